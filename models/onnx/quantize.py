"""int8 graphs for the ONNX Runtime encoder backend (``dtype: int8``): dynamic quantization of an exported float32
encoder graph with ``onnxruntime.quantization.quantize_dynamic``.

What is quantized: the weights of the graph's ``MatMul`` nodes whose second input is a constant and of its
``Gemm`` nodes (the dynamo exporter writes both for the Linear layers: QKV, attention output, FFN, the relative
position projections, pooler, classifier), one scale per output channel, to signed int8 (``QInt8``, 7-bit range
below); their activations
are quantized to uint8 per tensor at run time (``DynamicQuantizeLinear`` -> ``MatMulInteger``). Left in float32:
activation x activation products (attention scores and context, ``MatMulConstBOnly``: quantizing softmax
probabilities costs accuracy and saves nothing), embeddings (``Gather``), LayerNorm, and the relative-position
work, which lives in ``com.relserve`` nodes whose bodies are model-local functions the quantizer does not enter,
so the custom ops reach the quantized graph unchanged (``op_types_to_quantize`` names MatMul and Gemm only).

Recipe: per-channel weights with ``reduce_range`` (7-bit weights, -63..63). On a CPU without VNNI (AVX2 only, like
this project's AMD EPYC build machine) MLAS's u8s8 kernels sum pairs of u8 x s8 products in int16
(``vpmaddubsw``), which saturates with full-range weights: measured with ONNX Runtime 1.31.1 there, one random
16x16 MatMul (weights N(0, 0.3^2), activations N(0, 1)) came out with a max relative error of 29 % with
full-range per-tensor weights, 35 % per-channel, 1.2 % with reduce_range and 1.1 % with both
(``tests/onnx/test_onnx_quantize.py`` runs that graph); on ``defaults/sentiment`` (6 x 384, trained; 128
committed sentences, batch 1) per-channel + reduce_range kept 0.984 of the labels with a max probability
difference of 0.18, full-range per-tensor 0.984 with 0.35. ONNX Runtime recommends reduce_range for non-VNNI
CPUs; on a VNNI CPU (AVX512-VNNI / AVX-VNNI: one instruction per 4-byte dot product, no int16 step) it costs a
little precision and nothing else. Speed on that machine, batch 1, one thread: float32 graph 31-35 sentences/s,
int8 about 50 (measure with ``python -m relserve.loadtest.bench.onnx_encoder --dtype int8``).

Output: ``out_dir/model.onnx`` (the graph keeps the float32 graph's metadata, so it still names the checkpoint
it came from) and ``export_report.json`` recording the recipe, the float32 graph's sha256 and the sha256 of the
file written (``file_sha256``), which the server verifies exactly as for float32 graphs
(``service/backends/graph_cache.py``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from .runtime import GRAPH_NAME, METADATA_CHECKPOINT, REPORT_DIGESTS, REPORT_NAME

QUANTIZED_OPS = ("MatMul", "Gemm")
# The cache entry of an int8 graph is ``<checkpoint sha256>-<CACHE_VARIANT>``: bump the suffix when the recipe
# below changes, so graphs quantized the old way are not served.
CACHE_VARIANT = "int8-q1"
RECIPE: dict[str, Any] = {"weight_type": "QInt8", "activation_type": "QUInt8 (dynamic)",
                          "op_types_to_quantize": list(QUANTIZED_OPS), "per_channel": True,
                          "reduce_range": True, "MatMulConstBOnly": True}


class _QuantizerChatter(logging.Filter):
    """ONNX Runtime's quantizer logs on the root logger itself: an INFO line per tensor without given
    quantization parameters and a WARNING advising a pre-processing step that does not apply to dynamic
    quantization of these graphs. Keep its errors, drop the rest (a filter on the root logger sees only records
    logged on the root logger, so the server's own loggers are untouched)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or "onnxruntime" not in record.pathname


def _untie_weights(proto) -> int:
    """Give every weight the quantizer rewrites a consumer of its own; returns how many initializers were added.

    ``quantize_dynamic`` turns ``Gemm(transB=1)`` into ``MatMul`` + ``Add`` by transposing the Gemm's weight
    initializer in place, so any other node reading the same initializer then reads the transposed tensor. Our
    exported graphs have exactly that at real sizes: with ``share_att_key`` a layer's ``key_proj.weight`` feeds the
    Gemm of the relative-position table and a ``Transpose`` for the hidden states' MatMul (the exporter folds
    that Transpose only for small tensors), so a square 384 x 384 weight silently came out transposed for one of
    them (on ``defaults/sentiment``, quantize_dynamic quantizing nothing changed the label of 29 of 128 committed
    sentences).
    Here a ``Transpose`` of an initializer becomes an initializer (the transposed copy), and a Gemm input still
    shared with another node gets its own copy, before the quantizer runs.
    """
    from onnx import numpy_helper

    g = proto.graph
    inits = {i.name: i for i in g.initializer}
    added = 0
    for node in list(g.node):
        if node.op_type == "Transpose" and len(node.input) == 1 and node.input[0] in inits:
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
            value = numpy_helper.to_array(inits[node.input[0]]).transpose(perm)
            g.initializer.append(numpy_helper.from_array(value.copy(), node.output[0]))
            g.node.remove(node)
            added += 1
    inits = {i.name: i for i in g.initializer}
    uses: dict[str, int] = {}
    for node in g.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    for node in g.node:
        if node.op_type != "Gemm":
            continue
        for k, name in enumerate(node.input):
            if name in inits and uses[name] > 1:
                copy = numpy_helper.from_array(numpy_helper.to_array(inits[name]).copy(), f"{name}.{node.name}")
                g.initializer.append(copy)
                node.input[k] = copy.name
                uses[name] -= 1
                added += 1
    return added


def quantize_graph(graph: bytes, out_dir: str | os.PathLike, *, checkpoint_sha256: str) -> dict[str, Any]:
    """Quantize the float32 encoder graph ``graph`` (serialized bytes, as the server verified them) into
    ``out_dir/model.onnx`` and write ``out_dir/export_report.json``; returns the report.

    Raises:
        ValueError: the graph records another checkpoint than ``checkpoint_sha256`` in its metadata.
        RuntimeError: the quantizer left no MatMul quantized (nothing to gain; the graph is not what the exporter
            writes).
    """
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from . import ops as onnx_ops
    from .export import file_digests

    proto = onnx.load_from_string(graph)
    metadata = {p.key: p.value for p in proto.metadata_props}
    if metadata.get(METADATA_CHECKPOINT, checkpoint_sha256) != checkpoint_sha256:
        raise ValueError(f"the float32 graph records checkpoint {metadata[METADATA_CHECKPOINT][:12]}..., not "
                         f"{checkpoint_sha256[:12]}...")
    untied = _untie_weights(proto)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / GRAPH_NAME
    chatter = _QuantizerChatter()
    logging.getLogger().addFilter(chatter)
    try:
        quantize_dynamic(proto, target, op_types_to_quantize=list(QUANTIZED_OPS), per_channel=RECIPE["per_channel"],
                         reduce_range=RECIPE["reduce_range"], weight_type=QuantType.QInt8,
                         extra_options={"MatMulConstBOnly": RECIPE["MatMulConstBOnly"]})
    finally:
        logging.getLogger().removeFilter(chatter)
    quantized = onnx.load(os.fspath(target))
    # the quantizer keeps metadata_props on the versions tested; set them either way so provenance always holds
    kept = {p.key: p.value for p in quantized.metadata_props}
    if kept != {**kept, **metadata, METADATA_CHECKPOINT: checkpoint_sha256}:
        del quantized.metadata_props[:]
        for key, value in {**kept, **metadata, METADATA_CHECKPOINT: checkpoint_sha256}.items():
            entry = quantized.metadata_props.add()
            entry.key, entry.value = key, value
        onnx.save(quantized, os.fspath(target))
    integer = sum(n.op_type in ("MatMulInteger", "DynamicQuantizeMatMul") for n in quantized.graph.node)
    if not integer:
        raise RuntimeError("onnxruntime.quantization.quantize_dynamic quantized no MatMul of the graph")
    report: dict[str, Any] = {
        "checkpoint_sha256": checkpoint_sha256,
        "dtype": "int8",
        "quantization": dict(RECIPE, untied_weights=untied, quantized_matmuls=integer,
                             float32_matmuls=sum(n.op_type == "MatMul" for n in quantized.graph.node)),
        "float32_graph_sha256": hashlib.sha256(graph).hexdigest(),
        "custom_ops": sorted({n.op_type for n in quantized.graph.node if n.domain == onnx_ops.DOMAIN}),
        "graph_bytes": target.stat().st_size,
        REPORT_DIGESTS: file_digests(out),
    }
    (out / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report
