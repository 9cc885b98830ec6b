"""The accessor: the side that will read (pull) or write (push) a pinner's memory.

It tracks a request from the moment it enters the scheduler, groups leases by pinner engine,
sends one batched heartbeat per engine per interval (split to the size bound, fanned out to
every worker of that engine), asks for a handshake with engines not yet connected, and learns
from acknowledgements which leases the pinner no longer holds.

Validity (Gray & Cheriton): an acknowledged heartbeat sent at local time ``t`` proves the lease
live until ``t + accessor_extension`` in *our* clock — the extension shrunk for drift and a margin
— with no synchronized clocks. An access is reported complete only if it finished inside that
window, or if the pinner confirms it handled the access-done while the lease was live; anything
else is reported stale. A push-mode WRITE is never started unless the window covers the
access-time bound. Fixed-TTL leases are valid until the pinner's deadline converted to our clock
conservatively by `ClockOffsetEstimator`.

Never reads a clock, never does I/O.
"""

from __future__ import annotations

import enum
import heapq
from collections import OrderedDict

import attrs

from ._clock import ClockOffsetEstimator, ClockSample, LocalTime, PeerTime
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

__all__ = ["AccessDecision", "Accessor", "TrackedState"]


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
    #: The access-done to attach to the transfer, so the transport delivers it to the pinner
    #: only after the data has landed (NIXL: the transfer's notification). Pass
    #: ``notified=True`` to `Accessor.access_finished` when it was attached.
    notification: AccessDone | None = None
    #: The pinner ranks this accessor rank accesses (and notifies), for heterogeneous TP.
    targets: tuple[int, ...] = ()


class _Tracked:
    __slots__ = (
        "attached_confirm", "confirm_pending", "early_verdicts", "engine", "incarnation", "key", "kind",
        "lease_id", "push", "state", "tracked_at", "valid_until",
    )

    def __init__(self, key: str, engine: _Engine, ticket: LeaseTicket, push: bool, now: float) -> None:
        self.key = key
        self.engine = engine
        self.lease_id = ticket.lease_id
        self.incarnation = ticket.incarnation
        self.kind = ticket.kind
        self.push = push
        self.state = TrackedState.WAITING
        self.tracked_at = now
        self.valid_until = float("-inf")
        self.confirm_pending: set[int] = set()
        self.attached_confirm = False  # the notification handed out by begin_access asks to confirm
        # Verdicts on that attached notification that arrived before access_finished (a transport
        # may report the transfer done after the pinner already answered).
        self.early_verdicts: dict[int, AccessOutcome] | None = None


class _Outstanding:
    __slots__ = ("ids", "incarnation", "missing", "pending_ranks", "t_send")

    def __init__(self, t_send: float, incarnation: int, ids: tuple[int, ...], ranks: int) -> None:
        self.t_send = t_send
        self.incarnation = incarnation
        self.ids = ids
        self.pending_ranks = set(range(ranks))
        self.missing: set[int] = set()


class _Engine:
    __slots__ = (
        "clock", "connected", "deadlines", "engine_id", "handshake_due", "incarnation", "leases", "max_message_bytes",
        "new_ids", "next_heartbeat", "outstanding", "ranks", "seq",
    )

    def __init__(self, engine_id: str, config: LeaseConfig, ranks: int) -> None:
        self.engine_id = engine_id
        self.connected = False
        self.incarnation: int | None = None
        self.ranks = ranks
        self.seq = 0
        # Keyed by (incarnation, lease id): a restarted pinner reuses ids under a new incarnation.
        self.leases: dict[tuple[int, int], _Tracked] = {}
        self.deadlines: dict[tuple[int, int], PeerTime] = {}  # fixed-TTL deadlines, pinner clock
        self.new_ids: set[tuple[int, int]] = set()
        self.next_heartbeat = float("inf")
        self.handshake_due = float("-inf")
        self.outstanding: OrderedDict[int, _Outstanding] = OrderedDict()
        self.max_message_bytes = config.max_message_bytes  # lowered to the pinner's at handshake
        self.clock = ClockOffsetEstimator(config.max_drift_rate, config.clock_sample_window)


