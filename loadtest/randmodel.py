"""Random-weight DeBERTa-v2 checkpoints for load tests when no trained model is at hand.

Throughput does not depend on the weights, only on the shape, so a random checkpoint with the default
models' shape (hidden 128, 3 layers, 4 heads, intermediate 512, 64 position buckets) times the serving path
honestly. The tokenizer is a small Unigram ``tokenizer.json`` trained in about a second on the committed
load-test texts (same pipeline as DeBERTa-v2/v3's: Metaspace, ``[CLS] A [SEP] (B [SEP])``).
"""

from __future__ import annotations

import json
from pathlib import Path

from .scenarios import german_sources, qa_pairs, sentences

SPECIALS = ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"]


def make_tokenizer(out_dir: Path, vocab_size: int = 4000) -> Path:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence([
        normalizers.Replace(Regex(r"\s{2,}|[\n\r\t]"), " "), normalizers.NFC(),
        normalizers.Strip(left=False, right=True),
    ])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    lines = sentences() + [c for q, c in qa_pairs()] + [q for q, c in qa_pairs()] + german_sources()
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, unk_token="[UNK]",
                                      show_progress=False, max_piece_length=12)
    tok.train_from_iterator(lines, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))],
    )
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {"tokenizer_class": "DebertaV2Tokenizer", "do_lower_case": False, "bos_token": "[CLS]",
           "eos_token": "[SEP]", "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]",
           "unk_token": "[UNK]", "mask_token": "[MASK]", "model_max_length": 512}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    return out_dir


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
