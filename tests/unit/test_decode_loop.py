"""The decode loop driven by fake step backends (no model, no torch): admission and retirement between
steps, the hypothesis budget, FIFO order, deadlines and cancellation, failing steps and NaN isolation,
request-level scheduling, and that slow steps run off the event loop."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest

from relserve.models.decode_types import DecodeOptions, Hypothesis
from relserve.service.backends.base import SeqUpdate
from relserve.service.scheduling.decode_loop import DecodeLoop
from relserve.service.errors import DeadlineExceeded, Internal, ResourceExhausted


class FakeStepBackend:
    """Sequence with source ids ``src`` produces ``len(src)`` tokens ``src[0], src[0]+1, ...`` (capped by
    max_length), growing to ``beam_size`` live hypotheses. Knobs: per-step ``delay``; ``fail_step_with``
    (a source first id whose presence in a step makes the step raise); ``item_error`` / ``nan`` (first ids
    whose update is an Exception / has a NaN score); ``fail_start`` (first ids whose start fails);
    ``fail_start_call`` (first ids whose presence makes the whole start call raise)."""

    name = "fake"

    def __init__(self, *, delay: float = 0.0, fail_step_with: int | None = None, item_error: tuple = (),
                 nan: tuple = (), fail_start: tuple = (), fail_start_call: tuple = ()) -> None:
        self.delay = delay
        self.fail_start_call = set(fail_start_call)  # first ids whose presence makes the whole start raise
        self.fail_step_with = fail_step_with
        self.item_error = set(item_error)
        self.nan = set(nan)
        self.fail_start = set(fail_start)
        self.state: dict[int, dict] = {}
        self.released: list[int] = []
        self.starts: list[list[int]] = []
        self.threads: set[str] = set()

    def start(self, items, budget=None):
        self.threads.add(threading.current_thread().name)
        self.starts.append([it.seq_id for it in items])
        if any(it.source_ids[0] in self.fail_start_call for it in items):
            raise RuntimeError("encoder call exploded")
        out = []
        for it in items:
            if it.source_ids[0] in self.fail_start:
                out.append(RuntimeError("cannot encode"))
                continue
            self.state[it.seq_id] = {"src": it.source_ids, "p": it.options, "t": 0}
            out.append(1)
        return out

    def step(self, plan, budget=None):
        self.threads.add(threading.current_thread().name)
        if self.delay:
            time.sleep(self.delay)
        firsts = [self.state[i]["src"][0] for i in plan.seq_ids]
        if self.fail_step_with is not None and self.fail_step_with in firsts:
            raise RuntimeError("step exploded")
        ups = []
        for sid in plan.seq_ids:
            st = self.state[sid]
            st["t"] += 1
            src, p, t = st["src"], st["p"], st["t"]
            tokens = [src[0] + i for i in range(t)]
            if src[0] in self.item_error:
                ups.append(ValueError("bad row"))
                continue
            score = float("nan") if src[0] in self.nan else -0.5 * t
            target = min(len(src), p.max_length_for(len(src)))
            if t >= target:
                del self.state[sid]
                hyps = [Hypothesis(tokens, -0.5 * t - k, -0.5 - k, t == len(src), t < len(src))
                        for k in range(p.n_best)]
                ups.append(SeqUpdate(0, tokens, score, hyps))
            else:
                ups.append(SeqUpdate(min(p.beam_size, t + 1), tokens, score))
        return ups

    def release(self, seq_ids):
        self.released.extend(seq_ids)
        for i in seq_ids:
            self.state.pop(i, None)


P1 = DecodeOptions(beam_size=1, n_best=1, max_length=100)


def src(first: int, length: int) -> list[int]:
    return [first] + [0] * (length - 1)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


async def _loop(backend, **kw) -> DecodeLoop:
    loop = DecodeLoop("m", backend, **kw)
    loop.start()
    return loop


def test_join_between_steps_and_retire_early():
    async def main():
        be = FakeStepBackend(delay=0.01)
        loop = await _loop(be)
        long_task = asyncio.ensure_future(loop.run([(src(100, 8), P1)]))
        while loop.steps < 2:
            await asyncio.sleep(0.001)
        short = await loop.run([(src(200, 2), P1)])
        assert not long_task.done()  # the short one joined the running loop and left before the long one
        (long_res,) = await long_task
        await loop.close()
        return be, loop, long_res, short

    be, loop, long_res, short = run(main())
    assert long_res[0].tokens == list(range(100, 108)) and short[0][0].tokens == [200, 201]
    joint = [p for p in loop.plans if len(p.seq_ids) == 2]
    assert len(joint) == 2  # exactly the short one's two steps were shared
    assert loop.plans[-1].seq_ids == (0,)  # the long one finished alone
    assert len(be.starts) == 2  # two encoder batches: the short one was encoded while the long one decoded


def test_budget_respected_fifo_and_results_match_solo():
    async def main():
        be = FakeStepBackend()
        loop = await _loop(be, max_active_hypotheses=6, max_batch_size=8)
        params = DecodeOptions(beam_size=2, n_best=2, max_length=100)
        items = [(src(10 * (i + 1), 2 + i % 4), params) for i in range(10)]
        mixed = await asyncio.gather(*(loop.run([it]) for it in items))
        solo = [await loop.run([it]) for it in items]
        await loop.close()
        return loop, be, mixed, solo

    loop, be, mixed, solo = run(main())
    assert all(p.total <= 6 and len(p.seq_ids) <= 3 for p in loop.plans)
    assert max(len(p.seq_ids) for p in loop.plans) == 3  # the budget was used, not just respected
    admitted = [i for batch in be.starts for i in batch]
    assert admitted == sorted(admitted)  # strict FIFO admission
    for m, s in zip(mixed, solo):
        assert [(h.tokens, h.score) for h in m[0]] == [(h.tokens, h.score) for h in s[0]]


def test_oversized_beam_runs_alone():
    async def main():
        loop = await _loop(FakeStepBackend(), max_active_hypotheses=2)
        out = await loop.run([(src(5, 3), DecodeOptions(beam_size=4, n_best=1, max_length=10))])
        await loop.close()
        return out

    assert run(main())[0][0].tokens == [5, 6, 7]


def test_encoder_token_budget_splits_batches():
    async def main():
        be = FakeStepBackend()
        loop = await _loop(be, max_batch_tokens=10, max_queue_delay=0.05)
        await asyncio.gather(*(loop.run([(src(i + 1, 4), P1)]) for i in range(5)))
        await loop.close()
        return be

    be = run(main())
    assert all(len(b) * 4 <= 10 for b in be.starts) and sum(map(len, be.starts)) == 5


def test_deadline_drops_hypotheses_at_next_step():
    async def main():
        be = FakeStepBackend(delay=0.02)
        loop = await _loop(be)
        other = loop.submit([(src(300, 15), P1)])  # seq 0
        with pytest.raises(DeadlineExceeded, match="while decoding"):
            await loop.run([(src(100, 50), P1)], deadline=time.monotonic() + 0.15)  # seq 1
        steps_at_expiry = loop.steps
        await loop.wait(other)
        res = other[0].result
        await loop.close()
        return be, loop, res, steps_at_expiry

    be, loop, res, at = run(main())
    late = [p for p in loop.plans[at + 1:]]
    assert late and all(1 not in p.seq_ids for p in late)  # seq 1 (the expired one) never stepped again
    assert 1 in be.released and res[0].tokens == list(range(300, 315))


def test_deadline_while_waiting_never_encodes():
    async def main():
        be = FakeStepBackend(delay=0.05)
        loop = await _loop(be, max_active_hypotheses=1)
        first = asyncio.ensure_future(loop.run([(src(1, 6), P1)]))
        await asyncio.sleep(0.01)
        with pytest.raises(DeadlineExceeded, match="waiting in the queue"):
            await loop.run([(src(2, 2), P1)], deadline=time.monotonic() + 0.05)
        await first
        await loop.close()
        return be

    be = run(main())
    assert be.starts == [[0]]


def test_cancel_drops_at_next_step():
    async def main():
        be = FakeStepBackend(delay=0.01)
        loop = await _loop(be)
        task = asyncio.ensure_future(loop.run([(src(100, 200), P1)]))
        while loop.steps < 3:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)
        steps = loop.steps
        await asyncio.sleep(0.05)
        quiet = loop.steps == steps and loop.active_sequences == 0
        await loop.close()
        return be, quiet

    be, quiet = run(main())
    assert quiet and be.released == [0] and not be.state


def test_failing_step_fails_only_its_sequences():
    async def main():
        be = FakeStepBackend(fail_step_with=666)
        loop = await _loop(be, max_active_hypotheses=2)
        a = asyncio.ensure_future(loop.run([(src(1, 5), P1)]))
        bad = asyncio.ensure_future(loop.run([(src(666, 5), P1)]))
        waiting = asyncio.ensure_future(loop.run([(src(7, 3), P1)]))  # no room yet: waits, untouched
        results = await asyncio.gather(a, bad, waiting, return_exceptions=True)
        after = await loop.run([(src(9, 2), P1)])  # the loop keeps serving
        await loop.close()
        return results, after

    (a, bad, waiting), after = run(main())
    assert isinstance(a, Internal) and "step exploded" in str(a)
    assert isinstance(bad, Internal)
    assert waiting[0][0].tokens == [7, 8, 9] and after[0][0].tokens == [9, 10]


def test_item_error_and_nan_fail_only_their_own_sequence():
    async def main():
        be = FakeStepBackend(item_error=(13,), nan=(17,))
        loop = await _loop(be, max_queue_delay=0.02)
        outs = await asyncio.gather(*(loop.run([(src(f, 4), P1)]) for f in (11, 13, 17, 19)),
                                    return_exceptions=True)
        await loop.close()
        return be, outs

    be, (ok1, err, nan, ok2) = run(main())
    assert isinstance(err, ValueError)
    assert isinstance(nan, Internal) and "non-finite" in str(nan)
    assert ok1[0][0].tokens == [11, 12, 13, 14] and ok2[0][0].tokens == [19, 20, 21, 22]
    assert set(be.released) >= {1, 2} and not be.state


def test_failed_encode_fails_its_items_only():
    async def main():
        loop = await _loop(FakeStepBackend(fail_start=(5,)), max_queue_delay=0.02)
        outs = await asyncio.gather(loop.run([(src(5, 2), P1)]), loop.run([(src(6, 2), P1)]),
                                    return_exceptions=True)
        await loop.close()
        return outs

    bad, good = run(main())
    assert isinstance(bad, RuntimeError) and good[0][0].tokens == [6, 7]


def test_request_level_scheduling_never_joins():
    async def main():
        be = FakeStepBackend(delay=0.005)
        loop = await _loop(be, scheduling="request")
        a = asyncio.ensure_future(loop.run([(src(100, 6), P1)]))
        while loop.steps < 2:
            await asyncio.sleep(0.001)
        b = await loop.run([(src(200, 2), P1)])
        await a
        await loop.close()
        return loop, b

    loop, b = run(main())
    assert all(len(p.seq_ids) == 1 for p in loop.plans)
    first_b = next(i for i, p in enumerate(loop.plans) if p.seq_ids == (1,))
    assert all(p.seq_ids == (0,) for p in loop.plans[:first_b]) and first_b == 6
    assert b[0][0].tokens == [200, 201]


def test_request_of_many_texts_and_queue_limit():
    async def main():
        loop = await _loop(FakeStepBackend(), max_queue_size=3)
        with pytest.raises(ResourceExhausted, match="max_queue_size is 3"):
            loop.submit([(src(i + 1, 2), P1) for i in range(4)])
        out = await loop.run([(src(i + 1, i + 1), P1) for i in range(3)])
        await loop.close()
        return out

    out = run(main())
    assert [o[0].tokens for o in out] == [[1], [2, 3], [3, 4, 5]]


def test_reservations_count_against_the_queue_and_are_consumed_or_released():
    async def main():
        loop = await _loop(FakeStepBackend(), max_queue_size=3)
        r = loop.reserve(2)  # a request of two texts being encoded
        with pytest.raises(ResourceExhausted, match="2 held by requests being tokenized"):
            loop.reserve(2)
        seqs = loop.submit([(src(1, 2), P1)], reservation=r)  # one text was blank: one place goes back
        assert (loop.reserved_places, r.places) == (0, 0)
        with loop.reserve(2):
            pass  # an error or cancellation while encoding leaves the with block: released
        assert loop.reserved_places == 0
        await loop.wait(seqs)
        await loop.close()
        return seqs

    (seq,) = run(main())
    assert seq.result[0].tokens == [1, 2]


def test_slow_steps_run_off_the_event_loop_and_stream_updates():
    async def main():
        be = FakeStepBackend(delay=0.03)
        loop = await _loop(be)
        seen = []
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        t = asyncio.ensure_future(ticker())
        seqs = loop.submit([(src(40, 5), P1)], on_update=lambda u, step: seen.append((step, u.best_tokens)))
        await loop.wait(seqs)
        t.cancel()
        await loop.close()
        return be, seen, ticks, seqs[0].result

    be, seen, ticks, result = run(main())
    assert ticks >= 10  # the event loop kept running while steps slept in the executor
    assert all(name.startswith("relserve-m") for name in be.threads)
    assert seen == [(1, [40]), (2, [40, 41]), (3, [40, 41, 42]), (4, [40, 41, 42, 43])]
    assert result[0].tokens == [40, 41, 42, 43, 44] and math.isfinite(result[0].score)


def test_queue_full_carries_retry_guidance_unless_the_request_can_never_fit():
    async def main():
        loop = await _loop(FakeStepBackend(delay=0.05), max_queue_size=2, max_active_hypotheses=1)
        running = asyncio.create_task(loop.run([(src(1, 3), P1)]))
        while loop.active_sequences == 0:
            await asyncio.sleep(0.005)
        waiting = asyncio.create_task(loop.run([(src(2, 1), P1), (src(3, 1), P1)]))
        await asyncio.sleep(0)
        with pytest.raises(ResourceExhausted) as full:
            loop.submit([(src(4, 1), P1)])
        with pytest.raises(ResourceExhausted) as never:
            loop.submit([(src(i + 5, 1), P1) for i in range(3)])
        await asyncio.gather(running, waiting)
        await loop.close()
        return full.value, never.value

    full, never = run(main())
    assert full.retry_after_s is not None and 0.01 <= full.retry_after_s <= 2.0
    assert never.retry_after_s is None


# ---------------------------------------------------------------------- newcomers' encoder batching

ENDLESS = DecodeOptions(beam_size=1, n_best=1, max_len_cap=100_000, max_length=100_000)


async def _endless(loop: DecodeLoop):
    """A sequence that decodes until it is discarded, so the loop stays busy for the whole test."""
    (seq,) = loop.submit([(src(1000, 100_000), ENDLESS)])
    while loop.active_sequences == 0:
        await asyncio.sleep(0.001)
    return seq


@pytest.mark.parametrize("hold", [0.0, 30.0])
def test_newcomers_held_while_decoding_share_one_encoder_call(hold):
    async def main():
        be = FakeStepBackend(delay=0.002)
        loop = await _loop(be, max_batch_size=3, encode_batch_delay=hold)
        busy = await _endless(loop)
        tasks = []
        for i in range(3):  # one newcomer per decoder step
            seen = loop.steps
            tasks.append(asyncio.ensure_future(loop.run([(src(10 * (i + 1), 3 + i), P1)])))
            while loop.steps < seen + 2:
                await asyncio.sleep(0.001)
        held = [await t for t in tasks]
        still_busy = not busy.future.done() and loop.active_sequences == 1
        loop.discard([busy])
        solo = [await loop.run([(src(10 * (i + 1), 3 + i), P1)]) for i in range(3)]
        await loop.close()
        return be, loop, held, solo, still_busy

    be, loop, held, solo, still_busy = run(main())
    assert still_busy  # the newcomers joined the running loop and left it while the endless one decoded
    if hold:
        # held (while the loop kept stepping) until three waited, the encoder batch's max_batch_size
        assert be.starts[:2] == [[0], [1, 2, 3]] and loop.held_steps >= 2
        assert any(set(p.seq_ids) == {0, 1, 2, 3} for p in loop.plans)
    else:
        assert be.starts[:4] == [[0], [1], [2], [3]] and loop.held_steps == 0
    for h, s in zip(held, solo):
        assert [(x.tokens, x.score) for x in h[0]] == [(x.tokens, x.score) for x in s[0]]


def test_saturated_loop_refills_freed_places_in_one_encoder_call():
    """More waiting than the budget holds: places freed one per step stay empty until REFILL_FRACTION of
    the budget is free (or MAX_REFILL_HOLD_STEPS passed), so each refill is one encoder call over several
    newcomers instead of one call per step; the last newcomers, who all fit, are admitted at once."""
    from relserve.service.scheduling import decode_loop

    budget = 10
    need = math.ceil(decode_loop.REFILL_FRACTION * budget)  # 3 places

    async def main():
        be = FakeStepBackend(delay=0.001)
        loop = await _loop(be, max_active_hypotheses=budget, max_batch_size=64, encode_batch_delay=0.0)
        # the first ten fill the budget and finish one per step (lengths 2..11); ten more wait behind them
        out = await loop.run([(src(100 * (i + 1), 2 + i), P1) for i in range(2 * budget)])
        await loop.close()
        return be, loop, out

    be, loop, out = run(main())
    assert [r[0].tokens for r in out] == [[100 * (i + 1) + k for k in range(2 + i)] for i in range(2 * budget)]
    assert be.starts[0] == list(range(budget))
    refills = [len(s) for s in be.starts[1:]]
    assert sum(refills) == budget and all(n >= need for n in refills[:-1]) and len(refills) <= budget // need + 1
    assert loop.held_steps >= need - 1


def test_held_newcomer_joins_after_the_delay_without_a_full_batch():
    async def main():
        be = FakeStepBackend(delay=0.002)
        loop = await _loop(be, encode_batch_delay=0.003)
        busy = await _endless(loop)
        out = await loop.run([(src(50, 4), P1)])
        joined_while_busy = not busy.future.done()
        loop.discard([busy])
        await loop.close()
        return be, out, joined_while_busy

    be, out, joined_while_busy = run(main())
    assert joined_while_busy and be.starts[:2] == [[0], [1]]
    assert out[0][0].tokens == [50, 51, 52, 53]


def test_cancelled_or_expired_newcomer_within_the_hold_frees_its_place():
    async def main():
        be = FakeStepBackend(delay=0.002)
        loop = await _loop(be, max_queue_size=1, encode_batch_delay=30.0)
        busy = await _endless(loop)
        doomed = asyncio.ensure_future(loop.run([(src(20, 3), P1)]))
        held_before = loop.held_steps
        while loop.held_steps < held_before + 2:  # it is being held while the loop steps
            await asyncio.sleep(0.001)
        with pytest.raises(ResourceExhausted):
            loop.submit([(src(30, 3), P1)])  # its place is taken
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        depth_after_cancel = loop.queue_depth
        late = loop.submit([(src(40, 3), P1)], deadline=time.monotonic() + 0.05)  # the freed place
        with pytest.raises(DeadlineExceeded, match="before decoding started"):
            await loop.wait(late)
        depth_after_deadline = loop.queue_depth
        ok = loop.submit([(src(60, 2), P1)])  # free again
        loop.discard([busy])  # the loop empties: the held one is admitted at once
        await loop.wait(ok)
        await loop.close()
        return be, depth_after_cancel, depth_after_deadline, ok[0].result

    be, depth_after_cancel, depth_after_deadline, result = run(main())
    assert depth_after_cancel == 0 and depth_after_deadline == 0
    started = [i for batch in be.starts for i in batch]
    assert 1 not in started and 2 not in started  # neither the cancelled nor the expired one was encoded
    assert result[0].tokens == [60, 61]


def test_failing_encoder_call_over_several_newcomers_fails_only_the_culprit():
    async def main():
        be = FakeStepBackend(fail_start_call=(13,))
        loop = await _loop(be, max_queue_delay=0.05)
        outs = await asyncio.gather(*(loop.run([(src(f, 3), P1)]) for f in (11, 13, 17)), return_exceptions=True)
        await loop.close()
        return be, outs

    be, (ok1, bad, ok2) = run(main())
    assert be.starts == [[0, 1, 2], [0], [1], [2]]  # the batch raised; then one at a time
    assert isinstance(bad, Internal) and "encoder call exploded" in str(bad)
    assert ok1[0][0].tokens == [11, 12, 13] and ok2[0][0].tokens == [17, 18, 19]
