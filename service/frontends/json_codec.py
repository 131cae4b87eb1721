"""KServe v2 REST JSON <-> Open Inference Protocol tensors (:mod:`.oip_codec`), and the JSON object of any
request body. The HTTP routes (``http``) use it; every check names the field and where it is. No torch.

An inference request is ``{"id"?, "parameters"?, "inputs": [{"name", "shape", "datatype", "data",
"parameters"?}], "outputs"?: [{"name", "parameters"?}]}``; ``data`` flat or nested exactly as ``shape``,
row-major, BYTES as JSON strings; tensor-level parameters follow
:func:`.oip_codec.check_tensor_parameters` (as the gRPC frontend's). Every string a reply or status
message may echo (``id``, tensor names, datatypes) must be valid UTF-8: a JSON ``"\\ud800"`` (a lone
surrogate) there is INVALID_ARGUMENT before inference.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import InvalidArgument, shown
from . import oip_codec as oip


def loads(raw: bytes) -> dict:
    """The JSON object in a request body.

    Raises:
        InvalidArgument: not UTF-8 JSON, or not an object (the message says which).
    """
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"the request body is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except ValueError as exc:
        raise InvalidArgument(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidArgument("the request body is JSON nested too deeply") from None
    if not isinstance(body, dict):
        raise InvalidArgument(f"the request body must be a JSON object, got {oip.describe(body)}")
    return body


_REQUEST_FIELDS = ("id", "parameters", "inputs", "outputs")
_INPUT_FIELDS = ("name", "shape", "datatype", "parameters", "data")
_OUTPUT_FIELDS = ("name", "parameters")


def _object(value: Any, where: str, fields: tuple[str, ...]) -> dict:
    """``value`` if it is a JSON object with no field outside ``fields``.

    Raises:
        InvalidArgument: not an object, or an unknown field (naming ``where`` and the known fields).
    """
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where} must be a JSON object {{{', '.join(fields)}}}, got {oip.describe(value)}")
    unknown = sorted(set(value) - set(fields))
    if unknown:
        raise InvalidArgument(f"unknown field(s) {unknown} in {where}; known: {', '.join(fields)}")
    return value


def _parameters_of(obj: dict, where: str) -> dict:
    """``obj["parameters"]``: a JSON object, or {} when absent or null."""
    parameters = obj.get("parameters")
    if parameters is None:
        return {}
    if not isinstance(parameters, dict):
        raise InvalidArgument(f"{where}: 'parameters' must be a JSON object, got {oip.describe(parameters)}")
    return parameters


def _flatten(data: Any, shape: list[int], where: str) -> list:
    """Row-major elements of a JSON tensor's ``data``: a flat array (its length is checked against the shape
    by :mod:`.oip_codec`), or arrays nested exactly as ``shape`` says (the v2 REST spec's two forms).

    Raises:
        InvalidArgument: not an array, or nested otherwise than ``shape`` (names the element and dimension).
    """
    if not isinstance(data, list):
        raise InvalidArgument(f"{where}: 'data' must be a JSON array, got {oip.describe(data)}")
    if not any(isinstance(v, list) for v in data):
        return data
    out: list = []
    hint = f"send the data flat or nested exactly as 'shape' {shape}"

    def walk(value: Any, depth: int, path: str) -> None:
        if depth == len(shape):
            if isinstance(value, list):
                raise InvalidArgument(f"{where}: data{path} is a list but 'shape' {shape} has {len(shape)} "
                                      f"dimension(s); {hint}")
            out.append(value)
            return
        if not isinstance(value, list) or len(value) != shape[depth]:
            got = f"{len(value)} elements" if isinstance(value, list) else oip.describe(value)
            raise InvalidArgument(f"{where}: data{path} must be a list of length {shape[depth]} (dimension "
                                  f"{depth} of 'shape' {shape}), got {got}; {hint}")
        for i, v in enumerate(value):
            walk(v, depth + 1, f"{path}[{i}]")

    walk(data, 0, "")
    return out


def parse_infer(body: dict) -> tuple[list[oip.Tensor], dict, list[str]]:
    """The v2 REST inference request's inputs, parameters and requested output names; tensor-level
    parameters follow :func:`.oip_codec.check_tensor_parameters` (as the gRPC frontend's).

    Raises:
        InvalidArgument: an unknown, missing or mis-typed field (naming it and where it is).
    """
    _object(body, "the inference request", _REQUEST_FIELDS)
    if body.get("id") is not None and not isinstance(body["id"], str):
        raise InvalidArgument(f"'id' must be a string, got {oip.describe(body['id'])}")
    if body.get("id") is not None:
        check_text(body["id"], "'id'")
    parameters = _parameters_of(body, "the inference request")
    raw_inputs = body.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidArgument(f"'inputs' must be a non-empty JSON array of tensors {{name, shape, datatype, data}}, "
                              f"got {'an empty list' if raw_inputs == [] else oip.describe(raw_inputs)}")
    inputs = []
    for i, t in enumerate(raw_inputs):
        where = f"inputs[{i}]"
        _object(t, where, _INPUT_FIELDS)
        for key, kind, words in (("name", str, "a string"), ("datatype", str, "a string"), ("shape", list, "a list")):
            if key not in t:
                raise InvalidArgument(f"{where}: {key!r} is missing")
            if not isinstance(t[key], kind):
                raise InvalidArgument(f"{where}: {key!r} must be {words}, got {oip.describe(t[key])}")
            if kind is str:
                check_text(t[key], f"{where}: {key!r}")
        where = f"inputs[{i}] ({shown(t['name'])})"
        if "data" not in t:
            raise InvalidArgument(f"{where}: 'data' is missing")
        shape = t["shape"]
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise InvalidArgument(f"{where}: 'shape' must be a list of non-negative integers, got {shown(str(shape))}")
        oip.check_tensor_parameters("input", t["name"], _parameters_of(t, where))
        try:
            data = _flatten(t["data"], shape, where)
        except RecursionError:
            raise InvalidArgument(f"{where}: 'data' is nested too deeply for 'shape' {shape}") from None
        inputs.append(oip.Tensor(t["name"], t["datatype"], tuple(shape), data))
    raw_outputs = body.get("outputs")
    if raw_outputs is None:
        raw_outputs = []
    if not isinstance(raw_outputs, list):
        raise InvalidArgument(f"'outputs' must be a JSON array of {{name, parameters}}, got "
                              f"{oip.describe(raw_outputs)}")
    names = []
    for i, o in enumerate(raw_outputs):
        where = f"outputs[{i}]"
        _object(o, where, _OUTPUT_FIELDS)
        if not isinstance(o.get("name"), str):
            raise InvalidArgument(f"{where}: 'name' must be a string, got {oip.describe(o.get('name'))}")
        check_text(o["name"], f"{where}: 'name'")
        oip.check_tensor_parameters("output", o["name"], _parameters_of(o, f"{where} ({shown(o['name'])})"))
        names.append(o["name"])
    return inputs, parameters, names


def check_text(value: str, where: str) -> None:
    """Refuse a string that UTF-8 cannot carry: JSON's ``"\ud800"`` escape parses to a lone surrogate, which
    would reach the reply (the echoed ``id``) or a status message and cannot be encoded there.

    Raises:
        InvalidArgument: ``value`` holds an unpaired surrogate (naming ``where`` and the character index).
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"{where} is not valid UTF-8 text (an unpaired surrogate at character "
                              f"{exc.start})") from None


def tensor_json(t: oip.Tensor) -> dict:
    """An output tensor as the v2 REST reply's JSON object (BYTES elements as strings)."""
    data = [v.decode("utf-8", "replace") if isinstance(v, (bytes, bytearray)) else v for v in t.data]
    return {"name": t.name, "datatype": t.datatype, "shape": list(t.shape), "data": data}
