#!/usr/bin/env python3
"""DPDK forwarder restart: how long forwarding stops after kill -9 of hpclb-dpdk,
what is lost, whether the appliance's kernel answers VIP traffic meanwhile, and
where the time goes.

A benchmark, not a test: it writes JSON and asserts nothing. Needs root (the lab).

The lab (client, appliance, two backends in network namespaces) runs `hpclb run`
with ``dataplane: dpdk`` (net_af_xdp on the appliance's veth, the lab's
LabAppliance settings: one worker napping 50 us when idle, 256 MB of hugepages).
For each restart a UDP stream (``stream`` below, in the client namespace) sends
--pps datagrams a second round robin over --flows source ports to the VIP; after
--lead seconds the forwarder is killed with SIGKILL; the stream goes on until
well after the control plane has pushed the tables again. The stream records
the wall-clock time of every datagram sent and every answer (each backend
answers with its name, straight to the client), and, on raw sockets, every ICMP
message and TCP RST whose source is the VIP.

Per restart:

* ``gap_ms``: the longest silence between two answers around the kill (last
  answered before it, first answered after it; None, with
  ``resumed_in_stream`` false, when the stream ended first, and then
  ``gap_estimate_ms`` runs to the table push instead), ``lost``: datagrams sent minus
  answered over the whole stream (the stream is lossless otherwise),
  ``flows_moved``: flows answered by more than one backend,
  ``icmp_from_vip`` / ``rst_from_vip``: what the appliance's kernel answered;
* ``timeline_ms`` (from the kill): ``exit_seen`` (the supervisor's exit
  watcher saw the process gone: the kernel's teardown of a killed forwarder),
  ``detected`` (the supervisor's "exited" line), ``spawned`` (the forwarder
  forked), ``hooks_while_starting_done`` (the hooks that overlap its
  start-up: VIP check, addresses onto the new TAP), ``main`` (its main() entered),
  ``eal_done``, ``ports_done``, ``forwarder_ready`` (the forwarder's own
  "start-up" line: EAL init, ports, tables and workers), ``hello_answered`` and
  ``hooks_done`` (the supervisor's timing line; older control planes log only
  the address hand-over, which stands in for hooks_done), ``tables_pushed``
  (the controller's "pushed tables" line, millisecond resolution) and
  ``first_answer``.

``--baseline REV`` runs the same restarts, in the same lab and alternating with
the working tree, with the restart path of git revision REV: a copy of the
control plane in use whose controller, supervisor, select, exception_path and
dpdk modules are REV's, run through PYTHONPATH (REV must have the floors layout,
7ef8e66 or later: its controller is controller/core.py); the same forwarder binary for
both, so that only the restart path differs (REV's controller must still fit
the rest of the tree).

``eal`` (skip with --eal-trials 0): the forwarder's own start-up, alone in a scratch
namespace on a veth pair, --eal-trials times per EAL argument variant (as the
control plane renders them, and without ``-m`` preallocation), and one run with
the EAL's debug log timestamped line by line to split its init into plugin
loading (Debian's shared DPDK loads every PMD of its driver directory),
hugepage allocation, TSC calibration and device probing.

Usage: .venv/bin/python perf/dpdk_restart.py --kills 5 --baseline HEAD \\
           --out results/dpdk_restart.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import platform
import re
import selectors
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
try:  # the installed (editable) control plane, or the one PYTHONPATH names
    import hpclb
except ImportError:
    sys.path.insert(0, str(REPO / "control"))
    import hpclb
CONTROL = Path(hpclb.__file__).resolve().parents[1]

LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\S+) (\w+) (.*)$")
STARTUP_LINE = re.compile(
    r"start-up: main at (?P<main>[\d.]+), EAL init (?P<eal>[\d.]+) ms, ports "
    r"(?P<ports>[\d.]+) ms, tables and workers (?P<tables>[\d.]+) ms, ready after "
    r"(?P<total>[\d.]+) ms")
TIMING_LINE = re.compile(r"\[exited=(?P<exited>[\d.]+) detected=(?P<detected>[\d.]+) "
                         r"spawned=(?P<spawned>[\d.]+) (?:starting_done=(?P<starting_done>"
                         r"[\d.]+) )?ready=(?P<ready>[\d.]+) hooks_done=(?P<hooks_done>[\d.]+)\]")


# --------------------------------------------------------------------------- stream


def _raw_socket(proto: int) -> socket.socket | None:
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_RAW, proto)
    except OSError:
        return None
    s.setblocking(False)
    return s


def run_stream(vip: str, port: int, sports: range, pps: float, duration: float,
               linger: float) -> dict[str, Any]:
    """In the client namespace: datagrams at ``pps`` round robin over ``sports``
    for ``duration`` s; every send and answer timestamped (wall clock), and the
    ICMP messages and TCP RSTs from the VIP seen on raw sockets."""
    sel = selectors.DefaultSelector()
    socks: list[socket.socket] = []
    for sport in sports:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        s.bind(("0.0.0.0", sport))
        s.connect((vip, port))
        s.setblocking(False)
        socks.append(s)
        sel.register(s, selectors.EVENT_READ, ("udp", sport))
    icmp = _raw_socket(socket.IPPROTO_ICMP)
    tcp = _raw_socket(socket.IPPROTO_TCP)
    if icmp is not None:
        sel.register(icmp, selectors.EVENT_READ, ("icmp", 0))
    if tcp is not None:
        sel.register(tcp, selectors.EVENT_READ, ("tcp", 0))
    vip_packed = socket.inet_aton(vip)
    sent: list[float] = []
    answers: list[tuple[float, int, str]] = []
    icmps: list[tuple[float, int, int]] = []
    rsts: list[tuple[float, int]] = []
    errors: Counter[str] = Counter()

    def receive(wait: float) -> None:
        for key, _ in sel.select(wait):
            kind, sport = key.data
            sock: socket.socket = key.fileobj  # type: ignore[assignment]
            for _ in range(64):
                try:
                    data = sock.recv(2048)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as exc:
                    errors[type(exc).__name__] += 1
                    break
                now = time.time()
                if kind == "udp":
                    answers.append((now, sport, data.decode(errors="replace").strip()))
                    continue
                ihl = (data[0] & 0x0F) * 4
                if len(data) < ihl + 14 or data[12:16] != vip_packed:
                    continue
                if kind == "icmp":
                    icmps.append((now, data[ihl], data[ihl + 1]))
                elif data[ihl + 13] & 0x04:  # TCP RST
                    rsts.append((now, struct.unpack("!H", data[ihl:ihl + 2])[0]))

    start = time.monotonic()
    order = list(socks)
    try:
        while (now := time.monotonic()) - start < duration:
            due = int((now - start) * pps) + 1
            while len(sent) < due:
                try:
                    order[len(sent) % len(order)].send(b"who\n")
                except OSError as exc:
                    errors[type(exc).__name__] += 1
                sent.append(time.time())
            receive(min(0.001, 1 / pps))
        end = time.monotonic() + linger
        while len(answers) < len(sent) and (left := end - time.monotonic()) > 0:
            receive(min(left, 0.05))
    finally:
        for s in socks:
            s.close()
    return {"sent": sent, "answers": answers, "icmp_from_vip": icmps, "rst_from_vip": rsts,
            "raw_sockets": icmp is not None and tcp is not None, "errors": dict(errors)}


# --------------------------------------------------------------------------- analysis


def log_time(stamp: str) -> float:
    """Wall-clock seconds of a `hpclb run` log line's asctime (local time, ms)."""
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def log_excerpt(text: str, start: float, end: float, limit: int = 30) -> list[str]:
    """The log lines stamped in [start, end] (wall clock, s)."""
    out = []
    for line in text.splitlines():
        m = LOG_LINE.match(line)
        if m and start - 0.001 <= log_time(m.group(1)) <= end + 0.001:
            out.append(line[:300])
    return out[:limit]


