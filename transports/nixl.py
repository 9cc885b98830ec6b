"""The NIXL transport: lease messages as NIXL notifications, KV blocks as registered memory.

What this module owns, for one worker (rank) of one engine:

- one ``nixl_agent`` (UCX backend, **no** progress thread: on a small machine two spinning
  progress threads starve each other, so progress is driven by `NixlTransport.poll`, which the
  driver calls every step);
- the memory regions this worker registered (torch tensors: DRAM on CPU, VRAM when the tensor
  lives on a CUDA device) and their block layout;
- the remote agents of peer workers, keyed by ``(engine_id, rank)``, their block layouts and
  prepared descriptor lists; a reconnecting peer (restart: new incarnation, new agent name,
  new metadata) replaces the old agent with ``remove_remote_agent`` + ``add_remote_agent``, both
  run only from the driver's thread, so re-adds are serialized;
- the side channel for the handshake (see below) and the liveness of peer engines: sends that
  fail are reported as `PeerUnreachable` and, once an engine has failed for `engine_ttl`
  seconds without a word from it, its agents are removed and `EngineLost` is reported.
  Send errors are hints, never the basis of safety: the lease core's timers are.

Side channel: a plain TCP socket bound to 127.0.0.1 (or the namespace address), carrying one
length-prefixed msgpack request and one reply per connection. Chosen over ZMQ REQ/REP because
it needs nothing beyond the standard library for the ``nixl`` extra, binds exactly the address
given (NIXL's own metadata listener binds every interface), and a peer that dies mid-exchange
just closes a connection instead of wedging a REQ socket's lockstep state machine. The server
side is non-blocking and served from `poll`; the client side (the proactive handshake with a
not-yet-connected pinner) is the only thing that runs in a background thread, and it never
touches NIXL: its result is applied in the next `poll`.

Must never: hold lease state or make lease decisions (that is the core's job; the transport
moves bytes and reports what happened), block the driver's step, or call NIXL from more than
one thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import selectors
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final, Literal

import attrs
import msgpack

from kvlease import DecodeError, Handshake, HandshakeReply, decode, encode

__all__ = [
    "EngineLost",
    "HandshakeCompleted",
    "HandshakeFailed",
    "NixlEvent",
    "NixlTransport",
    "NotificationReceived",
    "PeerUnreachable",
    "Region",
    "RemoteRegion",
    "TransferDone",
    "TransferFailed",
    "loopback_ucx_env",
]

log = logging.getLogger("kvlease.transports.nixl")

#: Side-channel frames are bounded: agent metadata is a few hundred bytes, layouts a few KiB.
MAX_SIDE_FRAME: Final = 1 << 20
SIDE_VERSION: Final = 1
_LEN = struct.Struct("!I")

Op = Literal["READ", "WRITE"]


def loopback_ucx_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """Keep UCX on the loopback device unless the caller chose otherwise. Must run before the
    first agent is created (UCX reads its environment once)."""
    target = os.environ if env is None else env
    target.setdefault("UCX_NET_DEVICES", "lo")
    return dict(target)


# -- memory ---------------------------------------------------------------------------------


@attrs.frozen
class RemoteRegion:
    """A peer's registered region as announced in its handshake reply."""

    name: str
    addr: int
    nbytes: int
    block_bytes: int
    mem_type: str  # "DRAM" or "VRAM"
    dev_id: int

    @property
    def blocks(self) -> int:
        return self.nbytes // self.block_bytes

    def descs(self) -> list[tuple[int, int, int]]:
        return [(self.addr + i * self.block_bytes, self.block_bytes, self.dev_id) for i in range(self.blocks)]

    def to_wire(self) -> list[Any]:
        return [self.name, self.addr, self.nbytes, self.block_bytes, self.mem_type, self.dev_id]

    @classmethod
    def from_wire(cls, v: object) -> RemoteRegion:
        if not isinstance(v, list) or len(v) != 6:
            raise ValueError(f"region must be a 6-item list, got {v!r}")
        name, addr, nbytes, block_bytes, mem_type, dev_id = v
        ints = (addr, nbytes, block_bytes, dev_id)
        if not isinstance(name, str) or not all(isinstance(i, int) and i >= 0 for i in ints):
            raise ValueError(f"malformed region {v!r}")
        if mem_type not in ("DRAM", "VRAM") or block_bytes <= 0 or nbytes % block_bytes:
            raise ValueError(f"malformed region {v!r}")
        return cls(name, addr, nbytes, block_bytes, mem_type, dev_id)


