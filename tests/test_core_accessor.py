"""The accessor, state x input, through the public API: tracking and handshakes, validity from
acknowledged heartbeats, every ack outcome in every tracked state, access decisions in pull and
push mode, confirmation, heterogeneous TP, heartbeat splitting, fixed-TTL leases across clock
offsets, misuse; and the protocol-v2 rules: replies and acks are bound to this accessor's rank,
session and seq (misaddressed ones are Rejected, stale or duplicate ones change nothing), an ack
must account exactly for its heartbeat's ids, seq is never reused, a lease given up is never
tracked again (FORGOTTEN below the tombstone watermark), a posted failed transfer gives the lease
up while an unposted one may retry, a verdict counts only for its own attempt, and heartbeats
go only to the pinner ranks of this rank's TP layout."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import TypedDict

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlease import (
    MIN_MESSAGE_BYTES,
    MIN_VALIDITY_MARGIN,
    PROTOCOL_VERSION,
    AccessCompleted,
    AccessDone,
    AccessDoneAck,
    Accessor,
    AccessorOutput,
    AccessOutcome,
    AccessStale,
    ConfigError,
    EndReason,
    Free,
    Handshake,
    HandshakeNeeded,
    HandshakeReply,
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
    PeerTime,
    Pinner,
    Rejected,
    Release,
    RemoteProtocolError,
    Send,
    TrackedState,
    encode,
    tp_layout,
)
from kvlease.testing import LinkProfile, Pair, PeerClock

CFG = LeaseConfig(kv_lease_duration=6.0, max_access_time=0.5, validity_margin=0.01)
P_EPOCH = 91_000.0  # the pinner's clock reads P_EPOCH + t
A_EPOCH = 12_345.5  # the accessor's clock reads A_EPOCH + t
INC = 42
PIN = "prefill-0"
SESSION = 0x5E55_0007  # the accessor's session (its incarnation)


def _a(t: float) -> LocalTime:
    return LocalTime(A_EPOCH + t)


def _p(t: float) -> LocalTime:
    return LocalTime(P_EPOCH + t)


def _accessor(
    cfg: LeaseConfig = CFG, engine: str = "decode-0", *, session: int = SESSION, rank: int = 0, ranks: int = 1
) -> Accessor:
    return Accessor(cfg, engine, session=session, rank=rank, ranks=ranks)


class Layout(TypedDict, total=False):
    """An accessor's TP layout, where it differs from rank 0 of 1."""

    rank: int
    ranks: int


class Readdress(TypedDict, total=False):
    """Where a reply claims to be addressed, instead of its real destination."""

    to_rank: int
    to_session: int


def _handshake_of(out: AccessorOutput) -> Handshake:
    """The Handshake an accessor output asks to send (a HandshakeNeeded, or a retry's Send)."""
    msg = out.message if isinstance(out, HandshakeNeeded | Send) else None
    assert isinstance(msg, Handshake), out
    return msg


class Wire:
    """One accessor and one pinner, driven by hand, messages passed directly (no loss)."""

    def __init__(self, cfg: LeaseConfig = CFG, *, push: bool = False) -> None:
        self.pinner = Pinner(cfg, PIN, INC)
        self.acc = _accessor(cfg)
        self.cfg = cfg
        self.push = push
        self.t = 0.0

    def connect(self, key: str = "k", *, kind: LeaseKind = LeaseKind.RENEWABLE) -> LeaseTicket:
        tk = self.pinner.grant(_p(self.t), key, push=self.push, kind=kind)
        out = self.acc.track(_a(self.t), key, tk, push=self.push)
        hs = [o for o in out if isinstance(o, HandshakeNeeded)]
        if hs:
            reply = self.pinner.handshake_reply(_p(self.t), hs[0].message)
            assert self.acc.handshake_reply(_a(self.t), reply) == ()
        return tk

    def heartbeat(self, *, deliver: bool = True) -> list[AccessorOutput]:
        """Wake the accessor; deliver its heartbeats and the acks back at the same instant."""
        out = list(self.acc.handle_timeout(_a(self.t)))
        events: list[AccessorOutput] = []
        for o in out:
            if isinstance(o, Send) and deliver:
                for reply in self.pinner.receive(_p(self.t), o.message):
                    assert isinstance(reply, Send)
                    events.extend(self.acc.receive(_a(self.t), reply.message))
            elif not isinstance(o, Send):
                events.append(o)
        return events

    def sends(self, out: tuple[AccessorOutput, ...]) -> list[Send]:
        return [o for o in out if isinstance(o, Send)]

    def next_heartbeat(self) -> Heartbeat:
        """Wake the accessor at its next deadline and return the one heartbeat it sends."""
        nd = self.acc.next_deadline()
        assert nd is not None
        self.t = max(self.t, nd - A_EPOCH)
        (send,) = self.acc.handle_timeout(_a(self.t))
        assert isinstance(send, Send) and isinstance(send.message, Heartbeat) and send.rank == 0
        return send.message


def _ack(hb: Heartbeat, t: float, renewed: int, **lists: tuple[int, ...]) -> HeartbeatAck:
    """The pinner's (rank 0) ack of `hb`, addressed to its sender, built by hand; `lists` are
    any of its id lists (unknown, expired, released, completed)."""
    assert set(lists) <= {"unknown", "expired", "released", "completed"}, lists
    return HeartbeatAck(
        PIN,
        0,
        INC,
        hb.rank,
        hb.session,
        hb.seq,
        LocalTime(hb.t_send),
        PeerTime(_p(t)),
        86400.0,  # the pinner's clock, as the accessor sees it
        renewed,
        unknown=lists.get("unknown", ()),
        expired=lists.get("expired", ()),
        released=lists.get("released", ()),
        completed=lists.get("completed", ()),
    )


# -- tracking, handshakes ----------------------------------------------------------------------


def test_track_asks_for_a_handshake_once_per_engine_and_interval() -> None:
    acc = _accessor(rank=1, ranks=2)
    tk1 = LeaseTicket(PIN, INC, 1)
    tk2 = LeaseTicket(PIN, INC, 2)
    (hs,) = acc.track(_a(0), "a", tk1)
    assert isinstance(hs, HandshakeNeeded) and hs.engine_id == PIN
    assert hs.message == Handshake(
        "decode-0", 1, 2, SESSION, PROTOCOL_VERSION, hs.message.capabilities, hs.message.seq, _a(0)
    )
    assert acc.track(_a(0.1), "b", tk2) == ()  # one handshake in flight per engine
    assert acc.next_deadline() == _a(CFG.heartbeat_interval)
    (again,) = acc.handle_timeout(_a(CFG.heartbeat_interval))
    assert isinstance(again, HandshakeNeeded)
    assert again.message.seq > hs.message.seq  # every handshake takes a fresh seq
    assert not acc.is_connected(PIN)


def test_handshake_then_heartbeat_at_once_then_every_interval() -> None:
    w = Wire()
    tk = w.connect()
    assert w.acc.is_connected(PIN) and w.acc.next_deadline() == _a(0)
    assert w.heartbeat() == []
    v = w.acc.valid_until("k")
    assert v == pytest.approx(A_EPOCH + CFG.accessor_extension)
    info = w.pinner.info(tk.lease_id)
    assert info is not None and info.expiry == max(LocalTime(P_EPOCH + CFG.kv_lease_duration), _p(CFG.lease_extension))
    assert w.acc.next_deadline() == pytest.approx(A_EPOCH + CFG.heartbeat_interval)
    w.t = CFG.heartbeat_interval
    w.heartbeat()
    assert w.acc.valid_until("k") == pytest.approx(A_EPOCH + CFG.heartbeat_interval + CFG.accessor_extension)


def test_track_on_a_connected_engine_heartbeats_the_new_id_at_once() -> None:
    w = Wire()
    w.connect("a")
    w.heartbeat()
    w.t = 0.2
    tk = w.pinner.grant(_p(0.2), "b")
    assert w.acc.track(_a(0.2), "b", tk) == ()
    assert w.acc.next_deadline() == _a(0.2)
    (send,) = w.acc.handle_timeout(_a(0.2))
    assert isinstance(send, Send) and isinstance(send.message, Heartbeat) and send.message.lease_ids == (tk.lease_id,)
    assert send.rank == 0 and send.message.session == SESSION


class ReplyChanges(TypedDict, total=False):
    """Fields of a handshake reply that a test changes."""

    engine_id: str
    ranks: int
    version: int
    to_rank: int
    to_session: int
    seq: int
    t_echo: LocalTime
    t_recv: PeerTime
    t_send: PeerTime


def _reply_to(hs: Handshake, *, ranks: int = 1) -> HandshakeReply:
    """The reply rank 0 of a pinner of `ranks` ranks gives to `hs`, built by hand."""
    return HandshakeReply(
        engine_id=PIN,
        rank=0,
        ranks=ranks,
        incarnation=INC,
        version=PROTOCOL_VERSION,
        capabilities=7,
        max_message_bytes=1024,
        extension=86400.0,
        max_drift_rate=0.0,
        max_access_time=1e-3,
        to_rank=hs.rank,
        to_session=hs.session,
        seq=hs.seq,
        t_echo=LocalTime(hs.t_send),
        t_recv=PeerTime(P_EPOCH),
        t_send=PeerTime(P_EPOCH),
    )


