"""The vLLM adapter's settings, version policy and transfer bound (pure: runs in the main
environment, without vLLM)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from kvlease.adapters.vllm._settings import (
    ADAPTER_KEYS,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_MIN_BANDWIDTH,
    LEASE_KEYS,
    SIDE_CHANNEL_ENV,
    check_side_channel,
    check_transfer_bound,
    largest_access_bytes,
    read_settings,
    transfer_bound,
)
from kvlease.adapters.vllm._version import OVERRIDE_ENV, SUPPORTED_SERIES, UnsupportedVllmVersion, check

from kvlease import ConfigError, LeaseConfig


def test_defaults_are_vllms() -> None:
    s = read_settings({})
    assert s.lease.kv_lease_duration == 30.0  # vLLM's kv_lease_duration default
    assert s.lease.decoder_kv_blocks_ttl == 480.0  # vLLM's decoder_kv_blocks_ttl default
    assert s.vllm_compat and s.lease.vllm_compat  # stock vLLM peers understood by default
    assert s.engine_ttl is None and s.transfer_timeout is None
    # The adapter's own message bound: NIXL notifications carry vLLM's thousands of ids too.
    assert s.lease.max_message_bytes == DEFAULT_MAX_MESSAGE_BYTES == 8192
    assert read_settings({"max_message_bytes": 1024}).lease.max_message_bytes == 1024


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


# -- issue 21 (operations): the vLLM version check ----------------------------------------------


@pytest.mark.parametrize("version", ["0.33.0", "0.33.1", "0.33.2.dev7+g1a2b3c", "0.33.0+cpu", "v0.33.0"])
def test_a_supported_vllm_loads(version: str) -> None:
    assert check(version, env={}) is True


@pytest.mark.parametrize("version", ["0.34.0", "0.32.1", "0.3.3", "1.0.0", "dev", "0.34.0rc1"])
def test_an_unsupported_vllm_is_refused_saying_what_to_do(version: str) -> None:
    with pytest.raises(UnsupportedVllmVersion) as info:
        check(version, env={}, where="/site-packages/vllm/__init__.py")
    msg = str(info.value)
    assert isinstance(info.value, ImportError)  # vLLM's connector factory shows it as it is
    assert f"vLLM {version} (/site-packages/vllm/__init__.py)" in msg
    assert "supports vLLM 0.33.x" in msg and "pip install 'vllm==0.33.*'" in msg
    assert "docs/vllm-operations.md" in msg
    assert f"{OVERRIDE_ENV}={version}" in msg


def test_an_unsupported_vllm_loads_only_when_named_exactly() -> None:
    assert check("0.34.0", env={OVERRIDE_ENV: "0.34.0"}) is False  # loads, untested (warned)
    with pytest.raises(UnsupportedVllmVersion):
        check("0.34.1", env={OVERRIDE_ENV: "0.34.0"})  # the next upgrade is refused again
    assert SUPPORTED_SERIES == ((0, 33),)


# -- issue 21: no test hooks in what ships -------------------------------------------------------


def test_the_shipped_adapter_carries_no_test_hooks() -> None:
    """The test hook that kept a push WRITE "in progress" lived in the shipped push worker
    (``_kv_test_pending``, consulted on every poll of vLLM's transfers); tests now wrap vLLM's
    own method on the instance they drive (tests/_vllm_node.py). No name in the adapter's
    source may be a test hook."""
    hooks = []
    for path in sorted((Path(__file__).resolve().parents[1] / "adapters" / "vllm").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            name = (
                node.attr
                if isinstance(node, ast.Attribute)
                else node.id
                if isinstance(node, ast.Name)
                else node.name
                if isinstance(node, ast.FunctionDef | ast.ClassDef)
                else ""
            )
            if re.search(r"(^|_)test(_|$)", name.lower()):
                hooks.append(f"{path.name}: {name}")
    assert hooks == []


# -- issue 21: the transfer bound ----------------------------------------------------------------

MIB = 1 << 20


def test_the_largest_access_counts_every_group_and_stops_at_the_cache() -> None:
    # 2048 tokens in blocks of 32: 64 blocks of 32 KiB (2 layers of 16 KiB pages) = 2 MiB.
    assert largest_access_bytes(2048, [(32, 32 * 1024)], cache_bytes=256 * 32 * 1024) == 2 * MIB
    assert largest_access_bytes(2049, [(32, 1)], cache_bytes=0) == 65  # a partial block counts
    # A hybrid model: a second group (a state of one block per request) adds its bytes.
    assert largest_access_bytes(2048, [(32, 32 * 1024), (2048, 1000)], cache_bytes=1 << 30) == 2 * MIB + 1000
    # Never more than the whole cache (a long max_model_len on a small cache).
    assert largest_access_bytes(1 << 20, [(16, 4096)], cache_bytes=MIB) == MIB


def test_the_default_transfer_timeout_grows_with_the_largest_access() -> None:
    """Issue 21: the driver's fixed default (access time + one interval: 7 s at vLLM's 30 s
    lease) failed every READ slower than that, a long context on a slow link included. The
    default now covers the largest access at the stated floor."""
    s = read_settings({})
    small = transfer_bound(s, 2 * MIB)
    assert small.timeout == pytest.approx(s.lease.access_time_local + s.lease.heartbeat_interval)  # 7 s
    # Llama-70B-like at 128k tokens on one TP-8 rank: 40 KiB per token, 5.4 GB: 5.4 s at 1 GB/s.
    big = transfer_bound(s, 131072 * 40 * 1024)
    assert big.seconds == pytest.approx(5.37, abs=0.01)
    assert big.timeout == pytest.approx(big.seconds * (1 + s.lease.max_drift_rate) + s.lease.heartbeat_interval)
    slow = transfer_bound(read_settings({"kvlease_min_bandwidth": 1e8}), 131072 * 40 * 1024)
    assert slow.timeout > 10 * big.seconds
    fixed = transfer_bound(read_settings({"kvlease_transfer_timeout": 3}), 131072 * 40 * 1024)
    assert fixed.timeout == 3.0  # an explicit timeout is kept as set ...


def test_the_start_up_check_refuses_an_uncoverable_push_and_warns_of_a_short_pull_timeout() -> None:
    s = read_settings({"max_access_time": 1})
    nbytes = 2 * MIB
    assert check_transfer_bound(s, transfer_bound(s, nbytes), push=True) == []  # 2 ms at 1 GB/s
    slow = read_settings({"max_access_time": 1, "kvlease_min_bandwidth": 1e6})  # 2.1 s at 1 MB/s
    with pytest.raises(ConfigError) as info:
        check_transfer_bound(slow, transfer_bound(slow, nbytes), push=True)
    assert info.value.field == "max_access_time"
    assert "at least 2.097 s" in str(info.value) and "kvlease_min_bandwidth" in str(info.value)
    # Pull: the READ's validity does not depend on its duration; nothing to refuse or warn of.
    assert check_transfer_bound(slow, transfer_bound(slow, nbytes), push=False) == []
    # ... but an explicit timeout below the largest READ at the floor is warned about.
    short = read_settings({"kvlease_min_bandwidth": 1e6, "kvlease_transfer_timeout": 1})
    (warning,) = check_transfer_bound(short, transfer_bound(short, nbytes), push=False)
    assert "kvlease_transfer_timeout = 1 s" in warning and "failed load" in warning


def test_the_bandwidth_floor_is_a_positive_number() -> None:
    assert read_settings({}).min_bandwidth == DEFAULT_MIN_BANDWIDTH == 1e9
    assert read_settings({"kvlease_min_bandwidth": 5e8}).min_bandwidth == 5e8
    for bad in (0, -1, "1e9", float("inf"), True):
        with pytest.raises(ConfigError) as info:
            read_settings({"kvlease_min_bandwidth": bad})
        assert info.value.field == "kvlease_min_bandwidth" and "bytes/s" in str(info.value)


def test_a_taken_side_channel_port_fails_naming_the_setting() -> None:
    """vLLM's handshake listener binds in a thread it waits for without a bound: a port another
    process holds left a real server alive and never healthy for 900 s (CI, 2026-12-05).
    kvlease's connectors check the port first and fail the start-up naming the variable."""
    import zmq

    ctx = zmq.Context()
    holder = ctx.socket(zmq.ROUTER)  # held the way another vLLM server's listener holds it
    port = holder.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(ConfigError, match=SIDE_CHANNEL_ENV) as caught:
            check_side_channel("127.0.0.1", port)
        assert caught.value.field == SIDE_CHANNEL_ENV and caught.value.value == port
        assert "in use" in str(caught.value)
    finally:
        holder.close(linger=0)
        ctx.term()
    check_side_channel("127.0.0.1", port)  # free again: no complaint
    with pytest.raises(ConfigError, match=SIDE_CHANNEL_ENV):
        check_side_channel("192.0.2.1", port)  # an address this host does not have
