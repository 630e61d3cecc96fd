"""Probe scale: N endpoints on loopback at a fixed interval, the prober on one core.

A benchmark, not a test (docs/ARCHITECTURE.md, Test strategy): it writes JSON and
asserts nothing. Run by ``hpclb bench control`` (:mod:`hpclb.lab.control_bench`) and
alone by perf/probe_scale.py (this module's :func:`main`). For each
kind (icmp, tcp) a fresh worker process pinned to one CPU runs a HealthChecker
over N loopback addresses (127.1.0.1, 127.1.0.2, ...: every 127/8 address answers
ICMP; for TCP one listener on 0.0.0.0, in its own process on another CPU when
there is one, accepts for all of them). After a warm-up it measures, over
--duration seconds:

* CPU seconds (user + system, getrusage) per wall second of the worker: the
  prober's cost, with the kernel work its system calls do (on loopback the kernel
  answers an echo or a SYN inside the sender's system call), but not the part of
  packet processing the kernel accounts as softirq time;
* the pinned core's own counters (/proc/stat): busy (softirq included), softirq,
  steal (a VM's host taking the core) and idle seconds per second, which also
  count anything else that ran on the core;
* garbage-collector runs and their longest pause, per generation;
* probes completed per second, failed probes (by reason), slots skipped;
* jitter: send lag (launch time - scheduled time) and interval deviation
  (|time between consecutive launches of one target - interval|), p50/p99/max.

Usage: .venv/bin/python perf/probe_scale.py --duration 30 --out results/probe_scale.json
(or ``python -m hpclb.lab.control_probes`` with the same arguments)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hpclb.config.probes import ProbeConfig
from hpclb.health import HealthChecker, ProbeOutcome

KINDS = ("icmp", "tcp")
MODULE = "hpclb.lab.control_probes"  # the worker and the listener run as python -m MODULE


@dataclass
class ProbeOptions:
    """What one probe-scale measurement runs (perf/probe_scale.py's arguments)."""

    endpoints: int = 10_000
    interval: float = 1.0
    duration: float = 30.0  # measured seconds per kind
    warmup: float = 3.0
    kinds: list[str] = field(default_factory=lambda: list(KINDS))
    cpu: int = 0  # the CPU the prober is pinned to
    gc_freeze: bool = False

    def check(self) -> None:
        """Raise ValueError naming the first option out of range."""
        bad = [k for k in self.kinds if k not in KINDS]
        if bad or not self.kinds:
            raise ValueError(f"kinds: {bad or self.kinds} not among {', '.join(KINDS)}")
        if self.endpoints < 1 or self.endpoints > 16_000_000:
            raise ValueError("endpoints must be between 1 and 16,000,000")
        if self.duration <= 0 or self.warmup < 0:
            raise ValueError("duration must be > 0 and warmup >= 0")
        try:
            ProbeConfig(interval_s=self.interval)
        except ValueError as exc:
            raise ValueError(f"interval: {exc}") from None


def addresses(n: int) -> list[str]:
    """n loopback addresses from 127.1.0.1, skipping .0 and .255 last octets."""
    out: list[str] = []
    i = 0
    while len(out) < n:
        i += 1
        b2, b3, b4 = (i >> 16) & 0xFF, (i >> 8) & 0xFF, i & 0xFF
        if b4 in (0, 255):
            continue
        out.append(f"127.{1 + b2}.{b3}.{b4}")
    return out


def pin(cpu: int) -> int | None:
    """Pin this process to ``cpu`` if it may run there; the CPU it got, or None."""
    allowed = os.sched_getaffinity(0)
    if cpu not in allowed:
        cpu = min(allowed)
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError:
        return None
    return cpu


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    a = np.asarray(values) * 1e3
    return {"p50": round(float(np.percentile(a, 50)), 3),
            "p99": round(float(np.percentile(a, 99)), 3),
            "max": round(float(a.max()), 3)}


# --- the worker: one kind, one core --------------------------------------------------


def core_ticks(cpu: int | None) -> dict[str, int] | None:
    """The kernel's per-CPU time counters (/proc/stat, in clock ticks) for ``cpu``.

    Loopback packet processing partly runs in softirq context, which the kernel
    accounts to the CPU rather than to our process (getrusage misses it): the
    core's counters show it, along with anything else that ran on the core.
    """
    if cpu is None:
        return None
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    try:
        with open("/proc/stat") as f:
            for line in f:
                fields = line.split()
                if fields[0] == f"cpu{cpu}":
                    return dict(zip(names, map(int, fields[1:9]), strict=True))
    except (OSError, ValueError):
        pass
    return None


def core_report(before: dict[str, int] | None, after: dict[str, int] | None,
                wall: float) -> dict[str, float] | None:
    if before is None or after is None:
        return None
    hz = os.sysconf("SC_CLK_TCK")

    def rate(*keys: str) -> float:
        return round(sum(after[k] - before[k] for k in keys) / hz / wall, 4)

    return {"busy_s_per_s": rate("user", "nice", "system", "irq", "softirq"),
            "softirq_s_per_s": rate("irq", "softirq"),
            "steal_s_per_s": rate("steal"),
            "idle_s_per_s": rate("idle", "iowait")}


class GcWatch:
    """Collections and their pauses per generation while active (a full collection
    over 10,000 targets' state is the one stall the prober itself can cause)."""

    def __init__(self) -> None:
        self.active = False
        self.count = [0, 0, 0]
        self.max_ms = [0.0, 0.0, 0.0]
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self.active:
            gen = info["generation"]
            self.count[gen] += 1
            self.max_ms[gen] = max(self.max_ms[gen], (time.perf_counter() - self._start) * 1e3)

    def report(self) -> dict[str, Any]:
        return {f"gen{g}": {"collections": self.count[g], "max_pause_ms": round(self.max_ms[g], 3)}
                for g in range(3)}


class Recorder:
    """Collects the timing of every outcome inside the measurement window."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.window: tuple[float, float] | None = None
        self.last_start: dict[str, float] = {}
        self.lag: list[float] = []
        self.dev: list[float] = []
        self.reasons: Counter[str] = Counter()
        self.done = 0
        self.ok = 0

    def __call__(self, o: ProbeOutcome) -> None:
        prev = self.last_start.get(o.name)
        if prev != o.started:
            self.last_start[o.name] = o.started
        if self.window is None or not self.window[0] <= o.finished < self.window[1]:
            return
        self.done += 1
        if o.result.ok:
            self.ok += 1
        else:
            self.reasons[o.result.reason] += 1
        self.lag.append(o.started - o.scheduled)
        if prev is not None and prev != o.started:
            self.dev.append(abs(o.started - prev - self.interval))


async def measure(kind: str, n: int, interval: float, duration: float, warmup: float,
                  port: int | None, gc_freeze: bool = False,
                  cpu: int | None = None) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    rec = Recorder(interval)
    watch = GcWatch()
    gc.callbacks.append(watch)
    config = ProbeConfig(kind=kind, interval_s=interval, port=port)
    checker = HealthChecker(on_transition=lambda t: None, on_result=rec)
    setup_start = time.monotonic()
    for i, addr in enumerate(addresses(n)):
        checker.add(f"b{i}", addr, config)
    setup_s = time.monotonic() - setup_start
    await asyncio.sleep(warmup)
    if gc_freeze:
        # What a long-running controller may do once its configuration is loaded:
        # move everything alive now out of the collector's sight.
        gc.collect()
        gc.freeze()
    stats0 = checker.stats()
    watch.active = True
    core0 = core_ticks(cpu)
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = loop.time()
    rec.window = (t0, t0 + duration)
    await asyncio.sleep(duration)
    t1 = loop.time()
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    core1 = core_ticks(cpu)
    stats1 = checker.stats()
    watch.active = False
    gc.callbacks.remove(watch)
    up = sum(checker.is_up(name) for name in checker.names())
    checker.close()
    wall = t1 - t0
    user = ru1.ru_utime - ru0.ru_utime
    system = ru1.ru_stime - ru0.ru_stime
    return {
        "kind": kind,
        "endpoints": n,
        "interval_s": interval,
        "timeout_s": config.timeout,
        "duration_s": round(wall, 3),
        "warmup_s": warmup,
        "setup_s": round(setup_s, 3),
        "cpu_s_per_s": round((user + system) / wall, 4),
        "cpu_user_s_per_s": round(user / wall, 4),
        "cpu_sys_s_per_s": round(system / wall, 4),
        # The whole pinned core: our process, the softirq work of its packets, and
        # whatever else ran there (an upper bound when the machine is shared).
        "core": core_report(core0, core1, wall),
        "probes_expected_per_s": round(n / interval, 1),
        "probes_per_s": round(rec.done / wall, 1),
        "probes_completed": rec.done,
        "probes_ok": rec.ok,
        "probes_failed": rec.done - rec.ok,
        "failure_reasons": dict(rec.reasons.most_common()),
        "missed_slots": stats1["missed_slots"] - stats0["missed_slots"],
        "backends_up_at_end": up,
        "send_lag_ms": percentiles(rec.lag),
        "interval_deviation_ms": percentiles(rec.dev),
        "gc_freeze": gc_freeze,
        "gc": watch.report(),
        "checker_stats": stats1,
    }


def _leave_sigint_to_parent() -> None:
    """Ctrl-C reaches the worker and the listener too (same process group): the
    parent ends them, without a traceback of theirs on the terminal."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def worker(args: argparse.Namespace) -> None:
    _leave_sigint_to_parent()
    cpu = pin(args.cpu)
    try:
        result = asyncio.run(measure(args.worker, args.endpoints, args.interval,
                                     args.duration, args.warmup, args.port, args.gc_freeze,
                                     cpu))
    except Exception as exc:  # reported in the JSON, not as a traceback
        result = {"kind": args.worker, "error": f"{type(exc).__name__}: {exc}"}
    result["cpu"] = cpu
    print(json.dumps(result), flush=True)


# --- the TCP listener ----------------------------------------------------------------


def listener(args: argparse.Namespace) -> None:
    _leave_sigint_to_parent()
    pin(args.cpu)
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # 0.0.0.0 reaches every 127/8 address with one socket.
    srv.bind(("0.0.0.0", 0))
    srv.listen(65535)
    print(srv.getsockname()[1], flush=True)
    while True:
        try:
            conn, _ = srv.accept()
        except OSError:
            continue
        conn.close()


# --- the driver ----------------------------------------------------------------------


def run_kind(kind: str, args: ProbeOptions) -> dict[str, Any]:
    listener_proc: subprocess.Popen[str] | None = None
    other_cpu = next((c for c in sorted(os.sched_getaffinity(0)) if c != args.cpu), args.cpu)
    cmd = [sys.executable, "-m", MODULE, "--worker", kind, "--endpoints", str(args.endpoints),
           "--interval", str(args.interval), "--duration", str(args.duration),
           "--warmup", str(args.warmup), "--cpu", str(args.cpu)]
    if args.gc_freeze:
        cmd.append("--gc-freeze")
    try:
        if kind == "tcp":
            listener_proc = subprocess.Popen(
                [sys.executable, "-m", MODULE, "--listener", "--cpu", str(other_cpu)],
                stdout=subprocess.PIPE, text=True)
            assert listener_proc.stdout is not None
            cmd += ["--port", listener_proc.stdout.readline().strip()]
        limit = args.warmup + args.duration + 120 + args.endpoints / 1000
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
    finally:
        if listener_proc is not None:
            listener_proc.kill()
            listener_proc.wait()
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"kind": kind, "error": f"worker exited {proc.returncode}: {proc.stderr[-2000:]}"}
    result: dict[str, Any] = json.loads(lines[-1])
    if kind == "tcp":
        result["listener_cpu"] = other_cpu
    return result


