"""Vectors of protocol version 3's stated terms: pinner and accessor configured apart.

    mismatched_terms, stated_terms, ack_extensions

Spec rules (spec/PROTOCOL.md): the pinner states the terms it enforces (extension, drift bound,
access-time bound) in its handshake reply and every ack, and the accessor counts validity, its
heartbeat period and the confirmation window from the stricter of those and its own (§2.1, §5.3,
§5.6, §6.1); a round's window from the smallest extension any of its acks stated.
"""

from __future__ import annotations

from kvlease.conformance import JSONDict

from ._common import BASE, Recorder, accessor, connect, heartbeat_round, only, only_type, outs, pinner

__all__ = ["ack_extensions", "mismatched_terms", "stated_terms"]


def mismatched_terms() -> Recorder:
    d_config: JSONDict = {"kv_lease_duration": 30.0}
    long = BASE.with_changes(**d_config)
    r = Recorder(
        "mismatched_terms",
        "P and D configured apart (a rolling config change): P extends by 4 s (duration 6), "
        "D's own settings would give it 19.9 s (duration 30). P states the terms it enforces "
        "in its handshake reply and in every ack; D counts validity from the stricter of those "
        "and its own, heartbeats at a quarter of the shorter extension, and so never counts "
        "valid a lease P has freed. v2 counted 19.9 s here: a stale read 13.9 s past P's free. An "
        "unconfirmed READ waits for a verdict for P's window too; a waiting lease is given up a whole "
        "lease duration (D's own) after its last acknowledged round was sent.",
        BASE,
        {"P": pinner("prefill-0", 0x5EED0301), "D": {**accessor("decode-0"), "config": d_config}},
        {"P": 3100.0, "D": 7733.5},
    )
    ticket = r.at(0.0).step("P", "grant", key="req-1")["result"]
    ticket2 = r.at(0.0).step("P", "grant", key="req-2")["result"]
    hs = only(r.at(0.25).step("D", "track", key="req-1", ticket=ticket), "HandshakeNeeded")
    assert r.at(0.25).step("D", "track", key="req-2", ticket=ticket2)["outputs"] == []
    connect(r, "D", "P", hs, 0.375)
    acks = heartbeat_round(r, "D", ["P"], 0.5)
    assert all(a["outputs"] == [] for a in acks)
    dec = r.at(1.0).step("D", "begin_access", key="req-1")["result"]
    assert dec["allowed"] and dec["guaranteed"]
    window = dec["valid_until"] - r.local("D", 0.5)
    assert abs(window - BASE.accessor_extension) < 1e-9 and window < long.accessor_extension - 15.0
    r.at(1.25).step("D", "access_failed", key="req-1", posted=False, note="not posted: D tries later")
    # D's next heartbeat is due a quarter of P's extension after the last, not D's own period.
    nd = r.at(1.25).step("D", "handle_timeout")["next_deadline"]
    assert nd is not None and abs(nd - r.local("D", 0.5 + BASE.lease_extension / 4)) < 1e-9
    # D stops heartbeating (overloaded, its sends lost); P's lease runs out at 6.0.
    dec = r.at(0.5 + BASE.accessor_extension + 0.01).step("D", "begin_access", key="req-1", note="past P's terms")
    res = dec["result"]
    assert not res["guaranteed"] and res["valid_until"] < r.local("D"), res  # only a confirmed read now
    frees = r.at(BASE.kv_lease_duration).step("P", "handle_timeout")["outputs"]
    assert sorted(f["key"] for f in frees) == ["req-1", "req-2"] and all(f["reason"] == "expired" for f in frees)
    # The READ ends unconfirmed: D waits for a verdict for P's window (E_a from P's terms), not D's.
    done = only(r.at(6.25).step("D", "access_finished", key="req-1", note="the READ ends, not covered"), "Send")
    assert done["message"]["confirm"] is True
    deadline = 6.25 + BASE.accessor_extension
    res = r.at(deadline).step("D", "handle_timeout", note="no verdict within P's window: stale (D's own: 19.9 s)")
    assert only_type(res, "AccessStale")["key"] == "req-1"
    # req-2 waits: given up a whole lease duration (D's own, 30 s) after its last acknowledged round
    # was sent, not when its window lapsed (nor at valid_until less D's own E_a + 30 s, as v2 had it).
    res = r.at(30.375).step("D", "handle_timeout", note="req-2's window lapsed long ago: not a loss by itself")
    assert not outs(res, "LeaseLost")
    lost = only_type(r.at(30.5).step("D", "handle_timeout", note="last acknowledged send + 30 s"), "LeaseLost")
    assert lost["key"] == "req-2" and lost["reason"] == "validity_lapsed"
    return r


