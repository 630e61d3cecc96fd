"""The API's short memory: what the status page draws and diagnose reads.

A ring of one sample a second over the last 900 s, each made from two
consecutive status snapshots: per VIP packets and bytes a second, per backend
packets a second, its share of its pool's packets (new flows and pinned
alike: the share of traffic it carries), its live ring weight and whether it
is up; and a coarse ring, one sample a minute over 24 h, of the control
plane's and the data plane's resident memory (a leak shows as a slope).
Rates come from counter deltas over the snapshots' own times; a counter that
went backwards (a data plane restarted) counts from zero.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

SECONDS = 900
COARSE_INTERVAL_S = 60.0
COARSE_SAMPLES = 24 * 60

Status = Mapping[str, Any]


class VipSeries(BaseModel):
    pps: list[float]
    bps: list[float]


class BackendSeries(BaseModel):
    pps: list[float]
    share: list[float]
    weight: list[float]
    up: list[bool]


class HistoryView(BaseModel):
    t: list[float]
    vips: dict[str, VipSeries]
    backends: dict[str, BackendSeries]


class VipPoint(BaseModel):
    pps: float
    bps: float


class BackendPoint(BaseModel):
    pps: float
    share: float
    weight: float
    up: bool


class Sample(BaseModel):
    t: float
    vips: dict[str, VipPoint]
    backends: dict[str, BackendPoint]


@dataclass(frozen=True)
class MemoryPoint:
    time: float
    control_rss_bytes: int
    dataplane_rss_bytes: int | None


def _counters(status: Status, kind: str) -> dict[str, tuple[int, int]]:
    """{name: (packets, bytes)} of the data plane's rows of ``kind``, by the
    snapshot's name -> id map."""
    ids = ((status.get("ids") or {}).get(kind) or {})
    names = {int(i): n for n, i in ids.items()}
    out = {}
    for row in (status.get("dataplane_stats") or {}).get(kind) or ():
        try:
            name = names.get(int(row[0]))
            if name is not None:
                out[name] = (int(row[1]), int(row[2]))
        except (TypeError, ValueError, IndexError):
            continue
    return out


def _delta(now: int, before: int | None) -> int:
    if before is None:
        return 0
    return now if now < before else now - before


class History:
    """Both rings; thread-safe (the sampler writes, request handlers read)."""

    def __init__(self, seconds: int = SECONDS, coarse_samples: int = COARSE_SAMPLES) -> None:
        self._lock = threading.Lock()
        self._samples: deque[Sample] = deque(maxlen=seconds)
        self._coarse: deque[MemoryPoint] = deque(maxlen=coarse_samples)
        self._last: tuple[float, dict[str, tuple[int, int]], dict[str, tuple[int, int]]] | None
        self._last = None

    def add(self, status: Status | None) -> Sample | None:
        """Take one snapshot; returns the sample it made (None for the first
        snapshot, a snapshot seen already, or one without a time)."""
        if not status or "time" not in status:
            return None
        t = float(status["time"])
        vips, backends = _counters(status, "vips"), _counters(status, "backends")
        self._add_memory(t, status.get("memory"))
        with self._lock:
            last = self._last
            if last is not None and t <= last[0]:
                return None  # the same snapshot again: keep the older base
            self._last = (t, vips, backends)
        if last is None:
            return None
        dt = t - last[0]
        sample = self._sample(status, t, dt, vips, backends, last[1], last[2])
        with self._lock:
            self._samples.append(sample)
        return sample

    @staticmethod
    def _sample(status: Status, t: float, dt: float,
                vips: dict[str, tuple[int, int]], backends: dict[str, tuple[int, int]],
                vips0: dict[str, tuple[int, int]],
                backends0: dict[str, tuple[int, int]]) -> Sample:
        vip_points = {}
        for name, (packets, octets) in vips.items():
            p0, b0 = vips0.get(name, (None, None))
            vip_points[name] = VipPoint(pps=_delta(packets, p0) / dt,
                                        bps=8 * _delta(octets, b0) / dt)
        weights = status.get("weights") or {}
        pool_of = {b: p for p, members in weights.items() for b in members}
        pool_of.update(status.get("pools") or {})
        health = status.get("health") or {}
        moved = {name: _delta(packets, backends0.get(name, (None, None))[0])
                 for name, (packets, _) in backends.items()}
        pool_total: dict[str, int] = {}
        for name, n in moved.items():
            pool = pool_of.get(name, "")
            pool_total[pool] = pool_total.get(pool, 0) + n
        names = set(backends) | set(pool_of) | set(health)
        backend_points = {}
        for name in sorted(names):
            pool = pool_of.get(name, "")
            n = moved.get(name, 0)
            total = pool_total.get(pool, 0)
            backend_points[name] = BackendPoint(
                pps=n / dt, share=n / total if total else 0.0,
                weight=float((weights.get(pool) or {}).get(name, 0.0)),
                up=bool((health.get(name) or {}).get("up", False)))
        return Sample(t=t, vips=vip_points, backends=backend_points)

    def _add_memory(self, t: float, memory: Any) -> None:
        if not isinstance(memory, Mapping) or memory.get("control_rss_bytes") is None:
            return
        with self._lock:
            if self._coarse and t - self._coarse[-1].time < COARSE_INTERVAL_S:
                return
            dp = memory.get("dataplane_rss_bytes")
            self._coarse.append(MemoryPoint(t, int(memory["control_rss_bytes"]),
                                            None if dp is None else int(dp)))

    def last(self) -> Sample | None:
        with self._lock:
            return self._samples[-1] if self._samples else None

    def memory(self) -> list[MemoryPoint]:
        with self._lock:
            return list(self._coarse)

    def window(self, seconds: float) -> HistoryView:
        """The samples of the last ``seconds`` (of the newest sample's time),
        as aligned series: a name absent from a sample reads 0 / down there."""
        with self._lock:
            samples = list(self._samples)
        if samples:
            since = samples[-1].t - seconds
            samples = [s for s in samples if s.t > since]
        vip_names = sorted({n for s in samples for n in s.vips})
        backend_names = sorted({n for s in samples for n in s.backends})
        zero_vip = VipPoint(pps=0.0, bps=0.0)
        zero_backend = BackendPoint(pps=0.0, share=0.0, weight=0.0, up=False)
        vips = {}
        for name in vip_names:
            points = [s.vips.get(name, zero_vip) for s in samples]
            vips[name] = VipSeries(pps=[p.pps for p in points], bps=[p.bps for p in points])
        backends = {}
        for name in backend_names:
            points = [s.backends.get(name, zero_backend) for s in samples]
            backends[name] = BackendSeries(pps=[p.pps for p in points],
                                           share=[p.share for p in points],
                                           weight=[p.weight for p in points],
                                           up=[p.up for p in points])
        return HistoryView(t=[s.t for s in samples], vips=vips, backends=backends)
