"""Command line of relserve's own SentencePiece-style Unigram tokenizer: train it on the shared English text.

The recipe (NFKC pipeline, DeBERTa template and special ids ``[PAD]=0 [CLS]=1 [SEP]=2 [UNK]=3 [MASK]=4``,
deterministic output) is :func:`relserve.models.tokenization.train_unigram_tokenizer`; this module only
chooses the corpus (:func:`corpus_lines`) and writes the directory.

    python -m relserve.models.training.tokenizer --data ../shared/data --out tok --vocab-size 8000
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Iterator

from relserve.models.tokenization import train_unigram_tokenizer


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
    p = argparse.ArgumentParser(prog="python -m relserve.models.training.tokenizer", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="../shared/data", help="shared data directory (sentiment/, qa/, topics/)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--model-max-length", type=int, default=512)
    a = p.parse_args(argv)
    out = train_unigram_tokenizer(corpus_lines(a.data), a.out, a.vocab_size, a.model_max_length)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
