"""Which VIP addresses to announce, and why (pure: every input and time is
passed in).

A VIP address is a /32 or /128 route. It is eligible while the data plane
answers its health check and at least one VIP at that address has a pool with
a backend in service (state UP and a weight above 0: the ring sends new flows
somewhere). Eligible and not damped: ANNOUNCED. Eligible but damped:
SUPPRESSED (held withdrawn). Otherwise WITHDRAWN, at once. Every state comes
with its reason, shown by `hpclb status` and the metrics.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from hpclb.announce.damping import Damper
from hpclb.config.bgp import DampingConfig


class State(StrEnum):
    ANNOUNCED = "announced"
    WITHDRAWN = "withdrawn"
    SUPPRESSED = "suppressed"


@dataclass(frozen=True)
class Inputs:
    """What the decision reads, taken by the controller each turn."""

    # None: the data plane answers; else why it does not count as serving.
    dataplane_fault: str | None
    # address -> the pools of its VIPs (an address serves TCP and UDP, maybe
    # from different pools)
    pools_of: Mapping[str, tuple[str, ...]]
    # pool -> backends in service (UP with a weight above 0)
    in_service: Mapping[str, int]
    # addresses configured never to be announced
    never: frozenset[str] = frozenset()
    stopping: bool = False


@dataclass
class Announcement:
    address: str
    state: State = State.WITHDRAWN
    reason: str = "not decided yet"
    cause: str = ""
    since: float = 0.0  # monotonic
    since_wall: float = 0.0
    changes: int = 0
    damper: Damper | None = None


# The cause of a state, a stable word (the metrics' label; the reason is the sentence).
SERVING, STOPPING, DISABLED, DATAPLANE, NO_BACKEND, DAMPED, ADOPTED = (
    "serving", "stopping", "disabled", "dataplane", "no_backend", "damped", "adopted")


def eligibility(address: str, inputs: Inputs) -> tuple[bool, str, str]:
    """Whether ``address`` may be announced, why (or why not), and the cause."""
    if inputs.stopping:
        return False, "appliance stopping", STOPPING
    if address in inputs.never:
        return False, "announce: false in the configuration", DISABLED
    if inputs.dataplane_fault is not None:
        return False, inputs.dataplane_fault, DATAPLANE
    pools = inputs.pools_of.get(address, ())
    serving = [p for p in pools if inputs.in_service.get(p, 0) > 0]
    if not serving:
        return False, f"no backend in service in pool {', '.join(pools) or '(none)'}", \
            NO_BACKEND
    up = sum(inputs.in_service[p] for p in serving)
    return True, f"{up} backend(s) in service in pool {', '.join(serving)}", SERVING


@dataclass
class Announcements:
    """The announcement of every VIP address and its damping."""

    damping: DampingConfig
    items: dict[str, Announcement] = field(default_factory=dict)

    def adopt(self, announced: Iterable[str], now: float, wall: float) -> None:
        """What the speaker already announces (a control-plane restart: it kept
        announcing while the data plane forwarded), taken as the state until
        the first decision."""
        for address in announced:
            self.items[address] = Announcement(
                address, State.ANNOUNCED, "announced before this start (kept)", ADOPTED,
                now, wall, damper=Damper(self.damping))

    def update(self, inputs: Inputs, now: float, wall: float) -> bool:
        """Decide every address; True when the set of announced ones changed."""
        before = self.announced()
        for gone in set(self.items) - set(inputs.pools_of):
            del self.items[gone]  # no VIP there any more: no route either
        for address in inputs.pools_of:
            item = self.items.get(address)
            if item is None:
                item = self.items[address] = Announcement(address, since=now, since_wall=wall,
                                                          damper=Damper(self.damping))
            assert item.damper is not None
            ok, why, cause = eligibility(address, inputs)
            if not ok:
                state = State.WITHDRAWN
                # A flap is the service's doing, not the operator's (a stop,
                # `announce: false`).
                if item.state is State.ANNOUNCED and cause not in (STOPPING, DISABLED):
                    item.damper.withdrawn(now)
            elif item.damper.may_announce(now):
                state = State.ANNOUNCED
            else:
                state, cause = State.SUPPRESSED, DAMPED
                release = item.damper.release_in(now)
                why = (f"damped: flapped, penalty {item.damper.current(now):.0f} over reuse "
                       f"{self.damping.reuse:g}, announced again in "
                       f"{0.0 if release is None else release:.0f} s ({why})")
            if state is not item.state:
                item.since, item.since_wall = now, wall
                item.changes += 1
            item.state, item.reason, item.cause = state, why, cause
        return self.announced() != before

    def announced(self) -> frozenset[str]:
        return frozenset(a for a, i in self.items.items() if i.state is State.ANNOUNCED)

    def reconfigure(self, damping: DampingConfig) -> None:
        self.damping = damping
        for item in self.items.values():
            if item.damper is not None:
                item.damper.reconfigure(damping)

    def report(self, now: float) -> list[dict[str, object]]:
        out: list[dict[str, object]] = []
        for address in sorted(self.items):
            item = self.items[address]
            damper = item.damper
            out.append({
                "address": address, "state": item.state.value, "reason": item.reason,
                "cause": item.cause,
                "since": item.since_wall, "for_s": round(now - item.since, 1),
                "changes": item.changes,
                "penalty": round(damper.current(now), 1) if damper else 0.0,
                "suppressed": bool(damper and damper.suppressed),
            })
        return out
