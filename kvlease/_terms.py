"""`LeaseTerms`: what an accessor may assume of one pinner engine's leases.

The pinner states the terms it enforces (its extension, drift bound and access-time bound) in
its handshake reply, and the extension it applied in every heartbeat ack (spec §2, §5.3, §5.6).
The accessor's validity window, push guard and heartbeat period come from the *stricter* of
those and its own configuration, so two sides with different settings (a rolling config change)
never give the accessor a window the pinner does not honour. The margin is the accessor's own.

Pure arithmetic; never reads a clock.
"""

from __future__ import annotations

import attrs

from ._config import LeaseConfig

__all__ = ["LeaseTerms"]


@attrs.frozen
class LeaseTerms:
    """The effective terms of one pinner engine at one accessor."""

    #: How far a renewal extends a lease (the smaller of the two sides'), pinner seconds.
    extension: float
    #: The drift bound (the larger of the two sides').
    max_drift_rate: float
    #: The access-time bound (the larger of the two sides'), real seconds.
    max_access_time: float
    #: The accessor's own margin.
    validity_margin: float
    #: The heartbeat period: the accessor's own, or a quarter of a shorter stated extension.
    heartbeat_interval: float
    #: `validity(extension)`, precomputed: the window an acknowledged round gives.
    accessor_extension: float
    #: `max_access_time` in a local clock (a fast clock counts more): the push guard.
    access_time_local: float

    @classmethod
    def own(cls, config: LeaseConfig) -> LeaseTerms:
        """The accessor's own terms, before a pinner stated any."""
        return cls._make(
            config.lease_extension,
            config.max_drift_rate,
            config.max_access_time,
            config.validity_margin,
            config.heartbeat_interval,
        )

    @classmethod
    def _make(cls, extension: float, rho: float, access: float, margin: float, interval: float) -> LeaseTerms:
        return cls(
            extension=extension,
            max_drift_rate=rho,
            max_access_time=access,
            validity_margin=margin,
            heartbeat_interval=interval,
            accessor_extension=((extension * (1.0 - rho)) / (1.0 + rho)) - margin,
            access_time_local=access * (1.0 + rho),
        )

    def with_pinner(self, config: LeaseConfig, extension: float, rho: float, access: float) -> LeaseTerms:
        """The stricter of `config` (the accessor's own) and a pinner's stated terms."""
        own_e = config.lease_extension
        e = min(own_e, extension)
        interval = config.heartbeat_interval if extension >= own_e else extension / 4.0
        return self._make(
            e,
            max(config.max_drift_rate, rho),
            max(config.max_access_time, access),
            config.validity_margin,
            interval,
        )

    def validity(self, ack_extension: float) -> float:
        """How long after sending a round every target acknowledged the accessor may count its
        leases valid, in its own clock: the smallest extension any ack of the round stated
        (and these terms allow), shrunk by the drift bound, less the margin (spec §6.1)."""
        if ack_extension >= self.extension:
            return self.accessor_extension
        rho = self.max_drift_rate
        return ((ack_extension * (1.0 - rho)) / (1.0 + rho)) - self.validity_margin
