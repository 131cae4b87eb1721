"""Tokenizer training: relserve's DeBERTa Unigram ``tokenizer.json`` recipe, translation's SentencePiece models,
and the command line that trains relserve's own Unigram tokenizer on the shared English text.

:func:`train_unigram_tokenizer` is the one recipe for a DeBERTa tokenizer directory (NFKC or NFC pipeline,
DeBERTa template and special ids ``[PAD]=0 [CLS]=1 [SEP]=2 [UNK]=3 [MASK]=4``, deterministic output; the
command line below, the test fixtures and the load test use it); :func:`train_sentencepiece` makes the
``source.spm`` / ``target.spm`` models of a translation checkpoint. Both write what
:mod:`relserve.models.tokenization` loads. The command line only chooses the corpus (:func:`corpus_lines`)
and writes the directory:

    python -m relserve.models.training.tokenizer --data ../shared/data --out tok --vocab-size 8000
"""

from __future__ import annotations

import argparse
import io
import json
import os
from pathlib import Path
from typing import Iterable, Iterator

from relserve.models.tokenization import SPECIAL_IDS

# DeBERTa-v3's special tokens, in id order: [PAD]=0 [CLS]=1 [SEP]=2 [UNK]=3 [MASK]=4
UNIGRAM_SPECIAL_TOKENS = ("[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]")
# what tokenizer_config.json / special_tokens_map.json name them (DeBERTa-v3's convention: BOS = CLS, EOS = SEP)
SPECIAL_TOKENS_MAP = {"bos_token": "[CLS]", "eos_token": "[SEP]", "cls_token": "[CLS]", "sep_token": "[SEP]",
                      "pad_token": "[PAD]", "unk_token": "[UNK]", "mask_token": "[MASK]"}
UNICODE_FORMS = ("NFKC", "NFC")


