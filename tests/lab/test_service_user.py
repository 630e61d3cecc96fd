"""Lab: `hpclb run` started exactly as hpclb.service starts it, as a user.

The unit (appliance/systemd/hpclb.service) runs the control plane, and the data
plane it starts, as the user ``hpclb`` with a few ambient capabilities and
no_new_privs. Everything that decides whether that works is read from the unit
file itself and applied with ``setpriv``: User=/Group= (a numeric id here, the
test's own: no user is created on the host), no supplementary groups,
AmbientCapabilities=, CapabilityBoundingSet=, NoNewPrivileges=, LimitNOFILE=,
LimitMEMLOCK= (as far as this host's root may raise them), the environment
systemd gives the service (its own variables, RUNTIME_DIRECTORY among them,
then Environment= over them), and the unit's seccomp settings as systemd builds
them (SystemCallFilter= with its @groups expanded by systemd-analyze,
SystemCallErrorNumber=, RestrictAddressFamilies=, MemoryDenyWriteExecute=;
libseccomp through ctypes).

What the host holds for the service is prepared as hpclb-prepare.service and
systemd would, in a mount namespace of this test only (a holder process keeps
it; every `hpclb run` enters it, so a successor sees what its predecessor
pinned): a fresh bpffs on /sys/fs/bpf, mode 0700 as systemd mounts it, made
passable (01711) with /sys/fs/bpf/hpclb owned by the user (prepare's work);
/run/hpclb and /run/dpdk owned by the user (RuntimeDirectory=: hpclb-xdp locks
its pins in /run/hpclb/locks, DPDK keeps its runtime directory in /run/dpdk);
the configuration's directory group-writable (/etc/hpclb as provisioned). A
developer's interpreter under /root (pyenv) is made reachable there too: the
unit's ProtectHome= forbids that on an appliance, whose .venv is made from
/usr/bin/python3.

The appliance's namespace is entered before the privileges are dropped (the
unit runs in the host's network namespace; `appliance.netns` would need
CAP_SYS_ADMIN, a drop-in). Not applied here (no systemd as PID 1 on the lab
host): the unit's read-only and private mounts (ProtectSystem=, ProtectHome=,
PrivateTmp=, ProtectKernel*=, ProtectProc=) and RestrictNamespaces=,
RestrictRealtime=, LockPersonality=; they were checked as root with the same
bounding set, and a user changes none of them.

Checked, XDP: the processes' credentials, `hpclb check` (ExecStartPre=), ICMP
probes, forwarding through a VIP, a SIGHUP reload, a REST API write-back into
the configuration file, kill -9 of the control plane and adoption of the
running data plane by its successor, clean stop (the program detached); and
that without prepare's opening of /sys/fs/bpf the daemon cannot pin. DPDK:
net_af_packet as the unit is, net_af_xdp with the af-xdp drop-in: start (the
runtime directory where the unit's RUNTIME_DIRECTORY puts it), forwarding,
clean stop. appliance.netns: refused as the unit is, forwarding with the netns
drop-in.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import re
import resource
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from hpclb.dataplane.dpdk import free_hugepages_mb
from hpclb.lab.appliance import LAB_PORT, LAB_VIP, LabAppliance
from hpclb.lab.topology import Lab, default_pass_obj
from tests.unit.test_systemd_units import HPCLB as UNIT_FILE
from tests.unit.test_systemd_units import Unit

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None or shutil.which("nsenter") is None,
    reason="needs root (namespaces, XDP), setpriv and nsenter (util-linux)")

REPO = Path(__file__).resolve().parents[2]
WEIGHTS = {"b1": 1.0, "b2": 1.0, "b3": 2.0}
# ICMP probes: a raw socket, CAP_NET_RAW from the ambient set.
PROBE: dict[str, Any] = {"kind": "icmp", "interval_s": 0.5, "timeout_s": 0.5, "rise": 1,
                         "fall": 2, "damping": {"enabled": False}}
CAPS_BITS = {"CAP_NET_ADMIN": 12, "CAP_NET_RAW": 13, "CAP_IPC_LOCK": 14, "CAP_SYS_ADMIN": 21,
             "CAP_PERFMON": 38, "CAP_BPF": 39}


def free_id() -> int:
    """A uid (and gid of the same number) no user, group or process has."""
    used = {p.pw_uid for p in pwd.getpwall()} | {g.gr_gid for g in grp.getgrall()}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            used.add(os.stat(f"/proc/{pid}").st_uid)
        except OSError:
            continue
    return next(i for i in range(64100, 65000) if i not in used)


# Applies the unit's seccomp settings to this process, then execs argv[2:]:
# SystemCallFilter= (an allow-list, others fail with SystemCallErrorNumber=),
# RestrictAddressFamilies= (socket() of another family: EAFNOSUPPORT) and
# MemoryDenyWriteExecute= (W+X mappings, mprotect to X: EPERM), as systemd
# builds them, each a filter of its own (libseccomp through ctypes).
SECCOMP_LOADER = r"""
import ctypes, errno, json, os, sys
spec = json.loads(sys.argv[1])
lib = ctypes.CDLL("libseccomp.so.2")
lib.seccomp_init.restype = ctypes.c_void_p
lib.seccomp_init.argtypes = [ctypes.c_uint32]
lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                       ctypes.c_uint, ctypes.c_void_p]
lib.seccomp_load.argtypes = [ctypes.c_void_p]
lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
ALLOW = 0x7FFF0000
def fail(e): return 0x00050000 | e
class Cmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64),
                ("b", ctypes.c_uint64)]
