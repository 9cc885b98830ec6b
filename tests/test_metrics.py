"""The Prometheus exporter, scraped over HTTP for real.

One test scrapes the endpoint of a running `kvlease demo --metrics-port` (two real processes
on loopback) and checks that the exposition parses and counts what happened; the others pin
the exporter's own contract (names, labels, a cumulative RTT histogram) over a stats object.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import urllib.request

import pytest
from kvlease.transports._stats import TransportStats
from kvlease.transports.metrics import LeaseStatsCollector, start_http_server
from ports import free_port
from prometheus_client.parser import text_string_to_metric_families


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, role: str) -> float | None:
    for (n, labels), v in samples.items():
        if n == name and ("role", role) in labels:
            return v
    return None


@pytest.mark.slow
def test_scrape_during_demo_counts_what_happened() -> None:
    port = free_port()
    requests = 5
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvlease",
            "demo",
            "--json",
            "--scenario",
            "overload",
            "--requests",
            str(requests),
            "--metrics-port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    scrapes = []
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                scrapes.append(scrape(port))
            time.sleep(0.1)
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert scrapes, "the metrics endpoint never answered"

    def peak(name: str, role: str) -> float:
        return max((value(s, name, role) or 0.0) for s in scrapes)

    # Every lease was granted and, while D queued them, held: active and pinned, never expired.
    assert peak("kvlease_leases_granted_total", "pinner") == requests
    assert peak("kvlease_leases_active", "pinner") == requests
    assert peak("kvlease_pinned_bytes", "pinner") == requests * 16 * 4096
    assert peak("kvlease_leases_expired_total", "pinner") == 0
    assert peak("kvlease_leases_lost_total", "accessor") == 0
    # Heartbeats flowed both ways and their round trips landed in the histogram.
    sent = peak("kvlease_heartbeats_sent_total", "accessor")
    assert sent >= 3
    assert peak("kvlease_heartbeats_received_total", "pinner") >= 3
    assert peak("kvlease_leases_renewed_total", "pinner") >= 3 * requests
    assert peak("kvlease_heartbeat_rtt_seconds_count", "accessor") >= 1
    # Counters never went backwards between scrapes.
    series = [value(s, "kvlease_heartbeats_sent_total", "accessor") or 0.0 for s in scrapes]
    assert series == sorted(series)


def test_exporter_names_labels_and_cumulative_histogram() -> None:
    stats = TransportStats()
    collector = LeaseStatsCollector({("prefill-0", "0"): stats})
    _, server = start_http_server(collector, 0)
    port = server.server_address[1]
    try:
        stats.leases_granted = 4
        stats.leases_completed = 1
        stats.leases_expired = 1
        stats.bytes_pinned = 8192
        for rtt in (40e-6, 3e-3, 0.2):
            stats.record_rtt(rtt)
            stats.heartbeat_acks_received += 1
        first = scrape(port)
        labels = (("engine_id", "prefill-0"), ("rank", "0"))
        assert first[("kvlease_leases_active", labels)] == 2
        assert first[("kvlease_pinned_bytes", labels)] == 8192
        assert first[("kvlease_leases_expired_total", labels)] == 1
        assert first[("kvlease_heartbeat_rtt_seconds_count", labels)] == 3
        assert first[("kvlease_heartbeat_rtt_seconds_bucket", (*labels[:1], ("le", "5e-05"), labels[1]))] == 1
        # A window that drops old samples must not make the histogram go backwards.
        stats.rtt_samples.clear()
        stats.record_rtt(1e-3)
        stats.heartbeat_acks_received += 1
        second = scrape(port)
        assert second[("kvlease_heartbeat_rtt_seconds_count", labels)] >= 3
    finally:
        server.shutdown()
