"""Shared test fixtures.

Tokenizer fixtures (session-scoped, trained in about a second from ../shared/data, or from the repo's
copy of it when ../shared is absent):

* ``unigram_tokenizer_dir`` — a small Unigram ``tokenizer.json`` (``tokenizers`` library) whose pipeline
  equals what transformers 5 ``DebertaV2Tokenizer`` rebuilds (NFC, whitespace runs -> " ", strip right,
  Metaspace prepend "always"), TemplateProcessing ``[CLS] $A [SEP]`` / ``[CLS] $A [SEP] $B:1 [SEP]:1``,
  special ids ``[PAD]=0 [CLS]=1 [SEP]=2 [UNK]=3 [MASK]=4``, ``model_max_length`` 512.
* ``spm_tokenizer_dir`` — a small ``spm.model`` (``sentencepiece`` library, Unigram, ``[PAD]=0 [CLS]=1
  [SEP]=2 [UNK]=3 [MASK]=4`` as in DeBERTa-v3) plus ``tokenizer_config.json`` with the huge
  ``model_max_length`` placeholder DeBERTa-v3 configs carry (C08).

Both load with ``transformers.AutoTokenizer.from_pretrained(dir)`` (tokenizer_class DebertaV2Tokenizer).
"""

from __future__ import annotations

import ast
import io
import json
import os
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
SPECIALS = ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"]


def _jsonl(path: Path, limit: int | None = None) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
            if limit is not None and len(rows) >= limit:
                break
    return rows


def qa_rows(name: str) -> list[dict]:
    """Rows of ../shared/data/qa/<name>, with ``answers`` parsed to a list of dicts."""
    rows = _jsonl(SHARED_DATA / "qa" / name)
    for r in rows:
        if isinstance(r.get("answers"), str):
            r["answers"] = ast.literal_eval(r["answers"])
    return rows


def _training_lines() -> list[str]:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} not found (tokenizer fixtures train on the shared data)")
    lines = [r["text"] for r in _jsonl(SHARED_DATA / "sentiment" / "train.jsonl", 400)]
    for r in _jsonl(SHARED_DATA / "qa" / "xquad_en_train.jsonl", 60):
        lines += [r["context"], r["question"]]
    lines += [r["source"] for r in _jsonl(SHARED_DATA / "translation" / "de_en_train.jsonl", 200)]
    for r in _jsonl(SHARED_DATA / "qa" / "xquad_zh_sample.jsonl", 6):
        lines.append(r["context"])
    return lines


def _write_config(directory: Path, extra: dict) -> None:
    cfg = {
        "tokenizer_class": "DebertaV2Tokenizer",
        "do_lower_case": False,
        "bos_token": "[CLS]",
        "eos_token": "[SEP]",
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "mask_token": "[MASK]",
        **extra,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")


@pytest.fixture(scope="session")
def unigram_tokenizer_dir(tmp_path_factory) -> Path:
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers, decoders

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence(
        [
            normalizers.Replace(Regex(r"\s{2,}|[\n\r\t]"), " "),
            normalizers.NFC(),
            normalizers.Strip(left=False, right=True),
        ]
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(
        vocab_size=1200, special_tokens=SPECIALS, unk_token="[UNK]", show_progress=False, max_piece_length=12
    )
    tok.train_from_iterator(_training_lines(), trainer=trainer)
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    d = tmp_path_factory.mktemp("unigram_tok")
    tok.save(str(d / "tokenizer.json"))
    _write_config(d, {"model_max_length": 512})
    return d


@pytest.fixture(scope="session")
def spm_tokenizer_dir(tmp_path_factory) -> Path:
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_training_lines()),
        model_writer=buf,
        model_type="unigram",
        vocab_size=1200,
        character_coverage=0.995,
        pad_id=0,
        pad_piece="[PAD]",
        bos_id=1,
        bos_piece="[CLS]",
        eos_id=2,
        eos_piece="[SEP]",
        unk_id=3,
        unk_piece="[UNK]",
        control_symbols=["[MASK]"],
        num_threads=1,
        minloglevel=2,
    )
    d = tmp_path_factory.mktemp("spm_tok")
    (d / "spm.model").write_bytes(buf.getvalue())
    _write_config(d, {"vocab_type": "spm", "model_max_length": int(1e30)})
    return d


@pytest.fixture(scope="session")
def hf_tokenizer():
    """Factory: transformers AutoTokenizer for a directory (the oracle), cached per directory."""
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    cache: dict[str, object] = {}

    def get(directory) -> object:
        key = os.fspath(directory)
        if key not in cache:
            cache[key] = AutoTokenizer.from_pretrained(key)
        return cache[key]

    return get
