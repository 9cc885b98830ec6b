"""The native codec (protocol v2): every message round-trips over its whole domain; `encode`
refuses exactly what `decode` refuses (field by field, with values on both sides of every
bound); `decode` raises only `DecodeError` whatever the bytes (random, or valid frames mutated
field by field); and heartbeat id lists split so that both the heartbeat and the worst ack
answering it stay within `max_message_bytes`."""

from __future__ import annotations

import ast
import itertools
import math
import pickle
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import msgpack
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import kvlease
from kvlease import (
    DECODE_ERROR_CATEGORIES,
    MAX_RANKS,
    MAX_TIME,
    MIN_MESSAGE_BYTES,
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
from kvlease._codec import (
    MAGIC,
    MAX_DECODE_BYTES,
    MAX_ENGINE_ID_BYTES,
    MAX_IDS,
    MIN_ID_BUDGET,
    chunk_cost,
    heartbeat_id_budget,
    ids_encoded_size,
)

U64_MAX = 2**64 - 1
T_MAX = 2**32  # MAX_TIME as an integer

# -- the domain of every field, written independently of the codec's own table ---------------

#: Wire type numbers, in the spec's order.
TYPES: dict[type, int] = {
    Handshake: 1,
    HandshakeReply: 2,
    Heartbeat: 3,
    HeartbeatAck: 4,
    AccessDone: 5,
    AccessDoneAck: 6,
    Release: 7,
}
ID_LISTS = {"lease_ids", "unknown", "expired", "released", "completed"}
TIME_FIELDS = {"t_send", "t_echo", "t_recv"}


def kind_of(name: str) -> str:
    """The field kind, from the field's name (spec/PROTOCOL.md's message table)."""
    if name == "engine_id":
        return "engine"
    if name == "ranks":
        return "ranks"
    if name == "max_message_bytes":
        return "mmb"
    if name in TIME_FIELDS:
        return "time"
    if name in ("confirm", "posted"):
        return "bool"
    if name in ("extension", "max_access_time"):
        return "duration"
    if name == "max_drift_rate":
        return "rate"
    if name in ID_LISTS:
        return "ids"
    if name == "outcome":
        return "outcome"
    return "uint"  # rank, session, incarnation, version, capabilities, seq, to_rank, ...


def _utf8_len(s: str) -> int:
    return len(s.encode("utf-8"))


NO_SURROGATES = st.characters(exclude_categories=["Cs"])
ENGINES = st.one_of(
    st.text(NO_SURROGATES, min_size=1, max_size=40),
    st.text(NO_SURROGATES, min_size=1, max_size=256).filter(lambda s: _utf8_len(s) <= MAX_ENGINE_ID_BYTES),
    st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=250, max_size=256),  # the byte bound
    st.sampled_from(["e", "\u00e9" * 128, "\U0001f600" * 64]),  # 256 bytes of 2- and 4-byte characters
)
U64 = st.one_of(st.integers(0, U64_MAX), st.sampled_from([0, 127, 128, 255, 256, 65535, 65536, 2**32, U64_MAX]))
RANKS = st.one_of(st.integers(1, MAX_RANKS), st.sampled_from([1, MAX_RANKS]))
MMB = st.one_of(st.integers(1, U64_MAX), st.sampled_from([1, MIN_MESSAGE_BYTES, U64_MAX]))
TIMES = st.one_of(
    st.floats(-MAX_TIME, MAX_TIME, allow_nan=False),
    st.sampled_from([-MAX_TIME, MAX_TIME, 0.0, -0.0, 5e-324]),
    st.integers(-T_MAX, T_MAX),  # another implementation may send a whole time as an int
)
IDS = st.one_of(
    st.lists(st.integers(0, U64_MAX), max_size=60, unique=True),
    st.lists(st.integers(0, 400), max_size=60, unique=True),
    st.sampled_from([[0], [U64_MAX], [0, U64_MAX], [U64_MAX - 1, U64_MAX]]),
).map(lambda v: tuple(sorted(v)))
OUTCOMES = st.sampled_from(AccessOutcome)

VALID: dict[str, st.SearchStrategy[Any]] = {
    "engine": ENGINES,
    "uint": U64,
    "ranks": RANKS,
    "mmb": MMB,
    "time": TIMES,
    "bool": st.booleans(),
    "ids": IDS,
    "outcome": OUTCOMES,
    "duration": st.one_of(
        st.floats(min_value=5e-324, max_value=MAX_TIME), st.sampled_from([5e-324, 1e-3, 6.0, MAX_TIME])
    ),
    "rate": st.one_of(st.floats(min_value=0.0, max_value=1.0, exclude_max=True), st.sampled_from([0.0, 1e-4])),
}


def _message(cls: type) -> st.SearchStrategy[Message]:
    return st.builds(cls, **{f.name: VALID[kind_of(f.name)] for f in attrs.fields(cls)})


MESSAGES: st.SearchStrategy[Message] = st.one_of(*(_message(cls) for cls in TYPES))


