"""The adapter's settings, read from vLLM's ``kv_connector_extra_config``.

Pure: no vLLM import, so it is checked (and tested) without vLLM. Every kvlease knob is read under
its `LeaseConfig` field name, which for the two timing knobs vLLM already has is vLLM's own name
(``kv_lease_duration``, default 30; ``decoder_kv_blocks_ttl``, default 480). A bad value, or an
unknown ``kvlease_*`` key, raises `ConfigError` naming the key when the connector is built.
"""

from __future__ import annotations

import difflib
import math
import socket
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from kvlease import ConfigError, LeaseConfig

__all__ = [
    "ADAPTER_KEYS",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_MIN_BANDWIDTH",
    "LEASE_KEYS",
    "VLLM_KEYS",
    "AdapterSettings",
    "TransferBound",
    "check_transfer_bound",
    "largest_access_bytes",
    "read_settings",
    "transfer_bound",
    "unknown_keys",
]

#: `LeaseConfig` fields readable from the extra config, under the same names.
LEASE_KEYS = (
    "kv_lease_duration",
    "decoder_kv_blocks_ttl",
    "max_drift_rate",
    "max_access_time",
    "validity_margin",
    "max_message_bytes",
    "tombstone_limit",
    "max_outstanding_heartbeats",
    "clock_sample_window",
    "auth_keys",
    "auth_allow_vllm_compat",
)

#: The adapter's own keys (all start with ``kvlease_``).
ADAPTER_KEYS = (
    # Accept stock vLLM ``HB:`` / ``id:count`` notifications on the producer (mixed fleets during
    # a rolling upgrade), and fall back to vLLM's own format towards a stock producer.
    "kvlease_vllm_compat",
    # Seconds a peer may stay silent after failing before the driver gives it up (default: the
    # lease duration).
    "kvlease_engine_ttl",
    # Seconds after which a READ the core started is given up (default: the larger of the
    # access-time bound and the largest transfer of this engine at kvlease_min_bandwidth, plus a
    # heartbeat interval; see `transfer_bound`).
    "kvlease_transfer_timeout",
    # The slowest rate, bytes per second, at which one request's KV transfer is stated to move
    # on this deployment's links (default 1e9, 1 GB/s): sizes the transfer bound (see
    # `transfer_bound`).
    "kvlease_min_bandwidth",
)

#: The default stated floor on one request's KV transfer rate, bytes per second (1 GB/s: well
#: under RDMA's 10-50 GB/s, above UCX over plain TCP's ~0.6 GB/s measured on loopback).
DEFAULT_MIN_BANDWIDTH = 1e9


#: The adapter's default bound on one heartbeat and the ack answering it, bytes (the protocol's
#: default is 1,024, for transports with small datagrams). Heartbeats ride on NIXL notifications,
#: which vLLM's own `HB:` fills with every request id a decoder holds, thousands at a time: 8 KiB
#: (about 7,000 ids) takes a producer's 100,000 leases in 15 messages an interval rather than
#: 112, and bounds each message's work at well under a millisecond. Peers with another bound
#: split by the smaller of both (protocol §4.3).
DEFAULT_MAX_MESSAGE_BYTES = 8192


#: Keys vLLM 0.33.0's NIXL connectors read from the same extra config (not kvlease's).
VLLM_KEYS = (
    "backends",
    "bidirectional_kv_xfer",
    "connectors",
    "enforce_handshake_compat",
    "engine_ttl",
    "kv_recompute_threshold",
    "num_threads",
    "push_registration_timeout",
)


def unknown_keys(extra: Mapping[str, Any] | None) -> list[str]:
    """Keys of ``kv_connector_extra_config`` that neither kvlease nor vLLM's NIXL connector
    reads, each with the closest known key when there is one (a typo such as
    ``kv_lease_durration`` would otherwise be silently ignored, leaving the default)."""
    known = (*LEASE_KEYS, *ADAPTER_KEYS, *VLLM_KEYS)
    out = []
    for key in extra or {}:
        if key in known or key.startswith("kvlease_"):  # kvlease_* typos are errors already
            continue
        close = difflib.get_close_matches(str(key), known, n=1)
        out.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return out


@attrs.frozen
class AdapterSettings:
    lease: LeaseConfig
    vllm_compat: bool = True
    engine_ttl: float | None = None
    transfer_timeout: float | None = None
    min_bandwidth: float = DEFAULT_MIN_BANDWIDTH


