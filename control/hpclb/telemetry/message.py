"""The node agent's telemetry message (docs/ARCHITECTURE.md, Contracts), version 1, in msgpack.

    payload = encode(TelemetryMessage(...))          # agent side
    msg = decode(payload)                            # raises TelemetryError

On the wire a message is one msgpack map with the field names of
:class:`TelemetryMessage`: ``v``, ``node``, ``time``, ``seq``, ``interval_s``,
``cpu_load``, ``mem_used``, ``mem_total``, ``numa_nodes``, ``numa``, ``cgroup``,
``gpus``, ``extra`` (the last four optional). Memory is in bytes, loads and
utilisations are ratios 0..1, ``time`` is the agent's wall clock in seconds since the
epoch, ``interval_s`` is how long until the agent's next message (the adaptive
heartbeat interval), so the control plane knows when a heartbeat is missing.

What :func:`decode` rejects and what it lets through is split on purpose:

* **Structure** is checked strictly: the payload's size, msgpack itself, a map at
  the top, the version, every field's type (no bool for a number, no bytes for a
  string), no unknown field, string and list sizes, identifiers and counts in
  range (node id, seq, NUMA node numbers, GPU indices, ``interval_s``). A message
  failing any of these is unusable and raises :class:`TelemetryError`.
* **Measured values** (loads, memory, utilisation, time, extra metrics) only have
  to be numbers: NaN, infinities, negatives and ratios above 1 pass. Judging them
  is :func:`hpclb.balancing.weights.check_sample`'s job, which rejects such a sample, counts
  it by reason and keeps the node's last good value; rejecting it here would hide
  a broken agent behind a generic decode error.

Version 1 forbids unknown fields; new figures go into ``extra`` (a name -> number
map) or into a version 2.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

VERSION = 1
#: Largest payload accepted: it bounds what one peer can make the control plane
#: parse, and is large enough for the largest message the schema allows (about
#: 72 KiB: every list and string at its limit), so whatever validates also encodes.
#: A node with 8 GPUs and 8 NUMA nodes takes about 1.5 KiB.
MAX_MESSAGE_BYTES = 128 * 1024
MAX_NUMA_NODES = 1024  # Linux's MAX_NUMNODES with NODES_SHIFT=10, the largest config
MAX_GPUS = 64
MAX_EXTRA = 64
MAX_INTERVAL_S = 3600.0

#: Why decode refused a payload: the keys the receiver counts malformed messages by.
DECODE_REASONS: tuple[str, ...] = (
    "oversized",  # longer than MAX_MESSAGE_BYTES
    "msgpack",  # not msgpack, truncated, or trailing bytes
    "not_map",  # valid msgpack but not a map at the top
    "version",  # no "v", or a version this code does not speak
    "schema",  # a field missing, unknown, of the wrong type, size or range
)

#: Same rule as config.Name (backend and appliance names), so a node id can be a
#: backend name and a file name (the allow-list is <node id>.key files).
NODE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
NodeId = Annotated[str, Field(pattern=NODE_ID_PATTERN)]
METRIC_NAME_PATTERN = r"^[a-z][a-z0-9_]{0,62}$"
#: The one ``extra`` figure of the agent's own (hpclb.agent.echo): its round
#: trip to the appliances, in ms, the network term of a fleet's weights.
FLEET_RTT = "fleet_rtt_ms"
MetricName = Annotated[str, Field(pattern=METRIC_NAME_PATTERN)]
#: A measured value: any number, NaN and negatives included (see the module doc).
Measure = float
NumaId = Annotated[int, Field(ge=0, lt=MAX_NUMA_NODES)]


class TelemetryError(ValueError):
    """A payload that is not a usable version-1 message; ``reason`` is one of
    DECODE_REASONS (for counters), str() says what is wrong in one line."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class _Msg(BaseModel):
    # strict: msgpack gives exact types, so an int where a str belongs (or True
    # where a number belongs) is a broken agent, not something to coerce.
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class NumaMemory(_Msg):
    """Memory of one NUMA node, bytes. ``mem_used`` leaves out page cache and
    reclaimable slab, like the host figure (what ``free`` calls used)."""

    node: NumaId
    mem_used: Measure
    mem_total: Measure


class CgroupStats(_Msg):
    """The figures of the cgroup given with ``--cgroup``; a field is None when that
    controller is not available for the cgroup (the host figure is used instead)."""

    path: Annotated[str, Field(max_length=4096)]
    version: Literal[1, 2]
    cpu_load: Measure | None = None  # CPU time used / time the quota allows, 0..1
    cpu_limit: Measure | None = None  # CPUs the quota allows (host CPUs if unlimited)
    mem_used: Measure | None = None  # bytes in use, page cache left out
    mem_limit: Measure | None = None  # bytes; the host's memory if unlimited


