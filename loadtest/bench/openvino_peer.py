"""OpenVINO as a benchmark peer: the strongest CPU engine a user would pick instead of relserve, run on the same
checkpoint in a child process of its own, never a server dependency.

Where OpenVINO comes from (:func:`openvino_path`): the running interpreter when it imports ``openvino`` (the
``[bench]`` extra: ``pip install -e .[bench]``); else ``build/openvino-<version>/``, a directory that
``pip install --target --no-deps openvino==<version>`` fills once (binary wheel only; an exclusive ``flock`` on
``build/openvino-<version>.lock`` keeps two benchmark or test processes from filling it at once; a
``complete`` file marks it done) and that the child gets on its ``PYTHONPATH``. OpenVINO's own dependencies are
numpy, which this interpreter has, and its telemetry package, which it does not need. The child is this
interpreter (torch and transformers convert the model) with OpenVINO's directory in front of its path, a
process apart so that OpenVINO's threading runtime and torch's OpenMP never share one.

The child (:class:`Peer`; ``python -m relserve.loadtest.bench.openvino_peer --serve``) answers JSON lines on
stdin: ``load`` converts transformers' ``DebertaV2ForSequenceClassification`` of the checkpoint directory with
``ov.convert_model`` (example input: 2 x 16 tokens; the graph keeps dynamic batch and length) and compiles it
for CPU once per precision hint (``f32``, ``bf16``; ``INFERENCE_NUM_THREADS`` = threads, ``PERFORMANCE_HINT``
LATENCY: one request at a time, as an offline loop runs); ``sentences`` / ``shape`` define a workload (sorted
batches of texts, tokenized in the child by the same tokenizer as relserve's path so that tokenization is in
both timings; or random ids); ``time`` runs one pass of a workload under a hint and returns its seconds and the
logits of the pass.
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
OPENVINO_VERSION = "2026.4.0"
HINTS = ("f32", "bf16")


class PeerUnavailable(RuntimeError):
    """OpenVINO could not be installed or started here (the message says why)."""


def openvino_path(build: Path = REPO / "build", version: str = OPENVINO_VERSION,
                  python: str = sys.executable) -> Path | None:
    """The directory to put on the child's ``PYTHONPATH`` (None: ``python`` imports openvino itself); installs
    it on first use (module docstring).

    Raises:
        PeerUnavailable: pip could not install the wheel (no package index, no wheel for this Python).
    """
    if importlib.util.find_spec("openvino") is not None:
        return None
    target = build / f"openvino-{version}"
    build.mkdir(parents=True, exist_ok=True)
    with open(build / f"openvino-{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "complete").is_file():
            return target
        t0 = time.monotonic()
        proc = subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                               "--no-deps", "--only-binary=:all:", "--upgrade", "--target", str(target),
                               f"openvino=={version}"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise PeerUnavailable(f"pip could not install openvino=={version} into {target}: "
                                  f"{(proc.stderr or proc.stdout).strip()[-600:]}")
        (target / "complete").write_text(f"openvino=={version}\n")
        print(f"installed openvino=={version} into {target} in {time.monotonic() - t0:.1f} s", file=sys.stderr)
        return target


class Peer:
    """The OpenVINO child process (module docstring): ``load``, then workloads, then ``time`` calls."""

    def __init__(self, threads: int, python: str = sys.executable) -> None:
        path = openvino_path(python=python)
        env = dict(os.environ)
        if path is not None:
            env["PYTHONPATH"] = os.pathsep.join([str(path), *filter(None, [env.get("PYTHONPATH")])])
        env["OMP_NUM_THREADS"] = str(threads)
        self.threads = threads
        self.proc = subprocess.Popen([python, "-m", "relserve.loadtest.bench.openvino_peer", "--serve"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.version = self._ask({"op": "version"})["version"]

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            raise PeerUnavailable(f"the OpenVINO child exited ({self.proc.poll()}) during {request['op']}")
        reply = json.loads(line)
        if "error" in reply:
            raise PeerUnavailable(f"OpenVINO child, {request['op']}: {reply['error']}")
        return reply

    def load(self, checkpoint: Path) -> float:
        """Convert and compile ``checkpoint`` (f32 and bf16 hints); returns the conversion seconds."""
        return float(self._ask({"op": "load", "checkpoint": str(checkpoint), "threads": self.threads})["convert_s"])

    def sentences(self, name: str, groups: list[list[str]], tokenizer_dir: Path) -> None:
        self._ask({"op": "sentences", "name": name, "groups": groups, "tokenizer": str(tokenizer_dir)})

    def shape(self, name: str, batch: int, seq: int, vocab: int, seed: int) -> None:
        self._ask({"op": "shape", "name": name, "batch": batch, "seq": seq, "vocab": vocab, "seed": seed})

    def time(self, name: str, hint: str) -> tuple[float, Any]:
        """One pass of workload ``name`` under ``hint``: (seconds, logits float32 ``[items, labels]``)."""
        import numpy as np

        r = self._ask({"op": "time", "name": name, "hint": hint})
        logits = np.frombuffer(base64.b64decode(r["logits"]), dtype=np.float32).reshape(r["shape"])
        return float(r["seconds"]), logits

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def random_ids(batch: int, seq: int, vocab: int, seed: int):
    """``batch`` x ``seq`` random token ids (no padding) and their mask, the same in both processes."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (batch, seq), generator=g)
    return ids, torch.ones_like(ids)


