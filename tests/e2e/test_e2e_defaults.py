"""End to end: the real ``relserve serve`` process on the built-in default models.

Started exactly as README's ``make serve`` does (no ``--model``: the defaults in ``defaults/``), on free
loopback ports. Real shared dev sentences and questions go through Classify and Answer; the health
service, reflection and ``/metrics`` are checked; the handed cases C03-C08 and C12 are checked with
their values; bad input gets the documented status and the server keeps serving.
"""

from __future__ import annotations

import collections
import concurrent.futures
import re
import string
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest

from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from relserve.loadtest.serverproc import ServerProcess
from relserve.models.tokenization import load_tokenizer
from relserve.service._proto import inference_pb2 as pb
from relserve.service._proto import inference_pb2_grpc as pb_grpc

from fixtures.data import jsonl, qa_rows

REPO = Path(__file__).resolve().parents[2]
DEFAULTS = REPO / "defaults"


@pytest.fixture(scope="module")
def server(defaults_serving):
    return defaults_serving


def _code(fn, *args, **kwargs) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        fn(*args, timeout=60, **kwargs)
    return err.value.code(), err.value.details()


# ---------------------------------------------------------------------------------------- the service
def test_health_reflection_and_models(server):
    _, stub, channel = server
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "relserve.v1.Inference"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                              timeout=10)
    names = {s.name for r in replies for s in r.list_services_response.service}
    assert {"relserve.v1.Inference", "grpc.health.v1.Health"} <= names
    models = {m.name: m for m in stub.ListModels(pb.ListModelsRequest(), timeout=10).models}
    assert models["sentiment"].task == "classification"
    assert list(models["sentiment"].labels) == ["negative", "positive"]
    assert models["qa"].task == "question-answering"
    for m in (models["sentiment"], models["qa"]):
        assert (m.backend, m.device) == ("torch", "cpu")
        # dtype auto (the default): float32 on CPUs without AVX512-BF16 / AMX-BF16, bfloat16 where native and the
        # agreement gate passes; either way ListModels says which and why
        assert m.dtype in ("float32", "bfloat16") and m.dtype_reason.startswith(f"dtype: auto -> {m.dtype}: ")
        assert m.max_seq_len > 0


def test_classify_shared_dev_sentences(server):
    _, stub, _ = server
    rows = jsonl("sentiment/dev.jsonl", 400, exact=True)  # the floor below was measured on these 400
    correct = 0
    for i in range(0, len(rows), 50):
        chunk = rows[i:i + 50]
        reply = stub.Classify(pb.ClassifyRequest(model="sentiment", texts=[r["text"] for r in chunk]), timeout=120)
        assert len(reply.results) == len(chunk)
        for r, res in zip(chunk, reply.results):
            scores = {ls.label: ls.score for ls in res.labels}
            assert set(scores) == {"negative", "positive"}  # top_k 0: all labels
            assert sum(scores.values()) == pytest.approx(1.0, abs=1e-5)
            assert res.labels[0].score >= res.labels[1].score
            correct += res.labels[0].label == r["label"]
    accuracy = correct / len(rows)
    # Model card: 88.2 % on the whole dev set through the server (majority class 55.6 %); these 400 gave 89.75 %.
    assert accuracy > 0.86, accuracy


def _normalize(s: str) -> str:
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def _f1(pred: str, gold: str) -> float:
    p, g = _normalize(pred).split(), _normalize(gold).split()
    common = sum((collections.Counter(p) & collections.Counter(g)).values())
    if not p or not g:
        return float(p == g)
    if common == 0:
        return 0.0
    prec, rec = common / len(p), common / len(g)
    return 2 * prec * rec / (prec + rec)


def _check_answer(ans, context: str) -> None:
    assert ans.text == context[ans.start:ans.end]
    if ans.is_impossible:
        assert (ans.text, ans.start, ans.end) == ("", 0, 0)
    else:
        assert ans.text and ans.text == ans.text.strip()  # C07: no leading/trailing whitespace