@pytest.mark.parametrize(
    ("reply_kw", "why"),
    [
        (ReplyChanges(version=PROTOCOL_VERSION + 1), "version"),
        (ReplyChanges(t_recv=PeerTime(P_EPOCH + 1)), "impossible"),  # received after it was sent
        (ReplyChanges(t_send=PeerTime(2.0**33)), "impossible"),  # beyond MAX_TIME
        (ReplyChanges(ranks=3), "uneven"),  # 3 pinner ranks, 2 accessor ranks: no layout
        (ReplyChanges(to_rank=0), "rank 0"),  # addressed to the sibling rank
        (ReplyChanges(to_session=SESSION + 1), f"session {SESSION + 1}"),  # addressed to another session
    ],
)
def test_bad_handshake_replies_are_rejected(reply_kw: ReplyChanges, why: str) -> None:
    acc = _accessor(rank=1, ranks=2)
    (hn,) = acc.track(_a(0), "k", LeaseTicket(PIN, INC, 1, ranks=2))
    assert isinstance(hn, HandshakeNeeded)
    good = _reply_to(hn.message, ranks=2)
    (rej,) = acc.handshake_reply(_a(1), attrs.evolve(good, **reply_kw))
    assert isinstance(rej, Rejected) and why in rej.reason and not acc.is_connected(PIN)
    # A refused reply does not retire the handshake: the genuine answer still connects.
    assert acc.handshake_reply(_a(1), good) == () and acc.is_connected(PIN)


@pytest.mark.parametrize(
    "reply_kw",
    [ReplyChanges(seq=99), ReplyChanges(t_echo=LocalTime(A_EPOCH - 1)), ReplyChanges(engine_id="stranger")],
    ids=["unknown-seq", "forged-echo", "other-engine"],
)
def test_handshake_replies_that_answer_no_handshake_of_ours_change_nothing(reply_kw: ReplyChanges) -> None:
    acc = _accessor()
    (hn,) = acc.track(_a(0), "k", LeaseTicket(PIN, INC, 1))
    assert isinstance(hn, HandshakeNeeded)
    assert acc.handshake_reply(_a(1), attrs.evolve(_reply_to(hn.message), **reply_kw)) == ()
    assert not acc.is_connected(PIN) and acc.state_of("k") is TrackedState.WAITING


def test_handshake_with_new_incarnation_loses_old_leases() -> None:
    w = Wire()
    w.connect("a")
    w.heartbeat()
    restarted = Pinner(CFG, PIN, INC + 1)
    w.t = 1
    # A reply to a handshake the accessor never sent (v1 tests forged one) answers nothing.
    forged = Handshake("decode-0", 0, 1, SESSION, PROTOCOL_VERSION, 7, 999, _a(1))
    assert w.acc.handshake_reply(_a(1), restarted.handshake_reply(_p(1), forged)) == ()
    assert w.acc.state_of("a") is TrackedState.WAITING
    # A real re-handshake answered by the restarted pinner loses the old incarnation's leases.
    hn = w.acc.handshake(_a(1), PIN)
    out = w.acc.handshake_reply(_a(1), restarted.handshake_reply(_p(1), hn.message))
    assert out == (LeaseLost("a", 1, LostReason.PINNER_RESTARTED),)
    assert w.acc.state_of("a") is None


def test_track_with_other_incarnation_forces_a_new_handshake() -> None:
    w = Wire()
    w.connect("a")
    (hs,) = w.acc.track(_a(0), "b", LeaseTicket(PIN, INC + 1, 1))
    assert isinstance(hs, HandshakeNeeded) and not w.acc.is_connected(PIN)


def test_ack_with_other_incarnation_means_the_pinner_restarted() -> None:
    w = Wire()
    w.connect("a")
    (send,) = w.acc.handle_timeout(_a(0))
    assert isinstance(send, Send) and isinstance(send.message, Heartbeat)
    hb = send.message
    restarted = Pinner(CFG, PIN, INC + 1)
    (ack,) = restarted.receive(_p(0), hb)
    assert isinstance(ack, Send)
    out = w.acc.receive(_a(0.01), ack.message)
    assert out == (LeaseLost("a", 1, LostReason.PINNER_RESTARTED),)
    assert not w.acc.is_connected(PIN)


def test_a_superseded_or_duplicate_handshake_reply_changes_nothing() -> None:
    """Two handshakes are outstanding; the first accepted reply retires both. The reply to the
    other one, a duplicate, and a reply to the other one from a restarted pinner (whose
    incarnation would otherwise lose every lease) all change nothing."""
    pin = Pinner(CFG, PIN, INC)
    acc = _accessor()
    tk = pin.grant(_p(0), "k")
    (hn1,) = acc.track(_a(0), "k", tk)
    (hn2,) = acc.handle_timeout(_a(CFG.heartbeat_interval))  # the first went unanswered for a while
    assert isinstance(hn1, HandshakeNeeded) and isinstance(hn2, HandshakeNeeded)
    assert hn1.message.seq != hn2.message.seq
    t = CFG.heartbeat_interval
    reply1 = pin.handshake_reply(_p(t), hn1.message)
    reply2 = pin.handshake_reply(_p(t), hn2.message)
    assert acc.handshake_reply(_a(t), reply2) == () and acc.is_connected(PIN)
    for o in acc.handle_timeout(_a(t)):
        assert isinstance(o, Send)
        for r in pin.receive(_p(t), o.message):
            assert isinstance(r, Send)
            assert acc.receive(_a(t), r.message) == ()
    est = acc.clock_estimator(PIN)
    assert est is not None
    before = (acc.state_of("k"), acc.valid_until("k"), acc.is_connected(PIN), est.sample_count)
    assert before[1] is not None
    restarted = Pinner(CFG, PIN, INC + 1)
    late = [reply1, reply2, restarted.handshake_reply(_p(t + 1), hn1.message)]
    for reply in late:
        assert acc.handshake_reply(_a(t + 1), reply) == ()
        assert acc.receive(_a(t + 1), reply) == ()
    after = (acc.state_of("k"), acc.valid_until("k"), acc.is_connected(PIN), est.sample_count)
    assert after == before
    assert acc.begin_access(_a(t + 1), "k").guaranteed


# -- acks in every tracked state ---------------------------------------------------------------


def _ack_for(w: Wire, lid: int, field: str) -> HeartbeatAck:
    """The next heartbeat (which must name `lid`), and an ack listing `lid` under `field`."""
    return _ack_listing(w.next_heartbeat(), w.t, lid, field)


def _ack_listing(hb: Heartbeat, t: float, lid: int, field: str) -> HeartbeatAck:
    assert lid in hb.lease_ids
    return _ack(hb, t, len(hb.lease_ids) - 1, **{field: (lid,)})


ACK_REASON = {
    "unknown": LostReason.UNKNOWN,
    "expired": LostReason.EXPIRED,
    "released": LostReason.RELEASED,
    "completed": LostReason.RELEASED,
}


@pytest.mark.parametrize("field", list(ACK_REASON))
@pytest.mark.parametrize("state", ["waiting", "accessing", "confirming"])
def test_missing_lease_in_ack(field: str, state: str) -> None:
    w = Wire()
    tk = w.connect("k")
    if state in ("accessing", "confirming"):
        assert w.acc.begin_access(_a(0), "k").allowed
    # The heartbeat names the lease (WAITING and ACCESSING leases are heartbeated)...
    hb = w.next_heartbeat()
    if state == "confirming":
        # ...and the access finishes before the ack comes back.
        out = w.acc.access_finished(_a(w.t), "k")  # never acknowledged: must be confirmed
        assert isinstance(out[0], Send) and isinstance(out[0].message, AccessDone) and out[0].message.confirm
        assert w.acc.state_of("k") is TrackedState.CONFIRMING
    ack = _ack_listing(hb, w.t, tk.lease_id, field)
    out = w.acc.receive(_a(w.t + 0.01), ack)
    if state == "waiting":
        assert out == (LeaseLost("k", tk.lease_id, ACK_REASON[field]),) and w.acc.state_of("k") is None
    elif state == "accessing" and field == "completed":
        # Our own attached access-done (after our part landed) completed it on this pinner
        # rank; the access in flight decides, and is still covered by validity.
        assert out == () and w.acc.state_of("k") is TrackedState.ACCESSING
        fin = w.acc.access_finished(_a(w.t + 0.02), "k", notified=True)
        assert not any(isinstance(o, AccessStale) for o in fin)
    elif state == "accessing":
        assert out == (LeaseLost("k", tk.lease_id, ACK_REASON[field]),)
        assert w.acc.state_of("k") is TrackedState.LOST
        fin = w.acc.access_finished(_a(w.t + 0.02), "k")
        assert isinstance(fin[-1], AccessStale) and w.acc.state_of("k") is None
    else:
        assert out == ()  # the pinner's access-done verdict decides
        assert w.acc.state_of("k") is TrackedState.CONFIRMING
    assert w.acc.receive(_a(w.t + 0.03), ack) == ()  # a duplicate ack carries nothing


