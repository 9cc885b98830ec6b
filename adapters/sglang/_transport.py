"""`SglangZmqTransport`: kvlease's control plane over the ZMQ sockets SGLang's KV managers bind.

Every SGLang 0.5.23 KV manager (prefill and decode) binds one ZMQ PULL socket (``rank_port``) and
runs a thread that reads it: the prefill's bootstrap thread, the decode's listener thread. Both
peers already know each other's socket: the prefill learns the decode's ``(ip, rank_port)`` from
the decode's metadata message, the decode learns the prefill rank's from the bootstrap server.
kvlease frames ride on those sockets as one more tagged message (``KVLEASE``), pushed from a
PUSH socket this transport owns (never blocking: a peer whose queue is full, ``SNDHWM``, fails the
send as `PeerUnreachable`; what a dead peer never reads is lost, which the protocol tolerates),
and handed over by SGLang's own reader thread through
:meth:`deliver`, which never raises and bounds what it keeps.

Why ZMQ and not NIXL notifications: SGLang's NIXL path never reads notifications (it reports
completion over this same ZMQ socket), the prefill only learns the decode's NIXL agent once the
decode registers, and the source-page lease must run before any NIXL metadata exists (while the
decode waits for memory). The ZMQ sockets exist from manager start, in both directions.

The data plane is SGLang's: the prefill's transfer worker posts the NIXL WRITEs. `start_write`
therefore starts nothing; it records the access (its handle and the access-done to send after the
data landed) and the engine reports the outcome with :meth:`complete`; a successful completion
sends the access-done on the same ordered stream the prefill's ``KV_STATUS`` uses. `start_read` and
`register` are not used by this adapter and raise.

Wire (multipart): ``[b"KVLEASE", kind, engine_id, rank, address, payload]`` with kind ``F`` (a
kvlease frame), ``H`` (handshake request), ``R`` (handshake reply), ``T`` (a lease ticket offered
for a room) or ``Q`` (a ticket asked for). The claimed sender is only a routing hint: the driver
judges frames (binding, sessions, and the deployment key when one is configured).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from kvlease.transports import (
    HandshakeEvent,
    HandshakeFailed,
    HandshakeRequest,
    HandshakeResponse,
    Inbound,
    PeerUnreachable,
    TransferResult,
)

__all__ = ["TAG", "SglangZmqTransport"]

TAG = b"KVLEASE"

#: Bounds on what a hostile or runaway peer can make this transport hold.
MAX_INBOX = 65536
MAX_PAYLOAD = 1 << 20
MAX_NAME = 256
MAX_PENDING_HANDSHAKES = 1024
MAX_PEERS = 65536

_KINDS = frozenset({b"F", b"H", b"R", b"T", b"Q"})


def _text(b: bytes) -> str | None:
    if len(b) > MAX_NAME:
        return None
    try:
        s = b.decode("ascii")
    except UnicodeDecodeError:
        return None
    return s if s and s.isprintable() else None


class SglangZmqTransport:
    """One SGLang KV manager's (one rank's) kvlease transport. Not thread-safe except
    :meth:`deliver` and :meth:`wake`: every other method runs under the owner's lock."""

    def __init__(
        self,
        engine_id: str,
        address: str,
        *,
        context: zmq.Context[Any] | None = None,
        on_ticket: Callable[[str, int, str, bytes], None] | None = None,
        on_ticket_request: Callable[[str, int, str, bytes], None] | None = None,
        rank: int = 0,
    ) -> None:
        self._engine_id = engine_id
        self._rank = rank
        self._address = address
        self._ctx = context if context is not None else zmq.Context.instance()
        self._socks: dict[str, zmq.Socket[bytes]] = {}
        self._book: dict[str, str] = {}  # engine id -> address (one rank per engine here)
        self._inbox: collections.deque[list[bytes]] = collections.deque()
        self._inbox_lock = threading.Lock()
        self._wake = threading.Event()
        self._handshakes: list[HandshakeEvent] = []
        self._hs_tokens: dict[int, tuple[str, str]] = {}  # token -> (engine id, address)
        self._hs_wanted: dict[str, str] = {}  # engine id -> address we asked
        self._tokens = itertools.count(1)
        self._handles = itertools.count(1)
        self._writes: dict[int, tuple[str, bytes | None]] = {}  # handle -> (engine id, notif)
        self._results: list[TransferResult] = []
        self._on_ticket = on_ticket
        self._on_ticket_request = on_ticket_request
        #: Messages dropped on arrival (malformed, oversized, inbox full).
        self.dropped = 0
        #: The handle of the latest `start_write` (the runtime pairs it with its lease key).
        self.last_started: int | None = None
        #: Known peer engine -> ``time.monotonic()`` when a lease frame from it last arrived (as
        #: its frame claims: before the driver checks a deployment key's tag).
        self.heard: dict[str, float] = {}

    # -- identity ---------------------------------------------------------------------------

    @property
    def engine_id(self) -> str:
        return self._engine_id

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def address(self) -> str:
        return self._address

    def learn(self, engine_id: str, address: str) -> None:
        """Where `engine_id` (one SGLang rank) listens: ``ip:port`` of its manager socket, as
        SGLang's own metadata says."""
        if engine_id in self._book or len(self._book) < MAX_PEERS:
            self._book[engine_id] = address

    # -- inbound (SGLang's reader thread) ------------------------------------------------------

    @staticmethod
    def is_ours(msg: Sequence[bytes]) -> bool:
        return len(msg) > 0 and msg[0] == TAG

    def deliver(self, msg: list[bytes]) -> None:
        """Called by SGLang's socket thread for a ``KVLEASE`` message. Never raises."""
        try:
            if len(msg) != 6 or msg[1] not in _KINDS or len(msg[5]) > MAX_PAYLOAD:
                self.dropped += 1
                return
            with self._inbox_lock:
                if len(self._inbox) >= MAX_INBOX:
                    self.dropped += 1
                    return
                self._inbox.append([bytes(m) for m in msg])
            self._wake.set()
        except Exception:
            self.dropped += 1

    def wake(self) -> None:
        self._wake.set()

    def wait(self, timeout: float) -> None:
        self._wake.wait(max(0.0, timeout))
        self._wake.clear()

    def _drain(self) -> list[Inbound]:
        with self._inbox_lock:
            msgs = list(self._inbox)
            self._inbox.clear()
        out: list[Inbound] = []
        for _tag, kind, eid_b, rank_b, addr_b, payload in msgs:
            eid, addr, rank_s = _text(eid_b), _text(addr_b), _text(rank_b)
            if eid is None or addr is None or rank_s is None or not rank_s.isdigit():
                self.dropped += 1
                continue
            rank = int(rank_s)
            if kind == b"F":
                if eid in self._book:
                    self.heard[eid] = time.monotonic()
                out.append(Inbound(eid, rank, payload))
            elif kind == b"H":
                if len(self._hs_tokens) >= MAX_PENDING_HANDSHAKES:
                    self.dropped += 1
                    continue
                token = next(self._tokens)
                self._hs_tokens[token] = (eid, addr)
                self._handshakes.append(HandshakeRequest(token, payload))
            elif kind == b"R":
                if self._hs_wanted.get(eid) != addr:  # a reply nobody asked this address for
                    self.dropped += 1
                    continue
                del self._hs_wanted[eid]
                self.learn(eid, addr)
                self._handshakes.append(HandshakeResponse(eid, payload))
            elif kind == b"T" and self._on_ticket is not None:
                self._on_ticket(eid, rank, addr, payload)
            elif kind == b"Q" and self._on_ticket_request is not None:
                self._on_ticket_request(eid, rank, addr, payload)
        return out

    # -- the Transport contract ---------------------------------------------------------------

    def _sock(self, address: str) -> zmq.Socket[bytes]:
        s = self._socks.get(address)
        if s is None:
            s = self._ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 4096)
            s.connect(f"tcp://{address}")
            self._socks[address] = s
        return s

    def push(self, address: str, kind: bytes, payload: bytes, *, peer: str = "") -> None:
        """Send one ``KVLEASE`` message to the manager socket at `address`."""
        frames = [TAG, kind, self._engine_id.encode(), str(self._rank).encode(), self._address.encode(), payload]
        try:
            self._sock(address).send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again as exc:
            raise PeerUnreachable(peer or address, None, "not connected (send would block)") from exc
        except zmq.ZMQError as exc:
            raise PeerUnreachable(peer or address, None, str(exc)) from exc

    def send(self, engine_id: str, rank: int | None, data: bytes) -> None:
        address = self._book.get(engine_id)
        if address is None:
            raise PeerUnreachable(engine_id, rank, "no address known")
        self.push(address, b"F", data, peer=engine_id)

    def receive(self) -> list[Inbound]:
        return self._drain()

    def progress(self) -> None:
        return None

    def request_handshake(self, engine_id: str, address: str, data: bytes) -> None:
        self._hs_wanted[engine_id] = address
        try:
            self.push(address, b"H", data, peer=engine_id)
        except PeerUnreachable as exc:
            self._hs_wanted.pop(engine_id, None)
            self._handshakes.append(HandshakeFailed(engine_id, exc.reason))

    def poll_handshakes(self) -> list[HandshakeEvent]:
        out, self._handshakes = self._handshakes, []
        return out

    def answer_handshake(self, token: int, data: bytes) -> None:
        who = self._hs_tokens.pop(token, None)
        if who is None:
            return
        engine_id, address = who
        self.learn(engine_id, address)  # the driver accepted it: acks may go there now
        with contextlib.suppress(PeerUnreachable):  # the accessor retries its handshake
            self.push(address, b"R", data, peer=engine_id)

    def reject_handshake(self, token: int) -> None:
        self._hs_tokens.pop(token, None)

    def register(self, region: str, buffer: object) -> int:
        raise NotImplementedError("SGLang registers its KV pool with NIXL itself")

    def unregister(self, region: str) -> None:
        return None

    def start_read(self, engine_id: str, rank: int, region: str, into: object, notif: bytes | None) -> int:
        raise NotImplementedError("SGLang's NIXL backend pushes: the prefill WRITEs")

    def start_write(self, engine_id: str, rank: int, region: str, src: object, notif: bytes | None) -> int:
        """Record an access SGLang's transfer worker is about to post; see :meth:`complete`."""
        handle = next(self._handles)
        self._writes[handle] = (engine_id, notif)
        self.last_started = handle
        return handle

    def complete(self, handle: int, ok: bool, error: str = "") -> None:
        """The engine's WRITEs for `handle` all settled: on success the access-done goes out
        now, after the data landed, on the stream the decode reads its ``KV_STATUS`` from."""
        entry = self._writes.pop(handle, None)
        if entry is None:
            return  # cancelled by the driver's transfer timeout
        engine_id, notif = entry
        if ok and notif is not None:
            with contextlib.suppress(PeerUnreachable):  # else the lease ends at its expiry (never unsafe)
                self.send(engine_id, None, notif)
        self._results.append(TransferResult(handle, ok, error))

    def poll_transfers(self) -> list[TransferResult]:
        out, self._results = self._results, []
        return out

    def cancel_transfer(self, handle: int) -> None:
        self._writes.pop(handle, None)

    def forget_peer(self, engine_id: str) -> None:
        address = self._book.pop(engine_id, None)
        self._hs_wanted.pop(engine_id, None)
        self.heard.pop(engine_id, None)
        if address is not None and address not in self._book.values():
            s = self._socks.pop(address, None)
            if s is not None:
                s.close(0)

    def close(self) -> None:
        for s in self._socks.values():
            s.close(0)
        self._socks.clear()
