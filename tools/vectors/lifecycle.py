"""Vectors of a renewable pull-mode lease's life on one pinner rank and one accessor rank.

    happy_pull, overload_long_queue, accessor_crash_expiry, late_read, late_read_confirmed,
    release, expiry_edges, late_cover

Spec rules (spec/PROTOCOL.md): leases and their ends (§3); heartbeats and their handling at both
ends (§5.4-§5.6); an access guaranteed only while covered, else confirmed with the pinner, and the
verdicts (§5.7, §5.8); an acknowledgement that widens the window past a CONFIRMING access's
finish completes it (§5.6 step 9); Release from either side, before and after a promise (§5.9); accessor
validity and giving up a waiting lease (§6.1); expiry at `now >= expiry`, before `handle_timeout`
frees (§6.4).
"""

from __future__ import annotations

from kvlease import AccessDone, AccessOutcome, LocalTime, encode

from ._common import BASE, Recorder, accessor, connect, heartbeat_round, only, outs, pinner

__all__ = [
    "accessor_crash_expiry",
    "expiry_edges",
    "happy_pull",
    "late_cover",
    "late_read",
    "late_read_confirmed",
    "overload_long_queue",
    "release",
]


def happy_pull() -> Recorder:
    r = Recorder(
        "happy_pull",
        "Pull mode: grant, track, handshake, one heartbeat round, a "
        "guaranteed READ, access-done frees the blocks; a duplicate access-done is a no-op.",
        BASE,
        {"P": pinner("prefill-0", 0x5EED0001), "D": accessor("decode-0")},
        {"P": 14021.5, "D": 98333.25},
    )
    ticket = r.at(0.0).step("P", "grant", key="req-1")["result"]
    hs = only(r.at(0.25).step("D", "track", key="req-1", ticket=ticket), "HandshakeNeeded")
    connect(r, "D", "P", hs, 0.375)
    acks = heartbeat_round(r, "D", ["P"], 0.5)
    assert all(a["outputs"] == [] for a in acks)
    dec = r.at(1.25).step("D", "begin_access", key="req-1")["result"]
    assert dec["allowed"] and dec["guaranteed"]
    assert abs(dec["valid_until"] - (r.local("D", 0.5) + BASE.accessor_extension)) < 1e-9
    fin = r.at(1.5).step("D", "access_finished", key="req-1")
    done, completed = fin["outputs"]
    assert done["message"]["type"] == "AccessDone" and not done["message"]["confirm"]
    assert completed == {"type": "AccessCompleted", "key": "req-1", "lease_id": 1, "confirmed_by_pinner": False}
    free = only(r.at(1.75).deliver("P", done), "Free")
    assert free["reason"] == "access_done" and free["at"] == r.local("P")
    assert r.at(2.0).deliver("P", done, "duplicate access-done: never a second free")["outputs"] == []
    assert r.at(7.0).step("P", "handle_timeout")["outputs"] == []
    assert r.at(7.0).step("D", "handle_timeout")["outputs"] == []
    return r


def overload_long_queue() -> Recorder:
    r = Recorder(
        "overload_long_queue",
        "Pull mode: the request waits in the decoder's queue for "
        "30 s (5 lease durations); heartbeats every interval keep the lease, so nothing is "
        "freed until the READ completes.",
        BASE,
        {"P": pinner("prefill-0", 0x5EED0002), "D": accessor("decode-0")},
        {"P": 51234.75, "D": 1234.5},
    )
    ticket = r.at(0.0).step("P", "grant", key="req-q")["result"]
    hs = only(r.at(0.0).step("D", "track", key="req-q", ticket=ticket), "HandshakeNeeded")
    connect(r, "D", "P", hs, 0.25)
    t = 0.375
    while t < 30.0:
        heartbeat_round(r, "D", ["P"], t)
        assert r.at(t + 0.5).step("P", "handle_timeout")["outputs"] == [], "freed while heartbeating"
        assert r.at(t + 0.5).step("D", "handle_timeout")["outputs"] == []
        t += BASE.heartbeat_interval
    dec = r.at(t).step("D", "begin_access", key="req-q")["result"]
    assert dec["allowed"] and dec["guaranteed"]
    fin = r.at(t + 0.25).step("D", "access_finished", key="req-q")
    assert outs(fin, "AccessCompleted")
    free = only(r.at(t + 0.5).deliver("P", outs(fin, "Send")[0]), "Free")
    assert free["reason"] == "access_done"
    return r


