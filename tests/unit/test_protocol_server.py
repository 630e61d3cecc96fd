"""The table-protocol server (dataplane/common/lb_proto_codec.c, lb_proto_ops.c)
inside the real daemons.

Every test runs against both: ``hpclb-dpdk`` on net_af_xdp ports, and
``dataplane/build/hpclb-xdp --no-attach``, on a veth pair in a fresh
network namespace and talks to it over its ZeroMQ socket: every operation of
PROTOCOL.md, then malformed, truncated, oversized and random messages, each of
which must get ``ok: false`` with an error naming the problem while the daemon
stays up and its tables stay exactly as they were.

Set HPCLB_TEST_VALGRIND=1 to run the daemon under valgrind (memcheck, leak
check); the daemon's exit status then carries valgrind's verdict.

``test_server_selftest`` needs no root: it builds the protocol server (codec
and ops) with tests/unit/proto_selftest.c (a fake data plane that can fail on demand) under
ASan/UBSan and runs its checks and fuzz loop. It covers NAT mode's server side (set_nat,
snat, dump's nat, stats' conns, restore) whatever the daemons implement; the NAT tests
here run against a daemon whose hello lists the "nat" capability and skip, saying so,
against one that does not.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import numpy as np
import pytest
import zmq

from hpclb.contract.tables import NatConfig, NatDown, Vip, VipMode
from hpclb.dataplane.client import DataplaneClient, snat_order
from hpclb.dataplane.dpdk import (
    DpdkLaunch,
    DpdkPort,
    find_dpdk_forwarder,
    forwarder_argv,
    reserve_hugepages,
)
from hpclb.dataplane.push import fetch_tables, push_tables
from hpclb.host import install

REPO = Path(__file__).resolve().parents[2]
try:
    DAEMON: Path | None = install.find("hpclb-xdp")
    _NO_DAEMON = ""
except install.MissingBuildOutput as err:
    DAEMON, _NO_DAEMON = None, str(err)
VALGRIND_SUPP = Path(__file__).with_name("valgrind-bpf.supp")
USE_VALGRIND = os.environ.get("HPCLB_TEST_VALGRIND") == "1"

RING_SIZE = 65537  # LB_RING_SIZE_DEFAULT
MAX_VIPS = 64
MAX_BACKENDS = 4096
MAX_MSG_BYTES = 16 << 20
NO_BACKEND = 0xFFFFFFFF
STAT_NAMES = [
    "rx", "fwd_tx", "fwd_redirect", "pass_not_ipv4", "pass_not_vip", "pass_fragment",
    "drop_malformed", "drop_no_backend", "drop_tx_error", "flow_hit", "flow_new",
    "flow_repin", "arp_reply", "flow_evict", "conn_new", "conn_hit", "conn_reply",
    "conn_evict", "conn_reschedule", "nat_icmp", "drop_conn_full", "drop_snat_exhausted",
    "drop_backend_down", "drop_conn_invalid", "ndp_reply", "pass_ext_headers", "tunnel_encap",
    "drop_encap",
]

CONN_STATE_NAMES = ["syn_sent", "syn_recv", "established", "fin_wait", "time_wait", "close",
                    "udp_unreplied", "udp_replied"]  # LB_CONN_STATE_NAMES
CONN_TIMEOUTS_DEFAULT = [120, 60, 432000, 120, 120, 10, 30, 120]  # LB_CONN_TIMEOUTS_DEFAULT
NAT_DEFAULT = {"snat_addrs": [], "snat_port_min": 1024, "snat_port_max": 65535,
               "on_backend_down": 0,
               "timeouts": dict(zip(CONN_STATE_NAMES, CONN_TIMEOUTS_DEFAULT, strict=True))}

PROTOCOL_VERSION = 2  # LB_PROTOCOL_VERSION
VIP_ID = 3
VIP_ADDR = bytes([10, 0, 0, 1])
VIP6_ADDR = bytes.fromhex("fd000000000000000000000000000001")  # fd00::1
NBACKENDS = 10


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root: network namespaces, bpffs and BPF maps"
    if DAEMON is None:
        return _NO_DAEMON
    if shutil.which("ip") is None:
        return "needs iproute2 (ip)"
    if USE_VALGRIND and shutil.which("valgrind") is None:
        return "HPCLB_TEST_VALGRIND=1 but valgrind is not installed"
    return None


_REASON = _skip_reason()
F = TypeVar("F", bound=Callable[..., Any])


def needs_root(f: F) -> F:
    """Marks a test that runs the daemon: it skips, saying why, when it cannot."""
    marked = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")(f)
    return pytest.mark.root(marked)  # type: ignore[no-any-return]


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


# --- fixtures ---------------------------------------------------------------


@pytest.fixture(scope="module")
def netns() -> Iterator[str]:
    """A fresh namespace holding veth pair va <-> vb, removed even on failure."""
    name = f"hpclbt-{uuid.uuid4().hex[:10]}"
    _run("ip", "netns", "add", name)
    try:
        _run("ip", "-n", name, "link", "add", "va", "type", "veth", "peer", "name", "vb")
        _run("ip", "-n", name, "link", "set", "va", "up")
        _run("ip", "-n", name, "link", "set", "vb", "up")
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    endpoint: str
    pin_dir: Path
    log_path: Path
    kind: str  # "xdp" or "dpdk": the same server behind both

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def assert_alive(self) -> None:
        assert self.proc.poll() is None, f"daemon exited:\n{self.log()[-4000:]}"


def _dpdk_argv(netns: str, endpoint: str, tag: str) -> list[str]:
    launch = DpdkLaunch(
        ports=(DpdkPort(0, "af_xdp", iface="va"), DpdkPort(1, "af_xdp", iface="vb")),
        socket=endpoint, netns=netns, flow_table_size=4096, idle_sleep_us=100,
        socket_mem_mb=256, file_prefix=f"hpclbt-{tag}",
    )
    if reserve_hugepages(launch.socket_mem_mb) < launch.socket_mem_mb:
        pytest.fail(f"cannot reserve {launch.socket_mem_mb} MB of hugepages for hpclb-dpdk")
    return [*forwarder_argv(launch), "--log-level", "debug"]


@pytest.fixture(scope="module", params=["xdp", "dpdk"])
def daemon(netns: str, tmp_path_factory: pytest.TempPathFactory,
           request: pytest.FixtureRequest) -> Iterator[Daemon]:
    kind = str(request.param)
    tmp = tmp_path_factory.mktemp(f"hpclb-{kind}")
    tag = uuid.uuid4().hex[:10]
    endpoint = f"ipc://{tmp}/dataplane.sock"
    pin_dir = Path(f"/sys/fs/bpf/hpclbt-{tag}")
    log_path = tmp / "daemon.log"
    if kind == "dpdk":
        if USE_VALGRIND:
            pytest.skip("valgrind cannot follow DPDK (hugepage memory, its own allocator)")
        if not os.access(find_dpdk_forwarder(), os.X_OK):
            pytest.fail("hpclb-dpdk not built: run make -C dataplane")
        argv = _dpdk_argv(netns, endpoint, tag)
    else:
        argv = [
            str(DAEMON), "--netns", netns, "--iface", "va", "--egress", "vb",
            "--socket", endpoint, "--pin-dir", str(pin_dir), "--flow-table-size", "4096",
            "--no-attach", "--log-level", "debug",
        ]
    if USE_VALGRIND:
        argv = [
            "valgrind", "--leak-check=full", "--show-leak-kinds=all",
            "--errors-for-leak-kinds=definite,indirect,possible", "--error-exitcode=99",
            f"--suppressions={VALGRIND_SUPP}", *argv,
        ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    d = Daemon(proc, endpoint, pin_dir, log_path, kind)
    try:
        deadline = time.monotonic() + (120 if USE_VALGRIND else 30)
        while f"hpclb-{kind}: ready" not in d.log():
            d.assert_alive()
            assert time.monotonic() < deadline, f"daemon not ready:\n{d.log()[-4000:]}"
            time.sleep(0.05)
        yield d
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60 if USE_VALGRIND else 10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        leftover = pin_dir.exists()
        if leftover:
            shutil.rmtree(pin_dir, ignore_errors=True)
    # Reached only when the module's tests are done: the shutdown is checked too.
    assert proc.returncode == 0, f"exit status {proc.returncode}:\n{d.log()[-6000:]}"
    assert not leftover, f"{pin_dir} still pinned after SIGTERM"


class Client:
    """A REQ socket with a receive timeout, rebuilt when a reply does not come
    (a REQ socket that missed its reply cannot send again)."""

    def __init__(self, endpoint: str, timeout_ms: int = 10000) -> None:
        self.endpoint = endpoint
        self.timeout_ms = timeout_ms
        self.ctx = zmq.Context()
        self.sock = self._make()
        self.seq = 0

    def _make(self) -> zmq.Socket[bytes]:
        s: zmq.Socket[bytes] = self.ctx.socket(zmq.REQ)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
        s.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        s.connect(self.endpoint)
        return s

    def raw(self, payload: bytes | list[bytes]) -> dict[str, Any]:
        try:
            if isinstance(payload, list):
                self.sock.send_multipart(payload)
            else:
                self.sock.send(payload)
            data = self.sock.recv()
        except zmq.Again:
            self.sock.close(linger=0)
            self.sock = self._make()
            raise
        reply = msgpack.unpackb(data, raw=False)
        assert isinstance(reply, dict), reply
        assert reply.get("v") == PROTOCOL_VERSION and isinstance(reply.get("ok"), bool), reply
        if not reply["ok"]:
            assert isinstance(reply.get("error"), str) and reply["error"], reply
        return reply

    def req(self, msg: dict[Any, Any]) -> dict[str, Any]:
        return self.raw(msgpack.packb(msg, use_bin_type=True))

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        reply = self.req({"v": PROTOCOL_VERSION, "op": op, "seq": self.seq, **fields})
        assert reply.get("seq") == self.seq, reply
        assert reply["ok"], f"{op}: {reply.get('error')}"
        return reply

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture
def client(daemon: Daemon) -> Iterator[Client]:
    c = Client(daemon.endpoint)
    try:
        yield c
    finally:
        c.close()
    daemon.assert_alive()


# --- helpers ----------------------------------------------------------------


def ring_bytes(slots: list[int]) -> bytes:
    return struct.pack(f"<{len(slots)}I", *slots)


def backend(i: int, state: int = 0, port: int = 1) -> dict[str, Any]:
    return {"id": i, "addr": bytes([10, 1, 0, i % 256]), "mac": bytes([2, 0, 0, 0, 0, i % 256]),
            "state": state, "port": port}


def reference_ring() -> list[int]:
    rng = random.Random(7)
    return [rng.randrange(NBACKENDS) if s % 97 else NO_BACKEND for s in range(RING_SIZE)]


def snapshot(c: Client) -> tuple[dict[str, Any], dict[int, bytes]]:
    dump = c.call("dump")
    del dump["seq"]
    rings = {v["vip_id"]: c.call("get_ring", vip_id=v["vip_id"])["slots"] for v in dump["vips"]}
    return dump, rings


def has_nat(c: Client) -> bool:
    return "nat" in c.call("hello")["capabilities"]


def has_tunnel(c: Client) -> bool:
    return "tunnel" in c.call("hello")["capabilities"]


def nat_or_skip(c: Client) -> dict[str, Any]:
    """hello's reply, or a skip saying why when the data plane has no NAT mode."""
    h = c.call("hello")
    if "nat" not in h["capabilities"]:
        reason = f"data plane lacks NAT mode (capabilities: {', '.join(h['capabilities'])})"
        print(reason)
        pytest.skip(reason)
    return h