def controller_events(text: str, after: float) -> dict[str, float]:
    """The first restart events logged after ``after`` (wall clock, s)."""
    found: dict[str, float] = {}
    wanted = (("detected", "exited (status"), ("spawned", "started "),
              ("handed_over", "exception path:"), ("timing", "replaces pid"),
              ("tables_pushed", "pushed tables"))
    for line in text.splitlines():
        m = LOG_LINE.match(line)
        if not m:
            continue
        t = log_time(m.group(1))
        if t < after - 0.001:
            continue
        msg = m.group(4)
        for key, needle in wanted:
            if key not in found and needle in msg:
                found[key] = t
                if key == "timing" and (tm := TIMING_LINE.search(msg)):
                    for k, v in tm.groupdict().items():
                        if v is not None:
                            found[f"precise_{k}"] = float(v)
    return found


def forwarder_startups(text: str) -> list[dict[str, float]]:
    """Every "start-up" line of the forwarder's log."""
    return [{k: float(v) for k, v in m.groupdict().items()}
            for m in STARTUP_LINE.finditer(text)]


def analyse(stream: dict[str, Any], kill_t: float, events: dict[str, float],
            startup: dict[str, float] | None) -> dict[str, Any]:
    """One restart's figures (times in ms from the kill)."""
    recv = sorted(a[0] for a in stream["answers"])
    window = [t for t in recv if kill_t - 0.5 <= t <= kill_t + 30]
    gap_start: float | None = None
    gap_end: float | None = None
    best = 0.0
    for a, b in itertools.pairwise(window):
        if b - a > best and b > kill_t:
            best, gap_start, gap_end = b - a, a, b
    # Forwarding that had not resumed when the stream stopped sending: the
    # silence runs from the last answer to the end of the stream (and beyond).
    last_sent = stream["sent"][-1] if stream["sent"] else kill_t
    resumed = not window or last_sent - window[-1] < 0.1
    if not resumed:
        best, gap_start, gap_end = 0.0, window[-1], None
    per_flow: dict[int, set[str]] = {}
    for _, sport, name in stream["answers"]:
        per_flow.setdefault(sport, set()).add(name)

    def rel(t: float | None) -> float | None:
        return None if t is None else round((t - kill_t) * 1000, 1)

    timeline: dict[str, float | None] = {
        "exit_seen": rel(events.get("precise_exited")),
        "detected": rel(events.get("precise_detected", events.get("detected"))),
        "spawned": rel(events.get("precise_spawned", events.get("spawned"))),
        "hooks_while_starting_done": rel(events.get("precise_starting_done")),
    }
    if startup is not None:
        main = startup["main"]
        timeline |= {
            "main": rel(main),
            "eal_done": rel(main + startup["eal"] / 1000),
            "ports_done": rel(main + (startup["eal"] + startup["ports"]) / 1000),
            "forwarder_ready": rel(main + startup["total"] / 1000),
        }
    timeline |= {
        "hello_answered": rel(events.get("precise_ready")),
        "hooks_done": rel(events.get("precise_hooks_done", events.get("handed_over"))),
        "tables_pushed": rel(events.get("tables_pushed")),
        "first_answer": rel(gap_end),
    }
    sent = len(stream["sent"])
    pushed = events.get("tables_pushed")
    return {
        "gap_ms": None if gap_end is None else round(best * 1000, 1),
        "resumed_in_stream": resumed,
        # Where the stream ended first: the gap up to the push (+ about 1 ms).
        "gap_estimate_ms": (round(best * 1000, 1) if gap_end is not None else
                            None if pushed is None or gap_start is None else
                            round((pushed - gap_start) * 1000, 1)),
        "last_answered_before_ms": rel(gap_start),
        "first_answered_after_ms": rel(gap_end),
        "sent": sent,
        "answered": len(stream["answers"]),
        "lost": sent - len(stream["answers"]),
        "flows_moved": sum(1 for names in per_flow.values() if len(names) > 1),
        "icmp_from_vip": len(stream["icmp_from_vip"]),
        "rst_from_vip": len(stream["rst_from_vip"]),
        "icmp_from_vip_ms": [rel(t) for t, _, _ in stream["icmp_from_vip"]][:20],
        "timeline_ms": timeline,
        "forwarder_startup_ms": None if startup is None else {
            "eal_init": startup["eal"], "ports": startup["ports"],
            "tables_and_workers": startup["tables"], "total": startup["total"]},
    }


