"""backend=torch and backend=onnx serving the same tiny checkpoints through a real grpc.aio server: equal
answers over gRPC, the ONNX provider in ListModels, export-on-first-load into the cache (keyed by checkpoint
hash), the load-time parity self-check refusing a graph that belongs to other weights, backend=auto; the export
cache's repairs for both model families (encoder and translation graphs)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

from fixtures.fake_serving import server_config  # noqa: E402
from fixtures.server import Running  # noqa: E402
from fixtures.deberta import make_deberta_checkpoint  # noqa: E402
from fixtures.translation import make_tiny_checkpoint  # noqa: E402
from relserve.models.checkpoint import checkpoint_hash  # noqa: E402
from relserve.models.onnx.runtime import EXPORT_VERSION  # noqa: E402
from relserve.service._proto import inference_pb2 as pb  # noqa: E402
from relserve.service.backends import create_backend  # noqa: E402
from relserve.service.backends.graph_cache import GraphMismatch  # noqa: E402
from relserve.service.backends.onnx_encoder import OnnxBackend  # noqa: E402
from relserve.service.config import ConfigError, ModelConfig  # noqa: E402
from relserve.service.registry import build_runner  # noqa: E402

CONTEXT = "Ann lives in Berlin and works as a baker. Her brother Tom lives in Paris. " * 8


def _strip_origin(graph):
    """Drop the checkpoint hash ``relserve export`` writes into a graph's metadata (a hand-made graph)."""
    import onnx

    proto = onnx.load(graph)
    del proto.metadata_props[:]
    onnx.save(proto, graph)


