"""relserve against OpenVINO on its own ground, translation on every core and memory, in one run: every row of
the CPU table with its target and PASS / MISS.

    python -m relserve.loadtest.bench.cpu_openvino                 # full: 3 repeats, 800 sentences, 20 s served
    python -m relserve.loadtest.bench.cpu_openvino --quick         # 1 repeat, 128 sentences, short runs
    python -m relserve.loadtest.bench.cpu_openvino --parts offline,served --no-openvino

The model is the one ``bench.cpu`` builds (:func:`.cpu.build_tokenizer`, :func:`.encoder.build_models`): a random
DeBERTa-v3-small-shaped classifier (6 x 768, 12 heads, FFN 3072, 256 position buckets) with an 8000-piece
Unigram tokenizer, saved as a servable checkpoint. Rows:

* offline, sorted batches of ``--batch`` short sentences (held-back sentiment dev sentences, else the committed
  load-test ones), tokenization included on both sides, fp32 and bf16;
* offline, ``--long`` (8 x 384) random tokens, fp32 and bf16;
* served: ``relserve serve`` of the checkpoint (``dtype: auto``, the defaults) at ``--clients`` closed-loop
  clients (:func:`.serving.serve_and_load`), against OpenVINO offline bf16 on the sentences;
* translation: :mod:`.translation_cores` (decode workers / the in-process loop at saturation);
* memory: :mod:`.memory` (the default server's summed PSS after warm-up and after a mixed load).

relserve offline runs the served paths: our encoder fp32 with the unpadded dense layers, and its bfloat16 copy
(:func:`relserve.service.backends.precision.to_bfloat16`). OpenVINO (:mod:`.openvino_peer`, its own child
process) runs ``ov.convert_model`` of transformers' model of the same checkpoint, compiled for CPU with the
``f32`` or ``bf16`` precision hint. Both use ``--threads`` threads. The offline paths take turns in
``--repeats`` rounds (the order rotating, medians), so a change in the machine's load falls on all; fp32 parity
(max |logit difference| against transformers) and bf16 argmax agreement are printed beside them. The first
lines name the CPU model, its bf16 / VNNI / AMX flags and the load average, which the figures depend on.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import harness

OV_PATHS = ("openvino_f32", "openvino_bf16")
OURS_PATHS = ("relserve_fp32", "relserve_bf16")
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile", "avx_vnni")
TARGET_OFFLINE = 1.0
TARGET_SERVED = 1.1


def cpu_flags() -> list[str]:
    """The flags of :data:`FLAGS` that /proc/cpuinfo lists (what decides the bf16 and int8 kernels)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in FLAGS if f in have]
    except OSError:
        pass
    return []


