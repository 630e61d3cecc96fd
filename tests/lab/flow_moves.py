"""A scenario the forwarding lab suites share (test_e2e_ipv6, test_e2e_tunnel)."""

from __future__ import annotations

from hpclb.lab.appliance import LAB_PORT, LabAppliance
from hpclb.lab.topology import Lab


def check_a_backend_down_moves_only_its_flows(lab: Lab, appliance: LabAppliance, vip: str,
                                              ports: str, backends: set[str]) -> None:
    """UDP flows from the client's ``ports`` to vip spread over every backend;
    b2 set down moves b2's flows, all of them and no other; b2 is set up again
    whatever happened."""
    before = lab.udp_flows(vip, LAB_PORT, ports)
    assert set(before.values()) == backends
    try:
        appliance.set_state("b2", "down")
        after = lab.udp_flows(vip, LAB_PORT, ports)
        moved = [p for p in before if before[p] != after[p]]
        assert moved and all(before[p] == "b2" for p in moved), "only b2's flows moved"
        assert len(moved) == list(before.values()).count("b2")
        assert "b2" not in after.values()
    finally:
        appliance.set_state("b2", "up")
