"""Files the control plane must never leave half-written: the configuration
the REST API writes back, the id checkpoint, the state checkpoint."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, data: bytes, mode: int, *, tmp: Path | None = None,
                     before_replace: Callable[[], None] | None = None) -> None:
    """Replace ``path`` with ``data``: a temporary file beside it (``tmp``, by
    default ``.NAME.tmp``) written and fsynced, ``before_replace`` (the state
    checkpoint keeps the former file there), a rename, an fsync of the folder.
    A crash leaves the old file or the new one, never a mix; a failure removes
    the temporary file and raises. The file gets ``mode`` whatever the umask."""
    tmp = tmp or path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        if before_replace is not None:
            before_replace()
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
