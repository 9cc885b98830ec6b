"""`kvlease check`: the exhaustive explorer finds each v1 and v3 hole, and nothing on the fixed core.

Each hole test switches one v2 fix off through a test-only seam (a subclass of the real core:
`kvlease.check._doubles`, built on `kvlease.sim._doubles`) and narrows the action families to
those the hole needs, so breadth-first search reaches the schedule's depth in a second; the
shortest schedule is printed and must be short and name the actions that matter. The fixed core
is then explored over the CI scopes with every family on (drop and cross-engine misdelivery
left out: dropping is holding forever, for safety), with zero violations. The v3 holes (one v3
fix off each) need the deployment they live in — the accessor configured apart, a push lease,
pinner TP above accessor TP, one outstanding round — and each scope is clean on the fixed core.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import attrs
import pytest
from click.testing import CliRunner

from kvlease import Accessor, AccessorOutput
from kvlease.check import BUG_HINTS, CHECK_BUGS, Scope, explore, replay, to_vector
from kvlease.check._world import CHECK_CONFIG
from kvlease.cli import main
from kvlease.conformance import CoreImplementation, run_vector

EVERY = frozenset(
    {
        "grant",
        "release",
        "track",
        "retrack",
        "untrack",
        "begin",
        "finish",
        "fail",
        "disconnect",
        "drop",
        "dup",
        "misroute",
        "cross",
        "replay",
        "advance",
        "restart",
        "part",
        "bigbeat",
    }
)


def _only(*families: str) -> frozenset[str]:
    return EVERY - set(families)


#: bug -> (scope, words the schedule must contain, most actions it may take)
HOLES: dict[str, tuple[Scope, tuple[str, ...], int]] = {
    "retrack-accepted": (
        Scope(depth=12, without=_only("grant", "track", "deliver", "begin", "fail", "finish", "retrack")),
        ("re-track given-up", "access_failed"),
        11,
    ),
    "no-rank-check": (
        Scope(
            pinner_ranks=2,
            accessor_ranks=2,
            depth=10,
            rates=(1.0, 1.0),
            without=_only("grant", "track", "deliver", "untrack", "misroute"),
        ),
        ("misroute Release", "untrack"),
        10,
    ),
    "unbound-ack": (
        Scope(
            leases=2, depth=15, rates=(1.0, 1.0), without=_only("grant", "track", "deliver", "disconnect", "release")
        ),
        ("disconnect", "HeartbeatAck(seq=2"),
        15,
    ),
    "retry-posted-failure": (
        Scope(depth=11, without=_only("grant", "track", "deliver", "begin", "fail", "finish")),
        ("access_failed k1 on decode-0.0 (landed)",),
        10,
    ),
    "renew-at-expiry": (
        Scope(depth=8, without=_only("grant", "track", "deliver", "advance")),
        ("advance real time", "deliver Heartbeat"),
        8,
    ),
    "no-drift-margin": (
        Scope(depth=9, without=_only("grant", "track", "deliver", "advance")),
        ("deliver HeartbeatAck",),
        9,
    ),
}


#: The v3 holes (v2 behaviour): each needs the deployment it lives in. bug -> (scope, words the
#: schedule must contain, most actions it may take, words the violation must contain).
V3_HOLES: dict[str, tuple[Scope, tuple[str, ...], int, str]] = {
    # The accessor configured with a 9 s lease against the pinner's 6 s.
    "own-terms": (
        Scope(
            depth=8,
            accessor_config=CHECK_CONFIG.with_changes(kv_lease_duration=9.0),
            without=_only("grant", "track", "deliver", "advance"),
        ),
        ("advance real time", "deliver HeartbeatAck"),
        8,
        "past pinner rank 0's expiry",
    ),
    # A push WRITE fails after posting; it may land until begin + A.
    "posted-release-frees": (
        Scope(depth=10, kinds=("push",), rates=(1.0, 1.0), without=_only("grant", "track", "deliver", "begin", "fail")),
        ("access_failed k1 on decode-0.0 (posted)", "deliver Release"),
        10,
        "may still land",
    ),
    # Pinner TP 2, accessor TP 1: one part's notification reaches the other pinner rank.
    "no-to-rank": (
        Scope(
            pinner_ranks=2,
            depth=11,
            rates=(1.0, 1.0),
            without=_only("grant", "track", "deliver", "begin", "finish", "misroute", "part"),
        ),
        ("part for P0", "misroute AccessDone", "to_rank=0", "delivered to P1"),
        11,
        "stale read reported done",
    ),
    # A forged heartbeat at the frame bound.
    "no-ack-budget": (
        Scope(depth=3, without=_only("grant", "bigbeat")),
        ("forged Heartbeat near the frame bound",),
        1,
        "over the 1024-byte frame bound",
    ),
    # One round outstanding at most, tracks faster than acks return, no loss.
    "chunk-bound": (
        Scope(
            leases=2,
            depth=10,
            rates=(1.0, 1.0),
            config=CHECK_CONFIG.with_changes(max_outstanding_heartbeats=1),
            without=_only("grant", "track", "deliver"),
        ),
        ("track k2", "deliver HeartbeatAck(seq=2"),
        10,
        "liveness",
    ),
}


@pytest.mark.parametrize("bug", sorted(V3_HOLES))
def test_each_v3_hole_is_found_in_its_deployment_and_the_fixed_core_is_clean(bug: str) -> None:
    scope, words, most, what = V3_HOLES[bug]
    pinner_cls, accessor_cls, hole = CHECK_BUGS[bug]
    found = explore(scope, pinner_cls, accessor_cls)
    cx = found.violation
    assert cx is not None, f"{bug} ({hole}) not found in {found.states} states"
    print(f"\n{bug}: {hole} ({found.states} states)\n  {cx.message}\n  " + "\n  ".join(cx.schedule))
    assert len(cx.actions) <= most
    text = "\n".join(cx.schedule)
    for w in words:
        assert w in text, f"{w!r} not in the schedule:\n{text}"
    assert what in cx.message, cx.message
    clean = explore(scope)
    assert clean.violation is None, clean.violation
    assert not clean.truncated and (clean.depth_reached == scope.depth or clean.exhausted)
    assert clean.states >= found.states // 2  # the clean run covered the schedule's depth too
    # Deterministic cost, not the wall clock: each pair stays under ~20k states.
    assert found.states + clean.states < 20_000


def test_a_posted_failed_push_write_is_held_to_expiry_and_guard_on_the_fixed_core() -> None:
    """The clean side of posted-release-frees, with time: the double's schedule on the fixed core,
    then time runs to each instant that matters and the pinner handles its timeouts. The
    destination outlives the WRITE's landing bound, is freed at expiry + guard, and no audit
    trips on the way (an exhaustive run to that depth is ~100k states: too dear for every run)."""
    scope, _, _, _ = V3_HOLES["posted-release-frees"]
    pinner_cls, accessor_cls, _ = CHECK_BUGS["posted-release-frees"]
    cx = explore(scope, pinner_cls, accessor_cls).violation
    assert cx is not None
    timed = attrs.evolve(scope, without=scope.without - {"advance"})
    on_fixed, w = replay(timed, cx.rates, cx.actions)
    assert on_fixed.message == "" and not w.frees and w.landing
    while not w.frees:
        due = [a for a in w.actions() if a[0] == "timeout"]
        for a in due:
            w.apply(a)
        if not due:  # to the next instant that matters (two advances in a row compose)
            w.apply(("advance", min(w._instants())))
        assert w.real < 20.0, "never freed"
    ((t, free),) = w.frees.values()
    # The initial lease (6 s: the heartbeat at 0 extends to max(6, 0 + 4)), then the guard.
    assert free.reason.value == "released"
    assert 6.0 + CHECK_CONFIG.push_guard - 1e-6 <= t < 6.0 + CHECK_CONFIG.push_guard + 1e-3, t


class _CountingAccessor(Accessor):
    """The real accessor, counting the late covers it takes (spec §5.6 step 9)."""

    covers = 0

    def _covered_late(self, t: Any) -> tuple[AccessorOutput, ...]:
        out = super()._covered_late(t)
        _CountingAccessor.covers += bool(out)
        return out


def test_a_late_cover_completes_an_access_only_when_its_window_covers_the_finish() -> None:
    """§5.6 step 9: an ack that arrives after a CONFIRMING access finished completes it if the
    window it proves ends after the finish. Without that condition (the double) the checker
    finds a READ that outlasted the lease (its memory freed before the READ ended), reported done
    on the late ack of a heartbeat sent when it began; the real core is clean in the same families, at the worst
    clock rates (pinner fast, accessor slow), and takes late covers there."""
    scope = Scope(depth=11, rates=(1.0, 1.0), without=_only("grant", "track", "deliver", "begin", "finish", "advance"))
    pinner_cls, accessor_cls, hole = CHECK_BUGS["late-cover-ignores-finish"]
    found = explore(scope, pinner_cls, accessor_cls)
    cx = found.violation
    assert cx is not None, f"{hole}: not found in {found.states} states"
    print(f"\nlate-cover-ignores-finish: {hole} ({found.states} states)\n  {cx.message}\n  " + "\n  ".join(cx.schedule))
    assert "stale read reported done" in cx.message
    text = "\n".join(cx.schedule)
    assert text.index("access_finished") < text.index("deliver HeartbeatAck"), text
    rho = CHECK_CONFIG.max_drift_rate
    _CountingAccessor.covers = 0
    clean = explore(attrs.evolve(scope, depth=10, rates=(1.0 + rho, 1.0 - rho)), accessor_cls=_CountingAccessor)
    assert clean.violation is None, clean.violation
    assert not clean.truncated
    print(f"real core: {clean.states} states, {_CountingAccessor.covers} late covers, no violation")
    assert _CountingAccessor.covers > 0, "the clean scope never reached a late cover"


def test_every_v3_hole_has_a_command_line_scope() -> None:
    assert set(V3_HOLES) <= set(BUG_HINTS) <= set(CHECK_BUGS)


@pytest.mark.parametrize("bug", sorted(HOLES))
def test_each_v1_hole_is_found_with_a_short_schedule(bug: str) -> None:
    scope, words, most = HOLES[bug]
    pinner_cls, accessor_cls, hole = CHECK_BUGS[bug]
    result = explore(scope, pinner_cls, accessor_cls)
    cx = result.violation
    assert cx is not None, f"{bug} ({hole}) not found in {result.states} states"
    print(f"\n{bug}: {hole}\n  {cx.message}\n  " + "\n  ".join(cx.schedule))
    assert len(cx.actions) <= most
    text = "\n".join(cx.schedule)
    for w in words:
        assert w in text, f"{w!r} not in the schedule:\n{text}"
    assert any(k in cx.message for k in ("stale read", "valid until", "later than the spec", "second Free"))


def test_the_same_scopes_are_clean_on_the_fixed_core() -> None:
    """The narrowed scopes above find nothing on the real core (the doubles are the cause)."""
    for bug, (scope, _, _) in sorted(HOLES.items()):
        result = explore(scope)
        assert result.violation is None, (bug, result.violation)


#: The CI scopes: every action family but drop (subsumed by holding a message forever) and
#: cross-engine misdelivery (one engine), all clock-rate extremes, exhaustive to the depth.
CI_SCOPES = [
    # Depth 7 in CI (29,588 states; KVLEASE_CHECK_DEPTH=8: 117,395, four times the cost).
    Scope(depth=int(os.environ.get("KVLEASE_CHECK_DEPTH", "7")), without=frozenset({"drop", "cross"})),
    Scope(depth=6, kinds=("renewable", "fixed", "push"), without=frozenset({"drop", "cross"})),
    Scope(pinner_ranks=2, accessor_ranks=2, depth=6, without=frozenset({"drop", "cross"})),
    Scope(pinner_ranks=1, accessor_ranks=2, depth=5, without=frozenset({"drop", "cross"})),
]


def documented_ci_states() -> list[int]:
    """The state counts docs/model-checker.md shows for the CI scopes, in its rows' order."""
    from _docs import ROOT, parse

    (table,) = [
        t for t in parse(ROOT / "docs" / "model-checker.md").tables if t.marker and t.marker.arg == "kvlease check"
    ]
    col = table.column("states")
    assert col is not None
    return [int(row[col].replace(",", "")) for row in table.rows if "(CI)" in row[0]]


