"""Dynamic batcher driven by fake backends (no model, no torch): limits, C11, deadlines, cancellation,
queue bounds and failure isolation."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest

from relserve.service.scheduling.batcher import Batcher
from relserve.service.errors import DeadlineExceeded, Internal, InvalidArgument, ResourceExhausted


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


class FakeBackend:
    """Records every batch; returns ``payload * 2`` per item; optional delay per batch."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.batches: list[list] = []

    def __call__(self, payloads):
        self.batches.append(list(payloads))
        if self.delay:
            time.sleep(self.delay)
        return [self.result(p) for p in payloads]

    def result(self, p):
        return p * 2 if isinstance(p, (int, float)) else p

    @property
    def seen(self):
        return [p for b in self.batches for p in b]


class RaisingBackend(FakeBackend):
    def __call__(self, payloads):
        self.batches.append(list(payloads))
        if "boom" in payloads:
            raise RuntimeError("kernel exploded")
        if "bad-input" in payloads:
            raise InvalidArgument("backend rejected the batch")
        return list(payloads)


class HangingBackend(FakeBackend):
    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def __call__(self, payloads):
        self.batches.append(list(payloads))
        self.release.wait(10)
        return list(payloads)


def make(backend, **kw) -> Batcher:
    kw.setdefault("max_queue_delay", 0.0)
    b = Batcher("fake", backend, **kw)
    b.start()
    return b


def test_batch_size_limit_respected():
    async def main():
        be = FakeBackend()
        b = make(be, max_batch_size=4)
        units = await b.run([(5, i) for i in range(10)])
        await b.close()
        return be, [u.result for u in units]

    be, results = run(main())
    assert results == [i * 2 for i in range(10)]
    assert all(len(batch) <= 4 for batch in be.batches)
    assert sorted(be.seen) == list(range(10))


def test_padded_token_budget_respected():
    lengths = [10, 50, 50, 10, 30, 45, 5, 20]

    async def main():
        be = FakeBackend()
        b = make(be, max_batch_size=32, max_batch_tokens=100)
        await b.run([(n, n) for n in lengths])
        await b.close()
        return be

    be = run(main())
    for batch in be.batches:
        assert len(batch) * max(batch) <= 100, batch  # padded tokens = size x longest
    assert sorted(be.seen) == sorted(lengths)


def test_unpadded_budget_counts_real_tokens():
    async def main():
        be = FakeBackend()
        b = make(be, max_batch_size=32, max_batch_tokens=100, is_padded=False)
        await b.run([(n, n) for n in [60, 10, 10, 10, 10]])
        await b.close()
        return be

    be = run(main())
    assert all(sum(batch) <= 100 for batch in be.batches)
    assert sorted(be.batches[0]) == [10, 10, 10, 10, 60]


def test_unit_longer_than_budget_still_runs_alone():
    async def main():
        be = FakeBackend()
        b = make(be, max_batch_tokens=64)
        units = await b.run([(200, 1), (10, 2)])
        await b.close()
        return be, [u.result for u in units]

    be, results = run(main())
    assert results == [2, 4]
    assert be.batches == [[1], [2]]


def test_similar_lengths_batched_together():
    lengths = [10, 200, 12, 190, 11, 205]

    async def main():
        be = FakeBackend()
        b = make(be, max_batch_size=3, max_batch_tokens=100_000)
        await b.run([(n, n) for n in lengths])
        await b.close()
        return be

    be = run(main())
    assert sorted(map(sorted, be.batches)) == [[10, 11, 12], [190, 200, 205]]


def test_case_C11_zero_queue_delay_still_batches():
    async def main():
        be = FakeBackend(delay=0.3)
        b = make(be, max_queue_delay=0.0, max_batch_size=32)
        first = asyncio.create_task(b.run([(8, 100)]))
        while not be.batches:  # the first batch is running
            await asyncio.sleep(0.005)
        five = [asyncio.create_task(b.run([(8, i)])) for i in range(5)]
        results = await asyncio.gather(first, *five)
        await b.close()
        return be, b, results

    be, b, results = run(main())
    assert [r[0].result for r in results] == [200, 0, 2, 4, 6, 8]
    assert b.executions <= 2, be.batches
    assert sorted(be.batches[-1]) == [0, 1, 2, 3, 4]


def test_queue_delay_waits_for_company():
    async def main():
        be = FakeBackend()
        b = make(be, max_queue_delay=0.2, max_batch_size=8)
        tasks = []
        for i in range(3):
            tasks.append(asyncio.create_task(b.run([(8, i)])))
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        await b.close()
        return be

    be = run(main())
    assert len(be.batches) == 1 and sorted(be.batches[0]) == [0, 1, 2]


