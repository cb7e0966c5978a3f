"""Control API over HTTP (aiohttp): the same operations as the Python API, for other processes.

Routes (JSON in and out; errors are ``{"error": "<one line>"}`` with 400/404/409):

- ``GET /toxics`` · ``POST /toxics`` (a toxic) · ``GET|PATCH|DELETE /toxics/{name}``
- ``POST /link/down`` ``{"duration_s": 2, "mode": "reset"}`` · ``POST /link/up`` · ``GET /link``
- ``GET /stats`` · ``GET /metrics`` (Prometheus text) · ``GET /health``

A request with a foreign ``Origin`` header (another web page in a browser) is refused with
403; with a token, every request but ``/health`` needs ``Authorization: Bearer <token>`` (401).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from pdx.errors import InputError, PdxError
from pdx.faults.proxy import FaultProxy

PROXY_KEY: web.AppKey[FaultProxy] = web.AppKey("proxy", FaultProxy)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


TOKEN_KEY: web.AppKey[str | None] = web.AppKey("token", str)


@web.middleware
async def _guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse a request another web page sent (a foreign ``Origin``: a browser's cross-site
    ``text/plain`` POST needs no preflight), and one without the bearer token when set."""
    origin = request.headers.get("Origin")
    if origin is not None and origin not in (f"http://{request.host}", f"https://{request.host}"):
        return _error(403, f"Origin {origin!r}: the control API takes no cross-site requests")
    token = request.app[TOKEN_KEY]
    if token is not None and request.path != "/health":
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return _error(401, "a bearer token is required (Authorization: Bearer <token>)")
    return await handler(request)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Map pdx errors to 4xx with a one-line reason; the proxy keeps running."""
    try:
        return await handler(request)
    except InputError as exc:
        status = 404 if exc.field == "toxic" and "name" in request.match_info else 400
        if exc.field == "toxic.name" and "in use" in exc.expected:
            status = 409
        return _error(status, str(exc))
    except PdxError as exc:
        return _error(400, " ; ".join(str(exc).splitlines()))


async def _body(request: web.Request) -> dict[str, Any]:
    raw = await request.text()
    if not raw.strip():
        return {}
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InputError(
            "body", raw[:80], f"valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None
    if not isinstance(data, dict):
        raise InputError("body", data, "a JSON object")
    return data


def _proxy(request: web.Request) -> FaultProxy:
    return request.app[PROXY_KEY]


async def list_toxics(request: web.Request) -> web.Response:
    """``GET /toxics``."""
    return web.json_response([t.model_dump() for t in _proxy(request).list_toxics()])


async def add_toxic(request: web.Request) -> web.Response:
    """``POST /toxics``: add a toxic; 201 with the stored toxic."""
    toxic = _proxy(request).add_toxic(await _body(request))
    return web.json_response(toxic.model_dump(), status=201)


async def get_toxic(request: web.Request) -> web.Response:
    """``GET /toxics/{name}``."""
    return web.json_response(_proxy(request).get_toxic(request.match_info["name"]).model_dump())


async def update_toxic(request: web.Request) -> web.Response:
    """``PATCH /toxics/{name}`` (or POST): change attributes."""
    body = await _body(request)
    toxic = _proxy(request).update_toxic(request.match_info["name"], body)
    return web.json_response(toxic.model_dump())


async def remove_toxic(request: web.Request) -> web.Response:
    """``DELETE /toxics/{name}``."""
    _proxy(request).remove_toxic(request.match_info["name"])
    return web.Response(status=204)


async def link_down(request: web.Request) -> web.Response:
    """``POST /link/down`` with optional ``duration_s`` and ``mode``."""
    body = await _body(request)
    unknown = set(body) - {"duration_s", "mode"}
    if unknown:
        raise InputError("body", sorted(unknown), "only duration_s and mode")
    duration = body.get("duration_s")
    if duration is not None and not isinstance(duration, int | float):
        raise InputError("duration_s", duration, "a number of seconds")
    await _proxy(request).link_down(duration_s=duration, mode=body.get("mode", "reset"))
    return await link_state(request)


async def link_up(request: web.Request) -> web.Response:
    """``POST /link/up``."""
    _proxy(request).link_up()
    return await link_state(request)


async def link_state(request: web.Request) -> web.Response:
    """``GET /link``."""
    proxy = _proxy(request)
    return web.json_response(
        {"link": "down" if proxy.link_blocked else "up", "mode": proxy.link_mode}
    )


async def stats(request: web.Request) -> web.Response:
    """``GET /stats``: the same dict as ``FaultProxy.stats()``."""
    return web.json_response(_proxy(request).stats())


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text format of this proxy's registry."""
    return web.Response(body=_proxy(request).metrics_text(), content_type="text/plain")


async def health(request: web.Request) -> web.Response:
    """``GET /health``."""
    return web.json_response({"status": "ok", "port": _proxy(request).port})


def create_app(proxy: FaultProxy, token: str | None = None) -> web.Application:
    """The aiohttp application controlling ``proxy`` (``token``: required as a bearer)."""
    app = web.Application(middlewares=[_guard, _errors], client_max_size=64 * 1024)
    app[PROXY_KEY] = proxy
    app[TOKEN_KEY] = token
    app.router.add_get("/toxics", list_toxics)
    app.router.add_post("/toxics", add_toxic)
    app.router.add_get("/toxics/{name}", get_toxic)
    app.router.add_patch("/toxics/{name}", update_toxic)
    app.router.add_post("/toxics/{name}", update_toxic)
    app.router.add_delete("/toxics/{name}", remove_toxic)
    app.router.add_post("/link/down", link_down)
    app.router.add_post("/link/up", link_up)
    app.router.add_get("/link", link_state)
    app.router.add_get("/stats", stats)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    return app


class ControlServer:
    """Runs the control API for a proxy on ``host:port`` (port 0 = ephemeral)."""

    def __init__(
        self, proxy: FaultProxy, host: str = "127.0.0.1", port: int = 0, *,
        token: str | None = None,
    ) -> None:  # fmt: skip
        self.proxy = proxy
        self.host = host
        self.port = port
        self.token = token
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        """Bind and serve."""
        self._runner = web.AppRunner(create_app(self.proxy, self.token), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    @property
    def url(self) -> str:
        """Base URL of the API."""
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        """Stop serving."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> ControlServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