@pytest.fixture
def configured(client: Client) -> Client:
    """A known state: hash key, VIP 3 (10.0.0.1:80/tcp), backends 0..9, a ring;
    the default NAT configuration where the data plane has NAT mode."""
    for v in client.call("dump")["vips"]:
        client.call("del_vip", addr=v["addr"], port=v["port"], proto=v["proto"])
    if has_nat(client):
        client.call("set_nat")  # every field left out: the defaults
    client.call("set_config", hash_key=bytes(range(16)))
    client.call("set_vip", vip_id=VIP_ID, addr=VIP_ADDR, port=80, proto=6, mode=0)
    client.call("set_backends", backends=[backend(i) for i in range(NBACKENDS)])
    client.call("set_ring", vip_id=VIP_ID, slots=ring_bytes(reference_ring()))
    return client


def bpf_lookup(pin: Path, key: int) -> Any:
    """One entry of a pinned map through bpftool: what the XDP program sees."""
    out = subprocess.run(
        ["bpftool", "-j", "map", "lookup", "pinned", str(pin), "key",
         *[str(b) for b in struct.pack("<I", key)]],
        check=True, capture_output=True, text=True,
    ).stdout
    value = json.loads(out)["value"]
    if isinstance(value, list):  # no BTF: hex bytes
        return int.from_bytes(bytes(int(b, 16) for b in value), "little")
    return value


# --- the server alone (no root) ---------------------------------------------


