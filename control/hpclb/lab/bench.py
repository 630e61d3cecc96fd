"""`hpclb bench`: forwarding rate of both data planes in the lab, against the
testbed's ceiling and the peers a user would pick instead.

One run, one lab, one generator; every subject (``hpclb.lab.subjects``: the
``reflect`` ceiling, ``xdp``, ``dpdk`` and their ``_ipv6`` and ``_tunnel`` rows;
``hpclb.lab.peers``: nftables DNAT, HAProxy) set up in turn, trials interleaved
round by round so that a drift of the host spreads over all of them. Each round,
each subject gets a trial at the generator's top rate; in the first round it also
gets a no-drop / partial-drop rate search (``hpclb.lab.ndr.search_rates``, RFC 2544
style, whose first trial is that line-rate one) and, for the data planes, the
per-packet cost rows (``hpclb.lab.xdp_cost``, ``hpclb.lab.dpdk_cost``, and the
in-run figures below). The generator is trafgen (``hpclb.lab.subjects``, decoupled
from the path by threaded NAPI unless ``coupled``) or TRex (``hpclb.lab.trex``).
Modules written beside this one (peers, TRex, the cost functions) are imported
when used; one that is not there has its rows reported with the reason.

Output (``hpclb.lab.bench_report``): ``<out>`` JSON with every trial and the
conditions, PNG plots, ``<out>.md``. Ctrl-C (or SIGTERM) stops the run: the
subject under way is stopped, the lab torn down, and what was measured written
with ``"interrupted": true``. This is a measurement, never a test assertion.

The dict-based trafgen trial (``run_generator``, ``settled_trial``,
``ndr_search``) stays here for ``hpclb bench --mode nat`` and perf/packet_cost.py.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from hpclb.host import install
from hpclb.lab import dpdk_telemetry
from hpclb.lab.appliance import LAB_PORT, LAB_VIP, LAB_VIP6, LabAppliance
from hpclb.lab.bench_report import BenchRecord, TrialProgress, host_conditions, write_all
from hpclb.lab.bpf_testrun import PinnedXdpProgram
from hpclb.lab.ndr import Trial, search_rates
from hpclb.lab.subjects import (
    TUNNEL_ROW,
    ApplianceSubject,
    Generator,
    ReflectSubject,
    Subject,
    SubjectUnavailable,
    TrafgenGenerator,
    appliance_subjects,
    write_trafgen_config,
    xdp_counters,
    xdp_packets,
)
from hpclb.lab.topology import Lab

__all__ = [
    "ALL_SUBJECTS", "TUNNEL_ROW", "dpdk_worker_cost", "ndr_search", "run_bench",
    "run_generator", "settled_trial", "udp_frame", "write_trafgen_config", "xdp_counters",
    "xdp_packets",
]

def run_generator(lab: Lab, cfg: Path, seconds: float, rate_pps: float | None,
                  offered: Callable[[], int], forwarded: Callable[[], int],
                  settle_s: float = 0.0) -> dict[str, float]:
    """Run trafgen in the client namespace for ``seconds`` (at ``rate_pps``, or
    as fast as it goes), counting with ``offered`` and ``forwarded`` (read
    before, and ``settle_s`` after); the trial's frame counts, its rates and the
    frames lost."""
    start_in, start_out = offered(), forwarded()
    argv = ["timeout", "-s", "INT", str(seconds), "trafgen", "--dev", "eth0",
            "--conf", str(cfg), "--cpus", "1", "--no-sock-mem"]
    if rate_pps is not None:
        argv += ["--rate", f"{max(int(rate_pps), 1)}pps"]
    t0 = time.monotonic()
    lab.exec("cli", argv, check=False, timeout=seconds + 30)
    elapsed = time.monotonic() - t0
    time.sleep(settle_s)
    got_in = offered() - start_in
    got_out = forwarded() - start_out
    return {
        "seconds": round(elapsed, 3),
        "offered_frames": got_in,
        "forwarded_frames": got_out,
        "rate_asked_pps": rate_pps or 0.0,
        "offered_pps": got_in / elapsed,
        "forwarded_pps": got_out / elapsed,
        "lost": float(max(got_in - got_out, 0)),
        "loss_ratio": (got_in - got_out) / got_in if got_in else 0.0,
    }


def _trial(lab: Lab, cfg: Path, seconds: float, rate_pps: float | None = None,
           settle_s: float = 0.0) -> dict[str, float]:
    """Run the generator for ``seconds`` (at ``rate_pps``, or as fast as it
    goes); offered at the appliance's eth0, forwarded at its peer's sink."""
    peer = lab.peer("lb")
    return run_generator(lab, cfg, seconds, rate_pps,
                         offered=lambda: xdp_packets(lab, "lb", "eth0"),
                         forwarded=lambda: xdp_packets(lab, "br", peer), settle_s=settle_s)


def udp_frame(lab: Lab, sport: int, vip: str = LAB_VIP) -> bytes:
    """One of the generator's frames (IPv4, or IPv6 for an IPv6 ``vip``)."""
    from scapy.layers.inet import IP, UDP
    from scapy.layers.inet6 import IPv6
    from scapy.layers.l2 import Ether

    eth = Ether(src=lab.mac("cli"), dst=lab.mac("lb"))
    if ":" in vip:
        return bytes(eth / IPv6(src=lab.ip6_of("cli"), dst=vip)
                     / UDP(sport=sport, dport=LAB_PORT) / bytes(2))
    return bytes(eth / IP(src=lab.ip_of("cli"), dst=vip) / UDP(sport=sport, dport=LAB_PORT)
                 / bytes(18))


