"""Issue 11's CPU benchmark in one run: every DeBERTa path offline, GFLOP/s against measured matmul peaks, the
server against its offline ideal, and iteration- vs request-level translation, ending in the issue's targets.

    python -m relserve.loadtest.bench.cpu --quick       # a few minutes on 2 free cores: 1 repeat, 256 sentences
    python -m relserve.loadtest.bench.cpu               # full: 3 repeats, 800 sentences, 20 s server runs
    python -m relserve.loadtest.bench.cpu --quick --parts offline --json out.json

Its successor for the CPU table against OpenVINO (every offline and served row side by side with OpenVINO in one
run, translation on every core and the default server's memory, with PASS / MISS) is
:mod:`relserve.loadtest.bench.cpu_openvino`.

What it builds (nothing is downloaded; everything lives in a temporary directory):

* a tokenizer of its own: a Unigram (SentencePiece-style) ``tokenizer.json`` of 8000 pieces trained with the
  ``tokenizers`` library's ``UnigramTrainer`` (through
  :func:`relserve.models.training.tokenizer.train_unigram_tokenizer`, the DeBERTa-v3 pipeline) on
  ``../shared/data/sentiment/train.jsonl`` when that file exists, else the small 4000-piece load-test tokenizer
  of :mod:`.randmodel` (committed load-test text);
* a random DeBERTa-v3-small-shaped classifier with that vocabulary (6 layers x 768, 12 heads, FFN 3072,
  position_buckets 256, p2c|c2p, shared key): transformers' ``DebertaV2ForSequenceClassification`` random-init
  from the config (seed 0), saved, and loaded into ours (:func:`.encoder.build_models`), so both run the same
  weights; the directory gets the tokenizer and is what the server serves;
* for 8x128 and 8x512, the same at DeBERTa-v3-base shape (12 layers; vocabulary 128100, random ids).

Offline paths, side by side (each workload: one untimed pass that also gives the logits for the agreement
columns, then ``--repeats`` rounds running every path once, the order rotating per round; medians):
``transformers`` eager fp32 : ours fp32 ``padded`` : ours fp32 ``unpadded`` (dense layers on real tokens) : ours
``bf16`` (bfloat16 weights and activations, :func:`relserve.service.backends.precision.to_bfloat16`, measured
whether or not the CPU has bf16 units; its native support is printed next to it) : ``ort_fp32`` (our exported
graph) : ``ort_int8`` (that graph's MatMul/Gemm weights dynamically quantized,
:func:`relserve.models.onnx.quantize.quantize_graph`; argmax agreement with ``ort_fp32`` printed). The sentence
workload (``--sentences`` real review / tweet sentences of ``../shared/data/sentiment/dev.jsonl``, else the 300
committed load-test sentences) runs batches of ``--batch`` sorted by token length, tokenization included in every
path's time.

Server vs offline ideal: ``relserve serve`` in a child process (:class:`.serverproc.ServerProcess`) with the
new defaults (``dtype: auto``, unpadded, cost-model batches), 32 closed-loop clients on the sentence workload;
the offline ideal is the same backend (``TorchBackend``, the dtype the server reports, unpadded) on sorted batches
of ``--batch``, tokenization included, no gRPC; today's behaviour (the issue's "fp32, padded, one batch") is the
same server with ``dtype: float32, cost_batching: false, torch_unpadded: false, max_batch_time_ms: 0,
worker_process: false`` (without ``max_batch_time_ms``, the 20 ms cap would still cut each formed batch
into pieces; the model computed in the server's process then). ``fp32 new`` is the new defaults with ``dtype:
float32`` (the worker process included). Padding efficiency: the server's
``relserve_batch_padding_efficiency`` (mean per backend call over the run) and the offline batches' real /
padded tokens. Tokenization time per request (``relserve_tokenization_duration_seconds``, which holds the GIL
for most of it) is printed next to the mean request time, and, where py-spy is installed, the GIL hold per
request measured by sampling the server (:mod:`.gil`: ``py-spy record --gil``), by thread role (event loop,
tokenizer, model executor) with ``--gil`` (a separate run: the sampling slows the server).

Translation: :func:`.translation.run_capacity` on the default de-en model and the committed Tatoeba
sentences, saturation throughput of iteration- vs request-level scheduling (no p99 phases here).

Every number comes from this run; the last table lists the issue's targets with the measured ratio and PASS / MISS.
Torch and ONNX Runtime use ``--threads`` intra-op threads everywhere (server processes included).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from . import harness

REPO = Path(__file__).resolve().parents[2]
SHARED_SENTIMENT = REPO.parent / "shared" / "data" / "sentiment"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
PATHS = ("transformers", "padded", "unpadded", "bf16", "ort_fp32", "ort_int8")
FP32_PATHS = ("transformers", "padded", "unpadded", "ort_fp32")
BASE_VOCAB = 128100  # DeBERTa-v3's vocabulary: sizes the v3-base embedding table


@dataclass(frozen=True)
class Shape:
    """Encoder shape: layers, hidden size, heads, feed-forward size, relative position buckets."""

    layers: int
    hidden: int = 768
    heads: int = 12
    intermediate: int = 3072
    buckets: int = 256


V3_SMALL = Shape(layers=6)
V3_BASE = Shape(layers=12)


def encoder_flops(batches: Sequence[Sequence[int]], shape: Shape) -> float:
    """FLOPs (2 per multiply-add) of the encoder forwards of ``batches`` (each a list of the real token counts of
    its sequences): the useful work, no padding counted.

    Per layer, with hidden ``H`` and feed-forward ``I``; per sequence of ``n`` tokens with relative window
    ``R = min(2n - 1, 2 * buckets)`` (the relative distances that occur, clipped to the bucket table):

    * dense layers, ``2 * P * n`` with ``P = 4H² + 2HI`` the Linear weights (Q, K, V, attention output; FFN in
      and out; biases, LayerNorm, embeddings and the classifier head left out);
    * attention core, ``2 * 2 * n² * H`` (QKᵀ and attention·V over all heads);
    * disentangled terms, ``2 * 2 * n * R * H`` (content-to-position and position-to-content products);

    and per batch ``2 * 2 * R * H²`` (the relative table through the shared query and key projections, with the
    window ``R`` of the batch's longest sequence). For one batch of equal lengths this is
    :func:`relserve.loadtest.bench.onnx_encoder.encoder_flops`.
    """
    H, I = shape.hidden, shape.intermediate
    dense = 4 * H * H + 2 * H * I

    def window(n: int) -> int:
        return min(2 * n - 1, 2 * shape.buckets)

    total = 0.0
    for lengths in batches:
        total += 2 * 2 * window(max(lengths)) * H * H
        for n in lengths:
            total += 2 * dense * n + 2 * 2 * n * n * H + 2 * 2 * n * window(n) * H
    return float(shape.layers * total)


def matmul_peak(dtype: torch.dtype, n: int = 2048, seconds: float = 1.0, linear_layout: bool = True) -> float:
    """Best GFLOP/s of an ``n``³ ``torch.matmul(a, b)`` in ``dtype`` over about ``seconds`` (at least two timed
    calls after one untimed), with the current torch threads. ``linear_layout``: ``b`` is a transposed view, the
    layout in which ``nn.Linear`` multiplies by its weight; without bf16 units a contiguous bfloat16 ``b`` falls
    to a kernel about 10x slower still (measured on AVX2), which would not be the peak the model can reach."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(dtype)
    b = torch.randn(n, n, generator=g).to(dtype)
    if linear_layout:
        b = b.t()
    torch.matmul(a, b)
    best, calls = float("inf"), 0
    end = time.perf_counter() + seconds
    while calls < 2 or time.perf_counter() < end:
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t0)
        calls += 1
    return 2 * n**3 / best / 1e9


