"""An active/standby pair with VRRP (keepalived): its configuration and its lab.

What keepalived moves. In this project clients reach a VIP by routing it via an
appliance address (the lab's client routes ``198.18.1.0/24`` via the appliance's
LAN address). A pair therefore moves a *VRRP virtual address on the client-facing
segment*, the VIPs' next hop: the client (or its router) routes the VIPs via it;
the member that holds it is the one its neighbour entry points at, and a takeover
sends gratuitous ARPs that move that entry (Linux updates an existing entry on a
gratuitous ARP whatever ``arp_accept`` says). Optionally (``vips_on_interface``)
the VIPs themselves are virtual addresses too, for L2-adjacent clients that ARP for
the VIP; a member must then not hold them on ``lo`` (the standby would answer).

Both members run the same control plane on the same configuration but for the
member-local fields (``appliance.name``, ``management_address``, the control
socket): the same ``hash_key`` and the same pools, hence bit-identical rings, so in
DSR a flow keeps its backend when the other member takes it, and the standby's
tables are in place before it is needed: new connections are served at once.

Each member's keepalived tracks a script (``templates/hpclb-vrrp-check.sh.j2``): the
status file of `hpclb run` fresh, the data plane's process alive, and (XDP) a
program attached to the ingress; a failure puts the instance in FAULT (no weight:
with ``nopreempt`` a priority drop alone would not hand over). Both members start
BACKUP with ``nopreempt``: the higher priority wins the first election only, and a
member that comes back (restarted, repaired) stays BACKUP, never flapping back.

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
the new master. ``PairMember`` is a ``LabAppliance`` pointed at one of them;
``Keepalived`` runs keepalived in a namespace (``--vrrp`` only, its own pid files);
``Capture`` timestamps the frames each member forwards (tcpdump on the bridge side)
for the failover time: last frame through the failed member to first frame through
the other.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jinja2 import Environment, PackageLoader, StrictUndefined
from pyroute2 import netns

from hpclb.config.schema import Dataplane, HpclbConfig
from hpclb.lab.appliance import LabAppliance
from hpclb.lab.topology import (
    ETH,
    LAN_PREFIXLEN,
    VIP_NET,
    Lab,
    LabError,
)

KEEPALIVED_TEMPLATE = "keepalived.conf.j2"
CHECK_TEMPLATE = "hpclb-vrrp-check.sh.j2"
ROLES = ("active", "standby")

# The lab's pair: two appliances on the LAN, the virtual address the client routes
# the VIPs via.
VRRP_ADDRESS = "198.18.0.1"
MEMBER_ADDRESSES = {"lba": "198.18.0.3", "lbb": "198.18.0.4"}
_VRRP_ROLE_RE = r"(br|cli|lba|lbb|b[0-9]+)"


@dataclass(frozen=True)
class PairSettings:
    """What a pair shares (the VRRP instance) and each member's own bits.

    ``next_hop``: the virtual address the VIPs are routed via (on the ingress's
    segment, ``prefixlen`` its mask). ``advert_int``: seconds between adverts
    (VRRPv3: down to 0.01); the standby takes over ``3 * advert_int`` plus a skew
    of ``(256 - priority) / 256 * advert_int`` after the last advert of a dead
    master, at once on a priority-0 advert (the master's FAULT or stop).
    ``unicast``: adverts unicast between ``addresses`` (member name -> its own
    address on the segment) where the segment filters multicast; else multicast
    224.0.0.18.
    """

    next_hop: str
    prefixlen: int = 24
    vrid: int = 51
    instance: str = "hpclb"
    priorities: tuple[int, int] = (150, 100)  # active, standby (first election only)
    advert_int: float = 1.0
    vips_on_interface: bool = False
    unicast: bool = False
    addresses: dict[str, str] = field(default_factory=dict)
    # More virtual addresses moving with the next hop: (ADDRESS/PREFIXLEN, interface),
    # e.g. a NAT pair's cluster-side gateway and SNAT addresses on its egress.
    extra_addresses: tuple[tuple[str, str], ...] = ()
    check_interval_s: int = 1
    check_timeout_s: int = 2
    fall: int = 1
    rise: int = 2
    status_max_age_s: int = 5
    garp_repeat: int = 5
    garp_delay_s: int = 5
    garp_refresh_s: int = 60

    def __post_init__(self) -> None:
        ipaddress.IPv4Address(self.next_hop)
        if not 1 <= self.vrid <= 255:
            raise ValueError(f"vrid must be in 1..255, got {self.vrid}")
        if not 0 < self.prefixlen <= 32:
            raise ValueError(f"prefixlen must be in 1..32, got {self.prefixlen}")
        if not all(1 <= p <= 254 for p in self.priorities) or \
                self.priorities[0] <= self.priorities[1]:
            raise ValueError("priorities: (active, standby), each in 1..254, active higher")
        if not 0.01 <= self.advert_int <= 40.95:
            raise ValueError("advert_int must be in 0.01..40.95 s (VRRPv3)")
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]{0,30}", self.instance):
            raise ValueError("instance: a letter, then letters, digits or '_'")
        for cidr, ifname in self.extra_addresses:
            ipaddress.ip_interface(cidr)
            if not re.fullmatch(r"[A-Za-z0-9_.@-]{1,15}", ifname):
                raise ValueError(f"extra_addresses: bad interface name {ifname!r}")
        if self.unicast and len(self.addresses) != 2:
            raise ValueError("unicast adverts need both members' addresses")
        if min(self.check_interval_s, self.check_timeout_s, self.fall, self.rise,
               self.status_max_age_s) < 1:
            raise ValueError("check_interval_s, check_timeout_s, fall, rise and "
                             "status_max_age_s must be at least 1")


@dataclass(frozen=True)
class Rendered:
    """One member's files: keepalived.conf and its track script."""

    keepalived_conf: str
    check_script: str


def _env() -> Environment:
    return Environment(loader=PackageLoader("hpclb", "templates"), undefined=StrictUndefined,
                       keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)


def render(config: HpclbConfig, settings: PairSettings, role: str, *, run_dir: Path,
           check_script: Path) -> Rendered:
    """keepalived.conf and the track script of the member ``role`` ("active" or
    "standby") whose hpclb configuration is ``config``, run with ``run_dir`` (where
    `hpclb run` writes NAME.status.json and the data plane's NAME.pid);
    ``check_script`` is where the script will be installed (root-owned, not
    writable by others: keepalived's script security)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    app = config.appliance
    name = app.name
    priority = settings.priorities[ROLES.index(role)]
    unicast_src = unicast_peer = ""
    if settings.unicast:
        if name not in settings.addresses:
            raise ValueError(f"unicast: no address for member {name!r} in "
                             f"{sorted(settings.addresses)}")
        unicast_src = settings.addresses[name]
        unicast_peer = next(a for n, a in settings.addresses.items() if n != name)
    vip_addresses: list[str] = []
    if settings.vips_on_interface:
        vip_addresses = sorted({f"{v.address}/{v.address.max_prefixlen}" for v in config.vips})
    script_name = f"hpclb_{re.sub(r'[^A-Za-z0-9_]', '_', name)}"
    # AUTO picks XDP or DPDK at start: only XDP has a program to look for.
    check_xdp = app.dataplane == Dataplane.XDP
    values: dict[str, Any] = {
        "name": name, "role": role, "instance": settings.instance,
        "interface": app.interfaces.ingress, "vrid": settings.vrid, "priority": priority,
        "advert_int": f"{settings.advert_int:g}", "next_hop": settings.next_hop,
        "prefixlen": settings.prefixlen, "vip_addresses": vip_addresses,
        "extra_addresses": [{"cidr": str(ipaddress.ip_interface(c)), "dev": d}
                            for c, d in settings.extra_addresses],
        "unicast_src": unicast_src, "unicast_peer": unicast_peer,
        "script_name": script_name, "check_script": str(check_script),
        "check_interval_s": settings.check_interval_s,
        "check_timeout_s": settings.check_timeout_s,
        "fall": settings.fall, "rise": settings.rise,
        "status_max_age_s": settings.status_max_age_s, "check_xdp": check_xdp,
        "garp_repeat": settings.garp_repeat, "garp_delay_s": settings.garp_delay_s,
        "garp_refresh_s": settings.garp_refresh_s,
        "status_file": str(run_dir / f"{name}.status.json"),
        "pid_file": str(run_dir / f"{name}.pid"),
    }
    env = _env()
    return Rendered(env.get_template(KEEPALIVED_TEMPLATE).render(**values),
                    env.get_template(CHECK_TEMPLATE).render(**values))


def write_member_files(rendered: Rendered, conf: Path, check_script: Path) -> None:
    """Write keepalived.conf (0644) and the track script (0700), root's as this
    process is."""
    check_script.write_text(rendered.check_script)
    check_script.chmod(0o700)
    conf.write_text(rendered.keepalived_conf)
    conf.chmod(0o644)


def config_test(conf: Path, timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    """``keepalived -t -f conf`` (keepalived 2.2's configuration test; exit 0 when
    valid). Its pid files go to a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="hpclb-kad-t-") as tmp:
        return subprocess.run(
            ["keepalived", "-t", "-l", "-f", str(conf), "-p", f"{tmp}/k.pid",
             "-r", f"{tmp}/v.pid", "-c", f"{tmp}/c.pid"],
            capture_output=True, text=True, timeout=timeout_s, check=False)


