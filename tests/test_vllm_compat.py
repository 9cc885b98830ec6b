"""vLLM's native lease notifications: ``b"HB:" + b",".join(ids)`` and ``f"{id}:{count}"``.

Real vLLM byte strings decode; ids the format cannot carry are refused at encode time with
`EncodeError` naming the problem; `decode_vllm` raises only `DecodeError`; and a pinner with
``vllm_compat=True`` renews and completes leases from them.
"""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlease import (
    AccessDone,
    AccessDoneAck,
    AccessOutcome,
    DecodeError,
    EncodeError,
    EndReason,
    Free,
    Heartbeat,
    HeartbeatAck,
    LeaseConfig,
    LocalProtocolError,
    LocalTime,
    Pinner,
    Rejected,
    Send,
    VllmAccessDone,
    VllmHeartbeat,
    decode_vllm,
    encode_vllm_done,
    encode_vllm_heartbeat,
    is_native_frame,
)

# Request ids as vLLM makes them (uuid-like with a prefix, and the P/D "-prefill" suffixes).
REAL_IDS = [
    "cmpl-8f14e45fceea167a5a36dedd4bea2543-0",
    "chatcmpl-a1b2c3d4e5f6",
    "___prefill_addr_10.0.0.1:8000___decode_addr_10.0.0.2:8001_9f3a",
]


def test_real_vllm_heartbeat_bytes() -> None:
    data = b"HB:cmpl-8f14e45fceea167a5a36dedd4bea2543-0,chatcmpl-a1b2c3d4e5f6"
    assert decode_vllm(data) == VllmHeartbeat(("cmpl-8f14e45fceea167a5a36dedd4bea2543-0", "chatcmpl-a1b2c3d4e5f6"))
    assert not is_native_frame(data)


def test_real_vllm_done_bytes_split_on_last_colon() -> None:
    # vLLM splits `id:count` on the last colon, so an id with colons still decodes.
    assert decode_vllm(b"cmpl-8f14e45f-0:2") == VllmAccessDone("cmpl-8f14e45f-0", 2)
    assert decode_vllm(REAL_IDS[2].encode() + b":1") == VllmAccessDone(REAL_IDS[2], 1)


@given(st.lists(st.sampled_from(REAL_IDS[:2]) | st.from_regex(r"[A-Za-z0-9_\-]{1,40}", fullmatch=True), min_size=1))
def test_heartbeat_round_trip(ids: list[str]) -> None:
    assert decode_vllm(encode_vllm_heartbeat(ids)) == VllmHeartbeat(tuple(ids))


@given(st.from_regex(r"[A-Za-z0-9_\-.]{1,60}", fullmatch=True), st.integers(1, 65536))
def test_done_round_trip(rid: str, count: int) -> None:
    assert decode_vllm(encode_vllm_done(rid, count)) == VllmAccessDone(rid, count)


@pytest.mark.parametrize(
    ("rid", "what"),
    [
        ("a,b", "','"),
        ("HB:x", "'HB:'"),
        ("", "empty"),
        ("\udcff", "UTF-8"),
        ("x" * 1025, "exceeds"),
        (7, "must be a str"),
    ],
)
def test_heartbeat_encode_refuses_tricky_ids(rid: object, what: str) -> None:
    with pytest.raises(EncodeError, match=what):
        encode_vllm_heartbeat([rid])  # type: ignore[list-item]


@pytest.mark.parametrize(("rid", "what"), [("a:b", "':'"), ("a,b", "','"), ("HB:", "'HB:'"), ("", "empty")])
def test_done_encode_refuses_tricky_ids(rid: str, what: str) -> None:
    with pytest.raises(EncodeError, match=what):
        encode_vllm_done(rid, 1)


def test_colon_is_fine_in_a_heartbeat_but_not_in_done() -> None:
    assert decode_vllm(encode_vllm_heartbeat(["a:b"])) == VllmHeartbeat(("a:b",))
    with pytest.raises(EncodeError):
        encode_vllm_done("a:b", 1)


@pytest.mark.parametrize("count", [0, -1, 65537, True, 1.0])
def test_done_encode_refuses_bad_counts(count: object) -> None:
    with pytest.raises(EncodeError, match="count"):
        encode_vllm_done("r", count)  # type: ignore[arg-type]


