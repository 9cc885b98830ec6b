"""Vectors of accesses, their verdicts, and tracking a lease at most once.

    retrack, failed_transfer, verdict_binding, accessor_edges, retrack_edges

Spec rules (spec/PROTOCOL.md): an accessor tracks a lease at most once, remembers
`tombstone_limit` given-up leases, and its watermark never moves down (§3, §5.11); an access
guaranteed only with `A_l` of window left, covered only while `now < valid_until` (§5.7, §6.1); a
posted failed transfer gives the lease up, an unposted attempt may be retried (§5.7); a verdict
counting only for this rank, session and attempt, once per pinner rank (§5.8).
"""

from __future__ import annotations

from kvlease import AccessDone, AccessDoneAck, Accessor, AccessOutcome, decode, encode

from ._common import BASE, Recorder, accessor, connect, forged, heartbeat_round, only, outs, pinner

__all__ = ["accessor_edges", "failed_transfer", "retrack", "retrack_edges", "verdict_binding"]


def retrack() -> Recorder:
    cfg = BASE.with_changes(tombstone_limit=2)
    r = Recorder(
        "retrack",
        "A lease is tracked at most once by one accessor. req-1 is untracked; "
        "its Release is held in the network while the engine re-tracks the same ticket: "
        "refused (LocalProtocolError), so no heartbeat can renew the lease under a second "
        "tracking that the late Release would then free. The same after a completed read "
        "(req-2). The accessor remembers tombstone_limit (here 2) given-up leases; an "
        "older ticket at or below the watermark is refused as LeaseLost 'forgotten'.",
        cfg,
        {"P": pinner("prefill-0", 0x5EED0101), "D": accessor("decode-0")},
        {"P": 7000.0, "D": 18000.5},
    )
    t1 = r.at(0.0).step("P", "grant", key="req-1")["result"]
    t2 = r.at(0.0).step("P", "grant", key="req-2")["result"]
    t3 = r.at(0.0).step("P", "grant", key="req-3")["result"]
    hs = only(r.at(0.0).step("D", "track", key="k1", ticket=t1), "HandshakeNeeded")
    r.at(0.0).step("D", "track", key="k2", ticket=t2)
    connect(r, "D", "P", hs, 0.25)
    heartbeat_round(r, "D", ["P"], 0.375)
    held = only(r.at(1.0).step("D", "untrack", key="k1", note="the Release is held in the network"), "Send")
    again = r.at(1.0).step("D", "track", key="k1-again", ticket=t1, note="re-track after untrack")
    assert again["error"]["class"] == "LocalProtocolError"
    assert only(r.at(1.5).deliver("P", held, "the held Release lands"), "Free")["reason"] == "released"
    dec = r.at(1.5).step("D", "begin_access", key="k2")["result"]
    assert dec["guaranteed"]
    fin = r.at(1.75).step("D", "access_finished", key="k2")
    done = outs(fin, "Send")[0]
    assert outs(fin, "AccessCompleted")
    again = r.at(2.0).step(
        "D", "track", key="k2-again", ticket=t2, note="re-track after completion; the access-done is still in flight"
    )
    assert again["error"]["class"] == "LocalProtocolError"
    assert only(r.at(2.25).deliver("P", done), "Free")["reason"] == "access_done"
    # A third give-up pushes req-1 out of the accessor's memory (limit 2): its id falls under
    # the watermark, and a ticket at or below it is refused as forgotten.
    r.at(2.5).step("D", "track", key="k3", ticket=t3)
    r.at(2.5).step("D", "untrack", key="k3")
    lost = only(r.at(2.75).step("D", "track", key="k1-late", ticket=t1), "LeaseLost")
    assert lost["reason"] == "forgotten"
    return r


