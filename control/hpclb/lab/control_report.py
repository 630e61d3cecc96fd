"""The PNG plots and the Markdown summary of a `hpclb bench control` run
(:mod:`.control_bench` writes the JSON and calls these). matplotlib, Agg backend: no
display needed. A part that did not run (skipped, failed, interrupted) is left out of
the plots and says so in the summary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def plots(doc: dict[str, Any], files: dict[str, Path]) -> list[Path]:
    """Every plot ``doc`` has data for; the files written."""
    written = []
    for key, draw in (("maglev_build", _plot_build), ("slots", _plot_slots),
                      ("reaction", _plot_reaction)):
        if draw(doc, files[key]):
            written.append(files[key])
    return written


def _build_series(doc: dict[str, Any], fill: str) -> list[dict[str, Any]]:
    rows = (doc.get("maglev_build") or {}).get("rows", [])
    return [r for r in rows if r["fill"] == fill and "build_ms" in r]


def _plot_build(doc: dict[str, Any], path: Path) -> bool:
    series = {fill: _build_series(doc, fill) for fill in ("c", "python")}
    if not any(series.values()):
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = {"c": "C fill (controller's path)", "python": "Python fill"}
    for fill, rows in series.items():
        if not rows:
            continue
        n = [r["backends"] for r in rows]
        p50 = [r["build_ms"]["p50"] for r in rows]
        lo = [r["build_ms"]["p50"] - r["build_ms"]["min"] for r in rows]
        hi = [r["build_ms"]["max"] - r["build_ms"]["p50"] for r in rows]
        ax.errorbar(n, p50, yerr=[lo, hi], marker="o", capsize=3, label=labels[fill])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter("{x:g}")  # 40, not 4 x 10^1
    ax.set_xlabel("backends")
    ax.set_ylabel("ring build time, ms (median, min-max)")
    size = (doc.get("maglev_build") or {}).get("ring_size")
    ax.set_title(f"Maglev ring build, {size} slots")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _plot_slots(doc: dict[str, Any], path: Path) -> bool:
    rows = [r for r in (doc.get("slots") or {}).get("rows", []) if r.get("per_step")]
    if not rows:
        return False
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    top = 1
    for r in rows:
        steps = [s for s in r["per_step"] if s["min_slots"]]
        if not steps:
            continue
        left.scatter([s["min_slots"] for s in steps], [s["changed_slots"] for s in steps],
                     s=10, label=f"{r['backends']} backends")
        top = max(top, *(s["changed_slots"] for s in steps))
    left.plot([1, top], [1, top], color="grey", linestyle="--", label="minimum")
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("minimum slots to move")
    left.set_ylabel("slots changed")
    left.set_title("One weight step: slots changed vs minimum")
    left.legend(fontsize="small")
    left.grid(True, which="both", alpha=0.3)
    n = [r["backends"] for r in rows]
    for key, label in (("ratio", "all steps"), ("ratio_up", "increases"),
                       ("ratio_down", "decreases")):
        pts = [(b, r[key]["p50"]) for b, r in zip(n, rows, strict=True)
               if r[key]["p50"] is not None]
        if pts:
            left_n, p50 = zip(*pts, strict=True)
            right.plot(left_n, p50, marker="o", label=f"{label}, median")
    pts99 = [(b, r["ratio"]["p99"]) for b, r in zip(n, rows, strict=True)
             if r["ratio"]["p99"] is not None]
    if pts99:
        b99, p99 = zip(*pts99, strict=True)
        right.plot(b99, p99, marker="x", linestyle=":", label="all steps, p99")
    right.axhline(1.0, color="grey", linestyle="--")
    right.set_xscale("log")
    right.set_xlabel("backends")
    right.set_ylabel("slots changed / minimum")
    right.set_title("Ratio to the minimum by ring population")
    right.legend(fontsize="small")
    right.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _plot_reaction(doc: dict[str, Any], path: Path) -> bool:
    runs = (doc.get("reaction") or {}).get("runs") or []
    if not runs:
        return False
    run = runs[0]
    paced = [r["reaction_ms"] for r in run["paced"]["per_sample"]
             if r.get("reaction_ms") is not None]
    if not paced:
        return False
    plt = _pyplot()
    fig, (hist, parts) = plt.subplots(1, 2, figsize=(11, 4.5))
    hist.hist(paced, bins=min(50, max(5, len(paced) // 4)), color="tab:blue", alpha=0.8)
    for q, style in ((50, "-"), (99, "--")):
        value = run["paced"]["reaction_ms"][f"p{q}"]
        if value is not None:
            hist.axvline(value, color="black", linestyle=style, label=f"p{q} {value:.2f} ms")
    hist.set_xlabel("reaction time, ms (telemetry enqueued -> ring patch applied)")
    hist.set_ylabel("samples")
    hist.set_title(f"Reaction time, {run['backends']} backends, paced samples")
    hist.legend()
    hist.grid(True, alpha=0.3)
    breakdown = run["paced"]["breakdown_ms"]
    names = [k for k in ("queue_wait", "weights", "tables_for", "ring_build", "push",
                         "patch_rpc", "push_other") if breakdown.get(k, {}).get("n")]
    parts.barh(names, [breakdown[k]["p50"] for k in names], color="tab:orange",
               label="median")
    parts.barh(names, [breakdown[k]["p99"] - breakdown[k]["p50"] for k in names],
               left=[breakdown[k]["p50"] for k in names], color="tab:orange", alpha=0.35,
               label="to p99")
    parts.invert_yaxis()
    parts.set_xlabel("ms")
    parts.set_title("Where it goes (p50, bar to p99)")
    parts.legend()
    parts.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


# --- Markdown -------------------------------------------------------------------------------


def _f(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _not_run(doc: dict[str, Any], part: str, key: str) -> str | None:
    """Why a part has no figures, or None."""
    if part in doc.get("errors", {}):
        return f"failed: {doc['errors'][part]}"
    if part not in doc["conditions"]["options"]["parts"]:
        return "not selected"
    value = doc.get(key)
    if value is None:
        return "interrupted before it ran"
    if isinstance(value, dict) and value.get("skipped"):
        return f"skipped: {value['skipped']}"
    return None


def markdown(doc: dict[str, Any]) -> str:
    c = doc["conditions"]
    o = c["options"]
    out = [f"# hpclb bench control{' (quick)' if doc.get('quick') else ''}", "",
           f"{doc['when']}, kernel {c['kernel']}, {c['cpu_model']}, {c['cpus']} CPUs "
           f"({c['cpu_affinity']} usable), Python {c['python']}, commit {c['commit']}; "
           f"{doc.get('duration_s', '-')} s."]
    if doc.get("interrupted"):
        out += ["", "**Interrupted**: the figures below are what was measured before."]
    out += ["", "Benchmarks, not tests: indicative on a shared machine.", ""]

    out += ["## Maglev ring build", ""]
    why = _not_run(doc, "maglev", "maglev_build")
    if why:
        out += [why, ""]
    else:
        c_rows = {r["backends"]: r for r in _build_series(doc, "c")}
        py_rows = {r["backends"]: r for r in _build_series(doc, "python")}
        out += [f"{o['ring_size']:,} slots; median (min-max) ms of {o['build_repeats']} "
                f"builds (C, the controller's `pool_ring`) and {o['python_repeats']} "
                "(Python fill).", "",
                "| backends | C fill ms | Python fill ms | Python / C |", "|---:|---:|---:|---:|"]
        for n in sorted(set(c_rows) | set(py_rows)):
            cb = c_rows.get(n, {}).get("build_ms")
            pb = py_rows.get(n, {}).get("build_ms")
            ratio = pb["p50"] / cb["p50"] if cb and pb and cb["p50"] else None
            out.append(f"| {n:,} | {_cell(cb)} | {_cell(pb)} | {_f(ratio, 1)} |")
        skipped = [r for r in (doc["maglev_build"].get("rows") or []) if r.get("skipped")]
        if skipped:
            out.append(f"\nC fill: {skipped[0]['skipped']}")
        out.append("")

    out += ["## Slots moved by one weight step", ""]
    why = _not_run(doc, "slots", "slots")
    if why:
        out += [why, ""]
    else:
        out += [f"{o['slot_steps']} single-backend weight steps per size (cpu_load moved by "
                f">= {o['min_cpu_step']}, weight 0.625 - 0.4 cpu on the 1/256 grid), ring "
                "rebuilt each time; slots changed / minimum (sum over owners of the slots "
                "gained).", "",
                "| backends | changed p50 | minimum p50 | ratio p50 | ratio p99 | "
                "increases p50 | decreases p50 |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in doc["slots"]["rows"]:
            out.append(f"| {r['backends']:,} | {_f(r['changed_slots']['p50'], 0)} | "
                       f"{_f(r['min_slots']['p50'], 0)} | {_f(r['ratio']['p50'])} | "
                       f"{_f(r['ratio']['p99'])} | {_f(r['ratio_up']['p50'])} | "
                       f"{_f(r['ratio_down']['p50'])} |")
        out.append("")

    out += ["## Reaction time (telemetry -> data plane)", ""]
    why = _not_run(doc, "reaction", "reaction")
    runs = (doc.get("reaction") or {}).get("runs") or []
    if why or not runs:
        out += [why or ("interrupted before a run completed" if doc.get("interrupted")
                        else "no run completed"), ""]
    else:
        run = runs[0]
        r = run["paced"]["reaction_ms"]
        out += [f"{run['backends']:,} backends, ring {run['ring_size']:,}, hpclb-xdp "
                f"({run['dataplane'].get('attach_mode', '-')}), {r['n']} paced samples.", "",
                "| | p50 ms | p99 ms | max ms |", "|---|---:|---:|---:|",
                f"| reaction (paced) | {_f(r['p50'])} | {_f(r['p99'])} | {_f(r['max'])} |"]
        for k, v in run["paced"]["breakdown_ms"].items():
            if v["n"]:
                out.append(f"| {k} | {_f(v['p50'])} | {_f(v['p99'])} | {_f(v['max'])} |")
        if run.get("burst"):
            b = run["burst"]["reaction_ms"]
            out.append(f"| reaction (burst of {run['burst']['samples']}, "
                       f"{run['burst']['gap_ms']} ms apart, {run['burst']['pushes']} pushes) | "
                       f"{_f(b['p50'])} | {_f(b['p99'])} | {_f(b['max'])} |")
        s = run["paced"]["slots"]
        out += ["", "ring_build is part of tables_for, patch_rpc part of push; reaction "
                "= the push's return - the telemetry's enqueue by the receiver."]
        out += ["", f"Live slots patched / minimum: p50 {_f(s['ratio']['p50'])}, p99 "
                f"{_f(s['ratio']['p99'])}; the push report equals the ring diff: "
                f"{s['report_equals_diff']}.", ""]

    out += ["## Probe scale", ""]
    why = _not_run(doc, "probes", "probes")
    probes = doc.get("probes") or {}
    for kind, reason in (probes.get("skipped_kinds") or {}).items():
        out.append(f"{kind}: skipped, {reason}.")
    if why:
        out += [why, ""]
    elif probes.get("results"):
        pc = probes["conditions"]
        out += [f"{pc['endpoints']:,} endpoints every {pc['interval_s']} s, the prober "
                f"pinned to CPU {pc['prober_cpu']}, {pc['duration_s']} s measured.", "",
                "| kind | probes/s | CPU s/s | failed | send lag p50/p99 ms | "
                "interval dev p50/p99 ms |", "|---|---:|---:|---:|---:|---:|"]
        for r in probes["results"]:
            if "error" in r:
                out.append(f"| {r['kind']} | error: {r['error'][:80]} | | | | |")
                continue
            out.append(f"| {r['kind']} | {_f(r['probes_per_s'], 0)} | "
                       f"{_f(r['cpu_s_per_s'])} | {r['probes_failed']:,} | "
                       f"{_f(r['send_lag_ms']['p50'])} / {_f(r['send_lag_ms']['p99'])} | "
                       f"{_f(r['interval_deviation_ms']['p50'])} / "
                       f"{_f(r['interval_deviation_ms']['p99'])} |")
        out.append("")

    out += ["## Configuration load", ""]
    why = _not_run(doc, "config", "config_load")
    if why:
        out += [why, ""]
    else:
        out += ["| scenario | bytes | median s | peak RSS MB | accepted |",
                "|---|---:|---:|---:|---|"]
        for r in doc["config_load"]["results"]:
            out.append(f"| {r['scenario']} | {r['file_bytes']:,} | {_f(r['seconds_median'], 3)} "
                       f"| {_f(r['peak_rss_mb'], 1)} | {r['accepted']} |")
        out.append("")

    if doc.get("files", {}).get("plots"):
        out += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})"
                                   for p in doc["files"]["plots"]] + [""]
    return "\n".join(out)


def _cell(b: dict[str, Any] | None) -> str:
    if not b:
        return "-"
    return f"{_f(b['p50'])} ({_f(b['min'])}-{_f(b['max'])})"
