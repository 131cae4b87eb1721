"""The training data mix of the translation CLI (the variations people type) and continuing from a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fixtures.translation import sentence_pairs, tiny_translation_model
from relserve.models.checkpoint import save_translation_checkpoint
from relserve.models.tokenization import TranslationTokenizer
from relserve.models.training.translation import (
    dev_variant,
    main as train_main,
    mix_variants,
    strip_final_punct,
)

REPO = Path(__file__).resolve().parents[2]
TOKENIZERS = REPO / "defaults" / "translate-de-en"


def test_strip_final_punct():
    assert strip_final_punct("Guten Morgen.") == "Guten Morgen"
    assert strip_final_punct("Was?!") == "Was"
    assert strip_final_punct("Ja ! ") == "Ja"
    assert strip_final_punct("Hallo, du") == "Hallo, du"
    assert strip_final_punct("z.B. 3.5") == "z.B. 3.5"
    assert strip_final_punct("...") == "..."  # nothing but punctuation: kept rather than emptied


def test_dev_variants():
    pairs = [("Wo ist der Bahnhof?", "Where is the station?"), ("Danke!", "Thanks!")]
    assert dev_variant(pairs, "written") == pairs
    assert dev_variant(pairs, "nopunct") == [("Wo ist der Bahnhof", "Where is the station"), ("Danke", "Thanks")]
    assert dev_variant(pairs, "lower") == [("wo ist der bahnhof", "Where is the station"), ("danke", "Thanks")]
    with pytest.raises(ValueError, match="shout"):
        dev_variant(pairs, "shout")


def test_mix_variants_rates_and_determinism():
    pairs = [(f"Das ist Satz Nummer {i}.", f"This is sentence number {i}.") for i in range(3000)]
    pairs += [(f"Hallo{i}!", f"Hello{i}!") for i in range(100)]  # one-word sources
    out, counts = mix_variants(pairs, nopunct=0.4, lower=0.3, short_repeat=2, seed=5)
    assert counts["short_sources"] == 100 and counts["short_copies"] == 200
    assert len(out) == counts["pairs"] == 3300
    n_np = sum(not t.endswith(("." , "!")) for _, t in out)
    n_lc = sum(s[0].islower() for s, _ in out)
    assert (n_np, n_lc) == (counts["no_final_punct"], counts["lower_source"])
    assert 0.36 < n_np / len(out) < 0.44 and 0.26 < n_lc / len(out) < 0.34
    # punctuation goes from both sides together; targets keep their case
    assert all(s.endswith((".", "!")) == t.endswith((".", "!")) for s, t in out)
    assert all(t[0].isupper() for _, t in out)
    again, _ = mix_variants(pairs, nopunct=0.4, lower=0.3, short_repeat=2, seed=5)
    other, _ = mix_variants(pairs, nopunct=0.4, lower=0.3, short_repeat=2, seed=6)
    assert again == out and other != out
    assert mix_variants(pairs, seed=5)[0] == pairs  # no rates: unchanged
    with pytest.raises(ValueError):
        mix_variants(pairs, nopunct=1.5)


def _write_jsonl(path: Path, pairs) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for s, t in pairs:
            f.write(json.dumps({"source": s, "target": t}, ensure_ascii=False) + "\n")
    return str(path)


def _args(tmp_path: Path, train: str, dev: str, run: str, steps: int, *extra: str) -> list[str]:
    return [
        "--train", train, "--dev", dev, "--dev-subset", "4", "--out", str(tmp_path / run / "out"),
        "--state-dir", str(tmp_path / run / "state"), "--lr", "0.01", "--batch-tokens", "400",
        "--max-steps", str(steps), "--eval-every", "0", "--seed", "3", "--no-progress", "--threads", "1",
        "--save-dtype", "float32", *extra,
    ]


def test_continue_from_checkpoint_with_mix_and_resume(tmp_path, capsys):
    """--init-from starts from a checkpoint's weights and tokenizers (step 0 scored on the dev variants),
    the mix is logged, and an interrupted run resumes to the same losses as a straight one."""
    train = _write_jsonl(tmp_path / "train.jsonl", sentence_pairs(40, split="train"))
    dev = _write_jsonl(tmp_path / "dev.jsonl", sentence_pairs(4, split="dev"))
    start = tiny_translation_model(TranslationTokenizer.from_dir(TOKENIZERS), hidden=16)
    save_translation_checkpoint(start, TranslationTokenizer.from_dir(TOKENIZERS), tmp_path / "base" / "out",
                                dtype=torch.float32)

    with pytest.raises(SystemExit, match="--mix-"):  # refused before any model work
        train_main(_args(tmp_path, train, dev, "bad", 1, "--mix-lower", "2"))

    mix = ["--init-from", str(tmp_path / "base" / "out"), "--mix-nopunct", "0.5", "--mix-lower", "0.5",
           "--mix-short-repeat", "1", "--dev-variants", "written,nopunct,lower"]
    capsys.readouterr()
    assert train_main(_args(tmp_path, train, dev, "a", 6, *mix)) == 0
    err = capsys.readouterr().err
    assert "data mix: " in err and "--init-from: weights of" in err
    a = torch.load(tmp_path / "a" / "state" / "state.pt", weights_only=True)
    first = a["history"][0]
    assert first["step"] == 0 and {"written", "nopunct", "lower"} <= set(first)
    assert first["bleu"] == round(sum(first[k]["bleu"] for k in ("written", "nopunct", "lower")) / 3, 2)
    # the continued run started from the checkpoint's weights, not a fresh initialisation
    assert a["spec"]["config"]["embedding_size"] == 16
    info = json.loads((tmp_path / "a" / "out" / "config.json").read_text())["training"]
    assert info["init_from"] == str(tmp_path / "base" / "out")
    assert set(info["dev_variants_greedy"]) == {"written", "nopunct", "lower"}
    moved = [(a["model"][k].float() - v.float()).abs().max() for k, v in start.state_dict().items()]
    assert max(moved) > 0 and max(moved) < 1.0

    assert train_main(_args(tmp_path, train, dev, "b", 3, *mix)) == 0
    assert train_main(_args(tmp_path, train, dev, "b", 6, *mix, "--resume")) == 0
    b = torch.load(tmp_path / "b" / "state" / "state.pt", weights_only=True)
    assert b["step"] == 6
    torch.testing.assert_close(torch.tensor(b["losses"]), torch.tensor(a["losses"]), rtol=1e-4, atol=1e-4)
