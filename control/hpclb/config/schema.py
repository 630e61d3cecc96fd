"""hpclb configuration: the pydantic models and their cross-field checks.

    cfg = parse_config(text)          # hpclb.config.loader, re-exported by hpclb.config
    cfg.appliance.hash_key_bytes, cfg.pools["web"].backends[0].address, ...

Limits come from the table contract (hpclb.contract.tables), so the
configuration can never ask for more than the data planes hold.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from enum import StrEnum
from ipaddress import IPv4Address, IPv4Network, IPv6Address
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from hpclb.config.addresses import AnyAddress, ip_address_text
from hpclb.config.bgp import BgpConfig
from hpclb.config.fleet import FleetConfig
from hpclb.config.probes import ProbeConfig
from hpclb.config.tunnel import TunnelConfig
from hpclb.config.vrrp import VrrpConfig
from hpclb.config.weights import WeightPolicy
from hpclb.contract import tables

Loc = tuple[str | int, ...]


def loc_path(loc: Loc) -> str:
    """("vips", 0, "port") -> "vips[0].port": a field as the user wrote it."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out

DEFAULT_TELEMETRY_PORT = 5557

NAT_NO_NAT64 = (
    "NAT mode does not translate between families (no NAT64: a connection's "
    "addresses, client, VIP, backend and SNAT, are all IPv4 or all IPv6)"
)


# A VIP's or a backend's address: the type the table contract carries. Which
# family a mode takes is checked across fields (HpclbConfig._check_families).
ServiceAddress = AnyAddress

Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")]
IfName = Annotated[str, Field(pattern=r"^[^\s/]{1,15}$")]  # IFNAMSIZ - 1; PCI addresses fit


class Dataplane(StrEnum):
    AUTO = "auto"
    XDP = "xdp"
    DPDK = "dpdk"


class XdpMode(StrEnum):
    AUTO = "auto"
    NATIVE = "native"
    GENERIC = "generic"


class WeightsMode(StrEnum):
    STATIC = "static"  # the configured weights
    DYNAMIC = "dynamic"  # configured weight x capacity left, from the nodes' telemetry


class AdminState(StrEnum):
    UP = "up"
    DRAINING = "draining"
    DOWN = "down"


class VipProtocol(StrEnum):
    TCP = "tcp"
    UDP = "udp"

    @property
    def number(self) -> int:
        return 6 if self is VipProtocol.TCP else 17


