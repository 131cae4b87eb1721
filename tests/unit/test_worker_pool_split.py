"""service/backends/worker_pool.py without processes: how a call is cut into parts (split_parts), how many
parts a call gets from its thread share, that each part's results go back to its own items and a failing part
fails only its own, and that fixed thread counts are shared out between the instances."""

from __future__ import annotations

import pytest

from relserve.service.backends import worker_pool
from relserve.service.backends.base import CallBudget
from relserve.service.backends.padding import WarmupEncoding
from relserve.service.backends.worker_pool import WorkerPool, split_parts
from relserve.service.config import ModelConfig
from relserve.service.errors import Internal


@pytest.mark.parametrize("lengths,parts", [
    ([5, 9, 3, 40, 12, 12, 7], 2), ([1] * 9, 4), ([100, 1, 1, 1], 2), ([3], 2), ([4, 4], 8), ([10, 20, 30], 3),
])
def test_parts_cover_every_item_once_without_empty_parts(lengths, parts):
    groups = split_parts(lengths, parts)
    assert len(groups) == min(parts, len(lengths))
    assert all(groups) and sorted(i for g in groups for i in g) == list(range(len(lengths)))


def test_parts_are_contiguous_in_length_and_about_equal_in_tokens():
    lengths = [28, 31, 12, 45, 19, 22, 30, 27, 8, 60, 25, 33, 17, 29, 24, 21]
    a, b = split_parts(lengths, 2)
    assert min(lengths[i] for i in a) >= max(lengths[i] for i in b)  # neighbours in length stay together
    ta, tb = sum(lengths[i] for i in a), sum(lengths[i] for i in b)
    assert abs(ta - tb) <= max(lengths)  # within one item of an even split
    # one very long item: it forms a part of its own, the rest the other
    assert split_parts([200, 10, 10, 10], 2) == [[0], [1, 2, 3]]
    assert split_parts([], 3) == []


class _FakeWorker:
    can_compute = True  # no watchdog complaint (WorkerBackend.can_compute)

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[list[int], int]] = []
        self.fail = fail

    def run(self, items, budget):
        self.calls.append(([len(x.input_ids) for x in items], budget.threads()))
        if self.fail:
            raise Internal("model 'm': worker process was killed by SIGKILL during run")
        return [len(x.input_ids) * 10 for x in items]


def _pool(tmp_path, instances=2, **kw) -> WorkerPool:
    pool = WorkerPool(ModelConfig(name="m", path=tmp_path, device="cpu", instances=instances, **kw),
                      "relserve.service.backends.torch_encoder", "TorchBackend")
    return pool


def _items(lengths):
    return [WarmupEncoding([1] * n) for n in lengths]


def test_a_call_is_divided_by_its_thread_share_and_results_keep_their_order(tmp_path, monkeypatch):
    pool = _pool(tmp_path, instances=2)
    pool.workers = [_FakeWorker(), _FakeWorker()]
    lengths = [5, 30, 7, 22, 9, 15]
    assert pool.run(_items(lengths), CallBudget.fixed(2)) == [n * 10 for n in lengths]
    (a, ta), (b, tb) = pool.workers[0].calls[0], pool.workers[1].calls[0]
    assert sorted(a + b) == sorted(lengths) and ta == tb == 1  # two parts, one thread each
    # two busy models under partition: one thread for this call -> one part, in one process
    assert pool.run(_items(lengths), CallBudget.fixed(1)) == [n * 10 for n in lengths]
    assert pool.workers[0].calls[1] == (sorted(lengths, reverse=True), 1) and len(pool.workers[1].calls) == 1
    # four threads for two instances: two parts of two threads each
    pool.run(_items(lengths), CallBudget.fixed(4))
    assert pool.workers[0].calls[2][1] == pool.workers[1].calls[1][1] == 2
    pool.close()


def test_a_failing_part_fails_only_its_own_items(tmp_path, monkeypatch):
    pool = _pool(tmp_path, instances=2)
    pool.workers = [_FakeWorker(), _FakeWorker(fail=True)]
    lengths = [40, 3, 38, 4]
    out = pool.run(_items(lengths), CallBudget.fixed(2))
    failed = {lengths[i] for i, r in enumerate(out) if isinstance(r, Internal)}
    ok = {lengths[i]: r for i, r in enumerate(out) if not isinstance(r, Exception)}
    assert failed == set(pool.workers[1].calls[0][0]) and failed and ok
    assert all(r == n * 10 for n, r in ok.items())
    assert "killed by SIGKILL" in str(next(r for r in out if isinstance(r, Internal)))
    pool.close()


def test_fixed_thread_counts_are_the_models_shared_out_between_instances(tmp_path, monkeypatch):
    pool = _pool(tmp_path, instances=2, torch_intra_op_threads=4)
    assert [w.config.torch_intra_op_threads for w in pool.workers] == [2, 2]
    pool.workers = [_FakeWorker(), _FakeWorker()]
    pool.run(_items([5, 6, 7, 8]), CallBudget.fixed(1))  # a fixed count wins over the share
    assert [w.calls[0][1] for w in pool.workers] == [2, 2]
    pool.close()
    assert worker_pool._per_instance(3, 2) == 1 and worker_pool._per_instance(1, 4) == 1
    assert worker_pool._per_instance(0, 2) == 0  # unset stays unset (the share decides)


def test_an_instance_being_replaced_gets_no_part(tmp_path):
    pool = _pool(tmp_path)
    pool.workers = [_FakeWorker(), _FakeWorker()]
    pool.workers[1].can_compute = False  # its watchdog is replacing it: the call goes to the other
    lengths = [7, 3, 5]
    assert pool.run(_items(lengths), CallBudget.fixed(2)) == [n * 10 for n in lengths]
    assert pool.workers[0].calls[0] == (sorted(lengths, reverse=True), 2) and pool.workers[1].calls == []
    pool.close()
