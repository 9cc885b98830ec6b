"""The codec vector: exact bytes of every message, and the bytes a decoder must refuse.

    codec

Spec rules (spec/PROTOCOL.md): the frame and the messages' fields in order (§4.1, §4.2); the vLLM
notifications (§4.4); sealed frames under a deployment key and its rotation (§4.5); `DecodeError`
and its categories (§8). Unlike the other families this is not a trace: every case is checked
against `kvlease.decode` (or `decode_vllm`, or `FrameAuth.open`) here before it is recorded.
"""

from __future__ import annotations

import msgpack

from kvlease import (
    PROTOCOL_VERSION,
    AccessDone,
    AccessDoneAck,
    AccessOutcome,
    DecodeError,
    FrameAuth,
    Handshake,
    HandshakeReply,
    Heartbeat,
    HeartbeatAck,
    LocalTime,
    Message,
    PeerTime,
    Release,
    decode,
    decode_vllm,
    encode,
    encode_vllm_done,
    encode_vllm_heartbeat,
)
from kvlease.conformance import JSON, VECTOR_FORMAT, JSONDict, message_to_json

__all__ = ["codec_cases"]


def codec_cases() -> JSONDict:
    valid_msgs: list[tuple[str, Message]] = [
        ("handshake", Handshake("decode-0", 1, 2, 0xACCE55, 3, 7, 1, LocalTime(98333.25))),
        (
            "handshake_reply",
            HandshakeReply(
                "prefill-0",
                0,
                2,
                0x5EED0001,
                3,
                7,
                1024,
                4.0,
                1e-4,
                0.5,
                1,
                0xACCE55,
                1,
                LocalTime(98333.25),
                PeerTime(14021.875),
                PeerTime(14021.875),
            ),
        ),
        (
            "heartbeat",
            Heartbeat("decode-0", 0, 1, 0xACCE55, 0x5EED0001, 3, LocalTime(98334.0), (1, 2, 3, 300, 70000, 2**63)),
        ),
        (
            "heartbeat_ack",
            HeartbeatAck(
                "prefill-0",
                1,
                0x5EED0001,
                0,
                0xACCE55,
                3,
                LocalTime(98334.0),
                PeerTime(14022.5),
                4.0,
                2,
                (7,),
                (8, 9),
                (),
                (12,),
            ),
        ),
        ("access_done", AccessDone("decode-0", 1, 2, 0xACCE55, 2**64 - 1, 1, 42, 17, True, LocalTime(98335.5))),
        ("access_done_ack", AccessDoneAck("prefill-0", 0, 5, 1, 0xACCE55, 42, 17, AccessOutcome.STALE)),
        ("release", Release("decode-0", 0, 1, 0xACCE55, 5, (4, 5, 900))),
        ("release_posted", Release("decode-0", 0, 1, 0xACCE55, 5, (4,), posted=True)),
        ("heartbeat_empty_ids", Heartbeat("d", 0, 1, 0, 0, 0, LocalTime(0.0), ())),
        ("heartbeat_largest_ranks", Heartbeat("d", 65535, 65536, 2**64 - 1, 0, 1, LocalTime(-(2.0**32)), (5,))),
    ]
    cases: list[JSON] = []
    for name, msg in valid_msgs:
        data = encode(msg)
        assert decode(data) == msg
        cases.append({"name": name, "codec": "native", "hex": data.hex(), "expect": {"message": message_to_json(msg)}})
    for name, raw in [
        ("vllm_heartbeat", encode_vllm_heartbeat(["cmpl-1", "cmpl-2:x"])),
        ("vllm_done", encode_vllm_done("cmpl-7", 4)),
        ("vllm_done_id_with_colon_last_wins", b"a:b:3"),
    ]:
        cases.append(
            {"name": name, "codec": "vllm", "hex": raw.hex(), "expect": {"message": message_to_json(decode_vllm(raw))}}
        )

    def frame(*items: object) -> bytes:
        body = msgpack.packb(list(items), use_bin_type=True)
        assert isinstance(body, bytes)
        return b"\xc1\x4b" + body

    # Heartbeat fields after [version, type]: engine_id, rank, ranks, session, incarnation, seq, t_send, ids
    hb_ok = ["decode-0", 0, 1, 7, 1, 1, 1.0, [1, 2]]
    V = PROTOCOL_VERSION

    # HandshakeReply fields after [version, type], v3: the pinner states its terms.
    reply_ok: dict[str, object] = {
        "engine_id": "p",
        "rank": 0,
        "ranks": 1,
        "incarnation": 5,
        "version": V,
        "capabilities": 7,
        "max_message_bytes": 1024,
        "extension": 4.0,
        "max_drift_rate": 1e-4,
        "max_access_time": 0.5,
        "to_rank": 0,
        "to_session": 7,
        "seq": 1,
        "t_echo": 1.0,
        "t_recv": 2.0,
        "t_send": 2.0,
    }

    def reply(**change: object) -> bytes:
        return frame(V, 2, *({**reply_ok, **change}).values())

    def hb(**change: object) -> bytes:
        names = ["engine_id", "rank", "ranks", "session", "incarnation", "seq", "t_send", "ids"]
        items = [change.get(n, v) for n, v in zip(names, hb_ok, strict=True)]
        return frame(V, 3, *items)

    bad: list[tuple[str, str, bytes, list[JSON]]] = [
        ("empty", "native", b"", ["frame"]),
        ("wrong_magic", "native", b"\xc1\x4c" + msgpack.packb([V, 3]), ["frame"]),
        ("vllm_bytes_to_native", "native", b"HB:req-1", ["frame"]),
        ("magic_only", "native", b"\xc1\x4b", ["body"]),
        ("truncated_body", "native", encode(valid_msgs[2][1])[:-3], ["body"]),
        ("trailing_bytes", "native", encode(valid_msgs[2][1]) + b"\x00", ["body"]),
        ("not_an_array", "native", b"\xc1\x4b" + msgpack.packb(7), ["body"]),
        ("array_too_short", "native", frame(V), ["body"]),
        ("map_body", "native", b"\xc1\x4b" + msgpack.packb({"v": V}), ["body"]),
        ("version_1", "native", frame(1, 3, "decode-0", 0, 1, 1, 1.0, [1, 2]), ["version"]),
        ("version_2", "native", frame(2, 3, *hb_ok), ["version"]),  # v2 and v3 refuse each other
        ("version_4", "native", frame(4, 3, *hb_ok), ["version"]),
        ("version_0", "native", frame(0, 3, *hb_ok), ["version"]),
        ("version_bool", "native", frame(True, 3, *hb_ok), ["version"]),
        ("type_unknown", "native", frame(V, 99, *hb_ok), ["type"]),
        ("type_zero", "native", frame(V, 0, *hb_ok), ["type"]),
        ("arity_short", "native", frame(V, 3, *hb_ok[:-1]), ["arity"]),
        ("arity_long", "native", frame(V, 3, *hb_ok, 0), ["arity"]),
        ("engine_empty", "native", hb(engine_id=""), ["field"]),
        ("engine_not_str", "native", hb(engine_id=5), ["field"]),
        ("engine_too_long", "native", hb(engine_id="e" * 257), ["body", "field"]),
        ("engine_binary", "native", hb(engine_id=b"decode-0"), ["body", "field"]),
        ("rank_negative", "native", hb(rank=-1), ["field"]),
        ("rank_bool", "native", hb(rank=True), ["field"]),
        ("rank_float", "native", hb(rank=0.0), ["field"]),
        ("ranks_zero", "native", hb(ranks=0), ["field"]),
        ("ranks_too_many", "native", hb(ranks=65537), ["field"]),
        ("session_negative", "native", hb(session=-1), ["field"]),
        ("time_nan", "native", hb(t_send=float("nan")), ["field"]),
        ("time_inf", "native", hb(t_send=float("inf")), ["field"]),
        ("time_beyond_2_32", "native", hb(t_send=2.0**32 + 1.0), ["field"]),
        ("time_string", "native", hb(t_send="1.0"), ["field"]),
        ("ids_zero_gap", "native", hb(ids=[5, 0]), ["field"]),
        ("ids_negative", "native", hb(ids=[-5]), ["field"]),
        ("ids_overflow_u64", "native", hb(ids=[2**64 - 1, 1]), ["field"]),
        ("ids_not_array", "native", hb(ids=5), ["field"]),
        ("handshake_ranks_zero", "native", frame(V, 1, "d", 0, 0, 7, V, 7, 1, 1.0), ["field"]),
        ("handshake_reply_max_message_bytes_zero", "native", reply(max_message_bytes=0), ["field"]),
        ("handshake_reply_extension_zero", "native", reply(extension=0.0), ["field"]),
        ("handshake_reply_extension_negative", "native", reply(extension=-6.0), ["field"]),
        ("handshake_reply_extension_beyond_2_32", "native", reply(extension=2.0**32 + 1.0), ["field"]),
        ("handshake_reply_drift_rate_one", "native", reply(max_drift_rate=1.0), ["field"]),
        ("handshake_reply_drift_rate_negative", "native", reply(max_drift_rate=-1e-4), ["field"]),
        ("handshake_reply_drift_rate_nan", "native", reply(max_drift_rate=float("nan")), ["field"]),
        ("handshake_reply_access_time_inf", "native", reply(max_access_time=float("inf")), ["field"]),
        ("handshake_reply_access_time_string", "native", reply(max_access_time="0.5"), ["field"]),
        (
            "heartbeat_ack_extension_zero",
            "native",
            frame(V, 4, "p", 0, 5, 0, 7, 1, 1.0, 2.0, 0.0, 0, [], [], [], []),
            ["field"],
        ),
        ("access_done_confirm_int", "native", frame(V, 5, "d", 0, 1, 7, 5, 0, 1, 1, 0, 1.0), ["field"]),
        ("access_done_to_rank_negative", "native", frame(V, 5, "d", 0, 1, 7, 5, -1, 1, 1, True, 1.0), ["field"]),
        ("access_done_v2_arity", "native", frame(V, 5, "d", 0, 1, 7, 5, 1, 1, True, 1.0), ["arity"]),
        ("access_done_ack_outcome_3", "native", frame(V, 6, "p", 0, 5, 0, 7, 1, 1, 3), ["field"]),
        ("release_ranks_zero", "native", frame(V, 7, "d", 0, 0, 7, 5, [1], False), ["field"]),
        ("release_posted_int", "native", frame(V, 7, "d", 0, 1, 7, 5, [1], 1), ["field"]),
        ("release_v2_arity", "native", frame(V, 7, "d", 0, 1, 7, 5, [1]), ["arity"]),
        ("vllm_empty", "vllm", b"", ["frame"]),
        ("vllm_not_utf8", "vllm", b"HB:\xff\xfe", ["frame"]),
        ("vllm_no_colon", "vllm", b"req-1", ["frame"]),
        ("vllm_heartbeat_empty_id", "vllm", b"HB:a,,b", ["field"]),
        ("vllm_done_count_zero", "vllm", b"req-1:0", ["field"]),
        ("vllm_done_count_huge", "vllm", b"req-1:65537", ["field"]),
        ("vllm_done_count_not_digits", "vllm", b"req-1:x1", ["field"]),
        ("vllm_done_empty_id", "vllm", b":3", ["frame"]),
    ]
    # Sealed frames (deployment-key authentication): a test key, and the previous one of a
    # rotation. An implementation must accept exactly these tags and refuse the rest.
    key_new, key_old = bytes(range(16)), bytes(range(200, 232))
    sealed_new, sealed_old = FrameAuth([key_new]), FrameAuth([key_old])
    rotating: list[JSON] = [key_new.hex(), key_old.hex()]
    for name, msg in valid_msgs[:7]:
        data = sealed_new.seal(encode(msg))
        cases.append(
            {
                "name": f"sealed_{name}",
                "codec": "sealed",
                "keys": [key_new.hex()],
                "hex": data.hex(),
                "expect": {"message": message_to_json(msg)},
            }
        )
    hb_msg = valid_msgs[2][1]
    cases.append(
        {
            "name": "sealed_with_the_previous_key_during_a_rotation",
            "codec": "sealed",
            "keys": rotating,
            "hex": sealed_old.seal(encode(hb_msg)).hex(),
            "expect": {"message": message_to_json(hb_msg)},
        }
    )
    good = sealed_new.seal(encode(hb_msg))
    tampered = bytearray(good)
    tampered[-1] ^= 1
    tag_flipped = bytearray(good)
    tag_flipped[5] ^= 0x80
    for name, raw in [
        ("sealed_unsealed_frame_refused", encode(hb_msg)),
        ("sealed_with_another_key", sealed_old.seal(encode(hb_msg))),
        ("sealed_body_tampered", bytes(tampered)),
        ("sealed_tag_tampered", bytes(tag_flipped)),
        ("sealed_truncated_tag", good[:10]),
        ("sealed_vllm_notification_refused", encode_vllm_heartbeat(["req-1"])),
    ]:
        try:
            decode(sealed_new.open(raw))
        except Exception as exc:
            assert isinstance(exc, DecodeError) and exc.category == "auth", (name, exc)
        else:
            raise AssertionError(f"{name} opened")
        cases.append(
            {
                "name": name,
                "codec": "sealed",
                "keys": [key_new.hex()],
                "hex": raw.hex(),
                "expect": {"error": {"class": "DecodeError", "category": ["auth"]}},
            }
        )
    for name, codec, raw, cats in bad:
        fn = decode if codec == "native" else decode_vllm
        try:
            fn(raw)
        except Exception as exc:
            assert isinstance(exc, DecodeError), (name, exc)
            assert exc.category in cats, (name, str(exc), exc.category, cats)
        else:
            raise AssertionError(f"{name} decoded")
        cases.append(
            {
                "name": name,
                "codec": codec,
                "hex": raw.hex(),
                "expect": {"error": {"class": "DecodeError", "category": cats}},
            }
        )
    return {
        "format": VECTOR_FORMAT,
        "kind": "codec",
        "name": "codec",
        "description": "Exact bytes of every message type (decode must yield exactly these "
        "fields) and malformed byte strings that must be rejected with DecodeError of the given "
        "category (any one of those listed).",
        "cases": cases,
    }
