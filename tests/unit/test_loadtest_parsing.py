"""Load-test input parsing without a server: ``--fail-if`` expressions, ``--data`` files, the flat metric names
the CSV and thresholds share, and the text-pair scenario's request pool."""

from __future__ import annotations

import json

import pytest

from relserve.loadtest import report, thresholds
from relserve.loadtest.generator import Records
from relserve.loadtest.scenarios import (DataFileError, Scenario, load_requests, qa_pairs,
                                         question_sentence_pairs)


@pytest.mark.parametrize("expr,metric,op,value", [
    ("p99_ms>200", "p99_ms", ">", 200.0),
    (" error_rate >= 0.01 ", "error_rate", ">=", 0.01),
    ("throughput_rps<50", "throughput_rps", "<", 50.0),
    ("p99.9_ms<=1e3", "p99.9_ms", "<=", 1000.0),
    ("p95_ms>-1", "p95_ms", ">", -1.0),
])
def test_threshold_parse(expr, metric, op, value):
    assert thresholds.parse(expr) == thresholds.Threshold(metric, op, value)


@pytest.mark.parametrize("expr,why", [
    ("p99_ms", "is not METRIC OP NUMBER"),
    ("p99_ms=200", "is not METRIC OP NUMBER"),
    ("p99_ms>>200", "is not a finite number"),
    ("p99>200", "unknown metric 'p99'"),
    ("p99_ms>nan", "is not a finite number"),
    ("p99_ms>inf", "is not a finite number"),
    ("p99_ms>200ms", "is not a finite number"),
])
def test_threshold_parse_errors_list_the_metrics(expr, why):
    with pytest.raises(ValueError) as e:
        thresholds.parse(expr)
    msg = str(e.value)
    assert why in msg and f"metrics: {', '.join(report.METRICS)}" in msg


def test_threshold_boundaries_and_missing_values():
    m = {"p99_ms": 200.0, "error_rate": 0.0, "p50_ms": None}
    assert not thresholds.parse("p99_ms>200").violated_by(m)
    assert thresholds.parse("p99_ms>=200").violated_by(m)
    assert not thresholds.parse("p99_ms<200").violated_by(m)
    assert thresholds.parse("p99_ms<=200").violated_by(m)
    assert thresholds.parse("p50_ms>1").violated_by(m)  # no successes: a latency bound cannot be shown to hold
    checks = [thresholds.parse(x) for x in ("p99_ms>100", "error_rate>0.01", "p50_ms>1")]
    assert thresholds.violations(checks, m) == ["p99_ms>100 (p99_ms = 200)",
                                                "p50_ms>1 (p50_ms = n/a, no successful requests)"]


def test_flat_metrics_and_csv_share_the_names(tmp_path):
    rec = Records()
    for i in range(100):
        rec.add("classify", i * 0.01, (i + 1) * 0.001, "OK" if i % 4 else "UNAVAILABLE")
    rec.elapsed = 2.0
    s = report.summarize(rec)
    flat = report.flat_metrics(s)
    assert list(flat) == list(report.METRICS) == list(report.CSV_COLUMNS[len(report.CSV_ID_COLUMNS):])
    assert flat["requests"] == 100 and flat["errors"] == 25 and flat["error_rate"] == 0.25
    assert flat["throughput_rps"] == 37.5 and flat["completed_rps"] == 50.0
    assert flat["p95_ms"] == s["latency_ms"]["p95"] and flat["p50_ms"] <= flat["p95_ms"] <= flat["p99_ms"]
    kind = report.flat_metrics(s["by_kind"]["classify"], s["duration_s"])
    assert kind == flat
    path = report.write_csv([{"command": "run", "kind": "classify", **flat, "p95_ms": None}], tmp_path / "x.csv")
    header, line = path.read_text().splitlines()
    assert header.split(",") == list(report.CSV_COLUMNS)
    values = dict(zip(header.split(","), line.split(",")))
    assert values["p95_ms"] == "" and values["rate"] == "" and values["error_rate"] == "0.25"
    assert float(values["p99_ms"]) == flat["p99_ms"]


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_load_requests_reads_fields_and_ignores_others(tmp_path):
    f = _write(tmp_path / "d.jsonl", [json.dumps({"id": 1, "text": "a b", "label": "x"}), "", "   ",
                                       json.dumps({"text": "ü ö"}, ensure_ascii=False)])
    assert load_requests(f, "classify") == [{"text": "a b"}, {"text": "ü ö"}]
    f = _write(tmp_path / "p.jsonl", [json.dumps({"text": "a", "text_pair": "b"})])
    assert load_requests(f, "classify") == [{"text": "a", "text_pair": "b"}]
    assert load_requests(f, "classify-pair") == [{"text": "a", "text_pair": "b"}]
    assert load_requests(f, "translate") == [{"text": "a"}]
    f = _write(tmp_path / "q.jsonl", [json.dumps({"question": "q?", "context": "c."})])
    assert load_requests(f, "qa") == [{"question": "q?", "context": "c."}]


