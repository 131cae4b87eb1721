"""Side-by-side CPU throughput of our DeBERTa encoder vs transformers' DebertaV2 on the same random weights.

    python -m relserve.loadtest.bench.encoder                 # DeBERTa-v3-base shape, 8x128 and 8x512
    python -m relserve.loadtest.bench.encoder --layers 2 --repeats 3    # quick run

Builds a DeBERTa-v3-base-shaped ``DebertaV2ForSequenceClassification`` (hidden 768, 12 layers, 12 heads,
intermediate 3072, vocab 128100, 256 position buckets, p2c|c2p, shared attention key, layer-normed relative
embeddings) with random weights, saves it, loads the same weights into ours with ``load_checkpoint``, checks the
logits agree, then times both under ``torch.inference_mode()``: warm-up, then repetitions alternating between
the two models (so drift in machine load hits both alike), reporting the median. Needs ``transformers``
(a test dependency). Prints one line per shape, and with ``--json`` one JSON line per shape.
"""

from __future__ import annotations

import tempfile

import torch

from . import harness


def build_models(layers: int, vocab: int, *, hidden: int = 768, heads: int = 12, intermediate: int = 3072,
                 buckets: int = 256, out_dir: str | None = None):
    """(transformers model, ours) with the same random weights (seed 0), v3-base layout by default.

    ``out_dir``: keep the saved checkpoint there (``save_pretrained`` layout, servable once a tokenizer is
    copied in); otherwise it lives in a temporary directory only while ours is loaded.
    """
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    from relserve.models.checkpoint import load_checkpoint

    cfg = DebertaV2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        hidden_act="gelu",
        max_position_embeddings=512,
        type_vocab_size=0,
        relative_attention=True,
        position_buckets=buckets,
        max_relative_positions=-1,
        pos_att_type=["p2c", "c2p"],
        share_att_key=True,
        norm_rel_ebd="layer_norm",
        position_biased_input=False,
        layer_norm_eps=1e-7,
        num_labels=2,
    )
    torch.manual_seed(0)
    hf = DebertaV2ForSequenceClassification(cfg).eval()
    if out_dir is not None:
        hf.save_pretrained(out_dir)
        return hf, load_checkpoint(out_dir, load_tokenizer=False).model
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = load_checkpoint(d, load_tokenizer=False).model
    return hf, ours


def bench_shape(hf, ours, batch: int, seq: int, repeats: int, warmup: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(1, vocab, (batch, seq), generator=g)
    mask = torch.ones_like(ids)

    def run_hf(i, m):
        return hf(input_ids=i, attention_mask=m).logits

    def run_ours(i, m):
        return ours(i, m)

    with torch.inference_mode():
        diff = (run_hf(ids, mask) - run_ours(ids, mask)).abs().max().item()
        times = harness.interleaved({"hf": lambda: run_hf(ids, mask), "ours": lambda: run_ours(ids, mask)},
                                    repeats, warmup)
    med = harness.medians(times)
    med_hf, med_ours = med["hf"], med["ours"]
    return {
        "batch": batch,
        "seq_len": seq,
        "repeats": repeats,
        "max_abs_logit_diff": diff,
        "transformers_seq_per_s": batch / med_hf,
        "ours_seq_per_s": batch / med_ours,
        "ratio_ours_to_transformers": med_hf / med_ours,
        "transformers_median_s": med_hf,
        "ours_median_s": med_ours,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = harness.parser("encoder", __doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12, help="encoder layers (12 = v3-base)")
    harness.add_common_args(ap, repeats=5, repeats_help="timed repetitions per model and shape",
                            warmup=1, warmup_help="untimed runs per model and shape",
                            threads=None, threads_help="torch.set_num_threads (default: torch's)", json="print")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--vocab", type=int, default=128100)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    hf, ours = build_models(args.layers, args.vocab)
    print(
        f"DeBERTa-v3-base shape, {args.layers} layers, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, fp32 CPU"
    )
    results = []
    for seq in args.seq_lens:
        r = bench_shape(hf, ours, args.batch, seq, args.repeats, args.warmup, args.vocab)
        results.append(r)
        print(
            f"batch {r['batch']} x {r['seq_len']}: transformers {r['transformers_seq_per_s']:.2f} seq/s, "
            f"ours {r['ours_seq_per_s']:.2f} seq/s, "
            f"ours:transformers {harness.fmt_ratio(r['ratio_ours_to_transformers'])} "
            f"(median of {r['repeats']}; max |logit diff| {r['max_abs_logit_diff']:.2e})",
            flush=True,
        )
    harness.emit_json(args, results)
    return results


if __name__ == "__main__":
    main()
