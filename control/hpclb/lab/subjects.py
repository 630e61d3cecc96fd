"""What `hpclb bench` measures (subjects) and what drives it (generators).

A *subject* sets the lab's appliance namespace up to forward the generator's frames
back out of its ``eth0`` (one-arm, DSR), where a sink counts them, and takes it down
again. A *generator* offers frames to the appliance at a rate for a trial's length
and counts what was offered and what came back (``hpclb.lab.ndr.Trial``).

Subjects here: ``reflect`` (an XDP program that swaps MACs and bounces each frame,
XDP_TX: the testbed's ceiling) and the real appliance with either data plane
(``xdp``, ``dpdk``) and their IPv6 and IPIP tunnel rows. The peers a user would pick
instead (nftables DNAT, HAProxy) are in ``hpclb.lab.peers`` and implement the same
protocol. A subject that cannot run on this host raises ``SubjectUnavailable`` with
the reason from ``start``; the bench reports the reason instead of rates.

The trafgen generator, and why it has two modes. In the lab a veth hands a frame to
its peer in the sender's context: trafgen's packet socket transmits on the client's
``eth0``, the bridge forwards in the softirq that follows on the same CPU, and the
appliance's ``eth0`` (a veth with NAPI, since XDP is attached) runs its NAPI poll
there too, XDP program and all. Generator and path then share one core: a slower
path slows the generator to its own rate, nothing is ever lost, and a "no-drop rate"
is one more full-speed sample (**coupled**; kept, because on that shared core
``1/pps(subject) - 1/pps(reflector)`` is the subject's marginal cost per packet).
**Decoupled** (the default where the kernel allows it): the appliance's ``eth0`` gets
threaded NAPI (``/sys/class/net/eth0/threaded`` in its namespace), its NAPI kthread
(``napi/eth0-<id>``) is pinned to the path's CPU and trafgen to the generator's CPU.
The veth then only queues the frame on the appliance's ring (256 frames) and wakes
the kthread; when the path is slower than the generator the ring overflows and
frames are lost, which is what a search needs. The client side (trafgen, its packet
socket, the bridge) stays on the generator's CPU and is the same for every subject.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from importlib.resources import files
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

from jinja2 import Template

from hpclb.host import install
from hpclb.lab.appliance import LAB_PORT, LAB_VIP, LabAppliance, LabApplianceError
from hpclb.lab.ndr import Trial
from hpclb.lab.topology import ETH, Lab

TRAFGEN_TEMPLATE = "templates/trafgen_udp64.cfg.j2"  # package data of hpclb
TRAFGEN_TEMPLATE6 = "templates/trafgen_udp6.cfg.j2"  # the same over IPv6
# The tunnel row's outer source prefix (hpclb.lab.appliance.LAB_TUNNEL_SOURCE).
TUNNEL_ROW = {"encap": "ipip", "source": "198.18.0.240/28"}
GENERATOR_CPU = 0
PATH_CPU = 1
NAPI_RT_PRIORITY = 50  # SCHED_FIFO, the default priority of threaded IRQ handlers
# The decoupled veths' coalescing (NapiDecoupler._coalesce): off. On an idle host
# 20 us (napi_defer_hard_irqs=2) lost frames before the appliance at every rate, the
# reflector 30 % at 40 kpps and 0.5 % at 1.3 kpps; off, the reflector forwarded its
# 263 kpps line rate without loss. Kept as a parameter for loaded hosts.
COALESCE_NS = 0
# Frames in flight (the veth rings, the AF_XDP rings) land within this after a
# trial; counters are read then, so that what never arrives is loss.
SETTLE_S = 0.5


class SubjectUnavailable(Exception):
    """A subject that cannot run on this host; the message says why."""


@runtime_checkable
class Generator(Protocol):
    name: str  # "trafgen" | "trex"
    line_rate_pps: float  # the top it can offer here (measured or configured)

    def trial(self, rate_pps: float | None, seconds: float) -> Trial: ...

    def conditions(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


@runtime_checkable
class Subject(Protocol):
    name: str  # the row: reflect, xdp, dpdk, nftables_dnat, ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def conditions(self) -> dict[str, Any]: ...


# ---------------------------------------------------------------- counters


def xdp_counters(lab: Lab, ns: str, ifname: str) -> dict[str, int]:
    """Sum of a veth's per-queue XDP counters (ethtool -S)."""
    out = lab.exec(ns, ["ethtool", "-S", ifname]).stdout
    totals: dict[str, int] = {}
    for name, value in re.findall(r"rx_queue_\d+_(xdp_\w+):\s+(\d+)", out):
        totals[name] = totals.get(name, 0) + int(value)
    return totals