def _program_cost_ns(pin: str, frame: bytes, repeat: int = 1_000_000) -> float:
    """Mean ns per run of a pinned XDP program on one frame (BPF_PROG_TEST_RUN).

    The program's own cost, free of the generator and the veth path: the
    median of five kernel-timed runs of ``repeat`` iterations each.
    """
    prog = PinnedXdpProgram(pin)
    try:
        return statistics.median(prog.run_repeated(frame, repeat)[2] for _ in range(5))
    finally:
        prog.close()


def _program_cost_single_ns(pin: str, frame: bytes, runs: int = 20000) -> dict[str, Any]:
    """Mean ns of ``runs`` single kernel-timed runs (BPF_PROG_TEST_RUN, repeat 1)
    and the actions they ended with. For a program that moves the frame's start
    (tunnel mode's bpf_xdp_adjust_head): a repeated test run does not restore the
    frame between iterations, so from the second one on it would time the
    already encapsulated frame, which is no VIP's (passed). A single run's time
    includes the timer's own cost (tens of ns)."""
    prog = PinnedXdpProgram(pin)
    try:
        actions: dict[str, int] = {}
        total = 0
        for _ in range(runs):
            action, _, ns = prog.run_repeated(frame, 1)
            actions[action] = actions.get(action, 0) + 1
            total += ns
        return {"ns_per_frame": total / runs, "runs": runs, "actions": actions}
    finally:
        prog.close()


def _reflect_cost_ns(frame: bytes) -> float:
    pin = f"/sys/fs/bpf/hpclb-bench-reflect-{uuid.uuid4().hex[:8]}"
    obj = install.find("reflect.bpf.o")
    subprocess.run(["bpftool", "prog", "load", str(obj), pin, "type", "xdp"],
                   check=True, capture_output=True)
    try:
        return _program_cost_ns(pin, frame)
    finally:
        Path(pin).unlink(missing_ok=True)


def settled_trial(lab: Lab, cfg: Path, seconds: float, rate_pps: float | None) -> dict[str, float]:
    """A trial whose counters are read once frames in flight (AF_XDP rings,
    queues) have landed, so that what was offered and never arrived is loss."""
    return _trial(lab, cfg, seconds, rate_pps=rate_pps, settle_s=0.5)


def ndr_search(trial: Callable[[float | None], dict[str, float]],
               steps: int) -> dict[str, Any]:
    """Highest rate with no frame lost: full speed first (``trial(None)``), then
    a binary search between 0 and the rate that lost frames (``trial(rate)``)."""
    full = trial(None)
    tried = [full]
    if full["lost"] == 0:
        return {"ndr_pps": full["forwarded_pps"], "search": tried}
    lo, hi, best = 0.0, full["offered_pps"], 0.0
    for _ in range(steps):
        mid = (lo + hi) / 2
        t = trial(mid)
        tried.append(t)
        if t["lost"] == 0:
            lo, best = mid, max(best, t["forwarded_pps"])
        else:
            hi = mid
    return {"ndr_pps": best, "search": tried}