def failed_transfer() -> Recorder:
    r = Recorder(
        "failed_transfer",
        "A transfer posted with its access-done attached fails at the "
        "transport, but the notification lands and the pinner frees. The accessor gives "
        "the lease up (LeaseLost 'access_failed', and a Release to the targets) instead of "
        "letting the engine retry a read of freed memory; the engine needs a fresh lease. "
        "An attempt nothing of which was posted may be retried (posted=false), and a "
        "verdict on an earlier attempt never completes a later one.",
        BASE,
        {"P": pinner("prefill-0", 0x5EED0105), "D": accessor("decode-0")},
        {"P": 12.5, "D": 2400.0},
    )
    t1 = r.at(0.0).step("P", "grant", key="req-1")["result"]
    t2 = r.at(0.0).step("P", "grant", key="req-2")["result"]
    hs = only(r.at(0.0).step("D", "track", key="k1", ticket=t1), "HandshakeNeeded")
    r.at(0.0).step("D", "track", key="k2", ticket=t2)
    connect(r, "D", "P", hs, 0.25)
    heartbeat_round(r, "D", ["P"], 0.375)
    dec = r.at(1.0).step("D", "begin_access", key="k1")["result"]
    assert dec["guaranteed"] and dec["notifications"][0]
    freed = r.at(1.25).step("P", "receive", hex=dec["notifications"][0], note="the attached notification lands")
    assert only(freed, "Free")["reason"] == "access_done"
    gone = r.at(1.5).step("D", "access_failed", key="k1", note="the transport reports the transfer failed")
    assert [o["type"] for o in gone["outputs"]] == ["Send", "LeaseLost"]
    assert outs(gone, "LeaseLost")[0]["reason"] == "access_failed"
    assert not r.at(1.5).step("D", "begin_access", key="k1")["result"]["allowed"]
    assert r.at(1.5).step("D", "track", key="k1", ticket=t1)["error"]["class"] == "LocalProtocolError"
    assert r.at(1.75).deliver("P", outs(gone, "Send")[0], "the Release: the lease already ended")["outputs"] == []
    # req-2: the acks stop, so the next access asks the pinner to confirm.
    t = 2.375
    while t < 4.0:
        heartbeat_round(r, "D", ["P"], t, lose_back=True)
        t += 1.0
    first = r.at(4.5).step("D", "begin_access", key="k2")["result"]
    assert first["allowed"] and not first["guaranteed"]
    r.at(4.7).step("D", "access_failed", key="k2", posted=False, note="nothing of attempt 1 was posted")
    attempt1 = decode(bytes.fromhex(first["notifications"][0]))
    assert isinstance(attempt1, AccessDone)
    verdict = {
        "hex": encode(
            AccessDoneAck(
                "prefill-0", 0, 0x5EED0105, 0, 0xACCE55, attempt1.lease_id, attempt1.attempt, AccessOutcome.OK
            )
        ).hex()
    }
    second = r.at(4.8).step("D", "begin_access", key="k2")["result"]
    assert second["allowed"] and second["notifications"][0] != first["notifications"][0]
    assert r.at(4.9).deliver("D", verdict, "an OK verdict naming attempt 1 reaches attempt 2")["outputs"] == []
    fin = r.at(5.0).step("D", "access_finished", key="k2", note="attempt 2 finished, not notified")
    done = only(fin, "Send")
    res = r.at(5.1).deliver("P", done)
    assert [o["type"] for o in res["outputs"]] == ["Free", "Send"]
    ok = only(r.at(5.2).deliver("D", outs(res, "Send")[0]), "AccessCompleted")
    assert ok["confirmed_by_pinner"] is True
    return r


