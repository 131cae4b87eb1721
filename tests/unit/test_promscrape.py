"""Histogram quantiles over a scrape window (loadtest/promscrape.py), on Prometheus text built here."""

from __future__ import annotations

import pytest

from relserve.loadtest.promscrape import histogram_quantile, parse


def _histogram(counts: dict[str, int], model: str = "m") -> str:
    lines = ["# TYPE relserve_x_seconds histogram"]
    for le, n in counts.items():
        lines.append(f'relserve_x_seconds_bucket{{le="{le}",model="{model}",task="t"}} {n}')
    lines.append(f'relserve_x_seconds_count{{model="{model}",task="t"}} {counts["+Inf"]}')
    return "\n".join(lines) + "\n"


def test_quantile_interpolates_within_the_bucket_of_the_window():
    before = parse(_histogram({"0.001": 10, "0.01": 10, "0.1": 10, "+Inf": 10}))
    # in the window: 50 observations <= 1 ms, 40 in (1 ms, 10 ms], 10 in (10 ms, 100 ms]
    after = parse(_histogram({"0.001": 60, "0.01": 100, "0.1": 110, "+Inf": 110}))
    assert histogram_quantile(before, after, "relserve_x_seconds", 0.5, model="m") == pytest.approx(0.001)
    assert histogram_quantile(before, after, "relserve_x_seconds", 0.7, model="m") == pytest.approx(
        0.001 + 0.009 * (20 / 40))
    assert histogram_quantile(before, after, "relserve_x_seconds", 0.99, model="m") == pytest.approx(
        0.01 + 0.09 * (9 / 10))


def test_quantile_in_the_inf_bucket_and_of_an_empty_window():
    before = parse(_histogram({"0.001": 0, "0.01": 0, "+Inf": 0}))
    after = parse(_histogram({"0.001": 0, "0.01": 1, "+Inf": 5}))
    assert histogram_quantile(before, after, "relserve_x_seconds", 0.99, model="m") == 0.01
    assert histogram_quantile(after, after, "relserve_x_seconds", 0.5, model="m") is None
    assert histogram_quantile(before, after, "relserve_x_seconds", 0.5, model="other") is None
