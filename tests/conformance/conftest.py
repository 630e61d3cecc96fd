from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hpclb.dataplane.dpdk import find_dpdk_forwarder
from hpclb.dataplane.supervisor import find_xdp_daemon

from .harness import Harness
from .natcase import NatCase, require_capability, require_nat6
from .targets import DpdkTarget, Target, XdpTarget

MODEL_PORT_MACS = ["02:00:00:00:00:01", "02:00:00:00:00:02"]
# NAT cases: the session's targets hold this many connection-table entries;
# the "small" cases get a fresh data plane whose table holds three connections.
CONN_TABLE_SIZE = 65536
SMALL_CONN_TABLE_SIZE = 6


# name -> (target class, what it needs, how to find its binary)
_TARGETS: dict[str, tuple[type[XdpTarget] | type[DpdkTarget], str, Callable[[], str]]] = {
    "xdp": (XdpTarget, "BPF, network namespaces", find_xdp_daemon),
    "dpdk": (DpdkTarget, "hugepages, AF_XDP, network namespaces", find_dpdk_forwarder),
}


def _real_target(name: str, tmp_path_factory: pytest.TempPathFactory,
                 conn_table_size: int = CONN_TABLE_SIZE) -> Iterator[Target]:
    """One data plane (for the whole session, or a case); CI must never skip it."""
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
    target = cls(Path(tmp_path_factory.mktemp(name)), conn_table_size=conn_table_size)
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


def _session_harness(request: pytest.FixtureRequest,
                     require: Callable[[Target], None] | None = None,
                     conn_capacity: int | None = None) -> Iterator[Harness]:
    """A harness on the model or the session's data plane (request.param),
    after ``require`` has looked at the plane; its counters are checked after
    the case."""
    target: Target | None = None
    port_macs = MODEL_PORT_MACS
    if request.param in ("xdp", "dpdk"):
        target = request.getfixturevalue(f"{request.param}_target")
        if require is not None:
            require(target)
        port_macs = target.port_macs
    h = Harness(target, port_macs, conn_capacity=conn_capacity or _capacity(target))
    yield h
    h.check_counters()


@pytest.fixture(params=["model", "xdp", "dpdk"])
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    yield from _session_harness(request)


def _capacity(target: Target | None) -> int:
    return target.conn_table_size if target is not None and target.nat else CONN_TABLE_SIZE


def _require_nat(target: Target, conn_table_size: int) -> None:
    """NAT cases need the hello's "nat" capability; until a plane has it they
    skip, saying so (CI checks they run once both planes have it)."""
    if not target.nat:
        reason = (f"the {target.name} data plane's hello lacks the 'nat' capability: "
                  "NAT mode cases skipped")
        print(reason)
        pytest.skip(reason)
    assert target.conn_table_size == conn_table_size, (
        f"{target.name} was started with a {conn_table_size}-entry connection table, its "
        f"hello says {target.conn_table_size}")


@pytest.fixture(params=["model", "xdp", "dpdk"])
def nat_harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    """A harness on the session's data plane, which must serve NAT mode."""
    yield from _session_harness(request, lambda t: _require_nat(t, CONN_TABLE_SIZE),
                                CONN_TABLE_SIZE)


def _require_tunnel(target: Target) -> None:
    """Tunnel cases need the hello's "tunnel" capability (set_vip refuses
    mode 2 without it)."""
    require_capability(target, target.tunnel, "tunnel", "tunnel mode")


@pytest.fixture(params=["model", "xdp", "dpdk"])
def tunnel_harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    """A harness on the session's data plane, which must serve tunnel mode."""
    yield from _session_harness(request, _require_tunnel)


@pytest.fixture(params=["model", "xdp", "dpdk"])
def small_nat_harness(request: pytest.FixtureRequest,
                      tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    """A harness on a data plane of its own whose connection table holds
    SMALL_CONN_TABLE_SIZE entries (a table the case fills)."""
    if request.param == "model":
        h = Harness(None, MODEL_PORT_MACS, conn_capacity=SMALL_CONN_TABLE_SIZE)
        yield h
        return
    started = _real_target(request.param, tmp_path_factory, SMALL_CONN_TABLE_SIZE)
    target = next(started)
    try:
        _require_nat(target, SMALL_CONN_TABLE_SIZE)
        h = Harness(target, target.port_macs, conn_capacity=SMALL_CONN_TABLE_SIZE)
        yield h
        h.check_counters()
    finally:
        started.close()  # the plane goes with the case


@pytest.fixture(params=[4, 6], ids=["v4", "v6"])
def family(request: pytest.FixtureRequest) -> int:
    """The IP version of a family-neutral case: 4 runs it as written, 6 its
    IPv6 twin (every address through harness.v6)."""
    return int(request.param)


@pytest.fixture
def nat(nat_harness: Harness, family: int) -> NatCase:
    """A family-neutral NAT case: the session's data plane, in ``family``
    (6: the plane must have "nat6")."""
    if family == 6:
        require_nat6(nat_harness.target)
    return NatCase(nat_harness, family)


@pytest.fixture
def small_nat(small_nat_harness: Harness, family: int) -> NatCase:
    """A family-neutral NAT case on a data plane of its own whose tables
    hold SMALL_CONN_TABLE_SIZE entries each."""
    if family == 6:
        require_nat6(small_nat_harness.target)
    return NatCase(small_nat_harness, family)


@pytest.fixture
def nat6(nat_harness: Harness) -> NatCase:
    """An IPv6-only NAT case on the session's data plane."""
    require_nat6(nat_harness.target)
    return NatCase(nat_harness, 6)
