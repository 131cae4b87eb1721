"""CPU fp32 throughput of one DeBERTa-v3-base-shaped encoder on every path we have:
transformers eager : our torch : ONNX Runtime with the portable custom-op functions (: ONNX Runtime with the
native custom-op library, when ``make onnx-native`` has built it), plus the achieved GFLOP/s of the best path
next to a matmul peak measured in the same run.

    python -m relserve.loadtest.bench.onnx_encoder                          # 12 layers, 8x128 and 8x512
    python -m relserve.loadtest.bench.onnx_encoder --layers 2 --repeats 2   # quick run
    python -m relserve.loadtest.bench.onnx_encoder --json bench_onnx.json
    python -m relserve.loadtest.bench.onnx_encoder --dtype int8 --threads 1 --layers 6   # + ONNX Runtime int8
    python -m relserve.loadtest.bench.onnx_encoder --dtype int8 --threads 1 --checkpoint defaults/sentiment

``--dtype int8`` adds the int8 graph (:mod:`relserve.models.onnx.quantize`: dynamic quantization of the MatMul/Gemm
weights) to the ONNX Runtime paths and prints its throughput over the float32 graph's (``ort_int8 /
ort_portable``) with their agreement on the shape's rows (same argmax, max softmax difference; random ids on
random weights, so a coarse check: the serving gate runs real text). ``--checkpoint DIR`` instead benches a real
classifier through the server's own backend (:class:`relserve.service.backends.onnx_encoder.OnnxBackend`, dtype
float32 and dtype int8, graphs exported and quantized into a temporary cache) on the committed sentiment
sentences in length-sorted batches of 32, and prints the int8 backend's agreement-gate result next to the
throughput ratio. How much int8 gains depends on the CPU: MLAS's u8s8 kernels are one instruction per 4-byte dot
product with AVX512-VNNI / AVX-VNNI and two (``vpmaddubsw`` + ``vpmaddwd``) on AVX2 without VNNI.

The model is built as in :mod:`relserve.loadtest.bench.encoder` (hidden 768, 12 heads, intermediate 3072,
256 position buckets, p2c|c2p, shared key, layer-normed relative table; random weights), loaded into ours,
exported with :func:`relserve.models.onnx.export.export_model`. Each shape: one warm-up per path, then
``--repeats`` rounds that run every path once in turn (so drift in machine load hits all alike); the median
is reported. All paths must agree on the logits (max |diff| printed). FLOPs count the matmuls only (Q/K/V/O
projections, feed-forward, QKᵀ and attention·V, the relative-table projections and the c2p/p2c products).
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import numpy as np
import torch

from . import harness


def encoder_flops(batch: int, seq: int, layers: int, hidden: int = 768, intermediate: int = 3072,
                  buckets: int = 256) -> float:
    """Multiply-adds x 2 of the encoder's matmuls for one forward."""
    B, T, H, I = batch, seq, hidden, intermediate
    R = min(2 * T - 1, 2 * buckets)  # rows of the relative table projected (the window)
    per_layer = (
        4 * 2 * B * T * H * H  # Q, K, V, output projections
        + 2 * 2 * B * T * H * I  # feed-forward
        + 2 * 2 * B * T * T * H  # QKᵀ and attention·V
        + 2 * 2 * R * H * H  # relative table through query_proj and key_proj (shared keys)
        + 2 * 2 * B * T * R * H  # c2p and p2c products
    )
    return float(layers * per_layer)