class Ours:
    """relserve's offline paths over one checkpoint, set as the torch backend sets them on CPU (unpadded, oneDNN
    dense layers, large blocks kept on the heap; no heap trim between batches, as OpenVINO keeps its memory too):
    fp32 and its bfloat16 copy; the transformers model
    of the same weights is kept for the fp32 parity column."""

    def __init__(self, hf: Any, ours: Any) -> None:
        from relserve.models.deberta import set_unpadded
        from relserve.models.onednn import set_onednn_linear
        from relserve.service.backends.heap import keep_freed_blocks
        from relserve.service.backends.precision import to_bfloat16

        self.hf = hf
        set_unpadded(ours, True)
        set_onednn_linear(ours, True)  # the torch backend's default on CPU (torch_onednn)
        keep_freed_blocks()  # as the torch backend's load does on CPU (large blocks reused from the heap)
        self.models = {"relserve_fp32": ours, "relserve_bf16": to_bfloat16(ours)}

    def run(self, path: str, ids: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
        with torch.inference_mode():
            if path == "transformers":
                return self.hf(input_ids=ids, attention_mask=mask).logits.float().numpy()
            return self.models[path](ids, mask).float().numpy()


def bench_workload(name: str, units: int, ours: Ours, batches_of, peer: Any, repeats: int) -> dict[str, Any]:
    """One workload on every path: a first pass (its logits give the parity columns), then ``repeats`` rounds
    taking turns; ``batches_of()`` yields (ids, mask) per batch, tokenization inside it."""
    def pass_of(path: str):
        def run() -> tuple[float, np.ndarray]:
            if path.startswith("openvino"):
                return peer.time(name, path.split("_", 1)[1])
            t0 = time.perf_counter()
            outs = [ours.run(path, ids, mask) for ids, mask in batches_of()]
            return time.perf_counter() - t0, np.concatenate(outs)
        return run

    paths = list(OURS_PATHS) + (list(OV_PATHS) if peer is not None else [])
    first = {p: pass_of(p)() for p in paths}
    ref = np.concatenate([ours.run("transformers", i, m) for i, m in batches_of()])
    if repeats > 0:
        # the rotation of harness.interleaved, but each path's own seconds: the peer's pass as the child timed
        # it, without the pipe and the logits' transfer
        samples: dict[str, list[float]] = {p: [] for p in paths}
        for r in range(repeats):
            order = paths[r % len(paths):] + paths[:r % len(paths)]
            for p in order:
                samples[p].append(pass_of(p)()[0])
        seconds = harness.medians(samples)
    else:
        seconds = {p: first[p][0] for p in paths}
    row = {"workload": name, "units": units, "seconds": seconds,
           "per_s": {p: units / s for p, s in seconds.items()},
           "max_abs_diff_vs_transformers": {p: float(np.max(np.abs(first[p][1] - ref))) for p in paths},
           "agreement_vs_transformers": {p: float(np.mean(first[p][1].argmax(-1) == ref.argmax(-1)))
                                         for p in paths}}
    return row


def build(root: Path, args: argparse.Namespace, log=print) -> dict[str, Any]:
    """Tokenizer, checkpoint and the sentence workload (module docstring)."""
    import shutil

    from relserve.models.tokenization import load_tokenizer

    from .cpu import TOKENIZER_FILES, build_tokenizer, sorted_batches, workload_sentences
    from .encoder import build_models

    shared = None if args.committed_text else build_tokenizer.__defaults__[0]
    tok_dir, tok_origin = build_tokenizer(root / "tokenizer", shared_train=shared)
    tok = load_tokenizer(tok_dir, log_choice=False)
    texts, text_origin = workload_sentences(args.sentences, shared_dev=None if args.committed_text else
                                            workload_sentences.__defaults__[0])
    checkpoint = root / "checkpoint"
    hf, ours = build_models(args.layers, int(tok.vocab_size), hidden=args.hidden, heads=args.heads,
                            intermediate=args.intermediate, buckets=args.buckets, out_dir=str(checkpoint))
    for name in TOKENIZER_FILES:
        shutil.copy(tok_dir / name, checkpoint / name)
    groups, real, padded = sorted_batches(tok, texts, args.batch)
    log(f"tokenizer: {tok_origin}; sentences: {text_origin}; model {args.layers} x {args.hidden}, "
        f"{sum(p.numel() for p in ours.parameters()) / 1e6:.1f}M parameters; sorted batches of {args.batch}: "
        f"padding efficiency {real / padded:.3f}, mean {real / len(texts):.1f} tokens")
    return {"tok": tok, "tok_dir": tok_dir, "texts": texts, "groups": groups, "checkpoint": checkpoint,
            "ours": Ours(hf, ours), "origin": {"tokenizer": tok_origin, "sentences": text_origin}}


def offline(built: dict[str, Any], peer: Any, args: argparse.Namespace, log=print) -> list[dict[str, Any]]:
    from .unpadded import _batches
    from .openvino_peer import random_ids

    tok, groups = built["tok"], built["groups"]
    B, T = (int(x) for x in args.long.lower().split("x"))
    vocab = int(tok.vocab_size)
    if peer is not None:
        peer.sentences("short", groups, built["tok_dir"])
        peer.shape("long", B, T, vocab, T)
    ids, mask = random_ids(B, T, vocab, T)
    rows = [
        bench_workload("short", len(built["texts"]), built["ours"],
                       lambda: (_batches(tok, g, len(g), 512)[0] for g in groups), peer, args.repeats),
        bench_workload("long", B, built["ours"], lambda: [(ids, mask)], peer, args.repeats),
    ]
    for row in rows:
        log(f"  {row['workload']}: " + ", ".join(f"{p} {v:.3g}/s" for p, v in row["per_s"].items())
            + "; max |logit diff| vs transformers: " + ", ".join(
                f"{p} {v:.1e}" for p, v in row["max_abs_diff_vs_transformers"].items())
            + "; argmax agreement: " + ", ".join(
                f"{p} {v:.3f}" for p, v in row["agreement_vs_transformers"].items()), flush=True)
    return rows


def served(built: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from .serving import serve_and_load

    ns = argparse.Namespace(threads=args.threads, duration=args.server_duration, max_requests=10**7,
                            warmup=args.server_warmup, seed=0, concurrency=args.clients)
    return serve_and_load(built["checkpoint"], f"max_batch_size={args.batch},torch_intra_op_threads={args.threads}",
                          "classify", ns, data=[{"text": t} for t in built["texts"]], start_timeout=900)


def translation(args: argparse.Namespace) -> dict[str, Any]:
    from . import translation_cores

    targs = translation_cores.build_parser().parse_args(
        ["--duration", str(args.sat_duration), "--warmup", str(args.sat_warmup), "--repeats", str(args.sat_repeats)])
    return translation_cores.run(targs)


def table(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every measured row: figure, relserve, peer, unit, ratio, target, verdict (PASS / MISS)."""
    rows: list[dict[str, Any]] = []

    def add(figure: str, ours: float | None, peer: float | None, unit: str, target: float, higher: bool = True,
            ratio: float | None = None) -> None:
        if ours is None:
            return
        if ratio is None and peer:
            ratio = ours / peer
        value = ratio if ratio is not None else None
        verdict = "-" if value is None else ("PASS" if (value >= target if higher else value <= target) else "MISS")
        rows.append({"figure": figure, "relserve": ours, "peer": peer, "unit": unit, "ratio": ratio,
                     "target": target, "higher_is_better": higher, "verdict": verdict})

    off = {r["workload"]: r["per_s"] for r in results.get("offline", [])}
    for w, label, unit in (("short", "offline, sorted batches of short sentences", "sent/s"),
                           ("long", "offline, long sequences", "seq/s")):
        if w in off:
            for ours, ov, dt in (("relserve_fp32", "openvino_f32", "fp32"), ("relserve_bf16", "openvino_bf16", "bf16")):
                add(f"{label}, {dt}", off[w][ours], off[w].get(ov), unit, TARGET_OFFLINE)
    if "served" in results:
        s = results["served"]
        add(f"served at {s['concurrency']} clients (dtype auto -> {s['dtype']}) vs OpenVINO offline bf16",
            s["throughput_rps"], off.get("short", {}).get("openvino_bf16"), "req/s", TARGET_SERVED)
    if "translation" in results:
        t = results["translation"]
        base = t["modes"]["in-process"]["sentences_per_s"]
        for name, ratio in t["ratios"].items():
            add(f"translation at saturation: {name} / in-process loop (0 errors, p99 no worse)",
                t["modes"][name]["sentences_per_s"], base, "sent/s", 1.5, ratio=ratio)
            m = t["modes"][name]
            if m["errors"] or m["p99_s"] > t["modes"]["in-process"]["p99_s"]:
                rows[-1]["verdict"] = "MISS"
    if "memory" in results:
        from .memory import GB

        m = results["memory"]
        add("memory of the server after warm-up (server + workers, PSS, GB)", m["warm"]["total_pss"] / GB, None, "GB",
            1.2, higher=False, ratio=m["warm"]["total_pss"] / GB)
        if "loaded" in m:
            add(f"memory after {m['load_s']:g} s of mixed load (server + workers, PSS, GB)",
                m["loaded"]["total_pss"] / GB, None, "GB", 1.5, higher=False, ratio=m["loaded"]["total_pss"] / GB)
    return rows


def print_table(rows: list[dict[str, Any]], log=print) -> None:
    log(f"{'figure':<86} {'relserve':>9} {'OpenVINO':>9} {'unit':>6} {'ratio':>6} {'target':>7}  verdict")
    for r in rows:
        peer = f"{r['peer']:9.2f}" if r["peer"] is not None else f"{'-':>9}"
        ratio = f"{r['ratio']:6.2f}" if r["ratio"] is not None else f"{'-':>6}"
        need = f"{'>=' if r['higher_is_better'] else '<='}{r['target']:.2f}"
        log(f"{r['figure']:<86} {r['relserve']:9.2f} {peer} {r['unit']:>6} {ratio} {need:>7}  {r['verdict']}")


# the defaults of the arguments that --quick shortens (left None by the parser)
QUICK = {"repeats": 1, "sentences": 128, "server_duration": 8.0, "sat_duration": 6.0, "sat_warmup": 2.0,
         "sat_repeats": 1, "memory_load_s": 15.0}
FULL = {"repeats": 3, "sentences": 800, "server_duration": 20.0, "sat_duration": 20.0, "sat_warmup": 3.0,
        "sat_repeats": 2, "memory_load_s": 60.0}


def build_parser() -> argparse.ArgumentParser:
    ap = harness.parser("cpu_openvino", __doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 repeat, 128 sentences, short served / translation / "
                                                         "memory runs")
    ap.add_argument("--parts", default="offline,served,translation,memory",
                    help="comma-separated: offline, served, translation, memory")
    harness.add_common_args(ap, threads=min(2, os.cpu_count() or 1), threads_help="threads of every path and server",
                            repeats=None, repeats_help="timed rounds per offline workload (3; quick 1)",
                            json="file")
    ap.add_argument("--no-openvino", action="store_true", help="relserve's figures only (no peer column)")
    ap.add_argument("--sentences", type=int, default=None, help="short-sentence workload size (800; quick 128)")
    ap.add_argument("--committed-text", action="store_true",
                    help="tokenizer and sentences from the committed load-test text, not ../shared/data")
    ap.add_argument("--batch", type=int, default=32, help="sentences per offline batch; the server's max_batch_size")
    ap.add_argument("--long", default="8x384", help="BATCHxTOKENS of the long workload")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--buckets", type=int, default=256)
    ap.add_argument("--clients", type=int, default=32, help="closed-loop clients of the served row")
    ap.add_argument("--server-duration", type=float, default=None, help="seconds of the served run (20; quick 8)")
    ap.add_argument("--server-warmup", type=int, default=64, help="requests before the served run counts")
    ap.add_argument("--sat-duration", type=float, default=None, help="translation: seconds per slice (20; quick 6)")
    ap.add_argument("--sat-warmup", type=float, default=None, help="translation: warm-up per slice (3; quick 2)")
    ap.add_argument("--sat-repeats", type=int, default=None, help="translation: slices per mode (2; quick 1)")
    ap.add_argument("--memory-load-s", type=float, default=None, help="memory: seconds of mixed load (60; quick 15)")
    ap.add_argument("--memory-server-args", default="",
                    help="memory: `relserve serve` flags, one string (default: none, the built-in default models; "
                         "{checkpoint} stands for the benchmark's own classifier)")
    return ap


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = harness.fill_defaults(build_parser().parse_args(argv), quick=QUICK, full=FULL)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    torch.set_num_threads(args.threads)
    from relserve.service.cpu_features import bf16_support

    native, why = bf16_support()
    results: dict[str, Any] = {"machine": {
        "processor": harness.cpu_name(), "cpus": os.cpu_count(), "flags": cpu_flags(), "torch": torch.__version__,
        "threads": args.threads, "bf16_native": native, "loadavg_start": os.getloadavg()}}
    print(f"{results['machine']['processor']}, {os.cpu_count()} cores, flags {' '.join(cpu_flags()) or 'none'}; "
          f"bf16 native: {'yes' if native else 'no'} ({why}); torch {torch.__version__}, {args.threads} threads; "
          f"load average {'/'.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    peer, built = None, None
    with tempfile.TemporaryDirectory(prefix="relserve-bench-ov-") as tmp:
        if parts & {"offline", "served"} or "{checkpoint}" in args.memory_server_args:
            built = build(Path(tmp), args)
            results["origin"] = built["origin"]
        try:
            if "offline" in parts:
                if not args.no_openvino:
                    from .openvino_peer import Peer, PeerUnavailable

                    try:
                        peer = Peer(args.threads)
                        convert_s = peer.load(built["checkpoint"])
                        results["openvino"] = {"version": peer.version, "convert_s": convert_s}
                        print(f"OpenVINO {peer.version}: ov.convert_model of transformers' model in {convert_s:.1f} s, "
                              f"compiled for CPU with the f32 and bf16 precision hints", flush=True)
                    except PeerUnavailable as exc:
                        results["openvino"] = {"unavailable": str(exc)}
                        print(f"OpenVINO unavailable, relserve's figures only: {exc}", flush=True)
                        if peer is not None:
                            peer.close()
                        peer = None
                print(f"offline ({args.repeats} rounds taking turns, medians):", flush=True)
                results["offline"] = offline(built, peer, args)
        finally:
            if peer is not None:
                peer.close()
        if "served" in parts:
            print(f"served ({args.clients} clients, {args.server_duration:g} s):", flush=True)
            results["served"] = served(built, args)
            print(f"  {results['served']['throughput_rps']:.1f} req/s, dtype {results['served']['dtype']}, "
                  f"errors {results['served']['errors_by_code'] or 0}", flush=True)
        if "translation" in parts:
            print("translation (bench.translation_cores):", flush=True)
            results["translation"] = translation(args)
        if "memory" in parts:
            from . import memory

            server_args = args.memory_server_args.replace("{checkpoint}", str(built["checkpoint"]) if built else "")
            print(f"memory (bench.memory, `relserve serve {server_args}`, {args.memory_load_s:g} s of mixed load):",
                  flush=True)
            results["memory"] = memory.measure(server_args.split(), args.memory_load_s, 8)
            results["memory"]["load_s"] = args.memory_load_s
    results["rows"] = table(results)
    results["machine"]["loadavg_end"] = os.getloadavg()
    print(f"\n{results['machine']['processor']} ({' '.join(results['machine']['flags'])}), {args.threads} threads; "
          f"load average {results['machine']['loadavg_start'][0]:.2f} at the start, "
          f"{results['machine']['loadavg_end'][0]:.2f} at the end; OpenVINO "
          f"{results.get('openvino', {}).get('version', 'not run')}")
    print_table(results["rows"])
    if args.json:
        harness.write_json(args.json, {k: v for k, v in results.items()})
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":  # pragma: no cover
    main()
