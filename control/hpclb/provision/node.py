"""The node's plan: a backend of the appliance (``provision.sh --role node``).

In order: the agent's CURVE keys (its own pair, the gateway's public key), its
settings (/etc/default/hpclb-agent: where to publish), the test server's
settings (/etc/default/hpclb-testserver: the VIPs' port), the DSR VIPs on
loopback (persistently, an ifupdown stanza: Debian 12's own network setup and
the one Vagrant's Debian boxes use; now, with ``ip``), the sysctls DSR needs on a
backend (:mod:`hpclb.provision.sysctls`), then the units (hpclb-agent and
hpclb-testserver), installed, enabled and started where systemd runs.

A node of NAT VIPs only gets no VIP on lo and no ARP settings (its test server
answers the backend port); its route back through the gateway is the
operator's network's, not set up here.

The tree in /opt/hpclb and its virtual environment are provision.sh's steps,
as for every role. What the node needs to know comes from the gateway's
configuration (``--config``: the VIPs, their ports, the telemetry endpoint);
``--gateway`` overrides the telemetry address (the gateway's management
address when the configuration binds something else).
"""

from __future__ import annotations

import ipaddress
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hpclb.config import ConfigError, HpclbConfig, load_config
from hpclb.config.schema import ForwardingMode, VipProtocol
from hpclb.provision.actions import (
    EnableUnit,
    ReloadUnits,
    RunLive,
    StartUnit,
    WriteFile,
    systemd_running,
)
from hpclb.provision.keys import CurveKeypair, ExportFile
from hpclb.provision.plan import Action, BaseAction, Context, Note, ProvisionError

CURVE_DIR = "/etc/hpclb/curve"
AGENT_DEFAULTS = "/etc/default/hpclb-agent"
TESTSERVER_DEFAULTS = "/etc/default/hpclb-testserver"
INTERFACES = "/etc/network/interfaces"
VIP_STANZA = "/etc/network/interfaces.d/60-hpclb-vips"
UNIT_DIR = "/etc/systemd/system"
NODE_UNITS = ("hpclb-agent.service", "hpclb-testserver.service")
DEFAULT_TELEMETRY_PORT = 5557
#: A line of /etc/network/interfaces that reads the stanzas of interfaces.d.
_SOURCES_D = re.compile(r"^\s*source(-directory)?\s+/etc/network/interfaces\.d(/\*|/)?\s*$",
                        re.MULTILINE)


@dataclass(frozen=True)
class NodeOptions:
    """provision.sh's flags for --role node."""

    name: str  # the node id: the short host name (hpclb-agent.service runs --node-id %l)
    config: Path  # the gateway's configuration (or the example it is made from)
    gateway: str | None = None  # the telemetry address; default: the configuration's
    keys_dir: Path | None = None  # where the keys are exchanged with the gateway


def read_config(path: Path) -> HpclbConfig:
    try:
        return load_config(path)
    except (OSError, ConfigError) as err:
        raise ProvisionError(f"--config {path}: {err}") from None


def dsr_vips(config: HpclbConfig) -> list[str]:
    """The addresses a DSR backend holds on loopback (tunnel backends too: they
    answer from the VIP after decapsulation), each once, in order."""
    modes = (ForwardingMode.DSR, ForwardingMode.TUNNEL)
    return list(dict.fromkeys(str(v.address) for v in config.vips if v.mode in modes))


def connect_endpoint(config: HpclbConfig, gateway: str | None) -> str:
    """HPCLB_CONNECT: the configuration's telemetry endpoint, its host replaced
    by ``gateway`` when given (an IPv6 address goes in brackets)."""
    tel = config.telemetry
    if tel is None:
        raise ProvisionError("the configuration has no telemetry section: a node's agent "
                             "has nowhere to publish")
    endpoint = tel.endpoint(config.appliance.management_address)
    port = int(endpoint.rpartition(":")[2]) if endpoint else DEFAULT_TELEMETRY_PORT
    host = gateway or endpoint[len("tcp://"):].rpartition(":")[0]
    if not host:
        raise ProvisionError("no telemetry address: give --gateway ADDR")
    host = host.strip("[]")
    if ":" in host:
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def agent_defaults(connect: str) -> str:
    return ("# hpclb-agent's settings (written by provision.sh --role node; see\n"
            "# /etc/systemd/system/hpclb-agent.service). The appliance's telemetry endpoint:\n"
            f"HPCLB_CONNECT={connect}\n"
            "# More options, e.g. a job's cgroup: HPCLB_AGENT_ARGS=\"--cgroup /slurm\"\n"
            "HPCLB_AGENT_ARGS=\n")


