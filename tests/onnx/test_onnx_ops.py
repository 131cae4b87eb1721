"""The com.relserve custom ops: torch kernels vs a naive reading of the paper / transformers' T5 code, the
portable ONNX functions (run on stock ONNX Runtime, CPU) vs the torch kernels at random shapes and lengths,
schemas, fake kernels (opcheck), and export of each op as one custom-domain node."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402

from relserve.models import relative_position as rp  # noqa: E402
from relserve.models.onnx import ops  # noqa: E402

ops.register_schemas()
F32, I64 = TensorProto.FLOAT, TensorProto.INT64


def _run_node(node, inputs, out_rank, feeds, out_type=F32):
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info(node.output[0], out_type,
                                                                                  [None] * out_rank)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid(ops.DOMAIN, ops.DOMAIN_VERSION)], ir_version=10)
    ops.add_local_functions(model)
    onnx.checker.check_model(model, full_check=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


def _vi(name, elem, rank):
    return helper.make_tensor_value_info(name, elem, [None] * rank)


# ------------------------------------------------------------------------------------------ LogBucketRelativePosition


@pytest.mark.parametrize("bucket_size,max_position", [(256, 512), (32, 128), (-1, -1), (64, 512), (10, 50)])
def test_log_bucket_function_matches_torch(bucket_size, max_position):
    rng = np.random.default_rng(bucket_size + 7)
    node = helper.make_node("LogBucketRelativePosition", ["q", "k"], ["rel"], domain=ops.DOMAIN,
                            bucket_size=bucket_size, max_position=max_position)
    for q, k in [(1, 1), (3, 3), (700, 700), tuple(rng.integers(1, 900, 2))]:
        got = _run_node(node, [_vi("q", I64, 0), _vi("k", I64, 0)], 2, {"q": np.array(q), "k": np.array(k)}, I64)
        want = rp.log_bucket_relative_position_reference(int(q), int(k), bucket_size, max_position)
        assert got.shape == (q, k) and np.array_equal(got, want.numpy())
        assert torch.equal(rp.log_bucket_relative_position(int(q), int(k), bucket_size, max_position), want)


def test_log_bucket_reference_matches_transformers():
    transformers = pytest.importorskip("transformers")  # noqa: F841
    from transformers.models.deberta_v2 import modeling_deberta_v2 as ref

    x = torch.zeros(1, 600, 4)
    want = ref.build_relative_position(x, x, bucket_size=256, max_position=512)[0]
    assert torch.equal(rp.log_bucket_relative_position(600, 600, 256, 512), want)


# ------------------------------------------------------------------------------------------ DisentangledAttentionBias


def _naive_bias(q, k, pos_query, pos_key, rel, span, scale, c2p, p2c):
    """Eq. (4) of He et al. read literally: full 2·span table, index clamp(δ + span)."""
    B, n, T, _ = q.shape
    out = torch.zeros(B, n, T, k.shape[2])
    for i in range(T):
        for j in range(k.shape[2]):
            r = int(min(max(rel[i, j] + span, 0), 2 * span - 1))
            if c2p:
                out[:, :, i, j] += (q[:, :, i] * pos_key[:, r]).sum(-1)
            if p2c:
                out[:, :, i, j] += (k[:, :, j] * pos_query[:, r]).sum(-1)
    return out * scale


@pytest.mark.parametrize("terms", [(True, True), (True, False), (False, True)])
def test_disentangled_bias_vs_naive_paper_reading(terms):
    g = torch.Generator().manual_seed(1)
    B, n, T, d, span = 2, 3, 9, 4, 6
    q, k = torch.randn(B, n, T, d, generator=g), torch.randn(B, n, T, d, generator=g)
    table_q, table_k = torch.randn(n, 2 * span, d, generator=g), torch.randn(n, 2 * span, d, generator=g)
    rel = rp.log_bucket_relative_position(T, T, 8, 20)
    want = _naive_bias(q, k, table_q, table_k, rel, span, 0.3, *terms)
    full = rp.disentangled_attention_bias(q, k, table_q, table_k, rel, att_span=span, scale=0.3, c2p=terms[0],
                                           p2c=terms[1])
    torch.testing.assert_close(full, want, atol=1e-5, rtol=1e-5)
    # the centred window of 2T - 1 rows gives the same result when T - 1 < span (here T=5)
    Tw = 5
    lo, hi = span - Tw + 1, span + Tw - 1
    relw = rel[:Tw, :Tw]
    win = rp.disentangled_attention_bias(q[:, :, :Tw], k[:, :, :Tw], table_q[:, lo:hi + 1], table_k[:, lo:hi + 1], relw,
                                          att_span=span, scale=0.3, c2p=terms[0], p2c=terms[1])
    torch.testing.assert_close(win, _naive_bias(q[:, :, :Tw], k[:, :, :Tw], table_q, table_k, relw, span, 0.3, *terms),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_disentangled_function_matches_torch(seed):
    rng = np.random.default_rng(seed)
    B, n, d = int(rng.integers(1, 4)), int(rng.integers(1, 4)), int(rng.integers(2, 9))
    T = int(rng.integers(1, 200))
    buckets, max_pos = [(256, 512), (32, 128), (-1, 64), (16, 40)][seed]
    span = buckets if buckets > 0 else max_pos
    c2p, p2c = [(True, True), (True, False), (False, True), (True, True)][seed]
    R = 2 * span if seed % 2 or T - 1 >= span else 2 * T - 1  # whole table or the centred window
    q, k = rng.standard_normal((B, n, T, d), dtype=np.float32), rng.standard_normal((B, n, T, d), dtype=np.float32)
    pq, pk = rng.standard_normal((n, R, d), dtype=np.float32), rng.standard_normal((n, R, d), dtype=np.float32)
    rel = rp.log_bucket_relative_position_reference(T, T, buckets, max_pos).numpy()
    scale = 1 / math.sqrt(d * 3)
    names = ["q", "k", "pq" if p2c else "", "pk" if c2p else "", "rel"]
    node = helper.make_node("DisentangledAttentionBias", names, ["bias"], domain=ops.DOMAIN, att_span=span,
                            scale=scale, c2p=int(c2p), p2c=int(p2c))
    inputs = [_vi("q", F32, 4), _vi("k", F32, 4)] + ([_vi("pq", F32, 3)] if p2c else []) + \
             ([_vi("pk", F32, 3)] if c2p else []) + [_vi("rel", I64, 2)]
    feeds = {"q": q, "k": k, "rel": rel} | ({"pq": pq} if p2c else {}) | ({"pk": pk} if c2p else {})
    got = _run_node(node, inputs, 4, feeds)
    want = rp.disentangled_attention_bias(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(pq) if p2c else None,
                                           torch.from_numpy(pk) if c2p else None, torch.from_numpy(rel), att_span=span,
                                           scale=scale, c2p=c2p, p2c=p2c)
    assert got.shape == (B, n, T, T)
    np.testing.assert_allclose(got, want.numpy(), atol=2e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ RelativePositionBias (T5)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_bucket_and_bias_match_transformers(bidirectional):
    pytest.importorskip("transformers")
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention

    for num_buckets, max_distance in ((32, 128), (16, 40), (64, 300)):
        rel = torch.arange(-700, 700)[None, :]
        want = T5Attention._relative_position_bucket(rel, bidirectional, num_buckets, max_distance)
        assert torch.equal(rp.t5_relative_position_bucket(rel, bidirectional, num_buckets, max_distance), want)
        cfg = T5Config(d_model=16, d_kv=4, num_heads=4, relative_attention_num_buckets=num_buckets,
                       relative_attention_max_distance=max_distance, is_decoder=not bidirectional)
        attn = T5Attention(cfg, has_relative_attention_bias=True).eval()
        with torch.no_grad():
            attn.relative_attention_bias.weight.normal_()
            for q, k in ((7, 7), (300, 300), (5, 40)):
                want = attn.compute_bias(q, k)
                got = rp.relative_position_bias(attn.relative_attention_bias.weight, q, k, max_distance=max_distance,
                                                 is_bidirectional=bidirectional)
                assert got.shape == (1, 4, q, k) and torch.equal(got, want)


@pytest.mark.parametrize("bidirectional", [1, 0])
def test_t5_function_matches_torch(bidirectional):
    rng = np.random.default_rng(bidirectional)
    table = rng.standard_normal((32, 3), dtype=np.float32)
    node = helper.make_node("RelativePositionBias", ["table", "q", "k"], ["out"], domain=ops.DOMAIN, max_distance=128,
                            is_bidirectional=bidirectional)
    init = [helper.make_tensor("table", F32, table.shape, table.ravel())]
    for q, k in ((1, 1), (9, 9), (400, 400), (3, 50)):
        graph = helper.make_graph([node], "g", [_vi("q", I64, 0), _vi("k", I64, 0)], [_vi("out", F32, 4)], initializer=init)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                        helper.make_opsetid(ops.DOMAIN, 1)], ir_version=10)
        ops.add_local_functions(model)
        onnx.checker.check_model(model, full_check=True)
        got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"q": np.array(q), "k": np.array(k)})[0]
        want = rp.relative_position_bias(torch.from_numpy(table), q, k, max_distance=128, is_bidirectional=bidirectional)
        assert got.shape == (1, 3, q, k) and np.array_equal(got, want.numpy())


# ------------------------------------------------------------------------------------------ schemas, fakes, export


def test_schemas_are_registered_and_documented():
    for name in ops.OP_NAMES:
        s = onnx.defs.get_schema(name, ops.DOMAIN_VERSION, ops.DOMAIN)
        assert s.doc and all(p.description for p in s.inputs) and s.attributes
    s = onnx.defs.get_schema("DisentangledAttentionBias", 1, ops.DOMAIN)
    assert [p.name for p in s.inputs] == ["query_layer", "key_layer", "pos_query", "pos_key", "relative_pos"]
    assert set(s.attributes) == {"att_span", "scale", "c2p", "p2c"}
    s = onnx.defs.get_schema("RelativePositionBias", 1, ops.DOMAIN)
    assert [p.name for p in s.inputs] == ["bias_table", "query_length", "key_length"]
    assert set(s.attributes) == {"max_distance", "is_bidirectional"}


def test_fake_kernels_opcheck():
    q, k = torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4)
    table = torch.randn(2, 9, 4)
    rel = rp.log_bucket_relative_position(5, 5, 8, 20)
    torch.library.opcheck(torch.ops.relserve.disentangled_attention_bias.default,
                          (q, k, table, table, rel, 6, 0.2, True, True), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.relserve.relative_position_bias.default, (torch.randn(32, 2), 5, 6, 128, True),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.relserve.log_bucket_relative_position.default, (5, 7, 8, 20, torch.device("cpu")),
                          test_utils=("test_schema", "test_faketensor"))


def test_functions_refuse_mixed_attributes():
    a = helper.make_node("LogBucketRelativePosition", ["q", "k"], ["r1"], domain=ops.DOMAIN, bucket_size=8, max_position=20)
    b = helper.make_node("LogBucketRelativePosition", ["q", "k"], ["r2"], domain=ops.DOMAIN, bucket_size=16, max_position=20)
    graph = helper.make_graph([a, b], "g", [_vi("q", I64, 0), _vi("k", I64, 0)], [_vi("r1", I64, 2), _vi("r2", I64, 2)])
    with pytest.raises(ValueError, match="different attributes"):
        ops.local_function_protos(helper.make_model(graph))


class _AllOps(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.table = torch.nn.Parameter(torch.randn(2, 16, 4, generator=g))
        self.t5 = torch.nn.Parameter(torch.randn(32, 2, generator=g))

    def forward(self, x):  # x [B, 2, T, 4]
        T = x.shape[2]
        rel = rp.log_bucket_relative_position(T, T, 8, 20, x.device)
        bias = rp.disentangled_attention_bias(x, x * 2, self.table, self.table, rel, att_span=8, scale=0.5, c2p=True,
                                               p2c=True)
        return bias + rp.relative_position_bias(self.t5, T, T, max_distance=128)


def test_each_op_exports_as_one_custom_node(tmp_path):
    ops.register_schemas()
    model = _AllOps().eval()
    T = torch.export.Dim("T", min=1, max=4096)
    prog = torch.onnx.export(model, (torch.randn(2, 2, 6, 4),), dynamo=True, dynamic_shapes=({2: T},),
                             custom_translation_table=ops.custom_translation_table(), opset_version=18, verbose=False)
    proto = prog.model_proto
    ops.add_local_functions(proto)
    custom = sorted(n.op_type for n in proto.graph.node if n.domain == ops.DOMAIN)
    assert custom == sorted(ops.OP_NAMES)
    assert sorted(f.name for f in proto.functions if f.domain == ops.DOMAIN) == sorted(ops.OP_NAMES)
    path = tmp_path / "ops.onnx"
    onnx.save(proto, path)
    onnx.checker.check_model(str(path), full_check=True)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for T in (1, 6, 37):
        x = torch.randn(2, 2, T, 4)
        got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
        with torch.no_grad():
            np.testing.assert_allclose(got, model(x).numpy(), atol=1e-5)


# ------------------------------------------------------------------------------------------ native kernels (optional)


def _native_library():
    from relserve.models.onnx.runtime import native_library

    lib = native_library()
    if lib is None:
        pytest.skip("native custom-op library not built (make onnx-native)")
    return lib


def _native_session(lib, node, inputs, out_type, rank, init=(), functions=True):
    graph = helper.make_graph([node], "g", inputs, [_vi(node.output[0], out_type, rank)], initializer=list(init))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid(ops.DOMAIN, 1)], ir_version=10)
    ops.add_local_functions(model)
    if not functions:
        del model.functions[:]
    so = ort.SessionOptions()
    so.register_custom_ops_library(lib)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _dab_case(rng, c2p, p2c):
    q, k = rng.standard_normal((2, 3, 50, 8), dtype=np.float32), rng.standard_normal((2, 3, 50, 8), dtype=np.float32)
    pq, pk = rng.standard_normal((3, 64, 8), dtype=np.float32), rng.standard_normal((3, 64, 8), dtype=np.float32)
    rel = rp.log_bucket_relative_position_reference(50, 50, 32, 128).numpy()
    node = helper.make_node("DisentangledAttentionBias", ["q", "k", "pq" if p2c else "", "pk" if c2p else "", "rel"],
                            ["b"], domain=ops.DOMAIN, att_span=32, scale=0.25, c2p=c2p, p2c=p2c)
    inputs = [_vi("q", F32, 4), _vi("k", F32, 4)] + ([_vi("pq", F32, 3)] if p2c else []) + \
             ([_vi("pk", F32, 3)] if c2p else []) + [_vi("rel", I64, 2)]
    feeds = {"q": q, "k": k, "rel": rel} | ({"pq": pq} if p2c else {}) | ({"pk": pk} if c2p else {})
    want = rp.disentangled_attention_bias(*(torch.from_numpy(x) if x is not None else None for x in
                                             (q, k, pq if p2c else None, pk if c2p else None, rel)),
                                           att_span=32, scale=0.25, c2p=bool(c2p), p2c=bool(p2c))
    return node, inputs, feeds, want.numpy()


def test_native_kernels_match_torch():
    """Runs only where ``make onnx-native`` has built the library (not part of the default build). The library
    has kernels for ``ops.NATIVE_KERNELS`` (LogBucketRelativePosition, RelativePositionBias) only."""
    lib = _native_library()
    for bs, mp in ((256, 512), (32, 128), (-1, -1)):
        node = helper.make_node("LogBucketRelativePosition", ["q", "k"], ["r"], domain=ops.DOMAIN, bucket_size=bs,
                                max_position=mp)
        sess = _native_session(lib, node, [_vi("q", I64, 0), _vi("k", I64, 0)], I64, 2, functions=False)
        got = sess.run(None, {"q": np.array(2000), "k": np.array(1500)})[0]
        assert np.array_equal(got, rp.log_bucket_relative_position_reference(2000, 1500, bs, mp).numpy())
    rng = np.random.default_rng(0)
    table = rng.standard_normal((32, 3), dtype=np.float32)
    for bidirectional in (1, 0):
        node = helper.make_node("RelativePositionBias", ["t", "q", "k"], ["o"], domain=ops.DOMAIN, max_distance=128,
                                is_bidirectional=bidirectional)
        sess = _native_session(lib, node, [_vi("q", I64, 0), _vi("k", I64, 0)], F32, 4,
                               [helper.make_tensor("t", F32, table.shape, table.ravel())], functions=False)
        for q, k in ((700, 700), (3, 50)):
            got = sess.run(None, {"q": np.array(q), "k": np.array(k)})[0]
            want = rp.relative_position_bias(torch.from_numpy(table), q, k, max_distance=128,
                                              is_bidirectional=bool(bidirectional))
            assert np.array_equal(got, want.numpy())


def test_native_library_registers_exactly_the_kept_kernels():
    """A graph holding a node but no local function only loads when the library has that op's kernel: exactly
    ``ops.NATIVE_KERNELS``. DisentangledAttentionBias (kernel removed: slower than the portable function) still
    runs in a session with the library registered, through its model-local function."""
    lib = _native_library()
    assert set(ops.NATIVE_KERNELS) == {"LogBucketRelativePosition", "RelativePositionBias"}
    rng = np.random.default_rng(1)
    table = [helper.make_tensor("t", F32, (32, 3), rng.standard_normal(96, dtype=np.float32))]
    lengths = [_vi("q", I64, 0), _vi("k", I64, 0)]
    cases = {
        "LogBucketRelativePosition": (helper.make_node("LogBucketRelativePosition", ["q", "k"], ["r"],
                                                       domain=ops.DOMAIN, bucket_size=8, max_position=20),
                                      lengths, I64, 2, ()),
        "RelativePositionBias": (helper.make_node("RelativePositionBias", ["t", "q", "k"], ["o"], domain=ops.DOMAIN,
                                                  max_distance=128, is_bidirectional=1), lengths, F32, 4, table),
    }
    node, inputs, feeds, want = _dab_case(rng, 1, 1)
    cases["DisentangledAttentionBias"] = (node, inputs, F32, 4, ())
    assert set(cases) == set(ops.OP_NAMES)
    registered = set()
    for name, (node, inputs, out_type, rank, init) in cases.items():
        try:
            _native_session(lib, node, inputs, out_type, rank, init, functions=False)
        except Exception:  # noqa: BLE001 - no kernel and no function: the session cannot be made
            continue
        registered.add(name)
    assert registered == set(ops.NATIVE_KERNELS)
    for c2p, p2c in ((1, 1), (1, 0), (0, 1)):  # the removed op: portable function, same numbers as torch
        node, inputs, feeds, want = _dab_case(rng, c2p, p2c)
        got = _native_session(lib, node, inputs, F32, 4).run(None, feeds)[0]
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def test_training_gets_gradients_through_the_reference():
    """The custom ops have no autograd formula; with grad enabled the wrappers run the references."""
    from relserve.models.deberta import DebertaConfig
    from relserve.models.deberta import DebertaForSequenceClassification

    for extra in ({}, {"relative_attention_type": "t5", "norm_rel_ebd": "none"}):
        cfg = DebertaConfig.from_dict(dict(dict(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                                intermediate_size=32, relative_attention=True, position_buckets=8,
                                                max_relative_positions=20, pos_att_type=["p2c", "c2p"],
                                                share_att_key=True, norm_rel_ebd="layer_norm",
                                                position_biased_input=False, type_vocab_size=0), **extra))
        model = DebertaForSequenceClassification(cfg).train()
        ids = torch.randint(1, 50, (2, 12))
        model(ids, torch.ones_like(ids)).sum().backward()
        table = (model.deberta.encoder.relative_attention_bias if extra else model.deberta.encoder.rel_embeddings).weight
        assert table.grad is not None and table.grad.abs().sum() > 0
        with torch.no_grad():  # eval path (custom ops) gives the same numbers
            model.eval()
            a = model(ids, torch.ones_like(ids))
        with torch.enable_grad():
            b = model(ids, torch.ones_like(ids))
        torch.testing.assert_close(a, b.detach(), atol=1e-6, rtol=1e-6)
