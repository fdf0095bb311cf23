"""Policies register by the `name` their class sets (a class attribute, which the compiled
build keeps; it drops class keywords)."""

from __future__ import annotations

from typing import ClassVar

import pytest

import router.policy.baselines
import router.policy.predicted_ttft  # noqa: F401
from router.policy.base import Policy
from router.policy.predicted_ttft import PredictedTtft


def test_the_shipped_policies_are_registered_by_name() -> None:
    assert {"predicted_ttft", "round_robin", "random", "least_load", "nearest",
            "power_of_two"} <= set(Policy.registry)
    assert Policy.registry["predicted_ttft"] is PredictedTtft


def test_a_subclass_registers_under_its_own_name_only() -> None:
    class Tuned(PredictedTtft):  # inherits the name: not registered again
        pass

    class Renamed(PredictedTtft):
        name: ClassVar[str] = "test_renamed"

    try:
        assert Policy.registry["predicted_ttft"] is PredictedTtft
        assert Policy.registry["test_renamed"] is Renamed
        assert Tuned not in Policy.registry.values()
    finally:
        Policy.registry.pop("test_renamed", None)


def test_a_name_taken_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="registered twice"):
        class Again(Policy):
            name: ClassVar[str] = "round_robin"
    assert Policy.registry["round_robin"].__name__ == "RoundRobin"
