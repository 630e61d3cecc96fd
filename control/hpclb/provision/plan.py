"""The provisioning engine: a plan of idempotent actions, checked whole, then applied.

An :class:`Action` says what it would change on the system as it is now
(:meth:`Action.pending`, an empty list when it is already in place) and makes
it so (:meth:`Action.apply`). :func:`run_plan` first asks every action (a
refusal, :class:`ProvisionRefused`, raised there or while the plan was being
built, stops everything before anything has changed), then, unless ``--check``,
applies each one that is still pending when its turn comes: an earlier action
may have put a later one in place (the ``hpclb`` user exists once sysusers has
run), so pending is asked again just before applying.

Every action runs against ``ctx.root``: ``/`` on a real host, any directory in
tests and for an image build (``--root``). Actions on the running kernel or
system (sysctl -w, mount, a driver binding, starting a unit) are
``live_only``: with ``--root`` they are reported as skipped, never run.

Report format, one line each: ``changed: WHAT: DETAIL`` (``would change:``
under ``--check``), ``skipped (--root): WHAT``, free lines from
:meth:`Context.say` (``kept: ...``, advice); then the summary,
``provision: no change`` or ``provision: N changes`` or ``provision: N changes
would be made (--check)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Protocol, runtime_checkable

#: Exit statuses of ``python -m hpclb.provision`` and provision.sh.
EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_REFUSED = 0, 1, 2, 3


class ProvisionError(Exception):
    """Provisioning cannot go on (a broken example configuration, a missing
    tool); nothing has been changed when it is raised before :func:`run_plan`
    applies anything. Exit 1 with the message."""


class ProvisionRefused(ProvisionError):
    """A step the operator asked for is refused because it would cut the host
    off or take something in use (binding the management NIC to vfio-pci).
    Raised while building the plan or from :meth:`Action.pending`, so nothing
    has been changed. Exit 3 with the message."""


@dataclass
class Context:
    """Where and how a plan runs."""

    root: Path  # Path("/") or the --root directory
    live: bool  # True only when root is "/": actions on the running kernel/system run
    check: bool  # --check: report, change nothing
    src: Path  # the hpclb source tree provision.sh runs from
    out: Callable[[str], None] = print  # where report lines go (tests capture them)
    lines: list[str] = field(default_factory=list)  # every line said, in order

    def path(self, absolute: str | PurePosixPath) -> Path:
        """``absolute`` (``/etc/hpclb/hpclb.yaml``) inside the root."""
        rel = PurePosixPath(absolute)
        if not rel.is_absolute():
            raise ValueError(f"{absolute}: a path on the provisioned system must be absolute")
        return self.root.joinpath(*rel.parts[1:])

    def say(self, line: str) -> None:
        """One line of the report."""
        self.lines.append(line)
        self.out(line)


@runtime_checkable
class Action(Protocol):
    """One idempotent step. ``live_only``: acts on the running system, skipped
    (and said so) when ``ctx.live`` is false."""

    live_only: bool

    def describe(self) -> str:
        """What it is about, e.g. ``write /etc/sysctl.d/60-hpclb.conf``."""
        ...

    def pending(self, ctx: Context) -> list[str]:
        """What it would change now (one short phrase each); [] = in place.
        Must not change anything. May raise :class:`ProvisionRefused`."""
        ...

    def apply(self, ctx: Context) -> None:
        """Make it so; called only when pending, never under ``--check``."""
        ...


class BaseAction:
    """Convenience base: not live-only; subclasses set ``what`` or override
    :meth:`describe`."""

    live_only: bool = False
    what: str = ""

    def describe(self) -> str:
        return self.what

    def pending(self, ctx: Context) -> list[str]:  # pragma: no cover - abstract
        raise NotImplementedError

    def apply(self, ctx: Context) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


@dataclass
class Note(BaseAction):
    """A line said when the plan runs, changing nothing (``kept: ...``,
    advice). Said in order with the other actions' lines."""

    line: str = ""

    def describe(self) -> str:
        return self.line

    def pending(self, ctx: Context) -> list[str]:
        return []

    def apply(self, ctx: Context) -> None:  # pragma: no cover - never pending
        pass


def _line(prefix: str, action: Action, changes: list[str]) -> str:
    return f"{prefix}: {action.describe()}: {'; '.join(changes)}"


def summary(changes: int, check: bool) -> str:
    if changes == 0:
        return "provision: no change"
    noun = "change" if changes == 1 else "changes"
    return (f"provision: {changes} {noun} would be made (--check)" if check
            else f"provision: {changes} {noun}")


def run_plan(actions: Iterable[Action], ctx: Context, prior_changes: int = 0) -> int:
    """Run the plan; returns the number of changes made (or that would be).

    ``prior_changes``: changes already made by provision.sh's bash steps
    (packages, the tree in /opt/hpclb), added to the summary line.
    :class:`ProvisionRefused` and :class:`ProvisionError` from any action's
    :meth:`~Action.pending` propagate before anything is applied.
    """
    plan = list(actions)
    # First pass: every action is asked before any is applied, so a refusal
    # anywhere leaves the system exactly as it was.
    first: list[list[str]] = []
    for action in plan:
        if action.live_only and not ctx.live:
            first.append([])
            continue
        first.append(action.pending(ctx))
    count = 0
    for action, changes in zip(plan, first, strict=True):
        if isinstance(action, Note):
            ctx.say(action.line)
            continue
        if action.live_only and not ctx.live:
            ctx.say(f"skipped (--root): {action.describe()}")
            continue
        if ctx.check:
            if changes:
                ctx.say(_line("would change", action, changes))
                count += 1
            continue
        changes = action.pending(ctx)  # again: an earlier action may have done it
        if not changes:
            continue
        action.apply(ctx)
        ctx.say(_line("changed", action, changes))
        count += 1
    ctx.say(summary(count + prior_changes, ctx.check))
    return count + prior_changes
