"""KServe v2 REST JSON <-> Open Inference Protocol tensors (:mod:`.oip_codec`), and the JSON object of any
request body. The HTTP routes (``http``) use it; every check names the field and where it is. No torch.

An inference request is ``{"id"?, "model_name"?, "model_version"?, "parameters"?, "inputs": [{"name",
"shape", "datatype", "data", "parameters"?}], "outputs"?: [{"name", "parameters"?}]}``; ``data`` flat or
nested exactly as ``shape``, row-major, BYTES as JSON strings; tensor-level parameters follow
:func:`.oip_codec.check_tensor_parameters` (as the gRPC frontend's). ``model_name`` / ``model_version``
(clients such as KServe's put them in every body) must agree with the URL's. Every string a reply or status
message may echo (``id``, tensor names, datatypes) must be valid UTF-8: a JSON ``"\\ud800"`` (a lone
surrogate) there is INVALID_ARGUMENT before inference.

Binary tensor data (Triton's extension, :func:`split_body`): with the ``Inference-Header-Content-Length``
header the body is the JSON object of that many bytes, then each binary input's ``binary_data_size`` bytes
in the order of ``inputs``, exactly to the body's end; replies put the binary outputs (an output's
``binary_data`` true, or the request's ``binary_data_output``) after the JSON in the same way
(:func:`encode_reply`).
"""

from __future__ import annotations

import json
import json.decoder
import json.scanner
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..errors import InvalidArgument, shown
from ..tasks.limits import check_text_count
from . import oip_codec as oip


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """A JSON object's members as a dict (``json.loads``'s ``object_pairs_hook``), refusing a key given twice:
    json.loads would keep the last one silently, and which one a client meant is unknowable.

    Raises:
        InvalidArgument: naming the repeated key.
    """
    obj = dict(pairs)
    if len(obj) < len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise InvalidArgument(f"duplicate key {shown(key)} in a JSON object of the request body; each key "
                                      f"may appear once")
            seen.add(key)
    return obj


