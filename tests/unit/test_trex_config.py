"""trex_cfg.yaml renders to valid YAML with the lab's interfaces, MACs and low_end;
the TRex tree and client are found (or not) as documented. No TRex needed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hpclb.lab import trex
from hpclb.lab.trex import TrexPort, lab_ports, render_trex_cfg


class _FakeLab:
    prefix = "tx1"

    @staticmethod
    def peer(role: str) -> str:
        return f"v-{role}"

    def mac(self, role: str) -> str:
        return {"lb": "02:48:4c:00:00:03", "cli": "02:48:4c:00:00:02"}[role]


def _cfg(text: str) -> dict:
    doc = yaml.safe_load(text)
    assert isinstance(doc, list) and len(doc) == 1
    return doc[0]


def test_lab_config_one_af_packet_port_on_the_appliance_cable_and_a_dummy() -> None:
    cfg = _cfg(render_trex_cfg(lab_ports(_FakeLab()), prefix="hpclb-tx1", low_end_core=0))
    assert cfg["version"] == 2
    # A name without ':' is an af_packet vdev for TRex; "dummy" pairs it.
    assert cfg["interfaces"] == ["v-lb", "dummy"]
    assert cfg["port_limit"] == 2
    assert cfg["low_end"] is True and cfg["low_end_core"] == 0
    assert cfg["prefix"] == "hpclb-tx1"
    assert (cfg["zmq_rpc_port"], cfg["zmq_pub_port"]) == (4501, 4500)
    # Port 0 sends as the client, to the appliance.
    assert cfg["port_info"][0] == {"src_mac": "02:48:4c:00:00:02",
                                   "dest_mac": "02:48:4c:00:00:03"}
    assert len(cfg["port_info"]) == 2


def test_even_port_list_is_kept_and_options_render() -> None:
    ports = [TrexPort("eth1", "02:00:00:00:00:01", "02:00:00:00:00:02"),
             TrexPort("eth2", "02:00:00:00:00:02", "02:00:00:00:00:01")]
    cfg = _cfg(render_trex_cfg(ports, prefix="p", zmq_rpc_port=5501, zmq_pub_port=5500,
                               limit_memory=512))
    assert cfg["interfaces"] == ["eth1", "eth2"]
    assert cfg["zmq_rpc_port"] == 5501 and cfg["limit_memory"] == 512
    assert "low_end_core" not in cfg and cfg["low_end"] is True
    assert [p["src_mac"] for p in cfg["port_info"]] == ["02:00:00:00:00:01",
                                                        "02:00:00:00:00:02"]


def test_without_low_end_no_low_end_keys() -> None:
    cfg = _cfg(render_trex_cfg([TrexPort("eth1", "02:00:00:00:00:01", "02:00:00:00:00:02")],
                               prefix="p", low_end=False))
    assert "low_end" not in cfg
    with pytest.raises(ValueError):
        render_trex_cfg([TrexPort("a", "x", "y")], prefix="p", low_end=False, low_end_core=0)
    with pytest.raises(ValueError):
        render_trex_cfg([], prefix="p")


def test_trex_dir_found_from_root_or_scripts(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HPCLB_TREX_DIR", raising=False)
    assert trex.find_trex_dir() is None
    assert trex.available() == trex.NO_TREX
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    assert trex.find_trex_dir(tmp_path) is None  # not built: no binary
    (scripts / "t-rex-64").write_text("#!/bin/sh\n")
    (scripts / "_t-rex-64").write_text("")
    assert trex.find_trex_dir(tmp_path) == scripts.resolve()
    assert trex.find_trex_dir(scripts) == scripts.resolve()
    monkeypatch.setenv("HPCLB_TREX_DIR", str(tmp_path))
    assert trex.find_trex_dir() == scripts.resolve()


def test_profiles_by_name_and_unknown_refused() -> None:
    for name in ("udp64", "imix", "syn", "latency"):
        assert trex.profile_path(name).name == f"{name}.py"
    with pytest.raises(trex.TrexError, match="no TRex profile"):
        trex.profile_path("nope")


def test_generator_needs_a_lab_or_a_server(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        trex.TrexGenerator(None, tmp_path)
    with pytest.raises(ValueError, match="IPv4"):
        trex.TrexGenerator(None, tmp_path, server="h", vip="fd48:4c01::10")