def test_acks_that_cannot_be_trusted_are_ignored_or_rejected() -> None:
    w = Wire()
    w.connect("k")
    (send,) = w.acc.handle_timeout(_a(0))
    assert isinstance(send, Send)
    hb = send.message
    assert isinstance(hb, Heartbeat)
    good = _ack(hb, 0, 1)
    forged = attrs.evolve(good, t_echo=LocalTime(hb.t_send - 1))
    unknown_seq = attrs.evolve(good, seq=hb.seq + 5)
    assert w.acc.receive(_a(0), forged) == () and w.acc.receive(_a(0), unknown_seq) == ()
    assert w.acc.valid_until("k") is None
    # From a pinner rank the heartbeat did not go to (this accessor only accesses rank 0): ignored.
    assert w.acc.receive(_a(0), attrs.evolve(good, rank=3)) == ()
    # From an engine this accessor does not know: nothing is outstanding there.
    assert w.acc.receive(_a(0), attrs.evolve(good, engine_id="stranger")) == ()
    assert w.acc.valid_until("k") is None
    # Addressed to another accessor rank or session: refused.
    (rej,) = w.acc.receive(_a(0), attrs.evolve(good, to_rank=3))
    assert isinstance(rej, Rejected) and "rank 3" in rej.reason
    (rej,) = w.acc.receive(_a(0), attrs.evolve(good, to_session=SESSION + 1))
    assert isinstance(rej, Rejected) and str(SESSION + 1) in rej.reason
    assert w.acc.valid_until("k") is None
    assert w.acc.receive(_a(0), good) == () and w.acc.valid_until("k") is not None


@pytest.mark.parametrize(
    "msg",
    [
        Heartbeat(PIN, 0, 1, 5, INC, 1, LocalTime(0), ()),
        AccessDone(PIN, 0, 1, 5, INC, 0, 1, 1, False, LocalTime(0)),
        Release(PIN, 0, 1, 5, INC, (1,)),
        Handshake(PIN, 0, 1, 5, PROTOCOL_VERSION, 0, 1, LocalTime(0)),
    ],
)
def test_messages_for_the_other_side_are_rejected(msg: Message) -> None:
    acc = _accessor()
    (rej,) = acc.receive(_a(0), msg)
    assert isinstance(rej, Rejected) and type(msg).__name__ in rej.reason


# -- v2: replies bound to rank, session, seq and attempt ---------------------------------------


@pytest.mark.parametrize(
    "readdress", [Readdress(to_rank=1), Readdress(to_session=SESSION + 1)], ids=["to_rank", "to_session"]
)
def test_misaddressed_replies_and_acks_are_rejected_and_change_nothing(readdress: Readdress) -> None:
    pin = Pinner(CFG, PIN, INC)
    acc = _accessor()
    tk = pin.grant(_p(0), "k")
    (hn,) = acc.track(_a(0), "k", tk)
    assert isinstance(hn, HandshakeNeeded)
    # Handshake reply: the real one, readdressed.
    reply = pin.handshake_reply(_p(0), hn.message)
    (rej,) = acc.handshake_reply(_a(0), attrs.evolve(reply, **readdress))
    assert isinstance(rej, Rejected) and not acc.is_connected(PIN)
    assert acc.handshake_reply(_a(0), reply) == () and acc.is_connected(PIN)
    # Heartbeat ack: the real one, readdressed, validates nothing and leaves the round pending.
    (hb,) = acc.handle_timeout(_a(0))
    assert isinstance(hb, Send)
    (ack,) = pin.receive(_p(0), hb.message)
    assert isinstance(ack, Send) and isinstance(ack.message, HeartbeatAck)
    (rej,) = acc.receive(_a(0.1), attrs.evolve(ack.message, **readdress))
    assert isinstance(rej, Rejected) and acc.valid_until("k") is None
    # An ack saying the lease is gone, readdressed, does not lose it either.
    gone = attrs.evolve(ack.message, renewed=0, expired=(tk.lease_id,), **readdress)
    (rej,) = acc.receive(_a(0.1), gone)
    assert isinstance(rej, Rejected) and acc.state_of("k") is TrackedState.WAITING
    assert acc.receive(_a(0.1), ack.message) == () and acc.valid_until("k") is not None
    # Access-done verdict: a STALE verdict readdressed does not end the confirmation.
    w_until = acc.valid_until("k")
    assert w_until is not None
    d = acc.begin_access(_a(0.2), "k")
    assert d.allowed and d.notification is not None
    t_late = w_until - A_EPOCH + 0.01
    (done,) = acc.access_finished(_a(t_late), "k", notified=True)  # finished after the window: ask
    assert isinstance(done, Send) and isinstance(done.message, AccessDone) and done.message.confirm
    stale = AccessDoneAck(PIN, 0, INC, 0, SESSION, tk.lease_id, done.message.attempt, AccessOutcome.STALE)
    (rej,) = acc.receive(_a(t_late), attrs.evolve(stale, **readdress))
    assert isinstance(rej, Rejected) and acc.state_of("k") is TrackedState.CONFIRMING
    ok = attrs.evolve(stale, outcome=AccessOutcome.OK)
    assert acc.receive(_a(t_late), ok) == (AccessCompleted("k", tk.lease_id, confirmed_by_pinner=True),)


def _one_round(ids: tuple[int, ...]) -> tuple[Wire, Heartbeat]:
    w = Wire()
    for i in range(len(ids)):
        w.connect(f"k{i}")
    hb = w.next_heartbeat()
    assert hb.lease_ids == ids
    return w, hb


@pytest.mark.parametrize(
    ("renewed", "lists"),
    [
        (0, {}),  # nothing renewed, nothing listed: an id is unaccounted for
        (1, {}),  # one of two renewed, the other unaccounted for
        (3, {}),  # more renewed than sent
        (2, {"unknown": (1,)}),  # over-counted: renewed both and listed one
        (1, {"expired": (99,)}),  # the count matches, but 99 was not in the heartbeat
        (0, {"unknown": (1,), "expired": (1,)}),  # the count matches, but 1 is listed twice
    ],
)
def test_an_ack_that_does_not_account_for_the_heartbeats_ids_is_rejected(
    renewed: int, lists: dict[str, tuple[int, ...]]
) -> None:
    w, hb = _one_round((1, 2))
    (rej,) = w.acc.receive(_a(w.t), _ack(hb, w.t, renewed, **lists))
    assert isinstance(rej, Rejected) and "account" in rej.reason
    # No effect: nothing lost, nothing validated, and the round still awaits its real ack.
    assert w.acc.state_of("k0") is w.acc.state_of("k1") is TrackedState.WAITING
    assert w.acc.valid_until("k0") is None and w.acc.valid_until("k1") is None
    assert w.acc.receive(_a(w.t), _ack(hb, w.t, 1, released=(2,))) == (LeaseLost("k1", 2, LostReason.RELEASED),)
    assert w.acc.valid_until("k0") is not None


def test_seq_is_never_reused_not_even_after_a_disconnect() -> None:
    """One counter for handshakes, heartbeats and access attempts, never reset: an ack or a
    verdict from before a disconnect can never match a message sent after it."""
    w = Wire()
    seqs: list[int] = []
    tk = w.pinner.grant(_p(0), "a")
    (hn,) = w.acc.track(_a(0), "a", tk)
    assert isinstance(hn, HandshakeNeeded)
    seqs.append(hn.message.seq)
    w.acc.handshake_reply(_a(0), w.pinner.handshake_reply(_p(0), hn.message))
    old_hb = w.next_heartbeat()
    seqs.append(old_hb.seq)
    (old_ack,) = w.pinner.receive(_p(0), old_hb)
    d = w.acc.begin_access(_a(0.1), "a")
    assert d.notification is not None
    seqs.append(d.notification.attempt)
    assert w.acc.access_failed(_a(0.2), "a", posted=False) == ()
    d = w.acc.begin_access(_a(0.3), "a")
    assert d.notification is not None
    seqs.append(d.notification.attempt)
    assert w.acc.disconnect(_a(0.4), PIN) == (LeaseLost("a", tk.lease_id, LostReason.UNREACHABLE),)
    w.acc.access_failed(_a(0.4), "a")
    # Reconnect at the same clock reading, for a new lease.
    tk2 = w.pinner.grant(_p(0.4), "b")
    (hn2,) = w.acc.track(_a(0.4), "b", tk2)
    assert isinstance(hn2, HandshakeNeeded)
    seqs.append(hn2.message.seq)
    w.acc.handshake_reply(_a(0.4), w.pinner.handshake_reply(_p(0.4), hn2.message))
    new_hb = w.next_heartbeat()
    seqs.append(new_hb.seq)
    d2 = w.acc.begin_access(_a(w.t), "b")
    assert d2.notification is not None
    seqs.append(d2.notification.attempt)
    assert seqs == sorted(set(seqs)), seqs  # strictly increasing: none reused
    # The old round's ack (the pinner answered the first connection) validates nothing now.
    assert isinstance(old_ack, Send)
    w.acc.access_failed(_a(w.t), "b", posted=False)
    assert w.acc.receive(_a(w.t), old_ack.message) == ()
    assert w.acc.valid_until("b") is None


