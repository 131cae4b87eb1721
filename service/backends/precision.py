"""``dtype: auto`` for the torch backends: which dtype a model is loaded in, and the agreement gate that
decides, after warm-up, whether bfloat16 serves it.

1. :func:`plan` (at load): an explicit dtype is used as configured. ``auto`` loads float32 and asks for the gate
   only where bfloat16 is native: a CUDA device with ``torch.cuda.is_bf16_supported()``, or a CPU with
   AVX512-BF16 / AMX-BF16 (:func:`relserve.service.cpu_features.bf16_support`, override ``RELSERVE_CPU_BF16``).
   Elsewhere, or with ``warmup: false`` (the gate belongs to warm-up), ``auto`` stays float32 and says why.
2. :func:`decide` (after warm-up): the model runs the gate text in float32, then a bfloat16 copy of it runs the
   same text; bfloat16 is kept when at least ``dtype_gate_agreement`` of the items agree (same argmax label,
   same best QA span, same greedy translation tokens) and no probability differs by more than
   ``dtype_gate_max_prob_diff``; otherwise the float32 model serves and the reason carries both numbers.

The gate text (:func:`gate_items`) is real text, not the synthetic warm-up: ``calibration.jsonl`` in the
checkpoint directory when present (one JSON object per line, the load-test fields: classification ``text`` and
optionally ``text_pair``; token classification ``text``, its agreement counted per token; QA ``question`` and
``context``; translation ``source``), else the committed load-test text of the task (``loadtest/data``:
``sentiment_dev.jsonl`` for both classifications, ``qa_dev.jsonl``, ``de_en_dev.jsonl``). QA rows
are followed by QNLI-style (question, one sentence of its context) pairs (the load test's ``classify-pair``
construction) when the rows alone are fewer than ``dtype_gate_items``: the committed QA text has 100 questions
and the gate needs at least ``DTYPE_GATE_MIN_ITEMS`` (200) items. Fewer usable items keep float32.

``auto`` never picks float16 or int8. The same gate (:func:`decide`) decides whether an explicit ``dtype: int8``
model of the ONNX encoder backend serves its int8 graph (:mod:`.onnx_encoder`), against the float32 torch model.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from relserve.models import qa_spans
from relserve.models.label_scores import apply_function, default_function
from relserve.models.decode_types import DecodeOptions

from ..config import DTYPE_GATE_MIN_ITEMS, ModelConfig
from ..cpu_features import bf16_support
from . import gate_cache
from .base import TASK_CLASSIFICATION, TASK_QA, TASK_TOKEN_CLASSIFICATION, TASK_TRANSLATION, StartItem, StepPlan

log = logging.getLogger(__name__)

CALIBRATION_FILE = "calibration.jsonl"
# <repo>/loadtest/data in a checkout; relserve/loadtest/data (package data) in an installed wheel
LOADTEST_DATA = Path(__file__).resolve().parents[2] / "loadtest" / "data"
LOADTEST_TEXT = {TASK_CLASSIFICATION: "sentiment_dev.jsonl", TASK_QA: "qa_dev.jsonl",
                 TASK_TRANSLATION: "de_en_dev.jsonl", TASK_TOKEN_CLASSIFICATION: "sentiment_dev.jsonl"}
# the load test's sentence split (loadtest/scenarios.py question_sentence_pairs; not importable from here:
# loadtest imports service)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(\[\u201c])")
GATE_BATCH = 16  # sequences per gate batch (at most max_batch_size / max_batch_tokens)
GATE_TRANSLATION_BATCH = 32  # sources decoded together by the translation gate
_GATE_SEQ_BASE = -1_000_000  # translation gate sequence ids: negative, clear of the warm-up's -1 / -2


@dataclass(frozen=True)
class Plan:
    """How a torch backend loads a model: ``dtype`` (a DTYPES name, never auto), why, and whether the
    agreement gate must run after warm-up to decide between float32 (loaded) and bfloat16."""

    dtype: str
    reason: str
    gate: bool = False


@dataclass(frozen=True)
class Outcome:
    """One gate item under one dtype: ``key`` must be equal across dtypes (argmax label, best span, tokens);
    ``probs`` are the probabilities compared (label probabilities, span score, mean token probability)."""

    key: Any
    probs: np.ndarray


@dataclass(frozen=True)
class GateResult:
    """The gate's numbers: ``agreement`` = fraction of ``items`` with equal keys; ``max_prob_diff`` = the largest
    ``|p_fp32 - p_candidate|`` (bfloat16 or int8) over all items and probabilities."""

    items: int
    agreement: float
    max_prob_diff: float
    source: str

    def passed(self, config: ModelConfig) -> bool:
        return self.agreement >= config.dtype_gate_agreement and self.max_prob_diff <= config.dtype_gate_max_prob_diff

    def describe(self, config: ModelConfig) -> str:
        return (f"{self.items} items of {self.source}: agreement {self.agreement:.4f} (needs >= "
                f"{config.dtype_gate_agreement:g}), max probability difference {self.max_prob_diff:.4g} (limit "
                f"{config.dtype_gate_max_prob_diff:g})")


def plan(config: ModelConfig, device: str) -> Plan:
    """The dtype to load ``config``'s model in on ``device`` (resolved: ``cpu`` / ``cuda:N``); see the module doc.

    Raises:
        ConfigError: a bad ``RELSERVE_CPU_BF16`` value.
    """
    if config.dtype != "auto":
        return Plan(config.dtype, f"dtype: {config.dtype} configured")
    if device.startswith("cuda"):
        supported = bool(torch.cuda.is_bf16_supported())
        why = f"CUDA device {device} {'supports' if supported else 'does not support'} bfloat16"
    else:
        supported, why = bf16_support()
    if not supported:
        return Plan("float32", f"dtype: auto -> float32: {why}")
    if not config.warmup:
        return Plan("float32", f"dtype: auto -> float32: {why}, but warm-up is disabled (warmup: false) and the "
                               f"bfloat16 agreement gate runs at warm-up")
    return Plan("float32", why, gate=True)


def gate_items(model_dir: Path, task: str, limit: int) -> tuple[list[dict[str, str]], str]:
    """At most ``limit`` items of gate text for ``task`` and where they come from (see the module doc).

    Returns ``([], why)`` when there is no usable text: no file, an unreadable or malformed one (a line that is
    not a JSON object), or no row with the task's fields (non-empty strings).
    """
    calibration = Path(model_dir) / CALIBRATION_FILE
    path = calibration if calibration.is_file() else LOADTEST_DATA / LOADTEST_TEXT.get(task, "")
    if task not in LOADTEST_TEXT or not path.is_file():
        return [], f"no {CALIBRATION_FILE} in {model_dir} and no load-test text for task {task!r} at {path}"
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        return [], f"{path} cannot be read: {exc}"
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            return [], f"{path} line {n} is not JSON"
        if not isinstance(row, dict):
            return [], f"{path} line {n} is not a JSON object"
        rows.append(row)
    items = [it for it in (_item(task, row) for row in rows) if it is not None]
    if task == TASK_QA and len(items) < limit:
        pairs = [{"question": it["question"], "context": s} for it in items
                 for s in _SENTENCE_END.split(it["context"].strip()) if s.strip()]
        items += pairs
    if not items:
        return [], f"{path} has no row with the fields of a {task} item"
    return items[:limit], str(path)


def _item(task: str, row: dict) -> dict[str, str] | None:
    def text(key: str) -> str | None:
        value = row.get(key)
        return value if isinstance(value, str) and value.strip() else None

    if task in (TASK_CLASSIFICATION, TASK_TOKEN_CLASSIFICATION):
        if text("text") is None:
            return None
        return {"text": row["text"], **({"text_pair": row["text_pair"]} if text("text_pair") else {})}
    if task == TASK_QA:
        return {"question": row["question"], "context": row["context"]} if text("question") and text("context") \
            else None
    return {"source": row["source"]} if text("source") else None


def judge(reference: Sequence[Outcome], candidate: Sequence[Outcome], source: str) -> GateResult:
    """Compare the float32 outcomes with the candidate's (bfloat16, int8), item by item (same order and length)."""
    if len(reference) != len(candidate) or not reference:
        raise ValueError(f"gate outcomes do not pair up: {len(reference)} float32, {len(candidate)} candidate")
    same = sum(r.key == c.key for r, c in zip(reference, candidate))
    diff = 0.0
    for r, c in zip(reference, candidate):
        if r.probs.shape != c.probs.shape:
            diff = math.inf
            break
        if r.probs.size:
            d = float(np.max(np.abs(r.probs - c.probs)))
            diff = max(diff, d if math.isfinite(d) else math.inf)
    return GateResult(items=len(reference), agreement=same / len(reference), max_prob_diff=diff, source=source)


