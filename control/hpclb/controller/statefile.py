"""The control plane's state checkpoint: what a restart continues from.

``ids.json`` (hpclb.controller.ids) keeps the table ids; this file keeps the
rest of what the control plane knows and the configuration cannot say: the
configuration text and revision in force, each backend's health verdict, each
dynamic pool's weight tracker (in a fleet, each node's window of samples: a
member restored from it publishes what the other members do at once), the
operator's weight pins, the last telemetry
samples, the decisions last pushed, the MACs they were pushed with and each
VIP's ring as pushed. A restart restores it before the first tables are built,
so that those tables equal what the adopted data plane holds: nothing is
pushed again, no backend flaps up and back down, no weight restarts from its
floor.

Format (``state.json`` in the state folder), one JSON object::

    {"version": 1, "sha256": "<hex of the canonical body>", "body": {...}}

The canonical body is ``json.dumps(body, sort_keys=True, separators=(",", ":"),
allow_nan=False)``, so a byte flipped anywhere, a truncation (no longer JSON)
or a file of another format or version is detected on load. A ring travels as
zlib + base64 of its ids (uint16 when they fit, else uint32; little-endian),
with its length and the SHA-256 of its ids as uint32 (``ring_hash``).

Writes are atomic and keep one good file whatever happens: the new state goes
to a temporary file (fsync), the current ``state.json``, when it checks out,
becomes ``state.prev.json`` (rename), the temporary file becomes
``state.json`` (rename) and the folder is fsynced. A crash between the two
renames leaves only ``state.prev.json``, which the load then uses. A load
reports every problem it met (a corrupt or truncated current file, a missing
one) and falls back to the previous file; both bad: no state at all, said
loudly, and the control plane starts afresh.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import logging
import os
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hpclb.config import HpclbConfig
from hpclb.contract.tables import IPAddress
from hpclb.controller.backends import BackendDecider, BackendDecision
from hpclb.health.backend import Change
from hpclb.host.files import write_atomically

log = logging.getLogger(__name__)

STATE_VERSION = 1
CURRENT = "state.json"
PREVIOUS = "state.prev.json"
TEMPORARY = ".state.json.tmp"
# How a checkpoint may store a ring's ids (little-endian; the data plane's are u32).
RING_DTYPES = ("<u2", "<u4")


class StateError(ValueError):
    """A checkpoint file that cannot be used (the message says why)."""


@dataclass(frozen=True)
class LoadedState:
    """What ``load_state`` found. ``body`` is None when there is no usable state
    (first start, or both files bad: ``problems`` says which). ``fallback`` is
    the previous file's body when the current one was used and the previous is
    good too: a body that passes its checksum but not the restore's own checks
    (``from_state``) falls back to it."""

    body: dict[str, Any] | None
    source: str | None  # "current" | "previous" | None
    problems: list[str] = field(default_factory=list)
    fallback: dict[str, Any] | None = None


def canonical(body: Mapping[str, Any]) -> bytes:
    """The bytes the checksum covers (ValueError for NaN or infinity)."""
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode()


def encode_state(body: Mapping[str, Any]) -> bytes:
    """The file's bytes for ``body``."""
    data = canonical(body)
    head = json.dumps({"version": STATE_VERSION, "sha256": hashlib.sha256(data).hexdigest()})
    # The envelope written by hand around the canonical body: no second
    # serialisation of a body that may hold rings of several hundred KB.
    return head[:-1].encode() + b', "body": ' + data + b"}\n"


def decode_state(data: bytes) -> dict[str, Any]:
    """The body of a checkpoint file's bytes; StateError saying what is wrong."""
    if not data:
        raise StateError("empty file")
    try:
        envelope = json.loads(data)
    except (ValueError, UnicodeDecodeError) as err:
        raise StateError(f"truncated or not JSON ({len(data)} bytes: {err})") from None
    if not isinstance(envelope, dict) or not {"version", "sha256", "body"} <= envelope.keys():
        raise StateError("not a state checkpoint (no version, sha256 and body)")
    if envelope["version"] != STATE_VERSION:
        raise StateError(f"format version {envelope['version']!r}; this build reads "
                         f"{STATE_VERSION}")
    body = envelope["body"]
    if not isinstance(body, dict):
        raise StateError("body is not a JSON object")
    try:
        digest = hashlib.sha256(canonical(body)).hexdigest()
    except ValueError as err:
        raise StateError(f"body not canonical JSON: {err}") from None
    if digest != envelope["sha256"]:
        raise StateError(f"checksum mismatch (file says {str(envelope['sha256'])[:16]}..., "
                         f"content is {digest[:16]}...): corrupt")
    return body