def _give_up(how: str) -> tuple[Accessor, LeaseTicket]:
    """A connected accessor that tracked a lease and gave it up in one of the ways there are."""
    w = Wire()
    tk = w.connect("k")
    w.heartbeat()
    if how == "untrack":
        assert len(w.sends(w.acc.untrack(_a(0.1), "k"))) == 1
    elif how == "completed":
        assert w.acc.begin_access(_a(0.1), "k").guaranteed
        assert w.acc.access_finished(_a(0.2), "k")[-1] == AccessCompleted("k", tk.lease_id, confirmed_by_pinner=False)
    elif how == "lost":
        ack = _ack_for(w, tk.lease_id, "unknown")
        assert w.acc.receive(_a(w.t), ack) == (LeaseLost("k", tk.lease_id, LostReason.UNKNOWN),)
    elif how == "failed-transfer":
        w.acc.begin_access(_a(0.1), "k")
        assert w.acc.access_failed(_a(0.2), "k")[-1] == LeaseLost("k", tk.lease_id, LostReason.ACCESS_FAILED)
    elif how == "lapsed":
        w.acc.handle_timeout(_a(CFG.kv_lease_duration + 1))
    else:
        assert how == "disconnect"
        w.acc.disconnect(_a(0.1), PIN)
    assert w.acc.state_of("k") is None
    return w.acc, tk


@pytest.mark.parametrize("how", ["untrack", "completed", "lost", "failed-transfer", "lapsed", "disconnect"])
def test_a_lease_given_up_is_never_tracked_again(how: str) -> None:
    acc, tk = _give_up(how)
    for key in ("k", "k-again"):
        with pytest.raises(LocalProtocolError, match="fresh lease"):
            acc.track(_a(CFG.kv_lease_duration + 2), key, tk)
    assert acc.state_of("k-again") is None
    # A fresh lease of the same pinner is tracked as usual.
    acc.track(_a(CFG.kv_lease_duration + 2), "k-again", LeaseTicket(PIN, INC, tk.lease_id + 1))
    assert acc.state_of("k-again") is TrackedState.WAITING


def test_tickets_below_the_forgotten_watermark_are_lost_as_forgotten() -> None:
    cfg = CFG.with_changes(tombstone_limit=2)
    acc = _accessor(cfg)
    for lid in (1, 3, 4, 5):  # given up in this order; 1 and 3 fall out of the memory
        acc.track(_a(0), f"k{lid}", LeaseTicket(PIN, INC, lid))
        acc.untrack(_a(0), f"k{lid}")
    # At or below the watermark (3): tracked before or not, it cannot be told apart.
    for lid in (1, 2, 3):
        assert acc.track(_a(1), f"again{lid}", LeaseTicket(PIN, INC, lid)) == (
            LeaseLost(f"again{lid}", lid, LostReason.FORGOTTEN),
        )
        assert acc.state_of(f"again{lid}") is None
    # Still remembered: refused as misuse.
    for lid in (4, 5):
        with pytest.raises(LocalProtocolError, match="fresh lease"):
            acc.track(_a(1), f"again{lid}", LeaseTicket(PIN, INC, lid))
    # Above the watermark, or of another incarnation or engine: tracked.
    for key, tk in (
        ("n6", LeaseTicket(PIN, INC, 6)),
        ("n1", LeaseTicket(PIN, INC + 1, 1)),
        ("o1", LeaseTicket("prefill-1", INC, 1)),
    ):
        acc.track(_a(1), key, tk)
        assert acc.state_of(key) is TrackedState.WAITING


def test_tombstone_limit_zero_puts_every_given_up_lease_under_the_watermark() -> None:
    acc = _accessor(CFG.with_changes(tombstone_limit=0))
    acc.track(_a(0), "k", LeaseTicket(PIN, INC, 7))
    acc.untrack(_a(0), "k")
    assert acc.track(_a(0), "k", LeaseTicket(PIN, INC, 7)) == (LeaseLost("k", 7, LostReason.FORGOTTEN),)
    assert acc.track(_a(0), "k", LeaseTicket(PIN, INC, 3)) == (LeaseLost("k", 3, LostReason.FORGOTTEN),)
    acc.track(_a(0), "k", LeaseTicket(PIN, INC, 8))
    assert acc.state_of("k") is TrackedState.WAITING


def test_access_failed_unposted_allows_a_retry() -> None:
    w = Wire()
    tk = w.connect()
    w.heartbeat()
    d1 = w.acc.begin_access(_a(0.1), "k")
    assert d1.guaranteed and d1.notification is not None
    assert w.acc.access_failed(_a(0.2), "k", posted=False) == ()
    assert w.acc.state_of("k") is TrackedState.WAITING
    d2 = w.acc.begin_access(_a(0.3), "k")
    assert d2.guaranteed and d2.notification is not None
    assert d2.notification.attempt > d1.notification.attempt  # a new attempt
    out = w.acc.access_finished(_a(0.4), "k")
    assert out[-1] == AccessCompleted("k", tk.lease_id, confirmed_by_pinner=False)
    (done,) = w.sends(out)
    assert isinstance(done.message, AccessDone) and done.message.attempt == d2.notification.attempt


def test_access_failed_posted_gives_the_lease_up_with_a_release_to_every_target() -> None:
    """Pinner TP 2, accessor TP 1: the accessor reads both pinner ranks. A posted transfer's
    notification may still land, so the lease is given up: Release to both ranks, ACCESS_FAILED."""
    pins = [Pinner(CFG, PIN, INC, rank=r, ranks=2) for r in range(2)]
    tk = pins[0].grant(_p(0), "k")
    assert pins[1].grant(_p(0), "k") == tk
    acc = _accessor()
    (hn,) = acc.track(_a(0), "k", tk)
    acc.handshake_reply(_a(0), pins[0].handshake_reply(_p(0), _handshake_of(hn)))
    d = acc.begin_access(_a(0.1), "k")
    assert d.allowed and d.targets == (0, 1) and d.engine_id == PIN
    out = acc.access_failed(_a(0.2), "k")  # posted=True is the default
    rel = Release("decode-0", 0, 1, SESSION, INC, (tk.lease_id,), posted=True)  # a WRITE of it may still land
    assert out == (Send(PIN, 0, rel), Send(PIN, 1, rel), LeaseLost("k", tk.lease_id, LostReason.ACCESS_FAILED))
    assert acc.state_of("k") is None and not acc.begin_access(_a(0.3), "k").allowed
    for r, pin in enumerate(pins):
        release = out[r]
        assert isinstance(release, Send)
        (free,) = pin.receive(_p(0.3), release.message)
        assert isinstance(free, Free) and free.reason is EndReason.RELEASED
    with pytest.raises(LocalProtocolError, match="fresh lease"):
        acc.track(_a(0.4), "k", tk)


def test_a_verdict_for_another_attempt_is_ignored() -> None:
    w = Wire()
    tk = w.connect()  # never acknowledged: every access must be confirmed
    d1 = w.acc.begin_access(_a(0), "k")
    assert d1.notification is not None and d1.notification.confirm
    # The pinner answers attempt 1's notification (a transport that posted it after all).
    (ack1,) = [o for o in w.pinner.receive(_p(0.01), d1.notification) if isinstance(o, Send)]
    assert isinstance(ack1.message, AccessDoneAck) and ack1.message.attempt == d1.notification.attempt
    assert w.acc.access_failed(_a(0.02), "k", posted=False) == ()
    d2 = w.acc.begin_access(_a(0.03), "k")
    assert d2.notification is not None and d2.notification.attempt != d1.notification.attempt
    # Attempt 1's OK arrives while attempt 2 is in flight: not kept as an early verdict...
    assert w.acc.receive(_a(0.04), ack1.message) == ()
    (again,) = w.acc.access_finished(_a(0.05), "k")
    assert isinstance(again, Send) and isinstance(again.message, AccessDone)
    assert w.acc.state_of("k") is TrackedState.CONFIRMING
    # ...nor counted while attempt 2 is confirming.
    assert w.acc.receive(_a(0.06), ack1.message) == ()
    assert w.acc.state_of("k") is TrackedState.CONFIRMING
    stale2 = AccessDoneAck(PIN, 0, INC, 0, SESSION, tk.lease_id, again.message.attempt, AccessOutcome.STALE)
    (st_,) = w.acc.receive(_a(0.07), stale2)
    assert isinstance(st_, AccessStale)