def served_ports(config: HpclbConfig) -> list[tuple[int, bool]]:
    """(port, UDP too) a backend answers on, in the configuration's order: a DSR or
    tunnel VIP's own port (the node holds the VIP), a NAT VIP's backend port (the
    gateway rewrites the destination to the backend's address and that port)."""
    out: dict[int, bool] = {}
    for v in config.vips:
        port = v.port
        if v.mode is ForwardingMode.NAT:
            port = v.backend_port or config.pools[v.pool].backend_port or v.port
        out[port] = out.get(port, False) or v.protocol is VipProtocol.UDP
    return list(out.items())


def testserver_defaults(config: HpclbConfig) -> tuple[str, list[str]]:
    """/etc/default/hpclb-testserver and the lines to say (ports it cannot serve).

    The test server answers one port (TCP, and UDP when a VIP of that port is
    UDP): the first VIP's (its backend port for a NAT VIP). Other ports are
    said, not served.
    """
    ports = served_ports(config)
    if not ports:
        raise ProvisionError("the configuration has no VIP for a node to serve")
    port, udp = ports[0]
    others = sorted(p for p, _ in ports[1:])
    notes = [f"note: the test server answers port {port} only, not {others}"] if others else []
    text = ("# hpclb-testserver's settings (written by provision.sh --role node): the port\n"
            "# of the VIPs it answers on, with this node's name (python -m hpclb.lab.node\n"
            "# server). --udp: UDP too.\n"
            f"HPCLB_TESTSERVER_PORT={port}\n"
            f"HPCLB_TESTSERVER_ARGS={'--udp' if udp else ''}\n")
    return text, notes


def vip_stanza(vips: list[str]) -> str:
    """One ifupdown stanza per VIP on ``lo``. ifupdown applies every stanza of an
    interface when it brings it up (interfaces(5): several ``iface`` stanzas may
    be given for one interface), so these add to the box's own ``iface lo inet
    loopback`` without touching it."""
    lines = ["# hpclb DSR backend (written by provision.sh --role node): the VIPs on",
             "# loopback, so that this node accepts the packets the appliance sends it",
             "# for them and answers from them. arp_ignore=1 and arp_announce=2",
             "# (/etc/sysctl.d/60-hpclb-node.conf) keep it from answering ARP for them.",
             "auto lo"]
    for vip in vips:
        v6 = ipaddress.ip_address(vip).version == 6
        lines += ["", f"iface lo {'inet6' if v6 else 'inet'} static",
                  f"    address {vip}/{128 if v6 else 32}"]
    return "\n".join(lines) + "\n"


@dataclass
class SourcesInterfacesD(BaseAction):
    """/etc/network/interfaces reads /etc/network/interfaces.d (Debian's default
    file does; an image that dropped the line gets it back, appended)."""

    what: str = f"{INTERFACES} reads /etc/network/interfaces.d"

    def pending(self, ctx: Context) -> list[str]:
        text = ctx.path(INTERFACES).read_text()
        return [] if _SOURCES_D.search(text) else ["append: source /etc/network/interfaces.d/*"]

    def apply(self, ctx: Context) -> None:
        path = ctx.path(INTERFACES)
        text = path.read_text()
        sep = "" if text.endswith("\n") or not text else "\n"
        WriteFile(INTERFACES, text + sep + "source /etc/network/interfaces.d/*\n",
                  path.stat().st_mode & 0o777).apply(ctx)


def _vip_missing(vip: str) -> Callable[[Context], str | None]:
    def needed(ctx: Context) -> str | None:
        del ctx
        proc = subprocess.run(["ip", "-o", "addr", "show", "dev", "lo"], capture_output=True,
                              text=True, check=False)
        plen = 128 if ":" in vip else 32
        return None if f" {vip}/{plen} " in proc.stdout else f"add {vip}/{plen} to lo now"
    return needed