def xdp_packets(lab: Lab, ns: str, ifname: str) -> int:
    """Frames an XDP program on a veth has seen (its rx XDP counter)."""
    return xdp_counters(lab, ns, ifname).get("xdp_packets", 0)


def sent_frames(lab: Lab, ns: str = "cli", ifname: str = ETH) -> int:
    """Frames handed to a veth for sending, those it dropped included (a veth
    counts a frame its peer's queue refused as a tx drop, not as sent)."""
    stats = f"/sys/class/net/{ifname}/statistics"
    out = lab.exec(ns, ["cat", f"{stats}/tx_packets", f"{stats}/tx_dropped"]).stdout.split()
    return sum(int(v) for v in out)


# ---------------------------------------------------------------- trafgen


def write_trafgen_config(lab: Lab, path: Path, flows: int, dst_ip: str = LAB_VIP,
                         dport: int = LAB_PORT) -> Path:
    """trafgen's configuration at ``path``: 64-byte UDP frames from the client
    to ``dst_ip`` (the VIP; an IPv6 one takes the IPv6 template and the client's
    IPv6 address) through the appliance's MAC, source ports 1024.. over
    ``flows`` flows."""
    v6 = ":" in dst_ip
    template = TRAFGEN_TEMPLATE6 if v6 else TRAFGEN_TEMPLATE
    path.write_text(Template(files("hpclb").joinpath(template).read_text()).render(
        dst_mac=lab.mac("lb"), src_mac=lab.mac("cli"),
        src_ip=lab.ip6_of("cli") if v6 else lab.ip_of("cli"),
        dst_ip=dst_ip, dport=dport, sport_first=1024, flows=flows,
    ))
    return path


def trafgen_argv(cfg: Path, seconds: float, rate_pps: float | None,
                 cpu: int | None = None) -> list[str]:
    """trafgen for ``seconds`` (SIGINT at the end), one process, at ``rate_pps`` or
    as fast as it goes; pinned to ``cpu`` (trafgen pins its one process to CPU 0
    by itself; taskset says which CPU explicitly)."""
    argv = ["timeout", "-s", "INT", str(seconds), "trafgen", "--dev", ETH,
            "--conf", str(cfg), "--cpus", "1", "--no-sock-mem", "--no-cpu-stats"]
    if rate_pps is not None:
        argv += ["--rate", f"{max(int(rate_pps), 1)}pps"]
    if cpu is not None:
        argv = ["taskset", "-c", str(cpu), *argv]
    return argv


def napi_threads(prefixes: tuple[str, ...] = (f"napi/{ETH}-",)) -> dict[int, str]:
    """Kernel NAPI threads by pid whose name starts with one of ``prefixes``."""
    found: dict[int, str] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            comm = (proc / "comm").read_text().strip()
            if comm.startswith(prefixes):
                found[int(proc.name)] = comm
    return found


# A spinner at SCHED_IDLE on the path's CPU, so that the vCPU never halts. On this
# VM (no cpuidle driver: an idle vCPU executes HLT and the hypervisor deschedules
# it) waking a halted vCPU for a frame took long enough, on a shared host, for the
# veth's 256-frame ring to overflow at paced rates: after one line-rate trial the
# reflector lost 15-20 % at 5 kpps (TX drops on v-lb), 0-7 frames of 10,000 with the
# spinner. SCHED_IDLE yields at once to the NAPI threads (FIFO) and to the DPDK
# worker; it dies with its parent (PR_SET_PDEATHSIG), Ctrl-C or not.
KEEP_AWAKE = """
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
os.sched_setaffinity(0, {int(sys.argv[1])})
os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
while True:
    pass
"""


