"""What one `hpclb bench` run leaves behind: the JSON, the plots, the Markdown.

Pure with respect to the lab: it takes what the runner measured (``BenchRecord``)
and writes ``<out>.json`` (every trial of every subject, the conditions), PNG plots
beside it (matplotlib, Agg backend: offered against forwarded with the loss, per
subject; latency percentiles per subject where a generator measured them) and
``<out>.md`` (a summary table). It also holds the progress bar shown while trials
run, and the host's conditions (kernel, CPU model, cores).

An interrupted run (Ctrl-C) is written the same way with ``"interrupted": true``:
what was measured is kept, and a summary says which subjects are incomplete.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpclb.lab.ndr import SearchResult, Trial

# The peer a user would pick instead, for the "ratio to nftables" column.
NFTABLES = "nftables_dnat"
REFLECT = "reflect"
LATENCY_KEYS = ("p50_us", "p99_us", "p999_us")


def host_conditions() -> dict[str, Any]:
    """Kernel, CPU model (/proc/cpuinfo) and cores of this host."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "cpu model", "hardware")):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"kernel": platform.release(), "cpu_model": model, "cores": os.cpu_count() or 1,
            "machine": platform.machine()}


@dataclass
class SubjectRecord:
    """One subject's trials: line-rate samples (one per round), its search."""

    name: str
    conditions: dict[str, Any] = field(default_factory=dict)
    samples: list[Trial] = field(default_factory=list)
    search: SearchResult | None = None
    cost: dict[str, Any] = field(default_factory=dict)

    def median_forwarded(self) -> float | None:
        if not self.samples:
            return None
        return statistics.median(t.forwarded_pps for t in self.samples)

    def all_trials(self) -> list[tuple[str, Trial]]:
        out = [("sample", t) for t in self.samples]
        if self.search is not None:
            out += [("search", t) for t in self.search.trials]
        return out

    def latency(self) -> dict[str, float] | None:
        """The latency of the best passing trial of the search (the NDR's), else
        of the last trial that has one."""
        if self.search is not None:
            for t in reversed(self.search.trials):
                if t.latency and t.loss_ratio == 0:
                    return t.latency
        for _, t in reversed(self.all_trials()):
            if t.latency:
                return t.latency
        return None


@dataclass
class BenchRecord:
    """Everything one run measured, in the order it was measured."""

    conditions: dict[str, Any]
    subjects: dict[str, SubjectRecord] = field(default_factory=dict)
    not_run: dict[str, str] = field(default_factory=dict)  # subject -> why
    cost: dict[str, Any] = field(default_factory=dict)
    connections: dict[str, Any] = field(default_factory=dict)  # subject -> cps figures
    interrupted: bool = False
    # How the marginal cost per packet reads (coupled: one shared core).
    marginal_mode: str = "coupled"

    def subject(self, name: str, conditions: dict[str, Any] | None = None) -> SubjectRecord:
        rec = self.subjects.setdefault(name, SubjectRecord(name))
        if conditions:
            rec.conditions.update(conditions)
        return rec

    # ------------------------------------------------------------ figures

    def medians(self) -> dict[str, float]:
        return {k: m for k, r in self.subjects.items() if (m := r.median_forwarded()) is not None}

    def ndr(self) -> dict[str, float | None]:
        return {k: r.search.ndr_pps for k, r in self.subjects.items() if r.search}

    def pdr(self) -> dict[str, float | None]:
        return {k: r.search.pdr_pps for k, r in self.subjects.items() if r.search}

    def ratios_to(self, base: str) -> dict[str, dict[str, float | None]]:
        """Each subject's NDR, PDR and median line-rate forwarding over ``base``'s."""
        med, ndr, pdr = self.medians(), self.ndr(), self.pdr()
        out: dict[str, dict[str, float | None]] = {}
        for k in self.subjects:
            if k == base:
                continue
            out[k] = {"ndr": _ratio(ndr.get(k), ndr.get(base)),
                      "pdr": _ratio(pdr.get(k), pdr.get(base)),
                      "median_forwarded": _ratio(med.get(k), med.get(base))}
        return out

    def marginal_ns(self) -> dict[str, float | None]:
        """1/pps(subject) - 1/pps(reflector) in ns, from the median line-rate
        forwarding: on a saturated core, what each packet costs over the
        reflector's bounce."""
        med = self.medians()
        base = med.get(REFLECT)
        return {k: (1e9 / v - 1e9 / base) if v and base else None
                for k, v in med.items() if k != REFLECT}

    def to_json(self) -> dict[str, Any]:
        return {
            "benchmark": "forwarding_udp64",
            "interrupted": self.interrupted,
            "conditions": self.conditions,
            "median_forwarded_pps": self.medians(),
            "ndr_pps": self.ndr(),
            "pdr_pps": self.pdr(),
            "ratio_to_reflect": self.ratios_to(REFLECT),
            "ratio_to_nftables": self.ratios_to(NFTABLES) if NFTABLES in self.subjects else {},
            "marginal_ns_per_packet": self.marginal_ns(),
            "marginal_mode": self.marginal_mode,
            "latency": {k: r.latency() for k, r in self.subjects.items() if r.latency()},
            "not_run": self.not_run,
            "cost": self.cost,
            "connections": self.connections,
            "subjects": {
                k: {"conditions": r.conditions,
                    "samples": [t.to_json() for t in r.samples],
                    "search": r.search.to_json() if r.search else None,
                    "cost": r.cost}
                for k, r in self.subjects.items()
            },
        }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ---------------------------------------------------------------- writing


