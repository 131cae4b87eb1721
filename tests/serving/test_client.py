"""``relserve.client`` (service/client/) against a real grpc.aio server on a free loopback port: fake
classification / QA models and a tiny random RNNsearch checkpoint. Each method's reply equals the raw stub's
reply to the same request; failures raise ClientError with the status code; deadline, TLS, mTLS and the
bearer token; and the import stays light (no torch or numpy) in a fresh interpreter."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import time

import grpc
import pytest
from grpc._cython.cygrpc import ExecuteBatchError
from prometheus_client import REGISTRY

from fixtures.fake_serving import runner, server_config
from fixtures.server import Running
from fixtures.tls import make_pki
from fixtures.translation import make_tiny_checkpoint
from relserve.client import Client, ClientError, ClientUsageError
from relserve.service._proto import inference_pb2 as pb
from relserve.service.frontends.grpc_v1 import InferenceServicer
from relserve.service.backends.base import TASK_QA
from relserve.service.config import ModelConfig
from relserve.service.registry import build_runner

HEAVY = ("torch", "numpy", "onnx", "onnxruntime", "onnxscript", "tokenizers", "sentencepiece", "transformers",
         "safetensors")
TOKEN = "client-test-token-0123456789"
CONTEXT = "My name is Wolfgang and I live in Berlin."


def test_import_pulls_in_only_grpc_and_protobuf():
    code = ("import relserve.client, relserve.client.cli, sys; "
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    top_level = set(out.stdout.split())
    assert {"grpc", "google", "relserve"} <= top_level
    assert not [m for m in top_level if m in HEAVY or m.startswith("onnx")], top_level


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("client") / "tr", seed=1)
    runners = [
        runner("sentiment"),
        runner("qa", TASK_QA),
        runner("slow", delay=1.0),
        build_runner(ModelConfig(name="tr", path=checkpoint, device="cpu", max_source_tokens=120,
                                 max_batch_tokens=4096, max_queue_delay=0.002)),
    ]
    s = Running(server_config(metrics_port=None), runners)
    s.wait_serving(timeout=60)
    yield s
    s.close()


@pytest.fixture
def client(srv):
    with Client(f"127.0.0.1:{srv.port}", timeout=30) as c:
        yield c


def test_list_models_and_health(srv, client):
    assert client.list_models() == srv.stub.ListModels(pb.ListModelsRequest(), timeout=5)
    assert {m.name for m in client.list_models().models} == {"sentiment", "qa", "slow", "tr"}
    assert client.health() == "SERVING"
    assert client.health("relserve.v1.Inference") == "SERVING"


def test_classify_equals_the_raw_stub(srv, client):
    texts, pairs = ["a good film", "bad bad acting"], ["good", "bad"]
    assert client.classify("sentiment", texts) == srv.stub.Classify(
        pb.ClassifyRequest(model="sentiment", texts=texts), timeout=5)
    reply = client.classify("sentiment", texts, pairs, top_k=1)
    assert reply == srv.stub.Classify(pb.ClassifyRequest(model="sentiment", texts=texts, text_pairs=pairs, top_k=1),
                                      timeout=5)
    assert [r.labels[0].label for r in reply.results] == ["positive", "negative"]
    # a lone string is one text, not a list of characters
    lone = client.classify("sentiment", "a good film")
    assert len(lone.results) == 1 and lone.results[0] == client.classify("sentiment", texts).results[0]
    sigmoid = client.classify("sentiment", texts, function_to_apply="sigmoid")
    assert sigmoid == srv.stub.Classify(pb.ClassifyRequest(model="sentiment", texts=texts, function_to_apply="sigmoid"),
                                        timeout=5)
    assert sigmoid != client.classify("sentiment", texts)  # the field reached the server


def test_answer_equals_the_raw_stub(srv, client):
    question = "Where do I live?"
    assert client.answer("qa", question, CONTEXT) == srv.stub.Answer(
        pb.AnswerRequest(model="qa", question=question, context=CONTEXT), timeout=5)
    kw = dict(top_k=2, max_answer_len=5, doc_stride=2, allow_impossible=True, null_threshold=1.5,
              align_to_words=False)
    reply = client.answer("qa", question, CONTEXT, **kw)
    assert reply == srv.stub.Answer(pb.AnswerRequest(model="qa", question=question, context=CONTEXT, **kw), timeout=5)
    best = reply.answers[0]
    assert best.is_impossible or best.text == CONTEXT[best.start:best.end]


def test_translate_and_stream_equal_the_raw_stub(srv, client):
    texts = ["Guten Morgen.", "Wir sehen uns morgen im Büro."]
    kw = dict(beam_size=3, n_best=2, max_length=20, return_alignment=True)
    reply = client.translate("tr", texts, **kw)
    assert reply == srv.stub.Translate(pb.TranslateRequest(model="tr", texts=texts, **kw), timeout=60)
    assert [len(r.hypotheses) for r in reply.results] == [2, 2]
    streamed = list(client.translate_stream("tr", texts[1], **kw))
    raw = list(srv.stub.TranslateStream(pb.TranslateStreamRequest(model="tr", text=texts[1], **kw), timeout=60))
    # the partial messages a stream carries depend on how fast it is read; the final one does not
    assert streamed[-1] == raw[-1]
    assert streamed[-1].final and not any(m.final for m in streamed[:-1]) and len(streamed) >= 2
    steps = [m.step for m in streamed]
    assert steps == sorted(steps)
    # the same hypotheses as translate (scores may differ in float rounding: batched with another text there)
    key = lambda result: [(list(h.token_ids), h.text, h.truncated) for h in result.hypotheses]  # noqa: E731
    assert key(streamed[-1].result) == key(reply.results[1])


def _count(model: str, code: str) -> float:
    return sum(s.value for f in REGISTRY.collect() for s in f.samples
               if s.name == "relserve_requests_total" and s.labels.get("model") == model
               and s.labels.get("code") == code)


def _cancelled(model: str) -> float:
    return _count(model, "CANCELLED")


def test_leaving_a_stream_early_cancels_it(srv, client):
    before = _cancelled("tr")
    # beam 16 to max_length 256 takes about a second here: closing after the first step cancels a live stream
    stream = client.translate_stream("tr", "Der alte Mann ging gestern Abend mit seinem Hund spazieren.",
                                     beam_size=16, max_length=256)
    assert not next(stream).final
    stream.close()  # what leaving a for loop early does to the generator
    loop = srv.server.registry.runners["tr"].loop
    end = time.monotonic() + 10  # the cancel reaches the decode loop within a step; generous bound
    while (loop.queue_depth or loop.active_sequences or _cancelled("tr") == before) and time.monotonic() < end:
        time.sleep(0.02)
    assert not loop.queue_depth and not loop.active_sequences
    assert _cancelled("tr") - before == 1  # the server saw the call cancelled, not finished


class _LeftContext:
    """The moment the early-leave race can leave a stream in: grpc refuses the write (the client has gone)
    while ``cancelled()`` still reads False, because the cancel notification has not reached the server yet."""

    def __init__(self) -> None:
        self.aborted = []
        self.writes = 0

    def cancelled(self) -> bool:
        return False

    def time_remaining(self):
        return None

    def invocation_metadata(self):
        return ()

    async def write(self, message) -> None:
        self.writes += 1
        raise ExecuteBatchError('Failed "execute_batch"')  # what grpc's server call raises for a gone client

    def set_trailing_metadata(self, metadata) -> None:
        pass

    async def abort(self, code, details) -> None:
        self.aborted.append((code, details))
        raise grpc.aio.AbortError(details)


def test_a_write_refused_before_the_cancel_is_seen_counts_cancelled_not_internal(srv):
    before_cancelled, before_internal = _cancelled("tr"), _count("tr", "INTERNAL")
    servicer = InferenceServicer(srv.server.registry)  # the server's own handlers, called on its loop
    context = _LeftContext()
    request = pb.TranslateStreamRequest(model="tr", text="Der alte Mann ging spazieren.", beam_size=4, max_length=64)
    with pytest.raises(concurrent.futures.CancelledError):
        srv.call(servicer.TranslateStream(request, context), timeout=60)
    assert context.writes == 1 and context.aborted == []  # no status sent to a call that is over
    assert _cancelled("tr") - before_cancelled == 1 and _count("tr", "INTERNAL") == before_internal
    loop = srv.server.registry.runners["tr"].loop
    end = time.monotonic() + 10
    while (loop.queue_depth or loop.active_sequences) and time.monotonic() < end:
        time.sleep(0.02)
    assert not loop.queue_depth and not loop.active_sequences  # the decode it started was cancelled too


def test_a_stream_message_over_the_send_limit_is_resource_exhausted_naming_it(tmp_path):
    checkpoint = make_tiny_checkpoint(tmp_path / "tr", seed=1)
    small = Running(server_config(metrics_port=None, max_send_message_length=1024), [
        build_runner(ModelConfig(name="tr-small-limit", path=checkpoint, device="cpu", max_source_tokens=120))])
    try:
        small.wait_serving(timeout=60)
        before = _count("tr-small-limit", "RESOURCE_EXHAUSTED")
        with Client(f"127.0.0.1:{small.port}", timeout=30) as c:
            # alignment weights: target x source floats, past 1 KiB in the final message
            stream = c.translate_stream("tr-small-limit", "Der alte Mann ging gestern Abend mit seinem Hund "
                                        "im Park spazieren und sah viele Enten.", beam_size=2, max_length=40,
                                        return_alignment=True)
            with pytest.raises(ClientError) as err:
                list(stream)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "stream message is" in err.value.details and "max_send_message_length of 1024 bytes" in err.value.details
        assert _count("tr-small-limit", "RESOURCE_EXHAUSTED") - before == 1  # the server's refusal, not a cancel
        assert _count("tr-small-limit", "CANCELLED") == 0
    finally:
        small.close()


def _error(call, *args, **kw) -> ClientError:
    with pytest.raises(ClientError) as err:
        result = call(*args, **kw)
        if hasattr(result, "__next__"):  # translate_stream: the status comes while iterating
            list(result)
    assert isinstance(err.value.__cause__, grpc.RpcError)
    return err.value


def test_deadline_exceeded(srv):
    with Client(f"127.0.0.1:{srv.port}", timeout=0.05) as short:
        assert _error(short.classify, "slow", ["good"]).code == grpc.StatusCode.DEADLINE_EXCEEDED
    with Client(f"127.0.0.1:{srv.port}", timeout=30) as long:  # the per-call timeout wins over the default
        assert _error(long.classify, "slow", ["good"], timeout=0.05).code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_bad_input_is_invalid_argument_with_the_servers_message(client):
    err = _error(client.classify, "sentiment", [])
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "texts" in err.details
    assert str(err).startswith("INVALID_ARGUMENT: ")
    err = _error(client.classify, "sentiment", ["good"], function_to_apply="cube")
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "function_to_apply" in err.details
    err = _error(client.translate, "tr", ["x"], beam_size=17)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "beam_size 17" in err.details
    err = _error(client.translate_stream, "tr", "x", beam_size=17)  # raised while iterating
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "beam_size 17" in err.details
    err = _error(client.answer, "qa", "", CONTEXT)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert _error(client.classify, "nope", ["x"]).code == grpc.StatusCode.NOT_FOUND
    assert _error(client.classify, "tr", ["x"]).code == grpc.StatusCode.FAILED_PRECONDITION


def test_client_cert_needs_its_key():
    with pytest.raises(ValueError, match="client_cert and client_key"):
        Client("127.0.0.1:1", client_cert=b"x")


@pytest.mark.parametrize("token", ["", " \n", "tök", "a b", "tok\x00en", "tok\ten", "tok\udcffen"])
def test_token_that_is_not_header_text_is_a_value_error_naming_it(token):
    # grpc would only refuse it when a call starts: INTERNAL "Invalid metadata" plus C-core noise on stderr
    with pytest.raises(ValueError, match="^token ") as info:
        Client("127.0.0.1:1", token=token)
    assert token.strip() == "" or token not in str(info.value)


def test_token_file_errors_name_it(tmp_path):
    path = tmp_path / "tokens"
    with pytest.raises(ValueError, match="^token_file: .*cannot read"):
        Client("127.0.0.1:1", token_file=path)
    path.write_text("# only a comment\n\n")
    with pytest.raises(ValueError, match="^token_file '.*' holds no token") as err:
        Client("127.0.0.1:1", token_file=path)
    assert "auth_token_file" not in str(err.value)  # the server's config key means nothing to a client
    path.write_text("one\ntwo\n")
    with pytest.raises(ValueError, match="^token_file .* holds 2 tokens"):
        Client("127.0.0.1:1", token_file=path)
    with pytest.raises(ValueError, match="token and token_file"):
        Client("127.0.0.1:1", token="x", token_file=path)


def _wait_serving(client: Client) -> None:
    end = time.monotonic() + 15
    while True:
        try:
            if client.health(timeout=2) == "SERVING":
                return
        except ClientError:
            if time.monotonic() > end:
                raise
        if time.monotonic() > end:
            raise AssertionError("server never became SERVING")
        time.sleep(0.02)


def test_tls_mtls_and_token(tmp_path):
    pki = make_pki(tmp_path / "pki")
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n")
    s = Running(server_config(metrics_port=None, tls_cert=pki.server_cert, tls_key=pki.server_key,
                              tls_client_ca=pki.ca_cert, auth_token_file=tokens), [runner("sentiment")])
    target = f"127.0.0.1:{s.port}"
    try:
        # paths and PEM bytes both work; the client certificate implies TLS
        with Client(target, root_certificates=pki.ca_cert, client_cert=pki.client_cert,
                    client_key=pki.client_key.read_bytes(), token=TOKEN, timeout=10) as good:
            _wait_serving(good)
            assert good.classify("sentiment", ["good"]).results[0].labels[0].label == "positive"
        # a token read from a file keeps its newline (open(path).read()); stripped as the server strips it
        with Client(target, root_certificates=pki.ca_cert, client_cert=pki.client_cert,
                    client_key=pki.client_key, token=tokens.read_text(), timeout=10) as read_token:
            assert read_token.classify("sentiment", ["good"]).results[0].labels[0].label == "positive"
        tokens.write_text(f"# the client's token\n\n  {TOKEN}  \n")
        with Client(target, root_certificates=pki.ca_cert, client_cert=pki.client_cert,
                    client_key=pki.client_key, token_file=tokens, timeout=10) as from_file:
            assert from_file.classify("sentiment", ["good"]).results[0].labels[0].label == "positive"
        with Client(target, root_certificates=pki.ca_cert, client_cert=pki.client_cert,
                    client_key=pki.client_key, timeout=10) as no_token:
            err = _error(no_token.classify, "sentiment", ["good"])
            assert err.code == grpc.StatusCode.UNAUTHENTICATED and "authorization" in err.details
        with Client(target, root_certificates=pki.ca_cert, client_cert=pki.client_cert,
                    client_key=pki.client_key, token="wrong-token", timeout=10) as wrong:
            assert _error(wrong.list_models).code == grpc.StatusCode.UNAUTHENTICATED
        with Client(target, tls=True, root_certificates=pki.ca_cert, token=TOKEN, timeout=5) as no_cert:
            assert _error(no_cert.classify, "sentiment", ["good"]).code == grpc.StatusCode.UNAVAILABLE
        with Client(target, token=TOKEN, timeout=5) as plaintext:
            assert _error(plaintext.classify, "sentiment", ["good"]).code == grpc.StatusCode.UNAVAILABLE
    finally:
        s.close()


@pytest.mark.parametrize("call, message", [
    (lambda c: c.classify("m", ["x"], top_k=-1), "top_k must be an int in 0..4294967295, got -1"),
    (lambda c: c.classify("m", ["x"], top_k="3"), "top_k must be an int in 0..4294967295, got '3'"),
    (lambda c: c.classify("m", ["x"], top_k=1.5), "top_k must be an int"),
    (lambda c: c.classify("m", ["ok", 7]), "texts[1] must be a str (UTF-8 encodable), got 7"),
    (lambda c: c.classify("m", ["bad \udcff surrogate"]), "texts[0] must be a str (UTF-8 encodable)"),
    (lambda c: c.classify("m", 7), "texts must be a str or a sequence of str, got int"),
    (lambda c: c.classify("m", b"bytes"), "texts must be a str or a sequence of str, got bytes"),
    (lambda c: c.classify("m", ["x"], ["p", None]), "text_pairs[1] must be a str"),
    (lambda c: c.classify(3, ["x"]), "model must be a str (UTF-8 encodable), got 3"),
    (lambda c: c.classify("m", ["x"], function_to_apply=1), "function_to_apply must be a str"),
    (lambda c: c.answer("qa", "q", "c", top_k=2 ** 32), "top_k must be an int in 0..4294967295, got 4294967296"),
    (lambda c: c.answer("qa", "q", "c", max_answer_len=-5), "max_answer_len must be an int in 0..4294967295"),
    (lambda c: c.answer("qa", "q", "c", null_threshold="high"), "null_threshold must be a number, got 'high'"),
    (lambda c: c.answer("qa", "q", "c", align_to_words="yes"), "align_to_words must be a bool, got 'yes'"),
    (lambda c: c.answer("qa", ["q"], "c"), "question must be a str"),
    (lambda c: c.translate("tr", ["x"], beam_size=-1), "beam_size must be an int in 0..4294967295, got -1"),
    (lambda c: c.translate("tr", ["x"], n_best=-1), "n_best must be an int in 0..4294967295, got -1"),
    # raised by the call itself, not when the stream is first read
    (lambda c: c.translate_stream("tr", "x", max_length=-1), "max_length must be an int in 0..4294967295"),
    (lambda c: c.translate_stream("tr", ["x"]), "text must be a str"),
    (lambda c: c.health(7), "service must be a str"),
    (lambda c: c.list_models(timeout="soon"), "timeout must be a number of seconds or None, got 'soon'"),
    (lambda c: c.list_models(timeout=float("inf")), "timeout must be at most 1e+09 seconds"),
    (lambda c: c.list_models(timeout=float("nan")), "timeout must be at most 1e+09 seconds"),
])
def test_arguments_refused_before_sending_are_client_usage_errors_naming_them(call, message):
    # nothing listens on port 1: an argument that got as far as a call would end UNAVAILABLE, not here
    with Client("127.0.0.1:1", timeout=30) as c:
        with pytest.raises(ClientError) as err:
            call(c)
    assert isinstance(err.value, ClientUsageError) and isinstance(err.value, ValueError)  # ValueError as before
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details
    assert str(err.value) == err.value.details and err.value.trailing_metadata == ()


@pytest.mark.parametrize("kwargs, message", [
    (dict(target=""), "target must be a non-empty str"),
    (dict(target=50051), "target must be a non-empty str"),
    (dict(timeout=float("inf")), "timeout must be at most 1e+09 seconds"),
    (dict(timeout="30"), "timeout must be a number of seconds or None"),
    (dict(root_certificates=3), "root_certificates must be PEM bytes or a path, got int"),
    (dict(root_certificates=b"not a certificate"), "root_certificates is not PEM"),
    (dict(options=[("grpc.max_receive_message_length",)]), "options must be (name, value) pairs"),
    (dict(options=3), "options must be (name, value) pairs"),
])
def test_client_arguments_refused_are_client_usage_errors(kwargs, message):
    kwargs = {"target": "127.0.0.1:1", **kwargs}
    with pytest.raises(ClientUsageError) as err:
        Client(kwargs.pop("target"), **kwargs)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and message in str(err.value)


def test_a_closed_client_is_a_usage_error_and_a_refused_port_is_unavailable_at_once():
    c = Client("127.0.0.1:1", timeout=30)
    start = time.monotonic()
    err = _error(c.list_models)  # nothing listens: refused, so UNAVAILABLE now rather than at the 30 s deadline
    assert err.code == grpc.StatusCode.UNAVAILABLE and time.monotonic() - start < 10
    c.close()
    for call in (c.list_models, lambda: list(c.translate_stream("tr", "x"))):
        with pytest.raises(ClientUsageError) as closed:
            call()
        assert closed.value.code == grpc.StatusCode.FAILED_PRECONDITION and "closed" in closed.value.details
