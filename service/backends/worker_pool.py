"""Several worker processes for one encoder model (``instances: N`` with ``worker_process``): each backend call
is split into up to N parts that run at the same time, one per process, each process with its share of the
call's intra-op threads.

Why: on a small CPU, one process with two intra-op threads runs a short-sentence batch slower than two
processes with one thread each on its halves. Each op's Python dispatch is serial in one process, and a
DeBERTa forward is thousands of small ops (LayerNorm, softmax, gathers) whose thread hand-off costs about
what they compute. Measured with ``loadtest/bench/instances.py`` on the 2-core machine (v3-small-shaped
classifier, 11-text calls): 1 process x 2 threads 177.5 texts/s, 2 processes x 1 thread 231.3 (1.30x).
Triton's ``instance_group { count: N }`` on CPU is the same idea; here the instances share one queue and one
batcher, and a formed batch is divided between them instead of each instance taking batches of its own, so
the batcher's cost model, fairness cap and compute scheduler see one call per batch as before.

How a call is divided (:func:`split_parts`): the items sorted by length, cut into contiguous runs of about
equal tokens (neighbours in length pad least together), as many runs as the call has threads, processes
and items allow: under ``compute_scheduling: partition`` with two busy models a call gets one thread, and
then runs in one process instead of putting two single-thread processes on one core. Each part's results go
back to its own items; a part whose process died fails only its own items (the process restarts on its
next call, as a single worker does).

Health: each instance has its own watchdog (:meth:`.worker.WorkerBackend.watch`). While one is being
replaced the calls are divided between the others (fewer parts); the model is not ready only while no
instance can compute (the listener hears the lowest instance's reason, then None once one is back).
Recycling (``recycle_rss_mb``) is per instance, each against the threshold.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
from typing import Any, Callable, Sequence

from ..cpu_features import available_cores
from ..config import ModelConfig
from ..errors import Internal
from .base import UNBUDGETED, CallBudget, EncoderBackendDefaults, ModelMeta
from .worker import WorkerBackend, on_all

log = logging.getLogger(__name__)


def _length(item: Any) -> int:
    return len(item.input_ids)


def _per_instance(threads: int, instances: int) -> int:
    """A model's fixed thread count (0: none) as each of its instances' count: ``max(1, threads // instances)``."""
    return max(1, threads // instances) if threads > 0 else 0


def split_parts(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of a batch cut into at most ``parts`` groups of about equal tokens: sorted by length (longest
    first), then contiguous runs, each ending once it holds its share of the remaining tokens; no empty group.

    Args:
        lengths: tokens per item (n items).
        parts: the most groups wanted (>= 1).

    Returns:
        ``min(parts, n)`` lists of indices into ``lengths`` (each non-empty; [] when n is 0).
    """
    if not lengths:
        return []
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    parts = max(1, min(parts, len(order)))
    groups: list[list[int]] = []
    remaining = sum(lengths[i] for i in order)
    pos = 0
    for g in range(parts):
        left_groups = parts - g
        if left_groups == 1:
            groups.append(order[pos:])
            break
        target = remaining / left_groups
        group: list[int] = []
        held = 0
        # leave at least one item for each later group
        while pos < len(order) - (left_groups - 1) and (not group or held + lengths[order[pos]] / 2 <= target):
            group.append(order[pos])
            held += lengths[order[pos]]
            pos += 1
        remaining -= held
        groups.append(group)
    return groups


class WorkerPool(EncoderBackendDefaults):
    """The encoder :class:`relserve.service.backends.base.Backend` contract over ``config.instances`` worker
    processes (:class:`.worker.WorkerBackend` each; see the module docstring). Calls come from the model's
    executor thread one at a time, as for any backend; the parts of one call run in this pool's own threads.

    Args:
        config: the model's entry (``instances`` >= 2, ``worker_process`` not false).
        module, cls: the in-process backend class each child builds (``backends.ENCODER_BACKENDS``).

    Raises (from ``load`` / ``warmup``): whatever one child raised (the others are closed), or
    :class:`Internal` when the children decided different dtypes (``dtype: auto``; never seen, since they
    run the same gate on the same weights and text).
    """

    worker_processes = True

    def __init__(self, config: ModelConfig, module: str, cls: str) -> None:
        self.config = config
        n = config.instances
        # a fixed intra-op thread count is the model's, shared out between its instances
        self._fixed_threads = config.onnx_intra_op_threads if "onnx" in module else config.torch_intra_op_threads
        child = dataclasses.replace(config, torch_intra_op_threads=_per_instance(config.torch_intra_op_threads, n),
                                    onnx_intra_op_threads=_per_instance(config.onnx_intra_op_threads, n))
        self.workers = [WorkerBackend(child, module, cls) for _ in range(n)]
        self._threads = concurrent.futures.ThreadPoolExecutor(
            max_workers=len(self.workers), thread_name_prefix=f"relserve-pool-{config.name}")
        self.meta: ModelMeta | None = None
        self._unhealthy: dict[int, str] = {}  # instance -> why it cannot compute now (watch)
        self._told: str | None = None
        self._health_lock = threading.Lock()

    # ------------------------------------------------------------- attributes the runner reads

    @property
    def name(self) -> str:
        return self.workers[0].name

    @property
    def is_padded(self) -> bool:
        return self.workers[0].is_padded

    @property
    def max_batch_size(self) -> int | None:
        return self.workers[0].max_batch_size

    @property
    def pids(self) -> list[int | None]:
        """The worker processes' pids, one per instance (None where one is not running)."""
        return [w.pid for w in self.workers]

    @property
    def can_probe(self) -> bool:  # type: ignore[override]
        return self.workers[0].can_probe

    def probe_batch(self, lengths: Sequence[int]) -> list[Any]:
        """The first child's ``probe_batch(lengths)`` (NotImplementedError when its backend has none)."""
        return self.workers[0].probe_batch(lengths)

    # ------------------------------------------------------------- contract

    def _on_all(self, fn: Any) -> list[Any]:
        """``fn(worker)`` for every worker at once; the first failure (by instance order) is raised."""
        return on_all(self._threads, fn, self.workers)

    def _agreed(self, metas: list[Any]) -> Any:
        first = metas[0]
        if isinstance(first, ModelMeta):
            dtypes = {m.dtype for m in metas}
            if len(dtypes) > 1:
                raise Internal(f"model {self.config.name!r}: its {len(metas)} instances decided different dtypes "
                               f"({', '.join(sorted(dtypes))}); serve it with instances: 1 or a fixed dtype")
        return first

    def load(self) -> ModelMeta:
        try:
            self.meta = self._agreed(self._on_all(lambda w: w.load()))
        except BaseException:
            self.close()
            raise
        log.info("model %r: %d worker processes (%s)", self.config.name, len(self.workers),
                 ", ".join(str(p) for p in self.pids))
        return self.meta

    def warmup(self) -> ModelMeta | None:
        warmed = self._agreed(self._on_all(lambda w: w.warmup()))
        if isinstance(warmed, ModelMeta):
            self.meta = warmed
        return warmed

    def run(self, batch: Sequence[Any], budget: CallBudget = UNBUDGETED) -> list[Any]:
        """Compute ``batch`` in up to ``instances`` parts at once (:func:`split_parts`); returns one result or
        one Exception per item, in order. The call's thread share (``budget.threads()``, all cores outside
        ``partition``) bounds the parts, and each part's process gets ``share // parts`` threads."""
        items = list(batch)
        share = self._fixed_threads or budget.threads() or available_cores()
        workers = [w for w in self.workers if w.can_compute] or self.workers  # not those being replaced
        parts = split_parts([_length(x) for x in items], min(len(workers), share))
        threads = max(1, share // max(1, len(parts)))
        futures = [self._threads.submit(w.run, [items[i] for i in part], CallBudget.fixed(threads, budget.expected_s))
                   for w, part in zip(workers, parts)]
        out: list[Any] = [None] * len(items)
        for part, future in zip(parts, futures):
            try:
                results = future.result()
                if len(results) != len(part):
                    raise Internal(f"model {self.config.name!r}: a worker returned {len(results)} results for "
                                   f"{len(part)} items")
            except Exception as exc:  # this part's items only (e.g. its process died)
                results = [exc] * len(part)
            for i, r in zip(part, results):
                out[i] = r
        return out

    def watch(self, listener: Callable[[str | None], None]) -> None:
        """Supervise every instance (:meth:`.worker.WorkerBackend.watch`); ``listener(reason)`` while none can
        compute (``instance i: reason`` of the lowest i), ``listener(None)`` once one is back."""

        def instance_health(i: int, reason: str | None) -> None:
            with self._health_lock:
                if reason is None:
                    self._unhealthy.pop(i, None)
                else:
                    self._unhealthy[i] = reason
                first = min(self._unhealthy, default=None)
                down = len(self._unhealthy) == len(self.workers)
                told = f"instance {first}: {self._unhealthy[first]}" if down and first is not None else None
                if told == self._told:
                    return
                self._told = told
            listener(told)

        for i, w in enumerate(self.workers):
            w.watch(lambda reason, i=i: instance_health(i, reason))

    def process_stats(self) -> tuple[float, int] | None:
        """``(cpu seconds, resident bytes)`` summed over the running worker processes (the
        ``relserve_worker_*`` metrics); None when none runs."""
        stats = [s for s in (w.process_stats() for w in self.workers) if s is not None]
        if not stats:
            return None
        return sum(s[0] for s in stats), sum(s[1] for s in stats)

    def trim_heap(self) -> bool:
        """:func:`.heap.trim_heap` in every worker process; True if any trimmed."""
        return any(self._on_all(lambda w: w.trim_heap()))

    def memory_stats(self) -> dict[str, tuple[int, int, int]]:
        """Accelerator memory summed over the worker processes, per device, as of their last answers."""
        total: dict[str, tuple[int, int, int]] = {}
        for w in self.workers:
            for device, values in w.memory_stats().items():
                prev = total.get(device, (0, 0, 0))
                total[device] = tuple(a + b for a, b in zip(prev, values))  # type: ignore[assignment]
        return total

    def close(self) -> None:
        """End every worker process (:meth:`.worker.WorkerBackend.close`); no new one starts after this."""
        for w in self.workers:
            try:
                w.close()
            except Exception:
                log.exception("model %r: closing a worker process failed", self.config.name)
        self._threads.shutdown(wait=False, cancel_futures=True)
