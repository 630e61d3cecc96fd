"""The two-network lab: the appliance as the gateway between a client network and a
cluster network (NAT mode).

Topology (``p`` is the prefix, as in ``hpclb.lab.topology``; every veth's peer lives in
``{p}-br``)::

    client network 198.18.0.0/24 (br0)           cluster network 198.19.0.0/24 (br1)
    {p}-cli eth0 198.18.0.2 ── v-cli ─┐           ┌─ v-b1 ── {p}-b1 eth0 198.19.0.11
                                     br0         br1  ...
    {p}-lb  eth0 198.18.0.3 ── v-lb ──┘           ├─ v-lb1 ─ {p}-lb eth1 198.19.0.1
            (VIPs 198.18.1.0/24 on lo)            └─ v-bN ── {p}-bN eth0 198.19.0.(10+N)

* The client's default route is the appliance's client-side address (198.18.0.3): VIP
  traffic and anything for the cluster network goes through the appliance.
* The appliance (``{p}-lb``) has two interfaces on two L2 segments, ``eth0`` on the
  client network and ``eth1`` on the cluster network, holds the VIPs on ``lo`` (as in
  the one-LAN lab) and forwards IPv4 in the kernel (``ip_forward=1``), so that traffic
  that is not for a VIP (the client to a backend's own address, a backend to the
  client network) is routed by the gateway as it would be without hpclb.
* The backends' default route is the appliance's cluster-side address (198.19.0.1), so
  that replies to a NATed connection come back through it to be translated back. They
  hold nothing on ``lo`` but 127.0.0.1 and keep the kernel's ARP defaults: no DSR.
* ``snat_ips=`` (e.g. ``("198.19.0.2",)``, from 198.19.0.2-198.19.0.9): addresses a
  SNAT pool translates to, held as /32s on the appliance's ``eth1`` so that the kernel
  answers the backends' ARP for them (NAT's ``nat.snat.addresses``).

The two segments share nothing at L2: ``br0`` and ``br1`` are separate bridges, and a
frame from the client reaches the cluster only through the appliance. The lab's
helpers (``start_backend``, ``run_client``, ``ping``...), cleanup on failure and on
signals, and ``cleanup_stale(prefix)`` are the one-LAN lab's: the namespaces have the
same names, and every bridge-side veth is ``v-...``.

With ``peer_xdp_pass=`` the XDP_PASS program goes on both of the appliance's peers
(``v-lb`` and ``v-lb1``): a frame an XDP data plane redirects out of either interface
is received only when the peer runs XDP (``hpclb.lab.topology``'s docstring).

The kernel's own NAT of the same job (nftables DNAT and conntrack) is in
``hpclb.lab.kernel_nat``.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Sequence

from pyroute2 import NetNS

from hpclb.lab.topology import (
    BRIDGE,
    DEFAULT_VIPS,
    ETH,
    LAN_PREFIXLEN,
    LB_IP,
    MAC_FMT,
    MAX_BACKENDS,
    VIP_NET,
    Lab,
    Port,
)

CLUSTER_NET = "198.19.0.0/24"
LB_CLUSTER_IP = "198.19.0.1"
CLUSTER_PREFIXLEN = 24
CLUSTER_BRIDGE = "br1"
CLUSTER_ETH = "eth1"  # the appliance's cluster-side interface
LB_CLUSTER_PEER = "v-lb1"  # its bridge-side peer
# The cluster segment's MACs differ from the client segment's in the fifth byte.
CLUSTER_MAC_FMT = "02:48:4c:00:01:{:02x}"
# Cluster-side addresses free for SNAT pools: above the appliance's, below the backends'.
SNAT_RANGE = tuple(f"198.19.0.{i}" for i in range(2, 10))

assert MAX_BACKENDS + 10 < 255  # backend i is 198.19.0.(10+i)
assert ipaddress.ip_address(LB_CLUSTER_IP) in ipaddress.ip_network(CLUSTER_NET)
assert not ipaddress.ip_network(CLUSTER_NET).overlaps(ipaddress.ip_network(VIP_NET))


def cluster_backend_ip(i: int) -> str:
    """Address of backend ``i`` (1-based) on the cluster network."""
    return f"198.19.0.{10 + i}"


class GatewayLab(Lab):
    """The lab with the appliance between a client network and a cluster network.

    Same life cycle as ``Lab`` (``with GatewayLab(...) as lab``, ``up``/``down``,
    teardown on exceptions, SIGINT/SIGTERM and exit, ``Lab.cleanup_stale(prefix)``).
    ``ip_of("lb")`` is the appliance's client-side address (what the client routes
    through); ``gateway_ip`` its cluster-side one (the backends' default route).
    """

    def __init__(
        self,
        prefix: str = "hlbgw",
        backends: int = 3,
        vips: Sequence[str] = DEFAULT_VIPS,
        *,
        peer_gro: bool = True,
        peer_xdp_pass: str | os.PathLike[str] | None = None,
        ipv6: bool = False,
        replace_stale: bool = False,
        snat_ips: Sequence[str] = (),
    ) -> None:
        super().__init__(prefix, backends, vips, peer_gro=peer_gro,
                         peer_xdp_pass=peer_xdp_pass, ipv6=ipv6, replace_stale=replace_stale)
        if any(ip not in SNAT_RANGE for ip in snat_ips) or len(set(snat_ips)) != len(snat_ips):
            raise ValueError(f"snat_ips must be distinct addresses of {SNAT_RANGE[0]}-"
                             f"{SNAT_RANGE[-1]}")
        self.snat_ips = tuple(snat_ips)

    # ------------------------------------------------------------------ naming

    @property
    def gateway_ip(self) -> str:
        """The appliance's cluster-side address: the backends' default route."""
        return LB_CLUSTER_IP

    @property
    def cluster_peer(self) -> str:
        """The bridge-side peer of the appliance's cluster interface (``v-lb1``)."""
        return LB_CLUSTER_PEER

    def backend_ip(self, i: int) -> str:
        self._check_backend(i)
        return cluster_backend_ip(i)

    def ip_of(self, role: str) -> str:
        role = role.rsplit("-", 1)[-1]
        if role.startswith("b") and role[1:].isdigit():
            return cluster_backend_ip(int(role[1:]))
        return super().ip_of(role)

    def ports(self) -> list[Port]:
        client = [Port(r, ETH, self.peer(r), BRIDGE, self.ip_of(r), LAN_PREFIXLEN,
                       MAC_FMT.format(_last_octet(self.ip_of(r)))) for r in ("cli", "lb")]
        cluster = [Port("lb", CLUSTER_ETH, LB_CLUSTER_PEER, CLUSTER_BRIDGE, LB_CLUSTER_IP,
                        CLUSTER_PREFIXLEN, CLUSTER_MAC_FMT.format(_last_octet(LB_CLUSTER_IP)))]
        cluster += [Port(f"b{i}", ETH, self.peer(f"b{i}"), CLUSTER_BRIDGE,
                         cluster_backend_ip(i), CLUSTER_PREFIXLEN,
                         CLUSTER_MAC_FMT.format(_last_octet(cluster_backend_ip(i))))
                    for i in range(1, self.backends + 1)]
        return client + cluster

    def set_backend_link(self, i: int, up: bool) -> None:
        """Take backend ``i``'s eth0 down or up (``Lab.set_backend_link``). The kernel
        drops the routes through a link that goes down, the backend's default route
        through the appliance with them: it is put back when the link comes up, or
        the backend could answer the appliance (on its segment) but not the client."""
        super().set_backend_link(i, up)
        if up:
            with NetNS(self.backend_ns(i)) as ipr:
                ipr.route("replace", dst="0.0.0.0", dst_len=0, gateway=LB_CLUSTER_IP)

    # ------------------------------------------------------------------ building

    def _configure_routes(self, role: str, ipr: NetNS) -> None:
        if role == "cli":
            # The appliance is the client network's gateway: VIPs and the cluster.
            ipr.route("add", dst="0.0.0.0", dst_len=0, gateway=LB_IP)
        elif role == "lb":
            lo = ipr.link_lookup(ifname="lo")[0]
            for vip in self.vips:
                ipr.addr("add", index=lo, address=vip, prefixlen=32)
            eth1 = ipr.link_lookup(ifname=CLUSTER_ETH)[0]
            for ip in self.snat_ips:
                ipr.addr("add", index=eth1, address=ip, prefixlen=32)
        else:
            # Replies go back through the appliance, to be translated back.
            ipr.route("add", dst="0.0.0.0", dst_len=0, gateway=LB_CLUSTER_IP)

    def _host_sysctls(self, role: str) -> dict[str, str]:
        values = super()._host_sysctls(role)
        if role.startswith("b"):
            # No DSR here: the backends never see a VIP, and keep the kernel's defaults.
            for key in ("net.ipv4.conf.all.arp_ignore", "net.ipv4.conf.all.arp_announce"):
                values.pop(key, None)
            values = {k: v for k, v in values.items() if ".rp_filter" not in k}
        if role == "lb":
            # Non-VIP traffic crosses the gateway through the kernel's routing; rp_filter
            # stays off (the base lab's): packets to a VIP arrive on an interface that
            # does not hold it, and NATed replies come in from the cluster side.
            values["net.ipv4.ip_forward"] = "1"
            values |= {f"net.ipv4.conf.{CLUSTER_ETH}.rp_filter": "0"}
        return values


def _last_octet(ip: str) -> int:
    return int(ip.rsplit(".", 1)[1])