def test_queue_delay_ends_early_when_batch_is_full():
    async def main():
        be = FakeBackend()
        b = make(be, max_queue_delay=5.0, max_batch_size=2)
        t0 = time.monotonic()
        await b.run([(8, 1), (8, 2)])
        elapsed = time.monotonic() - t0
        await b.close()
        return elapsed

    assert run(main()) < 1.0


def test_expired_deadline_dropped_before_compute():
    async def main():
        be = FakeBackend(delay=0.3)
        b = make(be)
        first = asyncio.create_task(b.run([(8, 1)]))
        while not be.batches:
            await asyncio.sleep(0.005)
        late = asyncio.create_task(b.run([(8, 99)], deadline=time.monotonic() + 0.05))
        with pytest.raises(DeadlineExceeded) as err:
            await late
        await first
        await asyncio.sleep(0.05)
        await b.close()
        return be, str(err.value)

    be, message = run(main())
    assert 99 not in be.seen  # never computed
    assert "deadline" in message and "fake" in message


def test_deadline_already_passed_is_refused():
    async def main():
        b = make(FakeBackend())
        try:
            with pytest.raises(DeadlineExceeded):
                b.submit([(8, 1)], deadline=time.monotonic() - 1)
        finally:
            await b.close()

    run(main())


def test_cancelled_request_leaves_the_queue():
    async def main():
        be = FakeBackend(delay=0.3)
        b = make(be)
        first = asyncio.create_task(b.run([(8, 1)]))
        while not be.batches:
            await asyncio.sleep(0.005)
        victim = asyncio.create_task(b.run([(8, 50), (8, 51)]))
        await asyncio.sleep(0.02)
        assert b.queue_depth == 2
        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        assert b.queue_depth == 0
        await first
        await asyncio.sleep(0.05)
        await b.close()
        return be

    be = run(main())
    assert 50 not in be.seen and 51 not in be.seen


def test_queue_full_raises_resource_exhausted_naming_limit():
    async def main():
        be = FakeBackend(delay=0.3)
        b = make(be, max_queue_size=3)
        first = asyncio.create_task(b.run([(8, 1)]))
        while not be.batches:
            await asyncio.sleep(0.005)
        waiting = asyncio.create_task(b.run([(8, 2), (8, 3), (8, 4)]))
        await asyncio.sleep(0)
        with pytest.raises(ResourceExhausted) as err:
            await b.run([(8, 5)])
        with pytest.raises(ResourceExhausted) as too_big:
            await b.run([(8, i) for i in range(4)])
        await asyncio.gather(first, waiting)
        await b.close()
        return str(err.value), str(too_big.value)

    full, too_big = run(main())
    assert "max_queue_size is 3" in full
    assert "max_queue_size 3" in too_big


def test_failing_batch_fails_only_its_members():
    async def main():
        be = RaisingBackend()
        b = make(be, max_batch_size=2, bucket_width=1)
        # lengths keep "boom" and "x" in one batch, "a"/"b" in the other
        bad = asyncio.create_task(b.run([(8, "x"), (8, "boom")]))
        good = asyncio.create_task(b.run([(100, "a"), (100, "b")]))
        results = await asyncio.gather(bad, good, return_exceptions=True)
        await b.close()
        return be, results

    be, (bad, good) = run(main())
    assert isinstance(bad, Internal) and "kernel exploded" in str(bad)
    assert [u.result for u in good] == ["a", "b"]
    assert sorted(map(sorted, be.batches)) == [["a", "b"], ["boom", "x"]]


def test_domain_error_from_backend_kept():
    async def main():
        b = make(RaisingBackend())
        try:
            with pytest.raises(InvalidArgument, match="rejected"):
                await b.run([(8, "bad-input")])
            units = await b.run([(8, "fine")])  # the worker survives
            return units[0].result
        finally:
            await b.close()

    assert run(main()) == "fine"


def test_per_item_errors_and_nan_stay_with_their_unit():
    class PerItem(FakeBackend):
        def result(self, p):
            if p == "err":
                return InvalidArgument("item rejected")
            if p == "nan":
                return float("nan")
            return p

    async def main():
        b = make(PerItem(), max_batch_size=8)
        r_err = asyncio.create_task(b.run([(8, "err")]))
        r_nan = asyncio.create_task(b.run([(8, "nan")]))
        r_ok = asyncio.create_task(b.run([(8, "ok")]))
        out = await asyncio.gather(r_err, r_nan, r_ok, return_exceptions=True)
        await b.close()
        return out

    err, nan, ok = run(main())
    assert isinstance(err, InvalidArgument)
    assert math.isnan(nan[0].result)
    assert ok[0].result == "ok"


