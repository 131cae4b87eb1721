"""The load-test CLI against an in-process server with fake models (milliseconds per request): JSON + PNG
outputs, consistent counts, ordered percentiles, /metrics window deltas; sweep, soak, skip and error paths;
the batcher's length_bucketing switch the padding benchmark relies on."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest

from fixtures.fake_serving import runner, server_config
from relserve.loadtest import cli, promscrape, report
from relserve.loadtest.generator import Records
from relserve.loadtest.scenarios import Scenario, ScenarioUnavailable, mixed_length_texts, qa_pairs, sentences
from relserve.service.backends.base import TASK_QA
from relserve.service.batcher import Batcher
from relserve.service.server import InferenceServer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class InProcessServer:
    def __init__(self, runners) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = InferenceServer(server_config(), runners)
        port = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)
        asyncio.run_coroutine_threadsafe(self.server.load_models(), self.loop).result(10)
        self.target = f"127.0.0.1:{port}"
        self.metrics_url = f"http://127.0.0.1:{self.server.metrics_port}/metrics"

    def close(self) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.server.stop(0.5), self.loop).result(10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)


@pytest.fixture(scope="module")
def srv():
    s = InProcessServer([
        runner("lt-sentiment", config={"max_queue_delay": 0.002}, delay=0.002),
        runner("lt-qa", TASK_QA),
        runner("lt-broken", fail=True),
    ])
    yield s
    s.close()


def _cli(srv, tmp_path, *args: str) -> tuple[int, dict]:
    argv = [args[0], "--target", srv.target, "--metrics-url", srv.metrics_url, "--out", str(tmp_path),
            "--no-progress", "--name", "r", *args[1:]]
    rc = cli.main(argv)
    path = tmp_path / "r.json"
    return rc, json.loads(path.read_text()) if path.exists() else {}


def _check_consistent(out: dict) -> None:
    assert out["requests"] == out["successes"] + out["errors"]
    assert out["errors"] == sum(out["errors_by_code"].values())
    lat = out["latency_ms"]
    if out["successes"]:
        assert lat["min"] <= lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["p99.9"] <= lat["max"]
    assert sum(k["requests"] for k in out["by_kind"].values()) == out["requests"]
    assert out["throughput_rps"] > 0 or not out["successes"]


def test_closed_loop_mix_json_png_and_server_deltas(srv, tmp_path):
    rc, out = _cli(srv, tmp_path, "run", "--scenario", "mix", "--classify-model", "lt-sentiment", "--qa-model",
                   "lt-qa", "--concurrency", "6", "--requests", "150")
    assert rc == 0
    assert out["requests"] == 150 and out["successes"] == 150 and out["errors"] == 0
    _check_consistent(out)
    assert set(out["by_kind"]) == {"classify", "qa"}
    for key in ("latency_png", "timeline_png"):
        png = Path(out["plots"][key])
        assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size < 200_000

    server = out["server"]
    models = server["models"]
    assert set(models) == {"lt-sentiment", "lt-qa"}
    sent = models["lt-sentiment"]
    assert sent["requests_by_code"] == {"OK": out["by_kind"]["classify"]["requests"]}
    assert models["lt-qa"]["requests_by_code"] == {"OK": out["by_kind"]["qa"]["requests"]}
    assert sent["sequences"] == out["by_kind"]["classify"]["requests"]  # one text per Classify request
    assert models["lt-qa"]["sequences"] >= out["by_kind"]["qa"]["requests"]  # >= 1 window per question
    for m in models.values():
        assert m["batches"] >= 1 and 1 <= m["mean_batch_size"] <= 32
        assert m["mean_batch_size"] == pytest.approx(m["sequences"] / m["batches"])
        assert m["real_tokens"] > 0 and 0 <= m["padding_ratio"] < 1
        assert m["padding_ratio"] == pytest.approx(m["padding_tokens"] / (m["real_tokens"] + m["padding_tokens"]))
        assert m["mean_queue_ms"] is not None and m["mean_queue_ms"] >= 0
    assert server["real_tokens"] == sum(m["real_tokens"] for m in models.values())
    assert server["rss_bytes_start"] > 0 and server["rss_bytes_end"] > 0


def test_open_loop_errors_counted_by_code(srv, tmp_path):
    rc, out = _cli(srv, tmp_path, "run", "--scenario", "classify", "--classify-model", "lt-broken", "--rate", "300",
                   "--requests", "40", "--no-plots")
    assert rc == 0 and out["config"]["mode"] == "open"
    assert out["requests"] == 40 and out["successes"] == 0
    assert out["errors_by_code"] == {"INTERNAL": 40}
    _check_consistent(out)
    assert out["server"]["models"]["lt-broken"]["requests_by_code"] == {"INTERNAL": 40}
    assert out["plots"] == {}


def test_open_loop_duration_bound(srv, tmp_path):
    rc, out = _cli(srv, tmp_path, "run", "--classify-model", "lt-sentiment", "--rate", "100", "--duration", "1",
                   "--no-plots")
    assert rc == 0
    assert 50 <= out["requests"] <= 170  # Poisson(100) over 1 s
    assert out["duration_s"] < 5
    _check_consistent(out)


def test_translate_without_model_is_skipped(srv, tmp_path, capsys):
    rc, out = _cli(srv, tmp_path, "run", "--scenario", "translate", "--requests", "5")
    assert rc == 0 and "translation" in out["skipped"]
    assert "skipped" in capsys.readouterr().out


def test_sweep_finds_highest_passing_rate(srv, tmp_path):
    rc, out = _cli(srv, tmp_path, "sweep", "--classify-model", "lt-sentiment", "--rates", "20,40", "--step-duration",
                   "0.5", "--slo-ms", "5000")
    assert rc == 0 and out["best_rate"] == 40.0 and [s["passed"] for s in out["steps"]] == [True, True]
    assert Path(out["plots"]["sweep_png"]).read_bytes()[:8] == PNG_MAGIC
    rc, out = _cli(srv, tmp_path, "sweep", "--classify-model", "lt-sentiment", "--rates", "20,40", "--step-duration",
                   "0.5", "--slo-ms", "0.001", "--no-plots")
    assert rc == 0 and out["best_rate"] is None and len(out["steps"]) == 1  # stops at the first failing rate


def test_soak_samples_rss(srv, tmp_path):
    rc, out = _cli(srv, tmp_path, "soak", "--classify-model", "lt-sentiment", "--requests", "300",
                   "--concurrency", "4", "--sample-interval", "0.1")
    assert rc == 0 and out["requests"] == 300
    _check_consistent(out)
    assert len(out["rss_samples"]) >= 2 and all(s["bytes"] > 0 for s in out["rss_samples"])
    assert out["server"]["rss_growth_bytes"] == out["server"]["rss_bytes_end"] - out["server"]["rss_bytes_start"]


def test_unreachable_server_exits_1(tmp_path, capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = cli.main(["run", "--target", f"127.0.0.1:{port}", "--metrics-url", "none", "--timeout", "1",
                   "--requests", "3", "--out", str(tmp_path), "--no-progress"])
    assert rc == 1 and "cannot reach" in capsys.readouterr().err


def test_bad_arguments_exit_2():
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "--rate", "10", "--concurrency", "3"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "--requests", "0"])
    assert e.value.code == 2


# ---------------------------------------------------------------------- units

def test_summarize_percentiles_and_counts():
    rec = Records()
    for i in range(1000):
        rec.add("classify", i * 0.001, (i + 1) * 0.001, "OK" if i % 10 else "UNAVAILABLE")
    rec.elapsed = 2.0
    out = report.summarize(rec)
    assert out["requests"] == 1000 and out["successes"] == 900 and out["errors_by_code"] == {"UNAVAILABLE": 100}
    lat = out["latency_ms"]
    assert lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["p99.9"] <= lat["max"] == 1000.0
    assert out["throughput_rps"] == 450.0
    tl = report.timeline(rec)
    assert sum(tl["ok_rps"][:-1]) + tl["ok_rps"][-1] > 0


def test_window_summary_deltas():
    def text(real, pad, bsum, bcount, qsum, qcount, ok, rss):
        return f"""
