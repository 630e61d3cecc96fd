"""TRex STL profile: TCP SYN to the VIP, every frame a new flow (the new-flow rate),
in bursts or continuous, with a latency stream.

Each SYN takes the next (source address, source port) of the field engine, so that
up to ``--flows`` frames in a row are each a flow the load balancer has not seen
(``--flows`` large: a million by default, 16 addresses x 62,500 ports); the sequence
number is random. ``--burst N`` sends bursts of N SYNs ``--ibg_us`` apart at
``--rate_pps`` inside a burst (a SYN flood's shape); without it the SYNs are
continuous. TCP and IPv4 checksums are computed for every frame (a kernel peer with
conntrack drops a SYN whose checksum is wrong). Tunables: see ``hpclb_streams``.
"""

from __future__ import annotations

import argparse
from typing import Any

import hpclb_streams as hs
from trex.stl.api import (
    IP,
    TCP,
    CTRexVmInsFixHwCs,
    Padding,
    STLPktBuilder,
    STLStream,
    STLTXCont,
    STLTXMultiBurst,
    STLVmFixChecksumHw,
    STLVmFlowVar,
    STLVmWrFlowVar,
)


def _options(p: argparse.ArgumentParser) -> None:
    p.set_defaults(flows=1_000_000)
    p.add_argument("--burst", type=int, default=0, help="SYNs per burst (0: continuous)")
    p.add_argument("--ibg_us", type=float, default=100000.0, help="gap between bursts")


class Syn:
    def get_streams(self, direction: int = 0, tunables: Any = None,
                    **kwargs: Any) -> list[STLStream]:
        args = hs.parse("TCP SYN, a new flow per frame, latency beside", tunables, _options)
        syn = (hs.ether(args) / IP(src=args.src_ip, dst=args.dst_ip)
               / TCP(sport=args.sport_first, dport=args.vip_port, flags="S", seq=1,
                     window=64240))
        # Ethernet padding, not TCP payload: a SYN carries no data (a listener
        # without TCP Fast Open would drop it anyway).
        base = syn / Padding(b"\x00" * max(args.size - 4 - len(syn), 0))
        vm = hs.flow_vm(args, "TCP", fix=[
            STLVmFlowVar(name="seq", min_value=0, max_value=0xFFFFFFFF, size=4,
                         op="random"),
            STLVmWrFlowVar(fv_name="seq", pkt_offset="TCP.seq"),
            # IPv4 and TCP checksums; TRex computes them in software where the port
            # has no offload (af_packet).
            STLVmFixChecksumHw(l3_offset="IP", l4_offset="TCP",
                               l4_type=CTRexVmInsFixHwCs.L4_TYPE_TCP),
        ])
        pps = hs.load_pps(args)
        mode: Any = (STLTXMultiBurst(pps=pps, pkts_per_burst=args.burst, ibg=args.ibg_us,
                                     count=1_000_000)
                     if args.burst > 0 else STLTXCont(pps=pps))
        load = STLStream(name="syn", mode=mode,
                         # keep the padding: TRex takes a trailing Padding for an FCS
                         packet=STLPktBuilder(pkt=base, vm=vm, remove_fcs=False))
        return [load, *hs.latency_stream(args)]


def register() -> Syn:
    return Syn()
