"""Sockets the probe tests share."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

WAIT = 10.0


def has_ipv6_loopback() -> bool:
    """Whether ::1 can be bound here (not so where IPv6 is disabled)."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@contextmanager
def syn_dropping_port() -> Iterator[int]:
    """A listener that never accepts, backlog 0: once its accept queue holds one
    connection (the filler) the kernel drops further SYNs, so a connect to the
    port can only time out."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(0)
    port = lst.getsockname()[1]
    filler = socket.socket()
    try:
        filler.settimeout(WAIT)
        filler.connect(("127.0.0.1", port))
        yield port
    finally:
        filler.close()
        lst.close()
