"""Vectors of the handshake and of pinner incarnations (a restarted prefill engine).

    pinner_restart, handshake_binding, handshake_new_incarnation

Spec rules (spec/PROTOCOL.md): the side-channel handshake, repeated every interval while no reply
comes, and a reply counting only for the handshake it answers (rank, session, seq, send time)
(§5.3); a new incarnation losing the old one's leases (`pinner_restarted`), and old-incarnation
heartbeats and late replies changing nothing (§3, §5.5, §5.6).
"""

from __future__ import annotations

from ._common import BASE, Recorder, accessor, connect, heartbeat_round, only, outs, pinner

__all__ = ["handshake_binding", "handshake_new_incarnation", "pinner_restart"]


def pinner_restart() -> Recorder:
    r = Recorder(
        "pinner_restart",
        "The prefill engine restarts (new incarnation, lease ids "
        "start again at 1). The accessor's next heartbeat is answered by the new "
        "incarnation: it gives up req-1 (pinner_restarted) and re-handshakes. A delayed "
        "heartbeat of the old incarnation naming id 1 never renews the new lease 1.",
        BASE,
        {
            "P": pinner("prefill-0", 0x1111111111111111),
            "P2": pinner("prefill-0", 0x2222222222222222),
            "D": accessor("decode-0"),
        },
        {"P": 40000.0, "P2": 40000.0, "D": 2222.25},
    )
    t1 = r.at(0.0).step("P", "grant", key="req-1")["result"]
    hs = only(r.at(0.0).step("D", "track", key="req-1", ticket=t1), "HandshakeNeeded")
    connect(r, "D", "P", hs, 0.25)
    heartbeat_round(r, "D", ["P"], 0.375)
    old_hb = outs(r.at(1.375).step("D", "handle_timeout", note="P crashes before this arrives"), "Send")[0]
    # P2 is the restarted engine (same engine id, same clock, new incarnation).
    t2 = r.at(1.5).step("P2", "grant", key="req-2")["result"]
    assert int(t2["lease_id"]) == int(t1["lease_id"]) == 1
    ack = only(r.at(1.625).deliver("P2", old_hb, "an old-incarnation heartbeat reaches the new engine"), "Send")
    assert ack["message"]["unknown"] == [1] and ack["message"]["renewed"] == 0
    lost = only(r.at(1.875).deliver("D", ack), "LeaseLost")
    assert lost["reason"] == "pinner_restarted"
    hs2 = only(r.at(2.0).step("D", "track", key="req-2", ticket=t2), "HandshakeNeeded")
    connect(r, "D", "P2", hs2, 2.125)
    heartbeat_round(r, "D", ["P2"], 2.25)
    # The old heartbeat, duplicated and delayed, arrives again after req-2 was granted.
    again = only(r.at(2.875).deliver("P2", old_hb, "duplicate of the old heartbeat"), "Send")
    assert again["message"]["unknown"] == [1]
    dec = r.at(3.0).step("D", "begin_access", key="req-2")["result"]
    assert dec["allowed"] and dec["guaranteed"]
    assert r.at(6.0).step("P2", "handle_timeout")["outputs"] == []
    return r


