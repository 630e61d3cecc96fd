#!/usr/bin/env python3
"""Per-packet cost of two builds of the data planes, measured in one sitting.

A benchmark, not a test: it writes JSON and asserts nothing. Needs root (the lab).

Made for refactoring the data planes: the build before (``--baseline``, a
build folder such as ``dataplane/build`` of a worktree of the unchanged tree)
and the build after (``--candidate``) are measured in the same run, their
trials interleaved (trial 1: baseline then candidate, trial 2: the same...),
so that the drift of a noisy shared host falls on both alike.

Each side runs with its own control plane, since two builds may speak
different versions of the table protocol (a control plane refuses a data
plane of another version): the source tree of each side (``--baseline-tree``,
``--candidate-tree``; by default the tree the build folder sits in, else
/tmp/baseline for the baseline and this script's tree for the candidate)
gives the `hpclb run` that LabAppliance starts, ``python -P -m <CLI module>
run ...`` with ``PYTHONPATH=<tree>/control`` (the CLI module is
``hpclb.faces.cli`` where the tree has it, else the older ``hpclb.cli``),
and the table-protocol client through which this script reads the data
plane's counters (a small ``python -c`` in the same environment that prints
JSON). Each build's daemons and Maglev fill are chosen the way the control
plane finds them: ``HPCLB_XDP_BIN``, ``HPCLB_DPDK_BIN`` and
``HPCLB_MAGLEV_LIB`` name that build's ``hpclb-xdp``, ``dpdk/hpclb-dpdk``
and ``libhpclb_maglev.so``, and the running data plane's /proc/PID/exe is
checked against them. What needs no protocol is this tree's, for both
sides: the lab, the BPF_PROG_TEST_RUN of the pinned program, the DPDK
telemetry socket, trafgen, and the lab's helper program (``sink.bpf.o``,
taken from the baseline build). The tree, CLI module and protocol version of
each side are in the conditions (``control_planes``), and each trial records
the version its running data plane answered with. The same binary and tree
on both sides makes an A/A run: the noise floor.

Per trial and build (a fresh appliance each time, so every trial starts with
empty flow tables):

* ``xdp``: the real appliance (`hpclb run` + ``hpclb-xdp``, tables pushed: VIP,
  3 backends, 65537-slot ring), then its pinned ``lb_xdp`` timed in the kernel
  with BPF_PROG_TEST_RUN (nothing is sent on a wire). Both builds' appliances
  are up at once, each in a lab of its own, and every timed run of one build
  is followed at once by the same run of the other: on this host the same
  program's cost moves by tens of percent from one phase of a few seconds to
  the next (48 ns, then 85 ns, for one build a minute apart; both builds
  move together), so builds measured seconds apart differ by that much.

  - ``flow_hit_ns``: a UDP frame to the VIP, run once so that its flow is
    pinned, then the median of five kernel-timed runs of ``--repeat``
    iterations (the statistic of bench's ``_program_cost_ns``, whose five
    runs are consecutive; here they alternate between the builds; every run
    in ``runs_ns``);
  - ``non_vip_ns``: a UDP frame to the appliance's own address (no VIP there:
    XDP_PASS), timed the same way;
  - ``flow_new_ns``: ``--new-flows`` frames with distinct source ports, each
    run once (repeat=1; in five shares alternating between the builds), the
    mean of the kernel's durations; every run inserts a flow (checked: the
    data plane's ``flow_new`` counter grows by exactly that many,
    ``flow_new_counted``). A repeat=1 duration also holds the kernel's timer
    reads and loop set-up, so ``flow_hit_repeat1_ns``, the same method on the
    pinned flow, is measured beside it: their difference is what a new flow
    costs more than a hit.

* ``dpdk``: the real appliance with the DPDK forwarder (net_af_xdp on the
  appliance's veth, one worker busy-polling, as in `hpclb bench`); trafgen in
  the client namespace sends 64-byte UDP frames to the VIP over ``--flows``
  source ports for ``--seconds`` at ``--dpdk-rate`` frames a second (0: as
  fast as it goes, as `hpclb bench` does; but then each build gets the load
  the noisy host lets trafgen make, and the burst sizes, which move cycles
  per frame most, differ: a fixed rate the testbed sustains without loss
  gives both the same); then the worker's busy cycles / frames from its
  telemetry socket (/hpclb/workers, bench's ``dpdk_worker_cost``; the
  forwarder is fresh, so its counters hold that load and the few frames
  seen before it, ``frames_before_traffic``). On this testbed (net_af_xdp in
  copy mode on a veth, about one frame per busy poll) a busy poll costs
  thousands of cycles whatever the build (each poll makes system calls:
  net_af_xdp's TX kick, the TAP's read; not profiled further): cycles per
  frame shows a change in the per-frame decision only when it is large beside
  that, and beside the trial-to-trial spread (the same build on both sides
  shows that spread).

* ``live`` (both builds by default, ``--live-sides``: a baseline that predates
  tunnel mode, IPv6 forwarding or this tree's table protocol fails its side,
  recorded, and the other goes on): per-packet cost of each build's ``lb_xdp`` in
  BPF_PROG_TEST_RUN with live frames (BPF_F_TEST_XDP_LIVE_FRAMES: the
  verdicts are carried out, XDP_TX really transmits out of a veth whose peer
  runs ``sink.bpf.o``) beside the reflector (``reflect.bpf.o``: swap MACs,
  XDP_TX) measured the same way in the same run, rounds alternating between
  all rows, and within a round each row run on every side back to back
  (``candidate_to_baseline``: the median over rounds of the candidate's
  ns/frame over the baseline's, same row, same round). Each side's
  ``hpclb-xdp`` runs --no-attach in a namespace of its own, its tables
  written through this tree's table-protocol client:
  DSR and tunnel VIPs, one backend each (the rows: ``LIVE_ROWS``). Two
  methods, because the kernel recycles a frame's page without rewriting it
  (only data and data_end are reset), so from the second batch on the
  program sees its own output:

  - ``recycled``: ``--live-repeat`` frames per run (``--live-rounds``
    rounds), batches of
    ``LIVE_BATCH``. Honest where the recycled view takes the same path as the
    original: DSR (only the MACs change); IPIP, where after adjust_head(-L)
    the view's 14-byte "Ethernet header" is the last 14 bytes of the outer
    headers, whose EtherType bytes are the outer destination's last two: the
    backends end in 0x0800 (10.1.8.0, fd00::800: inner IPv4) or 0x86dd
    (fd00::86dd: inner IPv6), so every recycled frame re-parses as the same
    inner packet and is encapsulated again the same way;
  - ``fresh``: runs of exactly one batch (repeat == batch size), each on a
    new page pool, so that every frame is the original: for GUE, whose
    recycled view has the UDP checksum (0) for an EtherType and would pass to
    the kernel. Each frame then also pays a page allocation and the copy of
    the frame into it (the kernel's page-pool init), which the reflector
    measured the same way pays too: the ratio is diluted towards 1 by that
    common cost, the difference in ns is not (both are reported; IPIP and
    IPv6 DSR are measured both ways, which shows what the method adds).

  Every row is checked with the data plane's counters over its runs: rx,
  fwd_tx and flow_hit (and tunnel_encap for a tunnel row) grew by exactly
  the frames run, no pass_* or drop_* counter moved (``verified``).

``--order abba`` puts the candidate first in every other trial (the
default, ``abab``, puts the baseline first in each, in every step). At the
defaults a run takes about two minutes.

Results: the median of the trials per build; candidate/baseline as the
ratio of the medians and as ``paired``, the median of the ratios of what the
two builds measured back to back (each XDP run, or share of the repeat=1
runs, against the other build's; each DPDK trial against the other build's
of the same round), where a phase of the host, which moves both builds
alike, cancels: the figure to read on this host; every trial, with the hash
of the binary it ran (a build rewritten during the run shows as two
hashes); the conditions. A trial whose appliance did not start (a build
being rewritten, say) is kept with its error and left out of the medians.

Usage (root):

    .venv/bin/python perf/packet_cost.py --baseline /tmp/baseline/dataplane/build \\
        --candidate dataplane/build --out results/packet_cost.json

(``--baseline-tree /tmp/baseline --candidate-tree .`` implied: the trees the
builds sit in.)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpclb.lab import dpdk_telemetry
from hpclb.lab.appliance import LAB_PORT, LabAppliance
from hpclb.lab.bench import (
    dpdk_worker_cost,
    settled_trial,
    udp_frame,
    write_trafgen_config,
)
from hpclb.lab.bpf_testrun import PinnedXdpProgram
from hpclb.lab.topology import Lab
from hpclb.lab.xdp_cost import prog_info as _prog_info
from hpclb.lab.xdp_cost import repeat1_ns, with_source

SIDES = ("baseline", "candidate")
DATAPLANES = ("xdp", "dpdk")
# Where each daemon is in a build folder (dataplane/Makefile), and the
# variable that makes the control plane run it (hpclb.host.install).
BINARIES = {"xdp": ("hpclb-xdp", "HPCLB_XDP_BIN"),
            "dpdk": ("dpdk/hpclb-dpdk", "HPCLB_DPDK_BIN")}
WEIGHTS = {"b1": 1.0, "b2": 1.0, "b3": 1.0}
HIT_SPORT = 65535  # outside the new flows' ports
NEW_SPORT_FIRST = 1024
ROUNDS = 5  # timed runs per XDP quantity, alternated between the builds
XDP_METRICS = ("flow_hit_ns", "flow_new_ns", "flow_hit_repeat1_ns", "non_vip_ns")
DPDK_METRICS = ("cycles_per_frame", "ns_per_frame", "frames_per_busy_loop",
                "cycles_per_busy_loop", "offered_pps", "forwarded_pps")


# --- builds -------------------------------------------------------------------

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def _git(cwd: Path, *args: str) -> str | None:
    res = subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True,
                         check=False)
    return res.stdout.strip() if res.returncode == 0 else None


def build_info(build: Path) -> dict[str, Any]:
    """What identifies a build folder: its files' hashes and times, and the
    commit of the git worktree it sits in, with the data plane's uncommitted
    changes at the time of the run (a build may be older than its tree)."""
    info: dict[str, Any] = {"dir": str(build)}
    for name in ("hpclb-xdp", "dpdk/hpclb-dpdk", "lb.bpf.o"):
        p = build / name
        if p.is_file():
            info[name] = {"sha256_16": _sha256(p), "mtime": datetime.datetime.fromtimestamp(
                p.stat().st_mtime, datetime.UTC).isoformat(timespec="seconds")}
    top = _git(build, "rev-parse", "--show-toplevel")
    if top:
        changed = (_git(Path(top), "status", "--porcelain", "--", "dataplane") or "").splitlines()
        info["git"] = {"worktree": top, "commit": _git(Path(top), "rev-parse", "HEAD"),
                       "subject": _git(Path(top), "log", "-1", "--format=%s"),
                       "dataplane_uncommitted": changed[:50]}
    return info


# --- control planes -----------------------------------------------------------

THIS_TREE = Path(__file__).resolve().parent.parent
DEFAULT_BASELINE_TREE = Path("/tmp/baseline")
MAGLEV_LIB = ("libhpclb_maglev.so", "HPCLB_MAGLEV_LIB")
# Run with PYTHONPATH=<tree>/control: which package and protocol version it is.
_PROBE = """
import importlib, importlib.util, json, sys
import hpclb
version = None
for name in ("hpclb.contract.tables", "hpclb.dataplane.tables"):
    try:
        version = importlib.import_module(name).PROTOCOL_VERSION
        break
    except (ImportError, AttributeError):
        continue
