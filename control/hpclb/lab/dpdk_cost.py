"""The DPDK worker's cycles per frame on memory-fed ports: no kernel, no veth,
no generator in the path.

hpclb-dpdk runs on one ``net_ring`` port (``--vdev net_ring0``: DPDK's ring
PMD, whose TX ring is its RX ring) fed once, before its worker starts, with
the frames of a pcap file (``--bench-frames``, dataplane/dpdk/fwd_bench.h);
from then on the same mbufs circulate, each pass through the worker's whole
path (RX burst, fwd_packet, TX burst) with no copy and no kernel. Frames for
the kernel go back out of the port (no TAP: as if one returned them at once).
The worker's telemetry (``/hpclb/workers``: cycles of the loops that moved frames, frames)
gives its cycles per frame, read as a difference between two readings taken
while it runs, so start-up and the first pass over the frames are left out.

Four cases, each in its own forwarder process, measured the same way in the
same call, rounds interleaved:

* ``macswap``: ``--bench macswap``, the worker only swaps each frame's MACs
  and sends it back (the reflector's twin, with the same RX/TX bursts and
  accounting as the forwarding loop): the floor the others are read against;
* ``flow_hit``: UDP to a DSR VIP over ``hit_flows`` flows, all pinned after
  the first pass (the counters say so: flow_hit == frames);
* ``new_flow``: UDP to the VIP over ``new_flows`` distinct flows with
  ``--bench forget-flows``, which empties the flow table (outside the timed
  loop) whenever it is half full: a flow comes round again only after
  ``new_flows`` frames, more than half the table, so a reset has always
  happened in between and every frame is a new flow in a table that is never
  full (the counters say so: flow_new == frames);
* ``not_vip``: UDP to an address that is no VIP's (passed to the kernel,
  here straight back to the port).

(An earlier version fed ``net_pcap`` with ``rx_pcap=FILE,infinite_rx=1``: that
PMD copies every frame into a fresh mbuf per burst and frees on TX, about 110
cycles per frame of its own, which buried the worker's cost.)

The frames are 64-byte UDP (60 on the wire without FCS), written by scapy.
``measure_dpdk_cost`` returns a dict (JSON-ready); ``main`` writes it to a file.
Needs root (hugepages) and the built forwarder.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from hpclb.balancing import maglev
from hpclb.contract.tables import Backend, BackendState, TableSet, Vip
from hpclb.dataplane.dpdk import find_dpdk_forwarder, reserve_hugepages
from hpclb.dataplane.push import push_tables
from hpclb.dataplane.supervisor import DataplaneProcess
from hpclb.lab import dpdk_telemetry

VIP = "198.18.1.10"
NOT_VIP = "198.18.1.99"
VIP_PORT = 80
UDP = 17
CLIENT = "198.18.0.2"
CASES = ("macswap", "flow_hit", "new_flow", "not_vip")
DEVICE = "net_ring0"
# net_ring0 made by --vdev has 1024-slot rings (1023 usable): at most that
# many frames circulate.
MAX_FRAMES = 1000
# Counters of /hpclb/stats each case reports (deltas over the timed window).
COUNTERS = ("rx", "fwd_tx", "flow_hit", "flow_new", "flow_evict", "pass_not_vip",
            "drop_no_backend", "drop_malformed", "drop_tx_error")


def udp_frames(dst: str, flows: int) -> list[bytes]:
    """``flows`` 64-byte UDP frames to ``dst``:VIP_PORT, one per source
    (address, port): distinct 5-tuples."""
    from scapy.layers.inet import IP
    from scapy.layers.inet import UDP as ScapyUDP
    from scapy.layers.l2 import Ether

    base = int(ipaddress.IPv4Address(CLIENT))
    out = []
    for i in range(flows):
        src = str(ipaddress.IPv4Address(base + i // 50000))
        out.append(bytes(Ether(src="02:00:00:00:00:02", dst="02:00:00:00:00:01")
                         / IP(src=src, dst=dst)
                         / ScapyUDP(sport=1024 + i % 50000, dport=VIP_PORT) / bytes(18)))
    return out


def write_pcap(path: Path, frames: list[bytes]) -> Path:
    from scapy.utils import wrpcap

    wrpcap(str(path), frames)
    return path


def tables(nbackends: int = 3) -> TableSet:
    """One UDP DSR VIP over ``nbackends`` backends, behind port 0."""
    t = TableSet(hash_key=bytes(range(16)), ring_size=65537)
    for i in range(nbackends):
        t.backends[i] = Backend(i, ipaddress.IPv4Address(f"198.18.2.{1 + i}"),
                                f"02:00:00:00:01:{i:02x}", BackendState.UP)
    t.vips[1] = Vip(1, ipaddress.IPv4Address(VIP), VIP_PORT, UDP)
    t.rings[1] = maglev.build_table([(i, f"b{i}", 1.0) for i in range(nbackends)], 65537)
    return t


def forwarder_argv(binary: str, pcap: Path, socket: str, file_prefix: str,
                   flow_table_size: int, bench: str | None, lcores: tuple[int, int],
                   socket_mem_mb: int) -> list[str]:
    """hpclb-dpdk on one memory-fed net_ring port (no TAP), its worker busy-polling."""
    argv = [binary, "-l", ",".join(map(str, lcores)), "--main-lcore", str(lcores[0]),
            "--in-memory", "--file-prefix", file_prefix, "-m", str(socket_mem_mb), "--no-pci",
            "--vdev", DEVICE, "--log-level", "notice",
            "--", "--port", DEVICE, "--socket", socket, "--flow-table-size",
            str(flow_table_size), "--idle-sleep-us", "0", "--bench-frames", str(pcap)]
    if bench:
        argv += ["--bench", bench]
    return argv


def worker_thread(pid: int, lcore: int) -> Path | None:
    """/proc's directory of the process's worker thread on ``lcore`` (DPDK
    names it rte-worker-N), or None."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "comm").read_text().strip() == f"rte-worker-{lcore}":
                return task
        except OSError:
            continue
    return None


