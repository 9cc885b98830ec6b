"""Vectors of heartbeats and their acks: whom they count for, and how big they may grow.

    heartbeat_batching, ack_binding, bounds, ack_bound, lease_binding, rounds_bound, early_heartbeat

Spec rules (spec/PROTOCOL.md): the size bounds and the heartbeat split rule, and an ack that
could exceed the pinner's bound Rejected (v3) (§4.3); a lease renewed only by the accessor engine,
rank and session bound to it, and a replayed heartbeat extending nothing (§5.5); an ack counting
only for the heartbeat it answers (rank, session, seq, echoed send time, ids accounted for)
(§5.6); pinner tombstones and the accessor's outstanding rounds bounded, counted in rounds, not
chunks (§2, §5.4); a heartbeat naming a lease not granted yet held until it is, or for one
heartbeat interval (§5.5 step 0). `ack_bound` and `lease_binding` are bound by tools/mutation_check.py.
"""

from __future__ import annotations

from kvlease import MIN_MESSAGE_BYTES, AccessDone, AccessOutcome, Heartbeat, HeartbeatAck, LocalTime, decode, encode

from ._common import BASE, Recorder, accessor, connect, forged, heartbeat_round, only, outs, pinner

__all__ = [
    "ack_binding",
    "ack_bound",
    "bounds",
    "early_heartbeat",
    "heartbeat_batching",
    "lease_binding",
    "rounds_bound",
]


