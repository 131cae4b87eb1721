"""``python -m relserve.loadtest`` (also ``relserve loadtest``): load-test a running relserve server.

    python -m relserve.loadtest run   --scenario classify --concurrency 16 --requests 2000
    python -m relserve.loadtest run   --scenario mix --rate 50 --duration 60
    python -m relserve.loadtest sweep --scenario classify --slo-ms 100 --rates 10,20,40,80 --step-duration 10
    python -m relserve.loadtest soak  --requests 20000 --concurrency 8

    python -m relserve.loadtest run   --scenario qa --data my_questions.jsonl --fail-if 'p99_ms>200'

Common flags: ``--target host:port`` (default 127.0.0.1:50051), ``--metrics-url`` (default
``http://<target host>:8002/metrics``; ``none`` disables), ``--out DIR`` (default ``loadtest-results``),
``--data FILE.jsonl`` (the user's own requests, :func:`scenarios.load_requests`), ``--connect-timeout`` (default
5 s), ``--tls`` / ``--tls-ca PEM`` (TLS; a CA implies it), ``--tls-cert PEM --tls-key PEM`` (mTLS client
certificate), ``--tls-server-name NAME``, ``--token TOKEN`` / ``--token-file PATH`` (sent as ``authorization:
Bearer <token>`` on every call, ListModels included, as service/auth.py expects). Each command writes
``DIR/<name>.json``, ``DIR/<name>.csv`` (or ``--csv PATH``; columns :data:`report.CSV_COLUMNS`) and PNG plots
beside them (``<name>-latency.png``, ``<name>-timeline.png``; ``<name>-sweep.png`` for sweeps); ``<name>``
defaults to ``<command>-<scenario>``. ``run`` and ``soak`` take ``--fail-if METRIC OP NUMBER`` (repeatable;
:mod:`thresholds`).

Before any request is sent the server must accept a connection and answer ListModels within
``--connect-timeout`` (over TLS and with the token when given; UNAUTHENTICATED names ``--token``), and every
model named with ``--*-model`` must be one it serves for that task.

Exit codes: 0 done (request errors are results; a scenario the server has no model for, e.g. ``translate``
without a translation model, is skipped with a message), 1 nothing sent: the server could not be reached or
does not serve a named model, 2 bad arguments or ``--data`` file, 3 a ``--fail-if`` threshold was violated, 4
every request of the run failed (the results are still written).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlsplit

import grpc

from relserve.client.cli import add_tls_and_token_flags

from . import generator, promscrape, report, thresholds
from .scenarios import (SCENARIOS, DataFileError, ModelNotServed, Scenario, ScenarioUnavailable, load_requests,
                        models_by_kind, parse_weights)

DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_METRICS_PORT = 8002
DEFAULT_CONNECT_TIMEOUT = 5.0
EXIT_OK, EXIT_NOT_RUN, EXIT_USAGE, EXIT_THRESHOLD, EXIT_ALL_FAILED = 0, 1, 2, 3, 4


@dataclass
class LoadSpec:
    """One load run. Exactly one of ``rate`` (open loop) and ``concurrency`` (closed loop)."""

    target: str = DEFAULT_TARGET
    scenario: str = "classify"
    rate: float | None = None
    concurrency: int | None = None
    requests: int | None = None
    duration: float | None = None
    metrics_url: str | None = None
    models: dict[str, str | None] = field(default_factory=dict)  # kind -> model override
    mix: dict[str, float] | None = None
    batch: int = 1
    beam_size: int = 0
    timeout: float = 30.0
    warmup: int = 0
    seed: int = 0
    progress: bool = True
    rss_interval: float | None = None  # sample server RSS every N seconds during the run (soak)
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT  # connect + ListModels before the run
    data: list[dict[str, str]] | None = None  # --data rows (scenarios.load_requests) instead of committed texts
    data_file: str | None = None
    security: generator.Security = field(default_factory=generator.Security)  # TLS / token (--tls*, --token)

    @property
    def mode(self) -> str:
        return "open" if self.rate is not None else "closed"


@dataclass
class RunResult:
    spec: LoadSpec
    summary: dict[str, Any]
    records: generator.Records
    server: dict[str, Any] | None
    rss_samples: list[tuple[float, float]]
    models: dict[str, str]
    skipped: str | None = None

    def to_json(self) -> dict[str, Any]:
        s = self.spec
        out: dict[str, Any] = {
            "config": {
                "target": s.target, "scenario": s.scenario, "mode": s.mode, "rate": s.rate,
                "concurrency": s.concurrency, "requests_limit": s.requests, "duration_limit_s": s.duration,
                "batch": s.batch, "timeout_s": s.timeout, "warmup": s.warmup, "seed": s.seed,
                "metrics_url": s.metrics_url, "models": self.models, "data_file": s.data_file,
                "data_requests": len(s.data) if s.data is not None else None,
                "tls": s.security.uses_tls, "mtls": s.security.client_cert is not None,
                "token": s.security.token is not None,  # whether one was sent, never the token
            },
            "started_at": self.records.started_at,
        }
        if self.skipped:
            out["skipped"] = self.skipped
            return out
        out.update(self.summary)
        out["server"] = self.server
        if self.rss_samples:
            out["rss_samples"] = [{"t": t, "bytes": b} for t, b in self.rss_samples]
        return out


def default_metrics_url(target: str) -> str:
    host = target.rsplit(":", 1)[0] if ":" in target else target
    host = host.strip("[]") or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{DEFAULT_METRICS_PORT}/metrics"


async def _settled(url: str | None, before: promscrape.Snapshot, after: promscrape.Snapshot | None,
                   models: list[str], sent: int, timeout: float = 2.0) -> promscrape.Snapshot | None:
    """Scrape again (up to ``timeout`` s) until the server has counted all ``sent`` requests: it counts a
    request just after sending its reply, so a scrape right after the last reply can miss the last few."""
    end = time.monotonic() + timeout
    while after is not None and time.monotonic() < end:
        window = promscrape.window_summary(before, after, models=models)["models"]
        if sum(v["requests"] for v in window.values()) >= sent:
            break
        await asyncio.sleep(0.05)
        after = await asyncio.to_thread(_scrape, url)
    return after


def _scrape(url: str | None) -> promscrape.Snapshot | None:
    if not url:
        return None
    try:
        return promscrape.scrape(url)
    except OSError as exc:
        print(f"loadtest: warning: cannot scrape {url}: {exc}", file=sys.stderr)
        return None


class _Progress:
    def __init__(self, enabled: bool, total: int | None, desc: str) -> None:
        self.bar = None
        self.errors = 0
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True,
                            mininterval=0.5)

    def __call__(self, code: str) -> None:
        if self.bar is None:
            return
        if code != "OK":
            self.errors += 1
            self.bar.set_postfix(errors=self.errors, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def connect(ch: grpc.aio.Channel, target: str, timeout: float,
                  security: generator.Security | None = None) -> list[Any]:
    """Wait up to ``timeout`` s for the channel to connect, then ListModels with the same deadline (and the
    bearer token of ``security``, if any).

    Raises:
        ConnectionError: no connection within ``timeout`` (nothing listening, wrong address, TLS on one side
            only, a certificate not trusted either way), or ListModels failed (UNAUTHENTICATED: no or a wrong
            token); the message says which and names the flags that fix it.
    """
    security = security or generator.Security()
    try:
        await asyncio.wait_for(ch.channel_ready(), timeout)
    except TimeoutError:
        how = ("over TLS: does the server use TLS, does --tls-ca sign its certificate, and does it want a client "
               "certificate (--tls-cert/--tls-key)?" if security.uses_tls else
               "in plaintext: does the server use TLS (--tls-ca, --tls-cert/--tls-key)?")
        raise ConnectionError(f"cannot reach relserve at {target}: no connection within {timeout:g} s "
                              f"(--connect-timeout); is the server running and listening there? Tried {how}") from None
    try:
        return await generator.list_models(ch, timeout=timeout, metadata=security.metadata)
    except grpc.aio.AioRpcError as exc:
        hint = ""
        if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
            hint = (" (the token given with --token/--token-file was refused)" if security.token is not None else
                    " (the server wants a bearer token: pass --token TOKEN or --token-file PATH)")
        what = (f"did not answer ListModels within {timeout:g} s" if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                else "refused ListModels")
        raise ConnectionError(f"relserve at {target} {what}: {exc.code().name}: {exc.details()}{hint}") from None


async def run_load(spec: LoadSpec) -> RunResult:
    """Connect, discover models, (warm up), scrape, run the loop, scrape again; see :class:`LoadSpec`.

    Raises:
        ConnectionError: the server did not connect and answer ListModels within ``spec.connect_timeout``.
        ModelNotServed: a model named in ``spec.models`` is not served for its task (nothing is sent).
        DataFileError: ``spec.data`` has fewer rows than ``spec.batch``.
        ValueError: inconsistent spec.
    """
    if (spec.rate is None) == (spec.concurrency is None):
        raise ValueError("give exactly one of rate (open loop) and concurrency (closed loop)")
    if spec.requests is None and spec.duration is None:
        raise ValueError("bound the run with requests and/or duration")
    ch = generator.channel(spec.target, spec.security)
    metadata = spec.security.metadata
    try:
        infos = await connect(ch, spec.target, spec.connect_timeout, spec.security)
        models = models_by_kind(infos, spec.models)
        try:
            scenario = Scenario(spec.scenario, models, weights=spec.mix, batch=spec.batch,
                                beam_size=spec.beam_size, seed=spec.seed, data=spec.data)
        except ScenarioUnavailable as exc:
            return RunResult(spec, {}, generator.Records(started_at=time.time()), None, [], models, skipped=str(exc))
        used = dict(scenario.models)
        if spec.warmup:
            await generator.Engine(ch, timeout=spec.timeout, metadata=metadata).closed_loop(
                scenario, spec.concurrency or 4, requests=spec.warmup, duration=None)
        before = await asyncio.to_thread(_scrape, spec.metrics_url)
        rss_samples: list[tuple[float, float]] = []
        progress = _Progress(spec.progress, spec.requests, f"{spec.scenario} ({spec.mode} loop)")
        engine = generator.Engine(ch, timeout=spec.timeout, on_done=progress, metadata=metadata)
        sampler = None
        if spec.rss_interval and spec.metrics_url and before is not None:
            sampler = asyncio.create_task(_sample_rss(spec.metrics_url, spec.rss_interval, engine, rss_samples))
        try:
            if spec.rate is not None:
                records = await engine.open_loop(scenario, spec.rate, requests=spec.requests,
                                                 duration=spec.duration, seed=spec.seed)
            else:
                records = await engine.closed_loop(scenario, spec.concurrency or 1, requests=spec.requests,
                                                   duration=spec.duration)
        finally:
            progress.close()
            if sampler is not None:
                sampler.cancel()
                await asyncio.gather(sampler, return_exceptions=True)
        after = await asyncio.to_thread(_scrape, spec.metrics_url)
        models = sorted(set(used.values()))
        if before is not None:
            after = await _settled(spec.metrics_url, before, after, models, len(records))
        server = None
        if before is not None and after is not None:
            server = promscrape.window_summary(before, after, models=models)
            rss1 = promscrape.rss_bytes(after)
            if rss1 is not None:
                rss_samples.append((records.elapsed, rss1))
            rss0 = promscrape.rss_bytes(before)
            if rss0 is not None and sampler is not None:
                rss_samples.insert(0, (0.0, rss0))
        return RunResult(spec, report.summarize(records), records, server, rss_samples if sampler else [], used)
    finally:
        await ch.close()


async def _sample_rss(url: str, interval: float, engine: generator.Engine, out: list[tuple[float, float]]) -> None:
    while True:
        await asyncio.sleep(interval)
        snap = await asyncio.to_thread(_scrape, url)
        rss = promscrape.rss_bytes(snap) if snap is not None else None
        if rss is not None:
            out.append((engine.now(), rss))


def csv_rows(result: RunResult, command: str) -> list[dict[str, Any]]:
    """The CSV rows of one run: a single-kind scenario gives one row with the report's top-level numbers; a
    mix gives an ``all`` row (top level) and one row per request kind (``by_kind``)."""
    if result.skipped:
        return []
    s, summ = result.spec, result.summary
    base = {"command": command, "scenario": s.scenario, "mode": s.mode, "rate": s.rate,
            "concurrency": s.concurrency}
    kinds = list(summ["by_kind"])
    if len(kinds) == 1:
        return [{**base, "kind": kinds[0], "model": result.models.get(kinds[0]), **report.flat_metrics(summ)}]
    rows = [{**base, "kind": "all", "model": "+".join(result.models[k] for k in sorted(result.models)),
             **report.flat_metrics(summ)}]
    for k in kinds:
        rows.append({**base, "kind": k, "model": result.models.get(k),
                     **report.flat_metrics(summ["by_kind"][k], summ["duration_s"])})
    return rows


def sweep_csv_rows(result: dict[str, Any], scenario: str) -> list[dict[str, Any]]:
    """One CSV row per sweep step (open loop at the step's rate)."""
    models = result.get("models", {})
    model = "+".join(models[k] for k in sorted(models))
    return [{"command": "sweep", "scenario": scenario, "kind": "all", "model": model, "mode": "open",
             "rate": step["rate"], "concurrency": None, **report.flat_metrics(step)} for step in result["steps"]]


def write_outputs(result: RunResult, out_dir: Path, name: str, plots: bool = True, *, command: str = "run",
                  csv_path: Path | None = None) -> dict[str, Path]:
    """Write ``<name>.json``, the CSV (``csv_path`` or ``<name>.csv`` beside the JSON; not for a skipped run)
    and, with ``plots``, the PNGs into ``out_dir``; returns ``{kind: path}``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    data = result.to_json()
    if plots and not result.skipped and len(result.records):
        title = f"relserve {result.spec.scenario} — {_describe(result.spec)}"
        paths["latency_png"] = report.plot_latency(result.records, out_dir / f"{name}-latency.png", title)
        paths["timeline_png"] = report.plot_timeline(result.records, out_dir / f"{name}-timeline.png", title,
                                                     rss=result.rss_samples)
    data["plots"] = {k: str(v) for k, v in paths.items()}
    paths["json"] = report.write_json(data, out_dir / f"{name}.json")
    rows = csv_rows(result, command)
    if rows:
        paths["csv"] = report.write_csv(rows, _csv_target(csv_path, out_dir, name))
    return paths


def _csv_target(csv_path: Path | None, out_dir: Path, name: str) -> Path:
    if csv_path is None:
        return out_dir / f"{name}.csv"
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    return csv_path


def _describe(spec: LoadSpec) -> str:
    load = f"open loop {spec.rate:g} req/s" if spec.rate is not None else f"closed loop, {spec.concurrency} clients"
    return load


def _fmt(v: float | None, unit: str = "", digits: int = 1) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}{unit}"


def print_summary(result: RunResult, paths: dict[str, Path], stream=None) -> None:
    stream = stream or sys.stdout
    if result.skipped:
        print(f"skipped: {result.skipped}", file=stream)
        return
    s = result.summary
    lat = s["latency_ms"]
    print(f"{result.spec.scenario} ({_describe(result.spec)}) against {result.spec.target}, models {result.models}",
          file=stream)
    print(f"  requests {s['requests']}  ok {s['successes']}  errors {s['errors']} {s['errors_by_code'] or ''}",
          file=stream)
    print(f"  throughput {s['throughput_rps']:.1f} req/s over {s['duration_s']:.1f} s", file=stream)
    print("  latency ms: " + "  ".join(f"{k} {_fmt(lat[k])}" for k in (*(k for k, _ in report.PERCENTILES), "max")),
          file=stream)
    srv = result.server
    if srv:
        for model, m in srv["models"].items():
            print(f"  server[{model}]: mean queue {_fmt(m['mean_queue_ms'], ' ms', 2)}, mean batch "
                  f"{_fmt(m['mean_batch_size'], '', 2)}, padding ratio {_fmt(m['padding_ratio'], '', 3)} "
                  f"({m['real_tokens']} real / {m['padding_tokens']} padding tokens)", file=stream)
        if srv.get("rss_bytes_start") is not None:
            print(f"  server RSS {srv['rss_bytes_start'] / 2**20:.1f} MiB -> {srv['rss_bytes_end'] / 2**20:.1f} MiB",
                  file=stream)
    for key, p in paths.items():
        print(f"  {key}: {p}", file=stream)


# ---------------------------------------------------------------------- sweep

async def run_sweep(base: LoadSpec, rates: Sequence[float], slo_ms: float, *, max_error_rate: float = 0.0,
                    stop_after_fail: bool = True) -> dict[str, Any]:
    """Open-loop steps at increasing rates; the answer is the highest rate whose p99 (of successes) stays
    under ``slo_ms`` with at most ``max_error_rate`` of requests failing."""
    steps: list[dict[str, Any]] = []
    best = None
    models: dict[str, str] = {}
    for i, rate in enumerate(rates):
        spec = LoadSpec(**{**base.__dict__, "rate": float(rate), "concurrency": None,
                           "warmup": base.warmup if i == 0 else 0})
        res = await run_load(spec)
        if res.skipped:
            return {"skipped": res.skipped, "models": res.models}
        models = res.models
        s = res.summary
        p99 = s["latency_ms"]["p99"]
        err_frac = s["errors"] / s["requests"] if s["requests"] else 1.0
        ok = p99 is not None and p99 < slo_ms and err_frac <= max_error_rate
        step = {"rate": float(rate), "passed": ok, "requests": s["requests"], "successes": s["successes"],
                "errors": s["errors"], "error_rate": s["error_rate"], "errors_by_code": s["errors_by_code"],
                "duration_s": s["duration_s"], "throughput_rps": s["throughput_rps"],
                "completed_rps": s["completed_rps"], "latency_ms": s["latency_ms"], "server": res.server}
        steps.append(step)
        print(f"  rate {rate:g}/s: p99 {_fmt(p99, ' ms')}, throughput {s['throughput_rps']:.1f}/s, "
              f"errors {s['errors']} -> {'pass' if ok else 'FAIL'}", file=sys.stderr)
        if ok:
            best = float(rate)
        elif stop_after_fail:
            break
    return {"slo_ms": slo_ms, "max_error_rate": max_error_rate, "best_rate": best, "steps": steps,
            "models": models}


def sweep_rates(args: argparse.Namespace) -> list[float]:
    if args.rates:
        return [float(x) for x in args.rates.split(",") if x.strip()]
    rates, r = [], args.start_rate
    while r <= args.max_rate + 1e-9 and len(rates) < 50:
        rates.append(round(r, 3))
        r *= args.factor
    return rates


# ---------------------------------------------------------------------- command line

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m relserve.loadtest",
                                     description="Load-test a running relserve server (gRPC).")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--target", default=DEFAULT_TARGET, help=f"server host:port (default {DEFAULT_TARGET})")
        p.add_argument("--metrics-url", help="the server's Prometheus endpoint (default http://<target host>:"
                                             f"{DEFAULT_METRICS_PORT}/metrics; 'none' disables scraping)")
        p.add_argument("--scenario", choices=SCENARIOS, default="classify", help="what to send (default classify)")
        p.add_argument("--classify-model", help="classification model (default: the first one the server lists)")
        p.add_argument("--qa-model", help="QA model (default: the first one the server lists)")
        p.add_argument("--translate-model", help="translation model (default: the first one the server lists)")
        p.add_argument("--zero-shot-model", help="NLI model for --scenario zero-shot (default: the first "
                                                 "classification model with an entailment label)")
        p.add_argument("--tokens-model", help="token-classification model for --scenario classify-tokens (default: "
                                              "the first one the server lists)")
        p.add_argument("--rerank-model", help="cross-encoder for --scenario rerank (default: the first one-label "
                                              "classification model, else one with an entailment label)")
        p.add_argument("--mix", help="weights for --scenario mix, e.g. classify=0.6,qa=0.3,translate=0.1")
        p.add_argument("--batch", type=int, default=1,
                       help="texts per Classify/Translate/ZeroShotClassify request (default 1)")
        p.add_argument("--beam-size", type=int, default=0, help="Translate beam size (default: model default)")
        p.add_argument("--timeout", type=float, default=30.0, help="per-request deadline in seconds (default 30)")
        p.add_argument("--warmup", type=int, default=0, help="requests sent (not recorded) before the run")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--out", default="loadtest-results", help="output directory (default loadtest-results)")
        p.add_argument("--name", help="output file stem (default <command>-<scenario>)")
        p.add_argument("--no-plots", action="store_true", help="write the JSON only")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
        p.add_argument("--data", metavar="FILE.jsonl",
                       help="send these requests instead of the committed texts: one JSON object per line with "
                            "the scenario's fields (classify: text, optional text_pair; classify-pair: text, "
                            "text_pair; qa: question, context; translate: text); other fields are ignored")
        p.add_argument("--csv", metavar="PATH", help="CSV report path (default <out>/<name>.csv beside the JSON)")
        p.add_argument("--connect-timeout", type=float, default=DEFAULT_CONNECT_TIMEOUT,
                       help="seconds to connect and list the models before the run; unreachable -> exit 1 "
                            f"(default {DEFAULT_CONNECT_TIMEOUT:g})")
        add_tls_and_token_flags(p, address_flag="--target")

    def fail_if(p: argparse.ArgumentParser) -> None:
        p.add_argument("--fail-if", action="append", default=[], type=_threshold, metavar="EXPR",
                       help="exit 3 if the run's METRIC OP NUMBER holds, e.g. 'p99_ms>200' or 'error_rate>0.01' "
                            "(repeatable; OP one of > >= < <=; metrics: " + ", ".join(report.METRICS) + ")")

    run = sub.add_parser("run", help="one load run (open or closed loop)")
    common(run)
    loop = run.add_mutually_exclusive_group()
    loop.add_argument("--rate", type=float, help="open loop: Poisson arrivals at this many requests/s")
    loop.add_argument("--concurrency", type=int, help="closed loop: this many clients (default 8)")
    run.add_argument("--requests", type=int, help="stop after this many requests (default 1000 if no --duration)")
    run.add_argument("--duration", type=float, help="stop sending after this many seconds")
    fail_if(run)

    sweep = sub.add_parser("sweep", help="step the open-loop rate; find the highest rate whose p99 < --slo-ms")
    common(sweep)
    sweep.add_argument("--slo-ms", type=float, required=True, help="p99 latency objective in milliseconds")
    sweep.add_argument("--rates", help="explicit comma-separated rates (req/s)")
    sweep.add_argument("--start-rate", type=float, default=5.0, help="first rate (default 5/s)")
    sweep.add_argument("--factor", type=float, default=1.5, help="rate multiplier per step (default 1.5)")
    sweep.add_argument("--max-rate", type=float, default=1000.0, help="last rate tried (default 1000/s)")
    sweep.add_argument("--step-duration", type=float, default=10.0, help="seconds per step (default 10)")
    sweep.add_argument("--step-requests", type=int, help="also stop a step after this many requests")
    sweep.add_argument("--max-error-rate", type=float, default=0.0,
                       help="fraction of failed requests a passing step may have (default 0)")
    sweep.add_argument("--keep-going", action="store_true", help="try every rate, even after one fails")

    soak = sub.add_parser("soak", help="long closed-loop run sampling server RSS (process_resident_memory_bytes)")
    common(soak)
    soak.add_argument("--requests", type=int, default=20000, help="requests (default 20000)")
    soak.add_argument("--duration", type=float, help="also stop after this many seconds")
    soak.add_argument("--concurrency", type=int, default=8, help="clients (default 8)")
    soak.add_argument("--sample-interval", type=float, default=2.0, help="seconds between RSS samples (default 2)")
    fail_if(soak)
    return parser


def _threshold(expr: str) -> thresholds.Threshold:
    try:
        return thresholds.parse(expr)
    except ValueError as exc:  # argparse prints it after the usage and exits 2
        raise argparse.ArgumentTypeError(str(exc)) from None


def spec_from_args(args: argparse.Namespace) -> LoadSpec:
    metrics_url = args.metrics_url or default_metrics_url(args.target)
    if metrics_url.lower() == "none":
        metrics_url = None
    elif not urlsplit(metrics_url).scheme:
        metrics_url = f"http://{metrics_url}"
    spec = LoadSpec(
        target=args.target, scenario=args.scenario, metrics_url=metrics_url,
        models={"classify": args.classify_model, "qa": args.qa_model, "translate": args.translate_model,
                "zero-shot": args.zero_shot_model, "tokens": args.tokens_model, "rerank": args.rerank_model},
        mix=parse_weights(args.mix), batch=args.batch, beam_size=args.beam_size, timeout=args.timeout,
        warmup=args.warmup, seed=args.seed, progress=not args.no_progress, connect_timeout=args.connect_timeout,
        security=security_from_args(args),
    )
    if args.data:
        spec.data, spec.data_file = load_requests(args.data, args.scenario), args.data
    if args.command == "run":
        spec.rate = args.rate
        spec.concurrency = None if args.rate is not None else (args.concurrency or 8)
        spec.requests, spec.duration = args.requests, args.duration
        if spec.requests is None and spec.duration is None:
            spec.requests = 1000
    elif args.command == "soak":
        spec.concurrency = args.concurrency
        spec.requests, spec.duration = args.requests, args.duration
        spec.rss_interval = args.sample_interval
    elif args.command == "sweep":
        spec.duration, spec.requests = args.step_duration, args.step_requests
        spec.progress = False
    return spec


def _pem_arg(path: str | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {path!r}: {exc.strerror or exc}") from None


def security_from_args(args: argparse.Namespace) -> generator.Security:
    """The :class:`generator.Security` of the ``--tls*`` / ``--token*`` flags.

    Raises:
        ValueError: only one of --tls-cert / --tls-key, an unreadable file, or a token that is empty or not
            printable ASCII (service/auth.py resolve_token); the message names the flag (main exits 2).
    """
    from relserve.service.auth import resolve_token

    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together (the mTLS client certificate and its key)")
    return generator.Security(
        tls=args.tls or args.tls_server_name is not None, root_certificates=_pem_arg(args.tls_ca, "--tls-ca"),
        client_cert=_pem_arg(args.tls_cert, "--tls-cert"), client_key=_pem_arg(args.tls_key, "--tls-key"),
        server_name=args.tls_server_name,
        token=resolve_token(args.token, args.token_file, names=("--token", "--token-file")))


def _validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for key in ("requests", "concurrency", "step_requests"):
        v = getattr(args, key, None)
        if v is not None and v < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1")
    for key in ("rate", "duration", "step_duration", "sample_interval", "slo_ms", "start_rate"):
        v = getattr(args, key, None)
        if v is not None and v <= 0:
            parser.error(f"--{key.replace('_', '-')} must be > 0")
    if args.batch < 1:
        parser.error("--batch must be >= 1")
    if args.timeout <= 0:
        parser.error("--timeout must be > 0")
    if args.connect_timeout <= 0:
        parser.error("--connect-timeout must be > 0")
    if args.command == "sweep" and not args.rates and args.factor <= 1:
        parser.error("--factor must be > 1")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (module docstring); argparse exits 2 on bad arguments."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _validate(args, parser)
    try:
        spec = spec_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    name = args.name or f"{args.command}-{args.scenario}"
    out_dir = Path(args.out)
    try:
        if args.command == "sweep":
            result = asyncio.run(run_sweep(spec, sweep_rates(args), args.slo_ms, max_error_rate=args.max_error_rate,
                                           stop_after_fail=not args.keep_going))
            if result.get("skipped"):
                print(f"skipped: {result['skipped']}")
                out_dir.mkdir(parents=True, exist_ok=True)
                report.write_json(result, out_dir / f"{name}.json")
                return 0
            out_dir.mkdir(parents=True, exist_ok=True)
            paths = {}
            if not args.no_plots and result["steps"]:
                paths["sweep_png"] = report.plot_sweep(result["steps"], args.slo_ms, out_dir / f"{name}-sweep.png",
                                                       f"relserve {args.scenario} rate sweep")
            result["plots"] = {k: str(v) for k, v in paths.items()}
            paths["json"] = report.write_json(result, out_dir / f"{name}.json")
            if result["steps"]:
                paths["csv"] = report.write_csv(sweep_csv_rows(result, args.scenario),
                                                _csv_target(Path(args.csv) if args.csv else None, out_dir, name))
            best = result["best_rate"]
            print(f"highest rate with p99 < {args.slo_ms:g} ms: "
                  f"{'none of the rates tried' if best is None else f'{best:g} req/s'}")
            for key, p in paths.items():
                print(f"  {key}: {p}")
            return 0
        result = asyncio.run(run_load(spec))
    except (ConnectionError, ModelNotServed) as exc:
        print(f"loadtest: {exc}", file=sys.stderr)
        return EXIT_NOT_RUN
    except DataFileError as exc:
        print(f"loadtest: {exc}", file=sys.stderr)
        return EXIT_USAGE
    paths = write_outputs(result, out_dir, name, plots=not args.no_plots, command=args.command,
                          csv_path=Path(args.csv) if args.csv else None)
    print_summary(result, paths)
    if args.command == "soak" and result.server and result.server.get("rss_bytes_start") is not None:
        srv = result.server
        peak = max([b for _, b in result.rss_samples] or [srv["rss_bytes_end"]])
        print(f"  soak: RSS start {srv['rss_bytes_start'] / 2**20:.1f} MiB, end {srv['rss_bytes_end'] / 2**20:.1f} "
              f"MiB, peak {peak / 2**20:.1f} MiB, growth {srv['rss_growth_bytes'] / 2**20:+.1f} MiB over "
              f"{result.summary['requests']} requests")
    return _verdict(result, args.fail_if)


def _verdict(result: RunResult, checks: Sequence[thresholds.Threshold]) -> int:
    """The exit code of a finished run: every request failed -> 4; a violated --fail-if -> 3; else 0. Both
    are printed (the thresholds on stdout with the report, the failures also on stderr)."""
    if result.skipped:
        return EXIT_OK
    s = result.summary
    code = EXIT_OK
    metrics = report.flat_metrics(s)
    failed = thresholds.violations(checks, metrics)
    for t in checks:
        shown = metrics[t.metric]
        print(f"  fail-if {t}: {'VIOLATED' if t.violated_by(metrics) else 'ok'} "
              f"({t.metric} = {'n/a' if shown is None else f'{shown:g}'})")
    for line in failed:
        print(f"loadtest: threshold violated: {line}", file=sys.stderr)
    if failed:
        code = EXIT_THRESHOLD
    if s["requests"] and not s["successes"]:
        print(f"loadtest: every one of the {s['requests']} requests failed: {s['errors_by_code']}", file=sys.stderr)
        code = EXIT_ALL_FAILED
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