print(json.dumps({"package": hpclb.__file__, "protocol_version": version,
                  "cli_found": importlib.util.find_spec(sys.argv[1]) is not None}))
"""
# Run likewise: one request through that tree's client, the reply as JSON.
_CLIENT_CALL = """
import json, sys
from hpclb.dataplane.client import DataplaneClient
client = DataplaneClient(sys.argv[1], timeout_s=5.0)
try:
    print(json.dumps(getattr(client, sys.argv[2])(), default=str))
finally:
    client.close()
"""


def tree_of(build: Path) -> Path | None:
    """The source tree a build folder sits in (the first folder above it
    with control/hpclb), or None."""
    for parent in build.parents:
        if (parent / "control" / "hpclb" / "__init__.py").is_file():
            return parent
    return None


def cli_module(tree: Path) -> str:
    """The module of the tree's `hpclb` command: ``hpclb.faces.cli``, or the
    older layout's ``hpclb.cli``."""
    pkg = tree / "control" / "hpclb"
    if (pkg / "faces" / "cli.py").is_file():
        return "hpclb.faces.cli"
    if (pkg / "cli.py").is_file():
        return "hpclb.cli"
    raise ValueError(f"{tree}: neither control/hpclb/faces/cli.py nor control/hpclb/cli.py")


@dataclass
class ControlPlane:
    """One side's control plane (its source tree) and build."""

    tree: Path
    build: Path
    cli_module: str
    protocol_version: int | None = None
    package: str | None = None

    @classmethod
    def of(cls, tree: Path, build: Path) -> ControlPlane:
        cp = cls(tree.resolve(), build.resolve(), cli_module(tree.resolve()))
        probe = cp.python("-c", _PROBE, cp.cli_module)
        cp.protocol_version, cp.package = probe["protocol_version"], probe["package"]
        if not probe["cli_found"]:
            raise ValueError(f"{cp.tree}: {cp.cli_module} cannot be imported")
        if not Path(cp.package).resolve().is_relative_to(cp.tree / "control"):
            raise ValueError(f"PYTHONPATH={cp.tree / 'control'} imports hpclb from "
                             f"{cp.package}, not from that tree")
        return cp

    @property
    def pythonpath(self) -> dict[str, str]:
        return {"PYTHONPATH": str(self.tree / "control")}

    def env(self, dataplane: str) -> dict[str, str]:
        """What `hpclb run` of this side is started with: its tree's package,
        its build's daemon and Maglev fill."""
        rel, var = BINARIES[dataplane]
        env = self.pythonpath | {var: str(self.build / rel)}
        if (self.build / MAGLEV_LIB[0]).is_file():
            env[MAGLEV_LIB[1]] = str(self.build / MAGLEV_LIB[0])
        return env

    @property
    def command_prefix(self) -> list[str]:
        # -P: nothing before PYTHONPATH in sys.path (not the current folder,
        # which could hold another tree's package).
        return [sys.executable, "-P", "-m", self.cli_module]

    def python(self, *argv: str, timeout_s: float = 30.0) -> Any:
        """This interpreter on ``argv`` in this tree's package: its stdout as JSON."""
        res = subprocess.run([sys.executable, "-P", *argv], capture_output=True, text=True,
                             env={**os.environ, **self.pythonpath}, timeout=timeout_s,
                             check=False)
        if res.returncode != 0:
            raise RuntimeError(f"{self.tree} ({self.cli_module}): {res.stderr.strip()[-2000:]}")
        return json.loads(res.stdout)

    def call(self, socket: str, op: str) -> dict[str, Any]:
        """One table-protocol request (``hello``, ``stats``, ``dump``) through
        this tree's own client."""
        reply: dict[str, Any] = self.python("-c", _CLIENT_CALL, socket, op)
        return reply

    def info(self) -> dict[str, Any]:
        maglev = self.build / MAGLEV_LIB[0]
        return {
            "tree": str(self.tree),
            "commit": _git(self.tree, "rev-parse", "HEAD"),
            "control_uncommitted": (_git(self.tree, "status", "--porcelain", "--", "control")
                                    or "").splitlines()[:50],
            "cli_module": self.cli_module,
            "hpclb_run": " ".join([*self.command_prefix, "run", "..."]),
            "pythonpath": str(self.tree / "control"),
            "package": self.package,
            "protocol_version": self.protocol_version,
            "build": str(self.build),
            "build_in_tree": self.build.is_relative_to(self.tree),
            "maglev_fill_lib": ({"path": str(maglev), "sha256_16": _sha256(maglev)}
                                if maglev.is_file() else
                                f"none in the build ({MAGLEV_LIB[0]}): the tree's install "
                                "manifest decides"),
        }