def train_unigram_tokenizer(
    lines: Iterable[str],
    out_dir: str | os.PathLike,
    vocab_size: int = 8000,
    model_max_length: int = 512,
    unicode_form: str = "NFKC",
    max_piece_length: int = 16,
) -> Path:
    """Train a SentencePiece-style Unigram tokenizer on ``lines`` and write a tokenizer directory.

    The directory holds ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` and
    loads with :func:`relserve.models.tokenization.load_tokenizer` and with transformers'
    ``AutoTokenizer.from_pretrained``. Pipeline: whitespace runs and single ``\\n \\r \\t`` -> one space,
    Unicode normalisation, strip right; Metaspace ``▁`` pre-tokenizer (prefix space always); Unigram model
    (``tokenizers`` ``UnigramTrainer``, pieces of at most ``max_piece_length`` characters); DeBERTa template
    ``[CLS] A [SEP] (B [SEP])`` with type ids 0/1; special ids as in DeBERTa-v3 (``UNIGRAM_SPECIAL_TOKENS``).

    ``unicode_form``:

    * ``"NFKC"`` (relserve's own tokenizers): NFKC before the whitespace step, so compatibility characters
      (ligatures, full-width letters) fold first. ``tokenizer_class`` is ``PreTrainedTokenizerFast`` on
      purpose: transformers 5 rebuilds a ``DebertaV2Tokenizer`` from the vocabulary alone (NFC, its own
      normaliser), which would drop the NFKC step; the generic class uses ``tokenizer.json`` as written.
    * ``"NFC"``: exactly the pipeline transformers 5 ``DebertaV2Tokenizer`` rebuilds (whitespace, NFC,
      strip right), declared as ``DebertaV2Tokenizer`` (``do_lower_case`` false), so transformers reads it
      with its DeBERTa tokenizer class (the test fixtures and random load-test checkpoints).

    Deterministic for a given ``lines`` and size: the ``tokenizers`` Unigram trainer sums floats in hash-map
    order (last-bit jitter between runs, and a different order among equal scores), so piece scores are
    rounded to 1e-8 and pieces after the specials are sorted by (score descending, piece) before saving;
    the same input gives the same bytes. Returns the directory's path.

    Raises:
        ValueError: ``unicode_form`` is not one of ``UNICODE_FORMS``.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    if unicode_form not in UNICODE_FORMS:
        raise ValueError(f"unicode_form {unicode_form!r}: expected one of {UNICODE_FORMS}")
    whitespace = normalizers.Replace(Regex(r"\s{2,}|[\n\r\t]"), " ")
    strip = normalizers.Strip(left=False, right=True)
    steps = [normalizers.NFKC(), whitespace] if unicode_form == "NFKC" else [whitespace, normalizers.NFC()]
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence([*steps, strip])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size,
        special_tokens=list(UNIGRAM_SPECIAL_TOKENS),
        unk_token="[UNK]",
        max_piece_length=max_piece_length,
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer)
    for i, t in enumerate(UNIGRAM_SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 1), ("[SEP]", 2)],
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(_canonical_unigram_json(tok.to_str()), encoding="utf-8")
    special_map = dict(SPECIAL_TOKENS_MAP)
    if unicode_form == "NFKC":
        config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    else:
        config = {"tokenizer_class": "DebertaV2Tokenizer", "do_lower_case": False}
    config.update({
        "model_max_length": model_max_length,
        "padding_side": "right",
        "truncation_side": "right",
        "model_input_names": ["input_ids", "token_type_ids", "attention_mask"],
        **special_map,
    })
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n", encoding="utf-8")
    return out


def _canonical_unigram_json(serialized: str) -> str:
    """Round scores and order pieces canonically (see :func:`train_unigram_tokenizer`); specials keep 0..4."""
    data = json.loads(serialized)
    vocab = [(p, round(float(sc), 8)) for p, sc in data["model"]["vocab"]]
    n = len(UNIGRAM_SPECIAL_TOKENS)
    assert tuple(p for p, _ in vocab[:n]) == UNIGRAM_SPECIAL_TOKENS
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
    data["model"]["unk_id"] = UNIGRAM_SPECIAL_TOKENS.index("[UNK]")
    return json.dumps(data, ensure_ascii=False, indent=2) + "\n"

def train_sentencepiece(
    texts: Iterable[str],
    model_path: str | os.PathLike,
    vocab_size: int,
    model_type: str = "unigram",
    character_coverage: float = 1.0,
    seed_sentencepiece_size: int = 200_000,
) -> str:
    """Train a SentencePiece model on ``texts`` and write it to ``model_path`` (a single ``.spm`` file).

    Special ids ``pad=0 bos=1 eos=2 unk=3``; one thread and no sentence sampling, so the same texts give
    the same model. Returns ``model_path``."""
    import sentencepiece as spm

    lines = [t.replace("\n", " ").strip() for t in texts]
    lines = [t for t in lines if t]
    if not lines:
        raise ValueError("train_sentencepiece: no text")
    model_path = os.fspath(model_path)
    os.makedirs(os.path.dirname(os.path.abspath(model_path)), exist_ok=True)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=buf,
        model_type=model_type,
        vocab_size=vocab_size,
        character_coverage=character_coverage,
        pad_id=SPECIAL_IDS["pad"],
        bos_id=SPECIAL_IDS["bos"],
        eos_id=SPECIAL_IDS["eos"],
        unk_id=SPECIAL_IDS["unk"],
        pad_piece="<pad>",
        bos_piece="<s>",
        eos_piece="</s>",
        unk_piece="<unk>",
        num_threads=1,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        seed_sentencepiece_size=seed_sentencepiece_size,
        minloglevel=2,
    )
    with open(model_path, "wb") as f:
        f.write(buf.getvalue())
    return model_path


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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m relserve.models.training.tokenizer",
        description="Command line of relserve's own SentencePiece-style Unigram tokenizer: train it on the shared "
                    "English text.")
    p.add_argument("--data", default="../shared/data", help="shared data directory (sentiment/, qa/, topics/)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--model-max-length", type=int, default=512)
    a = p.parse_args(argv)
    out = train_unigram_tokenizer(corpus_lines(a.data), a.out, a.vocab_size, a.model_max_length)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
