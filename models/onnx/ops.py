"""The ONNX faces of the relative-position custom ops: schemas, exporter translations, portable functions.

Domain ``com.relserve`` version 1 holds three ops. Each op has

* a torch reference (``*_reference`` in :mod:`relserve.models.relative_position`, plain tensor code) that the
  eager model runs through a ``torch.library.custom_op`` (``torch.ops.relserve.*``) with a fake kernel, so that
  ``torch.export`` sees one opaque node per op instead of the index arithmetic behind it;
* an ONNX schema registered with ``onnx.defs.register_schema`` (:func:`register_schemas`; inputs, outputs,
  attributes, type and shape inference) and a translation for the dynamo exporter
  (:func:`custom_translation_table`) that emits the op as a single node of this domain;
* a portable implementation: :func:`add_local_functions` puts one ``FunctionProto`` per op into the exported
  model (same domain and name), written in standard ONNX ops, so any ONNX Runtime inlines it and runs the
  graph with no extra library. A native kernel library (``models/onnx/native``, ``make onnx-native``), when
  registered, takes the nodes of the ops in :data:`NATIVE_KERNELS` instead: LogBucketRelativePosition and
  RelativePositionBias, whose kernels beat the functions in the op-level benchmark
  (``python -m relserve.loadtest.bench.onnx_ops``, DeBERTa-v3-base shapes, CPU fp32, 2 threads, native:portable
  time 0.08 / 0.06 and 0.29 / 0.33 at 8x128 / 8x512). DisentangledAttentionBias has no kernel: the C++ one
  measured 2.33 / 5.54 against the function (then MatMul + GatherElements) and was removed, so that op always
  runs its portable function. That function now gathers whole rows of B·n floats (see its body): 11.3 -> 8.2-8.8
  ms at 8x128 and 184 -> 130-134 ms at 8x512 in the same benchmark (the gathers themselves 60-100 -> 9 ms at
  8x512; what is left is mostly the two Transposes into and one out of that layout). Both of the kept ops run once per forward on [Tq, Tk]; the saving is well under 1 ms
  (8x128) to a few ms (8x512) per forward.

Ops (shapes: B batch, n heads, d head size, Tq/Tk query/key length, R rows of a relative table):

``LogBucketRelativePosition(query_length, key_length) -> relative_pos``
    Int64 scalars in, Int64[Tq, Tk] out: ``δ(i, j) = i - j``, and with ``bucket_size > 0`` and
    ``max_position > 0`` the DeBERTa-v2 log buckets of :func:`relserve.models.relative_position.
    make_log_bucket_position` (exact up to ``bucket_size // 2``, logarithmic beyond).
    Attributes: ``bucket_size`` (int, default -1), ``max_position`` (int, default -1).

``DisentangledAttentionBias(query_layer, key_layer, pos_query?, pos_key?, relative_pos) -> bias``
    The c2p and p2c terms of DeBERTa's disentangled attention (He et al. 2021, eq. 4), summed and scaled::

        idx[i, j]  = clamp(clamp(relative_pos[i, j] + att_span, 0, 2·att_span - 1) - offset, 0, R - 1)
        bias[b,h,i,j] = scale · ( c2p · query_layer[b,h,i]·pos_key[h, idx[i,j]]
                                + p2c · key_layer[b,h,j]·pos_query[h, idx[i,j]] )

    query_layer Float[B, n, Tq, d], key_layer Float[B, n, Tk, d], pos_query / pos_key Float[n, R, d] (the
    projected relative table, split into heads), relative_pos Int64[Tq, Tk] (signed, bucketed) ->
    Float[B, n, Tq, Tk]. ``pos_*`` hold R <= 2·att_span consecutive rows of the 2·att_span-row table centred
    on row ``att_span``: input row r is table row ``r + offset`` with ``offset = att_span - R // 2`` (R =
    2·att_span passes the whole table). For self-attention this is exactly the reference's
    ``gather(c2p, c2p_pos)`` plus ``gather(p2c, p2c_pos)ᵀ``: ``p2c_pos[j, i] = clamp(att_span - δ(j, i))``
    equals ``idx[i, j]`` because bucketed distances are odd (``δ(j, i) = -δ(i, j)``).
    Attributes: ``att_span`` (int), ``scale`` (float, ``1/sqrt(d·s)``), ``c2p`` / ``p2c`` (int 0/1; the
    matching ``pos_key`` / ``pos_query`` input must be present when set).

``RelativePositionBias(bias_table, query_length, key_length) -> bias``
    T5 relative position bias (Raffel et al. 2020) with the interface of ONNX Runtime's
    ``com.microsoft.RelativePositionBias``: bias_table Float[num_buckets, num_heads], Int64 scalar lengths
    -> Float[1, num_heads, Tq, Tk], ``bias[0, h, i, j] = bias_table[bucket(j - i), h]`` with the bucket
    function of transformers' ``T5Attention._relative_position_bucket`` (bidirectional: half the buckets per
    sign; exact below ``num_buckets' // 2``, logarithmic up to ``max_distance``, one bucket beyond).
    Attributes: ``max_distance`` (int), ``is_bidirectional`` (int 0/1).

Function bodies are specialised to the attribute values found in the model (an exported model has one set
per op; :func:`add_local_functions` checks that and refuses a mix), with float constants computed here in
float32 exactly as the torch code computes them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from .. import relative_position  # noqa: F401  registers the torch.ops.relserve.* custom ops the translations map

DOMAIN = "com.relserve"
DOMAIN_VERSION = 1
OP_NAMES = ("LogBucketRelativePosition", "DisentangledAttentionBias", "RelativePositionBias")
# Ops with a kernel in the native library (models/onnx/native): those where it beat the portable function in
# ``python -m relserve.loadtest.bench.onnx_ops``. DisentangledAttentionBias always runs its portable function.
NATIVE_KERNELS = ("LogBucketRelativePosition", "RelativePositionBias")

__all__ = [
    "DOMAIN",
    "DOMAIN_VERSION",
    "OP_NAMES",
    "NATIVE_KERNELS",
    "register_schemas",
    "custom_translation_table",
    "add_local_functions",
    "local_function_protos",
]


# ---------------------------------------------------------------------------------------------------------------
# ONNX schemas
# ---------------------------------------------------------------------------------------------------------------

_FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"]
_registered = False


def _dims(type_proto) -> list | None:
    tt = type_proto.tensor_type
    if not tt.HasField("shape"):
        return None
    return list(tt.shape.dim)


def _set_output(ctx, elem_type: int, dims: list | None, rank: int) -> None:
    """Output 0 gets ``elem_type`` and ``rank`` dims, copying the known ones (``dims`` entries or None)."""
    import onnx

    tp = onnx.TypeProto()
    tp.tensor_type.elem_type = elem_type
    shape = tp.tensor_type.shape
    for k in range(rank):
        d = shape.dim.add()
        src = dims[k] if dims is not None and k < len(dims) else None
        if src is not None:
            d.CopyFrom(src)
    ctx.set_output_type(0, tp)


def _infer_log_bucket(ctx) -> None:
    import onnx

    dims = []
    for i in (0, 1):
        data = ctx.get_input_data(i)
        d = onnx.TensorShapeProto.Dimension()
        if data is not None:
            d.dim_value = int(np.asarray(onnx.numpy_helper.to_array(data)).reshape(-1)[0])
        dims.append(d)
    _set_output(ctx, onnx.TensorProto.INT64, dims, 2)


def _infer_disentangled(ctx) -> None:
    q = ctx.get_input_type(0)
    k = ctx.get_input_type(1)
    qd, kd = _dims(q), _dims(k)
    dims = None
    if qd is not None and len(qd) == 4:
        dims = [qd[0], qd[1], qd[2], kd[2] if kd is not None and len(kd) == 4 else None]
    _set_output(ctx, q.tensor_type.elem_type, dims, 4)


def _infer_t5_bias(ctx) -> None:
    import onnx

    table = ctx.get_input_type(0)
    td = _dims(table)
    one = onnx.TensorShapeProto.Dimension()
    one.dim_value = 1
    dims = [one, td[1] if td is not None and len(td) == 2 else None]
    for i in (1, 2):
        data = ctx.get_input_data(i)
        d = onnx.TensorShapeProto.Dimension()
        if data is not None:
            d.dim_value = int(np.asarray(onnx.numpy_helper.to_array(data)).reshape(-1)[0])
        dims.append(d)
    _set_output(ctx, table.tensor_type.elem_type, dims, 4)


def _schemas() -> list:
    from onnx.defs import OpSchema

    P, A = OpSchema.FormalParameter, OpSchema.Attribute
    opt = OpSchema.FormalParameterOption.Optional
    INT, FLOAT = OpSchema.AttrType.INT, OpSchema.AttrType.FLOAT
    log_bucket = OpSchema(
        "LogBucketRelativePosition", DOMAIN, DOMAIN_VERSION,
        "Signed relative positions i - j of queries 0..Tq-1 to keys 0..Tk-1, DeBERTa-v2 log-bucketed when "
        "bucket_size > 0 and max_position > 0 (exact up to bucket_size // 2, logarithmic beyond).",
        inputs=[P("query_length", "tensor(int64)", "Tq, int64 scalar (or [1])"),
                P("key_length", "tensor(int64)", "Tk, int64 scalar (or [1])")],
        outputs=[P("relative_pos", "tensor(int64)", "Int64[Tq, Tk] signed (bucketed) distances")],
        attributes=[A("bucket_size", INT, "buckets per side (position_buckets); <= 0: no buckets"),
                    A("max_position", INT, "distance the log scale reaches (max_relative_positions)")],
    )
    disentangled = OpSchema(
        "DisentangledAttentionBias", DOMAIN, DOMAIN_VERSION,
        "DeBERTa disentangled attention bias: scale * (c2p + p2c^T) gathered at clamped relative indices "
        "(He et al. 2021, eq. 4). pos_query/pos_key hold R <= 2*att_span rows centred on row att_span.",
        inputs=[P("query_layer", "T", "Float[B, n, Tq, d] content queries"),
                P("key_layer", "T", "Float[B, n, Tk, d] content keys"),
                P("pos_query", "T", "Float[n, R, d] projected relative table (p2c)", param_option=opt),
                P("pos_key", "T", "Float[n, R, d] projected relative table (c2p)", param_option=opt),
                P("relative_pos", "tensor(int64)", "Int64[Tq, Tk] signed (bucketed) distances")],
        outputs=[P("bias", "T", "Float[B, n, Tq, Tk]")],
        type_constraints=[("T", _FLOATS, "float tensors")],
        attributes=[A("att_span", INT, "half the rows of the relative table"),
                    A("scale", FLOAT, "multiplier, 1/sqrt(d * (1 + number of terms))"),
                    A("c2p", INT, "1: add the content-to-position term (needs pos_key)"),
                    A("p2c", INT, "1: add the position-to-content term (needs pos_query)")],
    )
    t5 = OpSchema(
        "RelativePositionBias", DOMAIN, DOMAIN_VERSION,
        "T5 relative position bias, interface of com.microsoft.RelativePositionBias: "
        "out[0, h, i, j] = bias_table[bucket(j - i), h].",
        inputs=[P("bias_table", "T", "Float[num_buckets, num_heads]"),
                P("query_length", "U", "Tq, int64 scalar"),
                P("key_length", "U", "Tk, int64 scalar")],
        outputs=[P("output", "T", "Float[1, num_heads, Tq, Tk]")],
        type_constraints=[("T", _FLOATS, "float tensors"), ("U", ["tensor(int64)"], "int64 lengths")],
        attributes=[A("max_distance", INT, "distance at which the last (logarithmic) bucket starts"),
                    A("is_bidirectional", INT, "1: separate buckets for keys after the query")],
    )
    log_bucket.set_type_and_shape_inference_function(_infer_log_bucket)
    disentangled.set_type_and_shape_inference_function(_infer_disentangled)
    t5.set_type_and_shape_inference_function(_infer_t5_bias)
    return [log_bucket, disentangled, t5]


def register_schemas() -> None:
    """Register the three schemas with ``onnx.defs`` (idempotent). Needed before export and checking."""
    global _registered
    if _registered:
        return
    import onnx.defs

    for schema in _schemas():
        try:
            onnx.defs.get_schema(schema.name, DOMAIN_VERSION, DOMAIN)
        except onnx.defs.SchemaError:
            onnx.defs.register_schema(schema)
    _registered = True


# ---------------------------------------------------------------------------------------------------------------
# Dynamo exporter translations: one custom-domain node per op
# ---------------------------------------------------------------------------------------------------------------


def custom_translation_table() -> dict:
    """``custom_translation_table`` for ``torch.onnx.export(..., dynamo=True)``."""
    register_schemas()
    import onnxscript
    from onnxscript import opset18 as op

    rs = onnxscript.values.Opset(DOMAIN, DOMAIN_VERSION)

    def _length(x):
        return op.Constant(value_int=int(x)) if isinstance(x, int) else x

    def log_bucket(query_length, key_length, bucket_size, max_position, device=None):
        return rs.LogBucketRelativePosition(_length(query_length), _length(key_length),
                                            bucket_size=int(bucket_size), max_position=int(max_position))

    def disentangled(query_layer, key_layer, pos_query, pos_key, relative_pos, att_span, scale, c2p, p2c):
        return rs.DisentangledAttentionBias(query_layer, key_layer, pos_query if p2c else None,
                                            pos_key if c2p else None, relative_pos, att_span=int(att_span),
                                            scale=float(scale), c2p=int(bool(c2p)), p2c=int(bool(p2c)))

    def t5_bias(bias_table, query_length, key_length, max_distance, is_bidirectional):
        return rs.RelativePositionBias(bias_table, _length(query_length), _length(key_length),
                                       max_distance=int(max_distance), is_bidirectional=int(bool(is_bidirectional)))

    ns = torch.ops.relserve
    return {
        ns.log_bucket_relative_position.default: log_bucket,
        ns.disentangled_attention_bias.default: disentangled,
        ns.relative_position_bias.default: t5_bias,
    }


# ---------------------------------------------------------------------------------------------------------------
# Portable implementation: model-local FunctionProtos in standard ONNX ops
# ---------------------------------------------------------------------------------------------------------------

_FUNCTION_OPSET = 18


class _Body:
    """Tiny builder of a function body: ``b.op("Add", x, y)`` returns the new value's name."""

    def __init__(self, prefix: str) -> None:
        self.nodes: list = []
        self.prefix = prefix
        self.count = 0

    def op(self, op_type: str, *inputs: str, **attrs: Any) -> str:
        from onnx import helper

        self.count += 1
        out = f"{self.prefix}_{self.count}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], **attrs))
        return out

    def const(self, value, dtype) -> str:
        from onnx import numpy_helper

        return self.op("Constant", value=numpy_helper.from_array(np.asarray(value, dtype=dtype)))

    def i64(self, value) -> str:
        return self.const(value, np.int64)

    def f32(self, value) -> str:
        return self.const(value, np.float32)