def _row_cost(cost: dict[str, Any], kind: str, appliance: LabAppliance, lab: Lab, vip: str,
              frame: bytes) -> None:
    """A row's per-frame cost: lb_xdp's own (BPF_PROG_TEST_RUN) on the row's frame,
    or the DPDK worker's cycles."""
    if appliance.dataplane == "xdp":
        pin = f"/sys/fs/bpf/hpclb/{appliance.name}/lb_xdp"
        if kind == "xdp":
            cost["lb_xdp_ns_per_frame_flow_hit"] = _program_cost_ns(pin, frame)
            cost["reflect_ns_per_frame"] = _reflect_cost_ns(frame)
            # The tunnel row's way too, so that the two compare.
            cost["lb_xdp_flow_hit_single_runs"] = _program_cost_single_ns(pin, frame)
        elif kind.endswith("_tunnel"):
            cost["lb_xdp_flow_hit_tunnel_single_runs"] = _program_cost_single_ns(
                pin, udp_frame(lab, 40000, vip))
        else:
            cost[f"lb_xdp_ns_per_frame_flow_hit_{kind.split('_', 1)[1]}"] = _program_cost_ns(
                pin, udp_frame(lab, 40000, vip))
    else:
        cost["dpdk_worker" if kind == "dpdk" else f"{kind}_worker"] = dpdk_worker_cost(appliance)


def dpdk_worker_cost(appliance: LabAppliance) -> dict[str, float]:
    """Cycles per frame and busy share of the forwarder's worker, from its
    telemetry socket (what dpdk-telemetry.py reads)."""
    stats = dpdk_telemetry.query(appliance.dpdk_file_prefix, "/hpclb/stats")
    workers = dpdk_telemetry.query(appliance.dpdk_file_prefix, "/hpclb/workers")
    w = workers["worker0"]
    frames = max(int(w["frames"]), 1)
    return {
        "cycles_per_frame": int(w["busy_cycles"]) / frames,
        "ns_per_frame": int(w["busy_cycles"]) / frames / int(stats["tsc_hz"]) * 1e9,
        "busy_share": int(w["busy_cycles"]) / max(int(w["total_cycles"]), 1),
        "frames_per_busy_loop": frames / max(int(w["busy_loops"]), 1),
        "frames": frames,
    }




# ---------------------------------------------------------------- the runner

# Every subject by row name, in the order a round runs them.
APPLIANCE_ROWS = ("xdp", "dpdk", "xdp_ipv6", "xdp_tunnel", "dpdk_ipv6", "dpdk_tunnel")
NFTABLES = "nftables_dnat"
ALL_SUBJECTS = ("reflect", *APPLIANCE_ROWS, NFTABLES, "haproxy_tcp", "ipvs")
XDP_COST_REPEAT = 1_000_000