def matmul_peak(threads: int, seconds: float = 1.0) -> float:
    """Best GFLOP/s of a 2048^3 fp32 torch matmul over about ``seconds``."""
    torch.set_num_threads(threads)
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.matmul(a, b)
    best = float("inf")
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def checkpoint_comparison(checkpoint: str, threads: int, repeats: int, batch: int = 32) -> dict:
    """ONNX Runtime float32 vs int8 through :class:`OnnxBackend` on a classification checkpoint: the committed
    sentiment sentences (``loadtest/data/sentiment_dev.jsonl``) in length-sorted batches of ``batch``; each round
    runs all batches on both backends in turn, the median round counts. Returns the summary (also printed)."""
    from relserve.service.backends.onnx_encoder import OnnxBackend
    from relserve.service.backends.precision import LOADTEST_DATA
    from relserve.service.config import ModelConfig
    from relserve.service.tasks import classify

    texts = [json.loads(line)["text"] for line in open(LOADTEST_DATA / "sentiment_dev.jsonl", encoding="utf-8")]
    with tempfile.TemporaryDirectory() as cache:
        backends = {}

        def load(dtype: str, **gate: float) -> OnnxBackend:
            t0 = time.perf_counter()
            be = OnnxBackend(ModelConfig(name=dtype, path=checkpoint, backend="onnx", device="cpu", dtype=dtype,
                                         onnx_intra_op_threads=threads, onnx_cache_dir=cache, **gate))
            meta = be.load()
            print(f"{dtype}{' (gate limits ' + str(gate) + ')' if gate else ''}: loaded in "
                  f"{time.perf_counter() - t0:.1f} s, serving {meta.dtype}: {meta.dtype_reason}")
            return be

        backends["float32"] = load("float32")
        gated = load("int8")  # the default gate: what a server would serve
        # the throughput of the int8 graph is measured even where the gate keeps float32 (limits opened up)
        backends["int8"] = gated if gated.meta.dtype == "int8" else load("int8", dtype_gate_agreement=1e-9,
                                                                         dtype_gate_max_prob_diff=1.0)
        tok = backends["float32"].meta.tokenizer
        enc = sorted(classify.preprocess(tok, texts, None, backends["float32"].max_seq_len), key=lambda e: len(e.input_ids))
        batches = [enc[i:i + batch] for i in range(0, len(enc), batch)]
        def all_batches(be: OnnxBackend):
            return lambda: [be.run(b) for b in batches]

        med = harness.medians(harness.interleaved({k: all_batches(be) for k, be in backends.items()}, repeats,
                                                  warmup=1))
        tokens = sum(len(e.input_ids) for e in enc)
        summary = {"checkpoint": checkpoint, "threads": threads, "sentences": len(enc), "mean_tokens":
                   round(tokens / len(enc), 1), "batch": batch, "repeats": repeats,
                   "sentences_per_s": {k: round(len(enc) / v, 1) for k, v in med.items()},
                   "int8_over_float32": round(harness.ratio(med["float32"], med["int8"]), 3),
                   "int8_served_with_default_gate": gated.meta.dtype, "int8_reason": gated.meta.dtype_reason}
    print(f"{checkpoint}: {len(enc)} sentences (mean {summary['mean_tokens']} tokens), batches of {batch}, "
          f"{threads} thread(s), median of {repeats}: ORT float32 {summary['sentences_per_s']['float32']} : ORT "
          f"int8 {summary['sentences_per_s']['int8']} sentences/s = int8/float32 {summary['int8_over_float32']:.2f}x; "
          f"with the default gate the server serves {gated.meta.dtype}: {summary['int8_reason']}")
    return summary


