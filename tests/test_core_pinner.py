"""The pinner, state x input, through the public API (h2 style): every message type in every
lease state, duplicates, late messages, wrong incarnations, misuse, the tombstone bound and the
expiry heap; and the v2 rules: the TP layout decides who may speak for a lease and how many
ranks must report, a lease is bound to the accessor that first speaks for it, a lease at its
expiry is expired for every message, ids only increase, and times are bounded."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import TypedDict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlease import (
    MAX_TIME,
    PROTOCOL_VERSION,
    AccessDone,
    AccessDoneAck,
    AccessOutcome,
    EndReason,
    Free,
    Handshake,
    HandshakeReply,
    Heartbeat,
    HeartbeatAck,
    LeaseConfig,
    LeaseKind,
    LeaseState,
    LocalProtocolError,
    LocalTime,
    Message,
    PeerTime,
    Pinner,
    PinnerOutput,
    Rejected,
    Release,
    Send,
)
from kvlease._layout import accesses

CFG = LeaseConfig(kv_lease_duration=6.0, max_access_time=0.5, decoder_kv_blocks_ttl=10.0, tombstone_limit=16)
T0 = 73_129.25  # a clock epoch far from zero
INC = 0xDEADBEEF
ACC = "decode-0"
OTHER = "decode-1"
SES = 0x5E55_1011  # the accessor's session
ATTEMPT = 41


class Speaker(TypedDict, total=False):
    """Who a test message claims to come from, where it differs from the defaults."""

    engine: str
    session: int


class Layout(TypedDict, total=False):
    """A TP layout, where it differs from the defaults (rank 0 of 1)."""

    rank: int
    ranks: int


class GrantOptions(TypedDict, total=False):
    """Keyword arguments of `Pinner.grant`."""

    kind: LeaseKind
    ttl: float
    expected: int
    lease_id: int


def _t(dt: float) -> LocalTime:
    return LocalTime(T0 + dt)


def _hb(
    ids: tuple[int, ...],
    *,
    inc: int = INC,
    seq: int = 1,
    at: float = 1.0,
    engine: str = ACC,
    rank: int = 0,
    ranks: int = 1,
    session: int = SES,
) -> Heartbeat:
    return Heartbeat(engine, rank, ranks, session, inc, seq, LocalTime(at), ids)


def _done(
    lid: int,
    *,
    inc: int = INC,
    confirm: bool = True,
    engine: str = ACC,
    rank: int = 0,
    ranks: int = 1,
    session: int = SES,
    attempt: int = ATTEMPT,
    to_rank: int = 0,
) -> AccessDone:
    return AccessDone(engine, rank, ranks, session, inc, to_rank, lid, attempt, confirm, LocalTime(2.0))


def _rel(
    ids: tuple[int, ...],
    *,
    inc: int = INC,
    engine: str = ACC,
    rank: int = 0,
    ranks: int = 1,
    session: int = SES,
) -> Release:
    return Release(engine, rank, ranks, session, inc, ids)


def _done_ack(
    lid: int, outcome: AccessOutcome, *, rank: int = 0, session: int = SES, attempt: int = ATTEMPT
) -> AccessDoneAck:
    return AccessDoneAck("prefill-0", 0, INC, rank, session, lid, attempt, outcome)


def _only_ack(out: tuple[PinnerOutput, ...], *, engine: str = ACC, rank: int = 0, session: int = SES) -> HeartbeatAck:
    assert len(out) == 1 and isinstance(out[0], Send) and isinstance(out[0].message, HeartbeatAck), out
    assert out[0].engine_id == engine and out[0].rank == rank
    ack = out[0].message
    assert (ack.to_rank, ack.to_session) == (rank, session)
    return ack


# -- lease states ------------------------------------------------------------------------------

# Each builder returns (pinner, lease id, now) with the lease in the named state at `now`.
Builder = Callable[[], tuple[Pinner, int, LocalTime]]


def _active() -> tuple[Pinner, int, LocalTime]:
    p = Pinner(CFG, "prefill-0", INC)
    return p, p.grant(_t(0), "k").lease_id, _t(1)


def _active_push() -> tuple[Pinner, int, LocalTime]:
    p = Pinner(CFG, "prefill-0", INC)
    return p, p.grant(_t(0), "k", push=True).lease_id, _t(1)


def _active_fixed() -> tuple[Pinner, int, LocalTime]:
    p = Pinner(CFG, "prefill-0", INC)
    return p, p.grant(_t(0), "k", kind=LeaseKind.FIXED_TTL).lease_id, _t(1)


def _quarantined() -> tuple[Pinner, int, LocalTime]:
    p = Pinner(CFG, "prefill-0", INC)
    lid = p.grant(_t(0), "k", push=True).lease_id
    assert p.handle_timeout(_t(6.0)) == ()
    info = p.info(lid)
    assert info is not None and info.state is LeaseState.QUARANTINED
    assert info.expiry == pytest.approx(T0 + 6.0 + CFG.push_guard)
    return p, lid, _t(6.1)


def _ended(reason: EndReason) -> Builder:
    def build() -> tuple[Pinner, int, LocalTime]:
        p = Pinner(CFG, "prefill-0", INC)
        lid = p.grant(_t(0), "k").lease_id
        if reason is EndReason.ACCESS_DONE:
            out = p.receive(_t(1), _done(lid, confirm=False))
        elif reason is EndReason.RELEASED:
            out = p.receive(_t(1), _rel((lid,)))
        else:
            out = p.handle_timeout(_t(6.0))
        assert len(out) == 1 and type(out[0]) is Free and out[0].reason is reason
        assert p.ended_reason(lid) is reason and p.info(lid) is None
        return p, lid, _t(7)

    return build


def _promised() -> tuple[Pinner, int, LocalTime]:
    """Renewed by a heartbeat: an accessor may now hold a validity window for it."""
    p = Pinner(CFG, "prefill-0", INC)
    lid = p.grant(_t(0), "k").lease_id
    _only_ack(p.receive(_t(0.5), _hb((lid,))))
    return p, lid, _t(1)


def _releasing() -> tuple[Pinner, int, LocalTime]:
    """Released by the local engine after a promise: held, unrenewed, until its expiry."""
    p, lid, now = _promised()
    assert p.release(now, lid) == ()
    info = p.info(lid)
    assert info is not None and info.state is LeaseState.RELEASING
    return p, lid, _t(1.5)


def _unknown() -> tuple[Pinner, int, LocalTime]:
    # Below the next id and never granted (an id at or above the next id is held, see
    # test_a_heartbeat_naming_a_lease_not_granted_yet_is_held).
    p = Pinner(CFG, "prefill-0", INC)
    p.grant(_t(0), "k", lease_id=1000)
    return p, 999, _t(1)


def _evicted() -> tuple[Pinner, int, LocalTime]:
    p = Pinner(CFG.with_changes(tombstone_limit=2), "prefill-0", INC)
    ids = [p.grant(_t(0), f"k{i}").lease_id for i in range(3)]
    for lid in ids:
        p.release(_t(0.5), lid)
    assert p.ended_reason(ids[0]) is None and p.ended_reason(ids[2]) is EndReason.RELEASED
    return p, ids[0], _t(1)


STATES: dict[str, Builder] = {
    "active": _active,
    "active_push": _active_push,
    "active_fixed": _active_fixed,
    "promised": _promised,
    "releasing": _releasing,
    "quarantined": _quarantined,
    "done": _ended(EndReason.ACCESS_DONE),
    "released": _ended(EndReason.RELEASED),
    "expired": _ended(EndReason.EXPIRED),
    "unknown": _unknown,
    "evicted": _evicted,
}
LIVE = {"active", "active_push", "active_fixed", "promised"}
HELD = LIVE | {"releasing", "quarantined"}

#: What a heartbeat ack reports for the lease in each state.
HB_EXPECT = {
    "active": "renewed",
    "active_push": "renewed",
    "active_fixed": "renewed",
    "promised": "renewed",
    "releasing": "released",
    "quarantined": "expired",
    "done": "completed",
    "released": "released",
    "expired": "expired",
    "unknown": "unknown",
    "evicted": "unknown",
}
DONE_EXPECT = {
    "active": AccessOutcome.OK,
    "active_push": AccessOutcome.OK,
    "active_fixed": AccessOutcome.OK,
    "promised": AccessOutcome.OK,
    "releasing": AccessOutcome.OK,  # still pinned: the access saw valid data
    "quarantined": AccessOutcome.STALE,
    "done": AccessOutcome.OK,  # a duplicate of a counted access
    "released": AccessOutcome.STALE,
    "expired": AccessOutcome.STALE,
    "unknown": AccessOutcome.UNKNOWN,
    "evicted": AccessOutcome.UNKNOWN,
}


def _ack_fields(ack: HeartbeatAck, lid: int) -> str:
    if ack.renewed:
        assert ack.renewed == 1
        return "renewed"
    for name in ("unknown", "expired", "released", "completed"):
        if lid in getattr(ack, name):
            return name
    raise AssertionError(f"lease {lid} missing from {ack!r}")


@pytest.mark.parametrize("state", list(STATES))
@pytest.mark.parametrize("dup", [1, 2])
def test_heartbeat_in_every_state(state: str, dup: int) -> None:
    p, lid, now = STATES[state]()
    before = p.info(lid)
    for i in range(dup):
        ack = _only_ack(p.receive(now, _hb((lid,), seq=7, at=123.5)))
        assert (ack.engine_id, ack.rank, ack.incarnation, ack.seq, ack.t_echo, ack.t_recv) == (
            "prefill-0",
            0,
            INC,
            7,
            LocalTime(123.5),
            PeerTime(now),  # the pinner's clock, as the peer sees it
        )
        assert _ack_fields(ack, lid) == HB_EXPECT[state], i
    after = p.info(lid)
    if state in ("active", "active_push", "promised"):
        assert before is not None and after is not None
        assert after.expiry == max(before.expiry, LocalTime(now + CFG.lease_extension))
    elif state in ("active_fixed", "quarantined", "releasing"):
        assert before == after  # fixed TTLs never move; quarantine and release are not renewable
    else:
        assert after is None and p.live_count == (1 if state == "unknown" else 0)


@pytest.mark.parametrize("state", list(STATES))
def test_heartbeat_of_wrong_incarnation_renews_nothing(state: str) -> None:
    p, lid, now = STATES[state]()
    before = p.info(lid)
    ack = _only_ack(p.receive(now, _hb((lid,), inc=INC + 1)))
    assert ack.unknown == (lid,) and ack.renewed == 0 and ack.incarnation == INC
    assert p.info(lid) == before


@pytest.mark.parametrize("state", list(STATES))
@pytest.mark.parametrize("confirm", [True, False])
def test_access_done_in_every_state(state: str, confirm: bool) -> None:
    p, lid, now = STATES[state]()
    out = list(p.receive(now, _done(lid, confirm=confirm)))
    frees = [o for o in out if isinstance(o, Free)]
    acks = [o.message for o in out if isinstance(o, Send)]
    if state in LIVE | {"releasing"}:
        reason = EndReason.RELEASED if state == "releasing" else EndReason.ACCESS_DONE
        assert frees == [Free(lid, "k", reason, now)]
        assert p.ended_reason(lid) is reason
    else:
        assert frees == []
    if confirm:
        assert acks == [_done_ack(lid, DONE_EXPECT[state])]
    else:
        assert acks == []
    # A duplicate never frees twice, and reports OK only if the first one counted.
    again = p.receive(now, _done(lid, confirm=True))
    assert not any(isinstance(o, Free) for o in again)


@pytest.mark.parametrize("state", list(STATES))
def test_access_done_of_wrong_incarnation(state: str) -> None:
    p, lid, now = STATES[state]()
    out = p.receive(now, _done(lid, inc=INC + 1, attempt=3))
    assert out == (Send(ACC, 0, _done_ack(lid, AccessOutcome.UNKNOWN, attempt=3)),)


@pytest.mark.parametrize("state", list(STATES))
@pytest.mark.parametrize("inc_ok", [True, False])
def test_release_message_in_every_state(state: str, inc_ok: bool) -> None:
    p, lid, now = STATES[state]()
    out = p.receive(now, _rel((lid,), inc=INC if inc_ok else INC + 1))
    if state in LIVE | {"releasing"} and inc_ok:
        assert out == (Free(lid, "k", EndReason.RELEASED, now),)
    else:
        assert out == ()
    if inc_ok:
        assert p.receive(now, _rel((lid,))) == ()  # late duplicate


@pytest.mark.parametrize("state", list(STATES))
def test_local_release_in_every_state(state: str) -> None:
    p, lid, now = STATES[state]()
    if state == "unknown":
        assert p.release(now, lid) == ()  # below the next id: nothing to release
        with pytest.raises(LocalProtocolError, match="never granted"):
            p.release(now, 5000)  # at or above it: never granted
        return
    before = p.info(lid)
    out = p.release(now, lid)
    if state in ("active", "active_push"):  # nothing promised yet: free at once
        assert out == (Free(lid, "k", EndReason.RELEASED, now),)
        return
    assert out == ()  # promised: held to expiry; quarantined: the guard frees it; ended: a race
    if state in ("active_fixed", "promised"):
        info = p.info(lid)
        assert info is not None and before is not None
        assert info.state is LeaseState.RELEASING and info.expiry == before.expiry
        (free,) = p.handle_timeout(info.expiry)
        assert free == Free(lid, "k", EndReason.RELEASED, info.expiry)


@pytest.mark.parametrize("state", list(STATES))
def test_timeout_in_every_state_frees_once(state: str) -> None:
    p, _lid, _now = STATES[state]()
    frees = [o for o in p.handle_timeout(_t(100)) if isinstance(o, Free)]
    if state == "releasing":
        assert [f.reason for f in frees] == [EndReason.RELEASED]
    elif state in HELD or state == "unknown":
        assert [f.reason for f in frees] == [EndReason.EXPIRED]
    else:
        assert frees == []
    assert p.handle_timeout(_t(200)) == ()
    assert p.next_deadline() is None


@pytest.mark.parametrize("msg_type", [HeartbeatAck, AccessDoneAck, HandshakeReply])
def test_messages_for_the_other_side_are_rejected(msg_type: type) -> None:
    p, lid, now = _active()
    messages: dict[type, Message] = {
        HeartbeatAck: HeartbeatAck(ACC, 0, INC, 0, SES, 1, LocalTime(0), PeerTime(0), 86400.0, 0),
        AccessDoneAck: AccessDoneAck(ACC, 0, INC, 0, SES, lid, 1, AccessOutcome.OK),
        HandshakeReply: HandshakeReply(
            ACC,
            0,
            1,
            INC,
            PROTOCOL_VERSION,
            0,
            1024,
            86400.0,
            0.0,
            1e-3,
            0,
            SES,
            1,
            LocalTime(0),
            PeerTime(0),
            PeerTime(0),
        ),
    }
    msg = messages[msg_type]
    out = p.receive(now, msg)
    assert len(out) == 1 and isinstance(out[0], Rejected) and msg_type.__name__ in out[0].reason
    assert p.counters.rejected == 1 and p.info(lid) is not None


def test_handshake_reply_and_version_mismatch() -> None:
    p = Pinner(CFG.with_changes(vllm_compat=True), "prefill-0", INC, rank=1, ranks=2)
    hs = Handshake(ACC, 3, 4, SES, PROTOCOL_VERSION, 0, 17, LocalTime(55.0))
    (send,) = p.receive(_t(1), hs)
    assert isinstance(send, Send) and (send.engine_id, send.rank) == (ACC, 3)
    reply = send.message
    assert isinstance(reply, HandshakeReply)
    assert (reply.engine_id, reply.rank, reply.ranks, reply.incarnation, reply.max_message_bytes) == (
        "prefill-0",
        1,
        2,
        INC,
        CFG.max_message_bytes,
    )
    assert (reply.version, reply.to_rank, reply.to_session, reply.seq) == (PROTOCOL_VERSION, 3, SES, 17)
    assert (reply.t_echo, reply.t_recv, reply.t_send) == (55.0, T0 + 1, T0 + 1)
    assert reply.capabilities & 8  # VLLM_COMPAT advertised
    assert p.handshake_reply(_t(1), hs) == reply  # the side-channel entry point answers the same
    out = p.receive(_t(2), Handshake(ACC, 0, 1, SES, PROTOCOL_VERSION + 1, 0, 18, LocalTime(56.0)))
    assert isinstance(out[0], Rejected) and "version" in out[0].reason and isinstance(out[1], Send)
    assert isinstance(out[1].message, HandshakeReply) and out[1].message.seq == 18


# -- access-done counting, ranks ---------------------------------------------------------------


def test_access_done_counts_distinct_ranks() -> None:
    """Three accessor ranks on one pinner rank: the layout says each must report (expected 3)."""
    p, lid, now = _active()
    assert p.receive(now, _done(lid, rank=0, ranks=3, confirm=False)) == ()
    assert p.receive(now, _done(lid, rank=0, ranks=3, confirm=False)) == ()  # duplicate rank
    info = p.info(lid)
    assert info is not None and (info.accesses_done, info.expected) == (1, 3)
    assert p.receive(now, _done(lid, rank=2, ranks=3, confirm=False)) == ()
    last = p.receive(now, _done(lid, rank=1, ranks=3, confirm=False))
    assert last == (Free(lid, "k", EndReason.ACCESS_DONE, now),)


def test_expected_comes_from_the_layout() -> None:
    """p >= a: one accessor rank per pinner rank (expected 1); p < a: a/p accessor ranks each."""
    p = Pinner(CFG, "prefill-0", INC, rank=3, ranks=4)
    lid = p.grant(_t(0), "k").lease_id
    # Accessor TP 2: rank 1 reads pinner ranks 2 and 3, and is the only one to report here.
    done = p.receive(_t(1), _done(lid, rank=1, ranks=2, confirm=False, to_rank=3))
    assert done == (Free(lid, "k", EndReason.ACCESS_DONE, _t(1)),)
    q = Pinner(CFG, "prefill-0", INC, rank=1, ranks=2)
    lid = q.grant(_t(0), "k").lease_id
    # Accessor TP 8: ranks 4..7 read pinner rank 1, so four must report.
    for r in (4, 5, 6):
        assert q.receive(_t(1), _done(lid, rank=r, ranks=8, confirm=False, to_rank=1)) == ()
    info = q.info(lid)
    assert info is not None and (info.accesses_done, info.expected) == (3, 4)
    done = q.receive(_t(1), _done(lid, rank=7, ranks=8, confirm=False, to_rank=1))
    assert done == (Free(lid, "k", EndReason.ACCESS_DONE, _t(1)),)


def test_access_done_expected_mismatch_is_rejected() -> None:
    p = Pinner(CFG, "prefill-0", INC)
    lid = p.grant(_t(0), "k", expected=2).lease_id
    out = p.receive(_t(1), _done(lid, ranks=3))  # accessor TP 3 -> expects 3
    assert isinstance(out[0], Rejected) and "expects 3" in out[0].reason
    assert out[1] == Send(ACC, 0, _done_ack(lid, AccessOutcome.STALE))
    info = p.info(lid)
    assert info is not None and info.accesses_done == 0
    # The layout that agrees with the grant counts.
    assert p.receive(_t(1), _done(lid, ranks=2, confirm=False)) == ()
    done = p.receive(_t(1), _done(lid, rank=1, ranks=2, confirm=False))
    assert done == (Free(lid, "k", EndReason.ACCESS_DONE, _t(1)),)


# -- layout rejection --------------------------------------------------------------------------

#: (pinner rank, pinner ranks, accessor rank, accessor ranks, what the rejection says) for
#: accessor ranks that may not speak to this pinner rank.
BAD_LAYOUTS = [
    pytest.param(1, 2, 0, 2, "does not access pinner rank 1", id="other-pinner-rank"),
    pytest.param(0, 4, 1, 2, "does not access pinner rank 0", id="p>a-other-block"),
    pytest.param(0, 2, 2, 4, "does not access pinner rank 0", id="p<a-other-group"),
    pytest.param(0, 1, 1, 1, "outside", id="rank>=ranks"),
    pytest.param(0, 1, 1 << 17, 1, "outside", id="huge-rank"),
    pytest.param(0, 1, 0, 0, "ranks must be", id="ranks=0"),
    pytest.param(0, 1, 0, (1 << 16) + 1, "ranks must be", id="ranks=65537"),
    pytest.param(0, 2, 0, 3, "uneven", id="uneven-2-3"),
    pytest.param(1, 4, 0, 6, "uneven", id="uneven-4-6"),
]


def _layout_pinner(prank: int, pranks: int) -> tuple[Pinner, int]:
    p = Pinner(CFG, "prefill-0", INC, rank=prank, ranks=pranks)
    return p, p.grant(_t(0), "k").lease_id


def _only_rejected(out: tuple[PinnerOutput, ...], what: str) -> None:
    assert len(out) == 1 and isinstance(out[0], Rejected), out
    assert out[0].engine_id == ACC and what in out[0].reason, out[0].reason


@pytest.mark.parametrize(("prank", "pranks", "arank", "aranks", "what"), BAD_LAYOUTS)
def test_heartbeat_from_outside_the_layout_is_rejected(
    prank: int, pranks: int, arank: int, aranks: int, what: str
) -> None:
    p, lid = _layout_pinner(prank, pranks)
    before = p.info(lid)
    _only_rejected(p.receive(_t(1), _hb((lid,), rank=arank, ranks=aranks)), what)  # no ack, no renewal
    assert p.info(lid) == before and p.counters.rejected == 1 and p.counters.renewed == 0
    # It did not bind the lease either: the accessor that does access this rank renews it.
    # (An accessor of TP 1 reads every pinner rank.)
    ack = _only_ack(p.receive(_t(1), _hb((lid,), engine=OTHER)), engine=OTHER)
    assert ack.renewed == 1 and ack.rank == prank


@pytest.mark.parametrize(("prank", "pranks", "arank", "aranks", "what"), BAD_LAYOUTS)
@pytest.mark.parametrize("confirm", [True, False])
def test_access_done_from_outside_the_layout_is_rejected(
    prank: int, pranks: int, arank: int, aranks: int, what: str, confirm: bool
) -> None:
    p, lid = _layout_pinner(prank, pranks)
    bad = _done(lid, rank=arank, ranks=aranks, confirm=confirm, to_rank=prank)
    _only_rejected(p.receive(_t(1), bad), what)  # no verdict
    info = p.info(lid)
    assert info is not None and info.accesses_done == 0 and p.counters.rejected == 1
    # Not counted, not bound: the right accessor still completes it alone.
    out = p.receive(_t(1), _done(lid, engine=OTHER, confirm=False, to_rank=prank))
    assert out == (Free(lid, "k", EndReason.ACCESS_DONE, _t(1)),)


@pytest.mark.parametrize(("prank", "pranks", "arank", "aranks", "what"), BAD_LAYOUTS)
def test_release_from_outside_the_layout_is_rejected(
    prank: int, pranks: int, arank: int, aranks: int, what: str
) -> None:
    p, lid = _layout_pinner(prank, pranks)
    _only_rejected(p.receive(_t(1), _rel((lid,), rank=arank, ranks=aranks)), what)
    info = p.info(lid)
    assert info is not None and info.state is LeaseState.ACTIVE and info.accesses_done == 0
    assert p.receive(_t(1), _rel((lid,), engine=OTHER)) == (Free(lid, "k", EndReason.RELEASED, _t(1)),)


def test_layout_rejection_is_checked_before_the_incarnation() -> None:
    p, lid = _layout_pinner(1, 2)
    _only_rejected(p.receive(_t(1), _hb((lid,), inc=INC + 1, ranks=2)), "does not access")
    _only_rejected(p.receive(_t(1), _rel((lid,), inc=INC + 1, ranks=2)), "does not access")
    _only_rejected(p.receive(_t(1), _done(lid, inc=INC + 1, ranks=2)), "does not access")
    assert p.counters.rejected == 3


# -- binding -----------------------------------------------------------------------------------

#: Who else might speak for a lease bound to (ACC, rank 0, SES): another engine, and the same
#: engine and rank in another session (a restarted accessor process).
STRANGERS: dict[str, Speaker] = {
    "other-engine": {"engine": OTHER},
    "other-engine-same-session": {"engine": OTHER, "session": SES},
    "other-session": {"session": SES + 1},
}

#: How the lease was bound: the first message that spoke for it.
BINDERS: dict[str, Callable[[Pinner, int], object]] = {
    "heartbeat": lambda p, lid: _only_ack(p.receive(_t(0.5), _hb((lid,)))),
    "access-done": lambda p, lid: p.receive(_t(0.5), _done(lid, ranks=2, confirm=False)),
    "release": lambda p, lid: p.receive(_t(0.5), _rel((lid,), ranks=2)),
}


def _bound(binder: str) -> tuple[Pinner, int]:
    """A lease bound to (ACC, rank 0, SES), still live. Access-done and release bind with an
    accessor of TP 2 (so the first report does not end the lease); heartbeat with TP 1."""
    p = Pinner(CFG, "prefill-0", INC)
    lid = p.grant(_t(0), "k").lease_id
    BINDERS[binder](p, lid)
    assert p.info(lid) is not None
    return p, lid


def _stranger_layout(binder: str) -> Layout:
    return {"ranks": 2} if binder != "heartbeat" else {}


@pytest.mark.parametrize("binder", list(BINDERS))
@pytest.mark.parametrize("stranger", list(STRANGERS))
def test_a_bound_lease_is_not_renewed_for_a_stranger(binder: str, stranger: str) -> None:
    p, lid = _bound(binder)
    other = p.grant(_t(0.5), "free-lease").lease_id  # unbound: whoever renews it first owns it
    before = p.info(lid)
    kw = STRANGERS[stranger]
    rejected = p.counters.rejected
    out = p.receive(_t(1), _hb((lid, other), seq=9, **kw, **_stranger_layout(binder)))
    assert len(out) == 2 and isinstance(out[0], Rejected) and "another accessor" in out[0].reason
    ack = _only_ack(out[1:], engine=kw.get("engine", ACC), session=kw.get("session", SES))
    assert ack.renewed == 1 and ack.unknown == (lid,)  # the foreign id is listed; the free one renewed
    assert (ack.expired, ack.released, ack.completed) == ((), (), ())
    assert p.info(lid) == before and p.counters.rejected == rejected + 1
    # The owner still renews it, and the stranger now owns `other`.
    out = p.receive(_t(3), _hb((lid, other), seq=10, **_stranger_layout(binder)))
    assert len(out) == 2 and isinstance(out[0], Rejected) and "1 lease(s)" in out[0].reason
    ack = _only_ack(out[1:])
    assert ack.renewed == 1 and ack.unknown == (other,)
    after = p.info(lid)
    assert after is not None and after.expiry == _t(3) + CFG.lease_extension


def _stranger_ranks(stranger: str) -> tuple[int, ...]:
    """The accessor ranks (of TP 2) a stranger tries: another engine any rank; the owner's
    engine in another session only rank 0, the rank bound to SES (sessions are per rank: the
    owner's rank 1 has bound none yet, see the per-rank test below)."""
    return (0,) if stranger == "other-session" else (0, 1)


@pytest.mark.parametrize("binder", list(BINDERS))
@pytest.mark.parametrize("stranger", list(STRANGERS))
def test_a_bound_lease_refuses_a_strangers_access_done(binder: str, stranger: str) -> None:
    p, lid = _bound(binder)
    kw = STRANGERS[stranger]
    engine = kw.get("engine", ACC)
    for rank in _stranger_ranks(stranger):
        out = p.receive(_t(1), _done(lid, rank=rank, ranks=2, attempt=5, **kw))
        assert len(out) == 2 and isinstance(out[0], Rejected) and "another accessor" in out[0].reason
        verdict = _done_ack(lid, AccessOutcome.STALE, rank=rank, session=kw.get("session", SES), attempt=5)
        assert out[1] == Send(engine, rank, verdict)
        assert p.receive(_t(1), _done(lid, rank=rank, ranks=2, confirm=False, **kw)) == (
            Rejected(engine, out[0].reason),
        )
    info = p.info(lid)
    assert info is not None and info.accesses_done == (0 if binder == "heartbeat" else 1)
    assert p.counters.late_access_done == 0  # refused, not late


@pytest.mark.parametrize("binder", list(BINDERS))
@pytest.mark.parametrize("stranger", list(STRANGERS))
def test_a_bound_lease_refuses_a_strangers_release(binder: str, stranger: str) -> None:
    p, lid = _bound(binder)
    kw = STRANGERS[stranger]
    for rank in _stranger_ranks(stranger):
        out = p.receive(_t(1), _rel((lid,), rank=rank, ranks=2, **kw))
        assert len(out) == 1 and isinstance(out[0], Rejected) and "another accessor" in out[0].reason
    info = p.info(lid)
    assert info is not None and info.state is LeaseState.ACTIVE
    # The owner's own rank 1 ends it (binders other than the heartbeat already counted rank 0).
    if binder == "heartbeat":
        assert p.receive(_t(1), _rel((lid,))) == (Free(lid, "k", EndReason.RELEASED, _t(1)),)
    else:
        (free,) = p.receive(_t(1), _rel((lid,), rank=1, ranks=2))
        assert isinstance(free, Free) and free.lease_id == lid


def test_binding_is_per_rank_session_and_only_the_first_session_of_a_rank_counts() -> None:
    """Ranks of one engine may use their own sessions; each rank is bound to the first one."""
    p = Pinner(CFG, "prefill-0", INC)
    lid = p.grant(_t(0), "k").lease_id
    _only_ack(p.receive(_t(0.5), _hb((lid,), rank=0, ranks=2, session=1)), session=1)
    ack = _only_ack(p.receive(_t(0.5), _hb((lid,), rank=1, ranks=2, session=2)), rank=1, session=2)
    assert ack.renewed == 1  # rank 1 of the same engine binds its own session
    out = p.receive(_t(0.6), _hb((lid,), rank=1, ranks=2, session=1, seq=3))
    assert isinstance(out[0], Rejected)  # rank 1's session is 2 now, whatever rank 0 uses
    assert _only_ack(out[1:], rank=1, session=1).unknown == (lid,)


def test_a_heartbeat_for_another_incarnation_does_not_bind() -> None:
    p = Pinner(CFG, "prefill-0", INC)
    lid = p.grant(_t(0), "k").lease_id
    assert _only_ack(p.receive(_t(0.5), _hb((lid,), inc=INC + 1, engine=OTHER)), engine=OTHER).unknown == (lid,)
    assert _only_ack(p.receive(_t(0.5), _hb((lid,)))).renewed == 1


# -- at the expiry instant, before handle_timeout ----------------------------------------------


def _at_expiry(push: bool = False, kind: LeaseKind = LeaseKind.RENEWABLE) -> tuple[Pinner, int, LocalTime]:
    """A lease renewed once, observed exactly at its expiry, handle_timeout not yet called."""
    p = Pinner(CFG, "prefill-0", INC)
    lid = p.grant(_t(0), "k", push=push, kind=kind).lease_id
    _only_ack(p.receive(_t(0.5), _hb((lid,))))
    info = p.info(lid)
    assert info is not None and p.next_deadline() is not None
    return p, lid, info.expiry


@pytest.mark.parametrize("push", [False, True])
@pytest.mark.parametrize("kind", [LeaseKind.RENEWABLE, LeaseKind.FIXED_TTL])
def test_heartbeat_at_expiry_lists_the_lease_expired(push: bool, kind: LeaseKind) -> None:
    if push and kind is LeaseKind.FIXED_TTL:
        return  # push is for renewable leases (covered with kind=RENEWABLE)
    p, lid, expiry = _at_expiry(push, kind)
    ack = _only_ack(p.receive(expiry, _hb((lid,), seq=2)))
    assert ack.renewed == 0 and ack.expired == (lid,)
    info = p.info(lid)
    assert info is not None and info.expiry == expiry  # not renewed
    (free,) = p.handle_timeout(expiry) if not push else p.handle_timeout(LocalTime(expiry + CFG.push_guard))
    assert isinstance(free, Free) and free.reason is EndReason.EXPIRED


def test_heartbeat_at_expiry_of_a_releasing_lease_lists_it_released() -> None:
    p, lid, expiry = _at_expiry()
    assert p.release(_t(1), lid) == ()
    ack = _only_ack(p.receive(expiry, _hb((lid,), seq=2)))
    assert ack.renewed == 0 and ack.released == (lid,)
    assert p.handle_timeout(expiry) == (Free(lid, "k", EndReason.RELEASED, expiry),)


@pytest.mark.parametrize("push", [False, True])
def test_access_done_at_expiry_is_stale_and_not_counted(push: bool) -> None:
    p, lid, expiry = _at_expiry(push)
    out = p.receive(expiry, _done(lid))
    assert out == (Send(ACC, 0, _done_ack(lid, AccessOutcome.STALE)),)
    info = p.info(lid)
    assert info is not None and info.accesses_done == 0 and p.counters.late_access_done == 1
    end = p.handle_timeout(LocalTime(expiry + (CFG.push_guard if push else 0.0)))
    assert [f.reason for f in end if isinstance(f, Free)] == [EndReason.EXPIRED]


def test_release_at_expiry_is_ignored_and_the_lease_expires() -> None:
    p, lid, expiry = _at_expiry()
    assert p.receive(expiry, _rel((lid,))) == ()
    assert p.release(expiry, lid) == ()  # the local engine's release too
    info = p.info(lid)
    assert info is not None and info.state is LeaseState.ACTIVE and info.accesses_done == 0
    assert p.handle_timeout(expiry) == (Free(lid, "k", EndReason.EXPIRED, expiry),)


def test_just_before_expiry_everything_still_counts() -> None:
    p, lid, expiry = _at_expiry()
    before = LocalTime(expiry - 1e-6)
    ack = _only_ack(p.receive(before, _hb((lid,), seq=2)))
    assert ack.renewed == 1
    assert p.receive(LocalTime(before + CFG.lease_extension - 1e-6), _done(lid)) == (
        Free(lid, "k", EndReason.ACCESS_DONE, LocalTime(before + CFG.lease_extension - 1e-6)),
        Send(ACC, 0, _done_ack(lid, AccessOutcome.OK)),
    )


# -- tombstones answer duplicates only for the accessor that was counted -----------------------


def _completed_by_two_ranks() -> tuple[Pinner, int]:
    p = Pinner(CFG, "prefill-0", INC)
    lid = p.grant(_t(0), "k").lease_id
    assert p.receive(_t(1), _done(lid, rank=0, ranks=2, confirm=False)) == ()
    done = p.receive(_t(1), _done(lid, rank=1, ranks=2, confirm=False))
    assert done == (Free(lid, "k", EndReason.ACCESS_DONE, _t(1)),)
    return p, lid


@pytest.mark.parametrize("rank", [0, 1])
def test_tombstone_answers_ok_to_a_counted_rank(rank: int) -> None:
    p, lid = _completed_by_two_ranks()
    out = p.receive(_t(2), _done(lid, rank=rank, ranks=2, attempt=8))
    assert out == (Send(ACC, rank, _done_ack(lid, AccessOutcome.OK, rank=rank, attempt=8)),)
    assert p.counters.late_access_done == 0 and p.counters.completed == 1


def test_tombstone_answers_stale_to_another_engine() -> None:
    p, lid = _completed_by_two_ranks()
    out = p.receive(_t(2), _done(lid, engine=OTHER, rank=0, ranks=2))
    assert out == (Send(OTHER, 0, _done_ack(lid, AccessOutcome.STALE)),)
    assert p.counters.late_access_done == 1


def test_tombstone_answers_stale_to_a_rank_that_was_not_counted() -> None:
    """Expected 2 but only rank 0 reported, then the lease expired: rank 1 is stale, and so is
    rank 0 (the lease did not complete)."""
    p = Pinner(CFG, "prefill-0", INC)
    lid = p.grant(_t(0), "k").lease_id
    assert p.receive(_t(1), _done(lid, rank=0, ranks=2, confirm=False)) == ()
    (free,) = p.handle_timeout(_t(6))
    assert isinstance(free, Free) and free.reason is EndReason.EXPIRED
    for rank in (0, 1):
        out = p.receive(_t(7), _done(lid, rank=rank, ranks=2))
        assert out == (Send(ACC, rank, _done_ack(lid, AccessOutcome.STALE, rank=rank)),)


def test_tombstone_of_a_release_answers_stale_even_to_the_releasing_rank() -> None:
    p = Pinner(CFG, "prefill-0", INC)
    lid = p.grant(_t(0), "k").lease_id
    assert p.receive(_t(1), _rel((lid,))) == (Free(lid, "k", EndReason.RELEASED, _t(1)),)
    assert p.receive(_t(2), _done(lid)) == (Send(ACC, 0, _done_ack(lid, AccessOutcome.STALE)),)


# -- lease ids ---------------------------------------------------------------------------------


def test_lease_ids_only_increase() -> None:
    p = Pinner(CFG, "prefill-0", INC)
    assert [p.grant(_t(0), f"a{i}").lease_id for i in range(3)] == [1, 2, 3]
    assert p.grant(_t(0), "b", lease_id=4).lease_id == 4  # the next id, explicitly
    assert p.grant(_t(0), "c", lease_id=100).lease_id == 100  # a jump forward
    assert p.grant(_t(0), "d").lease_id == 101
    for stale in (0, 1, 4, 50, 100, 101):
        with pytest.raises(LocalProtocolError, match="only increase"):
            p.grant(_t(0), "x", lease_id=stale)
    with pytest.raises(LocalProtocolError, match="lease_id"):
        p.grant(_t(0), "x", lease_id=True)  # a bool is an int to mypy, never a lease id
    assert p.grant(_t(0), "e").lease_id == 102  # refused grants consumed nothing
    assert p.live_count == 7


def test_lease_ids_are_exhausted_at_the_largest_uint64() -> None:
    p = Pinner(CFG, "prefill-0", INC)
    last = p.grant(_t(0), "last", lease_id=(1 << 64) - 1)
    assert last.lease_id == (1 << 64) - 1
    with pytest.raises(LocalProtocolError, match="exhausted"):
        p.grant(_t(0), "more")
    with pytest.raises(LocalProtocolError, match="lease_id"):
        p.grant(_t(0), "more", lease_id=1 << 64)
    # The last lease still works like any other.
    ack = _only_ack(p.receive(_t(1), _hb((last.lease_id,))))
    assert ack.renewed == 1
    assert p.receive(_t(1), _done(last.lease_id, confirm=False)) == (
        Free(last.lease_id, "last", EndReason.ACCESS_DONE, _t(1)),
    )


def test_a_grant_refused_for_its_expiry_consumes_no_id() -> None:
    p = Pinner(CFG, "prefill-0", INC)
    late = LocalTime(MAX_TIME - 1.0)  # expiry would lie beyond 2**32
    with pytest.raises(LocalProtocolError):
        p.grant(late, "k")
    assert p.grant(late, "k", kind=LeaseKind.FIXED_TTL, ttl=0.5).lease_id == 1


@pytest.mark.parametrize("where", ["incarnation", "lease_id"])
def test_bools_are_not_integers_to_the_pinner(where: str) -> None:
    with pytest.raises(LocalProtocolError):
        if where == "incarnation":
            Pinner(CFG, "prefill-0", True)
        else:
            Pinner(CFG, "prefill-0", INC).grant(_t(0), "k", lease_id=True)


def test_release_of_a_never_issued_id_is_misuse() -> None:
    p = Pinner(CFG, "prefill-0", INC)
    for lid in (0, 1, 5):
        with pytest.raises(LocalProtocolError, match="never granted"):
            p.release(_t(0), lid)
    p.grant(_t(0), "a", lease_id=10)
    with pytest.raises(LocalProtocolError, match="never granted"):
        p.release(_t(0), 11)
    with pytest.raises(LocalProtocolError, match="never granted"):
        p.release(_t(0), 1 << 64)
    # Below the next id and not live (skipped by the jump, or ended): a harmless race.
    assert p.release(_t(0), 5) == ()
    assert p.release(_t(0), 10) == (Free(10, "a", EndReason.RELEASED, _t(0)),)
    assert p.release(_t(0), 10) == ()


# -- time bounds -------------------------------------------------------------------------------

BAD_TIMES = [math.inf, -math.inf, math.nan, MAX_TIME + 1, -(MAX_TIME + 1), 2.0**33]


@pytest.mark.parametrize("bad", BAD_TIMES)
def test_every_entry_point_refuses_an_unbounded_time(bad: float) -> None:
    p = Pinner(CFG.with_changes(vllm_compat=True), "prefill-0", INC)
    lid = p.grant(_t(0), "k").lease_id
    t = LocalTime(bad)
    calls: list[Callable[[], object]] = [
        lambda: p.handle_timeout(t),
        lambda: p.grant(t, "x"),
        lambda: p.release(t, lid),
        lambda: p.receive(t, _hb((lid,))),
        lambda: p.receive(t, _done(lid)),
        lambda: p.receive(t, _rel((lid,))),
        lambda: p.handshake_reply(t, Handshake(ACC, 0, 1, SES, PROTOCOL_VERSION, 0, 1, LocalTime(0))),
        lambda: p.receive_vllm_heartbeat(t, ["k"]),
        lambda: p.receive_vllm_done(t, "k", 1),
    ]
    for call in calls:
        with pytest.raises(LocalProtocolError, match="2\\*\\*32"):
            call()
    info = p.info(lid)
    assert info is not None and info.expiry == _t(6) and info.accesses_done == 0
    assert p.handle_timeout(_t(1)) == ()  # a refused time did not move the clock


def test_times_at_the_bound_are_accepted() -> None:
    p = Pinner(CFG, "prefill-0", INC)
    assert p.handle_timeout(LocalTime(-MAX_TIME)) == ()
    lid = p.grant(LocalTime(-MAX_TIME), "early").lease_id
    (free,) = p.handle_timeout(LocalTime(MAX_TIME))
    assert isinstance(free, Free) and free.lease_id == lid
    q = Pinner(CFG, "prefill-0", INC)
    last = LocalTime(MAX_TIME - CFG.kv_lease_duration)
    lid = q.grant(last, "late").lease_id  # expires exactly at 2**32
    info = q.info(lid)
    assert info is not None and info.expiry == MAX_TIME
    with pytest.raises(LocalProtocolError):
        q.grant(LocalTime(last + 1.0), "too-late")  # its expiry would lie beyond the bound
    assert _only_ack(q.receive(LocalTime(MAX_TIME), _hb((lid,)))).expired == (lid,)
    assert q.handle_timeout(LocalTime(MAX_TIME)) == (Free(lid, "late", EndReason.EXPIRED, LocalTime(MAX_TIME)),)


# -- misuse ------------------------------------------------------------------------------------


def test_time_running_backwards_is_misuse() -> None:
    p, lid, now = _active()
    back = LocalTime(now - 1e-9)
    calls: list[Callable[[], object]] = [
        lambda: p.handle_timeout(back),
        lambda: p.grant(back, "x"),
        lambda: p.release(back, lid),
        lambda: p.receive(back, _hb((lid,))),
        lambda: p.handshake_reply(back, Handshake(ACC, 0, 1, SES, PROTOCOL_VERSION, 0, 1, LocalTime(0))),
        lambda: p.handle_timeout(LocalTime(math.nan)),
    ]
    p.handle_timeout(now)
    for call in calls:
        with pytest.raises(LocalProtocolError):
            call()
    assert p.info(lid) is not None


@pytest.mark.parametrize(
    ("kwargs", "what"),
    [
        ({"ttl": 3.0}, "only for FIXED_TTL"),
        ({"kind": LeaseKind.FIXED_TTL, "ttl": 0.0}, "positive"),
        ({"kind": LeaseKind.FIXED_TTL, "ttl": math.inf}, "positive"),
        ({"kind": LeaseKind.FIXED_TTL, "ttl": math.nan}, "positive"),
        ({"kind": LeaseKind.FIXED_TTL, "ttl": -1.0}, "positive"),
        ({"expected": 0}, "expected"),
        ({"expected": (1 << 16) + 1}, "expected"),
        ({"lease_id": 0}, "lease_id"),
        ({"lease_id": 1 << 64}, "lease_id"),
        ({"lease_id": 1}, "only increase"),
    ],
)
def test_grant_misuse(kwargs: GrantOptions, what: str) -> None:
    p, _, now = _active()
    with pytest.raises(LocalProtocolError, match=what):
        p.grant(now, "other", **kwargs)


def test_grant_with_explicit_id_and_fixed_ticket() -> None:
    p = Pinner(CFG, "prefill-0", INC, rank=0, ranks=4)
    tk = p.grant(_t(0), "k", lease_id=1000, kind=LeaseKind.FIXED_TTL, ttl=2.5)
    assert (tk.lease_id, tk.ranks, tk.deadline, tk.kind) == (1000, 4, T0 + 2.5, LeaseKind.FIXED_TTL)
    assert p.grant(_t(0), "k2").lease_id == 1001  # ids continue after an explicit one
    with pytest.raises(LocalProtocolError, match="only increase"):
        p.grant(_t(0), "k3", lease_id=1000)
    p.release(_t(1), 1000)
    with pytest.raises(LocalProtocolError, match="only increase"):
        p.grant(_t(1), "k3", lease_id=1000)  # an ended id is never reused either


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        (("", 1), {}),
        (("e", -1), {}),
        (("e", 1 << 64), {}),
        (("e", 1), {"rank": 2, "ranks": 2}),
        (("e", 1), {"ranks": 0}),
        (("e", 1), {"ranks": (1 << 16) + 1}),
    ],
)
def test_constructor_misuse(args: tuple[str, int], kwargs: Layout) -> None:
    with pytest.raises(LocalProtocolError):
        Pinner(CFG, *args, **kwargs)


