"""RNNsearch ONNX export (encoder + decoder-step graphs) and the ONNX Runtime translation backend.

* the BiGRU -> ONNX ``GRU`` weight mapping, checked against the ONNX operator's own formulas;
* ``relserve export`` on BiGRU and DeBERTa-encoder checkpoints: graph I/O, the GRU node's attributes,
  custom-domain nodes, dynamic axes, the parity report;
* a plain ``onnxruntime.InferenceSession`` on each graph vs torch at held-back lengths and batch mixes;
* beam search on the graphs gives torch's tokens;
* ``OnnxTranslationBackend``: graphs of other weights or shapes refused, the vocabulary-wide parity check,
  backend selection, the translation benchmark. (Serving it over gRPC: tests/serving/test_translate_server.py;
  the export cache's repairs: tests/serving/test_onnx_server.py.)
"""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

from fixtures.translation import make_tiny_checkpoint  # noqa: E402
from relserve.models.decoding import DecodeOptions, beam_search  # noqa: E402
from relserve.models.checkpoint import checkpoint_hash  # noqa: E402
from relserve.models.onnx.runtime import EXPORT_VERSION  # noqa: E402
from relserve.models.onnx.cli import main as export_main  # noqa: E402
from relserve.models.onnx.export_rnnsearch import onnx_bigru_reference, onnx_gru_weights  # noqa: E402
from relserve.models.onnx.runtime import OrtRNNSearch  # noqa: E402
from relserve.models.rnnsearch import RNNSearch, RNNSearchConfig  # noqa: E402
from relserve.models.checkpoint import load_translation_checkpoint  # noqa: E402
from relserve.service.backends import create_translation_backend  # noqa: E402
from relserve.service.backends.graph_cache import GraphMismatch  # noqa: E402
from relserve.service.backends.onnx_translation import OnnxTranslationBackend  # noqa: E402
from relserve.service.config import ConfigError, ModelConfig  # noqa: E402


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("onnx-translation")
    return {
        "bigru": make_tiny_checkpoint(root / "bigru", seed=11),
        "deberta": make_tiny_checkpoint(root / "deberta", seed=12, encoder="deberta"),
        "bigru-other": make_tiny_checkpoint(root / "bigru-other", seed=13),
    }


@pytest.fixture(scope="module")
def exported(checkpoints, tmp_path_factory):
    out = {}
    for kind in ("bigru", "deberta"):
        d = tmp_path_factory.mktemp(f"export-{kind}")
        assert export_main([str(checkpoints[kind]), str(d)]) == 0
        out[kind] = d
    return out


def _strip_origin(graph):
    """Drop the checkpoint hash ``relserve export`` writes into a graph's metadata (a hand-made graph)."""
    proto = onnx.load(graph)
    del proto.metadata_props[:]
    onnx.save(proto, graph)


def _sources(model, lengths, seed):
    rng = np.random.default_rng(seed)
    cfg = model.config
    ids = np.full((len(lengths), max(lengths)), cfg.pad_token_id, dtype=np.int64)
    mask = np.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, :n] = rng.integers(3, cfg.src_vocab_size, n)
        mask[b, :n] = 1
    return ids, mask


# ---------------------------------------------------------------------- the GRU mapping


def test_onnx_gru_formulas_reproduce_the_paper_bigru():
    """Our BiGRU (paper's cell, z weighs the candidate) == ONNX GRU formulas on the mapped weights, with
    padding (per-row lengths: the reverse direction starts at each row's last real word)."""
    cfg = RNNSearchConfig(src_vocab_size=50, tgt_vocab_size=40, embedding_size=7, hidden_size=5, alignment_size=6,
                          maxout_size=3)
    torch.manual_seed(0)
    model = RNNSearch(cfg).eval()
    lengths = torch.tensor([9, 1, 4, 9])
    ids = torch.randint(3, 50, (4, 9))
    mask = torch.arange(9)[None, :] < lengths[:, None]
    with torch.no_grad():
        want = model.encoder(ids, mask)
        W, R, B = onnx_gru_weights(model.encoder)
        got = onnx_bigru_reference(model.encoder.embeddings(ids), lengths, W, R, B)
    assert W.shape == (2, 15, 7) and R.shape == (2, 15, 5) and B.shape == (2, 30)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    # the sign flip is what makes it work: unflipped weights give a different function
    with torch.no_grad():
        wrong = onnx_bigru_reference(model.encoder.embeddings(ids), lengths, W.abs(), R, B)
    assert (wrong - want).abs().max() > 1e-3