def test_fixed_core_has_no_violation_in_the_ci_scope() -> None:
    """The CI scopes are clean, and docs/model-checker.md shows their state counts as they are
    (the figure test regenerates only that table's quick rows; these cost minutes)."""
    t0 = time.perf_counter()
    total = 0
    counts = []
    for scope in CI_SCOPES:
        result = explore(scope)
        assert result.violation is None, (scope, result.violation)
        assert not result.truncated
        assert result.depth_reached == scope.depth or result.exhausted
        print(
            f"\n{scope.pinner_ranks}x{scope.accessor_ranks} kinds={scope.kinds} depth={scope.depth}: "
            f"{result.states:,} states, {result.transitions:,} transitions"
        )
        total += result.states
        counts.append(result.states)
    wall = time.perf_counter() - t0
    print(f"CI scope: {total:,} states in {wall:.1f} s")
    assert total > 100_000  # non-trivial: the happy path, faults and time all branch
    # Its cost stays bounded by the state count (deterministic), never by the wall clock of a
    # shared machine: ~108k states today (~196k at depth 8), a few minutes on one loaded core.
    assert total < 400_000
    if "KVLEASE_CHECK_DEPTH" not in os.environ:
        assert counts == documented_ci_states(), "docs/model-checker.md shows other state counts for the CI scopes"


