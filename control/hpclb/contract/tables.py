"""The data-plane tables as the control plane sees them.

``TableSet`` is the complete desired state of one data plane (hash key, VIPs,
backends, one Maglev ring per VIP). The controller builds one from the
configuration; ``push.py`` turns the difference between two of them into table
protocol operations. The numpy dtypes mirror ``dataplane/common/lb_tables.h``;
``tests/unit/test_tables_layout.py`` compiles that header and checks every size.
"""

from __future__ import annotations

import enum
import ipaddress
import math
from dataclasses import dataclass, field

import numpy as np

# Mirrors of lb_tables.h constants (checked against the header by a test).
PROTOCOL_VERSION = 2
MAX_VIPS = 64
MAX_BACKENDS = 4096
RING_SIZE_DEFAULT = 65537
RING_SIZE_MAX = 1048573
MAX_PORTS = 8
MAX_FLOWS = 1048576
HASH_KEY_LEN = 16
RING_PROBES = 8
NO_BACKEND = 0xFFFFFFFF

STAT_NAMES = (
    "rx",
    "fwd_tx",
    "fwd_redirect",
    "pass_not_ipv4",
    "pass_not_vip",
    "pass_fragment",
    "drop_malformed",
    "drop_no_backend",
    "drop_tx_error",
    "flow_hit",
    "flow_new",
    "flow_repin",
    "arp_reply",
    "flow_evict",
    "conn_new",
    "conn_hit",
    "conn_reply",
    "conn_evict",
    "conn_reschedule",
    "nat_icmp",
    "drop_conn_full",
    "drop_snat_exhausted",
    "drop_backend_down",
    "drop_conn_invalid",
    "ndp_reply",
    "pass_ext_headers",
    "tunnel_encap",
    "drop_encap",
)

# NAT mode's connection table (lb_tables.h, "NAT mode: the connection table").
CONN_STATE_NAMES = (
    "syn_sent",
    "syn_recv",
    "established",
    "fin_wait",
    "time_wait",
    "close",
    "udp_unreplied",
    "udp_replied",
)
CONN_TIMEOUTS_DEFAULT = (120, 60, 432000, 120, 120, 10, 30, 120)  # seconds, by state
CONN_TABLE_DEFAULT = 524288  # entries, two per connection
CONN_TABLE_MIN = 4
CONN_TABLE_MAX = 33554432
CONN_EVICT_TRIES = 4
MAX_SNAT_ADDRS = 16
SNAT_PROBES = 8

IPPROTO_TCP = 6
IPPROTO_UDP = 17
PROTOCOLS = {"tcp": IPPROTO_TCP, "udp": IPPROTO_UDP}


class BackendState(enum.IntEnum):
    UP = 0
    DRAINING = 1
    DOWN = 2
    UNUSED = 3


class Family(enum.IntEnum):
    """enum lb_family: the IP version number."""

    V4 = 4
    V6 = 6


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def family_of(addr: IPAddress) -> Family:
    return Family(addr.version)


def addr_from_wire(raw: bytes) -> IPAddress:
    """An address field of the table protocol: bin 4 (IPv4) or bin 16 (IPv6)."""
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw)
    if len(raw) == 16:
        return ipaddress.IPv6Address(raw)
    raise ValueError(f"an address is 4 or 16 bytes, got {len(raw)}")


class VipMode(enum.IntEnum):
    DSR = 0
    NAT = 1
    TUNNEL = 2


class Encap(enum.IntEnum):
    """enum lb_encap: tunnel mode's encapsulation (dataplane/common/lb_encap.h)."""

    IPIP = 0
    GUE = 1


GUE_PORT_DEFAULT = 6080
TUNNEL_SRC_BITS_MAX = 16


class ConnState(enum.IntEnum):
    """enum lb_conn_state."""

    SYN_SENT = 0
    SYN_RECV = 1
    ESTABLISHED = 2
    FIN_WAIT = 3
    TIME_WAIT = 4
    CLOSE = 5
    UDP_UNREPLIED = 6
    UDP_REPLIED = 7


class NatDown(enum.IntEnum):
    """enum lb_nat_down: what a NAT VIP's down backend does to its connections."""

    RESCHEDULE = 0  # the next packet opens a new connection on an up backend
    DROP = 1  # packets dropped until the backend returns or the entry expires


VIP_F_SNAT = 0x01
CONN_F_SNAT = 0x01


