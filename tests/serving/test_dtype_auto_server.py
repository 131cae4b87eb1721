"""``dtype: auto`` through a real server on tiny checkpoints: the bfloat16-vs-float32 agreement gate at load, the
dtype it chose and why in ListModels, and that the chosen model is the one that serves.

CPUs without AVX512-BF16 / AMX-BF16 (this project's CI machines) resolve auto to float32 without a gate, so the
gate is exercised under ``RELSERVE_CPU_BF16=assume`` (service/cpu_features.py): torch computes bfloat16 on any CPU,
emulated. Oracles: our own float32 model and an independent bfloat16 copy of it, run here on the same texts.
"""

from __future__ import annotations

import copy
import json
import re
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fixtures.deberta import make_deberta_checkpoint, make_near_tied_classifier  # noqa: E402
from fixtures.fake_serving import server_config  # noqa: E402
from fixtures.server import Running  # noqa: E402
from fixtures.translation import make_tiny_checkpoint  # noqa: E402
from relserve.models.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from relserve.models.onednn import set_onednn_linear  # noqa: E402
from relserve.service._proto import inference_pb2 as pb  # noqa: E402
from relserve.service.backends.precision import LOADTEST_DATA  # noqa: E402
from relserve.service.config import ModelConfig  # noqa: E402
from relserve.service.cpu_features import CPU_BF16_ENV  # noqa: E402
from relserve.service.registry import build_runner  # noqa: E402

TEXTS = ["the film was a delight", "a dull, lifeless mess of a movie", "ok", "I would not buy it again."]
_NUMBERS = re.compile(r"(\d+) items of (\S+): agreement ([\d.]+) \(needs >= ([\d.]+)\), max probability difference "
                      r"(\S+) \(limit ([\d.]+)\)")


def _write(d, model, tok_dir):
    save_checkpoint(model, model.config, d, tokenizer_dir=tok_dir)
    return d


def _confident(root, tok_dir):
    """A classifier whose decisions are far from ties: the two label rows are opposite, so the margin is twice
    the first logit (bfloat16 moves it by well under the smallest margin on the committed sentences)."""
    model = make_deberta_checkpoint(root / "confident", tokenizer_dir=tok_dir, labels=("negative", "positive"),
                                    init="matrices", seed=1).model
    with torch.no_grad():
        model.classifier.weight[1] = -model.classifier.weight[0]
        model.classifier.bias[1] = -model.classifier.bias[0]
    return _write(root / "confident", model, tok_dir), model


def _near_tied(root, tok_dir):
    """float32 splits the labels; in bfloat16 (8 significant bits) they flip on about half the texts."""
    d = root / "tied"
    return d, make_near_tied_classifier(d, tok_dir, _sentences()[:64])


def _sentences():
    return [json.loads(line)["text"] for line in open(LOADTEST_DATA / "sentiment_dev.jsonl", encoding="utf-8")]


def _probs(model, tokenizer, texts, dtype):
    out = []
    # computed as the torch backend computes on CPU (torch_onednn): the near-tied classifier turns the last bits of
    # its pooled features into its label, so an oracle summing in another order would differ by more than rounding
    set_onednn_linear(model, True)
    with torch.inference_mode():
        m = model if dtype is torch.float32 else copy.deepcopy(model).to(dtype)
        for t in texts:
            ids = torch.tensor([tokenizer.encode(t).input_ids])
            logits = m(input_ids=ids, attention_mask=torch.ones_like(ids))
            logits = logits[0] if isinstance(logits, (tuple, list)) else logits
            out.append(torch.softmax(logits[0].float(), -1).numpy())
    return np.array(out)


def _numbers(reason):
    m = _NUMBERS.search(reason)
    assert m, reason
    n, source, agreement, need, diff, limit = m.groups()
    return int(n), source.rstrip(":"), float(agreement), float(need), float(diff), float(limit)


