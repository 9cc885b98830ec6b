"""The contract between the kvlease driver and a transport (ZMQ, NIXL, ...).

This module owns the `Transport` protocol a transport implements, the small values that cross
it (`Inbound`, handshake events, `TransferResult`), the `PeerUnreachable` hint, and the events
the driver adds to the core's outputs (`PeerSuspect`, `PeerDead`, `TransferFailed`). It holds no
logic and must never read a clock or touch a socket.

The contract, in the driver's words:

- **Identity.** A transport belongs to one worker (`rank`) of one engine (`engine_id`). Engine
  ids are the kvlease engine ids; a worker's transport serves both its pinner and its accessor
  role (messages are self-describing, so the driver routes them by type, never by path).
- **Control plane.** `send(engine_id, rank, data)` delivers one kvlease frame (or a vLLM compat
  notification) to worker `rank` of `engine_id`, or to every known worker of it when rank is
  None. It never blocks; it raises `PeerUnreachable` when it *knows* delivery failed or is
  impossible (no address, socket error). That is a hint only: a send that returns may still be
  lost, and safety never rests on either outcome. `receive()` drains every frame that has
  arrived, as `Inbound(engine_id, rank, data)` with the sender as the transport knows it; it
  never blocks and never raises for bad bytes (the driver decodes and judges them).
- **Handshake side channel.** The accessor side calls `request_handshake(engine_id, address,
  data)` with an encoded kvlease `Handshake`; the transport carries it, together with its own
  metadata (addresses of every worker, block layout, NIXL agent metadata, ...), to `address`
  — the pinner engine's rank-0 side channel — possibly from a background thread. On the pinner
  side the request surfaces from `poll_handshakes()` as a `HandshakeRequest`; the driver
  answers it *in its step* (the core is single-threaded) with `answer_handshake(token, reply)`.
  The reply surfaces on the accessor side as `HandshakeResponse` (after the transport has
  consumed the pinner's metadata, so sends to every worker of that engine work) or
  `HandshakeFailed`. A transport may also let a handshake arrive through `receive()`; the
  driver handles both. Each step the driver calls `receive()` *first*, then
  `poll_handshakes()` and `poll_transfers()`, so a transport may fill those queues while it
  drains in `receive()`.
- **Data plane.** The pinner side `register(region, buffer)`s memory (a writable object with
  the buffer protocol — bytearray, numpy array — or a contiguous CPU torch tensor; CUDA tensors
  where the transport supports them). Registration outlives leases: like RDMA-registered KV
  blocks, a region's memory is reused by the engine for a later request, which is exactly why
  a late access must be caught by the lease protocol and not by the transport. The accessor
  side starts `start_read(engine_id, rank, region, into, notif)` (pull: copy the whole remote
  region into `into`) or `start_write(engine_id, rank, region, src, notif)` (push), and gets a
  handle; completion is reported by `poll_transfers()`. The driver times transfers out (it
  owns the clock) and calls `cancel_transfer(handle)`; `forget_peer` fails every transfer in
  flight to that engine. `notif`, when given, is delivered to
  the remote worker's `receive()` only after the data has landed (NIXL's notification attached
  to a transfer; ZMQ: the next frame on the same ordered stream, after the READ's bytes were
  copied or the WRITE applied), and never when the transfer failed. The driver passes the
  core's encoded `AccessDone` there, so the pinner hears "done" with the data, without a
  separate message; a transport must deliver it (dropping it costs the lease its expiry, never
  safety, but turns every access into a late free).
- **Progress and liveness.** `progress()` does whatever must happen for remote peers to make
  progress against this worker (serve ZMQ reads, poll NIXL transfers); the driver calls it
  every step. `forget_peer(engine_id)` drops every address, connection and remote agent of an
  engine (after its engine TTL); a later handshake re-adds it, which is how a restarted peer
  (new incarnation, new agent metadata) comes back.
- **Waiting.** `wait(timeout)` blocks up to `timeout` seconds until something may have
  arrived (for a caller that runs its own blocking loop). A transport whose input shows on file
  descriptors also implements `Pollable` (`wait_fds()`, `ready()`), and `Driver.run` then
  sleeps on those descriptors until input or the next deadline; for any other transport (NIXL:
  notifications are only seen by polling ``get_new_notifs``, there is no descriptor) it polls at
  its ``poll_interval``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

from kvlease import KvLeaseError

__all__ = [
    "HandshakeEvent",
    "HandshakeFailed",
    "HandshakeRequest",
    "HandshakeResponse",
    "Inbound",
    "PeerDead",
    "PeerSuspect",
    "PeerUnreachable",
    "Pollable",
    "TransferFailed",
    "TransferResult",
    "Transport",
]


class PeerUnreachable(KvLeaseError):
    """`send` knows the frame cannot be delivered to `engine_id` (rank `rank`, or all).

    A hint that a peer may be gone; never a proof that it is, and never a basis for freeing
    memory or trusting a lease.
    """

    def __init__(self, engine_id: str, rank: int | None, reason: str) -> None:
        self.engine_id = engine_id
        self.rank = rank
        self.reason = reason
        where = "all workers" if rank is None else f"rank {rank}"
        super().__init__(f"cannot reach {engine_id!r} ({where}): {reason}")


@attrs.frozen
class Inbound:
    """One frame received from worker `rank` of `engine_id` (as the transport knows it)."""

    engine_id: str
    rank: int
    data: bytes


@attrs.frozen
class HandshakeRequest:
    """Pinner side: an accessor's encoded `Handshake` arrived on the side channel. Answer it
    with `Transport.answer_handshake(token, encoded_reply)`."""

    token: int
    data: bytes


@attrs.frozen
class HandshakeResponse:
    """Accessor side: the pinner engine's encoded `HandshakeReply` arrived; the transport has
    already learned that engine's worker addresses / agent metadata."""

    engine_id: str
    data: bytes


