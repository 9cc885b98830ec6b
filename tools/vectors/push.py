"""Vectors of push mode: the decoder pins destination pages and the prefiller WRITEs into them.

    push_mode, posted_failed_push

Spec rules (spec/PROTOCOL.md): a write refused until covered (§5.7); an expired push lease is
quarantined, not freed, and an access-done landing then counts nothing (§3, §5.8); the push guard
`max_access_time * (1 + rho)` before the free (§6.2); a posted Release holds the lease to expiry +
the guard, an unposted one frees at once (v3, §5.9). Bound by tools/mutation_check.py
(`quarantined_counts_access_done`, `posted_release_not_held`, `posted_release_held_without_guard`).
"""

from __future__ import annotations

from ._common import BASE, Recorder, accessor, connect, heartbeat_round, only, outs, pinner

__all__ = ["posted_failed_push", "push_mode"]


def push_mode() -> Recorder:
    r = Recorder(
        "push_mode",
        "Push mode: the decoder pins destination pages, the prefiller "
        "WRITEs. A write is refused until an acknowledged heartbeat covers the "
        "access-time bound. req-2: the writer vanishes mid-write; at expiry the pinner "
        "quarantines the pages (a write may still land) and frees them only after the "
        "push guard (max_access_time * (1 + rho)); neither the write's access-done landing then nor a "
        "local release can shorten it.",
        BASE,
        {"D": pinner("decode-0", 0x5EED0006), "P": accessor("prefill-0")},
        {"D": 8192.0, "P": 65000.5},
    )
    t1 = r.at(0.0).step("D", "grant", key="req-1", push=True)["result"]
    hs = only(r.at(0.0).step("P", "track", key="req-1", ticket=t1, push=True), "HandshakeNeeded")
    dec = r.at(0.125).step("P", "begin_access", key="req-1")["result"]
    assert not dec["allowed"] and dec["valid_until"] is None
    connect(r, "P", "D", hs, 0.25)
    heartbeat_round(r, "P", ["D"], 0.375)
    dec = r.at(1.0).step("P", "begin_access", key="req-1")["result"]
    assert dec["allowed"] and dec["guaranteed"]
    fin = r.at(1.25).step("P", "access_finished", key="req-1")
    assert outs(fin, "AccessCompleted")
    assert only(r.at(1.5).deliver("D", outs(fin, "Send")[0]), "Free")["reason"] == "access_done"
    t2 = r.at(2.0).step("D", "grant", key="req-2", push=True)["result"]
    assert r.at(2.0).step("P", "track", key="req-2", ticket=t2, push=True)["outputs"] == []
    sends = outs(r.at(2.0).step("P", "handle_timeout", note="a new lease is heartbeated at once"), "Send")
    assert len(sends) == 1 and sends[0]["message"]["lease_ids"] == [2]
    ack = only(r.at(2.25).deliver("D", sends[0]), "Send")
    r.at(2.5).deliver("P", ack)
    dec = r.at(2.75).step("P", "begin_access", key="req-2")["result"]
    assert dec["allowed"] and dec["guaranteed"]
    # The writer dies here. The lease never shrinks: its expiry is the later of the grant's
    # (2.0 + duration) and the last heartbeat's (2.25 + extension).
    expiry = max(2.0 + BASE.kv_lease_duration, 2.25 + BASE.lease_extension)
    assert r.at(expiry - 0.125).step("D", "handle_timeout")["outputs"] == []
    assert r.at(expiry).step("D", "handle_timeout", note="expired: quarantined, not freed")["outputs"] == []
    note = "the write's access-done lands in quarantine: expired, it counts nothing (no free)"
    assert r.at(expiry + 0.0625).step("D", "receive", hex=dec["notifications"][0], note=note)["outputs"] == []
    assert r.at(expiry + 0.125).step("D", "release", lease_id=2)["outputs"] == []
    guard_end = expiry + BASE.push_guard
    assert r.at(guard_end - 0.001).step("D", "handle_timeout")["outputs"] == []
    free = only(r.at(guard_end).step("D", "handle_timeout"), "Free")
    assert free["reason"] == "expired" and free["key"] == "req-2"
    return r


def posted_failed_push() -> Recorder:
    r = Recorder(
        "posted_failed_push",
        "Push mode: a WRITE is posted and then fails (a later part refused, an error after "
        "the first posts); the WRITE may still land. The accessor's Release says posted=true, "
        "and the pinner holds the destination pages as it would at expiry: freed at expiry + "
        "the push guard, never at once; heartbeats no longer extend it. A Release with "
        "posted=false (nothing posted, the transfer abandoned) frees at once.",
        BASE,
        {"D": pinner("decode-0", 0x5EED0302), "P": accessor("prefill-0")},
        {"D": 412.0, "P": 90017.25},
    )
    t1 = r.at(0.0).step("D", "grant", key="req-1", push=True)["result"]
    hs = only(r.at(0.0).step("P", "track", key="req-1", ticket=t1, push=True), "HandshakeNeeded")
    connect(r, "P", "D", hs, 0.125)
    heartbeat_round(r, "P", ["D"], 0.25)
    dec = r.at(0.875).step("P", "begin_access", key="req-1")["result"]
    assert dec["allowed"] and dec["guaranteed"]
    failed = r.at(0.9).step("P", "access_failed", key="req-1", posted=True, note="the WRITE may still land")
    (rel,) = outs(failed, "Send")
    assert rel["message"]["type"] == "Release" and rel["message"]["posted"] is True
    assert r.at(0.95).deliver("D", rel, note="held, not freed")["outputs"] == []
    expiry = max(0.0 + BASE.kv_lease_duration, 0.5 + BASE.lease_extension)
    guard_end = expiry + BASE.push_guard
    assert r.at(expiry).step("D", "handle_timeout")["outputs"] == []
    assert r.at(guard_end - 0.001).step("D", "handle_timeout")["outputs"] == []
    free = only(r.at(guard_end).step("D", "handle_timeout"), "Free")
    assert free["reason"] == "released" and free["key"] == "req-1"
    # Nothing posted: the Release frees at once.
    t2 = r.at(8.0).step("D", "grant", key="req-2", push=True)["result"]
    assert r.at(8.0).step("P", "track", key="req-2", ticket=t2, push=True)["outputs"] == []
    heartbeat_round(r, "P", ["D"], 8.0)
    assert r.at(8.75).step("P", "begin_access", key="req-2")["result"]["guaranteed"]
    assert r.at(8.8).step("P", "access_failed", key="req-2", posted=False)["outputs"] == []
    (rel,) = outs(r.at(8.8).step("P", "untrack", key="req-2", note="the transfer is abandoned"), "Send")
    assert rel["message"]["posted"] is False
    assert only(r.at(8.9).deliver("D", rel), "Free")["reason"] == "released"
    return r
