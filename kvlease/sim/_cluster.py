"""The discrete-event simulation of a P/D cluster driving the real kvlease core.

Owns: virtual real time (one event heap), each engine's drifting clock, the forward loops of
prefill (pinner) and decode (accessor) engines, the router, the network (delay, loss,
duplication, reordering, partitions) and the handshake side channel, crashes and restarts, and
the bookkeeping that metrics and the safety/liveness checks need. Every kvlease message is
encoded and decoded on its way; the engines hold real `Pinner` and `Accessor` objects (or the
baseline models of `Policy.FIXED_*`), fed only their own local clock.

Must never read a clock, sleep, start a thread or do I/O: a run is a pure function of its
scenario, policy and seed, so a seed reproduces bit for bit.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from .._accessor import AccessDecision, Accessor, TrackedState
from .._clock import LocalTime
from .._codec import decode, encode
from .._config import LeaseConfig
from .._errors import DecodeError, LocalProtocolError
from .._events import (
    AccessCompleted,
    AccessStale,
    EndReason,
    Free,
    HandshakeNeeded,
    LeaseLost,
    LostReason,
    Rejected,
    Send,
)
from .._layout import tp_layout
from .._messages import (
    AccessDone,
    AccessDoneAck,
    Handshake,
    HandshakeReply,
    Heartbeat,
    HeartbeatAck,
    LeaseTicket,
    Message,
    Release,
)
from .._pinner import LeaseInfo, Pinner
from .._vllm_compat import VllmAccessDone, VllmHeartbeat, decode_vllm, encode_vllm_done, encode_vllm_heartbeat
from ._scenario import FaultKind, Policy, Scenario

__all__ = ["AccessorFactory", "Cluster", "PinnerFactory", "RunResult", "Violation"]

PinnerFactory = Callable[[LeaseConfig, str, int, int, int], Pinner]
AccessorFactory = Callable[[LeaseConfig, str, int, int, int], Accessor]

_INF = math.inf
_heappush = heapq.heappush
_log = math.log
_heappop = heapq.heappop


@attrs.frozen
class Violation:
    """A broken safety or liveness claim, with what is needed to find it in a trace."""

    claim: str
    at: float
    detail: str
    lease: str = ""  # "P0/inc/lease_id"
    key: str = ""

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.define
class RunResult:
    """Everything a run measured. `summary()` is the JSON-friendly, comparable part."""

    policy: str
    seed: int
    sim_seconds: float
    events: int = 0
    requests: int = 0
    completed: int = 0
    prefills: int = 0
    recomputed: int = 0
    false_frees: int = 0
    leases_lost: int = 0
    stale_caught: int = 0
    stale_used: int = 0
    dead_block_seconds: float = 0.0
    peak_pinned_blocks: float = 0.0
    pinned_block_seconds: float = 0.0
    heartbeat_bytes: int = 0
    protocol_bytes: int = 0
    messages: int = 0
    dropped: int = 0
    rejected: int = 0
    reclaim_latencies: list[float] = attrs.field(factory=list)
    timeline: list[tuple[float, float]] = attrs.field(factory=list)
    violations: list[Violation] = attrs.field(factory=list)
    trace: list[tuple[float, str, str, str]] | None = None
    #: API-level adversity that happened (`Scenario.api`), by kind: e.g. ``retrack-after-untrack-refused``.
    api: dict[str, int] = attrs.field(factory=dict)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.reclaim_latencies)

        def q(p: float) -> float | None:
            return None if not lat else round(lat[min(len(lat) - 1, int(p * len(lat)))], 6)

        return {
            "policy": self.policy,
            "seed": self.seed,
            "sim_seconds": self.sim_seconds,
            "events": self.events,
            "requests": self.requests,
            "completed": self.completed,
            "prefills": self.prefills,
            "recomputed": self.recomputed,
            "false_frees": self.false_frees,
            "leases_lost": self.leases_lost,
            "stale_caught": self.stale_caught,
            "stale_used": self.stale_used,
            "dead_block_seconds": round(self.dead_block_seconds, 6),
            "peak_pinned_blocks": round(self.peak_pinned_blocks, 6),
            "pinned_block_seconds": round(self.pinned_block_seconds, 6),
            "heartbeat_bytes": self.heartbeat_bytes,
            "protocol_bytes": self.protocol_bytes,
            "messages": self.messages,
            "dropped": self.dropped,
            "rejected": self.rejected,
            "reclaim_p50": q(0.5),
            "reclaim_p99": q(0.99),
            "reclaim_max": None if not lat else round(lat[-1], 6),
            "reclaimed_after_crash": len(lat),
            "violations": [v.to_json() for v in self.violations],
            **({"api": dict(sorted(self.api.items()))} if self.api else {}),
        }


class _Clock:
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


class _Lease:
    """The simulator's record of one granted lease (all pinner ranks share its id)."""

    __slots__ = (
        "api", "blocks", "d_crash", "d_name", "dead_since", "freed", "granted", "incarnation", "key", "last_hb",
        "lease_id", "p", "push", "req", "troubled", "unfreed",
    )

    def __init__(self, p: _PEngine, incarnation: int, lease_id: int, req: _Req, t: float) -> None:
        self.p = p
        self.incarnation = incarnation
        self.lease_id = lease_id
        self.key = req.key
        self.req: _Req | None = req
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