# -- bounds: tombstones, heap ------------------------------------------------------------------


def test_tombstones_are_bounded_and_zero_disables_them() -> None:
    for limit in (0, 1, 5):
        p = Pinner(CFG.with_changes(tombstone_limit=limit), "prefill-0", INC)
        ids = [p.grant(_t(0), f"k{i}").lease_id for i in range(20)]
        for lid in ids:
            p.release(_t(1), lid)
        remembered = [lid for lid in ids if p.ended_reason(lid) is not None]
        assert remembered == ids[len(ids) - limit :]
        ack = _only_ack(p.receive(_t(2), _hb(tuple(ids))))
        assert ack.released == tuple(remembered) and len(ack.unknown) == 20 - limit


def test_counters() -> None:
    p = Pinner(CFG, "prefill-0", INC)
    a, b = (p.grant(_t(0), k).lease_id for k in "ab")
    c = p.grant(_t(0), "c", lease_id=100).lease_id
    p.receive(_t(1), _hb((a, b, 77)))  # 77: below the next id, never granted
    p.receive(_t(1), _done(a, confirm=False))
    p.release(_t(1), b)
    p.handle_timeout(_t(50))
    p.receive(_t(51), _done(c))
    cn = p.counters
    assert (cn.granted, cn.renewed, cn.heartbeats, cn.heartbeat_ids_missing) == (3, 2, 1, 1)
    assert (cn.completed, cn.released, cn.expired, cn.late_access_done) == (1, 1, 1, 1)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["grant", "push", "fixed", "hb", "release", "done", "tick"]),
            st.floats(0, 3),
            st.integers(0, 40),
        ),
        max_size=80,
    )
)
def test_heap_never_late_and_never_busy(ops: list[tuple[str, float, int]]) -> None:
    p = Pinner(CFG.with_changes(tombstone_limit=4), "prefill-0", INC)
    now = T0
    freed: set[int] = set()
    for op, dt, n in ops:
        now += dt
        t = LocalTime(now)
        out: tuple[PinnerOutput, ...] = ()
        live = sorted(p.live_ids())
        if op in ("grant", "push", "fixed"):
            kind = LeaseKind.FIXED_TTL if op == "fixed" else LeaseKind.RENEWABLE
            p.grant(t, f"k{now}-{n}", push=op == "push", kind=kind, ttl=n / 10 + 0.1 if op == "fixed" else None)
        elif op == "hb" and live:
            out = p.receive(t, _hb(tuple(live[: n + 1])))
        elif op == "release" and live:
            out = p.release(t, live[n % len(live)])
        elif op == "done" and live:
            out = p.receive(t, _done(live[n % len(live)], confirm=False))
        else:
            nd = p.next_deadline()
            out = p.handle_timeout(t)
            after = p.next_deadline()
            assert after is None or after > t
            if nd is not None and nd <= t:
                for lid in p.live_ids():
                    info = p.info(lid)
                    assert info is not None and info.expiry > t  # nothing overdue survives
        for o in out:
            if isinstance(o, Free):
                assert o.lease_id not in freed
                freed.add(o.lease_id)
        nd = p.next_deadline()
        expiries = [info.expiry for lid in p.live_ids() if (info := p.info(lid)) is not None]
        if expiries:
            assert nd is not None and nd <= min(expiries)


