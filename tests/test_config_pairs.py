"""Hypothesis model of one pinner and one accessor configured apart (protocol v3, spec §2.2).

Each side draws its own valid `LeaseConfig` (lease duration, drift bound, margin, access-time
bound, fixed TTL, frame bound), and each clock runs within the drift bound of its *own* side
(spec §7.1 S1: the accessor computes with the larger of the two, so the bound holds for both
clocks of every comparison). A random schedule then grants and tracks renewable, fixed-TTL and
push leases, reads and writes them (finished, failed unposted, failed posted — a posted push
WRITE may still land later, within the accessor's own access-time bound from its begin, S2),
stalls the accessor for longer than either lease, partitions and slows the links. The
`kvlease.testing.Pair` audit runs after every step: never a validity past the pinner's free or
expiry, no stale read reported done, no push WRITE landing after its memory was freed, every
frame within the smaller of the two bounds. This machine adds liveness on clean leases.

`test_own_terms_accessor_is_caught` shows the model can fail: a v2 accessor that computes from
its own settings alone (`kvlease._doubles.OwnTermsAccessor`) is caught.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from conftest import EXAMPLES, STEPS
from hypothesis import Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvlease import (
    MIN_VALIDITY_MARGIN,
    Accessor,
    AccessStale,
    EndReason,
    LeaseConfig,
    LeaseKind,
    LeaseLost,
    TrackedState,
)
from kvlease._doubles import OwnTermsAccessor
from kvlease.testing import InvariantViolation, LinkProfile, Pair, PeerClock


@st.composite
def lease_configs(draw: st.DrawFn) -> LeaseConfig:
    """One side's valid configuration. Every value here is in range, and the margin stays far
    below the window of the shortest lease either side may draw, so the stricter terms of any
    two of them still give a non-empty window (spec §2.1)."""
    d = draw(st.floats(0.6, 3.0), label="kv_lease_duration")
    return LeaseConfig(
        kv_lease_duration=d,
        max_drift_rate=draw(st.sampled_from([0.0, 1e-4, 1e-3, 1e-2]), label="max_drift_rate"),
        validity_margin=max(MIN_VALIDITY_MARGIN, d * draw(st.sampled_from([0.0, 0.005, 0.02]), label="margin")),
        max_access_time=d * draw(st.floats(0.01, 0.1), label="access_frac"),
        decoder_kv_blocks_ttl=d * draw(st.floats(0.5, 3.0), label="ttl_frac"),
        max_message_bytes=draw(st.sampled_from([192, 256, 1024]), label="max_message_bytes"),
        tombstone_limit=8,
    )


def _clock(draw: st.DataObject, epoch: float, rho: float, label: str) -> PeerClock:
    """A clock within its own side's bound; the extremes as often as the interior."""
    sign = draw.draw(st.sampled_from([-1.0, 1.0, 0.5, -0.5, 0.0]), label=label)
    return PeerClock(epoch, 1.0 + sign * rho)


