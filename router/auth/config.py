"""The `auth:` section of regions.yaml: tenants, their API keys (as hashes) and limits.

    auth:
      keys_file: keys.yaml          # optional; relative to regions.yaml; same `keys:` shape
      tenants:
        acme:
          allowed_models: [tiny-llama]          # omitted: every model
          allowed_regions: [eu-west]            # omitted: every region (data residency)
          limits: {requests_per_min: 600, tokens_per_min: 200000}   # the whole tenant
          key_limits: {requests_per_min: 60}                        # each of its keys
      keys:
        - {id: acme-ci, tenant: acme, sha256: 9f86d0...}            # sha256 of the key

Only hashes are ever stored: `python -m router.auth.keys new` makes a key and prints
the line to add. No keys configured means authentication is off (the local demo).
This module imports nothing from router.config so that router.config can import it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

_NAME = r"^[A-Za-z0-9._:@-]{1,128}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class RateLimits(_Strict):
    """Limits of one scope (a key or a tenant). None means unlimited.

    Enforced as a GCRA (leaky bucket): capacity refills continuously at the per-minute
    rate, and a burst of up to `burst_*` (default: one minute's worth) is allowed at once.
    """

    requests_per_min: int | None = Field(default=None, ge=1)
    tokens_per_min: int | None = Field(default=None, ge=1)
    burst_requests: int | None = Field(default=None, ge=1)
    burst_tokens: int | None = Field(default=None, ge=1)

    @property
    def empty(self) -> bool:
        return self.requests_per_min is None and self.tokens_per_min is None


class TenantConfig(_Strict):
    allowed_models: list[str] | None = Field(
        default=None, description="models its keys may use; omitted = all"
    )
    allowed_regions: list[str] | None = Field(
        default=None, min_length=1,
        description="regions its requests may be served in (data residency); omitted = all",
    )
    limits: RateLimits = Field(default=RateLimits(), description="for the tenant as a whole")
    key_limits: RateLimits = Field(default=RateLimits(), description="for each of its keys")


class ApiKeyConfig(_Strict):
    id: str = Field(pattern=_NAME, description="a name for the key, safe to log")
    tenant: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$",
                        description="hex sha256 of the key; the key itself is never stored")
    limits: RateLimits | None = Field(default=None, description="overrides the tenant's "
                                      "key_limits for this key")


class RateLimitSettings(_Strict):
    redis_timeout_ms: float = Field(
        default=75.0, gt=0, le=1000,
        description="longest wait for Redis on the request path; then the local limiter "
        "decides, and Redis is not asked again for `redis_retry_s`",
    )
    redis_retry_s: float = Field(default=1.0, gt=0, le=60)
    default_max_tokens: int = Field(
        default=256, ge=0,
        description="completion tokens charged when a request names no max_tokens",
    )


class AuthConfig(_Strict):
    keys_file: str | None = Field(
        default=None, description="a YAML file with `keys:` (relative to regions.yaml)"
    )
    tenants: dict[str, TenantConfig] = Field(default_factory=dict)
    keys: list[ApiKeyConfig] = Field(default_factory=list)
    rate_limits: RateLimitSettings = RateLimitSettings()

    @property
    def enabled(self) -> bool:
        """Whether clients must present a key (any key is configured)."""
        return bool(self.keys)

    def problems(self, regions: set[str]) -> list[str]:
        """What regions.yaml's validation reports: keys naming unknown tenants, a key id or
        hash listed twice, tenants naming regions that regions.yaml does not define."""
        problems: list[str] = []
        seen_ids: set[str] = set()
        seen_hashes: set[str] = set()
        for index, key in enumerate(self.keys):
            if key.tenant not in self.tenants:
                problems.append(f"auth.keys.{index}.tenant: no tenant named {key.tenant!r}")
            if key.id in seen_ids:
                problems.append(f"auth.keys.{index}.id: {key.id!r} is used twice")
            if key.sha256 in seen_hashes:
                problems.append(f"auth.keys.{index}.sha256: the same key is listed twice")
            seen_ids.add(key.id)
            seen_hashes.add(key.sha256)
        problems.extend(
            f"auth.tenants.{name}.allowed_regions: no region named {region!r}"
            for name, tenant in self.tenants.items()
            for region in tenant.allowed_regions or ()
            if region not in regions
        )
        return problems


class _KeysFile(_Strict):
    keys: list[ApiKeyConfig] = Field(default_factory=list)


class KeysFileError(Exception):
    """The keys file cannot be used; `problems` are `path: reason` (the file is the source)."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__("; ".join(problems))


def merge_keys_file(document: Any, base_dir: Path) -> Any:
    """`document` (a parsed regions.yaml) with the keys of `auth.keys_file` appended to
    `auth.keys`. Returns `document` unchanged when there is no keys file; raises
    KeysFileError naming the keys file."""
    if not isinstance(document, dict):
        return document
    auth = document.get("auth")
    if not isinstance(auth, dict) or not isinstance(auth.get("keys_file"), str):
        return document
    path = base_dir / auth["keys_file"]
    source = str(path)
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise KeysFileError(source, [f"(file): cannot read: {exc.strerror or exc}"]) from None
    except yaml.YAMLError:
        raise KeysFileError(source, ["(document): invalid YAML"]) from None
    try:
        keys_file = _KeysFile.model_validate(loaded if loaded is not None else {})
    except ValidationError as exc:
        raise KeysFileError(source, [
            f"{'.'.join(str(p) for p in error['loc']) or '(document)'}: {error['msg']}"
            for error in exc.errors()
        ]) from None
    inline = auth.get("keys") or []
    if not isinstance(inline, list):
        return document  # the main validation reports it
    merged = [*inline, *(key.model_dump(exclude_none=True) for key in keys_file.keys)]
    return {**document, "auth": {**auth, "keys": merged, "keys_file": str(path)}}