# First 400 Tatoeba dev rows, beam 5, sacrebleu corpus BLEU; measured through the server with the shipped
# checkpoints: 43.61 (translate-de-en) and 43.87 (translate-de-en-deberta); 39.62 and 39.81 before they were
# trained on typed input too. The model cards give the whole dev set.
TRANSLATION_BLEU_FLOORS = {"translate-de-en": 35.0, "translate-de-en-deberta": 35.0}


@pytest.mark.parametrize("model", sorted(TRANSLATION_BLEU_FLOORS))
def test_translate_shared_dev_sentences(server, model):
    sacrebleu = pytest.importorskip("sacrebleu")
    _, stub, _ = server
    rows = jsonl("translation/tatoeba_de_en_dev.jsonl", 400, exact=True)

    def run(chunk):
        reply = stub.Translate(pb.TranslateRequest(model=model, texts=[r["source"] for r in chunk], beam_size=5),
                               timeout=300)
        return [res.hypotheses[0].text for res in reply.results]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        hyps = [h for part in pool.map(run, [rows[i:i + 8] for i in range(0, len(rows), 8)]) for h in part]
    assert all(h.strip() for h in hyps), "empty translations"
    bleu = sacrebleu.corpus_bleu(hyps, [[r["target"] for r in rows]]).score
    assert bleu > TRANSLATION_BLEU_FLOORS[model], bleu


# The first 200 of those rows as people type them (``dev_variant``: final . ! ? removed from source, reference
# and output; then also the source lower-cased), beam 5, measured through the server with the shipped
# checkpoints: translate-de-en 22.61 / 21.83, translate-de-en-deberta 31.53 / 30.55 (the checkpoints before
# they were trained on such input: 9.40 / 1.88 and 15.45 / 4.73). The model cards give the whole dev split.
TRANSLATION_VARIANT_FLOORS = {"translate-de-en": {"nopunct": 19.0, "lower": 18.0},
                              "translate-de-en-deberta": {"nopunct": 27.0, "lower": 26.0}}


@pytest.mark.parametrize("model", sorted(TRANSLATION_VARIANT_FLOORS))
def test_translate_dev_sentences_as_typed(server, model):
    sacrebleu = pytest.importorskip("sacrebleu")
    from relserve.models.training.translation import dev_variant, strip_final_punct

    _, stub, _ = server
    rows = jsonl("translation/tatoeba_de_en_dev.jsonl", 400, exact=True)[:200]
    pairs = [(r["source"], r["target"]) for r in rows]

    def run(chunk):
        reply = stub.Translate(pb.TranslateRequest(model=model, texts=list(chunk), beam_size=5), timeout=300)
        return [res.hypotheses[0].text for res in reply.results]

    for kind, floor in TRANSLATION_VARIANT_FLOORS[model].items():
        var = dev_variant(pairs, kind)
        sources = [s for s, _ in var]
        assert sources != [s for s, _ in pairs]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            hyps = [h for part in pool.map(run, [sources[i:i + 8] for i in range(0, len(sources), 8)]) for h in part]
        assert all(h.strip() for h in hyps), f"{kind}: empty translations"
        bleu = sacrebleu.corpus_bleu([strip_final_punct(h) for h in hyps], [[t for _, t in var]]).score
        assert bleu > floor, (kind, bleu)


@pytest.mark.parametrize("model", sorted(TRANSLATION_BLEU_FLOORS))
def test_translate_everyday_sentences(server, model):
    """Two of the model cards' samples: the first impression of a new user."""
    _, stub, _ = server
    reply = stub.Translate(pb.TranslateRequest(model=model, texts=["Guten Morgen.", "Wo ist der Bahnhof?"],
                                               beam_size=5), timeout=60)
    morning, station = (r.hypotheses[0].text.lower() for r in reply.results)
    assert "morning" in morning, morning
    assert "station" in station, station


def test_readme_qa_example(server):
    """README's example answers the question."""
    _, stub, _ = server
    reply = stub.Answer(pb.AnswerRequest(model="qa", question="Where do I live?",
                                         context="My name is Wolfgang and I live in Berlin."), timeout=60)
    assert reply.answers[0].text == "Berlin"


