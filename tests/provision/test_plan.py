"""The engine: a plan is checked whole before anything changes; the report."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hpclb.provision.actions import MakeDir, Symlink, WriteFile
from hpclb.provision.plan import (
    BaseAction,
    Context,
    Note,
    ProvisionRefused,
    run_plan,
)


def _ctx(root: Path, check: bool = False, live: bool = False) -> Context:
    lines: list[str] = []
    return Context(root=root, live=live, check=check, src=Path("."), out=lines.append)


@dataclass
class Refuses(BaseAction):
    what: str = "bind eth0"

    def pending(self, ctx: Context) -> list[str]:
        raise ProvisionRefused("eth0 carries the default route")


@dataclass
class LiveOnly(BaseAction):
    what: str = "sysctl -w"
    live_only: bool = True
    asked: list[int] = field(default_factory=list)

    def pending(self, ctx: Context) -> list[str]:
        self.asked.append(1)
        return ["now"]


def test_a_refusal_anywhere_changes_nothing(root: Path) -> None:
    ctx = _ctx(root)
    plan = [WriteFile("/etc/a.conf", "a\n"), Refuses(), WriteFile("/etc/b.conf", "b\n")]
    with pytest.raises(ProvisionRefused, match="default route"):
        run_plan(plan, ctx)
    assert list(root.iterdir()) == []
    assert ctx.lines == []


def test_live_only_actions_are_skipped_and_never_asked_under_root(root: Path) -> None:
    action = LiveOnly()
    ctx = _ctx(root)
    assert run_plan([action, Note("advice: isolcpus=2-3")], ctx) == 0
    assert ctx.lines == ["skipped (--root): sysctl -w", "advice: isolcpus=2-3",
                         "provision: no change"]
    assert action.asked == []


def test_report_and_summary(root: Path) -> None:
    plan = [WriteFile("/etc/x/a.conf", "a\n", 0o640), MakeDir("/var/lib/x", 0o750),
            Symlink("/usr/local/bin/x", "/opt/x/bin/x")]
    check = _ctx(root, check=True)
    assert run_plan(plan, check, prior_changes=1) == 4
    assert check.lines[-1] == "provision: 4 changes would be made (--check)"
    assert all(line.startswith("would change: ") for line in check.lines[:-1])
    assert list(root.iterdir()) == []

    ctx = _ctx(root)
    assert run_plan(plan, ctx) == 3
    assert ctx.lines == [
        "changed: write /etc/x/a.conf: create (0640 root:root)",
        "changed: directory /var/lib/x: create (0750 root:root)",
        "changed: link /usr/local/bin/x -> /opt/x/bin/x: create",
        "provision: 3 changes",
    ]
    assert (root / "etc/x/a.conf").read_text() == "a\n"
    assert (root / "etc/x/a.conf").stat().st_mode & 0o7777 == 0o640
    assert (root / "etc/x").stat().st_mode & 0o7777 == 0o755
    assert (root / "usr/local/bin/x").readlink() == Path("/opt/x/bin/x")

    again = _ctx(root)
    assert run_plan(plan, again) == 0
    assert again.lines == ["provision: no change"]


def test_write_file_repairs_content_mode_and_keeps_an_operators_file(root: Path) -> None:
    target = root / "etc/a.conf"
    run_plan([WriteFile("/etc/a.conf", "a\n", 0o600)], _ctx(root))
    target.chmod(0o666)
    target.write_text("edited\n")
    assert WriteFile("/etc/a.conf", "a\n", 0o600).pending(_ctx(root)) == [
        "content", "mode 0666 -> 0600"]
    assert WriteFile("/etc/a.conf", "a\n", 0o600, keep=True).pending(_ctx(root)) == []
    run_plan([WriteFile("/etc/a.conf", "a\n", 0o600)], _ctx(root))
    assert target.read_text() == "a\n" and target.stat().st_mode & 0o7777 == 0o600


def test_paths_stay_inside_the_root(root: Path) -> None:
    ctx = _ctx(root)
    assert ctx.path("/etc/hpclb/hpclb.yaml") == root / "etc/hpclb/hpclb.yaml"
    with pytest.raises(ValueError):
        ctx.path("etc/relative")
