"""`ZmqTransport`: the kvlease `Transport` over pyzmq (extra ``zmq``), with KV data copied
through the socket, so the whole protocol runs where NIXL is not installed.

Owns: one ROUTER socket per worker, bound to a concrete address (``tcp://IP:port`` or
``ipc://path``; never a wildcard host, since its endpoint is what peers are told), and one
DEALER per remote worker it initiates traffic to. It never reads a clock, never blocks (every
socket call is ``NOBLOCK``; `wait` is the only blocking call and is for blocking drivers), runs
no thread, and holds no protocol logic.

Wire (multipart frames; the first frame is a one-byte kind):

- ``M`` + payload: one control message (kvlease frame or vLLM notification), either way.
- ``H`` + handshake: accessor → pinner side channel (the ROUTER of the pinner's rank 0);
  answered ``h`` + reply + JSON metadata ``{"engine_id", "workers": [address per rank]}``, from
  which the accessor learns where every worker of that engine listens. The side channel shares
  the ROUTER: ZMQ connects in the background, so no thread is needed for a proactive handshake.
- ``R`` + handle + region: READ request, served by the pinner in `receive`/`progress` with
  ``r`` + handle + status + bytes (a snapshot of the region at serve time). The accessor copies
  the bytes into its buffer and only then reports completion (and sends `notif`, if any).
- ``W`` + handle + region + bytes + notif: WRITE; the pinner copies the bytes into the region,
  answers ``w`` + handle + status, and only then delivers `notif` to its own `receive`.

Identities: a DEALER's ZMQ routing id is ``engine_id \\0 rank`` (UTF-8), so the ROUTER knows
who sent every frame and can route replies; ``ROUTER_HANDOVER`` lets a restarted peer reuse
its identity, ``ROUTER_MANDATORY`` turns a send to a vanished peer into a `PeerUnreachable`
hint. ZMTP heartbeats (``HEARTBEAT_IVL``/``TIMEOUT``) drop dead TCP connections so that DEALERs
reconnect after a partition heals.

Registration outlives leases (as RDMA memory does): a region's memory stays readable after a
lease on it ends, and an engine that reuses it for another request will serve the new bytes to
a late READ. Catching that is the lease protocol's job, which is the point of the tests.
A write that arrives after the accessor's driver timed it out is still applied (a ZMQ message
cannot be recalled, like a NIXL WRITE in flight): push safety rests on the core's
`max_access_time` bound, so keep the transfer timeout within it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence

import zmq

from ._base import (
    HandshakeEvent,
    HandshakeFailed,
    HandshakeRequest,
    HandshakeResponse,
    Inbound,
    PeerUnreachable,
    TransferResult,
)

__all__ = ["ZmqTransport", "as_bytes_view"]

_K_MSG = b"M"
_K_HS = b"H"
_K_HS_REPLY = b"h"
_K_READ = b"R"
_K_READ_REPLY = b"r"
_K_WRITE = b"W"
_K_WRITE_REPLY = b"w"
_OK = b"\x01"
_ERR = b"\x00"
_MAX_DRAIN = 4096  # frames per socket per call, so one flooding peer cannot starve a step
_MAX_HANDSHAKE_TOKENS = 1024


def as_bytes_view(buf: object) -> memoryview:
    """A flat, writable byte view of a bytearray / numpy array / contiguous CPU torch tensor."""
    if hasattr(buf, "is_cuda") and hasattr(buf, "numpy"):
        if buf.is_cuda:
            raise ValueError("the ZMQ transport copies through host memory: pass CPU tensors")
        if not buf.is_contiguous():  # type: ignore[attr-defined]
            raise ValueError("tensor must be contiguous")
        buf = buf.detach().view(-1).numpy()  # type: ignore[attr-defined]
        # A bfloat16 tensor has no numpy dtype; callers view such tensors as uint8 first.
    mv = memoryview(buf)  # type: ignore[arg-type]
    if mv.readonly:
        raise ValueError("buffer must be writable")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def _identity(engine_id: str, rank: int) -> bytes:
    return engine_id.encode() + b"\0" + str(rank).encode()


def _parse_identity(ident: bytes) -> tuple[str, int] | None:
    name, sep, rank = ident.rpartition(b"\0")
    if not sep or not rank.isdigit() or len(rank) > 6:
        return None
    try:
        return name.decode(), int(rank)
    except UnicodeDecodeError:
        return None


class _Dealer:
    __slots__ = ("address", "engine_id", "rank", "sock")

    def __init__(self, sock: zmq.Socket[bytes], address: str, engine_id: str, rank: int) -> None:
        self.sock = sock
        self.address = address
        self.engine_id = engine_id
        self.rank = rank


class ZmqTransport:
    """A `Transport` for one worker (`rank`) of `engine_id`. See the module docstring."""

    def __init__(
        self,
        engine_id: str,
        rank: int = 0,
        *,
        bind: str = "tcp://127.0.0.1:0",
        worker_addresses: Sequence[str] | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        heartbeat_ivl_ms: int = 1000,
        sndhwm: int = 10000,
    ) -> None:
        self._engine_id = engine_id
        self._rank = rank
        # Our own context unless one is shared in: closing then terminates it, which returns only
        # once ZMQ's I/O thread has really closed the sockets, so a restarted engine can bind the
        # same address at once (with the shared global context the unbind happens later).
        self._own_ctx = context is None
        self._ctx = context if context is not None else zmq.Context()
        self._heartbeat_ivl_ms = heartbeat_ivl_ms
        self._sndhwm = sndhwm
        self._ident = _identity(engine_id, rank)
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        router.setsockopt(zmq.SNDHWM, sndhwm)
        router.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ivl_ms)
        router.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * heartbeat_ivl_ms)
        if bind.startswith("tcp://") and bind.endswith(":0"):
            bind = bind[:-2] + ":*"
        router.bind(bind)
        self._router = router
        endpoint = router.getsockopt(zmq.LAST_ENDPOINT)
        self._address = endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)
        #: Every worker of this engine, by rank, for handshake replies (default: just us).
        self.worker_addresses: list[str] = list(worker_addresses) if worker_addresses else [self._address]
        self._dealers: dict[tuple[str, int], _Dealer] = {}
        self._hs_dealers: dict[str, _Dealer] = {}  # by side-channel address, until answered
        self._workers: dict[str, list[str]] = {}  # remote engine -> addresses by rank
        self._routes: dict[str, dict[int, bytes]] = {}  # remote engine -> rank -> identity
        self._regions: dict[str, memoryview] = {}
        self._inbound: list[Inbound] = []
        self._handshakes: list[HandshakeEvent] = []
        self._hs_tokens: dict[int, bytes] = {}
        self._next_token = 1
        self._transfers: dict[int, tuple[str, int, memoryview | None, bytes | None]] = {}
        self._done: list[TransferResult] = []
        self._next_handle = 1
        self._poller = zmq.Poller()
        self._poller.register(router, zmq.POLLIN)
        self._closed = False

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

    # -- sockets ----------------------------------------------------------------------------

    def _new_dealer(self, address: str, engine_id: str, rank: int) -> _Dealer:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, self._ident)
        sock.setsockopt(zmq.SNDHWM, self._sndhwm)
        sock.setsockopt(zmq.HEARTBEAT_IVL, self._heartbeat_ivl_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * self._heartbeat_ivl_ms)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sock.connect(address)
        self._poller.register(sock, zmq.POLLIN)
        return _Dealer(sock, address, engine_id, rank)

    def _close_dealer(self, d: _Dealer) -> None:
        self._poller.unregister(d.sock)
        d.sock.close(linger=0)

    def _dealer(self, engine_id: str, rank: int) -> _Dealer | None:
        d = self._dealers.get((engine_id, rank))
        if d is not None:
            return d
        workers = self._workers.get(engine_id)
        if workers is None or not 0 <= rank < len(workers):
            return None
        d = self._dealers[(engine_id, rank)] = self._new_dealer(workers[rank], engine_id, rank)
        return d

    def _send_frames(self, engine_id: str, rank: int, frames: list[bytes | memoryview]) -> None:
        """To worker `rank` of `engine_id`: over our DEALER if we connected to it, else over
        our ROUTER if it connected to us."""
        d = self._dealer(engine_id, rank)
        try:
            if d is not None:
                d.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=True)
                return
            ident = self._routes.get(engine_id, {}).get(rank)
            if ident is None:
                raise PeerUnreachable(engine_id, rank, "no address or connection known")
            self._router.send_multipart([ident, *frames], flags=zmq.NOBLOCK, copy=True)
        except zmq.Again:
            raise PeerUnreachable(engine_id, rank, "send queue full") from None
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH and engine_id in self._routes:
                self._routes[engine_id].pop(rank, None)
            raise PeerUnreachable(engine_id, rank, f"zmq: {exc}") from None

    # -- control plane ----------------------------------------------------------------------

    def send(self, engine_id: str, rank: int | None, data: bytes) -> None:
        if rank is not None:
            self._send_frames(engine_id, rank, [_K_MSG, data])
            return
        workers = self._workers.get(engine_id)
        ranks = range(len(workers)) if workers is not None else sorted(self._routes.get(engine_id, {}))
        if not ranks:
            raise PeerUnreachable(engine_id, None, "no address or connection known")
        failed: PeerUnreachable | None = None
        for r in ranks:
            try:
                self._send_frames(engine_id, r, [_K_MSG, data])
            except PeerUnreachable as exc:
                failed = exc  # keep serving the other workers
        if failed is not None:
            raise failed

    def receive(self) -> list[Inbound]:
        self._drain()
        out, self._inbound = self._inbound, []
        return out

    def progress(self) -> None:
        self._drain()

    def _drain(self) -> None:
        if self._closed:
            return
        self._drain_router()
        for d in list(self._dealers.values()):
            self._drain_dealer(d)
        for d in list(self._hs_dealers.values()):
            self._drain_dealer(d)

    def _drain_router(self) -> None:
        # Checking EVENTS first is far cheaper than a recv that raises zmq.Again.
        if not int(self._router.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            return
        for _ in range(_MAX_DRAIN):
            try:
                frames = self._router.recv_multipart(flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue
            ident, kind = frames[0], frames[1]
            who = _parse_identity(ident)
            if who is None:
                continue  # not one of ours; nothing to answer
            engine_id, rank = who
            self._routes.setdefault(engine_id, {})[rank] = ident
            if kind == _K_MSG and len(frames) == 3:
                self._inbound.append(Inbound(engine_id, rank, frames[2]))
            elif kind == _K_HS and len(frames) == 3:
                token = self._next_token
                self._next_token += 1
                if len(self._hs_tokens) >= _MAX_HANDSHAKE_TOKENS:
                    self._hs_tokens.pop(next(iter(self._hs_tokens)))
                self._hs_tokens[token] = ident
                self._handshakes.append(HandshakeRequest(token, frames[2]))
            elif kind == _K_READ and len(frames) == 4:
                self._serve_read(ident, frames[2], frames[3])
            elif kind == _K_WRITE and len(frames) == 6:
                self._serve_write(ident, engine_id, rank, frames[2], frames[3], frames[4], frames[5])
            # anything else: malformed transport framing, dropped (the driver judges payloads)

    def _reply(self, ident: bytes, frames: list[bytes | memoryview]) -> None:
        # The requester may be gone; its driver times the transfer out.
        with contextlib.suppress(zmq.ZMQError):
            self._router.send_multipart([ident, *frames], flags=zmq.NOBLOCK, copy=True)

    def _serve_read(self, ident: bytes, handle: bytes, region: bytes) -> None:
        mv = self._regions.get(region.decode(errors="replace"))
        if mv is None:
            self._reply(ident, [_K_READ_REPLY, handle, _ERR, b"no such region"])
        else:
            self._reply(ident, [_K_READ_REPLY, handle, _OK, mv])  # copy=True: a snapshot

    def _serve_write(
        self, ident: bytes, engine_id: str, rank: int, handle: bytes, region: bytes, data: bytes, notif: bytes
    ) -> None:
        mv = self._regions.get(region.decode(errors="replace"))
        if mv is None:
            self._reply(ident, [_K_WRITE_REPLY, handle, _ERR, b"no such region"])
            return
        if len(data) != mv.nbytes:
            self._reply(ident, [_K_WRITE_REPLY, handle, _ERR, f"size {len(data)} != region {mv.nbytes}".encode()])
            return
        mv[:] = data
        self._reply(ident, [_K_WRITE_REPLY, handle, _OK, b""])
        if notif:
            self._inbound.append(Inbound(engine_id, rank, notif))  # after the data landed

    def _drain_dealer(self, d: _Dealer) -> None:
        try:
            if not int(d.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                return
        except zmq.ZMQError:
            return  # closed under us by forget_peer
        for _ in range(_MAX_DRAIN):
            try:
                frames = d.sock.recv_multipart(flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            except zmq.ZMQError:
                return  # closed under us by forget_peer
            if not frames:
                continue
            kind = frames[0]
            if kind == _K_MSG and len(frames) == 2:
                self._inbound.append(Inbound(d.engine_id, d.rank, frames[1]))
            elif kind == _K_HS_REPLY and len(frames) == 3:
                self._on_handshake_reply(d, frames[1], frames[2])
            elif kind == _K_READ_REPLY and len(frames) == 4:
                self._on_read_reply(frames[1], frames[2], frames[3])
            elif kind == _K_WRITE_REPLY and len(frames) == 4:
                self._on_write_reply(frames[1], frames[2], frames[3])

    # -- handshake side channel -------------------------------------------------------------

    def request_handshake(self, engine_id: str, address: str, data: bytes) -> None:
        d = self._dealers.get((engine_id, 0))
        if d is None or d.address != address:
            d = self._hs_dealers.get(address)
            if d is None:
                d = self._hs_dealers[address] = self._new_dealer(address, engine_id, 0)
        try:
            d.sock.send_multipart([_K_HS, data], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise PeerUnreachable(engine_id, 0, f"zmq: {exc}") from None

    def _on_handshake_reply(self, d: _Dealer, reply: bytes, meta: bytes) -> None:
        try:
            info = json.loads(meta)
            engine_id = info["engine_id"]
            workers = info["workers"]
            ok = bool(
                isinstance(engine_id, str)
                and isinstance(workers, list)
                and 0 < len(workers) <= 1 << 16
                and all(isinstance(w, str) for w in workers)
            )
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            self._handshakes.append(HandshakeFailed(d.engine_id, "malformed handshake metadata"))
            return
        workers = list(workers)
        workers[0] = d.address  # the address we reached it at beats what it believes
        if self._workers.get(engine_id) != workers:
            for key in [k for k in self._dealers if k[0] == engine_id]:
                self._close_dealer(self._dealers.pop(key))
            self._workers[engine_id] = workers
        if d.address in self._hs_dealers and self._hs_dealers[d.address] is d:
            # Promote the side-channel socket to the rank-0 data socket.
            del self._hs_dealers[d.address]
            if (engine_id, 0) not in self._dealers:
                d.engine_id = engine_id
                self._dealers[(engine_id, 0)] = d
            else:
                self._close_dealer(d)
        self._handshakes.append(HandshakeResponse(engine_id, reply))

    def poll_handshakes(self) -> list[HandshakeEvent]:
        # Filled by the drain in `receive`/`progress` (the driver calls receive first).
        out, self._handshakes = self._handshakes, []
        return out

    def answer_handshake(self, token: int, data: bytes) -> None:
        ident = self._hs_tokens.pop(token, None)
        if ident is None:
            return
        meta = json.dumps({"engine_id": self._engine_id, "workers": self.worker_addresses}).encode()
        try:
            self._router.send_multipart([ident, _K_HS_REPLY, data, meta], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            who = _parse_identity(ident) or ("?", 0)
            raise PeerUnreachable(who[0], who[1], f"zmq: {exc}") from None

    def reject_handshake(self, token: int) -> None:
        self._hs_tokens.pop(token, None)

    # -- data plane -------------------------------------------------------------------------

    def register(self, region: str, buffer: object) -> int:
        mv = as_bytes_view(buffer)
        self._regions[region] = mv
        return mv.nbytes

    def unregister(self, region: str) -> None:
        self._regions.pop(region, None)

    def _start(
        self, engine_id: str, rank: int, frames: list[bytes | memoryview], into: memoryview | None, notif: bytes | None
    ) -> int:
        h = self._next_handle
        self._next_handle += 1
        hb = h.to_bytes(8, "little")
        self._send_frames(engine_id, rank, [frames[0], hb, *frames[1:]])
        self._transfers[h] = (engine_id, rank, into, notif)
        return h

    def start_read(self, engine_id: str, rank: int, region: str, into: object, notif: bytes | None) -> int:
        return self._start(engine_id, rank, [_K_READ, region.encode()], as_bytes_view(into), notif)

    def start_write(self, engine_id: str, rank: int, region: str, src: object, notif: bytes | None) -> int:
        data = as_bytes_view(src)
        return self._start(engine_id, rank, [_K_WRITE, region.encode(), data, notif or b""], None, None)

    def _on_read_reply(self, handle: bytes, status: bytes, payload: bytes) -> None:
        h = int.from_bytes(handle, "little")
        rec = self._transfers.pop(h, None)
        if rec is None:
            return  # cancelled: the late bytes are dropped, never copied
        engine_id, rank, into, notif = rec
        assert into is not None
        if status != _OK:
            self._done.append(TransferResult(h, False, payload.decode(errors="replace")))
            return
        if len(payload) != into.nbytes:
            self._done.append(TransferResult(h, False, f"region has {len(payload)} bytes, buffer {into.nbytes}"))
            return
        into[:] = payload
        if notif:
            # A lost notification is covered by the pinner's expiry.
            with contextlib.suppress(PeerUnreachable):
                self._send_frames(engine_id, rank, [_K_MSG, notif])
        self._done.append(TransferResult(h, True, nbytes=len(payload)))

    def _on_write_reply(self, handle: bytes, status: bytes, payload: bytes) -> None:
        h = int.from_bytes(handle, "little")
        if self._transfers.pop(h, None) is None:
            return
        if status != _OK:
            self._done.append(TransferResult(h, False, payload.decode(errors="replace")))
        else:
            self._done.append(TransferResult(h, True))

    def poll_transfers(self) -> list[TransferResult]:
        out, self._done = self._done, []
        return out

    def cancel_transfer(self, handle: int) -> None:
        self._transfers.pop(handle, None)

    # -- peers and lifetime -----------------------------------------------------------------

    def forget_peer(self, engine_id: str) -> None:
        for key in [k for k in self._dealers if k[0] == engine_id]:
            self._close_dealer(self._dealers.pop(key))
        for addr in [a for a, d in self._hs_dealers.items() if d.engine_id == engine_id]:
            self._close_dealer(self._hs_dealers.pop(addr))
        self._workers.pop(engine_id, None)
        self._routes.pop(engine_id, None)
        for h in [h for h, rec in self._transfers.items() if rec[0] == engine_id]:
            del self._transfers[h]
            self._done.append(TransferResult(h, False, f"peer {engine_id!r} forgotten"))

    def wait(self, timeout: float) -> None:
        if self._inbound or self._done or self._handshakes:
            return
        self._poller.poll(max(0, int(timeout * 1000)))

    # -- `Pollable`: how an event loop waits for this transport's input ---------------------

    def wait_fds(self) -> list[int]:
        """The ZMQ_FD of every socket: edge-triggered, so `ready()` first, then wait on them."""
        if self._closed:
            return []
        socks = [self._router, *(d.sock for d in self._dealers.values()), *(d.sock for d in self._hs_dealers.values())]
        return [int(sk.getsockopt(zmq.FD)) for sk in socks]

    def ready(self) -> bool:
        """A step now would find input. A level check (a zero-timeout poll), which also re-arms
        the edge-triggered descriptors of `wait_fds`."""
        if self._inbound or self._done or self._handshakes:
            return True
        if self._closed:
            return False
        return bool(self._poller.poll(0))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for d in [*self._dealers.values(), *self._hs_dealers.values()]:
            d.sock.close(linger=0)
        self._dealers.clear()
        self._hs_dealers.clear()
        self._router.close(linger=0)
        if self._own_ctx:
            self._ctx.destroy(linger=0)  # closes any socket still open, then terminates