def _check_exe(appliance: LabAppliance, binary: Path) -> None:
    """The running data plane is the build's binary, or the comparison is void."""
    exe = os.readlink(f"/proc/{appliance.dataplane_pid()}/exe")
    if Path(exe.removesuffix(" (deleted)")).resolve() != binary.resolve():
        raise RuntimeError(f"the data plane runs {exe}, not {binary}")


# --- XDP ----------------------------------------------------------------------

def _non_vip_frame(lab: Lab) -> bytes:
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether

    return bytes(Ether(src=lab.mac("cli"), dst=lab.mac("lb"))
                 / IP(src=lab.ip_of("cli"), dst=lab.ip_of("lb"))
                 / UDP(sport=HIT_SPORT, dport=LAB_PORT) / bytes(18))


def _stats(cp: ControlPlane, appliance: LabAppliance) -> dict[str, int]:
    """The data plane's counters, through its own tree's client."""
    return {k: int(v) for k, v in cp.call(appliance.socket, "stats")["counters"].items()}


class XdpSide:
    """One build's pinned lb_xdp, measured in steps (:data:`STEPS`) so that
    the two builds can take each step in turn, back to back."""

    # Each timed quantity in ROUNDS steps: a few tenths of a second each.
    STEPS = ("prepare", *("non_vip",) * ROUNDS, *("hit",) * ROUNDS,
             *("hit_repeat1",) * ROUNDS, *("new",) * ROUNDS, "finish")

    def __init__(self, cp: ControlPlane, appliance: LabAppliance, frames: dict[str, Any],
                 repeat: int) -> None:
        self.cp = cp
        self.appliance = appliance
        self.pin = f"/sys/fs/bpf/hpclb/{appliance.name}/lb_xdp"
        self.frames = frames
        self.repeat = repeat
        self.result: dict[str, Any] = {}
        self.runs: dict[str, list[int]] = {"non_vip": [], "flow_hit": []}
        self.repeat1: dict[str, list[int]] = {"flow_hit": [], "flow_new": []}
        self.new_actions: set[str] = set()
        self.prog = PinnedXdpProgram(self.pin)

    def prepare(self) -> None:
        self.before = _stats(self.cp, self.appliance)
        pass_action, _ = self.prog.run(self.frames["non_vip"])
        hit_action, _ = self.prog.run(self.frames["hit"])  # pins the flow
        self.result["actions"] = {"non_vip": pass_action, "flow_hit": hit_action}

    def non_vip(self) -> None:
        self.runs["non_vip"].append(self.prog.run_repeated(self.frames["non_vip"],
                                                           self.repeat)[2])

    def hit(self) -> None:
        self.runs["flow_hit"].append(self.prog.run_repeated(self.frames["hit"], self.repeat)[2])

    def _share(self, frames: list[bytes], done: list[int]) -> list[bytes]:
        """This round's share of ``frames`` (every ROUNDS-th, from the round's index)."""
        return frames[len(done)::ROUNDS]

    def hit_repeat1(self) -> None:
        done = self.repeat1["flow_hit"]
        frames = self._share([self.frames["hit"]] * len(self.frames["new"]), done)
        done.append(repeat1_ns(self.prog, frames)[0])

    def new(self) -> None:
        done = self.repeat1["flow_new"]
        if not done:
            self.after_hits = _stats(self.cp, self.appliance)
        total, actions = repeat1_ns(self.prog, self._share(self.frames["new"], done))
        done.append(total)
        self.new_actions |= set(actions)

    def finish(self) -> None:
        n = len(self.frames["new"])
        self.result |= {
            "non_vip_ns": statistics.median(self.runs["non_vip"]),
            "flow_hit_ns": statistics.median(self.runs["flow_hit"]),
            "flow_hit_repeat1_ns": sum(self.repeat1["flow_hit"]) / n,
            "flow_new_ns": sum(self.repeat1["flow_new"]) / n,
            "runs_ns": self.runs,
            "shares_ns": self.repeat1,
        }
        self.result["actions"]["flow_new"] = sorted(self.new_actions)
        after = _stats(self.cp, self.appliance)
        self.result["counters"] = {k: after.get(k, 0) - self.before.get(k, 0)
                                   for k in ("flow_new", "flow_hit", "pass_not_vip", "fwd_tx")}
        self.result["flow_new_counted"] = (after.get("flow_new", 0)
                                           - self.after_hits.get("flow_new", 0))
        self.result["lb_xdp"] = _prog_info(self.pin)

    def close(self) -> None:
        self.prog.close()


# --- DPDK ---------------------------------------------------------------------

def dpdk_trial(lab: Lab, appliance: LabAppliance, cfg: Path, seconds: float,
               rate: float | None) -> dict[str, Any]:
    def worker0() -> dict[str, int]:
        w = dpdk_telemetry.query(appliance.dpdk_file_prefix, "/hpclb/workers")["worker0"]
        return {k: int(w[k]) for k in ("frames", "busy_cycles", "total_cycles")}

    before = worker0()
    load = settled_trial(lab, cfg, seconds, rate)
    cost = dpdk_worker_cost(appliance)  # since the forwarder started
    after = worker0()
    window = {k: after[k] - before[k] for k in after}
    return {**cost, "frames_before_traffic": before["frames"],
            "cycles_per_busy_loop": cost["cycles_per_frame"] * cost["frames_per_busy_loop"],
            "busy_share_during_load": window["busy_cycles"] / max(window["total_cycles"], 1),
            "offered_pps": load["offered_pps"], "forwarded_pps": load["forwarded_pps"],
            "lost": load["lost"], "seconds": load["seconds"]}


# --- XDP live frames: IPv6 and tunnel mode beside the reflector ----------------

LIVE_BATCH = 64  # the kernel's default live-frame batch (NAPI_POLL_WEIGHT)
LIVE_CLIENT_MAC = "02:aa:00:00:00:01"
LIVE_TUNNEL_SRC4 = "172.16.0.1"
LIVE_TUNNEL_SRC6 = "fd00:1::1"
LIVE_GUE_PORT = 6080
# Backends: (address, MAC). The IPIP targets end in 0x0800 / 0x86dd (the
# module docstring: the recycled view's EtherType).
LIVE_BACKENDS = {0: ("10.1.8.0", "02:bb:00:00:00:30"), 1: ("fd00::800", "02:bb:00:00:00:31"),
                 2: ("fd00::86dd", "02:bb:00:00:00:32"), 3: ("10.1.9.9", "02:bb:00:00:00:33"),
                 4: ("fd00::9", "02:bb:00:00:00:34")}