def _read(path: Path) -> dict[str, Any]:
    try:
        data = path.read_bytes()
    except OSError as err:
        raise StateError(f"unreadable: {err.strerror or err}") from None
    return decode_state(data)


# The envelope as encode_state writes it: the body's bytes are then hashed as they
# are, with no JSON parse (the check before every write, of a file up to MBs).
_ENVELOPE = re.compile(rb'\{"version": (\d+), "sha256": "([0-9a-f]{64})", "body": ')


def _checks_out(path: Path) -> bool:
    """Whether ``path`` is a good checkpoint (False when missing)."""
    try:
        data = path.read_bytes()
    except OSError:
        return False
    m = _ENVELOPE.match(data)
    if m and data.endswith(b"}\n") and int(m[1]) == STATE_VERSION:
        return hashlib.sha256(data[m.end():-2]).hexdigest() == m[2].decode()
    try:  # written some other way (by hand?): the full check
        decode_state(data)
    except StateError:
        return False
    return True


def write_state(folder: Path, body: Mapping[str, Any]) -> Path:
    """Write ``body`` as ``folder/state.json``, atomically, keeping the former
    one (when it checks out) as ``state.prev.json``. Raises OSError (or
    ValueError for a body that is not JSON) with the files as they were or
    with one good file: never a half-written one under either name."""
    data = encode_state(body)
    folder.mkdir(parents=True, exist_ok=True)
    current, previous = folder / CURRENT, folder / PREVIOUS

    def keep_previous() -> None:
        # A corrupt current file must not push out the good previous one.
        if _checks_out(current):
            os.replace(current, previous)

    write_atomically(current, data, 0o600, tmp=folder / TEMPORARY, before_replace=keep_previous)
    return current


def load_state(folder: Path) -> LoadedState:
    """The newest good state in ``folder`` (see the module's docstring)."""
    current, previous = folder / CURRENT, folder / PREVIOUS
    problems: list[str] = []
    cur_body = prev_body = None
    if current.exists():
        try:
            cur_body = _read(current)
        except StateError as err:
            problems.append(f"{current}: {err}")
    elif previous.exists():
        problems.append(f"{current}: missing (a write was interrupted)")
    if previous.exists():
        try:
            prev_body = _read(previous)
        except StateError as err:
            # Worth saying only when it is what a restart would need.
            if cur_body is None:
                problems.append(f"{previous}: {err}")
    if cur_body is not None:
        return LoadedState(cur_body, "current", problems, prev_body)
    if prev_body is not None:
        return LoadedState(prev_body, "previous", problems)
    return LoadedState(None, None, problems)


# --- rings -------------------------------------------------------------------------


def _canonical_ring(ring: np.ndarray) -> np.ndarray:
    """A ring as little-endian uint32, the form its hash is taken of."""
    arr = np.asarray(ring)
    if arr.ndim != 1 or arr.dtype.kind not in "ui" or (arr.size and int(arr.min()) < 0):
        raise ValueError(f"a ring is a 1-D array of backend ids, not {arr.dtype} x {arr.shape}")
    return np.ascontiguousarray(arr, dtype="<u4")


def ring_hash(ring: np.ndarray) -> str:
    """SHA-256 of a ring's ids as little-endian uint32, however it is stored."""
    return hashlib.sha256(_canonical_ring(ring).tobytes()).hexdigest()


def encode_ring(ring: np.ndarray) -> dict[str, Any]:
    """A ring as the checkpoint holds it: its ids as uint16 when they fit (a
    Maglev ring of 65537 slots: 128 KiB, ~40 KiB compressed) else uint32,
    zlib (level 1: a ring is re-encoded whenever a weight moves, in the loop
    thread) and base64, with its length and ``ring_hash``."""
    arr = _canonical_ring(ring)
    narrow = arr.size == 0 or int(arr.max()) <= 0xFFFF
    stored = arr.astype("<u2") if narrow else arr
    return {"dtype": stored.dtype.str, "len": int(arr.size),
            "sha256": hashlib.sha256(arr.tobytes()).hexdigest(),
            "zlib_b64": base64.b64encode(zlib.compress(stored.tobytes(), 1)).decode("ascii")}


