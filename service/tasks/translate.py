"""Translation end to end: the request's decoding options validated once (:func:`validate_translate`),
admission in the decode loop, source encoding, decoding, detokenized hypotheses out (:func:`translate`,
:func:`translate_stream`).

Rules (documented in the proto):

* ``beam_size`` 0 -> the model's configured default; 1..16. ``n_best`` 0 -> 1; 1..beam_size.
* ``max_length`` 0 -> ``min(int(max_len_a * source_tokens + max_len_b), max_output_tokens)`` per text; an
  explicit one must be <= ``max_output_tokens``. Counts the final EOS
  (:meth:`relserve.models.decode_types.DecodeOptions.max_length_for`).
* A source longer than ``max_source_tokens`` (pieces + EOS) is INVALID_ARGUMENT, naming the limit; only as
  much of it is encoded as it takes to know (``TranslationTokenizer.encode_source_bounded``).
* At most ``max_request_texts`` texts and ``max_request_chars`` characters per request (INVALID_ARGUMENT,
  naming the key), checked before any encoding.
* A blank text (empty, whitespace or zero-width characters only) is not sent to the model: one hypothesis
  with text "" and score 0.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Sequence

from relserve.models.decode_types import DecodeOptions, Hypothesis
from relserve.service.config import MAX_BEAM_SIZE, ModelConfig
from relserve.service.errors import DeadlineExceeded, InvalidArgument
from relserve.service.tasks.limits import check_request_size, check_text_count, count_chars
from relserve.service.tasks.text import is_blank


@dataclass
class TranslationItem:
    """One text's answer: its n-best list (best first) and what the encoder read."""

    hypotheses: list[Hypothesis]
    num_source_tokens: int  # pieces + EOS; 0 for a blank text
    source_pieces: tuple[str, ...] = ()  # one per source token, when alignments were asked for


def validate_translate(texts: Sequence[str], *, beam_size: int, n_best: int, max_length: int,
                       return_alignment: bool, config: ModelConfig) -> DecodeOptions:
    """Check a Translate / TranslateStream request and resolve its defaults from the model's config. ``texts``
    may be a wire message's repeated field: its count is checked before any text is read.

    Returns:
        The options every text of the request is decoded with (the length rule resolves per text).

    Raises:
        InvalidArgument: no texts, too many texts or characters (naming ``max_request_texts`` /
            ``max_request_chars``), or a field out of range (naming the field, its value and the range).
    """
    c = config
    if not texts:
        raise InvalidArgument("texts is empty; send at least one text")
    check_text_count(c.name, len(texts), c.max_request_texts)  # before any text is read: len() of the wire field
    check_request_size(c.name, len(texts), count_chars(texts), c.max_request_texts, c.max_request_chars)
    beam = beam_size or c.beam_size
    if not 1 <= beam <= MAX_BEAM_SIZE:
        raise InvalidArgument(
            f"beam_size {beam_size} is out of range; allowed 1..{MAX_BEAM_SIZE} (0 = default {c.beam_size})"
        )
    nb = n_best or 1
    if not 1 <= nb <= beam:
        raise InvalidArgument(f"n_best {n_best} is out of range; allowed 1..beam_size ({beam}) (0 = 1)")
    if not 0 <= max_length <= c.max_output_tokens:
        raise InvalidArgument(
            f"max_length {max_length} is out of range; allowed 1..max_output_tokens {c.max_output_tokens} of "
            f"model {c.name!r} (0 = default min({c.max_len_a:g} x source tokens + {c.max_len_b}, "
            f"{c.max_output_tokens}))"
        )
    return DecodeOptions(beam_size=beam, n_best=nb, length_penalty=c.length_penalty, max_len_a=c.max_len_a,
                         max_len_b=c.max_len_b, max_len_cap=c.max_output_tokens, max_length=int(max_length),
                         return_alignment=bool(return_alignment))


def preprocess(tokenizer: Any, texts: Sequence[str], max_source_tokens: int, model: str) -> list[list[int] | None]:
    """Source ids (pieces + EOS) per text; None for a blank text (never sent to the model). A text is encoded
    only as far as it takes to know it is too long (``tokenizer.encode_source_bounded``).

    Raises:
        InvalidArgument: a text has more than ``max_source_tokens`` source tokens (names the text and limit).
    """
    sources: list[list[int] | None] = []
    for i, t in enumerate(texts):
        if is_blank(t):
            sources.append(None)
            continue
        ids, complete = tokenizer.encode_source_bounded(t, max_source_tokens)
        if not complete:
            raise InvalidArgument(
                f"texts[{i}] has more than {max_source_tokens} source tokens (pieces + EOS; at least "
                f"{len(ids) + 1}); model {model!r} has max_source_tokens {max_source_tokens}; split the text"
            )
        sources.append(list(ids))
    return sources


