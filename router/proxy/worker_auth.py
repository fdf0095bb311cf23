"""The key a region's workers ask of the router: `Authorization: Bearer <key>` upstream.

The client's own credentials never go upstream (`router.proxy.targets.upstream_headers`);
a region whose workers want a key names the variable that holds it in regions.yaml
(`upstream_api_key_env`).
"""

from __future__ import annotations

import os

from router.config import GlobalConfig

_UNREAD = "\x00unread"  # not a header value (a NUL cannot be in one)


def upstream_key(config: GlobalConfig, region: str) -> str | None:
    """The key for `region`'s workers: the value of its `upstream_api_key_env`, if set."""
    region_config = config.regions.get(region)
    name = region_config.upstream_api_key_env if region_config is not None else None
    return os.environ.get(name) or None if name else None


class WorkerAuth:
    """The `Authorization` header of each region's workers, read once per region and
    config."""

    __slots__ = ("_config", "_values")

    def __init__(self) -> None:
        # "Bearer <key>" per region, for the config it was read from.
        self._values: dict[str, str | None] = {}
        self._config: GlobalConfig | None = None

    def authorize(self, headers: dict[str, str], config: GlobalConfig, region: str) -> None:
        """`Authorization: Bearer <key>` in `headers` for `region`'s workers, or none (the
        client's own never goes upstream). The key is read once per region and config."""
        if config is not self._config:
            self._config = config
            self._values.clear()
        value = self._values.get(region, _UNREAD)
        if value is _UNREAD:
            key = upstream_key(config, region)
            value = self._values[region] = None if key is None else f"Bearer {key}"
        if value is None:
            headers.pop("authorization", None)
        else:
            headers["authorization"] = value