class NapiDecoupler:
    """Threaded NAPI on the appliance's ``eth0`` and on the sink's veth (the
    appliance's peer, which receives what the appliance sends), their kthreads
    pinned to the path's CPU at real-time priority (module doc). A veth's NAPI
    is made again whenever XDP is attached or detached, so :meth:`pin` is called
    before every trial; only threads that appeared after :meth:`enable` are
    pinned (another lab's ``eth0``, should it be threaded, keeps its own)."""

    def __init__(self, lab: Lab, cpu: int = PATH_CPU, coalesce_ns: int = COALESCE_NS) -> None:
        self.lab = lab
        self.cpu = cpu
        self.coalesce_ns = coalesce_ns
        self._before: set[int] = set()
        self.pinned: dict[int, str] = {}
        self._waker: subprocess.Popen[bytes] | None = None
        # (namespace, interface): the appliance's side, then the sink's.
        self.links = (("lb", ETH), ("br", lab.peer("lb")))

    def problem(self) -> str | None:
        """Why this host cannot decouple (None: it can)."""
        if (os.cpu_count() or 1) < 2:
            return "one CPU: generator and path cannot have a core each"
        res = self.lab.exec("lb", ["cat", f"/sys/class/net/{ETH}/threaded"], check=False)
        if res.returncode != 0:
            return f"no threaded NAPI in this kernel ({res.stderr.strip()})"
        return None

    def enable(self) -> None:
        """From now on, threads that appear are this lab's (see :meth:`pin`)."""
        self._before = set(napi_threads(("napi/",)))

    def _threaded(self, ns: str, ifname: str, on: bool) -> subprocess.CompletedProcess[str]:
        return self.lab.exec(ns, ["sh", "-c", f"echo {int(on)} > /sys/class/net/{ifname}/threaded"],
                             check=False)

    def _coalesce(self, ns: str, ifname: str, coalesce_ns: int) -> None:
        """The veth's interrupt coalescing, as a NIC's: after a poll that emptied
        the ring, NAPI stays scheduled for ``coalesce_ns`` (a timer polls again)
        instead of being woken by the next frame. Without it a frame at a time
        wakes the thread (a context switch per frame at moderate rates, where full
        speed brings batches), so the path costs more per frame at 50 kpps than at
        its top and the loss is not monotone in the rate, which a search assumes.
        Measured on this 2-core VM with the reflector: the NAPI threads' CPU per
        frame 4.0-4.5 µs without, 1.7-2.1 µs with 20 µs coalescing."""
        defer = 2 if coalesce_ns > 0 else 0
        self.lab.exec(ns, ["sh", "-c",
                           f"echo {defer} > /sys/class/net/{ifname}/napi_defer_hard_irqs && "
                           f"echo {coalesce_ns} > /sys/class/net/{ifname}/gro_flush_timeout"],
                      check=False)

    def rest(self) -> None:
        """A trial is over: the path's CPU may sleep again (the per-packet cost
        runs between trials must not share a core with the spinner)."""
        if self._waker is not None:
            self._waker.kill()
            self._waker.wait()
            self._waker = None

    def disable(self) -> None:
        self.rest()
        for ns, ifname in self.links:
            self._threaded(ns, ifname, False)
            self._coalesce(ns, ifname, 0)

    def pin(self) -> str | None:
        """Thread the NAPI of both veths and pin the threads to the path's CPU;
        None, or why not (a veth has NAPI only while XDP is attached or GRO is on:
        writing ``threaded`` without it fails, and a NAPI made later by an XDP
        attach starts unthreaded, hence every trial asks again)."""
        for ns, ifname in self.links:
            res = self._threaded(ns, ifname, True)
            if res.returncode != 0:
                self.pinned = {}
                return (f"threaded NAPI refused on {self.lab.ns(ns)} {ifname}: "
                        f"{res.stderr.strip()}")
            self._coalesce(ns, ifname, self.coalesce_ns)
        if self._waker is None:  # the path's CPU kept awake for the trial (KEEP_AWAKE)
            self._waker = subprocess.Popen([sys.executable, "-c", KEEP_AWAKE, str(self.cpu)])
        names = tuple(f"napi/{ifname}-" for _, ifname in self.links)
        mine = {pid: comm for pid, comm in napi_threads(names).items()
                if pid not in self._before}
        for pid, comm in mine.items():
            # The sink's thread one priority above the path's: both are FIFO on one
            # CPU, so at equal priority the sink could not drain its ring while the
            # path forwards (one run lost 84 % at 20 kpps, 39,417 TX drops on the
            # appliance's eth0); the counting end must never be the bottleneck.
            priority = NAPI_RT_PRIORITY + (0 if comm.startswith(names[0]) else 1)
            with contextlib.suppress(OSError):  # a thread gone with a detach
                os.sched_setaffinity(pid, {self.cpu})
                # Real-time, as a NAPI thread on a dedicated packet core would be
                # set up: at the default policy a woken thread waits its turn
                # behind whatever else runs on that core (tens of ms on a busy
                # host), the veth's 256-frame ring overflows meanwhile and the
                # loss is the host's, not the path's.
                os.sched_setscheduler(pid, os.SCHED_FIFO, os.sched_param(priority))
        self.pinned = mine
        if not any(comm.startswith(names[0]) for comm in mine.values()):
            return "no NAPI thread of the appliance's eth0 found"
        return None


