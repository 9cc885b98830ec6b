"""The pinner, state x input, through the public API (h2 style): every message type in every
lease state, duplicates, late messages, wrong incarnations, misuse, the tombstone bound and the
expiry heap."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlease import (
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
    Pinner,
    PinnerOutput,
    Rejected,
    Release,
    Send,
)

CFG = LeaseConfig(kv_lease_duration=6.0, max_access_time=0.5, decoder_kv_blocks_ttl=10.0, tombstone_limit=16)
T0 = 73_129.25  # a clock epoch far from zero
INC = 0xDEADBEEF
ACC = "decode-0"


def _t(dt: float) -> LocalTime:
    return LocalTime(T0 + dt)


def _hb(ids: tuple[int, ...], *, inc: int = INC, seq: int = 1, at: float = 1.0) -> Heartbeat:
    return Heartbeat(ACC, 0, inc, seq, LocalTime(at), ids)


def _done(lid: int, *, inc: int = INC, confirm: bool = True, rank: int = 0, expected: int = 1) -> AccessDone:
    return AccessDone(ACC, rank, inc, lid, expected, confirm, LocalTime(2.0))


def _only_ack(out: tuple[PinnerOutput, ...]) -> HeartbeatAck:
    assert len(out) == 1 and isinstance(out[0], Send) and isinstance(out[0].message, HeartbeatAck)
    assert out[0].engine_id == ACC and out[0].rank == 0
    return out[0].message


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
            out = p.receive(_t(1), Release(ACC, 0, INC, (lid,)))
        else:
            out = p.handle_timeout(_t(6.0))
        assert [type(o) for o in out] == [Free] and out[0].reason is reason  # type: ignore[union-attr]
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
    p = Pinner(CFG, "prefill-0", INC)
    p.grant(_t(0), "k")
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
        assert (ack.engine_id, ack.incarnation, ack.seq, ack.t_echo, ack.t_recv) == ("prefill-0", INC, 7, 123.5, now)
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
        assert acks == [AccessDoneAck("prefill-0", 0, INC, lid, DONE_EXPECT[state])]
    else:
        assert acks == []
    # A duplicate never frees twice, and reports OK only if the first one counted.
    again = p.receive(now, _done(lid, confirm=True))
    assert not any(isinstance(o, Free) for o in again)


@pytest.mark.parametrize("state", list(STATES))
def test_access_done_of_wrong_incarnation(state: str) -> None:
    p, lid, now = STATES[state]()
    out = p.receive(now, _done(lid, inc=INC + 1))
    assert out == (Send(ACC, 0, AccessDoneAck("prefill-0", 0, INC, lid, AccessOutcome.UNKNOWN)),)


@pytest.mark.parametrize("state", list(STATES))
@pytest.mark.parametrize("inc_ok", [True, False])
def test_release_message_in_every_state(state: str, inc_ok: bool) -> None:
    p, lid, now = STATES[state]()
    out = p.receive(now, Release(ACC, 0, INC if inc_ok else INC + 1, (lid,)))
    if state in LIVE | {"releasing"} and inc_ok:
        assert out == (Free(lid, "k", EndReason.RELEASED, now),)
    else:
        assert out == ()
    if inc_ok:
        assert p.receive(now, Release(ACC, 0, INC, (lid,))) == ()  # late duplicate


@pytest.mark.parametrize("state", list(STATES))
def test_local_release_in_every_state(state: str) -> None:
    p, lid, now = STATES[state]()
    if state == "unknown":
        with pytest.raises(LocalProtocolError, match="never granted"):
            p.release(now, lid)
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
    msg = {
        HeartbeatAck: HeartbeatAck(ACC, 0, INC, 1, LocalTime(0), LocalTime(0), 0),
        AccessDoneAck: AccessDoneAck(ACC, 0, INC, lid, AccessOutcome.OK),
        HandshakeReply: HandshakeReply(ACC, 0, 1, INC, 1, 0, 1024, LocalTime(0), LocalTime(0), LocalTime(0)),
    }[msg_type]
    out = p.receive(now, msg)
    assert len(out) == 1 and isinstance(out[0], Rejected) and msg_type.__name__ in out[0].reason
    assert p.counters.rejected == 1 and p.info(lid) is not None


def test_handshake_reply_and_version_mismatch() -> None:
    p = Pinner(CFG.with_changes(vllm_compat=True), "prefill-0", INC, rank=1, ranks=2)
    hs = Handshake(ACC, 3, 4, PROTOCOL_VERSION, 0, LocalTime(55.0))
    (send,) = p.receive(_t(1), hs)
    assert isinstance(send, Send) and (send.engine_id, send.rank) == (ACC, 3)
    reply = send.message
    assert isinstance(reply, HandshakeReply)
    assert (reply.rank, reply.ranks, reply.incarnation, reply.max_message_bytes) == (1, 2, INC, CFG.max_message_bytes)
    assert (reply.t_echo, reply.t_recv, reply.t_send) == (55.0, T0 + 1, T0 + 1)
    assert reply.capabilities & 8  # VLLM_COMPAT advertised
    out = p.receive(_t(2), Handshake(ACC, 0, 1, PROTOCOL_VERSION + 1, 0, LocalTime(56.0)))
    assert isinstance(out[0], Rejected) and "version" in out[0].reason and isinstance(out[1], Send)


# -- access-done counting, ranks ---------------------------------------------------------------


def test_access_done_counts_distinct_ranks() -> None:
    p, lid, now = _active()
    assert p.receive(now, _done(lid, rank=0, expected=3, confirm=False)) == ()
    assert p.receive(now, _done(lid, rank=0, expected=3, confirm=False)) == ()  # duplicate rank
    info = p.info(lid)
    assert info is not None and (info.accesses_done, info.expected) == (1, 3)
    assert p.receive(now, _done(lid, rank=2, expected=3, confirm=False)) == ()
    last = p.receive(now, _done(lid, rank=1, expected=3, confirm=False))
    assert last == (Free(lid, "k", EndReason.ACCESS_DONE, now),)


def test_access_done_expected_mismatch_is_rejected() -> None:
    p = Pinner(CFG, "prefill-0", INC)
    lid = p.grant(_t(0), "k", expected=2).lease_id
    out = p.receive(_t(1), _done(lid, expected=3))
    assert isinstance(out[0], Rejected) and "expects 3" in out[0].reason
    assert out[1] == Send(ACC, 0, AccessDoneAck("prefill-0", 0, INC, lid, AccessOutcome.STALE))
    assert p.info(lid) is not None


@pytest.mark.parametrize(("rank", "expected"), [(1 << 17, 1), (0, 0), (0, (1 << 16) + 1)])
def test_access_done_out_of_range_is_rejected(rank: int, expected: int) -> None:
    p, lid, now = _active()
    out = p.receive(now, _done(lid, rank=rank, expected=expected))
    assert isinstance(out[0], Rejected) and p.info(lid) is not None


# -- misuse ------------------------------------------------------------------------------------


def test_time_running_backwards_is_misuse() -> None:
    p, lid, now = _active()
    back = LocalTime(now - 1e-9)
    calls: list[Callable[[], object]] = [
        lambda: p.handle_timeout(back),
        lambda: p.grant(back, "x"),
        lambda: p.release(back, lid),
        lambda: p.receive(back, _hb((lid,))),
        lambda: p.handshake_reply(back, Handshake(ACC, 0, 1, 1, 0, LocalTime(0))),
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
        ({"kind": LeaseKind.FIXED_TTL, "ttl": -1.0}, "positive"),
        ({"expected": 0}, "expected"),
        ({"expected": (1 << 16) + 1}, "expected"),
        ({"lease_id": 0}, "lease_id"),
        ({"lease_id": 1 << 64}, "lease_id"),
        ({"lease_id": 1}, "already in use"),
    ],
)
def test_grant_misuse(kwargs: dict[str, object], what: str) -> None:
    p, _, now = _active()
    with pytest.raises(LocalProtocolError, match=what):
        p.grant(now, "other", **kwargs)  # type: ignore[arg-type]


def test_grant_with_explicit_id_and_fixed_ticket() -> None:
    p = Pinner(CFG, "prefill-0", INC, rank=0, ranks=4)
    tk = p.grant(_t(0), "k", lease_id=1000, kind=LeaseKind.FIXED_TTL, ttl=2.5)
    assert (tk.lease_id, tk.ranks, tk.deadline, tk.kind) == (1000, 4, T0 + 2.5, LeaseKind.FIXED_TTL)
    assert p.grant(_t(0), "k2").lease_id == 1001  # ids continue after an explicit one
    with pytest.raises(LocalProtocolError, match="already in use"):
        p.grant(_t(0), "k3", lease_id=1000)
    p.release(_t(1), 1000)
    with pytest.raises(LocalProtocolError, match="already in use"):
        p.grant(_t(1), "k3", lease_id=1000)  # a tombstoned id is not fresh either


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [(("", 1), {}), (("e", -1), {}), (("e", 1 << 64), {}), (("e", 1), {"rank": 2, "ranks": 2}),
     (("e", 1), {"ranks": 0}), (("e", 1), {"ranks": (1 << 16) + 1})],
)
def test_constructor_misuse(args: tuple[str, int], kwargs: dict[str, int]) -> None:
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
    a, b, c = (p.grant(_t(0), k).lease_id for k in "abc")
    p.receive(_t(1), _hb((a, b, 77)))
    p.receive(_t(1), _done(a, confirm=False))
    p.release(_t(1), b)
    p.handle_timeout(_t(50))
    p.receive(_t(51), _done(c))
    cn = p.counters
    assert (cn.granted, cn.renewed, cn.heartbeats, cn.heartbeat_ids_missing) == (3, 2, 1, 1)
    assert (cn.completed, cn.released, cn.expired, cn.late_access_done) == (1, 1, 1, 1)


@given(
    st.lists(
        st.tuples(st.sampled_from(["grant", "push", "fixed", "hb", "release", "done", "tick"]), st.floats(0, 3),
                  st.integers(0, 40)),
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
    p, lid, now = _promised()
    assert p.receive(now, Release(ACC, 0, INC, (lid,), 2)) == ()
    assert p.receive(now, Release(ACC, 0, INC, (lid,), 2)) == ()  # same rank again
    (free,) = p.receive(now, _done(lid, rank=1, expected=2, confirm=False))
    assert free == Free(lid, "k", EndReason.RELEASED, now)


def test_release_with_wrong_expected_is_rejected() -> None:
    p = Pinner(CFG, "prefill-0", INC)
    lid = p.grant(_t(0), "k", expected=2).lease_id
    (rej,) = p.receive(_t(1), Release(ACC, 0, INC, (lid,), 3))
    assert isinstance(rej, Rejected) and "expects 3" in rej.reason
    (rej,) = p.receive(_t(1), Release(ACC, 0, INC, (lid,), 0))
    assert isinstance(rej, Rejected) and "out of range" in rej.reason
    assert p.info(lid) is not None
