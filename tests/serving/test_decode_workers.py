"""Translation decode loops in worker processes (``worker_process: true``; service/scheduling/decode_workers.py,
decode_pool.py, decode_child.py) through a real grpc.aio server with a tiny real RNNsearch checkpoint: the same
hypotheses, scores and alignments as the in-process loop (beam 1 and 5, n-best, alignments) with the texts
spread over two processes; TranslateStream's per-step partial results; a cancelled call's texts leave the
process's loop; and the worker faults: decode processes killed (SIGKILL) or stopped (SIGSTOP) under calls turn
the model NOT_SERVING, those calls fail UNAVAILABLE naming why, new processes replace them and answer as
before, while the in-process model answers throughout."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

pytest.importorskip("torch")

from fixtures.fake_serving import server_config  # noqa: E402
from fixtures.health_watch import NOT_SERVING, WAIT_S, HealthWatch  # noqa: E402
from fixtures.health_watch import wait_until as _wait_until  # noqa: E402
from fixtures.server import Running, wait_gone  # noqa: E402
from fixtures.translation import make_tiny_checkpoint, sentence_pairs  # noqa: E402
from relserve.service._proto import inference_pb2 as pb  # noqa: E402
from relserve.service.config import ConfigError, ModelConfig  # noqa: E402
from relserve.service.config.validation import validate_model  # noqa: E402
from relserve.service.registry import build_runner  # noqa: E402
from relserve.service.scheduling.decode_pool import DecodePool  # noqa: E402
from relserve.service.scheduling.decode_workers import DecodeWorkers  # noqa: E402


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    """``tr``: in-process; ``trw``: the same checkpoint in two decode processes, declared hung when they hold texts
    and finish no step for 2 s."""
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("decode-workers") / "bigru", seed=1)
    # one intra-op thread each: the processes get one by default on 2 cores, and a matmul summed over other thread
    # splits differs in the last float32 bits (a 98-nat log_prob by 2 ulps)
    cfg = dict(path=ckpt, device="cpu", dtype="float32", backend="torch", max_source_tokens=120,
               max_batch_tokens=4096, max_queue_delay=0.002, torch_intra_op_threads=1)
    runners = [build_runner(ModelConfig(name="tr", worker_process=False, **cfg)),
               build_runner(ModelConfig(name="trw", worker_process=True, decode_instances=2, worker_batch_timeout=2.0,
                                        **cfg))]
    s = Running(server_config(), runners)
    s.wait_serving(timeout=240)
    yield s
    s.close()


def _runner(srv, name="trw"):
    return srv.server.registry.runners[name]


def _translate(srv, model, texts, timeout=60, **kw):
    return srv.stub.Translate(pb.TranslateRequest(model=model, texts=texts, **kw), timeout=timeout).results


def _assert_same(a, b) -> None:
    """Two Translate answers agree: the same n-best token ids in order, scores within 1e-5 (log_prob within
    1e-6 relative), alignments (labels and weights) within 1e-5."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.num_source_tokens == y.num_source_tokens
        assert [list(h.token_ids) for h in x.hypotheses] == [list(h.token_ids) for h in y.hypotheses]
        assert [h.text for h in x.hypotheses] == [h.text for h in y.hypotheses]
        assert [h.truncated for h in x.hypotheses] == [h.truncated for h in y.hypotheses]
        assert [h.score for h in x.hypotheses] == pytest.approx([h.score for h in y.hypotheses], abs=1e-5)
        # log_prob sums up to ~200 nats over the tokens: float32 holds it to ~1e-7 relative (a text batched with
        # other texts sums in another order); score, the per-token mean that ranks hypotheses, to 1e-5
        assert [h.log_prob for h in x.hypotheses] == pytest.approx([h.log_prob for h in y.hypotheses], rel=1e-6,
                                                                   abs=1e-5)
        for h, g in zip(x.hypotheses, y.hypotheses):
            assert h.HasField("alignment") == g.HasField("alignment")
            assert list(h.alignment.source_tokens) == list(g.alignment.source_tokens)
            assert list(h.alignment.target_tokens) == list(g.alignment.target_tokens)
            assert list(h.alignment.weights) == pytest.approx(list(g.alignment.weights), abs=1e-5)


TEXTS = [s for s, _ in sentence_pairs(24)]


def test_decode_instances_needs_worker_process(tmp_path):
    with pytest.raises(ConfigError, match="decode_instances 2 needs worker_process: true"):
        validate_model(ModelConfig(name="tr", path=tmp_path, decode_instances=2))
    assert validate_model(ModelConfig(name="tr", path=tmp_path, decode_instances=2, worker_process=True))


@pytest.mark.parametrize("beam,n_best", [(1, 1), (5, 3)])
def test_same_hypotheses_scores_and_alignments_as_the_in_process_loop(srv, beam, n_best):
    pool = _runner(srv).scheduler
    assert isinstance(pool, DecodePool) and isinstance(_runner(srv).backend, DecodeWorkers)
    before = pool.dispatched
    kw = dict(beam_size=beam, n_best=n_best, return_alignment=True)
    # concurrent requests, so that texts join and leave the processes' loops together as in service
    with ThreadPoolExecutor(4) as ex:
        worker = list(ex.map(lambda t: _translate(srv, "trw", t, **kw), [TEXTS[i::4] for i in range(4)]))
    local = [_translate(srv, "tr", TEXTS[i::4], **kw) for i in range(4)]
    for a, b in zip(worker, local):
        _assert_same(a, b)
        assert all(len(r.hypotheses) == n_best for r in a)
    assert pool.dispatched - before == len(TEXTS)
    busy = _runner(srv).backend.instances
    assert all(inst.process.pid for inst in busy)  # two processes served