class TrafgenGenerator:
    """trafgen in the client namespace, 64-byte UDP over ``flows`` flows to the
    VIP a subject serves (:meth:`aim`). Offered: frames the client's ``eth0`` was
    handed; forwarded: frames the sink on the appliance's veth peer saw, both
    read ``SETTLE_S`` after the trial. ``decoupled``: threaded NAPI on the
    appliance's veth, pinned to another CPU than trafgen (module doc)."""

    name = "trafgen"

    def __init__(self, lab: Lab, workdir: Path, flows: int, *, decoupled: bool = True,
                 vips: tuple[str, ...] = (LAB_VIP,)) -> None:
        self.lab = lab
        self.flows = flows
        self.cfgs = {vip: write_trafgen_config(lab, workdir / f"udp-{i}.cfg", flows,
                                               dst_ip=vip)
                     for i, vip in enumerate(vips)}
        self.vip = vips[0]
        self.decoupler: NapiDecoupler | None = None
        self.decoupled_refused: str | None = None
        if decoupled:
            d = NapiDecoupler(lab)
            if (why := d.problem()) is None:
                d.enable()
                self.decoupler = d
                # The client's bridge port runs XDP_PASS: the veth then copies each
                # frame out of trafgen's TX ring into a page of its own at once.
                # Otherwise the frame's skb, still holding its ring slot and
                # trafgen's socket memory, waits in the appliance's queue; the
                # socket runs out and trafgen's send fails (EAGAIN: it exits).
                lab.attach_xdp_pass(lab.peer("cli"), install.find("pass.bpf.o"))
            else:
                self.decoupled_refused = why
        self.line_rate_pps = 0.0  # set by calibrate()

    @property
    def decoupled(self) -> bool:
        return self.decoupler is not None

    def aim(self, vip: str) -> None:
        """The VIP the next trials are sent to (the subject's)."""
        if vip not in self.cfgs:
            raise ValueError(f"no trafgen configuration for {vip}")
        self.vip = vip

    def calibrate(self, seconds: float) -> float:
        """The generator's top here: a full-speed trial (against whatever the
        appliance runs now, the reflector in the bench); raised later by any
        full-speed trial that offered more."""
        t = self.trial(None, seconds)
        self.line_rate_pps = max(self.line_rate_pps, t.offered_pps)
        return self.line_rate_pps

    def trial(self, rate_pps: float | None, seconds: float) -> Trial:
        # At or near the top, full speed: trafgen's rate limiting sends one frame
        # per syscall, which is slower than its full-speed TX ring.
        full = rate_pps is None or (self.line_rate_pps > 0
                                    and rate_pps >= self.line_rate_pps * 0.999)
        unpinned = self.decoupler.pin() if self.decoupler is not None else None
        peer = self.lab.peer("lb")
        start_in = sent_frames(self.lab)
        start_app = xdp_counters(self.lab, "lb", ETH)
        start_out = xdp_packets(self.lab, "br", peer)
        argv = trafgen_argv(self.cfgs[self.vip], seconds, None if full else rate_pps,
                            cpu=GENERATOR_CPU)
        t0 = time.monotonic()
        res = self.lab.exec("cli", argv, check=False, timeout=seconds + 30)
        elapsed = time.monotonic() - t0
        time.sleep(SETTLE_S)
        offered = sent_frames(self.lab) - start_in
        forwarded = xdp_packets(self.lab, "br", peer) - start_out
        app = {k: v - start_app.get(k, 0) for k, v in xdp_counters(self.lab, "lb", ETH).items()}
        if self.decoupler is not None:
            self.decoupler.rest()
        extra: dict[str, Any] = {"appliance_xdp": app}
        if self.decoupler is not None:
            # Per trial: a subject without NAPI on the veth runs coupled anyway.
            extra["decoupled"] = unpinned is None
            extra["napi_threads"] = sorted(self.decoupler.pinned.values())
            if unpinned is not None:
                extra["coupled_because"] = unpinned
        if res.returncode not in (0, 124) and offered == 0:
            extra["trafgen_error"] = (res.stderr or "").strip()[-500:]
        # Rates over the time trafgen sent (``timeout`` stops it after ``seconds``),
        # not over the wall time of the command, which adds the start of
        # ip-netns-exec, taskset and trafgen (a fifth of a one-second trial).
        extra["elapsed_s"] = round(elapsed, 3)
        sending = min(seconds, elapsed)
        if full and rate_pps is None:
            self.line_rate_pps = max(self.line_rate_pps, offered / sending)
        return Trial(offered_pps=offered / sending, forwarded_pps=forwarded / sending,
                     offered=offered, forwarded=forwarded, seconds=sending,
                     rate_pps=None if full and rate_pps is None else rate_pps,
                     extra=extra)

    def conditions(self) -> dict[str, Any]:
        mode = ("decoupled: threaded NAPI on the appliance's eth0 and the sink's veth "
                f"pinned to CPU "
                f"{PATH_CPU} (SCHED_FIFO {NAPI_RT_PRIORITY}), trafgen pinned to CPU "
                f"{GENERATOR_CPU}" if self.decoupled
                else f"coupled: trafgen on CPU {GENERATOR_CPU}, the whole path in its "
                     "softirq on the same core")
        return {
            "generator": "trafgen, 1 process, client namespace, through a Linux bridge",
            "decoupled": self.decoupled,
            "mode": mode,
            **({"napi_coalesce_ns": self.decoupler.coalesce_ns,
                "napi_threads": sorted(self.decoupler.pinned.values())}
               if self.decoupler is not None else {}),
            **({"decoupled_refused": self.decoupled_refused}
               if self.decoupled_refused else {}),
            "frame_bytes": 64,
            "flows": self.flows,
            "line_rate_pps": self.line_rate_pps,
            "offered_at": "client eth0 tx_packets + tx_dropped",
            "forwarded_at": "appliance veth peer's XDP_DROP sink, rx XDP counter",
            "settle_s": SETTLE_S,
            "rate_limit": "trafgen --rate below the line rate (one sendto per frame)",
        }

    def close(self) -> None:
        if self.decoupler is not None:
            self.decoupler.disable()
            self.lab.exec("br", ["ip", "link", "set", "dev", self.lab.peer("cli"), "xdp",
                                 "off"], check=False)


