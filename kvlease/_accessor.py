"""The accessor: the side that will read (pull) or write (push) a pinner's memory.

It tracks a request from the moment it enters the scheduler, groups leases by pinner engine,
sends one batched heartbeat per engine per interval (split to the size bound, to each pinner
rank this accessor rank accesses), asks for a handshake with engines not yet connected, and
learns from acknowledgements which leases the pinner no longer holds.

Validity (Gray & Cheriton): an acknowledged heartbeat sent at local time ``t`` proves the lease
live until ``t + accessor_extension`` in *our* clock — the extension shrunk for drift and a margin
— with no synchronized clocks. An access is reported complete only if it finished inside that
window, or if the pinner confirms it handled the access-done while the lease was live; anything
else is reported stale. A push-mode WRITE is never started unless the window covers the
access-time bound. Fixed-TTL leases are valid until the pinner's deadline converted to our clock
conservatively by `ClockOffsetEstimator`.

Identity: every reply it trusts is bound to the message it answers — the accessor's rank, its
session (a random incarnation per accessor process) and a per-session sequence number that never
repeats — so a reply meant for a sibling rank, an earlier session, an earlier connection or an
earlier access attempt confers nothing. A lease it gave up (untracked, completed, lost, or whose
posted transfer failed) is never tracked again, because a message it sent about that lease may
still be in flight and end the lease under a later access.

Never reads a clock, never does I/O.
"""

from __future__ import annotations

import enum
import heapq

import attrs

from ._clock import MAX_TIME, ClockOffsetEstimator, ClockSample, LocalTime, check_time
from ._codec import MIN_ID_BUDGET, heartbeat_id_budget, split_ids
from ._config import LeaseConfig
from ._errors import ConfigError, LocalProtocolError
from ._events import (
    AccessCompleted,
    AccessorOutput,
    AccessStale,
    HandshakeNeeded,
    LeaseLost,
    LostReason,
    Rejected,
    Send,
)
from ._layout import MAX_RANKS, TpLayout, layout_error, tp_layout
from ._messages import (
    ALL_CAPABILITIES,
    PROTOCOL_VERSION,
    AccessDone,
    AccessDoneAck,
    AccessOutcome,
    Handshake,
    HandshakeReply,
    Heartbeat,
    HeartbeatAck,
    LeaseKind,
    LeaseTicket,
    Message,
    Release,
)
from ._peer import Outstanding, PinnerEngine, Round
from ._records import GivenUp
from ._terms import LeaseTerms

__all__ = ["AccessDecision", "Accessor", "TrackedState"]

_U64 = 1 << 64
_NEG_INF = float("-inf")


class TrackedState(enum.Enum):
    WAITING = "waiting"  # tracked, heartbeating, not being accessed
    ACCESSING = "accessing"  # a READ or WRITE is in flight
    CONFIRMING = "confirming"  # finished outside the window; waiting for the pinner's verdict
    LOST = "lost"  # the lease is gone; an access in flight will be reported stale


#: The states whose leases a periodic heartbeat renews.
_HEARTBEATING = (TrackedState.WAITING, TrackedState.ACCESSING)


@attrs.frozen
class AccessDecision:
    """The answer to `Accessor.begin_access`."""

    allowed: bool
    #: The access is covered by the validity window for the access-time bound: if it finishes
    #: in time it is valid without asking the pinner.
    guaranteed: bool
    valid_until: LocalTime | None
    reason: str = ""
    #: The access-dones to attach to the transfer, one per target rank (in `targets` order),
    #: so the transport delivers each to its pinner rank only after that part's data has
    #: landed (NIXL: the transfer's notification). Each names its pinner rank: attach
    #: `notification_for(rank)` to the part that accesses `rank`. Pass ``notified=True`` to
    #: `Accessor.access_finished` when they were attached.
    notifications: tuple[AccessDone, ...] = ()
    #: The pinner ranks this accessor rank accesses (and notifies), for heterogeneous TP.
    targets: tuple[int, ...] = ()
    #: The pinner engine the access goes to.
    engine_id: str = ""

    @property
    def notification(self) -> AccessDone | None:
        """The one access-done of an access of a single pinner rank (None if not allowed). An
        access of several pinner ranks has one per rank: `notification_for` (asking this of
        one is misuse: attaching one rank's access-done to every part is what lets a
        misdelivered part free a rank whose part is still running)."""
        if len(self.notifications) > 1:
            raise LocalProtocolError(
                f"the access targets pinner ranks {list(self.targets)}: use notification_for(rank) per part"
            )
        return self.notifications[0] if self.notifications else None

    def notification_for(self, rank: int) -> AccessDone:
        """The access-done to attach to the part of the transfer that accesses pinner `rank`."""
        for note in self.notifications:
            if note.to_rank == rank:
                return note
        raise LocalProtocolError(f"pinner rank {rank} is not a target of this access ({list(self.targets)})")


