"""Random-weight DeBERTa-v2 checkpoints for load tests when no trained model is at hand.

Throughput does not depend on the weights, only on the shape, so a random checkpoint with the default
models' shape (hidden 128, 3 layers, 4 heads, intermediate 512, 64 position buckets) times the serving path
honestly. The tokenizer is a small Unigram ``tokenizer.json`` trained in about a second on the committed
load-test texts with :func:`relserve.models.training.tokenizer.train_unigram_tokenizer` (the NFC pipeline that
transformers' DeBERTa-v2/v3 tokenizer rebuilds: Metaspace, ``[CLS] A [SEP] (B [SEP])``).
"""

from __future__ import annotations

import json
from pathlib import Path

from relserve.models.training.tokenizer import train_unigram_tokenizer

from ..scenarios import german_sources, qa_pairs, sentences


def make_tokenizer(out_dir: Path, vocab_size: int = 4000) -> Path:
    """Train the small load-test tokenizer (see the module doc) into ``out_dir``; returns it."""
    lines = sentences() + [c for q, c in qa_pairs()] + [q for q, c in qa_pairs()] + german_sources()
    return train_unigram_tokenizer(lines, out_dir, vocab_size, model_max_length=512, unicode_form="NFC",
                                   max_piece_length=12)


def make_checkpoint(out_dir: Path, *, task: str = "classification", tokenizer_dir: Path | None = None,
                    hidden: int = 128, layers: int = 3, heads: int = 4, intermediate: int = 512,
                    seed: int = 0) -> Path:
    """Save a random DeBERTa-v2 classifier (labels negative/positive) or QA model to ``out_dir``."""
    import torch

    from relserve.models.checkpoint import save_checkpoint
    from relserve.models.deberta import DebertaConfig
    from relserve.models.deberta import DebertaForQuestionAnswering, DebertaForSequenceClassification

    out_dir = Path(out_dir)
    if tokenizer_dir is None:
        tokenizer_dir = make_tokenizer(out_dir.parent / f"{out_dir.name}-tokenizer")
    vocab = len(json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text())["model"]["vocab"])
    labels = {} if task != "classification" else dict(
        num_labels=2, id2label={"0": "negative", "1": "positive"}, label2id={"negative": 0, "positive": 1})
    cfg = DebertaConfig.from_dict(dict(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=intermediate, max_position_embeddings=512, relative_attention=True,
        position_buckets=64, pos_att_type=["p2c", "c2p"], position_biased_input=False,
        norm_rel_ebd="layer_norm", share_att_key=True, type_vocab_size=0, pad_token_id=0, **labels,
    ))
    torch.manual_seed(seed)
    model = DebertaForSequenceClassification(cfg) if task == "classification" else DebertaForQuestionAnswering(cfg)
    return Path(save_checkpoint(model, cfg, out_dir, tokenizer_dir=tokenizer_dir))