def _function(name: str, inputs: list[str], body: _Body, output: str, out_name: str, attrs: list[str]):
    from onnx import helper

    body.nodes.append(helper.make_node("Identity", [output], [out_name]))
    return helper.make_function(
        DOMAIN, name, inputs, [out_name], body.nodes,
        opset_imports=[helper.make_opsetid("", _FUNCTION_OPSET)], attributes=attrs,
    )


def _scalar(b: _Body, x: str) -> str:
    return b.op("Reshape", x, b.i64([]))  # [] or [1] -> []


def _log_bucket_function(bucket_size: int, max_position: int):
    b = _Body("lb")
    q = b.op("Range", b.i64(0), _scalar(b, "query_length"), b.i64(1))
    k = b.op("Range", b.i64(0), _scalar(b, "key_length"), b.i64(1))
    rel = b.op("Sub", b.op("Unsqueeze", q, b.i64([1])), b.op("Unsqueeze", k, b.i64([0])))  # [Tq, Tk]
    if bucket_size > 0 and max_position > 0:
        # make_log_bucket_position, float32 in the same order as the torch code
        mid = bucket_size // 2
        sign = b.op("Cast", b.op("Sign", rel), to=1)
        near = b.op("And", b.op("Less", rel, b.i64(mid)), b.op("Greater", rel, b.i64(-mid)))
        abs_pos = b.op("Where", near, b.i64(mid - 1), b.op("Abs", rel))
        log_ratio = b.op("Log", b.op("Div", b.op("Cast", abs_pos, to=1), b.f32(mid)))
        log_base = torch.log(torch.tensor((max_position - 1) / mid, dtype=torch.float32)).numpy()
        scaled = b.op("Mul", b.op("Div", log_ratio, b.f32(log_base)), b.f32(mid - 1))
        log_pos = b.op("Add", b.op("Ceil", scaled), b.f32(mid))
        bucket = b.op("Where", b.op("LessOrEqual", abs_pos, b.i64(mid)), b.op("Cast", rel, to=1),
                      b.op("Mul", log_pos, sign))
        rel = b.op("Cast", bucket, to=7)
    return _function("LogBucketRelativePosition", ["query_length", "key_length"], b, rel, "relative_pos",
                     ["bucket_size", "max_position"])


