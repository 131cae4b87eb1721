"""CUDA checks: run only where torch and ONNX Runtime both reach a GPU (skipped on CPU machines and in CI).

* the ONNX Runtime encoder backend on ``device=cuda``: the provider in its metadata, IO-bound results equal to
  torch on the CPU;
* a T5-bias encoder on the CUDA provider runs ONNX Runtime's ``com.microsoft.RelativePositionBias`` and matches
  the CPU graph;
* the ONNX Runtime translation backend on CUDA: beam-search tokens equal torch's on the CPU;
* the torch encoder on CUDA in float32 and float16 against the CPU.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")


def _cuda_usable() -> bool:
    if not torch.cuda.is_available() or "CUDAExecutionProvider" not in ort.get_available_providers():
        return False
    import onnx
    from onnx import helper

    node = helper.make_node("Identity", ["x"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    try:
        s = ort.InferenceSession(model.SerializeToString(), providers=["CUDAExecutionProvider"])
    except Exception:
        return False
    return "CUDAExecutionProvider" in s.get_providers()


pytestmark = pytest.mark.skipif(not _cuda_usable(), reason="needs a GPU visible to torch and ONNX Runtime")

from fixtures.deberta import make_deberta_checkpoint  # noqa: E402
from fixtures.translation import make_tiny_checkpoint  # noqa: E402
from relserve.models.onnx.export import export_checkpoint
from relserve.models.onnx.runtime import make_session  # noqa: E402
from relserve.service.config import ModelConfig  # noqa: E402


class _Item:
    def __init__(self, ids):
        self.input_ids = ids
        self.token_type_ids = [0] * len(ids)


def _checkpoint(root, tokenizer_dir=None, **extra):
    """A v3-style classifier (64 log buckets, 3 labels), library init under seed 0: (directory, our model)."""
    tiny = make_deberta_checkpoint(root, tokenizer_dir=tokenizer_dir, labels=3, position_buckets=64, **extra)
    return tiny.path, tiny.model


def test_onnx_backend_on_cuda_matches_torch_cpu(tmp_path, unigram_tokenizer_dir):
    from relserve.service.backends.onnx_encoder import OnnxBackend

    ckpt, model = _checkpoint(tmp_path / "ckpt", unigram_tokenizer_dir)
    be = OnnxBackend(ModelConfig(name="m", path=ckpt, backend="onnx", device="cuda", onnx_cache_dir=tmp_path / "c",
                                 max_seq_len=128))
    meta = be.load()
    assert meta.device == "CUDAExecutionProvider:0" and be.device == "cuda:0"
    batch = [_Item([1, 5, 6, 7, 2]), _Item([1] + [5 + i % 40 for i in range(100)] + [2])]
    got = be.run(batch)
    ids = torch.zeros(2, 102, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, it in enumerate(batch):
        ids[i, : len(it.input_ids)] = torch.tensor(it.input_ids)
        mask[i, : len(it.input_ids)] = 1
    with torch.inference_mode():
        want = model(ids, mask).numpy()
    for i in range(2):
        np.testing.assert_allclose(got[i], want[i], atol=1e-3)


def test_t5_bias_runs_the_contrib_kernel_on_cuda(tmp_path):
    ckpt, _ = _checkpoint(tmp_path / "ckpt", relative_attention_type="t5", relative_attention_num_buckets=32,
                          relative_attention_max_distance=128, norm_rel_ebd="none")
    graph = export_checkpoint(ckpt, tmp_path / "onnx", progress=None, parity=False).graph
    cuda = make_session(graph, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert cuda.get_providers()[0] == "CUDAExecutionProvider"
    rng = np.random.default_rng(0)
    for T in (7, 200):  # past max_exact and past max_distance's buckets
        feeds = {"input_ids": rng.integers(5, 97, (2, T)).astype(np.int64), "attention_mask": np.ones((2, T), np.int64)}
        np.testing.assert_allclose(cuda.run(None, feeds)[0], make_session(graph).run(None, feeds)[0], atol=1e-4)


@pytest.mark.parametrize("encoder", ["bigru", "deberta"])
def test_onnx_translation_backend_on_cuda(tmp_path, encoder):
    from relserve.models.decoding import DecodeOptions, beam_search
    from relserve.models.checkpoint import load_translation_checkpoint
    from relserve.service.backends.onnx_translation import OnnxTranslationBackend

    ckpt = make_tiny_checkpoint(tmp_path / "tr", seed=5, encoder=encoder)
    be = OnnxTranslationBackend(ModelConfig(name="t", path=ckpt, backend="onnx", device="cuda",
                                            onnx_cache_dir=tmp_path / "c"))
    meta = be.load()
    assert meta.device == "CUDAExecutionProvider:0"
    ref, cfg, _ = load_translation_checkpoint(ckpt)
    ids = torch.randint(3, cfg.src_vocab_size, (3, 9))
    ids[:, -1] = cfg.eos_token_id
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 4:] = False
    opts = DecodeOptions(beam_size=4, max_len_cap=12)
    want = [[h.tokens for h in r] for r in beam_search(ref, ids, mask, opts)]
    got = [[h.tokens for h in r] for r in beam_search(be.model, ids, mask, opts)]
    assert got == want


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 2e-2)])
def test_torch_encoder_on_cuda(tmp_path, dtype, tol):
    _, model = _checkpoint(tmp_path / "ckpt")
    ids = torch.randint(5, 97, (3, 300))
    mask = torch.ones_like(ids)
    mask[1, 100:] = 0
    with torch.inference_mode():
        want = model(ids, mask)
        got = model.to("cuda", dtype)(ids.cuda(), mask.cuda()).float().cpu()
    torch.testing.assert_close(got, want, atol=tol, rtol=0)
