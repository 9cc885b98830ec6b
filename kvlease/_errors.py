"""The kvlease error tree.

Expected races (a heartbeat for an expired lease, a duplicate access-done) are *outputs* of the
state machines, never exceptions. Exceptions are for misuse by the local caller
(`LocalProtocolError`), for a peer that broke the protocol (`RemoteProtocolError`), for bytes
that are not a kvlease message (`DecodeError`) and for bad configuration (`ConfigError`).
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "DecodeError",
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


class DecodeError(KvLeaseError):
    """Bytes from the wire are not a valid kvlease message. The only error `decode` raises."""


class EncodeError(KvLeaseError, ValueError):
    """A value cannot be put on the wire (for example an id the vLLM format cannot carry)."""