# ---------------------------------------------------------------------- export


@pytest.mark.parametrize("kind", ["bigru", "deberta"])
def test_export_graphs_report_and_nodes(exported, checkpoints, kind):
    d = exported[kind]
    report = json.loads((d / "export_report.json").read_text())
    assert report["task"] == "translation" and report["encoder_type"] == kind and report["opset"] >= 17
    assert report["parity"]["passed"] and all(s["identical_tokens"] for s in report["parity"]["search"].values())
    assert max(c["encoder_max_abs_diff"] for c in report["parity"]["cases"]) < 1e-4
    assert report["checkpoint_sha256"] == checkpoint_hash(checkpoints[kind], EXPORT_VERSION)
    # the sha256 of every file written, which the server checks before loading (tests/onnx/test_graph_cache.py)
    assert report["file_sha256"] == {n: hashlib.sha256((d / n).read_bytes()).hexdigest()
                                     for n in ("decoder_step.onnx", "encoder.onnx")}
    enc = onnx.load(d / "encoder.onnx")
    dec = onnx.load(d / "decoder_step.onnx")
    onnx.checker.check_model(enc, full_check=True)
    onnx.checker.check_model(dec, full_check=True)
    assert [i.name for i in enc.graph.input] == ["src_ids", "src_mask"]
    assert [o.name for o in enc.graph.output] == ["annotations", "projected_annotations", "init_state"]
    assert [i.name for i in dec.graph.input] == ["annotations", "projected_annotations", "src_mask", "source_index",
                                                 "prev_tokens", "prev_hidden"]
    assert [o.name for o in dec.graph.output] == ["log_probs", "new_hidden", "alignment"]
    def symbolic(graph):  # which input dims are named (dynamic) axes
        return {i.name: [bool(d.dim_param) for d in i.type.tensor_type.shape.dim] for i in graph.input}

    assert symbolic(enc.graph) == {"src_ids": [True, True], "src_mask": [True, True]}
    assert symbolic(dec.graph) == {"annotations": [True, True, False], "projected_annotations": [True, True, False],
                                   "src_mask": [True, True], "source_index": [True], "prev_tokens": [True],
                                   "prev_hidden": [True, False]}
    nodes = {(n.domain, n.op_type): n for n in enc.graph.node}
    if kind == "bigru":
        gru = nodes[("", "GRU")]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in gru.attribute}
        assert attrs["direction"] == b"bidirectional" and attrs.get("linear_before_reset", 0) == 0
        assert len(gru.input) >= 5 and gru.input[4]  # sequence_lens is wired
        assert not any(n.domain == "com.relserve" for n in enc.graph.node)
    else:
        assert ("com.relserve", "DisentangledAttentionBias") in nodes
        assert ("com.relserve", "LogBucketRelativePosition") in nodes