def test_unbound_handshake_late_duplicate_after_a_pinner_restart_is_found() -> None:
    """The sixth hole needs a pinner restart: a late duplicate of the OLD incarnation's handshake
    reply, accepted after the accessor re-handshook, drops the new incarnation's lease."""
    scope = Scope(
        leases=2,
        depth=10,
        restarts=1,
        rates=(1.0, 1.0),
        without=_only("grant", "track", "deliver", "dup", "release", "restart"),
    )
    pinner_cls, accessor_cls, hole = CHECK_BUGS["unbound-handshake"]
    found = explore(scope, pinner_cls, accessor_cls)
    cx = found.violation
    assert cx is not None, hole
    print(f"\nunbound-handshake: {hole}\n  {cx.message}\n  " + "\n  ".join(cx.schedule))
    assert len(cx.actions) <= 10
    text = "\n".join(cx.schedule)
    for w in ("pinner restart", "track k2"):
        assert w in text, f"{w!r} not in the schedule:\n{text}"
    # A late duplicate, or (shorter, since v3's audit of hole 6) the old incarnation's first reply.
    assert "late duplicate of a handshake reply" in cx.message or "previous incarnation" in cx.message
    clean = explore(scope)
    assert clean.violation is None, clean.violation
    assert clean.depth_reached == scope.depth and not clean.truncated
    # Cheap enough for every run, by its state count (deterministic: ~10k today), not the wall clock.
    assert found.states + clean.states < 20_000


