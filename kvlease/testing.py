"""Public test helpers: drifting peer clocks, a lossy fake link, and a `Pair` harness.

Owns: `PeerClock` (one simulated peer's monotonic clock: a random epoch and a drift rate within
the configured bound), `FakeLink` (one direction between two endpoints that drops, delays,
duplicates and reorders, and carries every message *as encoded bytes*, so the codec is on every
hop), `Pair` (one `Pinner` and one `Accessor` joined by two fake links, with the side-channel
handshake performed for the accessor), and the audit `Pair` runs after every step against
ground truth kept in simulated real time: at most one free per lease, expiry never earlier,
frees within their bounds, no completed access overlapping a free, the accessor never counting
a lease valid after the pinner's real deadline, nothing after a terminal state. A broken
invariant raises `InvariantViolation`.

Must never read a clock or do I/O: "real time" here is a float the test advances by hand, and
every random choice comes from the `random.Random` the caller passes in, so a seed replays a run.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from typing import assert_never

import attrs

from ._accessor import AccessDecision, Accessor, TrackedState
from ._clock import LocalTime
from ._codec import decode, encode
from ._config import LeaseConfig
from ._events import (
    AccessCompleted,
    AccessorOutput,
    AccessStale,
    EndReason,
    Free,
    HandshakeNeeded,
    LeaseLost,
    PinnerOutput,
    Rejected,
    Send,
)
from ._layout import tp_layout
from ._messages import AccessDone, Handshake, Heartbeat, LeaseKind, LeaseTicket, Message
from ._pinner import LeaseState, Pinner
from ._terms import LeaseTerms

__all__ = [
    "FakeLink",
    "InvariantViolation",
    "LeaseRecord",
    "LinkProfile",
    "Mesh",
    "MeshAccess",
    "MeshMessage",
    "Pair",
    "PeerClock",
]

#: How far past a deadline (in real seconds) the harness wakes an endpoint: the step
#: granularity of a `Pair`. Far above float rounding at epochs of 2e5 s, far below any timing
#: the protocol cares about.
STEP_EPSILON = 1e-7
#: Tolerance for comparing instants that went through clock conversions.
TIME_TOLERANCE = 1e-6


class InvariantViolation(AssertionError):
    """A protocol invariant failed; the message names it and the numbers involved."""


def _run_events(
    now: float, target: float, next_event: Callable[[], float | None], step: Callable[[float], None]
) -> None:
    """Step a harness at each of its events up to `target` real time, then at `target`. An
    event that never moves past now (a deadline an endpoint keeps re-reporting) is a busy loop."""
    for _ in range(1_000_000):
        t = next_event()
        if t is None or t > target:
            break
        now = max(t, now)
        step(now)
    else:
        raise InvariantViolation("busy loop: a deadline never moved past now")
    step(target)


@attrs.frozen
class PeerClock:
    """One simulated peer's monotonic clock: ``local = epoch + rate * real``."""

    epoch: float
    rate: float

    @classmethod
    def random(
        cls,
        rng: random.Random,
        max_drift_rate: float,
        *,
        epoch_range: tuple[float, float] = (1e4, 2e5),
    ) -> PeerClock:
        """A random epoch and a rate within the drift bound; the extremes of the bound are
        drawn as often as the interior, since that is where conversions go wrong."""
        pick = rng.randrange(3)
        if pick == 0:
            rate = 1.0 - max_drift_rate
        elif pick == 1:
            rate = 1.0 + max_drift_rate
        else:
            rate = 1.0 + rng.uniform(-max_drift_rate, max_drift_rate)
        return cls(rng.uniform(*epoch_range), rate)

    def local(self, real: float) -> LocalTime:
        return LocalTime(self.epoch + self.rate * real)

    def real(self, local: float) -> float:
        return (local - self.epoch) / self.rate


@attrs.frozen
class LinkProfile:
    """How a `FakeLink` mistreats messages. Delays are uniform in [min_delay, max_delay]
    real seconds, drawn per message, so messages also reorder."""

    min_delay: float = 0.0
    max_delay: float = 0.0
    drop: float = 0.0
    duplicate: float = 0.0


class FakeLink:
    """One direction between two endpoints, carrying encoded bytes.

    `send` encodes (and checks the size bound, if given); `deliver_due` decodes. While `up`
    is False (a partition) everything sent is lost.
    """

    def __init__(self, rng: random.Random, profile: LinkProfile | None = None, *, max_bytes: int | None = None) -> None:
        self.rng = rng
        self.profile = profile or LinkProfile()
        self.max_bytes = max_bytes
        self.up = True
        self._queue: list[tuple[float, int, bytes]] = []
        self._seq = 0
        self.sent = 0
        self.dropped = 0
        self.delivered = 0
        self.largest = 0

    def send(self, real_now: float, message: Message) -> None:
        data = encode(message)
        self.sent += 1
        self.largest = max(self.largest, len(data))
        if self.max_bytes is not None and len(data) > self.max_bytes:
            raise InvariantViolation(
                f"{type(message).__name__} of {len(data)} bytes exceeds max_message_bytes={self.max_bytes}"
            )
        p = self.profile
        if not self.up or (p.drop > 0.0 and self.rng.random() < p.drop):
            self.dropped += 1
            return
        copies = 2 if p.duplicate > 0.0 and self.rng.random() < p.duplicate else 1
        for _ in range(copies):
            delay = self.rng.uniform(p.min_delay, p.max_delay) if p.max_delay > p.min_delay else p.min_delay
            self._seq += 1
            heapq.heappush(self._queue, (real_now + delay, self._seq, data))

    def next_delivery(self) -> float | None:
        return self._queue[0][0] if self._queue else None

    def deliver_due(self, real_now: float) -> list[Message]:
        out: list[Message] = []
        while self._queue and self._queue[0][0] <= real_now:
            _, _, data = heapq.heappop(self._queue)
            self.delivered += 1
            out.append(decode(data))
        return out

    def drop_in_flight(self) -> None:
        self.dropped += len(self._queue)
        self._queue.clear()

    @property
    def in_flight(self) -> int:
        return len(self._queue)


