"""The steps of one demo scenario, what each waits for, and when waiting has gone on too long.

A scenario is six steps in order: start the pinner process, start the accessor process,
connect the accessor to the pinner, grant and track every lease, play the scenario (until the
accessor is done or dead), and wind down (until the pinner has ended every lease and exited).
`Steps` knows which step is current from the events the children report, and gives up on a
step only when it has gone without progress for longer than that step can legitimately be quiet:

- starting a process: 30 s with neither an event nor CPU time used by the child (an import of
  torch on a loaded machine is slow, but it burns CPU), and at most 300 s in all;
- every later step: the scenario's own longest quiet time (`Scenario.expected_duration`: a
  queue, a partition, an expiry) plus a margin that follows the machine: four times the slowest
  process start-up measured so far in this run (`Calibration`), and at least 5 s.

Every progress event (a lease granted, tracked, read, lost or freed; a process ready,
connected or gone) starts the step's quiet time again; heartbeats and stats do not (they go on
forever if a step hangs). ``--patience`` scales all of it. When it gives up, `why` says which
step waited, for how long, for what, and what had happened so far.

Pure: the caller passes the time (``now``, the parent's monotonic clock) and the children's
CPU time; nothing here reads a clock or a process.
"""

from __future__ import annotations

import attrs

from ._demo_scenarios import ScenarioRun

__all__ = ["STEPS", "Calibration", "Steps"]

#: The steps, in order: (name, what it waits for).
STEPS: tuple[tuple[str, str], ...] = (
    ("start the pinner process", "the pinner process to start its transport and report 'ready'"),
    ("start the accessor process", "the accessor process to start its transport and report 'ready'"),
    ("connect the accessor to the pinner", "the accessor's handshake with the pinner ('connected')"),
    ("grant and track the leases", "the pinner to grant every lease and the accessor to track each"),
    ("play the scenario", "the accessor to resolve every request (or die, in the crash scenario)"),
    ("wind down", "the pinner to end every lease and exit"),
)

#: Events that are progress: each happens a bounded number of times per scenario, so a step
#: that keeps making progress still ends. Heartbeats, stats and RTT samples are not.
PROGRESS = frozenset(
    {"ready", "connected", "grant", "track", "read_start", "read", "baseline_read", "lost", "free", "eof"}
)

STARTUP_QUIET = 30.0
STARTUP_CAP = 300.0
MARGIN_FLOOR = 5.0
MARGIN_PER_STARTUP = 4.0


@attrs.define
class Calibration:
    """What this run has measured of the machine, carried from scenario to scenario."""

    patience: float = 1.0
    slowest_startup: float = 0.0

    @property
    def margin(self) -> float:
        return self.patience * max(MARGIN_FLOOR, MARGIN_PER_STARTUP * self.slowest_startup)


