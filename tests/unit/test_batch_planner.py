"""Cost-model batch forming (issue 11 item 4), without models: the partition optimiser
(``cost_model.plan_batch``) against brute-force oracles, the non-negative fit of ``cost_model.BatchCostModel``,
the warm-up probes (``cost_model.calibrate``) and the batcher running a formed batch as the planned sub-batches."""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest

from relserve.service.scheduling.batcher import Batcher
from relserve.service.scheduling.cost_model import (COST_TERMS, MIN_PIECE_TOKENS, BatchCostModel, calibrate,
                                                    calibration_shapes, cost_features, plan_batch)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def block_cost(lengths, coef, is_padded=True):
    """The oracle's cost of one sub-batch, written out independently of plan_batch's prefix sums."""
    c, a, d, b = coef
    n, longest, real = len(lengths), max(lengths), sum(lengths)
    if is_padded:
        return c + a * real + d * n * longest + b * n * longest ** 2
    return c + a * real + d * real + b * sum(x * x for x in lengths)


def plan_cost(lengths, pieces, coef, is_padded=True):
    return sum(block_cost([lengths[i] for i in p], coef, is_padded) for p in pieces)


def set_partitions(items):
    """Every partition of ``items`` into non-empty blocks (Bell(n) of them)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        yield [[first]] + part
        for k in range(len(part)):
            yield part[:k] + [[first] + part[k]] + part[k + 1:]


def sorted_runs(n):
    """Every partition of range(n) into contiguous runs (2^(n-1) of them), as lists of cut positions."""
    for cuts in itertools.product((False, True), repeat=max(0, n - 1)):
        bounds = [0] + [i + 1 for i, cut in enumerate(cuts) if cut] + [n]
        yield [list(range(bounds[k], bounds[k + 1])) for k in range(len(bounds) - 1)]


def random_coef(rng):
    """(c, a, d, b) with realistic magnitudes, some terms switched off."""
    coef = [rng.uniform(0, 5e-3), rng.uniform(0, 2e-4), rng.uniform(0, 1e-4), rng.uniform(0, 2e-6)]
    for k in range(4):
        if rng.random() < 0.2:
            coef[k] = 0.0
    return tuple(coef)


def check_is_partition(pieces, n):
    flat = [i for p in pieces for i in p]
    assert sorted(flat) == list(range(n)), pieces
    assert all(p == sorted(p) and p for p in pieces), pieces


@pytest.mark.parametrize("is_padded", [True, False])
def test_plan_is_optimal_over_every_set_partition(is_padded):
    rng = random.Random(1)
    for _ in range(150):
        n = rng.randint(1, 7)
        lengths = [rng.choice((rng.randint(2, 40), rng.randint(2, 400))) for _ in range(n)]
        coef = random_coef(rng)
        cap = rng.choice((0, 1, 2, 3, n))
        pieces = plan_batch(lengths, coef, is_padded=is_padded, max_batch_size=cap)
        check_is_partition(pieces, n)
        limit = cap or n
        assert all(len(p) <= limit for p in pieces)
        oracle = min(plan_cost(lengths, part, coef, is_padded) for part in set_partitions(list(range(n)))
                     if all(len(b) <= limit for b in part))
        assert plan_cost(lengths, pieces, coef, is_padded) == pytest.approx(oracle, rel=1e-9, abs=1e-15)


def test_plan_with_the_time_cap_is_optimal_over_the_allowed_sorted_runs():
    """With ``max_batch_time`` the allowed sub-batches are those predicted within it (or one unit, or at most
    ``min_piece_tokens`` padded tokens); the oracle enumerates every contiguous run partition of the sorted
    order and keeps the allowed ones."""
    rng = random.Random(2)
    for _ in range(200):
        n = rng.randint(1, 8)
        lengths = [rng.randint(2, 300) for _ in range(n)]
        coef = random_coef(rng)
        max_time = rng.uniform(0.001, 0.2)
        min_tokens = rng.choice((0, 64, MIN_PIECE_TOKENS))
        pieces = plan_batch(lengths, coef, max_batch_time=max_time, min_piece_tokens=min_tokens)
        check_is_partition(pieces, n)
        order = sorted(range(n), key=lambda i: (lengths[i], i))

        def allowed(block):
            ls = [lengths[i] for i in block]
            return len(ls) == 1 or len(ls) * max(ls) <= min_tokens or block_cost(ls, coef) <= max_time

        for p in pieces:
            assert allowed(p), (lengths, p)
        candidates = [[[order[k] for k in run] for run in part] for part in sorted_runs(n)]
        oracle = min(plan_cost(lengths, part, coef) for part in candidates if all(allowed(b) for b in part))
        assert plan_cost(lengths, pieces, coef) == pytest.approx(oracle, rel=1e-9, abs=1e-15)


def test_plan_runs_the_oldest_units_sub_batch_first():
    rng = random.Random(3)
    coef = (2e-3, 1e-4, 1e-5, 1e-6)
    for _ in range(100):
        n = rng.randint(2, 30)
        lengths = [rng.choice((rng.randint(5, 30), rng.randint(100, 400))) for _ in range(n)]
        pieces = plan_batch(lengths, coef, max_batch_size=8)
        check_is_partition(pieces, n)
        assert 0 in pieces[0]
        firsts = [p[0] for p in pieces]
        assert firsts == sorted(firsts)  # then each by its oldest unit
        assert all(len(p) <= 8 for p in pieces)


def test_plan_cost_is_monotone():
    """The optimum never costs more than one batch or one call per unit, and a unit more never makes it
    cheaper; a mixed burst is split where padding costs, and kept whole where only calls cost."""
    rng = random.Random(4)
    for _ in range(100):
        coef = random_coef(rng)
        lengths = [rng.randint(2, 400) for _ in range(rng.randint(1, 24))]
        best = plan_cost(lengths, plan_batch(lengths, coef), coef)
        assert best <= block_cost(lengths, coef) * (1 + 1e-12)
        assert best <= plan_cost(lengths, [[i] for i in range(len(lengths))], coef) * (1 + 1e-12)
        more = lengths + [rng.randint(2, 400)]
        assert plan_cost(more, plan_batch(more, coef), coef) >= best * (1 - 1e-12)
    burst = [10] * 8 + [400] * 2
    assert sorted(map(len, plan_batch(burst, (1e-3, 1e-4, 0.0, 1e-6)))) == [2, 8]
    assert plan_batch(burst, (1e-3, 0.0, 0.0, 0.0)) == [list(range(10))]
    assert plan_batch([], (1.0, 0, 0, 0)) == []


def test_plan_ties_keep_fewer_calls():
    """With only per-token terms and uniform lengths every partition costs the same: one call is kept."""
    assert plan_batch([40] * 16, (0.0, 1e-4, 1e-5, 0.0)) == [list(range(16))]
    capped = plan_batch([40] * 16, (0.0, 1e-4, 1e-5, 0.0), max_batch_size=5)
    check_is_partition(capped, 16)
    assert len(capped) == 4 and all(len(p) <= 5 for p in capped)


def synthetic_shapes(rng, count):
    out = []
    for _ in range(count):
        n = rng.randint(1, 16)
        out.append([rng.randint(2, 300) for _ in range(n)])
    return out


def test_fit_recovers_known_coefficients():
    true = (2.5e-3, 1.2e-4, 3e-5, 4e-7)
    model = BatchCostModel()
    assert model.coefficients() is None and model.predict([10]) is None and not model.fitted
    for lengths in synthetic_shapes(random.Random(5), 40):
        model.observe(lengths, block_cost(lengths, true), warmup=True)
    assert model.fitted and model.observations == 40
    assert model.coefficients() == pytest.approx(true, rel=1e-6)
    assert model.predict([50, 20, 7]) == pytest.approx(block_cost([50, 20, 7], true), rel=1e-6)


def test_fit_of_a_padded_backend_puts_the_dense_term_on_padded_tokens():
    """ONNX-like device: dense layers follow padded tokens; the fit finds a = 0 (never negative)."""
    true = (1e-3, 0.0, 1.5e-4, 2e-7)
    model = BatchCostModel()
    rng = random.Random(6)
    for lengths in synthetic_shapes(rng, 30):
        noisy = block_cost(lengths, true) * rng.uniform(0.97, 1.03)
        model.observe(lengths, noisy, warmup=True)
    c, a, d, b = model.coefficients()
    assert min(c, a, d, b) >= 0
    assert a < 0.1 * d and d == pytest.approx(true[2], rel=0.3)
    for lengths in synthetic_shapes(rng, 20):  # held-out shapes: within the noise (plus a little)
        assert model.predict(lengths) == pytest.approx(block_cost(lengths, true), rel=0.06)


def test_fit_without_mixed_lengths_does_not_split_real_from_padded_arbitrarily():
    """Uniform probes make real and padded tokens the same column: one of them carries the dense term."""
    model = BatchCostModel()
    for n, L in [(1, 8), (16, 8), (4, 32), (1, 128), (8, 64), (2, 256)]:
        model.observe([L] * n, 1e-3 + 1e-4 * n * L + 1e-7 * n * L * L, warmup=True)
    c, a, d, b = model.coefficients()
    assert min(a, d) == 0.0 and a + d == pytest.approx(1e-4, rel=1e-6)
    assert (c, b) == pytest.approx((1e-3, 1e-7), rel=1e-5)


def test_live_calls_refine_the_warm_up_fit():
    warm, live = (1e-3, 1e-4, 0.0, 1e-7), (2e-3, 2e-4, 0.0, 2e-7)  # the device got twice as slow
    probe = [30, 30, 200]
    predictions = {}
    for prior in (0.0, 0.25, 1.0):
        model = BatchCostModel(alpha=0.2, prior_weight=prior)
        rng = random.Random(7)
        for lengths in synthetic_shapes(rng, 20):
            model.observe(lengths, block_cost(lengths, warm), warmup=True)
        assert model.predict(probe) == pytest.approx(block_cost(probe, warm), rel=1e-6)
        for lengths in synthetic_shapes(rng, 200):
            model.observe(lengths, block_cost(lengths, live))
        predictions[prior] = model.predict(probe)
        assert model.observations == 220
    assert predictions[0.0] == pytest.approx(block_cost(probe, live), rel=1e-6)  # live calls only
    assert predictions[1.0] == pytest.approx(block_cost(probe, warm), rel=1e-6)  # probes only
    assert block_cost(probe, warm) * 1.2 < predictions[0.25] < block_cost(probe, live) * 0.9  # in between
    model = BatchCostModel()
    model.observe([10], 0.0)
    model.observe([], 1.0)
    assert model.observations == 0 and model.coefficients() is None  # ignored
    with pytest.raises(ValueError):
        BatchCostModel(alpha=0)


def test_cost_features():
    assert cost_features([3, 5, 2]) == (1.0, 10.0, 15.0, 75.0)
    assert cost_features([3, 5, 2], is_padded=False) == (1.0, 10.0, 10.0, 38.0)
    assert len(cost_features([1])) == len(COST_TERMS)


def test_calibrate_times_each_shape_and_fits_the_device():
    """A simulated device whose clock advances by a known cost per call: the probes recover it."""
    true = (3e-3, 2e-4, 1e-5, 5e-7)
    now = [0.0]
    calls = []

    def clock():
        return now[0]

    def run_batch(batch):
        calls.append([len(x) for x in batch])
        extra = 0.01 if calls.count(calls[-1]) == 1 else 0.0  # first run of a shape allocates
        now[0] += block_cost([len(x) for x in batch], true) + extra
        return [0.0] * len(batch)

    shapes = calibration_shapes(512, 32, 8192)
    assert len(shapes) >= len(COST_TERMS) + 2
    assert any(len(set(s)) > 1 for s in shapes)  # mixed lengths: real vs padded tokens identifiable
    model = BatchCostModel()
    n = calibrate(run_batch, lambda lengths: [[0] * k for k in lengths], shapes, model, clock=clock)
    assert n == len(shapes) and len(calls) == 2 * len(shapes)
    assert model.coefficients() == pytest.approx(true, rel=1e-6)  # the faster second runs only

    def failing(batch):
        return [RuntimeError("probe failed")] * len(batch)

    with pytest.raises(RuntimeError, match="probe failed"):
        calibrate(failing, lambda lengths: list(lengths), shapes, BatchCostModel())


def test_calibration_shapes_respect_the_limits():
    for max_len, max_size, max_tokens in [(512, 32, 8192), (128, 4, 256), (64, 1, 64), (16, 8, 16)]:
        shapes = calibration_shapes(max_len, max_size, max_tokens)
        assert shapes
        for s in shapes:
            assert max(s) <= max_len and len(s) <= max_size and len(s) * max(s) <= max_tokens


# ------------------------------------------------------------------------------------------ through the batcher


class RecordingBackend:
    def __init__(self) -> None:
        self.batches: list[list] = []

    def __call__(self, payloads):
        self.batches.append(list(payloads))
        return [p for p in payloads]


def calibrated(coef=(2e-3, 1e-4, 0.0, 1e-6)) -> BatchCostModel:
    model = BatchCostModel()
    for lengths in synthetic_shapes(random.Random(8), 12):
        model.observe(lengths, block_cost(lengths, coef), warmup=True)
    return model


def burst(batcher, lengths, request_of=None):
    """Submit each length as its own request (or grouped by ``request_of``) in one tick; payload (length,
    index) so that results and batches can be checked."""
    if request_of is None:
        return [batcher.run([(n, (n, i))]) for i, n in enumerate(lengths)]
    groups: dict[int, list] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(request_of[i], []).append((n, (n, i)))
    return [batcher.run(items) for items in groups.values()]


def test_batcher_runs_the_planned_sub_batches_oldest_first():
    lengths = [300, 12, 15, 300, 10, 14, 11, 13, 300, 16]  # the oldest is long

    async def main(cost_batching):
        be = RecordingBackend()
        b = Batcher("fake", be, max_batch_size=32, max_batch_tokens=100_000, max_queue_delay=0.05,
                    batch_cost=calibrated(), cost_batching=cost_batching)
        b.start()
        units = await asyncio.gather(*burst(b, lengths))
        await b.close()
        return be, [u[0].result for u in units]

    be, results = run(main(True))
    assert results == [(n, i) for i, n in enumerate(lengths)]
    assert sorted(len(x) for x in be.batches) == [3, 7]
    assert be.batches[0] == [(300, 0), (300, 3), (300, 8)]  # the oldest unit's sub-batch first
    assert all(p[0] < 20 for p in be.batches[1])
    be, _ = run(main(False))
    assert len(be.batches) == 1 and len(be.batches[0]) == len(lengths)  # the control: one padded batch


def test_batcher_plan_keeps_max_batch_size_and_the_fairness_cap():
    rng = random.Random(9)
    lengths = [rng.choice((rng.randint(5, 40), rng.randint(200, 400))) for _ in range(40)]
    request_of = [0] * 12 + list(range(1, 29))  # one 12-unit request, then 28 one-unit requests

    async def main():
        be = RecordingBackend()
        b = Batcher("fake", be, max_batch_size=8, max_batch_tokens=100_000, max_queue_delay=0.05,
                    max_request_batch_share=0.5, batch_cost=calibrated())
        b.start()
        groups = await asyncio.gather(*burst(b, lengths, request_of))
        await b.close()
        return be, groups

    be, groups = run(main())
    assert sorted(u.result for g in groups for u in g) == sorted((n, i) for i, n in enumerate(lengths))
    assert all(len(x) <= 8 for x in be.batches)
    # a sub-batch is part of one formed batch, and one-unit requests outnumber the long one's units in every
    # formed batch: the 12-unit request has at most ceil(0.5 x 8) = 4 places in each call
    assert all(sum(1 for _, i in x if i < 12) <= 4 for x in be.batches)
    assert (lengths[0], 0) in be.batches[0]  # the oldest unit runs in the first call
