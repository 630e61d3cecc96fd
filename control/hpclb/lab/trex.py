"""TRex as the lab's traffic generator (`hpclb bench --generator trex`).

TRex (Cisco's DPDK traffic generator, stateless mode) offers frames at a rate it
holds on its own, whatever the path does with them, and measures latency on a
stream of its own: what a no-drop-rate search needs and trafgen cannot give. Its
server is in no package registry: ``perf/trex/build_trex.sh`` builds it from source
(``perf/trex/README.md``); ``--trex-dir``/``$HPCLB_TREX_DIR`` names the built tree.

Three pieces, kept apart:

* the **server** (``TrexServer``): started here for the lab from a rendered
  ``trex_cfg.yaml`` (``templates/trex_cfg.yaml.j2``: af_packet vdevs on veths,
  ``low_end: true``, no hugepages), in the namespace that holds its interfaces, and
  stopped again whatever happens; or a server already running on real hardware
  (``--trex-server HOST``), which is only connected to;
* the **client**: ``lbr-trex-client`` brings its own scapy and zmq, so it never enters
  this interpreter. ``perf/trex/driver.py`` runs in the TRex client's interpreter
  (``.venv-trex``, ``$HPCLB_TREX_PYTHON``) and speaks JSON lines with ``TrexDriver``;
  the profiles it loads are ``perf/trex/profiles/*.py``;
* the **generator** (``TrexGenerator``): the bench's Generator protocol
  (``hpclb.lab.subjects``): ``trial(rate_pps, seconds) -> hpclb.lab.ndr.Trial``, the
  latency stream's min/avg/max and p50/p99/p99.9 decoded from TRex's HDR histogram.

Wiring in the lab (``Lab``: client, appliance, backends on one bridge ``br0`` in the
``{p}-br`` namespace)::

    {p}-br namespace                                {p}-lb namespace
    TRex port 0 ── af_packet on v-lb ══ veth ══ eth0 (appliance: XDP / AF_XDP / kernel)
      (v-lb taken off br0 while TRex runs)            │ forwards back out of eth0
    TRex port 1: "dummy" (TRex pairs ports)           ▼ (one-arm, DSR: to a backend's MAC)
    frames come back on v-lb ─────────────────────────┘ = TRex port 0 rx

TRex takes the appliance's cable out of the switch: ``v-lb``, the bridge side of the
appliance's ``eth0``, leaves ``br0`` and becomes TRex port 0. Port 0 sends as the
client would (source MAC the client's, destination the appliance's, to the VIP,
source addresses and ports walked by the profile's field engine); whatever the
appliance sends back out of ``eth0`` (DSR: to a backend's MAC; the reflector: back to
the sender) arrives on ``v-lb`` and is TRex port 0's rx, whatever its destination
MAC (promiscuous). Nothing goes through the bridge, no backend receives the load, and
the frames counted are the same ones the trafgen bench counts at ``v-lb``'s sink.
An XDP_PASS program on ``v-lb`` (replacing the bench's XDP_DROP sink) is what makes
XDP_TX from ``eth0`` reach ``v-lb``'s stack at all (``hpclb.lab.topology``, module
doc), where TRex's packet socket sees it; frames are then dropped by ``v-lb``'s stack
cheaply (no address, not for its MAC). The appliance must not need the bridge while
TRex runs: the bench's appliances take static MACs (``static_macs=True``) and no
health probes, as they do under trafgen's sink. ``unplug()`` puts ``v-lb`` back on
``br0`` (with XDP_PASS, the lab's usual peer program).

With ``decoupled`` (the default where the kernel has threaded NAPI), the appliance's
``eth0`` NAPI runs in a kthread pinned to CPU 1 and TRex (``low_end_core``) on CPU 0,
as the trafgen generator does (``hpclb.lab.subjects.NapiDecoupler``): TRex's packet
socket only queues a frame on the appliance's ring, and a path slower than the offer
loses frames there, which is what the search looks for.

Counting: offered = TRex port 0's ``opackets`` (latency stream included), forwarded =
its ``ipackets``, both read ``settle_s`` after the trial; the appliance's own XDP
counters go in ``Trial.extra`` (where a loss happened). Latency: the latency stream
(``STLFlowLatencyStats``, 1,000 pps by default) beside the load; the server runs with
``--hdrh`` and reports each packet group's HDR histogram (µs, 3 significant digits),
decoded here with ``hdrhistogram``.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import IO, Any

from jinja2 import Template

from hpclb.host import install
from hpclb.lab.appliance import LAB_PORT, LAB_VIP
from hpclb.lab.ndr import Trial
from hpclb.lab.topology import BRIDGE, ETH, Lab, LabError

TEMPLATE = "templates/trex_cfg.yaml.j2"  # package data of hpclb
REPO = Path(__file__).resolve().parents[3]
PERF_TREX = REPO / "perf" / "trex"
PROFILES = PERF_TREX / "profiles"
DRIVER = PERF_TREX / "driver.py"
ZMQ_PUB_PORT = 4500
ZMQ_RPC_PORT = 4501
# Source addresses the profiles walk: inside the lab LAN, clear of the hosts (.2, .3),
# the backends (.11 up to .210) and the tunnel rows' sources (.240/28).
SRC_IP = "198.18.0.224"
SRC_IPS = 16
LAT_PPS = 1000.0
PG_ID = 7
# Asked for a "full speed" trial: far above what af_packet on a veth can send.
FULL_SPEED_PPS = 20_000_000.0
GENERATOR_CPU = 0
SETTLE_S = 0.5
NO_TREX = "no TRex server: set HPCLB_TREX_DIR to a built TRex tree (perf/trex/build_trex.sh)"


class TrexError(RuntimeError):
    """The TRex server or its client failed; the message carries TRex's words."""


