"""The kernel settings each forwarding mode needs, in one sysctl.d file per role.

Every setting carries its reason, written above it in the file. The file is
applied at every boot by systemd-sysctl; when provisioning the running host
(``ctx.live``) the same values are written to /proc/sys at once.

The gateway (the appliance):

* NAT VIPs: ``net.ipv4.ip_forward = 1`` (and ``net.ipv6.conf.all.forwarding =
  1`` for IPv6 NAT VIPs). The backends route everything through the
  appliance; what is not a VIP's (their own traffic out, replies of no
  connection) passes to the kernel, which must route it.
* ``rp_filter = 2`` (loose) on ``all`` and ``default``: traffic to a VIP
  arrives on an interface that does not hold the VIP, and NAT replies come in
  from the cluster side; strict reverse-path filtering would drop what the
  kernel sees of them. The kernel uses the larger of ``all`` and the
  interface's own value, so ``all = 2`` makes every interface loose.

A backend node (:func:`backend_sysctls`, used by the node role):

* DSR and tunnel VIPs: the VIP sits on ``lo``. ``arp_ignore = 1``: answer ARP
  only for addresses of the interface asked on, so the node never draws VIP
  traffic away from the appliance; ``arp_announce = 2``: never use the VIP as
  the source of the node's own ARP requests (a neighbour would learn VIP ->
  this node); ``rp_filter = 2``: packets to the VIP arrive on an interface
  that does not hold it (and, tunnelled, from a source not reached back
  through the tunnel).
* NAT VIPs: nothing (the backends only need their default route through the
  appliance, which is the network's business).
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from ipaddress import ip_address
from pathlib import Path
from typing import Any

from hpclb.provision.actions import WriteFile
from hpclb.provision.plan import Action, BaseAction, Context, ProvisionError

ROLES = ("gateway", "node", "client")


@dataclass(frozen=True)
class Sysctl:
    key: str
    value: str
    why: str


def conf_path(role: str) -> str:
    return f"/etc/sysctl.d/60-hpclb-{role}.conf"


_LOOSE_RP = ("reverse-path filtering loose (2): {why} (the kernel uses the larger of "
             "'all' and the interface's value)")


def _rp_filter(why: str) -> list[Sysctl]:
    text = _LOOSE_RP.format(why=why)
    return [Sysctl("net.ipv4.conf.all.rp_filter", "2", text),
            Sysctl("net.ipv4.conf.default.rp_filter", "2",
                   "the same for interfaces created later")]


def _vips(config: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    return list((config or {}).get("vips") or [])


def gateway_sysctls(config: Mapping[str, Any] | None) -> list[Sysctl]:
    """The appliance's settings for the VIPs of ``config`` (a plain mapping)."""
    nat = [v for v in _vips(config) if v.get("mode") == "nat"]
    out: list[Sysctl] = []
    if any(ip_address(str(v["address"])).version == 4 for v in nat):
        out.append(Sysctl("net.ipv4.ip_forward", "1",
                          "NAT VIPs: the backends route through the appliance, and what is "
                          "not a VIP's (their own traffic, replies of no connection) is routed "
                          "by the kernel"))
    if any(ip_address(str(v["address"])).version == 6 for v in nat):
        out.append(Sysctl("net.ipv6.conf.all.forwarding", "1",
                          "IPv6 NAT VIPs: as ip_forward for IPv4. With forwarding on, the "
                          "kernel ignores router advertisements unless an interface has "
                          "accept_ra = 2 (set it on the management NIC if it needs them)"))
    out += _rp_filter("packets to a VIP arrive on an interface that does not hold it, and "
                      "NAT replies come in from the cluster side")
    return out


def backend_sysctls(modes: Iterable[str]) -> list[Sysctl]:
    """A backend node's settings for the forwarding modes of the VIPs it serves."""
    wanted = {str(getattr(m, "value", m)) for m in modes}
    if not wanted & {"dsr", "tunnel"}:
        return []
    return [
        Sysctl("net.ipv4.conf.all.arp_ignore", "1",
               "DSR/tunnel: the VIP is on lo; answer ARP only for addresses of the interface "
               "asked on, so this node never draws the VIP's traffic from the appliance"),
        Sysctl("net.ipv4.conf.all.arp_announce", "2",
               "DSR/tunnel: never use the VIP as the source address of this node's own ARP "
               "requests (a neighbour would learn the VIP at this node's MAC)"),
        *_rp_filter("packets to the VIP arrive on an interface that does not hold it"),
    ]


def render(role: str, settings: Sequence[Sysctl]) -> str:
    lines = [f"# hpclb: kernel settings of the {role} role, applied at boot by",
             "# systemd-sysctl. Written by hpclb provisioning (python -m hpclb.provision)",
             "# and rewritten on each run: put local changes in a file that sorts after",
             "# this one (e.g. 70-local.conf)."]
    if not settings:
        lines.append("# Nothing to set for this role's forwarding modes.")
    for s in settings:
        lines += ["", *(f"# {part}" for part in textwrap.wrap(s.why, 76)), f"{s.key} = {s.value}"]
    return "\n".join(lines) + "\n"


def proc_path(proc: Path, key: str) -> Path:
    # Dots separate levels; an interface name with a dot (eth0.100) would need
    # a slash, but hpclb only sets all/default here.
    return proc / "sys" / key.replace(".", "/")


@dataclass
class SysctlLive(BaseAction):
    """The settings written to /proc/sys now (live only)."""

    settings: Sequence[Sysctl] = ()
    proc: Path = Path("/proc")
    live_only: bool = True

    def describe(self) -> str:
        return "kernel settings now (/proc/sys)"

    def _current(self, s: Sysctl) -> str | None:
        try:
            return proc_path(self.proc, s.key).read_text().strip()
        except OSError:
            return None

    def pending(self, ctx: Context) -> list[str]:
        out = []
        for s in self.settings:
            current = self._current(s)
            if current is None:
                # Asked before anything is applied: nothing half done.
                raise ProvisionError(f"{s.key}: not on this kernel ({proc_path(self.proc, s.key)}"
                                     " is missing; IPv6 disabled?), and it is needed: "
                                     f"{s.why}")
            if current != s.value:
                out.append(f"{s.key} {current} -> {s.value}")
        return out

    def apply(self, ctx: Context) -> None:
        for s in self.settings:
            if self._current(s) != s.value:
                proc_path(self.proc, s.key).write_text(s.value + "\n")


def sysctl_actions(role: str, settings: Sequence[Sysctl], *,
                   proc: Path = Path("/proc")) -> list[Action]:
    """The role's sysctl.d file, and the live settings."""
    out: list[Action] = [WriteFile(conf_path(role), render(role, settings), 0o644)]
    if settings:
        out.append(SysctlLive(settings=list(settings), proc=proc))
    return out


def actions(ctx: Context, role: str, config: Mapping[str, Any] | None, *,
            proc: Path = Path("/proc")) -> list[Action]:
    """H1's entry: the gateway's settings from its configuration; a node's
    from the modes of the configuration's VIPs (H4 may call
    :func:`backend_sysctls` with the modes of the node's own VIPs instead);
    none for a client."""
    del ctx
    if role == "gateway":
        return sysctl_actions(role, gateway_sysctls(config), proc=proc)
    if role == "node":
        modes = {str(v.get("mode", "dsr")) for v in _vips(config)}
        return sysctl_actions(role, backend_sysctls(modes), proc=proc)
    return []
