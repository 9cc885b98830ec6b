"""The simulated cluster's state and the primitives every layer of `Cluster` uses.

`Cluster` is built in layers, one module per concern, each a subclass of the one below:
`_kernel` (state, the event heap, clocks, the core objects, metrics accounting), `_network`
(send, deliver, partitions, the handshake side channel), `_checks` (the safety and liveness
claims), `_lifecycle` (workload, router, faults, crashes and restarts), `_prefill` (the pinner
side), `_decode` (the accessor side), `_adversity` (API-level misuse) and `_cluster` (the event
loop). A layer calls down freely; the few event handlers a lower layer schedules but an upper
one defines are declared at the end of this class.

Must never read a clock, sleep, start a thread or do I/O: a run is a pure function of its
scenario, policy and seed, so a seed reproduces bit for bit.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable
from typing import Any, TypeVar

import attrs

from .._accessor import AccessDecision, Accessor
from .._clock import LocalTime
from .._config import LeaseConfig
from .._events import Send
from .._messages import Message
from .._pinner import Pinner
from ._baselines import FixedTimeoutPinner
from ._recording import recording
from ._results import RunResult, Violation
from ._scenario import Policy, Scenario
from ._world import DecodeEngine, DriftingClock, PrefillEngine, Request, SimEngine, SimLease

__all__ = ["AccessorFactory", "PinnerFactory"]

PinnerFactory = Callable[[LeaseConfig, str, int, int, int], Pinner]
AccessorFactory = Callable[[LeaseConfig, str, int, int, int], Accessor]

_INF = math.inf
_heappush = heapq.heappush
_Core = TypeVar("_Core")


class _Kernel:
    """What every layer shares: the scenario, the event heaps, virtual time, the engines and
    their core objects, the run's result and the pinned-memory accounting."""

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
        #: Each engine's settings (a rolling config change draws the decode side's apart).
        self.cfgs: dict[str, LeaseConfig] = {
            e.name: (self.cfg if e.config is None else e.config)
            if policy is not Policy.VLLM_HB or e.config is None
            else e.config.with_changes(vllm_compat=True)
            for e in scenario.prefill + scenario.decode
        }
        self.check = check
        self.rng = random.Random(scenario.seed)
        # Lease ids far apart (`Scenario.id_gap`): their own stream.
        self.id_rng = random.Random(scenario.seed * 0x2545F491 + 0x1D)
        self.net_rng = random.Random(scenario.seed ^ 0x5EED)
        self.result = RunResult(policy.value, scenario.seed, scenario.workload.duration)
        if trace:
            self.result.trace = []
        # Hot paths test these flags before building a trace line, so a
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
        self.leases: dict[tuple[str, int, int], SimLease] = {}
        self.all_leases: list[SimLease] = []
        self.next_req = 0
        self.p_step_max = wl.prefill_base + wl.prefill_per_token * wl.prompt_tokens[1]
        self._start_engines()
        self._start_api()

    def _start_engines(self) -> None:
        scenario = self.sc
        drift = scenario.drift
        self.p: dict[str, PrefillEngine] = {}
        self.d: dict[str, DecodeEngine] = {}
        for spec in scenario.prefill:
            pe = PrefillEngine(spec.name, spec.tp, self._new_clock(drift, fast=True))
            self._start_pinner(pe)
            self.p[spec.name] = pe
        for dspec in scenario.decode:
            de = DecodeEngine(dspec.name, dspec.tp, dspec.slots, self._new_clock(drift, fast=False))
            self._start_accessor(de)
            self.d[dspec.name] = de
        self.engines: dict[str, SimEngine] = {**self.p, **self.d}
        self.router_down: dict[str, bool] = dict.fromkeys(self.engines, False)

    def _start_api(self) -> None:
        """API-level adversity (kvlease only): its own random streams, so a scenario without it
        draws exactly what it drew before the knob existed."""
        scenario, policy = self.sc, self.policy
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
        self._forged_ids: dict[int, list[int]] = {}  # frame bound -> a forged heartbeat's ids

    def _start_pinner(self, pe: PrefillEngine) -> None:
        pe.incarnation = self.rng.getrandbits(64)
        timeout = self.policy.fixed_timeout
        if timeout is not None:
            pe.fixed = [FixedTimeoutPinner(timeout) for _ in range(pe.tp)]
            pe.pinners = []
        else:
            cfg = self.cfgs[pe.name]
            pe.pinners = [self.pinner_factory(cfg, pe.name, pe.incarnation, r, pe.tp) for r in range(pe.tp)]
            pe.last_id = 0
            pe.fixed = []
            if self.recorded is not None:
                pe.pinners = [
                    self._recording(
                        pinner,
                        {
                            "role": "pinner",
                            "engine_id": pe.name,
                            "incarnation": pe.incarnation,
                            "rank": r,
                            "ranks": pe.tp,
                            **self._own_config(pe.name),
                        },
                        pe.gen,
                    )
                    for r, pinner in enumerate(pe.pinners)
                ]

    def _start_accessor(self, de: DecodeEngine) -> None:
        de.accessors = []
        if self.policy is Policy.KVLEASE:
            # Sessions differ per engine incarnation (generation) and rank, deterministically (no
            # draw from the simulation's random streams).
            session = (de.gen << 20) + 1
            cfg = self.cfgs[de.name]
            de.accessors = [self.accessor_factory(cfg, de.name, r, de.tp, session + r) for r in range(de.tp)]
            if self.recorded is not None:
                de.accessors = [
                    self._recording(
                        acc,
                        {
                            "role": "accessor",
                            "engine_id": de.name,
                            "rank": r,
                            "ranks": de.tp,
                            "session": session + r,
                            **self._own_config(de.name),
                        },
                        de.gen,
                    )
                    for r, acc in enumerate(de.accessors)
                ]
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

    def _own_config(self, engine: str) -> dict[str, Any]:
        """A recorded endpoint's own settings, where they differ from the scenario's."""
        cfg = self.cfgs[engine]
        return {} if cfg == self.cfg else {"config": attrs.asdict(cfg)}

    def _recording(self, core: _Core, spec: dict[str, Any], generation: int) -> _Core:
        """`core` wrapped to record its calls as endpoint `spec` (one per engine generation)."""
        assert self.recorded is not None
        name = f"{spec['engine_id']}.{spec['rank']}#{generation}"
        self.endpoints[name] = spec
        return recording(core, spec["role"], name, self.recorded, self._real_time)

    def _real_time(self) -> float:
        return self.now

    def _new_clock(self, drift: float, *, fast: bool) -> DriftingClock:
        # Clocks at the bound most of the time, and mostly in the adversarial direction
        # (pinners fast: they expire early in real time; accessors slow: they believe late):
        # that is where drift bugs live.
        r = self.rng.choice((drift, drift, -drift, self.rng.uniform(-drift, drift)))
        return DriftingClock(self.rng.uniform(1e4, 2e5), 1.0 + (r if fast else -r))

    def _at(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        _heappush(self._heap, (t, next(self._seqs), fn, arg))

    def _trace(self, who: str, what: str, detail: str) -> None:
        tr = self.result.trace
        if tr is not None:
            tr.append((round(self.now, 9), who, what, detail))

    def _violate(self, claim: str, detail: str, lease: SimLease | None = None) -> None:
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

    def _sample(self, _: Any) -> None:
        self.result.timeline.append((round(self.now, 6), round(self.pinned, 6)))
        self._at(self.now + self.sc.workload.sample_every, self._sample, None)

    def _poke(self, eng: SimEngine, t: float) -> None:
        """Wake an idle engine at `t` (a stepping engine looks at its inbox at the boundary)."""
        if eng.stepping or t >= eng.wake_at:
            return
        eng.wake_at = t
        _heappush(self._wakes, (t, next(self._seqs), self._wake, (eng, eng.gen, t)))

    def _count(self, what: str) -> None:
        api = self.result.api
        api[what] = api.get(what, 0) + 1

    def _api_mark(self, d_name: str, p_name: str) -> None:
        self.api_marks.append((self.now, d_name, p_name))

    # -- handlers the layers above define (declared here so that each layer type-checks) -----

    def _wake(self, arg: tuple[SimEngine, int, float]) -> None:
        raise NotImplementedError

    def _p_enqueue(self, arg: tuple[PrefillEngine, int, Request]) -> None:
        raise NotImplementedError

    def _d_arrive(self, arg: tuple[DecodeEngine, int, Request]) -> None:
        raise NotImplementedError

    def _d_step_done(self, arg: tuple[DecodeEngine, int, float]) -> None:
        raise NotImplementedError

    # API-level adversity (`_adversity`): the hooks the engines call.

    def _api_send(self, de: DecodeEngine, rank: int, out: Send, msg: Message, hb: bool) -> bool:
        raise NotImplementedError

    def _api_begin(self, de: DecodeEngine, now: LocalTime, req: Request, decisions: list[AccessDecision]) -> bool:
        raise NotImplementedError

    def _d_checked(self, de: DecodeEngine, now: LocalTime, rank: int, data: bytes, why: str) -> None:
        raise NotImplementedError

    def _dup_reply(self, de: DecodeEngine, rank: int, data: bytes, p_name: str) -> None:
        raise NotImplementedError

    def _failed_after_notify(self, de: DecodeEngine, now: LocalTime, req: Request) -> None:
        raise NotImplementedError

    def _late_write(self, de: DecodeEngine, now: LocalTime, req: Request) -> None:
        raise NotImplementedError

    def _retrack_later(self, arg: tuple[DecodeEngine, int, Request]) -> None:
        raise NotImplementedError

    def _abort(self, arg: tuple[DecodeEngine, int, Request]) -> None:
        raise NotImplementedError

    def _redispatch(self, req: Request) -> None:
        raise NotImplementedError
