"""Prometheus export of a driver's `TransportStats`: a collector an engine adapter can mount.

`LeaseStatsCollector` reads one or more `TransportStats` objects at scrape time (no background
thread, no copy kept in between) and yields metric families named after Prometheus conventions:
``kvlease_`` prefix, base units (bytes, seconds), ``_total`` on counters, one label set per
driver (``engine_id``, ``rank``, plus whatever the caller adds). The heartbeat round-trip
histogram is cumulative: samples are folded into fixed buckets as they appear in the stats'
sample window, so it never goes backwards between scrapes.

`start_http_server` serves a registry holding such a collector on 127.0.0.1 by default.

This is the only kvlease module that imports ``prometheus_client`` (the ``metrics`` extra). It
owns no lease logic, reads no clock, and never mutates the stats it exports.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client import start_http_server as _prom_start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from ._stats import TransportStats

__all__ = ["RTT_BUCKETS", "LeaseStatsCollector", "start_http_server"]

#: Heartbeat round-trip buckets, seconds: loopback NIXL is ~50 us, a loaded TCP hop ~10 ms,
#: and a round trip anywhere near the heartbeat interval (seconds) is a problem worth seeing.
RTT_BUCKETS: tuple[float, ...] = (
    25e-6,
    50e-6,
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    50e-3,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)

#: (metric name without prefix/suffix, stats field, help). Counters get ``_total``.
_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("leases_granted", "leases_granted", "Leases granted by the pinner."),
    ("leases_renewed", "leases_renewed", "Lease renewals by heartbeats, counted per lease id."),
    ("leases_released", "leases_released", "Leases released before any access."),
    ("leases_completed", "leases_completed", "Leases ended because every accessor rank reported its access done."),
    ("leases_expired", "leases_expired", "Leases that expired without a heartbeat in time: memory reclaimed."),
    ("leases_lost", "leases_lost", "Leases the accessor gave up (expired, unknown, unreachable pinner)."),
    ("stale_reads_caught", "stale_reads_caught", "Accesses reported stale instead of handing reused KV to the engine."),
    ("accesses_completed", "accesses_completed", "Accesses that completed while their lease was provably live."),
    (
        "accesses_confirmed",
        "accesses_confirmed",
        "Of the completed accesses, those that waited for the pinner's confirmation (one more round trip).",
    ),
    ("heartbeats_sent", "heartbeats_sent", "Heartbeat messages sent by the accessor."),
    ("heartbeats_received", "heartbeats_received", "Heartbeat messages handled by the pinner."),
    ("heartbeats_rejected", "heartbeats_rejected", "Lease ids in heartbeats that the pinner did not renew."),
    ("heartbeat_acks_received", "heartbeat_acks_received", "Heartbeat acknowledgements received by the accessor."),
    ("handshakes_sent", "handshakes_sent", "Handshakes the accessor started."),
    ("handshakes_answered", "handshakes_answered", "Handshakes the pinner answered."),
    ("malformed_messages", "malformed_messages", "Undecodable or protocol-breaking messages dropped."),
    ("rejected_messages", "rejected_messages", "Messages understood but refused by the core."),
    ("peer_send_failures", "peer_send_failures", "Sends that failed at the transport (a hint that a peer is gone)."),
    ("peers_dead", "peers_dead", "Peer engines disconnected after their engine TTL."),
    ("transfers_ok", "transfers_ok", "KV transfers (READ/WRITE) that completed at the transport."),
    ("transfers_failed", "transfers_failed", "KV transfers that failed at the transport."),
    ("transferred_bytes", "bytes_transferred", "Bytes moved by completed KV transfers."),
)


class _RttFold:
    """Folds a stats object's bounded window of RTT samples into cumulative buckets."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.bounds = list(buckets)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0
        self.sum = 0.0
        self._seen_len = 0
        self._seen_acks = 0

    def update(self, stats: TransportStats) -> None:
        samples = stats.rtt_samples
        n = len(samples)
        acks = stats.heartbeat_acks_received
        maxlen = samples.maxlen
        # Once the window is full its length no longer grows: one sample is recorded per
        # acknowledged heartbeat, so the acks counted since the last scrape say how many of
        # the newest samples are new.
        full = maxlen is not None and n >= maxlen
        new = min(n, max(acks - self._seen_acks, 0)) if full else n - self._seen_len
        if new < 0:  # the window shrank: the stats object was reset or replaced
            new = n
        self._seen_len = n
        self._seen_acks = acks
        if new <= 0:
            return
        for v in list(samples)[n - new :]:
            self.counts[bisect.bisect_left(self.bounds, v)] += 1
            self.total += 1
            self.sum += v


class LeaseStatsCollector(Collector):
    """Exports `TransportStats` objects, each under its own label values.

    `sources` maps a tuple of label values (in the order of `label_names`) to the stats of
    one driver, e.g. ``{("prefill-0", "0"): stats}`` with ``label_names=("engine_id", "rank")``.
    Add or replace sources later with `set_source` (thread-safe against scrapes).
    """

    def __init__(
        self,
        sources: Mapping[tuple[str, ...], TransportStats] | None = None,
        *,
        label_names: Sequence[str] = ("engine_id", "rank"),
        rtt_buckets: Sequence[float] = RTT_BUCKETS,
    ) -> None:
        self.label_names = tuple(label_names)
        self._buckets = tuple(rtt_buckets)
        self._lock = threading.Lock()
        self._sources: dict[tuple[str, ...], TransportStats] = {}
        self._folds: dict[tuple[str, ...], _RttFold] = {}
        for labels, stats in (sources or {}).items():
            self.set_source(labels, stats)

    def set_source(self, labels: tuple[str, ...], stats: TransportStats) -> None:
        if len(labels) != len(self.label_names):
            raise ValueError(f"expected label values for {self.label_names}, got {labels!r}")
        with self._lock:
            if self._sources.get(labels) is not stats:
                self._sources[labels] = stats
                self._folds.setdefault(labels, _RttFold(self._buckets))

    def describe(self) -> Iterable[Any]:
        return ()  # families are known only at collect time; the registry then skips checks

    def collect(self) -> Iterator[Any]:
        with self._lock:
            items = list(self._sources.items())
            for labels, stats in items:
                self._folds[labels].update(stats)
            folds = {labels: self._folds[labels] for labels, _ in items}
        names = list(self.label_names)
        active = GaugeMetricFamily(
            "kvlease_leases_active", "Leases the pinner holds now (granted and not yet ended).", labels=names
        )
        pinned = GaugeMetricFamily("kvlease_pinned_bytes", "Bytes pinned under live leases.", labels=names)
        for labels, s in items:
            live = s.leases_granted - s.leases_released - s.leases_completed - s.leases_expired
            active.add_metric(list(labels), max(live, 0))
            pinned.add_metric(list(labels), s.bytes_pinned)
        yield active
        yield pinned
        for name, field, help_text in _COUNTERS:
            fam = CounterMetricFamily(f"kvlease_{name}", help_text, labels=names)
            for labels, s in items:
                fam.add_metric(list(labels), float(getattr(s, field)))
            yield fam
        rtt = HistogramMetricFamily(
            "kvlease_heartbeat_rtt_seconds", "Heartbeat round trip, send to acknowledgement, seconds.", labels=names
        )
        for labels, _ in items:
            fold = folds[labels]
            cumulative = 0
            buckets: list[tuple[str, float]] = []
            for bound, count in zip([*fold.bounds, float("inf")], fold.counts, strict=True):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), float(cumulative)))
            rtt.add_metric(list(labels), buckets, fold.sum)
        yield rtt


def start_http_server(
    collector: LeaseStatsCollector, port: int, addr: str = "127.0.0.1"
) -> tuple[CollectorRegistry, Any]:
    """Serve `collector` on ``http://addr:port/metrics`` from a daemon thread (own registry,
    so the process's default metrics do not mix in). Returns the registry and the server,
    whose ``shutdown()`` stops it. Port 0 picks a free port: read it from
    ``server.server_address``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server, _thread = _prom_start_http_server(port, addr=addr, registry=registry)
    return registry, server