# ---------------------------------------------------------------- locating


def find_trex_dir(explicit: str | os.PathLike[str] | None = None) -> Path | None:
    """The ``scripts`` directory of a built TRex tree (holding ``t-rex-64`` and
    ``_t-rex-64``), from ``explicit`` or ``$HPCLB_TREX_DIR``; the tree's root or its
    ``scripts`` may be named. None when there is none."""
    given = explicit if explicit is not None else os.environ.get("HPCLB_TREX_DIR")
    if not given:
        return None
    root = Path(given).expanduser()
    for d in (root / "scripts", root):
        if (d / "t-rex-64").is_file() and (d / "_t-rex-64").exists():
            return d.resolve()
    return None


def trex_python() -> Path:
    """The interpreter that has the TRex client (``lbr-trex-client``):
    ``$HPCLB_TREX_PYTHON``, else the repository's ``.venv-trex``."""
    env = os.environ.get("HPCLB_TREX_PYTHON")
    return Path(env) if env else REPO / ".venv-trex" / "bin" / "python"


def client_problem() -> str | None:
    """Why the TRex client cannot run here (None: it can)."""
    py = trex_python()
    if not py.exists():
        return (f"no TRex client interpreter at {py}: python3 -m venv .venv-trex && "
                ".venv-trex/bin/pip install lbr-trex-client (or set HPCLB_TREX_PYTHON)")
    if not DRIVER.is_file():
        return f"no TRex driver at {DRIVER} (perf/trex is not in this tree)"
    return None


def profile_path(name: str) -> Path:
    """A profile of ``perf/trex/profiles`` by name (``udp64``, ``imix``, ``syn``,
    ``latency``) or a path to one of the user's."""
    p = Path(name)
    if p.suffix == ".py" and p.is_file():
        return p.resolve()
    found = PROFILES / f"{name}.py"
    if not found.is_file():
        raise TrexError(f"no TRex profile {name!r} (have "
                        f"{sorted(x.stem for x in PROFILES.glob('*.py') if x.stem[0] != '_')})")
    return found


# ---------------------------------------------------------------- configuration


@dataclass(frozen=True)
class TrexPort:
    """One TRex port: an interface (a name: af_packet vdev; ``dummy``: none) and the
    MACs its frames carry by default."""

    interface: str
    src_mac: str
    dest_mac: str


DUMMY_MAC = "02:00:00:00:00:00"