def to_bfloat16(model: torch.nn.Module) -> torch.nn.Module:
    """A bfloat16 copy of ``model`` on its device (its forward hooks and unpadded switch come along); the
    float32 model is left as it is, so a failed gate loses nothing.

    Each floating-point parameter and buffer is cast straight into the copy (the deep copy's memo maps it to
    its bfloat16 tensor; a weight shared by two modules stays shared), so the float32 weights are never copied
    first: while the gate runs, the process holds float32 + bfloat16 weights, not twice float32 + bfloat16
    (a deep copy cast afterwards) at its peak."""
    memo: dict[int, Any] = {}
    for t in (*model.parameters(), *model.buffers()):
        if id(t) in memo or not t.is_floating_point():
            continue
        cast = t.detach().to(torch.bfloat16, copy=True)  # copy: a bfloat16 tensor must not be shared
        memo[id(t)] = torch.nn.Parameter(cast, requires_grad=t.requires_grad) if isinstance(
            t, torch.nn.Parameter) else cast
    return copy.deepcopy(model, memo).to(torch.bfloat16)


def decide(config: ModelConfig, plan_: Plan, task: str, outcomes: Callable[[list[dict[str, str]]], list[Outcome]],
           use_candidate: Callable[[], None], use_float32: Callable[[], None],
           candidate: str = "bfloat16") -> tuple[str, str]:
    """Run the agreement gate of ``plan_`` (a no-op when it asks for none) and return ``(dtype, reason)``:
    ``candidate`` when it agrees with float32, else float32.

    Args:
        outcomes: runs gate items on the model the backend serves now, one :class:`Outcome` per item.
        use_candidate: makes the backend serve the candidate: a bfloat16 copy (:func:`to_bfloat16`) of its float32
            model (torch backends, ``dtype: auto``), or the int8 graph (the ONNX encoder backend, ``dtype: int8``).
        use_float32: makes it serve the float32 model again (the gate failed or the candidate raised).
        candidate: the dtype under test, for the reason ("bfloat16" or "int8").

    The reason starts ``dtype: <configured> -> <chosen>:`` and carries the gate's numbers. Nothing raises out of
    the gate: an error in either run keeps float32 and is named in the reason.
    """
    if not plan_.gate:
        return plan_.dtype, plan_.reason
    asked = f"dtype: {config.dtype}"
    items, source = gate_items(config.path, task, config.dtype_gate_items)
    if len(items) < DTYPE_GATE_MIN_ITEMS:
        detail = source if not items else f"{source} has only {len(items)} usable items"
        return "float32", (f"{asked} -> float32: {plan_.reason}, but there is no usable agreement-gate text "
                           f"(at least {DTYPE_GATE_MIN_ITEMS} items needed): {detail}")
    try:
        reference = outcomes(items)
    except Exception as exc:  # e.g. a calibration QA context over max_qa_windows: serve, in float32, and say so
        log.warning("model %r: float32 agreement gate run failed", config.name, exc_info=True)
        return "float32", f"{asked} -> float32: {plan_.reason}, but the gate text failed to run in float32: {exc}"
    try:
        use_candidate()
        result = judge(reference, outcomes(items), source)
    except Exception as exc:  # a kernel missing in the candidate must not stop the model from serving in float32
        use_float32()
        log.warning("model %r: %s agreement gate run failed", config.name, candidate, exc_info=True)
        return "float32", f"{asked} -> float32: {plan_.reason}, but the {candidate} run failed: {exc}"
    if result.passed(config):
        return candidate, f"{asked} -> {candidate}: {plan_.reason}; agreement gate passed on {result.describe(config)}"
    use_float32()
    return "float32", (f"{asked} -> float32: {plan_.reason}, but {candidate} failed the agreement gate on "
                       f"{result.describe(config)}")