@attrs.define
class LeaseRecord:
    """Ground truth about one lease, in real time and in the pinner's clock."""

    lease_id: int
    key: str
    kind: LeaseKind
    push: bool
    grant_real: float
    grant_p: float
    duration: float
    last_hb_p: float | None = None
    #: The seq of the heartbeat that last extended the lease: an older or repeated one (a
    #: duplicate, a replay) is acknowledged but extends nothing (spec §5.5).
    last_hb_seq: int = 0
    last_expiry_p: float = float("-inf")
    frees: list[tuple[float, Free]] = attrs.Factory(list)
    #: (begin_real, end_real or None) of each access the accessor was allowed to start.
    accesses: list[tuple[float, float | None]] = attrs.Factory(list)
    accessor_events: list[AccessorOutput] = attrs.Factory(list)
    accessor_terminal: bool = False
    released_by_pinner: bool = False

    @property
    def free_real(self) -> float | None:
        return self.frees[0][0] if self.frees else None


class Pair:
    """One pinner and one accessor joined by two `FakeLink`s, in simulated real time.

    Operations act at the current real instant; `advance(dt)` moves time on, waking each
    endpoint at its deadlines (converted through its own clock) and delivering messages as
    they arrive. Every step is audited; see the module docstring.

    `accessor_config`: the accessor runs its own settings (protocol v3: they need not match
    the pinner's, spec §2.2). `config` is then the pinner's, and the audit holds the accessor
    to the terms of spec §2.1, the stricter of both. The clocks are not drawn from it: pass
    them when the two drift bounds differ.
    """

    def __init__(
        self,
        config: LeaseConfig,
        rng: random.Random,
        *,
        accessor_config: LeaseConfig | None = None,
        accessor_cls: Callable[..., Accessor] = Accessor,
        pinner_clock: PeerClock | None = None,
        accessor_clock: PeerClock | None = None,
        to_pinner: LinkProfile | None = None,
        to_accessor: LinkProfile | None = None,
        pinner_engine: str = "prefill-0",
        accessor_engine: str = "decode-0",
        incarnation: int | None = None,
    ) -> None:
        self.config = config
        self.rng = rng
        self.pinner_clock = pinner_clock or PeerClock.random(rng, config.max_drift_rate)
        self.accessor_clock = accessor_clock or PeerClock.random(rng, config.max_drift_rate)
        self.real = 0.0
        inc = rng.randrange(1, 1 << 64) if incarnation is None else incarnation
        self.pinner = Pinner(config, pinner_engine, inc)
        self.accessor = accessor_cls(accessor_config or config, accessor_engine, session=rng.randrange(1, 1 << 64))
        # Every frame must fit both sides' bounds (spec §4.3: the accessor splits by the smaller).
        limit = min(config.max_message_bytes, self.accessor.config.max_message_bytes)
        self.to_pinner = FakeLink(rng, to_pinner, max_bytes=limit)
        self.to_accessor = FakeLink(rng, to_accessor, max_bytes=limit)
        self.accessor_alive = True
        self.leases: dict[int, LeaseRecord] = {}
        self.by_key: dict[str, int] = {}
        self.rejected: list[Rejected] = []
        self.handshakes = 0
        self._open_access: dict[str, float] = {}
        # Posted push WRITEs reported failed that still land later: (real landing time, key,
        # index of the access in its record).
        self._landing: list[tuple[float, str, int]] = []
        # While True (inside `advance(..., accessor_stalled=True)`) the accessor does not run.
        self._accessor_stalled = False
        # The window an acknowledged round gives the accessor (spec §2.1: its own margin, the
        # stricter extension and drift bound of the two sides). With one configuration for
        # both sides it equals `config.accessor_extension`.
        acfg = self.accessor.config
        self._accessor_window = (
            LeaseTerms.own(acfg)
            .with_pinner(acfg, config.lease_extension, config.max_drift_rate, config.max_access_time)
            .accessor_extension
        )

    # -- clocks -----------------------------------------------------------------------------

    @property
    def now_p(self) -> LocalTime:
        return self.pinner_clock.local(self.real)

    @property
    def now_a(self) -> LocalTime:
        return self.accessor_clock.local(self.real)

    # -- operations -------------------------------------------------------------------------

    def grant(
        self, key: str, *, push: bool = False, kind: LeaseKind = LeaseKind.RENEWABLE, ttl: float | None = None
    ) -> LeaseTicket:
        if key in self.by_key:
            raise ValueError(f"keys are never reused in a Pair: {key!r}")
        now = self.now_p
        ticket = self.pinner.grant(now, key, kind=kind, push=push, ttl=ttl)
        if kind is LeaseKind.FIXED_TTL:
            duration = self.config.decoder_kv_blocks_ttl if ttl is None else ttl
        else:
            duration = self.config.kv_lease_duration
        self.leases[ticket.lease_id] = LeaseRecord(
            ticket.lease_id, key, kind, push, self.real, now, duration, last_expiry_p=now + duration
        )
        self.by_key[key] = ticket.lease_id
        # The ticket travels to the accessor as transfer parameters (JSON-like).
        return LeaseTicket.from_dict(ticket.to_dict())

    def track(self, key: str, ticket: LeaseTicket, *, push: bool = False) -> None:
        self._accessor_outputs(self.accessor.track(self.now_a, key, ticket, push=push))

    def grant_and_track(
        self, key: str, *, push: bool = False, kind: LeaseKind = LeaseKind.RENEWABLE, ttl: float | None = None
    ) -> int:
        ticket = self.grant(key, push=push, kind=kind, ttl=ttl)
        if self.accessor_alive:
            self.track(key, ticket, push=push)
        return ticket.lease_id

    def begin_access(self, key: str) -> AccessDecision:
        decision = self.accessor.begin_access(self.now_a, key)
        if decision.allowed:
            self._open_access[key] = self.real
            self.record(key).accesses.append((self.real, None))
        return decision

    def finish_access(self, key: str) -> None:
        rec = self.record(key)
        begin = self._open_access.pop(key)
        rec.accesses[-1] = (begin, self.real)
        self._check_push_write(rec, begin, self.real)
        self._accessor_outputs(self.accessor.access_finished(self.now_a, key))

    def fail_access(self, key: str, *, posted: bool = True, lands_after: float = 0.0) -> None:
        """The transfer failed; `posted`: it had been handed to the transport (see
        `Accessor.access_failed`). `lands_after`: a posted push WRITE still lands that many
        real seconds from now (a cancel that lost the race; spec §7.1 S2 bounds it by the
        accessor's `max_access_time` from its begin, which the caller respects). Until then
        the write counts as in flight: a free of its memory is a violation."""
        if lands_after < 0.0:
            raise ValueError("a write lands after it failed, not before")
        rec = self.record(key)
        begin = self._open_access.pop(key)
        if rec.push and posted and lands_after > 0.0:
            self._landing.append((self.real + lands_after, key, len(rec.accesses) - 1))
        else:
            rec.accesses[-1] = (begin, self.real)
            self._check_push_write(rec, begin, self.real)
        self._accessor_outputs(self.accessor.access_failed(self.now_a, key, posted=posted))

    def untrack(self, key: str) -> None:
        self._accessor_outputs(self.accessor.untrack(self.now_a, key))

    def pinner_release(self, key: str) -> None:
        rec = self.record(key)
        rec.released_by_pinner = True
        self._pinner_outputs(self.pinner.release(self.now_p, rec.lease_id))

    def kill_accessor(self) -> None:
        """The accessor process dies: it never sends, receives or wakes again. Its writes in
        flight are taken to end now (they cannot outlive the process's queue pair)."""
        self.accessor_alive = False
        for key, begin in list(self._open_access.items()):
            rec = self.record(key)
            rec.accesses[-1] = (begin, self.real)
            self._check_push_write(rec, begin, self.real)
        self._open_access.clear()
        self._land_writes(float("inf"))

    def partition(self, *, drop_in_flight: bool = True) -> None:
        self.to_pinner.up = self.to_accessor.up = False
        if drop_in_flight:
            self.to_pinner.drop_in_flight()
            self.to_accessor.drop_in_flight()

    def heal(self) -> None:
        self.to_pinner.up = self.to_accessor.up = True

    def set_profiles(self, to_pinner: LinkProfile, to_accessor: LinkProfile) -> None:
        self.to_pinner.profile = to_pinner
        self.to_accessor.profile = to_accessor

    def record(self, key: str) -> LeaseRecord:
        return self.leases[self.by_key[key]]

    def accessing(self) -> list[str]:
        return list(self._open_access)

    # -- time -------------------------------------------------------------------------------

    def advance(self, dt: float, *, accessor_stalled: bool = False) -> None:
        """Move real time on by `dt`, handling every deadline and delivery on the way.

        `accessor_stalled`: the accessor's process does not run meanwhile (an overloaded
        scheduler): it is not woken, sends nothing, and what reaches it waits in its queue,
        to be handled (late) at its first step after the stall. The audit still runs.
        """
        if dt < 0.0:
            raise ValueError("real time never runs backwards")
        self._accessor_stalled = accessor_stalled
        try:
            _run_events(self.real, self.real + dt, self._next_event, self._step)
        finally:
            self._accessor_stalled = False

    def _land_writes(self, until: float) -> None:
        """End the posted-failed WRITEs due by `until` (all of them at an accessor's death)."""
        due = [w for w in self._landing if w[0] <= until]
        self._landing = [w for w in self._landing if w[0] > until]
        for at, key, i in due:
            rec = self.record(key)
            end = min(at, self.real)
            begin = rec.accesses[i][0]
            rec.accesses[i] = (begin, end)
            self._check_push_write(rec, begin, end)

    def _next_event(self) -> float | None:
        cands: list[float] = [w[0] for w in self._landing]
        nd = self.pinner.next_deadline()
        if nd is not None:
            cands.append(self.pinner_clock.real(nd) + STEP_EPSILON)
        running = self.accessor_alive and not self._accessor_stalled
        if running:
            nd = self.accessor.next_deadline()
            if nd is not None:
                cands.append(self.accessor_clock.real(nd) + STEP_EPSILON)
        for link in (self.to_pinner, self.to_accessor) if running else (self.to_pinner,):
            t = link.next_delivery()
            if t is not None:
                cands.append(t)
        return min(cands) if cands else None

    def _step(self, real: float) -> None:
        self.real = real
        self._land_writes(real)
        now_p = self.now_p
        nd = self.pinner.next_deadline()
        if nd is not None and nd <= now_p:
            outputs = self.pinner.handle_timeout(now_p)
            after = self.pinner.next_deadline()
            if after is not None and after <= now_p:
                raise InvariantViolation(f"pinner next_deadline {after} <= now {now_p} after handle_timeout")
            self._pinner_outputs(outputs)
        for msg in self.to_pinner.deliver_due(real):
            if isinstance(msg, Heartbeat) and msg.incarnation == self.pinner.incarnation:
                for lid in msg.lease_ids:
                    info = self.pinner.info(lid)
                    rec = self.leases.get(lid)
                    if (
                        info is not None
                        and info.state is LeaseState.ACTIVE
                        and info.expiry > now_p
                        and rec is not None
                        and msg.seq > rec.last_hb_seq
                    ):
                        rec.last_hb_p = now_p
                        rec.last_hb_seq = msg.seq
            self._pinner_outputs(self.pinner.receive(now_p, msg))
        if self._accessor_stalled:
            self.check()
            return
        for msg in self.to_accessor.deliver_due(real):
            if self.accessor_alive:
                self._accessor_outputs(self.accessor.receive(self.now_a, msg))
        if self.accessor_alive:
            now_a = self.now_a
            nd = self.accessor.next_deadline()
            if nd is not None and nd <= now_a:
                a_outputs = self.accessor.handle_timeout(now_a)
                # Checked before dispatch: a handshake completed while dispatching may
                # legitimately make a heartbeat due at once.
                after = self.accessor.next_deadline()
                if after is not None and after <= now_a:
                    raise InvariantViolation(f"accessor next_deadline {after} <= now {now_a} after handle_timeout")
                self._accessor_outputs(a_outputs)
        self.check()

    # -- dispatch ---------------------------------------------------------------------------

    def _pinner_outputs(self, outputs: tuple[PinnerOutput, ...]) -> None:
        for o in outputs:
            match o:
                case Send():
                    self.to_accessor.send(self.real, o.message)
                case Free():
                    self._on_free(o)
                case Rejected():
                    self.rejected.append(o)
                case _:
                    assert_never(o)

    def _accessor_outputs(self, outputs: tuple[AccessorOutput, ...]) -> None:
        for o in outputs:
            match o:
                case Send():
                    if self.accessor_alive:
                        self.to_pinner.send(self.real, o.message)
                case HandshakeNeeded():
                    self._handshake(o.message)
                case LeaseLost() | AccessCompleted() | AccessStale():
                    self._on_accessor_event(o)
                case Rejected():
                    self.rejected.append(o)
                case _:
                    assert_never(o)

    def _handshake(self, hs: Handshake) -> None:
        """The side-channel round trip, at this instant, through the codec. It fails like the
        link does (partition, drops); the accessor retries on its own schedule."""
        if not self.accessor_alive or not (self.to_pinner.up and self.to_accessor.up):
            return
        for link in (self.to_pinner, self.to_accessor):
            if link.profile.drop > 0.0 and self.rng.random() < link.profile.drop:
                return
        hs_wire = decode(encode(hs))
        assert isinstance(hs_wire, Handshake)
        reply = decode(encode(self.pinner.handshake_reply(self.now_p, hs_wire)))
        self.handshakes += 1
        self._accessor_outputs(self.accessor.receive(self.now_a, reply))

    # -- audit ------------------------------------------------------------------------------

    def _on_free(self, free: Free) -> None:
        rec = self.leases.get(free.lease_id)
        if rec is None:
            raise InvariantViolation(f"Free for a lease never granted: {free!r}")
        if rec.frees:
            raise InvariantViolation(f"second Free for lease {free.lease_id}: {rec.frees[0][1]!r} then {free!r}")
        if free.key != rec.key:
            raise InvariantViolation(f"Free names key {free.key!r}, lease was granted for {rec.key!r}")
        rec.frees.append((self.real, free))
        if free.reason is EndReason.EXPIRED:
            cfg = self.config
            guard = cfg.push_guard if rec.push else 0.0
            at = float(free.at)
            earliest = rec.grant_p + rec.duration + guard
            if rec.kind is LeaseKind.RENEWABLE and rec.last_hb_p is not None:
                earliest = max(earliest, rec.last_hb_p + cfg.lease_extension + guard)
            # Early frees break the pinner's promise; late ones leak memory. The harness wakes
            # the pinner STEP_EPSILON after its deadline, so nothing beyond that is excused.
            if at < earliest - TIME_TOLERANCE:
                raise InvariantViolation(f"lease {rec.lease_id} freed at {at}, before its expiry {earliest}")
            if at > earliest + TIME_TOLERANCE:
                raise InvariantViolation(
                    f"lease {rec.lease_id} freed at {at}, {at - earliest:.6g} s after its bound {earliest}"
                )
        for _begin, end in rec.accesses:
            if rec.push and end is None:
                # A write in flight when its memory is freed. (Checked at its end too.)
                raise InvariantViolation(f"push lease {rec.lease_id} freed with a write in flight")

    def _check_push_write(self, rec: LeaseRecord, begin: float, end: float) -> None:
        free = rec.free_real
        if rec.push and free is not None and free < end:
            raise InvariantViolation(
                f"push write into lease {rec.lease_id} ran [{begin}, {end}] past its free at {free}"
            )

    def _on_accessor_event(self, ev: LeaseLost | AccessCompleted | AccessStale) -> None:
        lid = self.by_key.get(ev.key)
        if lid is None or lid != ev.lease_id:
            raise InvariantViolation(f"accessor event for an unknown lease: {ev!r}")
        rec = self.leases[lid]
        if rec.accessor_terminal:
            raise InvariantViolation(
                f"accessor event after a terminal one for {ev.key!r}: {rec.accessor_events} then {ev!r}"
            )
        lost_in_access = any(isinstance(e, LeaseLost) for e in rec.accessor_events)
        if lost_in_access and not isinstance(ev, AccessStale):
            raise InvariantViolation(f"lease {lid} was lost during its access but then reported {ev!r}")
        rec.accessor_events.append(ev)
        in_access = ev.key in self._open_access
        rec.accessor_terminal = not (isinstance(ev, LeaseLost) and in_access)
        if isinstance(ev, AccessCompleted):
            end = rec.accesses[-1][1] if rec.accesses else None
            if end is None:
                raise InvariantViolation(f"AccessCompleted for {ev.key!r} with no finished access")
            free = rec.free_real
            if free is not None and free < end - TIME_TOLERANCE:
                raise InvariantViolation(
                    f"stale access reported done: lease {lid} freed at real {free} "
                    f"({rec.frees[0][1].reason.value}), access ended at {end}"
                )

    def check(self) -> None:
        """Audit the state at this instant (also run after every step of `advance`)."""
        pinner = self.pinner
        nd = pinner.next_deadline()
        for lid in pinner.live_ids():
            info = pinner.info(lid)
            assert info is not None
            rec = self.leases[lid]
            if rec.frees:
                raise InvariantViolation(f"lease {lid} is live after its Free")
            if nd is None or nd > info.expiry:
                raise InvariantViolation(f"pinner next_deadline {nd} is later than lease {lid}'s expiry {info.expiry}")
            if info.state is LeaseState.ACTIVE:
                if info.expiry < rec.last_expiry_p:
                    raise InvariantViolation(f"lease {lid} expiry moved earlier: {rec.last_expiry_p} -> {info.expiry}")
                rec.last_expiry_p = info.expiry
        if not self.accessor_alive:
            return
        for key, lid in self.by_key.items():
            v = self.accessor.valid_until(key)
            if v is None:
                continue
            rec = self.leases[lid]
            v_real = self.accessor_clock.real(v)
            info = pinner.info(lid)
            if info is not None:
                limit = self.pinner_clock.real(rec.last_expiry_p)
            elif rec.frees and rec.frees[0][1].reason is not EndReason.ACCESS_DONE:
                limit = rec.frees[0][0]
            else:
                continue  # ended by the accessor's own access-done
            if v_real > limit + TIME_TOLERANCE:
                raise InvariantViolation(
                    f"accessor counts lease {lid} valid until real {v_real}, beyond the pinner's "
                    f"deadline {limit} by {v_real - limit:.6g} s"
                )
            state = self.accessor.state_of(key)
            if state is TrackedState.WAITING:
                # The accessor must wake to give a WAITING lease up: at a fixed-TTL lease's
                # converted deadline, or one lease duration after the send time of the last
                # acknowledged heartbeat of a renewable one (a lapsed window alone is not a loss).
                cfg = self.accessor.config
                renewable = rec.kind is not LeaseKind.FIXED_TTL
                give_up = v + (cfg.kv_lease_duration - self._accessor_window if renewable else 0.0)
                and_nd = self.accessor.next_deadline()
                if and_nd is None or and_nd > give_up + TIME_TOLERANCE:
                    raise InvariantViolation(
                        f"accessor next_deadline {and_nd} is later than when it must give {key!r} up ({give_up})"
                    )