def render_trex_cfg(ports: Sequence[TrexPort], *, prefix: str,
                    zmq_rpc_port: int = ZMQ_RPC_PORT, zmq_pub_port: int = ZMQ_PUB_PORT,
                    low_end: bool = True, low_end_core: int | None = None,
                    limit_memory: int | None = None) -> str:
    """``trex_cfg.yaml``'s text. TRex wants an even number of ports: a ``dummy`` one is
    added to an odd list. ``prefix``: DPDK's file prefix (one per server on a host)."""
    ports = list(ports)
    if not ports:
        raise ValueError("a TRex configuration needs at least one port")
    if len(ports) % 2:
        ports.append(TrexPort("dummy", DUMMY_MAC, DUMMY_MAC))
    if low_end_core is not None and not low_end:
        raise ValueError("low_end_core is TRex's low_end option")
    template = Template(files("hpclb").joinpath(TEMPLATE).read_text())
    return template.render(ports=ports, prefix=prefix, zmq_rpc_port=zmq_rpc_port,
                           zmq_pub_port=zmq_pub_port, low_end=low_end,
                           low_end_core=low_end_core, limit_memory=limit_memory,
                           version_note="v3.08")


def lab_ports(lab: Lab) -> list[TrexPort]:
    """TRex port 0 on the appliance's cable (``v-lb``), sending as the client to the
    appliance's MAC (module doc); the dummy pairs it."""
    return [TrexPort(lab.peer("lb"), lab.mac("cli"), lab.mac("lb"))]


# ---------------------------------------------------------------- HDR histogram


LATENCY_KEYS = ("min_us", "avg_us", "max_us", "p50_us", "p99_us", "p999_us")


def decode_hdrh(encoded: str | bytes) -> dict[str, float]:
    """min/avg/max and p50/p99/p99.9 (µs, TRex records µs) of an HDR histogram as
    TRex's server encodes it (``hdr_log_encode``: base64 of the compressed V2 form)."""
    from hdrh.histogram import HdrHistogram

    hist = HdrHistogram.decode(encoded)
    if hist.get_total_count() == 0:
        return {}
    return {
        "min_us": float(hist.get_min_value()),
        "avg_us": float(hist.get_mean_value()),
        "max_us": float(hist.get_max_value()),
        "p50_us": float(hist.get_value_at_percentile(50.0)),
        "p99_us": float(hist.get_value_at_percentile(99.0)),
        "p999_us": float(hist.get_value_at_percentile(99.9)),
        "count": float(hist.get_total_count()),
    }


def _number(v: Any) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):  # TRex's StatNotAvailable, as text
        return None


def latency_summary(pg: Mapping[str, Any]) -> dict[str, float] | None:
    """A packet group's latency (TRex's ``stats["latency"][pg_id]``) as Trial.latency:
    from its HDR histogram where the server has one (``--hdrh``), else TRex's own
    min/avg/max only. None when no latency frame came back."""
    lat = pg.get("latency", {})
    out: dict[str, float] = {}
    if lat.get("hdrh"):
        out = decode_hdrh(lat["hdrh"])
    if not out:
        got = {"min_us": _number(lat.get("total_min")), "avg_us": _number(lat.get("average")),
               "max_us": _number(lat.get("total_max"))}
        out = {k: v for k, v in got.items() if v is not None and v > 0}
    if "avg_us" in out and _number(lat.get("average")):
        # TRex's own average is exact; the histogram's is of bucket values.
        out["avg_us"] = float(lat["average"])
    return out or None


# ---------------------------------------------------------------- processes


