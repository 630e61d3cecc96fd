"""`hpclb`'s client commands: the operator's view and changes over the REST API.

``hpclb status``, ``vip|pool|backend list|show|set|delete``, ``drain``,
``undrain``, ``down``, ``up``, ``weight``, ``stats [--watch]``, ``diagnose`` and
``config export`` each make a few requests to the API of a running appliance
(:mod:`hpclb.faces.client`) and print readable tables (rich) or, with
``--json``, the API's own JSON for scripts.

Exit status: 0 done, 1 the API refused (its message and problems on stderr),
2 usage (bad arguments, an unreadable token file), 3 the API cannot be reached.

The renderers (``render_*``, ``*_table``: :mod:`hpclb.faces.render`) are pure
functions of the API's JSON returning rich renderables, tested without a server.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import yaml
from rich.console import Console, RenderableType
from rich.live import Live
from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from hpclb.faces.client import (
    API_ENV,
    DEFAULT_API,
    DEFAULT_TIMEOUT_S,
    TOKEN_ENV,
    ApiClient,
    ApiError,
    ApiUnreachable,
    TokenFileError,
    resolve_token,
    resolve_url,
)
from hpclb.faces.render import (
    backends_table,
    duration_text,
    findings_table,
    last_sample,
    pools_table,
    render_backend,
    render_pool,
    render_stats,
    render_status,
    render_vip,
    vips_table,
)

EXIT_OK = 0
EXIT_API = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3

Json = Any
SubParsers = "argparse._SubParsersAction[argparse.ArgumentParser]"
Action = Callable[[ApiClient, Console, argparse.Namespace], int]


class UsageError(Exception):
    """Arguments the command cannot use (exit 2)."""


def error_lines(err: ApiError, url: str) -> list[str]:
    """What stderr says of a refusal: the API's message, its problems, and for
    the kinds an operator can fix from here, what to do."""
    lines = [f"hpclb: {err.message} ({err.kind}, HTTP {err.status})"]
    lines += [f"  {p}" for p in err.problems]
    hint = {
        "unauthorized": f"give a token: --token-file FILE or ${TOKEN_ENV}",
        "forbidden": "this token may only read: use a write token",
        "precondition_failed": "the configuration changed since this command read it: "
                               "run it again",
        "unavailable": "nothing was applied: run it again when the appliance is less busy",
    }.get(err.kind)
    if err.kind.startswith("http_"):
        hint = f"is {url} the hpclb API (appliance.api.listen)?"
    if hint:
        lines.append(f"  ({hint})")
    return lines


def unreachable_lines(err: ApiUnreachable) -> list[str]:
    return [f"hpclb: {err}",
            f"  check that `hpclb run` is running with appliance.api set, that --api or "
            f"${API_ENV} names its appliance.api.listen address (default {DEFAULT_API}), and "
            "that this host may reach it"]


# --- arguments -------------------------------------------------------------------------


def _scalar(text: str) -> Any:
    """A `key=value` value as a YAML 1.2 scalar (81 -> int, true -> bool,
    10:20:30:40:50:60 stays a string); a flow list or mapping is allowed too."""
    if text == "":
        return ""
    try:
        return YAML(typ="safe", pure=True).load(text)
    except YAMLError:
        return text


def parse_assignments(pairs: Sequence[str]) -> list[tuple[list[str], Any]]:
    """`a.b=value` pairs as (path, value); UsageError naming a bad one."""
    out = []
    for pair in pairs:
        key, eq, value = pair.partition("=")
        path = key.split(".")
        if not eq or not all(path):
            raise UsageError(f"{pair!r}: give fields as key=value (a.b=value for a nested one)")
        out.append((path, _scalar(value)))
    return out


def apply_assignments(body: dict[str, Any], assignments: Sequence[tuple[list[str], Any]],
                      ) -> dict[str, Any]:
    """``body`` with each assignment made; a value ``null`` removes the field
    (back to its default)."""
    for path, value in assignments:
        node = body
        for key in path[:-1]:
            child = node.get(key)
            if not isinstance(child, dict):
                child = node[key] = {}
            node = child
        if value is None:
            node.pop(path[-1], None)
        else:
            node[path[-1]] = value
    return body


def read_body_file(path: str) -> dict[str, Any]:
    """A --file body: YAML or JSON (JSON is YAML), '-' for stdin; a mapping."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as err:
        raise UsageError(f"{path}: cannot read: {err.strerror or err}") from None
    try:
        body = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise UsageError(f"{path}: not YAML or JSON: {err}") from None
    if not isinstance(body, dict):
        raise UsageError(f"{path}: must hold a mapping of fields")
    if "name" in body:
        raise UsageError(f"{path}: the name is the command's argument, not a field")
    return body


