"""BGP announcements of the VIPs: the optional top-level `bgp:` section.

    bgp:
      local_asn: 65001
      router_id: 192.0.2.10
      peers:
        - {name: tor1, address: 192.0.2.1, asn: 65000}
      communities: ["65000:100"]
      med: 10
      vips:
        198.18.1.10: {med: 20, communities: ["65000:200", "no-export"]}

Without the section nothing is announced and nothing else changes. The
speaker is BIRD 2, a separate service (hpclb.announce): hpclb writes its
configuration (``config_dir``) and reconfigures it through its control
socket. Damping (RFC 2439's penalty, with seconds instead of minutes) delays
a VIP's return after it flapped; a withdrawal is never delayed.

Two couplings work without hpclb: each VIP is announced as a route through
the data plane's liveness interface (``alive_interface``), which leaves with
the data plane's process, so BIRD withdraws a dead data plane's VIPs even
with `hpclb run` dead too; and BFD (``bfd``) lets a router drop a silent
appliance in interval x multiplier instead of the hold time.
"""

from __future__ import annotations

import math
import re
from ipaddress import IPv4Address, IPv6Address, ip_address
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from hpclb.config.addresses import AnyAddress

# RFC 1997 and RFC 8326 names, as BIRD spells them.
WELL_KNOWN_COMMUNITIES = {
    "no-export": (65535, 65281),
    "no-advertise": (65535, 65282),
    "no-export-subconfed": (65535, 65283),
    "graceful-shutdown": (65535, 0),
}
ASN_MAX = 2**32 - 1
# A peer's name becomes a BIRD protocol's (bgp_NAME): letters, digits, underscores.
PEER_NAME = r"^[A-Za-z][A-Za-z0-9_]{0,31}$"
# The liveness interface's name: one the kernel takes (IFNAMSIZ - 1) and the
# data plane checks the same way (lb_daemon_valid_alive_name).
ALIVE_NAME = r"[A-Za-z0-9_.-]{1,15}"


Address = AnyAddress
Asn = Annotated[int, Field(strict=True, ge=1, le=ASN_MAX)]


def parse_community(text: str) -> tuple[int, ...]:
    """"65000:100" -> (65000, 100) (RFC 1997, 16-bit halves); "1:2:3" -> a large
    community (RFC 8092, 32-bit parts); a well-known name -> its value.
    ValueError says what is wrong."""
    name = text.strip().lower()
    if name in WELL_KNOWN_COMMUNITIES:
        return WELL_KNOWN_COMMUNITIES[name]
    if not re.fullmatch(r"\d+(:\d+){1,2}", name):
        raise ValueError(f"community {text!r}: write ASN:VALUE (65000:100), a large "
                         f"community GLOBAL:DATA1:DATA2 (65000:1:2), or one of "
                         f"{', '.join(sorted(WELL_KNOWN_COMMUNITIES))}")
    parts = tuple(int(p) for p in name.split(":"))
    limit = 0xFFFF if len(parts) == 2 else ASN_MAX
    if any(p > limit for p in parts):
        kind = "a standard community's parts are 16-bit (0-65535)" if len(parts) == 2 \
            else "a large community's parts are 32-bit (0-4294967295)"
        raise ValueError(f"community {text!r}: {kind}")
    return parts


def _community(v: Any) -> Any:
    if isinstance(v, str):
        parse_community(v)  # raises with the reason
        return v.strip()
    return v


