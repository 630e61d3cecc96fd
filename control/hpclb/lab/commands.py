"""The lab's commands of `hpclb`: the demo and the bench."""

from __future__ import annotations

import argparse
from pathlib import Path


def _cmd_demo(args: argparse.Namespace) -> int:
    from hpclb.lab.demo import run_demo

    return run_demo(connections=args.connections, dataplane=args.dataplane)


def _cmd_bench(args: argparse.Namespace) -> int:
    from hpclb.lab.bench import run_bench

    return run_bench(out=args.out, seconds=args.seconds, trials=args.trials, flows=args.flows,
                     ndr_steps=args.ndr_steps)


def add_lab_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="the lab demo on network namespaces")
    p.add_argument("--connections", type=int, default=600)
    p.add_argument("--dataplane", choices=["xdp", "dpdk"], default="xdp")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("bench", help="forwarding benchmark in the lab, writes JSON")
    p.add_argument("--out", type=Path, default=Path("results/bench.json"))
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--flows", type=int, default=50000, help="distinct UDP source ports, 1..64000")
    p.add_argument("--ndr-steps", type=int, default=6,
                   help="binary-search steps of the no-drop-rate search (0: full speed only)")
    p.set_defaults(func=_cmd_bench)