def parse_duration(text: str) -> float:
    """Seconds, or with a unit: 90, 90s, 10m, 2h, 1d."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    scale = units.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in units else text
    try:
        value = float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a duration: 90, 90s, 10m, 2h") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0")
    return value


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: seconds, e.g. 1 or 0.5") from None
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{text!r}: between 0.1 and 3600 seconds")
    return value


# --- running a command ------------------------------------------------------------------


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=1))


def _path(*parts: str) -> str:
    return "/" + "/".join(quote(p, safe="") for p in parts)


def run_action(args: argparse.Namespace, action: Action) -> int:
    """Run ``action`` with a client built from the global options, and map
    every failure to its exit status and its lines on stderr."""
    try:
        token = resolve_token(args.token_file)
    except TokenFileError as err:
        print(f"hpclb: {err}", file=sys.stderr)
        return EXIT_USAGE
    url = resolve_url(args.api)
    console = Console(highlight=False, soft_wrap=False)
    try:
        with ApiClient(url, token, timeout_s=args.timeout) as client:
            return action(client, console, args)
    except UsageError as err:
        print(f"hpclb {args.command}: {err}", file=sys.stderr)
        return EXIT_USAGE
    except ApiError as err:
        print("\n".join(error_lines(err, url)), file=sys.stderr)
        return EXIT_API
    except ApiUnreachable as err:
        print("\n".join(unreachable_lines(err)), file=sys.stderr)
        return EXIT_UNREACHABLE


def _command(action: Action) -> Callable[[argparse.Namespace], int]:
    return lambda args: run_action(args, action)


# --- the commands -----------------------------------------------------------------------


def _status(client: ApiClient, console: Console, args: argparse.Namespace) -> int:
    body = client.get("/status")
    if args.json:
        _print_json(body)
    else:
        console.print(render_status(body))
    return EXIT_OK


#: kind -> (collection path, list renderer, detail renderer)
KINDS: dict[str, tuple[str, Callable[[Any, float], RenderableType],
                       Callable[[Any, float], RenderableType]]] = {
    "vip": ("vips", lambda xs, _now: vips_table(xs), lambda x, _now: render_vip(x)),
    "pool": ("pools", lambda xs, _now: pools_table(xs), lambda x, _now: render_pool(x)),
    "backend": ("backends", backends_table, render_backend),
}


def _list(client: ApiClient, console: Console, args: argparse.Namespace) -> int:
    collection, table, _ = KINDS[args.kind]
    items = client.get(f"/{collection}")
    if getattr(args, "pool", None):
        items = [b for b in items if b.get("pool") == args.pool]
    if args.json:
        _print_json(items)
    else:
        console.print(table(items, time.time()))
    return EXIT_OK


def _show(client: ApiClient, console: Console, args: argparse.Namespace) -> int:
    collection, _, detail = KINDS[args.kind]
    item = client.get(_path(collection, args.name))
    if args.json:
        _print_json(item)
    else:
        console.print(detail(item, time.time()))
    return EXIT_OK


def _configured(client: ApiClient) -> dict[str, Any]:
    """The configuration text in force, as the appliance's loader reads it
    (the operator's own fields only, no defaults); its ETag becomes the next
    write's If-Match."""
    root = yaml.safe_load(client.get_text("/config", {"format": "yaml"})) or {}
    return root if isinstance(root, dict) else {}


def _configured_backend(root: Mapping[str, Any], name: str) -> tuple[str, dict[str, Any]] | None:
    for pool_name, pool in (root.get("pools") or {}).items():
        for b in (pool or {}).get("backends") or []:
            if isinstance(b, dict) and b.get("name") == name:
                return str(pool_name), {k: v for k, v in b.items() if k != "name"}
    return None


def _set_body(args: argparse.Namespace, current: dict[str, Any] | None) -> dict[str, Any]:
    """--file replaces the object's fields; key=value pairs change the ones
    given and keep the rest (of the file, else of the configuration in force)."""
    assignments = parse_assignments(args.fields)
    if args.file is None and not assignments:
        raise UsageError("nothing to set: give key=value fields and/or --file FILE")
    base = read_body_file(args.file) if args.file is not None else dict(current or {})
    return apply_assignments(base, assignments)


def _wrote(console: Console, args: argparse.Namespace, answer: Mapping[str, Any],
           what: str) -> None:
    if args.json:
        _print_json(answer)
        return
    console.print(f"{what} (revision {answer.get('revision', '?')})")


def _set(client: ApiClient, console: Console, args: argparse.Namespace) -> int:
    now = time.time()
    if args.kind == "vip":
        current = None
        if args.file is None:
            for v in _configured(client).get("vips") or []:
                if isinstance(v, dict) and v.get("name") == args.name:
                    current = {k: x for k, x in v.items() if k != "name"}
        answer = client.put(_path("vips", args.name), _set_body(args, current))
        _wrote(console, args, answer, f"VIP {args.name} written")
        if not args.json:
            console.print(render_vip(answer["vip"]))
    elif args.kind == "pool":
        current = None
        if args.file is None:
            pool = (_configured(client).get("pools") or {}).get(args.name)
            # Its members have their own command: absent, they stay as they are.
            current = ({k: x for k, x in pool.items() if k != "backends"}
                       if isinstance(pool, dict) else None)
        answer = client.put(_path("pools", args.name), _set_body(args, current))
        _wrote(console, args, answer, f"pool {args.name} written")
        if not args.json:
            console.print(render_pool(answer["pool"]))
    else:
        found = _configured_backend(_configured(client), args.name)
        pool = args.pool or (found[0] if found else None)
        if pool is None:
            raise UsageError(f"no backend {args.name!r} yet: say in which pool (--pool POOL)")
        current = found[1] if found and found[0] == pool and args.file is None else None
        answer = client.put(_path("pools", pool, "backends", args.name),
                            _set_body(args, current))
        _wrote(console, args, answer, f"backend {args.name} written in pool {pool}")
        if not args.json:
            console.print(render_backend(answer["backend"], now))
    return EXIT_OK


def _delete(client: ApiClient, console: Console, args: argparse.Namespace) -> int:
    if args.kind == "backend":
        pool = args.pool
        if pool is None:
            found = _configured_backend(_configured(client), args.name)
            if found is None:
                raise ApiError(404, "not_found", f"no backend {args.name!r}")
            pool = found[0]
        answer = client.delete(_path("pools", pool, "backends", args.name))
        what = f"backend {args.name} deleted from pool {pool}"
    else:
        collection = KINDS[args.kind][0]
        answer = client.delete(_path(collection, args.name))
        what = f"{'VIP' if args.kind == 'vip' else 'pool'} {args.name} deleted"
    _wrote(console, args, answer, what)
    return EXIT_OK


def _state(client: ApiClient, console: Console, args: argparse.Namespace) -> int:
    answer = client.post(_path("backends", args.name, args.command))
    if args.json:
        _print_json(answer)
        return EXIT_OK
    b = answer["backend"]
    console.print(f"backend {args.name}: admin state {b['admin_state']} "
                  f"(revision {answer.get('revision', '?')})")
    console.print(backends_table([b], time.time(), title=""))
    return EXIT_OK


def _weight_pin(client: ApiClient, console: Console, args: argparse.Namespace) -> int:
    if args.unpin:
        if args.weight is not None or args.duration is not None:
            raise UsageError("--unpin takes the backend's name only")
        answer = client.delete(_path("backends", args.name, "pin"))
        what = f"backend {args.name}: unpinned"
    else:
        if args.weight is None:
            raise UsageError("give WEIGHT --for SECONDS, or --unpin")
        if args.duration is None:
            raise UsageError("a pin needs --for SECONDS (it always ends by itself)")
        if not args.weight >= 0:
            raise UsageError("WEIGHT must be >= 0")
        answer = client.put(_path("backends", args.name, "pin"),
                            {"weight": args.weight, "duration_s": args.duration})
        what = f"backend {args.name}: weight pinned at {args.weight:g} for " \
               f"{duration_text(args.duration)}"
    if args.json:
        _print_json(answer)
    else:
        console.print(what)
        console.print(backends_table([answer["backend"]], time.time(), title=""))
    return EXIT_OK


def _stats_frame(client: ApiClient) -> dict[str, Any]:
    return {"vips": client.get("/vips"), "backends": client.get("/backends"),
            "counters": client.get("/counters"),
            "sample": last_sample(client.get("/history", {"seconds": 2}))}


def _stats(client: ApiClient, console: Console, args: argparse.Namespace) -> int:
    """One frame, or with --watch one every --interval seconds until Ctrl-C (or
    --count frames). On a terminal the frame is redrawn in place; into a pipe
    or a file each frame is printed after the last (--json: one JSON line each)."""
    count = args.count if args.watch else 1
    live = (Live(console=console, auto_refresh=False)
            if args.watch and console.is_terminal and not args.json else None)
    frames = 0
    try:
        if live is not None:
            live.start()
        while True:
            frame = _stats_frame(client)
            if args.json:
                print(json.dumps(frame, indent=None if args.watch else 1), flush=True)
            else:
                view = render_stats(frame["vips"], frame["backends"], frame["counters"],
                                    frame["sample"], time.time())
                if live is not None:
                    live.update(view, refresh=True)
                else:
                    console.print(view)
            frames += 1
            if count and frames >= count:
                break
            time.sleep(args.interval)
    except KeyboardInterrupt:  # Ctrl-C is how --watch ends: not an error
        pass
    finally:
        if live is not None:
            live.stop()
    return EXIT_OK


def _diagnose(client: ApiClient, console: Console, args: argparse.Namespace) -> int:
    body = client.get("/diagnose")
    if args.json:
        _print_json(body)
        return EXIT_OK
    try:
        from hpclb.faces import diagnose_render

        findings = diagnose_render.from_json(body)
    except (ImportError, AttributeError, ValueError):
        console.print(findings_table(body))
    else:
        diagnose_render.render(findings, console, verbose=args.verbose)
    return EXIT_OK


def _export(client: ApiClient, console: Console, args: argparse.Namespace) -> int:
    if args.json:
        _print_json(client.get("/config"))
    else:  # the text in force, comments and all, as is
        sys.stdout.write(client.get_text("/config", {"format": "yaml"}))
    return EXIT_OK


# --- the parser ---------------------------------------------------------------------------


class _FieldsParser(argparse.ArgumentParser):
    """Lets `set`'s key=value fields come after its options too
    (`backend set b9 --pool batch address=10.0.0.19`): argparse alone takes a
    positional list only where it starts."""

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None,
                         ) -> tuple[argparse.Namespace, list[str]]:
        ns, extras = super().parse_known_args(args, namespace)
        if hasattr(ns, "fields"):
            more = [a for a in extras if "=" in a and not a.startswith("-")]
            ns.fields = [*(ns.fields or []), *more]
            extras = [a for a in extras if a not in more]
        return ns, extras