def _deltas(ids: Sequence[Any]) -> list[Any]:
    return [v if i == 0 else v - ids[i - 1] for i, v in enumerate(ids)]


def _wire(name: str, v: Any) -> Any:
    """What the spec says the field looks like inside the msgpack array."""
    kind = kind_of(name)
    if kind in ("time", "duration", "rate") and isinstance(v, int | float) and not isinstance(v, bool):
        return float(v)
    if kind == "ids" and isinstance(v, tuple):
        return _deltas(v)
    if kind == "outcome" and isinstance(v, AccessOutcome):
        return int(v)
    return v


def _body(msg: Message) -> list[Any]:
    """The spec's frame body: [version, type, every field in constructor order]."""
    return [PROTOCOL_VERSION, TYPES[type(msg)], *(_wire(f.name, getattr(msg, f.name)) for f in attrs.fields(type(msg)))]


M = TypeVar("M", bound=Message)


def _decode_as(data: bytes, kind: type[M]) -> M:
    """`decode(data)`, which must be a `kind`."""
    msg = decode(data)
    assert isinstance(msg, kind), msg
    return msg


def _frame(body: list[Any]) -> bytes:
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return MAGIC + packed


# -- round trips --------------------------------------------------------------------------------


@given(MESSAGES)
def test_every_message_round_trips(msg: Message) -> None:
    data = encode(msg)
    assert is_native_frame(data) and is_native_frame(bytearray(data)) and is_native_frame(memoryview(data))
    assert decode(data) == msg
    assert decode(bytearray(data)) == msg
    assert decode(memoryview(data)) == msg


@given(MESSAGES)
def test_the_frame_is_the_fields_in_constructor_order(msg: Message) -> None:
    """Whatever path encodes it (the fast one or the table-driven one), the bytes are the
    spec's array, and decoding the spec's array gives the message back."""
    expected = _frame(_body(msg))
    assert encode(msg) == expected
    assert decode(expected) == msg


@pytest.mark.parametrize(
    "msg",
    [
        Handshake("a", U64_MAX, MAX_RANKS, U64_MAX, U64_MAX, U64_MAX, U64_MAX, LocalTime(-MAX_TIME)),
        HandshakeReply(
            "p" * MAX_ENGINE_ID_BYTES,
            0,
            1,
            0,
            0,
            0,
            1,
            86400.0,
            0.0,
            1e-3,
            0,
            0,
            0,
            LocalTime(MAX_TIME),
            PeerTime(-MAX_TIME),
            PeerTime(0.0),
        ),
        HandshakeReply(
            "p",
            1,
            MAX_RANKS,
            2,
            3,
            4,
            U64_MAX,
            86400.0,
            0.0,
            1e-3,
            5,
            U64_MAX,
            6,
            LocalTime(1.0),
            PeerTime(2.0),
            PeerTime(3.0),
        ),
        Heartbeat("d", 65535, MAX_RANKS, U64_MAX, U64_MAX, U64_MAX, LocalTime(MAX_TIME), (0, 1, U64_MAX)),
        Heartbeat("d", 0, 1, 0, 0, 0, LocalTime(0.0), ()),
        HeartbeatAck(
            "p",
            U64_MAX,
            U64_MAX,
            U64_MAX,
            U64_MAX,
            U64_MAX,
            LocalTime(-MAX_TIME),
            PeerTime(MAX_TIME),
            86400.0,
            U64_MAX,
            (0,),
            (1,),
            (U64_MAX - 1,),
            (U64_MAX,),
        ),
        AccessDone("d", 0, MAX_RANKS, U64_MAX, 0, 0, U64_MAX, U64_MAX, True, LocalTime(MAX_TIME)),
        AccessDoneAck("p", 0, 0, 65535, U64_MAX, U64_MAX, 0, AccessOutcome.UNKNOWN),
        Release("d", 3, 4, 5, 6, (U64_MAX,)),
    ],
)
def test_boundary_values_round_trip(msg: Message) -> None:
    assert decode(encode(msg)) == msg
    assert encode(msg) == _frame(_body(msg))


@given(IDS)
def test_ids_encoded_size_is_exact(ids: tuple[int, ...]) -> None:
    hb = Heartbeat("e", 0, 1, 0, 0, 0, LocalTime(0.0), ids)
    empty = Heartbeat("e", 0, 1, 0, 0, 0, LocalTime(0.0), ())
    assert len(encode(hb)) - len(encode(empty)) == ids_encoded_size(ids) - 1


# -- encode refuses exactly what decode refuses -------------------------------------------------

