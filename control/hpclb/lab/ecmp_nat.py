"""NAT backends behind the ECMP fleet: ``hpclb.lab.ecmp``'s router and three
members, each member also a NAT gateway to a cluster network of its own side.

Topology (``p`` is the prefix; every veth's peer lives in ``{p}-br``)::

    client network 198.18.2.0/24 (br1): {p}-cli eth0 .2.2, {p}-rtr eth1 .2.1
    LAN 198.18.0.0/24 (br0):            {p}-rtr eth0 198.18.0.1 (BIRD 2, AS 65000)
                                        {p}-lba / -lbb / -lbc eth0 198.18.0.3 / .4 / .5
    cluster 198.19.0.0/24 (br2):        {p}-lba / -lbb / -lbc eth1 198.19.0.3 / .4 / .5
                                          SNAT (/32 on eth1)       198.19.0.6 / .7 / .8
                                        {p}-bN eth0 198.19.0.(10+N)

    client ── router ══ECMP══ lba | lbb | lbc ── backends (NAT, each member's own SNAT)

* The client, the router (BIRD 2, ECMP over the members' eBGP announcements,
  the kernel's L4 multipath hash) and the members' LAN side are
  ``hpclb.lab.ecmp``'s, unchanged (``EcmpLab``'s router configuration,
  sysctls and flooding rule).
* Each member is also a NAT gateway (``hpclb.lab.gateway``'s idea): ``eth0``
  towards the router, ``eth1`` on the cluster network, where the backends are.
  Each member holds its **own** SNAT address (``MEMBER_SNAT``, a /32 on its
  ``eth1``, so that its kernel answers the backends' ARP for it) and its
  configuration's ``nat.snat.addresses`` names that one address: the one
  member-local field of the NAT section. A backend answers a connection's SNAT
  address on-link, hence the member that translated it, whatever the router
  does in front.
* The backends hold nothing on ``lo`` and have no default route: every VIP
  connection reaches them from a member's SNAT address (on-link); the members'
  probes come from the members' own ``eth1`` addresses (on-link too).
* Unknown-unicast flooding is off towards the members' cluster-side bridge
  ports as well as their LAN ones (``hpclb.lab.ecmp``: a veth hands every frame
  to XDP whatever its destination MAC; a NIC would filter).

``EcmpNatMember`` is an ``EcmpMember`` in ``mode: nat`` with SNAT on the VIPs
and the member's own SNAT address; ``NatFlowCapture`` records, per member, the
frames the bridge hands the member for the VIP (what the router sent it; in NAT
mode a member's forwarded frames carry the backend's address, not the VIP's).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpclb.lab.ecmp import (
    CLIENT_BRIDGE,
    CLIENT_GW,
    CLIENT_MAC,
    CLIENT_NET,
    ECMP_CLIENT_IP,
    ROUTER_CLIENT_ETH,
    ROUTER_CLIENT_MAC,
    ROUTER_CLIENT_PEER,
    EcmpLab,
    EcmpMember,
    FlowCapture,
)
from hpclb.lab.gateway import (
    CLUSTER_ETH,
    CLUSTER_MAC_FMT,
    CLUSTER_PREFIXLEN,
    GatewayLab,
    cluster_backend_ip,
)
from hpclb.lab.topology import BRIDGE, ETH, LAN_PREFIXLEN, MAC_FMT, Port

CLUSTER_BRIDGE = "br2"  # br1 is the client network's in the ECMP lab
MEMBER_CLUSTER = {"lba": "198.19.0.3", "lbb": "198.19.0.4", "lbc": "198.19.0.5"}
MEMBER_SNAT = {"lba": "198.19.0.6", "lbb": "198.19.0.7", "lbc": "198.19.0.8"}
SNAT_PORTS = "20000-29999"


def _last_octet(ip: str) -> int:
    return int(ip.rsplit(".", 1)[1])


class EcmpNatLab(EcmpLab, GatewayLab):
    """The ECMP lab (client, router, three members on the LAN) with the
    backends on a cluster network behind the members (module doc).

    A ``GatewayLab`` for ``LabAppliance``'s NAT mode (backends by their cluster
    addresses, reached through ``eth1``); its own ``snat_ips`` stay empty: the
    SNAT addresses are per member (``MEMBER_SNAT``)."""

    @staticmethod
    def cluster_peer_of(member: str) -> str:
        """The bridge-side peer of ``member``'s ``eth1`` (``v-lba1``...)."""
        return f"v-{member}1"

    @staticmethod
    def snat_of(member: str) -> str:
        return MEMBER_SNAT[member]

    def ports(self) -> list[Port]:
        lan = [Port(r, ETH, self.peer(r), BRIDGE, self.ip_of(r), LAN_PREFIXLEN,
                    MAC_FMT.format(_last_octet(self.ip_of(r))))
               for r in ("rtr", *self.members)]
        plen = int(CLIENT_NET.split("/")[1])
        client = [Port("rtr", ROUTER_CLIENT_ETH, ROUTER_CLIENT_PEER, CLIENT_BRIDGE, CLIENT_GW,
                       plen, ROUTER_CLIENT_MAC),
                  Port("cli", ETH, self.peer("cli"), CLIENT_BRIDGE, ECMP_CLIENT_IP, plen,
                       CLIENT_MAC)]
        cluster = [Port(m, CLUSTER_ETH, self.cluster_peer_of(m), CLUSTER_BRIDGE,
                        MEMBER_CLUSTER[m], CLUSTER_PREFIXLEN,
                        CLUSTER_MAC_FMT.format(_last_octet(MEMBER_CLUSTER[m])))
                   for m in self.members]
        cluster += [Port(f"b{i}", ETH, self.peer(f"b{i}"), CLUSTER_BRIDGE,
                         cluster_backend_ip(i), CLUSTER_PREFIXLEN,
                         CLUSTER_MAC_FMT.format(_last_octet(cluster_backend_ip(i))))
                    for i in range(1, self.backends + 1)]
        return lan + client + cluster

    def appliance_peers(self) -> list[str]:
        # XDP_PASS on both peers of each member: its NAT program redirects out
        # of either interface (hpclb.lab.topology's docstring).
        return [*(self.peer(m) for m in self.members),
                *(self.cluster_peer_of(m) for m in self.members)]

    def _configure_routes(self, role: str, ipr: Any) -> None:
        if role == "cli":
            ipr.route("add", dst="0.0.0.0", dst_len=0, gateway=CLIENT_GW)
        elif role in self.members:
            eth1 = ipr.link_lookup(ifname=CLUSTER_ETH)[0]
            ipr.addr("add", index=eth1, address=MEMBER_SNAT[role], prefixlen=32)
        # The router needs nothing more; the backends reach every SNAT address
        # and every member's eth1 on-link.

    def _host_sysctls(self, role: str) -> dict[str, str]:
        values = super()._host_sysctls(role)
        if role in self.members:
            # NATed replies come in on eth1 to an address the member holds there,
            # but the probes' answers too: no reverse-path judgement.
            values[f"net.ipv4.conf.{CLUSTER_ETH}.rp_filter"] = "0"
        return values

    def _configure_bridge_ns(self) -> None:
        super()._configure_bridge_ns()
        for member in self.members:  # module doc: a NIC's MAC filter, cluster side too
            self.exec(self.bridge_ns, ["bridge", "link", "set", "dev",
                                       self.cluster_peer_of(member), "flood", "off"])


