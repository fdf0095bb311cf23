"""The policies by name: `create_policy` builds the one regions.yaml names."""

from __future__ import annotations

import router.policy.baselines  # registers the built-in policies
import router.policy.predicted_ttft  # noqa: F401
from router.policy.base import Policy, RoutingContext


def create_policy(name: str, context: RoutingContext) -> Policy:
    """The policy registered under `name`; ValueError names the known ones otherwise."""
    try:
        cls = Policy.registry[name]
    except KeyError:
        known = ", ".join(sorted(Policy.registry))
        raise ValueError(f"unknown policy {name!r} (known: {known})") from None
    return cls(context)
