"""What a user would pick instead of hpclb, as subjects of the bench runner, and a
new-connections-per-second measurement that compares them with hpclb.

Subjects (the ``Subject`` protocol of ``hpclb.lab.subjects``: ``name``, ``start()``,
``stop()``, ``conditions()``) on the one-arm DSR lab of ``hpclb.lab.bench`` (``Lab(...,
backends=3, ipv6=True)``: the generator in the client namespace sends to the VIP
through the appliance's MAC; forwarded frames are counted by the sink on the
appliance veth's peer):

``NftablesDnat``
    The kernel forwards: nftables DNAT with conntrack in the appliance namespace
    (``numgen random`` or ``jhash`` over the backends, ``hpclb.lab.kernel_nat``'s
    ruleset), back out of ``eth0`` to the backends' MACs. Its ``start()`` turns
    forwarding on (``ip_forward``; IPv6 ``forwarding``), stops ICMP redirects (a
    packet leaves by the interface it came in on: sysctl ``send_redirects`` for IPv4,
    an output rule in the table for IPv6, which has no such sysctl), makes the
    backends permanent neighbours (the sink on the appliance's peer drops ARP and NDP
    too, and resolution must not be in the measured path) and puts an XDP_PASS
    program on the appliance's ``eth0``, whose rx XDP counter is where the runner
    reads what was offered (a veth counts only while it runs NAPI). ``stop()`` undoes
    exactly that, in reverse: the table, the conntrack entries, the neighbours it
    added, the sysctls' earlier values, the program. ``masquerade=True`` also SNATs
    to the appliance's address: with it a TCP connection through the one-arm lab
    works (the backends answer the appliance, not the client), which is what the
    connection-rate measurement needs; without it the backends answer the client
    from their own address, which a client of the VIP discards (packet rates only).
``HaproxyTcp``
    HAProxy in TCP mode in the appliance namespace, listening on VIP:port (the VIP
    is on the appliance's ``lo``), round-robin over the backends; its configuration
    rendered with jinja2 into a temporary directory; a full proxy, so for
    connection rates only (``measures``), never in the packet-rate trials.
``Ipvs``
    Only says why it cannot run: this lab's kernel is built without IP_VS.

``measure_connection_rate`` opens short TCP connections from the client namespace
(connect, read the backend's name line, close) with several processes, each one
connection at a time, as fast as they go, for a given time; it reports connections
per second and the latency percentiles of connect() and of connect-to-name-line.
The client closes with a reset (SO_LINGER 0): a normal close would leave every
connection in TIME_WAIT on the client and use up its ephemeral ports within seconds.
``compare_connection_rates`` runs it against the backends directly (no balancer:
the ceiling of this client and these backends on this host, measured in the same
run) and against each subject.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

from jinja2 import Template

from hpclb.lab import kernel_nat
from hpclb.lab.subjects import SubjectUnavailable
from hpclb.lab.topology import DEFAULT_PORT, ETH, Lab, LabError, default_pass_obj

__all__ = ["HaproxyTcp", "Ipvs", "NftablesDnat", "SubjectUnavailable",
           "compare_connection_rates", "measure_connection_rate"]


# ---------------------------------------------------------------------- shared


def _lb_sysctl_get(lab: Lab, key: str) -> str | None:
    res = lab.exec("lb", ["sysctl", "-n", key], check=False)
    return res.stdout.strip() if res.returncode == 0 else None


class _Undo:
    """What a subject changed, undone in reverse order, every step tried even when
    an earlier one failed (the first error is raised at the end)."""

    def __init__(self) -> None:
        self._steps: list[tuple[str, Callable[[], None]]] = []

    def push(self, what: str, step: Callable[[], None]) -> None:
        self._steps.append((what, step))

    def run(self) -> None:
        errors: list[str] = []
        while self._steps:
            what, step = self._steps.pop()
            try:
                step()
            except Exception as err:  # keep undoing; reported below
                errors.append(f"{what}: {err}")
        if errors:
            raise LabError("stop left something behind: " + "; ".join(errors))


def _set_lb_sysctls(lab: Lab, values: dict[str, str], undo: _Undo) -> dict[str, str | None]:
    """Set sysctls of the appliance namespace, remembering the earlier values in
    ``undo``; returns the earlier values."""
    before = {k: _lb_sysctl_get(lab, k) for k in values}
    lab.sysctl("lb", values)
    restore = {k: v for k, v in before.items() if v is not None and v != values[k]}
    if restore:
        undo.push("sysctls", lambda: lab.sysctl("lb", restore))
    return before


def _permanent_neighbours(lab: Lab, family: int, undo: _Undo) -> list[str]:
    """The backends as permanent neighbours of the appliance's eth0 (of IP version
    ``family``); the entries that were not permanent before are deleted on undo."""
    added: list[str] = []
    for i in range(1, lab.backends + 1):
        ip = lab.ip6_of(f"b{i}") if family == 6 else lab.backend_ip(i)
        shown = lab.exec("lb", ["ip", "neigh", "show", ip, "dev", ETH], check=False).stdout
        if "PERMANENT" in shown:
            continue
        lab.exec("lb", ["ip", "neigh", "replace", ip, "lladdr", lab.backend_mac(f"b{i}"),
                        "dev", ETH, "nud", "permanent"])
        added.append(ip)

    def delete() -> None:
        for ip in added:
            lab.exec("lb", ["ip", "neigh", "del", ip, "dev", ETH], check=False)

    undo.push("neighbours", delete)
    return added


def _xdp_attached(lab: Lab, ns: str, ifname: str) -> bool:
    out = lab.exec(ns, ["ip", "-d", "link", "show", "dev", ifname]).stdout
    return " prog/xdp " in out or "xdpdrv" in out or "xdpgeneric" in out


# ---------------------------------------------------------------------- nftables


class NftablesDnat:
    """The kernel as the balancer of the one-arm DSR lab: nftables DNAT + conntrack
    in the appliance namespace, forwarding out of eth0 (module doc).

    ``balance``: ``"random"`` (``numgen random``, per new connection) or ``"jhash"``
    (a hash of the 4-tuple). ``family``: 4 or 6 (the lab's first VIP of that
    family; the IPv6 twin needs a dual-stack lab). ``masquerade``: SNAT to the
    appliance's address too (TCP through the one-arm lab). ``offered_counter``: put
    XDP_PASS on the appliance's eth0 so its rx XDP counter counts what arrives.
    """

    measures: ClassVar[tuple[str, ...]] = ("pps", "cps")

    def __init__(self, lab: Lab, balance: kernel_nat.Balance = "random", *, family: int = 4,
                 port: int = DEFAULT_PORT, vip: str | None = None, masquerade: bool = False,
                 offered_counter: bool = True, name: str | None = None) -> None:
        if family not in (4, 6):
            raise ValueError(f"family must be 4 or 6, got {family}")
        vips = lab.vips6 if family == 6 else lab.vips4
        if vip is None and not vips:
            raise ValueError(f"the lab has no IPv{family} VIP")
        self.lab = lab
        self.family = family
        self.nat = kernel_nat.nat_for_lab(
            lab, vip or vips[0], port, balance=balance, masquerade=masquerade,
            out_ifname=ETH, drop_redirects=family == 6)
        self.vip = self.nat.vip  # where the runner aims the generator
        self.offered_counter = offered_counter
        pick = "numgen" if balance == "random" else "jhash"
        self.name = name or ("nftables_dnat_" + pick + ("_masq" if masquerade else "")
                             + ("_ipv6" if family == 6 else ""))
        self._undo = _Undo()
        self._started = False
        self._sysctls: dict[str, str] = {}

    def _forwarding_sysctls(self) -> dict[str, str]:
        if self.family == 6:
            return {"net.ipv6.conf.all.forwarding": "1", f"net.ipv6.conf.{ETH}.forwarding": "1"}
        # A redirect is sent when either "all" or the device asks for it.
        return {"net.ipv4.ip_forward": "1",
                "net.ipv4.conf.all.send_redirects": "0",
                f"net.ipv4.conf.{ETH}.send_redirects": "0",
                # rp_filter is off in the lab's appliance already (a VIP on lo); kept
                # here so that the subject does not depend on it.
                "net.ipv4.conf.all.rp_filter": "0", f"net.ipv4.conf.{ETH}.rp_filter": "0"}

    def start(self) -> None:
        if self._started:
            return
        reason = kernel_nat.nft_missing()
        if reason is not None:
            raise SubjectUnavailable(reason)
        lab = self.lab
        try:
            if self.offered_counter:
                if _xdp_attached(lab, "lb", ETH):
                    raise LabError(f"the appliance's {ETH} already runs an XDP program")
                lab.attach_xdp("lb", ETH, default_pass_obj())
                self._undo.push("xdp", lambda: lab.detach_xdp("lb", ETH))
            self._sysctls = self._forwarding_sysctls()
            _set_lb_sysctls(lab, self._sysctls, self._undo)
            _permanent_neighbours(lab, self.family, self._undo)
            self._flush_conntrack()
            try:
                kernel_nat.install_kernel_nat(lab, self.nat)
            except LabError as err:
                raise SubjectUnavailable(f"nft refused the ruleset: {err}") from err
            self._undo.push("table", self._remove_table)
        except BaseException:
            self._undo.run()
            raise
        self._started = True

    def _flush_conntrack(self) -> None:
        if shutil.which("conntrack") is not None:
            kernel_nat.flush_conntrack(self.lab)

    def _remove_table(self) -> None:
        kernel_nat.remove_kernel_nat(self.lab, self.family)
        self._flush_conntrack()

    def stop(self) -> None:
        self._started = False
        self._undo.run()

    def __enter__(self) -> NftablesDnat:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def counters(self) -> dict[str, int]:
        """The rules' counters (new connections, not packets: conntrack does the
        rest) and the conntrack table's size."""
        counts = kernel_nat.rule_counters(self.lab, self.family)
        size = _lb_sysctl_get(self.lab, "net.netfilter.nf_conntrack_count")
        counts["conntrack_entries"] = int(size) if size and size.isdigit() else -1
        return counts

    def conditions(self) -> dict[str, Any]:
        return {
            "subject": "nftables DNAT with conntrack, the kernel forwarding back out of "
                       f"{ETH} (one-arm)",
            "balance": "numgen random" if self.nat.balance == "random" else "jhash 4-tuple",
            "family": f"IPv{self.family}",
            "vip": self.nat.vip,
            "backends": list(self.nat.backends),
            "masquerade": self.nat.masquerade,
            "ruleset": kernel_nat.ruleset(self.nat),
            "sysctls": self._sysctls or self._forwarding_sysctls(),
            "neighbours": "backends permanent on the appliance's eth0 (no ARP/NDP in path)",
            "offered_counter": ("XDP_PASS (pass.bpf.o) on the appliance's eth0: its rx XDP "
                                "counter counts the offered frames" if self.offered_counter
                                else "none"),
            "nf_conntrack_max": _lb_sysctl_get(self.lab, "net.netfilter.nf_conntrack_max"),
        }


