"""The lab's commands of `hpclb`: the demo and the bench."""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_OUT = {"dsr": Path("results/bench.json"), "nat": Path("results/bench_nat.json")}
DEFAULT_CPS_SECONDS = 2.0


def _cmd_demo(args: argparse.Namespace) -> int:
    from hpclb.lab.demo import run_demo

    return run_demo(connections=args.connections, dataplane=args.dataplane, mode=args.mode,
                    ipv6=args.ipv6)


def _cmd_bench(args: argparse.Namespace) -> int:
    out = args.out or DEFAULT_OUT[args.mode]
    if args.mode == "nat":
        from hpclb.lab.nat_bench import ALL_KINDS, run_nat_bench

        kinds = args.kinds.split(",") if args.kinds else ALL_KINDS
        return run_nat_bench(out=out, seconds=args.seconds, trials=args.trials,
                             flows=args.flows, ndr_steps=args.ndr_steps, kinds=kinds,
                             cps_seconds=args.cps_seconds, memory=not args.no_memory)
    if args.kinds or args.cps_seconds != DEFAULT_CPS_SECONDS or args.no_memory:
        raise SystemExit("hpclb bench: --kinds, --cps-seconds and --no-memory go with "
                         "--mode nat")
    from hpclb.lab.bench import run_bench

    return run_bench(out=out, seconds=args.seconds, trials=args.trials, flows=args.flows,
                     ndr_steps=args.ndr_steps)


def add_lab_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="the lab demo on network namespaces")
    p.add_argument("--connections", type=int, default=600)
    p.add_argument("--dataplane", choices=["xdp", "dpdk"], default="xdp")
    p.add_argument("--mode", choices=["dsr", "nat", "tunnel"], default="dsr",
                   help="dsr: one LAN, backends answer the client directly; nat: the "
                        "appliance as the gateway between a client and a cluster network; "
                        "tunnel: backends behind a router, reached through IPIP (GUE over "
                        "IPv6 with --ipv6), decapsulating with an XDP program")
    p.add_argument("--ipv6", action="store_true",
                   help="dual stack: an IPv6 VIP beside the IPv4 one (dsr: the shares are "
                        "measured on it; nat: the same through an IPv6 NAT VIP to the "
                        "backends' cluster-side IPv6 addresses; tunnel: GUE over IPv6 to "
                        "IPv6 backends)")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("bench", help="forwarding benchmark in the lab, writes JSON")
    p.add_argument("--mode", choices=["dsr", "nat"], default="dsr",
                   help="dsr: both data planes against an XDP reflector on one LAN; nat: "
                        "NAT gateway mode on the two-network lab against DSR on the same "
                        "lab and against the kernel's routing and nftables NAT: packets/s, "
                        "connections/s (TCP SYN flood), connection-table memory per entry")
    p.add_argument("--out", type=Path, default=None,
                   help="default: results/bench.json (dsr), results/bench_nat.json (nat)")
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--flows", type=int, default=50000, help="distinct UDP source ports, 1..64000")
    p.add_argument("--ndr-steps", type=int, default=6,
                   help="binary-search steps of the no-drop-rate search (0: full speed only)")
    p.add_argument("--kinds", default=None,
                   help="--mode nat: comma-separated subset of route, nftables, "
                        "nftables_masq, xdp, dpdk, dsr_xdp, dsr_dpdk (default: all; a data "
                        "plane that cannot run a mode is skipped and says why)")
    p.add_argument("--cps-seconds", type=float, default=DEFAULT_CPS_SECONDS,
                   help="--mode nat: seconds of each SYN-flood trial of the connections/s "
                        "phase (nftables, xdp, dpdk among --kinds; 0: no such phase)")
    p.add_argument("--no-memory", action="store_true",
                   help="--mode nat: skip the connection tables' memory per entry")
    p.set_defaults(func=_cmd_bench)
