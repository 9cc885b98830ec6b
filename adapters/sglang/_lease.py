"""`LeaseRuntime`: one SGLang KV manager's (one rank's) kvlease pinner + accessor, pumped by
`kvlease.transports.Driver` from a thread of its own.

SGLang calls into its KV manager from several threads (the scheduler, the prefill's transfer
workers, the bootstrap/listener thread); the core is single-threaded. Every call into the driver
therefore happens under one lock, held only for the call. Events the driver produces are handed to
the manager's callback *after* the lock is released, so the manager may take its own locks.

Leases (one rank of each side is one kvlease engine, so every lease is 1:1; a room that several
prefill ranks write, or that one prefill rank writes to several decode ranks, gets one lease per
pair):

- destination lease ``d:<room>:<engine>`` — pinner: the decode, push mode, granted when it sends
  its metadata, its ticket sealed to the room, both ranks and the destination pages; accessor: the
  prefill rank that WRITEs, tracking from the moment the ticket arrives;
- source lease ``s:<room>`` — pinner: the prefill, granted when its sender is created; accessor:
  the decode, tracking from the moment it admits the request (before its memory wait).

The prefill's WRITEs to a decode rank are **one access** of that rank's destination lease, from
the room's first WRITE (of any chunk) to the end of its last: `gate` begins it (the core's push
guard) before the first WRITE is posted and checks the validity window again before every later
one; `settle` reports each chunk's WRITEs settled; the access ends when the room concludes and
nothing of it is in flight — with the access-done if every WRITE settled DONE (the decode frees
at once), else as a *posted* failure (the decode keeps the pages to expiry plus the push guard,
because a WRITE whose outcome is unknown may still land). Nothing gives an access up by a clock:
SGLang awaits its WRITEs without a bound and the plugin cannot cancel them, so the lease is
heartbeated for as long as one runs (a WRITE past the access-time bound is logged and counted).
"""

from __future__ import annotations

import collections
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import msgpack
from kvlease.transports import (
    Driver,
    DriverEvent,
    TransferFailed,
    TransportStats,
    load_frame_auth,
    new_session,
)

from kvlease import (
    AccessCompleted,
    Accessor,
    AccessStale,
    EndReason,
    Free,
    LeaseLost,
    LeaseState,
    LeaseTicket,
    LocalTime,
    Pinner,
    RemoteProtocolError,
    TrackedState,
)

from ._settings import Settings
from ._transport import SglangZmqTransport

__all__ = ["LeaseRuntime", "Peer", "RoomEvent", "TicketRefused", "engine_name", "pages_digest"]

logger = logging.getLogger("kvlease.adapters.sglang")

MAX_STASHED = 4096  # ticket requests that arrived before their sender, kept at most
MAX_REMEMBERED = 65536  # the newest lease seen per key, kept at most (stale and replayed tickets)
MAX_REFUSALS_KEPT = 256
_ENGINE_PREFIX = "sglang:"
_BIND_TAG = "kvlease-sglang/1"

#: A decode rank a room writes to, as the prefill's transfer metadata says: (its kvlease engine
#: id, the destination pages as SGLang sends them (int32 bytes), the aux slot).
Peer = tuple[str, bytes, int]


class RoomEvent:
    """What the runtime tells the manager about a room (after the lock is released)."""

    __slots__ = ("kind", "reason", "room")

    def __init__(self, kind: str, room: int, reason: str) -> None:
        self.kind = kind  # "fail" | "dest_freed" | "source_freed"
        self.room = room
        self.reason = reason

    def __repr__(self) -> str:
        return f"RoomEvent({self.kind!r}, {self.room}, {self.reason!r})"


@attrs.frozen
class TicketRefused:
    """A ticket the runtime did not track: forged, relabelled, moved to other pages, stale or
    malformed (with a deployment key: anything not sealed for this room, these ranks and pages)."""

    room: int | None
    engine_id: str
    reason: str


def engine_name(ip: str, port: int) -> str:
    """The kvlease engine id of one SGLang rank: its manager socket (unique while it lives; a
    restart on the same socket is a new incarnation/session, which the handshake tells apart)."""
    return f"{_ENGINE_PREFIX}{ip}:{port}"


def _address_of(engine_id: str) -> str | None:
    """Where an SGLang rank's manager socket listens, from its engine id (never from what a
    message claims: a replayed ticket cannot redirect heartbeats)."""
    if not engine_id.startswith(_ENGINE_PREFIX):
        return None
    address = engine_id[len(_ENGINE_PREFIX) :]
    host, sep, port = address.rpartition(":")
    return address if sep and host and port.isdigit() else None


