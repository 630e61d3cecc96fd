"""The API's one error body, and how each failure maps onto it.

Every error, whatever raised it (an edit the controller refused, a body that
fails the schema, an unknown path, a missing token), answers
``{"error": kind, "message": one line, "problems": [..]}``; bad input is
always a 4xx, never a 500.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from hpclb.controller.operations import EditError

log = logging.getLogger(__name__)

#: HTTP status of each error kind (the spec's table).
STATUS = {
    "unauthorized": 401,
    "forbidden": 403,
    "not_found": 404,
    "method_not_allowed": 405,
    "conflict": 409,
    "precondition_failed": 412,
    "too_large": 413,
    "invalid": 422,
    "unavailable": 503,
    "internal": 500,
}
_KIND_OF_STATUS = {status: kind for kind, status in STATUS.items()}


class ErrorBody(BaseModel):
    error: str = Field(description="the kind: unauthorized, forbidden, not_found, conflict, "
                       "precondition_failed, too_large, invalid, unavailable...")
    message: str = Field(description="one line for a human")
    problems: list[str] = Field(default_factory=list,
                                description="one line per problem (e.g. each ConfigError line)")


class ApiError(Exception):
    """An error the API answers itself (auth, unknown names, bad parameters)."""

    def __init__(self, kind: str, message: str, problems: Sequence[str] = (),
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.kind, self.message, self.problems = kind, message, list(problems)
        self.headers = headers or {}


def error_response(kind: str, message: str, problems: Sequence[str] = (),
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorBody(error=kind, message=message, problems=list(problems))
    return JSONResponse(body.model_dump(), status_code=STATUS.get(kind, 400), headers=headers)


def _validation_problems(errors: Sequence[Any]) -> list[str]:
    """One line per schema error: where and what, never the input itself (a
    query string may hold a token)."""
    out = []
    for e in errors:
        loc = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
        out.append(f"{loc}: {e.get('msg', 'invalid')}" if loc else str(e.get("msg", "invalid")))
    return out


def install(app: FastAPI) -> None:
    """Every failure of ``app`` in the one error body."""

    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.kind, exc.message, exc.problems, exc.headers)

    @app.exception_handler(EditError)
    async def _edit(_: Request, exc: EditError) -> JSONResponse:
        kind = exc.kind if exc.kind in STATUS else "invalid"
        return error_response(kind, exc.message, exc.problems)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = _validation_problems(exc.errors())
        return error_response("invalid", "the request does not match the API's schema: "
                              + "; ".join(problems[:3]), problems)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = _KIND_OF_STATUS.get(exc.status_code, "invalid")
        if exc.status_code == 404:
            message = f"no such resource: {request.url.path}"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return error_response(kind, message, headers=dict(exc.headers or {}))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        # A bug of ours, not bad input: logged with its traceback (the request
        # line only: headers and bodies may carry tokens).
        log.error("api: %s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response("internal", f"internal error: {type(exc).__name__}")
