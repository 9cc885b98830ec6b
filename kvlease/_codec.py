"""The native wire codec: messages <-> bytes. Strict, versioned, bounded.

Frame: the two bytes ``0xC1 0x4B`` (0xC1 is unused by msgpack and can never start UTF-8 text, so
a frame is never mistaken for a vLLM notification), then one msgpack array
``[version, type, field...]``. Lease-id lists are sorted and delta-encoded (first id absolute,
then positive gaps), so consecutive ids cost one byte each. `decode` raises only `DecodeError`,
whatever the bytes; the state machines never see bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate
from operator import sub
from typing import Any, Final

import msgpack

from ._clock import LocalTime, PeerTime
from ._errors import DecodeError, EncodeError
from ._messages import (
    PROTOCOL_VERSION,
    AccessDone,
    AccessDoneAck,
    AccessOutcome,
    Handshake,
    HandshakeReply,
    Heartbeat,
    HeartbeatAck,
    Message,
    Release,
)

__all__ = [
    "MAGIC",
    "MAX_DECODE_BYTES",
    "MAX_ENGINE_ID_BYTES",
    "MIN_ID_BUDGET",
    "decode",
    "encode",
    "heartbeat_id_budget",
    "ids_encoded_size",
    "is_native_frame",
    "split_ids",
]

MAGIC: Final = b"\xc1\x4b"
MAX_DECODE_BYTES: Final = 1 << 20
MAX_ENGINE_ID_BYTES: Final = 256
MAX_IDS: Final = 1 << 17
_U64: Final = 1 << 64

_T_HANDSHAKE: Final = 1
_T_HANDSHAKE_REPLY: Final = 2
_T_HEARTBEAT: Final = 3
_T_HEARTBEAT_ACK: Final = 4
_T_ACCESS_DONE: Final = 5
_T_ACCESS_DONE_ACK: Final = 6
_T_RELEASE: Final = 7

#: Field count after [version, type] for each message type.
_ARITY: Final = {
    _T_HANDSHAKE: 6,
    _T_HANDSHAKE_REPLY: 10,
    _T_HEARTBEAT: 6,
    _T_HEARTBEAT_ACK: 11,
    _T_ACCESS_DONE: 7,
    _T_ACCESS_DONE_ACK: 5,
    _T_RELEASE: 5,
}


def is_native_frame(data: bytes) -> bool:
    """True if `data` starts like a native kvlease frame (it may still fail to decode)."""
    return data[:2] == MAGIC


def uint_size(v: int) -> int:
    """Bytes msgpack uses for a non-negative int."""
    if v < 128:
        return 1
    if v < 256:
        return 2
    if v < 65536:
        return 3
    if v < 1 << 32:
        return 5
    return 9


def _array_header_size(n: int) -> int:
    return 1 if n < 16 else 3 if n < 65536 else 5


def ids_encoded_size(ids: Sequence[int]) -> int:
    """Exact encoded size of a sorted id list (array header plus deltas)."""
    total = _array_header_size(len(ids))
    prev = 0
    for i, v in enumerate(ids):
        total += uint_size(v if i == 0 else v - prev)
        prev = v
    return total


def heartbeat_id_budget(max_message_bytes: int, accessor_id: str, pinner_id: str) -> int:
    """The largest `split_ids` budget for which both a heartbeat from `accessor_id` and the
    pinner's `HeartbeatAck` to it stay within `max_message_bytes`.

    Worst cases, with C the id list's content: a heartbeat is at most ``40 + len(accessor_id)
    + 3 + C`` bytes; an ack spreads the same ids over four lists, each opening with an absolute
    id (at most 8 bytes more than a gap, for three extra lists) behind a 3-byte header, so it is
    at most ``51 + len(pinner_id) + 12 + 24 + C``. `split_ids` counts a 5-byte header in its
    budget.
    """
    acc = len(accessor_id.encode("utf-8", "surrogatepass"))
    pin = len(pinner_id.encode("utf-8", "surrogatepass"))
    return max_message_bytes - max(38 + acc, 82 + pin)


#: The smallest id budget that still carries a full-size (9-byte) id.
MIN_ID_BUDGET: Final = 16


def split_ids(ids: Sequence[int], budget: int) -> list[tuple[int, ...]]:
    """Split a sorted id list into chunks whose encoded list is at most `budget` bytes."""
    if budget < MIN_ID_BUDGET:
        raise EncodeError(f"id budget of {budget} bytes is too small (need >= {MIN_ID_BUDGET})")
    chunks: list[tuple[int, ...]] = []
    start = 0
    size = 5  # worst-case array header
    prev = 0
    for i, v in enumerate(ids):
        cost = uint_size(v if i == start else v - prev)
        if i > start and size + cost > budget:
            chunks.append(tuple(ids[start:i]))
            start = i
            size = 5
            cost = uint_size(v)
        size += cost
        prev = v
    if start < len(ids) or not chunks:
        chunks.append(tuple(ids[start:]))
    return chunks


def _pack_ids(ids: Iterable[int]) -> list[int]:
    out: list[int] = []
    prev = -1
    for v in ids:
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < _U64:
            raise EncodeError(f"lease id must be a uint64, got {v!r}")
        if v <= prev:
            raise EncodeError(f"lease ids must be strictly increasing, got {v} after {prev}")
        out.append(v if prev < 0 else v - prev)
        prev = v
    return out


def _check_uint(name: str, v: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < _U64:
        raise EncodeError(f"{name} must be a uint64, got {v!r}")
    return v


def _check_time(name: str, v: float) -> float:
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
        raise EncodeError(f"{name} must be a finite number, got {v!r}")
    return float(v)


def _check_engine(v: str) -> str:
    if not isinstance(v, str) or not v or len(v.encode("utf-8", "surrogatepass")) > MAX_ENGINE_ID_BYTES:
        raise EncodeError(f"engine_id must be a non-empty string of at most {MAX_ENGINE_ID_BYTES} bytes, got {v!r}")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise EncodeError(f"engine_id must be valid UTF-8 text, got {v!r}") from None
    return v


# -- fast paths ---------------------------------------------------------------------------------
#
# Heartbeats, acks and access-dones are encoded and decoded once per message per worker, so they
# are the codec's hot path. Each has a fast encoder/decoder that checks the same conditions with
# exact-type tests (``type(v) is int`` also rules out bool and int subclasses) and C-level
# helpers, and accepts only a subset of what the general path accepts (short ASCII engine ids,
# exact floats): anything else -- including every invalid value -- falls through to the general
# path below, which accepts or raises exactly as before. So the fast paths change no output and
# no error; they only skip per-field method calls.

_FAST_ENGINE_CHARS: Final = 64  # 64 characters are at most 256 UTF-8 bytes
_INF: Final = math.inf
_INT_ONLY: Final = frozenset((int,))
_FAST_PACK_BUFFER: Final = 512  # grows if a message needs more


def _fast_engine(v: object) -> bool:
    return type(v) is str and 0 < len(v) <= _FAST_ENGINE_CHARS and v.isascii()


def _fast_uint(v: object) -> bool:
    return type(v) is int and 0 <= v < _U64


def _fast_pack_ids(ids: object) -> list[int] | None:
    """`_pack_ids` for a tuple of ints, or None to take the general path."""
    if type(ids) is not tuple:
        return None
    if not ids:
        return []
    if not _INT_ONLY.issuperset(map(type, ids)) or ids[0] < 0 or ids[-1] >= _U64:
        return None
    gaps = list(map(sub, ids[1:], ids))
    if gaps and min(gaps) <= 0:
        return None  # not strictly increasing
    gaps.insert(0, ids[0])
    return gaps


def _fast_encode_body(msg: Message) -> list[Any] | None:
    """The encoded array of a hot-path message, or None to take the general path. The field
    tests are `_fast_engine` / `_fast_uint` and a finite-float test, inlined."""
    cls = type(msg)
    if cls is Heartbeat:
        assert isinstance(msg, Heartbeat)
        engine, rank, inc, seq, t = msg.engine_id, msg.rank, msg.incarnation, msg.seq, msg.t_send
        if (
            type(engine) is str and 0 < len(engine) <= _FAST_ENGINE_CHARS and engine.isascii()
            and type(rank) is int and 0 <= rank < _U64 and type(inc) is int and 0 <= inc < _U64
            and type(seq) is int and 0 <= seq < _U64 and type(t) is float and -_INF < t < _INF
        ):
            ids = _fast_pack_ids(msg.lease_ids)
            if ids is not None:
                return [PROTOCOL_VERSION, _T_HEARTBEAT, engine, rank, inc, seq, t, ids]
    elif cls is HeartbeatAck:
        assert isinstance(msg, HeartbeatAck)
        engine, rank, inc, seq = msg.engine_id, msg.rank, msg.incarnation, msg.seq
        t_echo, t_recv, renewed = msg.t_echo, msg.t_recv, msg.renewed
        if (
            type(engine) is str and 0 < len(engine) <= _FAST_ENGINE_CHARS and engine.isascii()
            and type(rank) is int and 0 <= rank < _U64 and type(inc) is int and 0 <= inc < _U64
            and type(seq) is int and 0 <= seq < _U64 and type(t_echo) is float and -_INF < t_echo < _INF
            and type(t_recv) is float and -_INF < t_recv < _INF and type(renewed) is int and 0 <= renewed < _U64
        ):
            unknown, expired = _fast_pack_ids(msg.unknown), _fast_pack_ids(msg.expired)
            released, completed = _fast_pack_ids(msg.released), _fast_pack_ids(msg.completed)
            if unknown is not None and expired is not None and released is not None and completed is not None:
                return [PROTOCOL_VERSION, _T_HEARTBEAT_ACK, engine, rank, inc, seq, t_echo, t_recv, renewed,
                        unknown, expired, released, completed]
    elif cls is AccessDone:
        assert isinstance(msg, AccessDone)
        engine, rank, inc, lease_id, expected, t = (
            msg.engine_id, msg.rank, msg.incarnation, msg.lease_id, msg.expected, msg.t_send
        )
        if (
            type(engine) is str and 0 < len(engine) <= _FAST_ENGINE_CHARS and engine.isascii()
            and type(rank) is int and 0 <= rank < _U64 and type(inc) is int and 0 <= inc < _U64
            and type(lease_id) is int and 0 <= lease_id < _U64 and type(expected) is int and 0 <= expected < _U64
            and type(t) is float and -_INF < t < _INF
        ):
            return [PROTOCOL_VERSION, _T_ACCESS_DONE, engine, rank, inc, lease_id, expected, bool(msg.confirm), t]
    elif cls is AccessDoneAck:
        assert isinstance(msg, AccessDoneAck)
        if (
            _fast_engine(msg.engine_id) and _fast_uint(msg.rank) and _fast_uint(msg.incarnation)
            and _fast_uint(msg.lease_id)
        ):
            return [PROTOCOL_VERSION, _T_ACCESS_DONE_ACK, msg.engine_id, msg.rank, msg.incarnation, msg.lease_id,
                    int(msg.outcome)]
    return None


def encode(msg: Message) -> bytes:
    """Encode one message; raises `EncodeError` for values the wire cannot carry."""
    fast = _fast_encode_body(msg)
    if fast is not None:
        # `packb` builds a Packer with a 256 KiB buffer per call (most of an encode's cost);
        # a fresh small one per call packs the same bytes and stays thread-safe.
        packed_fast: bytes = msgpack.Packer(use_bin_type=True, buf_size=_FAST_PACK_BUFFER).pack(fast)
        return MAGIC + packed_fast
    body: list[Any]
    match msg:
        case Handshake():
            body = [
                _T_HANDSHAKE, _check_engine(msg.engine_id), _check_uint("rank", msg.rank),
                _check_uint("ranks", msg.ranks), _check_uint("version", msg.version),
                _check_uint("capabilities", msg.capabilities), _check_time("t_send", msg.t_send),
            ]
        case HandshakeReply():
            body = [
                _T_HANDSHAKE_REPLY, _check_engine(msg.engine_id), _check_uint("rank", msg.rank),
                _check_uint("ranks", msg.ranks), _check_uint("incarnation", msg.incarnation),
                _check_uint("version", msg.version), _check_uint("capabilities", msg.capabilities),
                _check_uint("max_message_bytes", msg.max_message_bytes),
                _check_time("t_echo", msg.t_echo), _check_time("t_recv", msg.t_recv),
                _check_time("t_send", msg.t_send),
            ]
        case Heartbeat():
            body = [
                _T_HEARTBEAT, _check_engine(msg.engine_id), _check_uint("rank", msg.rank),
                _check_uint("incarnation", msg.incarnation), _check_uint("seq", msg.seq),
                _check_time("t_send", msg.t_send), _pack_ids(msg.lease_ids),
            ]
        case HeartbeatAck():
            body = [
                _T_HEARTBEAT_ACK, _check_engine(msg.engine_id), _check_uint("rank", msg.rank),
                _check_uint("incarnation", msg.incarnation), _check_uint("seq", msg.seq),
                _check_time("t_echo", msg.t_echo), _check_time("t_recv", msg.t_recv),
                _check_uint("renewed", msg.renewed), _pack_ids(msg.unknown),
                _pack_ids(msg.expired), _pack_ids(msg.released), _pack_ids(msg.completed),
            ]
        case AccessDone():
            body = [
                _T_ACCESS_DONE, _check_engine(msg.engine_id), _check_uint("rank", msg.rank),
                _check_uint("incarnation", msg.incarnation), _check_uint("lease_id", msg.lease_id),
                _check_uint("expected", msg.expected), bool(msg.confirm),
                _check_time("t_send", msg.t_send),
            ]
        case AccessDoneAck():
            body = [
                _T_ACCESS_DONE_ACK, _check_engine(msg.engine_id), _check_uint("rank", msg.rank),
                _check_uint("incarnation", msg.incarnation), _check_uint("lease_id", msg.lease_id),
                int(msg.outcome),
            ]
        case Release():
            body = [
                _T_RELEASE, _check_engine(msg.engine_id), _check_uint("rank", msg.rank),
                _check_uint("incarnation", msg.incarnation), _pack_ids(msg.lease_ids),
                _check_uint("expected", msg.expected),
            ]
        case _:
            raise EncodeError(f"not a kvlease message: {msg!r}")
    packed: bytes = msgpack.packb([PROTOCOL_VERSION, *body], use_bin_type=True)
    return MAGIC + packed


class _Fields:
    """Typed, bounds-checked access to a decoded array's fields."""

    def __init__(self, items: list[Any], what: str) -> None:
        self._items = items
        self._i = 2
        self._what = what

    def _next(self, name: str) -> Any:
        v = self._items[self._i]
        self._i += 1
        return v

    def uint(self, name: str, *, lo: int = 0, hi: int = _U64 - 1) -> int:
        v = self._next(name)
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise DecodeError(f"{self._what}.{name}: expected an integer in [{lo}, {hi}], got {v!r}")
        return v

    def time(self, name: str) -> float:
        v = self._next(name)
        if not isinstance(v, float | int) or isinstance(v, bool) or not math.isfinite(v):
            raise DecodeError(f"{self._what}.{name}: expected a finite float, got {v!r}")
        return float(v)

    def engine(self, name: str = "engine_id") -> str:
        v = self._next(name)
        if not isinstance(v, str) or not v or len(v.encode()) > MAX_ENGINE_ID_BYTES:
            raise DecodeError(
                f"{self._what}.{name}: expected a non-empty string of at most "
                f"{MAX_ENGINE_ID_BYTES} bytes, got {v!r:.80}"
            )
        return v

    def boolean(self, name: str) -> bool:
        v = self._next(name)
        if not isinstance(v, bool):
            raise DecodeError(f"{self._what}.{name}: expected a boolean, got {v!r}")
        return v

    def ids(self, name: str) -> tuple[int, ...]:
        v = self._next(name)
        if not isinstance(v, list):
            raise DecodeError(f"{self._what}.{name}: expected an array of ids, got {type(v).__name__}")
        out: list[int] = []
        cur = 0
        for i, d in enumerate(v):
            if not isinstance(d, int) or isinstance(d, bool) or d < 0 or (i > 0 and d == 0):
                raise DecodeError(
                    f"{self._what}.{name}[{i}]: expected a {'positive gap' if i else 'uint'}, got {d!r}"
                )
            cur = d if i == 0 else cur + d
            if cur >= _U64:
                raise DecodeError(f"{self._what}.{name}[{i}]: id exceeds uint64")
            out.append(cur)
        return tuple(out)


