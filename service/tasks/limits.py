"""The per-request size limits every task shares, checked by each ``validate_*`` before any tokenizing.

``max_request_texts`` and ``max_request_chars`` are model config keys (``service/config.py``); the QA window
limit (``max_qa_windows``) and the translation source limit (``max_source_tokens``) need the tokenizer and are
checked while tokenizing, on bounded prefixes (``relserve.models.tokenization.leading_tokens``).
"""

from __future__ import annotations

from typing import Sequence

from relserve.service.errors import InvalidArgument


def check_request_size(model: str, n_texts: int, n_chars: int, max_texts: int | None,
                       max_chars: int | None, what: str = "texts") -> None:
    """The per-request size limits every task shares (None = no limit); the messages name the config keys.
    ``what`` names the counted sequences in the message (zero-shot and rerank count (text, hypothesis) /
    (query, text) pairs against the same keys).

    Raises:
        InvalidArgument: more than ``max_texts`` texts (``max_request_texts``) or ``max_chars`` characters
            (``max_request_chars``).
    """
    check_text_count(model, n_texts, max_texts, what)
    if max_chars is not None and n_chars > max_chars:
        raise InvalidArgument(f"the request has {n_chars} characters; model {model!r} takes at most {max_chars} "
                              f"per request (max_request_chars); send less text")


def check_text_count(model: str, n_texts: int, max_texts: int | None, what: str = "texts") -> None:
    """The text count limit alone, checked on the request's own sequence (``len(request.texts)`` of the wire
    message) before any text is read or copied: a refused request costs nothing in proportion to its texts.

    Raises:
        InvalidArgument: more than ``max_texts`` texts (``max_request_texts``; None = no limit).
    """
    if max_texts is not None and n_texts > max_texts:
        raise InvalidArgument(f"the request has {n_texts} {what}; model {model!r} takes at most {max_texts} per "
                              f"request (max_request_texts); split the request")


def count_chars(*sequences: Sequence[str] | None) -> int:
    """Characters in all the texts of ``sequences`` (None: none), each text read once and not kept."""
    return sum(sum(map(len, seq)) for seq in sequences if seq)
