"""transformers 5's DeBERTa-v2 text pipeline with character alignment, and DeBERTa's punctuation split.

:func:`_deberta_v2_normalize` applies what transformers 5 ``DebertaV2Tokenizer`` builds for an ``spm.model``
directory (optional lower-casing, whitespace runs -> one space, NFC, strip right) and keeps, per normalised
character, the span of original characters it came from, so offsets computed on the normalised text map back
into the caller's text. :func:`_punct_segments` is ``split_by_punct`` (both transformers generations cut
around every :func:`_is_punct` character). Used by the ``spm.model`` backends (:mod:`.backends`).
"""

from __future__ import annotations

import unicodedata

from .text import _WHITE_SPACE, Offset


def _deberta_v2_normalize(text: str, lower: bool) -> tuple[str, list[Offset]]:
    """transformers 5 DebertaV2 normaliser with alignment.

    Returns the normalised string and, per normalised char, the (start, end) span of original chars it
    comes from. Steps: Lowercase (optional, per char), Replace(``\\s{2,}|[\\n\\r\\t]`` -> " "), NFC,
    Strip(right).
    """
    chars: list[str] = []
    spans: list[Offset] = []
    for i, ch in enumerate(text):
        out = ch.lower() if lower else ch
        for o in out:
            chars.append(o)
            spans.append((i, i + 1))
    # whitespace runs of >= 2, or a single \n \r \t, become one space spanning the run
    c2: list[str] = []
    s2: list[Offset] = []
    i, n = 0, len(chars)
    while i < n:
        if chars[i] in _WHITE_SPACE:
            j = i
            while j < n and chars[j] in _WHITE_SPACE:
                j += 1
            if j - i >= 2 or chars[i] in "\n\r\t":
                c2.append(" ")
                s2.append((spans[i][0], spans[j - 1][1]))
            else:
                c2.append(chars[i])
                s2.append(spans[i])
            i = j
        else:
            c2.append(chars[i])
            s2.append(spans[i])
            i += 1
    joined = "".join(c2)
    if not unicodedata.is_normalized("NFC", joined):
        c2, s2 = _nfc_aligned(c2, s2)
    while c2 and c2[-1] in _WHITE_SPACE:
        c2.pop()
        s2.pop()
    return "".join(c2), s2


def _nfc_aligned(chars: list[str], spans: list[Offset]) -> tuple[list[str], list[Offset]]:
    """NFC per cluster (a starter plus following combining marks / Hangul V,T jamo), keeping alignment."""
    out_c: list[str] = []
    out_s: list[Offset] = []
    i, n = 0, len(chars)
    while i < n:
        j = i + 1
        while j < n and (unicodedata.combining(chars[j]) or "\u1160" <= chars[j] <= "\u11ff"):
            j += 1
        composed = unicodedata.normalize("NFC", "".join(chars[i:j]))
        span = (spans[i][0], spans[j - 1][1])
        if len(composed) == j - i:
            out_c.extend(composed)
            out_s.extend(spans[i:j])
        else:
            out_c.extend(composed)
            out_s.extend([span] * len(composed))
        i = j
    return out_c, out_s


def _is_punct(ch: str) -> bool:
    """Punctuation as both DeBERTa-v2 tokenizers define it for ``split_by_punct``: ASCII ``!``-``/``,
    ``:``-``@``, ``[``-`````, ``{``-``~``, or a Unicode ``P*`` category (transformers 4 ``_is_punctuation``,
    and the ``tokenizers`` ``Punctuation`` pre-tokenizer transformers 5 uses)."""
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _punct_segments(text: str) -> list[tuple[int, int]]:
    """``(start, end)`` of the pieces of ``text`` cut around every punctuation character, each punctuation
    character a piece of its own, no empty pieces (transformers 4 ``_run_split_on_punc``, ``Punctuation``
    ``isolated``)."""
    out: list[tuple[int, int]] = []
    start = 0
    for i, ch in enumerate(text):
        if _is_punct(ch):
            if start < i:
                out.append((start, i))
            out.append((i, i + 1))
            start = i + 1
    if start < len(text):
        out.append((start, len(text)))
    return out
