"""Rerank end to end (text-embeddings-inference's ``/rerank`` semantics): one query, texts scored as
``[CLS] query [SEP] text [SEP]`` pairs by a sequence classifier, returned as indices sorted by score.

Which logit is the relevance, and what turns it into a score:

* a one-label head (a cross-encoder, e.g. DeBERTa-v3 rerankers saved with ``num_labels=1``): its logit, and
  the score is its sigmoid, whatever the model's ``problem_type`` (TEI's rule); ``raw_scores`` returns the logit;
* a head with more labels: the first label (id order) whose lower-cased name starts with ``"entail"``,
  ``"relevan"`` or ``"positive"`` (NLI models, relevant / not-relevant heads, sentiment-style yes/no heads), else
  label 1 of a two-label head (binary cross-encoders saved with ``LABEL_0`` / ``LABEL_1``); the score is that
  label's probability under the head's default function (``relserve.models.label_scores.default_function``:
  the softmax over the labels, or the label's own sigmoid for ``multi_label_classification``); ``raw_scores``
  returns that label's logit;
* any other head is INVALID_ARGUMENT naming its labels (at validation, before any work).

Sorted by score, best first; ties keep the lower index first; ``top_n`` (0 = all) keeps the best ones.
Over-long pairs are truncated longest-first to the model's window (TEI's truncation, as classify's pairs); with
``truncate`` false an over-long pair is INVALID_ARGUMENT naming its index, after tokenizing and before any model
work. Each pair is one unit in the model's batcher (the pairs of concurrent requests share batches; the fairness
cap counts a request's pairs together; ``relserve_batch_size`` counts pairs).

Bounds before any tokenizing (:func:`validate_rerank`): 1..``max_rerank_texts`` texts, and the pairs'
characters (the query once per text, plus the texts) at most ``max_request_chars``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from relserve.models.label_scores import apply_function, default_function
from relserve.models.tokenization import Encoding, Tokenizer
from relserve.service.errors import Internal, InvalidArgument
from relserve.service.tasks.classify import effective_max_length, preprocess, run_encoded
from relserve.service.tasks.limits import check_request_size
from relserve.service.tasks.text import is_blank
from relserve.service.tasks.timings import Timings
from relserve.service.tasks.zero_shot import check_not_blank, check_types, head_label, nli_model_labels

TASK_RERANK = "rerank"
RELEVANT_PREFIXES = ("entail", "relevan", "positive")


@dataclass
class RerankRequest:
    """A validated rerank request (:func:`validate_rerank`); ``top_n`` 0 = all texts."""

    query: str
    texts: list[str]
    top_n: int
    raw_scores: bool
    return_text: bool
    truncate: bool


@dataclass
class RerankItem:
    """One text's rank entry: its index in the request, its score, and the text itself with ``return_text``."""

    index: int
    score: float
    text: str | None = None


def relevance_index(labels: Sequence[str]) -> int | None:
    """The head output that scores relevance (see the module docstring): 0 for a one-label head, the first label
    starting with one of :data:`RELEVANT_PREFIXES` (case-insensitive), else 1 for a two-label head; None for any
    other head."""
    if len(labels) <= 1:
        return 0
    for i, label in enumerate(labels):
        if str(label).lower().startswith(RELEVANT_PREFIXES):
            return i
    return 1 if len(labels) == 2 else None