def lazy(module: str, attr: str) -> tuple[Any, str | None]:
    """``module.attr``, or None and why not (the module is written beside this
    one and may not be there yet)."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name and module.startswith(err.name):
            return None, f"{module} is not in this tree"
        raise
    found = getattr(mod, attr, None)
    return (found, None) if found is not None else (None, f"{module} has no {attr}")


def call_with(fn: Callable[..., Any], /, *args: Any, **available: Any) -> Any:
    """``fn(*args, **those of available it takes)``: the runner offers what it
    has (lab, workdir, flows...) to functions and classes written beside it."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(*args, **available)
    return fn(*args, **{k: v for k, v in available.items() if k in params})


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM ends the run as Ctrl-C does: stop, tear down, write what was measured."""
    def raise_interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, raise_interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def make_generator(kind: str, lab: Lab, workdir: Path, flows: int, *, coupled: bool,
                   trex_server: str | None, trex_dir: Path | None,
                   latency: bool) -> Generator:
    if kind == "trafgen":
        return TrafgenGenerator(lab, workdir, flows, decoupled=not coupled,
                                vips=(LAB_VIP, LAB_VIP6))
    if kind == "trex":
        cls, why = lazy("hpclb.lab.trex", "TrexGenerator")
        if cls is None:
            raise SubjectUnavailable(f"TRex generator: {why}")
        try:
            gen: Generator = call_with(cls, lab, workdir, flows=flows, server=trex_server,
                                       trex_dir=trex_dir, latency=latency,
                                       decoupled=not coupled)
        except (OSError, RuntimeError, ValueError) as err:
            raise SubjectUnavailable(f"TRex generator: {err}") from err
        return gen
    raise ValueError(f"generator must be trafgen or trex, got {kind!r}")


def make_subjects(lab: Lab, workdir: Path, wanted: tuple[str, ...],
                  not_run: dict[str, str]) -> list[Subject]:
    """The packet-rate subjects asked for (the reflector always: every ratio is to
    it); a peer whose module is not there goes to ``not_run`` with the reason."""
    subjects: list[Subject] = [ReflectSubject(lab)]
    for row in appliance_subjects(lab, workdir, LAB_VIP6):
        if row.name in wanted:
            subjects.append(row)
    if NFTABLES in wanted:
        cls, why = lazy("hpclb.lab.peers", "NftablesDnat")
        if cls is None:
            not_run[NFTABLES] = why or "unknown"
        else:
            subjects.append(cls(lab, "random", name=NFTABLES))
    if "ipvs" in wanted:
        # Only detected: where the kernel lacks ip_vs (this lab's), its start()
        # reports the evidence and the row says why it was not run.
        cls, why = lazy("hpclb.lab.peers", "Ipvs")
        if cls is None:
            not_run["ipvs"] = why or "unknown"
        else:
            subjects.append(cls(lab))
    return subjects


def connection_rates(lab: Lab, workdir: Path, wanted: tuple[str, ...], seconds: float,
                     record: BenchRecord) -> None:
    """New TCP connections per second through hpclb (DSR), nftables DNAT (with
    masquerade: one-arm, the backends must answer through it) and HAProxy, beside
    the client connecting to the backends directly (``hpclb.lab.peers``). The
    sink gives way to XDP_PASS on the appliance's peer: the backends must get the
    frames."""
    fn, why = lazy("hpclb.lab.peers", "compare_connection_rates")
    if fn is None:
        record.connections["skipped"] = why
        return
    peers = importlib.import_module("hpclb.lab.peers")
    subjects: list[Any] = [row for row in appliance_subjects(lab, workdir / "cps", LAB_VIP6)
                           if row.name in ("xdp", "dpdk") and row.name in wanted]
    if NFTABLES in wanted:
        subjects.append(peers.NftablesDnat(lab, "random", masquerade=True,
                                           name=f"{NFTABLES}_masq"))
    if "haproxy_tcp" in wanted:
        subjects.append(peers.HaproxyTcp(lab, start_backends=False))
    _replace_peer_program(lab, "pass.bpf.o")
    try:
        lab.start_backends(LAB_PORT)
        record.connections.update(fn(lab, seconds, subjects))
    except Exception as err:  # a failed phase is reported; the rest is kept
        record.connections["error"] = f"{type(err).__name__}: {err}"
    finally:
        for i in range(1, lab.backends + 1):
            with contextlib.suppress(Exception):
                lab.stop_backend(i, LAB_PORT)
        _replace_peer_program(lab, "sink.bpf.o")


def _replace_peer_program(lab: Lab, obj: str) -> None:
    """Swap the XDP program on the appliance's veth peer (the sink, XDP_PASS)."""
    subprocess.run(["ip", "-n", lab.bridge_ns, "link", "set", "dev", lab.peer("lb"), "xdp",
                    "off"], capture_output=True, check=False, timeout=30)
    lab.attach_xdp_pass(lab.peer("lb"), install.find(obj))


