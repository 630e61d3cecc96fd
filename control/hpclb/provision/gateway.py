"""The gateway's plan: the appliance itself.

In order: the ``hpclb`` user (sysusers), its directories (tmpfiles), the
configuration from an example (only when there is none: an existing one is
the operator's and is kept), the CURVE keys, the host's part (hugepages,
sysctls, NIC binding, cores: :mod:`hpclb.provision.hugepages` and its
siblings), ``hpclb`` on PATH, and last the systemd units, installed and
enabled, then started where systemd runs (where it does not, the plan says so
and stops there).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hpclb.announce import vrrp
from hpclb.config import parse_config
from hpclb.config.vrrp import CHECK_SCRIPT, KEEPALIVED_CONF
from hpclb.provision import cores, hostfacts, hugepages, nics, sysctls
from hpclb.provision.actions import (
    EnableUnit,
    ReloadUnits,
    StartUnit,
    Symlink,
    Sysusers,
    Tmpfiles,
    WriteFile,
    systemd_running,
)
from hpclb.provision.keys import server_keys
from hpclb.provision.plan import Action, Context, Note, ProvisionError
from hpclb.provision.render import (
    CONFIG,
    ConfigInputs,
    check_config,
    new_hash_key,
    render_config,
    template,
)

#: Where units are installed: the administrator's directory, as for any
#: software not installed by the package manager (a drop-in still overrides).
UNIT_DIR = "/etc/systemd/system"
#: The units the gateway enables, in start order (those present are enabled).
GATEWAY_UNITS = ("hpclb-prepare.service", "hpclb.service")
#: keepalived for an active/standby pair (enabled with a `vrrp:` section).
VRRP_UNIT = "hpclb-keepalived.service"
#: DPDK drivers that wrap a kernel interface: no vfio-pci binding.
VDEV_DRIVERS = ("af_xdp", "af_packet")
#: ``hpclb`` on PATH for the operator (sudo hpclb status).
CLI_LINK = ("/usr/local/bin/hpclb", "/opt/hpclb/.venv/bin/hpclb")


@dataclass(frozen=True)
class GatewayOptions:
    """What the operator said (provision.sh's flags); None: the example's or
    the host's."""

    config: Path  # the example the configuration is made from
    name: str | None = None  # appliance.name; default: the host name
    dataplane: str | None = None  # xdp | dpdk | auto
    ingress: str | None = None
    egress: Sequence[str] | None = None
    management: str | None = None  # the management NIC (never bound, never a data port)
    management_address: str | None = None
    hugepages_mb: int | None = None
    keys_dir: Path | None = None
    sysfs: Path | None = None  # a fake /sys (tests); default the real one
    # Under --root: this host's facts (its /sys, the current network
    # namespace's NICs) stand for the target's (a namespace standing for a VM).
    host_facts: bool = False


def host_name(ctx: Context, name: str | None) -> str:
    """``name``, else the provisioned system's host name (ROOT/etc/hostname
    under --root, when there is one), short form."""
    if name:
        return name
    if not ctx.live:
        try:
            text = ctx.path("/etc/hostname").read_text().strip()
        except FileNotFoundError:
            text = ""
        if text:
            return text.split(".")[0]
    return socket.gethostname().split(".")[0]


def unit_actions(ctx: Context, enable: Sequence[str]) -> list[Action]:
    """Every ``appliance/systemd/*.service`` and ``*.path`` installed in /etc/systemd/system,
    the ``enable`` ones (those that exist) enabled, and started where systemd
    runs; where it does not (a container, a chroot), a line says so and the
    plan stops there. The node and client roles use this too."""
    src = ctx.src / "appliance" / "systemd"
    units = sorted([*src.glob("*.service"), *src.glob("*.path")])
    if not units:
        raise ProvisionError(f"no unit files in {src}")
    actions: list[Action] = [WriteFile(f"{UNIT_DIR}/{u.name}", u.read_bytes(), 0o644)
                             for u in units]
    present = {u.name for u in units}
    wanted = [u for u in enable if u in present]
    actions += [EnableUnit(u) for u in wanted]
    if not ctx.live or systemd_running(ctx):
        # A running unit whose file was rewritten (an upgrade) is reloaded,
        # not restarted; the stopped ones are started.
        actions.append(ReloadUnits(tuple(u.name for u in units)))
        actions += [StartUnit(u) for u in wanted]  # under --root: reported as skipped
    else:
        actions.append(Note(
            "systemd is not running (no /run/systemd/system): the units are installed "
            f"and enabled, not started ({', '.join(wanted)}); stopping here"))
    return actions


# --- the host's part (hostfacts, nics, cores, hugepages, sysctls)


@dataclass
class HostChoice:
    """What the host decides in the configuration written (None: keep the
    example's value), and lines to say (advice, a fallback to XDP)."""

    dataplane: str | None = None
    ingress: str | None = None
    egress: list[str] | None = None
    management_address: str | None = None
    lcores: list[int] | None = None
    notes: list[str] = field(default_factory=list)


def _facts(ctx: Context, sysfs: Path | None,
           host_facts: bool = False) -> hostfacts.HostFacts | None:
    """The host's facts (read-only). Live: the running host's. Under --root
    only from a given --sysfs tree (with no addresses nor routes), or this
    host's when asked (``host_facts``): the host that builds an image is not
    the one it will run on. None: no facts."""
    if ctx.live or host_facts:
        return hostfacts.gather(sysfs or Path("/sys"))
    if sysfs is None:
        return None
    # The tree's interfaces, without addresses or routes (no netlink to ask).
    net = sysfs / "class" / "net"
    links = {p.name: _read(p / "address") for p in sorted(net.iterdir())} if net.is_dir() else {}
    return hostfacts.gather(sysfs, net=hostfacts.NetState(links=links), ssh_connection="",
                            run=sysfs / "run", proc=sysfs / "proc",
                            modules=sysfs / "lib-modules", release="fake")


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _ports(opts: GatewayOptions, app: dict[str, Any]) -> tuple[str, str, list[str], str | None]:
    """(dataplane asked, ingress, egress, management address): the flags',
    else the configuration's."""
    ifs = app.get("interfaces") or {}
    return (opts.dataplane or str(app.get("dataplane") or "auto"),
            opts.ingress or str(ifs.get("ingress") or ""),
            list(opts.egress if opts.egress is not None else ifs.get("egress") or []),
            opts.management_address or (str(app["management_address"])
                                        if app.get("management_address") else None))


def _nic_plan(facts: hostfacts.HostFacts, opts: GatewayOptions,
              ports: tuple[str, str, list[str], str | None]) -> nics.NicPlan:
    dataplane, ingress, egress, address = ports
    return nics.plan_nics(facts, ingress, egress, dataplane=dataplane,  # type: ignore[arg-type]
                          management=opts.management, management_address=address,
                          sysfs=opts.sysfs or Path("/sys"))


def _management_address(facts: hostfacts.HostFacts, nic: str | None) -> str | None:
    """The first IPv4 address of the management NIC, when one is named."""
    found = facts.nics.get(nic) if nic else None
    for address in found.addresses if found else ():
        if ":" not in address:
            return str(address).split("/")[0]
    return None


def _choose(facts: hostfacts.HostFacts | None, opts: GatewayOptions,
            draft: dict[str, Any]) -> HostChoice:
    """Data plane, ports, management address and lcores for a new
    configuration (a refused NIC raises ProvisionRefused here)."""
    if facts is None:
        return HostChoice(notes=[
            "host facts: not read (--root without --sysfs or --host-facts): data plane, "
            "interfaces and lcores are the example's or the flags'"])
    app = draft.get("appliance") or {}
    ports = _ports(opts, app)
    if (app.get("dpdk") or {}).get("driver") in VDEV_DRIVERS:
        # DPDK on the kernel interfaces (af_xdp, af_packet): nothing is bound.
        lcores = None
        if ports[0] == "dpdk":
            picked = cores.pick_cores(facts, [facts.numa_node_of(p)
                                              for p in (ports[1], *ports[2])])
            lcores = list(picked.lcores)
        return HostChoice(lcores=lcores, management_address=(
            None if opts.management_address else _management_address(facts, opts.management)))
    plan = _nic_plan(facts, opts, ports)
    choice = HostChoice(dataplane=plan.dataplane, ingress=plan.ingress, egress=plan.egress,
                        management_address=(None if opts.management_address else
                                            _management_address(facts, opts.management)))
    if plan.message:
        choice.notes.append(f"fallback: {plan.message}")
    if plan.dataplane == "dpdk":
        picked = cores.pick_cores(facts, plan.numa_nodes)
        choice.lcores = list(picked.lcores)
        choice.notes += list(picked.notes) + list(picked.advice)
    return choice


def _host_actions(ctx: Context, facts: Any, opts: GatewayOptions,
                  text: str) -> list[Action]:
    """NIC binding, hugepages and sysctls for the configuration in force."""
    config = parse_config(text, CONFIG)
    app = config.appliance
    dpdk = app.dataplane.value == "dpdk"
    actions: list[Action] = []
    if facts is not None:
        # The configuration's ports (the operator's, when it was kept): the
        # refusals hold for them whatever `dataplane` says, and PCI ports vfio
        # cannot take here are a loud warning (XDP cannot run PCI addresses).
        actions += nics.config_actions(facts, yaml.safe_load(text), management=opts.management,
                                       sysfs=opts.sysfs or Path("/sys"))
        if dpdk:
            actions += hugepages.hugepage_actions(
                facts, app.dpdk.lcores, app.dpdk.hugepages_mb, persistent=True, live=ctx.live,
                sysfs=opts.sysfs or Path("/sys"))
    elif dpdk:
        actions.append(Note("hugepages: not planned (--root without host facts); "
                            "hpclb-prepare.service reserves them at boot"))
    actions += sysctls.sysctl_actions("gateway", sysctls.gateway_sysctls(yaml.safe_load(text)))
    return actions


def _configuration(ctx: Context, opts: GatewayOptions,
                   facts: Any) -> tuple[list[Action], str]:
    """The configuration's action and the configuration's text in force
    afterwards (for the host's part)."""
    existing = ctx.path(CONFIG)
    if existing.exists():
        text = existing.read_text()
        check_config(text, str(existing))
        return ([Note(f"kept: {CONFIG} (it exists; provisioning never overwrites it)")],
                text)
    try:
        example = opts.config.read_text()
    except OSError as err:
        raise ProvisionError(f"--config {opts.config}: {err.strerror}") from None
    check_config(example, str(opts.config))
    draft: dict[str, Any] = yaml.safe_load(example)
    app = draft.setdefault("appliance", {})
    if opts.dataplane:
        app["dataplane"] = opts.dataplane
    if opts.ingress:
        app.setdefault("interfaces", {})["ingress"] = opts.ingress
    if opts.egress is not None:
        app.setdefault("interfaces", {})["egress"] = list(opts.egress)
    choice = _choose(facts, opts, draft)
    inputs = ConfigInputs(
        name=host_name(ctx, opts.name), hash_key=new_hash_key(),
        dataplane=choice.dataplane or opts.dataplane, ingress=choice.ingress or opts.ingress,
        egress=choice.egress if choice.egress is not None else opts.egress,
        management_address=opts.management_address or choice.management_address,
        lcores=choice.lcores, hugepages_mb=opts.hugepages_mb)
    text = render_config(example, str(opts.config), inputs)
    actions: list[Action] = [Note(line) for line in choice.notes]
    actions.append(WriteFile(CONFIG, text, 0o660, "root", "hpclb", keep=True))
    return actions, text


def plan(ctx: Context, opts: GatewayOptions) -> list[Action]:
    """The gateway's actions, computed and checked whole (nothing is changed
    here: a bad example or a refused NIC raises before any action runs)."""
    facts = _facts(ctx, opts.sysfs, opts.host_facts)
    actions: list[Action] = [
        Sysusers(template("sysusers-hpclb.conf")),
        Tmpfiles(template("tmpfiles-hpclb.conf")),
    ]
    config_actions, config = _configuration(ctx, opts, facts)
    actions += config_actions
    actions += server_keys(opts.keys_dir)
    actions += _host_actions(ctx, facts, opts, config)
    actions.append(Symlink(*CLI_LINK))
    # The BGP speaker (BIRD 2) when the configuration announces: its path unit
    # starts it once hpclb has written the speaker's configuration.
    speaker = ("hpclb-bird.path",) if (yaml.safe_load(config) or {}).get("bgp") else ()
    pair_actions, pair_units = vrrp_actions(config)
    actions += pair_actions
    # Last: without systemd, the plan stops here.
    actions += unit_actions(ctx, (*GATEWAY_UNITS, *speaker, *pair_units))
    return actions


def vrrp_actions(config: str) -> tuple[list[Action], tuple[str, ...]]:
    """With a `vrrp:` section: keepalived's configuration and track script
    (rendered from the configuration in force, rewritten when it changed: they
    are hpclb's, not the operator's) and the unit that runs them."""
    parsed = parse_config(config, CONFIG)
    if parsed.vrrp is None:
        return [], ()
    rendered = vrrp.render(parsed, check_script=CHECK_SCRIPT)
    return ([WriteFile(str(CHECK_SCRIPT), rendered.check_script, 0o700),
             WriteFile(str(KEEPALIVED_CONF), rendered.keepalived_conf, 0o644)],
            (VRRP_UNIT,))
