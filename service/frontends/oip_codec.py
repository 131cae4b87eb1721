"""The KServe v2 / Open Inference Protocol (OIP) over relserve's tasks, independent of the transport: OIP
tensors <-> task requests and results.

The gRPC frontend (``kserve_v2_grpc``) and the HTTP routes (``http``) call these functions with plain Python
values; each transport only converts its wire form to :class:`Tensor` and back. Validation, limits and the
task calls are the same as relserve.v1's: each task's ``validate_*`` and its entry point in
:mod:`relserve.service.tasks`. Errors are the domain exceptions of :mod:`relserve.service.errors` (the
transport maps them: INVALID_ARGUMENT / HTTP 400, NOT_FOUND / 404, ...).

Tensors per task (``N`` = texts in the request; ``[N]`` inputs may also be sent as ``[N, 1]``):

=============== ============================================ ==================================================
task            inputs (all BYTES, UTF-8)                    outputs
=============== ============================================ ==================================================
classification  ``text`` [N], optional ``text_pair`` [N]     ``probabilities`` FP32 [N, num_labels] (label id
                                                             order, the scores of relserve.v1 Classify);
                                                             ``label`` BYTES [N] (the best label), or
                                                             [N, top_k] best first when ``top_k`` is sent
                                                             (0 = all labels)
qa              ``question`` [N], ``context`` [N]            ``answer`` BYTES, ``start`` / ``end`` INT64
                                                             (character offsets in the context, end
                                                             exclusive), ``score`` FP32, ``is_impossible``
                                                             BOOL, each [N, top_k] best first; a row with
                                                             fewer answers is padded with "", -1, -1, 0.0,
                                                             false
translation     ``text`` [N]                                 ``translation`` BYTES [N] (the best hypothesis),
                                                             or [N, n_best] best first when ``n_best`` is sent
=============== ============================================ ==================================================

Zero-shot classification and rerank (on a classification model, selected by the inputs
``candidate_labels`` and ``query``) and token classification: :mod:`.oip_pipeline`, whose tensors a model's
metadata lists after its own where the model is made for them (:func:`.oip_pipeline.metadata`).

Request parameters (relserve.v1's request fields of the same name, same defaults and ranges; 0 = default):
classification ``top_k``, ``function_to_apply`` (string: the scores of ``probabilities`` and the order of
``label``); qa ``top_k``, ``max_answer_len``, ``doc_stride``, ``allow_impossible``, ``null_threshold``,
``align_to_words``; translation ``beam_size``, ``n_best``, ``max_length``. Integers must be integers,
``allow_impossible`` / ``align_to_words`` booleans, ``null_threshold`` a number. An unknown parameter is INVALID_ARGUMENT listing
the known ones. A QA request of N questions runs N relserve.v1 Answer calls concurrently, after the request-wide
``max_request_texts`` / ``max_request_chars`` check.

Binary tensor data (Triton's ``binary_tensor_data`` extension, listed in the server metadata): elements
little-endian, row-major, without padding; a BYTES element is a 4-byte little-endian unsigned length then
its bytes, FP32 / INT64 4 / 8 bytes, BOOL one byte 0 or 1 (:func:`split_bytes`, :func:`to_bytes`). Where it
travels is the transport's: HTTP after the JSON header (``Inference-Header-Content-Length``), gRPC in
``raw_input_contents`` / ``raw_output_contents``. Tensor-level parameters (:func:`check_tensor_parameters`,
the same rule on both transports, after the transport took the binary ones it carries): an input's
``binary_data_size`` only with binary data; an output's ``binary_data`` a boolean (true: this output as
binary data); no shared memory and no ``classification`` / ``class_count`` (the classification extension:
use ``label`` with ``top_k``), each INVALID_ARGUMENT naming the parameter. The request parameter
``binary_data_output`` (a boolean: every output binary unless it says otherwise) is taken by the transport
(:func:`binary_output_default`). Element counts are checked on the wire, before a list is built
(:func:`check_element_count`): a refused request costs memory in proportion to the limit. FP32 outputs are
float32 values (:func:`output`), so every transport prints the same numbers.

Versions: a model from a versioned repository may have several loaded versions (``registry.loaded``); every
other model has the one version ``"1"``. A request names a loaded version or leaves it empty for the version
that serves the model (the highest ready one); replies name the version that answered (``runner.version``).
No torch here.
"""

from __future__ import annotations

