"""The model repository extension (Triton's) without a transport: what the KServe v2 gRPC servicer
(``RepositoryIndex``, ``RepositoryModelLoad``, ``RepositoryModelUnload``) and the HTTP routes
(:mod:`.http_repository`: ``POST /v2/repository/index``, ``/v2/repository/models/{name}/load``, ``/unload``) share.

Each call checks what it was sent before the repository manager sees it, and touches no file: a model name
must be a model name (``model_name``: the rule of a ``models:`` entry's ``name``, so no path separator, no
``..``, nothing percent-encoded), a parameter must carry a value; then :class:`RepositoryManager`
(``service/repository/manager.py``) decides (unknown parameter keys, the control mode, unknown models). The
transports turn the domain errors into their codes: INVALID_ARGUMENT / 400 for a bad name or parameter,
FAILED_PRECONDITION / 400 when the control mode is not ``explicit``, NOT_FOUND / 404 for an unknown model or
repository, UNAVAILABLE / 503 when a load failed (the serving version stays). Who may call (the admin token) is
the transports' (``service/auth.py``). No torch, no filesystem access here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence

from ..config.schema import NAME_RE
from ..errors import FailedPrecondition, InvalidArgument, shown
from .messages import oneof_values

# the metrics task label of the three calls (relserve_requests_total{task="repository"})
REPOSITORY_TASK = "repository"
# the server metadata's extension name while a model repository is served (Triton's name)
EXTENSION = "model_repository"


class Manager(Protocol):
    """What the transports call: ``service/repository/manager.py``'s ``RepositoryManager``."""

    mode: str

    def index(self, repository_name: str = "", ready: bool = False) -> Sequence[Any]: ...

    async def load(self, name: str, parameters: Mapping[str, object] | None = None) -> None: ...

    async def unload(self, name: str, parameters: Mapping[str, object] | None = None) -> None: ...


@dataclass(frozen=True)
class IndexRow:
    """One row of the index as both transports send it (Triton's ``ModelIndex``): ``version`` and ``reason``
    empty when there is none."""

    name: str
    version: str
    state: str
    reason: str

    def json(self) -> dict[str, str]:
        """Triton's JSON object: ``name`` always; ``version`` only for a model with a version, ``state`` only
        when known, ``reason`` only when not empty (as Triton's server writes its index)."""
        out = {"name": self.name}
        if self.version:
            out["version"] = self.version
        if self.state:
            out["state"] = self.state
        if self.reason:
            out["reason"] = self.reason
        return out


def serves(manager: Manager | None) -> bool:
    """Whether the server has a model repository (then its metadata lists :data:`EXTENSION`): a manager with
    at least one configured repository."""
    return manager is not None and bool(getattr(manager, "repositories", ()))


def check_model_name(name: str) -> str:
    """``name`` when it is a model name (``[A-Za-z0-9][A-Za-z0-9._-]*``, no ``..``), else why not.

    Raises:
        InvalidArgument: empty, a path (``/``, ``\\``, ``..``), percent-encoded, or any other character outside
            the rule (the message quotes the name, cut to 64 characters, and says what is allowed).
    """
    if not name:
        raise InvalidArgument("model_name is empty; name a model of the repository (RepositoryIndex lists them)")
    if "/" in name or "\\" in name or ".." in name:
        raise InvalidArgument(f"model_name {shown(name)} is a path; a model is named by its directory's name in "
                              f"the repository, without separators or '..'")
    if not NAME_RE.match(name):
        raise InvalidArgument(f"model_name {shown(name)} is not a model name: it must match {NAME_RE.pattern}")
    return name


def _no_repository_name(repository_name: str, call: str) -> None:
    if repository_name:
        raise InvalidArgument(f"repository_name {shown(repository_name)} is not supported by {call}: a model name "
                              f"is unique across the repositories; leave repository_name empty")


def index(manager: Manager | None, repository_name: str = "", ready: bool = False) -> list[IndexRow]:
    """The index rows (sorted by the manager: name, then version number); none without a repository.

    Raises:
        NotFound: ``repository_name`` names no configured repository.
    """
    if manager is None:
        return []
    return [IndexRow(e.name, e.version, e.state, e.reason) for e in manager.index(repository_name, ready)]


def _mode_none(call: str) -> FailedPrecondition:
    return FailedPrecondition(f"{call} is not allowed: the server runs with --model-control-mode none and no "
                              f"model repository; load and unload need --model-repository DIR and "
                              f"--model-control-mode explicit")


async def load(manager: Manager | None, model_name: str, parameters: Mapping[str, object] | None = None,
               repository_name: str = "") -> None:
    """Load or reload ``model_name`` (:func:`check_model_name` first); returns once its new versions serve.

    Raises:
        InvalidArgument: a bad name, a ``repository_name``, or what the manager refuses (an unknown parameter).
        FailedPrecondition: the control mode is not ``explicit`` (the message names the mode).
        NotFound: no such model in the repositories.
        Unavailable: the load failed; the serving version, if any, still serves.
    """
    check_model_name(model_name)
    _no_repository_name(repository_name, "load")
    if manager is None:
        raise _mode_none("load")
    await manager.load(model_name, dict(parameters or {}))


async def unload(manager: Manager | None, model_name: str, parameters: Mapping[str, object] | None = None,
                 repository_name: str = "") -> None:
    """Drain and unload every version of ``model_name`` (:func:`check_model_name` first).

    Raises:
        InvalidArgument, FailedPrecondition, NotFound: as :func:`load` (FailedPrecondition also for a model
            of the server config's ``models:``, which is not the repository's to unload).
    """
    check_model_name(model_name)
    _no_repository_name(repository_name, "unload")
    if manager is None:
        raise _mode_none("unload")
    await manager.unload(model_name, dict(parameters or {}))


def grpc_parameters(params: Mapping[str, Any]) -> dict[str, object]:
    """A ``map<string, ModelRepositoryParameter>`` as plain values (bool, int, str, bytes).

    Raises:
        InvalidArgument: a parameter with no value set (names it).
    """
    return oneof_values(params, "parameter", "bool_param, int64_param, string_param, bytes_param")


def json_parameters(body: Mapping[str, Any]) -> dict[str, object]:
    """The ``parameters`` object of a load / unload request body (absent or null: none), values as sent; the
    manager refuses the keys it does not take (Triton's ``file:<version>/<name>`` among them), naming them.

    Raises:
        InvalidArgument: ``parameters`` not an object, or a value that is not a string, number or boolean
            (naming the parameter).
    """
    params = body.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise InvalidArgument(f"'parameters' must be a JSON object of name: value, got {type(params).__name__}")
    for key, value in params.items():
        if isinstance(value, (dict, list)) or value is None:
            raise InvalidArgument(f"parameter {shown(key)} must be a string, number or boolean")
    return dict(params)
