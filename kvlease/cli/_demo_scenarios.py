"""The demo's scenarios, each one object: its timing, its fault, its judgement and its row.

A `Scenario` says when D reads each request (`read_delay`), what goes wrong and when (a
`kill_after` for the parent to SIGKILL D, a `partition` window for D's transport, a fixed-TTL
lease), how long it should take, which claims it must satisfy beyond the common safety claims
(`judge`) and the two cells of the summary table (kvlease, the baseline it replaces). The
processes are told their part in a typed `ChildSpec` (JSON on their command line).

Everything is computed from a `LeaseConfig` and the events the processes reported (each stamped
with the system-wide monotonic clock, so P's and D's reports are comparable even though the
protocol itself saw clocks with different epochs). No hard-coded figures: a claim's bound is
derived from the configuration the run used. This module does no I/O.

To add a scenario: subclass `Scenario`, override what differs, add it to `SCENARIOS`.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import attrs

from kvlease import LeaseConfig

__all__ = [
    "SCENARIOS",
    "Bounds",
    "ChildSpec",
    "Claim",
    "Scenario",
    "ScenarioResult",
    "ScenarioRun",
    "Tally",
    "Timing",
    "evaluate",
]


#: vLLM's fixed abort timeout (VLLM_NIXL_ABORT_REQUEST_TIMEOUT): the baseline for a dead D.
BASELINE_FIXED_TIMEOUT = 480.0


@attrs.frozen
class Bounds:
    """The protocol bounds a run is checked against, from its `LeaseConfig`."""

    lease: float
    interval: float
    extension: float
    accessor_extension: float
    #: Allowance for the driver's timer tick and OS scheduling on a loaded machine (a
    #: parameter of the demo's drivers, not of the protocol).
    slack: float

    @classmethod
    def from_config(cls, config: LeaseConfig, tick: float) -> Bounds:
        return cls(
            lease=config.kv_lease_duration,
            interval=config.heartbeat_interval,
            extension=config.lease_extension,
            accessor_extension=config.accessor_extension,
            slack=tick + 0.5,
        )

    @property
    def reclaim(self) -> float:
        """Liveness: a dead accessor's memory is freed within ``extension + interval`` (+ the
        driver's tick) of its last heartbeat (spec, "Liveness") -- once the lease has been
        extended past its initial duration; see `reclaim_deadline`."""
        return self.extension + self.interval + self.slack

    def reclaim_deadline(self, granted: float, last_heartbeat: float | None) -> float:
        """The latest a lease granted at `granted`, last renewed by a heartbeat handled at
        `last_heartbeat`, may be freed: its expiry is ``max(grant + duration, hb +
        extension)`` (a lease never shrinks), plus the driver's tick."""
        expiry = granted + self.lease
        if last_heartbeat is not None:
            expiry = max(expiry, last_heartbeat + self.extension)
        return expiry + self.slack


@attrs.frozen
class Claim:
    name: str
    ok: bool
    #: What was measured: words, or counts by name (a JSON object in ``--json``).
    detail: str | dict[str, int]
    kind: str = "safety"  # or "liveness"

    @property
    def text(self) -> str:
        """`detail` for a person."""
        if isinstance(self.detail, str):
            return self.detail
        return ", ".join(f"{k}: {v}" for k, v in self.detail.items()) or "none"


@attrs.define
class ScenarioResult:
    name: str
    transport: str
    figures: dict[str, Any] = attrs.field(factory=dict)
    claims: list[Claim] = attrs.field(factory=list)
    kvlease: str = ""
    baseline: str = ""

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.claims)

    def claim(self, name: str, ok: bool, detail: str | dict[str, int], kind: str = "safety") -> None:
        self.claims.append(Claim(name, bool(ok), detail, kind))

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.name,
            "transport": self.transport,
            "ok": self.ok,
            "figures": self.figures,
            "kvlease": self.kvlease,
            "baseline": self.baseline,
            "claims": [attrs.asdict(c) for c in self.claims],
        }