def largest_access_bytes(max_model_len: int, groups: Iterable[tuple[int, int]], cache_bytes: int) -> int:
    """An upper bound on the bytes one access of this worker moves (its READ in pull mode, its
    WRITE in push mode): every transferred cache group's blocks of a request of
    `max_model_len` tokens, ``groups`` giving each group's ``(block_size, bytes of one block
    over all its layers)``, and never more than the worker's whole KV cache (`cache_bytes`).
    These are this worker's own bytes whatever the other side's TP: a decoder rank reading from
    several producer ranks fills its own blocks, a producer rank writing to several decoder
    ranks sends its own."""
    total = sum(-(-max_model_len // block_size) * nbytes for block_size, nbytes in groups if block_size > 0)
    return min(total, cache_bytes) if cache_bytes > 0 else total


@attrs.frozen
class TransferBound:
    """How long one access of this worker may take, and the driver's transfer timeout."""

    #: The largest access of this worker (`largest_access_bytes`).
    nbytes: int
    #: That access at the stated floor (``kvlease_min_bandwidth``), seconds.
    seconds: float
    #: Seconds after which an access still running is given up (the driver's transfer_timeout).
    timeout: float


def transfer_bound(settings: AdapterSettings, nbytes: int) -> TransferBound:
    """The transfer bound of a worker whose largest access moves `nbytes`.

    The timeout, unless ``kvlease_transfer_timeout`` sets it, is the larger of the access-time
    bound and the largest access at the floor, plus one heartbeat interval: a transfer that moves
    at the floor or faster is never cut short, whatever the model's length and layers (a fixed
    bound, the earlier ``A + I`` = 7 s, failed every long-context read on a slow link), and one
    that stalls (a hung link) is given up, so the producer's blocks are not pinned by heartbeats
    for as long as it hangs."""
    cfg = settings.lease
    seconds = nbytes / settings.min_bandwidth
    timeout = settings.transfer_timeout
    if timeout is None:
        timeout = max(cfg.access_time_local, seconds * (1.0 + cfg.max_drift_rate)) + cfg.heartbeat_interval
    return TransferBound(nbytes, seconds, timeout)


def check_transfer_bound(settings: AdapterSettings, bound: TransferBound, *, push: bool) -> list[str]:
    """Start-up check of the transfer bound: raises `ConfigError` where the safety argument does
    not hold, returns warnings where only liveness suffers.

    Push: a WRITE must end within ``max_access_time`` of its start (spec §7.1, S2), or it may
    land after the decoder freed the blocks; the largest WRITE at the floor must fit, or the
    engine refuses to start, naming both settings. Pull: a READ's validity does not depend on its
    duration (one that outlasts its window is confirmed by the producer), but one still running
    at the transfer timeout becomes a failed load: an explicit ``kvlease_transfer_timeout`` below
    the largest READ at the floor is warned about."""
    cfg = settings.lease
    mib = bound.nbytes / (1 << 20)
    what = f"the largest {'WRITE' if push else 'READ'} this engine can issue ({mib:.4g} MiB)"
    floor = f"kvlease_min_bandwidth = {settings.min_bandwidth:.4g} bytes/s"
    if push and bound.seconds > cfg.max_access_time:
        raise ConfigError(
            "max_access_time",
            cfg.max_access_time,
            f"at least {bound.seconds:.4g} s: {what} takes that long at the stated floor {floor}, and a push "
            "WRITE that outlasts max_access_time may land after the decoder freed its blocks; raise "
            "max_access_time, or state a higher kvlease_min_bandwidth if every link guarantees it",
        )
    if settings.transfer_timeout is not None and bound.timeout < bound.seconds:
        return [
            f"kvlease_transfer_timeout = {bound.timeout:.4g} s is shorter than {what} at the stated floor "
            f"{floor} ({bound.seconds:.4g} s): such a transfer is given up and reported as a failed load"
        ]
    return []


def _positive(key: str, value: object, unit: str = "seconds") -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok:
        raise ConfigError(key, value, f"a positive finite number of {unit}")
    return float(value)  # type: ignore[arg-type]


def read_settings(extra: Mapping[str, Any] | None) -> AdapterSettings:
    """The adapter's settings from ``kv_connector_extra_config``; `ConfigError` names a bad key."""
    extra = dict(extra or {})
    for key in extra:
        if key.startswith("kvlease_") and key not in ADAPTER_KEYS:
            raise ConfigError(key, extra[key], f"a known kvlease setting (one of {', '.join(ADAPTER_KEYS)})")
    fields: dict[str, Any] = {k: extra[k] for k in LEASE_KEYS if k in extra}
    fields.setdefault("max_message_bytes", DEFAULT_MAX_MESSAGE_BYTES)
    if "auth_keys" in fields and isinstance(fields["auth_keys"], str):
        fields["auth_keys"] = (fields["auth_keys"],)
    if "auth_keys" in fields and not isinstance(fields["auth_keys"], list | tuple):
        raise ConfigError("auth_keys", fields["auth_keys"], "a list of key sources")
    compat = extra.get("kvlease_vllm_compat", True)
    if not isinstance(compat, bool):
        raise ConfigError("kvlease_vllm_compat", compat, "a bool")
    # The producer keeps a request-id index so stock vLLM notifications can be understood.
    lease = LeaseConfig(**fields, vllm_compat=compat)  # a bad value raises ConfigError naming it
    engine_ttl = extra.get("kvlease_engine_ttl")
    transfer_timeout = extra.get("kvlease_transfer_timeout")
    bandwidth = extra.get("kvlease_min_bandwidth")
    return AdapterSettings(
        lease,
        compat,
        None if engine_ttl is None else _positive("kvlease_engine_ttl", engine_ttl),
        None if transfer_timeout is None else _positive("kvlease_transfer_timeout", transfer_timeout),
        DEFAULT_MIN_BANDWIDTH if bandwidth is None else _positive("kvlease_min_bandwidth", bandwidth, "bytes/s"),
    )


#: The environment variable vLLM reads the NIXL handshake listener's port from.
SIDE_CHANNEL_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"


def check_side_channel(host: str, port: int) -> None:
    """Raise `ConfigError` naming ``VLLM_NIXL_SIDE_CHANNEL_PORT`` when the NIXL handshake
    listener's address cannot be bound now (another process holds it: typically a second vLLM
    server on the host with the default port). vLLM binds it in a thread and waits for that
    thread without a bound, so a taken port leaves its server alive and never healthy, saying
    nothing but the thread's traceback. Checked the way the listener binds (ZMQ sets
    ``SO_REUSEADDR``), just before it does."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as e:
        raise ConfigError(
            SIDE_CHANNEL_ENV,
            port,
            f"a port the NIXL handshake listener can bind on {host} (binding it failed: {e.strerror or e}; vLLM "
            f"would wait for it for good): give each vLLM server on this host its own {SIDE_CHANNEL_ENV} "
            f"(each binds the port plus its data-parallel rank)",
        ) from e