def test_heap_compacts_after_mass_release() -> None:
    p = Pinner(CFG, "prefill-0", INC)
    ids = [p.grant(_t(0), f"k{i}").lease_id for i in range(500)]
    keep = p.grant(_t(0.5), "keep").lease_id
    for lid in ids:
        p.release(_t(1), lid)
    p.receive(_t(4), _hb((keep,)))
    # 500 stale entries not yet due: the heap is rebuilt from the live leases.
    assert p.handle_timeout(_t(5.0)) == ()
    assert p.next_deadline() == LocalTime(T0 + 4 + CFG.lease_extension)
    (free,) = p.handle_timeout(_t(4 + CFG.lease_extension))
    assert isinstance(free, Free) and free.lease_id == keep and p.next_deadline() is None


def test_renewal_never_shortens_and_fixed_never_extends() -> None:
    p = Pinner(CFG, "prefill-0", INC)
    a = p.grant(_t(0), "a").lease_id
    f = p.grant(_t(0), "f", kind=LeaseKind.FIXED_TTL, ttl=1.0).lease_id
    p.receive(_t(3), _hb((a, f)))
    info = p.info(a)
    assert info is not None and info.expiry == pytest.approx(T0 + 3 + CFG.lease_extension)
    # A heartbeat handled earlier in the pinner's clock than the current expiry allows
    # (possible after a long grant) never pulls the expiry in.
    q = Pinner(CFG.with_changes(kv_lease_duration=60.0), "prefill-0", INC)
    b = q.grant(_t(0), "b").lease_id
    q.receive(_t(1), _hb((b,)))
    bi = q.info(b)
    assert bi is not None and bi.expiry == pytest.approx(T0 + 60)
    (free,) = p.handle_timeout(_t(3.0))
    assert isinstance(free, Free) and free.lease_id == f and free.reason is EndReason.EXPIRED


