"""A fleet of three appliances behind a router that spreads a VIP over them by
ECMP, announced with BGP: the lab of issue 15's fleet.

Topology (``p`` is the prefix; every veth's peer lives in ``{p}-br``)::

    client network 198.18.2.0/24 (br1)        LAN 198.18.0.0/24 (br0)
    {p}-cli eth0 198.18.2.2 ─ v-cli ─┐        ┌─ v-rtr ─ {p}-rtr eth0 198.18.0.1
                                    br1       br0 ─ v-lba ─ {p}-lba eth0 198.18.0.3
    {p}-rtr eth1 198.18.2.1 ─ v-rtr1 ┘         ├─ v-lbb ─ {p}-lbb eth0 198.18.0.4
                                               ├─ v-lbc ─ {p}-lbc eth0 198.18.0.5
                                               └─ v-bN ── {p}-bN  eth0 198.18.0.(10+N)

* The client sits behind the router (its default route is 198.18.2.1); the
  router forwards (``ip_forward``) and learns the VIPs' /32s from the three
  members by eBGP (BIRD 2, AS 65000; the members AS 65001): its kernel protocol
  with ``merge paths on`` installs one route with a next hop per member that
  announces. ``fib_multipath_hash_policy=1`` hashes the 5-tuple (L4), so each
  TCP connection sticks to one member while the set of next hops stays;
  ``ignore_routes_with_linkdown=1`` drops next hops on a link that lost carrier
  (the router's own; a member's cut link is seen by BFD or the hold time).
* The three members (``lba``, ``lbb``, ``lbc``) run `hpclb run` (XDP, DSR) with
  the same configuration but for the member-local fields (name, namespace,
  management address, control socket, BGP router id and speaker files): the same
  ``hash_key`` and pools, hence the same rings. They hold no VIP on ``lo`` and
  do not forward in their kernels: VIP traffic reaching a member without its XDP
  program is dropped (TCP retransmits it), never answered with a reset.
* The backends hold the VIPs on ``lo`` (DSR) and route the client network via
  the router (198.18.0.1): their answers never cross a member.
* Unknown-unicast flooding is off towards the members' bridge ports
  (``bridge link set ... flood off``). A bridge that lost a member's port (its
  link cut) forgets that member's MAC and would flood the router's frames for it
  to every port; a veth hands every frame to XDP whatever its destination MAC,
  so the other members' XDP programs would forward frames the router sent to
  the dead one, and a cut link would look like no outage at all. A real NIC
  filters by destination MAC; the flag gives the lab that behaviour.

``EcmpRouter`` is the router's BIRD and its kernel table; ``EcmpMember`` a
``LabAppliance`` on one member with a ``bgp:`` section peering with the router
(and optionally a ``fleet:`` section) plus that member's own BIRD, started once
`hpclb run` wrote its ``bird.conf``; ``FlowCapture`` timestamps the frames
each member forwards to the VIP (tcpdump on the bridge side) by client source
port, for the failover time of each flow; ``member_rings`` reads a member's
rings back from its data plane as backend addresses, slot by slot.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpclb.lab.appliance import LAB_TELEMETRY_PORT, LabAppliance
from hpclb.lab.members import MembersLab
from hpclb.lab.topology import (
    BRIDGE,
    ETH,
    LAN_PREFIXLEN,
    MAC_FMT,
    LabError,
    Port,
)
from hpclb.lab.vrrp import Capture

ROUTER_IP = "198.18.0.1"  # the router on the LAN: the members' BGP peer, the backends' way back
CLIENT_NET = "198.18.2.0/24"
CLIENT_GW = "198.18.2.1"  # the router on the client network
ECMP_CLIENT_IP = "198.18.2.2"
CLIENT_BRIDGE = "br1"
ROUTER_CLIENT_ETH = "eth1"
ROUTER_CLIENT_PEER = "v-rtr1"
ROUTER_CLIENT_MAC = "02:48:4c:00:02:01"
CLIENT_MAC = "02:48:4c:00:02:02"
MEMBER_ADDRESSES = {"lba": "198.18.0.3", "lbb": "198.18.0.4", "lbc": "198.18.0.5"}
ROUTER_AS, MEMBER_AS = 65000, 65001
EMPTY_SLOT = 0xFFFFFFFF


class EcmpLab(MembersLab):
    """Client behind a router, three appliances and the backends on the LAN
    (module doc). ``lb_ns`` is the first member's namespace."""

    members = ("lba", "lbb", "lbc")
    member_addresses = MEMBER_ADDRESSES
    extra_roles = ("rtr",)

    @property
    def router_ns(self) -> str:
        return self.ns("rtr")

    def ip_of(self, role: str) -> str:
        role = role.rsplit("-", 1)[-1]
        if role == "rtr":
            return ROUTER_IP
        if role == "cli":
            return ECMP_CLIENT_IP
        return super().ip_of(role)

    def ports(self) -> list[Port]:
        lan = [Port(r, ETH, self.peer(r), BRIDGE, self.ip_of(r), LAN_PREFIXLEN,
                    MAC_FMT.format(int(self.ip_of(r).rsplit(".", 1)[1])))
               for r in self.roles() if r != "cli"]
        plen = int(CLIENT_NET.split("/")[1])
        client = [Port("rtr", ROUTER_CLIENT_ETH, ROUTER_CLIENT_PEER, CLIENT_BRIDGE, CLIENT_GW,
                       plen, ROUTER_CLIENT_MAC),
                  Port("cli", ETH, self.peer("cli"), CLIENT_BRIDGE, ECMP_CLIENT_IP, plen,
                       CLIENT_MAC)]
        return lan + client

    def _configure_routes(self, role: str, ipr: Any) -> None:
        lo = ipr.link_lookup(ifname="lo")[0]
        if role == "cli":
            ipr.route("add", dst="0.0.0.0", dst_len=0, gateway=CLIENT_GW)
        elif role.startswith("b"):
            self._vips_on_lo(ipr, lo)
            net, plen = CLIENT_NET.split("/")
            ipr.route("add", dst=net, dst_len=int(plen), gateway=ROUTER_IP)

    def _host_sysctls(self, role: str) -> dict[str, str]:
        values = super()._host_sysctls(role)
        if role in self.members:
            for dev in ("all", "default", "lo", ETH):
                values[f"net.ipv4.conf.{dev}.rp_filter"] = "0"
            # Never route: VIP traffic reaching a member without its XDP program
            # is dropped, so TCP retransmits it through another member.
            values["net.ipv4.ip_forward"] = "0"
        if role == "rtr":
            values |= {
                "net.ipv4.ip_forward": "1",
                # L4 hash: a connection's packets take one next hop; another
                # connection from the same client may take another.
                "net.ipv4.fib_multipath_hash_policy": "1",
                "net.ipv4.conf.all.ignore_routes_with_linkdown": "1",
                # Backends answer from the VIP, whose route points back at the
                # LAN: no reverse-path judgement on a router in the middle.
                **{f"net.ipv4.conf.{d}.rp_filter": "0"
                   for d in ("all", "default", ETH, ROUTER_CLIENT_ETH)},
            }
        return values

    def _configure_bridge_ns(self) -> None:
        super()._configure_bridge_ns()
        for member in self.members:  # module doc: a NIC's MAC filter
            self.exec(self.bridge_ns, ["bridge", "link", "set", "dev", self.peer(member),
                                       "flood", "off"])

    def set_member_link(self, member: str, up: bool) -> None:
        """Cut (or restore) a member's LAN link: its eth0 down inside the member,
        both veth ends lose carrier, as a pulled cable."""
        self.set_link(member, ETH, up)


