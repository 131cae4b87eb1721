"""Retry guidance for queue-full refusals (service/scheduling/pushback.py) on a fake clock: drain rate, virtual queue,
clamps, the trailer value."""

from __future__ import annotations

import pytest

from relserve.service.scheduling.pushback import DrainEstimate, pushback_ms


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_unknown_rate_gives_the_fallback_delay():
    est = DrainEstimate(clock=Clock())
    assert est.rate() is None
    assert est.retry_after(waiting=8, needed=1) == pytest.approx(0.05)


def test_delay_is_the_drain_time_of_the_queue_plus_the_request():
    est = DrainEstimate(clock=Clock(), retry_share=1.0)
    est.drained(10, 0.1)
    est.drained(30, 0.2)  # 40 units in 0.3 s
    assert est.rate() == pytest.approx(40 / 0.3)
    assert est.retry_after(waiting=8, needed=4) == pytest.approx(12 / (40 / 0.3))


def test_refusals_in_the_same_instant_are_spread_at_the_retry_share_of_the_drain_rate():
    clock = Clock()
    est = DrainEstimate(clock=clock)  # default retry_share 0.25
    est.drained(100, 1.0)  # 100 units/s: the queue of 8 drains in 80 ms, the refused come back 40 ms apart
    delays = [est.retry_after(waiting=8, needed=1) for _ in range(4)]
    assert delays == pytest.approx([0.12, 0.16, 0.20, 0.24])
    clock.t += 0.5  # everyone told to come back has had their turn: the virtual queue is empty again
    assert est.retry_after(waiting=8, needed=1) == pytest.approx(0.12)
    with pytest.raises(ValueError):
        DrainEstimate(retry_share=0.0)


def test_delay_is_clamped():
    est = DrainEstimate(clock=Clock(), min_s=0.01, max_s=2.0, retry_share=1.0)
    est.drained(1, 1.0)  # 1 unit/s
    assert est.retry_after(waiting=1000, needed=1) == 2.0
    assert est.retry_after(waiting=1000, needed=1) == 2.0  # the virtual queue does not run away past the cap
    fast = DrainEstimate(clock=Clock(), min_s=0.01, max_s=2.0)
    fast.drained(1_000_000, 1.0)
    assert fast.retry_after(waiting=1, needed=1) == 0.01


def test_rate_follows_the_recent_samples_only():
    est = DrainEstimate(clock=Clock(), samples=4)
    est.drained(1000, 1.0)
    for _ in range(4):
        est.drained(10, 1.0)  # the model got slower; the old sample has left the window
    assert est.rate() == pytest.approx(10.0)
    est.drained(0, 1.0)
    est.drained(5, 0.0)  # empty or instantaneous samples carry no rate
    assert est.rate() == pytest.approx(10.0)


def test_trailer_value_is_whole_milliseconds():
    assert pushback_ms(0.0234) == "23"
    assert pushback_ms(2.0) == "2000"
    assert pushback_ms(-1.0) == "0"  # a negative value would tell a gRFC A6 client not to retry at all


def test_full_queue_samples_are_preferred():
    """Small batches of a lightly used queue must not make the rate (and so the delays) look bad: once there
    are samples taken at a full queue, the rate is theirs."""
    est = DrainEstimate(clock=Clock())
    est.drained(1, 0.02)
    assert est.rate() == pytest.approx(50.0)  # nothing better known yet
    est.drained(8, 0.04, full=True)
    est.drained(2, 0.02)
    assert est.rate() == pytest.approx(200.0)
