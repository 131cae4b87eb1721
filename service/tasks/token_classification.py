"""Token classification (NER, PII detection) end to end: the request validated once
(:func:`validate_token_classification`), admission, tokenization into windows, the batcher, and entities out
(:func:`classify_tokens`, whose :class:`TokenClassificationItem` list every frontend encodes).

Entities as transformers' ``TokenClassificationPipeline`` gives them, for every ``aggregation_strategy``
(``none`` / ``simple`` / ``first`` / ``average`` / ``max``) and ``ignore_labels``; the algorithms are
:mod:`relserve.models.token_entities` (which says where relserve differs: ``start`` / ``end`` are character
offsets into the original text, trimmed of whitespace, and ``word`` is exactly ``text[start:end]``).

A text longer than the window (``max_seq_len`` - 2 content tokens) runs as windows overlapping by ``stride``
tokens (the request's, else the ``token_stride`` key, else 128; at most half a window), merged as the pipeline
merges its chunks; with ``none`` (the pipeline refuses a stride there) a token two windows report is kept once.
Each text takes at most ``max_token_windows`` windows, proven on a bounded prefix of it before any model work
(the request's total is bounded by ``max_request_texts`` and ``max_request_chars``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from relserve.models import token_entities
from relserve.models.token_entities import AGGREGATION_STRATEGIES, window_count, window_starts
from relserve.models.tokenization import Encoding
from relserve.service.backends.base import TASK_TOKEN_CLASSIFICATION
from relserve.service.errors import Internal, InvalidArgument
from relserve.service.tasks.classify import effective_max_length
from relserve.service.tasks.limits import check_request_size, check_text_count, count_chars
from relserve.service.tasks.text import is_blank
from relserve.service.tasks.timings import Timings

__all__ = ["AGGREGATION_STRATEGIES", "DEFAULT_STRIDE", "Entity", "TokenClassificationItem",
           "TokenClassificationRequest", "classify_tokens", "validate_token_classification"]

DEFAULT_STRIDE = 128  # tokens, when neither the request nor the token_stride key sets one
MAX_IGNORE_LABELS = 256  # entries of ignore_labels per request
# Characters per token assumed when reserving queue places before tokenizing (as the QA task does).
ESTIMATE_CHARS_PER_TOKEN = 4


@dataclass
class TokenClassificationRequest:
    """A validated request: ``aggregation_strategy`` one of :data:`AGGREGATION_STRATEGIES`, ``stride`` in
    tokens, resolved (never None after validation)."""

    texts: list[str]
    aggregation_strategy: str
    ignore_labels: list[str]
    stride: int | None


@dataclass
class Entity:
    """One entity (or token, with ``none``): ``word`` is ``text[start:end]``; ``start`` / ``end`` character
    offsets (code points, end exclusive) into the original text; ``score`` a probability. ``entity_group`` is
    set for simple / first / average / max (the label's tag), ``entity`` and ``index`` (the token's position,
    ``[CLS]`` = 0, counted over the whole text) for none."""

    word: str
    score: float
    start: int
    end: int
    entity_group: str | None = None
    entity: str | None = None
    index: int | None = None


@dataclass
class TokenClassificationItem:
    """One text's entities in text order, the windows it took and the tokens fed to the model (all windows,
    special tokens included)."""

    entities: list[Entity]
    num_windows: int
    num_tokens: int


def _window_room(runner: Any) -> int:
    """Content tokens per window: the model's window less ``[CLS]`` and ``[SEP]``."""
    return effective_max_length(runner.meta.tokenizer, runner.max_seq_len) - 2


