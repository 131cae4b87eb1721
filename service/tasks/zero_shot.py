"""Zero-shot classification end to end on an NLI sequence classifier, with the semantics of transformers'
``ZeroShotClassificationPipeline``: each candidate label becomes a hypothesis (``hypothesis_template`` with the
label in its ``{}``), each (text, hypothesis) pair is scored by the model, and the entailment logits rank the
labels.

* The entailment label is the first of the model's labels (id order) whose lower-cased name starts with
  ``"entail"``, as the pipeline finds it in ``label2id``; the contradiction label is label 0, or the last one
  when entailment is label 0. A model with no entailment label is refused at request time (INVALID_ARGUMENT
  naming its labels), where the pipeline would silently score with the last label.
* ``multi_label`` (or a single candidate label): each label on its own, the softmax over its pair's
  [contradiction, entailment] logits; otherwise the softmax of the entailment logits over all the labels.
  Labels come best first; ties put the later label first (the pipeline reverses an ascending sort).
* Each pair is one unit in the model's batcher, so the pairs of concurrent requests share batches and the
  fairness cap counts a request's pairs together; ``relserve_batch_size`` counts pairs.
* Tokens: ``[CLS] text [SEP] hypothesis [SEP]``; an over-long pair loses tokens from the end of the text only
  (the pipeline's ``only_first`` truncation), each text and hypothesis tokenized once per request. A hypothesis
  that leaves no room for one text token is INVALID_ARGUMENT (the pipeline would run the over-long pair
  untruncated).
* Bounds before any tokenizing (:func:`validate_zero_shot`): texts against ``max_request_texts``, labels
  against ``max_candidate_labels``, the texts x labels pairs against ``max_request_texts`` and their characters
  against ``max_request_chars``.
"""

from __future__ import annotations

import math
import string
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from relserve.models.tokenization import Encoding, Tokenizer
from relserve.service.backends.base import TASK_CLASSIFICATION
from relserve.service.errors import Internal, InvalidArgument
from relserve.service.tasks.classify import effective_max_length, run_encoded
from relserve.service.tasks.limits import check_request_size, check_text_count
from relserve.service.tasks.text import is_blank
from relserve.service.tasks.timings import Timings

TASK_ZERO_SHOT = "zero-shot-classification"
DEFAULT_HYPOTHESIS_TEMPLATE = "This example is {}."


@dataclass
class ZeroShotRequest:
    """A validated zero-shot request (:func:`validate_zero_shot`)."""

    texts: list[str]
    candidate_labels: list[str]
    hypothesis_template: str
    multi_label: bool


@dataclass
class ZeroShotItem:
    """One text's result: the candidate labels best first with their scores (as the pipeline's ``labels`` and
    ``scores``), whether any of its pairs was truncated, and its pairs' tokens summed."""

    sequence: str
    labels: list[str]
    scores: list[float]
    truncated: bool
    num_tokens: int


def entailment_index(labels: Sequence[str]) -> int | None:
    """The index of the first label whose lower-cased name starts with ``"entail"`` (the pipeline's
    ``entailment_id``), None if there is none."""
    for i, label in enumerate(labels):
        if str(label).lower().startswith("entail"):
            return i
    return None


def nli_model_labels(runner: Any, what: str) -> tuple[str, ...]:
    """The labels of ``runner``'s loaded sequence classifier (the NLI or cross-encoder head ``what`` needs).

    Raises:
        Unavailable: the model is not loaded and ready.
        InvalidArgument: the model is not a sequence classifier (naming its task).
    """
    runner.check_ready()
    if runner.task != TASK_CLASSIFICATION:
        raise InvalidArgument(f"model {runner.name!r} is a {runner.task} model; {what} needs a sequence "
                              f"classification model")
    return tuple(runner.meta.labels)


def head_label(runner: Any, find: Callable[[Sequence[str]], int | None], role: str) -> tuple[Any, int]:
    """``runner``'s loaded model metadata and the index ``find(labels)`` gives of its ``role`` label, read when the
    work starts (the model may have been swapped since the request's validation).

    Raises:
        Unavailable: the model is not ready.
        InvalidArgument: ``find`` gives None (naming the role and the model's labels).
    """
    runner.check_ready()
    meta = runner.meta
    index = find(meta.labels)
    if index is None:
        raise InvalidArgument(f"model {runner.name!r} has no {role} label (labels: {list(meta.labels)})")
    return meta, index


