"""Text facts every tokenization module shares: character offsets, Unicode whitespace, and the one
definition of blank text (``is_blank``) that every task applies to user input."""

from __future__ import annotations

Offset = tuple[int, int]  # (start, end) Python str indices (code points), end exclusive

# Unicode White_Space (what Rust's regex `\s` and `char::is_whitespace` match; Python's str.isspace also
# accepts U+001C..U+001F, which tokenizers does not)
_WHITE_SPACE = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000"
)

# What counts as "nothing there" in user text, one definition for every task: besides ``str.isspace()``
# characters, the zero-width ones that real text carries invisibly (XQuAD contexts have U+FEFF and
# U+200B): zero-width space/non-joiner/joiner, word joiner and the BOM. A text made only of these is blank
# (INVALID_ARGUMENT for classification and QA, "" for translation), and answer spans never start or
# end on them.
INVISIBLE = frozenset("\u200b\u200c\u200d\u2060\ufeff")


def is_blank_char(ch: str) -> bool:
    """True for whitespace and the zero-width characters of ``INVISIBLE``."""
    return ch.isspace() or ch in INVISIBLE


def is_blank(text: str) -> bool:
    """True when ``text`` has no character other than whitespace and zero-width characters.

    The same set as ``all(is_blank_char(ch) for ch in text)``, computed with C string methods (``isspace``,
    ``strip`` and ``replace`` share ``str.isspace``'s definition of whitespace), so a 4 MB text costs
    milliseconds rather than a Python loop over every character (the servicer calls this on the event loop).
    """
    if not text or text.isspace():
        return True
    if not (text[0].isspace() or text[0] in INVISIBLE):
        return False  # the usual case, without touching the rest of a long text
    rest = text.strip()  # non-empty: text.isspace() is False
    if not any(ch in rest for ch in INVISIBLE):
        return False  # rest starts with a character that is neither whitespace nor zero-width
    for ch in INVISIBLE:
        rest = rest.replace(ch, "")
    return not rest or rest.isspace()