def pages_digest(pages: bytes) -> bytes:
    """What a destination ticket is bound to instead of the page list itself (bounded size)."""
    return hashlib.sha256(pages).digest()


def _room_of(key: str) -> int | None:
    try:
        return int(key.split(":", 2)[1])
    except (IndexError, ValueError):
        return None


def _binding(kind: str, room: int, pinner: str, accessor: str, digest: bytes = b"", aux: int = -1) -> bytes:
    """The bytes a ticket is sealed over besides itself: which memory its lease guards."""
    return msgpack.packb([_BIND_TAG, kind, room, pinner, accessor, digest, aux], use_bin_type=True)  # type: ignore[no-any-return]


def _request_binding(room: int, asker: str, prefill: str) -> bytes:
    """The bytes a ticket request's tag covers: the room, who asks, and whom."""
    return msgpack.packb([_BIND_TAG, "q", room, asker, prefill], use_bin_type=True)  # type: ignore[no-any-return]


@attrs.define
class _Held:
    """A lease this rank renews (a ticket it tracks), and its access while one is open."""

    key: str
    room: int
    ticket: LeaseTicket
    digest: bytes = b""  # destination tickets: the pages (and aux slot) the lease guards
    aux: int = -1
    handle: int | None = None  # the open access's transport handle (prefill, destination leases)
    inflight: int = 0  # chunks of the access whose posted WRITEs have not all settled
    dirty: bool = False  # a WRITE of the access ended with an unknown outcome (raised, ERR, unsettled)
    closing: bool = False  # the room concluded: end the access once nothing is in flight
    since: float = 0.0  # when the oldest chunk in flight was first posted
    overran: bool = False  # logged: a chunk in flight has run past the access-time bound
    successor: tuple[LeaseTicket, bytes, int] | None = None  # a newer ticket for the key, after this access


