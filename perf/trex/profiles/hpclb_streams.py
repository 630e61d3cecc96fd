"""What the hpclb TRex profiles share: their tunables, the flow field engine and the
latency stream.

Loaded by TRex's profile loader (``STLProfile.load_py`` puts this directory on
``sys.path``), inside the TRex client's interpreter (``lbr-trex-client`` or TRex's own
``trex-console``), never by the control plane.

Every profile takes the same tunables (``--name value``, TRex's argparse convention):

* ``--dst_mac``: the appliance's MAC (frames go *through* it, the port's own
  destination otherwise); ``--src_mac``: the sender's (default: the TRex port's).
* ``--src_ip`` / ``--src_ips``: the first source address and how many consecutive ones
  the field engine walks; ``--dst_ip``: the VIP; ``--vip_port``: its port.
* ``--flows``: distinct (source address, source port) pairs; source ports start at
  ``--sport_first`` and the field engine walks addresses x ports
  (``ceil(flows / src_ips)`` ports per address).
* ``--rate_pps``: the profile's total rate, latency stream included, so that what is
  asked of the port is what the runner asked for (the load streams get the rest).
* ``--lat_pps``: the latency stream's rate (0: none); ``--pg_id``: its packet group.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
from typing import Any

from trex.stl.api import (
    IP,
    UDP,
    Ether,
    STLFlowLatencyStats,
    STLPktBuilder,
    STLScVmRaw,
    STLStream,
    STLTXCont,
    STLVmFixIpv4,
    STLVmTupleGen,
    STLVmWrFlowVar,
)

# Latency frames leave from a source port below the load's, so that they are one flow
# of their own and never share a flow with the load.
LATENCY_SPORT = 1023


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dst_mac", default=None, help="appliance MAC (None: the port's)")
    p.add_argument("--src_mac", default=None, help="sender MAC (None: the port's)")
    p.add_argument("--src_ip", default="198.18.0.224", help="first source address")
    p.add_argument("--src_ips", type=int, default=16, help="source addresses walked")
    p.add_argument("--dst_ip", default="198.18.1.10", help="the VIP")
    p.add_argument("--vip_port", type=int, default=8080, help="the VIP's port")
    p.add_argument("--sport_first", type=int, default=1024, help="first source port")
    p.add_argument("--flows", type=int, default=50000, help="distinct source (addr, port)")
    p.add_argument("--rate_pps", type=float, default=1000.0, help="total rate, latency incl.")
    p.add_argument("--lat_pps", type=float, default=1000.0, help="latency stream (0: none)")
    p.add_argument("--pg_id", type=int, default=7, help="latency stream's packet group")
    p.add_argument("--size", type=int, default=64, help="frame size incl. the 4-byte FCS")
    return p


def parse(description: str, tunables: Any, extra: Any = None) -> argparse.Namespace:
    """Parse TRex's tunables (a list of ``--name value`` strings; a dict is taken too,
    as older loaders pass one). ``extra(parser)`` adds a profile's own options."""
    p = parser(description)
    if extra is not None:
        extra(p)
    if isinstance(tunables, dict):
        tunables = [x for k, v in tunables.items() for x in (f"--{k}", str(v))]
    args = p.parse_args(list(tunables or []))
    if args.src_ips < 1 or args.flows < 1:
        raise ValueError("src_ips and flows must be >= 1")
    if args.lat_pps < 0 or args.rate_pps <= 0:
        raise ValueError("rate_pps must be > 0 and lat_pps >= 0")
    return args


def ether(args: argparse.Namespace) -> Any:
    fields = {k: v for k, v in (("dst", args.dst_mac), ("src", args.src_mac)) if v}
    return Ether(**fields)


def load_pps(args: argparse.Namespace) -> float:
    """The load streams' share of ``rate_pps`` (the latency stream's is taken out;
    never below 1 pps, TRex refuses a zero rate)."""
    return max(args.rate_pps - args.lat_pps, 1.0)


def ports_per_ip(args: argparse.Namespace) -> int:
    return max(math.ceil(args.flows / args.src_ips), 1)


def flow_vm(args: argparse.Namespace, l4: str, fix: list[Any] | None = None) -> STLScVmRaw:
    """The field engine: source address and port walked together (a tuple generator,
    addresses x ports, each combination once before repeating), IPv4 checksum fixed.
    ``fix``: more instructions after the writes (a TCP checksum fix)."""
    first = ipaddress.IPv4Address(args.src_ip)
    last = first + (args.src_ips - 1)
    nports = ports_per_ip(args)
    if args.sport_first + nports - 1 > 65535:
        raise ValueError(f"{args.flows} flows over {args.src_ips} addresses need ports "
                         f"{args.sport_first}..{args.sport_first + nports - 1} (> 65535)")
    return STLScVmRaw([
        STLVmTupleGen(ip_min=str(first), ip_max=str(last), port_min=args.sport_first,
                      port_max=args.sport_first + nports - 1, name="tuple"),
        STLVmWrFlowVar(fv_name="tuple.ip", pkt_offset="IP.src"),
        STLVmWrFlowVar(fv_name="tuple.port", pkt_offset=f"{l4}.sport"),
        *(fix if fix is not None else [STLVmFixIpv4(offset="IP")]),
    ])


def pad(pkt: Any, size: int) -> Any:
    """``pkt`` padded to ``size`` bytes on the wire (the NIC adds the 4-byte FCS)."""
    missing = max(size - 4 - len(pkt), 0)
    return pkt / (b"\x00" * missing) if missing else pkt


def udp_packet(args: argparse.Namespace, size: int) -> Any:
    # UDP checksum 0 (none, valid over IPv4): the field engine rewrites the source
    # address and port, which a computed checksum would no longer match.
    base = ether(args) / IP(src=args.src_ip, dst=args.dst_ip) / UDP(
        sport=args.sport_first, dport=args.vip_port, chksum=0)
    return pad(base, size)


def latency_stream(args: argparse.Namespace) -> list[STLStream]:
    """One UDP flow to the VIP at ``lat_pps``, its latency measured by TRex
    (``STLFlowLatencyStats``: TRex appends a signature and a timestamp; a server started
    with ``--hdrh`` reports an HDR histogram of it). Empty when ``lat_pps`` is 0."""
    if args.lat_pps <= 0:
        return []
    # 64-byte frames have room for the latency signature (16 bytes) after UDP.
    base = ether(args) / IP(src=args.src_ip, dst=args.dst_ip) / UDP(
        sport=LATENCY_SPORT, dport=args.vip_port, chksum=0)
    return [STLStream(name="latency", packet=STLPktBuilder(pkt=pad(base, max(args.size, 64))),
                      mode=STLTXCont(pps=args.lat_pps),
                      flow_stats=STLFlowLatencyStats(pg_id=args.pg_id))]
