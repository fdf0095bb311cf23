"""What routing knows of a request, and what it decides."""

from __future__ import annotations

from typing import NamedTuple

from router.core.outcome import Prediction
from router.registry.drained import NOTHING_DRAINED, Drained
from router.registry.worker_view import WorkerView


class RouteRequest(NamedTuple):
    """What routing knows of one request (a named tuple: built once per attempt, and a
    frozen dataclass costs several times as much to build).

    `origin_region` is where the client is (this router's region unless the request
    names another); `prompt_tokens` is an estimate; `exclude` holds workers already tried
    for this request (a retry never returns to them).
    """

    model: str
    origin_region: str | None
    prompt_tokens: int = 0
    stream: bool = False
    exclude: frozenset[str] = frozenset()
    # Regions to prefer against (after a connection error there): used only while any
    # candidate elsewhere remains.
    avoid_regions: frozenset[str] = frozenset()
    # What operators drained when the request arrived (the same for all its attempts).
    drained: Drained = NOTHING_DRAINED
    # Data residency: the only regions this request may be served in (None: any). Holds
    # for every attempt: a retry or failover never leaves these regions.
    allowed_regions: frozenset[str] | None = None
    # Cache affinity: a session id from the client, and the keys of the prompt's leading
    # 1k, 2k, 4k, ... characters (router.core.parse.prefix_keys_of; none when it is short).
    session_id: str | None = None
    prefix_keys: tuple[int, ...] = ()
    # "interactive" (default) or "batch" (cheapest region with spare capacity), and the
    # client's time-to-first-token budget in ms, if it sent one.
    traffic_class: str = "interactive"
    ttft_budget_ms: float | None = None
    # The tokens it may generate (max_tokens x n), if it says: what it commits a batch
    # slot to (router.registry.inflight.InFlight.commit).
    completion_tokens: int | None = None
    # The one worker the request may go to (None: any): the holder of the stored response
    # it continues (the Responses API's `previous_response_id`), which no other has.
    only_worker: str | None = None
    # The tokens one of its sequences needs of a worker's context (`max_model_len`): the
    # prompt's estimate and the output it asks for (one token when it names no limit:
    # the engine fills what is left). `context_above`: workers whose context is this long
    # or shorter refused it as too long (a retry's: never sent to one again).
    context_tokens: int = 0
    context_above: int = 0
    # Sent by the router at its own pace (a Batch API line: router.batch.runner), into the
    # room interactive traffic leaves (router.policy.batch_room); a batch-class request
    # from a client comes when it comes, and takes a free slot beyond a quarter.
    paced: bool = False


class Decision(NamedTuple):
    """The chosen worker, its predicted time to first token and why it was chosen."""

    worker: WorkerView
    predicted_ttft_ms: float
    reason: str  # "local" | "spillover" | "affinity" | "batch" | policy-specific
    candidates: int
    # Whether the predicted TTFT is within the request's budget (None: it set none).
    budget_met: bool | None = None
    # The predicted TTFT by its parts (None: the policy predicts none).
    prediction: Prediction | None = None
    # Of the prompt, the tokens the worker was scored as holding in its prefix cache.
    cached_tokens: int = 0


class NoRoute(Exception):
    """No worker can take the request now, and why.

    `reason` is safe to show to the client: it names the model and at most the regions
    the client may use, never a worker or an address. `code` is the client's error code,
    one per cause (the proxy answers 503 with Retry-After for each):

    - `model_unavailable`: no live worker serves the model (its last one died or left);
    - `region_unavailable`: data residency forbids every region that could serve it;
    - `draining`: every live worker that could serve it is drained or draining;
    - `no_capacity`: live, allowed, undrained workers exist, but none can take it now.

    `model_known` is False when no worker serves the model and none has lately (see
    router.registry.snapshot.MODEL_MEMORY_S): then the model may not exist at all, and
    the proxy answers 404 unless regions.yaml lists it.
    """

    def __init__(
        self, reason: str, *, model_known: bool = True, code: str = "no_capacity"
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.model_known = model_known
        self.code = code