@pytest.mark.parametrize("kind", ["bigru", "deberta"])
def test_stock_onnxruntime_sessions_match_torch_at_held_back_shapes(exported, checkpoints, kind):
    """Plain InferenceSessions (no relserve code at run time) vs torch's encode / decode_step."""
    model, _, _ = load_translation_checkpoint(checkpoints[kind])
    enc = ort.InferenceSession(str(exported[kind] / "encoder.onnx"), providers=["CPUExecutionProvider"])
    dec = ort.InferenceSession(str(exported[kind] / "decoder_step.onnx"), providers=["CPUExecutionProvider"])
    for k, lengths in enumerate([[2], [23, 5], [77, 1, 40], [130, 130], [6, 61, 2, 19, 33]]):
        ids, mask = _sources(model, lengths, seed=50 + k)
        a, pa, s0 = enc.run(None, {"src_ids": ids, "src_mask": mask})
        with torch.no_grad():
            want = model.encode(torch.from_numpy(ids), torch.from_numpy(mask))
        for b, n in enumerate(lengths):
            np.testing.assert_allclose(a[b, :n], want.annotations[b, :n].numpy(), atol=2e-5)
            np.testing.assert_allclose(pa[b, :n], want.projected_annotations[b, :n].numpy(), atol=2e-5)
        np.testing.assert_allclose(s0, want.init_state.numpy(), atol=2e-5)
        rows = np.array([len(lengths) - 1] + list(range(len(lengths))) * 2, dtype=np.int64)
        tokens = np.random.default_rng(k).integers(3, model.config.tgt_vocab_size, len(rows)).astype(np.int64)
        hidden = np.random.default_rng(k).standard_normal((len(rows), model.config.hidden_size)).astype(np.float32)
        got = dec.run(None, {"annotations": a, "projected_annotations": pa, "src_mask": mask, "source_index": rows,
                             "prev_tokens": tokens, "prev_hidden": hidden})
        with torch.no_grad():
            ref = model.decode_step(want, torch.from_numpy(rows), torch.from_numpy(tokens), torch.from_numpy(hidden))
        for g, w in zip(got, ref):
            np.testing.assert_allclose(g, w.numpy(), atol=2e-5)
        assert np.all(got[2][mask[rows] == 0] == 0)  # alignment is exactly zero at pads


@pytest.mark.parametrize("kind", ["bigru", "deberta"])
def test_beam_search_on_the_graphs_gives_torch_tokens(exported, checkpoints, kind):
    model, cfg, _ = load_translation_checkpoint(checkpoints[kind])
    ort_model = OrtRNNSearch(exported[kind], cfg)
    ids, mask = _sources(model, [11, 3, 26, 7], seed=7)
    for beam in (1, 5):
        opts = DecodeOptions(beam_size=beam, n_best=beam, max_len_cap=15, return_alignment=True)
        want = beam_search(model, torch.from_numpy(ids), torch.from_numpy(mask), opts)
        got = beam_search(ort_model, torch.from_numpy(ids), torch.from_numpy(mask), opts)
        for w, g in zip(want, got):
            assert [h.tokens for h in w] == [h.tokens for h in g]
            np.testing.assert_allclose([h.log_prob for h in w], [h.log_prob for h in g], atol=1e-4)
            for hw, hg in zip(w, g):
                np.testing.assert_allclose(hw.alignment.numpy(), hg.alignment.numpy(), atol=1e-4)
    with pytest.raises(ValueError, match="at least one token"):
        ort_model.encode(torch.from_numpy(ids), torch.zeros_like(torch.from_numpy(mask)))


def test_export_refuses_a_broken_translation_checkpoint(checkpoints, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(checkpoints["bigru"], bad)
    (bad / "model.safetensors").unlink()
    assert export_main([str(bad), str(tmp_path / "out")]) == 2
    assert "model.safetensors: missing" in capsys.readouterr().err


# ---------------------------------------------------------------------- the ONNX Runtime backend


def test_graphs_of_other_weights_are_refused(checkpoints, exported, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoints["bigru-other"], ckpt)
    shutil.copytree(exported["bigru"], ckpt / "onnx")
    cfg = ModelConfig(name="m", path=ckpt, device="cpu", backend="onnx", onnx_cache_dir=tmp_path / "cache")
    # the export report beside the graphs names another checkpoint hash
    with pytest.raises(GraphMismatch, match=r"'m'.* exported from another checkpoint .*relserve export"):
        OnnxTranslationBackend(cfg).load()
    # without a report, the hash in the graphs' metadata
    (ckpt / "onnx" / "export_report.json").unlink()
    with pytest.raises(GraphMismatch, match=r"encoder.onnx was exported from another checkpoint .*relserve export"):
        OnnxTranslationBackend(cfg).load()
    # graphs that do not say where they came from: the load-time parity check
    for name in ("encoder.onnx", "decoder_step.onnx"):
        _strip_origin(ckpt / "onnx" / name)
    with pytest.raises(GraphMismatch, match=r"differ from the torch checkpoint .* refusing to serve"):
        OnnxTranslationBackend(cfg).load()
    (ckpt / "onnx" / "decoder_step.onnx").unlink()
    with pytest.raises(GraphMismatch, match="has encoder.onnx but not decoder_step.onnx"):
        OnnxTranslationBackend(cfg).load()


def test_parity_check_reads_the_whole_vocabulary(checkpoints, exported, tmp_path):
    """Weights changed only in embedding rows the short warm-up source never reads are still caught."""
    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoints["bigru"], ckpt)
    sd = load_file(ckpt / "model.safetensors")
    w = sd["encoder.embeddings.weight"]
    w[100:] += 0.5 * torch.randn(w[100:].shape, generator=torch.Generator().manual_seed(0))
    save_file(sd, ckpt / "model.safetensors", metadata={"format": "pt"})
    shutil.copytree(exported["bigru"], ckpt / "onnx")
    (ckpt / "onnx" / "export_report.json").unlink()
    for name in ("encoder.onnx", "decoder_step.onnx"):
        _strip_origin(ckpt / "onnx" / name)
    with pytest.raises(GraphMismatch, match="refusing to serve"):
        OnnxTranslationBackend(ModelConfig(name="m", path=ckpt, device="cpu", backend="onnx")).load()


