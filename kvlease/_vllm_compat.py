"""A codec for vLLM's native NIXL lease notifications, so a stock vLLM peer is understood.

vLLM sends ``b"HB:" + b",".join(request_ids)`` as a heartbeat and ``f"{request_id}:{count}"``
when a reading worker finishes. The format has no escaping: an id containing ``,`` splits into
two, one containing ``:`` is ambiguous in ``id:count`` (vLLM splits on the *last* colon), and an
id starting with ``HB:`` makes a read-done look like a heartbeat. `encode_*` refuses such ids
with `EncodeError`; `decode_vllm` raises only `DecodeError`.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from ._errors import DecodeError, EncodeError

__all__ = ["VllmAccessDone", "VllmHeartbeat", "decode_vllm", "encode_vllm_done", "encode_vllm_heartbeat"]

HEARTBEAT_PREFIX = b"HB:"
MAX_VLLM_BYTES = 1 << 20
MAX_REQUEST_ID_BYTES = 1024


@attrs.frozen
class VllmHeartbeat:
    request_ids: tuple[str, ...]


@attrs.frozen
class VllmAccessDone:
    request_id: str
    count: int


def _check_id(rid: str, *, in_heartbeat: bool) -> bytes:
    if not isinstance(rid, str):
        raise EncodeError(f"vLLM request id must be a str, got {type(rid).__name__}")
    if not rid:
        raise EncodeError("vLLM request id must not be empty")
    try:
        raw = rid.encode("utf-8")
    except UnicodeEncodeError:
        raise EncodeError(f"vLLM request id {rid!r} is not valid UTF-8 text") from None
    if len(raw) > MAX_REQUEST_ID_BYTES:
        raise EncodeError(f"vLLM request id of {len(raw)} bytes exceeds {MAX_REQUEST_ID_BYTES}")
    if b"," in raw:
        raise EncodeError(f"vLLM request id {rid!r} contains ',' which the HB: format cannot carry")
    if raw.startswith(HEARTBEAT_PREFIX):
        raise EncodeError(f"vLLM request id {rid!r} starts with 'HB:' and would read as a heartbeat")
    if not in_heartbeat and b":" in raw:
        raise EncodeError(f"vLLM request id {rid!r} contains ':' which makes 'id:count' ambiguous")
    return raw


def encode_vllm_heartbeat(request_ids: Iterable[str]) -> bytes:
    ids = [_check_id(r, in_heartbeat=True) for r in request_ids]
    if not ids:
        raise EncodeError("a vLLM heartbeat needs at least one request id")
    data = HEARTBEAT_PREFIX + b",".join(ids)
    if len(data) > MAX_VLLM_BYTES:
        raise EncodeError(f"vLLM heartbeat of {len(data)} bytes exceeds {MAX_VLLM_BYTES}")
    return data


def encode_vllm_done(request_id: str, count: int) -> bytes:
    raw = _check_id(request_id, in_heartbeat=False)
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= 1 << 16:
        raise EncodeError(f"vLLM read-done count must be in [1, 65536], got {count!r}")
    return raw + b":" + str(count).encode()


def decode_vllm(data: bytes | bytearray | memoryview) -> VllmHeartbeat | VllmAccessDone:
    """Decode one vLLM notification. Only `DecodeError` escapes."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise DecodeError(f"expected bytes, got {type(data).__name__}", category="frame")
    data = bytes(data)
    if len(data) > MAX_VLLM_BYTES:
        raise DecodeError(f"vLLM notification of {len(data)} bytes exceeds {MAX_VLLM_BYTES}", category="frame")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DecodeError(f"vLLM notification is not UTF-8: {exc}", category="frame") from None
    if text.startswith("HB:"):
        ids = text[3:].split(",")
        if any(not i for i in ids):
            raise DecodeError("vLLM heartbeat has an empty request id", category="field")
        if any(len(i.encode()) > MAX_REQUEST_ID_BYTES for i in ids):
            raise DecodeError(f"vLLM heartbeat has a request id over {MAX_REQUEST_ID_BYTES} bytes", category="field")
        return VllmHeartbeat(tuple(ids))
    rid, sep, count = text.rpartition(":")
    if not sep or not rid:
        raise DecodeError(f"not a vLLM notification: {text[:80]!r}", category="frame")
    if not count.isascii() or not count.isdigit() or len(count) > 6:
        raise DecodeError(f"vLLM read-done count is not a small integer: {count[:20]!r}", category="field")
    n = int(count)
    if not 1 <= n <= 1 << 16:
        raise DecodeError(f"vLLM read-done count {n} out of range [1, 65536]", category="field")
    if len(rid.encode()) > MAX_REQUEST_ID_BYTES:
        raise DecodeError(f"vLLM request id over {MAX_REQUEST_ID_BYTES} bytes", category="field")
    return VllmAccessDone(rid, n)