EQ, GE, MASKED_EQ = 4, 5, 7
def nr(name):
    return lib.seccomp_syscall_resolve_name(name.encode())
def rule(ctx, action, name, *cmps):
    n = nr(name)
    if n < 0:
        return
    arr = (Cmp * max(1, len(cmps)))(*cmps)
    if lib.seccomp_rule_add_array(ctx, action, n, len(cmps), arr) < 0:
        raise SystemExit(f"seccomp rule {name} refused")
def load(ctx):
    if lib.seccomp_load(ctx) < 0:
        raise SystemExit("seccomp_load failed")
ctx = lib.seccomp_init(ALLOW)
for af in range(0, 64):
    if af not in spec["families"]:
        rule(ctx, fail(errno.EAFNOSUPPORT), "socket", Cmp(0, EQ, af, 0))
rule(ctx, fail(errno.EAFNOSUPPORT), "socket", Cmp(0, GE, 64, 0))
load(ctx)
if spec["mdwe"]:
    ctx = lib.seccomp_init(ALLOW)
    WX = 0x2 | 0x4
    rule(ctx, fail(errno.EPERM), "mmap", Cmp(2, MASKED_EQ, WX, WX))
    for name in ("mprotect", "pkey_mprotect"):
        rule(ctx, fail(errno.EPERM), name, Cmp(2, MASKED_EQ, 0x4, 0x4))
    rule(ctx, fail(errno.EPERM), "shmat", Cmp(2, MASKED_EQ, 0o100000, 0o100000))
    load(ctx)
# Last: seccomp() itself is outside the allow-list.
ctx = lib.seccomp_init(fail(getattr(errno, spec["errno"])))
for name in spec["allow"]:
    rule(ctx, ALLOW, name)
