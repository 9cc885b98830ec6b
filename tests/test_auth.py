"""Authentication of native frames (`FrameAuth`), its configuration, and the driver using it:
sealing covers every byte, either of two keys opens during a rotation, the key never shows,
bad key sources fail at start-up naming the setting, and a driver with a key drops (and counts)
every unsealed, wrongly keyed or unauthenticatable message without an exception."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlease import (
    MAC_BYTES,
    AccessDone,
    Accessor,
    ConfigError,
    DecodeError,
    FrameAuth,
    Heartbeat,
    LeaseConfig,
    LocalProtocolError,
    LocalTime,
    Pinner,
    decode,
    encode,
    encode_vllm_heartbeat,
    is_sealed_frame,
)
from kvlease._codec import heartbeat_id_budget, split_ids

if TYPE_CHECKING:  # the transports load only where a test uses them
    from kvlease.transports import Driver

K1 = bytes(range(16))
K2 = bytes(range(100, 132))
HB = Heartbeat("decode-0", 0, 1, 7, 9, 3, LocalTime(1234.5), (1, 2, 3, 300))


def test_a_sealed_frame_opens_to_the_same_message_and_costs_the_tag() -> None:
    auth = FrameAuth([K1])
    frame = encode(HB)
    sealed = auth.seal(frame)
    assert is_sealed_frame(sealed) and len(sealed) == len(frame) + MAC_BYTES
    assert is_sealed_frame(memoryview(sealed)) and not is_sealed_frame(memoryview(frame))
    assert decode(auth.open(memoryview(sealed))) == HB
    assert decode(auth.open(sealed)) == HB


@given(st.data())
def test_flipping_any_byte_of_a_sealed_frame_is_refused(data: st.DataObject) -> None:
    auth = FrameAuth([K1])
    sealed = bytearray(auth.seal(encode(HB)))
    i = data.draw(st.integers(0, len(sealed) - 1))
    sealed[i] ^= data.draw(st.integers(1, 255))
    with pytest.raises(DecodeError) as exc:
        auth.open(bytes(sealed))
    assert exc.value.category == "auth"


def test_unsealed_wrong_key_and_truncated_frames_are_refused_as_auth() -> None:
    auth = FrameAuth([K1])
    for data in (encode(HB), FrameAuth([K2]).seal(encode(HB)), b"\xc1\x41" + b"\0" * 5, b"HB:req-1", b""):
        with pytest.raises(DecodeError) as exc:
            auth.open(data)
        assert exc.value.category == "auth"


def test_rotation_accepts_both_keys_and_signs_with_the_first() -> None:
    old, new = FrameAuth([K1]), FrameAuth([K2])
    rotating = FrameAuth([K2, K1])
    assert decode(rotating.open(old.seal(encode(HB)))) == HB  # peers not yet rotated
    assert decode(rotating.open(new.seal(encode(HB)))) == HB  # peers already rotated
    assert decode(new.open(rotating.seal(encode(HB)))) == HB  # it signs with the new key
    with pytest.raises(DecodeError):
        old.open(rotating.seal(encode(HB)))


def test_message_tags_are_their_own_domain_and_follow_rotation() -> None:
    # An adapter's own control messages (SGLang's ticket requests) are tagged in a domain of
    # their own: no ticket's tag is a valid message tag for the same bytes, nor the reverse.
    old, rotating = FrameAuth([K1]), FrameAuth([K2, K1])
    payload = b"room 7, asked by d0 of p0"
    tag = old.message_tag(payload)
    assert len(tag) == MAC_BYTES and old.check_message_tag(payload, tag)
    assert not old.check_message_tag(payload + b"!", tag)
    assert not old.check_message_tag(payload, bytes.fromhex(old.ticket_tag(payload)))
    assert not old.check_ticket_tag(payload, tag.hex())
    assert rotating.check_message_tag(payload, tag)  # a peer not yet rotated
    assert not old.check_message_tag(payload, rotating.message_tag(payload))  # it signs with the new key


def test_the_key_never_shows() -> None:
    auth = FrameAuth([K1, K2])
    assert K1.hex() not in repr(auth) and "hidden" in repr(auth)
    cfg = LeaseConfig(auth_keys=("env:KVLEASE_TEST_KEY",))
    assert "KVLEASE_TEST_KEY" in repr(cfg)  # only where the key lives


@pytest.mark.parametrize("keys", [[], [K1, K2, K1], [b"short"], [bytes(65)], ["not bytes"]])
def test_frame_auth_refuses_bad_keys(keys: list[bytes]) -> None:
    with pytest.raises(LocalProtocolError):
        FrameAuth(keys)


def test_only_native_frames_are_sealed() -> None:
    with pytest.raises(LocalProtocolError):
        FrameAuth([K1]).seal(b"HB:req-1")


@pytest.mark.parametrize(
    "value", [("KVLEASE_KEY",), ("env:",), ("file:",), ("env:A", "env:B", "env:C"), ("http:x",), "env:A"]
)
def test_config_refuses_malformed_key_sources_naming_the_setting(value: object) -> None:
    with pytest.raises(ConfigError, match="auth_keys"):
        LeaseConfig(auth_keys=value)  # type: ignore[arg-type]  # malformed on purpose


def test_the_tag_counts_against_the_message_bound() -> None:
    """A sealed heartbeat and the sealed ack answering it fit max_message_bytes."""
    plain, sealed = LeaseConfig(max_message_bytes=256), LeaseConfig(max_message_bytes=256, auth_keys=("env:K",))
    assert sealed.frame_overhead == MAC_BYTES and plain.frame_overhead == 0
    acc = Accessor(sealed, "decode-0", session=2**64 - 1)
    pin = Pinner(sealed, "prefill-0", 2**64 - 1)
    ids = list(range(1, 5000, 7))
    budget = heartbeat_id_budget(sealed.max_message_bytes - sealed.frame_overhead, acc.engine_id, pin.engine_id)
    auth = FrameAuth([K1])
    for chunk in split_ids(ids, budget):
        hb = Heartbeat("decode-0", 65535, 65536, 2**64 - 1, 2**64 - 1, 2**64 - 1, LocalTime(-(2.0**32)), chunk)
        assert len(auth.seal(encode(hb))) <= 256


# -- the driver: keys loaded at start-up, input judged before decoding -------------------------


def test_load_frame_auth_reads_env_and_file_and_names_the_setting(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from kvlease.transports import load_frame_auth

    assert load_frame_auth(LeaseConfig()) is None
    monkeypatch.setenv("KVLEASE_TEST_KEY", K1.hex())
    key_file = tmp_path / "key"
    key_file.write_text(K2.hex()[:32] + "\n" + K2.hex()[32:] + "\n")
    auth = load_frame_auth(LeaseConfig(auth_keys=("env:KVLEASE_TEST_KEY", f"file:{key_file}")))
    assert auth is not None
    assert decode(auth.open(FrameAuth([K2]).seal(encode(HB)))) == HB
    assert decode(FrameAuth([K1]).open(auth.seal(encode(HB)))) == HB
    monkeypatch.setenv("KVLEASE_BAD", "zz" * 16)
    for source, says in (
        ("env:KVLEASE_UNSET_VARIABLE", "is not set"),
        (f"file:{tmp_path / 'missing'}", "readable key file"),
        ("env:KVLEASE_BAD", "hex digits"),
    ):
        with pytest.raises(ConfigError, match="auth_keys") as exc:
            load_frame_auth(LeaseConfig(auth_keys=(source,)))
        assert says in str(exc.value) and "zz" not in str(exc.value)


zmq = pytest.importorskip("zmq")


def _pump(drivers: list[Driver], until: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "condition not reached"
        for d in drivers:
            d.step()
        time.sleep(0.001)


def test_a_keyed_driver_drops_and_counts_what_is_not_sealed_with_its_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two drivers with the key talk (the handshake and heartbeats are sealed); forged and
    wrongly keyed frames and stock vLLM notifications are dropped and counted, with no
    exception, and the lease is untouched."""
    from kvlease.transports import Driver
    from kvlease.transports.zmq import ZmqTransport

    monkeypatch.setenv("KVLEASE_TEST_KEY", K1.hex())
    cfg = LeaseConfig(kv_lease_duration=3.0, max_access_time=0.2, vllm_compat=True, auth_keys=("env:KVLEASE_TEST_KEY",))
    p = Driver(
        ZmqTransport("P", bind="tcp://127.0.0.1:0"),
        pinner=Pinner(cfg, "P", random.getrandbits(63)),
        vllm_compat=True,
        log_interval=60.0,
    )
    d = Driver(ZmqTransport("D", bind="tcp://127.0.0.1:0"), accessor=Accessor(cfg, "D", session=11))
    try:
        ticket = p.grant("req-1")
        d.track("req-1", ticket, address=p.transport.address)
        _pump([p, d], lambda: d.accessor is not None and d.accessor.valid_until("req-1") is not None)
        forged = [
            encode(AccessDone("D", 0, 1, 11, ticket.incarnation, 0, ticket.lease_id, 1, False, LocalTime(1.0))),
            FrameAuth([K2]).seal(
                encode(AccessDone("D", 0, 1, 11, ticket.incarnation, 0, ticket.lease_id, 1, False, LocalTime(1.0)))
            ),
            encode_vllm_heartbeat(["req-1"]),
        ]
        # The attacker reaches P's socket like any peer would (ZMQ routes by address).
        attacker_dealer = zmq.Context.instance().socket(zmq.DEALER)
        attacker_dealer.setsockopt(zmq.IDENTITY, b"X\x000")
        attacker_dealer.connect(p.transport.address)
        for data in forged:
            attacker_dealer.send_multipart([b"M", data])
        _pump([p, d], lambda: p.stats.unauthenticated_messages >= 3)
        assert p.pinner is not None and p.pinner.info(ticket.lease_id) is not None  # not freed
        assert p.stats.malformed_messages == 0
        attacker_dealer.close(linger=0)
    finally:
        p.close()
        d.close()


def test_an_unkeyed_driver_refuses_sealed_frames() -> None:
    from kvlease.transports import Driver
    from kvlease.transports.zmq import ZmqTransport

    cfg = LeaseConfig(kv_lease_duration=3.0, max_access_time=0.2)
    p = Driver(ZmqTransport("P", bind="tcp://127.0.0.1:0"), pinner=Pinner(cfg, "P", 5), log_interval=60.0)
    try:
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, b"X\x000")
        dealer.connect(p.transport.address)
        dealer.send_multipart([b"M", FrameAuth([K1]).seal(encode(HB))])
        _pump([p], lambda: p.stats.unauthenticated_messages == 1)
        dealer.close(linger=0)
    finally:
        p.close()
