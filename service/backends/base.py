"""The backend contracts and the plain data that crosses them; everything above (runners, batcher, decode
loop, API) is the same for every backend. No torch here: schedulers and backends both import this module,
so nothing imports up from a scheduler.

Encoder models (classification, QA, token classification) follow :class:`Backend`: ``load()`` reads the
checkpoint and returns :class:`ModelMeta`, ``warmup()`` runs a throw-away batch and returns None, or a
:class:`ModelMeta` that replaces the one ``load()`` gave (``dtype: auto`` is decided after warm-up, by the
agreement gate), ``run(batch, budget)`` computes one batch and returns one result *or one Exception* per item, in
order. Items are
tokenizer Encodings / QA windows (anything with ``input_ids`` and ``token_type_ids``). Results are numpy
arrays per item: classification ``float32[num_labels]`` logits; QA a pair ``(start float32[T_i], end
float32[T_i])`` unpadded to the item's own length ``T_i``; token classification ``float32[T_i, num_labels]``
logits per token, unpadded likewise.

Translation models follow :class:`StepBackend` (the same ``load`` / ``warmup`` / ``memory_stats`` /
``close``, then ``start`` / ``step`` / ``release`` over :class:`StartItem`, :class:`StepPlan` and
:class:`SeqUpdate`), driven one decoder step at a time by ``relserve.service.scheduling.decode_loop``: schedule ->
execute -> update, as plain data (vLLM's engine step).

Every compute call (``run``, ``start``, ``step``) gets a :class:`CallBudget` as an argument: the intra-op
threads the compute scheduler grants it and the hook a long call runs between encoder layers. Calls made
outside the scheduler (warm-up, probes, tests) get :data:`UNBUDGETED`. Backends know nothing of the
scheduler; the budget is all they see of it.

Every member the runners and schedulers use is declared here; :class:`BackendDefaults` and
:class:`EncoderBackendDefaults` give the optional ones their in-process answers, so nothing above the
backends asks whether a member exists.

Every call except ``memory_stats`` comes from the model's executor thread, never from the event loop.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from relserve.models.decode_types import DecodeOptions, Hypothesis

TASK_CLASSIFICATION = "classification"
TASK_QA = "question-answering"
TASK_TOKEN_CLASSIFICATION = "token-classification"
TASK_TRANSLATION = "translation"


@dataclass(frozen=True)
class ModelMeta:
    """What the server needs to know about a loaded model (ListModels, validation, metrics)."""

    task: str                       # TASK_CLASSIFICATION | TASK_QA | TASK_TOKEN_CLASSIFICATION | TASK_TRANSLATION
    family: str                     # e.g. "deberta-v2", "rnnsearch-bigru"
    backend: str                    # e.g. "torch", "onnxruntime"
    device: str                     # e.g. "cpu", "cuda:0", "CUDAExecutionProvider:0"
    dtype: str                      # "float32" | "float16" | "bfloat16" (what runs; never "auto")
    tokenizer: Any                  # relserve.models.tokenization.Tokenizer / TranslationTokenizer (or a fake)
    labels: tuple[str, ...] = ()    # (token) classification labels in id order
    problem_type: str | None = None  # with the label count, the scores' default (models.label_scores.default_function)
    max_positions: int | None = None  # the model's own limit (max_position_embeddings), None if unbounded
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. translation: eos_token_id; ONNX: graph
    dtype_reason: str = ""          # why this dtype (dtype: auto's decision and its gate numbers; ListModels)


def _default_threads() -> int:
    return 0


def _no_layer_hook() -> None:
    return None


@dataclass(frozen=True)
class CallBudget:
    """What the compute scheduler grants one backend call, passed as an argument of the call.

    Attributes:
        threads: the intra-op threads the call should use now (0: the backend's default). Asked at the start
            of the call and again at every layer hook: under ``compute_scheduling: partition`` a call that
            began alone shrinks to its share as soon as another model computes.
        layer_hook: run between encoder sub-layers (torch forward pre-hooks): where a long call may hand the
            cores to a waiting model (``compute_scheduling: fair``). Raises
            :class:`relserve.service.errors.Unavailable` when the model is shutting down.
        expected_s: the seconds the model's cost model predicts for this call (the batcher's
            :mod:`relserve.service.scheduling.cost_model`); None before it has a prediction. A worker process
            that has not answered within a multiple of it is declared hung (``worker_batch_timeout``).
    """

    threads: Callable[[], int] = _default_threads
    layer_hook: Callable[[], None] = _no_layer_hook
    expected_s: float | None = None

    @classmethod
    def fixed(cls, threads: int, expected_s: float | None = None) -> "CallBudget":
        """``threads`` for the whole call and no hand-over (a worker process applying the share its parent's
        scheduler gave the call); ``expected_s`` as the parent's call had it."""
        n = max(0, int(threads))
        return cls(threads=lambda: n, expected_s=expected_s)

    def expecting(self, seconds: float | None) -> "CallBudget":
        """This budget for a call the cost model expects to take ``seconds`` (None: no prediction yet)."""
        return dataclasses.replace(self, expected_s=seconds)


