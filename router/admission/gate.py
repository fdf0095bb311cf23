"""Admission of one request: who is calling, may it use this model, is it within limits.

`Admission.authenticate` runs before the body is read (401 costs no body read);
`Admission.admit` after it is parsed (the token cost needs the body). Both raise
`ApiError` with OpenAI-format errors: 401 (no or unknown key), 403 (model not allowed),
429 (over a limit, with Retry-After and x-ratelimit-* headers). With no keys configured
both let everything through: authentication is off.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence

from router.admission.gcra import Bucket, BucketState, RateDecision
from router.admission.limiter import RateLimiter
from router.auth.config import AuthConfig, RateLimits
from router.auth.keys import AuthError, Keyring, Principal
from router.core.errors import ApiError
from router.core.outcome import RequestRecord
from router.core.parse import ParsedRequest
from router.core.stats import SecurityStats


class Caller(enum.Enum):
    """Who sends a request: whom its `Authorization` names (FROM_HEADERS, the default), or
    the Principal the router passes when it sends one itself (a batch's line, for the key
    that created the batch)."""

    FROM_HEADERS = "from headers"


class Admission:
    """Auth and rate limits for one router replica. The keyring follows the config object
    it is given, so a hot-reloaded config takes effect on the next request."""

    def __init__(self, limiter: RateLimiter, stats: SecurityStats) -> None:
        self.limiter = limiter
        self.stats = stats
        self._auth: AuthConfig | None = None
        self._keyring = Keyring()

    async def aclose(self) -> None:
        await self.limiter.aclose()

    async def warm_up(self) -> None:
        await self.limiter.warm_up()

    def keyring(self, auth: AuthConfig) -> Keyring:
        if auth is not self._auth:
            self._keyring = Keyring.from_config(auth)
            self._auth = auth
        return self._keyring

    def authenticate(self, headers: Mapping[str, str], auth: AuthConfig) -> Principal | None:
        """The caller (from `headers`, looked up by lower-case name), or None when
        authentication is off. Raises ApiError(401)."""
        keyring = self.keyring(auth)
        if not keyring.enabled:
            return None
        try:
            principal = keyring.authenticate(headers.get("authorization"))
        except AuthError as exc:
            self.stats.auth[exc.code] += 1
            raise ApiError(401, exc.message, code=exc.code,
                           headers={"WWW-Authenticate": 'Bearer realm="globalpool"'}) from None
        self.stats.auth["ok"] += 1
        return principal

    def may_use_model(self, principal: Principal | None, model: str) -> bool:
        return (principal is None or principal.allowed_models is None
                or model in principal.allowed_models)

    async def admit(
        self, principal: Principal | None, parsed: ParsedRequest, auth: AuthConfig,
    ) -> dict[str, str] | None:
        """Check the model and charge the limits; the x-ratelimit-* headers for the
        answer (None when no limit applies). Raises ApiError(403 / 429)."""
        if principal is None:
            return None
        if not self.may_use_model(principal, parsed.model):
            self.stats.auth["model_not_allowed"] += 1
            raise ApiError(403, f"The model {parsed.model!r} is not available to this API key.",
                           code="model_not_allowed", param="model")
        tokens = parsed.prompt_tokens + (parsed.completion_tokens
                                         if parsed.completion_tokens is not None
                                         else auth.rate_limits.default_max_tokens)
        buckets = buckets_for(principal, tokens)
        if not buckets:
            return None
        oversized = [b for b in buckets if not b.fits_at_all]
        if oversized:
            bucket = oversized[0]
            self.stats.rate_limited[(bucket.scope, bucket.unit)] += 1
            raise ApiError(429, f"Request too large: it needs {bucket.cost} {bucket.unit}, more "
                           f"than the {bucket.scope} limit allows at once ({bucket.burst}); "
                           "lower max_tokens or the prompt.", code="request_too_large")
        decision = await self.limiter.check(principal.tenant, buckets)
        headers = rate_limit_headers(decision.states)
        if not decision.allowed:
            hit = _limiting(decision)
            self.stats.rate_limited[(hit.bucket.scope, hit.bucket.unit)] += 1
            retry_s = decision.retry_after_s
            raise ApiError(
                429,
                f"Rate limit reached for {hit.bucket.unit} per minute of this "
                f"{'API key' if hit.bucket.scope == 'key' else 'organization'}: limit "
                f"{hit.bucket.limit_per_min}/min. Please try again in {retry_s:.1f}s.",
                code="rate_limit_exceeded",
                headers={**headers, "Retry-After": str(max(1, math.ceil(retry_s))),
                         "retry-after-ms": str(max(1, math.ceil(retry_s * 1000)))},
            )
        return headers

    def record_residency(self, principal: Principal | None, record: RequestRecord) -> None:
        """Count where a region-restricted tenant's request went (see SecurityStats)."""
        if principal is None or principal.allowed_regions is None:
            return
        allowed = principal.allowed_regions
        for attempt in record.attempts:
            if attempt.region not in allowed:
                self.stats.residency_violations += 1
        served = record.served_by
        if served is not None:
            self.stats.residency[(principal.tenant, served.region, "routed")] += 1
        elif not record.attempts:
            self.stats.residency[(principal.tenant, "-", "refused")] += 1
        else:
            self.stats.residency[(principal.tenant, "-", "failed")] += 1


def buckets_for(principal: Principal, tokens: int) -> list[Bucket]:
    """The buckets a request of `tokens` tokens is charged against (key, then tenant)."""
    buckets: list[Bucket] = []
    scopes: tuple[tuple[str, str, RateLimits], ...] = (
        ("key", f"key:{principal.key_id}", principal.key_limits),
        ("tenant", "tenant", principal.tenant_limits),
    )
    for scope, name, limits in scopes:
        if limits.requests_per_min is not None:
            buckets.append(Bucket(f"{name}:requests", scope, "requests",
                                  limits.requests_per_min,
                                  limits.burst_requests or limits.requests_per_min, 1))
        if limits.tokens_per_min is not None and tokens > 0:
            buckets.append(Bucket(f"{name}:tokens", scope, "tokens", limits.tokens_per_min,
                                  limits.burst_tokens or limits.tokens_per_min, tokens))
    return buckets


def _limiting(decision: RateDecision) -> BucketState:
    return max(decision.states, key=lambda s: s.retry_after_s)


def rate_limit_headers(states: Sequence[BucketState]) -> dict[str, str]:
    """OpenAI's `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` for the tightest
    bucket of each unit."""
    tightest: dict[str, BucketState] = {}
    for state in states:
        unit = state.bucket.unit
        best = tightest.get(unit)
        if best is None or state.remaining < best.remaining or (
                state.remaining == best.remaining and state.reset_s > best.reset_s):
            tightest[unit] = state
    headers: dict[str, str] = {}
    for unit, state in tightest.items():
        headers[f"x-ratelimit-limit-{unit}"] = str(state.bucket.limit_per_min)
        headers[f"x-ratelimit-remaining-{unit}"] = str(state.remaining)
        headers[f"x-ratelimit-reset-{unit}"] = duration(state.reset_s)
    return headers


def duration(seconds: float) -> str:
    """`17ms`, `6s`, `1m30s`: the format OpenAI uses in x-ratelimit-reset-*."""
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    rest_text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{rest_text}" if minutes else rest_text
