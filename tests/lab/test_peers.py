"""The peers of the bench on the one-arm DSR lab: nftables DNAT really forwards VIP
traffic to the backends (IPv4 and IPv6), jhash keeps a flow on one backend, stop()
leaves nothing behind; HAProxy in TCP mode proxies to every backend and stops
cleanly; the connection-rate measurement returns a well-formed result; IPVS says why
it cannot run. Never a speed assertion."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from hpclb.lab.appliance import LAB_PORT, LAB_VIP, LAB_VIP6
from hpclb.lab.kernel_nat import nft_missing
from hpclb.lab.peers import (
    HaproxyTcp,
    Ipvs,
    NftablesDnat,
    SubjectUnavailable,
    compare_connection_rates,
    haproxy_missing,
    ipvs_missing,
    measure_connection_rate,
)
from hpclb.lab.topology import Lab, default_pass_obj

pytestmark = pytest.mark.root

if os.geteuid() != 0:
    pytest.skip("lab tests need root (network namespaces, veth, XDP)", allow_module_level=True)

# From the client: one datagram per (source port, repeat) to the VIP on an unbound
# socket, so that the answers the backends send from their own addresses (DNAT
# without SNAT: they answer the client directly) are received; prints
# {sport: [[answering address, name], ...]}.
UDP_PROBE = """
import json, socket, sys
vip, port, first, count, repeat = sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:6])
fam = socket.AF_INET6 if ":" in vip else socket.AF_INET
out = {}
for sport in range(first, first + count):
    with socket.socket(fam, socket.SOCK_DGRAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("::" if fam == socket.AF_INET6 else "0.0.0.0", sport))
        s.settimeout(2)
        got = []
        for _ in range(repeat):
            s.sendto(b"who\\n", (vip, port))
            try:
                data, addr = s.recvfrom(256)
                got.append([addr[0], data.decode().strip()])
            except OSError as err:
                got.append(["", type(err).__name__])
        out[sport] = got
print(json.dumps(out))
"""


def _probe(lab: Lab, vip: str, first: int, count: int, repeat: int = 1) -> dict[str, list]:
    res = lab.exec("cli", [sys.executable, "-c", UDP_PROBE, vip, str(LAB_PORT), str(first),
                           str(count), str(repeat)], timeout=120)
    return dict(json.loads(res.stdout))


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    # XDP_PASS on the appliance's peer (not the bench's sink): the frames must reach
    # the backends.
    with Lab(prefix=f"q{uuid.uuid4().hex[:6]}", backends=3, ipv6=True,
             peer_xdp_pass=default_pass_obj()) as lab:
        lab.start_backends(LAB_PORT, udp=True)
        yield lab


@pytest.fixture
def need_nft() -> None:
    if (reason := nft_missing()) is not None:
        pytest.skip(reason)


def _lb_state(lab: Lab) -> dict[str, str]:
    """What the nftables subject may touch in the appliance namespace."""
    return {
        "ruleset": lab.exec("lb", ["nft", "list", "ruleset"]).stdout,
        "neigh": lab.exec("lb", ["ip", "neigh", "show", "nud", "permanent"]).stdout,
        "sysctls": lab.exec("lb", ["sysctl", "net.ipv4.ip_forward",
                                   "net.ipv6.conf.all.forwarding",
                                   "net.ipv6.conf.eth0.forwarding",
                                   "net.ipv4.conf.all.send_redirects",
                                   "net.ipv4.conf.eth0.send_redirects"]).stdout,
        "xdp": "xdp" if "prog/xdp" in lab.exec(
            "lb", ["ip", "-d", "link", "show", "dev", "eth0"]).stdout else "none",
    }


def _backend_of(lab: Lab, family: int) -> dict[str, str]:
    """{backend address: name} of the lab's backends."""
    return {(lab.ip6_of(f"b{i}") if family == 6 else lab.backend_ip(i)): f"b{i}"
            for i in range(1, lab.backends + 1)}


@pytest.mark.parametrize("family", [4, 6])
def test_nftables_dnat_forwards_vip_traffic_to_every_backend(
        lab: Lab, need_nft: None, family: int) -> None:
    vip = LAB_VIP6 if family == 6 else LAB_VIP
    before = _lb_state(lab)
    subject = NftablesDnat(lab, "random", family=family)
    subject.start()
    try:
        assert _lb_state(lab)["xdp"] == "xdp"  # the offered counter's program
        flows = _probe(lab, vip, 20000, 30)
        backends = _backend_of(lab, family)
        answers = [a for got in flows.values() for a in got]
        # Every datagram answered by a backend, from its own address (it was
        # DNATed to it), naming itself.
        assert all(backends.get(addr) == name for addr, name in answers), answers
        assert {name for _, name in answers} == {"b1", "b2", "b3"}
        counters = subject.counters()
        assert counters["dnat"] == 30 and counters["conntrack_entries"] >= 30
        conditions = subject.conditions()
        assert conditions["family"] == f"IPv{family}" and "dnat to numgen" in conditions[
            "ruleset"]
    finally:
        subject.stop()
    assert _lb_state(lab) == before
    # And without it the appliance no longer forwards: the VIP is its own again.
    again = _probe(lab, vip, 20000, 3)
    assert all(addr == "" for got in again.values() for addr, _ in got), again


