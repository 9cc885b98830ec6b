"""Hypothesis stateful model of one pinner and one accessor over lossy links, with drifting
clocks at random epochs. `kvlease.testing.Pair` audits the safety invariants at every step in
real time; this machine adds the liveness ones (a clean lease is never lost, a dead accessor's
leases are all freed) and shows that the checker catches a deliberately broken accessor.
"""

from __future__ import annotations

import random
from typing import Any

import attrs
import pytest
from conftest import EXAMPLES, STEPS
from hypothesis import Phase, settings
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
    AccessorOutput,
    AccessStale,
    EndReason,
    HandshakeReply,
    LeaseConfig,
    LeaseKind,
    LeaseLost,
    LocalTime,
    TrackedState,
)
from kvlease._terms import LeaseTerms
from kvlease.testing import InvariantViolation, LinkProfile, Pair, PeerClock


def _profiles(cfg: LeaseConfig, good: bool) -> tuple[LinkProfile, LinkProfile]:
    interval = cfg.heartbeat_interval
    # Good: bounded delay, no loss, well inside what renewal needs (an interval plus two
    # delays must fit in the accessor's extension, about 4 intervals). Bad: lossy and slow.
    p = LinkProfile(0.0, 0.5 * interval) if good else LinkProfile(0.0, 3.0 * interval, drop=0.3, duplicate=0.2)
    return p, p


