"""The telemetry message (docs/ARCHITECTURE.md, Contracts): round trip, strict
structure, lenient values.

Structure is rejected at decode with one exception type and a reason per family;
garbage *values* (NaN, negative, a ratio above 1) pass decode and are rejected,
counted and outlived by weights.WeightTracker, which is checked end to end here.
"""

from __future__ import annotations

import math
import random
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpclb.balancing.weights import WeightTracker
from hpclb.config.weights import WeightPolicy
from hpclb.controller.backends import to_node_sample
from hpclb.telemetry.message import (
    DECODE_REASONS,
    MAX_EXTRA,
    MAX_GPUS,
    MAX_MESSAGE_BYTES,
    CgroupStats,
    GpuStats,
    NumaMemory,
    TelemetryError,
    TelemetryMessage,
    decode,
    encode,
)

GiB = 2**30


def full_message(**kw: Any) -> TelemetryMessage:
    fields: dict[str, Any] = {
        "node": "gpu-node01.rack2", "time": 1_700_000_000.25, "seq": 42, "interval_s": 6.25,
        "cpu_load": 0.5, "mem_used": 10 * GiB, "mem_total": 64 * GiB, "numa_nodes": 2,
        "numa": (NumaMemory(node=0, mem_used=4 * GiB, mem_total=32 * GiB),
                 NumaMemory(node=1, mem_used=6 * GiB, mem_total=32 * GiB)),
        "cgroup": CgroupStats(path="/slurm/job_7", version=1, cpu_load=0.9, cpu_limit=4.0,
                              mem_used=2 * GiB, mem_limit=8 * GiB),
        "gpus": (GpuStats(index=0, name="H200", uuid="GPU-1", mem_used=10 * GiB,
                          mem_total=141 * GiB, util=0.3, numa_node=0),
                 GpuStats(index=1, mem_used=1 * GiB, mem_total=141 * GiB, util=None,
                          numa_node=None)),
        "extra": {"pmem_read_bytes_per_s": 1.5e9},
    }
    fields.update(kw)
    return TelemetryMessage(**fields)


def wire(**changes: Any) -> bytes:
    """A valid message's map with fields changed (or removed, with value ...)."""
    data = full_message().model_dump()
    for k, v in changes.items():
        if v is ...:
            del data[k]
        else:
            data[k] = v
    return msgpack.packb(data, use_bin_type=True)


def reason_of(payload: bytes) -> tuple[str, str]:
    with pytest.raises(TelemetryError) as info:
        decode(payload)
    assert info.value.reason in DECODE_REASONS
    return info.value.reason, str(info.value)


# --- round trip ----------------------------------------------------------------------


def test_round_trip_keeps_every_field() -> None:
    msg = full_message()
    payload = encode(msg)
    assert len(payload) < 1024  # 2 GPUs, 2 NUMA nodes: far below the cap
    assert decode(payload) == msg


def test_minimal_message_needs_no_optional_block() -> None:
    payload = msgpack.packb({"v": 1, "node": "n1", "time": 1.0, "seq": 0, "interval_s": 5,
                             "cpu_load": 0, "mem_used": 1, "mem_total": 2, "numa_nodes": 1})
    msg = decode(payload)
    assert msg.cgroup is None and msg.gpus == () and msg.numa == () and msg.extra == {}
    assert msg.cpu_load == 0.0  # an int is a number


# --- structure is rejected --------------------------------------------------------------


@pytest.mark.parametrize(("payload", "reason", "says"), [
    (b"", "msgpack", "msgpack"),
    (b"\xc1", "msgpack", "msgpack"),  # a byte msgpack never uses
    (msgpack.packb({"v": 1})[:-1], "msgpack", "incomplete"),
    (msgpack.packb({"v": 1}) + b"\x00", "msgpack", "extra data"),
    (msgpack.packb([1, 2]), "not_map", "array"),
    (msgpack.packb("v"), "not_map", "string"),
    (msgpack.packb({"node": "n1"}), "version", "None"),
    (msgpack.packb({"v": 2}), "version", "2"),
    (msgpack.packb({"v": True}), "version", "True"),
    (msgpack.packb({"v": "1"}), "version", "'1'"),
    (msgpack.packb({1: 1}), "msgpack", "map key"),
])
def test_not_a_message(payload: bytes, reason: str, says: str) -> None:
    got, text = reason_of(payload)
    assert got == reason
    assert says in text