# TYPE relserve_tokens counter
relserve_tokens_total{{model="m",kind="real"}} {real}
relserve_tokens_total{{model="m",kind="padding"}} {pad}
# TYPE relserve_batch_size histogram
relserve_batch_size_bucket{{model="m",le="+Inf"}} {bcount}
relserve_batch_size_count{{model="m"}} {bcount}
relserve_batch_size_sum{{model="m"}} {bsum}
# TYPE relserve_queue_duration_seconds histogram
relserve_queue_duration_seconds_bucket{{model="m",le="+Inf"}} {qcount}
relserve_queue_duration_seconds_count{{model="m"}} {qcount}
relserve_queue_duration_seconds_sum{{model="m"}} {qsum}
# TYPE relserve_requests counter
relserve_requests_total{{model="m",task="classification",code="OK"}} {ok}
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes {rss}
"""
    before = promscrape.parse(text(100, 50, 10, 5, 1.0, 10, 10, 1000))
    after = promscrape.parse(text(400, 150, 40, 10, 3.0, 40, 40, 1500))
    w = promscrape.window_summary(before, after)
    m = w["models"]["m"]
    assert m["real_tokens"] == 300 and m["padding_tokens"] == 100 and m["padding_ratio"] == 0.25
    assert m["mean_batch_size"] == 6.0 and m["batches"] == 5
    assert m["mean_queue_ms"] == pytest.approx(2000.0 / 30)
    assert m["requests_by_code"] == {"OK": 30}
    assert w["rss_bytes_start"] == 1000 and w["rss_growth_bytes"] == 500


def test_scenarios_use_committed_text():
    assert len(sentences()) == 300 and len(qa_pairs()) == 100
    lengths = sorted(len(t.split()) for t in mixed_length_texts(200))
    assert lengths[0] < 30 and lengths[-1] > 150
    sc = Scenario("mix", {"classify": "a", "qa": "b"}, seed=3)
    kinds = {sc.next().kind for _ in range(50)}
    assert kinds == {"classify", "qa"}
    with pytest.raises(ScenarioUnavailable):
        Scenario("translate", {"classify": "a"})


def test_length_bucketing_switch_orders_batches():
    """With bucketing the oldest unit is joined by the closest lengths; without it, by arrival order."""

    async def take(bucketing: bool) -> list[int]:
        b = Batcher("m", lambda xs: xs, max_batch_size=3, bucket_width=8, length_bucketing=bucketing)
        b.start()
        try:
            b._worker.cancel()  # form batches by hand
            b.submit([(t, t) for t in (10, 200, 190, 12, 11)])
            return [u.tokens for u in b._take_batch()]
        finally:
            await b.close()

    assert asyncio.run(take(True)) == [10, 12, 11]
    assert asyncio.run(take(False)) == [10, 200, 190]


def test_relserve_loadtest_subcommand_delegates(srv, tmp_path):
    from relserve.service.main import main as relserve_main

    rc = relserve_main(["loadtest", "run", "--target", srv.target, "--metrics-url", "none", "--classify-model",
                        "lt-sentiment", "--requests", "5", "--concurrency", "1", "--out", str(tmp_path),
                        "--no-progress", "--no-plots"])
    assert rc == 0 and json.loads((tmp_path / "run-classify.json").read_text())["successes"] == 5
