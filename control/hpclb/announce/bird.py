"""BIRD 2 as the BGP speaker: its configuration, rendered from the `bgp:`
section, and its control socket.

hpclb writes two files into ``bgp.config_dir``: ``bird.conf`` (router id,
one BGP protocol per peer, exporting only hpclb's static routes, nothing
imported; BFD when configured) and ``vips.conf`` (two static protocols holding
one route per announced VIP address, with its MED and communities), which
bird.conf includes. Each route goes through the data plane's liveness
interface (``bgp.alive_interface``, a TUN device the data plane holds for its
life): a static device route is valid only while its interface exists and is
up, so BIRD withdraws every VIP by itself, told by the kernel over netlink,
when the data plane dies, even with `hpclb run` dead too. Without one, the
routes are blackholes, withdrawn only by hpclb.

A change is applied with ``configure`` on the control socket: BIRD compares
the new configuration with the running one and restarts only the protocols
whose settings changed; a new vips.conf changes only the static protocols'
routes, so sessions stay up and only UPDATEs are sent.

The socket speaks BIRD's CLI protocol (doc/prog "Remote control"): each
reply line is a 4-digit code, then '-' (more follows) or ' ' (last line), or a
line starting with a space continuing the previous code; codes 8xxx and 9xxx
are errors.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from ipaddress import ip_address
from pathlib import Path

from hpclb.config.bgp import BgpConfig, parse_community

VIPS4 = "hpclb_vips4"
VIPS6 = "hpclb_vips6"
EXPORT = "hpclb_export"  # the peers' export filter, in vips.conf
BFD = "hpclb_bfd"
# A peer's protocol is "bgp_NAME": a peer may then be named like one of
# BIRD's keywords (router, device, static...).
PEER_PREFIX = "bgp_"
HEADER = "# Written by hpclb from the bgp: section of its configuration; do not edit.\n"


class BirdError(Exception):
    """The speaker could not be reached, or refused a command (the message says which)."""


# --- configuration ---------------------------------------------------------------

def _attributes(med: int | None, communities: Iterable[str]) -> str:
    parts = [] if med is None else [f"bgp_med = {med};"]
    for text in communities:
        value = parse_community(text)
        if len(value) == 2:
            parts.append(f"bgp_community.add(({value[0]},{value[1]}));")
        else:
            parts.append(f"bgp_large_community.add(({value[0]},{value[1]},{value[2]}));")
    return " ".join(parts)


def render_vips(config: BgpConfig, announced: Iterable[str],
                device: str | None = None) -> str:
    """vips.conf: one route per announced address (the route exists only to
    be exported: BIRD on the appliance has no kernel protocol), and the export
    filter that gives each its MED and communities. The route goes through
    ``device`` (the data plane's liveness interface: valid only while it
    exists and is up), or is a blackhole when None. The attributes are set in
    the export filter, not on the static routes: BIRD sends an eBGP peer a MED
    only when the export filter set it (RFC 4271 5.1.4)."""
    target = "blackhole" if device is None else f'via "{device}"'
    routes: dict[int, list[str]] = {4: [], 6: []}
    clauses = []
    for address in sorted(announced, key=lambda a: (ip_address(a).version, ip_address(a))):
        addr = ip_address(address)
        net = f"{addr}/{addr.max_prefixlen}"
        routes[addr.version].append(f"  route {net} {target};")
        attrs = _attributes(*config.attributes(address))
        clauses.append(f"  if net = {net} then {{ {attrs + ' ' if attrs else ''}accept; }}")
    out = [HEADER.rstrip("\n"), "# The VIP addresses announced now."]
    for version, name in ((4, VIPS4), (6, VIPS6)):
        out += [f"protocol static {name} {{", f"  ipv{version};", *routes[version], "}"]
    out += [f"filter {EXPORT} {{",
            f'  if proto != "{VIPS4}" && proto != "{VIPS6}" then reject;',
            *clauses, "  reject;", "}"]
    return "\n".join(out) + "\n"


def render_bird(config: BgpConfig, vips_path: Path) -> str:
    """bird.conf for the appliance's speaker."""
    export = f"export filter {EXPORT};"
    lines = [
        HEADER.rstrip("\n"),
        f"router id {config.router_id};",
        # Seconds since the epoch: `show protocols` then gives each session's
        # start in a form the status can turn into an uptime.
        'timeformat protocol "%s";',
        "log stderr { info, remote, warning, error, auth, fatal, bug };",
        "protocol device { scan time 10; }",
        f'include "{vips_path}";',
    ]
    bfd = config.bfd
    if bfd.enabled:
        # One BFD session per BGP peer, requested by its `bfd on;`; the
        # same timers for directly connected and multihop peers.
        timers = f"interval {bfd.interval_ms} ms; multiplier {bfd.multiplier};"
        lines += [f"protocol bfd {BFD} {{", f'  interface "*" {{ {timers} }};',
                  f"  multihop {{ {timers} }};", "}"]
    for peer in config.peers:
        local = f"local {peer.source_address} " if peer.source_address else "local "
        hop4 = "next hop self;" if config.next_hop == "self" else \
            f"next hop address {config.next_hop};"
        hop6 = "next hop self;" if config.next_hop6 is None else \
            f"next hop address {config.next_hop6};"
        if peer.address.version == 6 and config.next_hop == "self":
            hop4 = ""  # no IPv4 VIP goes over it (checked by the schema)
        body = [
            f"  {local}as {config.local_asn};",
            f"  neighbor {peer.address} port {peer.port} as {peer.asn};",
            f"  hold time {peer.hold_time_s or config.hold_time_s};",
            *([f"  multihop {peer.multihop};"] if peer.multihop else []),
            *(["  bfd on;"] if bfd.enabled else []),
            f"  ipv4 {{ {' '.join(filter(None, ('import none;', export, hop4)))} }};",
            f"  ipv6 {{ {' '.join(filter(None, ('import none;', export, hop6)))} }};",
        ]
        lines += [f"protocol bgp {PEER_PREFIX}{peer.name} {{", *body, "}"]
    return "\n".join(lines) + "\n"


