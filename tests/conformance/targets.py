"""The data planes the conformance suite runs against.

Every target takes tables (pushed through the real table protocol where the
target is a real data plane) and answers ``run(frame) -> (action, frame_out)``.
The model itself (``hpclb.model``) is the oracle every target is compared
with, and the model-only run of the suite checks the cases' own expectations
against it. The XDP target is the real ``lb_xdp``
program loaded and fed by the real ``hpclb-xdp`` daemon, run on each frame
with BPF_PROG_TEST_RUN.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path
from typing import Protocol

from hpclb.dataplane.bpf_testrun import PinnedXdpProgram
from hpclb.dataplane.push import push_tables
from hpclb.dataplane.supervisor import DataplaneProcess, find_xdp_daemon
from hpclb.dataplane.tables import TableSet, mac_str


class Target(Protocol):
    name: str
    port_macs: list[str]
    min_frame: int

    def load(self, current: TableSet | None, desired: TableSet) -> None: ...

    def run(self, frame: bytes) -> tuple[str, bytes]: ...

    def counters(self) -> dict[str, int]: ...

    def close(self) -> None: ...


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


class XdpTarget:
    """hpclb-xdp --no-attach in a scratch namespace; frames via BPF_PROG_TEST_RUN."""

    name = "xdp"
    # The kernel refuses test runs of frames shorter than an Ethernet header.
    min_frame = 14

    def __init__(self, workdir: Path) -> None:
        tag = uuid.uuid4().hex[:8]
        self.netns = f"hlbc-{tag}"
        self.pin_dir = f"/sys/fs/bpf/hpclb/conf-{tag}"
        endpoint = f"ipc://{workdir}/dp.sock"
        self.dataplane = DataplaneProcess(
            argv=[find_xdp_daemon(), "--netns", self.netns, "--iface", "in0", "--egress",
                  "out0", "--no-attach", "--pin-dir", self.pin_dir, "--socket", endpoint],
            endpoint=endpoint,
            pidfile=workdir / "hpclb-xdp.pid",
            log_path=workdir / "hpclb-xdp.log",
        )
        self.client = self.dataplane.client
        _sh("ip", "netns", "add", self.netns)
        try:
            for a, b in (("in0", "in1"), ("out0", "out1")):
                _sh("ip", "-n", self.netns, "link", "add", a, "type", "veth", "peer", "name", b)
                _sh("ip", "-n", self.netns, "link", "set", a, "up")
                _sh("ip", "-n", self.netns, "link", "set", b, "up")
            self.dataplane.start()  # returns once the daemon answers hello
            hello = self.client.hello()
            self.port_macs = [mac_str(bytes(p["mac"])) for p in hello["ports"]]
            self.prog = PinnedXdpProgram(f"{self.pin_dir}/lb_xdp")
            self._affinity = os.sched_getaffinity(0)
        except BaseException:
            self.close()
            raise

    def set_cpu(self, cpu: int) -> None:
        """Run the next frames on ``cpu`` (as RSS would steer another queue)."""
        os.sched_setaffinity(0, {cpu})

    def load(self, current: TableSet | None, desired: TableSet) -> None:
        push_tables(self.client, current, desired)

    def run(self, frame: bytes) -> tuple[str, bytes]:
        return self.prog.run(frame)

    def counters(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.client.stats()["counters"].items()}

    def close(self) -> None:
        if hasattr(self, "prog"):
            self.prog.close()
        self.dataplane.stop()
        if hasattr(self, "_affinity"):
            os.sched_setaffinity(0, self._affinity)
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, check=False)
        subprocess.run(["rm", "-rf", self.pin_dir], capture_output=True, check=False)
