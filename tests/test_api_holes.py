"""Adversarial schedules against the public API: one test per known hole of the core.

Every test drives pinners and accessors by hand, with explicit times (each endpoint reads its own
clock, with its own epoch), passes messages directly (through `encode`/`decode`, so every message
is wire-valid) and lets the "network" hold, duplicate, reorder or misroute them. Each test then
asserts the SAFE behaviour, and the mechanism of protocol v2 that gives it. The unsafe outcome is
detected by the small helpers at the top.

Every test FAILED on the protocol-v1 core (commit d9bed30), with the unsafe outcome below, and
passes on v2 for the reason on the right:

===========  =====================================================  ===================================
test         unsafe outcome on the v1 core                           v2 mechanism that refuses it
===========  =====================================================  ===================================
1            re-tracked ticket: the held Release freed the lease     re-track -> LocalProtocolError
             (Free released) yet the new tracking's read was
             reported AccessCompleted
1b           re-tracked ticket: the first read's held AccessDone     re-track -> LocalProtocolError
             freed it mid-read (Free access_done), second read
             reported AccessCompleted
2            pinner rank 0 counted accessor rank 1's AccessDone      misrouted AccessDone -> Rejected by
             (Free access_done); accessor rank 0 then read it and    the TP layout, no Free
             was told AccessCompleted
2b           AccessDone claiming accessor rank 70000 was counted     Rejected (rank outside the layout)
             and freed the lease
3            another accessor's handshake reply became A's clock     reply bound to to_session (Rejected)
             sample: a read after the fixed TTL's Free (expired)     and to seq/t_echo (ignored)
             was reported AccessCompleted
3b           a late duplicate reply of the pinner's OLD incarnation  a reply to a retired handshake
             dropped a live lease (LeaseLost PINNER_RESTARTED)       changes nothing
4            an ack held from before a disconnect validated L2,      seq never reused: the old ack
             which the pinner freed (Free released); read reported   answers nothing outstanding
             AccessCompleted
4b           a sibling accessor rank's ack validated L2 (freed,      ack bound to to_rank (Rejected)
             Free released); read reported AccessCompleted
4c           ack with renewed=0 and no listed ids for a 1-id         ack must account for every id
             heartbeat validated the freed lease; read reported      (Rejected)
             AccessCompleted
5            retry after a failed transfer whose notification had    posted failure -> LeaseLost
             freed the lease (Free access_done) was reported         (ACCESS_FAILED) + Release, no retry
             AccessCompleted
5b           attempt 1's OK verdict was applied to attempt 2 (after  posted: ACCESS_FAILED; unposted:
             Free access_done): AccessCompleted(confirmed)           the verdict's attempt must match
6a           LeaseConfig(validity_margin=0) accepted                 ConfigError (>= MIN_VALIDITY_MARGIN)
6b           now=+inf accepted by 7 calls; -inf as the first time    LocalProtocolError (check_time)
             accepted by both handle_timeouts
6c           at now=1e17 the accessor's next_deadline() equalled     |now| <= MAX_TIME = 2**32, else
             now after handle_timeout (busy loop)                    LocalProtocolError
7            (p=a=2 and p=4,a=2) another accessor rank's completion  heartbeats only to target ranks;
             on another pinner rank lost rank 1's lease (LeaseLost   a misrouted heartbeat is Rejected
             RELEASED)
8a           a heartbeat handled at expiry renewed the lease         expiry <= now is expired everywhere
8a2          a confirm AccessDone handled at expiry answered OK      STALE at expiry
8b           release() of an id never granted was accepted           LocalProtocolError for an id >= the
                                                                     next id (v2: one below it may have
                                                                     ended and been forgotten: ())
8c           grant after lease id 2**64-1 assigned id 2**64          LocalProtocolError
8d           a 961 B heartbeat was answered by a 1599 B ack          split rule sized for the ack
             (> max_message_bytes=1024)
9            (found while porting to v2) a restarted accessor        the tombstone confirms a duplicate
             process (same engine and rank, new session) reading a   access-done only for the same
             lease already freed got OK from the tombstone:          session (STALE otherwise)
             AccessCompleted(confirmed)
===========  =====================================================  ===================================

Construction goes only through `make_pinner` / `make_accessor`, so a changed constructor
signature is ported by editing those two functions. Each accessor process (and each rank, which
is its own process) gets its own session unless a test says otherwise.

Clock mapping: unless a test says otherwise, accessor time ``a(x)`` and pinner time ``p(x - 90)``
are the same real instant (so ``a(100)`` is ``p(10)``); the schedule's order is the real order.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import attrs
import pytest

from kvlease import (
    MAX_TIME,
    MIN_ACCESS_TIME,
    MIN_VALIDITY_MARGIN,
    AccessCompleted,
    AccessDone,
    AccessDoneAck,
    Accessor,
    AccessOutcome,
    ConfigError,
    Free,
    HandshakeNeeded,
    Heartbeat,
    HeartbeatAck,
    LeaseConfig,
    LeaseKind,
    LeaseLost,
    LeaseTicket,
    LocalProtocolError,
    LocalTime,
    LostReason,
    Message,
    Pinner,
    Rejected,
    Release,
    Send,
    TrackedState,
    decode,
    encode,
)

# -- factories (the only place the constructors are called) ------------------------------------


def make_pinner(cfg: LeaseConfig, engine: str, inc: int, rank: int = 0, ranks: int = 1) -> Pinner:
    return Pinner(cfg, engine, inc, rank=rank, ranks=ranks)


def session_of(engine: str, rank: int) -> int:
    """A fixed, distinct session per accessor (engine, rank): each is its own process."""
    return zlib.crc32(f"{engine}/{rank}".encode()) + 1


def make_accessor(
    cfg: LeaseConfig, engine: str, rank: int = 0, ranks: int = 1, *, session: int | None = None
) -> Accessor:
    return Accessor(
        cfg, engine, session=session_of(engine, rank) if session is None else session, rank=rank, ranks=ranks
    )


# -- clocks and names ---------------------------------------------------------------------------

CFG = LeaseConfig()  # defaults: d=30 s, heartbeat every 5 s, E=20 s, E_a ~ 19.946 s, A_l ~ 2.0002 s
P_EPOCH = 91_000.0  # pinner clocks read P_EPOCH + t
A_EPOCH = 12_345.5  # accessor clocks read A_EPOCH + t (sibling ranks of one engine share the host clock)
B_EPOCH = A_EPOCH + 10.0  # another accessor engine whose clock reads 10 s ahead of A's
PIN = "prefill-0"
ACC = "decode-0"
INC = 0x5EED0001
INC2 = 0x5EED0002


def a(t: float) -> LocalTime:
    return LocalTime(A_EPOCH + t)


def b(t: float) -> LocalTime:
    return LocalTime(B_EPOCH + t)


def p(t: float) -> LocalTime:
    return LocalTime(P_EPOCH + t)


# -- the network ---------------------------------------------------------------------------------


M = TypeVar("M", bound=Message)


def wire(msg: M) -> M:
    """Put a message on the wire and take it off again (every delivery goes through this)."""
    out = decode(encode(msg))
    assert isinstance(out, type(msg)), (msg, out)
    return out


def sends(outs: Iterable[object], kind: type | None = None) -> list[Send]:
    return [o for o in outs if isinstance(o, Send) and (kind is None or isinstance(o.message, kind))]


def messages(outs: Iterable[object], kind: type[M]) -> list[M]:
    """The messages of kind `kind` that `outs` send."""
    return [o.message for o in outs if isinstance(o, Send) and isinstance(o.message, kind)]


def outcomes(verdicts: Iterable[Send]) -> list[AccessOutcome]:
    """The outcomes of access-done verdicts (every one must be an AccessDoneAck)."""
    acks = [v.message for v in verdicts]
    assert all(isinstance(m, AccessDoneAck) for m in acks), acks
    return [m.outcome for m in acks if isinstance(m, AccessDoneAck)]


def not_sends(outs: Iterable[object]) -> list[object]:
    return [o for o in outs if not isinstance(o, Send)]


def rejections(outs: Iterable[object]) -> list[Rejected]:
    return [o for o in outs if isinstance(o, Rejected)]


def handshake(acc: Accessor, outs: Iterable[object], pinner: Pinner, a_t: LocalTime, p_t: LocalTime) -> list[object]:
    """Answer the accessor's HandshakeNeeded (in `outs`) with `pinner` and deliver the reply."""
    (hs,) = [o for o in outs if isinstance(o, HandshakeNeeded)]
    reply = pinner.handshake_reply(p_t, hs.message)
    return list(acc.handshake_reply(a_t, wire(reply)))