def run_bench(out: Path, seconds: float = 4.0, trials: int = 3, flows: int = 50000,
              ndr_steps: int = 6, *, pdr_loss: float = 0.005, resolution: float = 0.01,
              generator: str = "trafgen", trex_server: str | None = None,
              trex_dir: Path | None = None, peers: tuple[str, ...] | None = None,
              coupled: bool = False, latency: bool = True, prefix: str | None = None,
              progress: bool = True, costs: bool = True, cps_seconds: float = 2.0) -> int:
    """Every subject against the generator, ``trials`` rounds interleaved, a
    search of up to ``ndr_steps`` binary steps after the line-rate trial in the
    first; writes ``out``, its plots and ``out.md``. 0, or 130 when interrupted."""
    wanted = tuple(peers) if peers else ALL_SUBJECTS
    unknown = set(wanted) - set(ALL_SUBJECTS)
    if unknown:
        raise ValueError(f"unknown subjects {sorted(unknown)}; known: {', '.join(ALL_SUBJECTS)}")
    record = BenchRecord(conditions={
        **host_conditions(), "seconds_per_trial": seconds, "trials": trials,
        "cps_seconds": cps_seconds,
        "pdr_loss": pdr_loss, "resolution": resolution, "max_search_trials": ndr_steps + 1,
        "subjects_asked": list(wanted),
    })
    n_subjects = 1 + sum(1 for w in wanted if w not in ("reflect", "haproxy_tcp"))
    bar = TrialProgress(total=1 + n_subjects * (trials + ndr_steps), enabled=progress)
    failed = False
    with sigterm_as_interrupt(), tempfile.TemporaryDirectory(prefix="hpclb-bench-") as tmp:
        lab: Lab | None = None
        try:
            with Lab(prefix=prefix or f"bn{uuid.uuid4().hex[:6]}", backends=3,
                     ipv6=True) as lab, bar.shown():
                _run(lab, Path(tmp), record, bar, seconds=seconds, trials=trials,
                     flows=flows, ndr_steps=ndr_steps, pdr_loss=pdr_loss,
                     resolution=resolution, generator=generator, trex_server=trex_server,
                     trex_dir=trex_dir, wanted=wanted, coupled=coupled, latency=latency,
                     costs=costs, cps_seconds=cps_seconds)
        except KeyboardInterrupt:
            record.interrupted = True
        except Exception as err:
            if lab is not None and lab.interrupted_by is not None:
                # A step (a command in a namespace, a generator thread) that ran
                # into the teardown Ctrl-C or SIGTERM started: an interrupted run,
                # not a broken one.
                record.interrupted = True
            else:
                # Whatever failed, what was measured before it is written, with the error.
                record.conditions["error"] = traceback.format_exc()[-4000:]
                print(f"hpclb bench: {type(err).__name__}: {err}", file=sys.stderr,
                      flush=True)
                failed = True
    paths = write_all(record, out)
    doc = record.to_json()
    print(_summary_line(doc), flush=True)
    print("written: " + ", ".join(str(p) for p in paths), flush=True)
    return 130 if record.interrupted else 1 if failed else 0


def _summary_line(doc: dict[str, Any]) -> str:
    parts = []
    for name, sub in doc["subjects"].items():
        s = sub["search"] or {}
        med = doc["median_forwarded_pps"].get(name)
        parts.append(f"{name}: NDR {s.get('ndr_pps') or 0:,.0f} PDR {s.get('pdr_pps') or 0:,.0f}"
                     f" line {med or 0:,.0f} pps")
    head = "interrupted; " if doc["interrupted"] else ""
    return head + "; ".join(parts)


def _run(lab: Lab, workdir: Path, record: BenchRecord, bar: TrialProgress, *,
         seconds: float, trials: int, flows: int, ndr_steps: int, pdr_loss: float,
         resolution: float, generator: str, trex_server: str | None,
         trex_dir: Path | None, wanted: tuple[str, ...], coupled: bool, latency: bool,
         costs: bool, cps_seconds: float) -> None:
    subjects = make_subjects(lab, workdir, wanted, record.not_run)
    gen = make_generator(generator, lab, workdir, flows, coupled=coupled,
                         trex_server=trex_server, trex_dir=trex_dir, latency=latency)
    try:
        if gen.name == "trafgen":
            # Forwarded frames land on the appliance's veth peer and end there
            # (XDP_DROP), counted; TRex takes that veth as its port instead.
            lab.attach_xdp_pass(lab.peer("lb"), install.find("sink.bpf.o"))
        record.conditions["generator"] = {"name": gen.name, **gen.conditions()}
        decoupled = bool(record.conditions["generator"].get("decoupled", True))
        record.marginal_mode = (
            "decoupled: ns per packet on the path's core, saturated" if decoupled else
            "coupled: generator and path share one core, saturated")
        calibrate = getattr(gen, "calibrate", None)
        if calibrate is not None:
            # The generator's top, measured against the ceiling.
            reflect = subjects[0]
            reflect.start()
            try:
                bar.step("calibrating the generator")
                calibrate(seconds)
                bar.done("calibrated")
            finally:
                _stop(reflect, record)
            record.conditions["generator"] = {"name": gen.name, **gen.conditions()}
        frame = udp_frame(lab, 40000)
        for n in range(trials):
            for subject in subjects:
                if subject.name in record.not_run:
                    continue
                _round(lab, gen, subject, record, bar, n=n, seconds=seconds,
                       ndr_steps=ndr_steps, pdr_loss=pdr_loss, resolution=resolution,
                       frame=frame, costs=costs)
    finally:
        try:
            gen.close()
        except Exception as err:  # the lab may be gone already (Ctrl-C)
            record.conditions.setdefault("errors", []).append(f"generator close: {err}")
    # After the generator has given the lab back (TRex holds the appliance's
    # veth peer off the bridge while it runs).
    if costs and any(s.name.startswith("dpdk") for s in subjects):
        bar.step("DPDK worker on memory-fed ports")
        _dpdk_cost(record, lab, workdir)
    if cps_seconds > 0 and {"xdp", "dpdk", NFTABLES, "haproxy_tcp"} & set(wanted):
        bar.step("new connections per second")
        connection_rates(lab, workdir, wanted, cps_seconds, record)


