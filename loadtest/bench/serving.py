"""Serving benchmarks: what dynamic batching and length bucketing buy, and what the server costs.

    python -m relserve.loadtest.bench.serving                      # default models (random ones if absent)
    python -m relserve.loadtest.bench.serving --classify-model DIR --duration 20 --concurrency 32

Each measurement starts ``relserve serve`` as a child process on free loopback ports and drives it with the
closed-loop load generator (``--concurrency`` clients on one grpc.aio channel, saturation) for ``--duration``
seconds after ``--warmup`` requests. Torch runs ``--threads`` intra-op threads in every process (default 1:
on a small shared machine torch's default pool degrades badly when the cores are oversubscribed):

1. dynamic batching on (``max_batch_size`` 32) vs off (``max_batch_size`` 1), ``classify`` scenario;
2. the server's saturated throughput vs the backend's offline throughput (same checkpoint, same texts,
   tokenize + ``TorchBackend.run`` in batches of 32 in this process, no gRPC): the server overhead ratio;
3. padding efficiency (real / padded tokens, from the server's ``relserve_tokens_total``) on the
   ``classify-mixed`` scenario (1 to 16 sentences per text) with ``length_bucketing`` true vs false.

Prints one line per measurement and the ratios, and writes ``<out>/bench_serving.json``. One run each: on a
shared machine, treat differences of a few per cent as noise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import harness
from .translation import process_cpu_s
from ..cli import LoadSpec, run_load
from ..promscrape import scrape
from ..serverproc import ServerProcess

REPO = Path(__file__).resolve().parents[2]


def resolve_classifier(path: str | None, tmp: Path) -> tuple[Path, str]:
    if path:
        return Path(path), "given"
    default = REPO / "defaults" / "sentiment"
    if (default / "config.json").is_file():
        return default, "defaults/sentiment"
    from .randmodel import make_checkpoint

    return make_checkpoint(tmp / "random-sentiment"), "random weights, default-model shape (hidden 128, 3 layers)"


def _cores_used(before, after, client_s: float, wall_s: float) -> dict[str, float | None]:
    """Mean cores used over a run, by who used them: the clients (this process), the server's process (gRPC,
    tokenization, batching, and the model where it runs in-process) and its worker processes, from
    :func:`.retrying.server_window`'s CPU figures; on a machine the clients share, what the model could not have
    had."""
    from ..retrying import server_window

    out: dict[str, float | None] = {"clients": client_s / wall_s, "server": None, "workers": None}
    if before is not None and after is not None:
        w = server_window(before, after, "sentiment", wall_s)
        if w["cpu_cores"] is not None:
            out["workers"] = w["worker_cpu_cores"]
            out["server"] = w["cpu_cores"] - (w["worker_cpu_cores"] or 0.0)
    return out


def serve_and_load(model_dir: Path, options: str, scenario: str, args: argparse.Namespace,
                   concurrency: int | None = None, data: list[dict[str, str]] | None = None,
                   start_timeout: float = 120.0, gil: bool = False) -> dict[str, Any]:
    """Serve ``model_dir`` as ``sentiment`` with ``options`` (``key=value,...``) in a child process and run
    the closed loop on it; ``data`` (``{"text": ...}`` rows) replaces the scenario's committed texts. Returns
    the client and server-side numbers of the run window, and the dtype the server serves
    (``relserve_model_info``). ``gil``: also sample the server's GIL holder with py-spy for ``args.duration``
    seconds from the start of the load (:mod:`.gil`; ``"gil"`` in the result: seconds held by thread role and
    ``ms_per_request``, or the reason it is missing)."""
    spec_model = f"sentiment={model_dir}" + (f",{options}" if options else "")
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else None
    with ServerProcess(["--model", spec_model, "--drain-timeout", "5"], env=env,
                       start_timeout=start_timeout) as srv:
        spec = LoadSpec(target=srv.target, scenario=scenario, concurrency=concurrency or args.concurrency,
                        duration=args.duration,
                        requests=args.max_requests, metrics_url=srv.metrics_url, warmup=args.warmup,
                        progress=False, seed=args.seed, data=data)
        sampler = None
        if gil:
            from . import gil as gil_mod

            sampler = gil_mod.GilSampler(srv.pid, args.duration) if gil_mod.available() else None
        snap = (lambda: scrape(srv.metrics_url)) if srv.metrics_url else (lambda: None)
        before, usage0, t0 = snap(), process_cpu_s(), time.monotonic()
        res = asyncio.run(run_load(spec))
        cores = _cores_used(before, snap(), process_cpu_s() - usage0, time.monotonic() - t0)
        gil_report = sampler.result() if sampler is not None else (
            {"error": ["py-spy is not installed (pip install py-spy)"]} if gil else None)
        dtypes = sorted(scrape(srv.metrics_url).label_values("relserve_model_info", "dtype")) if srv.metrics_url else []
    s = res.summary
    m = (res.server or {}).get("models", {}).get("sentiment", {})
    out = {
        "server_options": options, "scenario": scenario, "concurrency": concurrency or args.concurrency, "requests": s["requests"], "successes": s["successes"],
        "errors_by_code": s["errors_by_code"], "throughput_rps": s["throughput_rps"], "latency_ms": s["latency_ms"],
        "mean_batch_size": m.get("mean_batch_size"), "mean_queue_ms": m.get("mean_queue_ms"),
        "mean_inference_ms_per_batch": m.get("mean_inference_ms_per_batch"),
        "real_tokens": m.get("real_tokens"), "padding_tokens": m.get("padding_tokens"),
        "padding_efficiency": m.get("padding_efficiency"), "padding_ratio": m.get("padding_ratio"),
        "batch_padding_efficiency": m.get("batch_padding_efficiency"),
        "mean_tokenization_ms": m.get("mean_tokenization_ms"), "mean_request_ms": m.get("mean_request_ms"),
        "dtype": dtypes[0] if len(dtypes) == 1 else ",".join(dtypes) or None,
        "cpu_cores": cores,
    }
    if gil_report is not None:
        if "held_s" in gil_report and s["throughput_rps"]:
            # the window starts with the warm-up requests: same load, so the per-request figure holds
            gil_report["ms_per_request"] = 1000 * gil_report["held_s"] / (s["throughput_rps"] * gil_report["seconds"])
        out["gil"] = gil_report
    lat = s["latency_ms"]
    print(f"  [{scenario}, {options or 'defaults'}, {concurrency or args.concurrency} clients] "
          f"{s['throughput_rps']:.1f} req/s, p50 {lat['p50']:.1f} ms, "
          f"p99 {lat['p99']:.1f} ms, mean batch {_f(out['mean_batch_size'])}, padding efficiency "
          f"{_f(out['padding_efficiency'], 3)}, errors {s['errors_by_code'] or 0}", flush=True)
    return out


def offline_throughput(model_dir: Path, texts: list[str], batch: int, seconds: float,
                       **model_keys: Any) -> dict[str, Any]:
    """Tokenize + run batches of ``batch`` texts in order, repeating the texts for about ``seconds``;
    ``model_keys`` are further ModelConfig keys (``dtype``, ``torch_unpadded``, ``torch_intra_op_threads``)."""
    from relserve.service.backends.torch_encoder import TorchBackend
    from relserve.service.config import ModelConfig

    be = TorchBackend(ModelConfig(name="sentiment", path=model_dir, device="cpu", max_batch_size=batch,
                                  **model_keys))
    meta = be.load()
    be.warmup()
    tok = meta.tokenizer
    max_len = min(meta.max_positions or 512, 512)

    def one_pass() -> tuple[int, float, float]:
        t_tok = t_run = 0.0
        n = 0
        for i in range(0, len(texts), batch):
            chunk = texts[i:i + batch]
            t0 = time.perf_counter()
            encs = [tok.encode(t, max_length=max_len) for t in chunk]
            t1 = time.perf_counter()
            be.run(encs)
            t2 = time.perf_counter()
            t_tok += t1 - t0
            t_run += t2 - t1
            n += len(chunk)
        return n, t_tok, t_run

    one_pass()  # warm caches and allocator
    n = 0
    t_tok = t_run = 0.0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        k, a, b = one_pass()
        n, t_tok, t_run = n + k, t_tok + a, t_run + b
    be.close()
    out = {"texts": n, "tokenize_s": t_tok, "run_s": t_run,
           "throughput_tps": n / (t_tok + t_run), "compute_only_tps": n / t_run}
    print(f"  [offline, batches of {batch}] {out['throughput_tps']:.1f} texts/s with tokenization, "
          f"{out['compute_only_tps']:.1f} texts/s model only", flush=True)
    return out


def _f(v: float | None, digits: int = 2) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser("serving", __doc__.split("\n")[0])
    ap.add_argument("--classify-model", help="classifier checkpoint directory (default defaults/sentiment, "
                                             "else a random checkpoint of that shape)")
    ap.add_argument("--concurrency", type=int, default=32, help="closed-loop clients (default 32)")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per measured run (default 20)")
    ap.add_argument("--max-requests", type=int, default=20000, help="also stop a run after this many requests")
    ap.add_argument("--bucketing-concurrency", type=int, default=128,
                    help="clients for the bucketing runs: a queue deeper than one batch, so that there is "
                         "something to choose from (default 128)")
    harness.add_common_args(ap, threads=1,
                            threads_help="torch threads per process, server and offline alike (OMP_NUM_THREADS; "
                                         "default 1; 0 leaves torch's default)",
                            warmup=64, warmup_help="requests before each measured run (default 64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="loadtest-results", help="directory for bench_serving.json")
    ap.add_argument("--only", choices=("batching", "overhead", "bucketing"), action="append",
                    help="run only these parts (repeatable)")
    args = ap.parse_args(argv)
    parts = set(args.only or ("batching", "overhead", "bucketing"))
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)  # the offline measurement runs in this process

    results: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "settings": {k: v for k, v in vars(args).items() if k != "only"},
    }
    with tempfile.TemporaryDirectory(prefix="relserve-bench-") as tmp:
        model_dir, origin = resolve_classifier(args.classify_model, Path(tmp))
        results["model"] = {"path": str(model_dir), "origin": origin}
        print(f"classifier: {model_dir} ({origin}); {args.concurrency} clients, {args.duration:g} s per run",
              flush=True)
        on = None
        if parts & {"batching", "overhead"}:
            print("dynamic batching (classify):", flush=True)
            on = serve_and_load(model_dir, "max_batch_size=32", "classify", args)
            results["batching_on"] = on
        if "batching" in parts:
            off = serve_and_load(model_dir, "max_batch_size=1", "classify", args)
            results["batching_off"] = off
            results["batching_speedup"] = harness.ratio(on["throughput_rps"], off["throughput_rps"])
            print(f"  => batching on/off throughput ratio {harness.fmt_ratio(results['batching_speedup'])}; "
                  f"p50 latency "
                  f"{on['latency_ms']['p50']:.1f} vs {off['latency_ms']['p50']:.1f} ms", flush=True)
        if "overhead" in parts:
            print("server vs offline backend (same texts):", flush=True)
            from ..scenarios import sentences

            offline = offline_throughput(model_dir, sentences(), 32, min(args.duration, 15.0))
            results["offline"] = offline
            results["server_vs_offline"] = harness.ratio(on["throughput_rps"], offline["throughput_tps"])
            results["server_vs_offline_compute_only"] = harness.ratio(on["throughput_rps"],
                                                                      offline["compute_only_tps"])
            print(f"  => server saturated / offline throughput {results['server_vs_offline']:.2f} "
                  f"(vs model-only offline {results['server_vs_offline_compute_only']:.2f})", flush=True)
        if "bucketing" in parts:
            print("padding efficiency (classify-mixed, 1-16 sentences per text):", flush=True)
            b_on = serve_and_load(model_dir, "length_bucketing=true", "classify-mixed", args,
                                  args.bucketing_concurrency)
            b_off = serve_and_load(model_dir, "length_bucketing=false", "classify-mixed", args,
                                   args.bucketing_concurrency)
            results["bucketing_on"], results["bucketing_off"] = b_on, b_off
            if b_on["padding_efficiency"] and b_off["padding_efficiency"]:
                results["padding_efficiency_gain"] = harness.ratio(b_on["padding_efficiency"],
                                                                   b_off["padding_efficiency"])
                results["bucketing_throughput_ratio"] = harness.ratio(b_on["throughput_rps"], b_off["throughput_rps"])
                print(f"  => real/padded tokens {b_on['padding_efficiency']:.3f} with bucketing vs "
                      f"{b_off['padding_efficiency']:.3f} without "
                      f"({harness.fmt_ratio(results['padding_efficiency_gain'])}); "
                      f"throughput ratio {results['bucketing_throughput_ratio']:.2f}", flush=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = harness.write_json(out_dir / "bench_serving.json", results)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