def check_template(template: str) -> None:
    """``template`` must hold exactly one ``{}`` and no other replacement field (``{{`` / ``}}`` are literal
    braces, as in ``str.format``), so that ``template.format(label)`` is the hypothesis.

    Raises:
        InvalidArgument: naming ``hypothesis_template`` and what is wrong with it.
    """
    try:
        fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(template)
                  if name is not None]
    except ValueError as exc:
        raise InvalidArgument(f"hypothesis_template {template!r} is not a valid template ({exc}); put one {{}} "
                              f"where the label goes and write a literal brace as {{{{ or }}}}") from None
    if len(fields) != 1 or fields[0] != ("", "", None):
        raise InvalidArgument(f"hypothesis_template {template!r} must contain exactly one {{}} (where the label "
                              f"goes) and no other {{...}} field; got {len(fields)} fields")


def check_types(values: Sequence[Any], field: str) -> None:
    """Raises InvalidArgument naming ``field[i]`` and its type for the first entry that is not a string."""
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise InvalidArgument(f"{field}[{i}] must be a string, got {type(v).__name__}")


def check_not_blank(values: Sequence[str], field: str) -> None:
    """Raises InvalidArgument naming ``field[i]`` for the first empty or whitespace-only string."""
    for i, v in enumerate(values):
        if is_blank(v):
            raise InvalidArgument(f"{field}[{i}] is empty or only whitespace; send at least one non-space character")


def validate_zero_shot(runner: Any, texts: Sequence[str], candidate_labels: Sequence[str] | str,
                       hypothesis_template: str | None, multi_label: bool) -> ZeroShotRequest:
    """Check a zero-shot request against ``runner`` (a ready sequence classifier) before any tokenizing.

    ``candidate_labels`` as a string is split at commas, as the pipeline does. ``hypothesis_template`` ``""`` or
    None means :data:`DEFAULT_HYPOTHESIS_TEMPLATE`. Order of checks: counts on the sequences as given (``len()``
    reads no text: 1..``max_request_texts`` texts, 1..``max_candidate_labels`` labels, texts x labels pairs at
    most ``max_request_texts``), the entries' types, the template (:func:`check_template`), the pairs'
    characters (``len(labels)`` x the texts' characters plus ``len(texts)`` x the hypotheses' characters, at
    most ``max_request_chars``), blank texts and labels, the model's entailment label.

    Raises:
        Unavailable: the model is not ready.
        InvalidArgument: naming the field, the index of a bad entry and the config key of a limit; or a model
            with no entailment label (naming its labels) or not a sequence classifier.
    """
    cfg = runner.config
    if isinstance(candidate_labels, str):
        candidate_labels = [label.strip() for label in candidate_labels.split(",") if label.strip()]
    if texts is None or len(texts) == 0:
        raise InvalidArgument("texts is empty; send at least one text")
    if candidate_labels is None or len(candidate_labels) == 0:
        raise InvalidArgument("candidate_labels is empty; send at least one label")
    check_text_count(runner.name, len(texts), cfg.max_request_texts)
    if len(candidate_labels) > cfg.max_candidate_labels:
        raise InvalidArgument(f"candidate_labels has {len(candidate_labels)} labels; model {runner.name!r} takes "
                              f"at most {cfg.max_candidate_labels} per request (max_candidate_labels)")
    n_pairs = len(texts) * len(candidate_labels)
    check_text_count(runner.name, n_pairs, cfg.max_request_texts, "(text, hypothesis) pairs")
    texts, labels = list(texts), list(candidate_labels)
    check_types(texts, "texts")
    check_types(labels, "candidate_labels")
    template = hypothesis_template or DEFAULT_HYPOTHESIS_TEMPLATE
    if not isinstance(template, str):
        raise InvalidArgument(f"hypothesis_template must be a string, got {type(template).__name__}")
    check_template(template)
    hypothesis_chars = sum(map(len, labels)) + len(labels) * (len(template) - 2)
    chars = len(labels) * sum(map(len, texts)) + len(texts) * hypothesis_chars
    check_request_size(runner.name, n_pairs, chars, cfg.max_request_texts, cfg.max_request_chars,
                       "(text, hypothesis) pairs")
    check_not_blank(texts, "texts")
    check_not_blank(labels, "candidate_labels")
    model_labels = nli_model_labels(runner, "zero-shot classification")
    if entailment_index(model_labels) is None:
        raise InvalidArgument(f"model {runner.name!r} has no entailment label (labels: {list(model_labels)}); "
                              f"zero-shot classification needs an NLI model with a label starting with "
                              f"'entail'")
    return ZeroShotRequest(texts, labels, template, bool(multi_label))


