"""perf/probe_scale.py runs and writes its JSON (a benchmark: no speed is asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "perf" / "probe_scale.py"
FIELDS = {"kind", "endpoints", "interval_s", "duration_s", "cpu_s_per_s", "probes_per_s",
          "probes_completed", "probes_failed", "missed_slots", "send_lag_ms",
          "interval_deviation_ms", "cpu"}


@pytest.mark.parametrize("kind", [
    "tcp",
    pytest.param("icmp", marks=[pytest.mark.root, pytest.mark.skipif(
        os.geteuid() != 0, reason="ICMP needs a raw socket (root)")]),
])
def test_probe_scale_smoke(kind: str, tmp_path: Path) -> None:
    out = tmp_path / "probe_scale.json"
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--endpoints", "200", "--interval", "0.5",
         "--duration", "2", "--warmup", "0.5", "--kinds", kind, "--out", str(out)],
        capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr + res.stdout
    assert res.stdout.startswith("probe_scale: ") and len(res.stdout.splitlines()) == 1
    doc = json.loads(out.read_text())
    assert doc["conditions"]["endpoints"] == 200
    (result,) = doc["results"]
    assert FIELDS <= result.keys(), FIELDS - result.keys()
    assert result["kind"] == kind and result["probes_completed"] > 0
    assert {"p50", "p99", "max"} <= result["send_lag_ms"].keys()


def test_probe_scale_rejects_bad_arguments(tmp_path: Path) -> None:
    for args in (["--kinds", "udp"], ["--interval", "0.01"], ["--endpoints", "0"]):
        res = subprocess.run([sys.executable, str(SCRIPT), *args, "--out",
                              str(tmp_path / "x.json")],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 2 and "error:" in res.stderr, args