def _disentangled_function(att_span: int, scale: float, c2p: bool, p2c: bool):
    b = _Body("dab")
    ref = "pos_key" if c2p else "pos_query"
    rows = b.op("Shape", ref, start=1, end=2)  # [1] = R
    offset = b.op("Sub", b.i64([att_span]), b.op("Div", rows, b.i64([2])))
    idx = b.op("Min", b.op("Max", b.op("Add", "relative_pos", b.i64(att_span)), b.i64(0)), b.i64(2 * att_span - 1))
    idx = b.op("Sub", idx, offset)
    idx = b.op("Min", b.op("Max", idx, b.i64(0)), b.op("Sub", rows, b.i64([1])))  # [Tq, Tk]
    # Both terms gather along the last axis with an index that depends on (i, j) only, the same for every batch
    # row and head. With (batch, head) moved innermost, the scores become a table of [Tq·R] rows of B·n floats
    # and each term is one Gather of whole rows by a [Tq·Tk] index: contiguous copies, instead of
    # GatherElements with the index expanded to [B, n, Tq, Tk] (8x512, 12 heads: 200 MB of int64 per layer)
    # and an element-by-element gather. The sum runs in that layout; one Transpose restores [B, n, Tq, Tk].
    lead = b.op("Shape", "query_layer", start=0, end=2)  # [B, n]
    tq = b.op("Shape", idx, start=0, end=1)
    tk = b.op("Shape", idx, start=1, end=2)
    bn = b.op("ReduceProd", lead, keepdims=1)  # [1] = B·n
    table_shape = b.op("Concat", b.i64([-1]), bn, axis=0)  # [X·R, B·n]
    bias = None
    for on, ref, states, base_len, base_axis in ((c2p, "pos_key", "query_layer", tq, 1),
                                                  (p2c, "pos_query", "key_layer", tk, 0)):
        if not on:
            continue
        # the scale goes on the [n, R, d] table, the smallest operand, instead of on the [B, n, Tq, Tk] sum
        scaled = b.op("Mul", ref, b.op("CastLike", b.f32(scale), ref))
        scores = b.op("MatMul", states, b.op("Transpose", scaled, perm=[0, 2, 1]))  # [B, n, X, R] (X = Tq or Tk)
        table = b.op("Reshape", b.op("Transpose", scores, perm=[2, 3, 0, 1]), table_shape)  # [X·R, B·n]
        base = b.op("Mul", b.op("Range", b.i64(0), _scalar(b, base_len), b.i64(1)), _scalar(b, rows))  # x·R
        # c2p reads row i·R + idx[i, j], p2c row j·R + idx[i, j] (x = i down the rows, x = j across them)
        at = b.op("Reshape", b.op("Add", b.op("Unsqueeze", base, b.i64([base_axis])), idx), b.i64([-1]))
        term = b.op("Gather", table, at, axis=0)  # [Tq·Tk, B·n]
        bias = term if bias is None else b.op("Add", bias, term)
    full = b.op("Concat", b.op("Shape", idx), lead, axis=0)  # [Tq, Tk, B, n]
    out = b.op("Transpose", b.op("Reshape", bias, full), perm=[2, 3, 0, 1])  # [B, n, Tq, Tk]
    return _function("DisentangledAttentionBias",
                     ["query_layer", "key_layer", "pos_query", "pos_key", "relative_pos"], b, out, "bias",
                     ["att_span", "scale", "c2p", "p2c"])


