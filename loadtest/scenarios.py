"""Load-test scenarios: which RPC to send next, built from real text committed under ``loadtest/data/``.

* ``classify``        — one sentiment dev sentence per Classify request (``--batch`` texts per request).
* ``classify-mixed``  — Classify with widely mixed lengths: 1 to 16 sentences joined (about 10 to 400
  tokens), the scenario where length bucketing pays.
* ``classify-pair``   — Classify with ``text_pairs`` (sentence-pair / NLI-style input, ``[CLS] a [SEP] b
  [SEP]``): QNLI-style (question, sentence) pairs, each XQuAD dev question with one sentence of its paragraph
  (:func:`question_sentence_pairs`).
* ``qa``              — Answer with XQuAD dev question/paragraph pairs.
* ``translate``       — Translate with German dictionary sentences (only when the server lists a
  translation model).
* ``zero-shot``       — ZeroShotClassify: ``--batch`` sentiment dev sentences per request against five candidate
  labels (:data:`ZERO_SHOT_LABELS`), on an NLI model (one whose labels include an entailment label).
* ``classify-tokens`` — ClassifyTokens (``simple`` aggregation) with the XQuAD dev paragraphs (names, places,
  dates; most span several windows of a 128-token model).
* ``rerank``          — Rerank: each XQuAD dev question against the sentences of its paragraph, on a
  cross-encoder (a one-label classification model, or one with an entailment label).
* ``mix``             — a weighted mix of the above over the models the server lists (default weights:
  classify 0.6, qa 0.3, translate 0.1).

Texts and provenance: ``loadtest/data/PROVENANCE.md``. ``--data FILE.jsonl`` replaces the committed texts
with the user's own requests (:func:`load_requests`).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from relserve.service._proto import inference_pb2 as pb

DATA_DIR = Path(__file__).resolve().parent / "data"
SCENARIOS = ("classify", "classify-mixed", "classify-pair", "qa", "translate", "zero-shot", "classify-tokens",
             "rerank", "mix")
KIND_OF_SCENARIO = {"classify": "classify", "classify-mixed": "classify", "classify-pair": "classify", "qa": "qa",
                    "translate": "translate", "zero-shot": "zero-shot", "classify-tokens": "tokens",
                    "rerank": "rerank"}
# --data FILE.jsonl: the fields of one request per scenario (required, optional); other fields are ignored.
DATA_FIELDS = {
    "classify": (("text",), ("text_pair",)),
    "classify-pair": (("text", "text_pair"), ()),
    "qa": (("question", "context"), ()),
    "translate": (("text",), ()),
}
TASK_OF_KIND = {"classify": "classification", "qa": "question-answering", "translate": "translation",
                "zero-shot": "classification", "tokens": "token-classification", "rerank": "classification"}
METHOD_OF_KIND = {"classify": "Classify", "qa": "Answer", "translate": "Translate", "zero-shot": "ZeroShotClassify",
                  "tokens": "ClassifyTokens", "rerank": "Rerank"}
ZERO_SHOT_LABELS = ("positive", "negative", "film", "music", "politics")
DEFAULT_MIX = {"classify": 0.6, "qa": 0.3, "translate": 0.1}


class ScenarioUnavailable(Exception):
    """The server does not list a model the scenario needs (e.g. no translation model)."""


class ModelNotServed(LookupError):
    """A model named on the command line is not served (or serves another task); the message lists what is."""


class DataFileError(ValueError):
    """A ``--data`` file that cannot be used; the message names the file and line."""


def _jsonl(name: str) -> list[dict]:
    with open(DATA_DIR / name, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def sentences() -> list[str]:
    return [r["text"] for r in _jsonl("sentiment_dev.jsonl")]


def qa_pairs() -> list[tuple[str, str]]:
    return [(r["question"], r["context"]) for r in _jsonl("qa_dev.jsonl")]


def german_sources() -> list[str]:
    return [r["source"] for r in _jsonl("de_en_dev.jsonl")]


# A sentence ends at . ! or ? followed by whitespace and an upper-case letter, digit or opening quote/bracket;
# good enough for the encyclopaedic XQuAD paragraphs (a rare split after an abbreviation only changes lengths).
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(\[\u201c])")


def question_sentence_pairs() -> list[tuple[str, str]]:
    """QNLI-style pairs (Wang et al. 2019, GLUE: a SQuAD question and one sentence of its paragraph), built
    from the committed XQuAD dev rows: every question with every sentence of its context, in file order
    (553 pairs of 7 to 83 words together)."""
    out = []
    for q, c in qa_pairs():
        out.extend((q, sent) for sent in _SENTENCE_END.split(c.strip()) if sent.strip())
    return out


def load_requests(path: str | Path, scenario: str) -> list[dict[str, str]]:
    """Read ``--data FILE.jsonl``: one JSON object per line with the request fields of ``scenario``
    (:data:`DATA_FIELDS`: classify ``text`` and optional ``text_pair``; classify-pair ``text`` and
    ``text_pair``; qa ``question`` and ``context``; translate ``text``). Blank lines are skipped and other
    fields (``id``, ``label``, ...) ignored, so the shared data files can be given as they are.

    Returns:
        one ``{field: text}`` per line, in file order.

    Raises:
        DataFileError: a scenario that takes no data file (mix, classify-mixed), an unreadable file, a line
            that is not a JSON object, a missing, non-string or blank field (file and line number in the
            message), ``text_pair`` on some classify lines but not others, or no requests at all.
    """
    if scenario not in DATA_FIELDS:
        raise DataFileError(f"--data works with --scenario {', '.join(DATA_FIELDS)}, not {scenario}")
    required, optional = DATA_FIELDS[scenario]
    try:
        f = open(path, encoding="utf-8")
    except OSError as exc:
        raise DataFileError(f"--data {path}: {exc.strerror or exc}") from None
    rows: list[dict[str, str]] = []
    first_pair: tuple[int, bool] | None = None  # (line, has text_pair) of the first row
    with f:
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"--data {path}:{lineno}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataFileError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
                if not isinstance(obj, dict):
                    raise DataFileError(f"{where}: a JSON object is wanted, got {type(obj).__name__}")
                row = {}
                for name in required + optional:
                    if name not in obj:
                        if name in required:
                            raise DataFileError(f"{where}: field {name!r} is missing (scenario {scenario} needs "
                                                f"{', '.join(required)})")
                        continue
                    v = obj[name]
                    if not isinstance(v, str) or not v.strip():
                        raise DataFileError(f"{where}: field {name!r} must be a non-blank string")
                    row[name] = v
                if optional:
                    has = "text_pair" in row
                    if first_pair is None:
                        first_pair = (lineno, has)
                    elif has != first_pair[1]:
                        raise DataFileError(
                            f"{where}: {'has' if has else 'has no'} text_pair but line {first_pair[0]} "
                            f"{'has' if first_pair[1] else 'has none'}; give text_pair on every line or on none "
                            "(one Classify request carries pairs for all its texts or for none)")
                rows.append(row)
        except UnicodeDecodeError as exc:
            raise DataFileError(f"--data {path}: not UTF-8 ({exc.reason} at byte {exc.start} of a line)") from None
    if not rows:
        raise DataFileError(f"--data {path}: no requests (the file is empty)")
    return rows


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


def _pool(kind: str, model: str, *, batch: int, scenario: str, beam_size: int, seed: int,
          data: Sequence[dict[str, str]] | None = None) -> list[Call]:
    method = METHOD_OF_KIND[kind]
    batch = max(1, batch)
    if kind == "classify":
        pairs: list[str] | None = None
        if data is not None:
            texts = [r["text"] for r in data]
            pairs = [r["text_pair"] for r in data] if "text_pair" in data[0] else None
        elif scenario == "classify-pair":
            qs = question_sentence_pairs()
            texts, pairs = [q for q, _ in qs], [s for _, s in qs]
        else:
            texts = mixed_length_texts(300, seed) if scenario == "classify-mixed" else sentences()
        calls = []
        for i in range(0, len(texts) - batch + 1, batch):
            req = pb.ClassifyRequest(model=model, texts=texts[i:i + batch],
                                     text_pairs=pairs[i:i + batch] if pairs else ())
            calls.append(Call(kind, method, req))
        return calls
    if kind == "qa":
        qas = [(r["question"], r["context"]) for r in data] if data is not None else qa_pairs()
        return [Call(kind, method, pb.AnswerRequest(model=model, question=q, context=c)) for q, c in qas]
    if kind == "zero-shot":
        texts = sentences()
        return [Call(kind, method, pb.ZeroShotClassifyRequest(model=model, texts=texts[i:i + batch],
                                                              candidate_labels=ZERO_SHOT_LABELS))
                for i in range(0, len(texts) - batch + 1, batch)]
    if kind == "tokens":
        contexts = list(dict.fromkeys(c for _, c in qa_pairs()))
        return [Call(kind, method, pb.ClassifyTokensRequest(model=model, texts=[c], aggregation_strategy="simple"))
                for c in contexts]
    if kind == "rerank":
        by_question: dict[str, list[str]] = {}
        for q, sentence in question_sentence_pairs():
            by_question.setdefault(q, []).append(sentence)
        return [Call(kind, method, pb.RerankRequest(model=model, query=q, texts=texts))
                for q, texts in by_question.items()]
    if kind == "translate":
        srcs = [r["text"] for r in data] if data is not None else german_sources()
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
        data: the user's requests (:func:`load_requests` for this scenario) instead of the committed texts.

    Raises:
        ScenarioUnavailable: no model for the kind(s) the scenario needs.
        DataFileError: ``data`` has fewer rows than ``batch``.
    """

    def __init__(self, name: str, models: dict[str, str], *, weights: dict[str, float] | None = None,
                 batch: int = 1, beam_size: int = 0, seed: int = 0,
                 data: Sequence[dict[str, str]] | None = None) -> None:
        if name not in SCENARIOS:
            raise ValueError(f"unknown scenario {name!r}; choose one of {list(SCENARIOS)}")
        self.name = name
        if name == "mix":
            wanted = dict(weights or DEFAULT_MIX)
            kinds = [k for k, w in wanted.items() if w > 0 and k in models]
            if not kinds:
                raise ScenarioUnavailable(f"scenario mix: the server lists no model for any of {sorted(wanted)}")
        else:
            kind = KIND_OF_SCENARIO[name]
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
            k: _pool(k, models[k], batch=batch, scenario=name, beam_size=beam_size, seed=seed, data=data)
            for k in kinds
        }
        if data is not None and not all(self._pools.values()):
            raise DataFileError(f"--data has {len(data)} requests, fewer than --batch {batch}")

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
    """Pick one served model per kind from ListModels (first listed of each task), honouring overrides.

    Raises:
        ModelNotServed: an override names a model the server does not list, or one of another task; the
            message lists the served models and their tasks.
    """
    out: dict[str, str] = {}
    task_of = {m.name: m.task for m in model_infos}
    served = ", ".join(f"{m.name} ({m.task})" for m in model_infos) or "none"
    for kind, task in TASK_OF_KIND.items():
        chosen = (overrides or {}).get(kind)
        if chosen:
            if chosen not in task_of:
                raise ModelNotServed(f"--{kind}-model {chosen!r}: the server does not serve it; it serves: {served}")
            if task_of[chosen] != task:
                raise ModelNotServed(f"--{kind}-model {chosen!r} is a {task_of[chosen]} model, not {task}; "
                                     f"the server serves: {served}")
            out[kind] = chosen
            continue
        for m in model_infos:
            if m.task == task and _fits(kind, m):
                out[kind] = m.name
                break
    if "translate" in out and not hasattr(pb, "TranslateRequest"):
        del out["translate"]
    return out


def _fits(kind: str, info: Any) -> bool:
    """Whether a served model (ListModels' ``ModelInfo``) can be the default for ``kind``: zero-shot needs an
    entailment label; rerank a one-label cross-encoder or an entailment label; other kinds any model of their
    task."""
    entailment = any(str(label).lower().startswith("entail") for label in info.labels)
    if kind == "zero-shot":
        return entailment
    if kind == "rerank":
        return len(info.labels) == 1 or entailment
    return True
