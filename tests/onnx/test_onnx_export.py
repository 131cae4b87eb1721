"""ONNX export of tiny random checkpoints: parity of the graph (ONNX Runtime CPU, portable custom-op functions)
with our torch model and with the transformers DebertaV2 oracle, for a v3-style classifier (C01, C02) and a
v2-style QA model with token types; the T5-bias configuration; graph structure (custom-domain nodes, local
functions, declared inputs only, dynamic axes); the ``relserve export`` CLI."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers")

from fixtures.deberta import make_deberta_checkpoint  # noqa: E402
from relserve.models.onnx import ops as onnx_ops  # noqa: E402
from relserve.models.checkpoint import load_checkpoint  # noqa: E402
from relserve.models.onnx.export import export_checkpoint
from relserve.models.onnx.runtime import GRAPH_NAME, make_session  # noqa: E402
from relserve.service.backends.onnx_encoder import OnnxBackend  # noqa: E402
from relserve.service.backends.torch_encoder import TorchBackend  # noqa: E402
from relserve.service.config import ModelConfig  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def v3(unigram_tokenizer_dir, tmp_path_factory):
    """C01's model: a v3-style classifier (position_buckets 256, no token types), exported from 8 tokens."""
    root = tmp_path_factory.mktemp("v3")
    hf = make_deberta_checkpoint(root, version="v3", oracle=True, tokenizer_dir=unigram_tokenizer_dir, labels=3,
                                 init="spread", seed=0).model
    result = export_checkpoint(root, root / "onnx", progress=None)
    return hf, root, result


@pytest.fixture(scope="module")
def v2qa(tmp_path_factory):
    root = tmp_path_factory.mktemp("v2qa")
    hf = make_deberta_checkpoint(root, task="question-answering", version="v2", oracle=True, vocab_size=97,
                                 init="spread", seed=1).model
    return hf, root, export_checkpoint(root, root / "onnx", progress=None)