def test_server_selftest(tmp_path: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not Path("/usr/include/msgpack.h").exists():
        pytest.skip("needs a C compiler and msgpack-c (libmsgpack-dev)")
    exe = tmp_path / "proto_selftest"
    base = [cc, "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-std=gnu11",
            f"-I{REPO / 'dataplane/common'}", "-o", str(exe),
            str(Path(__file__).with_name("proto_selftest.c")),
            str(REPO / "dataplane/common/lb_proto_codec.c"),
            str(REPO / "dataplane/common/lb_proto_ops.c")]
    sanitize = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]
    build = subprocess.run([*base, *sanitize, "-lmsgpackc"], capture_output=True, text=True)
    if build.returncode != 0:  # no sanitizer runtime: still worth running plain
        build = subprocess.run([*base, "-lmsgpackc"], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "proto_selftest: ok" in run.stdout


# --- operations -------------------------------------------------------------


@needs_root
def test_hello(client: Client, daemon: Daemon) -> None:
    h = client.call("hello")
    assert h["dataplane"] == daemon.kind and h["version"] == PROTOCOL_VERSION
    assert h["ring_size"] == RING_SIZE
    assert (h["max_vips"], h["max_backends"], h["max_ports"]) == (MAX_VIPS, MAX_BACKENDS, 8)
    assert [p["index"] for p in h["ports"]] == [0, 1]
    assert all(len(p["mac"]) == 6 and p["ifindex"] > 0 for p in h["ports"])
    # NAT mode: a connection table exactly when the "nat" capability is there.
    assert isinstance(h["conn_table_size"], int)
    assert (h["conn_table_size"] > 0) == ("nat" in h["capabilities"]), h
    # Both data planes do tunnel mode (set_vip mode 2); the tunnel tests below
    # also check the refusal a data plane without it gives.
    assert "tunnel" in h["capabilities"], h
    if daemon.kind == "xdp":
        assert h["attach_mode"] == "none"  # --no-attach
        assert [p["ifname"] for p in h["ports"]] == ["va", "vb"]
        assert set(h["capabilities"]) >= {"dsr", "patch_ring", "xdp_tx", "redirect"}
    else:
        assert h["attach_mode"] == "poll"
        assert [p["ifname"] for p in h["ports"]] == ["net_af_xdp0", "net_af_xdp1"]
        assert set(h["capabilities"]) >= {"dsr", "patch_ring", "redirect", "arp_reply"}


@needs_root
def test_dpdk_stats_carry_the_ports_counters(client: Client, daemon: Daemon) -> None:
    stats = client.call("stats")
    if daemon.kind == "xdp":
        assert "ports" not in stats  # the kernel's own counters are ip -s link's
        return
    assert len(stats["ports"]) == 2
    for port in stats["ports"]:
        assert set(port) == {"rx_packets", "rx_bytes", "tx_packets", "tx_bytes", "rx_missed",
                             "rx_errors", "tx_errors", "rx_nombuf", "rx_crc_errors"}


@needs_root
def test_pins(daemon: Daemon) -> None:
    if daemon.kind != "xdp":
        pytest.skip("only the XDP daemon pins BPF maps")
    names = {p.name for p in daemon.pin_dir.iterdir()}
    assert {"lb_xdp", "vip_map", "backend_map", "ring_map", "flow_map", "config_map",
            "port_map", "tx_devmap", "stats_map", "vip_stats_map",
            "backend_stats_map"} <= names


@needs_root
def test_seq_echo_and_unknown_keys(client: Client) -> None:
    r = client.req({"v": PROTOCOL_VERSION, "op": "hello", "seq": 2**64 - 1,
                    "future_field": [1, {"x": b""}]})
    assert r["ok"] and r["seq"] == 2**64 - 1
    r = client.req({"v": PROTOCOL_VERSION, "op": "hello"})
    assert r["ok"] and "seq" not in r


@needs_root
def test_set_config(client: Client, daemon: Daemon) -> None:
    key = bytes(range(100, 116))
    client.call("set_config", hash_key=key)
    assert client.call("dump")["hash_key"] == key
    assert client.call("dump")["ring_size"] == RING_SIZE


@needs_root
def test_tables_round_trip(configured: Client, daemon: Daemon) -> None:
    c = configured
    dump = c.call("dump")
    assert dump["vips"] == [{"vip_id": VIP_ID, "addr": VIP_ADDR, "port": 80, "proto": 6,
                             "mode": 0, "nat_port": 0, "snat": False}]
    assert dump["nat"] == NAT_DEFAULT
    assert dump["backends"] == [backend(i) for i in range(NBACKENDS)]
    ring = reference_ring()
    assert c.call("get_ring", vip_id=VIP_ID)["slots"] == ring_bytes(ring)

    patch = [(0, 9), (5, NO_BACKEND), (RING_SIZE - 1, 4), (5, 2)]  # slot 5 twice: last wins
    c.call("patch_ring", vip_id=VIP_ID, patch=b"".join(struct.pack("<II", s, b)
                                                          for s, b in patch))
    for s, b in patch:
        ring[s] = b
    assert c.call("get_ring", vip_id=VIP_ID)["slots"] == ring_bytes(ring)

    # The writes reached the maps the XDP program reads.
    if daemon.kind == "xdp" and shutil.which("bpftool"):
        for s in (0, 5, 96, 97, RING_SIZE - 1):
            assert bpf_lookup(daemon.pin_dir / "ring_map", VIP_ID * RING_SIZE + s) == ring[s]
        assert bpf_lookup(daemon.pin_dir / "ring_map", 0) == NO_BACKEND


@needs_root
def test_set_backend_state(configured: Client) -> None:
    c = configured
    c.call("set_backend_state", id=4, state=1)
    c.call("set_backend_state", id=5, state=2)
    states = {b["id"]: b["state"] for b in c.call("dump")["backends"]}
    assert states[4] == 1 and states[5] == 2 and states[3] == 0
    c.call("set_backend_state", id=5, state=3)  # UNUSED: removed
    assert 5 not in {b["id"] for b in c.call("dump")["backends"]}
    c.call("set_backends", backends=[backend(5, state=0, port=0)])
    assert backend(5, state=0, port=0) in c.call("dump")["backends"]
    # A backend whose MAC is not known yet: all zeros, down (the controller's
    # NO_MAC). Unlike a multicast MAC (BAD below), accepted.
    unknown = {**backend(6, state=2), "mac": bytes(6)}
    c.call("set_backends", backends=[unknown])
    assert unknown in c.call("dump")["backends"]


@needs_root
def test_del_vip_resets_ring(configured: Client, daemon: Daemon) -> None:
    c = configured
    c.call("del_vip", addr=VIP_ADDR, port=80, proto=6)
    assert c.call("dump")["vips"] == []
    r = c.req({"v": PROTOCOL_VERSION, "op": "get_ring", "vip_id": VIP_ID})
    assert not r["ok"] and "not configured" in r["error"]
    if daemon.kind == "xdp" and shutil.which("bpftool"):
        assert bpf_lookup(daemon.pin_dir / "ring_map", VIP_ID * RING_SIZE + 1) == NO_BACKEND
    # Re-created, the VIP starts with an empty ring.
    c.call("set_vip", vip_id=VIP_ID, addr=VIP_ADDR, port=80, proto=6, mode=0)
    assert c.call("get_ring", vip_id=VIP_ID)["slots"] == ring_bytes([NO_BACKEND] * RING_SIZE)


@needs_root
def test_second_vip_and_udp(configured: Client) -> None:
    c = configured
    c.call("set_vip", vip_id=MAX_VIPS - 1, addr=bytes([10, 0, 0, 2]), port=53, proto=17, mode=0)
    c.call("set_vip", vip_id=MAX_VIPS - 1, addr=bytes([10, 0, 0, 2]), port=53, proto=17, mode=0)
    ids = sorted(v["vip_id"] for v in c.call("dump")["vips"])
    assert ids == [VIP_ID, MAX_VIPS - 1]
    c.call("del_vip", addr=bytes([10, 0, 0, 2]), port=53, proto=17)


def backend6(i: int, state: int = 0, port: int = 1) -> dict[str, Any]:
    """An IPv6 backend, fd00:1::<i>."""
    return {**backend(i, state, port), "addr": bytes.fromhex("fd000001" + "00" * 10) +
            struct.pack("!H", i)}


@needs_root
def test_ipv6_vip_and_backends_round_trip(configured: Client, daemon: Daemon) -> None:
    """Protocol 2: an IPv6 VIP and IPv6 backends are stored, dumped and deleted
    next to the IPv4 ones."""
    c = configured
    v4 = {"vip_id": VIP_ID, "addr": VIP_ADDR, "port": 80, "proto": 6, "mode": 0, "nat_port": 0,
          "snat": False}
    # The same port and protocol as the IPv4 VIP: another key.
    c.call("set_vip", vip_id=10, addr=VIP6_ADDR, port=80, proto=6, mode=0,
           slots=ring_bytes([20, 21] * (RING_SIZE // 2) + [20]))
    c.call("set_backends", backends=[backend6(20), backend6(21, state=1, port=0)])
    dump = c.call("dump")
    v6 = {"vip_id": 10, "addr": VIP6_ADDR, "port": 80, "proto": 6, "mode": 0, "nat_port": 0,
          "snat": False}
    assert dump["vips"] == [v4, v6]
    assert dump["backends"] == [backend(i) for i in range(NBACKENDS)] + [
        backend6(20), backend6(21, state=1, port=0)]
    assert c.call("get_ring", vip_id=10)["slots"][:8] == ring_bytes([20, 21])
    if daemon.kind == "xdp" and shutil.which("bpftool"):
        out = subprocess.run(["bpftool", "-j", "map", "dump", "pinned",
                              str(daemon.pin_dir / "vip_map")],
                             check=True, capture_output=True, text=True).stdout
        assert len(json.loads(out)) == 2
    # An IPv4 address whose bytes begin the IPv6 one is still another VIP.
    r = c.req({**V, "op": "del_vip", "addr": VIP6_ADDR[:4], "port": 80, "proto": 6})
    assert not r["ok"] and "no VIP" in r["error"]
    c.call("del_vip", addr=VIP6_ADDR, port=80, proto=6)
    c.call("set_backend_state", id=20, state=3)
    c.call("set_backend_state", id=21, state=3)
    dump = c.call("dump")
    assert dump["vips"] == [v4]
    assert dump["backends"] == [backend(i) for i in range(NBACKENDS)]


@needs_root
def test_nat_port_and_tunnel_src_are_stored(configured: Client) -> None:
    """nat_port and tunnel_src are decoded, checked, stored and reported by
    dump with a DSR VIP; a refused tunnel VIP changes nothing."""
    c = configured
    c.call("set_vip", vip_id=11, addr=bytes([10, 0, 0, 11]), port=443, proto=6, mode=0,
           nat_port=8443, tunnel_src=bytes([192, 0, 2, 1]))
    c.call("set_vip", vip_id=12, addr=VIP6_ADDR, port=443, proto=17, mode=0,
           tunnel_src=bytes.fromhex("fd00000000000000000000000000aaaa"))
    vips = {v["vip_id"]: v for v in c.call("dump")["vips"]}
    assert vips[11] == {"vip_id": 11, "addr": bytes([10, 0, 0, 11]), "port": 443, "proto": 6,
                        "mode": 0, "nat_port": 8443, "snat": False,
                        "tunnel_src": bytes([192, 0, 2, 1])}
    assert vips[12]["nat_port"] == 0
    assert vips[12]["tunnel_src"] == bytes.fromhex("fd00000000000000000000000000aaaa")
    before = c.call("dump")["vips"]
    r = c.req({**V, "op": "set_vip", "vip_id": 11, "addr": bytes([10, 0, 0, 11]), "port": 443,
               "proto": 6, "mode": 2, "nat_port": 9000})
    assert not r["ok"] and (
        "field 'tunnel_src': tunnel mode (2) needs an outer source address" if has_tunnel(c)
        else "mode not supported by this data plane") in r["error"], r
    assert c.call("dump")["vips"] == before
    # The same key and id again rewrites the extras (as it rewrites the mode).
    c.call("set_vip", vip_id=11, addr=bytes([10, 0, 0, 11]), port=443, proto=6, mode=0)
    vips = {v["vip_id"]: v for v in c.call("dump")["vips"]}
    assert vips[11]["nat_port"] == 0 and "tunnel_src" not in vips[11]
    c.call("del_vip", addr=bytes([10, 0, 0, 11]), port=443, proto=6)
    c.call("del_vip", addr=VIP6_ADDR, port=443, proto=17)


@needs_root
def test_version_mismatch_reply_says_ours(client: Client) -> None:
    """A request of another version: an error reply whose 'v' is this data
    plane's version, so the peer can tell which builds to install."""
    for v in (1, 3):
        r = client.req({"v": v, "op": "hello", "seq": 5})
        assert not r["ok"] and r["v"] == PROTOCOL_VERSION and r["seq"] == 5
        assert r["error"] == f"protocol version {v} not supported: this data plane speaks 2"


@needs_root
def test_stats(configured: Client) -> None:
    s = configured.call("stats")
    assert list(s["counters"]) == STAT_NAMES
    assert all(isinstance(v, int) and v >= 0 for v in s["counters"].values())
    assert [row[0] for row in s["vips"]] == [VIP_ID]
    assert [row[0] for row in s["backends"]] == list(range(NBACKENDS))
    assert all(len(row) == 3 for row in s["vips"] + s["backends"])
    if not has_nat(configured):
        assert "conns" not in s  # no NAT mode, no connection table


# --- rejected messages: error reply, daemon up, tables unchanged ------------

V = {"v": PROTOCOL_VERSION}
GOOD_VIP = {**V, "op": "set_vip", "vip_id": 7, "addr": bytes([10, 0, 0, 9]), "port": 443,
            "proto": 6, "mode": 0}
MULTICAST = bytes.fromhex("01005e0000fb")  # what the configuration refuses too
GOOD_BACKENDS = {**V, "op": "set_backends", "backends": [backend(20), backend(21)]}


def _without(d: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != key}


# (request, substring the error must contain)
BAD: list[tuple[Any, str]] = [
    ([1, 2], "must be a msgpack map"),
    ("hello", "must be a msgpack map"),
    ({"op": "hello"}, "missing field 'v'"),
    ({"v": 1, "op": "hello"}, "protocol version 1 not supported: this data plane speaks 2"),
    ({"v": 3, "op": "hello"}, "protocol version 3 not supported: this data plane speaks 2"),
    ({"v": "2", "op": "hello"}, "field 'v' must be an unsigned integer"),
    ({"v": 2.0, "op": "hello"}, "got float"),
    ({"v": 2}, "missing field 'op'"),
    ({"v": 2, "op": 5}, "field 'op' must be str"),
    ({"v": 2, "op": b"hello"}, "field 'op' must be str"),
    ({"v": 2, "op": "frobnicate"}, "unknown op 'frobnicate'"),
    ({"v": 2, "op": "hello", "seq": -1}, "field 'seq'"),
    ({b"v": 2, b"op": "hello"}, "keys of the request must be str"),
    ({1: 1, "v": 2, "op": "hello"}, "keys of the request must be str"),
    # set_config
    ({**V, "op": "set_config"}, "missing field 'hash_key'"),
    ({**V, "op": "set_config", "hash_key": bytes(15)}, "field 'hash_key' must be bin of 16"),
    ({**V, "op": "set_config", "hash_key": "0123456789abcdef"}, "field 'hash_key' must be bin"),
    # set_vip
    ({**GOOD_VIP, "vip_id": MAX_VIPS}, "field 'vip_id' out of range"),
    ({**GOOD_VIP, "vip_id": -1}, "field 'vip_id' out of range"),
    ({**GOOD_VIP, "vip_id": None}, "field 'vip_id' must be an unsigned integer"),
    ({**GOOD_VIP, "addr": bytes(5)}, "field 'addr' must be bin of 4 (IPv4) or 16 (IPv6) bytes, "
     "got 5"),
    ({**GOOD_VIP, "addr": bytes(0)}, "field 'addr' must be bin of 4 (IPv4) or 16 (IPv6) bytes"),
    ({**GOOD_VIP, "addr": bytes(15)}, "field 'addr' must be bin of 4 (IPv4) or 16 (IPv6) bytes"),
    ({**GOOD_VIP, "addr": bytes(17)}, "field 'addr' must be bin of 4 (IPv4) or 16 (IPv6) bytes"),
    ({**GOOD_VIP, "nat_port": 65536}, "field 'nat_port' out of range"),
    ({**GOOD_VIP, "nat_port": "80"}, "field 'nat_port' must be an unsigned integer"),
    ({**GOOD_VIP, "tunnel_src": bytes(6)},
     "field 'tunnel_src' must be bin of 4 (IPv4) or 16 (IPv6) bytes, got 6"),
    ({**GOOD_VIP, "tunnel_src": "10.0.0.1"}, "field 'tunnel_src' must be bin"),
    # tunnel fields: their own checks come before any mode rule
    ({**GOOD_VIP, "tunnel_encap": 2}, "field 'tunnel_encap' out of range: 2 (allowed 0..1)"),
    ({**GOOD_VIP, "mode": 2, "tunnel_encap": "gue"},
     "field 'tunnel_encap' must be an unsigned integer, got str"),
    ({**GOOD_VIP, "mode": 2, "tunnel_encap": 1, "gue_port": 0},
     "field 'gue_port' out of range: 0 (allowed 1..65535)"),
    ({**GOOD_VIP, "gue_port": 65536}, "field 'gue_port' out of range: 65536"),
    ({**GOOD_VIP, "mode": 2, "tunnel_src_bits": 17},
     "field 'tunnel_src_bits' out of range: 17 (allowed 0..16)"),
    # ...and the tunnel fields with another mode, whatever the data plane serves
    ({**GOOD_VIP, "tunnel_encap": 0},
     "field 'tunnel_encap': only a tunnel VIP (mode 2) takes it, field 'mode' is 0"),
    ({**GOOD_VIP, "tunnel_src": bytes(4), "gue_port": 6080},
     "field 'gue_port': only a tunnel VIP (mode 2) takes it, field 'mode' is 0"),
    ({**GOOD_VIP, "tunnel_src_bits": 0},
     "field 'tunnel_src_bits': only a tunnel VIP (mode 2) takes it"),
    ({**GOOD_VIP, "addr": "10.0.0.9"}, "field 'addr' must be bin"),
    ({**GOOD_VIP, "port": 0}, "field 'port' out of range"),
    ({**GOOD_VIP, "port": 65536}, "field 'port' out of range"),
    ({**GOOD_VIP, "proto": 1}, "field 'proto'"),
    ({**GOOD_VIP, "mode": 3}, "field 'mode' out of range"),
    ({**GOOD_VIP, "snat": True}, "field 'snat': only a NAT VIP (mode 1) takes SNAT, field "
     "'mode' is 0"),
    ({**GOOD_VIP, "snat": 1}, "field 'snat' must be bool, got unsigned integer"),
    (_without(GOOD_VIP, "port"), "missing field 'port'"),
    (_without(GOOD_VIP, "mode"), "missing field 'mode'"),
    ({**GOOD_VIP, "vip_id": VIP_ID}, "already used by another VIP"),
    ({**GOOD_VIP, "addr": VIP_ADDR, "port": 80}, "already VIP 3"),
    ({**GOOD_VIP, "port": 8080, "v": 2, "vip_id": 7, "seq": 1.5}, "field 'seq'"),
    # del_vip
    ({**V, "op": "del_vip", "addr": bytes([10, 9, 9, 9]), "port": 80, "proto": 6}, "no VIP"),
    ({**V, "op": "del_vip", "addr": VIP_ADDR, "port": 80}, "missing field 'proto'"),
    # set_backends
    ({**V, "op": "set_backends"}, "missing field 'backends'"),
    ({**V, "op": "set_backends", "backends": {"id": 1}}, "field 'backends' must be an array"),
    ({**V, "op": "set_backends", "backends": [backend(i) for i in range(MAX_BACKENDS + 1)]},
     "at most 4096"),
    ({**V, "op": "set_backends", "backends": [backend(20), backend(21), backend(20)]},
     "appears twice"),
    ({**V, "op": "set_backends", "backends": [backend(20), 7]},
     "field 'backends[1]' must be a map"),
    ({**V, "op": "set_backends", "backends": [{**backend(20), "mac": bytes(5)}]},
     "field 'backends[0].mac' must be bin of 6"),
    ({**V, "op": "set_backends", "backends": [backend(20), {**backend(21), "mac": MULTICAST}]},
     "field 'backends[1].mac' must be a unicast address, 01:00:5e:00:00:fb has the multicast"),
    ({**V, "op": "set_backends", "backends": [{**backend(20), "mac": b"\xff" * 6}]},
     "field 'backends[0].mac' must be a unicast address"),
    ({**V, "op": "set_backends", "backends": [{**backend(20), "state": 4}]},
     "field 'backends[0].state' out of range"),
    ({**V, "op": "set_backends", "backends": [{**backend(20), "port": 2}]},
     "field 'backends[0].port' out of range"),
    ({**V, "op": "set_backends", "backends": [backend(20), {**backend(21), "id": MAX_BACKENDS}]},
     "field 'backends[1].id' out of range"),
    ({**V, "op": "set_backends", "backends": [backend(1), _without(backend(21), "addr")]},
     "missing field 'backends[1].addr'"),
    ({**V, "op": "set_backends", "backends": [backend(1), {**backend(21), "addr": bytes(8)}]},
     "field 'backends[1].addr' must be bin of 4 (IPv4) or 16 (IPv6) bytes, got 8"),
    ({**V, "op": "set_backends", "backends": [{**backend(2), "id": 2, "x": 1, 3: 4}]},
     "keys of backends[0] must be str"),
    # set_backend_state
    ({**V, "op": "set_backend_state", "id": 100, "state": 1}, "backend 100 is not configured"),
    ({**V, "op": "set_backend_state", "id": 1, "state": 9}, "field 'state' out of range"),
    ({**V, "op": "set_backend_state", "state": 1}, "missing field 'id'"),
    # set_ring
    ({**V, "op": "set_ring", "vip_id": 9, "slots": ring_bytes([0] * RING_SIZE)},
     "VIP 9 is not configured"),
    ({**V, "op": "set_ring", "vip_id": VIP_ID, "slots": ring_bytes([0] * (RING_SIZE - 1))},
     f"field 'slots' must be bin of {RING_SIZE * 4}"),
    ({**V, "op": "set_ring", "vip_id": VIP_ID,
      "slots": ring_bytes([0] * 1000 + [MAX_BACKENDS] + [0] * (RING_SIZE - 1001))},
     "field 'slots': slot 1000 holds 4096"),
    ({**V, "op": "set_ring", "vip_id": VIP_ID, "slots": [0] * 10}, "field 'slots' must be bin"),
    ({**V, "op": "set_ring", "vip_id": VIP_ID}, "missing field 'slots'"),
    # patch_ring
    ({**V, "op": "patch_ring", "vip_id": VIP_ID, "patch": b""}, "field 'patch' must be bin of n*8"),
    ({**V, "op": "patch_ring", "vip_id": VIP_ID, "patch": bytes(12)},
     "field 'patch' must be bin of n*8"),
    ({**V, "op": "patch_ring", "vip_id": VIP_ID,
      "patch": struct.pack("<4I", 1, 1, RING_SIZE, 1)}, "entry 1 names slot 65537"),
    ({**V, "op": "patch_ring", "vip_id": VIP_ID, "patch": struct.pack("<4I", 1, 1, 2, 4096)},
     "entry 1 sets backend 4096"),
    ({**V, "op": "patch_ring", "vip_id": 0, "patch": struct.pack("<2I", 1, 1)},
     "VIP 0 is not configured"),
    # get_ring
    ({**V, "op": "get_ring", "vip_id": "3"}, "field 'vip_id' must be an unsigned integer"),
    ({**V, "op": "get_ring"}, "missing field 'vip_id'"),
]


@needs_root
@pytest.mark.parametrize(("request_", "needle"), BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_rejected(configured: Client, daemon: Daemon, request_: Any, needle: str) -> None:
    assert_rejected(configured, daemon, request_, needle)


def assert_rejected(c: Client, daemon: Daemon, request_: Any, needle: str) -> None:
    before = snapshot(c)
    reply = c.raw(msgpack.packb(request_, use_bin_type=True))
    assert not reply["ok"], reply
    assert needle in reply["error"], reply["error"]
    daemon.assert_alive()
    assert snapshot(c) == before


# --- NAT mode ------------------------------------------------------------------
# Against a data plane whose hello lists "nat"; the others skip, saying so
# (the server's NAT logic is proto_selftest.c's either way).

SET_NAT = {**V, "op": "set_nat"}
NAT_VIP = {**GOOD_VIP, "mode": 1}
POOL = [bytes([198, 51, 100, 1]), bytes([198, 51, 100, 2])]
NOT_UNICAST = [[0, 1, 2, 3], [127, 0, 0, 1], [224, 0, 0, 1], [239, 255, 255, 250],
               [240, 0, 0, 1], [255, 255, 255, 255]]

# What a data plane with NAT mode refuses, from its default NAT configuration.
NAT_BAD: list[tuple[Any, str]] = [
    # set_vip (IPv6 NAT VIPs: NAT6_CASES)
    ({**NAT_VIP, "snat": True}, "field 'snat': no SNAT pool configured (set_nat)"),
    ({**NAT_VIP, "snat": "yes"}, "field 'snat' must be bool, got str"),
    # set_nat: every field's bounds
    ({**SET_NAT, "snat_addrs": "198.51.100.1"}, "field 'snat_addrs' must be an array, got str"),
    ({**SET_NAT, "snat_addrs": [bytes([10, 9, 0, i]) for i in range(1, 18)]},
     "field 'snat_addrs' has 17 IPv4 entries, at most 16 of each family allowed"),
    ({**SET_NAT, "snat_addrs": [bytes([10, 9, 0, i]) for i in range(1, 34)]},
     "field 'snat_addrs' has 33 entries, at most 32 allowed (16 of each family)"),
    ({**SET_NAT, "snat_addrs": [POOL[0], bytes(5)]},
     "field 'snat_addrs[1]' must be bin of 4 (IPv4) or 16 (IPv6) bytes, got 5"),
    ({**SET_NAT, "snat_addrs": ["198.51.100.1"]}, "field 'snat_addrs[0]' must be bin, got str"),
    *[({**SET_NAT, "snat_addrs": [POOL[0], bytes(a)]},
       f"field 'snat_addrs[1]': {'.'.join(map(str, a))} is not a unicast address")
      for a in NOT_UNICAST],
    ({**SET_NAT, "snat_addrs": [POOL[0], POOL[1], POOL[0]]},
     "field 'snat_addrs[2]': 198.51.100.1 appears twice (also snat_addrs[0])"),
    ({**SET_NAT, "snat_port_min": 0}, "field 'snat_port_min' out of range: 0 (allowed 1..65535)"),
    ({**SET_NAT, "snat_port_min": 65536}, "field 'snat_port_min' out of range: 65536"),
    ({**SET_NAT, "snat_port_min": -1}, "field 'snat_port_min' out of range: -1"),
    ({**SET_NAT, "snat_port_min": "1024"},
     "field 'snat_port_min' must be an unsigned integer, got str"),
    ({**SET_NAT, "snat_port_max": 0}, "field 'snat_port_max' out of range: 0 (allowed 1..65535)"),
    ({**SET_NAT, "snat_port_max": 65536}, "field 'snat_port_max' out of range: 65536"),
    ({**SET_NAT, "snat_port_min": 2000, "snat_port_max": 1999},
     "field 'snat_port_min': 2000 is above snat_port_max 1999"),
    ({**SET_NAT, "snat_port_max": 1000},  # against the default minimum
     "field 'snat_port_min': 1024 is above snat_port_max 1000"),
    ({**SET_NAT, "on_backend_down": 2}, "field 'on_backend_down' out of range: 2 (allowed 0..1)"),
    ({**SET_NAT, "on_backend_down": None}, "field 'on_backend_down' must be an unsigned integer"),
    ({**SET_NAT, "timeouts": [1]}, "field 'timeouts' must be a map, got array"),
    ({**SET_NAT, "timeouts": {"established": 60, "establishd": 60}},
     "field 'timeouts': unknown connection state 'establishd' (known: syn_sent, syn_recv, "
     "established, fin_wait, time_wait, close, udp_unreplied, udp_replied)"),
    ({**SET_NAT, "timeouts": {"ESTABLISHED": 60}}, "unknown connection state 'ESTABLISHED'"),
    ({**SET_NAT, "timeouts": {"established": 0}},
     "field 'timeouts.established' out of range: 0 (allowed 1..2147483647)"),
    ({**SET_NAT, "timeouts": {"udp_replied": 2**31}},
     "field 'timeouts.udp_replied' out of range: 2147483648 (allowed 1..2147483647)"),
    ({**SET_NAT, "timeouts": {"close": "10"}},
     "field 'timeouts.close' must be an unsigned integer, got str"),
    ({**SET_NAT, "timeouts": {1: 5}}, "keys of timeouts must be str"),
]

# What a data plane without NAT mode refuses instead.
# A data plane without NAT mode (ops->set_nat NULL) refuses NAT VIPs and
# set_nat; both planes have it, so proto_selftest.c's test_no_nat (fake ops)
# covers that path.

# NAT mode for IPv6: (request, the error with "nat6", the error without it).
POOL6 = [bytes.fromhex("fd00000000000000000000000000000a"),  # fd00::a
         bytes.fromhex("20010db8000000000000000000000002")]  # 2001:db8::2
NO_NAT6_VIP = "field 'mode': NAT mode (1) is IPv4 only, this VIP's 'addr' is IPv6"
NAT6_CASES: list[tuple[Any, str, str]] = [
    ({**NAT_VIP, "addr": VIP6_ADDR, "snat": True},
     "field 'snat': no IPv6 SNAT pool configured (set_nat)", NO_NAT6_VIP),
    ({**SET_NAT, "snat_addrs": [POOL[0]] + [bytes([0xfd, *[0] * 13, 1, i]) for i in range(17)]},
     "field 'snat_addrs' has 17 IPv6 entries, at most 16 of each family allowed",
     "field 'snat_addrs[1]' is IPv6: this data plane has no NAT mode for IPv6 (no \"nat6\" "
     "capability)"),
    *[({**SET_NAT, "snat_addrs": [POOL6[0], POOL[0], bytes.fromhex(a)]},
       f"field 'snat_addrs[2]': {text} is not a unicast address (::, ::1, ff00::/8, fe80::/10 "
       "and ::ffff:0:0/96 are refused)", "field 'snat_addrs[0]' is IPv6")
      for a, text in (("00" * 16, "::"), ("00" * 15 + "01", "::1"),
                      ("ff02" + "00" * 13 + "01", "ff02::1"),
                      ("fe80" + "00" * 13 + "01", "fe80::1"),
                      ("00" * 10 + "ffffc0000201", "::ffff:192.0.2.1"))],
    ({**SET_NAT, "snat_addrs": [POOL6[0], POOL[0], POOL6[1], POOL6[0]]},
     "field 'snat_addrs[3]': fd00::a appears twice (also snat_addrs[0])",
     "field 'snat_addrs[0]' is IPv6"),
    # the IPv4 pool's faults come first
    ({**SET_NAT, "snat_addrs": [POOL6[0], POOL6[0], bytes([127, 0, 0, 1])]},
     "field 'snat_addrs[2]': 127.0.0.1 is not a unicast address", "field 'snat_addrs[0]' is IPv6"),
]


def has_nat6(c: Client) -> bool:
    return "nat6" in c.call("hello")["capabilities"]


@needs_root
@pytest.mark.parametrize(("request_", "with_nat6", "without"), NAT6_CASES,
                         ids=[f"nat6_bad{i}" for i in range(len(NAT6_CASES))])
def test_rejected_nat6(configured: Client, daemon: Daemon, request_: Any, with_nat6: str,
                       without: str) -> None:
    """Refused by a data plane with NAT mode for IPv6 as PROTOCOL.md says, and
    by one without it as having none (checked either way, not skipped)."""
    nat_or_skip(configured)
    assert_rejected(configured, daemon, request_,
                    with_nat6 if has_nat6(configured) else without)


@needs_root
def test_nat6_round_trip(configured: Client, daemon: Daemon) -> None:
    """A mixed pool is dumped IPv4 first, each family in order, and the dump
    sent back changes nothing; an IPv6 NAT VIP with snat is stored and
    dumped as set, and the IPv6 pool cannot be emptied under it. Without
    "nat6" both are refused and nothing changes."""
    c = configured
    nat_or_skip(c)
    key = {"addr": bytes.fromhex("fd00000000000000000000000000002a"), "port": 80, "proto": 6}
    vip6 = {"vip_id": 22, **key, "mode": 1, "nat_port": 8080, "snat": True}
    mixed = [POOL6[1], POOL[0], POOL6[0]]
    if not has_nat6(c):
        assert_rejected(c, daemon, {**SET_NAT, "snat_addrs": mixed}, "is IPv6")
        assert_rejected(c, daemon, {**V, "op": "set_vip", **vip6}, NO_NAT6_VIP)
        return
    c.call("set_nat", snat_addrs=mixed)
    nat = c.call("dump")["nat"]
    assert nat["snat_addrs"] == [POOL[0], POOL6[1], POOL6[0]]
    before = snapshot(c)
    c.call("set_nat", **nat)
    assert snapshot(c) == before
    c.call("set_vip", **vip6, slots=ring_bytes([i % NBACKENDS for i in range(RING_SIZE)]))
    assert {v["vip_id"]: v for v in c.call("dump")["vips"]}[22] == vip6
    r = c.req({**SET_NAT, "snat_addrs": [POOL[0]]})
    assert not r["ok"] and "VIP 22 uses SNAT, the IPv6 pool cannot be emptied" in r["error"]
    c.call("del_vip", **key)
    c.call("set_nat")
    assert c.call("dump")["nat"] == NAT_DEFAULT


@needs_root
@pytest.mark.parametrize(("request_", "needle"), NAT_BAD,
                         ids=[f"nat_bad{i}" for i in range(len(NAT_BAD))])
def test_rejected_nat(configured: Client, daemon: Daemon, request_: Any, needle: str) -> None:
    nat_or_skip(configured)
    assert_rejected(configured, daemon, request_, needle)


@needs_root
def test_set_nat_dump_round_trip(configured: Client) -> None:
    c = configured
    nat_or_skip(c)
    assert c.call("dump")["nat"] == NAT_DEFAULT
    c.call("set_nat", snat_addrs=POOL, snat_port_min=20000, snat_port_max=20999,
           on_backend_down=1, timeouts={"established": 3600, "udp_unreplied": 5})
    nat = c.call("dump")["nat"]
    assert nat == {"snat_addrs": POOL, "snat_port_min": 20000, "snat_port_max": 20999,
                   "on_backend_down": 1,
                   "timeouts": {**NAT_DEFAULT["timeouts"], "established": 3600,
                                "udp_unreplied": 5}}
    assert list(nat) == ["snat_addrs", "snat_port_min", "snat_port_max", "on_backend_down",
                         "timeouts"]
    assert list(nat["timeouts"]) == CONN_STATE_NAMES
    # dump's nat, sent back, is the same configuration.
    before = snapshot(c)
    c.call("set_nat", **nat)
    assert snapshot(c) == before
    # The bounds themselves are accepted.
    bounds = {"snat_addrs": [bytes([1 if i == 0 else 223, 255, i, 254]) for i in range(16)],
              "snat_port_min": 65535, "snat_port_max": 65535, "on_backend_down": 0,
              "timeouts": {n: 2**31 - 1 if i % 2 else 1 for i, n in enumerate(CONN_STATE_NAMES)}}
    c.call("set_nat", **bounds)
    assert c.call("dump")["nat"] == bounds
    c.call("set_nat", snat_port_min=1, snat_port_max=1)
    # The request is the whole configuration: no field, the defaults.
    c.call("set_nat")
    assert c.call("dump")["nat"] == NAT_DEFAULT


@needs_root
def test_snat_rule(configured: Client) -> None:
    """A VIP with snat needs a SNAT address; the pool cannot be emptied under it."""
    c = configured
    nat_or_skip(c)
    key = {"addr": bytes([10, 0, 0, 20]), "port": 80, "proto": 6}
    nat_vip = {"vip_id": 20, **key, "mode": 1}
    ring = [i % NBACKENDS for i in range(RING_SIZE)]
    # A NAT VIP without SNAT needs no pool; its ring travels with it.
    c.call("set_vip", **nat_vip, nat_port=8080, slots=ring_bytes(ring))
    assert c.call("get_ring", vip_id=20)["slots"] == ring_bytes(ring)
    r = c.req({**V, "op": "set_vip", **nat_vip, "snat": True})
    assert not r["ok"] and "field 'snat': no SNAT pool configured (set_nat)" in r["error"]
    c.call("set_nat", snat_addrs=POOL[:1])
    c.call("set_vip", **nat_vip, snat=True)
    vips = {v["vip_id"]: v for v in c.call("dump")["vips"]}
    assert vips[20] == {**nat_vip, "nat_port": 0, "snat": True}
    for emptying in ({}, {"snat_addrs": []}, {"snat_port_min": 2000}):
        r = c.req({**SET_NAT, **emptying})
        assert not r["ok"] and "field 'snat_addrs': VIP 20 uses SNAT" in r["error"], r
    assert c.call("dump")["nat"]["snat_addrs"] == POOL[:1]
    c.call("set_nat", snat_addrs=POOL[1:])  # another pool is fine
    c.call("set_vip", **nat_vip)  # without snat: the pool may go
    assert {v["vip_id"]: v for v in c.call("dump")["vips"]}[20]["snat"] is False
    c.call("set_nat")
    # ...and so it may once the VIP is gone.
    c.call("set_nat", snat_addrs=POOL)
    c.call("set_vip", **nat_vip, snat=True)
    c.call("del_vip", **key)
    c.call("set_nat")
    assert c.call("dump")["nat"] == NAT_DEFAULT


@needs_root
def test_stats_conns(configured: Client) -> None:
    h = nat_or_skip(configured)
    conns = configured.call("stats")["conns"]
    assert list(conns) == ["capacity", "entries", "by_state", "snat_ports_in_use", "expired"]
    assert list(conns["by_state"]) == CONN_STATE_NAMES
    values = [conns[k] for k in ("capacity", "entries", "snat_ports_in_use", "expired")]
    assert all(isinstance(v, int) and v >= 0 for v in [*values, *conns["by_state"].values()])
    # One table per family with "nat6", each of conn_table_size entries.
    assert conns["capacity"] == h["conn_table_size"] * (2 if "nat6" in h["capabilities"] else 1)
    assert conns["entries"] <= conns["capacity"]


@needs_root
def test_push_with_nat(configured: Client, daemon: Daemon) -> None:
    """client.py and push.py against the real server: a NAT configuration and a
    SNAT VIP pushed, read back equal by fetch_tables, then taken away again.
    With "nat6" also an IPv6 SNAT VIP, the pool given IPv6 first (read back
    IPv4 first, and no change for the next push)."""
    nat6 = "nat6" in nat_or_skip(configured)["capabilities"]
    client = DataplaneClient(daemon.endpoint, timeout_s=10.0)
    try:
        held = fetch_tables(client)
        assert held.nat == NatConfig()
        desired = fetch_tables(client)
        timeouts = list(desired.nat.timeouts_s)
        timeouts[2] = 7200
        pool = ("2001:db8::9",) * nat6 + ("198.51.100.9",)
        desired.nat = NatConfig(snat_addrs=tuple(ipaddress.ip_address(a) for a in pool),
                                snat_port_min=30000, snat_port_max=30999,
                                on_backend_down=NatDown.DROP, timeouts_s=tuple(timeouts))
        snat_vip = Vip(vip_id=21, addr=ipaddress.IPv4Address("10.0.0.21"), port=443, proto=6,
                       mode=VipMode.NAT, nat_port=8443, snat=True)
        desired.vips[21] = snat_vip
        desired.rings[21] = np.full(RING_SIZE, 1, dtype=np.uint32)
        if nat6:
            desired.vips[23] = Vip(vip_id=23, addr=ipaddress.IPv6Address("fd00::23"), port=443,
                                   proto=6, mode=VipMode.NAT, nat_port=8443, snat=True)
            desired.rings[23] = np.full(RING_SIZE, 2, dtype=np.uint32)
        report = push_tables(client, held, desired)
        assert report.nat_set and report.vips_set == 1 + nat6
        back = fetch_tables(client)
        assert back.nat.snat_addrs == snat_order(desired.nat.snat_addrs)
        assert back.nat == dataclasses.replace(desired.nat, snat_addrs=back.nat.snat_addrs)
        assert back.vips == desired.vips
        assert push_tables(client, back, desired).summary().startswith("nat=same key=same")
        push_tables(client, back, held)  # the VIP goes first, then the pool
        assert fetch_tables(client).nat == NatConfig()
    finally:
        client.close()


# --- tunnel mode -----------------------------------------------------------------
# Against a data plane whose hello lists "tunnel"; one without it must refuse
# every tunnel VIP as an unsupported mode instead (checked, not skipped).

TUNNEL_VIP = {**GOOD_VIP, "mode": 2, "tunnel_src": bytes([192, 0, 2, 1])}
SRC6 = bytes.fromhex("fd0000000000000000000000000000aa")  # fd00::aa

# What a data plane with tunnel mode refuses: the rules in PROTOCOL.md's order.
TUNNEL_BAD: list[tuple[Any, str]] = [
    ({**TUNNEL_VIP, "gue_port": 6080},
     "field 'gue_port': only GUE (tunnel_encap 1) has a UDP port, tunnel_encap is 0 (ipip)"),
    ({**TUNNEL_VIP, "tunnel_encap": 0, "gue_port": 6080}, "field 'gue_port': only GUE"),
    # gue_port's rule comes before tunnel_src's
    (_without({**TUNNEL_VIP, "gue_port": 6080}, "tunnel_src"), "field 'gue_port': only GUE"),
    (_without(TUNNEL_VIP, "tunnel_src"),
     "field 'tunnel_src': tunnel mode (2) needs an outer source address"),
    (_without({**TUNNEL_VIP, "tunnel_encap": 1, "snat": True}, "tunnel_src"),
     "field 'tunnel_src': tunnel mode (2) needs an outer source address"),
    ({**TUNNEL_VIP, "addr": VIP6_ADDR},
     "field 'tunnel_src': an IPv6 VIP is tunnelled in IPv6 only (IPv6 inside IPv4 is not "
     "carried), 'tunnel_src' is IPv4"),
    ({**TUNNEL_VIP, "nat_port": 8080},
     "field 'nat_port': only a NAT VIP (mode 1) takes a backend port, field 'mode' is 2"),
    ({**TUNNEL_VIP, "snat": True},
     "field 'snat': only a NAT VIP (mode 1) takes SNAT, field 'mode' is 2"),
    # the IPv6 NAT rule comes before the tunnel fields' mode rule (a plane with
    # "nat6" has none: test_rejected_tunnel expects the tunnel field's error there)
    ({**GOOD_VIP, "mode": 1, "addr": VIP6_ADDR, "tunnel_encap": 1},
     "field 'mode': NAT mode (1) is IPv4 only"),
]


@needs_root
@pytest.mark.parametrize(("request_", "needle"), TUNNEL_BAD,
                         ids=[f"tunnel_bad{i}" for i in range(len(TUNNEL_BAD))])
def test_rejected_tunnel(configured: Client, daemon: Daemon, request_: Any, needle: str) -> None:
    if not has_tunnel(configured) and request_["mode"] == 2:
        needle = "mode not supported by this data plane: field 'mode' is 2, only 0 (dsr)"
    if needle.startswith("field 'mode': NAT mode (1) is IPv4 only") and has_nat6(configured):
        needle = "field 'tunnel_encap': only a tunnel VIP (mode 2) takes it, field 'mode' is 1"
    assert_rejected(configured, daemon, request_, needle)


@needs_root
def test_tunnel_vips_round_trip(configured: Client, daemon: Daemon) -> None:
    """Tunnel VIPs (IPIP over IPv4, GUE 4-in-6 on the default port, IPv6 GUE
    on a given port) stored, dumped with their tunnel fields, the same when
    sent back, and plain DSR again once re-set without them. A data plane
    without tunnel mode refuses them all and changes nothing."""
    c = configured
    ipip = {"vip_id": 30, "addr": bytes([10, 0, 0, 30]), "port": 80, "proto": 6, "mode": 2,
            "tunnel_src": bytes([192, 0, 2, 1])}
    gue46 = {"vip_id": 31, "addr": bytes([10, 0, 0, 31]), "port": 80, "proto": 17, "mode": 2,
             "tunnel_src": SRC6, "tunnel_encap": 1, "tunnel_src_bits": 8}
    gue6 = {"vip_id": 32, "addr": VIP6_ADDR, "port": 443, "proto": 6, "mode": 2,
            "tunnel_src": SRC6, "tunnel_encap": 1, "gue_port": 5555, "tunnel_src_bits": 16}
    before = snapshot(c)
    if not has_tunnel(c):
        for vip in (ipip, gue46, gue6):
            r = c.req({**V, "op": "set_vip", **vip})
            assert not r["ok"] and "mode not supported by this data plane" in r["error"], r
        assert snapshot(c) == before
        return
    c.call("set_vip", **ipip, nat_port=0, slots=ring_bytes([1] * RING_SIZE))
    c.call("set_vip", **gue46)
    c.call("set_vip", **gue6)
    vips = {v["vip_id"]: v for v in c.call("dump")["vips"]}
    common = {"nat_port": 0, "snat": False}
    assert vips[30] == {**ipip, **common, "tunnel_encap": 0, "tunnel_src_bits": 0}
    assert vips[31] == {**gue46, **common, "gue_port": 6080}
    assert vips[32] == {**gue6, **common}
    assert "tunnel_encap" not in vips[VIP_ID]  # a DSR VIP has no tunnel fields
    assert c.call("get_ring", vip_id=30)["slots"] == ring_bytes([1] * RING_SIZE)
    if daemon.kind == "xdp" and shutil.which("bpftool"):
        out = subprocess.run(["bpftool", "-j", "map", "dump", "pinned",
                              str(daemon.pin_dir / "vip_map")],
                             check=True, capture_output=True, text=True).stdout
        assert len(json.loads(out)) == 4
    # Each dumped VIP sent back is the same VIP.
    held = snapshot(c)
    for vip in vips.values():
        c.call("set_vip", **vip)
    assert snapshot(c) == held
    # Re-set without the tunnel fields as DSR: they go.
    plain = {k: v for k, v in gue46.items() if k not in ("tunnel_encap", "tunnel_src_bits")}
    c.call("set_vip", **{**plain, "mode": 0})
    dsr = {v["vip_id"]: v for v in c.call("dump")["vips"]}[31]
    assert dsr == {**common, "vip_id": 31, "addr": gue46["addr"], "port": 80, "proto": 17,
                   "mode": 0, "tunnel_src": SRC6}
    for vip in (ipip, gue46, gue6):
        c.call("del_vip", addr=vip["addr"], port=vip["port"], proto=vip["proto"])
    assert snapshot(c) == before


@needs_root
def test_push_with_tunnel(configured: Client, daemon: Daemon) -> None:
    """client.py and push.py against the real server: tunnel VIPs pushed, read
    back equal by fetch_tables, a changed GUE port re-set, then taken away; a
    data plane without tunnel mode gets a DataplaneError before any change."""
    from hpclb.contract.tables import GUE_PORT_DEFAULT, Encap
    from hpclb.dataplane.client import DataplaneError
    from hpclb.dataplane.push import held_form

    client = DataplaneClient(daemon.endpoint, timeout_s=10.0)
    try:
        held = fetch_tables(client)
        desired = fetch_tables(client)
        desired.vips[33] = Vip(vip_id=33, addr=ipaddress.IPv4Address("10.0.0.33"), port=80,
                               proto=6, mode=VipMode.TUNNEL,
                               tunnel_src=ipaddress.IPv4Address("192.0.2.7"),
                               tunnel_encap=Encap.IPIP, tunnel_src_bits=6)
        desired.vips[34] = Vip(vip_id=34, addr=ipaddress.IPv6Address("fd00::34"), port=443,
                               proto=17, mode=VipMode.TUNNEL,
                               tunnel_src=ipaddress.IPv6Address("fd00::aa"),
                               tunnel_encap=Encap.GUE, gue_port=0, tunnel_src_bits=16)
        for vid in (33, 34):
            desired.rings[vid] = np.full(RING_SIZE, 2, dtype=np.uint32)
        if not has_tunnel(configured):
            with pytest.raises(DataplaneError, match=r"VIPs \[33, 34\] use tunnel mode"):
                push_tables(client, held, desired)
            assert fetch_tables(client).vips == held.vips
            return
        report = push_tables(client, held, desired)
        assert report.vips_set == 2
        back = fetch_tables(client)
        assert back.vips[33] == desired.vips[33]
        assert back.vips[34].gue_port == GUE_PORT_DEFAULT
        assert back.vips == {k: held_form(v) for k, v in desired.vips.items()}
        assert push_tables(client, back, desired).vips_set == 0
        desired.vips[34] = dataclasses.replace(desired.vips[34], gue_port=4789)
        assert push_tables(client, back, desired).vips_set == 1
        assert fetch_tables(client).vips[34].gue_port == 4789
        push_tables(client, None, held)
        assert fetch_tables(client).vips == held.vips
    finally:
        client.close()


@needs_root
def test_duplicate_key(configured: Client) -> None:
    # {"v":2,"op":"hello","v":2}: msgpack allows it, the server must not guess.
    raw = b"\x83" + msgpack.packb("v") + b"\x02" + msgpack.packb("op") + msgpack.packb(
        "hello") + msgpack.packb("v") + b"\x02"
    reply = configured.raw(raw)
    assert not reply["ok"] and "field 'v' given twice" in reply["error"]


@needs_root
def test_structurally_bad(configured: Client, daemon: Daemon) -> None:
    before = snapshot(configured)
    good = msgpack.packb({**V, "op": "hello"})
    cases: list[tuple[bytes, str]] = [
        (b"", "empty message"),
        (good + b"\x00", "trailing bytes"),
        (b"\xc1", "invalid byte 0xc1"),
        (b"\x91" * 40 + b"\x90", "nests deeper"),
        (b"\xdd\xff\xff\xff\xff", "truncated"),        # array of 2^32-1, nothing after
        (b"\xdf\x7f\xff\xff\xff" + b"\x00" * 64, "truncated"),  # huge map, few bytes
        (b"\xc6\xff\xff\xff\xff" + b"\x00" * 16, "truncated"),  # bin32 claiming 4 GiB
    ]
    for raw, needle in cases:
        reply = configured.raw(raw)
        assert not reply["ok"] and needle in reply["error"], (raw[:16], reply)
    daemon.assert_alive()
    assert snapshot(configured) == before


@needs_root
def test_truncated(configured: Client, daemon: Daemon) -> None:
    before = snapshot(configured)
    msgs = [GOOD_VIP, GOOD_BACKENDS, {**V, "op": "set_config", "hash_key": bytes(16)},
            {**V, "op": "patch_ring", "vip_id": VIP_ID, "patch": struct.pack("<2I", 1, 1)}]
    for m in msgs:
        raw = msgpack.packb(m)
        for n in range(1, len(raw)):
            reply = configured.raw(raw[:n])
            assert not reply["ok"] and "truncated" in reply["error"], (m, n, reply)
    # A full-ring message cut short somewhere in its slots.
    raw = msgpack.packb({**V, "op": "set_ring", "vip_id": VIP_ID,
                         "slots": ring_bytes([1] * RING_SIZE)})
    for n in (len(raw) - 1, len(raw) // 2, 40):
        reply = configured.raw(raw[:n])
        assert not reply["ok"] and "truncated" in reply["error"], reply
    daemon.assert_alive()
    assert snapshot(configured) == before


@needs_root
def test_oversized(configured: Client, daemon: Daemon) -> None:
    before = snapshot(configured)
    # A well-formed request, one byte over the limit: refused on size alone.
    # (the pad's bin header grows from 2 to 5 bytes)
    pad = MAX_MSG_BYTES + 1 - len(msgpack.packb({**V, "op": "hello", "pad": b""})) - 3
    raw = msgpack.packb({**V, "op": "hello", "pad": bytes(pad)})
    assert len(raw) == MAX_MSG_BYTES + 1
    reply = configured.raw(raw)
    assert not reply["ok"] and "exceeds the limit" in reply["error"], reply
    daemon.assert_alive()
    assert snapshot(configured) == before


@needs_root
def test_multipart(configured: Client) -> None:
    reply = configured.raw([msgpack.packb({**V, "op": "hello"}), b"more"])
    assert not reply["ok"] and "multi-part" in reply["error"]
    assert configured.call("hello")["ok"]


@needs_root
def test_random_bytes(configured: Client, daemon: Daemon) -> None:
    before = snapshot(configured)
    rng = random.Random(20240531)
    for i in range(300):
        n = rng.choice([1, 2, 3, 5, 8, 16, 64, 256, 4096])
        raw = bytes(rng.randrange(256) for _ in range(n))
        if i % 3 == 0:  # start like a map, so the fuzz gets past the first byte
            raw = bytes([0x80 | rng.randrange(16)]) + raw
        reply = configured.raw(raw)
        assert not reply["ok"], (raw[:32], reply)
    daemon.assert_alive()
    assert snapshot(configured) == before


@needs_root
def test_mutated_requests(configured: Client, daemon: Daemon) -> None:
    """Valid requests with bytes flipped: whatever they turn into, every reply
    is well formed (Client.raw checks it) and the daemon stays up."""
    rng = random.Random(4242)
    seeds = [GOOD_VIP, GOOD_BACKENDS, {**V, "op": "hello"}, {**V, "op": "dump"},
             {**V, "op": "get_ring", "vip_id": VIP_ID}, {**V, "op": "set_backend_state",
                                                         "id": 1, "state": 2},
             {**V, "op": "patch_ring", "vip_id": VIP_ID, "patch": struct.pack("<4I", 1, 1, 2, 2)},
             {**V, "op": "set_nat", "snat_addrs": POOL, "snat_port_min": 2000,
              "timeouts": {"established": 60}},
             {**NAT_VIP, "snat": True}, {**V, "op": "stats"}]
    for _ in range(300):
        raw = bytearray(msgpack.packb(rng.choice(seeds)))
        for _ in range(rng.randrange(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        configured.raw(bytes(raw))
    daemon.assert_alive()
    assert configured.call("hello")["ok"]


@needs_root
def test_no_partial_apply(configured: Client) -> None:
    """The last backend is bad: none of the earlier ones may have been written."""
    before = snapshot(configured)
    bad = [backend(i, state=2) for i in range(NBACKENDS)] + [{**backend(30), "state": 7}]
    reply = configured.req({**V, "op": "set_backends", "backends": bad})
    assert not reply["ok"] and "backends[10].state" in reply["error"]
    assert snapshot(configured) == before


# --- the client against a peer of another version (no root) ----------------


@pytest.mark.parametrize("answer_ok", [False, True])
def test_client_refuses_a_peer_of_another_version(tmp_path: Path, answer_ok: bool) -> None:
    """A fake REP peer speaking version 1: hello raises a DataplaneError that
    says which versions meet and what to do, whether the old peer refuses the
    request (what a real version-1 data plane does) or answers it."""
    from hpclb.dataplane.client import DataplaneError

    endpoint = f"ipc://{tmp_path}/old.sock"
    ctx = zmq.Context()
    rep: zmq.Socket[bytes] = ctx.socket(zmq.REP)
    rep.setsockopt(zmq.LINGER, 0)
    rep.bind(endpoint)
    client = DataplaneClient(endpoint, timeout_s=5.0)
    try:
        import threading

        def serve() -> None:
            request = msgpack.unpackb(rep.recv(), raw=False)
            reply: dict[str, Any] = {"v": 1, "ok": answer_ok, "seq": request.get("seq")}
            if answer_ok:
                reply.update(dataplane="xdp", version=1)
            else:
                reply["error"] = ("field 'v': protocol version 2 not supported (this data "
                                  "plane speaks 1)")
            rep.send(msgpack.packb(reply, use_bin_type=True))

        thread = threading.Thread(target=serve)
        thread.start()
        with pytest.raises(DataplaneError) as info:
            client.hello()
        thread.join(timeout=10)
        assert str(info.value) == (
            "data plane speaks table protocol version 1, this control plane speaks 2: "
            "install matching builds (./bootstrap)")
    finally:
        client.close()
        rep.close(linger=0)
        ctx.term()
