"""The pipeline tasks over the Open Inference Protocol, for :mod:`.oip_codec`: zero-shot classification and
rerank (operations of a classification model, chosen by the input that only they take) and token
classification (a model task). Plain Python values in and out, as :mod:`.oip_codec`; the task calls are
relserve.v1's (:mod:`relserve.service.tasks.zero_shot`, ``rerank``, ``token_classification``). No torch.

Tensors (``N`` texts; ``[N]`` inputs may also be sent as ``[N, 1]``, ``[L]`` / ``[M]`` ones as ``[1, L]``):

================= ===================================== ===========================================================
operation         inputs (all BYTES, UTF-8)             outputs
================= ===================================== ===========================================================
zero-shot         ``text`` [N], ``candidate_labels``    ``labels`` BYTES [N, L]: every candidate label, best
(a classification [L] (its presence selects zero-shot)  first; ``scores`` FP32 [N, L]: the score of
model)                                                  ``labels[i, j]``
rerank            ``query`` [1] (its presence selects   ``index`` INT64 [K]: the texts' indices, best first;
(a classification rerank), ``text`` [N]                 ``score`` FP32 [K]: their scores; K = ``top_n`` or N
model)
token             ``text`` [N], optional                ``entity`` BYTES, ``score`` FP32, ``word`` BYTES,
classification    ``ignore_labels`` [M] (sent: the      ``start`` / ``end`` INT64 (character offsets into the
                  labels whose entities are dropped,    text, end exclusive), ``index`` INT64 (the token's index
                  [0] drops none; not sent: ["O"])      with aggregation ``none``, else -1), each [N, E]: one
                                                        row per text, its entities in text order, padded to E
                                                        (the most entities of any text) with "", 0.0, "", -1,
                                                        -1, -1; ``num_entities`` INT64 [N]: each row's count.
                                                        ``entity`` is the entity_group when aggregated, the
                                                        token's label with ``none``
================= ===================================== ===========================================================

A model's metadata lists these tensors after its own (:func:`metadata`): a classification model's zero-shot
ones when it has an entailment label, its rerank ones when it has one label or an entailment label.

Parameters (relserve.v1's fields of the same name, same defaults): zero-shot ``hypothesis_template``
(string), ``multi_label`` (boolean); rerank ``top_n`` (integer, 0 = all), ``raw_scores``, ``truncate``
(booleans; ``truncate`` defaults to true); token classification ``aggregation_strategy`` (string),
``stride`` (integer). Entity lists are parallel padded tensors, as QA's answers: every OIP client reads
them as numpy arrays (tritonclient's ``as_numpy``), where JSON in a BYTES element would need a second parse.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..backends.base import TASK_CLASSIFICATION, TASK_TOKEN_CLASSIFICATION
from ..errors import InvalidArgument, shown
from ..runner import Runner
from ..tasks import rerank as rerank_task
from ..tasks import token_classification, zero_shot
from .oip_tensors import (_BOOL, _INT, _STRING, BYTES, FP32, INT64, Tensor, check_parameters, output,
                          text_inputs)

# per operation: inputs (name -> (required, one entry per text)), outputs (name -> datatype, in reply order),
# parameters (name -> kind)
_INPUTS = {
    zero_shot.TASK_ZERO_SHOT: {"text": (True, True), "candidate_labels": (True, False)},
    rerank_task.TASK_RERANK: {"query": (True, False), "text": (True, True)},
    TASK_TOKEN_CLASSIFICATION: {"text": (True, True), "ignore_labels": (False, False)},
}
_OUTPUTS = {
    zero_shot.TASK_ZERO_SHOT: {"labels": BYTES, "scores": FP32},
    rerank_task.TASK_RERANK: {"index": INT64, "score": FP32},
    TASK_TOKEN_CLASSIFICATION: {"entity": BYTES, "score": FP32, "word": BYTES, "start": INT64, "end": INT64,
                                "index": INT64, "num_entities": INT64},
}
_PARAMETERS = {
    zero_shot.TASK_ZERO_SHOT: {"hypothesis_template": _STRING, "multi_label": _BOOL},
    rerank_task.TASK_RERANK: {"top_n": _INT, "raw_scores": _BOOL, "truncate": _BOOL},
    TASK_TOKEN_CLASSIFICATION: {"aggregation_strategy": _STRING, "stride": _INT},
}
# the input whose presence selects an operation of a classification model
_SELECTORS = {"candidate_labels": zero_shot.TASK_ZERO_SHOT, "query": rerank_task.TASK_RERANK}
_PAD = (b"", 0.0, b"", -1, -1, -1)  # an entity row's padding: entity, score, word, start, end, index


def operation(task: str, input_names: Sequence[str]) -> str:
    """What a request with inputs ``input_names`` asks of a ``task`` model: zero-shot or rerank when a
    classification model gets ``candidate_labels`` or ``query``, else the model's own task (also the metrics
    ``task`` label)."""
    if task == TASK_CLASSIFICATION:
        for name in input_names:
            if name in _SELECTORS:
                return _SELECTORS[name]
    return task


def handles(op: str) -> bool:
    """Whether :func:`infer_on` serves operation ``op`` (from :func:`operation`)."""
    return op in _INPUTS


def most_inputs(task: str) -> int:
    """The most input tensors a request to a ``task`` model may carry for an operation served here (0: none)."""
    ops = [zero_shot.TASK_ZERO_SHOT, rerank_task.TASK_RERANK] if task == TASK_CLASSIFICATION else [task]
    return max((len(_INPUTS[op]) for op in ops if op in _INPUTS), default=0)


def metadata(task: str, labels: Sequence[str]) -> tuple[list[tuple[str, str, tuple[int, ...]]],
                                                        list[tuple[str, str, tuple[int, ...]]]]:
    """The extra (inputs, outputs) a ``task`` model with ``labels`` lists in its metadata for the operations
    served here, each ``(name, datatype, shape)``: a token-classification model's all; a classification
    model's zero-shot tensors when it is made for it (an entailment label: an NLI model) and rerank tensors
    when it is (one label: a cross-encoder; or an entailment label), the selecting input first. Other
    classification models list only their own tensors, although the operations accept any head their task
    accepts (a two-label head reranks by its second label)."""
    entailment = zero_shot.entailment_index(labels) is not None
    if task == TASK_CLASSIFICATION:
        ops = ([zero_shot.TASK_ZERO_SHOT] if entailment else []) + (
            [rerank_task.TASK_RERANK] if entailment or len(labels) == 1 else [])
    else:
        ops = [task]
    inputs: list = []
    outputs: list = []
    for op in ops:
        if op not in _INPUTS:
            continue
        for name, (_required, per_text) in _INPUTS[op].items():
            if task == TASK_CLASSIFICATION and name == "text":
                continue  # the classification model lists its own "text"
            inputs.append((name, BYTES, (-1,) if per_text or name != "query" else (1,)))
        for name, datatype in _OUTPUTS[op].items():
            shape = (-1,) if op == rerank_task.TASK_RERANK or name == "num_entities" else (-1, -1)
            outputs.append((name, datatype, shape))
    return inputs, outputs


async def infer_on(runner: Runner, op: str, inputs: Sequence[Tensor], parameters: Mapping[str, Any],
                   requested_outputs: Sequence[str], deadline: float | None) -> list[Tensor]:
    """Run operation ``op`` (:func:`operation`) on ``runner``: the inputs, parameters and outputs of the
    module docstring.

    Raises:
        InvalidArgument: an unknown, duplicate, missing or mis-typed/mis-shaped input (naming it), an unknown or
            mis-typed parameter (listing the known ones), an unknown requested output, or anything the task's
            ``validate_*`` refuses (as relserve.v1).
        RelserveError: from the runner, as relserve.v1.
    """
    what = f"{op} on a {runner.task} model" if op != runner.task else f"a {op} model"
    params = check_parameters(what, _PARAMETERS[op], parameters)
    wanted = _requested(op, requested_outputs)
    values = _values(op, inputs)
    if op == zero_shot.TASK_ZERO_SHOT:
        outputs = await _zero_shot(runner, values, params, deadline)
    elif op == rerank_task.TASK_RERANK:
        outputs = await _rerank(runner, values, params, deadline)
    else:
        outputs = await _classify_tokens(runner, values, params, deadline)
    return [t for t in outputs if t.name in wanted]


def _requested(op: str, names: Sequence[str]) -> set[str]:
    outputs = list(_OUTPUTS[op])
    for name in names:
        if name not in outputs:
            raise InvalidArgument(f"unknown output {shown(name)} requested; {op} has outputs {outputs}")
    if len(set(names)) != len(names):
        raise InvalidArgument(f"an output is requested twice: {list(names)}")
    return set(names or outputs)


def _values(op: str, inputs: Sequence[Tensor]) -> dict[str, list[str]]:
    """Each input tensor of ``op`` as a list of strings, checked (:func:`.oip_tensors.text_inputs`)."""
    return text_inputs(inputs, _INPUTS[op], op)


async def _zero_shot(runner: Runner, values: dict[str, list[str]], params: dict[str, Any],
                     deadline: float | None) -> list[Tensor]:
    request = zero_shot.validate_zero_shot(runner, values["text"], values["candidate_labels"],
                                           params.get("hypothesis_template"), bool(params.get("multi_label")))
    items, _timings = await zero_shot.zero_shot(runner, request, deadline)
    n, k = len(items), len(request.candidate_labels)
    labels = [label.encode() for item in items for label in item.labels]
    scores = [float(score) for item in items for score in item.scores]
    return [output("labels", BYTES, (n, k), labels), output("scores", FP32, (n, k), scores)]


async def _rerank(runner: Runner, values: dict[str, list[str]], params: dict[str, Any],
                  deadline: float | None) -> list[Tensor]:
    query = values["query"]
    if len(query) != 1:
        raise InvalidArgument(f"input 'query' has {len(query)} elements; send exactly one query")
    request = rerank_task.validate_rerank(runner, query[0], values["text"], top_n=params.get("top_n", 0),
                                          raw_scores=bool(params.get("raw_scores")),
                                          truncate=params.get("truncate", True))
    items, _timings = await rerank_task.rerank(runner, request, deadline)
    k = len(items)
    return [output("index", INT64, (k,), [item.index for item in items]),
            output("score", FP32, (k,), [float(item.score) for item in items])]


async def _classify_tokens(runner: Runner, values: dict[str, list[str]], params: dict[str, Any],
                           deadline: float | None) -> list[Tensor]:
    request = token_classification.validate_token_classification(
        runner, values["text"], params.get("aggregation_strategy"), values.get("ignore_labels"),
        params.get("stride"))
    items, _timings = await token_classification.classify_tokens(runner, request, deadline)
    n, width = len(items), max((len(item.entities) for item in items), default=0)
    columns: list[list] = [[], [], [], [], [], []]
    for item in items:
        rows = [((e.entity_group if e.entity_group is not None else e.entity or "").encode(), float(e.score),
                 e.word.encode(), e.start, e.end, -1 if e.index is None else e.index) for e in item.entities]
        for row in rows + [_PAD] * (width - len(rows)):
            for column, value in zip(columns, row):
                column.append(value)
    names = list(_OUTPUTS[TASK_TOKEN_CLASSIFICATION])
    return [output(name, _OUTPUTS[TASK_TOKEN_CLASSIFICATION][name], (n, width), column)
            for name, column in zip(names, columns)] + [
        output("num_entities", INT64, (n,), [len(item.entities) for item in items])]