@attrs.frozen
class Timing:
    """A scenario's timing, in seconds after D starts tracking, derived from the lease."""

    queue_time: float = 0.0
    partition_start: float = 0.0
    partition_end: float = 0.0
    kill_after: float = 0.0


@attrs.frozen
class ChildSpec:
    """What one demo process is told: its role, the scenario, the lease and the pool."""

    role: str  # "pinner" or "accessor"
    scenario: str
    transport: str  # "zmq" or "nixl"
    kv_lease_duration: float
    max_access_time: float
    requests: int
    block_size: int
    blocks_per_request: int
    tick: float
    log_level: str
    #: Added to the process's monotonic clock: P's and D's clocks disagree by hours.
    epoch: float
    timing: Timing
    #: D only: P's side-channel address.
    endpoint: str = ""

    @property
    def config(self) -> LeaseConfig:
        return LeaseConfig(kv_lease_duration=self.kv_lease_duration, max_access_time=self.max_access_time)

    @property
    def pool_blocks(self) -> int:
        return self.requests * self.blocks_per_request

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ChildSpec:
        d = json.loads(text)
        return cls(**{**d, "timing": Timing(**d["timing"])})


@attrs.frozen
class Tally:
    """What every judgement starts from: the reads by verdict and the frees by reason."""

    valid: set[str]
    caught: set[str]
    reasons: dict[str, int]


class Scenario:
    """One scenario. The base is the happy path: D reads at once, P frees on access-done."""

    name = "happy"
    description = "D reads, P frees on access-done"
    #: P grants fixed-TTL leases (the ticket carries the deadline) instead of renewable ones.
    fixed_ttl = False
    #: When the core refuses D's READ, D also starts the same READ without the lease check,
    #: to show what the baseline would have handed the engine.
    baseline_read_when_refused = False

    def timing(self, config: LeaseConfig) -> Timing:
        return Timing()

    def expected_duration(self, config: LeaseConfig) -> float:
        """Roughly how long the scenario runs once D tracks (the parent allows twice this)."""
        return 1.0

    def read_delay(self, i: int, config: LeaseConfig, timing: Timing) -> float:
        """When D attempts request `i`'s READ, after the request arrived."""
        return 0.05 + 0.01 * i

    def partition(self, timing: Timing) -> tuple[float, float] | None:
        """The window (after D starts tracking) in which D's control frames are dropped."""
        return None

    def kill_after(self, timing: Timing) -> float | None:
        """When (after the first grant) the parent SIGKILLs D, once D tracks every request."""
        return None

    def judge(self, run: ScenarioRun, config: LeaseConfig, bounds: Bounds, tally: Tally, res: ScenarioResult) -> None:
        """This scenario's claims, figures and table row, beyond the common safety claims."""
        n, valid, reasons = run.requests, tally.valid, tally.reasons
        res.claim("every read valid", len(valid) == n, f"{len(valid)}/{n}", "liveness")
        res.claim("freed on access-done", reasons.get("access_done", 0) == n, dict(reasons), "liveness")
        res.kvlease = f"{len(valid)}/{n} reads valid, {reasons.get('access_done', 0)} freed on access-done"
        res.baseline = "same (frees on read-done)"


class Overload(Scenario):
    name = "overload"
    description = "D keeps requests queued past the initial lease while heartbeating"

    def timing(self, config: LeaseConfig) -> Timing:
        return Timing(queue_time=2.5 * config.kv_lease_duration)  # well past the initial lease

    def expected_duration(self, config: LeaseConfig) -> float:
        return self.timing(config).queue_time + 0.5

    def read_delay(self, i: int, config: LeaseConfig, timing: Timing) -> float:
        return timing.queue_time + 0.01 * i

    def judge(self, run: ScenarioRun, config: LeaseConfig, bounds: Bounds, tally: Tally, res: ScenarioResult) -> None:
        n, valid, f = run.requests, tally.valid, res.figures
        queue = self.timing(config).queue_time
        false_frees = tally.reasons.get("expired", 0) + tally.reasons.get("released", 0)
        f["queue_time_s"] = queue
        f["false_frees"] = false_frees
        baseline_lost = n if queue > config.kv_lease_duration else 0
        f["baseline_prefills_lost"] = baseline_lost
        res.claim("no false frees while D heartbeats", false_frees == 0, f"{false_frees}", "liveness")
        res.claim("every read valid after queueing past the lease", len(valid) == n, f"{len(valid)}/{n}", "liveness")
        res.kvlease = (
            f"queued {queue:.1f} s (lease {config.kv_lease_duration:g} s): {len(valid)}/{n} reads valid, 0 freed"
            if false_frees == 0
            else f"{false_frees} false frees"
        )
        res.baseline = f"fixed {config.kv_lease_duration:g} s timeout: {baseline_lost}/{n} prefills lost"