def test_heartbeat_encode_refuses_empty_and_huge() -> None:
    with pytest.raises(EncodeError, match="at least one"):
        encode_vllm_heartbeat([])
    with pytest.raises(EncodeError, match="exceeds"):
        encode_vllm_heartbeat(["x" * 1000] * 1100)


@pytest.mark.parametrize(
    ("data", "what"),
    [
        (b"HB:a,,b", "empty request id"),
        (b"HB:", "empty request id"),
        (b"HB:" + b"x" * 1025, "over 1024"),
        (b"\xff\xfe:1", "not UTF-8"),
        (b"no-colon", "not a vLLM notification"),
        (b":3", "not a vLLM notification"),
        (b"r:", "not a small integer"),
        (b"r:abc", "not a small integer"),
        (b"r:\xd9\xa3".decode("latin-1").encode(), "not a small integer"),
        ("r:\u0663".encode(), "not a small integer"),  # Arabic-Indic digit: isdigit() but not ASCII
        (b"r:0", "out of range"),
        (b"r:65537", "out of range"),
        (b"r:1234567", "not a small integer"),
        (b"x" * 1025 + b":1", "over 1024"),
        (b"x" * (1 << 20) + b":1", "exceeds"),
    ],
)
def test_decode_rejects(data: bytes, what: str) -> None:
    with pytest.raises(DecodeError, match=what):
        decode_vllm(data)


def test_decode_rejects_non_bytes() -> None:
    with pytest.raises(DecodeError, match="expected bytes"):
        decode_vllm("HB:a")  # type: ignore[arg-type]


@given(st.binary(max_size=200))
def test_decode_raises_only_decode_error(data: bytes) -> None:
    with contextlib.suppress(DecodeError):
        decode_vllm(data)


@given(st.text(max_size=60))
def test_decode_text_raises_only_decode_error(text: str) -> None:
    with contextlib.suppress(DecodeError):
        decode_vllm(text.encode("utf-8", "surrogatepass"))


# -- the pinner understands stock vLLM peers ---------------------------------------------------

CFG = LeaseConfig(kv_lease_duration=3.0, vllm_compat=True)


def test_pinner_compat_heartbeat_renews_by_request_id() -> None:
    p = Pinner(CFG, "prefill", 7)
    t = LocalTime(5e4)
    a = p.grant(t, REAL_IDS[0])
    b = p.grant(t, REAL_IDS[1])
    hb = decode_vllm(encode_vllm_heartbeat([REAL_IDS[0], "unknown-id"]))
    assert isinstance(hb, VllmHeartbeat)
    assert p.receive_vllm_heartbeat(LocalTime(t + 2.5), hb.request_ids) == 1
    info_a, info_b = p.info(a.lease_id), p.info(b.lease_id)
    assert info_a is not None and info_a.expiry == pytest.approx(t + 2.5 + CFG.lease_extension)
    assert info_b is not None and info_b.expiry == pytest.approx(t + 3.0)
    out = p.handle_timeout(LocalTime(t + 3.0))
    assert out == (Free(b.lease_id, REAL_IDS[1], EndReason.EXPIRED, LocalTime(t + 3.0)),)
    assert p.receive_vllm_heartbeat(LocalTime(t + 3.1), [REAL_IDS[1]]) == 0  # gone: nothing renewed


def test_pinner_compat_done_counts_workers() -> None:
    p = Pinner(CFG, "prefill", 7)
    t = LocalTime(1e5)
    tk = p.grant(t, "req-1")
    first = decode_vllm(encode_vllm_done("req-1", 2))
    assert isinstance(first, VllmAccessDone)
    assert p.receive_vllm_done(LocalTime(t + 0.1), first.request_id, first.count) == ()
    out = p.receive_vllm_done(LocalTime(t + 0.2), "req-1", 2)
    assert out == (Free(tk.lease_id, "req-1", EndReason.ACCESS_DONE, LocalTime(t + 0.2)),)
    # Late and unknown notifications are no-ops, never a second free.
    assert p.receive_vllm_done(LocalTime(t + 0.3), "req-1", 2) == ()
    assert p.receive_vllm_done(LocalTime(t + 0.3), "never", 1) == ()
    assert p.counters.late_access_done == 2


def test_pinner_compat_key_reuse_follows_the_newest_lease() -> None:
    p = Pinner(CFG, "prefill", 7)
    t = LocalTime(1e4)
    old = p.grant(t, "req")
    p.release(LocalTime(t + 0.1), old.lease_id)
    new = p.grant(LocalTime(t + 0.2), "req")
    assert p.receive_vllm_done(LocalTime(t + 0.3), "req", 1) == (
        Free(new.lease_id, "req", EndReason.ACCESS_DONE, LocalTime(t + 0.3)),
    )


