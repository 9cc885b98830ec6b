"""API-level adversity in the fault campaign: what an engine can do through the API at the worst
moment (`kvlease.sim.ApiSpec`), and each v1 behaviour it catches.

About half the campaign seeds draw API faults on top of the network ones: re-tracking a ticket
after untrack, completion, disconnect or a posted failed transfer; the same ticket handed to a
second request; a transfer that fails after its attached notification landed (or before it was
posted, then retried); messages and handshake replies misrouted to a sibling rank of the right
engine (p != a and p = a > 1); handshake replies delivered again later; disconnects; ranks of an
engine reading one clock; a transfer ending exactly at valid_until; a message handled exactly at
a lease's expiry; and the smallest validity margin. Each protocol-v1 behaviour the adversarial
review found (a subclass of the real core with one v2 fix switched off, `kvlease.sim.BUGS`) is
caught by the extended campaign within a bounded number of seeds, on the claim it breaks, while
the real core passes those same seeds.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import attrs
import pytest
from click.testing import CliRunner

from kvlease import (
    MIN_VALIDITY_MARGIN,
    Accessor,
    HandshakeNeeded,
    HeartbeatAck,
    LeaseConfig,
    LocalProtocolError,
    LocalTime,
    Pinner,
    Rejected,
    Send,
)
from kvlease.cli._sim import sim
from kvlease.sim import BUGS, ApiSpec, Cluster, Policy, RunResult, Scenario, campaign_scenario, run_scenario, run_seed

#: The seeds the doubles are hunted in (each is caught well inside these).
SEEDS = range(200)


@pytest.fixture(scope="module")
def real_core() -> dict[int, RunResult]:
    return {seed: run_seed(seed) for seed in SEEDS}


def test_the_real_core_passes_the_extended_seeds_and_the_api_faults_happen(real_core: dict[int, RunResult]) -> None:
    failures = {seed: r.violations for seed, r in real_core.items() if r.violations}
    assert failures == {}
    scenarios = [campaign_scenario(seed) for seed in SEEDS]
    with_api = [sc for sc in scenarios if sc.api is not None]
    assert 70 <= len(with_api) <= 130  # about half the seeds
    # Topologies with ranks to misroute between, the smallest margin.
    tps = {(p.tp, d.tp) for sc in with_api for p in sc.prefill for d in sc.decode}
    assert any(p == a > 1 for p, a in tps) and any(p > a for p, a in tps) and any(p < a for p, a in tps)
    assert any(sc.config.validity_margin == MIN_VALIDITY_MARGIN for sc in with_api)
    seen: Counter[str] = Counter()
    for r in real_core.values():
        seen.update(r.api)
    for kind in (
        "abort",
        "disconnect",
        "exact-end",
        "failed-after-notify",
        "failed-unposted",
        "held-to-expiry",
        "misrouted-reply",
        "misrouted-to-accessor",
        "misrouted-to-pinner",
        "reply-again",
        "stale-or-misdelivered",
        "retrack-after-completion-refused",
        "retrack-after-untrack-refused",
        "retrack-after-disconnect-refused",
        "retrack-after-failed-transfer-refused",
        "redispatch-refused",
        "redispatch-accepted",
    ):
        assert seen[kind] > 0, (kind, seen)
    # The real core never lets an engine re-track a lease after completion, untrack or a failed
    # transfer (the engine recomputes); a redispatch to another engine is the pinner's to refuse.
    for kind in ("completion", "untrack", "failed-transfer"):
        assert seen[f"retrack-after-{kind}-accepted"] == 0


#: v1 behaviour -> the claim the extended campaign catches it on.
CAUGHT = [
    ("retrack-accepted", "no-stale-read-reported-done"),
    ("retry-posted-failure", "no-stale-read-reported-done"),
    ("no-binding", "no-stale-read-reported-done"),
    ("unbound-replies", "misdelivery-refused"),
    ("no-rank-check", "misdelivery-refused"),
    ("renew-at-expiry", "overdue-lease-not-renewed"),
]


@pytest.mark.parametrize(("bug", "claim"), CAUGHT)
def test_each_v1_behaviour_is_caught_and_the_real_core_passes_the_same_seeds(
    bug: str, claim: str, real_core: dict[int, RunResult]
) -> None:
    pinner_factory, accessor_factory = BUGS[bug]
    caught = []
    for seed in SEEDS:
        r = run_seed(seed, pinner_factory=pinner_factory, accessor_factory=accessor_factory)
        if any(v.claim == claim for v in r.violations):
            caught.append(seed)
            if len(caught) == 2:
                break
    assert caught, f"the extended campaign did not catch {bug!r} in {len(SEEDS)} seeds"
    for seed in caught:
        assert real_core[seed].violations == []
        assert campaign_scenario(seed).api is not None or claim == "overdue-lease-not-renewed"


def test_the_v1_doubles_can_be_injected_from_the_command_line() -> None:
    pinner_factory, _ = BUGS["renew-at-expiry"]
    seed = next(s for s in SEEDS if run_seed(s, pinner_factory=pinner_factory).violations)
    res = CliRunner().invoke(
        sim,
        [
            "--campaign",
            "1",
            "--first-seed",
            str(seed),
            "--inject-bug",
            "renew-at-expiry",
            "--json",
            "--max-reports",
            "0",
        ],
    )
    assert res.exit_code == 1, res.output
    summary = json.loads(res.output[res.output.index("{") :])
    assert summary["failing_seeds"] == [seed] and "overdue-lease-not-renewed" in summary["by_claim"]


def _digest(result: RunResult) -> str:
    return hashlib.sha256(json.dumps([result.summary(), result.trace], sort_keys=True).encode()).hexdigest()


def test_api_faults_are_deterministic_per_seed_and_off_changes_nothing() -> None:
    seed = next(s for s in SEEDS if campaign_scenario(s).api is not None)
    sc = campaign_scenario(seed)
    assert _digest(run_scenario(sc, trace=True)) == _digest(run_scenario(sc, trace=True))
    # Every knob at zero draws nothing: the run is the one without API adversity.
    off = run_scenario(attrs.evolve(sc, api=None), trace=True)
    zero = run_scenario(attrs.evolve(sc, api=ApiSpec()), trace=True)
    assert _digest(off) == _digest(zero) and not zero.api
    # A scenario with API faults round-trips through JSON (replay), knobs included.
    assert Scenario.from_json(json.loads(json.dumps(sc.to_json()))) == sc
    # The baselines ignore it (it is about the kvlease API).
    base = Cluster(sc, Policy.FIXED_30).run()
    assert base.api == {} and base.summary() == Cluster(attrs.evolve(sc, api=None), Policy.FIXED_30).run().summary()


def test_one_fault_off_leaves_the_others_draws_alone() -> None:
    """Each kind of API fault draws from its own stream (what lets `minimize` switch one off)."""
    api = ApiSpec(misroute=0.1, dup_reply=1.0, disconnect=0.5)
    sc = attrs.evolve(campaign_scenario(3), api=api)
    both = run_scenario(sc).api
    no_dup = run_scenario(attrs.evolve(sc, api=attrs.evolve(api, dup_reply=0.0))).api
    assert both["disconnect"] == no_dup["disconnect"] and "reply-again" not in no_dup


def test_an_access_ends_exactly_at_valid_until_and_messages_land_exactly_at_expiry() -> None:
    """The boundaries: the accessor is told the transfer finished at a reading equal to its
    valid_until (not covered, so it asks the pinner), and a pinner handles a held message at a
    reading equal to a lease's expiry (expired: neither renewed nor counted). The smallest
    margin keeps both safe."""
    exact = at_expiry = 0
    for seed in range(40):
        sc = campaign_scenario(seed)
        sc = attrs.evolve(
            sc,
            api=ApiSpec(exact_end=1.0, at_expiry=0.2, notify=0.5),
            config=sc.config.with_changes(validity_margin=MIN_VALIDITY_MARGIN),
        )
        r = run_scenario(sc, trace=True)
        assert r.violations == [], (seed, r.violations)
        assert r.trace is not None
        for _t, _who, what, detail in r.trace:
            if what == "exact_end":
                # "KEY at valid_until V (reading R)": the reading handed to the core is V itself.
                v = float(detail.split("valid_until ")[1].split(" ")[0])
                reading = float(detail.split("(reading ")[1].rstrip(")"))
                exact += reading == v
        at_expiry += r.api.get("held-to-expiry", 0)
    assert exact > 10 and at_expiry > 10


def test_misrouted_acks_to_a_sibling_with_an_equal_clock_are_refused() -> None:
    """Ranks of one engine read one clock and take the same seqs, so an ack for rank 0 matches
    rank 1's outstanding heartbeat exactly: only its to_rank tells them apart."""
    cfg = LeaseConfig(kv_lease_duration=6.0)
    p = Pinner(cfg, "P", 5)
    accs = [Accessor(cfg, "D", session=100 + r, rank=r, ranks=2) for r in range(2)]
    ticket = p.grant(LocalTime(0.0), "k")
    for acc in accs:
        (hs,) = acc.track(LocalTime(1.0), "k", ticket)
        assert isinstance(hs, HandshakeNeeded)
        acc.handshake_reply(LocalTime(1.0), p.handshake_reply(LocalTime(0.0), hs.message))
    sends = [acc.handle_timeout(LocalTime(2.0)) for acc in accs]
    (hb0,), (hb1,) = sends
    assert isinstance(hb0, Send) and isinstance(hb1, Send)
    assert (hb0.message.seq, hb0.message.t_send) == (hb1.message.seq, hb1.message.t_send)  # type: ignore[union-attr]
    (ack0,) = p.receive(LocalTime(0.5), hb0.message)
    assert isinstance(ack0, Send) and isinstance(ack0.message, HeartbeatAck)
    before = accs[1].valid_until("k")
    out = accs[1].receive(LocalTime(2.1), ack0.message)
    assert len(out) == 1 and isinstance(out[0], Rejected) and accs[1].valid_until("k") == before
    bug = BUGS["unbound-replies"][1]
    assert bug is not None
    unbound = bug(cfg, "D", 1, 2, 101)
    (hs,) = unbound.track(LocalTime(1.0), "k", ticket)
    assert isinstance(hs, HandshakeNeeded)
    unbound.handshake_reply(LocalTime(1.0), p.handshake_reply(LocalTime(0.6), hs.message))
    unbound.handle_timeout(LocalTime(2.0))
    assert unbound.receive(LocalTime(2.1), ack0.message) == () and unbound.valid_until("k") is not None