@pytest.mark.parametrize("lines,scenario,message", [
    (['{"text": "a"}', "{not json"], "classify", ":2: not JSON"),
    (['["text"]'], "classify", ":1: a JSON object is wanted, got list"),
    (['{"text": "a"}', '{"txt": "b"}'], "classify", ":2: field 'text' is missing (scenario classify needs text)"),
    (['{"text": "  "}'], "classify", ":1: field 'text' must be a non-blank string"),
    (['{"text": "a", "text_pair": 3}'], "classify", ":1: field 'text_pair' must be a non-blank string"),
    (['{"text": "a"}', '', '{"text": "b", "text_pair": "c"}'], "classify",
     ":3: has text_pair but line 1 has none; give text_pair on every line or on none"),
    (['{"text": "a"}'], "classify-pair", ":1: field 'text_pair' is missing"),
    (['{"question": "q"}'], "qa", ":1: field 'context' is missing (scenario qa needs question, context)"),
    (["", ""], "qa", ": no requests (the file is empty)"),
])
def test_load_requests_errors_name_file_and_line(tmp_path, lines, scenario, message):
    f = _write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataFileError) as e:
        load_requests(f, scenario)
    assert str(e.value).startswith(f"--data {f}") and message in str(e.value)


def test_load_requests_file_and_scenario_errors(tmp_path):
    with pytest.raises(DataFileError, match="No such file"):
        load_requests(tmp_path / "missing.jsonl", "classify")
    f = tmp_path / "latin1.jsonl"
    f.write_bytes('{"text": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(DataFileError, match="not UTF-8"):
        load_requests(f, "classify")
    for scenario in ("mix", "classify-mixed"):
        with pytest.raises(DataFileError, match=f"--data works with --scenario .*, not {scenario}"):
            load_requests(f, scenario)


def test_scenario_with_data_batches_rows_in_order():
    rows = [{"text": f"t{i}", "text_pair": f"p{i}"} for i in range(5)]
    sc = Scenario("classify", {"classify": "m"}, batch=2, data=rows)
    reqs = sc.texts("classify")
    assert [list(r.texts) for r in reqs] == [["t0", "t1"], ["t2", "t3"]]
    assert [list(r.text_pairs) for r in reqs] == [["p0", "p1"], ["p2", "p3"]]
    with pytest.raises(DataFileError, match="fewer than --batch 6"):
        Scenario("classify", {"classify": "m"}, batch=6, data=rows)
    qa = Scenario("qa", {"qa": "m"}, data=[{"question": "q", "context": "c"}]).texts("qa")
    assert [(r.question, r.context) for r in qa] == [("q", "c")]


def test_text_pair_scenario_pairs_each_question_with_sentences_of_its_paragraph():
    pairs = question_sentence_pairs()
    context_of = {q: c for q, c in qa_pairs()}
    assert len(pairs) > 3 * len(context_of)  # several sentences per paragraph
    for q, sent in pairs:
        assert sent in context_of[q] and sent == sent.strip() and len(sent) < len(context_of[q])
    sc = Scenario("classify-pair", {"classify": "nli"}, batch=3, seed=1)
    reqs = sc.texts("classify")
    assert len(reqs) == len(pairs) // 3
    for r in reqs:
        assert r.model == "nli" and len(r.texts) == len(r.text_pairs) == 3
    assert [(t, p) for r in reqs for t, p in zip(r.texts, r.text_pairs)] == pairs[:len(reqs) * 3]