def _fast_ids(v: object) -> tuple[int, ...] | None:
    """`_Fields.ids` for a valid list, or None to take the general path (which raises)."""
    if type(v) is not list:
        return None
    if not v:
        return ()
    # ints only (no bool); the first id >= 0 and every later gap > 0 (so a 0 is allowed only
    # first); the last id, the largest, below 2**64.
    if not _INT_ONLY.issuperset(map(type, v)) or min(v) < 0 or v.count(0) > (v[0] == 0):
        return None
    out = tuple(accumulate(v))
    return out if out[-1] < _U64 else None


# The fast decoders inline `_fast_engine` / `_fast_uint` and a finite-float test (a call per
# field is most of their cost); they are the same tests.


def _fast_heartbeat(items: list[Any]) -> Message | None:
    _, _, engine, rank, inc, seq, t_send, ids = items
    if (
        type(engine) is str and 0 < len(engine) <= _FAST_ENGINE_CHARS and engine.isascii()
        and type(rank) is int and 0 <= rank < _U64 and type(inc) is int and 0 <= inc < _U64
        and type(seq) is int and 0 <= seq < _U64 and type(t_send) is float and -_INF < t_send < _INF
    ):
        lease_ids = _fast_ids(ids)
        if lease_ids is not None:
            return Heartbeat(engine, rank, inc, seq, t_send, lease_ids)  # type: ignore[arg-type]
    return None