def test_violation_becomes_a_vector_the_conformance_runner_replays(tmp_path: Path) -> None:
    scope, _, _ = HOLES["retry-posted-failure"]
    pinner_cls, accessor_cls, _ = CHECK_BUGS["retry-posted-failure"]
    cx = explore(scope, pinner_cls, accessor_cls).violation
    assert cx is not None
    vector = to_vector(scope, cx, "check_retry", pinner_cls, accessor_cls)
    assert vector["kind"] == "trace" and len(vector["steps"]) >= len(cx.actions)
    assert {s["op"] for s in vector["steps"]} >= {"grant", "track", "receive", "begin_access", "access_failed"}
    result = run_vector(json.loads(json.dumps(vector)), CoreImplementation())
    assert result.passed, result


def test_cli_writes_the_candidate_and_conformance_replays_it(tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(
        main,
        [
            "check",
            "--inject-bug",
            "renew-at-expiry",
            "--depth",
            "8",
            "--json",
            "--out",
            str(tmp_path),
            "--without",
            "drop,dup,misroute,cross,replay,release,untrack,retrack,begin,finish,fail,disconnect",
        ],
    )
    assert res.exit_code == 1, res.output
    out = json.loads(res.output)
    assert out["violations"] == 1 and out["states"] > 0 and out["wall_s"] >= 0
    assert any("advance real time" in line for line in out["violation"]["schedule"])
    assert Path(out["vector"]).exists()
    rep = runner.invoke(main, ["conformance", "--vectors", str(tmp_path)])
    assert rep.exit_code == 0, rep.output
    clean = runner.invoke(main, ["check", "--depth", "4"])
    assert clean.exit_code == 0, clean.output
    assert "violations: 0" in clean.output


@pytest.mark.parametrize("bug", ["no-ack-budget", "posted-release-frees", "chunk-bound"])
def test_cli_finds_a_v3_hole_with_its_hinted_scope_and_hints_it_otherwise(bug: str, tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(main, ["check", "--inject-bug", bug, *BUG_HINTS[bug].split(), "--json", "--out", str(tmp_path)])
    assert res.exit_code == 1, res.output
    out = json.loads(res.output)
    assert out["violations"] == 1 and Path(out["vector"]).exists()
    rep = runner.invoke(main, ["conformance", "--vectors", str(tmp_path)])
    assert rep.exit_code == 0, rep.output
    if bug != "no-ack-budget":  # found in every scope: the forged heartbeat is one action
        missed = runner.invoke(main, ["check", "--inject-bug", bug, "--depth", "2"])
        assert missed.exit_code == 0 and f"--inject-bug {bug} {BUG_HINTS[bug]}" in missed.output, missed.output


def test_progress_reports_each_depth_and_changes_no_result() -> None:
    scope = Scope(depth=6, without=frozenset({"drop", "cross"}))
    seen: list[tuple[int, int, int]] = []
    with_progress = explore(scope, progress=lambda *counts: seen.append(counts))
    plain = explore(scope)
    assert attrs.asdict(with_progress) == attrs.asdict(plain)
    assert plain.transitions > 2048  # so that mid-depth reports happen too
    assert [d for d, _, _ in seen] == sorted(d for d, _, _ in seen)
    ends = {d: (states, transitions) for d, states, transitions in seen}
    assert sorted(ends) == list(range(1, 7)) and ends[6] == (plain.states, plain.transitions)
    assert len(seen) > 6


def test_unretired_handshake_across_a_pinner_restart_is_found() -> None:
    """v3 hole 6: a handshake sent to the old incarnation (for a ticket of it), the pinner
    restarts and grants, the new ticket is tracked, and the old incarnation's delayed reply is
    accepted: the new lease is lost as pinner_restarted. v3 forgets outstanding handshakes when
    a ticket of another incarnation is tracked; the double does not."""
    scope = Scope(
        leases=2,
        depth=8,
        restarts=1,
        rates=(1.0, 1.0),
        without=_only("grant", "track", "deliver", "release", "restart"),
    )
    pinner_cls, accessor_cls, hole = CHECK_BUGS["unretired-handshake"]
    found = explore(scope, pinner_cls, accessor_cls)
    cx = found.violation
    assert cx is not None, hole
    print(f"\nunretired-handshake: {hole}\n  {cx.message}\n  " + "\n  ".join(cx.schedule))
    assert "previous incarnation" in cx.message and "pinner restart" in "\n".join(cx.schedule)
    clean = explore(scope)
    assert clean.violation is None, clean.violation
    assert clean.depth_reached == scope.depth and not clean.truncated
