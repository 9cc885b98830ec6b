"""`TransportStats`: the counters a driver keeps, for the demo and adapters to export.

A plain mutable attrs object updated by the driver (single-threaded, from its step); exporters
read `snapshot()`. It owns no logic and never reads a clock: heartbeat round-trip samples are
handed to it by the driver.
"""

from __future__ import annotations

from collections import deque

import attrs

__all__ = ["TransportStats"]

_RTT_WINDOW = 4096


@attrs.define
class TransportStats:
    """Monotone counters (plus the `bytes_pinned` gauge) of one driver."""

    #: Pinner side.
    leases_granted: int = 0
    leases_renewed: int = 0  # per lease id renewed by a heartbeat
    leases_released: int = 0
    leases_completed: int = 0  # ended by access-done
    leases_expired: int = 0
    bytes_pinned: int = 0  # gauge: bytes under live leases granted with `nbytes`
    heartbeats_received: int = 0
    heartbeats_rejected: int = 0  # heartbeat ids the pinner did not renew (unknown/expired/...)
    #: Accessor side.
    leases_lost: int = 0
    stale_reads_caught: int = 0  # accesses reported stale instead of valid
    accesses_completed: int = 0
    #: Of those, completed only on the pinner's confirmation: no acknowledged validity window
    #: covered the access, so its completion waited one more round trip.
    accesses_confirmed: int = 0
    heartbeats_sent: int = 0
    heartbeat_acks_received: int = 0
    handshakes_sent: int = 0
    #: Both.
    handshakes_answered: int = 0
    malformed_messages: int = 0  # undecodable or protocol-breaking input, dropped
    unauthenticated_messages: int = 0  # unsealed, wrongly keyed or unauthenticatable input, dropped
    rejected_messages: int = 0  # understood but refused by the core (`Rejected` outputs)
    peer_send_failures: int = 0  # `PeerUnreachable` hints
    peers_dead: int = 0  # engines disconnected after their engine TTL
    transfers_ok: int = 0
    transfers_failed: int = 0
    bytes_transferred: int = 0
    #: Heartbeat round trips (send to ack, local clock), seconds; the latest samples only.
    rtt_samples: deque[float] = attrs.field(factory=lambda: deque(maxlen=_RTT_WINDOW))

    def record_rtt(self, seconds: float) -> None:
        self.rtt_samples.append(seconds)

    def rtt_quantile(self, q: float) -> float | None:
        """The `q` quantile (0..1) of the recent round trips, or None without samples."""
        if not self.rtt_samples:
            return None
        ordered = sorted(self.rtt_samples)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def snapshot(self) -> dict[str, float]:
        """Every counter by name, plus ``heartbeat_rtt_p50`` / ``_p99`` / ``_count``."""
        out: dict[str, float] = {
            f.name: getattr(self, f.name) for f in attrs.fields(type(self)) if f.name != "rtt_samples"
        }
        out["heartbeat_rtt_count"] = len(self.rtt_samples)
        for name, q in (("heartbeat_rtt_p50", 0.5), ("heartbeat_rtt_p99", 0.99)):
            v = self.rtt_quantile(q)
            if v is not None:
                out[name] = v
        return out
