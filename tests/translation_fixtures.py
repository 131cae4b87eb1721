"""A tiny random RNNsearch translation checkpoint for serving tests (about a second to build).

Two SentencePiece models trained on a few hundred German/English sentences of ../shared/data (or, when
that is absent, on the load-test sample committed under loadtest/data, or on built-in sentences), a
seeded random RNNsearch with small sizes, written with ``save_translation_checkpoint``. The weights are
random, so outputs are gibberish, but they are deterministic and exercise every code path.
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED_TRANSLATION = REPO.parent / "shared" / "data" / "translation"
FALLBACK = [
    ("Guten Morgen.", "Good morning."), ("Wie geht es dir?", "How are you?"),
    ("Das Wetter ist heute schön.", "The weather is nice today."), ("Ich habe keine Zeit.", "I have no time."),
    ("Der Zug kommt um acht Uhr an.", "The train arrives at eight o'clock."),
    ("Wir sehen uns morgen im Büro.", "See you tomorrow at the office."),
]


def sentence_pairs(limit: int = 400) -> list[tuple[str, str]]:
    for path in (SHARED_TRANSLATION / "de_en_train.jsonl", SHARED_TRANSLATION / "de_en_dev.jsonl",
                 REPO / "loadtest" / "data" / "de_en_dev.jsonl"):
        if path.is_file():
            rows = []
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        r = json.loads(line)
                        rows.append((r["source"], r.get("target", r["source"])))
                    if len(rows) >= limit:
                        break
            if rows:
                return rows
    return FALLBACK * 20


def make_tiny_checkpoint(out_dir: Path, *, seed: int = 0, hidden: int = 24, vocab: int = 160,
                         encoder: str = "bigru") -> Path:
    import torch

    from relserve.models.rnnsearch import RNNSearchConfig
    from relserve.models.translation_checkpoint import (
        TranslationTokenizer, build_translation_model, save_translation_checkpoint, train_sentencepiece,
    )

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pairs = sentence_pairs()
    spm_dir = out_dir / "_spm"
    src = train_sentencepiece([s for s, _ in pairs], spm_dir / "source.spm", vocab)
    tgt = train_sentencepiece([t for _, t in pairs], spm_dir / "target.spm", vocab)
    tok = TranslationTokenizer(src, tgt)
    enc_cfg = None
    kw = {}
    if encoder == "deberta":
        from relserve.models.config import DebertaConfig

        enc_cfg = DebertaConfig(vocab_size=tok.source_vocab_size, hidden_size=2 * hidden, num_hidden_layers=1,
                                num_attention_heads=2, intermediate_size=4 * hidden, max_position_embeddings=512,
                                type_vocab_size=0, relative_attention=True, position_buckets=32,
                                max_relative_positions=-1, pos_att_type=["p2c", "c2p"], position_biased_input=False)
        kw = {"encoder_type": "external", "annotation_size": 2 * hidden}
    cfg = RNNSearchConfig(src_vocab_size=tok.source_vocab_size, tgt_vocab_size=tok.target_vocab_size,
                          embedding_size=hidden, hidden_size=hidden, alignment_size=hidden, maxout_size=hidden // 2,
                          **kw)
    torch.manual_seed(seed)
    model = build_translation_model(cfg, enc_cfg).eval()
    with torch.no_grad():  # sharper distributions than the default init, so EOS wins sometimes
        model.decoder.output_proj.weight.mul_(8.0)
    save_translation_checkpoint(model, tok, out_dir)
    for p in spm_dir.iterdir():
        p.unlink()
    spm_dir.rmdir()
    return out_dir