def parse_vips(text: str) -> set[str]:
    """The addresses a vips.conf announces (what the speaker announces after a
    control-plane restart, if it was reconfigured with it): blackhole routes
    or routes through the liveness interface."""
    return {str(ip_address(m.group(1)))
            for m in re.finditer(r'^\s*route\s+(\S+)/\d+\s+(?:blackhole|via\s+"[^"]*")\s*;',
                                 text, re.M)}


def write_if_changed(path: Path, text: str) -> bool:
    """Write ``text`` to ``path`` (atomically, 0644: the speaker's user reads
    it) unless it holds it already. True when written."""
    with contextlib.suppress(OSError):
        if path.read_text() == text:
            return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o644)
    tmp.replace(path)
    return True


# --- the control socket -------------------------------------------------------------

@dataclass(frozen=True)
class Reply:
    code: int  # the last line's code
    lines: tuple[tuple[int, str], ...]  # (code, text), continuation lines with their code

    @property
    def text(self) -> str:
        return "\n".join(t for _, t in self.lines)


def read_reply(stream: Iterable[str]) -> Reply:
    """One reply from the lines of the socket (without the greeting)."""
    lines: list[tuple[int, str]] = []
    code = 0
    for raw in stream:
        line = raw.rstrip("\n")
        if line.startswith(" "):
            lines.append((code, line[1:]))
            continue
        m = re.match(r"^(\d{4})([ -])(.*)$", line)
        if m is None:
            raise BirdError(f"unexpected line from BIRD: {line!r}")
        code = int(m.group(1))
        lines.append((code, m.group(3)))
        if m.group(2) == " ":
            return Reply(code, tuple(lines))
    raise BirdError("BIRD closed the connection in the middle of a reply")