def test_answer_shared_dev_questions(server):
    _, stub, _ = server
    rows = qa_rows("xquad_en_dev.jsonl", exact=True, answers=True)  # all 242, as the model card measured

    def ask(r):
        return stub.Answer(pb.AnswerRequest(model="qa", question=r["question"], context=r["context"], top_k=3),
                           timeout=120)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # concurrent requests get batched together
        replies = list(pool.map(ask, rows))
    f1s, exact = [], 0
    for r, reply in zip(rows, replies):
        assert 1 <= len(reply.answers) <= 3
        scores = [a.score for a in reply.answers]
        assert scores == sorted(scores, reverse=True)
        for a in reply.answers:
            _check_answer(a, r["context"])
        golds = [a["text"] for a in r["answers"]]
        pred = reply.answers[0].text
        f1s.append(max(_f1(pred, g) for g in golds))
        exact += any(_normalize(pred) == _normalize(g) for g in golds)
    f1, em = 100 * float(np.mean(f1s)), 100 * exact / len(rows)
    # Model card: EM 52.9 / F1 67.3 through the server on these 242 questions (during training, with 256-token
    # windows: EM 52.9 / F1 68.2); trivial baselines score F1 1.4 (random span) and 6.6 (first five words).
    assert f1 > 60.0 and em > 45.0, (em, f1)


@pytest.mark.parametrize("sample", ["xquad_zh_sample.jsonl", "xquad_de_sample.jsonl"])
def test_answer_multilingual_offsets(server, sample):
    _, stub, _ = server
    for r in qa_rows(sample)[:10]:
        reply = stub.Answer(pb.AnswerRequest(model="qa", question=r["question"], context=r["context"], top_k=2),
                            timeout=120)
        for a in reply.answers:
            _check_answer(a, r["context"])


def test_metrics_endpoint(server):
    srv, stub, _ = server
    stub.Classify(pb.ClassifyRequest(model="sentiment", texts=["a fine film"]), timeout=30)
    text = urllib.request.urlopen(srv.metrics_url, timeout=10).read().decode()
    for name in (
        'relserve_requests_total{code="OK",model="sentiment",protocol="grpc_v1",task="classification"}',
        "relserve_request_duration_seconds_bucket", "relserve_queue_duration_seconds_bucket",
        "relserve_inference_duration_seconds_bucket", "relserve_tokenization_duration_seconds_bucket",
        "relserve_batch_size_bucket", "relserve_batch_tokens_bucket", 'kind="real"', 'kind="padding"',
        "relserve_queue_depth", "relserve_inflight_requests", "process_resident_memory_bytes",
    ):
        assert name in text, name
    info = [ln for ln in text.splitlines() if ln.startswith("relserve_model_info{") and 'model="sentiment"' in ln]
    assert info and 'backend="torch"' in info[0] and 'device="cpu"' in info[0]
    assert 'dtype="float32"' in info[0] or 'dtype="bfloat16"' in info[0]  # dtype auto's choice