class _Tracked:
    __slots__ = (
        "acked_send",
        "attached_confirm",
        "attempt",
        "confirm_deadline",
        "confirm_pending",
        "early_verdicts",
        "engine",
        "finished_at",
        "held",
        "incarnation",
        "key",
        "kind",
        "lease_id",
        "push",
        "state",
        "tracked_at",
        "valid_until",
    )

    def __init__(self, key: str, engine: PinnerEngine, ticket: LeaseTicket, push: bool, now: float) -> None:
        self.key = key
        self.engine = engine
        self.lease_id = ticket.lease_id
        self.incarnation = ticket.incarnation
        self.kind = ticket.kind
        self.push = push
        self.state = TrackedState.WAITING
        self.tracked_at = now
        self.valid_until = _NEG_INF
        self.acked_send = _NEG_INF  # the send time of the newest round every target acknowledged
        # A heartbeat round sent after tracking was acknowledged by every target rank without
        # listing the lease: the pinner held it for this accessor then. A fixed-TTL lease has
        # no validity before that (its deadline alone does not say the lease is still ours).
        self.held = False
        self.attempt = 0  # the seq of the current access attempt's begin_access
        self.confirm_deadline = _NEG_INF  # CONFIRMING: give up (stale) at this local time
        self.finished_at = _NEG_INF  # CONFIRMING: when the access finished (local time)
        self.confirm_pending: set[int] = set()
        self.attached_confirm = False  # the notification handed out by begin_access asks to confirm
        # Verdicts on that attached notification that arrived before access_finished (a transport
        # may report the transfer done after the pinner already answered), for this attempt only.
        self.early_verdicts: dict[int, AccessOutcome] | None = None


