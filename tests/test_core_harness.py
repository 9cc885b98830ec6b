"""`kvlease.testing` itself: the fake link really drops, duplicates, reorders and bounds sizes;
peer clocks convert both ways; and each audit of `Pair` fires on a core double that breaks it
(a checker that cannot fail proves nothing)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvlease import (
    AccessCompleted,
    AccessDecision,
    Accessor,
    AccessorOutput,
    EndReason,
    Free,
    Heartbeat,
    LeaseConfig,
    LeaseLost,
    LocalProtocolError,
    LocalTime,
    LostReason,
    Pinner,
    PinnerOutput,
)
from kvlease.testing import FakeLink, InvariantViolation, LinkProfile, Pair, PeerClock

CFG = LeaseConfig(kv_lease_duration=1.2, max_access_time=0.05, validity_margin=0.01)


def _hb(i: int, ids: tuple[int, ...] = (1,)) -> Heartbeat:
    return Heartbeat("d", 0, 1, 7, 1, i, LocalTime(float(i)), ids)


def test_fake_link_drops_duplicates_reorders_and_decodes() -> None:
    link = FakeLink(random.Random(3), LinkProfile(0.0, 1.0, drop=0.3, duplicate=0.3))
    for i in range(400):
        link.send(0.0, _hb(i))
    got = link.deliver_due(1.0)
    seqs = [m.seq for m in got if isinstance(m, Heartbeat)]
    assert 0 < link.dropped < 400 and len(seqs) > len(set(seqs))  # some lost, some twice
    assert seqs != sorted(seqs)  # reordered
    assert link.in_flight == 0 and link.next_delivery() is None


def test_fake_link_partition_and_size_bound() -> None:
    link = FakeLink(random.Random(0), max_bytes=128)
    link.up = False
    link.send(0.0, _hb(1))
    assert link.dropped == 1 and link.in_flight == 0
    link.up = True
    link.send(0.0, _hb(2))
    link.drop_in_flight()
    assert link.in_flight == 0 and link.deliver_due(5.0) == []
    with pytest.raises(InvariantViolation, match="exceeds max_message_bytes"):
        link.send(0.0, _hb(3, tuple(range(1, 200))))


def test_peer_clock_converts_both_ways_within_the_bound() -> None:
    rng = random.Random(9)
    for _ in range(50):
        c = PeerClock.random(rng, 1e-3)
        assert 1e4 <= c.epoch <= 2e5 and abs(c.rate - 1.0) <= 1e-3 + 1e-12
        assert c.real(c.local(123.25)) == pytest.approx(123.25, abs=1e-9)


def test_pair_refuses_key_reuse_and_negative_time() -> None:
    pair = Pair(CFG, random.Random(1))
    pair.grant_and_track("a")
    with pytest.raises(ValueError, match="never reused"):
        pair.grant("a")
    with pytest.raises(ValueError, match="backwards"):
        pair.advance(-1.0)


def test_honest_pair_runs_clean() -> None:
    pair = Pair(CFG, random.Random(2), to_pinner=LinkProfile(0.0, 0.02), to_accessor=LinkProfile(0.0, 0.02))
    pair.grant_and_track("a")
    pair.grant_and_track("p", push=True)
    pair.advance(3.0)
    assert pair.begin_access("a").guaranteed
    pair.advance(0.01)
    pair.finish_access("a")
    assert pair.begin_access("p").guaranteed
    pair.advance(0.02)
    pair.finish_access("p")
    pair.grant_and_track("dead")
    pair.advance(0.5)
    pair.kill_accessor()
    pair.advance(3.0)
    assert [f.reason for _, f in pair.record("dead").frees] == [EndReason.EXPIRED]
    assert pair.rejected == [] and pair.handshakes == 1


# -- each audit fires on a broken double ------------------------------------------------------


class DoubleFreePinner(Pinner):
    def handle_timeout(self, now: LocalTime) -> tuple[PinnerOutput, ...]:
        out = super().handle_timeout(now)
        return out + out


class LateDeadlinePinner(Pinner):
    def next_deadline(self) -> LocalTime | None:
        nd = super().next_deadline()
        return None if nd is None else LocalTime(nd + 0.5)


class BusyPinner(Pinner):
    def next_deadline(self) -> LocalTime | None:
        return LocalTime(0.0)


class CompletesAnythingAccessor(Accessor):
    def begin_access(self, now: LocalTime, key: str) -> AccessDecision:
        super().begin_access(now, key)
        return AccessDecision(True, True, None)

    def access_finished(self, now: LocalTime, key: str, *, notified: bool = False) -> tuple[AccessorOutput, ...]:
        return (AccessCompleted(key, 1, confirmed_by_pinner=False),)


class EchoingAccessor(Accessor):
    def access_finished(self, now: LocalTime, key: str, *, notified: bool = False) -> tuple[AccessorOutput, ...]:
        out = super().access_finished(now, key, notified=notified)
        return out + tuple(o for o in out if isinstance(o, AccessCompleted))


def _pair(**kw: Any) -> Pair:
    return Pair(CFG, random.Random(4), to_pinner=LinkProfile(0.0, 0.01), to_accessor=LinkProfile(0.0, 0.01), **kw)


def test_audit_flags_a_second_free() -> None:
    pair = _pair()
    pair.pinner = DoubleFreePinner(CFG, "prefill-0", 5)
    pair.grant("a")
    with pytest.raises(InvariantViolation, match="second Free"):
        pair.advance(2.0)


@pytest.mark.parametrize(("duration", "what"), [(0.6, "before its expiry"), (2.4, "after its bound")])
def test_audit_flags_early_and_late_expiry(duration: float, what: str) -> None:
    pair = _pair()
    pair.pinner = Pinner(CFG.with_changes(kv_lease_duration=duration), "prefill-0", 5)
    pair.grant("a")
    with pytest.raises(InvariantViolation, match=what):
        pair.advance(3.0)


def test_audit_flags_a_late_next_deadline() -> None:
    pair = _pair()
    pair.pinner = LateDeadlinePinner(CFG, "prefill-0", 5)
    pair.grant("a")
    with pytest.raises(InvariantViolation, match="later than lease"):
        pair.advance(0.1)


def test_audit_flags_a_busy_loop() -> None:
    pair = _pair()
    pair.pinner = BusyPinner(CFG, "prefill-0", 5)
    pair.grant("a")
    with pytest.raises(InvariantViolation, match="after handle_timeout"):
        pair.advance(0.1)


def test_audit_flags_a_stale_read_reported_done() -> None:
    pair = _pair(accessor_cls=CompletesAnythingAccessor)
    pair.grant_and_track("a")
    pair.pinner_release("a")  # nothing promised yet: freed at once
    assert pair.begin_access("a").allowed
    pair.advance(0.01)
    with pytest.raises(InvariantViolation, match="stale access reported done"):
        pair.finish_access("a")


def test_audit_flags_events_after_a_terminal_one() -> None:
    pair = _pair(accessor_cls=EchoingAccessor)
    pair.grant_and_track("a")
    pair.advance(0.5)
    assert pair.begin_access("a").guaranteed
    with pytest.raises(InvariantViolation, match="after a terminal one"):
        pair.finish_access("a")


def test_audit_flags_a_free_naming_another_key_or_lease() -> None:
    pair = _pair()
    pair.grant("a")
    with pytest.raises(InvariantViolation, match="never granted"):
        pair._pinner_outputs((Free(99, "a", EndReason.EXPIRED, pair.now_p),))  # the audit's entry point
    with pytest.raises(InvariantViolation, match="names key"):
        pair._pinner_outputs((Free(1, "b", EndReason.RELEASED, pair.now_p),))


def test_a_failed_posted_transfer_gives_the_lease_up_cleanly() -> None:
    """v2: `Pair.fail_access` (a posted transfer failed) ends in LeaseLost(ACCESS_FAILED), the
    accessor's Release frees the lease at the pinner, the audit stays quiet, and the lease can
    never be tracked again by this accessor."""
    pair = _pair()
    ticket = pair.grant("a")
    pair.track("a", ticket)
    pair.advance(0.5)
    assert pair.begin_access("a").allowed
    pair.advance(0.01)
    pair.fail_access("a")
    assert [type(e).__name__ for e in pair.record("a").accessor_events] == ["LeaseLost"]
    lost = pair.record("a").accessor_events[0]
    assert isinstance(lost, LeaseLost) and lost.reason is LostReason.ACCESS_FAILED
    pair.advance(0.1)
    assert [f.reason for _, f in pair.record("a").frees] == [EndReason.RELEASED]
    assert pair.rejected == []
    with pytest.raises(LocalProtocolError, match="fresh lease"):
        pair.track("a", ticket)
