"""A short TRex run against the lab: fixed rates through the reflector and hpclb's
XDP (and DPDK) data plane, the latency stream beside; a Markdown table and a JSON file.

    sudo HPCLB_TREX_DIR=/opt/trex-src .venv/bin/python perf/trex/lab_run.py \
        --rates 50000,100000,200000 --seconds 5 --out results/trex_lab.json

What `perf/trex/README.md`'s table comes from. A measurement, never a test; the full
NDR/PDR search is `hpclb bench --generator trex`.
"""

from __future__ import annotations

import argparse
import json
import platform
import secrets
import sys
import tempfile
from pathlib import Path
from typing import Any

from hpclb.lab.subjects import ApplianceSubject, ReflectSubject, SubjectUnavailable, cpu_model
from hpclb.lab.topology import Lab
from hpclb.lab.trex import TrexGenerator, available


def _row(subject: str, t: Any) -> str:
    lat = t.latency or {}
    asked = "full" if t.rate_pps is None else f"{t.rate_pps:,.0f}"

    def us(key: str) -> str:
        return f"{lat[key]:.0f}" if key in lat else "-"

    return (f"| {subject} | {asked} | {t.offered_pps:,.0f} | {t.forwarded_pps:,.0f} | "
            f"{t.loss_ratio * 100:.3f} | {us('min_us')} | {us('avg_us')} | {us('p50_us')} | "
            f"{us('p99_us')} | {us('p999_us')} | {us('max_us')} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="50000,100000,200000,300000",
                    help="pps, comma separated; 'full' for as fast as TRex goes")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--flows", type=int, default=50000)
    ap.add_argument("--profile", default="udp64")
    ap.add_argument("--subjects", default="reflect,xdp", help="reflect, xdp, dpdk")
    ap.add_argument("--trex-dir", default=None)
    ap.add_argument("--no-decouple", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("results/trex_lab.json"))
    args = ap.parse_args(argv)
    if (why := available(args.trex_dir)) is not None:
        print(why, file=sys.stderr)
        return 2
    rates: list[float | None] = [None if r == "full" else float(r)
                                 for r in args.rates.split(",")]
    report: dict[str, Any] = {"trials": {}, "skipped": {}}
    lines = ["| subject | asked pps | offered pps | forwarded pps | loss % | min µs | "
             "avg µs | p50 µs | p99 µs | p99.9 µs | max µs |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory(prefix="hpclb-trex-run-") as tmp, \
            Lab(prefix="tr" + secrets.token_hex(3), backends=3) as lab:
        work = Path(tmp)
        subjects: list[Any] = []
        for name in args.subjects.split(","):
            subjects.append(ReflectSubject(lab) if name == "reflect"
                            else ApplianceSubject(lab, work, name, name))
        with TrexGenerator(lab, work, trex_dir=args.trex_dir, flows=args.flows,
                           profile=args.profile, decoupled=not args.no_decouple) as gen:
            for subject in subjects:
                try:
                    subject.start()
                except SubjectUnavailable as err:
                    report["skipped"][subject.name] = str(err)
                    continue
                try:
                    rows = report["trials"][subject.name] = []
                    for rate in rates:
                        t = gen.trial(rate, args.seconds)
                        rows.append(t.to_json())
                        lines.append(_row(subject.name, t))
                        print(lines[-1], flush=True)
                finally:
                    subject.stop()
            report["conditions"] = {
                **gen.conditions(), "kernel": platform.release(), "cpu": cpu_model(),
                "seconds_per_trial": args.seconds,
                "subjects": {s.name: s.conditions() for s in subjects},
            }
    report["table"] = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print("\n".join(lines))
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
