"""What regions.yaml must satisfy beyond its schema to run a router: one list of checks
that `globalpool check-config`, the router's start and every hot reload all apply, so a
file that one accepts the others accept."""

from __future__ import annotations

from router.config import GlobalConfig
from router.policy import Policy


def runtime_problems(config: GlobalConfig, *, policy_override: str | None = None) -> list[str]:
    """Problems a router would refuse `config` for (empty: it would run it)."""
    import router.policy.baselines  # registers the built-in policies
    import router.policy.predicted_ttft  # noqa: F401

    problems: list[str] = []
    if policy_override is None and config.router.policy not in Policy.registry:
        known = ", ".join(sorted(Policy.registry))
        problems.append(f"router.policy: unknown policy {config.router.policy!r} "
                        f"(known: {known})")
    return problems
