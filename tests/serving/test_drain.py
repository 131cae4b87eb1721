"""Graceful drain of the real server process under load.

``relserve serve`` runs as a child process with a tiny random DeBERTa classifier; a closed-loop load
(``relserve.loadtest``'s engine, 16 clients, one grpc.aio channel, mixed-length texts) runs against it and
SIGTERM arrives mid-run while requests are queued. Checked: health turns NOT_SERVING on an open Watch
stream, which then ends (it no longer holds the drain), every request sent before the signal succeeds,
every request ends OK or UNAVAILABLE (none CANCELLED, also those racing the signal: the process exits
instead of running grpc core's stop, which reset calls it had not handed to Python yet), the process exits 0
well before drain_timeout, and its log has no stray asyncio errors.

The fake-model tests below drive the same ``serve`` process path (fixtures/server.py FakeServerProcess):
repeated SIGTERMs under 16 closed-loop clients, a Watch stream with nothing in flight, and a call that runs
past drain_timeout (it ends UNAVAILABLE and the process still exits, although the backend thread hangs).
"""

from __future__ import annotations

import asyncio
import collections
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fixtures.deberta import make_deberta_checkpoint
from fixtures.server import FakeServerProcess, stray_errors
from relserve.loadtest import generator, promscrape
from relserve.loadtest.scenarios import Scenario
from relserve.loadtest.serverproc import ServerProcess
from relserve.service._proto import inference_pb2 as pb
from relserve.service._proto import inference_pb2_grpc as pb_grpc

DRAIN_TIMEOUT = 10.0
CLIENTS = 16
SIGNAL_AT = 1.5      # seconds into the load
LOAD_FOR = 3.5       # clients stop sending new requests after this (2 s after the signal)
MARGIN = 0.05        # a request sent this long before the signal has certainly reached the server
RACE = 0.5           # a request sent this long after the signal certainly meets a draining server


@pytest.fixture(scope="module")
def tiny_classifier(unigram_tokenizer_dir, tmp_path_factory):
    pytest.importorskip("torch")
    return make_deberta_checkpoint(tmp_path_factory.mktemp("drain") / "tiny", tokenizer_dir=unigram_tokenizer_dir,
                                   labels=("negative", "positive"), hidden_size=64, intermediate_size=128,
                                   num_attention_heads=2, position_buckets=64).path


def _wait_exit(srv: ServerProcess, timeout: float) -> tuple[int, float]:
    code = srv.wait(timeout)
    return code, time.monotonic()


async def _drive(srv: ServerProcess) -> dict:
    ch = generator.channel(srv.target)
    health = health_pb2_grpc.HealthStub(ch)
    statuses: list[tuple[float, int]] = []
    engine = generator.Engine(ch, timeout=30.0)

    async def watch() -> str:
        try:
            async for reply in health.Watch(health_pb2.HealthCheckRequest(service="")):
                statuses.append((engine.now(), reply.status))
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        return "OK"

    try:
        scenario = Scenario("classify-mixed", {"classify": "tiny"}, seed=1)
        watcher = asyncio.create_task(watch())
        load = asyncio.create_task(engine.closed_loop(scenario, CLIENTS, requests=None, duration=LOAD_FOR))
        await asyncio.sleep(SIGNAL_AT)
        inflight = 0.0
        end = time.monotonic() + 5
        while time.monotonic() < end:  # signal while the server holds many accepted requests
            snap = await asyncio.to_thread(promscrape.scrape, srv.metrics_url)
            inflight = snap.get("relserve_inflight_requests", model="tiny")
            if inflight >= CLIENTS // 2:
                break
        t_signal = engine.now()
        srv.terminate()
        wall_signal = time.monotonic()
        exited = asyncio.create_task(asyncio.to_thread(_wait_exit, srv, DRAIN_TIMEOUT + 20))
        watch_end = await asyncio.wait_for(watcher, timeout=DRAIN_TIMEOUT + 20)  # ends with the drain
        records = await asyncio.wait_for(load, timeout=60)
        code, exit_time = await exited
        exit_after = exit_time - wall_signal
        try:  # a brand-new call after exit: UNAVAILABLE, not a hang
            await generator.pb_grpc.InferenceStub(ch).ListModels(generator.pb.ListModelsRequest(), timeout=5)
            late = "OK"
        except grpc.aio.AioRpcError as exc:
            late = exc.code().name
    finally:
        await ch.close()
    return dict(records=records, statuses=statuses, t_signal=t_signal, inflight=inflight, code=code,
                exit_after=exit_after, late=late, watch_end=watch_end)