def _fast_heartbeat_ack(items: list[Any]) -> Message | None:
    _, _, engine, rank, inc, seq, t_echo, t_recv, renewed, u, e, r, c = items
    if (
        type(engine) is str and 0 < len(engine) <= _FAST_ENGINE_CHARS and engine.isascii()
        and type(rank) is int and 0 <= rank < _U64 and type(inc) is int and 0 <= inc < _U64
        and type(seq) is int and 0 <= seq < _U64 and type(t_echo) is float and -_INF < t_echo < _INF
        and type(t_recv) is float and -_INF < t_recv < _INF and type(renewed) is int and 0 <= renewed < _U64
    ):
        # An ack's four lists are usually empty.
        unknown = () if u == [] else _fast_ids(u)
        expired = () if e == [] else _fast_ids(e)
        released = () if r == [] else _fast_ids(r)
        completed = () if c == [] else _fast_ids(c)
        if unknown is not None and expired is not None and released is not None and completed is not None:
            return HeartbeatAck(
                engine, rank, inc, seq, t_echo, t_recv, renewed,  # type: ignore[arg-type]
                unknown, expired, released, completed,
            )
    return None


def _fast_access_done(items: list[Any]) -> Message | None:
    _, _, engine, rank, inc, lease_id, expected, confirm, t_send = items
    if (
        type(engine) is str and 0 < len(engine) <= _FAST_ENGINE_CHARS and engine.isascii()
        and type(rank) is int and 0 <= rank < _U64 and type(inc) is int and 0 <= inc < _U64
        and type(lease_id) is int and 0 <= lease_id < _U64 and type(expected) is int and 1 <= expected <= 1 << 16
        and type(confirm) is bool and type(t_send) is float and -_INF < t_send < _INF
    ):
        return AccessDone(engine, rank, inc, lease_id, expected, confirm, t_send)  # type: ignore[arg-type]
    return None


