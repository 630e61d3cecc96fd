"""Every TRex profile builds and serialises (STLProfile.to_json) in the TRex client's
own interpreter (lbr-trex-client, .venv-trex), through perf/trex/driver.py, as the
bench runs it: the control plane never imports the client. No TRex server needed."""

from __future__ import annotations

import base64
import json
import subprocess

import pytest

from hpclb.lab import trex

pytestmark = pytest.mark.skipif(
    trex.client_problem() is not None, reason=str(trex.client_problem()))

TUNABLES = {"dst_mac": "02:48:4c:00:00:03", "src_mac": "02:48:4c:00:00:02",
            "dst_ip": "198.18.1.10", "vip_port": 8080, "flows": 1000, "pg_id": 5,
            "lat_pps": 500}


def _frame(stream: dict) -> bytes:
    return base64.b64decode(stream["packet"]["binary"])


def _rates(profile: dict) -> list[float]:
    return [s["mode"]["rate"]["value"] for s in profile["profile"]]


@pytest.mark.parametrize("name", ["udp64", "imix", "syn"])
def test_load_profiles_build_with_a_latency_stream_and_the_total_rate(name: str) -> None:
    got = trex.build_profile(name, TUNABLES, rate_pps=100_000)
    streams = got["profile"]
    assert got["streams"][-1] == "latency"
    lat = streams[-1]
    assert lat["flow_stats"]["enabled"] and lat["flow_stats"]["rule_type"] == "latency"
    assert lat["flow_stats"]["stream_id"] == 5
    assert lat["mode"]["rate"] == {"type": "pps", "value": 500.0}
    # The total asked for is the port's: load streams get what the latency one leaves.
    assert sum(_rates(got)) == pytest.approx(100_000)
    for s in streams:
        frame = _frame(s)
        assert frame[:6] == bytes.fromhex("02484c000003")  # to the appliance
        assert frame[6:12] == bytes.fromhex("02484c000002")
        assert frame[30:34] == bytes([198, 18, 1, 10])  # the VIP
        assert int.from_bytes(frame[36:38], "big") == 8080
    json.dumps(got)  # serialisable as the server takes it


def test_udp64_frames_are_60_bytes_and_walk_addresses_and_ports() -> None:
    got = trex.build_profile("udp64", {**TUNABLES, "src_ip": "198.18.0.224", "src_ips": 4},
                             rate_pps=10_000)
    load = got["profile"][0]
    assert len(_frame(load)) == 60  # 64 on the wire with the FCS
    assert _frame(load)[23] == 17  # UDP
    instrs = load["vm"]["instructions"]
    tuple_gen = next(i for i in instrs if i["type"] == "tuple_flow_var")
    # 1000 flows over 4 addresses: 250 ports each.
    assert tuple_gen["ip_min"] == int.from_bytes(bytes([198, 18, 0, 224]), "big")
    assert tuple_gen["ip_max"] == int.from_bytes(bytes([198, 18, 0, 227]), "big")
    assert (tuple_gen["port_min"], tuple_gen["port_max"]) == (1024, 1273)
    assert {i["type"] for i in instrs} >= {"write_flow_var", "fix_checksum_ipv4"}


def test_imix_sizes_and_ratio() -> None:
    got = trex.build_profile("imix", TUNABLES, rate_pps=48_500)
    sizes = [len(_frame(s)) + 4 for s in got["profile"][:3]]
    assert sizes == [64, 594, 1518]
    assert _rates(got)[:3] == pytest.approx([28_000, 16_000, 4_000])


def test_syn_frames_new_flow_each_and_bursts() -> None:
    got = trex.build_profile("syn", {**TUNABLES, "burst": 64, "ibg_us": 1000},
                             rate_pps=10_000)
    syn = got["profile"][0]
    frame = _frame(syn)
    assert frame[23] == 6 and frame[47] == 0x02  # TCP, SYN only
    # 64 bytes on the wire, the SYN itself without data (IP length 40): the rest is
    # Ethernet padding, kept (TRex would take a trailing Padding for an FCS).
    assert len(frame) == 60 and int.from_bytes(frame[16:18], "big") == 40
    assert syn["mode"]["type"] == "multi_burst" and syn["mode"]["pkts_per_burst"] == 64
    types = [i["type"] for i in syn["vm"]["instructions"]]
    assert "tuple_flow_var" in types and "fix_checksum_hw" in types
    cont = trex.build_profile("syn", TUNABLES, rate_pps=10_000)["profile"][0]
    assert cont["mode"]["type"] == "continuous"


def test_latency_profile_alone_and_no_latency_when_zero() -> None:
    got = trex.build_profile("latency", TUNABLES)
    assert got["streams"] == ["latency"]
    got = trex.build_profile("udp64", {**TUNABLES, "lat_pps": 0}, rate_pps=1000)
    assert got["streams"] == ["udp64"]


def test_bad_tunables_and_unknown_commands_answer_errors(tmp_path) -> None:
    with pytest.raises(trex.TrexError, match="flows"):
        trex.build_profile("udp64", {**TUNABLES, "flows": 0})
    driver = trex.TrexDriver(tmp_path)
    try:
        with pytest.raises(trex.TrexError, match="unknown command"):
            driver.request({"cmd": "format_disk"})
        with pytest.raises(trex.TrexError, match="before connect"):
            driver.request({"cmd": "trial", "rate_pps": 1, "seconds": 1})
    finally:
        driver.close()
    assert driver.proc.poll() is not None


def test_driver_never_imported_by_the_control_plane() -> None:
    # The client's scapy/zmq stay in their own interpreter.
    code = ("import sys, hpclb.lab.trex; "
            "sys.exit(any(m.startswith(('lbr_trex_client', 'trex')) for m in sys.modules))")
    assert subprocess.run([__import__("sys").executable, "-c", code]).returncode == 0