def decode_ring(raw: object, where: str = "ring") -> np.ndarray:
    """``encode_ring``'s dict back to the ring (uint32); ValueError naming what
    is wrong."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: expected a mapping")
    dtype, length = raw.get("dtype"), raw.get("len")
    if dtype not in RING_DTYPES:
        raise ValueError(f"{where}.dtype: {dtype!r} is not one of {', '.join(RING_DTYPES)}")
    if not isinstance(length, int) or isinstance(length, bool) or length < 0:
        raise ValueError(f"{where}.len: expected an integer >= 0")
    try:
        data = zlib.decompress(base64.b64decode(str(raw.get("zlib_b64")), validate=True))
    except (ValueError, zlib.error) as err:
        raise ValueError(f"{where}.zlib_b64: {err}") from None
    item = np.dtype(str(dtype)).itemsize
    if len(data) != length * item:
        raise ValueError(f"{where}: {len(data)} bytes, not {length} slots of {dtype}")
    ring = np.frombuffer(data, dtype=np.dtype(str(dtype))).astype("<u4")
    if hashlib.sha256(ring.tobytes()).hexdigest() != raw.get("sha256"):
        raise ValueError(f"{where}.sha256: does not match the ring")
    return ring


# --- the controller's side: what goes in, when it is written, how it comes back ------

#: Never more than one write a second, however fast the changes come (coalesced).
MIN_WRITE_INTERVAL_S = 1.0
#: How long a checkpoint found corrupt at start stays on the status's alarm list
#: (the status's "checkpoint" block keeps the problems for the process's life).
START_ALARM_HOLD_S = 3600.0


@dataclass(frozen=True)
class Snapshot:
    """What the controller holds that a checkpoint keeps (references, no copies:
    built every loop turn, turned into a body only when written)."""

    appliance: str
    revision: str
    config_text: str
    decider: BackendDecider
    decisions: Mapping[str, tuple[BackendDecision, ...]]  # pool -> as last pushed
    rings: Mapping[str, tuple[int, np.ndarray]]  # VIP name -> (id, ring) as pushed
    macs: Mapping[tuple[IPAddress, bool], str]  # (address, routed) -> MAC

    def key(self) -> tuple[Any, ...]:
        """Equal keys: nothing a restart needs at once has changed (decisions,
        configuration, pins, health verdicts, MACs). Inputs that only feed the
        weights (samples, smoothing) wait for the interval."""
        d = self.decider
        return (self.revision, tuple(self.decisions.items()), frozenset(d.pins.items()),
                len(d.transitions), d.transitions[-1] if d.transitions else None,
                frozenset(self.macs.items()),
                # A ring pushed anew (a retried push, a restarted data plane).
                frozenset((vip, vid, id(ring)) for vip, (vid, ring) in self.rings.items()))


@dataclass
class Restored:
    """What a restore gave the controller besides the decider's state."""

    macs: dict[tuple[IPAddress, bool], str] = field(default_factory=dict)
    rings: dict[str, np.ndarray] = field(default_factory=dict)  # VIP -> ring as pushed
    # backend -> (state, weight) as last pushed
    decisions: dict[str, tuple[str, float]] = field(default_factory=dict)
    same_config: bool = False