UNBUDGETED = CallBudget()  # outside the compute scheduler: the backend's default threads, no hand-over


class _Lifecycle(Protocol):
    name: str  # "torch", "onnxruntime", ... (the ``backend`` label of the metrics)
    # whether the model computes in worker processes of its own (``process_stats`` then reports them)
    worker_processes: bool

    def load(self) -> ModelMeta: ...

    def warmup(self) -> ModelMeta | None:
        """A throw-away batch; a :class:`ModelMeta` that replaces ``load()``'s (``dtype: auto`` decided by the
        agreement gate), or None to keep it."""
        ...

    def memory_stats(self) -> dict[str, tuple[int, int, int]]:
        """``{device: (allocated, reserved, peak) bytes}`` for accelerators; {} on CPU."""
        ...

    def process_stats(self) -> tuple[float, int] | None:
        """``(cpu seconds, resident bytes)`` of the worker processes (the ``relserve_worker_*`` metrics); None
        when none runs (always, in-process)."""
        ...

    def trim_heap(self) -> bool:
        """Return freed heap to the OS in the worker processes (the server trims its own); whether any was."""
        ...

    def watch(self, listener: Callable[[str | None], None]) -> None:
        """Start supervising the worker processes: ``listener(reason)`` (from any thread) when the model can no
        longer compute (a worker died, is stopped, or a call ran past ``worker_batch_timeout``: it is then
        killed and replaced), ``listener(None)`` once the replacement has warmed. A no-op in-process."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Backend(_Lifecycle, Protocol):
    """An encoder model behind the batcher.

    A backend whose ``can_probe`` is true makes synthetic items of exactly the token counts asked
    (``probe_batch(lengths) -> items``); it is timed on a few probe shapes at warm-up to fit the batch cost
    model (``ModelRunner.load``, ``relserve.service.scheduling.cost_model.calibrate``).
    """

    is_padded: bool       # pads a batch to its longest member (the batcher counts padded tokens)
    max_batch_size: int | None  # the backend's own cap (None: whatever the config says)
    can_probe: bool       # probe_batch works

    def run(self, batch: Sequence[Any], budget: CallBudget = UNBUDGETED) -> list[Any]: ...

    def probe_batch(self, lengths: Sequence[int]) -> list[Any]: ...


class BackendDefaults:
    """The in-process answers of the optional lifecycle members (:class:`Backend`, :class:`StepBackend`)."""

    worker_processes = False

    def process_stats(self) -> tuple[float, int] | None:
        """None: no worker process."""
        return None

    def trim_heap(self) -> bool:
        """False: nothing to trim outside the server's own process."""
        return False

    def watch(self, listener: Callable[[str | None], None]) -> None:
        """Nothing to supervise: no worker process."""
        return None


class EncoderBackendDefaults(BackendDefaults):
    """:class:`BackendDefaults` plus an encoder backend without warm-up probes."""

    can_probe = False

    def probe_batch(self, lengths: Sequence[int]) -> list[Any]:
        """Not offered (``can_probe`` is false).

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(f"{type(self).__name__} makes no probe batches")


# ---------------------------------------------------------------------------------------------- translation

@dataclass(frozen=True)
class StartItem:
    """One source to encode and start decoding: ``source_ids`` are pieces + EOS."""

    seq_id: int
    source_ids: list[int]
    options: DecodeOptions


@dataclass(frozen=True)
class StepPlan:
    """One decoder step: the active sequences (admission order) and their live hypothesis counts."""

    seq_ids: tuple[int, ...]
    hypotheses: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.hypotheses)


@dataclass
class SeqUpdate:
    """What one step did to one sequence."""

    live: int                     # live hypotheses after the step (0 once finished)
    best_tokens: list[int]        # the best live hypothesis so far (result's best once finished)
    best_score: float             # its summed log-probability
    results: list[Hypothesis] | None = None  # set in the step where the sequence finished, best first


@runtime_checkable
class StepBackend(_Lifecycle, Protocol):
    """A translation model behind the decode loop. Calls come from the loop's executor thread, one at a time."""

    def start(self, items: Sequence[StartItem], budget: CallBudget = UNBUDGETED) -> Sequence[int | Exception]:
        """Encode the sources (one padded batch) and create their beams; per item its live hypotheses
        (1 at the start) or an Exception."""
        ...

    def step(self, plan: StepPlan, budget: CallBudget = UNBUDGETED) -> Sequence[SeqUpdate | Exception]:
        """Advance every live hypothesis of the planned sequences by one token; one update per sequence.
        A sequence whose update has ``results`` is finished and forgotten by the backend."""
        ...

    def release(self, seq_ids: Sequence[int]) -> None:
        """Forget these sequences (dropped: cancelled, expired, failed). Unknown ids are ignored."""
        ...
