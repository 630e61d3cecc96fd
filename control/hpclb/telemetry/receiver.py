"""The control plane's telemetry receiver: CURVE-authenticated ZeroMQ PULL socket.

    rx = TelemetryReceiver("tcp://0.0.0.0:5557", Path("/etc/hpclb/curve/server.key_secret"),
                           Path("/etc/hpclb/agents"), on_message)
    await rx.start(); ...; await rx.stop()          # inside an asyncio loop, or
    th = ReceiverThread(rx); th.start(); ...; th.stop()   # from synchronous code

Where: ``bind`` is ``tcp://ADDRESS:PORT``, an IPv4 address or an IPv6 one in
brackets (``tcp://[fd00::1]:5557``): the listener is then an AF_INET6 socket and
libzmq's gets ZMQ_IPV6. Agents dial it by that address; nothing below depends on
the family (the ZAP decision is made on the CURVE key alone, never on the peer's
address, and connections are counted by file descriptor).

Who may send: the allow-list directory holds one pyzmq public certificate per
agent, named ``<node id>.key`` (``hpclb-agent keygen DIR --name <node id>`` writes
it). A CURVE handshake from any other key is refused by the ZAP handler and counted
per key (its first 8 z85 characters). The file name binds the key to a node: a
message from an allowed key that names another node is refused and counted, so an
agent cannot speak for a node it is not. ``reload_allow_list()`` re-reads the
directory (a removed key is refused from its next message on, even on an open
connection).

What gets through: each agent may send ``max_rate_per_agent`` messages a second
(a token bucket per node, burst twice that), checked from the frame's CURVE
User-Id *before* decoding, so a flooding key costs a dictionary lookup per
message; the excess is dropped and counted per node. Each payload is then decoded
by :func:`hpclb.telemetry.message.decode`; a malformed one is counted by reason and
dropped. A valid one goes to ``on_message(msg, identity)`` at once, in the
receiver's event loop (the controller stamps its arrival there); an exception
there is logged and counted, never fatal. Measured values are not judged here
(NaN, negatives...): that is WeightTracker.observe's job.

Connections that never authenticate (idle TCP, garbage, port scans) cost a file
descriptor each, and the controller shares its descriptor limit with the health
probes. Two defences:

* ``ZMQ_HANDSHAKE_IVL`` (``handshake_timeout_s``): libzmq closes a connection whose
  ZMTP/CURVE handshake has not completed in time. Measured with libzmq 4.3.5: an
  idle connection yields HANDSHAKE_FAILED_NO_DETAIL then DISCONNECTED(fd) at the
  deadline; garbage yields DISCONNECTED alone (or FAILED_PROTOCOL first) at once.
* A bound on connections accepted but not authenticated (``max_unauthenticated``),
  counted from the socket monitor (ACCEPTED(fd), HANDSHAKE_SUCCEEDED,
  DISCONNECTED(fd), see :class:`_Connections`). At the bound the receiver stops
  *accepting* until half of them are gone: we own the listening socket and hand
  libzmq a duplicate (``ZMQ_USE_FD``), so we can attach a socket filter to it that
  drops incoming SYNs. Connections in progress and open ones are untouched; a new
  peer's kernel retransmits its SYN (1 s, 3 s, ...) and gets in once the pause
  ends; the port stays ours, and the kernel's accept queue (BACKLOG) is the only
  overshoot. Why not unbind()/bind() (measured, libzmq 4.3.5): unbind closes every
  connection accepted through that endpoint, authenticated agents included, and
  reports no DISCONNECTED for them (only CLOSED for the listener). Under a
  sustained flood every pause would cut off the whole fleet, which then races the
  attacker to reconnect. Unbinding is kept for one case only: an accept that fails
  for want of resources (EMFILE, ENFILE, ENOBUFS, ENOMEM). libzmq retries such an
  accept in a busy loop (100 % CPU, an ACCEPT_FAILED event per try) as long as a
  connection waits; only removing the listener stops it. The receiver unbinds (its
  connections close, which frees descriptors), waits ACCEPT_PAUSE_S (doubling
  while it recurs), and binds the same socket again: same port, and connections
  made meanwhile wait in the kernel's queue. No descriptor taken from a monitor
  event is ever closed or shut down here: it may already belong to another socket.

Trouble of its own, so that the controller can tell "the agent went quiet" from
"we could not hear it": :meth:`TelemetryReceiver.trouble` gives (monotonic time,
reason) of the latest local trouble: listener paused or closed, accepts failing,
unauthenticated connections at the bound, the event loop running late by more than
LAG_S (a ticker every TICK_S measures it; a loop that stops turning is reported as
stalled by trouble() itself, from any thread), the receive queue not drained for
LAG_S. :meth:`TelemetryReceiver.alarm` words it while it is under ALARM_HOLD_S old;
its start and its end are logged once.

Threads: everything runs in one event loop (the ZAP handler included), so the
counters need no lock. Other threads read :meth:`ReceiverThread.snapshot` (a dict
the loop rebuilds every SNAPSHOT_EVERY_S and within TICK_S of a change, never
changed once published) and trouble() (one attribute holding a tuple), both
without waiting on the loop.

Monitor events travel through an in-process pipe. When it is full (about a
thousand events behind), libzmq's I/O thread blocks in the send, holding the
socket's monitor lock, and every connection stalls until the loop catches up
(measured). So the loop reads events in large batches, and never calls
``disable_monitor()``: that takes the same lock and, with the pipe full, hangs the
whole process (pyzmq keeps the GIL) -- measured with 3,000 connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import inspect
import ipaddress
import logging
import os
import re
import socket
import struct
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

from hpclb.host.loop_thread import LoopThread
from hpclb.telemetry.message import (
    DECODE_REASONS,
    MAX_MESSAGE_BYTES,
    NODE_ID_PATTERN,
    TelemetryError,
    TelemetryMessage,
    decode,
)

log = logging.getLogger(__name__)

ZAP_DOMAIN = "hpclb-telemetry"
#: libzmq drops the connection of a peer that sends a larger message, before it is
#: buffered whole; between MAX_MESSAGE_BYTES and this, it is read and counted.
HARD_MAX_BYTES = 1 << 20
#: Per connection (PULL has one queue per peer): an agent may send 2x its rate
#: limit in a burst, so 100 is seconds of backlog, while a flooding peer beyond
#: it is pushed back by TCP instead of growing our memory (up to HARD_MAX_BYTES each).
RCVHWM = 100
MAX_TRACKED_KEYS = 256  # distinct refused keys counted apart; the rest in "other"
#: Why a message was dropped, the keys of counters()["malformed"].
MALFORMED_REASONS: tuple[str, ...] = (*DECODE_REASONS, "multipart")
#: The kernel's queue of connections established but not yet accepted: the most
#: the unauthenticated count can overshoot its bound once SYNs are dropped.
BACKLOG = 128
RECEIVE_BATCH = 256  # messages read per turn before other tasks (ZAP, monitor) run
MONITOR_BATCH = 2048  # monitor events read per turn: libzmq blocks when ~1000 wait
TICK_S = 0.1  # the ticker's period: trouble checks, listener resumes, snapshots
LAG_S = 1.0  # the loop running this late, or the queue undrained this long: trouble
SNAPSHOT_EVERY_S = 0.5  # the snapshot's age at most while the loop turns
ALARM_HOLD_S = 10.0  # an alarm stays this long after its trouble was last seen
ACCEPT_PAUSE_S = 1.0  # the listener stays closed this long after a failed accept...
ACCEPT_PAUSE_MAX_S = 30.0  # ...doubling up to this while failures recur
ACCEPT_CALM_S = 60.0  # failures further apart than this start again from ACCEPT_PAUSE_S
#: accept() errnos that mean "out of resources", where libzmq spins (see module doc);
#: others (ECONNABORTED...) are a peer's doing and cost nothing.
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: A connection still pending this long after its handshake deadline has in fact
#: authenticated (libzmq would have closed it): slack for the monitor's delay.
AGE_SLACK_S = 1.0

_MONITOR_EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_ACCEPT_FAILED | zmq.EVENT_CLOSED
                   | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
                   | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                   | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
# Plain ints: IntFlag arithmetic is slow, and these are used per message.
_POLLIN, _NOBLOCK = int(zmq.POLLIN), int(zmq.NOBLOCK)
_HANDSHAKE_EVENTS = {zmq.EVENT_HANDSHAKE_SUCCEEDED: "ok",
                     zmq.EVENT_HANDSHAKE_FAILED_AUTH: "failed_auth",
                     zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "failed_protocol",
                     zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "failed_no_detail"}

# Linux socket filter (classic BPF) that drops TCP segments with SYN set: on a
# listening socket, that refuses new connections and nothing else. For TCP the
# filter sees the segment from its TCP header; byte 13 holds the flags.
_SO_ATTACH_FILTER, _SO_DETACH_FILTER = 26, 27  # asm-generic; not in the socket module
_DROP_SYN = b"".join(struct.pack("=HBBI", *insn) for insn in (
    (0x30, 0, 0, 13),  # ldb [13]
    (0x45, 0, 1, 0x02),  # jset #SYN: next, else skip one
    (0x06, 0, 0, 0),  # ret #0: drop
    (0x06, 0, 0, 0xFFFFFFFF),  # ret #-1: keep all
))

OnMessage = Callable[[TelemetryMessage, "AgentIdentity"], Awaitable[None] | None]
Trouble = tuple[float, str]
T = TypeVar("T")


class AllowListError(Exception):
    """The allow-list directory or one of its files is unusable (message names it)."""


@dataclass(frozen=True, slots=True)
class AgentIdentity:
    """Who sent a message, as CURVE authenticated it."""

    node: str  # the node id bound to the key (its allow-list file name)
    key: str  # the agent's public key, z85 (40 characters)

    @property
    def key_id(self) -> str:
        """Short form of the key for logs and counters."""
        return self.key[:8]


def load_allow_list(directory: Path) -> dict[str, str]:
    """{z85 public key: node id} from the ``<node id>.key`` files of ``directory``."""
    if not directory.is_dir():
        raise AllowListError(f"allow-list directory {directory} does not exist")
    allowed: dict[str, str] = {}
    source: dict[str, Path] = {}
    for path in sorted(directory.glob("*.key")):
        node = path.stem
        if not re.fullmatch(NODE_ID_PATTERN, node):
            raise AllowListError(f"{path}: {node!r} is not a node id")
        try:
            public, _ = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as err:
            raise AllowListError(f"{path}: not a CURVE certificate ({err})") from None
        key = public.decode("ascii", "replace")
        if len(key) != 40:
            raise AllowListError(f"{path}: public key is not 40 z85 characters")
        if key in allowed:
            raise AllowListError(f"{path} and {source[key]} hold the same key: "
                                 "which node is it?")
        allowed[key], source[key] = node, path
    return allowed


def load_server_key(path: Path) -> tuple[bytes, bytes]:
    """(public, secret) of the control plane's CURVE key file; AllowListError if it
    is not a certificate or holds no secret key."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as err:
        raise AllowListError(f"{path}: not a CURVE certificate ({err})") from None
    if not secret:
        raise AllowListError(f"{path}: has no secret key (give the .key_secret file)")
    return public, secret


