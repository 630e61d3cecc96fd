"""A delay line for a lab node's TCP SYN-ACKs, where netem is not in the kernel.

The lab's kernels are built without ``sch_netem`` (and ``sch_fq``, which
honours departure times), so a fixed delay is made here: on the node, a
``clsact`` egress filter (u32) steals every IPv4 TCP SYN-ACK leaving
``IFACE`` from ``PORT`` and redirects it (mirred) into one end of a veth
pair; this program reads it from the other end, holds it ``DELAY_MS`` and
sends it out of ``IFACE`` with ``PACKET_QDISC_BYPASS`` (so the filter does not
see it again). A stolen frame's TCP checksum may be partial (the stack leaves
it to the device), so it is computed here before sending.

Only the handshake is delayed: a TCP probe's round trip (connect) grows by
``DELAY_MS``; nothing else changes.

    python delay_line.py run IFACE PORT DELAY_MS  # installs, prints "ready", runs until killed
    python delay_line.py remove IFACE             # the filter and the pair

Run inside the node's namespace (``ip netns exec``).
"""

from __future__ import annotations

import heapq
import select
import socket
import struct
import subprocess
import sys
import time

STEAL_A, STEAL_B = "dly0", "dly1"  # the veth pair the stolen frames cross
ETH_P_ALL = 0x0003
ETH_P_IP = b"\x08\x00"
SOL_PACKET = 263
PACKET_QDISC_BYPASS = 20
TCP_SYN_ACK = 0x12


def sh(*argv: str, check: bool = True) -> None:
    subprocess.run(argv, check=check, capture_output=True, text=True)


def add_pair() -> None:
    sh("ip", "link", "add", STEAL_A, "type", "veth", "peer", "name", STEAL_B)
    for name in (STEAL_A, STEAL_B):
        sh("ip", "link", "set", name, "up")


def add_filter(iface: str, port: int) -> None:
    sh("tc", "qdisc", "add", "dev", iface, "clsact")
    # IP header without options (20 bytes): protocol at 9, source port at 20,
    # TCP flags at 20 + 13.
    sh("tc", "filter", "add", "dev", iface, "egress", "protocol", "ip", "prio", "1", "u32",
       "match", "ip", "protocol", "6", "0xff", "match", "ip", "sport", str(port), "0xffff",
       "match", "u8", str(TCP_SYN_ACK), "0xff", "at", "33",
       "action", "mirred", "egress", "redirect", "dev", STEAL_A)


def remove(iface: str) -> None:
    sh("tc", "qdisc", "del", "dev", iface, "clsact", check=False)
    sh("ip", "link", "del", STEAL_A, check=False)


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def with_tcp_checksum(frame: bytes) -> bytes:
    """An Ethernet + IPv4 + TCP frame with its TCP checksum computed."""
    ip = frame[14:]
    ihl = (ip[0] & 0x0F) * 4
    total = struct.unpack("!H", ip[2:4])[0]
    segment = bytearray(ip[ihl:total])
    segment[16:18] = b"\0\0"
    pseudo = ip[12:20] + struct.pack("!BBH", 0, 6, len(segment))
    segment[16:18] = struct.pack("!H", _checksum(pseudo + bytes(segment)))
    return frame[:14 + ihl] + bytes(segment) + frame[14 + total:]


def run(iface: str, port: int, delay_ms: float) -> None:
    delay = delay_ms / 1000.0
    add_pair()
    rx = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    rx.bind((STEAL_B, ETH_P_ALL))
    tx = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
    tx.setsockopt(SOL_PACKET, PACKET_QDISC_BYPASS, 1)
    tx.bind((iface, 0))
    # Stealing starts only once the reader is there: no handshake is lost.
    add_filter(iface, port)
    print("ready", flush=True)
    held: list[tuple[float, int, bytes]] = []
    seq = 0
    while True:
        timeout = max(0.0, held[0][0] - time.monotonic()) if held else None
        if select.select([rx], [], [], timeout)[0]:
            frame, addr = rx.recvfrom(65535)
            # Only what the filter stole: the pair's own traffic (IPv6 neighbour
            # discovery...) is not IPv4 TCP, or leaves this end (outgoing).
            if (addr[2] != socket.PACKET_OUTGOING and frame[12:14] == ETH_P_IP
                    and len(frame) > 34 and frame[23] == 6):
                seq += 1
                heapq.heappush(held, (time.monotonic() + delay, seq, with_tcp_checksum(frame)))
        while held and held[0][0] <= time.monotonic():
            tx.send(heapq.heappop(held)[2])


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[0] == "run":
        run(argv[1], int(argv[2]), float(argv[3]))
    elif len(argv) == 2 and argv[0] == "remove":
        remove(argv[1])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