def test_pinner_compat_needs_the_flag() -> None:
    p = Pinner(LeaseConfig(), "prefill", 7)
    with pytest.raises(LocalProtocolError, match="vllm_compat"):
        p.receive_vllm_heartbeat(LocalTime(1.0), ["a"])
    with pytest.raises(LocalProtocolError, match="vllm_compat"):
        p.receive_vllm_done(LocalTime(1.0), "a", 1)


# -- v2: binding between stock vLLM peers and kvlease accessors --------------------------------

SES = 0x5E55


def _native_hb(lid: int, inc: int = 7) -> Heartbeat:
    return Heartbeat("decode-0", 0, 1, SES, inc, 1, LocalTime(1.0), (lid,))


def test_a_lease_renewed_by_a_kvlease_accessor_ignores_vllm_notifications() -> None:
    p = Pinner(CFG, "prefill", 7)
    t = LocalTime(1e4)
    tk = p.grant(t, "req")
    (send,) = p.receive(LocalTime(t + 0.5), _native_hb(tk.lease_id))
    assert isinstance(send, Send) and isinstance(send.message, HeartbeatAck) and send.message.renewed == 1
    before = p.info(tk.lease_id)
    assert p.receive_vllm_heartbeat(LocalTime(t + 1.9), ["req"]) == 0  # not renewed for "vllm"
    assert p.info(tk.lease_id) == before
    (rej,) = p.receive_vllm_done(LocalTime(t + 2.0), "req", 1)
    assert isinstance(rej, Rejected) and rej.engine_id == "vllm"
    info = p.info(tk.lease_id)
    assert info is not None and info.accesses_done == 0


def test_a_lease_renewed_by_vllm_refuses_a_kvlease_accessor() -> None:
    p = Pinner(CFG, "prefill", 7)
    t = LocalTime(1e4)
    tk = p.grant(t, "req")
    assert p.receive_vllm_heartbeat(LocalTime(t + 0.5), ["req"]) == 1
    rej, send = p.receive(LocalTime(t + 1.0), _native_hb(tk.lease_id))
    assert isinstance(rej, Rejected) and isinstance(send, Send) and isinstance(send.message, HeartbeatAck)
    assert send.message.renewed == 0 and send.message.unknown == (tk.lease_id,)
    out = p.receive(LocalTime(t + 1.0), AccessDone("decode-0", 0, 1, SES, 7, 0, tk.lease_id, 3, True, LocalTime(2.0)))
    assert isinstance(out[0], Rejected)
    assert out[1] == Send("decode-0", 0, AccessDoneAck("prefill", 0, 7, 0, SES, tk.lease_id, 3, AccessOutcome.STALE))
    # The vLLM peer still completes it.
    assert p.receive_vllm_done(LocalTime(t + 1.1), "req", 1) == (
        Free(tk.lease_id, "req", EndReason.ACCESS_DONE, LocalTime(t + 1.1)),
    )


def test_vllm_notifications_at_expiry_are_late() -> None:
    p = Pinner(CFG, "prefill", 7)
    t = LocalTime(1e4)
    tk = p.grant(t, "req")
    at = LocalTime(t + CFG.kv_lease_duration)  # exactly the expiry, before handle_timeout
    assert p.receive_vllm_heartbeat(at, ["req"]) == 0
    assert p.receive_vllm_done(at, "req", 1) == ()
    assert p.counters.late_access_done == 1
    assert p.handle_timeout(at) == (Free(tk.lease_id, "req", EndReason.EXPIRED, at),)


def test_vllm_done_with_a_disagreeing_count_is_rejected() -> None:
    p = Pinner(CFG, "prefill", 7)
    t = LocalTime(1e4)
    tk = p.grant(t, "req", expected=2)
    (rej,) = p.receive_vllm_done(LocalTime(t + 0.1), "req", 3)
    assert isinstance(rej, Rejected) and "counts 3" in rej.reason
    assert p.receive_vllm_done(LocalTime(t + 0.2), "req", 2) == ()
    assert p.receive_vllm_done(LocalTime(t + 0.3), "req", 2) == (
        Free(tk.lease_id, "req", EndReason.ACCESS_DONE, LocalTime(t + 0.3)),
    )