def accessor_crash_expiry() -> Recorder:
    r = Recorder(
        "accessor_crash_expiry",
        "The decoder crashes after two heartbeats: the pinner "
        "frees exactly extension (4 s) after the last heartbeat it handled, not one tick "
        "earlier. A lease no accessor ever tracked frees at grant + duration. A heartbeat "
        "delayed past the free is answered 'expired' and frees nothing twice.",
        BASE,
        {"P": pinner("prefill-0", 0x5EED0003), "D": accessor("decode-0")},
        {"P": 77000.0, "D": 20480.125},
    )
    ticket = r.at(0.0).step("P", "grant", key="req-1")["result"]
    r.at(0.0).step("P", "grant", key="req-2", note="never tracked by any accessor")
    hs = only(r.at(0.0).step("D", "track", key="req-1", ticket=ticket), "HandshakeNeeded")
    connect(r, "D", "P", hs, 0.25)
    for t in (0.375, 1.375, 2.375):
        heartbeat_round(r, "D", ["P"], t)
    late = outs(r.at(3.375).step("D", "handle_timeout"), "Send")[0]
    r.at(3.625).deliver("P", late, "the last heartbeat the pinner handles; the decoder dies now")
    last_hb_recv = 3.625
    # A copy of its final heartbeat is stuck in the network.
    stuck = outs(
        r.at(4.375).step("D", "handle_timeout", note="the accessor's final heartbeat; it is delayed in the network"),
        "Send",
    )[0]
    expiry = last_hb_recv + BASE.lease_extension
    assert r.at(5.875).step("P", "handle_timeout")["outputs"] == []
    free2 = only(r.at(6.0).step("P", "handle_timeout", note="req-2: grant + duration"), "Free")
    assert free2["key"] == "req-2" and free2["reason"] == "expired"
    assert r.at(expiry - 0.125).step("P", "handle_timeout")["outputs"] == []
    free = only(r.at(expiry).step("P", "handle_timeout", note="last heartbeat + extension"), "Free")
    assert free == {**free, "key": "req-1", "reason": "expired", "at": r.local("P", expiry)}
    ack = only(r.at(expiry + 1.0).deliver("P", stuck, "the delayed heartbeat arrives after the free"), "Send")
    assert ack["message"]["expired"] == [1] and ack["message"]["renewed"] == 0
    assert r.at(expiry + 2.0).step("P", "handle_timeout")["outputs"] == []
    return r


def late_read() -> Recorder:
    r = Recorder(
        "late_read",
        "A partition cuts the pinner off after one acknowledged heartbeat. "
        "req-1: the READ starts inside validity but is not covered for the access-time "
        "bound, ends after validity, so the accessor asks the pinner; the pinner had "
        "expired it and answers STALE: the data is never reported valid. req-2 (no "
        "access) is given up one lease duration after its last acknowledged heartbeat "
        "was sent (a lapsed window alone is not a loss).",
        BASE,
        {"P": pinner("prefill-0", 0x5EED0004), "D": accessor("decode-0")},
        {"P": 31337.0, "D": 4096.75},
    )
    t1 = r.at(0.0).step("P", "grant", key="req-1")["result"]
    t2 = r.at(0.0).step("P", "grant", key="req-2")["result"]
    hs = only(r.at(0.0).step("D", "track", key="req-1", ticket=t1), "HandshakeNeeded")
    assert r.at(0.0).step("D", "track", key="req-2", ticket=t2)["outputs"] == []
    connect(r, "D", "P", hs, 0.25)
    heartbeat_round(r, "D", ["P"], 0.375)
    valid_until = r.local("D", 0.375) + BASE.accessor_extension
    # Partition: heartbeats from here on are lost.
    t = 1.375
    while t < 3.9:
        heartbeat_round(r, "D", ["P"], t, lose_to=True)
        t += 1.0
    dec = r.at(4.0).step("D", "begin_access", key="req-1")["result"]
    assert dec["allowed"] and not dec["guaranteed"] and abs(dec["valid_until"] - valid_until) < 1e-9
    assert r.at(4.33).step("D", "handle_timeout", note="req-2's window lapsed: not a loss by itself")["outputs"] == []
    frees = r.at(6.0).step("P", "handle_timeout")["outputs"]
    assert sorted(f["key"] for f in frees) == ["req-1", "req-2"]
    assert all(f["reason"] == "expired" for f in frees)
    fin = r.at(6.25).step("D", "access_finished", key="req-1", note="the READ ends after validity")
    done = only(fin, "Send")
    assert done["message"]["confirm"] is True
    res = r.at(6.375).step(
        "D",
        "handle_timeout",
        note="req-2: a whole lease duration without an ack since the last acknowledged heartbeat was sent: given up",
    )
    lost = outs(res, "LeaseLost")
    assert len(lost) == 1 and lost[0]["key"] == "req-2" and lost[0]["reason"] == "validity_lapsed"
    ack = only(r.at(7.0).deliver("P", done, "the partition heals"), "Send")
    assert ack["message"]["outcome"] == int(AccessOutcome.STALE)
    stale = only(r.at(7.25).deliver("D", ack), "AccessStale")
    assert stale["key"] == "req-1"
    return r


