"""The compute scheduler (service/scheduling/cores.py) with fake backends and a fake clock: turn order between models,
no starvation, release on exception and close, yield points, the cost model's splitting, the batcher and the
decode loop waiting for the compute slot (cancelled work never runs, close never hangs), the core partition
(the share follows which models are active), and that torch keeps an intra-op thread count per calling
thread. No timed assertions: every wait below is
"until the scheduler reports the expected state", with a generous timeout that only guards against hangs."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from relserve.models.decode_types import DecodeOptions, Hypothesis
from relserve.service.backends.base import SeqUpdate
from relserve.service.config import ModelConfig
from relserve.service.errors import Unavailable
from relserve.service.scheduling.batcher import Batcher
from relserve.service.scheduling.cores import ComputeScheduler, partition, thread_share, yield_point
from relserve.service.scheduling.cost_model import CostModel
from relserve.service.scheduling.decode_loop import DecodeLoop

GUARD = 10.0  # seconds before a wait is declared a hang


def until(cond, what: str) -> None:
    end = time.monotonic() + GUARD
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


async def async_until(cond, what: str) -> None:
    end = time.monotonic() + GUARD
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.001)


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def in_thread(fn, *args) -> tuple[threading.Thread, dict]:
    """Run ``fn(*args)`` in a thread; the dict gets 'result' or 'error'."""
    out: dict = {}

    def body():
        try:
            out["result"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            out["error"] = exc

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, out


def blocker(record: list, name: str, gate: threading.Event):
    def fn(_arg):
        record.append(name)
        assert gate.wait(GUARD), "gate never opened"
        return name
    return fn


# ------------------------------------------------------------------------------------ the slot


def test_waiting_models_get_the_slot_in_arrival_order():
    sched = ComputeScheduler("fair")
    a, b, c = sched.lane("a"), sched.lane("b"), sched.lane("c")
    record: list[str] = []
    gate = threading.Event()
    ta, _ = in_thread(a.run, blocker(record, "a", gate), None)
    until(lambda: sched.holder == "a", "a to hold the slot")
    tc, _ = in_thread(c.run, lambda _x: record.append("c"), None)
    until(lambda: sched.waiting == ["c"], "c to wait")
    tb, _ = in_thread(b.run, lambda _x: record.append("b"), None)
    until(lambda: sched.waiting == ["c", "b"], "b to wait behind c")
    assert record == ["a"]  # nobody computes next to the holder
    gate.set()
    for t in (ta, tb, tc):
        t.join(GUARD)
    assert record == ["a", "c", "b"]
    assert sched.holder is None and sched.waiting == []


def test_two_busy_models_alternate_no_starvation():
    """Each call finishes only once the other model waits, so a model that wants the slot again queues
    behind the waiting one: strict turns, however fast one model resubmits."""
    sched = ComputeScheduler("fair")
    lanes = {"a": sched.lane("a"), "b": sched.lane("b")}
    record: list[str] = []
    calls = 6

    def call(name: str, other: str):
        def fn(_arg):
            record.append(name)
            # hold until the other model waits (or is done): it must get the next turn
            until(lambda: other in sched.waiting or done[other].is_set(), f"{other} to wait")
        return fn

    done = {"a": threading.Event(), "b": threading.Event()}

    def loop(name: str, other: str):
        for _ in range(calls):
            lanes[name].run(call(name, other), None)
        done[name].set()

    ta, oa = in_thread(loop, "a", "b")
    tb, ob = in_thread(loop, "b", "a")
    ta.join(GUARD)
    tb.join(GUARD)
    assert "error" not in oa and "error" not in ob
    assert sorted(record) == ["a"] * calls + ["b"] * calls
    assert all(x != y for x, y in zip(record, record[1:])), record  # turns: never the same model twice


def test_exception_releases_the_slot():
    sched = ComputeScheduler("fair")
    a, b = sched.lane("a"), sched.lane("b")

    def boom(_x):
        raise RuntimeError("kernel exploded")

    with pytest.raises(RuntimeError, match="kernel exploded"):
        a.run(boom, None)
    assert sched.holder is None
    assert b.run(lambda x: x + 1, 1) == 2
    timing = b.take_timing()
    assert timing is not None and timing.compute_s >= 0 and b.take_timing() is None


def test_close_while_waiting_raises_and_leaves_the_holder_alone():
    sched = ComputeScheduler("fair")
    a, b = sched.lane("a"), sched.lane("b")
    gate = threading.Event()
    record: list[str] = []
    ta, _ = in_thread(a.run, blocker(record, "a", gate), None)
    until(lambda: sched.holder == "a", "a to hold")
    tb, out = in_thread(b.run, lambda _x: record.append("b"), None)
    until(lambda: sched.waiting == ["b"], "b to wait")
    b.close()
    tb.join(GUARD)
    assert not tb.is_alive() and isinstance(out.get("error"), Unavailable)
    assert sched.holder == "a" and sched.waiting == []
    with pytest.raises(Unavailable, match="shutting down"):
        b.run(lambda _x: record.append("b"), None)
    gate.set()
    ta.join(GUARD)
    assert record == ["a"]


def test_closing_the_holder_hands_the_slot_on():
    """A model that closes while its (hung) call holds the slot must not block the other models."""
    sched = ComputeScheduler("fair")
    a, b = sched.lane("a"), sched.lane("b")
    gate = threading.Event()
    record: list[str] = []
    ta, _ = in_thread(a.run, blocker(record, "a", gate), None)
    until(lambda: sched.holder == "a", "a to hold")
    tb, out = in_thread(b.run, lambda _x: record.append("b") or "ok", None)
    until(lambda: sched.waiting == ["b"], "b to wait")
    a.close()
    tb.join(GUARD)
    assert out == {"result": "ok"} and record == ["a", "b"]
    gate.set()
    ta.join(GUARD)
    assert sched.holder is None  # a's late release does not take anything from anyone


def test_shared_mode_never_waits():
    sched = ComputeScheduler("shared")
    a, b = sched.lane("a", max_hold=0.001), sched.lane("b")
    gate = threading.Event()
    record: list[str] = []
    ta, _ = in_thread(a.run, blocker(record, "a", gate), None)
    until(lambda: record == ["a"], "a to run")
    assert b.run(lambda _x: "b ran beside a", None) == "b ran beside a"
    gate.set()
    ta.join(GUARD)
    with pytest.raises(ValueError, match="not one of"):
        ComputeScheduler("roundrobin")


# ------------------------------------------------------------------------------------ yield points


def test_holder_yields_to_a_waiting_model_after_max_hold():
    clock = FakeClock()
    sched = ComputeScheduler("fair", clock=clock)
    a, b = sched.lane("a", max_hold=0.020), sched.lane("b")
    record: list[str] = []
    ready = threading.Event()

    def long_call(_x):
        record.append("a: layer 1")
        ready.set()
        until(lambda: sched.waiting == ["b"], "b to wait")
        clock.t += 0.010
        yield_point()  # held 10 ms < 20 ms: keeps the slot
        assert record == ["a: layer 1"] and sched.holder == "a"
        record.append("a: layer 2")
        clock.t += 0.015
        yield_point()  # held 25 ms and b waits: b computes now, a continues after it
        record.append("a: layer 3")
        return "a"

    ta, out = in_thread(a.run, long_call, None)
    ready.wait(GUARD)
    b_out = b.run(lambda _x: record.append("b") or "b", None)
    ta.join(GUARD)
    assert out == {"result": "a"} and b_out == "b"
    assert record == ["a: layer 1", "a: layer 2", "b", "a: layer 3"]
    assert sched.handovers == 1
    timing = a.take_timing()
    assert timing is not None and timing.yields == 1
    assert timing.compute_s == pytest.approx(0.025)  # the fake clock: held 25 ms, the wait for b not counted


def test_yield_point_is_a_no_op_without_a_waiter_outside_a_call_and_without_a_cap():
    clock = FakeClock()
    sched = ComputeScheduler("fair", clock=clock)
    yield_point()  # no call runs in this thread
    a, uncapped = sched.lane("a", max_hold=0.001), sched.lane("u", max_hold=0.0)

    def call(_x):
        clock.t += 1.0
        yield_point()  # nobody waits
        return sched.handovers

    assert a.run(call, None) == 0 and uncapped.run(call, None) == 0


def test_yield_point_stops_a_call_of_a_closed_model():
    sched = ComputeScheduler("fair")
    a = sched.lane("a", max_hold=0.02)

    def call(_x):
        a.close()
        yield_point()
        return "not reached"

    with pytest.raises(Unavailable, match="shutting down"):
        a.run(call, None)
    assert sched.holder is None


# ------------------------------------------------------------------------------------ the cost model


def test_cost_model_fits_seconds_per_token_and_an_intercept():
    cm = CostModel(max_batch_time=0.020)
    assert cm.coefficients() is None and cm.estimate(100) is None
    cm.observe(512, 0.100)
    a, b = cm.coefficients()
    assert a == 0.0 and b == pytest.approx(0.100 / 512)  # one size seen: seconds per padded token
    cm = CostModel(max_batch_time=0.020, alpha=1.0)
    cm.observe(0, 1.0)  # ignored
    cm.observe(100, 0.003)
    cm.observe(300, 0.007)  # alpha 1: the newest point; with one point in the means: per token again
    assert cm.estimate(300) == pytest.approx(0.007)
    cm = CostModel(max_batch_time=0.020, alpha=0.5)
    for x, y in [(100, 0.003), (300, 0.007), (100, 0.003), (300, 0.007)]:
        cm.observe(x, y)  # y = 0.001 + 2e-5 x exactly
    a, b = cm.coefficients()
    assert a == pytest.approx(0.001) and b == pytest.approx(2e-5)


def test_cost_model_splits_batches_into_pieces_within_the_budget():
    cm = CostModel(max_batch_time=0.020)
    assert cm.split([512] * 4) == [[0, 1, 2, 3]]  # nothing observed yet: the batch as formed
    cm.observe(512, 0.100)  # ~0.2 ms per padded token: one 512-token window is over the budget already
    assert cm.split([512] * 4) == [[0], [1], [2], [3]]  # every window alone, still in batch order
    assert cm.split([]) == [] and cm.split([9999]) == [[0]]
    cm = CostModel(max_batch_time=0.25, min_piece_tokens=0)
    cm.observe(100, 1.0)  # 10 ms per token: 25 tokens per piece
    assert cm.split([10] * 6) == [[0, 1], [2, 3], [4, 5]]  # padded: 2 x 10 = 20 tokens fits, 3 x 10 does not
    assert cm.split([10, 10, 3, 3, 3], is_padded=False) == [[0, 1, 2], [3, 4]]  # unpadded: sums
    assert cm.split([5, 20, 5], is_padded=True) == [[0], [1], [2]]  # 2 x 20 = 40 > 25
    assert CostModel(max_batch_time=0.0).split([10] * 6) == [list(range(6))]  # 0: no cap


def test_cost_model_never_cuts_pieces_of_short_texts_below_min_piece_tokens():
    """Contention-swollen estimates must not turn a queue of short texts into one-text calls."""
    cm = CostModel(max_batch_time=0.020)  # default floor: 512 padded tokens
    cm.observe(16, 0.037)  # one 16-token text measured at 37 ms while clients took the cores
    assert cm.split([16] * 32) == [list(range(32))]  # 32 x 16 = 512 tokens: not cut
    assert cm.split([16] * 40) == [list(range(32)), list(range(32, 40))]  # cut only past the floor
    assert cm.split([384] * 3) == [[0], [1], [2]]  # QA windows: 2 x 384 > 512, each alone


# ------------------------------------------------------------------------------------ batcher and decode loop


class RecordingBackend:
    def __init__(self) -> None:
        self.batches: list[list] = []

    def __call__(self, payloads):
        self.batches.append(list(payloads))
        return [p * 2 for p in payloads]


async def behind_another_model(sched, batcher, items):
    """Model "other" holds the slot (until ``gate`` is set) while ``batcher`` runs ``items``; returns
    ``(task, gate, thread)`` once the batch waits for the slot."""
    gate = threading.Event()
    t, _ = in_thread(sched.lane("other").run, blocker([], "other", gate), None)
    await async_until(lambda: sched.holder == "other", "other to hold")
    task = asyncio.ensure_future(batcher.run(items))
    await async_until(lambda: sched.waiting == ["fake"], "the batch to wait for the slot")
    return task, gate, t


def test_batcher_runs_a_formed_batch_in_pieces_each_taking_the_slot():
    sched = ComputeScheduler("fair")
    be = RecordingBackend()

    async def main():
        b = Batcher("fake", be, max_queue_delay=0.0, compute=sched.lane("fake", max_hold=0.25))
        b.cost_model.observe(100, 1.0)  # as if measured: 10 ms per padded token
        b.cost_model.min_piece_tokens = 0  # tiny units here; the floor has its own test
        b.start()
        task, gate, t = await behind_another_model(sched, b, [(10, i) for i in range(6)])
        gate.set()
        units = await task
        t.join(GUARD)
        await b.close()
        return units, b.executions

    units, executions = asyncio.run(asyncio.wait_for(main(), 30))
    assert [u.result for u in units] == [i * 2 for i in range(6)]
    assert be.batches == [[0, 1], [2, 3], [4, 5]] and executions == 3
    assert [u.batch_size for u in units] == [2] * 6
    assert sched.grants == 4  # other once, then each piece took the slot anew


def test_batcher_work_cancelled_while_waiting_for_the_slot_never_runs():
    sched = ComputeScheduler("fair")
    be = RecordingBackend()

    async def main():
        b = Batcher("fake", be, max_queue_delay=0.0, compute=sched.lane("fake"))
        b.start()
        task, gate, t = await behind_another_model(sched, b, [(5, 1), (5, 2)])
        task.cancel()  # the client went away while its batch waited for the cores
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        t.join(GUARD)
        await async_until(lambda: sched.holder is None and not sched.waiting, "the slot to be free")
        assert be.batches == []  # the slot came, but nothing was computed for the cancelled request
        later = await b.run([(5, 3)])
        await b.close()
        return later

    later = asyncio.run(asyncio.wait_for(main(), 30))
    assert be.batches == [[3]] and later[0].result == 6


def test_batcher_close_while_waiting_for_the_slot_does_not_hang():
    sched = ComputeScheduler("fair")
    be = RecordingBackend()

    async def main():
        b = Batcher("fake", be, max_queue_delay=0.0, compute=sched.lane("fake"))
        b.start()
        task, gate, t = await behind_another_model(sched, b, [(5, 1)])
        await b.close()
        assert sched.waiting == []  # the waiting backend thread gave up
        with pytest.raises(Unavailable, match="shutting down"):
            await task
        gate.set()
        t.join(GUARD)

    asyncio.run(asyncio.wait_for(main(), 30))
    assert be.batches == []


class StepBackend:
    """Each source decodes to one token in one step."""

    name = "fake"

    def __init__(self) -> None:
        self.started: list[list[int]] = []
        self.stepped: list[tuple[int, ...]] = []
        self.released: list[int] = []

    def start(self, items, budget=None):
        self.started.append([it.seq_id for it in items])
        return [1 for _ in items]

    def step(self, plan, budget=None):
        self.stepped.append(plan.seq_ids)
        return [SeqUpdate(live=0, best_tokens=[7], best_score=-1.0, results=[_hyp()]) for _ in plan.seq_ids]

    def release(self, seq_ids):
        self.released.extend(seq_ids)


def _hyp():
    return Hypothesis(tokens=[7], log_prob=-1.0, score=-1.0, finished=True, truncated=False)


def test_decode_loop_encode_cancelled_while_waiting_for_the_slot_never_runs():
    sched = ComputeScheduler("fair")
    be = StepBackend()
    opts = DecodeOptions(beam_size=1, n_best=1, max_length=4)

    async def main():
        loop = DecodeLoop("mt", be, compute=sched.lane("mt"))
        loop.start()
        gate = threading.Event()
        t, _ = in_thread(sched.lane("other").run, blocker([], "other", gate), None)
        await async_until(lambda: sched.holder == "other", "other to hold")
        task = asyncio.ensure_future(loop.run([([5, 6], opts)]))
        await async_until(lambda: sched.waiting == ["mt"], "the encoder batch to wait for the slot")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        t.join(GUARD)
        await async_until(lambda: sched.holder is None and not sched.waiting, "the slot to be free")
        assert be.started == []
        result = await loop.run([([8], opts)])
        await loop.close()
        return result

    result = asyncio.run(asyncio.wait_for(main(), 30))
    assert len(be.started) == 1 and len(be.stepped) == 1 and result[0][0].tokens == [7]


# ------------------------------------------------------------------------------------ partition and threads


def test_partition_sizes_onnx_pools_once(tmp_path: Path):
    models = [ModelConfig(name="a", path=tmp_path), ModelConfig(name="b", path=tmp_path, torch_intra_op_threads=3),
              ModelConfig(name="c", path=tmp_path, onnx_intra_op_threads=5)]
    a, b, c = partition(models, cores=7)
    assert [m.onnx_intra_op_threads for m in (a, b, c)] == [2, 2, 5]  # 7 // 3; explicit values are kept
    assert [m.torch_intra_op_threads for m in (a, b, c)] == [0, 3, 0]  # torch follows thread_share per call
    assert [m.onnx_intra_op_threads for m in partition(models * 2, cores=2)] == [1, 1, 5, 1, 1, 5]  # at least 1
    assert partition([], cores=4) == ()


def test_thread_share_splits_the_cores_between_active_models():
    clock = FakeClock()
    sched = ComputeScheduler("partition", clock=clock, cores=4)
    qa, light, idle = sched.lane("qa"), sched.lane("light"), sched.lane("idle")
    assert thread_share() == 0  # outside a call: the backend's default
    assert qa.run(lambda _x: thread_share(), None) == 4  # alone: every core
    clock.t += 0.5
    assert light.run(lambda _x: thread_share(), None) == 2  # qa ran 0.5 s ago: still active
    gate = threading.Event()
    shares: list[int] = []

    def long_call(_x):
        shares.append(thread_share())
        assert gate.wait(GUARD)
        shares.append(thread_share())

    clock.t += 5.0  # both idle for longer than ACTIVE_WINDOW_S
    t, _ = in_thread(qa.run, long_call, None)
    until(lambda: shares == [4], "qa to start alone")
    assert light.run(lambda _x: thread_share(), None) == 2  # qa is computing
    gate.set()  # qa's next sub-layer sees light active: half the cores
    t.join(GUARD)
    assert shares == [4, 2]
    idle.close()
    clock.t += 5.0
    assert light.run(lambda _x: thread_share(), None) == 4
    assert ComputeScheduler("fair", cores=4).lane("x").run(lambda _x: thread_share(), None) == 0
    assert ComputeScheduler("partition", cores=1).lane("x").run(lambda _x: thread_share(), None) == 1


def test_torch_keeps_the_thread_count_per_calling_thread():
    """What partition relies on: OpenMP's thread count is per calling thread, so two model threads can hold
    different counts at once (torch.set_num_threads only changes the default that new threads adopt)."""
    torch = pytest.importorskip("torch")
    from relserve.service.backends.torch_device import use_threads

    seen: dict[str, int] = {}
    both_set = threading.Barrier(2)

    def model_thread(name: str, n: int) -> None:
        use_threads(n)
        torch.ones(4).sum()  # a torch op in this thread
        both_set.wait(GUARD)  # the other thread has set its own count by now
        seen[name] = torch.get_num_threads()

    threads = [threading.Thread(target=model_thread, args=("one", 1)),
               threading.Thread(target=model_thread, args=("three", 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(GUARD)
    assert seen == {"one": 1, "three": 3}


def test_batch_time_cap_cuts_formed_batches_only_while_another_model_is_active():
    """max_batch_time_ms is for the other models' sake: a model alone runs the least-predicted-time plan
    (here one call, since each call costs 1 ms more than its tokens), and pieces within the cap only while
    another model ran within ACTIVE_WINDOW_S."""
    from types import SimpleNamespace

    from relserve.service.scheduling.cores import ACTIVE_WINDOW_S
    from relserve.service.scheduling.cost_model import BatchCostModel, cost_features

    clock = FakeClock()
    sched = ComputeScheduler("partition", clock=clock, cores=2)
    lane, other = sched.lane("m", max_hold=0.010), sched.lane("other")
    cost = BatchCostModel()
    for lengths in ([3], [3, 3], [2, 5, 4], [6, 6, 6, 6], [1, 2], [4] * 6, [5, 1, 1], [2] * 8):
        real = cost_features(lengths)[1]
        cost.observe(lengths, 1e-3 + 1e-3 * real, warmup=True)  # 1 ms per call, 1 ms per real token
    b = Batcher("m", RecordingBackend(), max_queue_delay=0.0, compute=lane, is_padded=False, batch_cost=cost)
    b.cost_model.min_piece_tokens = 0
    formed = [SimpleNamespace(tokens=3) for _ in range(6)]  # 19 ms as one call
    assert cost.fitted and not lane.contended
    assert b.plan(formed) == [list(range(6))]
    clock.t = 10.0
    other.run(lambda _x: None, None)
    clock.t += ACTIVE_WINDOW_S / 2
    assert lane.contended
    pieces = b.plan(formed)
    assert sorted(i for p in pieces for i in p) == list(range(6)) and len(pieces) >= 2
    assert all(len(p) <= 3 for p in pieces)  # 1 + 3 x 3 ms = the 10 ms cap
    clock.t += ACTIVE_WINDOW_S
    assert not lane.contended and b.plan(formed) == [list(range(6))]