@dataclass(frozen=True)
class LiveVip:
    """A VIP of the live rows: UDP port 53 at ``addr``, one backend."""

    vip_id: int
    addr: str
    backend: int
    mode: int = 0  # VipMode.DSR; 2: tunnel
    encap: int = 0  # Encap.IPIP; 1: GUE
    tunnel_src: str | None = None


LIVE_VIPS = {
    "dsr4": LiveVip(0, "198.18.1.10", 0),
    "dsr6": LiveVip(1, "fd00:18::10", 2),
    "ipip4in4": LiveVip(2, "198.18.1.20", 0, 2, 0, LIVE_TUNNEL_SRC4),
    "ipip4in6": LiveVip(3, "198.18.1.21", 1, 2, 0, LIVE_TUNNEL_SRC6),
    "ipip6in6": LiveVip(4, "fd00:18::20", 2, 2, 0, LIVE_TUNNEL_SRC6),
    "gue4in4": LiveVip(5, "198.18.1.22", 3, 2, 1, LIVE_TUNNEL_SRC4),
    "gue6in6": LiveVip(6, "fd00:18::22", 4, 2, 1, LIVE_TUNNEL_SRC6),
}
# (row name, program, VIP (None: the reflector's IPv4 frame), method).
LIVE_ROWS = (
    ("reflect", "reflect", None, "recycled"),
    ("dsr4", "lb", "dsr4", "recycled"),
    ("dsr6", "lb", "dsr6", "recycled"),
    ("ipip4in4", "lb", "ipip4in4", "recycled"),
    ("ipip4in6", "lb", "ipip4in6", "recycled"),
    ("ipip6in6", "lb", "ipip6in6", "recycled"),
    ("reflect_fresh", "reflect", None, "fresh"),
    ("dsr6_fresh", "lb", "dsr6", "fresh"),
    ("ipip4in4_fresh", "lb", "ipip4in4", "fresh"),
    ("gue4in4_fresh", "lb", "gue4in4", "fresh"),
    ("gue6in6_fresh", "lb", "gue6in6", "fresh"),
)
LIVE_GOAL = 1.3  # the issue's: a tunnel or IPv6 DSR row <= 1.3 x the reflector
_LIVE_MUST_STAY = ("pass_not_ipv4", "pass_not_vip", "pass_fragment", "pass_ext_headers",
                   "drop_malformed", "drop_no_backend", "drop_tx_error", "drop_encap",
                   "fwd_redirect", "flow_new", "flow_repin")


def _live_frame(vip: LiveVip | None, port_mac: str) -> bytes:
    """A UDP frame of 18 payload bytes to ``vip`` (None: to the reflector,
    IPv4, 60 bytes as a 64-byte frame without FCS)."""
    from scapy.layers.inet import IP, UDP
    from scapy.layers.inet6 import IPv6
    from scapy.layers.l2 import Ether

    dst = vip.addr if vip else "198.18.1.10"
    l3 = (IPv6(src="fd00:99::1", dst=dst) if ":" in dst else IP(src="10.99.0.1", dst=dst))
    return bytes(Ether(src=LIVE_CLIENT_MAC, dst=port_mac) / l3 / UDP(sport=4242, dport=53)
                 / bytes(18))


def _live_tables(client: Any) -> None:
    """The live rows' tables, through the table protocol (every field of a
    tunnel VIP, whatever the client's set_vip sends)."""
    import ipaddress

    import numpy as np

    ring_size = int(client.hello()["ring_size"])
    client.set_config(bytes(range(16)))
    client.call("set_backends", backends=[
        {"id": bid, "addr": ipaddress.ip_address(addr).packed,
         "mac": bytes.fromhex(mac.replace(":", "")), "state": 0, "port": 0}
        for bid, (addr, mac) in LIVE_BACKENDS.items()])
    for vip in LIVE_VIPS.values():
        fields: dict[str, Any] = {
            "vip_id": vip.vip_id, "addr": ipaddress.ip_address(vip.addr).packed, "port": 53,
            "proto": 17, "mode": vip.mode,
            "slots": np.full(ring_size, vip.backend, dtype="<u4").tobytes()}
        if vip.tunnel_src:
            fields |= {"tunnel_src": ipaddress.ip_address(vip.tunnel_src).packed,
                       "tunnel_encap": vip.encap}
            if vip.encap == 1:
                fields["gue_port"] = LIVE_GUE_PORT
        client.call("set_vip", **fields)


def _live_run(prog: PinnedXdpProgram, frame: bytes, method: str, ifindex: int,
              args: argparse.Namespace) -> tuple[float, int]:
    """One round of a row: (mean ns per frame, frames run)."""
    if method == "recycled":
        return float(prog.run_live(frame, args.live_repeat, ifindex, LIVE_BATCH)), \
            args.live_repeat
    total = sum(prog.run_live(frame, LIVE_BATCH, ifindex, LIVE_BATCH)
                for _ in range(args.live_fresh_calls))
    return total / args.live_fresh_calls, LIVE_BATCH * args.live_fresh_calls


LIVE_METHOD = {
    "batch_size": LIVE_BATCH,
    "frames": "UDP, 18 payload bytes: IPv4 60 bytes, IPv6 80 bytes (no FCS); the "
              "reflector's IPv4",
    "ingress": "veth (native XDP driver); its peer runs sink.bpf.o (XDP_DROP), so "
               "that XDP_TX (a redirect to the ingress device in live mode) transmits",
    "recycled": "repeat=recycled_repeat in batches of batch_size: pages are recycled "
                "with their content as the program left it (only data/data_end "
                "reset). Used for DSR (only MACs change) and IPIP: the recycled "
                "view's EtherType is the outer destination's last two bytes, and the "
                "backends end in 0x0800 (10.1.8.0, fd00::800) or 0x86dd (fd00::86dd), "
                "so every recycled frame re-parses as the same inner packet",
    "fresh": "runs of exactly one batch (repeat == batch_size), fresh_calls per round, "
             "mean of the runs: every frame on a new page, so it is the original; "
             "for GUE, whose recycled view's EtherType is the UDP checksum (0). Each "
             "frame also pays a page allocation and copy, as the reflector measured "
             "this way does (the ratio is diluted towards 1; minus_reflector_ns is "
             "not)",
    "verified": "over all of a row's runs: rx, fwd_tx, flow_hit (and tunnel_encap "
                "for a tunnel row) grew by exactly frames_run; no pass_*/drop_*, "
                "fwd_redirect, flow_new or flow_repin moved",
    "ratios": "ratio_to_reflector: medians' ratio; paired_ratio_to_reflector: median "
              "over rounds of row/reflector of the same round (the figure to read on a "
              f"noisy host); within_goal: paired <= {LIVE_GOAL}",
    "sides": "each build measured (--live-sides) has its own namespace, hpclb-xdp, "
             "tables and reflector; within a round every row is run on every side back "
             "to back, so candidate_to_baseline (median over rounds of the candidate's "
             "ns/frame over the baseline's, same row, same round) pairs the builds as "
             "the xdp trials do",
    "programs_attached": "lb_xdp and reflect attached (native) to a spare veth pair "
                         "while measured, so that each test run finds them in the "
                         "kernel's XDP dispatcher"}


