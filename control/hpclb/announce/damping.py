"""Flap damping of one VIP's announcement, after RFC 2439 (BGP route flap
damping), in seconds rather than minutes: an appliance's VIP flaps because
its backends or its data plane do, and routers should not rehash the fleet's
flows every time it does.

Each withdrawal of an announced VIP adds a fixed penalty; the penalty decays
exponentially (``half_life_s``). At ``suppress`` or above the VIP is
suppressed: it stays withdrawn while it could be announced, until the penalty
decays below ``reuse``. The penalty is capped so that no suppression outlasts
``max_suppress_s`` after the last withdrawal. Withdrawals themselves are
never delayed: a VIP that cannot be served must leave the routers at once.
Pure: every time is passed in (monotonic seconds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpclb.config.bgp import DampingConfig


@dataclass
class Damper:
    config: DampingConfig
    penalty: float = 0.0
    suppressed: bool = False
    _at: float | None = None  # when ``penalty`` was last brought up to date

    def _decay(self, now: float) -> None:
        if self._at is not None and now > self._at:
            self.penalty *= math.pow(0.5, (now - self._at) / self.config.half_life_s)
        self._at = now if self._at is None else max(self._at, now)
        if self.suppressed and self.penalty < self.config.reuse:
            self.suppressed = False

    def withdrawn(self, now: float) -> None:
        """An announced VIP was withdrawn: one flap."""
        self._decay(now)
        if not self.config.enabled:
            return
        self.penalty = min(self.penalty + self.config.penalty, self.config.ceiling)
        if self.penalty >= self.config.suppress:
            self.suppressed = True

    def may_announce(self, now: float) -> bool:
        """Whether the VIP may be announced now (not suppressed)."""
        self._decay(now)
        return not self.suppressed

    def current(self, now: float) -> float:
        self._decay(now)
        return self.penalty

    def release_in(self, now: float) -> float | None:
        """Seconds until a suppressed VIP may be announced again; None when not
        suppressed."""
        self._decay(now)
        if not self.suppressed:
            return None
        return max(0.0, self.config.half_life_s * math.log2(self.penalty / self.config.reuse))

    def reconfigure(self, config: DampingConfig) -> None:
        """New settings keep the penalty (capped at the new ceiling)."""
        self.config = config
        self.penalty = min(self.penalty, config.ceiling)
        if not config.enabled:
            self.penalty, self.suppressed = 0.0, False
