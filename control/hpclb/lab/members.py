"""A lab with several appliances ("members") on the LAN instead of one, each at
a fixed address: the active/standby pair's (``hpclb.lab.vrrp``) and the ECMP
fleet's (``hpclb.lab.ecmp``). What differs between them (the client's route
to the VIPs, a router in front) is theirs."""

from __future__ import annotations

import re
from typing import ClassVar

from pyroute2 import netns

from hpclb.lab.topology import Lab


class MembersLab(Lab):
    """``Lab`` with ``members`` (role -> ``member_addresses``) in place of the
    one appliance, and ``extra_roles`` (e.g. a router) beside the client and
    the backends. ``lb_ns`` is the first member's namespace."""

    members: ClassVar[tuple[str, ...]] = ()
    member_addresses: ClassVar[dict[str, str]] = {}
    extra_roles: ClassVar[tuple[str, ...]] = ()

    def roles(self) -> list[str]:
        return ["cli", *self.extra_roles, *self.members,
                *(f"b{i}" for i in range(1, self.backends + 1))]

    @classmethod
    def existing_namespaces(cls, prefix: str) -> list[str]:
        """Namespaces that a lab of this kind with this prefix would own (and
        no others): the bridge's, and one per role."""
        names = "|".join(re.escape(r) for r in ("br", "cli", *cls.extra_roles, *cls.members))
        pattern = re.compile(re.escape(prefix) + f"-({names}|b[0-9]+)")
        return sorted(n for n in netns.listnetns() if pattern.fullmatch(n))

    @property
    def lb_ns(self) -> str:
        return self.ns(self.members[0])

    def ip_of(self, role: str) -> str:
        role = role.rsplit("-", 1)[-1]
        if role in self.member_addresses:
            return self.member_addresses[role]
        return super().ip_of(role)

    def appliance_peers(self) -> list[str]:
        return [self.peer(m) for m in self.members]
