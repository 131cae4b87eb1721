"""Train an RNNsearch translation model (BiGRU or DeBERTa-style encoder + attention decoder).

    python -m relserve.models.training.translation --train de_en_train.jsonl --dev de_en_dev.jsonl \\
        --out defaults/translate-de-en --state-dir runs/tr-bigru --encoder bigru --seed 1

Data: JSON lines with ``source`` and ``target`` fields. Tokenizers: two SentencePiece unigram models trained
on the training text (``--src-vocab``/``--tgt-vocab``), or copied from ``--tokenizer-from DIR``.

Training: teacher forcing, label-smoothed cross-entropy per target token, Adam, gradient-norm clipping,
length-bucketed batches of at most ``--batch-tokens`` padded tokens (max(src, tgt) length x rows), shuffled
per epoch from ``--seed``. Every ``--eval-every`` steps: greedy BLEU/chrF (sacrebleu) on the first
``--dev-subset`` dev pairs; the best checkpoint by BLEU is written to ``--out`` (``save_translation_checkpoint``,
weights stored as ``--save-dtype``), and the learning rate is halved after ``--patience`` evaluations without
improvement. ``--state-dir`` holds ``state.pt`` (model, optimizer, step, epoch position, RNG states, history)
written at each evaluation and at the end; ``--resume`` continues from it exactly where it stopped.
``--max-steps`` / ``--max-minutes`` stop early (the state is saved, so a resumed run continues).

Input as people type it: ``--mix-nopunct``/``--mix-lower``/``--mix-short-repeat`` mix unpunctuated pairs,
lower-cased sources and extra copies of one- and two-word sources into the training pairs (:func:`mix_variants`,
fixed per pair from ``--seed``, so a resumed run sees the same pairs); ``--dev-variants written,nopunct,lower``
picks the checkpoint by the mean BLEU of those dev variants (:func:`dev_variant`). ``--init-from DIR``
continues from a checkpoint's weights and tokenizers (a fresh optimizer; step 0 is evaluated first).

BLEU/chrF need sacrebleu, from the ``train`` extra (``pip install 'relserve[train]'``); without it the command
stops at once with that install line.

``--eval-checkpoint DIR`` instead evaluates a saved checkpoint on ``--dev`` (greedy and ``--beam``) and prints
JSON with BLEU and chrF.

The teacher-forced pass is the model's own ``RNNSearch.forward`` (the recurrence stepped, the deep output and
``W_o`` once over all steps; the same maths as the serving ``decode_step``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..checkpoint import load_translation_checkpoint, save_translation_checkpoint
from ..decoding import DecodeOptions, beam_search, greedy_search
from ..deberta import DebertaConfig
from ..rnnsearch import RNNSearch, RNNSearchConfig, build_translation_model, encoder_kind
from ..tokenization import SOURCE_SPM, TARGET_SPM, TranslationTokenizer
from .tokenizer import train_sentencepiece
from . import TRAIN_EXTRA_INSTALL, require_train_extra
from .loop import count_parameters

STATE_NAME = "state.pt"


# ---------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------


def load_pairs(path: str, limit: int | None = None) -> list[tuple[str, str]]:
    pairs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "source" not in row or "target" not in row:
                raise ValueError(f"{path}:{n}: expected fields 'source' and 'target'")
            pairs.append((row["source"], row["target"]))
            if limit is not None and len(pairs) >= limit:
                break
    if not pairs:
        raise ValueError(f"{path}: no pairs")
    return pairs


def load_train_pairs(paths: Sequence[str], limit: int | None = None) -> list[tuple[str, str]]:
    """The pairs of several JSON Lines files in order, exact (source, target) duplicates dropped (the first
    kept): Tatoeba and the Ding dictionary share everyday sentences, and a pair seen twice would be weighted
    twice. ``limit`` applies per file."""
    seen: set[tuple[str, str]] = set()
    out = []
    for path in paths:
        for pair in load_pairs(path, limit):
            if pair not in seen:
                seen.add(pair)
                out.append(pair)
    return out


FINAL_PUNCT = ".!?"


def strip_final_punct(text: str) -> str:
    """``text`` without its trailing ``.``, ``!`` and ``?`` (and the spaces before them): how people type a
    sentence into a box. A text that is only punctuation is returned unchanged."""
    out = text.rstrip().rstrip(FINAL_PUNCT).rstrip()
    return out or text


def mix_variants(
    pairs: Sequence[tuple[str, str]],
    nopunct: float = 0.0,
    lower: float = 0.0,
    short_repeat: int = 0,
    short_words: int = 2,
    seed: int = 1,
) -> tuple[list[tuple[str, str]], dict[str, int]]:
    """The training pairs with the variations people type mixed in, deterministically from ``seed``.

    * ``short_repeat`` extra copies of each pair whose source has at most ``short_words`` whitespace words
      (single words and two-word phrases are rare in sentence corpora but common in a demo box);
    * then, per pair, with probability ``nopunct``: the final ``.``/``!``/``?`` removed from source and target
      (a translation of an unpunctuated source may end without punctuation);
    * independently, with probability ``lower``: the source lower-cased (the target keeps its case).

    Variants replace the written pair rather than adding to it, so an epoch keeps its length and the written
    form keeps weight ``1 - rate``. Returns (pairs, counts of each change)."""
    if not (0.0 <= nopunct <= 1.0 and 0.0 <= lower <= 1.0) or short_repeat < 0:
        raise ValueError(f"mix rates must lie in [0, 1] and short_repeat >= 0 "
                         f"(got {nopunct}, {lower}, {short_repeat})")
    rng = random.Random(seed * 7_919 + 17)
    pool = list(pairs)
    short = [p for p in pool if len(p[0].split()) <= short_words]
    pool += short * short_repeat
    out, n_np, n_lc = [], 0, 0
    for src, tgt in pool:
        if rng.random() < nopunct:
            src, tgt = strip_final_punct(src), strip_final_punct(tgt)
            n_np += 1
        if rng.random() < lower:
            src = src.lower()
            n_lc += 1
        out.append((src, tgt))
    return out, {"pairs": len(out), "short_sources": len(short), "short_copies": len(short) * short_repeat,
                 "no_final_punct": n_np, "lower_source": n_lc}


DEV_VARIANTS = ("written", "nopunct", "lower")


def dev_variant(pairs: Sequence[tuple[str, str]], kind: str) -> list[tuple[str, str]]:
    """A dev set as people type it: ``written`` (as is), ``nopunct`` (final ``.``/``!``/``?`` removed from
    source and reference) or ``lower`` (removed, and the source lower-cased; the reference keeps its case).
    Score a variant other than ``written`` with :func:`strip_final_punct` applied to the hypotheses too, so
    that a translation of an unpunctuated source may end with or without punctuation. Raises ``ValueError``
    for another ``kind``."""
    if kind == "written":
        return list(pairs)
    if kind == "nopunct":
        return [(strip_final_punct(s), strip_final_punct(t)) for s, t in pairs]
    if kind == "lower":
        return [(strip_final_punct(s).lower(), strip_final_punct(t)) for s, t in pairs]
    raise ValueError(f"unknown dev variant {kind!r} (expected one of {', '.join(DEV_VARIANTS)})")


@dataclass
class Example:
    src: list[int]  # pieces + eos
    tgt: list[int]  # pieces + eos


def encode_pairs(tok: TranslationTokenizer, pairs, max_len: int) -> list[Example]:
    return [Example(tok.encode_source(s, max_len), tok.encode_target(t, max_len)) for s, t in pairs]


def make_batches(examples: list[Example], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Indices grouped into batches of similar length: sort by (max len, random key), cut when
    rows x longest exceeds ``batch_tokens``, then shuffle the batch order."""
    keys = [(max(len(e.src), len(e.tgt)), rng.random(), i) for i, e in enumerate(examples)]
    keys.sort()
    batches, cur, longest = [], [], 0
    for length, _, i in keys:
        new_longest = max(longest, length)
        if cur and new_longest * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, new_longest = [], length
        cur.append(i)
        longest = new_longest
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(examples: list[Example], idx: list[int], pad: int, bos: int):
    rows = [examples[i] for i in idx]
    S = max(len(r.src) for r in rows)
    T = max(len(r.tgt) for r in rows)
    src = torch.full((len(rows), S), pad, dtype=torch.long)
    tgt_in = torch.full((len(rows), T), pad, dtype=torch.long)
    tgt_out = torch.full((len(rows), T), pad, dtype=torch.long)
    for b, r in enumerate(rows):
        src[b, : len(r.src)] = torch.tensor(r.src)
        tgt_out[b, : len(r.tgt)] = torch.tensor(r.tgt)
        tgt_in[b, 0] = bos
        tgt_in[b, 1 : len(r.tgt)] = torch.tensor(r.tgt[:-1])
    return src, src != pad, tgt_in, tgt_out


