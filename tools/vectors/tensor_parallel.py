"""Vectors of heterogeneous tensor-parallel layouts: several pinner ranks, several accessor ranks.

    hetero_tp_pinner_wider, hetero_tp_accessor_wider, wrong_rank, multi_part_to_rank

Spec rules (spec/PROTOCOL.md): which accessor rank heartbeats and accesses which pinner ranks,
validity needing every target rank's ack, and `expected` derived from the sender's layout (§5.2);
a misrouted heartbeat or access-done Rejected (§5.5, §5.8); one access-done per target pinner rank,
each naming it (`to_rank`, v3, §4.2, §5.8). `multi_part_to_rank` is bound by
tools/mutation_check.py (`access_done_to_rank_unchecked`).
"""

from __future__ import annotations

from kvlease import AccessDone, LocalTime, encode

from ._common import BASE, Recorder, accessor, connect, heartbeat_round, only, outs, pinner

__all__ = ["hetero_tp_accessor_wider", "hetero_tp_pinner_wider", "multi_part_to_rank", "wrong_rank"]


def hetero_tp_pinner_wider() -> Recorder:
    r = Recorder(
        "hetero_tp_pinner_wider",
        "Prefill TP=2, decode TP=1: the decoder's one worker "
        "reads from both prefill workers, so it heartbeats each of them (one send per rank), "
        "validity needs the ack of every rank (a duplicate of one rank's is not another's), and each prefill "
        "worker frees on the one "
        "access-done it expects. An access begun before the round is fully acknowledged is "
        "not guaranteed; the driver had not posted it, so it backs off (posted=false) and "
        "retries under the same lease.",
        BASE,
        {
            "P0": pinner("prefill-0", 0x5EED0009, 0, 2),
            "P1": pinner("prefill-0", 0x5EED0009, 1, 2),
            "D": accessor("decode-0"),
        },
        {"P0": 9000.0, "P1": 9000.0, "D": 123.0},
    )
    t = r.at(0.0).step("P0", "grant", key="req-1")["result"]
    assert r.at(0.0).step("P1", "grant", key="req-1")["result"] == {**t, "engine_id": "prefill-0"}
    assert t["ranks"] == 2
    hs = only(r.at(0.0).step("D", "track", key="req-1", ticket=t), "HandshakeNeeded")
    connect(r, "D", "P0", hs, 0.25)
    hb = r.at(0.375).step("D", "handle_timeout")
    sends = outs(hb, "Send")
    assert [s["rank"] for s in sends] == [0, 1] and sends[0]["hex"] == sends[1]["hex"]
    a0 = only(r.at(0.5).deliver("P0", sends[0]), "Send")
    a1 = only(r.at(0.5).deliver("P1", sends[1]), "Send")
    r.at(0.625).deliver("D", a0)
    assert r.at(0.65).deliver("D", a0, "a duplicate of rank 0's ack: it does not stand for rank 1's")["outputs"] == []
    dec = r.at(0.7).step("D", "begin_access", key="req-1", note="rank 1 has not acked yet")["result"]
    assert dec["allowed"] and not dec["guaranteed"] and dec["targets"] == [0, 1]
    r.at(0.75).step(
        "D",
        "access_failed",
        key="req-1",
        posted=False,
        note="the driver backs off before posting anything, and retries",
    )
    r.at(0.75).deliver("D", a1)
    dec = r.at(0.8).step("D", "begin_access", key="req-1")["result"]
    assert dec["allowed"] and dec["guaranteed"]
    fin = r.at(1.0).step("D", "access_finished", key="req-1")
    sends = outs(fin, "Send")
    assert [s["rank"] for s in sends] == [0, 1] and outs(fin, "AccessCompleted")
    assert only(r.at(1.25).deliver("P0", sends[0]), "Free")["reason"] == "access_done"
    assert only(r.at(1.25).deliver("P1", sends[1]), "Free")["reason"] == "access_done"
    return r


