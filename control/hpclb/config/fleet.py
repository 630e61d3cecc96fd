"""A fleet of appliances behind ECMP: the optional top-level ``fleet:`` section.

    fleet:
      members: [lb1, lb2, lb3]   # the appliances' names (appliance.name of each)
      window: 16                 # samples per node the weights are a function of

Every member gets the same configuration (the same ``appliance.hash_key``,
``ring_size`` and pools; only ``appliance`` itself differs) and every node
agent publishes each message to every member (``hpclb-agent run --connect``
repeated). With the section, a dynamic pool's weights are a pure function of
each node's last ``window`` samples (:mod:`hpclb.balancing.fleet_weights`),
so the members build the same rings without talking to one another. Without
it nothing changes.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

#: Same rule as config.schema.Name (an appliance's name); repeated here
#: because schema imports this module.
_Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")]

WINDOW_MIN = 4
WINDOW_MAX = 256
MAX_MEMBERS = 64


class FleetConfig(BaseModel):
    """The fleet this appliance is a member of. Frozen; validated on construction."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: How many of a node's last samples its weight is computed from: after a
    #: missed sample (or a restart) a member agrees with the others again once
    #: it holds the same last ``window`` samples. Longer smooths more and heals
    #: slower; 16 at the default 5 s heartbeat is 80 s.
    window: int = Field(16, ge=WINDOW_MIN, le=WINDOW_MAX, strict=True)
    #: The members' appliance names, for the status (an operator compares their
    #: ring digests); empty: not listed.
    members: list[_Name] = Field(default_factory=list, max_length=MAX_MEMBERS)

    @field_validator("members")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        twice = sorted({m for m in v if v.count(m) > 1})
        if twice:
            raise ValueError(f"members named twice: {', '.join(twice)}")
        return v