def pad_sources(ids: list[list[int]], pad: int) -> tuple[Tensor, Tensor]:
    S = max(len(x) for x in ids)
    src = torch.full((len(ids), S), pad, dtype=torch.long)
    for b, x in enumerate(ids):
        src[b, : len(x)] = torch.tensor(x)
    return src, src != pad


# ---------------------------------------------------------------------------------------------------------
# Model pieces
# ---------------------------------------------------------------------------------------------------------


def batch_loss(model: RNNSearch, batch, pad: int, label_smoothing: float) -> tuple[Tensor, int]:
    """Label-smoothed cross-entropy per real target token of one ``collate`` batch -> (loss, target tokens)."""
    src, src_mask, tgt_in, tgt_out = batch
    logits = model(src, src_mask, tgt_in)  # Float[B,T,K_y]
    ntok = int((tgt_out != pad).sum())
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        tgt_out.reshape(-1),
        ignore_index=pad,
        label_smoothing=label_smoothing,
        reduction="sum",
    )
    return loss / ntok, ntok


def deberta_encoder_config(args, src_vocab: int) -> DebertaConfig:
    h = args.deberta_hidden
    return DebertaConfig(
        vocab_size=src_vocab,
        hidden_size=h,
        num_hidden_layers=args.deberta_layers,
        num_attention_heads=args.deberta_heads,
        intermediate_size=args.deberta_intermediate or 4 * h,
        hidden_act="gelu",
        hidden_dropout_prob=args.dropout,
        attention_probs_dropout_prob=args.dropout,
        max_position_embeddings=512,
        relative_attention=True,
        max_relative_positions=128,
        position_buckets=32,
        pos_att_type=["c2p", "p2c"],
        share_att_key=True,
        norm_rel_ebd="layer_norm",
        position_biased_input=False,
        pad_token_id=0,
        layer_norm_eps=1e-7,
        architectures=["DebertaV2Model"],
    )


