"""Lab: a restart of the control plane continues from its state checkpoint.

Client, appliance and three backends in network namespaces, as in test_e2e;
the XDP data plane (it forwards on its own while `hpclb run` is dead); a
dynamic pool with a TCP probe and a real agent per backend. Backend b2 is cut
off (link down: its probe fails, its agent goes quiet); then `hpclb run` is
killed (-9) and started again. Without the checkpoint the new control plane
would think b2 up (health starts "up"), push it UP and take it down again a
probe fall later, and start every dynamic weight from the floor; with it:

1. b2 is DOWN from the first moment and never shown up (no flap), the first
   push finds everything in place (all zeros in its report), the weights
   decided at start are those decided before the kill, and when b2's link
   comes back it returns after the probe's rise;
2. a corrupted state.json at a restart: the previous checkpoint is used, the
   corruption is in the log and on the status's alarm list, and still nothing
   is pushed again.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from hpclb.lab.appliance import LAB_PORT, LAB_VIP, LabAppliance
from hpclb.lab.topology import Lab, default_pass_obj

from .conftest import AGENT_NAMES, Keys, agents_heard

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="lab tests need root (network namespaces, veth, XDP)")

WEIGHTS = {"b1": 1.0, "b2": 1.0, "b3": 3.0}
PROBE: dict[str, Any] = {"kind": "tcp", "port": LAB_PORT, "interval_s": 0.5, "timeout_s": 0.5,
                         "rise": 2, "fall": 3, "damping": {"enabled": False}}
# No rate limit and a coarse hysteresis: the weights of idle backends hold still,
# so "the same as before the kill" is exact; no slow start to ramp through.
POLICY: dict[str, Any] = {"max_rate": None, "step": 0.3, "slow_start_s": 0,
                          "stale_after_s": 60.0}
AGENT_INTERVAL_S = 0.5
NOTHING_PUSHED = ("key=same backends=0 vips=0 vips_deleted=0 full_rings=0 patched_slots=0")


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with Lab(prefix=f"s{uuid.uuid4().hex[:6]}", backends=3,
             peer_xdp_pass=default_pass_obj()) as lab:
        lab.start_backends(LAB_PORT, udp=True)
        yield lab


class FrequentCheckpoints(LabAppliance):
    """The lab appliance with a checkpoint every second (the least allowed):
    once nothing moves, the previous checkpoint holds what the current one
    does, so a restart from either must find everything in place."""

    def config(self) -> dict[str, Any]:
        config = super().config()
        config["appliance"]["checkpoint_interval_s"] = 1.0
        return config


@pytest.fixture(scope="module")
def appliance(lab: Lab, keys: Keys,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[LabAppliance]:
    """`hpclb run` on XDP with every agent heard and every backend up."""
    workdir = tmp_path_factory.mktemp("restart")
    app = FrequentCheckpoints(lab, workdir, WEIGHTS, dataplane="xdp", weights_mode="dynamic",
                             policy=POLICY, probe=PROBE,
                             telemetry={"server_key": str(keys.secret("server")),
                                        "allow_dir": str(keys.allow),
                                        "handshake_timeout_s": 1.0})
    with app:
        try:
            with agents_heard(lab, app, keys, AGENT_NAMES, AGENT_INTERVAL_S, workdir,
                              lambda s: set(s.get("inputs", {})) == set(WEIGHTS)):
                yield app
        finally:
            lab.set_backend_link(2, up=True)


def checkpoint(app: LabAppliance, name: str = "state.json") -> dict[str, Any]:
    body: dict[str, Any] = json.loads((app.workdir / "state" / name).read_bytes())["body"]
    return body


def settled(app: LabAppliance) -> dict[str, Any]:
    """Wait until nothing moved for a while and both checkpoints (current and
    previous, one a second) were written after the last push; returns the
    current one's body."""
    def still(s: dict[str, Any]) -> bool:
        written, pushed = s["checkpoint"]["written_at"], s["push"]["last_at"]
        return written is not None and pushed is not None and written > pushed + 2.0 \
            and time.time() - pushed > 3.0
    app.wait_status(still, timeout_s=60, what="checkpoint written after the last push")
    return checkpoint(app)


def pushes_since(app: LabAppliance, mark: int) -> list[str]:
    lines = app.log_text_full()[mark:].splitlines()
    return [line for line in lines if "pushed tables" in line]


def restart(app: LabAppliance) -> int:
    """kill -9 `hpclb run` and start it again; returns the log offset of the start."""
    app.kill()
    mark = len(app.log_text_full())
    app.start()
    return mark


def watch_b2_down(app: LabAppliance, seconds: float) -> list[dict[str, Any]]:
    """Every status seen for ``seconds``: b2 must never be up in any."""
    seen = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        status = app.wait_status(lambda s: True, timeout_s=10)
        assert status["health"]["b2"]["up"] is False, status["health"]
        assert status["states"]["b2"] == "down", status["states"]
        seen.append(status)
        time.sleep(0.2)
    return seen


def ring_of(app: LabAppliance) -> list[int]:
    return [int(x) for x in app.client.get_ring(0)]