class EcmpNatMember(EcmpMember):
    """``EcmpMember`` in NAT mode: every VIP with ``snat: true``, ``nat.snat``
    the member's own address (``MEMBER_SNAT``) and ``snat_ports``."""

    def __init__(self, lab: EcmpNatLab, member: str, workdir: Path,
                 weights: dict[str, float], *, snat_ports: str = SNAT_PORTS,
                 **kwargs: Any) -> None:
        super().__init__(lab, member, workdir, weights, mode="nat",
                         nat={"snat": {"addresses": [MEMBER_SNAT[member]],
                                       "ports": snat_ports}},
                         vip_options={"snat": True}, **kwargs)
        self.snat_address = MEMBER_SNAT[member]


@dataclass
class NatFlowCapture(FlowCapture):
    """``FlowCapture`` of the frames the bridge sends *to* each member for the
    VIP (tcpdump ``-Q out`` on the member's LAN peer): the member the router
    chose for each frame, by client source port (a NAT member's forwarded
    frames carry the backend's address, not the VIP's)."""

    direction: str = "out"


__all__ = ["CLUSTER_BRIDGE", "MEMBER_CLUSTER", "MEMBER_SNAT", "SNAT_PORTS", "EcmpNatLab",
           "EcmpNatMember", "NatFlowCapture"]