def client_options() -> argparse.ArgumentParser:
    """The options every client command takes (a parent parser)."""
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("API client")
    g.add_argument("--api", metavar="URL",
                   help=f"the appliance's API (default ${API_ENV}, else {DEFAULT_API})")
    g.add_argument("--token-file", type=Path, metavar="FILE",
                   help=f"a file holding the bearer token (default: the token itself in "
                   f"${TOKEN_ENV}); "
                   "a write token for changes")
    g.add_argument("--json", action="store_true", help="print the API's JSON (for scripts)")
    g.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help=argparse.SUPPRESS)
    return common


def add_api_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser],
                     ) -> dict[str, argparse.ArgumentParser]:
    """Add the client commands to `hpclb`; returns the top-level parsers by
    name (the CLI adds local variants of status and stats to theirs)."""
    common = client_options()
    parsers: dict[str, argparse.ArgumentParser] = {}

    def command(name: str, action: Action, help: str,
                into: Any = sub, **kw: Any) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = into.add_parser(name, help=help, description=help,
                                                    parents=[common], **kw)
        p.set_defaults(func=_command(action))
        return p

    parsers["status"] = command("status", _status, "the appliance's state over the API: data "
                                "plane, revision, backends up, alarms (-c CONFIG: its status "
                                "file instead, on the appliance)")

    for kind, plural, noun in (("vip", "vips", "VIP"), ("pool", "pools", "pool"),
                               ("backend", "backends", "backend")):
        group = sub.add_parser(kind, help=f"{noun}s: list, show, set (create or change), "
                               "delete", description=f"{noun}s of the running appliance; "
                               "a change is written to its configuration file")
        parsers[kind] = group
        group.set_defaults(kind=kind)
        actions = group.add_subparsers(dest="action", required=True, metavar="ACTION",
                                       parser_class=_FieldsParser)
        p = command("list", _list, f"all {plural}", actions)
        if kind == "backend":
            p.add_argument("--pool", help="only this pool's")
        p = command("show", _show, f"one {noun}", actions)
        p.add_argument("name", metavar="NAME")
        p = command("set", _set, f"create a {noun} or change fields of one: key=value "
                    "changes those fields and keeps the others (value: a YAML scalar; "
                    "key=null removes the field); --file FILE gives all its fields", actions)
        p.add_argument("name", metavar="NAME")
        p.add_argument("fields", nargs="*", metavar="KEY=VALUE")
        p.add_argument("--file", metavar="FILE", help="the fields as YAML or JSON ('-': stdin)")
        if kind == "backend":
            p.add_argument("--pool", help="its pool (required for a new backend)")
        p = command("delete", _delete, f"delete a {noun}" + (
            " (refused while a VIP uses it)" if kind == "pool" else ""), actions)
        p.add_argument("name", metavar="NAME")
        if kind == "backend":
            p.add_argument("--pool", help="its pool (default: looked up)")

    for action, help in (("drain", "drain a backend: no new flows, existing ones stay"),
                         ("undrain", "end a drain: the backend takes new flows again"),
                         ("down", "take a backend out (admin down)"),
                         ("up", "put a backend back in service (admin up)")):
        p = command(action, _state, help + "; written to the configuration file")
        p.add_argument("name", metavar="NAME")
        parsers[action] = p

    p = command("weight", _weight_pin, "pin a backend's ring weight for a while (runtime "
                "only, not written to the file), or --unpin it")
    p.add_argument("name", metavar="NAME")
    p.add_argument("weight", metavar="WEIGHT", type=float, nargs="?")
    p.add_argument("--for", dest="duration", type=parse_duration, metavar="SECONDS",
                   help="how long the pin holds: 90, 90s, 10m, 2h (at most 1d)")
    p.add_argument("--unpin", action="store_true", help="end the pin now")
    parsers["weight"] = p

    p = command("stats", _stats, "per VIP and per backend packet rates, health, state and "
                "weight, over the API (with --socket: the data plane's own counters, asked "
                "directly, on the appliance)")
    p.add_argument("--watch", action="store_true", help="redraw every --interval seconds "
                   "until Ctrl-C")
    p.add_argument("--interval", type=_interval, default=1.0, metavar="S",
                   help="seconds between frames of --watch (default 1)")
    p.add_argument("--count", type=int, default=0, metavar="N",
                   help="with --watch: stop after N frames (default: until Ctrl-C)")
    parsers["stats"] = p

    p = command("diagnose", _diagnose, "what looks wrong, what it likely means and what "
                "to check next")
    p.add_argument("--verbose", action="store_true", help="with each finding's evidence")
    parsers["diagnose"] = p

    group = sub.add_parser("config", help="the configuration in force (export)")
    actions = group.add_subparsers(dest="action", required=True, metavar="ACTION")
    command("export", _export, "print the YAML in force as is (comments included); "
            "--json: as the API's JSON", actions)
    parsers["config"] = group
    return parsers
