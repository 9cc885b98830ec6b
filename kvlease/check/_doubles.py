"""The holes `kvlease check --inject-bug NAME` reopens, one fix switched off each (the doubles:
`kvlease._doubles`, subclasses of the real core that override the private method implementing
one fix). The v1 unbound-replies hole is split in two here, so each is found on its own:
handshake replies, and acks (with v1's per-connection seq that restarts at a disconnect).
The v3 holes (v2 behaviour) need a scope that models their deployment: `own-terms` an accessor
configured apart (`Scope.accessor_config`, `--accessor-lease`), `no-to-rank` pinner TP above
accessor TP, `chunk-bound` a small frame or outstanding bound (`--max-outstanding`,
`--max-message-bytes`); `BUG_HINTS` gives the command-line flags of a scope that finds each.
A bug has one name in `kvlease check` and `kvlease sim` (`kvlease.sim.BUGS`) alike;
`RENAMED_BUGS` maps this registry's earlier names to them."""

from __future__ import annotations

from collections.abc import Callable

from .._accessor import Accessor
from .._doubles import (
    ChunkBoundAccessor,
    ForgetfulAccessor,
    LateCoverIgnoresFinishAccessor,
    NoAckBudgetPinner,
    NoBindingPinner,
    NoRankCheckPinner,
    NoToRankPinner,
    OwnTermsAccessor,
    PostedReleaseFreesPinner,
    RenewAtExpiryPinner,
    RetryAfterPostedFailureAccessor,
    UnboundAckAccessor,
    UnboundHandshakeAccessor,
    UnretiredHandshakeAccessor,
    no_drift_margin_accessor,
)
from .._pinner import Pinner

__all__ = ["BUG_HINTS", "CHECK_BUGS", "RENAMED_BUGS"]


#: name -> (pinner class, accessor class or factory, the hole it reopens)
CHECK_BUGS: dict[str, tuple[Callable[..., Pinner], Callable[..., Accessor], str]] = {
    "retrack-accepted": (Pinner, ForgetfulAccessor, "re-track of a given-up ticket accepted"),
    "no-rank-check": (
        NoRankCheckPinner,
        Accessor,
        "access-done / release from an accessor rank that does not access this pinner rank counted",
    ),
    "unbound-handshake": (Pinner, UnboundHandshakeAccessor, "handshake reply not bound to the handshake it answers"),
    "unbound-ack": (Pinner, UnboundAckAccessor, "ack not bound to rank/session; seq reused after a disconnect"),
    "retry-posted-failure": (Pinner, RetryAfterPostedFailureAccessor, "retry after a posted failed transfer"),
    "renew-at-expiry": (RenewAtExpiryPinner, Accessor, "a message handled at expiry renews / completes the lease"),
    "no-drift-margin": (Pinner, no_drift_margin_accessor, "validity without the drift shrink and margin"),
    "no-binding": (NoBindingPinner, Accessor, "leases not bound to the accessor that first spoke for them"),
    # v2 behaviour, one v3 fix off each
    "own-terms": (Pinner, OwnTermsAccessor, "validity from the accessor's own config, not the pinner's stated terms"),
    "posted-release-frees": (PostedReleaseFreesPinner, Accessor, "a posted Release of a push lease frees at once"),
    "no-to-rank": (NoToRankPinner, Accessor, "an access-done counted at a sibling rank it does not name (to_rank)"),
    "no-ack-budget": (NoAckBudgetPinner, Accessor, "a heartbeat whose ack exceeds the frame bound is answered"),
    "chunk-bound": (Pinner, ChunkBoundAccessor, "outstanding heartbeats bounded by chunks, not rounds"),
    "unretired-handshake": (
        Pinner,
        UnretiredHandshakeAccessor,
        "a handshake sent before the pinner restarted decides a new incarnation's lease",
    ),
    # a rule added within v3, broken the tempting way
    "late-cover-ignores-finish": (
        Pinner,
        LateCoverIgnoresFinishAccessor,
        "a late ack completes a CONFIRMING access whether or not its window covers the finish",
    ),
}

#: earlier name -> name: `kvlease check --inject-bug` accepts these (deprecated) for the name
#: that `kvlease sim --inject-bug` uses for the same double.
RENAMED_BUGS: dict[str, str] = {
    "retrack": "retrack-accepted",
    "wrong-rank": "no-rank-check",
    "retry-failed-transfer": "retry-posted-failure",
    "no-margin": "no-drift-margin",
    "posted-release": "posted-release-frees",
    "wrong-part": "no-to-rank",
    "rounds": "chunk-bound",
}

_LEAVE_OUT = "drop,cross,dup,misroute,replay,release,untrack,retrack,disconnect,bigbeat"

#: name -> `kvlease check` flags of a narrow scope that finds it (the v3 holes need a deployment).
BUG_HINTS: dict[str, str] = {
    "own-terms": "--accessor-lease 9 --depth 8 --without " + _LEAVE_OUT + ",begin,finish,fail,part",
    "posted-release-frees": "--kinds push --depth 10 --without " + _LEAVE_OUT + ",finish,advance,part",
    "no-to-rank": "-p 2 --depth 11 --without " + _LEAVE_OUT.replace(",misroute", "") + ",fail,advance",
    "no-ack-budget": "--depth 1",
    "chunk-bound": "--max-outstanding 1 --leases 2 --depth 10 --without "
    + _LEAVE_OUT
    + ",begin,finish,fail,advance,part",
    "unretired-handshake": "--restarts 1 --leases 2 --depth 8 --without "
    + _LEAVE_OUT.replace(",release", "")
    + ",begin,finish,fail,advance,part",
    "late-cover-ignores-finish": "--depth 11 --without " + _LEAVE_OUT + ",fail,part",
}
