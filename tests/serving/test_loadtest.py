"""The load-test CLI against an in-process server with fake models (milliseconds per request): JSON + PNG + CSV
outputs, consistent counts, ordered percentiles, /metrics window deltas; sweep, soak, skip and error paths;
--data files, the text-pair scenario, --fail-if exit codes, fail-fast on unreachable servers and unknown
models; the batcher's length_bucketing switch the padding benchmark relies on."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fixtures.fake_serving import FakeTokenizer, runner, server_config
from relserve.loadtest import cli, promscrape, report
from relserve.loadtest.generator import Records
from relserve.loadtest.scenarios import (Scenario, ScenarioUnavailable, mixed_length_texts, qa_pairs,
                                         question_sentence_pairs, sentences)
from relserve.service.backends.base import TASK_QA
from relserve.service.scheduling.batcher import Batcher
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
        assert lat["min"] <= lat["p50"] <= lat["p90"] <= lat["p95"] <= lat["p99"] <= lat["p99.9"] <= lat["max"]
    assert out["error_rate"] == pytest.approx(out["errors"] / out["requests"] if out["requests"] else 0.0)
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


def test_open_loop_errors_counted_by_code(srv, tmp_path, capsys):
    rc, out = _cli(srv, tmp_path, "run", "--scenario", "classify", "--classify-model", "lt-broken", "--rate", "300",
                   "--requests", "40", "--no-plots")
    assert rc == cli.EXIT_ALL_FAILED == 4 and out["config"]["mode"] == "open"  # results written all the same
    assert "every one of the 40 requests failed" in capsys.readouterr().err
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


def test_unreachable_server_exits_1_within_the_connect_timeout(tmp_path):
    """The real ``python -m relserve.loadtest`` process; the subprocess timeout (well under the 30 s request
    deadline) is only a guard against a hang."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-m", "relserve.loadtest", "run", "--target", f"127.0.0.1:{port}",
                           "--metrics-url", "none", "--connect-timeout", "1", "--requests", "3", "--out",
                           str(tmp_path), "--no-progress"], capture_output=True, text=True, timeout=25, env=env)
    assert proc.returncode == 1, proc.stderr
    assert f"cannot reach relserve at 127.0.0.1:{port}: no connection within 1 s" in proc.stderr
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written


def test_unknown_model_fails_fast_listing_the_served_models(srv, tmp_path, capsys):
    before = promscrape.scrape(srv.metrics_url)
    rc, out = _cli(srv, tmp_path, "run", "--classify-model", "no-such-model", "--requests", "20")
    err = capsys.readouterr().err
    assert rc == 1 and out == {}
    assert "'no-such-model': the server does not serve it" in err
    for name in ("lt-sentiment (classification)", "lt-qa (question-answering)", "lt-broken (classification)"):
        assert name in err
    rc, _ = _cli(srv, tmp_path, "run", "--qa-model", "lt-sentiment", "--scenario", "qa", "--requests", "20")
    assert rc == 1 and "'lt-sentiment' is a classification model, not question-answering" in capsys.readouterr().err
    after = promscrape.scrape(srv.metrics_url)
    # only the two ListModels calls reached the server (counted under task list_models); no inference request
    assert after.get("relserve_requests_total") - before.get("relserve_requests_total") == 2
    assert (after.get("relserve_requests_total", task="list_models")
            - before.get("relserve_requests_total", task="list_models")) == 2