# --------------------------------------------------------------------------- router


def router_conf(members: Mapping[str, str], *, hold_time_s: int = 3,
                bfd: tuple[int, int] | None = None) -> str:
    """The router's bird.conf: a BGP session per member (``members``: name ->
    address), everything they announce imported, the kernel table fed with
    ECMP routes (``merge paths on``). ``bfd``: (interval in ms, multiplier) for
    BFD on every session."""
    lines = [
        f"router id {ROUTER_IP};",
        "protocol device { scan time 2; }",
        "protocol kernel { ipv4 { import none; export all; }; merge paths on; }",
    ]
    if bfd is not None:
        interval, multiplier = bfd
        lines.append(f'protocol bfd {{ interface "{ETH}" {{ min rx interval {interval} ms; '
                     f"min tx interval {interval} ms; multiplier {multiplier}; }}; }}")
    for name, address in members.items():
        lines += [
            f"protocol bgp {name} {{",
            f"  local {ROUTER_IP} as {ROUTER_AS};",
            f"  neighbor {address} as {MEMBER_AS};",
            f"  hold time {hold_time_s};",
            "  connect delay time 1;",
            "  connect retry time 1;",
            "  error wait time 1, 2;",
            *(["  bfd on;"] if bfd is not None else []),
            "  ipv4 { import all; export none; };",
            "}",
        ]
    return "\n".join(lines) + "\n"


