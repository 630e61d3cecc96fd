from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hpclb.dataplane.dpdk import find_dpdk_forwarder
from hpclb.dataplane.supervisor import find_xdp_daemon

from .harness import Harness
from .targets import DpdkTarget, Target, XdpTarget

MODEL_PORT_MACS = ["02:00:00:00:00:01", "02:00:00:00:00:02"]


# name -> (target class, what it needs, how to find its binary)
_TARGETS: dict[str, tuple[type[XdpTarget] | type[DpdkTarget], str, Callable[[], str]]] = {
    "xdp": (XdpTarget, "BPF, network namespaces", find_xdp_daemon),
    "dpdk": (DpdkTarget, "hugepages, AF_XDP, network namespaces", find_dpdk_forwarder),
}


def _real_target(name: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    """One data plane for the whole session; CI must never skip it."""
    cls, needs, find = _TARGETS[name]
    reason = None
    if os.geteuid() != 0:
        reason = f"the {name} target needs root ({needs})"
    else:
        try:
            find()
        except FileNotFoundError as exc:
            reason = str(exc)
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the {name} conformance suite: {reason}")
        pytest.skip(reason)
    target = cls(Path(tmp_path_factory.mktemp(name)))
    try:
        yield target
    finally:
        target.close()


@pytest.fixture(scope="session")
def xdp_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    yield from _real_target("xdp", tmp_path_factory)


@pytest.fixture(scope="session")
def dpdk_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    yield from _real_target("dpdk", tmp_path_factory)


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