@attrs.define
class Region:
    """A local tensor registered with NIXL, cut into equal blocks (the KV block layout)."""

    name: str
    tensor: Any  # torch.Tensor; kept referenced so the registered memory stays alive
    block_bytes: int
    reg: Any = attrs.field(repr=False)
    prepped: Any = attrs.field(repr=False, default=None)

    @property
    def wire(self) -> RemoteRegion:
        t = self.tensor
        is_cuda = bool(t.is_cuda)
        return RemoteRegion(
            self.name,
            int(t.data_ptr()),
            int(t.numel() * t.element_size()),
            self.block_bytes,
            "VRAM" if is_cuda else "DRAM",
            int(t.device.index or 0) if is_cuda else 0,
        )


# -- events ---------------------------------------------------------------------------------


@attrs.frozen
class NotificationReceived:
    """A notification from a known peer worker (raw bytes: the driver decodes them)."""

    engine_id: str
    rank: int
    payload: bytes


@attrs.frozen
class HandshakeCompleted:
    """Accessor side: one pinner worker answered; feed `reply` to `Accessor.handshake_reply`."""

    engine_id: str
    rank: int
    reply: HandshakeReply


@attrs.frozen
class HandshakeFailed:
    engine_id: str
    rank: int
    reason: str


@attrs.frozen
class PeerUnreachable:
    """A send to a peer worker failed (a hint that it died; safety never depends on it)."""

    engine_id: str
    rank: int
    reason: str


@attrs.frozen
class EngineLost:
    """Every worker of `engine_id` failed for the engine TTL; its agents were removed. An
    accessor driver passes this to `Accessor.disconnect`."""

    engine_id: str


@attrs.frozen
class TransferDone:
    xfer_id: int
    engine_id: str
    rank: int


@attrs.frozen
class TransferFailed:
    xfer_id: int
    engine_id: str
    rank: int
    reason: str


NixlEvent = (
    NotificationReceived
    | HandshakeCompleted
    | HandshakeFailed
    | PeerUnreachable
    | EngineLost
    | TransferDone
    | TransferFailed
)


# -- side channel ---------------------------------------------------------------------------


def _frame(obj: object) -> bytes:
    body: bytes = msgpack.packb(obj, use_bin_type=True)
    return _LEN.pack(len(body)) + body


def _unpack(body: bytes) -> dict[str, Any]:
    obj = msgpack.unpackb(body, raw=False, strict_map_key=True)
    if not isinstance(obj, dict):
        raise ValueError("side-channel frame is not a map")
    return obj


