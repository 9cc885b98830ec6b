"""The simulated cluster's things: drifting clocks, requests, the simulator's lease records
and the prefill and decode engines that hold the real core objects.

Owns plain mutable records (``__slots__`` classes, for speed); behaviour lives in the layers of
`Cluster`. Names say which side they model: `SimLease` is the simulator's record of a lease
granted by a prefill engine (all its pinner ranks share the id), not the pinner's own record.
"""

from __future__ import annotations

import math
from collections import deque

from .._accessor import Accessor
from .._clock import LocalTime
from .._messages import AccessDone, LeaseTicket
from .._pinner import Pinner
from ._baselines import FixedTimeoutPinner

__all__ = ["DecodeEngine", "DriftingClock", "PrefillEngine", "Request", "SimEngine", "SimLease", "respawn"]

_INF = math.inf


class DriftingClock:
    """local = epoch + rate * real; rate within the scenario's drift bound. All ranks of an
    engine read the same clock object: their readings are equal at the same instant.

    `floor`: a reading handed to the core at an exact instant (an access ending exactly at
    valid_until, a message handled exactly at a lease's expiry) may be a rounding step above
    ``epoch + rate * t``; later readings never go below it, so time never runs backwards."""

    __slots__ = ("epoch", "floor", "rate")

    def __init__(self, epoch: float, rate: float) -> None:
        self.epoch = epoch
        self.rate = rate
        self.floor = -_INF

    def local(self, t: float) -> LocalTime:
        v = self.epoch + self.rate * t
        return LocalTime(v if v >= self.floor else self.floor)

    def real(self, local: float) -> float:
        return (local - self.epoch) / self.rate


class SimLease:
    """The simulator's record of one granted lease (all pinner ranks share its id)."""

    __slots__ = (
        "api",
        "blocks",
        "d_crash",
        "d_name",
        "dead_since",
        "freed",
        "granted",
        "incarnation",
        "key",
        "last_hb",
        "lease_id",
        "p",
        "push",
        "req",
        "troubled",
        "unfreed",
    )

    def __init__(self, p: PrefillEngine, incarnation: int, lease_id: int, req: Request, t: float) -> None:
        self.p = p
        self.incarnation = incarnation
        self.lease_id = lease_id
        self.key = req.key
        self.req: Request | None = req
        self.blocks = req.blocks / p.tp  # per rank
        self.d_name = req.d.name if req.d is not None else ""
        self.push = req.push
        self.granted = t
        self.last_hb = -_INF
        self.dead_since = _INF
        self.d_crash = _INF
        self.freed: dict[int, tuple[float, str]] = {}
        self.unfreed = p.tp
        self.troubled = ""
        self.api = False  # API-level adversity touched it: off the liveness claim's fault-free path

    @property
    def name(self) -> str:
        return f"{self.p.name}/{self.incarnation}/{self.lease_id}"


class Request:
    __slots__ = (
        "arrival",
        "attempt",
        "blocks",
        "copy",
        "d",
        "done_ranks",
        "due",
        "exact",
        "failed",
        "id",
        "key",
        "lease",
        "notes",
        "out_tokens",
        "p",
        "prompt",
        "push",
        "ticket",
        "xfer_end",
        "xfer_start",
    )

    def __init__(self, rid: int, arrival: float, prompt: int, out_tokens: int, blocks: int, push: bool) -> None:
        self.id = rid
        self.arrival = arrival
        self.prompt = prompt
        self.out_tokens = out_tokens
        self.blocks = blocks
        self.push = push
        self.attempt = 0
        self.key = ""
        self.p: PrefillEngine | None = None
        self.d: DecodeEngine | None = None
        self.lease: SimLease | None = None
        self.ticket: LeaseTicket | None = None
        self.done_ranks = 0
        self.failed = False
        self.xfer_start = 0.0
        self.xfer_end = 0.0
        self.due = 0.0  # when the engine's loop finishes the transfer (inf: an exact-end event does)
        self.exact: float | None = None  # the accessor valid_until the transfer ends exactly at
        # Attached notifications (rank, pinner ranks, access-done), delivered after the data landed.
        self.notes: list[tuple[int, tuple[int, ...], tuple[AccessDone, ...]]] | None = None
        self.copy = False  # API adversity: a second tracking of another request's ticket


class SimEngine:
    __slots__ = (
        "alive",
        "checked",
        "clock",
        "gen",
        "inbox",
        "name",
        "step_end",
        "stepping",
        "tp",
        "wake_at",
    )

    def __init__(self, name: str, tp: int, clock: DriftingClock) -> None:
        self.name = name
        self.tp = tp
        self.clock = clock
        self.alive = True
        self.gen = 0  # bumped on crash/restart: stale events and messages are dropped
        self.inbox: list[tuple[int, bytes]] = []
        # API adversity: deliveries to a rank they were not addressed to, or stale ones, which
        # must confer nothing (rank, frame, why); handled at the boundary like the inbox.
        self.checked: list[tuple[int, bytes, str]] = []
        self.stepping = False
        self.step_end = 0.0
        self.wake_at = _INF


class PrefillEngine(SimEngine):
    __slots__ = ("current", "fixed", "incarnation", "last_id", "live", "pinners", "queue")

    def __init__(self, name: str, tp: int, clock: DriftingClock) -> None:
        super().__init__(name, tp, clock)
        self.queue: deque[Request] = deque()
        self.current: Request | None = None
        self.pinners: list[Pinner] = []
        self.fixed: list[FixedTimeoutPinner] = []
        self.incarnation = 0
        self.last_id = 0  # the last lease id granted (ids far apart: `Scenario.id_gap`)
        self.live: dict[int, SimLease] = {}


class DecodeEngine(SimEngine):
    __slots__ = (
        "accessors",
        "cut_seq",
        "finishing",
        "flush",
        "hb_due",
        "replies",
        "reqs",
        "running",
        "sent_seq",
        "slots",
        "stall_until",
        "steps",
        "transfers",
        "waiting",
    )

    def __init__(self, name: str, tp: int, slots: int, clock: DriftingClock) -> None:
        super().__init__(name, tp, clock)
        self.slots = slots
        self.accessors: list[Accessor] = []
        self.replies: list[tuple[int, bytes]] = []
        self.reqs: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: dict[str, Request] = {}
        # (forward pass at whose end the request has decoded all its tokens, id, key): one
        # heap instead of touching every running request on every step.
        self.finishing: list[tuple[int, int, str]] = []
        self.steps = 0
        self.transfers: list[Request] = []
        self.stall_until = 0.0  # the next forward pass lasts at least until then
        self.flush = False  # the stalled forward pass finishes the whole running batch
        self.hb_due = _INF  # vLLM-style heartbeats
        # API adversity (disconnect): the highest seq each rank sent to each pinner engine, and
        # at the last disconnect; an answer to a seq at or below the cut is stale.
        self.sent_seq: dict[tuple[int, str], int] = {}
        self.cut_seq: dict[tuple[int, str], int] = {}


def respawn(req: Request) -> Request:
    """The same client request, tried again (a fresh object: the old attempt's transfer may
    still be in flight and must keep its own key)."""
    new = Request(req.id, req.arrival, req.prompt, req.out_tokens, req.blocks, req.push)
    new.attempt = req.attempt
    return new
