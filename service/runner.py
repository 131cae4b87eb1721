"""A served model: backend + scheduler + metrics, behind a small lifecycle (no task logic here).

:class:`Runner` is the lifecycle every served model shares (load and warm-up, start, ready, info, close,
the UNAVAILABLE answer before it is ready, the model's own tokenization threads). :class:`ModelRunner`
serves encoder models (classification, QA) through the batcher; :class:`TranslationRunner` serves
translation models through the decode loop. The server takes a list of runners (built from the config by
``relserve.service.registry.build_runner``, or built by a test around a fake backend); each task's module
in :mod:`relserve.service.tasks` validates a request, reserves its places in the runner's scheduler,
tokenizes through :meth:`Runner.tokenize`, submits and post-processes.

No torch here: the backend is reached through the contracts in :mod:`relserve.service.backends.base`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from . import metrics, tracing
from .backends.base import TASK_QA, TASK_TRANSLATION, Backend, ModelMeta, StepBackend
from .backends import gate_cache
from .backends.progress import log_phase
from .config import DEFAULT_DOC_STRIDE, ModelConfig
from .errors import ConfigError, Unavailable
from .scheduling.batcher import Batcher, BatchStats
from .scheduling.cores import ComputeScheduler, Lane
from .scheduling.cost_model import COST_TERM_UNITS, BatchCostModel, calibrate, calibration_shapes
from .scheduling.decode_loop import DecodeLoop, LoopObserver
from .scheduling.decode_pool import DecodePool

log = logging.getLogger(__name__)

# Threads per model for tokenizing (its own pool: a long tokenization never waits for, or holds up, another
# model's; two, so one long request of a model does not hold up its short ones).
TOKENIZATION_THREADS = 2


@dataclass(frozen=True)
class ModelInfo:
    """What a loaded model is (relserve.v1 ListModels, KServe v2 model metadata, the load log line)."""

    name: str
    task: str
    family: str
    backend: str
    device: str
    dtype: str
    max_seq_len: int
    labels: tuple[str, ...]
    max_batch_size: int
    dtype_reason: str = ""  # why this dtype (ModelMeta.dtype_reason: dtype auto's choice and its gate numbers)


class Runner:
    """One served model's lifecycle: ``load()`` (blocking: load + warm-up; run it in a thread), then
    ``await start()`` (the scheduler on the running loop), then requests, then ``await close()``.
    ``state``: created -> loading -> warming -> ready | failed; closed.

    Subclasses say what the loaded model must satisfy (:meth:`_check_loaded`) and which scheduler serves it
    (:meth:`_make_scheduler`: anything with ``start()``, ``await close()`` and ``max_batch_size``).

    Args:
        config: the model's config entry.
        backend: anything following a contract of :mod:`relserve.service.backends.base` (a fake in tests).
    """

    def __init__(self, config: ModelConfig, backend: Any) -> None:
        self.config = config
        self.name = config.name
        self.backend = backend
        self.meta: ModelMeta | None = None
        self.max_seq_len = 0  # tokens per sequence fed to the model (translation: max_source_tokens)
        self.state = "created"
        self.scheduler: Any = None
        self._tokenization: concurrent.futures.ThreadPoolExecutor | None = None  # this model's, from start()
        # the server's compute scheduler (set by InferenceServer before start; None: the model computes
        # without coordinating with other models)
        self.compute: ComputeScheduler | None = None
        # why a started model cannot compute now (its worker process is being replaced); None: it can
        self.unavailable: str | None = None
        # called with ``ready`` whenever it changes after start (the server's per-model health)
        self.readiness_listeners: list[Callable[[bool], None]] = []
        # the repository version this runner serves ("1" for a model that is not from a versioned repository)
        self.version = "1"
        self._tokenizing = 0  # calls in this model's tokenization threads now (drain)
        self._open_units: set[asyncio.Future] = set()  # reply slots of submitted units not yet answered (drain)

    # ------------------------------------------------------------------ lifecycle

    def load(self) -> None:
        """Load and warm up (blocking).

        Raises:
            ConfigError: the loaded model does not fit the config (see the subclass).
            Exception: whatever the backend raises. Either way ``state`` becomes ``failed``.
        """
        try:
            self.state = "loading"
            t0 = time.monotonic()
            meta = self.backend.load()
            log_phase(self.name, "weights and tokenizer loaded", time.monotonic() - t0,
                      f"{meta.backend}, {meta.device}, {meta.dtype}")
            self._check_loaded(meta)
            self.meta = meta
            self.state = "warming"
            if self.config.warmup:
                t0 = time.monotonic()
                warmed = self.backend.warmup()
                if isinstance(warmed, ModelMeta):  # e.g. dtype: auto decided by the agreement gate
                    self.meta = warmed
                log_phase(self.name, "warm-up", time.monotonic() - t0,
                          "includes the dtype decision" if self.config.dtype == "auto" else "")
            if self.meta.dtype_reason:
                log.info("model %r: dtype %s (%s)", self.name, self.meta.dtype, self.meta.dtype_reason)
        except BaseException:
            self.state = "failed"
            raise

    async def start(self) -> None:
        """Start the scheduler on the running loop and publish model_info. Call after :meth:`load`."""
        if self.meta is None:
            raise RuntimeError(f"model {self.name!r}: start() before load()")
        self.scheduler = self._make_scheduler()
        self._count_submissions(self.scheduler)
        self.scheduler.trace_attributes = {"relserve.model": self.name, "relserve.backend": self.meta.backend,
                                           "relserve.dtype": self.meta.dtype}  # on each backend call's span
        self.scheduler.start()
        self._tokenization = concurrent.futures.ThreadPoolExecutor(
            max_workers=TOKENIZATION_THREADS, thread_name_prefix=f"relserve-tok-{self.name}")
        m = self.meta
        metrics.set_model_info(self.name, m.family, m.task, m.backend, m.device, m.dtype)
        metrics.add_memory_source(self.backend.memory_stats)
        if self.backend.worker_processes:  # worker_process: its children's CPU and memory
            metrics.add_worker_source(self.name, self.backend.process_stats)
        self.state = "ready"
        loop = asyncio.get_running_loop()
        # a worker that dies, hangs or overruns its batch turns the model not ready until it is replaced
        self.backend.watch(lambda reason: loop.call_soon_threadsafe(self._set_unavailable, reason))

    def _set_unavailable(self, reason: str | None) -> None:
        """On the loop: the backend says the model cannot compute (``reason``) or can again (None). Queued
        calls fail UNAVAILABLE naming the reason and new ones are refused with it until then."""
        if self.state != "ready" or reason == self.unavailable:
            return
        was_ready = self.ready
        self.unavailable = reason
        if reason is not None:
            log.warning("model %r: not ready: %s", self.name, reason)
            self.scheduler.suspend(reason)
        else:
            log.info("model %r: ready again", self.name)
            self.scheduler.resume()
        if self.ready != was_ready:
            for listener in self.readiness_listeners:
                listener(self.ready)

    def _count_submissions(self, scheduler: Any) -> None:
        """Keep the reply slot of every unit ``scheduler.submit`` queues until it is answered, so that
        :meth:`drain` knows when the queue and the running batches of this model are done (every task submits
        through ``submit``; the scheduler itself is shared code that need not know about draining)."""
        submit = scheduler.submit

        def counted(*args: Any, **kwargs: Any) -> Any:
            units = submit(*args, **kwargs)
            for unit in units:
                self._open_units.add(unit.future)
                unit.future.add_done_callback(self._open_units.discard)
            return units

        scheduler.submit = counted

    @property
    def busy(self) -> bool:
        """Work of this model is under way: a call tokenizing or holding queue places, units queued or in a
        running batch."""
        s = self.scheduler
        return bool(self._tokenizing or self._open_units or (s is not None and (s.reserved or s.queue_depth)))

    async def drain(self, timeout: float, settle: float = 0.05) -> bool:
        """Wait until no work of this model is under way (:attr:`busy`) and has stayed so for ``settle`` seconds
        (a call that looked this runner up just before it stopped being served reaches its queue meanwhile), at
        most ``timeout`` seconds; then :meth:`close`. Work still under way at the timeout fails UNAVAILABLE.

        Returns:
            whether it drained within ``timeout``.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout)
        idle_since: float | None = None
        drained = False
        while True:
            now = loop.time()
            if self.busy:
                idle_since = None
            elif idle_since is None:
                idle_since = now
            elif now - idle_since >= settle:
                drained = True
                break
            if now >= deadline:
                break
            await asyncio.sleep(0.005)
        if not drained:
            log.warning("model %r version %s: work still under way after %.1f s of draining ends UNAVAILABLE",
                        self.name, self.version, timeout)
        await self.close()
        return drained

    async def close(self) -> None:
        """Stop the scheduler (queued and running work fails with UNAVAILABLE) and close the backend."""
        self.state = "closed"
        if self.scheduler is not None:
            await self.scheduler.close()
        if self._tokenization is not None:
            self._tokenization.shutdown(wait=False, cancel_futures=True)
            self._tokenization = None
        metrics.remove_memory_source(self.backend.memory_stats)
        if self.backend.worker_processes:
            metrics.remove_worker_source(self.name, self.backend.process_stats)
        try:
            # off the event loop: joining worker processes or freeing a model's weights takes seconds, and the
            # other models (and, after a swap, this model's new version) serve meanwhile
            await asyncio.to_thread(self.backend.close)
        except Exception:
            log.exception("model %r: backend close failed", self.name)

    def _check_loaded(self, meta: ModelMeta) -> None:
        """Raise ConfigError when the loaded model cannot be served with this config; may set ``max_seq_len``."""
        raise NotImplementedError

    def _make_scheduler(self) -> Any:
        raise NotImplementedError

    async def tokenize(self, fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
        """``fn(*args, **kwargs)`` in this model's tokenization threads (never on the event loop, never in a
        pool another model shares); returns (its result, seconds) and records the tokenization metric.

        Raises:
            Unavailable: the model is closed.
            whatever ``fn`` raises.
        """
        pool = self._tokenization
        if pool is None:
            raise Unavailable(f"model {self.name!r} is not ready (state: {self.state}); retry later")
        t0 = time.monotonic()
        self._tokenizing += 1
        try:
            result = await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args, **kwargs))
        finally:
            self._tokenizing -= 1
        seconds = time.monotonic() - t0
        metrics.observe_tokenization(self.name, seconds)
        if tracing.ENABLED:
            tracing.record("relserve.tokenize", t0, t0 + seconds, {"relserve.model": self.name})
        return result, seconds

    def _compute_lane(self) -> Lane | None:
        """This model's handle on the server's compute scheduler, capped at ``max_batch_time_ms``."""
        if self.compute is None:
            return None
        return self.compute.lane(self.name, max_hold=self.config.max_batch_time_ms / 1000.0)

    @property
    def ready(self) -> bool:
        """Loaded, warmed, started and able to compute now (ModelReady, per-model health)."""
        return self.state == "ready" and self.unavailable is None

    def not_ready_message(self) -> str:
        """Why the model takes no calls now, for an UNAVAILABLE refusal."""
        if self.state == "ready" and self.unavailable is not None:
            return f"model {self.name!r} is not ready: {self.unavailable}; retry later"
        return f"model {self.name!r} is not ready yet (state: {self.state}); retry later"

    @property
    def task(self) -> str | None:
        return self.meta.task if self.meta else None

    def info(self) -> "ModelInfo":
        """What this model is (before loading: what its config says)."""
        m = self.meta
        return ModelInfo(
            name=self.name,
            task=m.task if m else "",
            family=m.family if m else "",
            backend=m.backend if m else self.config.backend,
            device=m.device if m else self.config.device,
            dtype=m.dtype if m else self.config.dtype,
            max_seq_len=self.max_seq_len,
            labels=tuple(m.labels) if m else (),
            max_batch_size=self.scheduler.max_batch_size if self.scheduler else self.config.max_batch_size,
            dtype_reason=m.dtype_reason if m else "",
        )

    def check_ready(self) -> Any:
        """The scheduler of a ready model.

        Raises:
            Unavailable: not loaded and warmed up yet, failed or closed (names the state).
        """
        if self.state != "ready" or self.scheduler is None:
            raise Unavailable(f"model {self.name!r} is not ready (state: {self.state}); retry later")
        if self.unavailable is not None:
            raise Unavailable(self.not_ready_message())
        return self.scheduler