def test_wrong_result_count_is_internal():
    async def main():
        b = make(lambda payloads: payloads[:-1])
        try:
            with pytest.raises(Internal, match="returned 1 results for a batch of 2"):
                await b.run([(8, 1), (8, 2)])
        finally:
            await b.close()

    run(main())


def test_hanging_backend_deadline_and_close():
    be = HangingBackend()

    async def main():
        b = make(be)
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="computing"):
            await b.run([(8, 1)], deadline=time.monotonic() + 0.2)
        queued = asyncio.create_task(b.run([(8, 2)], deadline=time.monotonic() + 0.2))
        with pytest.raises(DeadlineExceeded):
            await queued
        elapsed = time.monotonic() - t0
        await b.close()
        return elapsed

    try:
        assert run(main()) < 2.0
    finally:
        be.release.set()


def test_timings_travel_with_units():
    async def main():
        be = FakeBackend(delay=0.05)
        b = make(be, max_queue_delay=0.02)
        units = await b.run([(8, 1), (12, 2)])
        await b.close()
        return units

    units = run(main())
    # each unit keeps its own size and result, and carries the timings of the one batch it ran in
    assert [(u.tokens, u.result, u.batch_size) for u in units] == [(8, 2, 2), (12, 4, 2)]
    assert units[0].inference_s == units[1].inference_s >= 0.05  # the backend's delay, measured once per batch
    # submitted together, so they waited equally: the 0.02 s max_queue_delay for company, then the batch ran
    assert units[0].queue_s == units[1].queue_s and 0.015 <= units[0].queue_s < 1.0


def test_observers_see_depth_and_batches():
    depths, stats = [], []

    async def main():
        b = make(FakeBackend(), max_batch_size=8, on_queue_depth=depths.append, on_batch=stats.append)
        await b.run([(4, 1), (10, 2)])
        await b.close()

    run(main())
    assert depths[0] == 2 and depths[-1] == 0
    assert stats[0].size == 2 and stats[0].real_tokens == 14 and stats[0].padded_tokens == 20


def test_closed_batcher_refuses():
    async def main():
        b = make(FakeBackend())
        await b.close()
        from relserve.service.errors import Unavailable

        with pytest.raises(Unavailable):
            await b.run([(8, 1)])

    run(main())


# ---------------------------------------------------------------------- fairness between requests


def _batch_of(be: FakeBackend, payload) -> int:
    """Index of the batch that computed ``payload``."""
    return next(i for i, batch in enumerate(be.batches) if payload in batch)


def _long_and_short(share: float, *, short_after_first_batch: bool):
    """A 64-window request, then a 1-window request (while the first batch runs, or in the same tick)."""

    async def main():
        be = FakeBackend(delay=0.02)
        b = make(be, max_batch_size=8, max_request_batch_share=share)
        long = asyncio.create_task(b.run([(40, f"L{i}") for i in range(64)]))
        if short_after_first_batch:
            while not be.batches:
                await asyncio.sleep(0.001)
        else:
            await asyncio.sleep(0)  # the long request is queued, the worker has not formed a batch yet
        short = asyncio.create_task(b.run([(40, "S")]))
        long_units, short_units = await asyncio.gather(long, short)
        await b.close()
        return be, [u.result for u in long_units], short_units[0].result

    return run(main())


@pytest.mark.parametrize("after_first_batch", [True, False])
def test_long_request_does_not_starve_a_short_one(after_first_batch):
    be, long_results, short_result = _long_and_short(0.5, short_after_first_batch=after_first_batch)
    assert long_results == [f"L{i}" for i in range(64)] and short_result == "S"
    assert _batch_of(be, "S") <= 1, be.batches  # first or second batch, not after the 64 windows
    assert len(be.batches) == 9  # 65 units in batches of 8: the cap gave places away, it wasted none
    assert all(sum(p.startswith("L") for p in batch) <= 8 for batch in be.batches)
    shared = be.batches[_batch_of(be, "S")]
    assert len(shared) == 8 and sum(p.startswith("L") for p in shared) == 7  # refilled from the long request