def command(sock_path: Path, cmd: str, timeout_s: float = 5.0) -> Reply:
    """Send one CLI command; BirdError when unreachable or refused (8xxx, 9xxx)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(str(sock_path))
            with s.makefile("rw", encoding="utf-8", newline="\n") as f:
                read_reply(f)  # the greeting, 0001 BIRD x.y ready.
                f.write(cmd + "\n")
                f.flush()
                reply = read_reply(f)
    except OSError as err:
        raise BirdError(f"BIRD's control socket {sock_path}: {err.strerror or err}") from None
    if reply.code >= 8000:
        raise BirdError(f"BIRD refused {cmd!r}: {reply.text}")
    return reply


def configure(sock_path: Path, timeout_s: float = 10.0) -> str:
    """Re-read the configuration file (graceful: only changed protocols restart)."""
    return command(sock_path, "configure", timeout_s).text


@dataclass(frozen=True)
class Session:
    name: str
    state: str  # BIRD's protocol state: up, start, down...
    bgp_state: str  # Established, Active, Connect, Idle...
    since: float | None  # seconds since the epoch, of the last state change
    neighbor: str | None
    neighbor_as: int | None
    info: str
    routes_exported: int | None

    def report(self, wall: float) -> dict[str, object]:
        established = self.bgp_state == "Established"
        return {"name": self.name, "peer": self.neighbor, "asn": self.neighbor_as,
                "state": self.bgp_state or self.state, "established": established,
                "since": self.since,
                "uptime_s": (round(wall - self.since, 1)
                             if established and self.since is not None else None),
                "info": self.info, "routes_exported": self.routes_exported}


@dataclass
class _Row:
    """One protocol of `show protocols all` while it is read."""

    name: str
    proto: str
    state: str
    since: float | None
    info: str
    bgp_state: str = ""
    neighbor: str | None = None
    neighbor_as: int | None = None
    exported: int | None = None

    def session(self) -> Session:
        return Session(self.name.removeprefix(PEER_PREFIX), self.state, self.bgp_state,
                       self.since, self.neighbor, self.neighbor_as, self.info, self.exported)


def _since(text: str) -> float | None:
    try:
        return float(text)  # timeformat protocol "%s" (bird.conf)
    except ValueError:
        return None


def parse_protocols(reply: Reply) -> list[Session]:
    """`show protocols all`: the BGP protocols and their state (code 1002 is a
    protocol's summary line, 1006 its details)."""
    rows: list[_Row] = []
    for code, text in reply.lines:
        if code == 1002:
            cols = text.split()
            if len(cols) >= 5 and cols[0] != "Name":
                rows.append(_Row(cols[0], cols[1], cols[3], _since(cols[4]),
                                 " ".join(cols[5:])))
        elif code == 1006 and rows:
            row = rows[-1]
            key, _, value = text.strip().partition(":")
            value = value.strip()
            if key == "BGP state":
                row.bgp_state = value
            elif key == "Neighbor address":
                row.neighbor = value
            elif key == "Neighbor AS" and value.isdigit():
                row.neighbor_as = int(value)
            elif key == "Routes" and (m := re.search(r"(\d+) exported", value)):
                row.exported = (row.exported or 0) + int(m.group(1))
    return [row.session() for row in rows if row.proto == "BGP"]


def show_protocols(sock_path: Path, timeout_s: float = 5.0) -> list[Session]:
    return parse_protocols(command(sock_path, "show protocols all", timeout_s))


def parse_bfd(reply: Reply) -> dict[str, str]:
    """`show bfd sessions`: peer address -> state (Up, Down, Init, AdminDown).
    Each session is a line under code 1020: address, interface ("---" for a
    multihop one), state, since, interval, timeout."""
    out: dict[str, str] = {}
    for code, text in reply.lines:
        cols = text.split()
        if code != 1020 or len(cols) < 3:
            continue
        try:
            out[str(ip_address(cols[0]))] = cols[2]
        except ValueError:
            continue  # the protocol's name, the header
    return out


def show_bfd(sock_path: Path, timeout_s: float = 5.0) -> dict[str, str]:
    return parse_bfd(command(sock_path, "show bfd sessions", timeout_s))


def wait_socket(sock_path: Path, timeout_s: float) -> bool:
    """Wait until BIRD answers on its socket (a lab starting one)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            command(sock_path, "show status", 1.0)
            return True
        except BirdError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