def build_tokenizer(out_dir: Path, shared_train: Path | None = SHARED_SENTIMENT / "train.jsonl",
                    vocab_size: int = 8000) -> tuple[Path, str]:
    """The benchmark's tokenizer in ``out_dir`` and where its pieces came from (see the module docstring)."""
    from relserve.models.training.tokenizer import train_unigram_tokenizer

    from .randmodel import make_tokenizer

    if shared_train is not None and shared_train.is_file():
        lines = [json.loads(x)["text"] for x in shared_train.read_text(encoding="utf-8").splitlines() if x.strip()]
        path = train_unigram_tokenizer(lines, out_dir, vocab_size, model_max_length=512, unicode_form="NFC",
                                       max_piece_length=12)
        return path, f"{vocab_size}-piece Unigram trained on {shared_train} ({len(lines)} texts)"
    return make_tokenizer(out_dir), "4000-piece Unigram trained on the committed load-test text (loadtest/data)"


def workload_sentences(n: int, shared_dev: Path | None = SHARED_SENTIMENT / "dev.jsonl",
                       seed: int = 0) -> tuple[list[str], str]:
    """``n`` real review / tweet sentences (a seeded sample of the shared sentiment dev set, in sample order),
    else all committed load-test sentences (300) when the shared file is absent."""
    import random

    from ..scenarios import sentences

    if shared_dev is not None and shared_dev.is_file():
        rows = [json.loads(x)["text"] for x in shared_dev.read_text(encoding="utf-8").splitlines() if x.strip()]
        random.Random(seed).shuffle(rows)
        return rows[:n], f"{min(n, len(rows))} of {shared_dev}"
    texts = sentences()[:n]
    return texts, f"{len(texts)} committed load-test sentences (loadtest/data/sentiment_dev.jsonl)"


