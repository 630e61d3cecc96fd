"""The generic actions: files, directories, links, users, tmpfiles, units, commands.

Each compares the system (under ``ctx.root``) with what it should be and says
what differs; each apply leaves the state its pending() would call in place.
Owners and groups are names, resolved against ``ROOT/etc/passwd`` and
``ROOT/etc/group`` (never the host's NSS: a ``--root`` tree has its own
users); ``root`` is 0 even in a tree that has no passwd file yet.
"""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hpclb.provision.plan import BaseAction, Context, ProvisionError

# ---------------------------------------------------------------- owners


def _lookup(ctx: Context, db: str, name: str) -> int | None:
    """The id of ``name`` in ROOT/etc/passwd or ROOT/etc/group; None if absent."""
    if name == "root":
        return 0
    try:
        text = ctx.path(f"/etc/{db}").read_text()
    except FileNotFoundError:
        return None
    for line in text.splitlines():
        parts = line.split(":")
        if len(parts) >= 3 and parts[0] == name:
            return int(parts[2])
    return None


def uid(ctx: Context, name: str) -> int | None:
    return _lookup(ctx, "passwd", name)


def gid(ctx: Context, name: str) -> int | None:
    return _lookup(ctx, "group", name)


def _ids(ctx: Context, owner: str, group: str) -> tuple[int, int]:
    u, g = uid(ctx, owner), gid(ctx, group)
    if u is None or g is None:
        missing = owner if u is None else group
        raise ProvisionError(f"no user or group {missing!r} in {ctx.path('/etc/passwd')} "
                             "(the sysusers step should have created it)")
    return u, g


def _ownership(ctx: Context, st: os.stat_result | None, mode: int, owner: str,
               group: str) -> list[str]:
    """What differs in mode and owner of an existing file (``st``)."""
    if st is None:
        return []
    out = []
    if stat.S_IMODE(st.st_mode) != mode:
        out.append(f"mode {stat.S_IMODE(st.st_mode):04o} -> {mode:04o}")
    u, g = uid(ctx, owner), gid(ctx, group)
    if u is None or g is None or (st.st_uid, st.st_gid) != (u, g):
        out.append(f"owner {st.st_uid}:{st.st_gid} -> {owner}:{group}")
    return out


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return path.lstat()
    except FileNotFoundError:
        return None


def _make_parents(ctx: Context, path: Path) -> None:
    """Missing parent directories as root:root 0755 (the usual for /etc, /usr)."""
    missing = []
    parent = path.parent
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    for d in reversed(missing):
        d.mkdir(mode=0o755)
        d.chmod(0o755)  # whatever the umask


# ---------------------------------------------------------------- files


@dataclass
class WriteFile(BaseAction):
    """``path`` holds exactly ``content`` with ``mode`` and ``owner:group``.

    ``keep``: an existing file is the operator's and is never rewritten (its
    mode and owner neither); :meth:`pending` is then [] once it exists.
    Written atomically (a temporary file beside it, then rename), the mode
    and owner set before the rename: a secret is never readable by others.
    """

    path: str = ""
    content: bytes | str = b""
    mode: int = 0o644
    owner: str = "root"
    group: str = "root"
    keep: bool = False

    def describe(self) -> str:
        return f"write {self.path}"

    def _bytes(self) -> bytes:
        c = self.content
        return c.encode() if isinstance(c, str) else c

    def pending(self, ctx: Context) -> list[str]:
        target = ctx.path(self.path)
        st = _lstat(target)
        if st is None:
            return [f"create ({self.mode:04o} {self.owner}:{self.group})"]
        if self.keep:
            return []
        if not stat.S_ISREG(st.st_mode):
            return ["replace (not a regular file)"]
        out = [] if target.read_bytes() == self._bytes() else ["content"]
        return out + _ownership(ctx, st, self.mode, self.owner, self.group)

    def apply(self, ctx: Context) -> None:
        target = ctx.path(self.path)
        u, g = _ids(ctx, self.owner, self.group)
        _make_parents(ctx, target)
        tmp = target.with_name(f".{target.name}.hpclb-new")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(self._bytes())
                f.flush()
                os.fchown(f.fileno(), u, g)
                os.fchmod(f.fileno(), self.mode)
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


