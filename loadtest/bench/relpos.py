"""Op-level CPU timing of the torch kernels of the disentangled-attention bias (c2p + p2cᵀ, He et al. 2021,
eq. 4), side by side in one run:

    python -m relserve.loadtest.bench.relpos                 # ~20 s on 2 cores
    python -m relserve.loadtest.bench.relpos --threads 1 --repeats 50

* ``reference``: ``torch.gather`` with the [Tq, Tk] index expanded to [B, n, Tq, Tk] (the differentiable
  form training uses);
* ``by_rows``: advanced indexing on the flattened scores (the bfloat16 CPU kernel beyond the exact bucket range;
  float32 keeps the reference there);
* ``by_shift``: strided views of the scores where the table index is linear in the distance (up to 132 tokens
  with 256 buckets; Transformer-XL's relative shift);
* ``by_diagonals``: the table rows put in diagonal order first, then one product of 2T - 1 columns per term and a
  strided view, at any length of self-attention (the CPU kernel now; float32 per head through oneDNN).

Shapes are those of DeBERTa-v3 (12 heads x 64, 256 position buckets, 512 max distance, the centred window of
R = 2T - 1 table rows the encoder passes, c2p and p2c): ``BxT`` from ``--shapes`` (default 8x128, the issue's
offline v3-base shape; 11x40 and 32x32, served sentence batches; 8x512 where only ``by_rows`` applies, so
``by_shift`` shows ``-``). Per shape and dtype (float32, bfloat16): every kernel's output is checked against the
reference (bit for bit; ``by_diagonals``, whose scale rides on the table, within rounding), then ``--repeats``
rounds run the kernels in turn; medians in ms and each kernel's speed-up over the reference are printed.
"""

from __future__ import annotations

import math

from . import harness
from .onnx_ops import BUCKETS, HEAD_SIZE, HEADS, MAX_POSITION  # the same DeBERTa-v3 op shapes


def _inputs(batch: int, seq: int, dtype):
    import torch

    from relserve.models import relative_position as rp

    g = torch.Generator().manual_seed(batch * 1000 + seq)
    rows = min(2 * seq - 1, 2 * BUCKETS)
    q, k = (torch.randn(batch, HEADS, seq, HEAD_SIZE, generator=g).to(dtype) for _ in range(2))
    pq, pk = (torch.randn(HEADS, rows, HEAD_SIZE, generator=g).to(dtype) for _ in range(2))
    rel = rp.log_bucket_relative_position_reference(seq, seq, BUCKETS, MAX_POSITION)
    return (q, k, pq, pk, rel, BUCKETS, 1 / math.sqrt(HEAD_SIZE * 3), True, True)


def main(argv: list[str] | None = None) -> int:
    import torch

    from relserve.models import relative_position as rp

    ap = harness.parser("relpos", __doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="8x128,11x40,32x32,8x512", help="comma-separated BxT (default %(default)s)")
    harness.add_common_args(ap, threads=2, threads_help="torch intra-op threads (default 2)",
                            repeats=20, repeats_help="timed rounds per shape and dtype (default 20)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernels = {"reference": rp.disentangled_attention_bias_reference,
               "by_rows": rp.disentangled_attention_bias_by_rows,
               "by_shift": rp.disentangled_attention_bias_by_shift,
               "by_diagonals": rp.disentangled_attention_bias_by_diagonals}
    # by_diagonals scales the table before the sum: equal within rounding, not bit for bit
    close = {"by_diagonals": {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=6e-2)}}
    print(f"disentangled attention bias, {HEADS} heads x {HEAD_SIZE}, {BUCKETS} buckets, torch {torch.__version__}, "
          f"{args.threads} threads; median ms over {args.repeats} rounds (speed-up over the reference)")
    for shape in args.shapes.split(","):
        batch, seq = (int(x) for x in shape.lower().split("x"))
        for dtype in (torch.float32, torch.bfloat16):
            inputs = _inputs(batch, seq, dtype)
            with torch.inference_mode():
                want = kernels["reference"](*inputs)
                live = {}
                for name, fn in kernels.items():
                    out = fn(*inputs)
                    if out is None:  # by_shift: the index is not linear in the distance at this length
                        continue
                    same = (torch.allclose(out, want, **close[name][dtype]) if name in close
                            else torch.equal(out, want))
                    if not same:
                        raise SystemExit(f"{name} differs from the reference at {shape} {dtype}")
                    live[name] = fn
                paths = {name: (lambda fn=fn: fn(*inputs).contiguous()) for name, fn in live.items()}
                times = harness.interleaved(paths, args.repeats)
            med = {name: t * 1000 for name, t in harness.medians(times).items()}
            cells = [f"{name} {med[name]:7.2f} ({harness.fmt_ratio(harness.ratio(med['reference'], med[name]))})"
                     if name in med
                     else f"{name} {'-':>7s}        " for name in kernels]
            print(f"  {shape:>6s} {str(dtype).replace('torch.', ''):9s} " + "  ".join(cells), flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
