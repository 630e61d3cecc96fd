"""The control plane's telemetry receiver: CURVE-authenticated ZeroMQ PULL socket.

    rx = TelemetryReceiver("tcp://0.0.0.0:5557", Path("/etc/hpclb/curve/server.key_secret"),
                           Path("/etc/hpclb/agents"), on_message)
    await rx.start(); ...; await rx.stop()          # inside an asyncio loop, or
    th = ReceiverThread(rx); th.start(); ...; th.stop()   # from synchronous code

Who may send: the allow-list directory holds one pyzmq public certificate per
agent, named ``<node id>.key`` (``hpclb-agent keygen DIR --name <node id>`` writes
it). A CURVE handshake from any other key is refused by the ZAP handler and counted
per key (its first 8 z85 characters). The file name binds the key to a node: a
message from an allowed key that names another node is refused and counted, so an
agent cannot speak for a node it is not. ``reload_allow_list()`` re-reads the
directory (a removed key is refused from its next message on, even on an open
connection).

What gets through: each payload is decoded by :func:`hpclb.telemetry.decode`; a
malformed one is counted by reason and dropped, and the receiver carries on. A
valid one goes to ``on_message(msg, identity)``, in the receiver's event loop; an
exception there is logged and counted, never fatal. Measured values are not
judged here (NaN, negatives...): that is WeightTracker.observe's job.

Everything runs in one event loop (the ZAP handler included), so the counters need
no lock; ReceiverThread reads them from inside its loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import re
import threading
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils.monitor import parse_monitor_message

from hpclb.netns import enter_netns
from hpclb.telemetry import (
    DECODE_REASONS,
    MAX_MESSAGE_BYTES,
    NODE_ID_PATTERN,
    TelemetryError,
    TelemetryMessage,
    decode,
)

log = logging.getLogger("hpclb.telemetry")

ZAP_DOMAIN = "hpclb-telemetry"
#: libzmq drops the connection of a peer that sends a larger message, before it is
#: buffered whole; between MAX_MESSAGE_BYTES and this, it is read and counted.
HARD_MAX_BYTES = 1 << 20
RCVHWM = 10_000  # a fleet's worth of queued messages; the loop reads them fast
MAX_TRACKED_KEYS = 256  # distinct refused keys counted apart; the rest in "other"
#: Why a message was dropped, the keys of counters()["malformed"].
MALFORMED_REASONS: tuple[str, ...] = (*DECODE_REASONS, "multipart")

OnMessage = Callable[[TelemetryMessage, "AgentIdentity"], Awaitable[None] | None]
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


def _load_server_key(path: Path) -> tuple[bytes, bytes]:
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


class TelemetryReceiver:
    """The PULL socket, its ZAP handler and its counters. Construction loads the
    keys (AllowListError on a bad file); start()/stop() in an asyncio loop."""

    def __init__(self, bind: str, server_key: Path, allow_dir: Path, on_message: OnMessage,
                 *, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.bind = bind
        self.allow_dir = allow_dir
        self._server_public, self._server_secret = _load_server_key(server_key)
        self._allowed = load_allow_list(allow_dir)
        self._on_message = on_message
        self._max_bytes = max_message_bytes
        #: The bound endpoint (the real port when bound to ``:*`` or ``:0``).
        self.endpoint: str | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._auth: AsyncioAuthenticator | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # counters
        self._accepted = 0
        self._rejected_keys: Counter[str] = Counter()
        self._node_mismatch: Counter[str] = Counter()
        self._malformed: Counter[str] = Counter()
        self._unknown_identity = 0
        self._handshakes: Counter[str] = Counter()
        self._callback_errors = 0
        self._logged: set[tuple[str, str]] = set()  # (what, who) already logged once

    # -- allow-list ---------------------------------------------------------------

    def reload_allow_list(self) -> int:
        """Re-read the allow-list directory; returns how many keys it holds. On an
        error (AllowListError) the list in force stays as it was."""
        new = load_allow_list(self.allow_dir)
        added = sorted(set(new.values()) - set(self._allowed.values()))
        removed = sorted(set(self._allowed.values()) - set(new.values()))
        self._allowed = new
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
            if key_id != "other":
                self._log_once("key", key_id, "refused telemetry from unknown CURVE key %s...",
                               key_id)
        except Exception:
            log.exception("ZAP key check failed; refusing the key")
        return False

    # -- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        """Start the ZAP handler, then bind (OSError/zmq.ZMQError if it cannot)."""
        if self._ctx is not None:
            raise RuntimeError("telemetry receiver already started")
        ctx = zmq.asyncio.Context()
        auth = AsyncioAuthenticator(ctx, log=logging.getLogger("hpclb.telemetry.zap"))
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
            monitor = sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
            sock.bind(self.bind)
        except Exception:
            if monitor is not None:
                monitor.close(linger=0)
            if sock is not None:
                sock.close(linger=0)
            auth.stop()
            ctx.destroy(linger=0)
            raise
        self._ctx, self._auth, self._sock, self._monitor = ctx, auth, sock, monitor
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._tasks = [asyncio.create_task(self._receive_loop(), name="telemetry-receive"),
                       asyncio.create_task(self._monitor_loop(), name="telemetry-monitor")]
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
        if self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            # The socket before the ZAP handler, so no client gets in unchecked.
            self._sock.close(linger=0)
        if self._monitor is not None:
            self._monitor.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
            await asyncio.sleep(0)  # let its cancelled task unwind before the context goes
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
        self._ctx = self._auth = self._sock = self._monitor = None

    async def __aenter__(self) -> TelemetryReceiver:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- receiving ------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            try:
                await self._handle(frames)
            except Exception:  # a bug here must not stop telemetry for every node
                log.exception("telemetry message handling failed")

    async def _handle(self, frames: list[zmq.Frame]) -> None:
        if len(frames) != 1:
            self._malformed["multipart"] += 1
            return
        frame = frames[0]
        try:
            key = frame.get("User-Id")
        except zmq.ZMQError:
            key = None
        if not isinstance(key, str) or (node := self._allowed.get(key)) is None:
            # Authenticated with a key that has since left the allow-list.
            self._unknown_identity += 1
            return
        try:
            msg = decode(frame.buffer, self._max_bytes)
        except TelemetryError as err:
            self._malformed[err.reason] += 1
            self._log_once(err.reason, node, "malformed telemetry from %s: %s", node, err)
            return
        if msg.node != node:
            self._node_mismatch[node] += 1
            self._log_once("mismatch", node, "the key of node %s sent telemetry as node %r: "
                           "refused", node, msg.node)
            return
        self._accepted += 1
        try:
            result = self._on_message(msg, AgentIdentity(node=node, key=key))
            if inspect.isawaitable(result):
                await result
        except Exception:
            self._callback_errors += 1
            log.exception("telemetry callback failed for node %s", node)

    async def _monitor_loop(self) -> None:
        assert self._monitor is not None
        names = {zmq.EVENT_HANDSHAKE_SUCCEEDED: "ok",
                 zmq.EVENT_HANDSHAKE_FAILED_AUTH: "failed_auth",
                 zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "failed_protocol",
                 zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "failed_no_detail"}
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
            if event in names:
                self._handshakes[names[event]] += 1

    # -- counters -------------------------------------------------------------------

    def counters(self) -> dict[str, Any]:
        """A snapshot, every key present, for the stats command and metrics:

        accepted: messages handed to the callback;
        allow_list: keys in the allow-list;
        rejected_keys: {key id (8 z85 chars) or "other": refused CURVE handshakes};
        rejected_key_total: their sum;
        node_mismatch: {node id of the key: messages naming another node};
        unknown_identity: messages from a key no longer allowed;
        malformed: {reason: messages dropped}, reasons of MALFORMED_REASONS;
        handshakes: {"ok", "failed_auth", "failed_protocol", "failed_no_detail"}
          (failed_protocol / no_detail: a client with a wrong server key or no CURVE);
        callback_errors: exceptions raised by on_message.
        """
        return {
            "accepted": self._accepted,
            "allow_list": len(self._allowed),
            "rejected_keys": dict(self._rejected_keys),
            "rejected_key_total": sum(self._rejected_keys.values()),
            "node_mismatch": dict(self._node_mismatch),
            "unknown_identity": self._unknown_identity,
            "malformed": {r: self._malformed[r] for r in MALFORMED_REASONS},
            "handshakes": {k: self._handshakes[k]
                           for k in ("ok", "failed_auth", "failed_protocol",
                                     "failed_no_detail")},
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
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._started: Future[None] = Future()

    def start(self, timeout: float = 10.0) -> None:
        """Start and wait until bound; re-raises a bind or setup error."""
        if self._thread is not None:
            raise RuntimeError("receiver thread already started")
        self._thread = threading.Thread(target=self._main, name="hpclb-telemetry",
                                        daemon=True)
        self._thread.start()
        self._started.result(timeout)

    def _main(self) -> None:
        if self.netns:
            try:
                enter_netns(self.netns)
            except OSError as err:
                self._started.set_exception(err)
                return

        async def serve() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            try:
                await self.receiver.start()
            except BaseException as err:
                self._started.set_exception(err)
                return
            self._started.set_result(None)
            try:
                await self._stop.wait()
            finally:
                await self.receiver.stop()

        asyncio.run(serve())

    @property
    def endpoint(self) -> str | None:
        return self.receiver.endpoint

    def _call(self, fn: Callable[[], T], timeout: float = 10.0) -> T:
        """Run ``fn`` in the receiver's loop (its state is only touched there)."""
        if self._loop is None or not self._started.done():
            raise RuntimeError("receiver thread not running")

        async def call() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(timeout)

    def counters(self) -> dict[str, Any]:
        return self._call(self.receiver.counters)

    def reload_allow_list(self) -> int:
        return self._call(self.receiver.reload_allow_list)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the receiver and join the thread. Idempotent."""
        if self._thread is None:
            return
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # loop already gone
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError("telemetry receiver thread did not stop")
        self._thread = None
