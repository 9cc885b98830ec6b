"""The fault campaign: thousands of adversarial seeds, every safety and liveness claim checked.

Zero violations on the real core over 2,000 seeds; and deliberately broken cores (a pinner
that shortens leases, an accessor that overstates the extension, a pinner that holds leases too
long) are caught, so the campaign is shown able to fail. A caught violation is minimized and
written as a JSON record that replays.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvlease.cli._sim import sim
from kvlease.conformance import VECTOR_FORMAT, CoreImplementation, run_vector
from kvlease.sim import BUGS, campaign, campaign_scenario, minimize, run_scenario, run_seed

#: Seeds the suite runs (CI's budget: about a minute on a 2-core box since the v3 fault
#: models). The full 2,000-seed campaign the README states is ``kvlease sim --campaign 2000``
#: (KVLEASE_CAMPAIGN_SEEDS=2000 runs it here).
CAMPAIGN_SEEDS = int(os.environ.get("KVLEASE_CAMPAIGN_SEEDS", "300"))


def test_campaign_finds_no_violation() -> None:
    report = campaign(range(CAMPAIGN_SEEDS))
    assert report.seeds == CAMPAIGN_SEEDS
    assert report.events > 400_000  # the seeds did simulate something (about 2,100 per seed)
    assert report.failures == [], report.by_claim


def test_campaign_seeds_exercise_the_faults() -> None:
    """The seeds are adversarial: leases are lost, stale accesses caught, leases expire."""
    lost = stale = pinned_at_crash = 0
    for seed in range(80):
        r = run_seed(seed)
        lost += r.leases_lost
        stale += r.stale_caught
        pinned_at_crash += len(r.reclaim_latencies)
    assert lost > 100 and stale > 0 and pinned_at_crash > 10


def _first_failure(bug: str, cap: int) -> tuple[int, str]:
    pinner_factory, accessor_factory = BUGS[bug]
    for seed in range(cap):
        r = run_seed(seed, pinner_factory=pinner_factory, accessor_factory=accessor_factory)
        if r.violations:
            return seed, r.violations[0].claim
    raise AssertionError(f"the campaign did not catch {bug!r} in {cap} seeds")


@pytest.mark.parametrize(
    ("bug", "cap", "claim"),
    [
        ("short-lease", 300, "no-stale-read-reported-done"),
        ("overstated-extension", 600, "no-stale-read-reported-done"),
        ("long-lease", 50, "dead-accessor-freed-in-time"),
    ],
)
def test_a_broken_core_is_caught(bug: str, cap: int, claim: str) -> None:
    seed, _ = _first_failure(bug, cap)
    pinner_factory, accessor_factory = BUGS[bug]
    r = run_seed(seed, pinner_factory=pinner_factory, accessor_factory=accessor_factory)
    assert claim in {v.claim for v in r.violations}
    # The checker is not what is broken: the real core passes the very same seed.
    assert run_seed(seed).violations == []


def test_a_violation_is_minimized_written_and_replays(tmp_path: Path) -> None:
    seed, claim = _first_failure("short-lease", 300)
    pf, af = BUGS["short-lease"]
    small = minimize(campaign_scenario(seed), claim, pinner_factory=pf, accessor_factory=af)
    assert len(small.faults) <= len(campaign_scenario(seed).faults)
    assert any(v.claim == claim for v in run_scenario(small, pinner_factory=pf).violations)

    runner = CliRunner()
    res = runner.invoke(
        sim,
        ["--campaign", "1", "--first-seed", str(seed), "--inject-bug", "short-lease", "--out", str(tmp_path), "--json"],
    )
    assert res.exit_code == 1, res.output
    summary = json.loads(res.output[res.output.index("{") :])
    assert summary["failing_seeds"] == [seed] and summary["by_claim"] == {claim: 1}
    files = list((tmp_path / "traces").glob("*.json"))
    assert len(files) == 1
    record = json.loads(files[0].read_text())
    assert record["format"] == "kvlease-sim-trace/1" and record["claim"] == claim and record["seed"] == seed
    assert record["trace"] and record["trace"][-1][2] in ("VIOLATION", "accepted")
    assert any(ev[2] == "VIOLATION" for ev in record["trace"])
    res = runner.invoke(sim, ["--replay", str(files[0])])
    assert res.exit_code == 1
    assert any(v["claim"] == claim for v in json.loads(res.output))
    # The conformance-vector candidate: the violating lease's engines' core calls, with the
    # reference core's answers; it replays cleanly through the conformance runner.
    (vector_file,) = tmp_path.glob("*.json")
    vector = json.loads(vector_file.read_text())
    assert vector["kind"] == "trace" and vector["format"] == VECTOR_FORMAT
    ops = {step["op"] for step in vector["steps"]}
    assert {"grant", "track", "receive", "begin_access", "access_finished", "handle_timeout"} <= ops
    assert {ep["role"] for ep in vector["endpoints"].values()} == {"pinner", "accessor"}
    result = run_vector(vector, CoreImplementation())
    assert result.passed and result.checked == result.total == len(vector["steps"]), result.mismatch