def side_request(addr: tuple[str, int], request: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One blocking request/reply on the side channel (run in a background thread)."""
    with socket.create_connection(addr, timeout=timeout) as s:
        s.settimeout(timeout)
        s.sendall(_frame(request))
        header = _recv_exact(s, _LEN.size)
        (n,) = _LEN.unpack(header)
        if n > MAX_SIDE_FRAME:
            raise ValueError(f"side-channel reply of {n} bytes exceeds {MAX_SIDE_FRAME}")
        return _unpack(_recv_exact(s, n))


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("side channel closed mid-frame")
        buf += chunk
    return bytes(buf)


class _SideConn:
    __slots__ = ("inbuf", "outbuf", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.inbuf = bytearray()
        self.outbuf = b""


class SideChannelServer:
    """Non-blocking TCP server: one request and one reply per connection, served in `poll`."""

    def __init__(self, host: str, port: int, handler: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        self._handler = handler
        self._sel = selectors.DefaultSelector()
        self._lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._lsock.bind((host, port))
        self._lsock.listen(64)
        self._lsock.setblocking(False)
        self._sel.register(self._lsock, selectors.EVENT_READ, None)
        self.address: tuple[str, int] = self._lsock.getsockname()[:2]
        self.malformed = 0

    def poll(self) -> None:
        for key, _ in self._sel.select(timeout=0):
            conn: _SideConn | None = key.data
            if conn is None:
                self._accept()
            else:
                self._service(conn)

    def _accept(self) -> None:
        for _ in range(16):
            try:
                s, _ = self._lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            s.setblocking(False)
            self._sel.register(s, selectors.EVENT_READ, _SideConn(s))

    def _service(self, conn: _SideConn) -> None:
        try:
            if conn.outbuf:
                sent = conn.sock.send(conn.outbuf)
                conn.outbuf = conn.outbuf[sent:]
                if not conn.outbuf:
                    self._close(conn)
                return
            chunk = conn.sock.recv(65536)
            if not chunk:
                self._close(conn)
                return
            conn.inbuf += chunk
            if len(conn.inbuf) < _LEN.size:
                return
            (n,) = _LEN.unpack_from(conn.inbuf)
            if n > MAX_SIDE_FRAME:
                raise ValueError(f"side-channel request of {n} bytes exceeds {MAX_SIDE_FRAME}")
            if len(conn.inbuf) < _LEN.size + n:
                return
            request = _unpack(bytes(conn.inbuf[_LEN.size : _LEN.size + n]))
            try:
                reply = self._handler(request)
            except (ValueError, KeyError, TypeError, DecodeError) as exc:
                self.malformed += 1
                reply = {"v": SIDE_VERSION, "error": f"{type(exc).__name__}: {exc}"}
            conn.outbuf = _frame(reply)
            self._sel.modify(conn.sock, selectors.EVENT_WRITE, conn)
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, ValueError, msgpack.UnpackException) as exc:
            # Hostile or broken input costs one connection, never the engine loop.
            self.malformed += 1
            log.debug("side channel: dropping connection: %s", exc)
            self._close(conn)

    def _close(self, conn: _SideConn) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn.sock)
        conn.sock.close()

    def close(self) -> None:
        for key in list(self._sel.get_map().values()):
            with contextlib.suppress(OSError):
                key.fileobj.close()  # type: ignore[union-attr]
        self._sel.close()


# -- the transport --------------------------------------------------------------------------


class _Peer:
    __slots__ = ("agent", "engine_id", "rank", "regions", "remote_prepped")

    def __init__(self, engine_id: str, rank: int, agent: str, regions: dict[str, RemoteRegion]) -> None:
        self.engine_id = engine_id
        self.rank = rank
        self.agent = agent
        self.regions = regions
        self.remote_prepped: dict[str, Any] = {}


class _EngineHealth:
    __slots__ = ("failing_since", "reported")

    def __init__(self) -> None:
        self.failing_since: float | None = None
        self.reported: set[int] = set()


class _Xfer:
    __slots__ = ("deadline", "engine_id", "handle", "rank")

    def __init__(self, handle: Any, engine_id: str, rank: int, deadline: float) -> None:
        self.handle = handle
        self.engine_id = engine_id
        self.rank = rank
        self.deadline = deadline


class NixlTransport:
    """One worker's NIXL agent, side channel, registered regions and peer table.

    Every method takes `now` from the driver's clock and never blocks; `poll(now)` drives
    NIXL progress, serves the side channel, and returns what happened as events.
    `on_handshake` (pinner side) turns a received `Handshake` into the core's
    `HandshakeReply` (``lambda hs: pinner.handshake_reply(now(), hs)``).
    """

    def __init__(
        self,
        engine_id: str,
        rank: int,
        incarnation: int,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        engine_ttl: float = 10.0,
        transfer_timeout: float = 30.0,
        handshake_timeout: float = 5.0,
        on_handshake: Callable[[Handshake], HandshakeReply] | None = None,
        serve: bool = True,
    ) -> None:
        loopback_ucx_env()
        logging.getLogger("nixl").setLevel(logging.WARNING)
        from nixl._api import nixl_agent, nixl_agent_config

        self.engine_id = engine_id
        self.rank = rank
        self.incarnation = incarnation
        self.engine_ttl = engine_ttl
        self.transfer_timeout = transfer_timeout
        self.handshake_timeout = handshake_timeout
        self.on_handshake = on_handshake
        # Unique per incarnation, so a restarted worker is a new agent to its peers.
        self.agent_name = f"{engine_id}#{rank}#{incarnation:016x}"
        cfg = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"])
        self._agent = nixl_agent(self.agent_name, cfg)
        self.regions: dict[str, Region] = {}
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._by_agent: dict[str, _Peer] = {}
        self._health: dict[str, _EngineHealth] = {}
        self._xfers: dict[int, _Xfer] = {}
        self._next_xfer = 1
        self._done_q: queue.SimpleQueue[tuple[str, int, dict[str, Any] | Exception]] = queue.SimpleQueue()
        self._pending_handshakes: set[tuple[str, int]] = set()
        self.addresses: dict[str, list[tuple[str, int]]] = {}
        self.unknown_senders = 0
        self.server: SideChannelServer | None = SideChannelServer(host, port, self._serve) if serve else None

    @property
    def side_address(self) -> tuple[str, int] | None:
        return None if self.server is None else self.server.address

    # -- memory ----------------------------------------------------------------------------

    def register(self, name: str, tensor: Any, block_bytes: int) -> Region:
        """Register a contiguous tensor (CPU → DRAM, CUDA → VRAM) cut into `block_bytes`
        blocks. The tensor must outlive the transport."""
        nbytes = int(tensor.numel() * tensor.element_size())
        if not tensor.is_contiguous() or block_bytes <= 0 or nbytes % block_bytes:
            raise ValueError(f"region {name!r}: need a contiguous tensor of whole {block_bytes}-byte blocks")
        if name in self.regions:
            raise ValueError(f"region {name!r} is already registered")
        reg = self._agent.register_memory(tensor)
        region = Region(name, tensor, block_bytes, reg)
        w = region.wire
        region.prepped = self._agent.prep_xfer_dlist("", w.descs(), w.mem_type)
        self.regions[name] = region
        return region

    # -- handshake ---------------------------------------------------------------------------

    def set_engine_addresses(self, engine_id: str, addresses: Sequence[tuple[str, int]]) -> None:
        """Where each worker (rank order) of a pinner engine serves its side channel."""
        self.addresses[engine_id] = [(h, int(p)) for h, p in addresses]

    def start_handshake(self, engine_id: str, message: Handshake) -> None:
        """Handshake with every worker of `engine_id` in the background (HandshakeNeeded)."""
        addrs = self.addresses.get(engine_id)
        if not addrs:
            self._done_q.put((engine_id, -1, LookupError(f"no side-channel address for engine {engine_id!r}")))
            return
        request = {
            "v": SIDE_VERSION,
            "handshake": encode(message),
            "engine_id": self.engine_id,
            "rank": self.rank,
            "agent": self.agent_name,
            "metadata": self._agent.get_agent_metadata(),
            "regions": [r.wire.to_wire() for r in self.regions.values()],
        }
        for rank, addr in enumerate(addrs):
            if (engine_id, rank) in self._pending_handshakes:
                continue
            self._pending_handshakes.add((engine_id, rank))
            threading.Thread(
                target=self._handshake_thread, args=(engine_id, rank, addr, request),
                name=f"kvlease-handshake-{engine_id}-{rank}", daemon=True,
            ).start()

    def _handshake_thread(self, engine_id: str, rank: int, addr: tuple[str, int], request: dict[str, Any]) -> None:
        try:
            self._done_q.put((engine_id, rank, side_request(addr, request, self.handshake_timeout)))
        except Exception as exc:  # reported as an event; the core retries each interval
            self._done_q.put((engine_id, rank, exc))

    def _serve(self, request: dict[str, Any]) -> dict[str, Any]:
        """Pinner side: answer a handshake and add the accessor worker's agent."""
        if request.get("v") != SIDE_VERSION:
            raise ValueError(f"side-channel version {request.get('v')!r}, expected {SIDE_VERSION}")
        if self.on_handshake is None:
            raise ValueError("this worker does not accept handshakes")
        hs = decode(request["handshake"])
        if not isinstance(hs, Handshake):
            raise ValueError(f"expected a Handshake, got {type(hs).__name__}")
        regions = {r.name: r for r in map(RemoteRegion.from_wire, request.get("regions", []))}
        if hs.engine_id != request["engine_id"] or hs.rank != request["rank"]:
            raise ValueError("handshake identity does not match the request")
        self._install_peer(hs.engine_id, hs.rank, str(request["agent"]), bytes(request["metadata"]), regions)
        reply = self.on_handshake(hs)
        return {
            "v": SIDE_VERSION,
            "reply": encode(reply),
            "agent": self.agent_name,
            "metadata": self._agent.get_agent_metadata(),
            "regions": [r.wire.to_wire() for r in self.regions.values()],
        }

    def _install_peer(
        self, engine_id: str, rank: int, agent: str, metadata: bytes, regions: dict[str, RemoteRegion]
    ) -> None:
        old = self._peers.get((engine_id, rank))
        if old is not None and old.agent == agent:
            old.regions = regions
            self._release_prepped(old)
        else:
            if old is not None:
                self._drop_peer(old)  # a restarted peer: its old agent is gone for good
            if agent in self._by_agent:
                self._drop_peer(self._by_agent[agent])
            name = self._agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else str(name)
            if name != agent:
                with contextlib.suppress(Exception):
                    self._agent.remove_remote_agent(name)
                raise ValueError(f"agent metadata names {name!r}, the request says {agent!r}")
            peer = _Peer(engine_id, rank, agent, regions)
            self._peers[(engine_id, rank)] = peer
            self._by_agent[agent] = peer
        h = self._health.setdefault(engine_id, _EngineHealth())
        h.failing_since = None
        h.reported.clear()

    def _release_prepped(self, peer: _Peer) -> None:
        for handle in peer.remote_prepped.values():
            with contextlib.suppress(Exception):
                handle.release()
        peer.remote_prepped.clear()

    def _drop_peer(self, peer: _Peer) -> None:
        self._release_prepped(peer)
        self._peers.pop((peer.engine_id, peer.rank), None)
        self._by_agent.pop(peer.agent, None)
        with contextlib.suppress(Exception):
            self._agent.remove_remote_agent(peer.agent)

    def drop_engine(self, engine_id: str) -> None:
        """Forget every worker of an engine (its agents are removed)."""
        for peer in [p for p in self._peers.values() if p.engine_id == engine_id]:
            self._drop_peer(peer)
        self._health.pop(engine_id, None)

    def peer_ranks(self, engine_id: str) -> list[int]:
        return sorted(r for (e, r) in self._peers if e == engine_id)

    def remote_region(self, engine_id: str, rank: int, name: str) -> RemoteRegion | None:
        peer = self._peers.get((engine_id, rank))
        return None if peer is None else peer.regions.get(name)

    # -- notifications -----------------------------------------------------------------------

    def send(self, now: float, engine_id: str, rank: int | None, payload: bytes) -> list[NixlEvent]:
        """Send one notification to a worker, or to every known worker of the engine."""
        if rank is None:
            targets = [p for p in self._peers.values() if p.engine_id == engine_id]
        else:
            p = self._peers.get((engine_id, rank))
            targets = [] if p is None else [p]
        if not targets:
            return [PeerUnreachable(engine_id, -1 if rank is None else rank, "not connected")]
        events: list[NixlEvent] = []
        for peer in targets:
            try:
                self._agent.send_notif(peer.agent, payload)
            except Exception as exc:  # nixlRemoteDisconnectError & co: typed, per peer
                events.extend(self._failed(now, peer, exc))
        return events

    def _failed(self, now: float, peer: _Peer, exc: Exception) -> list[NixlEvent]:
        h = self._health.setdefault(peer.engine_id, _EngineHealth())
        if h.failing_since is None:
            h.failing_since = now
        if peer.rank in h.reported:
            return []  # once per peer until it is heard from again
        h.reported.add(peer.rank)
        return [PeerUnreachable(peer.engine_id, peer.rank, f"{type(exc).__name__}: {exc}")]

    def poll(self, now: float) -> list[NixlEvent]:
        """Drive NIXL progress, drain notifications (they queue without bound otherwise),
        serve the side channel, apply finished handshakes, check transfers and peer health."""
        events: list[NixlEvent] = []
        if self.server is not None:
            self.server.poll()
        while True:
            try:
                engine_id, rank, result = self._done_q.get_nowait()
            except queue.Empty:
                break
            self._pending_handshakes.discard((engine_id, rank))
            events.append(self._apply_handshake(engine_id, rank, result))
        events.extend(self._check_transfers(now))
        notifs = self._agent.get_new_notifs()
        for agent, payloads in notifs.items():
            peer = self._by_agent.get(agent)
            if peer is None:
                self.unknown_senders += len(payloads)
                continue
            h = self._health.get(peer.engine_id)
            if h is not None and h.failing_since is not None:
                h.failing_since = None
                h.reported.clear()
            events.extend(NotificationReceived(peer.engine_id, peer.rank, bytes(p)) for p in payloads)
        for engine_id, h in list(self._health.items()):
            if h.failing_since is not None and now - h.failing_since >= self.engine_ttl:
                self.drop_engine(engine_id)
                events.append(EngineLost(engine_id))
        return events

    def _apply_handshake(self, engine_id: str, rank: int, result: dict[str, Any] | Exception) -> NixlEvent:
        if isinstance(result, Exception):
            return HandshakeFailed(engine_id, rank, f"{type(result).__name__}: {result}")
        try:
            if "error" in result:
                raise ValueError(f"pinner refused: {result['error']}")
            reply = decode(result["reply"])
            if not isinstance(reply, HandshakeReply):
                raise ValueError(f"expected a HandshakeReply, got {type(reply).__name__}")
            if reply.engine_id != engine_id or reply.rank != rank:
                raise ValueError(f"asked {engine_id!r} rank {rank}, {reply.engine_id!r} rank {reply.rank} answered")
            regions = {r.name: r for r in map(RemoteRegion.from_wire, result.get("regions", []))}
            self._install_peer(engine_id, rank, str(result["agent"]), bytes(result["metadata"]), regions)
        except Exception as exc:
            return HandshakeFailed(engine_id, rank, f"{type(exc).__name__}: {exc}")
        return HandshakeCompleted(engine_id, rank, reply)

    # -- transfers ---------------------------------------------------------------------------

    def start_transfer(
        self,
        now: float,
        op: Op,
        engine_id: str,
        rank: int,
        local: str,
        local_blocks: Sequence[int],
        remote: str,
        remote_blocks: Sequence[int],
        notif: bytes = b"",
    ) -> int | TransferFailed:
        """READ remote blocks into local ones (pull) or WRITE local blocks into remote ones
        (push). `notif`, when given, is delivered to the peer only after the data landed.
        Returns a transfer id, whose outcome a later `poll` reports; or the failure."""
        xfer_id = self._next_xfer
        self._next_xfer += 1
        peer = self._peers.get((engine_id, rank))
        if peer is None:
            return TransferFailed(xfer_id, engine_id, rank, "not connected")
        region = self.regions.get(local)
        rr = peer.regions.get(remote)
        if region is None or rr is None:
            return TransferFailed(xfer_id, engine_id, rank, f"unknown region {local!r} or {remote!r}")
        if len(local_blocks) != len(remote_blocks) or region.block_bytes != rr.block_bytes:
            return TransferFailed(xfer_id, engine_id, rank, "block lists or block sizes do not match")
        try:
            prepped = peer.remote_prepped.get(remote)
            if prepped is None:
                prepped = self._agent.prep_xfer_dlist(peer.agent, rr.descs(), rr.mem_type)
                peer.remote_prepped[remote] = prepped
            handle = self._agent.make_prepped_xfer(
                op, region.prepped, list(local_blocks), prepped, list(remote_blocks), notif
            )
            state = self._agent.transfer(handle)
        except Exception as exc:
            self._failed(now, peer, exc)  # counts toward the engine TTL
            return TransferFailed(xfer_id, engine_id, rank, f"{type(exc).__name__}: {exc}")
        if state == "ERR":
            handle.release()
            return TransferFailed(xfer_id, engine_id, rank, "transfer could not be posted")
        self._xfers[xfer_id] = _Xfer(handle, engine_id, rank, now + self.transfer_timeout)
        return xfer_id

    def _check_transfers(self, now: float) -> list[NixlEvent]:
        events: list[NixlEvent] = []
        for xfer_id, x in list(self._xfers.items()):
            try:
                # Polling is also what sends the attached notification once the data landed.
                state = self._agent.check_xfer_state(x.handle)
            except Exception as exc:
                state = f"{type(exc).__name__}: {exc}"
            if state == "PROC":
                if now < x.deadline:
                    continue
                state = f"timed out after {self.transfer_timeout} s"
            del self._xfers[xfer_id]
            if state == "DONE":
                x.handle.release()
                events.append(TransferDone(xfer_id, x.engine_id, x.rank))
            else:
                with contextlib.suppress(Exception):
                    x.handle.release()  # aborts it where the backend can
                events.append(TransferFailed(xfer_id, x.engine_id, x.rank, state))
        return events

    @property
    def transfers_in_flight(self) -> int:
        return len(self._xfers)

    def close(self) -> None:
        for x in self._xfers.values():
            with contextlib.suppress(Exception):
                x.handle.release()
        self._xfers.clear()
        for peer in list(self._peers.values()):
            self._drop_peer(peer)
        for region in self.regions.values():
            with contextlib.suppress(Exception):
                region.prepped.release()
            with contextlib.suppress(Exception):
                self._agent.deregister_memory(region.reg)
        self.regions.clear()
        if self.server is not None:
            self.server.close()
            self.server = None
