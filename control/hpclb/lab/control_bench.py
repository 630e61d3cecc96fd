"""`hpclb bench control`: the control plane's benchmarks under one runner.

Parts, each in its own module (also runnable alone through perf/):

* ``maglev``: ring build time from 10 to 10,000 backends, the controller's path (C
  fill) and the Python fill (:mod:`.control_maglev`);
* ``slots``: slots one weight step moves against the theoretical minimum, at the same
  sizes (:mod:`.control_maglev`);
* ``reaction``: telemetry-to-data-plane reaction time at 1,000 backends through the
  real controller, ZeroMQ CURVE agents and hpclb-xdp (:mod:`.control_reaction`,
  perf/reaction_time.py; needs root);
* ``probes``: health probing of 10,000 endpoints on one core (:mod:`.control_probes`,
  perf/probe_scale.py; ICMP needs root);
* ``config``: load time and memory of large configurations (:mod:`.control_config_load`,
  perf/config_load.py).

One run writes ``<out>.json`` (every measurement and its conditions: kernel, CPU model,
cores, sizes, repeats), PNG plots beside it (``<out>-maglev_build.png``,
``<out>-slots.png``, ``<out>-reaction.png``) and ``<out>.md`` (a summary). A progress
bar while it runs; Ctrl-C (or SIGTERM) stops the part in progress, which cleans up
after itself, and the files are written with what was measured and ``"interrupted":
true``. Benchmarks, not tests: nothing here asserts a speed.

The host conditions and the progress bar are the forwarding bench's
(:mod:`.bench_report`); the plots and the summary, which share nothing with its
trial tables, are :mod:`.control_report`.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from hpclb.lab.bench_report import TrialProgress

PARTS = ("maglev", "slots", "reaction", "probes", "config")


def host_conditions() -> dict[str, Any]:
    """The machine a measurement ran on: the bench's host conditions (kernel, CPU model,
    cores) and what the control plane's figures also depend on (usable CPUs, Python,
    numpy, the commit). ``cpus`` repeats ``cores`` under the perf/ scripts' old key."""
    import numpy as np

    from hpclb.lab.bench_report import host_conditions as bench_host

    commit = None
    with contextlib.suppress(Exception):
        commit = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent),
                                 "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=5).stdout.strip() or None
    host = bench_host()
    return {**host, "cpus": host["cores"], "cpu_affinity": len(os.sched_getaffinity(0)),
            "python": platform.python_version(), "numpy": np.__version__, "commit": commit}


