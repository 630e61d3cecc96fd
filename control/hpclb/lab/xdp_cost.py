"""Per-packet cost of ``lb_xdp`` free of the testbed: BPF_PROG_TEST_RUN.

:func:`measure_xdp_cost` times the ``lb_xdp`` a running lab appliance pinned
(``/sys/fs/bpf/hpclb/<name>/lb_xdp``, with the tables its control plane
pushed) on three paths, each beside do-nothing programs measured the same way
in the same call, their runs interleaved (every round runs every row once),
so that a slow phase of a shared host falls on all rows alike:

* ``flow_hit``: a UDP frame to the VIP whose flow is pinned (XDP_TX);
* ``non_vip``: a UDP frame for no VIP (XDP_PASS, the kernel's);
* ``flow_new``: frames of flows the table has never seen (XDP_TX, a flow
  pinned by each).

The baselines: ``noop_tx`` and ``noop_pass`` (``noop.bpf.o``: return the
verdict, read nothing: what the harness costs per frame) and ``reflect``
(``reflect.bpf.o``: swap the MACs, XDP_TX: the forwarding floor, the ratio
the issue's targets are stated against).

Two modes:

* ``plain``: ``repeat`` iterations on one frame in one test run, nothing
  sent; the kernel's mean ns per iteration, the median over ``rounds``.
* ``live`` (BPF_F_TEST_XDP_LIVE_FRAMES): the verdicts are carried out.
  XDP_TX really transmits out of the appliance's ``eth0`` (the peer ``v-lb``
  runs ``sink.bpf.o`` meanwhile, so that the frames cross the veth and are
  dropped there rather than flooding the lab; whatever it ran before is put
  back), XDP_PASS hands the frame to the appliance namespace's stack. The
  non-VIP frame is addressed to a MAC that is not the appliance's, so that
  the stack drops it at once (not ours) instead of answering it.

The live-frame caveat: the kernel runs the frames in pages of a pool of
``batch`` pages and, recycling a page, resets only ``data``/``data_end``,
not its bytes: from the second batch on a program sees the frame as it left
it the last time. lb_xdp's DSR path rewrites only the two MACs, and nothing
it decides on reads a MAC (the parse reads the EtherType on), so a recycled
hit frame takes the same branch; this is checked, not assumed: every lb row
reads the data plane's counters before and after its runs, and a live
flow-hit row of N frames must have counted N ``flow_hit`` and N ``fwd_tx``
and no ``flow_new``/``pass_*``/``drop_*`` (``verified``). Plain repeat has
the same property (the frame is not restored between iterations either).

A new flow cannot be repeated: the same frame repeats, so only its first
iteration is new (and live frames repeat one frame too: a test run has no
frame generator). ``flow_new`` is therefore timed with ``new_flows``
distinct frames (source address and port vary; a random base, so that a
second call on the same appliance still meets flows the table lacks), each
in a test run of its own (repeat=1), and the same many runs of the pinned
flow's frame beside them: a repeat=1 duration also holds the kernel's timer
reads and loop set-up, which the difference cancels. The estimate
``flow_new.ns_per_frame`` = plain flow_hit + (new repeat=1 - hit repeat=1),
and every one of those runs must have counted a ``flow_new``.

Also runnable alone (root): ``python -m hpclb.lab.xdp_cost --out cost.json``
starts a lab and an appliance, measures, writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hpclb.host import install, netns
from hpclb.lab.appliance import LAB_PORT, LabAppliance
from hpclb.lab.bench import udp_frame
from hpclb.lab.bpf_testrun import PinnedXdpProgram
from hpclb.lab.topology import Lab

HIT_SPORT = 65535
LIVE_BATCH = 64  # the kernel's default live-frame batch (NAPI_POLL_WEIGHT)
# A unicast MAC that is no lab interface's: the live non-VIP frame's
# destination, which the appliance's stack drops as PACKET_OTHERHOST.
OTHER_HOST_MAC = "02:00:5e:00:53:01"
# The new flows' source addresses: a /10 no lab host uses (RFC 6598).
NEW_FLOW_NET = ipaddress.ip_network("100.64.0.0/10")
BPFFS = Path("/sys/fs/bpf")

# Counters an lb row checks: (row, counter that must grow by the frames run).
_MUST_COUNT = {"flow_hit": ("flow_hit", "fwd_tx"), "non_vip": ("pass_not_vip",),
               "flow_new": ("flow_new", "fwd_tx")}
_MUST_STAY = {
    "flow_hit": ("flow_new", "flow_repin", "pass_not_vip", "pass_not_ipv4", "drop_malformed",
                 "drop_no_backend", "drop_tx_error", "fwd_redirect"),
    "non_vip": ("flow_hit", "flow_new", "fwd_tx", "fwd_redirect", "drop_malformed"),
    "flow_new": ("flow_hit", "flow_repin", "pass_not_vip", "drop_malformed",
                 "drop_no_backend", "drop_tx_error", "fwd_redirect"),
}


# --- frames -------------------------------------------------------------------

def ipv4_checksum(header: bytes) -> int:
    s = sum(int.from_bytes(header[i:i + 2], "big") for i in range(0, len(header), 2))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def with_source(frame: bytes, saddr: str | None = None, sport: int | None = None) -> bytes:
    """``frame`` (Ethernet, 20-byte IPv4 header, UDP) from another source
    address and/or port: the IPv4 header checksum recomputed, the UDP checksum
    updated incrementally (RFC 1624; 0, no checksum, stays 0)."""
    b = bytearray(frame)
    csum = int.from_bytes(b[40:42], "big")
    old_words = [int.from_bytes(b[o:o + 2], "big") for o in (26, 28, 34)]
    if saddr is not None:
        b[26:30] = ipaddress.IPv4Address(saddr).packed
        b[24:26] = b"\0\0"
        b[24:26] = ipv4_checksum(bytes(b[14:34])).to_bytes(2, "big")
    if sport is not None:
        b[34:36] = sport.to_bytes(2, "big")
    if csum:
        s = ~csum & 0xFFFF
        for off, old in zip((26, 28, 34), old_words, strict=True):
            s += (~old & 0xFFFF) + int.from_bytes(b[off:off + 2], "big")
        while s >> 16:
            s = (s & 0xFFFF) + (s >> 16)
        b[40:42] = ((~s & 0xFFFF) or 0xFFFF).to_bytes(2, "big")
    return bytes(b)


def new_flow_frames(hit: bytes, count: int, rng: random.Random | None = None) -> list[bytes]:
    """``count`` frames like ``hit`` of distinct flows: source addresses from a
    random offset in NEW_FLOW_NET, 1000 source ports each."""
    rng = rng or random.Random()
    base = int(NEW_FLOW_NET.network_address) + rng.randrange(NEW_FLOW_NET.num_addresses // 2)
    return [with_source(hit, str(ipaddress.IPv4Address(base + i // 1000)), 10000 + i % 1000)
            for i in range(count)]


def non_vip_frame(lab: Lab) -> bytes:
    """A UDP frame to the appliance's own address (no VIP there), to a MAC that
    is not the appliance's: lb_xdp passes it (it decides on addresses, never
    on the destination MAC), the stack drops it as another host's."""
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether

    return bytes(Ether(src=lab.mac("cli"), dst=OTHER_HOST_MAC)
                 / IP(src=lab.ip_of("cli"), dst=lab.ip_of("lb"))
                 / UDP(sport=HIT_SPORT, dport=LAB_PORT) / bytes(18))


