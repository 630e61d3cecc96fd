"""`hpclb bench --mode nat`: forwarding rate of NAT gateway mode on the two-network
lab (``hpclb.lab.gateway``), against the kernel doing the same job.

Same lab, same generator as `hpclb bench` (64-byte UDP frames from trafgen in the
client namespace, one flow per source port), kinds interleaved in each trial:

  * ``route``: the frames go to backend 1's own address and the appliance's kernel
    routes them (ip_forward, no NAT, no conntrack): the kernel path's ceiling;
  * ``nftables``: the kernel's NAT, nftables DNAT + conntrack
    (``hpclb.lab.kernel_nat``, numgen random over the backends): the baseline;
  * ``nftables_masq``: the same with masquerade (SNAT to the appliance's
    cluster-side address);
  * ``xdp``, ``dpdk``: the real appliance (`hpclb run`) with VIPs in ``mode: nat``,
    when this build's configuration and data plane take it (else they are listed
    under ``skipped`` in the JSON with the reason, and the kernel's figures stand
    alone).

Frames to the VIP enter the appliance's client-side ``eth0`` and leave, translated,
out of its cluster-side ``eth1``; an XDP_DROP program on ``eth1``'s bridge-side peer
(``v-lb1``) counts them where they land, so the backends cost nothing (and answer
nothing: the measurement is one way, as `hpclb bench`'s). The appliance knows the
backends' MACs without ARP (static neighbours for the kernel, ``mac:`` in the
configuration for hpclb), since the sink drops ARP too. Offered frames are those the
client's ``eth0`` sent (its tx counter), so that every kind is counted the same way
whether or not an XDP program sits on the appliance's ``eth0``: a frame lost in the
bridge, the appliance's backlog, conntrack or a data plane is lost.

Before each kind's trials its state is made fresh (conntrack flushed) and every flow
is sent once at a modest rate (the warm-up), so that the trials measure established
flows, not connection set-up. The no-drop rate (NDR) is searched as in `hpclb bench`.
A measurement, never a test assertion.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from hpclb.host import install
from hpclb.lab.appliance import LAB_PORT, LAB_VIP, LabAppliance, LabApplianceError
from hpclb.lab.bench import (
    ndr_search,
    run_generator,
    write_trafgen_config,
    xdp_packets,
)
from hpclb.lab.gateway import CLUSTER_ETH, GatewayLab
from hpclb.lab.kernel_nat import (
    install_kernel_nat,
    nat_for_lab,
    nft_missing,
    remove_kernel_nat,
)
from hpclb.lab.topology import LabError

KERNEL_KINDS: tuple[str, ...] = ("route", "nftables", "nftables_masq")
PLANE_KINDS: tuple[str, ...] = ("xdp", "dpdk")
ALL_KINDS = KERNEL_KINDS + PLANE_KINDS
WARMUP_PPS = 50_000
WEIGHTS = {"b1": 1.0, "b2": 1.0, "b3": 1.0}


def client_tx_packets(lab: GatewayLab) -> int:
    """Frames the client's eth0 has sent (what trafgen offered)."""
    out = lab.exec("cli", ["ip", "-j", "-s", "link", "show", "dev", "eth0"]).stdout
    return int(json.loads(out)[0]["stats64"]["tx"]["packets"])


def static_neighbours(lab: GatewayLab) -> None:
    """The backends' MACs as permanent neighbours of the appliance's eth1: the
    sink on v-lb1 drops ARP, so the kernel could not resolve them."""
    for i in range(1, lab.backends + 1):
        lab.exec("lb", ["ip", "neigh", "replace", lab.backend_ip(i), "lladdr",
                        lab.mac(f"b{i}"), "dev", CLUSTER_ETH, "nud", "permanent"])


def conntrack_count(lab: GatewayLab) -> int:
    """Entries in the appliance's conntrack table."""
    res = lab.exec("lb", ["sysctl", "-n", "net.netfilter.nf_conntrack_count"], check=False)
    return int(res.stdout.strip() or 0) if res.returncode == 0 else 0


def flush_conntrack(lab: GatewayLab) -> None:
    lab.exec("lb", ["conntrack", "-F"], check=False)