def heartbeat_round(
    acc: Accessor,
    pinners: Sequence[Pinner],
    a_t: LocalTime,
    p_t: LocalTime,
    *,
    deliver_heartbeats: bool = True,
    deliver_acks: bool = True,
) -> list[object]:
    """Wake the accessor at `a_t`; deliver its heartbeats to the addressed pinner ranks at `p_t`
    (`pinners[r]` is pinner rank r) and their acks back at `a_t`. Returns the accessor's
    non-Send outputs."""
    out = acc.handle_timeout(a_t)
    events = not_sends(out)
    for s in sends(out, Heartbeat):
        assert isinstance(s.rank, int)  # v2: every Send names one pinner rank
        if not deliver_heartbeats:
            continue
        for reply in sends(pinners[s.rank].receive(p_t, wire(s.message))):
            if deliver_acks:
                events.extend(acc.receive(a_t, wire(reply.message)))
    return events


def assert_retrack_refused(acc: Accessor, now: LocalTime, key: str, ticket: LeaseTicket) -> None:
    """v2: tracking a ticket this accessor already gave up is local misuse (a fresh lease is needed)."""
    with pytest.raises(LocalProtocolError, match="fresh lease"):
        acc.track(now, key, ticket)
    assert acc.state_of(key) is None


def read(acc: Accessor, key: str, begin: LocalTime, end: LocalTime, *, notified: bool = True) -> list[object]:
    """begin_access at `begin`; if allowed, access_finished at `end`. Returns the accessor's outputs."""
    d = acc.begin_access(begin, key)
    if not d.allowed:
        return []
    return list(acc.access_finished(end, key, notified=notified))


# -- unsafe-outcome detectors ---------------------------------------------------------------------


def completions(events: Iterable[object], key: str) -> list[AccessCompleted]:
    return [e for e in events if isinstance(e, AccessCompleted) and e.key == key]


def free_of(outs: Iterable[object], lease_id: int) -> Free | None:
    frees = [o for o in outs if isinstance(o, Free) and o.lease_id == lease_id]
    assert len(frees) <= 1, f"lease {lease_id} freed twice: {frees}"
    return frees[0] if frees else None


def assert_no_stale_completion(free: Free | None, read_events: Iterable[object], key: str, what: str) -> None:
    """`free` is the pinner's Free of the memory `key`'s read used, emitted before the read
    began or while it was in flight (None: the pinner did not free, so nothing to check).
    Such a read must never be reported AccessCompleted."""
    if free is None:
        return
    done = completions(read_events, key)
    assert not done, f"UNSAFE ({what}): pinner emitted {free} before/during the read, yet accessor reported {done}"


def assert_not_lost(events: Iterable[object], key: str, what: str) -> None:
    lost = [e for e in events if isinstance(e, LeaseLost) and e.key == key]
    assert not lost, f"UNSAFE ({what}): accessor reported {lost}"


def assert_rejected_not_freed(outs: Sequence[object], what: str) -> None:
    frees = [o for o in outs if isinstance(o, Free)]
    assert not frees, f"UNSAFE ({what}): pinner freed {frees}"
    assert any(isinstance(o, Rejected) for o in outs), f"({what}) expected Rejected, got {outs}"


def assert_deadline_after(side: Pinner | Accessor, now: float, what: str) -> None:
    nd = side.next_deadline()
    assert nd is None or nd > now, f"UNSAFE ({what}): after handle_timeout({now!r}) next_deadline() = {nd!r}"


def connected_pair(key: str = "k1") -> tuple[Pinner, Accessor, LeaseTicket]:
    """P grants at p(0); A tracks at a(100), handshakes (P at p(10)) and has one acked round."""
    pin = make_pinner(CFG, PIN, INC)
    tk = pin.grant(p(0.0), key)  # P: lease L1, expiry p(30)
    acc = make_accessor(CFG, ACC)
    out = acc.track(a(100.0), key, tk)  # A: HandshakeNeeded
    assert handshake(acc, out, pin, a(100.0), p(10.0)) == []
    assert heartbeat_round(acc, [pin], a(100.0), p(10.0)) == []  # renewed to p(30), acked
    assert acc.valid_until(key) == pytest.approx(A_EPOCH + 100.0 + CFG.accessor_extension)
    return pin, acc, tk


# == 1. re-tracking a ticket after untrack / after a completed read ==============================


def test_1_retrack_after_untrack_then_held_release_frees_under_new_validity() -> None:
    pin, acc, tk = connected_pair("k1")
    # A: the request is aborted; the Release it emits is HELD by the network.
    held = sends(acc.untrack(a(101.0), "k1"), Release)
    assert held
    # A: the same ticket is tracked again under a new request key: v2 refuses (the held Release
    # may still end the lease under the new tracking).
    assert_retrack_refused(acc, a(101.0), "k2", tk)
    # A has nothing to heartbeat for it, so P's lease is never renewed for a "k2".
    events = heartbeat_round(acc, [pin], a(101.0), p(11.0))
    assert events == []
    # The held Release reaches P at p(11.0): every expected rank released -> Free(released).
    p_out: list[object] = []
    for s in held:
        p_out += pin.receive(p(11.0), wire(s.message))
    free = free_of(p_out, tk.lease_id)
    assert free is not None
    # A reads "k2" at a(111) (= p(21), ten seconds after the free): not tracked, not allowed.
    assert not acc.begin_access(a(111.0), "k2").allowed
    events += read(acc, "k2", a(111.0), a(111.5), notified=False)
    assert_no_stale_completion(free, events, "k2", "re-tracked ticket, held Release freed it")


def test_1b_retrack_after_completed_read_then_held_access_done_frees_second_read() -> None:
    pin, acc, tk = connected_pair("k1")
    # A: first read, covered by validity; its AccessDone is HELD by the network.
    assert acc.begin_access(a(102.0), "k1").guaranteed
    fin = acc.access_finished(a(103.0), "k1", notified=False)
    assert completions(fin, "k1")
    held = sends(fin, AccessDone)
    assert held
    # A: the same ticket is tracked again (a second request on the same KV): v2 refuses.
    assert_retrack_refused(acc, a(104.0), "k2", tk)
    events = heartbeat_round(acc, [pin], a(104.0), p(14.0))
    # A: second read would begin at a(105) (= p(15)): not tracked, not allowed.
    d = acc.begin_access(a(105.0), "k2")
    assert not d.allowed
    # The held AccessDone of the first read reaches P at p(15.5): Free(access_done).
    p_out: list[object] = []
    for s in held:
        p_out += pin.receive(p(15.5), wire(s.message))
    free = free_of(p_out, tk.lease_id)
    assert free is not None
    # A: the second read would finish at a(106) (= p(16), after the free).
    if d.allowed:
        events += acc.access_finished(a(106.0), "k2", notified=True)
    assert_no_stale_completion(free, events, "k2", "re-tracked ticket, held AccessDone freed it mid-read")


# == 2. AccessDone accepted from a rank that does not map to this pinner rank ====================