Community = Annotated[str, BeforeValidator(_community)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DampingConfig(_Strict):
    """Each withdrawal of an announced VIP adds ``penalty``; the penalty halves
    every ``half_life_s``. At ``suppress`` or above, the VIP stays withdrawn
    (suppressed) even when it could be announced, until the penalty falls
    below ``reuse``; never longer than ``max_suppress_s`` after its last
    withdrawal. Defaults: a third withdrawal within about 15 s suppresses, for
    about 30 s."""

    enabled: bool = True
    penalty: float = Field(1000.0, gt=0)
    suppress: float = Field(2500.0, gt=0)
    reuse: float = Field(750.0, gt=0)
    half_life_s: float = Field(15.0, gt=0, le=3600)
    max_suppress_s: float = Field(120.0, gt=0, le=86400)

    @model_validator(mode="after")
    def _thresholds(self) -> DampingConfig:
        if self.reuse >= self.suppress:
            raise ValueError(f"reuse ({self.reuse:g}) must be below suppress "
                             f"({self.suppress:g}): a suppressed VIP would never come back")
        if self.max_suppress_s < self.half_life_s:
            raise ValueError(f"max_suppress_s ({self.max_suppress_s:g}) must be at least "
                             f"half_life_s ({self.half_life_s:g})")
        return self

    @property
    def ceiling(self) -> float:
        """The highest penalty: from it, decay reaches ``reuse`` in max_suppress_s."""
        return self.reuse * math.pow(2.0, self.max_suppress_s / self.half_life_s)


class BfdConfig(_Strict):
    """BFD (RFC 5880) on every BGP session: the router drops the session, and
    with it the routes through this appliance, once ``multiplier`` control
    packets in a row (every ``interval_ms``) were missed, instead of after the
    hold time. The router must run BFD too (e.g. BIRD's `bfd on;`, FRR's
    `neighbor X bfd`): against a router without it the BFD session stays
    Down and the BGP session works as without BFD (BIRD drops a session only
    when its BFD session goes down after it was up). BIRD needs CAP_NET_RAW
    for BFD: it gives the sockets SO_PRIORITY 7 (checked on Linux 6.18; older
    kernels may want CAP_NET_ADMIN for it)."""

    enabled: bool = False
    # The desired minimal transmit and required minimal receive interval.
    interval_ms: int = Field(300, strict=True, ge=10, le=60000)
    multiplier: int = Field(3, strict=True, ge=1, le=255)


class BgpPeer(_Strict):
    name: str = Field(pattern=PEER_NAME)
    address: Address
    asn: Asn
    port: int = Field(179, strict=True, ge=1, le=65535)
    # The session's local address (default: BIRD picks the route's source).
    source_address: Address | None = None
    # eBGP to a router more than one hop away (TTL); None: directly connected.
    multihop: int | None = Field(None, strict=True, ge=1, le=255)
    hold_time_s: int | None = Field(None, strict=True, ge=3, le=65535)

    @model_validator(mode="after")
    def _families(self) -> BgpPeer:
        if self.source_address is not None and \
                self.source_address.version != self.address.version:
            raise ValueError(f"source_address {self.source_address} and address "
                             f"{self.address} are of different families")
        return self


class VipAnnouncement(_Strict):
    """Per-VIP attributes, over the section's."""

    med: int | None = Field(None, strict=True, ge=0, le=ASN_MAX)
    communities: list[Community] | None = None
    # False: never announce this VIP (e.g. one served only on the local network).
    announce: bool = True


class BgpConfig(_Strict):
    speaker: Literal["bird"] = "bird"
    local_asn: Asn
    router_id: IPv4Address
    peers: list[BgpPeer] = Field(min_length=1, max_length=64)
    # The next hop announced: "self" (the session's local address) or an address
    # (e.g. the ingress address when peering from the management network).
    next_hop: Literal["self"] | IPv4Address = "self"
    # IPv6 VIPs over an IPv4 session need an IPv6 next hop (and IPv4 VIPs over
    # an IPv6 session an IPv4 `next_hop`).
    next_hop6: IPv6Address | None = None
    communities: list[Community] = Field(default_factory=list, max_length=32)
    med: int | None = Field(None, strict=True, ge=0, le=ASN_MAX)
    hold_time_s: int = Field(90, strict=True, ge=3, le=65535)
    # VIP address -> its attributes.
    vips: dict[str, VipAnnouncement] = Field(default_factory=dict)
    damping: DampingConfig = Field(default_factory=DampingConfig)
    # Where hpclb writes bird.conf and vips.conf, and the speaker's socket.
    config_dir: Path = Path("/run/hpclb/bird")
    control_socket: Path = Path("/run/hpclb/bird/bird.ctl")
    # On a stop that takes the data plane down: how long the withdrawal is given
    # to reach the routers before the data plane stops.
    withdraw_wait_s: float = Field(2.0, ge=0, le=60)
    # A TUN device the data plane creates and holds for its whole life (it
    # leaves with the process, even killed -9); each VIP is announced as a
    # route through it, valid only while it exists and is up: BIRD withdraws
    # the VIPs of a dead data plane at once, with `hpclb run` dead too. None:
    # blackhole routes, withdrawn only by `hpclb run` (or the hold time).
    alive_interface: str | None = "hpclb-alive"
    bfd: BfdConfig = Field(default_factory=BfdConfig)

    @field_validator("router_id", mode="before")
    @classmethod
    def _router_id(cls, v: Any) -> Any:
        if isinstance(v, str):
            try:
                return IPv4Address(v.strip())
            except ValueError:
                raise ValueError("the router id is written as an IPv4 address "
                                 "(e.g. the appliance's own IPv4 address)") from None
        return v

    @model_validator(mode="after")
    def _bfd_multihop(self) -> BgpConfig:
        if self.bfd.enabled:
            for peer in self.peers:
                if peer.multihop and peer.source_address is None:
                    raise ValueError(f"peer {peer.name} is multihop: BFD to it needs its "
                                     "source_address (BIRD binds the BFD session to it)")
        return self

    @field_validator("alive_interface")
    @classmethod
    def _alive_interface(cls, v: str | None) -> str | None:
        if v is not None and (not re.fullmatch(ALIVE_NAME, v) or v in (".", "..")):
            raise ValueError(f"{v!r} is not an interface name: 1 to 15 letters, digits, "
                             "'_', '.' or '-' (not '.' or '..'); null turns the liveness "
                             "interface off")
        return v

    @field_validator("vips", mode="before")
    @classmethod
    def _vip_keys(cls, v: Any) -> Any:
        if isinstance(v, dict):
            out = {}
            for key, val in v.items():
                try:
                    out[str(ip_address(str(key).strip()))] = val
                except ValueError:
                    raise ValueError(f"{key!r} is not a VIP address (the keys of "
                                     "bgp.vips are VIP addresses)") from None
            return out
        return v

    def problems(self, vip_addresses: set[IPv4Address | IPv6Address]
                 ) -> list[tuple[tuple[str | int, ...], str]]:
        """Cross-checks against the configuration's VIPs: (location under bgp,
        message) for each problem."""
        out: list[tuple[tuple[str | int, ...], str]] = []
        seen: dict[object, int] = {}
        for i, peer in enumerate(self.peers):
            for key, what in ((peer.name, f"peer name {peer.name!r}"),
                              ((peer.address, peer.port), f"{peer.address} port {peer.port}")):
                if key in seen:
                    out.append((("peers", i), f"{what} already used by peers[{seen[key]}]"))
                seen.setdefault(key, i)
        known = {str(a) for a in vip_addresses}
        for key in self.vips:
            if key not in known:
                out.append((("vips", key), f"{key} is not the address of any VIP "
                                           f"(VIPs: {', '.join(sorted(known)) or 'none'})"))
        families = {a.version for a in vip_addresses
                    if self.vips.get(str(a), VipAnnouncement()).announce}
        for i, peer in enumerate(self.peers):
            if 6 in families and peer.address.version == 4 and self.next_hop6 is None:
                out.append((("peers", i), f"peer {peer.name} is an IPv4 session and IPv6 "
                                          "VIPs are announced over it: set bgp.next_hop6"))
            if 4 in families and peer.address.version == 6 and self.next_hop == "self":
                out.append((("peers", i), f"peer {peer.name} is an IPv6 session and IPv4 "
                                          "VIPs are announced over it: set bgp.next_hop to "
                                          "an IPv4 address"))
        return out

    def attributes(self, address: str) -> tuple[int | None, list[str]]:
        """The MED and communities announced with ``address``."""
        own = self.vips.get(address)
        med = own.med if own is not None and own.med is not None else self.med
        comms = own.communities if own is not None and own.communities is not None \
            else self.communities
        return med, list(comms)

    def announced(self, address: str) -> bool:
        own = self.vips.get(address)
        return own is None or own.announce
