"""The lab of an active/standby pair with VRRP (keepalived).

The pair's design, its configuration (the `vrrp:` section, hpclb.config.vrrp)
and the files keepalived runs with (hpclb.announce.vrrp) are the appliance's;
this module is the lab around them.

NAT mode (read from dataplane/xdp/lb.bpf.c and common/lb_conn.h, not run in a
pair): the connection table is per member and not replicated, and the standby does
not need it for most connections. A client segment that misses the table opens an
entry mid-stream (ESTABLISHED; only an RST opens nothing), to the backend the same
ring gives, hence the one the failed member used; without SNAT the translation is a
function of the tuple (backend, backend port, client address and port), so the
connection continues; with SNAT the address is ``(hash >> 32) % addresses`` and the
port ``port_min + (hash + n) % range`` for the first n whose reply key is free in
the member's own table: the same as on the failed member unless that member had
to skip a taken candidate (n > 0), in which case the backend sees a new tuple and
the connection breaks. Conditions: the cluster-side gateway and SNAT addresses move with the pair
(``extra_addresses``: virtual addresses on the egress, in the same instance so that
they move together), and the client speaks first after the takeover: a backend's
retransmission that arrives before any client segment finds no entry and passes to
the kernel untranslated. Nothing is replicated (not built); no NAT pair lab.

The lab (``VrrpLab``): one LAN on a bridge: client, two appliances ``lba`` and
``lbb`` (198.18.0.3 and .4), backends; the client routes the VIPs via the virtual
address ``VRRP_ADDRESS`` (198.18.0.1). The appliances do NOT hold the VIPs on
``lo``: a member whose XDP program is gone then drops VIP traffic (no forwarding
in the namespace) instead of answering it with resets, and TCP retransmits through
the new master. ``PairMember`` is a ``LabAppliance`` pointed at one of them, its
configuration with a `vrrp:` section (``role``: active or standby);
``Keepalived`` runs keepalived in a namespace (``--vrrp`` only, its own pid files);
``Capture`` timestamps the frames each member forwards (tcpdump on the bridge side)
for the failover time: last frame through the failed member to first frame through
the other.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpclb.lab.appliance import LabAppliance
from hpclb.lab.members import MembersLab
from hpclb.lab.topology import (
    ETH,
    LAN_PREFIXLEN,
    VIP_NET,
    Lab,
    LabError,
)

# The lab's pair: two appliances on the LAN, the virtual address the client routes
# the VIPs via.
VRRP_ADDRESS = "198.18.0.1"
MEMBER_ADDRESSES = {"lba": "198.18.0.3", "lbb": "198.18.0.4"}


# --------------------------------------------------------------------------- lab


class VrrpLab(MembersLab):
    """The one-LAN lab with two appliances (``lba``, ``lbb``) instead of one; the
    client routes the VIPs via ``VRRP_ADDRESS``. The VIPs are on the backends'
    ``lo`` only (DSR), not on the appliances' (module doc)."""

    members = ("lba", "lbb")
    member_addresses = MEMBER_ADDRESSES

    def _configure_routes(self, role: str, ipr: Any) -> None:
        lo = ipr.link_lookup(ifname="lo")[0]
        if role == "cli":
            net, plen = VIP_NET.split("/")
            ipr.route("add", dst=net, dst_len=int(plen), gateway=VRRP_ADDRESS)
        elif role.startswith("b"):
            self._vips_on_lo(ipr, lo)

    def _host_sysctls(self, role: str) -> dict[str, str]:
        values = super()._host_sysctls(role)
        if role in self.members:
            for dev in ("all", "default", "lo", ETH):
                values[f"net.ipv4.conf.{dev}.rp_filter"] = "0"
            # Never route: VIP traffic that reaches a member without its XDP
            # program is dropped, so TCP retransmits it through the new master.
            values["net.ipv4.ip_forward"] = "0"
        return values

    def holds(self, member: str, address: str = VRRP_ADDRESS) -> bool:
        """Whether ``member``'s eth0 holds ``address`` now."""
        res = self.exec(member, ["ip", "-o", "-4", "addr", "show", "dev", ETH])
        return f" {address}/" in res.stdout

    def client_neighbour(self, address: str = VRRP_ADDRESS) -> str:
        """The client's neighbour entry of ``address`` (``ip neigh`` line, or "")."""
        return self.exec("cli", ["ip", "neigh", "show", address]).stdout.strip()


class PairMember(LabAppliance):
    """``LabAppliance`` on one member of a ``VrrpLab``: the same configuration as
    the other member but for its name, namespace and management address."""

    def __init__(self, lab: VrrpLab, member: str, workdir: Path, weights: dict[str, float],
                 vrrp: dict[str, Any], role: str, **kwargs: Any) -> None:
        if member not in lab.members:
            raise ValueError(f"member must be one of {lab.members}")
        super().__init__(lab, workdir, weights, **kwargs)
        self.member = member
        self.name = f"{lab.prefix}-{member}"
        self.vrrp = {**vrrp, "role": role}

    def config(self) -> dict[str, Any]:
        config = super().config()
        config["appliance"]["name"] = self.name
        config["appliance"]["netns"] = self.lab.ns(self.member)
        config["appliance"]["management_address"] = self.lab.ip_of(self.member)
        config["vrrp"] = dict(self.vrrp)
        return config

    @property
    def run_dir(self) -> Path:
        return self.workdir / "run"


