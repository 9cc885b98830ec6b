"""kvlease.transports: the driver that pumps the kvlease core, and the transports it drives.

This package owns the I/O shell around the pure core: `Driver` (the only place kvlease reads a
clock), the `Transport` contract every transport implements (`_base`), and the counters
(`TransportStats`). Concrete transports load only when imported, behind extras:
``kvlease.transports.zmq`` (extra ``zmq``) and the NIXL transport (extra ``nixl``).
Nothing here holds protocol logic; that is the core's.
"""

from ._base import (
    HandshakeEvent,
    HandshakeFailed,
    HandshakeRequest,
    HandshakeResponse,
    Inbound,
    PeerDead,
    PeerSuspect,
    PeerUnreachable,
    Pollable,
    TransferFailed,
    TransferResult,
    Transport,
)
from ._driver import Driver, DriverEvent, load_frame_auth, new_session
from ._stats import TransportStats

__all__ = [
    "Driver",
    "DriverEvent",
    "HandshakeEvent",
    "HandshakeFailed",
    "HandshakeRequest",
    "HandshakeResponse",
    "Inbound",
    "PeerDead",
    "PeerSuspect",
    "PeerUnreachable",
    "Pollable",
    "TransferFailed",
    "TransferResult",
    "Transport",
    "TransportStats",
    "load_frame_auth",
    "new_session",
]
