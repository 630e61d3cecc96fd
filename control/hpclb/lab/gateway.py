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
  answers the backends' ARP for them (NAT's ``nat.snat.addresses``). A dual-stack lab
  takes IPv6 ones too (``fd48:4c03::2``-``::9``), held as /128s (nodad). Unlike a
  secondary IPv4 /32, such an address may be the source the appliance's kernel picks
  for its own connections to the cluster (IPv6 source address selection, RFC 6724,
  sees one more address of ``eth1``): probes then come from the pool address with
  kernel ephemeral ports, outside any SNAT port range, and their answers, matching no
  connection, go to the kernel. A test that counts what the backends see keeps the
  probes on a port of their own.

Dual stack (``ipv6=True``): every interface also gets an IPv6 ULA (nodad), the client
network ``fd48:4c00::/64`` as in the one-LAN lab (client ``::2``, appliance ``::3``),
the cluster network ``fd48:4c03::/64`` (appliance ``fd48:4c03::1``, backend i
``fd48:4c03::(10+i)``); the IPv6 VIPs (``fd48:4c01::/64``) are on the appliance's
``lo``. The client's IPv6 default route is the appliance's client-side address, the
backends' the cluster-side one; the appliance forwards IPv6 in its kernel too
(``net.ipv6.conf.all.forwarding=1``). The IPv6 neighbour entries of the lab's own
addresses are static (permanent): the client's and the backends' for the appliance,
the appliance's for the client (``eth0``) and every backend (``eth1``), as the
one-LAN lab's client entry is (``hpclb.lab.topology``): a DPDK forwarder takes every
frame the wire brings to ``eth0``/``eth1``, and the appliance's kernel then resolves
and answers neighbours only through the forwarder's exception path (its TAP,
``hpclb.dataplane.exception_path``); the lab's own plumbing does not depend on what
that path carries. The SNAT pool's IPv6 addresses and the NAT VIPs are what NDP is
left to, as on a real cluster network: in XDP mode the appliance's kernel answers
for the pool addresses (XDP passes NDP), in DPDK mode the forwarder answers for both
(``ndp_reply``). The backends keep their IPv6 addresses across a link down
(``keep_addr_on_down``), as they keep the IPv4 ones.

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
from socket import AF_INET6

from pyroute2 import NetNS