def test_graphs_of_another_shape_are_refused_by_name(checkpoints, exported, tmp_path):
    from relserve.models.onnx.export_rnnsearch import export_translation_model

    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoints["bigru"], ckpt)
    small = make_tiny_checkpoint(tmp_path / "small", seed=3, hidden=16)  # 16-wide states, not 24
    export_translation_model(load_translation_checkpoint(small)[0], ckpt / "onnx", check=False)
    with pytest.raises(GraphMismatch, match=r"model 'm': the ONNX graphs in .*onnx do not work with checkpoint "
                                            r".*re-export them with `relserve export"):
        OnnxTranslationBackend(ModelConfig(name="m", path=ckpt, device="cpu", backend="onnx")).load()


def test_backend_selection_for_translation(checkpoints):
    assert isinstance(create_translation_backend(ModelConfig(name="m", path=checkpoints["bigru"], backend="onnx")),
                      OnnxTranslationBackend)
    assert isinstance(create_translation_backend(ModelConfig(name="m", path=checkpoints["bigru"], backend="auto")),
                      OnnxTranslationBackend)
    half = create_translation_backend(ModelConfig(name="m", path=checkpoints["bigru"], backend="auto",
                                                  dtype="float16"))
    assert half.name == "torch"
    be = OnnxTranslationBackend(ModelConfig(name="m", path=checkpoints["bigru"], backend="onnx", device="cpu",
                                            dtype="bfloat16"))
    with pytest.raises(ConfigError, match="float32 graphs only"):
        be.load()


def test_translation_benchmark_runs_and_agrees(checkpoints, tmp_path):
    from relserve.loadtest.bench import onnx_translation as bench_onnx_translation

    out = tmp_path / "bench.json"
    summary = bench_onnx_translation.main(["--model", str(checkpoints["deberta"]), "--batch", "3", "--beam", "2",
                                           "--repeats", "1", "--threads", "1", "--json", str(out)])
    (row,) = summary["results"]
    assert row["identical_beam_tokens"] and row["step_max_abs_diff"] < 1e-4 and row["encoder"] == "deberta"
    assert set(row["torch_over_ort"]) == {"encode", "step", "beam"} and all(v > 0 for v in row["torch_over_ort"].values())
    assert json.loads(out.read_text())["results"][0]["batch"] == 3


def test_a_failed_export_leaves_out_dir_unchanged(checkpoints, exported, tmp_path, capsys):
    """Opset 17 cannot express the decoder step (the exporter stays at 18): the export fails after writing a
    graph, but only into its staging folder, which is removed; the previous export in OUT_DIR is untouched."""
    out = tmp_path / "out"
    shutil.copytree(exported["bigru"], out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert export_main([str(checkpoints["bigru"]), str(out), "--opset", "17"]) == 1
    assert "not the requested 17" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # and no staging folder left behind
