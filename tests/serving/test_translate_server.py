"""Translation through a real grpc.aio server on a free loopback port, with real (tiny, random) RNNsearch
checkpoints loaded by ``build_runner`` from their directories: unary and streaming, n-best and alignments,
C09 and C10, batch invariance (short and long sources mixed in one request and across concurrent
requests vs solo; newcomers held and encoded together while another request decodes vs solo), status codes, deadline/cancel leaving nothing behind, metrics, backend=onnx giving torch's
answers, runner wiring from the config."""

from __future__ import annotations

import concurrent.futures
import math
import time
import urllib.request

import grpc
import numpy as np
import pytest

from fixtures.fake_serving import runner as fake_runner
from fixtures.fake_serving import server_config
from fixtures.server import Running
from fixtures.translation import REPO, make_tiny_checkpoint, sentence_pairs
from relserve.models.checkpoint import checkpoint_hash
from relserve.models.onnx.runtime import EXPORT_VERSION
from relserve.service._proto import inference_pb2 as pb
from relserve.service.config import ModelConfig, load_config
from relserve.service.registry import build_runner
from relserve.service.runner import TranslationRunner

TEN_WORDS = "Der alte Mann ging gestern Abend mit seinem Hund spazieren."


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("translation")
    return {
        "bigru": make_tiny_checkpoint(root / "bigru", seed=1),
        "deberta": make_tiny_checkpoint(root / "deberta", seed=2, encoder="deberta"),
    }


@pytest.fixture(scope="module")
def srv(checkpoints):
    # float32 pinned: batched-vs-alone equality to 1e-5 is a float32 property (dtype auto may pick bfloat16)
    cfg = dict(device="cpu", dtype="float32", max_source_tokens=120, max_batch_tokens=4096, max_queue_delay=0.002)
    runners = [
        build_runner(ModelConfig(name="tr", path=checkpoints["bigru"], **cfg)),
        build_runner(ModelConfig(name="tr-deberta", path=checkpoints["deberta"], **cfg)),
        build_runner(ModelConfig(name="tr-request", path=checkpoints["bigru"], scheduling="request", **cfg)),
        fake_runner("sentiment"),
    ]
    s = Running(server_config(), runners)
    s.wait_serving(timeout=60)
    yield s
    s.close()


def _code(call, *args, **kw):
    with pytest.raises(grpc.RpcError) as err:
        call(*args, **kw)
    return err.value.code(), err.value.details()


def translate(srv, texts, **kw):
    kw.setdefault("model", "tr")
    return srv.stub.Translate(pb.TranslateRequest(texts=texts, **kw), timeout=60).results


def hyp_key(h):
    return (list(h.token_ids), h.text, h.truncated)


def dev_sources() -> list[str]:
    return [s for s, _ in sentence_pairs(200)]


def nothing_left(srv, name="tr"):
    r = srv.server.registry.runners[name]
    end = time.monotonic() + 5
    while time.monotonic() < end:
        if not r.loop.queue_depth and not r.loop.active_sequences and not r.backend.stepper.beams:
            return True
        time.sleep(0.01)
    return False


# ---------------------------------------------------------------------- basics

def test_runner_kind_and_list_models(srv):
    assert isinstance(srv.server.registry.runners["tr"], TranslationRunner)
    models = {m.name: m for m in srv.stub.ListModels(pb.ListModelsRequest()).models}
    assert models["tr"].task == "translation" and models["tr"].family == "rnnsearch-bigru"
    assert models["tr-deberta"].family == "rnnsearch-deberta" and models["tr"].max_seq_len == 120
    assert models["sentiment"].task == "classification"


def test_unary_nbest_sorted_with_alignment(srv):
    (res,) = translate(srv, ["Das Wetter ist heute schön."], beam_size=4, n_best=3, return_alignment=True)
    hyps = res.hypotheses
    assert len(hyps) == 3
    assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
    for h in hyps:
        a = h.alignment
        assert list(a.source_tokens)[-1] == "</s>" and len(a.source_tokens) == res.num_source_tokens
        finished = not h.truncated
        assert list(a.target_tokens) == list(h.tokens) + (["</s>"] if finished else [])
        assert len(a.weights) == len(a.target_tokens) * len(a.source_tokens)
        n = len(a.source_tokens)
        for i in range(len(a.target_tokens)):
            assert abs(sum(a.weights[i * n:(i + 1) * n]) - 1.0) < 1e-4
        assert math.isfinite(h.log_prob) and h.log_prob <= 0
    plain = translate(srv, ["Das Wetter ist heute schön."], beam_size=4, n_best=3)[0]
    assert not plain.hypotheses[0].HasField("alignment")
    assert [hyp_key(h) for h in plain.hypotheses] == [hyp_key(h) for h in hyps]


