"""Who is calling: `Authorization: Bearer <key>` -> the key's `Principal`, or a 401.

Keys are stored only as sha256 hashes. A lookup hashes the presented key once (about a
microsecond) and looks the digest up in a dict built when the config is loaded, so the
cost does not grow with the number of keys. Looking up a digest leaks nothing useful by
its timing: an attacker who does not know a key cannot choose which digest to probe.
Neither keys nor their digests are ever logged; a key is named by its configured `id`.

    python -m router.auth.keys new  TENANT KEY_ID   # a fresh key and its config line
    python -m router.auth.keys hash                 # sha256 of a key read from stdin
"""

from __future__ import annotations

import hashlib
import secrets
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from router.auth.config import AuthConfig, RateLimits

KEY_PREFIX = "gp-"
_BEARER = "bearer "


def hash_key(key: str) -> str:
    """The hex sha256 that regions.yaml stores for `key`."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller: its key, its tenant and what the tenant may do.

    `allowed_models` / `allowed_regions` are None when unrestricted. `key_limits` are the
    key's own limits (the key's override, or the tenant's `key_limits`); `tenant_limits`
    are shared by every key of the tenant.
    """

    key_id: str
    tenant: str
    allowed_models: frozenset[str] | None
    allowed_regions: frozenset[str] | None
    key_limits: RateLimits
    tenant_limits: RateLimits


class AuthError(Exception):
    """A request without a valid key; `message` is safe to show (it never quotes the key)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


@dataclass(frozen=True)
class Keyring:
    """The configured keys by digest. Built once per loaded config."""

    by_digest: Mapping[str, Principal] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def enabled(self) -> bool:
        return bool(self.by_digest)

    @classmethod
    def from_config(cls, auth: AuthConfig) -> Keyring:
        by_digest: dict[str, Principal] = {}
        for key in auth.keys:
            tenant = auth.tenants[key.tenant]
            by_digest[key.sha256] = Principal(
                key_id=key.id,
                tenant=key.tenant,
                allowed_models=(None if tenant.allowed_models is None
                                else frozenset(tenant.allowed_models)),
                allowed_regions=(None if tenant.allowed_regions is None
                                 else frozenset(tenant.allowed_regions)),
                key_limits=key.limits if key.limits is not None else tenant.key_limits,
                tenant_limits=tenant.limits,
            )
        return cls(MappingProxyType(by_digest))

    def principal_of(self, key_id: str) -> Principal | None:
        """The principal of the configured key `key_id` (None: no such key now), for work
        the router does on a key's behalf later (a batch's lines)."""
        return next((principal for principal in self.by_digest.values()
                     if principal.key_id == key_id), None)

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal of an `Authorization` header value. Raises AuthError."""
        if not authorization:
            raise AuthError("You didn't provide an API key. Send it as "
                            "'Authorization: Bearer YOUR_KEY'.", "missing_api_key")
        if authorization[:7].lower() != _BEARER:
            raise AuthError("The Authorization header must be 'Bearer YOUR_KEY'.",
                            "invalid_api_key")
        principal = self.by_digest.get(hash_key(authorization[7:].strip()))
        if principal is None:
            raise AuthError("Incorrect API key provided.", "invalid_api_key")
        return principal


def new_key() -> str:
    """A fresh random key (256 bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 3 and args[0] == "new":
        key = new_key()
        print(f"key (give it to the client; it is not stored anywhere): {key}")
        print("add to auth.keys (regions.yaml or the keys file):")
        print(f"  - {{id: {args[2]}, tenant: {args[1]}, sha256: {hash_key(key)}}}")
        return 0
    if args == ["hash"]:
        print(hash_key(sys.stdin.readline().strip()))
        return 0
    print("usage: python -m router.auth.keys new TENANT KEY_ID | hash  (key on stdin)",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
