"""Fuzzing the KServe v2 REST inference route (``POST /v2/models/{name}[/versions/1]/infer``,
service/frontends/http_v2.py with json_codec.py's binary tensor data) with hypothesis: requests that carry
Triton's binary tensor data extension with declared lengths that exceed the body, are negative, overlap the next
input, leave bytes over or are huge; ``Inference-Header-Content-Length`` values that are not numbers, negative,
zero, cut the JSON or run past the body; malformed JSON; gzip bodies that decode past the server's
``max_receive_message_length``. Every one is a 4xx with the v2 error body ``{"error", "code"}`` (never a 5xx
nor a dropped connection), and the server answers a well-formed binary request afterwards.

Each generated request has at least one fault by construction (the ``fault`` drawn first), so a 2xx is a
failure too. The server serves a fake classifier (fixtures/fake_serving.py): no request here reaches a model,
and the route's parsing is the same for every task. Examples are derandomized (the same cases on every run).
"""

from __future__ import annotations

import gzip
import json
import struct
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fixtures.fake_serving import runner as fake_runner
from fixtures.fake_serving import server_config
from fixtures.server import Running

HEADER = "Inference-Header-Content-Length"
LIMIT = 16 * 1024  # the server's max_receive_message_length here
INPUT_NAMES = ("text", "text_pair")


@pytest.fixture(scope="module")
def srv():
    s = Running(server_config(http_port=0, metrics_port=None, max_receive_message_length=LIMIT),
                [fake_runner("cls")])
    s.wait_serving(timeout=30)
    s.base = f"http://127.0.0.1:{s.server.http_port}"
    yield s
    s.close()


