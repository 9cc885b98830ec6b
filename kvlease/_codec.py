"""The native wire codec: messages <-> bytes. Strict, versioned, bounded.

Frame: the two bytes ``0xC1 0x4B`` (0xC1 is unused by msgpack and can never start UTF-8 text, so
a frame is never mistaken for a vLLM notification), then one msgpack array
``[version, type, field...]``. Lease-id lists are sorted and delta-encoded (first id absolute,
then positive gaps), so consecutive ids cost one byte each. `decode` raises only `DecodeError`,
whatever the bytes; the state machines never see bytes.

One field table per message (`_FIELDS`) drives both the general encoder and decoder, so what
`encode` accepts is exactly what `decode` accepts back.
"""

from __future__ import annotations

import bisect
import math
from array import array
from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate
from operator import sub
from typing import Any, Final

import msgpack

from ._clock import MAX_TIME
from ._errors import DecodeError, EncodeError
from ._layout import MAX_RANKS
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
    "chunk_cost",
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

_MESSAGE_TYPES: Final = {
    Handshake: _T_HANDSHAKE,
    HandshakeReply: _T_HANDSHAKE_REPLY,
    Heartbeat: _T_HEARTBEAT,
    HeartbeatAck: _T_HEARTBEAT_ACK,
    AccessDone: _T_ACCESS_DONE,
    AccessDoneAck: _T_ACCESS_DONE_ACK,
    Release: _T_RELEASE,
}

# Field kinds of the table below.
_ENGINE: Final = "engine"  # UTF-8 str, 1..256 bytes
_UINT: Final = "uint"  # uint64
_RANKS: Final = "ranks"  # integer in [1, MAX_RANKS]
_MMB: Final = "max_message_bytes"  # integer >= 1
_TIME: Final = "time"  # finite float, |t| <= MAX_TIME
_BOOL: Final = "bool"
_IDS: Final = "ids"  # strictly increasing uint64 list, delta-encoded
_OUTCOME: Final = "outcome"  # AccessOutcome
_DUR: Final = "duration"  # finite number d, 0 < d <= MAX_TIME (a pinner's stated term)
_RATE: Final = "rate"  # finite number in [0, 1) (a stated drift bound)

#: Every message's fields after [version, type], in wire order: (attribute, kind).
_FIELDS: Final[dict[int, tuple[tuple[str, str], ...]]] = {
    _T_HANDSHAKE: (
        ("engine_id", _ENGINE),
        ("rank", _UINT),
        ("ranks", _RANKS),
        ("session", _UINT),
        ("version", _UINT),
        ("capabilities", _UINT),
        ("seq", _UINT),
        ("t_send", _TIME),
    ),
    _T_HANDSHAKE_REPLY: (
        ("engine_id", _ENGINE),
        ("rank", _UINT),
        ("ranks", _RANKS),
        ("incarnation", _UINT),
        ("version", _UINT),
        ("capabilities", _UINT),
        ("max_message_bytes", _MMB),
        ("extension", _DUR),
        ("max_drift_rate", _RATE),
        ("max_access_time", _DUR),
        ("to_rank", _UINT),
        ("to_session", _UINT),
        ("seq", _UINT),
        ("t_echo", _TIME),
        ("t_recv", _TIME),
        ("t_send", _TIME),
    ),
    _T_HEARTBEAT: (
        ("engine_id", _ENGINE),
        ("rank", _UINT),
        ("ranks", _RANKS),
        ("session", _UINT),
        ("incarnation", _UINT),
        ("seq", _UINT),
        ("t_send", _TIME),
        ("lease_ids", _IDS),
    ),
    _T_HEARTBEAT_ACK: (
        ("engine_id", _ENGINE),
        ("rank", _UINT),
        ("incarnation", _UINT),
        ("to_rank", _UINT),
        ("to_session", _UINT),
        ("seq", _UINT),
        ("t_echo", _TIME),
        ("t_recv", _TIME),
        ("extension", _DUR),
        ("renewed", _UINT),
        ("unknown", _IDS),
        ("expired", _IDS),
        ("released", _IDS),
        ("completed", _IDS),
    ),
    _T_ACCESS_DONE: (
        ("engine_id", _ENGINE),
        ("rank", _UINT),
        ("ranks", _RANKS),
        ("session", _UINT),
        ("incarnation", _UINT),
        ("to_rank", _UINT),
        ("lease_id", _UINT),
        ("attempt", _UINT),
        ("confirm", _BOOL),
        ("t_send", _TIME),
    ),
    _T_ACCESS_DONE_ACK: (
        ("engine_id", _ENGINE),
        ("rank", _UINT),
        ("incarnation", _UINT),
        ("to_rank", _UINT),
        ("to_session", _UINT),
        ("lease_id", _UINT),
        ("attempt", _UINT),
        ("outcome", _OUTCOME),
    ),
    _T_RELEASE: (
        ("engine_id", _ENGINE),
        ("rank", _UINT),
        ("ranks", _RANKS),
        ("session", _UINT),
        ("incarnation", _UINT),
        ("lease_ids", _IDS),
        ("posted", _BOOL),
    ),
}