def test_sigterm_under_load_drains_accepted_requests(tiny_classifier):
    srv = ServerProcess(["--model", f"tiny={tiny_classifier},max_batch_size=4,max_queue_delay=0",
                         "--drain-timeout", str(DRAIN_TIMEOUT)], env={"OMP_NUM_THREADS": "1"})
    srv.start()
    try:
        out = asyncio.run(_drive(srv))
    finally:
        srv.kill()
        log = srv.log_text()
        srv.close()
    rec, t_sig = out["records"], out["t_signal"]
    codes = list(rec.codes)
    assert len(rec) == rec.sent, "every request sent got an answer"
    assert out["inflight"] >= CLIENTS // 2, f"only {out['inflight']} requests in flight at the signal"

    before = [i for i in range(len(rec)) if rec.starts[i] < t_sig - MARGIN]
    assert len(before) > CLIENTS
    failed_before = [(rec.starts[i] - t_sig, codes[i]) for i in before if codes[i] != "OK"]
    assert not failed_before, f"requests sent before SIGTERM failed: {failed_before[:5]}\n{log[-2000:]}"
    drained = [i for i in range(len(rec)) if rec.starts[i] < t_sig < rec.starts[i] + rec.latencies[i]
               and codes[i] == "OK"]
    assert len(drained) >= 4, "requests in flight at the signal were answered during the drain"

    after = [i for i in range(len(rec)) if rec.starts[i] > t_sig + RACE]
    assert after and all(codes[i] == "UNAVAILABLE" for i in after), [codes[i] for i in after][:10]
    assert out["late"] == "UNAVAILABLE"
    # Sent while the signal was being handled: OK (admitted in time) or UNAVAILABLE (refused), never CANCELLED.
    assert set(codes) <= {"OK", "UNAVAILABLE"}, collections.Counter(codes)

    seen = [s for _, s in out["statuses"]]
    assert seen[:1] == [health_pb2.HealthCheckResponse.SERVING]
    assert health_pb2.HealthCheckResponse.NOT_SERVING in seen, seen
    assert out["watch_end"] == "UNAVAILABLE", out["watch_end"]  # the drain ended the stream

    assert out["code"] == 0, log[-3000:]
    assert out["exit_after"] < DRAIN_TIMEOUT, (out["exit_after"], out["statuses"], log[-3000:])
    print(f"inflight at SIGTERM {out['inflight']:.0f}, answered during drain {len(drained)}, exit {out['exit_after']:.2f} s after SIGTERM")
    assert "draining" in log
    assert not stray_errors(log), stray_errors(log)


# ---------------------------------------------------------------------- the serve() process path, fake models

async def _closed_loop_until_exit(srv: FakeServerProcess, clients: int) -> tuple[collections.Counter, int]:
    """``clients`` closed-loop Classify clients (50 ms back-off after UNAVAILABLE, as loadtest's engine);
    SIGTERM once every client has had an answer; clients stop when the process has exited."""
    codes: collections.Counter = collections.Counter()
    exited = asyncio.Event()
    async with grpc.aio.insecure_channel(srv.target) as ch:
        stub = pb_grpc.InferenceStub(ch)

        async def client() -> None:
            while not exited.is_set():
                try:
                    await stub.Classify(pb.ClassifyRequest(model="m", texts=["good film"]), timeout=30)
                    codes["OK"] += 1
                except grpc.aio.AioRpcError as exc:
                    codes[exc.code().name] += 1
                    if exc.code() == grpc.StatusCode.UNAVAILABLE:
                        await asyncio.sleep(0.05)

        tasks = [asyncio.create_task(client()) for _ in range(clients)]
        while codes["OK"] < 4 * clients:
            await asyncio.sleep(0.01)
        srv.terminate()
        code = await asyncio.to_thread(srv.wait, 60)
        await asyncio.sleep(0.2)  # calls sent just before the exit still end
        exited.set()
        await asyncio.gather(*tasks)
    return codes, code


