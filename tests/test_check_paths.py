"""The explorer's own edges, cheaply: a state bound truncates (and says so), an exhausted scope
says so, a core that raises an undocumented exception is a violation, and a replay that does not
reproduce its violation is refused."""

from __future__ import annotations

from typing import Any

import pytest

from kvlease import LocalTime, Pinner, PinnerOutput
from kvlease.check import Scope, explore, replay


def test_a_state_bound_truncates_and_says_so() -> None:
    result = explore(Scope(depth=12), max_states=500)
    assert result.truncated and not result.exhausted and result.violation is None
    assert result.states >= 500


def test_a_tiny_scope_is_exhausted() -> None:
    result = explore(
        Scope(
            depth=30,
            without=frozenset(
                {"advance", "drop", "cross", "dup", "misroute", "replay", "retrack", "fail", "disconnect"}
            ),
        )
    )
    assert result.exhausted and result.violation is None and result.states > 0


class _RaisingPinner(Pinner):
    """A pinner that breaks the contract: an exception out of `receive`."""

    def receive(self, now: LocalTime, message: Any) -> tuple[PinnerOutput, ...]:
        raise RuntimeError("boom")


def test_an_undocumented_exception_from_the_core_is_a_violation_and_replays() -> None:
    scope = Scope(depth=6)
    cx = explore(scope, _RaisingPinner).violation
    assert cx is not None and "undocumented exception RuntimeError: boom" in cx.message
    again, _ = replay(scope, cx.rates, cx.actions, _RaisingPinner, expected=cx.message)
    assert again.message == cx.message and len(again.schedule) == len(cx.actions)
    with pytest.raises(AssertionError, match="does not reproduce"):
        replay(scope, cx.rates, cx.actions, _RaisingPinner, expected="something else")


def test_the_campaign_reports_and_minimizes_a_broken_core() -> None:
    """The campaign's failure path end to end on a double that renews at expiry (caught in the
    first seeds): the report counts the claim, and the minimizer keeps the violation."""
    from kvlease.sim import BUGS, campaign, campaign_scenario, minimize, run_scenario

    pinner_factory, accessor_factory = BUGS["renew-at-expiry"]
    seen: list[int] = []
    report = campaign(
        range(0, 4),
        pinner_factory=pinner_factory,
        accessor_factory=accessor_factory,
        on_seed=lambda seed, result: seen.append(seed),
    )
    assert seen == [0, 1, 2, 3] and report.seeds == 4 and report.failures
    failure = report.failures[0]
    claim = failure.violations[0].claim
    assert report.by_claim[claim] >= 1
    small = minimize(
        campaign_scenario(failure.seed),
        claim,
        pinner_factory=pinner_factory,
        accessor_factory=accessor_factory,
        budget=8,
    )
    result = run_scenario(small, pinner_factory=pinner_factory, accessor_factory=accessor_factory)
    assert any(v.claim == claim for v in result.violations)
