"""The pinner: the side that holds memory for a remote accessor and decides when to free it.

It grants leases, extends them on heartbeats (``expiry = max(old, now + extension)``), counts
access-done per accessor rank, releases, and expires. It answers every heartbeat with what it
renewed and which ids it does not hold, so an accessor learns of a lost lease within one round
trip. Each lease frees exactly once; a late or duplicate message about a finished lease gets a
precise answer from a bounded tombstone, never a second free.

Expiry structure: a binary heap with exactly one entry per live lease, keyed by a *lower bound*
of its expiry. A renewal only raises the lease's own expiry field (O(1), no heap work); when the
entry surfaces, a renewed lease is pushed back at its true expiry (O(log n)), an expired one is
freed. Peeking the next deadline is O(1) and never late — the bug of stopping at the first
unexpired entry of a list ordered by *grant* time (vLLM issue #58222) cannot happen because the
heap is ordered by the bound itself.

Never reads a clock, never does I/O.
"""

from __future__ import annotations

import enum
import heapq
from collections import deque
from collections.abc import Iterable
from typing import Final

import attrs

from ._binding import bind, bound_elsewhere, fresh_renewal, sessions
from ._clock import LocalTime, PeerTime, check_time
from ._codec import MAX_IDS, MIN_ID_BUDGET, chunk_cost, heartbeat_id_budget
from ._config import LeaseConfig
from ._errors import ConfigError, LocalProtocolError
from ._events import EndReason, Free, PinnerOutput, Rejected, Send
from ._layout import MAX_RANKS, layout_error, tp_layout
from ._messages import (
    ALL_CAPABILITIES,
    PROTOCOL_VERSION,
    AccessDone,
    AccessDoneAck,
    AccessOutcome,
    Capability,
    Handshake,
    HandshakeReply,
    Heartbeat,
    HeartbeatAck,
    LeaseKind,
    LeaseTicket,
    Message,
    Release,
)
from ._records import Tombstones

__all__ = ["LeaseInfo", "LeaseState", "Pinner", "PinnerCounters"]

_MAX_RANK = MAX_RANKS
_COMPAT_RANK_BASE = _MAX_RANK  # pseudo-ranks for vLLM's rank-less `id:count` notifications
_COMPAT_ENGINE = "vllm"  # the accessor a lease renewed or ended by stock vLLM notifications is bound to
_U64 = 1 << 64
#: Lease ids held at most in heartbeats that name a lease not granted yet (spec §5.5 step 0);
#: a heartbeat that would exceed it is answered at once (its early ids `unknown`).
MAX_HELD_IDS = 1 << 16


class LeaseState(enum.Enum):
    ACTIVE = "active"
    #: Released by the local engine after the pinner had promised validity (acknowledged a
    #: heartbeat, or handed out a fixed-TTL deadline): no longer renewed, held until its
    #: current expiry so no access inside an accessor's validity window overlaps the free.
    RELEASING = "releasing"
    #: Push mode: expired, but a write that started in time may still be landing; the memory
    #: is kept for the access-time bound before it is freed.
    QUARANTINED = "quarantined"
    ENDED = "ended"


# Enum member lookups cost a descriptor call each; the hot paths use these module constants.
_ACTIVE = LeaseState.ACTIVE
_RELEASING = LeaseState.RELEASING
_RENEWABLE = LeaseKind.RENEWABLE
_FIXED_TTL = LeaseKind.FIXED_TTL
_INF = float("inf")
_LAYOUTS_KEPT = 256  # accessor layouts remembered as valid (a peer cannot grow the set past it)


class _Lease:
    """One live lease. Plain slots class: it exists a million times over."""

    __slots__ = (
        "accessor",
        "b_rank",
        "b_seq",
        "b_session",
        "done",
        "expected",
        "expiry",
        "hold",
        "key",
        "kind",
        "lease_id",
        "more",
        "promised",
        "push",
        "released",
        "state",
        "steady",
    )

    def __init__(self, lease_id: int, key: str, kind: LeaseKind, expiry: float, expected: int, push: bool) -> None:
        self.lease_id = lease_id
        self.key = key
        self.kind = kind
        self.expiry = expiry
        self.expected = expected  # 0: taken from the first access-done
        self.push = push
        self.state = _ACTIVE
        self.done: frozenset[int] | None = None  # accessor ranks that reported done or release
        # An accessor may hold a validity window for it: set by an acknowledged heartbeat, and
        # from the start for fixed-TTL leases (the ticket carries the deadline).
        self.promised = kind is _FIXED_TTL
        self.released = False  # ends as RELEASED rather than EXPIRED
        # A counted posted Release of a push lease: a WRITE of that accessor rank may still
        # land, so counting never ends the lease; it ends at its expiry plus the push guard.
        self.hold = False
        # Binding: the accessor engine, and each of its ranks' session, that first spoke for
        # this lease (renewal, access-done or release). Nobody else may renew or end it. The
        # first rank is kept in slots (the common case: one accessor rank per pinner rank),
        # further ranks (fewer pinner than accessor ranks) in `more`: rank -> [session, seq].
        # The seq is the highest heartbeat seq of that session that extended the lease: an
        # older or replayed heartbeat is acknowledged but extends nothing.
        self.accessor: str | None = None
        self.b_rank = -1
        self.b_session = 0
        self.b_seq = 0
        self.more: dict[int, list[int]] | None = None
        # The renewal loop's steady state: set when a heartbeat renewed this ACTIVE renewable
        # lease from its first bound rank (`b_rank`), to that rank's session's `_Steady` key;
        # cleared by every arrow out of ACTIVE. A later heartbeat of that session then needs
        # one identity test, the expiry and the seq (binding never changes once made).
        self.steady: _Steady | None = None


