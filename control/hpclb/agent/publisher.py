"""The agent's ZeroMQ PUSH socket to the control plane, CURVE-authenticated.

Telemetry is perishable: a figure queued while the control plane was away is stale
(and rejected as such) by the time it arrives. So the socket never holds much and
never blocks:

* ``IMMEDIATE``: nothing is queued for a connection whose handshake has not
  completed (down, or our key refused), the send fails at once instead;
* a small send high-water mark, and sends with ``NOBLOCK``: when the queue is
  full, the message is dropped and counted;
* a bounded ``LINGER``, so closing (SIGTERM) never waits on an absent peer;
* ZMTP heartbeats, so a silently dead connection is noticed and redialled.

A socket monitor turns handshake failures into a log line (the one an operator
needs when the control plane refuses our key), and into a redial with backoff:
libzmq never redials a connection whose handshake failed, and an agent must get
in by itself once its key is added to the allow-list.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("hpclb.agent")

SNDHWM = 4  # messages queued at most; older telemetry is worth nothing
LINGER_MS = 1000  # on close, try this long to deliver what is queued
HEARTBEAT_IVL_MS = 10_000
HEARTBEAT_TIMEOUT_MS = 30_000
RECONNECT_IVL_MAX_MS = 30_000  # back off while the control plane is down
REDIAL_MIN_S = 1.0  # first redial after a refused handshake...
REDIAL_MAX_S = 30.0  # ...doubling up to this

_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
           | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
           | zmq.EVENT_DISCONNECTED)


class Publisher:
    """Sends payloads to ``endpoint`` (``tcp://HOST:PORT``, an IPv6 address in
    brackets); :meth:`close` when done."""

    def __init__(self, endpoint: str, server_key: bytes, public_key: bytes,
                 secret_key: bytes, *, sndhwm: int = SNDHWM, linger_ms: int = LINGER_MS,
                 context: zmq.Context[zmq.Socket[bytes]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.endpoint = endpoint
        self._keys = (server_key, public_key, secret_key)
        self._sndhwm, self._linger_ms = sndhwm, linger_ms
        self._clock = clock
        self._own_ctx = context is None
        self._ctx = context if context is not None else zmq.Context()
        try:
            self._sock, self._monitor = self._open()
        except zmq.ZMQError:
            if self._own_ctx:
                self._ctx.term()
            raise
        #: True once a CURVE handshake succeeded, until the connection drops.
        self.connected = False
        self.sent = 0
        self.dropped = 0
        self.auth_failures = 0
        self._redial_at: float | None = None
        self._backoff = REDIAL_MIN_S

    def _open(self) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
        sock = self._ctx.socket(zmq.PUSH)
        try:
            server_key, public_key, secret_key = self._keys
            sock.curve_serverkey = server_key
            sock.curve_publickey = public_key
            sock.curve_secretkey = secret_key
            # Without it libzmq cannot reach an IPv6 address (tcp://[fd00::1]:5557):
            # connect() succeeds and every dial then fails quietly. IPv4 is unchanged,
            # and a name resolves to whichever family it has.
            sock.setsockopt(zmq.IPV6, 1)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.SNDHWM, self._sndhwm)
            sock.setsockopt(zmq.LINGER, self._linger_ms)
            sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
            monitor = sock.get_monitor_socket(_EVENTS)
            sock.connect(self.endpoint)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        return sock, monitor

    def _close_socket(self, linger: int | None = None) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=linger)

    def _handshake_failed(self) -> None:
        # libzmq ends a connection whose handshake failed for good (it does not
        # redial), so a refused agent would stay silent after its key is allowed.
        # Redial ourselves, backing off: each attempt is a refusal counted there.
        self.connected = False
        if self._redial_at is None:
            self._redial_at = self._clock() + self._backoff
            self._backoff = min(self._backoff * 2, REDIAL_MAX_S)

    def poll_events(self) -> None:
        """Read pending monitor events: update :attr:`connected`, log changes,
        schedule a redial after a failed handshake."""
        while self._monitor.poll(0):
            event = parse_monitor_message(self._monitor.recv_multipart())["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if not self.connected:
                    log.info("connected to %s", self.endpoint)
                self.connected = True
                self._backoff = REDIAL_MIN_S
            elif event == zmq.EVENT_DISCONNECTED:
                if self.connected:
                    log.warning("lost the connection to %s, redialling", self.endpoint)
                self.connected = False
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self.auth_failures += 1
                if self.auth_failures == 1:
                    log.error("%s refused this agent's key: add its public .key file to "
                              "the control plane's allow-list (named <node id>.key); "
                              "retrying every %g s at most", self.endpoint, REDIAL_MAX_S)
                self._handshake_failed()
            else:  # protocol / no detail: a wrong server key, or not an hpclb receiver
                log.warning("CURVE handshake with %s failed (wrong --server-key?)",
                            self.endpoint)
                self._handshake_failed()
        if self._redial_at is not None and self._clock() >= self._redial_at:
            self._redial_at = None
            self._close_socket(linger=0)
            self._sock, self._monitor = self._open()

    def send(self, payload: bytes) -> bool:
        """Queue one message without blocking; False (and counted) if dropped."""
        self.poll_events()
        try:
            self._sock.send(payload, zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            return False
        self.sent += 1
        return True

    def close(self) -> None:
        """Close the sockets (waiting at most the linger time) and our context."""
        self._close_socket()
        if self._own_ctx:
            self._ctx.term()
