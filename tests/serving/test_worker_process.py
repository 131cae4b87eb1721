"""worker_process: an encoder model computed in a child process (service/backends/worker.py), through a real
grpc.aio server: the same answers as in-process, the child's CPU and memory in the metrics, a child killed
while idle or during a batch (only that batch fails, the next one is served by a new child), the child ended
with the server and with a killed parent, and translation models refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request

import grpc
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fixtures.deberta import make_deberta_checkpoint  # noqa: E402
from fixtures.fake_serving import server_config  # noqa: E402
from fixtures.server import Running, process_alive, wait_gone  # noqa: E402
from relserve.service._proto import inference_pb2 as pb  # noqa: E402
from relserve.service.backends import create_backend, create_translation_backend  # noqa: E402
from relserve.service.backends.padding import WarmupEncoding  # noqa: E402
from relserve.service.backends.worker import WorkerBackend  # noqa: E402
from relserve.service.config import ConfigError, ModelConfig  # noqa: E402
from relserve.service.errors import Internal  # noqa: E402
from relserve.service.registry import build_runner  # noqa: E402

CONTEXT = "Ann lives in Berlin and works as a baker. Her brother Tom lives in Paris. " * 6
TEXTS = ["some text", "some longer text about Berlin", "word " * 150, "x"]


@pytest.fixture(scope="module")
def checkpoints(unigram_tokenizer_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("worker-ckpt")
    return {name: make_deberta_checkpoint(root / name, task=task, tokenizer_dir=unigram_tokenizer_dir,
                                          labels=("a", "b", "c"), init="spread", seed=seed).path
            for name, task, seed in (("cls", "classification", 1), ("qa", "question-answering", 2))}


@pytest.fixture(scope="module")
def srv(checkpoints):
    common = dict(device="cpu", dtype="float32", max_seq_len=128, max_queue_delay=0.002, doc_stride=32)
    runners = [build_runner(ModelConfig(name=f"{task}-{mode}", path=checkpoints[task], worker_process=mode == "worker",
                                        **common))
               for task in ("cls", "qa") for mode in ("inproc", "worker")]
    s = Running(server_config(), runners)
    s.wait_serving(timeout=150)
    yield s
    s.close()


def _worker(srv, name: str) -> WorkerBackend:
    backend = next(r for r in srv.server.runners if r.name == name).backend
    assert isinstance(backend, WorkerBackend)
    return backend


def _classify(srv, model: str):
    return srv.stub.Classify(pb.ClassifyRequest(model=model, texts=TEXTS), timeout=60).results


def _assert_same_classify(a, b) -> None:
    assert len(a) == len(b) == len(TEXTS)
    for x, y in zip(a, b):
        assert (x.num_tokens, x.truncated) == (y.num_tokens, y.truncated)
        assert [s.label for s in x.labels] == [s.label for s in y.labels]
        np.testing.assert_allclose([s.score for s in x.labels], [s.score for s in y.labels], atol=1e-6)


def test_worker_answers_as_the_in_process_model(srv):
    _assert_same_classify(_classify(srv, "cls-inproc"), _classify(srv, "cls-worker"))
    for question in ("Where does Ann live?", "Who is Tom?"):
        kw = dict(question=question, context=CONTEXT, top_k=3)
        a = srv.stub.Answer(pb.AnswerRequest(model="qa-inproc", **kw), timeout=60)
        b = srv.stub.Answer(pb.AnswerRequest(model="qa-worker", **kw), timeout=60)
        assert a.num_windows == b.num_windows >= 2
        assert [(x.text, x.start, x.end) for x in a.answers] == [(x.text, x.start, x.end) for x in b.answers]
        np.testing.assert_allclose([x.score for x in a.answers], [x.score for x in b.answers], atol=1e-6)
    models = {m.name: m for m in srv.stub.ListModels(pb.ListModelsRequest()).models}
    assert (models["cls-worker"].backend, models["cls-worker"].device) == ("torch", "cpu")


def test_the_worker_is_a_child_process_and_its_cpu_and_memory_are_metrics(srv):
    backend = _worker(srv, "cls-worker")
    pid = backend.pid
    assert pid not in (None, os.getpid()) and process_alive(pid)
    with open(f"/proc/{pid}/stat") as f:
        assert int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid()  # ppid: the server's process
    _classify(srv, "cls-worker")
    body = urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10).read().decode()
    values = {}
    for line in body.splitlines():
        for name in ("relserve_worker_cpu_seconds_total", "relserve_worker_resident_memory_bytes"):
            if line.startswith(f'{name}{{model="cls-worker"}}'):
                values[name] = float(line.split()[-1])
    assert values["relserve_worker_cpu_seconds_total"] > 0.1  # it loaded torch and a model, and ran batches
    assert values["relserve_worker_resident_memory_bytes"] > 50e6
    assert 'relserve_worker_cpu_seconds_total{model="cls-inproc"}' not in body


def _wait_ready_again(srv, name: str, old: int) -> None:
    """The watchdog replaced the worker (the model is NOT_SERVING meanwhile: tests/serving/test_worker_health.py)."""
    from grpc_health.v1 import health_pb2

    backend = _worker(srv, name)
    serving = health_pb2.HealthCheckResponse.SERVING
    end = time.monotonic() + 150
    while not (backend.pid not in (None, old) and srv.health_status(name) == serving) and time.monotonic() < end:
        time.sleep(0.05)


def test_a_worker_killed_while_idle_is_restarted_and_serves_again(srv):
    backend = _worker(srv, "cls-worker")
    old = backend.pid
    os.kill(old, signal.SIGKILL)
    assert wait_gone(old)
    _wait_ready_again(srv, "cls-worker", old)
    _assert_same_classify(_classify(srv, "cls-inproc"), _classify(srv, "cls-worker"))
    assert backend.pid not in (None, old) and process_alive(backend.pid)


def test_a_worker_that_dies_during_a_batch_fails_that_batch_only(srv):
    backend = _worker(srv, "qa-worker")
    old = backend.pid
    # Stop the child, then kill it once the batch is on its way: it dies holding the batch, which fails
    # with INTERNAL naming what ended it; the next request is served by a new child.
    os.kill(old, signal.SIGSTOP)
    call = srv.stub.Answer.future(pb.AnswerRequest(model="qa-worker", question="Who is Tom?", context=CONTEXT),
                                  timeout=60)
    # until the batch is on the pipe to the child (a fixed sleep lost the race on a busy machine: the call was still
    # queued when the child died, and queued calls fail fast UNAVAILABLE instead)
    end = time.monotonic() + 30
    while backend._call_since is None and time.monotonic() < end:
        time.sleep(0.01)
    os.kill(old, signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as err:
        call.result()
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "worker process was killed by SIGKILL" in err.value.details()
    _wait_ready_again(srv, "qa-worker", old)
    kw = dict(question="Who is Tom?", context=CONTEXT, top_k=2)
    a = srv.stub.Answer(pb.AnswerRequest(model="qa-inproc", **kw), timeout=60)
    b = srv.stub.Answer(pb.AnswerRequest(model="qa-worker", **kw), timeout=60)
    assert [(x.text, x.start) for x in a.answers] == [(x.text, x.start) for x in b.answers]
    assert backend.pid != old


def test_closing_the_model_ends_its_worker(checkpoints):
    runner = build_runner(ModelConfig(name="m", path=checkpoints["cls"], device="cpu", dtype="float32",
                                      max_seq_len=64, worker_process=True))
    s = Running(server_config(), [runner])
    try:
        s.wait_serving(timeout=150)
        pid = runner.backend.pid
        assert process_alive(pid)
    finally:
        s.close()
    assert wait_gone(pid, 5.0)


def test_the_worker_dies_with_a_killed_parent(checkpoints, tmp_path):
    """The parent is SIGKILLed (no drain, no close): the child must not outlive it (PR_SET_PDEATHSIG)."""
    pid_file = tmp_path / "pid"
    script = textwrap.dedent(f"""
        from relserve.service.backends import create_backend
        from relserve.service.config import ModelConfig
        be = create_backend(ModelConfig(name="m", path={str(checkpoints["cls"])!r}, device="cpu", dtype="float32",
                                        max_seq_len=64, worker_process=True))
        be.load()
        open({str(pid_file)!r}, "w").write(str(be.pid))
        import time
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        end = time.monotonic() + 120
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < end:
            assert parent.poll() is None, "the parent exited before its worker loaded"
            time.sleep(0.1)
        child = int(pid_file.read_text())
        assert process_alive(child)
    finally:
        parent.kill()
        parent.wait(10)
    assert wait_gone(child, 10.0)


