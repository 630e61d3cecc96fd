"""Per-pool probe configuration (pydantic), embedded in ``PoolConfig``
(:mod:`hpclb.config.schema`).

Defaults follow the usual balancers: a probe every 5 s, up after 2 successes
and down after 3 failures in a row (HAProxy's and keepalived's rise/fall), and
route-flap damping in the manner of BGP (RFC 2439) scaled from minutes to seconds.

With the default damping (penalty 1000 per state change, half-life 60 s, suppress
at 2500, reuse below 800, at most 300 s held): a single down/up bounce (penalty
~1900) is not damped; a third change within ~half a minute crosses 2500 and the
backend is held down until the penalty decays below 800, about 100 s later. Each
further change while held adds to the penalty, but never beyond what decays to the
reuse threshold in ``max_suppress_s``.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: Default probe timeout, capped at the interval (a probe never outlives its slot).
DEFAULT_TIMEOUT_S = 2.0
MIN_INTERVAL_S = 0.1
MAX_INTERVAL_S = 3600.0

StatusRange = tuple[int, int]
_RANGE = re.compile(r"^\s*(\d{3})\s*(?:-\s*(\d{3})\s*)?$")
#: Fields of the HTTP request, for kinds http and https.
_HTTP_FIELDS = frozenset({"path", "host", "expect_status"})
#: TLS settings, for kind https.
_TLS_FIELDS = frozenset({"verify", "ca_file", "server_name"})


class DampingConfig(BaseModel):
    """Flap damping: a penalty per state change that halves every ``half_life_s``.

    A change that takes the penalty to ``suppress`` or above holds the backend down
    (its recoveries are not reported) until the penalty decays below ``reuse``. The
    penalty is capped so that no hold lasts longer than ``max_suppress_s``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    penalty: float = Field(1000.0, gt=0, allow_inf_nan=False)
    half_life_s: float = Field(60.0, gt=0, allow_inf_nan=False)
    suppress: float = Field(2500.0, gt=0, allow_inf_nan=False)
    reuse: float = Field(800.0, gt=0, allow_inf_nan=False)
    max_suppress_s: float = Field(300.0, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _thresholds(self) -> DampingConfig:
        if self.reuse >= self.suppress:
            raise ValueError(f"reuse {self.reuse} must be below suppress {self.suppress}")
        # A ceiling below `suppress` would make suppression unreachable: say so now
        # rather than silently never damping.
        if self.ceiling < self.suppress:
            raise ValueError(
                f"max_suppress_s {self.max_suppress_s} caps the penalty at {self.ceiling:.0f},"
                f" below suppress {self.suppress}: raise max_suppress_s or lower suppress")
        return self

    @property
    def ceiling(self) -> float:
        """Highest penalty: the one that decays to ``reuse`` in ``max_suppress_s``."""
        exponent = min(self.max_suppress_s / self.half_life_s, 1000.0)  # no float overflow
        return self.reuse * math.pow(2.0, exponent)


def _parse_status(v: Any) -> list[StatusRange]:
    """200, "200", "200-399", or a list of those -> [(lo, hi), ...]."""
    items = v if isinstance(v, list | tuple) else [v]
    out: list[StatusRange] = []
    for item in items:
        if isinstance(item, bool):  # bool is an int; True is no status code
            raise ValueError(f"{item!r} is not an HTTP status")
        if isinstance(item, int):
            lo = hi = item
        elif isinstance(item, str) and (m := _RANGE.match(item)):
            lo = int(m.group(1))
            hi = int(m.group(2) or m.group(1))
        elif isinstance(item, list | tuple) and len(item) == 2 \
                and all(isinstance(x, int) and not isinstance(x, bool) for x in item):
            lo, hi = item  # the serialised form of a range
        else:
            raise ValueError(f"{item!r} is not a status (200) or a range (\"200-399\")")
        if not 100 <= lo <= hi <= 599:
            raise ValueError(f"status range {lo}-{hi} is not within 100-599 or is reversed")
        out.append((lo, hi))
    if not out:
        raise ValueError("expect_status must list at least one status")
    return out


class ProbeConfig(BaseModel):
    """How one pool's backends are probed. Frozen; validated on construction."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: icmp (ICMPv6 for an IPv6 backend), tcp, http, or https (http over TLS).
    kind: Literal["icmp", "tcp", "http", "https"] = "icmp"
    #: TCP/HTTP port; required for tcp, 80 when omitted for http, 443 for https,
    #: refused for icmp.
    port: int | None = Field(None, ge=1, le=65535, strict=True)
    #: HTTP(S) only: request target, an origin-form path (no spaces or control bytes,
    #: so it cannot smuggle headers into the request).
    path: str = Field("/", pattern=r"^/[\x21-\x7e]*$", max_length=2048)
    #: HTTP(S) only: Host header; the backend's address (and :port) when omitted.
    host: str | None = Field(None, pattern=r"^[\x21-\x7e]+$", max_length=255)
    #: HTTP(S) only: statuses that count as up (ints or "lo-hi" ranges).
    expect_status: tuple[StatusRange, ...] = ((200, 399),)
    #: HTTPS only: check the backend's certificate (chain to ca_file, or the
    #: system's trust store, and server_name). A failed check fails the probe.
    verify: bool = Field(True, strict=True)
    #: HTTPS only: PEM file of the CA(s) the backends' certificates chain to.
    ca_file: Path | None = None
    #: HTTPS only: name sent in SNI and checked against the certificate; the name
    #: in ``host`` when omitted, else the backend's address (its IP in the cert).
    server_name: str | None = Field(None, pattern=r"^[A-Za-z0-9._:-]+$", max_length=253)
    interval_s: float = Field(5.0, ge=MIN_INTERVAL_S, le=MAX_INTERVAL_S, allow_inf_nan=False)
    #: None = min(DEFAULT_TIMEOUT_S, interval_s); see `timeout`.
    timeout_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    rise: int = Field(2, ge=1, le=1000, strict=True)
    fall: int = Field(3, ge=1, le=1000, strict=True)
    #: State of a backend before its first verdict. "up" (HAProxy's default) keeps a
    #: configured pool serving while the first probes run; "down" makes a backend
    #: added to a running pool earn its place with `rise` successes first.
    initial: Literal["up", "down"] = "up"
    damping: DampingConfig = Field(default_factory=DampingConfig)

    @field_validator("expect_status", mode="before")
    @classmethod
    def _status(cls, v: Any) -> Any:
        return tuple(_parse_status(v))

    @model_validator(mode="after")
    def _consistent(self) -> ProbeConfig:
        if self.timeout_s is not None and self.timeout_s > self.interval_s:
            raise ValueError(f"timeout_s {self.timeout_s} is longer than interval_s "
                             f"{self.interval_s}: a probe must end before the next one")
        if self.kind == "tcp" and self.port is None:
            raise ValueError("kind tcp needs a port")
        if self.kind == "icmp" and self.port is not None:
            raise ValueError("kind icmp takes no port")
        if self.kind not in ("http", "https") and (given := self._given(_HTTP_FIELDS)):
            raise ValueError(f"{', '.join(sorted(given))} only apply to kinds http and https")
        if self.kind != "https" and (given := self._given(_TLS_FIELDS)):
            raise ValueError(f"{', '.join(sorted(given))} only apply to kind https")
        if not self.verify and self.ca_file is not None:
            raise ValueError("ca_file is ignored with verify: false: drop one of them")
        return self

    def _given(self, names: frozenset[str]) -> set[str]:
        """Those of ``names`` set and not at their default (a dumped configuration
        carries defaults, and must load again)."""
        fields = type(self).model_fields
        return {f for f in names & self.model_fields_set
                if getattr(self, f) != fields[f].get_default(call_default_factory=True)}

    @property
    def timeout(self) -> float:
        """The effective per-probe timeout in seconds (always <= interval_s)."""
        if self.timeout_s is not None:
            return self.timeout_s
        return min(DEFAULT_TIMEOUT_S, self.interval_s)

    @property
    def effective_port(self) -> int | None:
        if self.port is None and self.kind in ("http", "https"):
            return 80 if self.kind == "http" else 443
        return self.port

    def accepts(self, status: int) -> bool:
        """True when an HTTP status counts as up."""
        return any(lo <= status <= hi for lo, hi in self.expect_status)