@pytest.mark.parametrize(("changes", "says"), [
    ({"surprise": 1}, "surprise: Extra inputs"),
    ({"cpu_load": ...}, "cpu_load: Field required"),
    ({"cpu_load": "0.5"}, "cpu_load: Input should be a valid number"),
    ({"cpu_load": True}, "cpu_load: Input should be a valid number"),
    ({"seq": 1.0}, "seq: Input should be a valid integer"),
    ({"seq": -1}, "seq: Input should be greater than or equal to 0"),
    ({"node": b"n1"}, "node: Input should be a valid string"),
    ({"node": "../etc"}, "node: String should match pattern"),
    ({"node": "x" * 64}, "node: String should match pattern"),
    ({"interval_s": 0}, "interval_s: Input should be greater than 0"),
    ({"interval_s": math.nan}, "interval_s: Input should be a finite number"),
    ({"interval_s": 7200}, "interval_s: Input should be less than or equal to 3600"),
    ({"numa_nodes": 0}, "numa_nodes: Input should be greater than or equal to 1"),
    ({"numa": [{"node": 0, "mem_used": 1, "mem_total": 2}] * 2}, "NUMA node numbers repeat"),
    ({"numa": [{"node": -1, "mem_used": 1, "mem_total": 2}]}, "numa.0.node"),
    ({"gpus": [{"index": 0, "mem_used": 1, "mem_total": 2}] * (MAX_GPUS + 1)},
     "gpus: Tuple should have at most 64 items"),
    ({"gpus": [{"index": 0, "mem_total": 2}]}, "gpus.0.mem_used: Field required"),
    ({"gpus": {"index": 0}}, "gpus: Input should be a valid tuple"),
    ({"cgroup": {"path": "/x", "version": 3}}, "cgroup.version"),
    ({"extra": {"Bad Name": 1.0}}, "extra.Bad Name"),
    ({"extra": {"ok": "1"}}, "extra.ok: Input should be a valid number"),
    ({"extra": {f"m{i}": 1.0 for i in range(MAX_EXTRA + 1)}}, "extra: Dictionary should have"),
])
def test_bad_structure_is_a_schema_error(changes: dict[str, Any], says: str) -> None:
    reason, text = reason_of(wire(**changes))
    assert reason == "schema"
    assert says in text, text


def test_several_problems_are_named_in_one_line() -> None:
    _, text = reason_of(wire(cpu_load="a", mem_used="b", mem_total="c", seq="d", node=1))
    assert "\n" not in text
    assert "and 2 more" in text


def test_oversized_is_refused_before_parsing() -> None:
    payload = wire(extra={"big": 1.0}) + b"\x00" * MAX_MESSAGE_BYTES
    assert reason_of(payload)[0] == "oversized"
    assert decode(encode(full_message()), max_bytes=4096).node == "gpu-node01.rack2"
    with pytest.raises(TelemetryError) as info:
        decode(encode(full_message()), max_bytes=100)
    assert info.value.reason == "oversized"


def test_the_largest_valid_message_fits_the_cap() -> None:
    """Every list and string at its limit: what validates must also encode."""
    numa = tuple(NumaMemory(node=i, mem_used=1.5, mem_total=2.5) for i in range(1024))
    gpus = tuple(GpuStats(index=i, name="x" * 96, uuid="u" * 96, mem_used=1.5, mem_total=2.5,
                          util=0.5, numa_node=1023) for i in range(MAX_GPUS))
    cg = CgroupStats(path="p" * 4096, version=2, cpu_load=0.5, cpu_limit=0.5, mem_used=0.5,
                     mem_limit=0.5)
    msg = full_message(node="n" * 63, seq=2**64 - 1, numa_nodes=1024, numa=numa, gpus=gpus,
                       cgroup=cg, extra={f"m{i:02d}" + "x" * 59: 1.5 for i in range(MAX_EXTRA)})
    payload = encode(msg)
    assert MAX_MESSAGE_BYTES // 2 < len(payload) <= MAX_MESSAGE_BYTES
    assert decode(payload) == msg


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_raise_only_telemetry_error(payload: bytes) -> None:
    try:
        decode(payload)
    except TelemetryError:
        pass