@contextlib.contextmanager
def _kind(lab: GatewayLab, kind: str, workdir: Path) -> Iterator[None]:
    """Set the appliance up as ``kind`` for the duration of the block."""
    # Again before each kind: a DPDK forwarder moves eth1's addresses to its TAP and
    # back, and the kernel forgets eth1's neighbours, permanent ones included.
    static_neighbours(lab)
    flush_conntrack(lab)
    if kind == "route":
        yield
    elif kind in ("nftables", "nftables_masq"):
        install_kernel_nat(lab, nat_for_lab(lab, LAB_VIP, LAB_PORT,
                                            masquerade=kind == "nftables_masq"))
        try:
            yield
        finally:
            remove_kernel_nat(lab)
            flush_conntrack(lab)
    else:
        # DPDK busy-polls here, as on an appliance: its worker owns a core.
        with LabAppliance(lab, workdir, WEIGHTS, static_macs=True, dataplane=kind,
                          dpdk_idle_sleep_us=0, mode="nat"):
            yield


def plane_problem(lab: GatewayLab, kind: str, workdir: Path) -> str | None:
    """Why hpclb's ``kind`` data plane cannot run NAT mode here, or None."""
    problem = LabAppliance(lab, workdir, WEIGHTS, static_macs=True, dataplane=kind,
                           mode="nat").config_problem()
    return f"configuration refuses NAT mode: {problem}" if problem else None


def run_nat_bench(out: Path, seconds: float = 4.0, trials: int = 3, flows: int = 50000,
                  ndr_steps: int = 6, kinds: Sequence[str] = ALL_KINDS,
                  prefix: str | None = None) -> int:
    """NAT gateway forwarding on the two-network lab: the kernel's routing and NAT
    against hpclb's NAT mode, in one run on one lab, trials interleaved. ``prefix``:
    the lab's (default: a fresh one)."""
    unknown = [k for k in kinds if k not in ALL_KINDS]
    if unknown:
        raise ValueError(f"unknown kinds {unknown}; known: {', '.join(ALL_KINDS)}")
    missing = [tool for tool in ("trafgen", "nft", "conntrack") if shutil.which(tool) is None]
    if missing:
        raise LabError(f"{', '.join(missing)} not found: ./bootstrap installs them "
                       "(netsniff-ng, nftables, conntrack)")
    assert nft_missing() is None
    results: dict[str, list[dict[str, float]]] = {}
    ndr: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    warmup: dict[str, dict[str, Any]] = {}
    load_at_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="hpclb-bench-nat-") as tmp, \
            GatewayLab(prefix=prefix or f"bn{uuid.uuid4().hex[:6]}", backends=3) as lab:
        workdir = Path(tmp)
        lab.attach_xdp_pass(lab.cluster_peer, install.find("sink.bpf.o"))
        to_vip = write_trafgen_config(lab, workdir / "udp64-vip.cfg", flows)
        to_backend = write_trafgen_config(lab, workdir / "udp64-b1.cfg", flows,
                                          dst_ip=lab.backend_ip(1))
        for kind in kinds:
            if kind in PLANE_KINDS and (why := plane_problem(lab, kind, workdir)):
                skipped[kind] = why
        active = [k for k in kinds if k not in skipped]

        def trial(cfg: Path, rate: float | None) -> dict[str, float]:
            return run_generator(lab, cfg, seconds, rate,
                                 offered=lambda: client_tx_packets(lab),
                                 forwarded=lambda: xdp_packets(lab, "br", lab.cluster_peer),
                                 settle_s=0.5)

        for n in range(trials):
            for kind in list(active):
                cfg = to_backend if kind == "route" else to_vip
                kind_dir = workdir / f"{kind}{n}"
                kind_dir.mkdir()
                try:
                    with _kind(lab, kind, kind_dir):
                        w = _warm_up(lab, cfg, flows)
                        warmup.setdefault(kind, w)
                        results.setdefault(kind, []).append(trial(cfg, None))
                        if n == 0:
                            ndr[kind] = ndr_search(lambda rate, c=cfg: trial(c, rate),
                                                   ndr_steps)
                except LabApplianceError as err:  # a data plane without NAT mode
                    skipped[kind] = f"appliance did not start: {str(err)[-1500:]}"
                    active.remove(kind)
            print(f"trial {n + 1}/{trials}: " + ", ".join(
                f"{k} {results[k][-1]['forwarded_pps']:,.0f} pps "
                f"(lost {results[k][-1]['lost']:.0f})" for k in active if k in results),
                flush=True)

    report = _report(results, ndr, skipped, warmup, seconds=seconds, trials=trials,
                     flows=flows)
    report["conditions"]["loadavg_at_start"] = [round(x, 2) for x in load_at_start]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("median_forwarded_pps", "ndr_pps",
                                             "ratio_to_route", "ratio_to_nftables",
                                             "skipped")}, indent=1))
    print(f"written to {out}")
    return 0