class Encoder:
    """One random classifier on every offline path (module docstring); ``run(path, ids, mask)`` returns the logits
    as float32 numpy ``[B, labels]``. ``checkpoint`` is the saved directory (servable when it has a tokenizer)."""

    def __init__(self, root: Path, shape: Shape, vocab: int, threads: int,
                 tokenizer_dir: Path | None = None, log: Callable[[str], None] = print) -> None:
        from relserve.models.onnx.export import export_checkpoint
        from relserve.models.onnx.quantize import quantize_graph
        from relserve.models.onnx.runtime import make_session
        from relserve.service.backends.precision import to_bfloat16

        from .encoder import build_models

        self.shape = shape
        self.checkpoint = root / "checkpoint"
        t0 = time.perf_counter()
        self.hf, self.ours = build_models(shape.layers, vocab, hidden=shape.hidden, heads=shape.heads,
                                          intermediate=shape.intermediate, buckets=shape.buckets,
                                          out_dir=str(self.checkpoint))
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                shutil.copy(tokenizer_dir / name, self.checkpoint / name)
        self.bf16 = to_bfloat16(self.ours)
        t1 = time.perf_counter()
        exported = export_checkpoint(self.checkpoint, root / "onnx", parity=False, progress=None)
        fp32_graph = Path(exported.graph).read_bytes()
        t2 = time.perf_counter()
        self.int8_report = quantize_graph(fp32_graph, root / "onnx-int8",
                                          checkpoint_sha256=exported.report["checkpoint_sha256"])
        t3 = time.perf_counter()
        self.ort = {"ort_fp32": make_session(fp32_graph, intra_op_threads=threads),
                    "ort_int8": make_session(str(root / "onnx-int8" / "model.onnx"), intra_op_threads=threads)}
        self.inputs = [i.name for i in self.ort["ort_fp32"].get_inputs()]
        log(f"  built {shape.layers}x{shape.hidden} models in {t1 - t0:.1f} s, exported in {t2 - t1:.1f} s, "
            f"quantized in {t3 - t2:.1f} s ({self.int8_report['quantization']['quantized_matmuls']} int8 MatMuls)")

    def run(self, path: str, ids: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
        from relserve.models.deberta import set_unpadded

        if path in self.ort:
            feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
            if "token_type_ids" in self.inputs:
                feeds["token_type_ids"] = np.zeros_like(feeds["input_ids"])
            return self.ort[path].run(None, {k: feeds[k] for k in self.inputs})[0].astype(np.float32)
        with torch.inference_mode():
            if path == "transformers":
                return self.hf(input_ids=ids, attention_mask=mask).logits.float().numpy()
            model = self.bf16 if path == "bf16" else self.ours
            set_unpadded(model, path != "padded")  # bf16 runs the served (unpadded) path
            return model(ids, mask).float().numpy()


def time_paths(enc: Encoder, items: list[Any], prepare: Callable[[Any], tuple[torch.Tensor, torch.Tensor]],
               repeats: int, paths: Sequence[str] = PATHS) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """Seconds per pass over ``items`` for each path (median of ``repeats`` timed rounds after one untimed pass;
    ``repeats`` 0 times that pass), ``prepare`` (tokenization and padding, or nothing) inside the timing; and
    each path's logits of the untimed pass, ``[items x B, labels]``."""
    def one_pass(path: str) -> tuple[float, np.ndarray]:
        t0 = time.perf_counter()
        outs = [enc.run(path, *prepare(item)) for item in items]
        return time.perf_counter() - t0, np.concatenate(outs)

    first: dict[str, float] = {}
    logits: dict[str, np.ndarray] = {}
    for p in paths:
        first[p], logits[p] = one_pass(p)
    if repeats == 0:
        return first, logits
    times = harness.interleaved({p: (lambda p=p: one_pass(p)) for p in paths}, repeats)
    return harness.medians(times), logits


def agreement(a: np.ndarray, b: np.ndarray) -> float:
    """Fraction of rows whose argmax is the same in ``a`` and ``b``."""
    return float(np.mean(a.argmax(-1) == b.argmax(-1)))


def summarize(name: str, units: int, unit: str, seconds: dict[str, float], logits: dict[str, np.ndarray],
              flops: float) -> dict[str, Any]:
    """One workload's row: per-path throughput, ratio to transformers, useful GFLOP/s, argmax agreement with
    ours fp32 padded (ORT int8 also with ORT fp32) and max |logit diff| against it."""
    ref = logits["padded"]
    row = {
        "workload": name, "unit": unit, "units": units,
        "seconds": {p: round(s, 4) for p, s in seconds.items()},
        "per_s": {p: units / s for p, s in seconds.items()},
        "ratio_vs_transformers": {p: harness.ratio(seconds["transformers"], s) for p, s in seconds.items()},
        "gflops": {p: flops / s / 1e9 for p, s in seconds.items()},
        "agreement_vs_padded": {p: agreement(v, ref) for p, v in logits.items()},
        "max_abs_diff_vs_padded": {p: float(np.max(np.abs(v - ref))) for p, v in logits.items()},
    }
    if "ort_int8" in logits and "ort_fp32" in logits:
        row["int8_agreement_vs_ort_fp32"] = agreement(logits["ort_int8"], logits["ort_fp32"])
    fp32 = [p for p in FP32_PATHS if p in seconds]
    row["best_fp32"] = min(fp32, key=seconds.get)
    return row


def print_row(row: dict[str, Any], bf16_note: str, log: Callable[[str], None] = print) -> None:
    r = row["ratio_vs_transformers"]
    log(f"{row['workload']}: " + " : ".join(f"{p} {r[p]:.2f}" for p in r) + "  (throughput / transformers)")
    log("  " + ", ".join(f"{p} {v:.3g}" for p, v in row["per_s"].items()) + f" {row['unit']}/s")
    log("  GFLOP/s (useful): " + ", ".join(f"{p} {v:.1f}" for p, v in row["gflops"].items()))
    log(f"  bf16 {harness.fmt_ratio(harness.ratio(r['bf16'], r['padded']))} ours fp32 padded; {bf16_note}")
    log(f"  ORT int8 {harness.fmt_ratio(harness.ratio(r['ort_int8'], r['ort_fp32']))} ORT fp32, "
        f"argmax agreement with ORT fp32 "
        f"{row['int8_agreement_vs_ort_fp32']:.3f} ({row['units']} items)")
    log("  argmax agreement with ours fp32 padded: " + ", ".join(
        f"{p} {v:.3f}" for p, v in row["agreement_vs_padded"].items() if p != "padded")
        + "; max |logit diff|: " + ", ".join(
        f"{p} {v:.1e}" for p, v in row["max_abs_diff_vs_padded"].items() if p != "padded"))


def bench_shape(enc: Encoder, batch: int, seq: int, vocab: int, repeats: int) -> dict[str, Any]:
    """``batch`` random sequences of ``seq`` tokens (no padding) on every path."""
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(5, vocab, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    seconds, logits = time_paths(enc, [None], lambda _: (ids, mask), repeats)
    return summarize(f"{batch}x{seq} ({enc.shape.layers} layers x {enc.shape.hidden})", batch, "sequences", seconds,
                     logits, encoder_flops([[seq] * batch], enc.shape))


def sorted_batches(tok, texts: list[str], batch: int, max_len: int = 512) -> tuple[list[list[str]], int, int]:
    """``texts`` sorted by token length and cut into batches of ``batch``; with the real and the padded token
    counts of those batches (padded: size x longest)."""
    lengths = [len(tok.encode(t, max_length=max_len).input_ids) for t in texts]
    order = sorted(range(len(texts)), key=lengths.__getitem__)
    groups = [order[i:i + batch] for i in range(0, len(order), batch)]
    real = sum(lengths)
    padded = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    return [[texts[i] for i in g] for g in groups], real, padded


def bench_sentences(enc: Encoder, tok, texts: list[str], batch: int, repeats: int) -> dict[str, Any]:
    """The sentence workload (sorted batches of ``batch``, tokenization in the timing) on every path."""
    from .unpadded import _batches

    groups, real, padded = sorted_batches(tok, texts, batch)
    lengths = [[len(tok.encode(t, max_length=512).input_ids) for t in g] for g in groups]
    seconds, logits = time_paths(enc, groups, lambda g: _batches(tok, g, len(g), 512)[0], repeats)
    row = summarize(f"{len(texts)} sentences, sorted batches of {batch} ({enc.shape.layers} layers x "
                    f"{enc.shape.hidden}, tokenization included)",
                    len(texts), "sentences", seconds, logits, encoder_flops(lengths, enc.shape))
    row.update(real_tokens=real, padded_tokens=padded, padding_efficiency=real / padded,
               mean_tokens=real / len(texts))
    return row


def bench_server(checkpoint: Path, tok, texts: list[str], args: argparse.Namespace,
                 log: Callable[[str], None] = print) -> dict[str, Any]:
    """New defaults and today's behaviour served (32 closed-loop clients on ``texts``), and the offline ideal of
    the dtype the new-defaults server reports (module docstring)."""
    from .serving import offline_throughput, serve_and_load

    ns = argparse.Namespace(threads=args.threads, duration=args.server_duration, max_requests=10**7,
                            warmup=args.server_warmup, seed=0, concurrency=args.clients)
    data = [{"text": t} for t in texts]
    base = f"max_batch_size={args.batch},torch_intra_op_threads={args.threads}"
    out: dict[str, Any] = {}
    log(f"server ({args.clients} closed-loop clients, {args.server_duration:g} s after {args.server_warmup} "
        f"warm-up requests):")
    out["new"] = serve_and_load(checkpoint, base, "classify", ns, data=data, start_timeout=900, gil=args.gil)
    out["today"] = serve_and_load(checkpoint, base + ",dtype=float32,cost_batching=false,torch_unpadded=false,"
                                  "max_batch_time_ms=0,worker_process=false",
                                  "classify", ns, data=data, start_timeout=900, gil=args.gil)
    if out["new"]["dtype"] != "float32":
        out["new_fp32"] = serve_and_load(checkpoint, base + ",dtype=float32", "classify", ns, data=data,
                                         start_timeout=900)
    else:
        out["new_fp32"] = out["new"]  # auto served float32: the fp32-only run is the same configuration
    if args.instances > 1:  # the new defaults with the model in that many single-thread worker processes
        out["new_instances"] = serve_and_load(checkpoint, base + f",instances={args.instances}", "classify", ns,
                                              data=data, start_timeout=900)
    groups, real, padded = sorted_batches(tok, texts, args.batch)
    ordered = [t for g in groups for t in g]
    log(f"  offline ideal: TorchBackend, dtype {out['new']['dtype']}, unpadded, sorted batches of {args.batch}:")
    out["offline_ideal"] = offline_throughput(checkpoint, ordered, args.batch, args.offline_seconds,
                                              dtype=out["new"]["dtype"] or "float32", torch_unpadded=True,
                                              torch_intra_op_threads=args.threads)
    out["offline_ideal"]["padding_efficiency"] = real / padded
    # A closed loop of N clients lets the server form batches of about N / 2 (while one cohort runs, the other
    # waits): the same ideal at that size shows how much of the gap is batch size rather than serving
    half = max(1, args.clients // 2)
    groups_h, real_h, padded_h = sorted_batches(tok, texts, half)
    log(f"  offline ideal at the closed loop's batch size ({args.clients} clients / 2): sorted batches of {half}:")
    out["offline_ideal_half"] = offline_throughput(checkpoint, [t for g in groups_h for t in g], half,
                                                   args.offline_seconds, dtype=out["new"]["dtype"] or "float32",
                                                   torch_unpadded=True, torch_intra_op_threads=args.threads)
    out["offline_ideal_half"]["padding_efficiency"] = real_h / padded_h
    new, today, ideal = out["new"], out["today"], out["offline_ideal"]
    out["ratios"] = {
        "new_over_today": new["throughput_rps"] / today["throughput_rps"],
        "fp32_new_over_today": out["new_fp32"]["throughput_rps"] / today["throughput_rps"],
        "server_over_offline_ideal": new["throughput_rps"] / ideal["throughput_tps"],
        "server_over_offline_ideal_half": new["throughput_rps"] / out["offline_ideal_half"]["throughput_tps"],
    }
    if "new_instances" in out:
        out["ratios"]["instances_over_today"] = out["new_instances"]["throughput_rps"] / today["throughput_rps"]
        out["ratios"]["instances_over_offline_ideal"] = out["new_instances"]["throughput_rps"] / ideal["throughput_tps"]
    for key in ("new", "today", "new_instances"):
        if key not in out:
            continue
        s = out[key]
        tok_ms, req_ms = s.get("mean_tokenization_ms"), s.get("mean_request_ms")
        gil = (f"tokenization step {tok_ms:.2f} ms of {req_ms:.1f} ms per request (an upper bound of its GIL hold)"
               if tok_ms is not None and req_ms else "tokenization time n/a")
        log(f"  => {key}: {s['throughput_rps']:.1f} sentences/s, dtype {s['dtype']}, server padding efficiency "
            f"{_f(s.get('batch_padding_efficiency'))} per call (tokens: {_f(s.get('padding_efficiency'))}); {gil}")
        cores = s.get("cpu_cores") or {}
        log(f"     cores used: clients {_f(cores.get('clients'))}, server process {_f(cores.get('server'))}, "
            f"worker processes {_f(cores.get('workers'))} (of {os.cpu_count()}); mean backend call "
            f"{_f(s.get('mean_batch_size'))} texts in {_f(s.get('mean_inference_ms_per_batch'))} ms")
        if args.gil:
            log(f"     GIL: {gil_line(s.get('gil'))}")
    log(f"  => offline ideal {ideal['throughput_tps']:.1f} sentences/s, padding efficiency {real / padded:.3f}; "
        f"at batches of {half}: {out['offline_ideal_half']['throughput_tps']:.1f} sentences/s, padding efficiency "
        f"{real_h / padded_h:.3f}")
    log(f"  => new defaults / today {out['ratios']['new_over_today']:.2f}x; fp32 new / today "
        f"{out['ratios']['fp32_new_over_today']:.2f}x; server / offline ideal "
        f"{out['ratios']['server_over_offline_ideal']:.2f} (batches of {args.batch}), "
        f"{out['ratios']['server_over_offline_ideal_half']:.2f} (batches of {half})")
    if "new_instances" in out:
        log(f"  => new defaults with instances={args.instances}: / today {out['ratios']['instances_over_today']:.2f}x, "
            f"/ new defaults {out['new_instances']['throughput_rps'] / new['throughput_rps']:.2f}x, / offline ideal "
            f"{out['ratios']['instances_over_offline_ideal']:.2f}")
    return out


def gil_line(report: dict[str, Any] | None) -> str:
    """One line of :mod:`.gil`'s report: held per request and share of the wall, by thread role."""
    if not report:
        return "n/a"
    if "held_s" not in report:
        return "n/a (" + "; ".join(report.get("error") or ["no samples"]) + ")"
    per = report.get("ms_per_request", float("nan"))
    roles = ", ".join(f"{role} {per * s / max(report['held_s'], 1e-9):.2f}" for role, s in report["by_role"].items())
    return (f"held {report['held_fraction']:.2f} of the wall, {per:.2f} ms per request ({roles} ms; "
            f"py-spy --gil, {report['samples']} samples)")


def bench_translation(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`.translation.run_capacity` at saturation only (n_best 1 and 5), dtype auto."""
    from . import translation as bt

    targs = bt.build_parser().parse_args([
        "--capacity", "--dtype", "auto", "--threads", str(args.threads),
        "--sat-duration", str(args.sat_duration), "--sat-warmup", str(args.sat_warmup),
        "--sat-repeats", str(args.sat_repeats)])
    targs.max_batch_size = 64  # as translation --capacity
    targs.load_fractions = ()  # saturation only: the p99 phases are translation's
    sentences, _ = bt.load_sentences(bt.EVERYDAY)
    return bt.run_capacity(bt.DEFAULT_MODEL, sentences, targs)


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets that this run measured: name, measured ratio, threshold, PASS / MISS."""
    rows = []

    def add(name: str, value: float | None, need: float, extra_ok: bool = True, note: str = "") -> None:
        if value is not None:
            rows.append({"target": name, "measured": value, "threshold": need,
                         "verdict": "PASS" if value >= need and extra_ok else "MISS", "note": note})

    srv = results.get("server", {}).get("ratios", {})
    add("server new defaults / today (fp32, padded, one batch)", srv.get("new_over_today"), 3.0)
    add("server fp32 (unpadded + cost-model batches) / today", srv.get("fp32_new_over_today"), 1.5)
    add("server / offline ideal of the same dtype", srv.get("server_over_offline_ideal"), 0.9)
    add("  new defaults with instances > 1 / today", srv.get("instances_over_today"), 3.0,
        note="not the default: instances is opt-in (one copy of the weights per instance)")
    add("  new defaults with instances > 1 / offline ideal", srv.get("instances_over_offline_ideal"), 0.9,
        note="not the default")
    add("  the same, offline ideal at the closed loop's batch size (clients / 2)",
        srv.get("server_over_offline_ideal_half"), 0.9, note="not the issue's target: batch size shown apart")
    for row in results.get("offline", []):
        if row["workload"].startswith("8x128"):
            r = row["ratio_vs_transformers"]
            best32 = max(r[p] for p in ("padded", "unpadded"))
            add("bf16 / fp32 offline, v3-base 8x128", r["bf16"] / best32, 1.8, note=results.get("bf16_note", ""))
            agree = next((x["int8_agreement_vs_ort_fp32"] for x in results["offline"] if "sentences" in x["workload"]),
                         row["int8_agreement_vs_ort_fp32"])
            add("ORT int8 / ORT fp32 offline, v3-base 8x128 (agreement >= 0.99)", r["ort_int8"] / r["ort_fp32"], 2.0,
                agree >= 0.99, note=f"argmax agreement {agree:.3f}")
    tr = results.get("translation", {}).get("ratios", {})
    add("translation iteration / request throughput at saturation (n_best 1)",
        tr.get("throughput_iteration_over_request/n_best=1"), 1.5)
    add("translation iteration / request throughput at saturation (n_best 5)",
        tr.get("throughput_iteration_over_request/n_best=5"), 1.5)
    return rows


def _f(v: float | None, digits: int = 3) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


# the defaults of the arguments that --quick shortens (left None by the parser)
QUICK = {"repeats": 1, "sentences": 256, "server_duration": 10.0, "offline_seconds": 8.0, "sat_duration": 5.0,
         "sat_warmup": 1.5, "sat_repeats": 1}
FULL = {"repeats": 3, "sentences": 800, "server_duration": 20.0, "offline_seconds": 15.0, "sat_duration": 20.0,
        "sat_warmup": 3.0, "sat_repeats": 2}


def build_parser() -> argparse.ArgumentParser:
    ap = harness.parser("cpu", __doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="1 repeat, 256 sentences, 10 s server runs, 5 s translation slices (a few minutes)")
    ap.add_argument("--parts", default="offline,server,translation",
                    help="comma-separated: offline (the path table and peaks), server, translation")
    harness.add_common_args(
        ap, threads=min(2, os.cpu_count() or 1),
        threads_help="torch / ONNX Runtime intra-op threads in every process (default min(2, cores))",
        repeats=None, repeats_help="timed rounds per offline workload (3; quick 1)",
        json="file", json_help="also write every number here")
    ap.add_argument("--sentences", type=int, default=None, help="sentence workload size (800; quick 256)")
    ap.add_argument("--batch", type=int, default=32, help="sentences per batch, offline and max_batch_size")
    ap.add_argument("--shapes", default="8x128,8x512", help="v3-base BATCHxSEQ workloads")
    ap.add_argument("--base-layers", type=int, default=V3_BASE.layers, help="layers of the v3-base-shaped model")
    ap.add_argument("--clients", type=int, default=32, help="closed-loop clients of the server runs")
    ap.add_argument("--instances", type=int, default=2,
                    help="also serve the new defaults with this many worker processes per model (instances; 1: not)")
    ap.add_argument("--server-duration", type=float, default=None, help="seconds per server run (20; quick 10)")
    ap.add_argument("--server-warmup", type=int, default=64, help="requests before each server run")
    ap.add_argument("--offline-seconds", type=float, default=None, 
                    help="offline ideal: seconds of passes (15; quick 8)")
    ap.add_argument("--sat-duration", type=float, default=None, 
                    help="translation: seconds counted per slice (20; quick 5)")
    ap.add_argument("--sat-warmup", type=float, default=None, 
                    help="translation: seconds before counting (3; quick 1.5)")
    ap.add_argument("--sat-repeats", type=int, default=None, help="translation: slices per scheduling (2; quick 1)")
    ap.add_argument("--gil", action="store_true",
                    help="sample the servers' GIL holder with py-spy (loadtest/bench/gil.py); the sampling itself "
                         "costs the server throughput on a small machine, so the throughput ratios of such a run are "
                         "not the reference ones")
    return ap


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = harness.fill_defaults(build_parser().parse_args(argv), quick=QUICK, full=FULL)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    from relserve.models.tokenization import load_tokenizer
    from relserve.service.cpu_features import bf16_support

    torch.set_num_threads(args.threads)
    native, why = bf16_support()
    bf16_note = f"CPU bf16 native: {'yes' if native else 'NO'} ({why})"
    results: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "processor": harness.cpu_name(), "cpus": os.cpu_count(),
                    "torch": torch.__version__, "threads": args.threads, "loadavg_1m_start": os.getloadavg()[0]},
        "settings": vars(args), "bf16_native": native, "bf16_note": bf16_note,
    }
    print(f"{results['machine']['processor']}, {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} "
          f"threads, load average {os.getloadavg()[0]:.2f}; {bf16_note}", flush=True)
    with tempfile.TemporaryDirectory(prefix="relserve-bench-cpu-") as tmp:
        root = Path(tmp)
        tok_dir, tok_origin = build_tokenizer(root / "tokenizer")
        tok = load_tokenizer(tok_dir)
        texts, text_origin = workload_sentences(args.sentences)
        results["tokenizer"], results["sentences"] = tok_origin, text_origin
        print(f"tokenizer: {tok_origin}; sentences: {text_origin}", flush=True)
        small = None
        if "offline" in parts or "server" in parts:
            small = Encoder(root / "small", V3_SMALL, int(tok.vocab_size), args.threads, tokenizer_dir=tok_dir)
        if "offline" in parts:
            peaks = {"fp32": [matmul_peak(torch.float32)], "bf16": [matmul_peak(torch.bfloat16)]}
            rows = []
            print(f"v3-base shape ({args.base_layers} layers x 768, vocabulary {BASE_VOCAB}):", flush=True)
            base = Encoder(root / "base", Shape(layers=args.base_layers), BASE_VOCAB, args.threads)
            for spec in args.shapes.split(","):
                B, T = (int(x) for x in spec.lower().split("x"))
                rows.append(bench_shape(base, B, T, BASE_VOCAB, args.repeats))
                print_row(rows[-1], bf16_note)
            del base
            rows.append(bench_sentences(small, tok, texts, args.batch, args.repeats))
            print_row(rows[-1], bf16_note)
            print(f"  padding efficiency of the sorted batches {rows[-1]['padding_efficiency']:.3f} "
                  f"(mean {rows[-1]['mean_tokens']:.1f} tokens per sentence)", flush=True)
            peaks["fp32"].append(matmul_peak(torch.float32))
            peaks["bf16"].append(matmul_peak(torch.bfloat16))
            peak = {k: max(v) for k, v in peaks.items()}
            results["offline"], results["matmul_peak_gflops"] = rows, peak
            print(f"matmul peaks (2048^3, a @ b.T as nn.Linear, {args.threads} threads, best of before/after): fp32 "
                  f"{peak['fp32']:.1f}, bf16 {peak['bf16']:.1f} GFLOP/s; {bf16_note}")
            for row in rows:
                best = row["best_fp32"]
                print(f"  {row['workload'].split(' (')[0]}: best fp32 {best} {row['gflops'][best]:.1f} GFLOP/s "
                      f"({row['gflops'][best] / peak['fp32']:.0%} of the fp32 peak), bf16 {row['gflops']['bf16']:.1f} "
                      f"GFLOP/s ({row['gflops']['bf16'] / peak['bf16']:.0%} of the bf16 peak)", flush=True)
        if "server" in parts:
            results["server"] = bench_server(small.checkpoint, tok, texts, args)
        if "translation" in parts:
            print("translation (defaults/translate-de-en, Tatoeba sentences, beam 5):", flush=True)
            results["translation"] = bench_translation(args)
    results["targets"] = targets(results)
    results["machine"]["loadavg_1m_end"] = os.getloadavg()[0]
    print(f"targets (one run, load average {results['machine']['loadavg_1m_start']:.2f} at the start, "
          f"{results['machine']['loadavg_1m_end']:.2f} at the end):")
    print(f"  {'target':<72} {'measured':>8} {'need':>6}  verdict")
    for t in results["targets"]:
        print(f"  {t['target']:<72} {t['measured']:>8.2f} {t['threshold']:>6.2f}  {t['verdict']}"
              + (f"  ({t['note']})" if t["note"] else ""))
    if args.json:
        harness.emit_json(args, [results], results)
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":  # pragma: no cover
    main()