_OUTCOMES: Final = {int(o): o for o in AccessOutcome}


def _fast_access_done_ack(items: list[Any]) -> Message | None:
    _, _, engine, rank, inc, lease_id, outcome = items
    if (
        type(engine) is str and 0 < len(engine) <= _FAST_ENGINE_CHARS and engine.isascii()
        and type(rank) is int and 0 <= rank < _U64 and type(inc) is int and 0 <= inc < _U64
        and type(lease_id) is int and 0 <= lease_id < _U64 and type(outcome) is int
    ):
        verdict = _OUTCOMES.get(outcome)
        if verdict is not None:
            return AccessDoneAck(engine, rank, inc, lease_id, verdict)
    return None


#: type -> (array length, fast decoder)
_FAST_DECODERS: Final[dict[int, tuple[int, Callable[[list[Any]], Message | None]]]] = {
    _T_HEARTBEAT: (2 + _ARITY[_T_HEARTBEAT], _fast_heartbeat),
    _T_HEARTBEAT_ACK: (2 + _ARITY[_T_HEARTBEAT_ACK], _fast_heartbeat_ack),
    _T_ACCESS_DONE: (2 + _ARITY[_T_ACCESS_DONE], _fast_access_done),
    _T_ACCESS_DONE_ACK: (2 + _ARITY[_T_ACCESS_DONE_ACK], _fast_access_done_ack),
}


