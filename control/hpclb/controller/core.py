"""The reconcile loop: configuration + backend health + telemetry -> tables
-> data plane.

One controller per appliance. It owns the only mutable state of the control
plane: the configuration in force, the backends' health and weights
(BackendDecider, which alone decides each backend's state and ring weight),
the tables last pushed, the id checkpoint and the supervised data-plane
process. Probes and telemetry arrive from their threads (Monitors) as events.

    desired = tables_for(config)          # MACs resolved, decisions, Maglev rings
    push_tables(client, current, desired) # only what differs
    current = desired

A backend that goes down is pushed at once; weight changes are pushed at
once too, but at most once per PUSH_INTERVAL_S (a ramp or a burst of
telemetry is coalesced). A data plane that dies is restarted and gets the full
tables again.

Start and reload are transactions. ``_prepare`` acquires and checks
everything a configuration needs (key files, addresses, the telemetry socket
bound, the faces bound (the metrics port), the data plane's command line rendered, the
tables computed, the id checkpoint written) without changing anything in
force; only then does ``start`` adopt or start a data plane, and ``_commit``
put the configuration in force. A reload that fails anywhere in ``_prepare``
is refused ("reload refused: <reason>") and changes nothing; a start that
fails leaves a data plane it adopted forwarding with its tables (only one it
started itself is stopped).

A local fault is never a backend's: missed heartbeats count only over time
the appliance could hear (no receiver trouble, no stalled loop), and local
faults are raised as alarms in the status and the metrics.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import ipaddress
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from hpclb.announce.decision import Inputs
from hpclb.announce.speaker import Speaker, inputs_for
from hpclb.balancing import maglev
from hpclb.config import (
    ConfigDocument,
    ConfigError,
    EditError,
    ForwardingMode,
    HpclbConfig,
    VipConfig,
    parse_config,
    read_config_text,
)
from hpclb.contract.tables import (
    MAX_BACKENDS,
    MAX_VIPS,
    PROTOCOLS,
    Backend,
    BackendState,
    Encap,
    IPAddress,
    NatConfig,
    NatDown,
    TableSet,
    Vip,
    VipMode,
)
from hpclb.controller.backends import BackendDecider, BackendDecision
from hpclb.controller.events import ProbeVerdict, TelemetryArrived
from hpclb.controller.ids import Checkpoint
from hpclb.controller.monitors import MonitorPlan, Monitors
from hpclb.controller.operations import Edit, Operations, revision_of
from hpclb.controller.preflight import check_host
from hpclb.controller.statefile import Snapshot, StateKeeper
from hpclb.dataplane.client import snat_order
from hpclb.dataplane.push import push_tables
from hpclb.dataplane.select import (
    DpdkHost,
    choose_dataplane,
    dataplane_argv,
    running_alive_interface,
)
from hpclb.dataplane.supervisor import DataplaneProcess
from hpclb.host.files import write_atomically
from hpclb.host.neighbours import NeighbourError, resolve_mac
from hpclb.host.procinfo import rss_bytes

log = logging.getLogger(__name__)

# A backend without a MAC is written with this one (its decision is DOWN: never chosen).
NO_MAC = "00:00:00:00:00:00"
# How often a failed push, or a backend that did not answer ARP or NDP, is retried.
RETRY_INTERVAL_S = 5.0
# How often the data plane must answer hello (three misses in a row: restart).
HEALTH_INTERVAL_S = 5.0
# Weight changes reach the data plane at most this often (a backend going
# down is pushed at once, whatever the interval).
PUSH_INTERVAL_S = 1.0
# How often the status file (run_dir/NAME.status.json) is rewritten.
STATUS_INTERVAL_S = 1.0
# A loop turn this late (the loop waits at most 0.25 s) means the control
# plane itself was stalled: heartbeats due meanwhile are not held against
# the agents.
LOOP_STALL_S = 2.0
# How long a local fault stays on the status's alarm list after it ended.
ALARM_HOLD_S = 10.0

# Maglev (NSDI 2016) advises a table at least 100 times the backend count.
SLOTS_PER_BACKEND_ADVISED = 100
# Without the C Maglev fill, a configuration whose rings take longer than
# this to rebuild in Python is refused (check_maglev_fill).
PYTHON_FILL_MAX_S = PUSH_INTERVAL_S

@dataclass(frozen=True)
class Paths:
    state_dir: Path
    run_dir: Path

    @classmethod
    def for_appliance(cls, name: str, state_dir: Path | None, run_dir: Path | None) -> Paths:
        return cls(
            state_dir or Path("/var/lib/hpclb") / name,
            run_dir or Path("/run/hpclb"),
        )


def warn_small_rings(config: HpclbConfig) -> None:
    """Once per configuration read: pools too large for the ring size."""
    ring_size = config.appliance.ring_size
    for name, pool in config.pools.items():
        if ring_size < SLOTS_PER_BACKEND_ADVISED * len(pool.backends):
            log.warning(
                "pool %s: %d backends on a %d-slot ring: below %d slots per backend, "
                "Maglev moves more flows than needed when a backend leaves; raise "
                "appliance.ring_size", name, len(pool.backends), ring_size,
                SLOTS_PER_BACKEND_ADVISED)


def check_maglev_fill(config: HpclbConfig) -> None:
    """Without the C Maglev fill (libhpclb_maglev.so), rings are filled in
    Python: one loud warning naming the cost, or StartError when rebuilding
    every pool's ring would take longer than the interval between weight
    pushes (the loop would fall behind its own pushes and probes)."""
    missing = maglev.c_fill_missing()
    if missing is None:
        return
    size = config.appliance.ring_size
    costs = {name: maglev.python_fill_estimate_s(len(config.pools[name].backends), size)
             for name in {v.pool for v in config.vips}}
    total = sum(costs.values())
    worst = max(costs, key=lambda name: costs[name], default=None)
    cost = (f"rebuilding this configuration's rings takes ~{total * 1e3:.0f} ms"
            + ("" if worst is None else
               f" (largest: pool {worst}, {len(config.pools[worst].backends)} backends on "
               f"{size} slots, ~{costs[worst] * 1e3:.0f} ms)")
            + ", at start and at every weight change")
    if total > PYTHON_FILL_MAX_S:
        raise StartError(f"Maglev fill in Python, 4-30x slower than in C: {cost}, over "
                         f"the {PYTHON_FILL_MAX_S:g} s allowed; {missing}")
    log.warning("Maglev fill in Python, 4-30x slower than in C: %s; %s", cost, missing)


def warn_empty_pools(config: HpclbConfig) -> None:
    """Once per configuration read: VIPs whose pool has no backend (they drop
    everything; valid, as a pool may await its nodes)."""
    for warning in config.empty_pool_warnings():
        log.warning("%s", warning)


#: A ring digest covers each slot's backend name NUL-padded to this many bytes
#: (a name has at most 63: config.Name), so it does not depend on the ids,
#: which each appliance numbers in its own order.
RING_DIGEST_NAME_BYTES = 64


def ring_digest(ring: np.ndarray, names: dict[int, str]) -> str:
    """The fleet's ring digest: SHA-256 over the backend name of each slot, in
    slot order, each NUL-padded to RING_DIGEST_NAME_BYTES (a slot of no backend:
    all NULs); hex, first 16 characters. Members of a fleet whose digests are
    equal hand every flow hash to the same backend."""
    slots = np.asarray(ring)
    present, where = np.unique(slots, return_inverse=True)
    lut = np.array([names.get(int(i), "").encode() for i in present],
                   dtype=f"S{RING_DIGEST_NAME_BYTES}")
    return hashlib.sha256(lut[where.reshape(-1)].tobytes()).hexdigest()[:16]


def pool_ring(decisions: tuple[BackendDecision, ...], ids: dict[str, int],
              ring_size: int) -> np.ndarray:
    """Maglev ring of a pool from its backends' decided weights (already 0 for a
    backend that is not UP: controller.backends)."""
    return maglev.build_table([(ids[d.name], d.name, d.weight) for d in decisions], ring_size)


def nat_tables(config: HpclbConfig) -> NatConfig:
    """The data plane's NAT settings (struct lb_nat_config) from the `nat:` section.
    The SNAT pool holds both families, normalised as the data plane holds it
    (IPv4 then IPv6, each in the configured order: ``snat_order``), so that a
    push's dump read back compares equal."""
    nat = config.nat
    snat = nat.snat
    return NatConfig(
        snat_addrs=snat_order(ipaddress.ip_address(a) for a in snat.addresses) if snat else (),
        snat_port_min=snat.ports.min if snat else NatConfig.snat_port_min,
        snat_port_max=snat.ports.max if snat else NatConfig.snat_port_max,
        on_backend_down=NatDown[nat.on_backend_down.name],
        timeouts_s=nat.timeouts.by_state(),
    )