class Crash(Scenario):
    name = "crash"
    description = "D is SIGKILLed mid-flight; P reclaims after the last heartbeat"

    def timing(self, config: LeaseConfig) -> Timing:
        return Timing(kill_after=max(0.5, config.heartbeat_interval * 1.5))

    def expected_duration(self, config: LeaseConfig) -> float:
        return self.timing(config).kill_after + config.lease_extension + 0.5

    def read_delay(self, i: int, config: LeaseConfig, timing: Timing) -> float:
        return 1e9  # killed before it reads

    def kill_after(self, timing: Timing) -> float | None:
        return timing.kill_after

    def judge(self, run: ScenarioRun, config: LeaseConfig, bounds: Bounds, tally: Tally, res: ScenarioResult) -> None:
        n, b, kill = run.requests, run.blocks_per_request, run.kill_time
        last_hb = max((t for t in run.heartbeats_at_pinner if kill is None or t <= kill + 0.05), default=None)
        free_ts = [evs[0]["t"] for evs in run.frees.values()]
        expired = tally.reasons.get("expired", 0)
        res.claim("every lease of the dead accessor reclaimed by expiry", expired == n, f"{expired}/{n}", "liveness")
        if kill is None or not free_ts or last_hb is None:
            why = f"kill={kill} frees={len(free_ts)} last_hb={last_hb}"
            res.claim("D was killed and P reclaimed", False, why, "liveness")
            return
        reclaim_kill = max(free_ts) - kill
        dead_bs = sum(b * max(t - kill, 0.0) for t in free_ts)
        base_bs = sum(b * (g["t"] + BASELINE_FIXED_TIMEOUT - kill) for g in run.grants.values())
        res.figures.update(
            reclaim_after_last_heartbeat_s=round(max(free_ts) - last_hb, 3),
            reclaim_after_kill_s=round(reclaim_kill, 3),
            reclaim_bound_s=round(bounds.reclaim, 3),
            dead_block_seconds=round(dead_bs, 1),
            baseline_dead_block_seconds=round(base_bs, 1),
        )
        _reclaim_claim(run, bounds, last_hb, res)
        res.kvlease = f"reclaimed {reclaim_kill:.2f} s after kill: {dead_bs:.0f} dead block-s"
        res.baseline = f"{BASELINE_FIXED_TIMEOUT:g} s timeout: {base_bs:.0f} dead block-s"


