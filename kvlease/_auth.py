"""Deployment-key authentication of native frames: sealing and opening, nothing else.

A sealed frame is ``0xC1 0x41``, a 16-byte tag, then the msgpack body of the native frame (the
same body that follows ``0xC1 0x4B`` in an unsealed one). The tag is keyed BLAKE2b-128 over the
two magic bytes and the body, so it covers every byte of the message; `FrameAuth.open` checks it
(against each configured key: the current one and, during a rotation, the previous one) before
anything past the magic is decoded. Sealing costs `MAC_BYTES` (16) bytes per message, which the
core budgets against `max_message_bytes` when `LeaseConfig.auth_keys` is set.

The key material is held here as bytes and never appears in a repr or a log line. Reading it
from a file or an environment variable is I/O and belongs to the driver
(`kvlease.transports.load_frame_auth`). Never reads a clock, never does I/O.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import Final

from ._codec import MAGIC
from ._errors import DecodeError, LocalProtocolError

__all__ = ["MAC_BYTES", "SEALED_MAGIC", "FrameAuth", "is_sealed_frame"]

#: The first two bytes of a sealed frame (0xC1 never starts msgpack or UTF-8 text).
SEALED_MAGIC: Final = b"\xc1\x41"
#: Bytes of the authentication tag in every sealed frame.
MAC_BYTES: Final = 16
#: The smallest key: 128 bits.
MIN_KEY_BYTES: Final = 16
_PERSON: Final = b"kvlease-frame-v2"  # 16 bytes: BLAKE2b personalization (domain separation)
_TICKET_PERSON: Final = b"kvlease-tkt-v3\x00\x00"  # tickets: another domain than frames
_MESSAGE_PERSON: Final = b"kvlease-msg-v3\x00\x00"  # an adapter's own messages: a third domain


def is_sealed_frame(data: bytes | bytearray | memoryview) -> bool:
    """True if `data` starts like a sealed frame (its tag may still be wrong)."""
    return data[:2] == SEALED_MAGIC


class FrameAuth:
    """Seals outgoing native frames with the first key and opens incoming ones with any key.

    ``FrameAuth([new])`` in steady state; ``FrameAuth([new, old])`` during a rotation (accept
    both, sign with the new), then ``FrameAuth([new])`` again once every peer signs with it.
    """

    __slots__ = ("_keys",)

    def __init__(self, keys: Sequence[bytes]) -> None:
        if not 1 <= len(keys) <= 2:
            raise LocalProtocolError(f"FrameAuth takes the current key and at most one previous key, got {len(keys)}")
        for k in keys:
            if not isinstance(k, bytes) or not MIN_KEY_BYTES <= len(k) <= 64:
                raise LocalProtocolError(f"an authentication key is {MIN_KEY_BYTES} to 64 bytes")
        self._keys = tuple(keys)

    def __repr__(self) -> str:
        return f"FrameAuth(<{len(self._keys)} key(s) hidden>)"

    def _tag(self, key: bytes, body: bytes) -> bytes:
        return hashlib.blake2b(SEALED_MAGIC + body, digest_size=MAC_BYTES, key=key, person=_PERSON).digest()

    def seal(self, frame: bytes) -> bytes:
        """A native frame (``MAGIC`` + body, from `encode`) as a sealed frame."""
        if frame[:2] != MAGIC:
            raise LocalProtocolError("only native kvlease frames are sealed")
        body = frame[2:]
        return SEALED_MAGIC + self._tag(self._keys[0], body) + body

    def open(self, data: bytes | bytearray | memoryview) -> bytes:
        """The native frame inside a sealed one, for `decode`. Raises `DecodeError` (category
        ``auth``) for anything that is not a frame sealed with one of the keys."""
        data = bytes(data)
        if data[:2] != SEALED_MAGIC:
            what = "an unsealed kvlease frame" if data[:2] == MAGIC else "not a sealed kvlease frame"
            raise DecodeError(f"authentication required: {what}", category="auth")
        if len(data) < 2 + MAC_BYTES:
            raise DecodeError("authentication failed: sealed frame shorter than its tag", category="auth")
        tag, body = data[2 : 2 + MAC_BYTES], data[2 + MAC_BYTES :]
        for key in self._keys:
            if hmac.compare_digest(tag, self._tag(key, body)):
                return MAGIC + body
        raise DecodeError("authentication failed: the tag matches no configured key", category="auth")

    def ticket_tag(self, payload: bytes) -> str:
        """The tag of a lease ticket's canonical bytes (`LeaseTicket.sealed_dict`), as hex."""
        return self._ticket_tag(self._keys[0], payload).hex()

    def check_ticket_tag(self, payload: bytes, tag: str) -> bool:
        """Whether `tag` (hex) is the tag of `payload` under one of the keys."""
        try:
            raw = bytes.fromhex(tag)
        except ValueError:
            return False
        return any(hmac.compare_digest(raw, self._ticket_tag(key, payload)) for key in self._keys)

    def _ticket_tag(self, key: bytes, payload: bytes) -> bytes:
        return hashlib.blake2b(payload, digest_size=MAC_BYTES, key=key, person=_TICKET_PERSON).digest()

    def message_tag(self, payload: bytes) -> bytes:
        """The tag of an adapter's own control message (e.g. a ticket request), raw bytes. Its
        own domain: no frame's or ticket's tag is ever a valid message tag, nor the reverse."""
        return self._message_tag(self._keys[0], payload)

    def check_message_tag(self, payload: bytes, tag: bytes) -> bool:
        """Whether `tag` is the message tag of `payload` under one of the keys."""
        return any(hmac.compare_digest(tag, self._message_tag(key, payload)) for key in self._keys)

    def _message_tag(self, key: bytes, payload: bytes) -> bytes:
        return hashlib.blake2b(payload, digest_size=MAC_BYTES, key=key, person=_MESSAGE_PERSON).digest()