def build_model(args, tok: TranslationTokenizer) -> RNNSearch:
    common = dict(
        src_vocab_size=tok.source_vocab_size,
        tgt_vocab_size=tok.target_vocab_size,
        embedding_size=args.embedding_size,
        hidden_size=args.hidden_size,
        alignment_size=args.alignment_size or args.hidden_size,
        maxout_size=args.maxout_size,
        dropout=args.dropout,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    if args.encoder == "bigru":
        return build_translation_model(RNNSearchConfig(encoder_type="bigru", **common))
    enc = deberta_encoder_config(args, tok.source_vocab_size)
    cfg = RNNSearchConfig(encoder_type="external", annotation_size=enc.hidden_size, init_state="mean", **common)
    return build_translation_model(cfg, enc)


def model_spec(model: RNNSearch) -> dict[str, Any]:
    """What ``model_from_spec`` needs to rebuild the module (stored in state.pt)."""
    d = {"config": model.config.to_dict(), "encoder": encoder_kind(model)}
    if d["encoder"] == "deberta":
        d["encoder_config"] = model.encoder.config.to_dict()
    return d


def model_from_spec(spec: dict[str, Any]) -> RNNSearch:
    cfg = RNNSearchConfig.from_dict(spec["config"])
    enc = DebertaConfig.from_dict(spec["encoder_config"]) if spec["encoder"] == "deberta" else None
    return build_translation_model(cfg, enc)


# ---------------------------------------------------------------------------------------------------------
# Decoding and evaluation
# ---------------------------------------------------------------------------------------------------------


@torch.no_grad()
def translate(
    model: RNNSearch,
    tok: TranslationTokenizer,
    texts: Sequence[str],
    beam_size: int = 1,
    batch_size: int = 64,
    max_src_len: int = 128,
) -> list[str]:
    """Translate ``texts`` (greedy when ``beam_size`` == 1); sources are length-sorted into batches."""
    was_training = model.training
    model.eval()
    encoded = [tok.encode_source(t, max_src_len) for t in texts]
    order = sorted(range(len(texts)), key=lambda i: len(encoded[i]))
    out: list[str] = [""] * len(texts)
    opts = DecodeOptions(beam_size=beam_size, n_best=1)
    device = next(model.parameters()).device
    for lo in range(0, len(order), batch_size):
        idx = order[lo : lo + batch_size]
        src, mask = pad_sources([encoded[i] for i in idx], tok.pad_token_id)
        src, mask = src.to(device), mask.to(device)
        if beam_size == 1:
            hyps = greedy_search(model, src, mask, opts)
        else:
            hyps = [h[0] for h in beam_search(model, src, mask, opts)]
        for i, h in zip(idx, hyps):
            out[i] = tok.decode_target(h.output_tokens)
    model.train(was_training)
    return out


def score(hyps: Sequence[str], refs: Sequence[str]) -> dict[str, float]:
    import sacrebleu

    return {
        "bleu": round(sacrebleu.corpus_bleu(list(hyps), [list(refs)]).score, 2),
        "chrf": round(sacrebleu.corpus_chrf(list(hyps), [list(refs)]).score, 2),
    }


def evaluate(model, tok, pairs, beam_size: int = 1, batch_size: int = 64) -> dict[str, float]:
    hyps = translate(model, tok, [s for s, _ in pairs], beam_size=beam_size, batch_size=batch_size)
    return score(hyps, [t for _, t in pairs])


def evaluate_variants(model, tok, pairs, kinds: Sequence[str], beam_size: int = 1) -> dict[str, Any]:
    """BLEU/chrF on each :func:`dev_variant` of ``pairs`` -> ``{"bleu", "chrf"}`` (the means over ``kinds``,
    what picks the checkpoint) plus ``{kind: {"bleu", "chrf"}}`` when there is more than one kind."""
    per: dict[str, dict[str, float]] = {}
    for kind in kinds:
        var = dev_variant(pairs, kind)
        hyps = translate(model, tok, [s for s, _ in var], beam_size=beam_size)
        if kind != "written":
            hyps = [strip_final_punct(h) for h in hyps]
        per[kind] = score(hyps, [t for _, t in var])
    if len(per) == 1:
        return next(iter(per.values()))
    mean = {m: round(sum(r[m] for r in per.values()) / len(per), 2) for m in ("bleu", "chrf")}
    return {**mean, **per}


# ---------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    # the help says up front what the first evaluation needs (sacrebleu), not only the error at start
    p = argparse.ArgumentParser(prog="relserve train-translation", description=__doc__.split("\n\n")[0],
                                epilog=f"Needs the relserve[train] extra (sacrebleu, for BLEU/chrF): "
                                       f"{TRAIN_EXTRA_INSTALL}")
    p.add_argument("--train", help="training JSON lines (source/target); several files comma-separated, deduplicated")
    p.add_argument("--exclude", help="comma-separated JSON lines files: drop train pairs sharing a source or "
                   "target sentence with them (e.g. the other corpus' dev split)")
    p.add_argument("--dev", help="dev JSON lines (source/target)")
    p.add_argument("--out", help="checkpoint directory for the best model (by dev BLEU)")
    p.add_argument("--state-dir", help="training state (state.pt, tokenizers); default <out>.state")
    p.add_argument("--resume", action="store_true", help="continue from <state-dir>/state.pt")
    p.add_argument("--encoder", choices=("bigru", "deberta"), default="bigru")
    p.add_argument("--tokenizer-from", help="directory with source.spm/target.spm to reuse")
    p.add_argument("--init-from", help="checkpoint directory to continue training from (its weights and its "
                   "tokenizers; the architecture flags are ignored)")
    p.add_argument("--mix-nopunct", type=float, default=0.0,
                   help="rate of pairs with the final . ! ? removed from source and target")
    p.add_argument("--mix-lower", type=float, default=0.0, help="rate of pairs with the source lower-cased")
    p.add_argument("--mix-short-repeat", type=int, default=0,
                   help="extra copies of each pair whose source has at most --short-words words")
    p.add_argument("--short-words", type=int, default=2)
    p.add_argument("--dev-variants", default="written",
                   help="comma-separated dev variants (written,nopunct,lower) whose mean BLEU picks the checkpoint")
    p.add_argument("--src-vocab", type=int, default=6000)
    p.add_argument("--tgt-vocab", type=int, default=6000)
    p.add_argument("--embedding-size", type=int, default=256)
    p.add_argument("--hidden-size", type=int, default=256, help="GRU size n (encoder per direction, decoder)")
    p.add_argument("--alignment-size", type=int, default=None, help="n' (default: hidden size)")
    p.add_argument("--maxout-size", type=int, default=256)
    p.add_argument("--deberta-hidden", type=int, default=256)
    p.add_argument("--deberta-layers", type=int, default=2)
    p.add_argument("--deberta-heads", type=int, default=4)
    p.add_argument("--deberta-intermediate", type=int, default=None, help="default 4 x hidden")
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip")
    p.add_argument("--patience", type=int, default=2, help="evaluations without improvement before lr /= 2")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--max-minutes", type=float, default=None, help="stop (and save state) after this wall time")
    p.add_argument("--batch-tokens", type=int, default=1500, help="padded tokens per batch (rows x longest)")
    p.add_argument("--max-len", type=int, default=64, help="pieces per side incl. EOS (longer ones truncated)")
    p.add_argument("--eval-every", type=int, default=500, help="steps between dev evaluations (0: per epoch)")
    p.add_argument("--dev-subset", type=int, default=300, help="dev pairs for periodic greedy BLEU")
    p.add_argument("--save-dtype", choices=("float32", "float16", "bfloat16"), default="float16")
    p.add_argument("--limit-train", type=int, default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--autocast", choices=("off", "bf16"), default="off",
                   help="bf16 autocast for the forward pass (pays only on CPUs with bf16 units: AVX512-BF16/AMX)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--eval-checkpoint", help="evaluate this checkpoint on --dev (greedy and --beam) and exit")
    p.add_argument("--beam", type=int, default=5)
    return p


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _eval_checkpoint(args) -> int:
    model, _, tok = load_translation_checkpoint(args.eval_checkpoint)
    pairs = load_pairs(args.dev)
    res: dict[str, Any] = {"checkpoint": args.eval_checkpoint, "pairs": len(pairs)}
    for name, k in (("greedy", 1), (f"beam{args.beam}", args.beam)):
        t0 = time.perf_counter()
        res[name] = evaluate(model, tok, pairs, beam_size=k)
        res[name]["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(res, indent=2))
    return 0


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def _set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    py = s["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # score() imports sacrebleu only at the first evaluation: refuse now, not after hours of training
    require_train_extra("relserve train-translation", ["sacrebleu"])
    torch.set_num_threads(max(1, args.threads))
    if args.eval_checkpoint:
        if not args.dev:
            raise SystemExit("--eval-checkpoint needs --dev")
        return _eval_checkpoint(args)
    if not (args.train and args.out):
        raise SystemExit("--train and --out are required")
    state_dir = args.state_dir or (args.out.rstrip("/") + ".state")
    os.makedirs(state_dir, exist_ok=True)
    state_path = os.path.join(state_dir, STATE_NAME)
    save_dtype = getattr(torch, args.save_dtype)

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    train_pairs = load_train_pairs(args.train.split(","), args.limit_train)
    if args.exclude:
        held = {side for path in args.exclude.split(",") for pair in load_pairs(path) for side in pair}
        n0 = len(train_pairs)
        train_pairs = [p for p in train_pairs if p[0] not in held and p[1] not in held]
        _log(f"--exclude: dropped {n0 - len(train_pairs)} train pairs sharing a side with {args.exclude}")
    if args.mix_nopunct or args.mix_lower or args.mix_short_repeat:
        try:
            train_pairs, mix_counts = mix_variants(train_pairs, args.mix_nopunct, args.mix_lower,
                                                   args.mix_short_repeat, args.short_words, args.seed)
        except ValueError as e:
            raise SystemExit(f"--mix-*: {e}") from e
        _log(f"data mix: {json.dumps(mix_counts)}")
    dev_pairs = load_pairs(args.dev)[: args.dev_subset] if args.dev else []
    dev_kinds = [k.strip() for k in args.dev_variants.split(",") if k.strip()]
    if not dev_kinds:
        raise SystemExit("--dev-variants: name at least one of " + ", ".join(DEV_VARIANTS))
    for k in dev_kinds:
        if k not in DEV_VARIANTS:
            raise SystemExit(f"--dev-variants: unknown variant {k!r} (expected {', '.join(DEV_VARIANTS)})")
    if args.init_from:
        # the continued model must keep the tokenizers its embeddings were trained with
        args.tokenizer_from = args.init_from

    # Tokenizers: resumed runs use the ones in the state dir.
    src_spm, tgt_spm = os.path.join(state_dir, SOURCE_SPM), os.path.join(state_dir, TARGET_SPM)
    if not (args.resume and os.path.isfile(src_spm) and os.path.isfile(tgt_spm)):
        if args.tokenizer_from:
            for name in (SOURCE_SPM, TARGET_SPM):
                with open(os.path.join(args.tokenizer_from, name), "rb") as fi, open(
                    os.path.join(state_dir, name), "wb"
                ) as fo:
                    fo.write(fi.read())
        else:
            t0 = time.perf_counter()
            train_sentencepiece([s for s, _ in train_pairs], src_spm, args.src_vocab)
            train_sentencepiece([t for _, t in train_pairs], tgt_spm, args.tgt_vocab)
            _log(f"sentencepiece: trained {args.src_vocab}/{args.tgt_vocab} pieces in {time.perf_counter() - t0:.1f}s")
    tok = TranslationTokenizer(src_spm, tgt_spm)
    examples = encode_pairs(tok, train_pairs, args.max_len)

    resumed = None
    if args.resume:
        if not os.path.isfile(state_path):
            raise SystemExit(f"--resume: {state_path} does not exist")
        resumed = torch.load(state_path, weights_only=True)
        model = model_from_spec(resumed["spec"])
        model.load_state_dict(resumed["model"])
    elif args.init_from:
        model, _, _ = load_translation_checkpoint(args.init_from)
        model = model.float()
        _log(f"--init-from: weights of {args.init_from}")
    else:
        model = build_model(args, tok)
    # a continued model's config still carries its first run's summary, which would win over this run's
    model.config.extra.pop("training", None)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    step, epoch, batch_pos = 0, 0, 0
    best_bleu, bad_evals, history, train_seconds = -1.0, 0, [], 0.0
    losses: list[float] = []  # per-step training loss (kept in state.pt)
    if resumed is not None:
        optimizer.load_state_dict(resumed["optimizer"])
        step, epoch, batch_pos = resumed["step"], resumed["epoch"], resumed["batch_pos"]
        best_bleu, bad_evals = resumed["best_bleu"], resumed["bad_evals"]
        history, train_seconds = list(resumed["history"]), resumed["train_seconds"]
        losses = list(resumed.get("losses", []))
        _set_rng_state(resumed["rng"])
        _log(f"resumed from {state_path} at step {step} (epoch {epoch}, batch {batch_pos})")
    n_params = count_parameters(model)
    _log(f"model: encoder={encoder_kind(model)} params={n_params:,} train pairs={len(examples)} dev={len(dev_pairs)}")

    def save_state() -> None:
        tmp = state_path + ".tmp"
        torch.save(
            {
                "spec": model_spec(model),
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "step": step,
                "epoch": epoch,
                "batch_pos": batch_pos,
                "best_bleu": best_bleu,
                "bad_evals": bad_evals,
                "history": history,
                "losses": losses,
                "train_seconds": train_seconds,
                "rng": _rng_state(),
            },
            tmp,
        )
        os.replace(tmp, state_path)

    def run_eval() -> None:
        nonlocal best_bleu, bad_evals
        if not dev_pairs:
            save_translation_checkpoint(model, tok, args.out, dtype=save_dtype, extra_config=_training_info())
            return
        t0 = time.perf_counter()
        rng = _rng_state()  # decoding draws no random numbers, but keep resumption exact regardless
        res = evaluate_variants(model, tok, dev_pairs, dev_kinds, beam_size=1)
        _set_rng_state(rng)
        entry = {"step": step, "epoch": epoch, "lr": optimizer.param_groups[0]["lr"], "loss": round(avg_loss, 4),
                 **res, "eval_seconds": round(time.perf_counter() - t0, 1), "train_seconds": round(train_seconds)}
        history.append(entry)
        improved = res["bleu"] > best_bleu
        if improved:
            best_bleu, bad_evals = res["bleu"], 0
            save_translation_checkpoint(model, tok, args.out, dtype=save_dtype, extra_config=_training_info())
        else:
            bad_evals += 1
            if bad_evals >= args.patience:
                for g in optimizer.param_groups:
                    g["lr"] *= 0.5
                bad_evals = 0
        _log(f"eval {json.dumps(entry)}{' *best*' if improved else ''}")

    def _training_info() -> dict[str, Any]:
        info = {"step": step, "epoch": epoch, "seed": args.seed, "dev_subset_greedy": None
                if not history else {"bleu": history[-1]["bleu"], "chrf": history[-1]["chrf"]},
                "train_seconds": round(train_seconds)}
        if args.init_from:
            info["init_from"] = args.init_from
        if len(dev_kinds) > 1 and history:
            info["dev_variants_greedy"] = {k: history[-1][k]["bleu"] for k in dev_kinds}
        return {"training": info}

    from tqdm import tqdm

    total_batches_hint = len(make_batches(examples, args.batch_tokens, random.Random(0)))
    total = args.max_steps or args.epochs * total_batches_hint
    bar = tqdm(total=total, initial=step, disable=args.no_progress, mininterval=5, dynamic_ncols=True)
    deadline = None if args.max_minutes is None else time.monotonic() + 60 * args.max_minutes
    avg_loss, stop = float("nan"), False
    last_eval_step = step
    if args.init_from and resumed is None and dev_pairs:
        # the starting point's score: the curve's first point, and the bar a continued checkpoint must beat
        run_eval()
        save_state()
    while epoch < args.epochs and not stop:
        batches = make_batches(examples, args.batch_tokens, random.Random(args.seed * 100_003 + epoch))
        while batch_pos < len(batches):
            if (args.max_steps is not None and step >= args.max_steps) or (
                deadline is not None and time.monotonic() >= deadline
            ):
                stop = True
                break
            t0 = time.perf_counter()
            batch = collate(examples, batches[batch_pos], tok.pad_token_id, tok.bos_token_id)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast == "bf16"):
                loss, _ = batch_loss(model, batch, tok.pad_token_id, args.label_smoothing)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            step += 1
            batch_pos += 1
            train_seconds += time.perf_counter() - t0
            value = float(loss.detach())
            losses.append(round(value, 5))
            avg_loss = value if math.isnan(avg_loss) else 0.98 * avg_loss + 0.02 * value
            bar.update(1)
            bar.set_postfix(loss=f"{avg_loss:.3f}", ep=epoch, refresh=False)
            if args.no_progress and step % 100 == 0:
                _log(f"step {step} epoch {epoch} loss {avg_loss:.4f} train_s {train_seconds:.0f}")
            if args.eval_every and step % args.eval_every == 0:
                run_eval()
                last_eval_step = step
                save_state()
        else:
            epoch += 1
            batch_pos = 0
            if not args.eval_every and step != last_eval_step:
                run_eval()
                last_eval_step = step
                save_state()
    bar.close()
    if step != last_eval_step:
        run_eval()
    save_state()
    with open(os.path.join(state_dir, "history.json"), "w", encoding="utf-8") as f:
        json.dump({"params": n_params, "best_bleu": best_bleu, "history": history, "args": vars(args)}, f, indent=1)
    _log(f"done: step {step}, epoch {epoch}, best dev-subset greedy BLEU {best_bleu}, train {train_seconds:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