def test_2_access_done_of_another_accessor_rank_frees_this_pinner_rank() -> None:
    # p=2 pinner ranks, a=2 accessor ranks: accessor rank r reads (and notifies) pinner rank r only.
    pins = [make_pinner(CFG, PIN, INC, rank=r, ranks=2) for r in range(2)]
    tk = pins[0].grant(p(0.0), "k")
    assert pins[1].grant(p(0.0), "k") == tk  # both workers grant lease 1, ticket ranks=2
    accs = [make_accessor(CFG, ACC, rank=r, ranks=2) for r in range(2)]
    for acc in accs:
        # A_r: track at a(100), handshake with pinner rank 0, heartbeat its pinner rank; all acked.
        assert handshake(acc, acc.track(a(100.0), "k", tk), pins[0], a(100.0), p(10.0)) == []
        assert heartbeat_round(acc, pins, a(100.0), p(10.0)) == []
    # A1 reads its part (pinner rank 1); its attached AccessDone is delivered to pinner rank 0.
    d1 = accs[1].begin_access(a(101.0), "k")
    assert d1.allowed and d1.notification is not None and d1.targets == (1,)
    misrouted = pins[0].receive(p(11.0), wire(d1.notification))
    # v2: pinner rank 0 refuses it (accessor rank 1 of 2 does not access it) and does not free.
    assert_rejected_not_freed(misrouted, "pinner rank 0 counted accessor rank 1's AccessDone")
    (rej,) = misrouted
    assert isinstance(rej, Rejected) and "does not access" in rej.reason
    free = free_of(misrouted, tk.lease_id)
    info = pins[0].info(tk.lease_id)
    assert info is not None and info.accesses_done == 0
    # Delivered where it belongs, it ends pinner rank 1's copy.
    assert free_of(pins[1].receive(p(11.0), wire(d1.notification)), tk.lease_id) is not None
    assert completions(accs[1].access_finished(a(101.5), "k", notified=True), "k")
    # A0, which still holds validity for pinner rank 0's copy, reads it at a(102) (= p(12)).
    events = read(accs[0], "k", a(102.0), a(102.5))
    assert_no_stale_completion(free, events, "k", "pinner rank 0 counted accessor rank 1's AccessDone")
    assert completions(events, "k")  # the memory was still pinned: a valid read
    assert pins[0].info(tk.lease_id) is not None  # until A0's own notification reaches it


def test_2b_access_done_with_rank_70000_is_rejected() -> None:
    pin = make_pinner(CFG, PIN, INC)
    tk = pin.grant(p(0.0), "k")
    acc = make_accessor(CFG, ACC)
    assert handshake(acc, acc.track(a(100.0), "k", tk), pin, a(100.0), p(10.0)) == []
    d = acc.begin_access(a(100.5), "k")
    assert d.notification is not None
    # The AccessDone claims accessor rank 70000 (> 65536, no such rank can exist); wire-valid.
    bogus = attrs.evolve(d.notification, rank=70_000)
    outs = pin.receive(p(10.5), wire(bogus))
    assert_rejected_not_freed(outs, "AccessDone from rank 70000 was counted")
    assert "outside" in rejections(outs)[0].reason  # refused by the TP layout check
    assert pin.info(tk.lease_id) is not None


# == 3. HandshakeReply not matched to a handshake this accessor sent ============================


@pytest.mark.parametrize("sessions", ["distinct", "colliding"])
def test_3_reply_to_another_accessors_handshake_skews_fixed_ttl_deadline(sessions: str) -> None:
    pin = make_pinner(CFG, PIN, INC)
    # P: fixed-TTL lease, deadline p(60) (= a(150)).
    tk = pin.grant(p(0.0), "k", kind=LeaseKind.FIXED_TTL, ttl=60.0)
    acc = make_accessor(CFG, ACC)
    # A tracks at a(100); its own handshake is lost.
    assert any(isinstance(o, HandshakeNeeded) for o in acc.track(a(100.0), "k", tk))
    # B (another engine, clock 10 s ahead of A: b(100) is a(100)) handshakes with P at p(10).
    # "colliding": B drew A's session by chance; the (seq, t_echo) binding must still hold.
    other = make_accessor(CFG, "decode-1", session=acc.session if sessions == "colliding" else None)
    reply_for_b = pin.handshake_reply(p(10.0), other.handshake(b(100.0), PIN).message)
    assert (reply_for_b.to_rank, reply_for_b.seq) == (acc.rank, 1)  # same rank, same first seq as A's
    # B's real reply reaches A at a(110) (t_echo = b(100) reads a(110): passes "t_echo <= now").
    refused = list(acc.handshake_reply(a(110.0), wire(reply_for_b)))
    if sessions == "distinct":
        (rej,) = refused  # v2: addressed to B's session
        assert isinstance(rej, Rejected) and "session" in rej.reason
    else:
        assert refused == []  # v2: it answers no handshake A sent (t_echo is not A's t_send)
    est = acc.clock_estimator(PIN)
    assert not acc.is_connected(PIN) and est is not None and est.sample_count == 0
    assert acc.valid_until("k") is None
    events: list[object] = list(refused)
    # A retries its own handshake at a(110); P answers it (at p(20)) and A heartbeats; P acks
    # (fixed-TTL: acknowledged, not extended).
    retry = acc.handle_timeout(a(110.0))
    assert handshake(acc, retry, pin, a(110.0), p(20.0)) == []
    events += heartbeat_round(acc, [pin], a(110.0), p(20.0))
    v = acc.valid_until("k")
    assert v is not None and v <= a(150.0), f"UNSAFE: A counts the TTL valid until {v}, P's deadline is {a(150.0)}"
    # P: the TTL runs out at p(60) (= a(150)): Free(expired).
    free = free_of(pin.handle_timeout(p(60.0)), tk.lease_id)
    assert free is not None
    # A reads at a(152) (= p(62), after the free).
    events += read(acc, "k", a(152.0), a(153.0))
    assert_no_stale_completion(free, events, "k", "another accessor's handshake reply became A's clock sample")


def test_3b_late_duplicate_reply_of_old_incarnation_changes_nothing() -> None:
    old = make_pinner(CFG, PIN, INC)
    tk1 = old.grant(p(0.0), "k1")
    acc = make_accessor(CFG, ACC)
    (hs1,) = acc.track(a(100.0), "k1", tk1)
    assert isinstance(hs1, HandshakeNeeded)
    old_reply = old.handshake_reply(p(10.0), hs1.message)  # the network will duplicate this one
    assert acc.handshake_reply(a(100.0), wire(old_reply)) == ()
    assert heartbeat_round(acc, [old], a(100.0), p(10.0)) == []
    # The pinner restarts with a new incarnation and grants a new lease.
    new = make_pinner(CFG, PIN, INC2)
    tk2 = new.grant(p(20.0), "k2")
    out = acc.track(a(110.0), "k2", tk2)  # other incarnation: A re-handshakes
    # A first duplicate of the old reply arrives while the new handshake is outstanding: it
    # answers an earlier, already answered handshake, so it changes nothing.
    assert acc.handshake_reply(a(110.0), wire(old_reply)) == ()
    assert acc.state_of("k1") is acc.state_of("k2") is TrackedState.WAITING
    assert handshake(acc, out, new, a(110.0), p(20.0)) == [LeaseLost("k1", tk1.lease_id, LostReason.PINNER_RESTARTED)]
    assert heartbeat_round(acc, [new], a(110.0), p(20.0)) == []
    before = (acc.state_of("k2"), acc.valid_until("k2"), acc.is_connected(PIN))
    assert before[0] is TrackedState.WAITING and before[1] is not None and before[2]
    # The late duplicate of the OLD incarnation's reply arrives at a(111).
    stale_out = list(acc.handshake_reply(a(111.0), wire(old_reply)))
    assert_not_lost(stale_out, "k2", "a stale handshake reply of the old incarnation dropped a live lease")
    assert stale_out == []  # v2: the first accepted reply retired every earlier handshake
    after = (acc.state_of("k2"), acc.valid_until("k2"), acc.is_connected(PIN))
    assert after == before, f"UNSAFE: a stale handshake reply changed the accessor: {before} -> {after}"
    d = acc.begin_access(a(111.5), "k2")
    assert d.allowed and d.guaranteed, f"UNSAFE: the stale reply reverted the engine: {d}"


# == 4. an ack trusted on (seq, t_send) alone ====================================================


