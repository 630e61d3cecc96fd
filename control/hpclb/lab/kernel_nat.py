"""The kernel's NAT as a baseline: nftables DNAT and conntrack in the gateway lab's
appliance namespace, doing NAT mode's job without hpclb.

A packet to VIP:port (TCP or UDP) opens a conntrack entry whose destination is
rewritten to one backend, chosen by ``numgen random`` (each new connection) or by
``jhash`` over its 4-tuple (the same 4-tuple always lands on the same backend);
conntrack rewrites every later packet of the connection and the replies, which the
backends send back through the appliance (their default route). With ``masquerade``
the connections also leave with the appliance's cluster-side address as source (with
``snat_to``, with that address: a ``GatewayLab(snat_ips=...)`` one), so that the
backends need no route back to the clients. The ruleset (one table, so
that removing it removes exactly what was added)::

    table ip hpclb_kernel_nat {
        chain prerouting {
            type nat hook prerouting priority dstnat; policy accept;
            ip daddr 198.18.1.10 meta l4proto { tcp, udp } th dport 8080 counter
                dnat to numgen random mod 3 map { 0 : 198.19.0.11, 1 : ..., 2 : ... }
        }
        chain postrouting {                   # with masquerade (or snat_to) only
            type nat hook postrouting priority srcnat; policy accept;
            oifname "eth1" ct status dnat counter masquerade   # snat to 198.19.0.2
        }
    }

Only a connection's first packet traverses the nat chains (conntrack does the rest),
so a rule's counter counts connections, not packets. Needs ``nft`` (Debian package
``nftables``) and a kernel with nf_tables, nft_nat, nft_numgen, nft_hash, nft_masq.

An IPv6 VIP (and IPv6 backends) makes the same table in the ``ip6`` family (``ip6
daddr``, ``jhash ip6 saddr . th sport . ip6 daddr . th dport``); the two families'
tables are separate objects, so each is removed on its own (``family=`` of the helpers
below, 4 by default). ``drop_redirects`` adds an output chain that drops the ICMP(v6)
redirects the kernel would send when it forwards out of the interface a packet came in
on (the one-arm lab of ``hpclb.lab.peers``): IPv6 has no sysctl to stop sending them.
"""

from __future__ import annotations

import ipaddress
import json
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from hpclb.lab.gateway import CLUSTER_ETH
from hpclb.lab.topology import Lab, LabError

NFT_TABLE = "hpclb_kernel_nat"
Family = Literal[4, 6]
Balance = Literal["random", "jhash"]
# jhash's seed: fixed, so that a run's placements are reproducible.
JHASH_SEED = 0x68706C62


@dataclass(frozen=True)
class KernelNat:
    """What the kernel is asked to do: ``vip``:``port`` -> ``backends``.

    ``backends`` are addresses; one listed twice takes twice the share (the weights of
    a static pool). ``backend_port``: the port the backends listen on (default: the
    VIP's). ``protocols``: which of tcp, udp. ``masquerade``: also SNAT to the address
    of ``out_ifname`` (the appliance's cluster side); ``snat_to``: to that address.
    """

    vip: str
    port: int
    backends: tuple[str, ...]
    backend_port: int | None = None
    protocols: tuple[str, ...] = ("tcp", "udp")
    balance: Balance = "random"
    masquerade: bool = False
    snat_to: str | None = None
    out_ifname: str = CLUSTER_ETH
    seed: int = JHASH_SEED
    extra: Sequence[str] = field(default=())  # more rules for the prerouting chain
    drop_redirects: bool = False  # an output chain dropping ICMP(v6) redirects

    def __post_init__(self) -> None:
        version = ipaddress.ip_address(self.vip).version
        if not self.backends:
            raise ValueError("kernel NAT needs at least one backend")
        for b in self.backends:
            if ipaddress.ip_address(b).version != version:
                raise ValueError(f"backend {b} is not of the VIP's family (IPv{version})")
        for port in (self.port, self.backend_port or self.port):
            if not 1 <= port <= 65535:
                raise ValueError(f"port {port} not in 1..65535")
        if not self.protocols or set(self.protocols) - {"tcp", "udp"}:
            raise ValueError(f"protocols must be tcp and/or udp, got {self.protocols}")
        if self.balance not in ("random", "jhash"):
            raise ValueError(f"balance must be random or jhash, got {self.balance!r}")
        if self.snat_to is not None:
            if ipaddress.ip_address(self.snat_to).version != version:
                raise ValueError(f"snat_to {self.snat_to} is not of the VIP's family")
            if self.masquerade:
                raise ValueError("masquerade or snat_to, not both")
        if not re.fullmatch(r"[a-zA-Z0-9_.-]{1,15}", self.out_ifname):
            raise ValueError(f"not an interface name: {self.out_ifname!r}")

    @property
    def family(self) -> Family:
        return 6 if ipaddress.ip_address(self.vip).version == 6 else 4


