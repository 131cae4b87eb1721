"""SQuAD v1.1 answer scoring (the official evaluation script's rules, written for this project): answer
normalisation, token-level F1 and exact match for one prediction against one gold answer.

Used by the QA trainer (:mod:`relserve.models.training.qa`) and the quality evaluation through the server
(:mod:`relserve.loadtest.eval_quality`); it imports nothing heavier than the standard library.
"""

from __future__ import annotations

import collections
import re
import string


def normalize_answer(s: str) -> str:
    """Official SQuAD normalisation: lower case, drop punctuation and articles, collapse whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def f1_score(pred: str, gold: str) -> float:
    p, g = normalize_answer(pred).split(), normalize_answer(gold).split()
    if not p or not g:
        return float(p == g)
    common = collections.Counter(p) & collections.Counter(g)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


def exact_match(pred: str, gold: str) -> float:
    return float(normalize_answer(pred) == normalize_answer(gold))
