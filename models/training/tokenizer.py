"""Train relserve's own SentencePiece-style Unigram tokenizer (``tokenizers`` library).

Pipeline: NFKC normaliser, whitespace runs -> one space, strip right; Metaspace ``▁`` pre-tokenizer
(prefix space always); Unigram model; DeBERTa template ``[CLS] A [SEP] (B [SEP])`` with type ids 0/1.
Special ids as in DeBERTa-v3: ``[PAD]=0 [CLS]=1 [SEP]=2 [UNK]=3 [MASK]=4``.

The output directory holds ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``
and loads with `relserve.models.tokenization.load_tokenizer` and with transformers'
``AutoTokenizer.from_pretrained``. ``tokenizer_class`` is ``PreTrainedTokenizerFast`` on purpose:
transformers 5 rebuilds a ``DebertaV2Tokenizer`` from the vocabulary alone (NFC, its own normaliser),
which would drop our NFKC step; the generic class uses ``tokenizer.json`` as written.

Training is deterministic for a given corpus and vocabulary size: the corpus is read in a fixed order,
and because the ``tokenizers`` Unigram trainer sums floats in hash-map order (last-bit jitter between
runs, and a different order among equal scores), piece scores are rounded to 1e-8 and pieces after the
specials are sorted by (score descending, piece) before saving, so the same input gives the same bytes.

    python -m relserve.models.training.tokenizer --data ../shared/data --out tok --vocab-size 8000
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Iterable, Iterator

SPECIAL_TOKENS = ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"]


def corpus_lines(data_dir: str | os.PathLike) -> Iterator[str]:
    """The shared English text, in a fixed order: sentiment train texts, QA train contexts (each once)
    and questions, BBC topics train texts (paragraph by paragraph)."""
    data = Path(data_dir)

    def rows(rel: str) -> Iterator[dict]:
        with open(data / rel, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)

    for r in rows("sentiment/train.jsonl"):
        yield r["text"]
    seen: set[str] = set()
    for r in rows("qa/xquad_en_train.jsonl"):
        if r["context"] not in seen:
            seen.add(r["context"])
            yield r["context"]
        yield r["question"]
    for r in rows("topics/train.jsonl"):
        for para in r["text"].split("\n"):
            if para.strip():
                yield para


def train_tokenizer(
    lines: Iterable[str],
    out_dir: str | os.PathLike,
    vocab_size: int = 8000,
    model_max_length: int = 512,
) -> Path:
    """Train on ``lines`` and save the tokenizer directory; returns its path."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.Replace(Regex(r"\s{2,}|[\n\r\t]"), " "),
            normalizers.Strip(left=False, right=True),
        ]
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        unk_token="[UNK]",
        max_piece_length=16,
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 1), ("[SEP]", 2)],
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(_canonical_json(tok.to_str()), encoding="utf-8")
    special_map = {
        "bos_token": "[CLS]",
        "eos_token": "[SEP]",
        "cls_token": "[CLS]",
        "sep_token": "[SEP]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "mask_token": "[MASK]",
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "padding_side": "right",
        "truncation_side": "right",
        "model_input_names": ["input_ids", "token_type_ids", "attention_mask"],
        **special_map,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n", encoding="utf-8")
    return out


def _canonical_json(serialized: str) -> str:
    """Round scores and order pieces canonically (see the module doc); specials keep ids 0..4."""
    data = json.loads(serialized)
    vocab = [(p, round(float(sc), 8)) for p, sc in data["model"]["vocab"]]
    n = len(SPECIAL_TOKENS)
    assert [p for p, _ in vocab[:n]] == SPECIAL_TOKENS
    rest = vocab[n:]
    # The trainer appends required single characters below every learned piece with scores that step
    # down in hash-map order; hand the same score values out in code point order instead.
    floor = min((sc for p, sc in rest if len(p) > 1), default=0.0)
    tail = [(p, sc) for p, sc in rest if len(p) == 1 and sc < floor]
    if tail:
        tail_scores = sorted((sc for _, sc in tail), reverse=True)
        tail_pieces = set(p for p, _ in tail)
        rest = [ps for ps in rest if ps[0] not in tail_pieces]
        rest += list(zip(sorted(tail_pieces), tail_scores))
    data["model"]["vocab"] = vocab[:n] + sorted(rest, key=lambda ps: (-ps[1], ps[0]))
    data["model"]["unk_id"] = SPECIAL_TOKENS.index("[UNK]")
    return json.dumps(data, ensure_ascii=False, indent=2) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="../shared/data", help="shared data directory (sentiment/, qa/, topics/)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--model-max-length", type=int, default=512)
    a = p.parse_args(argv)
    out = train_tokenizer(corpus_lines(a.data), a.out, a.vocab_size, a.model_max_length)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
