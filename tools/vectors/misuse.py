"""The vector of refusals: what the core must answer to messages it will not take, and to misuse.

    rejections_and_misuse

Spec rules (spec/PROTOCOL.md): a message that decodes but is refused is a `Rejected` output and
changes nothing; bytes that do not decode are a `DecodeError`; local misuse (time backwards, a
clock reading beyond 2**32 s, an id never issued, an access never begun, tracking twice) is a
`LocalProtocolError` (§8).
"""

from __future__ import annotations

from kvlease import (
    AccessDone,
    AccessDoneAck,
    AccessOutcome,
    Handshake,
    Heartbeat,
    HeartbeatAck,
    LocalTime,
    PeerTime,
    encode,
)

from ._common import BASE, Recorder, accessor, connect, only, pinner

__all__ = ["rejections_and_misuse"]


def rejections_and_misuse() -> Recorder:
    r = Recorder(
        "rejections_and_misuse",
        "Messages that decode but are refused are Rejected "
        "outputs (nothing else changes); bytes that do not decode are a DecodeError; "
        "local misuse (time running backwards, an id never issued, finishing an access "
        "never begun, tracking twice, a clock reading beyond 2**32 s) is a "
        "LocalProtocolError and changes nothing.",
        BASE,
        {"P": pinner("prefill-0", 0x5EED000E), "D": accessor("decode-0", session=0xD)},
        {"P": 50.0, "D": 60.0},
    )
    t1 = r.at(0.0).step("P", "grant", key="req-1")["result"]
    wrong = HeartbeatAck("decode-0", 0, 1, 0, 0xD, 1, LocalTime(1.0), PeerTime(1.0), 4.0, 0)
    assert only(r.at(0.5).step("P", "receive", hex=encode(wrong).hex()), "Rejected")["engine_id"] == "decode-0"
    future = Handshake("decode-0", 0, 1, 0xD, 7, 7, 1, LocalTime(60.5))
    resp = r.at(0.5).step(
        "P", "receive", note="handshake announcing a future protocol version (in a v2 frame)", hex=encode(future).hex()
    )
    assert [o["type"] for o in resp["outputs"]] == ["Rejected", "Send"]
    bad = r.at(0.5).step("P", "receive", hex="c14b9202")
    assert bad["error"]["class"] == "DecodeError"
    assert r.at(0.5).step("P", "receive", hex="4842")["error"]["category"] == "frame"
    back = r.step("P", "handle_timeout", note="time ran backwards", clock=r.local("P") - 0.25)
    assert back["error"]["class"] == "LocalProtocolError"
    huge = r.step("P", "handle_timeout", note="a clock reading beyond 2**32 s", clock=float(2**32) + 1.0)
    assert huge["error"]["class"] == "LocalProtocolError"
    assert r.at(0.5).step("P", "release", lease_id=99, note="never issued")["error"]["class"] == "LocalProtocolError"
    assert r.at(0.5).step("D", "access_finished", key="req-1")["error"]["class"] == "LocalProtocolError"
    hs = only(r.at(0.5).step("D", "track", key="req-1", ticket=t1), "HandshakeNeeded")
    assert r.at(0.5).step("D", "track", key="req-1", ticket=t1)["error"]["class"] == "LocalProtocolError"
    connect(r, "D", "P", hs, 0.75)
    bogus = AccessDone("decode-0", 3, 2, 0xD, 0x5EED000E, 0, 1, 1, False, LocalTime(61.0))
    rej = r.at(1.0).step("P", "receive", hex=encode(bogus).hex(), note="rank 3 of a 2-rank engine")
    assert only(rej, "Rejected")
    t2 = r.at(1.0).step("P", "grant", key="req-2", expected=2)["result"]
    one = AccessDone("decode-0", 0, 1, 0xD, 0x5EED000E, 0, int(t2["lease_id"]), 1, False, LocalTime(61.0))
    rej = r.at(1.0).step(
        "P", "receive", hex=encode(one).hex(), note="granted with expected=2; a 1-rank accessor's layout says 1"
    )
    assert only(rej, "Rejected")
    hb = Heartbeat("decode-0", 0, 1, 0xD, 0x5EED000E, 1, LocalTime(61.0), (1,))
    assert only(r.at(0.9 + 0.2).step("D", "receive", hex=encode(hb).hex()), "Rejected")
    alien = HeartbeatAck("prefill-0", 0, 0x5EED000E, 0, 0xE, 1, LocalTime(61.0), PeerTime(51.0), 4.0, 1)
    note = "an ack addressed to another session"
    assert only(r.at(1.2).step("D", "receive", hex=encode(alien).hex(), note=note), "Rejected")
    forged = AccessDoneAck("prefill-0", 0, 0x5EED000E, 0, 0xD, 1, 99, AccessOutcome.OK)
    note = "an unasked confirmation is ignored"
    assert r.at(1.3).step("D", "receive", hex=encode(forged).hex(), note=note)["outputs"] == []
    return r
