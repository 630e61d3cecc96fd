"""The bench runner's loop with a fake generator and fake subjects (no lab): a
subject that cannot run is reported, not fatal; a subject is stopped whatever
happens; the search reuses the round's line-rate trial; the CLI passes its options."""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from hpclb.lab import bench
from hpclb.lab.bench_report import BenchRecord, TrialProgress
from hpclb.lab.ndr import Trial
from hpclb.lab.subjects import Generator, Subject, SubjectUnavailable


class FakeGenerator:
    name = "fake"

    def __init__(self, knee: float, line: float = 500_000.0,
                 interrupt_after: int | None = None) -> None:
        self.knee = knee
        self.line_rate_pps = line
        self.asked: list[float | None] = []
        self.aimed: list[str] = []
        self.interrupt_after = interrupt_after

    def aim(self, vip: str) -> None:
        self.aimed.append(vip)

    def trial(self, rate_pps: float | None, seconds: float) -> Trial:
        if self.interrupt_after is not None and len(self.asked) >= self.interrupt_after:
            raise KeyboardInterrupt
        self.asked.append(rate_pps)
        rate = self.line_rate_pps if rate_pps is None else rate_pps
        offered = int(rate * seconds)
        forwarded = offered if rate <= self.knee else int(self.knee * seconds)
        return Trial(offered / seconds, forwarded / seconds, offered, forwarded, seconds,
                     rate_pps)

    def conditions(self) -> dict[str, Any]:
        return {"decoupled": True}

    def close(self) -> None:
        pass


class FakeSubject:
    def __init__(self, name: str, unavailable: str | None = None,
                 measures: tuple[str, ...] = ("pps",)) -> None:
        self.name = name
        self.vip = "198.18.1.10"
        self.unavailable = unavailable
        self.measures = measures
        self.started = 0
        self.stopped = 0

    def start(self) -> None:
        if self.unavailable:
            raise SubjectUnavailable(self.unavailable)
        self.started += 1

    def stop(self) -> None:
        self.stopped += 1

    def conditions(self) -> dict[str, Any]:
        return {"fake": True}


def _round(gen: FakeGenerator, subject: FakeSubject, record: BenchRecord, n: int = 0,
           steps: int = 8) -> None:
    bench._round(None, gen, subject, record, TrialProgress(0, enabled=False),  # type: ignore[arg-type]
                 n=n, seconds=1.0, ndr_steps=steps, pdr_loss=0.005, resolution=0.01,
                 frame=b"", costs=False)


def test_protocols_are_met_by_the_fakes() -> None:
    assert isinstance(FakeGenerator(1), Generator)
    assert isinstance(FakeSubject("x"), Subject)


def test_first_round_searches_from_its_line_rate_trial() -> None:
    gen, subject, record = FakeGenerator(knee=300_000), FakeSubject("xdp"), BenchRecord({})
    _round(gen, subject, record)
    rec = record.subjects["xdp"]
    assert rec.search is not None and rec.samples
    # The line-rate sample is the search's first trial, not a second run of it.
    assert rec.search.trials[0] is rec.samples[0] and gen.asked.count(None) == 1
    assert rec.search.ndr_offered_pps is not None
    assert 290_000 <= rec.search.ndr_offered_pps <= 300_000
    assert len(gen.asked) == 9 and subject.started == subject.stopped == 1
    assert gen.aimed == ["198.18.1.10"]
    # Later rounds: one line-rate sample each, no search.
    _round(gen, subject, record, n=1)
    assert len(rec.samples) == 2 and len(gen.asked) == 10


def test_unavailable_subject_is_reported_not_fatal() -> None:
    gen, record = FakeGenerator(knee=1), BenchRecord({})
    _round(gen, FakeSubject("ipvs", unavailable="no ip_vs module"), record)
    assert record.not_run == {"ipvs": "no ip_vs module"} and gen.asked == []


def test_connection_only_subject_gets_no_packet_trials() -> None:
    gen, record = FakeGenerator(knee=1), BenchRecord({})
    subject = FakeSubject("haproxy_tcp", measures=("cps",))
    _round(gen, subject, record)
    assert gen.asked == [] and subject.stopped == 1


