"""The `hpclb` command: configuration errors exit 2 and name file, line, field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "appliance" / "examples"


def hpclb(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hpclb.cli", *args],
                          capture_output=True, text=True, timeout=60)


def test_check_accepts_the_examples() -> None:
    for example in sorted(EXAMPLES.glob("*.yaml")):
        res = hpclb("check", "-c", str(example))
        assert res.returncode == 0, res.stderr
        assert "ok" in res.stdout


def test_broken_config_exits_2_naming_file_line_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    text = (EXAMPLES / "lab.yaml").read_text().replace("port: 8080", "port: 80800", 1)
    bad.write_text(text)
    line = next(i for i, row in enumerate(text.splitlines(), 1) if "80800" in row)
    for command in ("check", "run"):
        res = hpclb(command, "-c", str(bad), *(["--run-dir", str(tmp_path)] * (command == "run")))
        assert res.returncode == 2
        assert f"bad.yaml:{line}:" in res.stderr and "vips[0].port" in res.stderr
        assert "Traceback" not in res.stderr
    assert not list(tmp_path.glob("*.pid")), "nothing started half-configured"


def test_yaml_syntax_error_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "syntax.yaml"
    bad.write_text("appliance:\n  name: [unclosed\n")
    res = hpclb("check", "-c", str(bad))
    assert res.returncode == 2 and "syntax.yaml:" in res.stderr


def test_missing_file_exits_2(tmp_path: Path) -> None:
    res = hpclb("check", "-c", str(tmp_path / "absent.yaml"))
    assert res.returncode == 2 and "absent.yaml" in res.stderr


def test_status_prints_the_status_file_or_says_why_not(tmp_path: Path) -> None:
    example = str(EXAMPLES / "lab.yaml")
    res = hpclb("status", "-c", example, "--run-dir", str(tmp_path))
    assert res.returncode == 1 and "no status" in res.stderr
    (tmp_path / "lab-lb.status.json").write_text('{"health": {}}\n')
    res = hpclb("status", "-c", example, "--run-dir", str(tmp_path))
    assert res.returncode == 0 and res.stdout == '{"health": {}}\n'