class _KeyCheck:
    """pyzmq's credentials-provider shape for configure_curve_callback."""

    def __init__(self, check: Callable[[bytes], bool]) -> None:
        self._check = check

    def callback(self, domain: str, key: bytes) -> bool:
        return self._check(key)


def _errno_text(code: int) -> str:
    return f"{os.strerror(code)} ({errno.errorcode.get(code, code)})"


def _recv_message(raw: zmq.Socket[Any]) -> list[zmq.Frame]:
    """One message, all its parts (zmq.Again if none is waiting)."""
    frames = [raw.recv(_NOBLOCK, copy=False)]
    while frames[-1].more:  # the parts of a message arrive together
        frames.append(raw.recv(_NOBLOCK, copy=False))
    return frames


@contextlib.asynccontextmanager
async def _readable(raw: zmq.Socket[Any]) -> AsyncIterator[Callable[[], Awaitable[None]]]:
    """A wait() that returns when ``raw`` may have a message: a reader on its
    ZMQ_FD, far cheaper than pyzmq's asyncio poll. ZMQ_FD is edge-triggered: it
    signals a change, so wait() first checks ZMQ_EVENTS (which also re-arms it)."""
    loop = asyncio.get_running_loop()
    ready = asyncio.Event()
    fd = raw.getsockopt(zmq.FD)

    async def wait() -> None:
        while not raw.getsockopt(zmq.EVENTS) & _POLLIN:
            ready.clear()
            await ready.wait()

    loop.add_reader(fd, ready.set)
    try:
        yield wait
    finally:
        loop.remove_reader(fd)


