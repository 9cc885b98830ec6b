"""What one accessor rank knows of one pinner engine: connection, clock, terms and rounds.

`PinnerEngine` holds, per pinner engine: whether a handshake answered (and which are in
flight), the incarnation and TP size it stated, the terms validity may assume (`LeaseTerms`,
the stricter of both sides'), the clock-offset estimate that converts its fixed-TTL deadlines
to our clock, and the heartbeat rounds awaiting acks (bounded in rounds, not chunks). The
`Accessor` owns one per engine it tracks a lease of, and is its only writer.

Pure; never reads a clock.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from ._clock import ClockOffsetEstimator, LocalTime, PeerTime
from ._config import LeaseConfig
from ._terms import LeaseTerms

if TYPE_CHECKING:
    from ._accessor import _Tracked as Tracked

__all__ = ["Outstanding", "PinnerEngine", "Round"]

_NEG_INF = float("-inf")


class Round:
    """One heartbeat round to one engine: its chunks' seqs still awaiting acks."""

    __slots__ = ("seqs", "t_send")

    def __init__(self, t_send: float) -> None:
        self.t_send = t_send
        self.seqs: set[int] = set()


class Outstanding:
    """One heartbeat chunk awaiting acks from its target pinner ranks."""

    __slots__ = ("extension", "ids", "incarnation", "missing", "pending_ranks", "round", "round_id", "t_send")

    def __init__(
        self, t_send: float, incarnation: int, ids: tuple[int, ...], ranks: range, rnd: Round, round_id: int
    ) -> None:
        self.t_send = t_send
        self.incarnation = incarnation
        self.ids = ids
        self.pending_ranks = set(ranks)
        self.missing: set[int] = set()
        self.extension = float("inf")  # the smallest extension an ack of this chunk stated
        self.round = rnd
        self.round_id = round_id


class PinnerEngine:
    """What this accessor rank knows of one pinner engine."""

    __slots__ = (
        "clock",
        "connected",
        "deadlines",
        "engine_id",
        "handshake_due",
        "handshake_for",
        "handshakes",
        "incarnation",
        "leases",
        "max_message_bytes",
        "new_ids",
        "next_heartbeat",
        "outstanding",
        "ranks",
        "rounds",
        "terms",
    )

    def __init__(self, engine_id: str, config: LeaseConfig, ranks: int) -> None:
        self.engine_id = engine_id
        self.connected = False
        self.incarnation: int | None = None
        self.ranks = ranks
        # Keyed by (incarnation, lease id): a restarted pinner reuses ids under a new incarnation.
        self.leases: dict[tuple[int, int], Tracked] = {}
        self.deadlines: dict[tuple[int, int], PeerTime] = {}  # fixed-TTL deadlines, pinner clock
        self.new_ids: set[tuple[int, int]] = set()
        self.next_heartbeat = float("inf")
        self.handshake_due = _NEG_INF
        # Handshakes sent and not yet answered: seq -> t_send. A reply counts only if it answers
        # one of them; the first accepted reply retires them all (older ones are superseded).
        self.handshakes: OrderedDict[int, float] = OrderedDict()
        # The incarnation named by the ticket whose tracking asked for those handshakes (None:
        # proactive). A ticket of another one retires them: their replies may predate it.
        self.handshake_for: int | None = None
        self.outstanding: OrderedDict[int, Outstanding] = OrderedDict()
        # Rounds with chunks awaiting acks, oldest first (max_outstanding_heartbeats bounds them).
        self.rounds: OrderedDict[int, Round] = OrderedDict()
        # What validity may assume: our own terms until the pinner states its own (handshake).
        self.terms = LeaseTerms.own(config)
        self.max_message_bytes = config.max_message_bytes  # lowered to the pinner's at handshake
        self.clock = ClockOffsetEstimator(config.max_drift_rate, config.clock_sample_window)

    def make_room(self, now: float, bound: int, *, periodic: bool) -> bool:
        """Forget rounds that can no longer extend anything (sent before ``now - E_a``); for a
        periodic round also the oldest while `bound` rounds are outstanding. Whether there is
        room for another round (spec §5.3: the bound is on rounds, never on chunks)."""
        horizon = now - self.terms.accessor_extension
        rounds = self.rounds
        while rounds:
            round_id, rnd = next(iter(rounds.items()))
            if not (rnd.t_send < horizon or (periodic and len(rounds) >= bound)):
                break
            del rounds[round_id]
            for seq in rnd.seqs:
                self.outstanding.pop(seq, None)
        return len(rounds) < bound

    def fixed_valid_until(self, now: float, lkey: tuple[int, int], margin: float) -> float | None:
        """A fixed-TTL lease's validity in our clock: its deadline (pinner clock) converted
        with the current clock-offset estimate, less `margin`; None while the estimate cannot
        bound it (no sample yet, or the deadline is not known)."""
        deadline = self.deadlines.get(lkey)
        if deadline is None:
            return None
        local = self.clock.to_local_deadline(LocalTime(now), deadline)
        return None if local is None else local - margin
