"""What the HTTP surfaces of other ecosystems' conventions (:mod:`.kserve_v1`, :mod:`.hf_inference`,
:mod:`.tei`) share on :mod:`.http_transport`: one model request's course (:func:`serve`) and the checks of
their JSON fields (:func:`text`, :func:`integer`, :func:`boolean`, ...). No surface imports another; each
imports this. No torch.

:func:`serve` gives every such route the transport's behaviour: the ``X-Request-Timeout`` deadline, the
body limit and Content-Encoding (:meth:`HttpTransport.body`), the drain count and the deadline's cancelling
(:meth:`HttpTransport.within`), ``relserve_requests_total`` / duration / in-flight under the model (when
served), its task and the surface's ``protocol`` label; and answers every error, the transport's own
refusals (413, 415) included, in the surface's error shape (``error``: the surface's function
``(grpc code, message, http status or None, retry_after_s, the exception or None) -> web.Response``).
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable, Protocol

import grpc
from aiohttp import web

from ..errors import InvalidArgument, shown, to_status
from .http_transport import HTTP_CODES, TIMEOUT_HEADER, Counted, Deadline, HttpTransport, json_response
from .json_codec import check_text
from .oip_codec import describe

log = logging.getLogger(__name__)


class ErrorReply(Protocol):
    def __call__(self, code: grpc.StatusCode, message: str, status: int | None = None,
                 retry_after_s: float | None = None, cause: BaseException | None = None) -> web.Response: ...


# (runner, the request body's JSON object or None, deadline) -> the reply's JSON value
Handler = Callable[[Any, Any, float | None], Awaitable[Any]]


async def serve(core: HttpTransport, request: web.Request, *, protocol: str, name: str, handle: Handler,
                error: ErrorReply, task: str | None = None, read_body: bool = True,
                operation: Callable[[Any, Any], str | None] | None = None) -> web.Response:
    """Answer one model request of a surface: ``handle(runner, body, deadline)`` on the served model ``name``
    (any task when ``task`` is None: the handler reads ``runner.task``), its JSON value as the reply.

    Counted in the request metrics under ``protocol``; the model and task labels are the URL's model when it
    is served (else ``_unknown_``: label values stay bounded by the served models). ``operation(runner,
    body)``, for a served model once the body is read, may name the task label instead (zero-shot and rerank
    run on a classification model); None keeps the model's. Every error is answered by ``error`` (the
    transport's 413 / 415 with their statuses), never raised to the transport.
    """
    count = Counted.for_url_model(core.registry, name, protocol=protocol)
    runner = core.registry.runners.get(name)
    try:
        deadline = core.deadline(request)
        body = await core.body(request) if read_body else None
        if operation is not None and runner is not None:
            count.task = operation(runner, body) or count.task
        runner = core.registry.get(name, task or (runner.task if runner is not None else None) or "")
        count.running()
        return json_response(await core.within(deadline, handle(runner, body, deadline)))
    except Deadline:
        count.code = grpc.StatusCode.DEADLINE_EXCEEDED.name
        return error(grpc.StatusCode.DEADLINE_EXCEEDED,
                     f"the request's deadline ({TIMEOUT_HEADER}) passed before it was answered")
    except web.HTTPException as exc:  # the transport's refusals of the body: 413 over the limit, 415 encoding
        count.code = HTTP_CODES.get(exc.status, "INVALID_ARGUMENT")
        message = exc.text if exc.status != 413 else (
            f"the request body is over the server's max_receive_message_length of {core.max_body} bytes; send "
            f"fewer or shorter texts")
        return error(grpc.StatusCode[count.code], message or exc.reason, exc.status)
    except Exception as exc:
        status, details = counted_failure(count, exc, log, f"{protocol} request to model {count.model!r}")
        return error(status, details, None, getattr(exc, "retry_after_s", None), exc)
    finally:
        count.done()


def counted_failure(count: Counted, exc: Exception, logger: logging.Logger, what: str) -> tuple[grpc.StatusCode, str]:
    """The status and details of a request that raised ``exc`` (:func:`relserve.service.errors.to_status`), set as
    ``count``'s code; an unexpected error (INTERNAL) is logged with its traceback as ``"<what> failed: ..."``
    on ``logger`` (call it from the ``except`` block)."""
    status, details = to_status(exc)
    count.code = status.name
    if status == grpc.StatusCode.INTERNAL:
        logger.exception("%s failed: %s", what, details)
    return status, details


def not_allowed(error: ErrorReply, allowed: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    """A handler for every other method on a surface's path (``web.route("*", ...)`` after its own): 405 with
    ``Allow`` in the surface's error shape (the transport's 405 would be relserve's shape)."""

    async def handler(request: web.Request) -> web.Response:
        response = error(grpc.StatusCode.UNIMPLEMENTED,
                         f"{request.method} is not allowed on {shown(request.path)}; allowed: {allowed}", 405)
        response.headers["Allow"] = allowed
        return response

    return handler


# ---------------------------------------------------------------------- JSON field checks

def text(value: Any, where: str) -> str:
    """``value`` as a string that UTF-8 can carry.

    Raises:
        InvalidArgument: not a string, or holding a lone surrogate (naming ``where``).
    """
    if not isinstance(value, str):
        raise InvalidArgument(f"{where} must be a string, got {describe(value)}")
    check_text(value, where)
    return value


def integer(value: Any, where: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an int (a JSON integer, or a number with no fraction: 3.0) within the bounds.

    Raises:
        InvalidArgument: another type (booleans included), a fraction, or out of range (naming ``where``).
    """
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{where} must be an integer, got {describe(value)}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        low = "" if minimum is None else f">= {minimum}"
        high = "" if maximum is None else f"<= {maximum}"
        raise InvalidArgument(f"{where} {value} is out of range; allowed {' and '.join(x for x in (low, high) if x)}")
    return value


def boolean(value: Any, where: str) -> bool:
    """``value`` as a bool (JSON true / false only).

    Raises:
        InvalidArgument: another type (naming ``where``).
    """
    if not isinstance(value, bool):
        raise InvalidArgument(f"{where} must be true or false, got {describe(value)}")
    return value


def obj(value: Any, where: str, known: tuple[str, ...] | None = None) -> dict:
    """``value`` as a JSON object ({} for null), with no key outside ``known`` when given.

    Raises:
        InvalidArgument: not an object, or an unknown key (naming ``where`` and the known keys).
    """
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where} must be a JSON object, got {describe(value)}")
    if known is not None:
        unknown = sorted(k for k in value if k not in known)
        if unknown:
            raise InvalidArgument(f"unknown key(s) {unknown} in {where}; relserve serves {', '.join(known)}")
    return value


def texts(value: Any, where: str) -> list[str]:
    """``value`` as a non-empty list of strings.

    Raises:
        InvalidArgument: not a list, empty, or an entry not a string (naming ``where[i]``).
    """
    if not isinstance(value, list):
        raise InvalidArgument(f"{where} must be a list, got {describe(value)}")
    if not value:
        raise InvalidArgument(f"{where} is empty; send at least one")
    return [text(v, f"{where}[{i}]") for i, v in enumerate(value)]


def strings(value: Any, where: str) -> list[str]:
    """``value`` as a list of strings (it may be empty).

    Raises:
        InvalidArgument: not a list, or an entry not a string (naming ``where[i]``).
    """
    if not isinstance(value, list):
        raise InvalidArgument(f"{where} must be a list of strings, got {describe(value)}")
    return [text(v, f"{where}[{i}]") for i, v in enumerate(value)]