@attrs.define
class Steps:
    """The current step of one scenario and its deadline. `observe` every child event,
    `cpu` the child's CPU time during a start-up, and ask `expired`."""

    requests: int
    #: The scenario's longest legitimate quiet time (`Scenario.expected_duration`).
    quiet: float
    calibration: Calibration
    started: float
    seen: set[tuple[str, str]] = attrs.field(factory=set)
    granted: int = 0
    tracked: int = 0
    step_started: float = 0.0
    last_progress: float = 0.0
    last_event: str = ""
    cpu_seen: dict[str, float] = attrs.field(factory=dict)
    #: How long each finished step took, by name.
    seconds: dict[str, float] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        self.step_started = self.last_progress = self.started

    @property
    def index(self) -> int:
        """The current step (0-based); ``len(STEPS)`` once every step is done."""
        done = (
            ("pinner", "ready") in self.seen,
            ("accessor", "ready") in self.seen,
            ("accessor", "connected") in self.seen,
            self.granted >= self.requests and self.tracked >= self.requests,
            ("accessor", "eof") in self.seen,
            ("pinner", "eof") in self.seen,
        )
        return next((i for i, ok in enumerate(done) if not ok), len(STEPS))

    @property
    def starting(self) -> str | None:
        """The role whose process is starting, during a start-up step."""
        return {0: "pinner", 1: "accessor"}.get(self.index)

    def observe(self, role: str, kind: str, now: float) -> None:
        if kind not in PROGRESS:
            return
        before = self.index
        self.seen.add((role, kind))
        if kind == "grant" and role == "pinner":
            self.granted += 1
        elif kind == "track" and role == "accessor":
            self.tracked += 1
        self.last_progress = now
        self.last_event = f"'{kind}' from the {role}"
        after = self.index
        if after != before:
            for i in range(before, min(after, len(STEPS))):
                self.seconds[STEPS[i][0]] = round(now - self.step_started, 3)
            if before <= 1 and after > before:  # a process finished starting: calibrate
                self.calibration.slowest_startup = max(self.calibration.slowest_startup, now - self.step_started)
            self.step_started = now

    def cpu(self, role: str, seconds: float | None, now: float) -> None:
        """The CPU time `role`'s process has used: while it starts, more is progress."""
        if seconds is None or role != self.starting:
            return
        if seconds > self.cpu_seen.get(role, 0.0):
            self.cpu_seen[role] = seconds
            self.last_progress = now

    @property
    def window(self) -> float:
        """How long the current step may go without progress."""
        if self.index <= 1:
            return self.calibration.patience * STARTUP_QUIET
        return self.calibration.patience * self.quiet + self.calibration.margin

    def deadline(self) -> float:
        if self.index <= 1:
            return min(self.last_progress + self.window, self.step_started + self.calibration.patience * STARTUP_CAP)
        return self.last_progress + self.window

    def expired(self, now: float) -> bool:
        return self.index < len(STEPS) and now > self.deadline()

    def why(self, run: ScenarioRun, now: float, pids: dict[str, int]) -> str:
        """Which step timed out, what it waited for and how long, and where things stood."""
        i = self.index
        name, waits_for = STEPS[i]
        since = now - self.last_progress
        if i <= 1 and now - self.step_started > self.calibration.patience * STARTUP_CAP:
            limit = f"at most {self.calibration.patience * STARTUP_CAP:.3g} s to start"
        elif i <= 1:
            limit = f"{self.window:.3g} s without an event or CPU time used"
        else:
            limit = (
                f"{self.window:.3g} s without progress: the scenario's quiet time "
                f"{self.calibration.patience * self.quiet:.3g} s + margin {self.calibration.margin:.3g} s "
                f"(slowest start-up {self.calibration.slowest_startup:.3g} s)"
            )
        last = f"last progress {since:.3g} s ago: {self.last_event}" if self.last_event else "no event yet"
        return (
            f"timed out in step {i + 1}/{len(STEPS)} '{name}' after {now - self.step_started:.3g} s "
            f"(limit {limit}); waited for {waits_for}: {self._state(i, run, pids)}; {last}"
        )

    def _state(self, i: int, run: ScenarioRun, pids: dict[str, int]) -> str:
        n = self.requests
        if i <= 1:
            role = ("pinner", "accessor")[i]
            cpu = self.cpu_seen.get(role)
            used = f", {cpu:.3g} s of CPU used" if cpu is not None else ""
            return f"pid {pids.get(role, '?')} running, no 'ready' yet{used}"
        if i == 2:
            return "no 'connected' from the accessor"
        if i == 3:
            return f"{self.granted}/{n} granted, {self.tracked}/{n} tracked"
        verdicts: dict[str, int] = {}
        for r in run.reads.values():
            verdicts[r["verdict"]] = verdicts.get(r["verdict"], 0) + 1
        in_flight = sorted(k for k in run.read_starts if k not in run.reads)
        frees: dict[str, int] = {}
        for evs in run.frees.values():
            frees[evs[0]["reason"]] = frees.get(evs[0]["reason"], 0) + 1
        pinned = sorted(k for k in run.grants if k not in run.frees)
        reads = ", ".join(f"{v} {k}" for k, v in sorted(verdicts.items())) or "none"
        freed = ", ".join(f"{v} {k}" for k, v in sorted(frees.items())) or "none"
        parts = [
            f"{len(set(run.reads) | set(run.baseline_reads))}/{n} requests resolved (reads: {reads})",
            f"reads in flight: {', '.join(in_flight) or 'none'}",
            f"{len(run.lost)} leases reported lost",
            f"{sum(frees.values())}/{n} freed at the pinner ({freed})",
            f"still pinned: {', '.join(pinned) or 'none'}",
        ]
        if run.kill_time is not None:
            parts.append("the accessor was killed as the scenario's fault")
        return "; ".join(parts)
