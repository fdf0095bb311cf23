"""What the router answers of itself and the fleet's models: GET /v1/models,
/v1/models/{id} and /health."""

from __future__ import annotations

import time

from aiohttp import web

from router.core.errors import error_response
from router.proxy.handlers import Proxy
from router.registry.snapshot import UNBOUNDED_CONTEXT, Snapshot


def _visible_models(proxy: Proxy, request: web.Request) -> list[str]:
    """Models served by live workers in every region that the caller's API key may use
    (all of them when no keys are configured); 401 for a missing or bad key."""
    admission = proxy.admission
    models = proxy.holder.current.models(time.monotonic())
    if admission is None:
        return models
    principal = admission.authenticate(request.headers, proxy.config.auth)
    return [model for model in models if admission.may_use_model(principal, model)]


async def models(proxy: Proxy, request: web.Request) -> web.Response:
    """GET /v1/models: the union of models served by live workers in every region (those
    the caller's API key may use, when keys are configured)."""
    created = int(time.time())
    snapshot = proxy.holder.current
    return web.json_response({"object": "list", "data": [
        _model_card(model, created, snapshot) for model in _visible_models(proxy, request)]})


async def model(proxy: Proxy, request: web.Request, model_id: str) -> web.Response:
    """GET /v1/models/{model_id}: the model's card as in /v1/models; 404 in OpenAI's format
    when no live worker serves it (or the caller's key may not use it)."""
    if model_id not in _visible_models(proxy, request):
        return error_response(
            404, f"The model '{model_id}' does not exist or you do not have access to it.",
            code="model_not_found", param="model")
    return web.json_response(_model_card(model_id, int(time.time()), proxy.holder.current))


async def health_check(proxy: Proxy, request: web.Request) -> web.Response:
    """GET /health: the router is up; says how current its view of the fleet is."""
    snapshot = proxy.holder.current
    age = snapshot.view_age_s(time.monotonic())
    return web.json_response({
        "status": "ok",
        "region": proxy.region,
        "workers": len(snapshot.workers),
        "redis_connected": snapshot.redis_connected,
        "view_age_s": None if age is None else round(age, 3),
    })


def _model_card(model: str, created: int, snapshot: Snapshot) -> dict[str, object]:
    """A model as OpenAI's /v1/models lists it, with vLLM's `max_model_len`: the longest
    context among its workers (requests that need more than a worker has go to one with
    more), when every one of them gives it."""
    card: dict[str, object] = {"id": model, "object": "model", "created": created,
                               "owned_by": "globalpool"}
    longest = snapshot.contexts(model)[1]
    if longest < UNBOUNDED_CONTEXT:
        card["max_model_len"] = longest
    return card
