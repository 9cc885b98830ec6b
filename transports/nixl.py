"""The NIXL transport: lease messages as NIXL notifications, KV memory as registered regions.

Implements `kvlease.transports._base.Transport` for one worker (rank) of one engine. It owns:

- one ``nixl_agent`` (UCX backend, **no** progress thread: on a small machine two spinning
  progress threads starve each other, so NIXL progresses only when the driver calls
  `receive` / `progress`, which it does every step — a pinner must keep stepping for its
  memory to be readable);
- the memory this worker registered (torch tensors: DRAM on CPU, VRAM when the tensor lives on
  a CUDA device; any writable buffer is wrapped as a CPU tensor) and the buffers it transfers
  into or out of (registered on first use and kept: registration is costly, KV pools are reused);
- the remote agents of peer workers keyed by ``(engine_id, rank)``, with their region layouts.
  A restarted peer (new incarnation → new agent name and metadata) replaces its old agent with
  ``remove_remote_agent`` + ``add_remote_agent``; both run only in the driver's thread, so
  re-adds are serialized;
- the side channel for the handshake.

It reads no clock: how long a transfer (or a wait for a peer's layout) may take is the driver's
``transfer_timeout``, enforced with `cancel_transfer`, so the driver stays the only clock reader.
The side channel's socket timeouts (``handshake_timeout``) are the kernel's, not a clock read here.
Waiting: NIXL's Python API gives no descriptor for notifications (they are seen only by polling
``get_new_notifs``), so this transport is not `Pollable` and `Driver.run` steps it every
``poll_interval``.

Side channel: a plain TCP socket bound to 127.0.0.1 (or the namespace address), carrying one
length-prefixed msgpack request and one reply per connection. Chosen over ZMQ REQ/REP because
it needs nothing beyond the standard library for the ``nixl`` extra, binds exactly the address
given (NIXL's own metadata listener binds every interface), and a peer that dies mid-exchange
just closes a connection instead of wedging a REQ socket's lockstep state machine. The server is
non-blocking and served from `progress`; rank 0 holds a handshake connection open until the
driver answers it in its step. The client side (the proactive handshake with a not-yet-connected
pinner, and fetching a layout) is the only thing that runs in a background thread, and it never
touches NIXL: results are applied in the next `progress`.

Handshake with a tensor-parallel pinner: the accessor worker sends the encoded `Handshake` and
its agent metadata to the pinner's rank-0 side channel; rank 0 answers with the core's
`HandshakeReply`, its own agent metadata and layout, and the side-channel addresses of every
worker of its engine; the accessor's background thread then says hello to every other worker
(each answers from its transport), so heartbeats can reach each of them. A requester's agent
(where acks go) is installed from a handshake only once the driver accepted the handshake —
with a deployment key, only a sealed one — and a hello may add a new peer but replaces a known
one (a restart) only through the same check of the handshake it carries, so a bare request
naming another engine cannot hijack where that engine's acks go.

Data plane: ``start_read`` pulls a whole remote region into a local buffer (RDMA READ),
``start_write`` pushes a local buffer into a remote region (WRITE). A notification passed as
`notif` is attached to the transfer: NIXL sends it only after the data landed, and only when
this side polls ``check_xfer_state`` (done in `progress`). Layout changes (a region registered
or unregistered after the handshake) are pushed to connected peers as a transport-private
notification (prefix ``0xC1 0x4E``), which `receive` consumes; a read naming a region not yet
known is held while the layout is fetched over the side channel.

Must never: hold lease state or decide anything about leases (that is the core's job; a send
error is reported as `PeerUnreachable`, a hint, never a basis for safety), block the driver's
step, or call NIXL from more than one thread.
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
from collections import deque
from typing import Any, Final, Literal

import msgpack

from ._base import (
    HandshakeEvent,
    HandshakeFailed,
    HandshakeRequest,
    HandshakeResponse,
    Inbound,
    PeerUnreachable,
    TransferResult,
)

__all__ = ["LAYOUT_MAGIC", "NixlTransport", "RemoteRegion", "loopback_ucx_env", "parse_address"]

log = logging.getLogger("kvlease.transports.nixl")

#: Side-channel frames are bounded: agent metadata is a few hundred bytes, layouts a few KiB.
MAX_SIDE_FRAME: Final = 1 << 20
SIDE_VERSION: Final = 1
#: Transport-private layout notifications. 0xC1 never starts msgpack or UTF-8, and the second
#: byte differs from the kvlease frame magic (0xC1 0x4B), so no peer mistakes one for the other.
LAYOUT_MAGIC: Final = b"\xc1\x4e"
#: Buffers registered on first use (transfer targets and sources) kept per transport.
MAX_AUTO_REGISTRATIONS: Final = 4096
_LEN = struct.Struct("!I")

Op = Literal["READ", "WRITE"]


def loopback_ucx_env() -> None:
    """Keep UCX on the loopback device unless the caller chose otherwise. Must run before the
    first agent is created (UCX reads its environment once)."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")


def parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"side-channel address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


# -- memory ---------------------------------------------------------------------------------


class RemoteRegion:
    """A registered region as announced to peers: one contiguous range."""

    __slots__ = ("addr", "dev_id", "mem_type", "name", "nbytes")

    def __init__(self, name: str, addr: int, nbytes: int, mem_type: str, dev_id: int) -> None:
        self.name = name
        self.addr = addr
        self.nbytes = nbytes
        self.mem_type = mem_type
        self.dev_id = dev_id

    def to_wire(self) -> list[Any]:
        return [self.name, self.addr, self.nbytes, self.mem_type, self.dev_id]

    @classmethod
    def from_wire(cls, v: object) -> RemoteRegion:
        if not isinstance(v, list) or len(v) != 5:
            raise ValueError(f"region must be a 5-item list, got {v!r}")
        name, addr, nbytes, mem_type, dev_id = v
        if not isinstance(name, str) or not all(isinstance(i, int) and i >= 0 for i in (addr, nbytes, dev_id)):
            raise ValueError(f"malformed region {v!r}")
        if mem_type not in ("DRAM", "VRAM"):
            raise ValueError(f"malformed region memory type {mem_type!r}")
        return cls(name, addr, nbytes, mem_type, dev_id)


def _as_tensor(buffer: object) -> Any:
    """A contiguous torch tensor viewing `buffer` (no copy)."""
    import torch

    if isinstance(buffer, torch.Tensor):
        if not buffer.is_contiguous():
            raise ValueError("a registered tensor must be contiguous")
        return buffer
    view = memoryview(buffer)  # type: ignore[arg-type]
    if view.readonly:
        raise ValueError("a registered buffer must be writable")
    return torch.frombuffer(view.cast("B"), dtype=torch.uint8)


def _describe(tensor: Any) -> tuple[int, int, str, int]:
    """(address, bytes, NIXL memory type, device id) of a tensor: VRAM only for CUDA memory."""
    nbytes = int(tensor.numel() * tensor.element_size())
    if bool(tensor.is_cuda):
        return int(tensor.data_ptr()), nbytes, "VRAM", int(tensor.device.index or 0)
    return int(tensor.data_ptr()), nbytes, "DRAM", 0


class _Local:
    __slots__ = ("desc", "reg", "tensor")

    def __init__(self, tensor: Any, reg: Any) -> None:
        self.tensor = tensor  # keeps the memory alive while registered
        self.reg = reg
        self.desc = _describe(tensor)


# -- side channel ---------------------------------------------------------------------------


#: Side-channel connections held at once (each waits for one request); beyond it new ones are
#: closed at once, so idle or refused connections cannot exhaust the process's descriptors.
MAX_SIDE_CONNECTIONS = 256


def _frame(obj: object) -> bytes:
    body: bytes = msgpack.packb(obj, use_bin_type=True)
    return _LEN.pack(len(body)) + body


def _unpack(body: bytes) -> dict[str, Any]:
    obj = msgpack.unpackb(body, raw=False, strict_map_key=True)
    if not isinstance(obj, dict):
        raise ValueError("side-channel frame is not a map")
    return obj


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("side channel closed mid-frame")
        buf += chunk
    return bytes(buf)


