"""The backend contracts and the plain data that crosses them; everything above (runners, batcher, decode
loop, API) is the same for every backend. No torch here: schedulers and backends both import this module,
so nothing imports up from a scheduler.

Encoder models (classification, QA) follow :class:`Backend`: ``load()`` reads the checkpoint and returns
:class:`ModelMeta`, ``warmup()`` runs a throw-away batch and returns None, or a :class:`ModelMeta` that
replaces the one ``load()`` gave (``dtype: auto`` is decided after warm-up, by the agreement gate),
``run(batch)`` computes one batch and returns one result *or one Exception* per item, in order. Items are
tokenizer Encodings / QA windows (anything with ``input_ids`` and ``token_type_ids``). Results are numpy
arrays per item: classification ``float32[num_labels]`` logits; QA a pair ``(start float32[T_i], end
float32[T_i])`` unpadded to the item's own length ``T_i``.

Translation models follow :class:`StepBackend` (the same ``load`` / ``warmup`` / ``memory_stats`` /
``close``, then ``start`` / ``step`` / ``release`` over :class:`StartItem`, :class:`StepPlan` and
:class:`SeqUpdate`), driven one decoder step at a time by ``relserve.service.decode_loop``: schedule ->
execute -> update, as plain data (vLLM's engine step).

Every call except ``memory_stats`` comes from the model's executor thread, never from the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

from relserve.models.decode_types import DecodeOptions, Hypothesis

TASK_CLASSIFICATION = "classification"
TASK_QA = "question-answering"
TASK_TRANSLATION = "translation"


@dataclass(frozen=True)
class ModelMeta:
    """What the server needs to know about a loaded model (ListModels, validation, metrics)."""

    task: str                       # TASK_CLASSIFICATION | TASK_QA | TASK_TRANSLATION
    family: str                     # e.g. "deberta-v2", "rnnsearch-bigru"
    backend: str                    # e.g. "torch", "onnxruntime"
    device: str                     # e.g. "cpu", "cuda:0", "CUDAExecutionProvider:0"
    dtype: str                      # "float32" | "float16" | "bfloat16" (what runs; never "auto")
    tokenizer: Any                  # relserve.models.tokenization.Tokenizer / TranslationTokenizer (or a fake)
    labels: tuple[str, ...] = ()    # classification labels in id order
    problem_type: str | None = None  # with the label count, the scores' default (tasks.classify.default_function)
    max_positions: int | None = None  # the model's own limit (max_position_embeddings), None if unbounded
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. translation: eos_token_id; ONNX: graph
    dtype_reason: str = ""          # why this dtype (dtype: auto's decision and its gate numbers; ListModels)


class _Lifecycle(Protocol):
    name: str  # "torch", "onnxruntime", ... (the ``backend`` label of the metrics)

    def load(self) -> ModelMeta: ...

    def warmup(self) -> None: ...

    def memory_stats(self) -> dict[str, tuple[int, int, int]]:
        """``{device: (allocated, reserved, peak) bytes}`` for accelerators; {} on CPU."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Backend(_Lifecycle, Protocol):
    """An encoder model behind the batcher.

    Optional: ``probe_batch(lengths) -> items`` (synthetic items of exactly those token counts); a backend
    that has it is timed on a few probe shapes at warm-up to fit the batch cost model
    (``ModelRunner.load``, ``relserve.service.compute.calibrate``).
    """

    is_padded: bool       # pads a batch to its longest member (the batcher counts padded tokens)
    max_batch_size: int | None  # the backend's own cap (None: whatever the config says)

    def run(self, batch: Sequence[Any]) -> list[Any]: ...


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

    def start(self, items: Sequence[StartItem]) -> Sequence[int | Exception]:
        """Encode the sources (one padded batch) and create their beams; per item its live hypotheses
        (1 at the start) or an Exception."""
        ...

    def step(self, plan: StepPlan) -> Sequence[SeqUpdate | Exception]:
        """Advance every live hypothesis of the planned sequences by one token; one update per sequence.
        A sequence whose update has ``results`` is finished and forgotten by the backend."""
        ...

    def release(self, seq_ids: Sequence[int]) -> None:
        """Forget these sequences (dropped: cancelled, expired, failed). Unknown ids are ignored."""
        ...
