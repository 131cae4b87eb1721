"""Load-test scenarios: which RPC to send next, built from real text committed under ``loadtest/data/``.

* ``classify``        — one sentiment dev sentence per Classify request (``--batch`` texts per request).
* ``classify-mixed``  — Classify with widely mixed lengths: 1 to 16 sentences joined (about 10 to 400
  tokens), the scenario where length bucketing pays.
* ``qa``              — Answer with XQuAD dev question/paragraph pairs.
* ``translate``       — Translate with German dictionary sentences (only when the server lists a
  translation model).
* ``mix``             — a weighted mix of the above over the models the server lists (default weights:
  classify 0.6, qa 0.3, translate 0.1).

Texts and provenance: ``loadtest/data/PROVENANCE.md``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from relserve.service._proto import inference_pb2 as pb

DATA_DIR = Path(__file__).resolve().parent / "data"
SCENARIOS = ("classify", "classify-mixed", "qa", "translate", "mix")
TASK_OF_KIND = {"classify": "classification", "qa": "question-answering", "translate": "translation"}
METHOD_OF_KIND = {"classify": "Classify", "qa": "Answer", "translate": "Translate"}
DEFAULT_MIX = {"classify": 0.6, "qa": 0.3, "translate": 0.1}


class ScenarioUnavailable(Exception):
    """The server does not list a model the scenario needs (e.g. no translation model)."""


def _jsonl(name: str) -> list[dict]:
    with open(DATA_DIR / name, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def sentences() -> list[str]:
    return [r["text"] for r in _jsonl("sentiment_dev.jsonl")]


def qa_pairs() -> list[tuple[str, str]]:
    return [(r["question"], r["context"]) for r in _jsonl("qa_dev.jsonl")]


def german_sources() -> list[str]:
    return [r["source"] for r in _jsonl("de_en_dev.jsonl")]


@dataclass(frozen=True)
class Call:
    """One request to send: its kind (classify / qa / translate), RPC method name and message."""

    kind: str
    method: str
    request: Any


def mixed_length_texts(n: int, seed: int = 0) -> list[str]:
    """``n`` texts of 1, 2, 4, 8 or 16 joined sentiment sentences (about 10 to 400 tokens)."""
    rng = random.Random(seed)
    pool = sentences()
    out = []
    for _ in range(n):
        k = rng.choice((1, 1, 1, 2, 2, 4, 4, 8, 16))
        out.append(" ".join(rng.choice(pool) for _ in range(k)))
    return out


def _pool(kind: str, model: str, *, batch: int, mixed: bool, beam_size: int, seed: int) -> list[Call]:
    method = METHOD_OF_KIND[kind]
    if kind == "classify":
        texts = mixed_length_texts(300, seed) if mixed else sentences()
        batch = max(1, batch)
        calls = []
        for i in range(0, len(texts) - batch + 1, batch):
            calls.append(Call(kind, method, pb.ClassifyRequest(model=model, texts=texts[i:i + batch])))
        return calls
    if kind == "qa":
        return [Call(kind, method, pb.AnswerRequest(model=model, question=q, context=c)) for q, c in qa_pairs()]
    if kind == "translate":
        srcs = german_sources()
        batch = max(1, batch)
        return [Call(kind, method, pb.TranslateRequest(model=model, texts=srcs[i:i + batch], beam_size=beam_size))
                for i in range(0, len(srcs) - batch + 1, batch)]
    raise ValueError(f"unknown request kind {kind!r}")


class Scenario:
    """Picks the next call at random (seeded) from pre-built request pools.

    Args:
        name: one of :data:`SCENARIOS`.
        models: ``{kind: model name}`` for the kinds the server can serve.
        weights: for ``mix``: ``{kind: weight}`` (kinds without a model are dropped).
        batch: texts per Classify / Translate request.
        beam_size: Translate beam size (0 = the model's default).

    Raises:
        ScenarioUnavailable: no model for the kind(s) the scenario needs.
    """

    def __init__(self, name: str, models: dict[str, str], *, weights: dict[str, float] | None = None,
                 batch: int = 1, beam_size: int = 0, seed: int = 0) -> None:
        if name not in SCENARIOS:
            raise ValueError(f"unknown scenario {name!r}; choose one of {list(SCENARIOS)}")
        self.name = name
        if name == "mix":
            wanted = dict(weights or DEFAULT_MIX)
            kinds = [k for k, w in wanted.items() if w > 0 and k in models]
            if not kinds:
                raise ScenarioUnavailable(f"scenario mix: the server lists no model for any of {sorted(wanted)}")
        else:
            kind = "classify" if name == "classify-mixed" else name
            if kind not in models:
                raise ScenarioUnavailable(
                    f"scenario {name}: the server lists no {TASK_OF_KIND[kind]} model"
                )
            kinds, wanted = [kind], {kind: 1.0}
        self.kinds = kinds
        self.weights = [float(wanted[k]) for k in kinds]
        self.models = {k: models[k] for k in kinds}
        self._rng = random.Random(seed)
        self._pools = {
            k: _pool(k, models[k], batch=batch, mixed=name == "classify-mixed", beam_size=beam_size, seed=seed)
            for k in kinds
        }

    def next(self) -> Call:
        kind = self.kinds[0] if len(self.kinds) == 1 else self._rng.choices(self.kinds, self.weights)[0]
        return self._rng.choice(self._pools[kind])

    def texts(self, kind: str) -> Sequence[Any]:
        """The requests of one kind (benchmarks replay them offline)."""
        return [c.request for c in self._pools[kind]]


def parse_weights(spec: str | None) -> dict[str, float] | None:
    """``classify=0.6,qa=0.3,translate=0.1`` -> dict (None passes through).

    Raises:
        ValueError: malformed entry or unknown kind.
    """
    if not spec:
        return None
    out: dict[str, float] = {}
    for item in spec.split(","):
        if "=" not in item:
            raise ValueError(f"--mix entry {item!r} is not kind=weight")
        k, v = (s.strip() for s in item.split("=", 1))
        if k not in TASK_OF_KIND:
            raise ValueError(f"--mix kind {k!r} is not one of {sorted(TASK_OF_KIND)}")
        out[k] = float(v)
    return out


def models_by_kind(model_infos: Sequence[Any], overrides: dict[str, str | None] | None = None) -> dict[str, str]:
    """Pick one served model per kind from ListModels (first listed of each task), honouring overrides."""
    out: dict[str, str] = {}
    for kind, task in TASK_OF_KIND.items():
        chosen = (overrides or {}).get(kind)
        if chosen:
            out[kind] = chosen
            continue
        for m in model_infos:
            if m.task == task:
                out[kind] = m.name
                break
    if "translate" in out and not hasattr(pb, "TranslateRequest"):
        del out["translate"]
    return out