def _sh(*argv: str) -> None:
    res = subprocess.run(argv, capture_output=True, text=True, check=False)
    if res.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {res.stderr.strip()}")


class _LiveSide:
    """One build's live rows: a namespace, its hpclb-xdp (--no-attach, the
    tables written through this tree's table-protocol client, so a baseline
    of another protocol version fails here, recorded), its pinned lb_xdp and
    a reflector, each attached to a spare veth pair."""

    def __init__(self, build: Path, workdir: Path, side: str) -> None:
        tag = uuid.uuid4().hex[:6]
        self.build, self.workdir, self.side = build, workdir, side
        self.ns, self.pin_dir = f"pcl-{tag}", f"/sys/fs/bpf/hpclb/pcl-{tag}"
        self.reflect_pin = Path(f"/sys/fs/bpf/pcl-{tag}-reflect")
        self.sock = f"ipc://{workdir}/live-{side}.sock"
        self.dataplane: Any = None
        self.client: Any = None
        self.progs: dict[str, PinnedXdpProgram] = {}
        self.frames: dict[str, bytes] = {}
        self.ifindex = 0
        self.runs: dict[str, list[float]] = {name: [] for name, *_ in LIVE_ROWS}
        self.counted: dict[str, dict[str, int]] = {}

    def start(self) -> None:
        from hpclb.dataplane.supervisor import DataplaneProcess
        from hpclb.host import netns

        build, ns = self.build, self.ns
        _sh("ip", "netns", "add", ns)
        _sh("ip", "-n", ns, "link", "add", "lv0", "type", "veth", "peer", "name", "lv1")
        _sh("ip", "-n", ns, "link", "set", "lv0", "up")
        _sh("ip", "-n", ns, "link", "set", "lv1", "up")
        _sh("ip", "-n", ns, "link", "set", "lv1", "xdpdrv", "obj", str(build / "sink.bpf.o"),
            "sec", "xdp")
        self.dataplane = DataplaneProcess(
            argv=[str(build / "hpclb-xdp"), "--netns", ns, "--iface", "lv0", "--no-attach",
                  "--pin-dir", self.pin_dir, "--socket", self.sock],
            endpoint=self.sock, pidfile=self.workdir / f"live-{self.side}.pid",
            log_path=self.workdir / f"live-{self.side}.log")
        self.dataplane.start()
        self.client = self.dataplane.client
        hello = self.client.hello()
        port_mac = ":".join(f"{b:02x}" for b in bytes(hello["ports"][0]["mac"]))
        self.ifindex = int(hello["ports"][0]["ifindex"])
        _live_tables(self.client)
        _sh("bpftool", "prog", "load", str(build / "reflect.bpf.o"), str(self.reflect_pin),
            "type", "xdp")
        # Both programs attached (native, to a spare veth pair no frame
        # crosses) while measured: a test run of a program the kernel's XDP
        # dispatcher does not hold swaps it in and out, each time waiting
        # for an RCU grace period (milliseconds on this host; untimed, but
        # thousands of one-batch runs would take many minutes).
        # (`ip -n` would remount /sys, hiding bpffs: ip runs in the namespace.)
        _sh("ip", "-n", ns, "link", "add", "lv2", "type", "veth", "peer", "name", "lv3")
        with netns.inside(ns):
            _sh("ip", "link", "set", "lv2", "xdpdrv", "pinned", f"{self.pin_dir}/lb_xdp")
            _sh("ip", "link", "set", "lv3", "xdpdrv", "pinned", str(self.reflect_pin))
        self.progs = {"lb": PinnedXdpProgram(f"{self.pin_dir}/lb_xdp"),
                      "reflect": PinnedXdpProgram(str(self.reflect_pin))}
        self.frames = {name: _live_frame(LIVE_VIPS[vip] if vip else None, port_mac)
                       for name, _, vip, _ in LIVE_ROWS}
        with netns.inside(ns):
            for name, prog, _, _ in LIVE_ROWS:  # pin every flow first (flow_new)
                if prog == "lb":
                    self.progs[prog].run(self.frames[name])

    def run_row(self, name: str, prog: str, method: str, args: argparse.Namespace) -> None:
        from hpclb.host import netns

        before = _counter_map(self.client) if prog == "lb" else None
        with netns.inside(self.ns):
            ns_per, n = _live_run(self.progs[prog], self.frames[name], method, self.ifindex,
                                  args)
        self.runs[name].append(ns_per)
        if before is not None:
            after = _counter_map(self.client)
            c = self.counted.setdefault(name, {})
            for k in after:
                c[k] = c.get(k, 0) + after[k] - before.get(k, 0)
            c["frames_run"] = c.get("frames_run", 0) + n

    def rows(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        runs = self.runs
        for name, prog, vip, method in LIVE_ROWS:
            row: dict[str, Any] = {"program": prog, "method": method, "vip": vip,
                                   "frame_bytes": len(self.frames[name]),
                                   "ns_per_frame": statistics.median(runs[name]),
                                   "runs_ns": runs[name]}
            if name in self.counted:
                c = self.counted[name]
                tunnel = vip is not None and LIVE_VIPS[vip].mode == 2
                row["counters"] = {k: c.get(k, 0) for k in (
                    "frames_run", "rx", "fwd_tx", "flow_hit", "tunnel_encap",
                    *_LIVE_MUST_STAY)}
                row["verified"] = (
                    c["rx"] == c["fwd_tx"] == c["flow_hit"] == c["frames_run"]
                    and c.get("tunnel_encap", 0) == (c["frames_run"] if tunnel else 0)
                    and not any(c.get(k, 0) for k in _LIVE_MUST_STAY))
            ref = "reflect" if method == "recycled" else "reflect_fresh"
            if prog == "lb":
                row["ratio_to_reflector"] = row["ns_per_frame"] / statistics.median(runs[ref])
                row["paired_ratio_to_reflector"] = statistics.median(
                    a / b for a, b in zip(runs[name], runs[ref], strict=True) if b)
                row["minus_reflector_ns"] = row["ns_per_frame"] - statistics.median(runs[ref])
                row["within_goal"] = row["paired_ratio_to_reflector"] <= LIVE_GOAL
            out[name] = row
        return out

    def close(self) -> None:
        for prog in self.progs.values():
            prog.close()
        if self.dataplane is not None:
            self.dataplane.stop()
        self.reflect_pin.unlink(missing_ok=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, check=False)
        subprocess.run(["rm", "-rf", self.pin_dir], capture_output=True, check=False)


def live_rows(builds: dict[str, Path], workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The live rows of each build in ``builds`` (side -> build folder; the
    module docstring), rounds interleaved between the sides."""
    out: dict[str, Any] = {"method": LIVE_METHOD | {
        "recycled_repeat": args.live_repeat, "fresh_calls": args.live_fresh_calls,
        "rounds": args.live_rounds}, "sides": {}}
    sides: dict[str, _LiveSide] = {}
    try:
        for side, build in builds.items():
            sides[side] = _LiveSide(build, workdir, side)
            try:
                sides[side].start()
            except Exception as err:  # kept in the report, as a failed trial is
                out["sides"][side] = {"error": f"{type(err).__name__}: {str(err)[-3000:]}"}
                print(f"live rows, {side}: {out['sides'][side]['error'][:300]}",
                      file=sys.stderr)
                sides.pop(side).close()
        for _ in range(args.live_rounds):
            for name, prog, _, method in LIVE_ROWS:
                for live in sides.values():
                    live.run_row(name, prog, method, args)
        for side, live in sides.items():
            out["sides"][side] = {"rows": live.rows(),
                                  "lb_xdp": _prog_info(f"{live.pin_dir}/lb_xdp")}
        if "baseline" in sides and "candidate" in sides:
            base, cand = sides["baseline"].runs, sides["candidate"].runs
            out["candidate_to_baseline"] = {
                name: statistics.median(c / b for c, b in zip(cand[name], base[name],
                                                               strict=True) if b)
                for name, *_ in LIVE_ROWS}
    except Exception as err:  # kept in the report, as a failed trial is
        out["error"] = f"{type(err).__name__}: {str(err)[-3000:]}"
        print(f"live rows: {out['error'][:300]}", file=sys.stderr)
    finally:
        for live in sides.values():
            live.close()
    return out


def _counter_map(client: Any) -> dict[str, int]:
    return {k: int(v) for k, v in client.stats()["counters"].items()}


def print_live(live: dict[str, Any]) -> None:
    if "error" in live:
        print(f"live rows: error: {live['error'][:300]}")

    def f(row: dict[str, Any], key: str, spec: str) -> str:
        return format(row[key], spec) if key in row else "-"

    ratio = live.get("candidate_to_baseline", {})
    for side, res in live.get("sides", {}).items():
        if "error" in res:
            print(f"live rows, {side}: error: {res['error'][:300]}")
            continue
        print(f"{'live (' + side + ')':24} {'ns/frame':>9} {'x reflector':>12} {'paired':>8} "
              f"{'+ns':>7}  verified" + ("  cand/base" if side == "candidate" and ratio
                                         else ""))
        for name, row in res["rows"].items():
            extra = (f"  {ratio[name]:9.3f}" if side == "candidate" and name in ratio else "")
            print(f"{name:24} {row['ns_per_frame']:9.1f} "
                  f"{f(row, 'ratio_to_reflector', '.3f'):>12} "
                  f"{f(row, 'paired_ratio_to_reflector', '.3f'):>8} "
                  f"{f(row, 'minus_reflector_ns', '.1f'):>7}"
                  f"  {row.get('verified', '-')!s:8}{extra}")


# --- the run ------------------------------------------------------------------

def _fail(entry: dict[str, Any], side: str, dataplane: str, n: int, err: Exception) -> None:
    """A build being rewritten, a failed start: kept in the trial, not fatal."""
    entry["error"] = f"{type(err).__name__}: {str(err)[-3000:]}"
    first = str(err).splitlines()[0][:200] if str(err) else ""
    print(f"{side} {dataplane} trial {n + 1}: {type(err).__name__}: {first}", file=sys.stderr)


def _start(stack: contextlib.ExitStack, lab: Lab, workdir: Path, side: str, cp: ControlPlane,
           dataplane: str, n: int, entry: dict[str, Any]) -> LabAppliance:
    """A fresh appliance in ``lab``: the `hpclb run` of ``cp``'s tree running
    its build's daemon, stopped when ``stack`` closes."""
    binary = cp.build / BINARIES[dataplane][0]
    entry["binary_sha256_16"] = _sha256(binary)
    appliance_dir = workdir / f"{dataplane}-{side}-{n}"
    appliance_dir.mkdir()
    appliance = LabAppliance(lab, appliance_dir, WEIGHTS, static_macs=True,
                             dataplane=dataplane, dpdk_idle_sleep_us=0,
                             command_prefix=cp.command_prefix, env=cp.env(dataplane))
    # After the appliance stops: the forwarder leaves its EAL runtime folder, empty.
    stack.callback(_rmdir, dpdk_telemetry.RUNTIME_DIR / appliance.dpdk_file_prefix)
    stack.enter_context(appliance)
    _check_exe(appliance, binary)
    hello = cp.call(appliance.socket, "hello")
    entry["protocol_version"] = hello.get("version", hello.get("v"))
    return appliance


def _rmdir(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.rmdir()


def xdp_pair(labs: dict[str, Lab], workdir: Path, planes: dict[str, ControlPlane], n: int,
             order: tuple[str, ...], frames: dict[str, Any],
             args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """One XDP trial of both builds: both appliances up at once (one lab
    each), then every measurement step taken by one build and the other in
    turn, back to back, so that a slow phase of the host falls on both."""
    entries: dict[str, dict[str, Any]] = {side: {"trial": n} for side in SIDES}
    sides: dict[str, XdpSide] = {}
    with contextlib.ExitStack() as stack:
        for side in order:
            try:
                appliance = _start(stack, labs[side], workdir, side, planes[side], "xdp", n,
                                   entries[side])
                sides[side] = XdpSide(planes[side], appliance, frames, args.repeat)
                stack.callback(sides[side].close)
            except Exception as err:
                _fail(entries[side], side, "xdp", n, err)
        for step in XdpSide.STEPS:
            for side in order:
                if side in sides and "error" not in entries[side]:
                    try:
                        getattr(sides[side], step)()
                    except Exception as err:
                        _fail(entries[side], side, "xdp", n, err)
    for side, xs in sides.items():
        if "error" not in entries[side]:
            entries[side].update(xs.result)
    return entries


def dpdk_one(lab: Lab, workdir: Path, side: str, cp: ControlPlane, n: int, cfg: Path,
             args: argparse.Namespace) -> dict[str, Any]:
    """One DPDK trial of one build, on a fresh appliance."""
    entry: dict[str, Any] = {"trial": n}
    try:
        with contextlib.ExitStack() as stack:
            appliance = _start(stack, lab, workdir, side, cp, "dpdk", n, entry)
            entry.update(dpdk_trial(lab, appliance, cfg, args.seconds, args.dpdk_rate or None))
    except Exception as err:
        _fail(entry, side, "dpdk", n, err)
    return entry


def _median(entries: list[dict[str, Any]], metric: str) -> float | None:
    values = [e[metric] for e in entries if "error" not in e and metric in e]
    return statistics.median(values) if values else None


# XDP quantities timed in ROUNDS parts, each part of one build next to the
# same part of the other: (key of the trial entry, key in it) of those parts.
PARTS = {"flow_hit_ns": ("runs_ns", "flow_hit"), "non_vip_ns": ("runs_ns", "non_vip"),
         "flow_hit_repeat1_ns": ("shares_ns", "flow_hit"),
         "flow_new_ns": ("shares_ns", "flow_new")}


def _paired_ratio(base: list[dict[str, Any]], cand: list[dict[str, Any]],
                  metric: str) -> float | None:
    """Median of candidate/baseline over what the two builds measured back to
    back, so that a slow phase of the host falls on both: each XDP run (or
    share) against the other build's same run; a DPDK trial against the
    other build's trial of the same round."""
    ratios: list[float] = []
    for b, c in zip(base, cand, strict=True):
        if "error" in b or "error" in c:
            continue
        if metric in PARTS:
            group, key = PARTS[metric]
            ratios += [y / x for x, y in zip(b[group][key], c[group][key], strict=True) if x]
        elif b.get(metric) and c.get(metric) is not None:
            ratios.append(c[metric] / b[metric])
    return statistics.median(ratios) if ratios else None


def summarize(trials: dict[str, dict[str, list[dict[str, Any]]]],
              dataplanes: list[str]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    metrics = {"xdp": XDP_METRICS, "dpdk": DPDK_METRICS}
    median = {side: {dp: {m: _median(trials[side][dp], m) for m in metrics[dp]}
                     | {"trials_ok": sum("error" not in e for e in trials[side][dp])}
                     | ({"trials_with_loss": sum(e.get("lost", 0) > 0
                                                 for e in trials[side][dp])}
                        if dp == "dpdk" else {})
                     for dp in dataplanes} for side in SIDES}
    ratio: dict[str, Any] = {}
    for dp in dataplanes:
        ratio[dp] = {}
        for m in metrics[dp]:
            a, b = median["baseline"][dp][m], median["candidate"][dp][m]
            ratio[dp][m] = b / a if a and b is not None else None
    paired = {dp: {m: _paired_ratio(trials["baseline"][dp], trials["candidate"][dp], m)
                   for m in metrics[dp]} for dp in dataplanes}
    return median, ratio, paired


def conditions(args: argparse.Namespace, planes: dict[str, ControlPlane]) -> dict[str, Any]:
    cpu, virtual = "unknown", None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "unknown":
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and virtual is None:
                virtual = "hypervisor" in line.split(":", 1)[1].split()
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "kernel": platform.release(),
        "cpu_model": cpu,
        "virtual_machine": virtual,
        "cpus": os.cpu_count(),
        "loadavg_at_start": Path("/proc/loadavg").read_text().split()[:3],
        "python": platform.python_version(),
        "harness": f"this script's hpclb ({Path(sys.modules['hpclb'].__file__ or '').parent}): "
                   "lab, BPF_PROG_TEST_RUN, DPDK telemetry, trafgen (no table protocol)",
        "control_planes": {side: planes[side].info() for side in SIDES},
        "builds": {side: build_info(planes[side].build) for side in SIDES},
        "order": ("baseline then candidate" if args.order == "abab"
                  else "baseline then candidate in odd trials, candidate then baseline in "
                       "even ones")
                 + "; xdp: both builds' appliances up at once (a lab each), every step "
                   "(non_vip, flow_hit, flow_hit_repeat1, flow_new) taken by both in that "
                   "order, back to back; dpdk: one forwarder after the other, in the first "
                   "lab; a trial's xdp runs before its dpdk runs; fresh appliances (empty "
                   "flow tables) every trial",
        "trials": args.trials,
        "xdp": {
            "program": "lb_xdp pinned by the build's hpclb-xdp under its tree's `hpclb run` "
                       "in the lab "
                       "(native XDP on the appliance veth; VIP 198.18.1.10:8080 udp+tcp, "
                       "3 backends, 65537-slot ring), timed with BPF_PROG_TEST_RUN",
            "frame": "64-byte Ethernet/IPv4/UDP (60 bytes without FCS)",
            "flow_hit_ns": f"frame to the VIP run once (flow pinned), then the median of "
                           f"{ROUNDS} kernel-timed runs of repeat={args.repeat} (mean ns per "
                           "iteration), each run followed by the other build's",
            "non_vip_ns": f"frame to the appliance's own address (XDP_PASS), median of "
                          f"{ROUNDS} runs of repeat={args.repeat}, alternated likewise",
            "flow_new_ns": f"{args.new_flows} frames to the VIP with distinct source ports "
                           f"({NEW_SPORT_FIRST}..{NEW_SPORT_FIRST + args.new_flows - 1}), each "
                           "run once (repeat=1) on an empty flow table, in "
                           f"{ROUNDS} shares alternated with the other build: the mean of "
                           "the kernel's per-call durations; each call inserts a flow "
                           "(flow_new_counted)",
            "flow_hit_repeat1_ns": f"the pinned flow's frame run {args.new_flows} times with "
                                   "repeat=1, as flow_new_ns: the same method's floor "
                                   "(timer reads, loop set-up)",
        },
        "dpdk": {
            "forwarder": "the build's hpclb-dpdk under its tree's `hpclb run`: net_af_xdp "
                         "vdev on the "
                         "appliance veth, lcores 0 (main) and 1 (one worker), busy polling",
            "load": f"trafgen, 1 process, client namespace: 64-byte UDP frames to the VIP, "
                    f"{args.flows} source ports, {args.seconds} s at "
                    + (f"{args.dpdk_rate:.0f} pps" if args.dpdk_rate else "full speed"),
            "cycles_per_frame": "worker0 busy_cycles / frames (/hpclb/workers) after the load, "
                                "on a forwarder started for the trial; busy cycles count only "
                                "polls that received frames, measured with the TSC from the "
                                "poll's start to its end (a worker descheduled meanwhile "
                                "counts the gap: such trials show bigger bursts and often "
                                "lost frames)",
        },
    }


def print_summary(median: dict[str, Any], ratio: dict[str, Any], paired: dict[str, Any],
                  dataplanes: list[str]) -> None:
    def fmt(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    print(f"{'median':32} {'baseline':>12} {'candidate':>12} {'cand/base':>10} {'paired':>8}")
    for dp in dataplanes:
        for m in (XDP_METRICS if dp == "xdp" else DPDK_METRICS):
            print(f"{dp + ' ' + m:32} {fmt(median['baseline'][dp][m], ',.1f'):>12} "
                  f"{fmt(median['candidate'][dp][m], ',.1f'):>12} "
                  f"{fmt(ratio[dp][m], '.3f'):>10} {fmt(paired[dp][m], '.3f'):>8}")
    print("cand/base: ratio of the medians; paired: median of the ratios of what the two "
          "builds measured back to back")
    for dp in dataplanes:
        print(f"{dp} trials ok: baseline {median['baseline'][dp]['trials_ok']}, "
              f"candidate {median['candidate'][dp]['trials_ok']}")
    if "dpdk" in dataplanes:  # a stalled worker: bigger bursts, stall cycles counted as busy
        print(f"dpdk trials that lost frames: baseline "
              f"{median['baseline']['dpdk']['trials_with_loss']}, candidate "
              f"{median['candidate']['dpdk']['trials_with_loss']}")


def run(args: argparse.Namespace) -> int:
    builds = {"baseline": args.baseline.resolve(), "candidate": args.candidate.resolve()}
    dataplanes = [dp for dp in DATAPLANES if dp in args.dataplanes.split(",")]
    for side, build in builds.items():
        for dp in dataplanes:
            if not os.access(build / BINARIES[dp][0], os.X_OK):
                print(f"{side}: no {BINARIES[dp][0]} in {build}", file=sys.stderr)
                return 2
    planes: dict[str, ControlPlane] = {}
    for side in SIDES:
        tree = getattr(args, f"{side}_tree") or tree_of(builds[side]) or (
            DEFAULT_BASELINE_TREE if side == "baseline" else THIS_TREE)
        try:
            planes[side] = ControlPlane.of(tree, builds[side])
        except (OSError, ValueError, RuntimeError, subprocess.TimeoutExpired) as err:
            print(f"{side}: control plane of {tree}: {err}", file=sys.stderr)
            return 2
        cp = planes[side]
        print(f"{side}: build {cp.build}, control plane {cp.tree} ({cp.cli_module}, table "
              f"protocol version {cp.protocol_version})", file=sys.stderr)
        if not cp.build.is_relative_to(cp.tree):
            print(f"warning: {side}: the build {cp.build} is not in the tree {cp.tree}",
                  file=sys.stderr)
    sink = builds["baseline"] / "sink.bpf.o"
    report: dict[str, Any] = {"benchmark": "packet_cost",
                              "conditions": conditions(args, planes)}
    infos = report["conditions"]["builds"]
    same = [name for name in ("hpclb-xdp", "dpdk/hpclb-dpdk")
            if name in infos["baseline"] and infos["baseline"][name] == infos["candidate"][name]]
    report["conditions"]["identical_in_both_builds"] = same
    if same:  # an A/A run (the noise floor), meant or not
        print(f"note: the same {', '.join(same)} in both builds (sha256 "
              f"{', '.join(infos['baseline'][n]['sha256_16'] for n in same)})", file=sys.stderr)
    trials: dict[str, dict[str, list[dict[str, Any]]]] = {
        side: {dp: [] for dp in dataplanes} for side in SIDES}
    t_start = time.monotonic()
    tag = uuid.uuid4().hex[:6]
    with tempfile.TemporaryDirectory(prefix="hpclb-packet-cost-") as tmp, \
            contextlib.ExitStack() as labs_up:
        workdir = Path(tmp)
        # One lab per build, so that both builds' lb_xdp are loaded at once;
        # the DPDK trials of both run in the first (one forwarder at a time).
        labs = {"baseline": labs_up.enter_context(Lab(prefix=f"pc{tag}a", backends=3))}
        labs["candidate"] = (labs_up.enter_context(Lab(prefix=f"pc{tag}b", backends=3))
                             if "xdp" in dataplanes else labs["baseline"])
        lab = labs["baseline"]
        lab.attach_xdp_pass(lab.peer("lb"), sink)  # everything forwarded ends there
        cfg = write_trafgen_config(lab, workdir / "udp64.cfg", args.flows)
        # The labs' MACs and addresses are the same (lab.topology): one set of frames.
        hit = udp_frame(lab, HIT_SPORT)
        frames = {"hit": hit, "non_vip": _non_vip_frame(lab),
                  "new": [with_source(hit, sport=NEW_SPORT_FIRST + i)
                          for i in range(args.new_flows)]}
        for n in range(args.trials):
            order = SIDES[::-1] if args.order == "abba" and n % 2 else SIDES
            if "xdp" in dataplanes:
                t0 = round(time.monotonic() - t_start, 1)
                for side, entry in xdp_pair(labs, workdir, planes, n, order, frames,
                                            args).items():
                    trials[side]["xdp"].append(entry | {"started_s": t0})
            if "dpdk" in dataplanes:
                for side in order:
                    t0 = round(time.monotonic() - t_start, 1)
                    entry = dpdk_one(lab, workdir, side, planes[side], n, cfg, args)
                    trials[side]["dpdk"].append(entry | {"started_s": t0})
            line = []
            for dp in dataplanes:
                m = "flow_hit_ns" if dp == "xdp" else "cycles_per_frame"
                vals = [trials[s][dp][-1].get(m) for s in SIDES]
                line.append(f"{dp} {m} " + " / ".join(
                    "error" if v is None else f"{v:,.1f}" for v in vals))
            print(f"trial {n + 1}/{args.trials} (baseline / candidate): " + "; ".join(line),
                  flush=True)
        if "xdp" in dataplanes and args.live:
            live_sides = [x for x in args.live_sides.split(",") if x]
            print(f"live rows ({', '.join(live_sides)})...", flush=True)
            report["live"] = live_rows({x: builds[x] for x in live_sides}, workdir, args)
    median, ratio, paired = summarize(trials, dataplanes)
    hashes = {side: {dp: sorted({e["binary_sha256_16"] for e in trials[side][dp]
                                 if "binary_sha256_16" in e}) for dp in dataplanes}
              for side in SIDES}
    report["conditions"]["loadavg_at_end"] = Path("/proc/loadavg").read_text().split()[:3]
    report["conditions"]["run_seconds"] = round(time.monotonic() - t_start, 1)
    report["conditions"]["binaries_run"] = hashes
    report["median"] = median
    report["ratio_candidate_to_baseline"] = ratio
    report["paired_ratio_median"] = paired
    report["trials"] = trials
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print_summary(median, ratio, paired, dataplanes)
    if "live" in report:
        print_live(report["live"])
    for side in SIDES:
        for dp in dataplanes:
            if len(hashes[side][dp]) > 1:
                print(f"warning: {side} {dp}: the binary changed during the run "
                      f"({', '.join(hashes[side][dp])})")
    print(f"written to {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--baseline", type=Path, required=True, help="build folder before")
    p.add_argument("--candidate", type=Path, required=True, help="build folder after")
    p.add_argument("--baseline-tree", type=Path,
                   help="source tree whose control plane (hpclb run, table-protocol client) "
                        "drives the baseline (default: the tree the build sits in, else "
                        f"{DEFAULT_BASELINE_TREE})")
    p.add_argument("--candidate-tree", type=Path,
                   help="the same for the candidate (default: the tree the build sits in, "
                        f"else this script's tree, {THIS_TREE})")
    p.add_argument("--out", type=Path, default=Path("results/packet_cost.json"))
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--repeat", type=int, default=1_000_000,
                   help="BPF_PROG_TEST_RUN iterations per timed run (hit, non-VIP)")
    p.add_argument("--new-flows", type=int, default=20000,
                   help="distinct flows timed one run each (new flow)")
    p.add_argument("--seconds", type=float, default=5.0, help="DPDK load per trial")
    p.add_argument("--flows", type=int, default=50000, help="source ports of the DPDK load")
    p.add_argument("--dpdk-rate", type=float, default=100_000,
                   help="frames a second of the DPDK load (0: as fast as trafgen goes)")
    p.add_argument("--dataplanes", default="xdp,dpdk", help="xdp, dpdk or xdp,dpdk")
    p.add_argument("--live", action=argparse.BooleanOptionalAction, default=True,
                   help="the live-frame rows of the candidate (IPv6 DSR, tunnel mode, "
                        "beside the reflector)")
    p.add_argument("--live-sides", default="baseline,candidate",
                   help="the builds whose live rows are measured, interleaved: baseline, "
                        "candidate or both (the baseline must have tunnel mode and IPv6 "
                        "and speak this tree's table protocol)")
    p.add_argument("--live-rounds", type=int, default=9,
                   help="rounds of the live rows (each row once per round, in turn)")
    p.add_argument("--live-repeat", type=int, default=100_000,
                   help="frames per recycled-method run of a live row")
    p.add_argument("--live-fresh-calls", type=int, default=1000,
                   help="one-batch runs per fresh-method round of a live row")
    p.add_argument("--order", choices=("abab", "abba"), default="abab",
                   help="abab: baseline first in every trial; abba: first in odd trials, "
                        "second in even ones (cancels an effect of going first)")
    args = p.parse_args(argv)
    if args.trials < 1 or args.repeat < 1 or not 1 <= args.new_flows <= 64000:
        p.error("--trials and --repeat must be >= 1, --new-flows in 1..64000")
    if min(args.live_rounds, args.live_repeat, args.live_fresh_calls) < 1:
        p.error("--live-rounds, --live-repeat and --live-fresh-calls must be >= 1")
    if not set(x for x in args.live_sides.split(",") if x) <= set(SIDES):
        p.error("--live-sides: baseline, candidate or baseline,candidate")
    if not args.dataplanes or not set(args.dataplanes.split(",")) <= set(DATAPLANES):
        p.error("--dataplanes: xdp, dpdk or xdp,dpdk")
    if os.geteuid() != 0:
        p.error("needs root (network namespaces, XDP, DPDK)")
    # SIGINT and SIGTERM unwind the run, so that every appliance is stopped
    # (`hpclb run` lives outside the lab's namespaces) and the lab removed:
    # the lab's own handler removes the namespaces, then calls this one. Set
    # even where SIGINT was ignored (a background job), for the same reason.
    main_pid = os.getpid()

    def interrupt(signum: int, frame: object) -> None:
        if os.getpid() != main_pid:  # a forked helper (pyroute2's NetNS)
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupt)
    try:
        return run(args)
    except KeyboardInterrupt as exc:
        print(f"interrupted ({exc}); appliances stopped, lab removed", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
