"""Train the built-in default sentiment classifier: a small DeBERTa-v3-style encoder, from scratch.

    python -m relserve.models.train_classifier \\
        --data /work/shared/data/sentiment --tokenizer runs/tokenizer-en-8k --out defaults/sentiment

Reads ``<data>/train.jsonl`` and ``<data>/dev.jsonl`` (JSON Lines with ``text`` and ``label``), tokenizes with
the project's own tokenizer (``relserve.models.tokenization.load_tokenizer``, the same code the server uses),
trains ``relserve.models.deberta.DebertaForSequenceClassification`` with AdamW and a linear warm-up/decay
schedule on length-bucketed, dynamically padded batches, evaluates dev accuracy after every epoch and writes the
best epoch with ``relserve.models.checkpoint.save_checkpoint`` as a Hugging Face checkpoint directory
(``config.json`` + ``model.safetensors`` + tokenizer files) that both our loader and
``transformers.AutoModelForSequenceClassification`` load.

Training is seeded (``random``, ``numpy``, ``torch``) and resumable: optimizer, scheduler, step counters, RNG
states and the current weights go to ``--state-dir`` (default ``runs/state/<name of --out>``, git-ignored,
never inside ``defaults/``) every ``--save-every`` steps and after each epoch; ``--resume`` continues from there.

The generic pieces (seeding, bucketing, padding, schedule, state store, epoch loop helpers) are reused by
``relserve.models.train_qa``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

# ----------------------------------------------------------------------------------------------------------------
# Generic training helpers (shared with train_qa)
# ----------------------------------------------------------------------------------------------------------------


def set_seed(seed: int) -> None:
    """Seed every RNG the training touches."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def bucketed_batches(
    lengths: Sequence[int], batch_size: int, seed: int, bucket_batches: int = 50
) -> list[list[int]]:
    """Length-bucketed batches for one epoch, deterministic in ``seed``.

    Shuffle all indices, cut them into buckets of ``batch_size * bucket_batches`` examples, sort each bucket by
    length (so a batch holds similar lengths and pads little), cut into batches and shuffle the batch order.
    """
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(lengths))
    size = batch_size * bucket_batches
    batches: list[list[int]] = []
    for start in range(0, len(order), size):
        bucket = sorted(order[start : start + size].tolist(), key=lambda i: lengths[i])
        batches.extend(bucket[i : i + batch_size] for i in range(0, len(bucket), batch_size))
    perm = rng.permutation(len(batches))
    return [batches[i] for i in perm]


def sorted_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Batches for evaluation: sorted by length, no shuffling."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def pad_batch(
    seqs: Sequence[Sequence[int]], pad_id: int, type_ids: Sequence[Sequence[int]] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Right-pad to the longest sequence of the batch (dynamic padding)."""
    longest = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), longest), dtype=torch.long)
    tt = torch.zeros((len(seqs), longest), dtype=torch.long) if type_ids is not None else None
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
        if tt is not None:
            tt[i, : len(s)] = torch.tensor(type_ids[i], dtype=torch.long)
    return ids, mask, tt


def linear_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int):
    """Linear warm-up from 0 to the peak LR over ``warmup_steps``, then linear decay to 0 at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(1, warmup_steps)
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW; no weight decay on biases, LayerNorm weights and embeddings tables' norms."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "LayerNorm" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98), eps=1e-6)


class StateStore:
    """Training state (weights, optimizer, scheduler, counters, RNG) in one file, written atomically."""

    def __init__(self, state_dir: str | os.PathLike):
        self.dir = Path(state_dir)
        self.path = self.dir / "state.pt"

    def exists(self) -> bool:
        return self.path.is_file()

    def save(self, state: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.path)

    def load(self) -> dict[str, Any]:
        return torch.load(self.path, map_location="cpu", weights_only=False)

    def write_json(self, name: str, obj: Any) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def default_state_dir(out: str | os.PathLike) -> Path:
    """``runs/state/<name of out>`` under the working directory (``/runs/`` is git-ignored).

    Never inside ``defaults/``: training state must not be committed or count towards the size limit.
    """
    return Path("runs") / "state" / Path(out).resolve().name


def check_resume_args(saved: dict[str, Any], current: dict[str, Any], keys: Iterable[str]) -> None:
    diff = {k: (saved.get(k), current.get(k)) for k in keys if saved.get(k) != current.get(k)}
    if diff:
        raise SystemExit(f"--resume: arguments differ from the saved run: {diff}")


def save_model_dir(
    model: torch.nn.Module,
    config: Any,
    out_dir: str | os.PathLike,
    tokenizer_dir: str | os.PathLike | None,
    save_dtype: str,
    extra_config: dict[str, Any] | None = None,
) -> None:
    """Write an HF checkpoint directory via ``save_checkpoint``; weights cast to ``save_dtype``.

    ``config.json`` gets ``dtype`` (and the legacy ``torch_dtype``) so transformers' ``dtype="auto"`` loads the
    stored precision; our loader ignores the key and casts to what the caller asks for.
    """
    from relserve.models.checkpoint import save_checkpoint

    m = copy.deepcopy(model).to("cpu")
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[save_dtype]
    m = m.to(dtype).eval()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_checkpoint(m, config, out_dir=str(out_dir), tokenizer_dir=str(tokenizer_dir) if tokenizer_dir else None)
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["dtype"] = save_dtype
    cfg.pop("torch_dtype", None)
    cfg.update(extra_config or {})
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------------------------------------
# Sentiment classifier
# ----------------------------------------------------------------------------------------------------------------

LABELS = ["negative", "positive"]


