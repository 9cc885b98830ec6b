"""A kvlease `Transport` over the NIXL agent vLLM's NIXL connector already owns.

No second NIXL agent and no new port: lease messages travel as NIXL notifications of the
connector's own agent (``send_notif``), and what arrives is handed over by the connector, which
drains ``get_new_notifs`` once per step and feeds each notification here (`feed`).

- **Accessor side (decode).** vLLM's handshake (its ZMQ side channel) gives this worker the
  producer's agents (``_remote_agents``); the kvlease `Handshake` then goes as a notification
  to those agents, framed with this worker's own agent metadata (``HELLO_MAGIC``), because in
  pull mode the producer never loads the decoder's agent otherwise and could not answer. Before
  vLLM's handshake is done, `request_handshake` asks the connector to start it (the same
  proactive handshake vLLM's own heartbeats do) and sends the hello once it completes.
- **Pinner side (prefill).** A hello surfaces as a `HandshakeRequest`; only when the driver
  accepted it (`answer_handshake`) is the decoder's agent loaded and the reply sent to it.
- **Data plane.** vLLM posts the READ itself (its descriptors, TP mapping and prepped handles).
  `start_read` records an *external* access for the request the connector names with `expect`,
  and hands the driver's access-done notification to the connector, which attaches it to vLLM's
  READ in place of vLLM's ``"id:count"`` (NIXL delivers it only after the data landed). The
  connector reports the READ's outcome with `complete`; `poll_transfers` returns it to the
  driver. Memory registration is vLLM's: `register` is refused.

Never decides anything about a lease, never blocks, never raises into the step for bad bytes.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Final

import msgpack
from kvlease.transports import (
    HandshakeEvent,
    HandshakeFailed,
    HandshakeRequest,
    Inbound,
    PeerUnreachable,
    TransferResult,
)

from kvlease import PROTOCOL_VERSION, FrameAuth

__all__ = ["HELLO_MAGIC", "PRODUCER_KEY", "ConnectorTransport", "NotifSwap", "producer_claim", "verify_producer_claim"]

log = logging.getLogger("kvlease.adapters.vllm")

#: A kvlease handshake carried with the sender's agent metadata. 0xC1 never starts msgpack, UTF-8
#: or a kvlease frame, so it is never mistaken for a vLLM notification or a native message.
HELLO_MAGIC: Final = b"\xc1\x4bH"
_MAX_HELLO: Final = 1 << 20
#: A NIXL or vLLM call of this transport that takes longer (ns) is logged at WARNING, naming it:
#: each runs under the worker's lease lock, which the engine's step also takes.
SLOW_CALL_NS: Final = 250_000_000


def _say_if_slow(what: str, began_ns: int, peer: object) -> None:
    """Log `what` (a call to `peer` begun at `began_ns`) at WARNING when it took over `SLOW_CALL_NS`."""
    took = time.perf_counter_ns() - began_ns
    if took > SLOW_CALL_NS:
        log.warning("kvlease: %s (%s) took %.3f s", what, _text(peer), took / 1e9)


#: The key of a kvlease push producer's claim in the ``kv_transfer_params`` it returns
#: (`producer_claim`).
PRODUCER_KEY: Final = "kvlease_producer"


def _claim_payload(engine_id: str, request_id: str) -> bytes:
    return b"push-producer\0" + bytes(msgpack.packb([engine_id, request_id]))


def producer_claim(auth: FrameAuth | None, engine_id: str, request_id: str) -> dict[str, Any]:
    """What a kvlease push producer adds to the ``kv_transfer_params`` it returns for
    `request_id`: that it runs kvlease (the wire version), sealed under a deployment key to its
    engine and that request. The decoder then never takes it for stock vLLM, whose WRITE it would
    wait for past the lease, when the producer's first lease message comes late (a loaded
    producer). Stripped on the way, the decoder judges as without it."""
    claim: dict[str, Any] = {"v": PROTOCOL_VERSION}
    if auth is not None:
        claim["tag"] = auth.message_tag(_claim_payload(engine_id, request_id)).hex()
    return claim


def verify_producer_claim(auth: FrameAuth | None, params: dict[str, Any], claim: object) -> bool:
    """Whether `claim` (from the params a producer returned, `params`) says that producer runs
    kvlease. Under a deployment key only a claim sealed to the producer engine and request those
    params name counts: believing a forged one about a stock producer would make the decoder free
    blocks that producer may still WRITE. Without a key the network is trusted (spec, section 7)."""
    if not isinstance(claim, dict) or claim.get("v") != PROTOCOL_VERSION:
        return False
    if auth is None:
        return True
    tag, engine, request = claim.get("tag"), params.get("remote_engine_id"), params.get("remote_request_id")
    if not (isinstance(tag, str) and isinstance(engine, str) and isinstance(request, str)):
        return False
    try:
        raw = bytes.fromhex(tag)
    except ValueError:
        return False
    return auth.check_message_tag(_claim_payload(engine, request), raw)


def _text(name: object) -> str:
    return name.decode() if isinstance(name, bytes) else str(name)


class ConnectorTransport:
    """`Transport` for one worker of a vLLM NIXL connector (see the module docstring)."""

    def __init__(
        self,
        agent: Any,
        engine_id: str,
        rank: int,
        remote_agents: dict[str, dict[tuple[int, int], str]],
        ensure_handshake: Callable[[str], Any],
    ) -> None:
        self._agent = agent
        self._engine_id = engine_id
        self._rank = rank
        #: vLLM's map engine -> {(pp rank, tp rank): agent name} of producers it READs from.
        self._remote_agents = remote_agents
        #: Starts vLLM's handshake with an engine: returns None when done, a Future while pending,
        #: or raises KeyError when the engine's side channel is not known.
        self._ensure_handshake = ensure_handshake
        self._inbound: list[Inbound] = []
        self._handshakes: list[HandshakeEvent] = []
        self._tokens = itertools.count(1)
        self._requests: dict[int, tuple[str, int, bytes]] = {}  # token -> (engine, rank, agent metadata)
        self._peers: dict[tuple[str, int], str] = {}  # accessor (engine, rank) -> loaded agent name
        self._peer_of: dict[str, tuple[str, int]] = {}  # agent name -> (engine, rank)
        self._hellos: dict[str, bytes] = {}  # producer engine -> encoded Handshake waiting for vLLM's handshake
        self._waiting: dict[str, Any] = {}  # producer engine -> vLLM handshake future
        self._handles = itertools.count(1)
        self._expect: str | None = None
        self._external: dict[str, list[int]] = {}  # request key -> handles of its access
        self._notif: dict[str, dict[int, bytes]] = {}  # request key -> pinner rank -> its access-done
        self._done: list[TransferResult] = []
        self.dropped_hellos = 0

    # -- identity ----------------------------------------------------------------------------

    @property
    def engine_id(self) -> str:
        return self._engine_id

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def address(self) -> str:
        return self._engine_id

    # -- fed by the connector ------------------------------------------------------------------

    def feed(self, agent_name: str, data: bytes) -> None:
        """One notification the connector drained from its agent that is not vLLM's own."""
        if data.startswith(HELLO_MAGIC):
            self._on_hello(agent_name, data)
            return
        engine, rank = self._sender(agent_name)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("kvlease notif in from %s (%s rank %d): %d bytes", agent_name, engine, rank, len(data))
        self._inbound.append(Inbound(engine, rank, bytes(data)))

    def _sender(self, agent_name: str) -> tuple[str, int]:
        known = self._peer_of.get(agent_name)
        if known is not None:
            return known
        for engine, agents in self._remote_agents.items():
            for (_pp, tp), name in agents.items():
                if _text(name) == agent_name:
                    self._peer_of[agent_name] = (engine, tp)
                    return engine, tp
        return agent_name, 0  # a peer we hold no agent of (a stock vLLM decoder)

    def _on_hello(self, agent_name: str, data: bytes) -> None:
        try:
            if len(data) > _MAX_HELLO:
                raise ValueError("oversized")
            body = msgpack.unpackb(data[len(HELLO_MAGIC) :], raw=False)
            engine, rank, md, hs = body["e"], body["r"], body["md"], body["hs"]
            if not (isinstance(engine, str) and engine and type(rank) is int and 0 <= rank < 1 << 16):
                raise ValueError("bad identity")
            if not (isinstance(md, bytes) and isinstance(hs, bytes)):
                raise ValueError("bad payload")
        except Exception as exc:  # a malformed hello is dropped, never raised into the step
            self.dropped_hellos += 1
            log.warning("kvlease: dropped a malformed handshake notification from %r: %s", agent_name, exc)
            return
        token = next(self._tokens)
        self._requests[token] = (engine, rank, md)
        self._handshakes.append(HandshakeRequest(token, hs))

    # -- the Transport contract ----------------------------------------------------------------

    def send(self, engine_id: str, rank: int | None, data: bytes) -> None:
        agents = self._agents_of(engine_id, rank)
        if not agents:
            raise PeerUnreachable(engine_id, rank, "no NIXL agent loaded for it")
        for name in agents:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("kvlease notif out to %s (%s rank %s): %d bytes", name, engine_id, rank, len(data))
            t0 = time.perf_counter_ns()
            try:
                self._agent.send_notif(name, notif_msg=data)
            except Exception as exc:
                raise PeerUnreachable(engine_id, rank, f"send_notif: {exc}") from None
            _say_if_slow("send_notif", t0, name)

    def _agents_of(self, engine_id: str, rank: int | None) -> list[str]:
        if rank is not None:
            name = self._peers.get((engine_id, rank))
            if name is None:
                name = self._remote_agents.get(engine_id, {}).get((0, rank))
            return [] if name is None else [name]
        found = [n for (e, _r), n in self._peers.items() if e == engine_id]
        found += [n for (pp, _tp), n in self._remote_agents.get(engine_id, {}).items() if pp == 0]
        return found

    def receive(self) -> list[Inbound]:
        out, self._inbound = self._inbound, []
        return out

    def idle(self) -> bool:
        """Nothing for the driver's next step: no frame fed, handshake event, hello waiting
        for vLLM's handshake, or transfer result."""
        return not (self._inbound or self._handshakes or self._hellos or self._done)

    def progress(self) -> None:
        if self._hellos:
            for engine in list(self._hellos):
                self._try_hello(engine)

    def request_handshake(self, engine_id: str, address: str, data: bytes) -> None:
        self._hellos[engine_id] = data
        self._try_hello(engine_id)

    def _try_hello(self, engine_id: str) -> None:
        data = self._hellos[engine_id]
        agents = self._remote_agents.get(engine_id) or {}
        if not agents:
            fut = self._waiting.get(engine_id)
            if fut is None:
                t0 = time.perf_counter_ns()
                try:
                    fut = self._ensure_handshake(engine_id)
                except KeyError as exc:
                    del self._hellos[engine_id]
                    self._handshakes.append(HandshakeFailed(engine_id, f"no side channel known: {exc}"))
                    return
                _say_if_slow("starting vLLM's handshake", t0, engine_id)
                if fut is None:
                    agents = self._remote_agents.get(engine_id) or {}
                else:
                    self._waiting[engine_id] = fut
            if not agents:
                if fut is not None and fut.done():
                    del self._waiting[engine_id]
                    error = fut.exception()
                    if error is not None:
                        del self._hellos[engine_id]
                        self._handshakes.append(HandshakeFailed(engine_id, f"vLLM handshake failed: {error}"))
                return
        del self._hellos[engine_id]
        self._waiting.pop(engine_id, None)
        t0 = time.perf_counter_ns()
        hello = HELLO_MAGIC + msgpack.packb(
            {"e": self._engine_id, "r": self._rank, "md": self._agent.get_agent_metadata(), "hs": data},
            use_bin_type=True,
        )
        for (pp, _tp), name in agents.items():
            if pp != 0:
                continue
            try:
                self._agent.send_notif(name, notif_msg=hello)
            except Exception as exc:
                self._handshakes.append(HandshakeFailed(engine_id, f"send_notif: {exc}"))
                return
        _say_if_slow("the kvlease hello (agent metadata and send)", t0, engine_id)

    def poll_handshakes(self) -> list[HandshakeEvent]:
        out, self._handshakes = self._handshakes, []
        return out

    def answer_handshake(self, token: int, data: bytes) -> None:
        req = self._requests.pop(token, None)
        if req is None:
            return
        engine, rank, md = req
        name = self._peers.get((engine, rank))
        t0 = time.perf_counter_ns()
        try:
            new_name = self._agent.add_remote_agent(md)
            if isinstance(new_name, bytes):
                new_name = new_name.decode()
        except Exception as exc:
            if name is None:
                raise PeerUnreachable(engine, rank, f"cannot load its agent: {exc}") from None
            new_name = name  # already loaded (the same agent said hello again)
        if name is not None and name != new_name:
            self._peer_of.pop(name, None)
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(name)
        _say_if_slow("loading a kvlease accessor's agent", t0, engine)
        self._peers[(engine, rank)] = new_name
        self._peer_of[new_name] = (engine, rank)
        self.send(engine, rank, data)

    def accessor_engines(self) -> set[str]:
        """Engines whose kvlease accessor said hello to this worker (a pinner) and was answered."""
        return {engine for engine, _rank in self._peers}

    def reject_handshake(self, token: int) -> None:
        self._requests.pop(token, None)

    def register(self, region: str, buffer: object) -> int:
        raise NotImplementedError("vLLM registers its KV cache itself")

    def unregister(self, region: str) -> None:
        raise NotImplementedError("vLLM registers its KV cache itself")

    # -- external accesses ---------------------------------------------------------------------

    def expect(self, key: str | None) -> None:
        """The next `start_read`/`start_write` calls belong to request `key` (None: none)."""
        self._expect = key

    def notifications(self, key: str) -> dict[int, bytes]:
        """The access-done the driver asked to attach to each part of `key`'s transfer, by the
        pinner rank the part reads (protocol v3: each names its rank)."""
        return dict(self._notif.get(key, {}))

    def _start(self, engine_id: str, rank: int, notif: bytes | None) -> int:
        key = self._expect
        if key is None:
            raise RuntimeError("the vLLM adapter performs transfers itself; call expect() first")
        h = next(self._handles)
        self._external.setdefault(key, []).append(h)
        if notif is not None:
            self._notif.setdefault(key, {})[rank] = notif
        return h

    def start_read(self, engine_id: str, rank: int, region: str, into: object, notif: bytes | None) -> int:
        return self._start(engine_id, rank, notif)

    def start_write(self, engine_id: str, rank: int, region: str, src: object, notif: bytes | None) -> int:
        return self._start(engine_id, rank, notif)

    def complete(self, key: str, ok: bool, error: str = "") -> bool:
        """vLLM's transfer for `key` finished (`ok`) or failed; False if none was expected."""
        handles = self._external.pop(key, None)
        self._notif.pop(key, None)
        if handles is None:
            return False
        for h in handles:
            self._done.append(TransferResult(h, ok, "" if ok else (error or "vLLM reported the READ failed")))
        return True

    def outstanding(self, key: str) -> bool:
        return key in self._external

    def poll_transfers(self) -> list[TransferResult]:
        out, self._done = self._done, []
        return out

    def cancel_transfer(self, handle: int) -> None:
        for key, handles in list(self._external.items()):
            if handle in handles:
                handles.remove(handle)
                if not handles:
                    # The driver gave up on it; vLLM's READ may still land: its completion is
                    # then reported for nothing here (the connector treats it as failed).
                    del self._external[key]
                    self._notif.pop(key, None)

    def forget_peer(self, engine_id: str) -> None:
        for (engine, rank), name in list(self._peers.items()):
            if engine == engine_id:
                del self._peers[(engine, rank)]
                self._peer_of.pop(name, None)
                with contextlib.suppress(Exception):
                    self._agent.remove_remote_agent(name)
        self._hellos.pop(engine_id, None)
        self._waiting.pop(engine_id, None)

    def wait(self, timeout: float) -> None:
        return None

    def close(self) -> None:
        self._inbound.clear()
        self._handshakes.clear()