def hetero_tp_accessor_wider() -> Recorder:
    r = Recorder(
        "hetero_tp_accessor_wider",
        "Prefill TP=1, decode TP=2: both decode workers "
        "heartbeat the one prefill worker (it simply renews twice), and the lease ends "
        "only when both have reported their access done (expected = 2, derived by the "
        "pinner from the sender's rank and ranks). A duplicate from one rank counts once.",
        BASE,
        {
            "P": pinner("prefill-0", 0x5EED000A),
            "D0": accessor("decode-0", 0, 2, 0xD0),
            "D1": accessor("decode-0", 1, 2, 0xD1),
        },
        {"P": 555.5, "D0": 70000.0, "D1": 70000.0},
    )
    t = r.at(0.0).step("P", "grant", key="req-1")["result"]
    hs0 = only(r.at(0.0).step("D0", "track", key="req-1", ticket=t), "HandshakeNeeded")
    hs1 = only(r.at(0.0).step("D1", "track", key="req-1", ticket=t), "HandshakeNeeded")
    connect(r, "D0", "P", hs0, 0.125)
    connect(r, "D1", "P", hs1, 0.25)
    heartbeat_round(r, "D0", ["P"], 0.5)
    heartbeat_round(r, "D1", ["P"], 1.0)
    f0 = r.at(1.5).step("D0", "begin_access", key="req-1")["result"]
    assert f0["guaranteed"]
    r.at(1.5).step("D1", "begin_access", key="req-1")
    fin0 = r.at(1.75).step("D0", "access_finished", key="req-1")
    fin1 = r.at(1.875).step("D1", "access_finished", key="req-1")
    s0, s1 = outs(fin0, "Send")[0], outs(fin1, "Send")[0]
    assert s0["message"]["ranks"] == 2 and s0["rank"] == 0 and s1["rank"] == 0
    assert r.at(2.0).deliver("P", s0)["outputs"] == []
    assert r.at(2.125).deliver("P", s0, "a duplicate from rank 0 does not count twice")["outputs"] == []
    assert only(r.at(2.25).deliver("P", s1), "Free")["reason"] == "access_done"
    return r


