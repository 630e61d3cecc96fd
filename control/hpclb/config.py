"""hpclb configuration: pydantic models and a YAML loader whose errors name file, line and field.

    cfg = load_config("appliance/examples/lab.yaml")   # raises ConfigError
    cfg.appliance.hash_key_bytes, cfg.pools["web"].backends[0].address, ...

A ConfigError's str() is one line per problem, sorted by position:
``lab.yaml:14:11: vips[0].port: Input should be less than or equal to 65535 (got 70000)``.
A file over MAX_CONFIG_BYTES is refused before it is parsed. libyaml parses when
PyYAML has it (its pure-Python parser takes seconds for 4,096 backends); YAML
errors are reported by the pure-Python parser, so messages never depend on it.
"""

from __future__ import annotations

import contextlib
import difflib
import gc
import os
import re
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from ipaddress import IPv4Address
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hpclb.dataplane import tables
from hpclb.probes.config import ProbeConfig
from hpclb.weights import WeightPolicy

# Limits of dataplane/common/lb_tables.h, through its Python mirror (checked
# against the header by tests/unit/test_tables_layout.py).
LB_MAX_VIPS = tables.MAX_VIPS
LB_MAX_BACKENDS = tables.MAX_BACKENDS
LB_MAX_PORTS = tables.MAX_PORTS  # egress ports, index 0 is the ingress port itself
LB_MAX_FLOWS = tables.MAX_FLOWS
LB_RING_SIZE_DEFAULT = tables.RING_SIZE_DEFAULT
LB_RING_SIZE_MAX = tables.RING_SIZE_MAX
LB_HASH_KEY_LEN = tables.HASH_KEY_LEN

Loc = tuple[str | int, ...]

DEFAULT_TELEMETRY_PORT = 5557

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


class BackendState(StrEnum):
    UP = "up"
    DRAINING = "draining"
    DOWN = "down"


class VipProtocol(StrEnum):
    TCP = "tcp"
    UDP = "udp"

    @property
    def number(self) -> int:
        return 6 if self is VipProtocol.TCP else 17