import importlib.metadata
import struct
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..backends.base import TASK_CLASSIFICATION, TASK_QA, TASK_TRANSLATION
from ..errors import InvalidArgument, NotFound, Unavailable, shown
from ..registry import ModelRegistry
from ..runner import Runner
from ..tasks import classify, qa, translate
from ..tasks.limits import check_request_size
from . import oip_pipeline
from .oip_tensors import (_BOOL, _INT, _NUMBER, _STRING, BOOL, BYTES, FP32, INT64, Tensor, check_parameters,
                          describe, output, text_inputs)

SERVER_NAME = "relserve"
MODEL_VERSION = "1"  # the one version of a model that is not from a versioned repository
# the protocol extensions served, as named in the server metadata (Triton's names)
EXTENSIONS = ("binary_tensor_data",)
BINARY_DATA_SIZE = "binary_data_size"  # input / response output parameter: bytes of binary data
BINARY_DATA = "binary_data"  # requested output parameter: true = this output as binary data
BINARY_DATA_OUTPUT = "binary_data_output"  # request parameter: the default of every output's binary_data


@dataclass(frozen=True)
class TensorMetadata:
    """A tensor's name, datatype and shape (-1 = variable dimension)."""

    name: str
    datatype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ServerMetadata:
    name: str
    version: str
    extensions: tuple[str, ...]


@dataclass(frozen=True)
class ModelMetadata:
    name: str
    versions: tuple[str, ...]
    platform: str  # "relserve_<backend>": relserve_torch or relserve_onnxruntime
    inputs: tuple[TensorMetadata, ...]
    outputs: tuple[TensorMetadata, ...]


# Per task: inputs (name -> required), outputs in reply order, parameters (name -> kind).
_INPUTS = {
    TASK_CLASSIFICATION: {"text": True, "text_pair": False},
    TASK_QA: {"question": True, "context": True},
    TASK_TRANSLATION: {"text": True},
}
_OUTPUTS = {
    TASK_CLASSIFICATION: ("probabilities", "label"),
    TASK_QA: ("answer", "start", "end", "score", "is_impossible"),
    TASK_TRANSLATION: ("translation",),
}
_PARAMETERS = {
    TASK_CLASSIFICATION: {"top_k": _INT, "function_to_apply": _STRING},
    TASK_QA: {"top_k": _INT, "max_answer_len": _INT, "doc_stride": _INT, "allow_impossible": _BOOL,
              "null_threshold": _NUMBER, "align_to_words": _BOOL},
    TASK_TRANSLATION: {"beam_size": _INT, "n_best": _INT, "max_length": _INT},
}


_PARAMETER_HINTS = {
    BINARY_DATA_SIZE: "it sizes binary tensor data, which this request does not carry (HTTP: send the "
                      "Inference-Header-Content-Length header; gRPC: send raw_input_contents)",
    "classification": "the classification extension is not supported; request the 'label' output (with the "
                      "top_k parameter) instead",
    "class_count": "the classification extension is not supported; request the 'label' output (with the "
                   "top_k parameter) instead",
}


def check_tensor_parameters(kind: str, name: str, parameters: Mapping[str, Any]) -> bool | None:
    """The rule for tensor-level ``parameters`` of input (``kind`` "input") or requested output (``kind``
    "output") ``name``, for every transport, once the transport took the input's ``binary_data_size`` of the
    binary data it carries: inputs take none; outputs only ``binary_data``, a boolean.

    Returns:
        An output's ``binary_data`` (None when not sent); None for an input.

    Raises:
        InvalidArgument: any other parameter, or ``binary_data`` not a boolean (names it, with what to do
            instead).
    """
    binary = None
    for key, value in parameters.items():
        if kind == "output" and key == BINARY_DATA:
            if not isinstance(value, bool):
                raise InvalidArgument(f"output {shown(name)} has parameter {BINARY_DATA!r} = {shown(str(value))}: "
                                      f"it must be a boolean (true: this output as binary data)")
            binary = value
            continue
        hint = _PARAMETER_HINTS.get(key, "tensor-level parameters (e.g. shared memory) are not supported")
        raise InvalidArgument(f"{kind} {shown(name)} has parameter {shown(key)} = {shown(str(value))}: {hint}")
    return binary