#: Values just outside (and some just inside) each field's domain; both sides must agree.
PROBES: dict[str, st.SearchStrategy[Any]] = {
    "engine": st.one_of(
        st.sampled_from(["", "x" * (MAX_ENGINE_ID_BYTES + 1), "\u00e9" * 129, "x" * MAX_ENGINE_ID_BYTES, None, 5]),
        st.text(max_size=300),  # may hold lone surrogates or exceed 256 bytes
        st.binary(max_size=4),
    ),
    "uint": st.one_of(
        st.sampled_from([-1, 0, U64_MAX, U64_MAX + 1, -(2**63), True, False, 1.5, 0.0, None, "1"]),
        st.integers(-(2**64), 2**65),
    ),
    "ranks": st.one_of(
        st.sampled_from([0, 1, MAX_RANKS, MAX_RANKS + 1, -1, U64_MAX, True, 1.0, None]),
        st.integers(-5, 70_000),
    ),
    "mmb": st.sampled_from([0, 1, -1, U64_MAX, U64_MAX + 1, True, 2.0, None]),
    "time": st.one_of(
        st.sampled_from(
            [
                math.nan,
                math.inf,
                -math.inf,
                MAX_TIME,
                -MAX_TIME,
                MAX_TIME + 1,
                -(MAX_TIME + 1),
                math.nextafter(MAX_TIME, math.inf),
                T_MAX,
                T_MAX + 1,
                -T_MAX - 1,
                2**63,
                1e308,
                True,
                None,
                "1.0",
            ]
        ),
        st.floats(),
        st.integers(-(2**33), 2**33),
    ),
    "bool": st.sampled_from([True, False, 0, 1, None, "true"]),
    "duration": st.one_of(
        st.sampled_from([0, 0.0, -0.0, -1.0, 5e-324, 1, MAX_TIME, MAX_TIME + 1, T_MAX, T_MAX + 1, math.nan, math.inf]),
        st.sampled_from([True, None, "1.0"]),
        st.floats(),
        st.integers(-(2**33), 2**33),
    ),
    "rate": st.one_of(
        st.sampled_from([0, 0.0, -0.0, 1e-4, 0.5, math.nextafter(1.0, 0.0), 1, 1.0, -1e-9, math.nan, math.inf]),
        st.sampled_from([True, None, "0"]),
        st.floats(),
    ),
    "ids": st.one_of(
        st.sampled_from([(3, 2), (1, 1), (-1,), (U64_MAX + 1,), (0, U64_MAX + 1), (True,), (1.5,), (0,), ()]),
        st.lists(st.integers(-3, 2**64 + 3), max_size=6).map(tuple),
    ),
    # A plain int is not an AccessOutcome to `encode`, yet on the wire 0..2 are outcomes: not probed.
    "outcome": st.sampled_from([*AccessOutcome, -1, 3, 2**63, True, None, "OK"]),
}


def _packable(v: Any) -> bool:
    try:
        msgpack.packb(v, use_bin_type=True)
    except (TypeError, ValueError, OverflowError, UnicodeEncodeError):
        return False
    return True


@given(MESSAGES, st.data())
def test_encode_accepts_exactly_what_decode_accepts(msg: Message, data: st.DataObject) -> None:
    fields = attrs.fields(type(msg))
    i = data.draw(st.integers(0, len(fields) - 1))
    name = fields[i].name
    value = data.draw(PROBES[kind_of(name)])
    probe = attrs.evolve(msg, **{name: value})
    try:
        frame = encode(probe)
    except EncodeError:
        accepted = False
    else:
        accepted = True
        assert decode(frame) == probe
    body = _body(msg)
    body[2 + i] = _wire(name, value)
    if not _packable(body):
        assert not accepted  # the wire cannot even carry it
        return
    try:
        decoded = decode(_frame(body))
    except DecodeError:
        assert not accepted, f"encode accepted {name}={value!r} that decode refuses"
    else:
        assert accepted, f"encode refused {name}={value!r} that decode accepts as {decoded!r}"