class Accessor:
    """The accessor side of the lease protocol for one worker (rank) of one engine."""

    def __init__(self, config: LeaseConfig, engine_id: str, *, rank: int = 0, ranks: int = 1) -> None:
        if not engine_id:
            raise LocalProtocolError("engine_id must be a non-empty string")
        if not 0 <= rank < ranks <= 1 << 16:
            raise LocalProtocolError(f"need 0 <= rank < ranks <= 65536, got rank={rank} ranks={ranks}")
        budget = heartbeat_id_budget(config.max_message_bytes, engine_id, "")
        if budget < MIN_ID_BUDGET:
            need = config.max_message_bytes - budget + MIN_ID_BUDGET
            raise ConfigError(
                "max_message_bytes", config.max_message_bytes, f">= {need} for the accessor engine id {engine_id!r}"
            )
        self.config = config
        self.engine_id = engine_id
        self.rank = rank
        self.ranks = ranks
        self._engines: dict[str, _Engine] = {}
        self._tracked: dict[str, _Tracked] = {}
        # (time to look at the lease again, key): a lower bound of when its validity lapses.
        self._checks: list[tuple[float, str]] = []
        self._now = float("-inf")

    # -- time -------------------------------------------------------------------------------

    def _advance(self, now: LocalTime) -> float:
        if now < self._now or now != now:
            raise LocalProtocolError(f"time ran backwards: now={now} after {self._now}")
        self._now = now
        return now

    def next_deadline(self) -> LocalTime | None:
        best = self._checks[0][0] if self._checks else float("inf")
        for eng in self._engines.values():
            if not eng.leases:
                continue
            if eng.connected:
                best = min(best, eng.next_heartbeat)
                if eng.new_ids:
                    best = min(best, self._now)
            else:
                best = min(best, eng.handshake_due)
        return None if best == float("inf") else LocalTime(best)

    def handle_timeout(self, now: LocalTime) -> tuple[AccessorOutput, ...]:
        """Send due heartbeats and handshakes, and report leases whose validity lapsed."""
        # `_advance`, inlined: a driver calls this on every forward pass of every rank.
        if now < self._now or now != now:
            raise LocalProtocolError(f"time ran backwards: now={now} after {self._now}")
        self._now = now
        out: list[AccessorOutput] = []
        for eng in self._engines.values():
            if not eng.leases:
                continue
            if not eng.connected:
                if eng.handshake_due <= now:
                    eng.handshake_due = now + self.config.heartbeat_interval
                    out.append(HandshakeNeeded(eng.engine_id, self._handshake(now)))
            elif eng.next_heartbeat <= now:
                eng.new_ids.clear()
                eng.next_heartbeat = now + self.config.heartbeat_interval
                ids = [i for (inc, i), t in eng.leases.items() if t.state in _HEARTBEATING and inc == eng.incarnation]
                self._send_heartbeats(now, eng, sorted(ids), out)
            elif eng.new_ids:
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
            return t.tracked_at  # reused as the confirmation deadline
        if t.kind is LeaseKind.FIXED_TTL:
            if t.valid_until == float("-inf"):
                return t.tracked_at + self.config.accessor_extension  # no converted deadline yet
            return t.valid_until
        # Renewable: a lapsed validity window only means we cannot *prove* the lease live (the
        # access would be confirmed, a push refused); heartbeats keep going and the pinner's
        # answer decides. Give up only after a whole lease duration without any acknowledgement
        # (since the last acknowledged heartbeat was sent, or since tracking): the pinner is
        # then dead or unreachable, and would have expired the lease.
        anchor = t.tracked_at if t.valid_until == float("-inf") else t.valid_until - self.config.accessor_extension
        return anchor + self.config.kv_lease_duration

    # -- local calls ------------------------------------------------------------------------

    def track(self, now: LocalTime, key: str, ticket: LeaseTicket, *, push: bool = False) -> tuple[AccessorOutput, ...]:
        """Start heartbeating for a request the moment it enters the scheduler."""
        self._advance(now)
        if key in self._tracked:
            raise LocalProtocolError(f"request {key!r} is already tracked")
        if push and ticket.kind is LeaseKind.FIXED_TTL:
            raise LocalProtocolError("push mode is for renewable leases")
        eng = self._engines.get(ticket.engine_id)
        if eng is None:
            eng = self._engines[ticket.engine_id] = _Engine(ticket.engine_id, self.config, ticket.ranks)
        lkey = (ticket.incarnation, ticket.lease_id)
        if lkey in eng.leases:
            raise LocalProtocolError(f"lease {ticket.lease_id} of {ticket.engine_id!r} is already tracked")
        t = _Tracked(key, eng, ticket, push, now)
        eng.ranks = ticket.ranks
        self._tracked[key] = t
        eng.leases[lkey] = t
        if eng.connected and eng.incarnation != ticket.incarnation:
            # Either this ticket is stale or the pinner restarted and we have not noticed:
            # a fresh handshake settles which leases still exist.
            eng.connected = False
            eng.handshake_due = now
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
            out.append(HandshakeNeeded(eng.engine_id, self._handshake(now)))
        return tuple(out)

    def untrack(self, now: LocalTime, key: str) -> tuple[AccessorOutput, ...]:
        """The request finished or was aborted before its access: stop heartbeating and tell
        the pinner it may free now. Untracking an unknown key is a harmless no-op (the lease
        may have been reported lost already)."""
        self._advance(now)
        t = self._tracked.get(key)
        if t is None:
            return ()
        if t.state is TrackedState.ACCESSING:
            raise LocalProtocolError(f"request {key!r} has an access in flight: finish or fail it first")
        self._forget(t)
        eng = t.engine
        if t.state is TrackedState.LOST:
            return ()
        expected, targets = self._pinner_targets(eng)
        msg = Release(self.engine_id, self.rank, t.incarnation, (t.lease_id,), expected)
        return tuple(Send(eng.engine_id, r, msg) for r in targets)

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
        if t.state is not TrackedState.WAITING:
            return AccessDecision(False, False, None, f"lease is {t.state.value}")
        if not t.engine.connected or t.engine.incarnation != t.incarnation:
            return AccessDecision(False, False, None, "the pinner engine is not connected (handshake pending)")
        if t.kind is LeaseKind.FIXED_TTL:
            self._refresh_fixed(now, t.engine, t)
        valid = None if t.valid_until == float("-inf") else LocalTime(t.valid_until)
        guaranteed = valid is not None and now + self.config.access_time_local <= valid
        if t.push and not guaranteed:
            return AccessDecision(False, False, valid, "validity window does not cover the access-time bound")
        t.state = TrackedState.ACCESSING
        expected, targets = self._pinner_targets(t.engine)
        # Not covered for the whole access: the attached notification asks the pinner to confirm.
        t.attached_confirm = not guaranteed
        note = AccessDone(
            self.engine_id, self.rank, t.incarnation, t.lease_id, expected, not guaranteed, LocalTime(now)
        )
        return AccessDecision(True, guaranteed, valid, "", note, tuple(targets))

    def access_failed(self, now: LocalTime, key: str) -> tuple[AccessorOutput, ...]:
        """The transfer failed at the transport; the lease stays tracked (retry or untrack)."""
        self._advance(now)
        t = self._require(key, TrackedState.ACCESSING, TrackedState.LOST)
        if t.state is TrackedState.LOST:
            self._forget(t)
            return ()
        t.state = TrackedState.WAITING
        heapq.heappush(self._checks, (self._lapse_time(t), key))
        return ()

    def access_finished(self, now: LocalTime, key: str, *, notified: bool = False) -> tuple[AccessorOutput, ...]:
        """The READ/WRITE finished. Reports it complete only if it provably did not overlap a
        free; otherwise asks the pinner and reports the verdict later (or stale on timeout).

        `notified`: the transport delivered `AccessDecision.notification` with the transfer
        (after the data landed), so the access-done is sent again only if a confirmation is
        needed that the attached one did not ask for.
        """
        self._advance(now)
        t = self._require(key, TrackedState.ACCESSING, TrackedState.LOST)
        eng = t.engine
        expected, targets = self._pinner_targets(eng)
        if t.state is TrackedState.LOST:
            self._forget(t)
            done = AccessDone(self.engine_id, self.rank, t.incarnation, t.lease_id, expected, False, LocalTime(now))
            sends = () if notified else tuple(Send(eng.engine_id, r, done) for r in targets)
            return (*sends, AccessStale(key, t.lease_id, "the lease was lost during the access"))
        if t.kind is LeaseKind.FIXED_TTL:
            self._refresh_fixed(now, eng, t)
        covered = now < t.valid_until
        done = AccessDone(self.engine_id, self.rank, t.incarnation, t.lease_id, expected, not covered, LocalTime(now))
        resend = not notified or (not covered and not t.attached_confirm)
        out: list[AccessorOutput] = [Send(eng.engine_id, r, done) for r in targets] if resend else []
        if covered:
            self._forget(t)
            out.append(AccessCompleted(key, t.lease_id, confirmed_by_pinner=False))
        else:
            t.state = TrackedState.CONFIRMING
            t.confirm_pending = set(targets)
            t.tracked_at = now + self.config.accessor_extension  # confirmation deadline
            heapq.heappush(self._checks, (t.tracked_at, key))
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

    def valid_until(self, key: str) -> LocalTime | None:
        t = self._tracked.get(key)
        return None if t is None or t.valid_until == float("-inf") else LocalTime(t.valid_until)

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
        """Feed the pinner's handshake reply (from the side channel)."""
        self._advance(now)
        eng = self._engines.get(reply.engine_id)
        if eng is None:
            eng = self._engines[reply.engine_id] = _Engine(reply.engine_id, self.config, reply.ranks)
        if reply.version != PROTOCOL_VERSION:
            return (Rejected(reply.engine_id, f"pinner speaks version {reply.version}, we speak {PROTOCOL_VERSION}"),)
        if not reply.t_echo <= now or not reply.t_recv <= reply.t_send:
            return (Rejected(reply.engine_id, "handshake reply carries impossible timestamps"),)
        out: list[AccessorOutput] = []
        for t in list(eng.leases.values()):
            if t.incarnation != reply.incarnation:
                out.extend(self._lose(t, LostReason.PINNER_RESTARTED))
        if eng.incarnation is not None and eng.incarnation != reply.incarnation:
            eng.outstanding.clear()
            eng.clock = ClockOffsetEstimator(self.config.max_drift_rate, self.config.clock_sample_window)
        eng.incarnation = reply.incarnation
        eng.ranks = reply.ranks
        # Honour the pinner's bound too (some NIXL backends cap notifications near 256 B).
        eng.max_message_bytes = min(self.config.max_message_bytes, reply.max_message_bytes)
        if heartbeat_id_budget(eng.max_message_bytes, self.engine_id, reply.engine_id) < MIN_ID_BUDGET:
            eng.connected = False
            why = (
                f"max_message_bytes={eng.max_message_bytes} leaves no room for lease ids between "
                f"engine ids {self.engine_id!r} and {reply.engine_id!r}"
            )
            return (*out, Rejected(reply.engine_id, why))
        eng.connected = True
        if reply.rank == 0:
            eng.clock.add_sample(ClockSample(LocalTime(reply.t_echo), reply.t_recv, reply.t_send, now))
        eng.next_heartbeat = now  # heartbeat at once: leases may have waited for this
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
        eng = self._engines.get(ack.engine_id)
        if eng is None:
            return (Rejected(ack.engine_id, "heartbeat ack from an engine we do not know"),)
        if not 0 <= ack.rank < eng.ranks:
            return (Rejected(ack.engine_id, f"heartbeat ack from rank {ack.rank} of a {eng.ranks}-rank engine"),)
        rec = eng.outstanding.get(ack.seq)
        if rec is None or rec.t_send != ack.t_echo or ack.rank not in rec.pending_ranks:
            return ()  # duplicate, too old, or forged echo: carries nothing we can trust
        out: list[AccessorOutput] = []
        if ack.incarnation != rec.incarnation:
            # The pinner restarted: nothing we held there under that incarnation exists.
            for t in list(eng.leases.values()):
                if t.incarnation == rec.incarnation:
                    out.extend(self._lose(t, LostReason.PINNER_RESTARTED))
            eng.outstanding.clear()
            eng.connected = False
            eng.handshake_due = now
            return tuple(out)
        # Usually all four lists are empty: skip building the loop then.
        lists = (
            (LostReason.UNKNOWN, ack.unknown),
            (LostReason.EXPIRED, ack.expired),
            (LostReason.RELEASED, ack.released),
            (None, ack.completed),
        ) if ack.unknown or ack.expired or ack.released or ack.completed else ()
        for reason, ids in lists:
            for lease_id in ids:
                rec.missing.add(lease_id)
                lost = eng.leases.get((rec.incarnation, lease_id))
                if lost is None or lost.state is TrackedState.CONFIRMING:
                    continue
                if reason is None:
                    # Completed by access-done: a lease completes only once every expected
                    # accessor rank reported, so while we are accessing it, this pinner rank
                    # heard our own access-done (attached to our part, after it landed); other
                    # pinner ranks' parts may still be in flight. Otherwise someone else used it.
                    if lost.state is TrackedState.ACCESSING:
                        continue
                    out.extend(self._lose(lost, LostReason.RELEASED))
                else:
                    out.extend(self._lose(lost, reason))
        rec.pending_ranks.discard(ack.rank)
        if ack.rank == 0 and ack.t_echo <= now:
            eng.clock.add_sample(ClockSample(LocalTime(ack.t_echo), ack.t_recv, ack.t_recv, now))
        if not rec.pending_ranks:
            del eng.outstanding[ack.seq]
            valid = rec.t_send + self.config.accessor_extension
            for lease_id in rec.ids:
                renewed = eng.leases.get((rec.incarnation, lease_id))
                if renewed is None or lease_id in rec.missing or renewed.kind is not LeaseKind.RENEWABLE:
                    continue
                if valid > renewed.valid_until:
                    renewed.valid_until = valid
        if ack.rank == 0:
            for lkey in list(eng.deadlines):
                self._refresh_fixed(now, eng, eng.leases[lkey])
        return tuple(out)

    def _on_done_ack(self, now: LocalTime, ack: AccessDoneAck) -> tuple[AccessorOutput, ...]:
        eng = self._engines.get(ack.engine_id)
        t = None if eng is None else eng.leases.get((ack.incarnation, ack.lease_id))
        if t is not None and t.state is TrackedState.ACCESSING and t.attached_confirm:
            if t.early_verdicts is None:
                t.early_verdicts = {}
            t.early_verdicts.setdefault(ack.rank, ack.outcome)
            return ()
        return self._verdict(t, ack.rank, ack.outcome) if t is not None else ()

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
        return HandshakeNeeded(engine_id, self._handshake(now))

    def _handshake(self, now: float) -> Handshake:
        return Handshake(self.engine_id, self.rank, self.ranks, PROTOCOL_VERSION, int(ALL_CAPABILITIES), LocalTime(now))

    def _pinner_targets(self, eng: _Engine) -> tuple[int, range]:
        """How many accessor ranks each pinner rank hears from, and which pinner ranks this
        accessor rank reads from (vLLM's heterogeneous-TP mapping)."""
        p, a = eng.ranks, self.ranks
        if p >= a:
            k = p // a
            return 1, range(self.rank * k, (self.rank + 1) * k)
        k = a // p
        return k, range(self.rank // k, self.rank // k + 1)

    def _send_heartbeats(self, now: float, eng: _Engine, ids: list[int], out: list[AccessorOutput]) -> None:
        assert eng.incarnation is not None
        budget = heartbeat_id_budget(eng.max_message_bytes, self.engine_id, eng.engine_id)
        # Forget rounds that can no longer extend anything, and bound the rest.
        horizon = now - self.config.accessor_extension
        while eng.outstanding and (
            len(eng.outstanding) >= self.config.max_outstanding_heartbeats
            or next(iter(eng.outstanding.values())).t_send < horizon
        ):
            eng.outstanding.popitem(last=False)
        for chunk in split_ids(ids, budget):
            eng.seq += 1
            eng.outstanding[eng.seq] = _Outstanding(now, eng.incarnation, chunk, eng.ranks)
            hb = Heartbeat(self.engine_id, self.rank, eng.incarnation, eng.seq, LocalTime(now), chunk)
            out.append(Send(eng.engine_id, None, hb))

    def _refresh_fixed(self, now: float, eng: _Engine, t: _Tracked) -> None:
        deadline = eng.deadlines.get((t.incarnation, t.lease_id))
        if deadline is None:
            return
        local = eng.clock.to_local_deadline(LocalTime(now), deadline)
        if local is not None:
            valid = local - self.config.validity_margin
            if valid > t.valid_until:
                first = t.valid_until == float("-inf")
                t.valid_until = valid
                if first:
                    # The check queued at track time assumed one accessor extension; a short
                    # TTL's converted deadline can be earlier, so queue a check at it.
                    heapq.heappush(self._checks, (valid, t.key))

    def _lose(self, t: _Tracked, reason: LostReason) -> tuple[AccessorOutput, ...]:
        if t.state is TrackedState.ACCESSING:
            t.state = TrackedState.LOST  # reported stale when the access finishes
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

    def _require(self, key: str, *states: TrackedState) -> _Tracked:
        t = self._tracked.get(key)
        if t is None or t.state not in states:
            got = "not tracked" if t is None else t.state.value
            raise LocalProtocolError(f"request {key!r} is {got}; expected {'/'.join(s.value for s in states)}")
        return t
