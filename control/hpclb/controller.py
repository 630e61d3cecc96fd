"""The reconcile loop: configuration -> tables -> data plane.

One controller per appliance. It owns the only mutable state of the control
plane: the configuration in force, the tables last pushed, the id checkpoint
and the supervised data-plane process.

    desired = tables_for(config)          # MACs resolved, Maglev rings built
    push_tables(client, current, desired) # only what differs
    current = desired

A reload (SIGHUP) that fails validation keeps everything as it is. A data
plane that dies is restarted and gets the full tables again.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpclb import maglev
from hpclb.config import BackendState as AdminState
from hpclb.config import ConfigError, HpclbConfig, PoolConfig, load_config
from hpclb.dataplane.client import DataplaneError
from hpclb.dataplane.push import PushReport, fetch_tables, push_tables
from hpclb.dataplane.supervisor import DataplaneProcess, find_xdp_daemon
from hpclb.dataplane.tables import (
    MAX_BACKENDS,
    MAX_VIPS,
    PROTOCOLS,
    Backend,
    BackendState,
    TableSet,
    Vip,
)
from hpclb.neighbours import resolve_mac
from hpclb.state import Checkpoint

log = logging.getLogger("hpclb.controller")

# Maglev (NSDI 2016) advises a table at least 100 times the backend count.
SLOTS_PER_BACKEND_ADVISED = 100

_STATE = {
    AdminState.UP: BackendState.UP,
    AdminState.DRAINING: BackendState.DRAINING,
    AdminState.DOWN: BackendState.DOWN,
}


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


def xdp_argv(config: HpclbConfig, paths: Paths) -> list[str]:
    """Command line of the XDP daemon for this configuration."""
    app = config.appliance
    argv = [
        find_xdp_daemon(),
        "--iface", app.interfaces.ingress,
        "--socket", app.control_socket,
        "--ring-size", str(app.ring_size),
        "--flow-table-size", str(app.xdp.flow_table_size),
        "--xdp-mode", app.xdp.mode.value,
        "--pin-dir", f"/sys/fs/bpf/hpclb/{app.name}",
    ]
    for egress in app.interfaces.egress:
        argv += ["--egress", egress]
    if app.netns:
        argv += ["--netns", app.netns]
    return argv


def pool_ring(pool: PoolConfig, ids: dict[str, int], ring_size: int) -> np.ndarray:
    """Maglev ring of a pool: configured weight, 0 for backends not up."""
    members = [
        (ids[b.name], b.name, b.weight if b.state is AdminState.UP else 0.0)
        for b in pool.backends
    ]
    return maglev.build_table(members, ring_size)


class Controller:
    def __init__(
        self,
        config_path: Path,
        state_dir: Path | None = None,
        run_dir: Path | None = None,
        keep_dataplane: bool = False,
    ) -> None:
        self.config_path = config_path
        self.config = load_config(config_path)
        self.paths = Paths.for_appliance(self.config.appliance.name, state_dir, run_dir)
        self.keep_dataplane = keep_dataplane
        self.checkpoint = Checkpoint.load(self.paths.state_dir / "ids.json", MAX_BACKENDS, MAX_VIPS)
        self.current: TableSet | None = None
        self.macs: dict[ipaddress.IPv4Address, str] = {}
        self.dataplane = DataplaneProcess(
            argv=xdp_argv(self.config, self.paths),
            endpoint=self.config.appliance.control_socket,
            pidfile=self.paths.run_dir / f"{self.config.appliance.name}.pid",
            log_path=self.paths.run_dir / f"{self.config.appliance.name}.dataplane.log",
        )
        self.reload_requested = threading.Event()
        self.stop_requested = threading.Event()

    # --- desired state -----------------------------------------------------

    def _mac(self, addr: ipaddress.IPv4Address, configured: str | None) -> str:
        if configured:
            return configured
        if addr not in self.macs:
            self.macs[addr] = resolve_mac(addr, self.config.appliance.netns)
        return self.macs[addr]

    def tables_for(self, config: HpclbConfig) -> TableSet:
        app = config.appliance
        names = {b.name for p in config.pools.values() for b in p.backends}
        self.checkpoint.backends.retain(names)
        self.checkpoint.vips.retain({v.name for v in config.vips})
        egress_port = {name: i + 1 for i, name in enumerate(app.interfaces.egress)}

        tables = TableSet(hash_key=app.hash_key_bytes, ring_size=app.ring_size)
        for pool in config.pools.values():
            for b in pool.backends:
                bid = self.checkpoint.backends.get(b.name)
                tables.backends[bid] = Backend(
                    backend_id=bid,
                    addr=b.address,
                    mac=self._mac(b.address, b.mac),
                    state=_STATE[b.state],
                    port=egress_port[b.via] if b.via else 0,
                )
        for name, pool in config.pools.items():
            if app.ring_size < SLOTS_PER_BACKEND_ADVISED * len(pool.backends):
                log.warning(
                    "pool %s: %d backends on a %d-slot ring: below %d slots per backend, "
                    "Maglev moves more flows than needed when a backend leaves; raise "
                    "appliance.ring_size", name, len(pool.backends), app.ring_size,
                    SLOTS_PER_BACKEND_ADVISED)
        rings: dict[str, np.ndarray] = {}
        for v in config.vips:
            vid = self.checkpoint.vips.get(v.name)
            tables.vips[vid] = Vip(vid, v.address, v.port, PROTOCOLS[v.protocol.value])
            if v.pool not in rings:
                rings[v.pool] = pool_ring(
                    config.pools[v.pool], self.checkpoint.backends.ids, app.ring_size
                )
            tables.rings[vid] = rings[v.pool]
        self.checkpoint.save()
        return tables

    # --- pushing -------------------------------------------------------------

    def _push(self, desired: TableSet) -> PushReport:
        report = push_tables(self.dataplane.client, self.current, desired)
        self.current = desired
        log.info("pushed tables: %s", report.summary())
        return report

    def start(self) -> None:
        desired = self.tables_for(self.config)
        adopted = self.dataplane.adopt_or_start()
        hello = self.dataplane.client.hello()
        log.info(
            "data plane %s, attach mode %s, ring size %s",
            hello.get("dataplane"), hello.get("attach_mode"), hello.get("ring_size"),
        )
        if adopted:
            # Diff against what the surviving data plane really holds.
            self.current = fetch_tables(self.dataplane.client)
        self._push(desired)

    def reload(self) -> bool:
        """Re-read the configuration file and push what changed."""
        try:
            config = load_config(self.config_path)
        except ConfigError as err:
            log.error("reload refused, keeping the running configuration:\n%s", err)
            return False
        if xdp_argv(config, self.paths) != self.dataplane.argv:
            log.warning("interface, socket or ring settings changed: restart hpclb to apply them")
        self.config = config
        self._push(self.tables_for(config))
        return True

    def step(self) -> None:
        """One turn of the loop: restart a dead data plane, apply a reload."""
        if self.dataplane.restart_if_dead():
            self.current = None
            self._push(self.tables_for(self.config))
        if self.reload_requested.is_set():
            self.reload_requested.clear()
            self.reload()

    def run_forever(self, poll_s: float = 0.5) -> None:
        while not self.stop_requested.is_set():
            try:
                self.step()
            except DataplaneError as err:
                log.error("data plane error: %s", err)
            self.stop_requested.wait(poll_s)

    def shutdown(self) -> None:
        if self.keep_dataplane:
            log.info("leaving the data plane running (pid %s)", self.dataplane.pid)
            self.dataplane.client.close()
        else:
            self.dataplane.stop()