def nft_family(family: int) -> str:
    """nftables' name of IP version ``family``: ``ip`` or ``ip6``."""
    if family not in (4, 6):
        raise ValueError(f"family must be 4 or 6, got {family}")
    return "ip6" if family == 6 else "ip"


def ruleset(nat: KernelNat) -> str:
    """The nftables ruleset (``nft -f`` input) of ``nat``: one table, ``NFT_TABLE``,
    in the ``ip`` family (``ip6`` for an IPv6 VIP)."""
    n = len(nat.backends)
    fam = nft_family(nat.family)
    if nat.backend_port is None or nat.backend_port == nat.port:
        target = "dnat to"
        entries = ", ".join(f"{i} : {b}" for i, b in enumerate(nat.backends))
    else:  # address and port from one map (a concatenation)
        target = f"dnat {fam} to"
        entries = ", ".join(f"{i} : {b} . {nat.backend_port}"
                            for i, b in enumerate(nat.backends))
    if nat.balance == "random":
        pick = f"numgen random mod {n}"
    else:
        pick = (f"jhash {fam} saddr . th sport . {fam} daddr . th dport mod {n} "
                f"seed {nat.seed:#x}")
    protos = ", ".join(nat.protocols)
    match = f"{fam} daddr {nat.vip} meta l4proto {{ {protos} }} th dport {nat.port}"
    lines = [
        f"table {fam} {NFT_TABLE} {{",
        "    chain prerouting {",
        "        type nat hook prerouting priority dstnat; policy accept;",
        f"        {match} counter {target} {pick} map {{ {entries} }}",
        *(f"        {rule}" for rule in nat.extra),
        "    }",
    ]
    if nat.masquerade or nat.snat_to is not None:
        source = "masquerade" if nat.masquerade else f"snat to {nat.snat_to}"
        lines += [
            "    chain postrouting {",
            "        type nat hook postrouting priority srcnat; policy accept;",
            f'        oifname "{nat.out_ifname}" ct status dnat counter {source}',
            "    }",
        ]
    if nat.drop_redirects:
        icmp = "icmpv6 type nd-redirect" if nat.family == 6 else "icmp type redirect"
        lines += [
            "    chain output {",
            "        type filter hook output priority filter; policy accept;",
            f"        {icmp} counter drop",
            "    }",
        ]
    lines.append("}")
    return "\n".join(lines) + "\n"


def nft_missing() -> str | None:
    """Why the baseline cannot run here (no ``nft``), or None."""
    if shutil.which("nft") is None:
        return "nft not found: install Debian's nftables package (./bootstrap does)"
    return None


def install_kernel_nat(lab: Lab, nat: KernelNat) -> str:
    """Load ``nat``'s ruleset into the appliance namespace (replacing one loaded
    before); returns the ruleset. The namespace goes with the lab, the table with it."""
    reason = nft_missing()
    if reason is not None:
        raise LabError(reason)
    text = ruleset(nat)
    remove_kernel_nat(lab, nat.family)
    lab.exec("lb", ["nft", "-f", "-"], input=text)
    return text


def remove_kernel_nat(lab: Lab, family: int = 4) -> bool:
    """Delete the baseline's table (of IP version ``family``) from the appliance
    namespace; True when there was one. Conntrack entries made under it stay until
    they expire or are flushed (``flush_conntrack``)."""
    res = lab.exec("lb", ["nft", "delete", "table", nft_family(family), NFT_TABLE],
                   check=False)
    return res.returncode == 0


