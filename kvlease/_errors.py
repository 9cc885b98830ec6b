"""The kvlease error tree.

Expected races (a heartbeat for an expired lease, a duplicate access-done) are *outputs* of the
state machines, never exceptions. Exceptions are for misuse by the local caller
(`LocalProtocolError`), for a peer that broke the protocol (`RemoteProtocolError`), for bytes
that are not a kvlease message (`DecodeError`) and for bad configuration (`ConfigError`).
"""

from __future__ import annotations

from typing import Final, Literal, get_args

__all__ = [
    "DECODE_ERROR_CATEGORIES",
    "ConfigError",
    "DecodeError",
    "DecodeErrorCategory",
    "EncodeError",
    "KvLeaseError",
    "LocalProtocolError",
    "ProtocolError",
    "RemoteProtocolError",
]


class KvLeaseError(Exception):
    """Base of every error kvlease raises."""


class ConfigError(KvLeaseError, ValueError):
    """A configuration value is out of range; the message names the setting."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"invalid {field}={value!r}: expected {allowed}")


class ProtocolError(KvLeaseError):
    """The protocol was violated, by us or by the peer."""


class LocalProtocolError(ProtocolError):
    """The local caller misused the state machine (time ran backwards, unknown lease, ...)."""


class RemoteProtocolError(ProtocolError):
    """A peer sent something that decodes but breaks the protocol's rules."""


#: Why bytes did not decode, in the language-neutral words of the conformance vectors
#: (PROTOCOL.md §8, spec/vectors/README.md): ``frame`` (not a frame at all: wrong magic, too
#: large, not bytes; vLLM: not UTF-8, no ``HB:`` and no ``id:count``), ``body`` (the msgpack body
#: is malformed, not an array of >= 2 items, or breaks a decoder limit), ``version``, ``type``,
#: ``arity`` (wrong field count for the type), ``field`` (a field's kind or bound) and ``auth``
#: (not a frame sealed with one of the configured keys, PROTOCOL.md §4.5).
DecodeErrorCategory = Literal["frame", "body", "version", "type", "arity", "field", "auth"]

DECODE_ERROR_CATEGORIES: Final[frozenset[DecodeErrorCategory]] = frozenset(get_args(DecodeErrorCategory))


class DecodeError(KvLeaseError):
    """Bytes from the wire are not a valid kvlease message. The only error `decode` raises.

    `category` says why, as one of `DECODE_ERROR_CATEGORIES`: match on it, not on the message,
    which is for people and may change.
    """

    def __init__(self, message: str, category: DecodeErrorCategory) -> None:
        self.category: DecodeErrorCategory = category
        super().__init__(message)

    def __reduce__(self) -> tuple[type[DecodeError], tuple[str, DecodeErrorCategory]]:
        # Exceptions pickle as `cls(*args)`; `category` is not in `args`, so say it here.
        return (type(self), (str(self), self.category))


class EncodeError(KvLeaseError, ValueError):
    """A value cannot be put on the wire (for example an id the vLLM format cannot carry)."""