def test_sigterm_under_closed_loop_load_no_call_is_cancelled():
    total: collections.Counter = collections.Counter()
    for _ in range(3):  # the race is per signal: several signals
        with FakeServerProcess({"m": {"delay": 0.01, "config": {"max_batch_size": 4, "max_queue_delay": 0.0}}},
                               drain_timeout=10.0) as srv:
            codes, exit_code = asyncio.run(_closed_loop_until_exit(srv, CLIENTS))
            log = srv.log_text()
        assert exit_code == 0, log[-3000:]
        assert not stray_errors(log), stray_errors(log)
        total += codes
    assert set(total) <= {"OK", "UNAVAILABLE"}, total
    assert total["OK"] >= 3 * 4 * CLIENTS and total["UNAVAILABLE"] >= 3


async def _watch_then_term(srv: FakeServerProcess) -> tuple[list[int], str, float, int]:
    seen: list[int] = []
    async with grpc.aio.insecure_channel(srv.target) as ch:
        call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))
        seen.append((await call.read()).status)  # the current status: SERVING
        # grpc.aio's read() raises at once, skipping messages it holds, once the status has arrived; so the
        # read that takes NOT_SERVING is pending before the signal, or a slow client loop could miss it.
        pending = asyncio.ensure_future(call.read())
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        srv.terminate()
        try:
            while (reply := await pending) is not grpc.aio.EOF:
                seen.append(reply.status)
                pending = asyncio.ensure_future(call.read())
            ended = "OK"
        except grpc.aio.AioRpcError as exc:
            ended = exc.code().name
        code = await asyncio.to_thread(srv.wait, 60)
        return seen, ended, time.monotonic() - t0, code


def test_open_watch_gets_not_serving_ends_and_does_not_hold_the_exit():
    drain_timeout = 20.0
    with FakeServerProcess({"m": {}}, drain_timeout=drain_timeout) as srv:
        seen, ended, exit_after, code = asyncio.run(_watch_then_term(srv))
        log = srv.log_text()
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert seen == [serving, not_serving], (seen, ended, exit_after, log[-3000:])
    assert ended == "UNAVAILABLE"
    assert code == 0, log[-3000:]
    assert exit_after < drain_timeout / 2, (exit_after, log[-3000:])  # nothing in flight: not the full grace
    assert "every request answered" in log
    assert not stray_errors(log), stray_errors(log)


def test_call_running_past_drain_timeout_ends_unavailable_and_the_process_exits():
    hang = 60.0  # the backend's batch outlives the drain by far; its thread must not keep the process alive
    with FakeServerProcess({"m": {"delay": hang, "config": {"max_batch_size": 1, "max_queue_delay": 0.0}}},
                           drain_timeout=1.0) as srv:
        with grpc.insecure_channel(srv.target) as ch:
            stub = pb_grpc.InferenceStub(ch)
            running = [stub.Classify.future(pb.ClassifyRequest(model="m", texts=["good"]), timeout=hang * 2)
                       for _ in range(2)]  # one in the backend, one queued behind it
            time.sleep(0.3)
            t0 = time.monotonic()
            srv.terminate()
            codes = []
            for f in running:
                try:
                    f.result(timeout=hang)
                    codes.append("OK")
                except grpc.RpcError as exc:
                    codes.append(exc.code().name)
            code = srv.wait(hang)
            exit_after = time.monotonic() - t0
        log = srv.log_text()
    assert codes == ["UNAVAILABLE", "UNAVAILABLE"], (codes, log[-3000:])
    assert code == 0, log[-3000:]
    assert exit_after < hang / 2, exit_after
    assert "drain timeout: 2 requests still running" in log
    assert not stray_errors(log), stray_errors(log)
