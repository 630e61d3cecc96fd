"""appliance/provision.sh itself, into a fresh --root tree: the bash steps
(packages and build skipped with their reason, the tree copied into
/opt/hpclb) and the Python plan after them, twice; --check first."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.provision.conftest import HASH_KEY, NAME, REPO, snapshot

SCRIPT = REPO / "appliance" / "provision.sh"


def _run(*args: str, script: Path = SCRIPT) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HPCLB_PROVISION_TEST_HASH_KEY": HASH_KEY}
    env.pop("SSH_CONNECTION", None)
    return subprocess.run([str(script), *args], capture_output=True, text=True, env=env,
                          check=False, timeout=120)


@pytest.fixture
def frozen_src(tmp_path: Path) -> Path:
    """A copy of the repository's files (a git index of its own, this
    checkout's .venv linked): the tree provision.sh copies cannot change
    between two runs, whatever else edits the checkout meanwhile."""
    if not (REPO / ".git").exists():
        pytest.skip(f"{REPO} is not a git checkout (provision.sh copies what git lists)")
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], capture_output=True, check=True).stdout
    src = tmp_path / "src"
    for rel in filter(None, listed.decode().split("\0")):
        path = REPO / rel
        if path.is_file() and not path.is_symlink():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / rel)
    (src / ".venv").symlink_to(REPO / ".venv")
    subprocess.run(["git", "init", "-q", str(src)], check=True)
    subprocess.run(["git", "-C", str(src), "add", "-A"], check=True)
    return src


def test_provision_sh_check_then_twice(root: Path, frozen_src: Path) -> None:
    script = frozen_src / "appliance/provision.sh"
    check = _run("--root", str(root), "--name", NAME, "--check", script=script)
    assert check.returncode == 0, check.stderr
    assert list(root.iterdir()) == []
    lines = check.stdout.splitlines()
    assert "skipped (--root): packages (dpkg and apt act on the running system)" in lines
    assert any(line.startswith("would change: tree: ") for line in lines)
    assert lines[-1].endswith("changes would be made (--check)")

    first = _run("--root", str(root), "--name", NAME, script=script)
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    assert any(line.startswith("skipped (--root): build") for line in lines)
    assert any(line.startswith("changed: tree: ") for line in lines)
    installed = root / "opt/hpclb"
    assert (installed / "appliance/provision.sh").read_bytes() == script.read_bytes()
    assert (installed / "pyproject.toml").is_file()
    assert not (installed / ".venv").exists() and not (installed / ".git").exists()
    # The bash step's change is counted in the one summary line.
    changed = [line for line in lines if line.startswith("changed: ")]
    assert lines[-1] == f"provision: {len(changed)} changes"

    before = snapshot(root)
    second = _run("--root", str(root), "--name", NAME, script=script)
    assert second.returncode == 0, second.stderr
    assert second.stdout.splitlines()[-1] == "provision: no change", second.stdout
    assert snapshot(root) == before


def test_provision_sh_usage_errors(root: Path) -> None:
    bad = _run("--role", "router", "--root", str(root))
    assert bad.returncode == 2 and "--role must be gateway, node or client" in bad.stderr
    node_flag = _run("--role", "node", "--root", str(root), "--ingress", "eth1")
    assert node_flag.returncode == 2 and "gateway options" in node_flag.stderr
    assert list(root.iterdir()) == []
    usage = _run("-h")
    assert usage.returncode == 0 and "--keys-dir" in usage.stdout


def test_provision_sh_broken_example_changes_nothing(root: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    text = (REPO / "appliance/examples/gateway.yaml").read_text()
    broken.write_text(text.replace("ring_size: 131071", "ring_size: 131072"))
    result = _run("--root", str(root), "--config", str(broken))
    assert result.returncode == 1
    assert f"provision: error: {broken} is not a valid configuration" in result.stderr
    assert "must be a prime, 131072 is not" in result.stderr
    assert list(root.iterdir()) == []  # not even the tree in /opt/hpclb
