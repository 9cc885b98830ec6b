"""Only the deployment's own engines can renew, release or end a lease — without a key.

A lease is bound to the accessor engine (and, per accessor rank, the session) that first renews,
completes or releases it, or to the engine named at grant; nobody else can. And a heartbeat
that is no newer than one that already extended a lease extends nothing, so replaying captured
frames keeps no dead memory pinned. The attack that motivated it: a process that knows only the
pinner's address handshakes (learning the incarnation), then sends AccessDone for ids 1..N under
an engine id the pinner never saw; v1 freed every lease.
"""

from __future__ import annotations

import pytest

from kvlease import (
    AccessDone,
    AccessDoneAck,
    AccessOutcome,
    Free,
    Handshake,
    Heartbeat,
    HeartbeatAck,
    LeaseConfig,
    LocalProtocolError,
    LocalTime,
    Pinner,
    PinnerOutput,
    Rejected,
    Release,
    Send,
)

CFG = LeaseConfig(kv_lease_duration=6.0, max_access_time=0.5)
INC = 0xFEED
T0 = 5_000.0
S_REAL, S_OTHER = 0xAAAA, 0xBBBB


def _t(dt: float) -> LocalTime:
    return LocalTime(T0 + dt)


def _hb(ids: tuple[int, ...], *, engine: str = "decode-0", session: int = S_REAL, seq: int = 1) -> Heartbeat:
    return Heartbeat(engine, 0, 1, session, INC, seq, LocalTime(1.0), ids)


def _done(lid: int, *, engine: str = "decode-0", session: int = S_REAL, confirm: bool = False) -> AccessDone:
    return AccessDone(engine, 0, 1, session, INC, 0, lid, 1, confirm, LocalTime(2.0))


def _ack(out: tuple[PinnerOutput, ...]) -> HeartbeatAck:
    (send,) = [o for o in out if isinstance(o, Send)]
    assert isinstance(send.message, HeartbeatAck)
    return send.message


def test_the_v1_attack_frees_nothing() -> None:
    """Handshake from outside, then AccessDone for every id under an unseen engine id: with the
    leases bound to the real accessor, all ten are refused."""
    p = Pinner(CFG, "prefill-0", INC)
    ids = tuple(p.grant(_t(0), f"k{i}").lease_id for i in range(10))
    p.receive(_t(0.5), _hb(ids))  # the real accessor renews: every lease is bound to it
    reply = p.handshake_reply(_t(1), Handshake("mallory", 0, 1, 666, 2, 7, 1, LocalTime(9.0)))
    assert reply.incarnation == INC  # the attacker learns the incarnation ...
    for lid in ids:
        for engine, session in (("mallory", 666), ("decode-0", S_OTHER)):
            out = p.receive(_t(1.5), _done(lid, engine=engine, session=session, confirm=True))
            assert not any(isinstance(o, Free) for o in out)
            assert any(isinstance(o, Rejected) for o in out)
            (verdict,) = [o.message for o in out if isinstance(o, Send)]
            assert isinstance(verdict, AccessDoneAck) and verdict.outcome is AccessOutcome.STALE
            assert not any(isinstance(o, Free) for o in p.receive(_t(1.5), Release(engine, 0, 1, session, INC, (lid,))))
    assert p.live_count == 10  # ... and frees nothing
    assert p.counters.rejected >= 40
    done = [o for o in p.receive(_t(2), _done(ids[0])) if isinstance(o, Free)]
    assert done and done[0].lease_id == ids[0]  # the real accessor still can


def test_foreign_heartbeats_neither_renew_nor_bind() -> None:
    p = Pinner(CFG, "prefill-0", INC)
    lid = p.grant(_t(0), "k").lease_id
    _ack(p.receive(_t(3), _hb((lid,))))  # bound to decode-0 / S_REAL, expiry 3 + 4 = 7
    ack = _ack(p.receive(_t(5), _hb((lid,), engine="mallory", seq=99)))
    assert ack.unknown == (lid,) and ack.renewed == 0
    info = p.info(lid)
    assert info is not None and info.expiry == _t(3 + CFG.lease_extension)


def test_a_lease_named_at_grant_is_bound_from_the_start() -> None:
    p = Pinner(CFG, "prefill-0", INC)
    lid = p.grant(_t(0), "k", accessor="decode-0").lease_id
    out = p.receive(_t(0.5), _done(lid, engine="mallory", session=1))
    assert any(isinstance(o, Rejected) for o in out) and p.info(lid) is not None
    assert _ack(p.receive(_t(0.5), _hb((lid,), engine="mallory"))).unknown == (lid,)
    ack = _ack(p.receive(_t(1), _hb((lid,))))  # the named engine binds its rank and session
    assert ack.renewed == 1
    assert _ack(p.receive(_t(1), _hb((lid,), session=S_OTHER, seq=2))).unknown == (lid,)
    with pytest.raises(LocalProtocolError, match="accessor"):
        p.grant(_t(1), "k2", accessor="")


def test_a_replayed_heartbeat_is_acknowledged_but_extends_nothing() -> None:
    """A heartbeat no newer (by seq, per session) than one that already extended the lease is
    answered as renewed — a newer one of the same session was sent later and covers its
    validity — but does not move the expiry: replaying captured frames pins nothing."""
    p = Pinner(CFG, "prefill-0", INC)
    lid = p.grant(_t(0), "k").lease_id
    p.receive(_t(3), _hb((lid,), seq=5))
    extended = p.info(lid)
    assert extended is not None and extended.expiry == _t(3 + CFG.lease_extension)
    for seq in (5, 4, 1):  # the same frame again, or an older one, much later
        ack = _ack(p.receive(_t(6.5), _hb((lid,), seq=seq)))
        assert ack.renewed == 1 and ack.unknown == ()
        info = p.info(lid)
        assert info is not None and info.expiry == extended.expiry
    assert [f.reason.value for f in p.handle_timeout(_t(3 + CFG.lease_extension)) if isinstance(f, Free)] == ["expired"]


def test_a_newer_heartbeat_extends_and_each_rank_keeps_its_own_seq() -> None:
    """With fewer pinner than accessor ranks, two accessor ranks renew one copy, each with its
    own session and seq stream."""
    p = Pinner(CFG, "prefill-0", INC)
    lid = p.grant(_t(0), "k").lease_id
    r0 = Heartbeat("decode-0", 0, 2, S_REAL, INC, 10, LocalTime(1.0), (lid,))
    r1 = Heartbeat("decode-0", 1, 2, S_OTHER, INC, 3, LocalTime(1.0), (lid,))
    p.receive(_t(3), r0)
    p.receive(_t(4), r1)  # rank 1's first heartbeat: fresh for rank 1 though its seq is lower
    info = p.info(lid)
    assert info is not None and info.expiry == _t(4 + CFG.lease_extension)
    p.receive(_t(5), r1)  # replayed: nothing
    info = p.info(lid)
    assert info is not None and info.expiry == _t(4 + CFG.lease_extension)
    p.receive(_t(5.5), Heartbeat("decode-0", 0, 2, S_REAL, INC, 11, LocalTime(2.0), (lid,)))
    info = p.info(lid)
    assert info is not None and info.expiry == _t(5.5 + CFG.lease_extension)
    # A third session claiming rank 1 is refused.
    ack = _ack(p.receive(_t(5.5), Heartbeat("decode-0", 1, 2, 0xCCCC, INC, 99, LocalTime(2.0), (lid,))))
    assert ack.unknown == (lid,)