def test_4_old_ack_after_disconnect_validates_a_lease_the_pinner_never_renewed() -> None:
    pin = make_pinner(CFG, PIN, INC)
    tk1 = pin.grant(p(0.0), "k1")
    tk2 = pin.grant(p(0.0), "k2")  # L2: no heartbeat for it will ever reach P
    acc = make_accessor(CFG, ACC)
    assert handshake(acc, acc.track(a(100.0), "k1", tk1), pin, a(100.0), p(10.0)) == []
    # A heartbeats L1 (t_send a(100)); P renews it; the ack is HELD by the network.
    (hb1,) = sends(acc.handle_timeout(a(100.0)), Heartbeat)
    (old_ack,) = sends(pin.receive(p(10.0), wire(hb1.message)))
    # A gives the engine up and reconnects, all at the same clock reading a(100).
    acc.disconnect(a(100.0), PIN)
    assert handshake(acc, acc.track(a(100.0), "k2", tk2), pin, a(100.0), p(10.0)) == []
    # A heartbeats L2, t_send a(100) again. This heartbeat is lost.
    (hb2,) = sends(acc.handle_timeout(a(100.0)), Heartbeat)
    assert isinstance(hb1.message, Heartbeat) and isinstance(hb2.message, Heartbeat)
    assert hb2.message.lease_ids == (tk2.lease_id,)
    # v2: the seq did not restart after the disconnect (v1 reused seq 1 here).
    assert hb2.message.seq > hb1.message.seq
    assert hb2.message.t_send == hb1.message.t_send
    # The held ack of the OLD heartbeat arrives: t_echo == the new t_send, but another seq.
    events: list[object] = list(acc.receive(a(100.0), wire(old_ack.message)))
    assert events == [] and acc.valid_until("k2") is None
    # P: the local engine aborts L2; it was never promised, so it frees at once.
    free = free_of(pin.release(p(11.0), tk2.lease_id), tk2.lease_id)
    assert free is not None
    # A reads k2 at a(102) (= p(12), after the free).
    events += read(acc, "k2", a(102.0), a(102.5))
    assert_no_stale_completion(free, events, "k2", "an ack from before the disconnect validated L2")


@pytest.mark.parametrize("sessions", ["shared", "per-rank"])
def test_4b_sibling_accessor_ranks_ack_is_accepted(sessions: str) -> None:
    pin = make_pinner(CFG, PIN, INC)
    tk1 = pin.grant(p(0.0), "k1")
    tk2 = pin.grant(p(0.0), "k2")
    # Two ranks of one accessor engine on one host (same clock); A0 tracks k2, A1 tracks k1.
    # p=1, a=2: both ranks access pinner rank 0. "shared": the ranks share one session (allowed),
    # so only the ack's to_rank tells them apart.
    a0 = make_accessor(CFG, ACC, rank=0, ranks=2)
    a1 = make_accessor(CFG, ACC, rank=1, ranks=2, session=a0.session if sessions == "shared" else None)
    assert handshake(a0, a0.track(a(100.0), "k2", tk2), pin, a(100.0), p(10.0)) == []
    assert handshake(a1, a1.track(a(100.0), "k1", tk1), pin, a(100.0), p(10.0)) == []
    # A0 heartbeats L2 (t_send a(100)): lost.
    (hb0,) = sends(a0.handle_timeout(a(100.0)), Heartbeat)
    # A1 heartbeats L1 (t_send a(100)): P renews L1 and acks to accessor rank 1...
    (hb1,) = sends(a1.handle_timeout(a(100.0)), Heartbeat)
    # (Both heartbeats carry the same seq and t_send, and one id each.)
    assert isinstance(hb0.message, Heartbeat) and isinstance(hb1.message, Heartbeat)
    assert (hb0.message.seq, hb0.message.t_send) == (hb1.message.seq, hb1.message.t_send)
    (ack1,) = sends(pin.receive(p(10.0), wire(hb1.message)))
    assert isinstance(ack1.message, HeartbeatAck) and ack1.message.to_rank == 1 and ack1.rank == 1
    # ...but the ack is delivered to accessor rank 0.
    events: list[object] = list(a0.receive(a(100.0), wire(ack1.message)))
    (rej,) = events  # v2: addressed to rank 1
    assert isinstance(rej, Rejected) and "rank 1" in rej.reason
    assert a0.valid_until("k2") is None
    # P: the engine aborts L2 (never promised): freed at once.
    free = free_of(pin.release(p(11.0), tk2.lease_id), tk2.lease_id)
    assert free is not None
    # A0 reads k2 at a(102) (= p(12)).
    events += read(a0, "k2", a(102.0), a(102.5))
    assert_no_stale_completion(free, events, "k2", "a sibling rank's ack validated L2")


def test_4c_ack_whose_renewed_count_contradicts_the_heartbeat_is_accepted() -> None:
    pin = make_pinner(CFG, PIN, INC)
    tk = pin.grant(p(0.0), "k")
    acc = make_accessor(CFG, ACC)
    assert handshake(acc, acc.track(a(100.0), "k", tk), pin, a(100.0), p(10.0)) == []
    # A heartbeats L1 (one id); the heartbeat is delayed.
    (hb,) = sends(acc.handle_timeout(a(100.0)), Heartbeat)
    # P: the engine aborts L1 (never promised): freed at once.
    free = free_of(pin.release(p(10.5), tk.lease_id), tk.lease_id)
    assert free is not None
    # The heartbeat reaches P at p(11): honest ack "renewed 0, released [1]".
    (honest,) = sends(pin.receive(p(11.0), wire(hb.message)))
    assert isinstance(honest.message, HeartbeatAck) and honest.message.renewed == 0
    # The ack A receives has lost its list: renewed=0 + nothing listed != 1 id sent.
    mangled = attrs.evolve(honest.message, released=())
    events: list[object] = list(acc.receive(a(101.0), wire(mangled)))
    (rej,) = events  # v2: the ack does not account for the heartbeat's ids
    assert isinstance(rej, Rejected) and "account" in rej.reason
    assert acc.valid_until("k") is None and acc.state_of("k") is TrackedState.WAITING
    # A reads at a(102) (= p(12), after the free).
    events += read(acc, "k", a(102.0), a(102.5))
    assert_no_stale_completion(free, events, "k", "ack with renewed=0 and no listed ids for a 1-id heartbeat")
    # The read was not covered: A waits for the pinner's verdict on it instead.
    assert acc.state_of("k") is TrackedState.CONFIRMING


# == 5. access_failed after the attached notification already reached the pinner =================


def test_5_failed_transfer_whose_notification_freed_then_retry_completes() -> None:
    pin, acc, tk = connected_pair("k")
    # A: attempt 1, guaranteed; the transfer carries the AccessDone as its notification.
    d1 = acc.begin_access(a(101.0), "k")
    assert d1.guaranteed and d1.notification is not None
    # The notification reaches P at p(11.5): Free(access_done).
    free = free_of(pin.receive(p(11.5), wire(d1.notification)), tk.lease_id)
    assert free is not None
    # The transport reports the (posted) transfer failed: v2 gives the lease up.
    events: list[object] = list(acc.access_failed(a(102.0), "k"))
    assert not_sends(events) == [LeaseLost("k", tk.lease_id, LostReason.ACCESS_FAILED)]
    assert [s.rank for s in sends(events, Release)] == list(d1.targets)
    assert acc.state_of("k") is None
    # A: retry at a(103) (= p(13), after the free): not tracked any more, refused.
    assert not acc.begin_access(a(103.0), "k").allowed
    events += read(acc, "k", a(103.0), a(104.0))
    assert_no_stale_completion(free, events, "k", "retry after a failed transfer whose notification freed the lease")
    assert_retrack_refused(acc, a(104.0), "k", tk)  # and the ticket cannot be tracked again
    # The Release reaches P after the free: nothing more happens.
    for s in sends(events, Release):
        assert free_of(pin.receive(p(14.0), wire(s.message)), tk.lease_id) is None


