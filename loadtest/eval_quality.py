"""Dev-set quality of served models, measured through a real relserve server (gRPC, ``relserve.client``).

    python -m relserve.loadtest.eval_quality --data ../shared/data                  # the built-in defaults
    python -m relserve.loadtest.eval_quality --data ../shared/data --models qa --limit 200
    python -m relserve.loadtest.eval_quality --data ../shared/data --target 127.0.0.1:50051
    python -m relserve.loadtest.eval_quality --data ../shared/data --model qa=runs/qa6 --json qa.json

Without ``--target`` it starts ``relserve serve`` on free loopback ports (``--model NAME=DIR[,key=value]`` as
the server takes them, default: the built-in models), sends every dev row and scores the answers:

* ``sentiment``: accuracy on ``sentiment/dev.jsonl`` (the top label against ``label``);
* ``qa``: SQuAD v1.1 exact match and F1 (official answer normalisation, max over the gold answers) on
  ``qa/xquad_en_dev.jsonl`` and ``qa/squad1_dev.jsonl``, the server's first answer as the prediction;
* ``translate-de-en`` and ``translate-de-en-deberta``: sacrebleu corpus BLEU and chrF (sacrebleu defaults,
  one reference per row, rows sharing a source count separately) on ``translation/tatoeba_de_en_dev.jsonl``
  and the Ding ``translation/de_en_dev.jsonl``, beam 5 (``--beam``), plus the count of empty outputs, and
  the translations of :data:`CARD_SENTENCES` (the samples the model cards show; also unpunctuated and
  lower-cased, with :data:`CARD_TYPED`, under ``card_samples_typed``). Each set is scored in the
  variants people type (``--variants``, :func:`relserve.models.training.translation.dev_variant`): ``written``
  (as is: the set's top-level ``bleu``/``chrf``), ``nopunct`` (final ``.``/``!``/``?`` removed from source,
  reference and output) and ``lower`` (removed, source lower-cased), side by side under ``variants`` with
  each one's BLEU as a fraction of ``written`` under ``bleu_ratio``. ``--variant-refs written`` instead
  changes only the sources and scores the outputs as they are against the written references (stricter: an
  output without final punctuation loses against a punctuated reference).

Quick runs: ``--limit N`` (the first N rows), ``--subset N`` (N rows spread evenly over each file: a fixed
sample that is not the first rows the training runs picked checkpoints on), ``--sets tatoeba_dev`` and
``--variants written,nopunct``.

A model is evaluated by its task (ListModels), so a served name other than the defaults works with
``--task NAME=classification|qa|translation``. sacrebleu comes with the train extra
(``pip install 'relserve[train]'``). Prints one JSON object (and writes it with ``--json``).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relserve.models.squad_metrics import exact_match, f1_score

# Everyday sentences for the translation model cards (written for this project, not taken from a corpus).
CARD_SENTENCES = [
    "Guten Morgen.",
    "Wo ist der Bahnhof?",
    "Das Haus ist sehr groß.",
    "Ich habe Hunger.",
    "Kannst du mir helfen?",
    "Wie spät ist es?",
    "Ich wohne seit drei Jahren in Berlin.",
    "Morgen regnet es wahrscheinlich.",
    "Er hat das Buch nicht gelesen.",
    "Vielen Dank für deine Hilfe!",
]

# As a new user types into a demo box (besides the card sentences unpunctuated and lower-cased).
CARD_TYPED = ["Guten Morgen", "Danke", "danke schön", "Hallo", "Katze", "wo ist das hotel"]

DEFAULT_TASKS = {"sentiment": "classification", "qa": "qa", "translate-de-en": "translation",
                 "translate-de-en-deberta": "translation"}


def read_jsonl(path: Path, limit: int = 0, subset: int = 0) -> list[dict[str, Any]]:
    """The rows of a JSON Lines file: the first ``limit`` (0: all), then, with ``subset``, that many rows
    spread evenly over them (row ``i * len // subset`` for ``i < subset``: fixed, no randomness)."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = rows[:limit] if limit else rows
    if subset and subset < len(rows):
        rows = [rows[i * len(rows) // subset] for i in range(subset)]
    return rows


def squad_scores(preds: Sequence[str], rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """EM and F1 in percent over ``rows`` (each with ``answers[].text``)."""
    em = f1 = 0.0
    for pred, r in zip(preds, rows):
        golds = [a["text"] for a in r["answers"]] or [""]
        em += max(exact_match(pred, g) for g in golds)
        f1 += max(f1_score(pred, g) for g in golds)
    n = max(1, len(rows))
    return {"exact_match": round(100 * em / n, 2), "f1": round(100 * f1 / n, 2), "n": len(rows)}


def _pool_map(fn, items: Sequence[Any], concurrency: int) -> list[Any]:
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(fn, items))


def _chunks(items: Sequence[Any], n: int) -> list[Sequence[Any]]:
    return [items[i: i + n] for i in range(0, len(items), n)]


def eval_classification(client, model: str, data: Path, limit: int, concurrency: int) -> dict[str, Any]:
    rows = read_jsonl(data / "sentiment/dev.jsonl", limit)
    chunks = _chunks(rows, 16)

    def run(chunk):
        resp = client.classify(model, [r["text"] for r in chunk], top_k=1, timeout=120)
        return [res.labels[0].label for res in resp.results]

    t0 = time.monotonic()
    labels = [lab for part in _pool_map(run, chunks, concurrency) for lab in part]
    correct = sum(lab == r["label"] for lab, r in zip(labels, rows))
    by_domain: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for lab, r in zip(labels, rows):
        counts = by_domain[r.get("domain", "all")]
        counts[0] += lab == r["label"]
        counts[1] += 1
    return {"sentiment_dev": {
        "accuracy": round(correct / len(rows), 4), "correct": correct, "n": len(rows),
        "by_domain": {d: {"accuracy": round(c / n, 4), "n": n} for d, (c, n) in sorted(by_domain.items())},
        "seconds": round(time.monotonic() - t0, 1),
    }}  # fmt: skip


def eval_qa(client, model: str, data: Path, limit: int, concurrency: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, rel in (("xquad_en_dev", "qa/xquad_en_dev.jsonl"), ("squad1_dev", "qa/squad1_dev.jsonl")):
        rows = read_jsonl(data / rel, limit)

        def run(r):
            return client.answer(model, r["question"], r["context"], timeout=300).answers[0].text

        t0 = time.monotonic()
        preds = _pool_map(run, rows, concurrency)
        out[name] = {**squad_scores(preds, rows), "seconds": round(time.monotonic() - t0, 1)}
    return out


TRANSLATION_SETS = {"tatoeba_dev": "translation/tatoeba_de_en_dev.jsonl", "ding_dev": "translation/de_en_dev.jsonl"}


def eval_translation(client, model: str, data: Path, limit: int, concurrency: int, beam: int,
                     subset: int = 0, sets: Sequence[str] = tuple(TRANSLATION_SETS),
                     variants: Sequence[str] = ("written", "nopunct", "lower"),
                     variant_refs: str = "typed") -> dict[str, Any]:
    """BLEU/chrF of ``model`` on each of ``sets`` in each of ``variants`` (see the module docstring)."""
    import sacrebleu

    from relserve.models.training.translation import dev_variant, strip_final_punct

    def translate_all(sources: Sequence[str]) -> list[str]:
        def run(chunk):
            resp = client.translate(model, list(chunk), beam_size=beam, timeout=600)
            return [res.hypotheses[0].text for res in resp.results]

        return [h for part in _pool_map(run, _chunks(sources, 8), concurrency) for h in part]

    out: dict[str, Any] = {}
    for name in sets:
        rows = read_jsonl(data / TRANSLATION_SETS[name], limit, subset)
        pairs = [(r["source"], r["target"]) for r in rows]
        per: dict[str, dict[str, Any]] = {}
        for kind in variants:
            t0 = time.monotonic()
            var = dev_variant(pairs, kind)
            hyps = translate_all([s for s, _ in var])
            if variant_refs == "written":
                var = [(s, t) for (s, _), (_, t) in zip(var, pairs)]
            elif kind != "written":
                # a translation of an unpunctuated source may end with or without punctuation
                hyps = [strip_final_punct(h) for h in hyps]
            refs = [t for _, t in var]
            per[kind] = {
                "bleu": round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2),
                "chrf": round(sacrebleu.corpus_chrf(hyps, [refs]).score, 2),
                "empty_outputs": sum(1 for h in hyps if not h.strip()), "seconds": round(time.monotonic() - t0, 1),
            }  # fmt: skip
        out[name] = {**per.get("written", {}), "n": len(rows), "beam": beam, "variant_refs": variant_refs,
                     "variants": per}
        if "written" in per and per["written"]["bleu"] > 0:
            out[name]["bleu_ratio"] = {k: round(v["bleu"] / per["written"]["bleu"], 3)
                                       for k, v in per.items() if k != "written"}
    out["card_samples"] = dict(zip(CARD_SENTENCES, translate_all(CARD_SENTENCES)))
    typed = [strip_final_punct(s).lower() for s in CARD_SENTENCES] + CARD_TYPED
    out["card_samples_typed"] = dict(zip(typed, translate_all(typed)))
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m relserve.loadtest.eval_quality",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="the shared data directory (sentiment/, qa/, translation/)")
    ap.add_argument("--target", help="HOST:PORT of a running server (default: start one)")
    ap.add_argument("--model", action="append", default=[], metavar="NAME=DIR[,key=value...]",
                    help="models for the started server (repeatable; default: the built-in models)")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra flag for the started server")
    ap.add_argument("--models", help="comma-separated served names to evaluate (default: all served)")
    ap.add_argument("--task", action="append", default=[], metavar="NAME=TASK",
                    help="task of a served name: classification | qa | translation (default: from ListModels)")
    ap.add_argument("--limit", type=int, default=0, help="first N rows of each dev file (0: all)")
    ap.add_argument("--subset", type=int, default=0,
                    help="N rows spread evenly over each translation dev file (after --limit; 0: all)")
    ap.add_argument("--sets", default=",".join(TRANSLATION_SETS),
                    help=f"translation dev sets (comma-separated: {', '.join(TRANSLATION_SETS)})")
    ap.add_argument("--variant-refs", choices=("typed", "written"), default="typed",
                    help="typed: final punctuation removed from references and outputs too; written: only the "
                    "sources change")
    ap.add_argument("--variants", default="written,nopunct,lower",
                    help="translation input variants (comma-separated: written, nopunct, lower)")
    ap.add_argument("--beam", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--json", help="also write the result to this file")
    return ap.parse_args(argv)


def _task_of(info: Any) -> str:
    task = str(getattr(info, "task", "")).lower()
    for key in ("classification", "qa", "question", "translation"):
        if key in task:
            return "qa" if key == "question" else key
    return task


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sets = [x for x in args.sets.split(",") if x]
    variants = [x for x in args.variants.split(",") if x]
    bad = [x for x in sets if x not in TRANSLATION_SETS] + [x for x in variants
                                                            if x not in ("written", "nopunct", "lower")]
    if bad:
        raise SystemExit(f"unknown --sets/--variants entries: {bad}")
    from relserve.service.client import Client

    data = Path(args.data)
    server = None
    target = args.target
    if not target:
        from relserve.loadtest.serverproc import ServerProcess

        serve_args = [a for m in args.model for a in ("--model", m)] + list(args.serve_arg)
        server = ServerProcess(serve_args, start_timeout=600).start()
        target = server.target
    try:
        with Client(target, timeout=600) as client:
            served = {m.name: _task_of(m) for m in client.list_models(timeout=60).models}
            tasks = {**{n: DEFAULT_TASKS.get(n, t) for n, t in served.items()},
                     **dict(t.split("=", 1) for t in args.task)}
            names = args.models.split(",") if args.models else list(served)
            result: dict[str, Any] = {"target": target, "limit": args.limit, "subset": args.subset, "models": {}}
            for name in names:
                if name not in served:
                    raise SystemExit(f"model {name!r} is not served (served: {sorted(served)})")
                task = tasks[name]
                t0 = time.monotonic()
                if task == "classification":
                    r = eval_classification(client, name, data, args.limit, args.concurrency)
                elif task == "qa":
                    r = eval_qa(client, name, data, args.limit, args.concurrency)
                elif task == "translation":
                    r = eval_translation(client, name, data, args.limit, args.concurrency, args.beam,
                                         args.subset, sets, variants, args.variant_refs)
                else:
                    raise SystemExit(f"model {name!r}: unknown task {task!r}; pass --task {name}=...")
                r["seconds"] = round(time.monotonic() - t0, 1)
                result["models"][name] = r
                print(f"{name}: {json.dumps(r, ensure_ascii=False)}", file=sys.stderr)
                for set_name, res in r.items():
                    if isinstance(res, dict) and "variants" in res:
                        cols = "  ".join(f"{k} {v['bleu']:6.2f}" for k, v in res["variants"].items())
                        print(f"{name} {set_name} (n={res['n']}) BLEU: {cols}  ratio {res.get('bleu_ratio', {})}",
                              file=sys.stderr)
    finally:
        if server is not None:
            server.close()
    text = json.dumps(result, indent=2, ensure_ascii=False)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
