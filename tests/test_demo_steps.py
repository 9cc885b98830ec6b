"""The demo's steps and deadlines (`kvlease.cli._demo_steps`): a scenario gives up only when a
step has gone without progress for longer than it can legitimately be quiet on this machine,
and then says which step waited, for what, and how things stood.

Time is driven by hand; one real run checks that the message reaches the user (``--patience``
makes the deadline impossible, so no loaded machine is needed).
"""

from __future__ import annotations

import json
import subprocess
import sys

from kvlease import LeaseConfig
from kvlease.cli._demo_scenarios import Bounds, ScenarioResult, ScenarioRun, _reclaim_claim
from kvlease.cli._demo_steps import MARGIN_FLOOR, STARTUP_CAP, STARTUP_QUIET, STEPS, Calibration, Steps

T0 = 5_000.0  # the parent's monotonic clock: any epoch
PIDS = {"pinner": 101, "accessor": 102}


def _run(n: int) -> ScenarioRun:
    return ScenarioRun("overload", "nixl", n, 16, {"pinner": 1e4, "accessor": 2e4}, started=T0)


def _started(steps: Steps, now: float, *, pinner: float = 1.0, accessor: float = 1.0) -> float:
    """Both processes start (taking `pinner` and `accessor` seconds) and connect."""
    now += pinner
    steps.observe("pinner", "ready", now)
    now += accessor
    steps.observe("accessor", "ready", now)
    now += 0.01
    steps.observe("accessor", "connected", now)
    return now


def test_steps_follow_the_events_in_order_and_record_their_durations() -> None:
    steps = Steps(2, quiet=7.0, calibration=Calibration(), started=T0)
    assert steps.index == 0 and steps.starting == "pinner"
    now = _started(steps, T0, pinner=3.0, accessor=4.0)
    assert steps.index == 3 and steps.starting is None
    for role, kind in [("pinner", "grant"), ("accessor", "track"), ("pinner", "grant")]:
        now += 0.1
        steps.observe(role, kind, now)
        assert steps.index == 3
    steps.observe("accessor", "track", now)
    assert steps.index == 4
    now += 6.0
    steps.observe("accessor", "eof", now)
    assert steps.index == 5
    steps.observe("pinner", "eof", now + 1.0)
    assert steps.index == len(STEPS) and not steps.expired(now + 1e6)  # done: never expires
    assert list(steps.seconds) == [name for name, _ in STEPS]
    assert steps.seconds["start the pinner process"] == 3.0 and steps.seconds["start the accessor process"] == 4.0
    assert steps.seconds["play the scenario"] == 6.0 and steps.seconds["wind down"] == 1.0


def test_a_later_step_waits_its_scenarios_quiet_time_plus_a_margin_from_the_slowest_start_up() -> None:
    calibration = Calibration()
    steps = Steps(1, quiet=7.0, calibration=calibration, started=T0)
    # A loaded machine: the pinner took 12 s to start (torch, NIXL), the accessor 3 s.
    now = _started(steps, T0, pinner=12.0, accessor=3.0)
    assert calibration.slowest_startup == 12.0 and calibration.margin == 48.0
    assert steps.deadline() == now + 7.0 + 48.0
    # Heartbeats and stats are not progress (they go on forever if a step hangs) ...
    steps.observe("pinner", "heartbeat", now + 50.0)
    steps.observe("pinner", "stats", now + 50.0)
    assert steps.deadline() == now + 55.0
    # ... a grant is, and so is every later lease event.
    steps.observe("pinner", "grant", now + 50.0)
    assert steps.deadline() == now + 105.0 and not steps.expired(now + 105.0) and steps.expired(now + 105.01)
    # A quiet machine: the floor.
    quiet = Calibration()
    _started(Steps(1, quiet=7.0, calibration=quiet, started=T0), T0, pinner=0.3, accessor=0.2)
    assert quiet.margin == MARGIN_FLOOR


def test_the_calibration_carries_over_to_the_next_scenario() -> None:
    calibration = Calibration()
    _started(Steps(1, quiet=1.0, calibration=calibration, started=T0), T0, pinner=9.0, accessor=2.0)
    later = Steps(1, quiet=1.0, calibration=calibration, started=T0 + 100)
    now = _started(later, T0 + 100, pinner=1.0, accessor=1.0)  # a faster start this time
    assert calibration.slowest_startup == 9.0 and later.deadline() == now + 1.0 + 36.0


def test_a_start_up_waits_while_the_child_uses_cpu_and_gives_up_when_it_does_not() -> None:
    steps = Steps(1, quiet=1.0, calibration=Calibration(), started=T0)
    now = T0
    for _ in range(10):  # importing torch slowly: 20 s of wall time, CPU used all along
        now += 2.0 + STARTUP_QUIET / 2
        steps.cpu("pinner", now - T0, now)
        steps.cpu("accessor", 99.0, now)  # not the process that is starting: ignored
        assert not steps.expired(now)
    cpu = now - T0
    steps.cpu("pinner", cpu, now + 10.0)  # no more CPU: stuck (a lock, a socket)
    steps.cpu("pinner", None, now + 20.0)  # /proc unreadable: no evidence either way
    assert not steps.expired(now + STARTUP_QUIET) and steps.expired(now + STARTUP_QUIET + 0.01)
    why = steps.why(_run(1), now + STARTUP_QUIET + 0.01, PIDS)
    assert why.startswith("timed out in step 1/6 'start the pinner process' after ")
    assert f"limit {STARTUP_QUIET:g} s without an event or CPU time used" in why
    assert "waited for the pinner process to start its transport and report 'ready': pid 101 running" in why
    assert f"{cpu:.3g} s of CPU used" in why and "no event yet" in why