def gate_torch_backend(backend: Any, task: str) -> None:
    """Run a torch backend's bfloat16 gate at warm-up when its plan asks for one (:func:`decide`), then set its
    ``plan`` and ``meta`` to the dtype that serves and why, and drop the copy that does not serve.

    The backend provides ``config``, ``plan``, ``meta``, ``_gate_outcomes(items)``, ``_use_bfloat16()``,
    ``_use_float32()`` and ``_float32_model`` (the float32 model while the bfloat16 copy is tried).
    """
    if not backend.plan.gate:
        return
    dtype, reason = _decide_or_reuse(backend, task)
    backend.plan = Plan(dtype, reason)
    backend._float32_model = None  # decided: the float32 weights are not needed any more if bfloat16 serves
    backend.meta = dataclasses.replace(backend.meta, dtype=dtype, dtype_reason=reason)


def _decide_or_reuse(backend: Any, task: str) -> tuple[str, str]:
    """:func:`decide`, or the decision kept for the same key (:mod:`.gate_cache`, unless ``load_cache`` is
    off); a decision of a gate that ran to its end is kept. Logs where the decision came from and its time."""
    config, t0 = backend.config, time.monotonic()
    key = None
    if config.load_cache:
        texts = [Path(config.path) / CALIBRATION_FILE, LOADTEST_DATA / LOADTEST_TEXT.get(task, "-")]
        try:
            key = gate_cache.gate_key(config, task, backend.device, texts)
        except OSError as exc:  # the load has read these files: a race with someone changing them; decide afresh
            log.warning("model %r: dtype decision key not computed (%s); running the gate", config.name, exc)
    kept = gate_cache.lookup(config, key) if key is not None else None
    if kept is not None:
        if kept.dtype == "bfloat16":
            backend._use_bfloat16()
            items, _ = gate_items(config.path, task, GATE_BATCH)
            try:  # warm-up ran the float32 model: the bfloat16 one computes once before it serves
                backend._gate_outcomes(items)
            except Exception as exc:  # as decide(): a kernel missing in bfloat16 leaves float32 serving
                backend._use_float32()
                log.warning("model %r: bfloat16 run failed", config.name, exc_info=True)
                return "float32", f"dtype: {config.dtype} -> float32: the kept bfloat16 decision's run failed: {exc}"
        log.info("model %r: dtype decision %s from %s in %.2f s (the agreement gate did not run)", config.name,
                 kept.dtype, kept.where, time.monotonic() - t0)
        return kept.dtype, f"{kept.reason} [decision kept in {kept.where}; the gate did not run at this start]"
    runs = []

    def outcomes(items: list[dict[str, str]]) -> list[Outcome]:
        out = backend._gate_outcomes(items)
        runs.append(len(out))
        return out

    dtype, reason = decide(config, backend.plan, task, outcomes, backend._use_bfloat16, backend._use_float32)
    log.info("model %r: dtype agreement gate ran in %.2f s -> %s", config.name, time.monotonic() - t0, dtype)
    if key is not None and len(runs) == 2:  # both runs finished: the decision is the gate's, not an error's
        gate_cache.store(config, key, dtype, reason)
    return dtype, reason