class ConfigPairMachine(RuleBasedStateMachine):
    #: The accessor's class; the broken-accessor test swaps it.
    accessor_cls: Any = Accessor

    def __init__(self) -> None:
        super().__init__()
        self.pair: Pair
        self.n = 0
        self.good = True
        #: Renewable leases tracked by a live, running accessor over a good link all their life.
        self.clean: set[str] = set()

    @initialize(
        data=st.data(),
        seed=st.integers(0, 2**32 - 1),
        pinner_cfg=lease_configs(),
        accessor_cfg=lease_configs(),
        epochs=st.tuples(st.floats(1e4, 2e5), st.floats(1e4, 2e5)),
    )
    def setup(
        self,
        data: st.DataObject,
        seed: int,
        pinner_cfg: LeaseConfig,
        accessor_cfg: LeaseConfig,
        epochs: tuple[float, float],
    ) -> None:
        self.pcfg, self.acfg = pinner_cfg, accessor_cfg
        event("accessor lease longer" if accessor_cfg.kv_lease_duration > pinner_cfg.kv_lease_duration else "shorter")
        self.pair = Pair(
            pinner_cfg,
            random.Random(seed),
            accessor_config=accessor_cfg,
            accessor_cls=self.accessor_cls,
            pinner_clock=_clock(data, epochs[0], pinner_cfg.max_drift_rate, "pinner_rate"),
            accessor_clock=_clock(data, epochs[1], accessor_cfg.max_drift_rate, "accessor_rate"),
            to_pinner=self._profile(True),
            to_accessor=self._profile(True),
        )

    # -- helpers ----------------------------------------------------------------------------

    @property
    def longest(self) -> float:
        return max(self.pcfg.kv_lease_duration, self.acfg.kv_lease_duration)

    def _profile(self, good: bool) -> LinkProfile:
        # Good: bounded delay well inside what renewal needs at the shorter of both periods.
        interval = min(self.pcfg.heartbeat_interval, self.acfg.heartbeat_interval)
        if good:
            return LinkProfile(0.0, 0.5 * interval)
        return LinkProfile(0.0, 3.0 * interval, drop=0.3, duplicate=0.2)

    def _keys(self, state: TrackedState, *, push: bool) -> list[str]:
        a = self.pair.accessor
        return [
            k for k, lid in self.pair.by_key.items() if a.state_of(k) is state and self.pair.leases[lid].push == push
        ]

    # -- engine actions ---------------------------------------------------------------------

    @rule(push=st.booleans(), fixed=st.booleans(), ttl_frac=st.floats(0.3, 3.0))
    def grant_and_track(self, push: bool, fixed: bool, ttl_frac: float) -> None:
        self.n += 1
        key = f"req-{self.n}"
        if fixed and not push:
            ttl = None if ttl_frac > 2.5 else ttl_frac * self.pcfg.kv_lease_duration  # None: the pinner's default
            self.pair.grant_and_track(key, kind=LeaseKind.FIXED_TTL, ttl=ttl)
            return
        self.pair.grant_and_track(key, push=push)
        if self.good and self.pair.accessor_alive and self.pair.to_pinner.up:
            self.clean.add(key)

    @precondition(lambda self: self.pair.accessor_alive)
    @rule(i=st.integers(0, 1000))
    def begin_read(self, i: int) -> None:
        keys = self._keys(TrackedState.WAITING, push=False)
        if keys:
            self.pair.begin_access(keys[i % len(keys)])

    @precondition(lambda self: self.pair.accessor_alive)
    @rule(i=st.integers(0, 1000), how=st.sampled_from(["finish", "fail-posted", "fail-unposted"]))
    def end_read(self, i: int, how: str) -> None:
        """End a READ, however long ago it began (a read has no deadline for safety: the
        accessor must ask the pinner when its window no longer covers it)."""
        keys = [k for k in self.pair.accessing() if not self.pair.record(k).push]
        if not keys:
            return
        key = keys[i % len(keys)]
        if how == "finish":
            self.pair.finish_access(key)
        else:
            self.clean.discard(key)  # a failed posted transfer gives the lease up: the engine's doing
            self.pair.fail_access(key, posted=how == "fail-posted")

    @precondition(lambda self: self.pair.accessor_alive)
    @rule(
        i=st.integers(0, 1000),
        frac=st.floats(0.0, 1.0),
        how=st.sampled_from(["finish", "fail-posted", "fail-unposted"]),
        land=st.floats(0.0, 1.0),
    )
    def push_write(self, i: int, frac: float, how: str, land: float) -> None:
        """A WRITE lasts at most the accessor's own `max_access_time` (S2). One reported
        failed after posting may still land within that bound from its begin."""
        keys = self._keys(TrackedState.WAITING, push=True)
        if not keys:
            return
        key = keys[i % len(keys)]
        for _ in range(3):
            if self.pair.accessor.valid_until(key) is not None:
                break
            # Not renewed yet: the engine's scheduler gets to it a period later.
            self.pair.advance(min(self.pcfg.heartbeat_interval, self.acfg.heartbeat_interval))
        decision = self.pair.begin_access(key)
        event(f"push write: {how}" if decision.allowed else f"push write refused: {decision.reason}")
        if not decision.allowed:
            return
        assert decision.guaranteed, "push mode must never start an unguaranteed write"
        bound = self.acfg.max_access_time
        self.pair.advance(frac * bound)
        if how == "finish":
            self.pair.finish_access(key)
            return
        self.clean.discard(key)
        if how == "fail-posted":
            event("posted push failure lands later" if land > 0.0 else "posted push failure")
            self.pair.fail_access(key, posted=True, lands_after=land * (1.0 - frac) * bound)
        else:
            self.pair.fail_access(key, posted=False)

    @precondition(lambda self: self.pair.accessor_alive)
    @rule(i=st.integers(0, 1000))
    def untrack(self, i: int) -> None:
        keys = self._keys(TrackedState.WAITING, push=False) + self._keys(TrackedState.WAITING, push=True)
        if keys:
            self.pair.untrack(sorted(keys)[i % len(keys)])

    @rule(i=st.integers(0, 1000))
    def pinner_release(self, i: int) -> None:
        live = sorted(self.pair.pinner.live_ids())
        if live:
            rec = self.pair.leases[live[i % len(live)]]
            self.clean.discard(rec.key)
            self.pair.pinner_release(rec.key)

    @precondition(lambda self: self.pair.accessor_alive)
    @rule()
    def kill_accessor(self) -> None:
        self.clean.clear()
        self.pair.kill_accessor()

    # -- time and the network ---------------------------------------------------------------

    @rule(frac=st.floats(0.0, 1.5))
    def advance(self, frac: float) -> None:
        self.pair.advance(frac * self.longest)

    @rule(frac=st.floats(0.0, 0.3))
    def advance_a_little(self, frac: float) -> None:
        self.pair.advance(frac * min(self.pcfg.heartbeat_interval, self.acfg.heartbeat_interval))

    @rule(frac=st.floats(0.0, 3.0))
    def stall_accessor(self, frac: float) -> None:
        """The accessor's process does not run (an overloaded scheduler), up to three times
        the longer lease, with its reads in flight: it must not count on a lease the pinner
        let go meanwhile."""
        self.clean.clear()
        if frac > 1.0:
            event("stall longer than the lease")
        self.pair.advance(frac * self.longest, accessor_stalled=True)

    @rule(drop_in_flight=st.booleans())
    def partition(self, drop_in_flight: bool) -> None:
        self.clean.clear()
        self.pair.partition(drop_in_flight=drop_in_flight)

    @rule()
    def heal(self) -> None:
        self.pair.heal()

    @rule(good=st.booleans())
    def set_link(self, good: bool) -> None:
        if not good:
            self.clean.clear()
        self.good = good
        self.pair.set_profiles(self._profile(good), self._profile(good))

    @rule()
    def drain(self) -> None:
        """A long quiet period; a dead accessor's leases must all be gone by its end."""
        self.pair.advance(3.0 * self.longest + self.pcfg.push_guard + 0.01)
        if not self.pair.accessor_alive:
            live = list(self.pair.pinner.live_ids())
            assert not live, f"dead accessor's leases still pinned after the drain: {live}"

    # -- liveness ---------------------------------------------------------------------------

    @invariant()
    def clean_leases_live(self) -> None:
        """Whatever the two sides' settings, a live accessor over a good link keeps its leases."""
        if not hasattr(self, "pair"):
            return
        for key in self.clean:
            rec = self.pair.record(key)
            for ev in rec.accessor_events:
                if isinstance(ev, LeaseLost | AccessStale):
                    raise InvariantViolation(f"configured apart, a live accessor lost {key!r}: {ev!r}")
            for _, free in rec.frees:
                if free.reason is EndReason.EXPIRED:
                    raise InvariantViolation(f"configured apart, a live accessor's lease {key!r} expired")

    @invariant()
    def nothing_rejected(self) -> None:
        if hasattr(self, "pair"):
            assert not self.pair.rejected, f"an honest peer was rejected: {self.pair.rejected[:3]}"


TestConfigPairs = ConfigPairMachine.TestCase
TestConfigPairs.settings = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None)


def test_own_terms_accessor_is_caught() -> None:
    """A v2 accessor (its own terms only: `OwnTermsAccessor`) counts a window from its own,
    longer lease: the audit finds a validity past the pinner's deadline."""

    class Broken(ConfigPairMachine):
        accessor_cls = OwnTermsAccessor

        # Left out, so the budget goes where the break shows (a tracked lease, renewed over a
        # working link): faults that keep a lease from being renewed at all. Shadowing a rule
        # with a plain method removes it from the machine.
        def partition(self, **kw: object) -> None: ...
        def kill_accessor(self, **kw: object) -> None: ...
        def set_link(self, **kw: object) -> None: ...
        def stall_accessor(self, **kw: object) -> None: ...

    with pytest.raises(InvariantViolation, match=r"valid until|stale access|push write") as caught:
        run_state_machine_as_test(
            Broken,
            settings=settings(
                max_examples=max(EXAMPLES, 300),
                stateful_step_count=STEPS,
                deadline=None,
                phases=[Phase.generate],
                database=None,
                derandomize=True,
            ),
        )
    assert "valid until" in str(caught.value) or "stale" in str(caught.value), caught.value