BAD_ENCODES: list[tuple[Message, str]] = [
    (Heartbeat("", 0, 1, 0, 0, 0, LocalTime(0.0), ()), "engine_id"),
    (Heartbeat("x" * (MAX_ENGINE_ID_BYTES + 1), 0, 1, 0, 0, 0, LocalTime(0.0), ()), "engine_id"),
    (Heartbeat("\udcff", 0, 1, 0, 0, 0, LocalTime(0.0), ()), "UTF-8"),
    (Heartbeat("e", -1, 1, 0, 0, 0, LocalTime(0.0), ()), "rank"),
    (Heartbeat("e", 0, 0, 0, 0, 0, LocalTime(0.0), ()), "ranks"),
    (Heartbeat("e", 0, MAX_RANKS + 1, 0, 0, 0, LocalTime(0.0), ()), "ranks"),
    (Heartbeat("e", 0, 1, 2**64, 0, 0, LocalTime(0.0), ()), "session"),
    (Heartbeat("e", 0, 1, 0, 2**64, 0, LocalTime(0.0), ()), "incarnation"),
    (Heartbeat("e", 0, 1, 0, 0, True, LocalTime(0.0), ()), "seq"),  # a bool is an int to mypy, never on the wire
    (Heartbeat("e", 0, 1, 0, 0, 0, LocalTime(math.nan), ()), "t_send"),
    (Heartbeat("e", 0, 1, 0, 0, 0, LocalTime(math.inf), ()), "t_send"),
    (Heartbeat("e", 0, 1, 0, 0, 0, LocalTime(MAX_TIME + 1), ()), "t_send"),
    (Heartbeat("e", 0, 1, 0, 0, 0, LocalTime(-(MAX_TIME + 1)), ()), "t_send"),
    (Heartbeat("e", 0, 1, 0, 0, 0, LocalTime(0.0), (3, 2)), "strictly increasing"),
    (Heartbeat("e", 0, 1, 0, 0, 0, LocalTime(0.0), (1, 1)), "strictly increasing"),
    (Heartbeat("e", 0, 1, 0, 0, 0, LocalTime(0.0), (-1,)), "uint64"),
    (Release("e", 0, 1, 0, 0, (2**64,)), "uint64"),
    (Release("e", 0, 0, 0, 0, (1,)), "ranks"),
    (HeartbeatAck("e", 0, 0, 0, 0, 0, LocalTime(0.0), PeerTime(-math.inf), 86400.0, 0), "t_recv"),
    (HeartbeatAck("e", 0, 0, 0, 0, 0, LocalTime(2.0**33), PeerTime(0.0), 86400.0, 0), "t_echo"),
    (HeartbeatAck("e", 0, 0, -1, 0, 0, LocalTime(0.0), PeerTime(0.0), 86400.0, 0), "to_rank"),
    (HeartbeatAck("e", 0, 0, 0, 0, 0, LocalTime(0.0), PeerTime(0.0), 86400.0, 0, (2, 1)), "strictly increasing"),
    (AccessDone("e", 0, 1, 0, 0, 0, -5, 1, False, LocalTime(0.0)), "lease_id"),
    (AccessDone("e", 0, 1, 0, 0, 0, 5, -1, False, LocalTime(0.0)), "attempt"),
    (AccessDone("e", 0, MAX_RANKS + 1, 0, 0, 0, 5, 1, False, LocalTime(0.0)), "ranks"),
    (AccessDone("e", 0, 1, 0, 0, 0, 5, 1, 1, LocalTime(0.0)), "confirm"),  # type: ignore[arg-type]  # on purpose
    (AccessDoneAck("e", 0, 0, 0, 0, 1.5, 1, AccessOutcome.OK), "lease_id"),  # type: ignore[arg-type]  # on purpose
    (AccessDoneAck("e", 0, 0, 0, 2**64, 1, 1, AccessOutcome.OK), "to_session"),
    (AccessDoneAck("e", 0, 0, 0, 0, 1, 1, 0), "outcome"),  # type: ignore[arg-type]  # on purpose
    (Handshake("e", 0, 1, 1, 1, -1, 0, LocalTime(0.0)), "capabilities"),
    (Handshake("e", 0, 0, 1, 1, 0, 0, LocalTime(0.0)), "ranks"),
    (
        HandshakeReply(
            "e", 0, 1, 0, 1, 0, 0, 86400.0, 0.0, 1e-3, 0, 0, 0, LocalTime(0.0), PeerTime(0.0), PeerTime(0.0)
        ),
        "max_message_bytes",
    ),
    (
        HandshakeReply(
            "e", 0, 1, 0, 1, 0, 1024, 86400.0, 0.0, 1e-3, 0, 0, 0, LocalTime(0.0), PeerTime(0.0), PeerTime(math.nan)
        ),
        "t_send",
    ),
]


@pytest.mark.parametrize(("msg", "what"), BAD_ENCODES)
def test_encode_refuses_unrepresentable_values(msg: Message, what: str) -> None:
    with pytest.raises(EncodeError, match=what):
        encode(msg)


def test_encode_refuses_non_messages() -> None:
    with pytest.raises(EncodeError, match="not a kvlease message"):
        encode("hello")  # type: ignore[arg-type]  # not a message, on purpose


@pytest.mark.parametrize("shape", ["too-many-ids", "too-many-bytes"])
def test_encode_refuses_what_decode_would_refuse_for_size(shape: str) -> None:
    # One byte each: a small frame, but too many ids; or 9 bytes each: over 1 MiB.
    ids = tuple(range(MAX_IDS + 1)) if shape == "too-many-ids" else tuple(i << 40 for i in range(1, MAX_IDS))
    msg = Release("decode-0", 0, 1, 0, 0, ids)
    try:
        frame = encode(msg)
    except EncodeError:
        return
    assert decode(frame) == msg  # if encode accepts it, decode must give it back


