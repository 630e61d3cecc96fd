"""The appliance's commands of `hpclb` (check, run, stats, status); the
lab's join them in :mod:`hpclb.main`."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import resource
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hpclb.config import ConfigError, load_config
from hpclb.faces.client import API_ENV
from hpclb.faces.commands import add_api_commands

EXIT_START = 1
EXIT_CONFIG = 2
# The control plane is a server (telemetry connections, probe sockets): far
# more files than the 1,024 a login shell or a bare unit gives it.
WANT_NOFILE = 65536
DATAPLANE_SOCKET = "ipc:///run/hpclb/dataplane.sock"

log = logging.getLogger(__name__)


def _cmd_check(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    for warning in cfg.empty_pool_warnings():
        print(f"{args.config}: warning: {warning}", file=sys.stderr)
    if not args.schema_only:
        from hpclb.controller.preflight import check_host

        check_host(cfg, str(args.config))
    backends = sum(len(p.backends) for p in cfg.pools.values())
    what = "schema ok" if args.schema_only else "ok"
    print(f"{args.config}: {what} ({len(cfg.vips)} VIPs, {len(cfg.pools)} pools, "
          f"{backends} backends)")
    return 0


def raise_nofile_limit(want: int = WANT_NOFILE) -> tuple[int, int]:
    """Raise the open-file limit towards ``want`` (the hard limit too, where
    the process may); returns the (soft, hard) limits in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
            return want, want
        except (ValueError, OSError):  # no CAP_SYS_RESOURCE: up to the hard limit
            pass
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft, hard


