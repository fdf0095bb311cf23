"""The admin API and the status page.

    GET  /admin/status            the fleet as this router sees it (JSON; ?workers=N lists
                                  at most N workers, problems first)
    POST /admin/drain             {"region": "eu-west"} or {"worker": "id"}, "reason" optional
                                  (no other field: a drain lasts until undrained)
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
from router.admin.terminal import first_unsafe
from router.core.errors import ApiError
from router.registry.drains import UNREACHABLE, DrainError, TargetKind

audit = logging.getLogger("globalpool.audit")

ADMIN = web.AppKey("admin", AdminContext)
AUTH = web.AppKey("admin_auth", AdminAuth)
_PAGE = web.AppKey("status_page", bytes)

MAX_REASON_CHARS = 500
BODY_FIELDS = ("region", "worker", "reason")  # of a drain or undrain
# A 404 for an unknown target echoes at most this much of the name and lists at most
# this many known names (a fleet may have thousands of workers).
MAX_ECHOED_CHARS = 100
MAX_KNOWN_LISTED = 20


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
    except RecursionError:  # json.loads recurses once per '[' or '{'
        raise ApiError(400, "body is not valid JSON: nested too deeply") from None
    if not isinstance(document, dict):
        raise ApiError(400, 'body must be {"region": NAME} or {"worker": ID}')
    unknown = sorted(name for name in document if name not in BODY_FIELDS)
    if unknown:  # e.g. "duration_s": the drain would silently last until undrained
        names = ", ".join(repr(name[:40]) for name in unknown[:5])
        raise ApiError(400, f"unknown field(s) {names}: the body takes 'region' or 'worker', "
                            "and 'reason' (a drain has no duration: it lasts until undrained)",
                       param=unknown[0][:40])
    targets = [(kind, document[kind]) for kind in ("region", "worker") if kind in document]
    if len(targets) != 1 or not isinstance(targets[0][1], str) or not targets[0][1]:
        raise ApiError(400, 'body must name exactly one target: {"region": NAME} or '
                            '{"worker": ID}')
    reason = document.get("reason", "")
    if not isinstance(reason, str) or len(reason) > MAX_REASON_CHARS:
        raise ApiError(400, f"'reason' must be a string of at most {MAX_REASON_CHARS} chars",
                       param="reason")
    unsafe = first_unsafe(reason)
    if unsafe is not None:  # it is shown in operators' terminals (router.admin.terminal)
        raise ApiError(400, f"'reason' must not contain control or bidi characters "
                            f"(found U+{ord(unsafe):04X})", param="reason")
    kind: TargetKind = "region" if targets[0][0] == "region" else "worker"
    return kind, targets[0][1], reason


def _check_known(context: AdminContext, kind: TargetKind, name: str) -> None:
    if kind == "region":
        known = set(context.configs.current.regions) | {
            v.region for v in context.snapshots.current.workers.values()}
    else:
        known = set(context.snapshots.current.workers)
    if name not in known:
        echoed = repr(name[:MAX_ECHOED_CHARS]) + ("..." if len(name) > MAX_ECHOED_CHARS else "")
        listed = [n[:MAX_ECHOED_CHARS] for n in sorted(known)[:MAX_KNOWN_LISTED]]
        more = f", and {len(known) - len(listed)} more" if len(known) > len(listed) else ""
        raise ApiError(404, f"no {kind} named {echoed} (known: {', '.join(listed)}{more})",
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
        raise ApiError(503, f"the drain could not be stored: {UNREACHABLE}",
                       code="redis_unavailable") from None
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
        raise ApiError(503, f"the undrain could not be stored: {UNREACHABLE}",
                       code="redis_unavailable") from None
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
    taken = await context.reload()
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
