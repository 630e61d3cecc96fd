"""The NAT end-to-end suites' shared pieces (``test_e2e_nat``, ``test_e2e_nat6``):
long-lived TCP connections held open through a VIP by one client process
(``Holder``), and what the backends see of them.

``HOLDER`` sends a line on every connection every 100 ms and records which backend
answered each and how the connection ended (``reset``: an RST, ``closed``: a FIN,
``timeout``...); an IPv6 VIP's connections bind their fixed source ports on ``::``.
"""

from __future__ import annotations

import ipaddress
import json
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hpclb.contract.flowhash import flow_slot
from hpclb.lab.appliance import LAB_PORT, LAB_VIP, LabAppliance
from hpclb.lab.gateway import GatewayLab
from hpclb.lab.topology import Lab

BACKENDS = ("b1", "b2", "b3")
# How long a held connection waits for one answer: longer than a backend takes to
# be marked down plus TCP's retransmission back-off to the next try (about 6 s).
HOLD_TIMEOUT_S = 20.0


# --------------------------------------------------------------------------- holder

# Holds COUNT TCP connections to VIP:PORT (from source ports FIRST.. when FIRST > 0),
# each sending a line every INTERVAL s and reading the backend's name back (TIMEOUT s
# per step). Prints {"conns": [...]} once all are open, again for every "report" line
# on stdin, and a last time after "quit" (or EOF) has closed them all. A connection
# stops at its first error: "reset" (RST), "closed" (FIN), "timeout"...
HOLDER = r"""
import asyncio, json, sys, time

vip, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
interval, timeout, first = float(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6])
start = time.monotonic()


class Closed(Exception):
    pass


def error_name(exc):
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return "timeout"
    if isinstance(exc, Closed):
        return "closed"
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, ConnectionResetError):
        return "reset"
    if isinstance(exc, OSError) and exc.errno is not None:
        return f"oserror_{exc.errno}"
    return type(exc).__name__


async def hold(c, stop):
    local = ("::" if ":" in vip else "0.0.0.0", c["sport"]) if c["sport"] else None
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(vip, port, local_addr=local), timeout)
    except Exception as exc:
        c["error"] = error_name(exc)
        return
    c["sport"] = writer.get_extra_info("sockname")[1]
    try:
        line = await asyncio.wait_for(reader.readline(), timeout)
        if not line:
            raise Closed()
        c["greeting"] = line.decode(errors="replace").strip()
        while not stop.is_set():
            writer.write(b"line\n")
            await asyncio.wait_for(writer.drain(), timeout)
            line = await asyncio.wait_for(reader.readline(), timeout)
            if not line:
                raise Closed()
            name = line.decode(errors="replace").strip()
            c["names"][name] = c["names"].get(name, 0) + 1
            c["lines"] += 1
            try:
                await asyncio.wait_for(stop.wait(), interval)
            except asyncio.TimeoutError:
                pass
    except Exception as exc:
        c["error"] = error_name(exc)
        c["error_after_s"] = round(time.monotonic() - start, 3)
    finally:
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), timeout)
        except Exception:
            pass


def emit(conns):
    print(json.dumps({"conns": conns}), flush=True)


async def main():
    stop = asyncio.Event()
    conns = [{"sport": first + i if first else 0, "greeting": "", "names": {}, "lines": 0,
              "error": None} for i in range(count)]
    tasks = [asyncio.create_task(hold(c, stop)) for c in conns]
    deadline = time.monotonic() + timeout + 5
    while (any(not c["greeting"] and c["error"] is None for c in conns)
           and time.monotonic() < deadline):
        await asyncio.sleep(0.02)
    emit(conns)
    loop = asyncio.get_running_loop()
    while (await loop.run_in_executor(None, sys.stdin.readline)).strip() == "report":
        emit(conns)
    stop.set()
    await asyncio.wait(tasks, timeout=timeout + 5)
    emit(conns)


asyncio.run(main())
"""