class GpuStats(_Msg):
    """One GPU, as NVML reports it."""

    index: Annotated[int, Field(ge=0, lt=1024)]
    name: Annotated[str, Field(max_length=96)] = ""
    uuid: Annotated[str, Field(max_length=96)] = ""
    mem_used: Measure
    mem_total: Measure
    util: Measure | None = None  # 0..1; None when the device does not report it
    numa_node: NumaId | None = None  # None when the platform does not say


class TelemetryMessage(_Msg):
    """One telemetry message, version 1. Frozen; build it, encode it."""

    v: Literal[1] = VERSION
    node: NodeId
    time: Measure
    seq: Annotated[int, Field(ge=0, lt=1 << 64)]
    interval_s: Annotated[float, Field(gt=0, le=MAX_INTERVAL_S, allow_inf_nan=False)]
    cpu_load: Measure
    mem_used: Measure
    mem_total: Measure
    numa_nodes: Annotated[int, Field(ge=1, le=MAX_NUMA_NODES)]
    numa: Annotated[tuple[NumaMemory, ...], Field(max_length=MAX_NUMA_NODES)] = ()
    cgroup: CgroupStats | None = None
    gpus: Annotated[tuple[GpuStats, ...], Field(max_length=MAX_GPUS)] = ()
    extra: Annotated[dict[MetricName, Measure], Field(max_length=MAX_EXTRA)] = Field(
        default_factory=dict)

    @model_validator(mode="after")
    def _unique_ids(self) -> TelemetryMessage:
        numa = [n.node for n in self.numa]
        if len(set(numa)) != len(numa):
            raise ValueError(f"NUMA node numbers repeat: {numa}")
        gpus = [g.index for g in self.gpus]
        if len(set(gpus)) != len(gpus):
            raise ValueError(f"GPU indices repeat: {gpus}")
        return self


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(err: ValidationError) -> str:
    """The first few problems in one line: ``gpus.0.mem_used: Input should be ...``."""
    parts = []
    for e in err.errors()[:3]:
        loc = ".".join(str(p) for p in e["loc"]) or "message"
        parts.append(f"{loc}: {e['msg']} (got {_short(e.get('input'))})")
    more = err.error_count() - 3
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def _wire_type(value: Any) -> str:
    names = {tuple: "array", str: "string", bytes: "binary", type(None): "nil"}
    return names.get(type(value), type(value).__name__)


def encode(msg: TelemetryMessage) -> bytes:
    """The msgpack payload of ``msg``. Every valid message fits the cap; the check
    is there so that if a schema change ever breaks that, the agent finds out at
    once (TelemetryError) instead of being dropped by every receiver."""
    payload: bytes = msgpack.packb(msg.model_dump(), use_bin_type=True)
    if len(payload) > MAX_MESSAGE_BYTES:
        raise TelemetryError("oversized", f"message is {len(payload)} bytes, "
                             f"the limit is {MAX_MESSAGE_BYTES}")
    return payload


def decode(payload: bytes | bytearray | memoryview,
           max_bytes: int = MAX_MESSAGE_BYTES) -> TelemetryMessage:
    """Parse and validate one payload; raises TelemetryError, never anything else."""
    if len(payload) > max_bytes:
        raise TelemetryError("oversized", f"message is {len(payload)} bytes, "
                             f"the limit is {max_bytes}")
    try:
        # unpackb caps every container by len(payload), so a small payload cannot
        # announce a huge one; tuples because the model's lists are tuples (strict).
        data = msgpack.unpackb(payload, raw=False, use_list=False, strict_map_key=True)
    except Exception as err:  # msgpack raises several unrelated types for bad input
        raise TelemetryError("msgpack", f"not a msgpack message: {str(err) or type(err).__name__}"
                             ) from None
    if not isinstance(data, dict):
        raise TelemetryError("not_map", f"message is a msgpack {_wire_type(data)}, not a map")
    version = data.get("v")
    # type() rather than isinstance: True == 1 in Python but is no version number.
    if type(version) is not int or version != VERSION:
        raise TelemetryError("version", f"unknown telemetry version {_short(version)} "
                             f"(this control plane speaks {VERSION})")
    try:
        return TelemetryMessage.model_validate(data)
    except ValidationError as err:
        raise TelemetryError("schema", _describe(err)) from None