def test_release_counts_accessor_ranks_like_access_done() -> None:
    """One accessor rank's abort never frees memory another rank may still be reading."""
    p = Pinner(CFG, "prefill-0", INC)
    lid = p.grant(_t(0), "k").lease_id
    for rank in (0, 1):  # accessor TP 2 on pinner TP 1: both ranks renew, both must report
        _only_ack(p.receive(_t(0.5), _hb((lid,), rank=rank, ranks=2)), rank=rank)
    now = _t(1)
    assert p.receive(now, _rel((lid,), ranks=2)) == ()
    assert p.receive(now, _rel((lid,), ranks=2)) == ()  # same rank again
    info = p.info(lid)
    assert info is not None and (info.accesses_done, info.expected, info.state) == (1, 2, LeaseState.ACTIVE)
    (free,) = p.receive(now, _done(lid, rank=1, ranks=2, confirm=False))
    assert free == Free(lid, "k", EndReason.RELEASED, now)


def test_release_with_wrong_expected_is_rejected() -> None:
    p = Pinner(CFG, "prefill-0", INC)
    lid = p.grant(_t(0), "k", expected=2).lease_id
    (rej,) = p.receive(_t(1), _rel((lid,), ranks=3))
    assert isinstance(rej, Rejected) and "expects 3" in rej.reason
    (rej,) = p.receive(_t(1), _rel((lid,), ranks=0))
    assert isinstance(rej, Rejected) and "ranks must be" in rej.reason
    info = p.info(lid)
    assert info is not None and info.accesses_done == 0 and p.counters.rejected == 2


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["hb", "done", "rel", "tick", "grant", "local-release"]),
            st.sampled_from([ACC, OTHER]),
            st.sampled_from([SES, SES + 1]),
            st.sampled_from([(0, 1), (0, 2), (1, 2), (0, 4), (1, 4), (2, 4), (0, 3)]),  # (rank, ranks)
            st.integers(1, 4),
            st.floats(0, 1.5),
        ),
        max_size=60,
    )
)
def test_a_lease_speaks_for_one_accessor_and_frees_once(
    ops: list[tuple[str, str, int, tuple[int, int], int, float]],
) -> None:
    """Random traffic from two engines, two sessions and every layout (some uneven, some not
    accessing pinner rank 1 of 2): whoever a lease was renewed for or counted for first is the
    only engine (and, per accessor rank, session) it is ever renewed or counted for, layout
    rejections change nothing, and every lease frees at most once."""
    p = Pinner(CFG, "prefill-0", INC, rank=1, ranks=2)
    now = T0
    p.grant(LocalTime(now), "k1")
    top = 1  # the highest id granted: a heartbeat naming a higher one is held (spec §5.5)
    owner: dict[int, str] = {}
    sessions: dict[tuple[int, int], int] = {}
    freed: set[int] = set()
    held: dict[tuple[str, int, int, int], int] = {}  # (engine, rank, session, seq) -> lease id

    def check_ack(ack: HeartbeatAck, engine: str, lid: int) -> None:
        assert ack.rank == 1
        if ack.renewed:
            assert owner.setdefault(lid, engine) == engine
            assert sessions.setdefault((lid, ack.to_rank), ack.to_session) == ack.to_session

    for seq, (op, engine, session, (rank, ranks), lid, dt) in enumerate(ops, 1):
        now += dt
        t = LocalTime(now)
        speaks = accesses(2, 1, ranks, rank)
        before = p.info(lid)
        out: tuple[PinnerOutput, ...] = ()
        if op == "grant":
            with contextlib.suppress(LocalProtocolError):  # ids only increase: lower ones are refused
                p.grant(t, f"k{lid}", lease_id=lid)
                top = lid
        elif op == "hb":
            out = p.receive(t, _hb((lid,), engine=engine, rank=rank, ranks=ranks, session=session, seq=seq))
            acks = [o.message for o in out if isinstance(o, Send)]
            if not speaks:
                assert acks == [] and p.info(lid) == before
            elif lid > top:
                assert acks == [] and p.info(lid) == before  # held until granted
                held[(engine, rank, session, seq)] = lid
            else:
                (ack,) = acks
                assert isinstance(ack, HeartbeatAck)
                check_ack(ack, engine, lid)
        elif op in ("done", "rel"):
            msg = (
                _done(lid, engine=engine, rank=rank, ranks=ranks, session=session)
                if op == "done"
                else _rel((lid,), engine=engine, rank=rank, ranks=ranks, session=session)
            )
            out = p.receive(t, msg)
            if not speaks:
                assert len(out) == 1 and isinstance(out[0], Rejected) and p.info(lid) == before
            counted = any(isinstance(o, Free) for o in out) or (
                before is not None and (info := p.info(lid)) is not None and info.accesses_done > before.accesses_done
            )
            if counted:
                assert owner.setdefault(lid, engine) == engine
                assert sessions.setdefault((lid, rank), session) == session
        elif op == "local-release":
            with contextlib.suppress(LocalProtocolError):
                out = p.release(t, lid)
        else:
            out = p.handle_timeout(t)
            for o in out:
                if isinstance(o, Send) and isinstance(o.message, HeartbeatAck):
                    ack = o.message
                    check_ack(ack, o.engine_id, held.pop((o.engine_id, ack.to_rank, ack.to_session, ack.seq)))
        for o in out:
            if isinstance(o, Free):
                assert o.lease_id not in freed
                freed.add(o.lease_id)