def _round(lab: Lab, gen: Generator, subject: Subject, record: BenchRecord,
           bar: TrialProgress, *, n: int, seconds: float, ndr_steps: int, pdr_loss: float,
           resolution: float, frame: bytes, costs: bool) -> None:
    name = subject.name
    bar.step(f"{name}: starting")
    try:
        subject.start()
    except SubjectUnavailable as err:
        record.not_run[name] = str(err)
        bar.done(f"{name}: not run")
        return
    try:
        rec = record.subject(name, subject.conditions())
        aim = getattr(gen, "aim", None)
        if aim is not None:
            try:
                aim(getattr(subject, "vip", LAB_VIP))
            except ValueError as err:  # e.g. a generator without IPv6
                record.not_run[name] = f"{gen.name}: {err}"
                record.subjects.pop(name, None)
                return
        if "pps" not in getattr(subject, "measures", ("pps",)):
            return

        def trial(rate: float | None) -> Trial:
            bar.step(f"{name} round {n + 1}: " + (
                "line rate" if rate is None else f"{rate:,.0f} pps"))
            t = gen.trial(rate, seconds)
            bar.done(f"{name}: {t.forwarded_pps:,.0f} pps, loss {t.loss_ratio:.3%}")
            return t

        sample = trial(None)
        rec.samples.append(sample)
        if n == 0:
            first = [sample]

            def searched(rate: float) -> Trial:
                if first:
                    return first.pop()
                full = gen.line_rate_pps > 0 and rate >= gen.line_rate_pps * 0.999
                return trial(None if full else rate)

            line = gen.line_rate_pps if gen.line_rate_pps > 0 else sample.offered_pps
            rec.search = search_rates(searched, max(line, 1.0), pdr_loss=pdr_loss,
                                      resolution=resolution, max_trials=ndr_steps + 1)
            if costs:
                _subject_cost(record, rec.cost, subject, lab, frame)
    finally:
        _stop(subject, record)


def _stop(subject: Subject, record: BenchRecord) -> None:
    """Stop a subject; a failure is recorded, never raised over what is under way
    (after Ctrl-C the lab is already torn down, and the interrupt must go on)."""
    try:
        subject.stop()
    except Exception as err:
        record.conditions.setdefault("errors", []).append(
            f"{subject.name} stop: {type(err).__name__}: {err}")


def _subject_cost(record: BenchRecord, cost: dict[str, Any], subject: Subject, lab: Lab,
                  frame: bytes) -> None:
    """The data plane's own per-packet cost while its subject runs: the in-run
    figures (BPF_PROG_TEST_RUN of the attached lb_xdp, the DPDK worker's cycles
    under the load just offered) and, for ``xdp``, hpclb.lab.xdp_cost's rows."""
    if not isinstance(subject, ApplianceSubject) or subject.appliance is None:
        return
    appliance = subject.appliance
    try:
        _row_cost(cost, subject.name, appliance, lab, subject.vip, frame)
    except Exception as err:  # a cost row must not end the run
        cost["error"] = f"{type(err).__name__}: {err}"
    if subject.name != "xdp":
        return
    fn, why = lazy("hpclb.lab.xdp_cost", "measure_xdp_cost")
    if fn is None:
        record.cost["xdp"] = {"skipped": why}
        return
    try:
        record.cost["xdp"] = call_with(fn, lab, appliance, repeat=XDP_COST_REPEAT)
    except Exception as err:
        record.cost["xdp"] = {"skipped": f"{type(err).__name__}: {err}"}


def _dpdk_cost(record: BenchRecord, lab: Lab, workdir: Path) -> None:
    """hpclb.lab.dpdk_cost's rows: the worker on memory-fed ports, no kernel in
    the path (no subject running)."""
    fn, why = lazy("hpclb.lab.dpdk_cost", "measure_dpdk_cost")
    if fn is None:
        record.cost["dpdk"] = {"skipped": why}
        return
    try:
        record.cost["dpdk"] = call_with(fn, lab=lab, workdir=workdir / "dpdk-cost")
    except Exception as err:
        record.cost["dpdk"] = {"skipped": f"{type(err).__name__}: {err}"}