class LeaseRuntime:
    """The kvlease side of one SGLang KV manager."""

    def __init__(
        self,
        settings: Settings,
        *,
        ip: str,
        port: int,
        role: str,
        on_event: Callable[[RoomEvent], None],
        zmq_context: Any = None,
        poll_interval: float = 0.05,
    ) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
        self.settings = settings
        self.role = role
        self.config = settings.config
        self.engine_id = engine_name(ip, port)
        self.address = f"{ip}:{port}"
        self._on_room_event = on_event
        self._lock = threading.RLock()
        self.stats = TransportStats()
        #: The deployment key tickets are sealed and opened with (None: authentication off).
        self._auth = load_frame_auth(self.config)
        self.transport = SglangZmqTransport(
            self.engine_id,
            self.address,
            context=zmq_context,
            on_ticket=self._on_ticket,
            on_ticket_request=self._on_ticket_request,
        )
        self.pinner = Pinner(self.config, self.engine_id, new_session())
        self.accessor = Accessor(self.config, self.engine_id, session=new_session())
        # No transfer timeout: SGLang's WRITEs cannot be cancelled from here, so an access is
        # given up only when its engine is declared dead, never because a clock ran out while
        # a WRITE may still land (its lease is heartbeated for as long as it runs).
        self.driver = Driver(
            self.transport,
            pinner=self.pinner,
            accessor=self.accessor,
            stats=self.stats,
            transfer_timeout=float("inf"),
        )
        self._poll_interval = poll_interval
        # pinner side
        self._dest: dict[int, dict[int, bool]] = {}  # room -> lease id -> freed
        self._source: dict[int, LeaseTicket] = {}  # room -> our source-lease ticket
        #: room -> [asker engine]: ticket requests that came before their sender (oldest
        #: evicted first past MAX_STASHED, so junk cannot lock real requests out).
        self._source_asked: collections.OrderedDict[int, list[str]] = collections.OrderedDict()
        self._dest_closing: set[int] = set()  # rooms the decode cleared while a lease was live
        self._dest_expired: set[int] = set()  # rooms a destination lease of which expired
        #: Destination leases this decode released while promised: lease id -> (its expiry then,
        #: ``time.monotonic()`` then, how many accessor ranks had reported it done or released).
        #: One that ends at that expiry or later (no word from the prefill ended it) while the
        #: prefill was heard from after the release (alive: a WRITE of it may still be running,
        #: longer than the access bound) puts its room in `_dest_drain`. A prefill silent since
        #: the release is presumed dead, as at an expiry. The prefill's own word after the
        #: release (its access-done, or its release as posted: it ends at expiry + G all the
        #: same) takes the lease out (`_heard_after_release`).
        self._released_expiry: dict[int, tuple[LocalTime, float, int]] = {}
        #: Rooms whose pages wait for SGLang's drain ACK too. Kept past the receiver's clear
        #: (SGLang clears it at the abort, then holds the pages): dropped when SGLang's deferred
        #: release of the room is done (`release_resolved`), the oldest first past MAX_REMEMBERED.
        self._dest_drain: collections.OrderedDict[int, None] = collections.OrderedDict()
        # accessor side
        self._held: dict[int, dict[str, _Held]] = {}  # room -> key -> the lease renewed here
        #: Decode: room -> the prefill ranks asked for its source-lease ticket, until the request
        #: concludes. A source ticket for anything else is refused: renewing a lease nobody here
        #: will end would pin the prefill's pages for as long as this rank lives.
        self._source_wanted: collections.OrderedDict[int, set[str]] = collections.OrderedDict()
        self._inflight: set[str] = set()  # keys with a chunk in flight (for the overrun warning)
        #: key -> (incarnation, lease id) of the newest ticket tracked for it: an older or equal
        #: one is stale (a replay, a late duplicate), a newer one a reused room's.
        self._newest: collections.OrderedDict[str, tuple[int, int]] = collections.OrderedDict()
        self._tickets: list[tuple[str, bytes]] = []  # arrived during the driver's step
        self._room_events: list[RoomEvent] = []
        #: Tickets not tracked, newest last (bounded), for operators and tests.
        self.refusals: collections.deque[TicketRefused] = collections.deque(maxlen=MAX_REFUSALS_KEPT)
        #: Adapter counters (exported by `_metrics`).
        self.writes_refused = 0
        self.rooms_failed = 0
        self.tickets_refused = 0
        self.accesses = 0
        self.writes_overran = 0
        self.chunks_deferred = 0
        self._on_step: list[Callable[[], None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, name=f"kvlease-{self.engine_id}", daemon=True)
        self._thread.start()

    # -- the pump -----------------------------------------------------------------------------

    def add_step_hook(self, fn: Callable[[], None]) -> None:
        """Run `fn` after each pump step, outside the lock (the metrics mirror)."""
        self._on_step.append(fn)

    def _pump(self) -> None:
        while not self._stop.is_set():
            try:
                with self._lock:
                    for ev in self.driver.step():
                        self._translate(ev)
                    if self._released_expiry:
                        self._heard_after_release()
                    # Tickets are tracked after the step, never from inside its receive: a
                    # track reads the clock, and the step's timers run on the time it started.
                    tickets, self._tickets = self._tickets, []
                    for engine_id, payload in tickets:
                        self._ticket(engine_id, payload)
                    self._check_overruns()
                    delay = self._poll_interval
                    d = self.driver.next_deadline()
                    if d is not None:
                        delay = max(0.0, min(delay, d - self.driver.now()))
                self._flush()
                for fn in self._on_step:
                    fn()
            except Exception:  # never let the pump die: leases would stop being renewed
                logger.exception("kvlease pump step failed")
                delay = self._poll_interval
            self.transport.wait(delay)

    def _flush(self) -> None:
        with self._lock:
            events, self._room_events = self._room_events, []
        for ev in events:
            try:
                self._on_room_event(ev)
            except Exception:
                logger.exception("kvlease: handling %r failed", ev)

    def _emit(self, kind: str, room: int, reason: str) -> None:
        if kind == "fail":
            self.rooms_failed += 1
        self._room_events.append(RoomEvent(kind, room, reason))

    def _find(self, key: str, lease_id: int | None = None) -> _Held | None:
        room = _room_of(key)
        held = None if room is None else self._held.get(room, {}).get(key)
        if held is None or (lease_id is not None and held.ticket.lease_id != lease_id):
            return None
        return held

    def _translate(self, ev: DriverEvent) -> None:
        match ev:
            case Free(lease_id=lease_id, key=key, reason=reason, at=at):
                room = _room_of(key)
                released_expiry = self._released_expiry.pop(lease_id, None)
                if room is None:
                    return
                if key.startswith("d:"):
                    if released_expiry is not None and self._alive_past(key, *released_expiry[:2], at):
                        self._dest_drain[room] = None
                        while len(self._dest_drain) > MAX_REMEMBERED:
                            self._dest_drain.popitem(last=False)
                    leases = self._dest.get(room)
                    if leases is not None and lease_id in leases:
                        leases[lease_id] = True
                    if reason is EndReason.EXPIRED:
                        self._dest_expired.add(room)
                        self._emit("fail", room, "kvlease: destination-page lease expired (prefill silent)")
                    if leases is not None and all(leases.values()):
                        self._emit("dest_freed", room, reason.value)
                        if room in self._dest_closing:
                            self._forget_dest(room)
                elif key.startswith("s:"):
                    self._source.pop(room, None)
                    if reason is EndReason.EXPIRED:
                        self._emit("fail", room, "kvlease: source-page lease expired (decode silent)")
                    self._emit("source_freed", room, reason.value)
            case LeaseLost(key=key, lease_id=lease_id, reason=reason):
                held = self._find(key, lease_id)
                if held is None:
                    return
                if held.handle is None:
                    self._drop(held)  # the core forgot it; an open access is still ours to end
                side = "destination" if key.startswith("d:") else "source"
                self._emit("fail", held.room, f"kvlease: {side}-page lease lost ({reason.value})")
            case AccessStale(key=key):
                room = _room_of(key)
                if room is not None:
                    self._emit("fail", room, "kvlease: the decode did not confirm the write")
            case AccessCompleted():
                pass  # its record went when the access ended (`_end_access`)
            case TransferFailed():
                pass
            case _:
                pass

    def close(self) -> None:
        self._stop.set()
        self.transport.wake()
        self._thread.join(timeout=2.0)
        with self._lock:
            self.transport.close()

    # -- inbound SGLang socket traffic ------------------------------------------------------

    def deliver(self, msg: list[bytes]) -> None:
        self.transport.deliver(msg)

    # -- tickets on the wire ----------------------------------------------------------------

    def _seal(self, ticket: LeaseTicket, bind: bytes) -> dict[str, Any]:
        return ticket.to_dict() if self._auth is None else ticket.sealed_dict(self._auth, bind)

    def _offer(
        self, kind: str, accessor: str, room: int, ticket: LeaseTicket, digest: bytes = b"", aux: int = -1
    ) -> None:
        """Send `ticket` for `room` to the rank `accessor` (its address from its engine id),
        sealed for exactly that: the room, both ranks and (destination, `kind` "d") the pages."""
        address = _address_of(accessor)
        if address is None:
            return
        body: dict[str, Any] = {
            "room": room,
            "ticket": self._seal(ticket, _binding(kind, room, self.engine_id, accessor, digest, aux)),
        }
        if kind == "d":
            body["pages"] = digest
            body["aux"] = aux
        try:
            self.transport.learn(accessor, address)
            self.transport.push(address, b"T", msgpack.packb(body, use_bin_type=True))
        except Exception as exc:  # PeerUnreachable: the asker retries or its lease lapses
            logger.debug("kvlease: offering room %s's ticket to %s failed: %s", room, accessor, exc)

    def _on_ticket(self, engine_id: str, rank: int, address: str, payload: bytes) -> None:
        # Under the lock, inside the driver's receive: queued, handled after the step.
        if len(self._tickets) < MAX_STASHED:
            self._tickets.append((engine_id, payload))
        else:
            self.transport.dropped += 1

    def _refuse(self, room: int | None, engine_id: str, reason: str, *, auth: bool = False) -> None:
        self.tickets_refused += 1
        if auth:
            self.stats.unauthenticated_messages += 1
        self.refusals.append(TicketRefused(room, engine_id, reason))
        logger.warning("kvlease: ticket from %.100s for room %s refused: %s", engine_id, room, reason)

    def _ticket(self, engine_id: str, payload: bytes) -> None:
        """A ticket offered to this rank: on a prefill a decode's destination lease (we WRITE
        under it), on a decode a prefill's source lease (we renew it while we want the KV)."""
        try:
            d = msgpack.unpackb(
                payload, raw=False, strict_map_key=True, max_str_len=512, max_bin_len=64, max_map_len=16
            )
            room = d["room"]
            if type(room) is not int or not 0 <= room < 1 << 64:
                raise ValueError(f"room {room!r}")
            push = self.role == "prefill"
            digest, aux = (d["pages"], d["aux"]) if push else (b"", -1)
            if push and (type(digest) is not bytes or len(digest) != 32 or type(aux) is not int):
                raise ValueError("no destination pages")
        except Exception as exc:
            self.transport.dropped += 1
            self._refuse(None, engine_id, f"malformed ticket message ({type(exc).__name__}: {exc})")
            return
        kind = "d" if push else "s"
        try:
            # The pinner named in the ticket is the one the binding (and the tag) is checked
            # for: what the message claims as its sender is only a routing hint.
            pinner = str(d["ticket"]["engine_id"])
            bind = _binding(kind, room, pinner, self.engine_id, digest, aux)
            ticket = LeaseTicket.from_dict(d["ticket"], auth=self._auth, bind=bind)
        except (RemoteProtocolError, KeyError, TypeError) as exc:
            self._refuse(room, engine_id, str(exc), auth=self._auth is not None)
            return
        if _address_of(ticket.engine_id) is None:
            self._refuse(room, engine_id, f"pinner {ticket.engine_id!r} is not an SGLang rank")
            return
        if not push and ticket.engine_id not in self._source_wanted.get(room, ()):
            self._refuse(
                room,
                engine_id,
                f"a source ticket of {ticket.engine_id!r} this rank did not ask for (or no longer wants)",
            )
            return
        self._track(room, f"{kind}:{room}:{ticket.engine_id}", ticket, digest, aux)

    def _track(self, room: int, key: str, ticket: LeaseTicket, digest: bytes = b"", aux: int = -1) -> None:
        held = self._held.get(room, {}).get(key)
        newest = self._newest.get(key)
        if held is not None and held.ticket == ticket:
            return  # a duplicate of the ticket tracked
        if newest is not None and newest[0] == ticket.incarnation and ticket.lease_id <= newest[1]:
            self._refuse(room, ticket.engine_id, f"stale ticket (lease {ticket.lease_id}, newest {newest[1]})")
            return
        if held is not None:
            # A reused room id: the decode granted a newer lease for this key. It replaces the
            # old one at once if no access is open under it, else when that access ends.
            if held.handle is not None:
                held.successor = (ticket, digest, aux)
                return
            self._untrack(held)
        self._newest[key] = (ticket.incarnation, ticket.lease_id)
        self._newest.move_to_end(key)
        while len(self._newest) > MAX_REMEMBERED:
            self._newest.popitem(last=False)
        address = _address_of(ticket.engine_id)
        assert address is not None
        try:
            self.driver.track(key, ticket, address=address, push=key.startswith("d:"))
        except Exception as exc:
            self._refuse(room, ticket.engine_id, f"cannot track {key}: {exc}")
            return
        self.transport.learn(ticket.engine_id, address)
        self._held.setdefault(room, {})[key] = _Held(key, room, ticket, digest, aux)

    def _drop(self, held: _Held) -> None:
        rooms = self._held.get(held.room)
        if rooms is not None and rooms.get(held.key) is held:
            del rooms[held.key]
            if not rooms:
                del self._held[held.room]
        self._inflight.discard(held.key)
        if held.successor is not None:
            ticket, digest, aux = held.successor
            held.successor = None
            self._track(held.room, held.key, ticket, digest, aux)

    def _untrack(self, held: _Held) -> None:
        """No access is open under `held`: tell its pinner now (it frees at once)."""
        try:
            self.driver.untrack(held.key)
        except Exception as exc:
            logger.debug("kvlease: untrack %s: %s", held.key, exc)
        self._drop(held)

    def _ticket_request(self, room: int, prefill: str) -> bytes:
        """A ``Q`` message: this rank asks `prefill` for `room`'s source ticket. Under a deployment
        key it carries the key's tag over the room and both ranks: a party without the key cannot
        make a prefill offer its tickets (spec §7.5: nothing it sends changes which lease guards
        which pages, nor makes one held longer)."""
        body: dict[str, Any] = {"room": room}
        if self._auth is not None:
            body["tag"] = self._auth.message_tag(_request_binding(room, self.engine_id, prefill))
        return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]

    def _on_ticket_request(self, engine_id: str, rank: int, address: str, payload: bytes) -> None:
        try:
            if payload.isdigit() and len(payload) <= 20:  # an earlier plugin's form: the room alone
                room, tag = int(payload), None
            else:
                d = msgpack.unpackb(
                    payload, raw=False, strict_map_key=True, max_str_len=64, max_bin_len=64, max_map_len=4
                )
                room, tag = d["room"], d.get("tag")
            if type(room) is not int or not 0 <= room < 1 << 64:
                raise ValueError(f"room {room!r}")
            if _address_of(engine_id) is None:
                raise ValueError(f"asker {engine_id!r} is not an SGLang rank")
        except Exception as exc:
            self.transport.dropped += 1
            logger.debug("kvlease: malformed ticket request from %.100s: %s", engine_id, exc)
            return
        if self._auth is not None and not (
            type(tag) is bytes and self._auth.check_message_tag(_request_binding(room, engine_id, self.engine_id), tag)
        ):
            self._refuse(
                room,
                engine_id,
                "ticket request " + ("carries no tag" if tag is None else "has a tag that matches no key and binding"),
                auth=True,
            )
            return
        ticket = self._source.get(room)
        if ticket is not None:
            self._offer("s", engine_id, room, ticket)
            return
        askers = self._source_asked.setdefault(room, [])
        if engine_id not in askers and len(askers) < 64:
            askers.append(engine_id)
        while len(self._source_asked) > MAX_STASHED:
            self._source_asked.popitem(last=False)

    # -- the prefill side: the source lease ---------------------------------------------------

    def open_source(self, room: int) -> None:
        """Prefill: a sender for `room` exists: hold its KV under a source lease (if enabled)."""
        with self._lock:
            if self.settings.source_lease and room not in self._source:
                ticket = self.driver.grant(f"s:{room}")
                self._source[room] = ticket
                for asker in self._source_asked.pop(room, []):
                    self._offer("s", asker, room, ticket)
        self._flush()

    def close_source(self, room: int) -> None:
        """Prefill: the sender is cleared (success or failure): end the source lease, and end
        or untrack the room's destination leases as `close_room` does."""
        with self._lock:
            ticket = self._source.pop(room, None)
            if ticket is not None:
                self.driver.release(ticket.lease_id)
            self._source_asked.pop(room, None)
            self._close_room(room)
        self._flush()

    def source_live(self, room: int) -> bool:
        with self._lock:
            return room in self._source

    # -- the prefill side: WRITEs under destination leases ----------------------------------

    def keys(self, room: int, prefix: str = "") -> list[str]:
        """The lease keys of `room` this rank renews (``d:`` destination, ``s:`` source)."""
        with self._lock:
            return sorted(k for k in self._held.get(room, {}) if k.startswith(prefix))

    def dest_keys(self, room: int) -> list[str]:
        return self.keys(room, "d:")

    def _window_ok(self, key: str, now: float) -> bool:
        vu = self.accessor.valid_until(key)
        return vu is not None and now + self.config.access_time_local <= vu

    def ready(self, room: int, peers: Sequence[Peer]) -> bool:
        """Prefill, before a transfer worker takes a chunk of `room`: every decode rank's
        destination lease is here and its validity window covers a WRITE starting now (if
        not, the worker serves other rooms meanwhile)."""
        with self._lock:
            rooms = self._held.get(room, {})
            now = self.driver.now()
            for engine_id, _pages, _aux in peers:
                held = rooms.get(f"d:{room}:{engine_id}")
                if held is None or held.closing or not self._window_ok(held.key, now):
                    return False
            return bool(peers)

    def gate(self, room: int, peers: Sequence[Peer], marked: set[str]) -> str | None:
        """Prefill, before posting any WRITE of `room`: None if it may be posted now, else why
        not (then nothing may be posted). The first WRITE to a decode rank begins the access
        (the core's push guard); every later one needs the window to cover it still and the
        lease not to be lost or concluding. Keys not yet in `marked` (this chunk's) are counted
        in flight until `settle`."""
        with self._lock:
            if not peers:
                return self._refused_write("no decode rank to write to")
            rooms = self._held.get(room, {})
            now = self.driver.now()
            todo: list[_Held] = []
            for engine_id, pages, aux in peers:
                key = f"d:{room}:{engine_id}"
                held = rooms.get(key)
                if held is None:
                    return self._refused_write(f"no destination lease from {engine_id}")
                if held.closing:
                    return self._refused_write(f"{key}: the room concluded")
                if held.digest != pages_digest(pages) or held.aux != aux:
                    return self._refused_write(f"{key}: the lease guards other pages than the transfer writes")
                state = self.accessor.state_of(key)
                want = TrackedState.WAITING if held.handle is None else TrackedState.ACCESSING
                if state is not want or not self._window_ok(key, now):
                    return self._refused_write(f"{key}: the validity window does not cover the write")
                todo.append(held)
            # Every access begins (or is refused) before any is counted in flight: one begun
            # here for a WRITE that is then not posted ends clean (nothing of it can land).
            for held in todo:
                if held.handle is None:
                    decision = self.driver.write(held.key, "", None)
                    handle = self.transport.last_started
                    self.transport.last_started = None
                    if not decision.allowed or handle is None:
                        return self._refused_write(f"{held.key}: {decision.reason or 'no write recorded'}")
                    held.handle = handle
                    self.accesses += 1
            for held in todo:
                if held.key not in marked:
                    marked.add(held.key)
                    if held.inflight == 0:
                        held.since = now
                    held.inflight += 1
                    self._inflight.add(held.key)
            return None

    def _refused_write(self, reason: str) -> str:
        self.writes_refused += 1
        return reason

    def settle(self, room: int, keys: Iterable[str], *, clean: bool) -> None:
        """Prefill: the WRITEs a chunk posted under `keys` all settled (`clean`: every one
        DONE and no post raised), or their outcome is unknown (not `clean`: they may still
        land). An access whose room concluded ends here once nothing of it is in flight."""
        with self._lock:
            rooms = self._held.get(room, {})
            for key in keys:
                held = rooms.get(key)
                if held is None or held.inflight == 0:
                    continue
                held.inflight -= 1
                if not clean:
                    held.dirty = True
                if held.inflight == 0:
                    self._inflight.discard(key)
                    if held.closing:
                        self._end_access(held)
        self.transport.wake()

    def taint(self, room: int) -> None:
        """Prefill: a post of `room` raised (SGLang's ``poison_deferred_ack_room``): its WRITE
        may still land, so every open access of the room ends as a posted failure."""
        with self._lock:
            for held in self._held.get(room, {}).values():
                if held.handle is not None:
                    held.dirty = True

    def end_write(self, room: int, ok: bool) -> None:
        """Prefill: the room's final chunk settled (`ok`: every WRITE DONE). Each access ends
        now (with the access-done when clean), or when what is still in flight settles."""
        with self._lock:
            for held in list(self._held.get(room, {}).values()):
                if not held.key.startswith("d:"):
                    continue
                if not ok:
                    held.dirty = held.dirty or held.handle is not None
                held.closing = True
                if held.handle is None:
                    self._untrack(held)
                elif held.inflight == 0:
                    self._end_access(held)
        self.transport.wake()

    def close_room(self, room: int) -> None:
        """Prefill: `room` will post no more WRITEs (an abort, a failure, the sender cleared)."""
        with self._lock:
            self._close_room(room)
        self._flush()

    def _close_room(self, room: int) -> None:
        for held in list(self._held.get(room, {}).values()):
            if not held.key.startswith("d:"):
                continue
            held.closing = True
            if held.handle is None:
                self._untrack(held)  # nothing was posted: the decode frees at once
            elif held.inflight == 0:
                self._end_access(held)
        self.transport.wake()

    def _end_access(self, held: _Held) -> None:
        """End the open access under `held`: clean, the access-done goes out (every WRITE is
        DONE: the decode frees at once); otherwise the core gives the lease up as posted (the
        decode keeps the pages to expiry + G, since a WRITE may still land)."""
        assert held.handle is not None and held.inflight == 0
        handle, held.handle = held.handle, None
        if held.dirty:
            self.transport.complete(handle, False, "a WRITE of the access may still land")
        else:
            self.transport.complete(handle, True)
        self._drop(held)

    def writing(self, room: int) -> bool:
        with self._lock:
            return any(h.handle is not None for h in self._held.get(room, {}).values())

    def _check_overruns(self) -> None:
        if not self._inflight:
            return
        now = self.driver.now()
        bound = self.config.access_time_local
        for key in list(self._inflight):
            held = self._find(key)
            if held is None or held.overran or now - held.since <= bound:
                continue
            held.overran = True
            self.writes_overran += 1
            logger.warning(
                "kvlease: room %s: a WRITE to %s ran past the access-time bound A = %gs (%.1fs in flight); "
                "its lease is kept alive while it runs, but an abort of the room now relies on "
                "SGLANG_KVLEASE_MAX_ACCESS_TIME: raise it",
                held.room,
                held.ticket.engine_id,
                self.config.max_access_time,
                now - held.since,
            )

    # -- the decode side ----------------------------------------------------------------------

    def grant_dest(self, room: int, prefill_ip: str, prefill_port: int, pages: bytes = b"", aux: int = -1) -> None:
        """Decode: pin the destination pages of `room` (SGLang's int32 page list, as sent in
        its metadata, and the aux slot) that this prefill rank will WRITE, under a push lease
        bound to it, and send it the ticket sealed to them."""
        peer = engine_name(prefill_ip, prefill_port)
        with self._lock:
            ticket = self.driver.grant(f"d:{room}:{peer}", push=True, accessor=peer)
            self._dest.setdefault(room, {})[ticket.lease_id] = False
            self._offer("d", peer, room, ticket, pages_digest(pages), aux)
        self._flush()

    def release_dest(self, room: int) -> None:
        """Decode: the request failed or was aborted. Each destination lease ends when no WRITE
        can still land: at once if never promised or when the prefill says no access is open,
        else at its expiry plus the push guard."""
        with self._lock:
            for lease_id, freed in self._dest.get(room, {}).items():
                if freed:
                    continue
                info = self.pinner.info(lease_id)
                if info is not None and info.state is LeaseState.ACTIVE:
                    # Only this release moves it on: a lease the prefill already gave up as
                    # posted (held to expiry + G on its word) is not waiting on this decode.
                    self._released_expiry[lease_id] = (info.expiry, time.monotonic(), info.accesses_done)
                self.driver.release(lease_id)
        self._flush()

    def dest_freed(self, room: int) -> bool:
        """Decode: no destination lease of `room` is live (none granted counts as freed)."""
        with self._lock:
            return all(self._dest.get(room, {}).values())

    def _alive_past(self, key: str, expiry: LocalTime, released: float, at: LocalTime) -> bool:
        """Whether the released destination lease `key` ended at its `expiry` or later (not on
        the prefill's word) while its prefill was heard from after the release at `released`."""
        prefill = key.split(":", 2)[2]
        return at >= expiry and self.transport.heard.get(prefill, float("-inf")) > released

    def _heard_after_release(self) -> None:
        """Released destination leases the prefill has spoken for since (an accessor rank
        counted: its access-done, or its release as posted, which holds the lease to expiry + G
        all the same): they end on the prefill's word, whichever came first, so their end waits
        for no drain (SGLang poisons that ACK when a post raised: it would only time out)."""
        for lease_id, (_expiry, _released, done) in list(self._released_expiry.items()):
            info = self.pinner.info(lease_id)
            if info is not None and info.accesses_done > done:
                del self._released_expiry[lease_id]

    def dest_needs_drain(self, room: int) -> bool:
        """Decode: a destination lease of `room` that this decode released ended only at its
        expiry (plus the push guard), not on a word from the prefill: the prefill may be alive
        with a WRITE still running past the access bound A (SGLang awaits its WRITEs without a
        bound), so the pages also wait for SGLang's own drain acknowledgement (or its
        deferred-release timeout), if the prefill was heard from after the release. A lease that
        expired unrenewed before any release or whose prefill went silent at the release (a
        presumed dead prefill), ended on the prefill's access-done or release, or that the
        prefill had already given up as posted (expiry + G on its word) does not."""
        with self._lock:
            return room in self._dest_drain

    def dest_decides(self, room: int) -> bool:
        """Decode: the destination leases of `room` decide its fate: one is live (the prefill is
        alive: however long it takes, no fixed timeout applies) or one expired (the room fails
        through the lease)."""
        with self._lock:
            leases = self._dest.get(room)
            if not leases:
                return False
            return not all(leases.values()) or room in self._dest_expired

    def dest_ended(self, room: int) -> bool:
        """Decode: `room` had destination leases and all of them ended without expiring (the
        access-done after the last WRITE, or the prefill's release)."""
        with self._lock:
            leases = self._dest.get(room)
            return leases is not None and bool(leases) and all(leases.values()) and room not in self._dest_expired

    def forget_dest(self, room: int) -> None:
        """Decode: the room is cleared; drop its bookkeeping once its leases have ended."""
        with self._lock:
            leases = self._dest.get(room)
            if leases is None:
                return
            if all(leases.values()):
                self._forget_dest(room)
            else:
                self._dest_closing.add(room)

    def _forget_dest(self, room: int) -> None:
        for lease_id in self._dest.pop(room, {}):
            self._released_expiry.pop(lease_id, None)
        self._dest_closing.discard(room)
        self._dest_expired.discard(room)

    def release_resolved(self, room: int) -> None:
        """Decode: SGLang's deferred release of `room` is done (its pages went back)."""
        with self._lock:
            self._dest_drain.pop(room, None)

    def ask_source(self, room: int, prefill_ip: str, prefill_port: int) -> None:
        """Decode: the request is admitted: ask the prefill rank for its source-lease ticket, to
        renew it from now on (the memory wait included)."""
        with self._lock:
            prefill = engine_name(prefill_ip, prefill_port)
            self.transport.learn(prefill, f"{prefill_ip}:{prefill_port}")
            self._source_wanted.setdefault(room, set()).add(prefill)
            self._source_wanted.move_to_end(room)
            while len(self._source_wanted) > MAX_REMEMBERED:
                self._source_wanted.popitem(last=False)
            try:
                self.transport.push(f"{prefill_ip}:{prefill_port}", b"Q", self._ticket_request(room, prefill))
            except Exception as exc:
                logger.debug("kvlease: asking %s:%s for room %s's ticket: %s", prefill_ip, prefill_port, room, exc)

    def stop_source(self, room: int) -> None:
        """Decode: the request concluded: release the prefill's source lease."""
        with self._lock:
            self._source_wanted.pop(room, None)
            for held in list(self._held.get(room, {}).values()):
                if held.key.startswith("s:"):
                    self._untrack(held)
        self._flush()

    def now(self) -> LocalTime:
        with self._lock:
            now: LocalTime = self.driver.now()
            return now
