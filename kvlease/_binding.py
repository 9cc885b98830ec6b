"""Lease binding (spec §5.2): whom a live lease speaks for, and which heartbeats may extend it.

The first accessor to speak for a lease (a renewing heartbeat, an access-done or a release) —
its engine, and for each of its ranks that rank's session — is bound to it; nobody else may
renew or end it. A heartbeat extends the lease only if its seq is newer than every heartbeat
of the same session that already did, so a replayed or reordered frame extends nothing.

The record lives in the lease's own slots (`accessor`, `b_rank`, `b_session`, `b_seq`, and
`more` for further accessor ranks: rank -> [session, seq]) — one pinner rank usually serves one
accessor rank, and a slot costs no allocation per lease. These functions are its only readers
and writers, except the pinner's renewal loop, which inlines the first bind (its hot path).
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["Bound", "bind", "bound_elsewhere", "fresh_renewal", "sessions"]


class Bound(Protocol):
    """The binding slots of a lease."""

    accessor: str | None
    b_rank: int
    b_session: int
    b_seq: int
    more: dict[int, list[int]] | None


def bound_elsewhere(lease: Bound, engine_id: str, rank: int, session: int) -> bool:
    """Whether the lease speaks for another accessor (engine, or session of this rank)."""
    if lease.accessor is not None and lease.accessor != engine_id:
        return True
    if lease.b_rank == rank:
        return lease.b_session != session
    more = lease.more
    return more is not None and rank in more and more[rank][0] != session


def bind(lease: Bound, engine_id: str, rank: int, session: int) -> None:
    """Bind `rank` of `engine_id` (with `session`) to the lease, if not bound yet."""
    lease.accessor = engine_id
    if lease.b_rank < 0:
        lease.b_rank, lease.b_session, lease.b_seq = rank, session, 0
    elif lease.b_rank != rank:
        if lease.more is None:
            lease.more = {}
        lease.more.setdefault(rank, [session, 0])


def fresh_renewal(lease: Bound, rank: int, seq: int | None) -> bool:
    """Whether a heartbeat with `seq` from the bound `rank` may extend the lease (newer than
    any that did), recording it. None: no seq (vLLM compat), always fresh."""
    if seq is None:
        return True
    if lease.b_rank == rank:
        if seq <= lease.b_seq:
            return False
        lease.b_seq = seq
        return True
    assert lease.more is not None
    entry = lease.more[rank]
    if seq <= entry[1]:
        return False
    entry[1] = seq
    return True


def sessions(lease: Bound) -> dict[int, int]:
    """Each bound accessor rank's session."""
    out = {} if lease.b_rank < 0 else {lease.b_rank: lease.b_session}
    if lease.more:
        out.update((r, v[0]) for r, v in lease.more.items())
    return out
