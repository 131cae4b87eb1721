"""The int8 recipe (models/onnx/quantize.py) on a hand-made graph with the weight sharing our exports have at real
sizes: one initializer read by a ``Gemm(transB=1)`` and by a ``Transpose`` feeding a MatMul (``share_att_key``).
ONNX Runtime's quantizer transposes a Gemm's weight in place, so without untying the other reader silently got
the transposed (square) weight; quantized, both branches must stay within int8 error of float32. On a CPU without
VNNI (AVX2) the same graph with full-range weights comes out 29 % wrong (u8 x s8 pair sums saturate int16), which
the recipe's reduce_range avoids, so this also pins that choice there."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from relserve.models.onnx.quantize import _untie_weights, quantize_graph  # noqa: E402
from relserve.models.onnx.runtime import GRAPH_NAME, METADATA_CHECKPOINT, REPORT_DIGESTS, REPORT_NAME  # noqa: E402

D = 16


def _shared_weight_graph(w: np.ndarray):
    nodes = [helper.make_node("Gemm", ["x", "W", "b"], ["gemm"], transB=1),  # x @ W.T + b
             helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "Wt"], ["mm"])]  # x @ W.T
    g = helper.make_graph(nodes, "shared", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", D])],
                          [helper.make_tensor_value_info("gemm", TensorProto.FLOAT, ["n", D]),
                           helper.make_tensor_value_info("mm", TensorProto.FLOAT, ["n", D])],
                          [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.zeros(D, np.float32), "b")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    entry = model.metadata_props.add()
    entry.key, entry.value = METADATA_CHECKPOINT, "c" * 64
    return model


def _run(model_bytes, x):
    return ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"]).run(None, {"x": x})


def test_shared_gemm_weights_are_untied_before_quantizing(tmp_path, caplog):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((D, D)) * 0.3).astype(np.float32)  # square: a transposed copy still fits
    x = rng.standard_normal((32, D)).astype(np.float32)
    want = x @ w.T
    model = _shared_weight_graph(w)
    untied = onnx.ModelProto()
    untied.CopyFrom(model)
    assert _untie_weights(untied) == 1  # the Transpose of W became an initializer
    assert not [n for n in untied.graph.node if n.op_type == "Transpose"]
    for got in _run(untied.SerializeToString(), x):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    caplog.set_level(logging.INFO)
    report = quantize_graph(model.SerializeToString(), tmp_path, checkpoint_sha256="c" * 64)
    # ORT's quantizer logs a line per tensor on the root logger; the server's log must not get them
    assert not [r for r in caplog.records if "onnxruntime" in r.pathname], caplog.text[-2000:]
    assert report["quantization"]["untied_weights"] == 1 and report["quantization"]["quantized_matmuls"] == 2
    graph = (tmp_path / GRAPH_NAME).read_bytes()
    scale = np.abs(want).max()
    for got in _run(graph, x):  # both branches x @ W.T within int8 error (untied: the MatMul branch would be x @ W)
        assert np.abs(got - want).max() / scale < 0.05
    assert np.abs(x @ w - want).max() / scale > 0.5  # what the untied-away bug computed is far outside that
    on_disk = json.loads((tmp_path / REPORT_NAME).read_text())
    assert on_disk[REPORT_DIGESTS] == report[REPORT_DIGESTS] and set(on_disk[REPORT_DIGESTS]) == {GRAPH_NAME}
    metadata = {p.key: p.value for p in onnx.load_from_string(graph).metadata_props}
    assert metadata[METADATA_CHECKPOINT] == "c" * 64


def test_a_graph_of_another_checkpoint_is_not_quantized(tmp_path):
    model = _shared_weight_graph(np.eye(D, dtype=np.float32))
    with pytest.raises(ValueError, match="records checkpoint cccccccccccc..., not dddddddddddd..."):
        quantize_graph(model.SerializeToString(), tmp_path, checkpoint_sha256="d" * 64)
