"""Prometheus metrics of the SGLang adapter: kvlease's own families (`LeaseStatsCollector`, one
label set per SGLang rank: ``engine_id``, ``rank``, ``role``) plus the adapter's counters.

SGLang's scheduler processes write their metrics through ``prometheus_client``; this collector
is registered on the same process-wide default registry, so whatever serves that registry in the
scheduler process serves these too. ``SGLANG_KVLEASE_METRICS_PORT`` (default 0: off) also serves
them on ``127.0.0.1:<port + engine_rank>``, for deployments whose SGLang metrics endpoint lives in
another process (SGLang's multiprocess mode aggregates only its own files).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

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
        fams = {
            "writes_refused": CounterMetricFamily(
                "kvlease_sglang_writes_refused",
                "Prefill WRITEs not started because no validity window covered them.",
                labels=list(_LABELS),
            ),
            "rooms_failed": CounterMetricFamily(
                "kvlease_sglang_rooms_failed",
                "Rooms failed (KVPoll.Failed) by a lease's expiry or loss.",
                labels=list(_LABELS),
            ),
            "dropped": CounterMetricFamily(
                "kvlease_sglang_messages_dropped",
                "Messages on SGLang's control sockets dropped as malformed, unknown or over a bound.",
                labels=list(_LABELS),
            ),
        }
        for labels, rt in list(self._runtimes.items()):
            fams["writes_refused"].add_metric(list(labels), float(rt.writes_refused))
            fams["rooms_failed"].add_metric(list(labels), float(rt.rooms_failed))
            fams["dropped"].add_metric(list(labels), float(rt.transport.dropped))
        yield from fams.values()


def mount(rt: LeaseRuntime, *, engine_rank: int) -> None:
    """Export `rt`'s metrics (see the module docstring). Never fails the manager's start."""
    global _stats_collector, _adapter_collector
    labels = (rt.engine_id, str(engine_rank), rt.role)
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
    port = rt.settings.metrics_port
    if port:
        try:
            start_http_server(_stats_collector, port + engine_rank)
        except OSError as exc:
            logger.warning("kvlease: metrics port %s: %s", port + engine_rank, exc)
