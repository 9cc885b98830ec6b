"""The accessor, state x input, through the public API: tracking and handshakes, validity from
acknowledged heartbeats, every ack outcome in every tracked state, access decisions in pull and
push mode, confirmation, heterogeneous TP, heartbeat splitting, fixed-TTL leases across clock
offsets, misuse."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlease import (
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
    PeerTime,
    Pinner,
    Rejected,
    Release,
    Send,
    TrackedState,
    encode,
)
from kvlease.testing import LinkProfile, Pair, PeerClock

CFG = LeaseConfig(kv_lease_duration=6.0, max_access_time=0.5, validity_margin=0.01)
P_EPOCH = 91_000.0  # the pinner's clock reads P_EPOCH + t
A_EPOCH = 12_345.5  # the accessor's clock reads A_EPOCH + t
INC = 42
PIN = "prefill-0"


def _a(t: float) -> LocalTime:
    return LocalTime(A_EPOCH + t)


def _p(t: float) -> LocalTime:
    return LocalTime(P_EPOCH + t)


class Wire:
    """One accessor and one pinner, driven by hand, messages passed directly (no loss)."""

    def __init__(self, cfg: LeaseConfig = CFG, *, push: bool = False) -> None:
        self.pinner = Pinner(cfg, PIN, INC)
        self.acc = Accessor(cfg, "decode-0")
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


# -- tracking, handshakes ----------------------------------------------------------------------


def test_track_asks_for_a_handshake_once_per_engine_and_interval() -> None:
    acc = Accessor(CFG, "decode-0", rank=1, ranks=2)
    tk1 = LeaseTicket(PIN, INC, 1)
    tk2 = LeaseTicket(PIN, INC, 2)
    (hs,) = acc.track(_a(0), "a", tk1)
    assert isinstance(hs, HandshakeNeeded) and hs.engine_id == PIN
    assert hs.message == Handshake("decode-0", 1, 2, PROTOCOL_VERSION, hs.message.capabilities, _a(0))
    assert acc.track(_a(0.1), "b", tk2) == ()  # one handshake in flight per engine
    assert acc.next_deadline() == _a(CFG.heartbeat_interval)
    (again,) = acc.handle_timeout(_a(CFG.heartbeat_interval))
    assert isinstance(again, HandshakeNeeded)
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


@pytest.mark.parametrize(
    ("reply_kw", "why"),
    [({"version": PROTOCOL_VERSION + 1}, "version"), ({"t_echo": PeerTime(A_EPOCH + 99)}, "impossible")],
)
def test_bad_handshake_replies_are_rejected(reply_kw: dict[str, object], why: str) -> None:
    acc = Accessor(CFG, "decode-0")
    acc.track(_a(0), "k", LeaseTicket(PIN, INC, 1))
    fields: dict[str, object] = {
        "engine_id": PIN, "rank": 0, "ranks": 1, "incarnation": INC, "version": PROTOCOL_VERSION,
        "capabilities": 7, "max_message_bytes": 1024, "t_echo": PeerTime(A_EPOCH), "t_recv": PeerTime(P_EPOCH),
        "t_send": PeerTime(P_EPOCH),
    }
    fields.update(reply_kw)
    (rej,) = acc.handshake_reply(_a(1), HandshakeReply(**fields))  # type: ignore[arg-type]
    assert isinstance(rej, Rejected) and why in rej.reason and not acc.is_connected(PIN)


def test_handshake_with_new_incarnation_loses_old_leases() -> None:
    w = Wire()
    w.connect("a")
    w.heartbeat()
    restarted = Pinner(CFG, PIN, INC + 1)
    hs = Handshake("decode-0", 0, 1, PROTOCOL_VERSION, 7, _a(1))
    w.t = 1
    out = w.acc.handshake_reply(_a(1), restarted.handshake_reply(_p(1), hs))
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
    assert isinstance(send.message, Heartbeat)  # type: ignore[union-attr]
    hb = send.message  # type: ignore[union-attr]
    restarted = Pinner(CFG, PIN, INC + 1)
    (ack,) = restarted.receive(_p(0), hb)
    out = w.acc.receive(_a(0.01), ack.message)  # type: ignore[union-attr]
    assert out == (LeaseLost("a", 1, LostReason.PINNER_RESTARTED),)
    assert not w.acc.is_connected(PIN)


# -- acks in every tracked state ---------------------------------------------------------------


def _ack_for(w: Wire, lid: int, field: str) -> HeartbeatAck:
    nd = w.acc.next_deadline()
    assert nd is not None
    w.t = max(w.t, nd - A_EPOCH)
    (send,) = w.acc.handle_timeout(_a(w.t))
    assert isinstance(send, Send) and isinstance(send.message, Heartbeat)
    hb = send.message
    kwargs = {"unknown": (), "expired": (), "released": (), "completed": ()}
    kwargs[field] = (lid,)
    return HeartbeatAck(PIN, 0, INC, hb.seq, PeerTime(hb.t_send), _p(w.t), 0, **kwargs)  # type: ignore[arg-type]


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
    if state == "confirming":
        out = w.acc.access_finished(_a(0), "k")  # never acknowledged: must be confirmed
        assert isinstance(out[0], Send) and out[0].message.confirm  # type: ignore[union-attr]
        assert w.acc.state_of("k") is TrackedState.CONFIRMING
    ack = _ack_for(w, tk.lease_id, field)
    out = w.acc.receive(_a(0.01), ack)
    if state == "waiting":
        assert out == (LeaseLost("k", tk.lease_id, ACK_REASON[field]),) and w.acc.state_of("k") is None
    elif state == "accessing" and field == "completed":
        # Our own attached access-done (after our part landed) completed it on this pinner
        # rank; the access in flight decides, and is still covered by validity.
        assert out == () and w.acc.state_of("k") is TrackedState.ACCESSING
        fin = w.acc.access_finished(_a(0.02), "k", notified=True)
        assert not any(isinstance(o, AccessStale) for o in fin)
    elif state == "accessing":
        assert out == (LeaseLost("k", tk.lease_id, ACK_REASON[field]),)
        assert w.acc.state_of("k") is TrackedState.LOST
        fin = w.acc.access_finished(_a(0.02), "k")
        assert isinstance(fin[-1], AccessStale) and w.acc.state_of("k") is None
    else:
        assert out == ()  # the pinner's access-done verdict decides
        assert w.acc.state_of("k") is TrackedState.CONFIRMING
    assert w.acc.receive(_a(0.03), ack) == ()  # a duplicate ack carries nothing


def test_acks_that_cannot_be_trusted_are_ignored_or_rejected() -> None:
    w = Wire()
    w.connect("k")
    (send,) = w.acc.handle_timeout(_a(0))
    hb = send.message  # type: ignore[union-attr]
    assert isinstance(hb, Heartbeat)
    good = HeartbeatAck(PIN, 0, INC, hb.seq, PeerTime(hb.t_send), _p(0), 1)
    forged = HeartbeatAck(PIN, 0, INC, hb.seq, PeerTime(hb.t_send - 1), _p(0), 1)
    unknown_seq = HeartbeatAck(PIN, 0, INC, hb.seq + 5, PeerTime(hb.t_send), _p(0), 1)
    assert w.acc.receive(_a(0), forged) == () and w.acc.receive(_a(0), unknown_seq) == ()
    assert w.acc.valid_until("k") is None
    (rej,) = w.acc.receive(_a(0), HeartbeatAck(PIN, 3, INC, hb.seq, PeerTime(hb.t_send), _p(0), 1))
    assert isinstance(rej, Rejected) and "rank 3" in rej.reason
    (rej,) = w.acc.receive(_a(0), HeartbeatAck("stranger", 0, INC, 1, PeerTime(0), _p(0), 1))
    assert isinstance(rej, Rejected)
    assert w.acc.receive(_a(0), good) == () and w.acc.valid_until("k") is not None


@pytest.mark.parametrize(
    "msg",
    [
        Heartbeat(PIN, 0, INC, 1, LocalTime(0), ()),
        AccessDone(PIN, 0, INC, 1, 1, False, LocalTime(0)),
        Release(PIN, 0, INC, (1,)),
        Handshake(PIN, 0, 1, 1, 0, LocalTime(0)),
    ],
)
def test_messages_for_the_other_side_are_rejected(msg: object) -> None:
    acc = Accessor(CFG, "decode-0")
    (rej,) = acc.receive(_a(0), msg)  # type: ignore[arg-type]
    assert isinstance(rej, Rejected) and type(msg).__name__ in rej.reason


# -- access decisions, completion, confirmation ------------------------------------------------


def test_pull_access_inside_the_window_completes_without_asking() -> None:
    w = Wire()
    tk = w.connect()
    w.heartbeat()
    w.t = 1.0
    d = w.acc.begin_access(_a(1.0), "k")
    assert d.allowed and d.guaranteed and d.valid_until == w.acc.valid_until("k")
    assert not w.acc.begin_access(_a(1.0), "k").allowed  # already accessing
    out = w.acc.access_finished(_a(1.2), "k")
    assert out == (
        Send(PIN, 0, AccessDone("decode-0", 0, INC, tk.lease_id, 1, False, _a(1.2))),
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
    ack = AccessDoneAck(PIN, 0, INC, tk.lease_id, outcome)
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
    w = Wire()
    tk = w.connect()
    w.heartbeat()
    w.acc.begin_access(_a(0.1), "k")
    assert w.acc.access_failed(_a(0.2), "k") == () and w.acc.state_of("k") is TrackedState.WAITING
    w.acc.begin_access(_a(0.3), "k")
    w.t = 0.3
    ack = _ack_for(w, tk.lease_id, "expired")
    w.acc.receive(_a(w.t), ack)
    assert w.acc.state_of("k") is TrackedState.LOST
    assert w.acc.access_failed(_a(w.t), "k") == () and w.acc.state_of("k") is None


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
    assert w.acc.access_failed(v, "k") == ()
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
    acc = Accessor(CFG, "decode-0")
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
    assert w.acc.untrack(_a(0.1), "a") == (Send(PIN, 0, Release("decode-0", 0, INC, (tk.lease_id,), 1)),)
    assert w.acc.untrack(_a(0.1), "a") == ()  # unknown key: harmless
    w.acc.begin_access(_a(0.2), "b")
    with pytest.raises(LocalProtocolError, match="in flight"):
        w.acc.untrack(_a(0.2), "b")
    assert w.acc.disconnect(_a(0.3), PIN) == (LeaseLost("b", 2, LostReason.UNREACHABLE),)
    assert w.acc.disconnect(_a(0.3), PIN) == ()
    assert w.acc.state_of("b") is TrackedState.LOST


# -- misuse ------------------------------------------------------------------------------------


def test_accessor_misuse() -> None:
    acc = Accessor(CFG, "decode-0")
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
    for call in (
        lambda: acc.handle_timeout(_a(0.5)),
        lambda: acc.begin_access(_a(0.5), "k"),
        lambda: acc.track(_a(0.5), "x", LeaseTicket(PIN, INC, 9)),
        lambda: acc.handle_timeout(LocalTime(float("nan"))),
    ):
        with pytest.raises(LocalProtocolError, match="backwards"):
            call()
    for args in ({"rank": 1, "ranks": 1}, {"ranks": 0}, {"ranks": (1 << 16) + 1}):
        with pytest.raises(LocalProtocolError):
            Accessor(CFG, "d", **args)
    with pytest.raises(LocalProtocolError):
        Accessor(CFG, "")


# -- heterogeneous TP --------------------------------------------------------------------------


@pytest.mark.parametrize(("p_ranks", "a_ranks"), [(1, 1), (2, 1), (4, 2), (8, 2), (1, 2), (2, 4), (1, 4)])
def test_heterogeneous_tp_frees_only_when_every_expected_rank_reported(p_ranks: int, a_ranks: int) -> None:
    pinners = [Pinner(CFG, PIN, INC, rank=r, ranks=p_ranks) for r in range(p_ranks)]
    accs = [Accessor(CFG, "decode-0", rank=r, ranks=a_ranks) for r in range(a_ranks)]
    tickets = [p.grant(_p(0), "k", lease_id=77) for p in pinners]
    assert all(tk.ranks == p_ranks for tk in tickets)
    frees: dict[int, list[Free]] = {r: [] for r in range(p_ranks)}
    completed: list[int] = []

    def to_pinner(send: Send, t: float, src: int) -> None:
        ranks = range(p_ranks) if send.rank is None else [send.rank]
        for r in ranks:
            for o in pinners[r].receive(_p(t), send.message):
                if isinstance(o, Free):
                    frees[r].append(o)
                elif isinstance(o, Send):
                    assert o.rank == src
                    for ev in accs[src].receive(_a(t), o.message):
                        if isinstance(ev, AccessCompleted):
                            completed.append(src)
                        assert not isinstance(ev, LeaseLost | AccessStale | Rejected), ev

    for r, acc in enumerate(accs):
        (hs,) = acc.track(_a(0), "k", tickets[0])
        assert isinstance(hs, HandshakeNeeded)
        acc.handshake_reply(_a(0), pinners[0].handshake_reply(_p(0), hs.message))  # type: ignore[arg-type]
        for o in acc.handle_timeout(_a(0)):
            assert isinstance(o, Send) and o.rank is None  # heartbeats go to every pinner worker
            to_pinner(o, 0, r)
        assert acc.valid_until("k") is not None  # validity needs every pinner rank's ack

    targets: dict[int, set[int]] = {}
    for r, acc in enumerate(accs[:-1] if a_ranks > 1 else accs):
        assert acc.begin_access(_a(0.1), "k").guaranteed
        out = acc.access_finished(_a(0.2), "k")
        completed.extend(r for o in out if isinstance(o, AccessCompleted))
        sends = [o for o in out if isinstance(o, Send)]
        targets[r] = {s.rank for s in sends}  # type: ignore[misc]
        expected = {s.message.expected for s in sends}  # type: ignore[union-attr]
        assert expected == {max(1, a_ranks // p_ranks)}
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
        for s in out:
            if isinstance(s, Send):
                to_pinner(s, 0.3, last)
    assert all(len(frees[r]) == 1 and frees[r][0].reason is EndReason.ACCESS_DONE for r in range(p_ranks))
    assert sorted(completed) == list(range(a_ranks))


# -- heartbeat splitting -----------------------------------------------------------------------


@pytest.mark.parametrize("max_bytes", [128, 256, 1024])
def test_heartbeats_split_under_the_size_bound_with_10k_leases(max_bytes: int) -> None:
    cfg = CFG.with_changes(max_message_bytes=max_bytes)
    pinner = Pinner(cfg, PIN, INC)
    acc = Accessor(cfg, "decode-0")
    rng = random.Random(max_bytes)
    ids = sorted(rng.sample(range(1, 2**40), 10_000))
    for i, lid in enumerate(ids):
        tk = pinner.grant(_p(0), f"k{i}", lease_id=lid)
        acc.track(_a(0), f"k{i}", tk)
    (hs,) = acc.handle_timeout(_a(CFG.heartbeat_interval))
    acc.handshake_reply(_a(1), pinner.handshake_reply(_p(1), hs.message))  # type: ignore[union-attr]
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
    cfg = CFG.with_changes(max_message_bytes=128)
    with pytest.raises(ConfigError, match="max_message_bytes"):
        Accessor(cfg, "decode-" + "x" * 80)
    with pytest.raises(ConfigError, match="max_message_bytes"):
        Pinner(cfg, "prefill-" + "x" * 40, INC)


def test_long_engine_id_under_the_smallest_message_bound() -> None:
    """A 40-byte engine id still leaves room for ids in a 128-byte heartbeat: every message
    stays under the bound (it used to raise EncodeError from handle_timeout)."""
    cfg = CFG.with_changes(max_message_bytes=128)
    pinner = Pinner(cfg, PIN, INC)
    acc = Accessor(cfg, "decode-with-a-rather-long-engine-name-0")
    tk = pinner.grant(_p(0), "k")
    (hs,) = acc.track(_a(0), "k", tk)
    acc.handshake_reply(_a(0), pinner.handshake_reply(_p(0), hs.message))  # type: ignore[union-attr]
    for o in acc.handle_timeout(_a(0)):
        assert isinstance(o, Send) and len(encode(o.message)) <= 128


def test_outstanding_heartbeats_are_bounded() -> None:
    cfg = CFG.with_changes(max_outstanding_heartbeats=2)
    w = Wire(cfg)
    w.connect()
    sends = []
    for i in range(4):
        w.t = i * cfg.heartbeat_interval
        (s,) = w.acc.handle_timeout(_a(w.t))
        sends.append(s.message)  # type: ignore[union-attr]
    # The oldest rounds were forgotten: their acks carry nothing.
    old = sends[0]
    assert isinstance(old, Heartbeat)
    w.acc.receive(_a(w.t), HeartbeatAck(PIN, 0, INC, old.seq, PeerTime(old.t_send), _p(w.t), 1))
    assert w.acc.valid_until("k") is None
    new = sends[-1]
    assert isinstance(new, Heartbeat)
    w.acc.receive(_a(w.t), HeartbeatAck(PIN, 0, INC, new.seq, PeerTime(new.t_send), _p(w.t), 1))
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
    cfg = LeaseConfig(kv_lease_duration=3.0, max_drift_rate=drift, validity_margin=0.0, decoder_kv_blocks_ttl=ttl)
    rng = random.Random(seed)
    prof = LinkProfile(0.0, 0.3, drop=0.3, duplicate=0.2) if lossy else LinkProfile(0.0, 0.05)
    pair = Pair(
        cfg, rng, pinner_clock=PeerClock.random(rng, drift), accessor_clock=PeerClock.random(rng, drift),
        to_pinner=prof, to_accessor=prof,
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


def test_fixed_ttl_lease_is_valid_from_the_handshake_and_lapses_at_the_deadline() -> None:
    w = Wire()
    tk = w.connect("f", kind=LeaseKind.FIXED_TTL)
    v = w.acc.valid_until("f")
    assert v is not None and v <= A_EPOCH + CFG.decoder_kv_blocks_ttl
    assert v == pytest.approx(A_EPOCH + CFG.decoder_kv_blocks_ttl - CFG.validity_margin, abs=0.1)
    w.heartbeat()
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
    assert w.acc.untrack(_a(w.t), "k") == ()


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
    assert w.acc.begin_access(_a(1.0), "f").guaranteed
    out = w.acc.access_finished(_a(1.5), "f")
    assert out[-1] == AccessCompleted("f", tk.lease_id, confirmed_by_pinner=False)
    est = w.acc.clock_estimator(PIN)
    assert est is not None and est.sample_count >= 1
    assert w.acc.clock_estimator("nobody") is None


def test_proactive_handshake_and_replies_from_other_ranks() -> None:
    acc = Accessor(CFG, "decode-0")
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
    acc = Accessor(CFG, "decode-0")
    tks = [p.grant(_p(0), "k", lease_id=5) for p in pinners]
    (hs,) = acc.track(_a(0), "k", tks[0])
    acc.handshake_reply(_a(0), pinners[0].handshake_reply(_p(0), hs.message))  # type: ignore[union-attr]
    acc.begin_access(_a(0), "k")  # never acknowledged: the access must be confirmed
    sends = [o for o in acc.access_finished(_a(0.1), "k") if isinstance(o, Send)]
    assert sorted(s.rank for s in sends) == [0, 1]  # type: ignore[type-var]
    acks = [pinners[s.rank].receive(_p(0.1), s.message)[-1] for s in sends]  # type: ignore[index]
    assert acc.receive(_a(0.2), acks[0].message) == ()  # type: ignore[union-attr]
    (done,) = acc.receive(_a(0.2), acks[1].message)  # type: ignore[union-attr]
    assert done == AccessCompleted("k", 5, confirmed_by_pinner=True)


def test_restart_seen_in_an_ack_spares_leases_of_the_new_incarnation() -> None:
    w = Wire()
    w.connect("old")
    (send,) = w.acc.handle_timeout(_a(0))
    hb = send.message  # type: ignore[union-attr]
    assert isinstance(hb, Heartbeat)
    # A ticket of the new incarnation arrives before the ack that reveals the restart.
    w.acc.track(_a(0.05), "new", LeaseTicket(PIN, INC + 1, 1))
    ack = HeartbeatAck(PIN, 0, INC + 1, hb.seq, PeerTime(hb.t_send), _p(0.05), 0, unknown=(1,))
    assert w.acc.receive(_a(0.1), ack) == (LeaseLost("old", 1, LostReason.PINNER_RESTARTED),)
    assert w.acc.state_of("new") is TrackedState.WAITING


def test_acks_stay_under_the_size_bound_when_the_pinner_id_is_longer() -> None:
    """The accessor sizes heartbeat chunks for its own engine id; the pinner's ack carries the
    pinner's id and splits the ids into four lists (each opening with an absolute id)."""
    cfg = CFG.with_changes(max_message_bytes=128, tombstone_limit=1000)
    pinner = Pinner(cfg, "prefill-" + "x" * 20, 2**63)
    acc = Accessor(cfg, "decode-0")
    base = 2**40
    tks = [pinner.grant(_p(0), f"k{i}", lease_id=base + 1 + i) for i in range(40)]
    for i, tk in enumerate(tks):
        acc.track(_a(0), f"k{i}", tk)
        if i % 4 == 1:
            pinner.release(_p(1), tk.lease_id)
        elif i % 4 == 2:
            pinner.receive(_p(1), AccessDone("decode-0", 0, 2**63, tk.lease_id, 1, False, _a(0)))
    (hs,) = acc.handle_timeout(_a(CFG.heartbeat_interval))
    acc.handshake_reply(_a(1), pinner.handshake_reply(_p(1), hs.message))  # type: ignore[union-attr]
    for o in acc.handle_timeout(_a(1)):
        assert isinstance(o, Send) and len(encode(o.message)) <= 128
        for reply in pinner.receive(_p(2), o.message):
            assert isinstance(reply, Send)
            assert len(encode(reply.message)) <= 128


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
    acks = [r for r in replies if isinstance(r, Send) and isinstance(r.message, AccessDoneAck)]
    assert len(acks) == 1 and acks[0].message.outcome is AccessOutcome.OK  # type: ignore[union-attr]
    early = AccessDoneAck(PIN, 0, INC, tk.lease_id, outcome)
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