# --------------------------------------------------------------------------- lab


class VrrpLab(Lab):
    """The one-LAN lab with two appliances (``lba``, ``lbb``) instead of one; the
    client routes the VIPs via ``VRRP_ADDRESS``. The VIPs are on the backends'
    ``lo`` only (DSR), not on the appliances' (module doc)."""

    members = ("lba", "lbb")

    def roles(self) -> list[str]:
        return ["cli", *self.members, *(f"b{i}" for i in range(1, self.backends + 1))]

    @staticmethod
    def existing_namespaces(prefix: str) -> list[str]:
        pattern = re.compile(re.escape(prefix) + "-" + _VRRP_ROLE_RE)
        return sorted(n for n in netns.listnetns() if pattern.fullmatch(n))

    @property
    def lb_ns(self) -> str:
        return self.ns("lba")

    def ip_of(self, role: str) -> str:
        role = role.rsplit("-", 1)[-1]
        if role in MEMBER_ADDRESSES:
            return MEMBER_ADDRESSES[role]
        return super().ip_of(role)

    def appliance_peers(self) -> list[str]:
        return [self.peer(m) for m in self.members]

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
                 **kwargs: Any) -> None:
        if member not in lab.members:
            raise ValueError(f"member must be one of {lab.members}")
        super().__init__(lab, workdir, weights, **kwargs)
        self.member = member
        self.name = f"{lab.prefix}-{member}"

    def config(self) -> dict[str, Any]:
        config = super().config()
        config["appliance"]["name"] = self.name
        config["appliance"]["netns"] = self.lab.ns(self.member)
        config["appliance"]["management_address"] = self.lab.ip_of(self.member)
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
                    ["tcpdump", "-n", "-tt", "-l", "--immediate-mode", "-Q", "in",
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


__all__ = ["LAN_PREFIXLEN", "VRRP_ADDRESS", "Capture", "Keepalived", "PairMember", "PairSettings",
           "Rendered", "VrrpLab", "config_test", "failover_gap", "render",
           "write_member_files"]
