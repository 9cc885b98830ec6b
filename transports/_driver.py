"""`Driver`: the one thin shell that pumps the kvlease core over a `Transport`.

The driver owns the clock (an injected ``clock`` callable, `time.monotonic` by default; it is
the only place in kvlease that reads one), feeds what the transport received into the core's
`Pinner` and/or `Accessor` (a worker may be both), dispatches the core's outputs (sends to the
transport; frees, losses, completions, stale accesses and rejections to the engine) and re-arms
from the cores' ``next_deadline()``. It contains no protocol logic: every decision about a lease
is the core's. It must never block, never raise into the engine loop because of what a peer
sent, and never let one lease's or one peer's trouble affect another.

Two ways to drive it:

1. **From an engine's forward loop**: call `step()` once per iteration. It drains the side
   channel and the transport, completes transfers, runs the cores' timers, checks peer liveness
   and calls the transport's `progress()`; it returns the engine-facing events of that step
   (plus those produced by calls such as `grant`/`track` since the previous step). No thread.
2. **As an asyncio service** (`await driver.run(stop)`), for standalone processes: the same
   step, then sleep until the next deadline or until the transport has input. A `Pollable`
   transport (ZMQ) is awaited on its file descriptors, so an idle driver costs next to nothing
   however many leases it holds; any other transport (NIXL, whose notifications can only be
   polled) is stepped every ``poll_interval``. Events go to the ``on_event`` callback.

Input from the wire is judged here: undecodable bytes (`DecodeError`), messages the core finds
protocol-breaking (`RemoteProtocolError`) and `Rejected` outputs are counted in `TransportStats`,
logged at WARNING at most once per peer per ``log_interval``, and dropped.

Peer liveness (hints only; safety never rests on it): a send that raises `PeerUnreachable`, a
failed handshake, or traffic sent to an engine that stays unanswered marks it *suspect*
(`PeerSuspect`, once per streak). An engine that stays silent for ``engine_ttl`` after that is
declared dead: `Accessor.disconnect` reports its remaining leases lost, the transport forgets it
(`PeerDead`), and a later handshake (e.g. after a restart with a new incarnation) brings it
back. Transfers that overrun ``transfer_timeout`` are cancelled and reported `TransferFailed`,
so an access to a dead pinner can never hang the engine.

The access-done rides on the transfer: the driver passes the core's
`AccessDecision.notification_for(rank)`, encoded, as the transfer's notification to every pinner rank the
decision targets (NIXL: the notification of the prepped READ/WRITE, delivered only after the
data landed; ZMQ: the next frame in the same ordered stream, after the data landed), and then
calls `Accessor.access_finished(..., notified=True)`, which sends a separate access-done only
when a confirmation is still needed that the attached one did not ask for. An access made of
several transfers (heterogeneous TP: one per pinner rank) attaches it to every part, so each
pinner rank frees once its own part landed. If a posted access fails, the core gives the lease up
(`LeaseLost(access_failed)`): a cancelled part may still land with its notification, so a retry
under the same lease could read a rank that already freed. Completed transfers
are handled *before* the inbound frames of the same step, so the pinner's answer to an attached
notification (an `AccessDoneAck`) always finds the access finished.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, assert_never

import attrs

from kvlease import (
    AccessCompleted,
    AccessDecision,
    AccessDone,
    AccessDoneAck,
    Accessor,
    AccessStale,
    ConfigError,
    DecodeError,
    EncodeError,
    EndReason,
    FrameAuth,
    Free,
    Handshake,
    HandshakeNeeded,
    HandshakeReply,
    Heartbeat,
    HeartbeatAck,
    LeaseConfig,
    LeaseKind,
    LeaseLost,
    LeaseTicket,
    LocalProtocolError,
    LocalTime,
    Message,
    Output,
    Pinner,
    ProtocolError,
    Rejected,
    Release,
    Send,
    VllmAccessDone,
    VllmHeartbeat,
    decode,
    decode_vllm,
    encode,
    is_native_frame,
    is_sealed_frame,
)

from ._base import (
    HandshakeFailed,
    HandshakeRequest,
    HandshakeResponse,
    Inbound,
    PeerDead,
    PeerSuspect,
    PeerUnreachable,
    Pollable,
    TransferFailed,
    Transport,
)
from ._stats import TransportStats

__all__ = ["Driver", "DriverEvent"]

logger = logging.getLogger("kvlease.transports")

#: What `step()` hands to the engine.
DriverEvent = Free | LeaseLost | AccessCompleted | AccessStale | Rejected | PeerSuspect | PeerDead | TransferFailed

_LOG_PEERS_MAX = 1024  # bound on the per-peer log limiter (hostile peers invent names)


def load_frame_auth(config: LeaseConfig) -> FrameAuth | None:
    """The deployment key(s) named by ``config.auth_keys`` (None when authentication is off).

    Each source is ``env:VARIABLE`` or ``file:PATH`` holding the key as hex (at least 32 hex
    digits, i.e. 128 bits; whitespace ignored). A missing variable or file, or a value that is
    not such a key, is a `ConfigError` naming ``auth_keys`` and the source, never the key."""
    if not config.auth_keys:
        return None
    keys: list[bytes] = []
    for source in config.auth_keys:
        kind, _, name = source.partition(":")
        if kind == "env":
            text = os.environ.get(name)
            if text is None:
                raise ConfigError("auth_keys", config.auth_keys, f"a set environment variable ({name!r} is not set)")
        else:
            try:
                with open(name, encoding="ascii") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError("auth_keys", config.auth_keys, f"a readable key file ({name!r}: {exc})") from None
        hex_text = "".join(text.split())
        try:
            key = bytes.fromhex(hex_text)
        except ValueError:
            key = b""
        if not 16 <= len(key) <= 64:
            raise ConfigError(
                "auth_keys", config.auth_keys, f"a key of 32 to 128 hex digits in {source!r} (the value is not shown)"
            )
        keys.append(key)
    return FrameAuth(keys)


def new_session() -> int:
    """A fresh accessor session (or pinner incarnation): 64 random bits from the OS. Each
    process start must use a new one; the core takes it as a parameter because it never
    reads randomness itself."""
    return secrets.randbits(64)


@attrs.define
class _Access:
    key: str
    engine_id: str
    handles: set[int]
    started: float
    nbytes: int = 0
    failed: str = ""
    notified: bool = False  # the access-done rode on the transfer
    landed: int = 0  # parts that completed (their pinner ranks have the access-done)
    posted: int = 0  # parts handed to the transport (their notification may land)


@attrs.define
class _Peer:
    engine_id: str
    #: The driver's engines with something unanswered (this one among them while it is): the
    #: liveness check and `next_deadline` look at those only, not at every engine ever heard.
    unanswered: dict[str, _Peer]
    #: Since when something we sent (or failed to send) to this engine is unanswered.
    unanswered_since: float | None = None
    reported: bool = False

    def heard(self) -> None:
        if self.unanswered_since is not None:
            self.unanswered.pop(self.engine_id, None)
        self.unanswered_since = None
        self.reported = False

    def sent(self, now: float) -> None:
        if self.unanswered_since is None:
            self.unanswered[self.engine_id] = self
            self.unanswered_since = now


class Driver:
    """Pumps a `Pinner` and/or an `Accessor` of one engine worker over one `Transport`."""

    def __init__(
        self,
        transport: Transport,
        *,
        pinner: Pinner | None = None,
        accessor: Accessor | None = None,
        clock: Callable[[], float] = time.monotonic,
        engine_ttl: float | None = None,
        transfer_timeout: float | None = None,
        vllm_compat: bool = False,
        stats: TransportStats | None = None,
        log_interval: float = 10.0,
        on_event: Callable[[DriverEvent], None] | None = None,
    ) -> None:
        if pinner is None and accessor is None:
            raise LocalProtocolError("a driver needs a pinner, an accessor, or both")
        config = (pinner or accessor).config  # type: ignore[union-attr]
        #: Seals what this driver sends and opens what it receives (None: authentication off).
        #: Loaded at start-up, so a missing or bad key fails here, naming the setting.
        self._auth = load_frame_auth(config)
        self.transport = transport
        self.pinner = pinner
        self.accessor = accessor
        self.config = config
        self.stats = stats if stats is not None else TransportStats()
        self._clock = clock
        #: Longer than the extension plus an interval, so the core reports a dead pinner's
        #: leases lost (validity lapsed) before the driver tears the peer down.
        self.engine_ttl = config.kv_lease_duration if engine_ttl is None else engine_ttl
        self.transfer_timeout = (
            config.access_time_local + config.heartbeat_interval if transfer_timeout is None else transfer_timeout
        )
        self.vllm_compat = vllm_compat
        self.log_interval = log_interval
        self.on_event = on_event
        self._pending: list[DriverEvent] = []
        self._addresses: dict[str, str] = {}
        self._peers: dict[str, _Peer] = {}
        self._unanswered: dict[str, _Peer] = {}  # the peers with unanswered_since set
        self._accesses: dict[str, _Access] = {}
        self._handles: dict[int, str] = {}  # transfer handle -> key
        self._pinned: dict[int, int] = {}  # lease id -> bytes
        self._log_last: dict[str, float] = {}
        self._log_suppressed: dict[str, int] = {}
        self._renewed_seen = 0
        self._missing_seen = 0
        self._last_now = float("-inf")
        self._busy = False  # the last step had input or transfers in flight (for run's backoff)
        #: Set while `run` sleeps: wakes it (thread-safe) when the engine calls the driver.
        self._waker: Callable[[], object] | None = None
        #: Counts what can bring work forward: every engine call, every output dispatched and
        #: every step that had input. While it stands, `idle_until` said before stays true.
        self.changes = 0

    # -- time -------------------------------------------------------------------------------

    def now(self) -> LocalTime:
        """The injected clock, clamped so the cores never see time run backwards."""
        t = self._clock()
        if t < self._last_now:
            t = self._last_now
        self._last_now = t
        return LocalTime(t)

    def next_deadline(self) -> LocalTime | None:
        """The earliest instant at which `step` has timer work (inbound frames aside)."""
        best = float("inf")
        for core in (self.pinner, self.accessor):
            if core is not None:
                d = core.next_deadline()
                if d is not None and d < best:
                    best = d
        if self._accesses:
            best = min(best, min(a.started for a in self._accesses.values()) + self.transfer_timeout)
        for p in self._unanswered.values():  # the liveness check: an unanswered peer's engine TTL
            if p.unanswered_since is not None and p.unanswered_since + self.engine_ttl < best:
                best = p.unanswered_since + self.engine_ttl
        return None if best == float("inf") else LocalTime(best)

    def idle_until(self) -> float:
        """Until when `step` has nothing to do as things stand (+inf: no timer at all; -inf:
        work now, a transfer in flight or an event not yet returned). It holds while
        `changes` stands and the transport brings no input: an engine's step loop that checks
        both may skip a step before this instant, and lose nothing."""
        if self._accesses or self._pending:
            return float("-inf")
        d = self.next_deadline()
        return float("inf") if d is None else d

    # -- pinner side ------------------------------------------------------------------------

    def grant(
        self,
        key: str,
        *,
        nbytes: int = 0,
        push: bool = False,
        kind: LeaseKind = LeaseKind.RENEWABLE,
        expected: int | None = None,
        ttl: float | None = None,
        lease_id: int | None = None,
        accessor: str | None = None,
    ) -> LeaseTicket:
        """Pin `key`'s memory (`nbytes`, for the bytes-pinned gauge) under a new lease;
        `accessor`: the accessor engine, when the router already picked it (see `Pinner.grant`)."""
        pinner = self._need_pinner()
        ticket = pinner.grant(
            self.now(), key, kind=kind, push=push, expected=expected, ttl=ttl, lease_id=lease_id, accessor=accessor
        )
        self.stats.leases_granted += 1
        self._poke()
        if nbytes:
            self._pinned[ticket.lease_id] = nbytes
            self.stats.bytes_pinned += nbytes
        return ticket

    def release(self, lease_id: int) -> None:
        """The local engine aborts a request it pinned; its `Free` comes out of `step`."""
        pinner = self._need_pinner()
        now = self.now()
        self._dispatch(now, pinner.release(now, lease_id))

    # -- accessor side ----------------------------------------------------------------------

    def add_peer(self, engine_id: str, address: str) -> None:
        """Where `engine_id`'s side channel (rank 0) listens."""
        self._addresses[engine_id] = address

    def connect(self, engine_id: str, address: str) -> None:
        """Proactive handshake with a pinner engine before any request names it, so the first
        heartbeat and transfer do not wait for it (the side channel may run in background)."""
        accessor = self._need_accessor()
        self._addresses[engine_id] = address
        if accessor.is_connected(engine_id):
            return
        now = self.now()
        self._dispatch(now, (accessor.handshake(now, engine_id),))

    def track(self, key: str, ticket: LeaseTicket, *, address: str | None = None, push: bool = False) -> None:
        """Start heartbeating for a request the moment it enters the scheduler. `address` is
        the pinner engine's side channel (needed once per engine)."""
        accessor = self._need_accessor()
        if address is not None:
            self._addresses[ticket.engine_id] = address
        now = self.now()
        self._dispatch(now, accessor.track(now, key, ticket, push=push))

    def untrack(self, key: str) -> None:
        """The request finished or was aborted before its access; the pinner may free."""
        accessor = self._need_accessor()
        now = self.now()
        self._dispatch(now, accessor.untrack(now, key))

    def read(self, key: str, region: str, into: object | Mapping[int, object]) -> AccessDecision:
        """Pull: READ the pinner's `region` into `into`, if the core allows, from every pinner
        rank the core targets. `into` is one buffer (one target rank: equal TP, or accessor TP
        larger than the pinner's) or a mapping of pinner rank to buffer (pinner TP larger: one
        READ per pinner worker). The access-done rides on each READ."""
        return self._access(key, region, into, write=False)

    def write(self, key: str, region: str, src: object | Mapping[int, object]) -> AccessDecision:
        """Push: WRITE `src` into the pinner's `region` on every target rank (a mapping of
        pinner rank to buffer when there are several), if the core allows."""
        return self._access(key, region, src, write=True)

    def read_parts(self, key: str, parts: Sequence[tuple[int, str, object]]) -> AccessDecision:
        """One access made of several READs, `(pinner rank, region, buffer)` each; the ranks
        must be exactly the ones the core targets (`AccessDecision.targets`)."""
        return self._access(key, "", {rank: (region, buf) for rank, region, buf in parts}, write=False, parts=True)

    def _access(self, key: str, region: str, bufs: object, *, write: bool, parts: bool = False) -> AccessDecision:
        accessor = self._need_accessor()
        if key in self._accesses:
            return AccessDecision(False, False, None, "an access is already in flight")
        now = self.now()
        decision = accessor.begin_access(now, key)
        if not decision.allowed:
            return decision
        engine_id = decision.engine_id  # the core says where the access goes
        # Which buffer goes to which pinner rank: checked before anything starts, so a
        # caller's mistake leaves the lease as it was (misuse raises, as in the core).
        plan: list[tuple[int, str, object]] = []
        if isinstance(bufs, Mapping):
            if set(bufs) != set(decision.targets):
                accessor.access_failed(now, key, posted=False)
                raise LocalProtocolError(
                    f"buffers given for pinner ranks {sorted(bufs)}, the access targets {list(decision.targets)}"
                )
            for r in decision.targets:
                item = bufs[r]
                plan.append((r, *item) if parts else (r, region, item))
        elif len(decision.targets) == 1:
            plan.append((decision.targets[0], region, bufs))
        else:
            accessor.access_failed(now, key, posted=False)
            raise LocalProtocolError(
                f"the access targets pinner ranks {list(decision.targets)}: pass one buffer per rank"
            )
        # Attached to every part, each part its own rank's: each pinner rank hears the
        # access-done only after its part landed (and the core knows that a rank answering
        # "completed" mid-access heard ours); one delivered to a sibling rank counts nothing.
        notifs = {r: self._wire(decision.notification_for(r)) for r, _reg, _buf in plan}
        acc = _Access(key, engine_id, set(), now, notified=True)
        self._accesses[key] = acc
        for rank, reg, buf in plan:
            notif = notifs[rank]
            try:
                if write:
                    h = self.transport.start_write(engine_id, rank, reg, buf, notif)
                else:
                    h = self.transport.start_read(engine_id, rank, reg, buf, notif)
            except PeerUnreachable as exc:
                self._suspect(now, exc.engine_id, exc.rank, exc.reason)
                acc.failed = exc.reason
                continue
            except Exception as exc:  # a transport bug or bad buffer must not wedge the lease
                acc.failed = f"{type(exc).__name__}: {exc}"
                continue
            acc.handles.add(h)
            acc.posted += 1
            self._handles[h] = key
            self._peer(engine_id).sent(now)
        if not acc.handles:
            self._finish_access(now, acc)
        self._poke()
        return decision

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[DriverEvent]:
        """One non-blocking round: receive, side channel, inbound, transfers, timers,
        liveness, progress. Returns the events for the engine (also passed to ``on_event``)."""
        now = self.now()
        tr = self.transport
        inbound_frames = tr.receive()  # first: a transport may fill the other queues here
        handshakes = tr.poll_handshakes()
        self._busy = bool(inbound_frames or handshakes or self._accesses)
        if inbound_frames or handshakes:
            self.changes += 1
        for hev in handshakes:
            match hev:
                case HandshakeRequest():
                    self._answer_handshake(now, hev)
                case HandshakeResponse():
                    self._peer(hev.engine_id).heard()
                    self._on_frame(now, hev.engine_id, hev.data)
                case HandshakeFailed():
                    self._suspect(now, hev.engine_id, 0, f"handshake failed: {hev.reason}")
                case _:
                    assert_never(hev)
        # Transfers first: every access whose attached access-done has gone out is finished
        # before the pinner's answer to it (in these frames or later) is handled.
        self._poll_transfers(now)
        for inbound in inbound_frames:
            self._on_inbound(now, inbound)
        if self.pinner is not None:
            d = self.pinner.next_deadline()
            if d is not None and d <= now:
                self._dispatch(now, self.pinner.handle_timeout(now))
            c = self.pinner.counters
            if c.renewed != self._renewed_seen or c.heartbeat_ids_missing != self._missing_seen:
                self.stats.leases_renewed += c.renewed - self._renewed_seen
                self.stats.heartbeats_rejected += c.heartbeat_ids_missing - self._missing_seen
                self._renewed_seen, self._missing_seen = c.renewed, c.heartbeat_ids_missing
        if self.accessor is not None:
            d = self.accessor.next_deadline()
            if d is not None and d <= now:
                self._dispatch(now, self.accessor.handle_timeout(now))
        if self._unanswered:
            self._check_liveness(now)
        tr.progress()
        events, self._pending = self._pending, []
        if self.on_event is not None:
            self._deliver(events, self.on_event)
        return events

    @staticmethod
    def _deliver(events: list[DriverEvent], on_event: Callable[[DriverEvent], None]) -> None:
        """Every event reaches the callback even if it raises for one of them; the first
        exception is raised after the last event was delivered (the engine's bug is not
        hidden, and no Free or LeaseLost is lost behind it)."""
        first: BaseException | None = None
        for ev in events:
            try:
                on_event(ev)
            except Exception as exc:
                logger.exception("kvlease on_event raised for %r; delivering the rest of this step's events", ev)
                first = first or exc
        if first is not None:
            raise first

    async def run(
        self,
        stop: asyncio.Event | None = None,
        *,
        poll_interval: float = 0.001,
        max_poll_interval: float = 0.05,
        max_wait: float = 1.0,
    ) -> None:
        """Serve until `stop` is set: step, then sleep until the next deadline or until the
        transport has input. A `Pollable` transport is awaited on its descriptors (at most
        `max_wait` at a time, a safety net). Any other one is polled: every `poll_interval`
        while there is traffic, backing off by doubling to `max_poll_interval` while idle (the
        first frame after a quiet spell waits at most that long; no deadline is ever late)."""
        if not (0 < poll_interval <= max_poll_interval and max_wait > 0):
            raise LocalProtocolError(
                "run() needs 0 < poll_interval <= max_poll_interval and max_wait > 0 "
                f"(got {poll_interval}, {max_poll_interval}, {max_wait})"
            )
        interval = poll_interval
        loop = asyncio.get_running_loop()
        tr = self.transport
        pollable = tr if isinstance(tr, Pollable) else None
        stopping = asyncio.ensure_future(stop.wait()) if stop is not None else None
        try:
            while stop is None or not stop.is_set():
                self.step()
                interval = poll_interval if self._busy else min(2 * interval, max_poll_interval)
                d = self.next_deadline()
                delay = max_wait if pollable is not None else interval
                if d is not None:
                    delay = max(0.0, min(delay, d - self.now()))
                if delay <= 0.0 or (pollable is not None and pollable.ready()):
                    await asyncio.sleep(0)  # work now; let the rest of the loop run first
                else:
                    fds = list(pollable.wait_fds()) if pollable is not None else []
                    await self._sleep(loop, fds, delay, stopping)
        finally:
            if stopping is not None:
                stopping.cancel()

    async def _sleep(
        self, loop: asyncio.AbstractEventLoop, fds: list[int], delay: float, stopping: asyncio.Future[Any] | None
    ) -> None:
        """Sleep up to `delay`, until one of `fds` is readable, `stopping` is done, or the
        engine calls the driver (a grant, track, read, ... may bring a deadline forward or open
        a socket this sleep does not watch)."""
        woken: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not woken.done():
                woken.set_result(None)

        for fd in fds:
            loop.add_reader(fd, wake)
        self._waker = lambda: loop.call_soon_threadsafe(wake)
        try:
            waits: set[asyncio.Future[Any]] = {woken} if stopping is None else {woken, stopping}
            await asyncio.wait(waits, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._waker = None
            for fd in fds:
                loop.remove_reader(fd)
            woken.cancel()

    serve_forever = run

    def close(self) -> None:
        self.transport.close()

    # -- the wire ---------------------------------------------------------------------------

    def _wire(self, msg: Message) -> bytes:
        """A message as the bytes that travel: encoded, and sealed when a key is configured."""
        data = encode(msg)
        return data if self._auth is None else self._auth.seal(data)

    def _unwire(self, data: bytes) -> Message:
        """The message in `data`; with a key, only a frame sealed with it (checked before
        anything past the magic is decoded). Raises `DecodeError`."""
        if self._auth is not None:
            return decode(self._auth.open(data))
        if is_sealed_frame(data):
            raise DecodeError(
                "authentication failed: a sealed frame, but no key is configured (auth_keys)", category="auth"
            )
        return decode(data)

    def _refused(self, now: LocalTime, peer: str, exc: DecodeError) -> None:
        if exc.category == "auth":
            self.stats.unauthenticated_messages += 1
            self._log(now, peer, f"dropped unauthenticated input: {exc}")
        else:
            self._malformed(now, peer, str(exc))

    # -- inbound ----------------------------------------------------------------------------

    def _on_inbound(self, now: LocalTime, inbound: Inbound) -> None:
        self._peer(inbound.engine_id).heard()
        self._on_frame(now, inbound.engine_id, inbound.data)

    def _on_frame(self, now: LocalTime, peer: str, data: bytes) -> None:
        if is_native_frame(data) or is_sealed_frame(data):
            try:
                msg = self._unwire(data)
            except DecodeError as exc:
                self._refused(now, peer, exc)
                return
            self._on_message(now, peer, msg)
        elif self.vllm_compat and self.pinner is not None:
            if self._auth is not None and not self.config.auth_allow_vllm_compat:
                self.stats.unauthenticated_messages += 1
                self._log(
                    now,
                    peer,
                    "dropped a vLLM notification: it cannot be authenticated (set auth_allow_vllm_compat to accept it)",
                )
                return
            self._on_vllm(now, peer, data)
        else:
            self._malformed(now, peer, f"not a kvlease frame ({len(data)} bytes, starts {data[:8]!r})")

    def _on_message(self, now: LocalTime, peer: str, msg: Message) -> None:
        try:
            match msg:
                case Heartbeat() | AccessDone() | Release() | Handshake():
                    if self.pinner is None:
                        self._malformed(now, peer, f"{type(msg).__name__} sent to an engine with no pinner")
                        return
                    if isinstance(msg, Heartbeat):
                        self.stats.heartbeats_received += 1
                    outs: tuple[Output, ...] = self.pinner.receive(now, msg)
                case HeartbeatAck() | AccessDoneAck() | HandshakeReply():
                    if self.accessor is None:
                        self._malformed(now, peer, f"{type(msg).__name__} sent to an engine with no accessor")
                        return
                    if isinstance(msg, HeartbeatAck):
                        self.stats.heartbeat_acks_received += 1
                        if msg.rank == 0 and msg.t_echo <= now:
                            # Only a round trip of a heartbeat we sent; a forged echo skews
                            # the figure but never the protocol (the core checks the echo).
                            self.stats.record_rtt(now - msg.t_echo)
                    outs = self.accessor.receive(now, msg)
                case _:
                    assert_never(msg)
        except ProtocolError as exc:
            self._malformed(now, peer, f"{type(exc).__name__}: {exc}")
            return
        self._dispatch(now, outs)

    def _on_vllm(self, now: LocalTime, peer: str, data: bytes) -> None:
        assert self.pinner is not None
        try:
            note = decode_vllm(data)
            match note:
                case VllmHeartbeat():
                    self.stats.heartbeats_received += 1
                    self.pinner.receive_vllm_heartbeat(now, note.request_ids)
                case VllmAccessDone():
                    self._dispatch(now, self.pinner.receive_vllm_done(now, note.request_id, note.count))
                case _:
                    assert_never(note)
        except (DecodeError, ProtocolError) as exc:
            self._malformed(now, peer, str(exc))

    def _answer_handshake(self, now: LocalTime, req: HandshakeRequest) -> None:
        if self.pinner is None:
            self._malformed(now, "?", "handshake request to an engine with no pinner")
            return
        try:
            hs = self._unwire(req.data)
        except DecodeError as exc:
            self._refused(now, "?", exc)
            self.transport.reject_handshake(req.token)
            return
        if not isinstance(hs, Handshake):
            self._malformed(now, "?", f"side channel carried a {type(hs).__name__}, expected a Handshake")
            self.transport.reject_handshake(req.token)
            return
        self._peer(hs.engine_id).heard()
        reply = self.pinner.handshake_reply(now, hs)
        try:
            self.transport.answer_handshake(req.token, self._wire(reply))
        except PeerUnreachable as exc:
            self._suspect(now, hs.engine_id, hs.rank, exc.reason)
            return
        self.stats.handshakes_answered += 1

    # -- outputs ----------------------------------------------------------------------------

    def _poke(self) -> None:
        """An engine call while `run` sleeps: wake it to re-plan (deadlines, sockets)."""
        self.changes += 1
        waker = self._waker
        if waker is not None:
            waker()

    def _dispatch(self, now: LocalTime, outputs: tuple[Output, ...]) -> None:
        self._poke()
        stats = self.stats
        for out in outputs:
            match out:
                case Send():
                    msg = out.message
                    if isinstance(msg, Heartbeat):
                        stats.heartbeats_sent += 1
                    # Only these are answered, so only these can show a peer is silent.
                    answered = isinstance(msg, Heartbeat) or (isinstance(msg, AccessDone) and msg.confirm)
                    try:
                        data = self._wire(msg)
                    except EncodeError as exc:
                        # The core builds nothing the wire cannot carry; should it ever, the
                        # message is dropped (a lost message, which the protocol survives)
                        # rather than raised into the engine's step.
                        stats.rejected_messages += 1
                        self._log(now, out.engine_id, f"dropped an unencodable {type(msg).__name__}: {exc}")
                        continue
                    self._send(now, out.engine_id, out.rank, data, expect_reply=answered)
                case Free():
                    if out.reason is EndReason.EXPIRED:
                        stats.leases_expired += 1
                    elif out.reason is EndReason.RELEASED:
                        stats.leases_released += 1
                    else:
                        stats.leases_completed += 1
                    stats.bytes_pinned -= self._pinned.pop(out.lease_id, 0)
                    self._pending.append(out)
                case HandshakeNeeded():
                    self._request_handshake(now, out.engine_id, out.message)
                case LeaseLost():
                    stats.leases_lost += 1
                    self._pending.append(out)
                case AccessCompleted():
                    stats.accesses_completed += 1
                    if out.confirmed_by_pinner:
                        stats.accesses_confirmed += 1
                    self._pending.append(out)
                case AccessStale():
                    stats.stale_reads_caught += 1
                    self._pending.append(out)
                case Rejected():
                    stats.rejected_messages += 1
                    self._log(now, out.engine_id, f"rejected: {out.reason}")
                    self._pending.append(out)
                case _:
                    assert_never(out)

    def _send(self, now: LocalTime, engine_id: str, rank: int | None, data: bytes, *, expect_reply: bool) -> None:
        try:
            self.transport.send(engine_id, rank, data)
        except PeerUnreachable as exc:
            self._suspect(now, engine_id, rank, exc.reason)
            return
        if expect_reply:
            self._peer(engine_id).sent(now)

    def _request_handshake(self, now: LocalTime, engine_id: str, hs: Handshake) -> None:
        address = self._addresses.get(engine_id)
        if address is None:
            self._suspect(now, engine_id, 0, "no side-channel address known (pass address= to track)")
            return
        try:
            self.transport.request_handshake(engine_id, address, self._wire(hs))
        except PeerUnreachable as exc:
            self._suspect(now, engine_id, 0, exc.reason)
            return
        self.stats.handshakes_sent += 1
        self._peer(engine_id).sent(now)

    # -- transfers --------------------------------------------------------------------------

    def _poll_transfers(self, now: LocalTime) -> None:
        for res in self.transport.poll_transfers():
            key = self._handles.pop(res.handle, None)
            acc = None if key is None else self._accesses.get(key)
            if acc is None:
                continue  # cancelled or unknown
            acc.handles.discard(res.handle)
            if res.ok:
                acc.landed += 1
                self.stats.transfers_ok += 1
                self.stats.bytes_transferred += res.nbytes
                self._peer(acc.engine_id).heard()
            else:
                self.stats.transfers_failed += 1
                acc.failed = acc.failed or res.error or "transfer failed"
            if not acc.handles:
                self._finish_access(now, acc)
        if self._accesses:
            for acc in list(self._accesses.values()):
                if now - acc.started >= self.transfer_timeout:
                    for h in acc.handles:
                        self.transport.cancel_transfer(h)
                        self._handles.pop(h, None)
                    acc.handles.clear()
                    acc.failed = acc.failed or f"transfer did not finish within {self.transfer_timeout:.3g} s"
                    self.stats.transfers_failed += 1
                    self._finish_access(now, acc)

    def _finish_access(self, now: LocalTime, acc: _Access) -> None:
        assert self.accessor is not None
        del self._accesses[acc.key]
        if acc.failed:
            # A posted part's notification may still land (a cancel races the completion), so
            # the core gives the lease up then; only an access nothing of which was posted
            # may be retried under the same lease.
            self._dispatch(now, self.accessor.access_failed(now, acc.key, posted=acc.posted > 0))
            if acc.posted:
                acc.failed += f" ({acc.posted} part(s) posted, {acc.landed} landed: lease given up, recompute)"
            self._pending.append(TransferFailed(acc.key, acc.failed))
        else:
            self._dispatch(now, self.accessor.access_finished(now, acc.key, notified=acc.notified))

    # -- liveness ---------------------------------------------------------------------------

    def _peer(self, engine_id: str) -> _Peer:
        p = self._peers.get(engine_id)
        if p is None:
            if len(self._peers) >= _LOG_PEERS_MAX * 4:
                # Bound the table against invented names: drop peers that are healthy.
                for k in [k for k, v in self._peers.items() if v.unanswered_since is None][:_LOG_PEERS_MAX]:
                    del self._peers[k]
            p = self._peers[engine_id] = _Peer(engine_id, self._unanswered)
        return p

    def _suspect(self, now: LocalTime, engine_id: str, rank: int | None, reason: str) -> None:
        self.stats.peer_send_failures += 1
        p = self._peer(engine_id)
        p.sent(now)
        if not p.reported:
            p.reported = True
            self._log(now, engine_id, f"peer unreachable: {reason}")
            self._pending.append(PeerSuspect(engine_id, rank, reason))

    def _check_liveness(self, now: LocalTime) -> None:
        ttl = self.engine_ttl
        dead = [
            e for e, p in self._unanswered.items() if p.unanswered_since is not None and now - p.unanswered_since >= ttl
        ]
        for engine_id in dead:
            del self._peers[engine_id]
            del self._unanswered[engine_id]
            self.stats.peers_dead += 1
            self._log(now, engine_id, f"peer silent for {ttl:.3g} s: disconnected")
            for acc in list(self._accesses.values()):
                if acc.engine_id == engine_id:
                    for h in acc.handles:
                        self.transport.cancel_transfer(h)
                        self._handles.pop(h, None)
                    acc.handles.clear()
                    acc.failed = "peer declared dead"
                    self._finish_access(now, acc)
            if self.accessor is not None:
                self._dispatch(now, self.accessor.disconnect(now, engine_id))
            self.transport.forget_peer(engine_id)
            self._pending.append(PeerDead(engine_id))

    # -- judging input ----------------------------------------------------------------------

    def _malformed(self, now: LocalTime, peer: str, what: str) -> None:
        self.stats.malformed_messages += 1
        self._log(now, peer, f"dropped malformed input: {what}")

    def _log(self, now: LocalTime, peer: str, what: str) -> None:
        last = self._log_last.get(peer)
        if last is not None and now - last < self.log_interval:
            self._log_suppressed[peer] = self._log_suppressed.get(peer, 0) + 1
            return
        if len(self._log_last) >= _LOG_PEERS_MAX:
            self._log_last.clear()
            self._log_suppressed.clear()
        self._log_last[peer] = now
        more = self._log_suppressed.pop(peer, 0)
        suffix = f" (+{more} similar suppressed)" if more else ""
        logger.warning("kvlease peer %r: %.300s%s", peer, what, suffix)

    # -- misuse -----------------------------------------------------------------------------

    def _need_pinner(self) -> Pinner:
        if self.pinner is None:
            raise LocalProtocolError("this driver has no pinner")
        return self.pinner

    def _need_accessor(self) -> Accessor:
        if self.accessor is None:
            raise LocalProtocolError("this driver has no accessor")
        return self.accessor
