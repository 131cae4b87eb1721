"""What one beam-search step of an RNNsearch model costs, piece by piece: the numbers behind iteration- vs
request-level scheduling (:mod:`.translation`).

    python -m relserve.loadtest.bench.decode_step                    # defaults/translate-de-en, 2 threads
    python -m relserve.loadtest.bench.decode_step --threads 1 --source-len 16 --repeats 30

Times, in one process on random source ids of ``--source-len`` tokens (the committed Tatoeba sample averages
about 11 source pieces; medians of ``--repeats`` calls after one untimed call):

* ``model.encode`` for batches of 1, 5, 16 and 45 sources (iteration-level batching encodes the few newcomers
  of each step, request-level a whole group);
* ``model.decode_step`` for 10 to 255 hypotheses (beam 5), and its least-squares line ``a + b x hypotheses``:
  ``a`` is what a step costs whatever its size, the only part that running fewer, fuller steps can save;
* ``apply_step`` (:mod:`relserve.models.decoding`: top-k, EOS and length rules, state gather) per beam at 51
  beams.

It prints the fit and the share of a full (255-hypothesis) step that is fixed: with a share of s, a scheduler that
never runs a step below full size saves at most the fixed part of the extra steps a request-level group takes on
its shrinking tail.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from . import harness

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO / "defaults" / "translate-de-en"
ENCODE_BATCHES = (1, 5, 16, 45)
STEP_HYPOTHESES = (10, 50, 100, 255)
BEAM = 5


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    return 1000 * harness.median_seconds(fn, repeats, warmup=1)


def _sources(model: Any, batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    low = max(cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) + 1
    ids = torch.randint(low, cfg.src_vocab_size, (batch, length), generator=g)
    return ids, torch.ones(batch, length, dtype=torch.bool)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` -> (a, b). Raises ValueError with fewer than two distinct x."""
    if len(set(xs)) < 2:
        raise ValueError("fit_line needs at least two distinct x values")
    b, a = np.polyfit(xs, ys, 1)
    return float(a), float(b)


@torch.inference_mode()
def step_costs(model: Any, source_len: int = 11, repeats: int = 20, seed: int = 0) -> dict[str, Any]:
    """Milliseconds per ``encode`` (by batch), per ``decode_step`` (by hypotheses) with their linear fit, and per
    beam of ``apply_step`` at 51 beams, for ``model`` (an :class:`relserve.models.rnnsearch.RNNSearch` in eval
    mode) on random sources of ``source_len`` tokens."""
    from relserve.models.decode_types import DecodeOptions
    from relserve.models.decoding import apply_step, build_step, start_beams

    encode_ms = {}
    for b in ENCODE_BATCHES:
        ids, mask = _sources(model, b, source_len, seed)
        encode_ms[b] = _median_ms(lambda: model.encode(ids, mask), repeats)
    step_ms = {}
    for n in STEP_HYPOTHESES:
        rows = max(1, n // BEAM)
        ids, mask = _sources(model, rows, source_len, seed)
        state = model.encode(ids, mask)
        index = torch.arange(rows).repeat_interleave(BEAM)[:n]
        if index.numel() < n:
            index = torch.cat([index, torch.zeros(n - index.numel(), dtype=torch.long)])
        g = torch.Generator().manual_seed(seed)
        prev = torch.randint(3, model.config.tgt_vocab_size, (n,), generator=g)
        hidden = torch.randn(n, model.config.hidden_size, generator=g)
        step_ms[n] = _median_ms(lambda: model.decode_step(state, index, prev, hidden), repeats)
    a, b = fit_line([float(n) for n in step_ms], list(step_ms.values()))

    beams_n = 51
    ids, mask = _sources(model, beams_n, source_len, seed)
    state = model.encode(ids, mask)

    def one_apply() -> float:
        beams = start_beams(model, state, [DecodeOptions(beam_size=BEAM)] * beams_n, request_ids=list(range(beams_n)))
        for _ in range(2):  # past the first step, every beam has BEAM live hypotheses
            batch = build_step(beams, state)
            outputs = model.decode_step(batch.encoder, batch.source_index, batch.prev_tokens, batch.prev_hidden)
            t0 = time.perf_counter()
            apply_step(batch, *outputs)
            elapsed = time.perf_counter() - t0
        return elapsed

    one_apply()
    apply_ms = 1000 * statistics.median(one_apply() for _ in range(max(3, repeats // 4))) / beams_n
    full = a + b * STEP_HYPOTHESES[-1]
    return {"source_len": source_len, "encode_ms": encode_ms, "decode_step_ms": step_ms,
            "decode_step_fixed_ms": a, "decode_step_ms_per_hypothesis": b,
            "fixed_share_of_full_step": a / full if full > 0 else float("nan"), "apply_ms_per_beam": apply_ms}


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser("decode_step", __doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="RNNsearch checkpoint directory")
    harness.add_common_args(ap, threads=2, threads_help="torch intra-op threads",
                            repeats=20, repeats_help="timed calls per figure (median)")
    ap.add_argument("--source-len", type=int, default=11, help="source tokens per sentence")
    args = ap.parse_args(argv)
    from relserve.models.checkpoint import load_translation_checkpoint

    torch.set_num_threads(args.threads)
    model = load_translation_checkpoint(args.model)[0].float().eval()
    r = step_costs(model, args.source_len, args.repeats)
    print(f"{args.model.name}: {args.threads} threads, sources of {args.source_len} tokens, medians of "
          f"{args.repeats}")
    print("  encode:      " + ", ".join(f"{b} sources {ms:.2f} ms ({ms / b:.2f} per source)"
                                       for b, ms in r["encode_ms"].items()))
    print("  decode_step: " + ", ".join(f"{n} hyps {ms:.2f} ms" for n, ms in r["decode_step_ms"].items()))
    print(f"  decode_step ~ {r['decode_step_fixed_ms']:.2f} ms + {r['decode_step_ms_per_hypothesis']:.3f} ms x "
          f"hypotheses; fixed share of a {STEP_HYPOTHESES[-1]}-hypothesis step: {r['fixed_share_of_full_step']:.2f}")
    print(f"  apply_step:  {r['apply_ms_per_beam']:.3f} ms per beam at 51 beams of {BEAM}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
