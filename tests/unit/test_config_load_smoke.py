"""perf/config_load.py runs and writes its JSON (a benchmark: no speed is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hpclb.config import MAX_CONFIG_BYTES

SCRIPT = Path(__file__).resolve().parents[2] / "perf" / "config_load.py"


def test_config_load_smoke(tmp_path: Path) -> None:
    out = tmp_path / "config_load.json"
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--repeat", "1", "--scenarios", "valid-4096",
         "over-64000", "--out", str(out)],
        capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr + res.stdout
    doc = json.loads(out.read_text())
    assert doc["conditions"]["size_limit_bytes"] == MAX_CONFIG_BYTES
    valid, over = doc["results"]
    assert (valid["scenario"], valid["accepted"], valid["backends"]) == ("valid-4096", True, 4096)
    assert over["scenario"] == "over-64000" and not over["accepted"]
    assert over["file_bytes"] > MAX_CONFIG_BYTES and "too large" in over["message"]
    for r in (valid, over):
        assert r["seconds_median"] >= 0 and r["peak_rss_mb"] >= r["rss_after_imports_mb"] > 0
