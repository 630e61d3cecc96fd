"""A kernel interface's counters, read inside the appliance's namespace.

Two sources per interface, both absolute (since the interface or its driver
came up): the kernel's link statistics (netlink, IFLA_STATS64: rx_errors,
rx_missed_errors, rx_crc_errors, ...) under their kernel names, and the
driver's own ethtool statistics (ETHTOOL_GSTATS), where it has any, under
``ethtool:<name>`` so they never shadow a kernel name (mlx5, for one, has its
own ``rx_packets``). A driver without ethtool statistics, or an interface that
is gone, is not an error: what exists is read, the rest is left out.

`NicStatsSource` is what the analysis (faces/diagnose.py) is fed; a unit test
hands it a fake one.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Sequence
from typing import Protocol

from pyroute2 import IPRoute, NetNS
from pyroute2.ethtool.ioctl import IoctlEthtool

from hpclb.host.netns import inside

log = logging.getLogger(__name__)

ETHTOOL_PREFIX = "ethtool:"

NicCounters = dict[str, dict[str, int]]  # {ifname: {counter: value}}


class NicStatsSource(Protocol):
    """Reads the counters of the named interfaces: {ifname: {counter: int}}.
    An interface that cannot be read is left out of the answer."""

    def __call__(self, ifnames: Sequence[str]) -> NicCounters: ...


class NetlinkNicStats:
    """The real source: netlink link statistics plus the driver's ethtool
    statistics of interfaces in ``netns`` (the caller's namespace for None)."""

    def __init__(self, netns: str | None = None) -> None:
        self.netns = netns

    def __call__(self, ifnames: Sequence[str]) -> NicCounters:
        out: NicCounters = {}
        links = self._link_stats(ifnames)
        for name in ifnames:
            if name not in links:
                continue  # not a kernel interface here (a NIC DPDK owns, or gone)
            counters = dict(links[name])
            counters.update(self._ethtool_stats(name))
            out[name] = counters
        return out

    def _link_stats(self, ifnames: Sequence[str]) -> NicCounters:
        wanted = set(ifnames)
        out: NicCounters = {}
        # One dump of all links: a per-name lookup of a missing one raises, a dump does not.
        with NetNS(self.netns) if self.netns else IPRoute() as ipr:
            for link in ipr.get_links():
                name = link.get_attr("IFLA_IFNAME")
                if name not in wanted:
                    continue
                stats = link.get_attr("IFLA_STATS64") or link.get_attr("IFLA_STATS")
                out[name] = ({k: int(v) for k, v in dict(stats).items()
                              if isinstance(v, int)} if stats else {})
        return out

    def _ethtool_stats(self, ifname: str) -> dict[str, int]:
        try:
            # The ioctl's socket must be made in the interface's namespace; once
            # made it may be used from anywhere.
            if self.netns:
                with inside(self.netns):
                    eth = IoctlEthtool(ifname)
            else:
                eth = IoctlEthtool(ifname)
        except OSError as err:
            log.debug("ethtool socket in %s: %s", self.netns, err)
            return {}
        try:
            pairs = eth.get_statistics()
        except Exception as err:
            # A driver without GSTATS answers variously (EOPNOTSUPP, ENODEV, an
            # empty string set pyroute2 trips over): nothing to read either way.
            if isinstance(err, OSError) and err.errno not in (errno.EOPNOTSUPP, errno.ENODEV):
                log.debug("ethtool statistics of %s: %s", ifname, err)
            return {}
        finally:
            eth.close()
        return {f"{ETHTOOL_PREFIX}{name}": int(value) for name, value in pairs}

