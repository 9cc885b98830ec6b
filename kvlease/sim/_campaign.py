"""The fault campaign: many seeds of small adversarial schedules, every claim checked.

Owns: running seeds (`run_seed`, `campaign`), shrinking a violating scenario while it keeps
violating the same claim (`minimize`), cutting a trace down to what concerns the violating lease
(`relevant_trace`), and the JSON record a failure is written as (`failure_record`: a
self-describing conformance-vector candidate that replays with `kvlease sim --replay`).

The claims (spec/PROTOCOL.md) checked after every seed: no access overlaps a free in real time
(push writes), no stale read is reported done, at most one free per lease and rank, a lease whose
heartbeats stopped is freed within extension (+ the pinner's step, + delay, + push guard) of the
last heartbeat sent, and a live connected accessor on a fault-free path never loses a lease. Two
more for the API-level adversity (`ApiSpec`): a message delivered to a rank it was not addressed
to, a handshake reply delivered again, or an answer to something sent before a disconnect confers
nothing (``misdelivery-refused``: the core refuses or ignores it, and nothing visible changes);
and no message renews, counts or frees a lease whose expiry has come (``overdue-lease-not-renewed``:
at pinner time now >= expiry the lease is expired even before handle_timeout frees it). And for
protocol v3's fault models (decode engines configured apart, late posted push writes, misdelivered
parts, forged heartbeats at the frame bound, a healthy crowd): every frame encodes within its
bound (``frame-within-bound``), and a posted push write that lands late lands in memory still
pinned (``no-access-overlaps-free``).

Pure: no clock, no I/O; the CLI writes files and draws the progress bar.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from .._config import LeaseConfig
from ._cluster import Cluster
from ._kernel import AccessorFactory, PinnerFactory
from ._results import RunResult, Violation
from ._scenario import Policy, Scenario, campaign_scenario
from ._vector import build_vector

__all__ = [
    "TRACE_FORMAT",
    "CampaignFailure",
    "CampaignReport",
    "campaign",
    "failure_record",
    "minimize",
    "record_vector",
    "relevant_trace",
    "run_scenario",
    "run_seed",
]

TRACE_FORMAT = "kvlease-sim-trace/1"


@attrs.frozen
class CampaignFailure:
    seed: int
    violations: tuple[Violation, ...]


@attrs.define
class CampaignReport:
    seeds: int = 0
    events: int = 0
    failures: list[CampaignFailure] = attrs.field(factory=list)
    #: claim -> how many seeds violated it
    by_claim: dict[str, int] = attrs.field(factory=dict)


def run_scenario(
    scenario: Scenario,
    *,
    pinner_factory: PinnerFactory | None = None,
    accessor_factory: AccessorFactory | None = None,
    trace: bool = False,
) -> RunResult:
    cluster = Cluster(
        scenario,
        Policy.KVLEASE,
        pinner_factory=pinner_factory,
        accessor_factory=accessor_factory,
        check=True,
        trace=trace,
    )
    return cluster.run()


def run_seed(
    seed: int,
    *,
    config: LeaseConfig | None = None,
    pinner_factory: PinnerFactory | None = None,
    accessor_factory: AccessorFactory | None = None,
) -> RunResult:
    """One adversarial seed with every claim checked."""
    return run_scenario(
        campaign_scenario(seed, config=config), pinner_factory=pinner_factory, accessor_factory=accessor_factory
    )


def campaign(
    seeds: Iterable[int],
    *,
    pinner_factory: PinnerFactory | None = None,
    accessor_factory: AccessorFactory | None = None,
    on_seed: Callable[[int, RunResult], None] | None = None,
) -> CampaignReport:
    report = CampaignReport()
    for seed in seeds:
        result = run_seed(seed, pinner_factory=pinner_factory, accessor_factory=accessor_factory)
        report.seeds += 1
        report.events += result.events
        if result.violations:
            report.failures.append(CampaignFailure(seed, tuple(result.violations)))
            for claim in {v.claim for v in result.violations}:
                report.by_claim[claim] = report.by_claim.get(claim, 0) + 1
        if on_seed is not None:
            on_seed(seed, result)
    return report


def _violates(result: RunResult, claim: str) -> bool:
    return any(v.claim == claim for v in result.violations)


def minimize(
    scenario: Scenario,
    claim: str,
    *,
    pinner_factory: PinnerFactory | None = None,
    accessor_factory: AccessorFactory | None = None,
    budget: int = 60,
) -> Scenario:
    """Greedily simplify `scenario` (drop faults, quiet the network, fewer requests, shorter
    run) while it still violates `claim`. Deterministic; at most `budget` reruns."""

    def still(candidate: Scenario) -> bool:
        nonlocal budget
        if budget <= 0:
            return False
        budget -= 1
        result = run_scenario(candidate, pinner_factory=pinner_factory, accessor_factory=accessor_factory)
        return _violates(result, claim)

    best = scenario
    changed = True
    while changed and budget > 0:
        changed = False
        for i in range(len(best.faults)):
            cand = attrs.evolve(best, faults=best.faults[:i] + best.faults[i + 1 :])
            if still(cand):
                best, changed = cand, True
                break
        if changed:
            continue
        api = best.api
        if api is not None:
            # No API adversity at all, else each API fault off in turn.
            cands = [None] + [
                attrs.evolve(api, **{f.name: 0.0}) for f in attrs.fields(type(api)) if getattr(api, f.name)
            ]
            for cand_api in cands:
                if still(attrs.evolve(best, api=cand_api)):
                    best, changed = attrs.evolve(best, api=cand_api), True
                    break
        if changed:
            continue
        # The v3 deployment faults: the decode engines on the scenario's own settings, ids
        # consecutive.
        for cand in (
            attrs.evolve(best, decode=tuple(attrs.evolve(e, config=None) for e in best.decode)),
            attrs.evolve(best, id_gap=0),
        ):
            if cand != best and still(cand):
                best, changed = cand, True
                break
        if changed:
            continue
        net = best.network
        for quiet in (attrs.evolve(net, loss=0.0), attrs.evolve(net, dup=0.0), attrs.evolve(net, jitter=0.0)):
            if quiet != net and still(attrs.evolve(best, network=quiet)):
                best, changed = attrs.evolve(best, network=quiet), True
                break
        if changed:
            continue
        if best.max_requests > 1:
            cand = attrs.evolve(best, max_requests=max(1, best.max_requests // 2))
            if still(cand):
                best, changed = cand, True
                continue
        if best.workload.bursts:
            cand = attrs.evolve(best, workload=attrs.evolve(best.workload, bursts=()))
            if still(cand):
                best, changed = cand, True
    return best


def relevant_trace(result: RunResult, violation: Violation) -> list[tuple[float, str, str, str]]:
    """The events that concern the violating lease: its key, its lease, the faults, the
    messages between its two engines up to the violation."""
    trace = result.trace or []
    engines: set[str] = set()
    lease_name = violation.lease
    if lease_name:
        engines.add(lease_name.split("/")[0])
    key = violation.key
    key_re = re.compile(rf"(?<![\w.]){re.escape(key)}(?![\w.])") if key else None
    lease_re = re.compile(rf"{re.escape(lease_name)}(?!\d)") if lease_name else None
    # Which decoder held it: the engine that tracked the key.
    for _t, who, what, detail in trace:
        if what == "track" and key_re is not None and key_re.search(detail):
            engines.add(who.split(".")[0])
    faults = {
        "crash",
        "restart",
        "partition",
        "heal",
        "stall",
        "edge-stall",
        # API-level adversity (`ApiSpec`)
        "disconnect",
        "retrack",
        "abort",
        "misroute",
        "hold",
        "exact_end",
        "post_failed",
        "transfer_failed",
        "late_write",
        "part_misroute",
        "forged",
    }
    start = 0.0
    for t, _who, what, detail in trace:
        if what == "grant" and lease_re is not None and lease_re.search(detail):
            start = t
            break
    out = []
    for ev in trace:
        t, who, what, detail = ev
        if t > violation.at + 1e-9:
            break
        if t < start and what not in faults:
            continue
        engine = who.split(".")[0]
        mentions = (key_re is not None and key_re.search(detail)) or (lease_re is not None and lease_re.search(detail))
        between = engine in engines and what in ("send", "recv") and any(e in detail for e in engines - {engine})
        if what in faults or what == "VIOLATION" or mentions or between:
            out.append(ev)
    return out


def record_vector(
    scenario: Scenario,
    claim: str,
    *,
    name: str,
    pinner_factory: PinnerFactory | None = None,
    accessor_factory: AccessorFactory | None = None,
) -> dict[str, Any] | None:
    """Rerun `scenario` recording every core call, and turn the calls on the violating
    lease's two engines (up to the violation) into a conformance trace vector whose
    expectations are the reference core's (see `kvlease.sim._vector`). None if the rerun
    does not violate `claim`."""
    cluster = Cluster(
        scenario,
        Policy.KVLEASE,
        pinner_factory=pinner_factory,
        accessor_factory=accessor_factory,
        check=True,
        record=True,
    )
    result = cluster.run()
    violation = next((v for v in result.violations if v.claim == claim), None)
    if violation is None or cluster.recorded is None:
        return None
    engines = {violation.lease.split("/")[0]} if violation.lease else set()
    for lease in cluster.all_leases:
        if lease.name == violation.lease and lease.d_name:
            engines.add(lease.d_name)
    description = (
        f"Fault-campaign candidate: the calls the simulator made on {sorted(engines)} up to a "
        f"'{claim}' violation ({violation.detail}) in seed {scenario.seed}'s minimized scenario. "
        "Expectations are the reference core's answers to the same inputs."
    )
    return build_vector(
        name, description, scenario.config, cluster.endpoints, cluster.recorded, engines=engines, until=violation.at
    )


def failure_record(
    scenario: Scenario,
    result: RunResult,
    violation: Violation,
    *,
    original_seed: int,
    note: str = "",
) -> dict[str, Any]:
    """A self-describing JSON record of a violation: a conformance-vector candidate. It holds
    the full (minimized) scenario, so `kvlease sim --replay FILE` reruns it exactly."""
    return {
        "format": TRACE_FORMAT,
        "kind": "sim-violation",
        "description": (
            "A fault-campaign violation of a protocol claim (spec/PROTOCOL.md). Candidate for a "
            "conformance vector: replay with `kvlease sim --replay FILE`; the trace lists the "
            "core calls' inputs and outputs that concern the violating lease."
        ),
        "note": note,
        "seed": original_seed,
        "claim": violation.claim,
        "violation": violation.to_json(),
        "all_violations": [v.to_json() for v in result.violations],
        "policy": Policy.KVLEASE.value,
        "scenario": scenario.to_json(),
        "trace_fields": ["real_time", "who", "what", "detail"],
        "trace": [list(ev) for ev in relevant_trace(result, violation)],
    }