# -- held heartbeats (spec §5.5): a ticket published before the grant --------------------------


def test_a_heartbeat_naming_a_lease_not_granted_yet_is_held() -> None:
    p = Pinner(CFG, "prefill-0", INC)
    a = p.grant(_t(0), "a").lease_id
    assert p.receive(_t(3), _hb((a, a + 1), seq=1)) == ()
    assert p.counters.heartbeats_held == 1
    assert p.next_deadline() == _t(3) + CFG.heartbeat_interval  # its answer-by time
    assert p.handle_timeout(_t(3.5)) == ()
    b = p.grant(_t(3.6), "b").lease_id
    assert b == a + 1 and p.next_deadline() == _t(3.6)  # answerable now
    ack = _only_ack(p.handle_timeout(_t(3.6)))
    assert ack.renewed == 2 and ack.unknown == () and float(ack.t_recv) == _t(3.6)
    info = p.info(a)
    assert info is not None and info.expiry == _t(3.6) + CFG.lease_extension  # renewed at the answer
    nd = p.next_deadline()
    assert nd is None or nd > _t(3.6)


def test_a_held_heartbeat_is_answered_unknown_at_its_answer_by_time() -> None:
    p = Pinner(CFG, "prefill-0", INC)
    a = p.grant(_t(0), "a").lease_id
    assert p.receive(_t(1), _hb((a, 40), seq=1)) == ()
    assert p.handle_timeout(_t(1 + CFG.heartbeat_interval - 1e-3)) == ()
    ack = _only_ack(p.handle_timeout(_t(1 + CFG.heartbeat_interval)))
    assert ack.renewed == 1 and ack.unknown == (40,)
    assert p.counters.heartbeats == 1  # counted once, when received