@attrs.frozen
class HandshakeFailed:
    """Accessor side: the side channel could not reach `engine_id` (the core retries)."""

    engine_id: str
    reason: str


HandshakeEvent = HandshakeRequest | HandshakeResponse | HandshakeFailed


@attrs.frozen
class TransferResult:
    """Completion of a `start_read` / `start_write` handle."""

    handle: int
    ok: bool
    error: str = ""
    nbytes: int = 0


@runtime_checkable
class Transport(Protocol):
    """What the driver needs from a transport. See the module docstring for the semantics."""

    @property
    def engine_id(self) -> str: ...

    @property
    def rank(self) -> int: ...

    @property
    def address(self) -> str:
        """Where peers send handshakes to this worker (meaningful on rank 0)."""
        ...

    def send(self, engine_id: str, rank: int | None, data: bytes) -> None: ...

    def receive(self) -> list[Inbound]: ...

    def progress(self) -> None: ...

    def request_handshake(self, engine_id: str, address: str, data: bytes) -> None: ...

    def poll_handshakes(self) -> list[HandshakeEvent]: ...

    def answer_handshake(self, token: int, data: bytes) -> None: ...

    def reject_handshake(self, token: int) -> None:
        """The driver refused this handshake request (undecodable or unauthenticated): forget
        it, free what it holds, and install nothing it carried."""
        ...

    def register(self, region: str, buffer: object) -> int:
        """Register memory under `region`; returns its size in bytes."""
        ...

    def unregister(self, region: str) -> None: ...

    def start_read(self, engine_id: str, rank: int, region: str, into: object, notif: bytes | None) -> int: ...

    def start_write(self, engine_id: str, rank: int, region: str, src: object, notif: bytes | None) -> int: ...

    def poll_transfers(self) -> list[TransferResult]: ...

    def cancel_transfer(self, handle: int) -> None:
        """Give up on a transfer that overran the driver's transfer timeout: it will not be
        reported by `poll_transfers`, and a late completion is dropped."""
        ...

    def forget_peer(self, engine_id: str) -> None: ...

    def wait(self, timeout: float) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class Pollable(Protocol):
    """A transport whose input shows on file descriptors, so an event loop can sleep on them."""

    def wait_fds(self) -> Sequence[int]:
        """Descriptors that become readable when input may have arrived (edge-triggered ones
        are fine: the driver calls `ready` before every wait)."""
        ...

    def ready(self) -> bool:
        """Whether a step now would find input (and re-arm edge-triggered descriptors)."""
        ...


# -- events the driver adds to the core's outputs -------------------------------------------


@attrs.frozen
class PeerSuspect:
    """A send to `engine_id` failed (a hint, reported once per failure streak)."""

    engine_id: str
    rank: int | None
    reason: str


@attrs.frozen
class PeerDead:
    """`engine_id` was silent past the engine TTL after failing: the driver disconnected it
    (its leases were reported lost) and asked the transport to forget it."""

    engine_id: str


@attrs.frozen
class TransferFailed:
    """A READ/WRITE for `key` failed at the transport; the lease stays tracked (retry or
    untrack)."""

    key: str
    reason: str