def wrong_rank() -> Recorder:
    r = Recorder(
        "wrong_rank",
        "Pinner TP 2, accessor TP 2: accessor rank r accesses pinner rank r "
        "only, and heartbeats only it. Accessor rank 1's AccessDone delivered to pinner "
        "rank 0 (the right engine, the wrong rank) is Rejected and counts nothing; so is "
        "its heartbeat there, and a rank outside the sender's engine. When accessor rank 0 "
        "finishes and pinner rank 0 frees, accessor rank 1 keeps its lease (it never "
        "heartbeats rank 0, so it never hears 'completed' from it) and reads later.",
        BASE,
        {
            "P0": pinner("prefill-0", 0x5EED0102, 0, 2),
            "P1": pinner("prefill-0", 0x5EED0102, 1, 2),
            "D0": accessor("decode-0", 0, 2, 0xD0),
            "D1": accessor("decode-0", 1, 2, 0xD1),
        },
        {"P0": 3000.0, "P1": 3000.0, "D0": 90000.0, "D1": 90000.0},
    )
    t = r.at(0.0).step("P0", "grant", key="req-1")["result"]
    r.at(0.0).step("P1", "grant", key="req-1")
    hs0 = only(r.at(0.0).step("D0", "track", key="req-1", ticket=t), "HandshakeNeeded")
    hs1 = only(r.at(0.0).step("D1", "track", key="req-1", ticket=t), "HandshakeNeeded")
    connect(r, "D0", "P0", hs0, 0.125)
    connect(
        r,
        "D1",
        "P0",
        hs1,
        0.25,
    )
    hb0 = r.at(0.375).step("D0", "handle_timeout")
    hb1 = r.at(0.375).step("D1", "handle_timeout")
    assert [s["rank"] for s in outs(hb0, "Send")] == [0] and [s["rank"] for s in outs(hb1, "Send")] == [1]
    stray = only(
        r.at(0.5).deliver("P0", outs(hb1, "Send")[0], "rank 1's heartbeat misrouted to pinner rank 0"), "Rejected"
    )
    assert stray
    a0 = only(r.at(0.5).deliver("P0", outs(hb0, "Send")[0]), "Send")
    a1 = only(r.at(0.5).deliver("P1", outs(hb1, "Send")[0]), "Send")
    r.at(0.625).deliver("D0", a0)
    r.at(0.625).deliver("D1", a1)
    assert r.at(0.625).step("D0", "begin_access", key="req-1")["result"]["guaranteed"]
    fin0 = r.at(0.875).step("D0", "access_finished", key="req-1")
    assert outs(fin0, "AccessCompleted")
    hx = AccessDone("decode-0", 1, 2, 0xD1, 0x5EED0102, 0, 1, 1, False, LocalTime(90001.0))
    rej = r.at(1.0).step("P0", "receive", hex=encode(hx).hex(), note="accessor rank 1's access-done at pinner rank 0")
    assert only(rej, "Rejected")
    far = AccessDone("decode-0", 70000 % 65536, 2, 0xD1, 0x5EED0102, 0, 1, 1, False, LocalTime(90001.0))
    assert only(
        r.at(1.0).step("P0", "receive", hex=encode(far).hex(), note="a rank the sender's engine lacks"), "Rejected"
    )
    assert only(r.at(1.125).deliver("P0", outs(fin0, "Send")[0]), "Free")["reason"] == "access_done"
    acks = heartbeat_round(r, "D1", ["P0", "P1"], 1.375)
    assert all(a["outputs"] == [] for a in acks), "rank 1 keeps its lease"
    assert r.at(2.0).step("D1", "begin_access", key="req-1")["result"]["guaranteed"]
    fin1 = r.at(2.25).step("D1", "access_finished", key="req-1")
    assert outs(fin1, "AccessCompleted")
    assert only(r.at(2.5).deliver("P1", outs(fin1, "Send")[0]), "Free")["reason"] == "access_done"
    return r


def multi_part_to_rank() -> Recorder:
    r = Recorder(
        "multi_part_to_rank",
        "Prefill TP=2, decode TP=1: one READ has a part per prefill rank, and each part's "
        "access-done names the pinner rank it is for (to_rank). Part 1's notification "
        "misdelivered to rank 0 (the wrong rank of the right engine) is Rejected and frees "
        "nothing; each rank frees on its own part's.",
        BASE,
        {
            "P0": pinner("prefill-0", 0x5EED0303, 0, 2),
            "P1": pinner("prefill-0", 0x5EED0303, 1, 2),
            "D": accessor("decode-0"),
        },
        {"P0": 5000.0, "P1": 5000.0, "D": 77.0},
    )
    t = r.at(0.0).step("P0", "grant", key="req-1")["result"]
    r.at(0.0).step("P1", "grant", key="req-1")
    hs = only(r.at(0.0).step("D", "track", key="req-1", ticket=t), "HandshakeNeeded")
    connect(r, "D", "P0", hs, 0.25)
    heartbeat_round(r, "D", ["P0", "P1"], 0.375)
    dec = r.at(1.0).step("D", "begin_access", key="req-1")["result"]
    assert dec["guaranteed"] and dec["targets"] == [0, 1] and len(dec["notifications"]) == 2
    n0, n1 = dec["notifications"]
    assert n0 != n1
    rej = r.at(1.25).step("P0", "receive", hex=n1, note="part 1's notification at pinner rank 0")
    assert only(rej, "Rejected")
    assert only(r.at(1.25).step("P0", "receive", hex=n0), "Free")["reason"] == "access_done"
    assert only(r.at(1.3).step("P1", "receive", hex=n1), "Free")["reason"] == "access_done"
    assert outs(r.at(1.5).step("D", "access_finished", key="req-1", notified=True), "AccessCompleted")
    return r
