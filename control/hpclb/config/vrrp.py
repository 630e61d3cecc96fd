"""An active/standby pair with VRRP: the optional top-level `vrrp:` section.

    vrrp:
      role: active            # this member's; the other member says standby
      next_hop: 192.0.2.1     # the virtual address clients route the VIPs via
      vrid: 51
      advert_int: 1
      unicast_peer: 192.0.2.4 # where the segment filters multicast
      unicast_src: 192.0.2.3

Both members carry the same configuration but for ``appliance.name``,
``management_address``, ``vrrp.role`` and the unicast addresses: the same
``hash_key`` and pools, hence the same rings, so a flow keeps its backend when
the other member takes it over (DSR). keepalived does the VRRP; hpclb renders
its configuration and track script (``hpclb.announce.vrrp``) and provisioning
installs them with the ``hpclb-keepalived`` unit.

Without the section nothing of this exists and nothing else changes.
"""

from __future__ import annotations

from ipaddress import IPv4Address, IPv4Interface
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: Where provisioning installs the pair's files (keepalived's own directory:
#: keepalived runs a track script only where no part of its path is writable
#: by anyone but root, which /etc/hpclb, group-writable by hpclb, is not).
KEEPALIVED_CONF = Path("/etc/keepalived/hpclb.conf")
CHECK_SCRIPT = Path("/etc/keepalived/hpclb-vrrp-check.sh")

_IFNAME = r"[A-Za-z0-9_.@-]{1,15}"


class ExtraAddress(BaseModel):
    """A virtual address that moves with the next hop, e.g. a NAT pair's
    cluster-side gateway and SNAT addresses on its egress."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    address: IPv4Interface  # ADDRESS/PREFIXLEN
    interface: str = Field(pattern=f"^{_IFNAME}$")


class VrrpConfig(BaseModel):
    """One member's VRRP settings. Frozen; validated on construction.

    ``advert_int``: seconds between adverts (VRRPv3: 0.01..40.95); the standby
    takes over ``3 * advert_int`` plus a skew of ``(256 - priority) / 256 *
    advert_int`` after the last advert of a dead master, at once on a
    priority-0 advert (the master's FAULT or stop).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Literal["active", "standby"]
    next_hop: IPv4Address
    prefixlen: int = Field(24, ge=1, le=32, strict=True)
    vrid: int = Field(51, ge=1, le=255, strict=True)
    instance: str = Field("hpclb", pattern=r"^[A-Za-z][A-Za-z0-9_]{0,30}$")
    # The active's priority wins the first election only (both start BACKUP
    # with nopreempt): a member that comes back stays BACKUP.
    priority_active: int = Field(150, ge=1, le=254, strict=True)
    priority_standby: int = Field(100, ge=1, le=254, strict=True)
    advert_int: float = Field(1.0, ge=0.01, le=40.95, allow_inf_nan=False)
    # The VIPs themselves as virtual addresses too, for L2-adjacent clients
    # that ARP for them (the members must then not hold them on lo).
    vips_on_interface: bool = False
    unicast_peer: IPv4Address | None = None
    unicast_src: IPv4Address | None = None
    extra_addresses: list[ExtraAddress] = Field(default_factory=list, max_length=64)
    check_interval_s: int = Field(1, ge=1, le=60, strict=True)
    check_timeout_s: int = Field(2, ge=1, le=60, strict=True)
    fall: int = Field(1, ge=1, le=100, strict=True)
    rise: int = Field(2, ge=1, le=100, strict=True)
    # The status file of `hpclb run` is rewritten every second: older than
    # this, the control plane is taken for dead.
    status_max_age_s: int = Field(5, ge=1, le=600, strict=True)
    garp_repeat: int = Field(5, ge=1, le=100, strict=True)
    garp_delay_s: int = Field(5, ge=0, le=3600, strict=True)
    garp_refresh_s: int = Field(60, ge=0, le=3600, strict=True)

    @field_validator("advert_int")
    @classmethod
    def _centiseconds(cls, value: float) -> float:
        # VRRPv3 carries the interval in centiseconds.
        if abs(value * 100 - round(value * 100)) > 1e-9:
            raise ValueError("advert_int is in centiseconds (e.g. 0.25, 1)")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> VrrpConfig:
        if self.priority_active <= self.priority_standby:
            raise ValueError("priority_active must be above priority_standby")
        if (self.unicast_peer is None) != (self.unicast_src is None):
            raise ValueError("unicast adverts need both unicast_src (this member's "
                             "address) and unicast_peer (the other member's)")
        if self.unicast_peer is not None and self.unicast_peer == self.unicast_src:
            raise ValueError("unicast_peer is this member's own address")
        return self

    @property
    def priority(self) -> int:
        """This member's priority."""
        return self.priority_active if self.role == "active" else self.priority_standby