@dataclass
class MakeDir(BaseAction):
    """Directory ``path`` exists with ``mode`` and ``owner:group``."""

    path: str = ""
    mode: int = 0o755
    owner: str = "root"
    group: str = "root"

    def describe(self) -> str:
        return f"directory {self.path}"

    def pending(self, ctx: Context) -> list[str]:
        st = _lstat(ctx.path(self.path))
        if st is None:
            return [f"create ({self.mode:04o} {self.owner}:{self.group})"]
        if not stat.S_ISDIR(st.st_mode):
            raise ProvisionError(f"{ctx.path(self.path)} exists and is not a directory")
        return _ownership(ctx, st, self.mode, self.owner, self.group)

    def apply(self, ctx: Context) -> None:
        target = ctx.path(self.path)
        u, g = _ids(ctx, self.owner, self.group)
        _make_parents(ctx, target)
        target.mkdir(mode=0o700, exist_ok=True)
        os.chown(target, u, g)
        target.chmod(self.mode)


@dataclass
class Symlink(BaseAction):
    """``path`` is a symbolic link to ``target`` (taken literally: an
    absolute target names the provisioned system's path, as in an image)."""

    path: str = ""
    target: str = ""

    def describe(self) -> str:
        return f"link {self.path} -> {self.target}"

    def pending(self, ctx: Context) -> list[str]:
        link = ctx.path(self.path)
        if not link.is_symlink():
            return ["create" if _lstat(link) is None else "replace (not a link)"]
        current = os.readlink(link)
        return [] if current == self.target else [f"target {current} -> {self.target}"]

    def apply(self, ctx: Context) -> None:
        link = ctx.path(self.path)
        _make_parents(ctx, link)
        tmp = link.with_name(f".{link.name}.hpclb-new")
        tmp.unlink(missing_ok=True)
        os.symlink(self.target, tmp)
        os.replace(tmp, link)


# ---------------------------------------------------------------- commands


def run(argv: Sequence[str], what: str) -> subprocess.CompletedProcess[str]:
    """Run ``argv``; a failure is a :class:`ProvisionError` with its output."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise ProvisionError(f"{what}: {argv[0]} is not installed") from None
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise ProvisionError(f"{what}: {' '.join(argv)} exited {proc.returncode}"
                             + (f": {detail[-1]}" if detail else ""))
    return proc


@dataclass
class RunLive(BaseAction):
    """Run ``argv`` on the running system when ``needed(ctx)`` returns a
    reason (a phrase; None: nothing to do). Live only."""

    argv: Sequence[str] = ()
    needed: Callable[[Context], str | None] = field(default=lambda ctx: None)
    what: str = ""
    live_only: bool = True

    def describe(self) -> str:
        return self.what or f"run {' '.join(self.argv)}"

    def pending(self, ctx: Context) -> list[str]:
        reason = self.needed(ctx)
        return [reason] if reason else []

    def apply(self, ctx: Context) -> None:
        run(self.argv, self.describe())


# ---------------------------------------------------------------- sysusers


SYSUSERS_CONF = "/usr/lib/sysusers.d/hpclb.conf"
TMPFILES_CONF = "/usr/lib/tmpfiles.d/hpclb.conf"


def sysusers_users(text: str) -> list[tuple[str, str]]:
    """(kind, name) of each ``u``/``g`` line of a sysusers.d file."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in ("u", "g"):
            out.append((parts[0], parts[1]))
    return out


@dataclass
class Sysusers(BaseAction):
    """Install the sysusers.d file and run ``systemd-sysusers --root=ROOT``
    on it: the users exist in ROOT/etc/passwd, even in an empty tree (where
    the tool creates passwd, group, shadow and gshadow)."""

    content: str = ""

    def describe(self) -> str:
        return f"users from {SYSUSERS_CONF}"

    def _file(self) -> WriteFile:
        return WriteFile(SYSUSERS_CONF, self.content, 0o644)

    def pending(self, ctx: Context) -> list[str]:
        out = ["install " + SYSUSERS_CONF] if self._file().pending(ctx) else []
        for kind, name in sysusers_users(self.content):
            exists = uid(ctx, name) if kind == "u" else gid(ctx, name)
            if exists is None:
                out.append(f"{'user' if kind == 'u' else 'group'} {name}")
        return out

    def apply(self, ctx: Context) -> None:
        f = self._file()
        if f.pending(ctx):
            f.apply(ctx)
        ctx.path("/etc").mkdir(mode=0o755, exist_ok=True)  # the tool locks /etc/.pwd.lock
        run(["systemd-sysusers", f"--root={ctx.root}", str(ctx.path(SYSUSERS_CONF))],
            "systemd-sysusers")


def tmpfiles_dirs(text: str) -> list[tuple[str, int, str, str]]:
    """(path, mode, owner, group) of each ``d`` line of a tmpfiles.d file."""
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[0] in ("d", "D") and not parts[1].startswith("/run"):
            out.append((parts[1], int(parts[2], 8), parts[3], parts[4]))
    return out


