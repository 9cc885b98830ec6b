"""kvlease's counters through vLLM's own connector metrics (``KVConnectorStats``).

Each worker step records the increase of the driver's `TransportStats` counters into the
connector's stats object; vLLM ships it from the workers to the scheduler with the model runner
output, aggregates it, logs its `reduce` with the other KV-transfer figures and hands it to the
connector's `KVConnectorPromMetrics`, which exports ``vllm:kvlease_*`` counters on vLLM's own
Prometheus endpoint (no second HTTP server).
"""

from __future__ import annotations

# First: an unsupported vLLM is refused, saying what to do, before its internals load.
from . import _vllm_check  # noqa: F401

# isort: split

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats, NixlPromMetrics
from vllm.v1.metrics.utils import create_metric_per_engine

__all__ = ["KVLEASE_COUNTERS", "PUSH_COUNTERS", "WORK_COUNTERS", "KvleaseConnectorStats", "KvleasePromMetrics"]

#: `TransportStats` counters exported, with their help text.
KVLEASE_COUNTERS: dict[str, str] = {
    "leases_granted": "Leases granted by this producer",
    "leases_renewed": "Lease renewals (per lease id) by heartbeats",
    "leases_completed": "Leases ended by the decoder's read-done",
    "leases_expired": "Leases that expired: their KV blocks were freed unread",
    "leases_released": "Leases released before a read",
    "leases_lost": "Decoder leases reported lost (the request is recomputed)",
    "stale_reads_caught": "Decoder reads that may have overlapped a free (reported as failed loads)",
    "accesses_completed": "Decoder reads proven inside a valid lease",
    "accesses_confirmed": "Of those, reads that waited for the producer's confirmation (one more round trip)",
    "heartbeats_sent": "Heartbeat messages sent by the decoder",
    "heartbeats_received": "Heartbeat messages received by the producer (kvlease and stock vLLM)",
    "heartbeat_acks_received": "Heartbeat acknowledgements received by the decoder",
    "handshakes_sent": "kvlease handshakes sent",
    "handshakes_answered": "kvlease handshakes answered",
    "malformed_messages": "Undecodable or protocol-breaking lease messages dropped",
    "unauthenticated_messages": "Lease messages dropped for failing authentication",
    "rejected_messages": "Lease messages understood but refused",
    "peers_dead": "Peers given up after the engine TTL",
}

#: The push connector's own counts (its producer's WRITEs), exported the same way.
PUSH_COUNTERS: dict[str, str] = {
    "push_writes_posted": "Push WRITEs posted by this producer under the decoder's push lease",
    "push_writes_refused": "Push WRITEs not started: the validity window did not cover them",
    "push_writes_dropped": "Push WRITEs dropped: the decoder's push lease was lost before approval",
}

#: What kvlease's own code costs inside the server (its part of each engine step, and the lease
#: pump's turns): ``rate(lease_work_us) / rate(lease_turns)`` is the cost of one turn, in µs.
WORK_COUNTERS: dict[str, str] = {
    "lease_work_us": "Microseconds spent in kvlease's lease code (its part of engine steps, and the lease pump)",
    "lease_turns": "Turns of kvlease's lease code (engine steps and lease-pump turns)",
}

_ALL = {**KVLEASE_COUNTERS, **PUSH_COUNTERS, **WORK_COUNTERS}
_KEYS = {name: f"kvlease_{name}" for name in _ALL}


class KvleaseConnectorStats(NixlKVConnectorStats):  # type: ignore[misc]
    """vLLM's NIXL connector stats plus kvlease's counters (one list entry per increase)."""

    def reset(self) -> None:
        super().reset()
        for key in _KEYS.values():
            self.data[key] = []

    def record_kvlease(self, deltas: dict[str, int]) -> None:
        for name, delta in deltas.items():
            if delta > 0:
                self.data[_KEYS[name]].append(delta)

    def kvlease_totals(self) -> dict[str, int]:
        return {name: int(sum(self.data.get(key, ()))) for name, key in _KEYS.items()}

    def is_empty(self) -> bool:
        return bool(super().is_empty()) and not any(self.data.get(key) for key in _KEYS.values())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            for k, v in other.data.items():
                self.data.setdefault(k, []).extend(v)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(super().reduce())
        for name, total in self.kvlease_totals().items():
            if total:
                out[f"kvlease {name.replace('_', ' ')}"] = total
        return out


class KvleasePromMetrics(NixlPromMetrics):  # type: ignore[misc]
    """vLLM's NIXL Prometheus metrics plus a ``vllm:kvlease_<counter>`` counter per kvlease counter."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.kvlease_counters: dict[str, Any] = {}
        for name, doc in _ALL.items():
            counter = self._counter_cls(name=f"vllm:kvlease_{name}", documentation=doc, labelnames=labelnames)
            self.kvlease_counters[name] = create_metric_per_engine(counter, self.per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        super().observe(transfer_stats_data, engine_idx)
        for name, per_engine in self.kvlease_counters.items():
            for delta in transfer_stats_data.get(_KEYS[name], ()):
                per_engine[engine_idx].inc(delta)