@pytest.mark.parametrize(("p_ranks", "a_ranks"), [(3, 2), (2, 3), (4, 3), (6, 4)])
def test_uneven_tp_ratio_is_refused_at_track(p_ranks: int, a_ranks: int) -> None:
    for rank in range(a_ranks):
        acc = _accessor(rank=rank, ranks=a_ranks)
        with pytest.raises(LocalProtocolError, match="uneven"):
            acc.track(_a(0), "k", LeaseTicket(PIN, INC, 1, ranks=p_ranks))
        assert acc.state_of("k") is None and acc.next_deadline() is None


# -- access decisions, completion, confirmation ------------------------------------------------


def test_pull_access_inside_the_window_completes_without_asking() -> None:
    w = Wire()
    tk = w.connect()
    w.heartbeat()
    w.t = 1.0
    d = w.acc.begin_access(_a(1.0), "k")
    assert d.allowed and d.guaranteed and d.valid_until == w.acc.valid_until("k")
    assert d.engine_id == PIN and d.targets == (0,) and d.notification is not None
    attempt = d.notification.attempt
    assert not w.acc.begin_access(_a(1.0), "k").allowed  # already accessing
    out = w.acc.access_finished(_a(1.2), "k")
    assert out == (
        Send(PIN, 0, AccessDone("decode-0", 0, 1, SESSION, INC, 0, tk.lease_id, attempt, False, _a(1.2))),
        AccessCompleted("k", tk.lease_id, confirmed_by_pinner=False),
    )
    assert w.acc.tracked_count == 0


@pytest.mark.parametrize("outcome", list(AccessOutcome))
def test_pull_access_outside_the_window_asks_the_pinner(outcome: AccessOutcome) -> None:
    w = Wire()
    tk = w.connect()
    d = w.acc.begin_access(_a(0), "k")  # never acknowledged: allowed for pull, not guaranteed
    assert d.allowed and not d.guaranteed and d.valid_until is None
    (send,) = w.acc.access_finished(_a(0.5), "k")
    assert isinstance(send, Send) and isinstance(send.message, AccessDone) and send.message.confirm
    assert w.acc.begin_access(_a(0.5), "k").reason == "lease is confirming"
    ack = AccessDoneAck(PIN, 0, INC, 0, SESSION, tk.lease_id, send.message.attempt, outcome)
    out = w.acc.receive(_a(0.6), ack)
    if outcome is AccessOutcome.OK:
        assert out == (AccessCompleted("k", tk.lease_id, confirmed_by_pinner=True),)
    else:
        assert len(out) == 1 and isinstance(out[0], AccessStale) and outcome.name in out[0].reason
    assert w.acc.receive(_a(0.7), ack) == ()  # duplicate


def test_confirmation_that_never_comes_is_stale() -> None:
    w = Wire()
    w.connect()
    w.acc.begin_access(_a(0), "k")
    w.acc.access_finished(_a(0.5), "k")
    just_before = [o for o in w.acc.handle_timeout(_a(0.5 + CFG.accessor_extension - 1e-6)) if not isinstance(o, Send)]
    assert just_before == []
    (stale,) = [o for o in w.acc.handle_timeout(_a(0.5 + CFG.accessor_extension)) if not isinstance(o, Send)]
    assert isinstance(stale, AccessStale) and "did not confirm" in stale.reason


def test_push_write_needs_the_window_to_cover_the_access_bound() -> None:
    w = Wire(push=True)
    w.connect()
    d = w.acc.begin_access(_a(0), "k")
    assert not d.allowed and "does not cover" in d.reason
    w.heartbeat()
    v = w.acc.valid_until("k")
    assert v is not None
    late = v - CFG.access_time_local + 1e-6
    w.t = late - A_EPOCH
    assert not w.acc.begin_access(LocalTime(late), "k").allowed
    w2 = Wire(push=True)
    w2.connect()
    w2.heartbeat()
    d2 = w2.acc.begin_access(_a(0.1), "k")
    assert d2.allowed and d2.guaranteed


def test_access_failed_returns_to_waiting_and_lost_access_failing_forgets() -> None:
    """v2: only an unposted failure (``posted=False``) returns to WAITING (a posted one gives the
    lease up: see test_access_failed_posted_...); a failure while LOST forgets in either case."""
    w = Wire()
    tk = w.connect()
    w.heartbeat()
    w.acc.begin_access(_a(0.1), "k")
    assert w.acc.access_failed(_a(0.2), "k", posted=False) == () and w.acc.state_of("k") is TrackedState.WAITING
    w.acc.begin_access(_a(0.3), "k")
    w.t = 0.3
    ack = _ack_for(w, tk.lease_id, "expired")
    w.acc.receive(_a(w.t), ack)
    assert w.acc.state_of("k") is TrackedState.LOST
    assert w.acc.access_failed(_a(w.t), "k") == () and w.acc.state_of("k") is None
    with pytest.raises(LocalProtocolError, match="fresh lease"):
        w.acc.track(_a(w.t), "k", tk)


def test_a_lapsed_window_is_not_a_loss_until_a_whole_lease_duration_without_acks() -> None:
    w = Wire()
    tk = w.connect()
    w.heartbeat()
    v = w.acc.valid_until("k")
    assert v is not None
    sent_at = v - CFG.accessor_extension  # the acknowledged heartbeat's send time
    w.t = CFG.heartbeat_interval
    w.heartbeat(deliver=False)
    # The window lapsed: no longer provable (a push would be refused, a read confirmed)...
    assert [o for o in w.acc.handle_timeout(v) if not isinstance(o, Send)] == []
    assert w.acc.state_of("k") is TrackedState.WAITING
    decision = w.acc.begin_access(v, "k")
    assert decision.allowed and not decision.guaranteed
    assert w.acc.access_failed(v, "k", posted=False) == ()  # nothing was handed to the transport
    # ...heartbeats keep going, and the lease is given up a whole duration after that send.
    give_up = LocalTime(sent_at + CFG.kv_lease_duration)
    nd = w.acc.next_deadline()
    assert nd is not None and nd <= give_up
    assert [o for o in w.acc.handle_timeout(LocalTime(give_up - 1e-6)) if not isinstance(o, Send)] == []
    out = [o for o in w.acc.handle_timeout(give_up) if not isinstance(o, Send)]
    assert out == [LeaseLost("k", tk.lease_id, LostReason.VALIDITY_LAPSED)]


def test_a_lapsed_window_revives_with_the_next_acknowledgement() -> None:
    """A stalled accessor (e.g. a long forward pass) whose window lapsed keeps its lease as
    soon as the pinner, which still holds it, acknowledges a heartbeat again."""
    w = Wire()
    w.connect()
    w.heartbeat()
    v = w.acc.valid_until("k")
    assert v is not None
    w.t = v - A_EPOCH + 0.01  # past the window, well within the pinner's grant
    w.heartbeat()
    v2 = w.acc.valid_until("k")
    assert v2 is not None and v2 > v
    assert w.acc.state_of("k") is TrackedState.WAITING


def test_never_acknowledged_lease_is_given_up_after_one_lease_duration() -> None:
    acc = _accessor()
    acc.track(_a(0), "k", LeaseTicket(PIN, INC, 7))
    early = [o for o in acc.handle_timeout(_a(CFG.accessor_extension)) if not isinstance(o, HandshakeNeeded)]
    assert early == []
    out = [o for o in acc.handle_timeout(_a(CFG.kv_lease_duration)) if not isinstance(o, HandshakeNeeded)]
    assert out == [LeaseLost("k", 7, LostReason.VALIDITY_LAPSED)]


def test_untrack_releases_and_disconnect_loses() -> None:
    w = Wire()
    tk = w.connect("a")
    w.pinner.grant(_p(0), "b")
    w.acc.track(_a(0), "b", LeaseTicket(PIN, INC, 2))
    assert w.acc.untrack(_a(0.1), "a") == (Send(PIN, 0, Release("decode-0", 0, 1, SESSION, INC, (tk.lease_id,))),)
    assert w.acc.untrack(_a(0.1), "a") == ()  # unknown key: harmless
    w.acc.begin_access(_a(0.2), "b")
    with pytest.raises(LocalProtocolError, match="in flight"):
        w.acc.untrack(_a(0.2), "b")
    assert w.acc.disconnect(_a(0.3), PIN) == (LeaseLost("b", 2, LostReason.UNREACHABLE),)
    assert w.acc.disconnect(_a(0.3), PIN) == ()
    assert w.acc.state_of("b") is TrackedState.LOST


# -- misuse ------------------------------------------------------------------------------------


