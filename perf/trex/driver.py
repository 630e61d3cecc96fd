"""TRex stateless client driver: JSON lines on stdin, one JSON answer per line on stdout.

Runs in the TRex client's own interpreter (``.venv-trex``, ``pip install
lbr-trex-client``): that package brings its own scapy and zmq, which must never meet the
control plane's. ``hpclb.lab.trex`` starts this script as a child process and speaks
to it; nothing of hpclb is imported here.

Requests (one JSON object per line; every answer has ``"ok"``, and ``"error"`` when
not ok):

* ``{"cmd": "build", "profile": PATH, "tunables": {...}}``: load the profile without a
  server; answers its streams as TRex's JSON (``"profile"``) and their names. The
  unit tests use it to check that every profile builds and serialises.
* ``{"cmd": "connect", "server": HOST, "sync_port": 4501, "async_port": 4500,
  "ports": [0]}``: connect, take the ports (reset), promiscuous on; answers the
  server's version and the ports' info.
* ``{"cmd": "load", "profile": PATH, "tunables": {...}, "tx_ports": [0]}``: the
  profile every later trial runs on ``tx_ports`` (default: the first port taken),
  checked by building it once.
* ``{"cmd": "trial", "rate_pps": R, "seconds": S, "settle_s": 0.5}``: remove the
  streams, load the profile at ``rate_pps`` (its ``--rate_pps`` tunable: the total,
  latency stream included), clear the counters, send for ``S`` seconds, wait
  ``settle_s`` for frames in flight, and answer the ports' counters (``opackets``,
  ``ipackets``, ``oerrors``, ``ierrors``, ``tx_pps``...), the latency stream's
  statistics per packet group (``latency``: min/avg/max in µs, the HDR histogram as
  TRex encodes it, ``hdrh``, and its error counters) and its frame counts
  (``flow_stats``).
* ``{"cmd": "quit"}``: release the ports, disconnect, exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from typing import Any

# The real stdout carries the protocol; the TRex client prints (warnings, progress)
# go to stderr, where they cannot corrupt an answer.
_OUT = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
sys.stdout = sys.stderr

try:  # lbr-trex-client sets up TRex's import paths when imported
    import lbr_trex_client  # noqa: F401
except ImportError:  # TRex's own client tree on PYTHONPATH instead
    pass

from trex.stl.api import STLClient, STLProfile  # noqa: E402


def _tunables(tunables: dict[str, Any], rate_pps: float | None = None) -> list[str]:
    merged = dict(tunables)
    if rate_pps is not None:
        merged["rate_pps"] = rate_pps
    return [x for k, v in merged.items() if v is not None for x in (f"--{k}", str(v))]


def _load(profile: str, tunables: dict[str, Any], rate_pps: float | None = None) -> Any:
    prof = STLProfile.load_py(profile, direction=0, port_id=0,
                              tunables=_tunables(tunables, rate_pps))
    if prof is None:
        raise ValueError(f"profile {profile} built nothing (--help?)")
    return prof


def _jsonable(obj: Any) -> Any:
    """TRex's stats hold numpy-free plain values but with int keys (ports, pg_ids)."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float | int | str | bool) or obj is None:
        return obj
    return str(obj)


