"""hpclb-xdp as an operator sees it: attach modes, clean detach, control-plane
pushes that change only what changed."""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from hpclb.contract.tables import (
    IPPROTO_TCP,
    IPPROTO_UDP,
    Backend,
    BackendState,
    Encap,
    Vip,
    VipMode,
)
from hpclb.dataplane.client import DataplaneClient, DataplaneError
from hpclb.dataplane.push import fetch_tables, push_tables
from hpclb.dataplane.supervisor import DataplaneProcess, find_xdp_daemon
from tests.conformance.harness import base_tables

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root: network namespaces and XDP")


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"hlbd-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)
        # Pins a daemon killed on purpose (or a failed test) left behind:
        # a preallocated connection table holds ~150 MiB.
        shutil.rmtree(f"/sys/fs/bpf/hpclb/test-{name}", ignore_errors=True)


def ip(netns: str, *args: str) -> str:
    return subprocess.run(["ip", "-n", netns, *args], check=True, capture_output=True,
                          text=True).stdout


def start_daemon(netns: str, iface: str, tmp: Path, *extra: str) -> DataplaneProcess:
    """hpclb-xdp in ``netns``, started the way the controller starts it."""
    endpoint = f"ipc://{tmp}/dp.sock"
    dataplane = DataplaneProcess(
        argv=[find_xdp_daemon(), "--netns", netns, "--iface", iface, "--socket", endpoint,
              "--pin-dir", f"/sys/fs/bpf/hpclb/test-{netns}", *extra],
        endpoint=endpoint, pidfile=tmp / "hpclb-xdp.pid", log_path=tmp / "hpclb-xdp.log",
    )
    dataplane.start()  # returns once it answers hello
    return dataplane


def stop_daemon(dataplane: DataplaneProcess) -> str:
    """SIGTERM the daemon (SIGKILL if it hangs); it must exit 0. Returns its log."""
    dataplane.stop()
    log = dataplane.log_path.read_text() if dataplane.log_path else ""
    assert dataplane.returncode == 0, log
    return log


def test_native_on_veth_and_clean_detach_on_sigterm(netns: str, tmp_path: Path) -> None:
    ip(netns, "link", "add", "va", "type", "veth", "peer", "name", "vb")
    ip(netns, "link", "set", "va", "up")
    ip(netns, "link", "set", "vb", "up")
    dataplane = start_daemon(netns, "va", tmp_path)
    client = dataplane.client
    try:
        assert client.hello()["attach_mode"] == "native"
        assert "xdp" in ip(netns, "link", "show", "va")
        assert Path(f"/sys/fs/bpf/hpclb/test-{netns}/lb_xdp").exists(), "program pinned"
    finally:
        stop_daemon(dataplane)
    assert "xdp" not in ip(netns, "link", "show", "va"), "detached on SIGTERM"
    assert not Path(f"/sys/fs/bpf/hpclb/test-{netns}").exists(), "pins removed"


def test_falls_back_to_generic_with_a_log_line(netns: str, tmp_path: Path) -> None:
    # A bridge has no native XDP support (and, unlike dummy, needs no module).
    ip(netns, "link", "add", "d0", "type", "bridge")
    ip(netns, "link", "set", "d0", "up")
    dataplane = start_daemon(netns, "d0", tmp_path)
    client = dataplane.client
    try:
        assert client.hello()["attach_mode"] == "generic"
        assert "xdpgeneric" in ip(netns, "link", "show", "d0")
    finally:
        err = stop_daemon(dataplane)
    assert "falling back to generic" in err


