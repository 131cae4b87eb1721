"""CPU fp32 throughput of one DeBERTa-v3-base-shaped encoder on every path we have:
transformers eager : our torch : ONNX Runtime with the portable custom-op functions (: ONNX Runtime with the
native custom-op library, when ``make onnx-native`` has built it), plus the achieved GFLOP/s of the best path
next to a matmul peak measured in the same run.

    python -m relserve.loadtest.bench_onnx                          # 12 layers, 8x128 and 8x512
    python -m relserve.loadtest.bench_onnx --layers 2 --repeats 2   # quick run
    python -m relserve.loadtest.bench_onnx --json bench_onnx.json

The model is built as in :mod:`relserve.loadtest.bench_encoder` (hidden 768, 12 heads, intermediate 3072,
256 position buckets, p2c|c2p, shared key, layer-normed relative table; random weights), loaded into ours,
exported with :func:`relserve.models.onnx.export.export_model`. Each shape: one warm-up per path, then
``--repeats`` rounds that run every path once in turn (so drift in machine load hits all alike); the median
is reported. All paths must agree on the logits (max |diff| printed). FLOPs count the matmuls only (Q/K/V/O
projections, feed-forward, QKᵀ and attention·V, the relative-table projections and the c2p/p2c products).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np
import torch


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


def main(argv: list[str] | None = None) -> dict:
    from relserve.loadtest.bench_encoder import build_models
    from relserve.models.onnx.export import export_model
    from relserve.models.onnx.runtime import make_session
    from relserve.models.onnx.runtime import native_library

    parser = argparse.ArgumentParser(prog="python -m relserve.loadtest.bench_onnx", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=128100)
    parser.add_argument("--shapes", default="8x128,8x512", help="comma-separated BATCHxSEQ")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch and ORT intra-op threads")
    parser.add_argument("--json", metavar="FILE", help="also write the summary here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

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
            diff = max(float(np.max(np.abs(o - outs["torch"]))) for o in outs.values())
            times: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(args.repeats):
                for name in paths:
                    t = time.perf_counter()
                    run(name)
                    times[name].append(time.perf_counter() - t)
            med = {name: statistics.median(v) for name, v in times.items()}
            best = min(med, key=med.get)
            flops = encoder_flops(B, T, args.layers)
            row = {
                "shape": f"{B}x{T}",
                "seconds": {k: round(v, 4) for k, v in med.items()},
                "sequences_per_s": {k: round(B / v, 2) for k, v in med.items()},
                "ratio_vs_transformers": {k: round(med["transformers"] / v, 3) for k, v in med.items()},
                "best": best,
                "best_gflops": round(flops / med[best] / 1e9, 1),
                "max_abs_diff": diff,
            }
            results.append(row)
            ratio = " : ".join(f"{k} {row['ratio_vs_transformers'][k]:.2f}" for k in paths)
            print(f"{B}x{T}: {ratio} (throughput relative to transformers; median of {args.repeats}); "
                  f"best {best} {row['best_gflops']} GFLOP/s; max |diff| {diff:.1e}")
    peak = max(peak_before, matmul_peak(args.threads))
    print(f"matmul peak (2048^3 fp32, {args.threads} threads, best of before/after): {peak:.1f} GFLOP/s")
    summary = {"layers": args.layers, "threads": args.threads, "export_seconds": round(export_s, 1),
               "paths": list(paths), "native_library": lib, "matmul_peak_gflops": round(peak, 1),
               "results": results}
    for row in results:
        row["best_fraction_of_peak"] = round(row["best_gflops"] / peak, 3)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":  # pragma: no cover
    main()
