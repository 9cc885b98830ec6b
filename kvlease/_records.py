"""What each side remembers of leases that are over: bounded, so memory never grows with traffic.

`Tombstones` (pinner): how each recently finished lease ended, so a late or duplicate message
about it gets a precise answer (``expired``, ``released``, ``completed``; an access-done counted
while the lease was live confirmed again) instead of ``unknown``, and never a second free.

`GivenUp` (accessor): every lease this accessor gave up (untracked, completed, lost, failed),
so its ticket is never tracked again — a message about the first tracking may still be in
flight. Past `limit` entries the oldest fall under a watermark per (pinner engine,
incarnation): tickets at or below it are refused too (ids only increase on one incarnation).

Pure bookkeeping; never reads a clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from ._events import EndReason

__all__ = ["GivenUp", "Tombstone", "Tombstones"]


class Tombstone:
    """What a finished lease leaves behind to answer late messages precisely."""

    __slots__ = ("accessor", "done", "reason", "sessions")

    def __init__(
        self, reason: EndReason, accessor: str | None, done: frozenset[int] | None, sessions: dict[int, int] | None
    ) -> None:
        self.reason = reason
        self.accessor = accessor
        self.done = done  # the accessor ranks whose access-done or release was counted
        self.sessions = sessions  # and their sessions (ACCESS_DONE only)

    def confirms(self, sender: str, rank: int, session: int) -> bool:
        """Whether an access-done from `rank` (with `session`) of `sender` is a duplicate of
        one counted while the lease was live, so it is answered OK again."""
        return (
            self.reason is EndReason.ACCESS_DONE
            and self.accessor == sender
            and self.done is not None
            and rank in self.done
            and self.sessions is not None
            and self.sessions.get(rank) == session
        )


class Tombstones:
    """The last `limit` finished leases of one pinner rank, oldest first (0: none kept)."""

    __slots__ = ("_limit", "_tombs")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._tombs: OrderedDict[int, Tombstone] = OrderedDict()

    def get(self, lease_id: int) -> Tombstone | None:
        return self._tombs.get(lease_id)

    def reason(self, lease_id: int) -> EndReason | None:
        tomb = self._tombs.get(lease_id)
        return None if tomb is None else tomb.reason

    def record(
        self,
        lease_id: int,
        reason: EndReason,
        accessor: str | None,
        done: frozenset[int] | None,
        sessions: dict[int, int] | None,
    ) -> None:
        if not self._limit:
            return
        tombs = self._tombs
        tombs[lease_id] = Tombstone(reason, accessor, done, sessions)
        if len(tombs) > self._limit:
            tombs.popitem(last=False)

    def items(self) -> Iterable[tuple[int, Tombstone]]:
        """Every tombstone kept, oldest first (for checkers that fingerprint the state)."""
        return self._tombs.items()

    def __len__(self) -> int:
        return len(self._tombs)


class GivenUp:
    """The leases one accessor rank gave up, by (pinner engine, incarnation, lease id)."""

    __slots__ = ("_floor", "_keys", "_limit")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._keys: OrderedDict[tuple[str, int, int], None] = OrderedDict()
        self._floor: dict[tuple[str, int], int] = {}

    def add(self, key: tuple[str, int, int]) -> None:
        """Remember a lease given up (the oldest past the limit fall under the watermark)."""
        keys = self._keys
        keys[key] = None
        while len(keys) > self._limit:
            (engine_id, incarnation, lease_id), _ = keys.popitem(last=False)
            fkey = (engine_id, incarnation)
            if lease_id > self._floor.get(fkey, 0):
                self._floor[fkey] = lease_id

    def __contains__(self, key: tuple[str, int, int]) -> bool:
        return key in self._keys

    def below_watermark(self, engine_id: str, incarnation: int, lease_id: int) -> bool:
        """Whether the lease is at or below the watermark: given up long ago, or never seen
        by this accessor but older than what it forgot (either way: not trackable)."""
        return lease_id <= self._floor.get((engine_id, incarnation), 0)

    def snapshot(self) -> tuple[tuple[tuple[str, int, int], ...], tuple[tuple[tuple[str, int], int], ...]]:
        """The leases remembered (oldest first) and the watermarks (for checkers)."""
        return tuple(self._keys), tuple(sorted(self._floor.items()))

    def __len__(self) -> int:
        return len(self._keys)