def postprocess(tokenizer: Any, source: list[int] | None, hypotheses: Sequence[Hypothesis] | None,
                options: DecodeOptions) -> TranslationItem:
    """Detokenize one text's hypotheses (``text``, one target piece per token) and label its alignments.

    ``source`` None (a blank text): one empty hypothesis with score 0 and, when alignments were asked for,
    an empty alignment.
    """
    if source is None or hypotheses is None:
        return TranslationItem([Hypothesis([], 0.0, 0.0, False, False, () if options.return_alignment else None)], 0)
    out = []
    for h in hypotheses:
        alignment = h.alignment if options.return_alignment else None
        out.append(replace(h, text=tokenizer.decode_target(h.output_tokens),
                           pieces=tuple(tokenizer.target_pieces(h.tokens)), alignment=alignment))
    pieces = tuple(tokenizer.source_pieces(source)) if options.return_alignment else ()
    return TranslationItem(out, len(source), pieces)


@dataclass
class StreamEvent:
    """A partial best hypothesis (``final`` False) or the final result."""

    text: str
    tokens: list[str]
    step: int
    final: bool = False
    result: TranslationItem | None = None


async def _encode(runner: Any, texts: Sequence[str]) -> list[list[int] | None]:
    """Source ids per text (None for blank ones), checked against max_source_tokens, encoded in the model's
    tokenization threads (only as much of a text as it takes to know it is too long)."""
    sources, _seconds = await runner.tokenize(preprocess, runner.meta.tokenizer, list(texts),
                                              runner.config.max_source_tokens, runner.name)
    return sources


async def translate(runner: Any, texts: Sequence[str], options: DecodeOptions,
                    deadline: float | None) -> list[TranslationItem]:
    """Translate ``texts`` (already validated) with ``options`` on ``runner`` (a ready translation model,
    ``relserve.service.runner.TranslationRunner``); one item per text, in order.

    Raises:
        InvalidArgument: a text over max_source_tokens.
        RelserveError: from the decode loop (deadline, queue full, shutting down, model failure).
    """
    loop = runner.check_ready()
    with loop.reserve(len(texts), deadline) as reservation:  # admission before encoding: one place per text
        sources = await _encode(runner, texts)
        work = [(i, src) for i, src in enumerate(sources) if src is not None]
        seqs = loop.submit([(src, options) for _, src in work], deadline, reservation=reservation) if work else []
    results: list[list[Hypothesis] | None] = [None] * len(texts)
    if work:
        await loop.wait(seqs, deadline)
        for (i, _), s in zip(work, seqs):
            results[i] = s.result
    tok = runner.meta.tokenizer
    return [postprocess(tok, src, hyps, options) for src, hyps in zip(sources, results)]


async def translate_stream(runner: Any, text: str, options: DecodeOptions,
                           deadline: float | None) -> AsyncIterator[StreamEvent]:
    """The best live hypothesis after each decoder step (a slow reader gets the latest only), then the
    final result; same errors as :func:`translate`."""
    loop = runner.check_ready()
    events: asyncio.Queue = asyncio.Queue()

    def on_update(update: Any, step: int) -> None:
        events.put_nowait((step, update.best_tokens))

    with loop.reserve(1, deadline) as reservation:  # admission before encoding
        (src,) = await _encode(runner, [text])
        if src is not None:
            (seq,) = loop.submit([(src, options)], deadline, on_update=on_update, reservation=reservation)
    tok = runner.meta.tokenizer
    if src is None:
        yield StreamEvent(text="", tokens=[], step=0, final=True, result=postprocess(tok, None, None, options))
        return
    seq.future.add_done_callback(lambda _f: events.put_nowait(None))
    try:
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                event = await asyncio.wait_for(events.get(), timeout)
            except asyncio.TimeoutError:
                raise DeadlineExceeded(f"deadline exceeded while decoding (model {runner.name!r})") from None
            while event is not None and not events.empty():  # a slow reader gets the latest only
                event = events.get_nowait()
            if event is None:
                hyps = seq.result  # raises the sequence's error
                item = postprocess(tok, src, hyps, options)
                best = item.hypotheses[0]
                yield StreamEvent(text=best.text, tokens=list(best.output_pieces), step=seq.steps, final=True,
                                  result=item)
                return
            step, ids = event
            yield StreamEvent(text=tok.decode_target(ids), tokens=tok.target_pieces(ids), step=step)
    finally:
        loop.discard([seq])
