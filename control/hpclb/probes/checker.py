"""The health checker: probes every backend and turns results into up/down.

Glue between the scheduler (when), the probes (how) and the health state (what it
means). This is the one object the controller holds.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from .config import ProbeConfig
from .health import HealthState, Transition
from .http import http_get
from .icmp import IcmpPinger, Mode
from .result import ProbeError
from .scheduler import ProbeFn, ProbeOutcome, ProbeScheduler
from .tcp import TcpConnector, family_of

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BackendStatus:
    """A snapshot of one backend's health, for the API and metrics."""

    name: str
    address: str
    kind: str
    up: bool  # reported verdict (what the weights see)
    raw_up: bool  # rise/fall verdict before damping
    suppressed: bool  # held down by flap damping
    penalty: float  # damping penalty now
    successes: int  # consecutive
    failures: int  # consecutive
    rtt_ms: float | None  # last probe's RTT; None when it failed or none yet
    last_reason: str  # last probe's reason ("ok", "timeout", ...); "" before any
    probes: int
    failed: int
    held: int  # recoveries held back by damping


@dataclass(slots=True)
class _Backend:
    address: str
    config: ProbeConfig
    state: HealthState
    rtt_ms: float | None = None
    last_reason: str = ""
    probes: int = 0
    failed: int = 0


def _canonical(address: str, kind: str) -> str:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        raise ValueError(f"backend address {address!r} is not an IP address (names are "
                         "resolved when the configuration is loaded, not per probe)") from None
    if kind == "icmp" and ip.version != 4:
        raise ValueError(f"ICMP probes are IPv4 only for now: {address!r}")
    return str(ip)