# ------------------------------------------------------------------------------------------ bad input
def test_bad_input_gets_clear_status_and_server_keeps_serving(server):
    _, stub, _ = server
    bad = [
        (stub.Classify, pb.ClassifyRequest(model="sentiment", texts=[]), grpc.StatusCode.INVALID_ARGUMENT),
        (stub.Classify, pb.ClassifyRequest(model="sentiment", texts=["ok", ""]), grpc.StatusCode.INVALID_ARGUMENT),
        (stub.Classify, pb.ClassifyRequest(model="sentiment", texts=["  \n"]), grpc.StatusCode.INVALID_ARGUMENT),
        (stub.Classify, pb.ClassifyRequest(model="sentiment", texts=["a", "b"], text_pairs=["c"]),
         grpc.StatusCode.INVALID_ARGUMENT),
        (stub.Classify, pb.ClassifyRequest(model="nope", texts=["a"]), grpc.StatusCode.NOT_FOUND),
        (stub.Classify, pb.ClassifyRequest(model="qa", texts=["a"]), grpc.StatusCode.FAILED_PRECONDITION),
        (stub.Answer, pb.AnswerRequest(model="qa", question="Who?", context=""), grpc.StatusCode.INVALID_ARGUMENT),
        (stub.Answer, pb.AnswerRequest(model="qa", question="", context="Some text."),
         grpc.StatusCode.INVALID_ARGUMENT),
        (stub.Answer, pb.AnswerRequest(model="sentiment", question="Who?", context="Me."),
         grpc.StatusCode.FAILED_PRECONDITION),
        (stub.Answer, pb.AnswerRequest(model="qa", question="Who?", context="Me.", max_answer_len=100000),
         grpc.StatusCode.INVALID_ARGUMENT),
    ]
    for fn, request, expected in bad:
        code, details = _code(fn, request)
        assert code == expected, (request, code, details)
        assert details and len(details) > 10
    unknown = _code(stub.Classify, pb.ClassifyRequest(model="nope", texts=["a"]))[1]
    assert "sentiment" in unknown  # NOT_FOUND names what is loaded
    reply = stub.Classify(pb.ClassifyRequest(model="sentiment", texts=["still serving"]), timeout=30)
    assert len(reply.results) == 1


# ------------------------------------------------------------------------------------------- cases
def _scores(result) -> dict[str, float]:
    return {ls.label: ls.score for ls in result.labels}


def test_case_C03_padding_invariance_through_the_server(server):
    _, stub, _ = server
    tok = load_tokenizer(DEFAULTS / "sentiment")
    long_text = " ".join(r["text"] for r in jsonl("sentiment/dev.jsonl", 60))
    assert len(tok.encode(long_text, max_length=10_000).input_ids) > 500
    # dtype auto: float32 here, bfloat16 on CPUs that run it natively (8 significant bits: sums over other
    # padding round differently, by ~1e-3 in a probability)
    dtype = {m.name: m.dtype for m in stub.ListModels(pb.ListModelsRequest(), timeout=10).models}["sentiment"]
    tol = 1e-4 if dtype == "float32" else 1e-2
    for texts in (["some text", "some longer text"], ["good", long_text]):
        together = stub.Classify(pb.ClassifyRequest(model="sentiment", texts=texts), timeout=60).results
        with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:  # separate requests, merged by the batcher
            solo = list(pool.map(
                lambda t: stub.Classify(pb.ClassifyRequest(model="sentiment", texts=[t]), timeout=60).results[0],
                texts))
        for a, b in zip(together, solo):
            sa, sb = _scores(a), _scores(b)
            for label in sa:
                assert sa[label] == pytest.approx(sb[label], abs=tol)


def test_case_C04_spans_only_from_context(server):
    """Every real answer starts where a context token starts and ends where one ends (after trimming): a span
    taken from question or special tokens would carry offsets that do not line up with the context's tokens."""
    from relserve.models.qa_spans import trim_span

    _, stub, _ = server
    context = "My name is <NAME> and I live in Berlin"
    _, offsets = load_tokenizer(DEFAULTS / "qa").tokenize(context)
    spans = [trim_span(context, s, e) for s, e in offsets]
    starts, ends = {s for s, e in spans if s < e}, {e for s, e in spans if s < e}
    for allow in (False, True):
        reply = stub.Answer(pb.AnswerRequest(model="qa", question="test finding", context=context, top_k=5,
                                             allow_impossible=allow), timeout=60)
        assert reply.answers
        for a in reply.answers:
            _check_answer(a, context)
            if not a.is_impossible:
                assert a.start in starts and a.end in ends, (a.text, a.start, a.end, sorted(spans))
        assert allow or not any(a.is_impossible for a in reply.answers)


