"""Model versions swapped under load in a polled model repository: failed calls, p99 around the swaps against
the steady state, which version answered, and a broken version that must change nothing.

    python -m relserve.loadtest.bench.model_swap                                   # about 2 minutes
    python -m relserve.loadtest.bench.model_swap --model-option worker_process=false  # models in the server process
    python -m relserve.loadtest.bench.model_swap --clients 4 --duration 6 --swap-every 2 --broken-for 1 \\
        --hidden 32 --layers 1 --json out.json --calls-csv calls.csv              # about 20 s

The script builds a temporary model repository ``REPO/swap/`` of small random DeBERTa-v2 classifiers (the
shape of :mod:`.randmodel`: hidden 128, 3 layers, 4 heads unless told otherwise) that share every weight but
their classifier head: in version ``v`` the head's weight is zero and its bias ``[0, b_v]``, so every text gets
the same score ``P(positive) = sigmoid(b_v)``, which names the version that answered (the encoder still runs in
full, so a call costs what it costs in a real model). All versions are written beforehand into a staging
directory beside the repository (same file system, outside it); publishing version ``v`` is one
``os.rename`` of its directory into ``REPO/swap/v``, the way a publisher must do it in poll mode: the server
never sees a half-copied version.

``relserve serve --model-repository REPO --model-control-mode poll --repository-poll-secs 0.5`` starts as a
child process on free loopback ports (gRPC and HTTP). ``--clients`` closed-loop clients (one asyncio loop,
one channel each) call ``relserve.v1.Inference/Classify`` with one text from the sentiment load-test set.

a) For ``--duration`` seconds a new version is published every ``--swap-every`` seconds. A swap's window runs
   from its rename to ``--settle`` seconds after the first reply of the new version (loading and warming
   beside the old one, the switch, the old one's drain and unload); every call overlapping a window is "in a
   swap", the others (after ``--warmup`` seconds) are the steady state. Printed: calls and failed calls by
   status code (target 0), the p50/p99 of both sets and their ratio (target p99 in swaps <= 1.5x steady), the
   p99 of the calls while a version loads and of those at its switch, per swap the seconds from the rename to
   the first reply of the new version and the older versions' replies after it (calls already queued there
   drain; a call sent after the window must not be among them), and replies that match no version.
b) Once the last version answers (and ``--settle`` seconds more), a broken version (``--broken truncated``: its
   model.safetensors cut in half; ``shapes``: a classifier head of the wrong width) is renamed in, under the
   same load, for ``--broken-for`` seconds and at least until the index has its verdict: failed calls
   (target 0), replies that were not the serving version's (target 0), and the index row of the broken
   version (``POST /v2/repository/index``: state and reason; the target is a row that is not READY and says
   why).
c) One ``PASS`` / ``MISS`` line per target.

``--model-option KEY=VALUE`` adds model keys to the model's relserve.yaml (backend torch, device cpu, dtype
float32: no agreement gate at each load); ``--calls-csv`` writes every call for a closer look at a swap.

One run on a shared machine: read the latencies as orders of magnitude; the counts are exact.
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import os
import re
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from ...service._proto import inference_pb2 as pb
from ...service._proto import inference_pb2_grpc as pb_grpc
from ..scenarios import sentences
from ..serverproc import ServerProcess
from . import harness

MODEL = "swap"
_HTTP = re.compile(r"HTTP/JSON API \(https?\) on \S+:(\d+)")
MATCH_TOL = 1e-4  # a float32 softmax of two logits is exact to ~1e-7; versions lie >= 2e-3 apart up to 60 versions


def version_logit(version: int, count: int) -> float:
    """The positive label's logit in version ``version`` of ``count`` (the negative one's is 0): spread evenly
    over [-4, 4], so the scores lie in (0.018, 0.982) and no two versions' scores are close."""
    return -4.0 + 8.0 * (version - 1) / max(1, count - 1)


