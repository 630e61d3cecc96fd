"""`hpclb bench`: forwarding rate of both data planes in the lab, against the
testbed's ceiling.

Same lab, same generator, same run, interleaved trials:
  * ``reflect``: an XDP program that only swaps MACs and sends each frame back
    (XDP_TX) on the appliance's interface — the ceiling of this testbed;
  * ``xdp``: the real appliance (`hpclb run`, lb_xdp attached natively);
  * ``dpdk``: the real appliance with the DPDK forwarder (net_af_xdp vdev on
    the same veth, one busy-polling worker).
Each data plane also gets its no-drop rate (NDR): full speed, then a binary
search on trafgen's --rate until no frame is lost. Two more rows per data
plane, on the same (dual-stack) lab in the same run: ``<plane>_ipv6``, IPv6
DSR (64-byte IPv6 UDP frames to an IPv6 VIP), and ``<plane>_tunnel``, tunnel
mode with IPIP (the same IPv4 frames, leaving 20 bytes longer inside an outer
IPv4 header to an on-link backend); a data plane that cannot run a row has it
reported with the reason instead of rates.
trafgen in the client namespace sends 64-byte UDP frames to the VIP with a
random source port each (many flows). Forwarded frames are counted where they
land, the appliance's veth peer, which runs an XDP_DROP program so nothing
downstream costs anything. Offered frames are counted by the appliance
interface's XDP counters. Beside the path rates, each program's own cost per
frame is timed in the kernel with BPF_PROG_TEST_RUN, and the DPDK worker's
cycles per frame are read from its telemetry socket. Results (median of the
trials, every trial, the conditions) go to a JSON file. This is a
measurement, never a test assertion.
"""

from __future__ import annotations

import json
import platform
import re
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from importlib.resources import files
from pathlib import Path
from typing import Any

from jinja2 import Template

from hpclb.host import install
from hpclb.lab import dpdk_telemetry
from hpclb.lab.appliance import LAB_PORT, LAB_VIP, LAB_VIP6, LabAppliance, LabApplianceError
from hpclb.lab.bpf_testrun import PinnedXdpProgram
from hpclb.lab.topology import Lab

TRAFGEN_TEMPLATE = "templates/trafgen_udp64.cfg.j2"  # package data of hpclb
TRAFGEN_TEMPLATE6 = "templates/trafgen_udp6.cfg.j2"  # the same over IPv6
# The tunnel row's outer source prefix (hpclb.lab.appliance.LAB_TUNNEL_SOURCE).
TUNNEL_ROW = {"encap": "ipip", "source": "198.18.0.240/28"}


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


def _ndr(lab: Lab, cfg: Path, seconds: float, steps: int) -> dict[str, Any]:
    return ndr_search(lambda rate: settled_trial(lab, cfg, seconds, rate), steps)


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


# The rows beside the IPv4 DSR ones: (row, data plane, VIP the generator aims at,
# LabAppliance options).
EXTRA_ROWS: tuple[tuple[str, str, str, dict[str, Any]], ...] = tuple(
    row for plane in ("xdp", "dpdk") for row in (
        (f"{plane}_ipv6", plane, LAB_VIP6, {"vips": (LAB_VIP6,)}),
        (f"{plane}_tunnel", plane, LAB_VIP,
         {"mode": "tunnel", "vips": (LAB_VIP,), "tunnel": TUNNEL_ROW}),
    ))