def vip_entry(config: HpclbConfig, vip: VipConfig, vip_id: int) -> Vip:
    """The data plane's VIP (struct lb_vip_entry) of a configured one: a NAT
    VIP carries its backends' port (explicit, even when it is the VIP's) and
    whether it takes SNAT; a tunnel VIP its encapsulation, the outer source
    prefix's network address and host bits (at most 16), and its GUE port
    (0 with IPIP)."""
    proto = PROTOCOLS[vip.protocol.value]
    if vip.mode is ForwardingMode.NAT:
        return Vip(vip_id, vip.address, vip.port, proto, mode=VipMode.NAT,
                   nat_port=config.vip_backend_port(vip), snat=config.vip_snat(vip))
    tunnel = config.vip_tunnel(vip)
    if tunnel is not None:  # the schema refuses a tunnel VIP without settings
        return Vip(vip_id, vip.address, vip.port, proto, mode=VipMode.TUNNEL,
                   tunnel_src=tunnel.source.network_address,
                   tunnel_encap=Encap[tunnel.encap.name], gue_port=tunnel.port,
                   tunnel_src_bits=tunnel.src_bits)
    return Vip(vip_id, vip.address, vip.port, proto)


class StartError(Exception):
    """The appliance cannot start with its configuration (the message says why)."""


@dataclass
class Prepared:
    """Everything a configuration needs, acquired and computed by
    ``Controller._prepare``, not yet in force."""

    config: HpclbConfig
    monitors: MonitorPlan
    decider: BackendDecider
    checkpoint: Checkpoint
    desired: TableSet
    decisions: dict[str, tuple[BackendDecision, ...]]
    faces: list[FaceChange] = field(default_factory=list)  # bound, not yet in force
    notes: list[str] = field(default_factory=list)


class FaceChange(Protocol):
    """What a face prepared for a configuration: put in force or released."""

    def commit(self) -> None: ...

    def abort(self) -> None: ...


class Face(Protocol):
    """Something that shows the controller's status outside it (the metrics
    exporter; the REST API). The CLI wires faces in; the controller only
    prepares them with each configuration (``prepare`` binds what it needs and
    raises StartError when it cannot, so a start or reload is refused before
    anything is in force) and closes them when it stops."""

    def prepare(self, config: HpclbConfig,
                status: Callable[[], dict[str, Any] | None]) -> FaceChange: ...

    def close(self) -> None: ...