def test_tls_mtls_and_token_server(tmp_path, capsys):
    """A server with TLS, client certificates and a bearer token: the run needs --tls-ca, --tls-cert/--tls-key
    and the token (sent on ListModels and every request); without the token it exits 1 naming --token."""
    from fixtures.server import Running
    from fixtures.tls import make_pki
    from relserve.client import Client

    pki = make_pki(tmp_path / "pki")
    token = "loadtest-token-0123456789"
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# for the load test\n{token}\n")
    s = Running(server_config(metrics_port=None, tls_cert=pki.server_cert, tls_key=pki.server_key,
                              tls_client_ca=pki.ca_cert, auth_token_file=tokens), [runner("lt-sentiment")])
    target = f"127.0.0.1:{s.port}"
    tls = ["--tls-ca", str(pki.ca_cert), "--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key)]

    def run(*flags: str) -> tuple[int, dict]:
        out = tmp_path / "out"
        rc = cli.main(["run", "--target", target, "--metrics-url", "none", "--out", str(out), "--no-progress",
                       "--name", "r", "--no-plots", "--requests", "20", "--concurrency", "2",
                       "--connect-timeout", "5", *flags])
        path = out / "r.json"
        result = json.loads(path.read_text()) if path.exists() else {}
        if path.exists():
            path.unlink()
        return rc, result

    try:
        with Client(target, root_certificates=pki.ca_cert, client_cert=pki.client_cert,
                    client_key=pki.client_key, token=token, timeout=5) as client:
            deadline = time.monotonic() + 15
            while client.list_models().models == [] and time.monotonic() < deadline:
                time.sleep(0.02)  # models load in the background
        rc, out = run(*tls, "--token-file", str(tokens))
        assert rc == 0 and out["requests"] == 20 and out["successes"] == 20, out
        assert out["config"]["tls"] and out["config"]["mtls"] and out["config"]["token"]
        assert token not in json.dumps(out)
        rc, out = run(*tls, "--token", token + "\n")  # stripped like the server strips its file's lines
        assert rc == 0 and out["successes"] == 20
        capsys.readouterr()

        rc, out = run(*tls)
        err = capsys.readouterr().err
        assert rc == 1 and out == {}
        assert "UNAUTHENTICATED" in err and "--token" in err, err
        rc, _ = run(*tls, "--token", "wrong-token")
        err = capsys.readouterr().err
        assert rc == 1 and "UNAUTHENTICATED" in err and "--token" in err and "wrong-token" not in err
    finally:
        s.close()


def test_tls_and_token_flags_are_checked_before_connecting(tmp_path, capsys):
    base = ["run", "--target", "127.0.0.1:1", "--metrics-url", "none", "--out", str(tmp_path)]
    for flags, message in ((["--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
                           (["--tls-ca", str(tmp_path / "none.pem")], "--tls-ca: cannot read"),
                           (["--token", " "], "--token is empty"),
                           (["--token", "t\u00f6k"], "--token must be printable ASCII"),
                           (["--token-file", str(tmp_path / "none")], "--token-file: ")):
        with pytest.raises(SystemExit) as e:
            cli.main(base + flags)
        assert e.value.code == 2 and message in capsys.readouterr().err, flags


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


# ---------------------------------------------------------------------- --data, pairs, CSV, --fail-if

def _csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _num(field: str) -> float | None:
    return None if field == "" else float(field)


def test_data_file_requests_reach_the_server_with_their_pairs(srv, tmp_path):
    """Every --data row is 3 + 4 words: the fake tokenizer makes [CLS] 3 [SEP] 4 [SEP] = 10 tokens per request,
    so the server's real-token count shows the pairs were sent (5 tokens each without them)."""
    data = tmp_path / "pairs.jsonl"
    rows = [{"id": i, "text": f"premise number {i}", "text_pair": f"the hypothesis is {i}", "label": "x"}
            for i in range(5)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n", encoding="utf-8")
    rc, out = _cli(srv, tmp_path, "run", "--classify-model", "lt-sentiment", "--data", str(data), "--concurrency",
                   "3", "--requests", "30", "--no-plots")
    assert rc == 0 and out["successes"] == 30
    assert out["config"]["data_file"] == str(data) and out["config"]["data_requests"] == 5
    m = out["server"]["models"]["lt-sentiment"]
    assert m["sequences"] == 30 and m["real_tokens"] == 30 * 10

    qa = tmp_path / "qa.jsonl"
    qa.write_text(json.dumps({"question": "who wins", "context": "good things win in the end"}) + "\n")
    rc, out = _cli(srv, tmp_path, "run", "--scenario", "qa", "--qa-model", "lt-qa", "--data", str(qa),
                   "--concurrency", "2", "--requests", "10", "--no-plots")
    assert rc == 0 and out["successes"] == 10
    # [CLS] 2 [SEP] 6 [SEP]: one window per question
    assert out["server"]["models"]["lt-qa"]["real_tokens"] == 10 * 11


def test_bad_data_file_exits_2_naming_the_line(srv, tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "fine"}\n\n{"text": 5}\n', encoding="utf-8")
    with pytest.raises(SystemExit) as e:
        _cli(srv, tmp_path, "run", "--data", str(data), "--requests", "3")
    assert e.value.code == 2
    assert f"--data {data}:3: field 'text' must be a non-blank string" in capsys.readouterr().err
    data.write_text('{"question": "q"}\n', encoding="utf-8")
    with pytest.raises(SystemExit) as e:
        _cli(srv, tmp_path, "run", "--scenario", "qa", "--data", str(data), "--requests", "3")
    assert e.value.code == 2 and "bad.jsonl:1: field 'context' is missing" in capsys.readouterr().err


def test_text_pair_scenario(srv, tmp_path):
    rc, out = _cli(srv, tmp_path, "run", "--scenario", "classify-pair", "--classify-model", "lt-sentiment",
                   "--concurrency", "4", "--requests", "60", "--batch", "2", "--no-plots")
    assert rc == 0 and out["successes"] == 60 and set(out["by_kind"]) == {"classify"}
    _check_consistent(out)
    m = out["server"]["models"]["lt-sentiment"]
    assert m["sequences"] == 120  # two (question, sentence) pairs per request
    # each request's real tokens lie between the fewest and most any batch of two pairs of the pool makes
    tok = FakeTokenizer()
    pairs = question_sentence_pairs()
    per_request = [sum(len(tok.encode(q, s, max_length=64).input_ids) for q, s in pairs[i:i + 2])
                   for i in range(0, len(pairs) - 1, 2)]
    assert 60 * min(per_request) <= m["real_tokens"] <= 60 * max(per_request)
    singles = [sum(len(tok.encode(q, max_length=64).input_ids) for q, _ in pairs[i:i + 2])
               for i in range(0, len(pairs) - 1, 2)]
    assert m["real_tokens"] > 60 * max(singles)  # the questions alone could not make that many tokens


def test_csv_rows_match_the_json(srv, tmp_path):
    rc, out = _cli(srv, tmp_path, "run", "--scenario", "mix", "--classify-model", "lt-sentiment", "--qa-model",
                   "lt-qa", "--concurrency", "4", "--requests", "80", "--no-plots")
    assert rc == 0
    rows = _csv(tmp_path / "r.csv")
    assert list(rows[0]) == list(report.CSV_COLUMNS)
    assert [(r["kind"], r["model"]) for r in rows] == [("all", "lt-sentiment+lt-qa"), ("classify", "lt-sentiment"),
                                                       ("qa", "lt-qa")]
    for row, part in zip(rows, (out, out["by_kind"]["classify"], out["by_kind"]["qa"])):
        assert row["command"] == "run" and row["scenario"] == "mix" and row["mode"] == "closed"
        assert row["concurrency"] == "4" and row["rate"] == ""
        assert int(row["requests"]) == part["requests"] and int(row["successes"]) == part["successes"]
        assert float(row["throughput_rps"]) == part["throughput_rps"]
        assert float(row["duration_s"]) == out["duration_s"]
        for key in ("mean", "min", "p50", "p90", "p95", "p99", "p99.9", "max"):
            assert _num(row[f"{key}_ms"]) == part["latency_ms"][key]
    assert int(rows[1]["requests"]) + int(rows[2]["requests"]) == 80

    csv_path = tmp_path / "elsewhere" / "one.csv"
    rc, out = _cli(srv, tmp_path, "run", "--classify-model", "lt-broken", "--rate", "200", "--requests", "10",
                   "--no-plots", "--csv", str(csv_path))
    assert rc == 4
    (row,) = _csv(csv_path)
    assert (row["kind"], row["model"], row["mode"], row["rate"]) == ("classify", "lt-broken", "open", "200.0")
    assert row["errors"] == "10" and row["error_rate"] == "1.0" and row["p95_ms"] == ""  # no successes


def test_sweep_writes_one_csv_row_per_step(srv, tmp_path):
    rc, out = _cli(srv, tmp_path, "sweep", "--classify-model", "lt-sentiment", "--rates", "20,40", "--step-duration",
                   "0.5", "--slo-ms", "5000", "--no-plots")
    assert rc == 0
    rows = _csv(tmp_path / "r.csv")
    assert [float(r["rate"]) for r in rows] == [20.0, 40.0]
    for row, step in zip(rows, out["steps"]):
        assert int(row["requests"]) == step["requests"] and _num(row["p95_ms"]) == step["latency_ms"]["p95"]


def test_fail_if_thresholds_set_the_exit_code(srv, tmp_path, capsys):
    base = ("run", "--classify-model", "lt-sentiment", "--concurrency", "2", "--requests", "30", "--no-plots")
    rc, out = _cli(srv, tmp_path, *base, "--fail-if", "p99_ms>60000", "--fail-if", "error_rate>0.01")
    captured = capsys.readouterr()
    assert rc == 0 and out["successes"] == 30
    assert "fail-if p99_ms>60000: ok" in captured.out and "fail-if error_rate>0.01: ok" in captured.out
    assert "violated" not in captured.err

    rc, out = _cli(srv, tmp_path, *base, "--fail-if", "p50_ms>=0", "--fail-if", "throughput_rps<1e9",
                   "--fail-if", "errors>0")
    err = capsys.readouterr().err
    assert rc == cli.EXIT_THRESHOLD == 3 and out["successes"] == 30  # the report is written all the same
    assert f"threshold violated: p50_ms>=0 (p50_ms = {out['latency_ms']['p50']:g})" in err
    assert "threshold violated: throughput_rps<1e+09" in err
    assert "errors>0" not in err

    # subprocess: the process exit code itself
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-m", "relserve.loadtest", "run", "--target", srv.target, "--metrics-url",
                           "none", "--classify-model", "lt-sentiment", "--requests", "10", "--concurrency", "1",
                           "--no-progress", "--no-plots", "--out", str(tmp_path / "sub"), "--fail-if", "max_ms>=0"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 3 and "threshold violated: max_ms>=0" in proc.stderr, proc.stderr


def test_bad_fail_if_exits_2_listing_the_metrics(capsys):
    for expr in ("p98_ms>3", "p99_ms=>3", "p99_ms>fast"):
        with pytest.raises(SystemExit) as e:
            cli.main(["run", "--fail-if", expr])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "--fail-if" in err and "p95_ms" in err and "error_rate" in err and "throughput_rps" in err