def test_a_start_up_that_keeps_using_cpu_is_still_capped() -> None:
    steps = Steps(1, quiet=1.0, calibration=Calibration(patience=2.0), started=T0)
    now = T0
    while now <= T0 + 2 * STARTUP_CAP:
        now += 1.0
        steps.cpu("pinner", now - T0, now)
    assert steps.expired(now)
    assert f"at most {2 * STARTUP_CAP:g} s to start" in steps.why(_run(1), now, PIDS)


def test_patience_scales_every_window() -> None:
    calibration = Calibration(patience=3.0)
    steps = Steps(1, quiet=7.0, calibration=calibration, started=T0)
    assert steps.deadline() == T0 + 3.0 * STARTUP_QUIET
    now = _started(steps, T0)
    assert steps.deadline() == now + 3.0 * 7.0 + 3.0 * MARGIN_FLOOR


def test_why_says_where_the_scenario_stood() -> None:
    run = _run(3)
    steps = Steps(3, quiet=2.0, calibration=Calibration(), started=T0)
    now = _started(steps, T0)
    feed = [
        ("pinner", {"ev": "grant", "key": "req-0"}),
        ("pinner", {"ev": "grant", "key": "req-1"}),
        ("accessor", {"ev": "track", "key": "req-0"}),
    ]
    for role, ev in feed:
        now += 0.1
        run.feed(role, {**ev, "t": now})
        steps.observe(role, ev["ev"], now)
    why = steps.why(run, now + 100, PIDS)
    assert "step 4/6 'grant and track the leases'" in why and "2/3 granted, 1/3 tracked" in why
    assert "last progress 100 s ago: 'track' from the accessor" in why

    for role, ev in [
        ("pinner", {"ev": "grant", "key": "req-2"}),
        ("accessor", {"ev": "track", "key": "req-1"}),
        ("accessor", {"ev": "track", "key": "req-2"}),
        ("accessor", {"ev": "read_start", "key": "req-0"}),
        ("accessor", {"ev": "read_start", "key": "req-1"}),
        ("accessor", {"ev": "read", "key": "req-0", "verdict": "valid"}),
        ("pinner", {"ev": "free", "key": "req-0", "reason": "access_done"}),
        ("accessor", {"ev": "read", "key": "req-2", "verdict": "refused"}),
        ("pinner", {"ev": "free", "key": "req-2", "reason": "expired"}),
    ]:
        now += 0.1
        run.feed(role, {**ev, "t": now})
        steps.observe(role, ev["ev"], now)
    assert steps.index == 4
    limit = 2.0 + MARGIN_FLOOR
    assert not steps.expired(now + limit) and steps.expired(now + limit + 0.01)
    why = steps.why(run, now + limit + 0.01, PIDS)
    assert why.startswith(f"timed out in step 5/6 'play the scenario' after {limit + 0.01 + 0.6:.3g} s")
    assert f"limit {limit:g} s without progress: the scenario's quiet time 2 s + margin {MARGIN_FLOOR:g} s" in why
    assert "2/3 requests resolved (reads: 1 refused, 1 valid)" in why
    assert "reads in flight: req-1" in why and "2/3 freed at the pinner (1 access_done, 1 expired)" in why
    assert "still pinned: req-1" in why and "'free' from the pinner" in why


def test_a_demo_whose_deadline_cannot_be_met_says_which_step_waited_for_what() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvlease",
            "demo",
            "--scenario",
            "happy",
            "--requests",
            "2",
            "--json",
            "--patience",
            "1e-4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    (finished,) = [c for c in json.loads(proc.stdout)["scenarios"][0]["claims"] if c["name"] == "finished"]
    assert not finished["ok"]
    detail = finished["detail"]
    assert detail.startswith("timed out in step ") and "waited for " in detail and "(limit " in detail, detail
    assert any(f"'{name}'" in detail for name, _ in STEPS), detail
    assert detail in proc.stderr  # said on stderr too, when it happens


def test_a_late_free_passes_only_when_the_pinners_own_loop_ran_that_late() -> None:
    bounds = Bounds.from_config(LeaseConfig(kv_lease_duration=2.5, max_access_time=0.25), 0.02)
    run = _run(2)
    for key in ("req-0", "req-1"):
        run.feed("pinner", {"ev": "grant", "key": key, "t": T0})
    due = bounds.reclaim_deadline(T0, last_heartbeat=None)
    # req-0 on time; req-1 3 s late, from a loop that itself woke 3.2 s late (starved).
    run.feed("pinner", {"ev": "free", "key": "req-0", "reason": "expired", "t": due - 0.1, "loop_late": 0.0})
    run.feed("pinner", {"ev": "free", "key": "req-1", "reason": "expired", "t": due + 3.0, "loop_late": 3.2})
    res = ScenarioResult("crash", "nixl")
    _reclaim_claim(run, bounds, None, res)
    (claim,) = res.claims
    assert claim.ok and "1 late by up to 3 s, each no more than the pinner's own loop ran late" in claim.text
    assert res.figures["pinner_loop_late_at_free_s"] == 3.2
    # The same late free from a loop that ran on time: the core decided late.
    run.frees["req-1"][0]["loop_late"] = 0.01
    res = ScenarioResult("crash", "nixl")
    _reclaim_claim(run, bounds, None, res)
    (claim,) = res.claims
    assert not claim.ok and claim.text == "late: req-1 by 3 s (the pinner's loop only 0.01 s)"