class LeaseMachine(RuleBasedStateMachine):
    #: The accessor's class; the broken-accessor test swaps it.
    accessor_cls: Any = Accessor

    def __init__(self) -> None:
        super().__init__()
        self.pair: Pair
        self.n = 0
        self.good = True
        #: Renewable leases tracked by a live accessor over a good link all their life.
        self.clean: set[str] = set()

    #: Parameter spaces; the broken-accessor test narrows them to where the break shows.
    DRIFTS: tuple[float, ...] = (0.0, 1e-4, 1e-3, 1e-2)
    MARGINS: tuple[float, ...] = (0.0, 0.005, 0.02)
    #: Clock rates as multiples of the drift bound (pinner, accessor); the extremes matter most.
    PINNER_RATES: tuple[float, ...] = (-1.0, 1.0, 0.5, -0.5, 0.0)
    ACCESSOR_RATES: tuple[float, ...] = (-1.0, 1.0, 0.5, 0.0)

    @initialize(
        data=st.data(),
        seed=st.integers(0, 2**32 - 1),
        duration=st.floats(0.6, 3.0),
        access_frac=st.floats(0.01, 0.2),
        max_bytes=st.sampled_from([192, 256, 1024]),
        epochs=st.tuples(st.floats(1e4, 2e5), st.floats(1e4, 2e5)),
    )
    def setup(
        self,
        data: st.DataObject,
        seed: int,
        duration: float,
        access_frac: float,
        max_bytes: int,
        epochs: tuple[float, float],
    ) -> None:
        rate_signs = (
            data.draw(st.sampled_from(self.PINNER_RATES), label="pinner_rate"),
            data.draw(st.sampled_from(self.ACCESSOR_RATES), label="accessor_rate"),
        )
        drift = data.draw(st.sampled_from(self.DRIFTS), label="max_drift_rate")
        margin_frac = data.draw(st.sampled_from(self.MARGINS), label="margin_frac")
        cfg = LeaseConfig(
            kv_lease_duration=duration,
            max_access_time=access_frac * duration,
            max_drift_rate=drift,
            validity_margin=max(MIN_VALIDITY_MARGIN, margin_frac * duration),
            max_message_bytes=max_bytes,
            decoder_kv_blocks_ttl=2 * duration,
            tombstone_limit=8,
        )
        to_p, to_a = _profiles(cfg, True)
        self.pair = Pair(
            cfg,
            random.Random(seed),
            accessor_cls=self.accessor_cls,
            pinner_clock=PeerClock(epochs[0], 1.0 + rate_signs[0] * drift),
            accessor_clock=PeerClock(epochs[1], 1.0 + rate_signs[1] * drift),
            to_pinner=to_p,
            to_accessor=to_a,
        )
        self.cfg = cfg

    # -- helpers ----------------------------------------------------------------------------

    def _keys(self, state: TrackedState, *, push: bool | None = None) -> list[str]:
        a = self.pair.accessor
        return [
            k
            for k, lid in self.pair.by_key.items()
            if a.state_of(k) is state and (push is None or self.pair.leases[lid].push == push)
        ]

    def _dirty_all(self) -> None:
        self.clean.clear()

    # -- rules ------------------------------------------------------------------------------

    @rule(push=st.booleans(), fixed=st.booleans(), ttl_frac=st.floats(0.3, 3.0))
    def grant_and_track(self, push: bool, fixed: bool, ttl_frac: float) -> None:
        self.n += 1
        key = f"req-{self.n}"
        if fixed and not push:
            self.pair.grant_and_track(key, kind=LeaseKind.FIXED_TTL, ttl=ttl_frac * self.cfg.kv_lease_duration)
            return
        self.pair.grant_and_track(key, push=push)
        if self.good and self.pair.accessor_alive and self.pair.to_pinner.up:
            self.clean.add(key)

    @rule(frac=st.floats(0.0, 1.5))
    def advance(self, frac: float) -> None:
        self.pair.advance(frac * self.cfg.kv_lease_duration)

    @rule(frac=st.floats(0.0, 0.3))
    def advance_a_little(self, frac: float) -> None:
        self.pair.advance(frac * self.cfg.heartbeat_interval)

    @precondition(lambda self: self.pair.accessor_alive)
    @rule(i=st.integers(0, 1000))
    def begin_read(self, i: int) -> None:
        keys = self._keys(TrackedState.WAITING, push=False)
        if keys:
            self.pair.begin_access(keys[i % len(keys)])

    @precondition(lambda self: self.pair.accessor_alive)
    @rule(i=st.integers(0, 1000), how=st.sampled_from(["finish", "fail-posted", "fail-unposted"]))
    def finish_read(self, i: int, how: str) -> None:
        keys = self.pair.accessing()
        if not keys:
            return
        key = keys[i % len(keys)]
        if how == "finish":
            self.pair.finish_access(key)
        else:
            # A posted transfer that failed gives the lease up (its notification may still
            # land): the engine's own doing, not a loss the liveness claim covers.
            self.clean.discard(key)
            self.pair.fail_access(key, posted=how == "fail-posted")

    @precondition(lambda self: self.pair.accessor_alive)
    @rule(i=st.integers(0, 1000), frac=st.floats(0.0, 1.0))
    def push_write(self, i: int, frac: float) -> None:
        keys = self._keys(TrackedState.WAITING, push=True)
        if not keys:
            return
        key = keys[i % len(keys)]
        decision = self.pair.begin_access(key)
        if decision.allowed:
            assert decision.guaranteed, "push mode must never start an unguaranteed write"
            # The protocol's assumption: a write lasts at most max_access_time (real).
            self.pair.advance(frac * self.cfg.max_access_time)
            self.pair.finish_access(key)

    @precondition(lambda self: self.pair.accessor_alive)
    @rule(i=st.integers(0, 1000))
    def untrack(self, i: int) -> None:
        keys = self._keys(TrackedState.WAITING)
        if keys:
            self.pair.untrack(keys[i % len(keys)])

    @rule(i=st.integers(0, 1000))
    def pinner_release(self, i: int) -> None:
        """The pinner's own engine aborts a request, maybe while the accessor reads it."""
        live = sorted(self.pair.pinner.live_ids())
        if live:
            rec = self.pair.leases[live[i % len(live)]]
            self.clean.discard(rec.key)
            self.pair.pinner_release(rec.key)

    @precondition(lambda self: self.pair.accessor_alive)
    @rule()
    def kill_accessor(self) -> None:
        self._dirty_all()
        self.pair.kill_accessor()

    @rule(drop_in_flight=st.booleans())
    def partition(self, drop_in_flight: bool) -> None:
        self._dirty_all()
        self.pair.partition(drop_in_flight=drop_in_flight)

    @rule()
    def heal(self) -> None:
        self.pair.heal()

    @rule(good=st.booleans())
    def set_link(self, good: bool) -> None:
        if not good:
            self._dirty_all()
        self.good = good
        self.pair.set_profiles(*_profiles(self.cfg, good))

    @rule()
    def drain(self) -> None:
        """Long quiet period. A dead accessor's leases must all be gone by its end."""
        self.pair.advance(3.0 * self.cfg.kv_lease_duration + self.cfg.push_guard + 0.01)
        if not self.pair.accessor_alive:
            live = list(self.pair.pinner.live_ids())
            assert not live, f"dead accessor's leases still pinned after the drain: {live}"

    # -- liveness invariants ----------------------------------------------------------------

    @invariant()
    def clean_leases_live(self) -> None:
        if not hasattr(self, "pair"):
            return
        for key in self.clean:
            rec = self.pair.record(key)
            for ev in rec.accessor_events:
                if isinstance(ev, LeaseLost | AccessStale):
                    raise InvariantViolation(f"a live, connected accessor lost {key!r}: {ev!r}")
            for _, free in rec.frees:
                if free.reason is EndReason.EXPIRED:
                    raise InvariantViolation(f"a live, connected accessor's lease {key!r} expired")

    @invariant()
    def nothing_rejected(self) -> None:
        if hasattr(self, "pair"):
            assert not self.pair.rejected, f"an honest peer was rejected: {self.pair.rejected[:3]}"


