"""The adapter's settings, read from vLLM's ``kv_connector_extra_config``.

Pure: no vLLM import, so it is checked (and tested) without vLLM. Every kvlease knob is read under
its `LeaseConfig` field name, which for the two timing knobs vLLM already has is vLLM's own name
(``kv_lease_duration``, default 30; ``decoder_kv_blocks_ttl``, default 480). A bad value, or an
unknown ``kvlease_*`` key, raises `ConfigError` naming the key when the connector is built.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from typing import Any

import attrs

from kvlease import ConfigError, LeaseConfig

__all__ = ["ADAPTER_KEYS", "LEASE_KEYS", "VLLM_KEYS", "AdapterSettings", "read_settings", "unknown_keys"]

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
    # Seconds after which a READ the core started is treated as failed (default: the access-time
    # bound plus a heartbeat interval).
    "kvlease_transfer_timeout",
)


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


def _positive(key: str, value: object) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok:
        raise ConfigError(key, value, "a positive finite number of seconds")
    return float(value)  # type: ignore[arg-type]


def read_settings(extra: Mapping[str, Any] | None) -> AdapterSettings:
    """The adapter's settings from ``kv_connector_extra_config``; `ConfigError` names a bad key."""
    extra = dict(extra or {})
    for key in extra:
        if key.startswith("kvlease_") and key not in ADAPTER_KEYS:
            raise ConfigError(key, extra[key], f"a known kvlease setting (one of {', '.join(ADAPTER_KEYS)})")
    fields: dict[str, Any] = {k: extra[k] for k in LEASE_KEYS if k in extra}
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
    return AdapterSettings(
        lease,
        compat,
        None if engine_ttl is None else _positive("kvlease_engine_ttl", engine_ttl),
        None if transfer_timeout is None else _positive("kvlease_transfer_timeout", transfer_timeout),
    )