@dataclass
class Tmpfiles(BaseAction):
    """Install the tmpfiles.d file and run ``systemd-tmpfiles --root=ROOT
    --create`` on it: the directories exist with their modes and owners now,
    and again at every boot. (Lines under /run are left to the boot: a
    ``--root`` tree has no running /run.)"""

    content: str = ""

    def describe(self) -> str:
        return f"directories from {TMPFILES_CONF}"

    def _file(self) -> WriteFile:
        return WriteFile(TMPFILES_CONF, self.content, 0o644)

    def pending(self, ctx: Context) -> list[str]:
        out = ["install " + TMPFILES_CONF] if self._file().pending(ctx) else []
        for path, mode, owner, group in tmpfiles_dirs(self.content):
            changes = MakeDir(path, mode, owner, group).pending(ctx)
            if changes:
                out.append(f"{path} ({', '.join(changes)})")
        return out

    def apply(self, ctx: Context) -> None:
        f = self._file()
        if f.pending(ctx):
            f.apply(ctx)
        run(["systemd-tmpfiles", f"--root={ctx.root}", "--create",
             str(ctx.path(TMPFILES_CONF))], "systemd-tmpfiles")
        # systemd-tmpfiles leaves an existing directory's mode alone when it
        # is already "right enough"; make what pending() checks true.
        for path, mode, owner, group in tmpfiles_dirs(self.content):
            d = MakeDir(path, mode, owner, group)
            if d.pending(ctx):
                d.apply(ctx)


# ---------------------------------------------------------------- units


def systemd_running(ctx: Context) -> bool:
    """Whether systemd is the running init (its documented test)."""
    return ctx.live and Path("/run/systemd/system").is_dir()


@dataclass
class EnableUnit(BaseAction):
    """``systemctl --root=ROOT enable UNIT`` (works offline, in any tree:
    it only makes the [Install] section's links)."""

    unit: str = ""

    def describe(self) -> str:
        return f"enable {self.unit}"

    def pending(self, ctx: Context) -> list[str]:
        proc = subprocess.run(["systemctl", f"--root={ctx.root}", "is-enabled", self.unit],
                              capture_output=True, text=True, check=False)
        state = proc.stdout.strip() or "not installed"
        return [] if state == "enabled" else [f"{state} -> enabled"]

    def apply(self, ctx: Context) -> None:
        run(["systemctl", f"--root={ctx.root}", "enable", self.unit], f"enable {self.unit}")


@dataclass
class StartUnit(BaseAction):
    """Start UNIT on the running system (after a daemon-reload) when it is
    not active. Live only; where systemd is not running the plan says so
    instead of including this."""

    unit: str = ""
    live_only: bool = True

    def describe(self) -> str:
        return f"start {self.unit}"

    def pending(self, ctx: Context) -> list[str]:
        proc = subprocess.run(["systemctl", "is-active", self.unit],
                              capture_output=True, text=True, check=False)
        state = proc.stdout.strip() or "unknown"
        return [] if state == "active" else [f"{state} -> active"]

    def apply(self, ctx: Context) -> None:
        run(["systemctl", "daemon-reload"], "systemctl daemon-reload")
        run(["systemctl", "start", self.unit], f"start {self.unit}")


@dataclass
class ReloadUnits(BaseAction):
    """``systemctl daemon-reload`` when systemd holds an older definition of
    one of ``units`` than the file (an upgrade rewrote a running unit's file:
    without this the Restart= after the hand-over would run the old one).
    Restarts nothing. Live only, where systemd runs."""

    units: tuple[str, ...] = ()
    live_only: bool = True

    def describe(self) -> str:
        return "systemctl daemon-reload"

    def pending(self, ctx: Context) -> list[str]:
        stale = []
        for unit in self.units:
            proc = subprocess.run(["systemctl", "show", "-p", "NeedDaemonReload", "--value",
                                   unit], capture_output=True, text=True, check=False)
            if proc.stdout.strip() == "yes":
                stale.append(unit)
        return [f"{', '.join(stale)} changed on disk"] if stale else []

    def apply(self, ctx: Context) -> None:
        run(["systemctl", "daemon-reload"], "systemctl daemon-reload")


__all__ = [
    "SYSUSERS_CONF", "TMPFILES_CONF", "EnableUnit", "MakeDir", "ReloadUnits", "RunLive",
    "StartUnit",
    "Symlink", "Sysusers", "Tmpfiles", "WriteFile", "gid", "run",
    "systemd_running", "uid",
]