def loads(raw: bytes) -> dict:
    """The JSON object in a request body.

    Raises:
        InvalidArgument: not UTF-8 JSON, not an object, or an object with a key given twice (the message says
            which).
    """
    try:
        body = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"the request body is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except ValueError as exc:
        raise InvalidArgument(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidArgument("the request body is JSON nested too deeply") from None
    if not isinstance(body, dict):
        raise InvalidArgument(f"the request body must be a JSON object, got {oip.describe(body)}")
    return body


class CountRefused(InvalidArgument):
    """A request body refused by :func:`check_counts` on its arrays' lengths, before any conversion: the
    INVALID_ARGUMENT the task's own validation gives, with the ``model`` it was counted for."""

    def __init__(self, message: str, model: str) -> None:
        super().__init__(message)
        self.model = model


def check_counts(body: dict, fields: Sequence[Sequence[str]], model: str, limit: int | None) -> None:
    """Count the arrays of a parsed request body against ``limit`` (the model's ``max_request_texts``) before
    protobuf's ``ParseDict`` or any other conversion copies them, so a refused body costs its ``json.loads``
    only (a million one-character texts: one list of a million strings, where the mapping builds a message
    of them first). The messages are the task validation's (:func:`.limits.check_text_count`; one pair per text).

    Args:
        body: the JSON object.
        fields: per array, the names it may have (protobuf's JSON mapping takes ``textPairs`` and
            ``text_pairs``); the first array holds the texts, each later one is at most one entry per text.
        model: the model the body names (for the message).
        limit: the most texts (None: no limit).

    Raises:
        CountRefused: the texts or a later array are over ``limit`` (INVALID_ARGUMENT naming the field).
    """
    if limit is None:
        return
    lengths = []
    for names in fields:
        value = next((body[n] for n in names if n in body), None)
        lengths.append(len(value) if isinstance(value, list) else 0)
    texts = lengths[0] if lengths else 0
    if texts > limit:
        try:
            check_text_count(model, texts, limit)
        except InvalidArgument as exc:
            raise CountRefused(str(exc), model) from None
    for names, n in zip(fields[1:], lengths[1:]):
        if n > limit:  # and so more than one per text
            if not texts:
                raise CountRefused(f"{fields[0][-1]} is empty; send at least one text", model)
            raise CountRefused(f"{names[-1]} has {n} entries but {fields[0][-1]} has {texts}; send one pair per "
                               f"text or none", model)


_WHITESPACE = re.compile(r"[ \t\n\r]*")
# the C scanner of json.loads, for one value at a time (the counted arrays' elements, the other members)
_scan_once = json.scanner.make_scanner(json.JSONDecoder(object_pairs_hook=_unique_keys))


def count_top_arrays(raw: bytes, caps: Mapping[str, int]) -> tuple[str, str] | None:
    """Count the elements of the top-level arrays ``caps`` names in the JSON object ``raw`` without parsing them
    all: ``(member name, the body's "model" string so far)`` as soon as one has more elements than its cap; each
    element is scanned alone and dropped, so a body of a million texts costs ``cap`` scans, not a list of a
    million strings. None when none is over its cap, and also when ``raw`` is not a plain UTF-8 JSON object
    (:func:`loads` then says what is wrong). The other members are scanned whole, as :func:`loads` would.
    """
    try:
        text = raw.decode("utf-8")
        pos = _WHITESPACE.match(text, 0).end()
        if text[pos] != "{":
            return None
        pos = _WHITESPACE.match(text, pos + 1).end()
        model = ""
        while text[pos] == '"':
            key, pos = json.decoder.scanstring(text, pos + 1)
            pos = _WHITESPACE.match(text, pos).end()
            if text[pos] != ":":
                return None
            pos = _WHITESPACE.match(text, pos + 1).end()
            if key in caps and text[pos] == "[":
                count, cap = 0, caps[key]
                pos = _WHITESPACE.match(text, pos + 1).end()
                while text[pos] != "]":
                    _element, pos = _scan_once(text, pos)
                    count += 1
                    if count > cap:
                        return key, model
                    pos = _WHITESPACE.match(text, pos).end()
                    if text[pos] == ",":
                        pos = _WHITESPACE.match(text, pos + 1).end()
                    elif text[pos] != "]":
                        return None
                pos += 1
            else:
                value, pos = _scan_once(text, pos)
                if key == "model" and isinstance(value, str):
                    model = value
            pos = _WHITESPACE.match(text, pos).end()
            if text[pos] != ",":
                return None
            pos = _WHITESPACE.match(text, pos + 1).end()
    except (ValueError, IndexError, StopIteration, RecursionError):  # not plain JSON: the parser's call
        return None
    return None


INFERENCE_HEADER = "Inference-Header-Content-Length"  # bytes of JSON before the binary tensor data
_REQUEST_FIELDS = ("id", "model_name", "model_version", "parameters", "inputs", "outputs")
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


@dataclass
class InferRequest:
    """A parsed v2 REST inference request: its input tensors, request parameters (without
    ``binary_data_output``), requested output names, and which outputs go back as binary data."""

    inputs: list[oip.Tensor]
    parameters: dict
    outputs: list[str]
    binary_default: bool = False  # the request's binary_data_output
    binary: dict[str, bool] = field(default_factory=dict)  # output name -> its binary_data, where sent

    def binary_output(self, name: str) -> bool:
        """Whether output ``name`` is answered as binary data (its ``binary_data``, else the default)."""
        return self.binary.get(name, self.binary_default)


def split_body(raw: bytes, header: str | None) -> tuple[bytes, memoryview | None]:
    """The JSON part of a request body and its binary tensor data: ``header`` is the request's
    ``Inference-Header-Content-Length`` (None: the whole body is JSON, no binary data).

    Raises:
        InvalidArgument: the header is not a non-negative decimal integer, or is 0 (a raw binary request
            without a JSON header, which no model here qualifies for: each takes named BYTES tensors), or
            is more than the body's length.
    """
    if header is None:
        return raw, None
    if not re.fullmatch(r"[0-9]{1,19}", header.strip()):
        raise InvalidArgument(f"header {INFERENCE_HEADER} must be the byte length of the JSON inference header "
                              f"at the start of the body (a non-negative integer), got {shown(header[:40])}")
    length = int(header)
    if length == 0:
        raise InvalidArgument(f"header {INFERENCE_HEADER} is 0 (a raw binary request without a JSON inference "
                              f"header), which is not supported; send the JSON inference header with each "
                              f"input's binary_data_size before the binary data")
    if length > len(raw):
        raise InvalidArgument(f"header {INFERENCE_HEADER} is {length} but the request body has only {len(raw)} "
                              f"bytes")
    view = memoryview(raw)
    return bytes(view[:length]), view[length:]


def _model_fields(body: dict, model: str, version: str, serving: str) -> None:
    """``model_name`` / ``model_version`` in the body must agree with the URL's ``model`` / ``version``
    (a URL without a version names the version ``serving`` the model, and so does an empty ``model_version``).

    Raises:
        InvalidArgument: not a string, or another value than the URL's (names both).
    """
    url_version = version or serving
    for key, url_value in (("model_name", model), ("model_version", url_version)):
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise InvalidArgument(f"{key!r} must be a string, got {oip.describe(value)}")
        check_text(value, f"{key!r}")
        if value != url_value and not (key == "model_version" and value == "" and not version):
            raise InvalidArgument(f"the body's {key} {shown(value)} differs from the URL's {shown(url_value)}; "
                                  f"leave it out or send the same value")


def parse_infer(body: dict, binary: memoryview | None = None, *, model: str = "", version: str = "",
                limit: int | None = None, serving: str = oip.MODEL_VERSION) -> InferRequest:
    """The v2 REST inference request's inputs, parameters and requested outputs; tensor-level parameters
    follow :func:`.oip_codec.check_tensor_parameters` (as the gRPC frontend's).

    Args:
        body: the JSON object.
        binary: the bytes after the JSON (:func:`split_body`), or None without the binary header.
        model, version: the URL's model and version (``body``'s ``model_name`` / ``model_version`` must agree).
        serving: the version serving ``model`` now (what a URL without a version names).
        limit: the most elements one input may hold (:func:`.oip_codec.max_elements`), checked before the
            elements are copied.

    Raises:
        InvalidArgument: an unknown, missing or mis-typed field (naming it and where it is), binary data
            whose declared sizes do not add up to the bytes after the JSON (naming the input and the sizes),
            or too many elements.
    """
    _object(body, "the inference request", _REQUEST_FIELDS)
    if body.get("id") is not None and not isinstance(body["id"], str):
        raise InvalidArgument(f"'id' must be a string, got {oip.describe(body['id'])}")
    if body.get("id") is not None:
        check_text(body["id"], "'id'")
    _model_fields(body, model, version, serving)
    parameters = dict(_parameters_of(body, "the inference request"))
    binary_default = oip.binary_output_default(parameters)
    raw_inputs = body.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise InvalidArgument(f"'inputs' must be a non-empty JSON array of tensors {{name, shape, datatype, data}}, "
                              f"got {'an empty list' if raw_inputs == [] else oip.describe(raw_inputs)}")
    inputs = []
    offset = 0  # into binary
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
        declared = t.get("parameters")
        # binary data instead of 'data' (without the header, the parameter check below says what is missing)
        if "data" not in t and not (isinstance(declared, dict) and oip.BINARY_DATA_SIZE in declared):
            raise InvalidArgument(f"{where}: 'data' is missing")
        shape = t["shape"]
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise InvalidArgument(f"{where}: 'shape' must be a list of non-negative integers, got {shown(str(shape))}")
        tensor_parameters = dict(_parameters_of(t, where))
        size = oip.binary_data_size(t["name"], tensor_parameters) if binary is not None else None
        oip.check_tensor_parameters("input", t["name"], tensor_parameters)
        if size is not None:
            if "data" in t:
                raise InvalidArgument(f"{where} has both 'data' and binary data (binary_data_size {size}); send one")
            if size > len(binary) - offset:
                raise InvalidArgument(f"{where}: binary_data_size {size} runs past the end of the body: "
                                      f"{len(binary) - offset} bytes of binary data are left at byte {offset} "
                                      f"after the JSON header")
            chunk = binary[offset:offset + size]
            offset += size
            # other datatypes stay undecoded: oip_codec refuses them, naming the input
            data = oip.split_bytes(t["name"], chunk, model, limit) if t["datatype"] == oip.BYTES else []
        else:
            if isinstance(t["data"], list):
                oip.check_element_count(model, len(t["data"]), limit)
            try:
                data = _flatten(t["data"], shape, where)
            except RecursionError:
                raise InvalidArgument(f"{where}: 'data' is nested too deeply for 'shape' {shape}") from None
        inputs.append(oip.Tensor(t["name"], t["datatype"], tuple(shape), data))
    if binary is not None and offset != len(binary):
        raise InvalidArgument(f"the body has {len(binary) - offset} bytes after the binary data of the inputs "
                              f"(their binary_data_size add up to {offset} of the {len(binary)} bytes after the "
                              f"JSON header); send exactly the declared bytes")
    raw_outputs = body.get("outputs")
    if raw_outputs is None:
        raw_outputs = []
    if not isinstance(raw_outputs, list):
        raise InvalidArgument(f"'outputs' must be a JSON array of {{name, parameters}}, got "
                              f"{oip.describe(raw_outputs)}")
    names, binary_of = [], {}
    for i, o in enumerate(raw_outputs):
        where = f"outputs[{i}]"
        _object(o, where, _OUTPUT_FIELDS)
        if not isinstance(o.get("name"), str):
            raise InvalidArgument(f"{where}: 'name' must be a string, got {oip.describe(o.get('name'))}")
        check_text(o["name"], f"{where}: 'name'")
        wanted = oip.check_tensor_parameters("output", o["name"], _parameters_of(o, f"{where} ({shown(o['name'])})"))
        if wanted is not None:
            binary_of[o["name"]] = wanted
        names.append(o["name"])
    return InferRequest(inputs, parameters, names, binary_default, binary_of)


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


def encode_reply(reply: dict, outputs: list[oip.Tensor], request: InferRequest) -> tuple[bytes, int | None]:
    """The v2 REST reply body: ``reply`` (the fields beside ``outputs``) with ``outputs`` as JSON tensors,
    or, for those ``request`` wants binary, as ``parameters: {binary_data_size}`` with their bytes after the
    JSON in output order.

    Returns:
        ``(body, json_length)``: json_length is the ``Inference-Header-Content-Length`` of a reply with
        binary data, None for a JSON-only reply.
    """
    chunks, tensors = [], []
    for t in outputs:
        if request.binary_output(t.name):
            data = oip.to_bytes(t)
            chunks.append(data)
            tensors.append({"name": t.name, "datatype": t.datatype, "shape": list(t.shape),
                            "parameters": {oip.BINARY_DATA_SIZE: len(data)}})
        else:
            tensors.append(tensor_json(t))
    reply = {**reply, "outputs": tensors}  # in the place the caller gave "outputs" (the reply's field order)
    # "replace": see http_transport.json_response (a lone surrogate never gets past the request parser)
    head = json.dumps(reply, ensure_ascii=False).encode("utf-8", "replace")
    if not chunks:
        return head, None
    return b"".join([head, *chunks]), len(head)