def test_load_errors_of_the_child_reach_the_parent(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    errors = []
    for worker in (False, True):
        be = create_backend(ModelConfig(name="m", path=tmp_path, device="cpu", worker_process=worker))
        with pytest.raises(Exception) as err:
            be.load()
        errors.append((type(err.value), str(err.value)))
        be.close()
    assert errors[0] == errors[1] and "no 'architectures' entry" in errors[0][1]  # the same error, not "worker died"


def test_a_call_to_a_dead_worker_is_internal_naming_the_exit(checkpoints):
    be = create_backend(ModelConfig(name="m", path=checkpoints["cls"], device="cpu", dtype="float32",
                                    max_seq_len=64, worker_process=True))
    be.load()
    pid = be.pid
    try:
        os.kill(pid, signal.SIGKILL)
        assert wait_gone(pid)
        with pytest.raises(Internal, match=r"worker process was killed by SIGKILL during run"):
            be._call("run", 1, [WarmupEncoding([1, 5, 2])])  # past run()'s liveness check: the pipe's EOF
        out = be.run([WarmupEncoding([1, 5, 2])])  # run() starts a new child
        assert out[0].shape == (3,) and be.pid != pid
    finally:
        be.close()


def test_translation_models_are_served_by_decode_worker_processes(tmp_path):
    # no longer refused: the registry runs the decode loops in worker processes (tests/serving/test_decode_workers.py)
    from relserve.service.scheduling.decode_workers import DecodeWorkers

    config = ModelConfig(name="tr", path=tmp_path, device="cpu", worker_process=True, decode_instances=2)
    workers = DecodeWorkers(config, create_translation_backend(config).name)
    assert len(workers.instances) == 2 and workers.pids == [None, None]  # nothing started before load()


def test_unset_means_a_worker_for_encoder_models_only(checkpoints, tmp_path):
    assert isinstance(create_backend(ModelConfig(name="m", path=checkpoints["cls"], device="cpu")), WorkerBackend)
    assert not isinstance(create_backend(ModelConfig(name="m", path=checkpoints["cls"], device="cpu",
                                                     worker_process=False)), WorkerBackend)
    # translation: unset is in-process (no error); only an explicit true is refused (test above)
    from relserve.service.backends.torch_translation import TorchTranslationBackend

    assert isinstance(create_translation_backend(ModelConfig(name="tr", path=tmp_path, device="cpu")),
                      TorchTranslationBackend)


def test_sigterm_to_the_process_group_drains_without_killing_the_worker(checkpoints):
    """systemd's control-group stop and ``kill -TERM -<pgid>`` signal the worker too: it must ignore that (the
    server drains and ends it), so the running batch finishes and no worker is restarted during the drain."""
    import re
    from concurrent.futures import ThreadPoolExecutor

    from relserve.loadtest.serverproc import ServerProcess
    from relserve.service._proto import inference_pb2_grpc as pb_grpc

    spec = f"qa={checkpoints['qa']},device=cpu,dtype=float32,max_seq_len=64,doc_stride=16,max_batch_size=2"
    with ServerProcess(["--model", spec, "--drain-timeout", "20"], new_session=True, start_timeout=150) as srv:
        child = int(re.search(r"worker process (\d+) started", srv.log_text()).group(1))
        with grpc.insecure_channel(srv.target) as ch, ThreadPoolExecutor(8) as pool:
            stub = pb_grpc.InferenceStub(ch)
            calls = [pool.submit(stub.Answer, pb.AnswerRequest(model="qa", question="Who is Tom?", context=CONTEXT * 3),
                                 timeout=60) for _ in range(8)]
            time.sleep(0.3)
            os.killpg(os.getpgid(srv.pid), signal.SIGTERM)
            answers = [c.result() for c in calls]  # every call answered: none failed with the worker
            code = srv.wait(30)
        log = srv.log_text()
    assert code == 0, log[-3000:]
    assert all(a.answers for a in answers)
    assert "restarting its worker process" not in log and "killed by SIGTERM" not in log, log[-3000:]
    assert wait_gone(child, 5.0)


def test_the_worker_returns_freed_heap_and_keeps_serving(srv):
    """The server trims every heap once its models are loaded (service/backends/heap.py); asked again, the worker
    answers (glibc: whether memory went back) and serves as before."""
    backend = _worker(srv, "cls-worker")
    assert isinstance(backend.trim_heap(), bool)
    _assert_same_classify(_classify(srv, "cls-inproc"), _classify(srv, "cls-worker"))
