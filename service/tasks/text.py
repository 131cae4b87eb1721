"""What counts as "nothing there" in user text — one definition for every task.

Besides ``str.isspace()`` characters, the zero-width ones that real text carries invisibly (XQuAD
contexts have U+FEFF and U+200B). The definition lives in :mod:`relserve.models.tokenization`, because
the QA span search (:mod:`relserve.models.qa_spans`, never importing the service) trims answers with it;
the service's tasks use it from here.
"""

from __future__ import annotations

from relserve.models.tokenization import INVISIBLE, is_blank, is_blank_char

__all__ = ["INVISIBLE", "is_blank", "is_blank_char"]
