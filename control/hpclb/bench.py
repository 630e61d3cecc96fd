"""`hpclb bench`: XDP forwarding rate in the lab against the testbed's ceiling.

Same lab, same generator, same run, alternating trials:
  * ``reflect``: an XDP program that only swaps MACs and sends each frame back
    (XDP_TX) on the appliance's interface — the ceiling of this testbed;
  * ``hpclb``: the real appliance (`hpclb run`, lb_xdp attached natively).
trafgen in the client namespace sends 64-byte UDP frames to the VIP with a
random source port each (many flows). Forwarded frames are counted where they
land, the appliance's veth peer, which runs an XDP_DROP program so nothing
downstream costs anything. Offered frames are counted by the appliance
interface's XDP counters. Beside the path rates, each program's own cost per
frame is timed in the kernel with BPF_PROG_TEST_RUN. Results (median of the trials, every trial, the
conditions) go to a JSON file. This is a measurement, never a test assertion.
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
from pathlib import Path
from typing import Any

from jinja2 import Template

from hpclb.dataplane.bpf_testrun import PinnedXdpProgram
from hpclb.lab import Lab
from hpclb.labrun import LAB_PORT, LAB_VIP, LabAppliance

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "dataplane" / "build"
TRAFGEN_TEMPLATE = REPO / "perf" / "trafgen_udp64.cfg.j2"


def _xdp_counters(lab: Lab, ns: str, ifname: str) -> dict[str, int]:
    """Sum of a veth's per-queue XDP counters (ethtool -S)."""
    out = lab.exec(ns, ["ethtool", "-S", ifname]).stdout
    totals: dict[str, int] = {}
    for name, value in re.findall(r"rx_queue_\d+_(xdp_\w+):\s+(\d+)", out):
        totals[name] = totals.get(name, 0) + int(value)
    return totals


def _trial(lab: Lab, cfg: Path, seconds: float) -> dict[str, float]:
    """Run the generator for ``seconds``; return offered and forwarded rates."""
    peer = lab.peer("lb")
    start_in = _xdp_counters(lab, "lb", "eth0")
    start_out = _xdp_counters(lab, "br", peer)
    t0 = time.monotonic()
    lab.exec("cli", ["timeout", "-s", "INT", str(seconds), "trafgen", "--dev", "eth0",
                     "--conf", str(cfg), "--cpus", "1", "--no-sock-mem"],
             check=False, timeout=seconds + 30)
    elapsed = time.monotonic() - t0
    end_in = _xdp_counters(lab, "lb", "eth0")
    end_out = _xdp_counters(lab, "br", peer)
    offered = end_in.get("xdp_packets", 0) - start_in.get("xdp_packets", 0)
    forwarded = end_out.get("xdp_packets", 0) - start_out.get("xdp_packets", 0)
    return {
        "seconds": round(elapsed, 3),
        "offered_pps": offered / elapsed,
        "forwarded_pps": forwarded / elapsed,
        "loss_ratio": (offered - forwarded) / offered if offered else 0.0,
    }


def _udp_frame(lab: Lab, sport: int) -> bytes:
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether

    return bytes(Ether(src=lab.mac("cli"), dst=lab.mac("lb"))
                 / IP(src=lab.ip_of("cli"), dst=LAB_VIP) / UDP(sport=sport, dport=LAB_PORT)
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


def _reflect_cost_ns(frame: bytes) -> float:
    pin = f"/sys/fs/bpf/hpclb-bench-reflect-{uuid.uuid4().hex[:8]}"
    subprocess.run(["bpftool", "prog", "load", str(BUILD / "reflect.bpf.o"), pin, "type", "xdp"],
                   check=True, capture_output=True)
    try:
        return _program_cost_ns(pin, frame)
    finally:
        Path(pin).unlink(missing_ok=True)


def run_bench(out: Path, seconds: float = 5.0, trials: int = 3, flows: int = 50000) -> int:
    results: dict[str, list[dict[str, float]]] = {"reflect": [], "hpclb": []}
    cost_ns: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="hpclb-bench-") as tmp, \
            Lab(prefix=f"bn{uuid.uuid4().hex[:6]}", backends=3) as lab:
        workdir = Path(tmp)
        lab.attach_xdp_pass(lab.peer("lb"), BUILD / "sink.bpf.o")
        cfg = workdir / "udp64.cfg"
        cfg.write_text(Template(TRAFGEN_TEMPLATE.read_text()).render(
            dst_mac=lab.mac("lb"), src_mac=lab.mac("cli"), src_ip=lab.ip_of("cli"),
            dst_ip=LAB_VIP, dport=LAB_PORT, sport_first=1024, flows=flows,
        ))
        for n in range(trials):
            lab.attach_xdp("lb", "eth0", BUILD / "reflect.bpf.o")
            results["reflect"].append(_trial(lab, cfg, seconds))
            lab.detach_xdp("lb", "eth0")
            appliance_dir = workdir / f"appliance{n}"
            appliance_dir.mkdir()
            with LabAppliance(lab, appliance_dir, {"b1": 1.0, "b2": 1.0, "b3": 1.0},
                              static_macs=True) as appliance:
                results["hpclb"].append(_trial(lab, cfg, seconds))
                if n == 0:
                    frame = _udp_frame(lab, 40000)
                    cost_ns["hpclb_flow_hit"] = _program_cost_ns(
                        f"/sys/fs/bpf/hpclb/{appliance.name}/lb_xdp", frame)
                    cost_ns["reflect"] = _reflect_cost_ns(frame)
            print(f"trial {n + 1}/{trials}: reflect "
                  f"{results['reflect'][-1]['forwarded_pps']:,.0f} pps, hpclb "
                  f"{results['hpclb'][-1]['forwarded_pps']:,.0f} pps")

    median = {k: statistics.median(t["forwarded_pps"] for t in v) for k, v in results.items()}
    report: dict[str, Any] = {
        "benchmark": "xdp_forwarding_udp64",
        "conditions": {
            "frame_bytes": 64,
            "flows": flows,
            "generator": "trafgen, 1 CPU, client namespace, through a Linux bridge",
            "path": "veth, lb_xdp attached natively, XDP_TX one-arm DSR",
            "measured_at": "appliance veth peer (XDP_DROP sink) rx XDP counter",
            "seconds_per_trial": seconds,
            "trials": trials,
            "kernel": platform.release(),
            "cpus": subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip(),
        },
        "median_forwarded_pps": median,
        "program_ns_per_frame": cost_ns,
        "ratio_hpclb_to_reflect": (
            median["hpclb"] / median["reflect"] if median["reflect"] else None
        ),
        "trials": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("median_forwarded_pps", "ratio_hpclb_to_reflect",
                                             "program_ns_per_frame")},
                     indent=1))
    print(f"written to {out}")
    return 0
