"""A served model: backend + batcher + task pre/post-processing, behind two coroutines.

``ModelRunner`` is the seam between the gRPC layer and the rest: the server takes a list of runners
(built from the config by :func:`build_runner`, or built by a test around a fake backend and fake task
processing) and the servicer only calls ``classify`` / ``answer`` / ``info``.

No torch here: the backend is reached through the contract in :mod:`relserve.service.backends`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from . import metrics
from .backends import TASK_CLASSIFICATION, TASK_QA, Backend, ModelMeta
from .batcher import Batcher, BatchStats, Unit
from .config import ModelConfig
from .errors import ConfigError, FailedPrecondition, Internal, InvalidArgument, NotFound, Unavailable

log = logging.getLogger(__name__)


class TaskProcessing(Protocol):
    """Task pre/post-processing the runner calls (default: ``relserve.service.tasks``)."""

    def classify_preprocess(self, tokenizer: Any, texts: Sequence[str], pairs: Sequence[str] | None,
                            max_seq_len: int) -> list[Any]: ...

    def classify_postprocess(self, logits: Any, meta: ModelMeta, top_k: int) -> list[tuple[str, float]]: ...

    def qa_windows(self, tokenizer: Any, question: str, context: str, max_seq_len: int,
                   doc_stride: int) -> list[Any]: ...

    def qa_best_answers(self, windows: Sequence[Any], logits: Sequence[tuple[Any, Any]], context: str, *,
                        top_k: int, max_answer_len: int, allow_impossible: bool,
                        null_threshold: float) -> list[Any]: ...


class DefaultTaskProcessing:
    """Adapter over ``relserve.service.tasks.classify`` and ``relserve.service.tasks.qa``."""

    def classify_preprocess(self, tokenizer, texts, pairs, max_seq_len):
        from .tasks import classify

        return classify.preprocess(tokenizer, texts, pairs, max_seq_len)

    def classify_postprocess(self, logits, meta, top_k):
        from .tasks import classify

        id2label = {i: label for i, label in enumerate(meta.labels)}
        return classify.postprocess(logits, id2label, meta.problem_type, top_k)

    def qa_windows(self, tokenizer, question, context, max_seq_len, doc_stride):
        return tokenizer.qa_windows(question, context, max_seq_len, doc_stride)

    def qa_best_answers(self, windows, logits, context, *, top_k, max_answer_len, allow_impossible,
                        null_threshold):
        from .tasks import qa

        return qa.best_answers(
            windows, [s for s, _ in logits], [e for _, e in logits], context,
            top_k=top_k, max_answer_len=max_answer_len, allow_impossible=allow_impossible,
            null_threshold=null_threshold,
        )


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


class ModelRunner:
    """One loaded model. Lifecycle: ``load()`` (blocking: load + warm-up, run it in a thread), then
    ``await start()`` (batcher on the loop), then requests, then ``await close()``.

    Args:
        config: the model's config entry.
        backend: anything following the backend contract (a fake in tests).
        tasks: task pre/post-processing (a fake in tests); default ``relserve.service.tasks``.
    """

    def __init__(self, config: ModelConfig, backend: Backend, tasks: TaskProcessing | None = None) -> None:
        self.config = config
        self.name = config.name
        self.backend = backend
        self.tasks: TaskProcessing = tasks or DefaultTaskProcessing()
        self.meta: ModelMeta | None = None
        self.max_seq_len = 0
        self.state = "created"  # created -> loading -> warming -> ready | failed; closed
        self.batcher: Batcher | None = None

    # ------------------------------------------------------------------ lifecycle

    def load(self) -> None:
        """Load and warm up (blocking). Raises whatever the backend raises; state becomes ``failed``."""
        try:
            self.state = "loading"
            meta = self.backend.load()
            self.max_seq_len = self.config.resolved_max_seq_len(meta.max_positions)
            if self.config.doc_stride >= self.max_seq_len and meta.task == TASK_QA:
                raise ConfigError(
                    f"model {self.name!r}: doc_stride {self.config.doc_stride} must be smaller than "
                    f"max_seq_len {self.max_seq_len}"
                )
            if self.config.max_batch_tokens < self.max_seq_len:
                raise ConfigError(
                    f"model {self.name!r}: max_batch_tokens {self.config.max_batch_tokens} must be >= "
                    f"max_seq_len {self.max_seq_len} so that one full-length sequence fits in a batch"
                )
            self.meta = meta
            self.state = "warming"
            if self.config.warmup:
                t0 = time.monotonic()
                self.backend.warmup()
                log.info("model %r: warm-up took %.3f s", self.name, time.monotonic() - t0)
        except BaseException:
            self.state = "failed"
            raise

    async def start(self) -> None:
        """Start the batcher on the running loop and publish model_info. Call after :meth:`load`."""
        if self.meta is None:
            raise RuntimeError(f"model {self.name!r}: start() before load()")
        cap = self.backend.max_batch_size
        max_batch = min(self.config.max_batch_size, cap) if cap else self.config.max_batch_size
        self.batcher = Batcher(
            self.name,
            self.backend.run,
            max_batch_size=max_batch,
            max_batch_tokens=self.config.max_batch_tokens,
            max_queue_delay=self.config.max_queue_delay,
            max_queue_size=self.config.max_queue_size,
            is_padded=self.backend.is_padded,
            length_bucketing=self.config.length_bucketing,
            on_queue_depth=lambda n: metrics.set_queue_depth(self.name, n),
            on_batch=self._observe_batch,
        )
        self.batcher.start()
        m = self.meta
        metrics.set_model_info(self.name, m.family, m.task, m.backend, m.device, m.dtype)
        metrics.add_memory_source(self.backend.memory_stats)
        self.state = "ready"

    async def close(self) -> None:
        self.state = "closed"
        if self.batcher is not None:
            await self.batcher.close()
        metrics.remove_memory_source(self.backend.memory_stats)
        try:
            self.backend.close()
        except Exception:
            log.exception("model %r: backend close failed", self.name)

    def _observe_batch(self, stats: BatchStats) -> None:
        metrics.observe_batch(self.name, self.backend.name, stats.size, stats.real_tokens, stats.padded_tokens,
                              stats.inference_s, stats.queue_s)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def task(self) -> str | None:
        return self.meta.task if self.meta else None

    def info(self) -> ModelInfo:
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
            max_batch_size=self.batcher.max_batch_size if self.batcher else self.config.max_batch_size,
        )

    # ------------------------------------------------------------------ requests

    def _check_ready(self) -> Batcher:
        if self.state != "ready" or self.batcher is None:
            raise Unavailable(f"model {self.name!r} is not ready (state: {self.state}); retry later")
        return self.batcher

    async def classify(self, texts: Sequence[str], pairs: Sequence[str] | None, top_k: int,
                       deadline: float | None) -> tuple[list[ClassifyItem], Timings]:
        batcher = self._check_ready()
        assert self.meta is not None
        timings = Timings()
        t0 = time.monotonic()
        encodings = await asyncio.to_thread(
            self.tasks.classify_preprocess, self.meta.tokenizer, list(texts), list(pairs) if pairs else None,
            self.max_seq_len,
        )
        timings.tokenization_s = time.monotonic() - t0
        metrics.observe_tokenization(self.name, timings.tokenization_s)
        units = await batcher.run([(len(e.input_ids), e) for e in encodings], deadline)
        timings.add_units(units)
        items = []
        for enc, unit in zip(encodings, units):
            items.append(ClassifyItem(
                labels=self.tasks.classify_postprocess(unit.result, self.meta, top_k),
                truncated=bool(getattr(enc, "truncated", False)),
                num_tokens=len(enc.input_ids),
            ))
        return items, timings

    async def answer(self, question: str, context: str, *, top_k: int, max_answer_len: int, doc_stride: int,
                     allow_impossible: bool, null_threshold: float, deadline: float | None) -> AnswerResult:
        batcher = self._check_ready()
        assert self.meta is not None
        timings = Timings()
        t0 = time.monotonic()
        try:
            windows = await asyncio.to_thread(
                self.tasks.qa_windows, self.meta.tokenizer, question, context, self.max_seq_len, doc_stride
            )
        except ValueError as exc:  # the tokenizer's range checks (e.g. stride / length)
            raise InvalidArgument(str(exc)) from None
        timings.tokenization_s = time.monotonic() - t0
        metrics.observe_tokenization(self.name, timings.tokenization_s)
        units = await batcher.run([(len(w.input_ids), w) for w in windows], deadline)
        timings.add_units(units)
        logits = [unit.result for unit in units]
        for start, end in logits:
            if not (_all_finite(start) and _all_finite(end)):
                raise Internal(f"model {self.name!r} returned non-finite start/end logits")
        raw = self.tasks.qa_best_answers(
            windows, logits, context, top_k=top_k, max_answer_len=max_answer_len,
            allow_impossible=allow_impossible, null_threshold=null_threshold,
        )
        return AnswerResult([_as_answer(a) for a in raw], len(windows), timings)


def _all_finite(values: Any) -> bool:
    try:
        import numpy as np

        return bool(np.all(np.isfinite(values)))
    except ImportError:  # pragma: no cover - numpy is a dependency
        return all(math.isfinite(float(v)) for v in values)


def _as_answer(a: Any) -> AnswerItem:
    """Accept the task module's answer objects (attributes) or mappings."""
    get = (lambda k, d=None: a.get(k, d)) if isinstance(a, dict) else (lambda k, d=None: getattr(a, k, d))
    return AnswerItem(text=str(get("text", "")), start=int(get("start", 0)), end=int(get("end", 0)),
                      score=float(get("score", 0.0)), is_impossible=bool(get("is_impossible", False)))


