"""The wire between the demo's pinner and accessor processes: the only transport-specific layer.

A link carries three things between the two processes: encoded lease-protocol messages (what
NIXL would carry as notifications), control frames (the lease ticket and block list a router
would carry in ``kv_transfer_params``), and the KV read itself. `ZmqLink` does all three over
one ZMQ PAIR socket on 127.0.0.1 (the read is a request answered with the bytes of the blocks,
served from the pinner's pool whatever the lease state, as an RDMA READ would be). The NIXL link
(`_demo_nixl`) does the read as a real NIXL READ of registered memory.

This module owns no protocol logic: it moves bytes. It is part of the application shell.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import zmq

__all__ = ["Frame", "Link", "ZmqLink"]

#: (kind, payload): kind is "msg" (encoded protocol message), "ctl" (a JSON object),
#: "read" (pinner side: a read request {key, blocks}), "data" (accessor side: {key} + bytes).
Frame = tuple[str, Any]


class Link(Protocol):
    def wait(self, timeout: float) -> None:
        """Block until input may be ready or `timeout` seconds passed."""

    def recv(self) -> list[Frame]:
        """Every frame received so far (never blocks)."""

    def send_msg(self, data: bytes) -> None: ...

    def send_ctl(self, obj: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class PinnerLink(Link, Protocol):
    def pool_write(self, block: int, data: bytes) -> None:
        """Fill one block of the pinned pool (a prefill writing KV, or a reuse overwriting it)."""

    def serve_read(self, key: str, blocks: list[int]) -> None:
        """Answer a read request (only links whose reads need the pinner's help)."""


class AccessorLink(Link, Protocol):
    def start_read(self, key: str, blocks: list[int]) -> None:
        """Start reading `blocks` of the pinner's pool; a ("data", (key, bytes)) frame follows."""


class ZmqLink:
    """Both ends of the ZMQ loopback link; the pinner binds, the accessor connects."""

    def __init__(
        self,
        *,
        bind: bool,
        endpoint: str = "tcp://127.0.0.1:*",
        block_size: int = 4096,
        blocks: int = 0,
        blocks_per_request: int = 16,
        epoch: float = 0.0,
    ) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PAIR)
        self._sock.setsockopt(zmq.LINGER, 0)
        if bind:
            self._sock.bind(endpoint)
            self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._sock.connect(endpoint)
            self.endpoint = endpoint
        self.block_size = block_size
        self._pool = bytearray(block_size * blocks)

    def wait(self, timeout: float) -> None:
        self._sock.poll(max(0, int(timeout * 1000)), zmq.POLLIN)

    def recv(self) -> list[Frame]:
        out: list[Frame] = []
        while True:
            try:
                parts = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            kind = parts[0]
            if kind == b"M":
                out.append(("msg", parts[1]))
            elif kind == b"C":
                out.append(("ctl", json.loads(parts[1])))
            elif kind == b"R":
                out.append(("read", json.loads(parts[1])))
            elif kind == b"D":
                out.append(("data", (parts[1].decode(), parts[2])))

    def send_msg(self, data: bytes) -> None:
        self._sock.send_multipart([b"M", data], zmq.NOBLOCK)

    def send_ctl(self, obj: dict[str, Any]) -> None:
        self._sock.send_multipart([b"C", json.dumps(obj).encode()], zmq.NOBLOCK)

    # pinner side
    def pool_write(self, block: int, data: bytes) -> None:
        bs = self.block_size
        self._pool[block * bs : (block + 1) * bs] = data

    def serve_read(self, key: str, blocks: list[int]) -> None:
        bs = self.block_size
        data = b"".join(bytes(self._pool[b * bs : (b + 1) * bs]) for b in blocks)
        self._sock.send_multipart([b"D", key.encode(), data], zmq.NOBLOCK)

    # accessor side
    def start_read(self, key: str, blocks: list[int]) -> None:
        self._sock.send_multipart([b"R", json.dumps({"key": key, "blocks": blocks}).encode()], zmq.NOBLOCK)

    def close(self) -> None:
        self._sock.close(linger=500)  # let the last access-done and bye frames go
