"""`hpclb bench` runs its subjects against the lab with trafgen and writes valid
JSON, the Markdown summary and the plots; Ctrl-C stops it cleanly and keeps what was
measured. Never a speed assertion."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="the lab needs root (network namespaces)"),
]


def _need_tools() -> None:
    from hpclb.host import install

    for tool in ("trafgen", "bpftool", "ethtool", "taskset"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed (./bootstrap)")
    try:
        for output in ("sink.bpf.o", "pass.bpf.o", "reflect.bpf.o", "hpclb-xdp"):
            install.find(output)
    except Exception as err:  # the data plane's build is not there
        pytest.skip(f"no data plane build: {err}")
    pytest.importorskip("matplotlib")


def test_one_second_trials_write_json_markdown_and_plots(tmp_path: Path) -> None:
    from hpclb.lab.bench import run_bench
    from hpclb.lab.topology import Lab

    _need_tools()
    out, prefix = tmp_path / "bench.json", "s" + secrets.token_hex(3)
    rc = run_bench(out, seconds=1.0, trials=1, flows=300, ndr_steps=1,
                   peers=("reflect", "xdp"), prefix=prefix, progress=False, costs=False,
                   cps_seconds=0)
    assert rc == 0
    assert Lab.existing_namespaces(prefix) == []
    doc = json.loads(out.read_text())
    assert doc["interrupted"] is False and doc["not_run"] == {}
    assert set(doc["subjects"]) == {"reflect", "xdp"}
    for name, sub in doc["subjects"].items():
        # Frames went through (the sink counted them): the path ran end to end.
        assert any(t["forwarded_frames"] > 0 for t in sub["samples"]), (name, sub)
        search = sub["search"]
        assert search is not None and 1 <= len(search["trials"]) <= 2
    cond = doc["conditions"]
    for key in ("kernel", "cpu_model", "cores", "seconds_per_trial", "pdr_loss"):
        assert key in cond, key
    gen = cond["generator"]
    assert gen["name"] == "trafgen" and gen["flows"] == 300 and gen["frame_bytes"] == 64
    assert isinstance(gen["decoupled"], bool)
    if gen["decoupled"]:
        # Each trial says it ran decoupled: the appliance's NAPI thread was found
        # and pinned (reflect and xdp attach XDP, so the veth has NAPI).
        for sub in doc["subjects"].values():
            for t in sub["samples"]:
                assert t["extra"]["decoupled"] is True, t
                assert any(n.startswith("napi/eth0-") for n in t["extra"]["napi_threads"])
    assert (tmp_path / "bench.md").read_text().count("| xdp |") == 1
    for png in ("bench-reflect.png", "bench-xdp.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


def test_ctrl_c_stops_cleanly_and_keeps_what_was_measured(tmp_path: Path) -> None:
    from hpclb.lab.topology import Lab

    _need_tools()
    out, prefix = tmp_path / "bench.json", "s" + secrets.token_hex(3)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "control")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpclb.main", "bench", "--peers", "reflect,xdp",
         "--seconds", "1", "--trials", "20", "--ndr-steps", "1", "--flows", "300",
         "--cps-seconds", "0", "--no-progress", "--lab-prefix", prefix, "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        # Mid-run: the lab is up and the first subject has had time to start.
        deadline = time.monotonic() + 120
        while not Lab.existing_namespaces(prefix):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the lab never came up"
            time.sleep(0.2)
        time.sleep(8)
        assert proc.poll() is None, proc.communicate()[0]
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        Lab.cleanup_stale(prefix)
    assert proc.returncode == 130, output
    assert Lab.existing_namespaces(prefix) == [], output
    doc = json.loads(out.read_text())
    assert doc["interrupted"] is True
    assert "Interrupted" in (tmp_path / "bench.md").read_text()