def summarise(restarts: list[dict[str, Any]]) -> dict[str, Any]:
    def med(values: list[float | None]) -> float | None:
        vals = [v for v in values if v is not None]
        return round(statistics.median(vals), 1) if vals else None

    keys = sorted({k for r in restarts for k in r["timeline_ms"]},
                  key=lambda k: list(restarts[0]["timeline_ms"]).index(k)
                  if k in restarts[0]["timeline_ms"] else 99)
    return {
        "restarts": len(restarts),
        "gap_ms_median": med([r["gap_ms"] for r in restarts]),
        "gap_ms_max": max((r["gap_ms"] for r in restarts if r["gap_ms"] is not None),
                          default=None),
        "not_resumed_in_stream": sum(not r["resumed_in_stream"] for r in restarts),
        "gap_estimate_ms_median": med([r["gap_estimate_ms"] for r in restarts]),
        "gap_estimate_ms_max": max((r["gap_estimate_ms"] for r in restarts
                                    if r["gap_estimate_ms"] is not None), default=None),
        "lost_median": med([r["lost"] for r in restarts]),
        "lost_total": sum(r["lost"] for r in restarts),
        "icmp_from_vip_total": sum(r["icmp_from_vip"] for r in restarts),
        "rst_from_vip_total": sum(r["rst_from_vip"] for r in restarts),
        "flows_moved_total": sum(r["flows_moved"] for r in restarts),
        "timeline_ms_median": {k: med([r["timeline_ms"].get(k) for r in restarts])
                               for k in keys},
    }


