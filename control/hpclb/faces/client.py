"""A small client of the appliance's REST API (``/api/v1``), for `hpclb`'s
client commands (:mod:`hpclb.faces.commands`) and for scripts.

Every failure is one of two exceptions, so a command maps it to its exit
status: :class:`ApiError` (the API answered with an error body: kind, message,
problems) and :class:`ApiUnreachable` (no answer: nothing listening, wrong
address, a timeout). The token goes into the ``Authorization`` header and
nowhere else: not into an exception, a ``repr`` or a message.

Read-modify-write: the client remembers the ``ETag`` of its last read and the
next write sends it as ``If-Match`` (then forgets it), so an edit computed
from what was read is refused (412) if the configuration changed in between,
instead of overwriting someone else's change.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

API_ENV = "HPCLB_API"
TOKEN_ENV = "HPCLB_API_TOKEN"
DEFAULT_API = "http://127.0.0.1:8443"
PREFIX = "/api/v1"
DEFAULT_TIMEOUT_S = 35.0  # a write may wait up to 30 s for the controller's loop
CONNECT_TIMEOUT_S = 5.0


@dataclass
class ApiError(Exception):
    """The API refused the request: its error body."""

    status: int
    kind: str
    message: str
    problems: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.kind} ({self.status}): {self.message}"


@dataclass
class ApiUnreachable(Exception):
    """No answer from the API at ``url``; ``reason`` says what went wrong."""

    url: str
    reason: str

    def __str__(self) -> str:
        return f"cannot reach the API at {self.url}: {self.reason}"


class TokenFileError(Exception):
    """The token file cannot be used (the message names the file, never a token)."""


def read_token_file(path: Path) -> str:
    """The first token of ``path`` (one a line, ``#`` comments, as the API's files)."""
    try:
        text = path.read_text()
    except OSError as err:
        raise TokenFileError(f"{path}: cannot read the token file: "
                             f"{err.strerror or err}") from None
    except UnicodeDecodeError:
        raise TokenFileError(f"{path}: not a text file") from None
    for line in text.splitlines():
        token = line.split("#", 1)[0].strip()
        if token:
            return token
    raise TokenFileError(f"{path}: holds no token")


def resolve_token(token_file: Path | None, env: Mapping[str, str] | None = None) -> str | None:
    """The token to send: from ``token_file`` when given, else $HPCLB_API_TOKEN."""
    if token_file is not None:
        return read_token_file(token_file)
    value = (os.environ if env is None else env).get(TOKEN_ENV, "").strip()
    return value or None


def resolve_url(url: str | None, env: Mapping[str, str] | None = None) -> str:
    """The API's base URL: ``url``, else $HPCLB_API, else the default."""
    value = url or (os.environ if env is None else env).get(API_ENV, "").strip()
    return (value or DEFAULT_API).rstrip("/")


def _error_of(response: httpx.Response) -> ApiError:
    """The API's error body as an ApiError; a body that is not one (a proxy's
    page, an older server) still gives a one-line message."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        problems = body.get("problems") or []
        return ApiError(response.status_code, body["error"],
                        str(body.get("message") or response.reason_phrase),
                        [str(p) for p in problems] if isinstance(problems, list) else [])
    text = response.text.strip().splitlines()
    message = text[0][:200] if text else response.reason_phrase
    return ApiError(response.status_code, f"http_{response.status_code}", message)


class ApiClient:
    """The API at ``base_url``; ``transport`` is for tests (an ASGI app, a mock)."""

    def __init__(self, base_url: str, token: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.Client(
            base_url=self.base_url, headers=headers, transport=transport,
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, CONNECT_TIMEOUT_S)),
            follow_redirects=False)
        #: The revision (ETag, unquoted) of the last read; the next write's If-Match.
        self.read_etag: str | None = None
        #: The revision the last answer carried (reads and writes).
        self.revision: str | None = None

    def __repr__(self) -> str:  # never the token
        return f"ApiClient({self.base_url!r})"

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # --- the one request path --------------------------------------------------

    def request(self, method: str, path: str, *, body: Any = None,
                params: Mapping[str, Any] | None = None) -> httpx.Response:
        """One request to ``/api/v1`` + ``path``; the answer when 2xx, else
        ApiError; ApiUnreachable when there is no answer."""
        headers = {}
        is_read = method in ("GET", "HEAD")
        if not is_read and self.read_etag is not None:
            headers["If-Match"] = f'"{self.read_etag}"'
        if not is_read:
            self.read_etag = None  # one write per read
        try:
            response = self._http.request(method, PREFIX + path, json=body, params=params,
                                          headers=headers)
        except httpx.TimeoutException as err:
            raise ApiUnreachable(self.base_url, f"no answer in time ({type(err).__name__})") \
                from None
        except httpx.TransportError as err:
            raise ApiUnreachable(self.base_url, str(err) or type(err).__name__) from None
        etag = response.headers.get("etag")
        if etag:
            self.revision = etag.removeprefix("W/").strip('"')
            if is_read:
                self.read_etag = self.revision
        if response.is_success:
            return response
        raise _error_of(response)

    def _json(self, response: httpx.Response) -> Any:
        try:
            return response.json()
        except ValueError:
            raise ApiError(response.status_code, "invalid_answer",
                           f"the API at {self.base_url} answered {PREFIX} with something "
                           "that is not JSON: is this the hpclb API?") from None

    def get(self, path: str, params: Mapping[str, Any] | None = None) -> Any:
        return self._json(self.request("GET", path, params=params))

    def get_text(self, path: str, params: Mapping[str, Any] | None = None) -> str:
        return self.request("GET", path, params=params).text

    def put(self, path: str, body: Any) -> Any:
        return self._json(self.request("PUT", path, body=body))

    def post(self, path: str, body: Any = None) -> Any:
        return self._json(self.request("POST", path, body=body))

    def delete(self, path: str) -> Any:
        return self._json(self.request("DELETE", path))

    def forget_read(self) -> None:
        """The next write applies to whatever is current (no If-Match)."""
        self.read_etag = None
