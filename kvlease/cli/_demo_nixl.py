"""The demo's NIXL link: lease messages as NIXL notifications, the KV read as a real NIXL READ.

Built on `kvlease.transports.nixl.NixlTransport` (UCX backend, loopback). The pinner registers
its KV pool as one region per request slot (torch tensors in host memory: DRAM); the accessor
READs a slot into its own tensor. Registration outlives leases, as in an engine, so a READ
after the pinner freed and reused a slot succeeds at the transport and returns the new
owner's bytes: only the lease protocol can catch it. The accessor connects with a proactive
handshake over the transport's side channel (the kvlease `Handshake` it carries is answered by
the pinner's core like any other); control frames (ticket, hello, bye) then ride on
notifications, tagged so they never look like kvlease frames.

This module moves bytes only; it holds no lease logic.
"""

from __future__ import annotations

import json
import time
from collections import deque
from typing import Any

from kvlease import (
    PROTOCOL_VERSION,
    Capability,
    DecodeError,
    Handshake,
    HandshakeReply,
    LocalTime,
    decode,
    encode,
)

from ..transports._base import (  # type: ignore[import-not-found,unused-ignore]
    HandshakeFailed,
    HandshakeRequest,
    HandshakeResponse,
    PeerUnreachable,
)
from ..transports.nixl import NixlTransport  # type: ignore[import-not-found,unused-ignore]
from ._demo_link import Frame

__all__ = ["NixlLink"]

#: Tag of the demo's control frames: 0xC1 never starts JSON, and 0x44 differs from the kvlease
#: (0x4B) and NIXL layout (0x4E) magics.
_CTL = b"\xc1\x44"
PINNER, ACCESSOR = "prefill-0", "decode-0"


class NixlLink:
    def __init__(
        self,
        *,
        bind: bool,
        endpoint: str = "",
        block_size: int = 4096,
        blocks: int = 0,
        blocks_per_request: int = 16,
        epoch: float = 0.0,
    ) -> None:
        import torch

        self.bind = bind
        self.block_size = block_size
        self.slot_bytes = block_size * blocks_per_request
        self.blocks_per_request = blocks_per_request
        self._epoch = epoch
        self._t = NixlTransport(PINNER if bind else ACCESSOR)
        self._frames: deque[Frame] = deque()
        self._tokens: deque[int] = deque()
        self._pending_ctl: list[bytes] = []
        self._connected = bind
        self._reads: dict[int, tuple[str, Any]] = {}
        self.send_failures = 0
        if bind:
            self._pool = torch.zeros(block_size * blocks, dtype=torch.uint8)
            for slot in range(blocks // blocks_per_request):
                self._t.register(f"slot-{slot}", self._pool[slot * self.slot_bytes : (slot + 1) * self.slot_bytes])
            self.endpoint = self._t.address
        else:
            self.endpoint = endpoint
            self._handshake()

    def _handshake(self) -> None:
        # Proactive handshake: connect to the pinner engine before any request needs it.
        now = LocalTime(time.monotonic() + self._epoch)
        hs = Handshake(
            ACCESSOR,
            0,
            1,
            PROTOCOL_VERSION,
            int(Capability.HEARTBEAT_ACK | Capability.PUSH | Capability.CONFIRM_ACCESS),
            now,
        )
        self._t.request_handshake(PINNER, self.endpoint, encode(hs))

    def wait(self, timeout: float) -> None:
        self._t.wait(timeout)

    def recv(self) -> list[Frame]:
        t = self._t
        t.progress()
        for ev in t.poll_handshakes():
            if isinstance(ev, HandshakeRequest):
                self._tokens.append(ev.token)
                self._frames.append(("msg", ev.data))
            elif isinstance(ev, HandshakeResponse):
                self._frames.append(("msg", ev.data))
                if not self._connected:
                    self._connected = True
                    for data in self._pending_ctl:
                        self._send(data)
                    self._pending_ctl.clear()
            elif isinstance(ev, HandshakeFailed):
                self._handshake()  # the pinner may still be starting: retry
        for inbound in t.receive():
            data = inbound.data
            if data[:2] == _CTL:
                self._frames.append(("ctl", json.loads(data[2:])))
            else:
                self._frames.append(("msg", data))
        for res in t.poll_transfers():
            pending = self._reads.pop(res.handle, None)
            if pending is None:
                continue
            key, into = pending
            # A failed READ yields no bytes: the accessor's content check fails it.
            self._frames.append(("data", (key, bytes(into.numpy().tobytes()) if res.ok else b"")))
        out = list(self._frames)
        self._frames.clear()
        return out

    def _send(self, data: bytes) -> None:
        target = ACCESSOR if self.bind else PINNER
        try:
            self._t.send(target, None, data)
        except PeerUnreachable:
            self.send_failures += 1  # a hint only; the lease timers decide

    def send_msg(self, data: bytes) -> None:
        if self.bind and self._tokens:
            try:
                msg = decode(data)
            except DecodeError:
                msg = None
            if isinstance(msg, HandshakeReply):
                self._t.answer_handshake(self._tokens.popleft(), data)
                return
        if not self.bind:
            try:
                msg = decode(data)
            except DecodeError:
                msg = None
            if isinstance(msg, Handshake):
                self._t.request_handshake(PINNER, self.endpoint, data)
                return
        self._send(data)

    def send_ctl(self, obj: dict[str, Any]) -> None:
        data = _CTL + json.dumps(obj).encode()
        if not self._connected:
            self._pending_ctl.append(data)
        else:
            self._send(data)

    # pinner side
    def pool_write(self, block: int, data: bytes) -> None:
        import torch

        bs = self.block_size
        self._pool[block * bs : (block + 1) * bs] = torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def serve_read(self, key: str, blocks: list[int]) -> None:
        pass  # NIXL READs need no help from the pinner beyond its progress() polling

    # accessor side
    def start_read(self, key: str, blocks: list[int]) -> None:
        import torch

        slot = min(blocks) // self.blocks_per_request
        into = torch.empty(self.slot_bytes, dtype=torch.uint8)
        handle = self._t.start_read(PINNER, 0, f"slot-{slot}", into, None)
        self._reads[handle] = (key, into)

    def close(self) -> None:
        # Let the last notifications (access-done, bye) go before the agent disappears.
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline:
            self._t.progress()
            self._t.wait(0.01)
        self._t.close()
