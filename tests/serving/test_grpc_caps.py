"""The gRPC port's per-call limits on a real ``relserve serve`` process (tiny checkpoints, short limits from a
config file): refused requests of a million texts are counted on the wire and cost the server no memory in
proportion to their size (RSS of the server process from /proc), ``max_concurrent_rpcs`` refuses the calls over
it RESOURCE_EXHAUSTED while health answers, a call whose request message never arrives ends after
``request_read_timeout``, and a TranslateStream whose reader stops ends after ``stream_write_timeout``."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest

pytest.importorskip("torch")

from fixtures.deberta import make_deberta_checkpoint  # noqa: E402
from fixtures.translation import make_tiny_checkpoint, sentence_pairs  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from relserve.loadtest.bench.grpc_flood import RssSampler, flood_request, rss_mb  # noqa: E402
from relserve.loadtest.serverproc import ServerProcess  # noqa: E402
from relserve.service._proto import inference_pb2 as pb  # noqa: E402
from relserve.service._proto import inference_pb2_grpc as pb_grpc  # noqa: E402

MAX_CALLS = 4
READ_TIMEOUT_S = 4.0
WRITE_TIMEOUT_S = 1.0
MAX_TEXTS = 8
FLOOD_CLIENTS = 6
FLOOD_CALLS = 4  # per client
CLASSIFY = "/relserve.v1.Inference/Classify"
REFUSAL = f"the request has more than 1024 texts; no model of this server takes more than {MAX_TEXTS} per request"


@pytest.fixture(scope="module")
def srv(unigram_tokenizer_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("grpc-caps")
    cls = make_deberta_checkpoint(root / "cls", task="classification", tokenizer_dir=unigram_tokenizer_dir,
                                  labels=("a", "b"), seed=1).path
    tr = make_tiny_checkpoint(root / "tr", seed=3)
    common = {"device": "cpu", "worker_process": False, "warmup": False}
    config = {
        "max_concurrent_rpcs": MAX_CALLS, "request_read_timeout": READ_TIMEOUT_S,
        "stream_write_timeout": WRITE_TIMEOUT_S,
        "models": [
            {"name": "cls", "path": str(cls), "max_seq_len": 64, "max_request_texts": MAX_TEXTS, **common},
            {"name": "cls-small", "path": str(cls), "max_seq_len": 64, "max_request_texts": 2, **common},
            {"name": "tr", "path": str(tr), "max_output_tokens": 200, "max_request_texts": MAX_TEXTS, **common},
        ],
    }
    path = root / "config.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    server = ServerProcess(["--config", str(path)], start_timeout=180).start()
    channel = grpc.insecure_channel(server.target)
    try:
        yield server, channel
    finally:
        channel.close()
        server.close()


def _requests_total(server: ServerProcess, model: str, code: str) -> float:
    """relserve_requests_total of ``model`` with ``code``, summed over the other labels."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("relserve_requests_total{") and f'model="{model}"' in line and f'code="{code}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _wait_for(predicate, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _parsed_mb(payload: bytes, tmp_path) -> float:
    """What parsing ``payload`` costs in RSS (MB): what the server would hold per request. Measured in a fresh
    interpreter: in this process, memory freed by earlier tests would absorb the parse and read as less."""
    path = tmp_path / "payload.bin"
    path.write_bytes(payload)
    code = ("import gc, os, sys\n"
            "from relserve.service._proto import inference_pb2 as pb\n"
            "from relserve.loadtest.bench.grpc_flood import rss_mb\n"
            "data = open(sys.argv[1], 'rb').read()\n"
            "gc.collect(); before = rss_mb(os.getpid())\n"
            "message = pb.ClassifyRequest.FromString(data)\n"
            "print(rss_mb(os.getpid()) - before)\n")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout)


def test_refused_million_text_requests_cost_the_server_no_memory_in_proportion_to_their_size(srv, tmp_path):
    server, channel = srv
    payload = flood_request("cls", 1_000_000)  # 3 MB on the wire
    parsed = _parsed_mb(payload, tmp_path)
    assert parsed > 15, parsed  # the cost a parse-before-count server would pay per request in flight
    classify = channel.unary_unary(CLASSIFY)
    assert pb.ClassifyResponse.FromString(classify(pb.ClassifyRequest(model="cls", texts=["warm"])
                                                   .SerializeToString(), timeout=60))
    start = rss_mb(server.pid)
    sampler = RssSampler(server.pid)
    sampler.start()
    failures: list[str] = []

    def client() -> None:
        with grpc.insecure_channel(server.target, options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
            call = ch.unary_unary(CLASSIFY)
            for _ in range(FLOOD_CALLS):
                try:
                    call(payload, timeout=60)
                    failures.append("accepted")
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.INVALID_ARGUMENT or REFUSAL not in exc.details():
                        failures.append(f"{exc.code().name}: {exc.details()}")

    threads = [threading.Thread(target=client) for _ in range(FLOOD_CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    sampler.stop()
    assert not failures, failures[:3]
    growth = sampler.peak - start
    # a server that parsed (or copied) the texts before counting them holds a parse per client in flight, and
    # kept them in reference cycles: 1.3 GB here before; counted on the wire, the growth is grpc's own buffers
    assert growth < parsed * FLOOD_CLIENTS / 2, (growth, parsed, start)
    # refused by the count under the model's name; the model's own, lower limit still reads as before
    assert _requests_total(server, "cls", "INVALID_ARGUMENT") >= FLOOD_CLIENTS * FLOOD_CALLS
    stub = pb_grpc.InferenceStub(channel)
    with pytest.raises(grpc.RpcError) as exc:
        stub.Classify(pb.ClassifyRequest(model="cls-small", texts=["a", "b", "c"]), timeout=30)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the request has 3 texts; model 'cls-small' takes at most 2" in exc.value.details()
    assert len(stub.Classify(pb.ClassifyRequest(model="cls", texts=["x"] * MAX_TEXTS), timeout=30).results) == MAX_TEXTS


def _held_call(channel: grpc.Channel, release: threading.Event):
    """A Classify call whose request message never comes (until ``release``): it holds one of the server's
    call slots until request_read_timeout."""

    def never():
        release.wait()
        return
        yield  # pragma: no cover - a generator that yields nothing

    return channel.stream_unary(CLASSIFY).future(never(), timeout=60)


def _fill(held_channel: grpc.Channel, release: threading.Event, stub) -> tuple[list, grpc.RpcError]:
    """Hold MAX_CALLS calls on ``held_channel`` (:func:`_held_call`), then call ListModels on ``stub`` until one
    is refused; returns the held calls and that refusal."""
    held = [_held_call(held_channel, release) for _ in range(MAX_CALLS)]
    refused: list[grpc.RpcError] = []

    def full() -> bool:
        try:
            stub.ListModels(pb.ListModelsRequest(), timeout=10)
        except grpc.RpcError as exc:
            refused.append(exc)
            return True
        return False

    _wait_for(full, READ_TIMEOUT_S, "a call refused while the held calls fill the server")
    return held, refused[0]


def test_max_concurrent_rpcs_refuses_at_once_while_health_answers_and_unsent_requests_end_after_the_timeout(srv):
    server, channel = srv
    release = threading.Event()
    held_channel = grpc.insecure_channel(server.target, options=[("grpc.use_local_subchannel_pool", 1)])
    stub = pb_grpc.InferenceStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    try:
        held, refused = _fill(held_channel, release, stub)
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
        assert "max_concurrent_rpcs" in refused.details()
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING
        # the calls whose message never came end DEADLINE_EXCEEDED from the server (their own deadline is 60 s)
        for call in held:
            exc = call.exception(timeout=30)
            assert exc is not None and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc
            assert "request_read_timeout" in exc.details()
        # their slots are free again
        assert stub.ListModels(pb.ListModelsRequest(), timeout=10).models
    finally:
        release.set()
        held_channel.close()


def test_a_call_refused_over_max_concurrent_rpcs_is_retried_by_a_client_retry_policy(srv):
    """The refusal is trailers-only (an abort, not a status after an empty message), so a client's retry policy
    may retry it: the retried attempt is answered once the held calls leave; a client without one gets the
    refusal's message."""
    server, channel = srv
    release = threading.Event()
    held_channel = grpc.insecure_channel(server.target, options=[("grpc.use_local_subchannel_pool", 1)])
    # attempts a random 0..1 s apart (gRFC A6 jitter): the held calls are released between two of them
    policy = {"methodConfig": [{"name": [{"service": "relserve.v1.Inference"}], "retryPolicy": {
        "maxAttempts": 5, "initialBackoff": "1s", "maxBackoff": "1s", "backoffMultiplier": 1,
        "retryableStatusCodes": ["RESOURCE_EXHAUSTED"]}}]}
    retrying = grpc.insecure_channel(server.target, options=[
        ("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(policy)),
        ("grpc.use_local_subchannel_pool", 1)])
    stub = pb_grpc.InferenceStub(channel)
    refused_before = _requests_total(server, "_unknown_", "RESOURCE_EXHAUSTED")
    try:
        held, refused = _fill(held_channel, release, stub)
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
        assert "maximum of 4 concurrent calls (max_concurrent_rpcs)" in refused.details()
        seen = _requests_total(server, "_unknown_", "RESOURCE_EXHAUSTED")
        call = pb_grpc.InferenceStub(retrying).ListModels.future(pb.ListModelsRequest(), timeout=20)
        _wait_for(lambda: _requests_total(server, "_unknown_", "RESOURCE_EXHAUSTED") > seen, READ_TIMEOUT_S,
                  "the retrying client's first attempt to be refused")
        release.set()  # the held calls end; a later attempt finds a free slot
        assert call.result(timeout=20).models  # answered: the refusal was retried
        assert len(held) == MAX_CALLS
    finally:
        release.set()
        held_channel.close()
        retrying.close()
    assert _requests_total(server, "_unknown_", "RESOURCE_EXHAUSTED") - refused_before >= 2


def test_a_translate_stream_whose_reader_stops_is_ended_after_the_write_timeout(srv):
    server, _channel = srv
    before = _requests_total(server, "tr", "DEADLINE_EXCEEDED")
    text = " ".join(s for s, _ in sentence_pairs(40))[:250]  # about 160 source tokens: 200 steps with alignments
    request = pb.TranslateStreamRequest(model="tr", text=text, max_length=200, return_alignment=True)

    async def stalled_reader() -> tuple[int, grpc.aio.AioRpcError | None]:
        # grpc.aio: its stream takes messages only when read (the blocking client reads ahead in the
        # background); a window of about 1 KB, never widened, makes the server's writes wait once it is full
        options = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
        async with grpc.aio.insecure_channel(server.target, options=options) as ch:
            stream = pb_grpc.InferenceStub(ch).TranslateStream(request, timeout=120)
            await stream.initial_metadata()
            # nothing is read until the server has ended the stream (it counts it then)
            end = time.monotonic() + 60
            while _requests_total(server, "tr", "DEADLINE_EXCEEDED") == before and time.monotonic() < end:
                await asyncio.sleep(0.05)
            received = 0
            try:
                async for _message in stream:  # what was queued before the status, then the status
                    received += 1
            except grpc.aio.AioRpcError as exc:
                return received, exc
            return received, None

    received, error = asyncio.run(stalled_reader())
    assert error is not None, f"the stream ran to its end ({received} messages) though its reader stopped"
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "stream_write_timeout" in error.details()
    assert received < 200  # ended, not finished


def test_the_wire_count_agrees_with_the_parser_and_leaves_odd_bytes_to_it():
    import random

    from relserve.service.frontends.grpc_transport import TooManyEntries, count_entries, counting_deserializer
    from relserve.service.frontends.messages import MalformedRequest

    rng = random.Random(0)
    for _ in range(300):
        n, m, cap = rng.randrange(0, 12), rng.randrange(0, 12), rng.randrange(0, 12)
        message = pb.ClassifyRequest(model="m" * rng.randrange(0, 300), texts=["é" * rng.randrange(0, 200)] * n,
                                     text_pairs=["x" * rng.randrange(0, 3)] * m, top_k=rng.randrange(0, 2**31),
                                     function_to_apply="softmax")
        data = message.SerializeToString()
        parsed = pb.ClassifyRequest.FromString(data)
        over = count_entries(data, {2: cap, 3: cap}, 2 * cap + 64)
        assert (over is not None) == (len(parsed.texts) > cap or len(parsed.text_pairs) > cap), (n, m, cap, over)
        if over is not None:
            assert over[1] == (parsed.model if len(parsed.model) <= 256 else "")
    deserialize = counting_deserializer(pb.ClassifyRequest, {"texts": 8, "text_pairs": 8})
    refused = deserialize(pb.ClassifyRequest(model="cls", texts=["x"] * 1025).SerializeToString())
    assert isinstance(refused, TooManyEntries) and (refused.field, refused.counted, refused.limit, refused.model) == \
        ("texts", 1024, 8, "cls")
    assert len(deserialize(pb.ClassifyRequest(texts=["x"] * 1024).SerializeToString()).texts) == 1024  # parsed
    padded = b"\x98\x06\x01" * 5000 + pb.ClassifyRequest(texts=["x"] * 2000).SerializeToString()  # unknown field 99
    assert len(deserialize(padded).texts) == 2000  # past the walk's budget: parsed, the task refuses it
    assert isinstance(deserialize(b"\x12\x05ab"), MalformedRequest)  # truncated: the parser's verdict
    labels = counting_deserializer(pb.ZeroShotClassifyRequest,
                                   {"texts": 8, "candidate_labels": (64, "max_candidate_labels")})
    refused = labels(pb.ZeroShotClassifyRequest(model="nli", texts=["x"],
                                                candidate_labels=["a"] * 1025).SerializeToString())
    assert "takes more than 64 per request (max_candidate_labels)" in str(refused.refusal())