class Accessor:
    """The accessor side of the lease protocol for one worker (rank) of one engine.

    `session` is this accessor's incarnation: a random 64-bit value that must differ between
    restarts of the process (the pinner binds a lease to the session that first renews it, and
    every reply echoes it). Ranks of one engine may share a session or use their own.
    """

    def __init__(self, config: LeaseConfig, engine_id: str, *, session: int, rank: int = 0, ranks: int = 1) -> None:
        if not engine_id:
            raise LocalProtocolError("engine_id must be a non-empty string")
        if type(session) is not int or not 0 <= session < _U64:
            raise LocalProtocolError(f"session must be a uint64, got {session!r}")
        if type(rank) is not int or type(ranks) is not int or not 0 <= rank < ranks <= MAX_RANKS:
            raise LocalProtocolError(f"need 0 <= rank < ranks <= {MAX_RANKS}, got rank={rank!r} ranks={ranks!r}")
        budget = heartbeat_id_budget(config.max_message_bytes - config.frame_overhead, engine_id, "")
        if budget < MIN_ID_BUDGET:
            need = config.max_message_bytes - budget + MIN_ID_BUDGET
            raise ConfigError(
                "max_message_bytes", config.max_message_bytes, f">= {need} for the accessor engine id {engine_id!r}"
            )
        self.config = config
        self.engine_id = engine_id
        self.session = session
        self.rank = rank
        self.ranks = ranks
        self._engines: dict[str, PinnerEngine] = {}
        self._tracked: dict[str, _Tracked] = {}
        # (time to look at the lease again, key): a lower bound of when its validity lapses.
        self._checks: list[tuple[float, str]] = []
        self._now = _NEG_INF
        self._seq = 0  # every handshake, heartbeat and access attempt takes the next one
        # Leases this accessor gave up: never tracked again (a message it sent about one may
        # still be in flight). Bounded by a watermark per (pinner engine, incarnation).
        self._given_up = GivenUp(config.tombstone_limit)

    # -- time -------------------------------------------------------------------------------

    def _check_now(self, now: LocalTime) -> float:
        """Refuse a reading the accessor cannot use, changing nothing."""
        check_time(now)
        if now < self._now:
            raise LocalProtocolError(f"time ran backwards: now={now} after {self._now}")
        return now

    def _advance(self, now: LocalTime) -> float:
        self._now = self._check_now(now)
        return now

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def next_deadline(self) -> LocalTime | None:
        best = self._checks[0][0] if self._checks else float("inf")
        for eng in self._engines.values():
            if not eng.leases:
                continue
            if eng.connected:
                best = min(best, eng.next_heartbeat)
                if eng.new_ids and len(eng.rounds) < self.config.max_outstanding_heartbeats:
                    best = min(best, self._now)
            else:
                best = min(best, eng.handshake_due)
        return None if best == float("inf") else LocalTime(best)

    def handle_timeout(self, now: LocalTime) -> tuple[AccessorOutput, ...]:
        """Send due heartbeats and handshakes, and report leases whose validity lapsed."""
        # `_advance`, inlined: a driver calls this on every forward pass of every rank.
        if not -MAX_TIME <= now <= MAX_TIME:
            check_time(now)
        if now < self._now:
            raise LocalProtocolError(f"time ran backwards: now={now} after {self._now}")
        self._now = now
        out: list[AccessorOutput] = []
        for eng in self._engines.values():
            if not eng.leases:
                continue
            if not eng.connected:
                if eng.handshake_due <= now:
                    eng.handshake_due = now + self.config.heartbeat_interval
                    out.append(HandshakeNeeded(eng.engine_id, self._handshake(now, eng)))
            elif eng.next_heartbeat <= now:
                eng.new_ids.clear()
                eng.next_heartbeat = now + eng.terms.heartbeat_interval
                ids = [i for (inc, i), t in eng.leases.items() if t.state in _HEARTBEATING and inc == eng.incarnation]
                self._make_room(now, eng, periodic=True)
                self._send_heartbeats(now, eng, sorted(ids), out)
            elif eng.new_ids and self._make_room(now, eng, periodic=False):
                # With max_outstanding_heartbeats rounds awaiting acks the new ids wait (for an
                # ack, or the periodic round): dropping a round before its ack could return is
                # what lets a fast-tracking accessor never validate anything.
                ids = sorted(i for inc, i in eng.new_ids if inc == eng.incarnation)
                eng.new_ids.clear()
                self._send_heartbeats(now, eng, ids, out)
        checks = self._checks
        if not out and (not checks or checks[0][0] > now):
            return ()  # nothing due: the common case
        while checks and checks[0][0] <= now:
            _, key = heapq.heappop(checks)
            t = self._tracked.get(key)
            if t is None:
                continue
            due = self._lapse_time(t)
            if due > now:
                heapq.heappush(checks, (due, key))
            elif t.state is TrackedState.CONFIRMING:
                self._forget(t)
                out.append(AccessStale(t.key, t.lease_id, "the pinner did not confirm the access in time"))
            elif t.state is TrackedState.WAITING:
                reason = LostReason.TTL_PASSED if t.kind is LeaseKind.FIXED_TTL else LostReason.VALIDITY_LAPSED
                self._forget(t)
                out.append(LeaseLost(t.key, t.lease_id, reason))
            # ACCESSING / LOST: the access in flight decides when it finishes.
        return tuple(out)

    def _lapse_time(self, t: _Tracked) -> float:
        if t.state is TrackedState.CONFIRMING:
            return t.confirm_deadline
        if t.kind is LeaseKind.FIXED_TTL:
            if t.valid_until == _NEG_INF:
                # Not yet held (or no clock sample): give up after a lease duration without one.
                return t.tracked_at + self.config.kv_lease_duration
            return t.valid_until
        # Renewable: a lapsed validity window only means we cannot *prove* the lease live (the
        # access would be confirmed, a push refused); heartbeats keep going and the pinner's
        # answer decides. Give up only after a whole lease duration without any acknowledgement
        # (since the last acknowledged heartbeat was sent, or since tracking): the pinner is
        # then dead or unreachable, and would have expired the lease.
        anchor = t.tracked_at if t.acked_send == _NEG_INF else t.acked_send
        return anchor + self.config.kv_lease_duration

    # -- local calls ------------------------------------------------------------------------

    def track(self, now: LocalTime, key: str, ticket: LeaseTicket, *, push: bool = False) -> tuple[AccessorOutput, ...]:
        """Start heartbeating for a request the moment it enters the scheduler.

        A lease is tracked at most once by one accessor: tracking a ticket this accessor
        tracked before (after untrack, completion, loss or a failed transfer) raises
        `LocalProtocolError` — a message about the earlier tracking may still be in flight and
        end the lease under the new one; a fresh lease is needed. A ticket older than this
        accessor's memory of given-up leases gives `LeaseLost(FORGOTTEN)` for the same reason.
        """
        self._check_now(now)
        if key in self._tracked:
            raise LocalProtocolError(f"request {key!r} is already tracked")
        if push and ticket.kind is LeaseKind.FIXED_TTL:
            raise LocalProtocolError("push mode is for renewable leases")
        why = layout_error(ticket.ranks, self.ranks, self.rank)
        if why is not None:
            raise LocalProtocolError(f"lease {ticket.lease_id} of {ticket.engine_id!r}: {why}")
        rkey = (ticket.engine_id, ticket.incarnation, ticket.lease_id)
        if rkey in self._given_up:
            raise LocalProtocolError(
                f"lease {ticket.lease_id} of {ticket.engine_id!r} was tracked before by this accessor and given up; "
                "a message about it may still be in flight, so re-tracking it needs a fresh lease"
            )
        lkey = (ticket.incarnation, ticket.lease_id)
        known = self._engines.get(ticket.engine_id)
        if known is not None and lkey in known.leases:
            raise LocalProtocolError(f"lease {ticket.lease_id} of {ticket.engine_id!r} is already tracked")
        self._now = now
        if self._given_up.below_watermark(ticket.engine_id, ticket.incarnation, ticket.lease_id):
            return (LeaseLost(key, ticket.lease_id, LostReason.FORGOTTEN),)
        eng = self._engines.get(ticket.engine_id)
        if eng is None:
            eng = self._engines[ticket.engine_id] = PinnerEngine(ticket.engine_id, self.config, ticket.ranks)
        if eng.connected and eng.incarnation == ticket.incarnation and eng.ranks != ticket.ranks:
            self._retire(rkey)
            return (LeaseLost(key, ticket.lease_id, LostReason.UNKNOWN),)
        t = _Tracked(key, eng, ticket, push, now)
        if not eng.connected:
            eng.ranks = ticket.ranks
        self._tracked[key] = t
        eng.leases[lkey] = t
        if eng.connected and eng.incarnation != ticket.incarnation:
            # Either this ticket is stale or the pinner restarted and we have not noticed:
            # a fresh handshake settles which leases still exist.
            eng.connected = False
            eng.handshake_due = now
        if not eng.connected:
            if eng.handshakes and eng.handshake_for != ticket.incarnation:
                # A reply to a handshake sent before this ticket was known may come from an
                # earlier incarnation than the ticket's; it must not decide this lease's fate.
                eng.handshakes.clear()
                eng.handshake_due = now
            eng.handshake_for = ticket.incarnation
        if ticket.kind is LeaseKind.FIXED_TTL:
            assert ticket.deadline is not None
            eng.deadlines[lkey] = ticket.deadline
            self._refresh_fixed(now, eng, t)
        heapq.heappush(self._checks, (self._lapse_time(t), key))
        out: list[AccessorOutput] = []
        if eng.connected:
            eng.new_ids.add(lkey)
        elif eng.handshake_due <= now:
            eng.handshake_due = now + self.config.heartbeat_interval
            out.append(HandshakeNeeded(eng.engine_id, self._handshake(now, eng)))
        return tuple(out)

    def untrack(self, now: LocalTime, key: str) -> tuple[AccessorOutput, ...]:
        """The request finished or was aborted before its access: stop heartbeating and tell
        the pinner it may free now. Untracking an unknown key is a harmless no-op (the lease
        may have been reported lost already)."""
        self._check_now(now)
        t = self._tracked.get(key)
        if t is not None and (t.state is TrackedState.ACCESSING or t.state is TrackedState.LOST):
            # LOST: lost while an access is in flight; the access is still the engine's to end.
            raise LocalProtocolError(f"request {key!r} has an access in flight: finish or fail it first")
        self._now = now
        if t is None:
            return ()
        self._forget(t)
        return self._release(t)

    def begin_access(self, now: LocalTime, key: str) -> AccessDecision:
        """Ask before starting the READ (pull) or WRITE (push) of `key`'s memory.

        Pull: allowed unless the lease is known lost; `guaranteed` when the window covers the
        access-time bound (otherwise the pinner is asked to confirm at the end). Push: allowed
        only when guaranteed, since a write that lands after a free cannot be taken back.
        """
        self._advance(now)
        t = self._tracked.get(key)
        if t is None:
            return AccessDecision(False, False, None, "not tracked (finished, lost, or never tracked)")
        eng = t.engine
        if t.state is not TrackedState.WAITING:
            return AccessDecision(False, False, None, f"lease is {t.state.value}", engine_id=eng.engine_id)
        if not eng.connected or eng.incarnation != t.incarnation:
            return AccessDecision(
                False, False, None, "the pinner engine is not connected (handshake pending)", engine_id=eng.engine_id
            )
        if t.kind is LeaseKind.FIXED_TTL:
            self._refresh_fixed(now, eng, t)
        valid = None if t.valid_until == _NEG_INF else LocalTime(t.valid_until)
        guaranteed = valid is not None and now + eng.terms.access_time_local <= valid
        if t.push and not guaranteed:
            return AccessDecision(
                False, False, valid, "validity window does not cover the access-time bound", engine_id=eng.engine_id
            )
        t.state = TrackedState.ACCESSING
        t.attempt = self._next_seq()
        t.early_verdicts = None
        layout = self._layout(eng)
        # Not covered for the whole access: the attached notification asks the pinner to confirm.
        t.attached_confirm = not guaranteed
        notes = tuple(self._access_done(t, not guaranteed, now, r) for r in layout.targets)
        return AccessDecision(True, guaranteed, valid, "", notes, tuple(layout.targets), eng.engine_id)

    def access_failed(self, now: LocalTime, key: str, *, posted: bool = True) -> tuple[AccessorOutput, ...]:
        """The transfer failed at the transport.

        `posted`: the transfer (with its attached notification) was handed to the transport.
        Its notification may then still land — a cancel can race the completion — and end the
        lease at the pinner, so the lease is given up: a `Release` goes to the pinner ranks and
        `LeaseLost(ACCESS_FAILED)` tells the engine to fetch a fresh lease (recompute). With
        ``posted=False`` nothing of the attempt can reach the pinner and the lease stays
        tracked for a retry.
        """
        self._check_now(now)
        t = self._require(key, TrackedState.ACCESSING, TrackedState.LOST)
        self._now = now
        if t.state is TrackedState.LOST:
            self._forget(t)
            return ()
        t.early_verdicts = None
        if not posted:
            t.state = TrackedState.WAITING
            heapq.heappush(self._checks, (self._lapse_time(t), key))
            return ()
        self._forget(t)
        # `posted`: a WRITE of this attempt may still land, so a push lease's memory is kept to
        # its expiry and the push guard rather than freed on this Release (spec §5.9).
        return (*self._release(t, posted=True), LeaseLost(key, t.lease_id, LostReason.ACCESS_FAILED))

    def access_finished(self, now: LocalTime, key: str, *, notified: bool = False) -> tuple[AccessorOutput, ...]:
        """The READ/WRITE finished. Reports it complete only if it provably did not overlap a
        free; otherwise asks the pinner and reports the verdict later (or stale on timeout).

        `notified`: the transport delivered `AccessDecision.notification` with the transfer
        (after the data landed), so the access-done is sent again only if a confirmation is
        needed that the attached one did not ask for.
        """
        self._check_now(now)
        t = self._require(key, TrackedState.ACCESSING, TrackedState.LOST)
        self._now = now
        eng = t.engine
        targets = self._layout(eng).targets
        if t.state is TrackedState.LOST:
            self._forget(t)
            sends = (
                () if notified else tuple(Send(eng.engine_id, r, self._access_done(t, False, now, r)) for r in targets)
            )
            return (*sends, AccessStale(key, t.lease_id, "the lease was lost during the access"))
        if t.kind is LeaseKind.FIXED_TTL:
            self._refresh_fixed(now, eng, t)
        covered = now < t.valid_until
        resend = not notified or (not covered and not t.attached_confirm)
        out: list[AccessorOutput] = (
            [Send(eng.engine_id, r, self._access_done(t, not covered, now, r)) for r in targets] if resend else []
        )
        if covered:
            self._forget(t)
            out.append(AccessCompleted(key, t.lease_id, confirmed_by_pinner=False))
        else:
            t.state = TrackedState.CONFIRMING
            t.finished_at = now
            t.confirm_pending = set(targets)
            t.confirm_deadline = now + eng.terms.accessor_extension
            heapq.heappush(self._checks, (t.confirm_deadline, key))
            if not resend and t.early_verdicts:
                for rank, outcome in t.early_verdicts.items():
                    out.extend(self._verdict(t, rank, outcome))
        t.early_verdicts = None
        return tuple(out)

    def disconnect(self, now: LocalTime, engine_id: str) -> tuple[AccessorOutput, ...]:
        """The driver gave up on a pinner engine (dead past its engine TTL): every lease held
        there is lost; a later `track` for that engine starts a fresh handshake."""
        self._advance(now)
        eng = self._engines.pop(engine_id, None)
        if eng is None:
            return ()
        out: list[AccessorOutput] = []
        for t in list(eng.leases.values()):
            out.extend(self._lose(t, LostReason.UNREACHABLE))
        return tuple(out)

    def state_of(self, key: str) -> TrackedState | None:
        t = self._tracked.get(key)
        return None if t is None else t.state

    def engine_of(self, key: str) -> str | None:
        """The pinner engine a tracked request's lease is held by."""
        t = self._tracked.get(key)
        return None if t is None else t.engine.engine_id

    def valid_until(self, key: str) -> LocalTime | None:
        t = self._tracked.get(key)
        return None if t is None or t.valid_until == _NEG_INF else LocalTime(t.valid_until)

    def is_connected(self, engine_id: str) -> bool:
        eng = self._engines.get(engine_id)
        return eng is not None and eng.connected

    def clock_estimator(self, engine_id: str) -> ClockOffsetEstimator | None:
        eng = self._engines.get(engine_id)
        return None if eng is None else eng.clock

    @property
    def tracked_count(self) -> int:
        return len(self._tracked)

    # -- messages ---------------------------------------------------------------------------

    def handshake_reply(self, now: LocalTime, reply: HandshakeReply) -> tuple[AccessorOutput, ...]:
        """Feed the pinner's handshake reply (from the side channel). Only a reply to a
        handshake this accessor sent, and has not yet seen answered, counts."""
        self._advance(now)
        if reply.to_rank != self.rank or reply.to_session != self.session:
            return (Rejected(reply.engine_id, f"handshake reply for rank {reply.to_rank} session {reply.to_session}"),)
        eng = self._engines.get(reply.engine_id)
        if eng is None or eng.handshakes.get(reply.seq) != reply.t_echo:
            return ()  # a duplicate, superseded or forged reply: it answers no handshake of ours
        if reply.version != PROTOCOL_VERSION:
            return (Rejected(reply.engine_id, f"pinner speaks version {reply.version}, we speak {PROTOCOL_VERSION}"),)
        if (
            not reply.t_echo <= now
            or not reply.t_recv <= reply.t_send
            or not -MAX_TIME <= reply.t_recv <= MAX_TIME
            or not -MAX_TIME <= reply.t_send <= MAX_TIME
        ):
            return (Rejected(reply.engine_id, "handshake reply carries impossible timestamps"),)
        why = layout_error(reply.ranks, self.ranks, self.rank)
        if why is not None:
            return (Rejected(reply.engine_id, why),)
        if not (
            0.0 < reply.extension <= MAX_TIME
            and 0.0 <= reply.max_drift_rate < 1.0
            and 0.0 < reply.max_access_time <= MAX_TIME
        ):
            return (Rejected(reply.engine_id, "handshake reply states impossible lease terms"),)
        eng.handshakes.clear()
        out: list[AccessorOutput] = []
        for t in list(eng.leases.values()):
            if t.incarnation != reply.incarnation or t.engine.ranks != reply.ranks:
                out.extend(self._lose(t, LostReason.PINNER_RESTARTED))
        terms = LeaseTerms.own(self.config).with_pinner(
            self.config, reply.extension, reply.max_drift_rate, reply.max_access_time
        )
        if (eng.incarnation is not None and eng.incarnation != reply.incarnation) or terms != eng.terms:
            # Another incarnation, or other terms (a restart with another config): nothing
            # measured or promised under the old ones carries over.
            eng.outstanding.clear()
            eng.rounds.clear()
            eng.clock = ClockOffsetEstimator(terms.max_drift_rate, self.config.clock_sample_window)
        eng.terms = terms
        eng.incarnation = reply.incarnation
        eng.ranks = reply.ranks
        # Honour the pinner's bound too (some NIXL backends cap notifications near 256 B).
        eng.max_message_bytes = min(self.config.max_message_bytes, reply.max_message_bytes)
        room = eng.max_message_bytes - self.config.frame_overhead
        if heartbeat_id_budget(room, self.engine_id, reply.engine_id) < MIN_ID_BUDGET:
            eng.connected = False
            why = (
                f"max_message_bytes={eng.max_message_bytes} leaves no room for lease ids between "
                f"engine ids {self.engine_id!r} and {reply.engine_id!r}"
            )
            return (*out, Rejected(reply.engine_id, why))
        eng.connected = True
        eng.handshake_for = None
        if reply.rank == 0:
            eng.clock.add_sample(ClockSample(reply.t_echo, reply.t_recv, reply.t_send, now))
        eng.next_heartbeat = now  # heartbeat at the next handle_timeout: leases may have waited for this
        for t in eng.leases.values():
            if t.kind is LeaseKind.FIXED_TTL:
                self._refresh_fixed(now, eng, t)
        return tuple(out)

    def receive(self, now: LocalTime, message: Message) -> tuple[AccessorOutput, ...]:
        """Handle one decoded message from a pinner."""
        self._advance(now)
        match message:
            case HeartbeatAck():
                return self._on_ack(now, message)
            case AccessDoneAck():
                return self._on_done_ack(now, message)
            case HandshakeReply():
                return self.handshake_reply(now, message)
            case Heartbeat() | AccessDone() | Release() | Handshake():
                return (Rejected(message.engine_id, f"{type(message).__name__} is not for an accessor"),)

    def _on_ack(self, now: LocalTime, ack: HeartbeatAck) -> tuple[AccessorOutput, ...]:
        if ack.to_rank != self.rank or ack.to_session != self.session:
            return (Rejected(ack.engine_id, f"heartbeat ack for rank {ack.to_rank} session {ack.to_session}"),)
        eng = self._engines.get(ack.engine_id)
        if eng is None:
            return ()  # an engine we disconnected: nothing of it is outstanding
        rec = eng.outstanding.get(ack.seq)
        if rec is None or rec.t_send != ack.t_echo or ack.rank not in rec.pending_ranks:
            return ()  # duplicate, too old, or forged echo: carries nothing we can trust
        if not -MAX_TIME <= ack.t_recv <= MAX_TIME or not 0.0 < ack.extension <= MAX_TIME:
            return (Rejected(ack.engine_id, "heartbeat ack carries an impossible time"),)
        out: list[AccessorOutput] = []
        if ack.incarnation != rec.incarnation:
            # The pinner restarted: nothing we held there under that incarnation exists.
            for t in list(eng.leases.values()):
                if t.incarnation == rec.incarnation:
                    out.extend(self._lose(t, LostReason.PINNER_RESTARTED))
            eng.outstanding.clear()
            eng.rounds.clear()
            eng.connected = False
            eng.handshake_due = now
            return tuple(out)
        listed = len(ack.unknown) + len(ack.expired) + len(ack.released) + len(ack.completed)
        if listed + ack.renewed != len(rec.ids) or (listed and not self._ack_lists_match(rec, ack)):
            return (Rejected(ack.engine_id, f"heartbeat ack {ack.seq} does not account for the heartbeat's ids"),)
        # Usually all four lists are empty: skip building the loop then.
        lists = (
            (
                (LostReason.UNKNOWN, ack.unknown),
                (LostReason.EXPIRED, ack.expired),
                (LostReason.RELEASED, ack.released),
                (None, ack.completed),
            )
            if listed
            else ()
        )
        for reason, ids in lists:
            for lease_id in ids:
                rec.missing.add(lease_id)
                lost = eng.leases.get((rec.incarnation, lease_id))
                if lost is None or lost.state is TrackedState.CONFIRMING:
                    continue
                if reason is None:
                    # Completed by access-done: a lease completes only once every expected
                    # accessor rank reported, and only ranks that access this pinner rank
                    # heartbeat it, so while we are accessing, this pinner rank heard our own
                    # access-done (attached to our part, after it landed). Otherwise the lease
                    # is gone from under us.
                    if lost.state is TrackedState.ACCESSING:
                        continue
                    out.extend(self._lose(lost, LostReason.RELEASED))
                else:
                    out.extend(self._lose(lost, reason))
        rec.pending_ranks.discard(ack.rank)
        if ack.extension < rec.extension:
            rec.extension = ack.extension
        if ack.rank == 0 and ack.t_echo <= now:
            eng.clock.add_sample(ClockSample(ack.t_echo, ack.t_recv, ack.t_recv, now))
        if not rec.pending_ranks:
            del eng.outstanding[ack.seq]
            rnd = rec.round
            rnd.seqs.discard(ack.seq)
            if not rnd.seqs and eng.rounds.get(rec.round_id) is rnd:
                del eng.rounds[rec.round_id]
            t_send = rec.t_send
            valid = t_send + eng.terms.validity(rec.extension)
            for lease_id in rec.ids:
                renewed = eng.leases.get((rec.incarnation, lease_id))
                if renewed is None or lease_id in rec.missing:
                    continue
                if renewed.kind is not LeaseKind.RENEWABLE:
                    if not renewed.held:
                        renewed.held = True
                        self._refresh_fixed(now, eng, renewed)
                        out.extend(self._covered_late(renewed))
                    continue
                renewed.held = True
                if t_send > renewed.acked_send:
                    renewed.acked_send = t_send
                if valid > renewed.valid_until:
                    renewed.valid_until = valid
                    out.extend(self._covered_late(renewed))
        if ack.rank == 0:
            for lkey in list(eng.deadlines):
                fixed = eng.leases[lkey]
                self._refresh_fixed(now, eng, fixed)
                out.extend(self._covered_late(fixed))
        return tuple(out)

    def _covered_late(self, t: _Tracked) -> tuple[AccessorOutput, ...]:
        """A CONFIRMING access whose finish the validity window, widened by an acknowledgement
        that arrived after the finish, now covers: complete, without waiting for the pinner's
        verdict (spec §5.6 step 9). The window proves the lease live until past the finish, and
        a lease never comes back once it ended, so the memory stayed pinned for the whole access
        — the same proof `access_finished` uses when the acknowledgement came first. The usual
        case: the heartbeat sent when the lease was tracked, acknowledged only after a fast READ
        landed."""
        if t.state is not TrackedState.CONFIRMING or not t.finished_at < t.valid_until:
            return ()
        self._forget(t)
        return (AccessCompleted(t.key, t.lease_id, confirmed_by_pinner=False),)

    @staticmethod
    def _ack_lists_match(rec: Outstanding, ack: HeartbeatAck) -> bool:
        """Every listed id was in the heartbeat, and none is listed twice."""
        sent = set(rec.ids)
        seen: set[int] = set()
        for ids in (ack.unknown, ack.expired, ack.released, ack.completed):
            for i in ids:
                if i not in sent or i in seen:
                    return False
                seen.add(i)
        return True

    def _on_done_ack(self, now: LocalTime, ack: AccessDoneAck) -> tuple[AccessorOutput, ...]:
        if ack.to_rank != self.rank or ack.to_session != self.session:
            return (Rejected(ack.engine_id, f"access-done ack for rank {ack.to_rank} session {ack.to_session}"),)
        eng = self._engines.get(ack.engine_id)
        t = None if eng is None else eng.leases.get((ack.incarnation, ack.lease_id))
        if t is None or t.attempt != ack.attempt:
            return ()  # a verdict on another attempt (or a lease we no longer track) proves nothing now
        if t.state is TrackedState.ACCESSING and t.attached_confirm:
            if t.early_verdicts is None:
                t.early_verdicts = {}
            t.early_verdicts.setdefault(ack.rank, ack.outcome)
            return ()
        return self._verdict(t, ack.rank, ack.outcome)

    def _verdict(self, t: _Tracked, rank: int, outcome: AccessOutcome) -> tuple[AccessorOutput, ...]:
        if t.state is not TrackedState.CONFIRMING or rank not in t.confirm_pending:
            return ()  # duplicate or late
        if outcome is not AccessOutcome.OK:
            self._forget(t)
            return (AccessStale(t.key, t.lease_id, f"the pinner answered {outcome.name}"),)
        t.confirm_pending.discard(rank)
        if t.confirm_pending:
            return ()
        self._forget(t)
        return (AccessCompleted(t.key, t.lease_id, confirmed_by_pinner=True),)

    # -- internals --------------------------------------------------------------------------

    def handshake(self, now: LocalTime, engine_id: str) -> HandshakeNeeded:
        """A handshake for `engine_id` now, for a driver that connects proactively (before
        any request names the engine). Feed the reply to `handshake_reply`."""
        self._advance(now)
        eng = self._engines.get(engine_id)
        if eng is None:
            eng = self._engines[engine_id] = PinnerEngine(engine_id, self.config, 1)
        return HandshakeNeeded(engine_id, self._handshake(now, eng))

    def _handshake(self, now: float, eng: PinnerEngine) -> Handshake:
        seq = self._next_seq()
        eng.handshakes[seq] = now
        while len(eng.handshakes) > self.config.max_outstanding_heartbeats:
            eng.handshakes.popitem(last=False)
        return Handshake(
            self.engine_id,
            self.rank,
            self.ranks,
            self.session,
            PROTOCOL_VERSION,
            int(ALL_CAPABILITIES),
            seq,
            LocalTime(now),
        )

    def _layout(self, eng: PinnerEngine) -> TpLayout:
        """Which pinner ranks this accessor rank accesses (vLLM's heterogeneous-TP mapping)."""
        return tp_layout(eng.ranks, self.ranks, self.rank)

    def _access_done(self, t: _Tracked, confirm: bool, now: float, to_rank: int) -> AccessDone:
        return AccessDone(
            self.engine_id,
            self.rank,
            self.ranks,
            self.session,
            t.incarnation,
            to_rank,
            t.lease_id,
            t.attempt,
            confirm,
            LocalTime(now),
        )

    def _release(self, t: _Tracked, *, posted: bool = False) -> tuple[AccessorOutput, ...]:
        eng = t.engine
        msg = Release(self.engine_id, self.rank, self.ranks, self.session, t.incarnation, (t.lease_id,), posted)
        return tuple(Send(eng.engine_id, r, msg) for r in self._layout(eng).targets)

    def _make_room(self, now: float, eng: PinnerEngine, *, periodic: bool) -> bool:
        """Forget rounds of `eng` that can no longer extend anything; whether another fits."""
        return eng.make_room(now, self.config.max_outstanding_heartbeats, periodic=periodic)

    def _send_heartbeats(self, now: float, eng: PinnerEngine, ids: list[int], out: list[AccessorOutput]) -> None:
        assert eng.incarnation is not None
        budget = heartbeat_id_budget(eng.max_message_bytes - self.config.frame_overhead, self.engine_id, eng.engine_id)
        targets = self._layout(eng).targets
        rnd = Round(now)
        round_id = self._seq + 1
        eng.rounds[round_id] = rnd
        for chunk in split_ids(ids, budget):
            seq = self._next_seq()
            rnd.seqs.add(seq)
            eng.outstanding[seq] = Outstanding(now, eng.incarnation, chunk, targets, rnd, round_id)
            hb = Heartbeat(
                self.engine_id, self.rank, self.ranks, self.session, eng.incarnation, seq, LocalTime(now), chunk
            )
            out.extend(Send(eng.engine_id, r, hb) for r in targets)

    def _refresh_fixed(self, now: float, eng: PinnerEngine, t: _Tracked) -> None:
        if not t.held:
            return
        valid = eng.fixed_valid_until(now, (t.incarnation, t.lease_id), self.config.validity_margin)
        if valid is not None and valid > t.valid_until:
            first = t.valid_until == _NEG_INF
            t.valid_until = valid
            if first:
                # The check queued at track time assumed one accessor extension; a short
                # TTL's converted deadline can be earlier, so queue a check at it.
                heapq.heappush(self._checks, (valid, t.key))

    def _lose(self, t: _Tracked, reason: LostReason) -> tuple[AccessorOutput, ...]:
        if t.state is TrackedState.ACCESSING:
            t.state = TrackedState.LOST  # reported stale when the access finishes
            # Given up now, not when the access ends: its engine may be forgotten meanwhile
            # (disconnect), and its attached access-done may still land.
            self._retire((t.engine.engine_id, t.incarnation, t.lease_id))
            return (LeaseLost(t.key, t.lease_id, reason),)
        if t.state is TrackedState.LOST:
            return ()
        if t.state is TrackedState.CONFIRMING:
            self._forget(t)
            return (AccessStale(t.key, t.lease_id, f"the pinner lost the lease ({reason.value})"),)
        self._forget(t)
        return (LeaseLost(t.key, t.lease_id, reason),)

    def _forget(self, t: _Tracked) -> None:
        if self._tracked.get(t.key) is t:
            del self._tracked[t.key]
        eng = t.engine
        lkey = (t.incarnation, t.lease_id)
        if eng.leases.get(lkey) is t:
            del eng.leases[lkey]
            eng.deadlines.pop(lkey, None)
            eng.new_ids.discard(lkey)
        self._retire((eng.engine_id, t.incarnation, t.lease_id))

    def _retire(self, rkey: tuple[str, int, int]) -> None:
        """Remember a lease given up, so it is never tracked again (bounded: see `track`)."""
        self._given_up.add(rkey)

    def _require(self, key: str, *states: TrackedState) -> _Tracked:
        t = self._tracked.get(key)
        if t is None or t.state not in states:
            got = "not tracked" if t is None else t.state.value
            raise LocalProtocolError(f"request {key!r} is {got}; expected {'/'.join(s.value for s in states)}")
        return t
