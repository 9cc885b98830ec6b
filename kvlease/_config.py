"""`LeaseConfig`: the one validated, frozen configuration object of the core.

Derived timing values (heartbeat interval, lease extension, the accessor's conservative
validity) are properties, so they can never disagree with the fields they come from.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import attrs

from ._errors import ConfigError

__all__ = ["MIN_ACCESS_TIME", "MIN_MESSAGE_BYTES", "MIN_VALIDITY_MARGIN", "LeaseConfig"]

#: The smallest `validity_margin`, seconds (see the field).
MIN_VALIDITY_MARGIN = 1e-3
#: The smallest `max_access_time`, seconds: with 0 the push guard is empty (a WRITE approved at
#: ``now == valid_until``) and the quarantine keeps nothing, so no access bound is meaningful.
MIN_ACCESS_TIME = 1e-3
#: The smallest `max_message_bytes`: a heartbeat chunk and the ack answering it, with short
#: engine ids, still fit under the ~256-byte notification cap of some NIXL backends.
MIN_MESSAGE_BYTES = 192


def _finite_range(lo: float, hi: float, *, lo_open: bool = False) -> Any:
    def check(inst: object, attribute: attrs.Attribute[float], value: float) -> None:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if ok:
            ok = (value > lo if lo_open else value >= lo) and value <= hi
        if not ok:
            bracket = "(" if lo_open else "["
            raise ConfigError(attribute.name, value, f"a finite number in {bracket}{lo}, {hi}]")

    return check


def _int_range(lo: int, hi: int) -> Any:
    def check(inst: object, attribute: attrs.Attribute[int], value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise ConfigError(attribute.name, value, f"an integer in [{lo}, {hi}]")

    return check


def _key_sources() -> Any:
    def check(inst: object, attribute: attrs.Attribute[tuple[str, ...]], value: tuple[str, ...]) -> None:
        ok = (
            isinstance(value, tuple)
            and len(value) <= 2
            and all(
                isinstance(v, str) and (v.startswith("env:") or v.startswith("file:")) and len(v) > v.index(":") + 1
                for v in value
            )
        )
        if not ok:
            raise ConfigError(
                attribute.name,
                value,
                "a tuple of at most two key sources, 'env:VARIABLE' or 'file:PATH' (the first signs, both verify)",
            )

    return check


def _str_tuple(value: Iterable[str]) -> tuple[str, ...]:
    # A typed `tuple`: with the bare builtin as converter, mypy's attrs plugin types the argument
    # as an unsolved `Iterable[_T_co]` and refuses every call that passes `auth_keys`.
    return tuple(value)


def _boolean() -> Any:
    def check(inst: object, attribute: attrs.Attribute[bool], value: bool) -> None:
        if not isinstance(value, bool):
            raise ConfigError(attribute.name, value, "a bool")

    return check


@attrs.frozen(kw_only=True)
class LeaseConfig:
    """Timing and safety settings shared by pinners and accessors.

    Defaults equal vLLM's at a 30 s lease: heartbeat every 5 s, each extending by 20 s.
    Unlike vLLM (which floors with ``//``), the derived values are exact fractions, so
    sub-second leases work: ``duration // 6`` is 0 s for any duration under 6 s, which would
    make vLLM heartbeat on every step and extend by 0 s.
    """

    #: Initial lease a pinner grants, seconds (vLLM ``kv_lease_duration``).
    kv_lease_duration: float = attrs.field(default=30.0, validator=_finite_range(0.0, 86400.0, lo_open=True))
    #: Fixed TTL of bidirectional (turn-1) blocks, seconds (vLLM ``decoder_kv_blocks_ttl``).
    decoder_kv_blocks_ttl: float = attrs.field(default=480.0, validator=_finite_range(0.0, 7 * 86400.0, lo_open=True))
    #: Bound on the drift rate of any clock against real time (1e-4 = 100 ppm; NTP-disciplined
    #: servers are within 1e-5, a free-running crystal within 1e-4).
    max_drift_rate: float = attrs.field(default=1e-4, validator=_finite_range(0.0, 0.01))
    #: Upper bound on the duration of one access (an RDMA READ or WRITE of one request's blocks),
    #: in seconds of real time. Push-mode writes are only started when the accessor's validity
    #: window covers it, and the pinner keeps pushed-into memory this long after expiry.
    max_access_time: float = attrs.field(default=2.0, validator=_finite_range(MIN_ACCESS_TIME, 3600.0))
    #: Extra safety margin the accessor subtracts from every validity window, seconds. At least
    #: `MIN_VALIDITY_MARGIN` (1 ms): the safety lemma needs m > 0 to absorb float rounding at the
    #: magnitudes of real clock readings (spec §7).
    validity_margin: float = attrs.field(default=0.05, validator=_finite_range(MIN_VALIDITY_MARGIN, 3600.0))
    #: Largest encoded message (heartbeats and acks are split to stay under it), bytes. Some
    #: NIXL backends cap notifications near 256 B, so the minimum allows that.
    max_message_bytes: int = attrs.field(default=1024, validator=_int_range(MIN_MESSAGE_BYTES, 1 << 20))
    #: How many finished leases the pinner remembers to answer late messages precisely, and how
    #: many given-up leases an accessor remembers to refuse re-tracking them (older ones fall
    #: under a per-incarnation watermark and are refused too).
    tombstone_limit: int = attrs.field(default=65536, validator=_int_range(0, 1 << 24))
    #: How many sent-but-unacknowledged heartbeats the accessor remembers per engine.
    max_outstanding_heartbeats: int = attrs.field(default=64, validator=_int_range(1, 1 << 16))
    #: Clock-offset samples kept per peer (the min-delay one among them is used).
    clock_sample_window: int = attrs.field(default=16, validator=_int_range(1, 4096))
    #: Keep a request-id index on the pinner so stock vLLM ``HB:``/``id:count`` notifications
    #: can be understood. Costs one dict entry per live lease.
    vllm_compat: bool = attrs.field(default=False, validator=_boolean())
    #: Where the deployment key lives, when native messages are authenticated: ``()`` (off, the
    #: default), or one or two sources, each ``"env:VARIABLE"`` or ``"file:PATH"`` holding the
    #: key as at least 32 hex digits. The first key seals what this endpoint sends; every listed
    #: key opens what it receives (a rotation lists the new key and the old one). The key itself
    #: never enters this object, a repr or a log line; the driver reads it at start-up.
    auth_keys: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple, validator=_key_sources())
    #: With `auth_keys` set, also accept stock vLLM ``HB:`` / ``id:count`` notifications, which
    #: cannot be authenticated (anyone who can reach the pinner can then renew or end a lease
    #: by request id). Off by default.
    auth_allow_vllm_compat: bool = attrs.field(default=False, validator=_boolean())

    def __attrs_post_init__(self) -> None:
        if self.accessor_extension <= 0.0:
            raise ConfigError(
                "validity_margin",
                self.validity_margin,
                f"less than the drift-adjusted extension ({self.lease_extension:.6g} s) so that "
                "an acknowledged heartbeat gives the accessor a non-empty validity window",
            )

    @property
    def authenticated(self) -> bool:
        """Native messages are sealed with a deployment key (`auth_keys` is set)."""
        return bool(self.auth_keys)

    @property
    def frame_overhead(self) -> int:
        """Bytes a sealed frame adds to an encoded message (its tag), 0 without a key."""
        return 16 if self.auth_keys else 0

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between two heartbeats to one engine: ``duration / 6``."""
        return self.kv_lease_duration / 6.0

    @property
    def lease_extension(self) -> float:
        """Seconds each received heartbeat extends a lease by: ``2 * duration / 3``."""
        return self.kv_lease_duration * 2.0 / 3.0

    @property
    def accessor_extension(self) -> float:
        """How long after *sending* an acknowledged heartbeat the accessor counts the lease
        valid, in its own clock: the extension shrunk by the drift bound (pinner clock fast,
        ours slow) and the margin. See spec/PROTOCOL.md, "Accessor validity"."""
        rho = self.max_drift_rate
        return self.lease_extension * (1.0 - rho) / (1.0 + rho) - self.validity_margin

    @property
    def access_time_local(self) -> float:
        """`max_access_time` as an upper bound in any local clock (a fast clock counts more)."""
        return self.max_access_time * (1.0 + self.max_drift_rate)

    @property
    def push_guard(self) -> float:
        """How long the pinner keeps pushed-into memory after expiry, in its own clock."""
        return self.access_time_local

    def with_changes(self, **changes: Any) -> LeaseConfig:
        """A validated copy with some fields replaced."""
        return attrs.evolve(self, **changes)
