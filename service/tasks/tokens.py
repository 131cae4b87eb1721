"""Tokenization as a request (text-embeddings-inference's ``/tokenize``): each text through the model's own
tokenizer, its tokens with their ids, the text each covers and its offsets, the special tokens marked.

Bounded before any tokenizing: at most ``max_request_texts`` texts and ``max_request_chars`` characters
(:func:`validate_tokenize`); the tokenizing runs in the model's tokenization threads
(:meth:`relserve.service.runner.Runner.tokenize`), never on the event loop. No batcher: no model runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from relserve.service.backends.base import TASK_CLASSIFICATION, TASK_QA
from relserve.service.errors import FailedPrecondition, InvalidArgument
from relserve.service.tasks.limits import check_request_size


@dataclass(frozen=True)
class Token:
    """One token: its id, the text it covers (a special token: its own string), whether it is a special token
    the template added, and its offsets in the text (None for a special token; end exclusive)."""

    id: int
    text: str
    special: bool
    start: int | None
    end: int | None


def validate_tokenize(texts: Sequence[str], model: str, *, max_texts: int | None, max_chars: int | None) -> list[str]:
    """Check a tokenize request: at least one text, the shared size limits (naming their config keys).

    Raises:
        InvalidArgument: no texts, too many texts or characters.
    """
    if not texts:
        raise InvalidArgument("texts is empty; send at least one text")
    check_request_size(model, len(texts), sum(map(len, texts)), max_texts, max_chars)
    return list(texts)


def _utf8_positions(text: str) -> list[int]:
    """The UTF-8 byte position of each character boundary of ``text`` (``len(text) + 1`` entries)."""
    positions = [0]
    total = 0
    for ch in text:
        total += len(ch.encode("utf-8", "surrogatepass"))
        positions.append(total)
    return positions


def token_lists(tokenizer: Any, texts: Sequence[str], add_special_tokens: bool,
                utf8_offsets: bool) -> list[list[Token]]:
    """The tokens of each text: ``[CLS] text [SEP]`` with ``add_special_tokens`` (the model's template for one
    text), else the text's tokens alone; offsets in characters, or in UTF-8 bytes with ``utf8_offsets``."""
    out = []
    for text in texts:
        ids, offsets = tokenizer.tokenize(text)
        positions = _utf8_positions(text) if utf8_offsets else None
        tokens = []
        for token_id, (start, end) in zip(ids, offsets):
            tokens.append(Token(int(token_id), text[start:end], False,
                                positions[start] if positions else start, positions[end] if positions else end))
        if add_special_tokens:
            tokens = [Token(tokenizer.cls_token_id, tokenizer.cls_token, True, None, None), *tokens,
                      Token(tokenizer.sep_token_id, tokenizer.sep_token, True, None, None)]
        out.append(tokens)
    return out


async def tokenize(runner: Any, texts: Sequence[str], add_special_tokens: bool, *,
                   utf8_offsets: bool = False) -> list[list[Token]]:
    """Tokenize validated ``texts`` (:func:`validate_tokenize`) with the tokenizer of ``runner`` (a ready
    encoder model: classification or question answering) in its tokenization threads.

    Raises:
        FailedPrecondition: ``runner`` is a model of another task (its tokenizer is not an encoder's).
        Unavailable: the model is not ready.
    """
    if runner.task not in (TASK_CLASSIFICATION, TASK_QA):
        raise FailedPrecondition(f"model {runner.name!r} is a {runner.task} model; tokenize serves encoder models "
                                 f"(classification, question answering)")
    runner.check_ready()
    tokens, _seconds = await runner.tokenize(token_lists, runner.meta.tokenizer, list(texts), add_special_tokens,
                                             utf8_offsets)
    return tokens
