"""loadtest/retrying.py's gRPC call floor against a real ``relserve serve`` process (fake models), and the goodput
ceiling bench/hostile.py derives from it."""

import pytest

from fixtures.server import FakeServerProcess

from relserve.loadtest.retrying import call_floor


def test_call_floor_measures_server_and_client_cpu_per_call():
    with FakeServerProcess({"m": {}}, metrics_port=0) as srv:
        assert srv.metrics_url is not None
        floor = call_floor(srv.target, srv.metrics_url, clients=4, duration=0.5)
    assert floor["calls_per_s"] > 0
    # a health Check is real work on both sides, but far below a millisecond of CPU on any machine
    assert 1.0 < floor["server_us_per_call"] < 100_000
    assert 1.0 < floor["client_us_per_call"] < 100_000


def test_goodput_ceiling_is_the_cores_left_after_the_refusals():
    from relserve.loadtest.bench.hostile import goodput_ceiling

    # capacity used 1.5 server + 0.5 client cores (2.0 s of client CPU over a 4 s window)
    capacity = {"server": {"cpu_cores": 1.5}, "client_cpu_s": 2.0, "client_window_s": 4.0}
    assert goodput_ceiling(capacity, refusal_floor_cores=0.8, cores=2) == pytest.approx(0.6)
    assert goodput_ceiling(capacity, refusal_floor_cores=0.0, cores=4) == 1.0  # capped: cores were not the limit
    assert goodput_ceiling(capacity, refusal_floor_cores=3.0, cores=2) == 0.0
    assert goodput_ceiling({"client_cpu_s": 1.0, "client_window_s": 1.0}, 0.5, 2) is None


def test_switch_interval_compares_medians_over_rounds_side_by_side(monkeypatch, capsys):
    import argparse

    from relserve.loadtest.bench import hostile as bench_hostile

    calls = []

    def fake_overload(args, server_flags=(), texts_options=(1, 4), floor=True):
        us = float(server_flags[server_flags.index("--gil-switch-interval-us") + 1])
        calls.append((us, texts_options, floor))
        n = sum(1 for c in calls if c[0] == us)  # the round: figures move between rounds, medians do not
        fast = us < 100
        return {"runs": {
            "capacity-1": {"goodput_rps": (60.0 if fast else 40.0) + n, "server": {"mean_batch_s": 0.07}},
            "overload-1-pushback": {"goodput_rps": 50.0 if fast else 40.0, "server": {}},
            "overload-1-fixed50ms": {"goodput_rps": (36.0 if fast else 10.0) - n, "server": {"mean_batch_s": 0.3}},
        }}

    monkeypatch.setattr(bench_hostile, "overload", fake_overload)
    args = argparse.Namespace(switch_intervals=[5000.0, 10.0], rounds=3, model_option=[])
    out = bench_hostile.switch_interval(args)
    assert [c[0] for c in calls] == [5000.0, 10.0] * 3  # in turn, round by round
    assert all(c[1] == (1,) and c[2] is False for c in calls)
    assert out["medians"]["5000 us"]["capacity-1 req/s"] == 42.0  # 41, 42, 43
    assert out["medians"]["10 us"]["overload-1-fixed50ms req/s"] == 34.0  # 35, 34, 33
    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if line.startswith("overload-1-fixed50ms req/s"))
    assert row.split()[-3:] == ["8.00", "34.00", "4.25"]  # 5000 us, 10 us, ratio 10/5000
    assert "10 us                1 text(s): fixed-50ms goodput / capacity = 0.55" in printed  # 34 / 62


def test_worker_process_scenario_runs_both_modes_with_the_model_option(monkeypatch, capsys):
    import argparse

    from relserve.loadtest.bench import hostile as bench_hostile

    seen = []

    def fake_overload(args, server_flags=(), texts_options=(1, 4), floor=True):
        seen.append((tuple(args.model_option), texts_options))
        worker = "worker_process=true" in args.model_option
        runs = {}
        for t in texts_options:
            runs[f"capacity-{t}"] = {"goodput_rps": 10.0 * t, "server": {"cpu_cores": 1.5 if worker else 1.0}}
            runs[f"overload-{t}-fixed50ms"] = {"goodput_rps": (9.0 if worker else 3.0) * t, "server": {}}
        return {"runs": runs}

    monkeypatch.setattr(bench_hostile, "overload", fake_overload)
    out = bench_hostile.worker_process(argparse.Namespace(rounds=1, model_option=["max_queue_size=8"]))
    assert seen == [(("max_queue_size=8", "worker_process=false"), (1, 4)),
                    (("max_queue_size=8", "worker_process=true"), (1, 4))]
    assert out["medians"]["worker"]["overload-4-fixed50ms req/s"] == 36.0
    printed = capsys.readouterr().out
    assert "worker               4 text(s): fixed-50ms goodput / capacity = 0.90" in printed
    assert "in-process           1 text(s): fixed-50ms goodput / capacity = 0.30" in printed


def _fake_run(spec, processes=4, metrics_url=None):
    return {"clients": spec.clients, "texts_per_request": spec.texts_per_request, "goodput_rps": 10.0,
            "rejections_per_s": 0.0, "rejected": 0, "other_errors": {}, "latency_s": {"p50": 0.1, "p99": 0.2},
            "client_rejection_latency_s": {"p50": None, "p99": None}, "mean_attempts_per_ok": 1.0,
            "pushback_s": {"p50": None, "max": None, "replies_with_trailer": 0},
            "client_cpu_s": 1.0, "client_window_s": 2.0,
            "server": {"cpu_cores": 1.0, "mean_batch_size": 4.0, "mean_batch_s": 0.05}}


@pytest.mark.parametrize("queue_requests, want", [(None, {1: 8, 4: 8}), (8, {1: 8, 4: 32})])
def test_overload_queue_holds_units_or_a_number_of_requests(monkeypatch, capsys, queue_requests, want):
    """--queue-requests N: one overloaded server per queue size, max_queue_size N x texts per request; by default
    8 units whatever the request size (the issue's repro)."""
    import argparse

    from relserve.loadtest import retrying
    from relserve.loadtest.bench import hostile as bench_hostile

    started = []

    class Server:
        def __init__(self, argv, env=None):
            started.append(argv[1])
            self.target, self.metrics_url = "127.0.0.1:1", "http://127.0.0.1:2/metrics"

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(bench_hostile, "ServerProcess", Server)
    monkeypatch.setattr(retrying, "run_clients", _fake_run)
    monkeypatch.setattr(retrying, "call_floor", lambda *a, **k: {"server_us_per_call": 300.0,
                                                                  "client_us_per_call": 200.0, "calls_per_s": 1.0})
    args = argparse.Namespace(quick=True, overload_duration=1.0, threads=1, model_option=[], client_processes=1,
                              queue_requests=queue_requests)
    out = bench_hostile.overload(args)
    assert out["queue_size"] == want
    overloaded = [a for a in started if "max_queue_size" in a]
    assert sorted(int(a.rsplit("max_queue_size=", 1)[1]) for a in overloaded) == sorted(set(want.values()))
    assert set(out["runs"]) == {"capacity-1", "capacity-4", "overload-1-pushback", "overload-1-fixed50ms",
                                "overload-4-pushback", "overload-4-fixed50ms"}
    assert out["call_floor"]["server_us_per_call"] == 300.0
    assert "can be at most" in capsys.readouterr().out