def validate_token_classification(runner: Any, texts: Sequence[str], aggregation_strategy: str | None = None,
                                  ignore_labels: Sequence[str] | None = None,
                                  stride: int | None = None) -> TokenClassificationRequest:
    """Check a token-classification request against ``runner`` (a ready model) before any tokenizing: the
    model's task, 1..``max_request_texts`` texts (counted with ``len()`` first), at most ``max_request_chars``
    characters, none blank; ``aggregation_strategy`` (None or "" = "none"; case-insensitive); ``ignore_labels``
    (None = ["O"]; [] ignores nothing; at most ``MAX_IGNORE_LABELS``); ``stride`` (None = the ``token_stride``
    key, else ``DEFAULT_STRIDE``, lowered to half a window's room; a request's own at most that half).

    Raises:
        Unavailable: the model is not loaded yet (its task is unknown).
        InvalidArgument: a model of another task (naming ``model``), or a bad field (naming it, the index of the
            bad entry and the limit with its config key).
    """
    if runner.meta is None:
        runner.check_ready()  # raises UNAVAILABLE naming the state
    if runner.task != TASK_TOKEN_CLASSIFICATION:
        raise InvalidArgument(f"model {runner.name!r} is a {runner.task} model; token classification needs a "
                              f"token-classification model (DebertaV2ForTokenClassification or "
                              f"DebertaForTokenClassification)")
    cfg = runner.config
    if texts is None or len(texts) == 0:
        raise InvalidArgument("texts is empty; send at least one text")
    check_text_count(runner.name, len(texts), cfg.max_request_texts)
    for i in range(len(texts)):
        if not isinstance(texts[i], str):
            raise InvalidArgument(f"texts[{i}] must be a string, got {type(texts[i]).__name__}")
    check_request_size(runner.name, len(texts), count_chars(texts), cfg.max_request_texts, cfg.max_request_chars)
    for i, t in enumerate(texts):
        if is_blank(t):
            raise InvalidArgument(f"texts[{i}] is empty or only whitespace; send at least one non-space character")
    strategy = (aggregation_strategy or "none")
    if not isinstance(strategy, str) or strategy.lower() not in AGGREGATION_STRATEGIES:
        raise InvalidArgument(f"aggregation_strategy {aggregation_strategy!r} is not one of "
                              f"{', '.join(AGGREGATION_STRATEGIES)} (empty: none)")
    if ignore_labels is None:
        ignored = ["O"]
    else:
        if len(ignore_labels) > MAX_IGNORE_LABELS:
            raise InvalidArgument(f"ignore_labels has {len(ignore_labels)} entries; at most {MAX_IGNORE_LABELS}")
        ignored = list(ignore_labels)
        for i, label in enumerate(ignored):
            if not isinstance(label, str):
                raise InvalidArgument(f"ignore_labels[{i}] must be a string, got {type(label).__name__}")
    limit = _window_room(runner) // 2
    if stride is None:
        resolved = min(cfg.token_stride if cfg.token_stride is not None else DEFAULT_STRIDE, limit)
    elif isinstance(stride, bool) or not isinstance(stride, int) or not 0 <= stride <= limit:
        raise InvalidArgument(
            f"stride {stride!r} is out of range; allowed 0..{limit} tokens: the overlap between windows may be at "
            f"most half a window's room ((max_seq_len {runner.max_seq_len} - 2 special tokens) // 2), so that each "
            f"window advances by at least half a window")
    else:
        resolved = stride
    return TokenClassificationRequest(list(texts), strategy.lower(), ignored, resolved)


class _TooManyWindows(Exception):
    pass


def _tokens_and_windows(tokenizer: Any, texts: list[str], room: int, stride: int,
                        limit: int) -> tuple[list[tuple[list[int], list[tuple[int, int]]]], list[list[int]]]:
    """Each text's content tokens and offsets, and its windows' first tokens; raises ``_TooManyWindows(index)`` for
    the first text that needs more than ``limit`` windows, having tokenized only a bounded prefix of it (enough
    tokens to prove it)."""
    step = room - stride
    need = room + (limit - 1) * step + 1  # a text of this many tokens needs limit + 1 windows
    leading = tokenizer.leading_tokens(texts, [need] * len(texts), offsets=True)
    tokens, starts = [], []
    for i, lead in enumerate(leading):
        n = len(lead.ids)
        if (not lead.complete and n >= need) or window_count(n, room, stride) > limit:
            raise _TooManyWindows(i)
        tokens.append((list(lead.ids), [tuple(o) for o in lead.offsets]))
        starts.append(window_starts(n, room, stride))
    return tokens, starts


