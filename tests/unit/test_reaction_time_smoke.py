"""perf/reaction_time.py runs the real control-plane path and writes its JSON
(a benchmark: no speed is asserted, only that samples were measured)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "perf" / "reaction_time.py"
STATS = {"n", "p50", "p99", "max"}

pytestmark = [pytest.mark.root, pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: a network namespace and the XDP daemon")]


def test_reaction_time_smoke(tmp_path: Path) -> None:
    out = tmp_path / "reaction_time.json"
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--backends", "20", "--samples", "5",
         "--slot-backends", "10", "--out", str(out)],
        capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr + res.stdout
    assert res.stdout.startswith("reaction_time: ")
    doc = json.loads(out.read_text())
    cond = doc["conditions"]
    assert {"backends", "ring_size", "cpus", "kernel", "python", "push_interval_s"} <= cond.keys()
    assert [r["backends"] for r in doc["runs"]] == [20, 10]
    for run in doc["runs"]:
        assert run["dataplane"]["dataplane"] == "xdp"
        paced = run["paced"]
        assert paced["samples"] == 5 and len(paced["per_sample"]) == 5
        assert STATS <= paced["reaction_ms"].keys() and paced["reaction_ms"]["n"] == 5
        for part in ("queue_wait", "tables_for", "ring_build", "push", "patch_rpc"):
            assert paced["breakdown_ms"][part]["n"] == 5, part
        slots = paced["slots"]
        assert slots["ratio"]["n"] == 5 and slots["report_equals_diff"]
        for row in paced["per_sample"]:
            assert row["patched_slots"] > 0 and row["min_slots"] > 0
            assert row["reaction_ms"] > 0
    burst = doc["runs"][0]["burst"]
    assert burst["samples"] == 5 and burst["reaction_ms"]["n"] == 5 and burst["pushes"] >= 1
    assert doc["runs"][1]["burst"] is None
    assert doc["maglev_build"]["build_ms"]["n"] > 0
    assert set(doc["summary"]["slot_ratio"]) == {"20", "10"}