class _Steady:
    """The identity of one accessor session of one rank of one engine, interned per pinner
    (`Pinner._steady`): the renewal loop compares leases to it with `is`."""

    __slots__ = ()


_NOT_STEADY: Final = _Steady()  # the key of a heartbeat that has none (no seq): matches no lease


# -- a lease's life: spec/PROTOCOL.md §3 "States", one function per arrow ------------------------
#
#   grant ──► ACTIVE ── every expected rank counted ─────────────────────► ENDED(access_done|released)
#               │ ───── local release, not promised ─────────────────────► ENDED(released)
#               │ ───── local release, promised ──► RELEASING ── expiry ─► ENDED(released)
#               │ ───── expiry, not push ────────────────────────────────► ENDED(expired|released)
#               └────── expiry, push ──► QUARANTINED ── expiry + G ──────► ENDED(expired|released)
#
# Besides `state`, two flags of the spec: `promised` (an accessor may hold a validity window:
# from the first renewing heartbeat, or from the grant for fixed-TTL) and `released` (the
# lease ends as RELEASED whatever ends it). These functions are the only writers of all three
# after the grant (`_Lease.__init__`); the renewal loop inlines `_promise`, its hot path.


def _counts(lease: _Lease, now: float) -> bool:
    """Whether a message may still act on the lease: ACTIVE or RELEASING, and not expired at
    `now` (expired is ``now >= expiry``, before `handle_timeout` frees it)."""
    return lease.state is not LeaseState.QUARANTINED and lease.expiry > now


def _promise(lease: _Lease) -> None:
    """A heartbeat renewed it (acknowledged): an accessor may now hold a validity window."""
    lease.promised = True


def _to_releasing(lease: _Lease) -> None:
    """ACTIVE -> RELEASING: a local release of a promised lease; held until its expiry."""
    lease.state = _RELEASING
    lease.steady = None
    lease.released = True


def _flag_released(lease: _Lease) -> None:
    """A counted accessor `Release`: the lease ends as RELEASED whatever ends it."""
    lease.released = True


def _to_held(lease: _Lease) -> None:
    """ACTIVE/RELEASING -> RELEASING, held: a counted posted Release of a push lease. A WRITE
    posted under it may still land, so neither counting nor a release frees it before its
    expiry and the push guard (which bound every WRITE the accessor started in time)."""
    lease.state = _RELEASING
    lease.steady = None
    lease.released = True
    lease.hold = True


def _to_quarantined(lease: _Lease, guard: float) -> None:
    """Expiry of a push lease: keep the memory `guard` longer for a write still landing."""
    lease.state = LeaseState.QUARANTINED
    lease.steady = None
    lease.expiry += guard


def _to_ended(lease: _Lease) -> None:
    lease.state = LeaseState.ENDED
    lease.steady = None


def _end_reason(lease: _Lease, otherwise: EndReason) -> EndReason:
    """The reason the lease ends with now: RELEASED if its flag is set, else `otherwise`."""
    return EndReason.RELEASED if lease.released else otherwise


@attrs.frozen
class LeaseInfo:
    """A read-only view of a live lease."""

    lease_id: int
    key: str
    kind: LeaseKind
    state: LeaseState
    expiry: LocalTime
    push: bool
    accesses_done: int
    expected: int


@attrs.define
class PinnerCounters:
    """Monotone counters a driver can export. Renewals are counted per lease id."""

    granted: int = 0
    renewed: int = 0
    released: int = 0
    expired: int = 0
    completed: int = 0
    heartbeats: int = 0
    heartbeat_ids_missing: int = 0
    late_access_done: int = 0
    rejected: int = 0
    heartbeats_held: int = 0  # held until the lease they name is granted (spec §5.5 step 0)