def _entities(text: str, ids: list[int], offsets: list[tuple[int, int]], starts: list[int], logits: list[Any],
              room: int, request: TokenClassificationRequest, labels: Sequence[str],
              unk: int | None) -> list[Entity]:
    found: list[token_entities.TokenEntity] = []
    for a, out in zip(starts, logits):
        b = min(a + room, len(ids))
        found += token_entities.window_entities(text, ids[a:b], offsets[a:b], np.asarray(out)[1:1 + b - a], labels,
                                                request.aggregation_strategy, request.ignore_labels,
                                                unk_token_id=unk, first_index=a + 1)
    none = request.aggregation_strategy == "none"
    if len(starts) > 1:
        found = (token_entities.merge_overlapping_tokens if none else token_entities.merge_overlapping)(found)
    return [Entity(word=text[e.start:e.end], score=float(e.score), start=e.start, end=e.end,
                   entity_group=None if none else e.label, entity=e.label if none else None,
                   index=e.index if none else None)
            for e in token_entities.finish(text, found)]


async def classify_tokens(runner: Any, request: TokenClassificationRequest,
                          deadline: float | None) -> tuple[list[TokenClassificationItem], Timings]:
    """Classify the tokens of a validated request's texts on ``runner`` (a ready token-classification model);
    one item per text, in order.

    Admission before work: queue places for the windows the texts' lengths suggest (at most
    ``max_token_windows`` each) are reserved before tokenizing, so a full queue refuses at no cost; then the
    texts are tokenized (bounded prefixes first) and the window limit checked before anything is submitted.

    Raises:
        Unavailable: the model is not ready.
        InvalidArgument: a text over ``max_token_windows`` windows (naming it and the key).
        Internal: non-finite logits, or logits that do not fit the tokens.
        RelserveError: from the batcher (queue full, deadline, shutting down, model failure).
    """
    batcher = runner.check_ready()
    meta = runner.meta
    tokenizer = meta.tokenizer
    room = _window_room(runner)
    stride = request.stride if request.stride is not None else min(DEFAULT_STRIDE, room // 2)
    limit = runner.config.max_token_windows
    estimate = sum(min(limit, window_count(len(t) // ESTIMATE_CHARS_PER_TOKEN, room, stride)) for t in request.texts)
    timings = Timings()
    with batcher.reserve(max(1, estimate), deadline) as reservation:
        try:
            (tokens, starts), timings.tokenization_s = await runner.tokenize(
                _tokens_and_windows, tokenizer, request.texts, room, stride, limit)
        except _TooManyWindows as exc:
            raise InvalidArgument(
                f"texts[{exc.args[0]}] needs more than {limit} windows of {room} tokens overlapping by {stride} "
                f"(model {runner.name!r}'s max_token_windows); send a shorter text") from None
        windows = []
        for (ids, _), first in zip(tokens, starts):
            for a in first:
                chunk = ids[a:a + room]
                ids_in = [tokenizer.cls_token_id, *chunk, tokenizer.sep_token_id]
                windows.append(Encoding(ids_in, [0] * len(ids_in)))
        units = batcher.submit([(len(w.input_ids), w) for w in windows], deadline, reservation)
    units = await batcher.wait(units, deadline)
    timings.add_units(units)
    labels = meta.labels
    items, at = [], 0
    for text, (ids, offsets), first in zip(request.texts, tokens, starts):
        mine = units[at:at + len(first)]
        fed = windows[at:at + len(first)]
        at += len(first)
        logits = [u.result for u in mine]
        for out in logits:
            if not np.all(np.isfinite(out)):
                raise Internal(f"model {runner.name!r} returned non-finite token logits")
        try:
            entities = _entities(text, ids, offsets, first, logits, room, request, labels, tokenizer.unk_token_id)
        except ValueError as exc:  # logits that do not fit the tokens: a model bug, not the client's
            raise Internal(str(exc)) from None
        items.append(TokenClassificationItem(entities, len(first), sum(len(w.input_ids) for w in fed)))
    return items, timings
