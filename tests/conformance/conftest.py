from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpclb.dataplane.dpdk import find_dpdk_forwarder
from hpclb.dataplane.supervisor import find_xdp_daemon

from .harness import Harness
from .targets import DpdkTarget, Target, XdpTarget

MODEL_PORT_MACS = ["02:00:00:00:00:01", "02:00:00:00:00:02"]


def _xdp_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the XDP target needs root (BPF, network namespaces)"
    try:
        find_xdp_daemon()
    except FileNotFoundError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="session")
def xdp_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[XdpTarget]:
    reason = _xdp_unavailable()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the XDP conformance suite: {reason}")
        pytest.skip(reason)
    target = XdpTarget(Path(tmp_path_factory.mktemp("xdp")))
    try:
        yield target
    finally:
        target.close()


def _dpdk_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "the DPDK target needs root (hugepages, AF_XDP, network namespaces)"
    try:
        find_dpdk_forwarder()
    except FileNotFoundError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="session")
def dpdk_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DpdkTarget]:
    reason = _dpdk_unavailable()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the DPDK conformance suite: {reason}")
        pytest.skip(reason)
    target = DpdkTarget(Path(tmp_path_factory.mktemp("dpdk")))
    try:
        yield target
    finally:
        target.close()


@pytest.fixture(params=["model", "xdp", "dpdk"])
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    target: Target | None = None
    port_macs = MODEL_PORT_MACS
    if request.param in ("xdp", "dpdk"):
        target = request.getfixturevalue(f"{request.param}_target")
        port_macs = target.port_macs
    h = Harness(target, port_macs)
    yield h
    h.check_counters()