class Partition(Scenario):
    name = "partition"
    description = "heartbeats stop reaching P; the lease expires; D's late read is caught"

    def timing(self, config: LeaseConfig) -> Timing:
        # Start after the first acknowledged heartbeat; end once P must have expired it.
        start = max(0.3, config.heartbeat_interval * 3.5)
        return Timing(
            partition_start=start,
            partition_end=start + config.lease_extension + config.heartbeat_interval + 0.3,
        )

    def expected_duration(self, config: LeaseConfig) -> float:
        return self.timing(config).partition_end + 0.5

    def read_delay(self, i: int, config: LeaseConfig, timing: Timing) -> float:
        return timing.partition_end + 0.1 + 0.01 * i

    def partition(self, timing: Timing) -> tuple[float, float] | None:
        return timing.partition_start, timing.partition_end

    baseline_read_when_refused = True

    def judge(self, run: ScenarioRun, config: LeaseConfig, bounds: Bounds, tally: Tally, res: ScenarioResult) -> None:
        n, valid, caught, f = run.requests, tally.valid, tally.caught, res.figures
        expired = tally.reasons.get("expired", 0)
        base_corrupt = sum(1 for ok in run.baseline_reads.values() if not ok)
        f["baseline_corrupt_reads"] = base_corrupt
        f["late_reads_attempted"] = len(run.reads)
        res.claim(
            "every late read caught (not handed over)", len(caught) == n and not valid, f"{len(caught)}/{n} caught"
        )
        res.claim("P reclaimed the partitioned leases by expiry", expired == n, f"{expired}/{n}", "liveness")
        last_hb = max(run.heartbeats_at_pinner, default=None)
        if last_hb is not None and expired:
            reclaim = max(evs[0]["t"] for evs in run.frees.values()) - last_hb
            f["reclaim_after_last_heartbeat_s"] = round(reclaim, 3)
            _reclaim_claim(run, bounds, last_hb, res)
        res.kvlease = f"{len(caught)}/{n} late reads caught as stale, 0 corrupt"
        res.baseline = f"no lease check: {base_corrupt}/{len(run.baseline_reads)} late reads return reused blocks"


class Bidirectional(Scenario):
    name = "bidirectional"
    description = "fixed TTL across clocks with different epochs (turn 2)"
    fixed_ttl = True

    def expected_duration(self, config: LeaseConfig) -> float:
        return config.kv_lease_duration + 1.0

    def read_delay(self, i: int, config: LeaseConfig, timing: Timing) -> float:
        if i % 2 == 0:  # early: well inside the TTL
            return config.kv_lease_duration * 0.3 + 0.01 * i
        return config.kv_lease_duration + 0.3 + 0.01 * i  # late: past it

    def judge(self, run: ScenarioRun, config: LeaseConfig, bounds: Bounds, tally: Tally, res: ScenarioResult) -> None:
        n, valid, caught, f = run.requests, tally.valid, tally.caught, res.figures
        early = {f"req-{i}" for i in range(0, n, 2)}
        late = {f"req-{i}" for i in range(1, n, 2)}
        slack = [g["expiry_real"] - run.valid_until[k] for k, g in run.grants.items() if k in run.valid_until]
        res.claim(
            "converted deadline never later than the pinner's",
            bool(slack) and min(slack) >= 0,
            f"min slack {min(slack):.4f} s" if slack else "no deadline converted",
        )
        res.claim("reads before the TTL valid", early <= valid, f"{len(early & valid)}/{len(early)}", "liveness")
        res.claim(
            "reads after the TTL refused",
            not (late & valid) and late <= caught | set(run.lost),
            f"{len(late & caught)}/{len(late)} refused",
        )
        epoch_gap = abs(run.epochs["pinner"] - run.epochs["accessor"])
        f["clock_epoch_gap_s"] = round(epoch_gap, 1)
        if slack:
            f["deadline_conversion_slack_ms"] = round(min(slack) * 1e3, 3)
            res.kvlease = (
                f"deadline converted within {max(slack) * 1e3:.1f} ms (never late); "
                f"{len(early & valid)}/{len(early)} early ok, {len(late & caught)}/{len(late)} late refused"
            )
        else:
            res.kvlease = "no deadline converted"
        res.baseline = f"raw peer deadline: off by {epoch_gap:.0f} s (clock epochs differ)"


#: name -> scenario, in the order the demo plays them.
SCENARIOS: dict[str, Scenario] = {s.name: s for s in (Scenario(), Overload(), Crash(), Partition(), Bidirectional())}