def binary_output_default(parameters: dict[str, Any]) -> bool:
    """Take the request parameter ``binary_data_output`` out of ``parameters`` (it is the transport's, not
    the task's): every output as binary data unless the output's ``binary_data`` says otherwise.

    Raises:
        InvalidArgument: it is not a boolean.
    """
    value = parameters.pop(BINARY_DATA_OUTPUT, False)
    if not isinstance(value, bool):
        raise InvalidArgument(f"parameter {BINARY_DATA_OUTPUT!r} must be a boolean (true: every output as binary "
                              f"data), got {describe(value)} {shown(str(value))}")
    return value


def binary_data_size(name: str, parameters: dict[str, Any]) -> int | None:
    """Take input ``name``'s ``binary_data_size`` out of its ``parameters``: the byte length of its binary
    data, or None when not sent.

    Raises:
        InvalidArgument: not a non-negative integer (names the input and the value).
    """
    if BINARY_DATA_SIZE not in parameters:
        return None
    size = parameters.pop(BINARY_DATA_SIZE)
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise InvalidArgument(f"input {shown(name)} has parameter {BINARY_DATA_SIZE!r} = {shown(str(size))}: it "
                              f"must be a non-negative integer (the bytes of its binary data)")
    return size


def max_elements(runner: Runner | None) -> int | None:
    """The most elements one input tensor of a request to ``runner`` may hold: its ``max_request_texts``
    (None: no limit, or no runner)."""
    return None if runner is None else runner.config.max_request_texts


def check_element_count(model: str, n: int, limit: int | None) -> None:
    """Refuse a tensor of ``n`` elements over ``limit`` (:func:`max_elements`) before its elements are
    copied, with the message of the task's own check (``max_request_texts``).

    Raises:
        InvalidArgument: ``n`` > ``limit``.
    """
    check_request_size(model, n, 0, limit, None)


def check_input_count(task: str, n: int) -> None:
    """Refuse a request of more input tensors than a ``task`` model takes, before they are converted (a
    request of a million inputs costs no more than one of the limit).

    Raises:
        InvalidArgument: ``n`` > the task's inputs (names them).
    """
    if (task in _INPUTS or oip_pipeline.most_inputs(task)) and n > max(len(_INPUTS.get(task, ())),
                                                                       oip_pipeline.most_inputs(task)):
        raise InvalidArgument(f"the request has {n} inputs; a {task} model takes {_describe_inputs(task)}")


def split_bytes(name: str, buf: bytes | memoryview, model: str = "", limit: int | None = None,
                what: str = "binary data") -> list[bytes]:
    """BYTES elements in binary form: each a 4-byte little-endian length, then that many bytes.

    The elements are counted first (no copy) and refused over ``limit`` (:func:`check_element_count`, naming
    ``model``); then copied out. ``what`` names the buffer in messages ("raw contents" on gRPC).

    Raises:
        InvalidArgument: a length prefix or an element runs past the end of ``buf`` (names the input and the
            byte offset), or too many elements.
    """
    view = memoryview(buf)
    size, pos, count = len(view), 0, 0
    while pos < size:
        if pos + 4 > size:
            raise InvalidArgument(f"{what} of input {shown(name)}: a length prefix is cut off at byte {pos}; BYTES "
                                  f"elements are a 4-byte little-endian length then the bytes")
        (n,) = struct.unpack_from("<I", view, pos)
        if pos + 4 + n > size:
            raise InvalidArgument(f"{what} of input {shown(name)}: element {count} has length {n} but only "
                                  f"{size - pos - 4} bytes follow")
        pos += 4 + n
        count += 1
    check_element_count(model, count, limit)
    out, pos = [], 0
    while pos < size:
        (n,) = struct.unpack_from("<I", view, pos)
        out.append(bytes(view[pos + 4:pos + 4 + n]))
        pos += 4 + n
    return out


_BINARY_FORMAT = {FP32: "f", INT64: "q", BOOL: "?"}  # the output datatypes relserve produces, besides BYTES


def to_bytes(t: Tensor) -> bytes:
    """Output tensor ``t``'s elements in binary form (see :func:`split_bytes`; FP32 as float32, INT64 as
    int64, BOOL one byte each, little-endian)."""
    if t.datatype == BYTES:
        return b"".join(struct.pack("<I", len(b)) + b for b in t.data)
    return struct.pack(f"<{len(t.data)}{_BINARY_FORMAT[t.datatype]}", *t.data)


def parameter_names(task: str) -> tuple[str, ...]:
    """The request parameters a model of ``task`` accepts (see the module docstring)."""
    return tuple(_PARAMETERS.get(task, {}))