TestLeaseMachine = LeaseMachine.TestCase
TestLeaseMachine.settings = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None)


class _BrokenTermsAccessor(Accessor):
    """An accessor that gets the validity window wrong from the terms it agreed (v3: the
    window comes from `LeaseTerms`, the stricter of its own and the pinner's stated terms)."""

    def _window(self, terms: LeaseTerms) -> float:
        raise NotImplementedError

    def handshake_reply(self, now: LocalTime, reply: HandshakeReply) -> tuple[AccessorOutput, ...]:
        out = super().handshake_reply(now, reply)
        eng = self._engines.get(reply.engine_id)
        if eng is not None:
            eng.terms = attrs.evolve(eng.terms, accessor_extension=self._window(eng.terms))
        return out


class _OverstatedConfig(_BrokenTermsAccessor):
    """Validity 10 % past the pinner's extension."""

    def _window(self, terms: LeaseTerms) -> float:
        return terms.extension * 1.1


class _NoDriftConfig(_BrokenTermsAccessor):
    """A subtler break: the margin kept, the drift correction forgotten."""

    def _window(self, terms: LeaseTerms) -> float:
        return terms.extension - terms.validity_margin


@pytest.mark.parametrize("broken", [_OverstatedConfig, _NoDriftConfig])
def test_checker_flags_a_broken_accessor(broken: type[Accessor]) -> None:
    """The model is only worth something if it fails on a core that overstates validity."""

    class Broken(LeaseMachine):
        accessor_cls = broken
        # Where the break shows: the widest drift, no margin, the pinner's clock fast and ours slow.
        DRIFTS = (1e-2,)
        MARGINS = (0.0,)
        PINNER_RATES = (1.0,)
        ACCESSOR_RATES = (-1.0,)

    with pytest.raises(InvariantViolation, match=r"valid until|stale access"):
        run_state_machine_as_test(
            Broken,
            settings=settings(
                max_examples=max(EXAMPLES, 300),
                stateful_step_count=STEPS,
                deadline=None,
                phases=[Phase.generate],
                database=None,
            ),
        )
