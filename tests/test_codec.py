"""The native codec: every message round-trips; `decode` raises only `DecodeError` whatever the
bytes (random, or valid frames mutated field by field); `encode` refuses what the wire cannot
carry with `EncodeError`; id lists split under any byte budget."""

from __future__ import annotations

import math
import struct
from typing import Any

import msgpack
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvlease import (
    PROTOCOL_VERSION,
    AccessDone,
    AccessDoneAck,
    AccessOutcome,
    DecodeError,
    EncodeError,
    Handshake,
    HandshakeReply,
    Heartbeat,
    HeartbeatAck,
    LocalTime,
    Message,
    PeerTime,
    Release,
    decode,
    encode,
    is_native_frame,
    split_ids,
)
from kvlease._codec import MAGIC, MAX_ENGINE_ID_BYTES, ids_encoded_size

U64 = st.integers(0, 2**64 - 1)
SMALL = st.integers(0, 2**16)
TIMES = st.floats(allow_nan=False, allow_infinity=False, width=64)
ENGINES = st.text(min_size=1, max_size=40).filter(lambda s: 0 < len(s.encode("utf-8", "surrogatepass")) <= 256).filter(
    lambda s: not any(0xD800 <= ord(c) <= 0xDFFF for c in s)
)
IDS = st.lists(st.integers(0, 2**64 - 1), max_size=60, unique=True).map(lambda v: tuple(sorted(v)))

MESSAGES: st.SearchStrategy[Message] = st.one_of(
    st.builds(Handshake, ENGINES, SMALL, st.integers(1, 2**16), U64, U64, TIMES.map(LocalTime)),
    st.builds(
        HandshakeReply, ENGINES, SMALL, st.integers(1, 2**16), U64, U64, U64, st.integers(1, 2**32),
        TIMES.map(PeerTime), TIMES.map(PeerTime), TIMES.map(PeerTime),
    ),
    st.builds(Heartbeat, ENGINES, SMALL, U64, U64, TIMES.map(LocalTime), IDS),
    st.builds(
        HeartbeatAck, ENGINES, SMALL, U64, U64, TIMES.map(PeerTime), TIMES.map(PeerTime), U64, IDS, IDS, IDS, IDS
    ),
    st.builds(AccessDone, ENGINES, SMALL, U64, U64, st.integers(1, 2**16), st.booleans(), TIMES.map(LocalTime)),
    st.builds(AccessDoneAck, ENGINES, SMALL, U64, U64, st.sampled_from(AccessOutcome)),
    st.builds(Release, ENGINES, SMALL, U64, IDS, st.integers(1, 2**16)),
)


@given(MESSAGES)
def test_every_message_round_trips(msg: Message) -> None:
    data = encode(msg)
    assert is_native_frame(data)
    assert decode(data) == msg
    assert decode(bytearray(data)) == msg
    assert decode(memoryview(data)) == msg


@given(IDS)
def test_ids_encoded_size_is_exact(ids: tuple[int, ...]) -> None:
    hb = Heartbeat("e", 0, 0, 0, LocalTime(0.0), ids)
    empty = Heartbeat("e", 0, 0, 0, LocalTime(0.0), ())
    assert len(encode(hb)) - len(encode(empty)) == ids_encoded_size(ids) - 1


@given(IDS, st.integers(16, 600))
def test_split_ids_respects_budget_and_keeps_every_id(ids: tuple[int, ...], budget: int) -> None:
    chunks = split_ids(ids, budget)
    assert tuple(i for c in chunks for i in c) == ids
    assert all(c for c in chunks) or chunks == [()]
    for c in chunks:
        assert ids_encoded_size(c) <= budget


def test_split_ids_many_ids_fit_a_small_message() -> None:
    ids = tuple(range(1, 10_001, 3)) + tuple(range(2**40, 2**40 + 7000 * 1_000_003, 1_000_003))
    for max_bytes in (128, 256, 1024):
        budget = max_bytes - 80
        chunks = split_ids(ids, budget)
        assert len(chunks) > 1
        for c in chunks:
            assert len(encode(Heartbeat("decode-0", 3, 2**63, 2**40, LocalTime(1e5), c))) <= max_bytes


def test_split_ids_rejects_tiny_budget_and_handles_empty() -> None:
    with pytest.raises(EncodeError, match="too small"):
        split_ids((1, 2), 15)
    assert split_ids((), 16) == [()]


# -- encode refuses what the wire cannot carry ------------------------------------------------