@dataclass
class ControlBenchOptions:
    """What a run measures; the defaults are the full run, :data:`QUICK` a smoke run."""

    parts: tuple[str, ...] = PARTS
    sizes: tuple[int, ...] = (10, 30, 100, 300, 1000, 3000, 10000)  # backends
    ring_size: int = 65537
    build_repeats: int = 5  # C fill (the controller's path)
    python_repeats: int = 3  # Python fill
    slot_steps: int = 50  # weight steps per size
    min_cpu_step: float = 0.1  # smallest cpu_load change of a step (weight 0.4x that)
    reaction_backends: int = 1000
    reaction_samples: int = 200  # paced samples, and as many in the burst
    reaction_xdp_mode: str = "native"
    probe_endpoints: int = 10_000
    probe_interval: float = 1.0
    probe_duration: float = 30.0  # measured seconds per kind
    probe_warmup: float = 3.0
    probe_kinds: tuple[str, ...] = ("icmp", "tcp")
    config_repeat: int = 3
    config_scenarios: tuple[str, ...] = ("valid-4096", "invalid-4096", "syntax-4096",
                                         "dense-64000", "over-64000")
    seed: int = 1

    def check(self) -> None:
        bad = [p for p in self.parts if p not in PARTS]
        if bad or not self.parts:
            raise ValueError(f"parts: {bad or list(self.parts)} not among {', '.join(PARTS)}")
        if not self.sizes or min(self.sizes) < 2:
            raise ValueError("sizes: at least one backend count, each >= 2")
        for name in ("build_repeats", "python_repeats", "slot_steps", "reaction_samples",
                     "config_repeat"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")


QUICK = ControlBenchOptions(
    sizes=(10, 100), build_repeats=2, python_repeats=1, slot_steps=5,
    reaction_backends=20, reaction_samples=5, probe_endpoints=200, probe_interval=0.5,
    probe_duration=2.0, probe_warmup=0.5, probe_kinds=("tcp",), config_repeat=1,
    config_scenarios=("valid-4096",))


def options(quick: bool = False, **overrides: Any) -> ControlBenchOptions:
    """The run's options: the full or quick defaults, then ``overrides`` (field names of
    :class:`ControlBenchOptions`; None means "the default")."""
    base = QUICK if quick else ControlBenchOptions()
    known = {f.name for f in fields(ControlBenchOptions)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise TypeError(f"unknown control bench options: {', '.join(unknown)}")
    given = {k: (tuple(v) if isinstance(v, list) else v)
             for k, v in overrides.items() if v is not None}
    opts = replace(base, **given)
    opts.check()
    return opts


# --- the parts --------------------------------------------------------------------------


def _maglev(opts: ControlBenchOptions, doc: dict[str, Any], rng: random.Random,
            tick: Callable[[], None]) -> None:
    from hpclb.lab.control_maglev import build_time

    rows: list[dict[str, Any]] = []
    doc["maglev_build"] = {"ring_size": opts.ring_size, "rows": rows}
    for n in opts.sizes:
        rows.append(build_time(n, opts.ring_size, opts.build_repeats, rng, "c"))
        tick()
        rows.append(build_time(n, opts.ring_size, opts.python_repeats, rng, "python"))
        tick()


def _slots(opts: ControlBenchOptions, doc: dict[str, Any], rng: random.Random,
           tick: Callable[[], None]) -> None:
    from hpclb.lab.control_maglev import weight_step_moves

    rows: list[dict[str, Any]] = []
    doc["slots"] = {"ring_size": opts.ring_size, "rows": rows}
    for n in opts.sizes:
        rows.append(weight_step_moves(n, opts.ring_size, opts.slot_steps, rng,
                                      opts.min_cpu_step))
        tick()


def _reaction_options(opts: ControlBenchOptions) -> Any:
    from hpclb.lab.control_reaction import ReactionOptions

    # No extra slot-ratio runs: the slots part measures the ratio at every size.
    return ReactionOptions(backends=opts.reaction_backends, samples=opts.reaction_samples,
                           burst_samples=opts.reaction_samples, slot_list=[],
                           ring_size=opts.ring_size, min_cpu_step=opts.min_cpu_step,
                           xdp_mode=opts.reaction_xdp_mode, seed=opts.seed)


def _reaction(opts: ControlBenchOptions, doc: dict[str, Any], ropts: Any,
              tick: Callable[[], None]) -> None:
    from hpclb.lab.control_reaction import measure

    part: dict[str, Any] = {}
    doc["reaction"] = part
    if os.geteuid() != 0:
        part["skipped"] = "needs root: a network namespace and the XDP daemon"
        return
    measure(ropts, on_sample=tick, into=part)


def _probe_kinds(opts: ControlBenchOptions) -> tuple[list[str], list[str]]:
    """The kinds that run here, and those that cannot (ICMP needs a raw socket)."""
    run = [k for k in opts.probe_kinds if k != "icmp" or os.geteuid() == 0]
    return run, [k for k in opts.probe_kinds if k not in run]


def _probes(opts: ControlBenchOptions, doc: dict[str, Any], tick: Callable[[], None]) -> None:
    from hpclb.lab.control_probes import ProbeOptions, measure_all

    kinds, skipped = _probe_kinds(opts)
    doc["probes"] = part = {"skipped_kinds": {k: "ICMP needs a raw socket (root)"
                                              for k in skipped}}
    if kinds:
        part.update(measure_all(ProbeOptions(
            endpoints=opts.probe_endpoints, interval=opts.probe_interval,
            duration=opts.probe_duration, warmup=opts.probe_warmup, kinds=kinds),
            on_kind=tick))


def _config(opts: ControlBenchOptions, doc: dict[str, Any], tick: Callable[[], None]) -> None:
    from hpclb.lab.control_config_load import measure

    doc["config_load"] = measure(opts.config_repeat, opts.config_scenarios, on_scenario=tick)


# --- the runner ---------------------------------------------------------------------------


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _catch_stops() -> dict[int, Any]:
    """Ctrl-C and SIGTERM raise KeyboardInterrupt for the run's length (SIGINT too:
    a shell starts a background job with it ignored, and then the run could not be
    stopped cleanly by it); the handlers they had. None outside the main thread, where
    Python lets no handler be set."""
    previous: dict[int, Any] = {}
    with contextlib.suppress(ValueError):
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, _raise_interrupt)
    return previous


def paths(out: Path) -> dict[str, Path]:
    """The files a run writes: ``out`` with .json and .md, plots beside it."""
    base = out.with_suffix("") if out.suffix == ".json" else out
    return {"json": base.with_name(base.name + ".json"),
            "markdown": base.with_name(base.name + ".md"),
            "maglev_build": base.with_name(base.name + "-maglev_build.png"),
            "slots": base.with_name(base.name + "-slots.png"),
            "reaction": base.with_name(base.name + "-reaction.png")}


def run_control_bench(out: Path, quick: bool = False, progress: bool = True,
                      **overrides: Any) -> int:
    """Run the control-plane benchmarks and write ``<out>.json``, ``<out>.md`` and the
    PNG plots. ``quick``: small sizes (a smoke run). ``overrides``: fields of
    :class:`ControlBenchOptions`. Returns 0, 1 when a part failed (its error is in the
    JSON), 130 when interrupted (what was measured is written)."""
    opts = options(quick, **overrides)
    files = paths(Path(out))
    rng = random.Random(opts.seed)
    doc: dict[str, Any] = {
        "benchmark": "control",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quick": quick,
        "interrupted": False,
        "conditions": {**host_conditions(), "options": asdict(opts)},
        "errors": {},
    }
    ropts = _reaction_options(opts) if "reaction" in opts.parts else None
    units = {"maglev": 2 * len(opts.sizes), "slots": len(opts.sizes),
             "reaction": ropts.units() if ropts is not None and os.geteuid() == 0 else 0,
             "probes": len(_probe_kinds(opts)[0]), "config": len(opts.config_scenarios)}
    bar = TrialProgress(sum(units[p] for p in opts.parts), enabled=progress)
    started = time.monotonic()
    previous = _catch_stops()
    try:
        with bar.shown():
            runners: dict[str, Callable[[Callable[[], None]], None]] = {
                "maglev": lambda t: _maglev(opts, doc, rng, t),
                "slots": lambda t: _slots(opts, doc, rng, t),
                "reaction": lambda t: _reaction(opts, doc, ropts, t),
                "probes": lambda t: _probes(opts, doc, t),
                "config": lambda t: _config(opts, doc, t),
            }
            for part in opts.parts:
                bar.step(part)
                try:
                    runners[part](lambda part=part: bar.done(part))
                except (KeyboardInterrupt, SystemExit):
                    raise
                except Exception as exc:  # one part's failure is reported, the rest run
                    doc["errors"][part] = f"{type(exc).__name__}: {exc}"
    except KeyboardInterrupt:
        doc["interrupted"] = True
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    doc["duration_s"] = round(time.monotonic() - started, 1)
    write(doc, files)
    if doc["interrupted"]:
        return 130
    return 1 if doc["errors"] else 0


def write(doc: dict[str, Any], files: dict[str, Path]) -> None:
    """The JSON, the plots and the Markdown summary of ``doc``."""
    from hpclb.lab.control_report import markdown, plots

    files["json"].parent.mkdir(parents=True, exist_ok=True)
    written = plots(doc, files)
    doc["files"] = {"json": str(files["json"]), "markdown": str(files["markdown"]),
                    "plots": [str(p) for p in written]}
    files["json"].write_text(json.dumps(doc, indent=1) + "\n")
    files["markdown"].write_text(markdown(doc))