def late_read_confirmed() -> Recorder:
    r = Recorder(
        "late_read_confirmed",
        "Acks are lost (heartbeats still arrive), so the "
        "accessor cannot prove validity and asks; the pinner still holds the lease and "
        "confirms: AccessCompleted(confirmed_by_pinner=true). Without an answer in time "
        "the accessor would report the access stale.",
        BASE,
        {"P": pinner("prefill-0", 0x5EED0005), "D": accessor("decode-0")},
        {"P": 600.5, "D": 190000.25},
    )
    t1 = r.at(0.0).step("P", "grant", key="req-1")["result"]
    t2 = r.at(0.0).step("P", "grant", key="req-2")["result"]
    hs = only(r.at(0.0).step("D", "track", key="req-1", ticket=t1), "HandshakeNeeded")
    r.at(0.0).step("D", "track", key="req-2", ticket=t2)
    connect(r, "D", "P", hs, 0.25)
    t = 0.375
    while t < 3.0:
        heartbeat_round(r, "D", ["P"], t, lose_back=True)
        t += 1.0
    for key in ("req-1", "req-2"):
        dec = r.at(3.5).step("D", "begin_access", key=key)["result"]
        assert dec["allowed"] and not dec["guaranteed"] and dec["valid_until"] is None
    d1 = only(r.at(3.75).step("D", "access_finished", key="req-1"), "Send")
    d2 = only(r.at(3.75).step("D", "access_finished", key="req-2"), "Send")
    assert d1["message"]["confirm"] and d2["message"]["confirm"]
    a1 = r.at(4.0).deliver("P", d1)
    assert [o["type"] for o in a1["outputs"]] == ["Free", "Send"]
    ok = only(r.at(4.25).deliver("D", a1["outputs"][1]), "AccessCompleted")
    assert ok["confirmed_by_pinner"] is True
    # req-2's access-done is lost: the confirmation deadline passes.
    deadline = 3.75 + BASE.accessor_extension
    assert not outs(r.at(deadline - 0.125).step("D", "handle_timeout"), "AccessStale")
    stale = only(r.at(deadline).step("D", "handle_timeout"), "AccessStale")
    assert stale["key"] == "req-2"
    return r