def test_interrupted_trial_still_stops_the_subject() -> None:
    gen, subject, record = FakeGenerator(knee=300_000, interrupt_after=3), FakeSubject("xdp"), \
        BenchRecord({})
    with pytest.raises(KeyboardInterrupt):
        _round(gen, subject, record)
    assert subject.stopped == 1
    assert record.subjects["xdp"].samples  # what was measured before is kept


def test_lazy_and_call_with() -> None:
    fn, why = bench.lazy("hpclb.lab.no_such_module", "x")
    assert fn is None and why is not None and "not in this tree" in why
    fn, why = bench.lazy("hpclb.lab.ndr", "no_such_name")
    assert fn is None and why is not None
    fn, why = bench.lazy("hpclb.lab.ndr", "search_rates")
    assert fn is not None and why is None

    def takes(lab: int, repeat: int = 0) -> tuple[int, int]:
        return lab, repeat
    assert bench.call_with(takes, lab=1, repeat=2, flows=3) == (1, 2)


def test_trex_generator_missing_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "hpclb.lab.trex", types.ModuleType("hpclb.lab.trex"))
    with pytest.raises(SubjectUnavailable, match="TrexGenerator"):
        bench.make_generator("trex", None, Path("/tmp"), 10, coupled=False,  # type: ignore[arg-type]
                             trex_server=None, trex_dir=None, latency=True)


def _parse(argv: list[str]) -> argparse.Namespace:
    from hpclb.lab.commands import add_lab_commands

    parser = argparse.ArgumentParser()
    add_lab_commands(parser.add_subparsers())
    return parser.parse_args(argv)


def test_cli_passes_the_bench_options(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def fake_run_bench(**kwargs: Any) -> int:
        seen.update(kwargs)
        return 0
    monkeypatch.setattr(bench, "run_bench", fake_run_bench)
    monkeypatch.setenv("HPCLB_TREX_DIR", "/opt/trex")
    args = _parse(["bench", "--generator", "trex", "--peers", "reflect,xdp,nftables_dnat",
                   "--pdr-loss", "0.01", "--coupled", "--no-latency", "--seconds", "2"])
    assert args.func(args) == 0
    assert seen["generator"] == "trex" and seen["trex_dir"] == Path("/opt/trex")
    assert seen["peers"] == ("reflect", "xdp", "nftables_dnat")
    assert seen["pdr_loss"] == 0.01 and seen["coupled"] and seen["latency"] is False
    args = _parse(["bench", "--peers", "xdp,bogus"])
    with pytest.raises(SystemExit, match="bogus"):
        args.func(args)
    args = _parse(["bench", "--trex-server", "10.0.0.1"])
    with pytest.raises(SystemExit, match="--generator trex"):
        args.func(args)


def test_cli_bench_control(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    module = types.ModuleType("hpclb.lab.control_bench")

    def run_control_bench(out: Path, quick: bool = False, progress: bool = True,
                          **overrides: Any) -> int:
        seen.update(out=out, quick=quick, progress=progress, **overrides)
        if overrides.get("parts") == ["bogus"]:
            raise ValueError("parts: ['bogus'] not among maglev, slots")
        return 0
    module.run_control_bench = run_control_bench  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "hpclb.lab.control_bench", module)
    args = _parse(["bench", "control", "--quick", "--out", "/tmp/c.json"])
    assert args.func(args) == 0
    assert seen == {"out": Path("/tmp/c.json"), "quick": True, "progress": True,
                    "parts": None, "sizes": None}
    seen.clear()
    args = _parse(["bench", "control", "--parts", "maglev, slots", "--sizes", "10,100"])
    assert args.func(args) == 0
    assert seen["parts"] == ["maglev", "slots"] and seen["sizes"] == [10, 100]
    # A bad option is a clear CLI error, not a traceback.
    with pytest.raises(SystemExit, match="bogus"):
        args = _parse(["bench", "control", "--parts", "bogus"])
        args.func(args)
    with pytest.raises(SystemExit, match="invalid literal"):
        args = _parse(["bench", "control", "--sizes", "ten"])
        args.func(args)
