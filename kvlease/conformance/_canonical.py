"""Canonical JSON forms of messages, outputs and errors, and the comparison rule for them.

This module owns the language-neutral shape the conformance vectors and the driver protocol
use (spec/vectors/README.md). Pure: it never reads a clock, a file or a socket.
"""

from __future__ import annotations

import enum
import math
from typing import TypeAlias

import attrs

from .._codec import decode, encode
from .._events import (
    AccessCompleted,
    AccessStale,
    Free,
    HandshakeNeeded,
    LeaseLost,
    Output,
    Rejected,
    Send,
)
from .._messages import Message
from .._vllm_compat import VllmAccessDone, VllmHeartbeat

__all__ = [
    "FLOAT_TOLERANCE",
    "INFORMATIVE_KEYS",
    "JSON",
    "JSONDict",
    "compare",
    "message_to_json",
    "output_to_json",
    "strip_informative",
]

JSON: TypeAlias = bool | int | float | str | list["JSON"] | dict[str, "JSON"] | None
JSONDict: TypeAlias = dict[str, JSON]

#: Absolute tolerance for floats that an implementation *computes* (validity windows,
#: converted deadlines). Times that only travel (echoed on the wire, `Free.at`) are exact in
#: the bytes anyway; on the JSON side this bound is far below any protocol margin.
FLOAT_TOLERANCE = 1e-6

#: Keys that `compare` skips: free-text reasons, decoded copies of hex, notes, and the deadline
#: keys (`next_deadline` is the reference's, which may be early; `next_work` is checked as a
#: bound on the implementation's next_deadline by the runner, not compared for equality).
INFORMATIVE_KEYS = frozenset({"reason_text", "message", "note", "next_deadline", "next_work", "error_message"})


def _plain(v: object) -> JSON:
    if isinstance(v, enum.Enum):
        value = v.value
        assert isinstance(value, int | str)
        return value
    if isinstance(v, tuple | list):
        return [_plain(x) for x in v]
    if v is None or isinstance(v, bool | int | str):
        return v
    if isinstance(v, float):
        return v
    raise TypeError(f"no canonical JSON form for {v!r}")


def message_to_json(msg: Message | VllmHeartbeat | VllmAccessDone) -> JSONDict:
    """``{"type": <class name>, <field>: <value>, ...}``; enums as their wire integers."""
    out: JSONDict = {"type": type(msg).__name__}
    for field in attrs.fields(type(msg)):
        out[field.name] = _plain(getattr(msg, field.name))
    return out


def _annotated_hex(data: bytes) -> JSONDict:
    return {"hex": data.hex(), "message": message_to_json(decode(data))}


def output_to_json(o: Output, *, annotate: bool = False) -> JSONDict:
    """The canonical form of one state-machine output. Wire messages appear as the exact
    bytes (hex); with `annotate`, a decoded copy is added under the informative key
    ``message`` for human readers."""

    def wire(msg: Message) -> JSONDict:
        data = encode(msg)
        return _annotated_hex(data) if annotate else {"hex": data.hex()}

    match o:
        case Send():
            return {"type": "Send", "engine_id": o.engine_id, "rank": o.rank, **wire(o.message)}
        case HandshakeNeeded():
            return {"type": "HandshakeNeeded", "engine_id": o.engine_id, **wire(o.message)}
        case Free():
            return {
                "type": "Free",
                "lease_id": o.lease_id,
                "key": o.key,
                "reason": o.reason.value,
                "at": float(o.at),
            }
        case Rejected():
            return {"type": "Rejected", "engine_id": o.engine_id, "reason_text": o.reason}
        case LeaseLost():
            return {"type": "LeaseLost", "key": o.key, "lease_id": o.lease_id, "reason": o.reason.value}
        case AccessCompleted():
            return {
                "type": "AccessCompleted",
                "key": o.key,
                "lease_id": o.lease_id,
                "confirmed_by_pinner": o.confirmed_by_pinner,
            }
        case AccessStale():
            return {"type": "AccessStale", "key": o.key, "lease_id": o.lease_id, "reason_text": o.reason}
    raise TypeError(f"not an output: {o!r}")  # pragma: no cover


def strip_informative(v: JSON) -> JSON:
    """A copy of `v` without informative keys, at every depth."""
    if isinstance(v, dict):
        return {k: strip_informative(x) for k, x in v.items() if k not in INFORMATIVE_KEYS}
    if isinstance(v, list):
        return [strip_informative(x) for x in v]
    return v


def compare(expected: JSON, actual: JSON, path: str = "$") -> str | None:
    """None if `actual` conforms to `expected`, else where and how it differs.

    Informative keys are ignored on both sides; floats (and an int against a float) agree
    within `FLOAT_TOLERANCE`; booleans are never numbers; lists compare in order.
    """
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return f"{path}: expected an object, got {_kind(actual)}"
        keys = (set(expected) | set(actual)) - INFORMATIVE_KEYS
        for k in sorted(keys):
            if k not in expected:
                return f"{path}.{k}: unexpected key (value {actual[k]!r})"
            if k not in actual:
                return f"{path}.{k}: missing (expected {expected[k]!r})"
            why = compare(expected[k], actual[k], f"{path}.{k}")
            if why is not None:
                return why
        return None
    if isinstance(expected, list):
        if not isinstance(actual, list):
            return f"{path}: expected an array, got {_kind(actual)}"
        for i, (e, a) in enumerate(zip(expected, actual, strict=False)):
            why = compare(e, a, f"{path}[{i}]")
            if why is not None:
                return why
        if len(expected) != len(actual):
            return f"{path}: expected {len(expected)} items, got {len(actual)}"
        return None
    if _is_number(expected) and _is_number(actual):
        assert isinstance(expected, int | float) and isinstance(actual, int | float)
        if isinstance(expected, int) and isinstance(actual, int):
            ok = expected == actual
        else:
            ok = math.isclose(expected, actual, rel_tol=0.0, abs_tol=FLOAT_TOLERANCE)
        return None if ok else f"{path}: expected {expected!r}, got {actual!r}"
    if type(expected) is not type(actual) or expected != actual:
        return f"{path}: expected {expected!r}, got {actual!r}"
    return None


def _is_number(v: JSON) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _kind(v: JSON) -> str:
    return "null" if v is None else type(v).__name__
