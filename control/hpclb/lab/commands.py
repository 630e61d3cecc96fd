"""The lab's commands of `hpclb`: the demo and the bench."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

DEFAULT_OUT = {"dsr": Path("results/bench.json"), "nat": Path("results/bench_nat.json")}
DEFAULT_CONTROL_OUT = Path("results/bench_control.json")
DEFAULT_CPS_SECONDS = 2.0


def _cmd_demo(args: argparse.Namespace) -> int:
    from hpclb.lab.demo import run_demo

    return run_demo(connections=args.connections, dataplane=args.dataplane, mode=args.mode,
                    ipv6=args.ipv6)


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "control":
        return _cmd_bench_control(args)
    out = args.out or DEFAULT_OUT[args.mode]
    if args.mode == "nat":
        if args.generator != "trafgen" or args.peers or args.coupled:
            raise SystemExit("hpclb bench --mode nat: trafgen only; --generator, --peers "
                             "and --coupled go with --mode dsr")
        from hpclb.lab.nat_bench import ALL_KINDS, run_nat_bench

        kinds = args.kinds.split(",") if args.kinds else ALL_KINDS
        return run_nat_bench(out=out, seconds=args.seconds, trials=args.trials,
                             flows=args.flows, ndr_steps=args.ndr_steps, kinds=kinds,
                             cps_seconds=args.cps_seconds, memory=not args.no_memory)
    if args.kinds or args.no_memory:
        raise SystemExit("hpclb bench: --kinds and --no-memory go with --mode nat")
    if args.generator == "trafgen" and (args.trex_server or args.trex_dir):
        raise SystemExit("hpclb bench: --trex-server and --trex-dir go with --generator trex")
    from hpclb.lab.bench import ALL_SUBJECTS, run_bench

    peers = tuple(p.strip() for p in args.peers.split(",") if p.strip()) if args.peers else None
    if peers and (unknown := sorted(set(peers) - set(ALL_SUBJECTS))):
        raise SystemExit(f"hpclb bench: unknown --peers {', '.join(unknown)}; known: "
                         f"{', '.join(ALL_SUBJECTS)}")
    trex_dir = args.trex_dir or os.environ.get("HPCLB_TREX_DIR") or None
    return run_bench(out=out, seconds=args.seconds, trials=args.trials, flows=args.flows,
                     ndr_steps=args.ndr_steps, pdr_loss=args.pdr_loss,
                     generator=args.generator, trex_server=args.trex_server,
                     trex_dir=Path(trex_dir) if trex_dir else None, peers=peers,
                     coupled=args.coupled, latency=args.latency, prefix=args.lab_prefix,
                     progress=not args.no_progress, cps_seconds=args.cps_seconds)


def _cmd_bench_control(args: argparse.Namespace) -> int:
    """`hpclb bench control`: the control plane's benchmarks (hpclb.lab.control_bench)."""
    try:
        from hpclb.lab.control_bench import run_control_bench
    except ImportError as err:
        raise SystemExit(f"hpclb bench control: not in this tree ({err})") from err
    parts = [x.strip() for x in args.parts.split(",") if x.strip()] if args.parts else None
    try:
        sizes = ([int(x) for x in args.sizes.split(",") if x.strip()] if args.sizes
                 else None)
        return run_control_bench(args.out or DEFAULT_CONTROL_OUT, quick=args.quick,
                                 progress=not args.no_progress, parts=parts, sizes=sizes)
    except (TypeError, ValueError) as err:
        raise SystemExit(f"hpclb bench control: {err}") from None


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

    p = sub.add_parser(
        "bench", help="forwarding benchmark in the lab (or `bench control`: the control "
                      "plane's), writes JSON, plots and a Markdown summary")
    p.add_argument("what", nargs="?", choices=["forwarding", "control"], default="forwarding",
                   help="forwarding (default): packet rates, latency and connections/s of "
                        "the data planes and their peers; control: Maglev build time, "
                        "slots moved, reaction time, probe scale, configuration load")
    p.add_argument("--mode", choices=["dsr", "nat"], default="dsr",
                   help="dsr: the subjects (--peers) on one LAN against an XDP reflector; "
                        "nat: NAT gateway mode on the two-network lab against DSR on the same "
                        "lab and against the kernel's routing and nftables NAT: packets/s, "
                        "connections/s (TCP SYN flood), connection-table memory per entry")
    p.add_argument("--out", type=Path, default=None,
                   help="default: results/bench.json (dsr), results/bench_nat.json (nat), "
                        "results/bench_control.json (control); <out>.md and PNGs beside it")
    p.add_argument("--seconds", type=float, default=4.0, help="length of one trial")
    p.add_argument("--trials", type=int, default=3,
                   help="rounds: each subject gets a line-rate trial per round")
    p.add_argument("--flows", type=int, default=50000, help="distinct UDP source ports, 1..64000")
    p.add_argument("--ndr-steps", type=int, default=6,
                   help="binary-search trials of the no-drop/partial-drop rate search after "
                        "the line-rate trial (0: line rate only)")
    p.add_argument("--pdr-loss", type=float, default=0.005,
                   help="the partial-drop rate's loss bound, a share of the offered frames "
                        "(default 0.005: 0.5%%)")
    p.add_argument("--generator", choices=["trafgen", "trex"], default="trafgen",
                   help="trafgen in the client namespace, or a TRex server (hpclb.lab.trex)")
    p.add_argument("--trex-server", default=None, metavar="HOST",
                   help="--generator trex: a TRex server already running on real hardware, "
                        "instead of starting one on the lab")
    p.add_argument("--trex-dir", default=None, metavar="PATH",
                   help="--generator trex: a built TRex tree (default: $HPCLB_TREX_DIR)")
    p.add_argument("--peers", default=None,
                   help="comma-separated subjects among reflect, xdp, dpdk, xdp_ipv6, "
                        "xdp_tunnel, dpdk_ipv6, dpdk_tunnel, nftables_dnat, haproxy_tcp, ipvs "
                        "(default: all; the reflector always runs; one that cannot run here "
                        "is reported with the reason)")
    p.add_argument("--coupled", action="store_true",
                   help="trafgen and the whole path on one core (no threaded NAPI): the "
                        "shared-core testbed, for the marginal cost per packet over the "
                        "reflector; default: the path's NAPI on its own core")
    p.add_argument("--latency", action=argparse.BooleanOptionalAction, default=True,
                   help="--generator trex: a latency stream beside the load")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--quick", action="store_true", help="bench control: small sizes")
    p.add_argument("--parts", default=None,
                   help="bench control: comma-separated subset of maglev, slots, reaction, "
                        "probes, config (default: all)")
    p.add_argument("--sizes", default=None,
                   help="bench control: backend counts for the build-time and slots parts "
                        "(default 10,30,100,300,1000,3000,10000)")
    p.add_argument("--lab-prefix", default=None, help=argparse.SUPPRESS)
    p.add_argument("--kinds", default=None,
                   help="--mode nat: comma-separated subset of route, nftables, "
                        "nftables_masq, xdp, dpdk, dsr_xdp, dsr_dpdk (default: all; a data "
                        "plane that cannot run a mode is skipped and says why)")
    p.add_argument("--cps-seconds", type=float, default=DEFAULT_CPS_SECONDS,
                   help="seconds of each connections/s trial (dsr: TCP connections through "
                        "xdp, dpdk, nftables DNAT, HAProxy; nat: the SYN flood); 0: none")
    p.add_argument("--no-memory", action="store_true",
                   help="--mode nat: skip the connection tables' memory per entry")
    p.set_defaults(func=_cmd_bench)
