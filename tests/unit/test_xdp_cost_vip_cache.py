"""lb_xdp's per-CPU IPv4 VIP cache (lb.bpf.c, vip4_lookup), made for the flow-hit
cost hpclb.lab.xdp_cost measures, changes no verdict: through the daemon's own
pinned program (BPF_PROG_TEST_RUN), every frame of many VIPs, more than the
cache has slots (so that slots collide), reaches its own VIP's backend in any
order, and a VIP deleted, re-added in another mode or added where a frame was
already passed as no VIP's takes effect at the next frame."""

from __future__ import annotations

import ipaddress
import os
import random
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from hpclb.contract.tables import IPPROTO_UDP, Backend, Vip, VipMode
from hpclb.dataplane.supervisor import DataplaneProcess, find_xdp_daemon

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root: network namespaces and XDP")

VIPS = 60  # LB_MAX_VIPS is 64, the cache 64 slots: collisions are certain


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"hlbc-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)
        shutil.rmtree(f"/sys/fs/bpf/hpclb/test-{name}", ignore_errors=True)


def _mac(bid: int) -> str:
    return f"02:00:00:00:{bid >> 8:02x}:{bid & 0xFF:02x}"


def test_vip_cache_changes_no_verdict(netns: str, tmp_path: Path) -> None:
    from scapy.layers.inet import IP, UDP
    from scapy.layers.l2 import Ether

    from hpclb.lab.bpf_testrun import PinnedXdpProgram

    subprocess.run(["ip", "-n", netns, "link", "add", "va", "type", "veth", "peer", "name",
                    "vb"], check=True)
    endpoint = f"ipc://{tmp_path}/dp.sock"
    dataplane = DataplaneProcess(
        argv=[find_xdp_daemon(), "--netns", netns, "--iface", "va", "--socket", endpoint,
              "--pin-dir", f"/sys/fs/bpf/hpclb/test-{netns}", "--no-attach"],
        endpoint=endpoint, pidfile=tmp_path / "hpclb-xdp.pid",
        log_path=tmp_path / "hpclb-xdp.log")
    dataplane.start()
    client = dataplane.client
    prog = PinnedXdpProgram(f"/sys/fs/bpf/hpclb/test-{netns}/lb_xdp")
    try:
        hello = client.hello()
        ring_size = int(hello["ring_size"])
        port_mac = ":".join(f"{b:02x}" for b in bytes(hello["ports"][0]["mac"]))
        client.set_config(bytes(range(16)))
        client.set_backends([Backend(bid, ipaddress.IPv4Address(f"10.2.{bid >> 8}.{bid & 255}"),
                                     _mac(bid)) for bid in range(1, VIPS + 2)])

        def vip(i: int, mode: VipMode = VipMode.DSR, **kw: object) -> Vip:
            return Vip(i, ipaddress.IPv4Address(f"198.18.{7 + i // 200}.{i % 200 + 1}"), 53,
                       IPPROTO_UDP, mode, **kw)  # type: ignore[arg-type]

        def frame(i: int, sport: int = 4000) -> bytes:
            return bytes(Ether(src="02:aa:00:00:00:01", dst=port_mac)
                         / IP(src="10.99.0.1", dst=str(vip(i).addr))
                         / UDP(sport=sport, dport=53) / bytes(18))

        for i in range(VIPS):
            client.set_vip(vip(i), np.full(ring_size, i + 1, dtype=np.uint32))
        order = [i for i in range(VIPS) for _ in range(3)]
        random.Random(5).shuffle(order)
        for i in order:
            action, out = prog.run(frame(i))
            assert (action, out[:6]) == ("tx", bytes.fromhex(_mac(i + 1).replace(":", ""))), i

        # Deleted: the next frame is the kernel's, not the cached VIP's.
        client.del_vip(vip(3).addr, 53, IPPROTO_UDP)
        assert prog.run(frame(3, 4001))[0] == "pass"
        # Re-added as a tunnel VIP: the next frame is encapsulated.
        client.set_vip(vip(3, VipMode.TUNNEL, tunnel_src=ipaddress.IPv4Address("172.16.0.1")),
                       np.full(ring_size, VIPS + 1, dtype=np.uint32))
        action, out = prog.run(frame(3, 4002))
        assert action == "tx" and len(out) == len(frame(3)) + 20  # IPIP's outer header
        # A frame passed as no VIP's (a negative answer cached), then its VIP added.
        assert prog.run(frame(VIPS))[0] == "pass"
        client.set_vip(vip(VIPS), np.full(ring_size, 1, dtype=np.uint32))
        assert prog.run(frame(VIPS))[1][:6] == bytes.fromhex(_mac(1).replace(":", ""))
    finally:
        prog.close()
        dataplane.stop()