# --------------------------------------------------------------------------- the lab


# The restart path: what --baseline takes from the older revision.
RESTART_PATH_FILES = (
    "hpclb/controller/core.py", "hpclb/dataplane/supervisor.py", "hpclb/dataplane/select.py",
    "hpclb/dataplane/exception_path.py", "hpclb/dataplane/dpdk.py",
)


def baseline_tree(rev: str, into: Path) -> Path:
    """A copy of the control plane in use (CONTROL) under ``into`` whose
    restart-path files (RESTART_PATH_FILES) are those of git revision ``rev``:
    the rest (configuration, lab) is the same for both variants."""
    shutil.copytree(CONTROL, into / "control",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for path in RESTART_PATH_FILES:
        text = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:control/{path}"],
                              check=True, capture_output=True).stdout
        (into / "control" / path).write_bytes(text)
    return into / "control"


def restart_once(lab: Any, appliance: Any, args: argparse.Namespace,
                 first_sport: int) -> dict[str, Any]:
    from hpclb.lab.appliance import LAB_PORT, LAB_VIP

    duration = args.lead + args.tail
    stream = lab.popen("cli", [sys.executable, str(Path(__file__).resolve()), "stream",
                               "--vip", LAB_VIP, "--port", str(LAB_PORT), "--sports",
                               f"{first_sport}-{first_sport + args.flows - 1}", "--pps",
                               str(args.pps), "--duration", str(duration)],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(args.lead)
    pid = appliance.dataplane_pid()
    pushes = appliance.pushes()
    kill_t = time.time()
    os.kill(pid, signal.SIGKILL)
    appliance.wait_pushes(pushes + 1, timeout_s=60)
    out, err = stream.communicate(timeout=duration + 60)
    try:
        report: dict[str, Any] = json.loads(out)
    except json.JSONDecodeError as exc:
        raise RuntimeError(f"stream printed no JSON: {out[-500:]!r} {err[-2000:]!r}") from exc
    text = appliance.log_path.read_text()
    events = controller_events(text, kill_t)
    dplog = appliance.workdir / "run" / f"{appliance.name}.dataplane.log"
    startups = [s for s in forwarder_startups(dplog.read_text()) if s["main"] >= kill_t]
    result = analyse(report, kill_t, events, startups[0] if startups else None)
    result["log"] = log_excerpt(text, kill_t, events.get("tables_pushed", kill_t + 10))
    return result


def run_variant(lab: Any, workdir: Path, args: argparse.Namespace, control: Path | None,
                first_sport: int) -> list[dict[str, Any]]:
    from hpclb.lab.appliance import LabAppliance

    old = os.environ.get("PYTHONPATH")
    if control is not None:
        os.environ["PYTHONPATH"] = str(control)
    try:
        with LabAppliance(lab, workdir, {"b1": 1.0, "b2": 1.0}, dataplane="dpdk") as app:
            time.sleep(1.0)  # the first push's ARP and flows settle
            results = []
            for i in range(args.kills):
                results.append(restart_once(lab, app, args, first_sport + i * args.flows))
                # Past the supervisor's stable time: each kill is a "first restart
                # after a stable run", not a crash loop.
                time.sleep(args.settle)
            return results
    finally:
        if control is not None:
            if old is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = old


# --------------------------------------------------------------------------- EAL


def _scratch_netns() -> str:
    name = f"hlbr-{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    subprocess.run(["ip", "-n", name, "link", "add", "d0", "type", "veth", "peer", "name",
                    "d1"], check=True)
    for dev in ("d0", "d1"):
        subprocess.run(["ip", "-n", name, "link", "set", dev, "up"], check=True)
    return name


