"""Heterogeneous tensor parallelism: which pinner ranks one accessor rank accesses.

One pure function, used by the accessor (where to heartbeat, notify and release), the pinner
(which accessor ranks may speak for a lease held by this rank, and how many must report) and
the simulator and drivers. The layout is vLLM's: with ``p`` pinner ranks and ``a`` accessor
ranks, one of them must divide the other.

* ``p >= a``: accessor rank ``r`` accesses the ``k = p / a`` pinner ranks
  ``[r k, (r + 1) k)``, and each pinner rank hears from exactly one accessor rank.
* ``p < a``: accessor rank ``r`` accesses pinner rank ``r // k`` with ``k = a / p``, and each
  pinner rank hears from ``k`` accessor ranks.
"""

from __future__ import annotations

import attrs

from ._errors import LocalProtocolError

__all__ = ["MAX_RANKS", "TpLayout", "accesses", "layout_error", "tp_layout"]

#: The largest tensor-parallel size (ranks of one engine) the protocol carries.
MAX_RANKS = 1 << 16


@attrs.frozen
class TpLayout:
    """What one accessor rank does against one pinner engine."""

    #: Pinner ranks this accessor rank accesses, heartbeats, notifies and releases.
    targets: range
    #: How many accessor ranks each of those pinner ranks must hear from before a lease ends.
    expected: int


def layout_error(pinner_ranks: int, accessor_ranks: int, accessor_rank: int) -> str | None:
    """Why this combination has no layout, or None if it has one."""
    p, a, r = pinner_ranks, accessor_ranks, accessor_rank
    if not 1 <= p <= MAX_RANKS or not 1 <= a <= MAX_RANKS:
        return f"ranks must be in [1, {MAX_RANKS}], got pinner {p} and accessor {a}"
    if not 0 <= r < a:
        return f"accessor rank {r} is outside its {a} ranks"
    if p % a and a % p:
        return f"uneven tensor parallelism: {p} pinner ranks and {a} accessor ranks (one must divide the other)"
    return None


def tp_layout(pinner_ranks: int, accessor_ranks: int, accessor_rank: int) -> TpLayout:
    """The pinner ranks accessor rank `accessor_rank` accesses, and the `expected` count.

    Raises `LocalProtocolError` when the ranks have no layout (see `layout_error`).
    """
    why = layout_error(pinner_ranks, accessor_ranks, accessor_rank)
    if why is not None:
        raise LocalProtocolError(why)
    p, a, r = pinner_ranks, accessor_ranks, accessor_rank
    if p >= a:
        k = p // a
        return TpLayout(range(r * k, (r + 1) * k), 1)
    k = a // p
    return TpLayout(range(r // k, r // k + 1), k)


def accesses(pinner_ranks: int, pinner_rank: int, accessor_ranks: int, accessor_rank: int) -> bool:
    """Whether accessor rank `accessor_rank` accesses pinner rank `pinner_rank` (no layout: False)."""
    if layout_error(pinner_ranks, accessor_ranks, accessor_rank) is not None:
        return False
    return pinner_rank in tp_layout(pinner_ranks, accessor_ranks, accessor_rank).targets
