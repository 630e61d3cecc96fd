"""Configuration load: time and peak memory of ``load_config`` on large files.

A benchmark, not a test: it writes JSON and asserts nothing. Run by ``hpclb bench
control`` (:mod:`hpclb.lab.control_bench`) and alone by perf/config_load.py (this
module's :func:`main`). Each scenario's
file is generated into a scratch folder, then loaded by a fresh Python process
(so that every run starts from the same memory): wall time of ``load_config``
alone (imports excluded), the process's peak RSS (VmHWM, which
includes the interpreter and its imports, measured separately as
``rss_after_imports_mb``), whether the file was accepted, and the first line
of the refusal.

Scenarios (all backends with name, address, weight and MAC, flow style, the
VIPs spread over pools of at most 256 backends):

* ``valid-4096``: 4,096 backends, the data planes' limit: must load;
* ``invalid-4096``: the same with one bad port on the last VIP: the refusal
  names its line (the cost of finding the line);
* ``syntax-4096``: the same with a YAML syntax error on the last line;
* ``dense-64000``: 64,000 backends written tersely (name and address only), a
  file under the size limit that the schema refuses (too many backends);
* ``over-64000``: 64,000 backends, about 5 MB: over the size limit.

Usage: .venv/bin/python perf/config_load.py --repeat 3 --out results/config_load.json
(or ``python -m hpclb.lab.control_config_load`` with the same arguments)
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

SCENARIOS = ("valid-4096", "invalid-4096", "syntax-4096", "dense-64000", "over-64000")
MODULE = "hpclb.lab.control_config_load"  # each load runs as python -m MODULE --child

HEAD = """\
appliance:
  name: perf
  interfaces:
    ingress: eth0
  hash_key: 000102030405060708090a0b0c0d0e0f
pools:
"""


def config_text(backends: int, terse: bool = False, pool_size: int = 256) -> str:
    """A configuration of ``backends`` backends in pools of ``pool_size``, one VIP per
    pool (at most 64 VIPs: the pools beyond share the last ones' addresses)."""
    lines = [HEAD]
    npools = (backends + pool_size - 1) // pool_size
    for p in range(npools):
        lines.append(f"  pool{p}:\n    backends:\n")
        for i in range(p * pool_size, min(backends, (p + 1) * pool_size)):
            addr = f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}"
            if terse:
                lines.append(f"      - {{name: c{i}, address: {addr}}}\n")
            else:
                mac = f"02:00:00:{i >> 16 & 255:02x}:{i >> 8 & 255:02x}:{i & 255:02x}"
                lines.append(f"      - {{name: cn{i:06d}, address: {addr}, weight: 1, "
                             f"mac: \"{mac}\"}}\n")
    lines.append("vips:\n")
    for p in range(min(npools, 64)):
        lines.append(f"  - {{name: v{p}, address: 198.18.1.{p + 1}, port: 80, pool: pool{p}}}\n")
    return "".join(lines)


def scenario_text(name: str) -> str:
    if name == "valid-4096":
        return config_text(4096)
    if name == "invalid-4096":
        return config_text(4096).replace("port: 80, pool: pool15}", "port: 70000, pool: pool15}")
    if name == "syntax-4096":
        return config_text(4096) + "  - {name: broken, address: [\n"
    if name == "dense-64000":
        return config_text(64000, terse=True)
    if name == "over-64000":
        return config_text(64000)
    raise ValueError(name)


def _rss_mb() -> float:
    """Peak RSS of this process so far, MB. VmHWM, not getrusage's ru_maxrss: that
    one survives exec, so it would start from the parent's size at the fork."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child(path: str) -> int:
    """Load one file; print one JSON line."""
    from hpclb.config import ConfigError, load_config

    after_imports = _rss_mb()
    t0 = time.perf_counter()
    try:
        cfg = load_config(path)
        accepted, message = True, ""
        backends = sum(len(p.backends) for p in cfg.pools.values())
    except ConfigError as exc:
        accepted, message, backends = False, str(exc).splitlines()[0][:300], 0
    elapsed = time.perf_counter() - t0
    sys.stdout.write(json.dumps({"seconds": elapsed, "peak_rss_mb": _rss_mb(),
                                 "rss_after_imports_mb": after_imports, "accepted": accepted,
                                 "backends": backends, "message": message}) + "\n")
    return 0


def run_one(path: Path) -> dict[str, Any]:
    res = subprocess.run([sys.executable, "-m", MODULE, "--child", str(path)],
                         capture_output=True, text=True, timeout=600, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"loading {path} failed: {res.stderr.strip()[-2000:]}")
    result: dict[str, Any] = json.loads(res.stdout.splitlines()[-1])
    return result


def measure(repeat: int = 3, scenarios: Sequence[str] = SCENARIOS,
            on_scenario: Callable[[], None] | None = None) -> dict[str, Any]:
    """Every scenario ``repeat`` times; the JSON document. ``on_scenario`` is called
    after each scenario (a progress bar's tick)."""
    import yaml

    import hpclb.config
    from hpclb.lab.control_bench import host_conditions

    if repeat < 1:
        raise ValueError("repeat must be at least 1")
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenarios {unknown}: not among {', '.join(SCENARIOS)}")
    results = []
    with tempfile.TemporaryDirectory(prefix="hpclb-config-load-") as tmp:
        for name in scenarios:
            path = Path(tmp) / f"{name}.yaml"
            path.write_text(scenario_text(name))
            runs = [run_one(path) for _ in range(repeat)]
            last = runs[-1]
            results.append({
                "scenario": name,
                "file_bytes": path.stat().st_size,
                "seconds_median": round(statistics.median(r["seconds"] for r in runs), 4),
                "seconds_max": round(max(r["seconds"] for r in runs), 4),
                "peak_rss_mb": round(max(r["peak_rss_mb"] for r in runs), 1),
                "rss_after_imports_mb": round(last["rss_after_imports_mb"], 1),
                "accepted": last["accepted"],
                "backends": last["backends"],
                "message": last["message"],
            })
            if on_scenario is not None:
                on_scenario()
    return {
        "host": {**host_conditions(), "pyyaml": yaml.__version__,
                 "libyaml": bool(yaml.__with_libyaml__)},
        "conditions": {"repeat": repeat,
                       "size_limit_bytes": getattr(hpclb.config, "MAX_CONFIG_BYTES", None)},
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="config_load", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3, help="runs per scenario (median time)")
    ap.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    ap.add_argument("--out", type=Path, help="JSON file to write (required)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.child)
    if args.out is None:
        ap.error("--out is required")
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    doc = measure(args.repeat, args.scenarios)
    for r in doc["results"]:
        print(f"config_load: {r['scenario']}: {r['seconds_median']} s, "
              f"{r['peak_rss_mb']} MB peak", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"config_load: {len(doc['results'])} scenarios, written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