def test_case_C05_no_answer_handling(server):
    _, stub, _ = server
    q, context = "How is the weather?", "Washington is the capital of the United States."
    reply = stub.Answer(pb.AnswerRequest(model="qa", question=q, context=context, allow_impossible=True), timeout=60)
    _check_answer(reply.answers[0], context)
    never_null = stub.Answer(pb.AnswerRequest(model="qa", question=q, context=context, allow_impossible=True,
                                              null_threshold=float("inf")), timeout=60).answers[0]
    assert not never_null.is_impossible and never_null.text
    always_null = stub.Answer(pb.AnswerRequest(model="qa", question=q, context=context, allow_impossible=True,
                                               null_threshold=float("-inf")), timeout=60).answers[0]
    assert always_null.is_impossible and (always_null.text, always_null.start, always_null.end) == ("", 0, 0)
    not_allowed = stub.Answer(pb.AnswerRequest(model="qa", question=q, context=context, allow_impossible=False,
                                               null_threshold=float("-inf")), timeout=60).answers[0]
    assert not not_allowed.is_impossible


def test_case_C06_span_length_bounded(server):
    _, stub, _ = server
    tok = load_tokenizer(DEFAULTS / "qa")
    for r in qa_rows("xquad_en_dev.jsonl")[:15]:
        for max_answer_len in (1, 2):
            # token spans: the bound is on the tokens picked; align_to_words (the default) may then widen the
            # span past them to whole words, as the transformers pipeline does
            reply = stub.Answer(pb.AnswerRequest(model="qa", question=r["question"], context=r["context"],
                                                 max_answer_len=max_answer_len, align_to_words=False), timeout=60)
            a = reply.answers[0]
            _, offsets = tok.tokenize(r["context"])
            covered = [o for o in offsets if o[0] < a.end and o[1] > a.start and o[1] > o[0]]
            assert 1 <= len(covered) <= max_answer_len, (a, covered)


def test_case_C07_answers_trimmed_of_whitespace(server):
    _, stub, _ = server
    context = "The  capital   of Germany is\u00a0 Berlin ,  and it is large ."
    reply = stub.Answer(pb.AnswerRequest(model="qa", question="What is the capital of Germany?", context=context,
                                         top_k=10), timeout=60)
    for a in reply.answers:
        _check_answer(a, context)


def test_case_C08_inputs_past_the_model_length(server):
    _, stub, _ = server
    words = " ".join(["wonderful"] * 600)
    res = stub.Classify(pb.ClassifyRequest(model="sentiment", texts=[words, "short"]), timeout=60).results
    assert res[0].truncated and not res[1].truncated
    models = {m.name: m for m in stub.ListModels(pb.ListModelsRequest(), timeout=10).models}
    assert res[0].num_tokens == models["sentiment"].max_seq_len
    row = qa_rows("xquad_en_dev.jsonl")[0]
    context = " ".join([r["context"] for r in qa_rows("xquad_en_dev.jsonl")[:40:8]])
    reply = stub.Answer(pb.AnswerRequest(model="qa", question=row["question"], context=context), timeout=120)
    assert reply.num_windows > 1
    _check_answer(reply.answers[0], context)


def test_case_C12_message_just_over_the_default_limit(server):
    _, stub, _ = server
    big_text = "a good film " * (4 * 1024 * 1024 // 12 + 50)  # just over 4 MiB once serialised
    request = pb.ClassifyRequest(model="sentiment", texts=[big_text])
    assert 4 * 1024 * 1024 < request.ByteSize() < 4 * 1024 * 1024 + 4096
    code, details = _code(stub.Classify, request)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "4194304" in details
    assert stub.Classify(pb.ClassifyRequest(model="sentiment", texts=["ok"]), timeout=30).results  # still serving

    limit = 8 * 1024 * 1024
    # a 4 MiB text is also over the default max_request_chars (1,000,000): raised with the message limit
    spec = f"sentiment={DEFAULTS / 'sentiment'},max_request_chars={limit}"
    with ServerProcess(["--model", spec, "--max-message-bytes", str(limit)]) as big:
        options = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
        with grpc.insecure_channel(big.target, options=options) as ch:
            reply = pb_grpc.InferenceStub(ch).Classify(request, timeout=120)
        assert reply.results[0].truncated
        big.stop()
