"""ONNX Runtime is optional (the ``relserve[onnx]`` / ``relserve[onnx-gpu]`` extras): with onnx, onnxscript and
onnxruntime hidden from a child process, a torch model is served without any of them being imported, and
``backend=onnx`` / ``relserve export`` fail with a message that names the extras.

The child processes get a ``sitecustomize`` that hides those three packages (tests/fixtures/hidden_modules.py:
what an absent package gives), so this runs in the test venv that has them installed; an audit hook writes
down every attempt to import one of them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import pytest

from relserve.loadtest.serverproc import ServerProcess
from relserve.service._proto import inference_pb2 as pb
from relserve.service._proto import inference_pb2_grpc as pb_grpc

from fixtures.deberta import make_deberta_checkpoint
from fixtures.hidden_modules import hiding_env

HIDDEN = ("onnx", "onnxruntime", "onnxscript")

# After the finder (tests/fixtures/hidden_modules.py): an audit hook writing down every import attempt.
AUDIT = textwrap.dedent("""
    import os


    REPORT = os.environ["RELSERVE_TEST_ONNX_MODULES"]
    open(REPORT, "w").close()


    def _audit(event, args):
        # every import statement of a HIDDEN module, as it happens (the server may leave through os._exit)
        if event == "import" and str(args[0]).split(".")[0] in HIDDEN:
            with open(REPORT, "a") as f:
                f.write(str(args[0]) + "\\n")


    sys.addaudithook(_audit)
""")


@pytest.fixture()
def no_onnx(tmp_path) -> tuple[dict, Path]:
    """(environment for a child without the onnx extra, the file listing its attempts to import them)."""
    env = hiding_env(tmp_path / "site", HIDDEN, AUDIT)
    report = tmp_path / "onnx-modules.json"
    return {"PYTHONPATH": env["PYTHONPATH"], "RELSERVE_TEST_ONNX_MODULES": str(report)}, report


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, unigram_tokenizer_dir) -> Path:
    return make_deberta_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", task="classification",
                                   tokenizer_dir=unigram_tokenizer_dir, labels=("negative", "positive")).path


def test_the_blocker_hides_onnx_runtime(no_onnx):
    env, report = no_onnx
    code = "import importlib.util as u; assert u.find_spec('onnx') is None; import onnxruntime"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, **env})
    assert out.returncode != 0 and "No module named 'onnxruntime'" in out.stderr, out.stderr
    assert report.read_text().split() == ["onnxruntime"]  # the audit hook sees an import attempt


def test_torch_model_serves_without_onnx_modules(no_onnx, checkpoint):
    env, report = no_onnx
    srv = ServerProcess(["--model", f"tiny={checkpoint}"], env=env, start_timeout=120).start()  # backend auto
    try:
        with grpc.insecure_channel(srv.target) as channel:
            stub = pb_grpc.InferenceStub(channel)
            (model,) = stub.ListModels(pb.ListModelsRequest(), timeout=30).models
            reply = stub.Classify(pb.ClassifyRequest(model="tiny", texts=["A fine film."]), timeout=60)
    finally:
        code = srv.stop()
        log = srv.log_text()
        srv.close()
    assert code == 0 and "Traceback" not in log, log[-3000:]
    assert model.backend == "torch"  # auto falls back to torch without ONNX Runtime
    (result,) = reply.results
    assert {s.label for s in result.labels} == {"negative", "positive"}
    assert abs(sum(s.score for s in result.labels) - 1.0) < 1e-5
    assert report.read_text().split() == []  # nothing even tried to import onnx, onnxruntime or onnxscript


def test_backend_onnx_without_onnx_runtime_names_the_extras(no_onnx, checkpoint):
    env, _ = no_onnx
    out = subprocess.run([sys.executable, "-m", "relserve.service.main", "serve", "--host", "127.0.0.1", "--port", "0",
                          "--metrics-port", "0",  # a server already on the default 8002 must not decide the outcome
                          "--model", f"tiny={checkpoint},backend=onnx"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, **env})
    assert out.returncode == 2, out.stderr[-3000:]
    assert "model 'tiny': backend onnx needs ONNX Runtime" in out.stderr
    assert "pip install 'relserve[onnx]'" in out.stderr and "relserve[onnx-gpu]" in out.stderr
    assert "Traceback" not in out.stderr


def test_export_without_onnx_runtime_names_the_extras(no_onnx, checkpoint, tmp_path):
    env, report = no_onnx
    out = subprocess.run([sys.executable, "-m", "relserve.service.main", "export", str(checkpoint),
                          str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env})
    assert out.returncode == 2, out.stderr[-3000:]
    assert "relserve export needs ONNX Runtime (not installed: onnxruntime, onnx, onnxscript)" in out.stderr
    assert "relserve[onnx]" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "out").exists()
