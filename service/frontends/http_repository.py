"""Triton's model repository extension over HTTP/REST: a surface of :mod:`.http_transport`.

=============================================== ===========================================================
``POST /v2/repository/index``                   body empty or ``{"ready": bool}`` -> 200, a JSON array of
                                                ``{"name", "version"?, "state"?, "reason"?}`` (``version`` only
                                                for a model with one, ``reason`` only when not empty, as
                                                Triton writes them)
``POST /v2/repository/models/{name}/load``      body empty or ``{"parameters": {...}}`` (``config``: JSON text
                                                of model keys) -> 200, empty body, once the model serves
``POST /v2/repository/models/{name}/unload``    body empty or ``{"parameters": {"unload_dependents": bool}}``
                                                -> 200, empty body, once the model is drained and unloaded
=============================================== ===========================================================

Errors are JSON ``{"error": message, "code": ...}`` (Triton's ``{"error"}`` plus relserve's code name): 400 for a
bad name, body or parameter and for a control mode other than ``explicit`` (FAILED_PRECONDITION, naming the
mode), 404 for an unknown model, 503 when a load failed. A name with a path in it (``a/b``, ``../x``, its
percent-encoded forms) is 400 before anything else happens: the route takes the rest of the path as the name
so that such a request reaches the name check rather than another route.

Who may call: these routes check the admin token themselves, with the gRPC port's rule
(:meth:`relserve.service.auth.AdminTokenInterceptor.check`; the transport's inference token check passes them,
:meth:`RepositorySurface.admin_path`): without a token 401, with another one (an inference token included) 403;
open only when the server has no token file at all. Counted in
``relserve_requests_total{task="repository", protocol="kserve_v2_http"}``. No torch here.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

from aiohttp import web

from ..auth import AdminTokenInterceptor
from ..errors import InvalidArgument, shown
from . import repository_codec as repo
from .http_transport import (HTTP_CODES, Counted, HttpTransport, authorization, error_response, http_words,
                             json_response)
from .http_calls import counted_failure
from .json_codec import loads

log = logging.getLogger(__name__)

PREFIX = "/v2/repository/"


class RepositorySurface:
    """The routes above over the transport's repository manager (``HttpTransport.repository``; None: no
    repository), guarded by ``admin`` (None: no tokens at all, the routes are open)."""

    PROTOCOL = "kserve_v2_http"  # the metrics label: these are routes of the v2 REST API

    def __init__(self, admin: AdminTokenInterceptor | None) -> None:
        self.admin = admin
        self.core: HttpTransport | None = None

    @property
    def repository(self) -> repo.Manager | None:
        return self.core.repository if self.core is not None else None

    def routes(self, core: HttpTransport) -> list[web.RouteDef]:
        self.core = core
        # {name:.+}: a name holding '/' still reaches this route, and is refused by its name check (400)
        return [web.post(PREFIX + "index", self.index),
                web.post(PREFIX + "models/{name:.+}/load", self.load),
                web.post(PREFIX + "models/{name:.+}/unload", self.unload)]

    @staticmethod
    def admin_path(path: str) -> bool:
        """The repository routes check the admin token themselves."""
        return path.startswith(PREFIX)

    async def index(self, request: web.Request) -> web.Response:
        async def call(body: dict) -> web.Response:
            ready = body.get("ready", False)
            if not isinstance(ready, bool):
                raise InvalidArgument(f"'ready' must be a boolean, got {type(ready).__name__}")
            return json_response([row.json() for row in repo.index(self.repository, "", ready)])

        return await self._serve(request, call)

    async def load(self, request: web.Request) -> web.Response:
        async def call(body: dict) -> web.Response:
            await repo.load(self.repository, request.match_info["name"], repo.json_parameters(body))
            return web.Response(status=200, content_type="application/json")

        return await self._serve(request, call)

    async def unload(self, request: web.Request) -> web.Response:
        async def call(body: dict) -> web.Response:
            await repo.unload(self.repository, request.match_info["name"], repo.json_parameters(body))
            return web.Response(status=200, content_type="application/json")

        return await self._serve(request, call)

    async def _serve(self, request: web.Request, call: Callable[[dict], Awaitable[web.Response]]) -> web.Response:
        """The admin check, then the body (empty: ``{}``) and ``call``; every outcome counted, every error JSON."""
        count = Counted("", repo.REPOSITORY_TASK, protocol=self.PROTOCOL)
        try:
            refused = self.admin.check(authorization(request)) if self.admin is not None else None
            if refused is not None:
                code, reason = refused
                count.code = code.name
                return error_response(code, http_words(reason))
            assert self.core is not None
            raw = await self.core.read(request)
            body: dict[str, Any] = loads(raw) if raw.strip() else {}
            return await call(body)
        except web.HTTPException as exc:  # 413 / 415 from read(): the transport's middleware answers them as JSON
            count.code = HTTP_CODES.get(exc.status, "INVALID_ARGUMENT")
            raise
        except Exception as exc:
            status, details = counted_failure(count, exc, log, f"{request.method} {shown(request.path)}")
            return error_response(status, details)
        finally:
            count.done()