# --- programs -----------------------------------------------------------------

def repeat1_ns(prog: PinnedXdpProgram, frames: list[bytes]) -> tuple[int, dict[str, int]]:
    """Total kernel duration of one test run per frame (repeat=1), and how many
    runs ended with each verdict."""
    total, actions = 0, {}
    for frame in frames:
        action, _, ns = prog.run_repeated(frame, 1)
        total += ns
        actions[action] = actions.get(action, 0) + 1
    return total, actions


def prog_info(pin: str) -> dict[str, Any]:
    """bpftool's identity of a pinned program: tag, translated and JITed size."""
    res = subprocess.run(["bpftool", "-j", "prog", "show", "pinned", pin],
                         capture_output=True, text=True, check=False)
    try:
        data = json.loads(res.stdout)
    except ValueError:
        return {}
    return {k: data.get(k) for k in ("tag", "bytes_xlated", "bytes_jited")}


def _find_object(name: str) -> Path:
    """A BPF object of the build: the install manifest's entry, else the file
    of that name beside reflect.bpf.o (an output the manifest may not know yet)."""
    try:
        return install.find(name)
    except (KeyError, install.MissingBuildOutput):
        path = install.find("reflect.bpf.o").with_name(name)
        if not path.is_file():
            raise
        return path


def _sh(*argv: str) -> str:
    res = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {res.returncode}: {res.stderr.strip()}")
    return res.stdout


