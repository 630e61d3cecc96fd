"""The health checker: probes every backend and turns results into up/down.

Glue between the scheduler (when), the probes (how) and the health state (what it
means). This is the one object the controller holds.

A local failure is never a backend failure: results the appliance's own side
spoiled (unknown, ``ProbeResult.local``) are counted, per backend and per cause,
and raise an alarm (:meth:`HealthChecker.alarm`), but never reach a backend's
verdict or its damping.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import math
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from hpclb.config.probes import ProbeConfig

from .http import default_server_name, http_get, tls_context
from .icmp import IcmpPinger, Mode
from .result import LOCAL_CAUSES, TIMEOUT, ProbeError, ProbeResult
from .rise_fall import HealthState, Transition
from .scheduler import LoopStalls, ProbeFn, ProbeOutcome, ProbeScheduler, stall_during
from .tcp import TcpConnector, socket_family

log = logging.getLogger(__name__)

#: The alarm holds while local errors happened this recently (seconds).
ALARM_HOLD_S = 10.0
#: A timeout is not judged when the loop was blind for more than this fraction
#: of the probe's timeout while the probe was owed attention (see judge).
STALL_FRACTION = 0.5
#: A damping penalty below this is no longer worth refreshing in views().
_PENALTY_SHOWN_MIN = 0.01


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
    rtt_ms: float | None  # last judged probe's RTT; None when it failed or none yet
    last_reason: str  # last probe's reason ("ok", "timeout", ...); "" before any
    probes: int
    failed: int
    held: int  # recoveries held back by damping
    unknown: int  # probes that ended unknown (a local error; not in `failed`)
    last_unknown: bool  # the last probe ended unknown
    release_at: float | None  # wall clock when the damping penalty decays below
    # reuse (the release comes with the first result after it); None unless suppressed


@dataclass(slots=True)
class _Backend:
    address: str
    config: ProbeConfig
    state: HealthState
    rtt_ms: float | None = None
    last_reason: str = ""
    probes: int = 0
    failed: int = 0
    unknown: int = 0
    last_unknown: bool = False


class _LocalErrors:
    """Local errors of the last ALARM_HOLD_S seconds, counted in one-second
    buckets (bounded memory however many probes fail at once), and whether the
    alarm they raise is on."""

    __slots__ = ("active", "buckets", "episode", "last_at", "last_reason")

    def __init__(self) -> None:
        self.buckets: deque[list[int]] = deque()  # [second, count], oldest first
        self.last_at: float | None = None
        self.last_reason = ""
        self.active = False
        self.episode = 0  # local errors since the alarm went on

    def add(self, now: float, reason: str) -> None:
        second = math.floor(now)
        if self.buckets and self.buckets[-1][0] >= second:  # (a clock stepping back too)
            self.buckets[-1][1] += 1
        else:
            self.buckets.append([second, 1])
        self.last_at = now
        self.last_reason = reason
        self.episode += 1
        self._prune(now)

    def count(self, now: float) -> int:
        self._prune(now)
        return sum(n for _, n in self.buckets)

    def recent(self, now: float) -> bool:
        return self.last_at is not None and now - self.last_at < ALARM_HOLD_S

    def _prune(self, now: float) -> None:
        while self.buckets and self.buckets[0][0] + 1 <= now - ALARM_HOLD_S:
            self.buckets.popleft()


def _clock_text(wall: float) -> str:
    return datetime.fromtimestamp(wall).isoformat(sep=" ", timespec="seconds")


def _canonical(address: str, kind: str) -> str:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        raise ValueError(f"backend address {address!r} is not an IP address (names are "
                         "resolved when the configuration is loaded, not per probe)") from None
    if getattr(ip, "scope_id", None):
        # A link-local address needs its interface on every send; backends are
        # reached by routable (global or unique local) addresses.
        raise ValueError(f"backend address {address!r}: a scoped (link-local) address "
                         f"cannot be probed by {kind}; give a routable one")
    return str(ip)


def judge(outcome: ProbeOutcome, timeout: float, stalls: LoopStalls) -> ProbeResult:
    """``outcome``'s result as evidence about the target: a timeout taken while our
    own loop was not looking is unknown (cause "loop_stall"); anything else as is.

    The rule: a timeout does not count when the loop was blind for more than half
    the probe's timeout in one stretch between the probe's slot and its result
    (stall_during: a late launch, a late verdict, or a stall the loop watch saw in
    between). Why it is robust: an answer that arrives while the loop is blind
    waits in the kernel and is read as soon as the loop runs again, so a short
    stall costs nothing; only a stall that reaches the deadline (answers and
    expiries then race, and expiries run in batches) or that eats the time a
    multi-step probe (HTTP) needs turns an answer into a timeout, and a stall that
    long leaves the probe less than half its time to be heard. Shorter ones are
    ordinary jitter, and a dead backend's timeouts keep counting through them.
    The price: a loop that stalls all the time judges no timeout at all, which
    the alarm then says.
    """
    result = outcome.result
    if result.ok or result.local or result.reason != TIMEOUT.reason:
        return result
    stall = stall_during(outcome, timeout, stalls)
    if stall <= timeout * STALL_FRACTION:
        return result
    return ProbeResult.local_error(
        f"timeout not judged: event loop stalled {stall * 1000:.0f} ms", "loop_stall")


class HealthChecker:
    """Probes backends and reports their up/down transitions and RTTs.

    Create it inside the running event loop and call its methods from that loop.
    Transitions go to ``on_transition`` if given (called synchronously, in the
    loop; exceptions are logged and counted), else to the :attr:`transitions`
    queue. ``on_result`` (optional) sees every probe outcome, for metrics.

    ICMP needs a raw socket (root) or a ping socket; the checker opens one per
    family (ICMP for IPv4 backends, ICMPv6 for IPv6 ones), shared by all ICMP
    backends of that family, when the first of them is added (``icmp_mode``),
    unless ``pinger`` is given (then it serves its family, and the caller owns it
    and closes it). TCP backends share one TcpConnector, opened with the first of
    them. HTTPS backends share one TLS context per (verify, ca_file).

    Sockets live in the network namespace of the thread that creates them: to
    probe from the appliance's namespace, run the loop in a
    :class:`hpclb.host.loop_thread.LoopThread` given that namespace.
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
        # One pinger per address family, opened when first needed.
        self._pingers: dict[int, IcmpPinger] = {} if pinger is None else {pinger.family: pinger}
        self._given_pinger = pinger
        self._tls: dict[tuple[bool, str | None], ssl.SSLContext] = {}
        self._tcp: TcpConnector | None = None
        self._icmp_mode: Mode = icmp_mode
        self._clock = clock
        self._wall = wall_clock
        self._backends: dict[str, _Backend] = {}
        self._scheduler = ProbeScheduler(self._outcome)
        self._closed = False
        self.probes = 0
        self.failed = 0
        #: Probes that ended unknown (a local error), in all and by cause.
        self.unknown = 0
        self._unknown_by_cause: dict[str, int] = dict.fromkeys(LOCAL_CAUSES, 0)
        self._local = _LocalErrors()
        self.callback_errors = 0
        # views(): the last view of each backend, and who needs a new one.
        self._views: dict[str, dict[str, Any]] = {}
        self._dirty: set[str] = set()
        self._penalised: set[str] = set()  # penalty decaying: its view changes with time

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
        self._dirty.add(name)

    def update(self, name: str, address: str, config: ProbeConfig) -> None:
        """Change a backend's address or probe configuration in place: its verdict
        and damping penalty stay, its success/failure runs restart."""
        backend = self._backends[name]
        address = _canonical(address, config.kind)
        probe = self._probe_fn(address, config)
        backend.address = address
        backend.config = config
        was_held = backend.state.held_out
        backend.state.reconfigure(config)  # damping turned off ends a suppression
        if backend.state.held_out != was_held:
            self._log_damping(name, backend, self._clock())
        self._scheduler.update(name, config.interval_s, probe)
        self._dirty.add(name)

    def remove(self, name: str) -> None:
        """Stop probing ``name`` and forget it (no transition is reported)."""
        del self._backends[name]
        self._scheduler.remove(name)
        self._views.pop(name, None)
        self._dirty.discard(name)
        self._penalised.discard(name)

    def __contains__(self, name: object) -> bool:
        return name in self._backends

    def names(self) -> list[str]:
        return sorted(self._backends)

    # -- verdicts --

    def is_up(self, name: str) -> bool:
        return self._backends[name].state.up

    def rtt_ms(self, name: str) -> float | None:
        """Last judged probe's RTT in ms: the ``NodeSample.rtt_ms`` input of
        hpclb.balancing.weights. None when it failed or none has completed yet; an unknown
        result leaves it as it was (it measured nothing about the backend)."""
        return self._backends[name].rtt_ms

    def rtts(self) -> dict[str, float | None]:
        return {name: b.rtt_ms for name, b in sorted(self._backends.items())}

    def status(self, name: str) -> BackendStatus:
        b = self._backends[name]
        s = b.state
        now = self._clock()
        return BackendStatus(
            name=name, address=b.address, kind=b.config.kind, up=s.up, raw_up=s.raw_up,
            suppressed=s.damper.suppressed, penalty=s.damper.penalty(now),
            successes=s.successes, failures=s.failures, rtt_ms=b.rtt_ms,
            last_reason=b.last_reason, probes=b.probes, failed=b.failed, held=s.held,
            unknown=b.unknown, last_unknown=b.last_unknown,
            release_at=self._release_at(s, now))

    def stats(self) -> dict[str, int]:
        """Counters for metrics: probes, failures, unknown results (in all and
        ``unknown_<cause>`` for every cause in LOCAL_CAUSES), missed slots, errors,
        ICMP (``icmp_*``; ICMPv6: ``icmp6_*``) and TCP counters."""
        out = {
            "backends": len(self._backends),
            "probes": self.probes,
            "failed": self.failed,
            "unknown": self.unknown,
            **{f"unknown_{cause}": n for cause, n in self._unknown_by_cause.items()},
            "loop_stalls": self._scheduler.stalls.count,
            "missed_slots": self._scheduler.missed,
            "probe_errors": self._scheduler.probe_errors,
            "callback_errors": self.callback_errors + self._scheduler.callback_errors,
        }
        for family, pinger in sorted(self._pingers.items()):
            prefix = "icmp6" if family == socket.AF_INET6 else "icmp"
            out.update({f"{prefix}_{k}": v for k, v in pinger.counters.items()})
        if self._tcp is not None:
            out.update({f"tcp_{k}": v for k, v in self._tcp.counters.items()})
        return out

    def views(self) -> dict[str, dict[str, Any]]:
        """Every backend as plain data, for snapshots: {name: {"up", "raw_up",
        "unknown" (the last result was unknown), "suppressed", "penalty",
        "release_at", "last_reason", "rtt_ms", "failures", "successes"}}, the
        meanings of BackendStatus. A new outer dict each call; the inner ones are
        shared between calls and must not be changed.

        Incremental: only backends probed or changed since the last call (and
        those whose damping penalty is still decaying) are looked at again, since
        rebuilding 10,000 views twice a second would stall the probe loop itself.
        """
        now = self._clock()
        wall = self._wall()
        for name in self._dirty | self._penalised:
            backend = self._backends.get(name)
            if backend is None:
                continue
            view = self._views[name] = self._view(backend, now, wall)
            if view["penalty"] < _PENALTY_SHOWN_MIN:
                self._penalised.discard(name)
        self._dirty.clear()
        return dict(self._views)

    def alarm(self, now: float) -> str | None:
        """A sentence for operators while probes met local errors in the last
        ALARM_HOLD_S seconds (``now`` on the checker's monotonic clock), else None.
        Its start is logged once (WARNING) and so is its end (INFO)."""
        if not self._alarm_update(now):
            return None
        return self._alarm_text(now)

    @property
    def pinger(self) -> IcmpPinger | None:
        """The IPv4 pinger, if one is open (``pingers`` has both families)."""
        return self._pingers.get(socket.AF_INET)

    @property
    def pingers(self) -> dict[int, IcmpPinger]:
        """{address family: its pinger}, for the families probed so far."""
        return dict(self._pingers)

    # -- life cycle --

    def close(self) -> None:
        """Stop all probing; closes the ICMP socket if the checker opened it."""
        if self._closed:
            return
        self._closed = True
        self._scheduler.close()
        for pinger in self._pingers.values():
            if pinger is not self._given_pinger:
                pinger.close()
        if self._tcp is not None:
            self._tcp.close()

    async def __aenter__(self) -> HealthChecker:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    # -- internals --

    def _probe_fn(self, address: str, config: ProbeConfig) -> ProbeFn:
        timeout = config.timeout
        family = socket_family(address)
        if config.kind == "icmp":
            pinger = self._icmp(family)
            return lambda: pinger.ping(address, timeout)
        port = config.effective_port
        assert port is not None  # ProbeConfig requires it for tcp, defaults it for http(s)
        if config.kind == "tcp":
            connector = self._connector()
            return lambda: connector.connect(address, port, timeout, family)
        if config.kind == "https":
            tls = self._tls_context(config)
            name = config.server_name or default_server_name(address, config.host)
            return lambda: http_get(address, port, timeout, path=config.path,
                                    host=config.host, accepts=config.accepts, tls=tls,
                                    server_name=name)
        return lambda: http_get(address, port, timeout, path=config.path, host=config.host,
                                accepts=config.accepts)

    def _tls_context(self, config: ProbeConfig) -> ssl.SSLContext:
        """One context per (verify, ca_file), shared: loading a CA bundle per
        backend would cost 10,000 loads of the same file. ValueError when the CA
        file cannot be used."""
        ca_file = None if config.ca_file is None else str(config.ca_file)
        key = (config.verify, ca_file)
        if key not in self._tls:
            self._tls[key] = tls_context(config.verify, ca_file)
        return self._tls[key]

    def _connector(self) -> TcpConnector:
        if self._closed:
            raise ProbeError("health checker is closed")
        if self._tcp is None:
            self._tcp = TcpConnector()
        return self._tcp

    def _icmp(self, family: socket.AddressFamily) -> IcmpPinger:
        if self._closed:
            raise ProbeError("health checker is closed")
        pinger = self._pingers.get(family)
        if pinger is None:
            pinger = self._pingers[family] = IcmpPinger(mode=self._icmp_mode, family=family)
        return pinger

    def _outcome(self, outcome: ProbeOutcome) -> None:
        backend = self._backends.get(outcome.name)
        if backend is None:
            return
        result = judge(outcome, backend.config.timeout, self._scheduler.stalls)
        if result is not outcome.result:
            outcome = dataclasses.replace(outcome, result=result)
        self.probes += 1
        backend.probes += 1
        backend.last_reason = result.reason
        backend.last_unknown = result.local
        self._dirty.add(outcome.name)
        now = self._clock()
        if result.local:
            self._unknown(backend, result, now)
        else:
            self._verdict(outcome.name, backend, result, now)
        self._alarm_update(now)
        if self._on_result is not None:
            try:
                self._on_result(outcome)
            except Exception:
                self.callback_errors += 1
                log.exception("on_result handler failed")

    def _unknown(self, backend: _Backend, result: ProbeResult, now: float) -> None:
        # Counted, and nothing else: the verdict, the runs, the damping and the
        # RTT stay as the last judged probe left them.
        self.unknown += 1
        backend.unknown += 1
        cause = result.cause if result.cause in self._unknown_by_cause else "other"
        self._unknown_by_cause[cause] += 1
        self._local.add(now, result.reason)

    def _verdict(self, name: str, backend: _Backend, result: ProbeResult, now: float) -> None:
        if not result.ok:
            self.failed += 1
            backend.failed += 1
        backend.rtt_ms = result.rtt_ms
        state = backend.state
        was_held = state.held_out
        verdict = state.record(result.ok, result.reason, now)
        if verdict is not None:
            up, why = verdict
            self._deliver(Transition(name, up, why, self._wall(), now))
        if state.held_out != was_held:
            self._log_damping(name, backend, now)
        if state.damper.penalty(now) >= _PENALTY_SHOWN_MIN:
            self._penalised.add(name)

    @staticmethod
    def _view(backend: _Backend, now: float, wall: float) -> dict[str, Any]:
        state = backend.state
        damper = state.damper
        release = damper.release_time()
        return {"up": state.up, "raw_up": state.raw_up, "unknown": backend.last_unknown,
                "suppressed": damper.suppressed, "penalty": damper.penalty(now),
                "release_at": None if release is None else wall + (release - now),
                "last_reason": backend.last_reason, "rtt_ms": backend.rtt_ms,
                "failures": state.failures, "successes": state.successes}

    def _release_at(self, state: HealthState, now: float) -> float | None:
        release = state.damper.release_time()
        return None if release is None else self._wall() + (release - now)

    def _log_damping(self, name: str, backend: _Backend, now: float) -> None:
        """A backend held out by damping answers yet stays down: one warning when
        that starts, one info line when damping lets it go, else it is invisible.

        Logged when it answers again (raw up while suppressed), not when the
        suppression starts with a down: that recovery is itself a change and
        adds a penalty, so only now is the expected release time right. A
        suppression that starts and ends while the backend is down anyway is
        only in the transition's reason.
        """
        state = backend.state
        damper = state.damper
        cfg = damper.config
        if state.held_out:
            release = self._release_at(state, now)
            assert release is not None
            log.warning("backend %s: answers again but flap damping holds it out: penalty "
                        "%.0f (suppress at %g, reuse below %g); release expected at %s "
                        "(in %.0f s) if it stops flapping", name, damper.penalty(now),
                        cfg.suppress, cfg.reuse, _clock_text(release), release - self._wall())
        elif not damper.suppressed:  # else it went down again: that is no release
            log.info("backend %s: flap damping released (penalty %.0f, reuse below %g)%s",
                     name, damper.penalty(now), cfg.reuse,
                     "; back in service" if state.up else "")

    def _alarm_text(self, now: float) -> str:
        n = self._local.count(now)
        return (f"probes: {n} local error{'' if n == 1 else 's'} in the last "
                f"{ALARM_HOLD_S:g} s (last: {self._local.last_reason}); verdicts held")

    def _alarm_update(self, now: float) -> bool:
        """Whether the alarm is on at ``now``; logs its start and its end."""
        errors = self._local
        on = errors.recent(now)
        if on and not errors.active:
            errors.active = True
            log.warning("%s", self._alarm_text(now))
        elif errors.active and not on:
            errors.active = False
            log.info("probes: no local error for %g s (%d in all since the alarm began); "
                     "verdicts judged again", ALARM_HOLD_S, errors.episode)
            errors.episode = 0
        return on

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