def test_size_limits_of_decode_hold() -> None:
    """What the test above relies on: decode does refuse those frames."""
    with pytest.raises(DecodeError, match=r"max_array_len|malformed"):
        decode(_frame([PROTOCOL_VERSION, 7, "d", 0, 1, 0, 0, [1] * (MAX_IDS + 1), False]))
    big = _frame([PROTOCOL_VERSION, 7, "d", 0, 1, 0, 0, [1 << 40] * (MAX_IDS - 1), False])
    assert len(big) > MAX_DECODE_BYTES
    with pytest.raises(DecodeError, match="exceeds"):
        decode(big)
    last = _decode_as(_frame([PROTOCOL_VERSION, 7, "d", 0, 1, 0, 0, [1] * MAX_IDS, False]), Release).lease_ids[-1]
    assert last == MAX_IDS


# -- decode raises only DecodeError -------------------------------------------------------------


def _decode_only_decode_error(data: bytes) -> Message | None:
    """`decode(data)`, or None when it raised a `DecodeError` with a documented category."""
    try:
        return decode(data)
    except DecodeError as exc:
        assert exc.category in DECODE_ERROR_CATEGORIES, (exc, exc.category)
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
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308, MAX_TIME + 1, -MAX_TIME - 1]),
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


# A heartbeat body after its engine id: rank 0, ranks 1, session 0, incarnation 0, seq 0,
# t_send 1.0, no ids.
HB_BODY_TAIL = b"\x00\x01\x00\x00\x00" + struct.pack(">Bd", 0xCB, 1.0) + b"\x90"


def _hb_body(*, rank: Any = 0, ranks: Any = 1, t: Any = 1.0, ids: Any = (), engine: Any = "e") -> bytes:
    return _frame([PROTOCOL_VERSION, 3, engine, rank, ranks, 0, 0, 0, t, list(ids) if isinstance(ids, tuple) else ids])


@pytest.mark.parametrize(
    ("data", "what", "category"),
    [
        (b"\x00\x01", "not a kvlease frame", "frame"),
        (MAGIC + msgpack.packb([PROTOCOL_VERSION + 1, 3]), "version", "version"),
        (MAGIC + msgpack.packb([1, 3, "e", 0, 0, 0, 1.0, []]), "version", "version"),  # a v1 heartbeat
        (MAGIC + msgpack.packb([True, 3]), "version", "version"),
        (MAGIC + msgpack.packb([PROTOCOL_VERSION, 99]), "unknown message type", "type"),
        (MAGIC + msgpack.packb({"a": 1}), "expected an array|malformed", "body"),
        (MAGIC + msgpack.packb([PROTOCOL_VERSION]), "expected an array", "body"),
        (MAGIC + msgpack.packb([PROTOCOL_VERSION, 3, "e"]), "expects 8 fields", "arity"),
        (MAGIC + msgpack.packb([PROTOCOL_VERSION, 3, "e", 0, 0, 0, 1.0, []]), "expects 8 fields", "arity"),  # v1 arity
        (MAGIC + b"\x9a\x02\x03" + _str_raw(b"\xff\xfe") + HB_BODY_TAIL, "malformed", "body"),
        (_hb_body(t=math.nan), "finite", "field"),
        (_hb_body(t=math.inf), "finite", "field"),
        (_hb_body(t=MAX_TIME + 1), "finite", "field"),
        (_hb_body(t=-(2**33)), "finite", "field"),
        (_hb_body(ids=[5, 0]), "positive gap", "field"),
        (_hb_body(ids=[2**64 - 1, 1]), "exceeds uint64", "field"),
        (_hb_body(ids="x"), "array of ids", "field"),
        (_hb_body(rank=-1), "rank", "field"),
        (_hb_body(ranks=0), "ranks", "field"),
        (_hb_body(ranks=MAX_RANKS + 1), "ranks", "field"),
        (_hb_body(ranks=True), "ranks", "field"),
        (_hb_body(engine=""), "engine_id", "field"),
        (_frame([PROTOCOL_VERSION, 5, "e", 0, True, 0, 0, 0, 1, 1, True, 1.0]), "ranks", "field"),
        (_frame([PROTOCOL_VERSION, 5, "e", 0, 1, 0, 0, 0, 1, 1, 1, 1.0]), "boolean", "field"),
        (_frame([PROTOCOL_VERSION, 5, "e", 0, 1, 0, 0, 0, 1, -1, True, 1.0]), "attempt", "field"),
        (_frame([PROTOCOL_VERSION, 5, "e", 0, 1, 0, 0, -1, 1, 1, True, 1.0]), "to_rank", "field"),
        (_frame([PROTOCOL_VERSION, 7, "e", 0, 1, 0, 0, [1], 1]), "boolean", "field"),
        (_frame([PROTOCOL_VERSION, 6, "e", 0, 0, 0, 0, 1, 1, 9]), "outcome", "field"),
        (
            _frame([PROTOCOL_VERSION, 2, "p", 0, 1, 0, 3, 0, 0, 6.0, 0.0, 1.0, 0, 0, 0, 1.0, 1.0, 1.0]),
            "max_message_bytes",
            "field",
        ),
        (
            _frame([PROTOCOL_VERSION, 2, "p", 0, 1, 0, 3, 0, 1024, 0.0, 0.0, 1.0, 0, 0, 0, 1.0, 1.0, 1.0]),
            "extension",
            "field",
        ),
        (
            _frame([PROTOCOL_VERSION, 2, "p", 0, 1, 0, 3, 0, 1024, 6.0, 1.0, 1.0, 0, 0, 0, 1.0, 1.0, 1.0]),
            "max_drift_rate",
            "field",
        ),
        (
            _frame([PROTOCOL_VERSION, 2, "p", 0, 1, 0, 3, 0, 1024, 6.0, math.nan, 1.0, 0, 0, 0, 1.0, 1.0, 1.0]),
            "max_drift_rate",
            "field",
        ),
        (
            _frame([PROTOCOL_VERSION, 2, "p", 0, 1, 0, 3, 0, 1024, 6.0, 0.0, math.inf, 0, 0, 0, 1.0, 1.0, 1.0]),
            "max_access_time",
            "field",
        ),
        (
            _frame([PROTOCOL_VERSION, 4, "p", 0, 0, 0, 0, 1, 1.0, 1.0, -6.0, 0, [], [], [], []]),
            "extension",
            "field",
        ),
        (_frame([PROTOCOL_VERSION, 7, "e", 0, 1, 0, 0, [1] * ((1 << 17) + 1)]), "malformed", "body"),
        (MAGIC + b"\x00" * (1 << 20), "exceeds", "frame"),
    ],
)
def test_decode_rejects_with_a_precise_reason_and_category(data: bytes, what: str, category: str) -> None:
    """The message says what was wrong (for people); `category` says it in the vectors' words
    (PROTOCOL.md §8), which the conformance runner compares without reading the message."""
    with pytest.raises(DecodeError, match=what) as exc:
        decode(data)
    assert exc.value.category == category