# numpy views of the C structs (little-endian host, network-order fields kept as bytes).
# union lb_addr is "16u1": an IPv4 address in its first 4 bytes, the rest 0.
VIP_KEY_DTYPE = np.dtype(
    [("addr", "16u1"), ("port", ">u2"), ("proto", "u1"), ("family", "u1")]
)
VIP_ENTRY_DTYPE = np.dtype(
    [("vip_id", "<u4"), ("mode", "u1"), ("tunnel_family", "u1"), ("nat_port", ">u2"),
     ("tunnel_src", "16u1"), ("nat_flags", "u1"), ("tunnel_encap", "u1"), ("gue_port", ">u2"),
     ("tunnel_src_bits", "u1"), ("pad", "3u1")]
)
BACKEND_DTYPE = np.dtype(
    [("addr", "16u1"), ("family", "u1"), ("mac", "6u1"), ("state", "u1"), ("port", "u1"),
     ("pad", "3u1")]
)
RING_PATCH_DTYPE = np.dtype([("slot", "<u4"), ("backend", "<u4")])
FLOW_KEY_DTYPE = np.dtype(
    [("saddr", "16u1"), ("daddr", "16u1"), ("sport", ">u2"), ("dport", ">u2"), ("proto", "u1"),
     ("family", "u1"), ("pad", "2u1")]
)
FLOW_ENTRY_DTYPE = np.dtype([("backend", "<u4"), ("vip_id", "<u4"), ("pinned_ns", "<u8")])
PORT_DTYPE = np.dtype([("ifindex", "<u4"), ("mac", "6u1"), ("pad", "<u2")])
COUNTER_DTYPE = np.dtype([("packets", "<u8"), ("bytes", "<u8")])
CONFIG_DTYPE = np.dtype([("hash_key", "16u1"), ("ring_size", "<u4"), ("flags", "<u4")])
FLOW_KEY_V4_DTYPE = np.dtype(
    [("saddr", "4u1"), ("daddr", "4u1"), ("sport", ">u2"), ("dport", ">u2"), ("proto", "u1"),
     ("pad", "3u1")]
)
CONN_DTYPE = np.dtype(
    [("peer", FLOW_KEY_V4_DTYPE), ("last_seen_ns", "<u8"), ("backend_id", "<u4"),
     ("vip_id", "u1"), ("dir", "u1"), ("state", "u1"), ("fin_dirs", "u1"),
     ("client_mac", "6u1"), ("client_port", "u1"), ("flags", "u1")]
)
CONN6_DTYPE = np.dtype(
    [("peer", FLOW_KEY_DTYPE), ("last_seen_ns", "<u8"), ("backend_id", "<u4"),
     ("vip_id", "u1"), ("dir", "u1"), ("state", "u1"), ("fin_dirs", "u1"),
     ("client_mac", "6u1"), ("client_port", "u1"), ("flags", "u1")]
)
NAT_CONFIG_DTYPE = np.dtype(
    [("snat_addrs", "16>u4"), ("snat_naddrs", "<u4"), ("snat_port_min", "<u2"),
     ("snat_port_max", "<u2"), ("on_backend_down", "u1"), ("pad", "3u1"),
     ("timeouts_s", "8<u4"), ("snat_addrs6", "(16,16)u1"), ("snat_naddrs6", "<u4")]
)


def mac_bytes(mac: str) -> bytes:
    """'aa:bb:cc:dd:ee:ff' -> 6 bytes."""
    parts = mac.split(":")
    if len(parts) != 6:
        raise ValueError(f"bad MAC address {mac!r}")
    return bytes(int(p, 16) for p in parts)


def mac_str(raw: bytes) -> str:
    return ":".join(f"{b:02x}" for b in raw)


@dataclass(frozen=True)
class Vip:
    vip_id: int
    addr: IPAddress
    port: int
    proto: int
    mode: VipMode = VipMode.DSR
    #: NAT mode's backend port (0 = the VIP's port); carried since protocol 2.
    nat_port: int = 0
    #: Tunnel mode's outer source address; carried since protocol 2.
    tunnel_src: IPAddress | None = None
    #: NAT mode: connections also take a source address and port from the
    #: SNAT pool (NatConfig.snat_addrs).
    snat: bool = False
    #: Tunnel mode: IPIP or GUE (lb_encap.h).
    tunnel_encap: Encap = Encap.IPIP
    #: Tunnel mode, GUE: the outer UDP destination port (0 unless GUE).
    gue_port: int = 0
    #: Tunnel mode: low bits of tunnel_src's last 16 that each flow sets
    #: (0..TUNNEL_SRC_BITS_MAX), so that backends' RSS spreads tunnelled flows.
    tunnel_src_bits: int = 0

    @property
    def family(self) -> Family:
        return family_of(self.addr)

    @property
    def key(self) -> tuple[IPAddress, int, int]:
        return (self.addr, self.port, self.proto)


@dataclass(frozen=True)
class Backend:
    backend_id: int
    addr: IPAddress
    mac: str
    state: BackendState = BackendState.UP
    port: int = 0

    @property
    def family(self) -> Family:
        return family_of(self.addr)


@dataclass(frozen=True)
class NatConfig:
    """struct lb_nat_config: the NAT mode's settings, one per data plane."""

    snat_addrs: tuple[IPAddress, ...] = ()
    snat_port_min: int = 1024
    snat_port_max: int = 65535
    on_backend_down: NatDown = NatDown.RESCHEDULE
    timeouts_s: tuple[int, ...] = CONN_TIMEOUTS_DEFAULT  # by ConnState


@dataclass
class TableSet:
    """Everything one data plane holds, as the control plane wants it."""

    hash_key: bytes
    ring_size: int = RING_SIZE_DEFAULT
    vips: dict[int, Vip] = field(default_factory=dict)
    backends: dict[int, Backend] = field(default_factory=dict)
    rings: dict[int, np.ndarray] = field(default_factory=dict)
    nat: NatConfig = field(default_factory=NatConfig)

    def vip_for(self, addr: IPAddress, port: int, proto: int) -> Vip | None:
        for vip in self.vips.values():
            if vip.key == (addr, port, proto):
                return vip
        return None


def is_prime(n: int) -> bool:
    """Trial division; ring sizes are at most about a million, so this is instant.
    The data planes and the configuration take prime ring sizes only (a
    Maglev walk must visit every slot)."""
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))
