"""Deliberately broken cores, to show the fault campaign can fail.

Each is a factory with the simulator's `PinnerFactory` / `AccessorFactory` signature that builds
a real `Pinner` or `Accessor` from a *wrong* configuration — the kind of mistake an
implementation of the protocol could make. Used by tests and by ``kvlease sim --campaign N
--inject-bug NAME``; never by anything else. Pure, like the rest of the simulator.
"""

from __future__ import annotations

from .._accessor import Accessor
from .._config import MIN_VALIDITY_MARGIN, LeaseConfig
from .._pinner import Pinner
from ._cluster import AccessorFactory, PinnerFactory

__all__ = [
    "BUGS",
    "long_lease_pinner",
    "no_drift_margin_accessor",
    "overstated_extension_accessor",
    "short_lease_pinner",
]


def short_lease_pinner(config: LeaseConfig, engine_id: str, incarnation: int, rank: int, ranks: int) -> Pinner:
    """A pinner whose leases are 30% shorter than the accessor assumes (initial lease and
    every extension): accessors believe leases valid after the pinner freed them."""
    wrong = config.with_changes(kv_lease_duration=config.kv_lease_duration * 0.7)
    return Pinner(wrong, engine_id, incarnation, rank=rank, ranks=ranks)


def long_lease_pinner(config: LeaseConfig, engine_id: str, incarnation: int, rank: int, ranks: int) -> Pinner:
    """A pinner that holds leases 50% longer than configured: safe, but a dead accessor's
    memory outlives the liveness bound."""
    wrong = config.with_changes(kv_lease_duration=config.kv_lease_duration * 1.5)
    return Pinner(wrong, engine_id, incarnation, rank=rank, ranks=ranks)


def overstated_extension_accessor(config: LeaseConfig, engine_id: str, rank: int, ranks: int, session: int) -> Accessor:
    """An accessor that computes validity from a 10% longer extension than the pinner grants."""
    wrong = config.with_changes(kv_lease_duration=config.kv_lease_duration * 1.1)
    return Accessor(wrong, engine_id, session=session, rank=rank, ranks=ranks)


def no_drift_margin_accessor(config: LeaseConfig, engine_id: str, rank: int, ranks: int, session: int) -> Accessor:
    """An accessor whose validity omits the drift shrink and the safety margin (the classic
    lease bug: trusting that the pinner's clock runs at our rate)."""
    wrong = config.with_changes(max_drift_rate=0.0, validity_margin=MIN_VALIDITY_MARGIN)
    return Accessor(wrong, engine_id, session=session, rank=rank, ranks=ranks)


#: name -> (pinner factory, accessor factory); None keeps the real one.
BUGS: dict[str, tuple[PinnerFactory | None, AccessorFactory | None]] = {
    "short-lease": (short_lease_pinner, None),
    "long-lease": (long_lease_pinner, None),
    "overstated-extension": (None, overstated_extension_accessor),
    "no-drift-margin": (None, no_drift_margin_accessor),
}
