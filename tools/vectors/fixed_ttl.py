"""Vectors of fixed-TTL leases (bidirectional turns): a deadline stated in the pinner's clock.

    fixed_ttl_bidirectional, fixed_ttl_past_deadline

Spec rules (spec/PROTOCOL.md): the conversion of the pinner's deadline into the accessor's clock
with the handshake offset, its error bound and the drift factor, less the margin, only after an
acknowledged round; a deadline already past stretched by (1+rho)/(1-rho) (§6.3); heartbeats
acknowledged but never extending a fixed lease, and the accessor giving it up before the pinner
frees it (§3, §5.5).
"""

from __future__ import annotations

from kvlease import AccessOutcome

from ._common import BASE, Recorder, accessor, connect, heartbeat_round, only, outs, pinner

__all__ = ["fixed_ttl_bidirectional", "fixed_ttl_past_deadline"]


def fixed_ttl_bidirectional() -> Recorder:
    r = Recorder(
        "fixed_ttl_bidirectional",
        "Bidirectional turn 1: the decoder pins its KV for "
        "the prefiller under a fixed TTL (20 s) stated in the decoder's clock. The "
        "prefiller's clock is ~54,000 s apart; it converts the deadline with the "
        "handshake offset, taking the error bound (half the round-trip delay) and the "
        "drift factor (1-rho)/(1+rho) against itself, minus the margin, once an acknowledged "
        "heartbeat round showed the lease is still held for it. Heartbeats are acknowledged "
        "but never extend a fixed lease. req-2 runs out: the accessor gives "
        "it up before the pinner frees it.",
        BASE,
        {"D": pinner("decode-0", 0x5EED0007), "P": accessor("prefill-0")},
        {"D": 60000.0, "P": 5800.5},
    )
    t1 = r.at(0.0).step("D", "grant", key="turn1-a", kind=1)["result"]
    t2 = r.at(0.0).step("D", "grant", key="turn1-b", kind=1, ttl=10.0)["result"]
    assert t1["deadline"] == r.local("D", 20.0) and t2["deadline"] == r.local("D", 10.0)
    hs = only(r.at(1.0).step("P", "track", key="turn1-a", ticket=t1), "HandshakeNeeded")
    r.at(1.0).step("P", "track", key="turn1-b", ticket=t2)
    # Asymmetric path: 0.1 s there, 0.2 s back: the offset estimate is 0.05 s off, within
    # the 0.15 s error bound (delay / 2).
    reply = r.at(1.1).step("D", "handshake", hex=hs["hex"])
    r.at(1.3).step("P", "handshake_reply", hex=reply["result"]["hex"])
    early = r.at(1.3).step(
        "P",
        "begin_access",
        key="turn1-a",
        note="no acknowledged heartbeat yet: the deadline alone does not prove the lease is still held for us",
    )["result"]
    assert early["allowed"] and not early["guaranteed"] and early["valid_until"] is None
    r.at(1.3).step("P", "access_failed", key="turn1-a", posted=False)
    acks = heartbeat_round(r, "P", ["D"], 1.4)
    assert all(a["outputs"] == [] for a in acks)
    dec = r.at(2.0).step("P", "begin_access", key="turn1-a")["result"]
    true_deadline = r.local("P", 20.0)
    assert dec["allowed"] and dec["guaranteed"] and dec["valid_until"] < true_deadline - BASE.validity_margin
    rho = BASE.max_drift_rate
    est_off = ((r.local("D", 1.1) - r.local("P", 1.0)) + (r.local("D", 1.1) - r.local("P", 1.3))) / 2
    err = 0.3 / 2 + 2 * rho * (r.local("P", 2.0) - r.local("P", 1.0))
    now = r.local("P", 2.0)
    expect_valid = now + (t1["deadline"] - (now + est_off + err)) * (1 - rho) / (1 + rho) - BASE.validity_margin
    assert abs(dec["valid_until"] - expect_valid) < 1e-6, (dec, expect_valid)
    fin = r.at(2.5).step("P", "access_finished", key="turn1-a")
    assert outs(fin, "AccessCompleted")
    assert only(r.at(2.6).deliver("D", outs(fin, "Send")[0]), "Free")["reason"] == "access_done"
    # turn1-b: heartbeats are acknowledged (the pinner holds it) but never extend it.
    acks = heartbeat_round(r, "P", ["D"], 3.0)
    assert all(a["outputs"] == [] for a in acks)
    t = 4.0
    lost_at = None
    while t < 10.5:
        # The accessor's driver wakes exactly at next_deadline.
        resp = r.at(t).step("P", "handle_timeout")
        if outs(resp, "LeaseLost"):
            lost_at = t
            break
        nd = resp["next_deadline"]
        for s in outs(resp, "Send"):
            a = only(r.at(t + 0.1).deliver("D", s), "Send")
            assert a["message"]["renewed"] == 1
            nd = r.at(t + 0.2).deliver("P", a)["next_deadline"]
        t = nd - r.epochs["P"]
    assert lost_at is not None and lost_at < 10.0 - 0.1, lost_at
    assert r.at(9.999).step("D", "handle_timeout")["outputs"] == []
    free = only(r.at(10.0).step("D", "handle_timeout"), "Free")
    assert free["key"] == "turn1-b" and free["reason"] == "expired"
    return r


def fixed_ttl_past_deadline() -> Recorder:
    r = Recorder(
        "fixed_ttl_past_deadline",
        "A fixed-TTL lease (1 s) whose first acknowledged round arrives after its deadline: the "
        "deadline, already past, is converted stretched by (1+rho)/(1-rho) (it happened at least "
        "that long ago in the accessor's clock), so valid_until lies in the past; the READ asks "
        "the pinner, which answers STALE.",
        BASE,
        {"D": pinner("decode-0", 0x5EED0405), "P": accessor("prefill-0")},
        {"D": 1200.0, "P": 77777.0},
    )
    t = r.at(0.0).step("D", "grant", key="turn-1", kind=1, ttl=1.0)["result"]
    hs = only(r.at(0.0).step("P", "track", key="turn-1", ticket=t), "HandshakeNeeded")
    connect(r, "P", "D", hs, 0.125)
    hb = outs(r.at(0.5).step("P", "handle_timeout"), "Send")[0]
    ack = only(r.at(0.75).deliver("D", hb), "Send")
    assert ack["message"]["renewed"] == 1
    assert r.at(1.5).deliver("P", ack, "the ack arrives after the deadline")["outputs"] == []
    dec = r.at(1.5).step("P", "begin_access", key="turn-1")["result"]
    assert dec["allowed"] and not dec["guaranteed"] and dec["valid_until"] < r.local("P")
    done = only(r.at(1.625).step("P", "access_finished", key="turn-1"), "Send")
    assert done["message"]["confirm"] is True
    verdict = only(r.at(1.75).deliver("D", done), "Send")
    assert verdict["message"]["outcome"] == int(AccessOutcome.STALE)
    assert only(r.at(1.875).deliver("P", verdict), "AccessStale")
    return r