def validate_rerank(runner: Any, query: str, texts: Sequence[str], top_n: int = 0, raw_scores: bool = False,
                    return_text: bool = False, truncate: bool = True) -> RerankRequest:
    """Check a rerank request against ``runner`` (a ready sequence classifier) before any tokenizing: the text
    count on the sequence as given (1..``max_rerank_texts``, ``len()`` reads no text), ``top_n`` (0 = all, a
    larger one than the texts gives them all), the entries' types, the pairs' characters (``len(texts)`` x the
    query's plus the texts', at most ``max_request_chars``), a blank query or text, the model's relevance label
    (:func:`relevance_index`).

    Raises:
        Unavailable: the model is not ready.
        InvalidArgument: naming the field, the index of a bad entry and the config key of a limit; or a model
            whose head has no relevance label (naming its labels) or that is not a sequence classifier.
    """
    cfg = runner.config
    if texts is None or len(texts) == 0:
        raise InvalidArgument("texts is empty; send at least one text to rank")
    if len(texts) > cfg.max_rerank_texts:
        raise InvalidArgument(f"texts has {len(texts)} entries; model {runner.name!r} ranks at most "
                              f"{cfg.max_rerank_texts} per request (max_rerank_texts); split the request")
    try:
        n = -1 if isinstance(top_n, bool) else operator.index(top_n)  # any integer type (numpy's too)
    except TypeError:
        n = -1
    if n < 0:
        raise InvalidArgument(f"top_n {top_n!r} must be a non-negative integer (0: all texts)")
    if not isinstance(query, str):
        raise InvalidArgument(f"query must be a string, got {type(query).__name__}")
    texts = list(texts)
    check_types(texts, "texts")
    chars = len(texts) * len(query) + sum(map(len, texts))
    check_request_size(runner.name, len(texts), chars, None, cfg.max_request_chars, "(query, text) pairs")
    if is_blank(query):
        raise InvalidArgument("query is empty or only whitespace; send at least one non-space character")
    check_not_blank(texts, "texts")
    labels = nli_model_labels(runner, "rerank")
    if relevance_index(labels) is None:
        raise InvalidArgument(f"model {runner.name!r} has {len(labels)} labels {list(labels)} and none of them "
                              f"names relevance (a label starting with {', '.join(RELEVANT_PREFIXES)}); rerank "
                              f"needs a one-label cross-encoder, a two-label head, or such a label")
    return RerankRequest(query, texts, n, bool(raw_scores), bool(return_text), bool(truncate))


def encode_query_pairs(tokenizer: Tokenizer, query: str, texts: Sequence[str], max_seq_len: int,
                       truncate: bool) -> list[Encoding]:
    """``[CLS] query [SEP] text [SEP]`` per text (classify's :func:`preprocess`: longest-first truncation to the
    model's window).

    Raises:
        InvalidArgument: with ``truncate`` false, the first pair over the window (naming ``texts[i]`` and the
            limit); ``max_seq_len`` under 5 tokens.
    """
    encodings = preprocess(tokenizer, [query] * len(texts), texts, max_seq_len)
    if not truncate:
        for i, e in enumerate(encodings):
            if e.truncated:
                limit = effective_max_length(tokenizer, max_seq_len)
                raise InvalidArgument(f"texts[{i}]: the (query, text) pair is longer than the model's {limit}-token "
                                      f"window (max_seq_len) and truncate is false; shorten it or set truncate")
    return encodings


def relevance_scores(logits: np.ndarray, index: int, problem_type: str | None, raw_scores: bool) -> np.ndarray:
    """Each pair's score from the logits ``Float[n_texts, num_labels]`` (see the module docstring).
    Returns ``Float64[n_texts]``.

    Raises:
        Internal: non-finite logits.
    """
    x = np.asarray(logits, dtype=np.float64)
    if not np.all(np.isfinite(x)):
        raise Internal(f"the model returned non-finite logits {x.tolist()}")
    if raw_scores:
        return x[:, index]
    if x.shape[1] == 1:
        return 1.0 / (1.0 + np.exp(-x[:, 0]))
    function = default_function(problem_type, x.shape[1])
    if function == "none":  # a regression head with several outputs has no probability: its logit
        return x[:, index]
    return np.array([apply_function(row, function)[index] for row in x])


async def rerank(runner: Any, request: RerankRequest, deadline: float | None) -> tuple[list[RerankItem], Timings]:
    """Rank a validated request's texts (:func:`validate_rerank`) on ``runner``: sorted by score descending
    (ties: lower index first), the best ``top_n`` (0: all).

    Admission before work: one place per pair is reserved in the batcher before any tokenizing (a full queue
    refuses the request, RESOURCE_EXHAUSTED, at no cost); the pairs run as units of one request.

    Raises:
        Unavailable: the model is not ready.
        InvalidArgument: an over-long pair with ``truncate`` false (:func:`encode_query_pairs`), or a head with
            no relevance label (the model was swapped since validation).
        RelserveError: from the batcher (queue full, deadline, shutting down, model failure).
    """
    meta, index = head_label(runner, relevance_index, "relevance")
    _encodings, units, timings = await run_encoded(
        runner, len(request.texts), deadline, encode_query_pairs, meta.tokenizer, request.query, request.texts,
        runner.max_seq_len, request.truncate,
    )
    logits = np.stack([np.asarray(u.result).reshape(-1) for u in units])
    scores = relevance_scores(logits, index, meta.problem_type, request.raw_scores)
    order = np.argsort(-scores, kind="stable")
    if request.top_n:
        order = order[:request.top_n]
    items = [RerankItem(int(i), float(scores[i]), request.texts[i] if request.return_text else None) for i in order]
    return items, timings