class ForwardingMode(StrEnum):
    DSR = "dsr"  # the backend holds the VIP and answers the client directly
    NAT = "nat"  # stateful NAT gateway: DNAT in, reverse out (LB_MODE_NAT, lb_conn.h)
    # DSR through a tunnel: IPIP or GUE outer headers to backends anywhere
    # routed (LB_MODE_TUNNEL, lb_encap.h); settings in a `tunnel:` block
    TUNNEL = "tunnel"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Problems(ValueError):
    """Cross-field problems, each with its own location (relative to the model's root)."""

    def __init__(self, problems: list[tuple[Loc, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{loc_path(loc)}: {msg}" for loc, msg in problems))


def _not_a_number(value: Any) -> Any:
    if isinstance(value, int | float) and not isinstance(value, bool):
        raise ValueError("must be a string; quote it so YAML does not read it as a number")
    return value


class XdpConfig(_Strict):
    mode: XdpMode = XdpMode.AUTO
    flow_table_size: int = Field(tables.MAX_FLOWS, strict=True, ge=1, le=tables.MAX_FLOWS)


class ApiConfig(_Strict):
    """The REST API and the status page (``appliance.api``), served by the
    control-plane process. Tokens come from these files and from the
    environment (HPCLB_API_READ_TOKENS, HPCLB_API_WRITE_TOKENS, comma
    separated); with none at all the API refuses to start."""

    # "host:port" or ":port" (on the management address); never a wildcard nor a VIP.
    listen: str = Field(":8443", pattern=r"^[^\s/]*:\d{1,5}$")
    # One token per line ('#' comments); not readable by others (preflight).
    read_tokens_file: Path | None = None
    write_tokens_file: Path | None = None
    # A request body larger than this is refused (413) before it is read.
    max_body_bytes: int = Field(65536, strict=True, ge=1024, le=4 * 1024 * 1024)

    def endpoint(self, management: IPv4Address | None) -> tuple[str, int]:
        """(address, port) the API binds; the management address for ":port"."""
        host, _, port = self.listen.rpartition(":")
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]  # an IPv6 address, bracketed as in a URL
        return (host or str(management)), int(port)


class DpdkDriver(StrEnum):
    AF_XDP = "af_xdp"  # a vdev on the kernel interface (AF_XDP socket)
    AF_PACKET = "af_packet"  # a vdev on the kernel interface (AF_PACKET socket)
    PCI = "pci"  # interfaces name PCI addresses of NICs bound to vfio-pci


class NumaPolicy(StrEnum):
    STRICT = "strict"  # refuse a worker lcore on another socket than its port
    WARN = "warn"


PCI_ADDRESS = re.compile(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")


class DpdkConfig(_Strict):
    # None: pci when the interfaces are PCI addresses; otherwise a vdev must
    # be asked for (af_xdp or af_packet), and `dataplane: auto` picks XDP.
    driver: DpdkDriver | None = None
    # The first lcore runs the control channel, each other one a worker with
    # its own RX/TX queue on every port.
    lcores: list[Annotated[int, Field(strict=True, ge=0, le=1023)]] = Field(
        default_factory=lambda: [0, 1], min_length=2, max_length=64)
    hugepages_mb: int = Field(512, strict=True, ge=64, le=1 << 20)
    # Grow the 2 MB hugepage pool at start when fewer are free (appliance
    # provisioning normally reserves them at boot, where memory is unfragmented).
    reserve_hugepages: bool = False
    flow_table_size: int = Field(262144, strict=True, ge=64, le=1 << 26)  # per worker
    flow_timeout_s: int = Field(300, strict=True, ge=1, le=86400)
    # 0 polls without pause (a dedicated core); a small value lets a shared or
    # lab host breathe when there is no traffic, at the cost of wake-up latency.
    idle_sleep_us: int = Field(0, strict=True, ge=0, le=100000)
    numa: NumaPolicy = NumaPolicy.WARN
    # One TAP per port gives the kernel what is not for a VIP; the addresses of
    # a vdev's kernel interface move onto it while the forwarder runs.
    exception_path: bool = True
    tap_prefix: str = Field("hpclb", pattern=r"^[A-Za-z][A-Za-z0-9_-]{0,12}$")

    @field_validator("lcores")
    @classmethod
    def _distinct_lcores(cls, v: list[int]) -> list[int]:
        if len(set(v)) != len(v):
            raise ValueError(f"lcores must be distinct, got {v}")
        return v


class InterfacesConfig(_Strict):
    ingress: IfName
    egress: list[IfName] = Field(default_factory=list, max_length=tables.MAX_PORTS - 1)

    @model_validator(mode="after")
    def _distinct(self) -> InterfacesConfig:
        problems: list[tuple[Loc, str]] = []
        for i, name in enumerate(self.egress):
            if name == self.ingress:
                problems.append((("egress", i), f"{name!r} is the ingress interface"))
            elif name in self.egress[:i]:
                problems.append((("egress", i), f"{name!r} is listed twice"))
        if problems:
            raise _Problems(problems)
        return self


class ApplianceConfig(_Strict):
    name: Name
    dataplane: Dataplane = Dataplane.AUTO
    interfaces: InterfacesConfig
    netns: str | None = Field(None, min_length=1, max_length=255)
    hash_key: str
    ring_size: int = Field(tables.RING_SIZE_DEFAULT, strict=True)
    # ipc only: the socket's file permissions (0600, root) are the guard; a tcp
    # endpoint would let anyone who reaches the port rewrite the tables.
    control_socket: str = Field("ipc:///run/hpclb/dataplane.sock", pattern=r"^ipc:///\S+$")
    xdp: XdpConfig = Field(default_factory=XdpConfig)
    dpdk: DpdkConfig = Field(default_factory=DpdkConfig)
    # The appliance's own address for its services (telemetry receiver, metrics
    # exporter), inside `netns` when that is set. Never a VIP: a service bound
    # there would be reachable by every client through the VIP.
    management_address: IPv4Address | None = None
    # Prometheus exporter, "host:port" (e.g. 10.0.0.5:9108) or ":port" (on the
    # management address); bound inside `netns`; none when unset.
    metrics: str | None = Field(None, pattern=r"^[^\s:/]*:\d{1,5}$")
    # The REST API and status page; none when unset.
    api: ApiConfig | None = None
    # The control plane's state checkpoint is written on every change and at
    # least this often (seconds).
    checkpoint_interval_s: float = Field(3600.0, ge=1.0, le=7 * 86400.0, allow_inf_nan=False)

    @property
    def metrics_endpoint(self) -> tuple[str, int] | None:
        """(address, port) the exporter binds, or None without one."""
        if self.metrics is None:
            return None
        host, _, port = self.metrics.rpartition(":")
        return (host or str(self.management_address)), int(port)

    @model_validator(mode="after")
    def _dpdk_ports(self) -> ApplianceConfig:
        names = [self.interfaces.ingress, *self.interfaces.egress]
        pci = [bool(PCI_ADDRESS.match(n)) for n in names]
        if any(pci) and not all(pci):
            raise _Problems([(("interfaces",), "mix of PCI addresses and interface names: "
                              "DPDK ports are either all NICs or all vdevs")])
        if any(pci) and self.dataplane == Dataplane.XDP:
            raise _Problems([(("dataplane",), "xdp needs kernel interface names, the "
                              "interfaces are PCI addresses")])
        if any(pci) and self.dpdk.driver not in (None, DpdkDriver.PCI):
            raise _Problems([(("dpdk", "driver"), f"{self.dpdk.driver.value} wraps a kernel "
                              "interface, the interfaces are PCI addresses")])
        if not any(pci) and self.dpdk.driver == DpdkDriver.PCI:
            raise _Problems([(("dpdk", "driver"), "pci needs the interfaces as PCI addresses "
                              "(0000:3b:00.0)")])
        return self

    @property
    def pci_ports(self) -> bool:
        return bool(PCI_ADDRESS.match(self.interfaces.ingress))

    @field_validator("hash_key", mode="before")
    @classmethod
    def _hash_key_text(cls, v: Any) -> Any:
        return _not_a_number(v)

    @field_validator("hash_key")
    @classmethod
    def _hash_key_hex(cls, v: str) -> str:
        if not re.fullmatch(rf"[0-9a-fA-F]{{{2 * tables.HASH_KEY_LEN}}}", v):
            raise ValueError(
                f"must be {2 * tables.HASH_KEY_LEN} hex digits ({tables.HASH_KEY_LEN} bytes), "
                f"got {len(v)} characters"
            )
        return v.lower()

    @field_validator("ring_size")
    @classmethod
    def _ring_prime(cls, v: int) -> int:
        if not 3 <= v <= tables.RING_SIZE_MAX:
            raise ValueError(f"must be between 3 and {tables.RING_SIZE_MAX}, got {v}")
        if not tables.is_prime(v):
            raise ValueError(f"must be a prime, {v} is not "
                             f"(the default is {tables.RING_SIZE_DEFAULT})")
        return v

    @property
    def hash_key_bytes(self) -> bytes:
        return bytes.fromhex(self.hash_key)


class BackendConfig(_Strict):
    name: Name
    address: ServiceAddress
    weight: float = Field(1.0, strict=True, ge=0, allow_inf_nan=False)
    mac: str | None = None
    via: IfName | None = None
    state: AdminState = AdminState.UP

    @field_validator("mac", mode="before")
    @classmethod
    def _mac(cls, v: Any) -> Any:
        v = _not_a_number(v)
        if not isinstance(v, str):
            return v
        octets = re.fullmatch(r"([0-9a-fA-F]{2})" + r"[:-]?([0-9a-fA-F]{2})" * 5, v.strip())
        if octets is None:
            raise ValueError("not a MAC address (expected aa:bb:cc:dd:ee:ff)")
        if int(octets[1], 16) & 1 or not any(int(o, 16) for o in octets.groups()):
            raise ValueError("must be a unicast, non-zero MAC address")
        return ":".join(octets.groups()).lower()


class PoolConfig(_Strict):
    weights: WeightsMode = WeightsMode.STATIC
    # The pool's weight formula and dynamics (dynamic pools; slow_start_s, floor
    # and grid shape the slow start of static pools too): a GPU pool sets
    # gpu > 0 (hybrid sharding: GPU nodes weighed by their free GPU memory too).
    policy: WeightPolicy = Field(default_factory=WeightPolicy)
    # Health probe of every backend of the pool; none: only the admin state and
    # (with an agent) missed heartbeats take a backend out.
    probe: ProbeConfig | None = None
    # For the NAT VIPs of this pool (mode: nat): the port its backends listen
    # on (default: each VIP's own port), and whether connections also take a
    # source address and port from nat.snat (backends whose default route is
    # not the appliance). A VIP's own backend_port and snat win over these; a
    # DSR VIP cannot use a pool that sets either.
    backend_port: int | None = Field(None, strict=True, ge=1, le=65535)
    snat: bool = False
    # For the tunnel VIPs of this pool (mode: tunnel): encapsulation and outer
    # source prefix. A VIP's own `tunnel:` block wins over this one, whole.
    tunnel: TunnelConfig | None = None
    backends: list[BackendConfig] = Field(default_factory=list, max_length=tables.MAX_BACKENDS)


class TelemetryConfig(_Strict):
    """Where the node agents publish (CURVE-authenticated ZeroMQ)."""

    # Bound inside appliance.netns when that is set (the receiver thread enters it).
    # Default: tcp://<appliance.management_address>:5557. Never a wildcard nor a
    # VIP: the port must not be reachable from the client network through a VIP.
    bind: str | None = Field(None, pattern=r"^tcp://\S+:\d+$")
    server_key: Path  # the control plane's secret key file (hpclb-agent keygen --name server)
    allow_dir: Path  # one <backend name>.key per agent: the name is the node the key speaks for
    # A backend whose agent misses this many heartbeats (its announced interval
    # each) is down until the next one arrives.
    missed_heartbeats: int = Field(3, strict=True, ge=1, le=100)
    # A connection that has not finished its CURVE handshake this long is closed.
    handshake_timeout_s: float = Field(2.0, gt=0, le=60, allow_inf_nan=False)
    # Connections accepted but not yet authenticated, at most: beyond, the
    # receiver stops accepting for a moment (the process's files stay free).
    max_unauthenticated: int = Field(256, strict=True, ge=8, le=10_000)
    # Messages per second accepted from one agent (burst: twice as many);
    # the excess is dropped and counted. Agents send every 5 s by default.
    max_rate_per_agent: float = Field(20.0, gt=0, le=10_000, allow_inf_nan=False)

    def endpoint(self, management: IPv4Address | IPv6Address | None) -> str:
        """The endpoint to bind: ``bind``, else the management address's port 5557
        (an IPv6 one in brackets)."""
        if self.bind is not None:
            return self.bind
        host = f"[{management}]" if isinstance(management, IPv6Address) else management
        return f"tcp://{host}:{DEFAULT_TELEMETRY_PORT}"

    @property
    def bind_host(self) -> str | None:
        """The host part of ``bind`` as written; None when it is not set."""
        return None if self.bind is None else self.bind[len("tcp://"):].rpartition(":")[0]


class NatDownPolicy(StrEnum):
    """What a NAT VIP's down backend does to its connections (enum lb_nat_down)."""

    # Like DSR's re-hash: the next packet opens a connection on an up backend
    # (a TCP one is then reset by that backend, which has no socket for it; a
    # UDP one simply goes on there).
    RESCHEDULE = "reschedule"
    DROP = "drop"  # dropped until the backend returns or the connection times out


def _snat_unicast(v: IPv4Address | IPv6Address) -> IPv4Address | IPv6Address:
    # The data planes' rule (lb_proto_nat_check): IPv4 not 0.0.0.0/8,
    # loopback, multicast or 240.0.0.0/4 (reserved, the broadcast address
    # included); IPv6 not ::, ::1, ff00::/8, fe80::/10 (a reply to a
    # link-local address needs a zone) nor ::ffff:0:0/96 (IPv4-mapped).
    if isinstance(v, IPv6Address):
        if v.is_unspecified or v.is_loopback or v.is_multicast or v.is_link_local or (
                v.ipv4_mapped is not None):
            raise ValueError(f"{v} is not a unicast address (::, ::1, ff00::/8, fe80::/10 "
                             "and ::ffff:0:0/96 are refused)")
        return v
    if v in IPv4Network("0.0.0.0/8") or v.is_multicast or v.is_loopback or v.is_reserved:
        raise ValueError(f"{v} is not a unicast address")
    return v


# A SNAT pool address: IPv4 or IPv6 (a VIP's connections take one of its
# family), unicast.
SnatAddress = Annotated[
    IPv4Address | IPv6Address, BeforeValidator(ip_address_text), AfterValidator(_snat_unicast)
]
_PORT_RANGE = re.compile(r"\s*(\d{1,5})\s*-\s*(\d{1,5})\s*")


class PortRange(_Strict):
    """Inclusive L4 port range, written "1024-65535" or {min: 1024, max: 65535}."""

    min: int = Field(1024, strict=True, ge=1, le=65535)
    max: int = Field(65535, strict=True, ge=1, le=65535)

    @model_validator(mode="before")
    @classmethod
    def _text(cls, v: Any) -> Any:
        if isinstance(v, str) and (m := _PORT_RANGE.fullmatch(v)) is not None:
            return {"min": int(m[1]), "max": int(m[2])}
        if not isinstance(v, dict | PortRange):
            raise ValueError("expected a range 'MIN-MAX' (e.g. '1024-65535') or "
                             "{min: 1024, max: 65535}")
        return v

    @model_validator(mode="after")
    def _ordered(self) -> PortRange:
        if self.min > self.max:
            raise ValueError(f"min {self.min} is above max {self.max}")
        return self


class SnatConfig(_Strict):
    """Source NAT for the NAT VIPs that ask for it (`snat: true` on the VIP or
    its pool): each connection takes an address of `addresses` of its VIP's
    family and a port of `ports`; the backends' replies come back to that
    address. IPv4 and IPv6 addresses may be mixed, at most
    tables.MAX_SNAT_ADDRS of each family."""

    addresses: list[SnatAddress] = Field(min_length=1, max_length=2 * tables.MAX_SNAT_ADDRS)
    ports: PortRange = Field(default_factory=PortRange)

    @field_validator("addresses")
    @classmethod
    def _distinct(cls, v: list[IPv4Address | IPv6Address]) -> list[IPv4Address | IPv6Address]:
        twice = sorted({str(a) for i, a in enumerate(v) if a in v[:i]})
        if twice:
            raise ValueError(f"listed twice: {', '.join(twice)}")
        for family in (4, 6):
            n = sum(a.version == family for a in v)
            if n > tables.MAX_SNAT_ADDRS:
                raise ValueError(f"{n} IPv{family} addresses: at most "
                                 f"{tables.MAX_SNAT_ADDRS} of each family")
        return v


# The table protocol's bound on set_nat's timeouts (PROTOCOL.md): seconds that
# fit a signed 32-bit count, about 68 years.
CONN_TIMEOUT_MAX_S = 2**31 - 1


def _timeout(state: tables.ConnState) -> Any:
    return Field(tables.CONN_TIMEOUTS_DEFAULT[state], strict=True, ge=1, le=CONN_TIMEOUT_MAX_S)


class ConnTimeouts(_Strict):
    """Idle timeouts of NAT connections by state, in seconds (one field per
    name of tables.CONN_STATE_NAMES). The defaults are the kernel conntrack's
    (nf_conntrack_tcp_timeout_*, nf_conntrack_udp_timeout{,_stream})."""

    syn_sent: int = _timeout(tables.ConnState.SYN_SENT)
    syn_recv: int = _timeout(tables.ConnState.SYN_RECV)
    established: int = _timeout(tables.ConnState.ESTABLISHED)
    fin_wait: int = _timeout(tables.ConnState.FIN_WAIT)
    time_wait: int = _timeout(tables.ConnState.TIME_WAIT)
    close: int = _timeout(tables.ConnState.CLOSE)
    udp_unreplied: int = _timeout(tables.ConnState.UDP_UNREPLIED)
    udp_replied: int = _timeout(tables.ConnState.UDP_REPLIED)

    def by_state(self) -> tuple[int, ...]:
        """The timeouts in enum lb_conn_state order (NatConfig.timeouts_s)."""
        return tuple(getattr(self, name) for name in tables.CONN_STATE_NAMES)


class NatConfig(_Strict):
    """NAT mode (VIPs with `mode: nat`): one section for the appliance."""

    # Connection-table entries, two per connection (one per direction); the
    # data plane sizes its table when it starts: a change takes effect at its
    # next start.
    conn_table_size: int = Field(tables.CONN_TABLE_DEFAULT, strict=True,
                                 ge=tables.CONN_TABLE_MIN, le=tables.CONN_TABLE_MAX)
    on_backend_down: NatDownPolicy = NatDownPolicy.RESCHEDULE
    timeouts: ConnTimeouts = Field(default_factory=ConnTimeouts)
    snat: SnatConfig | None = None

    @field_validator("conn_table_size")
    @classmethod
    def _even(cls, v: int) -> int:
        if v % 2:
            raise ValueError(f"must be even (two entries per connection), got {v}")
        return v


class VipConfig(_Strict):
    name: Name
    mode: ForwardingMode = ForwardingMode.DSR
    address: Annotated[IPv4Address | IPv6Address, BeforeValidator(ip_address_text)]
    port: int = Field(strict=True, ge=1, le=65535)
    protocol: VipProtocol = VipProtocol.TCP
    pool: Name
    # NAT mode only; each wins over the pool's setting of the same name.
    backend_port: int | None = Field(None, strict=True, ge=1, le=65535)
    snat: bool | None = None
    # Tunnel mode only; wins over the pool's `tunnel:` block, whole.
    tunnel: TunnelConfig | None = None

    @model_validator(mode="after")
    def _mode_fields(self) -> VipConfig:
        problems: list[tuple[Loc, str]] = []
        if self.mode is not ForwardingMode.NAT:
            if self.backend_port is not None:
                problems.append((("backend_port",), "only a NAT VIP (mode: nat) maps ports: a "
                                 f"{self.mode.value} backend answers from the VIP's port itself"))
            if self.snat:
                problems.append((("snat",), "only a NAT VIP (mode: nat) takes SNAT"))
        if self.mode is not ForwardingMode.TUNNEL and self.tunnel is not None:
            problems.append((("tunnel",), "only a tunnel VIP (mode: tunnel) encapsulates: "
                             f"this one is {self.mode.value}"))
        if problems:
            raise _Problems(problems)
        return self


class HpclbConfig(_Strict):
    appliance: ApplianceConfig
    telemetry: TelemetryConfig | None = None
    pools: dict[Name, PoolConfig] = Field(default_factory=dict)
    vips: list[VipConfig] = Field(default_factory=list, max_length=tables.MAX_VIPS)
    nat: NatConfig = Field(default_factory=NatConfig)
    # BGP announcements of the VIPs (hpclb.config.bgp); None: none.
    bgp: BgpConfig | None = None
    # A fleet of appliances behind ECMP (hpclb.config.fleet): weights every
    # member computes alike from the same samples; None: a lone appliance.
    fleet: FleetConfig | None = None
    # An active/standby pair with keepalived (hpclb.config.vrrp); None: none.
    vrrp: VrrpConfig | None = None

    def vip_backend_port(self, vip: VipConfig) -> int:
        """The port a VIP's backends listen on: its backend_port, else its
        pool's (NAT VIPs only: both refused with DSR), else the VIP's port."""
        pool = self.pools.get(vip.pool)
        for port in (vip.backend_port, pool.backend_port if pool else None):
            if port is not None:
                return port
        return vip.port

    def vip_snat(self, vip: VipConfig) -> bool:
        """Whether a NAT VIP's connections take a SNAT address: the VIP's
        snat, else its pool's. Never for a DSR VIP."""
        if vip.mode is not ForwardingMode.NAT:
            return False
        if vip.snat is not None:
            return vip.snat
        pool = self.pools.get(vip.pool)
        return bool(pool and pool.snat)

    def vip_tunnel(self, vip: VipConfig) -> TunnelConfig | None:
        """A tunnel VIP's tunnel settings: its own block, else its pool's.
        None for a VIP of another mode (and for a tunnel VIP without either,
        which the configuration refuses)."""
        if vip.mode is not ForwardingMode.TUNNEL:
            return None
        if vip.tunnel is not None:
            return vip.tunnel
        pool = self.pools.get(vip.pool)
        return pool.tunnel if pool else None

    def tunnel_pools(self) -> set[str]:
        """The pools tunnel VIPs use: their backends may be routed (their MAC
        in the tables is the next hop's), and no other VIP uses them."""
        return {v.pool for v in self.vips if v.mode is ForwardingMode.TUNNEL}

    def empty_pool_warnings(self) -> list[str]:
        """One line per VIP whose pool has no backend. Valid (a pool may await
        its nodes), but every packet to such a VIP is dropped: worth a warning."""
        return [f"VIP {vip.name!r} ({vip.address}:{vip.port}/{vip.protocol.value}): pool "
                f"{vip.pool!r} has no backend; its traffic is dropped until one is added"
                for vip in self.vips
                if vip.pool in self.pools and not self.pools[vip.pool].backends]

    def pool_of(self, backend: str) -> str | None:
        for name, pool in self.pools.items():
            if any(b.name == backend for b in pool.backends):
                return name
        return None

    def _check_service_addresses(self, add: Callable[[tuple[Loc, str]], None]) -> None:
        """The telemetry receiver and the metrics exporter bind one address of
        the appliance's, never a wildcard (which includes every VIP the kernel
        holds) nor a VIP."""
        vips = {v.address for v in self.vips}
        management = self.appliance.management_address
        if management is not None and management in vips:
            add((("appliance", "management_address"), f"{management} is a VIP"))
        services: list[tuple[Loc, str | None, str]] = []
        if self.telemetry is not None:
            services.append((("telemetry", "bind"), self.telemetry.bind_host, "telemetry"))
        if self.appliance.metrics is not None:
            services.append((("appliance", "metrics"),
                             self.appliance.metrics.rpartition(":")[0] or None, "metrics"))
        if self.appliance.api is not None:
            services.append((("appliance", "api", "listen"),
                             self.appliance.api.listen.rpartition(":")[0] or None, "REST API"))
        for loc, host, what in services:
            if host is None:
                if management is None:
                    add((loc, f"no address for the {what} service: give one here or set "
                              "appliance.management_address"))
                continue
            try:
                # An IPv6 address in brackets, as in tcp://[fd00::1]:5557 (the receiver
                # binds it with ZMQ_IPV6); IPv4 as written.
                addr: IPv4Address | IPv6Address = (
                    IPv6Address(host[1:-1]) if host.startswith("[") and host.endswith("]")
                    else IPv4Address(host))
            except ValueError:
                add((loc, f"{host!r} is not an IPv4 address nor an IPv6 one in brackets (a "
                          "name could resolve to anything; give the management address "
                          "itself)"))
                continue
            if addr.is_unspecified:
                add((loc, f"{host} is a wildcard: it reaches every address of the "
                          "appliance, VIPs included; bind the management address"))
            elif addr in vips:
                add((loc, f"{host} is a VIP: clients would reach the {what} service "
                          "through it; bind the management address"))

    def _check_nat(self, add: Callable[[tuple[Loc, str]], None]) -> None:
        """NAT VIPs: two interfaces (clients on the ingress port, backends behind
        an egress port), SNAT addresses when asked for, pool settings only NAT
        VIPs can use; SNAT addresses that are no one else's."""
        interfaces = self.appliance.interfaces
        dsr_users: dict[str, int] = {}  # pool -> the first DSR VIP using it
        for i, vip in enumerate(self.vips):
            pool = self.pools.get(vip.pool)
            if pool is None:
                continue  # reported as an unknown pool
            if vip.mode is not ForwardingMode.NAT:
                dsr_users.setdefault(vip.pool, i)
                continue
            if not interfaces.egress:
                add((("vips", i, "mode"),
                     "NAT mode needs two interfaces: clients on appliance.interfaces.ingress "
                     f"({interfaces.ingress}), backends behind an egress interface "
                     "(appliance.interfaces.egress is empty)"))
            else:
                one_arm = [b.name for b in pool.backends if b.via is None]
                if one_arm:
                    shown = ", ".join(one_arm[:5]) + (
                        f" and {len(one_arm) - 5} more" if len(one_arm) > 5 else "")
                    add((("vips", i, "mode"),
                         f"NAT mode needs the backends behind an egress interface, but pool "
                         f"{vip.pool!r} has {shown} on the ingress interface "
                         f"{interfaces.ingress} (no `via`): give each a `via:` of "
                         f"appliance.interfaces.egress ({', '.join(interfaces.egress)})"))
            if self.vip_snat(vip):
                loc: Loc = ("vips", i, "snat") if vip.snat else ("pools", vip.pool, "snat")
                family = vip.address.version
                if self.nat.snat is None:
                    add((loc, f"SNAT for VIP {vip.name!r} needs addresses: add "
                              "nat.snat.addresses"))
                elif not any(a.version == family for a in self.nat.snat.addresses):
                    add((loc, f"SNAT for IPv{family} VIP {vip.name!r} needs an IPv{family} "
                              "address: add one to nat.snat.addresses (a connection takes a "
                              "SNAT address of its VIP's family)"))
        for name, i in dsr_users.items():
            pool = self.pools[name]
            for key, given in (("backend_port", pool.backend_port is not None),
                               ("snat", pool.snat)):
                if given:
                    add((("pools", name, key),
                         f"only NAT VIPs can use {key}, and {self.vips[i].mode.value} VIP "
                         f"{self.vips[i].name!r} uses this pool: set it on the NAT VIPs "
                         "instead"))
        if self.nat.snat is None:
            return
        taken: dict[IPv4Address | IPv6Address, str] = {}
        for vip in self.vips:
            taken.setdefault(vip.address, f"VIP {vip.name!r}'s address")
        for pool_name, pool in self.pools.items():
            for b in pool.backends:
                taken.setdefault(b.address, f"backend {b.name!r}'s address (pool {pool_name})")
        if self.appliance.management_address is not None:
            taken.setdefault(self.appliance.management_address, "the management address")
        for i, addr in enumerate(self.nat.snat.addresses):
            if addr in taken:
                add((("nat", "snat", "addresses", i), f"{addr} is {taken[addr]}: a SNAT "
                     "address must be the appliance's alone"))

    def _check_families(self, add: Callable[[tuple[Loc, str]], None]) -> None:
        """Which family each mode's backends take (the data planes' rules):
        a DSR VIP's backends are of the VIP's family (DSR only rewrites MACs:
        the backend holds the VIP); so are a NAT VIP's (no NAT64); a tunnel VIP's backends
        are of its tunnel source's family (the outer headers'), and an IPv6
        VIP is never tunnelled over IPv4. A pool serves tunnel VIPs only or
        none: a backend has one MAC in the tables, the next hop's for a
        tunnel VIP, its own for the others."""
        reported: set[Loc] = set()

        def once(loc: Loc, msg: str) -> None:
            if loc not in reported:
                reported.add(loc)
                add((loc, msg))

        users: dict[str, dict[bool, int]] = {}  # pool -> {tunnel?: first VIP}
        for i, vip in enumerate(self.vips):
            pool = self.pools.get(vip.pool)
            if pool is None:
                continue  # reported as an unknown pool
            tunnel = vip.mode is ForwardingMode.TUNNEL
            users.setdefault(vip.pool, {}).setdefault(tunnel, i)
            if tunnel:
                self._check_tunnel_vip(i, vip, pool, once)
                continue
            for j, b in enumerate(pool.backends):
                loc: Loc = ("pools", vip.pool, "backends", j, "address")
                if vip.mode is ForwardingMode.NAT and b.address.version != vip.address.version:
                    once(loc, f"backend {b.name!r} is IPv{b.address.version} and NAT VIP "
                              f"{vip.name!r} ({vip.address}) IPv{vip.address.version}: "
                              f"{NAT_NO_NAT64}; give pool {vip.pool!r} "
                              f"IPv{vip.address.version} backends")
                elif vip.mode is ForwardingMode.DSR and b.address.version != vip.address.version:
                    once(loc, f"backend {b.name!r} is IPv{b.address.version} and DSR VIP "
                              f"{vip.name!r} ({vip.address}) IPv{vip.address.version}: DSR "
                              "only rewrites MAC addresses, the backend must hold the VIP; "
                              f"give pool {vip.pool!r} IPv{vip.address.version} backends")
        for name, first in users.items():
            other = first.get(False)
            if other is None:
                continue
            if True in first:
                vip = self.vips[other]
                add((("vips", other, "pool"),
                     f"pool {name!r} serves tunnel VIP {self.vips[first[True]].name!r}: a "
                     f"{vip.mode.value} VIP cannot share it (a backend has one MAC in the "
                     "tables, the next hop's for a tunnel VIP); give this VIP its own pool"))
            elif self.pools[name].tunnel is not None:
                add((("pools", name, "tunnel"),
                     f"only tunnel VIPs can use tunnel, and {self.vips[other].mode.value} VIP "
                     f"{self.vips[other].name!r} uses this pool"))

    def _check_tunnel_vip(self, i: int, vip: VipConfig, pool: PoolConfig,
                          once: Callable[[Loc, str], None]) -> None:
        t = self.vip_tunnel(vip)
        if t is None:
            once(("vips", i, "mode"),
                 f"tunnel mode needs the outer source prefix: add a `tunnel:` block to VIP "
                 f"{vip.name!r} or to pool {vip.pool!r} (e.g. tunnel: {{source: 172.16.0.0/24}})")
            return
        tloc: Loc = (("vips", i, "tunnel", "source") if vip.tunnel is not None
                     else ("pools", vip.pool, "tunnel", "source"))
        if vip.address.version == 6 and t.family == 4:
            once(("vips", i, "address"),
                 f"IPv6 VIP {vip.name!r} cannot be tunnelled from an IPv4 source "
                 f"({t.source}): IPv6 inside IPv4 is not carried (an IPv4 path need not "
                 "carry IPv6's minimum MTU of 1280 plus the outer header); give it an IPv6 "
                 "tunnel source and IPv6 backends")
            return
        for j, b in enumerate(pool.backends):
            if b.address.version != t.family:
                once(("pools", vip.pool, "backends", j, "address"),
                     f"backend {b.name!r} is IPv{b.address.version}, and tunnel VIP "
                     f"{vip.name!r} reaches pool {vip.pool!r} from an IPv{t.family} source "
                     f"({t.source}): the outer headers are of the source's family, so every "
                     "backend of a tunnel pool is too")
        # A host drops packets whose source is one of its own addresses (a
        # martian); every backend holds the VIPs, so an outer source equal to
        # a VIP or a backend would silently lose the flows it is picked for.
        sources = t.sources
        owners = [(v.address, f"VIP {v.name!r}") for v in self.vips]
        owners += [(b.address, f"backend {b.name!r}")
                   for p in self.pools.values() for b in p.backends]
        for addr, who in owners:
            if addr.version == sources.version and addr in sources:
                once(tloc, f"{t.source} gives outer sources {sources[0]}-{sources[-1]}, which "
                           f"include the address of {who}, {addr}: the hosts holding it drop "
                           "packets from it as martians; choose a prefix without VIP or "
                           "backend addresses")
                break

    @model_validator(mode="after")
    def _cross_check(self) -> HpclbConfig:
        problems: list[tuple[Loc, str]] = []
        add = problems.append
        egress = self.appliance.interfaces.egress
        seen_backend: dict[str, Loc] = {}
        for pool_name, pool in self.pools.items():
            if pool.weights is WeightsMode.DYNAMIC and self.telemetry is None:
                add((("pools", pool_name, "weights"),
                     "dynamic weights need the node agents' telemetry: add a top-level "
                     "`telemetry:` section (bind, server_key, allow_dir)"))
            for i, b in enumerate(pool.backends):
                loc: Loc = ("pools", pool_name, "backends", i)
                if b.name in seen_backend:
                    add(
                        (
                            (*loc, "name"),
                            f"backend {b.name!r} already defined at "
                            f"{loc_path(seen_backend[b.name])}",
                        )
                    )
                seen_backend.setdefault(b.name, loc)
                if b.via is not None and b.via not in egress:
                    add(
                        (
                            (*loc, "via"),
                            f"{b.via!r} is not an egress interface "
                            f"(appliance.interfaces.egress: {', '.join(egress) or 'none'})",
                        )
                    )
        self._check_service_addresses(add)
        self._check_nat(add)
        self._check_families(add)
        if self.bgp is not None:
            for loc, msg in self.bgp.problems({v.address for v in self.vips}):
                add((("bgp", *loc), msg))
        if self.fleet is not None and self.fleet.members \
                and self.appliance.name not in self.fleet.members:
            add((("fleet", "members"),
                 f"this appliance ({self.appliance.name!r}) is not one of the members "
                 f"({', '.join(self.fleet.members)})"))
        if self.vrrp is not None and self.vrrp.next_hop in {v.address for v in self.vips}:
            add((("vrrp", "next_hop"), f"{self.vrrp.next_hop} is a VIP: the next hop is "
                 "the address the VIPs are routed via"))
        if len(seen_backend) > tables.MAX_BACKENDS:
            add((("pools",), f"{len(seen_backend)} backends, at most {tables.MAX_BACKENDS}"))
        seen_name: dict[str, int] = {}
        seen_key: dict[tuple[IPv4Address | IPv6Address, int, VipProtocol], int] = {}
        for i, vip in enumerate(self.vips):
            if vip.pool not in self.pools:
                known = ", ".join(self.pools) or "none defined"
                add((("vips", i, "pool"), f"unknown pool {vip.pool!r} (pools: {known})"))
            if vip.name in seen_name:
                add(
                    (
                        ("vips", i, "name"),
                        f"VIP name {vip.name!r} already used by vips[{seen_name[vip.name]}]",
                    )
                )
            seen_name.setdefault(vip.name, i)
            key = (vip.address, vip.port, vip.protocol)
            if key in seen_key:
                add(
                    (
                        ("vips", i),
                        f"{vip.address}:{vip.port}/{vip.protocol} already used by "
                        f"vips[{seen_key[key]}]",
                    )
                )
            seen_key.setdefault(key, i)
        if problems:
            raise _Problems(problems)
        return self