load(ctx)
os.execv(sys.argv[2], sys.argv[2:])
"""
FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10, "AF_NETLINK": 16, "AF_PACKET": 17,
            "AF_XDP": 44}


def expand_syscalls(words: list[str]) -> list[str]:
    """System call names of an allow-list as systemd expands its @groups."""
    names: set[str] = set()
    todo = list(words)
    seen: set[str] = set()
    while todo:
        word = todo.pop()
        if not word.startswith("@"):
            names.add(word)
            continue
        if word in seen:
            continue
        seen.add(word)
        out = subprocess.run(["systemd-analyze", "syscall-filter", word], capture_output=True,
                             text=True, check=True, timeout=30).stdout
        todo += [line.strip() for line in out.splitlines()[1:]
                 if line.strip() and not line.strip().startswith("#")]
    return sorted(names)



def within_reach(which: int, value: str) -> str:
    """The unit's limit for prlimit, or this process's hard limit where that is
    lower and cannot be raised (a lab host whose root lacks CAP_SYS_RESOURCE:
    the unit's LimitNOFILE=/LimitMEMLOCK= are then not reproduced; CAP_IPC_LOCK
    makes the memlock limit moot for the data plane anyway)."""
    want = resource.RLIM_INFINITY if value == "infinity" else int(value)
    hard = resource.getrlimit(which)[1]
    bits = int(proc_status(os.getpid())["CapEff"], 16)
    if not bits >> 24 & 1 and hard != resource.RLIM_INFINITY and \
            (want == resource.RLIM_INFINITY or want > hard):
        want = hard
    return "unlimited" if want == resource.RLIM_INFINITY else str(want)


@dataclass(frozen=True)
class ServiceStart:
    """How systemd would start hpclb.service's ExecStart=, as far as privileges,
    limits and environment go (read from the unit)."""

    uid: int
    capabilities: tuple[str, ...]
    bounding: tuple[str, ...]
    no_new_privs: bool
    nofile: str
    memlock: str
    environment: dict[str, str]
    seccomp: dict[str, Any] | None  # None: not applied (no systemd-analyze to expand groups)

    @classmethod
    def from_unit(cls, unit: Unit, uid: int) -> ServiceStart:
        assert unit.get("User") == "hpclb" and unit.get("Group") == "hpclb"
        assert not unit.values("SupplementaryGroups")
        runtime = [f"/run/{d}" for d in unit.words("RuntimeDirectory")]
        state = [f"/var/lib/{d}" for d in unit.words("StateDirectory")]
        # systemd's own variables first, Environment= over them (its merge order).
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin", "LANG": "C.UTF-8",
               "USER": "hpclb", "LOGNAME": "hpclb", "HOME": "/", "SHELL": "/usr/sbin/nologin",
               "INVOCATION_ID": uuid.uuid4().hex, "RUNTIME_DIRECTORY": ":".join(runtime),
               "STATE_DIRECTORY": ":".join(state)}
        for assignment in unit.values("Environment"):
            for word in assignment.split():
                key, _, value = word.partition("=")
                env[key] = value
        filters = unit.words("SystemCallFilter")
        assert filters and not any(f.startswith("~") for f in filters)  # an allow-list
        seccomp = None if shutil.which("systemd-analyze") is None else {
            "allow": expand_syscalls(filters),
            "errno": unit.get("SystemCallErrorNumber") or "EPERM",
            "families": [FAMILIES[f] for f in unit.words("RestrictAddressFamilies")],
            "mdwe": unit.yes("MemoryDenyWriteExecute")}
        return cls(uid, tuple(unit.words("AmbientCapabilities")),
                   tuple(unit.words("CapabilityBoundingSet")), unit.yes("NoNewPrivileges"),
                   unit.get("LimitNOFILE") or "1024", unit.get("LimitMEMLOCK") or "8M", env,
                   seccomp)

    def mask(self, caps: tuple[str, ...]) -> int:
        return sum(1 << CAPS_BITS[c] for c in caps)

    def argv(self, holder: int, netns: str) -> list[str]:
        """The command prefix: into the test's mount namespace and the appliance's
        network namespace, the unit's limits, then the user and capabilities."""
        def caps(names: tuple[str, ...]) -> str:
            return ",".join(["-all", *(f"+{c.removeprefix('CAP_').lower()}" for c in names)])

        nofile, memlock = within_reach(resource.RLIMIT_NOFILE, self.nofile), \
            within_reach(resource.RLIMIT_MEMLOCK, self.memlock)
        return ["nsenter", f"--mount=/proc/{holder}/ns/mnt", f"--net=/run/netns/{netns}", "--",
                "prlimit", f"--nofile={nofile}:{nofile}", f"--memlock={memlock}:{memlock}",
                "setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups",
                f"--inh-caps={caps(self.capabilities)}",
                f"--ambient-caps={caps(self.capabilities)}",
                f"--bounding-set={caps(self.bounding)}",
                *(["--no-new-privs"] if self.no_new_privs else []), "--",
                "env", "-i", *(f"{k}={v}" for k, v in sorted(self.environment.items())),
                *([str(REPO / ".venv" / "bin" / "python"), "-c", SECCOMP_LOADER,
                   json.dumps(self.seccomp)] if self.seccomp else []),
                str(REPO / ".venv" / "bin" / "hpclb")]


# What hpclb-prepare and systemd leave on the host, in this mount namespace only.
HOLDER_SETUP = r"""
set -eu
uid=$1 stage=$2 home_dir=$3
mount -t bpf -o mode=0700 bpf /sys/fs/bpf
chmod 01711 /sys/fs/bpf
mkdir -m 0700 /sys/fs/bpf/hpclb
chown "$uid:$uid" /sys/fs/bpf/hpclb
for d in /run/hpclb /run/dpdk; do
    mount -t tmpfs -o "mode=0750,uid=$uid,gid=$uid" tmpfs "$d"
done
if [ -n "$home_dir" ]; then
    mkdir -p "$stage/keep"
    mount --bind "$home_dir" "$stage/keep"
    mount -t tmpfs -o mode=0755 tmpfs /root
    mkdir -p "$home_dir"
    mount --bind "$stage/keep" "$home_dir"
    umount "$stage/keep"
fi
echo ready
exec sleep infinity
"""