def test_native_only_refuses_to_fall_back(netns: str, tmp_path: Path) -> None:
    ip(netns, "link", "add", "d0", "type", "bridge")
    ip(netns, "link", "set", "d0", "up")
    proc = subprocess.run(
        [find_xdp_daemon(), "--netns", netns, "--iface", "d0", "--xdp-mode", "native",
         "--socket", f"ipc://{tmp_path}/dp.sock", "--pin-dir",
         f"/sys/fs/bpf/hpclb/test-{netns}"], capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0
    assert "native XDP attach to d0 failed" in proc.stderr
    assert "xdp" not in ip(netns, "link", "show", "d0")


def test_a_weight_change_is_pushed_as_a_patch(netns: str, tmp_path: Path) -> None:
    ip(netns, "link", "add", "va", "type", "veth", "peer", "name", "vb")
    ip(netns, "link", "add", "wa", "type", "veth", "peer", "name", "wb")
    dataplane = start_daemon(netns, "va", tmp_path, "--egress", "wa", "--no-attach")
    client = dataplane.client
    try:
        first = base_tables()
        report = push_tables(client, None, first)
        assert report.rings_full == len(first.vips)
        second = base_tables({0: 1.0, 1: 1.0, 2: 3.0})
        report = push_tables(client, first, second)
        assert report.rings_full == 0 and report.backends_set == 0 and report.vips_set == 0
        assert 0 < report.slots_patched < 2 * 65537 // 2
        held = fetch_tables(client)
        for vip_id, ring in second.rings.items():
            assert (held.rings[vip_id] == ring).all()
        assert held.vips == second.vips and held.backends == second.backends
        assert push_tables(client, held, second).summary().endswith("patched_slots=0")
    finally:
        stop_daemon(dataplane)


def test_set_vip_with_its_ring_goes_live_complete(netns: str, tmp_path: Path) -> None:
    """A new VIP and its ring in one request: no moment with an empty ring.
    A broken ring refuses the VIP; a ring for an existing VIP is refused."""
    ip(netns, "link", "add", "va", "type", "veth", "peer", "name", "vb")
    ip(netns, "link", "add", "wa", "type", "veth", "peer", "name", "wb")
    dataplane = start_daemon(netns, "va", tmp_path, "--egress", "wa", "--no-attach")
    client = dataplane.client
    try:
        tables = base_tables()
        client.set_backends(list(tables.backends.values()))
        vip = tables.vips[0]
        with pytest.raises(DataplaneError, match="slots"):
            client.call("set_vip", vip_id=vip.vip_id, addr=vip.addr.packed, port=vip.port,
                        proto=vip.proto, mode=0, slots=b"\x00" * 12)
        assert client.dump()["vips"] == [], "a VIP with a broken ring is not added"
        client.set_vip(vip, tables.rings[0])
        assert (client.get_ring(0) == tables.rings[0]).all()
        with pytest.raises(DataplaneError, match="exists"):
            client.set_vip(vip, tables.rings[0][::-1].copy())
        assert (client.get_ring(0) == tables.rings[0]).all()
    finally:
        stop_daemon(dataplane)


def test_ipv6_tables_push_and_fetch(netns: str, tmp_path: Path) -> None:
    """Table protocol 2: an IPv6 VIP (with NAT/tunnel fields) and IPv6 backends
    pushed by the control plane's client, read back equal, then removed."""
    ip(netns, "link", "add", "va", "type", "veth", "peer", "name", "vb")
    ip(netns, "link", "add", "wa", "type", "veth", "peer", "name", "wb")
    dataplane = start_daemon(netns, "va", tmp_path, "--egress", "wa", "--no-attach")
    client = dataplane.client
    try:
        first = base_tables()
        second = base_tables()
        vip6 = Vip(9, ipaddress.IPv6Address("fd00::10"), 80, 6, nat_port=8080,
                   tunnel_src=ipaddress.IPv6Address("fd00::1"))
        second.vips[9] = vip6
        second.rings[9] = second.rings[0].copy()
        for bid in (100, 101):
            second.backends[bid] = Backend(bid, ipaddress.IPv6Address(f"fd00:1::{bid}"),
                                           f"02:00:00:00:01:{bid - 100:02x}")
        push_tables(client, None, first)
        push_tables(client, first, second)
        held = fetch_tables(client)
        assert held.vips == second.vips and held.backends == second.backends
        assert held.vips[9].family == 6 and held.backends[100].family == 6
        assert (held.rings[9] == second.rings[9]).all()
        # A change of an IPv6 VIP's fields goes through del + set.
        third = base_tables()
        third.vips[9] = replace(vip6, nat_port=0, tunnel_src=None)
        third.rings[9] = second.rings[9]
        third.backends[100] = replace(second.backends[100], state=BackendState.DRAINING)
        report = push_tables(client, held, third)
        assert report.vips_deleted == 1 and report.vips_set == 1
        held = fetch_tables(client)
        assert held.vips == third.vips and held.backends == third.backends
        push_tables(client, held, first)
        held = fetch_tables(client)
        assert held.vips == first.vips and held.backends == first.backends
    finally:
        stop_daemon(dataplane)


def _bpftool_show(pin: Path) -> dict:
    import json

    out = subprocess.run(["bpftool", "-j", "map", "show", "pinned", str(pin)], check=True,
                         capture_output=True, text=True).stdout
    return dict(json.loads(out))


def _kill_hard(dataplane: DataplaneProcess) -> None:
    """SIGKILL: the daemon leaves its pins behind, as after a crash."""
    import signal
    import time

    assert dataplane.pid is not None
    os.kill(dataplane.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{dataplane.pid}") and time.monotonic() < deadline:
        try:
            os.waitpid(dataplane.pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.05)
    dataplane.stop()


def test_pinned_maps_adopted_and_a_previous_layout_replaced(netns: str, tmp_path: Path) -> None:
    """The compact IPv4 maps (vip4_map, flow_map) and the IPv6 flow table
    (flow6_map) survive a crash and are adopted with the rest, IPv4 and IPv6
    VIPs alike, a tunnel VIP's fields included; pins of previous layouts (a
    40-byte flow key and no vip4_map; 28-byte VIP entries and no flow6_map,
    before tunnel mode) are replaced, not adopted."""
    import shutil

    if shutil.which("bpftool") is None:
        pytest.skip("needs bpftool")
    ip(netns, "link", "add", "va", "type", "veth", "peer", "name", "vb")
    ip(netns, "link", "add", "wa", "type", "veth", "peer", "name", "wb")
    pins = Path(f"/sys/fs/bpf/hpclb/test-{netns}")
    tables = base_tables()
    tables.vips[9] = Vip(9, ipaddress.IPv6Address("fd00::10"), 80, 6)
    tables.rings[9] = tables.rings[0].copy()
    gue = Vip(10, ipaddress.IPv6Address("fd00::11"), 53, IPPROTO_UDP, VipMode.TUNNEL,
              tunnel_src=ipaddress.IPv6Address("fd00:2::"), tunnel_encap=Encap.GUE,
              gue_port=6081, tunnel_src_bits=12)
    (tmp_path / "1").mkdir()
    first = start_daemon(netns, "va", tmp_path / "1", "--egress", "wa", "--no-attach",
                         "--flow-table-size", "4096")
    try:
        push_tables(first.client, None, tables)
        _set_tunnel_vip(first.client, gue, tables.rings[0])
        tunnel_fields = [v for v in first.client.dump()["vips"] if v["vip_id"] == 10]
        assert tunnel_fields and tunnel_fields[0]["gue_port"] == 6081
    finally:
        _kill_hard(first)
    assert _bpftool_show(pins / "vip4_map")["bytes_key"] == 8
    assert _bpftool_show(pins / "flow_map")["bytes_key"] == 16
    assert _bpftool_show(pins / "vip_map")["bytes_key"] == 20
    assert _bpftool_show(pins / "vip_map")["bytes_value"] == 32
    flow6 = _bpftool_show(pins / "flow6_map")
    assert (flow6["type"], flow6["bytes_key"], flow6["bytes_value"]) == ("lru_hash", 40, 16)
    assert flow6["max_entries"] == _bpftool_show(pins / "flow_map")["max_entries"] == 4096
    # NAT mode's maps are pinned with the rest (tests/unit/test_xdp_nat.py
    # drives them).
    conn_map = _bpftool_show(pins / "conn_map")
    assert (conn_map["bytes_key"], conn_map["bytes_value"]) == (16, 40)
    assert _bpftool_show(pins / "conn_fifo")["max_entries"] == conn_map["max_entries"]
    assert _bpftool_show(pins / "nat_config_map")["bytes_value"] == 368
    # IPv6 NAT: a table of its own, as large, and its FIFO.
    conn6_map = _bpftool_show(pins / "conn6_map")
    assert (conn6_map["type"], conn6_map["bytes_key"], conn6_map["bytes_value"]) == ("hash", 40,
                                                                                   64)
    assert conn6_map["max_entries"] == conn_map["max_entries"]
    conn6_fifo = _bpftool_show(pins / "conn6_fifo")
    assert (conn6_fifo["bytes_value"], conn6_fifo["max_entries"]) == (40, conn_map["max_entries"])

    (tmp_path / "2").mkdir()
    second = start_daemon(netns, "va", tmp_path / "2", "--egress", "wa", "--no-attach",
                          "--flow-table-size", "4096")
    try:
        held = fetch_tables(second.client)
        assert {k: v for k, v in held.vips.items() if k != 10} == tables.vips
        assert (held.rings[9] == tables.rings[9]).all()
        assert [v for v in second.client.dump()["vips"] if v["vip_id"] == 10] == tunnel_fields
    finally:
        _kill_hard(second)
    log = (tmp_path / "2" / "hpclb-xdp.log").read_text()
    assert "adopted the pinned tables" in log, log

    # The previous layout: flow_map keyed by the 40-byte struct lb_flow_key,
    # no vip4_map, VIP entries of 24 bytes (before nat_flags).
    (pins / "vip4_map").unlink()
    (pins / "flow_map").unlink()
    (pins / "vip_map").unlink()
    subprocess.run(["bpftool", "map", "create", str(pins / "flow_map"), "type", "lru_hash",
                    "key", "40", "value", "16", "entries", "1024", "name", "flow_map"],
                   check=True)
    subprocess.run(["bpftool", "map", "create", str(pins / "vip_map"), "type", "hash",
                    "key", "20", "value", "24", "entries", "64", "name", "vip_map"],
                   check=True)
    (tmp_path / "3").mkdir()
    third = start_daemon(netns, "va", tmp_path / "3", "--egress", "wa", "--no-attach")
    try:
        held = fetch_tables(third.client)
        assert not held.vips, "tables of the previous layout are not adopted"
        assert _bpftool_show(pins / "flow_map")["bytes_key"] == 16
        assert _bpftool_show(pins / "vip4_map")["bytes_key"] == 8
        assert _bpftool_show(pins / "vip_map")["bytes_value"] == 32
    finally:
        log = stop_daemon(third)
    assert "adopted the pinned tables" not in log, log
    assert "removing stale pins" in log, log

    # The layout before tunnel mode: VIP entries of 28 bytes in both VIP
    # maps, no flow6_map (the rest as now).
    (tmp_path / "4").mkdir()
    fourth = start_daemon(netns, "va", tmp_path / "4", "--egress", "wa", "--no-attach")
    try:
        push_tables(fourth.client, None, tables)
    finally:
        _kill_hard(fourth)
    for name, key in (("vip_map", "20"), ("vip4_map", "8")):
        (pins / name).unlink()
        subprocess.run(["bpftool", "map", "create", str(pins / name), "type", "hash", "key",
                        key, "value", "28", "entries", "64", "name", name], check=True)
    (pins / "flow6_map").unlink()
    (tmp_path / "5").mkdir()
    fifth = start_daemon(netns, "va", tmp_path / "5", "--egress", "wa", "--no-attach")
    try:
        held = fetch_tables(fifth.client)
        assert not held.vips, "tables of the layout before tunnel mode are not adopted"
        assert _bpftool_show(pins / "vip_map")["bytes_value"] == 32
        assert _bpftool_show(pins / "vip4_map")["bytes_value"] == 32
        assert _bpftool_show(pins / "flow6_map")["bytes_key"] == 40
    finally:
        log = stop_daemon(fifth)
    assert "adopted the pinned tables" not in log, log
    assert "removing stale pins" in log, log


# ---- IPv6 and tunnel mode through the pinned program ------------------------

def _set_tunnel_vip(client: DataplaneClient, vip: Vip, ring: np.ndarray) -> None:
    """set_vip with every tunnel field, whatever the client's set_vip sends."""
    assert vip.tunnel_src is not None
    extra = {"gue_port": vip.gue_port} if vip.tunnel_encap == Encap.GUE else {}
    client.call("set_vip", vip_id=vip.vip_id, addr=vip.addr.packed, port=vip.port,
                proto=vip.proto, mode=int(VipMode.TUNNEL), nat_port=0,
                tunnel_src=vip.tunnel_src.packed, tunnel_encap=int(vip.tunnel_encap),
                tunnel_src_bits=vip.tunnel_src_bits, slots=ring.astype("<u4").tobytes(),
                **extra)


def _counters(client: DataplaneClient) -> dict[str, int]:
    return {k: int(v) for k, v in client.stats()["counters"].items()}


def test_ipv6_dsr_and_tunnels_through_the_pinned_program(netns: str, tmp_path: Path) -> None:
    """Frames through the daemon's own lb_xdp (BPF_PROG_TEST_RUN): an IPv6 DSR
    flow keeps its backend across a ring change (flow6_map); IPIP over IPv4
    and GUE over IPv6 come out with the outer headers lb_encap.h specifies,
    built here independently of the model; a tunnel VIP whose backend is of
    the other family than its tunnel source is dropped as drop_encap."""
    from scapy.layers.inet import IP, TCP, UDP
    from scapy.layers.inet6 import IPv6
    from scapy.layers.l2 import Ether

    from hpclb.lab.bpf_testrun import PinnedXdpProgram
    from tests.conformance.harness import ring

    ip(netns, "link", "add", "va", "type", "veth", "peer", "name", "vb")
    ip(netns, "link", "add", "wa", "type", "veth", "peer", "name", "wb")
    dataplane = start_daemon(netns, "va", tmp_path, "--egress", "wa", "--no-attach")
    client = dataplane.client
    prog = PinnedXdpProgram(f"/sys/fs/bpf/hpclb/test-{netns}/lb_xdp")
    try:
        hello = client.hello()
        assert "tunnel" in hello["capabilities"]
        port_mac = ":".join(f"{b:02x}" for b in bytes(hello["ports"][0]["mac"]))
        tables = base_tables()
        b6 = {bid: Backend(bid, ipaddress.IPv6Address(f"fd00:1::{bid}"), f"02:00:00:00:06:{bid}")
              for bid in (40, 41)}
        b4 = Backend(42, ipaddress.IPv4Address("10.1.8.0"), "02:00:00:00:04:42")
        tables.backends.update(b6)
        tables.backends[42] = b4
        vip6 = Vip(9, ipaddress.IPv6Address("fd00::10"), 80, IPPROTO_TCP)
        tables.vips[9] = vip6
        tables.rings[9] = ring({40: 1.0})
        push_tables(client, None, tables)
        ipip = Vip(10, ipaddress.IPv4Address("198.18.9.10"), 80, IPPROTO_TCP, VipMode.TUNNEL,
                   tunnel_src=ipaddress.IPv4Address("172.16.0.0"), tunnel_src_bits=4)
        gue6 = Vip(11, ipaddress.IPv6Address("fd00::11"), 53, IPPROTO_UDP, VipMode.TUNNEL,
                   tunnel_src=ipaddress.IPv6Address("fd00:2::"), tunnel_encap=Encap.GUE,
                   gue_port=6080)
        mixed = Vip(12, ipaddress.IPv4Address("198.18.9.12"), 80, IPPROTO_TCP, VipMode.TUNNEL,
                    tunnel_src=ipaddress.IPv4Address("172.16.0.1"))
        client_mac = "02:aa:00:00:00:01"

        # IPv6 DSR, pinned in flow6_map: it stays on backend 40 when the
        # ring moves to 41; a new flow takes 41.
        def six(sport: int) -> bytes:
            return bytes(Ether(src=client_mac, dst=port_mac)
                         / IPv6(src="fd00:99::1", dst="fd00::10")
                         / TCP(sport=sport, dport=80))
        before = _counters(client)
        action, out = prog.run(six(1000))
        assert (action, out[:12]) == ("tx", bytes.fromhex("020000000640") + bytes.fromhex(
            port_mac.replace(":", "")))
        assert out[12:] == six(1000)[12:]
        moved = dict(tables.rings)
        moved[9] = ring({41: 1.0})
        moved_tables = replace(tables, rings=moved)
        push_tables(client, fetch_tables(client), moved_tables)
        assert prog.run(six(1000))[1][:6] == bytes.fromhex("020000000640"), "flow kept"
        assert prog.run(six(1001))[1][:6] == bytes.fromhex("020000000641"), "new flow moved"
        after = _counters(client)
        assert after["flow_new"] - before["flow_new"] == 2
        assert after["flow_hit"] - before["flow_hit"] == 1
        assert after["fwd_tx"] - before["fwd_tx"] == 3

        # After the push above, which would delete them (a TableSet push
        # sends set_vip through the client's own fields).
        _set_tunnel_vip(client, ipip, ring({42: 1.0}))
        _set_tunnel_vip(client, gue6, ring({41: 1.0}))
        _set_tunnel_vip(client, mixed, ring({41: 1.0}))

        # IPIP over IPv4: the outer header field by field (lb_encap.h).
        inner = IP(src="10.9.0.5", dst="198.18.9.10", tos=0x2E, ttl=33) / TCP(sport=4242,
                                                                              dport=80)
        action, out = prog.run(bytes(Ether(src=client_mac, dst=port_mac) / inner))
        flow_bits = 0x0A09 ^ 0x0005 ^ 4242
        want = (Ether(dst="02:00:00:00:04:42", src=port_mac)
                / IP(version=4, ihl=5, tos=0x2E, len=20 + len(inner), id=0, flags="DF",
                     frag=0, ttl=64, proto=4, src=f"172.16.0.{flow_bits & 0xF}",
                     dst="10.1.8.0")
                / inner)
        assert action == "tx"
        assert out.hex() == bytes(want).hex()

        # GUE over IPv6, inner IPv6: flow label, UDP source port, zero checksum.
        inner6 = IPv6(src="fd00:99::7", dst="fd00::11", tc=0xB8) / UDP(sport=5353, dport=53)
        action, out = prog.run(bytes(Ether(src=client_mac, dst=port_mac) / inner6))
        bits = 0xFD00 ^ 0x0099 ^ 0x0007 ^ 5353
        got = Ether(out)
        assert action == "tx"
        assert (got.dst, got.src, got.type) == ("02:00:00:00:06:41", port_mac, 0x86DD)
        outer = got[IPv6]
        assert (outer.tc, outer.fl, outer.nh, outer.hlim, outer.src, outer.dst) == (
            0xB8, bits, 17, 64, "fd00:2::", "fd00:1::41")
        assert outer.plen == 8 + len(inner6)
        udp = outer.payload
        assert (udp.sport, udp.dport, udp.len, udp.chksum) == (
            49152 + (bits & 0x3FFF), 6080, 8 + len(inner6), 0)
        assert bytes(udp.payload) == bytes(inner6)

        # An IPv4 tunnel source with an IPv6 backend: not encapsulated.
        before = _counters(client)
        frame = bytes(Ether(src=client_mac, dst=port_mac)
                      / IP(src="10.9.0.6", dst="198.18.9.12") / TCP(sport=1, dport=80))
        assert prog.run(frame) == ("drop", frame)
        after = _counters(client)
        assert after["drop_encap"] - before["drop_encap"] == 1
        assert after["tunnel_encap"] - before["tunnel_encap"] == 0
    finally:
        prog.close()
        stop_daemon(dataplane)


def test_pins_before_ipv6_nat_replaced(netns: str, tmp_path: Path) -> None:
    """Pins of a daemon before NAT mode for IPv6 (nat_config_map values of
    108 bytes, no conn6_map, conn6_fifo, nat6_prog, nat6_scratch) are stale
    as a whole: removed and made afresh, the tables not adopted."""
    import shutil

    if shutil.which("bpftool") is None:
        pytest.skip("needs bpftool")
    ip(netns, "link", "add", "va", "type", "veth", "peer", "name", "vb")
    ip(netns, "link", "add", "wa", "type", "veth", "peer", "name", "wb")
    pins = Path(f"/sys/fs/bpf/hpclb/test-{netns}")
    (tmp_path / "1").mkdir()
    first = start_daemon(netns, "va", tmp_path / "1", "--egress", "wa", "--no-attach")
    try:
        push_tables(first.client, None, base_tables())
    finally:
        _kill_hard(first)
    for name in ("conn6_map", "conn6_fifo", "nat6_prog", "nat6_scratch", "nat_config_map"):
        (pins / name).unlink()
    subprocess.run(["bpftool", "map", "create", str(pins / "nat_config_map"), "type", "array",
                    "key", "4", "value", "108", "entries", "1", "name", "nat_config_map"],
                   check=True)
    (tmp_path / "2").mkdir()
    second = start_daemon(netns, "va", tmp_path / "2", "--egress", "wa", "--no-attach")
    try:
        assert not fetch_tables(second.client).vips, "the old layout is not adopted"
        assert _bpftool_show(pins / "nat_config_map")["bytes_value"] == 368
        assert _bpftool_show(pins / "conn6_map")["bytes_value"] == 64
    finally:
        log = stop_daemon(second)
    assert "adopted the pinned tables" not in log, log
    assert "removing stale pins" in log, log
