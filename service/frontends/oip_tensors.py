"""The Open Inference Protocol's tensors as plain Python values, shared by the OIP codecs (:mod:`.oip_codec`,
:mod:`.oip_pipeline`): the :class:`Tensor` type, the datatypes relserve produces, output construction
(:func:`output`), BYTES decoding (:func:`decode_text`) and the checks of a request's text inputs
(:func:`text_inputs`). No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy

from ..errors import InvalidArgument, shown

BYTES, FP32, INT64, BOOL = "BYTES", "FP32", "INT64", "BOOL"
# the kinds of request parameters (check_parameters), in the words of its messages
_INT, _BOOL, _NUMBER, _STRING = "an integer", "a boolean", "a number", "a string"


@dataclass(frozen=True)
class Tensor:
    """One input or output tensor.

    ``data`` is the flattened, row-major list of ``prod(shape)`` elements: ``bytes`` for BYTES (inputs may
    also carry ``str``, taken as already decoded), ``float`` for FP32, ``int`` for INT64, ``bool`` for BOOL.
    """

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: list


def describe(value: Any) -> str:
    """``value``'s kind in words, for error messages: "null", "a boolean", "an integer", "a number",
    "a string", "a list", "an object", "bytes" (else the Python type name)."""
    if value is None:
        return "null"
    for kind, words in ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"),
                        ((list, tuple), "a list"), (dict, "an object"), ((bytes, bytearray, memoryview), "bytes")):
        if isinstance(value, kind):
            return words
    return f"a {type(value).__name__}"


def output(name: str, datatype: str, shape: tuple[int, ...], data: list) -> Tensor:
    """An output tensor; FP32 elements are rounded to float32 here, the one place, so that a JSON reply
    prints the numbers a gRPC reply's ``fp32_contents`` / raw float32 bytes carry."""
    if datatype == FP32:
        data = numpy.asarray(data, dtype=numpy.float32).tolist()  # tolist: Python floats of the float32 values
    return Tensor(name, datatype, tuple(shape), data)


def decode_text(name: str, index: int, value: Any) -> str:
    """Element ``index`` of BYTES input ``name`` as text (``str`` elements are taken as decoded).

    Raises:
        InvalidArgument: not UTF-8, an unpaired surrogate, or not a string or bytes (naming the element).
    """
    if isinstance(value, str):
        try:
            value.encode("utf-8")  # a JSON "\ud800" is a str that no UTF-8 (and no tokenizer) can take
        except UnicodeEncodeError as exc:
            raise InvalidArgument(f"input {name!r}[{index}] is not valid UTF-8 text (an unpaired surrogate at "
                                  f"character {exc.start})") from None
        return value
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise InvalidArgument(f"input {name!r}[{index}] is {describe(value)}; BYTES elements must be UTF-8 "
                              f"strings")
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"input {name!r}[{index}] is not valid UTF-8 ({exc.reason} at byte {exc.start})") \
            from None


def describe_inputs(expected: Mapping[str, tuple[bool, bool]]) -> str:
    """``expected``'s inputs for a message: "'text' (required), 'text_pair' (optional)"."""
    return ", ".join(f"{n!r} ({'required' if r else 'optional'})" for n, (r, _) in expected.items())


def text_inputs(inputs: Sequence[Tensor], expected: Mapping[str, tuple[bool, bool]],
                taker: str) -> dict[str, list[str]]:
    """Each input tensor as its list of texts, checked against ``expected`` (name -> (required, per_text)):
    known names, each sent once, BYTES, the required ones present; a ``per_text`` input holds one text per row
    (shape [N] or [N, 1]), any other one list (shape [L] or [1, L]). ``taker`` names who takes them in the
    messages ("a classification model").

    Raises:
        InvalidArgument: naming the input and what is wrong with it (or :func:`decode_text`'s).
    """
    out: dict[str, list[str]] = {}
    for tensor in inputs:
        name = tensor.name
        if name not in expected:
            raise InvalidArgument(f"unknown input {shown(name)}; {taker} takes {describe_inputs(expected)}")
        if name in out:
            raise InvalidArgument(f"input {name!r} is sent twice")
        if tensor.datatype != BYTES:
            raise InvalidArgument(f"input {name!r} has datatype {shown(tensor.datatype)}; it must be BYTES (UTF-8 "
                                  f"text)")
        shape = tuple(tensor.shape)
        per_text = expected[name][1]
        ok = len(shape) == 1 or (len(shape) == 2 and (shape[1] == 1 if per_text else shape[0] == 1))
        if not ok or any(d < 0 for d in shape):
            form = "[N] or [N, 1] (one text per row)" if per_text else "[L] or [1, L] (one list)"
            raise InvalidArgument(f"input {name!r} has shape {list(shape)}; it must be {form}")
        count = shape[0] if per_text or len(shape) == 1 else shape[1]
        if len(tensor.data) != count:
            raise InvalidArgument(f"input {name!r} has shape {list(shape)} but {len(tensor.data)} elements")
        out[name] = [decode_text(name, i, v) for i, v in enumerate(tensor.data)]
    for name, (required, _) in expected.items():
        if required and name not in out:
            raise InvalidArgument(f"input {name!r} is missing; {taker} takes {describe_inputs(expected)}")
    return out


def check_parameters(what: str, known: Mapping[str, str], parameters: Mapping[str, Any]) -> dict[str, Any]:
    """Request ``parameters`` checked against ``known`` (name -> kind: :data:`_INT`, :data:`_BOOL`,
    :data:`_NUMBER`, :data:`_STRING`) of ``what`` ("a classification model").

    Raises:
        InvalidArgument: an unknown parameter (listing the known ones) or a value of another kind.
    """
    out = {}
    for name, value in parameters.items():
        kind = known.get(name)
        if kind is None:
            raise InvalidArgument(f"unknown parameter {shown(name)} for {what}; known parameters: {sorted(known)}")
        ok = {_INT: isinstance(value, int) and not isinstance(value, bool),
              _BOOL: isinstance(value, bool),
              _STRING: isinstance(value, str),
              _NUMBER: isinstance(value, (int, float)) and not isinstance(value, bool)}[kind]
        if not ok:
            raise InvalidArgument(f"parameter {name!r} must be {kind}, got {describe(value)} {shown(str(value))}")
        out[name] = value
    return out