@pytest.fixture(scope="module")
def checkpoints(unigram_tokenizer_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("onnx-ckpt")
    out = {}
    for name, task, seed in (("cls", "classification", 1), ("qa", "question-answering", 2),
                             ("cls-other", "classification", 3)):
        out[name] = make_deberta_checkpoint(root / name, task=task, tokenizer_dir=unigram_tokenizer_dir,
                                            labels=("a", "b", "c"), init="spread", seed=seed).path
    return out


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("onnx-cache")


@pytest.fixture(scope="module")
def srv(checkpoints, cache_dir):
    # compute in-process: worker processes have their own tests (test_worker_process.py, test_worker_pool.py)
    common = dict(device="cpu", max_seq_len=128, max_queue_delay=0.002, doc_stride=32, worker_process=False)
    runners = [
        # torch pinned to float32 (compared with the float32 graphs); the onnx models keep dtype auto
        build_runner(ModelConfig(name="cls-torch", path=checkpoints["cls"], dtype="float32", **common)),
        build_runner(ModelConfig(name="cls-onnx", path=checkpoints["cls"], backend="onnx", onnx_cache_dir=cache_dir,
                                 onnx_intra_op_threads=1, **common)),
        build_runner(ModelConfig(name="qa-torch", path=checkpoints["qa"], dtype="float32", **common)),
        build_runner(ModelConfig(name="qa-onnx", path=checkpoints["qa"], backend="onnx", onnx_cache_dir=cache_dir,
                                 **common)),
    ]
    s = Running(server_config(), runners)
    s.wait_serving(timeout=150)
    yield s
    s.close()


def test_list_models_shows_the_provider(srv):
    models = {m.name: m for m in srv.stub.ListModels(pb.ListModelsRequest()).models}
    assert models["cls-torch"].backend == "torch" and models["cls-torch"].device == "cpu"
    assert models["cls-onnx"].backend == "onnxruntime"
    assert models["cls-onnx"].device == "CPUExecutionProvider"
    assert (models["cls-onnx"].dtype, models["cls-onnx"].dtype_reason) == (
        "float32", "dtype: auto; the onnx backend runs float32 graphs only")
    assert models["qa-onnx"].task == "question-answering"


def test_export_on_first_load_lands_in_the_cache(srv, checkpoints, cache_dir):
    for name in ("cls", "qa"):
        assert (cache_dir / checkpoint_hash(checkpoints[name], EXPORT_VERSION) / "model.onnx").is_file()
    assert not any(p.name.startswith("tmp") for p in cache_dir.iterdir())


def test_classify_equal_on_both_backends(srv):
    texts = ["some text", "some longer text about Berlin", "word " * 200, "x"]
    a = srv.stub.Classify(pb.ClassifyRequest(model="cls-torch", texts=texts), timeout=30).results
    b = srv.stub.Classify(pb.ClassifyRequest(model="cls-onnx", texts=texts), timeout=30).results
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert x.num_tokens == y.num_tokens and x.truncated == y.truncated
        assert [s.label for s in x.labels] == [s.label for s in y.labels]
        np.testing.assert_allclose([s.score for s in x.labels], [s.score for s in y.labels], atol=1e-5)


def test_answer_equal_on_both_backends(srv):
    for question in ("Where does Ann live?", "Who is Tom?"):
        kw = dict(question=question, context=CONTEXT, top_k=3, allow_impossible=True)
        a = srv.stub.Answer(pb.AnswerRequest(model="qa-torch", **kw), timeout=30)
        b = srv.stub.Answer(pb.AnswerRequest(model="qa-onnx", **kw), timeout=30)
        assert a.num_windows == b.num_windows >= 2
        assert [(x.text, x.start, x.end) for x in a.answers] == [(x.text, x.start, x.end) for x in b.answers]
        np.testing.assert_allclose([x.score for x in a.answers], [x.score for x in b.answers], atol=1e-4)


def test_graph_of_other_weights_is_refused(srv, checkpoints, cache_dir, tmp_path, caplog):
    """A model.onnx beside the checkpoint that was exported from other weights fails the load-time check."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoints["cls-other"], ckpt)
    shutil.copyfile(cache_dir / checkpoint_hash(checkpoints["cls"], EXPORT_VERSION) / "model.onnx", ckpt / "model.onnx")
    be = OnnxBackend(ModelConfig(name="m", path=ckpt, device="cpu", backend="onnx", max_seq_len=64))
    with pytest.raises(GraphMismatch, match=r"exported from another checkpoint .*relserve export"):
        be.load()  # the hash in the graph's metadata
    _strip_origin(ckpt / "model.onnx")
    with caplog.at_level("WARNING"), pytest.raises(GraphMismatch, match=r"differs from the torch checkpoint .* refusing"):
        OnnxBackend(ModelConfig(name="m", path=ckpt, device="cpu", backend="onnx", max_seq_len=64)).load()
    assert "does not record which checkpoint it was exported from" in caplog.text
    (ckpt / "model.onnx").unlink()
    (ckpt / "onnx").mkdir()
    (ckpt / "onnx" / "model.onnx").symlink_to(ckpt / "gone.onnx")  # dangling: not silently skipped
    with pytest.raises(GraphMismatch, match="is not a readable file"):
        OnnxBackend(ModelConfig(name="m", path=ckpt, device="cpu", backend="onnx", max_seq_len=64)).load()
    (ckpt / "onnx" / "model.onnx").unlink()
    # the graph of the right weights, placed beside the checkpoint, is used without an export
    shutil.copyfile(cache_dir / checkpoint_hash(checkpoints["cls"], EXPORT_VERSION) / "model.onnx", ckpt / "model.onnx")
    be = OnnxBackend(ModelConfig(name="m", path=checkpoints["cls"], device="cpu", backend="onnx", max_seq_len=64,
                                 onnx_cache_dir=cache_dir))
    meta = be.load()
    assert meta.backend == "onnxruntime" and be.parity_diff is not None and be.parity_diff < 1e-4


def test_backend_auto_and_dtype(checkpoints):
    """backend=auto picks ONNX Runtime for float32 and torch for half precision; the ONNX backend refuses a half
    dtype at load (the config check is in tests/unit/test_config.py)."""
    inproc = dict(worker_process=False)
    assert isinstance(create_backend(ModelConfig(name="m", path=checkpoints["cls"], backend="auto", **inproc)),
                      OnnxBackend)
    assert create_backend(ModelConfig(name="m", path=checkpoints["cls"], backend="auto", dtype="float16",
                                      **inproc)).name == "torch"
    # the default: the same choice, computed in a worker process
    assert create_backend(ModelConfig(name="m", path=checkpoints["cls"], backend="auto")).name == "onnx"
    be = OnnxBackend(ModelConfig(name="m", path=checkpoints["cls"], backend="onnx", device="cpu", dtype="bfloat16"))
    with pytest.raises(ConfigError, match="float32 graphs only"):
        be.load()


def test_graph_provenance_and_vocabulary_wide_check(checkpoints, cache_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from relserve.models.onnx.runtime import REPORT_NAME

    entry = cache_dir / checkpoint_hash(checkpoints["cls"], EXPORT_VERSION)
    # 1. graphs + report of another checkpoint beside this one: refused by the recorded hash
    ckpt = tmp_path / "other"
    shutil.copytree(checkpoints["cls-other"], ckpt)
    shutil.copytree(entry, ckpt / "onnx")
    assert (ckpt / "onnx" / REPORT_NAME).is_file()
    with pytest.raises(GraphMismatch, match=r"exported from another checkpoint .*relserve export"):
        OnnxBackend(ModelConfig(name="m", path=ckpt, device="cpu", backend="onnx", max_seq_len=64)).load()
    # 2. embedding rows the short warm-up item never reads, changed; no report: the long item catches it
    ckpt = tmp_path / "rows"
    shutil.copytree(checkpoints["cls"], ckpt)
    sd = load_file(ckpt / "model.safetensors")
    key = next(k for k in sd if k.endswith("word_embeddings.weight"))
    sd[key][100:] += 0.5 * torch.randn(sd[key][100:].shape, generator=torch.Generator().manual_seed(0))
    save_file(sd, ckpt / "model.safetensors", metadata={"format": "pt"})
    (ckpt / "onnx").mkdir()
    shutil.copyfile(entry / "model.onnx", ckpt / "onnx" / "model.onnx")
    _strip_origin(ckpt / "onnx" / "model.onnx")  # a graph that does not say where it came from
    with pytest.raises(GraphMismatch, match="refusing to serve"):
        OnnxBackend(ModelConfig(name="m", path=ckpt, device="cpu", backend="onnx", max_seq_len=64)).load()


# ---------------------------------------------------------------------- the export cache, both model families
# (service/backends: graphs keyed by checkpoint hash; a bad entry is repaired, never served or fatal)


@pytest.fixture(scope="module")
def translation_checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("onnx-cache-translation") / "bigru", seed=11)


def test_a_corrupted_encoder_cache_entry_is_exported_again(checkpoints, tmp_path):
    """A truncated graph in the cache is exported again instead of failing every restart."""
    cache = tmp_path / "cache"
    cfg = ModelConfig(name="m", path=checkpoints["cls"], device="cpu", backend="onnx", max_seq_len=64,
                      onnx_cache_dir=cache)
    OnnxBackend(cfg).load()
    graph = cache / checkpoint_hash(checkpoints["cls"], EXPORT_VERSION) / "model.onnx"
    graph.write_bytes(graph.read_bytes()[:1000])
    be = OnnxBackend(cfg)
    be.load()
    assert be.parity_diff < 1e-4 and graph.stat().st_size > 1000


def test_a_broken_translation_cache_entry_is_exported_again(translation_checkpoint, tmp_path):
    from relserve.service.backends.onnx_translation import OnnxTranslationBackend

    cfg = ModelConfig(name="m", path=translation_checkpoint, device="cpu", backend="onnx", onnx_cache_dir=tmp_path)
    OnnxTranslationBackend(cfg).load()
    entry = tmp_path / checkpoint_hash(translation_checkpoint, EXPORT_VERSION)
    (entry / "decoder_step.onnx").write_bytes(b"not a protobuf")  # truncated / corrupted
    be = OnnxTranslationBackend(cfg)
    be.load()
    assert be.parity_diff < 1e-4 and (entry / "decoder_step.onnx").stat().st_size > 1000
    (entry / "encoder.onnx").unlink()  # incomplete
    be = OnnxTranslationBackend(cfg)
    be.load()
    assert (entry / "encoder.onnx").is_file()


def test_a_fresh_translation_export_failing_parity_is_not_exported_again(translation_checkpoint, tmp_path,
                                                                         monkeypatch):
    """Both graphs exported in this load fail the (impossibly strict) parity check: one export, and the error
    names the measured difference and the tolerance keys, not "delete the cache entry"."""
    from relserve.service.backends import onnx_translation

    exports = []
    real = onnx_translation.export_translation_checkpoint
    monkeypatch.setattr(onnx_translation, "export_translation_checkpoint",
                        lambda *a, **kw: exports.append(a) or real(*a, **kw))
    cfg = ModelConfig(name="m", path=translation_checkpoint, device="cpu", backend="onnx", onnx_cache_dir=tmp_path,
                      onnx_parity_tolerance=1e-12, onnx_parity_rtol=0.0)
    with pytest.raises(GraphMismatch) as err:
        onnx_translation.OnnxTranslationBackend(cfg).load()
    message = str(err.value)
    assert len(exports) == 1
    assert "max |diff| " in message and "(atol 1e-12, rtol 0)" in message
    assert "onnx_parity_tolerance" in message and "onnx_parity_rtol" in message and "delete" not in message


def test_cache_entry_edge_cases(translation_checkpoint, tmp_path):
    """A stray file or a symlink where the entry belongs is replaced by a real entry, readable by other users;
    an onnx_cache_dir that is a file is a config error naming it."""
    from relserve.service.backends.onnx_translation import OnnxTranslationBackend

    ckpt = translation_checkpoint
    cfg = ModelConfig(name="m", path=ckpt, device="cpu", backend="onnx", onnx_cache_dir=tmp_path / "c")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / checkpoint_hash(ckpt, EXPORT_VERSION)).write_text("a stray file where the entry belongs")
    OnnxTranslationBackend(cfg).load()
    assert (tmp_path / "c" / checkpoint_hash(ckpt, EXPORT_VERSION) / "encoder.onnx").is_file()
    entry = tmp_path / "c" / checkpoint_hash(ckpt, EXPORT_VERSION)
    shutil.rmtree(entry)
    (tmp_path / "elsewhere").mkdir()
    entry.symlink_to(tmp_path / "elsewhere")  # a link where the entry belongs: replaced by a real entry
    OnnxTranslationBackend(cfg).load()
    assert not entry.is_symlink() and (entry / "decoder_step.onnx").is_file()
    assert oct((entry / "encoder.onnx").stat().st_mode & 0o777) == "0o644"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="onnx_cache_dir .* cannot be used as a directory"):
        OnnxTranslationBackend(ModelConfig(name="m", path=ckpt, device="cpu", backend="onnx",
                                           onnx_cache_dir=tmp_path / "file")).load()
