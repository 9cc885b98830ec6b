"""The simulator's registry of broken cores, for ``kvlease sim --campaign N --inject-bug NAME``
and the tests (the doubles themselves: `kvlease._doubles`)."""

from __future__ import annotations

from .._accessor import Accessor
from .._config import LeaseConfig
from .._doubles import (
    ChunkBoundAccessor,
    ForgetfulAccessor,
    NoAckBudgetPinner,
    NoBindingPinner,
    NoRankCheckPinner,
    NoToRankPinner,
    OwnTermsAccessor,
    PostedReleaseFreesPinner,
    RenewAtExpiryPinner,
    RetryAfterPostedFailureAccessor,
    UnboundRepliesAccessor,
    long_lease_pinner,
    no_drift_margin_accessor,
    overstated_extension_accessor,
    short_lease_pinner,
)
from .._pinner import Pinner
from ._kernel import AccessorFactory, PinnerFactory

__all__ = ["BUGS"]


def _pinner(cls: type[Pinner]) -> PinnerFactory:
    def factory(config: LeaseConfig, engine_id: str, incarnation: int, rank: int, ranks: int) -> Pinner:
        return cls(config, engine_id, incarnation, rank=rank, ranks=ranks)

    return factory


def _accessor(cls: type[Accessor]) -> AccessorFactory:
    def factory(config: LeaseConfig, engine_id: str, rank: int, ranks: int, session: int) -> Accessor:
        return cls(config, engine_id, session=session, rank=rank, ranks=ranks)

    return factory


#: name -> (pinner factory, accessor factory); None keeps the real one.
BUGS: dict[str, tuple[PinnerFactory | None, AccessorFactory | None]] = {
    "short-lease": (short_lease_pinner, None),
    "long-lease": (long_lease_pinner, None),
    "overstated-extension": (None, overstated_extension_accessor),
    "no-drift-margin": (None, no_drift_margin_accessor),
    # Protocol v1 behaviour, caught by the API-level adversity:
    "retrack-accepted": (None, _accessor(ForgetfulAccessor)),
    "unbound-replies": (None, _accessor(UnboundRepliesAccessor)),
    "retry-posted-failure": (None, _accessor(RetryAfterPostedFailureAccessor)),
    "no-rank-check": (_pinner(NoRankCheckPinner), None),
    "no-binding": (_pinner(NoBindingPinner), None),
    "renew-at-expiry": (_pinner(RenewAtExpiryPinner), None),
    # Protocol v2 behaviour, caught by the v3 fault models (rolling config change, late posted
    # writes, misdelivered parts, frames at the bound, many rounds per round trip):
    "own-terms": (None, _accessor(OwnTermsAccessor)),
    "posted-release-frees": (_pinner(PostedReleaseFreesPinner), None),
    "no-to-rank": (_pinner(NoToRankPinner), None),
    "no-ack-budget": (_pinner(NoAckBudgetPinner), None),
    "chunk-bound": (None, _accessor(ChunkBoundAccessor)),
}
