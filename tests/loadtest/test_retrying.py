"""loadtest/retrying.py's gRPC call floor against a real ``relserve serve`` process (fake models), and the goodput
ceiling bench_hostile derives from it."""

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
    from relserve.loadtest.bench_hostile import goodput_ceiling

    # capacity used 1.5 server + 0.5 client cores (2.0 s of client CPU over a 4 s window)
    capacity = {"server": {"cpu_cores": 1.5}, "client_cpu_s": 2.0, "client_window_s": 4.0}
    assert goodput_ceiling(capacity, refusal_floor_cores=0.8, cores=2) == pytest.approx(0.6)
    assert goodput_ceiling(capacity, refusal_floor_cores=0.0, cores=4) == 1.0  # capped: cores were not the limit
    assert goodput_ceiling(capacity, refusal_floor_cores=3.0, cores=2) == 0.0
    assert goodput_ceiling({"client_cpu_s": 1.0, "client_window_s": 1.0}, 0.5, 2) is None
