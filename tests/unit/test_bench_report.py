"""What a bench run writes (JSON, Markdown, PNGs) from recorded trials: no lab."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpclb.lab.bench_report import BenchRecord, markdown, write_all
from hpclb.lab.ndr import Trial, search_rates


def _path(knee: float, latency: bool = False):  # type: ignore[no-untyped-def]
    def trial(rate: float) -> Trial:
        offered = int(rate)
        forwarded = offered if rate <= knee else int(knee)
        lat = ({"min_us": 5.0, "avg_us": 9.0, "max_us": 90.0, "p50_us": 8.0,
                "p99_us": 20.0 + rate / 1e4, "p999_us": 40.0 + rate / 1e4}
               if latency else None)
        return Trial(float(offered), float(forwarded), offered, forwarded, 1.0, rate, lat)
    return trial


def _record(interrupted: bool = False, latency: bool = False) -> BenchRecord:
    rec = BenchRecord(conditions={"kernel": "6.18", "cpu_model": "test", "cores": 2,
                                  "seconds_per_trial": 1.0, "pdr_loss": 0.005,
                                  "generator": {"name": "trafgen", "flows": 100,
                                                "frame_bytes": 64, "mode": "decoupled"}})
    for name, knee, line in (("reflect", 400_000, 500_000), ("xdp", 380_000, 480_000),
                             ("nftables_dnat", 100_000, 200_000)):
        sub = rec.subject(name, {"what": name})
        res = search_rates(_path(knee, latency), line, max_trials=10)
        sub.search = res
        sub.samples.append(res.trials[0])
        sub.samples.append(_path(knee)(line))
    rec.not_run["ipvs"] = "this kernel has no IPVS"
    rec.connections = {"direct": {"cps": 9000.0, "latency_connect": {"p50_us": 80.0}},
                       "haproxy_tcp": {"cps": 4500.0, "ratio_to_direct": 0.5},
                       "dpdk": {"unavailable": "no hugepages"}}
    rec.interrupted = interrupted
    return rec


def test_json_md_and_plots_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "res" / "bench.json"
    paths = write_all(_record(latency=True), out)
    doc = json.loads(out.read_text())
    assert doc["interrupted"] is False
    assert set(doc["subjects"]) == {"reflect", "xdp", "nftables_dnat"}
    # every trial of every subject, search and samples
    assert len(doc["subjects"]["xdp"]["search"]["trials"]) > 2
    assert len(doc["subjects"]["xdp"]["samples"]) == 2
    assert doc["ratio_to_reflect"]["xdp"]["ndr"] == pytest.approx(380_000 / 400_000, rel=0.02)
    assert doc["ratio_to_nftables"]["xdp"]["ndr"] == pytest.approx(3.8, rel=0.02)
    # 1/pps(subject) - 1/pps(reflector), ns, from the median line-rate forwarding
    med = doc["median_forwarded_pps"]
    assert doc["marginal_ns_per_packet"]["xdp"] == pytest.approx(
        1e9 / med["xdp"] - 1e9 / med["reflect"])
    assert doc["latency"]["xdp"]["p99_us"] > 0
    pngs = [p for p in paths if p.suffix == ".png"]
    # offered vs forwarded per subject, and latency per subject (it has some)
    assert {p.name for p in pngs} >= {"bench-xdp.png", "bench-xdp-latency.png",
                                      "bench-reflect.png"}
    for p in pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert doc["plots"] == [p.name for p in pngs]
    md = (tmp_path / "res" / "bench.md").read_text()
    assert "| xdp |" in md and "NDR pps" in md and "p99.9" in md
    assert "haproxy_tcp" in md and "no hugepages" in md and "ipvs" in md


def test_interrupted_run_says_so(tmp_path: Path) -> None:
    rec = _record(interrupted=True)
    rec.subjects["xdp"].search = None  # stopped before its search
    write_all(rec, tmp_path / "b.json")
    doc = json.loads((tmp_path / "b.json").read_text())
    assert doc["interrupted"] is True and doc["subjects"]["xdp"]["search"] is None
    assert "xdp" not in doc["ndr_pps"]
    assert "Interrupted" in (tmp_path / "b.md").read_text()


def test_markdown_flags_a_lossless_line_rate() -> None:
    rec = BenchRecord(conditions={"generator": {}})
    sub = rec.subject("reflect")
    sub.search = search_rates(_path(10e6), 100_000)
    text = markdown(rec.to_json())
    assert "lower bound" in text