def _private_run_dir(path: Path) -> None:
    """The run folder and what is in it: not for every local user to read
    (status, logs, pid files; the data plane's socket is 0600 on its own)."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o750)
    for f in path.iterdir():
        if f.is_file() and not f.is_symlink():
            f.chmod(f.stat().st_mode & 0o640)


def _cmd_run(args: argparse.Namespace) -> int:
    from hpclb.controller import Controller, StartError
    from hpclb.faces.api.server import ApiFace
    from hpclb.faces.metrics import MetricsFace
    from hpclb.host.install import MissingBuildOutput

    # Files and folders this process creates: group-readable at most.
    os.umask(0o027)
    soft, hard = raise_nofile_limit()
    if soft < WANT_NOFILE:
        log.warning("open files limited to %d (hard limit %d): set LimitNOFILE=%d",
                    soft, hard, WANT_NOFILE)
    api = ApiFace()
    try:
        controller = Controller(args.config, args.state_dir, args.run_dir,
                                args.keep_dataplane, faces=[MetricsFace(), api])
    except MissingBuildOutput as err:  # the data plane's binary, before anything started
        print(f"hpclb run: cannot start: {err}", file=sys.stderr)
        return EXIT_START
    api.attach(controller.operations)
    _private_run_dir(controller.paths.run_dir)
    def request(event: threading.Event) -> None:
        event.set()
        controller.wake.set()

    def hand_over() -> None:
        # An upgrade: this control plane ends and leaves the data plane
        # forwarding (and BGP announcing) for its successor, which adopts it
        # (`systemctl kill --kill-whom=main -s USR2 hpclb`; the data planes
        # ignore SIGUSR2 should it reach them; systemd's Restart= starts the
        # new release). Flows are never interrupted.
        controller.keep_dataplane = True
        request(controller.stop_requested)

    signal.signal(signal.SIGHUP, lambda *_: request(controller.reload_requested))
    signal.signal(signal.SIGUSR2, lambda *_: hand_over())
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: request(controller.stop_requested))
    try:
        try:
            controller.start()
        except StartError as err:
            print(f"hpclb run: cannot start: {err}", file=sys.stderr)
            return EXIT_START
        # What start() built (configuration, 10,000 probe targets...) lives as
        # long as the process: out of the collector's way, so a full collection
        # does not pause the probes' loop for 50-180 ms (perf/probe_scale.py).
        gc.collect()
        gc.freeze()
        controller.run_forever()
    finally:
        controller.shutdown()
    return 0


def _rows(rows: Sequence[Sequence[object]], header: Sequence[str] | None = None,
          align: str = "lrrr") -> list[str]:
    """Indented rows of aligned columns, column i (l)eft- or (r)ight-aligned
    as ``align[i]`` says."""
    table = [list(map(str, r)) for r in ([header] if header else []) + list(rows)]
    if not table:
        return []
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    return ["  " + "  ".join(cell.ljust(widths[i]) if align[i] == "l" else cell.rjust(widths[i])
                             for i, cell in enumerate(r)).rstrip()
            for r in table]


def render_stats(stats: dict[str, Any]) -> str:
    """The data plane's stats reply as tables: packet counters, per VIP and per
    backend, the NIC counters (DPDK) and, from a data plane with NAT mode, the
    connection table (`hpclb stats --json` prints the reply itself)."""
    counters: dict[str, int] = stats.get("counters", {})
    out = ["counters", *_rows(list(counters.items()))]
    for kind in ("vips", "backends"):
        rows = stats.get(kind) or []
        if rows:
            out += [kind, *_rows([r[:3] for r in rows], (kind[:-1] + " id", "packets", "bytes"))]
    for index, port in enumerate(stats.get("ports") or []):
        out += [f"port {index}", *_rows(list(port.items()))]
    conns = stats.get("conns")
    if conns is not None:
        capacity, entries = int(conns.get("capacity", 0)), int(conns.get("entries", 0))
        fill = f"{100 * entries / capacity:.1f} % full" if capacity else "no table"
        by_state: dict[str, int] = conns.get("by_state", {})
        out += ["connection table (NAT)", *_rows([
            ("capacity", capacity, "entries, two per connection"),
            ("entries", entries, fill),
            ("connections", sum(by_state.values()), ""),
            *((f"  {name}", n, "") for name, n in by_state.items()),
            ("evictions", counters.get("conn_evict", 0), "embryonic connections evicted"),
            ("SNAT ports in use", conns.get("snat_ports_in_use", 0), ""),
            ("expired", conns.get("expired", 0), "connections ended by idle timeouts"),
        ], align="lrl")]
    return "\n".join(out)


def _cmd_stats(args: argparse.Namespace) -> int:
    from hpclb.dataplane.client import DataplaneClient

    client = DataplaneClient(args.socket, timeout_s=2.0)
    try:
        stats = client.stats()
    finally:
        client.close()
    if args.json:
        print(json.dumps(stats, indent=1, default=lambda b: b.hex()))
    else:
        print(render_stats(stats))
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    path = (args.run_dir or Path("/run/hpclb")) / f"{cfg.appliance.name}.status.json"
    try:
        print(path.read_text().rstrip())
    except FileNotFoundError:
        print(f"{path}: no status: is `hpclb run -c {args.config}` running?", file=sys.stderr)
        return 1
    return 0


#: Where provisioning (appliance/provision.sh) puts the configuration.
INSTALLED_CONFIG = Path("/etc/hpclb/hpclb.yaml")


def _installed_config_without_api(args: argparse.Namespace) -> Path | None:
    """On a provisioned appliance whose configuration enables no REST API, a
    bare `hpclb status` has no API to ask: it reads the status file of
    /etc/hpclb/hpclb.yaml instead (readable by root and the `hpclb` group).
    None when an API was asked for (--api, $HPCLB_API) or is configured."""
    if getattr(args, "api", None) or os.environ.get(API_ENV):
        return None
    try:
        config = load_config(INSTALLED_CONFIG)
    except (OSError, ConfigError):
        return None  # not an appliance, or unreadable: the API form says what is wrong
    return INSTALLED_CONFIG if config.appliance.api is None else None


def _local_or_api(local: Callable[[argparse.Namespace], int], parser: argparse.ArgumentParser,
                  option: str) -> Callable[[argparse.Namespace], int]:
    """The local form of a command when ``option`` is given, else its API form."""
    over_api: Callable[[argparse.Namespace], int] = parser.get_default("func")

    def either(args: argparse.Namespace) -> int:
        if getattr(args, option) is None and option == "config":
            setattr(args, option, _installed_config_without_api(args))
        if getattr(args, option) is None:
            return over_api(args)
        if getattr(args, "watch", False):
            print("hpclb stats: --watch is over the API, not with --socket", file=sys.stderr)
            return EXIT_CONFIG  # usage
        return local(args)
    return either


#: Adds subcommands to the `hpclb` command (the lab's, from hpclb.main).
AddCommands = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]


def build_parser(extra_commands: Sequence[AddCommands] = ()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpclb", description="hpclb, a load-balancing appliance for HPC clusters: run it, "
        "check its configuration, read its status and counters.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("check", help="validate a configuration file and what it needs of "
                       "this host (key files, local addresses)")
    p.add_argument("-c", "--config", type=Path, required=True)
    p.add_argument("--schema-only", action="store_true",
                   help="validate the file only (on another machine than the appliance)")
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser("run", help="run the appliance (control plane + data plane)")
    p.add_argument("-c", "--config", type=Path, required=True)
    p.add_argument("--state-dir", type=Path, help="checkpoints (default /var/lib/hpclb/NAME)")
    p.add_argument("--run-dir", type=Path, help="pid and log files (default /run/hpclb)")
    p.add_argument(
        "--keep-dataplane", action="store_true",
        help="leave the data plane forwarding when this process stops",
    )
    p.set_defaults(func=_cmd_run)

    # The client commands over the REST API (hpclb.faces.commands). `stats`
    # and `status` keep their local forms for the appliance itself: an explicit
    # --socket asks the data plane directly, -c reads the status file; without
    # them both ask the API.
    api = add_api_commands(sub)
    p = api["stats"]
    p.add_argument("--socket", metavar="SOCKET",
                   help="ask the data plane at this control socket directly (on the "
                   f"appliance: {DATAPLANE_SOCKET}): its counters and NAT connection "
                   "table; --json: its reply")
    p.set_defaults(func=_local_or_api(_cmd_stats, p, "socket"))

    p = api["status"]
    p.add_argument("-c", "--config", type=Path,
                   help="read the status file of the appliance run with this configuration "
                   "(on the appliance: health, weights, telemetry and probe counters, "
                   "rewritten every second) instead of asking the API")
    p.add_argument("--run-dir", type=Path, help="with -c: as given to hpclb run "
                   "(default /run/hpclb)")
    p.set_defaults(func=_local_or_api(_cmd_status, p, "config"))

    for add in extra_commands:
        add(sub)
    return parser


def main(argv: list[str] | None = None, extra_commands: Sequence[AddCommands] = ()) -> int:
    args = build_parser(extra_commands).parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        return int(args.func(args))
    except ConfigError as err:
        print(err, file=sys.stderr)
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