def test_without_the_cap_the_short_request_waits_for_the_whole_long_one():
    """The control for the test above: share 1.0 (no cap) is the old order."""
    be, _, _ = _long_and_short(1.0, short_after_first_batch=True)
    assert _batch_of(be, "S") == len(be.batches) - 1 == 8


def test_lone_request_still_gets_full_batches():
    async def main():
        be = FakeBackend()
        b = make(be, max_batch_size=8, max_request_batch_share=0.5)
        units = await b.run([(40, i) for i in range(64)])
        await b.close()
        return be, [u.result for u in units]

    be, results = run(main())
    assert results == [i * 2 for i in range(64)]
    assert [len(batch) for batch in be.batches] == [8] * 8


def test_two_long_requests_share_each_batch():
    async def main():
        be = FakeBackend()
        b = make(be, max_batch_size=8, max_request_batch_share=0.5)
        a = asyncio.create_task(b.run([(40, f"a{i}") for i in range(16)]))
        c = asyncio.create_task(b.run([(40, f"c{i}") for i in range(16)]))
        await asyncio.gather(a, c)
        await b.close()
        return be

    be = run(main())
    assert [(sum(p[0] == "a" for p in batch), sum(p[0] == "c" for p in batch)) for batch in be.batches] == [(4, 4)] * 4


def test_cap_is_work_conserving_under_the_token_budget():
    """The other request's unit does not fit the token budget next to the anchor: the capped request fills
    the batch instead of leaving places empty."""

    async def main():
        be = FakeBackend()
        b = make(be, max_batch_size=8, max_batch_tokens=100, max_request_batch_share=0.5)
        long = asyncio.create_task(b.run([(10, f"L{i}") for i in range(16)]))
        big = asyncio.create_task(b.run([(60, "B")]))
        await asyncio.gather(long, big)
        await b.close()
        return be

    be = run(main())
    # B next to the 10-token anchor would cost 2 x 60 > 100 padded tokens: it can only run alone, so the
    # places the cap held for others go back to the long request
    assert be.batches == [[f"L{i}" for i in range(8)], [f"L{i}" for i in range(8, 16)], ["B"]]


@pytest.mark.parametrize("padded", [True, False])
def test_cap_leaves_a_lone_request_batches_unchanged(padded):
    """One request alone: the held-back units are taken in the same bucket order, under the same budget, so
    the batches are exactly those without the cap."""
    lengths = [10, 200, 12, 190, 11, 205, 40, 45, 300, 9, 14, 180]

    async def main(share):
        be = FakeBackend()
        b = make(be, max_batch_size=4, max_batch_tokens=600, is_padded=padded, max_request_batch_share=share)
        await b.run([(n, n) for n in lengths])
        await b.close()
        return be.batches

    capped, uncapped = run(main(0.25)), run(main(1.0))
    assert capped == uncapped
    assert sorted(n for batch in capped for n in batch) == sorted(lengths)


def test_max_request_batch_share_validated():
    with pytest.raises(ValueError, match="max_request_batch_share"):
        Batcher("fake", FakeBackend(), max_request_batch_share=0.0)
    with pytest.raises(ValueError, match="max_request_batch_share"):
        Batcher("fake", FakeBackend(), max_request_batch_share=1.5)


def test_queue_full_carries_retry_guidance():
    async def main():
        be = FakeBackend(delay=0.05)
        b = make(be, max_queue_size=2, max_batch_size=1)
        with pytest.raises(ResourceExhausted) as too_big:  # 3 units can never fit max_queue_size 2
            await b.run([(8, 1), (8, 2), (8, 3)])
        running = asyncio.create_task(b.run([(8, 1), (8, 2)]))
        while len(be.batches) < 2:  # one batch measured: the drain rate is known
            await asyncio.sleep(0.005)
        waiting = asyncio.create_task(b.run([(8, 3), (8, 4)]))
        await asyncio.sleep(0)
        refusals = []
        for _ in range(3):
            with pytest.raises(ResourceExhausted) as full:
                await b.run([(8, 5)])
            refusals.append(full.value.retry_after_s)
        await asyncio.gather(running, waiting)
        await b.close()
        return too_big.value, refusals

    too_big, refusals = run(main())
    assert too_big.retry_after_s is None  # no retry makes a request fit max_queue_size
    assert all(r is not None and 0.01 <= r <= 2.0 for r in refusals), refusals
    assert refusals[0] < refusals[1] < refusals[2]  # a virtual queue: refused together, told to come back spread out


# ---------------------------------------------------------------------- admission before work (reservations)