@dataclass
class Holder:
    proc: subprocess.Popen[str]
    stage: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def path(self, inside: str) -> Path:
        """A path as the processes in the namespace see it."""
        return Path(f"/proc/{self.pid}/root") / inside.lstrip("/")


def interpreter_under_root() -> str:
    """The top folder under /root holding this venv's interpreter, or ''."""
    real = Path(os.path.realpath(REPO / ".venv" / "bin" / "python"))
    parts = real.parts
    return f"/root/{parts[2]}" if len(parts) > 2 and parts[1] == "root" else ""


@contextmanager
def mount_namespace(uid: int, setup: str = HOLDER_SETUP) -> Iterator[Holder]:
    """A holder process in a mount namespace set up by ``setup``; killed (and
    the namespace with its bpffs gone) on the way out."""
    for mountpoint in ("/run/hpclb", "/run/dpdk"):
        Path(mountpoint).mkdir(exist_ok=True)  # as hpclb-xdp and DPDK (root) make them
    stage = Path(tempfile.mkdtemp(prefix="hpclb-unit-"))
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                             setup, "holder", str(uid), str(stage), interpreter_under_root()],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        if proc.stdout.readline().strip() != "ready":
            proc.wait(timeout=10)
            raise AssertionError(f"mount namespace setup failed: {proc.stderr.read()}")
        yield Holder(proc, stage)
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(stage, ignore_errors=True)


@pytest.fixture(scope="module")
def uid() -> int:
    return free_id()


@pytest.fixture(scope="module")
def holder(uid: int) -> Iterator[Holder]:
    with mount_namespace(uid) as h:
        yield h


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with Lab(prefix=f"u{uuid.uuid4().hex[:6]}", backends=3,
             peer_xdp_pass=default_pass_obj()) as lab:
        lab.start_backends(LAB_PORT, udp=True)
        yield lab