def _t5_bias_function(num_buckets: int, max_distance: int, bidirectional: bool):
    b = _Body("rpb")
    q = b.op("Range", b.i64(0), _scalar(b, "query_length"), b.i64(1))
    k = b.op("Range", b.i64(0), _scalar(b, "key_length"), b.i64(1))
    rel = b.op("Sub", b.op("Unsqueeze", k, b.i64([0])), b.op("Unsqueeze", q, b.i64([1])))  # memory - context
    nb = num_buckets
    if bidirectional:
        nb //= 2
        base = b.op("Mul", b.op("Cast", b.op("Greater", rel, b.i64(0)), to=7), b.i64(nb))
        rp = b.op("Abs", rel)
    else:
        base = None
        rp = b.op("Neg", b.op("Min", rel, b.i64(0)))
    max_exact = nb // 2
    is_small = b.op("Less", rp, b.i64(max_exact))
    log_base = np.float32(math.log(max_distance / max_exact))
    large = b.op("Mul", b.op("Div", b.op("Log", b.op("Div", b.op("Cast", rp, to=1), b.f32(max_exact))),
                                 b.f32(log_base)), b.f32(nb - max_exact))
    # the torch code truncates a possibly -inf value (rp == 0) that Where then discards; keep it finite here
    large = b.op("Max", large, b.f32(0.0))
    large = b.op("Add", b.i64(max_exact), b.op("Cast", large, to=7))
    large = b.op("Min", large, b.i64(nb - 1))
    buckets = b.op("Where", is_small, rp, large)
    if base is not None:
        buckets = b.op("Add", base, buckets)
    values = b.op("Gather", "bias_table", buckets, axis=0)  # [Tq, Tk, n]
    out = b.op("Unsqueeze", b.op("Transpose", values, perm=[2, 0, 1]), b.i64([0]))
    return _function("RelativePositionBias", ["bias_table", "query_length", "key_length"], b, out, "output",
                     ["max_distance", "is_bidirectional"])