def _time_startup(argv: list[str], netns: str, stamp_lines: bool = False
                  ) -> tuple[float, list[tuple[float, str]]]:
    """ms from fork to the forwarder's "ready" line; with ``stamp_lines``, every
    stderr line with its ms."""
    import select

    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    lines: list[tuple[float, str]] = []
    buf = b""
    ready = None
    try:
        while ready is None and time.monotonic() - t0 < 30:
            r, _, _ = select.select([proc.stderr], [], [], 1.0)
            if not r:
                continue
            chunk = os.read(proc.stderr.fileno(), 1 << 16)
            if not chunk:
                break
            t = (time.monotonic() - t0) * 1000
            buf += chunk
            *done, buf = buf.split(b"\n")
            for raw in done:
                line = raw.decode(errors="replace")
                if stamp_lines:
                    lines.append((round(t, 1), line))
                if line.endswith("hpclb-dpdk: ready"):
                    ready = t
    finally:
        proc.kill()
        proc.wait()
        for mode in ("xdp", "xdpgeneric"):
            subprocess.run(["ip", "-n", netns, "link", "set", "dev", "d0", mode, "off"],
                           capture_output=True, check=False)
    if ready is None:
        raise RuntimeError(f"forwarder not ready: {buf[-2000:]!r}")
    return ready, lines


def eal_phases(lines: list[tuple[float, str]]) -> dict[str, float | None]:
    """Split the EAL's init from its timestamped debug log."""
    def first(pred: Any) -> float | None:
        return next((t for t, line in lines if pred(line)), None)

    def last(pred: Any) -> float | None:
        return next((t for t, line in reversed(lines) if pred(line)), None)

    marks = {
        "plugins_start": first(lambda s: "open shared lib" in s),
        "plugins_end": last(lambda s: "open shared lib" in s),
        "hugepages_start": first(lambda s: "Allocating" in s and "pages of size" in s),
        "hugepages_end": first(lambda s: "to heap on socket" in s),
        "tsc_done": first(lambda s: "TSC frequency is" in s),
        "lcores_ready": last(lambda s: "is ready (tid=" in s),
        "ready": first(lambda s: s.endswith("hpclb-dpdk: ready")),
    }

    def span(a: str, b: str) -> float | None:
        x, y = marks[a], marks[b]
        return None if x is None or y is None else round(y - x, 1)

    return {
        "marks_ms": marks,  # type: ignore[dict-item]
        "plugin_loading_ms": span("plugins_start", "plugins_end"),
        "hugepage_allocation_ms": span("hugepages_start", "hugepages_end"),
        "tsc_calibration_ms": span("hugepages_end", "tsc_done"),
        "after_eal_to_ready_ms": span("lcores_ready", "ready"),
    }


def measure_eal(trials: int, socket_mem_mb: int) -> dict[str, Any]:
    from hpclb.dataplane.dpdk import DpdkLaunch, DpdkPort, forwarder_argv, reserve_hugepages

    netns = _scratch_netns()
    tmp = Path(tempfile.mkdtemp(prefix="hlbr-"))
    try:
        reserve_hugepages(socket_mem_mb)
        launch = DpdkLaunch(
            ports=(DpdkPort(0, "af_xdp", iface="d0", tap="hlbr0"),),
            socket=f"ipc://{tmp}/dp.sock", netns=netns, flow_table_size=65536,
            idle_sleep_us=50, socket_mem_mb=socket_mem_mb, file_prefix=netns)
        rendered = forwarder_argv(launch)
        m = rendered.index("-m")
        no_prealloc = [*rendered[:m], "--socket-limit", rendered[m + 1], *rendered[m + 2:]]
        variants = {"as_rendered": rendered, "socket_limit_instead_of_m": no_prealloc}
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(trials):
            for name, argv in variants.items():
                times[name].append(round(_time_startup(argv, netns)[0], 1))
        # The EAL's own debug lines: its global level (notice) would hide them.
        lvl = rendered.index("--log-level")
        debug = [*rendered[:lvl], "--log-level", "lib.eal:debug", *rendered[lvl + 2:]]
        _, lines = _time_startup(debug, netns, stamp_lines=True)
        return {
            "argv": rendered,
            "ready_ms": {k: {"trials": v, "median": round(statistics.median(v), 1)}
                         for k, v in times.items()},
            "phases_one_debug_run": eal_phases(lines),
        }
    finally:
        subprocess.run(["ip", "netns", "del", netns], check=False)
        with contextlib.suppress(OSError):
            for f in tmp.iterdir():
                f.unlink()
            tmp.rmdir()


# --------------------------------------------------------------------------- main