def test_a_retrack_after_disconnect_with_the_access_in_flight_is_refused() -> None:
    cfg = LeaseConfig(kv_lease_duration=6.0)
    p = Pinner(cfg, "P", 5)
    acc = Accessor(cfg, "D", session=7)
    ticket = p.grant(LocalTime(0.0), "k")
    (hs,) = acc.track(LocalTime(1.0), "k", ticket)
    assert isinstance(hs, HandshakeNeeded)
    acc.handshake_reply(LocalTime(1.0), p.handshake_reply(LocalTime(0.0), hs.message))
    assert acc.begin_access(LocalTime(1.5), "k").allowed
    acc.disconnect(LocalTime(1.6), "P")  # the transfer (and its notification) is still in flight
    with pytest.raises(LocalProtocolError):
        acc.track(LocalTime(1.7), "k-again", ticket)


# -- protocol v3's holes ---------------------------------------------------------------------

#: The seeds the v3 doubles are hunted in (each is caught well inside them).
V3_SEEDS = range(60)


def _apart(sc: Scenario) -> bool:
    return any(e.config is not None and e.config != sc.config for e in sc.decode)


#: v2 behaviour (a v3 fix off, `kvlease._doubles`) -> the claim the v3 fault models catch it on,
#: and the fault model the catching seed must have.
V3_CAUGHT = [
    ("own-terms", "no-stale-read-reported-done", _apart),
    ("posted-release-frees", "no-access-overlaps-free", lambda sc: sc.api is not None and sc.api.late_write > 0),
    ("no-to-rank", "misdelivery-refused", lambda sc: sc.api is not None and sc.api.part_misroute > 0),
    ("no-ack-budget", "frame-within-bound", lambda sc: sc.api is not None and sc.api.forged_heartbeat > 0),
    # A liveness failure on a healthy network: the crowd has no loss and no scheduled faults.
    ("chunk-bound", "live-accessor-keeps-lease", lambda sc: sc.id_gap > 0 and not sc.faults and not sc.network.loss),
]