_msgpackable = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                               max_size=4),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["v", "node", "time", "seq", "cpu_load", "gpus",
                                        "numa", "cgroup", "extra", "zzz"]), _msgpackable))
def test_random_maps_raise_only_telemetry_error(data: dict[str, Any]) -> None:
    try:
        decode(msgpack.packb({"v": 1, **data}))
    except TelemetryError:
        pass


def test_corrupted_real_messages_raise_only_telemetry_error() -> None:
    good = encode(full_message())
    rng = random.Random(4)
    for _ in range(2000):
        b = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        cut = rng.randrange(len(b) + 1)
        for payload in (bytes(b), bytes(b[:cut])):
            try:
                decode(payload)
            except TelemetryError:
                pass


# --- values are not judged at decode -------------------------------------------------


@pytest.mark.parametrize(("field", "value", "reason"), [
    ("cpu_load", math.nan, "non_finite"),
    ("cpu_load", -0.1, "negative"),
    ("cpu_load", 1.5, "ratio_above_1"),
    ("mem_used", math.inf, "non_finite"),
    ("mem_total", 0, "zero_total"),
    ("mem_used", 128 * GiB, "used_above_total"),
])
def test_garbage_values_pass_decode_and_weights_reject_them(field: str, value: float,
                                                            reason: str) -> None:
    tracker = WeightTracker(WeightPolicy(alpha=1.0, step=0.0, max_rate=None, slow_start_s=0))
    good = full_message(cgroup=None, time=100.0)
    assert tracker.observe(to_node_sample(decode(encode(good)), rtt_ms=1.0), now=100.0)
    before = tracker.weight("gpu-node01.rack2", now=100.0)

    bad = decode(wire(cgroup=None, time=101.0, **{field: value}))  # no exception
    got = getattr(bad, field)
    assert got == value or (math.isnan(got) and math.isnan(value))
    assert not tracker.observe(to_node_sample(bad, rtt_ms=1.0), now=101.0)
    assert tracker.rejection_counts()[reason] == 1
    assert tracker.weight("gpu-node01.rack2", now=101.0) == before  # last good value kept


def test_garbage_gpu_values_pass_decode() -> None:
    msg = decode(wire(gpus=[{"index": 0, "mem_used": -5, "mem_total": 1, "util": 7.0}]))
    assert msg.gpus[0].mem_used == -5.0 and msg.gpus[0].util == 7.0


# --- to_node_sample --------------------------------------------------------------------


def test_node_sample_without_cgroup_uses_the_host() -> None:
    s = to_node_sample(full_message(cgroup=None), rtt_ms=2.5)
    assert (s.node, s.time, s.cpu_load, s.mem_used, s.mem_total, s.rtt_ms) == (
        "gpu-node01.rack2", 1_700_000_000.25, 0.5, 10 * GiB, 64 * GiB, 2.5)
    assert [(g.mem_used, g.mem_total, g.util, g.numa_node) for g in s.gpus] == [
        (10 * GiB, 141 * GiB, 0.3, 0), (1 * GiB, 141 * GiB, 0.0, None)]


def test_node_sample_with_cgroup_uses_the_cgroup() -> None:
    s = to_node_sample(full_message(), rtt_ms=None)
    assert (s.cpu_load, s.mem_used, s.mem_total, s.rtt_ms) == (0.9, 2 * GiB, 8 * GiB, None)


def test_node_sample_with_partial_cgroup_falls_back_per_figure() -> None:
    cg = CgroupStats(path="/x", version=2, cpu_load=0.7, cpu_limit=2.0)  # no memory controller
    s = to_node_sample(full_message(cgroup=cg), rtt_ms=1.0)
    assert (s.cpu_load, s.mem_used, s.mem_total) == (0.7, 10 * GiB, 64 * GiB)
    cg = CgroupStats(path="/x", version=1, mem_used=1.0, mem_limit=4.0)  # no cpu controllers
    s = to_node_sample(full_message(cgroup=cg), rtt_ms=1.0)
    assert (s.cpu_load, s.mem_used, s.mem_total) == (0.5, 1.0, 4.0)
