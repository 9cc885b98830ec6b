"""The vLLM adapter's settings (pure: runs in the main environment, without vLLM)."""

from __future__ import annotations

import pytest
from kvlease.adapters.vllm._settings import ADAPTER_KEYS, LEASE_KEYS, read_settings

from kvlease import ConfigError, LeaseConfig


def test_defaults_are_vllms() -> None:
    s = read_settings({})
    assert s.lease.kv_lease_duration == 30.0  # vLLM's kv_lease_duration default
    assert s.lease.decoder_kv_blocks_ttl == 480.0  # vLLM's decoder_kv_blocks_ttl default
    assert s.vllm_compat and s.lease.vllm_compat  # stock vLLM peers understood by default
    assert s.engine_ttl is None and s.transfer_timeout is None


def test_every_knob_is_read_under_its_name() -> None:
    s = read_settings(
        {
            "kv_lease_duration": 6,
            "decoder_kv_blocks_ttl": 60,
            "max_drift_rate": 1e-5,
            "max_access_time": 0.5,
            "validity_margin": 0.01,
            "max_message_bytes": 4096,
            "tombstone_limit": 10,
            "max_outstanding_heartbeats": 8,
            "clock_sample_window": 4,
            "kvlease_vllm_compat": False,
            "kvlease_engine_ttl": 12,
            "kvlease_transfer_timeout": 3,
            # vLLM's own keys pass through untouched
            "backends": ["UCX"],
            "kv_recompute_threshold": 64,
        }
    )
    assert s.lease == LeaseConfig(
        kv_lease_duration=6,
        decoder_kv_blocks_ttl=60,
        max_drift_rate=1e-5,
        max_access_time=0.5,
        validity_margin=0.01,
        max_message_bytes=4096,
        tombstone_limit=10,
        max_outstanding_heartbeats=8,
        clock_sample_window=4,
        vllm_compat=False,
    )
    assert (s.vllm_compat, s.engine_ttl, s.transfer_timeout) == (False, 12.0, 3.0)
    assert set(LEASE_KEYS) <= set(attr.name for attr in LeaseConfig.__attrs_attrs__)
    assert all(k.startswith("kvlease_") for k in ADAPTER_KEYS)


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"kv_lease_duration": -1}, "kv_lease_duration"),
        ({"kv_lease_duration": "30"}, "kv_lease_duration"),
        ({"decoder_kv_blocks_ttl": 0}, "decoder_kv_blocks_ttl"),
        ({"max_access_time": float("nan")}, "max_access_time"),
        ({"validity_margin": 0}, "validity_margin"),
        ({"max_message_bytes": 10}, "max_message_bytes"),
        ({"auth_keys": 5}, "auth_keys"),
        ({"kvlease_vllm_compat": "yes"}, "kvlease_vllm_compat"),
        ({"kvlease_engine_ttl": 0}, "kvlease_engine_ttl"),
        ({"kvlease_transfer_timeout": True}, "kvlease_transfer_timeout"),
        ({"kvlease_engine_tll": 5}, "kvlease_engine_tll"),  # a misspelt kvlease key
    ],
)
def test_a_bad_value_fails_naming_the_key(extra: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        read_settings(extra)
    assert info.value.field == key and key in str(info.value)