def _killpg(proc: subprocess.Popen[Any], grace: float) -> None:
    """SIGTERM to the process's group (a session of its own), SIGKILL after ``grace``."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _netns(ns: str | None, argv: Sequence[str]) -> list[str]:
    return ["ip", "netns", "exec", ns, *argv] if ns else list(argv)


class TrexServer:
    """A TRex server (``t-rex-64 -i``) started from ``scripts_dir`` with the
    configuration text ``cfg`` in namespace ``ns``; :meth:`stop` always ends it and
    everything it started (its own session)."""

    def __init__(self, scripts_dir: Path, cfg: str, workdir: Path, *, ns: str | None = None,
                 zmq_rpc_port: int = ZMQ_RPC_PORT, dpdk_prefix: str | None = None,
                 extra_args: Sequence[str] = ()) -> None:
        self.scripts_dir = scripts_dir
        self.ns = ns
        # DPDK's runtime directory of this server (the configuration's ``prefix``),
        # which TRex leaves behind: removed on stop.
        self.runtime_dir = Path("/var/run/dpdk") / dpdk_prefix if dpdk_prefix else None
        self.zmq_rpc_port = zmq_rpc_port
        self.cfg_path = workdir / "trex_cfg.yaml"
        self.cfg_path.write_text(cfg)
        self.log_path = workdir / "trex-server.log"
        self.argv = ["./t-rex-64", "-i", "--cfg", str(self.cfg_path), "--hdrh",
                     "--no-scapy-server", "--iom", "0", "--no-termio", *extra_args]
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def log_tail(self, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""

    def start(self, timeout: float = 90.0) -> None:
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            _netns(self.ns, self.argv), cwd=self.scripts_dir, stdin=subprocess.DEVNULL,
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise TrexError(f"TRex server exited {self.proc.returncode}:\n"
                                f"{self.log_tail()}")
            if self._listening():
                return
            time.sleep(0.5)
        raise TrexError(f"TRex server not listening on {self.zmq_rpc_port} after "
                        f"{timeout:.0f} s:\n{self.log_tail()}")

    def _listening(self) -> bool:
        res = subprocess.run(_netns(self.ns, ["ss", "-Hltn", f"sport = :{self.zmq_rpc_port}"]),
                             capture_output=True, text=True, check=False, timeout=10)
        return bool(res.stdout.strip())

    def stop(self) -> None:
        try:
            if self.proc is not None:
                _killpg(self.proc, grace=10.0)
        finally:
            self.proc = None
            if self.runtime_dir is not None:
                shutil.rmtree(self.runtime_dir, ignore_errors=True)
            if self._log is not None:
                self._log.close()
                self._log = None


class TrexDriver:
    """``perf/trex/driver.py`` in the TRex client's interpreter (in namespace ``ns``
    when the server listens there): one JSON request, one JSON answer."""

    def __init__(self, workdir: Path, *, ns: str | None = None,
                 python: Path | None = None) -> None:
        if (why := client_problem()) is not None and python is None:
            raise TrexError(why)
        self.stderr_path = workdir / "trex-driver.log"
        self._stderr = self.stderr_path.open("wb")
        argv = _netns(ns, [str(python or trex_python()), str(DRIVER)])
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr, start_new_session=True)

    def request(self, req: Mapping[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        proc = self.proc
        if proc.stdin is None or proc.stdout is None or proc.poll() is not None:
            raise TrexError(f"the TRex driver is gone:\n{self._stderr_tail()}")
        proc.stdin.write((json.dumps(req) + "\n").encode())
        proc.stdin.flush()
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                raise TrexError(f"the TRex driver did not answer {req.get('cmd')!r} in "
                                f"{timeout:.0f} s:\n{self._stderr_tail()}")
        line = proc.stdout.readline()
        if not line:
            raise TrexError(f"the TRex driver exited:\n{self._stderr_tail()}")
        answer: dict[str, Any] = json.loads(line)
        if not answer.get("ok"):
            raise TrexError(f"{req.get('cmd')}: {answer.get('error')}\n{answer.get('trace', '')}")
        return answer

    def _stderr_tail(self, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.stderr_path.read_text(errors="replace")[-chars:]
        return ""

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                with contextlib.suppress(TrexError, OSError, ValueError):
                    self.request({"cmd": "quit"}, timeout=20)
                _killpg(self.proc, grace=5.0)
        finally:
            self._stderr.close()


def build_profile(profile: str, tunables: Mapping[str, Any] | None = None,
                  rate_pps: float | None = None, python: Path | None = None) -> dict[str, Any]:
    """Build a profile in the TRex client's interpreter without a server: its streams
    as TRex's JSON (``profile``) and their names (``streams``)."""
    with tempfile.TemporaryDirectory(prefix="hpclb-trex-") as tmp:
        driver = TrexDriver(Path(tmp), python=python)
        try:
            return driver.request({"cmd": "build", "profile": str(profile_path(profile)),
                                   "tunables": dict(tunables or {}), "rate_pps": rate_pps})
        finally:
            driver.close()