# ---------------------------------------------------------------------- HAProxy

HAPROXY_CFG = """\
# Rendered by hpclb.lab.peers.HaproxyTcp: HAProxy in TCP mode on the lab's
# appliance, round-robin over the backends.
global
    maxconn {{ maxconn }}
    nbthread {{ threads }}
    # no log: a log line per connection would be measured too

defaults
    mode tcp
    timeout connect {{ timeout_s }}s
    timeout client {{ timeout_s }}s
    timeout server {{ timeout_s }}s
    maxconn {{ maxconn }}

frontend vip
{%- for bind in binds %}
    bind {{ bind }}
{%- endfor %}
    default_backend pool

backend pool
    balance roundrobin
    # Close towards the backends with a reset: a normal close would leave each
    # connection in TIME_WAIT on the appliance and use up its source ports.
    option nolinger
{%- for name, address in servers %}
    server {{ name }} {{ address }}
{%- endfor %}
"""


def _hostport(address: str, port: int) -> str:
    """HAProxy's address:port (an IPv6 address in brackets)."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def render_haproxy(binds: Sequence[tuple[str, int]], servers: Sequence[tuple[str, str, int]],
                   *, threads: int = 2, maxconn: int = 20000, timeout_s: float = 10) -> str:
    """HAProxy's configuration: listen on every (address, port) of ``binds``,
    round-robin over ``servers`` ((name, address, port)), TCP mode."""
    if not binds or not servers:
        raise ValueError("haproxy needs an address to listen on and a server")
    for _, port in binds:
        if not 1 <= port <= 65535:
            raise ValueError(f"port {port} not in 1..65535")
    return Template(HAPROXY_CFG).render(
        binds=[_hostport(a, p) for a, p in binds],
        servers=[(n, _hostport(a, p)) for n, a, p in servers],
        threads=threads, maxconn=maxconn, timeout_s=int(timeout_s),
    ) + "\n"  # jinja2 drops the last newline; haproxy refuses a file without it


def haproxy_missing() -> str | None:
    if shutil.which("haproxy") is None:
        return "haproxy not found: install Debian's haproxy package (./bootstrap does)"
    return None


def haproxy_maxconn(ceiling: int = 20000) -> int:
    """A maxconn HAProxy can have here: it needs two descriptors per connection and
    refuses to start when the hard RLIMIT_NOFILE is below that."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        return ceiling
    return max(100, min(ceiling, (hard - 200) // 2))


def _listening(lab: Lab, ns: str, port: int) -> bool:
    out = lab.exec(ns, ["ss", "-Hltn", f"sport = :{port}"], check=False).stdout
    return bool(out.strip())


class HaproxyTcp:
    """HAProxy in TCP mode in the appliance namespace on VIP:port (every VIP of the
    lab: IPv4 and IPv6), round-robin over the backends' servers on ``port``, which
    ``start()`` starts where they do not run yet (and ``stop()`` stops those)."""

    measures: ClassVar[tuple[str, ...]] = ("cps",)

    def __init__(self, lab: Lab, *, port: int = DEFAULT_PORT, threads: int = 2,
                 start_backends: bool = True, name: str = "haproxy_tcp") -> None:
        self.lab = lab
        self.port = port
        self.threads = threads
        self.start_backends = start_backends
        self.name = name
        self.vip = lab.vips4[0]
        self._proc: subprocess.Popen[str] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._undo = _Undo()
        self.config_text = ""

    def render(self) -> str:
        lab = self.lab
        servers: list[tuple[str, str, int]] = [
            (f"b{i}", lab.backend_ip(i), self.port) for i in range(1, lab.backends + 1)]
        return render_haproxy([(v, self.port) for v in lab.vips4], servers,
                              threads=self.threads, maxconn=haproxy_maxconn())

    def start(self, timeout_s: float = 10.0) -> None:
        if self._proc is not None:
            return
        reason = haproxy_missing()
        if reason is not None:
            raise SubjectUnavailable(reason)
        lab = self.lab
        try:
            if self.start_backends:
                for i in range(1, lab.backends + 1):
                    if not _listening(lab, f"b{i}", self.port):
                        lab.start_backend(i, self.port)
                        self._undo.push(f"backend b{i}",
                                        lambda i=i: lab.stop_backend(i, self.port))
            self._tmp = tempfile.TemporaryDirectory(prefix="hpclb-haproxy-")
            self._undo.push("workdir", self._tmp.cleanup)
            cfg = Path(self._tmp.name) / "haproxy.cfg"
            self.config_text = self.render()
            cfg.write_text(self.config_text)
            check = subprocess.run(["haproxy", "-c", "-q", "-f", str(cfg)],
                                   capture_output=True, text=True, timeout=30, check=False)
            if check.returncode != 0:
                raise LabError(f"haproxy -c refused {cfg}: "
                               f"{(check.stdout + check.stderr).strip()[-2000:]}")
            log = open(Path(self._tmp.name) / "haproxy.log", "w")
            self._undo.push("log", log.close)
            # -db: foreground, no daemon, so that the lab owns (and stops) the process.
            proc = lab.popen("lb", ["haproxy", "-db", "-f", str(cfg)],
                             stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
            self._proc = proc
            self._undo.push("haproxy", lambda: lab.stop_process(proc))
            deadline = time.monotonic() + timeout_s
            while not _listening(lab, "lb", self.port):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise LabError("haproxy did not listen: "
                                   + (Path(self._tmp.name) / "haproxy.log").read_text()[-2000:])
                time.sleep(0.05)
        except BaseException:
            self._proc = None
            self._undo.run()
            raise

    def stop(self) -> None:
        self._proc = None
        self._undo.run()

    def __enter__(self) -> HaproxyTcp:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def cpu_seconds(self) -> float | None:
        """CPU seconds HAProxy's process has used so far (None when not running)."""
        if self._proc is None:
            return None
        with contextlib.suppress(OSError, ValueError, IndexError):
            return process_cpu_s(self._proc.pid)
        return None

    def version(self) -> str:
        res = subprocess.run(["haproxy", "-v"], capture_output=True, text=True, check=False)
        return res.stdout.splitlines()[0] if res.stdout else "?"

    def conditions(self) -> dict[str, Any]:
        return {
            "subject": "HAProxy, TCP mode, in the appliance namespace (a full proxy: two "
                       "TCP connections per client connection)",
            "version": self.version() if haproxy_missing() is None else None,
            "threads": self.threads,
            "balance": "roundrobin",
            "config": self.config_text or self.render(),
        }


# ---------------------------------------------------------------------- IPVS


def ipvs_missing() -> str | None:
    """Why IPVS cannot run here (with the evidence looked at), or None when the
    kernel has it."""
    if Path("/proc/net/ip_vs").exists() or Path("/sys/module/ip_vs").exists():
        return None
    evidence = ["no /proc/net/ip_vs", "no /sys/module/ip_vs"]
    modules = Path("/proc/modules")
    if modules.exists():
        if any(line.split()[:1] == ["ip_vs"] for line in modules.read_text().splitlines()):
            return None
        evidence.append("ip_vs not in /proc/modules")
    else:
        evidence.append("no /proc/modules (a kernel without loadable modules)")
    if shutil.which("modprobe") is not None:
        res = subprocess.run(["modprobe", "ip_vs"], capture_output=True, text=True, check=False)
        if res.returncode == 0 and Path("/proc/net/ip_vs").exists():
            return None
        evidence.append(f"modprobe ip_vs: {(res.stderr or '').strip() or res.returncode}")
    else:
        evidence.append("no modprobe")
    release = os.uname().release
    if not Path(f"/lib/modules/{release}").is_dir():
        evidence.append(f"no /lib/modules/{release}")
    config = _kernel_config_line("CONFIG_IP_VS")
    if config is not None:
        evidence.append(f"kernel config: {config}")
    return f"this kernel ({release}) has no IPVS: " + "; ".join(evidence)


def _kernel_config_line(option: str) -> str | None:
    """The kernel configuration's line for ``option`` (/proc/config.gz, or
    /boot/config-<release>), or None when no configuration is readable."""
    import gzip

    text = None
    with contextlib.suppress(OSError):
        text = gzip.decompress(Path("/proc/config.gz").read_bytes()).decode()
    if text is None:
        with contextlib.suppress(OSError):
            text = Path(f"/boot/config-{os.uname().release}").read_text()
    if text is None:
        return None
    for line in text.splitlines():
        if line.startswith(f"{option}=") or line == f"# {option} is not set":
            return line
    return f"{option} absent"


class Ipvs:
    """IPVS (the kernel's L4 balancer, ``ipvsadm``): a subject only where the kernel
    has it. Only detection is implemented; on this lab's kernel it raises
    SubjectUnavailable with the evidence."""

    measures: ClassVar[tuple[str, ...]] = ("pps", "cps")
    name = "ipvs"

    def __init__(self, lab: Lab) -> None:
        self.lab = lab

    def start(self) -> None:
        reason = ipvs_missing()
        if reason is not None:
            raise SubjectUnavailable(reason)
        raise SubjectUnavailable("this kernel has IPVS, but hpclb's lab has no IPVS subject "
                                 "yet (only the detection is written)")

    def stop(self) -> None:
        pass

    def conditions(self) -> dict[str, Any]:
        return {"subject": "IPVS", "available": ipvs_missing() or "yes"}


# ---------------------------------------------------------------------- connections/s

LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a reset
NAME_LINE_MAX = 256


def _one_connection(target: tuple[str, int], timeout: float) -> tuple[int, int, str]:
    """One connection: (connect ns, connect-to-name-line ns, backend name)."""
    family = socket.AF_INET6 if ":" in target[0] else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RESET)
        sock.settimeout(timeout)
        t0 = time.perf_counter_ns()
        sock.connect(target)
        t1 = time.perf_counter_ns()
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(NAME_LINE_MAX)
            if not chunk:
                raise ConnectionResetError("closed before the name line")
            data += chunk
            if len(data) > NAME_LINE_MAX:
                raise ValueError("name line too long")
        t2 = time.perf_counter_ns()
        return t1 - t0, t2 - t0, data.decode(errors="replace").strip()
    finally:
        sock.close()


def connection_client(targets: Sequence[tuple[str, int]], seconds: float, timeout: float,
                      start_at: float | None = None) -> dict[str, Any]:
    """One client process: connections one after the other, round-robin over
    ``targets``, for ``seconds`` (from wall-clock ``start_at`` when given, so that
    several processes run the same window). Latencies in µs, every sample."""
    if start_at is not None:
        time.sleep(max(0.0, start_at - time.time()))
    connect_us: list[int] = []
    total_us: list[int] = []
    names: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    t_start = time.monotonic()
    end = t_start + seconds
    n = 0
    while time.monotonic() < end:
        target = targets[n % len(targets)]
        n += 1
        try:
            c, t, name = _one_connection(target, timeout)
        except (OSError, ValueError) as err:
            errors[type(err).__name__] += 1
            continue
        connect_us.append(c // 1000)
        total_us.append(t // 1000)
        names[name] += 1
    return {"elapsed_s": time.monotonic() - t_start, "ok": len(total_us),
            "failed": sum(errors.values()), "errors": dict(errors), "names": dict(names),
            "connect_us": connect_us, "total_us": total_us}


def host_cpu_busy_s() -> float:
    """CPU seconds the whole host has spent busy (every CPU, /proc/stat: all but idle
    and iowait), softirq included: where the kernel's forwarding and XDP are paid."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentiles(samples: Sequence[int]) -> dict[str, float]:
    """min, mean, p50, p90, p99, p99.9 and max of latency samples (µs)."""
    if not samples:
        return {}
    s = sorted(samples)

    def at(q: float) -> float:
        return float(s[min(len(s) - 1, int(q * len(s)))])

    return {"min_us": float(s[0]), "avg_us": statistics.fmean(s), "p50_us": at(0.50),
            "p90_us": at(0.90), "p99_us": at(0.99), "p999_us": at(0.999),
            "max_us": float(s[-1])}


def _targets_arg(targets: Sequence[tuple[str, int]]) -> str:
    return ",".join(_hostport(a, p) for a, p in targets)


def _parse_targets(text: str) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for item in text.split(","):
        host, _, port = item.rpartition(":")
        out.append((host.strip("[]"), int(port)))
    return out


def measure_connection_rate(lab: Lab, seconds: float, *,
                            targets: Sequence[tuple[str, int]] | None = None,
                            processes: int = 4, timeout: float = 2.0,
                            label: str | None = None) -> dict[str, Any]:
    """New TCP connections per second and connection latency through whatever
    holds ``targets`` (default: the lab's first IPv4 VIP on the default port), from
    the client namespace: ``processes`` processes, each one connection at a time
    (connect, read the backend's name line, close with a reset), for ``seconds``.

    The lab must already forward to ``targets`` (a subject started, backends'
    servers running). Returns connections/s (the sum of the processes' rates), the
    latency percentiles of connect() and of connect-to-name-line (µs, every
    connection's), connections per backend name, failures by kind. A measurement:
    on a shared host the client, the balancer and the backends share the CPUs.
    """
    if seconds <= 0 or processes < 1:
        raise ValueError("seconds must be positive and processes at least 1")
    targets = list(targets or [(lab.vips4[0] if lab.vips4 else lab.vips[0], DEFAULT_PORT)])
    argv = [sys.executable, "-m", "hpclb.lab.peers", "connclient", "--targets",
            _targets_arg(targets), "--seconds", str(seconds), "--timeout", str(timeout),
            "--wait-go"]
    procs = [lab.popen("cli", argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE) for _ in range(processes)]
    # Every client imports, says it is ready, then all start at one wall-clock time:
    # on a loaded host an interpreter's start-up takes seconds, and the windows must
    # be the same for the rates to add up and for the host's CPU to be theirs.
    for proc in procs:
        assert proc.stdout is not None
        proc.stdout.readline()  # READY, or "" from a client that died (reported below)
    start_at = time.time() + 0.2
    for proc in procs:
        assert proc.stdin is not None
        with contextlib.suppress(OSError):  # (communicate() closes stdin)
            proc.stdin.write(f"{start_at:.6f}\n")
            proc.stdin.flush()
    # The host's CPU over the clients' window (not their start-up and exit).
    time.sleep(max(0.0, start_at - time.time()))
    busy0 = host_cpu_busy_s()
    time.sleep(max(0.0, start_at + seconds - time.time()))
    busy = host_cpu_busy_s() - busy0
    reports: list[dict[str, Any]] = []
    problems: list[str] = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=seconds + timeout + 60)
        except subprocess.TimeoutExpired:
            lab.stop_process(proc)
            problems.append("a client process did not finish")
            continue
        try:
            reports.append(json.loads(out))
        except json.JSONDecodeError:
            problems.append(f"client exited {proc.returncode}: {err.strip()[-500:]}")
    if not reports:
        raise LabError("no connection client reported: " + "; ".join(problems))
    connect = [x for r in reports for x in r["connect_us"]]
    total = [x for r in reports for x in r["total_us"]]
    names: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    for r in reports:
        names.update(r["names"])
        errors.update(r["errors"])
    ok = sum(r["ok"] for r in reports)
    cps = sum(r["ok"] / r["elapsed_s"] for r in reports if r["elapsed_s"] > 0)
    return {
        "label": label or _targets_arg(targets),
        "targets": [_hostport(a, p) for a, p in targets],
        "seconds": seconds,
        "processes": processes,
        "processes_reported": len(reports),
        "connections": ok,
        "failed": sum(r["failed"] for r in reports),
        "errors": dict(errors),
        "problems": problems,
        "cps": cps,
        "latency_connect": percentiles(connect),
        "latency_name_line": percentiles(total),
        "backends": dict(sorted(names.items())),
        # Everything the host did per connection (client, balancer, backends, softirq,
        # and whatever else runs here): compare with the direct row on a quiet host.
        "host_cpu_busy_s": busy,
        "host_cpu_us_per_connection": busy / (cps * seconds) * 1e6 if cps else None,
        "client": ("python, blocking sockets, one connection at a time per process, "
                   "close with a reset (SO_LINGER 0)"),
    }


def direct_targets(lab: Lab, port: int = DEFAULT_PORT) -> list[tuple[str, int]]:
    """Every backend's own address: the client and the backends without a balancer."""
    return [(lab.backend_ip(i), port) for i in range(1, lab.backends + 1)]


@contextlib.contextmanager
def _started(subject: Any) -> Iterator[Any]:
    subject.start()
    try:
        yield subject
    finally:
        subject.stop()


def compare_connection_rates(lab: Lab, seconds: float, subjects: Sequence[Any], *,
                             processes: int = 4, port: int = DEFAULT_PORT
                             ) -> dict[str, Any]:
    """``measure_connection_rate`` against the backends directly (the ceiling of this
    client with these backends here, no balancer) and through each subject (started
    and stopped around its measurement) on the lab's first IPv4 VIP. The backends'
    servers must run on ``port``; the appliance's veth peer must deliver (XDP_PASS,
    not the sink). A subject that cannot run is reported with its reason."""
    vip = (lab.vips4[0], port)
    rows: dict[str, Any] = {"direct": measure_connection_rate(
        lab, seconds, targets=direct_targets(lab, port), processes=processes,
        label="direct to the backends")}
    for subject in subjects:
        try:
            with _started(subject):
                cpu = getattr(subject, "cpu_seconds", None)
                cpu0 = cpu() if cpu is not None else None
                row = measure_connection_rate(lab, seconds, targets=[vip],
                                              processes=processes, label=subject.name)
                cpu1 = cpu() if cpu is not None else None
                if cpu0 is not None and cpu1 is not None and row["connections"]:
                    # The proxy's own process (user + system), beside the host's total.
                    row["process_cpu_us_per_connection"] = (
                        (cpu1 - cpu0) / row["connections"] * 1e6)
                row["conditions"] = subject.conditions()
        except SubjectUnavailable as err:
            row = {"unavailable": str(err)}
        rows[subject.name] = row
    ceiling = rows["direct"]["cps"]
    base = rows["direct"]["host_cpu_us_per_connection"]
    for name, row in rows.items():
        if name != "direct" and "cps" in row and ceiling:
            row["ratio_to_direct"] = row["cps"] / ceiling
            if base is not None and row["host_cpu_us_per_connection"] is not None:
                # What the balancer adds per connection, all CPUs counted.
                row["marginal_host_cpu_us_per_connection"] = (
                    row["host_cpu_us_per_connection"] - base)
    return rows


# ---------------------------------------------------------------------- the runner's lists


def packet_subjects(lab: Lab) -> list[Any]:
    """The peers for the packet-rate trials on ``lab`` (the bench's one-arm lab):
    nftables DNAT with numgen and with jhash, the jhash IPv6 twin on a dual-stack
    lab, and IPVS (which says why it cannot run where it cannot)."""
    subjects: list[Any] = [NftablesDnat(lab, "random"), NftablesDnat(lab, "jhash")]
    if lab.vips6:
        subjects.append(NftablesDnat(lab, "jhash", family=6))
    subjects.append(Ipvs(lab))
    return subjects


def connection_subjects(lab: Lab) -> list[Any]:
    """The peers for the connection-rate measurement: HAProxy in TCP mode, nftables
    DNAT with masquerade (the only way a TCP connection crosses the kernel's NAT in
    the one-arm lab) and IPVS."""
    return [HaproxyTcp(lab), NftablesDnat(lab, "random", masquerade=True), Ipvs(lab)]


@contextlib.contextmanager
def peer_program(lab: Lab, obj: str | os.PathLike[str],
                 restore: str | os.PathLike[str] | None = None) -> Iterator[None]:
    """Run XDP object ``obj`` on the appliance veth's bridge-side peer for the block
    (``default_pass_obj()``: deliver to the backends, as connections need), then
    ``restore`` (the bench's sink), or nothing."""
    peer = lab.peer("lb")
    lab.detach_xdp("br", peer)
    lab.attach_xdp_pass(peer, obj)
    try:
        yield
    finally:
        lab.detach_xdp("br", peer)
        if restore is not None:
            lab.attach_xdp_pass(peer, restore)


# ---------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    """``connclient``: one process of ``measure_connection_rate`` (in the lab's
    client namespace); prints its JSON report."""
    parser = argparse.ArgumentParser(prog="python -m hpclb.lab.peers")
    sub = parser.add_subparsers(dest="command", required=True)
    client = sub.add_parser("connclient", help="short TCP connections, as fast as they go")
    client.add_argument("--targets", required=True, help="ADDR:PORT[,ADDR:PORT...]")
    client.add_argument("--seconds", type=float, required=True)
    client.add_argument("--timeout", type=float, default=2.0)
    client.add_argument("--wait-go", action="store_true",
                        help="print 'ready', then start at the wall-clock time read "
                             "from stdin")
    args = parser.parse_args(argv)
    start_at = None
    if args.wait_go:
        print("ready", flush=True)
        start_at = float(sys.stdin.readline())
    report = connection_client(_parse_targets(args.targets), args.seconds, args.timeout,
                               start_at)
    print(json.dumps(report, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
