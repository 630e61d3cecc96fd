"""``python -m hpclb.provision prepare``: what hpclb-prepare.service does at every boot.

The control plane runs as the unprivileged ``hpclb`` user; what it needs from
the host and cannot do itself is done here, as root, before it starts, on the
running system only (nothing under /etc is written: that is provisioning's):

* DPDK (``dataplane: dpdk``, or ``auto`` with PCI ports or a vdev driver):
  2 MB hugepages on the lcores' NUMA nodes (:mod:`hpclb.provision.hugepages`),
  hugetlbfs mounted;
* PCI ports: vfio-pci loaded, each port bound with ``dpdk-devbind.py`` under the
  same refusals as provisioning (:mod:`hpclb.provision.nics`: the management
  NIC, a default route, a global address, the SSH connection's NIC), and its
  ``/dev/vfio/GROUP`` handed to ``hpclb``. Where vfio-pci or the IOMMU is
  missing the configuration cannot run at all (XDP needs interface names, not
  PCI addresses): an error, nothing changed;
* always: bpffs at /sys/fs/bpf (systemd mounts it 0700: search permission is
  added so ``hpclb`` can reach its directory) and /sys/fs/bpf/hpclb owned by
  ``hpclb``, where the XDP daemon pins its maps.

In XDP mode the DPDK steps are skipped with a line saying so. Idempotent: a
second run changes nothing and says ``provision: no change``.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpclb.provision import actions as generic
from hpclb.provision import hugepages, nics
from hpclb.provision.hostfacts import PCI_ADDRESS, HostFacts, NetState, gather
from hpclb.provision.plan import (
    EXIT_ERROR,
    EXIT_OK,
    EXIT_REFUSED,
    Action,
    BaseAction,
    Context,
    Note,
    ProvisionError,
    ProvisionRefused,
    run_plan,
)

BPFFS = "/sys/fs/bpf"
PIN_DIR = "/sys/fs/bpf/hpclb"
USER = "hpclb"
Runner = Callable[[Sequence[str]], None]


def _run(argv: Sequence[str]) -> None:
    generic.run(argv, argv[0])


def _mounted(proc: Path, where: str, fstype: str) -> bool:
    try:
        mounts = (proc / "mounts").read_text()
    except OSError:
        return False
    return any(len(p) >= 3 and p[1] == where and p[2] == fstype
               for p in (line.split() for line in mounts.splitlines()))


@dataclass
class MountBpffs(BaseAction):
    """bpffs at /sys/fs/bpf (systemd's sys-fs-bpf.mount does it at boot)."""

    proc: Path = Path("/proc")
    runner: Runner = _run
    live_only: bool = True

    def describe(self) -> str:
        return f"mount bpffs at {BPFFS}"

    def pending(self, ctx: Context) -> list[str]:
        return [] if _mounted(self.proc, BPFFS, "bpf") else ["not mounted"]

    def apply(self, ctx: Context) -> None:
        self.runner(["mount", "-t", "bpf", "-o", "mode=0700", "bpf", str(ctx.path(BPFFS))])


@dataclass
class Searchable(BaseAction):
    """Search (x) permission for group and others on a directory, nothing
    else: ``hpclb`` passes through /sys/fs/bpf to its own directory without
    seeing what else is pinned there (a pin's own mode guards it)."""

    path: str = BPFFS
    live_only: bool = True

    def describe(self) -> str:
        return f"search permission on {self.path}"

    def pending(self, ctx: Context) -> list[str]:
        try:
            mode = stat.S_IMODE(ctx.path(self.path).stat().st_mode)
        except FileNotFoundError:
            return ["mount it first"]  # MountBpffs runs before
        want = mode | 0o011
        return [] if mode == want else [f"mode {mode:04o} -> {want:04o}"]

    def apply(self, ctx: Context) -> None:
        target = ctx.path(self.path)
        target.chmod(stat.S_IMODE(target.stat().st_mode) | 0o011)


@dataclass
class VfioGroupOwner(BaseAction):
    """/dev/vfio/GROUP of a bound port owned by ``hpclb`` (0600), so the
    forwarder running as that user can open it. The device appears when the
    port is bound (an earlier action of the same plan)."""

    pci: str = ""
    sysfs: Path = Path("/sys")
    user: str = USER
    live_only: bool = True

    def describe(self) -> str:
        return f"/dev/vfio group of {self.pci} owned by {self.user}"

    def _device(self, ctx: Context) -> Path | None:
        try:
            group = Path(os.readlink(self.sysfs / "bus/pci/devices" / self.pci /
                                     "iommu_group")).name
        except OSError:
            return None
        return ctx.path(f"/dev/vfio/{group}")

    def pending(self, ctx: Context) -> list[str]:
        dev = self._device(ctx)
        if dev is None or not dev.exists():
            return ["when bound"]
        want = generic.uid(ctx, self.user)
        st = dev.stat()
        if want is not None and st.st_uid == want:
            return []
        return [f"owner {st.st_uid} -> {self.user}"]

    def apply(self, ctx: Context) -> None:
        dev = self._device(ctx)
        uid, gid = generic.uid(ctx, self.user), generic.gid(ctx, self.user)
        if dev is None or not dev.exists():
            raise ProvisionError(f"{self.pci} is bound but no /dev/vfio device appeared")
        if uid is None or gid is None:
            raise ProvisionError(f"no user {self.user!r}: provision the gateway first")
        os.chown(dev, uid, gid)
        dev.chmod(0o600)


@dataclass
class PinDir(BaseAction):
    """/sys/fs/bpf/hpclb owned by ``hpclb`` (0700), and everything already
    pinned under it: after an upgrade from a control plane that ran as root,
    the pins it left are root's, and the ``hpclb`` user must reopen them to
    adopt the running data plane."""

    path: str = PIN_DIR
    user: str = USER
    mode: int = 0o700

    def describe(self) -> str:
        return f"directory {self.path} owned by {self.user}"

    def _ids(self, ctx: Context) -> tuple[int, int] | None:
        uid, gid = generic.uid(ctx, self.user), generic.gid(ctx, self.user)
        return None if uid is None or gid is None else (uid, gid)

    def pending(self, ctx: Context) -> list[str]:
        target = ctx.path(self.path)
        if not target.exists():
            return [f"create ({self.mode:04o} {self.user}:{self.user})"]
        ids = self._ids(ctx)
        st = target.stat()
        out = []
        if stat.S_IMODE(st.st_mode) != self.mode:
            out.append(f"mode {stat.S_IMODE(st.st_mode):04o} -> {self.mode:04o}")
        if ids is None or (st.st_uid, st.st_gid) != ids:
            out.append(f"owner {st.st_uid}:{st.st_gid} -> {self.user}:{self.user}")
        others = sum(1 for p in _below(target) if (p.lstat().st_uid, p.lstat().st_gid) != ids)
        if others:
            out.append(f"{others} pinned object(s) -> {self.user}:{self.user}")
        return out

    def apply(self, ctx: Context) -> None:
        ids = self._ids(ctx)
        if ids is None:
            raise ProvisionError(f"no user or group {self.user!r}: provision the gateway first")
        target = ctx.path(self.path)
        target.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chown(target, *ids)
        target.chmod(self.mode)
        for p in _below(target):
            os.chown(p, *ids, follow_symlinks=False)


def _below(top: Path) -> list[Path]:
    out = []
    for dirpath, dirs, files in os.walk(top):
        out += [Path(dirpath) / name for name in (*dirs, *files)]
    return out


def _plain(config_path: Path) -> dict[str, Any]:
    """The configuration, validated, as a plain mapping (enums as strings)."""
    from hpclb.config.loader import ConfigError, load_config

    try:
        return load_config(config_path).model_dump(mode="json")
    except ConfigError as err:
        raise ProvisionError(f"{config_path}: {err}") from None


def prepare_actions(config: dict[str, Any], facts: HostFacts, *, management: str | None = None,
                    sysfs: Path = Path("/sys"), proc: Path = Path("/proc"), user: str = USER,
                    devbind: str = nics.DEVBIND, runner: Runner = _run) -> list[Action]:
    """The boot-time steps for ``config`` on a host with ``facts``. Raises
    ProvisionRefused (a port that must not be bound) or ProvisionError (PCI
    ports vfio-pci cannot take) before anything is changed."""
    out: list[Action] = []
    app = config.get("appliance") or {}
    interfaces = app.get("interfaces") or {}
    ports = [str(interfaces.get("ingress", "")), *map(str, interfaces.get("egress", []))]
    pci = all(PCI_ADDRESS.match(p) for p in ports)
    if hugepages.uses_dpdk(config):
        lcores, mb = hugepages.dpdk_settings(config)
        out += hugepages.hugepage_actions(facts, lcores, mb, sysfs=sysfs, proc=proc,
                                          persistent=False, runner=runner)
    else:
        out.append(Note("prepare: dataplane xdp: no hugepages, no NIC binding"))
    if pci:
        unknown = [p for p in ports if not facts.knows(p)]
        if unknown:
            raise ProvisionError(f"no network PCI function {', '.join(unknown)} on this host "
                                 "(appliance.interfaces names PCI addresses)")
        blocker = nics.vfio_blocker(facts, ports)
        if blocker is None:
            out += nics.config_actions(facts, config, management=management, devbind=devbind,
                                       sysfs=sysfs, runner=runner)
            out += [VfioGroupOwner(pci=p.lower(), sysfs=sysfs, user=user)
                    for p in nics.vfio_ports(facts, ports)]
        else:
            # Refusals first: they say more than the missing driver.
            address = app.get("management_address")
            nics.check_bindable(facts, ports, management=management,
                                management_address=str(address) if address else None)
            raise ProvisionError(f"the configured PCI ports cannot be bound: {blocker}; no data "
                                 "plane can run with PCI addresses without vfio-pci (XDP needs "
                                 "interface names: rerun provisioning, which falls back to XDP)")
    elif app.get("dataplane") != "xdp" and hugepages.uses_dpdk(config):
        out.append(Note("prepare: the DPDK ports are kernel interfaces (a vdev): no binding"))
    out.append(MountBpffs(proc=proc, runner=runner))
    out.append(Searchable(BPFFS))
    out.append(PinDir(PIN_DIR, user))
    return out


def plan(ctx: Context, config_path: Path | str, *, sysfs: Path | None = None,
         proc: Path = Path("/proc"), management: str | None = None, net: NetState | None = None,
         user: str = USER, devbind: str = nics.DEVBIND, runner: Runner = _run) -> list[Action]:
    """H1's entry (``python -m hpclb.provision prepare``): the actions for
    the configuration at ``config_path``; host facts read now."""
    del ctx
    sysfs = sysfs or Path("/sys")
    config = _plain(Path(config_path))
    # Links, addresses and routes of the namespace prepare runs in (the
    # host's, at boot): where a NIC appears and where the operator's
    # management lives. Not appliance.netns: that namespace is the appliance's
    # own, and the unit's RestrictNamespaces= forbids entering it.
    facts = gather(sysfs, net=net, proc=proc)
    return prepare_actions(config, facts, management=management, sysfs=sysfs, proc=proc,
                           user=user, devbind=devbind, runner=runner)


def run(config_path: Path | str, *, check: bool = False, management: str | None = None,
        root: Path = Path("/"), sysfs: Path | None = None, proc: Path = Path("/proc"),
        net: NetState | None = None, user: str = USER, devbind: str = nics.DEVBIND,
        runner: Runner = _run, out: Callable[[str], None] = print) -> int:
    """Prepare the running host; returns the exit status (plan.EXIT_*).
    ``root``, ``sysfs``, ``proc``, ``net``, ``runner``: seams for tests."""
    ctx = Context(root=root, live=True, check=check, src=Path(__file__).resolve().parents[3],
                  out=out)
    try:
        actions = plan(ctx, config_path, sysfs=sysfs, proc=proc, management=management,
                       net=net, user=user, devbind=devbind, runner=runner)
        run_plan(actions, ctx)
    except ProvisionRefused as err:
        ctx.say(f"provision: refused: {err}")
        ctx.say("provision: nothing was changed")
        return EXIT_REFUSED
    except ProvisionError as err:
        ctx.say(f"provision: error: {err}")
        return EXIT_ERROR
    return EXIT_OK