def write_all(record: BenchRecord, out: Path) -> list[Path]:
    """``out`` (JSON), the plots and ``out.with_suffix('.md')``; the paths written.
    A plot that cannot be drawn (no matplotlib) is noted in the JSON instead."""
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = record.to_json()
    written: list[Path] = []
    try:
        pngs = write_plots(record, out)
        doc["plots"] = [p.name for p in pngs]
        written += pngs
    except ImportError as err:
        doc["plots"] = []
        doc["plots_skipped"] = f"matplotlib not installed: {err}"
    out.write_text(json.dumps(doc, indent=1))
    md = out.with_suffix(".md")
    md.write_text(markdown(doc))
    return [out, md, *written]


def write_plots(record: BenchRecord, out: Path) -> list[Path]:
    """Per subject: forwarded against offered pps over every trial, the loss on a
    second axis; latency percentiles against offered pps where measured."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    paths: list[Path] = []
    stem = out.with_suffix("")
    for name, rec in record.subjects.items():
        trials = sorted((t for _, t in rec.all_trials()), key=lambda t: t.offered_pps)
        if not trials:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        x = [t.offered_pps / 1e3 for t in trials]
        ax.plot(x, [t.forwarded_pps / 1e3 for t in trials], "o-", label="forwarded")
        top = max(x) if x else 1.0
        ax.plot([0, top], [0, top], ":", color="grey", label="offered = forwarded")
        ax.set_xlabel("offered (kpps)")
        ax.set_ylabel("forwarded (kpps)")
        loss_ax = ax.twinx()
        loss_ax.plot(x, [t.loss_ratio * 100 for t in trials], "x--", color="tab:red",
                     label="loss")
        loss_ax.set_ylabel("loss (%)", color="tab:red")
        title = name
        if rec.search is not None and rec.search.ndr_pps is not None:
            title += f": NDR {rec.search.ndr_pps / 1e3:,.1f} kpps"
        ax.set_title(title)
        ax.legend(loc="upper left", fontsize="small")
        fig.tight_layout()
        path = Path(f"{stem}-{name}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
        lat = [t for t in trials if t.latency]
        if lat:
            fig, ax = plt.subplots(figsize=(6.4, 4.2))
            for key in LATENCY_KEYS:
                pts = [(t.offered_pps / 1e3, t.latency[key]) for t in lat
                       if t.latency and key in t.latency]
                if pts:
                    ax.plot(*zip(*pts, strict=True), "o-", label=key.removesuffix("_us"))
            ax.set_xlabel("offered (kpps)")
            ax.set_ylabel("latency (µs)")
            ax.set_yscale("log")
            ax.set_title(f"{name}: latency percentiles")
            ax.legend(fontsize="small")
            fig.tight_layout()
            path = Path(f"{stem}-{name}-latency.png")
            fig.savefig(path, dpi=100)
            plt.close(fig)
            paths.append(path)
    return paths


def _fmt(v: Any, spec: str = ",.0f") -> str:
    return "-" if v is None else format(v, spec)


def markdown(doc: dict[str, Any]) -> str:
    """The summary of a report (its JSON form): one row per subject."""
    c = doc["conditions"]
    gen = c.get("generator", {})
    lines = [f"# hpclb bench: {doc['benchmark']}", ""]
    if doc.get("interrupted"):
        lines += ["**Interrupted** (Ctrl-C): what was measured until then.", ""]
    lines += [
        f"Kernel {c.get('kernel')}, {c.get('cpu_model')}, {c.get('cores')} cores; "
        f"{gen.get('frame_bytes', 64)}-byte frames, {gen.get('flows')} flows, "
        f"{c.get('seconds_per_trial')} s trials; generator {gen.get('name')} "
        f"({gen.get('mode', '')}); PDR: loss ≤ {c.get('pdr_loss', 0) * 100:g}%.",
        "",
        "| subject | NDR pps | PDR pps | median line-rate pps | NDR / reflect | "
        "NDR / nftables | p50 µs | p99 µs | p99.9 µs | marginal ns/pkt |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, sub in doc["subjects"].items():
        rr = doc["ratio_to_reflect"].get(name, {})
        rn = doc["ratio_to_nftables"].get(name, {})
        lat = doc["latency"].get(name) or {}
        search = sub["search"] or {}
        lines.append(
            f"| {name} | {_fmt(search.get('ndr_pps'))} | {_fmt(search.get('pdr_pps'))} | "
            f"{_fmt(doc['median_forwarded_pps'].get(name))} | "
            f"{_fmt(rr.get('ndr'), '.2f')} | {_fmt(rn.get('ndr'), '.2f')} | "
            f"{_fmt(lat.get('p50_us'), '.1f')} | {_fmt(lat.get('p99_us'), '.1f')} | "
            f"{_fmt(lat.get('p999_us'), '.1f')} | "
            f"{_fmt(doc['marginal_ns_per_packet'].get(name), ',.0f')} |")
    lines += ["", f"Marginal cost per packet: 1/pps(subject) - 1/pps(reflector) at line "
                  f"rate ({doc['marginal_mode']})."]
    rows = {k: v for k, v in doc["connections"].items() if isinstance(v, dict)}
    if rows:
        lines += ["", "New TCP connections per second (connect, name line, reset):", "",
                  "| through | connections/s | / direct | connect p50 µs | connect p99 µs |"
                  " connect p99.9 µs |", "|---|---:|---:|---:|---:|---:|"]
        for name, row in rows.items():
            if "cps" not in row:
                lines.append(f"| {name} | {row.get('unavailable', 'not measured')} "
                             "| | | | |")
                continue
            lat = row.get("latency_connect") or {}
            lines.append(f"| {name} | {_fmt(row['cps'])} | "
                         f"{_fmt(row.get('ratio_to_direct'), '.2f')} | "
                         f"{_fmt(lat.get('p50_us'), '.0f')} | {_fmt(lat.get('p99_us'), '.0f')} | "
                         f"{_fmt(lat.get('p999_us'), '.0f')} |")
    flags = []
    for name, sub in doc["subjects"].items():
        s = sub["search"]
        if s and s.get("line_rate_lossless"):
            flags.append(f"{name}: lossless at the generator's top; the NDR is a lower "
                         "bound" + (" (generator limited)" if s.get("generator_limited")
                                    else ""))
        elif s and not s.get("converged"):
            flags.append(f"{name}: the search ended on its trial budget before the "
                         "resolution")
    if flags:
        lines += ["", *[f"- {f}" for f in flags]]
    if doc["not_run"]:
        lines += ["", "Not run here:", ""]
        lines += [f"- {k}: {v.splitlines()[-1] if v else ''}" for k, v in doc["not_run"].items()]
    if doc.get("plots"):
        lines += ["", "Plots: " + ", ".join(f"[{p}]({p})" for p in doc["plots"])]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- progress


class TrialProgress:
    """A rich progress bar over the run's trials (a budget: a search may end
    early), describing the trial under way."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total = total
        self.enabled = enabled
        self._progress: Any = None
        self._task: Any = None

    def step(self, what: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=what)

    def done(self, what: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, advance=1, description=what)

    @contextmanager
    def shown(self) -> Iterator[TrialProgress]:
        if not self.enabled:
            yield self
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn()) as progress:
            self._progress = progress
            self._task = progress.add_task("starting", total=self.total)
            try:
                yield self
            finally:
                self._progress = None