def _attrs(node) -> dict[str, Any]:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _static_shape(model, name: str) -> list[int] | None:
    for init in model.graph.initializer:
        if init.name == name:
            return list(init.dims)
    for vi in list(model.graph.value_info) + list(model.graph.input):
        if vi.name == name:
            dims = vi.type.tensor_type.shape.dim
            if all(d.HasField("dim_value") for d in dims):
                return [d.dim_value for d in dims]
    return None


def local_function_protos(model) -> list:
    """One FunctionProto per custom op used in ``model`` (a ModelProto), specialised to its attributes.

    Raises:
        ValueError: two nodes of one op disagree on attributes, or a RelativePositionBias table's shape is unknown.
    """
    seen: dict[str, tuple] = {}
    for node in _all_nodes(model.graph):
        if node.domain != DOMAIN:
            continue
        a = _attrs(node)
        if node.op_type == "LogBucketRelativePosition":
            key = (int(a.get("bucket_size", -1)), int(a.get("max_position", -1)))
        elif node.op_type == "DisentangledAttentionBias":
            key = (int(a["att_span"]), float(a["scale"]), bool(a.get("c2p", 1)), bool(a.get("p2c", 1)))
        elif node.op_type == "RelativePositionBias":
            shape = _static_shape(model, node.input[0])
            if shape is None or len(shape) != 2:
                raise ValueError(f"RelativePositionBias node {node.name!r}: bias_table {node.input[0]!r} needs a "
                                 f"static [num_buckets, num_heads] shape for the portable function")
            key = (shape[0], int(a["max_distance"]), bool(a.get("is_bidirectional", 1)))
        else:
            raise ValueError(f"node {node.name!r}: unknown op {DOMAIN}.{node.op_type}")
        if seen.setdefault(node.op_type, key) != key:
            raise ValueError(f"{DOMAIN}.{node.op_type}: nodes with different attributes {seen[node.op_type]} and "
                             f"{key} in one model; the portable functions are specialised per model")
    builders = {
        "LogBucketRelativePosition": _log_bucket_function,
        "DisentangledAttentionBias": _disentangled_function,
        "RelativePositionBias": _t5_bias_function,
    }
    return [builders[name](*key) for name, key in seen.items()]