@pytest.fixture(scope="module")
def served(tmp_path_factory, unigram_tokenizer_dir):
    root = tmp_path_factory.mktemp("dtype-auto")
    confident, confident_model = _confident(root, unigram_tokenizer_dir)
    tied, tied_model = _near_tied(root, unigram_tokenizer_dir)
    few = root / "few"
    shutil.copytree(confident, few)
    (few / "calibration.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    # compute in-process: worker processes have their own tests (test_worker_process.py, test_worker_pool.py)
    common = dict(device="cpu", max_seq_len=128, max_queue_delay=0.002, worker_process=False)
    configs = [ModelConfig(name="confident", path=confident, **common),  # dtype: auto is the default
               ModelConfig(name="tied", path=tied, **common),
               ModelConfig(name="no-warmup", path=confident, warmup=False, **common),
               ModelConfig(name="few-texts", path=few, **common),
               ModelConfig(name="pinned", path=confident, dtype="float32", **common)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CPU_BF16_ENV, "assume")
        s = Running(server_config(), [build_runner(c) for c in configs])
        try:
            s.wait_serving(timeout=300)
            yield s, {"confident": confident_model, "tied": tied_model}, load_checkpoint(confident).tokenizer
        finally:
            s.close()


def test_a_confident_checkpoint_passes_the_gate_and_serves_bfloat16(served):
    s, models, tokenizer = served
    info = {m.name: m for m in s.stub.ListModels(pb.ListModelsRequest(), timeout=10).models}["confident"]
    assert info.dtype == "bfloat16", info.dtype_reason
    assert info.dtype_reason.startswith(f"dtype: auto -> bfloat16: {CPU_BF16_ENV}=assume")
    assert "agreement gate passed on" in info.dtype_reason
    n, source, agreement, need, diff, limit = _numbers(info.dtype_reason)
    assert (n, source, need, limit) == (256, str(LOADTEST_DATA / "sentiment_dev.jsonl"), 0.99, 0.05)
    assert agreement >= 0.99 and diff <= 0.05
    # the bfloat16 copy serves: its scores, not the float32 model's (one text per request: a batch of one, as
    # the oracle runs it; bfloat16 sums differ with the batch's padding)
    got = np.array([[{ls.label: ls.score for ls in r.labels}[k] for k in ("negative", "positive")]
                    for t in TEXTS for r in s.stub.Classify(pb.ClassifyRequest(model="confident", texts=[t],
                                                                                top_k=0), timeout=60).results])
    bf16 = _probs(models["confident"], tokenizer, TEXTS, torch.bfloat16)
    fp32 = _probs(models["confident"], tokenizer, TEXTS, torch.float32)
    np.testing.assert_allclose(got, bf16, atol=1e-6)
    assert np.abs(got - fp32).max() > 1e-5


def test_a_checkpoint_that_bfloat16_flips_falls_back_to_float32_and_says_why(served):
    s, models, tokenizer = served
    info = {m.name: m for m in s.stub.ListModels(pb.ListModelsRequest(), timeout=10).models}["tied"]
    assert info.dtype == "float32", info.dtype_reason
    assert "but bfloat16 failed the agreement gate on" in info.dtype_reason
    n, source, agreement, _, diff, _ = _numbers(info.dtype_reason)
    # the reported agreement is the fraction of the committed sentences whose label bfloat16 keeps (oracle: the
    # float32 model and a bfloat16 copy of it, here)
    texts = _sentences()[:n]
    assert source == str(LOADTEST_DATA / "sentiment_dev.jsonl")
    fp32, bf16 = (_probs(models["tied"], tokenizer, texts, dt) for dt in (torch.float32, torch.bfloat16))
    assert agreement == pytest.approx(float(np.mean(fp32.argmax(1) == bf16.argmax(1))), abs=5e-5)
    assert agreement < 0.9 and diff == pytest.approx(float(np.abs(fp32 - bf16).max()), abs=1e-3)
    # ... and the float32 model serves
    reply = s.stub.Classify(pb.ClassifyRequest(model="tied", texts=TEXTS, top_k=0), timeout=60)
    got = np.array([[{ls.label: ls.score for ls in r.labels}[k] for k in ("negative", "positive")]
                    for r in reply.results])
    np.testing.assert_allclose(got, _probs(models["tied"], tokenizer, TEXTS, torch.float32), atol=1e-5)


def test_without_warmup_or_gate_text_auto_stays_float32(served):
    s, _, _ = served
    info = {m.name: m for m in s.stub.ListModels(pb.ListModelsRequest(), timeout=10).models}
    assert info["no-warmup"].dtype == "float32"
    assert "warm-up is disabled (warmup: false)" in info["no-warmup"].dtype_reason
    assert info["few-texts"].dtype == "float32"
    assert "no usable agreement-gate text (at least 200 items needed)" in info["few-texts"].dtype_reason
    assert "calibration.jsonl has only 4 usable items" in info["few-texts"].dtype_reason
    assert (info["pinned"].dtype, info["pinned"].dtype_reason) == ("float32", "dtype: float32 configured")


def test_auto_without_native_bfloat16_is_float32_and_says_so(tmp_path, monkeypatch, unigram_tokenizer_dir):
    d, _ = _confident(tmp_path, unigram_tokenizer_dir)
    monkeypatch.setenv(CPU_BF16_ENV, "off")  # as on a CPU without AVX512-BF16 / AMX-BF16, whatever this one has
    r = build_runner(ModelConfig(name="m", path=d, device="cpu", max_seq_len=64, worker_process=False))  # reads .model
    r.load()
    assert (r.meta.dtype, r.info().dtype) == ("float32", "float32")
    assert r.info().dtype_reason == f"dtype: auto -> float32: {CPU_BF16_ENV}=off (CPU bfloat16 support switched off)"
    assert next(r.backend.model.parameters()).dtype == torch.float32


def test_translation_gate_compares_greedy_tokens(tmp_path, monkeypatch):
    d = make_tiny_checkpoint(tmp_path / "tr", seed=3)
    monkeypatch.setenv(CPU_BF16_ENV, "assume")
    r = build_runner(ModelConfig(name="tr", path=d, device="cpu", max_output_tokens=24))
    r.load()
    n, source, agreement, need, diff, limit = _numbers(r.info().dtype_reason)
    assert (n, source) == (256, str(LOADTEST_DATA / "de_en_dev.jsonl"))
    passed = agreement >= need and diff <= limit
    assert r.info().dtype == ("bfloat16" if passed else "float32")
    assert next(r.backend.model.parameters()).dtype == (torch.bfloat16 if passed else torch.float32)
    assert r.backend.stepper.model is r.backend.model