def encode_premise_pairs(tokenizer: Tokenizer, texts: Sequence[str], hypotheses: Sequence[str],
                         max_seq_len: int) -> list[Encoding]:
    """``[CLS] text [SEP] hypothesis [SEP]`` for every text x hypothesis (text-major: the pairs of ``texts[0]``
    first), truncated ``only_first`` to the model's limit (:func:`effective_max_length`): the hypothesis is kept
    whole and the text loses tokens from its end. Each text is tokenized once, only as far as the longest room
    any hypothesis leaves (``Tokenizer.leading_tokens``); each hypothesis once, whole (bounded by the request's
    characters). Token types: 0 for ``[CLS] text [SEP]``, 1 for ``hypothesis [SEP]``.

    Raises:
        InvalidArgument: a hypothesis that leaves no room for one text token in an over-long pair (naming the
            label's index, its tokens and the limit), or ``max_seq_len`` under 5 tokens.
    """
    limit = effective_max_length(tokenizer, max_seq_len)
    if limit < 5:
        raise InvalidArgument(f"max_seq_len {limit} is too small; a text pair needs at least 5 tokens")
    budget = limit - 3  # [CLS], [SEP], [SEP]
    hyps = [lead.ids for lead in tokenizer.leading_tokens(list(hypotheses), [math.inf] * len(hypotheses))]
    room = [budget - len(h) for h in hyps]
    leads = tokenizer.leading_tokens(list(texts), [max(max(room), 0) + 1] * len(texts))
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    out = []
    for lead in leads:
        # an incomplete prefix has more tokens than any room: the text is over and gets cut
        for j, h in enumerate(hyps):
            a = lead.ids
            truncated = len(a) > room[j]
            if truncated:
                if room[j] < 1:
                    raise InvalidArgument(
                        f"candidate_labels[{j}]: its hypothesis has {len(h)} tokens, which leaves no room for the "
                        f"text in the model's {limit}-token window (max_seq_len); use a shorter label or template")
                a = a[:room[j]]
            out.append(Encoding([cls, *a, sep, *h, sep], [0] * (len(a) + 2) + [1] * (len(h) + 1), truncated))
    return out


def label_scores(logits: np.ndarray, entailment: int, multi_label: bool) -> np.ndarray:
    """Scores of one text's candidate labels from its pairs' logits ``Float[n_labels, num_model_labels]``:
    per label the softmax over [contradiction, entailment] with ``multi_label`` or a single label, else the
    softmax of the entailment logits over the labels. Contradiction is model label 0, or the last one when
    entailment is 0 (the pipeline's choice). Returns ``Float64[n_labels]``.

    Raises:
        Internal: non-finite logits.
    """
    x = np.asarray(logits, dtype=np.float64)
    if not np.all(np.isfinite(x)):
        raise Internal(f"the model returned non-finite logits {x.tolist()}")
    if multi_label or x.shape[0] == 1:
        contradiction = x.shape[1] - 1 if entailment == 0 else 0
        # softmax over the two logits, written as the logistic of their difference (no overflow)
        return 1.0 / (1.0 + np.exp(x[:, contradiction] - x[:, entailment]))
    e = x[:, entailment]
    e = np.exp(e - e.max())
    return e / e.sum()


async def zero_shot(runner: Any, request: ZeroShotRequest,
                    deadline: float | None) -> tuple[list[ZeroShotItem], Timings]:
    """Score a validated request (:func:`validate_zero_shot`) on ``runner``: one item per text, in order.

    Admission before work: one place per pair is reserved in the batcher before any tokenizing (a full queue
    refuses the request, RESOURCE_EXHAUSTED, at no cost); the pairs run as units of one request.

    Raises:
        Unavailable: the model is not ready.
        InvalidArgument: a hypothesis too long for the window (:func:`encode_premise_pairs`), or the model has
            no entailment label (it was swapped since validation).
        RelserveError: from the batcher (queue full, deadline, shutting down, model failure).
    """
    meta, entailment = head_label(runner, entailment_index, "entailment")
    labels = request.candidate_labels
    hypotheses = [request.hypothesis_template.format(label) for label in labels]
    encodings, units, timings = await run_encoded(
        runner, len(request.texts) * len(labels), deadline, encode_premise_pairs, meta.tokenizer,
        request.texts, hypotheses, runner.max_seq_len,
    )
    items = []
    n = len(labels)
    for t, text in enumerate(request.texts):
        pairs = range(t * n, (t + 1) * n)
        scores = label_scores(np.stack([np.asarray(units[k].result).reshape(-1) for k in pairs]), entailment,
                              request.multi_label)
        order = np.argsort(scores, kind="stable")[::-1]
        items.append(ZeroShotItem(
            sequence=text,
            labels=[labels[i] for i in order],
            scores=[float(scores[i]) for i in order],
            truncated=any(encodings[k].truncated for k in pairs),
            num_tokens=sum(len(encodings[k].input_ids) for k in pairs),
        ))
    return items, timings
