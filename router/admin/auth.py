"""The admin token: separate from client API keys, compared in constant time, never logged.

The token is read from the environment variable that `admin.token_env` names
(GLOBALPOOL_ADMIN_TOKEN by default). Without it the admin API answers 403 and says how to
turn it on; the status page's HTML is public, its data is not.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Callable, Mapping

from aiohttp import web

from router.config import AdminConfig
from router.core.errors import ApiError

audit = logging.getLogger("globalpool.audit")

# An admin or scrape token shorter than this is refused at start: README's `change-me`
# or a word is guessed, and the admin API drains regions (16 hex digits: 64 bits).
MIN_TOKEN_CHARS = 16


def token_problems(config: AdminConfig, environ: Mapping[str, str]) -> list[str]:
    """Why the tokens set in the environment for `config` cannot be used (empty: they
    can). A token not set leaves its API off; one set must be long enough."""
    names = [config.token_env]
    if config.metrics_auth == "scrape_token":
        names.append(config.scrape_token_env)
    return [f"{name} is {len(environ[name].strip())} characters: a token must have at least "
            f"{MIN_TOKEN_CHARS} (for example `openssl rand -hex 16`), or leave {name} unset "
            "to keep its API off"
            for name in names if 0 < len(environ.get(name, "").strip()) < MIN_TOKEN_CHARS]


def _digest(value: str) -> bytes:
    # Comparing fixed-length digests keeps the comparison constant-time even in length.
    return hashlib.sha256(value.encode()).digest()


class AdminAuth:
    """Checks `Authorization: Bearer <token>` against the token in the environment."""

    def __init__(self, token_env: Callable[[], str],
                 environ: Mapping[str, str] | None = None) -> None:
        self._token_env = token_env
        self._environ = os.environ if environ is None else environ

    def check(self, request: web.Request) -> None:
        """Raises ApiError 403 (admin API off) or 401 (no or wrong token)."""
        name = self._token_env()
        expected = self._environ.get(name, "")
        if not expected:
            raise ApiError(403, f"the admin API is off: set the {name} environment variable "
                                "on the router to an admin token", code="admin_disabled")
        if len(expected.strip()) < MIN_TOKEN_CHARS:  # (a reload named another variable)
            raise ApiError(403, f"the admin API is off: the token in {name} is shorter than "
                                f"{MIN_TOKEN_CHARS} characters", code="admin_disabled")
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                _digest(given.strip()), _digest(expected)):
            audit.warning("admin auth refused: %s %s from %s", request.method, request.path,
                          request.remote)
            raise ApiError(401, "admin token missing or wrong (Authorization: Bearer <token>)",
                           code="invalid_admin_token",
                           headers={"WWW-Authenticate": 'Bearer realm="globalpool-admin"'})