def server_live() -> bool:
    """True: a process that answers is live (liveness must not depend on the models)."""
    return True


def server_ready(registry: ModelRegistry) -> bool:
    """Whether every model is loaded and warm and the server is not draining (as grpc.health.v1 SERVING)."""
    return not registry.draining and registry.all_ready


def _version_order(version: str) -> tuple[int, str]:
    return (int(version), "") if version.isdigit() else (-1, version)


def loaded_versions(registry: ModelRegistry, name: str) -> list[str]:
    """Every loaded version of model ``name``, ascending (ModelMetadata's ``versions``, ListModels' rows)."""
    return sorted(registry.loaded(name), key=_version_order)


def _at_version(registry: ModelRegistry, name: str, version: str) -> Runner:
    """Model ``name``'s runner at ``version`` ("" = the serving one), ready or not.

    Raises:
        InvalidArgument: empty name.
        NotFound: unknown model (lists the loaded ones), or a version not loaded (lists the loaded ones).
    """
    runner = _known(registry, name)
    if not version:
        return runner
    at = registry.loaded(name).get(version)
    if at is None:
        raise NotFound(f"model {shown(name)} has no version {shown(version)}; versions: "
                       f"{loaded_versions(registry, name)} (or leave the version empty)")
    return at


def model_ready(registry: ModelRegistry, name: str, version: str = "") -> bool:
    """Whether model ``name`` (at ``version``; "" = the serving version) is loaded, warm and the server is not
    draining.

    An unknown model or version is not ready (False rather than an error: this is what readiness probes ask,
    and Triton answers the same way).
    """
    try:
        runner = _at_version(registry, name, version)
    except (InvalidArgument, NotFound):
        return False
    return runner.ready and not registry.draining


