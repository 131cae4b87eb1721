"""Does bf16 autocast speed up training on this CPU? One training step (forward, backward, AdamW) of the
default models' shapes, fp32 against ``torch.autocast("cpu", torch.bfloat16)``, measured side by side.

    python -m relserve.loadtest.bench.train_autocast [--threads 2] [--repeats 5]

Shapes: the QA/sentiment encoder (DeBERTa-v2 layout, 6 layers x 384, 12 heads, FFN 1536, vocabulary 10k) on a
batch of 16 x 192 tokens, and the RNNsearch translation model (BiGRU 256, vocabulary 6k/6k) on 256 x 14
source/target pieces. Random weights and ids: the cost of a step does not depend on their values. Prints the
CPU's bf16 capability (torch's ``get_cpu_capability`` and the /proc/cpuinfo flags) and, per model, the median
step seconds and the ratio fp32 / bf16 (> 1 means autocast pays). The trainers take ``--autocast bf16``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import torch

from . import harness


def cpu_bf16_flags() -> list[str]:
    """The bf16-related flags in /proc/cpuinfo (``avx512_bf16``, ``amx_bf16``...); empty elsewhere."""
    try:
        text = open("/proc/cpuinfo", encoding="utf-8").read()
    except OSError:
        return []
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    return sorted(f for f in flags if "bf16" in f or f.startswith("amx"))


def _time_steps(step: Callable[[], None], repeats: int) -> float:
    return harness.median_seconds(step, repeats, warmup=1)  # warm-up: allocations, oneDNN primitive creation


def encoder_step(autocast: bool) -> Callable[[], None]:
    from relserve.models.deberta import DebertaConfig, DebertaForQuestionAnswering

    cfg = DebertaConfig.from_dict({
        "model_type": "deberta-v2", "vocab_size": 10000, "hidden_size": 384, "num_hidden_layers": 6,
        "num_attention_heads": 12, "intermediate_size": 1536, "max_position_embeddings": 512, "type_vocab_size": 2,
        "relative_attention": True, "position_buckets": 128, "pos_att_type": ["p2c", "c2p"], "share_att_key": True,
        "norm_rel_ebd": "layer_norm", "position_biased_input": True, "layer_norm_eps": 1e-12,
    })  # fmt: skip
    torch.manual_seed(0)
    model = DebertaForQuestionAnswering(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(5, 10000, (16, 192))
    mask = torch.ones_like(ids)
    ys = torch.randint(0, 192, (16,))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            start, end = model(input_ids=ids, attention_mask=mask)[:2]
            loss = torch.nn.functional.cross_entropy(start.float(), ys) + torch.nn.functional.cross_entropy(end.float(), ys)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def translation_step(autocast: bool) -> Callable[[], None]:
    from relserve.models.rnnsearch import RNNSearch, RNNSearchConfig

    cfg = RNNSearchConfig(src_vocab_size=6000, tgt_vocab_size=6000, embedding_size=256, hidden_size=256,
                          alignment_size=256, maxout_size=256)
    torch.manual_seed(0)
    model = RNNSearch(cfg).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    src = torch.randint(3, 6000, (256, 14))
    tgt = torch.randint(3, 6000, (256, 14))
    src_mask = torch.ones_like(src, dtype=torch.bool)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(src, src_mask, tgt)
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def main(argv: Sequence[str] | None = None) -> int:
    ap = harness.parser("train_autocast", __doc__.split("\n\n")[0])
    harness.add_common_args(ap, threads=2, repeats=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
          f"bf16 flags {cpu_bf16_flags() or 'none'}, threads {args.threads}")
    for name, make in (("encoder 6x384, 16x192", encoder_step), ("rnnsearch bigru 256, 256x14", translation_step)):
        fp32 = _time_steps(make(False), args.repeats)
        bf16 = _time_steps(make(True), args.repeats)
        print(f"{name}: fp32 {fp32:.3f} s/step, bf16 autocast {bf16:.3f} s/step, fp32/bf16 {harness.fmt_ratio(harness.ratio(fp32, bf16))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
