"""Op-level CPU fp32 timing of the com.relserve custom ops: the portable ONNX function vs the native kernel
of ``models/onnx/native`` (when ``make onnx-native`` has built it and it registers the op), side by side.

    python -m relserve.loadtest.bench.onnx_ops                      # DeBERTa-v3-base shapes, 8x128 and 8x512
    python -m relserve.loadtest.bench.onnx_ops --repeats 5 --shapes 8x512
    python -m relserve.loadtest.bench.onnx_ops --json bench_onnx_ops.json

Each op is a one-node ONNX model (the node plus its model-local function from
:func:`relserve.models.onnx.ops.add_local_functions`, so the portable session inlines the function and the
native session, with the library registered, runs the kernel instead), built at DeBERTa-v3-base shapes:

* ``LogBucketRelativePosition``: Tq = Tk = T, bucket_size 256, max_position 512;
* ``DisentangledAttentionBias``: query/key Float[B, 12, T, 64], c2p and p2c, att_span 256, the centred window
  of R = min(2T - 1, 512) table rows that the encoder passes, relative positions from the op above;
* ``RelativePositionBias`` (T5): table Float[32, 12], max_distance 128, bidirectional.

Sessions are made with :func:`relserve.models.onnx.runtime.make_session` (all graph optimisations, ``--threads``
intra-op threads, 2 by default). Per op and shape: one warm-up run of each session (outputs compared:
exact for the integer / table-lookup ops, ``max |diff|`` for the float op), then ``--repeats`` rounds that
run portable and native in turn; medians are reported with the native:portable time ratio (below 1: the
native kernel is faster). Which ops the library has kernels for is probed first (a node without its local
function only loads when the library supplies the kernel); for an op it lacks, the "native" session runs the
portable function as well, the row says ``no kernel`` (``"kernel": false`` in the JSON) and its ratio only
shows the noise of the measurement. Without the library only the portable sessions are timed.
"""

from __future__ import annotations

import math
import os
import tempfile

import numpy as np

from . import harness

HEADS, HEAD_SIZE, BUCKETS, MAX_POSITION = 12, 64, 256, 512
T5_BUCKETS, T5_MAX_DISTANCE = 32, 128


def _model(node, inputs, output, out_type, out_rank, initializers=()):
    import onnx
    from onnx import helper

    from relserve.models.onnx import ops

    ops.register_schemas()
    graph = helper.make_graph([node], node.op_type, inputs,
                              [helper.make_tensor_value_info(output, out_type, [None] * out_rank)],
                              initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid(ops.DOMAIN, ops.DOMAIN_VERSION)],
                              ir_version=10)
    ops.add_local_functions(model)
    onnx.checker.check_model(model, full_check=True)
    return model


def op_cases(batch: int, seq: int, seed: int = 0) -> list[tuple[str, object, dict, bool]]:
    """``(op name, one-node ModelProto, feeds, exact)`` for the three ops at one shape."""
    from onnx import TensorProto, helper

    from relserve.models import relative_position as rp
    from relserve.models.onnx import ops

    F32, I64 = TensorProto.FLOAT, TensorProto.INT64
    rng = np.random.default_rng(seed)

    def vi(name, elem, rank):
        return helper.make_tensor_value_info(name, elem, [None] * rank)

    lengths = {"q": np.array(seq, dtype=np.int64), "k": np.array(seq, dtype=np.int64)}
    cases = []
    node = helper.make_node("LogBucketRelativePosition", ["q", "k"], ["rel"], domain=ops.DOMAIN,
                            bucket_size=BUCKETS, max_position=MAX_POSITION)
    cases.append(("LogBucketRelativePosition", _model(node, [vi("q", I64, 0), vi("k", I64, 0)], "rel", I64, 2),
                  dict(lengths), True))

    R = min(2 * seq - 1, 2 * BUCKETS)  # the encoder's centred window of the relative table
    q = rng.standard_normal((batch, HEADS, seq, HEAD_SIZE), dtype=np.float32)
    k = rng.standard_normal((batch, HEADS, seq, HEAD_SIZE), dtype=np.float32)
    pq = rng.standard_normal((HEADS, R, HEAD_SIZE), dtype=np.float32)
    pk = rng.standard_normal((HEADS, R, HEAD_SIZE), dtype=np.float32)
    rel = rp.log_bucket_relative_position_reference(seq, seq, BUCKETS, MAX_POSITION).numpy()
    node = helper.make_node("DisentangledAttentionBias", ["q", "k", "pq", "pk", "rel"], ["bias"], domain=ops.DOMAIN,
                            att_span=BUCKETS, scale=1 / math.sqrt(HEAD_SIZE * 3), c2p=1, p2c=1)
    inputs = [vi("q", F32, 4), vi("k", F32, 4), vi("pq", F32, 3), vi("pk", F32, 3), vi("rel", I64, 2)]
    cases.append(("DisentangledAttentionBias", _model(node, inputs, "bias", F32, 4),
                  {"q": q, "k": k, "pq": pq, "pk": pk, "rel": rel}, False))

    table = rng.standard_normal((T5_BUCKETS, HEADS), dtype=np.float32)
    node = helper.make_node("RelativePositionBias", ["table", "q", "k"], ["out"], domain=ops.DOMAIN,
                            max_distance=T5_MAX_DISTANCE, is_bidirectional=1)
    cases.append(("RelativePositionBias",
                  _model(node, [vi("q", I64, 0), vi("k", I64, 0)], "out", F32, 4,
                         [helper.make_tensor("table", F32, table.shape, table.ravel())]),
                  dict(lengths), True))
    return cases