def test_stream_partials_then_final_equal_to_unary(srv):
    text = TEXTS[5]
    msgs = list(srv.stub.TranslateStream(pb.TranslateStreamRequest(model="trw", text=text, beam_size=3), timeout=60))
    local = list(srv.stub.TranslateStream(pb.TranslateStreamRequest(model="tr", text=text, beam_size=3), timeout=60))
    assert msgs[-1].final and not any(m.final for m in msgs[:-1])
    assert len(msgs) > 2  # partials per decoder step, forwarded over the pipe
    # a slow reader gets the latest partial only, so either side may skip steps: where both have a step, the
    # best hypothesis after it is the same; the steps only grow; the final result is the same
    by_step = {m.step: list(m.tokens) for m in local[:-1]}
    partial = [m for m in msgs[:-1]]
    assert [m.step for m in partial] == sorted({m.step for m in partial})
    shared = [m for m in partial if m.step in by_step]
    assert shared and all(list(m.tokens) == by_step[m.step] for m in shared)
    assert list(msgs[-1].tokens) == list(local[-1].tokens) and msgs[-1].step == local[-1].step
    unary = _translate(srv, "trw", [text], beam_size=3)[0].hypotheses[0]
    assert msgs[-1].text == unary.text


def test_a_cancelled_call_leaves_the_process_loop(srv):
    """The processes are held still (SIGSTOP, well under worker_batch_timeout) while a call is handed to them and
    cancelled, so the cancellation reaches texts that are still in their loops: each process drops them and
    says so, and nothing stays held."""
    backend, pool = _runner(srv).backend, _runner(srv).scheduler
    _wait_until(lambda: len(backend.serving()) == 2, "both decode processes serving")
    dropped = pool.dropped
    pids = list(backend.pids)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        future = srv.stub.Translate.future(pb.TranslateRequest(model="trw", texts=TEXTS[:6], beam_size=5), timeout=60)
        _wait_until(lambda: pool.held_sequences == 6, "the texts handed to the decode processes")
        future.cancel()
        _wait_until(lambda: all(s.future.done() for _, s in pool._held.values()), "the cancellation sent")
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    _wait_until(lambda: pool.held_sequences == 0, "the cancelled texts gone from the decode processes")
    assert pool.dropped - dropped == 6 and backend.pids == pids  # dropped by the loops, not by a replacement
    _assert_same(_translate(srv, "trw", TEXTS[:3], beam_size=5), _translate(srv, "tr", TEXTS[:3], beam_size=5))


def test_lost_decode_processes_fail_their_calls_unavailable_and_are_replaced(srv):
    """Both processes stopped and calls handed to them; then one is killed (SIGKILL) and the other left stopped
    until the watchdog gives up on it (worker_batch_timeout). Each call fails UNAVAILABLE naming what happened
    to its process (not at its 600 s deadline); with both down the model is NOT_SERVING (the killed one's
    replacement is held stopped until then, so both are down at once on any machine); new processes answer as
    the old ones did (no SIGCONT to the old ones), and the in-process model answers throughout."""
    backend, pool = _runner(srv).backend, _runner(srv).scheduler
    _wait_until(lambda: len(backend.serving()) == 2, "both decode processes serving")
    before = _translate(srv, "trw", TEXTS[:4], beam_size=5, n_best=2)
    old = list(backend.pids)
    watch = HealthWatch(srv, "trw")
    errors, held_new = [], None
    try:
        with ThreadPoolExecutor(4) as ex:
            for pid in old:
                os.kill(pid, signal.SIGSTOP)
            calls = [ex.submit(_translate, srv, "trw", [t], 600, beam_size=5) for t in TEXTS[:4]]
            _wait_until(lambda: pool.held_sequences == 4, "the calls handed to the stopped processes")
            assert sorted(i for i, _ in pool._held.values()) == [0, 0, 1, 1]  # spread: the least loaded first
            os.kill(old[0], signal.SIGKILL)
            _wait_until(lambda: backend.pids[0] not in (None, old[0]), "a replacement for instance 0 started")
            held_new = backend.pids[0]
            os.kill(held_new, signal.SIGSTOP)  # still importing: it cannot serve before instance 1 is given up
            _wait_until(lambda: NOT_SERVING in watch.statuses, "model trw NOT_SERVING")
            assert _translate(srv, "tr", TEXTS[:2])  # the in-process model is not touched
            for call in calls:
                with pytest.raises(grpc.RpcError) as err:
                    call.result(WAIT_S)
                errors.append((err.value.code(), err.value.details()))
            os.kill(held_new, signal.SIGCONT)
            held_new = None
        _wait_until(watch.saw_recovery, "model trw SERVING again")
        _wait_until(lambda: len(backend.serving()) == 2, "both decode processes replaced")
        _assert_same(_translate(srv, "trw", TEXTS[:4], beam_size=5, n_best=2), before)
    finally:
        if held_new is not None:
            os.kill(held_new, signal.SIGCONT)
        watch.close()
    assert all(code == grpc.StatusCode.UNAVAILABLE for code, _ in errors), errors
    killed = [d for _, d in errors if f"decode worker process {old[0]} was killed by SIGKILL" in d]
    hung = [d for _, d in errors if f"decode worker process {old[1]} " in d
            and ("finished no decoder step" in d and "worker_batch_timeout" in d or "stopped (SIGSTOP)" in d)]
    assert len(killed) == 2 and len(hung) == 2, errors
    assert all(wait_gone(pid) for pid in old)
    assert not set(backend.pids) & set(old) and pool.held_sequences == 0