def cmd_stream(args: argparse.Namespace) -> int:
    first, _, last = args.sports.partition("-")
    report = run_stream(args.vip, args.port, range(int(first), int(last or first) + 1),
                        args.pps, args.duration, args.linger)
    print(json.dumps(report))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from hpclb.dataplane.dpdk import find_dpdk_forwarder
    from hpclb.lab.appliance import LAB_PORT
    from hpclb.lab.topology import Lab, default_pass_obj

    if os.geteuid() != 0:
        print("needs root (network namespaces, hugepages, AF_XDP)", file=sys.stderr)
        return 2
    # One binary for every variant (the install manifest's, or $HPCLB_DPDK_BIN:
    # a baseline revision's control plane may look for it elsewhere).
    os.environ["HPCLB_DPDK_BIN"] = find_dpdk_forwarder()
    result: dict[str, Any] = {
        "conditions": {
            "host": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count(),
            "pps": args.pps, "flows": args.flows, "kills": args.kills, "rounds": args.rounds,
            "lead_s": args.lead, "settle_s": args.settle, "baseline": args.baseline,
            "control": None if args.control is None else str(args.control),
            "dataplane": "dpdk (net_af_xdp on the appliance veth, 1 worker, idle_sleep_us 50,"
                         " hugepages_mb 256)",
            "forwarder": os.environ["HPCLB_DPDK_BIN"],
        },
    }
    with contextlib.ExitStack() as stack:
        variants: dict[str, Path | None] = {"working_tree": args.control}
        if args.baseline:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hlbr-base-")))
            variants = {f"baseline_{args.baseline}": baseline_tree(args.baseline, tmp),
                        "working_tree": args.control}
        lab = stack.enter_context(Lab(prefix=f"r{uuid.uuid4().hex[:6]}", backends=2,
                                      peer_xdp_pass=default_pass_obj()))
        lab.start_backends(LAB_PORT, udp=True)
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hlbr-")))
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
        sport = 20000
        for rnd in range(args.rounds):
            for name, control in variants.items():
                wd = work / f"{name}-{rnd}"
                wd.mkdir()
                runs[name] += run_variant(lab, wd, args, control, sport)
                sport += args.kills * args.flows
                print(f"{name} round {rnd}: gaps "
                      f"{[r['gap_ms'] for r in runs[name][-args.kills:]]} ms", flush=True)
        result["variants"] = {name: {"summary": summarise(rs), "restarts": rs}
                              for name, rs in runs.items()}
    if args.eal_trials:
        result["eal"] = measure_eal(args.eal_trials, 256)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({name: v["summary"] for name, v in result["variants"].items()}, indent=1))
    print(f"written to {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd")
    run = sub.add_parser("run", help="the benchmark (default)")
    for parser in (p, run):
        parser.add_argument("--kills", type=int, default=5, help="restarts per variant and round")
        parser.add_argument("--rounds", type=int, default=1,
                            help="alternations of the variants")
        parser.add_argument("--pps", type=float, default=2000.0)
        parser.add_argument("--flows", type=int, default=64, help="UDP source ports")
        parser.add_argument("--lead", type=float, default=1.0,
                            help="seconds of stream before each kill")
        parser.add_argument("--tail", type=float, default=7.0,
                            help="seconds of stream after each kill")
        parser.add_argument("--settle", type=float, default=11.0,
                            help="seconds between restarts (past the stable time)")
        parser.add_argument("--baseline", default=None,
                            help="git revision whose control plane runs alternately")
        parser.add_argument("--control", type=Path, default=None,
                            help="run the working-tree variant's control plane from this "
                                 "control/ directory instead (PYTHONPATH)")
        parser.add_argument("--eal-trials", type=int, default=5,
                            help="forwarder start-ups per EAL variant (0: skip)")
        parser.add_argument("--out", type=Path, default=Path("results/dpdk_restart.json"))
    st = sub.add_parser("stream", help="(internal) the UDP stream, in the client namespace")
    st.add_argument("--vip", required=True)
    st.add_argument("--port", type=int, required=True)
    st.add_argument("--sports", required=True)
    st.add_argument("--pps", type=float, default=2000.0)
    st.add_argument("--duration", type=float, default=4.5)
    st.add_argument("--linger", type=float, default=1.0)
    args = p.parse_args(argv)
    if args.cmd == "stream":
        return cmd_stream(args)
    return cmd_run(args)


if __name__ == "__main__":
    sys.exit(main())