class EcmpRouter:
    """The router's BIRD 2 in ``{p}-rtr`` and what its kernel table says."""

    def __init__(self, lab: EcmpLab, workdir: Path, *, hold_time_s: int = 3,
                 bfd: tuple[int, int] | None = None) -> None:
        self.lab = lab
        self.workdir = workdir
        self.conf = workdir / "router-bird.conf"
        self.socket = workdir / "router-bird.ctl"
        self.log_path = workdir / "router-bird.log"
        self.hold_time_s = hold_time_s
        self.bfd = bfd
        self.proc: subprocess.Popen[str] | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        self.conf.write_text(router_conf({m: self.lab.ip_of(m) for m in self.lab.members},
                                         hold_time_s=self.hold_time_s, bfd=self.bfd))
        with open(self.log_path, "w") as log:
            self.proc = self.lab.popen(self.lab.router_ns, ["bird", "-f", "-c", str(self.conf),
                                                            "-s", str(self.socket)],
                                       stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not self.socket.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise LabError(f"router BIRD did not start: {self.log_text()}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.lab.stop_process(self.proc)
        self.proc = None

    def route(self, prefix: str) -> str:
        """The router's kernel route to ``prefix`` ("" when it has none)."""
        res = subprocess.run(["ip", "-4", "-n", self.lab.router_ns, "route", "show", "exact",
                              prefix], capture_output=True, text=True, timeout=10, check=True)
        return res.stdout.strip()

    def next_hops(self, prefix: str) -> set[str]:
        """The next hops of the router's kernel route to ``prefix``."""
        return set(re.findall(r"\bvia (\S+)", self.route(prefix)))

    def birdc(self, *command: str) -> str:
        res = subprocess.run(["birdc", "-s", str(self.socket), *command], capture_output=True,
                             text=True, timeout=10, check=False)
        return res.stdout + res.stderr

    def log_text(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text()[-3000:]
        return "(no log)"


# --------------------------------------------------------------------------- members


class EcmpMember(LabAppliance):
    """`hpclb run` on one member of an ``EcmpLab`` with a ``bgp:`` section peering
    with the router, and that member's BIRD (``start_speaker``). The configuration
    is the fleet's but for the member-local fields (module doc). ``bgp``: more
    fields of the ``bgp:`` section (e.g. BFD); ``fleet``: the ``fleet:`` section,
    written as given."""

    def __init__(self, lab: EcmpLab, member: str, workdir: Path, weights: dict[str, float],
                 *, hold_time_s: int = 3, bgp: Mapping[str, Any] | None = None,
                 fleet: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        if member not in lab.members:
            raise ValueError(f"member must be one of {lab.members}")
        super().__init__(lab, workdir, weights, **kwargs)
        self.member = member
        self.name = f"{lab.prefix}-{member}"
        self.address = lab.ip_of(member)
        self.hold_time_s = hold_time_s
        self.bgp_extra = dict(bgp or {})
        self.fleet = dict(fleet) if fleet is not None else None
        self.bird_dir = workdir / "bird"
        self.bird_dir.mkdir(parents=True, exist_ok=True)
        self.speaker: subprocess.Popen[str] | None = None

    def config(self) -> dict[str, Any]:
        config = super().config()
        app = config["appliance"]
        app["name"] = self.name
        app["netns"] = self.lab.ns(self.member)
        app["management_address"] = self.address
        app["checkpoint_interval_s"] = 1.0
        if "telemetry" in config:
            config["telemetry"] = {**config["telemetry"],
                                   "bind": f"tcp://{self.address}:{LAB_TELEMETRY_PORT}"}
        config["bgp"] = {
            "local_asn": MEMBER_AS, "router_id": self.address,
            "peers": [{"name": "router", "address": ROUTER_IP, "asn": ROUTER_AS,
                       "hold_time_s": self.hold_time_s}],
            "config_dir": str(self.bird_dir),
            "control_socket": str(self.bird_dir / "bird.ctl"),
            "withdraw_wait_s": 1.0,
            # The lab withdraws and announces on purpose, several times a run.
            "damping": {"enabled": False},
            **self.bgp_extra,
        }
        if self.fleet is not None:
            config["fleet"] = dict(self.fleet)
        return config

    def telemetry_endpoint(self, port: int = LAB_TELEMETRY_PORT) -> str:
        return f"tcp://{self.address}:{port}"

    @property
    def run_dir(self) -> Path:
        return self.workdir / "run"

    def start_speaker(self, timeout_s: float = 20.0) -> None:
        """Start this member's BIRD once `hpclb run` wrote its bird.conf (as the
        hpclb-bird.path unit does), as root in the lab."""
        conf = self.bird_dir / "bird.conf"
        deadline = time.monotonic() + timeout_s
        while not conf.exists():
            if time.monotonic() > deadline:
                raise LabError(f"{self.member}: no bird.conf from hpclb run:\n{self.log_text()}")
            time.sleep(0.05)
        with open(self.workdir / "speaker.log", "a") as log:
            self.speaker = self.lab.popen(self.member, ["bird", "-f", "-c", str(conf), "-s",
                                                       str(self.bird_dir / "bird.ctl")],
                                          stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT)

    def stop_speaker(self) -> None:
        if self.speaker is not None:
            self.lab.stop_process(self.speaker)
        self.speaker = None

    def speaker_log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.workdir / "speaker.log").read_text()[-2000:]
        return "(no log)"


# --------------------------------------------------------------------------- rings


def member_rings(app: LabAppliance) -> dict[str, tuple[str | None, ...]]:
    """Every VIP's ring in ``app``'s data plane, slot by slot as backend
    addresses (None: an empty slot), keyed "ADDRESS:PORT/PROTO", plus a
    "states" entry: each backend address with its state. Backend ids are each
    member's own; addresses are what the fleet shares."""
    dump = app.client.dump()
    by_id = {int(b["id"]): str(ipaddress.ip_address(bytes(b["addr"])))
             for b in dump["backends"]}
    rings: dict[str, tuple[str | None, ...]] = {}
    for vip in dump["vips"]:
        key = f"{ipaddress.ip_address(bytes(vip['addr']))}:{vip['port']}/{vip['proto']}"
        slots = app.client.get_ring(int(vip["vip_id"]))
        rings[key] = tuple(None if int(s) == EMPTY_SLOT else by_id.get(int(s), f"?{int(s)}")
                           for s in slots)
    rings["states"] = tuple(sorted(f"{by_id[int(b['id'])]}={int(b['state'])}"
                                   for b in dump["backends"]))
    return rings


def ring_differences(rings: Mapping[str, Mapping[str, tuple[str | None, ...]]]
                     ) -> dict[str, Any]:
    """Where the members' rings differ: per member other than the first, per
    ring key, how many slots differ from the first member's (missing rings
    named). Empty when every member holds the same rings."""
    names = list(rings)
    if not names:
        return {}
    base = rings[names[0]]
    out: dict[str, Any] = {}
    for name in names[1:]:
        other = rings[name]
        diff: dict[str, Any] = {}
        for key in sorted(set(base) | set(other)):
            a, b = base.get(key), other.get(key)
            if a is None or b is None:
                diff[key] = "missing"
            elif len(a) != len(b):
                diff[key] = f"size {len(a)} vs {len(b)}"
            elif a != b:
                diff[key] = sum(1 for x, y in zip(a, b, strict=True) if x != y)
        if diff:
            out[f"{names[0]} vs {name}"] = diff
    return out


def ring_shares(ring: Sequence[str | None]) -> dict[str, float]:
    """Each backend address's share of a ring's slots."""
    counts: dict[str, int] = {}
    for s in ring:
        if s is not None:
            counts[s] = counts.get(s, 0) + 1
    return {k: round(v / len(ring), 4) for k, v in sorted(counts.items())}


# --------------------------------------------------------------------------- capture


_FLOW_RE = re.compile(r"^(\d+\.\d+) IP (\d+\.\d+\.\d+\.\d+)\.(\d+) > ")


class FlowCapture(Capture):
    """``vrrp.Capture`` (frames each member forwarded to the VIP, bridge side)
    read by flow: per member, each client source port's frame timestamps."""

    def flows(self, member: str) -> dict[int, list[float]]:
        out: dict[int, list[float]] = {}
        with contextlib.suppress(FileNotFoundError):
            for line in self.path(member).read_text().splitlines():
                m = _FLOW_RE.match(line)
                if m:
                    out.setdefault(int(m.group(3)), []).append(float(m.group(1)))
        return out


def flow_failover(flows: Mapping[str, Mapping[int, list[float]]], failed: str,
                  injected: float) -> dict[str, Any]:
    """For each flow the failed member forwarded before ``injected`` (epoch
    seconds): its last frame through the failed member, its first frame through
    another member after ``injected``: the gap per flow, summarised."""
    mine = flows.get(failed, {})
    gaps: list[float] = []
    never: list[int] = []
    took: dict[str, int] = {}
    for port, times in mine.items():
        if not any(t <= injected for t in times):
            continue
        last = max(times)
        firsts = [(min(t for t in ts if t > injected), m)
                  for m, f in flows.items() if m != failed
                  for ts in [f.get(port, [])] if any(t > injected for t in ts)]
        if not firsts:
            never.append(port)
            continue
        first, member = min(firsts)
        gaps.append(first - last)
        took[member] = took.get(member, 0) + 1
    gaps.sort()

    def q(p: float) -> float | None:
        return round(gaps[min(len(gaps) - 1, int(p * len(gaps)))], 4) if gaps else None

    return {"flows_on_failed": len(gaps) + len(never), "flows_moved": len(gaps),
            "flows_not_seen_elsewhere": len(never), "taken_by": took,
            "failover_s_min": round(gaps[0], 4) if gaps else None,
            "failover_s_median": q(0.5), "failover_s_p90": q(0.9),
            "failover_s_max": round(gaps[-1], 4) if gaps else None}


def tools_missing() -> list[str]:
    """What the ECMP lab needs that this host lacks (a test skips on it)."""
    return [t for t in ("bird", "birdc", "tcpdump", "bridge", "nft") if shutil.which(t) is None]


__all__ = ["CLIENT_NET", "ECMP_CLIENT_IP", "MEMBER_ADDRESSES", "MEMBER_AS", "ROUTER_AS",
           "ROUTER_IP", "EcmpLab", "EcmpMember", "EcmpRouter", "FlowCapture", "flow_failover",
           "member_rings", "ring_differences", "ring_shares", "router_conf", "tools_missing"]
