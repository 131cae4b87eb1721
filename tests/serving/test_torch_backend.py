"""TorchBackend on a tiny random DeBERTa checkpoint (seconds on CPU): padding invariance (C03), QA
outputs unpadded per item, token_type handling, and the runner+batcher path end to end."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fixtures.deberta import make_deberta_checkpoint  # noqa: E402
from relserve.service.backends.base import TASK_CLASSIFICATION, TASK_QA  # noqa: E402
from relserve.service.backends.torch_encoder import TorchBackend  # noqa: E402
from relserve.service.config import ConfigError, ModelConfig  # noqa: E402
from relserve.service.runner import ModelRunner  # noqa: E402
from relserve.service.tasks.classify import classify  # noqa: E402


@pytest.fixture(scope="module")
def checkpoints(unigram_tokenizer_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    cls_dir = make_deberta_checkpoint(root / "cls", tokenizer_dir=unigram_tokenizer_dir, labels=("a", "b", "c")).path
    qa_dir = make_deberta_checkpoint(root / "qa", task="question-answering", tokenizer_dir=unigram_tokenizer_dir).path
    return cls_dir, qa_dir


def _backend(path, **kw) -> TorchBackend:
    be = TorchBackend(ModelConfig(name="m", path=path, device="cpu", **kw))
    be.load()
    return be


def test_case_C03_padding_invariance(checkpoints):
    be = _backend(checkpoints[0])
    assert be.meta.task == TASK_CLASSIFICATION and be.meta.labels == ("a", "b", "c")
    tok = be.meta.tokenizer
    texts = ["some text", "some longer text", "word " * 600]
    encs = [tok.encode(t, max_length=500) for t in texts]
    assert len(encs[2].input_ids) == 500 and len(encs[0].input_ids) < 10
    solo = [be.run([e])[0] for e in encs]
    batched = be.run(encs)
    for s, b in zip(solo, batched):
        assert s.dtype == np.float32 and s.shape == (3,)
        np.testing.assert_allclose(b, s, atol=1e-4)


def test_qa_outputs_unpadded(checkpoints):
    be = _backend(checkpoints[1], max_seq_len=64, doc_stride=16)
    assert be.meta.task == TASK_QA
    windows = be.meta.tokenizer.qa_windows("who?", "Ann lives in Berlin. " * 20, 64, 16)
    out = be.run(windows)
    assert len(out) == len(windows) >= 2
    for w, (start, end) in zip(windows, out):
        assert start.shape == end.shape == (len(w.input_ids),) and start.dtype == np.float32
    solo = be.run([windows[-1]])[0]
    np.testing.assert_allclose(out[-1][0], solo[0], atol=1e-4)


def test_half_precision_on_cpu_is_a_clear_error(checkpoints, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: half precision is allowed")
    be = TorchBackend(ModelConfig(name="m", path=checkpoints[0], device="auto", dtype="float16"))
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        be.load()
    # bfloat16 on a CPU without native support (forced here whatever this CPU has) names the missing feature
    monkeypatch.setenv("RELSERVE_CPU_BF16", "off")
    be = TorchBackend(ModelConfig(name="m", path=checkpoints[0], device="auto", dtype="bfloat16"))
    with pytest.raises(ConfigError, match="needs a CPU with AVX512-BF16 or AMX-BF16"):
        be.load()


def test_runner_end_to_end_through_batcher(checkpoints):
    async def main():
        cfg = ModelConfig(name="cls", path=checkpoints[0], device="cpu", max_seq_len=128)
        r = ModelRunner(cfg, TorchBackend(cfg))
        await asyncio.to_thread(r.load)
        await r.start()
        try:
            a = asyncio.create_task(classify(r, ["some text"], None, 0, None))
            b = asyncio.create_task(classify(r, ["some longer text", "x y z"], None, 2, None))
            (items_a, _), (items_b, tb) = await asyncio.gather(a, b)
            return items_a, items_b, tb
        finally:
            await r.close()

    items_a, items_b, timings = asyncio.run(main())
    assert len(items_a[0].labels) == 3 and abs(sum(s for _, s in items_a[0].labels) - 1) < 1e-5
    assert [len(i.labels) for i in items_b] == [2, 2]
    assert timings.units == 2 and timings.inference_s > 0


def test_tokenizer_larger_than_the_embedding_table_is_refused(unigram_tokenizer_dir, tmp_path):
    """Ids past vocab_size would fail whole batches (other clients' requests too) at run time: refuse at load."""
    import json

    from relserve.models.checkpoint import CheckpointError, load_checkpoint

    vocab = len(json.loads((unigram_tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"])
    ckpt = make_deberta_checkpoint(tmp_path / "ckpt", tokenizer_dir=unigram_tokenizer_dir, vocab_size=vocab - 10).path
    with pytest.raises(CheckpointError, match=rf"tokenizer has {vocab} tokens but the model's vocab_size is {vocab - 10}"):
        load_checkpoint(ckpt)
    assert load_checkpoint(ckpt, load_tokenizer=False).config.vocab_size == vocab - 10


def test_special_token_id_past_the_embedding_table_is_refused_at_load(unigram_tokenizer_dir, tmp_path):
    """A tokenizer no larger than vocab_size whose post-processor adds a [CLS] id past it: every request (the
    warm-up's first) would fail with ``IndexError: index out of range in self``; the backend's load refuses it
    naming both files and both numbers."""
    import json

    from relserve.models.checkpoint import CheckpointError

    ckpt = make_deberta_checkpoint(tmp_path / "ckpt", tokenizer_dir=unigram_tokenizer_dir).path
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    spec = json.loads((ckpt / "tokenizer.json").read_text())
    assert spec["post_processor"]["type"] == "TemplateProcessing"
    spec["post_processor"]["special_tokens"]["[CLS]"]["ids"] = [vocab + 100]
    (ckpt / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(CheckpointError) as info:
        _backend(ckpt)
    message = str(info.value)
    assert f"{ckpt / 'tokenizer.json'} and {ckpt / 'config.json'}:" in message
    assert f"special token id(s) up to {vocab + 100} (cls_token_id)" in message
    assert f"the model's vocab_size is {vocab}" in message
