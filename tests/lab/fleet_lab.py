"""Shared by the fleet suites (test_ecmp, test_ecmp_nat): what a member's
configuration shares with the others', and a watch on the router's route."""

from __future__ import annotations

import json
import time
from typing import Any

from hpclb.lab.appliance import LAB_VIP
from hpclb.lab.ecmp import EcmpRouter

from .polling import Watcher

ROUTE = f"{LAB_VIP}/32"
POLL_S = 0.02


def member_local(config: dict[str, Any]) -> dict[str, Any]:
    """A member's configuration without the member-local fields: its name,
    namespace, addresses and sockets, its speaker's router id and files, and,
    where the configuration has them, its telemetry bind and SNAT addresses."""
    config = json.loads(json.dumps(config))
    for key in ("name", "netns", "management_address", "control_socket"):
        config["appliance"].pop(key)
    for key in ("router_id", "config_dir", "control_socket"):
        config["bgp"].pop(key)
    config.get("telemetry", {}).pop("bind", None)
    config.get("nat", {}).get("snat", {}).pop("addresses", None)
    return config


class RouteWatch(Watcher):
    """Polls the router's next hops of ``ROUTE`` in a thread: every distinct
    set seen, and when ``gone`` first left."""

    def __init__(self, router: EcmpRouter, gone: str) -> None:
        super().__init__(POLL_S)
        self.router = router
        self.gone = gone
        self.left_at: float | None = None
        self.hops_seen: list[set[str]] = []

    def look(self) -> None:
        hops = self.router.next_hops(ROUTE)
        if not self.hops_seen or self.hops_seen[-1] != hops:
            self.hops_seen.append(hops)
        if self.gone not in hops and self.left_at is None:
            self.left_at = time.time()
