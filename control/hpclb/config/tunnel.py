"""Tunnel mode's settings (`mode: tunnel` VIPs): the `tunnel:` block of a pool
or of a VIP.

    tunnel: {encap: gue, gue_port: 6080, source: 172.16.0.0/24}

The outer headers are dataplane/common/lb_encap.h's. ``source`` is the outer
source prefix: its network address is the VIP entry's tunnel_src, and its
host bits (16 at most) are the tunnel_src_bits each flow sets, so that a
backend NIC's RSS, which hashes the outer addresses of an IPIP packet, spreads
the tunnelled flows; a /32 or /128 is one fixed source.
"""

from __future__ import annotations

from enum import StrEnum
from ipaddress import IPv4Network, IPv6Network, ip_network
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hpclb.contract import tables


class TunnelEncap(StrEnum):
    IPIP = "ipip"  # IPv4 in IPv4 (proto 4), IPv4 in IPv6 (4), IPv6 in IPv6 (41)
    GUE = "gue"  # the same inside UDP (GUE variant 1, direct IP encapsulation)


def _network(v: Any) -> Any:
    """Text -> IPv4Network or IPv6Network; host bits set are refused (which
    address would be meant: the network's, or the one written?)."""
    if isinstance(v, str):
        try:
            return ip_network(v.strip())
        except ValueError as err:
            text = str(err)
            if "host bits set" in text:
                raise ValueError(f"host bits set: the prefix's network address is the tunnel "
                                 f"source, write {ip_network(v.strip(), strict=False)}"
                                 ) from None
            raise ValueError("not an IPv4 or IPv6 prefix (e.g. 172.16.0.0/24, "
                             "fd00:100::/112, or one address: 172.16.0.1/32)") from None
    return v


class TunnelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    encap: TunnelEncap = TunnelEncap.IPIP
    # The outer UDP destination port (GUE only; the backends' fou/GUE port).
    gue_port: int | None = Field(None, strict=True, ge=1, le=65535)
    # The outer source prefix: its family is the outer headers' (and must be
    # every backend's of the pool).
    source: IPv4Network | IPv6Network

    @field_validator("source", mode="before")
    @classmethod
    def _source_text(cls, v: Any) -> Any:
        if isinstance(v, int | float) and not isinstance(v, bool):
            raise ValueError("must be a prefix such as 172.16.0.0/24")
        return _network(v)

    @model_validator(mode="after")
    def _gue_port_is_gues(self) -> TunnelConfig:
        if self.gue_port is not None and self.encap is not TunnelEncap.GUE:
            raise ValueError(f"gue_port is for encap gue only (encap is {self.encap.value}: "
                             "IPIP has no UDP header)")
        return self

    @property
    def family(self) -> int:
        return self.source.version

    @property
    def src_bits(self) -> int:
        """tunnel_src_bits: the source's host bits, at most TUNNEL_SRC_BITS_MAX."""
        return min(tables.TUNNEL_SRC_BITS_MAX, self.source.max_prefixlen - self.source.prefixlen)

    @property
    def port(self) -> int:
        """The VIP entry's gue_port: the configured or default port with GUE, 0 without."""
        if self.encap is not TunnelEncap.GUE:
            return 0
        return self.gue_port if self.gue_port is not None else tables.GUE_PORT_DEFAULT

    @property
    def sources(self) -> IPv4Network | IPv6Network:
        """Every outer source the data planes may write: the network address
        with its last ``src_bits`` bits set by each flow (lb_tunnel_src); the
        whole prefix unless it has more than 16 host bits."""
        net = self.source
        return ip_network((net.network_address, net.max_prefixlen - self.src_bits))
