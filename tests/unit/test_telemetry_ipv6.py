"""Telemetry over IPv6: the receiver bound to an IPv6 address, the real Publisher
and the real ``hpclb-agent run`` connecting to it, CURVE and the allow-list as
over IPv4 (the ZAP decision is by key; no address of either family is involved).

On ::1, and on a unique local address in a scratch network namespace (root),
removed afterwards even when the test fails.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from hpclb.telemetry.message import encode
from hpclb.telemetry.receiver import AgentIdentity

from .probe_sockets import has_ipv6_loopback
from .test_telemetry_receiver import (
    Keys,
    make_keys,
    message,
    run_agent,
    running,
    send_until,
    wait_for,
)

ULA = "fd00:5557::1"


pytestmark = pytest.mark.skipif(not has_ipv6_loopback(),
                                reason="no IPv6 on loopback here (disable_ipv6?)")


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    return make_keys(tmp_path)


def test_receiver_on_ipv6_loopback_authenticates_by_key(keys: Keys) -> None:
    with running(keys, "tcp://[::1]:*") as rx:
        assert rx.endpoint.startswith("tcp://[::1]:"), rx.endpoint
        pub = keys.publisher(rx.endpoint, "n1")
        try:
            msg, who = rx.deliver(pub, message("n1"))
        finally:
            pub.close()
        assert msg.node == "n1" and who == AgentIdentity("n1", keys.public_z85("n1"))
        # A key off the allow-list is refused by the ZAP handler, over IPv6 too.
        rogue = keys.publisher(rx.endpoint, "rogue")
        try:
            assert send_until(rogue, encode(message("rogue")),
                              lambda: rogue.auth_failures >= 1)
        finally:
            rogue.close()
        # An allowed key speaks for its own node only.
        n2 = keys.publisher(rx.endpoint, "n2")
        try:
            assert send_until(n2, encode(message("n1", seq=7)),
                              lambda: rx.counters()["node_mismatch"].get("n2", 0) >= 1)
        finally:
            n2.close()
        c = rx.counters()
        assert c["rejected_keys"].get(keys.public_z85("rogue")[:8], 0) >= 1
        assert c["accepted"] >= 1 and rx.got.qsize() == 0  # nothing from rogue or n2


def _bare(endpoint: str) -> str:
    """``[v6]:port`` without the scheme: the agent accepts that form too."""
    return endpoint.removeprefix("tcp://")


def test_the_agent_process_publishes_to_an_ipv6_receiver(keys: Keys) -> None:
    with running(keys, "tcp://[::1]:*") as rx:
        got, _err = run_agent(rx, keys, _bare(rx.endpoint))
    assert all(who.node == "n1" and m.node == "n1" for m, who in got)


@contextmanager
def scratch_netns_with_ula() -> Iterator[str]:
    """A named network namespace with lo up and ULA on it; deleted at the end."""
    name = f"hpclb-t6-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        for cmd in (["link", "set", "lo", "up"],
                    ["-6", "addr", "add", f"{ULA}/128", "dev", "lo", "nodad"]):
            subprocess.run(["ip", "-n", name, *cmd], check=True, timeout=30)
        # The kernel makes the address usable from a work queue, its local route
        # last: bind() fails and packets are dropped until then.
        assert wait_for(lambda: ULA in _ip(name, "route", "show", "table", "local")
                        and not _ip(name, "addr", "show", "tentative").strip(), 10.0)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, timeout=30)


def _ip(ns: str, *args: str) -> str:
    return subprocess.run(["ip", "-n", ns, "-6", *args], capture_output=True, text=True,
                          check=True, timeout=30).stdout


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: network namespaces")
def test_agent_reaches_a_receiver_bound_to_a_ula_in_a_namespace(keys: Keys) -> None:
    """As deployed: the receiver binds the appliance's management address (here a
    ULA, inside the appliance's namespace), the agent dials it by address."""
    with scratch_netns_with_ula() as ns, running(keys, f"tcp://[{ULA}]:*", netns=ns) as rx:
        assert rx.endpoint.startswith(f"tcp://[{ULA}]:"), rx.endpoint
        got, _err = run_agent(rx, keys, _bare(rx.endpoint), node="n2",
                              wrapper=("ip", "netns", "exec", ns))
        counters = rx.counters()
    assert all(who.node == "n2" for _, who in got)
    assert counters["handshakes"]["ok"] >= 1 and counters["rejected_key_total"] == 0
    # Gone afterwards.
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                            timeout=30).stdout
    assert ns not in listed


def test_configuration_takes_an_ipv6_telemetry_bind() -> None:
    """telemetry.bind may be an IPv6 address in brackets; a wildcard or a VIP
    stays refused in either family."""
    from hpclb.config.loader import ConfigError, parse_config

    from .test_config import services

    cfg = parse_config(services("", "bind: 'tcp://[fd00::5]:5557'"), "s.yaml")
    assert cfg.telemetry is not None
    assert cfg.telemetry.endpoint(cfg.appliance.management_address) == "tcp://[fd00::5]:5557"
    for bind, why in (("tcp://[::]:5557", "[::] is a wildcard"),
                      ("tcp://[fd00::zz]:5557", "nor an IPv6 one in brackets"),
                      ("tcp://fd00::5:5557", "nor an IPv6 one in brackets")):
        with pytest.raises(ConfigError) as err:
            parse_config(services("", f"bind: '{bind}'"), "s.yaml")
        assert why in str(err.value), (bind, str(err.value))