def stated_terms() -> Recorder:
    p_config: JSONDict = {"max_drift_rate": 1e-3, "max_access_time": 2.0}
    r = Recorder(
        "stated_terms",
        "P states a larger drift bound (1e-3) and access-time bound (2 s) than D's own (1e-4, "
        "0.5 s): D's window shrinks by P's drift bound, and a READ begun with 1 s of window left "
        "is not guaranteed (P's bound, 2 s, does not fit).",
        BASE,
        {"P": {**pinner("prefill-0", 0x5EED0406), "config": p_config}, "D": accessor("decode-0")},
        {"P": 5.0, "D": 6.0},
    )
    strict = BASE.with_changes(**p_config)
    ticket = r.at(0.0).step("P", "grant", key="req-1")["result"]
    hs = only(r.at(0.0).step("D", "track", key="req-1", ticket=ticket), "HandshakeNeeded")
    connect(r, "D", "P", hs, 0.125)
    heartbeat_round(r, "D", ["P"], 0.375)
    at = 0.375 + strict.accessor_extension - 1.0
    dec = r.at(at).step("D", "begin_access", key="req-1", note="1 s of window left")["result"]
    assert dec["allowed"] and not dec["guaranteed"]
    assert abs(dec["valid_until"] - r.local("D", 0.375) - strict.accessor_extension) < 1e-9
    r.at(at).step("D", "access_failed", key="req-1", posted=False)
    return r


def ack_extensions() -> Recorder:
    short: JSONDict = {"kv_lease_duration": 3.0}
    r = Recorder(
        "ack_extensions",
        "Each ack states the extension its pinner rank applied. Prefill TP=2 whose rank 1 runs a "
        "shorter lease (duration 3, extension 2): D's window for a round is counted from the "
        "smallest extension any of its acks stated (rank 1's, whatever the order of arrival). "
        "D2 runs the shorter settings itself: acks stating 4 s give it no more than its own 2.",
        BASE,
        {
            "P0": pinner("prefill-0", 0x5EED0407, 0, 2),
            "P1": {**pinner("prefill-0", 0x5EED0407, 1, 2), "config": short},
            "D": accessor("decode-0", session=0xD0),
            "D2": {**accessor("decode-1", 0, 2, session=0xD2), "config": short},
        },
        {"P0": 640.0, "P1": 640.0, "D": 9100.0, "D2": 300.0},
    )
    short_cfg = BASE.with_changes(**short)
    t = r.at(0.0).step("P0", "grant", key="req-1")["result"]
    r.at(0.0).step("P1", "grant", key="req-1")
    hs = only(r.at(0.0).step("D", "track", key="req-1", ticket=t), "HandshakeNeeded")
    connect(r, "D", "P0", hs, 0.125)
    s0, s1 = outs(r.at(0.375).step("D", "handle_timeout"), "Send")
    a0 = only(r.at(0.5).deliver("P0", s0), "Send")
    a1 = only(r.at(0.5).deliver("P1", s1), "Send")
    assert a0["message"]["extension"] == 4.0 and a1["message"]["extension"] == 2.0
    r.at(0.625).deliver("D", a1, "rank 1's ack (2 s) first")
    r.at(0.75).deliver("D", a0, "rank 0's (4 s) last")
    dec = r.at(0.875).step("D", "begin_access", key="req-1")["result"]
    assert abs(dec["valid_until"] - r.local("D", 0.375) - short_cfg.accessor_extension) < 1e-9
    r.at(0.875).step("D", "access_failed", key="req-1", posted=False)
    t2 = r.at(1.0).step("P0", "grant", key="req-2")["result"]
    hs2 = only(r.at(1.0).step("D2", "track", key="req-2", ticket=t2), "HandshakeNeeded")
    connect(r, "D2", "P0", hs2, 1.125)
    acks = heartbeat_round(r, "D2", ["P0"], 1.375)
    assert acks[0]["outputs"] == []
    dec = r.at(1.875).step("D2", "begin_access", key="req-2")["result"]
    assert abs(dec["valid_until"] - r.local("D2", 1.375) - short_cfg.accessor_extension) < 1e-9
    return r