class VipMode(StrEnum):
    DSR = "dsr"
    NAT = "nat"  # reserved (lb_vip_mode LB_MODE_NAT)
    TUNNEL = "tunnel"  # reserved (LB_MODE_TUNNEL)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Problems(ValueError):
    """Cross-field problems, each with its own location (relative to the model's root)."""

    def __init__(self, problems: list[tuple[Loc, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{_path(loc)}: {msg}" for loc, msg in problems))


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))


def _not_a_number(value: Any) -> Any:
    if isinstance(value, int | float) and not isinstance(value, bool):
        raise ValueError("must be a string; quote it so YAML does not read it as a number")
    return value


class XdpConfig(_Strict):
    mode: XdpMode = XdpMode.AUTO
    flow_table_size: int = Field(LB_MAX_FLOWS, strict=True, ge=1, le=LB_MAX_FLOWS)


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
    egress: list[IfName] = Field(default_factory=list, max_length=LB_MAX_PORTS - 1)

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
    ring_size: int = Field(LB_RING_SIZE_DEFAULT, strict=True)
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
        if not re.fullmatch(rf"[0-9a-fA-F]{{{2 * LB_HASH_KEY_LEN}}}", v):
            raise ValueError(
                f"must be {2 * LB_HASH_KEY_LEN} hex digits ({LB_HASH_KEY_LEN} bytes), "
                f"got {len(v)} characters"
            )
        return v.lower()

    @field_validator("ring_size")
    @classmethod
    def _ring_prime(cls, v: int) -> int:
        if not 3 <= v <= LB_RING_SIZE_MAX:
            raise ValueError(f"must be between 3 and {LB_RING_SIZE_MAX}, got {v}")
        if not _is_prime(v):
            raise ValueError(f"must be a prime, {v} is not (the default is {LB_RING_SIZE_DEFAULT})")
        return v

    @property
    def hash_key_bytes(self) -> bytes:
        return bytes.fromhex(self.hash_key)


class BackendConfig(_Strict):
    name: Name
    address: IPv4Address
    weight: float = Field(1.0, strict=True, ge=0, allow_inf_nan=False)
    mac: str | None = None
    via: IfName | None = None
    state: BackendState = BackendState.UP

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
    # The pool's weight formula and dynamics (dynamic pools; slow_start_s applies
    # to static pools too): a GPU pool sets gpu > 0 (hybrid sharding: GPU nodes
    # weighed by their free GPU memory too).
    policy: WeightPolicy = Field(default_factory=WeightPolicy)
    # Health probe of every backend of the pool; none: only the admin state and
    # (with an agent) missed heartbeats take a backend out.
    probe: ProbeConfig | None = None
    backends: list[BackendConfig] = Field(default_factory=list, max_length=LB_MAX_BACKENDS)


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

    def endpoint(self, management: IPv4Address | None) -> str:
        """The endpoint to bind: ``bind``, else the management address's port 5557."""
        return self.bind or f"tcp://{management}:{DEFAULT_TELEMETRY_PORT}"

    @property
    def bind_host(self) -> str | None:
        """The host part of ``bind`` as written; None when it is not set."""
        return None if self.bind is None else self.bind[len("tcp://"):].rpartition(":")[0]


class VipConfig(_Strict):
    name: Name
    address: IPv4Address
    port: int = Field(strict=True, ge=1, le=65535)
    protocol: VipProtocol = VipProtocol.TCP
    mode: VipMode = VipMode.DSR
    pool: Name

    @field_validator("mode")
    @classmethod
    def _implemented(cls, v: VipMode) -> VipMode:
        if v is not VipMode.DSR:
            raise ValueError(f"mode {v.value!r} is not implemented yet (only 'dsr' is)")
        return v


class HpclbConfig(_Strict):
    appliance: ApplianceConfig
    telemetry: TelemetryConfig | None = None
    pools: dict[Name, PoolConfig] = Field(default_factory=dict)
    vips: list[VipConfig] = Field(default_factory=list, max_length=LB_MAX_VIPS)

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
        for loc, host, what in services:
            if host is None:
                if management is None:
                    add((loc, f"no address for the {what} service: give one here or set "
                              "appliance.management_address"))
                continue
            try:
                addr = IPv4Address(host)
            except ValueError:
                add((loc, f"{host!r} is not an IPv4 address (a name could resolve to "
                          "anything; give the management address itself)"))
                continue
            if addr.is_unspecified:
                add((loc, f"{host} is a wildcard: it reaches every address of the "
                          "appliance, VIPs included; bind the management address"))
            elif addr in vips:
                add((loc, f"{host} is a VIP: clients would reach the {what} service "
                          "through it; bind the management address"))

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
                            f"backend {b.name!r} already defined at {_path(seen_backend[b.name])}",
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
        if len(seen_backend) > LB_MAX_BACKENDS:
            add((("pools",), f"{len(seen_backend)} backends, at most {LB_MAX_BACKENDS}"))
        seen_name: dict[str, int] = {}
        seen_key: dict[tuple[IPv4Address, int, VipProtocol], int] = {}
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


# ---- loading ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigIssue:
    source: str
    line: int | None  # 1-based
    column: int | None  # 1-based
    path: str  # "vips[0].port", "" for the document or the YAML syntax
    message: str

    def __str__(self) -> str:
        where = self.source + "".join(f":{n}" for n in (self.line, self.column) if n is not None)
        return "".join(f"{part}: " for part in (where, self.path) if part) + self.message


class ConfigError(Exception):
    """A configuration that cannot be used; str() is one line per problem (`issues`)."""

    def __init__(self, issues: list[ConfigIssue] | str) -> None:
        if isinstance(issues, str):  # a plain message from elsewhere (CLI, REST)
            issues = [ConfigIssue("", None, None, "", issues)]
        self.issues = sorted(issues, key=lambda i: (i.line or 0, i.column or 0))
        super().__init__("\n".join(map(str, self.issues)))


def _short(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _path(loc: Loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


# The largest configuration accepted, in bytes, checked before any parsing. 4,096
# backends (the data planes' limit) take about 340 kB written one per line with
# name, address, weight and MAC, and under 1 MB spelt out in block style with
# every field and a comment each: 4 MiB (1 KiB per backend) leaves that room
# several times over, while a file far beyond any valid configuration is refused
# at once instead of costing its parse (a 5 MB file took 40 s and 0.5 GB).
MAX_CONFIG_BYTES = 4 << 20


def _too_large(source: str, size: int | None) -> ConfigError:
    got = f"{size} bytes, " if size is not None else ""
    msg = (f"configuration too large: {got}over the limit of {MAX_CONFIG_BYTES} bytes "
           f"({MAX_CONFIG_BYTES >> 20} MiB)")
    return ConfigError([ConfigIssue(source, None, None, "", msg)])


class _Constructing(yaml.constructor.SafeConstructor):
    """The construction both loaders share (PyYAML's SafeConstructor, made strict)."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except yaml.YAMLError:
            raise
        except Exception as exc:  # PyYAML's constructors raise anything on e.g. `!!int abc`
            problem = f"cannot read {_short(node.value)} as {node.tag}: {str(exc)[:200]}"
            raise yaml.constructor.ConstructorError(None, None, problem, node.start_mark) from exc

    def construct_yaml_timestamp(self, node: yaml.Node) -> Any:  # type: ignore[override]
        return self.construct_scalar(node)  # no dates in this schema; keep the text


class _Loader(_Constructing, yaml.SafeLoader):
    """The pure-Python loader: the reference, whose YAML error messages are reported."""


_Loader.add_constructor("tag:yaml.org,2002:timestamp", _Loader.construct_yaml_timestamp)

_FastLoader: type[_Constructing] | None = None
if getattr(yaml, "__with_libyaml__", False):

    class _CLoader(_Constructing, yaml.CSafeLoader):
        """libyaml's parser and composer (same nodes, same marks, ten times faster);
        any YAML error it finds is reported by _Loader instead, so messages stay the same."""

    _CLoader.add_constructor("tag:yaml.org,2002:timestamp", _CLoader.construct_yaml_timestamp)
    _FastLoader = _CLoader

_MERGE = "tag:yaml.org,2002:merge"
_MODELS = (HpclbConfig, ApplianceConfig, InterfacesConfig, XdpConfig, PoolConfig, BackendConfig)
_KNOWN_KEYS = sorted({key for model in (*_MODELS, VipConfig) for key in model.model_fields})


def _duplicate_keys(root: yaml.Node, source: str) -> list[ConfigIssue]:
    """A mapping key given twice (YAML would silently keep the last value).

    Run before construction, which rewrites mappings that use merge keys (`<<`).
    Only collections are walked (scalars cannot hold keys), each node once:
    aliases share nodes, which also stops cycles.
    """
    issues: list[ConfigIssue] = []
    seen: set[int] = set()
    stack: list[tuple[tuple[str, ...], yaml.Node]] = [((), root)]
    while stack:
        path, node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                if not isinstance(item, yaml.ScalarNode):
                    stack.append(((*path, str(i)), item))
        elif isinstance(node, yaml.MappingNode):
            keys: set[tuple[str, str]] = set()
            for k, v in node.value:
                if not isinstance(k, yaml.ScalarNode) or k.tag == _MERGE:
                    continue
                if (k.tag, k.value) in keys:
                    m = k.start_mark
                    where = _path(tuple(int(p) if p.isdigit() else p for p in (*path, k.value)))
                    issues.append(
                        ConfigIssue(source, m.line + 1, m.column + 1, where, "duplicate key")
                    )
                keys.add((k.tag, k.value))
                if not isinstance(v, yaml.ScalarNode):
                    stack.append(((*path, str(k.value)), v))
    return issues


class _Marks:
    """Where a path (as strings) is in the document, found only when a problem is
    reported: the value's mark for a scalar, else its key's or item's; the nearest
    enclosing one for a path the document does not spell (a missing key)."""

    def __init__(self, root: yaml.Node) -> None:
        self.root = root
        self._keys: dict[int, dict[str, tuple[yaml.Node, yaml.Node]]] = {}

    def _entries(self, node: yaml.MappingNode) -> dict[str, tuple[yaml.Node, yaml.Node]]:
        entries = self._keys.get(id(node))
        if entries is None:  # the last of duplicate keys wins, as in construction
            entries = {str(k.value): (k, v) for k, v in node.value
                       if isinstance(k, yaml.ScalarNode) and k.tag != _MERGE}
            self._keys[id(node)] = entries
        return entries

    def __getitem__(self, path: tuple[str, ...]) -> yaml.Mark:
        node, mark = self.root, self.root.start_mark
        for part in path:
            if isinstance(node, yaml.SequenceNode):
                if not part.isdigit() or int(part) >= len(node.value):
                    break
                node = node.value[int(part)]
                mark = node.start_mark
            elif isinstance(node, yaml.MappingNode):
                entry = self._entries(node).get(part)
                if entry is None:
                    break
                key, node = entry
                mark = (node if isinstance(node, yaml.ScalarNode) else key).start_mark
            else:
                break
        return mark


def _issue(err: dict[str, Any], prefix: Loc, marks: _Marks, source: str) -> ConfigIssue:
    loc: Loc = (*prefix, *(p for p in err["loc"] if p != "[key]"))
    if "[key]" in err["loc"]:  # a bad mapping key: show it as a key even when YAML made it an int
        loc = tuple(map(str, loc))
    mark = marks[tuple(str(p) for p in loc)]
    msg = re.sub(r" or instance of \w+", "", err["msg"].removeprefix("Value error, "))
    inp = err.get("input", ...)  # absent for missing keys and cross-field problems
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
        close = difflib.get_close_matches(str(loc[-1]), _KNOWN_KEYS, n=1)
        msg += f" (did you mean {close[0]!r}?)" if close else ""
    elif isinstance(inp, str | int | float | bool | None) and str(inp) not in msg:
        msg += f" (got {_short(inp)})"
    return ConfigIssue(source, mark.line + 1, mark.column + 1, _path(loc) or "(top level)", msg)


def _read(loader_class: type[_Constructing], text: str,
          source: str) -> tuple[yaml.Node | None, Any, list[ConfigIssue]]:
    """(root node, constructed data, duplicate-key issues); YAML errors propagate."""
    loader = loader_class(text)  # type: ignore[call-arg]
    try:
        root = loader.get_single_node()  # type: ignore[attr-defined]
        if root is None:
            return None, None, []
        issues = _duplicate_keys(root, source)  # before construction, which merges `<<` keys
        return root, loader.construct_document(root), issues
    finally:
        loader.dispose()  # type: ignore[attr-defined]


def _read_reference(text: str, source: str) -> tuple[yaml.Node | None, Any, list[ConfigIssue]]:
    """_read with the pure-Python loader; its YAML errors become a ConfigError."""
    try:
        return _read(_Loader, text, source)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        msg = "; ".join(str(s) for s in (exc.context, exc.problem) if s) or "invalid YAML"
        line, col = (mark.line + 1, mark.column + 1) if mark else (None, None)
        raise ConfigError([ConfigIssue(source, line, col, "", msg)]) from None
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        ch = exc.character
        msg = f"unacceptable character #x{ord(ch) if isinstance(ch, str) else ch:04x}"
        raise ConfigError([ConfigIssue(source, line, None, "", msg)]) from None
    except (yaml.YAMLError, RecursionError) as exc:
        msg = "nesting too deep" if isinstance(exc, RecursionError) else str(exc)
        raise ConfigError([ConfigIssue(source, None, None, "", msg)]) from None


def parse_config(text: str, source_name: str = "<config>") -> HpclbConfig:
    """Parse and validate YAML text; `source_name` prefixes every error line."""
    if len(text) > MAX_CONFIG_BYTES // 4:  # 4 bytes a character at most: count only then
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > MAX_CONFIG_BYTES:
            raise _too_large(source_name, size)
    with _gc_paused():
        return _parse(text, source_name)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while a document's tens of thousands of nodes
    and objects are made: it would scan them again and again (a quarter of the
    time). Collection resumes at the end and finds any cycle (a recursive alias)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _parse(text: str, source_name: str) -> HpclbConfig:
    parsed = None
    # libyaml takes tabs where PyYAML refuses them (`port: 80<TAB># x`): a text
    # with a tab is judged by the reference loader alone, so that whether a file
    # loads never depends on whether libyaml is installed.
    if _FastLoader is not None and "\t" not in text:
        try:
            parsed = _read(_FastLoader, text, source_name)
        except MemoryError:
            raise
        except Exception:  # whatever libyaml refused, the reference loader reports it
            parsed = None
    root, data, issues = parsed if parsed is not None else _read_reference(text, source_name)
    if root is None:
        raise ConfigError([ConfigIssue(source_name, 1, None, "", "configuration is empty")])
    marks = _Marks(root)
    try:
        cfg = HpclbConfig.model_validate(data)
        if not issues:
            return cfg
    except ValidationError as exc:
        for err in exc.errors():
            problems = err.get("ctx", {}).get("error")
            if isinstance(problems, _Problems):
                for loc, msg in problems.problems:
                    sub = {"loc": loc, "msg": msg, "type": "cross"}
                    issues.append(_issue(sub, tuple(err["loc"]), marks, source_name))
            else:
                issues.append(_issue(err, (), marks, source_name))
    except RecursionError:
        issues.append(ConfigIssue(source_name, None, None, "", "nesting too deep"))
    raise ConfigError(issues)


def load_config(path: str | Path) -> HpclbConfig:
    """Read and validate a YAML configuration file; any problem raises ConfigError.

    A file larger than MAX_CONFIG_BYTES is refused before it is parsed (and read
    no further than that, whatever it is)."""
    name = str(path)
    try:
        with open(path, encoding="utf-8") as f:
            st = os.fstat(f.fileno())
            if stat.S_ISREG(st.st_mode) and st.st_size > MAX_CONFIG_BYTES:
                raise _too_large(name, st.st_size)
            text = f.read(MAX_CONFIG_BYTES + 1)  # characters: at least as many bytes
            if len(text) > MAX_CONFIG_BYTES:  # a file that grew, a pipe, a device
                raise _too_large(name, None)
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError([ConfigIssue(name, None, None, "", f"cannot read: {reason}")]) from None
    return parse_config(text, name)
