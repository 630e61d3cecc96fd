"""No-drop and partial-drop rate search in the manner of RFC 2544 (section 26.1).

Pure: a trial is a callable that offers frames at a rate and says what was offered
and what came back; nothing here knows the lab or the generator.

The search: the first trial at the top rate the generator can offer (its "line
rate"); if that loses nothing, the path is not the limit and both rates are that
trial's. Otherwise a binary search between the highest rate that passed and the
lowest that failed, for two bounds at once, from one series of trials: the no-drop
rate (NDR, nothing lost) and the partial-drop rate (PDR, loss at most ``pdr_loss``).
Every trial narrows both intervals: a lossless one raises both lower bounds, one
that lost no more than ``pdr_loss`` raises the PDR's and lowers the NDR's upper
bound, one that lost more lowers both upper bounds. The next rate is the middle of
whichever interval is still the wider (relative to its upper bound); the search ends
when both are within ``resolution`` or after ``max_trials`` trials.

A rate in the intervals is the rate the path was *offered*: what the generator
actually sent per second, which is below what it was asked for when it cannot go
that fast (a generator on a small machine, or slowed by the path it drives). So a
lossless trial proves only the rate it offered, and a lossy one disproves the rate
it offered, not the one asked for; a search whose every trial falls short of its
asked rate by more than the resolution is marked ``generator_limited``. The rates
reported are what was forwarded at the best passing trial.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# A trial whose generator sent less than this share of the asked rate fell short.
REACHED_SHARE = 0.98


@dataclass(frozen=True)
class Trial:
    """One trial: frames offered to the path and frames it forwarded."""

    offered_pps: float
    forwarded_pps: float
    offered: int
    forwarded: int
    seconds: float
    rate_pps: float | None  # the rate asked for (None: full speed)
    # {"min_us","avg_us","max_us","p50_us","p99_us","p999_us"} where measured
    latency: dict[str, float] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def loss_ratio(self) -> float:
        """Share of the offered frames that did not come back; never negative (a
        sink that counted a stray frame of its own, ARP say, is no gain)."""
        if self.offered <= 0:
            return 0.0
        return max(self.offered - self.forwarded, 0) / self.offered

    @property
    def lost(self) -> int:
        return max(self.offered - self.forwarded, 0)

    def to_json(self) -> dict[str, Any]:
        return {
            "rate_asked_pps": self.rate_pps,
            "offered_pps": self.offered_pps,
            "forwarded_pps": self.forwarded_pps,
            "offered_frames": self.offered,
            "forwarded_frames": self.forwarded,
            "lost": self.lost,
            "loss_ratio": self.loss_ratio,
            "seconds": self.seconds,
            "latency": self.latency,
            **({"extra": self.extra} if self.extra else {}),
        }


@dataclass(frozen=True)
class SearchResult:
    """NDR and PDR from one series of trials (every trial kept, in order)."""

    ndr_pps: float | None  # forwarded pps at the best lossless trial (None: none was)
    pdr_pps: float | None  # forwarded pps at the best trial with loss <= pdr_loss
    trials: tuple[Trial, ...]
    pdr_loss: float
    line_rate_pps: float
    ndr_offered_pps: float | None = None  # the offered rate of those trials
    pdr_offered_pps: float | None = None
    # Both intervals narrowed to the resolution (False: max_trials ended it).
    converged: bool = False
    # Every trial offered less than it was asked for: the generator, not the path,
    # set the top of the range.
    generator_limited: bool = False
    # The first trial (the generator's top) lost nothing: the path never was the limit.
    line_rate_lossless: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "ndr_pps": self.ndr_pps,
            "pdr_pps": self.pdr_pps,
            "ndr_offered_pps": self.ndr_offered_pps,
            "pdr_offered_pps": self.pdr_offered_pps,
            "pdr_loss": self.pdr_loss,
            "line_rate_pps": self.line_rate_pps,
            "converged": self.converged,
            "generator_limited": self.generator_limited,
            "line_rate_lossless": self.line_rate_lossless,
            "trials": [t.to_json() for t in self.trials],
        }


@dataclass
class _Bound:
    """One rate's interval: ``lo`` passed (0: nothing has), ``hi`` failed."""

    lo: float
    hi: float
    best: Trial | None = None

    def passed(self, rate: float, trial: Trial) -> None:
        if rate > self.lo:
            self.lo, self.best = rate, trial
        # Noise: a pass at or above a rate that failed earlier. The failure at the
        # lower rate stands (a bound proven once is not unproven), but the
        # interval must stay ordered for the search to continue.
        self.hi = max(self.hi, self.lo)

    def failed(self, rate: float) -> None:
        # A failure below a rate that passed is noise the other way; keep lo.
        if rate < self.hi:
            self.hi = max(rate, self.lo)

    def width(self) -> float:
        return (self.hi - self.lo) / self.hi if self.hi > 0 else 0.0


