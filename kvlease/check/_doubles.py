"""The v1 holes, one fix switched off each, for `kvlease check --inject-bug NAME` and the tests.

Most are the simulator's doubles (`kvlease.sim._doubles`: subclasses of the real core that
override the private method implementing one v2 fix). The unbound-replies double is split in
two here, so each hole is found on its own: handshake replies, and acks (with v1's
per-connection seq that restarts at a disconnect). Never used by anything but checks and tests.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from .._accessor import Accessor
from .._clock import LocalTime
from .._events import AccessorOutput
from .._messages import AccessDoneAck, HeartbeatAck, Message
from .._pinner import Pinner
from ..sim._doubles import (
    ForgetfulAccessor,
    NoBindingPinner,
    NoRankCheckPinner,
    RenewAtExpiryPinner,
    RetryAfterPostedFailureAccessor,
    UnboundHandshakeAccessor,
    no_drift_margin_accessor,
)

__all__ = ["CHECK_BUGS", "UnboundAckAccessor", "UnboundHandshakeAccessor"]


class UnboundAckAccessor(Accessor):
    """v1: an ack or verdict counts on its seq and echoed time alone, whoever it was meant
    for, and the seq restarts at 1 per connection (so an ack from before a disconnect can
    answer a heartbeat after it)."""

    def receive(self, now: LocalTime, message: Message) -> tuple[AccessorOutput, ...]:
        if isinstance(message, HeartbeatAck | AccessDoneAck):
            message = attrs.evolve(message, to_rank=self.rank, to_session=self.session)
        return super().receive(now, message)

    def disconnect(self, now: LocalTime, engine_id: str) -> tuple[AccessorOutput, ...]:
        self._seq = 0
        return super().disconnect(now, engine_id)


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
