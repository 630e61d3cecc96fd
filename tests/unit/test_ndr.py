"""The RFC 2544 style search finds a path's loss knee from synthetic and recorded
trial series: no lab, no generator, no timing."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable

import pytest

from hpclb.lab.ndr import SearchResult, Trial, search_rates

SECONDS = 10.0


def path(knee: float, *, gen_top: float = 1e9, pdr_knee: float | None = None,
         offered_noise: float = 0.0, seed: int = 1) -> Callable[[float], Trial]:
    """A path lossless up to ``knee`` pps and lossy above: loss grows linearly from
    0.1% just above the knee to 0.5% at ``pdr_knee`` (and on). The generator offers
    what it is asked for up to ``gen_top``, off by up to ``offered_noise`` (a share)."""
    rng = random.Random(seed)
    pdr_knee = pdr_knee or knee * 1.1

    def trial(asked: float) -> Trial:
        rate = min(asked, gen_top) * (1 + rng.uniform(-offered_noise, offered_noise))
        if rate <= knee:
            loss = 0.0
        else:
            loss = 0.001 + 0.004 * (rate - knee) / (pdr_knee - knee)
        offered = int(rate * SECONDS)
        forwarded = offered - int(offered * loss)
        return Trial(offered_pps=offered / SECONDS, forwarded_pps=forwarded / SECONDS,
                     offered=offered, forwarded=forwarded, seconds=SECONDS, rate_pps=asked)
    return trial


def recorded(points: list[tuple[float, float]]) -> Callable[[float], Trial]:
    """Replays measured (offered pps, loss ratio) points, the loss interpolated
    linearly between them (lossless below the first)."""
    def trial(asked: float) -> Trial:
        loss = 0.0
        for (r0, l0), (r1, l1) in itertools.pairwise(points):
            if r0 <= asked <= r1:
                loss = l0 + (l1 - l0) * (asked - r0) / (r1 - r0)
        if asked > points[-1][0]:
            loss = points[-1][1]
        offered = int(asked * SECONDS)
        forwarded = offered - round(offered * loss)
        return Trial(offered / SECONDS, forwarded / SECONDS, offered, forwarded, SECONDS, asked)
    return trial


def test_knee_at_300k_found_by_a_search() -> None:
    res = search_rates(path(300_000), 1_000_000, resolution=0.01, max_trials=20)
    assert len(res.trials) > 2  # not one full-speed sample: a search
    assert res.trials[0].rate_pps == 1_000_000
    assert res.ndr_offered_pps is not None and 297_000 <= res.ndr_offered_pps <= 300_000
    assert res.ndr_pps is not None and res.ndr_pps <= 300_000
    # PDR (loss <= 0.5%): at 330k with the default path
    assert res.pdr_offered_pps is not None and 326_000 <= res.pdr_offered_pps <= 330_000
    assert res.converged and not res.generator_limited and not res.line_rate_lossless
    # Every trial below the reported NDR's rate passed, every one above it failed.
    for t in res.trials:
        assert (t.loss_ratio == 0) == (t.offered_pps <= res.ndr_offered_pps)


def test_one_series_informs_both_bounds() -> None:
    """The PDR needs no trials of its own when the NDR's already bracket it."""
    res = search_rates(path(300_000, pdr_knee=300_001), 1_000_000, max_trials=30)
    separate = sum(1 for t in res.trials if t.loss_ratio)
    assert res.pdr_offered_pps is not None and res.ndr_offered_pps is not None
    assert res.pdr_offered_pps >= res.ndr_offered_pps
    assert len(res.trials) <= 1 + 2 * 8 and separate >= 1


def test_line_rate_already_lossless_is_one_trial() -> None:
    res = search_rates(path(2_000_000), 1_000_000)
    assert len(res.trials) == 1 and res.line_rate_lossless and res.converged
    assert res.ndr_pps == res.pdr_pps == 1_000_000