# -- Mesh: several ranks, several accessor engines, a network the caller drives ---------------


@attrs.define
class MeshMessage:
    """One encoded message in flight. `deliver_at` None: held by the adversary until a test
    delivers, misroutes or drops it."""

    ident: int
    to_pinner: bool  # True: to pinner rank `rank`; False: to accessor `engine` rank `rank`
    engine: str
    rank: int
    data: bytes
    sent_at: float
    deliver_at: float | None


@attrs.define
class MeshAccess:
    """One access attempt of one accessor rank, in real time."""

    engine: str
    rank: int
    key: str
    lease_id: int
    begin: float
    targets: tuple[int, ...]
    notifications: dict[int, bytes]  # pinner rank -> the access-done attached to its part
    attempt: int
    end: float | None = None
    #: A WRITE into the pinner's memory (push); it must not land after any target rank's free.
    push: bool = False
    #: Target ranks whose part of the transfer has landed (its access-done sent after it).
    landed: set[int] = attrs.Factory(set)
    #: A posted push WRITE reported failed lands (or is known over) at this real time.
    lands_at: float | None = None


class Mesh:
    """One pinner engine of `pinner_ranks` workers and several accessor engines (name -> TP
    size), joined by a network whose every message the caller can hold, drop, duplicate,
    deliver to a sibling rank of the right engine, or replay later. The ranks of one engine
    share one clock (one host): equal readings across ranks are the normal case.

    The audit (raising `InvariantViolation`) runs in real time after every step: at most one
    free per lease and pinner rank; no `AccessCompleted` for an access that overlapped a free
    of any pinner rank it accessed; no accessor rank counts a lease valid past the instant a
    pinner rank it accesses freed it (unless its own access-done freed it) or past that rank's
    current expiry; `next_deadline` honest after `handle_timeout`. Handshakes travel through
    the network too (a `Handshake` reaches pinner rank 0 through `Pinner.receive`), so their
    replies can be duplicated, delayed, misrouted and replayed like everything else.

    Protocol v3: `accessor_configs` gives an accessor engine its own settings (spec §2.2; the
    others run `config`, the pinner's); every message sent must fit the smaller of the two
    bounds of its link (the pinner's and the accessor engine's `max_message_bytes`, spec §4.3);
    push leases are audited too: no WRITE may be in flight at a free of a rank it writes, nor
    land after one (a posted WRITE reported failed may land later, `fail_access(lands_after=)`).
    `id_stride` spaces lease ids apart (ids far apart cost 9 bytes each on the wire).
    """

    PINNER = "prefill-0"

    def __init__(
        self,
        config: LeaseConfig,
        rng: random.Random,
        *,
        pinner_ranks: int,
        accessor_engines: dict[str, int],
        pinner_clock: PeerClock,
        accessor_clocks: dict[str, PeerClock],
        delay: tuple[float, float] = (0.0, 0.0),
        pinner_factory: Callable[..., Pinner] = Pinner,
        accessor_factory: Callable[..., Accessor] = Accessor,
        history: int = 64,
        accessor_configs: dict[str, LeaseConfig] | None = None,
        id_stride: int = 1,
    ) -> None:
        self.config = config
        self.accessor_configs = {e: (accessor_configs or {}).get(e, config) for e in accessor_engines}
        self.id_stride = id_stride
        self.rng = rng
        self.real = 0.0
        self.delay = delay
        self.pinner_clock = pinner_clock
        self.accessor_clocks = accessor_clocks
        inc = rng.randrange(1, 1 << 64)
        self.pinners = [
            pinner_factory(config, self.PINNER, inc, rank=q, ranks=pinner_ranks) for q in range(pinner_ranks)
        ]
        self.accessors: dict[tuple[str, int], Accessor] = {}
        for engine, ranks in accessor_engines.items():
            for r in range(ranks):
                session = rng.randrange(1 << 64)
                self.accessors[engine, r] = accessor_factory(
                    self.accessor_configs[engine], engine, session=session, rank=r, ranks=ranks
                )
        self.flight: list[MeshMessage] = []
        self.delivered: list[MeshMessage] = []  # the most recent, for replays
        self._history = history
        self._ident = 0
        self._next_lease = 0
        self.tickets: dict[str, LeaseTicket] = {}  # request key -> ticket
        self.granted_at: dict[int, float] = {}
        self.frees: dict[tuple[int, int], tuple[float, Free]] = {}  # (lease id, pinner rank)
        # (lease id, pinner rank) -> accessor (engine, rank, attempt) whose access-done reached it
        self.done_heard: dict[tuple[int, int], set[tuple[str, int, int]]] = {}
        self.accesses: dict[tuple[str, int, str], MeshAccess] = {}  # open accesses
        self.push_leases: set[int] = set()
        self.writes: list[MeshAccess] = []  # posted push WRITEs reported failed, not landed yet
        self.finished: dict[tuple[str, int, str], MeshAccess] = {}  # the last finished one
        self.events: list[tuple[str, int, LeaseLost | AccessCompleted | AccessStale]] = []
        self.rejected: list[Rejected] = []

    # -- clocks -----------------------------------------------------------------------------

    def now_p(self) -> LocalTime:
        return self.pinner_clock.local(self.real)

    def now_a(self, engine: str) -> LocalTime:
        return self.accessor_clocks[engine].local(self.real)

    # -- engine actions ---------------------------------------------------------------------

    def grant(
        self, key: str, *, kind: LeaseKind = LeaseKind.RENEWABLE, ttl: float | None = None, push: bool = False
    ) -> LeaseTicket:
        """Every pinner rank grants `key` under one id (as a scheduler fanning a grant out)."""
        now = self.now_p()
        self._next_lease += self.id_stride
        lease_id = self._next_lease
        ticket = self.pinners[0].grant(now, key, kind=kind, ttl=ttl, lease_id=lease_id, push=push)
        for p in self.pinners[1:]:
            # Same deadline for a fixed-TTL lease on every rank (spec: one clock per engine).
            p.grant(now, key, kind=kind, ttl=ttl, lease_id=lease_id, push=push)
        if push:
            self.push_leases.add(lease_id)
        self.tickets[key] = LeaseTicket.from_dict(ticket.to_dict())
        self.granted_at[lease_id] = self.real
        return self.tickets[key]

    def track(self, engine: str, key: str, ticket: LeaseTicket) -> None:
        """Every rank of `engine` tracks `key` (misuse raises, as the core does)."""
        push = ticket.lease_id in self.push_leases
        for (e, r), acc in self.accessors.items():
            if e == engine:
                self._accessor_outputs(e, r, acc.track(self.now_a(e), key, ticket, push=push))

    def untrack(self, engine: str, rank: int, key: str) -> None:
        self._accessor_outputs(engine, rank, self.accessors[engine, rank].untrack(self.now_a(engine), key))

    def begin_access(self, engine: str, rank: int, key: str) -> AccessDecision:
        acc = self.accessors[engine, rank]
        decision = acc.begin_access(self.now_a(engine), key)
        if decision.allowed:
            first = decision.notifications[0]
            self.accesses[engine, rank, key] = MeshAccess(
                engine,
                rank,
                key,
                first.lease_id,
                self.real,
                decision.targets,
                {q: encode(decision.notification_for(q)) for q in decision.targets},
                first.attempt,
                push=first.lease_id in self.push_leases,
            )
        return decision

    def land_part(self, engine: str, rank: int, key: str, q: int) -> None:
        """The part of an open transfer that accesses pinner rank `q` landed before the rest:
        its attached access-done goes to `q` now (the network may still misroute it)."""
        access = self.accesses[engine, rank, key]
        if q in access.targets and q not in access.landed:
            access.landed.add(q)
            self._send(True, self.PINNER, q, access.notifications[q])

    def finish_access(self, engine: str, rank: int, key: str, *, notified: bool = True) -> None:
        """The transfer landed; its attached access-done (if `notified`) goes to every target
        rank whose part had not landed earlier, after the data, then the accessor hears the
        transfer finished."""
        access = self.accesses.pop((engine, rank, key))
        access.end = self.real
        self.finished[engine, rank, key] = access
        self._check_write(access, self.real)
        if notified:
            for q in access.targets:
                if q not in access.landed:
                    self._send(True, self.PINNER, q, access.notifications[q])
        acc = self.accessors[engine, rank]
        self._accessor_outputs(engine, rank, acc.access_finished(self.now_a(engine), key, notified=notified))

    def fail_access(
        self, engine: str, rank: int, key: str, *, posted: bool, landed: bool, lands_after: float = 0.0
    ) -> None:
        """The transport reports the transfer failed. `landed`: its attached notification
        reached every target rank anyway (a cancel that raced the completion). `lands_after`:
        a posted push WRITE still lands that many real seconds from now (S2 bounds it by the
        accessor's `max_access_time` from its begin; the caller respects that)."""
        access = self.accesses[engine, rank, key]
        if not posted and access.landed:
            # A part that landed was posted: its access-done is out, and may end the lease.
            raise ValueError(f"{engine}.{rank} {key!r}: parts {sorted(access.landed)} landed, so it was posted")
        del self.accesses[engine, rank, key]
        access.end = self.real
        if access.push and posted and lands_after > 0.0:
            access.lands_at = self.real + lands_after
            self.writes.append(access)
        else:
            self._check_write(access, self.real)
        if landed:
            for q in access.targets:
                self._deliver(MeshMessage(-1, True, self.PINNER, q, access.notifications[q], self.real, self.real))
        acc = self.accessors[engine, rank]
        self._accessor_outputs(engine, rank, acc.access_failed(self.now_a(engine), key, posted=posted))

    def disconnect(self, engine: str, rank: int) -> None:
        acc = self.accessors[engine, rank]
        self._accessor_outputs(engine, rank, acc.disconnect(self.now_a(engine), self.PINNER))

    def pinner_release(self, key: str) -> None:
        lease_id = self.tickets[key].lease_id
        for q, p in enumerate(self.pinners):
            if p.info(lease_id) is not None:
                self._pinner_outputs(q, p.release(self.now_p(), lease_id))

    # -- the network ------------------------------------------------------------------------

    def hold(self, i: int) -> None:
        if self.flight:
            self.flight[i % len(self.flight)].deliver_at = None

    def drop(self, i: int) -> None:
        if self.flight:
            self.flight.pop(i % len(self.flight))

    def duplicate(self, i: int) -> None:
        if self.flight:
            m = self.flight[i % len(self.flight)]
            self._send(m.to_pinner, m.engine, m.rank, m.data)

    def deliver_now(self, i: int, *, sibling: int | None = None) -> None:
        """Deliver in-flight message `i` now; `sibling`: to that rank of the same engine instead."""
        if not self.flight:
            return
        m = self.flight.pop(i % len(self.flight))
        if sibling is not None:
            ranks = len(self.pinners) if m.to_pinner else sum(1 for e, _ in self.accessors if e == m.engine)
            m = attrs.evolve(m, rank=(m.rank + 1 + sibling % max(ranks - 1, 1)) % ranks)
        self._deliver(m)
        self.check()

    def replay(self, i: int) -> None:
        """Deliver again, now, a message delivered earlier (a stale duplicate)."""
        if self.delivered:
            self._deliver(self.delivered[i % len(self.delivered)])
            self.check()

    def send_raw(self, q: int, message: Message) -> None:
        """Put `message` on the network to pinner rank `q`, as a peer outside the mesh sent
        it (an adversary's, or a non-conforming peer's: it is size-checked like the rest)."""
        self._send(True, self.PINNER, q, encode(message))

    def bound(self, engine: str) -> int:
        """The frame bound of the link between the pinner engine and accessor `engine`."""
        own = self.accessor_configs.get(engine)
        limit = self.config.max_message_bytes
        return limit if own is None else min(limit, own.max_message_bytes)

    def _send(self, to_pinner: bool, engine: str, rank: int, data: bytes) -> None:
        link = engine if not to_pinner else None
        if to_pinner and engine == self.PINNER and data:
            sender = decode(data)
            link = getattr(sender, "engine_id", None)
        limit = self.bound(link) if link is not None else self.config.max_message_bytes
        if len(data) > limit:
            raise InvariantViolation(
                f"{type(decode(data)).__name__} of {len(data)} bytes to {'pinner' if to_pinner else engine}.{rank} "
                f"exceeds max_message_bytes={limit}"
            )
        self._ident += 1
        lo, hi = self.delay
        self.flight.append(
            MeshMessage(self._ident, to_pinner, engine, rank, data, self.real, self.real + self.rng.uniform(lo, hi))
        )

    def _deliver(self, m: MeshMessage) -> None:
        self.delivered.append(m)
        if len(self.delivered) > self._history:
            del self.delivered[0]
        msg = decode(m.data)
        if m.to_pinner:
            if m.engine != self.PINNER or not 0 <= m.rank < len(self.pinners):
                return
            # Only a rank's own part's access-done shows that part's data landed; one
            # misdelivered from a sibling part says nothing about this rank's part.
            if isinstance(msg, AccessDone) and msg.to_rank == m.rank:
                self.done_heard.setdefault((msg.lease_id, m.rank), set()).add((msg.engine_id, msg.rank, msg.attempt))
            self._pinner_outputs(m.rank, self.pinners[m.rank].receive(self.now_p(), msg))
        else:
            acc = self.accessors.get((m.engine, m.rank))
            if acc is not None:
                self._accessor_outputs(m.engine, m.rank, acc.receive(self.now_a(m.engine), msg))

    # -- time -------------------------------------------------------------------------------

    def advance(self, dt: float) -> None:
        """Move real time on by `dt`, waking every endpoint at its deadlines and delivering
        every message whose time has come (held ones stay held)."""
        if dt < 0.0:
            raise ValueError("real time never runs backwards")
        _run_events(self.real, self.real + dt, self._next_event, self._step)

    def _next_event(self) -> float | None:
        cands = [m.deliver_at for m in self.flight if m.deliver_at is not None]
        cands += [w.lands_at for w in self.writes if w.lands_at is not None]
        for p in self.pinners:
            nd = p.next_deadline()
            if nd is not None:
                cands.append(self.pinner_clock.real(nd) + STEP_EPSILON)
        for (e, _), acc in self.accessors.items():
            nd = acc.next_deadline()
            if nd is not None:
                cands.append(self.accessor_clocks[e].real(nd) + STEP_EPSILON)
        return min(cands) if cands else None

    def _step(self, real: float) -> None:
        self.real = max(real, self.real)
        for w in [w for w in self.writes if w.lands_at is not None and w.lands_at <= self.real]:
            self.writes.remove(w)
            self._check_write(w, self.real)
        due = [m for m in self.flight if m.deliver_at is not None and m.deliver_at <= self.real]
        self.flight = [m for m in self.flight if m.deliver_at is None or m.deliver_at > self.real]
        for m in sorted(due, key=lambda m: (m.deliver_at or 0.0, m.ident)):
            self._deliver(m)
        now_p = self.now_p()
        for q, p in enumerate(self.pinners):
            nd = p.next_deadline()
            if nd is not None and nd <= now_p:
                outputs = p.handle_timeout(now_p)
                after = p.next_deadline()
                if after is not None and after <= now_p:
                    raise InvariantViolation(f"pinner rank {q} next_deadline {after} <= now {now_p}")
                self._pinner_outputs(q, outputs)
        for (e, r), acc in self.accessors.items():
            now_a = self.now_a(e)
            nd = acc.next_deadline()
            if nd is not None and nd <= now_a:
                a_out = acc.handle_timeout(now_a)
                after = acc.next_deadline()
                if after is not None and after <= now_a:
                    raise InvariantViolation(f"accessor {e}.{r} next_deadline {after} <= now {now_a}")
                self._accessor_outputs(e, r, a_out)
        self.check()

    # -- dispatch ---------------------------------------------------------------------------

    def _pinner_outputs(self, q: int, outputs: tuple[PinnerOutput, ...]) -> None:
        for o in outputs:
            match o:
                case Send():
                    self._send(False, o.engine_id, o.rank if o.rank is not None else 0, encode(o.message))
                case Free():
                    self._on_free(q, o)
                case Rejected():
                    self.rejected.append(o)
                case _:
                    assert_never(o)

    def _accessor_outputs(self, engine: str, rank: int, outputs: tuple[AccessorOutput, ...]) -> None:
        for o in outputs:
            match o:
                case Send():
                    if o.rank is None:
                        raise InvariantViolation(f"{engine}.{rank} sent to every rank: {o!r}")
                    self._send(True, o.engine_id, o.rank, encode(o.message))
                case HandshakeNeeded():
                    self._send(True, o.engine_id, 0, encode(o.message))
                case LeaseLost() | AccessCompleted() | AccessStale():
                    self._on_event(engine, rank, o)
                case Rejected():
                    self.rejected.append(o)
                case _:
                    assert_never(o)

    # -- audit ------------------------------------------------------------------------------

    def _on_free(self, q: int, free: Free) -> None:
        k = (free.lease_id, q)
        if k in self.frees:
            raise InvariantViolation(f"second Free of lease {free.lease_id} on pinner rank {q}: {free!r}")
        self.frees[k] = (self.real, free)
        for w in [*self.accesses.values(), *self.writes]:
            if w.push and w.lease_id == free.lease_id and q in w.targets:
                raise InvariantViolation(
                    f"push write of {w.engine}.{w.rank} into lease {free.lease_id} (begun at real {w.begin}) "
                    f"in flight when pinner rank {q} freed it ({free.reason.value})"
                )

    def _check_write(self, w: MeshAccess, end: float) -> None:
        """A push WRITE that landed at `end` must not have outlived a free of a rank it wrote."""
        if not w.push:
            return
        for q in w.targets:
            freed = self.frees.get((w.lease_id, q))
            if freed is not None and freed[0] < end - TIME_TOLERANCE:
                raise InvariantViolation(
                    f"push write into lease {w.lease_id} landed at real {end}, after pinner rank {q} freed it "
                    f"at {freed[0]} ({freed[1].reason.value})"
                )

    def _on_event(self, engine: str, rank: int, ev: LeaseLost | AccessCompleted | AccessStale) -> None:
        self.events.append((engine, rank, ev))
        if not isinstance(ev, AccessCompleted):
            return
        access = self.finished.get((engine, rank, ev.key))
        if access is None or access.end is None:
            raise InvariantViolation(f"AccessCompleted for {engine}.{rank} {ev.key!r} with no finished access")
        own = (engine, rank, access.attempt)
        for q in access.targets:
            freed = self.frees.get((access.lease_id, q))
            # A free this very access's own access-done caused came after its data landed;
            # any other free at or before the access's end overlapped it.
            if (
                freed is not None
                and own not in self.done_heard.get((access.lease_id, q), set())
                and (freed[0] <= access.end + TIME_TOLERANCE)
            ):
                raise InvariantViolation(
                    f"stale read reported done: {engine}.{rank} read {ev.key!r} (lease {access.lease_id}) from "
                    f"pinner rank {q} during [{access.begin}, {access.end}], but that rank freed it at real "
                    f"{freed[0]} ({freed[1].reason.value})"
                )

    def check(self) -> None:
        """Every accessor rank's validity window ends before any free (or expiry) of a pinner
        rank it accesses, in real time."""
        p_ranks = len(self.pinners)
        # Each pinner rank's expiry of a lease, in real time, read once per check (several
        # accessor ranks compare against the same one).
        expiry_real: dict[tuple[int, int], float | None] = {}
        for (e, r), acc in self.accessors.items():
            clock = self.accessor_clocks[e]
            targets = tp_layout(p_ranks, acc.ranks, r).targets
            for key, ticket in self.tickets.items():
                v = acc.valid_until(key)
                if v is None:
                    continue
                v_real = clock.real(v)
                lid = ticket.lease_id
                for q in targets:
                    limit: float | None
                    freed = self.frees.get((lid, q))
                    if freed is not None:
                        # Validity past a free is fine only while the access whose own
                        # access-done caused that free is still being finished (not for a
                        # later one).
                        access = self.accesses.get((e, r, key)) or self.finished.get((e, r, key))
                        own = (
                            access is not None
                            and acc.state_of(key) is not TrackedState.WAITING
                            and (e, r, access.attempt) in self.done_heard.get((lid, q), ())
                        )
                        limit = None if own else freed[0]
                    elif (lid, q) in expiry_real:
                        limit = expiry_real[lid, q]
                    else:
                        info = self.pinners[q].info(lid)
                        limit = None if info is None else self.pinner_clock.real(info.expiry)
                        expiry_real[lid, q] = limit
                    if limit is not None and v_real > limit + TIME_TOLERANCE:
                        raise InvariantViolation(
                            f"{e}.{r} counts {key!r} (lease {lid}) valid until real {v_real}, "
                            f"past pinner rank {q}'s {'free' if freed else 'expiry'} at {limit}"
                        )
