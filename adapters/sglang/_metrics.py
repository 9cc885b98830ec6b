"""Prometheus metrics of the SGLang adapter: kvlease's own families (`LeaseStatsCollector`, one
label set per SGLang rank: ``engine_id``, ``rank``, ``role``) plus the adapter's counters.

Where they show:

- **SGLang's own ``/metrics``** (``--enable-metrics``). SGLang runs ``prometheus_client`` in
  multiprocess mode: every process writes its metrics to files under ``PROMETHEUS_MULTIPROC_DIR``
  and the HTTP server's ``/metrics`` merges them (``MultiProcessCollector``). A collector in the
  scheduler process is invisible there, so when that variable is set the adapter also mirrors
  its figures into ``prometheus_client`` counters (`_Mirror`, updated from the pump at most once
  a second), which write those files: the ``kvlease_sglang_*`` counters and the main
  ``kvlease_*`` lease counters appear in SGLang's ``/metrics``.
- The scheduler process's default registry (`LeaseStatsCollector` and `AdapterCollector`): every
  family, heartbeat round trips included, for whatever serves that registry in-process.
- ``SGLANG_KVLEASE_METRICS_PORT`` (default 0: off) serves that registry on
  ``127.0.0.1:<port + engine_rank>``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar

from kvlease.transports.metrics import LeaseStatsCollector, start_http_server
from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from ._lease import LeaseRuntime

__all__ = ["AdapterCollector", "mount"]

logger = logging.getLogger("kvlease.adapters.sglang")

_LABELS = ("engine_id", "rank", "role")
_lock = threading.Lock()
_stats_collector: LeaseStatsCollector | None = None
_adapter_collector: AdapterCollector | None = None


class AdapterCollector(Collector):
    """The adapter's counters, per runtime."""

    def __init__(self) -> None:
        self._runtimes: dict[tuple[str, ...], LeaseRuntime] = {}

    def add(self, labels: tuple[str, ...], rt: LeaseRuntime) -> None:
        self._runtimes[labels] = rt

    def describe(self) -> Iterator[Any]:
        return iter(())

    def collect(self) -> Iterator[Any]:
        fams = {name: CounterMetricFamily(f"kvlease_sglang_{name}", doc, labels=list(_LABELS)) for name, doc in ADAPTER}
        for labels, rt in list(self._runtimes.items()):
            values = adapter_values(rt)
            for name, fam in fams.items():
                fam.add_metric(list(labels), float(values[name]))
        yield from fams.values()


#: The adapter's counters: (name after ``kvlease_sglang_``, help).
ADAPTER: tuple[tuple[str, str], ...] = (
    ("writes_refused", "Prefill WRITEs not posted because no validity window covered them (or no lease guarded them)."),
    ("rooms_failed", "Rooms failed (KVPoll.Failed) by a lease's expiry or loss."),
    ("messages_dropped", "Messages on SGLang's control sockets dropped as malformed, unknown or over a bound."),
    ("tickets_refused", "Lease tickets not tracked: forged, relabelled, moved to other pages, stale or malformed."),
    ("accesses", "Prefill accesses begun: one per room and decode rank, from its first WRITE to its last."),
    ("writes_overran", "Accesses with WRITEs in flight longer than the access-time bound A (kept alive meanwhile)."),
    ("chunks_deferred", "Transfer chunks set aside while their room's lease was not acknowledged yet."),
)

#: Lease counters of `TransportStats` mirrored into SGLang's ``/metrics`` (after ``kvlease_``).
MIRRORED_STATS: tuple[str, ...] = (
    "leases_granted",
    "leases_released",
    "leases_completed",
    "leases_expired",
    "leases_lost",
    "heartbeats_sent",
    "heartbeats_received",
    "unauthenticated_messages",
)


def adapter_values(rt: LeaseRuntime) -> dict[str, int]:
    return {
        "writes_refused": rt.writes_refused,
        "rooms_failed": rt.rooms_failed,
        "messages_dropped": rt.transport.dropped,
        "tickets_refused": rt.tickets_refused,
        "accesses": rt.accesses,
        "writes_overran": rt.writes_overran,
        "chunks_deferred": rt.chunks_deferred,
    }


class _Mirror:
    """One runtime's counters as ``prometheus_client`` counters (multiprocess files)."""

    _counters: ClassVar[dict[str, Any]] = {}  # per process: name -> Counter (one per name, labelled)

    def __init__(self, rt: LeaseRuntime, labels: tuple[str, ...]) -> None:
        from prometheus_client import Counter

        self._rt = rt
        self._labels = labels
        self._seen: dict[str, int] = {}
        self._last = 0.0
        names = [(f"kvlease_sglang_{n}", d) for n, d in ADAPTER]
        names += [(f"kvlease_{n}", f"kvlease lease counter {n} (see kvlease's metrics docs).") for n in MIRRORED_STATS]
        with _lock:
            for name, doc in names:
                if name not in self._counters:
                    # registry=None: the files are the export; the in-process registry already
                    # carries these families through the collectors above.
                    self._counters[name] = Counter(name, doc, list(_LABELS), registry=None)

    def refresh(self) -> None:
        now = time.monotonic()
        if now - self._last < 1.0:
            return
        self._last = now
        values = {f"kvlease_sglang_{k}": v for k, v in adapter_values(self._rt).items()}
        snap = self._rt.stats.snapshot()
        values.update({f"kvlease_{k}": int(snap.get(k, 0)) for k in MIRRORED_STATS})
        for name, value in values.items():
            delta = value - self._seen.get(name, 0)
            if delta > 0:
                self._counters[name].labels(*self._labels).inc(delta)
                self._seen[name] = value


def mount(rt: LeaseRuntime, *, engine_rank: int) -> str:
    """Export `rt`'s metrics (see the module docstring); says where. Never fails the start."""
    global _stats_collector, _adapter_collector
    labels = (rt.engine_id, str(engine_rank), rt.role)
    where: list[str] = []
    with _lock:
        first = _stats_collector is None
        if _stats_collector is None or _adapter_collector is None:
            _stats_collector = LeaseStatsCollector(label_names=_LABELS)
            _adapter_collector = AdapterCollector()
        _stats_collector.set_source(labels, rt.stats)
        _adapter_collector.add(labels, rt)
        if first:
            try:
                REGISTRY.register(_stats_collector)
                REGISTRY.register(_adapter_collector)
            except ValueError as exc:
                logger.warning("kvlease: metrics not registered on the default registry: %s", exc)
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        try:
            rt.add_step_hook(_Mirror(rt, labels).refresh)
            where.append("SGLang's /metrics")
        except Exception as exc:  # never fail the manager's start over metrics
            logger.warning("kvlease: metrics not mirrored into SGLang's multiprocess files: %s", exc)
    port = rt.settings.metrics_port
    if port:
        try:
            start_http_server(_stats_collector, port + engine_rank)
            where.append(f"127.0.0.1:{port + engine_rank}")
        except OSError as exc:
            logger.warning("kvlease: metrics port %s: %s", port + engine_rank, exc)
    return ", ".join(where) or "in-process registry only"