def _batch(lengths, vocab, seed, types=False):
    g = np.random.default_rng(seed)
    T = max(lengths)
    ids = np.zeros((len(lengths), T), dtype=np.int64)
    mask = np.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, :n] = g.integers(5, vocab, n)
        mask[b, :n] = 1
    feeds = {"input_ids": ids, "attention_mask": mask}
    if types:
        feeds["token_type_ids"] = (np.arange(T)[None, :] >= np.array(lengths)[:, None] // 2).astype(np.int64) * mask
    return feeds


def _hf(hf, feeds):
    with torch.no_grad():
        out = hf(**{k: torch.from_numpy(v) for k, v in feeds.items()})
    return [out.logits.numpy()] if hasattr(out, "logits") else [out.start_logits.numpy(), out.end_logits.numpy()]


def _ours(model, feeds):
    with torch.inference_mode():
        out = model(*(torch.from_numpy(v) for v in feeds.values()))
    return [out.numpy()] if isinstance(out, torch.Tensor) else [o.numpy() for o in out]


def _close(a, b, lengths, qa):
    for x, y in zip(a, b):
        for i, n in enumerate(lengths):
            xi, yi = (x[i, :n], y[i, :n]) if qa else (x[i], y[i])
            assert np.max(np.abs(xi - yi)) <= TOL, f"item {i} (len {n}) differs by {np.max(np.abs(xi - yi))}"


def test_case_C01_exported_graph_does_not_freeze_sequence_maths(v3):
    hf, root, result = v3
    report = result.report
    assert report["parity"]["passed"]
    lengths_seen = [c["lengths"] for c in report["parity"]["cases"]]
    assert [3] in lengths_seen and [40] in lengths_seen and [300] in lengths_seen
    assert any(sorted(c) == [3, 40, 137, 300] for c in lengths_seen)  # the padded batch of all
    assert json.loads((root / "onnx" / "export_report.json").read_text())["parity"]["passed"]
    sess = make_session(result.graph)
    ours = load_checkpoint(root, load_tokenizer=False).model
    vocab = hf.config.vocab_size
    for k, lengths in enumerate(([3], [40], [300], [3, 40, 300])):
        feeds = _batch(lengths, vocab, seed=k)
        got = sess.run(None, feeds)
        _close(got, _ours(ours, feeds), lengths, qa=False)
        _close(got, _hf(hf, feeds), lengths, qa=False)


def test_graph_structure(v3):
    _, _, result = v3
    m = onnx.load(result.graph)
    assert [i.name for i in m.graph.input] == ["input_ids", "attention_mask"] == result.inputs
    assert [o.name for o in m.graph.output] == ["logits"]
    for i in m.graph.input:
        assert [d.dim_param for d in i.type.tensor_type.shape.dim] == ["batch", "sequence"]
    custom = [n.op_type for n in m.graph.node if n.domain == onnx_ops.DOMAIN]
    assert custom.count("LogBucketRelativePosition") == 1 and custom.count("DisentangledAttentionBias") == 2
    assert {f.name for f in m.functions if f.domain == onnx_ops.DOMAIN} == {"LogBucketRelativePosition",
                                                                            "DisentangledAttentionBias"}
    opsets = {o.domain: o.version for o in m.opset_import}
    assert opsets[""] >= 17 and opsets[onnx_ops.DOMAIN] == 1
    onnx.checker.check_model(result.graph, full_check=True)


def test_case_C02_only_declared_inputs(v3):
    """type_vocab_size=0 but the tokenizer emits token_type_ids: both backends answer the same, and type ids
    0 -> 1 change nothing."""
    _, root, _ = v3
    torch_be = TorchBackend(ModelConfig(name="t", path=root, device="cpu", max_seq_len=64))
    onnx_be = OnnxBackend(ModelConfig(name="o", path=root, device="cpu", backend="onnx", max_seq_len=64))
    torch_be.load()
    onnx_be.load()  # finds root/onnx/model.onnx, no export
    assert onnx_be.graph == root / "onnx" / "model.onnx"
    enc = onnx_be.meta.tokenizer.encode("Hello, my dog is cute")
    ones = dataclasses.replace(enc, token_type_ids=[1] * len(enc.input_ids))
    a, b = torch_be.run([enc])[0], onnx_be.run([enc])[0]
    assert int(np.argmax(a)) == int(np.argmax(b))
    np.testing.assert_allclose(a, b, atol=TOL)
    np.testing.assert_allclose(onnx_be.run([ones])[0], b, atol=0)
    np.testing.assert_allclose(torch_be.run([ones])[0], a, atol=0)


def test_v2_qa_with_token_types_matches_torch_and_transformers(v2qa):
    hf, root, result = v2qa
    assert result.inputs == ["input_ids", "attention_mask", "token_type_ids"]
    assert result.outputs == ["start_logits", "end_logits"] and result.report["parity"]["passed"]
    sess = make_session(result.graph)
    ours = load_checkpoint(root, load_tokenizer=False).model
    for k, lengths in enumerate(([5], [600, 7, 300, 1])):  # 600 > max_relative_positions, < 640 positions
        feeds = _batch(lengths, 97, seed=k, types=True)
        got = sess.run(None, feeds)
        _close(got, _ours(ours, feeds), lengths, qa=True)
        _close(got, _hf(hf, feeds), lengths, qa=True)


def test_t5_relative_bias_encoder_exports(tmp_path):
    model = make_deberta_checkpoint(tmp_path / "ckpt", version="v3", labels=2, init="spread", seed=3,
                                    relative_attention_type="t5", relative_attention_num_buckets=32,
                                    relative_attention_max_distance=128, norm_rel_ebd="none").model
    assert tuple(model.deberta.encoder.relative_attention_bias.weight.shape) == (32, 4)
    assert load_checkpoint(tmp_path / "ckpt", load_tokenizer=False).config.relative_attention_type == "t5"
    result = export_checkpoint(tmp_path / "ckpt", tmp_path / "onnx", progress=None)
    assert result.report["parity"]["passed"], result.report["parity"]
    assert result.report["custom_ops"] == ["RelativePositionBias"]

    # CUDA: the T5 node is re-homed to ONNX Runtime's com.microsoft.RelativePositionBias, inputs and attributes
    # unchanged (the contrib schema's names: bias_table, query_length, key_length; max_distance, is_bidirectional)
    proto = onnx.load(result.graph)
    assert onnx_ops.to_cuda_contrib_ops(proto) == 1
    (node,) = [n for n in proto.graph.node if n.op_type == "RelativePositionBias"]
    assert node.domain == "com.microsoft" and len(node.input) == 3
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs == {"max_distance": 128, "is_bidirectional": 1}
    assert any(o.domain == "com.microsoft" and o.version == 1 for o in proto.opset_import)
    schema = {(x.name, x.domain): x for x in ort.capi._pybind_state.get_all_operator_schema()}
    contrib = schema[("RelativePositionBias", "com.microsoft")]
    assert [i.name for i in contrib.inputs] == ["bias_table", "query_length", "key_length"]
    assert set(contrib.attributes) == set(attrs)
    # asking for CUDA where it cannot start (this machine) falls back to the graph as exported, same numbers
    sess = make_session(result.graph, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    feeds = _batch([9, 200], 97, seed=5, types=False)
    cpu = make_session(result.graph).run(None, feeds)
    got = sess.run(None, feeds)
    if "CUDAExecutionProvider" in sess.get_providers():  # a GPU machine: the contrib kernel ran
        np.testing.assert_allclose(got[0], cpu[0], atol=1e-4)
    else:
        np.testing.assert_array_equal(got[0], cpu[0])


def test_export_cli_errors(tmp_path, capsys):
    """The CLI path itself (a full export through it is what ``export_checkpoint`` above does)."""
    import argparse

    from relserve.models.onnx.cli import add_arguments
    from relserve.service.main import main

    args = add_arguments(argparse.ArgumentParser()).parse_args(["ckpt", "out", "--opset", "17", "--no-parity"])
    assert (args.checkpoint, args.out, args.opset, args.no_parity) == ("ckpt", "out", 17, True)
    assert main(["export", str(tmp_path), str(tmp_path / "out")]) == 2  # not a checkpoint
    assert "config.json" in capsys.readouterr().err


def test_export_opsets_and_out_dir_errors(tmp_path, capsys):
    """Newer opsets export with parity (the local functions import the model's opset); impossible ones and an
    OUT_DIR under a file are refused with a message, not a traceback."""
    from relserve.models.onnx.cli import main as export_main

    ckpt = make_deberta_checkpoint(tmp_path / "ckpt", version="v3", labels=2, init="spread", seed=4).path
    for opset in (17, 20):
        result = export_checkpoint(ckpt, tmp_path / f"o{opset}", opset=opset, progress=None)
        graph = onnx.load(result.graph)
        assert result.report["opset"] == opset and result.report["parity"]["passed"]
        assert [o.version for o in graph.opset_import if o.domain == ""] == [opset]
        assert {o.version for f in graph.functions for o in f.opset_import if o.domain == ""} == {opset}
    for bad in ("99", "24", "16"):  # 24: beyond what torch's exporter declares (it would silently give 18)
        assert export_main([str(ckpt), str(tmp_path / "o99"), "--opset", bad]) == 2
        assert f"opset {bad}: need 17..23" in capsys.readouterr().err and not (tmp_path / "o99").exists()
    assert export_main([str(tmp_path / "nothing"), str(tmp_path / "o-bad")]) == 2
    assert not (tmp_path / "o-bad").exists()  # a bad checkpoint creates nothing
    meta = {p.key: p.value for p in onnx.load(tmp_path / "o20" / "model.onnx").metadata_props}
    assert meta["relserve.checkpoint_sha256"] == json.loads((tmp_path / "o20" / "export_report.json").read_text())[
        "checkpoint_sha256"]
    (tmp_path / "afile").write_text("x")
    assert export_main([str(ckpt), str(tmp_path / "afile" / "sub")]) == 2
    assert "cannot create OUT_DIR" in capsys.readouterr().err


def test_parity_tolerance_scales_with_large_logits(tmp_path, unigram_tokenizer_dir):
    """A correct graph whose logits reach ~40 (the classifier's weights scaled up): with the same tight atol the
    export's parity check and the server's load-time self-check pass with rtol and fail with rtol=0; report and
    refusals name atol, rtol, max |diff| and max |diff|/(atol + rtol*|ref|)."""
    from relserve.models.checkpoint import save_checkpoint
    from relserve.models.onnx.export import PARITY_RTOL, ExportParityError, parity_report
    from relserve.service.backends.graph_cache import GraphMismatch

    raw = make_deberta_checkpoint(tmp_path / "raw", version="v3", labels=2, init="spread", seed=4,
                                  tokenizer_dir=unigram_tokenizer_dir).path
    loaded = load_checkpoint(raw, load_tokenizer=False)
    feeds = {"input_ids": np.array([[1, 5, 9, 2], [1, 40, 41, 2]]), "attention_mask": np.ones((2, 4), dtype=np.int64)}

    def logits():
        with torch.inference_mode():
            return loaded.model(*(torch.from_numpy(v) for v in feeds.values())).numpy()

    with torch.no_grad():  # scale the head so the logits reach ~40, as a trained classifier's can
        scale = 40.0 / float(np.abs(logits()).max())
        loaded.model.classifier.weight.mul_(scale)
        loaded.model.classifier.bias.mul_(scale)
    assert 30 < np.abs(logits()).max() < 50  # the point of the test: outputs far from order 1
    ckpt = tmp_path / "big"
    save_checkpoint(loaded.model, loaded.config, ckpt, tokenizer_dir=unigram_tokenizer_dir)
    result = export_checkpoint(ckpt, ckpt / "onnx", progress=None)
    p = result.report["parity"]
    assert p["passed"] and p["rtol"] == PARITY_RTOL == 1e-4 and p["atol"] == p["tolerance"] == 1e-4
    assert {"atol", "rtol", "max_abs_diff", "max_scaled_diff"} <= set(p)
    assert all({"max_abs_diff", "max_scaled_diff"} <= set(c) for c in p["cases"])
    assert json.loads((ckpt / "onnx" / "export_report.json").read_text())["parity"] == p
    worst = p["max_abs_diff"]
    assert worst > 0
    tight = worst / 2  # an atol the absolute differences exceed
    session = make_session(result.graph)
    relative = parity_report(result.graph, loaded.model, loaded.config, loaded.task, session=session,
                             tolerance=tight, rtol=1e-4)
    absolute = parity_report(result.graph, loaded.model, loaded.config, loaded.task, session=session,
                             tolerance=tight, rtol=0.0)
    assert relative["passed"] and relative["max_scaled_diff"] <= 1.0
    assert not absolute["passed"] and absolute["max_scaled_diff"] == pytest.approx(2.0, rel=1e-6)
    assert absolute["max_abs_diff"] == relative["max_abs_diff"] == worst
    with pytest.raises(ExportParityError, match=r"max \|diff\| .*max \|diff\|/\(atol \+ rtol\*\|ref\|\) 2 "
                                                r"\(atol .*, rtol 0\)"):
        export_checkpoint(ckpt, tmp_path / "refused", progress=None, atol=tight, rtol=0.0)

    # the server's self-check on the warm-up batch (the graph in ckpt/onnx, no export)
    def backend(**tol):
        return OnnxBackend(ModelConfig(name="big", path=ckpt, device="cpu", backend="onnx", max_seq_len=64, **tol))

    be = backend()
    be.load()
    assert be.graph == ckpt / "onnx" / GRAPH_NAME and 0 < be.parity_diff < 1e-3
    warm = be.parity_diff
    backend(onnx_parity_tolerance=warm / 2, onnx_parity_rtol=1e-4).load()  # passes only through rtol
    with pytest.raises(GraphMismatch, match=r"differs from the torch checkpoint .* max \|diff\|/\(atol \+ "
                                            r"rtol\*\|ref\|\) 2 \(atol .*, rtol 0\); refusing to serve it"):
        backend(onnx_parity_tolerance=warm / 2, onnx_parity_rtol=0.0).load()


@pytest.mark.parametrize("task", ["classification", "question-answering"])
def test_exported_graph_passes_strict_shape_inference(tmp_path, task):
    """onnx strict shape inference and the full checker accept the graph, and ONNX Runtime's ``quantize_dynamic``
    (which rewrites weights, then runs strict shape inference) quantizes it: no value_info repeats an initializer
    (a graph that had them failed there with "existing shape differ in dimension 0: (32) vs (2)"); labels !=
    hidden size so a transposed shape shows."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    ckpt = make_deberta_checkpoint(tmp_path / "ckpt", task=task, version="v3", labels=2, init="spread", seed=4).path
    result = export_checkpoint(ckpt, tmp_path / "onnx", progress=None, parity=False)
    model = onnx.load(result.graph)
    inits = {i.name for i in model.graph.initializer}
    assert not [vi.name for vi in model.graph.value_info if vi.name in inits]
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, check_type=True)
    onnx.checker.check_model(inferred, full_check=True)
    out = {o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in inferred.graph.output}
    assert out == ({"logits": ["batch", 2]} if task == "classification"
                   else {"start_logits": ["batch", "sequence"], "end_logits": ["batch", "sequence"]})
    quantize_dynamic(result.graph, tmp_path / "q.onnx", weight_type=QuantType.QInt8)
    feeds = {"input_ids": np.array([[1, 5, 9, 2, 7]]), "attention_mask": np.ones((1, 5), dtype=np.int64)}
    want = make_session(result.graph).run(None, feeds)
    got = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"]).run(None, feeds)
    assert [g.shape for g in got] == [w.shape for w in want] and all(np.isfinite(g).all() for g in got)