class HealthChecker:
    """Probes backends and reports their up/down transitions and RTTs.

    Create it inside the running event loop and call its methods from that loop.
    Transitions go to ``on_transition`` if given (called synchronously, in the
    loop; exceptions are logged and counted), else to the :attr:`transitions`
    queue. ``on_result`` (optional) sees every probe outcome, for metrics.

    ICMP needs a raw socket (root) or a ping socket; the checker opens one, shared
    by all ICMP backends, when the first ICMP backend is added (``icmp_mode``),
    unless ``pinger`` is given (then the caller owns it and closes it). TCP
    backends share one TcpConnector, opened with the first of them.

    Sockets live in the network namespace of the thread that creates them: to
    probe from the appliance's namespace, run the loop in a thread that first
    calls ``netns.enter_netns(name)``.
    """

    def __init__(self, on_transition: Callable[[Transition], object] | None = None, *,
                 on_result: Callable[[ProbeOutcome], object] | None = None,
                 pinger: IcmpPinger | None = None, icmp_mode: Mode = "auto",
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self._on_transition = on_transition
        self._on_result = on_result
        #: Transitions, when no on_transition callback was given (unbounded:
        #: transitions are rare, and damping bounds a flapping backend's share).
        self.transitions: asyncio.Queue[Transition] | None = (
            None if on_transition is not None else asyncio.Queue())
        self._pinger = pinger
        self._own_pinger = pinger is None
        self._tcp: TcpConnector | None = None
        self._icmp_mode: Mode = icmp_mode
        self._clock = clock
        self._wall = wall_clock
        self._backends: dict[str, _Backend] = {}
        self._scheduler = ProbeScheduler(self._outcome)
        self._closed = False
        self.probes = 0
        self.failed = 0
        self.callback_errors = 0

    # -- backends --

    def add(self, name: str, address: str, config: ProbeConfig) -> None:
        """Start probing backend ``name`` at ``address`` (an IP literal).

        It starts in ``config.initial`` state (up by default) and is first probed
        within one interval. ValueError for a bad name, address or a duplicate;
        ProbeError when ICMP is asked for and no ICMP socket can be had."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"backend name {name!r} must be a non-empty string")
        if name in self._backends:
            raise ValueError(f"backend {name!r} is already probed")
        address = _canonical(address, config.kind)
        probe = self._probe_fn(address, config)
        self._backends[name] = _Backend(address, config, HealthState(config))
        self._scheduler.add(name, config.interval_s, probe)

    def update(self, name: str, address: str, config: ProbeConfig) -> None:
        """Change a backend's address or probe configuration in place: its verdict
        and damping penalty stay, its success/failure runs restart."""
        backend = self._backends[name]
        address = _canonical(address, config.kind)
        probe = self._probe_fn(address, config)
        backend.address = address
        backend.config = config
        backend.state.reconfigure(config)
        self._scheduler.update(name, config.interval_s, probe)

    def remove(self, name: str) -> None:
        """Stop probing ``name`` and forget it (no transition is reported)."""
        del self._backends[name]
        self._scheduler.remove(name)

    def __contains__(self, name: object) -> bool:
        return name in self._backends

    def names(self) -> list[str]:
        return sorted(self._backends)

    # -- verdicts --

    def is_up(self, name: str) -> bool:
        return self._backends[name].state.up

    def rtt_ms(self, name: str) -> float | None:
        """Last probe's RTT in ms: the ``NodeSample.rtt_ms`` input of weights.py.
        None when the last probe failed or none has completed yet."""
        return self._backends[name].rtt_ms

    def rtts(self) -> dict[str, float | None]:
        return {name: b.rtt_ms for name, b in sorted(self._backends.items())}

    def status(self, name: str) -> BackendStatus:
        b = self._backends[name]
        s = b.state
        return BackendStatus(
            name=name, address=b.address, kind=b.config.kind, up=s.up, raw_up=s.raw_up,
            suppressed=s.damper.suppressed, penalty=s.damper.penalty(self._clock()),
            successes=s.successes, failures=s.failures, rtt_ms=b.rtt_ms,
            last_reason=b.last_reason, probes=b.probes, failed=b.failed, held=s.held)

    def stats(self) -> dict[str, int]:
        """Counters for metrics: probes, failures, missed slots, errors, ICMP drops."""
        out = {
            "backends": len(self._backends),
            "probes": self.probes,
            "failed": self.failed,
            "missed_slots": self._scheduler.missed,
            "probe_errors": self._scheduler.probe_errors,
            "callback_errors": self.callback_errors + self._scheduler.callback_errors,
        }
        if self._pinger is not None:
            out.update({f"icmp_{k}": v for k, v in self._pinger.counters.items()})
        if self._tcp is not None:
            out.update({f"tcp_{k}": v for k, v in self._tcp.counters.items()})
        return out

    @property
    def pinger(self) -> IcmpPinger | None:
        return self._pinger

    # -- life cycle --

    def close(self) -> None:
        """Stop all probing; closes the ICMP socket if the checker opened it."""
        if self._closed:
            return
        self._closed = True
        self._scheduler.close()
        if self._pinger is not None and self._own_pinger:
            self._pinger.close()
        if self._tcp is not None:
            self._tcp.close()

    async def __aenter__(self) -> HealthChecker:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    # -- internals --

    def _probe_fn(self, address: str, config: ProbeConfig) -> ProbeFn:
        timeout = config.timeout
        if config.kind == "icmp":
            pinger = self._icmp()
            return lambda: pinger.ping(address, timeout)
        port = config.effective_port
        assert port is not None  # ProbeConfig requires it for tcp, defaults it for http
        if config.kind == "tcp":
            connector = self._connector()
            family = family_of(address)
            return lambda: connector.connect(address, port, timeout, family)
        return lambda: http_get(address, port, timeout, path=config.path, host=config.host,
                                accepts=config.accepts)

    def _connector(self) -> TcpConnector:
        if self._closed:
            raise ProbeError("health checker is closed")
        if self._tcp is None:
            self._tcp = TcpConnector()
        return self._tcp

    def _icmp(self) -> IcmpPinger:
        if self._closed:
            raise ProbeError("health checker is closed")
        if self._pinger is None:
            self._pinger = IcmpPinger(mode=self._icmp_mode)
        return self._pinger

    def _outcome(self, outcome: ProbeOutcome) -> None:
        backend = self._backends.get(outcome.name)
        if backend is None:
            return
        result = outcome.result
        self.probes += 1
        backend.probes += 1
        if not result.ok:
            self.failed += 1
            backend.failed += 1
        backend.rtt_ms = result.rtt_ms
        backend.last_reason = result.reason
        now = self._clock()
        verdict = backend.state.record(result.ok, result.reason, now)
        if verdict is not None:
            up, why = verdict
            self._deliver(Transition(outcome.name, up, why, self._wall(), now))
        if self._on_result is not None:
            try:
                self._on_result(outcome)
            except Exception:
                self.callback_errors += 1
                log.exception("on_result handler failed")

    def _deliver(self, transition: Transition) -> None:
        log.info("backend %s is %s: %s", transition.backend,
                 "up" if transition.up else "down", transition.reason)
        if self._on_transition is None:
            assert self.transitions is not None
            self.transitions.put_nowait(transition)
            return
        try:
            self._on_transition(transition)
        except Exception:
            self.callback_errors += 1
            log.exception("on_transition handler failed")
