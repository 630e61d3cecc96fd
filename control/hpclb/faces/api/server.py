"""The REST API as a face of the controller (``appliance.api``).

``prepare`` binds the listening socket inside the appliance's namespace
(where the management address lives) and reads the tokens, so a taken
address, a missing token or a bad token file refuses the start or the reload
before anything is in force. ``commit`` starts uvicorn on that socket, in a
daemon thread with its own asyncio loop (or, when the address did not change,
keeps the running server and only swaps in an app with the new tokens and
limits). ``close`` stops it. A sampler task in the same loop feeds the
history one status snapshot a second.

uvicorn's access log is off and its own logging configuration unused: a
request line may carry ``?token=`` (server-sent events) and no token may
reach a log.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from hpclb.config import HpclbConfig
from hpclb.controller import StartError
from hpclb.controller.operations import Operations
from hpclb.faces.api.app import create_app
from hpclb.faces.api.auth import Tokens, load_tokens
from hpclb.faces.api.history import History
from hpclb.host.netns import inside

log = logging.getLogger(__name__)

Status = Mapping[str, Any]
SAMPLE_INTERVAL_S = 1.0
STOP_TIMEOUT_S = 3.0


class _Switch:
    """The app a running server serves, replaceable between requests: a
    reload on the same address keeps the server (and its connections) and
    swaps in an app built with the new tokens and body limit."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


def bind(host: str, port: int, netns: str | None) -> socket.socket:
    """A listening TCP socket on (host, port), created inside ``netns``."""
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    with inside(netns) if netns else contextlib.nullcontext():
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose proto
        # says TCP, and without it each answer's second segment waits for the
        # client's delayed ACK (40 ms a request on a kept-alive connection).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accept()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.set_inheritable(False)
    except BaseException:
        sock.close()
        raise
    return sock


class ApiServer:
    """uvicorn serving one bound socket, in a daemon thread with its own loop."""

    def __init__(self, sock: socket.socket, address: tuple[str, int], switch: _Switch,
                 sample: Callable[[], None], settings: tuple[Tokens, int]) -> None:
        self.sock, self.address, self.switch, self._sample = sock, address, switch, sample
        self.settings = settings  # what the app serves with (tokens, body limit)
        config = uvicorn.Config(switch, log_config=None, log_level="warning", access_log=False,
                                lifespan="off", proxy_headers=False, server_header=False,
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, name="api", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        sampler = asyncio.create_task(self._sampling())
        try:
            await self.server.serve(sockets=[self.sock])
        finally:
            sampler.cancel()

    async def _sampling(self) -> None:
        while True:
            try:
                self._sample()
            except Exception:  # a bad snapshot must not end the sampling
                log.exception("api: history sample failed")
            await asyncio.sleep(SAMPLE_INTERVAL_S)

    def stop(self) -> None:
        if self.thread.is_alive():
            self.server.should_exit = True
            self.thread.join(STOP_TIMEOUT_S)
            if self.thread.is_alive():  # open event streams: stop waiting for them
                self.server.force_exit = True
                self.thread.join(STOP_TIMEOUT_S)
        self.sock.close()


class ApiFace:
    """The REST API and the status page, wired in by the CLI: ``attach`` the
    controller's operations before the controller starts."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.env = env
        self.ops: Operations | None = None
        self.history = History()
        self.server: ApiServer | None = None

    def attach(self, ops: Operations) -> None:
        self.ops = ops

    def sample(self) -> None:
        if self.ops is not None:
            self.history.add(self.ops.status())

    def prepare(self, config: HpclbConfig, status: Callable[[], Status | None]) -> _ApiChange:
        del status  # the operations give the snapshot (and everything else)
        api = config.appliance.api
        if api is None:
            return _ApiChange(self, None, None)
        if self.ops is None:
            raise StartError("appliance.api: the REST API was not attached to the controller")
        tokens = load_tokens(api, self.env if self.env is not None else os.environ)
        address = api.endpoint(config.appliance.management_address)
        settings = (tokens, api.max_body_bytes)
        if self.server is not None and self.server.address == address:
            if settings == self.server.settings:
                return _ApiChange(self, None, None, keep=True)  # every API write lands here
            app = create_app(self.ops, tokens, api.max_body_bytes, self.history)
            return _ApiChange(self, None, app, settings)
        app = create_app(self.ops, tokens, api.max_body_bytes, self.history)
        try:
            sock = bind(address[0], address[1], config.appliance.netns)
        except (OSError, ValueError) as err:
            reason = err.strerror if isinstance(err, OSError) and err.strerror else err
            raise StartError(f"appliance.api: cannot listen on {address[0]}:{address[1]}: "
                             f"{reason}") from err
        return _ApiChange(self, ApiServer(sock, address, _Switch(app), self.sample, settings),
                          app, settings)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


class _ApiChange:
    """``new``: a server bound for a new address; ``app``: the app to serve
    (None with ``new`` None: the API is switched off); ``keep``: nothing
    changes."""

    def __init__(self, face: ApiFace, new: ApiServer | None, app: ASGIApp | None,
                 settings: tuple[Tokens, int] | None = None, keep: bool = False) -> None:
        self.face, self.new, self.app, self.settings, self.keep = face, new, app, settings, keep

    def commit(self) -> None:
        face = self.face
        if self.keep:
            return
        if self.new is None and self.app is not None and face.server is not None:
            face.server.switch.app = self.app  # same address: new tokens and limits
            if self.settings is not None:
                face.server.settings = self.settings
            return
        face.close()
        if self.new is not None:
            self.new.start()
            face.server = self.new
            log.info("api: REST API and status page on %s", self.new.url)

    def abort(self) -> None:
        if self.new is not None:
            self.new.sock.close()