def server_metadata(more: Sequence[str] = ()) -> ServerMetadata:
    """The server's name (``relserve``), its package version, and the protocol extensions it serves
    (:data:`EXTENSIONS`, then ``more``: the transport's, e.g. ``model_repository`` while a repository is
    served)."""
    try:
        version = importlib.metadata.version("relserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree without an install
        version = "unknown"
    return ServerMetadata(SERVER_NAME, version, EXTENSIONS + tuple(more))


def _known(registry: ModelRegistry, name: str) -> Runner:
    if not name:
        raise InvalidArgument(f"model name is empty; set it to one of {registry.names()}")
    runner = registry.runners.get(name)
    if runner is None:
        raise NotFound(f"model {shown(name)} is not loaded; loaded models: {registry.names()}")
    return runner


def model_metadata(registry: ModelRegistry, name: str, version: str = "") -> ModelMetadata:
    """The tensors model ``name`` (at ``version``; "" = the serving version) takes and returns (see the module
    docstring), and every loaded version; also while draining.

    Raises:
        InvalidArgument: empty name.
        NotFound: unknown model (lists the loaded ones) or version.
        Unavailable: the model is not loaded yet (its task and labels are not known before).
    """
    runner = _at_version(registry, name, version)
    task = runner.task
    if task is None:
        raise Unavailable(f"model {name!r} is not loaded yet (state: {runner.state}); retry later")
    info = runner.info()
    inputs = tuple(TensorMetadata(n, BYTES, (-1,)) for n in _INPUTS.get(task, ()))
    extra_inputs, extra_outputs = oip_pipeline.metadata(task, info.labels)
    inputs += tuple(TensorMetadata(*t) for t in extra_inputs)
    if task not in _OUTPUTS:
        outputs: tuple[TensorMetadata, ...] = ()
    elif task == TASK_CLASSIFICATION:
        outputs = (TensorMetadata("probabilities", FP32, (-1, len(info.labels) or -1)),
                   TensorMetadata("label", BYTES, (-1,)))
    elif task == TASK_QA:
        types = {"answer": BYTES, "start": INT64, "end": INT64, "score": FP32, "is_impossible": BOOL}
        outputs = tuple(TensorMetadata(n, types[n], (-1, -1)) for n in _OUTPUTS[task])
    else:
        outputs = (TensorMetadata("translation", BYTES, (-1,)),)
    outputs += tuple(TensorMetadata(*t) for t in extra_outputs)
    return ModelMetadata(name, tuple(loaded_versions(registry, name)), f"relserve_{info.backend}", inputs, outputs)


def operation(task: str, input_names: Sequence[str]) -> str:
    """What a request with inputs ``input_names`` asks of a ``task`` model (the metrics ``task`` label):
    :func:`.oip_pipeline.operation`."""
    return oip_pipeline.operation(task, input_names)


def lookup(registry: ModelRegistry, name: str, version: str = "") -> Runner:
    """The ready runner of model ``name`` at ``version`` ("" = the serving one; what :func:`infer` runs on;
    transports call it first to label their metrics with the model and its task). Its ``version`` is the
    reply's ``model_version``.

    Raises:
        InvalidArgument: empty name.
        NotFound: unknown model (lists the loaded ones) or version (lists the loaded versions).
        Unavailable: draining, or the model (version) is not ready yet.
    """
    runner = _at_version(registry, name, version)
    # draining / readiness checks, as relserve.v1
    return registry.get(name, runner.task or "", runner.version if version else "")


async def infer(registry: ModelRegistry, model_name: str, inputs: Sequence[Tensor],
                parameters: Mapping[str, Any] | None = None, requested_outputs: Sequence[str] | None = None,
                deadline: float | None = None, model_version: str = "") -> list[Tensor]:
    """Run one inference request on model ``model_name``: :func:`lookup`, then :func:`infer_on`."""
    runner = lookup(registry, model_name, model_version)
    return await infer_on(runner, inputs, parameters, requested_outputs, deadline)


async def infer_on(runner: Runner, inputs: Sequence[Tensor], parameters: Mapping[str, Any] | None = None,
                   requested_outputs: Sequence[str] | None = None, deadline: float | None = None) -> list[Tensor]:
    """Run one inference request on ``runner`` (from :func:`lookup`).

    Args:
        inputs: the request's tensors (names, datatypes and shapes per task: module docstring).
        parameters: request parameters, name -> bool / int / float / str (see the module docstring).
        requested_outputs: output names to return, in the model's order; None or empty = all.
        deadline: ``time.monotonic()`` value after which the work is dropped (DEADLINE_EXCEEDED), or None.

    Returns:
        The output tensors, in the model's output order.

    Raises:
        InvalidArgument: an unknown, duplicate, missing or mis-typed/mis-shaped input (naming it), undecodable
            UTF-8 (naming the tensor and element), mismatched N between inputs, an unknown or mis-typed
            parameter (listing the known ones), an unknown requested output, or anything the task's
            ``validate_*`` refuses (as relserve.v1).
        RelserveError: from the runner, as relserve.v1 (queue full, deadline, draining, model failure).
    """
    task = runner.task or ""
    op = operation(task, [t.name for t in inputs])
    if oip_pipeline.handles(op):
        return await oip_pipeline.infer_on(runner, op, inputs, parameters or {}, requested_outputs or (), deadline)
    params = _parameters(task, parameters or {})
    wanted = _requested(task, requested_outputs or ())
    texts = _texts(task, inputs)
    if task == TASK_CLASSIFICATION:
        outputs = await _classify(runner, texts, params, deadline)
    elif task == TASK_QA:
        outputs = await _answer(runner, texts, params, deadline)
    else:
        outputs = await _translate(runner, texts, params, deadline)
    return [t for t in outputs if t.name in wanted]


# ---------------------------------------------------------------------------------------------- requests


def _parameters(task: str, parameters: Mapping[str, Any]) -> dict[str, Any]:
    return check_parameters(f"a {task} model", _PARAMETERS.get(task, {}), parameters)


def _requested(task: str, names: Sequence[str]) -> set[str]:
    outputs = _OUTPUTS[task]
    if not names:
        return set(outputs)
    for name in names:
        if name not in outputs:
            raise InvalidArgument(f"unknown output {shown(name)} requested; a {task} model has outputs "
                                  f"{list(outputs)}")
    if len(set(names)) != len(names):
        raise InvalidArgument(f"an output is requested twice: {list(names)}")
    return set(names)


def _texts(task: str, inputs: Sequence[Tensor]) -> dict[str, list[str]]:
    """Each input tensor as a list of strings, after the checks of :func:`infer_on` (names, BYTES, shapes)."""
    expected = _INPUTS[task]
    out = text_inputs(inputs, {name: (required, True) for name, required in expected.items()}, f"a {task} model")
    first = next(iter(expected))
    for name, values in out.items():
        if len(values) != len(out[first]):
            raise InvalidArgument(f"input {name!r} has {len(values)} elements but {first!r} has "
                                  f"{len(out[first])}; send one per {first}")
    return out


def _describe_inputs(task: str) -> str:
    return ", ".join(f"{n!r} ({'required' if r else 'optional'})" for n, r in _INPUTS[task].items())


async def _classify(runner: Runner, inputs: dict[str, list[str]], params: dict[str, Any],
                    deadline: float | None) -> list[Tensor]:
    labels = list(runner.info().labels)
    top_k = params.get("top_k")
    function = classify.validate_function(params.get("function_to_apply", ""))
    texts, pairs = classify.validate_classify(inputs["text"], inputs.get("text_pair"), int(top_k or 0),
                                              len(labels), runner.name, max_texts=runner.config.max_request_texts,
                                              max_chars=runner.config.max_request_chars)
    # all labels' scores for `probabilities`; top_k (checked above) only cuts `label`
    items, _timings = await classify.classify(runner, texts, pairs, 0, deadline, function_to_apply=function)
    n = len(items)
    order = labels or [label for label, _ in items[0].labels]
    column = {label: j for j, label in enumerate(order)}
    probabilities = [0.0] * (n * len(order))
    best: list[bytes] = []
    k = len(order) if top_k == 0 else (top_k or 1)
    for i, item in enumerate(items):
        for label, score in item.labels:
            probabilities[i * len(order) + column[label]] = float(score)
        best.extend(label.encode() for label, _ in item.labels[:k])  # item.labels is best first
    label_shape = (n,) if top_k is None else (n, k)
    return [output("probabilities", FP32, (n, len(order)), probabilities), output("label", BYTES, label_shape, best)]


_NO_ANSWER = (b"", -1, -1, 0.0, False)  # pads a QA row with fewer than top_k answers


async def _answer(runner: Runner, inputs: dict[str, list[str]], params: dict[str, Any],
                  deadline: float | None) -> list[Tensor]:
    questions, contexts = inputs["question"], inputs["context"]
    cfg = runner.config
    if not questions:
        raise InvalidArgument("input 'question' is empty; send at least one question")
    # request-wide limits first (relserve.v1 Answer has one question; here N share one request's budget)
    check_request_size(runner.name, len(questions), sum(map(len, questions)) + sum(map(len, contexts)),
                       cfg.max_request_texts, cfg.max_request_chars)
    null_threshold = params.get("null_threshold")
    options = []
    for i, (question, context) in enumerate(zip(questions, contexts)):
        try:
            options.append(qa.validate_for(
                runner, question, context, top_k=params.get("top_k", 0),
                max_answer_len=params.get("max_answer_len", 0), doc_stride=params.get("doc_stride", 0),
                allow_impossible=params.get("allow_impossible", False),
                null_threshold=None if null_threshold is None else float(null_threshold),
                align_to_words=params.get("align_to_words")))
        except InvalidArgument as exc:
            raise InvalidArgument(f"row {i}: {exc}") if len(questions) > 1 else exc from None
    results = await qa.answer_all(runner, list(zip(questions, contexts, options)), deadline)
    n, k = len(results), options[0].top_k
    columns: list[list] = [[], [], [], [], []]
    for result in results:
        rows = [(a.text.encode(), a.start, a.end, float(a.score), bool(a.is_impossible)) for a in result.answers[:k]]
        rows += [_NO_ANSWER] * (k - len(rows))
        for row in rows:
            for column, value in zip(columns, row):
                column.append(value)
    return [output(name, dtype, (n, k), column) for name, dtype, column in
            zip(_OUTPUTS[TASK_QA], (BYTES, INT64, INT64, FP32, BOOL), columns)]


async def _translate(runner: Runner, inputs: dict[str, list[str]], params: dict[str, Any],
                     deadline: float | None) -> list[Tensor]:
    texts = inputs["text"]
    options = translate.validate_translate(texts, beam_size=params.get("beam_size", 0),
                                           n_best=params.get("n_best", 0), max_length=params.get("max_length", 0),
                                           return_alignment=False, config=runner.config)
    items = await translate.translate(runner, texts, options, deadline)
    k = options.n_best
    data: list[bytes] = []
    for item in items:
        hyps = [h.text.encode() for h in item.hypotheses[:k]]
        data += hyps + [b""] * (k - len(hyps))  # a blank text has one (empty) hypothesis
    shape = (len(items),) if "n_best" not in params else (len(items), k)
    return [output("translation", BYTES, shape, data)]
