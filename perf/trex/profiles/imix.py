"""TRex STL profile: IMIX to the VIP over many flows, with a latency stream.

The classic simple IMIX: 64, 594 and 1518-byte frames (with FCS) in the packet ratio
28:16:4, each size its own stream over the same flows (field engine as ``udp64``).
``--rate_pps`` is the total of all three (and the latency stream). Tunables: see
``hpclb_streams``; ``--size`` is ignored.
"""

from __future__ import annotations

from typing import Any

import hpclb_streams as hs
from trex.stl.api import STLPktBuilder, STLStream, STLTXCont

# (frame bytes incl. FCS, packets per cycle)
IMIX = ((64, 28), (594, 16), (1518, 4))


class Imix:
    def get_streams(self, direction: int = 0, tunables: Any = None,
                    **kwargs: Any) -> list[STLStream]:
        args = hs.parse("IMIX 64/594/1518 (28:16:4) over many flows, latency beside",
                        tunables)
        total = sum(n for _, n in IMIX)
        streams = [STLStream(name=f"imix{size}",
                             packet=STLPktBuilder(pkt=hs.udp_packet(args, size),
                                                  vm=hs.flow_vm(args, "UDP")),
                             mode=STLTXCont(pps=max(hs.load_pps(args) * n / total, 1.0)))
                   for size, n in IMIX]
        return [*streams, *hs.latency_stream(args)]


def register() -> Imix:
    return Imix()