# ------------------------------------------------------------------------------------- per-task outcomes

def _batches(lengths: Sequence[int], max_batch: int, max_tokens: int) -> list[list[int]]:
    """Indices grouped by length (shortest first) into batches within ``max_batch`` and padded ``max_tokens``."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out: list[list[int]] = []
    for i in order:
        if out and len(out[-1]) < max_batch and (len(out[-1]) + 1) * lengths[i] <= max_tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _run_all(run: Callable[[list[Any]], list[Any]], units: Sequence[Any], config: ModelConfig) -> list[Any]:
    """``run`` over ``units`` in length-sorted batches; results in ``units`` order. Raises a per-item error."""
    results: list[Any] = [None] * len(units)
    max_batch = max(1, min(GATE_BATCH, config.max_batch_size))
    for idx in _batches([len(u.input_ids) for u in units], max_batch, config.max_batch_tokens):
        for i, res in zip(idx, run([units[i] for i in idx])):
            if isinstance(res, Exception):
                raise res
            results[i] = res
    return results


def label_probabilities(logits: np.ndarray, problem_type: str | None) -> np.ndarray:
    """The probabilities the gate compares for one item's logits ``Float[num_labels]``: the model's default
    scores function (:func:`relserve.models.label_scores.default_function`: sigmoid for multi-label or one
    logit), softmax when that is ``none``."""
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    return apply_function(x, "sigmoid" if default_function(problem_type, x.size) == "sigmoid" else "softmax")


def encoder_outcomes(task: str, items: Sequence[dict[str, str]], *, tokenizer: Any, run: Callable, config: ModelConfig,
                     max_seq_len: int, problem_type: str | None) -> list[Outcome]:
    """Gate outcomes of an encoder backend's ``run`` (the :class:`relserve.service.backends.base.Backend`
    contract): classification ``(argmax label, label probabilities)``; QA ``((start, end) characters of the
    best span, [its score])`` from the server's own span search over all windows of the item; token
    classification one outcome per content token of each item (truncated at the window) ``(argmax label, label
    probabilities)``, so agreement is the fraction of tokens labelled alike."""
    if task == TASK_TOKEN_CLASSIFICATION:
        limit = max_seq_len if tokenizer.model_max_length is None else min(max_seq_len, tokenizer.model_max_length)
        encodings = tokenizer.batch_encode([it["text"] for it in items], None, max_length=limit)
        out = []
        for logits in _run_all(run, encodings, config):
            x = np.asarray(logits, dtype=np.float64)[1:-1]  # content tokens: [CLS] and [SEP] carry no label
            for row in x:
                p = apply_function(row, "softmax")
                out.append(Outcome(int(np.argmax(p)), p))
        return out
    if task == TASK_CLASSIFICATION:
        # the classify task's truncation: longest-first at max_seq_len, lowered to a real model_max_length
        limit = max_seq_len if tokenizer.model_max_length is None else min(max_seq_len, tokenizer.model_max_length)
        encodings = []
        for it in items:  # one at a time: items with and without a pair may mix
            encodings += tokenizer.batch_encode([it["text"]], [it["text_pair"]] if "text_pair" in it else None,
                                                max_length=limit)
        out = []
        for logits in _run_all(run, encodings, config):
            p = label_probabilities(logits, problem_type)
            out.append(Outcome(int(np.argmax(p)), p))
        return out
    stride = config.resolved_doc_stride(max_seq_len)
    windows = [tokenizer.qa_windows(it["question"], it["context"], max_seq_len, stride,
                                    max_windows=config.max_qa_windows, clamp_stride=True) for it in items]
    flat = [w for ws in windows for w in ws]
    logits = _run_all(run, flat, config)
    out, at = [], 0
    for it, ws in zip(items, windows):
        mine = logits[at:at + len(ws)]
        at += len(ws)
        best = qa_spans.best_answers(ws, [s for s, _ in mine], [e for _, e in mine], it["context"], top_k=1,
                                     max_answer_len=config.max_answer_len, align_to_words=config.align_to_words)[0]
        out.append(Outcome((int(best.start), int(best.end)), np.array([float(best.score)])))
    return out


def translation_outcomes(items: Sequence[dict[str, str]], *, tokenizer: Any, stepper: Any,
                         config: ModelConfig) -> list[Outcome]:
    """Gate outcomes of a translation :class:`relserve.service.backends.translation_steps.BeamStepper`: greedy
    decoding (beam 1, the model's length limits); ``(output tokens, [mean token probability
    exp(log_prob / tokens)])``. Sources over ``max_source_tokens`` are cut to it."""
    options = DecodeOptions(beam_size=1, n_best=1, length_penalty=config.length_penalty, max_len_a=config.max_len_a,
                            max_len_b=config.max_len_b, max_len_cap=config.max_output_tokens)
    sources = [tokenizer.encode_source(it["source"], max_length=config.max_source_tokens) for it in items]
    out: list[Outcome | None] = [None] * len(sources)
    for lo in range(0, len(sources), GATE_TRANSLATION_BATCH):
        ids = list(range(lo, min(lo + GATE_TRANSLATION_BATCH, len(sources))))
        seq = {_GATE_SEQ_BASE - i: i for i in ids}
        try:
            for r in stepper.start([StartItem(sid, sources[i], options) for sid, i in seq.items()]):
                if isinstance(r, Exception):
                    raise r
            live = list(seq)
            while live:
                ups = stepper.step(StepPlan(tuple(live), tuple(1 for _ in live)))
                still = []
                for sid, u in zip(live, ups):
                    if isinstance(u, Exception):
                        raise u
                    if u.results is None:
                        still.append(sid)
                        continue
                    h = u.results[0]
                    mean = math.exp(h.log_prob / max(1, len(h.tokens))) if math.isfinite(h.log_prob) else math.nan
                    out[seq[sid]] = Outcome(tuple(h.output_tokens), np.array([mean]))
                live = still
        finally:
            stepper.release(list(seq))
    return out  # type: ignore[return-value]
