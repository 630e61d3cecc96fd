"""The reference model of the data-plane semantics: frame in, verdict out.

This is the oracle of the conformance suite: the XDP program and the DPDK
forwarder must give, for every case, the verdict, the output frame and the
backend this model gives. It follows ``dataplane/xdp/lb.bpf.c`` step by step
and is written for clarity, not speed.

The tables are family-aware (table protocol 2: a VIP or backend may be IPv6),
the fast paths are not yet: every IPv6 frame, one to a configured IPv6 VIP
included, passes to the kernel as ``pass_not_ipv4``, exactly as the data
planes do. Only IPv4 VIPs match IPv4 frames.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass, field

from hpclb.contract.flowhash import flow_hash, probe_slot
from hpclb.contract.tables import (
    IPPROTO_TCP,
    IPPROTO_UDP,
    NO_BACKEND,
    RING_PROBES,
    BackendState,
    TableSet,
    mac_bytes,
)

ETH_HLEN = 14
ETH_P_IP = 0x0800
ETH_P_ARP = 0x0806
ARP_REQUEST_HEAD = bytes.fromhex("0001080006040001")  # Ethernet/IPv4, hlen 6, plen 4, request
ARP_LEN = 28
IP_MF = 0x2000
IP_OFFSET = 0x1FFF

FlowTuple = tuple[int, int, int, int, int]  # saddr, daddr, sport, dport, proto (host ints)


@dataclass(frozen=True)
class Verdict:
    """What a data plane does with one frame."""

    action: str  # "tx" | "redirect" | "pass" | "drop"
    reason: str  # the lb_stat counter this frame is accounted to (LB_STAT_NAMES)
    frame: bytes  # the frame as it leaves (unchanged for pass/drop)
    backend_id: int | None = None
    port: int = 0


@dataclass
class Model:
    """Tables plus the flow-affinity memory, like one data-plane instance."""

    tables: TableSet
    port_macs: list[str]  # index 0 = the ingress port
    flows: dict[FlowTuple, int] = field(default_factory=dict)
    # The DPDK forwarder owns the port, so it answers ARP for VIP addresses
    # itself; XDP leaves ARP to the kernel, which holds the VIPs.
    answers_arp: bool = False

    def _arp_reply(self, frame: bytes) -> bytes | None:
        """The reply to an ARP request for a VIP address, or None."""
        arp = frame[ETH_HLEN : ETH_HLEN + ARP_LEN]
        if len(arp) < ARP_LEN or arp[:8] != ARP_REQUEST_HEAD:
            return None
        sender_mac, sender_ip, target_ip = arp[8:14], arp[14:18], arp[24:28]
        vip_addrs = {vip.addr.packed for vip in self.tables.vips.values() if vip.addr.version == 4}
        if target_ip not in vip_addrs:
            return None
        mac = mac_bytes(self.port_macs[0])
        reply = (bytes.fromhex("0001080006040002") + mac + target_ip + sender_mac + sender_ip)
        return sender_mac + mac + frame[12:14] + reply + frame[ETH_HLEN + ARP_LEN :]

    def _backend_state(self, backend_id: int) -> BackendState:
        backend = self.tables.backends.get(backend_id)
        return backend.state if backend else BackendState.UNUSED

    def _pick(self, vip_id: int, flow: FlowTuple) -> int:
        ring = self.tables.rings.get(vip_id)
        size = self.tables.ring_size
        if ring is None:
            return NO_BACKEND
        h = flow_hash(self.tables.hash_key, *flow)
        for n in range(RING_PROBES):
            backend_id = int(ring[probe_slot(h, size, n)])
            if backend_id == NO_BACKEND:
                continue
            if self._backend_state(backend_id) == BackendState.UP:
                return backend_id
        return NO_BACKEND

    def process(self, frame: bytes) -> Verdict:
        def verdict(action: str, reason: str) -> Verdict:
            return Verdict(action, reason, frame)

        if len(frame) < ETH_HLEN:
            return verdict("drop", "drop_malformed")
        (ethertype,) = struct.unpack_from("!H", frame, 12)
        if ethertype == ETH_P_ARP and self.answers_arp:
            reply = self._arp_reply(frame)
            if reply is not None:
                return Verdict("tx", "arp_reply", reply)
        if ethertype != ETH_P_IP:  # IPv6 too: not forwarded yet, whatever the tables hold
            return verdict("pass", "pass_not_ipv4")
        ip = frame[ETH_HLEN:]
        if len(ip) < 20:
            return verdict("drop", "drop_malformed")
        version, ihl = ip[0] >> 4, ip[0] & 0xF
        if ihl < 5 or version != 4:
            return verdict("drop", "drop_malformed")
        # The total length covers the header and fits in the frame; what follows
        # it is Ethernet padding (a 60-byte minimum frame around a 40-byte
        # packet), no part of the packet: the L4 header must fit in the packet.
        (total_length,) = struct.unpack_from("!H", ip, 2)
        if total_length < ihl * 4 or total_length > len(ip):
            return verdict("drop", "drop_malformed")
        ip = ip[:total_length]
        proto = ip[9]
        if proto not in (IPPROTO_TCP, IPPROTO_UDP):
            return verdict("pass", "pass_not_vip")
        (frag,) = struct.unpack_from("!H", ip, 6)
        if frag & (IP_MF | IP_OFFSET):
            return verdict("pass", "pass_fragment")
        l4 = ip[ihl * 4 :]
        if len(l4) < (20 if proto == IPPROTO_TCP else 8):
            return verdict("drop", "drop_malformed")
        sport, dport = struct.unpack_from("!HH", l4, 0)
        saddr, daddr = struct.unpack_from("!II", ip, 12)
        vip = self.tables.vip_for(ipaddress.IPv4Address(daddr), dport, proto)
        if vip is None:
            return verdict("pass", "pass_not_vip")

        flow: FlowTuple = (saddr, daddr, sport, dport, proto)
        backend_id = self.flows.get(flow)
        if backend_id is not None and self._backend_state(backend_id) not in (
            BackendState.UP,
            BackendState.DRAINING,
        ):
            backend_id = None  # pinned to a down backend: re-hash (task migration)
        if backend_id is None:
            backend_id = self._pick(vip.vip_id, flow)
            if backend_id == NO_BACKEND:
                return verdict("drop", "drop_no_backend")
            self.flows[flow] = backend_id

        backend = self.tables.backends[backend_id]
        if backend.port >= len(self.port_macs):
            return verdict("drop", "drop_tx_error")
        out = mac_bytes(backend.mac) + mac_bytes(self.port_macs[backend.port]) + frame[12:]
        if backend.port == 0:
            return Verdict("tx", "fwd_tx", out, backend_id, 0)
        return Verdict("redirect", "fwd_redirect", out, backend_id, backend.port)
