"""The routed tunnel lab: backends on another L3 network behind a router (tunnel mode).

Topology (``p`` is the prefix; every veth's peer lives in ``{p}-br``; dual stack
always)::

    client network (br0)                            backend network (br1), MTU 1600
    198.18.0.0/24, fd48:4c00::/64                   198.19.2.0/24, fd48:4c02::/64
    {p}-cli eth0 .2   ::2  (MTU 1500) ─┐         ┌─ {p}-b1 eth0 198.19.2.11 fd48:4c02::11
    {p}-lb  eth0 .3   ::3  (MTU 1600) ─┤ br0 br1 ┤   ...     (decap.bpf.o on eth0,
    {p}-rt  eth0 .1   ::1  (MTU 1600) ─┘         ├─ {p}-bN    VIPs on lo)
    {p}-rt  eth1 198.19.2.1 fd48:4c02::1 ────────┘

* The client routes the VIP prefixes (198.18.1.0/24, fd48:4c01::/64) via the
  appliance, as in the one-LAN lab (``hpclb.lab.topology``), and the backend network
  via the router (the backends' own addresses: management, probes).
* The appliance (one arm, ``eth0``) holds the VIPs on ``lo`` and routes the backend
  network via the router (198.18.0.1, fd48:4c00::1): that route is what the control
  plane follows to put the next hop's MAC (the router's ``eth0``) into each distant
  backend's entry. In tunnel mode it sends a client's packet inside an IPIP or GUE
  header (``dataplane/common/lb_encap.h``) to the backend's address, through the
  router.
* The router (``{p}-rt``) forwards IPv4 and IPv6 in its kernel, reverse-path
  filtering off (replies come from the VIPs, which it has no route for).
* Each backend has its default routes via the router, holds the VIPs on ``lo`` and
  runs the decapsulation program ``decap.bpf.o`` (``dataplane/xdp/decap.bpf.c``)
  natively on ``eth0``: IPIP, 4in6, 6in6 and GUE (UDP to ``gue_port``, default 6080)
  frames lose their outer headers there and the kernel gets the client's own packet,
  for a VIP it holds; the answer goes from the VIP straight to the client through the
  router (DSR). This kernel has no ipip, ip6_tunnel or fou modules; on one that has
  them, an ipip/ip6tnl device or ``ip fou add port 6080 gue`` does the same.
* MTU: the tunnel adds 20 to 48 bytes and the appliance never fragments
  (lb_encap.h), so every link a tunnelled frame crosses has MTU 1600 while the
  client keeps 1500 (its TCP MSS, and with it every packet it sends, stays below
  what the tunnel path carries).

The life cycle, cleanup and helpers are the one-LAN lab's (``Lab``); the router's
namespace is ``{p}-rt``, which ``Lab.cleanup_stale`` knows.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from typing import Any

from pyroute2 import NetNS

from hpclb.contract.tables import GUE_PORT_DEFAULT
from hpclb.host import install
from hpclb.lab.topology import (
    BRIDGE,
    DEFAULT_VIPS,
    ETH,
    LAN_PREFIXLEN,
    MAC_FMT,
    MAX_BACKENDS,
    Lab,
    LabError,
    Port,
)

ROUTER_IP = "198.18.0.1"
ROUTER_IP6 = "fd48:4c00::1"
BACKEND_NET = "198.19.2.0/24"
BACKEND_NET6 = "fd48:4c02::/64"
ROUTER_BACK_IP = "198.19.2.1"
ROUTER_BACK_IP6 = "fd48:4c02::1"
BACKEND_BRIDGE = "br1"
ROUTER_BACK_ETH = "eth1"
ROUTER_BACK_PEER = "v-rt1"
TUNNEL_MTU = 1600  # 1500 + 48 (GUE over IPv6) and then some
# The backend network's MACs differ from the client network's in the fifth byte.
BACKEND_MAC_FMT = "02:48:4c:00:02:{:02x}"
# The configuration's default GUE port, which decap.bpf.c also takes when told none
# (LB_DECAP_GUE_PORT_DEFAULT).
DEFAULT_GUE_PORT = GUE_PORT_DEFAULT
DECAP_STATS = ("decapsulated", "passed", "malformed")  # decap.bpf.c's decap_stats

assert MAX_BACKENDS + 10 < 255


def tunnel_backend_ip(i: int) -> str:
    return f"198.19.2.{10 + i}"


def tunnel_backend_ip6(i: int) -> str:
    return f"fd48:4c02::{10 + i}"


def default_decap_obj() -> str:
    """The data plane build's decapsulation program (``decap.bpf.o``)."""
    return str(install.find("decap.bpf.o"))


