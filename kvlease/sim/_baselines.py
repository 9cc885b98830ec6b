"""The baselines kvlease is compared with (not kvlease): a pinner that frees at grant plus a
fixed timeout, and vLLM-style silent heartbeats (`Policy.VLLM_HB` runs the real `Pinner` in
vllm_compat mode; the decode engine's side of it is `vllm_heartbeats`).

Owns the baseline models only; the cluster runs them exactly where it runs the real core.
"""

from __future__ import annotations

import heapq
from typing import Any

from .._clock import LocalTime
from .._events import EndReason, Free

__all__ = ["FixedTimeoutPinner"]


class FixedTimeoutPinner:
    """Baseline model (not kvlease): free at grant + T, or when `expected` read-dones came."""

    __slots__ = ("by_key", "heap", "leases", "next_id", "timeout")

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.leases: dict[int, list[Any]] = {}  # id -> [expiry, key, done, expected]
        self.by_key: dict[str, int] = {}
        self.heap: list[tuple[float, int]] = []
        self.next_id = 1

    def grant(self, now: float, key: str) -> int:
        lid = self.next_id
        self.next_id += 1
        self.leases[lid] = [now + self.timeout, key, 0]
        self.by_key[key] = lid
        heapq.heappush(self.heap, (now + self.timeout, lid))
        return lid

    def done(self, now: float, key: str, count: int) -> Free | None:
        lid = self.by_key.get(key)
        if lid is None or lid not in self.leases:
            return None
        rec = self.leases[lid]
        rec[2] += 1
        if rec[2] >= count:
            return self._end(lid, EndReason.ACCESS_DONE, now)
        return None

    def handle_timeout(self, now: float) -> list[Free]:
        out = []
        while self.heap and self.heap[0][0] <= now:
            _, lid = heapq.heappop(self.heap)
            if lid in self.leases:
                out.append(self._end(lid, EndReason.EXPIRED, now))
        return out

    def next_deadline(self) -> float | None:
        while self.heap and self.heap[0][1] not in self.leases:
            heapq.heappop(self.heap)
        return self.heap[0][0] if self.heap else None

    def _end(self, lid: int, reason: EndReason, now: float) -> Free:
        rec = self.leases.pop(lid)
        self.by_key.pop(rec[1], None)
        return Free(lid, rec[1], reason, LocalTime(now))
