"""models/onnx/runtime.py make_session: a CPU session keeps no per-shape memory patterns (what held a served
encoder's memory as batch shapes changed; loadtest/bench/shape_soak.py --backend onnx measures it), and still
computes the graph on every shape."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from relserve.models.onnx.runtime import make_session


def _add_graph() -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "l"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "l"])
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "double", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def test_cpu_sessions_run_without_memory_patterns_on_any_shape():
    session = make_session(_add_graph())
    assert session.get_session_options().enable_mem_pattern is False
    for shape in ((1, 3), (4, 17), (2, 512)):
        x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
        np.testing.assert_array_equal(session.run(None, {"x": x})[0], 2 * x)