def _serve() -> None:  # the child: runs with OpenVINO importable
    import numpy as np
    import openvino as ov
    import torch

    from relserve.models.tokenization import load_tokenizer

    from .unpadded import _batches

    compiled: dict[str, Any] = {}
    workloads: dict[str, Any] = {}

    def handle(req: dict[str, Any]) -> dict[str, Any]:
        op = req["op"]
        if op == "version":
            return {"version": ov.__version__}
        if op == "load":
            from transformers import DebertaV2ForSequenceClassification

            torch.set_num_threads(int(req["threads"]))
            model = DebertaV2ForSequenceClassification.from_pretrained(req["checkpoint"]).eval()
            ids, mask = random_ids(2, 16, int(model.config.vocab_size), 0)
            t0 = time.perf_counter()
            graph = ov.convert_model(model, example_input={"input_ids": ids, "attention_mask": mask})
            convert_s = time.perf_counter() - t0
            core = ov.Core()
            for hint in HINTS:
                compiled[hint] = core.compile_model(graph, "CPU", {
                    "INFERENCE_NUM_THREADS": int(req["threads"]), "INFERENCE_PRECISION_HINT": hint,
                    "PERFORMANCE_HINT": "LATENCY"}).create_infer_request()
            return {"convert_s": convert_s}
        if op == "sentences":
            tok = load_tokenizer(req["tokenizer"], log_choice=False)
            workloads[req["name"]] = ("texts", tok, req["groups"])
            return {}
        if op == "shape":
            ids, mask = random_ids(req["batch"], req["seq"], req["vocab"], req["seed"])
            workloads[req["name"]] = ("ids", ids.numpy(), mask.numpy())
            return {}
        if op == "time":
            infer, work = compiled[req["hint"]], workloads[req["name"]]
            t0 = time.perf_counter()
            if work[0] == "ids":
                outs = [infer.infer({"input_ids": work[1], "attention_mask": work[2]})[0].copy()]
            else:
                outs = []
                for g in work[2]:  # tokenization inside the timing, as on relserve's path
                    ids, mask = _batches(work[1], g, len(g), 512)[0]
                    outs.append(infer.infer({"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0].copy())
            seconds = time.perf_counter() - t0
            logits = np.ascontiguousarray(np.concatenate(outs), dtype=np.float32)
            return {"seconds": seconds, "shape": list(logits.shape),
                    "logits": base64.b64encode(logits.tobytes()).decode()}
        raise ValueError(f"unknown op {op!r}")

    out = sys.stdout
    sys.stdout = sys.stderr  # conversion warnings and prints must not reach the reply stream
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = handle(json.loads(line))
        except Exception as exc:  # reported to the parent, which names it
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m relserve.loadtest.bench.openvino_peer", description=__doc__)
    ap.add_argument("--serve", action="store_true", help="run as the child (JSON lines on stdin)")
    ap.add_argument("--install", action="store_true", help="install OpenVINO into build/ if needed, print where")
    args = ap.parse_args(argv)
    if args.serve:
        _serve()
    elif args.install:
        print(openvino_path() or "openvino imports in this interpreter")
    else:
        ap.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