@contextlib.contextmanager
def _baselines() -> Iterator[dict[str, PinnedXdpProgram]]:
    """reflect, noop_tx and noop_pass loaded and pinned in a folder of their
    own for the call, removed after."""
    pin_dir = BPFFS / f"hpclb-xdp-cost-{uuid.uuid4().hex[:8]}"
    progs: dict[str, PinnedXdpProgram] = {}
    try:
        pin_dir.mkdir()
        _sh("bpftool", "prog", "load", str(_find_object("reflect.bpf.o")),
            str(pin_dir / "reflect"), "type", "xdp")
        _sh("bpftool", "prog", "loadall", str(_find_object("noop.bpf.o")),
            str(pin_dir / "noop"), "type", "xdp")
        progs["reflect"] = PinnedXdpProgram(str(pin_dir / "reflect"))
        progs["noop_tx"] = PinnedXdpProgram(str(pin_dir / "noop" / "xdp_noop_tx"))
        progs["noop_pass"] = PinnedXdpProgram(str(pin_dir / "noop" / "xdp_noop_pass"))
        yield progs
    finally:
        for prog in progs.values():
            prog.close()
        shutil.rmtree(pin_dir, ignore_errors=True)  # unpins (bpffs allows unlink)


def _xdp_prog_id(lab: Lab, ifname: str) -> int | None:
    out = _sh("ip", "-n", lab.bridge_ns, "-j", "link", "show", "dev", ifname)
    xdp = (json.loads(out) or [{}])[0].get("xdp") or {}
    prog = xdp.get("prog") or {}
    if "id" in prog:
        return int(prog["id"])
    progs = [p.get("prog", p) for p in xdp.get("attached", [])]
    return int(progs[0]["id"]) if progs and "id" in progs[0] else None


@contextlib.contextmanager
def peer_sink(lab: Lab) -> Iterator[None]:
    """sink.bpf.o (XDP_DROP) on the appliance's peer ``v-lb`` while live frames
    run: XDP_TX out of eth0 then crosses the veth (a veth transmits a
    redirected frame only to a peer running XDP) and ends there. The program
    the peer ran before (pinned meanwhile, so that it stays loaded) is put
    back, or none."""
    peer = lab.peer("lb")
    keep = BPFFS / f"hpclb-xdp-cost-peer-{uuid.uuid4().hex[:8]}"
    prev = _xdp_prog_id(lab, peer)
    if prev is not None:
        _sh("bpftool", "prog", "pin", "id", str(prev), str(keep))
    try:
        _sh("ip", "-force", "-n", lab.bridge_ns, "link", "set", "dev", peer, "xdpdrv", "obj",
            str(_find_object("sink.bpf.o")), "sec", "xdp")
        yield
    finally:
        try:
            if prev is not None:
                # In the namespace, not `ip -n` (which remounts /sys, hiding bpffs).
                with netns.inside(lab.bridge_ns):
                    _sh("ip", "-force", "link", "set", "dev", peer, "xdpdrv", "pinned",
                        str(keep))
            else:
                _sh("ip", "-n", lab.bridge_ns, "link", "set", "dev", peer, "xdpdrv", "off")
        finally:
            keep.unlink(missing_ok=True)


# --- the measurement ----------------------------------------------------------

class _Rows:
    """The timed rows of one call: each a function run once per round, its
    results, and (lb rows) the counters it moved."""

    def __init__(self, counters: Callable[[], dict[str, int]]) -> None:
        self.counters = counters
        self.runs: dict[str, list[float]] = {}
        self.counted: dict[str, dict[str, int]] = {}
        self.actions: dict[str, dict[str, int]] = {}

    def run(self, name: str, fn: Callable[[], tuple[float, int, dict[str, int]]],
            counted: bool) -> None:
        before = self.counters() if counted else None
        ns, frames, actions = fn()
        self.runs.setdefault(name, []).append(ns)
        acts = self.actions.setdefault(name, {})
        for k, v in actions.items():
            acts[k] = acts.get(k, 0) + v
        if before is not None:
            after = self.counters()
            c = self.counted.setdefault(name, {"frames_run": 0})
            for k in after:
                c[k] = c.get(k, 0) + after[k] - before.get(k, 0)
            c["frames_run"] += frames


def _verified(path: str, c: dict[str, int]) -> bool:
    n = c["frames_run"]
    return (all(c.get(k, 0) == n for k in _MUST_COUNT[path])
            and not any(c.get(k, 0) for k in _MUST_STAY[path]))


