"""TRex STL profile: 64-byte UDP to the VIP over many flows, with a latency stream.

The field engine walks ``--src_ips`` source addresses x source ports (``--flows``
pairs), so that the load balancer sees many flows as from many clients; the latency
stream (``--lat_pps``, ``--pg_id``) runs beside at a low rate. Tunables: see
``hpclb_streams``. Run by ``perf/trex/driver.py`` or ``trex-console``
(``start -f udp64.py -t rate_pps=100000,dst_mac=...``).
"""

from __future__ import annotations

from typing import Any

import hpclb_streams as hs
from trex.stl.api import STLPktBuilder, STLStream, STLTXCont


class Udp64:
    def get_streams(self, direction: int = 0, tunables: Any = None,
                    **kwargs: Any) -> list[STLStream]:
        args = hs.parse("64-byte UDP over many flows, latency beside", tunables)
        load = STLStream(name="udp64",
                         packet=STLPktBuilder(pkt=hs.udp_packet(args, args.size),
                                              vm=hs.flow_vm(args, "UDP")),
                         mode=STLTXCont(pps=hs.load_pps(args)))
        return [load, *hs.latency_stream(args)]


def register() -> Udp64:
    return Udp64()