class Driver:
    def __init__(self) -> None:
        self.client: Any = None
        self.ports: list[int] = [0]
        self.tx_ports: list[int] = [0]
        self.profile: str | None = None
        self.tunables: dict[str, Any] = {}

    def build(self, req: dict[str, Any]) -> dict[str, Any]:
        prof = _load(req["profile"], req.get("tunables", {}), req.get("rate_pps"))
        return {"profile": prof.to_json(),
                "streams": [s.get_name() for s in prof.get_streams()]}

    def connect(self, req: dict[str, Any]) -> dict[str, Any]:
        self.ports = [int(p) for p in req.get("ports", [0])]
        if self.client is not None:  # a retry: the earlier attempt's connection goes
            with contextlib.suppress(Exception):
                self.client.disconnect()
            self.client = None
        self.client = STLClient(server=req.get("server", "127.0.0.1"),
                                sync_port=int(req.get("sync_port", 4501)),
                                async_port=int(req.get("async_port", 4500)),
                                verbose_level="error")
        self.client.connect()
        self.client.reset(ports=self.ports)
        # Forwarded frames carry the destination MAC the appliance chose (a backend's,
        # or the sender's for a reflector): take them all.
        promiscuous: Any = True
        try:
            self.client.set_port_attr(ports=self.ports, promiscuous=True)
        except Exception as err:  # a port type without it (TRex says which)
            promiscuous = f"{type(err).__name__}: {err}"
        return {"server_version": _jsonable(self.client.get_server_version()),
                "port_info": _jsonable(self.client.get_port_info(ports=self.ports)),
                "promiscuous": promiscuous}

    def load(self, req: dict[str, Any]) -> dict[str, Any]:
        self.profile = req["profile"]
        self.tunables = dict(req.get("tunables", {}))
        self.tx_ports = [int(p) for p in req.get("tx_ports", self.ports[:1])]
        if set(self.tx_ports) - set(self.ports):
            raise ValueError(f"tx_ports {self.tx_ports} not among the ports taken {self.ports}")
        prof = _load(self.profile, self.tunables)
        return {"streams": [s.get_name() for s in prof.get_streams()]}

    def trial(self, req: dict[str, Any]) -> dict[str, Any]:
        if self.client is None or self.profile is None:
            raise RuntimeError("trial before connect and load")
        c = self.client
        seconds = float(req["seconds"])
        c.stop(ports=self.ports)
        c.remove_all_streams(ports=self.ports)
        prof = _load(self.profile, self.tunables, float(req["rate_pps"]))
        c.add_streams(prof.get_streams(), ports=self.tx_ports)
        c.clear_stats(ports=self.ports)
        t0 = time.monotonic()
        c.start(ports=self.tx_ports, mult="1", duration=seconds, force=True)
        # The server ends the traffic after ``seconds`` and says so on its event
        # channel; an event the subscriber missed would leave the client waiting
        # forever (wait_on_traffic), so wait a bounded time and stop explicitly (a
        # synchronous RPC, harmless on stopped ports).
        deadline = t0 + seconds + float(req.get("grace_s", 5.0))
        while c.is_traffic_active(ports=self.tx_ports) and time.monotonic() < deadline:
            time.sleep(0.05)
        late = bool(c.is_traffic_active(ports=self.tx_ports))
        c.stop(ports=self.tx_ports)
        sent_s = time.monotonic() - t0
        time.sleep(float(req.get("settle_s", 0.5)))
        stats = c.get_stats(ports=self.ports)
        return {
            "seconds": seconds,
            "wall_s": sent_s,
            "stopped_late": late,
            "ports": {str(p): _jsonable(stats[p]) for p in self.ports},
            "total": _jsonable(stats.get("total", {})),
            "latency": _jsonable(stats.get("latency", {})),
            "flow_stats": _jsonable(stats.get("flow_stats", {})),
        }

    def quit(self, req: dict[str, Any]) -> dict[str, Any]:
        if self.client is not None:
            try:
                self.client.stop(ports=self.ports)
                self.client.release(ports=self.ports)
            finally:
                self.client.disconnect()
                self.client = None
        return {}


def main() -> int:
    driver = Driver()
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = "?"
        try:
            req = json.loads(line)
            cmd = req.get("cmd", "?")
            handler = getattr(driver, cmd, None) if cmd in (
                "build", "connect", "load", "trial", "quit") else None
            if handler is None:
                raise ValueError(f"unknown command {cmd!r}")
            answer = {"ok": True, **handler(req)}
        except Exception as err:  # the answer carries it; the caller decides
            answer = {"ok": False, "error": f"{type(err).__name__}: {err}",
                      "trace": traceback.format_exc()[-3000:]}
        _OUT.write(json.dumps(answer) + "\n")
        if cmd == "quit":
            break
    else:
        driver.quit({})  # stdin closed: the caller went away; give the ports back
    return 0


if __name__ == "__main__":
    sys.exit(main())