def late_cover() -> Recorder:
    r = Recorder(
        "late_cover",
        "A READ faster than the first heartbeat's round trip (spec §5.6 step 9). req-1: the "
        "heartbeat sent when the lease was tracked is acknowledged only after the READ finished "
        "(CONFIRMING, the access-done asks to confirm); the ack's window covers the finish, so the "
        "access completes at the ack (confirmed_by_pinner false) and the pinner's later verdict "
        "finds nothing tracked. req-2: its round's ack comes back more than a window after the "
        "heartbeat was sent, so the window ends before the finish: the access stays CONFIRMING "
        "until the pinner's verdict.",
        BASE,
        {"P": pinner("prefill-0", 0x5EED0024), "D": accessor("decode-0")},
        {"P": 52.75, "D": 7100.5},
    )
    t1 = r.at(0.0).step("P", "grant", key="req-1")["result"]
    hs = only(r.at(0.0).step("D", "track", key="req-1", ticket=t1), "HandshakeNeeded")
    connect(r, "D", "P", hs, 0.25)
    hb = only(r.at(0.5).step("D", "handle_timeout", "the new lease's first heartbeat"), "Send")
    ack = only(r.at(0.625).deliver("P", hb), "Send")  # held on the way back
    dec = r.at(0.75).step("D", "begin_access", key="req-1")["result"]
    assert dec["allowed"] and not dec["guaranteed"] and dec["valid_until"] is None
    done = only(r.at(0.875).step("D", "access_finished", key="req-1"), "Send")
    assert done["message"]["confirm"]
    cover = only(r.at(1.0).deliver("D", ack, "the ack arrives after the READ finished"), "AccessCompleted")
    assert cover["key"] == "req-1" and cover["confirmed_by_pinner"] is False
    verdict = r.at(1.125).deliver("P", done)
    assert [o["type"] for o in verdict["outputs"]] == ["Free", "Send"]
    assert r.at(1.25).deliver("D", verdict["outputs"][1], "the verdict finds nothing tracked")["outputs"] == []
    # req-2: the round's ack comes back 4.5 s after its heartbeat, past the window (≈ 3.95 s).
    t2 = r.at(2.0).step("P", "grant", key="req-2")["result"]
    assert not r.at(2.0).step("D", "track", key="req-2", ticket=t2)["outputs"]
    hb2 = only(r.at(2.125).step("D", "handle_timeout", "req-2's first heartbeat"), "Send")
    ack2 = only(r.at(2.25).deliver("P", hb2), "Send")
    assert r.at(2.375).step("D", "begin_access", key="req-2")["result"]["allowed"]
    done2 = only(r.at(6.125).step("D", "access_finished", key="req-2"), "Send")
    assert done2["message"]["confirm"]
    late = r.at(6.625).deliver("D", ack2, "the window ended before the finish: still CONFIRMING")
    assert not outs(late, "AccessCompleted") and not outs(late, "AccessStale")
    verdict2 = r.at(6.75).deliver("P", done2)
    assert [o["type"] for o in verdict2["outputs"]] == ["Free", "Send"]
    ok = only(r.at(6.875).deliver("D", verdict2["outputs"][1]), "AccessCompleted")
    assert ok["key"] == "req-2" and ok["confirmed_by_pinner"] is True
    return r


def release() -> Recorder:
    r = Recorder(
        "release",
        "Aborts before access. req-1: the decoder untracks it and sends "
        "Release; the pinner frees at once. req-2: the prefill engine aborts locally "
        "before any heartbeat for it was acknowledged (so no accessor can hold validity "
        "and it may free at once); the decoder tracks it later and the first heartbeat's "
        "ack tells it the lease was released. Duplicate releases do nothing. req-3: the "
        "prefill engine aborts after an acknowledged heartbeat: held until expiry.",
        BASE,
        {"P": pinner("prefill-0", 0x5EED000B), "D": accessor("decode-0")},
        {"P": 1000.0, "D": 2000.0},
    )
    t1 = r.at(0.0).step("P", "grant", key="req-1")["result"]
    t2 = r.at(0.0).step("P", "grant", key="req-2")["result"]
    hs = only(r.at(0.0).step("D", "track", key="req-1", ticket=t1), "HandshakeNeeded")
    connect(r, "D", "P", hs, 0.25)
    heartbeat_round(r, "D", ["P"], 0.375)
    rel = only(r.at(1.0).step("D", "untrack", key="req-1"), "Send")
    assert rel["rank"] == 0 and rel["message"]["type"] == "Release"
    free = only(r.at(1.125).deliver("P", rel), "Free")
    assert free["reason"] == "released" and free["key"] == "req-1"
    assert r.at(1.25).deliver("P", rel, "duplicate Release")["outputs"] == []
    assert only(r.at(1.3).step("P", "release", lease_id=2), "Free")["reason"] == "released"
    assert r.at(1.3).step("P", "release", lease_id=2, note="already ended: harmless")["outputs"] == []
    assert r.at(1.35).step("D", "track", key="req-2", ticket=t2)["outputs"] == []
    acks = heartbeat_round(r, "D", ["P"], 1.375)
    assert len(acks) == 1
    lost = only(acks[0], "LeaseLost")
    assert lost["key"] == "req-2" and lost["reason"] == "released"
    assert r.at(2.0).step("D", "untrack", key="req-2", note="already lost: no-op")["outputs"] == []
    # req-3: the prefill engine aborts *after* a heartbeat was acknowledged. The decoder may hold
    # a validity window, so the pinner must not free at once: it stops renewing, answers the
    # next heartbeat with "released", and frees at the current expiry.
    t3 = r.at(2.0).step("P", "grant", key="req-3")["result"]
    assert r.at(2.0).step("D", "track", key="req-3", ticket=t3)["outputs"] == []
    heartbeat_round(r, "D", ["P"], 2.125)
    assert (
        r.at(3.0).step("P", "release", lease_id=3, note="held: an acked heartbeat promised validity")["outputs"] == []
    )
    acks = heartbeat_round(r, "D", ["P"], 3.5)
    lost = only(acks[0], "LeaseLost")
    assert lost["key"] == "req-3" and lost["reason"] == "released"
    assert r.at(7.875).step("P", "handle_timeout", note="not before the expiry (grant + 6 s)")["outputs"] == []
    free3 = only(r.at(8.0).step("P", "handle_timeout"), "Free")
    assert free3["key"] == "req-3" and free3["reason"] == "released"
    return r