from hpclb.lab.topology import (
    BRIDGE,
    CLIENT_IP,
    CLIENT_IP6,
    DEFAULT_VIPS,
    ETH,
    IFA_F_NODAD,
    LAN6_NET,
    LAN_PREFIXLEN,
    LB_IP,
    LB_IP6,
    MAC_FMT,
    MAX_BACKENDS,
    NUD_PERMANENT,
    VIP6_NET,
    VIP_NET,
    Lab,
    LabError,
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
CLUSTER_MAC = CLUSTER_MAC_FMT.format(1)  # the appliance's eth1 (LB_CLUSTER_IP's last octet)
# Cluster-side addresses free for SNAT pools: above the appliance's, below the backends'.
SNAT_RANGE = tuple(f"198.19.0.{i}" for i in range(2, 10))
# Dual stack: the cluster network's IPv6 twin (the client network's is the one-LAN
# lab's LAN6_NET), laid out the same way.
CLUSTER_NET6 = "fd48:4c03::/64"
LB_CLUSTER_IP6 = "fd48:4c03::1"
CLUSTER6_PREFIXLEN = 64
SNAT_RANGE6 = tuple(f"fd48:4c03::{i}" for i in range(2, 10))

assert MAX_BACKENDS + 10 < 255  # backend i is 198.19.0.(10+i)
assert ipaddress.ip_address(LB_CLUSTER_IP) in ipaddress.ip_network(CLUSTER_NET)
assert not ipaddress.ip_network(CLUSTER_NET).overlaps(ipaddress.ip_network(VIP_NET))
assert not any(ipaddress.ip_network(CLUSTER_NET6).overlaps(ipaddress.ip_network(n))
               for n in (VIP6_NET, LAN6_NET))


def cluster_backend_ip(i: int) -> str:
    """Address of backend ``i`` (1-based) on the cluster network."""
    return f"198.19.0.{10 + i}"


def cluster_backend_ip6(i: int) -> str:
    """IPv6 address of backend ``i`` (1-based) on the dual-stack cluster network."""
    return f"fd48:4c03::{10 + i}"


class GatewayLab(Lab):
    """The lab with the appliance between a client network and a cluster network.

    Same life cycle as ``Lab`` (``with GatewayLab(...) as lab``, ``up``/``down``,
    teardown on exceptions, SIGINT/SIGTERM and exit, ``Lab.cleanup_stale(prefix)``).
    ``ip_of("lb")`` is the appliance's client-side address (what the client routes
    through); ``gateway_ip`` its cluster-side one (the backends' default route); a
    dual-stack lab's ``ip6_of`` and ``gateway_ip6`` are their IPv6 twins.
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
        allowed = SNAT_RANGE + (SNAT_RANGE6 if ipv6 else ())
        if any(ip not in allowed for ip in snat_ips) or len(set(snat_ips)) != len(snat_ips):
            six = f" or {SNAT_RANGE6[0]}-{SNAT_RANGE6[-1]} (dual stack)" if ipv6 else ""
            raise ValueError(f"snat_ips must be distinct addresses of {SNAT_RANGE[0]}-"
                             f"{SNAT_RANGE[-1]}{six}")
        self.snat_ips = tuple(snat_ips)

    # ------------------------------------------------------------------ naming

    @property
    def gateway_ip(self) -> str:
        """The appliance's cluster-side address: the backends' default route."""
        return LB_CLUSTER_IP

    @property
    def gateway_ip6(self) -> str:
        """The appliance's cluster-side IPv6 address (dual stack): the backends'
        IPv6 default route."""
        if not self.ipv6:
            raise LabError("this lab has no IPv6 addresses (ipv6=False)")
        return LB_CLUSTER_IP6

    @property
    def snat_ips4(self) -> tuple[str, ...]:
        return tuple(ip for ip in self.snat_ips if ":" not in ip)

    @property
    def snat_ips6(self) -> tuple[str, ...]:
        return tuple(ip for ip in self.snat_ips if ":" in ip)

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

    def ip6_of(self, role: str) -> str:
        role = role.rsplit("-", 1)[-1]
        if self.ipv6 and role.startswith("b") and role[1:].isdigit():
            return cluster_backend_ip6(int(role[1:]))
        return super().ip6_of(role)

    def ports(self) -> list[Port]:
        def six(address: str) -> str | None:
            return address if self.ipv6 else None

        client = [Port(r, ETH, self.peer(r), BRIDGE, self.ip_of(r), LAN_PREFIXLEN,
                       MAC_FMT.format(_last_octet(self.ip_of(r))),
                       self.ip6_of(r) if self.ipv6 else None) for r in ("cli", "lb")]
        cluster = [Port("lb", CLUSTER_ETH, LB_CLUSTER_PEER, CLUSTER_BRIDGE, LB_CLUSTER_IP,
                        CLUSTER_PREFIXLEN, CLUSTER_MAC, six(LB_CLUSTER_IP6),
                        CLUSTER6_PREFIXLEN)]
        cluster += [Port(f"b{i}", ETH, self.peer(f"b{i}"), CLUSTER_BRIDGE,
                         cluster_backend_ip(i), CLUSTER_PREFIXLEN, _cluster_mac(i),
                         six(cluster_backend_ip6(i)), CLUSTER6_PREFIXLEN)
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
                self._backend_routes(ipr)

    # ------------------------------------------------------------------ building

    def _configure_routes(self, role: str, ipr: NetNS) -> None:
        if role == "cli":
            # The appliance is the client network's gateway: VIPs and the cluster.
            ipr.route("add", dst="0.0.0.0", dst_len=0, gateway=LB_IP)
            if self.ipv6:
                _static_neighbour(ipr, ETH, LB_IP6, MAC_FMT.format(_last_octet(LB_IP)))
                ipr.route("add", dst="::", dst_len=0, gateway=LB_IP6, family=AF_INET6)
        elif role == "lb":
            self._vips_on_lo(ipr, ipr.link_lookup(ifname="lo")[0])
            eth1 = ipr.link_lookup(ifname=CLUSTER_ETH)[0]
            for ip in self.snat_ips:
                v6 = ":" in ip
                ipr.addr("add", index=eth1, address=ip, prefixlen=128 if v6 else 32,
                         **({"flags": IFA_F_NODAD} if v6 else {}))
            if self.ipv6:
                _static_neighbour(ipr, ETH, CLIENT_IP6, MAC_FMT.format(_last_octet(CLIENT_IP)))
                for i in range(1, self.backends + 1):
                    _static_neighbour(ipr, CLUSTER_ETH, cluster_backend_ip6(i), _cluster_mac(i))
        else:
            # Replies go back through the appliance, to be translated back.
            self._backend_routes(ipr)

    def _backend_routes(self, ipr: NetNS) -> None:
        """A backend's default routes through the appliance's cluster side (and, in
        dual stack, the appliance's static neighbour entry: module doc)."""
        ipr.route("replace", dst="0.0.0.0", dst_len=0, gateway=LB_CLUSTER_IP)
        if self.ipv6:
            _static_neighbour(ipr, ETH, LB_CLUSTER_IP6, CLUSTER_MAC)
            ipr.route("replace", dst="::", dst_len=0, gateway=LB_CLUSTER_IP6, family=AF_INET6)

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
            if self.ipv6:
                values["net.ipv6.conf.all.forwarding"] = "1"
        if role.startswith("b") and self.ipv6:
            # A link taken down and up (set_backend_link) keeps the IPv6 address, as it
            # keeps the IPv4 one; the kernel's default would remove it.
            values |= {f"net.ipv6.conf.{dev}.keep_addr_on_down": "1"
                       for dev in ("all", "default", ETH)}
        return values


def _last_octet(ip: str) -> int:
    return int(ip.rsplit(".", 1)[1])


def _cluster_mac(i: int) -> str:
    """Backend ``i``'s MAC on the cluster network."""
    return CLUSTER_MAC_FMT.format(_last_octet(cluster_backend_ip(i)))


def _static_neighbour(ipr: NetNS, ifname: str, address: str, mac: str) -> None:
    """A permanent neighbour entry (module doc: why the lab's IPv6 ones are static)."""
    ipr.neigh("replace", dst=address, lladdr=mac, ifindex=ipr.link_lookup(ifname=ifname)[0],
              state=NUD_PERMANENT)