def test_the_v3_fault_models_are_drawn_and_happen(real_core: dict[int, RunResult]) -> None:
    scenarios = [campaign_scenario(seed) for seed in SEEDS]
    apart = [sc for sc in scenarios if _apart(sc)]
    assert 40 <= len(apart) <= 120
    # Decode configs drawn apart in every setting the accessor takes the stricter of.
    for field in ("kv_lease_duration", "max_drift_rate", "validity_margin", "max_access_time", "max_message_bytes"):
        values = {getattr(e.config, field) > getattr(sc.config, field) for sc in apart for e in sc.decode if e.config}
        assert values == {True, False}, field
    assert any(sc.id_gap for sc in scenarios) and any(sc.max_requests == 40 for sc in scenarios)
    seen: Counter[str] = Counter()
    for r in real_core.values():
        seen.update(r.api)
    for kind in ("late-write", "part-misrouted", "forged-heartbeat"):
        assert seen[kind] > 20, (kind, seen)


@pytest.mark.parametrize(("bug", "claim", "has_model"), V3_CAUGHT, ids=[b for b, _, _ in V3_CAUGHT])
def test_each_v2_behaviour_is_caught_by_the_v3_fault_models(
    bug: str, claim: str, has_model: object, real_core: dict[int, RunResult]
) -> None:
    pinner_factory, accessor_factory = BUGS[bug]
    seed = next(
        (
            s
            for s in V3_SEEDS
            if any(
                v.claim == claim
                for v in run_seed(s, pinner_factory=pinner_factory, accessor_factory=accessor_factory).violations
            )
        ),
        None,
    )
    assert seed is not None, f"the v3 fault models did not catch {bug!r} in {len(V3_SEEDS)} seeds"
    assert real_core[seed].violations == []  # the checker is not what is broken
    sc = campaign_scenario(seed)
    assert callable(has_model) and has_model(sc), (bug, seed)
    # And it is that fault model which finds it: without it the same seed passes.
    if bug == "own-terms":
        off = attrs.evolve(sc, decode=tuple(attrs.evolve(e, config=None) for e in sc.decode))
    elif bug == "chunk-bound":
        off = attrs.evolve(sc, decode=tuple(attrs.evolve(e, config=None) for e in sc.decode), id_gap=0)
    else:
        assert sc.api is not None
        knob = {
            "posted-release-frees": "late_write",
            "no-to-rank": "part_misroute",
            "no-ack-budget": "forged_heartbeat",
        }
        off = attrs.evolve(sc, api=attrs.evolve(sc.api, **{knob[bug]: 0.0}))
    r = run_scenario(off, pinner_factory=pinner_factory, accessor_factory=accessor_factory)
    assert not any(v.claim == claim for v in r.violations), (bug, seed, r.violations)