@pytest.mark.parametrize("posted", [True, False])
def test_5b_ok_verdict_of_failed_attempt_completes_the_retry(posted: bool) -> None:
    pin, acc, tk = connected_pair("k")  # valid until ~a(119.95); P expiry p(30)
    # Heartbeats every 5 s reach P (which renews) but every ack is lost: A's validity lapses.
    for t in (105.0, 110.0, 115.0, 120.0):
        assert heartbeat_round(acc, [pin], a(t), p(t - 90.0), deliver_acks=False) == []
    # A: attempt 1 at a(121): not guaranteed, the attached AccessDone asks confirm=True.
    d1 = acc.begin_access(a(121.0), "k")
    assert d1.allowed and not d1.guaranteed and d1.notification is not None and d1.notification.confirm
    # P gets attempt 1's notification at p(31.5): lease live -> OK, Free(access_done).
    p_out = pin.receive(p(31.5), wire(d1.notification))
    free = free_of(p_out, tk.lease_id)
    assert free is not None
    verdicts = sends(p_out, AccessDoneAck)
    assert [m.attempt for m in messages(p_out, AccessDoneAck)] == [d1.notification.attempt]
    # The OK verdict reaches A while attempt 1 is still in flight.
    events: list[object] = []
    for s in verdicts:
        events += acc.receive(a(121.6), wire(s.message))
    # The transport reports attempt 1 failed. posted=True (what happened: the notification was
    # delivered): v2 gives the lease up. posted=False (a transport that wrongly claims nothing
    # was handed over): the retry is allowed, and only the attempt binding keeps attempt 1's
    # verdict from deciding attempt 2.
    events += acc.access_failed(a(122.0), "k", posted=posted)
    if posted:
        assert LeaseLost("k", tk.lease_id, LostReason.ACCESS_FAILED) in events
        assert not acc.begin_access(a(123.0), "k").allowed
    else:
        assert not_sends(events) == [] and acc.state_of("k") is TrackedState.WAITING
    # A: retry at a(123) (= p(33), after the free); its own notification is lost. The network
    # duplicates attempt 1's verdict during the retry and after it.
    d2 = acc.begin_access(a(123.0), "k")
    assert d2.allowed is not posted
    if d2.allowed:
        assert d2.notification is not None and d2.notification.attempt != d1.notification.attempt
        for s in verdicts:
            events += acc.receive(a(123.5), wire(s.message))
        events += acc.access_finished(a(124.0), "k", notified=True)
        for s in verdicts:
            events += acc.receive(a(124.5), wire(s.message))
        assert acc.state_of("k") is TrackedState.CONFIRMING  # attempt 2's own verdict decides
    assert_no_stale_completion(free, events, "k", "attempt 1's OK verdict was applied to attempt 2")


# == 6. configuration and time validation ========================================================


def test_6a_zero_validity_margin_is_rejected() -> None:
    with pytest.raises(ConfigError, match="validity_margin"):
        LeaseConfig(validity_margin=0.0)
    with pytest.raises(ConfigError, match="validity_margin"):
        LeaseConfig(validity_margin=MIN_VALIDITY_MARGIN / 2)
    assert LeaseConfig(validity_margin=MIN_VALIDITY_MARGIN).validity_margin == MIN_VALIDITY_MARGIN


def _pinner_at_zero() -> tuple[Pinner, LeaseTicket]:
    pin = make_pinner(CFG, PIN, INC)
    return pin, pin.grant(p(0.0), "k")


def _accessor_tracking() -> Accessor:
    acc = make_accessor(CFG, ACC)
    acc.track(a(0.0), "k", LeaseTicket(PIN, INC, 1))
    return acc


NON_FINITE_CALLS: dict[str, Callable[[LocalTime], object]] = {
    "pinner.grant": lambda now: _pinner_at_zero()[0].grant(now, "k2"),
    "pinner.handle_timeout": lambda now: _pinner_at_zero()[0].handle_timeout(now),
    "pinner.release": lambda now: _pinner_at_zero()[0].release(now, 1),
    "pinner.receive": lambda now: _pinner_at_zero()[0].receive(
        now, make_accessor(CFG, ACC).handshake(a(0.0), PIN).message
    ),
    "accessor.track": lambda now: make_accessor(CFG, ACC).track(now, "k", LeaseTicket(PIN, INC, 1)),
    "accessor.handle_timeout": lambda now: _accessor_tracking().handle_timeout(now),
    "accessor.begin_access": lambda now: _accessor_tracking().begin_access(now, "k"),
}


@pytest.mark.parametrize("call", list(NON_FINITE_CALLS))
@pytest.mark.parametrize("now", [math.inf, math.nan, 1e17, MAX_TIME * 2])
def test_6b_non_finite_time_is_local_misuse(call: str, now: float) -> None:
    with pytest.raises(LocalProtocolError, match="finite time"):
        NON_FINITE_CALLS[call](LocalTime(now))


@pytest.mark.parametrize("call", ["pinner.handle_timeout", "accessor.handle_timeout"])
def test_6b_minus_infinity_as_first_time_is_local_misuse(call: str) -> None:
    side = make_pinner(CFG, PIN, INC) if call.startswith("pinner") else make_accessor(CFG, ACC)
    with pytest.raises(LocalProtocolError, match="finite time"):
        side.handle_timeout(LocalTime(-math.inf))


def test_6c_next_deadline_after_handle_timeout_is_later_than_now_at_1e17() -> None:
    t = 1e17  # ulp(1e17) = 16 s: now + heartbeat_interval rounds back to now
    # v2 refuses such a clock reading on both sides (|now| <= MAX_TIME = 2**32 s).
    pin = make_pinner(CFG, PIN, INC)
    with pytest.raises(LocalProtocolError, match="finite time"):
        pin.grant(LocalTime(t), "k", push=True)
    with pytest.raises(LocalProtocolError, match="finite time"):
        make_accessor(CFG, ACC).track(LocalTime(t), "k", LeaseTicket(PIN, INC, 1))
    # At the largest accepted magnitude (ulp ~ 1e-6 s) deadlines still move past now.
    t = MAX_TIME - 1000.0
    pin = make_pinner(CFG, PIN, INC)
    pin.grant(LocalTime(t), "k", push=True)  # push lease, so the quarantine step is exercised too
    pin.handle_timeout(LocalTime(t))
    assert_deadline_after(pin, t, "pinner")
    nd = pin.next_deadline()
    assert nd is not None
    pin.handle_timeout(nd)
    assert_deadline_after(pin, nd, "pinner, quarantine")
    # Accessor near MAX_TIME, pinner at its usual epoch.
    pin2 = make_pinner(CFG, PIN, INC)
    tk = pin2.grant(p(0.0), "k")
    acc = make_accessor(CFG, ACC)
    out = acc.track(LocalTime(t), "k", tk)
    acc.handle_timeout(LocalTime(t))  # handshake still pending
    assert_deadline_after(acc, t, "accessor, handshake pending")
    handshake(acc, out, pin2, LocalTime(t), p(0.0))
    heartbeat_round(acc, [pin2], LocalTime(t), p(0.0))
    assert_deadline_after(acc, t, "accessor, connected")
    assert acc.valid_until("k") is not None


# == 7. liveness: another rank's completion kills this rank's lease ==============================