class TunnelLab(Lab):
    """Client and appliance on one network, backends on another behind a router.

    Always dual stack. ``decap_obj``: the decapsulation program attached to every
    backend's ``eth0`` on ``up()`` (default: the build's; ``False``: none, for a test
    that attaches its own); ``gue_port``: the GUE port it is told.
    """

    def __init__(
        self,
        prefix: str = "hlbtun",
        backends: int = 3,
        vips: Sequence[str] = DEFAULT_VIPS,
        *,
        peer_gro: bool = True,
        peer_xdp_pass: str | os.PathLike[str] | None = None,
        replace_stale: bool = False,
        decap_obj: str | os.PathLike[str] | bool | None = None,
        gue_port: int = DEFAULT_GUE_PORT,
    ) -> None:
        super().__init__(prefix, backends, vips, peer_gro=peer_gro,
                         peer_xdp_pass=peer_xdp_pass, ipv6=True, replace_stale=replace_stale)
        if not 1 <= gue_port <= 65535:
            raise ValueError("gue_port must be in 1..65535")
        self.decap_obj = decap_obj
        self.gue_port = gue_port

    # ------------------------------------------------------------------ naming

    def roles(self) -> list[str]:
        return ["cli", "lb", "rt", *(f"b{i}" for i in range(1, self.backends + 1))]

    @property
    def router_ns(self) -> str:
        return self.ns("rt")

    def backend_ip(self, i: int) -> str:
        self._check_backend(i)
        return tunnel_backend_ip(i)

    def ip_of(self, role: str) -> str:
        role = role.rsplit("-", 1)[-1]
        if role == "rt":
            return ROUTER_IP
        if role.startswith("b") and role[1:].isdigit():
            return tunnel_backend_ip(int(role[1:]))
        return super().ip_of(role)

    def ip6_of(self, role: str) -> str:
        role = role.rsplit("-", 1)[-1]
        if role == "rt":
            return ROUTER_IP6
        if role.startswith("b") and role[1:].isdigit():
            return tunnel_backend_ip6(int(role[1:]))
        return super().ip6_of(role)

    def backend_mac(self, role: str) -> str:
        """A distant backend's frames go to the next hop: the router's ``eth0``."""
        return self.mac("rt", ETH)

    def ports(self) -> list[Port]:
        def mac(fmt: str, ip: str) -> str:
            return fmt.format(int(ip.rsplit(".", 1)[1]))

        client = [Port(r, ETH, self.peer(r), BRIDGE, self.ip_of(r), LAN_PREFIXLEN,
                       mac(MAC_FMT, self.ip_of(r)), self.ip6_of(r),
                       mtu=None if r == "cli" else TUNNEL_MTU) for r in ("cli", "lb", "rt")]
        back = [Port("rt", ROUTER_BACK_ETH, ROUTER_BACK_PEER, BACKEND_BRIDGE, ROUTER_BACK_IP,
                     24, mac(BACKEND_MAC_FMT, ROUTER_BACK_IP), ROUTER_BACK_IP6, mtu=TUNNEL_MTU)]
        back += [Port(f"b{i}", ETH, self.peer(f"b{i}"), BACKEND_BRIDGE, tunnel_backend_ip(i),
                      24, mac(BACKEND_MAC_FMT, tunnel_backend_ip(i)), tunnel_backend_ip6(i),
                      mtu=TUNNEL_MTU) for i in range(1, self.backends + 1)]
        return client + back

    # ------------------------------------------------------------------ building

    def _build(self) -> None:
        super()._build()
        if self.decap_obj is not False:
            obj = default_decap_obj() if self.decap_obj in (None, True) else self.decap_obj
            for i in range(1, self.backends + 1):
                self.attach_decap(i, str(obj))

    def _configure_routes(self, role: str, ipr: NetNS) -> None:
        lo = ipr.link_lookup(ifname="lo")[0]
        if role in ("cli", "lb"):
            # Client: VIPs via the appliance (the one-LAN lab's routes). Appliance:
            # VIPs on lo. Both reach the backend network through the router.
            super()._configure_routes(role, ipr)
            for net, via in ((BACKEND_NET, ROUTER_IP), (BACKEND_NET6, ROUTER_IP6)):
                dst, plen = net.split("/")
                ipr.route("add", dst=dst, dst_len=int(plen), gateway=via)
        elif role.startswith("b"):
            self._vips_on_lo(ipr, lo)
            self._default_routes(ipr)

    @staticmethod
    def _default_routes(ipr: NetNS) -> None:
        ipr.route("replace", dst="0.0.0.0", dst_len=0, gateway=ROUTER_BACK_IP)
        ipr.route("replace", dst="::", dst_len=0, gateway=ROUTER_BACK_IP6, family=10)

    def _host_sysctls(self, role: str) -> dict[str, str]:
        values = super()._host_sysctls(role)
        if role == "rt":
            values |= {"net.ipv4.ip_forward": "1", "net.ipv6.conf.all.forwarding": "1"}
            for dev in ("all", "default", "lo", ETH, ROUTER_BACK_ETH):
                values[f"net.ipv4.conf.{dev}.rp_filter"] = "0"
        return values

    def set_backend_link(self, i: int, up: bool) -> None:
        """``Lab.set_backend_link``; the default routes a link-down took with it come
        back with the link."""
        super().set_backend_link(i, up)
        if up:
            with NetNS(self.backend_ns(i)) as ipr:
                self._default_routes(ipr)

    # ------------------------------------------------------------------ decapsulation

    def attach_decap(self, i: int, obj: str | os.PathLike[str] | None = None,
                     gue_port: int | None = None) -> None:
        """Attach the decapsulation program to backend ``i``'s ``eth0`` (native XDP)
        and tell it the GUE port (``gue_port``, default the lab's)."""
        self.attach_xdp(self.backend_ns(i), ETH, obj or default_decap_obj())
        self.set_gue_port(i, self.gue_port if gue_port is None else gue_port)

    def _decap_map(self, i: int, name: str) -> int:
        """The id of map ``name`` of the program on backend ``i``'s ``eth0``."""
        links = json.loads(self.exec(self.backend_ns(i), ["ip", "-j", "link", "show", "dev",
                                                          ETH]).stdout)
        try:
            prog_id = int(links[0]["xdp"]["prog"]["id"])
        except (KeyError, IndexError, TypeError) as exc:
            raise LabError(f"no XDP program on b{i}'s {ETH}") from exc
        prog = _bpftool("prog", "show", "id", str(prog_id))
        for map_id in prog.get("map_ids", []):
            if _bpftool("map", "show", "id", str(map_id)).get("name") == name:
                return int(map_id)
        raise LabError(f"b{i}'s XDP program {prog_id} has no map {name}")

    def set_gue_port(self, i: int, port: int) -> None:
        """decap_config[0].gue_port of backend ``i``'s decapsulation program."""
        if not 1 <= port <= 65535:
            raise ValueError("GUE port must be in 1..65535")
        value = port.to_bytes(2, "little") + bytes(2)  # struct decap_config, host order
        _bpftool("map", "update", "id", str(self._decap_map(i, "decap_config")), "key",
                 *"0 0 0 0".split(), "value", *(str(b) for b in value), parse=False)

    def decap_stats(self, i: int) -> dict[str, int]:
        """Backend ``i``'s decapsulation counters (decapsulated, passed, malformed)."""
        dump = _bpftool("map", "dump", "id", str(self._decap_map(i, "decap_stats")))
        out = dict.fromkeys(DECAP_STATS, 0)
        for entry in dump if isinstance(dump, list) else []:
            key, value = _entry_int(entry, "key"), _entry_int(entry, "value")
            if 0 <= key < len(DECAP_STATS):
                out[DECAP_STATS[key]] = value
        return out


def _entry_int(entry: dict[str, Any], field: str) -> int:
    """A bpftool -j dump entry's key or value as an integer (BTF-formatted or raw
    hex bytes, host order)."""
    formatted = entry.get("formatted", {})
    if isinstance(formatted.get(field), int):
        return int(formatted[field])
    raw = entry.get(field)
    if isinstance(raw, int):
        return raw
    if isinstance(raw, list):
        return int.from_bytes(bytes(int(b, 16) for b in raw), "little")
    raise LabError(f"bpftool entry without a {field}: {entry}")


def _bpftool(*args: str, parse: bool = True) -> Any:
    """Run ``bpftool -j ARGS`` (map and program ids are global: no namespace)."""
    res = subprocess.run(["bpftool", "-j", *args], capture_output=True, text=True,
                         timeout=30, check=False)
    if res.returncode != 0:
        raise LabError(f"bpftool {' '.join(args)} exited {res.returncode}: "
                       f"{(res.stderr or res.stdout).strip()}")
    return json.loads(res.stdout) if parse and res.stdout.strip() else None
