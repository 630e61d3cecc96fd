"""Bearer tokens of the API: where they come from and which role each gives.

Two roles: ``read`` (GETs) and ``write`` (everything; a write token also
reads). Tokens come from ``appliance.api.read_tokens_file`` and
``write_tokens_file`` (one a line, ``#`` comments) and from the environment
(``HPCLB_API_READ_TOKENS`` / ``HPCLB_API_WRITE_TOKENS``, comma separated).
A token is compared with every configured one in constant time per token, and
is never logged, echoed or put in an error message; a file or a variable it
came from may be named.
"""

from __future__ import annotations

import hmac
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

from hpclb.config import ApiConfig
from hpclb.controller import StartError

READ_ENV = "HPCLB_API_READ_TOKENS"
WRITE_ENV = "HPCLB_API_WRITE_TOKENS"
# Short tokens can be guessed: 16 characters of a random token are ~96 bits.
MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 4096


class Role(IntEnum):
    READ = 1
    WRITE = 2


@dataclass(frozen=True)
class Tokens:
    read: tuple[bytes, ...] = ()
    write: tuple[bytes, ...] = ()

    def role_of(self, token: str | None) -> Role | None:
        """The role ``token`` gives, or None. Every configured token is
        compared (no early exit), each with ``hmac.compare_digest``."""
        if not token:
            return None
        given = token.encode("utf-8", "surrogateescape")
        role: Role | None = None
        for known in self.read:
            if hmac.compare_digest(given, known) and role is None:
                role = Role.READ
        for known in self.write:
            if hmac.compare_digest(given, known):
                role = Role.WRITE
        return role

    def __repr__(self) -> str:  # never the tokens themselves
        return f"Tokens(read={len(self.read)}, write={len(self.write)})"


def _checked(tokens: list[str], where: str) -> tuple[bytes, ...]:
    for i, token in enumerate(tokens, 1):
        if len(token) < MIN_TOKEN_CHARS:
            raise StartError(f"{where}: token {i} is shorter than {MIN_TOKEN_CHARS} characters")
        if len(token) > MAX_TOKEN_CHARS or any(c.isspace() or not c.isprintable()
                                               for c in token):
            raise StartError(f"{where}: token {i} is not a printable word of at most "
                             f"{MAX_TOKEN_CHARS} characters")
    return tuple(t.encode() for t in tokens)


def read_token_file(path: Path, setting: str) -> tuple[bytes, ...]:
    """The tokens of one file; StartError naming the file (never a token)
    when it cannot be read, is readable by others, or holds a short token."""
    where = f"appliance.api.{setting} {path}"
    try:
        mode = path.stat().st_mode
        if mode & stat.S_IROTH:
            raise StartError(f"{where}: readable by others (mode {stat.S_IMODE(mode):04o}); "
                             f"chmod o-r it")
        text = path.read_text()
    except OSError as err:
        raise StartError(f"{where}: cannot read: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise StartError(f"{where}: not a text file") from None
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return _checked([line for line in lines if line], where)


def _from_env(env: Mapping[str, str], name: str) -> tuple[bytes, ...]:
    words = [w.strip() for w in env.get(name, "").split(",")]
    return _checked([w for w in words if w], f"environment {name}")


def load_tokens(api: ApiConfig, env: Mapping[str, str] | None = None) -> Tokens:
    """Every token the API accepts; StartError when there is none at all or a
    source is unusable."""
    env = os.environ if env is None else env
    read = _from_env(env, READ_ENV)
    write = _from_env(env, WRITE_ENV)
    if api.read_tokens_file is not None:
        read += read_token_file(api.read_tokens_file, "read_tokens_file")
    if api.write_tokens_file is not None:
        write += read_token_file(api.write_tokens_file, "write_tokens_file")
    if not read and not write:
        raise StartError("appliance.api: no token configured: set appliance.api."
                         f"read_tokens_file / write_tokens_file or {READ_ENV} / {WRITE_ENV}")
    return Tokens(read, write)