def _post(srv, path: str, body: bytes, headers: dict) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(srv.base + path, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def _prefixed(values: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


def _binary_request(chunks: list[bytes], sizes: list, counts: list[int], *,
                    extra: dict | None = None) -> tuple[dict, bytes]:
    """The JSON header (inputs ``text``, ``text_pair`` ... with ``counts`` elements each and the declared
    ``binary_data_size``) and the binary data after it."""
    inputs = [{"name": INPUT_NAMES[i % 2] + ("" if i < 2 else str(i)), "shape": [n], "datatype": "BYTES",
               "parameters": {"binary_data_size": size}} for i, (size, n) in enumerate(zip(sizes, counts))]
    return {"inputs": inputs, **(extra or {})}, b"".join(chunks)


WORD = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12).filter(
    str.strip).map(str.encode)
HUGE = st.one_of(st.integers(2 ** 31, 2 ** 63 - 1), st.integers(2 ** 63, 2 ** 80), st.just(10 ** 30))
BAD_HEADER = st.one_of(st.integers(-(2 ** 63), -1).map(str), HUGE.map(str), st.just("0"),
                       st.text(alphabet="0123456789 +-_.xe", min_size=0, max_size=24).filter(
                           lambda s: not s.strip().isdigit()),
                       st.floats(allow_nan=True).map(str))
NOT_JSON = st.one_of(st.binary(min_size=1, max_size=64),
                     st.just(b'{"inputs": [}'), st.just(b'{"inputs": '), st.just(b"[1, 2"), st.just(b"\xff\xfe{}"),
                     st.just(b'{"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["\\ud800"]}]}'),
                     st.just(b'{"a": 1} trailing'), st.just(b"NaN"))


FAULTS = ("header_past_body", "header_bad", "header_cuts_json", "size_negative", "size_huge", "size_past_body",
          "bytes_left_over", "sizes_overlap", "element_overlaps_next", "size_not_integer", "size_without_header", "malformed_json",
          "malformed_json_with_header", "gzip_over_limit")


@st.composite
def binary_requests(draw, faults=FAULTS) -> tuple[str, bytes, dict]:
    """(fault, body, headers): a v2 inference request of one or two binary inputs (``text``, ``text_pair``)
    with the drawn fault; ``"none"``: a well-formed one."""
    fault = draw(st.sampled_from(faults))
    n = draw(st.integers(1, 3))
    words = [draw(st.lists(WORD, min_size=n, max_size=n)) for _ in range(draw(st.integers(1, 2)))]
    chunks = [_prefixed(w) for w in words]
    sizes: list = [len(c) for c in chunks]
    extra = draw(st.fixed_dictionaries({}, optional={
        "id": st.text(max_size=8), "model_name": st.just("cls"), "model_version": st.just("1"),
        "parameters": st.fixed_dictionaries({}, optional={"binary_data_output": st.booleans()})}))
    i = draw(st.integers(0, len(chunks) - 1))
    headers = {"Content-Type": draw(st.sampled_from(["application/octet-stream", "application/json"]))}
    header_value = None  # None: the exact JSON length

    if fault == "size_negative":
        sizes[i] = draw(st.integers(-(2 ** 63), -1))
    elif fault == "size_huge":
        sizes[i] = draw(HUGE)
    elif fault == "size_past_body":
        sizes[-1] += draw(st.integers(1, 64))  # the last input's bytes run past the end
    elif fault == "sizes_overlap" and len(sizes) == 2:
        # the sizes still add up to the body, but the first input claims the start of the second's bytes
        shift = draw(st.integers(1, sizes[1]))
        sizes[0], sizes[1] = sizes[0] + shift, sizes[1] - shift
    elif fault in ("bytes_left_over", "sizes_overlap"):
        chunks[-1] += draw(st.binary(min_size=1, max_size=16))
    elif fault == "element_overlaps_next":
        # an element's length prefix reaches into the next input's bytes (or past the body for the last one)
        inside = chunks[i][4:]
        chunks[i] = struct.pack("<I", len(inside) + draw(st.integers(1, 2 ** 32 - 1 - len(inside)))) + inside
    elif fault == "size_not_integer":
        sizes[i] = draw(st.one_of(st.floats(allow_nan=False), st.text(max_size=6), st.booleans(), st.none(),
                                  st.lists(st.integers(), max_size=2)))
    obj, binary = _binary_request(chunks, sizes, [len(w) for w in words], extra=extra)
    head = json.dumps(obj).encode()

    if fault == "header_past_body":
        header_value = str(len(head) + len(binary) + draw(st.integers(1, 2 ** 40)))
    elif fault == "header_bad":
        header_value = draw(BAD_HEADER)
    elif fault == "header_cuts_json":
        header_value = str(draw(st.integers(1, len(head) - 1)))
    elif fault == "size_without_header":
        headers[HEADER] = None
    elif fault in ("malformed_json", "malformed_json_with_header"):
        head, binary = draw(NOT_JSON), b""
    body = head + binary

    if fault == "gzip_over_limit":
        # a valid binary request whose gzip body decodes past max_receive_message_length
        pad = [_prefixed([b"x" * (LIMIT + draw(st.integers(1, 4 * LIMIT)))])]
        obj, binary = _binary_request(pad, [len(pad[0])], [1])
        head = json.dumps(obj).encode()
        body = gzip.compress(head + binary)
        headers["Content-Encoding"] = "gzip"
    if fault == "malformed_json":
        headers.pop(HEADER, None)
    elif headers.get(HEADER, "") is None:
        del headers[HEADER]
    else:
        headers[HEADER] = header_value if header_value is not None else str(len(head))
    return fault, body, headers


def test_faulty_binary_and_json_requests_are_4xx_and_the_server_keeps_answering(srv):
    seen: set[str] = set()

    @settings(max_examples=300, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(binary_requests(), st.sampled_from(["/v2/models/cls/infer", "/v2/models/cls/versions/1/infer"]))
    def check(request, path):
        fault, body, headers = request
        seen.add(fault)
        status, _, payload = _post(srv, path, body, headers)
        assert 400 <= status < 500, (fault, status, headers, body[:200], payload[:300])
        error = json.loads(payload)
        assert isinstance(error.get("error"), str) and error.get("code"), (fault, error)

    check()
    assert seen == set(FAULTS)  # every fault was drawn
    # alive and answering: a well-formed binary request (text and text_pair) right after
    obj, binary = _binary_request([_prefixed([b"good"]), _prefixed([b"fine"])], [8, 8], [1, 1])
    head = json.dumps(obj).encode()
    status, headers, payload = _post(srv, "/v2/models/cls/infer", head + binary,
                                     {HEADER: str(len(head)), "Content-Type": "application/octet-stream"})
    assert status == 200, payload[:300]
    reply = json.loads(payload)
    assert reply["model_name"] == "cls"
    assert {o["name"] for o in reply["outputs"]} == {"probabilities", "label"}


def test_the_same_requests_without_a_fault_are_answered(srv):
    """The generator's control: without the fault its requests are well-formed (so the 4xx above come from the
    faults, and the test above can fail)."""
    @settings(max_examples=40, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(binary_requests(faults=("none",)), st.sampled_from(["/v2/models/cls/infer",
                                                               "/v2/models/cls/versions/1/infer"]))
    def check(request, path):
        _, body, headers = request
        status, _, payload = _post(srv, path, body, headers)
        assert status == 200, (headers, body[:200], payload[:300])

    check()