@pytest.mark.parametrize("model", ["tr", "tr-deberta", "tr-request"])
def test_stream_grows_then_final_equals_unary(srv, model):
    text = "Wir sehen uns morgen im Büro."
    msgs = list(srv.stub.TranslateStream(pb.TranslateStreamRequest(model=model, text=text, beam_size=3, n_best=2),
                                         timeout=60))
    assert msgs[-1].final and not any(m.final for m in msgs[:-1]) and len(msgs) >= 2
    steps = [m.step for m in msgs]
    assert steps == sorted(steps) and len(set(steps[:-1])) == len(steps) - 1
    unary = translate(srv, [text], model=model, beam_size=3, n_best=2)[0]
    final = msgs[-1].result
    assert [hyp_key(h) for h in final.hypotheses] == [hyp_key(h) for h in unary.hypotheses]
    assert msgs[-1].text == unary.hypotheses[0].text
    assert all(len(m.tokens) == m.step for m in msgs[:-1])  # the best live hypothesis grows one token a step


def test_stream_blank_text_single_final_message(srv):
    msgs = list(srv.stub.TranslateStream(pb.TranslateStreamRequest(model="tr", text="  "), timeout=10))
    assert len(msgs) == 1 and msgs[0].final and msgs[0].text == "" and msgs[0].result.hypotheses[0].text == ""


# ---------------------------------------------------------------------- cases

def test_case_C09_beam_under_tight_length_limit(srv):
    assert len(TEN_WORDS.split()) == 10
    for model in ("tr", "tr-deberta"):
        (res,) = translate(srv, [TEN_WORDS], model=model, beam_size=5, n_best=5, max_length=3)
        hyps = res.hypotheses
        assert len(hyps) == 5
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        for h in hyps:
            assert len(h.token_ids) + (0 if h.truncated else 1) <= 3  # EOS counts
            assert h.truncated == (len(h.token_ids) == 3)  # truncated = never produced EOS


def test_case_C10_nothing_to_translate(srv):
    batch = ["", " ", "-", "Guten Morgen"]
    results = translate(srv, batch, beam_size=4, n_best=2)
    for r in results[:2]:
        assert [(h.text, h.score, h.truncated, len(h.tokens)) for h in r.hypotheses] == [("", 0.0, False, 0)]
        assert r.num_source_tokens == 0
    dash = results[2]
    src_len = dash.num_source_tokens
    assert 1 <= src_len <= 3
    assert all(len(h.token_ids) <= 2 * src_len + 10 for h in dash.hypotheses)  # bounded by the length formula
    solo = translate(srv, ["Guten Morgen"], beam_size=4, n_best=2)[0]
    assert [hyp_key(h) for h in results[3].hypotheses] == [hyp_key(h) for h in solo.hypotheses]
    steps_before = srv.server.registry.runners["tr"].loop.steps
    blank_only = translate(srv, ["", "\t \n", "\u200b", "\u2060\ufeff "])  # zero-width only is blank too
    assert [r.hypotheses[0].text for r in blank_only] == ["", "", "", ""]
    assert srv.server.registry.runners["tr"].loop.steps == steps_before  # the model never ran


# ---------------------------------------------------------------------- batch invariance

