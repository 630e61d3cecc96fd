"""``hpclb-agent``: the node agent's command line.

    hpclb-agent keygen /etc/hpclb/curve --name node01     # node01.key, node01.key_secret
    hpclb-agent run --connect tcp://gateway:5557 [--connect tcp://lb2:5557 ...] \\
        --node-id node01 \\
        --server-key /etc/hpclb/curve/server.key --key /etc/hpclb/curve/node01.key_secret \\
        [--cgroup /slurm/job_42] [--base-interval 5] [--min-interval 0.1] [--max-interval 60]
    hpclb-agent sample [--node-id NAME] [--cgroup PATH] [--require-gpu]   # one message, JSON

``run`` publishes one telemetry message per heartbeat interval, ``base x (1 +
load^2)`` within the bounds, until SIGTERM or SIGINT, then exits 0. Each round it
first measures the round trip to every endpoint's host (``ping -c 4``'s average,
hpclb.agent.echo; ``extra["fleet_rtt_ms"]``, the mean over the hosts), unless
``--no-echo``. ``--connect`` may be repeated (a fleet of appliances): each message
goes to every endpoint. It takes an IPv4 address, a name, or an IPv6 address in
brackets (``tcp://[fd00::1]:5557``). Keys are pyzmq certificate files: the control
plane's allow-list holds ``<node id>.key`` (the public half), the node keeps
``<node id>.key_secret``.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

import zmq
import zmq.auth

from hpclb.agent import Collector, IntervalPolicy
from hpclb.agent.cgroup import CgroupError, CgroupMeter, find_cgroup
from hpclb.agent.echo import EchoMeter
from hpclb.agent.gpu import NvmlGpus
from hpclb.agent.procstat import ProcError, read_memory
from hpclb.agent.publisher import Publisher
from hpclb.agent.sources import available_sources
from hpclb.telemetry.message import FLEET_RTT, NODE_ID_PATTERN, TelemetryError, encode

log = logging.getLogger("hpclb.agent")

#: The first message's CPU window, like ``mpstat 1``: long enough to mean
#: something, short enough that a starting agent shows up at once.
FIRST_WINDOW_S = 1.0
#: An echo round takes at most this share of the last interval, and at most
#: ECHO_BUDGET_MAX_S: a host that does not answer costs that much per heartbeat.
ECHO_BUDGET_SHARE = 0.25
ECHO_BUDGET_MAX_S = 1.0


class AgentError(Exception):
    """A setup problem the user can fix (bad key file, unknown cgroup)."""


def _node_id(text: str) -> str:
    if not re.fullmatch(NODE_ID_PATTERN, text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a node id (letters, digits, '.', '_', '-', at most 63, "
            "starting with a letter or digit)")
    return text


_ENDPOINT = re.compile(r"(?:tcp://)?(\[[^\]]*\]|[^:\[\]/\s]+):(\d{1,5})")


def endpoint(text: str) -> str:
    """The control plane's telemetry endpoint, ``tcp://HOST:PORT`` (``tcp://`` may
    be left out): HOST an IPv4 address, a name, or an IPv6 address in brackets."""
    m = _ENDPOINT.fullmatch(text)
    if m is None:
        hint = (" (an IPv6 address goes in brackets: tcp://[fd00::1]:5557)"
                if text.count(":") > 2 else "")
        raise argparse.ArgumentTypeError(f"{text!r} is not tcp://HOST:PORT{hint}")
    host, port = m.group(1), int(m.group(2))
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: port {port} is not 1-65535")
    if host.startswith("["):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: {host} is not an IPv6 address in brackets") from None
    return f"tcp://{host}:{port}"


def endpoint_host(where: str) -> str:
    """The host of an ``endpoint()`` (an IPv6 address without its brackets)."""
    host = where.removeprefix("tcp://").rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") else host


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a positive number of seconds")
    return value


def load_keys(path: Path, need_secret: bool) -> tuple[bytes, bytes | None]:
    """(public, secret) of a pyzmq certificate file; AgentError naming the file."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as err:
        raise AgentError(f"{path}: not a readable CURVE certificate ({err})") from None
    if need_secret and not secret:
        raise AgentError(f"{path}: has no secret key (give the .key_secret file)")
    return public, secret