# -- the listening socket ----------------------------------------------------------


def _parse_bind(bind: str) -> tuple[socket.AddressFamily, tuple[str, int]]:
    """(family, (address, port)) of ``tcp://ADDRESS:PORT``: an IP address, ``[v6]``
    or ``*``, and a port (``*`` or 0: any). zmq.ZMQError(EINVAL) otherwise, as
    libzmq's bind would raise."""
    m = re.fullmatch(r"tcp://(\[[^\]]+\]|[^:\[\]]+):(\*|\d{1,5})", bind)
    try:
        if m is None:
            raise ValueError("not tcp://ADDRESS:PORT")
        host, port_text = m.group(1).strip("[]"), m.group(2)
        port = 0 if port_text == "*" else int(port_text)
        if port > 65535:
            raise ValueError(f"port {port} out of range")
        if m.group(1).startswith("["):  # brackets hold an IPv6 address, nothing else
            addr: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.IPv6Address(host)
        else:
            addr = ipaddress.ip_address("0.0.0.0" if host == "*" else host)
    except ValueError as err:
        raise zmq.ZMQError(errno.EINVAL, f"telemetry bind {bind!r}: {err}") from None
    family = socket.AF_INET6 if addr.version == 6 else socket.AF_INET
    return family, (str(addr), port)


class _Listener:
    """The listening TCP socket, ours: libzmq accepts on a duplicate of it
    (ZMQ_USE_FD), so that we can stop SYNs on it or take libzmq off it, and bind
    it again, without ever letting the port go."""

    def __init__(self, bind: str, backlog: int) -> None:
        family, address = _parse_bind(bind)
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as libzmq does
            sock.bind(address)
            sock.listen(backlog)
            sock.setblocking(False)  # libzmq must never block in accept()
        except OSError as err:
            sock.close()
            raise zmq.ZMQError(err.errno or errno.EINVAL,
                               f"telemetry bind {bind}: {err.strerror or err}") from None
        self.sock = sock
        self.ipv6 = family == socket.AF_INET6
        host, port = sock.getsockname()[:2]
        self.endpoint = f"tcp://[{host}]:{port}" if self.ipv6 else f"tcp://{host}:{port}"
        self.syns_blocked = False

    def attach(self, zsock: zmq.Socket[Any]) -> None:
        """Let ``zsock`` accept on a duplicate (libzmq closes it when it unbinds or
        closes). OSError (EMFILE...) or zmq.ZMQError if it cannot."""
        fd = os.dup(self.sock.fileno())
        zsock.setsockopt(zmq.IPV6, int(self.ipv6))
        zsock.setsockopt(zmq.USE_FD, fd)
        zsock.bind(self.endpoint)

    def block_syns(self) -> None:
        """Refuse new connections (their SYNs are dropped, the peers retry)."""
        prog = ctypes.create_string_buffer(_DROP_SYN, len(_DROP_SYN))
        fprog = struct.pack("HP", len(_DROP_SYN) // 8, ctypes.addressof(prog))
        self.sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, fprog)
        self.syns_blocked = True

    def allow_syns(self) -> None:
        with contextlib.suppress(OSError):  # ENOENT: no filter attached
            self.sock.setsockopt(socket.SOL_SOCKET, _SO_DETACH_FILTER, 0)
        self.syns_blocked = False

    def close(self) -> None:
        self.sock.close()