def side_request(addr: tuple[str, int], request: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One blocking request/reply on the side channel (background threads only)."""
    with socket.create_connection(addr, timeout=timeout) as s:
        s.settimeout(timeout)
        s.sendall(_frame(request))
        (n,) = _LEN.unpack(_recv_exact(s, _LEN.size))
        if n > MAX_SIDE_FRAME:
            raise ValueError(f"side-channel reply of {n} bytes exceeds {MAX_SIDE_FRAME}")
        reply = _unpack(_recv_exact(s, n))
    if "error" in reply:
        raise ConnectionRefusedError(f"peer refused: {reply['error']}")
    if reply.get("v") != SIDE_VERSION:
        raise ValueError(f"side-channel version {reply.get('v')!r}, expected {SIDE_VERSION}")
    return reply


class _SideConn:
    __slots__ = ("inbuf", "outbuf", "request", "sock", "token")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.inbuf = bytearray()
        self.outbuf = b""
        self.token = 0
        #: A request whose requester is installed only when the driver accepts its handshake.
        self.request: dict[str, Any] | None = None


# -- the transport --------------------------------------------------------------------------


class _Peer:
    __slots__ = ("address", "agent", "engine_id", "rank", "regions")

    def __init__(self, engine_id: str, rank: int, agent: str) -> None:
        self.engine_id = engine_id
        self.rank = rank
        self.agent = agent
        self.regions: dict[str, RemoteRegion] = {}
        self.address: str | None = None


class _Xfer:
    __slots__ = ("engine_id", "handle", "local", "nbytes", "notif", "op", "rank", "region")

    def __init__(self, op: Op, engine_id: str, rank: int, region: str, local: _Local, notif: bytes):
        self.op = op
        self.engine_id = engine_id
        self.rank = rank
        self.region = region
        self.local = local
        self.notif = notif
        self.handle: Any = None  # None while waiting for the remote layout
        self.nbytes = 0


class NixlTransport:
    """One worker's NIXL agent, side channel, registered memory and peer table.

    `worker_addresses` (rank order, ``host:port``) are the side channels of every worker of
    this engine; rank 0 hands them to accessors in its handshake reply. With one worker it may
    be omitted. `incarnation` makes the agent name unique per process life (default: random).
    """

    def __init__(
        self,
        engine_id: str,
        rank: int = 0,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        incarnation: int | None = None,
        worker_addresses: list[str] | None = None,
        handshake_timeout: float = 5.0,
    ) -> None:
        loopback_ucx_env()
        logging.getLogger("nixl").setLevel(logging.WARNING)
        from nixl._api import nixl_agent, nixl_agent_config

        self._engine_id = engine_id
        self._rank = rank
        self.handshake_timeout = handshake_timeout
        inc = int.from_bytes(os.urandom(8), "big") if incarnation is None else incarnation
        # Unique per process life, so a restarted worker is a new agent to its peers.
        self.agent_name = f"{engine_id}#{rank}#{inc:016x}"
        cfg = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"])
        self._agent = nixl_agent(self.agent_name, cfg)
        self._regions: dict[str, _Local] = {}
        self._auto: dict[tuple[int, int], _Local] = {}
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._by_agent: dict[str, _Peer] = {}
        self._xfers: dict[int, _Xfer] = {}
        self._next_handle = 1
        self._results: list[TransferResult] = []
        self._hs_events: list[HandshakeEvent] = []
        # Background threads post (kind, engine_id, payload); applied in `progress`.
        self._bg: queue.SimpleQueue[tuple[str, str, Any]] = queue.SimpleQueue()
        self._inbound: deque[Inbound] = deque()
        self._pending_answers: dict[int, _SideConn] = {}
        self._next_token = 1
        self._layout_fetches: set[tuple[str, int]] = set()
        #: Notifications from agents we do not know (dropped) and bad side-channel requests.
        self.unknown_senders = 0
        self.malformed = 0
        self._sel = selectors.DefaultSelector()
        self._lsock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._lsock.bind((host, port))
        self._lsock.listen(64)
        self._lsock.setblocking(False)
        self._sel.register(self._lsock, selectors.EVENT_READ, None)
        h, p = self._lsock.getsockname()[:2]
        self._address = f"[{h}]:{p}" if ":" in h else f"{h}:{p}"
        self.worker_addresses = list(worker_addresses) if worker_addresses else [self._address]

    # -- identity ----------------------------------------------------------------------------

    @property
    def engine_id(self) -> str:
        return self._engine_id

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def address(self) -> str:
        return self._address

    # -- memory ------------------------------------------------------------------------------

    def register(self, region: str, buffer: object) -> int:
        if region in self._regions:
            raise ValueError(f"region {region!r} is already registered")
        tensor = _as_tensor(buffer)
        local = self._register(tensor)
        self._regions[region] = local
        addr, nbytes, mem_type, dev = local.desc
        # Peers hold our agent metadata from their handshake, which lacks this registration's
        # remote keys: ship them (partial metadata; add_remote_agent merges it).
        meta = self._agent.get_partial_agent_metadata(local.reg, False)
        self._announce(["+", [region, addr, nbytes, mem_type, dev], meta])
        return nbytes

    def unregister(self, region: str) -> None:
        local = self._regions.pop(region, None)
        if local is None:
            return
        self._announce(["-", region])
        if not any(x.local is local for x in self._xfers.values()):
            with contextlib.suppress(Exception):
                self._agent.deregister_memory(local.reg)

    def _register(self, tensor: Any) -> _Local:
        return _Local(tensor, self._agent.register_memory(tensor))

    def _local_for(self, buffer: object) -> _Local:
        """The registration covering `buffer`: a region of ours, or one made on first use."""
        tensor = _as_tensor(buffer)
        addr, nbytes, _, _ = _describe(tensor)
        for local in (*self._regions.values(), *self._auto.values()):
            a, n, _, _ = local.desc
            if a <= addr and addr + nbytes <= a + n:
                if (a, n) == (addr, nbytes):
                    return local
                sub = _Local(tensor, local.reg)
                return sub
        if len(self._auto) >= MAX_AUTO_REGISTRATIONS:
            raise ValueError(f"more than {MAX_AUTO_REGISTRATIONS} distinct transfer buffers; register a pool")
        local = self._register(tensor)
        self._auto[(addr, nbytes)] = local
        return local

    def _layout(self) -> list[list[Any]]:
        return [[name, *loc.desc] for name, loc in self._regions.items()]

    def _announce(self, change: list[Any]) -> None:
        payload = LAYOUT_MAGIC + msgpack.packb(change, use_bin_type=True)
        for peer in list(self._peers.values()):
            with contextlib.suppress(Exception):
                self._agent.send_notif(peer.agent, payload)

    # -- control plane -----------------------------------------------------------------------

    def send(self, engine_id: str, rank: int | None, data: bytes) -> None:
        if rank is None:
            targets = [p for p in self._peers.values() if p.engine_id == engine_id]
        else:
            p = self._peers.get((engine_id, rank))
            targets = [] if p is None else [p]
        if not targets:
            raise PeerUnreachable(engine_id, rank, "no NIXL agent known for it (not handshaken or forgotten)")
        failures: list[str] = []
        for peer in targets:
            try:
                self._agent.send_notif(peer.agent, data)
            except Exception as exc:  # nixlRemoteDisconnectError & co: typed, per peer
                failures.append(f"rank {peer.rank}: {type(exc).__name__}: {exc}")
        if failures:
            raise PeerUnreachable(engine_id, rank, "; ".join(failures))

    def receive(self) -> list[Inbound]:
        # Received notifications queue without bound inside NIXL until drained: drain all.
        for agent, payloads in self._agent.get_new_notifs().items():
            peer = self._by_agent.get(agent)
            if peer is None:
                self.unknown_senders += len(payloads)
                continue
            for p in payloads:
                data = bytes(p)
                if data[:2] == LAYOUT_MAGIC:
                    self._apply_layout_change(peer, data[2:])
                else:
                    self._inbound.append(Inbound(peer.engine_id, peer.rank, data))
        out = list(self._inbound)
        self._inbound.clear()
        return out

    def _apply_layout_change(self, peer: _Peer, body: bytes) -> None:
        try:
            change = msgpack.unpackb(body, raw=False)
            if change[0] == "+":
                r = RemoteRegion.from_wire(change[1])
                self._agent.add_remote_agent(bytes(change[2]))
                peer.regions[r.name] = r
            elif change[0] == "-" and isinstance(change[1], str):
                peer.regions.pop(change[1], None)
            else:
                raise ValueError(change)
        except Exception:
            self.malformed += 1

    def progress(self) -> None:
        self._serve_side_channel()
        self._apply_background()
        self._check_transfers()

    def wait(self, timeout: float) -> None:
        # NIXL without a progress thread has no descriptor to wait on: nap briefly, waking
        # early for side-channel traffic, so notifications are picked up within ~1 ms.
        if timeout > 0:
            self._sel.select(timeout=min(timeout, 0.001))

    # -- handshake ---------------------------------------------------------------------------

    def _hello(self, kind: str, data: bytes = b"") -> dict[str, Any]:
        return {
            "v": SIDE_VERSION,
            "kind": kind,
            "engine_id": self._engine_id,
            "rank": self._rank,
            "agent": self.agent_name,
            "metadata": self._agent.get_agent_metadata(),
            "address": self._address,
            "handshake": data,
        }

    def request_handshake(self, engine_id: str, address: str, data: bytes) -> None:
        request = self._hello("handshake", data)
        threading.Thread(
            target=self._handshake_thread,
            args=(engine_id, address, request),
            name=f"kvlease-nixl-handshake-{engine_id}",
            daemon=True,
        ).start()

    def _handshake_thread(self, engine_id: str, address: str, request: dict[str, Any]) -> None:
        try:
            reply = side_request(parse_address(address), request, self.handshake_timeout)
            # The hellos carry the same handshake: a worker that already knows this engine/rank
            # under another agent (we restarted) installs the new one only once its driver
            # accepted that handshake (with a key: only if it is sealed with it).
            hello = dict(request, kind="hello")
            workers = reply.get("workers") or [address]
            others = []
            for rank, addr in enumerate(workers):
                if rank != reply.get("rank", 0):
                    others.append(side_request(parse_address(str(addr)), hello, self.handshake_timeout))
            self._bg.put(("handshake", engine_id, (reply, others)))
        except Exception as exc:  # reported as HandshakeFailed; the core retries each interval
            self._bg.put(("handshake_failed", engine_id, f"{type(exc).__name__}: {exc}"))

    def _layout_thread(self, engine_id: str, rank: int, address: str, request: dict[str, Any]) -> None:
        try:
            self._bg.put(("layout", engine_id, side_request(parse_address(address), request, self.handshake_timeout)))
        except Exception as exc:
            self._bg.put(("layout_failed", engine_id, (rank, f"{type(exc).__name__}: {exc}")))

    def poll_handshakes(self) -> list[HandshakeEvent]:
        out = self._hs_events
        self._hs_events = []
        return out

    def answer_handshake(self, token: int, data: bytes) -> None:
        conn = self._pending_answers.pop(token, None)
        if conn is None:
            return  # the accessor hung up meanwhile
        try:
            if conn.request is not None:
                self._install(conn.request)  # the driver accepted the handshake it carried
        except Exception as exc:
            self.malformed += 1
            log.debug("side channel: dropping a connection: %s", exc)
            self._close(conn)
            return
        if conn.request is not None and conn.request.get("kind") == "hello":
            self._answer_hello(conn)
            return
        reply = {
            "v": SIDE_VERSION,
            "reply": data,
            "engine_id": self._engine_id,
            "rank": self._rank,
            "agent": self.agent_name,
            "metadata": self._agent.get_agent_metadata(),
            "regions": self._layout(),
            "workers": self.worker_addresses,
        }
        conn.outbuf = _frame(reply)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.modify(conn.sock, selectors.EVENT_WRITE, conn)

    def _apply_background(self) -> None:
        while True:
            try:
                kind, engine_id, payload = self._bg.get_nowait()
            except queue.Empty:
                return
            if kind == "handshake":
                reply, others = payload
                try:
                    for info in (reply, *others):
                        if info.get("engine_id") != engine_id:
                            raise ValueError(f"{info.get('engine_id')!r} answered for {engine_id!r}")
                        self._install(info)
                except Exception as exc:
                    self._hs_events.append(HandshakeFailed(engine_id, f"{type(exc).__name__}: {exc}"))
                    continue
                self._hs_events.append(HandshakeResponse(engine_id, bytes(reply["reply"])))
            elif kind == "handshake_failed":
                self._hs_events.append(HandshakeFailed(engine_id, str(payload)))
            elif kind == "layout":
                with contextlib.suppress(Exception):
                    self._install(payload)
                self._layout_fetches.discard((engine_id, int(payload.get("rank", -1))))
                self._start_waiting(engine_id)
            elif kind == "layout_failed":
                rank, reason = payload
                self._layout_fetches.discard((engine_id, rank))
                self._fail_waiting(engine_id, rank, f"layout fetch failed: {reason}")

    def _install(self, info: dict[str, Any]) -> _Peer:
        """Add (or replace) a peer worker's agent from its hello, serialized in this thread."""
        engine_id, rank, agent = info["engine_id"], info["rank"], info["agent"]
        if not isinstance(engine_id, str) or not isinstance(rank, int) or not isinstance(agent, str):
            raise ValueError("malformed hello")
        peer = self._peers.get((engine_id, rank))
        if peer is None or peer.agent != agent:
            if peer is not None:
                self._drop(peer)  # restarted: the old agent is gone for good
            stale = self._by_agent.get(agent)
            if stale is not None:
                self._drop(stale)
            name = self._agent.add_remote_agent(bytes(info["metadata"]))
            name = name.decode() if isinstance(name, bytes) else str(name)
            if name != agent:
                with contextlib.suppress(Exception):
                    self._agent.remove_remote_agent(name)
                raise ValueError(f"agent metadata names {name!r}, the hello says {agent!r}")
            peer = _Peer(engine_id, rank, agent)
            self._peers[(engine_id, rank)] = peer
            self._by_agent[agent] = peer
        else:
            # Same agent, fresher metadata (memory registered since): add_remote_agent merges.
            self._agent.add_remote_agent(bytes(info["metadata"]))
        if "regions" in info:
            peer.regions = {r.name: r for r in map(RemoteRegion.from_wire, info["regions"])}
        if isinstance(info.get("address"), str):
            peer.address = info["address"]
        return peer

    def _drop(self, peer: _Peer) -> None:
        self._peers.pop((peer.engine_id, peer.rank), None)
        self._by_agent.pop(peer.agent, None)
        with contextlib.suppress(Exception):
            self._agent.remove_remote_agent(peer.agent)

    def forget_peer(self, engine_id: str) -> None:
        for handle, x in list(self._xfers.items()):
            if x.engine_id == engine_id:
                self._finish(handle, x, "peer forgotten (engine TTL)")
        for peer in [p for p in self._peers.values() if p.engine_id == engine_id]:
            self._drop(peer)

    def known_ranks(self, engine_id: str) -> list[int]:
        return sorted(r for (e, r) in self._peers if e == engine_id)

    # -- side-channel server -----------------------------------------------------------------

    def _serve_side_channel(self) -> None:
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
            except OSError as exc:  # out of descriptors (EMFILE/ENFILE): shed load, never raise
                self.malformed += 1
                log.debug("side channel: accept failed: %s", exc)
                return
            if len(self._sel.get_map()) > MAX_SIDE_CONNECTIONS:
                # Connections that never finish a request must not exhaust the process.
                self.malformed += 1
                s.close()
                continue
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
            if conn.token:
                return  # a request is already being answered; ignore extra bytes
            conn.inbuf += chunk
            if len(conn.inbuf) < _LEN.size:
                return
            (n,) = _LEN.unpack_from(conn.inbuf)
            if n > MAX_SIDE_FRAME:
                raise ValueError(f"side-channel request of {n} bytes exceeds {MAX_SIDE_FRAME}")
            if len(conn.inbuf) < _LEN.size + n:
                return
            self._handle_request(conn, _unpack(bytes(conn.inbuf[_LEN.size : _LEN.size + n])))
        except (BlockingIOError, InterruptedError):
            return
        except Exception as exc:
            # Hostile or broken input costs one connection (and a counter), never the step.
            self.malformed += 1
            log.debug("side channel: dropping a connection: %s", exc)
            with contextlib.suppress(OSError):
                conn.sock.send(_frame({"v": SIDE_VERSION, "error": f"{type(exc).__name__}: {exc}"}))
            self._close(conn)

    def _handle_request(self, conn: _SideConn, request: dict[str, Any]) -> None:
        if request.get("v") != SIDE_VERSION:
            raise ValueError(f"side-channel version {request.get('v')!r}, expected {SIDE_VERSION}")
        kind = request.get("kind")
        if kind not in ("handshake", "hello"):
            raise ValueError(f"unknown side-channel request {kind!r}")
        engine_id, rank, agent = request.get("engine_id"), request.get("rank"), request.get("agent")
        if not isinstance(engine_id, str) or not isinstance(rank, int) or not isinstance(agent, str):
            raise ValueError("malformed hello")
        known = self._peers.get((engine_id, rank))
        # The requester's agent is what acks go back to. A handshake installs it only once the
        # driver accepted the handshake (answer_handshake): with a key, only a sealed one. A
        # hello installs a new peer at once, but replaces a known one (a restart, or a
        # hijack attempt) only through the same driver check of the handshake it carries.
        if kind == "handshake" or (known is not None and known.agent != agent):
            data = request.get("handshake")
            if not isinstance(data, bytes) or not data:
                raise ValueError(f"{kind} without a handshake")
            conn.token = self._next_token
            self._next_token += 1
            self._pending_answers[conn.token] = conn
            conn.request = request
            self._hs_events.append(HandshakeRequest(conn.token, data))
            return
        self._install(request)
        self._answer_hello(conn)

    def _answer_hello(self, conn: _SideConn) -> None:
        conn.outbuf = _frame(
            {
                "v": SIDE_VERSION,
                "engine_id": self._engine_id,
                "rank": self._rank,
                "agent": self.agent_name,
                "metadata": self._agent.get_agent_metadata(),
                "regions": self._layout(),
            }
        )
        self._sel.modify(conn.sock, selectors.EVENT_WRITE, conn)

    def reject_handshake(self, token: int) -> None:
        conn = self._pending_answers.pop(token, None)
        if conn is not None:
            conn.token = 0
            self._close(conn)

    def _close(self, conn: _SideConn) -> None:
        if conn.token:
            self._pending_answers.pop(conn.token, None)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn.sock)
        conn.sock.close()

    # -- data plane --------------------------------------------------------------------------

    def start_read(self, engine_id: str, rank: int, region: str, into: object, notif: bytes | None) -> int:
        return self._start("READ", engine_id, rank, region, into, notif)

    def start_write(self, engine_id: str, rank: int, region: str, src: object, notif: bytes | None) -> int:
        return self._start("WRITE", engine_id, rank, region, src, notif)

    def _start(self, op: Op, engine_id: str, rank: int, region: str, buffer: object, notif: bytes | None) -> int:
        handle = self._next_handle
        self._next_handle += 1
        try:
            local = self._local_for(buffer)
        except Exception as exc:
            self._results.append(TransferResult(handle, False, f"local buffer: {type(exc).__name__}: {exc}"))
            return handle
        x = _Xfer(op, engine_id, rank, region, local, notif or b"")
        self._xfers[handle] = x
        peer = self._peers.get((engine_id, rank))
        if peer is None:
            self._finish(handle, x, "not connected to that worker")
        elif region in peer.regions:
            self._post(handle, x, peer)
        elif peer.address is not None and (engine_id, rank) not in self._layout_fetches:
            self._layout_fetches.add((engine_id, rank))
            threading.Thread(
                target=self._layout_thread,
                args=(engine_id, rank, peer.address, self._hello("hello")),
                name=f"kvlease-nixl-layout-{engine_id}",
                daemon=True,
            ).start()
        elif peer.address is None:
            self._finish(handle, x, f"region {region!r} unknown on {engine_id!r} rank {rank}")
        return handle

    def _post(self, handle: int, x: _Xfer, peer: _Peer) -> None:
        rr = peer.regions[x.region]
        addr, nbytes, mem_type, dev = x.local.desc
        if nbytes != rr.nbytes:
            self._finish(handle, x, f"local buffer has {nbytes} bytes, remote region {x.region!r} {rr.nbytes}")
            return
        try:
            local_descs = self._agent.get_xfer_descs([(addr, nbytes, dev)], mem_type)
            remote_descs = self._agent.get_xfer_descs([(rr.addr, rr.nbytes, rr.dev_id)], rr.mem_type)
            x.handle = self._agent.initialize_xfer(x.op, local_descs, remote_descs, peer.agent, x.notif)
            state = self._agent.transfer(x.handle)
        except Exception as exc:
            self._finish(handle, x, f"{type(exc).__name__}: {exc}")
            return
        x.nbytes = nbytes
        if state == "ERR":
            self._finish(handle, x, "the transfer could not be posted")
        elif state == "DONE":
            self._check_one(handle, x)  # polls once more so the attached notification goes

    def _start_waiting(self, engine_id: str) -> None:
        for handle, x in list(self._xfers.items()):
            if x.engine_id != engine_id or x.handle is not None:
                continue
            peer = self._peers.get((engine_id, x.rank))
            if peer is None:
                self._finish(handle, x, "peer forgotten while fetching its layout")
            elif x.region in peer.regions:
                self._post(handle, x, peer)
            elif (engine_id, x.rank) not in self._layout_fetches:
                self._finish(handle, x, f"region {x.region!r} unknown on {engine_id!r} rank {x.rank}")

    def _fail_waiting(self, engine_id: str, rank: int, reason: str) -> None:
        for handle, x in list(self._xfers.items()):
            if x.engine_id == engine_id and x.rank == rank and x.handle is None:
                self._finish(handle, x, reason)

    def _check_transfers(self) -> None:
        for handle, x in list(self._xfers.items()):
            self._check_one(handle, x)

    def _check_one(self, handle: int, x: _Xfer) -> None:
        if x.handle is None:
            return  # waiting for the remote layout (the driver's transfer timeout bounds it)
        try:
            # Polling is also what sends the attached notification once the data landed.
            state = self._agent.check_xfer_state(x.handle)
        except Exception as exc:
            self._finish(handle, x, f"{type(exc).__name__}: {exc}")
            return
        if state == "DONE":
            self._finish(handle, x, None)
        elif state != "PROC":
            self._finish(handle, x, f"transfer state {state}")

    def _finish(self, handle: int, x: _Xfer, error: str | None) -> None:
        self._xfers.pop(handle, None)
        if x.handle is not None:
            with contextlib.suppress(Exception):
                x.handle.release()  # aborts an unfinished transfer where the backend can
        if error is None:
            self._results.append(TransferResult(handle, True, "", x.nbytes))
        else:
            self._results.append(TransferResult(handle, False, error))

    def cancel_transfer(self, handle: int) -> None:
        """Abandon a transfer (the driver's timeout): released, and never reported."""
        x = self._xfers.pop(handle, None)
        if x is not None and x.handle is not None:
            with contextlib.suppress(Exception):
                x.handle.release()  # aborts it where the backend can

    def poll_transfers(self) -> list[TransferResult]:
        # Check NIXL here too, so a completion is seen in the same step, not the next one.
        self._check_transfers()
        out = self._results
        self._results = []
        return out

    @property
    def transfers_in_flight(self) -> int:
        return len(self._xfers)

    def close(self) -> None:
        for handle, x in list(self._xfers.items()):
            self._finish(handle, x, "transport closed")
        self._results.clear()
        for peer in list(self._peers.values()):
            self._drop(peer)
        for local in (*self._regions.values(), *self._auto.values()):
            with contextlib.suppress(Exception):
                self._agent.deregister_memory(local.reg)
        self._regions.clear()
        self._auto.clear()
        for key in list(self._sel.get_map().values()):
            with contextlib.suppress(OSError):
                key.fileobj.close()  # type: ignore[union-attr]
        self._sel.close()