def _all_nodes(graph):
    for node in graph.node:
        yield node
        for a in node.attribute:
            if a.g is not None and a.HasField("g"):
                yield from _all_nodes(a.g)
            for g in a.graphs:
                yield from _all_nodes(g)


def add_local_functions(model):
    """Replace any ``com.relserve`` FunctionProtos of ``model`` with portable ones; add the opset import."""
    from onnx import helper

    functions = local_function_protos(model)
    # The bodies use ops unchanged from opset 17 on; they import the model's own ai.onnx version, which the
    # checker requires to match (a model at opset 19 may not call functions that import 18).
    model_opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), _FUNCTION_OPSET)
    for f in functions:
        for imp in f.opset_import:
            if imp.domain in ("", "ai.onnx"):
                imp.version = model_opset
    keep = [f for f in model.functions if f.domain != DOMAIN]
    del model.functions[:]
    model.functions.extend(keep + functions)
    if functions and not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    return model


# ---------------------------------------------------------------------------------------------------------------
# CUDA: ONNX Runtime's own contrib kernel for the T5 bias
# ---------------------------------------------------------------------------------------------------------------

CUDA_CONTRIB_DOMAIN = "com.microsoft"


def to_cuda_contrib_ops(model) -> int:
    """Re-home ``com.relserve.RelativePositionBias`` nodes of ``model`` (in place) to ONNX Runtime's
    ``com.microsoft.RelativePositionBias`` (CUDA contrib op, same inputs and attributes), so the CUDA execution
    provider runs them with its own kernel. Returns the number of nodes changed.

    Only for sessions on the CUDA provider: ONNX Runtime has no CPU kernel for that op. Its kernel also needs
    ``query_length == key_length`` (self-attention, which is how our encoders use it) and ``max_distance > 0``.
    The now unused local function stays in the model (harmless)."""
    from onnx import helper

    changed = 0
    for node in _all_nodes(model.graph):
        if node.domain == DOMAIN and node.op_type == "RelativePositionBias":
            node.domain = CUDA_CONTRIB_DOMAIN
            changed += 1
    if changed and not any(o.domain == CUDA_CONTRIB_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(CUDA_CONTRIB_DOMAIN, 1))
    return changed