def main(argv: list[str] | None = None) -> dict:
    from relserve.loadtest.bench.encoder import build_models
    from relserve.models.onnx.export import export_model
    from relserve.models.onnx.quantize import quantize_graph
    from relserve.models.onnx.runtime import make_session
    from relserve.models.onnx.runtime import native_library

    parser = harness.parser("onnx_encoder", __doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=128100)
    parser.add_argument("--shapes", default="8x128,8x512", help="comma-separated BATCHxSEQ")
    harness.add_common_args(parser, repeats=3, threads=os.cpu_count() or 1,
                            threads_help="torch and ORT intra-op threads", json="file")
    parser.add_argument("--dtype", choices=("float32", "int8"), default="float32",
                        help="int8: also run the dynamically quantized graph and print int8 / float32")
    parser.add_argument("--checkpoint", metavar="DIR", help="bench this classifier's float32 vs int8 graphs "
                                                           "through the server's backend instead (implies --dtype int8)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.checkpoint:
        summary = checkpoint_comparison(args.checkpoint, args.threads, args.repeats)
        harness.emit_json(args, [summary], summary)
        return summary

    peak_before = matmul_peak(args.threads)  # measured before and after the runs; the higher one counts
    t0 = time.perf_counter()
    hf, ours = build_models(args.layers, args.vocab)
    print(f"built {args.layers}-layer models in {time.perf_counter() - t0:.1f} s")
    with tempfile.TemporaryDirectory() as d:
        graph = os.path.join(d, "model.onnx")
        t0 = time.perf_counter()
        export_model(ours, ours.config, "classification", graph, check=False)
        export_s = time.perf_counter() - t0
        print(f"exported in {export_s:.1f} s")
        paths = {"transformers": None, "torch": None,
                 "ort_portable": make_session(graph, intra_op_threads=args.threads)}
        lib = native_library()
        if lib:
            paths["ort_native"] = make_session(graph, intra_op_threads=args.threads, native_library=lib)
        if args.dtype == "int8":
            t0 = time.perf_counter()
            with open(graph, "rb") as f:
                quantize_graph(f.read(), os.path.join(d, "int8"), checkpoint_sha256="bench")
            print(f"quantized in {time.perf_counter() - t0:.1f} s")
            paths["ort_int8"] = make_session(os.path.join(d, "int8", "model.onnx"), intra_op_threads=args.threads)
        results = []
        for shape in args.shapes.split(","):
            B, T = (int(x) for x in shape.lower().split("x"))
            g = torch.Generator().manual_seed(T)
            ids = torch.randint(5, args.vocab, (B, T), generator=g)
            mask = torch.ones_like(ids)
            feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}

            def run(name):
                if name == "transformers":
                    with torch.inference_mode():
                        return hf(input_ids=ids, attention_mask=mask).logits.numpy()
                if name == "torch":
                    with torch.inference_mode():
                        return ours(ids, mask).numpy()
                return paths[name].run(None, feeds)[0]

            outs = {name: run(name) for name in paths}  # warm-up + agreement
            # the float32 paths must agree on the logits; int8 is compared on decisions and probabilities below
            diff = max(float(np.max(np.abs(o - outs["torch"]))) for k, o in outs.items() if k != "ort_int8")
            med = harness.medians(harness.interleaved({name: (lambda name=name: run(name)) for name in paths},
                                                      args.repeats))
            best = min(med, key=med.get)
            flops = encoder_flops(B, T, args.layers)
            row = {
                "shape": f"{B}x{T}",
                "seconds": {k: round(v, 4) for k, v in med.items()},
                "sequences_per_s": {k: round(B / v, 2) for k, v in med.items()},
                "ratio_vs_transformers": {k: round(harness.ratio(med["transformers"], v), 3) for k, v in med.items()},
                "best": best,
                "best_gflops": round(flops / med[best] / 1e9, 1),
                "max_abs_diff": diff,
            }
            if "ort_int8" in paths:
                p32, p8 = (torch.softmax(torch.from_numpy(outs[k]).double(), -1).numpy()
                           for k in ("ort_portable", "ort_int8"))
                row["int8_over_ort_fp32"] = round(harness.ratio(med["ort_portable"], med["ort_int8"]), 3)
                row["int8_argmax_agreement"] = float(np.mean(p32.argmax(-1) == p8.argmax(-1)))
                row["int8_max_prob_diff"] = float(np.max(np.abs(p32 - p8)))
            results.append(row)
            ratio = " : ".join(f"{k} {row['ratio_vs_transformers'][k]:.2f}" for k in paths)
            print(f"{B}x{T}: {ratio} (throughput relative to transformers; median of {args.repeats}); "
                  f"best {best} {row['best_gflops']} GFLOP/s; max |diff| {diff:.1e}")
            if "ort_int8" in paths:
                print(f"{B}x{T}: ORT int8 / ORT float32 throughput {row['int8_over_ort_fp32']:.2f}x; int8 agreement "
                      f"on these {B} rows: argmax {row['int8_argmax_agreement']:.3f}, max probability difference "
                      f"{row['int8_max_prob_diff']:.3g}")
    peak = max(peak_before, matmul_peak(args.threads))
    print(f"matmul peak (2048^3 fp32, {args.threads} threads, best of before/after): {peak:.1f} GFLOP/s")
    summary = {"layers": args.layers, "threads": args.threads, "export_seconds": round(export_s, 1),
               "paths": list(paths), "native_library": lib, "matmul_peak_gflops": round(peak, 1),
               "results": results}
    for row in results:
        row["best_fraction_of_peak"] = round(row["best_gflops"] / peak, 3)
    harness.emit_json(args, results, summary)
    print(harness.json_line(summary))
    return summary


if __name__ == "__main__":  # pragma: no cover
    main()
