"""Shared by the lab suites: both data planes as a parameter, CURVE keys made
by `hpclb-agent keygen`."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq.auth

AGENT_NAMES = ("b1", "b2", "b3")


@pytest.fixture(params=["xdp", "dpdk"])
def dataplane(request: pytest.FixtureRequest) -> str:
    """Both data planes. With DPDK, management traffic (probes, the agents'
    telemetry, metrics) crosses the forwarder's exception path (the TAP)."""
    return str(request.param)


@dataclass(frozen=True)
class Keys:
    dir: Path
    allow: Path

    def public(self, name: str) -> Path:
        return self.dir / f"{name}.key"

    def secret(self, name: str) -> Path:
        return self.dir / f"{name}.key_secret"

    def key_id(self, name: str) -> str:
        public, _ = zmq.auth.load_certificate(self.public(name))
        return public.decode()[:8]


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    """CURVE keypairs from `hpclb-agent keygen`: the server's, one per backend
    (allow-listed) and a rogue one (not)."""
    base = tmp_path_factory.mktemp("curve")
    k = Keys(base / "keys", base / "allow")
    k.allow.mkdir()
    for name in ("server", *AGENT_NAMES, "rogue"):
        subprocess.run([sys.executable, "-m", "hpclb.agent.main", "keygen", str(k.dir),
                        "--name", name], check=True, capture_output=True, timeout=60)
    for name in AGENT_NAMES:
        (k.allow / f"{name}.key").write_text(k.public(name).read_text())
    return k


@contextmanager
def agents_heard(lab: Any, app: Any, keys: Keys, names: tuple[str, ...], interval_s: float,
                 log_dir: Path, heard: Callable[[dict[str, Any]], bool]) -> Iterator[None]:
    """One `hpclb-agent` per name, pointed at ``app``'s telemetry with that
    name's key; returns once the status says ``heard`` and every backend is
    up; stops every agent it started, whatever happened."""
    agents: list[subprocess.Popen[str]] = []
    try:
        for name in names:
            agents.append(lab.start_agent(
                name, connect=app.telemetry_endpoint(), server_key=keys.public("server"),
                key=keys.secret(name), base_interval=interval_s,
                log=log_dir / f"agent-{name}.log"))
        app.wait_status(lambda s: heard(s) and all(h["up"] for h in s["health"].values()),
                        timeout_s=60, what="agents heard, backends up")
        yield
    finally:
        for agent in agents:
            lab.stop_process(agent)