# -- connection accounting -----------------------------------------------------------


class _Connections:
    """The listener's open connections, from the socket monitor's events.

    ACCEPTED and DISCONNECTED carry the connection's fd, HANDSHAKE_SUCCEEDED does
    not (its value is 0, libzmq 4.3.5), so a success is first "unattributed": it
    turns one pending connection into an authenticated one, we do not know which.
    It is pinned to an fd when a message arrives from it (ZMQ_SRCFD), or when the
    connection outlives the handshake deadline (libzmq would have closed it
    otherwise). Until then the counts are right and only the fd is unknown; a
    DISCONNECTED that could be either kind is taken for a pending one, an error
    that ends when the other connection closes or ages."""

    def __init__(self) -> None:
        self.pending: dict[int, float] = {}  # fd -> monotonic accept time, oldest first
        self.authenticated: set[int] = set()
        self.unattributed = 0  # successes not pinned to an fd of `pending` yet
        self.accepted_total = 0
        self.handshake_timeouts = 0
        self._failed: int | None = None  # the previous event, if a handshake failure

    @property
    def n_pending(self) -> int:
        return len(self.pending) - self.unattributed

    @property
    def n_authenticated(self) -> int:
        return len(self.authenticated) + self.unattributed

    def accepted(self, fd: int, now: float) -> None:
        self.accepted_total += 1
        # The fd number may be reused: its earlier connection is gone for sure.
        self.authenticated.discard(fd)
        self.pending.pop(fd, None)
        self.pending[fd] = now

    def succeeded(self) -> None:
        self.unattributed = min(self.unattributed + 1, len(self.pending))

    def failed(self, event: int) -> None:
        self._failed = event

    def disconnected(self, fd: int, now: float, timeout_s: float) -> None:
        """libzmq emits a handshake failure and its DISCONNECTED back to back (one
        I/O thread): NO_DETAIL late in the handshake window is its timer."""
        failed, self._failed = self._failed, None
        if fd in self.authenticated:
            self.authenticated.discard(fd)
            return
        accepted_at = self.pending.pop(fd, None)
        if accepted_at is None:
            return  # a connection of a listener closed since (see listener_closed)
        self.unattributed = min(self.unattributed, len(self.pending))
        # Half the window: our stamps of both events lag by varying amounts.
        if (failed == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                and now - accepted_at >= timeout_s / 2):
            self.handshake_timeouts += 1

    def heard_from(self, fd: int) -> None:
        """A message came in through ``fd``: it is authenticated."""
        if self.pending.pop(fd, None) is not None:
            self.authenticated.add(fd)
            self.unattributed = max(0, self.unattributed - 1)

    def age_out(self, deadline: float) -> None:
        """Connections pending since before ``deadline`` have authenticated."""
        while self.pending:
            fd, accepted_at = next(iter(self.pending.items()))
            if accepted_at >= deadline:
                break
            self.heard_from(fd)

    def listener_closed(self) -> None:
        """unbind() closed every connection of the listener, without a
        DISCONNECTED for any of them (measured, libzmq 4.3.5)."""
        self.pending.clear()
        self.authenticated.clear()
        self.unattributed = 0
        self._failed = None


