"""``relserve call`` / ``python -m relserve.client`` (service/client/cli.py) and the top-level ``relserve`` flags
(service/main.py: ``--version``, a mistyped ``serve`` flag), against a real grpc.aio server on a free loopback
port serving fake classification / QA models and a tiny random RNNsearch checkpoint (the models of
tests/serving/test_client.py). Each sub-command runs in a subprocess, and the JSON it prints parses back to the
very reply :class:`relserve.client.Client` gets for the same call; failures exit 1 with the status as JSON,
usage errors exit 2 naming the flag; a refused port fails at once, not at the deadline."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest
from google.protobuf import json_format

from fixtures.fake_serving import runner, server_config
from fixtures.server import Running
from fixtures.tls import make_pki
from fixtures.translation import make_tiny_checkpoint
from relserve.client import Client, ClientError, cli
from relserve.service._proto import inference_pb2 as pb
from relserve.service.backends.base import TASK_QA
from relserve.service.config import ModelConfig
from relserve.service.main import main as relserve_main
from relserve.service.registry import build_runner

CONTEXT = "My name is Wolfgang and I live in Berlin."
TOKEN = "cli-test-token-0123456789"
# the console script pip installed beside this interpreter (tests run from the project's venv); else the module
_SCRIPT = Path(sys.executable).with_name("relserve")
RELSERVE = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "relserve.service.main"]


def relserve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*RELSERVE, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("cli") / "tr", seed=1)
    runners = [
        runner("sentiment"),
        runner("qa", TASK_QA),
        build_runner(ModelConfig(name="tr", path=checkpoint, device="cpu", max_source_tokens=120,
                                 max_batch_tokens=4096, max_queue_delay=0.002)),
    ]
    s = Running(server_config(metrics_port=None), runners)
    s.wait_serving(timeout=60)
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(srv):
    with Client(f"127.0.0.1:{srv.port}", timeout=30) as c:
        yield c


def call(srv, *args: str) -> subprocess.CompletedProcess:
    """``relserve call SUBCOMMAND --address <the test server> ARGS...``."""
    return relserve("call", args[0], "--address", f"127.0.0.1:{srv.port}", *args[1:])


def reply(result: subprocess.CompletedProcess, message):
    """The stdout JSON of a successful call, parsed into ``message`` (unknown fields refused)."""
    assert result.returncode == 0, result.stderr
    return json_format.Parse(result.stdout, message)


def test_models_and_health(srv, client):
    result = call(srv, "models")
    assert reply(result, pb.ListModelsResponse()) == client.list_models()
    assert {m["name"] for m in json.loads(result.stdout)["models"]} == {"sentiment", "qa", "tr"}
    # python -m relserve.client is the same command line
    module = subprocess.run([sys.executable, "-m", "relserve.client", "models", "--address", f"127.0.0.1:{srv.port}"],
                            capture_output=True, text=True, timeout=60)
    assert module.returncode == 0 and module.stdout == result.stdout
    health = call(srv, "health")
    assert health.returncode == 0 and json.loads(health.stdout) == {"status": "SERVING"}
    assert json.loads(call(srv, "health", "--service", "relserve.v1.Inference").stdout) == {"status": "SERVING"}


def test_classify_equals_the_client(srv, client):
    texts = ["a good film", "bad bad acting"]
    plain = call(srv, "classify", "--model", "sentiment", "--text", texts[0], "--text", texts[1])
    assert reply(plain, pb.ClassifyResponse()) == client.classify("sentiment", texts)
    # every field printed, in the JSON mapping of the HTTP /v1 routes (numTokens, truncated even when false)
    first = json.loads(plain.stdout)["results"][0]
    assert set(first) == {"labels", "truncated", "numTokens"} and first["labels"][0]["label"] == "positive"
    options = call(srv, "classify", "--model", "sentiment", "--text", texts[0], "--text", texts[1],
                   "--text-pair", "good", "--text-pair", "bad", "--top-k", "1", "--function-to-apply", "sigmoid")
    expected = client.classify("sentiment", texts, ["good", "bad"], top_k=1, function_to_apply="sigmoid")
    assert reply(options, pb.ClassifyResponse()) == expected
    assert [len(r.labels) for r in expected.results] == [1, 1]


def test_answer_equals_the_client(srv, client):
    question = "Where do I live?"
    assert reply(call(srv, "answer", "--model", "qa", "--question", question, "--context", CONTEXT),
                 pb.AnswerResponse()) == client.answer("qa", question, CONTEXT)
    result = call(srv, "answer", "--model", "qa", "--question", question, "--context", CONTEXT, "--top-k", "2",
                  "--max-answer-len", "5", "--doc-stride", "2", "--allow-impossible", "--null-threshold", "1.5",
                  "--no-align-to-words")
    expected = client.answer("qa", question, CONTEXT, top_k=2, max_answer_len=5, doc_stride=2, allow_impossible=True,
                             null_threshold=1.5, align_to_words=False)
    assert reply(result, pb.AnswerResponse()) == expected
    best = json.loads(result.stdout)["answers"][0]
    assert best["isImpossible"] or best["text"] == CONTEXT[best["start"]:best["end"]]


def test_translate_and_stream_equal_the_client(srv, client):
    texts = ["Guten Morgen.", "Wir sehen uns morgen im Büro."]
    flags = ["--beam-size", "3", "--n-best", "2", "--max-length", "20", "--return-alignment"]
    kw = dict(beam_size=3, n_best=2, max_length=20, return_alignment=True)
    result = call(srv, "translate", "--model", "tr", "--text", texts[0], "--text", texts[1], *flags)
    expected = client.translate("tr", texts, **kw)
    assert reply(result, pb.TranslateResponse()) == expected
    assert [len(r.hypotheses) for r in expected.results] == [2, 2]
    stream = call(srv, "translate", "--model", "tr", "--text", texts[1], "--stream", *flags)
    assert stream.returncode == 0, stream.stderr
    lines = stream.stdout.splitlines()
    messages = [json_format.Parse(line, pb.TranslateStreamResponse()) for line in lines]  # one object per line
    assert len(messages) >= 2 and messages[-1].final and not any(m.final for m in messages[:-1])
    # the partial messages depend on how fast the stream is read; the final one does not
    assert messages[-1] == list(client.translate_stream("tr", texts[1], **kw))[-1]


def test_health_exits_1_unless_serving():
    loading = Running(server_config(metrics_port=None), [runner("sentiment")], load=False)  # never SERVING
    try:
        result = relserve("call", "health", "--address", f"127.0.0.1:{loading.port}")
    finally:
        loading.close()
    assert result.returncode == 1 and json.loads(result.stdout) == {"status": "NOT_SERVING"}, result.stderr


def test_a_failed_call_exits_1_with_the_status_as_json(srv, client):
    for args, call_client in [
        (("classify", "--model", "nope", "--text", "x"), lambda: client.classify("nope", ["x"])),
        (("translate", "--model", "tr", "--text", "x", "--beam-size", "17"),
         lambda: client.translate("tr", ["x"], beam_size=17)),
        (("health", "--service", "no.such.Service"), lambda: client.health("no.such.Service")),
    ]:
        result = call(srv, *args)
        with pytest.raises(ClientError) as err:
            call_client()
        assert result.returncode == 1 and result.stdout == ""
        assert json.loads(result.stderr) == {"code": err.value.code.name, "details": err.value.details}
    assert json.loads(result.stderr)["code"] == "NOT_FOUND"  # the last one: health of an unknown service


def test_a_refused_port_fails_at_once_not_at_the_deadline():
    # a socket bound but not listening: the port is ours (no other process takes it) and connecting is refused
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        start = time.monotonic()
        result = relserve("call", "models", "--address", f"127.0.0.1:{port}", "--timeout", "30")
        elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr
    error = json.loads(result.stderr)
    assert error["code"] == "UNAVAILABLE" and str(port) in error["details"]
    # a functional bound, not a timing claim: waiting for the 30 s deadline would take 30 s; startup is ~1 s
    assert elapsed < 10, elapsed


@pytest.mark.parametrize("args, message", [
    (["classify", "--model", "m", "--text", "x", "--top-k", "-1"], "--top-k must be an int in 0..4294967295, got -1"),
    (["translate", "--model", "m", "--text", "x", "--beam-size", "4294967296"], "--beam-size must be an int in 0.."),
    (["answer", "--model", "m", "--question", "q", "--context", "c", "--doc-stride", "-2"], "--doc-stride must be"),
    (["translate", "--model", "m", "--text", "a", "--text", "b", "--stream"], "--stream translates one text, got 2"),
    (["models", "--timeout", "inf"], "--timeout must be at most 1e+09 seconds"),
    (["models", "--address", ""], "--address must be a non-empty str"),
    (["models", "--token-file", "/nonexistent/tokens"], "--token-file: cannot read '/nonexistent/tokens'"),
    (["models", "--tls-cert", "/nonexistent/cert.pem"], "--tls-cert and --tls-key go together"),
    (["classify", "--text", "x"], "the following arguments are required: --model"),
    (["classify", "--model", "m", "--text", "x", "--top-k", "two"], "argument --top-k: invalid int value: 'two'"),
])
def test_usage_errors_exit_2_naming_the_flag_before_anything_is_sent(args, message, capsys):
    # port 1: nothing is sent, so nothing needs to listen; a call that got that far would exit 1 UNAVAILABLE
    with pytest.raises(SystemExit) as exit_:
        cli.main([args[0], "--address", "127.0.0.1:1", *args[1:]])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: relserve call {args[0]} ") and message in err, err


def test_tls_mtls_and_token_flags(tmp_path):
    pki = make_pki(tmp_path / "pki")
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# the client's token\n{TOKEN}\n")
    s = Running(server_config(metrics_port=None, tls_cert=pki.server_cert, tls_key=pki.server_key,
                              tls_client_ca=pki.ca_cert, auth_token_file=tokens), [runner("sentiment")])
    tls = ["--address", f"127.0.0.1:{s.port}", "--tls-ca", str(pki.ca_cert), "--tls-cert", str(pki.client_cert),
           "--tls-key", str(pki.client_key)]
    try:
        with Client(f"127.0.0.1:{s.port}", root_certificates=pki.ca_cert, client_cert=pki.client_cert,
                    client_key=pki.client_key, token_file=tokens, timeout=10) as good:
            end = time.monotonic() + 15
            while good.health(timeout=2) != "SERVING" and time.monotonic() < end:
                time.sleep(0.02)
            expected = good.classify("sentiment", ["good"])
        result = relserve("call", "classify", *tls, "--token-file", str(tokens), "--model", "sentiment",
                          "--text", "good")
        assert reply(result, pb.ClassifyResponse()) == expected
        no_token = relserve("call", "classify", *tls, "--model", "sentiment", "--text", "good")
        assert no_token.returncode == 1 and json.loads(no_token.stderr)["code"] == "UNAUTHENTICATED"
        plaintext = relserve("call", "models", "--address", f"127.0.0.1:{s.port}", "--token-file", str(tokens),
                             "--timeout", "5")
        assert plaintext.returncode == 1 and json.loads(plaintext.stderr)["code"] == "UNAVAILABLE"
    finally:
        s.close()


def test_version():
    version = metadata.version("relserve")
    result = relserve("--version")
    assert result.returncode == 0 and result.stdout == f"relserve {version}\n"
    module = subprocess.run([sys.executable, "-m", "relserve.client", "--version"], capture_output=True, text=True,
                            timeout=60)
    assert module.returncode == 0 and module.stdout == result.stdout


def test_a_mistyped_serve_flag_prints_the_serve_usage(capsys):
    with pytest.raises(SystemExit) as exit_:
        relserve_main(["serve", "--prot", "50052"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: relserve serve ") and "--port" in err  # serve's flags, not the sub-command list
    assert "relserve serve: error: unrecognized arguments: --prot 50052" in err
    with pytest.raises(SystemExit):  # an unknown sub-command still gets the top-level usage, naming call
        relserve_main(["serv"])
    err = capsys.readouterr().err
    assert err.startswith("usage: relserve ") and "call" in err and "invalid choice: 'serv'" in err
