"""Network namespaces for the calling thread only.

Sockets belong to the namespace they were created in, so a thread can step into
a namespace, open a socket there and step back out, and the socket keeps
working from anywhere in the process. Linux only; needs CAP_SYS_ADMIN.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CLONE_NEWNET = 0x40000000

_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int, what: object) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns({what}): {os.strerror(err)}")


def enter_netns(name_or_path: str) -> None:
    """Move the calling thread into a named namespace (``/run/netns/NAME``) or the
    one at a path (``/proc/PID/ns/net``)."""
    path = Path(name_or_path) if "/" in name_or_path else Path("/run/netns") / name_or_path
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _setns(fd, path)
    finally:
        os.close(fd)


def new_netns() -> None:
    """Move the calling thread into a new, empty namespace (only ``lo``, down)."""
    if _libc.unshare(CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNET): {os.strerror(err)}")


@contextmanager
def inside(name_or_path: str) -> Iterator[None]:
    """Run the block in another namespace, then return to this thread's own,
    whatever the block does."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        enter_netns(name_or_path)
        try:
            yield
        finally:
            _setns(own, "the thread's own namespace")
    finally:
        os.close(own)
