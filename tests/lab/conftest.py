"""Shared by the lab suites: both data planes as a parameter, CURVE keys made
by `hpclb-agent keygen`."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

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