def _paired(rows: _Rows, a: str, b: str) -> float | None:
    """Median over rounds of a/b, same round: the figure to read on a noisy host."""
    ratios = [x / y for x, y in zip(rows.runs[a], rows.runs[b], strict=True) if y]
    return statistics.median(ratios) if ratios else None


def measure_xdp_cost(lab: Lab, appliance: LabAppliance, repeat: int = 1_000_000, *,
                     rounds: int = 5, live_repeat: int = 100_000, new_flows: int = 5000,
                     live: bool = True, batch: int = LIVE_BATCH) -> dict[str, Any]:
    """Per-frame cost of the appliance's lb_xdp (module docstring) as a JSON-able
    dict: ``plain``, ``live`` and ``repeat1`` rows (ns per frame, every round's
    run, lb rows' counters and ``verified``), ``flow_new`` (the estimate and
    its parts), ``ratios`` (paired medians: lb row over its baseline, same
    round), ``verified`` (every lb row), ``conditions`` and ``method``.

    ``appliance`` must be an XDP one in DSR mode whose VIP is the lab's
    (``bench.udp_frame``'s); its flow table gains one flow for the hit frame
    and ``new_flows`` more."""
    if appliance.dataplane != "xdp":
        raise ValueError(f"lb_xdp cost needs an XDP appliance, not {appliance.dataplane}")
    if min(repeat, rounds, live_repeat, new_flows) < 1 or not 1 <= batch <= 256:
        raise ValueError("repeat, rounds, live_repeat, new_flows >= 1; batch in 1..256")
    pin = f"/sys/fs/bpf/hpclb/{appliance.name}/lb_xdp"
    hit = udp_frame(lab, HIT_SPORT)
    frames = {"flow_hit": hit, "non_vip": non_vip_frame(lab)}
    new = new_flow_frames(hit, new_flows)
    hello = appliance.client.hello()
    ifindex = int(hello["ports"][0]["ifindex"])

    def counters() -> dict[str, int]:
        return {k: int(v) for k, v in appliance.client.stats()["counters"].items()}

    rows = _Rows(counters)
    lb = PinnedXdpProgram(pin)
    try:
        with _baselines() as base:
            progs = {"lb": lb, **base}
            first = {"flow_hit": lb.run(hit)[0], "non_vip": lb.run(frames["non_vip"])[0]}

            def plain(prog: str, frame: bytes) -> Callable[[], tuple[float, int, dict[str, int]]]:
                def fn() -> tuple[float, int, dict[str, int]]:
                    action, _, ns = progs[prog].run_repeated(frame, repeat)
                    return float(ns), repeat, {action: repeat}
                return fn

            def single(prog: str, share: Callable[[], list[bytes]]
                       ) -> Callable[[], tuple[float, int, dict[str, int]]]:
                def fn() -> tuple[float, int, dict[str, int]]:
                    todo = share()
                    total, actions = repeat1_ns(progs[prog], todo)
                    return total / max(len(todo), 1), len(todo), actions
                return fn

            def live_fn(prog: str, frame: bytes) -> Callable[[], tuple[float, int, dict[str, int]]]:
                def fn() -> tuple[float, int, dict[str, int]]:
                    with netns.inside(lab.ns("lb")):
                        ns = progs[prog].run_live(frame, live_repeat, ifindex, batch)
                    return float(ns), live_repeat, {}
                return fn

            done_new: list[int] = []

            def new_share() -> list[bytes]:
                share = new[len(done_new)::rounds]
                done_new.append(len(share))
                return share

            per_round = -(-new_flows // rounds)
            plan: list[tuple[str, Callable[[], tuple[float, int, dict[str, int]]], bool]] = [
                ("plain/noop_pass", plain("noop_pass", frames["non_vip"]), False),
                ("plain/non_vip", plain("lb", frames["non_vip"]), True),
                ("plain/noop_tx", plain("noop_tx", hit), False),
                ("plain/reflect", plain("reflect", hit), False),
                ("plain/flow_hit", plain("lb", hit), True),
                ("repeat1/noop_tx", single("noop_tx", lambda: [hit] * per_round), False),
                ("repeat1/flow_hit", single("lb", lambda: [hit] * per_round), True),
                ("repeat1/flow_new", single("lb", new_share), True),
            ]
            if live:
                plan += [
                    ("live/noop_pass", live_fn("noop_pass", frames["non_vip"]), False),
                    ("live/non_vip", live_fn("lb", frames["non_vip"]), True),
                    ("live/noop_tx", live_fn("noop_tx", hit), False),
                    ("live/reflect", live_fn("reflect", hit), False),
                    ("live/flow_hit", live_fn("lb", hit), True),
                ]
            with peer_sink(lab) if live else contextlib.nullcontext():
                for _ in range(rounds):
                    for name, fn, counted in plan:
                        rows.run(name, fn, counted)
    finally:
        lb.close()
    return _report(rows, first, frames, repeat, rounds, live_repeat, new_flows, batch, live,
                   pin)


def _report(rows: _Rows, first: dict[str, str], frames: dict[str, bytes], repeat: int,
            rounds: int, live_repeat: int, new_flows: int, batch: int, live: bool,
            pin: str) -> dict[str, Any]:
    out: dict[str, Any] = {"plain": {}, "repeat1": {}, "live": {}}
    all_ok = True
    for name, runs in rows.runs.items():
        mode, row = name.split("/")
        entry: dict[str, Any] = {"ns_per_frame": statistics.median(runs), "runs_ns": runs}
        if rows.actions.get(name):
            entry["actions"] = rows.actions[name]
        if name in rows.counted:
            c = rows.counted[name]
            path = row
            entry["counters"] = {k: c.get(k, 0) for k in (
                "frames_run", "rx", *sorted({*_MUST_COUNT[path], *_MUST_STAY[path]}))}
            entry["verified"] = _verified(path, c)
            all_ok = all_ok and entry["verified"]
        out[mode][row] = entry
    p, r1 = out["plain"], out["repeat1"]
    # The new flow's figure: repeat=1 runs of new flows minus the same runs of
    # the pinned flow (timer and set-up cancel), on top of the plain hit.
    new_minus_hit = r1["flow_new"]["ns_per_frame"] - r1["flow_hit"]["ns_per_frame"]
    flow_new = {"ns_per_frame": p["flow_hit"]["ns_per_frame"] + new_minus_hit,
                "minus_flow_hit_ns": new_minus_hit,
                "repeat1_ns": r1["flow_new"]["ns_per_frame"],
                "hit_repeat1_ns": r1["flow_hit"]["ns_per_frame"],
                "noop_repeat1_ns": r1["noop_tx"]["ns_per_frame"],
                "flows_counted": r1["flow_new"]["counters"]["flow_new"],
                "flows_run": r1["flow_new"]["counters"]["frames_run"]}
    ratios: dict[str, Any] = {"plain": {
        "flow_hit_to_reflect": _paired(rows, "plain/flow_hit", "plain/reflect"),
        "flow_hit_to_noop_tx": _paired(rows, "plain/flow_hit", "plain/noop_tx"),
        "non_vip_to_noop_pass": _paired(rows, "plain/non_vip", "plain/noop_pass"),
        "flow_new_to_flow_hit": flow_new["ns_per_frame"] / p["flow_hit"]["ns_per_frame"]
        if p["flow_hit"]["ns_per_frame"] else None,
    }}
    minus = {"plain": {
        "flow_hit_minus_noop_tx_ns": p["flow_hit"]["ns_per_frame"] - p["noop_tx"]["ns_per_frame"],
        "flow_hit_minus_reflect_ns": p["flow_hit"]["ns_per_frame"] - p["reflect"]["ns_per_frame"],
        "non_vip_minus_noop_pass_ns": (p["non_vip"]["ns_per_frame"]
                                       - p["noop_pass"]["ns_per_frame"]),
    }}
    if live:
        lv = out["live"]
        ratios["live"] = {
            "flow_hit_to_reflect": _paired(rows, "live/flow_hit", "live/reflect"),
            "flow_hit_to_noop_tx": _paired(rows, "live/flow_hit", "live/noop_tx"),
            "non_vip_to_noop_pass": _paired(rows, "live/non_vip", "live/noop_pass"),
        }
        minus["live"] = {
            "flow_hit_minus_reflect_ns": (lv["flow_hit"]["ns_per_frame"]
                                          - lv["reflect"]["ns_per_frame"]),
            "flow_hit_minus_noop_tx_ns": (lv["flow_hit"]["ns_per_frame"]
                                          - lv["noop_tx"]["ns_per_frame"]),
            "non_vip_minus_noop_pass_ns": (lv["non_vip"]["ns_per_frame"]
                                           - lv["noop_pass"]["ns_per_frame"]),
        }
    else:
        del out["live"]
    return {
        "benchmark": "xdp_cost",
        **out,
        "flow_new": flow_new,
        "ratios": ratios,
        "minus_baseline_ns": minus,
        "first_run_actions": first,
        "verified": all_ok and flow_new["flows_counted"] == new_flows,
        "lb_xdp": prog_info(pin),
        "conditions": {
            "kernel": platform.release(), "cpus": os.cpu_count(), "cpu_model": _cpu_model(),
            "loadavg": Path("/proc/loadavg").read_text().split()[:3],
            "repeat": repeat, "rounds": rounds, "live_repeat": live_repeat,
            "live_batch": batch, "new_flows": new_flows,
            "frame_bytes": {k: len(v) for k, v in frames.items()},
        },
        "method": METHOD,
    }


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


METHOD = {
    "program": "the appliance's pinned lb_xdp (its tables as its control plane pushed "
               "them), BPF_PROG_TEST_RUN; baselines noop_tx/noop_pass (noop.bpf.o: "
               "return the verdict) and reflect (reflect.bpf.o: swap MACs, XDP_TX), "
               "loaded for the call",
    "interleaving": "every round runs every row once, in a fixed order; ns_per_frame is "
                    "the median over rounds; ratios are paired: the median over rounds of "
                    "row/baseline of the same round",
    "plain": "repeat iterations on one frame per test run (kernel's mean ns per "
             "iteration), no context (the loopback device), nothing sent",
    "live": "BPF_F_TEST_XDP_LIVE_FRAMES on the appliance's eth0, live_repeat frames in "
            "batches of live_batch: XDP_TX transmitted to v-lb (running sink.bpf.o "
            "meanwhile), XDP_PASS into the appliance's stack (the non-VIP frame's "
            "destination MAC is another host's: dropped at once). Recycled pages keep "
            "the program's output (only data/data_end are reset): lb_xdp's DSR path "
            "rewrites only the MACs, which nothing it decides on reads; checked by the "
            "counters (verified)",
    "flow_new": "new_flows distinct frames (source address and port vary), each in a "
                "test run of its own (repeat=1), shared over the rounds; beside them as "
                "many repeat=1 runs of the pinned flow: ns_per_frame = plain flow_hit + "
                "(new repeat=1 - hit repeat=1). Live frames cannot time it (one frame "
                "repeats: only the first is new)",
    "verified": "each lb row's counters over its runs: flow_hit rows count flow_hit and "
                "fwd_tx, flow_new rows flow_new and fwd_tx, non_vip rows pass_not_vip, "
                "each exactly the frames run, and none of the others moved",
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="lb_xdp per-packet cost (BPF_PROG_TEST_RUN) "
                                            "beside do-nothing programs, in a fresh lab")
    p.add_argument("--out", type=Path, default=Path("results/xdp_cost.json"))
    p.add_argument("--repeat", type=int, default=1_000_000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--live-repeat", type=int, default=100_000)
    p.add_argument("--new-flows", type=int, default=5000)
    p.add_argument("--no-live", action="store_true")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        p.error("needs root (network namespaces, XDP)")
    with tempfile.TemporaryDirectory(prefix="hpclb-xdp-cost-") as tmp, \
            Lab(prefix=f"xc{uuid.uuid4().hex[:6]}", backends=3) as lab, \
            LabAppliance(lab, Path(tmp), {"b1": 1.0, "b2": 1.0, "b3": 1.0},
                         static_macs=True) as appliance:
        result = measure_xdp_cost(lab, appliance, args.repeat, rounds=args.rounds,
                                  live_repeat=args.live_repeat, new_flows=args.new_flows,
                                  live=not args.no_live)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print_summary(result)
    print(f"written to {args.out}")
    return 0


def print_summary(result: dict[str, Any]) -> None:
    for mode in ("plain", "repeat1", "live"):
        for row, e in result.get(mode, {}).items():
            ok = e.get("verified", "-")
            print(f"{mode + '/' + row:22} {e['ns_per_frame']:9.1f} ns  verified {ok}")
    fn = result["flow_new"]
    print(f"{'flow_new (estimate)':22} {fn['ns_per_frame']:9.1f} ns  "
          f"({fn['flows_counted']}/{fn['flows_run']} new flows counted)")
    for mode, rs in result["ratios"].items():
        print(mode, " ".join(f"{k}={v:.3f}" for k, v in rs.items() if v is not None))
    print("verified:", result["verified"])


if __name__ == "__main__":
    sys.exit(main())