def decode(data: bytes, *, max_bytes: int = MAX_DECODE_BYTES) -> Message:
    """Decode one native frame. Any problem raises `DecodeError` naming what was wrong."""
    if type(data) is not bytes:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise DecodeError(f"expected bytes, got {type(data).__name__}")
        data = bytes(data)
    if len(data) > max_bytes:
        raise DecodeError(f"message of {len(data)} bytes exceeds the {max_bytes}-byte bound")
    if data[:2] != MAGIC:
        raise DecodeError(f"not a kvlease frame: starts with {data[:2]!r}, expected {MAGIC!r}")
    try:
        items = msgpack.unpackb(
            data[2:],
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=MAX_ENGINE_ID_BYTES,
            max_bin_len=0,
            max_array_len=MAX_IDS,
            max_map_len=0,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many types (ValueError, ExtraData, ...)
        raise DecodeError(f"malformed msgpack body: {type(exc).__name__}: {exc}") from None
    if type(items) is list and len(items) > 2 and type(items[0]) is int and items[0] == PROTOCOL_VERSION:
        mtype = items[1]
        fast = _FAST_DECODERS.get(mtype) if type(mtype) is int else None
        if fast is not None and len(items) == fast[0]:
            # Exactly the frames the checks below pass on to `_decode_fields` for this type.
            try:
                msg = fast[1](items)
            except Exception as exc:  # defensive, as below: nothing but DecodeError escapes
                raise DecodeError(f"malformed message: {type(exc).__name__}: {exc}") from None
            if msg is not None:
                return msg
    if not isinstance(items, list) or len(items) < 2:
        raise DecodeError(f"expected an array [version, type, ...], got {type(items).__name__}")
    version, mtype = items[0], items[1]
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise DecodeError(f"unsupported protocol version {version!r} (this peer speaks {PROTOCOL_VERSION})")
    if not isinstance(mtype, int) or isinstance(mtype, bool) or mtype not in _ARITY:
        raise DecodeError(f"unknown message type {mtype!r}")
    if len(items) != 2 + _ARITY[mtype]:
        raise DecodeError(f"message type {mtype} expects {_ARITY[mtype]} fields, got {len(items) - 2}")
    try:
        return _decode_fields(mtype, items)
    except DecodeError:
        raise
    except Exception as exc:  # defensive: nothing else may escape
        raise DecodeError(f"malformed message: {type(exc).__name__}: {exc}") from None


def _decode_fields(mtype: int, items: list[Any]) -> Message:
    if mtype == _T_HANDSHAKE:
        f = _Fields(items, "Handshake")
        return Handshake(
            f.engine(), f.uint("rank"), f.uint("ranks", lo=1), f.uint("version"),
            f.uint("capabilities"), LocalTime(f.time("t_send")),
        )
    if mtype == _T_HANDSHAKE_REPLY:
        f = _Fields(items, "HandshakeReply")
        return HandshakeReply(
            f.engine(), f.uint("rank"), f.uint("ranks", lo=1), f.uint("incarnation"),
            f.uint("version"), f.uint("capabilities"), f.uint("max_message_bytes", lo=1),
            PeerTime(f.time("t_echo")), PeerTime(f.time("t_recv")), PeerTime(f.time("t_send")),
        )
    if mtype == _T_HEARTBEAT:
        f = _Fields(items, "Heartbeat")
        return Heartbeat(
            f.engine(), f.uint("rank"), f.uint("incarnation"), f.uint("seq"),
            LocalTime(f.time("t_send")), f.ids("lease_ids"),
        )
    if mtype == _T_HEARTBEAT_ACK:
        f = _Fields(items, "HeartbeatAck")
        return HeartbeatAck(
            f.engine(), f.uint("rank"), f.uint("incarnation"), f.uint("seq"),
            PeerTime(f.time("t_echo")), PeerTime(f.time("t_recv")), f.uint("renewed"),
            f.ids("unknown"), f.ids("expired"), f.ids("released"), f.ids("completed"),
        )
    if mtype == _T_ACCESS_DONE:
        f = _Fields(items, "AccessDone")
        return AccessDone(
            f.engine(), f.uint("rank"), f.uint("incarnation"), f.uint("lease_id"),
            f.uint("expected", lo=1, hi=1 << 16), f.boolean("confirm"), LocalTime(f.time("t_send")),
        )
    if mtype == _T_ACCESS_DONE_ACK:
        f = _Fields(items, "AccessDoneAck")
        engine, rank, inc, lid = f.engine(), f.uint("rank"), f.uint("incarnation"), f.uint("lease_id")
        outcome = f.uint("outcome", hi=max(AccessOutcome))
        return AccessDoneAck(engine, rank, inc, lid, AccessOutcome(outcome))
    f = _Fields(items, "Release")
    return Release(
        f.engine(), f.uint("rank"), f.uint("incarnation"), f.ids("lease_ids"), f.uint("expected", lo=1, hi=1 << 16)
    )