class _Req:
    __slots__ = (
        "arrival", "attempt", "blocks", "copy", "d", "done_ranks", "due", "exact", "failed", "id", "key", "lease",
        "notes", "out_tokens", "p", "prompt", "push", "ticket", "xfer_end", "xfer_start",
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
        self.p: _PEngine | None = None
        self.d: _DEngine | None = None
        self.lease: _Lease | None = None
        self.ticket: LeaseTicket | None = None
        self.done_ranks = 0
        self.failed = False
        self.xfer_start = 0.0
        self.xfer_end = 0.0
        self.due = 0.0  # when the engine's loop finishes the transfer (inf: an exact-end event does)
        self.exact: float | None = None  # the accessor valid_until the transfer ends exactly at
        # Attached notifications (rank, pinner ranks, access-done), delivered after the data landed.
        self.notes: list[tuple[int, tuple[int, ...], AccessDone]] | None = None
        self.copy = False  # API adversity: a second tracking of another request's ticket


class _FixedPinner:
    """Baseline model (not kvlease): free at grant + T, or when `expected` read-dones came."""

    __slots__ = ("by_key", "heap", "leases", "next_id", "timeout")

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.leases: dict[int, list[Any]] = {}  # id -> [expiry, key, done, expected]
        self.by_key: dict[str, int] = {}
        self.heap: list[tuple[float, int]] = []
        self.next_id = 1

    def grant(self, now: float, key: str) -> int:
        lid = self.next_id
        self.next_id += 1
        self.leases[lid] = [now + self.timeout, key, 0]
        self.by_key[key] = lid
        heapq.heappush(self.heap, (now + self.timeout, lid))
        return lid

    def done(self, now: float, key: str, count: int) -> Free | None:
        lid = self.by_key.get(key)
        if lid is None or lid not in self.leases:
            return None
        rec = self.leases[lid]
        rec[2] += 1
        if rec[2] >= count:
            return self._end(lid, EndReason.ACCESS_DONE, now)
        return None

    def handle_timeout(self, now: float) -> list[Free]:
        out = []
        while self.heap and self.heap[0][0] <= now:
            _, lid = heapq.heappop(self.heap)
            if lid in self.leases:
                out.append(self._end(lid, EndReason.EXPIRED, now))
        return out

    def next_deadline(self) -> float | None:
        while self.heap and self.heap[0][1] not in self.leases:
            heapq.heappop(self.heap)
        return self.heap[0][0] if self.heap else None

    def _end(self, lid: int, reason: EndReason, now: float) -> Free:
        rec = self.leases.pop(lid)
        self.by_key.pop(rec[1], None)
        return Free(lid, rec[1], reason, LocalTime(now))


class _Engine:
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

    def __init__(self, name: str, tp: int, clock: _Clock) -> None:
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


class _PEngine(_Engine):
    __slots__ = ("current", "fixed", "incarnation", "live", "pinners", "queue")

    def __init__(self, name: str, tp: int, clock: _Clock) -> None:
        super().__init__(name, tp, clock)
        self.queue: deque[_Req] = deque()
        self.current: _Req | None = None
        self.pinners: list[Pinner] = []
        self.fixed: list[_FixedPinner] = []
        self.incarnation = 0
        self.live: dict[int, _Lease] = {}


class _DEngine(_Engine):
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

    def __init__(self, name: str, tp: int, slots: int, clock: _Clock) -> None:
        super().__init__(name, tp, clock)
        self.slots = slots
        self.accessors: list[Accessor] = []
        self.replies: list[tuple[int, bytes]] = []
        self.reqs: dict[str, _Req] = {}
        self.waiting: list[_Req] = []
        self.running: dict[str, _Req] = {}
        # (forward pass at whose end the request has decoded all its tokens, id, key): one
        # heap instead of touching every running request on every step.
        self.finishing: list[tuple[int, int, str]] = []
        self.steps = 0
        self.transfers: list[_Req] = []
        self.stall_until = 0.0  # the next forward pass lasts at least until then
        self.flush = False  # the stalled forward pass finishes the whole running batch
        self.hb_due = _INF  # vLLM-style heartbeats
        # API adversity (disconnect): the highest seq each rank sent to each pinner engine, and
        # at the last disconnect; an answer to a seq at or below the cut is stale.
        self.sent_seq: dict[tuple[int, str], int] = {}
        self.cut_seq: dict[tuple[int, str], int] = {}


class Cluster:
    """One run of one policy on one scenario. `run()` returns the `RunResult`.

    `pinner_factory` / `accessor_factory` build the core objects (a test passes deliberately
    broken doubles to show the checks can fail). With `check=True` every safety and liveness
    claim is checked as the run goes and violations are collected; `trace=True` records an
    event trace (slower) for the campaign's minimized reports.

    With `scenario.api` (kvlease policy only) the engines and their transport also misuse the
    API at the worst moment: re-track a ticket after untrack, completion, disconnect or a failed
    transfer, hand a ticket to a second request, deliver a transfer's attached notification and
    then report the transfer failed (or fail before posting and retry), misroute messages and
    handshake replies to a sibling rank of the right engine, deliver replies again later,
    disconnect, end a transfer exactly at valid_until and have a pinner handle a message exactly
    at a lease's expiry. Each draws from its own random stream (`api_rngs`), so the scenario
    without it runs exactly as before and one switched off leaves the others' draws alone.
    """

    def __init__(
        self,
        scenario: Scenario,
        policy: Policy = Policy.KVLEASE,
        *,
        pinner_factory: PinnerFactory | None = None,
        accessor_factory: AccessorFactory | None = None,
        check: bool = False,
        trace: bool = False,
        record: bool = False,
    ) -> None:
        self.sc = scenario
        self.policy = policy
        self.cfg = scenario.config
        if policy is Policy.VLLM_HB:
            self.cfg = self.cfg.with_changes(vllm_compat=True)
        self.pinner_factory: PinnerFactory = pinner_factory or (
            lambda c, e, inc, r, n: Pinner(c, e, inc, rank=r, ranks=n)
        )
        self.accessor_factory: AccessorFactory = accessor_factory or (
            lambda c, e, r, n, session: Accessor(c, e, session=session, rank=r, ranks=n)
        )
        self.check = check
        self.rng = random.Random(scenario.seed)
        self.net_rng = random.Random(scenario.seed ^ 0x5EED)
        self.result = RunResult(policy.value, scenario.seed, scenario.workload.duration)
        if trace:
            self.result.trace = []
        # Hot paths test these flags before building a trace line or a recorded step, so a
        # plain run never formats strings or dicts it throws away.
        self._tracing = trace
        self._native = policy is Policy.KVLEASE  # kvlease frames on the wire (else vLLM's)
        self._vllm_hb = policy is Policy.VLLM_HB
        wl = scenario.workload
        self._step_base = wl.step_base  # a decode forward pass: base + per-sequence time
        self._step_per_seq = wl.step_per_seq
        #: With `record`: every call made on a core object, as conformance-vector steps
        #: (spec/vectors/README.md), and the endpoints they address.
        self.recorded: list[dict[str, Any]] | None = [] if record else None
        self.endpoints: dict[str, dict[str, Any]] = {}
        self._endpoint_names: dict[int, str] = {}
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        # Idle engines' wake-ups, in a heap of their own: most are superseded long before they
        # come due (an engine re-arms on every boundary) yet stay queued, and in the main heap
        # they would sit under every forward-pass event. `run` pops the earlier of both heads
        # by (time, sequence), so the order of events is that of one heap.
        self._wakes: list[tuple[float, int, Callable[[Any], None], Any]] = []
        # Tie-breaker of simultaneous events: scheduling order (1, 2, 3, ...).
        self._seqs = itertools.count(1)
        self.now = 0.0
        self.pinned = 0.0
        self._last_pin_t = 0.0
        self.dead_pinned = 0.0
        self.partitions: dict[tuple[str, str], int] = {}
        self.leases: dict[tuple[str, int, int], _Lease] = {}
        self.all_leases: list[_Lease] = []
        self.next_req = 0
        wl = scenario.workload
        self.p_step_max = wl.prefill_base + wl.prefill_per_token * wl.prompt_tokens[1]
        drift = scenario.drift
        self.p: dict[str, _PEngine] = {}
        self.d: dict[str, _DEngine] = {}
        for spec in scenario.prefill:
            pe = _PEngine(spec.name, spec.tp, self._new_clock(drift, fast=True))
            self._start_pinner(pe)
            self.p[spec.name] = pe
        for dspec in scenario.decode:
            de = _DEngine(dspec.name, dspec.tp, dspec.slots, self._new_clock(drift, fast=False))
            self._start_accessor(de)
            self.d[dspec.name] = de
        self.engines: dict[str, _Engine] = {**self.p, **self.d}
        self.router_down: dict[str, bool] = dict.fromkeys(self.engines, False)
        # API-level adversity (kvlease only): its own random stream, so a scenario without it
        # draws exactly what it drew before the knob existed.
        self.api = scenario.api if policy is Policy.KVLEASE else None
        api = self.api
        # One random stream per kind of API fault: switching one off (as `minimize` does)
        # leaves the others' draws as they were.
        self.api_rngs: dict[str, random.Random] = {
            f.name: random.Random(scenario.seed * 0x9E3779B1 + 0xA91 + 7919 * i)
            for i, f in enumerate(attrs.fields(type(api)) if api is not None else ())
        }
        self._misroute = api.misroute if api is not None else 0.0
        self._at_expiry = api.at_expiry if api is not None else 0.0
        self._track_seq = api is not None and api.disconnect > 0
        #: (real time, decode engine, pinner engine) of each API fault that can cost a lease
        #: its messages (misroute, held message): off the liveness claim's fault-free path.
        self.api_marks: list[tuple[float, str, str]] = []
        self._copies = itertools.count(1)

    # -- infrastructure -----------------------------------------------------------------------

    def _new_clock(self, drift: float, *, fast: bool) -> _Clock:
        # Clocks at the bound most of the time, and mostly in the adversarial direction
        # (pinners fast: they expire early in real time; accessors slow: they believe late):
        # that is where drift bugs live.
        r = self.rng.choice((drift, drift, -drift, self.rng.uniform(-drift, drift)))
        return _Clock(self.rng.uniform(1e4, 2e5), 1.0 + (r if fast else -r))

    def _rec(self, obj: object, now: float, op: str, args: dict[str, Any] | None = None) -> None:
        """Record one core call as a conformance-vector step (only with `record`)."""
        if self.recorded is not None:
            step: dict[str, Any] = {"endpoint": self._endpoint_names[id(obj)], "now": now, "op": op, "t": self.now}
            if args:
                step["args"] = args
            self.recorded.append(step)

    def _register(self, obj: object, spec: dict[str, Any]) -> None:
        if self.recorded is not None:
            name = f"{spec['engine_id']}.{spec['rank']}#{spec.pop('generation')}"
            self._endpoint_names[id(obj)] = name
            self.endpoints[name] = spec

    def _at(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        _heappush(self._heap, (t, next(self._seqs), fn, arg))

    def _trace(self, who: str, what: str, detail: str) -> None:
        tr = self.result.trace
        if tr is not None:
            tr.append((round(self.now, 9), who, what, detail))

    def _violate(self, claim: str, detail: str, lease: _Lease | None = None) -> None:
        v = Violation(claim, self.now, detail, lease.name if lease else "", lease.key if lease else "")
        self.result.violations.append(v)
        if self._tracing:
            self._trace("check", "VIOLATION", f"{claim}: {detail}")

    def _set_pinned(self, delta: float, dead_delta: float = 0.0) -> None:
        t = self.now
        dt = t - self._last_pin_t
        if dt > 0:
            self.result.pinned_block_seconds += self.pinned * dt
            self.result.dead_block_seconds += self.dead_pinned * dt
            self._last_pin_t = t
        self.pinned += delta
        self.dead_pinned += dead_delta
        if self.pinned > self.result.peak_pinned_blocks:
            self.result.peak_pinned_blocks = self.pinned

    def run(self) -> RunResult:
        sc = self.sc
        wl = sc.workload
        for f in sc.faults:
            self._at(f.at, self._fault, f)
        if self.api is not None and self.api.disconnect > 0:
            for de in self.d.values():
                self._at(self.api_rngs["disconnect"].expovariate(self.api.disconnect), self._disconnect, de)
        self._at(0.0, self._arrival, None)
        if wl.sample_every > 0:
            self._at(0.0, self._sample, None)
        heap = self._heap
        wakes = self._wakes
        end = wl.duration
        events = 0
        pop = _heappop
        while True:
            # Sequence numbers are unique across both heaps: the comparison never reaches `fn`.
            if wakes and (not heap or wakes[0] < heap[0]):
                t, _, fn, arg = pop(wakes)
            elif heap:
                t, _, fn, arg = pop(heap)
            else:
                break
            if t > end:
                break
            self.now = t
            events += 1
            fn(arg)
        self.now = end
        self._set_pinned(0.0)
        self.result.events = events
        if self.check:
            self._final_checks()
        return self.result

    def _sample(self, _: Any) -> None:
        self.result.timeline.append((round(self.now, 6), round(self.pinned, 6)))
        self._at(self.now + self.sc.workload.sample_every, self._sample, None)

    # -- workload and router --------------------------------------------------------------------

    def _rate(self, t: float) -> float:
        wl = self.sc.workload
        for start, length, rate in wl.bursts:
            if start <= t < start + length:
                return rate
        return wl.rate

    def _arrival(self, _: Any) -> None:
        wl = self.sc.workload
        if self.next_req < self.sc.max_requests:
            rng = self.rng
            prompt = rng.randint(*wl.prompt_tokens)
            req = _Req(
                self.next_req, self.now, prompt, rng.randint(*wl.output_tokens),
                max(1, -(-prompt // wl.block_tokens)), rng.random() < wl.push_fraction,
            )
            self.next_req += 1
            self.result.requests += 1
            self._route(req)
            self._at(self.now + rng.expovariate(self._rate(self.now)), self._arrival, None)

    def _route(self, req: _Req) -> None:
        ps = [e for e in self.p.values() if not self.router_down[e.name]]
        ds = [e for e in self.d.values() if not self.router_down[e.name]]
        if not ps or not ds:
            self._at(self.now + self.sc.workload.client_retry, self._retry, req)
            return
        p = min(ps, key=lambda e: (len(e.queue) + (e.current is not None), e.name))
        d = min(ds, key=lambda e: (len(e.reqs) / e.slots, e.name))
        req.attempt += 1
        req.key = f"r{req.id}.{req.attempt}"
        req.p, req.d = p, d
        self._at(self.now + self.sc.workload.router_delay, self._p_enqueue, (p, p.gen, req))

    def _retry(self, req: _Req) -> None:
        self._route(_respawn(req))

    def _recompute(self, req: _Req) -> None:
        self.result.recomputed += 1
        self._route(_respawn(req))

    # -- faults ---------------------------------------------------------------------------------

    def _fault(self, f: Any) -> None:
        if self._tracing:
            self._trace(f.engine, f.kind.value, f"duration={f.duration} peer={f.peer}")
        if f.kind is FaultKind.CRASH:
            eng = self.engines[f.engine]
            if not eng.alive:
                return
            if isinstance(eng, _PEngine):
                self._crash_p(eng)
            else:
                assert isinstance(eng, _DEngine)
                self._crash_d(eng)
            self._at(self.now + self.sc.workload.router_detect, self._router_mark, (eng.name, True))
            self._at(self.now + f.duration, self._restart, eng)
        elif f.kind is FaultKind.PARTITION:
            pair = (f.engine, f.peer) if f.engine < f.peer else (f.peer, f.engine)
            self.partitions[pair] = self.partitions.get(pair, 0) + 1
            self._at(self.now + f.duration, self._heal, pair)
        else:
            eng = self.engines[f.engine]
            if isinstance(eng, _DEngine) and eng.alive:
                until = self.now + f.duration
                if f.kind is FaultKind.EDGE_STALL:
                    until = self._edge(eng, f.duration)
                    eng.flush = True
                if eng.stepping:
                    # The forward pass in progress is the one that stalls.
                    if until > eng.step_end:
                        eng.step_end = until
                        self._at(until, self._d_step_done, (eng, eng.gen, until))
                else:
                    eng.stall_until = max(eng.stall_until, until)
                    self._poke(eng, self.now)

    def _edge(self, de: _DEngine, u: float) -> float:
        """An adversarial stall: end the forward pass right at a lease's edge, so the next
        access starts where validity, expiry and the access's end meet (where a wrong drift or
        extension bound shows). ``u >= 0``: ``u * duration / 50`` before a waiting request's
        accessor validity end; ``u < 0``: ``|u| * duration / 200`` after its pinner's expiry
        (the adversary sees both sides' state). The earliest such edge the forward pass in
        progress can still reach is chosen."""
        if not de.accessors:
            return self.now
        earliest = de.step_end if de.stepping else self.now
        d = self.cfg.kv_lease_duration
        best = _INF
        for req in de.waiting:
            edge = _INF
            if u >= 0:
                v = de.accessors[0].valid_until(req.key)
                if v is not None:
                    edge = de.clock.real(v) - u * d / 50.0
            elif req.lease is not None and req.p is not None and req.p.pinners:
                info = req.p.pinners[0].info(req.lease.lease_id)
                if info is not None and req.p.incarnation == req.lease.incarnation:
                    edge = req.p.clock.real(info.expiry) - u * d / 200.0
            if earliest <= edge < best:
                best = edge
        if best == _INF:
            return self.now + abs(u) * self.cfg.lease_extension
        return best

    def _heal(self, pair: tuple[str, str]) -> None:
        if self._tracing:
            self._trace(pair[0], "heal", pair[1])
        self.partitions[pair] -= 1
        if not self.partitions[pair]:
            del self.partitions[pair]

    def _cut(self, a: str, b: str) -> bool:
        if not self.partitions:
            return False
        return ((a, b) if a < b else (b, a)) in self.partitions

    def _router_mark(self, arg: tuple[str, bool]) -> None:
        name, down = arg
        if down == (not self.engines[name].alive):
            self.router_down[name] = down

    def _restart(self, eng: _Engine) -> None:
        if self._tracing:
            self._trace(eng.name, "restart", "")
        eng.alive = True
        eng.gen += 1
        eng.inbox.clear()
        eng.checked.clear()
        eng.stepping = False
        eng.wake_at = _INF
        if isinstance(eng, _PEngine):
            self._start_pinner(eng)
        else:
            assert isinstance(eng, _DEngine)
            self._start_accessor(eng)
        self._at(self.now + self.sc.workload.router_detect / 4, self._router_mark, (eng.name, False))

    def _start_pinner(self, pe: _PEngine) -> None:
        pe.incarnation = self.rng.getrandbits(64)
        timeout = self.policy.fixed_timeout
        if timeout is not None:
            pe.fixed = [_FixedPinner(timeout) for _ in range(pe.tp)]
            pe.pinners = []
        else:
            pe.pinners = [self.pinner_factory(self.cfg, pe.name, pe.incarnation, r, pe.tp) for r in range(pe.tp)]
            pe.fixed = []
            for r, pinner in enumerate(pe.pinners):
                self._register(pinner, {
                    "role": "pinner", "engine_id": pe.name, "incarnation": pe.incarnation, "rank": r,
                    "ranks": pe.tp, "generation": pe.gen,
                })

    def _start_accessor(self, de: _DEngine) -> None:
        de.accessors = []
        if self.policy is Policy.KVLEASE:
            # Sessions differ per engine incarnation (generation) and rank, deterministically (no
            # draw from the simulation's random streams).
            session = (de.gen << 20) + 1
            de.accessors = [self.accessor_factory(self.cfg, de.name, r, de.tp, session + r) for r in range(de.tp)]
            for r, acc in enumerate(de.accessors):
                spec = {
                    "role": "accessor", "engine_id": de.name, "rank": r, "ranks": de.tp, "generation": de.gen,
                    "session": session + r,
                }
                self._register(acc, spec)
        de.replies = []
        de.reqs = {}
        de.waiting = []
        de.running = {}
        de.finishing = []
        de.transfers = []
        de.stall_until = 0.0
        de.hb_due = _INF
        de.sent_seq = {}
        de.cut_seq = {}

    def _crash_p(self, pe: _PEngine) -> None:
        pe.alive = False
        pe.gen += 1
        pe.inbox.clear()
        pe.checked.clear()
        retry = self.sc.workload.client_retry
        lost = list(pe.queue) + ([pe.current] if pe.current else [])
        pe.queue.clear()
        pe.current = None
        for req in lost:
            self._at(self.now + retry, self._retry, req)
        # Process exit releases every pinned block; not a protocol free.
        for lease in list(pe.live.values()):
            for r in range(pe.tp):
                if r not in lease.freed:
                    self._memory_released(lease, r, "crash")
        pe.live.clear()

    def _crash_d(self, de: _DEngine) -> None:
        de.alive = False
        de.gen += 1
        de.inbox.clear()
        de.checked.clear()
        retry = self.sc.workload.client_retry
        for req in list(de.reqs.values()):
            lease = req.lease
            if lease is not None and lease.unfreed:
                self._mark_dead(lease, crash=True)
            req.failed = True
            self._at(self.now + retry, self._retry, req)
        de.reqs = {}
        de.accessors = []
        de.waiting = []
        de.running = {}
        de.finishing = []
        de.transfers = []

    def _mark_dead(self, lease: _Lease, *, crash: bool = False) -> None:
        if crash and lease.unfreed and lease.d_crash == _INF:
            lease.d_crash = self.now  # reclaim latency is measured from here
        if lease.dead_since == _INF and lease.unfreed:
            lease.dead_since = self.now
            self._set_pinned(0.0, lease.blocks * lease.unfreed)
        lease.req = None

    # -- network ----------------------------------------------------------------------------------

    def _send(self, src: _Engine, dst_name: str, rank: int | None, data: bytes, heartbeat: bool) -> None:
        dst = self.engines.get(dst_name)
        res = self.result
        if dst is None:
            return
        n = len(data)
        ranks = range(dst.tp) if rank is None else (rank,)
        net = self.sc.network
        rng = self.net_rng
        partitions = self.partitions
        src_name = src.name
        cut = bool(partitions) and (
            ((src_name, dst_name) if src_name < dst_name else (dst_name, src_name)) in partitions
        )
        loss, dup, jitter, base = net.loss, net.dup, net.jitter, net.base_delay
        now = self.now
        heap, seqs, deliver = self._heap, self._seqs, self._deliver
        # The random draws, and their order, are exactly those of one draw sequence per rank:
        # loss, then duplication, then one delay per copy.
        for r in ranks:
            res.messages += 1
            res.protocol_bytes += n
            if heartbeat:
                res.heartbeat_bytes += n
            if cut or (loss and rng.random() < loss):
                res.dropped += 1
                continue
            copies = 2 if dup and rng.random() < dup else 1
            for _ in range(copies):
                # `rng.expovariate(1.0 / jitter)`, inlined (same formula, same draw).
                delay = base + (min(-_log(1.0 - rng.random()) / (1.0 / jitter), net.cap) if jitter > 0 else 0.0)
                _heappush(heap, (now + delay, next(seqs), deliver, (dst, dst.gen, r, data, src_name)))

    def _deliver(self, arg: tuple[_Engine, int, int, bytes, str]) -> None:
        dst, gen, rank, data, src = arg
        if not dst.alive or dst.gen != gen or (self.partitions and self._cut(src, dst.name)):
            self.result.dropped += 1
            return
        dst.inbox.append((rank, data))
        self._poke(dst, self.now)

    # -- API-level adversity: the network side -----------------------------------------------------

    def _count(self, what: str) -> None:
        api = self.result.api
        api[what] = api.get(what, 0) + 1

    def _api_mark(self, d_name: str, p_name: str) -> None:
        self.api_marks.append((self.now, d_name, p_name))

    def _send_checked(self, src: _Engine, dst: _Engine, rank: int, data: bytes, why: str, heartbeat: bool) -> None:
        """`_send` of one frame to `rank` of `dst` that must confer nothing there (`why`)."""
        res = self.result
        net = self.sc.network
        rng = self.api_rngs["misroute"]  # only misroutes deliver checked frames
        res.messages += 1
        res.protocol_bytes += len(data)
        if heartbeat:
            res.heartbeat_bytes += len(data)
        if self._cut(src.name, dst.name) or (net.loss and rng.random() < net.loss):
            res.dropped += 1
            return
        delay = net.base_delay + (min(rng.expovariate(1.0 / net.jitter), net.cap) if net.jitter > 0 else 0.0)
        self._at(self.now + delay, self._deliver_checked, (dst, dst.gen, rank, data, src.name, why))

    def _deliver_checked(self, arg: tuple[_Engine, int, int, bytes, str, str]) -> None:
        dst, gen, rank, data, src, why = arg
        if not dst.alive or dst.gen != gen or self._cut(src, dst.name):
            self.result.dropped += 1
            return
        dst.checked.append((rank, data, why))
        self._poke(dst, self.now)

    def _api_send(self, de: _DEngine, rank: int, out: Send, msg: Message, hb: bool) -> bool:
        """Adversity on a decode engine's message to a pinner: hold it until the pinner's
        expiry of a lease it names, or deliver it to a sibling pinner rank. True if handled."""
        pe = self.p.get(out.engine_id)
        if pe is None or out.rank is None:
            return False
        if (
            self._at_expiry and isinstance(msg, Heartbeat | AccessDone)
            and self.api_rngs["at_expiry"].random() < self._at_expiry and self._hold_to_expiry(de, pe, out.rank, msg)
        ):
            return True
        rng = self.api_rngs["misroute"]
        if self._misroute and pe.tp > 1 and rng.random() < self._misroute:
            q = out.rank
            targets = tp_layout(pe.tp, de.tp, rank).targets
            others = [x for x in range(pe.tp) if x not in targets]
            self._api_mark(de.name, pe.name)
            if self._tracing:
                self._trace(f"{de.name}.{rank}", "misroute", f"to {pe.name}.{q}: {msg!r}")
            if others:
                to = rng.choice(others)
                self._count("misrouted-to-pinner")
                why = f"{type(msg).__name__} of {de.name}.{rank} for rank {q} misrouted to rank {to}"
                self._send_checked(de, pe, to, encode(msg), why, hb)
            else:
                # Every sibling is one this accessor rank addresses too: a delivery there is
                # as good as addressed (and the addressed rank loses it).
                self._count("misrouted-within-layout")
                self._send(de, pe.name, rng.choice([x for x in range(pe.tp) if x != q]), encode(msg), hb)
            return True
        return False

    def _hold_to_expiry(self, de: _DEngine, pe: _PEngine, prank: int, msg: Heartbeat | AccessDone) -> bool:
        """Hold `msg` and have pinner rank `prank` handle it exactly at the expiry (its clock)
        of a lease it names. False if there is no such future expiry."""
        if not pe.alive or not pe.pinners or prank >= len(pe.pinners) or msg.incarnation != pe.incarnation:
            return False
        ids = msg.lease_ids if isinstance(msg, Heartbeat) else (msg.lease_id,)
        if not ids:
            return False
        lid = ids[self.api_rngs["at_expiry"].randrange(len(ids))]
        info = pe.pinners[prank].info(lid)
        if info is None:
            return False
        e = float(info.expiry)
        clock = pe.clock
        tr = clock.real(e)
        if tr <= self.now + self.sc.network.base_delay:
            return False
        while clock.epoch + clock.rate * tr > e:  # the real instant whose reading is at most e
            tr = math.nextafter(tr, -_INF)
        self._api_mark(de.name, pe.name)
        self._count("held-to-expiry")
        if self._tracing:
            self._trace(f"{de.name}", "hold", f"to {pe.name}.{prank} until lease {lid} expiry {e!r}: {msg!r}")
        self._at(tr, self._p_exact, (pe, pe.gen, prank, encode(msg), e, de.name))
        return True

    def _p_exact(self, arg: tuple[_PEngine, int, int, bytes, float, str]) -> None:
        pe, gen, prank, data, e, src = arg
        if not pe.alive or pe.gen != gen or not pe.pinners or self._cut(src, pe.name):
            self.result.dropped += 1
            return
        clock = pe.clock
        now = clock.local(self.now)
        if now < e:
            now = LocalTime(e)  # exactly at the expiry
        clock.floor = now
        msg = decode(data)
        if isinstance(msg, Heartbeat) and self.check:
            # A held heartbeat is one the network delivered late: for the reclaim bound it was
            # sent no earlier than one network delay before it arrived.
            for lid in msg.lease_ids:
                lease = self.leases.get((pe.name, msg.incarnation, lid))
                if lease is not None and lease.last_hb < self.now - self.sc.network.max_delay:
                    lease.last_hb = self.now - self.sc.network.max_delay
        self._p_receive(pe, now, prank, data)
        self._poke(pe, self.now)

    def _poke(self, eng: _Engine, t: float) -> None:
        """Wake an idle engine at `t` (a stepping engine looks at its inbox at the boundary)."""
        if eng.stepping or t >= eng.wake_at:
            return
        eng.wake_at = t
        _heappush(self._wakes, (t, next(self._seqs), self._wake, (eng, eng.gen, t)))

    def _wake(self, arg: tuple[_Engine, int, float]) -> None:
        eng, gen, t = arg
        if gen != eng.gen or not eng.alive or eng.stepping or t != eng.wake_at:
            return
        eng.wake_at = _INF
        if isinstance(eng, _PEngine):
            self._p_boundary(eng)
        else:
            assert isinstance(eng, _DEngine)
            self._d_boundary(eng, stepped=False)

    # The forward-pass end of each kind of engine is its own event handler: it is the commonest
    # event, and this saves a type dispatch on each.

    def _p_step_done(self, arg: tuple[_PEngine, int, float]) -> None:
        eng, gen, end = arg
        if gen != eng.gen or not eng.alive or end != eng.step_end:
            return  # the engine died, or a stall made this forward pass longer
        eng.stepping = False
        req = eng.current
        eng.current = None
        if req is not None:
            self._prefilled(eng, req)
        self._p_boundary(eng)

    def _d_step_done(self, arg: tuple[_DEngine, int, float]) -> None:
        eng, gen, end = arg
        if gen != eng.gen or not eng.alive or end != eng.step_end:
            return  # the engine died, or a stall made this forward pass longer
        eng.stepping = False
        self._d_boundary(eng, stepped=True)

    def _start_step(self, eng: _PEngine, duration: float) -> None:
        eng.stepping = True
        eng.wake_at = _INF
        end = eng.step_end = self.now + duration
        _heappush(self._heap, (end, next(self._seqs), self._p_step_done, (eng, eng.gen, end)))

    # -- prefill engine (pinner side) ---------------------------------------------------------------

    def _p_enqueue(self, arg: tuple[_PEngine, int, _Req]) -> None:
        pe, gen, req = arg
        if not pe.alive or pe.gen != gen:
            self._at(self.now + self.sc.workload.client_retry, self._retry, req)
            return
        pe.queue.append(req)
        self._poke(pe, self.now)

    def _p_boundary(self, pe: _PEngine) -> None:
        clock = pe.clock
        # `_Clock.local` inlined (this runs once per forward pass); LocalTime is a NewType,
        # the same float either way.
        now: LocalTime = clock.epoch + clock.rate * self.now  # type: ignore[assignment]
        if now < clock.floor:
            now = LocalTime(clock.floor)
        if pe.inbox:
            inbox = pe.inbox
            pe.inbox = []
            for rank, data in inbox:
                self._p_receive(pe, now, rank, data)
        if pe.checked:
            checked = pe.checked
            pe.checked = []
            for rank, data, why in checked:
                self._p_receive(pe, now, rank, data, why)
        pinners = pe.pinners
        if pinners:
            recorded = self.recorded
            for r, pinner in enumerate(pinners):
                if recorded is not None:
                    self._rec(pinner, now, "handle_timeout")
                outs = pinner.handle_timeout(now)
                if outs:
                    for out in outs:
                        self._p_output(pe, r, out)
        else:
            for r, fixed in enumerate(pe.fixed):
                for free in fixed.handle_timeout(now):
                    self._p_output(pe, r, free)
        if pe.queue:
            req = pe.queue.popleft()
            pe.current = req
            wl = self.sc.workload
            self._start_step(pe, wl.prefill_base + wl.prefill_per_token * req.prompt)
            return
        nd = _INF
        for pinner in pinners:
            d = pinner.next_deadline()
            if d is not None and d < nd:
                nd = d
        for fixed in pe.fixed:
            fd = fixed.next_deadline()
            if fd is not None and fd < nd:
                nd = fd
        if nd < _INF:
            self._poke(pe, max(self.now, pe.clock.real(nd)))

    def _p_receive(self, pe: _PEngine, now: LocalTime, rank: int, data: bytes, why: str = "") -> None:
        """Hand one frame to pinner rank `rank`. `why`: it was misdelivered there (API
        adversity), so the pinner must refuse it."""
        if self._native and pe.pinners:
            try:
                msg = decode(data)
            except DecodeError as exc:
                self._violate("codec", f"{pe.name} could not decode: {exc}")
                return
            if self._tracing:
                self._trace(f"{pe.name}.{rank}", "recv", repr(msg) if not why else f"{why}: {msg!r}")
            pinner = pe.pinners[rank]
            if self.recorded is not None:
                self._rec(pinner, now, "receive", {"hex": data.hex()})
            watch = self._overdue(pinner, now, msg) if self.check else None
            outs = pinner.receive(now, msg)
            if watch:
                self._check_overdue(pe, rank, pinner, now, msg, watch, outs)
            if why and self.check:
                acted = [out for out in outs if not isinstance(out, Rejected)]
                if acted:
                    self._violate(
                        "misdelivery-refused", f"{pe.name}.{rank} acted on a {why}: {acted!r}",
                        self._msg_lease(pe.name, msg),
                    )
            for out in outs:
                self._p_output(pe, rank, out)
            return
        try:
            note = decode_vllm(data)
        except DecodeError as exc:
            self._violate("codec", f"{pe.name} could not decode a vLLM notification: {exc}")
            return
        if isinstance(note, VllmHeartbeat):
            if pe.pinners:
                pe.pinners[rank].receive_vllm_heartbeat(now, note.request_ids)
        elif isinstance(note, VllmAccessDone):
            if pe.pinners:
                for out in pe.pinners[rank].receive_vllm_done(now, note.request_id, note.count):
                    self._p_output(pe, rank, out)
            else:
                free = pe.fixed[rank].done(now, note.request_id, note.count)
                if free is not None:
                    self._p_output(pe, rank, free)

    def _msg_lease(self, p_name: str, msg: Message) -> _Lease | None:
        """The simulator's lease a message names (its first id), for a violation report."""
        inc = getattr(msg, "incarnation", None)
        if isinstance(msg, Heartbeat | Release):
            lid = msg.lease_ids[0] if msg.lease_ids else None
        elif isinstance(msg, AccessDone | AccessDoneAck):
            lid = msg.lease_id
        else:
            lid = None
        if inc is None or lid is None:
            return None
        return self.leases.get((p_name, inc, lid))

    @staticmethod
    def _overdue(pinner: Pinner, now: LocalTime, msg: Message) -> list[tuple[int, LeaseInfo]] | None:
        """The leases `msg` names that are live at the pinner but expired (expiry <= now)."""
        nd = pinner.next_deadline()
        if nd is None or nd > now:
            return None  # no lease is overdue: the common case
        if isinstance(msg, Heartbeat | Release):
            ids: tuple[int, ...] = msg.lease_ids
        elif isinstance(msg, AccessDone):
            ids = (msg.lease_id,)
        else:
            return None
        if msg.incarnation != pinner.incarnation:
            return None
        watch = []
        for lid in ids:
            info = pinner.info(lid)
            if info is not None and info.expiry <= now:
                watch.append((lid, info))
        return watch or None

    def _check_overdue(
        self, pe: _PEngine, rank: int, pinner: Pinner, now: LocalTime, msg: Message,
        watch: list[tuple[int, LeaseInfo]], outs: Sequence[object],
    ) -> None:
        """A lease is expired at pinner time now >= expiry even before handle_timeout frees it:
        no message may renew it, count an access-done or a release for it, or free it."""
        for lid, before in watch:
            after = pinner.info(lid)
            freed = any(isinstance(out, Free) and out.lease_id == lid for out in outs)
            if freed or (after is not None and (
                after.expiry != before.expiry or after.accesses_done != before.accesses_done
                or after.state is not before.state
            )):
                self._violate(
                    "overdue-lease-not-renewed",
                    f"{pe.name}.{rank} at {float(now)!r} acted on lease {lid} (expiry {float(before.expiry)!r}) "
                    f"for a {type(msg).__name__}: {before} -> {after}{' and freed it' if freed else ''}",
                    self.leases.get((pe.name, pinner.incarnation, lid)),
                )

    def _prefilled(self, pe: _PEngine, req: _Req) -> None:
        """Prefill finished: pin the blocks under a lease on every rank, send the ticket."""
        now = pe.clock.local(self.now)
        self.result.prefills += 1
        if pe.pinners:
            if self.recorded is not None:
                self._rec(pe.pinners[0], now, "grant", {"key": req.key, "push": req.push})
            ticket = pe.pinners[0].grant(now, req.key, push=req.push)
            for pinner in pe.pinners[1:]:
                if self.recorded is not None:
                    self._rec(pinner, now, "grant", {"key": req.key, "push": req.push, "lease_id": ticket.lease_id})
                pinner.grant(now, req.key, push=req.push, lease_id=ticket.lease_id)
            lid = ticket.lease_id
            # The ticket travels as JSON-ish transfer params, as vLLM's kv_transfer_params do.
            req.ticket = LeaseTicket.from_dict(ticket.to_dict())
        else:
            lid = pe.fixed[0].grant(now, req.key)
            for fixed in pe.fixed[1:]:
                fixed.grant(now, req.key)
        lease = _Lease(pe, pe.incarnation, lid, req, self.now)
        req.lease = lease
        pe.live[lid] = lease
        self.leases[(pe.name, pe.incarnation, lid)] = lease
        if self.check:
            self.all_leases.append(lease)
        self._set_pinned(req.blocks)
        if self._tracing:
            self._trace(pe.name, "grant", f"{lease.name} key={req.key} blocks={req.blocks} push={req.push}")
        d = req.d
        assert d is not None
        self._at(self.now + self.sc.workload.router_delay, self._d_arrive, (d, d.gen, req))

    def _p_output(self, pe: _PEngine, rank: int, out: Any) -> None:
        if isinstance(out, Send):
            heartbeat = isinstance(out.message, HeartbeatAck)
            if self._tracing:
                self._trace(f"{pe.name}.{rank}", "send", f"to {out.engine_id}.{out.rank}: {out.message!r}")
            if self._misroute:
                de = self.d.get(out.engine_id)
                rng = self.api_rngs["misroute"]
                if de is not None and de.tp > 1 and out.rank is not None and rng.random() < self._misroute:
                    # Delivered to a sibling accessor rank (whose clock reads the same).
                    to = rng.choice([r for r in range(de.tp) if r != out.rank])
                    self._api_mark(de.name, pe.name)
                    self._count("misrouted-to-accessor")
                    why = f"{type(out.message).__name__} of {pe.name}.{rank} for rank {out.rank} misrouted to rank {to}"
                    if self._tracing:
                        self._trace(f"{pe.name}.{rank}", "misroute", why)
                    self._send_checked(pe, de, to, encode(out.message), why, heartbeat)
                    return
            self._send(pe, out.engine_id, out.rank, encode(out.message), heartbeat)
        elif isinstance(out, Free):
            lease = pe.live.get(out.lease_id)
            if self._tracing:
                self._trace(
                    f"{pe.name}.{rank}", "free", f"{pe.name}/{pe.incarnation}/{out.lease_id} {out.reason.value}"
                )
            if lease is None or rank in lease.freed:
                if self.check:
                    self._violate("one-free", f"{pe.name}.{rank} freed lease {out.lease_id} again ({out.reason.value})")
                return
            if out.reason is EndReason.EXPIRED:
                self._on_expired(pe, rank, lease)
            self._memory_released(lease, rank, out.reason.value)
            if not lease.unfreed:
                del pe.live[out.lease_id]
        elif isinstance(out, Rejected):
            self.result.rejected += 1
            if self._tracing:
                self._trace(f"{pe.name}.{rank}", "rejected", out.reason)

    def _on_expired(self, pe: _PEngine, rank: int, lease: _Lease) -> None:
        req = lease.req
        pending = req is not None and not req.failed and req.lease is lease
        if rank == 0 and pending and req is not None and req.d is not None and req.d.alive:
            self.result.false_frees += 1
            if self.check and not lease.troubled:
                lease.troubled = "expired while its accessor still needed it"
        if self.check:
            self._check_reclaim_bound(pe, lease)

    def _memory_released(self, lease: _Lease, rank: int, why: str) -> None:
        lease.freed[rank] = (self.now, why)
        lease.unfreed -= 1
        dead = lease.blocks if lease.dead_since != _INF else 0.0
        self._set_pinned(-lease.blocks, -dead)
        if not lease.unfreed and lease.d_crash != _INF:
            self.result.reclaim_latencies.append(self.now - lease.d_crash)

    # -- decode engine (accessor side) -------------------------------------------------------------------

    def _d_arrive(self, arg: tuple[_DEngine, int, _Req]) -> None:
        de, gen, req = arg
        lease = req.lease
        assert lease is not None
        if not de.alive or de.gen != gen:
            self._mark_dead(lease, crash=True)
            self._at(self.now + self.sc.workload.client_retry, self._retry, req)
            return
        de.reqs[req.key] = req
        de.waiting.append(req)
        if de.accessors:
            now = de.clock.local(self.now)
            assert req.ticket is not None
            for r, acc in enumerate(de.accessors):
                if self.recorded is not None:
                    self._rec(acc, now, "track", {"key": req.key, "ticket": req.ticket.to_dict(), "push": req.push})
                for out in acc.track(now, req.key, req.ticket, push=req.push):
                    self._d_output(de, r, out)
        elif self.policy is Policy.VLLM_HB and de.hb_due == _INF:
            de.hb_due = self.now
        if self._tracing:
            self._trace(de.name, "track", req.key)
        api = self.api
        if api is not None and not req.copy:
            d = self.cfg.kv_lease_duration
            rng = self.api_rngs["abort"]
            if api.abort and rng.random() < api.abort:
                self._at(self.now + rng.uniform(0.0, d), self._abort, (de, de.gen, req))
            rng = self.api_rngs["redispatch"]
            if api.redispatch and rng.random() < api.redispatch:
                self._at(self.now + rng.uniform(0.0, d / 4), self._redispatch, req)
        self._poke(de, self.now)

    def _d_boundary(self, de: _DEngine, *, stepped: bool) -> None:
        t = self.now
        clock = de.clock
        now: LocalTime = clock.epoch + clock.rate * t  # type: ignore[assignment]  # _Clock.local
        if now < clock.floor:
            now = LocalTime(clock.floor)
        accessors = de.accessors
        recorded = self.recorded
        if de.replies:
            replies = de.replies
            de.replies = []
            api = self.api
            for rank, data in replies:
                msg = decode(data)
                assert isinstance(msg, HandshakeReply)
                if de.cut_seq and self._stale_answer(de, rank, msg):
                    self._d_checked(de, now, rank, data, "handshake reply from before a disconnect")
                    continue
                if self.recorded is not None:
                    self._rec(accessors[rank], now, "handshake_reply", {"hex": data.hex()})
                for out in accessors[rank].handshake_reply(now, msg):
                    self._d_output(de, rank, out)
                if api is not None and api.dup_reply and self.api_rngs["dup_reply"].random() < api.dup_reply:
                    self._dup_reply(de, rank, data, msg.engine_id)
        if de.inbox:
            inbox = de.inbox
            de.inbox = []
            for rank, data in inbox:
                try:
                    msg = decode(data)
                except DecodeError as exc:
                    self._violate("codec", f"{de.name} could not decode: {exc}")
                    continue
                if de.cut_seq and self._stale_answer(de, rank, msg):
                    self._d_checked(de, now, rank, data, f"{type(msg).__name__} from before a disconnect")
                    continue
                if self._tracing:
                    self._trace(f"{de.name}.{rank}", "recv", repr(msg))
                if recorded is not None:
                    self._rec(accessors[rank], now, "receive", {"hex": data.hex()})
                outs = accessors[rank].receive(now, msg)
                if outs:
                    for out in outs:
                        self._d_output(de, rank, out)
        if de.checked:
            checked = de.checked
            de.checked = []
            for rank, data, why in checked:
                self._d_checked(de, now, rank, data, why)
        for req in de.transfers:
            if req.due <= t:  # some transfer ended
                done = [req for req in de.transfers if req.due <= t]
                de.transfers = [req for req in de.transfers if req.due > t]
                for ended in done:
                    self._transfer_done(de, now, ended)
                break
        for r, acc in enumerate(accessors):
            if recorded is not None:
                self._rec(acc, now, "handle_timeout")
            outs = acc.handle_timeout(now)
            if outs:
                for out in outs:
                    self._d_output(de, r, out)
        if self._vllm_hb and de.hb_due <= t:
            self._vllm_heartbeat(de)
        if stepped:
            de.steps += 1
            finishing = de.finishing
            if de.flush:  # this forward pass finished the whole batch
                de.flush = False
                for req in list(de.running.values()):
                    self._finish(de, req)
                finishing.clear()
            while finishing and finishing[0][0] <= de.steps:
                _, _, key = _heappop(finishing)
                req_done = de.running.get(key)
                if req_done is not None:
                    self._finish(de, req_done)
        if de.waiting and de.slots > len(de.running) + len(de.transfers):  # a slot is free
            self._schedule(de, now)
        if de.running or de.stall_until > t:
            duration = self._step_base + self._step_per_seq * len(de.running)
            if de.stall_until > t:
                duration = max(duration, de.stall_until - t)
                if self._tracing:
                    self._trace(de.name, "stall", f"until {de.stall_until:.9f}")
            de.stall_until = 0.0
            # `_start_step` inlined: a decode engine's forward pass is the commonest event.
            de.stepping = True
            de.wake_at = _INF
            end = de.step_end = t + duration
            _heappush(self._heap, (end, next(self._seqs), self._d_step_done, (de, de.gen, end)))
            return
        nd = _INF
        for req in de.transfers:
            nd = min(nd, req.due)
        if accessors:
            for acc in accessors:
                ad = acc.next_deadline()
                if ad is not None:
                    nd = min(nd, de.clock.real(ad))
        if de.waiting and any(req.push for req in de.waiting):
            nd = min(nd, t + self.sc.workload.step_base)  # poll: a push write waits for validity
        nd = min(nd, de.hb_due)
        if nd < _INF:
            self._poke(de, max(t, nd))

    def _vllm_heartbeat(self, de: _DEngine) -> None:
        by_p: dict[str, list[str]] = {}
        for req in de.reqs.values():
            if req.p is not None and req.lease is not None and not req.failed:
                by_p.setdefault(req.p.name, []).append(req.key)
        for p_name, keys in by_p.items():
            data = encode_vllm_heartbeat(keys)
            for _ in range(de.tp):  # every decode worker heartbeats every prefill worker
                self._send(de, p_name, None, data, True)
        de.hb_due = self.now + self.cfg.heartbeat_interval if de.reqs else _INF

    def _schedule(self, de: _DEngine, now: LocalTime) -> None:
        if not de.waiting:
            return
        free = de.slots - len(de.running) - len(de.transfers)
        if free <= 0:
            return
        keep = []
        waiting = de.waiting
        for i, req in enumerate(waiting):
            if free <= 0:
                # No slot left: the rest only drop their failed requests (one pass in C,
                # instead of a Python step per queued request on every boundary).
                keep.extend([r for r in waiting[i:] if not r.failed])
                break
            if req.failed:
                continue
            if self._begin(de, now, req):
                free -= 1
            elif not req.failed:
                keep.append(req)
        de.waiting = keep

    def _begin(self, de: _DEngine, now: LocalTime, req: _Req) -> bool:
        """Ask every rank's accessor; start the transfer only if all allow it."""
        started: list[int] = []
        decisions: list[AccessDecision] = []
        for r, acc in enumerate(de.accessors):
            if self.recorded is not None:
                self._rec(acc, now, "begin_access", {"key": req.key})
            dec = acc.begin_access(now, req.key)
            if not dec.allowed:
                for s in started:
                    if self.recorded is not None:
                        self._rec(de.accessors[s], now, "access_failed", {"key": req.key, "posted": False})
                    de.accessors[s].access_failed(now, req.key, posted=False)  # never posted: back to waiting
                return False
            started.append(r)
            decisions.append(dec)
        wl = self.sc.workload
        req.xfer_start = self.now
        req.xfer_end = req.due = self.now + wl.transfer_base + wl.transfer_per_block * req.blocks
        req.exact = None
        req.notes = None
        if self.api is not None and decisions and not self._api_begin(de, now, req, decisions):
            return False
        de.transfers.append(req)
        if self._tracing:
            self._trace(de.name, "begin_access", f"{req.key} until {req.xfer_end:.9f}")
        return True

    def _transfer_done(self, de: _DEngine, now: LocalTime, req: _Req) -> None:
        lease = req.lease
        assert lease is not None and req.p is not None
        pe = req.p
        end = req.xfer_end
        # The transport: a dead or restarted pinner engine, or a cut link, fails the transfer.
        ok = pe.alive and pe.incarnation == lease.incarnation and not self._cut(de.name, pe.name)
        ok = ok and not any(why == "crash" for _, why in lease.freed.values())
        if self.check and ok and req.push:
            for prank, (ft, why) in lease.freed.items():
                if ft <= end:
                    self._violate(
                        "no-access-overlaps-free",
                        f"push write {req.key} ran [{req.xfer_start:.9f}, {end:.9f}] but rank {prank} "
                        f"freed at {ft:.9f} ({why})",
                        lease,
                    )
        if self._tracing:
            self._trace(de.name, "transfer_done", f"{req.key} ok={ok} end={end:.9f}")
        if ok and req.notes is not None:
            # The transport delivers each rank's attached access-done after its data landed,
            # whatever the engine has decided about the request meanwhile.
            for r, note_ranks, note in req.notes:
                for q in note_ranks:
                    self._d_output(de, r, Send(pe.name, q, note))
        if req.failed:
            for r, acc in enumerate(de.accessors):
                if acc.state_of(req.key) is not None:
                    if self.recorded is not None:
                        self._rec(acc, now, "access_failed", {"key": req.key})
                    for out in acc.access_failed(now, req.key):
                        self._d_output(de, r, out)
                if self.recorded is not None:
                    self._rec(acc, now, "untrack", {"key": req.key})
                for out in acc.untrack(now, req.key):
                    self._d_output(de, r, out)
            return
        # Every rank's transfer ends here: tell each rank's accessor before acting on what any
        # of them says (one rank's loss must not untrack a sibling whose access is in flight).
        if not ok:
            failed = []
            for acc in de.accessors:
                if self.recorded is not None:
                    self._rec(acc, now, "access_failed", {"key": req.key})
                failed.append(acc.access_failed(now, req.key))
            for r, outs in enumerate(failed):
                for out in outs:
                    self._d_output(de, r, out)
            self._fail(de, req, "transfer failed")
            return
        if de.accessors:
            notified = False
            if req.notes is not None:
                api = self.api
                if api is not None and api.fail_posted and self.api_rngs["fail_posted"].random() < api.fail_posted:
                    self._failed_after_notify(de, now, req)
                    return
                notified = True
            finished = []
            for acc in de.accessors:
                if self.recorded is not None:
                    args: dict[str, Any] = {"key": req.key, "notified": True} if notified else {"key": req.key}
                    self._rec(acc, now, "access_finished", args)
                finished.append(acc.access_finished(now, req.key, notified=notified))
            for r, outs in enumerate(finished):
                for out in outs:
                    self._d_output(de, r, out)
            return
        # Baselines: tell the pinner ranks; the data is whatever the blocks hold now.
        expected, targets = _targets(pe.tp, de.tp)
        for r in range(de.tp):
            for pr in targets(r):
                self._send(de, pe.name, pr, encode_vllm_done(req.key, expected), False)
        req.done_ranks = de.tp
        self._accepted(de, req)

    def _accepted(self, de: _DEngine, req: _Req) -> None:
        """Every rank's access is reported valid: the engine will decode from these blocks."""
        lease = req.lease
        assert lease is not None
        stale = [(r, ft, why) for r, (ft, why) in lease.freed.items() if ft <= req.xfer_end]
        if stale:
            self.result.stale_used += 1
            if self.check or self.policy is Policy.KVLEASE:
                self._violate(
                    "no-stale-read-reported-done",
                    f"{req.key} read [{req.xfer_start:.9f}, {req.xfer_end:.9f}] reported valid; freed: {stale}",
                    lease,
                )
            if self.policy is not Policy.KVLEASE:
                # Optimistic for the baselines: assume the corruption is noticed and recomputed.
                self._fail(de, req, "stale data")
                return
        if self._tracing:
            self._trace(de.name, "accepted", req.key)
        de.running[req.key] = req
        heapq.heappush(de.finishing, (de.steps + req.out_tokens, req.id, req.key))
        api = self.api
        if api is not None and api.retrack and self.api_rngs["retrack"].random() < api.retrack:
            later = self.now + self.api_rngs["retrack"].uniform(0.0, self.cfg.kv_lease_duration / 2)
            self._at(later, self._retrack_later, (de, de.gen, req))

    def _finish(self, de: _DEngine, req: _Req) -> None:
        self.result.completed += 1
        de.running.pop(req.key, None)
        de.reqs.pop(req.key, None)
        if req.lease is not None:
            req.lease.req = None

    def _fail(self, de: _DEngine, req: _Req, why: str) -> None:
        if req.failed:
            return
        req.failed = True
        if self._tracing:
            self._trace(de.name, "fail", f"{req.key}: {why}")
        de.reqs.pop(req.key, None)
        de.running.pop(req.key, None)
        now = de.clock.local(self.now)
        for r, acc in enumerate(de.accessors):
            if acc.state_of(req.key) is not None and req not in de.transfers:
                if self.recorded is not None:
                    self._rec(acc, now, "untrack", {"key": req.key})
                for out in acc.untrack(now, req.key):
                    self._d_output(de, r, out)
        if req.lease is not None:
            self._mark_dead(req.lease)
        self._recompute(req)

    def _trouble(self, req: _Req, what: str) -> None:
        lease = req.lease
        if self.check and lease is not None and not lease.troubled:
            lease.troubled = what

    def _d_output(self, de: _DEngine, rank: int, out: Any) -> None:
        if isinstance(out, Send):
            msg = out.message
            hb = isinstance(msg, Heartbeat)
            if hb and self.check:
                assert isinstance(msg, Heartbeat)
                for lid in msg.lease_ids:
                    lease = self.leases.get((out.engine_id, msg.incarnation, lid))
                    if lease is not None:
                        lease.last_hb = self.now
            if self._tracing:
                self._trace(f"{de.name}.{rank}", "send", f"to {out.engine_id}.{out.rank}: {msg!r}")
            if self.api is not None:
                if self._track_seq and isinstance(msg, Heartbeat | AccessDone):
                    self._sent(de, rank, out.engine_id, msg.seq if isinstance(msg, Heartbeat) else msg.attempt)
                if self._api_send(de, rank, out, msg, hb):
                    return
            self._send(de, out.engine_id, out.rank, encode(msg), hb)
        elif isinstance(out, HandshakeNeeded):
            self._side_channel(de, rank, out.engine_id, out.message)
        elif isinstance(out, LeaseLost):
            req = de.reqs.get(out.key)
            self.result.leases_lost += 1
            if self._tracing:
                self._trace(f"{de.name}.{rank}", "lease_lost", f"{out.key} {out.reason.value}")
            if req is not None:
                if out.reason not in (LostReason.PINNER_RESTARTED, LostReason.UNREACHABLE, LostReason.ACCESS_FAILED):
                    self._trouble(req, f"lease lost ({out.reason.value})")
                if req not in de.transfers:
                    self._fail(de, req, f"lease lost: {out.reason.value}")
                else:
                    req.failed = True
                    self._fail_later(de, req)
        elif isinstance(out, AccessStale):
            self.result.stale_caught += 1
            req = de.reqs.get(out.key)
            if self._tracing:
                self._trace(f"{de.name}.{rank}", "access_stale", f"{out.key} {out.reason}")
            if req is not None:
                self._trouble(req, f"access stale ({out.reason})")
                self._fail(de, req, "stale access caught")
        elif isinstance(out, AccessCompleted):
            req = de.reqs.get(out.key)
            if req is not None and not req.failed:
                req.done_ranks += 1
                if req.done_ranks == de.tp:
                    self._accepted(de, req)
        elif isinstance(out, Rejected):
            self.result.rejected += 1
            if self._tracing:
                self._trace(f"{de.name}.{rank}", "rejected", out.reason)

    def _fail_later(self, de: _DEngine, req: _Req) -> None:
        """A rank lost the lease while the transfer is in flight: the transfer's end decides."""
        de.reqs.pop(req.key, None)
        if req.lease is not None:
            self._mark_dead(req.lease)
        self._recompute(req)

    def _side_channel(self, de: _DEngine, rank: int, p_name: str, msg: Handshake) -> None:
        if self._track_seq:
            self._sent(de, rank, p_name, msg.seq)
        delay = self.sc.network.side_channel_delay
        self._at(self.now + delay, self._handshake_at_p, (de, de.gen, rank, p_name, encode(msg)))

    def _handshake_at_p(self, arg: tuple[_DEngine, int, int, str, bytes]) -> None:
        de, gen, rank, p_name, data = arg
        pe = self.p.get(p_name)
        if pe is None or not pe.alive or not pe.pinners or self._cut(de.name, p_name):
            return  # the accessor asks again after an interval
        msg = decode(data)
        assert isinstance(msg, Handshake)
        p_now = pe.clock.local(self.now)
        if self.recorded is not None:
            self._rec(pe.pinners[0], p_now, "handshake", {"hex": data.hex()})
        reply = pe.pinners[0].handshake_reply(p_now, msg)
        if self._tracing:
            self._trace(p_name, "handshake", f"from {de.name}.{rank} inc={reply.incarnation}")
        back = (de, gen, rank, encode(reply), p_name)
        self._at(self.now + self.sc.network.side_channel_delay, self._handshake_back, back)

    def _handshake_back(self, arg: tuple[_DEngine, int, int, bytes, str]) -> None:
        de, gen, rank, data, p_name = arg
        if not de.alive or de.gen != gen or self._cut(de.name, p_name):
            return
        rng = self.api_rngs["misroute"] if self._misroute else None
        if rng is not None and de.tp > 1 and rng.random() < self._misroute:
            to = rng.choice([r for r in range(de.tp) if r != rank])
            self._api_mark(de.name, p_name)
            self._count("misrouted-reply")
            de.checked.append((to, data, f"handshake reply of {p_name} for rank {rank} misrouted to rank {to}"))
        else:
            de.replies.append((rank, data))
        self._poke(de, self.now)

    # -- API-level adversity: the engine side -------------------------------------------------------

    def _sent(self, de: _DEngine, rank: int, p_name: str, seq: int) -> None:
        key = (rank, p_name)
        if seq > de.sent_seq.get(key, 0):
            de.sent_seq[key] = seq

    @staticmethod
    def _stale_answer(de: _DEngine, rank: int, msg: Message) -> bool:
        """Whether `msg` answers something rank `rank` sent before its last disconnect."""
        if isinstance(msg, HeartbeatAck | HandshakeReply):
            seq = msg.seq
        elif isinstance(msg, AccessDoneAck):
            seq = msg.attempt
        else:
            return False
        cut = de.cut_seq.get((rank, msg.engine_id))
        return cut is not None and seq <= cut

    def _acc_view(self, de: _DEngine, acc: Accessor) -> tuple[Any, ...]:
        """What an accessor shows of itself: each request's state and validity, and which
        pinner engines it is connected to."""
        return (
            tuple((key, acc.state_of(key), acc.valid_until(key)) for key in de.reqs),
            tuple(acc.is_connected(name) for name in self.p),
        )

    def _d_checked(self, de: _DEngine, now: LocalTime, rank: int, data: bytes, why: str) -> None:
        """Hand accessor rank `rank` a frame that was misdelivered to it, or that answers
        something it sent before a disconnect, or a handshake reply delivered again: the
        accessor must refuse it or ignore it (Rejected or nothing, and no visible change)."""
        msg = decode(data)
        acc = de.accessors[rank]
        before = self._acc_view(de, acc) if self.check else None
        if self._tracing:
            self._trace(f"{de.name}.{rank}", "recv", f"{why}: {msg!r}")
        self._count("stale-or-misdelivered")
        if isinstance(msg, HandshakeReply):
            if self.recorded is not None:
                self._rec(acc, now, "handshake_reply", {"hex": data.hex()})
            outs = acc.handshake_reply(now, msg)
        else:
            if self.recorded is not None:
                self._rec(acc, now, "receive", {"hex": data.hex()})
            outs = acc.receive(now, msg)
        if self.check:
            acted = [out for out in outs if not isinstance(out, Rejected)]
            if acted or self._acc_view(de, acc) != before:
                self._violate(
                    "misdelivery-refused",
                    f"{de.name}.{rank} acted on a {why}: {msg!r} -> {acted!r}",
                    self._msg_lease(msg.engine_id, msg),
                )
        for out in outs:
            self._d_output(de, rank, out)

    def _dup_reply(self, de: _DEngine, rank: int, data: bytes, p_name: str) -> None:
        """Deliver a handshake reply again later (perhaps after the pinner restarted), to its
        rank or a sibling."""
        rng = self.api_rngs["dup_reply"]
        to = rank
        if de.tp > 1 and rng.random() < 0.3:
            to = rng.choice([r for r in range(de.tp) if r != rank])
        later = self.now + rng.uniform(0.0, 2.0 * self.cfg.kv_lease_duration)
        why = f"handshake reply of {p_name} for rank {rank}, delivered again" + (f" to rank {to}" if to != rank else "")
        self._at(later, self._reply_again, (de, de.gen, to, data, p_name, why))

    def _reply_again(self, arg: tuple[_DEngine, int, int, bytes, str, str]) -> None:
        de, gen, to, data, p_name, why = arg
        if not de.alive or de.gen != gen or self._cut(de.name, p_name):
            return
        self._count("reply-again")
        de.checked.append((to, data, why))
        self._poke(de, self.now)

    def _api_begin(self, de: _DEngine, now: LocalTime, req: _Req, decisions: list[AccessDecision]) -> bool:
        """Adversity as a transfer starts. False: the transport refused to post it (nothing was
        handed over: access_failed(posted=False)); the request waits and is tried again."""
        api = self.api
        assert api is not None
        rngs = self.api_rngs
        if self._track_seq:
            for r, dec in enumerate(decisions):
                if dec.notification is not None:
                    self._sent(de, r, dec.engine_id, dec.notification.attempt)
        if api.fail_unposted and rngs["fail_unposted"].random() < api.fail_unposted:
            self._count("failed-unposted")
            if self._tracing:
                self._trace(de.name, "post_failed", req.key)
            failed = []
            for acc in de.accessors:
                if self.recorded is not None:
                    self._rec(acc, now, "access_failed", {"key": req.key, "posted": False})
                failed.append(acc.access_failed(now, req.key, posted=False))
            for r, outs in enumerate(failed):
                for out in outs:
                    self._d_output(de, r, out)
            return False
        if api.notify and rngs["notify"].random() < api.notify:
            req.notes = [
                (r, dec.targets, dec.notification) for r, dec in enumerate(decisions) if dec.notification is not None
            ]
        if api.exact_end and not req.push and rngs["exact_end"].random() < api.exact_end:
            ends = [dec.valid_until for dec in decisions]
            if all(v is not None for v in ends):
                v = min(float(e) for e in ends if e is not None)
                clock = de.clock
                tr = clock.real(v)
                if req.xfer_start + self.sc.workload.transfer_base <= tr < _INF:
                    while clock.epoch + clock.rate * tr > v:  # the real instant whose reading is at most v
                        tr = math.nextafter(tr, -_INF)
                    req.xfer_end = tr
                    req.exact = v
                    req.due = _INF  # `_exact_done` finishes it, not the engine loop
                    self._count("exact-end")
                    self._at(tr, self._exact_done, (de, de.gen, req))
        return True

    def _exact_done(self, arg: tuple[_DEngine, int, _Req]) -> None:
        """The transport reports the transfer done exactly at the accessor's valid_until."""
        de, gen, req = arg
        if not de.alive or de.gen != gen or req not in de.transfers or req.exact is None:
            return
        de.transfers.remove(req)
        clock = de.clock
        now = clock.local(self.now)
        if now < req.exact:
            now = LocalTime(req.exact)
        clock.floor = now
        if self._tracing:
            self._trace(de.name, "exact_end", f"{req.key} at valid_until {req.exact!r} (reading {float(now)!r})")
        self._transfer_done(de, now, req)
        self._poke(de, self.now)

    def _failed_after_notify(self, de: _DEngine, now: LocalTime, req: _Req) -> None:
        """The transport reports the transfer failed after its attached notification landed:
        access_failed(posted=True). The engine retries only if the core keeps the lease."""
        self._count("failed-after-notify")
        if self._tracing:
            self._trace(de.name, "transfer_failed", f"{req.key} after its notification was delivered")
        failed = []
        for acc in de.accessors:
            if self.recorded is not None:
                self._rec(acc, now, "access_failed", {"key": req.key, "posted": True})
            failed.append(acc.access_failed(now, req.key, posted=True))
        for r, outs in enumerate(failed):
            for out in outs:
                self._d_output(de, r, out)
        api = self.api
        assert api is not None
        if not req.failed and all(acc.state_of(req.key) is TrackedState.WAITING for acc in de.accessors):
            self._count("retried-after-posted-failure")
            de.waiting.append(req)  # the core let it retry under the same lease
            return
        self._fail(de, req, "transfer failed after its notification landed")
        if api.retrack and self.api_rngs["retrack"].random() < api.retrack:
            why = "re-track after a posted transfer failed"
            self._track_copy(de, self._copy(req, de), "retrack-after-failed-transfer", why)

    def _copy(self, req: _Req, de: _DEngine) -> _Req:
        """Another request of decode engine `de` carrying `req`'s ticket (a fresh id: a key the
        engine never used)."""
        c = _Req(1_000_000 + next(self._copies), self.now, req.prompt, req.out_tokens, req.blocks, req.push)
        c.attempt = 1
        c.key = f"r{c.id}.1"
        c.p, c.d, c.lease, c.ticket = req.p, de, req.lease, req.ticket
        c.copy = True
        return c

    def _track_copy(self, de: _DEngine, c: _Req, kind: str, why: str) -> None:
        """Track `c` (a ticket tracked before) on every rank. Refused: the engine recomputes
        (a fresh lease). Accepted: it is served like any request, and the checks judge."""
        lease, ticket = c.lease, c.ticket
        if lease is None or ticket is None or not de.alive or not de.accessors:
            return
        lease.api = True
        now = de.clock.local(self.now)
        outs: list[tuple[Any, ...]] = []
        refused = ""
        for acc in de.accessors:
            if self.recorded is not None:
                self._rec(acc, now, "track", {"key": c.key, "ticket": ticket.to_dict(), "push": c.push})
            try:
                outs.append(acc.track(now, c.key, ticket, push=c.push))
            except LocalProtocolError as exc:
                refused = str(exc) or type(exc).__name__
                break
        if self._tracing:
            self._trace(de.name, "retrack", f"{why}: {lease.name} as {c.key}: " + (refused or "accepted"))
        if refused:
            self._count(f"{kind}-refused")
            for r in range(len(outs)):  # the ranks that did track it let it go again
                if self.recorded is not None:
                    self._rec(de.accessors[r], now, "untrack", {"key": c.key})
                for out in de.accessors[r].untrack(now, c.key):
                    self._d_output(de, r, out)
            self._recompute(c)  # a fresh lease: prefill again
            return
        self._count(f"{kind}-accepted")
        de.reqs[c.key] = c
        de.waiting.append(c)
        for r, rank_outs in enumerate(outs):
            for out in rank_outs:
                self._d_output(de, r, out)
        self._poke(de, self.now)

    def _retrack_later(self, arg: tuple[_DEngine, int, _Req]) -> None:
        de, gen, req = arg
        if de.alive and de.gen == gen:
            self._track_copy(de, self._copy(req, de), "retrack-after-completion", "re-track after the read completed")

    def _abort(self, arg: tuple[_DEngine, int, _Req]) -> None:
        """The engine aborts a waiting request (untrack: its Release goes out) and, while the
        Release is in flight, tracks the same ticket again under a new key."""
        de, gen, req = arg
        if (
            not de.alive or de.gen != gen or req.failed or de.reqs.get(req.key) is not req
            or req in de.transfers or req.key in de.running
            or not all(acc.state_of(req.key) is TrackedState.WAITING for acc in de.accessors)
        ):
            return
        now = de.clock.local(self.now)
        self._count("abort")
        if self._tracing:
            self._trace(de.name, "abort", req.key)
        released = []
        for acc in de.accessors:
            if self.recorded is not None:
                self._rec(acc, now, "untrack", {"key": req.key})
            released.append(acc.untrack(now, req.key))
        req.failed = True
        de.reqs.pop(req.key, None)
        for r, outs in enumerate(released):
            for out in outs:
                self._d_output(de, r, out)
        self._track_copy(de, self._copy(req, de), "retrack-after-untrack", "re-track after untrack")

    def _redispatch(self, req: _Req) -> None:
        """The router hands `req`'s ticket to a second request (a retry): on another decode
        engine mostly, else on the same one."""
        rng = self.api_rngs["redispatch"]
        others = sorted(name for name in self.d if req.d is None or name != req.d.name)
        de = self.d[rng.choice(others)] if others and rng.random() < 0.8 else req.d
        if de is None:
            return
        if req.ticket is not None and de.alive and de.accessors:
            self._track_copy(de, self._copy(req, de), "redispatch", "redispatch of a ticket still held")

    def _disconnect(self, de: _DEngine) -> None:
        """The engine gives up on one pinner engine (Accessor.disconnect on every rank); its
        later requests there reconnect. Answers to what it sent before must confer nothing."""
        api = self.api
        assert api is not None
        rng = self.api_rngs["disconnect"]
        self._at(self.now + rng.expovariate(api.disconnect), self._disconnect, de)
        p_name = rng.choice(sorted(self.p))
        if not de.alive or not de.accessors:
            return
        now = de.clock.local(self.now)
        self._count("disconnect")
        self._api_mark(de.name, p_name)  # its leases there are lost (or confirmations given up)
        if self._tracing:
            self._trace(de.name, "disconnect", p_name)
        outs = []
        for r, acc in enumerate(de.accessors):
            de.cut_seq[(r, p_name)] = de.sent_seq.get((r, p_name), 0)
            if self.recorded is not None:
                self._rec(acc, now, "disconnect", {"engine_id": p_name})
            outs.append(acc.disconnect(now, p_name))
        lost: dict[str, _Req] = {}
        for rank_outs in outs:
            for out in rank_outs:
                if isinstance(out, LeaseLost) and out.key in de.reqs:
                    lost[out.key] = de.reqs[out.key]
        for r, rank_outs in enumerate(outs):
            for out in rank_outs:
                self._d_output(de, r, out)
        if api.retrack:
            for req in lost.values():
                if self.api_rngs["retrack"].random() < api.retrack:
                    self._track_copy(de, self._copy(req, de), "retrack-after-disconnect", "re-track after disconnect")

    # -- checks -------------------------------------------------------------------------------------

    def _reclaim_bound(self, lease: _Lease) -> float:
        """The latest real time the protocol allows `lease` to stay pinned (liveness)."""
        cfg = self.cfg
        rho = self.sc.drift
        slow = 1.0 / (1.0 - rho)
        pstep = self.p_step_max
        net = self.sc.network
        guard = cfg.push_guard * slow if lease.push else 0.0
        initial = lease.granted + cfg.kv_lease_duration * slow
        renewed = lease.last_hb + net.max_delay + pstep + cfg.lease_extension * slow
        return max(initial, renewed) + pstep + guard + 1e-9

    def _check_reclaim_bound(self, pe: _PEngine, lease: _Lease) -> None:
        bound = self._reclaim_bound(lease)
        if self.now > bound:
            self._violate(
                "dead-accessor-freed-in-time",
                f"expired at {self.now:.9f}, bound {bound:.9f} (granted {lease.granted:.9f}, last heartbeat "
                f"{lease.last_hb:.9f})",
                lease,
            )

    def _clean(self, lease: _Lease, end: float) -> bool:
        """Did the lease live on a fault-free path (the liveness claim's premise)?"""
        sc = self.sc
        if sc.network.loss > 0 or lease.api:
            return False
        p, d = lease.p.name, lease.d_name
        lo = lease.granted - 2 * self.cfg.kv_lease_duration
        for f in sc.faults:
            if f.at > end or f.at + f.duration < lo:
                continue
            if f.engine in (p, d) or f.peer in (p, d):
                return False
        return not any(lo <= t <= end and d_name == d and p_name == p for t, d_name, p_name in self.api_marks)

    def _final_checks(self) -> None:
        end = self.sc.workload.duration
        for lease in self.all_leases:
            if lease.unfreed and lease.p.alive and lease.p.incarnation == lease.incarnation:
                bound = self._reclaim_bound(lease)
                if end > bound + self.p_step_max:
                    self._violate("dead-accessor-freed-in-time", f"still pinned at the end; bound {bound:.9f}", lease)
            if lease.troubled and self._clean(lease, end):
                self._violate("live-accessor-keeps-lease", lease.troubled, lease)


def _targets(p_ranks: int, a_ranks: int) -> tuple[int, Callable[[int], Sequence[int]]]:
    """vLLM's heterogeneous-TP read mapping (as `Accessor._pinner_targets`)."""
    if p_ranks >= a_ranks:
        k = p_ranks // a_ranks
        return 1, lambda r: range(r * k, (r + 1) * k)
    k = a_ranks // p_ranks
    return k, lambda r: range(r // k, r // k + 1)


def _respawn(req: _Req) -> _Req:
    """The same client request, tried again (a fresh object: the old attempt's transfer may
    still be in flight and must keep its own key)."""
    new = _Req(req.id, req.arrival, req.prompt, req.out_tokens, req.blocks, req.push)
    new.attempt = req.attempt
    return new
