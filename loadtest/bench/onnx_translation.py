"""RNNsearch on torch vs on its exported ONNX graphs (CPU, fp32): encoder, one decoder step, whole beam search.

    python -m relserve.loadtest.bench.onnx_translation                                  # both default models
    python -m relserve.loadtest.bench.onnx_translation --model defaults/translate-de-en --repeats 5

For each checkpoint: export to a temporary directory (:mod:`relserve.models.onnx.export_rnnsearch`), then time
on the same German sentences (``loadtest/data/de_en_dev.jsonl``, ``--batch`` of them per batch):

* ``encode``: one batch through the encoder (the paper's BiGRU is a Python loop over time in torch, one
  ``GRU`` node in ONNX Runtime);
* ``step``: one decoder step for ``batch x beam`` hypotheses;
* ``beam``: a whole beam search (``--beam``, ``max_len_cap`` 40) over the batch, tokens must be identical.

Each measurement warms both up, then runs torch and ONNX Runtime alternately ``--repeats`` times (a sample
is 5 encodes, 20 steps or one search; alternating lets drift in machine load hit both alike); medians per
call and the torch / ORT time ratio (> 1: ORT faster) are printed.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import torch

from . import harness

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODELS = [REPO / "defaults" / "translate-de-en", REPO / "defaults" / "translate-de-en-deberta"]


def _sentences(n: int) -> list[str]:
    rows = []
    with open(REPO / "loadtest" / "data" / "de_en_dev.jsonl", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line)["source"])
            if len(rows) >= n:
                break
    return rows


def bench_model(path: Path, args) -> dict:
    from relserve.models.decoding import DecodeOptions, beam_search
    from relserve.models.onnx.export_rnnsearch import export_translation_model
    from relserve.models.onnx.runtime import OrtRNNSearch
    from relserve.models.checkpoint import load_translation_checkpoint

    model, cfg, tok = load_translation_checkpoint(path)
    texts = _sentences(args.batch)
    encoded = [tok.encode_source(t) for t in texts]
    S = max(len(e) for e in encoded)
    ids = torch.full((len(encoded), S), cfg.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(encoded), S, dtype=torch.bool)
    for i, e in enumerate(encoded):
        ids[i, : len(e)] = torch.tensor(e)
        mask[i, : len(e)] = True
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        export_translation_model(model, d, check=False)
        export_s = time.perf_counter() - t0
        ort_model = OrtRNNSearch(d, cfg, intra_op_threads=args.threads)
        models = {"torch": model, "onnxruntime": ort_model}
        opts = DecodeOptions(beam_size=args.beam, max_len_cap=40)
        with torch.inference_mode():
            state = model.encode(ids, mask)
            rows = torch.arange(len(encoded)).repeat_interleave(args.beam)
            tokens = torch.full((len(rows),), cfg.bos_token_id, dtype=torch.long)
            hidden = state.init_state.index_select(0, rows)
            tokens_out = {k: [[h.tokens for h in r] for r in beam_search(m, ids, mask, opts)] for k, m in models.items()}
            diff = max(float((a - b).abs().max()) for a, b in zip(model.decode_step(state, rows, tokens, hidden),
                                                                  ort_model.decode_step(state, rows, tokens, hidden)))
            med: dict[str, dict[str, float]] = {k: {} for k in models}
            for what, calls, call in (("encode", 5, lambda m: m.encode(ids, mask)),
                                      ("step", 20, lambda m: m.decode_step(state, rows, tokens, hidden)),
                                      ("beam", 1, lambda m: beam_search(m, ids, mask, opts))):
                def back_to_back(m, call=call, calls=calls):
                    return lambda: [call(m) for _ in range(calls)]

                # one warm-up round: first calls allocate
                samples = harness.interleaved({k: back_to_back(m) for k, m in models.items()}, args.repeats, warmup=1)
                for k, seconds in harness.medians(samples).items():
                    med[k][what] = seconds / calls
    row = {
        "model": os.fspath(path), "encoder": "bigru" if cfg.encoder_type == "bigru" else "deberta",
        "batch": len(encoded), "max_source_tokens": S, "beam": args.beam, "export_seconds": round(export_s, 1),
        "seconds": {k: {w: round(v, 5) for w, v in m.items()} for k, m in med.items()},
        "torch_over_ort": {w: round(harness.ratio(med["torch"][w], med["onnxruntime"][w]), 2) for w in med["torch"]},
        "identical_beam_tokens": tokens_out["torch"] == tokens_out["onnxruntime"], "step_max_abs_diff": diff,
    }
    print(f"{path.name} ({row['encoder']}, batch {row['batch']}, {S} tokens, beam {args.beam}): torch/ORT time "
          + ", ".join(f"{w} {harness.fmt_ratio(r)}" for w, r in row["torch_over_ort"].items())
          + " (ORT ms: " + ", ".join(f"{w} {1e3 * v:.1f}" for w, v in med["onnxruntime"].items())
          + f"); beam tokens {'identical' if row['identical_beam_tokens'] else 'DIFFER'}; step |diff| {diff:.1e}")
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser("onnx_translation", __doc__.splitlines()[0])
    parser.add_argument("--model", action="append", help="translation checkpoint (repeatable; default: both defaults)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--beam", type=int, default=5)
    harness.add_common_args(parser, repeats=5, threads=os.cpu_count() or 1,
                            threads_help="torch and ORT intra-op threads", json="file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = [bench_model(Path(p), args) for p in (args.model or DEFAULT_MODELS)]
    summary = {"threads": args.threads, "results": results}
    harness.emit_json(args, results, summary)
    return summary


if __name__ == "__main__":  # pragma: no cover
    main()