@pytest.mark.parametrize("beam_size", [1, 4])
def test_batch_invariance_mixed_lengths_item_by_item(srv, beam_size):
    sources = sorted(dev_sources(), key=len)
    mixed = [sources[0], "Ja.", sources[-1], sources[len(sources) // 2], sources[-2], "Nein"]
    together = translate(srv, mixed, beam_size=beam_size, n_best=beam_size)
    solo = [translate(srv, [t], beam_size=beam_size, n_best=beam_size)[0] for t in mixed]
    for t, a, b in zip(mixed, together, solo):
        if beam_size == 1:  # greedy: identical tokens
            assert list(a.hypotheses[0].token_ids) == list(b.hypotheses[0].token_ids), t
        else:  # beam: identical best hypothesis
            assert hyp_key(a.hypotheses[0]) == hyp_key(b.hypotheses[0]), t
            assert abs(a.hypotheses[0].score - b.hypotheses[0].score) < 1e-5
        assert len(a.hypotheses) == beam_size


def test_batch_invariance_across_concurrent_requests_joining_between_steps(srv):
    loop = srv.server.registry.runners["tr"].loop
    texts = sorted(dev_sources(), key=len)
    texts = texts[:4] + texts[-4:]
    solo = [translate(srv, [t], beam_size=2)[0] for t in texts]
    loop.plans.clear()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(translate, srv, [t], beam_size=2) for t in texts]
        together = [f.result()[0] for f in futs]
    for t, a, b in zip(texts, together, solo):
        assert hyp_key(a.hypotheses[0]) == hyp_key(b.hypotheses[0]), t
    assert max(len(p.seq_ids) for p in loop.plans) >= 2  # they really shared steps


@pytest.fixture(scope="module")
def held_srv(checkpoints):
    """Both encoders with a long encode_batch_delay_ms (so that a burst of concurrent newcomers is held while
    another request decodes and then encoded together) and fp32."""
    cfg = dict(device="cpu", dtype="float32", max_source_tokens=120, max_batch_tokens=4096, max_queue_delay=0.002,
               encode_batch_delay_ms=300)
    runners = [build_runner(ModelConfig(name=f"held-{kind}", path=checkpoints[kind], **cfg))
               for kind in ("bigru", "deberta")]
    s = Running(server_config(metrics_port=None), runners)
    s.wait_serving(timeout=60)
    yield s
    s.close()


@pytest.mark.parametrize("kind", ["bigru", "deberta"])
def test_newcomers_encoded_together_while_decoding_equal_solo(held_srv, kind):
    model = f"held-{kind}"
    loop = held_srv.server.registry.runners[model].loop
    sources = sorted(dev_sources(), key=len)
    burst = [sources[0], "Ja.", sources[-1], sources[len(sources) // 2], TEN_WORDS, "Nein", sources[-2],
             sources[len(sources) // 3]]
    solo = [translate(held_srv, [t], model=model, beam_size=3, n_best=3)[0] for t in burst]
    with concurrent.futures.ThreadPoolExecutor(len(burst) + 1) as pool:
        # the tiny random model never emits EOS under beam 16: the anchor decodes all 256 steps
        anchor = pool.submit(translate, held_srv, sources[-4:], model=model, beam_size=16, max_length=256)
        while loop.active_sequences < 4:  # the anchor decodes; the burst arrives as newcomers
            time.sleep(0.001)
        batches, encoded, held = loop.encoder_batches, loop.encoded_sequences, loop.held_steps
        futs = [pool.submit(translate, held_srv, [t], model=model, beam_size=3, n_best=3) for t in burst]
        together = [f.result()[0] for f in futs]
        anchor.result()
    assert loop.encoded_sequences - encoded == len(burst)
    # held while the anchor decoded (the loop stepped without them), then encoded in fewer calls than texts
    assert loop.held_steps > held and loop.encoder_batches - batches < len(burst)
    for t, a, b in zip(burst, together, solo):
        assert [list(h.token_ids) for h in a.hypotheses] == [list(h.token_ids) for h in b.hypotheses], t
        np.testing.assert_allclose([h.score for h in a.hypotheses], [h.score for h in b.hypotheses], atol=1e-5)
        # log_prob sums up to 256 token log-probs (-200 and below here): float32 row rounding adds up, so it is
        # compared relative to its size; score, the per-token mean that ranks hypotheses, is held to 1e-5
        np.testing.assert_allclose([h.log_prob for h in a.hypotheses], [h.log_prob for h in b.hypotheses],
                                   rtol=1e-6, atol=1e-5)
    assert nothing_left(held_srv, model)


# ---------------------------------------------------------------------- errors

@pytest.mark.parametrize("request_kw, fragment", [
    ({"texts": []}, "texts is empty"),
    ({"texts": ["x"], "beam_size": 17}, "beam_size 17"),
    ({"texts": ["x"], "beam_size": 2, "n_best": 3}, "n_best 3"),
    ({"texts": ["x"], "n_best": 6}, "1..beam_size (5)"),
    ({"texts": ["x"], "max_length": 1000}, "max_output_tokens 256"),
    ({"texts": ["ok", "Wort " * 200]}, "max_source_tokens 120"),
])
def test_invalid_argument(srv, request_kw, fragment):
    code, details = _code(srv.stub.Translate, pb.TranslateRequest(model="tr", **request_kw))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and fragment in details, details
    assert nothing_left(srv)


def test_model_status_codes(srv):
    code, details = _code(srv.stub.Translate, pb.TranslateRequest(model="nope", texts=["x"]))
    assert code == grpc.StatusCode.NOT_FOUND and "tr" in details
    code, details = _code(srv.stub.Translate, pb.TranslateRequest(model="sentiment", texts=["x"]))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "Classify" in details
    code, details = _code(srv.stub.Classify, pb.ClassifyRequest(model="tr", texts=["x"]))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "Translate" in details
    code, _ = _code(lambda r: list(srv.stub.TranslateStream(r)), pb.TranslateStreamRequest(model="tr", text="x",
                                                                                              beam_size=99))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert translate(srv, ["Guten Morgen"])[0].hypotheses  # nothing lost: still serving


def test_deadline_and_cancel_leave_nothing_behind(srv):
    long_text = sorted(dev_sources(), key=len)[-1]
    code, _ = _code(srv.stub.Translate, pb.TranslateRequest(model="tr", texts=[long_text] * 4, beam_size=8),
                    timeout=0.05)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    stream = srv.stub.TranslateStream(pb.TranslateStreamRequest(model="tr", text=long_text, beam_size=8),
                                      timeout=30)
    next(stream)
    stream.cancel()
    assert nothing_left(srv)
    assert translate(srv, ["Guten Morgen"])[0].hypotheses


def _scrape(srv) -> tuple[str, dict[tuple[str, str], float]]:
    """/metrics text and its samples of model "tr" by (sample name, sorted other labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=5).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model") == "tr":
                rest = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model")
                samples[(s.name, rest)] = s.value
    return text, samples


def test_metrics(srv):
    loop = srv.server.registry.runners["tr"].loop
    _, before = _scrape(srv)
    steps_before = loop.steps
    translate(srv, ["Guten Morgen"], beam_size=3)
    text, after = _scrape(srv)

    def delta(name: str) -> float:
        return after.get((name, ""), 0.0) - before.get((name, ""), 0.0)

    # the decode metrics of model "tr" moved with what its loop did: one step sample per decoder step, one
    # generated token per live hypothesis per step (<= beam size), nothing left live afterwards
    steps = delta("relserve_decode_steps_total")
    assert steps == loop.steps - steps_before >= 1, (steps, loop.steps - steps_before)
    assert delta("relserve_decode_step_hypotheses_count") == steps
    tokens = delta("relserve_generated_tokens_total")
    assert delta("relserve_decode_step_hypotheses_sum") == tokens and steps <= tokens <= 3 * steps
    assert after[("relserve_active_hypotheses", "")] == 0
    assert 'relserve_requests_total{code="OK",model="tr",protocol="grpc_v1",task="translation"}' in text
    assert 'relserve_queue_duration_seconds_count{model="tr"}' in text
    assert 'relserve_inference_duration_seconds_count{backend="torch",model="tr"}' in text
    dtype = srv.server.registry.runners["tr"].info().dtype  # dtype auto: float32, or bfloat16 where it is native
    assert f'relserve_model_info{{backend="torch",device="cpu",dtype="{dtype}",family="rnnsearch-bigru"' in text


# ---------------------------------------------------------------------- backend=onnx (ONNX Runtime) vs torch


@pytest.fixture(scope="module")
def onnx_srv(checkpoints, tmp_path_factory):
    pytest.importorskip("onnxruntime")
    cache_dir = tmp_path_factory.mktemp("onnx-translation-cache")
    # float32 pinned: torch is compared with the float32 graphs
    common = dict(device="cpu", dtype="float32", max_source_tokens=120, max_queue_delay=0.002)
    runners = [build_runner(ModelConfig(name=f"{kind}-{backend}", path=checkpoints[kind], backend=backend,
                                        onnx_cache_dir=cache_dir, **common))
               for kind in ("bigru", "deberta") for backend in ("torch", "onnx")]
    s = Running(server_config(), runners)
    s.wait_serving(timeout=150)
    yield s, cache_dir
    s.close()


def test_server_lists_the_provider_and_exports_into_the_cache(onnx_srv, checkpoints):
    srv, cache_dir = onnx_srv
    models = {m.name: m for m in srv.stub.ListModels(pb.ListModelsRequest()).models}
    assert models["bigru-onnx"].backend == "onnxruntime" and models["bigru-onnx"].device == "CPUExecutionProvider"
    assert models["bigru-torch"].backend == "torch" and models["bigru-onnx"].task == "translation"
    for kind in ("bigru", "deberta"):
        d = cache_dir / checkpoint_hash(checkpoints[kind], EXPORT_VERSION)
        assert (d / "encoder.onnx").is_file() and (d / "decoder_step.onnx").is_file()


@pytest.mark.parametrize("kind", ["bigru", "deberta"])
def test_translate_equal_on_both_backends(onnx_srv, kind):
    srv, _ = onnx_srv
    texts = ["Guten Morgen.", TEN_WORDS, "Ja", "Wie geht es dir?"]
    for beam in (1, 4):
        kw = dict(texts=texts, beam_size=beam, n_best=min(beam, 2), max_length=20, return_alignment=True)
        a = srv.stub.Translate(pb.TranslateRequest(model=f"{kind}-torch", **kw), timeout=60).results
        b = srv.stub.Translate(pb.TranslateRequest(model=f"{kind}-onnx", **kw), timeout=60).results
        assert len(a) == len(b) == len(texts)
        for x, y in zip(a, b):
            assert [list(h.token_ids) for h in x.hypotheses] == [list(h.token_ids) for h in y.hypotheses]
            assert [h.text for h in x.hypotheses] == [h.text for h in y.hypotheses]
            np.testing.assert_allclose([h.score for h in x.hypotheses], [h.score for h in y.hypotheses], atol=1e-4)


def test_stream_on_onnx_backend(onnx_srv):
    srv, _ = onnx_srv
    req = pb.TranslateRequest(model="bigru-onnx", texts=["Das Wetter ist heute schön."], beam_size=3, max_length=12)
    unary = srv.stub.Translate(req, timeout=60).results[0]
    msgs = list(srv.stub.TranslateStream(req, timeout=60))
    assert msgs[-1].final and [h.text for h in msgs[-1].result.hypotheses] == [h.text for h in unary.hypotheses]


# ---------------------------------------------------------------------- runner wiring

def test_model_flag_builds_a_translation_runner(checkpoints):
    """An RNNsearch directory given with --model is served by the translation runner (config keys:
    tests/unit/test_config.py)."""
    cfg = load_config(model_specs=[f"de-en={checkpoints['bigru']},scheduling=request,max_active_hypotheses=64"])
    assert isinstance(build_runner(cfg.model("de-en")), TranslationRunner)


# ---------------------------------------------------------------------- the real default, when present

DEFAULT_DE_EN = REPO / "defaults" / "translate-de-en"


@pytest.mark.skipif(not (DEFAULT_DE_EN / "model.safetensors").is_file(), reason="defaults/translate-de-en not built")
def test_default_de_en_model_case_C10():
    s = Running(server_config(metrics_port=None),
                [build_runner(ModelConfig(name="de-en", path=DEFAULT_DE_EN, device="cpu"))])
    try:
        s.wait_serving(timeout=120)
        res = translate(s, ["", " ", "-", "Guten Morgen"], model="de-en")
        assert res[0].hypotheses[0].text == res[1].hypotheses[0].text == ""
        dash = res[2].hypotheses[0]
        assert len(dash.token_ids) <= 2 * res[2].num_source_tokens + 10
        words = dash.text.split()
        assert not words or max(words.count(w) for w in set(words)) <= 3, dash.text  # no runaway repetition
        solo = translate(s, ["Guten Morgen"], model="de-en")[0]
        assert res[3].hypotheses[0].text == solo.hypotheses[0].text and solo.hypotheses[0].text
    finally:
        s.close()
