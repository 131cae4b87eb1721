"""The per-request size limits every task shares, checked by each ``validate_*`` before any tokenizing.

``max_request_texts`` and ``max_request_chars`` are model config keys (``service/config.py``); the QA window
limit (``max_qa_windows``) and the translation source limit (``max_source_tokens``) need the tokenizer and are
checked while tokenizing, on bounded prefixes (``relserve.models.tokenization.leading_tokens``).
"""

from __future__ import annotations

from relserve.service.errors import InvalidArgument


def check_request_size(model: str, n_texts: int, n_chars: int, max_texts: int | None,
                       max_chars: int | None) -> None:
    """The per-request size limits every task shares (None = no limit); the messages name the config keys.

    Raises:
        InvalidArgument: more than ``max_texts`` texts (``max_request_texts``) or ``max_chars`` characters
            (``max_request_chars``).
    """
    if max_texts is not None and n_texts > max_texts:
        raise InvalidArgument(f"the request has {n_texts} texts; model {model!r} takes at most {max_texts} per "
                              f"request (max_request_texts); split the request")
    if max_chars is not None and n_chars > max_chars:
        raise InvalidArgument(f"the request has {n_chars} characters; model {model!r} takes at most {max_chars} "
                              f"per request (max_request_chars); send less text")