def build_config(args: argparse.Namespace, vocab_size: int, pad_id: int):
    from relserve.models.config import DebertaConfig

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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data", required=True, help="directory with train.jsonl and dev.jsonl")
    ap.add_argument("--tokenizer", required=True, help="tokenizer directory (tokenizer.json + tokenizer_config.json)")
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
    ap.add_argument("--save-dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limit-train", type=int, default=0, help="use only the first N training rows (smoke tests)")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after N optimizer steps (smoke tests)")
    ap.add_argument("--max-minutes", type=float, default=0, help="stop (resumable) after N minutes of training")
    return ap.parse_args(argv)


RESUME_KEYS = (
    "data", "tokenizer", "seed", "hidden", "layers", "heads", "intermediate", "position_buckets", "dropout",
    "max_len", "epochs", "batch_size", "lr", "weight_decay", "warmup", "limit_train",
)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from relserve.models.deberta import DebertaForSequenceClassification
    from relserve.models.tokenization import load_tokenizer

    store = StateStore(args.state_dir or default_state_dir(args.out))
    tok = load_tokenizer(args.tokenizer)
    pad_id = tok.pad_token_id
    vocab_size = tokenizer_vocab_size(args.tokenizer, tok)

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
    config = build_config(args, vocab_size, pad_id)
    model = DebertaForSequenceClassification(config)
    print(f"parameters: {count_parameters(model):,}", file=sys.stderr)
    steps_per_epoch = math.ceil(len(train_ids) / args.batch_size)
    total_steps = steps_per_epoch * args.epochs
    optimizer = make_optimizer(model, args.lr, args.weight_decay)
    scheduler = linear_schedule(optimizer, int(args.warmup * total_steps), total_steps)

    state: dict[str, Any] = {
        "args": vars(args), "step": 0, "epoch": 0, "batch_in_epoch": 0, "best": -1.0, "best_epoch": -1,
        "history": [], "train_seconds": 0.0, "run_loss": 0.0, "run_n": 0,
    }  # fmt: skip
    if args.resume:
        if not store.exists():
            raise SystemExit(f"--resume: no state at {store.path}")
        saved = store.load()
        check_resume_args(saved["args"], vars(args), RESUME_KEYS)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        set_rng_state(saved["rng"])
        for k in ("step", "epoch", "batch_in_epoch", "best", "best_epoch", "history", "train_seconds", "run_loss", "run_n"):
            state[k] = saved[k]
        print(f"resumed at epoch {state['epoch']} batch {state['batch_in_epoch']} step {state['step']}", file=sys.stderr)

    def checkpoint_state() -> None:
        store.save(
            {
                **state,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "rng": rng_state(),
            }
        )

    loss_fn = torch.nn.CrossEntropyLoss()
    t_start = time.monotonic() - state["train_seconds"]
    t_run = time.monotonic()
    stop = False
    while state["epoch"] < args.epochs and not stop:
        epoch = state["epoch"]
        batches = bucketed_batches(lengths, args.batch_size, seed=args.seed * 1000 + epoch)
        model.train()
        bar = tqdm(total=len(batches), initial=state["batch_in_epoch"], desc=f"epoch {epoch + 1}/{args.epochs}")
        run_loss, run_n = (state["run_loss"], state["run_n"]) if state["batch_in_epoch"] else (0.0, 0)
        for b in range(state["batch_in_epoch"], len(batches)):
            batch = batches[b]
            ids, mask, _ = pad_batch([train_ids[i] for i in batch], pad_id)
            y = torch.tensor([train_y[i] for i in batch])
            logits = model(input_ids=ids, attention_mask=mask)
            logits = logits if isinstance(logits, torch.Tensor) else logits[0]
            loss = loss_fn(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            scheduler.step()
            state["step"] += 1
            state["batch_in_epoch"] = b + 1
            run_loss += loss.item() * len(batch)
            run_n += len(batch)
            state["run_loss"], state["run_n"] = run_loss, run_n
            bar.update(1)
            bar.set_postfix(loss=f"{run_loss / run_n:.4f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")
            if state["step"] % args.save_every == 0:
                state["train_seconds"] = time.monotonic() - t_start
                checkpoint_state()
            if args.max_steps and state["step"] >= args.max_steps:
                stop = True
                break
            if args.max_minutes and time.monotonic() - t_run > 60 * args.max_minutes:
                print(f"--max-minutes {args.max_minutes} reached; state saved, continue with --resume", file=sys.stderr)
                stop = True
                break
        bar.close()
        if stop and state["batch_in_epoch"] < len(batches):
            state["train_seconds"] = time.monotonic() - t_start
            checkpoint_state()
            break
        acc = accuracy(model, dev_ids, dev_y, pad_id)
        state["train_seconds"] = time.monotonic() - t_start
        rec = {"epoch": epoch + 1, "step": state["step"], "train_loss": run_loss / max(1, run_n), "dev_accuracy": acc,
               "seconds": round(state["train_seconds"], 1)}  # fmt: skip
        state["history"].append(rec)
        print(json.dumps(rec), file=sys.stderr)
        if acc > state["best"]:
            state["best"], state["best_epoch"] = acc, epoch + 1
            save_model_dir(model, config, args.out, args.tokenizer, args.save_dtype)
            print(f"new best dev accuracy {acc:.4f}; wrote {args.out}", file=sys.stderr)
        state["epoch"] = epoch + 1
        state["batch_in_epoch"] = 0
        checkpoint_state()

    # Re-evaluate what was written (weights rounded to --save-dtype), through our own loader.
    if state["epoch"] < args.epochs:
        print(f"stopped in epoch {state['epoch'] + 1} after batch {state['batch_in_epoch']}; state in {store.dir}", file=sys.stderr)
        return 3
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