def build_collector(node_id: str, cgroup: str | None, interval: IntervalPolicy,
                    gpus: bool = True) -> Collector:
    """The collector with every reader this node has."""
    meter = None
    if cgroup is not None:
        try:
            cg = find_cgroup(cgroup)
            meter = CgroupMeter(cg, host_mem_total=read_memory()[1])
        except (CgroupError, ProcError) as err:
            raise AgentError(str(err)) from None
        log.info("cgroup %s: v%d", cgroup, cg.version)
    return Collector(node_id=node_id, interval=interval, cgroup=meter,
                     gpus=NvmlGpus.open() if gpus else None, sources=available_sources())


def run(args: argparse.Namespace) -> int:
    try:
        interval = IntervalPolicy(args.base_interval, args.min_interval, args.max_interval)
    except ValueError as err:
        raise AgentError(str(err)) from None
    server_public, _ = load_keys(args.server_key, need_secret=False)
    public, secret = load_keys(args.key, need_secret=True)
    assert secret is not None
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("%s: stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    collector = build_collector(args.node_id, args.cgroup, interval)
    publishers: list[Publisher] = []
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()  # one I/O thread for them all
    try:
        for where in args.connect:
            publishers.append(Publisher(where, server_public, public, secret, context=context))
    except zmq.ZMQError as err:
        for p in publishers:
            p.close()
        context.term()
        collector.close()
        raise AgentError(f"--connect {args.connect[len(publishers)]}: {err}") from None
    meter = None if args.no_echo else EchoMeter([endpoint_host(e) for e in args.connect])
    log.info("node %s publishing to %s every %.3g-%.3g s", args.node_id,
             ", ".join(args.connect), interval.lo, interval.hi)
    dropping = [False] * len(publishers)
    try:
        stop.wait(min(FIRST_WINDOW_S, interval.base))
        last = interval.base  # the interval the previous message announced
        while not stop.is_set():
            started = time.monotonic()
            wait = interval.base
            try:
                extra: dict[str, float] = {}
                if meter is not None:
                    # Bounded well under the interval: the heartbeat comes first.
                    rtt = meter.measure(min(ECHO_BUDGET_MAX_S, ECHO_BUDGET_SHARE * last))
                    if rtt is not None:
                        extra[FLEET_RTT] = rtt
                msg = collector.collect(extra)
                wait = last = msg.interval_s
                payload = encode(msg)
            except (ProcError, CgroupError, TelemetryError) as err:
                # Keep trying: if it persists, the missing heartbeats tell the
                # control plane, and this line tells the operator why.
                log.error("no telemetry this round: %s", err)
            except Exception:  # a reader bug must not end the heartbeat for good
                log.exception("no telemetry this round")
            else:
                # Each send is non-blocking: an endpoint that is down never
                # delays the others (its messages are dropped and counted).
                for i, publisher in enumerate(publishers):
                    delivered = publisher.send(payload)
                    if not delivered and not dropping[i]:
                        log.warning("control plane %s not reachable: dropping telemetry "
                                    "until it is", publisher.endpoint)
                    elif delivered and dropping[i]:
                        log.info("delivering telemetry to %s again (%d dropped in all)",
                                 publisher.endpoint, publisher.dropped)
                    dropping[i] = not delivered
            stop.wait(max(wait - (time.monotonic() - started), 0.0))
    finally:
        for publisher in publishers:
            publisher.close()
        context.term()
        collector.close()
    log.info("stopped: %s", "; ".join(f"{p.endpoint}: {p.sent} sent, {p.dropped} dropped"
                                     for p in publishers))
    return 0


def keygen(args: argparse.Namespace) -> int:
    directory: Path = args.dir
    public, secret = directory / f"{args.name}.key", directory / f"{args.name}.key_secret"
    existing = [p for p in (public, secret) if p.exists()]
    if existing and not args.force:
        raise AgentError(f"{existing[0]} exists (use --force to replace the keypair)")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    # The secret file must never exist world-readable, not even for a moment.
    old = os.umask(0o077)
    try:
        for p in existing:
            p.unlink()
        zmq.auth.create_certificates(directory, args.name, metadata={"node-id": args.name})
    finally:
        os.umask(old)
    public.chmod(0o644)  # the public half is meant to be copied around
    print(f"public key: {public}  (copy to the control plane's allow-list directory)")
    print(f"secret key: {secret}  (stays here; hpclb-agent run --key {secret})")
    return 0


def sample(args: argparse.Namespace) -> int:
    """One message after a CPU window, printed as JSON (NaN as null)."""
    collector = build_collector(args.node_id, args.cgroup,
                                IntervalPolicy(args.window, args.window, max(args.window, 60)))
    try:
        time.sleep(args.window)
        msg = collector.collect()
    finally:
        collector.close()
    print(msg.model_dump_json(indent=2))
    if args.require_gpu and not msg.gpus:
        print("hpclb-agent: NVML found no GPU", file=sys.stderr)
        return 1
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpclb-agent", description="hpclb node agent")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"])
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="publish telemetry to the control plane")
    r.add_argument("--connect", required=True, type=endpoint, action="append",
                   help="the control plane's telemetry endpoint, e.g. tcp://10.0.0.1:5557 "
                   "or tcp://[fd00::1]:5557; repeated for a fleet: every message goes to "
                   "every endpoint (one --server-key: a fleet shares its CURVE server pair)")
    r.add_argument("--node-id", required=True, type=_node_id,
                   help="this node's id; must match the allow-list file <id>.key")
    r.add_argument("--server-key", required=True, type=Path,
                   help="the control plane's public certificate (server.key)")
    r.add_argument("--key", required=True, type=Path,
                   help="this agent's secret certificate (<id>.key_secret)")
    r.add_argument("--cgroup", help="report this cgroup's CPU and memory as the node's "
                   "(a cgroup directory or a path as /proc/PID/cgroup shows it)")
    r.add_argument("--base-interval", type=_positive, default=5.0)
    r.add_argument("--min-interval", type=_positive, default=0.1)
    r.add_argument("--max-interval", type=_positive, default=60.0)
    r.add_argument("--no-echo", action="store_true",
                   help="do not measure the round trip to the endpoints' hosts "
                   "(extra fleet_rtt_ms, the network term of a fleet's weights)")
    r.set_defaults(func=run)

    k = sub.add_parser("keygen", help="write a CURVE keypair: NAME.key and NAME.key_secret")
    k.add_argument("dir", type=Path)
    k.add_argument("--name", type=_node_id, default=None,
                   help="file name, the node id (default: the short host name)")
    k.add_argument("--force", action="store_true", help="replace an existing keypair")
    k.set_defaults(func=keygen)

    s = sub.add_parser("sample", help="print one telemetry message as JSON")
    s.add_argument("--node-id", type=_node_id, default=None)
    s.add_argument("--cgroup")
    s.add_argument("--window", type=_positive, default=1.0, help="CPU sampling window, s")
    s.add_argument("--require-gpu", action="store_true",
                   help="exit 1 if NVML reports no GPU")
    s.set_defaults(func=sample)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    if getattr(args, "name", "") is None or getattr(args, "node_id", "") is None:
        host = socket.gethostname().split(".")[0]
        try:
            default = _node_id(host)
        except argparse.ArgumentTypeError as err:
            print(f"hpclb-agent: {err}: give the name explicitly", file=sys.stderr)
            return 2
        if getattr(args, "name", "") is None:
            args.name = default
        if getattr(args, "node_id", "") is None:
            args.node_id = default
    try:
        return int(args.func(args))
    except AgentError as err:
        print(f"hpclb-agent: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
