"""Per-backend health: rise/fall thresholds and flap damping. Pure: no I/O, no clock.

Every call takes ``now`` (seconds on a monotonic clock) so tests and the checker
drive time explicitly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpclb.config.probes import DampingConfig, ProbeConfig


@dataclass(frozen=True, slots=True)
class Transition:
    """A backend's reported state changed.

    ``time`` is wall-clock seconds (``time.time()``), the clock of telemetry
    timestamps and of the slow start (``BackendHealth.up_since``); ``monotonic`` is the
    checker's monotonic clock at the same instant, for interval arithmetic.
    """

    backend: str
    up: bool
    reason: str
    time: float
    monotonic: float


class Damper:
    """Route-flap damping (RFC 2439 style) for one backend."""

    __slots__ = ("_at", "_penalty", "config", "suppressed")

    def __init__(self, config: DampingConfig) -> None:
        self.config = config
        self._penalty = 0.0
        self._at = 0.0
        self.suppressed = False

    def penalty(self, now: float) -> float:
        """The penalty decayed to ``now``."""
        if self._penalty == 0.0:
            return 0.0
        elapsed = max(now - self._at, 0.0)  # a clock stepping back must not inflate it
        return self._penalty * math.pow(0.5, elapsed / self.config.half_life_s)

    def flap(self, now: float) -> bool:
        """Charge one state change; True when it starts a suppression."""
        cfg = self.config
        self._penalty = min(self.penalty(now) + cfg.penalty, cfg.ceiling)
        self._at = now
        if not self.suppressed and self._penalty >= cfg.suppress:
            self.suppressed = True
            return True
        return False

    def release_time(self) -> float | None:
        """When (on the clock the damper is driven with) the penalty decays below
        ``reuse`` and the suppression may end; None when not suppressed. The
        release itself happens with the first result recorded from then on."""
        if not self.suppressed:
            return None
        cfg = self.config
        if self._penalty <= cfg.reuse:
            return self._at
        # penalty(t) = _penalty * 2^-((t - _at) / half_life) = reuse
        return self._at + cfg.half_life_s * math.log2(self._penalty / cfg.reuse)

    def release(self, now: float) -> bool:
        """End a suppression whose penalty decayed below ``reuse``; True if it did."""
        if self.suppressed and self.penalty(now) < self.config.reuse:
            self.suppressed = False
            return True
        return False


class HealthState:
    """One backend's up/down verdict from its probe results.

    The *raw* state follows rise/fall: down after ``fall`` failures in a row, up
    after ``rise`` successes in a row. The *reported* state (:attr:`up`) is the raw
    state, except that a backend held by damping is reported down. A change to
    down is always reported at once; damping only delays recoveries.
    """

    __slots__ = ("config", "damper", "failures", "held", "raw_up", "successes", "up")

    def __init__(self, config: ProbeConfig) -> None:
        self.config = config
        self.up = self.raw_up = config.initial == "up"
        self.successes = 0  # consecutive
        self.failures = 0  # consecutive
        self.held = 0  # recoveries held back by damping, for status and metrics
        self.damper = Damper(config.damping)

    @property
    def held_out(self) -> bool:
        """Answering (raw up) but reported down: damping holds the recovery back."""
        return self.raw_up and self.damper.suppressed

    def reconfigure(self, config: ProbeConfig) -> None:
        """New thresholds (and probe); the verdict and the damping penalty stay, the
        run counters restart since they counted another probe's results."""
        self.config = config
        self.successes = self.failures = 0
        if config.damping != self.damper.config:
            self.damper.config = config.damping
            if not config.damping.enabled:
                self.damper.suppressed = False

    def record(self, ok: bool, reason: str, now: float, *,
               local: bool = False) -> tuple[bool, str] | None:
        """Take one probe result; returns (up, why) when the reported state changes.

        A ``local`` (unknown) result is ignored entirely: it neither breaks nor
        extends a run, charges no damping penalty and releases no suppression,
        since it says nothing about the backend."""
        if local:
            return None
        cfg = self.config
        why = ""
        changed = False
        if ok:
            self.failures = 0
            self.successes += 1
            if not self.raw_up and self.successes >= cfg.rise:
                self.raw_up = changed = True
                why = f"{cfg.rise} consecutive successes"
        else:
            self.successes = 0
            self.failures += 1
            if self.raw_up and self.failures >= cfg.fall:
                self.raw_up = False
                changed = True
                why = f"{cfg.fall} consecutive failures (last: {reason})"
        damping = cfg.damping.enabled
        if damping and changed:
            if self.damper.flap(now):
                why += (f"; flapping: held down until the damping penalty "
                        f"decays below {cfg.damping.reuse:g}")
        elif damping and self.damper.release(now):
            why = f"damping released (penalty below {cfg.damping.reuse:g})"
        reported = self.raw_up and not (damping and self.damper.suppressed)
        if changed and self.raw_up and not reported:
            self.held += 1
        if reported == self.up:
            return None
        self.up = reported
        return reported, why
