"""The admin API and the status page.

    GET  /admin/status            the fleet as this router sees it (JSON; ?workers=N lists
                                  at most N workers, problems first)
    POST /admin/drain             {"region": "eu-west"} or {"worker": "id"}, "reason" optional
    POST /admin/undrain           the same body
    POST /admin/reload            check regions.yaml now (it is also checked every second)
    GET  /status                  the status page (HTML; its data comes from /admin/status)

Every /admin/ call needs the admin token (router.admin.auth). Each action leaves one line
in the `globalpool.audit` log: what, on what, from where, and the result.
"""

from __future__ import annotations

import json
import logging
from importlib import resources
from typing import Any

from aiohttp import web

from router.admin.auth import AdminAuth
from router.admin.status import AdminContext, status_json
from router.core.errors import ApiError
from router.registry.drains import DrainError, TargetKind

audit = logging.getLogger("globalpool.audit")

ADMIN = web.AppKey("admin", AdminContext)
AUTH = web.AppKey("admin_auth", AdminAuth)
_PAGE = web.AppKey("status_page", bytes)

MAX_REASON_CHARS = 500


def add_admin_routes(app: web.Application, auth: AdminAuth) -> None:
    """Register the routes; `app[ADMIN]` must be set before the first request."""
    app[AUTH] = auth
    app[_PAGE] = resources.files("router.admin").joinpath("status.html").read_bytes()
    app.router.add_get("/admin/status", _status)
    app.router.add_post("/admin/drain", _drain)
    app.router.add_post("/admin/undrain", _undrain)
    app.router.add_post("/admin/reload", _reload)
    app.router.add_get("/status", _page)


def _authorized(request: web.Request) -> AdminContext:
    request.app[AUTH].check(request)
    return request.app[ADMIN]


async def _status(request: web.Request) -> web.Response:
    context = _authorized(request)
    return web.Response(body=await status_json(context, _max_workers(request)),
                        content_type="application/json", headers={"Cache-Control": "no-store"})


def _max_workers(request: web.Request) -> int | None:
    """`?workers=N`: list at most N workers (problems first); every worker without it.
    Any other query parameter, or `workers` twice, is refused (400): a typo such as
    `?worker=5` must not quietly return every worker."""
    unknown = sorted({name for name in request.query if name != "workers"})
    if unknown:
        names = ", ".join(repr(name[:40]) for name in unknown[:5])
        raise ApiError(400, f"unknown query parameter(s) {names}: /admin/status takes "
                            "only 'workers'", param=unknown[0][:40])
    if len(request.query.getall("workers", ())) > 1:
        raise ApiError(400, "'workers' given more than once", param="workers")
    given = request.query.get("workers")
    if given is None:
        return None
    if not given.isdigit() or len(given) > 9:
        raise ApiError(400, f"'workers' must be a whole number of workers to list, not "
                            f"{given[:40]!r}", param="workers")
    return int(given)


async def _page(request: web.Request) -> web.Response:
    return web.Response(body=request.app[_PAGE], content_type="text/html", charset="utf-8",
                        headers={"Cache-Control": "no-store"})


async def _target(request: web.Request, context: AdminContext) -> tuple[TargetKind, str, str]:
    try:
        document: Any = json.loads(await request.read() or b"{}")
    except ValueError as exc:
        raise ApiError(400, f"body is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise ApiError(400, 'body must be {"region": NAME} or {"worker": ID}')
    targets = [(kind, document[kind]) for kind in ("region", "worker") if kind in document]
    if len(targets) != 1 or not isinstance(targets[0][1], str) or not targets[0][1]:
        raise ApiError(400, 'body must name exactly one target: {"region": NAME} or '
                            '{"worker": ID}')
    reason = document.get("reason", "")
    if not isinstance(reason, str) or len(reason) > MAX_REASON_CHARS:
        raise ApiError(400, f"'reason' must be a string of at most {MAX_REASON_CHARS} chars",
                       param="reason")
    kind: TargetKind = "region" if targets[0][0] == "region" else "worker"
    return kind, targets[0][1], reason


def _check_known(context: AdminContext, kind: TargetKind, name: str) -> None:
    if kind == "region":
        known = set(context.configs.current.regions) | {
            v.region for v in context.snapshots.current.workers.values()}
    else:
        known = set(context.snapshots.current.workers)
    if name not in known:
        raise ApiError(404, f"no {kind} named {name!r} (known: {', '.join(sorted(known))})",
                       code=f"unknown_{kind}")


def _store(context: AdminContext) -> Any:
    if context.drains is None:
        raise ApiError(503, "drain flags are not available yet (the router is starting)")
    return context.drains


async def _drain(request: web.Request) -> web.Response:
    context = _authorized(request)
    kind, name, reason = await _target(request, context)
    _check_known(context, kind, name)
    by = request.remote or ""
    try:
        record = await _store(context).drain(kind, name, reason=reason, by=by)
    except DrainError as exc:
        _audit(request, "drain", kind, name, f"failed: {exc}", reason)
        raise ApiError(503, str(exc), code="redis_unavailable") from None
    context.events.record("drain", f"{kind} {name}", reason)
    _audit(request, "drain", kind, name, "ok", reason)
    return web.json_response({"drained": {"kind": kind, "name": name, "reason": reason,
                                          "since_unix_s": record.since_unix_s}})


async def _undrain(request: web.Request) -> web.Response:
    context = _authorized(request)
    kind, name, reason = await _target(request, context)
    try:
        was_drained = await _store(context).undrain(kind, name)
    except DrainError as exc:
        _audit(request, "undrain", kind, name, f"failed: {exc}", reason)
        raise ApiError(503, str(exc), code="redis_unavailable") from None
    if was_drained:
        context.events.record("undrain", f"{kind} {name}", reason)
    _audit(request, "undrain", kind, name, "ok" if was_drained else "ok (was not drained)",
           reason)
    return web.json_response({"undrained": {"kind": kind, "name": name},
                              "was_drained": was_drained})


async def _reload(request: web.Request) -> web.Response:
    context = _authorized(request)
    if context.reload is None:
        raise ApiError(409, "this router was not started from a config file: nothing to reload")
    taken = context.reload()
    if context.reload_siblings is not None:
        context.reload_siblings()
    configs = context.configs
    error = configs.last_error
    result = "reloaded" if taken else ("refused" if error is not None else "unchanged")
    _audit(request, "reload", "config", str(configs.path), result, "")
    return web.json_response({
        "result": result, "version": configs.version,
        "problems": list(error.problems) if error is not None else [],
    }, status=422 if result == "refused" else 200)


def _audit(request: web.Request, action: str, kind: str, name: str, result: str,
           reason: str) -> None:
    # Never the token: only what was done, on what, from where.
    audit.info("admin action=%s target=%s:%s reason=%s remote=%s result=%s", action, kind, name,
               json.dumps(reason), request.remote, result)
