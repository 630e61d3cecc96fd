"""``python -m hpclb.provision {gateway,node,client,prepare}``.

appliance/provision.sh runs this after its bash steps (packages, the tree in
/opt/hpclb, the build) and passes their change count (``--prior-changes``) so
that the summary line counts everything. Exit 0 (done, or nothing to do), 1
(an error: nothing changed when it was found before applying), 2 (usage),
3 (refused: nothing changed).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hpclb.provision.plan import (
    EXIT_ERROR,
    EXIT_OK,
    EXIT_REFUSED,
    Action,
    Context,
    ProvisionError,
    ProvisionRefused,
    run_plan,
)

#: The source tree this package runs from (provision.sh passes --src).
SOURCE = Path(__file__).resolve().parents[3]
DEFAULT_GATEWAY_EXAMPLE = "appliance/examples/gateway.yaml"


def _csv(text: str) -> list[str]:
    return [p for p in text.split(",") if p]


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", type=Path, default=Path("/"),
                   help="provision this directory tree instead of / (nothing live is done)")
    p.add_argument("--check", action="store_true",
                   help="print what would change, change nothing")
    p.add_argument("--src", type=Path, default=SOURCE,
                   help="the hpclb source tree (units, examples); default: this one")
    p.add_argument("--prior-changes", type=int, default=0, metavar="N",
                   help="changes already made by provision.sh's own steps")
    p.add_argument("--keys-dir", type=Path, default=None,
                   help="directory where gateway and nodes exchange public CURVE keys")
    p.add_argument("--name", default=None,
                   help="appliance or node name (default: the host name)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hpclb.provision",
                                description="provision an hpclb gateway, node or client")
    sub = p.add_subparsers(dest="role", required=True)

    g = sub.add_parser("gateway", help="the appliance")
    _common(g)
    g.add_argument("--config", type=Path, default=None,
                   help=f"the example to make /etc/hpclb/hpclb.yaml from "
                        f"(default: {DEFAULT_GATEWAY_EXAMPLE})")
    g.add_argument("--dataplane", choices=["xdp", "dpdk", "auto"], default=None)
    g.add_argument("--ingress", default=None, metavar="IF")
    g.add_argument("--egress", type=_csv, default=None, metavar="IF[,IF]")
    g.add_argument("--management", default=None, metavar="IF",
                   help="the management NIC (never a data port, never bound to vfio-pci)")
    g.add_argument("--management-address", default=None, metavar="A")
    g.add_argument("--hugepages-mb", type=int, default=None, metavar="N")
    g.add_argument("--sysfs", type=Path, default=None,
                   help="read host facts from this tree instead of /sys (tests)")
    g.add_argument("--host-facts", action="store_true",
                   help="with --root: this host's facts (/sys, the current network "
                        "namespace's NICs) stand for the target's")

    for role, what in (("node", "a backend node (hpclb-agent, DSR sysctls)"),
                       ("client", "a client machine (routes to the VIPs, load tools)")):
        r = sub.add_parser(role, help=what)
        _common(r)
        r.add_argument("--config", type=Path, required=True,
                       help="the gateway's configuration or example (VIPs, telemetry)")
        r.add_argument("--gateway", default=None, metavar="ADDR",
                       help="the appliance's address (telemetry for a node, the VIPs' "
                            "next hop for a client)")

    pr = sub.add_parser("prepare", help="the boot-time host preparation (hpclb-prepare.service)")
    pr.add_argument("-c", "--config", type=Path, default=Path("/etc/hpclb/hpclb.yaml"))
    pr.add_argument("--check", action="store_true")
    pr.add_argument("--sysfs", type=Path, default=None)
    pr.add_argument("--management", default=None, metavar="IF",
                    help="the management NIC (never bound to vfio-pci)")
    return p


def context(args: argparse.Namespace, out: Callable[[str], None] = print) -> Context:
    root = Path(getattr(args, "root", Path("/"))).resolve()
    src = Path(getattr(args, "src", SOURCE)).resolve()
    return Context(root=root, live=root == Path("/"), check=args.check, src=src, out=out)


def _gateway(ctx: Context, args: argparse.Namespace) -> list[Action]:
    from hpclb.provision import gateway

    opts = gateway.GatewayOptions(
        config=args.config or ctx.src / DEFAULT_GATEWAY_EXAMPLE, name=args.name,
        dataplane=args.dataplane, ingress=args.ingress, egress=args.egress,
        management=args.management, management_address=args.management_address,
        hugepages_mb=args.hugepages_mb, keys_dir=args.keys_dir, sysfs=args.sysfs,
        host_facts=args.host_facts)
    return gateway.plan(ctx, opts)


def _role_module(name: str) -> Any:
    """node.py / client.py (the node and client plans)."""
    try:
        return importlib.import_module(f"hpclb.provision.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"hpclb.provision.{name}":
            raise
        raise ProvisionError(f"the {name} role is not available in this release") from None


def _node(ctx: Context, args: argparse.Namespace) -> list[Action]:
    mod = _role_module("node")
    opts = mod.NodeOptions(name=args.name or _short_host(ctx), config=args.config,
                           gateway=args.gateway, keys_dir=args.keys_dir)
    return list(mod.plan(ctx, opts))


def _client(ctx: Context, args: argparse.Namespace) -> list[Action]:
    mod = _role_module("client")
    opts = mod.ClientOptions(config=args.config, gateway=args.gateway)
    return list(mod.plan(ctx, opts))


def _prepare(ctx: Context, args: argparse.Namespace) -> list[Action]:
    mod = _role_module("prepare")
    return list(mod.plan(ctx, args.config, sysfs=args.sysfs, management=args.management))


def _short_host(ctx: Context) -> str:
    from hpclb.provision.gateway import host_name

    return host_name(ctx, None)


PLANS: dict[str, Callable[[Context, argparse.Namespace], list[Action]]] = {
    "gateway": _gateway, "node": _node, "client": _client, "prepare": _prepare,
}


def main(argv: Sequence[str] | None = None, out: Callable[[str], None] = print) -> int:
    args = parser().parse_args(argv)
    ctx = context(args, out)  # prepare has no --root: always the running system
    try:
        actions = PLANS[args.role](ctx, args)
        run_plan(actions, ctx, getattr(args, "prior_changes", 0))
    except ProvisionRefused as err:
        print(f"provision: refused: {err}", file=sys.stderr)
        print("provision: nothing was changed", file=sys.stderr)
        return EXIT_REFUSED
    except ProvisionError as err:
        print(f"provision: error: {err}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK
