"""The client's plan: a load client in front of the appliance (``provision.sh
--role client``).

Its packages (the load tools: ping, curl, trafgen from netsniff-ng, tcpdump)
and the hpclb tree with its virtual environment (``python -m hpclb.lab.node
client|stream``, the lab's load programs) are provision.sh's steps. Here: every
VIP of the configuration routed via the appliance's ingress address
(``--gateway``), now and at every interface's start (an ifupdown hook, as
Debian 12 and Vagrant's Debian boxes set up their network with ifupdown), and a
``hpclb-load`` command that runs the lab's client against the first VIP.
"""

from __future__ import annotations

import ipaddress
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hpclb.provision.actions import RunLive, WriteFile
from hpclb.provision.node import read_config
from hpclb.provision.plan import Action, Context, Note, ProvisionError

ROUTE_HOOK = "/etc/network/if-up.d/hpclb-vip-routes"
LOAD_COMMAND = "/usr/local/bin/hpclb-load"


@dataclass(frozen=True)
class ClientOptions:
    """provision.sh's flags for --role client."""

    config: Path  # the gateway's configuration (the VIPs)
    gateway: str | None = None  # the appliance's ingress address: the VIPs' next hop


def route_hook(routes: list[tuple[str, str]]) -> str:
    """An ifupdown if-up.d hook: run for every interface brought up; a route whose
    next hop is not on a network that is up yet fails quietly and is made when
    that interface comes up."""
    lines = ["#!/bin/sh",
             "# hpclb client (written by provision.sh --role client): the VIPs are",
             "# routed via the appliance's ingress address. ifupdown runs this for",
             "# every interface it brings up.",
             "# Not 'set -e': a next hop on a network that is not up yet is expected."]
    for dst, via in routes:
        lines.append(f"ip route replace {dst} via {via} 2>/dev/null || true")
    lines.append("exit 0")
    return "\n".join(lines) + "\n"


def load_script(vip: str, port: int, udp: bool) -> str:
    return ("#!/bin/sh\n"
            "# hpclb client: N short connections to the VIP, counts per backend (the\n"
            "# lab's load client, python -m hpclb.lab.node client). More options: -h.\n"
            "# Written by provision.sh --role client.\n"
            "exec /opt/hpclb/.venv/bin/python -m hpclb.lab.node client "
            f"--vip {vip} --port {port}{' --udp' if udp else ''} \"$@\"\n")


def _route_missing(dst: str, via: str) -> Callable[[Context], str | None]:
    def needed(ctx: Context) -> str | None:
        del ctx
        family = "-6" if ":" in dst else "-4"
        proc = subprocess.run(["ip", family, "route", "show", dst], capture_output=True,
                              text=True, check=False)
        return None if f"via {via} " in proc.stdout + " " else f"route {dst} via {via} now"
    return needed


def plan(ctx: Context, opts: ClientOptions) -> list[Action]:
    config = read_config(opts.config)
    vips = list(dict.fromkeys(str(v.address) for v in config.vips))
    if not vips:
        raise ProvisionError(f"--config {opts.config}: no VIP")
    actions: list[Action] = []
    if opts.gateway is None:
        actions.append(Note("note: no --gateway: the VIPs are left to this host's routes"))
    else:
        via = str(ipaddress.ip_address(opts.gateway))
        routes = [(f"{v}/{128 if ':' in v else 32}", via) for v in vips
                  if (":" in v) == (":" in via)]
        actions.append(WriteFile(ROUTE_HOOK, route_hook(routes), 0o755))
        actions += [RunLive(["ip", "route", "replace", dst, "via", hop], _route_missing(dst, hop),
                            f"route {dst} via {hop}") for dst, hop in routes]
    first = config.vips[0]
    udp = first.protocol == "udp"  # a TCP VIP's port may serve UDP too: TCP is the test
    actions.append(WriteFile(LOAD_COMMAND, load_script(str(first.address), first.port, udp),
                             0o755))
    return actions
