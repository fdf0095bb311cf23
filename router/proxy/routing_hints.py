"""What a request asks of routing beyond its body: the client's region, a session, a
traffic class and a TTFT budget from its headers, and the `RouteRequest` policies read."""

from __future__ import annotations

from collections.abc import Mapping

from router.auth.keys import Principal
from router.config import GlobalConfig
from router.core.errors import ApiError
from router.core.outcome import RequestRecord
from router.core.parse import ParsedRequest
from router.policy import RouteRequest
from router.registry.drained import Drained

CLIENT_REGION_HEADER = "x-globalpool-client-region"
SESSION_HEADER = "x-globalpool-session-id"
CLASS_HEADER = "x-globalpool-class"  # interactive (default) | batch
TTFT_BUDGET_HEADER = "x-globalpool-ttft-budget-ms"
TRAFFIC_CLASSES = ("interactive", "batch")


def origin_region(headers: Mapping[str, str], default: str | None,
                  config: GlobalConfig) -> str | None:
    """The region the client is in: the one it names, else `default` (the router's)."""
    named = headers.get(CLIENT_REGION_HEADER)
    if named is None:
        return default
    if named not in config.regions:
        raise ApiError(400, f"{CLIENT_REGION_HEADER}: no region named {named!r}")
    return named


def routing_hints(headers: Mapping[str, str]) -> tuple[str | None, str, float | None]:
    """Session id, traffic class and TTFT budget (ms) from the request's headers."""
    session_id = headers.get(SESSION_HEADER) or None
    if session_id is not None and len(session_id) > 256:
        raise ApiError(400, f"{SESSION_HEADER}: at most 256 characters")
    traffic_class = headers.get(CLASS_HEADER, "interactive")
    if traffic_class not in TRAFFIC_CLASSES:
        raise ApiError(400, f"{CLASS_HEADER}: one of {', '.join(TRAFFIC_CLASSES)}")
    raw_budget = headers.get(TTFT_BUDGET_HEADER)
    budget_ms: float | None = None
    if raw_budget is not None:
        try:
            budget_ms = float(raw_budget)
        except ValueError:
            budget_ms = -1.0
        if not 0 < budget_ms < 86_400_000:
            raise ApiError(400, f"{TTFT_BUDGET_HEADER}: a positive number of milliseconds")
    return session_id, traffic_class, budget_ms


def route_request(parsed: ParsedRequest, record: RequestRecord, drained: Drained,
                  principal: Principal | None,
                  hints: tuple[str | None, str, float | None],
                  only_worker: str | None = None, paced: bool = False) -> RouteRequest:
    """What routing knows of the request, for its first attempt (`only_worker`: the one
    worker it may go to, if any; `paced`: a batch line the router sends)."""
    session_id, traffic_class, budget_ms = hints
    limit = parsed.completion_tokens
    allowed = None if principal is None else principal.allowed_regions  # data residency
    # `__new__` called directly: `RouteRequest(...)` costs twice as much, as the type's
    # call turns the keywords into a dict for a named tuple's Python `__new__`.
    return RouteRequest.__new__(
        RouteRequest,
        model=parsed.model,
        origin_region=record.origin_region,
        prompt_tokens=parsed.prompt_tokens,
        stream=parsed.stream,
        drained=drained,
        allowed_regions=allowed,
        session_id=session_id,
        prefix_keys=parsed.prefix_keys,
        traffic_class=traffic_class,
        ttft_budget_ms=budget_ms,
        completion_tokens=limit,
        # One sequence's need of a worker's context: the prompt and the output its limit
        # asks for (one token when it names none, as the engine then fills what is left;
        # none for a request that generates nothing).
        context_tokens=parsed.prompt_tokens + (
            1 if limit is None else limit // parsed.choices),
        only_worker=only_worker,
        paced=paced,
    )