def native_ops(lib: str | None) -> set[str]:
    """Names of the com.relserve ops whose kernels ``lib`` registers (probed: a session whose graph holds the
    node but *no* local function only loads when the library supplies the kernel)."""
    if not lib:
        return set()
    import onnxruntime as ort

    found = set()
    for name, model, _, _ in op_cases(1, 2):
        del model.functions[:]
        opts = ort.SessionOptions()
        opts.register_custom_ops_library(lib)
        try:
            ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        except Exception:  # noqa: BLE001 - "no kernel / no schema" is the answer we probe for
            continue
        found.add(name)
    return found


def main(argv: list[str] | None = None) -> dict:
    import onnx
    import onnxruntime as ort

    from relserve.models.onnx.runtime import make_session
    from relserve.models.onnx.runtime import native_library

    parser = harness.parser("onnx_ops", __doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--shapes", default="128,512", help="comma-separated sequence lengths (or BATCHxSEQ)")
    harness.add_common_args(parser, repeats=7, threads=2, threads_help="ORT intra-op threads", json="file")
    args = parser.parse_args(argv)

    lib = native_library()
    kernels = native_ops(lib)
    if lib is None:
        print("native custom-op library not built (make onnx-native): timing the portable functions only")
    else:
        print(f"native library {lib}: kernels for {sorted(kernels) or 'no op'}")
    results = []
    with tempfile.TemporaryDirectory() as d:
        for shape in args.shapes.split(","):
            B, T = (int(x) for x in shape.lower().split("x")) if "x" in shape.lower() else (args.batch, int(shape))
            for name, model, feeds, exact in op_cases(B, T, seed=T):
                path = os.path.join(d, f"{name}.onnx")
                onnx.save(model, path)
                sessions = {"portable": make_session(path, intra_op_threads=args.threads)}
                if lib is not None:
                    sessions["native"] = make_session(path, intra_op_threads=args.threads, native_library=lib)
                outs = {k: s.run(None, feeds)[0] for k, s in sessions.items()}  # warm-up + agreement
                if "native" in outs:
                    a, b = outs["portable"], outs["native"]
                    if a.shape != b.shape:
                        raise AssertionError(f"{name} {B}x{T}: shapes {a.shape} vs {b.shape}")
                    diff = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if a.size else 0.0
                    if (exact and diff != 0) or (not exact and diff > 1e-4 * max(1.0, float(np.max(np.abs(a))))):
                        raise AssertionError(f"{name} {B}x{T}: portable and native differ by {diff}")
                else:
                    diff = None
                med = harness.medians(harness.interleaved(
                    {k: (lambda s=s: s.run(None, feeds)) for k, s in sessions.items()}, args.repeats))
                row = {"op": name, "shape": f"{B}x{T}", "kernel": name in kernels,
                       "ms": {k: round(v * 1e3, 3) for k, v in med.items()}, "max_abs_diff": diff}
                if "native" in med:
                    row["native_to_portable"] = round(harness.ratio(med["native"], med["portable"]), 3)
                results.append(row)
                line = f"{name:27s} {B}x{T:<4d} portable {med['portable'] * 1e3:9.3f} ms"
                if "native" in med:
                    what = "native" if row["kernel"] else "no kernel"
                    line += (f"   {what:9s} {med['native'] * 1e3:9.3f} ms   native:portable "
                             f"{row['native_to_portable']:.2f}   max |diff| {diff:.1e}")
                print(line, flush=True)
                del sessions, outs
    summary = {"threads": args.threads, "repeats": args.repeats, "onnxruntime": ort.__version__,
               "native_library": lib, "native_kernels": sorted(kernels), "results": results}
    harness.emit_json(args, results, summary)
    print(harness.json_line(summary))
    return summary


if __name__ == "__main__":  # pragma: no cover
    main()
