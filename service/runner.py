"""A served model: backend + scheduler + task pre/post-processing, behind a few coroutines.

:class:`Runner` is the lifecycle every served model shares (load and warm-up, start, ready, info, close,
the UNAVAILABLE answer before it is ready). :class:`ModelRunner` serves encoder models (classification,
QA) through the batcher; ``relserve.service.translation.TranslationRunner`` serves translation models
through the decode loop. The server takes a list of runners (built from the config by
``relserve.service.registry.build_runner``, or built by a test around a fake backend and fake task
processing); the servicer validates each request once (``relserve.service.tasks``) and calls ``classify`` /
``answer`` / ``translate`` / ``info``.

No torch here: the backend is reached through the contracts in :mod:`relserve.service.backends.base`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np

from . import metrics
from .backends.base import TASK_CLASSIFICATION, TASK_QA, Backend, ModelMeta
from .batcher import Batcher, BatchStats, Unit
from .compute import COST_TERM_UNITS, BatchCostModel, ComputeScheduler, Lane, calibrate, calibration_shapes
from .config import DEFAULT_DOC_STRIDE, ModelConfig
from .errors import ConfigError, Internal, InvalidArgument, Unavailable
from relserve.models import qa_spans
from relserve.models.tokenization import DocStrideTooLarge, TooManyWindows, qa_window_count

from .tasks import classify

log = logging.getLogger(__name__)

# Threads per model for tokenizing (its own pool: a long tokenization never waits for, or holds up, another
# model's; two, so one long request of a model does not hold up its short ones).
TOKENIZATION_THREADS = 2
# Characters per token assumed when estimating a QA request's windows from its length, before tokenizing (for
# the queue reservation; prose runs about 4-5 per token with the default vocabularies).
QA_ESTIMATE_CHARS_PER_TOKEN = 4


class TaskProcessing(Protocol):
    """Task pre/post-processing the runner calls (default: ``relserve.service.tasks``)."""

    def classify_preprocess(self, tokenizer: Any, texts: Sequence[str], pairs: Sequence[str] | None,
                            max_seq_len: int) -> list[Any]: ...

    def classify_postprocess(self, logits: Any, meta: ModelMeta, top_k: int,
                             function_to_apply: str | None = None) -> list[tuple[str, float]]: ...

    def qa_windows(self, tokenizer: Any, question: str, context: str, max_seq_len: int, doc_stride: int, *,
                   max_windows: int | None = None, clamp_stride: bool = False) -> list[Any]: ...

    def qa_best_answers(self, windows: Sequence[Any], logits: Sequence[tuple[Any, Any]], context: str, *,
                        top_k: int, max_answer_len: int, allow_impossible: bool,
                        null_threshold: float, align_to_words: bool = False) -> list[Any]: ...


class DefaultTaskProcessing:
    """The real task processing: ``relserve.service.tasks.classify``, ``Tokenizer.qa_windows`` and
    ``relserve.models.qa_spans`` (tests swap in fakes through :class:`TaskProcessing`)."""

    def classify_preprocess(self, tokenizer, texts, pairs, max_seq_len):
        return classify.preprocess(tokenizer, texts, pairs, max_seq_len)

    def classify_postprocess(self, logits, meta, top_k, function_to_apply=None):
        id2label = {i: label for i, label in enumerate(meta.labels)}
        return classify.postprocess(logits, id2label, meta.problem_type, top_k, function_to_apply)

    def qa_windows(self, tokenizer, question, context, max_seq_len, doc_stride, *, max_windows=None,
                   clamp_stride=False):
        return tokenizer.qa_windows(question, context, max_seq_len, doc_stride, max_windows=max_windows,
                                    clamp_stride=clamp_stride)

    def qa_best_answers(self, windows, logits, context, *, top_k, max_answer_len, allow_impossible,
                        null_threshold, align_to_words=False):
        try:
            return qa_spans.best_answers(
                windows, [s for s, _ in logits], [e for _, e in logits], context,
                top_k=top_k, max_answer_len=max_answer_len, allow_impossible=allow_impossible,
                null_threshold=null_threshold, align_to_words=align_to_words,
            )
        except ValueError as e:  # logits that do not fit the windows: a model bug, not the client's
            raise Internal(str(e)) from None


@dataclass(frozen=True)
class ModelInfo:
    name: str
    task: str
    family: str
    backend: str
    device: str
    dtype: str
    max_seq_len: int
    labels: tuple[str, ...]
    max_batch_size: int
    function_to_apply: str = ""  # classification: the scores' default function (classify.default_function)
    dtype_reason: str = ""  # why this dtype (ModelMeta.dtype_reason: dtype auto's choice and its gate numbers)


@dataclass
class Timings:
    """Per-request timings, assembled from its units (they travel with each unit)."""

    tokenization_s: float = 0.0
    queue_s: float = 0.0       # longest wait of any of its units
    inference_s: float = 0.0   # longest batch any of its units ran in
    units: int = 0

    def add_units(self, units: Sequence[Unit]) -> None:
        self.units += len(units)
        for u in units:
            self.queue_s = max(self.queue_s, u.queue_s)
            self.inference_s = max(self.inference_s, u.inference_s)


@dataclass
class ClassifyItem:
    labels: list[tuple[str, float]]
    truncated: bool
    num_tokens: int


@dataclass
class AnswerItem:
    text: str
    start: int
    end: int
    score: float
    is_impossible: bool = False


@dataclass
class AnswerResult:
    answers: list[AnswerItem]
    num_windows: int
    timings: Timings = field(default_factory=Timings)


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

    # ------------------------------------------------------------------ lifecycle

    def load(self) -> None:
        """Load and warm up (blocking).

        Raises:
            ConfigError: the loaded model does not fit the config (see the subclass).
            Exception: whatever the backend raises. Either way ``state`` becomes ``failed``.
        """
        try:
            self.state = "loading"
            meta = self.backend.load()
            self._check_loaded(meta)
            self.meta = meta
            self.state = "warming"
            if self.config.warmup:
                t0 = time.monotonic()
                warmed = self.backend.warmup()
                if isinstance(warmed, ModelMeta):  # e.g. dtype: auto decided by the agreement gate
                    self.meta = warmed
                log.info("model %r: warm-up took %.3f s", self.name, time.monotonic() - t0)
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
        self.scheduler.start()
        self._tokenization = concurrent.futures.ThreadPoolExecutor(
            max_workers=TOKENIZATION_THREADS, thread_name_prefix=f"relserve-tok-{self.name}")
        m = self.meta
        metrics.set_model_info(self.name, m.family, m.task, m.backend, m.device, m.dtype)
        metrics.add_memory_source(self.backend.memory_stats)
        if hasattr(self.backend, "process_stats"):  # worker_process: its child's CPU and memory
            metrics.add_worker_source(self.name, self.backend.process_stats)
        self.state = "ready"

    async def close(self) -> None:
        """Stop the scheduler (queued and running work fails with UNAVAILABLE) and close the backend."""
        self.state = "closed"
        if self.scheduler is not None:
            await self.scheduler.close()
        if self._tokenization is not None:
            self._tokenization.shutdown(wait=False, cancel_futures=True)
            self._tokenization = None
        metrics.remove_memory_source(self.backend.memory_stats)
        if hasattr(self.backend, "process_stats"):
            metrics.remove_worker_source(self.name, self.backend.process_stats)
        try:
            self.backend.close()
        except Exception:
            log.exception("model %r: backend close failed", self.name)

    def _check_loaded(self, meta: ModelMeta) -> None:
        """Raise ConfigError when the loaded model cannot be served with this config; may set ``max_seq_len``."""
        raise NotImplementedError

    def _make_scheduler(self) -> Any:
        raise NotImplementedError

    async def _tokenize(self, fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
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
        result = await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args, **kwargs))
        seconds = time.monotonic() - t0
        metrics.observe_tokenization(self.name, seconds)
        return result, seconds

    def _compute_lane(self) -> Lane | None:
        """This model's handle on the server's compute scheduler, capped at ``max_batch_time_ms``."""
        if self.compute is None:
            return None
        return self.compute.lane(self.name, max_hold=self.config.max_batch_time_ms / 1000.0)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def task(self) -> str | None:
        return self.meta.task if self.meta else None

    def info(self) -> "ModelInfo":
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
            function_to_apply=(classify.default_function(m.problem_type, len(m.labels))
                               if m and m.task == TASK_CLASSIFICATION else ""),
            dtype_reason=m.dtype_reason if m else "",
        )

    def _check_ready(self) -> Any:
        """The scheduler of a ready model.

        Raises:
            Unavailable: not loaded and warmed up yet, failed or closed (names the state).
        """
        if self.state != "ready" or self.scheduler is None:
            raise Unavailable(f"model {self.name!r} is not ready (state: {self.state}); retry later")
        return self.scheduler


class ModelRunner(Runner):
    """An encoder model (classification or QA) behind the batcher.

    Args:
        config: the model's config entry.
        backend: anything following :class:`relserve.service.backends.base.Backend` (a fake in tests).
        tasks: task pre/post-processing (a fake in tests); default ``relserve.service.tasks``.
    """

    def __init__(self, config: ModelConfig, backend: Backend, tasks: TaskProcessing | None = None) -> None:
        super().__init__(config, backend)
        self.tasks: TaskProcessing = tasks or DefaultTaskProcessing()
        # fitted by load() from warm-up probes, then refined by the batcher from every call
        self.batch_cost = BatchCostModel()

    def load(self) -> None:
        """Load and warm up (:meth:`Runner.load`), then, with warm-up and ``cost_batching`` on, fit the batch
        cost model from probe batches of a few shapes (:func:`relserve.service.compute.calibration_shapes`)
        on the model's own device, so that the first batches are already split by a measured model. A
        backend without ``probe_batch(lengths)`` (test fakes) is not probed; its fit comes from live calls.

        Raises:
            as :meth:`Runner.load`; and whatever a probe batch raises (``state`` becomes ``failed``).
        """
        super().load()
        make = getattr(self.backend, "probe_batch", None)
        if not (self.config.warmup and self.config.cost_batching and callable(make)):
            return
        try:
            t0 = time.monotonic()
            cap = self.backend.max_batch_size
            shapes = calibration_shapes(self.max_seq_len, min(self.config.max_batch_size, cap or 1 << 30),
                                        self.config.max_batch_tokens)
            n = calibrate(self.backend.run, make, shapes, self.batch_cost, is_padded=self.backend.is_padded)
        except BaseException:
            self.state = "failed"
            raise
        coef = self.batch_cost.coefficients()
        log.info("model %r: batch cost model from %d warm-up probes in %.2f s: %s", self.name, n,
                 time.monotonic() - t0, "no fit" if coef is None else ", ".join(
                     f"{term} {value:.3g}" for term, value in zip(COST_TERM_UNITS, coef)))

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
        return Batcher(
            self.name,
            self.backend.run,
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

    def _observe_batch(self, stats: BatchStats) -> None:
        metrics.observe_batch(self.name, self.backend.name, stats.size, stats.real_tokens, stats.padded_tokens,
                              stats.inference_s, stats.queue_s)

    # ------------------------------------------------------------------ requests

    async def classify(self, texts: Sequence[str], pairs: Sequence[str] | None, top_k: int,
                       deadline: float | None,
                       function_to_apply: str | None = None) -> tuple[list[ClassifyItem], Timings]:
        """Classify validated texts (and pairs): one item per text, in order; ``function_to_apply`` (checked
        by ``classify.validate_function``; None: the model's default) turns logits into scores.

        Admission before work: the request's places (one per text) are reserved in the batcher before any
        tokenizing, so a full queue refuses it (RESOURCE_EXHAUSTED) at no tokenizing cost; the reservation
        is released on any error or cancellation.
        """
        batcher = self._check_ready()
        assert self.meta is not None
        timings = Timings()
        with batcher.reserve(len(texts), deadline) as reservation:
            encodings, timings.tokenization_s = await self._tokenize(
                self.tasks.classify_preprocess, self.meta.tokenizer, list(texts), list(pairs) if pairs else None,
                self.max_seq_len,
            )
            units = batcher.submit([(len(e.input_ids), e) for e in encodings], deadline, reservation)
        units = await batcher.wait(units, deadline)
        timings.add_units(units)
        items = []
        for enc, unit in zip(encodings, units):
            items.append(ClassifyItem(
                labels=self.tasks.classify_postprocess(unit.result, self.meta, top_k, function_to_apply),
                truncated=bool(getattr(enc, "truncated", False)),
                num_tokens=len(enc.input_ids),
            ))
        return items, timings

    async def answer(self, question: str, context: str, *, top_k: int, max_answer_len: int, doc_stride: int,
                     allow_impossible: bool, null_threshold: float, deadline: float | None,
                     clamp_stride: bool = False, align_to_words: bool | None = None) -> AnswerResult:
        """Answer a validated question over ``context`` (stride windows of ``max_seq_len`` overlapping by
        ``doc_stride`` tokens; ``clamp_stride``: it is the config's default, lowered for a long question;
        ``align_to_words``: spans widened to whole words, ``relserve.models.qa_spans``; None: the model's
        ``align_to_words`` config).

        Bounded work: the window count is estimated from the context's length and reserved in the batcher
        before tokenizing (a full queue refuses at no cost); the tokenizer then tokenizes only as much of the
        context as it takes to prove it needs more than ``max_qa_windows`` windows, before building any.

        Raises:
            InvalidArgument: ``doc_stride`` over this question's limit, or more than ``max_qa_windows`` windows
                (each naming the limit).
            RelserveError: from the batcher (queue full, deadline, shutting down, model failure).
        """
        batcher = self._check_ready()
        assert self.meta is not None
        timings = Timings()
        limit = self.config.max_qa_windows
        with batcher.reserve(self._estimated_windows(question, context, doc_stride), deadline) as reservation:
            try:
                windows, timings.tokenization_s = await self._tokenize(
                    self.tasks.qa_windows, self.meta.tokenizer, question, context, self.max_seq_len, doc_stride,
                    max_windows=limit, clamp_stride=clamp_stride,
                )
            except TooManyWindows as exc:
                raise InvalidArgument(f"context too long for model {self.name!r} (max_qa_windows {limit}): {exc}; "
                                      f"send a shorter context") from None
            except DocStrideTooLarge as exc:
                raise InvalidArgument(f"{exc}; send a doc_stride of at most {exc.limit} (0 = the model's "
                                      f"default)") from None
            except ValueError as exc:  # the tokenizer's other range checks
                raise InvalidArgument(str(exc)) from None
            units = batcher.submit([(len(w.input_ids), w) for w in windows], deadline, reservation)
        units = await batcher.wait(units, deadline)
        timings.add_units(units)
        logits = [unit.result for unit in units]
        for start, end in logits:
            if not (_all_finite(start) and _all_finite(end)):
                raise Internal(f"model {self.name!r} returned non-finite start/end logits")
        raw = self.tasks.qa_best_answers(
            windows, logits, context, top_k=top_k, max_answer_len=max_answer_len,
            allow_impossible=allow_impossible, null_threshold=null_threshold,
            align_to_words=self.config.align_to_words if align_to_words is None else align_to_words,
        )
        return AnswerResult([_as_answer(a) for a in raw], len(windows), timings)


    def _estimated_windows(self, question: str, context: str, doc_stride: int) -> int:
        """The windows a QA request will need, from its lengths alone (``QA_ESTIMATE_CHARS_PER_TOKEN``), at
        most ``max_qa_windows``: what :meth:`answer` reserves before tokenizing."""
        max_q = (self.max_seq_len - 3) // 2
        room = self.max_seq_len - 3 - min(max_q, max(1, len(question) // QA_ESTIMATE_CHARS_PER_TOKEN))
        step = room - min(doc_stride, room // 2)
        tokens = len(context) // QA_ESTIMATE_CHARS_PER_TOKEN
        return min(self.config.max_qa_windows, qa_window_count(tokens, room, step))


def _all_finite(values: Any) -> bool:
    return bool(np.all(np.isfinite(values)))


def _as_answer(a: Any) -> AnswerItem:
    """Accept the task module's answer objects (attributes) or mappings."""
    get = (lambda k, d=None: a.get(k, d)) if isinstance(a, dict) else (lambda k, d=None: getattr(a, k, d))
    return AnswerItem(text=str(get("text", "")), start=int(get("start", 0)), end=int(get("end", 0)),
                      score=float(get("score", 0.0)), is_impossible=bool(get("is_impossible", False)))