#: Field count after [version, type] for each message type.
_ARITY: Final = {t: len(f) for t, f in _FIELDS.items()}
_CLASSES: Final = {t: cls for cls, t in _MESSAGE_TYPES.items()}


def is_native_frame(data: bytes | bytearray | memoryview) -> bool:
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
    pinner's `HeartbeatAck` answering it stay within `max_message_bytes`.

    With C the cost `split_ids` counts for a chunk (a 5-byte list header, the first id's size,
    and each other id's size *measured from the first id*), a heartbeat is at most
    ``52 + len(accessor_id) + C`` bytes (every fixed field at its widest). An ack spreads the
    same ids over four lists: each list costs at most a 5-byte header and a 9-byte first id,
    and every other id's gap inside its list is at most its distance from the chunk's first
    id, so the lists take at most ``C + 50`` bytes, and the ack (whose fixed fields, the
    stated extension and a 3-byte array header included, cost at most 75 bytes plus the
    engine id) at most ``ACK_FIXED_BYTES + len(pinner_id) + C`` = ``125 + len(pinner_id) +
    C``. (Counting gaps from the first id, not from the predecessor, is what makes the ack
    bound hold: splitting sorted ids over four lists can widen every gap by a size class.)
    """
    acc = len(accessor_id.encode("utf-8", "surrogatepass"))
    pin = len(pinner_id.encode("utf-8", "surrogatepass"))
    return max_message_bytes - max(HEARTBEAT_FIXED_BYTES + acc, ACK_FIXED_BYTES + pin)


#: The widest fixed fields of a heartbeat, and of an ack plus its four list headers and first
#: ids: the constants of the split rule (spec §4.3).
HEARTBEAT_FIXED_BYTES: Final = 52
ACK_FIXED_BYTES: Final = 125


#: The distances at which an id's size, measured from the chunk's first id, grows past 1, 2, 3
#: and 5 bytes (msgpack uint classes): the split rule's size steps.
_SIZE_STEPS: Final = ((128, 1), (256, 2), (1 << 16, 3), (1 << 32, 5))


def chunk_cost(ids: Sequence[int]) -> int:
    """The split rule's cost of one chunk of sorted ids (see `split_ids`); 0 for no ids.

    Strictly increasing ids (what a decoded list is) fall into the size classes in order, so the
    cost is counted with a bisection per class: O(log n), since a pinner checks it for every
    heartbeat it handles."""
    if not ids:
        return 0
    first = ids[0]
    cost = 5 + uint_size(first)
    lo = 1
    for step, size in _SIZE_STEPS:
        hi = bisect.bisect_left(ids, first + step, lo)
        cost += (hi - lo) * size
        lo = hi
    return cost + (len(ids) - lo) * 9


#: The smallest id budget that still carries a full-size (9-byte) id.
MIN_ID_BUDGET: Final = 16


def split_ids(ids: Sequence[int], budget: int) -> list[tuple[int, ...]]:
    """Split a sorted id list into chunks of cost at most `budget` bytes, greedily in order.

    A chunk's cost is ``5 + size(first) + sum(size(id - first) for the other ids)``, with
    ``size`` the msgpack size of an unsigned integer (1, 2, 3, 5 or 9 bytes); it bounds the
    encoded list in a heartbeat and the four lists of the ack answering it. An id joins the
    current chunk while the cost stays within `budget` and the chunk holds fewer than 2**17
    ids (what a decoder accepts in one list); otherwise it opens the next chunk.
    """
    if budget < MIN_ID_BUDGET:
        raise EncodeError(f"id budget of {budget} bytes is too small (need >= {MIN_ID_BUDGET})")
    chunks: list[tuple[int, ...]] = []
    start = 0
    first = 0
    size = 0
    for i, v in enumerate(ids):
        if i == start:
            first = v
            size = 5 + uint_size(v)
            continue
        cost = uint_size(v - first)
        if size + cost > budget or i - start >= MAX_IDS:
            chunks.append(tuple(ids[start:i]))
            start = i
            first = v
            size = 5 + uint_size(v)
        else:
            size += cost
    if start < len(ids) or not chunks:
        chunks.append(tuple(ids[start:]))
    return chunks


def _pack_ids(ids: Iterable[int]) -> list[int]:
    if isinstance(ids, Sequence) and len(ids) > MAX_IDS:
        raise EncodeError(f"an id list holds at most {MAX_IDS} ids, got {len(ids)}")
    out: list[int] = []
    prev = -1
    for v in ids:
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < _U64:
            raise EncodeError(f"lease id must be a uint64, got {v!r}")
        if v <= prev:
            raise EncodeError(f"lease ids must be strictly increasing, got {v} after {prev}")
        out.append(v if prev < 0 else v - prev)
        prev = v
    if len(out) > MAX_IDS:
        raise EncodeError(f"an id list holds at most {MAX_IDS} ids, got {len(out)}")
    return out


def _check_uint(name: str, v: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < _U64:
        raise EncodeError(f"{name} must be a uint64, got {v!r}")
    return v


def _check_time(name: str, v: float) -> float:
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or abs(v) > MAX_TIME:
        raise EncodeError(f"{name} must be a finite number within +-{MAX_TIME:.0f}, got {v!r}")
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
# exact floats, ranks below 2**16): anything else -- including every invalid value -- falls
# through to the general, table-driven path, which accepts or raises. So the fast paths change
# no output and no error; they only skip per-field method calls.

_FAST_ENGINE_CHARS: Final = 64  # 64 characters are at most 256 UTF-8 bytes
_INT_ONLY: Final = frozenset((int,))
_FAST_PACK_BUFFER: Final = 512  # grows if a message needs more
_U16: Final = 1 << 16


def _fast_engine(v: object) -> bool:
    return type(v) is str and 0 < len(v) <= _FAST_ENGINE_CHARS and v.isascii()


def _fast_uint(v: object) -> bool:
    return type(v) is int and 0 <= v < _U64


def _fast_time(v: object) -> bool:
    return type(v) is float and -MAX_TIME <= v <= MAX_TIME


def _fast_duration(v: object) -> bool:
    return type(v) is float and 0.0 < v <= MAX_TIME


def _fast_ranks(rank: object, ranks: object) -> bool:
    return type(rank) is int and type(ranks) is int and 0 <= rank < _U16 and 1 <= ranks <= _U16


def _fast_pack_ids(ids: object) -> list[int] | None:
    """`_pack_ids` for a tuple of ints, or None to take the general path."""
    if type(ids) is not tuple or len(ids) > MAX_IDS:
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
    """The encoded array of a hot-path message, or None to take the general path."""
    cls = type(msg)
    if cls is Heartbeat:
        assert isinstance(msg, Heartbeat)
        if (
            _fast_engine(msg.engine_id)
            and _fast_ranks(msg.rank, msg.ranks)
            and _fast_uint(msg.session)
            and _fast_uint(msg.incarnation)
            and _fast_uint(msg.seq)
            and _fast_time(msg.t_send)
        ):
            ids = _fast_pack_ids(msg.lease_ids)
            if ids is not None:
                return [
                    PROTOCOL_VERSION,
                    _T_HEARTBEAT,
                    msg.engine_id,
                    msg.rank,
                    msg.ranks,
                    msg.session,
                    msg.incarnation,
                    msg.seq,
                    msg.t_send,
                    ids,
                ]
    elif cls is HeartbeatAck:
        assert isinstance(msg, HeartbeatAck)
        if (
            _fast_engine(msg.engine_id)
            and _fast_uint(msg.rank)
            and _fast_uint(msg.incarnation)
            and _fast_uint(msg.to_rank)
            and _fast_uint(msg.to_session)
            and _fast_uint(msg.seq)
            and _fast_time(msg.t_echo)
            and _fast_time(msg.t_recv)
            and _fast_duration(msg.extension)
            and _fast_uint(msg.renewed)
        ):
            unknown, expired = _fast_pack_ids(msg.unknown), _fast_pack_ids(msg.expired)
            released, completed = _fast_pack_ids(msg.released), _fast_pack_ids(msg.completed)
            if unknown is not None and expired is not None and released is not None and completed is not None:
                return [
                    PROTOCOL_VERSION,
                    _T_HEARTBEAT_ACK,
                    msg.engine_id,
                    msg.rank,
                    msg.incarnation,
                    msg.to_rank,
                    msg.to_session,
                    msg.seq,
                    msg.t_echo,
                    msg.t_recv,
                    msg.extension,
                    msg.renewed,
                    unknown,
                    expired,
                    released,
                    completed,
                ]
    elif cls is AccessDone:
        assert isinstance(msg, AccessDone)
        if (
            _fast_engine(msg.engine_id)
            and _fast_ranks(msg.rank, msg.ranks)
            and _fast_uint(msg.session)
            and _fast_uint(msg.incarnation)
            and _fast_uint(msg.to_rank)
            and _fast_uint(msg.lease_id)
            and _fast_uint(msg.attempt)
            and type(msg.confirm) is bool
            and _fast_time(msg.t_send)
        ):
            return [
                PROTOCOL_VERSION,
                _T_ACCESS_DONE,
                msg.engine_id,
                msg.rank,
                msg.ranks,
                msg.session,
                msg.incarnation,
                msg.to_rank,
                msg.lease_id,
                msg.attempt,
                msg.confirm,
                msg.t_send,
            ]
    elif cls is AccessDoneAck:
        assert isinstance(msg, AccessDoneAck)
        if (
            _fast_engine(msg.engine_id)
            and _fast_uint(msg.rank)
            and _fast_uint(msg.incarnation)
            and _fast_uint(msg.to_rank)
            and _fast_uint(msg.to_session)
            and _fast_uint(msg.lease_id)
            and _fast_uint(msg.attempt)
            and type(msg.outcome) is AccessOutcome
        ):
            return [
                PROTOCOL_VERSION,
                _T_ACCESS_DONE_ACK,
                msg.engine_id,
                msg.rank,
                msg.incarnation,
                msg.to_rank,
                msg.to_session,
                msg.lease_id,
                msg.attempt,
                int(msg.outcome),
            ]
    return None


def _encode_field(name: str, kind: str, v: Any) -> Any:
    if kind == _ENGINE:
        return _check_engine(v)
    if kind == _UINT:
        return _check_uint(name, v)
    if kind == _RANKS:
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_RANKS:
            raise EncodeError(f"{name} must be an integer in [1, {MAX_RANKS}], got {v!r}")
        return v
    if kind == _MMB:
        if _check_uint(name, v) < 1:
            raise EncodeError(f"{name} must be >= 1, got {v!r}")
        return v
    if kind == _TIME:
        return _check_time(name, v)
    if kind == _DUR:
        if _check_time(name, v) <= 0.0:
            raise EncodeError(f"{name} must be a positive duration, got {v!r}")
        return float(v)
    if kind == _RATE:
        if not isinstance(v, int | float) or isinstance(v, bool) or not 0.0 <= v < 1.0:
            raise EncodeError(f"{name} must be a finite number in [0, 1), got {v!r}")
        return float(v)
    if kind == _BOOL:
        if not isinstance(v, bool):
            raise EncodeError(f"{name} must be a bool, got {v!r}")
        return v
    if kind == _IDS:
        return _pack_ids(v)
    if not isinstance(v, AccessOutcome):
        raise EncodeError(f"{name} must be an AccessOutcome, got {v!r}")
    return int(v)


def encode(msg: Message) -> bytes:
    """Encode one message; raises `EncodeError` for values the wire cannot carry (exactly the
    values `decode` would refuse)."""
    fast = _fast_encode_body(msg)
    if fast is not None:
        # `packb` builds a Packer with a 256 KiB buffer per call (most of an encode's cost);
        # a fresh small one per call packs the same bytes and stays thread-safe.
        packed_fast: bytes = msgpack.Packer(use_bin_type=True, buf_size=_FAST_PACK_BUFFER).pack(fast)
        return _bounded(MAGIC + packed_fast)
    mtype = _MESSAGE_TYPES.get(type(msg))
    if mtype is None:
        raise EncodeError(f"not a kvlease message: {msg!r}")
    body: list[Any] = [PROTOCOL_VERSION, mtype]
    for name, kind in _FIELDS[mtype]:
        body.append(_encode_field(name, kind, getattr(msg, name)))
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return _bounded(MAGIC + packed)


def _bounded(frame: bytes) -> bytes:
    if len(frame) > MAX_DECODE_BYTES:
        raise EncodeError(f"message of {len(frame)} bytes exceeds the {MAX_DECODE_BYTES}-byte bound of every decoder")
    return frame


def _decode_ids(what: str, v: Any) -> tuple[int, ...]:
    if not isinstance(v, list):
        raise DecodeError(f"{what}: expected an array of ids, got {type(v).__name__}", category="field")
    out: list[int] = []
    cur = 0
    for i, d in enumerate(v):
        if not isinstance(d, int) or isinstance(d, bool) or d < 0 or (i > 0 and d == 0):
            raise DecodeError(f"{what}[{i}]: expected a {'positive gap' if i else 'uint'}, got {d!r}", category="field")
        cur = d if i == 0 else cur + d
        if cur >= _U64:
            raise DecodeError(f"{what}[{i}]: id exceeds uint64", category="field")
        out.append(cur)
    return tuple(out)


def _decode_field(what: str, kind: str, v: Any) -> Any:
    if kind == _ENGINE:
        if not isinstance(v, str) or not v or len(v.encode("utf-8", "surrogatepass")) > MAX_ENGINE_ID_BYTES:
            raise DecodeError(
                f"{what}: expected a non-empty string of at most {MAX_ENGINE_ID_BYTES} bytes, got {v!r:.80}",
                category="field",
            )
        return v
    if kind in (_UINT, _RANKS, _MMB, _OUTCOME):
        lo, hi = {
            _UINT: (0, _U64 - 1),
            _RANKS: (1, MAX_RANKS),
            _MMB: (1, _U64 - 1),
            _OUTCOME: (0, int(max(AccessOutcome))),
        }[kind]
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise DecodeError(f"{what}: expected an integer in [{lo}, {hi}], got {v!r}", category="field")
        return AccessOutcome(v) if kind == _OUTCOME else v
    if kind == _TIME:
        if not isinstance(v, float | int) or isinstance(v, bool) or not math.isfinite(v) or abs(v) > MAX_TIME:
            raise DecodeError(f"{what}: expected a finite float within +-{MAX_TIME:.0f}, got {v!r}", category="field")
        return float(v)
    if kind == _DUR:
        if not isinstance(v, float | int) or isinstance(v, bool) or not math.isfinite(v) or not 0 < v <= MAX_TIME:
            raise DecodeError(f"{what}: expected a duration in (0, {MAX_TIME:.0f}], got {v!r}", category="field")
        return float(v)
    if kind == _RATE:
        if not isinstance(v, float | int) or isinstance(v, bool) or not 0 <= v < 1:
            raise DecodeError(f"{what}: expected a rate in [0, 1), got {v!r}", category="field")
        return float(v)
    if kind == _BOOL:
        if not isinstance(v, bool):
            raise DecodeError(f"{what}: expected a boolean, got {v!r}", category="field")
        return v
    return _decode_ids(what, v)


def _fast_ids(v: object) -> tuple[int, ...] | None:
    """`_decode_ids` for a valid list, or None to take the general path (which raises)."""
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


def _fast_tail_ids(v: list[Any], data: bytes, start: int) -> tuple[int, ...] | None:
    """`_fast_ids` for a non-empty list that ends the frame `data` and is encoded at or after
    byte `start`: a heartbeat's ids, the longest list on the wire. msgpack marks a bool with one
    byte, 0xc2 or 0xc3; with neither byte from `start` on, no item is a bool, and one array
    conversion (C) checks what the type test and `min` check one item at a time (every item
    an int in [0, 2**64)). Either byte there (in a wider int, or a float of the header before
    the list) takes the item-by-item checks: the same result, more slowly."""
    if data.find(_FALSE_BYTE, start) >= 0 or data.find(_TRUE_BYTE, start) >= 0:
        return _fast_ids(v)
    try:
        array("Q", v)
    except (TypeError, OverflowError):
        return None
    if v.count(0) > (v[0] == 0):
        return None
    out = tuple(accumulate(v))
    return out if out[-1] < _U64 else None


_TAIL_CHECK_MIN: Final = 64  # ids from which `_fast_tail_ids` pays for finding the list's start
_FALSE_BYTE: Final = b"\xc2"
_TRUE_BYTE: Final = b"\xc3"


def _fast_heartbeat(items: list[Any], data: bytes) -> Message | None:
    _, _, engine, rank, ranks, session, inc, seq, t_send, ids = items
    if (
        _fast_engine(engine)
        and _fast_ranks(rank, ranks)
        and _fast_uint(session)
        and _fast_uint(inc)
        and _fast_uint(seq)
        and _fast_time(t_send)
    ):
        if type(ids) is list and len(ids) >= _TAIL_CHECK_MIN:
            # Where the id list starts, at the earliest: every field before it in its shortest
            # msgpack form (magic, array header, version and type as fixints, a float as float32).
            start = (
                len(MAGIC)
                + 1  # the array header
                + 2  # version, type
                + (1 if len(engine) < 32 else 2)
                + len(engine)
                + uint_size(rank)
                + uint_size(ranks)
                + uint_size(session)
                + uint_size(inc)
                + uint_size(seq)
                + 5
            )
            lease_ids = _fast_tail_ids(ids, data, start)
        else:
            lease_ids = _fast_ids(ids)
        if lease_ids is not None:
            return Heartbeat(engine, rank, ranks, session, inc, seq, t_send, lease_ids)
    return None


def _fast_heartbeat_ack(items: list[Any], data: bytes) -> Message | None:
    _, _, engine, rank, inc, to_rank, to_session, seq, t_echo, t_recv, extension, renewed, u, e, r, c = items
    if (
        _fast_engine(engine)
        and _fast_uint(rank)
        and _fast_uint(inc)
        and _fast_uint(to_rank)
        and _fast_uint(to_session)
        and _fast_uint(seq)
        and _fast_time(t_echo)
        and _fast_time(t_recv)
        and _fast_duration(extension)
        and _fast_uint(renewed)
    ):
        # An ack's four lists are usually empty.
        unknown = () if u == [] else _fast_ids(u)
        expired = () if e == [] else _fast_ids(e)
        released = () if r == [] else _fast_ids(r)
        completed = () if c == [] else _fast_ids(c)
        if unknown is not None and expired is not None and released is not None and completed is not None:
            return HeartbeatAck(
                engine,
                rank,
                inc,
                to_rank,
                to_session,
                seq,
                t_echo,
                t_recv,
                extension,
                renewed,
                unknown,
                expired,
                released,
                completed,
            )
    return None


def _fast_access_done(items: list[Any], data: bytes) -> Message | None:
    _, _, engine, rank, ranks, session, inc, to_rank, lease_id, attempt, confirm, t_send = items
    if (
        _fast_engine(engine)
        and _fast_ranks(rank, ranks)
        and _fast_uint(session)
        and _fast_uint(inc)
        and _fast_uint(to_rank)
        and _fast_uint(lease_id)
        and _fast_uint(attempt)
        and type(confirm) is bool
        and _fast_time(t_send)
    ):
        return AccessDone(engine, rank, ranks, session, inc, to_rank, lease_id, attempt, confirm, t_send)
    return None


_OUTCOMES: Final = {int(o): o for o in AccessOutcome}


def _fast_access_done_ack(items: list[Any], data: bytes) -> Message | None:
    _, _, engine, rank, inc, to_rank, to_session, lease_id, attempt, outcome = items
    if (
        _fast_engine(engine)
        and _fast_uint(rank)
        and _fast_uint(inc)
        and _fast_uint(to_rank)
        and _fast_uint(to_session)
        and _fast_uint(lease_id)
        and _fast_uint(attempt)
        and type(outcome) is int
    ):
        verdict = _OUTCOMES.get(outcome)
        if verdict is not None:
            return AccessDoneAck(engine, rank, inc, to_rank, to_session, lease_id, attempt, verdict)
    return None


#: type -> (array length, fast decoder)
_FAST_DECODERS: Final[dict[int, tuple[int, Callable[[list[Any], bytes], Message | None]]]] = {
    _T_HEARTBEAT: (2 + _ARITY[_T_HEARTBEAT], _fast_heartbeat),
    _T_HEARTBEAT_ACK: (2 + _ARITY[_T_HEARTBEAT_ACK], _fast_heartbeat_ack),
    _T_ACCESS_DONE: (2 + _ARITY[_T_ACCESS_DONE], _fast_access_done),
    _T_ACCESS_DONE_ACK: (2 + _ARITY[_T_ACCESS_DONE_ACK], _fast_access_done_ack),
}


def decode(data: bytes | bytearray | memoryview, *, max_bytes: int = MAX_DECODE_BYTES) -> Message:
    """Decode one native frame. Any problem raises `DecodeError` naming what was wrong."""
    if type(data) is not bytes:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise DecodeError(f"expected bytes, got {type(data).__name__}", category="frame")
        data = bytes(data)
    if len(data) > max_bytes:
        raise DecodeError(f"message of {len(data)} bytes exceeds the {max_bytes}-byte bound", category="frame")
    if data[:2] != MAGIC:
        raise DecodeError(f"not a kvlease frame: starts with {data[:2]!r}, expected {MAGIC!r}", category="frame")
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
        raise DecodeError(f"malformed msgpack body: {type(exc).__name__}: {exc}", category="body") from None
    if type(items) is list and len(items) > 2 and type(items[0]) is int and items[0] == PROTOCOL_VERSION:
        mtype = items[1]
        fast = _FAST_DECODERS.get(mtype) if type(mtype) is int else None
        if fast is not None and len(items) == fast[0]:
            # Exactly the frames the checks below pass on to `_decode_fields` for this type.
            try:
                msg = fast[1](items, data)
            except Exception as exc:  # defensive, as below: nothing but DecodeError escapes
                raise DecodeError(f"malformed message: {type(exc).__name__}: {exc}", category="field") from None
            if msg is not None:
                return msg
    if not isinstance(items, list) or len(items) < 2:
        raise DecodeError(f"expected an array [version, type, ...], got {type(items).__name__}", category="body")
    version, mtype = items[0], items[1]
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise DecodeError(
            f"unsupported protocol version {version!r} (this peer speaks {PROTOCOL_VERSION})", category="version"
        )
    if not isinstance(mtype, int) or isinstance(mtype, bool) or mtype not in _ARITY:
        raise DecodeError(f"unknown message type {mtype!r}", category="type")
    if len(items) != 2 + _ARITY[mtype]:
        raise DecodeError(
            f"message type {mtype} expects {_ARITY[mtype]} fields, got {len(items) - 2}", category="arity"
        )
    try:
        return _decode_fields(mtype, items)
    except DecodeError:
        raise
    except Exception as exc:  # defensive: nothing else may escape
        raise DecodeError(f"malformed message: {type(exc).__name__}: {exc}", category="field") from None


def _decode_fields(mtype: int, items: list[Any]) -> Message:
    cls = _CLASSES[mtype]
    fields = zip(_FIELDS[mtype], items[2:], strict=True)
    values = [_decode_field(f"{cls.__name__}.{name}", kind, v) for (name, kind), v in fields]
    msg: Message = cls(*values)
    return msg
