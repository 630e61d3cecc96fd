"""Run a pinned XDP program on one frame with BPF_PROG_TEST_RUN.

The conformance suite uses this to drive the real, loaded ``lb_xdp`` program
(the one the daemon pinned, with the maps the daemon filled through the table
protocol) without a network. Two bpf(2) commands are all it takes, so this
talks to the syscall through ctypes rather than pulling in a BPF library.

A frame may be run as if it arrived on a given interface (``ingress_ifindex``):
the test run then passes a ``struct xdp_md`` context naming it, so that the
program's ``ctx->ingress_ifindex`` (and its rx queue) are that device's. The
kernel resolves the index in the calling thread's network namespace, so the
caller runs the test inside the namespace the interface lives in
(``hpclb.host.netns.inside``). Without one, the kernel runs the program "on"
the loopback device of the caller's namespace, as before.

``run_live`` runs a program in live-frame mode (BPF_F_TEST_XDP_LIVE_FRAMES,
for perf/packet_cost.py): the kernel carries out the verdicts, XDP_TX
really transmits out of the ingress interface (as a redirect to it: the
device needs ndo_xdp_xmit; a veth, whose peer runs an XDP program), and
nothing comes back but the time. Frames live in pages of a pool the size of
a batch; a recycled page is handed to the program with data and data_end
reset but its bytes as the program left them, so from the second batch on a
program that rewrites frames sees its own output (the caller designs its
frames for that, or runs one batch per call: fresh pages only).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

_BPF_SYSCALL = {"x86_64": 321, "aarch64": 280}
BPF_OBJ_GET = 7
BPF_PROG_TEST_RUN = 10

BPF_F_TEST_XDP_LIVE_FRAMES = 1 << 1
LIVE_BATCH_MAX = 256  # the kernel's TEST_XDP_MAX_BATCH
XDP_ACTIONS = {0: "aborted", 1: "drop", 2: "pass", 3: "tx", 4: "redirect"}


class _ObjGetAttr(ctypes.Structure):
    _fields_ = (
        ("pathname", ctypes.c_uint64),
        ("bpf_fd", ctypes.c_uint32),
        ("file_flags", ctypes.c_uint32),
        ("path_fd", ctypes.c_int32),
        ("_pad", ctypes.c_uint8 * 108),
    )


class _TestRunAttr(ctypes.Structure):
    _fields_ = (
        ("prog_fd", ctypes.c_uint32),
        ("retval", ctypes.c_uint32),
        ("data_size_in", ctypes.c_uint32),
        ("data_size_out", ctypes.c_uint32),
        ("data_in", ctypes.c_uint64),
        ("data_out", ctypes.c_uint64),
        ("repeat", ctypes.c_uint32),
        ("duration", ctypes.c_uint32),
        ("ctx_size_in", ctypes.c_uint32),
        ("ctx_size_out", ctypes.c_uint32),
        ("ctx_in", ctypes.c_uint64),
        ("ctx_out", ctypes.c_uint64),
        ("flags", ctypes.c_uint32),
        ("cpu", ctypes.c_uint32),
        ("batch_size", ctypes.c_uint32),
        ("_pad", ctypes.c_uint8 * 60),
    )


class _XdpMd(ctypes.Structure):
    """struct xdp_md as a test run's ctx_in: data 0 (no metadata), data_end the
    frame's length, the ingress device; the rest 0 (the kernel refuses an
    egress_ifindex, and a queue other than 0 needs a device that has it)."""

    _fields_ = (
        ("data", ctypes.c_uint32),
        ("data_end", ctypes.c_uint32),
        ("data_meta", ctypes.c_uint32),
        ("ingress_ifindex", ctypes.c_uint32),
        ("rx_queue_index", ctypes.c_uint32),
        ("egress_ifindex", ctypes.c_uint32),
    )


class BpfError(OSError):
    pass


class PinnedXdpProgram:
    """An XDP program pinned in bpffs, opened for test runs."""

    def __init__(self, pin_path: str) -> None:
        self._libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self._nr = _BPF_SYSCALL[platform.machine()]
        path = ctypes.create_string_buffer(pin_path.encode())
        attr = _ObjGetAttr(pathname=ctypes.addressof(path))
        self.fd = self._bpf(BPF_OBJ_GET, attr)

    def _bpf(self, cmd: int, attr: ctypes.Structure) -> int:
        ret = self._libc.syscall(
            self._nr, ctypes.c_int(cmd), ctypes.byref(attr), ctypes.c_uint(ctypes.sizeof(attr))
        )
        if ret < 0:
            err = ctypes.get_errno()
            raise BpfError(err, f"bpf(cmd={cmd}): {os.strerror(err)}")
        return int(ret)

    def run(self, frame: bytes, ingress_ifindex: int = 0) -> tuple[str, bytes]:
        """Run the program once on ``frame``; return (action, frame as it left).
        ``ingress_ifindex``: the device the frame arrives on (0: none given,
        the loopback device); it must exist in the calling thread's namespace."""
        action, out, _ = self.run_repeated(frame, 1, ingress_ifindex)
        return action, out

    def run_repeated(self, frame: bytes, repeat: int,
                     ingress_ifindex: int = 0) -> tuple[str, bytes, int]:
        """Run ``repeat`` times in the kernel; also return the mean ns per run."""
        data_in = ctypes.create_string_buffer(frame, len(frame))
        out_len = len(frame) + 256
        data_out = ctypes.create_string_buffer(out_len)
        attr = _TestRunAttr(
            prog_fd=self.fd,
            data_size_in=len(frame),
            data_size_out=out_len,
            data_in=ctypes.addressof(data_in),
            data_out=ctypes.addressof(data_out),
            repeat=repeat,
        )
        if ingress_ifindex:
            ctx = _XdpMd(data=0, data_end=len(frame), ingress_ifindex=ingress_ifindex)
            attr.ctx_size_in = ctypes.sizeof(ctx)
            attr.ctx_in = ctypes.addressof(ctx)
        self._bpf(BPF_PROG_TEST_RUN, attr)
        action = XDP_ACTIONS.get(attr.retval, f"unknown({attr.retval})")
        return action, data_out.raw[: attr.data_size_out], int(attr.duration)

    def run_live(self, frame: bytes, repeat: int, ingress_ifindex: int,
                 batch_size: int = 64) -> int:
        """Run ``repeat`` times in live-frame mode "on" ``ingress_ifindex``
        (which must exist in the calling thread's namespace), in batches of
        ``batch_size``; return the kernel's mean ns per run."""
        if not 1 <= batch_size <= LIVE_BATCH_MAX:
            raise ValueError(f"batch_size {batch_size}: 1..{LIVE_BATCH_MAX}")
        data_in = ctypes.create_string_buffer(frame, len(frame))
        ctx = _XdpMd(data=0, data_end=len(frame), ingress_ifindex=ingress_ifindex)
        attr = _TestRunAttr(
            prog_fd=self.fd,
            data_size_in=len(frame),
            data_in=ctypes.addressof(data_in),
            repeat=repeat,
            ctx_size_in=ctypes.sizeof(ctx),
            ctx_in=ctypes.addressof(ctx),
            flags=BPF_F_TEST_XDP_LIVE_FRAMES,
            batch_size=batch_size,
        )
        self._bpf(BPF_PROG_TEST_RUN, attr)
        return int(attr.duration)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