def summary(results: list[dict[str, Any]]) -> str:
    parts = []
    for r in results:
        if "error" in r:
            parts.append(f"{r['kind']}: ERROR {r['error'][:80]}")
            continue
        parts.append(
            f"{r['kind']}: {r['endpoints']} endpoints @{r['interval_s']}s "
            f"{r['probes_per_s']:.0f} probes/s, {r['cpu_s_per_s']:.2f} CPU s/s, "
            f"failed {r['probes_failed']}, lag p50/p99 {r['send_lag_ms']['p50']}/"
            f"{r['send_lag_ms']['p99']} ms, interval dev p50/p99 "
            f"{r['interval_deviation_ms']['p50']}/{r['interval_deviation_ms']['p99']} ms")
    return "probe_scale: " + " | ".join(parts)


def measure_all(opts: ProbeOptions, on_kind: Callable[[], None] | None = None
                ) -> dict[str, Any]:
    """Every kind of ``opts`` in turn; the JSON document (a kind that failed carries
    "error"). ``on_kind`` is called after each kind (a progress bar's tick)."""
    from hpclb.lab.control_bench import host_conditions

    opts.check()
    load_before = [round(x, 2) for x in os.getloadavg()]
    results = []
    for kind in opts.kinds:
        results.append(run_kind(kind, opts))
        if on_kind is not None:
            on_kind()
    return {
        "benchmark": "probe_scale",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": {**host_conditions(), "euid": os.geteuid()},
        "conditions": {"endpoints": opts.endpoints, "interval_s": opts.interval,
                       "duration_s": opts.duration, "warmup_s": opts.warmup,
                       "prober_cpu": opts.cpu, "gc_freeze": opts.gc_freeze,
                       # Other work on the machine shows in the jitter tail.
                       "load_average_before": load_before,
                       "load_average_after": [round(x, 2) for x in os.getloadavg()]},
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="probe_scale", description=__doc__.split("\n\n")[0])
    d = ProbeOptions()
    p.add_argument("--endpoints", type=int, default=d.endpoints)
    p.add_argument("--interval", type=float, default=d.interval)
    p.add_argument("--duration", type=float, default=d.duration,
                   help="measured seconds per kind")
    p.add_argument("--warmup", type=float, default=d.warmup, help="seconds before measuring")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated: icmp,tcp")
    p.add_argument("--cpu", type=int, default=d.cpu, help="the CPU the prober is pinned to")
    p.add_argument("--gc-freeze", action="store_true",
                   help="gc.freeze() after the warm-up (default: the collector as it is)")
    p.add_argument("--out", type=Path, default=Path("results/probe_scale.json"))
    p.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    p.add_argument("--listener", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.listener:
        listener(args)
        return 0
    opts = ProbeOptions(endpoints=args.endpoints, interval=args.interval,
                        duration=args.duration, warmup=args.warmup,
                        kinds=[k.strip() for k in args.kinds.split(",") if k.strip()],
                        cpu=args.cpu, gc_freeze=args.gc_freeze)
    try:
        opts.check()
    except ValueError as exc:
        p.error(str(exc))
    doc = measure_all(opts)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(summary(doc["results"]))
    return 1 if any("error" in r for r in doc["results"]) else 0


if __name__ == "__main__":
    sys.exit(main())