def test_decode_rejects_non_bytes() -> None:
    with pytest.raises(DecodeError, match="expected bytes") as exc:
        decode("text")  # type: ignore[arg-type]  # the wrong type is the point
    assert exc.value.category == "frame"


def test_a_decode_error_keeps_its_category_through_pickle() -> None:
    """Exceptions pickle as ``cls(*args)``; the category must survive (multiprocessing, logs)."""
    with pytest.raises(DecodeError) as exc:
        decode(memoryview(MAGIC + msgpack.packb([PROTOCOL_VERSION, 99])))
    back = pickle.loads(pickle.dumps(exc.value))
    assert isinstance(back, DecodeError) and back.category == "type" and str(back) == str(exc.value)


def _decode_error_calls(root: Path) -> list[tuple[str, int, ast.Call]]:
    calls = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "DecodeError":
                calls.append((str(path.relative_to(root.parent)), node.lineno, node))
    return calls


def test_every_decode_error_kvlease_raises_names_a_documented_category() -> None:
    """Statically, so that a rare path cannot slip through: every ``DecodeError(...)`` in the
    package, its transports and its adapters passes ``category=`` one of the documented literals."""
    root = Path(kvlease.__file__).parent
    calls = [c for d in (root, root.parent / "transports", root.parent / "adapters") for c in _decode_error_calls(d)]
    assert any(where.startswith("transports") for where, _, _ in calls)
    assert len(calls) >= 20  # not vacuous (30 today: codec, vLLM codec, frame auth, conformance core)
    for where, line, call in calls:
        cat = next((k.value for k in call.keywords if k.arg == "category"), None)
        assert isinstance(cat, ast.Constant) and cat.value in DECODE_ERROR_CATEGORIES, f"{where}:{line}"


def test_decode_accepts_integer_times() -> None:
    """Another implementation may send a whole-number time as an int; it means the same."""
    msg = decode(_frame([PROTOCOL_VERSION, 3, "e", 0, 1, 9, 0, 0, 7, [1, 2]]))
    assert msg == Heartbeat("e", 0, 1, 9, 0, 0, LocalTime(7.0), (1, 3))
    assert isinstance(msg, Heartbeat) and type(msg.t_send) is float
    assert _decode_as(_frame([PROTOCOL_VERSION, 3, "e", 0, 1, 9, 0, 0, T_MAX, []]), Heartbeat).t_send == MAX_TIME


def test_a_float_version_is_not_the_version() -> None:
    """msgpack floats compare equal to ints; the version must be the integer 2."""
    body = [float(PROTOCOL_VERSION), 7, "decode-0", 0, 1, 5, 9, [1], False]
    with pytest.raises(DecodeError, match="version"):
        decode(_frame(body))
    msg = decode(_frame([PROTOCOL_VERSION, *body[1:]]))
    assert msg == Release("decode-0", 0, 1, 5, 9, (1,))


# -- heartbeat splitting ------------------------------------------------------------------------


def _usize(v: int) -> int:
    return 1 if v < 128 else 2 if v < 256 else 3 if v < 65536 else 5 if v < 2**32 else 9


