"""The BFD state of each BGP session in the metrics: a series per session only
when the status says BFD is enabled (bgp.bfd), 1 while it is Up."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from hpclb.faces.metrics import StatusCollector


def metrics(bgp: dict[str, Any]) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatusCollector(lambda: {"bgp": bgp}))
    return generate_latest(registry).decode()


def sessions(bfd: bool) -> list[dict[str, Any]]:
    extra = [{"bfd": "Up"}, {"bfd": "Down"}] if bfd else [{}, {}]
    return [{"name": "tor1", "peer": "10.99.0.2", "state": "Established", "established": True,
             **extra[0]},
            {"name": "tor2", "peer": "10.99.0.3", "state": "Active", "established": False,
             **extra[1]}]


def test_bfd_state_per_session_when_enabled() -> None:
    text = metrics({"reachable": True, "bfd": True, "sessions": sessions(True)})
    assert 'hpclb_bgp_bfd_up{address="10.99.0.2",peer="tor1",state="Up"} 1.0' in text
    assert 'hpclb_bgp_bfd_up{address="10.99.0.3",peer="tor2",state="Down"} 0.0' in text


def test_no_bfd_series_without_bfd() -> None:
    text = metrics({"reachable": True, "bfd": False, "sessions": sessions(False)})
    assert "hpclb_bgp_bfd_up" not in text
    assert 'hpclb_bgp_session_up{address="10.99.0.2",peer="tor1",state="Established"} 1.0' in text