def verdict_binding() -> Recorder:
    r = Recorder(
        "verdict_binding",
        "Prefill TP=2, decode TP=1, acks lost, so the READ asks both pinner ranks to confirm. A "
        "verdict counts only if addressed to this rank and session, for this attempt, and once per "
        "pinner rank: one for rank 1 of the session, one for another session, one on an earlier "
        "attempt, and duplicates of rank 0's (before and after access_finished) all count nothing; "
        "the access completes on rank 1's own OK.",
        BASE,
        {
            "P0": pinner("prefill-0", 0x5EED0402, 0, 2),
            "P1": pinner("prefill-0", 0x5EED0402, 1, 2),
            "D": accessor("decode-0", session=0xD0),
        },
        {"P0": 8100.0, "P1": 8100.0, "D": 450.0},
    )
    t = r.at(0.0).step("P0", "grant", key="req-1")["result"]
    r.at(0.0).step("P1", "grant", key="req-1")
    hs = only(r.at(0.0).step("D", "track", key="req-1", ticket=t), "HandshakeNeeded")
    connect(r, "D", "P0", hs, 0.125)
    heartbeat_round(r, "D", ["P0", "P1"], 0.375, lose_back=True)
    first = r.at(1.0).step("D", "begin_access", key="req-1")["result"]
    r.at(1.0).step("D", "access_failed", key="req-1", posted=False, note="attempt 1: nothing posted")
    attempt1 = decode(bytes.fromhex(first["notifications"][1]))
    assert isinstance(attempt1, AccessDone)
    dec = r.at(1.1).step("D", "begin_access", key="req-1")["result"]
    assert dec["allowed"] and not dec["guaranteed"] and len(dec["notifications"]) == 2
    n0, n1 = dec["notifications"]
    res = r.at(1.2).step("P0", "receive", hex=n0)
    assert [o["type"] for o in res["outputs"]] == ["Free", "Send"]
    v0 = res["outputs"][1]
    assert only(r.at(1.3).step("D", "receive", hex=forged(v0["hex"], to_rank=1), note="for rank 1"), "Rejected")
    assert only(
        r.at(1.3).step("D", "receive", hex=forged(v0["hex"], to_session=0xBAD), note="for another session"), "Rejected"
    )
    stale = AccessDoneAck("prefill-0", 1, 0x5EED0402, 0, 0xD0, 1, attempt1.attempt, AccessOutcome.OK)
    note = "rank 1's OK on attempt 1"
    assert r.at(1.3).step("D", "receive", hex=encode(stale).hex(), note=note)["outputs"] == []
    assert r.at(1.35).deliver("D", v0, "rank 0's OK, before the transfer is reported done")["outputs"] == []
    assert r.at(1.4).deliver("D", v0, "a duplicate of it")["outputs"] == []
    fin = r.at(1.5).step("D", "access_finished", key="req-1", notified=True, note="rank 1 has not answered")
    assert fin["outputs"] == []
    assert r.at(1.6).deliver("D", v0, "rank 0's OK again, after")["outputs"] == []
    res = r.at(1.7).step("P1", "receive", hex=n1)
    assert [o["type"] for o in res["outputs"]] == ["Free", "Send"]
    ok = only(r.at(1.8).deliver("D", res["outputs"][1]), "AccessCompleted")
    assert ok["confirmed_by_pinner"] is True
    return r