def snapshot_body(snap: Snapshot, wall: float,
                  ring_cache: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The checkpoint body of ``snap``. ``ring_cache`` (hash -> encoded ring)
    spares recompressing a ring that did not change; it is pruned to the rings
    written."""
    cache = {} if ring_cache is None else ring_cache
    rings: dict[str, dict[str, Any]] = {}
    vip_rings: dict[str, dict[str, Any]] = {}
    for vip, (vid, ring) in sorted(snap.rings.items()):
        digest = ring_hash(ring)
        if digest not in cache:
            cache[digest] = encode_ring(ring)
        rings[digest] = cache[digest]  # two VIPs of one pool share their ring
        vip_rings[vip] = {"id": vid, "sha256": digest}
    for digest in [h for h in cache if h not in rings]:
        del cache[digest]
    return {
        "appliance": snap.appliance, "written_at": wall,
        "revision": snap.revision, "config_text": snap.config_text,
        "decider": snap.decider.to_state(),
        "pushed": {
            "decisions": {pool: [{"name": d.name, "state": d.state.name.lower(),
                                  "weight": d.weight} for d in ds]
                          for pool, ds in snap.decisions.items()},
            "macs": sorted([str(addr), routed, mac] for (addr, routed), mac in snap.macs.items()),
            "rings": rings, "vip_rings": vip_rings,
        },
    }


def _restored_parts(body: Mapping[str, Any], appliance: str, same_config: bool) -> Restored:
    """Check the body's own parts (the decider checks its own); ValueError."""
    if body.get("appliance") != appliance:
        raise ValueError(f"written for appliance {body.get('appliance')!r}, not {appliance!r}")
    pushed = body.get("pushed")
    if not isinstance(pushed, Mapping):
        raise ValueError("pushed: expected a mapping")
    out = Restored(same_config=same_config)
    rings_raw = pushed.get("rings", {})
    vip_rings = pushed.get("vip_rings", {})
    if not isinstance(rings_raw, Mapping) or not isinstance(vip_rings, Mapping):
        raise ValueError("pushed.rings: expected mappings")
    rings = {h: decode_ring(r, f"pushed.rings.{h[:16]}") for h, r in rings_raw.items()}
    for vip, ref in vip_rings.items():
        if not isinstance(ref, Mapping) or ref.get("sha256") not in rings:
            raise ValueError(f"pushed.vip_rings.{vip}: names no ring of the checkpoint")
        out.rings[str(vip)] = rings[ref["sha256"]]
    decisions = pushed.get("decisions", {})
    if not isinstance(decisions, Mapping):
        raise ValueError("pushed.decisions: expected a mapping")
    for pool, ds in decisions.items():
        for i, d in enumerate(ds if isinstance(ds, list) else [None]):
            if not isinstance(d, Mapping) or not isinstance(d.get("name"), str) \
                    or not isinstance(d.get("state"), str) \
                    or not isinstance(d.get("weight"), (int, float)):
                raise ValueError(f"pushed.decisions.{pool}.{i}: expected name, state, weight")
            out.decisions[d["name"]] = (d["state"], float(d["weight"]))
    macs = pushed.get("macs", [])
    if not isinstance(macs, list):
        raise ValueError("pushed.macs: expected a list")
    for i, entry in enumerate(macs):
        try:
            addr, routed, mac = entry
            if not isinstance(routed, bool) or not _MAC.fullmatch(str(mac)):
                raise ValueError
            out.macs[(ipaddress.ip_address(addr), routed)] = str(mac)
        except (TypeError, ValueError):
            raise ValueError(f"pushed.macs.{i}: expected [address, routed, mac]") from None
    if not same_config:
        out.macs.clear()  # a reload forgets MACs too: a changed backend resolves afresh
    return out


_MAC = re.compile(r"[0-9a-f]{2}(:[0-9a-f]{2}){5}")


class StateKeeper:
    """The controller's checkpoint: restored once at start, written when
    something a restart needs changed (at most once a second) and at least
    every ``checkpoint_interval_s``; its problems on the status and its alarm
    list."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.source_at_start: str | None = None
        self.problems: list[str] = []  # met at start
        self.written_at: float | None = None  # wall clock of the last write
        self._last_write = -float("inf")  # monotonic
        self._last_key: tuple[Any, ...] | None = None
        self._write_error: str | None = None
        self._started_at = 0.0  # monotonic time of the restore
        self._ring_cache: dict[str, dict[str, Any]] = {}
        # Backends restored as failing their probe: the probe thread starts from
        # its configured initial verdict and tells only changes, so their
        # recovery is read off its snapshot (reconcile_probes).
        self._probe_held: set[str] = set()

    # -- start --

    def _problem(self, text: str) -> None:
        self.problems.append(text)
        log.error("state checkpoint: %s", text)

    def restore(self, decider: BackendDecider, config: HpclbConfig, revision: str,
                mono: float, wall: float) -> Restored:
        """Load the newest good checkpoint into ``decider`` (all or nothing) and
        return what else it holds; any problem is logged and kept for the status
        and the alarms. No usable checkpoint: the decider as it was (fresh)."""
        self._started_at = mono
        loaded = load_state(self.folder)
        for text in loaded.problems:
            self._problem(text)
        tries = [(loaded.source, loaded.body), ("previous", loaded.fallback)]
        for source, body in tries:
            if body is None:
                continue
            try:
                return self._apply(source or "?", body, decider, config, revision, mono, wall)
            except ValueError as err:
                self._problem(f"{source} checkpoint not restored: {err}")
        if self.problems:
            log.error("state checkpoint: no usable checkpoint in %s: starting afresh (health, "
                      "weights and pins as after a first start)", self.folder)
        else:
            log.info("state checkpoint: none in %s (first start)", self.folder)
        return Restored()

    def _apply(self, source: str, body: Mapping[str, Any], decider: BackendDecider,
               config: HpclbConfig, revision: str, mono: float, wall: float) -> Restored:
        same = body.get("revision") == revision
        restored = _restored_parts(body, config.appliance.name, same)
        notes = decider.from_state(body.get("decider"), mono, wall)  # the last check
        self.source_at_start = source
        self._probe_held = {name for name, h in decider.health.snapshot().items()
                            if not h["probe_up"]}
        when = body.get("written_at")
        age = f"{wall - when:.0f} s old" if isinstance(when, (int, float)) else "undated"
        counts = (f"{len(decider.health.snapshot())} health verdicts, "
                  f"{len(decider.trackers)} dynamic pools, {len(decider.pins)} pins")
        if same:
            log.info("state checkpoint: restored the %s one (%s, revision %s): %s",
                     source, age, revision, counts)
        else:
            log.warning("state checkpoint: the configuration changed while the control plane "
                        "was down (revision %s -> %s): restored the %s checkpoint (%s) for the "
                        "backends still configured: %s", body.get("revision"), revision,
                        source, age, counts)
        for note in notes:
            log.warning("state checkpoint: %s", note)
        return restored

    def started(self, snap: Snapshot, restored: Restored, mono: float, wall: float) -> None:
        """After the first push: say whether the tables built from the restored
        state are those pushed before the restart, then write the checkpoint."""
        if restored.same_config and restored.rings:
            differ = sorted(vip for vip, (_, ring) in snap.rings.items()
                            if vip not in restored.rings
                            or not np.array_equal(restored.rings[vip], ring))
            now = {d.name: (d.state.name.lower(), d.weight)
                   for ds in snap.decisions.values() for d in ds}
            moved = sorted(n for n, d in now.items() if restored.decisions.get(n) != d)
            if differ or moved:
                log.info("state checkpoint: since the last checkpoint, decisions of %s and "
                         "rings of VIPs %s moved (time passed: ramps, expired pins)",
                         ", ".join(moved) or "no backend", ", ".join(differ) or "none")
            else:
                log.info("state checkpoint: the tables equal those pushed before the restart")
        self.write(snap, mono, wall)

    # -- running --

    def reconcile_probes(self, decider: BackendDecider, verdicts: Mapping[str, Mapping[str, Any]],
                         config: HpclbConfig, wall: float) -> list[Change]:
        """Backends restored as failing their probe come back up once the probe
        thread has seen ``rise`` successes in a row (it started from its initial
        verdict, "up", and reports no change for a backend that answers)."""
        changes: list[Change] = []
        for name in sorted(self._probe_held):
            pool = config.pool_of(name)
            if pool is None:  # no longer configured
                self._probe_held.discard(name)
                continue
            probe = config.pools[pool].probe
            v = verdicts.get(name)
            if probe is not None and v is not None and not v.get("up", True):
                self._probe_held.discard(name)  # the thread's own changes count from now
                continue
            rise = probe.rise if probe is not None else 0
            if probe is not None and (v is None or int(v.get("successes", 0)) < rise):
                continue
            self._probe_held.discard(name)
            why = (f"{rise} consecutive successes since the restart" if probe is not None
                   else "no probe configured any more")
            change = decider.probe(name, True, why, wall)
            if change is not None:
                changes.append(change)
        return changes

    def tick(self, snap: Snapshot, mono: float, wall: float, interval_s: float) -> None:
        """Write when something a restart needs changed (coalesced to once a
        second) or when the interval is over."""
        since = mono - self._last_write
        if since < MIN_WRITE_INTERVAL_S:
            return
        if snap.key() != self._last_key or since >= interval_s \
                or self._write_error is not None:
            self.write(snap, mono, wall)

    def write(self, snap: Snapshot, mono: float, wall: float) -> bool:
        """Write now; a failure is logged and raised as an alarm until a write
        succeeds (the control plane goes on: the previous checkpoint stays)."""
        self._last_write = mono
        key = snap.key()
        try:
            write_state(self.folder, snapshot_body(snap, wall, self._ring_cache))
        except (OSError, ValueError) as err:
            text = f"cannot write {self.folder / CURRENT}: {err}"
            if text != self._write_error:
                log.error("state checkpoint: %s; the previous one stays", text)
            self._write_error = text
            return False
        if self._write_error is not None:
            log.info("state checkpoint: written again")
        self._write_error = None
        self._last_key = key
        self.written_at = wall
        return True

    def status(self) -> dict[str, Any]:
        return {"written_at": self.written_at, "source_at_start": self.source_at_start,
                "problems": list(self.problems), "write_error": self._write_error}

    def alarms(self, mono: float) -> list[dict[str, Any]]:
        out = []
        if self.problems and mono - self._started_at < START_ALARM_HOLD_S:
            used = (f"the {self.source_at_start} checkpoint was used"
                    if self.source_at_start else "started without one")
            out.append({"source": "checkpoint",
                        "message": f"state checkpoint problems at start ({used}): "
                                   + "; ".join(self.problems)})
        if self._write_error is not None:
            out.append({"source": "checkpoint", "message": self._write_error})
        return out