def test_generator_that_cannot_reach_the_asked_rate() -> None:
    """A generator that tops out at 400k when asked for 1M: the lossy first trial
    disproves 400k (what the path was offered), not 1M, and the knee is still found."""
    res = search_rates(path(300_000, gen_top=400_000), 1_000_000, max_trials=20)
    assert res.trials[0].offered_pps == 400_000
    assert res.ndr_offered_pps is not None and 297_000 <= res.ndr_offered_pps <= 300_000
    # Binary search from 400k, not from 1M: the second trial asks for 200k.
    assert res.trials[1].rate_pps == pytest.approx(200_000)
    assert not res.generator_limited


def test_generator_below_the_knee_is_generator_limited() -> None:
    res = search_rates(path(300_000, gen_top=250_000), 1_000_000)
    assert res.line_rate_lossless and res.generator_limited
    assert res.ndr_pps == 250_000  # what was forwarded, not what was asked


def test_noisy_offered_rates_still_find_the_knee() -> None:
    for seed in range(20):
        res = search_rates(path(300_000, offered_noise=0.03, seed=seed), 1_000_000,
                           max_trials=16)
        assert res.ndr_offered_pps is not None
        assert 280_000 <= res.ndr_offered_pps <= 300_000, (seed, res.ndr_offered_pps)
        assert res.ndr_pps is not None and res.ndr_pps <= 300_000


def test_stray_sink_frame_is_no_negative_loss() -> None:
    t = Trial(offered_pps=10, forwarded_pps=11, offered=100, forwarded=101, seconds=10,
              rate_pps=None)
    assert t.loss_ratio == 0 and t.lost == 0
    assert Trial(0, 0, 0, 0, 1, None).loss_ratio == 0


def test_nothing_passes() -> None:
    def lossy(asked: float) -> Trial:
        n = int(asked)
        return Trial(asked, asked / 2, n, n // 2, 1.0, asked)
    res = search_rates(lossy, 100_000, max_trials=6)
    assert res.ndr_pps is None and res.pdr_pps is None and len(res.trials) == 6


def test_generator_sent_nothing_proves_nothing() -> None:
    calls = []

    def broken(asked: float) -> Trial:
        calls.append(asked)
        return Trial(0, 0, 0, 0, 1.0, asked)
    res = search_rates(broken, 100_000, max_trials=4)
    assert res.ndr_pps is None and not res.line_rate_lossless


def test_recorded_trex_series() -> None:
    """The issue's TRex run: XDP lossless to 300k, 0.087% at 350k; DPDK lossless to
    150k, 0.5% at 200k, 28% at 250k. Replayed, the search lands on those knees."""
    xdp = search_rates(recorded([(300_000, 0.0), (350_000, 0.00087), (400_000, 0.02)]),
                       400_000, max_trials=14)
    assert xdp.ndr_offered_pps is not None and 297_000 <= xdp.ndr_offered_pps <= 300_500
    # 0.5% lies between 350k (0.087%) and 400k (2%)
    assert xdp.pdr_offered_pps is not None and 350_000 <= xdp.pdr_offered_pps <= 362_000
    dpdk = search_rates(recorded([(150_000, 0.0), (200_000, 0.005), (250_000, 0.28)]),
                        400_000, max_trials=14)
    assert dpdk.ndr_offered_pps is not None and 148_000 <= dpdk.ndr_offered_pps <= 150_500
    assert dpdk.pdr_offered_pps is not None and 196_000 <= dpdk.pdr_offered_pps <= 200_000


def test_max_trials_bounds_the_series_and_json_round_trips() -> None:
    res = search_rates(path(300_000), 1_000_000, resolution=1e-9, max_trials=5)
    assert len(res.trials) == 5 and not res.converged
    doc = json.loads(json.dumps(res.to_json()))
    assert len(doc["trials"]) == 5 and doc["ndr_pps"] == res.ndr_pps
    assert set(doc["trials"][0]) >= {"rate_asked_pps", "offered_pps", "forwarded_pps",
                                     "loss_ratio", "latency"}
    assert isinstance(res, SearchResult)


@pytest.mark.parametrize("bad", [{"line_rate_pps": 0}, {"pdr_loss": 1.0},
                                 {"max_trials": 0}])
def test_bad_arguments(bad: dict[str, float]) -> None:
    args: dict[str, float] = {"line_rate_pps": 1e6, **bad}
    line = args.pop("line_rate_pps")
    with pytest.raises(ValueError):
        search_rates(path(1), line, **args)  # type: ignore[arg-type]