class ModelRegistry:
    """The runners of one server, looked up by name; knows whether the server is draining."""

    def __init__(self, runners: Sequence[ModelRunner]) -> None:
        self.runners: dict[str, ModelRunner] = {}
        for r in runners:
            if r.name in self.runners:
                raise ValueError(f"model name {r.name!r} appears twice")
            self.runners[r.name] = r
        self.draining = False

    def names(self) -> list[str]:
        return sorted(self.runners)

    def get(self, name: str, task: str) -> ModelRunner:
        """The runner for ``name`` that can do ``task``.

        Raises:
            Unavailable: draining, or the model is not loaded and warmed up yet.
            InvalidArgument: empty model name.
            NotFound: unknown model (lists the loaded ones).
            FailedPrecondition: the model does another task (names it).
        """
        if self.draining:
            raise Unavailable("server is shutting down and no longer accepts requests; retry on another replica")
        if not name:
            raise InvalidArgument(f"model is empty; set it to one of {self.names()}")
        runner = self.runners.get(name)
        if runner is None:
            raise NotFound(f"model {name!r} is not loaded; loaded models: {self.names()}")
        if not runner.ready:
            raise Unavailable(f"model {name!r} is not ready yet (state: {runner.state}); retry later")
        if runner.task != task:
            rpc = {TASK_CLASSIFICATION: "Classify", TASK_QA: "Answer"}.get(runner.task or "", "Translate")
            raise FailedPrecondition(
                f"model {name!r} is a {runner.task} model and cannot serve {task}; use {rpc} instead"
            )
        return runner

    @property
    def all_ready(self) -> bool:
        return bool(self.runners) and all(r.ready for r in self.runners.values())


def build_runner(config: ModelConfig):
    """A runner with the backend named in the config (imports torch for the torch backend): a
    :class:`relserve.service.translation.TranslationRunner` for RNNsearch directories (config.json
    model_type "rnnsearch"), else a :class:`ModelRunner`."""
    from .backends import TASK_TRANSLATION, checkpoint_task, create_backend, create_translation_backend

    if checkpoint_task(config.path) == TASK_TRANSLATION:
        from .translation import TranslationRunner

        return TranslationRunner(config, create_translation_backend(config))
    return ModelRunner(config, create_backend(config))
