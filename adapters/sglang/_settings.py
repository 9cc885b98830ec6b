"""The adapter's settings, read from environment variables the way SGLang reads its own
(``SGLANG_*``), with defaults equal to kvlease's. A bad value fails when the KV manager starts,
naming the variable.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import attrs

from kvlease import ConfigError, LeaseConfig

__all__ = ["ENV", "Settings", "load_settings"]

#: variable -> (LeaseConfig field or adapter setting, meaning). Defaults: kvlease's.
ENV: dict[str, tuple[str, str]] = {
    "SGLANG_KVLEASE_LEASE_DURATION": ("kv_lease_duration", "initial lease, seconds (heartbeat every 1/6 of it)"),
    "SGLANG_KVLEASE_MAX_ACCESS_TIME": ("max_access_time", "bound on one request's WRITEs, seconds (push guard)"),
    "SGLANG_KVLEASE_VALIDITY_MARGIN": ("validity_margin", "margin the writer subtracts from its window, seconds"),
    "SGLANG_KVLEASE_MAX_DRIFT_RATE": ("max_drift_rate", "clock rate bound"),
    "SGLANG_KVLEASE_AUTH_KEYS": ("auth_keys", "deployment key sources, comma-separated env:VAR / file:PATH"),
    "SGLANG_KVLEASE_DEST_LEASE": ("dest_lease", "1: decode pins its destination pages under a push lease"),
    "SGLANG_KVLEASE_SOURCE_LEASE": ("source_lease", "1: prefill holds finished KV under a lease the decode renews"),
    "SGLANG_KVLEASE_METRICS_PORT": ("metrics_port", "serve kvlease's Prometheus metrics on this port (0: off)"),
}


@attrs.frozen
class Settings:
    config: LeaseConfig
    dest_lease: bool = True
    source_lease: bool = True
    metrics_port: int = 0


def _float(name: str, raw: str) -> float:
    try:
        v = float(raw)
    except ValueError:
        raise ConfigError(name, raw, "a number") from None
    if not math.isfinite(v):
        raise ConfigError(name, raw, "a finite number")
    return v


def _flag(name: str, raw: str) -> bool:
    if raw.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if raw.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ConfigError(name, raw, "1/0/true/false")


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Read the ``SGLANG_KVLEASE_*`` variables; a bad value raises `ConfigError` naming it."""
    env = os.environ if environ is None else environ
    fields: dict[str, object] = {}
    extra: dict[str, object] = {}
    for name, (field, _doc) in ENV.items():
        raw = env.get(name)
        if raw is None or raw == "":
            continue
        if field == "auth_keys":
            fields[field] = tuple(s.strip() for s in raw.split(",") if s.strip())
        elif field in ("dest_lease", "source_lease"):
            extra[field] = _flag(name, raw)
        elif field == "metrics_port":
            try:
                port = int(raw)
            except ValueError:
                raise ConfigError(name, raw, "a port number") from None
            if not 0 <= port < 65536:
                raise ConfigError(name, raw, "a port number (0: off)")
            extra[field] = port
        else:
            fields[field] = _float(name, raw)
    try:
        config = LeaseConfig(**fields)  # type: ignore[arg-type]
    except ConfigError as exc:
        # Name the variable, not the LeaseConfig field (a derived-value error names the field).
        var = next((n for n, (f, _d) in ENV.items() if f == exc.field), None)
        if var is None:
            var = ", ".join(n for n, (f, _d) in ENV.items() if f in fields) or "SGLANG_KVLEASE_*"
            raise ConfigError(var, exc.value, f"{exc.allowed} ({exc.field})") from None
        raise ConfigError(var, env.get(var), exc.allowed) from None
    return Settings(config=config, **extra)  # type: ignore[arg-type]
