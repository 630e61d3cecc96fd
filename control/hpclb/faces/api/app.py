"""The REST API's FastAPI app (the contract: the API section of
docs/ARCHITECTURE.md): reads of the configuration and the status snapshot,
writes as edits of the configuration document, which the controller applies
one at a time as a whole new configuration (``Operations.change``).

In front of the routes, one ASGI gate (:class:`Gate`) does what must happen
before a route sees the request: the bearer token and its role (so a refused
request reads no body and changes nothing), the body size cap (413 before a
body larger than ``max_body_bytes`` is read whole, with or without
Content-Length), and the ``ETag`` of every answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import parse_qs

from fastapi import APIRouter, Body, FastAPI, Header, Query, Request, Security
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, StreamingResponse
from fastapi.security import HTTPBearer
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hpclb.config import BackendConfig, HpclbConfig, PoolConfig, VipConfig
from hpclb.controller.operations import ConfigDocument, Operations, revision_of
from hpclb.faces.api import errors, views
from hpclb.faces.api.auth import Role, Tokens
from hpclb.faces.api.history import History, HistoryView, Sample
from hpclb.faces.diagnose import ConfigFacts, diagnose, gather
from hpclb.host.nicstats import NetlinkNicStats

STATIC_DIR = Path(__file__).with_name("static")
API_PREFIX = "/api/v1"
EVENT_INTERVAL_S = 1.0
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

TokenSource = Tokens | Callable[[], Tokens]


# --- the gate: auth, body cap, ETag ------------------------------------------------


def _bearer(scope: Scope) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def _query_token(scope: Scope) -> str | None:
    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token")
    return values[0] if values else None


class _TooLarge(Exception):
    pass


class Gate:
    """Token and role, body cap and ETag, before and around every route."""

    def __init__(self, app: ASGIApp, ops: Operations, tokens: TokenSource,
                 max_body_bytes: int) -> None:
        self.app, self.ops, self.max_body_bytes = app, ops, max_body_bytes
        self.tokens: Callable[[], Tokens] = tokens if callable(tokens) else (lambda: tokens)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/api/"):
            await self.app(scope, receive, send)
            return
        token = _bearer(scope)
        if token is None and scope["path"] == f"{API_PREFIX}/events":
            token = _query_token(scope)  # EventSource cannot set headers
        role = self.tokens().role_of(token)
        if role is None:
            await errors.error_response(
                "unauthorized", "a valid bearer token is required (Authorization: Bearer ...)",
                headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        if scope["method"] not in READ_METHODS and role < Role.WRITE:
            await self._answer(scope, receive, send, errors.error_response(
                "forbidden", "this token may read, not write"), role)
            return
        try:
            receive = await self._capped(scope, receive)
        except _TooLarge:
            await self._answer(scope, receive, send, errors.error_response(
                "too_large", f"the request body is larger than {self.max_body_bytes} bytes "
                "(appliance.api.max_body_bytes)"), role)
            return
        await self.app(scope, receive, self._with_etag(send, role))

    async def _answer(self, scope: Scope, receive: Receive, send: Send,
                      response: JSONResponse, role: Role) -> None:
        await response(scope, receive, self._with_etag(send, role))

    async def _capped(self, scope: Scope, receive: Receive) -> Receive:
        """The request's body read here, up to the cap (refused beyond it, by
        its Content-Length before anything is read, else as it streams in),
        and handed to the route from memory."""
        for key, value in scope.get("headers", ()):
            if key == b"content-length":
                try:
                    if int(value) > self.max_body_bytes:
                        raise _TooLarge
                except ValueError:
                    pass  # the server refuses a malformed length itself
        if scope["method"] in READ_METHODS:
            return receive
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client went away: the route sees an empty body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay

    def _with_etag(self, send: Send, role: Role) -> Send:
        """The revision as ETag, and the token's role (never the token) as
        X-Hpclb-Role, so the status page shows write buttons only to a writer."""
        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"etag" for k, _ in headers):
                    headers.append((b"etag", f'"{self.ops.revision()}"'.encode()))
                headers.append((b"x-hpclb-role", role.name.lower().encode()))
                message = {**message, "headers": headers}
            await send(message)
        return sending


# --- request and response bodies -------------------------------------------------


class RevisionOut(BaseModel):
    revision: str


class VipWrite(RevisionOut):
    vip: views.Vip


class PoolWrite(RevisionOut):
    pool: views.Pool


class BackendWrite(RevisionOut):
    backend: views.Backend


class BackendOut(BaseModel):
    backend: views.Backend


class PinBody(BaseModel):
    model_config = {"extra": "forbid"}

    weight: float = Field(ge=0, allow_inf_nan=False, description="the ring weight to hold")
    duration_s: float = Field(gt=0, le=86400, allow_inf_nan=False,
                              description="how long; then the pin ends by itself")


class EventOut(BaseModel):
    """The data of each ``event: status`` of /api/v1/events."""

    status: views.StatusView
    backends: list[views.Backend]
    sample: Sample | None


def _etag(value: str | None) -> str | None:
    """An If-Match header's revision: quotes and a weak prefix dropped; None
    for none or ``*`` (any revision)."""
    if value is None:
        return None
    value = value.strip()
    if value.startswith("W/"):
        value = value[2:]
    value = value.strip().strip('"')
    return None if value in ("", "*") else value


def _body_schema(model: type[BaseModel], components: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of a configuration model as a request body: its name
    is the path's, so not a field; nested models go to the components."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(schema.pop("$defs", {}))
    schema["properties"] = {k: v for k, v in schema.get("properties", {}).items() if k != "name"}
    schema["required"] = [k for k in schema.get("required", []) if k != "name"]
    if not schema["required"]:
        del schema["required"]
    return schema


def _body_doc(schema: dict[str, Any]) -> dict[str, Any]:
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": schema}}}}


ERRORS = {status: {"model": errors.ErrorBody, "description": kind}
          for kind, status in errors.STATUS.items()
          if kind not in ("internal", "method_not_allowed")}
READ_ERRORS = {s: ERRORS[s] for s in (401, 404, 422, 503)}

Fields = Annotated[dict[str, Any], Body()]
IfMatch = Annotated[str | None, Header(alias="If-Match",
                                       description='"<revision>" or *: refuse (412) unless '
                                       "the configuration is still at that revision")]


def create_app(ops: Operations, tokens: TokenSource, max_body_bytes: int,
               history: History, diagnose_interval_s: float = 2.0) -> FastAPI:
    """The API over ``ops``; ``tokens`` may be a callable, read per request
    (a reload re-reads the token files without a new server).
    ``diagnose_interval_s``: how long /diagnose watches the counters (what
    rises meanwhile is happening now)."""
    app = FastAPI(title="hpclb", version="1",
                  description="The hpclb appliance's REST API: configuration, status, "
                  "counters, history; writes edit the configuration file.")
    errors.install(app)
    bearer = HTTPBearer(auto_error=False, description="a read or a write token")
    api = APIRouter(prefix=API_PREFIX, dependencies=[Security(bearer)])
    components: dict[str, Any] = {}
    vip_body = _body_doc(_body_schema(VipConfig, components))
    pool_body = _body_doc(_body_schema(PoolConfig, components))
    backend_body = _body_doc(_body_schema(BackendConfig, components))

    def config() -> HpclbConfig:
        return ops.config()

    def change(edit: Callable[[ConfigDocument], None], if_match: str | None) -> str:
        return ops.change(edit, if_match=_etag(if_match))

    def vip(name: str) -> views.Vip:
        for v in config().vips:
            if v.name == name:
                return views.vip_view(v, ops.status())
        raise errors.ApiError("not_found", f"no VIP {name!r}")

    def pool(name: str) -> views.Pool:
        cfg = config()
        if name not in cfg.pools:
            raise errors.ApiError("not_found", f"no pool {name!r}")
        return views.pool_view(cfg, name, cfg.pools[name])

    def backend(name: str) -> views.Backend:
        found = views.find_backend(config(), name)
        if found is None:
            raise errors.ApiError("not_found", f"no backend {name!r}")
        return views.backend_view(found[0], found[1], ops.status())

    def with_etag(body: BaseModel, revision: str) -> JSONResponse:
        return JSONResponse(body.model_dump(mode="json", by_alias=True),
                            headers={"ETag": f'"{revision}"'})

    # --- reads ---------------------------------------------------------------

    @api.get("/status", response_model=views.StatusView, responses=READ_ERRORS)
    def get_status() -> views.StatusView:
        return views.status_view(config(), ops.status(), ops.revision())

    @api.get("/config", response_model=dict[str, Any], responses={
        **READ_ERRORS, 200: {"description": "the configuration in force",
                             "content": {"application/json": {}, "text/yaml": {
                                 # The file's text, a YAML mapping (format=yaml).
                                 "schema": {"type": "object"}}}}})
    def get_config(format: Literal["json", "yaml"] = "json") -> Any:
        text = ops.config_text()
        headers = {"ETag": f'"{revision_of(text)}"'}
        if format == "yaml":
            return PlainTextResponse(text, media_type="text/yaml", headers=headers)
        # The object parsed from that text: the same revision as the ETag.
        cfg = ops.config()
        return JSONResponse(cfg.model_dump(mode="json"), headers=headers)

    @api.get("/vips", response_model=list[views.Vip], responses=READ_ERRORS)
    def get_vips() -> list[views.Vip]:
        return views.vips_view(config(), ops.status())

    @api.get("/vips/{name}", response_model=views.Vip, responses=READ_ERRORS)
    def get_vip(name: str) -> views.Vip:
        return vip(name)

    @api.get("/pools", response_model=list[views.Pool], responses=READ_ERRORS)
    def get_pools() -> list[views.Pool]:
        return views.pools_view(config())

    @api.get("/pools/{name}", response_model=views.Pool, responses=READ_ERRORS)
    def get_pool(name: str) -> views.Pool:
        return pool(name)

    @api.get("/backends", response_model=list[views.Backend], responses=READ_ERRORS)
    def get_backends() -> list[views.Backend]:
        return views.backends_view(config(), ops.status())

    @api.get("/backends/{name}", response_model=views.Backend, responses=READ_ERRORS)
    def get_backend(name: str) -> views.Backend:
        return backend(name)

    @api.get("/counters", response_model=views.CountersView, responses=READ_ERRORS)
    def get_counters() -> JSONResponse:
        return JSONResponse(views.counters_view(config(), ops.status())
                            .model_dump(mode="json", by_alias=True))

    @api.get("/history", response_model=HistoryView, responses=READ_ERRORS)
    def get_history(seconds: Annotated[int, Query(ge=1, le=900)] = 300) -> HistoryView:
        return history.window(seconds)

    @api.get("/diagnose", response_model=views.DiagnoseView, responses=READ_ERRORS)
    def get_diagnose() -> views.DiagnoseView:
        cfg = config()
        try:
            inputs = gather(ops.status, NetlinkNicStats(cfg.appliance.netns),
                            memory_history=[(m.time, m.control_rss_bytes, m.dataplane_rss_bytes)
                                            for m in history.memory()],
                            config=ConfigFacts.from_config(cfg),
                            interval_s=diagnose_interval_s)
        except LookupError as err:  # no snapshot yet: the controller just started
            raise errors.ApiError("unavailable", str(err)) from None
        return views.DiagnoseView(findings=[views.Finding(**f.to_dict())
                                            for f in diagnose(inputs)], time=time.time())

    @api.get("/events", response_class=StreamingResponse, responses={
        **READ_ERRORS, 200: {"description": "server-sent events: one `event: status` a second, "
                             "its data an EventOut", "content": {"text/event-stream": {
                                 "schema": {"type": "string"}}}}})
    async def get_events(request: Request,
                         token: Annotated[str | None, Query(
                             description="the token, for EventSource (no headers)")] = None,
                         ) -> StreamingResponse:
        del token  # checked by the gate

        async def stream() -> AsyncIterator[str]:
            while not await request.is_disconnected():
                cfg, status = config(), ops.status()
                event = EventOut(status=views.status_view(cfg, status, ops.revision()),
                                 backends=views.backends_view(cfg, status),
                                 sample=history.last())
                yield f"event: status\ndata: {event.model_dump_json()}\n\n"
                await asyncio.sleep(EVENT_INTERVAL_S)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store"})

    # --- writes ----------------------------------------------------------------

    @api.put("/vips/{name}", response_model=VipWrite, responses=ERRORS, openapi_extra=vip_body)
    def put_vip(name: str, fields: Fields, if_match: IfMatch = None) -> JSONResponse:
        revision = change(lambda d: d.put_vip(name, fields), if_match)
        return with_etag(VipWrite(revision=revision, vip=vip(name)), revision)

    @api.delete("/vips/{name}", response_model=RevisionOut, responses=ERRORS)
    def delete_vip(name: str, if_match: IfMatch = None) -> JSONResponse:
        revision = change(lambda d: d.delete_vip(name), if_match)
        return with_etag(RevisionOut(revision=revision), revision)

    @api.put("/pools/{name}", response_model=PoolWrite, responses=ERRORS,
             openapi_extra=pool_body)
    def put_pool(name: str, fields: Fields, if_match: IfMatch = None) -> JSONResponse:
        revision = change(lambda d: d.put_pool(name, fields), if_match)
        return with_etag(PoolWrite(revision=revision, pool=pool(name)), revision)

    @api.delete("/pools/{name}", response_model=RevisionOut, responses=ERRORS)
    def delete_pool(name: str, if_match: IfMatch = None) -> JSONResponse:
        revision = change(lambda d: d.delete_pool(name), if_match)
        return with_etag(RevisionOut(revision=revision), revision)

    @api.put("/pools/{pool_name}/backends/{name}", response_model=BackendWrite,
             responses=ERRORS, openapi_extra=backend_body)
    def put_backend(pool_name: str, name: str, fields: Fields,
                    if_match: IfMatch = None) -> JSONResponse:
        revision = change(lambda d: d.put_backend(pool_name, name, fields), if_match)
        return with_etag(BackendWrite(revision=revision, backend=backend(name)), revision)

    @api.delete("/pools/{pool_name}/backends/{name}", response_model=RevisionOut,
                responses=ERRORS)
    def delete_backend(pool_name: str, name: str, if_match: IfMatch = None) -> JSONResponse:
        revision = change(lambda d: d.delete_backend(pool_name, name), if_match)
        return with_etag(RevisionOut(revision=revision), revision)

    def set_state(name: str, state: str, if_match: str | None) -> JSONResponse:
        revision = change(lambda d: d.set_backend_state(name, state), if_match)
        return with_etag(BackendWrite(revision=revision, backend=backend(name)), revision)

    for action, state in (("drain", "draining"), ("undrain", "up"), ("down", "down"),
                          ("up", "up")):
        def post_state(name: str, if_match: IfMatch = None, state: str = state) -> JSONResponse:
            return set_state(name, state, if_match)
        api.add_api_route(f"/backends/{{name}}/{action}", post_state, methods=["POST"],
                          name=f"backend_{action}", response_model=BackendWrite,
                          responses=ERRORS,
                          summary=f"the backend's admin state in the configuration: {state}")

    @api.put("/backends/{name}/pin", response_model=BackendOut, responses=ERRORS)
    def put_pin(name: str, body: PinBody) -> BackendOut:
        backend(name)
        until = time.time() + body.duration_s
        ops.pin(name, body.weight, body.duration_s)
        view = backend(name)
        # The snapshot is refreshed every second: the pin just taken is known now.
        view.weight.pinned = views.Pin(weight=body.weight, until=until)
        return BackendOut(backend=view)

    @api.delete("/backends/{name}/pin", response_model=BackendOut, responses=ERRORS)
    def delete_pin(name: str) -> BackendOut:
        backend(name)
        ops.unpin(name)
        view = backend(name)
        view.weight.pinned = None
        return BackendOut(backend=view)

    app.include_router(api)

    # --- the page ----------------------------------------------------------------

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        page = STATIC_DIR / "index.html"
        if not page.is_file():
            raise errors.ApiError("not_found", "the status page is not installed")
        return FileResponse(page, media_type="text/html")

    app.mount("/static", StaticFiles(directory=STATIC_DIR, check_dir=False), name="static")

    plain_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = plain_openapi()
            schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    # Outside the routes' exception handling: it answers refusals itself.
    app.add_middleware(Gate, ops=ops, tokens=tokens, max_body_bytes=max_body_bytes)
    return app
