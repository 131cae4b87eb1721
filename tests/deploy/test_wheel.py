"""A non-editable install works: the wheel built from the tracked sources carries the generated gRPC stubs,
the .proto files and the default models, and its console script serves a checkpoint.

The wheel is built offline (``pip wheel --no-deps --no-build-isolation``, the build requirements come from
the venv running the tests) from a copy of the files git tracks plus the untracked, not-ignored ones, so
nothing generated in this checkout (stubs, egg-info, build/) can leak into it. It is installed with
``--no-deps`` into a temporary venv whose dependencies (torch, grpcio, ...) come from the test venv through
a ``.pth`` line; that line only extends ``sys.path``, so the test venv's editable-install finder is not
activated, and the test checks that ``relserve`` really is imported from the temporary venv.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import grpc
import numpy as np
import pytest

from relserve.loadtest.serverproc import ServerProcess
from relserve.service._proto import PROTOS
from relserve.service._proto import inference_pb2 as pb
from relserve.service._proto import inference_pb2_grpc as pb_grpc

from fixtures.deberta import make_deberta_checkpoint

REPO = Path(__file__).resolve().parents[2]
LABELS = ("negative", "positive")
TEXTS = ["A gripping, beautifully shot film.", "Dull and far too long."]


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True,
                          timeout=60).stdout


def _source_files() -> list[str]:
    """What a fresh clone has (tracked) plus new files not yet committed (untracked, not ignored)."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: cannot tell the tracked sources from generated files")
    files = set(_git("ls-files").splitlines()) | set(_git("ls-files", "--others", "--exclude-standard").splitlines())
    return sorted(f for f in files if (REPO / f).is_file())


def test_no_generated_stubs_are_committed():
    stubs = [f for f in _git("ls-files", "service/_proto").splitlines() if "_pb2" in f]
    assert stubs == [], f"generated stubs are committed: {stubs}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for rel in _source_files():
        if "_pb2" in rel:  # never ship stubs generated in this checkout; the build makes its own
            continue
        dest = src / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, dest)
    assert not list((src / "service" / "_proto").glob("*_pb2*.py"))
    dist = tmp_path_factory.mktemp("dist")
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          "--no-index", "-w", str(dist), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (whl,) = dist.glob("relserve-*.whl")
    return whl


def test_wheel_carries_stubs_protos_and_defaults(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for directory, proto in PROTOS:
        stem = proto.removesuffix(".proto")
        assert f"relserve/proto/{directory}/{proto}" in names
        assert f"relserve/service/_proto/{stem}_pb2.py" in names
        assert f"relserve/service/_proto/{stem}_pb2_grpc.py" in names
    for model in ("sentiment", "qa", "translate-de-en", "translate-de-en-deberta"):
        assert f"relserve/defaults/{model}/config.json" in names
        assert f"relserve/defaults/{model}/model.safetensors" in names
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    assert "Requires-Python: >=3.11" in text
    requires = [ln for ln in text.splitlines() if ln.startswith("Requires-Dist:")]
    core = [r for r in requires if "extra ==" not in r]
    # ONNX Runtime and the stub generator are not part of the core install
    assert not [r for r in core if r.split()[1].startswith(("onnx", "grpcio-tools"))], core
    assert any("onnxruntime==" in r and "extra == \"onnx\"" in r for r in requires), requires
    assert any("onnxruntime-gpu==" in r and "extra == \"onnx-gpu\"" in r for r in requires), requires


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True, timeout=60).stdout.strip())
    # the dependencies, from the venv running the tests: a plain path line (its .pth files stay unprocessed)
    (site / "_relserve_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    out = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                          "--no-index", str(wheel)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return root


def test_installed_wheel_imports_from_itself(venv):
    code = ("import json, relserve.service, relserve.service._proto as p, relserve.service.config as c; "
            "print(json.dumps([relserve.service.__file__, p.__file__, str(c.DEFAULTS_DIR), "
            "sorted(x.name for x in c.DEFAULTS_DIR.iterdir())]))")
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=venv)
    assert out.returncode == 0, out.stderr[-3000:]
    service_file, proto_file, defaults, models = json.loads(out.stdout)
    for path in (service_file, proto_file, defaults):
        assert Path(path).resolve().is_relative_to(venv.resolve()), path
    assert {"sentiment", "qa", "translate-de-en", "translate-de-en-deberta"} <= set(models)


class WheelServer(ServerProcess):
    """``<venv>/bin/relserve serve`` (the wheel's console script) instead of ``python -m`` of the checkout."""

    def __init__(self, venv: Path, args: list[str]) -> None:
        super().__init__(args, start_timeout=120.0)
        self.venv = venv

    def command(self) -> list[str]:
        return [str(self.venv / "bin" / "relserve"), "serve", "--host", self.host, "--port", "0",
                "--metrics-port", "0", *self.args, "--log-level", "INFO"]


def test_wheel_console_script_serves_a_checkpoint(venv, tmp_path, unigram_tokenizer_dir):
    import torch
    import transformers

    ckpt = make_deberta_checkpoint(tmp_path / "tiny", task="classification", oracle=True,
                                   tokenizer_dir=unigram_tokenizer_dir, labels=LABELS, init="matrices", seed=3)
    srv = WheelServer(venv, ["--model", f"tiny={ckpt.path},backend=torch"])
    srv.env["PYTHONPATH"] = ""  # nothing of the checkout on the server's path
    srv.start()
    try:
        with grpc.insecure_channel(srv.target) as channel:
            reply = pb_grpc.InferenceStub(channel).Classify(pb.ClassifyRequest(model="tiny", texts=TEXTS), timeout=60)
    finally:
        code = srv.stop()
        log = srv.log_text()
        srv.close()
    assert code == 0 and "Traceback" not in log, log[-3000:]
    tok = transformers.AutoTokenizer.from_pretrained(str(ckpt.path))
    for text, result in zip(TEXTS, reply.results):
        with torch.no_grad():
            want = torch.softmax(ckpt.model(**tok(text, return_tensors="pt")).logits[0], -1).numpy()
        got = {s.label: s.score for s in result.labels}
        assert set(got) == set(LABELS)
        np.testing.assert_allclose([got[name] for name in LABELS], want, atol=1e-4)