class Holder:
    """Long-lived TCP connections through the VIP, held by ``HOLDER`` in the client's
    namespace. ``opened``: the connections once open (sport, greeting...)."""

    def __init__(self, lab: Lab, count: int, first: int, log: Path,
                 interval_s: float = 0.1, timeout_s: float = HOLD_TIMEOUT_S,
                 vip: str = LAB_VIP) -> None:
        self.lab = lab
        self.timeout_s = timeout_s
        self._log = open(log, "w")  # closed in stop()
        self.proc = lab.popen("cli", [sys.executable, "-c", HOLDER, vip, str(LAB_PORT),
                                      str(count), str(interval_s), str(timeout_s), str(first)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log)
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.opened = self._next(timeout_s + 30)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put("")

    def _next(self, timeout: float) -> list[dict[str, Any]]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the holder said nothing for {timeout}s") from None
        if not line:
            self._log.flush()
            raise AssertionError(f"the holder exited: {Path(self._log.name).read_text()}")
        conns: list[dict[str, Any]] = json.loads(line)["conns"]
        return conns

    def _send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def report(self) -> list[dict[str, Any]]:
        self._send("report")
        return self._next(30)

    def wait(self, predicate: Callable[[list[dict[str, Any]]], bool], timeout_s: float = 30.0,
             what: str = "condition") -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        while not predicate(conns := self.report()):
            assert time.monotonic() < deadline, f"holder: no {what} within {timeout_s}s: {conns}"
            time.sleep(0.2)
        return conns

    def wait_lines(self, more: int, since: list[dict[str, Any]] | None = None
                   ) -> list[dict[str, Any]]:
        """Wait until every connection still open has answered ``more`` lines more
        than in ``since`` (default: the current report)."""
        base = {c["sport"]: c["lines"] for c in (since or self.report())}
        return self.wait(lambda conns: all(c["error"] is not None
                                           or c["lines"] >= base[c["sport"]] + more
                                           for c in conns), what=f"{more} more lines")

    def close(self) -> list[dict[str, Any]]:
        """Close every connection (the client first); the last report."""
        try:
            self._send("quit")
            return self._next(self.timeout_s + 30)
        finally:
            self.stop()

    def stop(self) -> None:
        self.lab.stop_process(self.proc)
        self._log.close()


@contextmanager
def holders(lab: Lab, tmp_path: Path, **defaults: Any) -> Iterator[Callable[..., Holder]]:
    """A function that starts Holders (``defaults``: Holder's keyword arguments
    unless a call says otherwise); any still running on the way out is stopped."""
    started: list[Holder] = []

    def start(count: int, first: int, **kwargs: Any) -> Holder:
        holder = Holder(lab, count, first, tmp_path / f"holder{len(started)}.log",
                        **{**defaults, **kwargs})
        started.append(holder)
        return holder

    try:
        yield start
    finally:
        for holder in started:
            holder.stop()


def assert_all_held(conns: list[dict[str, Any]], *, backends: set[str] | None = None) -> None:
    """Every connection open, answered only by the backend that greeted it."""
    broken = [c for c in conns if c["error"] is not None or set(c["names"]) - {c["greeting"]}
              or c["greeting"] not in (backends or set(BACKENDS))]
    assert broken == [], f"connections broken or moved: {broken}"


def by_backend(conns: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in BACKENDS}
    for c in conns:
        out[c["greeting"]].append(c)
    return out


# --------------------------------------------------------------------------- helpers


Peers = dict[str, set[tuple[str, int]]]


def established_peers(lab: GatewayLab, since: Peers | None = None) -> Peers:
    """Per backend, the (address, port) of every established connection to LAB_PORT:
    whom the backend sees; those already in ``since`` left out."""
    peers: Peers = {}
    for i, name in enumerate(BACKENDS, 1):
        out = lab.exec(f"b{i}", ["ss", "-Htn", "state", "established",
                                 f"( sport = :{LAB_PORT} )"]).stdout
        # ss writes an IPv6 peer as [address]:port.
        peers[name] = {(addr.strip("[]"), int(port)) for addr, _, port in
                       (line.split()[-1].rpartition(":") for line in out.splitlines())}
        peers[name] -= (since or {}).get(name, set())
    return peers


def kill_connections(lab: GatewayLab, i: int, sports: set[int]) -> None:
    """Close (ss -K) the established connections from those client ports that backend
    ``i`` still holds: a backend cut off never learns that the client's side is gone,
    and would hold them until its server's idle timeout."""
    ports = " or ".join(f"dport = :{p}" for p in sorted(sports))
    lab.exec(f"b{i}", ["ss", "-K", "-Htn", "state", "established",
                       f"( sport = :{LAB_PORT} ) and ( {ports} )"], check=False)


def counters(app: LabAppliance) -> dict[str, int]:
    return dict(app.client.stats()["counters"])


def _backends(app: LabAppliance, version: int) -> list[tuple[int, str, int]]:
    """(data-plane id, lab name, state) of the backends of one IP version: backend
    i is 198.19.0.(10+i) or fd48:4c03::(10+i) (hexadecimal)."""
    size, first = (4, 10) if version == 4 else (16, 0x10)
    return [(b["id"], f"b{bytes(b['addr'])[-1] - first}", b["state"])
            for b in app.client.dump()["backends"] if len(bytes(b["addr"])) == size]


def backend_names(app: LabAppliance, version: int = 4) -> dict[int, str]:
    """Data-plane backend id -> lab name, of one IP version's backends."""
    return {bid: name for bid, name, _state in _backends(app, version)}


def backend_states(app: LabAppliance, version: int = 4) -> dict[str, int]:
    return {name: state for _bid, name, state in _backends(app, version)}


def vip_id(app: LabAppliance, vip: str, proto: int) -> int:
    packed = ipaddress.ip_address(vip).packed
    return next(int(v["vip_id"]) for v in app.client.dump()["vips"]
                if bytes(v["addr"]) == packed and v["proto"] == proto)


def predicted(app: LabAppliance, client: str, vip: str, proto: int,
              sports: list[int]) -> dict[int, str]:
    """Where the model puts each flow from client: the ring slot of its flow hash
    (every backend up: the slot's own backend)."""
    key = bytes(app.client.dump()["hash_key"])
    ring = app.client.get_ring(vip_id(app, vip, proto))
    names = backend_names(app, ipaddress.ip_address(vip).version)
    return {sport: names[int(ring[flow_slot(key, client, vip, sport, LAB_PORT, proto,
                                            len(ring))])] for sport in sports}


def wait_slow_start_over(app: LabAppliance, name: str, weight: float,
                         version: int = 4) -> None:
    """Wait until backend ``name``, back up, has its whole configured ``weight`` in
    the ring again: right after it comes back its slow start gives it only the
    pool's floor share (5 %), so a check that it "takes new flows" would be a
    lottery on a hundred connections."""
    pool, backend = app.pool_name(version), app.backend_name(name, version)
    app.wait_status(lambda s: s["weights"][pool][backend] == weight, timeout_s=30.0,
                    what=f"{backend}'s slow start over (ring weight {weight})")


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s}s"
        time.sleep(0.1)