@attrs.define
class ScenarioRun:
    """Everything the parent observed during one scenario, fed event by event."""

    name: str
    transport: str
    requests: int
    blocks_per_request: int
    epochs: dict[str, float]
    grants: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    frees: dict[str, list[dict[str, Any]]] = attrs.field(factory=lambda: defaultdict(list))
    reads: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    read_starts: dict[str, float] = attrs.field(factory=dict)
    baseline_reads: dict[str, bool] = attrs.field(factory=dict)
    lost: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    valid_until: dict[str, float] = attrs.field(factory=dict)
    heartbeats_at_pinner: list[float] = attrs.field(factory=list)
    rtts: list[float] = attrs.field(factory=list)
    tracked: set[str] = attrs.field(factory=set)
    kill_time: float | None = None
    started: float = 0.0
    finished: float | None = None
    timed_out: bool = False
    errors: list[str] = attrs.field(factory=list)
    #: Each process's loop stalls as it last reported them (``longest_step_s``, ``longest_oversleep_s``).
    loop: dict[str, dict[str, float]] = attrs.field(factory=dict)
    #: How long each of the scenario's steps took (`_demo_steps.STEPS`), seconds by name.
    step_seconds: dict[str, float] = attrs.field(factory=dict)

    def feed(self, role: str, ev: dict[str, Any]) -> None:
        kind, t = ev["ev"], ev["t"]
        key: str = ev.get("key", "")
        if kind == "grant":
            self.grants[key] = ev
        elif kind == "free":
            self.frees[key].append(ev)
        elif kind == "heartbeat":
            self.heartbeats_at_pinner.append(t)
        elif kind == "track":
            self.tracked.add(key)
        elif kind == "read_start":
            self.read_starts[key] = t
        elif kind == "read":
            self.reads[key] = ev
        elif kind == "baseline_read":
            self.baseline_reads[key] = bool(ev["content_ok"])
        elif kind == "lost":
            self.lost[key] = ev
        elif kind == "valid_until":
            self.valid_until[key] = max(self.valid_until.get(key, float("-inf")), float(ev["real"]))
        elif kind == "rtt":
            self.rtts.append(float(ev["seconds"]))
        elif kind == "stats" and "loop" in ev:
            self.loop[role] = dict(ev["loop"])

    # -- the live view's numbers ----------------------------------------------------------------

    def block_states(self, now: float) -> dict[str, int]:
        """Blocks per state, for the live table."""
        b = self.blocks_per_request
        out = {"pinned, awaiting read": 0, "freed: access done": 0, "freed: expired": 0, "freed: released": 0}
        for key in self.grants:
            frees = self.frees.get(key)
            if not frees:
                out["pinned, awaiting read"] += b
            else:
                out[
                    {"access_done": "freed: access done", "expired": "freed: expired"}.get(
                        frees[0]["reason"], "freed: released"
                    )
                ] += b
        return out