def _warm_up(lab: GatewayLab, cfg: Path, flows: int) -> dict[str, Any]:
    """Every flow once, at a rate nothing loses: the trials then meet established
    connections. Returns how long it took and the conntrack entries it left."""
    t0 = time.monotonic()
    lab.exec("cli", ["trafgen", "--dev", "eth0", "--conf", str(cfg), "--cpus", "1",
                     "--no-sock-mem", "--num", str(flows), "--rate", f"{WARMUP_PPS}pps"],
             check=False, timeout=flows / WARMUP_PPS + 60)
    time.sleep(0.5)
    return {"seconds": round(time.monotonic() - t0, 3), "conntrack_entries": conntrack_count(lab)}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _report(results: dict[str, list[dict[str, float]]], ndr: dict[str, dict[str, Any]],
            skipped: dict[str, str], warmup: dict[str, dict[str, Any]], *, seconds: float,
            trials: int, flows: int) -> dict[str, Any]:
    median = {k: statistics.median(t["forwarded_pps"] for t in v) for k, v in results.items()}
    ndr_pps = {k: v["ndr_pps"] for k, v in ndr.items()}
    load = os.getloadavg()
    return {
        "benchmark": "forwarding_udp64_nat",
        "conditions": {
            "frame_bytes": 64,
            "flows": flows,
            "generator": "trafgen, 1 process, client namespace, through a Linux bridge",
            "topology": "two networks: client 198.18.0.0/24 (br0) -> appliance eth0, "
                        "appliance eth1 -> cluster 198.19.0.0/24 (br1), 3 backends",
            "route": "kernel IPv4 forwarding to backend 1's own address, no NAT, "
                     "no conntrack: the kernel path's ceiling",
            "nftables": "nftables DNAT (numgen random mod 3) + conntrack in the appliance "
                        "namespace (hpclb.lab.kernel_nat)",
            "nftables_masq": "as nftables, plus masquerade out of eth1 (ct status dnat)",
            "xdp": "hpclb run + hpclb-xdp, VIPs mode: nat, eth0 ingress, eth1 egress",
            "dpdk": "hpclb run + hpclb-dpdk (net_af_xdp), VIPs mode: nat, 1 worker "
                    "busy-polling",
            "measured_at": "offered: the client eth0's tx counter; forwarded: the XDP_DROP "
                           "sink on the appliance eth1's bridge peer (v-lb1), rx XDP "
                           "counter; both read 0.5 s after each trial",
            "warmup": f"conntrack flushed before each kind, then every flow sent once at "
                      f"{WARMUP_PPS} pps: trials measure established flows",
            "ndr": "no frame lost; full speed first, then a binary search with trafgen --rate",
            "seconds_per_trial": seconds,
            "trials": trials,
            "kernel": platform.release(),
            "cpus": subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip(),
            "loadavg_at_end": [round(x, 2) for x in load],
        },
        "median_forwarded_pps": median,
        "ndr_pps": ndr_pps,
        "ratio_dpdk_to_xdp": {
            "median_forwarded": _ratio(median.get("dpdk"), median.get("xdp")),
            "ndr": _ratio(ndr_pps.get("dpdk"), ndr_pps.get("xdp")),
        },
        "ratio_to_route": {k: _ratio(median[k], median.get("route"))
                           for k in median if k != "route"},
        "ratio_to_nftables": {
            "median_forwarded": {k: _ratio(median[k], median.get("nftables"))
                                 for k in median if k != "nftables"},
            "ndr": {k: _ratio(ndr_pps[k], ndr_pps.get("nftables"))
                    for k in ndr_pps if k != "nftables"},
        },
        "cost": {"warmup": warmup},
        "skipped": skipped,
        "trials": results,
        "ndr_search": {k: v["search"] for k, v in ndr.items()},
    }
