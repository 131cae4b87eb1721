"""What counts as "nothing there" in user text — one definition for every task.

Besides ``str.isspace()`` characters, the zero-width ones that real text carries invisibly (XQuAD
contexts have U+FEFF and U+200B): zero-width space/non-joiner/joiner, word joiner and the BOM. A text
made only of these is blank (INVALID_ARGUMENT for classification and QA, "" for translation, C10), and
answer spans never start or end on them (C07).
"""

from __future__ import annotations

INVISIBLE = frozenset("\u200b\u200c\u200d\u2060\ufeff")


def is_blank_char(ch: str) -> bool:
    """True for whitespace and the zero-width characters above."""
    return ch.isspace() or ch in INVISIBLE


def is_blank(text: str) -> bool:
    """True when ``text`` has no character other than whitespace and zero-width characters."""
    return all(is_blank_char(ch) for ch in text)