def version_score(version: int, count: int) -> float:
    """The P(positive) that version ``version`` (of ``count``) of the generated model answers for every text."""
    return 1.0 / (1.0 + math.exp(-version_logit(version, count)))


def version_of(score: float, count: int) -> int | None:
    """The version among 1..count whose score is ``score`` (None: none is, a reply no version gives)."""
    best = min(range(1, count + 1), key=lambda v: abs(version_score(v, count) - score))
    return best if abs(version_score(best, count) - score) <= MATCH_TOL else None


def build_versions(staging: Path, count: int, broken: str, *, hidden: int, layers: int, heads: int,
                   intermediate: int) -> tuple[dict[int, Path], Path]:
    """Write versions 1..count of the model into ``staging`` (one directory each) and a broken one.

    Returns ({version: directory}, broken directory). The versions share one random encoder (seed 0); version
    ``v``'s classifier head has weight 0 and bias ``[0, version_logit(v, count + 1)]`` (the broken one is version
    ``count + 1``). ``broken``: "truncated" (the weights file cut in half: unreadable) or "shapes" (a classifier
    weight one column too wide: Float[2, hidden + 1])."""
    from safetensors.torch import load_file, save_file

    from .randmodel import make_checkpoint, make_tokenizer

    tokenizer = make_tokenizer(staging / "tokenizer")
    base = make_checkpoint(staging / "base", tokenizer_dir=tokenizer, hidden=hidden, layers=layers, heads=heads,
                           intermediate=intermediate, seed=0)
    tensors = load_file(str(base / "model.safetensors"))
    out: dict[int, Path] = {}
    for v in range(1, count + 2):
        d = staging / f"v{v}"
        shutil.copytree(base, d)
        head = dict(tensors)
        head["classifier.weight"] = tensors["classifier.weight"].clone().zero_()
        head["classifier.bias"] = tensors["classifier.bias"].clone().zero_()
        head["classifier.bias"][1] = version_logit(v, count + 1)
        if v == count + 1 and broken == "shapes":
            w = head["classifier.weight"]
            head["classifier.weight"] = w.new_zeros((w.shape[0], w.shape[1] + 1))
        save_file(head, str(d / "model.safetensors"), metadata={"format": "pt"})
        if v == count + 1 and broken == "truncated":
            raw = (d / "model.safetensors").read_bytes()
            (d / "model.safetensors").write_bytes(raw[: len(raw) // 2])
        out[v] = d
    return {v: p for v, p in out.items() if v <= count}, out[count + 1]


@dataclass
class Call:
    start: float
    end: float
    code: str          # "OK" or the gRPC status code name
    version: int | None = None
    score: float | None = None


@dataclass
class Load:
    """The closed-loop clients' record: every call, in completion order."""
    calls: list[Call] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)


async def _client(target: str, texts: list[str], offset: int, load: Load, count: int) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.InferenceStub(channel)
        i = offset
        while not load.stop.is_set():
            req = pb.ClassifyRequest(model=MODEL, texts=[texts[i % len(texts)]])
            i += 1
            t0 = time.monotonic()
            try:
                reply = await stub.Classify(req, timeout=30)
                score = next(ls.score for ls in reply.results[0].labels if ls.label == "positive")
                load.calls.append(Call(t0, time.monotonic(), "OK", version_of(score, count), score))
            except grpc.aio.AioRpcError as exc:
                load.calls.append(Call(t0, time.monotonic(), exc.code().name))


def repository_index(http_port: int) -> list[dict[str, Any]] | str:
    """POST /v2/repository/index on the server's HTTP port: its rows, or the error as text."""
    req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v2/repository/index", data=b"{}",
                                 headers={"content-type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        detail = exc.read().decode(errors="replace")[:200] if isinstance(exc, urllib.error.HTTPError) else ""
        return f"{exc} {detail}".strip()


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile ``q`` (0-100) of ``values``; None when empty."""
    if not values:
        return None
    s = sorted(values)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f} ms"


def _overlaps(c: Call, windows: list[tuple[float, float]]) -> bool:
    return any(c.start < hi and c.end > lo for lo, hi in windows)


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser("model_swap", __doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=32, help="closed-loop clients (default 32)")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load with swaps (default 60)")
    ap.add_argument("--swap-every", type=float, default=10.0, help="seconds between two published versions "
                    "(default 10); the first is published this long after the load starts")
    ap.add_argument("--broken-for", type=float, default=15.0,
                    help="seconds of load after the broken version is dropped in, at least (default 15; longer until "
                    "the index has its verdict)")
    ap.add_argument("--broken", choices=("truncated", "shapes"), default="truncated",
                    help="what is wrong with the broken version (default: truncated weights)")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of load before anything counts (default 3)")
    ap.add_argument("--settle", type=float, default=1.0,
                    help="seconds after a swap's first new reply that still count as the swap (default 1)")
    ap.add_argument("--poll-secs", type=float, default=0.5, help="the server's --repository-poll-secs (default 0.5)")
    ap.add_argument("--give-up", type=float, default=120.0,
                    help="seconds to wait for the last swap before the broken version goes in, and for the "
                    "index's verdict on it (default 120)")
    ap.add_argument("--hidden", type=int, default=128, help="hidden size of the generated model (default 128)")
    ap.add_argument("--layers", type=int, default=3, help="encoder layers (default 3)")
    ap.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    ap.add_argument("--intermediate", type=int, default=None, help="FFN width (default 4 x hidden)")
    ap.add_argument("--model-option", action="append", default=[], metavar="KEY=VALUE",
                    help="another model key for the repository's relserve.yaml (repeatable; e.g. warmup=false)")
    ap.add_argument("--calls-csv", metavar="FILE", help="also write every call (start and end in seconds from the "
                    "load's start, status code, version) to FILE")
    ap.add_argument("--keep", metavar="DIR", help="build the repository here and keep it (default: a temporary "
                    "directory, removed at the end)")
    harness.add_common_args(ap, threads=1, threads_help="OMP_NUM_THREADS of the server (default 1)", json="file")
    args = ap.parse_args(argv)
    n_swaps = max(1, math.ceil(args.duration / args.swap_every) - 1)
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="relserve-model-swap-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        return _run(args, root, n_swaps)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def _run(args, root: Path, n_swaps: int) -> int:
    repo, staging = root / "repository", root / "staging"
    model_dir = repo / MODEL
    model_dir.mkdir(parents=True)
    staging.mkdir()
    t_build = time.monotonic()
    versions, broken_dir = build_versions(staging, n_swaps + 1, args.broken, hidden=args.hidden,
                                          layers=args.layers, heads=args.heads,
                                          intermediate=args.intermediate or 4 * args.hidden)
    broken_version = n_swaps + 2
    # float32: no agreement gate at each load (the swap must not wait for a dtype decision)
    options = {"backend": "torch", "device": "cpu", "dtype": "float32"}
    options.update(o.split("=", 1) for o in args.model_option)
    (model_dir / "relserve.yaml").write_text("".join(f"{k}: {v}\n" for k, v in options.items()))
    os.rename(versions[1], model_dir / "1")
    print(f"{harness.cpu_name()}, {os.cpu_count()} cores; model hidden {args.hidden}, {args.layers} layers; "
          f"{n_swaps + 1} versions + 1 broken built in {time.monotonic() - t_build:.1f} s", flush=True)
    server_args = ["--model-repository", str(repo), "--model-control-mode", "poll",
                   "--repository-poll-secs", str(args.poll_secs), "--http-port", "0", "--drain-timeout", "5"]
    with ServerProcess(server_args, env={"OMP_NUM_THREADS": str(args.threads)}, start_timeout=300) as srv:
        m = _HTTP.search(srv.log_text())
        http_port = int(m.group(1)) if m else None
        summary = asyncio.run(_drive(args, srv.target, http_port, model_dir, versions, broken_dir, broken_version,
                                     n_swaps))
        log = srv.log_text()
    summary["server_log_repository_lines"] = [ln[:300] for ln in log.splitlines()
                                              if "relserve.service.repository" in ln]
    _print(args, summary)
    harness.emit_json(args, [summary], summary)
    return 0


async def _drive(args, target: str, http_port: int | None, model_dir: Path, versions: dict[int, Path],
                 broken_dir: Path, broken_version: int, n_swaps: int) -> dict[str, Any]:
    texts = sentences()
    load = Load()
    tasks = [asyncio.create_task(_client(target, texts, i * 7, load, broken_version)) for i in range(args.clients)]
    # the clock starts at the first answer: the server is up and the model warm
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(c.code == "OK" for c in load.calls):
        await asyncio.sleep(0.02)
    t0 = time.monotonic()
    await asyncio.sleep(args.warmup)
    t_a = time.monotonic()
    published: dict[int, float] = {1: t0}
    for k in range(1, n_swaps + 1):
        await asyncio.sleep(max(0.0, t_a + k * args.swap_every - time.monotonic()))
        v = k + 1
        published[v] = time.monotonic()
        os.rename(versions[v], model_dir / str(v))
    await asyncio.sleep(max(0.0, t_a + args.duration - time.monotonic()))
    # the broken version goes in once the last swap is done, so that a late switch is not taken for its effect
    last = max(published)
    deadline = time.monotonic() + args.give_up
    while time.monotonic() < deadline and not any(c.version == last for c in reversed(load.calls[-200:])):
        await asyncio.sleep(0.05)
    await asyncio.sleep(args.settle)  # calls queued on the old version finish
    t_b = time.monotonic()
    serving_before = next((c.version for c in reversed(load.calls) if c.code == "OK"), None)
    os.rename(broken_dir, model_dir / str(broken_version))
    index_row: dict[str, Any] | None = None
    index_error = None
    seconds_to_index = None
    # at least --broken-for seconds, and until the index has the broken version's verdict (or --give-up)
    while (time.monotonic() < t_b + args.broken_for
           or (index_row is None and time.monotonic() < t_b + args.give_up)):
        rows = await asyncio.to_thread(repository_index, http_port) if http_port else "no HTTP port in the log"
        if isinstance(rows, str):
            index_error = rows
        else:
            index_error = None
            row = next((r for r in rows if r.get("name") == MODEL and str(r.get("version", "")) == str(broken_version)),
                       None)
            if row is not None and row.get("state") not in ("LOADING", None) and index_row is None:
                index_row, seconds_to_index = row, time.monotonic() - t_b
        await asyncio.sleep(0.25)
    t_end = time.monotonic()
    final_index = await asyncio.to_thread(repository_index, http_port) if http_port else None
    load.stop.set()
    await asyncio.gather(*tasks)
    if args.calls_csv:
        with open(args.calls_csv, "w", encoding="utf-8") as f:
            f.write("start_s,end_s,code,version\n")
            f.writelines(f"{c.start - t_a:.4f},{c.end - t_a:.4f},{c.code},{c.version or ''}\n" for c in load.calls)
            f.writelines(f"{t - t_a:.4f},{t - t_a:.4f},PUBLISHED,{v}\n" for v, t in published.items())
            f.write(f"{t_b - t_a:.4f},{t_b - t_a:.4f},PUBLISHED,{broken_version}\n")
    return _summarise(args, load.calls, t_a, t_b, t_end, published, serving_before, broken_version, index_row,
                      seconds_to_index, index_error, final_index)


def _summarise(args, calls: list[Call], t_a: float, t_b: float, t_end: float, published: dict[int, float],
               serving_before: int, broken_version: int, index_row, seconds_to_index, index_error,
               final_index) -> dict[str, Any]:
    phase_a = [c for c in calls if t_a <= c.start < t_b]
    phase_b = [c for c in calls if t_b <= c.start < t_end]
    swaps = []
    windows, loading, switching = [], [], []
    for v, t_pub in sorted(published.items()):
        if v == 1:
            continue
        first = min((c.end for c in phase_a if c.version == v), default=None)
        hi = (first + args.settle) if first is not None else t_b
        windows.append((t_pub, hi))
        loading.append((t_pub, first if first is not None else t_b))
        if first is not None:
            switching.append((first, hi))
        older = [c for c in phase_a if c.version is not None and c.version < v and first is not None
                 and c.end > first]
        swaps.append({"version": v, "seconds_to_first_reply": None if first is None else round(first - t_pub, 3),
                      "window_s": round(hi - t_pub, 3), "older_version_replies_after_switch": len(older),
                      "older_version_calls_started_after_settle": sum(1 for c in older if c.start > hi)})
    ok_a = [c for c in phase_a if c.code == "OK"]
    in_swap = [c.end - c.start for c in ok_a if _overlaps(c, windows)]
    steady = [c.end - c.start for c in ok_a if not _overlaps(c, windows)]
    in_loading = [c.end - c.start for c in ok_a if _overlaps(c, loading)]
    in_switching = [c.end - c.start for c in ok_a if _overlaps(c, switching)]
    p99_swap, p99_steady = percentile(in_swap, 99), percentile(steady, 99)
    first_replies: dict[int, float] = {}
    for c in ok_a:
        if c.version is not None:
            first_replies[c.version] = min(first_replies.get(c.version, c.end), c.end)
    by_first_reply = sorted(first_replies, key=first_replies.get)
    failed_a = collections.Counter(c.code for c in phase_a if c.code != "OK")
    failed_b = collections.Counter(c.code for c in phase_b if c.code != "OK")
    answered_b = collections.Counter(c.version for c in phase_b if c.code == "OK")
    seen_versions = sorted({c.version for c in ok_a if c.version is not None})
    return {
        "cpu": harness.cpu_name(), "cores": os.cpu_count(), "clients": args.clients,
        "load_average": os.getloadavg(), "duration_s": round(t_b - t_a, 2), "swap_every_s": args.swap_every,
        "poll_secs": args.poll_secs,
        "model": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads},
        "swap": {
            "calls": len(phase_a), "failed": sum(failed_a.values()), "failed_by_code": dict(failed_a),
            "unmatched_replies": sum(1 for c in ok_a if c.version is None),
            "calls_in_swaps": len(in_swap), "calls_steady": len(steady),
            "p50_steady_s": percentile(steady, 50), "p99_steady_s": p99_steady,
            "p50_in_swaps_s": percentile(in_swap, 50), "p99_in_swaps_s": p99_swap,
            "p99_ratio": harness.ratio(p99_swap, p99_steady),
            "calls_while_loading": len(in_loading), "p99_while_loading_s": percentile(in_loading, 99),
            "calls_at_switch": len(in_switching), "p99_at_switch_s": percentile(in_switching, 99),
            "versions_published": sorted(published), "versions_answering": seen_versions,
            "versions_by_first_reply": by_first_reply, "swaps": swaps,
        },
        "broken": {
            "kind": args.broken, "version": broken_version, "serving_version": serving_before,
            "duration_s": round(t_end - t_b, 2),
            "calls": len(phase_b), "failed": sum(failed_b.values()), "failed_by_code": dict(failed_b),
            "answers_by_version": {str(k): n for k, n in answered_b.items()},
            "answers_not_from_serving_version": sum(n for k, n in answered_b.items() if k != serving_before),
            "index_row": index_row, "seconds_to_index_row": None if seconds_to_index is None
            else round(seconds_to_index, 2), "index_error": index_error,
            "final_index": final_index if isinstance(final_index, list) else None,
        },
    }


def _print(args, s: dict[str, Any]) -> None:
    a, b = s["swap"], s["broken"]
    print(f"a) {s['clients']} closed-loop clients for {s['duration_s']} s, a new version every "
          f"{s['swap_every_s']} s (poll every {s['poll_secs']} s)")
    print(f"   calls: {a['calls']}, failed: {a['failed']} {a['failed_by_code'] or ''}")
    print(f"   p99 steady: {_ms(a['p99_steady_s'])} ({a['calls_steady']} calls, p50 {_ms(a['p50_steady_s'])}); "
          f"p99 in swaps: {_ms(a['p99_in_swaps_s'])} ({a['calls_in_swaps']} calls, p50 {_ms(a['p50_in_swaps_s'])}); "
          f"ratio: {harness.fmt_ratio(a['p99_ratio'])}")
    print(f"   of which: p99 {_ms(a['p99_while_loading_s'])} while a version loads beside the serving one "
          f"({a['calls_while_loading']} calls), p99 {_ms(a['p99_at_switch_s'])} from its first reply to "
          f"{args.settle} s after ({a['calls_at_switch']} calls)")
    print(f"   versions published: {a['versions_published']}; answering: {a['versions_answering']}; "
          f"by first reply: {a['versions_by_first_reply']}; replies of no version: {a['unmatched_replies']}")
    for sw in a["swaps"]:
        first = sw["seconds_to_first_reply"]
        print(f"   swap to version {sw['version']}: first reply "
              f"{'never' if first is None else f'{first:.2f} s'} after the rename; window {sw['window_s']:.2f} s; "
              f"older versions' replies after it: {sw['older_version_replies_after_switch']} (calls sent after "
              f"the window: {sw['older_version_calls_started_after_settle']})")
    print(f"b) broken version {b['version']} ({b['kind']}) dropped in under the same load for "
          f"{b['duration_s']} s; serving version {b['serving_version']}")
    print(f"   calls: {b['calls']}, failed: {b['failed']} {b['failed_by_code'] or ''}")
    print(f"   answers by version: {b['answers_by_version']}; not from the serving version: "
          f"{b['answers_not_from_serving_version']}")
    row = b["index_row"]
    if row is not None:
        print(f"   index: version {row.get('version')} state {row.get('state')} after {b['seconds_to_index_row']} s; "
              f"reason: {row.get('reason', '')}")
    else:
        print(f"   index: no row for version {b['version']} that is not LOADING"
              f"{'; last error: ' + b['index_error'] if b['index_error'] else ''}")
    if b["final_index"] is not None:
        rows = [(r.get("version"), r.get("state")) for r in b["final_index"] if r.get("name") == MODEL]
        print(f"   index at the end: {rows}")
    new_versions = a["versions_published"][1:]
    targets = [
        ("failed calls during swaps = 0", a["calls"] > 0 and a["failed"] == 0),
        ("p99 in swaps <= 1.5x steady p99", a["p99_ratio"] is not None and a["p99_ratio"] <= 1.5),
        ("replies changed to every new version", all(v in a["versions_answering"] for v in new_versions)
         and a["unmatched_replies"] == 0
         and not any(sw["older_version_calls_started_after_settle"] for sw in a["swaps"])),
        ("broken version: failed calls = 0", b["calls"] > 0 and b["failed"] == 0),
        ("broken version: answers unchanged", b["calls"] > 0 and b["answers_not_from_serving_version"] == 0),
        ("broken version: index names the reason", row is not None and row.get("state") != "READY"
         and bool(row.get("reason"))),
    ]
    lines = s.get("server_log_repository_lines", [])
    print(f"   server log, repository lines: {len(lines)}")
    for line in lines[-(2 * len(a["swaps"]) + 3):]:
        print("     " + line)
    print("c) targets")
    for name, ok in targets:
        print(f"   {'PASS' if ok else 'MISS'}  {name}")
    s["targets"] = {name: ok for name, ok in targets}


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
