"""A real TRex server (built by perf/trex/build_trex.sh, named by $HPCLB_TREX_DIR)
drives the lab: the reflector and hpclb's XDP data plane forward TRex's frames back
into TRex port 0, the latency stream comes back with an HDR histogram, and closing
the generator stops the server and puts the appliance's cable back on the bridge.
Skipped, with the reason, where no TRex is built. Never a speed assertion."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest

from hpclb.lab import trex

pytestmark = pytest.mark.root


def _need_trex() -> None:
    if os.geteuid() != 0:
        pytest.skip("the lab needs root (network namespaces)")
    if (why := trex.available()) is not None:
        pytest.skip(why)
    from hpclb.host import install

    try:
        for output in ("reflect.bpf.o", "pass.bpf.o", "hpclb-xdp"):
            install.find(output)
    except Exception as err:  # the data plane's build is not there
        pytest.skip(f"no data plane build: {err}")


def _on_bridge(lab, ifname: str) -> bool:
    return "master br0" in lab.exec("br", ["ip", "-o", "link", "show", ifname]).stdout


def test_trex_drives_reflector_and_xdp_appliance(tmp_path: Path) -> None:
    _need_trex()
    from hpclb.host import install
    from hpclb.lab.appliance import LabAppliance
    from hpclb.lab.topology import ETH, Lab

    prefix = "t" + secrets.token_hex(3)
    with Lab(prefix=prefix, backends=3) as lab:
        lab.attach_xdp("lb", ETH, install.find("reflect.bpf.o"))
        gen = trex.TrexGenerator(lab, tmp_path, flows=1000)
        pid = gen.server.proc.pid if gen.server and gen.server.proc else None
        try:
            assert not _on_bridge(lab, lab.peer("lb"))  # TRex holds the cable
            t = gen.trial(5000, 2)
            assert t.offered > 0 and t.forwarded > 0, t.to_json()
            assert t.rate_pps == 5000
            assert t.latency is not None, t.extra
            for key in trex.LATENCY_KEYS:
                assert t.latency[key] > 0, t.latency
            assert t.latency["min_us"] <= t.latency["p50_us"] <= t.latency["p999_us"]
            assert t.latency["p999_us"] <= t.latency["max_us"] * 1.001
            assert t.extra["latency_frames"]["rx"] > 0
            full = gen.trial(None, 1)
            assert full.rate_pps is None and gen.line_rate_pps > 0
            lab.detach_xdp("lb", ETH)
            # The real appliance, XDP data plane, static MACs (no bridge needed).
            (tmp_path / "app").mkdir()
            app = LabAppliance(lab, tmp_path / "app", {"b1": 1.0, "b2": 1.0, "b3": 1.0},
                               static_macs=True)
            try:
                app.start()
                t = gen.trial(5000, 2)
                assert t.forwarded > 0 and t.latency is not None, t.to_json()
                assert t.extra["appliance_xdp"].get("xdp_tx", 0) > 0, t.extra
            finally:
                app.stop()
            cond = gen.conditions()
            assert cond["generator"].startswith("TRex") and cond["profile"] == "udp64"
        finally:
            gen.close()
        assert _on_bridge(lab, lab.peer("lb"))
        if pid is not None:
            assert not Path(f"/proc/{pid}").exists()
        # TRex's DPDK runtime directory goes with the server.
        assert not Path(f"/var/run/dpdk/hpclb-trex-{prefix}").exists()
    assert lab.existing_namespaces(prefix) == []


def test_trex_server_stops_when_the_client_fails(tmp_path: Path) -> None:
    """A generator whose setup fails after the server started (a bad profile
    tunable) stops the server and restores the wiring before raising."""
    _need_trex()
    from hpclb.lab.topology import Lab

    prefix = "t" + secrets.token_hex(3)
    with Lab(prefix=prefix, backends=1) as lab:
        with pytest.raises(trex.TrexError, match="flows"):
            trex.TrexGenerator(lab, tmp_path, tunables={"flows": 0})
        assert _on_bridge(lab, lab.peer("lb"))
        left = lab.exec("br", ["ss", "-Hltn", f"sport = :{trex.ZMQ_RPC_PORT}"]).stdout
        assert left.strip() == ""
