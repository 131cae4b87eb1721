"""Offline CPU throughput of the DeBERTa encoder's unpadded path (dense layers on real tokens) vs the padded one.

    python -m relserve.loadtest.bench.unpadded                      # all 300 sentences, 5 repeats
    python -m relserve.loadtest.bench.unpadded --sentences 128 --repeats 3   # quick run

Builds a DeBERTa-v3-small-shaped ``DebertaForSequenceClassification`` (hidden 768, 6 layers, 12 heads,
intermediate 3072, 256 position buckets, p2c|c2p, shared attention key, layer-normed relative embeddings;
random weights, the vocabulary of the small load-test tokenizer of :mod:`.randmodel`, which only sizes the
embedding table). The committed load-test sentences (``loadtest/data/sentiment_dev.jsonl``) are tokenized and
cut, in arrival order (no length bucketing), into batches of ``--batch`` sentences padded to their longest.
Each repeat times one pass over all batches per path under ``torch.inference_mode()``; the order of the two
paths alternates between repeats so drift in machine load hits both alike; medians are reported.

Prints sentences/s of each path, the ratio unpadded / padded, the padding efficiency (real tokens / padded
tokens), the largest logit difference between the paths, and the 1-minute load average before and after.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from . import harness


def _batches(tok, texts: list[str], batch: int, max_len: int):
    """Arrival-order batches as (input_ids Long[B,T], attention_mask Long[B,T]) padded to the longest."""
    import torch

    out = []
    for i in range(0, len(texts), batch):
        encs = [tok.encode(t, max_length=max_len).input_ids for t in texts[i:i + batch]]
        T = max(len(e) for e in encs)
        ids = torch.zeros(len(encs), T, dtype=torch.long)
        mask = torch.zeros(len(encs), T, dtype=torch.long)
        for b, e in enumerate(encs):
            ids[b, :len(e)] = torch.tensor(e)
            mask[b, :len(e)] = 1
        out.append((ids, mask))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser("unpadded", __doc__.split("\n\n")[0])
    ap.add_argument("--sentences", type=int, default=300, help="first N load-test sentences (arrival order)")
    ap.add_argument("--batch", type=int, default=32, help="sentences per batch")
    ap.add_argument("--max-len", type=int, default=512, help="truncate sentences to this many tokens")
    ap.add_argument("--layers", type=int, default=6, help="encoder layers (6 = v3-small)")
    harness.add_common_args(ap, repeats=5, repeats_help="timed passes per path (interleaved)",
                            threads=2, threads_help="torch.set_num_threads", json="print")
    args = ap.parse_args(argv)

    import torch

    from relserve.models.deberta import DebertaConfig, DebertaForSequenceClassification, set_unpadded

    from .randmodel import make_tokenizer
    from ..scenarios import sentences

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = make_tokenizer(Path(tmp) / "tokenizer")
        from relserve.models.tokenization import load_tokenizer

        tok = load_tokenizer(tok_dir)
    texts = sentences()[: args.sentences]
    batches = _batches(tok, texts, args.batch, args.max_len)
    real = sum(int(m.sum()) for _, m in batches)
    padded_tokens = sum(m.numel() for _, m in batches)

    cfg = DebertaConfig(
        vocab_size=int(tok.vocab_size), hidden_size=768, num_hidden_layers=args.layers, num_attention_heads=12,
        intermediate_size=3072, max_position_embeddings=512, relative_attention=True, position_buckets=256,
        pos_att_type=["p2c", "c2p"], position_biased_input=False, norm_rel_ebd="layer_norm", share_att_key=True,
        type_vocab_size=0, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = DebertaForSequenceClassification(cfg).eval()

    def run(unpadded: bool) -> list:
        set_unpadded(model, unpadded)
        with torch.inference_mode():
            return [model(ids, mask) for ids, mask in batches]

    load_before = os.getloadavg()[0]
    ref = run(False)  # warm-up of both paths, and the parity check
    got = run(True)
    max_diff = max((a - b).abs().max().item() for a, b in zip(ref, got))
    times = harness.medians(harness.interleaved({"padded": lambda: run(False), "unpadded": lambda: run(True)},
                                                args.repeats))
    load_after = os.getloadavg()[0]

    n = len(texts)
    res = {
        "sentences": n, "batches": len(batches), "batch": args.batch, "layers": args.layers,
        "threads": args.threads, "repeats": args.repeats,
        "real_tokens": real, "padded_tokens": padded_tokens, "padding_efficiency": real / padded_tokens,
        "padded_sent_per_s": n / times["padded"],
        "unpadded_sent_per_s": n / times["unpadded"],
        "max_abs_logit_diff": max_diff, "loadavg_1m_before": load_before, "loadavg_1m_after": load_after,
    }
    res["ratio_unpadded_over_padded"] = harness.ratio(res["unpadded_sent_per_s"], res["padded_sent_per_s"])
    print(f"v3-small shape ({args.layers} layers x 768), {n} sentences in {len(batches)} arrival-order batches of "
          f"{args.batch}, {args.threads} threads, {args.repeats} interleaved repeats (median)")
    print(f"padding efficiency {res['padding_efficiency']:.3f} ({real} real / {padded_tokens} padded tokens)")
    print(f"padded   {res['padded_sent_per_s']:8.1f} sentences/s")
    print(f"unpadded {res['unpadded_sent_per_s']:8.1f} sentences/s")
    print(f"ratio unpadded/padded {harness.fmt_ratio(res['ratio_unpadded_over_padded'])}; max |logit diff| {max_diff:.2e}")
    print(f"load average (1 min) {load_before:.2f} before, {load_after:.2f} after")
    harness.emit_json(args, [res])
    return res


if __name__ == "__main__":
    main()