def _on_cpu_ns(task: Path | None) -> int:
    """Nanoseconds the thread has run (schedstat's first field): time it was
    preempted is not in it."""
    if task is None:
        return 0
    try:
        return int((task / "schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _reading(prefix: str, task: Path | None) -> dict[str, int]:
    w = dpdk_telemetry.query(prefix, "/hpclb/workers")["worker0"]
    s = dpdk_telemetry.query(prefix, "/hpclb/stats")
    return {"frames": int(w["frames"]), "busy_cycles": int(w["busy_cycles"]),
            "on_cpu_ns": _on_cpu_ns(task),
            "busy_loops": int(w["busy_loops"]), "total_cycles": int(w["total_cycles"]),
            "tsc_hz": int(s["tsc_hz"]), **{k: int(s.get(k, 0)) for k in COUNTERS}}


def run_case(case: str, pcap: Path, workdir: Path, seconds: float, warmup_s: float,
             flow_table_size: int, lcores: tuple[int, int], socket_mem_mb: int,
             binary: str, worker_nice: int | None = 0) -> dict[str, Any]:
    """One forwarder process fed ``pcap``: cycles per frame over ``seconds``
    after ``warmup_s``, and the counters' deltas over the same window."""
    prefix = f"hcost-{uuid.uuid4().hex[:8]}"
    socket = f"ipc://{workdir}/{prefix}.sock"
    bench = {"macswap": "macswap", "new_flow": "forget-flows"}.get(case)
    argv = forwarder_argv(binary, pcap, socket, prefix, flow_table_size, bench, lcores,
                          socket_mem_mb)
    dp = DataplaneProcess(argv=argv, endpoint=socket, pidfile=workdir / f"{prefix}.pid",
                          log_path=workdir / f"{prefix}.log")
    dp.start()
    try:
        task = worker_thread(dp.pid, lcores[1]) if dp.pid else None
        if task is not None and worker_nice is not None:
            # The worker alone, as on an appliance: a caller started under
            # nice (a shared build box) would otherwise hand it on.
            os.setpriority(os.PRIO_PROCESS, int(task.name), worker_nice)
        push_tables(dp.client, None, tables())
        time.sleep(warmup_s)
        a = _reading(prefix, task)
        time.sleep(seconds)
        b = _reading(prefix, task)
    finally:
        dp.stop()
    d = {k: b[k] - a[k] for k in a if k != "tsc_hz"}
    frames = max(d["frames"], 1)
    return {
        "cycles_per_frame": d["busy_cycles"] / frames,
        # The worker's time on the CPU per frame, in TSC cycles: free of the
        # time it was preempted (busy_cycles are wall-clock TSC and count
        # it), though it includes its loops that moved nothing.
        "on_cpu_cycles_per_frame": (d["on_cpu_ns"] * a["tsc_hz"] / 1e9 / frames
                                    if task is not None else None),
        "ns_per_frame": d["busy_cycles"] / frames / a["tsc_hz"] * 1e9,
        "frames": d["frames"],
        "frames_per_busy_loop": d["frames"] / max(d["busy_loops"], 1),
        "busy_share": d["busy_cycles"] / max(d["total_cycles"], 1),
        "mpps": d["frames"] / seconds / 1e6,
        "counters": {k: d[k] for k in COUNTERS},
        "tsc_hz": a["tsc_hz"],
    }


def _conditions(lcores: tuple[int, int], seconds: float, rounds: int, flow_table_size: int,
                hit_flows: int, new_flows: int) -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    dpdk = subprocess.run(["pkg-config", "--modversion", "libdpdk"], capture_output=True,
                          text=True, check=False).stdout.strip()
    return {
        "kernel": platform.release(), "cpu": cpu, "dpdk": dpdk or "unknown",
        "port": f"{DEVICE} (--vdev {DEVICE}: TX ring is the RX ring), fed once with the "
                "frames (--bench-frames), which circulate; no TAP (kernel frames go back "
                "out of the port)",
        "lcores": {"main": lcores[0], "worker": lcores[1]}, "idle_sleep_us": 0,
        "frame_bytes": 60, "seconds_per_reading": seconds, "rounds": rounds,
        "flow_table_size": flow_table_size, "hit_flows": hit_flows, "new_flows": new_flows,
        "new_flow_method": "--bench forget-flows: the table is emptied outside the timed "
                           "loop whenever half full; new_flows > half the table, so a flow "
                           "never comes round to a table that still holds it",
        "vip": f"{VIP}:{VIP_PORT}/udp DSR, 3 backends, ring 65537",
        "statistic": "median (and min) over rounds of busy_cycles/frames between two "
                     "telemetry readings; on_cpu: the worker thread's run time "
                     "(/proc/.../schedstat) per frame in TSC cycles, free of preemption",
    }


def measure_dpdk_cost(seconds: float = 2.0, rounds: int = 3, warmup_s: float = 0.5,
                      flow_table_size: int = 1024, hit_flows: int = 512,
                      new_flows: int = 1000, lcores: tuple[int, int] = (0, 1),
                      socket_mem_mb: int = 256, cases: tuple[str, ...] = CASES,
                      binary: str | None = None, worker_nice: int | None = 0
                      ) -> dict[str, Any]:
    """Cycles per frame of the DPDK worker for each case in ``cases`` (see the
    module doc), rounds interleaved, medians, and each case's cycles above
    ``macswap`` and ratio to it when it was measured."""
    if new_flows <= flow_table_size // 2 + 32:
        raise ValueError("new_flows must exceed half the flow table (plus a burst) for "
                         "every frame to be a new flow")
    if max(hit_flows, new_flows) > MAX_FRAMES:
        raise ValueError(f"at most {MAX_FRAMES} frames circulate on {DEVICE}")
    if any(c not in CASES for c in cases):
        raise ValueError(f"cases must be among {CASES}")
    binary = binary or find_dpdk_forwarder()
    if reserve_hugepages(socket_mem_mb) < socket_mem_mb:
        raise RuntimeError(f"cannot reserve {socket_mem_mb} MB of hugepages")
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in cases}
    with tempfile.TemporaryDirectory(prefix="hpclb-dpdk-cost-") as tmp:
        workdir = Path(tmp)
        pcaps = {
            "macswap": write_pcap(workdir / "hit.pcap", udp_frames(VIP, hit_flows)),
            "new_flow": write_pcap(workdir / "new.pcap", udp_frames(VIP, new_flows)),
            "not_vip": write_pcap(workdir / "pass.pcap", udp_frames(NOT_VIP, hit_flows)),
        }
        pcaps["flow_hit"] = pcaps["macswap"]  # the same frames: only the worker differs
        for _ in range(rounds):
            for case in cases:
                runs[case].append(run_case(case, pcaps[case], workdir, seconds, warmup_s,
                                           flow_table_size, lcores, socket_mem_mb, binary,
                                           worker_nice))
    result: dict[str, Any] = {
        "conditions": {**_conditions(lcores, seconds, rounds, flow_table_size, hit_flows,
                                     new_flows), "worker_nice": worker_nice,
                       "binary": binary},
        "cases": {},
    }
    for case in cases:
        cpf = [r["cycles_per_frame"] for r in runs[case]]
        on_cpu = [r["on_cpu_cycles_per_frame"] for r in runs[case]
                  if r["on_cpu_cycles_per_frame"] is not None]
        result["cases"][case] = {
            "cycles_per_frame": statistics.median(cpf),
            "cycles_per_frame_min": min(cpf),
            "on_cpu_cycles_per_frame": statistics.median(on_cpu) if on_cpu else None,
            "ns_per_frame": statistics.median(r["ns_per_frame"] for r in runs[case]),
            "cycles_per_frame_runs": cpf,
            "runs": runs[case],
        }
    if "macswap" in result["cases"]:
        floor = result["cases"]["macswap"]["cycles_per_frame"]
        for row in result["cases"].values():
            row["over_macswap_cycles"] = row["cycles_per_frame"] - floor
            row["ratio_to_macswap"] = row["cycles_per_frame"] / floor if floor else None
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("dpdk-cost.json"))
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--flow-table-size", type=int, default=1024)
    ap.add_argument("--hit-flows", type=int, default=512)
    ap.add_argument("--new-flows", type=int, default=1000)
    ap.add_argument("--worker-cpu", type=int, default=1)
    ap.add_argument("--main-cpu", type=int, default=0)
    ap.add_argument("--binary", default=None, help="hpclb-dpdk to measure (default: installed)")
    args = ap.parse_args(argv)
    result = measure_dpdk_cost(seconds=args.seconds, rounds=args.rounds,
                               flow_table_size=args.flow_table_size, hit_flows=args.hit_flows,
                               new_flows=args.new_flows,
                               lcores=(args.main_cpu, args.worker_cpu), binary=args.binary)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for case, row in result["cases"].items():
        print(f"{case:9s} {row['cycles_per_frame']:8.1f} cycles/frame (min "
              f"{row['cycles_per_frame_min']:.1f}, on-CPU {row['on_cpu_cycles_per_frame']}) "
              f"{row['ns_per_frame']:7.1f} ns")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