class ModelRunner(Runner):
    """An encoder model (classification or QA) behind the batcher.

    Args:
        config: the model's config entry.
        backend: anything following :class:`relserve.service.backends.base.Backend` (a fake in tests).
    """

    def __init__(self, config: ModelConfig, backend: Backend) -> None:
        super().__init__(config, backend)
        # fitted by load() from warm-up probes, then refined by the batcher from every call
        self.batch_cost = BatchCostModel()

    def load(self) -> None:
        """Load and warm up (:meth:`Runner.load`), then, with warm-up and ``cost_batching`` on, fit the batch
        cost model from probe batches of a few shapes
        (:func:`relserve.service.scheduling.cost_model.calibration_shapes`)
        on the model's own device, so that the first batches are already split by a measured model (with
        ``load_cache``, the timings an earlier start on this machine kept, without probing: :meth:`_calibrate`). A
        backend whose ``can_probe`` is false (test fakes) is not probed; its fit comes from live calls.

        Raises:
            as :meth:`Runner.load`; and whatever a probe batch raises (``state`` becomes ``failed``).
        """
        super().load()
        if not (self.config.warmup and self.config.cost_batching and self.backend.can_probe):
            return
        try:
            t0 = time.monotonic()
            cap = self.backend.max_batch_size
            shapes = calibration_shapes(self.max_seq_len, min(self.config.max_batch_size, cap or 1 << 30),
                                        self.config.max_batch_tokens)
            n, kept = self._calibrate(shapes)
        except BaseException:
            self.state = "failed"
            raise
        coef = self.batch_cost.coefficients()
        log_phase(self.name, f"batch cost model from {n} {'kept' if kept else 'warm-up'} probes",
                  time.monotonic() - t0,
                  "no fit" if coef is None else ", ".join(
                      f"{term} {value:.3g}" for term, value in zip(COST_TERM_UNITS, coef)))

    def _calibrate(self, shapes: list[list[int]]) -> tuple[int, bool]:
        """Fit the batch cost model from probes of ``shapes``: the timings kept by an earlier start on this
        machine (:func:`relserve.service.backends.gate_cache.lookup_probes`, with ``load_cache``), else measured
        now and kept. Returns (probes observed, whether they were kept ones)."""
        key = None
        if self.config.load_cache and self.meta is not None:
            try:
                key = gate_cache.probe_key(self.config, self.meta, shapes)
            except OSError as exc:  # a checkpoint file changed under the load: measure, keep nothing
                log.warning("model %r: probe timings not kept (%s)", self.name, exc)
        kept = gate_cache.lookup_probes(self.config, key) if key is not None else None
        if kept:
            for lengths, seconds in kept:
                self.batch_cost.observe(lengths, seconds, is_padded=self.backend.is_padded, warmup=True)
            return len(kept), True
        probes: list[tuple[list[int], float]] = []
        model = self.batch_cost

        class Recording:  # what calibrate() observes, kept for the next start
            def observe(self, lengths, seconds, **kw):
                probes.append((list(lengths), seconds))
                model.observe(lengths, seconds, **kw)

        n = calibrate(self.backend.run, self.backend.probe_batch, shapes, Recording(),  # type: ignore[arg-type]
                      is_padded=self.backend.is_padded)
        if key is not None and probes:
            gate_cache.store_probes(self.config, key, probes)
        return n, False

    @property
    def batcher(self) -> Batcher | None:
        return self.scheduler

    def _check_loaded(self, meta: ModelMeta) -> None:
        self.max_seq_len = self.config.resolved_max_seq_len(meta.max_positions)
        if meta.task == TASK_QA:
            # an unset doc_stride becomes min(128, the limit) here, where max_seq_len is known; the resolved
            # value replaces it so that every reader of config.doc_stride (gRPC and KServe request defaults)
            # sees the one the model serves with. An explicit one over the limit is refused.
            stride = self.config.resolved_doc_stride(self.max_seq_len)
            if self.config.doc_stride is None:
                if stride < DEFAULT_DOC_STRIDE:
                    log.info("model %r: doc_stride %d (the default %d is over the limit of %d tokens for "
                             "max_seq_len %d)", self.name, stride, DEFAULT_DOC_STRIDE, stride, self.max_seq_len)
                self.config = dataclasses.replace(self.config, doc_stride=stride)
        if self.config.max_batch_tokens < self.max_seq_len:
            raise ConfigError(
                f"model {self.name!r}: max_batch_tokens {self.config.max_batch_tokens} must be >= "
                f"max_seq_len {self.max_seq_len} so that one full-length sequence fits in a batch"
            )

    def _make_scheduler(self) -> Batcher:
        cap = self.backend.max_batch_size
        max_batch = min(self.config.max_batch_size, cap) if cap else self.config.max_batch_size
        # every backend call is given the compute budget of the batcher's lane
        batcher = Batcher(
            self.name,
            self.backend.run,  # with its call's budget: the lane's, and the cost model's prediction
            budgeted=True,
            max_batch_size=max_batch,
            max_batch_tokens=self.config.max_batch_tokens,
            max_queue_delay=self.config.max_queue_delay,
            max_queue_size=self.config.max_queue_size,
            is_padded=self.backend.is_padded,
            length_bucketing=self.config.length_bucketing,
            max_request_batch_share=self.config.max_request_batch_share,
            on_queue_depth=lambda n: metrics.set_queue_depth(self.name, n),
            on_batch=self._observe_batch,
            compute=self._compute_lane(),
            cost_batching=self.config.cost_batching,
            batch_cost=self.batch_cost,
        )
        return batcher

    def _observe_batch(self, stats: BatchStats) -> None:
        metrics.observe_batch(self.name, self.backend.name, stats.size, stats.real_tokens, stats.padded_tokens,
                              stats.inference_s, stats.queue_s)