# ---------------------------------------------------------------- subjects


class ReflectSubject:
    """The testbed's ceiling: an XDP program that swaps MACs and bounces every
    frame (XDP_TX) on the appliance's ``eth0``."""

    name = "reflect"
    vip: str = LAB_VIP

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self.obj = install.find("reflect.bpf.o")

    def start(self) -> None:
        self.lab.attach_xdp("lb", ETH, self.obj)

    def stop(self) -> None:
        self.lab.detach_xdp("lb", ETH)

    def conditions(self) -> dict[str, Any]:
        return {"what": "XDP program swapping MACs, XDP_TX on the appliance veth: the "
                        "ceiling", "vip": self.vip}


class ApplianceSubject:
    """The real appliance (`hpclb run`) with one data plane, started fresh for
    every trial round in its own directory. Static MACs: the bench sinks
    everything the appliance sends, ARP included."""

    WEIGHTS: ClassVar[dict[str, float]] = {"b1": 1.0, "b2": 1.0, "b3": 1.0}

    def __init__(self, lab: Lab, workdir: Path, name: str, plane: str,
                 vip: str = LAB_VIP, options: dict[str, Any] | None = None) -> None:
        self.lab = lab
        self.workdir = workdir
        self.name = name
        self.plane = plane
        self.vip = vip
        self.options = dict(options or {})
        self.appliance: LabAppliance | None = None
        self._starts = 0

    def start(self) -> None:
        appliance_dir = self.workdir / f"{self.name}{self._starts}"
        self._starts += 1
        appliance_dir.mkdir(parents=True)
        # DPDK busy-polls here, as on an appliance: its worker owns a core.
        appliance = LabAppliance(self.lab, appliance_dir, self.WEIGHTS, static_macs=True,
                                 dataplane=self.plane, dpdk_idle_sleep_us=0, **self.options)
        try:
            appliance.start()
        except LabApplianceError as err:
            appliance.stop()
            raise SubjectUnavailable(str(err)[-1500:]) from err
        self.appliance = appliance

    def stop(self) -> None:
        if self.appliance is not None:
            try:
                self.appliance.stop()
            finally:
                self.appliance = None

    def conditions(self) -> dict[str, Any]:
        what = {
            "xdp": "hpclb run + hpclb-xdp, lb_xdp attached natively, XDP_TX one-arm",
            "dpdk": ("hpclb run + hpclb-dpdk, net_af_xdp vdev on the appliance veth (copy "
                     "mode, queue 0), 1 worker lcore (CPU 1) busy-polling, one-arm"),
        }[self.plane]
        mode = self.options.get("mode", "dsr")
        cond: dict[str, Any] = {"what": what, "dataplane": self.plane, "mode": mode,
                                "vip": self.vip}
        if mode == "tunnel":
            cond["tunnel"] = ("IPIP from 198.18.0.240/28 (4 flow bits), the frames leave "
                              "20 bytes longer (84) to the backends' MACs")
        if ":" in self.vip:
            cond["frames"] = "64-byte IPv6 UDP (14+40+8+2) to an IPv6 VIP, lab dual stack"
        if self.plane == "dpdk":
            cond["vdev"] = "net_af_xdp, copy mode, queue 0"
        return cond


def appliance_subjects(lab: Lab, workdir: Path, vip6: str) -> list[ApplianceSubject]:
    """xdp, dpdk, and per plane its IPv6 DSR and IPIP tunnel rows."""
    rows: list[ApplianceSubject] = [ApplianceSubject(lab, workdir, p, p) for p in ("xdp", "dpdk")]
    for plane in ("xdp", "dpdk"):
        rows.append(ApplianceSubject(lab, workdir, f"{plane}_ipv6", plane, vip6,
                                     {"vips": (vip6,)}))
        rows.append(ApplianceSubject(lab, workdir, f"{plane}_tunnel", plane, LAB_VIP,
                                     {"mode": "tunnel", "vips": (LAB_VIP,),
                                      "tunnel": TUNNEL_ROW}))
    return rows


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("unknown" where it says none)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "cpu model", "hardware")):
                return line.split(":", 1)[1].strip()
    return "unknown"


def cpus() -> int:
    return os.cpu_count() or 1