class Pinner:
    """The pinner side of the lease protocol, for one worker (rank) of one engine.

    `incarnation` must differ between restarts of the engine (a random 64-bit value): lease
    ids restart from 1, and a heartbeat for an id of an older incarnation must never renew a
    new lease that reuses that id.
    """

    def __init__(
        self,
        config: LeaseConfig,
        engine_id: str,
        incarnation: int,
        *,
        rank: int = 0,
        ranks: int = 1,
    ) -> None:
        if not engine_id:
            raise LocalProtocolError("engine_id must be a non-empty string")
        if type(incarnation) is not int or not 0 <= incarnation < 1 << 64:
            raise LocalProtocolError(f"incarnation must be a uint64, got {incarnation!r}")
        if type(rank) is not int or type(ranks) is not int or not 0 <= rank < ranks <= _MAX_RANK:
            raise LocalProtocolError(f"need 0 <= rank < ranks <= {_MAX_RANK}, got rank={rank} ranks={ranks}")
        budget = heartbeat_id_budget(config.max_message_bytes - config.frame_overhead, "", engine_id)
        if budget < MIN_ID_BUDGET:
            need = config.max_message_bytes - budget + MIN_ID_BUDGET
            raise ConfigError(
                "max_message_bytes", config.max_message_bytes, f">= {need} for the pinner engine id {engine_id!r}"
            )
        self.config = config
        self.engine_id = engine_id
        self.incarnation = incarnation
        # The id budget of a heartbeat whose ack fits this pinner's bound (spec §4.3): a larger
        # one is refused, so no ack this pinner sends can exceed max_message_bytes.
        self._ack_budget = budget
        # A heartbeat of at most this many ids fits the budget whatever its ids (5 + 9 n).
        self._ack_ids_always_fit = min((budget - 5) // 9, MAX_IDS)
        self.rank = rank
        self.ranks = ranks
        self.counters = PinnerCounters()
        self._leases: dict[int, _Lease] = {}
        self._layouts_ok: set[tuple[int, int]] = set()  # accessor (ranks, rank) that access this rank
        # One `_Steady` per accessor (engine, rank, session) some lease was steady for (pruned
        # to the live ones when it outgrows the leases, `_steady_key`).
        self._steady: dict[tuple[str, int, int], _Steady] = {}
        self._steady_cap = 64
        self._heap: list[tuple[float, int]] = []
        self._tombstones = Tombstones(config.tombstone_limit)
        self._by_key: dict[str, int] | None = {} if config.vllm_compat else None
        self._next_id = 1
        self._now = float("-inf")
        # Heartbeats naming a lease id not granted yet (spec §5.5 step 0): (answer by, message),
        # in arrival order, and the smallest highest-id among them.
        self._held: deque[tuple[float, Heartbeat]] = deque()
        self._held_ids = 0
        self._held_top = _U64

    # -- time -------------------------------------------------------------------------------

    def _check_now(self, now: LocalTime) -> float:
        """Refuse a reading the pinner cannot use, changing nothing."""
        check_time(now)
        if now < self._now:
            raise LocalProtocolError(f"time ran backwards: now={now} after {self._now}")
        return now

    def _advance(self, now: LocalTime) -> float:
        self._now = self._check_now(now)
        return now

    def next_deadline(self) -> LocalTime | None:
        """When `handle_timeout` next has work (possibly early, never late), or None."""
        if not self._held:
            return LocalTime(self._heap[0][0]) if self._heap else None
        # A held heartbeat is answered once its ids are granted, or at its answer-by time.
        due = self._now if self._held_top < self._next_id else self._held[0][0]
        return LocalTime(min(self._heap[0][0], due) if self._heap else due)

    def handle_timeout(self, now: LocalTime) -> tuple[PinnerOutput, ...]:
        """Answer held heartbeats that are due and expire every lease whose deadline has
        passed. Safe to call at any time."""
        self._advance(now)
        heap = self._heap
        if not self._held and (not heap or heap[0][0] > now):
            # Nothing due: the common case (a driver calls this every forward pass).
            if len(heap) > 2 * len(self._leases) + 64:
                self._compact()
            return ()
        out: list[PinnerOutput] = self._answer_held(now) if self._held else []
        while heap and heap[0][0] <= now:
            _, lease_id = heapq.heappop(heap)
            lease = self._leases.get(lease_id)
            if lease is None:
                continue  # ended earlier; its entry was left behind
            if lease.expiry > now:
                heapq.heappush(heap, (lease.expiry, lease_id))  # renewed since it was pushed
            elif lease.push and lease.state is not LeaseState.QUARANTINED:
                _to_quarantined(lease, self.config.push_guard)
                heapq.heappush(heap, (lease.expiry, lease_id))
            else:
                out.append(self._end(lease, _end_reason(lease, EndReason.EXPIRED), now))
        if len(heap) > 2 * len(self._leases) + 64:
            self._compact()
        return tuple(out)

    def _answer_held(self, now: float) -> list[PinnerOutput]:
        """Answer, in arrival order, every held heartbeat whose ids are all granted by now or
        whose answer-by time has come (its ids still not granted are then ``unknown``)."""
        out: list[PinnerOutput] = []
        keep: deque[tuple[float, Heartbeat]] = deque()
        top, count = _U64, 0
        for due, msg in self._held:
            if msg.lease_ids[-1] < self._next_id or due <= now:
                out.extend(self._answer(LocalTime(now), msg))
            else:
                keep.append((due, msg))
                top = min(top, msg.lease_ids[-1])
                count += len(msg.lease_ids)
        self._held, self._held_top, self._held_ids = keep, top, count
        return out

    def _compact(self) -> None:
        """Drop the entries ended leases left behind (bounds the heap at 2x live + 64)."""
        self._heap = [(lease.expiry, lid) for lid, lease in self._leases.items()]
        heapq.heapify(self._heap)

    # -- local calls ------------------------------------------------------------------------

    def grant(
        self,
        now: LocalTime,
        key: str,
        *,
        kind: LeaseKind = LeaseKind.RENEWABLE,
        push: bool = False,
        expected: int | None = None,
        ttl: float | None = None,
        lease_id: int | None = None,
        accessor: str | None = None,
    ) -> LeaseTicket:
        """Pin `key`'s memory under a new lease and return the ticket the accessor needs.

        Renewable leases last `kv_lease_duration` unless renewed; fixed-TTL ones last `ttl`
        (default `decoder_kv_blocks_ttl`) and are never extended. `push` marks memory the
        accessor will WRITE into (kept for the access-time bound after expiry). `expected`
        fixes how many accessor ranks must report done (default: as the accessor's layout
        says). `lease_id` lets a scheduler that fans a grant out to several workers use one
        id for all; ids only increase on one pinner incarnation (an id is never reused, so a
        late message about an old lease can never touch a new one). `accessor`: the accessor
        engine the router already picked, when it is known at grant; the lease is then bound to
        it from the start (otherwise to the first accessor that renews, completes or releases
        it), and no other engine can renew or end it.
        """
        self._check_now(now)
        if kind is _RENEWABLE and ttl is None:
            duration = self.config.kv_lease_duration
        elif kind is _FIXED_TTL:
            duration = self.config.decoder_kv_blocks_ttl if ttl is None else ttl
        else:
            raise LocalProtocolError("ttl is only for FIXED_TTL leases")
        if not isinstance(duration, int | float) or isinstance(duration, bool) or not 0.0 < duration < _INF:
            raise LocalProtocolError(f"lease duration must be positive and finite, got {duration!r}")
        if accessor is not None and (type(accessor) is not str or not accessor):
            raise LocalProtocolError(f"accessor must be a non-empty engine id, got {accessor!r}")
        if expected is not None and (type(expected) is not int or not 1 <= expected <= _MAX_RANK):
            raise LocalProtocolError(f"expected must be an integer in [1, {_MAX_RANK}], got {expected!r}")
        if lease_id is None:
            lease_id = self._next_id
        elif type(lease_id) is not int or not self._next_id <= lease_id < _U64:
            raise LocalProtocolError(
                f"lease_id must be an integer in [{self._next_id}, 2**64): ids only increase on one "
                f"incarnation, got {lease_id!r}"
            )
        if lease_id >= _U64:
            raise LocalProtocolError("lease ids of this incarnation are exhausted: restart with a new incarnation")
        expiry = now + duration
        check_time(expiry)
        self._now = now
        self._next_id = lease_id + 1
        lease = _Lease(lease_id, key, kind, expiry, expected or 0, push)
        lease.accessor = accessor
        self._leases[lease_id] = lease
        heapq.heappush(self._heap, (expiry, lease_id))
        if self._by_key is not None:
            self._by_key[key] = lease_id
        self.counters.granted += 1
        return LeaseTicket(
            engine_id=self.engine_id,
            incarnation=self.incarnation,
            lease_id=lease_id,
            kind=kind,
            deadline=PeerTime(expiry) if kind is _FIXED_TTL else None,
            ranks=self.ranks,
        )

    def release(self, now: LocalTime, lease_id: int) -> tuple[PinnerOutput, ...]:
        """The local engine aborts the request.

        Frees at once if no accessor can hold a validity window for the lease (no heartbeat
        was ever acknowledged). Otherwise the lease stops being renewed — heartbeats are
        answered with "released", so the accessor learns within one round trip — and is
        freed at its current expiry (plus the push guard for push leases): freeing earlier
        could pull memory from under an access the accessor was entitled to start.
        Releasing a lease that already ended (or any id below the next id, which may have
        ended and been forgotten) is a harmless race (no output); an id this incarnation
        never issued is misuse.
        """
        self._check_now(now)
        lease = self._leases.get(lease_id)
        if lease is None:
            if type(lease_id) is not int or not 1 <= lease_id < self._next_id:
                raise LocalProtocolError(f"lease id {lease_id!r} was never granted by this pinner")
            self._now = now
            return ()
        self._now = now
        if lease.state is not _ACTIVE or lease.expiry <= now:
            return ()  # already releasing, expired, or a push write may still land: expiry frees it
        if not lease.promised:
            return (self._end(lease, EndReason.RELEASED, now),)
        _to_releasing(lease)
        return ()

    def info(self, lease_id: int) -> LeaseInfo | None:
        lease = self._leases.get(lease_id)
        if lease is None:
            return None
        return LeaseInfo(
            lease.lease_id,
            lease.key,
            lease.kind,
            lease.state,
            LocalTime(lease.expiry),
            lease.push,
            len(lease.done or ()),
            lease.expected,
        )

    def ended_reason(self, lease_id: int) -> EndReason | None:
        """Why a finished lease ended, while its tombstone lasts."""
        return self._tombstones.reason(lease_id)

    @property
    def live_count(self) -> int:
        return len(self._leases)

    def live_ids(self) -> Iterable[int]:
        return self._leases.keys()

    # -- messages ---------------------------------------------------------------------------

    def receive(self, now: LocalTime, message: Message) -> tuple[PinnerOutput, ...]:
        """Handle one decoded message from an accessor."""
        self._advance(now)
        match message:
            case Heartbeat():
                return self._on_heartbeat(now, message)
            case AccessDone():
                return self._on_access_done(now, message)
            case Release():
                return self._on_release(now, message)
            case Handshake():
                return self._on_handshake(now, message)
            case HeartbeatAck() | AccessDoneAck() | HandshakeReply():
                self.counters.rejected += 1
                return (Rejected(message.engine_id, f"{type(message).__name__} is not for a pinner"),)

    def handshake_reply(self, now: LocalTime, message: Handshake) -> HandshakeReply:
        """The reply to a handshake, for a driver that answers on a side channel. It is bound
        to the handshake it answers (the accessor's rank, session, seq and send time)."""
        self._advance(now)
        caps = ALL_CAPABILITIES | (Capability.VLLM_COMPAT if self._by_key is not None else 0)
        return HandshakeReply(
            engine_id=self.engine_id,
            rank=self.rank,
            ranks=self.ranks,
            incarnation=self.incarnation,
            version=PROTOCOL_VERSION,
            capabilities=int(caps),
            max_message_bytes=self.config.max_message_bytes,
            extension=self.config.lease_extension,
            max_drift_rate=self.config.max_drift_rate,
            max_access_time=self.config.max_access_time,
            to_rank=message.rank,
            to_session=message.session,
            seq=message.seq,
            t_echo=message.t_send,
            t_recv=PeerTime(now),
            t_send=PeerTime(now),
        )

    def _on_handshake(self, now: LocalTime, msg: Handshake) -> tuple[PinnerOutput, ...]:
        reply = Send(msg.engine_id, msg.rank, self.handshake_reply(now, msg))
        if msg.version != PROTOCOL_VERSION:
            self.counters.rejected += 1
            why = f"handshake version {msg.version}, this pinner speaks {PROTOCOL_VERSION}"
            return (Rejected(msg.engine_id, why), reply)
        why_layout = layout_error(self.ranks, msg.ranks, msg.rank)
        if why_layout is not None:
            # Answered all the same: the reply carries our ranks, so the accessor refuses too.
            self.counters.rejected += 1
            return (Rejected(msg.engine_id, f"handshake: {why_layout}"), reply)
        return (reply,)

    def _layout_rejection(self, engine_id: str, what: str, rank: int, ranks: int) -> Rejected | None:
        """Refuse a message from an accessor rank that does not access this pinner rank."""
        if (ranks, rank) in self._layouts_ok:
            return None
        why = layout_error(self.ranks, ranks, rank)
        if why is None and self.rank not in tp_layout(self.ranks, ranks, rank).targets:
            why = f"accessor rank {rank} of {ranks} does not access pinner rank {self.rank} of {self.ranks}"
        if why is None:
            if len(self._layouts_ok) < _LAYOUTS_KEPT:
                self._layouts_ok.add((ranks, rank))
            return None
        self.counters.rejected += 1
        return Rejected(engine_id, f"{what}: {why}")

    # Binding (spec §5.2, `kvlease._binding`): class attributes, so a test double can swap one.
    _bound_elsewhere = staticmethod(bound_elsewhere)
    _bind = staticmethod(bind)
    _fresh_renewal = staticmethod(fresh_renewal)

    def _on_heartbeat(self, now: LocalTime, msg: Heartbeat) -> tuple[PinnerOutput, ...]:
        self.counters.heartbeats += 1
        bad = self._layout_rejection(msg.engine_id, "heartbeat", msg.rank, msg.ranks)
        if bad is not None:
            return (bad,)
        ids = msg.lease_ids
        if len(ids) > self._ack_ids_always_fit and chunk_cost(ids) > self._ack_budget:
            # Its ack could exceed our bound: an honest accessor splits by the smaller of both
            # bounds (spec §4.3) and never sends this. No ack, so nothing oversized is built.
            self.counters.rejected += 1
            why = f"heartbeat of {len(ids)} ids costs more than the {self._ack_budget}-byte id budget of its ack"
            return (Rejected(msg.engine_id, why),)
        if (
            ids
            and ids[-1] >= self._next_id
            and msg.incarnation == self.incarnation
            and self._held_ids + len(ids) <= MAX_HELD_IDS
        ):
            # It names a lease this rank has not granted yet: its ticket went out before the
            # grant reached this rank (vLLM publishes the ticket a step before its workers
            # grant). Answered `unknown` now, the accessor would lose a lease about to exist:
            # held instead, and answered once granted or after one heartbeat interval. Holding
            # is safe: a later renewal extends further than the receipt's would have.
            self._held.append((now + self.config.heartbeat_interval, msg))
            self._held_ids += len(ids)
            self._held_top = min(self._held_top, ids[-1])
            self.counters.heartbeats_held += 1
            return ()
        return self._answer(now, msg)

    def _answer(self, now: LocalTime, msg: Heartbeat) -> tuple[PinnerOutput, ...]:
        """Renew what a heartbeat names and acknowledge it (spec §5.5 steps 2-4)."""
        out: list[PinnerOutput] = []
        renewed, unknown, expired, released, completed, foreign = self._renew(
            now, msg.incarnation, msg.lease_ids, msg.engine_id, msg.rank, msg.session, msg.seq
        )
        self.counters.heartbeat_ids_missing += len(msg.lease_ids) - renewed
        if foreign:
            self.counters.rejected += 1
            out.append(Rejected(msg.engine_id, f"heartbeat names {foreign} lease(s) held for another accessor"))
        ack = HeartbeatAck(
            engine_id=self.engine_id,
            rank=self.rank,
            incarnation=self.incarnation,
            to_rank=msg.rank,
            to_session=msg.session,
            seq=msg.seq,
            t_echo=msg.t_send,
            t_recv=PeerTime(now),
            extension=self.config.lease_extension,
            renewed=renewed,
            unknown=tuple(unknown),
            expired=tuple(expired),
            released=tuple(released),
            completed=tuple(completed),
        )
        out.append(Send(msg.engine_id, msg.rank, ack))
        return tuple(out)

    def _renew(
        self,
        now: LocalTime,
        incarnation: int,
        lease_ids: Iterable[int],
        engine_id: str,
        rank: int,
        session: int,
        seq: int | None,
    ) -> tuple[int, list[int], list[int], list[int], list[int], int]:
        """Renew every named lease that is ACTIVE, not yet expired at `now`, and held for this
        accessor; classify the rest. A heartbeat no newer (by `seq`) than one that already
        extended a lease is acknowledged as renewed but extends nothing: a newer heartbeat
        of the same session was sent later, so its renewal already covers the older one's
        validity, and a replayed frame cannot keep memory pinned. Returns (renewed, unknown,
        expired, released, completed, how many were held for another accessor)."""
        unknown: list[int] = []
        expired: list[int] = []
        released: list[int] = []
        completed: list[int] = []
        renewed = 0
        foreign = 0
        if incarnation != self.incarnation:
            unknown = list(lease_ids)
        else:
            new_expiry = now + self.config.lease_extension
            get = self._leases.get
            tombstones = self._tombstones
            if seq is None:
                key, top = _NOT_STEADY, 0
            else:
                key = self._steady.get((engine_id, rank, session)) or _NOT_STEADY
                top = seq
            for lease_id in lease_ids:
                lease = get(lease_id)
                if lease is not None and lease.steady is key and lease.expiry > now:
                    # The steady state, in one test: an ACTIVE renewable lease this very session
                    # of this rank renewed before (so bound to it, and promised).
                    if top > lease.b_seq:
                        lease.b_seq = top
                        if new_expiry > lease.expiry:
                            lease.expiry = new_expiry
                    renewed += 1
                    continue
                if lease is not None and lease.state is _ACTIVE and lease.expiry > now:
                    # Binding (inlined `_bound_elsewhere` + `_bind` + `_fresh_renewal`: this loop
                    # is the hot path). The steady state first: the lease is bound to this very
                    # rank of this engine, which `bind` leaves as it is.
                    bound = lease.accessor
                    if bound == engine_id and lease.b_rank == rank:
                        if lease.b_session != session:
                            foreign += 1
                            unknown.append(lease_id)
                            continue
                        if seq is None or seq > lease.b_seq:
                            if seq is not None:
                                lease.b_seq = seq
                            if lease.kind is _RENEWABLE and new_expiry > lease.expiry:
                                lease.expiry = new_expiry
                        lease.promised = True
                        if seq is not None and lease.kind is _RENEWABLE:
                            lease.steady = key = self._steady_key(engine_id, rank, session)
                        renewed += 1
                        continue
                    if bound is None:
                        lease.accessor = engine_id
                        lease.b_rank, lease.b_session, lease.b_seq = rank, session, (0 if seq is None else seq)
                        fresh = True
                    elif bound != engine_id or self._bound_elsewhere(lease, engine_id, rank, session):
                        foreign += 1
                        unknown.append(lease_id)
                        continue
                    else:
                        self._bind(lease, engine_id, rank, session)
                        fresh = self._fresh_renewal(lease, rank, seq)
                    if fresh and lease.kind is _RENEWABLE and new_expiry > lease.expiry:
                        lease.expiry = new_expiry
                    lease.promised = True  # `_promise`, inlined
                    if seq is not None and lease.kind is _RENEWABLE and lease.b_rank == rank:
                        lease.steady = key = self._steady_key(engine_id, rank, session)
                    renewed += 1
                    continue
                reason: EndReason | None
                if lease is not None:  # releasing, quarantined or overdue: held, but no longer renewed
                    reason = _end_reason(lease, EndReason.EXPIRED)
                else:
                    tomb = tombstones.get(lease_id)
                    reason = None if tomb is None else tomb.reason
                if reason is EndReason.EXPIRED:
                    expired.append(lease_id)
                elif reason is EndReason.RELEASED:
                    released.append(lease_id)
                elif reason is EndReason.ACCESS_DONE:
                    completed.append(lease_id)
                else:
                    unknown.append(lease_id)
        self.counters.renewed += renewed
        return renewed, unknown, expired, released, completed, foreign

    def _steady_key(self, engine_id: str, rank: int, session: int) -> _Steady:
        """The interned `_Steady` of this accessor session (made on first use)."""
        k = (engine_id, rank, session)
        steady = self._steady.get(k)
        if steady is None:
            if len(self._steady) >= self._steady_cap:
                # Sessions come and go (accessor restarts, a peer naming new ones): keep those a
                # live lease is steady for, and let the dict double (plus 64) before the next
                # pass: amortized O(1) per new session.
                live = {id(lease.steady) for lease in self._leases.values()}
                self._steady = {key: v for key, v in self._steady.items() if id(v) in live}
                self._steady_cap = 2 * len(self._steady) + 64
            steady = self._steady[k] = _Steady()
        return steady

    def _on_access_done(self, now: LocalTime, msg: AccessDone) -> tuple[PinnerOutput, ...]:
        bad = self._layout_rejection(msg.engine_id, "access-done", msg.rank, msg.ranks)
        if bad is not None:
            return (bad,)
        if msg.to_rank != self.rank:
            # One part's notification delivered to a sibling rank: that rank's own part may
            # still be running, so it counts nothing here (and draws no verdict).
            self.counters.rejected += 1
            why = f"access-done for pinner rank {msg.to_rank} delivered to rank {self.rank}"
            return (Rejected(msg.engine_id, why),)
        out: list[PinnerOutput] = []
        expected = tp_layout(self.ranks, msg.ranks, msg.rank).expected
        outcome = self._count_access(
            now, msg.incarnation, msg.lease_id, msg.engine_id, msg.rank, msg.session, expected, out
        )
        if msg.confirm:
            ack = AccessDoneAck(
                self.engine_id, self.rank, self.incarnation, msg.rank, msg.session, msg.lease_id, msg.attempt, outcome
            )
            out.append(Send(msg.engine_id, msg.rank, ack))
        return tuple(out)

    def _count_access(
        self,
        now: LocalTime,
        incarnation: int,
        lease_id: int,
        sender: str,
        rank: int,
        session: int,
        expected: int,
        out: list[PinnerOutput],
    ) -> AccessOutcome:
        """Count one accessor rank's access-done; the verdict is OK iff the memory was still
        pinned, not overdue, and held for this accessor when the message was handled (or the
        lease already completed with this very rank counted)."""
        lease = self._leases.get(lease_id) if incarnation == self.incarnation else None
        if lease is None:
            tomb = self._tombstones.get(lease_id) if incarnation == self.incarnation else None
            if tomb is not None and tomb.confirms(sender, rank, session):
                return AccessOutcome.OK  # a duplicate of this rank's access-done, counted while live
            self.counters.late_access_done += 1
            return AccessOutcome.STALE if tomb is not None else AccessOutcome.UNKNOWN
        if not _counts(lease, now):
            self.counters.late_access_done += 1
            return AccessOutcome.STALE  # expired (the next handle_timeout frees or quarantines it)
        # ACTIVE or RELEASING: the memory is still pinned, so the access saw valid data.
        if not self._count_rank(now, lease, "access-done", sender, rank, session, expected, out):
            return AccessOutcome.STALE
        return AccessOutcome.OK

    def _count_rank(
        self,
        now: LocalTime,
        lease: _Lease,
        what: str,
        sender: str,
        rank: int,
        session: int,
        expected: int,
        out: list[PinnerOutput],
        *,
        release: bool = False,
        hold: bool = False,
    ) -> bool:
        """Count accessor rank `rank` of `sender` as finished with the lease (an access-done,
        or with `release` a Release, which counts like an access-done without data); end the
        lease when every expected rank is counted. The one place ranks are counted (stock
        vLLM read-dones too, by `_count_pseudo_rank`). False, with a `Rejected` in `out`: the
        lease is held for another accessor, or `expected` disagrees with the grant's."""
        if self._bound_elsewhere(lease, sender, rank, session):
            self.counters.rejected += 1
            of = "of" if release else "for"
            out.append(Rejected(sender, f"{what} {of} lease {lease.lease_id}, which is held for another accessor"))
            return False
        if lease.expected and expected != lease.expected:
            self.counters.rejected += 1
            why = f"{what} for lease {lease.lease_id} expects {expected} ranks, granted with {lease.expected}"
            out.append(Rejected(sender, why))
            return False
        self._bind(lease, sender, rank, session)
        if hold:
            _to_held(lease)
        elif release:
            _flag_released(lease)
        self._count_pseudo_rank(now, lease, rank, expected, out)
        return True

    def _count_pseudo_rank(
        self, now: LocalTime, lease: _Lease, rank: int, expected: int, out: list[PinnerOutput]
    ) -> None:
        lease.expected = expected
        done = (lease.done or frozenset()) | {rank}
        lease.done = done
        if len(done) >= expected and not lease.hold:
            out.append(self._end(lease, _end_reason(lease, EndReason.ACCESS_DONE), now))

    def _on_release(self, now: LocalTime, msg: Release) -> tuple[PinnerOutput, ...]:
        bad = self._layout_rejection(msg.engine_id, "release", msg.rank, msg.ranks)
        if bad is not None:
            return (bad,)
        if msg.incarnation != self.incarnation:
            return ()
        out: list[PinnerOutput] = []
        expected = tp_layout(self.ranks, msg.ranks, msg.rank).expected
        for lease_id in msg.lease_ids:
            lease = self._leases.get(lease_id)
            if lease is None or not _counts(lease, now):
                continue  # ended, or expired: expiry frees it
            # The lease ends only when every expected accessor rank has finished or released,
            # so one rank's abort never frees memory another rank may be reading.
            self._count_rank(
                now,
                lease,
                "release",
                msg.engine_id,
                msg.rank,
                msg.session,
                expected,
                out,
                release=True,
                hold=msg.posted and lease.push,
            )
        return tuple(out)

    # -- vLLM compatibility -----------------------------------------------------------------

    def receive_vllm_heartbeat(self, now: LocalTime, request_ids: Iterable[str]) -> int:
        """Renew by request id, as a stock vLLM decoder's ``HB:`` notification asks. vLLM
        expects no answer. Returns how many were renewed. Needs ``vllm_compat=True``."""
        self._check_now(now)
        by_key = self._require_compat()
        self._now = now
        ids = sorted({by_key[k] for k in request_ids if k in by_key})
        self.counters.heartbeats += 1
        renewed = self._renew(now, self.incarnation, ids, _COMPAT_ENGINE, 0, 0, None)[0]
        return renewed

    def receive_vllm_done(self, now: LocalTime, request_id: str, count: int) -> tuple[PinnerOutput, ...]:
        """Handle a stock vLLM ``id:count`` read-done notification (one per reading worker;
        the lease ends after `count` of them)."""
        self._check_now(now)
        by_key = self._require_compat()
        self._now = now
        lease_id = by_key.get(request_id)
        lease = None if lease_id is None else self._leases.get(lease_id)
        if lease is None or not _counts(lease, now):
            self.counters.late_access_done += 1
            return ()
        if lease.accessor is not None and lease.accessor != _COMPAT_ENGINE:
            self.counters.rejected += 1
            return (Rejected(_COMPAT_ENGINE, f"vLLM read-done for {request_id!r}, held for a kvlease accessor"),)
        if not 1 <= count <= _MAX_RANK or (lease.expected and count != lease.expected):
            self.counters.rejected += 1
            return (Rejected(_COMPAT_ENGINE, f"vLLM read-done for {request_id!r} counts {count} readers"),)
        lease.accessor = _COMPAT_ENGINE
        out: list[PinnerOutput] = []
        pseudo_rank = _COMPAT_RANK_BASE + len(lease.done or ())
        self._count_pseudo_rank(now, lease, pseudo_rank, count, out)
        return tuple(out)

    def _require_compat(self) -> dict[str, int]:
        if self._by_key is None:
            raise LocalProtocolError("vLLM compatibility needs LeaseConfig(vllm_compat=True)")
        return self._by_key

    # -- internals --------------------------------------------------------------------------

    def _end(self, lease: _Lease, reason: EndReason, now: LocalTime) -> Free:
        _to_ended(lease)
        del self._leases[lease.lease_id]
        if self._by_key is not None and self._by_key.get(lease.key) == lease.lease_id:
            del self._by_key[lease.key]
        bound = sessions(lease) if reason is EndReason.ACCESS_DONE else None
        self._tombstones.record(lease.lease_id, reason, lease.accessor, lease.done, bound)
        if reason is EndReason.EXPIRED:
            self.counters.expired += 1
        elif reason is EndReason.RELEASED:
            self.counters.released += 1
        else:
            self.counters.completed += 1
        return Free(lease.lease_id, lease.key, reason, now)
