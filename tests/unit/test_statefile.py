"""The control plane's state checkpoint (controller/statefile.py): the file
format, atomic writes that always leave one good file, corruption and
truncation detected and the previous file used, and the restore of the
decider's state (health, trackers, pins, samples) all or nothing, continuing
with the same decisions and weights."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpclb.balancing.weights import WeightTracker
from hpclb.config import parse_config
from hpclb.config.weights import WeightPolicy
from hpclb.contract.tables import BackendState
from hpclb.controller import statefile
from hpclb.controller.backends import BackendDecider
from hpclb.controller.statefile import (
    CURRENT,
    PREVIOUS,
    Snapshot,
    StateKeeper,
    decode_ring,
    encode_ring,
    load_state,
    write_state,
)
from hpclb.health.backend import BackendHealth
from hpclb.telemetry.message import TelemetryMessage

from .test_backends import FLEET, apply_event

# The decider suite's fleet, with a probe on the static pool and a second web node.
CONFIG = FLEET.replace(
    "    policy: {slow_start_s: 8}\n",
    "    policy: {slow_start_s: 8}\n    probe: {kind: tcp, port: 80, rise: 2}\n").replace(
    "      - {name: w1, address: 198.18.0.21, weight: 3}\n",
    "      - {name: w1, address: 198.18.0.21, weight: 3}\n"
    "      - {name: w2, address: 198.18.0.22}\n")
T0 = 1.7e9


def msg(node: str, cpu: float, t: float) -> TelemetryMessage:
    return TelemetryMessage(node=node, time=t, seq=int(t * 10), interval_s=1.0, cpu_load=cpu,
                            mem_used=1.0, mem_total=4.0, numa_nodes=1)


def busy_decider(config: str = CONFIG) -> BackendDecider:
    """A decider with something in every part of its state: samples and a
    rate-limited ramp in flight, a backend down by its probe, one back up (slow
    start), a pin."""
    d = BackendDecider(parse_config(config))
    for i in range(6):
        t = T0 + i
        d.telemetry(msg("c1", 0.1 + 0.12 * i, t), rtt_ms=1.0, mono=100.0 + i, wall=t)
        d.telemetry(msg("c2", 0.3, t), rtt_ms=None, mono=100.0 + i, wall=t)
    d.probe("w2", False, "refused", T0 + 2)
    d.probe("c2", False, "timeout", T0 + 3)
    d.probe("c2", True, "answers", T0 + 5)
    d.pin("w1", 0.5, T0 + 3600)
    return d


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    return json.loads(statefile.canonical(state))


# --- the file ------------------------------------------------------------------------


def test_a_written_state_loads_back_and_the_former_one_is_kept(tmp_path: Path) -> None:
    first = {"revision": "a" * 16, "x": [1, 2.5, None, "é"], "f": 0.1 + 0.2}
    second = {**first, "revision": "b" * 16}
    assert load_state(tmp_path) == statefile.LoadedState(None, None, [])  # first start
    write_state(tmp_path, first)
    write_state(tmp_path, second)
    loaded = load_state(tmp_path)
    assert (loaded.body, loaded.source, loaded.problems) == (second, "current", [])
    assert loaded.fallback == first
    assert loaded.body is not None and loaded.body["f"] == 0.1 + 0.2  # floats bit for bit
    assert not (tmp_path / statefile.TEMPORARY).exists()
    envelope = json.loads((tmp_path / CURRENT).read_bytes())
    assert envelope["version"] == statefile.STATE_VERSION and len(envelope["sha256"]) == 64


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "version", "garbage"])
def test_a_damaged_current_file_is_reported_and_the_previous_one_used(
        tmp_path: Path, damage: str) -> None:
    good, newer = {"n": 1, "text": "pools: {}"}, {"n": 2, "text": "pools: {a: 1}"}
    write_state(tmp_path, good)
    write_state(tmp_path, newer)
    path = tmp_path / CURRENT
    data = bytearray(path.read_bytes())
    if damage == "flip":  # one byte of the body's text: still JSON, wrong checksum
        i = data.index(b"a: 1")
        data[i] ^= 0x02
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "empty":
        data = bytearray()
    elif damage == "version":
        data = data.replace(b'"version": 1', b'"version": 9')
    else:
        data = bytearray(b'{"something": "else"}')
    path.write_bytes(bytes(data))
    loaded = load_state(tmp_path)
    assert (loaded.body, loaded.source) == (good, "previous")
    [problem] = loaded.problems
    expected = {"flip": "checksum mismatch", "truncate": "truncated", "empty": "empty",
                "version": "format version 9", "garbage": "not a state checkpoint"}[damage]
    assert str(path) in problem and expected in problem, problem


def test_both_files_bad_is_no_state_with_both_problems(tmp_path: Path) -> None:
    write_state(tmp_path, {"n": 1})
    write_state(tmp_path, {"n": 2})
    for name in (CURRENT, PREVIOUS):
        data = (tmp_path / name).read_bytes()
        (tmp_path / name).write_bytes(data[:-10])
    loaded = load_state(tmp_path)
    assert loaded.body is None and loaded.source is None
    assert len(loaded.problems) == 2 and all("truncated" in p for p in loaded.problems)


@pytest.mark.parametrize("rot", ["zeros", "flip"])
def test_a_corrupt_current_file_never_pushes_out_the_good_previous_one(
        tmp_path: Path, rot: str) -> None:
    write_state(tmp_path, {"n": 1})
    write_state(tmp_path, {"n": 2, "s": "abc"})
    path = tmp_path / CURRENT
    if rot == "zeros":
        path.write_bytes(b"\x00" * 40)  # rotted on disk
    else:  # one bit, where the check before a write hashes the bytes as they are
        path.write_bytes(path.read_bytes().replace(b"abc", b"abd"))
    write_state(tmp_path, {"n": 3})
    assert json.loads((tmp_path / PREVIOUS).read_bytes())["body"] == {"n": 1}
    (tmp_path / CURRENT).write_bytes(b"{")
    assert load_state(tmp_path).body == {"n": 1}


class Crash(BaseException):
    """A kill -9 in the middle of a write (not an Exception: nothing catches it)."""


@pytest.mark.parametrize("step", ["fsync_file", "replace_current", "replace_tmp", "fsync_dir"])
@pytest.mark.parametrize("kind", [OSError, Crash])
def test_a_write_that_fails_at_any_step_leaves_a_good_state(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str,
        kind: type[BaseException]) -> None:
    """With two good files already there, a write that fails (OSError: a full
    disk) or stops dead (a crash) at each of its steps leaves a loadable
    state: the last one written before, or the new one, never the oldest."""
    for n in (1, 2):
        write_state(tmp_path, {"n": n})
    calls = {"fsync": 0, "replace": 0}
    real_fsync, real_replace = os.fsync, os.replace
    target = {"fsync_file": ("fsync", 1), "fsync_dir": ("fsync", 2),
              "replace_current": ("replace", 1), "replace_tmp": ("replace", 2)}[step]

    def maybe_fail(name: str) -> None:
        calls[name] += 1
        if (name, calls[name]) == target:
            raise kind(f"simulated failure at {step}")

    def fsync(fd: int) -> None:
        maybe_fail("fsync")
        real_fsync(fd)

    def replace(src: Any, dst: Any) -> None:
        maybe_fail("replace")
        real_replace(src, dst)

    monkeypatch.setattr(statefile.os, "fsync", fsync)
    monkeypatch.setattr(statefile.os, "replace", replace)
    with pytest.raises(kind):
        write_state(tmp_path, {"n": 3})
    monkeypatch.undo()
    loaded = load_state(tmp_path)
    assert loaded.body is not None
    assert loaded.body["n"] == (3 if step == "fsync_dir" else 2), loaded
    if step == "replace_tmp":  # between the renames: only the previous file is there
        assert loaded.source == "previous" and "missing" in loaded.problems[0]
    write_state(tmp_path, {"n": 4})  # and the next write goes through
    assert load_state(tmp_path).body == {"n": 4}


def test_rings_travel_compact_and_checked() -> None:
    ring = np.random.default_rng(1).integers(0, 40, 65537).astype(np.uint32)
    enc = encode_ring(ring)
    assert enc["len"] == 65537 and len(enc["zlib_b64"]) < ring.nbytes
    back = decode_ring(json.loads(json.dumps(enc)))
    assert back.dtype == np.dtype("<u4") and np.array_equal(back, ring)
    wide = ring.astype(np.uint32) + 70000  # ids above 65535: stored as uint32
    assert encode_ring(wide)["dtype"] == "<u4" and enc["dtype"] == "<u2"
    assert np.array_equal(decode_ring(encode_ring(wide)), wide)
    other = encode_ring(ring[::-1].copy())
    with pytest.raises(ValueError, match="sha256"):
        decode_ring({**enc, "sha256": other["sha256"]})
    with pytest.raises(ValueError, match="slots"):
        decode_ring({**enc, "len": 7})
    with pytest.raises(ValueError, match="dtype"):
        decode_ring({**enc, "dtype": "<f8"})


# --- the decider's state -------------------------------------------------------------


def test_decider_round_trip_decides_the_same_now_and_later() -> None:
    a = busy_decider()
    b = BackendDecider(parse_config(CONFIG))
    assert b.from_state(roundtrip(a.to_state()), mono=500.0, now=T0 + 6) == []
    assert b.to_state() == a.to_state()
    for dt in (6.0, 7.5, 9.0, 20.0, 100.0):  # ramps and slow start continue alike
        assert b.all_decisions(T0 + dt) == a.all_decisions(T0 + dt)
    assert b.report(T0 + 7)["inputs"] == a.report(T0 + 7)["inputs"]
    # ... and both take the next samples alike.
    for d in (a, b):
        d.telemetry(msg("c1", 0.9, T0 + 8), rtt_ms=1.0, mono=600.0, wall=T0 + 8)
    assert b.all_decisions(T0 + 12) == a.all_decisions(T0 + 12)
    assert [d.state for d in b.decisions("web", T0 + 8)] == [BackendState.UP, BackendState.DOWN]
    assert b.decisions("web", T0 + 8)[0].weight == 0.5  # the pin


event = st.one_of(
    st.tuples(st.just("sample"), st.sampled_from(["c1", "c2", "w1"]), st.floats(-30, 60),
              st.floats(0, 1), st.one_of(st.none(), st.floats(0, 300))),
    st.tuples(st.just("probe"), st.sampled_from(["c1", "c2", "w1", "w2"]), st.booleans()),
)


def replay(d: BackendDecider, events: list[tuple[Any, ...]], start: float) -> float:
    now = start
    for i, ev in enumerate(events):
        now += 0.7
        apply_event(d, ev, i, now)
    return now


@settings(max_examples=40, deadline=None)
@given(before=st.lists(event, max_size=30), after=st.lists(event, max_size=15))
def test_a_restored_decider_continues_bit_for_bit(before: list[tuple[Any, ...]],
                                                  after: list[tuple[Any, ...]]) -> None:
    """Whatever happened before the checkpoint, a decider restored from it and
    the one that wrote it, fed the same events afterwards, decide the same
    states and weights to the bit."""
    a = BackendDecider(parse_config(CONFIG))
    now = replay(a, before, T0)
    b = BackendDecider(parse_config(CONFIG))
    b.from_state(roundtrip(a.to_state()), mono=now, now=now)
    end = replay(a, after, now)
    assert replay(b, after, now) == end
    for t in (now, end, end + 5, end + 60):
        da, db = a.all_decisions(t), b.all_decisions(t)
        assert [(x.name, x.state, x.weight.hex()) for ds in da.values() for x in ds] == \
            [(x.name, x.state, x.weight.hex()) for ds in db.values() for x in ds]


@pytest.mark.parametrize(("path", "value", "named"), [
    (("trackers", "cpu", "nodes", "c1", "goal"), "x", "trackers.cpu.nodes.c1.goal"),
    (("trackers", "cpu", "nodes", "c1", "smoothed"), 1 << 20, "trackers.cpu.nodes.c1.smoothed"),
    (("health", "w2", "up_since"), "yesterday", "health.w2.up_since"),
    (("health", "w2", "up"), True, "health.w2.up"),
    (("pins", "w1", "weight"), -1.0, "pins.w1.weight"),
    (("samples", "c1", "sample", "mem_total"), 0.0, "samples.c1.sample"),
    (("samples", "c2", "received"), None, "samples.c2.received"),
    (("transitions",), {"not": "a list"}, "transitions"),
])
def test_a_bad_field_restores_nothing_and_names_the_field(
        path: tuple[str, ...], value: Any, named: str) -> None:
    """Nothing starts half-restored: any bad field, even the last checked,
    leaves the decider exactly as it was."""
    state = roundtrip(busy_decider().to_state())
    node = state
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    fresh = BackendDecider(parse_config(CONFIG))
    fresh.probe("c1", False, "down before the restore", T0)
    before = copy.deepcopy(fresh.to_state())
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        fresh.from_state(state, mono=1.0, now=T0 + 6)
    assert fresh.to_state() == before


def test_a_changed_configuration_keeps_what_still_applies() -> None:
    """Backends gone, a pool whose policy changed, an expired pin: left out and
    named; the rest restored."""
    changed = (CONFIG.replace("      - {name: w2, address: 198.18.0.22}\n", "")
               .replace("alpha: 0.5", "alpha: 0.7"))
    a = busy_decider()
    a.pin("c1", 1.0, T0 + 10)
    b = BackendDecider(parse_config(changed))
    notes = b.from_state(roundtrip(a.to_state()), mono=1.0, now=T0 + 20)
    assert any("backends no longer configured: w2" in n for n in notes), notes
    assert any("pool cpu's policy changed" in n for n in notes), notes
    assert any("pins expired meanwhile: c1" in n for n in notes), notes
    assert b.pins == {"w1": (0.5, T0 + 3600)}
    assert "w2" not in b.health.snapshot() and b.health.up_since("c2") == T0 + 5
    assert b.trackers["cpu"].nodes() == []  # fresh: its policy changed


def test_health_round_trip_and_a_heard_agent_must_be_heard_again() -> None:
    h = BackendHealth(missed=3)
    h.heartbeat("a", 2.0, mono=10.0, wall=T0)
    h.probe("b", False, "refused", T0)
    h.probe("c", False, "refused", T0)
    h.probe("c", True, "answers", T0 + 1)
    state = roundtrip(h.to_state())
    r = BackendHealth(missed=3)
    r.from_state(state, mono=1000.0)
    assert r.snapshot() == h.snapshot() and r.up_since("c") == T0 + 1
    assert r.expire(mono=1005.0, wall=T0 + 9) == []  # counted from the restore
    [change] = r.expire(mono=1006.5, wall=T0 + 10)
    assert change.backend == "a" and not change.up
    # A grace longer than the missed intervals: the agent has that long to reconnect.
    g = BackendHealth(missed=3)
    g.from_state(state, mono=1000.0, grace_s=20.0)
    assert g.expire(mono=1019.5, wall=T0 + 9) == []
    [change] = g.expire(mono=1020.5, wall=T0 + 10)
    assert change.backend == "a" and not change.up


def test_tracker_refuses_state_of_another_policy() -> None:
    t = WeightTracker(WeightPolicy(alpha=0.5))
    with pytest.raises(ValueError, match="policy"):
        WeightTracker(WeightPolicy(alpha=0.6)).from_state(roundtrip(t.to_state()))


# --- the controller's side -----------------------------------------------------------


def snapshot(d: BackendDecider, revision: str = "r1",
             ring: np.ndarray | None = None) -> Snapshot:
    ring = np.arange(64, dtype=np.uint32) % 3 if ring is None else ring
    return Snapshot("gw", revision, CONFIG, d, d.all_decisions(T0 + 6),
                    {"web-tcp": (0, ring), "web-udp": (1, ring)}, {})


def test_keeper_restores_and_falls_back_with_an_alarm(tmp_path: Path) -> None:
    writer = StateKeeper(tmp_path)
    a = busy_decider()
    assert writer.write(snapshot(a), mono=1.0, wall=T0 + 6)
    a.pin("w1", 0.25, T0 + 3600)
    assert writer.write(snapshot(a), mono=2.0, wall=T0 + 7)
    body = json.loads((tmp_path / CURRENT).read_bytes())["body"]
    assert len(body["pushed"]["rings"]) == 1  # two VIPs, one ring stored
    (tmp_path / CURRENT).write_bytes((tmp_path / CURRENT).read_bytes()[:-100])

    keeper = StateKeeper(tmp_path)
    b = BackendDecider(parse_config(CONFIG))
    restored = keeper.restore(b, parse_config(CONFIG), "r1", mono=5.0, wall=T0 + 8)
    assert keeper.source_at_start == "previous" and restored.same_config
    assert b.pins["w1"] == (0.5, T0 + 3600)  # the previous file's pin
    assert np.array_equal(restored.rings["web-udp"], np.arange(64) % 3)
    [alarm] = keeper.alarms(mono=6.0)
    assert alarm["source"] == "checkpoint" and "truncated" in alarm["message"]
    assert keeper.status()["problems"] == keeper.problems != []

    # Both bad: nothing restored, said loudly, the decider untouched.
    (tmp_path / PREVIOUS).write_bytes(b"{}")
    keeper = StateKeeper(tmp_path)
    c = BackendDecider(parse_config(CONFIG))
    assert keeper.restore(c, parse_config(CONFIG), "r1", 5.0, T0 + 8).rings == {}
    assert keeper.source_at_start is None and len(keeper.problems) == 2
    assert c.pins == {} and c.health.snapshot() == {}


def test_keeper_skips_a_checkpoint_that_fails_the_restore_for_the_previous(
        tmp_path: Path) -> None:
    keeper = StateKeeper(tmp_path)
    keeper.write(snapshot(busy_decider()), 1.0, T0 + 6)
    bad = roundtrip(statefile.snapshot_body(snapshot(busy_decider()), T0 + 7))
    bad["decider"]["pins"]["w1"]["until"] = "never"
    write_state(tmp_path, bad)  # a valid file whose content does not restore
    b = BackendDecider(parse_config(CONFIG))
    keeper = StateKeeper(tmp_path)
    keeper.restore(b, parse_config(CONFIG), "r1", 5.0, T0 + 8)
    assert keeper.source_at_start == "previous"
    assert any("pins.w1.until" in p for p in keeper.problems), keeper.problems
    assert b.pins == {"w1": (0.5, T0 + 3600)}


def test_keeper_writes_on_a_change_at_most_once_a_second_and_on_the_interval(
        tmp_path: Path) -> None:
    keeper = StateKeeper(tmp_path)
    d = busy_decider()
    keeper.write(snapshot(d), mono=100.0, wall=T0)
    written = [keeper.written_at]

    def tick(mono: float) -> None:
        keeper.tick(snapshot(d), mono, T0 + mono, interval_s=3600.0)
        if keeper.written_at != written[-1]:
            written.append(keeper.written_at)

    tick(100.5)
    assert len(written) == 1  # nothing changed
    d.pin("c1", 0.3, T0 + 9999)
    tick(100.6)  # changed, but within the second: coalesced
    d.pin("c2", 0.3, T0 + 9999)
    tick(100.9)
    assert len(written) == 1
    tick(101.1)
    assert len(written) == 2  # both pins in one write
    assert set(load_state(tmp_path).body["decider"]["pins"]) == {"w1", "c1", "c2"}  # type: ignore[index]
    tick(2000.0)
    assert len(written) == 2  # unchanged, within the interval
    tick(3701.2)
    assert len(written) == 3  # the interval


def test_a_failed_write_is_an_alarm_until_one_succeeds(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    keeper = StateKeeper(blocker)
    assert not keeper.write(snapshot(busy_decider()), 1.0, T0)
    [alarm] = keeper.alarms(2.0)
    assert alarm["source"] == "checkpoint" and "cannot write" in alarm["message"]
    keeper.folder = tmp_path / "state"
    keeper.tick(snapshot(busy_decider()), 3.0, T0 + 3, 3600.0)  # retried at once
    assert keeper.alarms(4.0) == [] and keeper.written_at == T0 + 3


def test_a_backend_restored_failing_its_probe_returns_after_rise_successes(
        tmp_path: Path) -> None:
    """The probe thread starts from "up" and tells no change for a backend that
    answers: the restored DOWN is lifted once it saw `rise` successes, and a
    backend still failing stays DOWN without a flap."""
    keeper = StateKeeper(tmp_path)
    keeper.write(snapshot(busy_decider()), 1.0, T0 + 6)
    config = parse_config(CONFIG)
    d = BackendDecider(config)
    keeper = StateKeeper(tmp_path)
    keeper.restore(d, config, "r1", 5.0, T0 + 8)
    assert not d.health.is_up("w2")
    assert keeper.reconcile_probes(d, {"w2": {"up": True, "successes": 1}}, config, T0 + 9) == []
    [change] = keeper.reconcile_probes(d, {"w2": {"up": True, "successes": 2}}, config, T0 + 10)
    assert change.backend == "w2" and change.up and d.health.is_up("w2")
    assert d.transitions[-1] == change
    # Still failing: the thread's own verdict goes down, no change here, none later.
    d2 = BackendDecider(config)
    keeper2 = StateKeeper(tmp_path)
    keeper2.restore(d2, config, "r1", 5.0, T0 + 8)
    assert keeper2.reconcile_probes(d2, {"w2": {"up": False, "failures": 3}}, config,
                                    T0 + 9) == []
    assert keeper2.reconcile_probes(d2, {"w2": {"up": True, "successes": 5}}, config,
                                    T0 + 20) == []  # the thread itself tells this one
    assert not d2.health.is_up("w2")
