"""Training pieces shared by the encoder trainers (``training.classifier``, ``training.qa``).

Seeding and RNG state, JSON Lines, length-bucketed batches with dynamic padding, AdamW with a linear
warm-up/decay schedule, the resumable training state (one file, written atomically) and the epoch loop:
bucketed batches, tqdm, a state save every ``--save-every`` steps and after each epoch, ``--max-steps`` /
``--max-minutes`` stops that ``--resume`` continues, dev evaluation after each epoch and the best epoch
written as a checkpoint.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from ..checkpoint import read_config, save_checkpoint, write_config


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
    m = copy.deepcopy(model).to("cpu")
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[save_dtype]
    m = m.to(dtype).eval()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_checkpoint(m, config, out_dir=str(out_dir), tokenizer_dir=str(tokenizer_dir) if tokenizer_dir else None)
    cfg = read_config(out_dir)[1]
    cfg["dtype"] = save_dtype
    cfg.pop("torch_dtype", None)
    cfg.update(extra_config or {})
    write_config(cfg, out_dir, ensure_ascii=False)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------------------------------------
# The resumable epoch loop
# ----------------------------------------------------------------------------------------------------------------

COUNTERS = ("step", "epoch", "batch_in_epoch", "best", "best_epoch", "history", "train_seconds", "run_loss", "run_n")


def initial_state(args: dict[str, Any]) -> dict[str, Any]:
    """A fresh run's counters (``args`` is what ``--resume`` compares against)."""
    return {
        "args": args, "step": 0, "epoch": 0, "batch_in_epoch": 0, "best": -1.0, "best_epoch": -1,
        "history": [], "train_seconds": 0.0, "run_loss": 0.0, "run_n": 0,
    }  # fmt: skip


class Run:
    """One training run's moving parts: the state counters and what ``--resume`` restores with them."""

    def __init__(self, store: StateStore, state: dict[str, Any], model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, scheduler: Any):
        self.store, self.state, self.model = store, state, model
        self.optimizer, self.scheduler = optimizer, scheduler

    def resume(self, keys: Iterable[str]) -> None:
        """Restore weights, optimizer, scheduler, RNG and counters from the store (arguments ``keys`` must match)."""
        if not self.store.exists():
            raise SystemExit(f"--resume: no state at {self.store.path}")
        saved = self.store.load()
        check_resume_args(saved["args"], self.state["args"], keys)
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        set_rng_state(saved["rng"])
        for k in COUNTERS:
            self.state[k] = saved[k]
        s = self.state
        print(f"resumed at epoch {s['epoch']} batch {s['batch_in_epoch']} step {s['step']}", file=sys.stderr)

    def save(self) -> None:
        """Write counters, weights, optimizer, scheduler and RNG states to the store."""
        self.store.save(
            {**self.state, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
             "scheduler": self.scheduler.state_dict(), "rng": rng_state()}
        )  # fmt: skip

    def _record_eval(self, evaluate: Callable[[], tuple[float, dict[str, Any]]], save_best: Callable[[float], None],
                     epoch: float, train_loss: float) -> None:
        """Score the model, append the history record and save it when it is the best so far; ``epoch`` is
        fractional for an evaluation inside an epoch (``args.eval_every``), and ``best_epoch`` records it."""
        state = self.state
        score, metrics = evaluate()
        rec = {"epoch": epoch, "step": state["step"], "train_loss": train_loss, **metrics,
               "seconds": round(state["train_seconds"], 1)}  # fmt: skip
        state["history"].append(rec)
        print(json.dumps(rec), file=sys.stderr)
        if score > state["best"]:
            state["best"], state["best_epoch"] = score, epoch
            save_best(score)

    def train(
        self,
        args: argparse.Namespace,
        lengths: Sequence[int],
        batch_loss: Callable[[list[int]], torch.Tensor],
        evaluate: Callable[[], tuple[float, dict[str, Any]]],
        save_best: Callable[[float], None],
        bucket_batches: int = 50,
    ) -> bool:
        """Train epochs ``state["epoch"]`` .. ``args.epochs - 1``; True when all epochs are done.

        ``batch_loss(indices)`` is the mean loss of one batch of examples; ``evaluate()`` gives the dev score
        (higher is better) and the metrics for the epoch's history record; ``save_best(score)`` writes the
        checkpoint of a new best epoch. Uses ``args.epochs``, ``batch_size``, ``seed``, ``clip``,
        ``save_every``, ``max_steps`` and ``max_minutes``.
        """
        state, model, optimizer, scheduler = self.state, self.model, self.optimizer, self.scheduler
        t_start = time.monotonic() - state["train_seconds"]
        t_run = time.monotonic()
        stop = False
        while state["epoch"] < args.epochs and not stop:
            epoch = state["epoch"]
            batches = bucketed_batches(lengths, args.batch_size, seed=args.seed * 1000 + epoch,
                                       bucket_batches=bucket_batches)
            model.train()
            bar = tqdm(total=len(batches), initial=state["batch_in_epoch"], desc=f"epoch {epoch + 1}/{args.epochs}")
            run_loss, run_n = (state["run_loss"], state["run_n"]) if state["batch_in_epoch"] else (0.0, 0)
            for b in range(state["batch_in_epoch"], len(batches)):
                batch = batches[b]
                # bf16 autocast only where the CPU has bf16 units: on AVX2-only CPUs it is emulated and slower
                # (loadtest/bench/train_autocast.py measures it)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=getattr(args, "autocast", "off") == "bf16"):
                    loss = batch_loss(batch)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], args.clip)
                optimizer.step()
                scheduler.step()
                state["step"] += 1
                state["batch_in_epoch"] = b + 1
                run_loss += loss.item() * len(batch)
                run_n += len(batch)
                state["run_loss"], state["run_n"] = run_loss, run_n
                bar.update(1)
                bar.set_postfix(loss=f"{run_loss / run_n:.4f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")
                if getattr(args, "eval_every", 0) and state["step"] % args.eval_every == 0 and b + 1 < len(batches):
                    state["train_seconds"] = time.monotonic() - t_start
                    self._record_eval(evaluate, save_best, round(epoch + (b + 1) / len(batches), 3),
                                      run_loss / run_n)
                    model.train()
                    self.save()
                elif state["step"] % args.save_every == 0:
                    state["train_seconds"] = time.monotonic() - t_start
                    self.save()
                if args.max_steps and state["step"] >= args.max_steps:
                    stop = True
                    break
                if args.max_minutes and time.monotonic() - t_run > 60 * args.max_minutes:
                    print(f"--max-minutes {args.max_minutes} reached; state saved, continue with --resume",
                          file=sys.stderr)
                    stop = True
                    break
            bar.close()
            if stop and state["batch_in_epoch"] < len(batches):
                state["train_seconds"] = time.monotonic() - t_start
                self.save()
                break
            state["train_seconds"] = time.monotonic() - t_start
            self._record_eval(evaluate, save_best, epoch + 1, run_loss / max(1, run_n))
            state["epoch"] = epoch + 1
            state["batch_in_epoch"] = 0
            self.save()
        if state["epoch"] < args.epochs:
            print(f"stopped in epoch {state['epoch'] + 1} after batch {state['batch_in_epoch']}; "
                  f"state in {self.store.dir}", file=sys.stderr)
            return False
        return True