# ---------------------------------------------------------------- lab wiring


class LabPlug:
    """Takes ``v-lb`` off the bridge for TRex and puts it back (module doc)."""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self.peer = lab.peer("lb")
        self.plugged = False

    def plug(self) -> None:
        self.lab.attach_xdp_pass(self.peer, install.find("pass.bpf.o"))
        self.lab.exec("br", ["ip", "link", "set", "dev", self.peer, "nomaster"])
        self.plugged = True

    def unplug(self) -> None:
        if self.plugged:
            self.lab.exec("br", ["ip", "link", "set", "dev", self.peer, "master", BRIDGE],
                          check=False)
            self.plugged = False


# ---------------------------------------------------------------- generator


class TrexGenerator:
    """TRex driving the lab (or a remote setup) for the bench (module doc).

    Local (``server=None``): renders the configuration for ``lab``, takes ``v-lb`` off
    the bridge, starts the server from ``trex_dir`` in the bridge namespace. Remote
    (``server=HOST``): connects to a running server; ``dst_mac`` (the device under
    test's) and the ports (``tx_ports`` send, ``rx_ports`` count what comes back) are
    the user's. ``profile``: a name of ``perf/trex/profiles`` (``udp64``, ``imix``,
    ``syn``) or a path; ``tunables`` go over the ones derived here.
    ``line_rate_pps``: the top the generator can offer here, configured or
    measured by :meth:`calibrate`. Use as a context manager or call :meth:`close`.
    """

    name = "trex"

    def __init__(self, lab: Lab | None, workdir: Path, *, trex_dir: str | os.PathLike[str]
                 | None = None, server: str | None = None, profile: str = "udp64",
                 flows: int = 50000, vip: str = LAB_VIP, vip_port: int = LAB_PORT,
                 latency: bool = True, lat_pps: float = LAT_PPS, pg_id: int = PG_ID,
                 dst_mac: str | None = None, tx_ports: Sequence[int] = (0,),
                 rx_ports: Sequence[int] = (0,), tunables: Mapping[str, Any] | None = None,
                 line_rate_pps: float | None = None, decoupled: bool = True,
                 settle_s: float = SETTLE_S, start_timeout: float = 90.0) -> None:
        if server is None and lab is None:
            raise ValueError("a local TRex server needs the lab (or give server=HOST)")
        if ":" in vip:
            raise ValueError("the hpclb TRex profiles send IPv4 only")
        self.lab = lab
        self.workdir = workdir
        self.remote = server
        self.profile = str(profile_path(profile))
        self.profile_name = Path(self.profile).stem
        self.flows = flows
        self.vip = vip
        self.latency = latency
        self.lat_pps = lat_pps if latency else 0.0
        self.pg_id = pg_id
        self.tx_ports = list(tx_ports)
        self.rx_ports = list(rx_ports)
        self.settle_s = settle_s
        self.line_rate_pps = float(line_rate_pps or 0.0)
        self._configured_line_rate = line_rate_pps is not None
        self.tunables: dict[str, Any] = {
            "dst_ip": vip, "vip_port": vip_port, "flows": flows, "src_ip": SRC_IP,
            "src_ips": SRC_IPS, "lat_pps": self.lat_pps, "pg_id": pg_id,
        }
        if dst_mac is not None:
            self.tunables["dst_mac"] = dst_mac
        if lab is not None and server is None:
            self.tunables.setdefault("dst_mac", lab.mac("lb"))
            self.tunables["src_mac"] = lab.mac("cli")
        self.tunables.update(tunables or {})
        self.server: TrexServer | None = None
        self.plug: LabPlug | None = None
        self.driver: TrexDriver | None = None
        self.decoupler: Any = None
        self.decoupled_refused: str | None = None
        self.server_info: dict[str, Any] = {}
        self.scripts_dir: Path | None = None
        try:
            self._start(trex_dir, decoupled, start_timeout)
        except BaseException:
            self.close()
            raise

    def _start(self, trex_dir: str | os.PathLike[str] | None, decoupled: bool,
               start_timeout: float) -> None:
        ns: str | None = None
        if self.remote is None:
            assert self.lab is not None
            scripts = find_trex_dir(trex_dir)
            if scripts is None:
                raise TrexError(NO_TREX if trex_dir is None
                                else f"no built TRex under {trex_dir} (scripts/_t-rex-64)")
            self.scripts_dir = scripts
            if decoupled:
                from hpclb.lab.subjects import NapiDecoupler  # the bench's, shared

                d = NapiDecoupler(self.lab)
                if (why := d.problem()) is None:
                    d.enable()
                    self.decoupler = d
                else:
                    self.decoupled_refused = why
            # One DPDK file prefix per lab: servers of two labs never share one.
            prefix = f"hpclb-trex-{self.lab.prefix}"
            cfg = render_trex_cfg(lab_ports(self.lab), prefix=prefix,
                                  low_end_core=GENERATOR_CPU if self.decoupler else None)
            self.plug = LabPlug(self.lab)
            self.plug.plug()
            ns = self.lab.bridge_ns
            self.server = TrexServer(scripts, cfg, self.workdir, ns=ns, dpdk_prefix=prefix)
            self.server.start(timeout=start_timeout)
        self.driver = TrexDriver(self.workdir, ns=ns)
        ports = sorted(set(self.tx_ports) | set(self.rx_ports))
        # The server's RPC socket can answer before its ports are up: retry a while.
        deadline = time.monotonic() + 30
        while True:
            try:
                self.server_info = self.driver.request(
                    {"cmd": "connect", "server": self.remote or "127.0.0.1",
                     "sync_port": ZMQ_RPC_PORT, "async_port": ZMQ_PUB_PORT, "ports": ports},
                    timeout=60)
                break
            except TrexError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(2)
        self.driver.request({"cmd": "load", "profile": self.profile,
                             "tunables": self.tunables, "tx_ports": self.tx_ports})

    def __enter__(self) -> TrexGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def aim(self, vip: str) -> None:
        """The VIP the next trials are sent to (the subject's); IPv4 only."""
        if ":" in vip:
            raise ValueError("the hpclb TRex profiles send IPv4 only")
        if vip != self.vip:
            self.vip = vip
            self.tunables["dst_ip"] = vip
            assert self.driver is not None
            self.driver.request({"cmd": "load", "profile": self.profile,
                                 "tunables": self.tunables, "tx_ports": self.tx_ports})

    def calibrate(self, seconds: float) -> float:
        """The generator's top here: a full-speed trial (against whatever forwards
        now); kept as ``line_rate_pps`` unless one was configured."""
        t = self.trial(None, seconds)
        if not self._configured_line_rate:
            self.line_rate_pps = max(self.line_rate_pps, t.offered_pps)
        return self.line_rate_pps

    def trial(self, rate_pps: float | None, seconds: float) -> Trial:
        if self.driver is None:
            raise TrexError("the TRex generator is closed")
        unpinned = self.decoupler.pin() if self.decoupler is not None else None
        app_before = self._appliance_counters()
        asked = FULL_SPEED_PPS if rate_pps is None else float(rate_pps)
        ans = self.driver.request({"cmd": "trial", "rate_pps": asked, "seconds": seconds,
                                   "settle_s": self.settle_s}, timeout=seconds + 120)
        ports = ans["ports"]
        offered = sum(int(ports[str(p)].get("opackets", 0)) for p in self.tx_ports)
        forwarded = sum(int(ports[str(p)].get("ipackets", 0)) for p in self.rx_ports)
        extra: dict[str, Any] = {
            "profile": self.profile_name,
            "trex_rate_asked_pps": asked,
            "wall_s": round(float(ans.get("wall_s", seconds)), 3),
            "stopped_late": ans.get("stopped_late"),
            "ports": {p: {k: ports[p].get(k) for k in ("opackets", "ipackets", "oerrors",
                                                        "ierrors", "tx_pps", "rx_pps")}
                      for p in ports},
        }
        pg = ans.get("latency", {}).get(str(self.pg_id))
        latency = latency_summary(pg) if (self.latency and pg) else None
        if pg:
            extra["latency_errors"] = pg.get("err_cntrs", {})
        fs = ans.get("flow_stats", {}).get(str(self.pg_id))
        if fs:
            extra["latency_frames"] = {"tx": fs.get("tx_pkts", {}).get("total"),
                                       "rx": fs.get("rx_pkts", {}).get("total")}
        if app_before is not None:
            after = self._appliance_counters() or {}
            extra["appliance_xdp"] = {k: v - app_before.get(k, 0) for k, v in after.items()}
        if self.decoupler is not None:
            self.decoupler.rest()
            extra["decoupled"] = unpinned is None
            if unpinned is not None:
                extra["coupled_because"] = unpinned
        if rate_pps is None and not self._configured_line_rate:
            self.line_rate_pps = max(self.line_rate_pps, offered / seconds)
        return Trial(offered_pps=offered / seconds, forwarded_pps=forwarded / seconds,
                     offered=offered, forwarded=forwarded, seconds=seconds,
                     rate_pps=rate_pps, latency=latency, extra=extra)

    def _appliance_counters(self) -> dict[str, int] | None:
        """The appliance eth0's XDP counters (local lab only): where a loss was."""
        if self.lab is None or self.remote is not None:
            return None
        from hpclb.lab.subjects import xdp_counters

        with contextlib.suppress(LabError, OSError, subprocess.SubprocessError):
            return xdp_counters(self.lab, "lb", ETH)
        return None

    def conditions(self) -> dict[str, Any]:
        version = self.server_info.get("server_version", {})
        cond: dict[str, Any] = {
            "generator": "TRex stateless (STL), lbr-trex-client in its own process",
            "server": self.remote or "local, started for the lab",
            "server_version": version.get("version") if isinstance(version, dict) else version,
            "profile": self.profile_name,
            "tunables": dict(self.tunables),
            "frame_bytes": 64 if self.profile_name in ("udp64", "syn") else "imix",
            "flows": self.flows,
            "latency_stream": ({"pps": self.lat_pps, "pg_id": self.pg_id,
                                "histogram": "HDR, µs, 3 significant digits (--hdrh)"}
                               if self.latency else None),
            "line_rate_pps": self.line_rate_pps,
            "line_rate": "configured" if self._configured_line_rate else "measured",
            "offered_at": f"TRex ports {self.tx_ports} opackets (latency stream included)",
            "forwarded_at": f"TRex ports {self.rx_ports} ipackets",
            "settle_s": self.settle_s,
        }
        if self.remote is None:
            cond |= {
                "wiring": ("TRex port 0 = af_packet on v-lb (the appliance veth's peer, "
                           "off the bridge, XDP_PASS); port 1 dummy; low_end"),
                "trex_dir": str(self.scripts_dir),
                "decoupled": self.decoupler is not None,
                "mode": (f"TRex on CPU {GENERATOR_CPU} (low_end_core), the appliance's "
                         "NAPI threaded and pinned to CPU 1" if self.decoupler is not None
                         else "TRex and the path share the CPUs as the kernel schedules"),
            }
            if self.decoupled_refused:
                cond["decoupled_refused"] = self.decoupled_refused
        return cond

    def close(self) -> None:
        """Stop the client, the server and undo the wiring; every step runs even if
        one before it failed."""
        steps = [
            (self.driver, lambda d: d.close()),
            (self.server, lambda s: s.stop()),
            (self.plug, lambda p: p.unplug()),
            (self.decoupler, lambda d: d.disable()),
        ]
        self.driver = self.server = self.plug = None
        self.decoupler = None
        errors: list[BaseException] = []
        for obj, step in steps:
            if obj is None:
                continue
            try:
                step(obj)
            except Exception as err:  # keep going: the others must still run
                errors.append(err)
        if errors:
            raise TrexError(f"closing TRex: {errors}")


def available(trex_dir: str | os.PathLike[str] | None = None) -> str | None:
    """Why a local TRex cannot run here (None: it can): no built tree, no client."""
    if find_trex_dir(trex_dir) is None:
        return NO_TREX if trex_dir is None and not os.environ.get("HPCLB_TREX_DIR") else (
            f"no built TRex under {trex_dir or os.environ.get('HPCLB_TREX_DIR')} "
            "(scripts/_t-rex-64): perf/trex/build_trex.sh")
    if shutil.which("ip") is None:
        return "no iproute2 (ip) to enter the lab's namespaces"
    return client_problem()