def offered_rate(trial: Trial) -> float:
    """The rate the path saw: what was offered, never more than was asked."""
    if trial.rate_pps is None:
        return trial.offered_pps
    return min(trial.offered_pps, trial.rate_pps)


def search_rates(trial: Callable[[float], Trial], line_rate_pps: float, *,
                 pdr_loss: float = 0.005, resolution: float = 0.01,
                 max_trials: int = 12) -> SearchResult:
    """NDR and PDR of a path by binary search over offered rates (module doc).

    ``trial(rate)`` offers frames at ``rate`` pps for the trial's length;
    ``line_rate_pps`` is the top the generator can offer (the first trial's rate).
    """
    if line_rate_pps <= 0:
        raise ValueError("line_rate_pps must be positive")
    if not 0 <= pdr_loss < 1:
        raise ValueError("pdr_loss is a share of the offered frames, in [0, 1)")
    if max_trials < 1:
        raise ValueError("max_trials must be at least 1")
    trials: list[Trial] = []
    short = 0  # trials that offered clearly less than they were asked for

    def run(rate: float) -> tuple[float, Trial]:
        nonlocal short
        t = trial(rate)
        trials.append(t)
        if t.rate_pps is not None and t.offered_pps < REACHED_SHARE * t.rate_pps:
            short += 1
        return offered_rate(t), t

    rate, first = run(line_rate_pps)
    ndr = _Bound(0.0, rate)
    pdr = _Bound(0.0, rate)
    _record(first, rate, ndr, pdr, pdr_loss)
    line_lossless = first.loss_ratio == 0 and first.offered > 0
    while len(trials) < max_trials and not line_lossless:
        open_bounds = [b for b in (ndr, pdr) if b.width() > resolution]
        if not open_bounds:
            break
        # The wider interval first; on a tie the NDR's (it is listed first).
        target = max(open_bounds, key=lambda b: b.width())
        asked = (target.lo + target.hi) / 2
        if asked <= 0:
            break
        rate, t = run(asked)
        _record(t, rate, ndr, pdr, pdr_loss)
    converged = line_lossless or (ndr.width() <= resolution and pdr.width() <= resolution)
    return SearchResult(
        ndr_pps=ndr.best.forwarded_pps if ndr.best else None,
        pdr_pps=pdr.best.forwarded_pps if pdr.best else None,
        ndr_offered_pps=ndr.lo if ndr.best else None,
        pdr_offered_pps=pdr.lo if pdr.best else None,
        trials=tuple(trials), pdr_loss=pdr_loss, line_rate_pps=line_rate_pps,
        converged=converged,
        generator_limited=short == len(trials),
        line_rate_lossless=line_lossless,
    )


def _record(t: Trial, rate: float, ndr: _Bound, pdr: _Bound, pdr_loss: float) -> None:
    if t.offered <= 0:
        # Nothing was offered (the generator failed): it proves no rate either way.
        return
    loss = t.loss_ratio
    if loss == 0:
        ndr.passed(rate, t)
    else:
        ndr.failed(rate)
    if loss <= pdr_loss:
        pdr.passed(rate, t)
    else:
        pdr.failed(rate)