def test_a_v3_double_can_be_injected_from_the_command_line_and_its_record_replays(tmp_path: Path) -> None:
    pinner_factory, _ = BUGS["posted-release-frees"]
    seed = next(s for s in V3_SEEDS if run_seed(s, pinner_factory=pinner_factory).violations)
    args = ["--campaign", "1", "--first-seed", str(seed), "--inject-bug", "posted-release-frees", "--json"]
    runner = CliRunner()
    res = runner.invoke(sim, [*args, "--max-reports", "1", "--out", str(tmp_path)])
    assert res.exit_code == 1, res.output
    summary = json.loads(res.output[res.output.index("{") :])
    assert summary["failing_seeds"] == [seed] and "no-access-overlaps-free" in summary["by_claim"]
    (record,) = (tmp_path / "traces").glob("*.json")
    assert any(ev[2] == "late_write" for ev in json.loads(record.read_text())["trace"])
    res = runner.invoke(sim, ["--replay", str(record)])
    assert res.exit_code == 1 and any(v["claim"] == "no-access-overlaps-free" for v in json.loads(res.output))


def test_a_scenario_with_configs_apart_and_ids_far_apart_round_trips() -> None:
    sc = next(
        campaign_scenario(s)
        for s in SEEDS
        if _apart(campaign_scenario(s)) and campaign_scenario(s).id_gap and campaign_scenario(s).api is not None
    )
    assert Scenario.from_json(json.loads(json.dumps(sc.to_json()))) == sc
    # Every decode engine's accessor runs its own config; the pinners run the scenario's.
    cluster = Cluster(sc, Policy.KVLEASE)
    for e in sc.decode:
        assert cluster.d[e.name].accessors[0].config == sc.config_of(e.name)
    for e in sc.prefill:
        assert cluster.p[e.name].pinners[0].config == sc.config


def test_every_frame_the_honest_core_sends_fits_the_bound_with_ids_far_apart() -> None:
    """At the smallest frame bound with ids up to 2**56 apart a few ids fill a chunk, so rounds
    split into several heartbeats; every frame still encodes within the bound (the
    ``frame-within-bound`` claim, which `no-ack-budget` breaks)."""
    split = 0
    for seed in range(8):
        sc = campaign_scenario(seed)
        sc = attrs.evolve(sc, config=sc.config.with_changes(max_message_bytes=192), id_gap=1 << 56, api=None)
        r = run_scenario(sc, trace=True)
        assert r.violations == [], (seed, r.violations)
        assert r.trace is not None
        chunks = Counter(
            (t, who, d.split(":")[0]) for t, who, what, d in r.trace if what == "send" and "Heartbeat(" in d
        )
        split += sum(1 for n in chunks.values() if n > 1)
    assert split > 10
