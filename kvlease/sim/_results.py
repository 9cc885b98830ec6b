"""What a simulator run measured: `RunResult` (metrics, timeline, trace) and `Violation`.

Owns the shape of a run's outcome and its JSON summary. Must never simulate anything: the
event loop (`_cluster`) fills these in.
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["RunResult", "Violation"]


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