def test_jhash_keeps_a_flow_on_one_backend(lab: Lab, need_nft: None) -> None:
    with NftablesDnat(lab, "jhash") as subject:
        flows = _probe(lab, LAB_VIP, 21000, 12, repeat=5)
        assert subject.name == "nftables_dnat_jhash"
    for sport, got in flows.items():
        assert len({name for _, name in got}) == 1, (sport, got)
    first = {sport: got[0][1] for sport, got in flows.items()}
    assert len(set(first.values())) >= 2  # 12 flows over 3 backends
    # The hash has a fixed seed: the same flows land on the same backends again,
    # with a fresh conntrack table.
    with NftablesDnat(lab, "jhash"):
        again = _probe(lab, LAB_VIP, 21000, 12)
    assert {sport: got[0][1] for sport, got in again.items()} == first


def test_nftables_stop_removes_what_start_added(lab: Lab, need_nft: None) -> None:
    before = _lb_state(lab)
    for subject in (NftablesDnat(lab, "random"), NftablesDnat(lab, "jhash", family=6),
                    NftablesDnat(lab, "random", masquerade=True)):
        subject.start()
        during = _lb_state(lab)
        assert "hpclb_kernel_nat" in during["ruleset"] and during["neigh"] != before["neigh"]
        subject.stop()
        assert _lb_state(lab) == before, subject.name
        subject.stop()  # twice is harmless


def test_haproxy_proxies_to_every_backend_and_stops(lab: Lab) -> None:
    if (reason := haproxy_missing()) is not None:
        pytest.skip(reason)
    subject = HaproxyTcp(lab)
    subject.start()
    try:
        report = lab.run_client(LAB_VIP, LAB_PORT, connections=30, concurrency=1)
        assert report["failures"] == 0, report
        assert report["counts"] == {"b1": 10, "b2": 10, "b3": 10}  # round robin
        assert "mode tcp" in subject.conditions()["config"]
    finally:
        subject.stop()
    res = lab.exec("lb", ["ss", "-Hltn", f"sport = :{LAB_PORT}"])
    assert res.stdout.strip() == ""
    assert subprocess.run(["pgrep", "-f", "hpclb-haproxy-"], capture_output=True,
                          check=False).returncode != 0
    gone = lab.run_client(LAB_VIP, LAB_PORT, connections=2, concurrency=1, timeout=1.0)
    assert gone["failures"] == 2


def test_connection_rate_is_well_formed(lab: Lab) -> None:
    if (reason := haproxy_missing()) is not None:
        pytest.skip(reason)
    with HaproxyTcp(lab):
        row = measure_connection_rate(lab, 1.0, processes=2)
    assert row["processes_reported"] == 2 and row["connections"] > 0
    assert row["cps"] > 0 and row["failed"] == 0, row
    assert row["host_cpu_us_per_connection"] > 0
    assert set(row["backends"]) == {"b1", "b2", "b3"}
    for key in ("latency_connect", "latency_name_line"):
        p = row[key]
        assert p["min_us"] <= p["p50_us"] <= p["p99_us"] <= p["p999_us"] <= p["max_us"]
    json.dumps(row)


def test_comparison_reports_direct_and_unavailable_subjects(lab: Lab) -> None:
    rows = compare_connection_rates(lab, 1.0, [Ipvs(lab)], processes=1)
    assert rows["direct"]["connections"] > 0
    assert set(rows["direct"]["backends"]) == {"b1", "b2", "b3"}
    if ipvs_missing() is not None:
        assert "has no IPVS" in rows["ipvs"]["unavailable"]


def test_ipvs_says_why(lab: Lab) -> None:
    reason = ipvs_missing()
    if reason is None:
        pytest.skip("this kernel has IPVS")
    with pytest.raises(SubjectUnavailable, match="has no IPVS"):
        Ipvs(lab).start()


def test_haproxy_cpu_is_attributed(lab: Lab) -> None:
    if (reason := haproxy_missing()) is not None:
        pytest.skip(reason)
    rows = compare_connection_rates(lab, 1.0, [HaproxyTcp(lab)], processes=1)
    row = rows["haproxy_tcp"]
    assert row["connections"] > 0 and row["process_cpu_us_per_connection"] >= 0
    assert "marginal_host_cpu_us_per_connection" in row and "ratio_to_direct" in row


def test_lab_teardown_takes_running_peers_with_it(need_nft: None) -> None:
    """A run that dies without stop(): the lab's teardown still ends HAProxy and
    the namespace (and with it the table, the sysctls, the neighbours) goes."""
    if (reason := haproxy_missing()) is not None:
        pytest.skip(reason)
    prefix = f"q{uuid.uuid4().hex[:6]}"
    with Lab(prefix=prefix, backends=3) as lab:
        haproxy = HaproxyTcp(lab)
        haproxy.start()
        NftablesDnat(lab, "jhash").start()
        pid = haproxy._proc.pid if haproxy._proc is not None else -1
    assert Lab.existing_namespaces(prefix) == []
    assert not os.path.exists(f"/proc/{pid}")
