"""`hpclb bench control` (hpclb.lab.control_bench): a quick run writes valid JSON, the
Markdown summary and the PNG plots with the expected keys; an interrupted run keeps
what was measured. A benchmark: no speed is asserted."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hpclb.balancing import maglev
from hpclb.lab import control_bench
from hpclb.lab.control_maglev import build_time, minimum_moves, weight_step_moves

PNG = b"\x89PNG\r\n\x1a\n"
STATS = {"n", "p50", "p99", "max", "min", "mean"}
ROOT = os.geteuid() == 0


def _png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG, path


def test_minimum_moves_counts_the_slots_owners_gain() -> None:
    old = np.array([0, 0, 0, 1, 1, 2], dtype=np.uint32)
    new = np.array([0, 0, 1, 1, 1, 1], dtype=np.uint32)  # 0 loses 1, 2 loses 1, 1 gains 2
    assert minimum_moves(old, new) == 2
    assert minimum_moves(old, old) == 0


def test_weight_steps_never_move_fewer_slots_than_the_minimum() -> None:
    r = weight_step_moves(20, 251, 6, random.Random(3))
    assert r["steps"] == len(r["per_step"]) == 6
    for step in r["per_step"]:
        assert step["weight_from"] != step["weight_to"]
        assert step["changed_slots"] >= step["min_slots"]
        assert step["direction"] in ("up", "down")
    assert STATS <= r["ratio"].keys() and r["ratio"]["n"] <= 6


@pytest.mark.parametrize("fill", ["c", "python"])
def test_build_time_rows(fill: str) -> None:
    row = build_time(12, 251, 2, random.Random(1), fill)
    assert (row["backends"], row["fill"], row["repeats"]) == (12, fill, 2)
    if fill == "c" and maglev.c_fill_missing() is not None:
        assert "C fill not loaded" in row["skipped"]
    else:
        assert row["build_ms"]["n"] == 2 and len(row["samples_ms"]) == 2


def test_options_quick_overrides_and_refusals() -> None:
    opts = control_bench.options(True, sizes=[10, 20], parts=["maglev"], slot_steps=None)
    assert opts.sizes == (10, 20) and opts.parts == ("maglev",)
    assert opts.slot_steps == control_bench.QUICK.slot_steps  # None: the default
    with pytest.raises(TypeError, match="unknown control bench options: nope"):
        control_bench.options(nope=1)
    with pytest.raises(ValueError, match="parts"):
        control_bench.options(parts=["warp"])
    with pytest.raises(ValueError, match="sizes"):
        control_bench.options(sizes=[1])


def test_paths_beside_out() -> None:
    files = control_bench.paths(Path("/r/control.json"))
    assert files["json"] == Path("/r/control.json")
    assert files["markdown"] == Path("/r/control.md")
    assert files["slots"] == Path("/r/control-slots.png")
    assert control_bench.paths(Path("/r/x"))["json"] == Path("/r/x.json")


NO_REACTION = ("maglev", "slots", "probes", "config")


def test_quick_run_writes_json_markdown_and_plots(tmp_path: Path) -> None:
    """Every part but the reaction time (root: the next test)."""
    out = tmp_path / "control.json"
    rc = control_bench.run_control_bench(out, quick=True, progress=False, parts=NO_REACTION)
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "control" and doc["quick"] is True
    assert doc["interrupted"] is False and doc["errors"] == {}
    cond = doc["conditions"]
    assert {"kernel", "cpu_model", "cpus", "cpu_affinity", "python", "options"} <= cond.keys()
    assert cond["options"]["sizes"] == [10, 100]

    rows = doc["maglev_build"]["rows"]
    assert [(r["backends"], r["fill"]) for r in rows] == [
        (10, "c"), (10, "python"), (100, "c"), (100, "python")]
    for r in rows:
        assert "skipped" in r or STATS <= r["build_ms"].keys()
    slots = doc["slots"]["rows"]
    assert [r["backends"] for r in slots] == [10, 100]
    for r in slots:
        assert len(r["per_step"]) == control_bench.QUICK.slot_steps
        assert {"ratio", "ratio_up", "ratio_down", "changed_slots", "min_slots"} <= r.keys()
    (probe,) = doc["probes"]["results"]
    assert probe["kind"] == "tcp" and probe["endpoints"] == 200
    assert probe["probes_completed"] > 0
    (load,) = doc["config_load"]["results"]
    assert load["scenario"] == "valid-4096" and load["accepted"]
    assert "reaction" not in doc

    files = control_bench.paths(out)
    assert doc["files"]["plots"] == [str(files["maglev_build"]), str(files["slots"])]
    _png(files["maglev_build"])
    _png(files["slots"])
    assert not files["reaction"].exists()
    md = files["markdown"].read_text()
    for heading in ("# hpclb bench control (quick)", "## Maglev ring build",
                    "## Slots moved by one weight step", "## Probe scale",
                    "## Configuration load"):
        assert heading in md, heading
    assert "## Reaction time (telemetry -> data plane)\n\nnot selected" in md
    assert "Interrupted" not in md


@pytest.mark.root
@pytest.mark.skipif(not ROOT, reason="needs root: a network namespace and the XDP daemon")
def test_quick_reaction_run(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    rc = control_bench.run_control_bench(out, quick=True, progress=False, parts=["reaction"])
    assert rc == 0
    doc = json.loads(out.read_text())
    (run,) = doc["reaction"]["runs"]
    quick = control_bench.QUICK
    assert run["backends"] == quick.reaction_backends
    assert run["paced"]["reaction_ms"]["n"] == quick.reaction_samples
    assert run["burst"]["samples"] == quick.reaction_samples
    assert doc["reaction"]["conditions"]["kernel"] == doc["conditions"]["kernel"]
    assert doc["reaction"]["summary"]["reaction_ms"]["n"] == quick.reaction_samples
    files = control_bench.paths(out)
    assert doc["files"]["plots"] == [str(files["reaction"])]
    _png(files["reaction"])
    assert "| reaction (paced) |" in files["markdown"].read_text()


def test_without_root_the_reaction_part_is_skipped(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    out = tmp_path / "n.json"
    assert control_bench.run_control_bench(out, quick=True, progress=False,
                                           parts=["reaction"]) == 0
    doc = json.loads(out.read_text())
    assert "needs root" in doc["reaction"]["skipped"] and doc["files"]["plots"] == []
    assert "skipped: needs root" in (tmp_path / "n.md").read_text()


def test_a_failing_part_is_reported_and_the_rest_run(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no ring today")

    monkeypatch.setattr("hpclb.lab.control_maglev.weight_step_moves", broken)
    out = tmp_path / "c.json"
    rc = control_bench.run_control_bench(out, quick=True, progress=False,
                                         parts=("slots", "maglev"))
    assert rc == 1
    doc = json.loads(out.read_text())
    assert doc["errors"] == {"slots": "RuntimeError: no ring today"}
    assert len(doc["maglev_build"]["rows"]) == 4
    assert "failed: RuntimeError: no ring today" in (tmp_path / "c.md").read_text()


_INTERRUPTIBLE = """
import sys, time
from pathlib import Path
from hpclb.lab import control_bench, control_maglev

real = control_maglev.weight_step_moves
def slow(*args, **kwargs):
    result = real(*args, **kwargs)
    print("step", flush=True)
    time.sleep(60)  # the interrupt lands here
    return result
control_maglev.weight_step_moves = slow
sys.exit(control_bench.run_control_bench(Path(sys.argv[1]), quick=True, progress=False,
                                         parts=("maglev", "slots", "config")))
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_keeps_what_was_measured(tmp_path: Path, signum: int) -> None:
    out = tmp_path / "i.json"
    proc = subprocess.Popen([sys.executable, "-c", _INTERRUPTIBLE, str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "step"
        proc.send_signal(signum)
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 130, proc.stderr.read() if proc.stderr else ""
    doc = json.loads(out.read_text())
    assert doc["interrupted"] is True
    assert len(doc["maglev_build"]["rows"]) == 4  # finished before the interrupt
    assert doc["slots"]["rows"] == []  # interrupted inside its first size
    assert "config_load" not in doc
    md = (tmp_path / "i.md").read_text()
    assert "**Interrupted**" in md and "interrupted before it ran" in md
    _png(tmp_path / "i-maglev_build.png")