def handshake_binding() -> Recorder:
    r = Recorder(
        "handshake_binding",
        "A handshake reply counts only for the handshake it answers "
        "(the accessor's rank, session, seq and send time). While no reply comes the "
        "accessor handshakes again every interval. A reply produced for another accessor "
        "(here one whose clock is 10 s ahead) is Rejected and gives no clock sample; a "
        "duplicate of an accepted reply does nothing. After the pinner restarts, the reply "
        "of the new incarnation loses the old incarnation's leases, and a late duplicate "
        "of the old incarnation's reply cannot bring them back.",
        BASE,
        {
            "P": pinner("prefill-0", 0x1111),
            "P2": pinner("prefill-0", 0x2222),
            "A": accessor("decode-0", session=0xA),
            "B": accessor("decode-1", session=0xB),
        },
        {"P": 500.0, "P2": 500.0, "A": 40000.0, "B": 40010.0},
    )
    t1 = r.at(0.0).step("P", "grant", key="req-1", kind=1)["result"]
    hs_a = only(r.at(0.0).step("A", "track", key="turn1", ticket=t1), "HandshakeNeeded")
    assert r.at(0.5).step("A", "handle_timeout")["outputs"] == []
    hs_a2 = only(
        r.at(1.0).step("A", "handle_timeout", note="no reply yet: handshake again every interval"), "HandshakeNeeded"
    )
    assert hs_a2["hex"] != hs_a["hex"]
    t1b = r.at(1.0).step("P", "grant", key="req-b")["result"]
    hs_b = only(r.at(1.0).step("B", "track", key="b", ticket=t1b), "HandshakeNeeded")
    reply_b = r.at(1.1).step("P", "handshake", hex=hs_b["hex"])["result"]["hex"]
    reply_a = r.at(1.1).step("P", "handshake", hex=hs_a["hex"])["result"]["hex"]
    rej = r.at(1.2).step("A", "handshake_reply", hex=reply_b, note="B's reply delivered to A")
    assert only(rej, "Rejected")
    dec = r.at(1.2).step("A", "begin_access", key="turn1")["result"]
    assert not dec["allowed"], "no connection, no clock sample from B's reply"
    assert r.at(1.3).step("A", "handshake_reply", hex=reply_a, note="the reply to A's first handshake")["outputs"] == []
    assert r.at(1.4).step("A", "handshake_reply", hex=reply_a, note="a duplicate")["outputs"] == []
    heartbeat_round(r, "A", ["P"], 1.45)
    dec = r.at(1.96).step("A", "begin_access", key="turn1")["result"]
    assert dec["allowed"] and dec["guaranteed"]
    r.at(1.96).step("A", "access_failed", key="turn1", posted=False)
    # P restarts as P2; A learns of a lease of the new incarnation.
    t2 = r.at(2.0).step("P2", "grant", key="req-2")["result"]
    hs3 = only(r.at(2.0).step("A", "track", key="new", ticket=t2), "HandshakeNeeded")
    reply2 = r.at(2.1).step("P2", "handshake", hex=hs3["hex"])["result"]["hex"]
    lost = only(r.at(2.2).step("A", "handshake_reply", hex=reply2), "LeaseLost")
    assert lost["key"] == "turn1" and lost["reason"] == "pinner_restarted"
    assert (
        r.at(2.3).step("A", "handshake_reply", hex=reply_a, note="the old incarnation's reply, late")["outputs"] == []
    )
    acks = heartbeat_round(r, "A", ["P2"], 2.5)
    assert all(a["outputs"] == [] for a in acks)
    assert r.at(3.25).step("A", "begin_access", key="new")["result"]["guaranteed"]
    return r


def handshake_new_incarnation() -> Recorder:
    r = Recorder(
        "handshake_new_incarnation",
        "The accessor tracks a ticket of incarnation 1 and handshakes; before the reply, the "
        "pinner restarts and a ticket of incarnation 2 is tracked: the outstanding handshake is "
        "forgotten and a new one is due at once, so the late reply of incarnation 1 counts "
        "nothing (it would have lost the new ticket as pinner_restarted); the new reply loses "
        "the old incarnation's lease.",
        BASE,
        {"P": pinner("prefill-0", 0x1001), "P2": pinner("prefill-0", 0x2002), "D": accessor("decode-0")},
        {"P": 150.0, "P2": 150.0, "D": 62000.0},
    )
    t1 = r.at(0.0).step("P", "grant", key="req-1")["result"]
    hs1 = only(r.at(0.0).step("D", "track", key="k1", ticket=t1), "HandshakeNeeded")
    old_reply = r.at(0.125).step("P", "handshake", hex=hs1["hex"])["result"]["hex"]
    t2 = r.at(0.25).step("P2", "grant", key="req-2")["result"]
    note = "a new incarnation: handshake again now"
    hs2 = only(r.at(0.375).step("D", "track", key="k2", ticket=t2, note=note), "HandshakeNeeded")
    note = "the old incarnation's reply, late"
    assert r.at(0.5).step("D", "handshake_reply", hex=old_reply, note=note)["outputs"] == []
    reply = r.at(0.5).step("P2", "handshake", hex=hs2["hex"])["result"]["hex"]
    lost = only(r.at(0.625).step("D", "handshake_reply", hex=reply), "LeaseLost")
    assert lost["key"] == "k1" and lost["reason"] == "pinner_restarted"
    heartbeat_round(r, "D", ["P2"], 0.75)
    assert r.at(1.5).step("D", "begin_access", key="k2")["result"]["guaranteed"]
    return r