BAD_ENCODES: list[tuple[Message, str]] = [
    (Heartbeat("", 0, 0, 0, LocalTime(0.0), ()), "engine_id"),
    (Heartbeat("x" * (MAX_ENGINE_ID_BYTES + 1), 0, 0, 0, LocalTime(0.0), ()), "engine_id"),
    (Heartbeat("\udcff", 0, 0, 0, LocalTime(0.0), ()), "UTF-8"),
    (Heartbeat("e", -1, 0, 0, LocalTime(0.0), ()), "rank"),
    (Heartbeat("e", 0, 2**64, 0, LocalTime(0.0), ()), "incarnation"),
    (Heartbeat("e", 0, 0, True, LocalTime(0.0), ()), "seq"),  # type: ignore[arg-type]
    (Heartbeat("e", 0, 0, 0, LocalTime(math.nan), ()), "t_send"),
    (Heartbeat("e", 0, 0, 0, LocalTime(math.inf), ()), "t_send"),
    (Heartbeat("e", 0, 0, 0, LocalTime(0.0), (3, 2)), "strictly increasing"),
    (Heartbeat("e", 0, 0, 0, LocalTime(0.0), (1, 1)), "strictly increasing"),
    (Heartbeat("e", 0, 0, 0, LocalTime(0.0), (-1,)), "uint64"),
    (Release("e", 0, 0, (2**64,)), "uint64"),
    (HeartbeatAck("e", 0, 0, 0, PeerTime(0.0), PeerTime(-math.inf), 0), "t_recv"),
    (AccessDone("e", 0, 0, -5, 1, False, LocalTime(0.0)), "lease_id"),
    (AccessDoneAck("e", 0, 0, 1.5, AccessOutcome.OK), "lease_id"),  # type: ignore[arg-type]
    (Handshake("e", 0, 1, 1, -1, LocalTime(0.0)), "capabilities"),
    (HandshakeReply("e", 0, 1, 0, 1, 0, -3, PeerTime(0.0), PeerTime(0.0), PeerTime(0.0)), "max_message_bytes"),
]


@pytest.mark.parametrize(("msg", "what"), BAD_ENCODES)
def test_encode_refuses_unrepresentable_values(msg: Message, what: str) -> None:
    with pytest.raises(EncodeError, match=what):
        encode(msg)


def test_encode_refuses_non_messages() -> None:
    with pytest.raises(EncodeError, match="not a kvlease message"):
        encode("hello")  # type: ignore[arg-type]


# -- decode raises only DecodeError -------------------------------------------------------------


def _decode_only_decode_error(data: Any) -> Message | None:
    try:
        return decode(data)
    except DecodeError:
        return None


@given(st.binary(max_size=300))
@example(b"")
@example(MAGIC)
@example(MAGIC + b"\xdd\xff\xff\xff\xff")  # array32 header claiming 4G elements
@example(MAGIC + b"\xc1")
def test_decode_arbitrary_bytes(data: bytes) -> None:
    _decode_only_decode_error(data)


@given(st.binary(max_size=200))
def test_decode_arbitrary_msgpack_after_magic(data: bytes) -> None:
    _decode_only_decode_error(MAGIC + data)


# Values that break field types and bounds.
WEIRD = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308]),
    st.floats(),
    st.text(max_size=5),
    st.binary(max_size=5),
    st.lists(st.integers(-3, 3), max_size=4),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)


