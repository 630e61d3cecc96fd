"""Lockstep runner: every frame goes to the model and to the data plane under
test, and both must do the same thing to it, byte for byte."""

from __future__ import annotations

import functools
import ipaddress
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from scapy.layers.inet import IP, TCP, UDP
from scapy.layers.l2 import Ether

from hpclb.balancing import maglev
from hpclb.contract.model import Model, Verdict
from hpclb.contract.tables import (
    IPPROTO_TCP,
    IPPROTO_UDP,
    STAT_NAMES,
    Backend,
    BackendState,
    TableSet,
    Vip,
)

from .targets import FrameRefused, Target

HASH_KEY = bytes(range(16))
RING_SIZE = 65537
CLIENT_MAC = "02:aa:00:00:00:01"
VIP_TCP = Vip(0, ipaddress.IPv4Address("198.18.1.10"), 80, IPPROTO_TCP)
VIP_UDP = Vip(1, ipaddress.IPv4Address("198.18.1.10"), 53, IPPROTO_UDP)
VIP_TWO_ARM = Vip(2, ipaddress.IPv4Address("198.18.1.11"), 80, IPPROTO_TCP)
BACKEND_MACS = {0: "02:bb:00:00:00:10", 1: "02:bb:00:00:00:11", 2: "02:bb:00:00:00:12",
                3: "02:bb:00:00:00:13"}


@functools.cache
def _ring(weights: tuple[tuple[int, float], ...]) -> np.ndarray:
    table = maglev.build_table([(bid, f"b{bid}", w) for bid, w in weights], RING_SIZE)
    table.setflags(write=False)  # shared between cases: nobody may change it
    return table


def ring(weights: dict[int, float]) -> np.ndarray:
    return _ring(tuple(sorted(weights.items())))


def base_tables(weights: dict[int, float] | None = None,
                states: dict[int, BackendState] | None = None) -> TableSet:
    """Three one-arm backends behind a TCP and a UDP VIP; a fourth, two-arm,
    backend (egress port 1) alone behind a second address."""
    weights = weights or {0: 1.0, 1: 1.0, 2: 1.0}
    states = states or {}
    t = TableSet(hash_key=HASH_KEY, ring_size=RING_SIZE)
    for bid, mac in BACKEND_MACS.items():
        t.backends[bid] = Backend(
            bid, ipaddress.IPv4Address(f"198.18.0.{10 + bid}"), mac,
            states.get(bid, BackendState.UP), port=1 if bid == 3 else 0,
        )
    shared = ring(weights)
    t.vips = {0: VIP_TCP, 1: VIP_UDP, 2: VIP_TWO_ARM}
    t.rings = {0: shared, 1: shared, 2: ring({3: 1.0})}
    return t


VIP6_TCP = Vip(3, ipaddress.IPv6Address("fd00:18::10"), 80, IPPROTO_TCP)
VIP6_UDP = Vip(4, ipaddress.IPv6Address("fd00:18::10"), 53, IPPROTO_UDP)
BACKEND6_MACS = {4: "02:bb:00:00:00:14", 5: "02:bb:00:00:00:15"}


def dual_tables(weights: dict[int, float] | None = None) -> TableSet:
    """base_tables plus an IPv6 TCP and UDP VIP on IPv6 backends 4 and 5
    (table protocol 2 holds them; the fast paths do not forward IPv6 yet)."""
    t = base_tables(weights)
    for bid, mac in BACKEND6_MACS.items():
        t.backends[bid] = Backend(bid, ipaddress.IPv6Address(f"fd00:18::{bid}"), mac)
    six = ring({4: 1.0, 5: 1.0})
    t.vips = {**t.vips, 3: VIP6_TCP, 4: VIP6_UDP}
    t.rings = {**t.rings, 3: six, 4: six}
    return t


def tcp(src: str, sport: int, dst: str = "198.18.1.10", dport: int = 80, **ip: object) -> bytes:
    return bytes(Ether(src=CLIENT_MAC, dst="02:00:00:00:00:01") / IP(src=src, dst=dst, **ip)
                 / TCP(sport=sport, dport=dport, flags="S"))


def udp(src: str, sport: int, dst: str = "198.18.1.10", dport: int = 53) -> bytes:
    return bytes(Ether(src=CLIENT_MAC, dst="02:00:00:00:00:01") / IP(src=src, dst=dst)
                 / UDP(sport=sport, dport=dport) / b"query")


@dataclass
class Harness:
    """One case's run: the model (oracle) and, unless None, a real data plane."""

    target: Target | None
    port_macs: list[str]
    tables: TableSet | None = None
    model: Model | None = None
    reasons: Counter[str] = field(default_factory=Counter)
    _start_counters: dict[str, int] = field(default_factory=dict)

    def load(self, tables: TableSet) -> None:
        if self.target is not None:
            if not self._start_counters and self.tables is None:
                self._start_counters = self.target.counters()
            self.target.load(self.tables, tables)
        if self.model is None:
            answers_arp = self.target is not None and self.target.answers_arp
            self.model = Model(tables, self.port_macs, answers_arp=answers_arp)
        self.model.tables = tables
        self.tables = tables

    def send(self, frame: bytes) -> Verdict:
        assert self.model is not None, "load tables first"
        verdict = self.model.process(frame)
        self.reasons[verdict.reason] += 1
        if self.target is None:
            return verdict
        if len(frame) < self.target.min_frame:
            # Cannot even reach this data plane (the kernel refuses it first).
            try:
                self.target.run(frame)
            except FrameRefused:
                self.reasons[verdict.reason] -= 1
                return verdict
            raise AssertionError(f"{self.target.name} accepted a {len(frame)}-byte frame")
        action, out = self.target.run(frame)
        assert (action, out.hex()) == (verdict.action, verdict.frame.hex()), (
            f"{self.target.name} disagrees with the model ({verdict.reason})"
        )
        return verdict

    def backend_of(self, frame: bytes) -> int | None:
        return self.send(frame).backend_id

    def check_counters(self) -> None:
        """The data plane counted every frame under the model's reason."""
        if self.target is None or self.model is None:
            return  # nothing was sent (the case skipped before loading tables)
        end = self.target.counters()
        for reason in STAT_NAMES:
            if reason.startswith(("fwd_", "pass_", "drop_")):
                got = end.get(reason, 0) - self._start_counters.get(reason, 0)
                n = self.reasons.get(reason, 0)
                assert got == n, f"{self.target.name} counted {got} {reason}, model {n}"
        received = end.get("rx", 0) - self._start_counters.get("rx", 0)
        assert received == sum(self.reasons.values()), "every frame counted once as rx"