def test_held_heartbeats_are_answered_in_arrival_order_and_before_frees() -> None:
    p = Pinner(CFG, "prefill-0", INC)
    old = p.grant(_t(0), "old").lease_id
    assert p.receive(_t(5), _hb((old + 1,), seq=1)) == ()
    assert p.receive(_t(5.5), _hb((old + 2,), seq=2)) == ()
    p.grant(_t(5.9), "n1")
    p.grant(_t(5.9), "n2")
    out = p.handle_timeout(_t(6.0))  # `old` expires at 6.0
    assert [type(o).__name__ for o in out] == ["Send", "Send", "Free"]
    seqs = [o.message.seq for o in out if isinstance(o, Send) and isinstance(o.message, HeartbeatAck)]
    assert seqs == [1, 2]


def test_what_is_not_held() -> None:
    """Another incarnation's ids are unknown at once; a heartbeat from a rank that does not
    access this one is rejected first; past the bound on held ids one is answered at once."""
    from kvlease._pinner import MAX_HELD_IDS

    p = Pinner(CFG, "prefill-0", INC)
    a = p.grant(_t(0), "a").lease_id
    assert _only_ack(p.receive(_t(1), _hb((a + 5,), inc=INC + 1))).unknown == (a + 5,)
    r1 = Pinner(CFG, "prefill-0", INC, rank=1, ranks=2)
    (rej,) = r1.receive(_t(1), _hb((5,), rank=0, ranks=2))  # accessor rank 0 of 2 reads rank 0
    assert isinstance(rej, Rejected) and r1.counters.heartbeats_held == 0
    big = tuple(range(a + 1, a + 1 + MAX_HELD_IDS))
    cfg = CFG.with_changes(max_message_bytes=1 << 20)
    q = Pinner(cfg, "prefill-0", INC)
    q.grant(_t(0), "a")
    assert q.receive(_t(1), _hb(big, seq=1)) == ()  # exactly the bound: held
    ack = _only_ack(q.receive(_t(1), _hb((a + 1,), seq=2)))  # one more: answered at once
    assert ack.unknown == (a + 1,)
    assert q.counters.heartbeats_held == 1