class ServiceAppliance(LabAppliance):
    """The lab appliance as hpclb.service runs it: no appliance.netns (the
    namespace is entered by the command prefix), files owned as provisioning
    leaves them (the configuration's folder root:hpclb 0770, the file 0660,
    tokens 0640; the run and state folders the user's, 0750)."""

    def __init__(self, *args: Any, uid: int, driver: str = "af_xdp", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.uid = uid
        self.driver = driver
        for sub in ("run", "state"):
            (self.workdir / sub).mkdir(mode=0o750, exist_ok=True)
            os.chown(self.workdir / sub, uid, uid)
        os.chown(self.workdir, 0, uid)
        self.workdir.chmod(0o770)

    def config(self) -> dict[str, Any]:
        config = super().config()
        del config["appliance"]["netns"]
        dpdk = config["appliance"]["dpdk"]
        dpdk["driver"] = self.driver
        # The pool is reserved by hpclb-prepare: the user cannot write nr_hugepages.
        dpdk["reserve_hugepages"] = False
        return config

    def _write_config(self) -> None:
        super()._write_config()
        for path, mode in ((self.config_path, 0o660), *(
                (self.workdir / f"api-{role}.tokens", 0o640) for role in ("read", "write"))):
            if path.exists():
                os.chown(path, 0, self.uid)
                path.chmod(mode)


def proc_status(pid: int) -> dict[str, str]:
    text = Path(f"/proc/{pid}/status").read_text()
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def assert_runs_as_the_unit_says(pid: int, start: ServiceStart) -> None:
    s = proc_status(pid)
    assert s["Uid"].split() == [str(start.uid)] * 4, s["Uid"]
    assert s["Gid"].split() == [str(start.uid)] * 4, s["Gid"]
    assert s["Groups"].strip() == ""
    want = start.mask(start.capabilities)
    for key in ("CapEff", "CapPrm", "CapAmb"):
        assert int(s[key], 16) == want, (key, s[key])
    assert int(s["CapBnd"], 16) == start.mask(start.bounding)
    assert s["NoNewPrivs"].strip() == "1"
    if start.seccomp is not None:  # mode 2 (filter): families, MDWE, then the allow-list
        assert s["Seccomp"].strip() == "2"
        assert int(s["Seccomp_filters"]) == 2 + int(start.seccomp["mdwe"])


@pytest.fixture(scope="module")
def start(uid: int) -> ServiceStart:
    return ServiceStart.from_unit(Unit(UNIT_FILE), uid)


def make_workdir() -> Path:
    """Not under pytest's tmp_path: /tmp/pytest-of-root is root's 0700."""
    return Path(tempfile.mkdtemp(prefix="hpclb-svc-"))


@pytest.fixture(scope="module")
def xdp_appliance(lab: Lab, holder: Holder, start: ServiceStart) -> Iterator[ServiceAppliance]:
    workdir = make_workdir()
    app = ServiceAppliance(lab, workdir, WEIGHTS, uid=start.uid, dataplane="xdp",
                           weights_mode="static", probe=PROBE, api=True,
                           command_prefix=start.argv(holder.pid, lab.lb_ns))
    problem = app.config_problem()
    assert problem is None, problem
    try:
        with app:
            yield app
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def ended(pid: int) -> bool:
    """Gone, or a zombie (an adopted data plane is no child of its stopper:
    whoever inherited it reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] == "Z"
    except (OSError, IndexError):
        return True


def served_by(lab: Lab, connections: int = 60) -> dict[str, int]:
    report = lab.run_client(LAB_VIP, LAB_PORT, connections=connections)
    assert report["failures"] == 0, report["errors"]
    return dict(report["counts"])


def xdp_attached(lab: Lab) -> bool:
    out = lab.exec("lb", ["ip", "-d", "link", "show", "dev", "eth0"]).stdout
    return bool(re.search(r"\bxdp", out))


def test_xdp_as_the_service_user(lab: Lab, holder: Holder, start: ServiceStart,
                                 xdp_appliance: ServiceAppliance) -> None:
    app = xdp_appliance
    assert app.proc is not None
    dataplane = app.dataplane_pid()
    # ExecStartPre=: `hpclb check` (schema and host) as the same user.
    check = subprocess.run([*start.argv(holder.pid, lab.lb_ns), "check", "-c",
                            str(app.config_path)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and ": ok (" in check.stdout, check.stdout + check.stderr
    assert_runs_as_the_unit_says(app.proc.pid, start)
    assert_runs_as_the_unit_says(dataplane, start)
    pins = holder.path(f"/sys/fs/bpf/hpclb/{app.name}")
    assert pins.stat().st_uid == start.uid and any(pins.iterdir())
    assert xdp_attached(lab)

    # ICMP probes (raw socket) see every backend; traffic through the VIP reaches all.
    status = app.wait_status(lambda s: all(h["up"] for h in s["health"].values()),
                             timeout_s=20, what="every backend up by its ICMP probe")
    assert set(status["health"]) == set(WEIGHTS)
    assert set(served_by(lab)) == set(WEIGHTS)

    # SIGHUP: the reloaded weights reach the data plane.
    app.set_weight("b3", 0.0)
    assert "b3" not in served_by(lab)

    # The REST API writes the configuration back into its (group-writable) folder.
    r = app.api("POST", "/api/v1/backends/b1/drain")
    assert r.status_code == 200, r.text
    written = yaml.safe_load(app.config_path.read_text())
    assert next(b for b in written["pools"]["lab"]["backends"] if b["name"] == "b1")[
        "state"] == "draining"
    assert app.config_path.stat().st_uid == start.uid
    assert set(served_by(lab)) == {"b2"}
    assert app.api("POST", "/api/v1/backends/b1/undrain").status_code == 200

    # kill -9 of the control plane: the data plane forwards on, and the successor
    # (the same user, the same capabilities) adopts it.
    app.kill()
    assert set(served_by(lab)) == {"b1", "b2"}
    mark = len(app.log_text_full())
    app.resume()
    assert app.proc is not None
    assert "adopted running data plane" in app.log_text_full()[mark:], app.log_text()
    assert app.dataplane_pid() == dataplane
    assert_runs_as_the_unit_says(app.proc.pid, start)
    assert set(served_by(lab)) == {"b1", "b2"}

    # A clean stop (SIGTERM, as systemctl stop sends it) detaches the program
    # and ends the data plane.
    proc = app.proc
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, app.log_text()
    app.proc = None
    assert ended(dataplane)
    assert not xdp_attached(lab)


def test_without_prepare_the_user_cannot_pin(lab: Lab, uid: int, start: ServiceStart) -> None:
    """What the user may not do, it does not do: with /sys/fs/bpf as systemd
    mounts it (0700 root: not even passable) and no hpclb-prepare to open it,
    the XDP daemon cannot pin, and nothing is attached."""
    setup = HOLDER_SETUP.replace("chmod 01711 /sys/fs/bpf\n", "")
    assert setup != HOLDER_SETUP
    workdir = make_workdir()
    try:
        with mount_namespace(uid, setup) as h:
            app = ServiceAppliance(lab, workdir, WEIGHTS, uid=uid, dataplane="xdp",
                                   command_prefix=start.argv(h.pid, lab.lb_ns))
            res = app.run_to_exit(timeout_s=60)
            app.stop()
        assert res.returncode != 0
        daemon_log = (workdir / "run" / f"{app.name}.dataplane.log").read_text()
        assert "Permission denied" in daemon_log, daemon_log[-2000:]
        assert not xdp_attached(lab)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


class NetnsServiceAppliance(ServiceAppliance):
    """The lab's own mode: appliance.netns, the namespace entered by hpclb."""

    def config(self) -> dict[str, Any]:
        config = super().config()
        config["appliance"]["netns"] = self.lab.lb_ns
        return config


@pytest.mark.parametrize("drop_in", [None, "hpclb-netns.conf"])
def test_appliance_netns_needs_its_drop_in(lab: Lab, holder: Holder, uid: int,
                                           drop_in: str | None) -> None:
    """appliance.netns: refused as the unit is (setns needs CAP_SYS_ADMIN);
    with the netns drop-in it starts and forwards (its ARP nudge, `ip netns
    exec ... ping`, mounts: @mount)."""
    drop_ins = [UNIT_FILE.parent / "drop-ins" / drop_in] if drop_in else []
    start = ServiceStart.from_unit(Unit(UNIT_FILE, *drop_ins), uid)
    argv = [a for a in start.argv(holder.pid, lab.lb_ns) if not a.startswith("--net=")]
    workdir = make_workdir()
    app = NetnsServiceAppliance(lab, workdir, WEIGHTS, uid=uid, dataplane="xdp",
                                command_prefix=argv)
    try:
        if drop_in is None:
            res = app.run_to_exit(timeout_s=60)
            assert res.returncode != 0
            assert re.search(r"setns\(\S+\): Operation not permitted", res.stderr), res.stderr
        else:
            with app:
                assert set(served_by(lab)) == set(WEIGHTS)
    finally:
        app.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.parametrize(("driver", "drop_in"), [("af_packet", None),
                                                  ("af_xdp", "hpclb-af-xdp.conf")])
def test_dpdk_as_the_service_user(lab: Lab, holder: Holder, uid: int, driver: str,
                                  drop_in: str | None) -> None:
    """net_af_packet as the unit is; net_af_xdp with its drop-in (CAP_SYS_ADMIN
    for libxdp), the drop-in's settings read after the unit's."""
    drop_ins = [UNIT_FILE.parent / "drop-ins" / drop_in] if drop_in else []
    start = ServiceStart.from_unit(Unit(UNIT_FILE, *drop_ins), uid)
    forwarder = REPO / "dataplane" / "build" / "dpdk" / "hpclb-dpdk"
    if not forwarder.exists():
        pytest.skip(f"{forwarder} is not built")
    if free_hugepages_mb() < 256:
        pytest.skip(f"{free_hugepages_mb()} MB of 2 MB hugepages free, 256 needed "
                    "(hpclb-prepare reserves them on an appliance)")
    workdir = make_workdir()
    app = ServiceAppliance(lab, workdir, WEIGHTS, uid=start.uid, dataplane="dpdk",
                           driver=driver, command_prefix=start.argv(holder.pid, lab.lb_ns))
    try:
        with app:
            assert app.proc is not None
            assert_runs_as_the_unit_says(app.proc.pid, start)
            assert_runs_as_the_unit_says(app.dataplane_pid(), start)
            # DPDK's runtime directory: where the unit's RUNTIME_DIRECTORY puts it.
            runtime = holder.path(f"{start.environment['RUNTIME_DIRECTORY']}/dpdk/"
                                  f"{app.dpdk_file_prefix}")
            assert runtime.is_dir() and runtime.stat().st_uid == start.uid
            assert set(served_by(lab)) == set(WEIGHTS)
            proc = app.proc
            dataplane = app.dataplane_pid()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, app.log_text()
            app.proc = None
            assert ended(dataplane)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    # The kernel has the appliance's address back on eth0 (exception path undone).
    assert lab.ping("cli", lab.ip_of("lb"), count=1)