def _cost(chunk: Sequence[int]) -> int:
    """The split rule of the spec: 5 + size(first) + sum(size(id - first)) over the others."""
    return 5 + _usize(chunk[0]) + sum(_usize(v - chunk[0]) for v in chunk[1:])


SORTED_IDS = st.lists(
    st.one_of(
        st.integers(0, 300),
        st.integers(0, U64_MAX),
        st.integers(2**32 - 300, 2**32 + 300),
        st.integers(U64_MAX - 300, U64_MAX),
    ),
    unique=True,
    max_size=400,
).map(lambda v: tuple(sorted(v)))


@given(SORTED_IDS, st.integers(MIN_ID_BUDGET, 600))
def test_split_ids_follows_the_rule_and_keeps_every_id(ids: tuple[int, ...], budget: int) -> None:
    chunks = split_ids(ids, budget)
    assert tuple(i for c in chunks for i in c) == ids
    assert all(c for c in chunks) or chunks == [()]
    for c in chunks:
        if c:
            assert ids_encoded_size(c) <= _cost(c) <= budget
    for c, nxt in itertools.pairwise(chunks):
        assert _cost((*c, nxt[0])) > budget  # greedy: the next id did not fit


def test_split_ids_rejects_tiny_budget_and_handles_empty() -> None:
    with pytest.raises(EncodeError, match="too small"):
        split_ids((1, 2), MIN_ID_BUDGET - 1)
    assert split_ids((), MIN_ID_BUDGET) == [()]
    assert split_ids((U64_MAX,), MIN_ID_BUDGET) == [(U64_MAX,)]


def test_heartbeat_id_budget_formula() -> None:
    assert heartbeat_id_budget(1024, "d", "p") == 1024 - max(52 + 1, 125 + 1)
    assert heartbeat_id_budget(1024, "d" * 100, "p") == 1024 - (52 + 100)
    assert heartbeat_id_budget(1024, "d", "\u00e9" * 10) == 1024 - (125 + 20)  # bytes, not characters


#: How an ack may spread a chunk's ids over its lists (renewed ids are only counted).
ACK_SHAPES = [
    "round-robin",
    "all-renewed",
    "all-unknown",
    "all-expired",
    "all-released",
    "all-completed",
    "alternate-unknown-renewed",
    "first-alone",
]


def _worst_heartbeat(acc: str, chunk: tuple[int, ...]) -> Heartbeat:
    return Heartbeat(acc, MAX_RANKS - 1, MAX_RANKS, U64_MAX, U64_MAX, U64_MAX, LocalTime(-MAX_TIME), chunk)


def _worst_ack(pin: str, chunk: tuple[int, ...], lists: list[list[int]]) -> HeartbeatAck:
    listed = sum(len(v) for v in lists)
    return HeartbeatAck(
        pin,
        MAX_RANKS - 1,
        U64_MAX,
        MAX_RANKS - 1,
        U64_MAX,
        U64_MAX,
        LocalTime(MAX_TIME),
        PeerTime(-MAX_TIME),
        MAX_TIME / 3,  # the stated extension: any float is 9 bytes
        len(chunk) - listed,
        *(tuple(v) for v in lists),
    )


def _spread(chunk: tuple[int, ...], shape: str | list[int]) -> list[list[int]]:
    """The four lists (unknown, expired, released, completed) of an ack answering `chunk`."""
    lists: list[list[int]] = [[], [], [], []]
    for n, v in enumerate(chunk):
        if isinstance(shape, list):
            where = shape[n % len(shape)]  # 0..3: a list; 4: renewed
        elif shape == "round-robin":
            where = n % 4
        elif shape == "all-renewed":
            where = 4
        elif shape.startswith("all-"):
            where = ["unknown", "expired", "released", "completed"].index(shape[4:])
        elif shape == "alternate-unknown-renewed":
            where = 0 if n % 2 else 4
        else:  # first-alone: the first id in one list, every other in another
            where = 3 if n == 0 else 0
        if where < 4:
            lists[where].append(v)
    return lists


@given(
    SORTED_IDS,
    ENGINES,
    ENGINES,
    st.one_of(st.integers(MIN_MESSAGE_BYTES, 2048), st.sampled_from([MIN_MESSAGE_BYTES, 256, 1024])),
    st.one_of(st.sampled_from(ACK_SHAPES), st.lists(st.integers(0, 4), min_size=1, max_size=9)),
)
@example(tuple(range(0, 4000, 3)), "d", "p", MIN_MESSAGE_BYTES, "round-robin")
@example(
    tuple(range(1, 10_001, 3)) + tuple(range(2**40, 2**40 + 7000 * 1_000_003, 1_000_003)),
    "decode-0",
    "prefill-0",
    256,
    "round-robin",
)
@example(tuple(i * 129 for i in range(1, 600)), "d", "p", MIN_MESSAGE_BYTES, "round-robin")  # 2-byte gaps -> 3
@example(tuple(2**16 - 200 + i * 70 for i in range(400)), "d", "p", 300, "round-robin")
def test_heartbeat_chunks_and_the_worst_ack_fit_max_message_bytes(
    ids: tuple[int, ...], acc: str, pin: str, mmb: int, shape: str | list[int]
) -> None:
    budget = heartbeat_id_budget(mmb, acc, pin)
    if budget < MIN_ID_BUDGET:
        with pytest.raises(EncodeError):
            split_ids(ids, budget)
        return
    for chunk in split_ids(ids, budget):
        hb = encode(_worst_heartbeat(acc, chunk))
        assert len(hb) <= mmb, (len(hb), mmb, chunk)
        ack = encode(_worst_ack(pin, chunk, _spread(chunk, shape)))
        assert len(ack) <= mmb, (len(ack), mmb, shape, chunk)


