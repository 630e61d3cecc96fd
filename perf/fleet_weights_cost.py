#!/usr/bin/env python3
"""What a fleet's weights cost the control plane: one telemetry sample taken by
:class:`hpclb.balancing.fleet_weights.FleetWeightTracker` (the weight replayed
over the node's last ``window`` samples) against
:class:`hpclb.balancing.weights.WeightTracker` (one EWMA step), at 1,000 nodes.

Each node's stream is a wandering load with a sample every 5 s; the fleet
tracker's windows are filled first, then every node's next samples are timed.
The share of a core assumes a heartbeat every ``--interval`` seconds from every
node. Writes JSON (``--output``); a measurement, never a test assertion.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

from hpclb.balancing.fleet_weights import FleetWeightTracker
from hpclb.balancing.weights import NodeSample, WeightTracker
from hpclb.config.weights import WeightPolicy

T0 = 1_700_000_000.0


def node_stream(rng: random.Random, node: str, n: int, interval_s: float) -> list[NodeSample]:
    """n samples of one node, ``interval_s`` apart, the CPU load wandering."""
    out, cpu = [], rng.random()
    for seq in range(n):
        cpu = min(max(cpu + rng.uniform(-0.2, 0.2), 0.0), 1.0)
        out.append(NodeSample(node=node, time=T0 + seq * interval_s, cpu_load=cpu,
                              mem_used=rng.uniform(0, 8), mem_total=8.0,
                              rtt_ms=rng.uniform(0.05, 150.0), seq=seq,
                              interval_s=interval_s))
    return out


def per_sample_us(nodes: int, window: int, interval_s: float, seed: int) -> dict[str, float]:
    """Microseconds per sample for each tracker, one timed pass over every node."""
    rng = random.Random(seed)
    streams = [node_stream(rng, f"n{i:04d}", 2 * window, interval_s) for i in range(nodes)]
    policy = WeightPolicy()
    fleet = FleetWeightTracker(policy, window)
    for s in (s for st in streams for s in st[:window]):  # fill the windows first
        fleet.observe(s, s.time)
    start = time.perf_counter()
    for k in range(window, 2 * window):
        for st in streams:
            fleet.observe(st[k], st[k].time)
    fleet_us = (time.perf_counter() - start) / (window * nodes) * 1e6
    classic = WeightTracker(policy)
    start = time.perf_counter()
    for st in streams:
        for s in st:
            classic.observe(s, s.time)
    classic_us = (time.perf_counter() - start) / (2 * window * nodes) * 1e6
    return {"fleet_us": fleet_us, "weight_tracker_us": classic_us}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", type=Path, default=Path("results/fleet_weights_cost.json"))
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--interval", type=float, default=5.0, help="heartbeat, seconds")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=2026)
    args = ap.parse_args(argv)
    runs = [per_sample_us(args.nodes, args.window, args.interval, args.seed + r)
            for r in range(args.repeats)]
    fleet = statistics.median(r["fleet_us"] for r in runs)
    classic = statistics.median(r["weight_tracker_us"] for r in runs)
    doc: dict[str, Any] = {
        "what": "microseconds per telemetry sample taken, median over repeats; share of "
                "one core at one heartbeat per node per interval",
        "conditions": {"nodes": args.nodes, "window": args.window,
                       "interval_s": args.interval, "repeats": args.repeats,
                       "python": platform.python_version(), "machine": platform.machine(),
                       "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        "fleet_weight_tracker_us": round(fleet, 2),
        "weight_tracker_us": round(classic, 2),
        "ratio": round(fleet / classic, 2),
        "fleet_core_share_percent": round(fleet * 1e-6 * args.nodes / args.interval * 100, 3),
        "runs": runs,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"per sample: fleet {fleet:.1f} us, WeightTracker {classic:.1f} us "
          f"(x{fleet / classic:.1f}); {doc['fleet_core_share_percent']} % of a core; "
          f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
