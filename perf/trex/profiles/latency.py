"""TRex STL profile: the latency stream alone (``STLFlowLatencyStats`` at
``--lat_pps``, packet group ``--pg_id``), for a path's idle latency or beside a load
another profile or generator offers. Tunables: see ``hpclb_streams``."""

from __future__ import annotations

from typing import Any

import hpclb_streams as hs
from trex.stl.api import STLStream


class Latency:
    def get_streams(self, direction: int = 0, tunables: Any = None,
                    **kwargs: Any) -> list[STLStream]:
        args = hs.parse("latency stream only", tunables)
        if args.lat_pps <= 0:
            raise ValueError("the latency profile needs lat_pps > 0")
        return hs.latency_stream(args)


def register() -> Latency:
    return Latency()
