"""Graceful drain of the real server process under load.

``relserve serve`` runs as a child process with a tiny random DeBERTa classifier; a closed-loop load
(``relserve.loadtest``'s engine, 16 clients, one grpc.aio channel, mixed-length texts) runs against it and
SIGTERM arrives mid-run while requests are queued. Checked: health turns NOT_SERVING (seen on a Watch stream),
every request sent before the signal succeeds (none CANCELLED, none lost), requests sent after the drain began
get UNAVAILABLE and nothing else, and the process exits 0 within drain_timeout.

Known limit (grpc core, not relserve): a call that reaches the server in the few milliseconds while it
handles the signal, and that grpc core has received but not yet handed to Python when the gRPC server is
stopped, is reset by the transport and its client sees CANCELLED. Such calls were sent concurrently with
the signal; the test allows that outcome only within that race window.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

torch = pytest.importorskip("torch")

from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from fixtures.deberta import make_deberta_checkpoint  # noqa: E402
from relserve.loadtest import generator, promscrape  # noqa: E402
from relserve.loadtest.scenarios import Scenario  # noqa: E402
from relserve.loadtest.serverproc import ServerProcess  # noqa: E402

DRAIN_TIMEOUT = 10.0
CLIENTS = 16
SIGNAL_AT = 1.5      # seconds into the load
LOAD_FOR = 3.5       # clients stop sending new requests after this (2 s after the signal)
MARGIN = 0.05        # a request sent this long before the signal has certainly reached the server
RACE = 0.5           # a request sent this long after the signal certainly meets a draining server


@pytest.fixture(scope="module")
def tiny_classifier(unigram_tokenizer_dir, tmp_path_factory):
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

    async def watch() -> None:
        try:
            async for reply in health.Watch(health_pb2.HealthCheckRequest(service="")):
                statuses.append((engine.now(), reply.status))
        except grpc.aio.AioRpcError:
            pass

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
        end = time.monotonic() + 5
        while not any(s == health_pb2.HealthCheckResponse.NOT_SERVING for _, s in statuses) \
                and time.monotonic() < end:
            await asyncio.sleep(0.01)
        watcher.cancel()  # an open Watch stream would otherwise hold the drain for the whole grace period
        await asyncio.gather(watcher, return_exceptions=True)
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
                exit_after=exit_after, late=late)


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
    # Sent while the signal was being handled: OK (admitted in time), UNAVAILABLE (refused), or - for a call
    # grpc core had received but not yet handed to Python when the server stopped - reset (CANCELLED).
    racing = [codes[i] for i in range(len(rec)) if t_sig - MARGIN <= rec.starts[i] <= t_sig + RACE]
    assert set(racing) <= {"OK", "UNAVAILABLE", "CANCELLED"}, racing
    assert racing.count("CANCELLED") <= CLIENTS

    seen = [s for _, s in out["statuses"]]
    assert seen[:1] == [health_pb2.HealthCheckResponse.SERVING]
    assert health_pb2.HealthCheckResponse.NOT_SERVING in seen, seen

    assert out["code"] == 0, log[-3000:]
    assert out["exit_after"] < DRAIN_TIMEOUT, (out["exit_after"], out["statuses"], log[-3000:])
    print(f"inflight at SIGTERM {out['inflight']:.0f}, answered during drain {len(drained)}, exit {out['exit_after']:.2f} s after SIGTERM")
    assert "draining" in log
