"""Health tells the truth about worker processes (service/backends/worker.py), through a real grpc.aio server with
tiny checkpoints: a killed worker turns its model's health (its own grpc.health.v1 service) and v2 ModelReady
NOT_SERVING until a new worker has warmed; a stopped worker under a call is killed once its batch overruns
``worker_batch_timeout``, the queued calls fail UNAVAILABLE naming why instead of waiting out their deadlines,
and a new worker answers without SIGCONT; a worker over ``recycle_rss_mb`` is replaced between batches with no
failed call; another model answers throughout. And a cache directory the server cannot write
(backends/graph_cache.py) ends ``relserve serve`` with exit 2 naming the directory and the checkpoint."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

torch = pytest.importorskip("torch")

from fixtures.deberta import make_deberta_checkpoint  # noqa: E402
from fixtures.fake_serving import server_config  # noqa: E402
from fixtures.health_watch import NOT_SERVING, SERVING, WAIT_S, HealthWatch  # noqa: E402
from fixtures.health_watch import wait_until as _wait_until  # noqa: E402
from fixtures.server import Running, process_alive, wait_gone  # noqa: E402
from relserve.service._proto import grpc_predict_v2_pb2 as v2  # noqa: E402
from relserve.service._proto import grpc_predict_v2_pb2_grpc as v2_grpc  # noqa: E402
from relserve.service._proto import inference_pb2 as pb  # noqa: E402
from relserve.service.backends import graph_cache  # noqa: E402
from relserve.service.backends.worker import WorkerBackend, batch_timeout  # noqa: E402
from relserve.service.config import ConfigError, ModelConfig  # noqa: E402
from relserve.service.registry import build_runner  # noqa: E402

TEXTS = ["some text", "some longer text about Berlin", "x"]


@pytest.fixture(scope="module")
def checkpoint(unigram_tokenizer_dir, tmp_path_factory):
    return make_deberta_checkpoint(tmp_path_factory.mktemp("health-ckpt") / "cls", task="classification",
                                   tokenizer_dir=unigram_tokenizer_dir, labels=("a", "b", "c"), init="spread",
                                   seed=3).path


@pytest.fixture(scope="module")
def srv(checkpoint):
    """``w``: a worker model with a 3 s batch timeout; ``recycled``: a worker replaced after every batch
    (``recycle_rss_mb`` 1); ``other``: in-process, the model that must keep answering."""
    common = dict(path=checkpoint, device="cpu", dtype="float32", max_seq_len=64, max_queue_delay=0.002)
    runners = [build_runner(ModelConfig(name="w", worker_process=True, worker_batch_timeout=3.0, **common)),
               build_runner(ModelConfig(name="recycled", worker_process=True, recycle_rss_mb=1, **common)),
               build_runner(ModelConfig(name="other", worker_process=False, **common))]
    s = Running(server_config(), runners)
    s.v2 = v2_grpc.GRPCInferenceServiceStub(s.channel)
    s.wait_serving(timeout=240)
    yield s
    s.close()


def _backend(srv, name: str) -> WorkerBackend:
    backend = next(r for r in srv.server.runners if r.name == name).backend
    assert isinstance(backend, WorkerBackend)
    return backend


def _classify(srv, model: str, timeout: float = 60):
    return srv.stub.Classify(pb.ClassifyRequest(model=model, texts=TEXTS), timeout=timeout).results


def _assert_same(a, b) -> None:
    """Two Classify answers agree: labels in the same order, scores within 1e-5 (worker and in-process)."""
    assert len(a) == len(b) == len(TEXTS)
    for x, y in zip(a, b):
        assert [s.label for s in x.labels] == [s.label for s in y.labels]
        assert [s.score for s in x.labels] == pytest.approx([s.score for s in y.labels], abs=1e-5)


class OtherModelCalls:
    """Calls model ``other`` back to back in a thread while the block runs; every call must succeed."""

    def __init__(self, srv) -> None:
        self.srv, self.ok, self.errors = srv, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                _classify(self.srv, "other", timeout=30)
                self.ok += 1
            except grpc.RpcError as exc:
                self.errors.append((exc.code(), exc.details()))

    def __enter__(self) -> "OtherModelCalls":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)


def test_every_model_has_its_own_health_service(srv):
    for name in ("w", "recycled", "other"):
        assert srv.health_status(name) == SERVING
        assert srv.v2.ModelReady(v2.ModelReadyRequest(name=name), timeout=5).ready


def test_a_killed_worker_turns_its_model_not_serving_until_a_new_one_has_warmed(srv):
    backend = _backend(srv, "w")
    before = _classify(srv, "w")
    old = backend.pid
    watch = HealthWatch(srv, "w")
    try:
        with OtherModelCalls(srv) as other:
            os.kill(old, signal.SIGKILL)
            _wait_until(lambda: NOT_SERVING in watch.statuses, "model w NOT_SERVING")
            _wait_until(watch.saw_recovery, "model w SERVING again")
            assert srv.health_status("w") == SERVING
            assert srv.v2.ModelReady(v2.ModelReadyRequest(name="w"), timeout=5).ready
            _assert_same(_classify(srv, "w"), before)  # the new worker answers as the old one did
        assert other.ok > 0 and other.errors == []
    finally:
        watch.close()
    assert backend.pid not in (None, old) and process_alive(backend.pid)
    assert srv.health_status("") == SERVING  # the server as a whole kept serving (probes stay green)


def test_a_stopped_worker_is_replaced_and_its_queued_calls_fail_fast(srv):
    backend = _backend(srv, "w")
    old = backend.pid
    before = _classify(srv, "w")
    watch = HealthWatch(srv, "w")
    try:
        with OtherModelCalls(srv) as other, ThreadPoolExecutor(4) as pool:
            os.kill(old, signal.SIGSTOP)
            running = pool.submit(_classify, srv, "w", 600)
            _wait_until(lambda: backend._call_since is not None, "the call to reach the stopped worker")
            queued = [pool.submit(_classify, srv, "w", 600) for _ in range(3)]  # long deadlines: not waited out
            _wait_until(lambda: NOT_SERVING in watch.statuses, "model w NOT_SERVING")
            assert not srv.v2.ModelReady(v2.ModelReadyRequest(name="w"), timeout=5).ready
            errors = []
            for call in [running, *queued]:
                with pytest.raises(grpc.RpcError) as err:
                    call.result(WAIT_S)
                errors.append((err.value.code(), err.value.details()))
            _wait_until(watch.saw_recovery, "model w SERVING again (no SIGCONT sent)")
            _assert_same(_classify(srv, "w"), before)
        assert other.ok > 0 and other.errors == []
    finally:
        watch.close()
    assert all(code == grpc.StatusCode.UNAVAILABLE for code, _ in errors), errors
    assert all(f"worker process {old}" in details for _, details in errors), errors  # the reason, named
    assert wait_gone(old)  # killed while stopped
    assert backend.pid not in (None, old)


def test_a_worker_over_recycle_rss_mb_is_replaced_between_batches_without_a_failed_call(srv):
    backend = _backend(srv, "recycled")
    first, replaced = backend.pid, backend.replacements
    watch = HealthWatch(srv, "recycled")
    try:
        answers = [_classify(srv, "recycled")]  # its batch leaves the worker over 1 MiB: replaced after it
        assert backend._call_limit == 30.0  # the batcher's prediction reached the worker (none: 300 s)
        answers.append(_classify(srv, "recycled"))  # sent at once: waits for the new worker, does not fail
        _wait_until(lambda: backend.replacements > replaced and backend.pid not in (None, first), "a new worker")
    finally:
        watch.close()
    for answer in answers:
        _assert_same(answer, _classify(srv, "other"))
    assert wait_gone(first)
    assert NOT_SERVING not in watch.statuses  # the model stayed ready throughout


def test_the_batch_timeout_is_ten_times_the_prediction_and_at_least_30_s(checkpoint):
    auto = ModelConfig(name="m", path=checkpoint)
    assert batch_timeout(auto, 0.5) == 30.0
    assert batch_timeout(auto, 12.0) == 120.0
    assert batch_timeout(auto, None) == 300.0  # no prediction yet
    assert batch_timeout(ModelConfig(name="m", path=checkpoint, worker_batch_timeout=2.5), 12.0) == 2.5


def test_a_full_cache_disk_is_a_config_error_naming_the_path_and_the_checkpoint(checkpoint, tmp_path):
    config = ModelConfig(name="m", path=checkpoint, onnx_cache_dir=tmp_path / "cache")

    def export(out):  # what an exporter does on a full disk: its own error, raised from the OSError
        try:
            raise OSError(errno.ENOSPC, "No space left on device", str(out / "model.onnx"))
        except OSError as exc:
            raise RuntimeError("export failed") from exc

    with pytest.raises(ConfigError) as err:
        graph_cache.load_graphs(config, ("model.onnx",), export, lambda *a: None)
    message = str(err.value)
    assert str(tmp_path / "cache") in message and str(checkpoint) in message and "No space left" in message


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory the server (this uid) owns and cannot write: mode 0500, or, for root, a read-only tmpfs."""
    d = tmp_path / "ro-cache"
    d.mkdir(mode=0o700)
    if os.geteuid() != 0:
        d.chmod(0o500)
        yield d
        d.chmod(0o700)
        return
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,mode=0700,size=64k", "tmpfs", str(d)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"root cannot be kept from writing a directory here (mount: {done.stderr.strip()})")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], capture_output=True)


def test_a_read_only_cache_dir_exits_2_naming_the_path_and_the_checkpoint(checkpoint, read_only_dir):
    pytest.importorskip("onnxruntime")
    spec = f"m={checkpoint},backend=onnx,device=cpu,max_seq_len=64,onnx_cache_dir={read_only_dir}"
    done = subprocess.run([sys.executable, "-m", "relserve.service.main", "serve", "--host", "127.0.0.1",
                           "--port", "0", "--metrics-port", "0", "--model", spec], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("relserve: configuration error:"), done.stderr[-3000:]
    assert str(read_only_dir) in last and str(checkpoint) in last, last
    assert "Read-only file system" in last or "Permission denied" in last, last