def vip_actions(ctx: Context, vips: list[str]) -> list[Action]:
    if not vips:
        return [Note("note: no DSR or tunnel VIP: nothing on lo (a NAT backend's answers "
                     "must route back through the gateway: its default route or a route to "
                     "the clients via the gateway's cluster address, not set up here)")]
    actions: list[Action] = [WriteFile(VIP_STANZA, vip_stanza(vips), 0o644)]
    if ctx.path(INTERFACES).exists():
        actions.append(SourcesInterfacesD())
    else:
        actions.append(Note(f"note: no {INTERFACES} in this system: {VIP_STANZA} is read "
                            "only where ifupdown manages the network"))
    for vip in vips:
        plen = 128 if ":" in vip else 32
        actions.append(RunLive(["ip", "addr", "replace", f"{vip}/{plen}", "dev", "lo"],
                               _vip_missing(vip), f"VIP {vip}/{plen} on lo"))
    return actions


def key_actions(name: str, keys_dir: Path | None) -> list[Action]:
    """The agent's keypair (root-only: the unit hands it over as a credential),
    made here or installed from ``keys_dir`` when the host made it beforehand;
    its public half exported for the gateway; the gateway's public key."""
    actions: list[Action] = [CurveKeypair(CURVE_DIR, name, group="root", secret_mode=0o600,
                                          seed=keys_dir)]
    if keys_dir is None:
        actions.append(Note(f"note: no --keys-dir: copy {CURVE_DIR}/{name}.key to the "
                            "gateway's allow dir, and its server.key to "
                            f"{CURVE_DIR}/server.key here"))
        return actions
    actions.append(ExportFile(keys_dir / f"{name}.key", f"{CURVE_DIR}/{name}.key"))
    server = keys_dir / "server.key"
    if server.is_file():
        actions.append(WriteFile(f"{CURVE_DIR}/server.key", server.read_bytes(), 0o644))
    else:
        actions.append(Note(f"note: {server} is not there yet (provision the gateway "
                            "first, then this node again): the agent cannot start without it"))
    return actions


def unit_actions(ctx: Context) -> list[Action]:
    """The node's units only (not the gateway's), installed from the tree,
    enabled, and started where systemd runs; where it does not (a chroot, a
    container), a line says so and nothing is started."""
    actions: list[Action] = []
    for unit in NODE_UNITS:
        src = ctx.src / "appliance" / "systemd" / unit
        try:
            actions.append(WriteFile(f"{UNIT_DIR}/{unit}", src.read_bytes(), 0o644))
        except OSError as err:
            raise ProvisionError(f"{src}: {err.strerror}") from None
    actions += [EnableUnit(u) for u in NODE_UNITS]
    if not ctx.live or systemd_running(ctx):
        actions.append(ReloadUnits(tuple(NODE_UNITS)))  # a rewritten running unit
        actions += [StartUnit(u) for u in NODE_UNITS]  # skipped, and said so, under --root
    else:
        actions.append(Note("systemd is not running (no /run/systemd/system): the units are "
                            f"installed and enabled, not started ({', '.join(NODE_UNITS)})"))
    return actions


def sysctl_actions(config: HpclbConfig) -> list[Action]:
    """The DSR backend's sysctls, by H2's module (one file, every line commented)."""
    from hpclb.provision import sysctls

    modes = sorted({str(v.mode) for v in config.vips})
    return list(sysctls.sysctl_actions("node", sysctls.backend_sysctls(modes)))


def plan(ctx: Context, opts: NodeOptions) -> list[Action]:
    """The node's actions, computed and checked whole before any is applied."""
    config = read_config(opts.config)
    vips = dsr_vips(config)
    server_text, notes = testserver_defaults(config)
    actions: list[Action] = key_actions(opts.name, opts.keys_dir)
    actions.append(WriteFile(AGENT_DEFAULTS,
                             agent_defaults(connect_endpoint(config, opts.gateway)), 0o644))
    actions.append(WriteFile(TESTSERVER_DEFAULTS, server_text, 0o644))
    actions += [Note(n) for n in notes]
    actions += vip_actions(ctx, vips)
    actions += sysctl_actions(config)
    if opts.name not in {b.name for p in config.pools.values() for b in p.backends}:
        actions.append(Note(f"note: {opts.name} is no backend of the configuration: the "
                            "gateway will refuse its agent's telemetry"))
    actions += unit_actions(ctx)
    return actions
