"""A pool's weight formula and dynamics, as the configuration states them.

The model lives with the configuration; what it computes (scores, the tracker
that turns samples into published weights) is :mod:`hpclb.balancing.weights`.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: Internal fixed-point unit: scores and weights are integers of 1/ONE.
#: 2^16 keeps the quantisation error (1.5e-5) far below the publication grid.
ONE = 1 << 16


class WeightPolicy(BaseModel):
    """A pool's weight formula and dynamics. Frozen; validated on construction."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Score coefficients: any non-negative numbers with a positive sum; they are
    # normalised to sum 1 (see `coefficients`), so 2/1/1 means 0.5/0.25/0.25.
    cpu: float = Field(0.4, ge=0, allow_inf_nan=False)
    mem: float = Field(0.3, ge=0, allow_inf_nan=False)
    net: float = Field(0.3, ge=0, allow_inf_nan=False)
    gpu: float = Field(0.0, ge=0, allow_inf_nan=False)
    #: RTT that counts as fully loaded network (the default formula divides it by 100 ms).
    latency_scale_ms: float = Field(100.0, gt=0, allow_inf_nan=False)
    #: Weight bounds. floor > 0 keeps a busy but healthy node in the ring, so it is
    #: still sampled by traffic and its flows are not all re-hashed; floor 0 is allowed.
    floor: float = Field(0.05, ge=0, le=1, allow_inf_nan=False)
    ceiling: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    #: EWMA weight of the newest score; 1 = no smoothing.
    alpha: float = Field(0.3, gt=0, le=1, allow_inf_nan=False)
    #: Hysteresis: move only for changes larger than this (weight units).
    step: float = Field(0.02, ge=0, lt=1, allow_inf_nan=False)
    #: Fastest a published weight may move, per second; None = unlimited.
    max_rate: float | None = Field(0.1, gt=0, allow_inf_nan=False)
    #: Published weights are multiples of 1/grid.
    grid: int = Field(256, ge=1, le=ONE, strict=True)
    #: Ramp length after a node comes back up; 0 = off.
    slow_start_s: float = Field(30.0, ge=0, allow_inf_nan=False)
    #: Samples older than this (or this far in the future) are rejected. 15 s is three
    #: of the default 5 s heartbeats.
    stale_after_s: float = Field(15.0, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _consistent(self) -> WeightPolicy:
        if self.cpu + self.mem + self.net + self.gpu <= 0:
            raise ValueError("coefficients cpu, mem, net, gpu must not all be 0")
        if self.floor > self.ceiling:
            raise ValueError(f"floor {self.floor} is above ceiling {self.ceiling}")
        if self.floor_steps > self.ceiling_steps:
            raise ValueError(
                f"no multiple of 1/{self.grid} between floor {self.floor} and "
                f"ceiling {self.ceiling}: use a finer grid")
        if self.ceiling_steps == 0:
            raise ValueError(f"ceiling {self.ceiling} rounds to 0 on a 1/{self.grid} grid")
        return self

    @property
    def coefficients(self) -> dict[str, float]:
        """The coefficients normalised to sum 1 (for display; scoring uses integers)."""
        total = self.cpu + self.mem + self.net + self.gpu
        return {k: getattr(self, k) / total for k in ("cpu", "mem", "net", "gpu")}

    @property
    def floor_steps(self) -> int:
        # Rounded up so a published weight is never below the configured floor.
        return math.ceil(self.floor * self.grid)

    @property
    def ceiling_steps(self) -> int:
        # Rounded down so a published weight is never above the configured ceiling.
        return math.floor(self.ceiling * self.grid)
