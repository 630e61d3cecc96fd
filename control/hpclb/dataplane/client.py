"""Client side of the table protocol (dataplane/common/PROTOCOL.md).

One request, one reply, over a ZeroMQ REQ socket. A reply that does not come
within the timeout raises ``DataplaneTimeout`` and the socket is rebuilt, since
a REQ socket that missed its reply cannot send again.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgpack
import numpy as np
import zmq

from hpclb.contract.tables import (
    CONN_STATE_NAMES,
    GUE_PORT_DEFAULT,
    PROTOCOL_VERSION,
    RING_PATCH_DTYPE,
    Backend,
    BackendState,
    Encap,
    IPAddress,
    NatConfig,
    Vip,
    VipMode,
    mac_bytes,
)


class DataplaneError(RuntimeError):
    """The data plane refused a request (its reply had ok=false)."""


class DataplaneTimeout(DataplaneError):
    """No reply within the timeout: the data plane is down or wedged."""


def version_mismatch(peer_version: object) -> DataplaneError:
    """The error for a data plane that speaks another table protocol version."""
    return DataplaneError(
        f"data plane speaks table protocol version {peer_version}, this control plane "
        f"speaks {PROTOCOL_VERSION}: install matching builds (./bootstrap)"
    )


def check_version(reply: dict[str, Any]) -> None:
    """Raise ``version_mismatch`` when a reply comes from a peer of another version.

    A data plane refuses every request of another version with an error reply
    that carries its own ``v`` (PROTOCOL.md, Versioning): that is how an older
    or newer peer shows; every reply carries ``v``, and ``hello`` also says
    ``version``.
    """
    if reply.get("v") != PROTOCOL_VERSION:
        raise version_mismatch(reply.get("v"))
    if "version" in reply and reply["version"] != PROTOCOL_VERSION:
        raise version_mismatch(reply["version"])


def snat_order(addrs: Iterable[IPAddress]) -> tuple[IPAddress, ...]:
    """A SNAT pool in the order a data plane holds and dumps it (PROTOCOL.md,
    set_nat and dump): the IPv4 addresses, then the IPv6 ones, each family in
    the given order. set_nat sends it so, and push compares pools so, so that
    a dump read back equals what was sent."""
    addrs = tuple(addrs)
    return (tuple(a for a in addrs if a.version == 4)
            + tuple(a for a in addrs if a.version == 6))


def tunnel_fields(vip: Vip) -> dict[str, int]:
    """set_vip's tunnel fields for ``vip`` (PROTOCOL.md, set_vip): all of them
    for a tunnel VIP (``gue_port`` with GUE only, ``GUE_PORT_DEFAULT`` when 0);
    for another mode none, unless the Vip sets one, which is then sent for the
    data plane to refuse with its error rather than silently dropped."""
    tunnel = vip.mode == VipMode.TUNNEL
    fields: dict[str, int] = {}
    if tunnel or vip.tunnel_encap != Encap.IPIP:
        fields["tunnel_encap"] = int(vip.tunnel_encap)
    if vip.gue_port:
        fields["gue_port"] = int(vip.gue_port)
    elif tunnel and vip.tunnel_encap == Encap.GUE:
        fields["gue_port"] = GUE_PORT_DEFAULT
    if tunnel or vip.tunnel_src_bits:
        fields["tunnel_src_bits"] = int(vip.tunnel_src_bits)
    return fields


class DataplaneClient:
    def __init__(self, endpoint: str, timeout_s: float = 5.0) -> None:
        self.endpoint = endpoint
        self.timeout_ms = int(timeout_s * 1000)
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket[bytes] | None = None
        self._seq = 0

    def _socket(self) -> zmq.Socket[bytes]:
        if self._sock is None:
            sock: zmq.Socket[bytes] = self._ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
            sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def send_raw(self, payload: bytes) -> dict[str, Any]:
        """Send bytes as they are (tests use this for malformed messages)."""
        sock = self._socket()
        try:
            sock.send(payload)
            reply = sock.recv()
        except zmq.Again as exc:
            self.close()
            raise DataplaneTimeout(f"no reply from {self.endpoint}") from exc
        decoded = msgpack.unpackb(reply, raw=False)
        if not isinstance(decoded, dict):
            raise DataplaneError(f"malformed reply from {self.endpoint}: {decoded!r}")
        return decoded

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        self._seq += 1
        request = {"v": PROTOCOL_VERSION, "op": op, "seq": self._seq, **fields}
        reply = self.send_raw(msgpack.packb(request, use_bin_type=True))
        check_version(reply)
        if not reply.get("ok"):
            raise DataplaneError(f"{op}: {reply.get('error', 'error without a message')}")
        return reply

    # --- operations ------------------------------------------------------

    def hello(self) -> dict[str, Any]:
        """The data plane's facts. Raises DataplaneError when it speaks another
        table protocol version than this control plane."""
        return self.call("hello")

    def set_config(self, hash_key: bytes) -> None:
        self.call("set_config", hash_key=hash_key)

    def set_vip(self, vip: Vip, ring: np.ndarray | None = None) -> None:
        """Add a VIP; with ``ring``, its ring is written before the VIP goes live."""
        fields: dict[str, Any] = {
            "vip_id": vip.vip_id, "addr": vip.addr.packed, "port": vip.port,
            "proto": vip.proto, "mode": int(vip.mode), "nat_port": vip.nat_port,
        }
        if vip.tunnel_src is not None:
            fields["tunnel_src"] = vip.tunnel_src.packed
        if vip.snat:  # only when set: a request without it reads as before
            fields["snat"] = True
        fields.update(tunnel_fields(vip))
        if ring is not None:
            fields["slots"] = ring.astype("<u4").tobytes()
        self.call("set_vip", **fields)

    def del_vip(self, addr: IPAddress, port: int, proto: int) -> None:
        self.call("del_vip", addr=addr.packed, port=port, proto=proto)

    def set_backends(self, backends: list[Backend]) -> None:
        self.call(
            "set_backends",
            backends=[
                {
                    "id": b.backend_id,
                    "addr": b.addr.packed,
                    "mac": mac_bytes(b.mac),
                    "state": int(b.state),
                    "port": b.port,
                }
                for b in backends
            ],
        )

    def set_backend_state(self, backend_id: int, state: BackendState) -> None:
        self.call("set_backend_state", id=backend_id, state=int(state))

    def set_ring(self, vip_id: int, ring: np.ndarray) -> None:
        self.call("set_ring", vip_id=vip_id, slots=ring.astype("<u4").tobytes())

    def patch_ring(self, vip_id: int, slots: np.ndarray, values: np.ndarray) -> None:
        patch = np.empty(len(slots), dtype=RING_PATCH_DTYPE)
        patch["slot"] = slots
        patch["backend"] = values
        self.call("patch_ring", vip_id=vip_id, patch=patch.tobytes())

    def get_ring(self, vip_id: int) -> np.ndarray:
        reply = self.call("get_ring", vip_id=vip_id)
        return np.frombuffer(reply["slots"], dtype="<u4").copy()

    def set_nat(self, nat: NatConfig) -> None:
        """Replace the data plane's whole NAT configuration (every field is sent;
        the SNAT pool in ``snat_order``: IPv4, then IPv6)."""
        if len(nat.timeouts_s) != len(CONN_STATE_NAMES):
            raise ValueError(f"NatConfig.timeouts_s has {len(nat.timeouts_s)} entries, "
                             f"one per connection state ({len(CONN_STATE_NAMES)}) expected")
        self.call(
            "set_nat",
            snat_addrs=[a.packed for a in snat_order(nat.snat_addrs)],
            snat_port_min=nat.snat_port_min,
            snat_port_max=nat.snat_port_max,
            on_backend_down=int(nat.on_backend_down),
            timeouts=dict(zip(CONN_STATE_NAMES, (int(t) for t in nat.timeouts_s), strict=True)),
        )

    def dump(self) -> dict[str, Any]:
        return self.call("dump")

    def stats(self) -> dict[str, Any]:
        """The reply as it comes: ``counters``, ``vips``, ``backends``, and from
        the data planes that have them ``ports`` and (NAT mode) ``conns``:
        ``{"capacity", "entries", "by_state": {state name: connections},
        "snat_ports_in_use", "expired"}``, an empty map when the data plane
        could not read its connection table."""
        return self.call("stats")