def test_accessor_misuse() -> None:
    acc = _accessor()
    acc.track(_a(1), "k", LeaseTicket(PIN, INC, 1))
    with pytest.raises(LocalProtocolError, match="already tracked"):
        acc.track(_a(1), "k", LeaseTicket(PIN, INC, 2))
    with pytest.raises(LocalProtocolError, match="already tracked"):
        acc.track(_a(1), "k2", LeaseTicket(PIN, INC, 1))
    with pytest.raises(LocalProtocolError, match="push mode"):
        acc.track(_a(1), "k3", LeaseTicket(PIN, INC, 3, LeaseKind.FIXED_TTL, PeerTime(5.0)), push=True)
    with pytest.raises(LocalProtocolError, match=r"not tracked|waiting"):
        acc.access_finished(_a(1), "k")
    with pytest.raises(LocalProtocolError, match="not tracked"):
        acc.access_failed(_a(1), "nope")
    assert not acc.begin_access(_a(1), "nope").allowed
    calls: list[Callable[[], object]] = [
        lambda: acc.handle_timeout(_a(0.5)),
        lambda: acc.begin_access(_a(0.5), "k"),
        lambda: acc.track(_a(0.5), "x", LeaseTicket(PIN, INC, 9)),
    ]
    for call in calls:
        with pytest.raises(LocalProtocolError, match="backwards"):
            call()
    # v2: a clock reading must be finite and within MAX_TIME (NaN used to fail as "backwards").
    for bad in (float("nan"), float("inf"), 2.0**32 + 1):
        with pytest.raises(LocalProtocolError, match="finite"):
            acc.handle_timeout(LocalTime(bad))
    bad_layouts: list[Layout] = [{"rank": 1, "ranks": 1}, {"ranks": 0}, {"ranks": (1 << 16) + 1}]
    for layout in bad_layouts:
        with pytest.raises(LocalProtocolError):
            _accessor(engine="d", **layout)
    with pytest.raises(LocalProtocolError):
        _accessor(engine="")
    for session in (-1, 1 << 64):
        with pytest.raises(LocalProtocolError, match="session"):
            _accessor(session=session)


# -- heterogeneous TP --------------------------------------------------------------------------


