"""Probe configuration, rise/fall thresholds and flap damping (pure, time driven by hand)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from hpclb.config.probes import DampingConfig, ProbeConfig
from hpclb.health import Damper, HealthState

NO_DAMPING = {"enabled": False}


def state(**kw: object) -> HealthState:
    return HealthState(ProbeConfig(**kw))  # type: ignore[arg-type]


REASONS = {"o": "ok", "x": "timeout", "u": "socket: Too many open files"}


def feed(h: HealthState, results: str, start: float = 0.0, step: float = 1.0
         ) -> list[tuple[int, bool, str]]:
    """Feed 'o' (ok) / 'x' (fail) / 'u' (unknown: a local error) results one `step`
    apart; the transitions, with the index of the result that caused each."""
    out = []
    for i, c in enumerate(results):
        verdict = h.record(c == "o", REASONS[c], start + i * step, local=c == "u")
        if verdict is not None:
            out.append((i, *verdict))
    return out


# --- configuration -----------------------------------------------------------------


def test_config_defaults() -> None:
    c = ProbeConfig()
    assert (c.kind, c.interval_s, c.timeout, c.rise, c.fall, c.initial) == \
        ("icmp", 5.0, 2.0, 2, 3, "up")
    assert c.expect_status == ((200, 399),) and c.path == "/"
    d = c.damping
    assert (d.enabled, d.penalty, d.half_life_s, d.suppress, d.reuse, d.max_suppress_s) == \
        (True, 1000.0, 60.0, 2500.0, 800.0, 300.0)
    assert ProbeConfig(interval_s=0.5).timeout == 0.5  # default capped at the interval
    assert ProbeConfig(kind="http").effective_port == 80
    assert ProbeConfig(kind="https").effective_port == 443
    assert ProbeConfig(kind="https", port=8443).effective_port == 8443
    tls = ProbeConfig(kind="https")
    assert (tls.verify, tls.ca_file, tls.server_name) == (True, None, None)
    assert ProbeConfig(kind="tcp", port=22).effective_port == 22


@pytest.mark.parametrize(("kw", "message"), [
    ({"interval_s": 0.05}, "greater than or equal to 0.1"),
    ({"interval_s": float("nan")}, "finite number"),
    ({"interval_s": 1.0, "timeout_s": 1.5}, "longer than interval_s"),
    ({"timeout_s": 0}, "greater than 0"),
    ({"kind": "tcp"}, "kind tcp needs a port"),
    ({"kind": "icmp", "port": 80}, "kind icmp takes no port"),
    ({"kind": "tcp", "port": 80, "path": "/x"}, "path only apply to kinds http and https"),
    ({"kind": "udp"}, "'icmp', 'tcp', 'http' or 'https'"),
    ({"kind": "http", "verify": False}, "verify only apply to kind https"),
    ({"kind": "tcp", "port": 1, "ca_file": "/ca.pem", "server_name": "x"},
     "ca_file, server_name only apply to kind https"),
    ({"kind": "https", "verify": False, "ca_file": "/ca.pem"}, "ignored with verify: false"),
    ({"kind": "https", "verify": "no"}, "valid boolean"),
    ({"kind": "https", "server_name": "a b"}, "should match pattern"),
    ({"kind": "http", "port": 0}, "greater than or equal to 1"),
    ({"kind": "http", "port": "80"}, "valid integer"),
    ({"kind": "http", "path": "no-slash"}, "should match pattern"),
    ({"kind": "http", "path": "/a\r\nX-Evil: 1"}, "should match pattern"),
    ({"kind": "http", "host": "a b"}, "should match pattern"),
    ({"kind": "http", "expect_status": "2xx"}, "not a status"),
    ({"kind": "http", "expect_status": "399-200"}, "reversed"),
    ({"kind": "http", "expect_status": [700]}, "within 100-599"),
    ({"kind": "http", "expect_status": []}, "at least one status"),
    ({"kind": "http", "expect_status": [True]}, "not an HTTP status"),
    ({"rise": 0}, "greater than or equal to 1"),
    ({"fall": 2.5}, "valid integer"),
    ({"initial": "maybe"}, "'up' or 'down'"),
    ({"retries": 3}, "Extra inputs are not permitted"),
    ({"damping": {"reuse": 3000}}, "must be below suppress"),
    ({"damping": {"max_suppress_s": 10}}, "raise max_suppress_s or lower suppress"),
    ({"damping": {"half_life_s": 0}}, "greater than 0"),
])
def test_config_rejects_bad_input_with_a_clear_message(kw: dict[str, Any], message: str
                                                        ) -> None:
    with pytest.raises(ValidationError, match=message):
        ProbeConfig(**kw)


def test_expect_status_forms() -> None:
    c = ProbeConfig(kind="http", expect_status=[200, "300-302", " 404 "])
    assert c.expect_status == ((200, 200), (300, 302), (404, 404))
    assert [s for s in (199, 200, 201, 301, 303, 404) if c.accepts(s)] == [200, 301, 404]
    # The serialised form reads back (what a dumped config holds).
    assert ProbeConfig.model_validate(c.model_dump()) == c
    assert ProbeConfig(kind="http", expect_status="204").expect_status == ((204, 204),)


def test_https_config_reads_back() -> None:
    c = ProbeConfig(kind="https", ca_file="/etc/hpclb/ca.pem", server_name="node1.cluster",
                    expect_status=204, path="/healthz")
    assert str(c.ca_file) == "/etc/hpclb/ca.pem" and c.effective_port == 443
    assert ProbeConfig.model_validate(c.model_dump()) == c
    # A dumped http configuration carries the TLS defaults and still loads.
    http = ProbeConfig(kind="http")
    assert ProbeConfig.model_validate(http.model_dump()) == http


def test_config_is_frozen() -> None:
    with pytest.raises(ValidationError):
        ProbeConfig().rise = 5  # type: ignore[misc]


# --- rise / fall -------------------------------------------------------------------


def test_fall_counts_consecutive_failures_exactly() -> None:
    h = state(fall=3, damping=NO_DAMPING)
    # Two failures, a success resets the run, then three in a row: down at the 3rd.
    assert feed(h, "xxoxxx") == [(5, False, "3 consecutive failures (last: timeout)")]
    assert (h.up, h.failures, h.successes) == (False, 3, 0)


def test_rise_counts_consecutive_successes_exactly() -> None:
    h = state(rise=2, fall=1, damping=NO_DAMPING)
    assert feed(h, "x") == [(0, False, "1 consecutive failures (last: timeout)")]
    assert feed(h, "oxoo") == [(3, True, "2 consecutive successes")]


@given(rise=st.integers(1, 6), fall=st.integers(1, 6),
       results=st.lists(st.booleans(), max_size=60))
def test_rise_fall_against_a_reference(rise: int, fall: int, results: list[bool]) -> None:
    h = state(rise=rise, fall=fall, damping=NO_DAMPING)
    up, run_ok, run_fail = True, 0, 0
    for i, ok in enumerate(results):
        run_ok, run_fail = (run_ok + 1, 0) if ok else (0, run_fail + 1)
        expected = up
        if not up and run_ok >= rise:
            expected = True
        if up and run_fail >= fall:
            expected = False
        verdict = h.record(ok, "r", float(i))
        assert (verdict is not None) == (expected != up)
        up = expected
        assert h.up == up


# --- unknown results -----------------------------------------------------------------


def test_unknown_results_neither_break_nor_extend_a_run() -> None:
    h = state(rise=2, fall=3, damping=NO_DAMPING)
    # Unknowns between failures do not reset the run (down at the 3rd failure)...
    assert feed(h, "xuuxuuux") == [(7, False, "3 consecutive failures (last: timeout)")]
    # ...nor count as one (fall 3 would be reached at index 2 otherwise), and
    # between successes they neither reset nor add.
    assert feed(h, "ouuuuo") == [(5, True, "2 consecutive successes")]
    assert (h.successes, h.failures) == (2, 0)
    assert feed(h, "u" * 50) == []
    assert h.up and (h.successes, h.failures) == (2, 0)


@given(rise=st.integers(1, 4), fall=st.integers(1, 4),
       results=st.text(alphabet="oxu", max_size=60))
def test_unknown_results_are_as_if_never_recorded(rise: int, fall: int, results: str) -> None:
    with_unknown = state(rise=rise, fall=fall, damping=NO_DAMPING)
    without = state(rise=rise, fall=fall, damping=NO_DAMPING)
    got = [(results[i], up, why) for i, up, why in feed(with_unknown, results)]
    judged = results.replace("u", "")
    want = [(judged[i], up, why) for i, up, why in feed(without, judged)]
    assert got == want
    assert (with_unknown.up, with_unknown.successes, with_unknown.failures) == \
        (without.up, without.successes, without.failures)


def test_unknown_results_never_charge_nor_release_damping() -> None:
    h = state(rise=1, fall=1)
    feed(h, "xox", step=1.0)  # three changes at t 0-2: penalty ~2970, suppressed
    assert h.damper.suppressed
    feed(h, "o", start=3.0)  # answers again: held out
    assert h.held_out and not h.up
    release = h.damper.release_time()
    assert release is not None
    # Long past the release time, unknown results alone release nothing, and
    # leave the penalty to decay as it would have.
    assert feed(h, "u" * 20, start=release + 1) == []
    assert h.held_out and h.damper.release_time() == release
    assert h.damper.penalty(release + 60) == pytest.approx(800 / 2)
    # The first judged result after it does.
    assert feed(h, "o", start=release + 30) == [(0, True,
                                                 "damping released (penalty below 800)")]
    # Unknowns on a healthy backend charge nothing either.
    feed(h, "uuuu", start=release + 31)
    assert h.damper.penalty(release + 31) == pytest.approx(800 * 2 ** (-31 / 60))


def test_initial_down_needs_rise_successes() -> None:
    h = state(initial="down", rise=3, damping=NO_DAMPING)
    assert not h.up
    assert feed(h, "ooo") == [(2, True, "3 consecutive successes")]


def test_reconfigure_keeps_the_verdict_and_restarts_runs() -> None:
    h = state(fall=3, damping=NO_DAMPING)
    feed(h, "xx")
    h.reconfigure(ProbeConfig(fall=2, damping=NO_DAMPING))
    assert h.up and h.failures == 0
    assert feed(h, "xx") == [(1, False, "2 consecutive failures (last: timeout)")]


# --- damping -----------------------------------------------------------------------


def test_damper_penalty_decays_with_the_half_life() -> None:
    d = Damper(DampingConfig(penalty=1000, half_life_s=10))
    assert d.penalty(0) == 0
    d.flap(100.0)
    assert d.penalty(100.0) == 1000
    assert d.penalty(110.0) == pytest.approx(500)
    assert d.penalty(130.0) == pytest.approx(125)
    assert d.penalty(50.0) == 1000  # a clock stepping back does not inflate it


def test_damper_penalty_is_capped_by_max_suppress() -> None:
    cfg = DampingConfig(penalty=1000, half_life_s=10, suppress=2000, reuse=500,
                        max_suppress_s=30)
    assert cfg.ceiling == pytest.approx(4000)  # 500 * 2^(30/10)
    d = Damper(cfg)
    for _ in range(50):
        d.flap(0.0)
    assert d.penalty(0.0) == pytest.approx(4000)
    # Held no longer than max_suppress_s: released as soon as it is below reuse.
    assert not d.release(29.9) and d.release(30.1)


def test_damping_suppresses_a_flapping_backend_and_releases_it_after_decay() -> None:
    # Defaults: penalty 1000, half-life 60 s, suppress 2500, reuse 800; rise 1,
    # fall 1 so that every result is a state change.
    h = state(rise=1, fall=1)
    t = 0.0
    assert h.record(False, "timeout", t) == (False, "1 consecutive failures (last: timeout)")
    t += 5
    assert h.record(True, "ok", t) == (True, "1 consecutive successes")  # penalty ~1944
    t += 5
    down = h.record(False, "timeout", t)  # ~2836 >= 2500: suppressed
    assert down is not None and down[0] is False and "held down" in down[1]
    assert h.damper.suppressed
    t += 5
    assert h.record(True, "ok", t) is None  # recovery held back
    assert (h.up, h.raw_up, h.held) == (False, True, 1)
    # Healthy from now on, probed every 5 s: held until the penalty decays below 800.
    penalty = h.damper.penalty(t)
    release_at = t + 60 * math.log2(penalty / 800)
    transitions = []
    while t < release_at + 30:
        t += 5
        verdict = h.record(True, "ok", t)
        if verdict is not None:
            transitions.append((t, verdict))
    assert len(transitions) == 1
    when, (up, why) = transitions[0]
    assert up and why == "damping released (penalty below 800)"
    assert release_at <= when < release_at + 5  # the first probe after the decay
    assert h.up and not h.damper.suppressed


def test_damper_release_time_is_when_the_penalty_crosses_reuse() -> None:
    d = Damper(DampingConfig(penalty=1000, half_life_s=10, suppress=2500, reuse=800))
    assert d.release_time() is None
    for t in (0.0, 1.0, 2.0):
        d.flap(t)
    assert d.suppressed
    release = d.release_time()
    assert release is not None
    assert d.penalty(release) == pytest.approx(800)
    assert release == pytest.approx(2.0 + 10 * math.log2(d.penalty(2.0) / 800))
    assert not d.release(release - 0.01) and d.release(release + 0.01)
    assert d.release_time() is None


def test_damping_never_delays_a_down() -> None:
    h = state(rise=1, fall=1, damping={"penalty": 3000})  # every change suppresses
    assert h.record(False, "refused", 0.0) is not None  # reported at once
    assert h.damper.suppressed and not h.up


def test_flapping_while_held_extends_the_hold() -> None:
    h = state(rise=1, fall=1)
    for i, ok in enumerate([False, True, False, True]):
        h.record(ok, "r", float(i))
    assert h.damper.suppressed
    p_before = h.damper.penalty(4.0)
    h.record(False, "r", 4.0)
    h.record(True, "r", 5.0)
    assert h.damper.penalty(5.0) > p_before and not h.up


def test_single_bounce_is_not_damped() -> None:
    h = state(rise=1, fall=1)
    assert feed(h, "xo", step=5.0) == [(0, False, "1 consecutive failures (last: timeout)"),
                                       (1, True, "1 consecutive successes")]
    assert not h.damper.suppressed


def test_damping_disabled_reports_every_change() -> None:
    h = state(rise=1, fall=1, damping=NO_DAMPING)
    assert len(feed(h, "xoxoxoxo")) == 8