def test_a_restart_continues_from_the_checkpoint(lab: Lab, appliance: LabAppliance) -> None:
    app = appliance
    lab.set_backend_link(2, up=False)
    app.wait_status(lambda s: s["states"]["b2"] == "down", timeout_s=30, what="b2 down")
    before = settled(app)
    assert {d["name"]: d["state"] for d in before["pushed"]["decisions"]["lab"]}["b2"] == "down"
    weights = {d["name"]: d["weight"] for d in before["pushed"]["decisions"]["lab"]}
    assert weights["b1"] > 2 * 0.05 and weights["b3"] > 2 * weights["b1"]  # not the floor
    ring = ring_of(app)
    killed_at = time.time()

    mark = restart(app)
    log = app.log_text_full()[mark:]
    assert "adopted running data plane" in log
    assert "state checkpoint: restored the current one" in log, log
    first = pushes_since(app, mark)[0]
    assert first.endswith(NOTHING_PUSHED), log
    assert "the tables equal those pushed before the restart" in log, log
    assert ring_of(app) == ring
    seen = watch_b2_down(app, 4.0)
    # The transitions survived the restart, and no backend gained one since
    # (b1 and b3's agents reconnect to the new receiver: not a missed heartbeat).
    assert any(t["backend"] == "b2" and not t["up"] for t in seen[-1]["transitions"])
    assert not [t for t in seen[-1]["transitions"] if t["time"] > killed_at], \
        "a backend changed state across the restart"
    # The weights decided at start (the checkpoint written right after the first
    # push) are those decided before the kill, not the floor of fresh trackers.
    after = app.wait_status(lambda s: (s["checkpoint"]["written_at"] or 0) > killed_at,
                            timeout_s=10, what="checkpoint written after the restart")
    assert after["checkpoint"]["source_at_start"] == "current"
    assert after["checkpoint"]["problems"] == []
    assert {d["name"]: d["weight"] for d in checkpoint(app)["pushed"]["decisions"]["lab"]} \
        == weights
    assert not [a for a in after["alarms"] if a["source"] == "checkpoint"]


def test_a_corrupt_checkpoint_is_reported_and_the_previous_one_used(
        lab: Lab, appliance: LabAppliance) -> None:
    app = appliance
    settled(app)
    ring = ring_of(app)
    app.kill()
    path = app.workdir / "state" / "state.json"
    data = bytearray(path.read_bytes())
    i = data.index(b'"config_text":"') + len(b'"config_text":"') + 3
    data[i] ^= 0x01  # one bit of the configuration's text: JSON still, checksum not
    path.write_bytes(bytes(data))
    mark = len(app.log_text_full())
    app.start()
    log = app.log_text_full()[mark:]
    assert "checksum mismatch" in log and "restored the previous one" in log, log
    assert pushes_since(app, mark)[0].endswith(NOTHING_PUSHED), log
    assert ring_of(app) == ring
    status = app.wait_status(lambda s: any(a["source"] == "checkpoint" for a in s["alarms"]),
                             timeout_s=10, what="the checkpoint alarm")
    [alarm] = [a for a in status["alarms"] if a["source"] == "checkpoint"]
    assert "checksum mismatch" in alarm["message"] and "previous" in alarm["message"]
    assert status["checkpoint"]["source_at_start"] == "previous"
    watch_b2_down(app, 2.0)

    # The checkpoint is written anew (the corrupt file replaced, the previous
    # kept); b2 returns by its probe once its link is back.
    app.wait_status(lambda s: (s["checkpoint"]["written_at"] or 0) > 0, timeout_s=10)
    assert checkpoint(app)["revision"] == checkpoint(app, "state.prev.json")["revision"]
    lab.set_backend_link(2, up=True)
    app.wait_status(lambda s: s["states"]["b2"] == "up", timeout_s=60, what="b2 back up")
    report = lab.run_client(LAB_VIP, LAB_PORT, connections=200)
    assert report["failures"] == 0, report["errors"]
    assert report["counts"].get("b2", 0) > 0


def test_an_upgrade_hand_over_leaves_the_data_plane_forwarding_for_the_successor(
        lab: Lab, appliance: LabAppliance) -> None:
    """SIGUSR2 (`systemctl kill -s USR2 hpclb`, the operator's guide's upgrade):
    `hpclb run` exits 0 and leaves the data plane and its flows; the next one
    (the new release, started by systemd's Restart=) adopts that very process
    and pushes nothing. A TCP connection through the VIP answers throughout."""
    app = appliance
    app.wait_status(lambda s: s["states"]["b2"] == "up", timeout_s=60, what="b2 up")
    settled(app)
    ring, pid = ring_of(app), app.dataplane_pid()
    stream = lab.start_stream(LAB_VIP, LAB_PORT, interval_ms=50, duration=5.0, timeout=10.0)
    time.sleep(1.0)
    assert app.proc is not None
    # As `systemctl kill -s USR2 hpclb` without --kill-whom=main: the whole
    # unit, data plane included (which ignores it).
    os.kill(pid, signal.SIGUSR2)
    app.proc.send_signal(signal.SIGUSR2)
    assert app.proc.wait(timeout=30) == 0, app.log_text()
    app.proc = None
    os.kill(pid, 0)  # the data plane outlived its control plane
    mark = len(app.log_text_full())
    assert "leaving the data plane running" in app.log_text_full()
    app.resume()
    report = lab.wait_json(stream, timeout=30)
    # The stream stops at its first error (each step has its own timeout): none
    # means the connection was answered to its end, through the hand-over.
    assert report["errors"] == [] and len(report["distinct"]) == 1, report
    log = app.log_text_full()[mark:]
    assert f"adopted running data plane pid {pid}" in log, log
    assert pushes_since(app, mark)[0].endswith(NOTHING_PUSHED), log
    assert app.dataplane_pid() == pid and ring_of(app) == ring