def run_bench(out: Path, seconds: float = 4.0, trials: int = 3, flows: int = 50000,
              ndr_steps: int = 6) -> int:
    """Forwarding rate of the XDP and the DPDK data planes against the
    testbed's ceiling, in one run on one lab, with trials interleaved; IPv6 DSR
    and IPIP tunnel rows for each plane beside them."""
    kinds = ("reflect", "xdp", "dpdk", *(row[0] for row in EXTRA_ROWS))
    results: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    ndr: dict[str, dict[str, Any]] = {}
    cost: dict[str, Any] = {}
    refused: dict[str, str] = {}  # row -> why its data plane could not run it
    weights = {"b1": 1.0, "b2": 1.0, "b3": 1.0}
    with tempfile.TemporaryDirectory(prefix="hpclb-bench-") as tmp, \
            Lab(prefix=f"bn{uuid.uuid4().hex[:6]}", backends=3, ipv6=True) as lab:
        workdir = Path(tmp)
        reflect_obj = install.find("reflect.bpf.o")
        lab.attach_xdp_pass(lab.peer("lb"), install.find("sink.bpf.o"))
        cfg = write_trafgen_config(lab, workdir / "udp64.cfg", flows)
        cfgs = {LAB_VIP: cfg, LAB_VIP6: write_trafgen_config(lab, workdir / "udp6.cfg", flows,
                                                             dst_ip=LAB_VIP6)}
        frame = udp_frame(lab, 40000)
        rows = [(k, k, LAB_VIP, {}) for k in ("xdp", "dpdk")] + list(EXTRA_ROWS)
        for n in range(trials):
            lab.attach_xdp("lb", "eth0", reflect_obj)
            results["reflect"].append(settled_trial(lab, cfg, seconds, None))
            lab.detach_xdp("lb", "eth0")
            for kind, plane, vip, options in rows:
                if kind in refused:
                    continue
                appliance_dir = workdir / f"{kind}{n}"
                appliance_dir.mkdir()
                # DPDK busy-polls here, as on an appliance: its worker owns a core.
                appliance = LabAppliance(lab, appliance_dir, weights, static_macs=True,
                                         dataplane=plane, dpdk_idle_sleep_us=0, **options)
                try:
                    appliance.start()
                except LabApplianceError as err:
                    appliance.stop()
                    if kind in ("xdp", "dpdk"):
                        raise
                    refused[kind] = str(err)[-1500:]
                    print(f"{kind}: the appliance did not start, row skipped", flush=True)
                    continue
                try:
                    results[kind].append(settled_trial(lab, cfgs[vip], seconds, None))
                    if n == 0:
                        ndr[kind] = _ndr(lab, cfgs[vip], seconds, ndr_steps)
                        _row_cost(cost, kind, appliance, lab, vip, frame)
                finally:
                    appliance.stop()
            print(f"trial {n + 1}/{trials}: " + ", ".join(
                f"{k} {results[k][-1]['forwarded_pps']:,.0f} pps "
                f"(lost {results[k][-1]['lost']:.0f})" for k in kinds if results[k]),
                flush=True)

    median = {k: statistics.median(t["forwarded_pps"] for t in v)
              for k, v in results.items() if v}
    report: dict[str, Any] = {
        "benchmark": "forwarding_udp64",
        "conditions": {
            "frame_bytes": 64,
            "flows": flows,
            "generator": "trafgen, 1 process, client namespace, through a Linux bridge",
            "reflect": "XDP program swapping MACs, XDP_TX on the appliance veth: the ceiling",
            "xdp": "hpclb run + hpclb-xdp, lb_xdp attached natively, XDP_TX one-arm DSR",
            "dpdk": ("hpclb run + hpclb-dpdk, net_af_xdp vdev on the appliance veth (copy "
                     "mode, queue 0), 1 worker lcore busy-polling, one-arm DSR"),
            "measured_at": "appliance veth peer (XDP_DROP sink) rx XDP counter; offered at "
                           "the appliance veth's rx XDP counter, read 0.5 s after each trial",
            "ndr": "no frame lost; full speed first, then a binary search with trafgen --rate",
            "ipv6_rows": ("<plane>_ipv6: IPv6 DSR, 64-byte IPv6 UDP frames (14+40+8+2) to "
                          "an IPv6 VIP, the lab in dual stack"),
            "tunnel_rows": ("<plane>_tunnel: tunnel mode, IPIP from 198.18.0.240/28 (4 "
                            "flow bits), the generator's IPv4 frames leave 20 bytes longer "
                            "(84) to the backends' MACs; counted at the same sink"),
            "seconds_per_trial": seconds,
            "trials": trials,
            "kernel": platform.release(),
            "cpus": subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip(),
        },
        "median_forwarded_pps": median,
        "ndr_pps": {k: v["ndr_pps"] for k, v in ndr.items()},
        "ratio_dpdk_to_xdp": {
            "median_forwarded": median["dpdk"] / median["xdp"] if median["xdp"] else None,
            "ndr": (ndr["dpdk"]["ndr_pps"] / ndr["xdp"]["ndr_pps"]
                    if ndr.get("xdp", {}).get("ndr_pps") else None),
        },
        "ratio_to_reflect": {k: median[k] / median["reflect"] if median["reflect"] else None
                             for k in kinds if k != "reflect" and k in median},
        "ratio_to_ipv4_dsr": {k: (median[k] / median[k.split("_")[0]]
                                  if median.get(k.split("_")[0]) else None)
                              for k, *_ in EXTRA_ROWS if k in median},
        "rows_not_run": refused,
        "cost": cost,
        "trials": results,
        "ndr_search": {k: v["search"] for k, v in ndr.items()},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("median_forwarded_pps", "ndr_pps",
                                             "ratio_dpdk_to_xdp", "ratio_to_reflect",
                                             "ratio_to_ipv4_dsr", "rows_not_run", "cost")},
                     indent=1))
    print(f"written to {out}")
    return 0