@pytest.mark.parametrize(("p_ranks", "a_ranks"), [(2, 2), (4, 2)])
def test_7_other_ranks_completion_does_not_lose_this_ranks_lease(p_ranks: int, a_ranks: int) -> None:
    pins = [make_pinner(CFG, PIN, INC, rank=r, ranks=p_ranks) for r in range(p_ranks)]
    tks = [pin.grant(p(0.0), "k") for pin in pins]
    tk = tks[0]
    accs = [make_accessor(CFG, ACC, rank=r, ranks=a_ranks) for r in range(a_ranks)]
    for acc in accs:
        # Every accessor rank tracks at a(100), handshakes, and gets one round acked by its pinner ranks.
        assert handshake(acc, acc.track(a(100.0), "k", tk), pins[0], a(100.0), p(10.0)) == []
        assert heartbeat_round(acc, pins, a(100.0), p(10.0)) == []
    # Accessor rank 0 reads its pinner ranks; their notifications free them (Free(access_done)).
    d0 = accs[0].begin_access(a(101.0), "k")
    assert d0.guaranteed and len(d0.notifications) == len(d0.targets)
    for r in d0.targets:
        assert free_of(pins[r].receive(p(11.0), wire(d0.notification_for(r))), tk.lease_id) is not None
    assert completions(accs[0].access_finished(a(101.5), "k", notified=True), "k")
    # Accessor rank 1, still waiting, heartbeats at a(105). v2: only to its own pinner ranks, so
    # pinner rank 0's "completed" never reaches it.
    out = accs[1].handle_timeout(a(105.0))
    hbs = sends(out, Heartbeat)
    assert {s.rank for s in hbs} == set(range(p_ranks // a_ranks, p_ranks))
    events = not_sends(out)
    for s in hbs:
        assert s.rank is not None
        for reply in sends(pins[s.rank].receive(p(15.0), wire(s.message))):
            events += accs[1].receive(a(105.0), wire(reply.message))
        # Misrouted to a pinner rank accessor rank 1 does not access (the completed one): refused,
        # no ack to lose the lease with.
        for q in d0.targets:
            misrouted = pins[q].receive(p(15.0), wire(s.message))
            assert len(misrouted) == 1 and isinstance(misrouted[0], Rejected), misrouted
    assert_not_lost(events, "k", "another accessor rank's completion on another pinner rank")
    assert accs[1].state_of("k") is TrackedState.WAITING
    # Rank 1 can still read its own pinner ranks, which still hold the lease.
    d1 = accs[1].begin_access(a(106.0), "k")
    assert d1.allowed, f"accessor rank 1 cannot read a lease its pinner ranks hold: {d1}"
    assert d1.guaranteed and len(d1.notifications) == len(d1.targets)
    for r in d1.targets:
        assert pins[r].info(tk.lease_id) is not None  # still pinned there
        assert free_of(pins[r].receive(p(16.5), wire(d1.notification_for(r))), tk.lease_id) is not None
    assert completions(accs[1].access_finished(a(107.0), "k", notified=True), "k")
    assert all(pin.live_count == 0 for pin in pins)


# == 8. spec/code disagreements (the spec's behaviour is asserted) ===============================


def test_8a_heartbeat_at_expiry_reports_expired_not_renewed() -> None:
    pin = make_pinner(CFG, PIN, INC)
    tk = pin.grant(p(0.0), "k")  # expiry p(30)
    acc = make_accessor(CFG, ACC)
    assert handshake(acc, acc.track(a(100.0), "k", tk), pin, a(100.0), p(0.5)) == []
    # A heartbeats at a(100); the heartbeat is delayed until p(30.0) == expiry (no handle_timeout ran).
    (hb,) = sends(acc.handle_timeout(a(100.0)), Heartbeat)
    (ack,) = sends(pin.receive(p(30.0), wire(hb.message)), HeartbeatAck)
    # Spec 3: "expired at pinner time now iff now >= expiry": must be reported expired, not renewed.
    assert isinstance(ack.message, HeartbeatAck)
    assert ack.message.renewed == 0 and tk.lease_id in ack.message.expired, (
        f"UNSAFE: heartbeat handled at expiry renewed the lease: {ack.message}"
    )
    info = pin.info(tk.lease_id)
    assert info is not None and info.expiry == p(30.0)  # not extended


def test_8a2_confirmed_access_done_at_expiry_is_not_ok() -> None:
    pin = make_pinner(CFG, PIN, INC)
    tk = pin.grant(p(0.0), "k")  # expiry p(30)
    acc = make_accessor(CFG, ACC)
    assert handshake(acc, acc.track(a(100.0), "k", tk), pin, a(100.0), p(0.5)) == []
    # A reads without validity: the attached AccessDone asks confirm=True; it reaches P at p(30.0).
    d = acc.begin_access(a(100.5), "k")
    assert d.allowed and d.notification is not None and d.notification.confirm
    outs = pin.receive(p(30.0), wire(d.notification))
    verdicts = [m.outcome for m in messages(outs, AccessDoneAck)]
    # Spec 5.7: OK iff the lease was ACTIVE when handled; at now >= expiry it is expired.
    assert verdicts and AccessOutcome.OK not in verdicts, f"UNSAFE: AccessDone at expiry answered {verdicts}"
    assert verdicts == [AccessOutcome.STALE] and free_of(outs, tk.lease_id) is None  # expiry frees it


def test_8b_release_of_an_id_never_granted_is_local_misuse() -> None:
    pin = make_pinner(CFG, PIN, INC)
    pin.grant(p(0.0), "k", lease_id=100)
    with pytest.raises(LocalProtocolError, match="never granted"):
        pin.release(p(1.0), 101)  # 101 was never granted (it is the next id)
    # v2: ids only increase, so 50 (below the next id) may have ended and been forgotten: a
    # harmless race, not misuse; an id that was never issued at all is.
    assert pin.release(p(1.0), 50) == ()
    with pytest.raises(LocalProtocolError, match="never granted"):
        pin.release(p(1.0), 2**40)


def test_8c_grant_after_the_largest_lease_id_is_local_misuse() -> None:
    pin = make_pinner(CFG, PIN, INC)
    pin.grant(p(0.0), "a", lease_id=2**64 - 1)
    with pytest.raises(LocalProtocolError):
        tk = pin.grant(p(1.0), "b")
        assert tk.lease_id < 2**64, f"UNSAFE: assigned lease id {tk.lease_id} (not a uint64)"
    with pytest.raises(LocalProtocolError):
        pin.grant(p(1.0), "c", lease_id=2**64)
    assert pin.live_count == 1


def test_8d_heartbeat_ack_stays_within_max_message_bytes() -> None:
    limit = CFG.max_message_bytes
    gap = 2**16 - 1  # heartbeat gaps: uint16 (3 B); gaps within one ack list: >= 2**16 (5 B)
    ids = [1 + i * gap for i in range(600)]
    slot = {lid: ("unknown", "expired", "released", "completed")[i % 4] for i, lid in enumerate(ids)}
    pin = make_pinner(CFG, PIN, INC)
    tickets = {lid: pin.grant(p(0.0), f"r{lid}", lease_id=lid) for lid in ids if slot[lid] != "unknown"}
    template = next(iter(tickets.values()))
    for lid in ids:
        if slot[lid] == "unknown":  # a ticket for an id P never granted
            tickets[lid] = attrs.evolve(template, lease_id=lid)
    acc = make_accessor(CFG, ACC)
    out: list[object] = []
    for lid in ids:  # A tracks every id at a(100)
        out += acc.track(a(100.0), f"r{lid}", tickets[lid])
    assert handshake(acc, out, pin, a(100.0), p(0.5)) == []
    # A heartbeats all ids at a(100), split to its size bound; the heartbeats are delayed.
    hbs = sends(acc.handle_timeout(a(100.0)), Heartbeat)
    assert len(hbs) >= 1
    for s in hbs:
        assert len(encode(s.message)) <= limit  # precondition: the accessor respects the bound
    # Meanwhile P ends the leases: "completed" ones by A's AccessDone, "released" ones locally,
    # and the rest ("expired") by timeout at p(30).
    for lid in ids:
        if slot[lid] == "completed":
            d = acc.begin_access(a(100.5), f"r{lid}")
            assert d.notification is not None
            assert free_of(pin.receive(p(1.0), wire(d.notification)), lid) is not None
    for lid in ids:
        if slot[lid] == "released":
            assert free_of(pin.release(p(2.0), lid), lid) is not None
    pin.handle_timeout(p(30.0))
    assert pin.live_count == 0
    # The heartbeats reach P at p(31): every id lands in one of the four lists, alternately.
    largest = 0
    accounted: list[int] = []
    for s in hbs:
        acks = sends(pin.receive(p(31.0), wire(s.message)))
        assert len(acks) == 1
        for ack in acks:
            size = len(encode(ack.message))
            largest = max(largest, size)
            assert size <= limit, (
                f"UNSAFE: heartbeat of {len(encode(s.message))} B answered by an ack of {size} B > {limit} B"
            )
            m = ack.message
            assert isinstance(m, HeartbeatAck) and m.unknown and m.expired and m.released and m.completed
            accounted += [*m.unknown, *m.expired, *m.released, *m.completed]
            # The accessor accepts it: it accounts exactly for the heartbeat's ids.
            assert not rejections(acc.receive(a(101.0), wire(m)))
    assert sorted(accounted) == ids
    assert largest > limit * 3 // 4  # the worst case was approached, not avoided by tiny chunks


# == 9. found while porting to v2 (no v1 counterpart) =============================================


def test_9_restarted_accessor_gets_ok_from_the_tombstone_for_a_read_after_the_free() -> None:
    pin, acc, tk = connected_pair("k")
    # A reads (covered) and its notification ends the lease at P: Free(access_done), memory reused.
    d = acc.begin_access(a(101.0), "k")
    assert d.guaranteed and d.notification is not None
    assert completions(acc.access_finished(a(101.5), "k", notified=True), "k")
    free = free_of(pin.receive(p(11.5), wire(d.notification)), tk.lease_id)
    assert free is not None
    # The decode process restarts: same engine id and rank, a new session, no memory. The request
    # is retried there with the same ticket (a router re-sending kv_transfer_params).
    again = make_accessor(CFG, ACC, session=acc.session + 1)
    assert handshake(again, again.track(a(110.0), "k", tk), pin, a(110.0), p(20.0)) == []
    # It reads before any heartbeat round (pull: allowed, not guaranteed: it asks to confirm).
    d2 = again.begin_access(a(110.0), "k")
    assert d2.allowed and not d2.guaranteed and d2.notification is not None and d2.notification.confirm
    events = list(again.access_finished(a(110.5), "k", notified=True))
    verdicts = sends(pin.receive(p(21.0), wire(d2.notification)), AccessDoneAck)
    for s in verdicts:
        events += again.receive(a(111.0), wire(s.message))
    # The read began ten seconds after the free: it must not be reported done.
    assert_no_stale_completion(free, events, "k", "a restarted accessor was confirmed from the tombstone")
    assert outcomes(verdicts) == [AccessOutcome.STALE]


# == 10. protocol v3: the deployment is part of the fault model ====================================
#
# Each test FAILED on the protocol-v2 core (commit f6bd4b1) with the unsafe outcome in its
# docstring; v3's mechanism is in the last sentence. Measured on v2 (the tests that use only v2
# calls were run there unchanged; the others by the same sequence in v2's API): 10a
# `guaranteed` at +10 s with a 19.946 s window on a lease P freed at +6 s; 10b Free(released)
# 0.06 s after begin_access; 10c (v2 had one notification for both parts) rank 0 freed by part
# 1's; 10d a 1,366 B heartbeat answered by a 1,379 B ack (bound 1,024), and EncodeError near
# 1 MiB; 10e 1,123 of 5,000 live leases given up; 10f no lease validated; 10g the new lease lost
# as pinner_restarted; 10h LeaseConfig(max_access_time=0) accepted, push_guard 0.


def test_10a_settings_apart_never_give_a_window_the_pinner_does_not_honour() -> None:
    """v2: P at kv_lease_duration 6 (extension 4 s), D at 30: D counted the lease valid 19.9 s
    after its acked heartbeat, P freed it 4 s after; a read at +10 s was reported
    AccessCompleted on freed memory. v3: P states its terms, D takes the stricter."""
    short, long = CFG.with_changes(kv_lease_duration=6.0), CFG.with_changes(kv_lease_duration=30.0)
    pin = make_pinner(short, PIN, INC)
    tk = pin.grant(p(10.0), "k")
    acc = make_accessor(long, ACC)
    assert handshake(acc, acc.track(a(100.0), "k", tk), pin, a(100.0), p(10.0)) == []
    assert heartbeat_round(acc, [pin], a(100.0), p(10.0)) == []
    v = acc.valid_until("k")
    assert v is not None and v <= A_EPOCH + 100.0 + short.accessor_extension + 1e-9
    assert v < A_EPOCH + 100.0 + long.accessor_extension - 15.0
    # D stops heartbeating (overloaded); P's lease runs out at p(16): max(10 + 6, 10 + 4).
    (free,) = pin.handle_timeout(p(16.0))
    assert isinstance(free, Free) and free.lease_id == tk.lease_id
    events = read(acc, "k", a(110.0), a(110.5), notified=False)
    assert_no_stale_completion(free, events, "k", "a window from the accessor's own, longer lease")
    # And D heartbeats at a quarter of P's stated extension, not its own period (5 s).
    nd = acc.next_deadline()
    assert nd is None or nd <= A_EPOCH + 100.0 + short.lease_extension / 4 + 1e-9


def test_10b_a_posted_failed_push_write_keeps_the_destination_until_expiry_and_guard() -> None:
    """v2: push lease, guaranteed begin_access, the WRITE fails after posting (it may still
    land), access_failed(posted=True) -> Release -> Free(released) at once, 50 ms later, while
    the WRITE could land until begin + A. v3: Release(posted=True) holds it to expiry + G."""
    pin = make_pinner(CFG, PIN, INC)
    tk = pin.grant(p(10.0), "k", push=True)
    acc = make_accessor(CFG, ACC)
    assert handshake(acc, acc.track(a(100.0), "k", tk, push=True), pin, a(100.0), p(10.0)) == []
    assert heartbeat_round(acc, [pin], a(100.0), p(10.0)) == []  # P: expiry max(40, 30) = p(40)
    assert acc.begin_access(a(100.1), "k").guaranteed
    out = acc.access_failed(a(100.15), "k", posted=True)
    (rel,) = messages(out, Release)
    assert rel.posted
    got = pin.receive(p(10.16), wire(rel))
    assert free_of(got, tk.lease_id) is None, f"UNSAFE: freed while the posted WRITE may land: {got}"
    write_may_land_until = 10.1 + CFG.max_access_time
    assert pin.handle_timeout(p(write_may_land_until + 0.01)) == ()
    assert pin.handle_timeout(p(40.0)) == ()  # expired: quarantined for the guard
    (free,) = pin.handle_timeout(p(40.0 + CFG.push_guard))
    assert isinstance(free, Free) and free.lease_id == tk.lease_id


def test_10c_one_parts_access_done_misdelivered_to_a_sibling_rank_frees_nothing() -> None:
    """v2: pinner TP 2, accessor TP 1: every part carried the same AccessDone; part 1's,
    delivered to pinner rank 0 (the wrong rank of the right engine), freed rank 0 while the
    READ from rank 0 was still running, and the access was reported AccessCompleted. v3: each
    part's access-done names its pinner rank, and a rank refuses another's."""
    pins = [make_pinner(CFG, PIN, INC, rank=r, ranks=2) for r in range(2)]
    tk = pins[0].grant(p(10.0), "k")
    pins[1].grant(p(10.0), "k")
    acc = make_accessor(CFG, ACC)
    assert handshake(acc, acc.track(a(100.0), "k", tk), pins[0], a(100.0), p(10.0)) == []
    assert heartbeat_round(acc, pins, a(100.0), p(10.0)) == []
    d = acc.begin_access(a(101.0), "k")
    assert d.guaranteed and d.targets == (0, 1)
    part1 = d.notification_for(1)
    assert part1.to_rank == 1 and d.notification_for(0).to_rank == 0
    with pytest.raises(LocalProtocolError, match="notification_for"):
        _ = d.notification  # one notification for several parts is exactly the v2 hole
    got = pins[0].receive(p(11.1), wire(part1))  # rank 0's own part is still running
    assert_rejected_not_freed(got, "another part's access-done at pinner rank 0")
    assert free_of(pins[0].receive(p(11.2), wire(d.notification_for(0))), tk.lease_id) is not None
    assert free_of(pins[1].receive(p(11.2), wire(part1)), tk.lease_id) is not None
    assert completions(acc.access_finished(a(101.5), "k", notified=True), "k")


def test_10d_a_heartbeat_whose_ack_cannot_fit_is_refused_not_answered() -> None:
    """v2: a heartbeat of ids 2**32 apart was answered by an ack larger than max_message_bytes
    (and, near the 1 MiB frame bound, by one `encode` refused: EncodeError raised into the
    driver's step). v3: a heartbeat whose ack could exceed the pinner's bound gets Rejected and
    no ack; every ack the pinner makes fits by construction."""
    pin = make_pinner(CFG, PIN, INC)
    ids = tuple(1 + i * 2**32 for i in range(150))  # 9 bytes each: ~1.4 KB, over 1024
    hb = Heartbeat(ACC, 0, 1, session_of(ACC, 0), INC, 1, a(100.0), ids)
    out = pin.receive(p(10.0), wire(hb))
    assert len(out) == 1 and isinstance(out[0], Rejected) and "budget" in out[0].reason, out
    # Just under the 1 MiB frame bound, every field at its widest, to a pinner with a 200-byte
    # id: v2's ack was 125 bytes over the bound and `encode` raised.
    wide = make_pinner(CFG, "p" * 200, INC)
    near = tuple(1 + i * 2**32 for i in range(116_495))
    big = Heartbeat(ACC, 0, 1, 2**64 - 1, INC, 2**64 - 1, a(100.0), near)
    assert len(encode(big)) > 2**20 - 100
    out = wide.receive(p(10.0), decode(encode(big)))
    assert not sends(out) and rejections(out)
    # An honest accessor's heartbeats (split by both bounds) are all answered within the bound.
    acc = make_accessor(CFG, ACC)
    tks = [pin.grant(p(11.0), f"k{i}", lease_id=1 + i * 2**32) for i in range(1, 150)]
    for i, tk in enumerate(tks):
        tracked = acc.track(a(101.0), f"k{i}", tk)
        if i == 0:
            assert handshake(acc, tracked, pin, a(101.0), p(11.0)) == []
    hbs = sends(acc.handle_timeout(a(101.0)), Heartbeat)
    assert len(hbs) > 1
    for s in hbs:
        (ack,) = sends(pin.receive(p(11.0), wire(s.message)))
        assert len(encode(ack.message)) <= CFG.max_message_bytes


def test_10e_many_leases_at_a_small_bound_all_validate() -> None:
    """v2 (hole 5a): 5,000 leases at max_message_bytes=192: the periodic round is 81 chunks; a
    round of new ids sent before its acks came back cut the outstanding records to 63 (the
    bound counted chunks), so with requests arriving every period the same first chunks were
    dropped each time: 1,123 leases never validated and were given up while P kept them
    active. v3: the bound counts rounds, and a round is never cut apart."""
    cfg = CFG.with_changes(max_message_bytes=192)
    pin = make_pinner(cfg, PIN, INC)
    acc = make_accessor(cfg, ACC)
    tks = [pin.grant(p(10.0), f"k{i}") for i in range(5000)]
    assert handshake(acc, acc.track(a(100.0), "k0", tks[0]), pin, a(100.0), p(10.0)) == []
    for i, tk in enumerate(tks[1:], 1):
        assert acc.track(a(100.0), f"k{i}", tk) == ()
    events: list[object] = []
    for n in range(8):  # 40 s: past the give-up time of a lease never validated (d = 30 s)
        t = 100.0 + 5.0 * n
        periodic = acc.handle_timeout(a(t))
        events.extend(not_sends(periodic))
        assert n > 0 or len(sends(periodic, Heartbeat)) > 64
        new = pin.grant(p(t - 89.9), f"new{n}")  # a request arrives before the acks are back
        events.extend(acc.track(a(t + 0.1), f"new{n}", new))
        more = acc.handle_timeout(a(t + 0.1))
        events.extend(not_sends(more))
        for s in sends(periodic, Heartbeat) + sends(more, Heartbeat):
            for reply in sends(pin.receive(p(t - 89.5), wire(s.message))):
                events.extend(acc.receive(a(t + 0.9), wire(reply.message)))
    lost = [e for e in events if isinstance(e, LeaseLost)]
    assert not lost, f"UNSAFE (liveness): {len(lost)} live leases given up, e.g. {lost[:2]}"
    assert all(acc.valid_until(f"k{i}") is not None for i in range(5000)), "a lease never validated"


def test_10f_more_rounds_per_round_trip_than_the_bound_still_validate() -> None:
    """v2 (hole 5b): one track per 10 ms step with a 0.7 s round trip: more than 64 rounds per
    round trip, every record dropped before its ack came, no lease ever validated. v3: rounds
    of new ids wait for the periodic round while the bound is reached; periodic rounds drop
    only rounds that can no longer extend anything."""
    pin = make_pinner(CFG, PIN, INC)
    acc = make_accessor(CFG, ACC)
    inflight: list[tuple[float, Heartbeat]] = []
    tk0 = pin.grant(p(10.0), "k0")
    assert handshake(acc, acc.track(a(100.0), "k0", tk0), pin, a(100.0), p(10.0)) == []
    events: list[object] = []
    t = 100.0
    for i in range(1, 400):
        t = 100.0 + i * 0.01
        tk = pin.grant(p(t - 90.0), f"k{i}")
        events.extend(acc.track(a(t), f"k{i}", tk))
        out = acc.handle_timeout(a(t))
        events.extend(not_sends(out))
        inflight += [(t, s.message) for s in sends(out, Heartbeat) if isinstance(s.message, Heartbeat)]
        while inflight and inflight[0][0] + 0.7 <= t:  # RTT 0.7 s
            _, hb = inflight.pop(0)
            for reply in sends(pin.receive(p(t - 90.0), wire(hb))):  # 0.7 s one way, ack at once
                events.extend(acc.receive(a(t), wire(reply.message)))
    assert not [e for e in events if isinstance(e, LeaseLost)]
    assert acc.valid_until("k0") is not None and acc.valid_until("k100") is not None


def test_10g_a_delayed_reply_to_a_handshake_before_the_restart_loses_nothing_new() -> None:
    """v2 (hole 6): a proactive handshake sent to incarnation 1; P restarts (incarnation 2) and
    grants; D tracks the new ticket; the delayed reply of incarnation 1 arrives and was
    accepted: the new lease was lost as pinner_restarted. v3: tracking a ticket of another
    incarnation than the one the outstanding handshakes may reach forgets them."""
    old = make_pinner(CFG, PIN, INC)
    acc = make_accessor(CFG, ACC)
    hs = acc.handshake(a(100.0), PIN)
    late = old.handshake_reply(p(10.0), wire(hs.message))  # delayed in the network
    new = make_pinner(CFG, PIN, INC2)  # the restart
    tk = new.grant(p(11.0), "k")
    out = acc.track(a(101.0), "k", tk)
    events = list(acc.handshake_reply(a(101.5), wire(late)))
    assert_not_lost(events, "k", "a delayed reply of the pinner's previous incarnation")
    assert acc.state_of("k") is TrackedState.WAITING
    assert handshake(acc, list(out) + list(acc.handle_timeout(a(101.6))), new, a(101.6), p(11.6)) == []
    assert heartbeat_round(acc, [new], a(101.7), p(11.7)) == []
    assert acc.valid_until("k") is not None


def test_10h_an_access_time_bound_of_zero_is_refused() -> None:
    """v2 (hole 7): max_access_time=0 was accepted (G = 0; a push WRITE approved at
    now == valid_until). v3: at least MIN_ACCESS_TIME (1 ms), a ConfigError naming it."""
    with pytest.raises(ConfigError, match="max_access_time"):
        LeaseConfig(max_access_time=0.0)
    with pytest.raises(ConfigError, match="max_access_time"):
        LeaseConfig(max_access_time=MIN_ACCESS_TIME / 2)
    assert LeaseConfig(max_access_time=MIN_ACCESS_TIME).push_guard > 0


# -- issue 21.2: a ticket published before its grant --------------------------------------------
#
# vLLM's producer scheduler publishes the ticket (request_finished) a step before its workers
# grant it (the connector metadata carrying the grant runs one step later: a whole prefill
# forward with async scheduling). Shown failing on the v3 core before the rule (de74a7c): the
# heartbeat was answered `unknown` at once and the accessor lost the lease (LeaseLost(unknown)),
# while the pinner then held the memory for the whole initial lease.


def test_11a_a_heartbeat_for_a_lease_granted_a_step_later_keeps_it() -> None:
    pin = make_pinner(CFG, PIN, INC)
    first = pin.grant(p(10.0), "warm")  # the pinner is known to the accessor already
    acc = make_accessor(CFG, ACC)
    assert handshake(acc, acc.track(a(100.0), "warm", first), pin, a(100.0), p(10.0)) == []
    # The scheduler's ticket for the next lease reaches the decoder before the worker grants.
    early = LeaseTicket.from_dict({**first.to_dict(), "lease_id": first.lease_id + 1})
    assert acc.track(a(100.2), "k", early) == ()
    sends = [o for o in acc.handle_timeout(a(100.2)) if isinstance(o, Send)]
    assert sends, "the new id is heartbeated at once"
    outs: list[object] = []
    for s in sends:
        outs.extend(pin.receive(p(10.3), wire(s.message)))
    assert outs == [], "held: no answer before the grant"
    nd = pin.next_deadline()
    assert nd is not None and nd <= p(10.3) + CFG.heartbeat_interval
    # The worker's step: the grant arrives, then handle_timeout answers the held heartbeat.
    tk = pin.grant(p(10.35), "k")
    assert tk.lease_id == early.lease_id
    nd = pin.next_deadline()
    assert nd is not None and nd <= p(10.35), "due at once once granted"
    acks = [o for o in pin.handle_timeout(p(10.35)) if isinstance(o, Send)]
    assert len(acks) == len(sends)
    lost: list[object] = []
    for ack in acks:
        assert isinstance(ack.message, HeartbeatAck) and ack.message.unknown == ()
        lost.extend(acc.receive(a(100.45), wire(ack.message)))
    assert lost == []
    decision = acc.begin_access(a(100.5), "k")
    assert decision.allowed and decision.guaranteed
