"""A client of DPDK's telemetry socket (the protocol ``dpdk-telemetry.py``
speaks): connect a SOCK_SEQPACKET socket to the process's
``dpdk_telemetry.v2``, read its greeting, send a command, read one JSON reply.

The forwarder registers its own commands there (/hpclb/stats, /hpclb/workers,
/hpclb/vips, /hpclb/backends, /hpclb/ports) beside DPDK's (/ethdev/xstats...).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

RUNTIME_DIR = Path("/var/run/dpdk")


class DpdkTelemetryError(RuntimeError):
    pass


def socket_path(file_prefix: str) -> Path:
    return RUNTIME_DIR / file_prefix / "dpdk_telemetry.v2"


def query(file_prefix: str, command: str, timeout_s: float = 2.0) -> Any:
    """The value the process answers ``command`` (``/cmd`` or ``/cmd,params``)
    with: the reply's only key."""
    path = socket_path(file_prefix)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(timeout_s)
        try:
            s.connect(str(path))
            greeting = json.loads(s.recv(4096))
            s.send(command.encode())
            reply = json.loads(s.recv(int(greeting.get("max_output_len", 16384))))
        except (OSError, ValueError) as exc:
            raise DpdkTelemetryError(f"{path}: {command}: {exc}") from exc
    name = command.split(",", 1)[0]  # "/cmd,params" is answered under "/cmd"
    if not isinstance(reply, dict) or name not in reply:
        raise DpdkTelemetryError(f"{path}: {command}: unexpected reply {reply!r:.200}")
    return reply[name]