def test_split_heartbeats_fill_the_message_reasonably() -> None:
    """The bound is not bought by tiny chunks: dense ids fill most of the budget."""
    ids = tuple(range(1, 100_001))
    for mmb in (MIN_MESSAGE_BYTES, 256, 1024):
        budget = heartbeat_id_budget(mmb, "decode-0", "prefill-0")
        chunks = split_ids(ids, budget)
        assert all(_cost(c) >= budget - 9 for c in chunks[:-1])
        assert all(len(encode(_worst_heartbeat("decode-0", c))) <= mmb for c in chunks)


def test_a_huge_budget_still_splits_at_the_decoders_list_bound() -> None:
    """The split rule bounds bytes, and ids too: a chunk never holds more than a decoder
    accepts in one list (2**17), so every heartbeat it makes encodes."""
    ids = tuple(range(1, 300_001))
    chunks = split_ids(ids, 600_000)
    assert [len(c) for c in chunks] == [MAX_IDS, MAX_IDS, 300_000 - 2 * MAX_IDS]
    for c in chunks:
        assert _decode_as(encode(Heartbeat("d", 0, 1, 0, 0, 1, LocalTime(1.0), c)), Heartbeat).lease_ids == c


@given(SORTED_IDS)
@example(())
@example((0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, U64_MAX))
def test_chunk_cost_is_the_split_rules_sum(ids: tuple[int, ...]) -> None:
    """`chunk_cost` counts by bisection (a pinner checks it per heartbeat); it is exactly the
    spec's ``5 + size(first) + sum(size(v - first))`` (PROTOCOL.md §4.3)."""
    assert chunk_cost(ids) == (_cost(ids) if ids else 0)


# -- the heartbeat's id list: the fast check against the table-driven one ------------------------


def _decoded_or_error(data: bytes) -> object:
    try:
        return decode(data)
    except DecodeError as exc:
        return ("DecodeError", exc.category)


@given(
    gaps=st.one_of(
        st.lists(st.integers(0, 70_000), max_size=70),
        st.lists(st.integers(1, 300), min_size=60, max_size=200),
    ),
    odd=st.sampled_from([None, True, False, -1, 1.0, "1", None, U64_MAX, [1]]),
    where=st.integers(0, 200),
    t_send=st.floats(-1e9, 1e9, allow_nan=False),
    session=st.integers(0, U64_MAX),
    incarnation=st.integers(0, U64_MAX),
    single_float=st.booleans(),
)
@example(gaps=[0xC3, *[1] * 70], odd=True, where=1, t_send=1.0, session=0, incarnation=0, single_float=True)
@example(gaps=[1] * 70, odd=False, where=0, t_send=1.0, session=0xC3C3, incarnation=0xC2, single_float=False)
@example(gaps=[1] * 70, odd=True, where=70, t_send=1.0, session=0, incarnation=0, single_float=False)
def test_a_heartbeats_ids_decode_alike_on_the_fast_and_the_table_driven_path(
    gaps: list[Any], odd: object, where: int, t_send: float, session: int, incarnation: int, single_float: bool
) -> None:
    """The fast path checks a long heartbeat's id gaps in one array conversion when no bool
    byte (0xc2, 0xc3) follows the header, item by item otherwise (a short list always):
    whatever the gaps hold (a bool, a negative, a float, a string, a list, ids past 2**64) and
    whatever bytes the header carries (a float32 t_send, wide ints with 0xc2/0xc3 in them), it
    accepts and refuses what the table-driven path does."""
    if odd is not None:
        gaps = [*gaps[:where], odd, *gaps[where:]]
    body = [PROTOCOL_VERSION, TYPES[Heartbeat], "d", 0, 1, session, incarnation, 7, t_send, gaps]
    data = MAGIC + msgpack.packb(body, use_bin_type=True, use_single_float=single_float)
    fast = _decoded_or_error(data)
    saved = dict(kvlease._codec._FAST_DECODERS)
    kvlease._codec._FAST_DECODERS.clear()
    try:
        slow = _decoded_or_error(data)
    finally:
        kvlease._codec._FAST_DECODERS.update(saved)
    assert fast == slow
