"""A hung worker process against the default server: how long its model stays unready, and what it costs the
other models (issue targets: not ready within 15 s, answering again within 45 s without SIGCONT, no failed
call of another model).

    python -m relserve.loadtest.bench.worker_faults
    python -m relserve.loadtest.bench.worker_faults --model qa --signal SIGKILL --json out.json

``relserve serve`` starts with the default models (``defaults/``) as a child process on free loopback ports. One
client thread per model calls it back to back (Classify / Answer / Translate, small real requests) and a probe
asks ``grpc.health.v1 Check`` for ``--model``'s own service every 50 ms. Once every model has answered, the
``--model``'s worker process (its pid from the server's log) gets ``--signal`` (SIGSTOP: a hung worker; nobody
sends SIGCONT). Printed: seconds from the signal until the probe saw NOT_SERVING, until the model answered a
call again (a call sent after NOT_SERVING), until its health was SERVING again; the calls of ``--model`` that
failed, by status code; and the failed calls of every other model (the target is zero). The run then goes on
for ``--after`` seconds. One run on a shared machine: read the seconds as orders of magnitude.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import threading
import time
from typing import Any, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ...service._proto import inference_pb2 as pb
from ...service._proto import inference_pb2_grpc as pb_grpc
from ..serverproc import ServerProcess
from . import harness

_WORKER = re.compile(r"model '([^']+)': worker process (\d+) started")
_SERVING = health_pb2.HealthCheckResponse.SERVING
CONTEXT = ("The Amazon rainforest covers much of the Amazon basin of South America. The basin covers seven million "
           "square kilometres, of which five and a half million are covered by the rainforest.")


def _call_for(stub: pb_grpc.InferenceStub, name: str, task: str) -> Callable[[], Any] | None:
    """One small real request of model ``name`` (its ListModels task); None for a task not exercised."""
    if task == "classification":
        return lambda: stub.Classify(pb.ClassifyRequest(model=name, texts=["a fine, moving film"]), timeout=30)
    if task == "question-answering":
        return lambda: stub.Answer(pb.AnswerRequest(model=name, question="What covers the basin?",
                                                    context=CONTEXT), timeout=30)
    if task == "translation":
        return lambda: stub.Translate(pb.TranslateRequest(model=name, texts=["Guten Morgen."]), timeout=30)
    return None


class Client(threading.Thread):
    """Calls one model back to back until stopped; keeps (end time, status code name) of every call."""

    def __init__(self, name: str, call: Callable[[], Any]) -> None:
        super().__init__(daemon=True, name=f"client-{name}")
        self.model, self.call = name, call
        self.results: list[tuple[float, str]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.call()
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            self.results.append((time.monotonic(), code))

    def failures(self, since: float = float("-inf")) -> collections.Counter:
        return collections.Counter(code for t, code in self.results if t >= since and code != "OK")


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser("worker_faults", __doc__.split("\n\n")[0])
    ap.add_argument("--model", default="sentiment", help="the model whose worker is signalled (default: sentiment)")
    ap.add_argument("--signal", default="SIGSTOP", choices=("SIGSTOP", "SIGKILL"),
                    help="SIGSTOP: a hung worker (the default); SIGKILL: a dead one")
    ap.add_argument("--after", type=float, default=10.0, help="seconds the clients go on once the model is back")
    ap.add_argument("--give-up", type=float, default=120.0, help="seconds to wait for each stage at most")
    harness.add_common_args(ap, json="file")
    args = ap.parse_args(argv)

    with ServerProcess([], start_timeout=600) as srv:
        workers = {m: int(pid) for m, pid in _WORKER.findall(srv.log_text())}
        if args.model not in workers:
            raise SystemExit(f"model {args.model!r} has no worker process (workers: {workers})")
        channel = grpc.insecure_channel(srv.target)
        stub = pb_grpc.InferenceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        clients = [Client(m.name, call) for m in stub.ListModels(pb.ListModelsRequest(), timeout=30).models
                   if (call := _call_for(stub, m.name, m.task)) is not None]
        for c in clients:
            c.start()
        target = next(c for c in clients if c.model == args.model)
        end = time.monotonic() + args.give_up
        while not all(any(code == "OK" for _, code in c.results) for c in clients) and time.monotonic() < end:
            time.sleep(0.05)
        pid = workers[args.model]
        t0 = time.monotonic()
        os.kill(pid, getattr(signal, args.signal))
        not_ready = answering = serving = None
        while time.monotonic() < t0 + args.give_up and (not_ready is None or answering is None or serving is None):
            try:
                status = health.Check(health_pb2.HealthCheckRequest(service=args.model), timeout=2).status
            except grpc.RpcError:
                status = None
            now = time.monotonic()
            if not_ready is None and status is not None and status != _SERVING:
                not_ready = now
            if not_ready is not None and serving is None and status == _SERVING:
                serving = now
            if not_ready is not None and answering is None:
                answering = next((t for t, code in target.results if code == "OK" and t > not_ready), None)
            time.sleep(0.05)
        time.sleep(args.after)
        for c in clients:
            c.stop.set()
        for c in clients:
            c.join(35)
        channel.close()
        still_there = os.path.exists(f"/proc/{pid}")
        log = srv.log_text()

    def since(t: float | None) -> float | None:
        return None if t is None else round(t - t0, 2)

    others = {c.model: dict(c.failures()) for c in clients if c.model != args.model}
    summary = {
        "cpu": harness.cpu_name(), "cores": os.cpu_count(), "model": args.model, "signal": args.signal,
        "worker_pid": pid, "seconds_to_not_ready": since(not_ready), "seconds_to_answering": since(answering),
        "seconds_to_serving": since(serving), "failed_calls_of_the_model": dict(target.failures(t0)),
        "calls_of_the_model_after_the_signal": sum(1 for t, _ in target.results if t >= t0),
        "failed_calls_of_other_models": others,
        "other_calls": {c.model: len(c.results) for c in clients if c.model != args.model},
        "old_worker_still_exists": still_there,
        "reasons": sorted(set(re.findall(r"model '[^']+': not ready: (.*)", log)))[:4],
    }
    print(f"{args.signal} to the worker process {pid} of model {args.model!r} ({summary['cpu']}, {os.cpu_count()} "
          f"cores):")
    print(f"  not ready after            {summary['seconds_to_not_ready']} s   (target <= 15 s)")
    print(f"  answering again after      {summary['seconds_to_answering']} s   (target <= 45 s, no SIGCONT)")
    print(f"  health SERVING again after {summary['seconds_to_serving']} s")
    print(f"  calls of {args.model!r} after the signal: {summary['calls_of_the_model_after_the_signal']}, failed: "
          f"{summary['failed_calls_of_the_model'] or 'none'}")
    print(f"  failed calls of the other models: {others or 'no other model'} (of {summary['other_calls']} calls; "
          f"target: none)")
    print(f"  reason logged: {summary['reasons']}")
    harness.emit_json(args, [summary], summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