def _median(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[len(s) // 2]


def _reclaim_claim(run: ScenarioRun, bounds: Bounds, last_hb: float | None, res: ScenarioResult) -> None:
    """Each free by its reclaim deadline. A free later than that is still in time for the
    machine when the pinner's own loop ran at least that late as it freed (``loop_late``: the
    process starved, the core decided on time); a core that decides late frees from a loop
    that ran on time, and fails."""
    late, starved = [], []
    for key, g in run.grants.items():
        evs = run.frees.get(key)
        if not evs:
            continue
        over = evs[0]["t"] - bounds.reclaim_deadline(g["t"], last_hb)
        loop_late = float(evs[0].get("loop_late", 0.0))
        if over > loop_late:
            late.append((key, round(over, 3), loop_late))
        elif over > 0:
            starved.append((key, round(over, 3), loop_late))
    res.figures["pinner_loop_late_at_free_s"] = max(
        (float(evs[0].get("loop_late", 0.0)) for evs in run.frees.values()), default=0.0
    )
    if late:
        detail = "late: " + ", ".join(f"{k} by {over:g} s (the pinner's loop only {ll:g} s)" for k, over, ll in late)
    elif starved:
        detail = (
            f"all {len(run.grants)} in time for the machine: {len(starved)} late by up to "
            f"{max(o for _, o, _ in starved):g} s, each no more than the pinner's own loop ran late (a starved process)"
        )
    else:
        detail = f"all {len(run.grants)} in time"
    res.claim("reclaimed by max(grant + lease, last heartbeat + extension) + tick", not late, detail, "liveness")


def evaluate(run: ScenarioRun, config: LeaseConfig, bounds: Bounds) -> ScenarioResult:
    """Judge one scenario: the claims every scenario must satisfy, its figures, then the
    scenario's own judgement (`Scenario.judge`)."""
    res = ScenarioResult(run.name, run.transport)
    n = run.requests
    res.claim(
        "finished",
        not run.timed_out and not run.errors and len(run.grants) == n,
        "; ".join(run.errors) or ("timed out" if run.timed_out else f"{len(run.grants)}/{n} leases granted"),
        "liveness",
    )
    tally = _tally(run)
    _figures(run, tally, res)
    _safety(run, tally, res)
    SCENARIOS[run.name].judge(run, config, bounds, tally, res)
    return res


def _tally(run: ScenarioRun) -> Tally:
    reasons: dict[str, int] = defaultdict(int)
    for evs in run.frees.values():
        for ev in evs:
            reasons[ev["reason"]] += 1
    return Tally(
        valid={k for k, r in run.reads.items() if r["verdict"] == "valid"},
        caught={k for k, r in run.reads.items() if r["verdict"] in ("stale", "refused")},
        reasons=dict(reasons),
    )


def _figures(run: ScenarioRun, tally: Tally, res: ScenarioResult) -> None:
    f, b = res.figures, run.blocks_per_request
    corrupt = [k for k in tally.valid if not run.reads[k].get("content_ok")]
    f["requests"] = run.requests
    f["blocks_per_request"] = b
    f["reads_valid"] = len(tally.valid)
    f["stale_reads_caught"] = len(tally.caught)
    f["corrupt_reads_handed_over"] = len(corrupt)
    f["frees"] = dict(tally.reasons)
    f["heartbeats_at_pinner"] = len(run.heartbeats_at_pinner)
    med = _median(run.rtts)
    f["heartbeat_rtt_median_ms"] = None if med is None else round(med * 1e3, 3)
    pinned_bs = 0.0
    for key, g in run.grants.items():
        ended = run.frees.get(key)
        end = ended[0]["t"] if ended else (run.finished or g["t"])
        pinned_bs += b * (end - g["t"])
    f["pinned_block_seconds"] = round(pinned_bs, 2)
    f["step_seconds"] = dict(run.step_seconds)
    f["loop_stalls_s"] = {role: dict(v) for role, v in sorted(run.loop.items())}


def _safety(run: ScenarioRun, tally: Tally, res: ScenarioResult) -> None:
    """The safety claims, whatever the scenario."""
    valid = tally.valid
    corrupt = sorted(k for k in valid if not run.reads[k].get("content_ok"))
    res.claim(
        "exactly one free per lease",
        all(len(v) == 1 for v in run.frees.values()),
        f"{sum(len(v) for v in run.frees.values())} frees for {len(run.frees)} leases",
    )
    res.claim(
        "no overwritten KV handed over as valid",
        not corrupt,
        f"corrupt valid reads: {', '.join(map(str, corrupt))}" if corrupt else "0",
    )
    overlap = []
    believed_after_free = []
    for key, evs in run.frees.items():
        free_t = evs[0]["t"]
        if evs[0]["reason"] != "access_done" and key in valid and run.reads[key]["t"] > free_t:
            overlap.append(key)
        if evs[0]["reason"] != "access_done" and run.valid_until.get(key, float("-inf")) > free_t:
            believed_after_free.append((key, round(run.valid_until[key] - free_t, 4)))
    res.claim(
        "no valid access overlaps a free",
        not overlap,
        f"overlapping: {', '.join(map(str, overlap))}" if overlap else "0",
    )
    res.claim(
        "accessor never believes a lease valid after the pinner freed it",
        not believed_after_free,
        ", ".join(f"{k} ({late:g} s too late)" for k, late in believed_after_free) if believed_after_free else "0",
    )
