"""An hpclb appliance running in the lab: config file, `hpclb run`, reloads.

Used by the demo, the lab end-to-end tests and the benchmark. The appliance is
the real thing: `hpclb run` in its own process, which starts `hpclb-xdp` in
the lab's appliance namespace; weight and state changes are made the way an
operator makes them (edit the YAML, send SIGHUP).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from hpclb.config.loader import ConfigError, parse_config
from hpclb.dataplane import exception_path
from hpclb.dataplane.client import DataplaneClient
from hpclb.dataplane.supervisor import stop_child, terminate_pid
from hpclb.host.netns import inside
from hpclb.lab.gateway import CLUSTER_ETH, GatewayLab
from hpclb.lab.topology import Lab
from hpclb.lab.tunnel import TunnelLab

LAB_HASH_KEY = "000102030405060708090a0b0c0d0e0f"
LAB_VIP = "198.18.1.10"
LAB_VIP6 = "fd48:4c01::10"  # hpclb.lab.topology.DEFAULT_VIP6
LAB_PORT = 8080
# Tunnel mode's outer source prefixes in the lab: on the client network (what the
# router forwards from), holding no VIP or backend address; 4 bits per flow.
LAB_TUNNEL_SOURCE = {4: "198.18.0.240/28", 6: "fd48:4c00::f0/124"}
# Where the node agents publish: a port on the appliance's lab address, which
# `hpclb run`'s telemetry receiver binds inside the appliance namespace.
LAB_TELEMETRY_PORT = 5557
# The REST API's port on the appliance's management address (api=True).
LAB_API_PORT = 8443
# LabAppliance.api's default token: the write token.
WRITE_TOKEN = object()


class LabApplianceError(RuntimeError):
    pass


class LabAppliance:
    """`hpclb run` for a lab, with helpers to change weights and states.

    By default the pool is static, without probes or telemetry. A lab that
    follows its backends passes ``weights_mode="dynamic"``, the pool's
    ``policy`` and ``probe`` (dicts, as in the YAML) and a ``telemetry``
    section (bind, server_key, allow_dir...); :meth:`status` reads the
    status file `hpclb run` rewrites every second.

    `hpclb run` is started as ``command_prefix + ["run", ...]``, by default
    this interpreter running this tree's CLI (``python -m hpclb.faces.cli``),
    in this process's environment with ``env`` set over it (default: nothing
    added). A caller that runs another tree's control plane (a benchmark
    comparing two builds that speak different table protocols) passes that
    tree's command and ``PYTHONPATH``, and talks to its data plane with that
    tree's client, not :attr:`client` (this tree's).

    ``mode``: the VIPs' forwarding mode, ``"dsr"`` (the one-LAN ``Lab``) or
    ``"nat"`` (a ``GatewayLab``: the appliance between the client and the cluster
    network, ``eth0`` the ingress, ``eth1`` the egress every backend is reached
    through, the management address on the cluster side). ``nat``: the
    configuration's ``nat:`` section as a dict, written as given; ``vip_options``:
    more fields of every VIP (e.g. a NAT VIP's backend port), ``vip_overrides``: more
    fields of the VIPs of one address ({address: fields}, over ``vip_options``), so
    that one appliance serves a NAT VIP with SNAT beside one without.
    :meth:`config_problem` says whether this build's configuration accepts what would
    be written. NAT mode is dual stack on a dual-stack ``GatewayLab``: an IPv6 VIP's
    pool is ``lab6``, the backends by their cluster-side IPv6 addresses, and the
    ``nat.snat.addresses`` given may mix both families (``GatewayLab(snat_ips=...)``
    holds them on the appliance).

    ``vips``: the VIP addresses (default ``LAB_VIP``), each served on TCP and UDP
    ``LAB_PORT``; a dual-stack lab (``Lab(ipv6=True)``) takes IPv6 ones too. A DSR
    VIP's pool is of its family: ``lab`` holds the backends by their IPv4 addresses,
    ``lab6`` by their IPv6 ones (named ``b1-v6``...; a weight or state change of
    ``b1`` changes both). ``"tunnel"`` (a ``TunnelLab``: backends behind a router;
    or the one-LAN lab, whose backends are on-link, as the benchmark has it)
    puts every VIP on one pool of the ``backend_family`` (the outer headers'), with
    the ``tunnel`` block given (default: IPIP from ``LAB_TUNNEL_SOURCE``); its
    backends' MACs are the router's (the next hop), found by the control plane
    or, with ``static_macs``, written into the configuration.
    """

    def __init__(self, lab: Lab, workdir: Path, weights: dict[str, float],
                 xdp_mode: str = "native", static_macs: bool = False,
                 dataplane: str = "xdp", dpdk_idle_sleep_us: int = 50, *,
                 weights_mode: str = "static", policy: dict[str, Any] | None = None,
                 probe: dict[str, Any] | None = None,
                 telemetry: dict[str, Any] | None = None,
                 metrics: str | None = None,
                 command_prefix: Sequence[str] | None = None,
                 env: Mapping[str, str] | None = None,
                 mode: str = "dsr",
                 nat: dict[str, Any] | None = None,
                 vip_options: dict[str, Any] | None = None,
                 vip_overrides: Mapping[str, dict[str, Any]] | None = None,
                 vips: Sequence[str] = (LAB_VIP,),
                 backend_family: int = 4,
                 tunnel: dict[str, Any] | None = None,
                 api: bool = False) -> None:
        if mode not in ("dsr", "nat", "tunnel"):
            raise ValueError(f"lab appliance mode must be dsr, nat or tunnel, got {mode!r}")
        if (mode == "nat") != isinstance(lab, GatewayLab):
            raise ValueError("NAT mode runs on a GatewayLab (two networks), DSR on a Lab")
        if isinstance(lab, TunnelLab) and mode != "tunnel":
            raise ValueError("a TunnelLab's backends are behind a router: tunnel mode only")
        if backend_family not in (4, 6) or not vips:
            raise ValueError("backend_family is 4 or 6, and vips names at least one VIP")
        self.lab = lab
        self.mode = mode
        self.vips = tuple(vips)
        self.backend_family = backend_family
        self.tunnel = (dict(tunnel) if tunnel is not None
                       else {"encap": "ipip", "source": LAB_TUNNEL_SOURCE[backend_family]})
        self.nat = nat
        self.vip_options = dict(vip_options or {})
        self.vip_overrides = {str(addr): dict(fields)
                              for addr, fields in (vip_overrides or {}).items()}
        if set(self.vip_overrides) - set(self.vips):
            raise ValueError(f"vip_overrides names VIPs not in vips: "
                             f"{sorted(set(self.vip_overrides) - set(self.vips))}")
        self.command_prefix = (list(command_prefix) if command_prefix is not None
                               else [sys.executable, "-m", "hpclb.faces.cli"])
        self.env = dict(env) if env is not None else None
        # Prometheus exporter, "host:port" or ":port" (the appliance's lab address)
        self.metrics = metrics
        # The REST API (appliance.api) on the management address, with a read
        # and a write token of its own in 0600 files of the workdir.
        self.api_enabled = api
        self.read_token = secrets.token_urlsafe(24)
        self.write_token = secrets.token_urlsafe(24)
        self.weights_mode = weights_mode
        self.policy = policy
        self.probe = probe
        self.telemetry = telemetry
        self.workdir = workdir
        self.weights = dict(weights)
        self.states: dict[str, str] = dict.fromkeys(weights, "up")
        self.xdp_mode = xdp_mode
        self.dataplane = dataplane
        # A lab on a small shared host lets the DPDK worker nap when idle; the
        # benchmark sets 0 (busy polling, as on an appliance).
        self.dpdk_idle_sleep_us = dpdk_idle_sleep_us
        # The benchmark sinks everything the appliance sends, ARP included, so
        # it writes the backends' MACs into the configuration instead.
        self.static_macs = static_macs
        self.config_path = workdir / "hpclb.yaml"
        self.socket = f"ipc://{workdir}/dataplane.sock"
        self.log_path = workdir / "hpclb-run.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.name = f"{lab.prefix}-appliance"
        self.client = DataplaneClient(self.socket, timeout_s=5.0)

    # --- configuration ------------------------------------------------------

    @staticmethod
    def pool_name(family: int) -> str:
        return "lab" if family == 4 else "lab6"

    @staticmethod
    def backend_name(name: str, family: int) -> str:
        """The configuration's name of backend ``name`` in the pool of ``family``."""
        return name if family == 4 else f"{name}-v6"

    def _vip_family(self, vip: str) -> int:
        """The family of the pool VIP ``vip`` uses."""
        if self.mode == "tunnel":
            return self.backend_family
        return 6 if ":" in vip else 4

    def _pool(self, family: int) -> dict[str, Any]:
        gateway = self.mode == "nat"
        backends = [
            {"name": self.backend_name(name, family),
             "address": self.lab.address_of(name, family), "weight": w,
             "state": self.states[name]}
            | ({"mac": self.lab.backend_mac(name)} if self.static_macs else {})
            | ({"via": CLUSTER_ETH} if gateway else {})
            for name, w in self.weights.items()
        ]
        pool: dict[str, Any] = {"weights": self.weights_mode}
        if self.policy is not None:
            pool["policy"] = self.policy
        if self.probe is not None:
            pool["probe"] = self.probe
        if self.mode == "tunnel":
            pool["tunnel"] = self.tunnel
        pool["backends"] = backends
        return pool

    def _vip_entries(self) -> list[dict[str, Any]]:
        out = []
        for i, vip in enumerate(self.vips):
            stem = "lab" if i == 0 else (f"lab6-{i}" if ":" in vip else f"lab-{i}")
            if i > 0 and ":" in vip and not any(":" in v for v in self.vips[:i]):
                stem = "lab6"
            pool = self.pool_name(self._vip_family(vip))
            out += [{"name": f"{stem}-{proto}", "address": vip, "port": LAB_PORT,
                     "protocol": proto, "mode": self.mode, "pool": pool, **self.vip_options,
                     **self.vip_overrides.get(vip, {})}
                    for proto in ("tcp", "udp")]
        return out

    def config(self) -> dict[str, Any]:
        gateway = self.mode == "nat"
        families = sorted({self._vip_family(v) for v in self.vips})
        pools = {self.pool_name(f): self._pool(f) for f in families}
        telemetry = {} if self.telemetry is None else {"telemetry": self.telemetry}
        nat = {} if self.nat is None else {"nat": self.nat}
        interfaces: dict[str, Any] = {"ingress": "eth0"}
        if gateway:
            interfaces["egress"] = [CLUSTER_ETH]
        # The services (metrics, telemetry by default) listen on one of the
        # appliance's own lab addresses, never on a VIP: in the gateway lab the
        # cluster side, where the agents and the probes are.
        management = (self.lab.gateway_ip if isinstance(self.lab, GatewayLab)
                      else self.lab.ip_of("lb"))
        return {
            "appliance": {
                "name": self.name,
                "dataplane": self.dataplane,
                "interfaces": interfaces,
                "netns": self.lab.lb_ns,
                "management_address": management,
                "hash_key": LAB_HASH_KEY,
                "control_socket": self.socket,
                **({"metrics": self.metrics} if self.metrics else {}),
                **({"api": {"listen": f":{LAB_API_PORT}",
                            "read_tokens_file": str(self.workdir / "api-read.tokens"),
                            "write_tokens_file": str(self.workdir / "api-write.tokens")}}
                   if self.api_enabled else {}),
                "xdp": {"mode": self.xdp_mode},
                # A lab on a small shared host: one worker, hugepages grown on
                # demand, a modest flow table.
                "dpdk": {"driver": "af_xdp", "lcores": [0, 1], "hugepages_mb": 256,
                         "reserve_hugepages": True, "idle_sleep_us": self.dpdk_idle_sleep_us,
                         "flow_table_size": 65536},
            },
            **telemetry,
            **nat,
            "pools": pools,
            "vips": self._vip_entries(),
        }

    def config_problem(self) -> str | None:
        """Why this build's configuration refuses what :meth:`config` would write
        (the schema's own words), or None when it accepts it. A NAT lab asks this
        before starting anything: a build without NAT mode says so here."""
        try:
            parse_config(yaml.safe_dump(self.config(), sort_keys=False), "lab appliance")
        except ConfigError as err:
            return str(err)
        return None

    def _write_config(self) -> None:
        if self.api_enabled:
            for role, token in (("read", self.read_token), ("write", self.write_token)):
                path = self.workdir / f"api-{role}.tokens"
                path.touch(mode=0o600)
                path.chmod(0o600)
                path.write_text(f"{token}\n")
        self.config_path.write_text(yaml.safe_dump(self.config(), sort_keys=False))

    # --- the REST API -------------------------------------------------------------

    @property
    def management_address(self) -> str:
        return str(self.config()["appliance"]["management_address"])

    @property
    def api_url(self) -> str:
        """The API's base URL: it exists only inside the appliance's namespace."""
        return f"http://{self.management_address}:{LAB_API_PORT}"

    def api(self, method: str, path: str, token: str | object | None = WRITE_TOKEN,
            json: Any = None, headers: Mapping[str, str] | None = None,
            timeout_s: float = 40.0, **kwargs: Any) -> httpx.Response:
        """One request to the API, made from inside the appliance's namespace
        (a fresh client: its sockets are created there). ``token``: the write
        token unless given (None: no Authorization header)."""
        tok = self.write_token if token is WRITE_TOKEN else token
        all_headers = {**({"Authorization": f"Bearer {tok}"} if tok else {}),
                       **(headers or {})}
        with inside(self.lab.lb_ns), httpx.Client(base_url=self.api_url,
                                                  timeout=timeout_s) as client:
            return client.request(method, path, json=json, headers=all_headers, **kwargs)

    # --- lifecycle ------------------------------------------------------------

    def _run_argv(self) -> list[str]:
        return [*self.command_prefix, "run", "-c", str(self.config_path),
                "--state-dir", str(self.workdir / "state"), "--run-dir", str(self.workdir / "run")]

    def _run_env(self) -> dict[str, str] | None:
        """`hpclb run`'s environment: None (inherited) unless ``env`` was given."""
        return None if self.env is None else {**os.environ, **self.env}

    def start(self, timeout_s: float = 30.0) -> None:
        self._write_config()
        before = self.pushes()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self._run_argv(), stdout=log, stderr=log,
                                         stdin=subprocess.DEVNULL, env=self._run_env())
        self.wait_pushes(before + 1, timeout_s)

    def resume(self, timeout_s: float = 30.0) -> None:
        """Start `hpclb run` again on the configuration file as it is (after
        :meth:`kill`: what the API wrote there stays), and wait for its push."""
        before = self.pushes()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self._run_argv(), stdout=log, stderr=log,
                                         stdin=subprocess.DEVNULL, env=self._run_env())
        self.wait_pushes(before + 1, timeout_s)

    def kill(self) -> None:
        """kill -9 `hpclb run` (the data plane, in its own session, stays)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def run_to_exit(self, config: dict[str, Any] | None = None,
                    timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run `hpclb run` with ``config`` (default: the current one) where it
        is expected to stop by itself (a start that must fail); its output is
        returned and appended to the log."""
        self.config_path.write_text(yaml.safe_dump(config or self.config(), sort_keys=False))
        res = subprocess.run(self._run_argv(), capture_output=True, text=True,
                             stdin=subprocess.DEVNULL, timeout=timeout_s, env=self._run_env())
        with open(self.log_path, "a") as log:
            log.write(res.stdout + res.stderr)
        return res

    def pushes(self) -> int:
        """How many table pushes `hpclb run` has logged so far."""
        try:
            return self.log_path.read_text().count("pushed tables")
        except FileNotFoundError:
            return 0

    def wait_pushes(self, count: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.pushes() < count:
            if self.proc is not None and self.proc.poll() is not None:
                raise LabApplianceError(f"hpclb run exited:\n{self.log_text()}")
            if time.monotonic() > deadline:
                raise LabApplianceError(f"no table push within {timeout_s}s:\n{self.log_text()}")
            time.sleep(0.05)

    @property
    def dpdk_file_prefix(self) -> str:
        """The forwarder's EAL file prefix (its telemetry socket's directory)."""
        return f"hpclb-{self.name}"

    def dataplane_pid(self) -> int:
        """pid of the data plane `hpclb run` supervises (from its pid file)."""
        return int((self.workdir / "run" / f"{self.name}.pid").read_text().strip())

    def log_text(self) -> str:
        try:
            return self.log_path.read_text()[-4000:]
        except FileNotFoundError:
            return "(no log)"

    def telemetry_endpoint(self, port: int = LAB_TELEMETRY_PORT) -> str:
        """Where agents in the backend namespaces reach the telemetry receiver."""
        return f"tcp://{self.lab.ip_of('lb')}:{port}"

    @property
    def status_path(self) -> Path:
        return self.workdir / "run" / f"{self.name}.status.json"

    def status(self) -> dict[str, Any]:
        """The status file (health, weights, samples, telemetry and probe counters);
        LabApplianceError while there is none yet."""
        try:
            data: dict[str, Any] = json.loads(self.status_path.read_text())
        except (OSError, ValueError) as err:
            raise LabApplianceError(f"no status file {self.status_path}: {err}") from None
        return data

    def wait_status(self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float = 30.0,
                    what: str = "condition") -> dict[str, Any]:
        """Poll the status file until ``predicate(status)`` holds; returns that status."""
        deadline = time.monotonic() + timeout_s
        last: dict[str, Any] | None = None
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise LabApplianceError(f"hpclb run exited:\n{self.log_text()}")
            with contextlib.suppress(LabApplianceError):
                last = self.status()
                if predicate(last):
                    return last
            if time.monotonic() > deadline:
                raise LabApplianceError(f"status: no {what} within {timeout_s}s; last status: "
                                        f"{json.dumps(last)[:3000]}\n{self.log_text()}")
            time.sleep(0.1)

    def reload(self, timeout_s: float = 15.0) -> None:
        """Rewrite the configuration, SIGHUP `hpclb run`, wait for its push."""
        assert self.proc is not None
        before = self.pushes()
        self._write_config()
        self.proc.send_signal(signal.SIGHUP)
        self.wait_pushes(before + 1, timeout_s)

    def reload_refused(self, config: dict[str, Any], timeout_s: float = 15.0) -> str:
        """Write ``config``, SIGHUP `hpclb run`, wait for "reload refused";
        returns that log line."""
        assert self.proc is not None
        before = self.log_text_full().count("reload refused")
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout_s
        while (text := self.log_text_full()).count("reload refused") <= before:
            if time.monotonic() > deadline:
                raise LabApplianceError(f"no 'reload refused' within {timeout_s}s:\n"
                                        f"{self.log_text()}")
            time.sleep(0.05)
        return [line for line in text.splitlines() if "reload refused" in line][-1]

    def log_text_full(self) -> str:
        try:
            return self.log_path.read_text()
        except FileNotFoundError:
            return ""

    def set_weight(self, name: str, weight: float) -> None:
        self.weights[name] = weight
        self.reload()

    def set_state(self, name: str, state: str) -> None:
        self.states[name] = state
        self.reload()

    def stop(self) -> None:
        self.client.close()
        if self.proc is not None:
            stop_child(self.proc, timeout_s=15)
        self.proc = None
        # A data plane orphaned by a killed `hpclb run` (tests do that) must not
        # outlive the lab: its pid file names it.
        with contextlib.suppress(OSError, ValueError):
            terminate_pid(self.dataplane_pid(), timeout_s=5)
        # A data plane that died by SIGKILL left its maps pinned; nobody will
        # adopt this lab's pins again.
        shutil.rmtree(f"/sys/fs/bpf/hpclb/{self.name}", ignore_errors=True)
        # A DPDK forwarder stopped behind a killed `hpclb run` leaves the
        # appliance's addresses recorded, not given back: the lab outlives it.
        for record in (self.workdir / "run").glob("*.addresses.json"):
            with contextlib.suppress(OSError, ValueError):
                exception_path.give_back(record, self.lab.lb_ns)

    def __enter__(self) -> LabAppliance:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
