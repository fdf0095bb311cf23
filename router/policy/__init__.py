"""Routing policies: filter, then score, then pick. See `base.Policy`."""

from router.policy.base import Policy, RoutingContext
from router.policy.catalog import create_policy
from router.policy.request import Decision, NoRoute, RouteRequest

__all__ = ["Decision", "NoRoute", "Policy", "RouteRequest", "RoutingContext", "create_policy"]