def accessor_edges() -> Recorder:
    r = Recorder(
        "accessor_edges",
        "Edges of the accessor's rules. req-1: begun with less than A_l = A(1+rho) of window left "
        "(but more than A) is not guaranteed; finished exactly at valid_until it is not covered "
        "(covered is now < valid_until) and asks the pinner. req-2: an ack listing it 'completed' "
        "while it is being accessed (its own attached access-done landed) does not lose it. "
        "req-3: lost during an access (disconnect) it is retired at once, so its ticket cannot be "
        "tracked again while the access runs; finished with notified=true it sends nothing.",
        BASE,
        {"P": pinner("prefill-0", 0x5EED0403), "D": accessor("decode-0")},
        {"P": 900.0, "D": 43000.0},
    )
    tickets = [r.at(0.0).step("P", "grant", key=f"req-{i}")["result"] for i in (1, 2, 3)]
    hs = only(r.at(0.0).step("D", "track", key="req-1", ticket=tickets[0]), "HandshakeNeeded")
    r.at(0.0).step("D", "track", key="req-2", ticket=tickets[1])
    r.at(0.0).step("D", "track", key="req-3", ticket=tickets[2])
    connect(r, "D", "P", hs, 0.125)
    heartbeat_round(r, "D", ["P"], 0.375)
    dec = r.at(1.0).step("D", "begin_access", key="req-2")["result"]
    assert dec["guaranteed"]
    landed = r.at(1.1).step("P", "receive", hex=dec["notifications"][0], note="req-2's attached access-done lands")
    assert only(landed, "Free")["reason"] == "access_done"
    acks = heartbeat_round(r, "D", ["P"], 1.375)
    assert acks[0]["outputs"] == [], "completed while accessing: our own access-done"
    fin = r.at(2.0).step("D", "access_finished", key="req-2", notified=True)
    assert only(fin, "AccessCompleted")["confirmed_by_pinner"] is False
    acc = r.impl._endpoints["D"]
    assert isinstance(acc, Accessor)
    valid = acc.valid_until("req-1")
    assert valid is not None and abs(valid - r.local("D", 1.375) - BASE.accessor_extension) < 1e-9
    begin = valid - (BASE.max_access_time + BASE.access_time_local) / 2
    dec = r.step("D", "begin_access", "between A and A_l before valid_until", clock=begin, key="req-1")["result"]
    assert dec["allowed"] and not dec["guaranteed"]
    done = only(r.step("D", "access_finished", "exactly at valid_until", clock=valid, key="req-1"), "Send")
    assert done["message"]["confirm"] is True
    r.at(valid - r.epochs["D"] + 0.0625)
    res = r.deliver("P", done)
    assert [o["type"] for o in res["outputs"]] == ["Free", "Send"]
    assert only(r.at(r.t + 0.0625).deliver("D", res["outputs"][1]), "AccessCompleted")["confirmed_by_pinner"]
    r.at(r.t + 0.125)
    assert not r.step("D", "begin_access", key="req-3")["result"]["guaranteed"]
    lost = only(r.step("D", "disconnect", engine_id="prefill-0"), "LeaseLost")
    assert lost["key"] == "req-3" and lost["reason"] == "unreachable"
    again = r.step("D", "track", "its access still runs: retired at the loss", key="req-3-again", ticket=tickets[2])
    assert again["error"]["class"] == "LocalProtocolError"
    fin = r.step("D", "access_finished", key="req-3", notified=True)
    assert only(fin, "AccessStale")["key"] == "req-3"
    return r


def retrack_edges() -> Recorder:
    cfg = BASE.with_changes(tombstone_limit=1)
    r = Recorder(
        "retrack_edges",
        "tombstone_limit 1: leases 5, 3 and 6 are given up in that order; the watermark rises "
        "to 5 and never moves down (to 3), so re-tracking 5 is LeaseLost 'forgotten'. A ticket of "
        "the connected incarnation that names another TP size is LeaseLost 'unknown', not tracked.",
        cfg,
        {"P": pinner("prefill-0", 0x5EED0404), "D": accessor("decode-0")},
        {"P": 70.0, "D": 4400.0},
    )
    tickets = {i: r.at(0.0).step("P", "grant", key=f"req-{i}")["result"] for i in range(1, 9)}
    hs = only(r.at(0.0).step("D", "track", key="req-7", ticket=tickets[7]), "HandshakeNeeded")
    connect(r, "D", "P", hs, 0.125)
    for i in (5, 3, 6):
        r.at(0.5).step("D", "track", key=f"req-{i}", ticket=tickets[i])
        r.at(0.5).step("D", "untrack", key=f"req-{i}")
    lost = only(r.at(0.75).step("D", "track", key="req-5-again", ticket=tickets[5]), "LeaseLost")
    assert lost["reason"] == "forgotten"
    wider = {**tickets[8], "ranks": 2}
    lost = only(r.at(1.0).step("D", "track", key="req-8", ticket=wider, note="ranks 2; the pinner said 1"), "LeaseLost")
    assert lost["reason"] == "unknown"
    return r