class Keepalived:
    """keepalived for one pair member, in its namespace: VRRP only, in the
    foreground, logging to ``workdir/keepalived.log``, with pid files of its own."""

    def __init__(self, lab: Lab, ns: str, workdir: Path) -> None:
        self.lab = lab
        self.ns = ns
        self.workdir = workdir
        self.conf = workdir / "keepalived.conf"
        self.check_script = workdir / "hpclb-vrrp-check.sh"
        self.log_path = workdir / "keepalived.log"
        self.proc: subprocess.Popen[str] | None = None

    def argv(self) -> list[str]:
        w = self.workdir
        return ["keepalived", "-n", "-l", "-D", "--vrrp", "-f", str(self.conf),
                "-p", str(w / "keepalived.pid"), "-r", str(w / "vrrp.pid"),
                "-c", str(w / "checkers.pid")]

    def start(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            raise LabError(f"keepalived already runs in {self.ns}")
        if self.log_path.exists():  # each start's log on its own, the last kept
            self.log_path.replace(self.log_path.with_suffix(".log.prev"))
        with open(self.log_path, "w") as log:
            self.proc = self.lab.popen(self.ns, self.argv(), stdin=subprocess.DEVNULL,
                                       stdout=log, stderr=subprocess.STDOUT)

    def pids(self) -> list[int]:
        """keepalived's processes, the VRRP child first, then its parent (from
        the pid files). The child first: a parent killed first may have the
        child told (parent-death signal), and it would then resign cleanly
        with a priority-0 advert, which is not what a crash does."""
        out = []
        for name in ("vrrp.pid", "keepalived.pid"):
            with contextlib.suppress(OSError, ValueError):
                out.append(int((self.workdir / name).read_text().strip()))
        if self.proc is not None and self.proc.pid not in out:
            out.append(self.proc.pid)
        return out

    def kill(self) -> None:
        """kill -9 of keepalived and its VRRP child: it leaves its addresses behind,
        as a crash does. The parent is stopped first, so that it cannot respawn
        the child in between (it restarts a child that dies)."""
        pids = self.pids()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[-1], signal.SIGSTOP)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.lab.stop_process(self.proc, grace=5.0)
        self.proc = None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text()[-3000:]
        except FileNotFoundError:
            return "(no log)"


@dataclass
class Capture:
    """tcpdump on the bridge side of each member's veth, frames coming *from* the
    member (what its XDP program forwarded) to ``vip``: their kernel timestamps."""

    lab: Lab
    members: Sequence[str]
    vip: str
    workdir: Path
    procs: dict[str, subprocess.Popen[str]] = field(default_factory=dict)
    # "in": the frames coming from the member (what it forwarded); "out": those
    # the bridge hands the member (what was sent to it).
    direction: str = "in"

    def path(self, member: str) -> Path:
        return self.workdir / f"capture-{member}.txt"

    def start(self, timeout_s: float = 10.0) -> None:
        for m in self.members:
            err = self.workdir / f"capture-{m}.err"
            with open(self.path(m), "w") as out, open(err, "w") as errf:
                self.procs[m] = self.lab.popen(
                    self.lab.bridge_ns,
                    # --immediate-mode: libpcap's TPACKET_V3 otherwise hands
                    # over a block only when full or after its timeout, and a
                    # short capture stopped by SIGINT loses what it held.
                    ["tcpdump", "-n", "-tt", "-l", "--immediate-mode", "-Q", self.direction,
                     "-i", self.lab.peer(m),
                     f"ip dst host {self.vip}"],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=errf)
            deadline = time.monotonic() + timeout_s
            while "listening on" not in err.read_text():
                if self.procs[m].poll() is not None or time.monotonic() > deadline:
                    raise LabError(f"tcpdump on {self.lab.peer(m)}: {err.read_text()}")
                time.sleep(0.02)

    def stop(self) -> dict[str, list[float]]:
        """Stop the captures; the timestamps (epoch seconds) per member."""
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGINT)
        for proc in self.procs.values():
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                self.lab.stop_process(proc)
        self.procs.clear()
        return {m: self.times(m) for m in self.members}

    def times(self, member: str) -> list[float]:
        out = []
        with contextlib.suppress(FileNotFoundError):
            for line in self.path(member).read_text().splitlines():
                with contextlib.suppress(ValueError, IndexError):
                    out.append(float(line.split(" ", 1)[0]))
        return out


def failover_gap(times: dict[str, list[float]], failed: str, other: str,
                 after: float) -> dict[str, float | None]:
    """Last frame through ``failed`` to first frame through ``other`` after the
    failure was injected (``after``, epoch seconds)."""
    before = [t for t in times[failed] if t <= after]
    failed_after = [t for t in times[failed] if t > after]
    took = [t for t in times[other] if t > after]
    last = max(times[failed]) if times[failed] else None
    first = min(took) if took else None
    return {
        "last_through_failed": last,
        "first_through_other": first,
        "failover_s": None if last is None or first is None else first - last,
        "failure_to_first_through_other_s": None if first is None else first - after,
        "frames_failed_before": float(len(before)),
        "frames_failed_after": float(len(failed_after)),
    }


__all__ = ["LAN_PREFIXLEN", "VRRP_ADDRESS", "Capture", "Keepalived", "PairMember", "VrrpLab",
           "failover_gap"]