def kernel_nat_loaded(lab: Lab, family: int = 4) -> bool:
    return lab.exec("lb", ["nft", "list", "table", nft_family(family), NFT_TABLE],
                    check=False).returncode == 0


def rule_counters(lab: Lab, family: int = 4) -> dict[str, int]:
    """Packets counted by the baseline's rules: ``{"dnat": n, "masquerade": m}``
    (or ``"snat"``; a rule's NAT statement names it); connections, as said above.
    The redirect-dropping rule (``drop_redirects``) is not counted here."""
    out = lab.exec("lb", ["nft", "-j", "list", "table", nft_family(family), NFT_TABLE]).stdout
    counts: dict[str, int] = {}
    for item in json.loads(out)["nftables"]:
        rule = item.get("rule")
        if rule is None:
            continue
        packets = next((s["counter"]["packets"] for s in rule["expr"] if "counter" in s), None)
        verdict = next((k for s in rule["expr"] for k in s
                        if k in ("dnat", "snat", "masquerade")), None)
        if packets is not None and verdict is not None:
            counts[verdict] = counts.get(verdict, 0) + int(packets)
    return counts


@dataclass(frozen=True)
class ConntrackEntry:
    """One conntrack entry: the original direction's tuple and the reply's."""

    proto: str
    orig: tuple[str, str, int, int]  # src, dst, sport, dport
    reply: tuple[str, str, int, int]

    @property
    def backend(self) -> str:
        """Where the connection was sent: the reply's source."""
        return self.reply[0]

    @property
    def snat(self) -> bool:
        """The backend saw another source than the client (masquerade)."""
        return self.reply[1] != self.orig[0]


def conntrack_entries(lab: Lab, ns: str = "lb") -> list[ConntrackEntry]:
    """The conntrack table of namespace ``ns`` (``/proc/net/nf_conntrack`` as seen
    from inside it; ``conntrack -L`` where the kernel has no such file)."""
    res = lab.exec(ns, ["cat", "/proc/net/nf_conntrack"], check=False)
    text = res.stdout
    if res.returncode != 0:
        if shutil.which("conntrack") is None:
            raise LabError("no /proc/net/nf_conntrack and no conntrack tool")
        text = lab.exec(ns, ["conntrack", "-L"], check=False).stdout
    return [e for line in text.splitlines() if (e := _parse_conntrack(line)) is not None]


def flush_conntrack(lab: Lab, ns: str = "lb") -> None:
    """Forget every connection of namespace ``ns`` (``conntrack -F``; needs the tool)."""
    if shutil.which("conntrack") is None:
        raise LabError("conntrack not found: install Debian's conntrack package")
    lab.exec(ns, ["conntrack", "-F"], check=False)


def _parse_conntrack(line: str) -> ConntrackEntry | None:
    words = line.split()
    proto = next((w for w in words if w in ("tcp", "udp", "icmp")), None)
    fields: dict[str, list[str]] = {}
    for w in words:
        key, eq, value = w.partition("=")
        if eq:
            fields.setdefault(key, []).append(value)
    try:
        src, dst = fields["src"], fields["dst"]
        sport, dport = fields["sport"], fields["dport"]
        orig = (src[0], dst[0], int(sport[0]), int(dport[0]))
        reply = (src[1], dst[1], int(sport[1]), int(dport[1]))
    except (KeyError, IndexError, ValueError):
        return None  # ICMP and the like: no ports
    return ConntrackEntry(proto or "?", orig, reply)


def nat_for_lab(lab: Lab, vip: str | None = None, port: int = 8080, **kwargs: Any) -> KernelNat:
    """The baseline for ``lab``: its first VIP (or ``vip``), ``port``, every backend
    (their IPv6 addresses for an IPv6 ``vip``)."""
    vip = vip or lab.vips[0]
    if ":" in vip:
        backends = tuple(lab.ip6_of(f"b{i}") for i in range(1, lab.backends + 1))
    else:
        backends = tuple(lab.backend_ip(i) for i in range(1, lab.backends + 1))
    return KernelNat(vip=vip, port=port, backends=backends, **kwargs)
