"""loadtest/retrying.py's gRPC call floor against a real ``relserve serve`` process (fake models)."""

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
