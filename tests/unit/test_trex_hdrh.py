"""TRex's HDR histogram (``--hdrh``: hdr_log_encode, µs) decodes to the right
min/avg/max and percentiles; a packet group's latency becomes Trial.latency."""

from __future__ import annotations

import pytest
from hdrh.histogram import HdrHistogram

from hpclb.lab.trex import decode_hdrh, latency_summary


def _encoded(values: dict[int, int]) -> str:
    # TRex's server: 1 µs .. 10 s, 3 significant digits (src/time_histogram.cpp).
    h = HdrHistogram(1, 10_000_000, 3)
    for value, count in values.items():
        h.record_value(value, count)
    return h.encode().decode()


def test_percentiles_of_a_known_distribution() -> None:
    # 1..1000 µs once each: p50 = 500, p99 = 990, p99.9 = 999.
    got = decode_hdrh(_encoded(dict.fromkeys(range(1, 1001), 1)))
    assert got["min_us"] == 1 and got["max_us"] == 1000
    assert got["p50_us"] == 500 and got["p99_us"] == 990 and got["p999_us"] == 999
    assert got["avg_us"] == pytest.approx(500.5)
    assert got["count"] == 1000


def test_a_long_tail_shows_in_p99_9_only() -> None:
    # 9,990 frames at 20 µs, 10 at 5,000 µs: p50 and p99 are 20, p99.9 is the tail's
    # bucket (3 significant digits: within 0.1 %).
    got = decode_hdrh(_encoded({20: 9990, 5000: 10}))
    assert got["p50_us"] == 20 and got["p99_us"] == 20
    assert got["p999_us"] == 20  # 99.9 % of 10,000 = 9,990 frames, all at 20 µs
    got = decode_hdrh(_encoded({20: 9980, 5000: 20}))
    assert got["p999_us"] == pytest.approx(5000, rel=1e-3)
    assert got["max_us"] == pytest.approx(5000, rel=1e-3)


def test_empty_histogram_is_no_latency() -> None:
    assert decode_hdrh(_encoded({})) == {}
    assert latency_summary({"latency": {"hdrh": _encoded({}), "total_min": "N/A",
                                        "average": 0, "total_max": 0}}) is None


def test_summary_takes_trex_average_and_falls_back_without_hdrh() -> None:
    pg = {"latency": {"hdrh": _encoded({10: 50, 30: 50}), "average": 19.7,
                      "total_min": 10, "total_max": 30},
          "err_cntrs": {"dropped": 0}}
    got = latency_summary(pg)
    assert got is not None
    assert got["avg_us"] == 19.7  # TRex's exact average, not the buckets'
    assert got["p50_us"] == 10 and got["p99_us"] == 30
    # A server started without --hdrh: TRex's own min/avg/max only.
    got = latency_summary({"latency": {"total_min": 8.0, "average": 12.5,
                                       "total_max": 40.0}})
    assert got == {"min_us": 8.0, "avg_us": 12.5, "max_us": 40.0}