class _RateLimiter:
    """A token bucket per node: ``rate`` a second, ``2 * rate`` at most in a burst.
    Nodes come from the allow-list, so the table is as large as it at most."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.burst = max(2.0 * rate, 1.0)
        self._buckets: dict[str, tuple[float, float]] = {}  # node -> (tokens, when)

    def allow(self, node: str, now: float) -> bool:
        tokens, then = self._buckets.get(node, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        allowed = tokens >= 1.0
        self._buckets[node] = (tokens - 1.0 if allowed else tokens, now)
        return allowed

    def keep_only(self, nodes: set[str]) -> None:
        for node in set(self._buckets) - nodes:
            del self._buckets[node]


# -- the receiver --------------------------------------------------------------------


class TelemetryReceiver:
    """The PULL socket, its ZAP handler, its limits and its counters. Construction
    loads the keys (AllowListError on a bad file); start()/stop() in an asyncio loop."""

    def __init__(self, bind: str, server_key: Path, allow_dir: Path, on_message: OnMessage,
                 *, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 handshake_timeout_s: float = 2.0, max_unauthenticated: int = 256,
                 max_rate_per_agent: float = 20.0) -> None:
        if not (handshake_timeout_s > 0 and max_unauthenticated >= 1
                and max_rate_per_agent > 0):
            raise ValueError("handshake_timeout_s, max_unauthenticated and "
                             "max_rate_per_agent must be positive")
        self.bind = bind
        self.allow_dir = allow_dir
        self._server_public, self._server_secret = load_server_key(server_key)
        self._allowed = load_allow_list(allow_dir)
        self._on_message = on_message
        self._max_bytes = max_message_bytes
        self.handshake_timeout_s = handshake_timeout_s
        self.max_unauthenticated = max_unauthenticated
        #: The bound endpoint (the real port when bound to ``:*`` or ``:0``).
        self.endpoint: str | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._auth: AsyncioAuthenticator | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._listener: _Listener | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._limiter = _RateLimiter(max_rate_per_agent)
        self._conns = _Connections()
        # listener state: closed (unbound) until _reopen_at after a failed accept
        self._reopen_at: float | None = None
        self._accept_pause = ACCEPT_PAUSE_S
        self._last_accept_failure = -ACCEPT_CALM_S
        # trouble: one attribute, a tuple, so that any thread reads it whole
        self._trouble: Trouble | None = None
        self._last_tick: float | None = None  # None: not running (cannot stall)
        self._undrained_since: float | None = None  # receive queue never empty since
        self._alarm_on = False
        # counters
        self._accepted = 0
        self._rejected_keys: Counter[str] = Counter()
        self._node_mismatch: Counter[str] = Counter()
        self._malformed: Counter[str] = Counter()
        self._rate_limited: Counter[str] = Counter()
        self._unknown_identity = 0
        self._handshakes: Counter[str] = Counter()
        self._callback_errors = 0
        self._accept_failures = 0
        self._listener_pauses = 0
        self._logged: set[tuple[str, str]] = set()  # (what, who) already logged once
        self._dirty = False
        self._snapshot: dict[str, Any] = {}
        self._refresh_snapshot(time.monotonic())

    # -- allow-list ---------------------------------------------------------------

    def reload_allow_list(self) -> int:
        """Re-read the allow-list directory; returns how many keys it holds. On an
        error (AllowListError) the list in force stays as it was."""
        new = load_allow_list(self.allow_dir)
        added = sorted(set(new.values()) - set(self._allowed.values()))
        removed = sorted(set(self._allowed.values()) - set(new.values()))
        self._allowed = new
        self._limiter.keep_only(set(new.values()))
        self._dirty = True
        log.info("telemetry allow-list: %d agent keys (added %s, removed %s)", len(new),
                 ", ".join(added) or "none", ", ".join(removed) or "none")
        return len(new)

    def allowed_nodes(self) -> dict[str, str]:
        """{node id: key id} of the allow-list in force."""
        return {node: key[:8] for key, node in self._allowed.items()}

    def _log_once(self, what: str, who: str, fmt: str, *args: object) -> None:
        # Bounded: `who` is a node of the allow-list or one of MAX_TRACKED_KEYS keys.
        if (what, who) not in self._logged:
            self._logged.add((what, who))
            log.warning(fmt + " (logged once; see the counters)", *args)

    def _check_key(self, key: bytes) -> bool:
        """The ZAP decision for a CURVE client key. Must not raise: an exception
        would end pyzmq's ZAP task and stall every later handshake."""
        try:
            z85 = key.decode("ascii", "replace")
            if z85 in self._allowed:
                return True
            key_id = z85[:8]
            if key_id not in self._rejected_keys and len(self._rejected_keys) >= MAX_TRACKED_KEYS:
                key_id = "other"  # a key-spraying peer cannot grow the counters unbounded
            self._rejected_keys[key_id] += 1
            self._dirty = True
            if key_id != "other":
                self._log_once("key", key_id, "refused telemetry from unknown CURVE key %s...",
                               key_id)
        except Exception:
            log.exception("ZAP key check failed; refusing the key")
        return False

    # -- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        """Start the ZAP handler, then bind (zmq.ZMQError if it cannot)."""
        if self._ctx is not None:
            raise RuntimeError("telemetry receiver already started")
        listener = _Listener(self.bind, BACKLOG)  # in this thread's network namespace
        ctx = zmq.asyncio.Context()
        auth = AsyncioAuthenticator(ctx, log=logging.getLogger(f"{__name__}.zap"))
        sock = monitor = None
        try:
            # The ZAP handler first: without one, libzmq lets every CURVE client in.
            auth.start()
            auth.configure_curve_callback(ZAP_DOMAIN, _KeyCheck(self._check_key))
            sock = ctx.socket(zmq.PULL)
            sock.zap_domain = ZAP_DOMAIN.encode()
            sock.curve_server = True
            sock.curve_publickey = self._server_public
            sock.curve_secretkey = self._server_secret
            sock.setsockopt(zmq.MAXMSGSIZE, max(HARD_MAX_BYTES, self._max_bytes))
            sock.setsockopt(zmq.RCVHWM, RCVHWM)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.HANDSHAKE_IVL, max(1, round(self.handshake_timeout_s * 1000)))
            monitor = sock.get_monitor_socket(_MONITOR_EVENTS)
            listener.attach(sock)
        except Exception:
            if monitor is not None:
                monitor.close(linger=0)
            if sock is not None:
                sock.close(linger=0)
            auth.stop()
            ctx.destroy(linger=0)
            listener.close()
            raise
        self._ctx, self._auth, self._sock, self._monitor = ctx, auth, sock, monitor
        self._listener = listener
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._last_tick = time.monotonic()
        self._tasks = [asyncio.create_task(self._receive_loop(), name="telemetry-receive"),
                       asyncio.create_task(self._monitor_loop(), name="telemetry-monitor"),
                       asyncio.create_task(self._ticker(), name="telemetry-ticker")]
        log.info("telemetry receiver on %s, %d agent keys allowed", self.endpoint,
                 len(self._allowed))

    async def stop(self) -> None:
        """Stop receiving, close the sockets, stop the ZAP handler. Idempotent."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []
        self._last_tick = None
        # No disable_monitor(): with the monitor pipe full it deadlocks (module doc).
        # Closing both ends and destroying the context ends the blocked send.
        if self._sock is not None:
            # The socket before the ZAP handler, so no client gets in unchecked.
            self._sock.close(linger=0)
        if self._monitor is not None:
            self._monitor.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
            await asyncio.sleep(0)  # let its cancelled task unwind before the context goes
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
        if self._listener is not None:
            self._listener.close()
        self._ctx = self._auth = self._sock = self._monitor = self._listener = None
        self._refresh_snapshot(time.monotonic())

    async def __aenter__(self) -> TelemetryReceiver:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- receiving ------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        assert self._sock is not None
        # A synchronous view of the same socket: batches of NOBLOCK reads after a
        # cheap wake-up, instead of pyzmq's futures per message and per wake-up
        # (a 5,000 messages/s flood: 60 % of a core with them, 40 % without).
        raw = zmq.Socket.shadow(self._sock.underlying)
        async with _readable(raw) as wait:
            while True:
                if await self._receive_batch(raw):
                    await asyncio.sleep(0)  # more to read: the monitor, ticker, ZAP first
                else:
                    await wait()

    async def _receive_batch(self, raw: zmq.Socket[Any]) -> bool:
        """Read and hand over up to RECEIVE_BATCH messages, each as it comes; True
        if the queue was not drained."""
        for _ in range(RECEIVE_BATCH):
            try:
                frames = _recv_message(raw)
            except zmq.Again:
                self._undrained_since = None
                return False
            try:
                got = self._judge(frames, time.monotonic())
                if got is not None:
                    await self._deliver(*got)
            except Exception:  # a bug here must not stop telemetry for every node
                log.exception("telemetry message handling failed")
        if self._undrained_since is None:
            self._undrained_since = time.monotonic()
        return True

    def _judge(self, frames: list[zmq.Frame], now: float
               ) -> tuple[TelemetryMessage, AgentIdentity] | None:
        """The message and its sender if it passes, else None (counted why)."""
        self._dirty = True
        frame = frames[0]
        try:
            key = frame.get("User-Id")
        except zmq.ZMQError:
            key = None
        if not isinstance(key, str) or (node := self._allowed.get(key)) is None:
            # Authenticated with a key that has since left the allow-list.
            self._unknown_identity += 1
            return None
        if self._conns.unattributed:
            self._conns.heard_from(frame.get(zmq.SRCFD))
        if not self._limiter.allow(node, now):
            self._rate_limited[node] += 1
            self._log_once("rate", node, "node %s sends above %g messages/s: excess dropped",
                           node, self._limiter.rate)
            return None
        if len(frames) != 1:
            self._malformed["multipart"] += 1
            return None
        try:
            msg = decode(frame.buffer, self._max_bytes)
        except TelemetryError as err:
            self._malformed[err.reason] += 1
            self._log_once(err.reason, node, "malformed telemetry from %s: %s", node, err)
            return None
        if msg.node != node:
            self._node_mismatch[node] += 1
            self._log_once("mismatch", node, "the key of node %s sent telemetry as node %r: "
                           "refused", node, msg.node)
            return None
        self._accepted += 1
        return msg, AgentIdentity(node=node, key=key)

    async def _deliver(self, msg: TelemetryMessage, who: AgentIdentity) -> None:
        try:
            result = self._on_message(msg, who)
            if inspect.isawaitable(result):
                await result
        except Exception:
            self._callback_errors += 1
            log.exception("telemetry callback failed for node %s", who.node)

    # -- connections ----------------------------------------------------------------

    async def _monitor_loop(self) -> None:
        assert self._monitor is not None
        raw = zmq.Socket.shadow(self._monitor.underlying)
        async with _readable(raw) as wait:
            while True:
                if self._read_events(raw):
                    await asyncio.sleep(0)
                else:
                    await wait()

    def _read_events(self, raw: zmq.Socket[Any]) -> bool:
        """Handle up to MONITOR_BATCH events; True if more are waiting."""
        for _ in range(MONITOR_BATCH):
            try:
                head, _endpoint = raw.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            # libzmq's v1 event: u16 event, u32 value (an fd or an errno).
            event, value = struct.unpack_from("=HI", head)
            self._on_event(event, value, time.monotonic())
        return True

    def _on_event(self, event: int, value: int, now: float) -> None:
        self._dirty = True
        if event == zmq.EVENT_ACCEPTED:
            self._conns.accepted(value, now)
            if self._conns.n_pending >= self.max_unauthenticated:
                self._hold_listener(now)
        elif event == zmq.EVENT_DISCONNECTED:
            self._conns.disconnected(value, now, self.handshake_timeout_s)
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._handshakes["ok"] += 1
            self._conns.succeeded()
        elif event in _HANDSHAKE_EVENTS:
            self._handshakes[_HANDSHAKE_EVENTS[event]] += 1
            self._conns.failed(event)
        elif event == zmq.EVENT_ACCEPT_FAILED:
            self._accept_failed(value, now)
        elif event == zmq.EVENT_CLOSED:
            self._conns.listener_closed()

    def _hold_listener(self, now: float) -> None:
        """Stop accepting: drop SYNs until the pending connections halve."""
        listener = self._listener
        if listener is None or listener.syns_blocked or self._reopen_at is not None:
            return
        try:
            listener.block_syns()
        except OSError as err:  # no socket filters here: take libzmq off instead
            log.error("cannot filter SYNs on the telemetry socket (%s): unbinding", err)
            self._close_listener(now)
            return
        self._listener_pauses += 1
        self._note(now, self._paused_reason())
        self._log_once("pause", "listener", "telemetry: %d connections not authenticated "
                       "(the bound): not accepting until half are gone", self._conns.n_pending)

    def _paused_reason(self) -> str:
        return (f"listener paused: {self._conns.n_pending} connections not authenticated "
                f"(bound {self.max_unauthenticated})")

    def _accept_failed(self, code: int, now: float) -> None:
        self._accept_failures += 1
        if code not in RESOURCE_ERRNOS:
            return  # the peer gave up before accept(): nothing of ours is short
        self._note(now, f"accept failed: {_errno_text(code)}")
        if self._reopen_at is None:
            self._close_listener(now)

    def _close_listener(self, now: float) -> None:
        """Take libzmq off the listening socket (its accept loop stops; its
        connections close), to bind it again in a while."""
        if self._sock is None or self._listener is None or self.endpoint is None:
            return
        with contextlib.suppress(zmq.ZMQError):
            self._sock.unbind(self.endpoint)
        recent = now - self._last_accept_failure < ACCEPT_CALM_S
        self._accept_pause = (min(self._accept_pause * 2, ACCEPT_PAUSE_MAX_S) if recent
                              else ACCEPT_PAUSE_S)
        self._last_accept_failure = now
        self._reopen_at = now + self._accept_pause
        self._listener_pauses += 1
        log.warning("telemetry: accept failing for want of resources: listener closed for "
                    "%g s (agents reconnect then)", self._accept_pause)

    def _reopen_listener(self, now: float) -> None:
        assert self._sock is not None and self._listener is not None
        if self._monitor is not None:
            # bind() reports LISTENING under the monitor lock: the pipe must have room.
            while self._read_events(zmq.Socket.shadow(self._monitor.underlying)):
                pass
        try:
            self._listener.attach(self._sock)
        except (OSError, zmq.ZMQError) as err:
            self._note(now, f"listener cannot reopen: {err}")
            return
        self._reopen_at = None
        log.info("telemetry: listener open again on %s", self.endpoint)

    def _step_listener(self, now: float) -> None:
        """Resume accepting when the pause has done its work."""
        listener = self._listener
        if listener is None:
            return
        if self._reopen_at is not None:
            if now >= self._reopen_at:
                self._reopen_listener(now)
            else:
                self._note(now, f"listener closed for {self._accept_pause:g} s: accepts "
                                "failed for want of resources")
            return
        if listener.syns_blocked:
            if self._conns.n_pending <= self.max_unauthenticated // 2:
                listener.allow_syns()
            else:
                self._note(now, self._paused_reason())

    # -- trouble --------------------------------------------------------------------

    def _note(self, now: float, reason: str) -> None:
        self._trouble = (now, reason)
        self._dirty = True

    def trouble(self) -> Trouble | None:
        """(monotonic time, reason) of the latest local trouble, None if none yet.
        Safe from any thread; reports a loop that stopped turning by itself."""
        last_tick = self._last_tick
        if last_tick is not None:
            now = time.monotonic()
            if now - last_tick > LAG_S + TICK_S:
                return now, f"event loop stalled: no tick for {now - last_tick:.1f} s"
        return self._trouble

    def alarm(self, now_mono: float) -> str | None:
        """A sentence while trouble was seen within ALARM_HOLD_S of ``now_mono``."""
        trouble = self.trouble()
        if trouble is None or now_mono - trouble[0] > ALARM_HOLD_S:
            return None
        age = max(0.0, now_mono - trouble[0])
        return (f"telemetry receiver could not hear every agent: {trouble[1]} "
                f"({age:.0f} s ago)")

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            last = self._last_tick if self._last_tick is not None else now
            self._last_tick = now
            self._tick(now, now - last - TICK_S)

    def _tick(self, now: float, lag: float) -> None:
        if lag > LAG_S:
            self._note(now, f"event loop lagged {lag:.1f} s")
        self._conns.age_out(now - self.handshake_timeout_s - AGE_SLACK_S)
        self._step_listener(now)
        if self._conns.n_pending >= self.max_unauthenticated:
            self._note(now, self._paused_reason())
        if self._undrained_since is not None and now - self._undrained_since > LAG_S:
            self._note(now, f"receive queue backing up: not drained for "
                            f"{now - self._undrained_since:.1f} s")
        self._log_alarm(now)
        if self._dirty or now - self._snapshot["at"] >= SNAPSHOT_EVERY_S:
            self._refresh_snapshot(now)

    def _log_alarm(self, now: float) -> None:
        alarm = self.alarm(now)
        if alarm is not None and not self._alarm_on:
            log.warning("%s", alarm)
        elif alarm is None and self._alarm_on:
            log.info("telemetry receiver: no trouble for %g s, alarm cleared", ALARM_HOLD_S)
        self._alarm_on = alarm is not None

    # -- counters -------------------------------------------------------------------

    def _refresh_snapshot(self, now: float) -> None:
        # A new dict each time, never changed after: readers in other threads
        # get a consistent one by reading the attribute once.
        self._snapshot = {"counters": self.counters(), "trouble": self.trouble(),
                          "alarm": self.alarm(now), "at": now}
        self._dirty = False

    def snapshot(self) -> dict[str, Any]:
        """{"counters": counters(), "trouble": trouble(), "alarm": alarm(at),
        "at": monotonic time taken}, as of the last refresh (within TICK_S of a
        change, SNAPSHOT_EVERY_S at most, while the loop turns). Read-only."""
        return self._snapshot

    def counters(self) -> dict[str, Any]:
        """A snapshot, every key present, for the stats command and metrics:

        accepted: messages handed to the callback;
        allow_list: keys in the allow-list;
        rejected_keys: {key id (8 z85 chars) or "other": refused CURVE handshakes};
        rejected_key_total: their sum;
        node_mismatch: {node id of the key: messages naming another node};
        unknown_identity: messages from a key no longer allowed;
        malformed: {reason: messages dropped}, reasons of MALFORMED_REASONS;
        rate_limited: {node id: messages dropped above its rate};
        handshakes: {"ok", "failed_auth", "failed_protocol", "failed_no_detail"}
          (failed_protocol / no_detail: a client with a wrong server key or no CURVE;
          no_detail also: a handshake timed out);
        connections: {"pending": open, not authenticated yet; "authenticated": open
          and authenticated; "accepted_total"; "handshake_timeouts": closed for not
          finishing the handshake in time; "accept_failures": failed accept()s
          (EMFILE...); "listener_pauses": times the receiver stopped accepting};
        callback_errors: exceptions raised by on_message.
        """
        conns = self._conns
        return {
            "accepted": self._accepted,
            "allow_list": len(self._allowed),
            "rejected_keys": dict(self._rejected_keys),
            "rejected_key_total": sum(self._rejected_keys.values()),
            "node_mismatch": dict(self._node_mismatch),
            "unknown_identity": self._unknown_identity,
            "malformed": {r: self._malformed[r] for r in MALFORMED_REASONS},
            "rate_limited": dict(self._rate_limited),
            "handshakes": {k: self._handshakes[k]
                           for k in ("ok", "failed_auth", "failed_protocol",
                                     "failed_no_detail")},
            "connections": {"pending": max(0, conns.n_pending),
                            "authenticated": conns.n_authenticated,
                            "accepted_total": conns.accepted_total,
                            "handshake_timeouts": conns.handshake_timeouts,
                            "accept_failures": self._accept_failures,
                            "listener_pauses": self._listener_pauses},
            "callback_errors": self._callback_errors,
        }


class ReceiverThread:
    """Runs a TelemetryReceiver in its own thread and event loop, for synchronous
    callers. ``on_message`` then runs in that thread: hand messages over with a
    queue or a lock."""

    def __init__(self, receiver: TelemetryReceiver, netns: str | None = None) -> None:
        self.receiver = receiver
        #: Network namespace (name or /proc/PID/ns/net path) the thread enters
        #: before it binds, as the probe thread does: the agents reach the
        #: appliance where the data plane forwards (the lab's appliance namespace).
        self.netns = netns
        self._thread = LoopThread("hpclb-telemetry", netns)

    def start(self, timeout: float = 10.0) -> None:
        """Start and wait until bound; re-raises a bind or setup error."""
        self._thread.start(self.receiver.start, self.receiver.stop, timeout)

    @property
    def endpoint(self) -> str | None:
        return self.receiver.endpoint

    def _call(self, fn: Callable[[], T], timeout: float = 10.0) -> T:
        """Run ``fn`` in the receiver's loop (its state is only touched there)."""
        return self._thread.call(fn, timeout)

    def snapshot(self) -> dict[str, Any]:
        """The receiver's snapshot, at once, without waiting on its loop: counters
        as of "at"; "trouble" and "alarm" as of now (a stalled loop shows there)."""
        snap = self.receiver.snapshot()
        now = time.monotonic()
        return {**snap, "trouble": self.receiver.trouble(), "alarm": self.receiver.alarm(now)}

    def trouble(self) -> Trouble | None:
        """TelemetryReceiver.trouble(), from this thread, without waiting."""
        return self.receiver.trouble()

    def alarm(self, now_mono: float) -> str | None:
        return self.receiver.alarm(now_mono)

    def counters(self) -> dict[str, Any]:
        """Exact counters, read in the receiver's loop: waits for it (up to 10 s).
        A status writer wants snapshot() instead."""
        return self._call(self.receiver.counters)

    def reload_allow_list(self) -> int:
        return self._call(self.receiver.reload_allow_list)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the receiver and join the thread. Idempotent."""
        if not self._thread.stop(timeout):
            raise RuntimeError("telemetry receiver thread did not stop")