class Controller:
    def __init__(
        self,
        config_path: Path,
        state_dir: Path | None = None,
        run_dir: Path | None = None,
        keep_dataplane: bool = False,
        faces: Sequence[Face] = (),
    ) -> None:
        self.config_path = config_path
        # The text in force beside its parse: the REST API edits that text (and
        # only while the file still holds it), and its hash is the revision.
        self.config_text = read_config_text(config_path)
        self.config = parse_config(self.config_text, str(config_path))
        self.revision = revision_of(self.config_text)
        self.operations = Operations(self)
        self._document: ConfigDocument | None = None  # apply_edit's, of config_text
        self.paths = Paths.for_appliance(self.config.appliance.name, state_dir, run_dir)
        self.keep_dataplane = keep_dataplane
        self.faces = tuple(faces)
        self.checkpoint = Checkpoint.load(self.paths.state_dir / "ids.json", MAX_BACKENDS, MAX_VIPS)
        # The state checkpoint (health, weights, pins, what was pushed): restored
        # in start(), written by step() (hpclb.controller.statefile).
        self.state = StateKeeper(self.paths.state_dir)
        self.current: TableSet | None = None
        # (address, routed) -> MAC: a routed lookup may give a next hop's MAC,
        # which a DSR backend of the same address must never get.
        self.macs: dict[tuple[IPAddress, bool], str] = {}
        self.choice = choose_dataplane(self.config)
        log.info("data plane: %s (%s)", self.choice.kind.value, self.choice.reason)
        host = DpdkHost(self.config, self.paths.run_dir) if self.choice.kind == "dpdk" else None
        self.dpdk_host = host
        self.wake = threading.Event()  # set by events and signals: the loop turns at once
        self.dataplane = DataplaneProcess(
            argv=dataplane_argv(self.config, self.choice),
            endpoint=self.config.appliance.control_socket,
            pidfile=self.paths.run_dir / f"{self.config.appliance.name}.pid",
            log_path=self.paths.run_dir / f"{self.config.appliance.name}.dataplane.log",
            before_start=host.before_start if host else None,
            after_ready=host.after_ready if host else None,
            after_stop=host.after_stop if host else None,
            while_starting=host.while_starting if host else None,
            # A data plane that dies wakes the loop at once: the restart
            # window is what the EAL takes, not a poll interval.
            on_exit=self.wake.set,
        )
        self.unresolved_addrs: set[tuple[IPAddress, bool]] = set()
        self.desired: TableSet | None = None
        self.push_pending = False
        self._last_retry = 0.0
        self._last_health = time.monotonic()
        self.reload_requested = threading.Event()
        self.stop_requested = threading.Event()
        self.decider = BackendDecider(self.config)
        self.monitors = Monitors(self.wake, self.config.appliance.netns)
        self._rings: dict[str, tuple[tuple[Any, ...], np.ndarray]] = {}  # pool -> (key, ring)
        # pool -> (ring key, digest): a fleet's ring digests, computed once per ring built.
        self._ring_digests: dict[str, tuple[tuple[Any, ...], str]] = {}
        # The decisions the last tables were built from ("did anything change?").
        self._pushed_decisions: dict[str, tuple[BackendDecision, ...]] = {}
        self._last_push = 0.0
        self._weights_due = False
        self._last_status = 0.0
        self.status: dict[str, Any] | None = None  # the last snapshot (status file, faces)
        self._touched_dataplane = False  # adopted or started by this process
        self._started = False  # start() completed
        self._last_turn = time.monotonic()
        self._stalled: tuple[float, float] | None = None  # (when noticed, seconds)
        self.hello: dict[str, Any] = {}  # the data plane's last hello (status)
        self.push_stats: dict[str, Any] = {"count": 0, "failures": 0, "last_duration_s": None,
                                           "last_at": None}
        # BGP announcements (hpclb.announce), with a `bgp:` section; whether the
        # data plane answered its last hello is one of their inputs.
        self.speaker: Speaker | None = None
        # The data plane whose liveness interface the speaker's routes go
        # through (read from its command line once per process), and its name.
        self._alive_pid: int | None = None
        self._alive_name: str | None = None
        self._dataplane_answers = True

    # --- desired state -----------------------------------------------------

    def _mac(self, addr: IPAddress, configured: str | None,
             resolve: bool = True, routed: bool = False) -> str | None:
        """The backend's MAC, or None when it does not answer ARP or NDP (asked
        again only when ``resolve``: the retry tick, not every weight push).
        ``routed`` (a tunnel pool's backend): the MAC of the next hop towards
        it when it is not on a connected network."""
        if configured:
            return configured
        key = (addr, routed)
        if key not in self.macs:
            if not resolve and key in self.unresolved_addrs:
                return None  # still unresolved: the retry tick asks again
            try:
                self.macs[key] = resolve_mac(addr, self.config.appliance.netns, routed=routed)
            except NeighbourError as err:
                log.warning("%s: taken out of the ring until it answers", err)
                self.unresolved_addrs.add(key)
                return None
        self.unresolved_addrs.discard(key)
        return self.macs[key]

    def _ring(self, pool: str, decisions: tuple[BackendDecision, ...], ring_size: int,
              ids: dict[str, int] | None = None) -> np.ndarray:
        """The pool's ring, rebuilt only when its backends' ids or weights changed
        (a state change without a weight change moves no slot)."""
        ids = self.checkpoint.backends.ids if ids is None else ids
        key = (ring_size, tuple((ids[d.name], d.name, d.weight) for d in decisions))
        cached = self._rings.get(pool)
        if cached is None or cached[0] != key:
            cached = self._rings[pool] = (key, pool_ring(decisions, ids, ring_size))
        return cached[1]

    def fleet_report(self) -> dict[str, Any] | None:
        """The status's ``fleet`` block (None outside a fleet): the members, the
        window and each VIP's ring digest, which an operator compares across
        the members' ``hpclb status``. A digest is computed once per ring
        built (the key of the ring cache), not per status write."""
        fleet = self.config.fleet
        if fleet is None:
            return None
        digests: dict[str, str] = {}
        names: dict[int, str] | None = None
        for pool, (key, ring) in self._rings.items():
            cached = self._ring_digests.get(pool)
            if cached is None or cached[0] != key:
                if names is None:  # ids are never reassigned while a name is configured
                    names = {bid: name for name, bid in self.checkpoint.backends.ids.items()}
                cached = self._ring_digests[pool] = (key, ring_digest(ring, names))
            digests[pool] = cached[1]
        for pool in [p for p in self._ring_digests if p not in self._rings]:
            del self._ring_digests[pool]
        return {"appliance": self.config.appliance.name, "members": list(fleet.members),
                "window": fleet.window,
                "rings": {v.name: digests[v.pool] for v in self.config.vips
                          if v.pool in digests}}

    def tables_for(self, config: HpclbConfig, resolve: bool = True) -> TableSet:
        """The tables of the configuration in force, as the decider decides now."""
        tables, self._pushed_decisions = self._build_tables(config, self.decider,
                                                            self.checkpoint, resolve)
        self.checkpoint.save()
        return tables

    def _build_tables(self, config: HpclbConfig, decider: BackendDecider, checkpoint: Checkpoint,
                      resolve: bool = True
                      ) -> tuple[TableSet, dict[str, tuple[BackendDecision, ...]]]:
        """Tables for ``config`` from the decisions of ``decider`` and the ids of
        ``checkpoint`` (updated in memory for new names; the caller saves it)."""
        app = config.appliance
        now = time.time()
        backends = [b for p in config.pools.values() for b in p.backends]
        checkpoint.backends.retain({b.name for b in backends})
        checkpoint.vips.retain({v.name for v in config.vips})
        egress_port = {name: i + 1 for i, name in enumerate(app.interfaces.egress)}

        # MACs first: whether a backend can be addressed at all is one of the
        # inputs of its decision.
        routed = {b.name for name in config.tunnel_pools() if name in config.pools
                  for b in config.pools[name].backends}
        macs = {b.name: self._mac(b.address, b.mac, resolve, b.name in routed)
                for b in backends}
        decider.set_unresolved(name for name, mac in macs.items() if mac is None)
        decisions = decider.all_decisions(now)
        decided = {d.name: d for ds in decisions.values() for d in ds}

        tables = TableSet(hash_key=app.hash_key_bytes, ring_size=app.ring_size)
        for b in backends:
            bid = checkpoint.backends.get(b.name)
            tables.backends[bid] = Backend(
                backend_id=bid,
                addr=b.address,
                mac=macs[b.name] or NO_MAC,
                state=decided[b.name].state,
                port=egress_port[b.via] if b.via else 0,
            )
        ids = checkpoint.backends.ids
        for v in config.vips:
            vid = checkpoint.vips.get(v.name)
            tables.vips[vid] = vip_entry(config, v, vid)
            tables.rings[vid] = self._ring(v.pool, decisions[v.pool], app.ring_size, ids)
        tables.nat = nat_tables(config)
        return tables, decisions

    # --- pushing -------------------------------------------------------------

    def _push(self, desired: TableSet) -> bool:
        """Push ``desired``; on any failure, forget what we think the data plane
        holds (the next push reads it back) and retry from the loop."""
        self.desired = desired
        started = time.monotonic()
        try:
            report = push_tables(self.dataplane.client, self.current, desired)
        except Exception as err:  # the data plane keeps its last good tables
            log.error("table push failed, will retry: %s", err)
            self.current = None
            self.push_pending = True
            self.push_stats["failures"] += 1
            return False
        self.current = desired
        self.push_pending = False
        self._last_push = time.monotonic()
        self.push_stats.update(count=self.push_stats["count"] + 1, last_at=time.time(),
                               last_duration_s=self._last_push - started)
        log.info("pushed tables: %s", report.summary())
        return True

    # --- configurations, as transactions --------------------------------------

    def _restart_only(self, config: HpclbConfig) -> HpclbConfig:
        """``config`` with the settings a running data plane cannot change (its
        command line: data plane, interfaces, socket, ring) kept as in force.
        The connection table's size is the exception: the running data plane
        keeps its table, and the new size is what its next start gets (a
        restart of hpclb, or of a data plane that exited; ``_commit``)."""
        same_size = config.model_copy(update={"nat": config.nat.model_copy(
            update={"conn_table_size": self.config.nat.conn_table_size})})
        if dataplane_argv(same_size, self.choice) == self.dataplane.argv:
            return config
        log.warning("data plane, interface, socket or ring settings changed: restart "
                    "hpclb to apply them; applying the rest now")
        new = config.appliance
        kept = self.config.appliance.model_copy(update={
            "hash_key": new.hash_key, "metrics": new.metrics,
            "management_address": new.management_address})
        return config.model_copy(update={"appliance": kept})

    def _prepare(self, config: HpclbConfig, decider: BackendDecider | None = None,
                 fill_checked: bool = False) -> Prepared:
        """Acquire and check everything ``config`` needs; change nothing in
        force. Raises (ConfigError, StartError, OSError...) after releasing
        what it acquired. ``fill_checked``: the caller ran check_maglev_fill."""
        if not fill_checked:
            check_maglev_fill(config)
        check_host(config, str(self.config_path))
        dataplane_argv(config, self.choice)  # renders (and finds the binary)
        plan = self.monitors.prepare(config)
        faces: list[FaceChange] = []
        try:
            for face in self.faces:
                faces.append(face.prepare(config, lambda: self.status))
            if decider is None:  # a reload: the decisions as they would be, on a copy
                decider = copy.deepcopy(self.decider)
                decider.reconfigure(config)
            checkpoint = copy.deepcopy(self.checkpoint)
            desired, decisions = self._build_tables(config, decider, checkpoint)
            # Before anything is pushed: a restart must find every id in use.
            checkpoint.save()
        except BaseException:
            self.monitors.abort(plan)
            for change in faces:
                change.abort()
            raise
        return Prepared(config, plan, decider, checkpoint, desired, decisions, faces)

    def _abort(self, prepared: Prepared) -> None:
        """Release what ``_prepare`` acquired for a configuration never put in force."""
        self.monitors.abort(prepared.monitors)
        for change in prepared.faces:
            change.abort()

    def _commit(self, prepared: Prepared) -> None:
        """Put a prepared configuration in force and push its tables."""
        config = prepared.config
        # The next start's command line: ``_restart_only`` lets only the
        # connection table's size differ from the running data plane's.
        argv = dataplane_argv(config, self.choice)
        if argv != self.dataplane.argv:
            if config.nat.conn_table_size != self.config.nat.conn_table_size:
                log.warning("nat.conn_table_size %d -> %d entries: takes effect at the next "
                            "data-plane start; the running data plane keeps its table and "
                            "its connections", self.config.nat.conn_table_size,
                            config.nat.conn_table_size)
            else:
                log.warning("the data plane's command line changed (bgp.alive_interface): "
                            "takes effect at its next start; the VIPs' routes follow the "
                            "interface the running data plane holds")
            self.dataplane.argv = argv
        self.config = config
        self.decider = prepared.decider
        self.checkpoint = prepared.checkpoint
        warn_small_rings(config)
        warn_empty_pools(config)
        for change in prepared.faces:
            change.commit()
        self._pushed_decisions = prepared.decisions
        self._push(prepared.desired)
        self.monitors.commit(prepared.monitors, config)
        self._bgp_follow(config)

    def start(self) -> None:
        """Acquire everything, then adopt (or start) the data plane and push.
        StartError/ConfigError before anything was adopted or started."""
        # A configuration whose rings cannot be built in time is refused before
        # anything else, the state checkpoint included.
        check_maglev_fill(self.config)
        # The state checkpoint next: the first tables are then those pushed
        # before a restart, and the adopted data plane gets nothing again.
        restored = self.state.restore(self.decider, self.config, self.revision,
                                      time.monotonic(), time.time())
        self.macs.update(restored.macs)
        try:
            prepared = self._prepare(self.config, self.decider, fill_checked=True)
        except (ConfigError, StartError):
            raise
        except Exception as err:
            raise StartError(str(err)) from err
        self._touched_dataplane = True
        adopted = self.dataplane.adopt_or_start()
        # Kept for the status (attach mode, capabilities: what diagnose and the API show).
        hello = self.hello = self.dataplane.client.hello()
        if adopted and hello.get("ring_size") != self.config.appliance.ring_size:
            log.warning("running data plane has a %s-slot ring, the configuration %d: "
                        "restarting it", hello.get("ring_size"), self.config.appliance.ring_size)
            self.dataplane.stop()
            self.dataplane.start()
            hello = self.hello = self.dataplane.client.hello()
        log.info(
            "data plane %s, attach mode %s, ring size %s",
            hello.get("dataplane"), hello.get("attach_mode"), hello.get("ring_size"),
        )
        self._check_nat_support(hello, adopted)
        self.current = None  # read back what it holds, adopted or fresh
        self._commit(prepared)
        self._started = True
        self.state.started(self._state_snapshot(), restored, time.monotonic(), time.time())
        self._last_turn = time.monotonic()  # a long start-up is not a stalled loop

    def _check_nat_support(self, hello: dict[str, Any], adopted: bool) -> None:
        """Warnings, never a refusal: a data plane without NAT mode (whose set_vip
        refuses NAT VIPs, a push error retried) or an adopted one whose connection
        table is not the configured size (it keeps it: a restart would drop
        every connection; the size takes effect at its next start)."""
        nat_vips = [v.name for v in self.config.vips if v.mode is ForwardingMode.NAT]
        caps = hello.get("capabilities", ())
        if nat_vips and "nat" not in caps:
            log.error("NAT VIPs %s: the %s data plane has no NAT mode (its capabilities: "
                      "%s); their pushes are refused", ", ".join(nat_vips),
                      hello.get("dataplane"), ", ".join(caps))
        nat6_vips = [v.name for v in self.config.vips
                     if v.mode is ForwardingMode.NAT and v.address.version == 6]
        if nat6_vips and "nat" in caps and "nat6" not in caps:
            log.error("IPv6 NAT VIPs %s: the %s data plane has no NAT mode for IPv6 (no "
                      "\"nat6\" capability; its capabilities: %s); their pushes are refused",
                      ", ".join(nat6_vips), hello.get("dataplane"), ", ".join(caps))
        size = hello.get("conn_table_size")
        want = self.config.nat.conn_table_size
        if adopted and size and size != want:
            log.warning("running data plane has a %s-entry connection table, "
                        "nat.conn_table_size is %d: takes effect at the next data-plane "
                        "start", size, want)

    def reload(self) -> bool:
        """Re-read the configuration file; put it in force whole, or refuse it
        whole ("reload refused: <reason>") and change nothing."""
        try:
            text = read_config_text(self.config_path)
            config = self._restart_only(parse_config(text, str(self.config_path)))
            prepared = self._prepare(config)
        except Exception as err:
            if not isinstance(err, (ConfigError, StartError, OSError, ValueError)):
                log.debug("reload preparation failed", exc_info=True)
            log.error("reload refused, keeping the running configuration: %s", err)
            return False
        self.macs.clear()  # a replaced NIC or a moved VM has a new MAC
        self.config_text, self.revision = text, revision_of(text)
        self._commit(prepared)
        if self.dpdk_host is not None:  # VIPs added or removed: the kernel holds none
            self.dpdk_host.sync_vips(self.config)
        log.info("reload applied")
        return True

    # --- changes from the faces (the loop thread, through Operations) ---------

    def apply_edit(self, edit: Edit, if_match: str | None) -> str:
        """One REST write as a transaction: edit the text in force, validate it
        as a reload would, prepare it, write the file (write, fsync, rename),
        then put it in force. Returns the new revision; EditError (nothing
        changed anywhere) when refused at any step before the commit."""
        if if_match not in (None, "*") and if_match != self.revision:
            raise EditError("precondition_failed", f"the configuration is at revision "
                            f"{self.revision}, not {if_match}: read it again")
        try:
            on_disk = read_config_text(self.config_path)
        except ConfigError as err:
            raise EditError("unavailable", str(err)) from err
        if on_disk != self.config_text:
            raise EditError("conflict", f"{self.config_path} changed on disk since it was "
                            "loaded: reload it (SIGHUP) before changing it through the API")
        # The document of the text in force, parsed once and kept between writes
        # (ruamel's round-trip parse of a 1,000-backend file takes about a
        # second); taken out while it is edited, kept only once in force.
        doc, self._document = self._document, None
        if doc is None or doc.source_text is not self.config_text:
            doc = ConfigDocument.parse(self.config_text, str(self.config_path))
        edit(doc)
        text = doc.text()
        if text == self.config_text:
            self._document = doc
            return self.revision
        try:
            config = parse_config(text, str(self.config_path))
        except ConfigError as err:
            raise EditError("invalid", "the configuration this change makes is refused",
                            [str(i) for i in err.issues]) from err
        try:
            prepared = self._prepare(self._restart_only(config))
        except (ConfigError, StartError, OSError, ValueError) as err:
            raise EditError("invalid", f"refused: {err}") from err
        try:
            # The operator's file keeps its permissions (it may be 0640).
            path = self.config_path
            write_atomically(path, text.encode("utf-8", "surrogatepass"),
                             path.stat().st_mode & 0o7777 if path.exists() else 0o640)
        except OSError as err:
            self._abort(prepared)
            raise EditError("unavailable", f"cannot write {self.config_path}: "
                            f"{err.strerror or err}; nothing changed") from err
        self.config_text, self.revision = text, revision_of(text)
        doc.source_text = text
        self._document = doc
        self._commit(prepared)
        if self.dpdk_host is not None:
            self.dpdk_host.sync_vips(self.config)
        log.info("configuration changed through the API: revision %s", self.revision)
        self._after_change()
        return self.revision

    def _after_change(self) -> None:
        """After an acknowledged change: the state checkpoint and the status at
        once, so a restart right after the answer finds the change there and the
        answer (built from the status) shows it."""
        self.state.write(self._state_snapshot(), time.monotonic(), time.time())
        self.write_status()

    def pin(self, backend: str, weight: float | None, duration_s: float) -> None:
        """Pin (or, with ``weight`` None, unpin) a backend's ring weight; pushed now."""
        if self.config.pool_of(backend) is None:
            raise EditError("not_found", f"no backend {backend!r}")
        self.decider.pin(backend, weight, time.time() + duration_s)
        log.info("backend %s: %s", backend, "unpinned" if weight is None else
                 f"weight pinned at {weight:g} for {duration_s:g} s")
        self._push(self.tables_for(self.config, resolve=False))
        self._after_change()

    # --- events --------------------------------------------------------------

    def _handle_events(self) -> None:
        """Probe verdicts and telemetry since the last turn: a health change is
        pushed now; a weight change when the push interval allows."""
        urgent = False
        mono, wall = time.monotonic(), time.time()
        for event in self.monitors.drain():
            if isinstance(event, ProbeVerdict):
                t = event.transition
                urgent |= self.decider.probe(t.backend, t.up, t.reason, t.time) is not None
            elif isinstance(event, TelemetryArrived):
                msg, mono, wall = event.msg, event.mono, event.wall
                _, change = self.decider.telemetry(msg, self.monitors.rtt_ms(msg.node), mono, wall)
                urgent |= change is not None
                self._weights_due = True
        now = time.monotonic()
        urgent |= bool(self.decider.expire(now, time.time(), self._heard_since(now)))
        # Backends restored as failing their probe: up once the probes say so.
        urgent |= bool(self.state.reconcile_probes(self.decider, self.monitors.probe_verdicts(),
                                                   self.config, time.time()))
        # Ramps (rate limit, slow start) move weights between events too.
        self._weights_due |= self.decider.ramps()
        interval_over = time.monotonic() - self._last_push >= PUSH_INTERVAL_S
        if urgent or (self._weights_due and interval_over):
            self._weights_due = False
            # With the MACs as the last build found them: only a build resolves.
            decisions = self.decider.all_decisions(time.time())
            if urgent or decisions != self._pushed_decisions:
                self._push(self.tables_for(self.config, resolve=False))

    def _heard_since(self, now: float) -> float | None:
        """Since when the appliance could hear its agents (see BackendHealth.expire):
        the receiver's own view, and no stall of this loop."""
        heard = self.monitors.heard_since(now)
        if heard is None or self._stalled is None:
            return heard
        return max(heard, self._stalled[0])

    def _note_turn(self, now: float) -> None:
        """A turn that comes LOOP_STALL_S late: the loop itself stalled."""
        gap = now - self._last_turn
        self._last_turn = now
        if gap > LOOP_STALL_S:
            self._stalled = (now, gap)
            log.warning("control loop stalled %.1fs: heartbeats due meanwhile are not held "
                        "against the agents", gap)

    def alarms(self, now: float) -> list[dict[str, Any]]:
        """Local faults in force: the monitors' and this loop's."""
        out = self.monitors.alarms() + self.state.alarms(now)
        if self.speaker is not None:
            out += self.speaker.alarms(now, time.time())
        if self._stalled is not None and now - self._stalled[0] < ALARM_HOLD_S:
            out.append({"source": "loop",
                        "message": f"control loop stalled {self._stalled[1]:.1f}s "
                                   f"{now - self._stalled[0]:.0f}s ago"})
        return out

    def _health_report(self, report: dict[str, Any]) -> None:
        """Add what the probes know (unknown verdicts, damping) to each backend."""
        verdicts = self.monitors.probe_verdicts()
        for name, h in report.get("health", {}).items():
            v = verdicts.get(name, {})
            h["unknown"] = bool(h.get("beats_unknown") or v.get("unknown"))
            if v:
                h["damping"] = {"suppressed": bool(v.get("suppressed")),
                                "penalty": round(float(v.get("penalty", 0.0)), 1),
                                "release_at": v.get("release_at")}

    def write_status(self) -> None:
        """run_dir/NAME.status.json: health, decided weights, telemetry and probe
        counters, for operators (`hpclb status`) and the lab tests."""
        report = self.decider.report(time.time())
        self._health_report(report)
        status = {"time": time.time(), "dataplane": self.choice.kind.value,
                  "revision": self.revision,
                  "pushes_pending": self.push_pending,
                  "alarms": self.alarms(time.monotonic()), **report,
                  **self.monitors.counters(),
                  "ids": {"vips": dict(self.checkpoint.vips.ids),
                          "backends": dict(self.checkpoint.backends.ids)},
                  "rtt_ms": {b.name: self.monitors.rtt_ms(b.name)
                             for p in self.config.pools.values() for b in p.backends},
                  "push": dict(self.push_stats),
                  "memory": {"control_rss_bytes": rss_bytes("self"),
                             "dataplane_rss_bytes": (None if self.dataplane.pid is None
                                                     else rss_bytes(self.dataplane.pid))},
                  "vip_pools": {v.name: v.pool for v in self.config.vips},
                  "dataplane_info": self._dataplane_info(),
                  "checkpoint": self.state.status()}
        if self.speaker is not None:
            status["bgp"] = self.speaker.report(time.monotonic(), time.time())
        fleet = self.fleet_report()
        if fleet is not None:
            status["fleet"] = fleet
        try:
            status["dataplane_stats"] = self.dataplane.client.stats()
        except Exception as err:  # a missing figure, not a reason to stop
            log.debug("data-plane stats unavailable: %s", err)
        self.status = status
        path = self.paths.run_dir / f"{self.config.appliance.name}.status.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(status, indent=1, default=str))
        tmp.replace(path)

    def _state_snapshot(self) -> Snapshot:
        """What the state checkpoint keeps, as in force now (rings: as pushed)."""
        vip_ids = self.checkpoint.vips.ids
        rings = ({} if self.current is None else
                 {name: (vid, self.current.rings[vid]) for name, vid in vip_ids.items()
                  if vid in self.current.rings})
        return Snapshot(self.config.appliance.name, self.revision, self.config_text,
                        self.decider, self._pushed_decisions, rings, self.macs)

    def _dataplane_info(self) -> dict[str, Any]:
        app = self.config.appliance
        return {"kind": self.choice.kind.value, "reason": self.choice.reason,
                "attach_mode": self.hello.get("attach_mode"), "pid": self.dataplane.pid,
                "capabilities": list(self.hello.get("capabilities", ())),
                "interfaces": {"ingress": app.interfaces.ingress,
                               "egress": list(app.interfaces.egress)},
                "netns": app.netns}

    # --- BGP announcements (hpclb.announce) -------------------------------------

    def _bgp_follow(self, config: HpclbConfig) -> None:
        """A configuration put in force: start, change or end the announcements."""
        try:
            if config.bgp is None:
                if self.speaker is not None:
                    log.warning("bgp: section removed: withdrawing every VIP")
                    self.speaker.withdraw_all(self._bgp_inputs(self.speaker), wait=False)
                    self.speaker = None
            elif self.speaker is None:
                self.speaker = Speaker(config.bgp)
                self._alive_pid = None
                self._bgp_device()
                self.speaker.prepare()
            else:
                self.speaker.reconfigure(config.bgp)
                self._bgp_device()
        except OSError as err:  # its files: the status shows it, the loop retries
            log.error("bgp: cannot write the speaker's configuration: %s", err)
            if self.speaker is not None:
                self.speaker.error = str(err)

    def _bgp_inputs(self, speaker: Speaker) -> Inputs:
        """What an announcement depends on: the data plane serving (alive,
        answering hello, holding tables) and, per VIP address, its pools'
        backends in service (as last pushed)."""
        fault = None
        if not self.dataplane.alive():
            fault = "data plane not running"
        elif not self._dataplane_answers:
            fault = "data plane did not answer its last health check (hello)"
        elif self.current is None:
            fault = "data plane holds no tables yet (push pending)"
        pools_of: dict[str, tuple[str, ...]] = {}
        for v in self.config.vips:
            have = pools_of.get(str(v.address), ())
            pools_of[str(v.address)] = have if v.pool in have else (*have, v.pool)
        in_service = {pool: sum(1 for d in ds if d.state is BackendState.UP and d.weight > 0)
                      for pool, ds in self._pushed_decisions.items()}
        return inputs_for(pools_of, in_service, fault, speaker.config)

    def _bgp_device(self) -> None:
        """The VIPs' routes go through the liveness interface the running data
        plane holds (its command line), not the configured one: a data plane
        adopted from an older hpclb, or started before a reload changed
        bgp.alive_interface, holds none or another, and routes through an
        absent interface would announce nothing."""
        if self.speaker is None or not self.dataplane.alive():
            return  # a dead one: the decision withdraws; the device stays
        if self.dataplane.pid != self._alive_pid:
            self._alive_pid = self.dataplane.pid
            self._alive_name = running_alive_interface(self.dataplane.pid)
        self.speaker.set_device(self._alive_name)

    def _bgp_update(self) -> None:
        if self.speaker is not None and self._started:
            self._bgp_device()
            self.speaker.update(self._bgp_inputs(self.speaker), time.monotonic(), time.time())

    def step(self) -> None:
        """One turn of the loop: restart a dead data plane, apply a reload,
        retry a failed push, and look again for backends that did not answer
        ARP or NDP."""
        now = time.monotonic()
        self._note_turn(now)
        if not self.dataplane.alive():
            self._bgp_update()  # withdrawn before the restart (and its back-off)
        if self.dataplane.restart_if_dead():
            self._dataplane_answers = True  # the restart waited for its hello
            self.current = None
            with contextlib.suppress(Exception):  # the status only; the push says more
                self.hello = self.dataplane.client.hello()
            self._push(self.tables_for(self.config))
        now = time.monotonic()
        if now - self._last_health >= HEALTH_INTERVAL_S:
            self._last_health = now
            self._dataplane_answers = self.dataplane.check_responsive()
        if self.reload_requested.is_set():
            self.reload_requested.clear()
            self.reload()
        self.operations.run_pending()
        self._handle_events()
        self._bgp_update()
        if self._started:  # the state checkpoint: on a change (coalesced) or its interval
            self.state.tick(self._state_snapshot(), time.monotonic(), time.time(),
                            self.config.appliance.checkpoint_interval_s)
        if now - self._last_status >= STATUS_INTERVAL_S:
            self._last_status = now
            self.write_status()
        if now - self._last_retry >= RETRY_INTERVAL_S:
            if self.unresolved_addrs:
                self._last_retry = now
                self._push(self.tables_for(self.config))
            elif self.push_pending and self.desired is not None:
                self._last_retry = now
                self._push(self.desired)

    def _bgp_stop(self) -> None:
        """Announcements on a stop: withdrawn (and given time to reach the
        routers) first when the data plane is about to stop; else kept, the
        speaker announcing while the data plane forwards without us."""
        if self.speaker is None:
            return
        stops_dataplane = (self._touched_dataplane and not self.keep_dataplane
                           and (self._started or not self.dataplane.adopted))
        if stops_dataplane:
            try:
                self.speaker.withdraw_all(self._bgp_inputs(self.speaker))
            except Exception:  # the data plane is stopped all the same
                log.exception("bgp: withdrawal on stop failed")
        else:
            log.info("bgp: announcements left to the speaker: the data plane keeps "
                     "forwarding")

    def run_forever(self, poll_s: float = 0.25) -> None:
        while not self.stop_requested.is_set():
            try:
                self.step()
            except Exception:  # never take the data plane down with us
                log.exception("control loop error; the data plane keeps its tables")
            self.wake.wait(poll_s)
            self.wake.clear()

    def shutdown(self) -> None:
        """Stop the monitors and the faces; stop the data plane unless told
        to keep it, or unless this process adopted it and never finished its
        start (a failed start must not take down traffic it did not carry).
        BGP announcements are withdrawn first when the data plane stops."""
        self._bgp_stop()
        self.monitors.stop()
        if self._started:  # the freshest state for the next start
            self.state.write(self._state_snapshot(), time.monotonic(), time.time())
        for face in self.faces:
            face.close()
        if not self._touched_dataplane:
            return  # never adopted nor started anything: nothing to leave or stop
        if self.keep_dataplane:
            log.info("leaving the data plane running (pid %s)", self.dataplane.pid)
            self.dataplane.client.close()
        elif not self._started and self.dataplane.adopted:
            log.warning("start failed: leaving the adopted data plane (pid %s) forwarding "
                        "with its tables", self.dataplane.pid)
            self.dataplane.client.close()
        else:
            self.dataplane.stop()
