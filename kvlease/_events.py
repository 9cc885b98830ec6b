"""Outputs of the state machines: small frozen values, returned in causal order.

A driver handles every output with ``match`` and ends with ``assert_never``. Nothing is kept in a
hidden outbox: what a call returns is everything it wants done.
"""

from __future__ import annotations

import enum

import attrs

from ._clock import LocalTime
from ._messages import Handshake, Message

__all__ = [
    "AccessCompleted",
    "AccessStale",
    "AccessorOutput",
    "EndReason",
    "Free",
    "HandshakeNeeded",
    "LeaseLost",
    "LostReason",
    "Output",
    "PinnerOutput",
    "Rejected",
    "Send",
]


class EndReason(enum.Enum):
    """Why a pinner's lease ended."""

    #: Every expected accessor rank reported its access done. In pull mode the memory is free
    #: to reuse; in push mode the written data is complete and belongs to the engine now.
    ACCESS_DONE = "access_done"
    #: Released before any access (by the accessor's `Release` or the local engine's abort).
    RELEASED = "released"
    #: No heartbeat extended it in time (or its fixed TTL ran out).
    EXPIRED = "expired"


class LostReason(enum.Enum):
    """Why an accessor gave a lease up. The engine must fail or recompute the request."""

    UNKNOWN = "unknown"  # the pinner never had it or forgot it (e.g. it restarted)
    EXPIRED = "expired"  # the pinner says it expired
    RELEASED = "released"  # the pinner's engine released it (its own abort)
    PINNER_RESTARTED = "pinner_restarted"  # the pinner's incarnation changed
    VALIDITY_LAPSED = "validity_lapsed"  # no acknowledgement came in time; it may be gone
    TTL_PASSED = "ttl_passed"  # a fixed-TTL lease's converted deadline passed
    UNREACHABLE = "unreachable"  # the pinner engine was declared dead by the driver
    #: A posted transfer failed: its attached access-done may still reach the pinner and end
    #: the lease, so the lease is never accessed again (a fresh lease is needed to retry).
    ACCESS_FAILED = "access_failed"
    #: The ticket is older than this accessor's memory of the leases it gave up, so it cannot
    #: tell whether it tracked it before (a fresh lease is needed).
    FORGOTTEN = "forgotten"


@attrs.frozen
class Send:
    """Send `message` to `engine_id`'s worker `rank`, or to every worker when rank is None."""

    engine_id: str
    rank: int | None
    message: Message


@attrs.frozen
class Free:
    """Pinner: the lease ended; the engine may release (or, push mode, use) `key`'s memory."""

    lease_id: int
    key: str
    reason: EndReason
    at: LocalTime


@attrs.frozen
class Rejected:
    """Pinner or accessor: a message was understood but refused (bad fields, wrong
    incarnation, a rank out of range). Nothing else was affected."""

    engine_id: str
    reason: str


@attrs.frozen
class HandshakeNeeded:
    """Accessor: a tracked request names an engine not yet connected; handshake with it
    (in the background) and pass the reply to `Accessor.handshake_reply`."""

    engine_id: str
    message: Handshake


@attrs.frozen
class LeaseLost:
    """Accessor: this request's lease is gone or can no longer be proven live. Never read it."""

    key: str
    lease_id: int
    reason: LostReason


@attrs.frozen
class AccessCompleted:
    """Accessor: the access finished while the lease was provably live: the data is valid."""

    key: str
    lease_id: int
    confirmed_by_pinner: bool


@attrs.frozen
class AccessStale:
    """Accessor: the access may have overlapped a free. Its data must not be used."""

    key: str
    lease_id: int
    reason: str


PinnerOutput = Send | Free | Rejected
AccessorOutput = Send | HandshakeNeeded | LeaseLost | AccessCompleted | AccessStale | Rejected
Output = PinnerOutput | AccessorOutput