@pytest.mark.parametrize(("p_ranks", "a_ranks"), [(1, 1), (2, 1), (4, 2), (8, 2), (1, 2), (2, 4), (1, 4)])
def test_heterogeneous_tp_frees_only_when_every_expected_rank_reported(p_ranks: int, a_ranks: int) -> None:
    pinners = [Pinner(CFG, PIN, INC, rank=r, ranks=p_ranks) for r in range(p_ranks)]
    # Every accessor rank is its own process: its own session.
    accs = [_accessor(rank=r, ranks=a_ranks, session=SESSION + r) for r in range(a_ranks)]
    layouts = [tp_layout(p_ranks, a_ranks, r) for r in range(a_ranks)]
    tickets = [p.grant(_p(0), "k", lease_id=77) for p in pinners]
    assert all(tk.ranks == p_ranks for tk in tickets)
    frees: dict[int, list[Free]] = {r: [] for r in range(p_ranks)}
    completed: list[int] = []

    def to_pinner(send: Send, t: float, src: int) -> None:
        assert isinstance(send.rank, int) and send.rank in layouts[src].targets  # only to its targets
        r = send.rank
        for o in pinners[r].receive(_p(t), send.message):
            if isinstance(o, Free):
                frees[r].append(o)
            elif isinstance(o, Send):
                assert o.rank == src
                for ev in accs[src].receive(_a(t), o.message):
                    if isinstance(ev, AccessCompleted):
                        completed.append(src)
                    assert not isinstance(ev, LeaseLost | AccessStale | Rejected), ev
            else:
                raise AssertionError(o)
        info = pinners[r].info(77)
        if isinstance(send.message, AccessDone) and info is not None:
            # The pinner derived `expected` from the sender's (rank, ranks).
            assert info.expected == layouts[src].expected == max(1, a_ranks // p_ranks)

    for r, acc in enumerate(accs):
        (hs,) = acc.track(_a(0), "k", tickets[0])
        assert isinstance(hs, HandshakeNeeded)
        acc.handshake_reply(_a(0), pinners[0].handshake_reply(_p(0), hs.message))
        out = acc.handle_timeout(_a(0))
        # One heartbeat per target pinner rank, each to one rank (never a broadcast).
        ranks = sorted(o.rank for o in out if isinstance(o, Send) and o.rank is not None)
        assert len(ranks) == len(out) and ranks == list(layouts[r].targets)
        for o in out:
            assert isinstance(o, Send) and isinstance(o.message, Heartbeat)
            # A pinner rank this accessor rank does not access refuses the heartbeat.
            for q in set(range(p_ranks)) - set(layouts[r].targets):
                (rej,) = pinners[q].receive(_p(0), o.message)
                assert isinstance(rej, Rejected) and "does not access" in rej.reason
            assert acc.valid_until("k") is None  # validity needs every target rank's ack
            to_pinner(o, 0, r)
        assert acc.valid_until("k") is not None

    targets: dict[int, set[int]] = {}
    for r, acc in enumerate(accs[:-1] if a_ranks > 1 else accs):
        d = acc.begin_access(_a(0.1), "k")
        assert d.guaranteed and d.targets == tuple(layouts[r].targets)
        out = acc.access_finished(_a(0.2), "k")
        completed.extend(r for o in out if isinstance(o, AccessCompleted))
        sends = [o for o in out if isinstance(o, Send)]
        assert all(s.rank is not None for s in sends)  # each to one rank, never a broadcast
        targets[r] = {s.rank for s in sends if s.rank is not None}
        for s in sends:
            to_pinner(s, 0.2, r)
    # Which pinner ranks each accessor rank reads from (vLLM's mapping).
    for r, tg in targets.items():
        if p_ranks >= a_ranks:
            k = p_ranks // a_ranks
            assert tg == set(range(r * k, (r + 1) * k))
        else:
            assert tg == {r // (a_ranks // p_ranks)}
    if a_ranks > 1:
        # The last accessor rank has not reported: the pinner ranks it reads from stay pinned.
        last = a_ranks - 1
        waiting = (
            set(range(last * (p_ranks // a_ranks), p_ranks)) if p_ranks >= a_ranks else {last // (a_ranks // p_ranks)}
        )
        for r in range(p_ranks):
            assert bool(frees[r]) == (r not in waiting), (r, frees)
        assert accs[last].begin_access(_a(0.25), "k").guaranteed
        out = accs[last].access_finished(_a(0.3), "k")
        completed.extend(last for o in out if isinstance(o, AccessCompleted))
        for o in out:
            if isinstance(o, Send):
                to_pinner(o, 0.3, last)
    assert all(len(frees[r]) == 1 and frees[r][0].reason is EndReason.ACCESS_DONE for r in range(p_ranks))
    assert sorted(completed) == list(range(a_ranks))


# -- heartbeat splitting -----------------------------------------------------------------------


@pytest.mark.parametrize("max_bytes", [MIN_MESSAGE_BYTES, 256, 1024])
def test_heartbeats_split_under_the_size_bound_with_10k_leases(max_bytes: int) -> None:
    cfg = CFG.with_changes(max_message_bytes=max_bytes)
    pinner = Pinner(cfg, PIN, INC)
    acc = _accessor(cfg)
    rng = random.Random(max_bytes)
    ids = sorted(rng.sample(range(1, 2**40), 10_000))
    for i, lid in enumerate(ids):
        tk = pinner.grant(_p(0), f"k{i}", lease_id=lid)
        acc.track(_a(0), f"k{i}", tk)
    (hs,) = acc.handle_timeout(_a(CFG.heartbeat_interval))
    acc.handshake_reply(_a(1), pinner.handshake_reply(_p(1), _handshake_of(hs)))
    out = acc.handle_timeout(_a(1))
    sent: list[int] = []
    for o in out:
        assert isinstance(o, Send) and isinstance(o.message, Heartbeat)
        assert len(encode(o.message)) <= max_bytes
        sent.extend(o.message.lease_ids)
        for reply in pinner.receive(_p(1), o.message):
            assert isinstance(reply, Send) and len(encode(reply.message)) <= max_bytes
            acc.receive(_a(1), reply.message)
    assert sent == ids and len(out) > 1
    assert all(acc.valid_until(f"k{i}") is not None for i in range(0, 10_000, 997))
    assert pinner.counters.renewed == 10_000


def test_engine_ids_too_long_for_the_message_bound_are_refused_at_start_up() -> None:
    cfg = CFG.with_changes(max_message_bytes=MIN_MESSAGE_BYTES)
    with pytest.raises(ConfigError, match="max_message_bytes"):
        _accessor(cfg, "decode-" + "x" * 118)  # 125 bytes
    _accessor(cfg, "decode-" + "x" * 117)  # 124 bytes: the longest that fits
    with pytest.raises(ConfigError, match="max_message_bytes"):
        Pinner(cfg, "prefill-" + "x" * 44, INC)  # 52 bytes (v3's ack states the extension)
    Pinner(cfg, "prefill-" + "x" * 43, INC)  # 51 bytes
    with pytest.raises(ConfigError, match="max_message_bytes"):
        LeaseConfig(max_message_bytes=MIN_MESSAGE_BYTES - 1)


def test_long_engine_id_under_the_smallest_message_bound() -> None:
    """A 40-byte engine id still leaves room for ids in a heartbeat of the smallest bound
    (192 bytes in v2): every message, and the ack answering it, stays under the bound (it used
    to raise EncodeError from handle_timeout)."""
    cfg = CFG.with_changes(max_message_bytes=MIN_MESSAGE_BYTES)
    pinner = Pinner(cfg, PIN, INC)
    acc = _accessor(cfg, "decode-with-a-rather-long-engine-name-0")
    tk = pinner.grant(_p(0), "k")
    (hs,) = acc.track(_a(0), "k", tk)
    acc.handshake_reply(_a(0), pinner.handshake_reply(_p(0), _handshake_of(hs)))
    out = acc.handle_timeout(_a(0))
    assert out
    for o in out:
        assert isinstance(o, Send) and len(encode(o.message)) <= MIN_MESSAGE_BYTES
        for reply in pinner.receive(_p(0), o.message):
            assert isinstance(reply, Send) and len(encode(reply.message)) <= MIN_MESSAGE_BYTES
            assert acc.receive(_a(0), reply.message) == ()
    assert acc.valid_until("k") is not None


def test_outstanding_heartbeats_are_bounded() -> None:
    cfg = CFG.with_changes(max_outstanding_heartbeats=2)
    w = Wire(cfg)
    w.connect()
    sends = []
    for i in range(4):
        w.t = i * cfg.heartbeat_interval
        (s,) = w.acc.handle_timeout(_a(w.t))
        assert isinstance(s, Send)
        sends.append(s.message)
    # The oldest rounds were forgotten: their acks carry nothing.
    old = sends[0]
    assert isinstance(old, Heartbeat)
    assert w.acc.receive(_a(w.t), _ack(old, w.t, 1)) == ()
    assert w.acc.valid_until("k") is None
    new = sends[-1]
    assert isinstance(new, Heartbeat)
    assert w.acc.receive(_a(w.t), _ack(new, w.t, 1)) == ()
    assert w.acc.valid_until("k") == pytest.approx(float(new.t_send) + cfg.accessor_extension)


# -- fixed-TTL leases across clock offsets -----------------------------------------------------


@given(
    seed=st.integers(0, 2**32 - 1),
    ttl=st.floats(0.2, 20.0),
    drift=st.sampled_from([0.0, 1e-4, 1e-2]),
    lossy=st.booleans(),
    waits=st.lists(st.floats(0.0, 5.0), min_size=1, max_size=6),
)
def test_fixed_ttl_validity_never_outlives_the_pinner_deadline(
    seed: int, ttl: float, drift: float, lossy: bool, waits: list[float]
) -> None:
    cfg = LeaseConfig(
        kv_lease_duration=3.0, max_drift_rate=drift, validity_margin=MIN_VALIDITY_MARGIN, decoder_kv_blocks_ttl=ttl
    )
    rng = random.Random(seed)
    prof = LinkProfile(0.0, 0.3, drop=0.3, duplicate=0.2) if lossy else LinkProfile(0.0, 0.05)
    pair = Pair(
        cfg,
        rng,
        pinner_clock=PeerClock.random(rng, drift),
        accessor_clock=PeerClock.random(rng, drift),
        to_pinner=prof,
        to_accessor=prof,
    )
    keys = []
    for i, dt in enumerate(waits):
        key = f"f{i}"
        pair.grant_and_track(key, kind=LeaseKind.FIXED_TTL, ttl=ttl * (1 + i % 3) / 3)
        keys.append(key)
        pair.advance(dt)  # the Pair audit checks validity against the pinner's real deadline
        for k in keys:
            v = pair.accessor.valid_until(k)
            rec = pair.record(k)
            if v is not None:
                deadline_real = pair.pinner_clock.real(rec.grant_p + rec.duration)
                assert pair.accessor_clock.real(v) <= deadline_real + 1e-6
    pair.advance(ttl + 1.0)
    for k in keys:
        rec = pair.record(k)
        assert [f.reason for _, f in rec.frees] == [EndReason.EXPIRED]
        assert any(isinstance(e, LeaseLost) and e.reason is LostReason.TTL_PASSED for e in rec.accessor_events) or (
            not pair.accessor.valid_until(k)
        )


def test_fixed_ttl_lease_is_valid_after_one_acknowledged_round_and_lapses_at_the_deadline() -> None:
    w = Wire()
    tk = w.connect("f", kind=LeaseKind.FIXED_TTL)
    # The deadline alone does not prove the lease is still held for this accessor (another
    # process may have completed it): no validity before an acknowledged round.
    assert w.acc.valid_until("f") is None
    assert not w.acc.begin_access(_a(0), "f").guaranteed
    w.acc.access_failed(_a(0), "f", posted=False)
    w.heartbeat()
    v = w.acc.valid_until("f")
    assert v is not None and v <= A_EPOCH + CFG.decoder_kv_blocks_ttl
    assert v == pytest.approx(A_EPOCH + CFG.decoder_kv_blocks_ttl - CFG.validity_margin, abs=0.1)
    info = w.pinner.info(tk.lease_id)
    assert info is not None and info.expiry == P_EPOCH + CFG.decoder_kv_blocks_ttl  # never extended
    out = [o for o in w.acc.handle_timeout(v) if not isinstance(o, Send)]
    assert out == [LeaseLost("f", tk.lease_id, LostReason.TTL_PASSED)]


# -- remaining transitions ---------------------------------------------------------------------


def test_untrack_after_the_lease_was_lost_mid_access_sends_nothing() -> None:
    w = Wire()
    tk = w.connect()
    w.heartbeat()
    w.acc.begin_access(_a(0.1), "k")
    w.t = 0.1
    ack = _ack_for(w, tk.lease_id, "expired")
    w.acc.receive(_a(w.t), ack)
    assert w.acc.state_of("k") is TrackedState.LOST
    assert w.acc.disconnect(_a(w.t), PIN) == ()  # already lost: nothing more to report
    # The access is still in flight: it is the engine's to end (finish or fail), not untrack's.
    with pytest.raises(LocalProtocolError, match="in flight"):
        w.acc.untrack(_a(w.t), "k")
    assert w.acc.state_of("k") is TrackedState.LOST
    fin = w.acc.access_finished(_a(w.t), "k", notified=True)
    assert fin == (AccessStale("k", tk.lease_id, "the lease was lost during the access"),)
    assert w.acc.untrack(_a(w.t), "k") == ()  # ended: a harmless no-op that sends nothing


def test_disconnect_while_confirming_is_stale() -> None:
    w = Wire()
    tk = w.connect()
    w.acc.begin_access(_a(0), "k")
    w.acc.access_finished(_a(0.1), "k")
    (stale,) = w.acc.disconnect(_a(0.2), PIN)
    assert isinstance(stale, AccessStale) and stale.lease_id == tk.lease_id and "unreachable" in stale.reason


def test_fixed_ttl_access_inside_the_converted_deadline_completes() -> None:
    w = Wire()
    tk = w.connect("f", kind=LeaseKind.FIXED_TTL)
    w.heartbeat()
    assert w.acc.begin_access(_a(1.0), "f").guaranteed
    out = w.acc.access_finished(_a(1.5), "f")
    assert out[-1] == AccessCompleted("f", tk.lease_id, confirmed_by_pinner=False)
    est = w.acc.clock_estimator(PIN)
    assert est is not None and est.sample_count >= 1
    assert w.acc.clock_estimator("nobody") is None


def test_proactive_handshake_and_replies_from_other_ranks() -> None:
    acc = _accessor()
    hn = acc.handshake(_a(0), PIN)
    assert isinstance(hn, HandshakeNeeded) and hn.engine_id == PIN
    pinners = [Pinner(CFG, PIN, INC, rank=r, ranks=2) for r in range(2)]
    assert acc.handshake_reply(_a(0.1), pinners[1].handshake_reply(_p(0), hn.message)) == ()
    est = acc.clock_estimator(PIN)
    assert acc.is_connected(PIN) and est is not None and est.sample_count == 0  # only rank 0 samples the clock
    tk = pinners[0].grant(_p(0.2), "k")
    assert acc.track(_a(0.2), "k", tk) == ()  # already connected: no handshake needed


def test_confirmation_needs_every_pinner_rank() -> None:
    pinners = [Pinner(CFG, PIN, INC, rank=r, ranks=2) for r in range(2)]
    acc = _accessor()
    tks = [p.grant(_p(0), "k", lease_id=5) for p in pinners]
    (hs,) = acc.track(_a(0), "k", tks[0])
    acc.handshake_reply(_a(0), pinners[0].handshake_reply(_p(0), _handshake_of(hs)))
    acc.begin_access(_a(0), "k")  # never acknowledged: the access must be confirmed
    sends = [o for o in acc.access_finished(_a(0.1), "k") if isinstance(o, Send)]
    ranks = [s.rank for s in sends if s.rank is not None]
    assert sorted(ranks) == [0, 1] and len(ranks) == len(sends)
    acks = [pinners[rank].receive(_p(0.1), s.message)[-1] for rank, s in zip(ranks, sends, strict=True)]
    assert isinstance(acks[0], Send) and isinstance(acks[1], Send)
    assert acc.receive(_a(0.2), acks[0].message) == ()
    (done,) = acc.receive(_a(0.2), acks[1].message)
    assert done == AccessCompleted("k", 5, confirmed_by_pinner=True)


def test_restart_seen_in_an_ack_spares_leases_of_the_new_incarnation() -> None:
    w = Wire()
    w.connect("old")
    (send,) = w.acc.handle_timeout(_a(0))
    assert isinstance(send, Send)
    hb = send.message
    assert isinstance(hb, Heartbeat)
    # A ticket of the new incarnation arrives before the ack that reveals the restart.
    w.acc.track(_a(0.05), "new", LeaseTicket(PIN, INC + 1, 1))
    ack = attrs.evolve(_ack(hb, 0.05, 0, unknown=(1,)), incarnation=INC + 1)
    assert w.acc.receive(_a(0.1), ack) == (LeaseLost("old", 1, LostReason.PINNER_RESTARTED),)
    assert w.acc.state_of("new") is TrackedState.WAITING


def test_acks_stay_under_the_size_bound_when_the_pinner_id_is_longer() -> None:
    """The accessor sizes heartbeat chunks for its own engine id; the pinner's ack carries the
    pinner's id and splits the ids into four lists (each opening with an absolute id)."""
    cfg = CFG.with_changes(max_message_bytes=MIN_MESSAGE_BYTES, tombstone_limit=1000)
    pinner = Pinner(cfg, "prefill-" + "x" * 43, 2**63)
    acc = _accessor(cfg)
    base = 2**40
    tks = [pinner.grant(_p(0), f"k{i}", lease_id=base + 1 + i) for i in range(40)]
    for i, tk in enumerate(tks):
        acc.track(_a(0), f"k{i}", tk)
        if i % 4 == 1:
            pinner.release(_p(1), tk.lease_id)
        elif i % 4 == 2:
            pinner.receive(_p(1), AccessDone("decode-0", 0, 1, SESSION, 2**63, 0, tk.lease_id, 1, False, _a(0)))
    (hs,) = acc.handle_timeout(_a(CFG.heartbeat_interval))
    acc.handshake_reply(_a(1), pinner.handshake_reply(_p(1), _handshake_of(hs)))
    lost: list[AccessorOutput] = []
    for o in acc.handle_timeout(_a(1)):
        assert isinstance(o, Send) and len(encode(o.message)) <= MIN_MESSAGE_BYTES
        for reply in pinner.receive(_p(2), o.message):
            assert isinstance(reply, Send)
            assert len(encode(reply.message)) <= MIN_MESSAGE_BYTES
            lost.extend(acc.receive(_a(2), reply.message))
    # Every ack was accepted (none Rejected for its accounting): the released and completed
    # leases are lost, the other 20 renewed.
    assert all(isinstance(e, LeaseLost) for e in lost) and len(lost) == 20
    assert all((acc.valid_until(f"k{i}") is None) == (i % 4 in (1, 2)) for i in range(40))


@pytest.mark.parametrize("outcome", [AccessOutcome.OK, AccessOutcome.STALE])
def test_verdict_on_the_attached_notification_may_arrive_before_the_transfer_is_reported_done(
    outcome: AccessOutcome,
) -> None:
    """An uncovered access attaches a confirm-request to the transfer; the pinner can answer
    before the transport reports the transfer complete. The early verdict is kept, not dropped."""
    w = Wire()
    tk = w.connect("k")  # never acknowledged: the access cannot be guaranteed
    decision = w.acc.begin_access(_a(0), "k")
    assert decision.allowed and not decision.guaranteed
    assert decision.notification is not None and decision.notification.confirm
    assert decision.targets == (0,)
    # The pinner handles the attached notification (after the data landed) and answers.
    replies = w.pinner.receive(_p(0.01), decision.notification)
    acks = [r.message for r in replies if isinstance(r, Send) and isinstance(r.message, AccessDoneAck)]
    assert len(acks) == 1 and acks[0].outcome is AccessOutcome.OK
    early = AccessDoneAck(PIN, 0, INC, 0, SESSION, tk.lease_id, decision.notification.attempt, outcome)
    assert w.acc.receive(_a(0.02), early) == ()  # still accessing: kept, nothing decided yet
    assert w.acc.state_of("k") is TrackedState.ACCESSING
    fin = w.acc.access_finished(_a(0.03), "k", notified=True)
    assert not any(isinstance(o, Send) for o in fin)  # the attached one already asked
    if outcome is AccessOutcome.OK:
        assert fin == (AccessCompleted("k", tk.lease_id, confirmed_by_pinner=True),)
    else:
        assert len(fin) == 1 and isinstance(fin[0], AccessStale)
    assert w.acc.state_of("k") is None


def test_an_uncovered_finish_without_an_attached_confirmation_asks_again() -> None:
    """Guaranteed at the start (the attached notification did not ask to confirm) but finished
    after the window: the accessor sends a confirm-request of its own."""
    w = Wire()
    w.connect("k")
    w.heartbeat()
    decision = w.acc.begin_access(_a(0), "k")
    assert decision.guaranteed and decision.notification is not None and not decision.notification.confirm
    late = w.acc.valid_until("k")
    assert late is not None
    fin = w.acc.access_finished(_a(late - A_EPOCH + 0.001), "k", notified=True)
    sends = [o for o in fin if isinstance(o, Send)]
    assert len(sends) == 1 and isinstance(sends[0].message, AccessDone) and sends[0].message.confirm
    assert w.acc.state_of("k") is TrackedState.CONFIRMING


@pytest.mark.parametrize("deadline", [float("inf"), float("nan"), 1e300])
def test_a_ticket_deadline_outside_the_time_bound_is_refused(deadline: float) -> None:
    d = {"engine_id": PIN, "incarnation": INC, "lease_id": 1, "kind": int(LeaseKind.FIXED_TTL), "deadline": deadline}
    with pytest.raises(RemoteProtocolError):
        LeaseTicket.from_dict(d)


# -- edges the mutation check of the core tests found unbound ------------------------------------


@pytest.mark.parametrize("early", [True, False])
def test_an_access_finishing_exactly_at_valid_until_is_not_covered(early: bool) -> None:
    w = Wire()
    tk = w.connect("k")
    w.heartbeat()
    valid = w.acc.valid_until("k")
    assert valid is not None
    assert w.acc.begin_access(LocalTime(valid - 1.0), "k").guaranteed
    end = math.nextafter(valid, -math.inf) if early else valid
    out = w.acc.access_finished(LocalTime(end), "k")
    (send,) = w.sends(out)
    assert isinstance(send.message, AccessDone)
    if early:  # strictly before: covered, complete without asking
        assert out[-1] == AccessCompleted("k", tk.lease_id, confirmed_by_pinner=False) and not send.message.confirm
    else:  # at valid_until the window no longer covers it: ask the pinner
        assert send.message.confirm and w.acc.state_of("k") is TrackedState.CONFIRMING


def test_the_given_up_watermark_never_moves_down() -> None:
    acc = _accessor(CFG.with_changes(tombstone_limit=1))
    for lid in (5, 3, 6):  # 5 falls under the watermark when 3 is given up; then 3 when 6 is
        acc.track(_a(0), f"k{lid}", LeaseTicket(PIN, INC, lid))
        acc.untrack(_a(0), f"k{lid}")
    assert acc.track(_a(1), "again5", LeaseTicket(PIN, INC, 5)) == (LeaseLost("again5", 5, LostReason.FORGOTTEN),)
    assert acc.state_of("again5") is None


@pytest.mark.parametrize("how", ["disconnect", "unknown"])
def test_a_lease_lost_during_an_access_is_retired_at_once(how: str) -> None:
    w = Wire()
    tk = w.connect("k")
    w.heartbeat()
    assert w.acc.begin_access(_a(0.1), "k").allowed
    if how == "disconnect":
        assert w.acc.disconnect(_a(0.2), PIN) == (LeaseLost("k", tk.lease_id, LostReason.UNREACHABLE),)
    else:
        hb = w.next_heartbeat()
        lost = w.acc.receive(_a(w.t), _ack(hb, w.t, 0, unknown=(tk.lease_id,)))
        assert lost == (LeaseLost("k", tk.lease_id, LostReason.UNKNOWN),)
    assert w.acc.state_of("k") is TrackedState.LOST
    # The access still runs, and its attached access-done may still land: not trackable again.
    with pytest.raises(LocalProtocolError, match="fresh lease"):
        w.acc.track(_a(w.t + 0.3), "k-again", tk)
    assert w.acc.state_of("k-again") is None


def test_a_ticket_of_the_connected_incarnation_with_another_tp_size_is_lost() -> None:
    w = Wire()
    w.connect("k")
    wider = LeaseTicket(PIN, INC, 2, ranks=2)  # the connected pinner said it has 1 rank
    assert w.acc.track(_a(0.1), "w", wider) == (LeaseLost("w", 2, LostReason.UNKNOWN),)
    assert w.acc.state_of("w") is None and w.acc.is_connected(PIN)
    with pytest.raises(LocalProtocolError, match="fresh lease"):
        w.acc.track(_a(0.2), "w", wider)