class _Observer(LoopObserver):
    def __init__(self, model: str, backend: str) -> None:
        self.model, self.backend = model, backend

    def queue_depth(self, n: int) -> None:
        metrics.set_queue_depth(self.model, n)

    def encoded(self, size, real_tokens, padded_tokens, seconds, queue_s) -> None:
        metrics.observe_batch(self.model, self.backend, size, real_tokens, padded_tokens, seconds, queue_s)

    def stepped(self, hypotheses, seconds) -> None:
        metrics.observe_decode_step(self.model, self.backend, hypotheses, seconds)

    def active(self, hypotheses) -> None:
        metrics.set_active_hypotheses(self.model, hypotheses)


class TranslationRunner(Runner):
    """One translation model behind the decode loop (iteration-level batching), in this process, or, with
    ``worker_process`` (a :class:`relserve.service.scheduling.decode_workers.DecodeWorkers` backend), in
    decode worker processes behind a :class:`relserve.service.scheduling.decode_pool.DecodePool`; requests go
    through :mod:`relserve.service.tasks.translate`."""

    def __init__(self, config: ModelConfig, backend: StepBackend) -> None:
        super().__init__(config, backend)
        self.max_seq_len = config.max_source_tokens

    @property
    def loop(self) -> DecodeLoop | None:
        return self.scheduler

    def _check_loaded(self, meta: ModelMeta) -> None:
        if meta.task != TASK_TRANSLATION:
            raise ConfigError(f"model {self.name!r}: backend loaded a {meta.task} model, expected translation")
        if self.config.max_batch_tokens < self.config.max_source_tokens:
            raise ConfigError(
                f"model {self.name!r}: max_batch_tokens {self.config.max_batch_tokens} must be >= "
                f"max_source_tokens {self.config.max_source_tokens}"
            )

    def _make_scheduler(self) -> DecodeLoop | DecodePool:
        c = self.config
        if getattr(self.backend, "decode_workers", False):  # worker_process: the loops run in its processes
            return DecodePool(self.name, self.backend, max_active_hypotheses=c.max_active_hypotheses,
                              max_batch_size=c.max_batch_size, max_queue_size=c.max_queue_size,
                              observer=_Observer(self.name, self.backend.name))
        return DecodeLoop(
            self.name, self.backend, scheduling=c.scheduling, max_active_hypotheses=c.max_active_hypotheses,
            max_batch_size=c.max_batch_size, max_batch_tokens=c.max_batch_tokens, max_queue_delay=c.max_queue_delay,
            encode_batch_delay=c.encode_batch_delay_ms / 1000, max_queue_size=c.max_queue_size,
            observer=_Observer(self.name, self.backend.name),
            compute=self._compute_lane(),
        )
