"""Crafted tunnel frames for the tunnel lab: what the appliance sends in tunnel mode
(dataplane/common/lb_encap.h), made with scapy and injected on the appliance's
``eth0``, so that the lab's router and the backends' decapsulation program are tested
without a data plane; and a one-datagram receiver on the client that waits for the
backend's DSR answer."""

from __future__ import annotations

import json
import subprocess
import sys

from hpclb.lab.tunnel import TunnelLab

# Run in the appliance's namespace: argv = outer_family encap inner_family dst_mac
# outer_src outer_dst client vip sport gue_port [bad]
INJECT = r"""
import sys
from scapy.all import Ether, IP, IPv6, UDP, Raw, sendp
of, encap, inf, dmac, osrc, odst, cli, vip, sport, gport = sys.argv[1:11]
bad = len(sys.argv) > 11
inner = (IP(src=cli, dst=vip) if inf == "4" else IPv6(src=cli, dst=vip)) / UDP(
    sport=int(sport), dport=8080) / Raw(b"who\n")
raw = bytes(inner)
if bad:  # a GUE variant 0 header's first nibble: not an IP packet
    raw = bytes([0x50]) + raw[1:]
proto = 4 if inf == "4" else 41
if encap == "gue":
    payload = UDP(sport=49152, dport=int(gport), chksum=0) / Raw(raw)
    proto = 17
else:
    payload = Raw(raw)
outer = (IP(src=osrc, dst=odst, proto=proto, flags="DF") if of == "4"
         else IPv6(src=osrc, dst=odst, nh=proto))
sendp(Ether(dst=dmac) / outer / payload, iface="eth0", verbose=False)
"""

# Run in the client's namespace: argv = family sport vip; prints the answer or "".
RECEIVE = r"""
import socket, sys
fam = socket.AF_INET6 if sys.argv[1] == "6" else socket.AF_INET
s = socket.socket(fam, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("::" if fam == socket.AF_INET6 else "0.0.0.0", int(sys.argv[2])))
s.connect((sys.argv[3], 8080))
s.settimeout(float(sys.argv[4]))
print("ready", flush=True)
try:
    print(s.recv(256).decode().strip(), flush=True)
except OSError:
    print("", flush=True)
"""


def inject_and_receive(lab: TunnelLab, *, outer: int, encap: str, inner: int, backend: int,
                       vip: str, sport: int, gue_port: int | None = None, bad: bool = False,
                       wait: float = 3.0) -> str:
    """One crafted tunnel frame from the appliance to backend ``backend`` (through the
    router) carrying a client's datagram to ``vip``; the answer the client got (the
    backend's name) or "" when none came within ``wait`` seconds of the frame's
    sending."""
    # The receiver waits long: scapy's import in the injector alone takes seconds.
    recv = lab.popen("cli", [sys.executable, "-c", RECEIVE, str(inner), str(sport), vip,
                             str(wait + 60)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert recv.stdout is not None
        assert recv.stdout.readline().strip() == "ready"
        src = "198.18.0.241" if outer == 4 else "fd48:4c00::f1"
        dst = lab.backend_ip(backend) if outer == 4 else lab.ip6_of(f"b{backend}")
        cli = lab.ip_of("cli") if inner == 4 else lab.ip6_of("cli")
        lab.exec("lb", [sys.executable, "-c", INJECT, str(outer), encap, str(inner),
                        lab.backend_mac(f"b{backend}"), src, dst, cli, vip, str(sport),
                        str(gue_port or lab.gue_port), *(["bad"] if bad else [])])
        try:
            out, _ = recv.communicate(timeout=wait)
        except subprocess.TimeoutExpired:
            out = ""  # nothing came back
    finally:
        lab.stop_process(recv)
    return out.strip()


def stats_json(lab: TunnelLab) -> str:
    return json.dumps({i: lab.decap_stats(i) for i in range(1, lab.backends + 1)})
