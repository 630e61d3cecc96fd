"""Operator pins and what the decider reports for the status and the REST API:
a pinned weight wins over configured x capacity x slow start for an UP backend,
never over health or the admin state, and expires by itself; the report carries
each backend's state, pool, configured weight, pin, weight inputs and the
recent health changes."""

from __future__ import annotations

from hpclb.config import parse_config
from hpclb.controller.backends import BackendDecider

from .test_backends import CONFIG, decision, msg


def decider() -> BackendDecider:
    return BackendDecider(parse_config(CONFIG))


def test_a_pin_sets_an_up_backends_weight_until_it_expires() -> None:
    d = decider()
    assert decision(d, "web", "w1", 100.0).weight == 3.0
    d.pin("w1", 0.5, until=160.0)
    assert decision(d, "web", "w1", 100.0).weight == 0.5
    assert d.ramps()  # the expiry changes decisions with no new input
    assert decision(d, "web", "w1", 160.0).weight == 3.0  # expired by itself
    assert "w1" not in d.pins


def test_a_pin_never_lifts_a_down_or_draining_backend() -> None:
    d = decider()
    d.pin("w1", 5.0, until=1e12)
    d.probe("w1", False, "timeout", 100.0)
    assert decision(d, "web", "w1", 101.0).weight == 0.0
    d.probe("w1", True, "answered", 102.0)
    assert decision(d, "web", "w1", 103.0).weight == 5.0  # no slow start under a pin
    d.pin("w1", None, 0.0)
    assert decision(d, "web", "w1", 103.0).weight < 3.0  # slow start again, unpinned


def test_the_report_carries_states_pins_inputs_and_transitions() -> None:
    d = decider()
    d.telemetry(msg("c1", 0.25, 1000.0), 0.4, mono=5.0, wall=1000.0)
    d.pin("c2", 1.5, until=2000.0)
    d.probe("w1", False, "timeout", 1001.0)
    report = d.report(1001.0)
    assert report["states"] == {"c1": "up", "c2": "up", "w1": "down"}
    assert report["pools"] == {"c1": "cpu", "c2": "cpu", "w1": "web"}
    assert report["configured_weights"] == {"c1": 2.0, "c2": 1.0, "w1": 3.0}
    assert report["pins"] == {"c2": {"weight": 1.5, "until": 2000.0}}
    inputs = report["inputs"]["c1"]
    assert inputs["cpu_load"] == 0.25 and inputs["rtt_ms"] == 0.4
    assert 0 < inputs["score"] < 1 and inputs["age_s"] == 1.0
    assert report["transitions"] == [
        {"backend": "w1", "up": False, "reason": "probe: timeout", "time": 1001.0}]


def test_a_backend_removed_from_the_configuration_loses_its_pin_and_inputs() -> None:
    d = decider()
    d.telemetry(msg("c1", 0.25, 1000.0), 0.4, mono=5.0, wall=1000.0)
    d.pin("c1", 1.0, until=2000.0)
    d.reconfigure(parse_config(CONFIG.replace(
        "      - {name: c1, address: 198.18.0.11, weight: 2}\n", "")))
    assert "c1" not in d.pins and "c1" not in d.samples