@given(MESSAGES, st.data())
def test_decode_structured_mutations(msg: Message, data: st.DataObject) -> None:
    frame = encode(msg)
    items: list[Any] = msgpack.unpackb(frame[2:], raw=False)
    op = data.draw(st.sampled_from(["replace", "drop", "append", "zero_gap", "negative", "bitflip", "truncate"]))
    if op == "replace":
        i = data.draw(st.integers(0, len(items) - 1))
        items[i] = data.draw(WEIRD)
    elif op == "drop":
        del items[data.draw(st.integers(0, len(items) - 1))]
    elif op == "append":
        items.append(data.draw(WEIRD))
    elif op in ("zero_gap", "negative"):
        lists = [i for i, v in enumerate(items) if isinstance(v, list)]
        if lists:
            i = data.draw(st.sampled_from(lists))
            if op == "zero_gap":  # a gap of 0 repeats an id: never valid after the first
                items[i] = [*items[i], 0] if items[i] else [1, 0]
            else:
                items[i] = [-1, *items[i]]
            assert _decode_only_decode_error(MAGIC + msgpack.packb(items)) is None
            return
        items[data.draw(st.integers(2, len(items) - 1))] = -1
    if op == "bitflip":
        raw = bytearray(frame)
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] ^= 1 << data.draw(st.integers(0, 7))
        _decode_only_decode_error(bytes(raw))
        return
    if op == "truncate":
        cut = data.draw(st.integers(0, len(frame) - 1))
        assert _decode_only_decode_error(frame[:cut]) is None
        return
    try:
        body = msgpack.packb(items, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return
    out = _decode_only_decode_error(MAGIC + body)
    if out is not None:
        assert encode(out) == MAGIC + body or decode(encode(out)) == out


def _str_raw(b: bytes) -> bytes:
    """A msgpack str header followed by raw (possibly invalid UTF-8) bytes."""
    return bytes([0xA0 | len(b)]) + b


HB_BODY_TAIL = b"\x00\x00\x00" + struct.pack(">Bd", 0xCB, 1.0) + b"\x90"


@pytest.mark.parametrize(
    ("data", "what"),
    [
        (b"\x00\x01", "not a kvlease frame"),
        (MAGIC + msgpack.packb([PROTOCOL_VERSION + 1, 3]), "version"),
        (MAGIC + msgpack.packb([True, 3]), "version"),
        (MAGIC + msgpack.packb([PROTOCOL_VERSION, 99]), "unknown message type"),
        (MAGIC + msgpack.packb({"a": 1}), "expected an array|malformed"),
        (MAGIC + msgpack.packb([PROTOCOL_VERSION, 3, "e"]), "expects 6 fields"),
        (MAGIC + b"\x97\x01\x03" + _str_raw(b"\xff\xfe") + HB_BODY_TAIL, "malformed"),
        (MAGIC + msgpack.packb([PROTOCOL_VERSION, 3, "e", 0, 0, 0, math.nan, []]), "finite"),
        (MAGIC + msgpack.packb([PROTOCOL_VERSION, 3, "e", 0, 0, 0, math.inf, []]), "finite"),
        (MAGIC + msgpack.packb([PROTOCOL_VERSION, 3, "e", 0, 0, 0, 1.0, [5, 0]]), "positive gap"),
        (MAGIC + msgpack.packb([PROTOCOL_VERSION, 3, "e", 0, 0, 0, 1.0, [2**64 - 1, 1]]), "exceeds uint64"),
        (MAGIC + msgpack.packb([PROTOCOL_VERSION, 3, "e", 0, 0, 0, 1.0, "x"]), "array of ids"),
        (MAGIC + msgpack.packb([PROTOCOL_VERSION, 3, "e", -1, 0, 0, 1.0, []]), "rank"),
        (MAGIC + msgpack.packb([PROTOCOL_VERSION, 3, "", 0, 0, 0, 1.0, []]), "engine_id"),
        (MAGIC + msgpack.packb([PROTOCOL_VERSION, 5, "e", 0, 0, 1, 0, True, 1.0]), "expected"),
        (MAGIC + msgpack.packb([PROTOCOL_VERSION, 5, "e", 0, 0, 1, 1, 1, 1.0]), "boolean"),
        (MAGIC + msgpack.packb([PROTOCOL_VERSION, 6, "e", 0, 0, 1, 9]), "outcome"),
        (MAGIC + msgpack.packb([PROTOCOL_VERSION, 3, "e", 0, 0, 0, 1.0, [1] * ((1 << 17) + 1)]), "malformed"),
        (MAGIC + b"\x00" * (1 << 20), "exceeds"),
    ],
)
def test_decode_rejects_with_a_precise_reason(data: bytes, what: str) -> None:
    with pytest.raises(DecodeError, match=what):
        decode(data)


def test_decode_rejects_non_bytes() -> None:
    with pytest.raises(DecodeError, match="expected bytes"):
        decode("text")  # type: ignore[arg-type]


def test_decode_accepts_integer_times() -> None:
    """Another implementation may send a whole-number time as an int; it means the same."""
    msg = decode(MAGIC + msgpack.packb([PROTOCOL_VERSION, 3, "e", 0, 0, 0, 7, [1, 2]]))
    assert msg == Heartbeat("e", 0, 0, 0, LocalTime(7.0), (1, 3))


def test_a_float_version_is_not_version_1() -> None:
    """msgpack floats compare equal to ints; the version must be the integer 1."""
    import msgpack

    from kvlease import DecodeError, decode

    body = msgpack.packb([1.0, 7, "decode-0", 0, 5, [1], 1])
    with pytest.raises(DecodeError, match="version"):
        decode(b"\xc1\x4b" + body)
    assert decode(b"\xc1\x4b" + msgpack.packb([1, 7, "decode-0", 0, 5, [1], 1])).lease_ids == (1,)  # type: ignore[union-attr]