def heartbeat_batching() -> Recorder:
    cfg = BASE.with_changes(max_message_bytes=192)
    r = Recorder(
        "heartbeat_batching",
        "60 leases on one pinner with a 192-byte message bound "
        "(a small-notification backend): the accessor splits its heartbeat by the exact "
        "rule of spec §4.3 (budget = 192 - max(52 + 8, 125 + 9) = 58 bytes; each chunk "
        "costs 5 + size(first id) + the sizes of every other id's distance from the "
        "first), so every heartbeat and every ack answering it stays within the bound.",
        cfg,
        {"P": pinner("prefill-0", 0x5EED000C), "D": accessor("decode-0")},
        {"P": 300.0, "D": 4000.0},
    )
    tickets = []
    lid = 0
    for i in range(60):
        # Gaps of 1, 300, 1000 and 70000 exercise one-, three- and five-byte distances (ids only
        # increase on one pinner incarnation).
        lid += (1, 1, 300, 1, 1, 1000, 1, 70000)[i % 8]
        tickets.append(r.at(0.0).step("P", "grant", key=f"req-{i}", lease_id=lid)["result"])
    hs = only(r.at(0.0).step("D", "track", key="req-0", ticket=tickets[0]), "HandshakeNeeded")
    for i, tk in enumerate(tickets[1:], 1):
        r.at(0.0).step("D", "track", key=f"req-{i}", ticket=tk)
    connect(r, "D", "P", hs, 0.25)
    hb = r.at(0.375).step("D", "handle_timeout")
    sends = outs(hb, "Send")
    assert len(sends) >= 2 and all(len(s["hex"]) // 2 <= 192 for s in sends), [len(s["hex"]) for s in sends]
    acks = [only(r.at(0.5).deliver("P", s), "Send") for s in sends]
    assert all(len(a["hex"]) // 2 <= 192 for a in acks)
    assert sum(a["message"]["renewed"] for a in acks) == 60
    for ack in acks:
        assert r.at(0.625).deliver("D", ack)["outputs"] == []
    return r


def ack_binding() -> Recorder:
    r = Recorder(
        "ack_binding",
        "A heartbeat ack counts only for the heartbeat it answers: the "
        "accessor's rank and session, a seq that never repeats within a session (not even "
        "after disconnect), the echoed send time, and ids that account exactly for the "
        "heartbeat's. An ack from before a disconnect, an ack meant for a sibling rank (whose "
        "clock reads the same, or which shares the session), one echoing another send time, and an "
        "ack whose lists contradict its heartbeat all confer nothing.",
        BASE,
        {
            "P": pinner("prefill-0", 0x5EED0104, 0, 1),
            "D0": accessor("decode-0", 0, 2, 0xD0),
            "D1": accessor("decode-0", 1, 2, 0xD1),
        },
        {"P": 800.0, "D0": 60000.0, "D1": 60000.0},
    )
    t1 = r.at(0.0).step("P", "grant", key="req-1")["result"]
    hs = only(r.at(0.0).step("D0", "track", key="k1", ticket=t1), "HandshakeNeeded")
    connect(r, "D0", "P", hs, 0.25)
    hb = outs(r.at(0.375).step("D0", "handle_timeout"), "Send")[0]
    old_ack = only(r.at(0.5).deliver("P", hb), "Send")
    lost = only(r.at(0.6).step("D0", "disconnect", engine_id="prefill-0"), "LeaseLost")
    assert lost["reason"] == "unreachable"
    t2 = r.at(0.7).step("P", "grant", key="req-2")["result"]
    hs = only(r.at(0.7).step("D0", "track", key="k2", ticket=t2), "HandshakeNeeded")
    connect(r, "D0", "P", hs, 0.8)
    hb2 = outs(r.at(0.925).step("D0", "handle_timeout"), "Send")[0]
    assert hb2["message"]["seq"] > hb["message"]["seq"], "seq continues across the disconnect"
    ack2 = only(r.at(1.0).deliver("P", hb2), "Send")
    assert r.at(1.0).deliver("D0", old_ack, "the ack from before the disconnect")["outputs"] == []
    assert r.at(1.0).step("D0", "begin_access", key="k2")["result"]["guaranteed"] is False
    r.at(1.0).step("D0", "access_failed", key="k2", posted=False)
    # The sibling rank sends a heartbeat at the same clock reading; its ack reaches D0.
    t3 = r.at(1.0).step("P", "grant", key="req-3")["result"]
    hs1 = only(r.at(1.0).step("D1", "track", key="k3", ticket=t3), "HandshakeNeeded")
    connect(r, "D1", "P", hs1, 1.0)
    hb1 = outs(r.at(1.125).step("D1", "handle_timeout"), "Send")[0]
    ack1 = only(r.at(1.25).deliver("P", hb1), "Send")
    assert only(r.at(1.375).deliver("D0", ack1, "the sibling's ack"), "Rejected")
    # D0's own round: the ack is tampered with to claim a renewal it does not account for.
    bad = forged(ack2["hex"], renewed=0)
    assert only(r.at(1.375).step("D0", "receive", hex=bad, note="renewed + listed != ids in the heartbeat"), "Rejected")
    to_rank_1 = forged(ack2["hex"], to_rank=1)
    note = "addressed to rank 1 (the session is D0's own)"
    assert only(r.at(1.375).step("D0", "receive", hex=to_rank_1, note=note), "Rejected")
    genuine = decode(bytes.fromhex(ack2["hex"]))
    assert isinstance(genuine, HeartbeatAck)
    echo = forged(ack2["hex"], t_echo=LocalTime(genuine.t_echo + 0.5))
    note = "echoes a send time its heartbeat did not have"
    assert r.at(1.375).step("D0", "receive", hex=echo, note=note)["outputs"] == []
    dec = r.at(1.375).step("D0", "begin_access", key="k2", note="neither confers anything")["result"]
    assert not dec["guaranteed"] and dec["valid_until"] is None
    r.at(1.375).step("D0", "access_failed", key="k2", posted=False)
    assert r.at(1.4).deliver("D0", ack2)["outputs"] == []
    dec = r.at(1.5).step("D0", "begin_access", key="k2")["result"]
    assert dec["guaranteed"], "the genuine ack still counts"
    return r


def bounds() -> Recorder:
    cfg = BASE.with_changes(tombstone_limit=2, max_outstanding_heartbeats=2)
    r = Recorder(
        "bounds",
        "Everything is bounded. The pinner remembers tombstone_limit (2) ended "
        "leases: a late heartbeat for an older one is answered 'unknown' instead of "
        "'completed'. The accessor remembers max_outstanding_heartbeats (2) unanswered "
        "rounds per engine: the ack of a forgotten round confers nothing. A grant may fix "
        "`expected`; an accessor layout that disagrees is Rejected.",
        cfg,
        {"P": pinner("prefill-0", 0x5EED0107), "D": accessor("decode-0")},
        {"P": 4321.0, "D": 1234.0},
    )
    tickets = [r.at(0.0).step("P", "grant", key=f"req-{i}")["result"] for i in range(1, 4)]
    hs = only(r.at(0.0).step("D", "track", key="k1", ticket=tickets[0]), "HandshakeNeeded")
    connect(r, "D", "P", hs, 0.25)
    heartbeat_round(r, "D", ["P"], 0.375)
    dec = r.at(0.875).step("D", "begin_access", key="k1")["result"]
    fin = r.at(0.9).step("D", "access_finished", key="k1")
    only(r.at(1.0).deliver("P", outs(fin, "Send")[0]), "Free")
    assert dec["guaranteed"]
    for lid in (2, 3):
        done = AccessDone("decode-9", 0, 1, 9, 0x5EED0107, 0, lid, 1, False, LocalTime(1.0))
        only(r.at(1.0).step("P", "receive", hex=encode(done).hex(), note="another accessor completes it"), "Free")
    late = Heartbeat("decode-0", 0, 1, 0xACCE55, 0x5EED0107, 99, LocalTime(1235.0), (1, 2, 3))
    ack = only(r.at(1.25).step("P", "receive", hex=encode(late).hex(), note="lease 1's tombstone was evicted"), "Send")
    assert ack["message"]["unknown"] == [1] and ack["message"]["completed"] == [2, 3]
    t4 = r.at(1.5).step("P", "grant", key="req-4")["result"]
    r.at(1.5).step("D", "track", key="k4", ticket=t4)
    sends = []
    for t in (1.5, 2.5, 3.5):
        sends += outs(r.at(t).step("D", "handle_timeout"), "Send")
    assert len(sends) == 3
    first_ack = only(r.at(3.625).deliver("P", sends[0]), "Send")
    assert r.at(3.75).deliver("D", first_ack, "its round was forgotten (bound 2)")["outputs"] == []
    assert r.at(3.75).step("D", "begin_access", key="k4")["result"]["valid_until"] is None
    r.at(3.75).step("D", "access_failed", key="k4", posted=False)
    t5 = r.at(4.0).step("P", "grant", key="req-5", expected=2)["result"]
    one = AccessDone("decode-0", 0, 1, 0xACCE55, 0x5EED0107, 0, int(t5["lease_id"]), 1, False, LocalTime(1238.0))
    assert only(r.at(4.0).step("P", "receive", hex=encode(one).hex(), note="granted for 2 accessor ranks"), "Rejected")
    return r


def ack_bound() -> Recorder:
    small = {"max_message_bytes": MIN_MESSAGE_BYTES}
    r = Recorder(
        "ack_bound",
        "Every reply a pinner makes fits its max_message_bytes by construction: a heartbeat "
        "whose ack could exceed the bound (ids far apart, each a 9-byte delta in one of the "
        "ack's lists) is Rejected with no ack. An honest accessor never sends one: it splits "
        "by the id budget of both bounds (the pinner's from the handshake reply).",
        BASE.with_changes(**small),
        {"P": pinner("prefill-0", 0x5EED0304), "D": accessor("decode-0", session=0xD3)},
        {"P": 1.0, "D": 2.0},
    )
    r.at(0.0).step("P", "grant", key="req-1")
    wide = tuple(1 + i * 2**40 for i in range(15))
    hb = Heartbeat("decode-0", 0, 1, 0xD3, 0x5EED0304, 1, LocalTime(2.0), wide)
    assert len(encode(hb)) <= MIN_MESSAGE_BYTES
    rej = r.at(0.25).step("P", "receive", hex=encode(hb).hex(), note="15 ids 2**40 apart")
    assert only(rej, "Rejected")
    near = Heartbeat("decode-0", 0, 1, 0xD3, 0x5EED0304, 2, LocalTime(2.5), (1,))
    ack = only(r.at(0.5).step("P", "receive", hex=encode(near).hex()), "Send")
    assert len(bytes.fromhex(ack["hex"])) <= MIN_MESSAGE_BYTES
    return r


def lease_binding() -> Recorder:
    r = Recorder(
        "lease_binding",
        "A lease speaks for the accessor bound to it (engine, and per rank its session): another "
        "engine's heartbeat and one of another session of the same engine are not renewed "
        "('unknown' + Rejected); a replayed heartbeat (a seq no newer than one that extended the "
        "lease) is acknowledged but extends nothing, so the lease frees at the last fresh one + "
        "extension; a completed lease's tombstone answers OK only to the session it counted. A "
        "refused call changes nothing, not even the endpoint's latest now: later calls may read "
        "an earlier clock.",
        BASE,
        {"P": pinner("prefill-0", 0x5EED0401), "D": accessor("decode-0", session=0xD0)},
        {"P": 2500.0, "D": 610.0},
    )
    t1 = r.at(0.0).step("P", "grant", key="req-1")["result"]
    t2 = r.at(0.0).step("P", "grant", key="req-2")["result"]
    note = "refused (never issued) at a later clock reading"
    assert r.step("P", "release", note, clock=r.local("P", 0.5), lease_id=99)["error"]["class"] == "LocalProtocolError"
    hs = only(r.at(0.0).step("D", "track", key="req-1", ticket=t1), "HandshakeNeeded")
    r.at(0.0).step("D", "track", key="req-2", ticket=t2)
    note = "refused (tracked twice) at a later clock reading"
    twice = r.step("D", "track", note, clock=r.local("D", 0.5), key="req-1", ticket=t1)
    assert twice["error"]["class"] == "LocalProtocolError"
    connect(r, "D", "P", hs, 0.25)
    first = outs(r.at(0.5).step("D", "handle_timeout"), "Send")[0]
    ack = only(r.at(0.75).deliver("P", first, "binds both leases to decode-0, rank 0, session 0xD0"), "Send")
    r.at(1.0).deliver("D", ack)
    other = Heartbeat("decode-1", 0, 1, 0xE1, 0x5EED0401, 1, LocalTime(33001.0), (1, 2))
    res = r.at(1.0).step("P", "receive", hex=encode(other).hex(), note="another accessor engine")
    assert [o["type"] for o in res["outputs"]] == ["Rejected", "Send"]
    assert res["outputs"][1]["message"]["unknown"] == [1, 2]
    restarted = Heartbeat("decode-0", 0, 1, 0xD9, 0x5EED0401, 1, LocalTime(611.0), (1, 2))
    res = r.at(1.0).step("P", "receive", hex=encode(restarted).hex(), note="decode-0 rank 0, another session")
    assert [o["type"] for o in res["outputs"]] == ["Rejected", "Send"]
    assert res["outputs"][1]["message"]["unknown"] == [1, 2]
    heartbeat_round(r, "D", ["P"], 1.5)
    heartbeat_round(r, "D", ["P"], 2.5)  # handled at 2.75: req-1 expires at 6.75
    dec = r.at(3.0).step("D", "begin_access", key="req-2")["result"]
    assert dec["guaranteed"]
    fin = r.at(3.0).step("D", "access_finished", key="req-2")
    assert only(r.at(3.25).deliver("P", outs(fin, "Send")[0]), "Free")["reason"] == "access_done"
    dup = AccessDone("decode-0", 0, 1, 0xD0, 0x5EED0401, 0, 2, 77, True, LocalTime(613.5))
    res = r.at(3.5).step("P", "receive", hex=encode(dup).hex(), note="the counted session asks again: OK")
    assert only(res, "Send")["message"]["outcome"] == int(AccessOutcome.OK)
    alien = AccessDone("decode-0", 0, 1, 0xD9, 0x5EED0401, 0, 2, 5, True, LocalTime(613.5))
    res = r.at(3.5).step("P", "receive", hex=encode(alien).hex(), note="another session of decode-0 asks: STALE")
    assert only(res, "Send")["message"]["outcome"] == int(AccessOutcome.STALE)
    replay = only(r.at(5.0).deliver("P", first, "the first heartbeat, replayed"), "Send")
    assert replay["message"]["renewed"] == 1 and replay["message"]["completed"] == [2]
    assert r.at(6.625).step("P", "handle_timeout")["outputs"] == []
    free = only(r.at(6.75).step("P", "handle_timeout", note="the last fresh heartbeat (2.75) + 4 s"), "Free")
    assert free["key"] == "req-1" and free["reason"] == "expired"
    return r


def rounds_bound() -> Recorder:
    cfg = BASE.with_changes(max_message_bytes=192, max_outstanding_heartbeats=2)
    r = Recorder(
        "rounds_bound",
        "max_outstanding_heartbeats (2) counts heartbeat rounds, not chunks: a round of 20 ids "
        "split into 2+ chunks is still outstanding (one round) when the next periodic round is "
        "sent, so its late acks still validate the leases.",
        cfg,
        {"P": pinner("prefill-0", 0x5EED0408), "D": accessor("decode-0")},
        {"P": 10.0, "D": 20.0},
    )
    tickets = [r.at(0.0).step("P", "grant", key=f"req-{i}", lease_id=1 + i * 2**20)["result"] for i in range(20)]
    hs = only(r.at(0.0).step("D", "track", key="req-0", ticket=tickets[0]), "HandshakeNeeded")
    for i, tk in enumerate(tickets[1:], 1):
        r.at(0.0).step("D", "track", key=f"req-{i}", ticket=tk)
    connect(r, "D", "P", hs, 0.125)
    sends = outs(r.at(0.375).step("D", "handle_timeout"), "Send")
    assert len(sends) >= 2
    acks = [only(r.at(0.5).deliver("P", s), "Send") for s in sends]
    nxt = r.at(1.375).step("D", "handle_timeout", note="the next round; the first one's acks are late")
    assert len(outs(nxt, "Send")) >= 2
    for a in acks:
        assert r.at(1.5).deliver("D", a)["outputs"] == []
    dec = r.at(1.625).step("D", "begin_access", key="req-0")["result"]
    assert dec["guaranteed"] and abs(dec["valid_until"] - r.local("D", 0.375) - cfg.accessor_extension) < 1e-9
    return r


def early_heartbeat() -> Recorder:
    r = Recorder(
        "early_heartbeat",
        "A heartbeat naming a lease id at or above the pinner's next id (its ticket went out "
        "before the grant reached this rank: vLLM publishes it a step early) is held, not "
        "answered 'unknown' (spec §5.5 step 0): answered at the first handle_timeout after every "
        "id it names is granted (renewed), or at receipt + heartbeat_interval with the ids "
        "still not granted 'unknown'.",
        BASE,
        {"P": pinner("prefill-0", 0x5EED0409), "D": accessor("decode-0")},
        {"P": 30.0, "D": 70.0},
    )
    t1 = r.at(0.0).step("P", "grant", key="req-1")["result"]
    hs = only(r.at(0.0).step("D", "track", key="k1", ticket=t1), "HandshakeNeeded")
    connect(r, "D", "P", hs, 0.125)
    early = {**t1, "lease_id": "2"}
    r.at(0.3).step("D", "track", key="k2", ticket=early, note="the ticket of lease 2, not granted yet")
    hb = outs(r.at(0.375).step("D", "handle_timeout"), "Send")
    assert len(hb) == 1 and hb[0]["message"]["lease_ids"] == [1, 2]
    held = r.at(0.5).deliver("P", hb[0], "names lease 2, at the next id: held, no ack")
    assert held["outputs"] == [] and r.next_work("P") == r.local("P", 1.5)
    assert r.at(0.75).step("P", "grant", key="req-2")["result"]["lease_id"] == "2"
    ack = only(r.at(0.75).step("P", "handle_timeout", note="lease 2 granted: the held heartbeat answered"), "Send")
    assert ack["message"]["renewed"] == 2 and ack["message"]["unknown"] == []
    assert r.at(0.875).deliver("D", ack)["outputs"] == []
    dec = r.at(1.0).step("D", "begin_access", key="k2")["result"]
    assert dec["guaranteed"]
    r.at(1.0).step("D", "access_finished", key="k2", notified=False)
    ghost = {**t1, "lease_id": "9"}
    r.at(1.0).step("D", "track", key="k9", ticket=ghost, note="lease 9: never granted in time")
    hb9 = outs(r.at(1.0).step("D", "handle_timeout"), "Send")
    assert len(hb9) == 1 and hb9[0]["message"]["lease_ids"] == [9]
    assert r.at(1.125).deliver("P", hb9[0], "held until receipt + heartbeat_interval")["outputs"] == []
    assert r.at(2.0).step("P", "handle_timeout")["outputs"] == []
    late = only(r.at(2.125).step("P", "handle_timeout", note="answer-by time: unknown"), "Send")
    assert late["message"]["unknown"] == [9] and late["message"]["renewed"] == 0
    lost = only(r.at(2.25).deliver("D", late), "LeaseLost")
    assert lost["key"] == "k9" and lost["reason"] == "unknown"
    return r