class NotifSwap:
    """vLLM's NIXL agent, except that the notification vLLM attaches to a READ (``"id:count"``)
    is replaced by kvlease's access-done for requests under a kvlease lease.

    A multi-part access (pinner TP > accessor TP) has one access-done per pinner rank (each
    names the rank it is for, protocol v3): the swap picks the part's by the remote rank vLLM
    is posting to, which the worker sets around each post (`for_rank`, per thread: vLLM's push
    writer posts from its own thread) or which the agent's name tells (``send_notif``)."""

    def __init__(self, agent: Any, table: dict[str, dict[int, bytes]], agents: dict[str, dict[Any, str]]) -> None:
        self._kvlease_agent = agent
        self._kvlease_table = table
        self._kvlease_agents = agents  # vLLM's _remote_agents: engine -> {(dcp, rank): agent name}
        self._kvlease_rank = threading.local()

    @contextlib.contextmanager
    def for_rank(self, rank: int) -> Iterator[None]:
        """Posts made inside go to remote rank `rank`."""
        self._kvlease_rank.value = rank
        try:
            yield
        finally:
            self._kvlease_rank.value = None

    def _rank_of(self, agent_name: Any) -> int | None:
        name = agent_name.decode() if isinstance(agent_name, bytes) else str(agent_name)
        for agents in self._kvlease_agents.values():
            for key, known in agents.items():
                if known == name:
                    return int(key[-1]) if isinstance(key, tuple) else int(key)
        return None

    def _swap(self, notif: Any, rank: int | None = None) -> Any:
        if self._kvlease_table and isinstance(notif, bytes | str):
            raw = notif.encode() if isinstance(notif, str) else notif
            rid, sep, _count = raw.rpartition(b":")
            if sep:
                parts = self._kvlease_table.get(rid.decode("utf-8", "replace"))
                if parts:
                    if rank is None:
                        rank = getattr(self._kvlease_rank, "value", None)
                    if rank is not None and rank in parts:
                        return parts[rank]
                    if rank is None and len(parts) == 1:
                        return next(iter(parts.values()))
                    # A rank the access does not target (or an unknown post): never another
                    # rank's access-done, which would free that rank while its part runs.
                    log.warning("kvlease: no access-done for remote rank %s of %r: vLLM's kept", rank, rid)
        return notif

    def make_prepped_xfer(self, *args: Any, **kwargs: Any) -> Any:
        if "notif_msg" in kwargs:
            kwargs["notif_msg"] = self._swap(kwargs["notif_msg"])
        elif len(args) >= 6:
            args = (*args[:5], self._swap(args[5]), *args[6:])
        return self._kvlease_agent.make_prepped_xfer(*args, **kwargs)

    def send_raw(self, agent_name: Any, data: bytes) -> None:
        """A notification of kvlease's own, sent as it is (never swapped)."""
        self._kvlease_agent.send_notif(agent_name, notif_msg=data)

    def send_notif(self, agent_name: Any, notif_msg: Any = b"", *args: Any, **kwargs: Any) -> Any:
        rank = getattr(self._kvlease_rank, "value", None)
        if rank is None:
            rank = self._rank_of(agent_name)
        return self._kvlease_agent.send_notif(agent_name, self._swap(notif_msg, rank), *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kvlease_agent, name)
