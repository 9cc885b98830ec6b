"""Local time, peer time, and the only way to convert between them.

`LocalTime` is a reading of this process's monotonic clock; `PeerTime` is a reading of a peer's.
They are distinct types so that comparing them is a type error. `ClockOffsetEstimator` turns
NTP-style round trips into an offset with an error bound and converts a peer's deadline into a
local one *conservatively*: never later than the true instant, whatever the clocks did within
the configured drift bound. The core never reads a clock; every reading is passed in.
"""

from __future__ import annotations

import math
from collections import deque
from typing import NewType

import attrs

from ._errors import LocalProtocolError, RemoteProtocolError

__all__ = ["MAX_TIME", "ClockOffsetEstimator", "ClockSample", "LocalTime", "OffsetEstimate", "PeerTime", "check_time"]

LocalTime = NewType("LocalTime", float)
PeerTime = NewType("PeerTime", float)

#: The largest clock reading (in magnitude) the protocol accepts: 2**32 s, 136 years. Bounding
#: times bounds float rounding: one operation on times this large errs by at most 2**-21 s
#: (~0.5 us), far below the smallest validity margin, and ``now + interval`` is always > now.
MAX_TIME = float(1 << 32)


def check_time(now: float) -> None:
    """Refuse a local clock reading the protocol cannot reason about (NaN, infinite, or beyond
    `MAX_TIME`) with `LocalProtocolError`."""
    if not -MAX_TIME <= now <= MAX_TIME:  # also false for NaN
        raise LocalProtocolError(f"clock reading {now!r} is not a finite time within +-2**32 s")


@attrs.frozen
class ClockSample:
    """One round trip: we sent at `t1` (local), the peer received at `t2` and replied at `t3`
    (peer clock), we received the reply at `t4` (local)."""

    t1: LocalTime
    t2: PeerTime
    t3: PeerTime
    t4: LocalTime

    @property
    def offset(self) -> float:
        """Estimated ``peer - local``."""
        return ((self.t2 - self.t1) + (self.t3 - self.t4)) / 2.0

    @property
    def delay(self) -> float:
        """Round-trip time not spent at the peer; the true offset is within ``delay / 2``."""
        return (self.t4 - self.t1) - (self.t3 - self.t2)


@attrs.frozen
class OffsetEstimate:
    """``peer = local + offset``, true within ``± error`` at local time `at`."""

    offset: float
    error: float
    at: LocalTime


@attrs.define
class ClockOffsetEstimator:
    """Tracks one peer's clock offset from a window of round trips (min-delay filter).

    The best sample of the window is re-chosen whenever a sample arrives, and its error bound
    grows with its age at twice the drift rate (both clocks may drift, in opposite
    directions), so a long-lived estimate never claims more precision than it has.
    """

    max_drift_rate: float
    window: int = 16
    _samples: deque[ClockSample] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._samples = deque(maxlen=self.window)

    def add_sample(self, sample: ClockSample) -> None:
        """Record a round trip. A sample whose local times run backwards is our misuse; one
        whose peer times do, or whose delay is negative beyond the drift bound, is the peer's."""
        for t in (sample.t1, sample.t2, sample.t3, sample.t4):
            if not math.isfinite(t):
                raise RemoteProtocolError(f"clock sample has a non-finite time: {sample!r}")
        if sample.t4 < sample.t1:
            raise LocalProtocolError(f"clock sample received (t4={sample.t4}) before sent (t1={sample.t1})")
        if sample.t3 < sample.t2:
            raise RemoteProtocolError(f"peer replied (t3={sample.t3}) before it received (t2={sample.t2})")
        if self._samples and sample.t4 < self._samples[-1].t4:
            raise LocalProtocolError("clock samples must be added in local receive order")
        self._samples.append(sample)

    @property
    def sample_count(self) -> int:
        return len(self._samples)

    def estimate(self, now: LocalTime) -> OffsetEstimate | None:
        """The tightest bound over the window at `now`, or None before any sample."""
        best: OffsetEstimate | None = None
        rho = self.max_drift_rate
        # Drift since the sample: per second of *our* clock the offset moves by up to
        # (rate_peer - rate_ours) / rate_ours <= 2 rho / (1 - rho) (peer fast, we slow).
        growth = 2.0 * rho / (1.0 - rho)
        for s in self._samples:
            err = max(s.delay, 0.0) / 2.0 + growth * max(now - s.t1, 0.0)
            if best is None or err < best.error:
                best = OffsetEstimate(offset=s.offset, error=err, at=now)
        return best

    def to_local_deadline(self, now: LocalTime, peer_now_deadline: PeerTime) -> LocalTime | None:
        """The earliest local instant at which the peer's clock may read `peer_now_deadline`.

        Offset and error bound are both taken against us, and the remaining interval is
        shrunk for the worst rate difference, so the result is never later than the truth.
        None if there is no sample yet (the caller must treat the deadline as unknown).
        """
        est = self.estimate(now)
        if est is None:
            return None
        peer_now_latest = now + est.offset + est.error
        remaining_peer = peer_now_deadline - peer_now_latest
        rho = self.max_drift_rate
        if remaining_peer <= 0.0:
            # Already past: it happened at least this long ago in our clock (we may run fast
            # and the peer slow), so stretch the interval rather than shrink it.
            return LocalTime(now + remaining_peer * (1.0 + rho) / (1.0 - rho))
        return LocalTime(now + remaining_peer * (1.0 - rho) / (1.0 + rho))
