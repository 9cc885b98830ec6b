"""The holes `kvlease check --inject-bug NAME` reopens, one fix switched off each (the doubles:
`kvlease._doubles`, subclasses of the real core that override the private method implementing
one fix). The v1 unbound-replies hole is split in two here, so each is found on its own:
handshake replies, and acks (with v1's per-connection seq that restarts at a disconnect)."""

from __future__ import annotations

from collections.abc import Callable

from .._accessor import Accessor
from .._doubles import (
    ForgetfulAccessor,
    NoBindingPinner,
    NoRankCheckPinner,
    RenewAtExpiryPinner,
    RetryAfterPostedFailureAccessor,
    UnboundAckAccessor,
    UnboundHandshakeAccessor,
    no_drift_margin_accessor,
)
from .._pinner import Pinner

__all__ = ["CHECK_BUGS"]


#: name -> (pinner class, accessor class or factory, the hole it reopens)
CHECK_BUGS: dict[str, tuple[Callable[..., Pinner], Callable[..., Accessor], str]] = {
    "retrack": (Pinner, ForgetfulAccessor, "re-track of a given-up ticket accepted"),
    "wrong-rank": (
        NoRankCheckPinner,
        Accessor,
        "access-done / release from an accessor rank that does not access this pinner rank counted",
    ),
    "unbound-handshake": (Pinner, UnboundHandshakeAccessor, "handshake reply not bound to the handshake it answers"),
    "unbound-ack": (Pinner, UnboundAckAccessor, "ack not bound to rank/session; seq reused after a disconnect"),
    "retry-failed-transfer": (Pinner, RetryAfterPostedFailureAccessor, "retry after a posted failed transfer"),
    "renew-at-expiry": (RenewAtExpiryPinner, Accessor, "a message handled at expiry renews / completes the lease"),
    "no-margin": (Pinner, no_drift_margin_accessor, "validity without the drift shrink and margin"),
    "no-binding": (NoBindingPinner, Accessor, "leases not bound to the accessor that first spoke for them"),
}