def test_reservation_counts_against_the_queue_before_submit():
    async def main():
        be = HangingBackend()
        b = make(be, max_batch_size=1, max_queue_size=4)
        running = asyncio.ensure_future(b.run([(5, "busy")]))
        await asyncio.sleep(0.05)  # "busy" is computing: the queue is empty
        r = b.reserve(3)
        assert (b.reserved, b.queue_depth) == (3, 0)
        with pytest.raises(ResourceExhausted) as err:
            b.reserve(2)  # 3 held + 2 > 4, refused with nothing tokenized
        assert "max_queue_size is 4" in str(err.value) and "3 held by requests being tokenized" in str(err.value)
        assert err.value.retry_after_s is not None
        units = b.submit([(5, "a"), (5, "b")], reservation=r)  # fewer than reserved: the rest goes back
        assert (b.reserved, b.queue_depth, r.places) == (0, 2, 0)
        r2 = b.reserve(2)
        with pytest.raises(ResourceExhausted):
            b.submit([(5, "c")] * 3, reservation=r2)  # more than reserved: the difference must fit too
        assert b.reserved == 2  # a refused submit keeps the reservation for its owner to release
        r2.release()
        r2.release()  # idempotent
        assert b.reserved == 0
        be.release.set()
        await running
        await b.wait(units)
        await b.close()

    run(main())


def test_reservation_larger_than_the_queue_is_refused_naming_max_queue_size():
    async def main():
        b = make(FakeBackend(), max_queue_size=8)
        with pytest.raises(ResourceExhausted, match="request needs 9 sequences but model 'fake' has max_queue_size 8"):
            b.reserve(9)
        assert b.reserved == 0
        await b.close()

    run(main())


def test_reservation_released_on_error_and_on_cancellation():
    async def main():
        b = make(FakeBackend(), max_queue_size=4)

        async def tokenize_then_fail():
            with b.reserve(4):
                await asyncio.sleep(0)
                raise ValueError("tokenizer refused the text")

        with pytest.raises(ValueError):
            await tokenize_then_fail()
        assert b.reserved == 0

        started = asyncio.Event()

        async def tokenize_slowly():
            with b.reserve(4) as r:
                started.set()
                await asyncio.sleep(10)
                b.submit([(5, 1)], reservation=r)

        task = asyncio.ensure_future(tokenize_slowly())
        await started.wait()
        assert b.reserved == 4
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (b.reserved, b.queue_depth) == (0, 0)
        units = await b.run([(5, 1)] * 4)  # all four places are free again
        assert [u.result for u in units] == [2] * 4
        await b.close()

    run(main())


def test_a_suspended_batcher_fails_its_queue_and_refuses_until_resumed():
    """A model whose worker is being replaced (service/runner.py ``_set_unavailable``): queued units fail
    UNAVAILABLE naming the reason at once, new submissions are refused with it, and after ``resume`` it serves."""
    from relserve.service.errors import Unavailable

    be = HangingBackend()

    async def main():
        b = Batcher("m", be, max_batch_size=1, max_queue_delay=0)
        b.start()
        running = asyncio.ensure_future(b.run([(3, 1)]))
        while not be.batches:
            await asyncio.sleep(0.001)
        queued = asyncio.ensure_future(b.run([(3, 2)], deadline=time.monotonic() + 60))
        await asyncio.sleep(0.01)
        b.suspend("worker process 42 was killed by SIGKILL")
        with pytest.raises(Unavailable, match="not ready: worker process 42 was killed by SIGKILL"):
            await queued
        with pytest.raises(Unavailable, match="worker process 42"):
            b.submit([(3, 3)])
        be.release.set()
        await running
        b.resume()
        units = await b.run([(3, 4)])
        await b.close()
        return units[0].result

    assert run(main()) == 4


def test_a_budgeted_batcher_passes_each_call_its_predicted_seconds():
    """``budgeted``: the backend gets ``(payloads, budget)``; the budget's ``expected_s`` is the cost model's
    prediction for that call (None before it has seen one), which a worker's watchdog turns into its timeout."""
    seen = []

    def backend(payloads, budget):
        seen.append(budget.expected_s)
        time.sleep(0.01)
        return list(payloads)

    async def main():
        b = Batcher("m", backend, max_queue_delay=0, budgeted=True)
        b.start()
        for i in range(3):
            await b.run([(8, i)])
        await b.close()
        return b

    b = run(main())
    assert seen[0] is None and all(s is not None and s > 0 for s in seen[1:])
    assert seen[-1] >= 0.005  # each call slept 10 ms: the prediction learned it