def expiry_edges() -> Recorder:
    r = Recorder(
        "expiry_edges",
        "A lease is expired at pinner time now >= expiry, before "
        "handle_timeout frees it: a heartbeat handled exactly at the expiry lists it "
        "'expired' (no renewal) and an access-done asking for confirmation is answered "
        "STALE. The ack's lists become LeaseLost: 'expired' for a waiting lease, 'unknown' "
        "for an id the pinner never granted; a lease lost during an access is reported "
        "AccessStale when the access finishes. An access-done for an id never granted is "
        "answered UNKNOWN.",
        BASE,
        {"P": pinner("prefill-0", 0x5EED0106), "D": accessor("decode-0")},
        {"P": 100.0, "D": 200.0},
    )
    t1 = r.at(0.0).step("P", "grant", key="req-1")["result"]
    t2 = r.at(0.0).step("P", "grant", key="req-2", lease_id=51)["result"]
    ghost = {**t1, "lease_id": "50"}  # below the next id (52) and never granted: unknown at once
    hs = only(r.at(0.0).step("D", "track", key="k1", ticket=t1), "HandshakeNeeded")
    r.at(0.0).step("D", "track", key="k2", ticket=t2)
    r.at(0.0).step("D", "track", key="ghost", ticket=ghost, note="a ticket for an id the pinner never granted")
    connect(r, "D", "P", hs, 0.25)
    hb = outs(r.at(0.375).step("D", "handle_timeout"), "Send")[0]
    # The heartbeat is delayed until exactly the grant's expiry (grant + 6 s).
    ack = only(r.at(6.0).deliver("P", hb, "handled at now == expiry: expired, not renewed"), "Send")
    assert ack["message"]["renewed"] == 0 and ack["message"]["expired"] == [1, 51]
    assert ack["message"]["unknown"] == [50]
    stale = AccessDone("decode-0", 0, 1, 0xACCE55, 0x5EED0106, 0, 51, 1, True, LocalTime(206.0))
    res = r.at(6.0).step("P", "receive", hex=encode(stale).hex(), note="confirm-request at now == expiry")
    assert only(res, "Send")["message"]["outcome"] == int(AccessOutcome.STALE)
    frees = r.at(6.0).step("P", "handle_timeout")["outputs"]
    assert sorted(f["key"] for f in frees) == ["req-1", "req-2"]
    dec = r.at(6.0).step("D", "begin_access", key="k1")["result"]
    assert dec["allowed"] and not dec["guaranteed"]
    out = r.at(6.125).deliver("D", ack)
    lost = outs(out, "LeaseLost")
    assert sorted((x["key"], x["reason"]) for x in lost) == [("ghost", "unknown"), ("k1", "expired"), ("k2", "expired")]
    fin = r.at(6.25).step("D", "access_finished", key="k1", note="lost during the access")
    assert outs(fin, "AccessStale")
    unknown = AccessDone("decode-0", 0, 1, 0xACCE55, 0x5EED0106, 0, 50, 1, True, LocalTime(206.0))
    res = r.at(6.5).step("P", "receive", hex=encode(unknown).hex(), note="an id never granted")
    assert only(res, "Send")["message"]["outcome"] == int(AccessOutcome.UNKNOWN)
    return r
