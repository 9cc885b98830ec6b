"""`LeaseRuntime`: one SGLang KV manager's (one rank's) kvlease pinner + accessor, pumped by
`kvlease.transports.Driver` from a thread of its own.

SGLang calls into its KV manager from several threads (the scheduler, the prefill's transfer
workers, the bootstrap/listener thread); the core is single-threaded. Every call into the driver
therefore happens under one lock, held only for the call. Events the driver produces are handed to
the manager's callback *after* the lock is released, so the manager may take its own locks.

Leases (one rank of each side is one kvlease engine, so every lease is 1:1; a room that several
prefill ranks write, or that one prefill rank writes to several decode ranks, gets one lease per
pair):

- destination lease ``d:<room>:<prefill engine>`` — pinner: the decode, push mode, granted when it
  sends its metadata; accessor: the prefill rank that WRITEs, tracking from the moment the ticket
  arrives (the request is already in the prefill's queues) until its last WRITE landed;
- source lease ``s:<room>`` — pinner: the prefill, granted when its sender is created; accessor:
  the decode, tracking from the moment it admits the request (before its memory wait).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

import msgpack
from kvlease.transports import Driver, DriverEvent, TransferFailed, TransportStats, new_session

from kvlease import (
    AccessCompleted,
    Accessor,
    AccessStale,
    EndReason,
    Free,
    LeaseLost,
    LeaseTicket,
    LocalTime,
    Pinner,
)

from ._settings import Settings
from ._transport import SglangZmqTransport

__all__ = ["LeaseRuntime", "RoomEvent"]

logger = logging.getLogger("kvlease.adapters.sglang")

MAX_STASHED = 4096  # ticket requests that arrived before their sender, kept at most


class RoomEvent:
    """What the runtime tells the manager about a room (after the lock is released)."""

    __slots__ = ("kind", "reason", "room")

    def __init__(self, kind: str, room: int, reason: str) -> None:
        self.kind = kind  # "fail" | "dest_freed" | "source_freed"
        self.room = room
        self.reason = reason

    def __repr__(self) -> str:
        return f"RoomEvent({self.kind!r}, {self.room}, {self.reason!r})"


def engine_name(ip: str, port: int) -> str:
    """The kvlease engine id of one SGLang rank: its manager socket (unique while it lives; a
    restart on the same socket is a new incarnation/session, which the handshake tells apart)."""
    return f"sglang:{ip}:{port}"


def _room_of(key: str) -> int | None:
    try:
        return int(key.split(":", 2)[1])
    except (IndexError, ValueError):
        return None


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
        self.transport = SglangZmqTransport(
            self.engine_id,
            self.address,
            context=zmq_context,
            on_ticket=self._on_ticket,
            on_ticket_request=self._on_ticket_request,
        )
        self.pinner = Pinner(self.config, self.engine_id, new_session())
        self.accessor = Accessor(self.config, self.engine_id, session=new_session())
        self.driver = Driver(self.transport, pinner=self.pinner, accessor=self.accessor, stats=self.stats)
        self._poll_interval = poll_interval
        # pinner side
        self._dest: dict[int, dict[int, bool]] = {}  # room -> lease id -> freed
        self._source: dict[int, LeaseTicket] = {}  # room -> our source-lease ticket
        #: room -> [(engine, address)]: ticket requests that came before their sender (oldest
        #: evicted first past MAX_STASHED, so junk cannot lock real requests out).
        self._source_asked: collections.OrderedDict[int, list[tuple[str, str]]] = collections.OrderedDict()
        self._dest_closing: set[int] = set()  # rooms the decode cleared while a lease was live
        self._dest_expired: set[int] = set()  # rooms a destination lease of which expired
        # accessor side
        self._tracked: dict[int, set[str]] = {}  # room -> keys tracked here
        self._writes: dict[int, dict[str, int]] = {}  # room -> key -> transport handle
        self._room_events: list[RoomEvent] = []
        #: Adapter counters (exported by `_metrics`).
        self.writes_refused = 0
        self.rooms_failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, name=f"kvlease-{self.engine_id}", daemon=True)
        self._thread.start()

    # -- the pump -----------------------------------------------------------------------------

    def _pump(self) -> None:
        while not self._stop.is_set():
            try:
                with self._lock:
                    for ev in self.driver.step():
                        self._translate(ev)
                    delay = self._poll_interval
                    d = self.driver.next_deadline()
                    if d is not None:
                        delay = max(0.0, min(delay, d - self.driver.now()))
                self._flush()
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

    def _translate(self, ev: DriverEvent) -> None:
        match ev:
            case Free(lease_id=lease_id, key=key, reason=reason):
                room = _room_of(key)
                if room is None:
                    return
                if key.startswith("d:"):
                    leases = self._dest.get(room)
                    if leases is not None and lease_id in leases:
                        leases[lease_id] = True
                    if reason is EndReason.EXPIRED:
                        self._dest_expired.add(room)
                        self._emit("fail", room, "kvlease: destination-page lease expired (prefill silent)")
                    if leases is not None and all(leases.values()):
                        self._emit("dest_freed", room, reason.value)
                        if room in self._dest_closing:
                            self._dest_closing.discard(room)
                            self._dest_expired.discard(room)
                            del self._dest[room]
                elif key.startswith("s:"):
                    self._source.pop(room, None)
                    if reason is EndReason.EXPIRED:
                        self._emit("fail", room, "kvlease: source-page lease expired (decode silent)")
                    self._emit("source_freed", room, reason.value)
            case LeaseLost(key=key, reason=reason):
                room = _room_of(key)
                if room is None:
                    return
                self._tracked.get(room, set()).discard(key)
                if key.startswith("d:"):
                    self._emit("fail", room, f"kvlease: destination-page lease lost ({reason.value})")
                else:
                    self._emit("fail", room, f"kvlease: source-page lease lost ({reason.value})")
            case AccessStale(key=key):
                room = _room_of(key)
                if room is not None:
                    self._emit("fail", room, "kvlease: the decode did not confirm the write")
            case AccessCompleted(key=key):
                room = _room_of(key)
                if room is not None:
                    self._tracked.get(room, set()).discard(key)
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

    @staticmethod
    def _pack_ticket(room: int, ticket: LeaseTicket) -> bytes:
        return msgpack.packb({"room": room, "ticket": ticket.to_dict()})  # type: ignore[no-any-return]

    @staticmethod
    def _unpack_ticket(payload: bytes) -> tuple[int, LeaseTicket] | None:
        try:
            d = msgpack.unpackb(payload, strict_map_key=True, max_str_len=512, max_map_len=16)
            room = d["room"]
            if type(room) is not int or not 0 <= room < 1 << 64:
                return None
            return room, LeaseTicket.from_dict(d["ticket"])
        except Exception:
            return None

    def _on_ticket(self, engine_id: str, rank: int, address: str, payload: bytes) -> None:
        # Under the lock (called from the driver's receive).
        parsed = self._unpack_ticket(payload)
        if parsed is None or parsed[1].engine_id != engine_id:
            self.transport.dropped += 1
            return
        room, ticket = parsed
        # On a prefill rank a ticket is a decode's destination lease (push: we WRITE under it);
        # on a decode rank, a prefill's source lease (we renew it while we want the KV).
        push = self.role == "prefill"
        key = f"d:{room}:{engine_id}" if push else f"s:{room}:{engine_id}"
        self._track(room, key, ticket, address, push=push)

    def _on_ticket_request(self, engine_id: str, rank: int, address: str, payload: bytes) -> None:
        try:
            room = int(payload.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            self.transport.dropped += 1
            return
        ticket = self._source.get(room)
        if ticket is not None:
            self._offer(address, room, ticket)
            return
        askers = self._source_asked.setdefault(room, [])
        if (engine_id, address) not in askers and len(askers) < 64:
            askers.append((engine_id, address))
        while len(self._source_asked) > MAX_STASHED:
            self._source_asked.popitem(last=False)

    def _offer(self, address: str, room: int, ticket: LeaseTicket) -> None:
        try:
            self.transport.push(address, b"T", self._pack_ticket(room, ticket))
        except Exception as exc:  # PeerUnreachable: the asker retries or its lease lapses
            logger.debug("kvlease: offering room %s's ticket to %s failed: %s", room, address, exc)

    # -- the prefill side -------------------------------------------------------------------

    def open_source(self, room: int) -> None:
        """Prefill: a sender for `room` exists: hold its KV under a source lease (if enabled)
        and start writing under any destination ticket that arrived early."""
        with self._lock:
            if self.settings.source_lease and room not in self._source:
                ticket = self.driver.grant(f"s:{room}")
                self._source[room] = ticket
                for _eid, address in self._source_asked.pop(room, []):
                    self._offer(address, room, ticket)
        self._flush()

    def close_source(self, room: int) -> None:
        """Prefill: the sender concluded (success or failure): end the source lease and stop
        heartbeating destination leases no WRITE of ours is in flight for."""
        with self._lock:
            ticket = self._source.pop(room, None)
            if ticket is not None:
                self.driver.release(ticket.lease_id)
            self._source_asked.pop(room, None)
            self._untrack_room(room)
        self._flush()

    def source_live(self, room: int) -> bool:
        with self._lock:
            return room in self._source

    def _track(self, room: int, key: str, ticket: LeaseTicket, address: str | None, *, push: bool) -> None:
        keys = self._tracked.setdefault(room, set())
        if key in keys:
            return
        if address is not None:
            self.transport.learn(ticket.engine_id, address)
        try:
            self.driver.track(key, ticket, address=address, push=push)
        except Exception as exc:
            logger.warning("kvlease: cannot track %s: %s", key, exc)
            return
        keys.add(key)

    def _untrack_room(self, room: int) -> None:
        writing = self._writes.get(room, {})
        for key in list(self._tracked.pop(room, set())):
            if key in writing:
                continue  # its access-done (or its expiry) ends it
            try:
                self.driver.untrack(key)
            except Exception as exc:
                logger.debug("kvlease: untrack %s: %s", key, exc)

    def dest_keys(self, room: int) -> list[str]:
        with self._lock:
            return sorted(k for k in self._tracked.get(room, set()) if k.startswith("d:"))

    def covered(self, room: int) -> str | None:
        """Prefill, before a non-final chunk's WRITE: None if every destination lease of `room`
        covers a WRITE starting now (``now + A_l <= valid_until``), else why not."""
        with self._lock:
            keys = [k for k in self._tracked.get(room, set()) if k.startswith("d:")]
            if not keys:
                return "no destination lease"
            now = self.driver.now()
            for key in keys:
                vu = self.accessor.valid_until(key)
                if vu is None or now + self.config.access_time_local > vu:
                    self.writes_refused += 1
                    return f"{key}: the validity window does not cover the write"
            return None

    def awaiting_first_ack(self, room: int) -> bool:
        """Prefill: a destination lease of `room` is not here yet or has never been
        acknowledged (its ticket or first heartbeat round is still on its way)."""
        with self._lock:
            keys = [k for k in self._tracked.get(room, set()) if k.startswith("d:")]
            return not keys or any(self.accessor.valid_until(k) is None for k in keys)

    def begin_write(self, room: int) -> str | None:
        """Prefill, before the final chunk's first WRITE: begin the access on every destination
        lease (the push guard decides); None if all allowed, else why not (nothing started)."""
        with self._lock:
            keys = sorted(k for k in self._tracked.get(room, set()) if k.startswith("d:"))
            if not keys:
                return "no destination lease"
            started: dict[str, int] = {}
            for key in keys:
                decision = self.driver.write(key, "", None)
                if not decision.allowed:
                    for h in started.values():  # nothing was posted; the lease is given up
                        self.transport.complete(h, False, "not started")
                    self._writes.pop(room, None)
                    self.writes_refused += 1
                    return f"{key}: {decision.reason or 'not covered by the validity window'}"
                handle = self.transport.last_started
                if handle is None:
                    return f"{key}: no write recorded"
                self.transport.last_started = None
                started[key] = handle
            self._writes[room] = started
            return None

    def end_write(self, room: int, ok: bool, error: str = "") -> None:
        """Prefill: every WRITE of the final chunk settled (`ok`: all DONE). On success the
        access-done goes to each decode now, after the data landed."""
        with self._lock:
            started = self._writes.pop(room, None)
            if not started:
                return
            for key, handle in started.items():
                self.transport.complete(handle, ok, error)
                if ok:
                    self._tracked.get(room, set()).discard(key)
        self.transport.wake()

    def writing(self, room: int) -> bool:
        with self._lock:
            return room in self._writes

    # -- the decode side ----------------------------------------------------------------------

    def grant_dest(self, room: int, prefill_ip: str, prefill_port: int) -> None:
        """Decode: pin the destination pages of `room` that this prefill rank will WRITE, under
        a push lease bound to it, and send it the ticket."""
        peer = engine_name(prefill_ip, prefill_port)
        address = f"{prefill_ip}:{prefill_port}"
        with self._lock:
            ticket = self.driver.grant(f"d:{room}:{peer}", push=True, accessor=peer)
            self._dest.setdefault(room, {})[ticket.lease_id] = False
            self.transport.learn(peer, address)
            self._offer(address, room, ticket)
        self._flush()

    def release_dest(self, room: int) -> None:
        """Decode: the request failed or was aborted. Each destination lease ends when no WRITE
        can still land: at once if never promised, else at its expiry plus the push guard."""
        with self._lock:
            for lease_id, freed in self._dest.get(room, {}).items():
                if not freed:
                    self.driver.release(lease_id)
        self._flush()

    def dest_freed(self, room: int) -> bool:
        """Decode: no destination lease of `room` is live (none granted counts as freed)."""
        with self._lock:
            return all(self._dest.get(room, {}).values())

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
                del self._dest[room]
                self._dest_closing.discard(room)
                self._dest_expired.discard(room)
            else:
                self._dest_closing.add(room)

    def ask_source(self, room: int, prefill_ip: str, prefill_port: int) -> None:
        """Decode: the request is admitted: ask the prefill rank for its source-lease ticket, to
        renew it from now on (the memory wait included)."""
        with self._lock:
            self.transport.learn(engine_name(prefill_ip, prefill_port), f"{prefill_ip}:{prefill_port}")
            try:
                self.transport.push(f"{prefill_ip}:{prefill_port}", b"Q", str(room).encode("ascii"))
            except Exception as exc:
                logger.debug("kvlease: asking %s:%s for room %s's ticket: %s", prefill_ip, prefill_port, room, exc)

    def stop_source(self, room: int) -> None:
        """Decode: the request concluded: release the prefill's source lease."""
        with self._lock:
            self._untrack_room(room)
        self._flush()

    def now(self) -> LocalTime:
        with self._lock:
            now: LocalTime = self.driver.now()
            return now
