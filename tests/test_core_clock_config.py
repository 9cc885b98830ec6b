"""`ClockOffsetEstimator` (min-delay filter, error growing with age, conservative conversion
under bounded drift) and `LeaseConfig` (validation names the field; derived values)."""

from __future__ import annotations

import math

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlease import (
    MAX_TIME,
    MIN_MESSAGE_BYTES,
    MIN_VALIDITY_MARGIN,
    Accessor,
    ClockOffsetEstimator,
    ClockSample,
    ConfigError,
    LeaseConfig,
    LeaseTicket,
    LocalProtocolError,
    LocalTime,
    PeerTime,
    Pinner,
    RemoteProtocolError,
)
from kvlease._clock import check_time
from kvlease.testing import PeerClock


def _sample(t1: float, t2: float, t3: float, t4: float) -> ClockSample:
    return ClockSample(LocalTime(t1), PeerTime(t2), PeerTime(t3), LocalTime(t4))


def test_offset_and_delay_of_one_round_trip() -> None:
    s = _sample(100.0, 5100.2, 5100.3, 100.5)
    assert s.offset == pytest.approx(5000.0)
    assert s.delay == pytest.approx(0.4)


def test_min_delay_filter_picks_the_tightest_sample() -> None:
    est = ClockOffsetEstimator(max_drift_rate=0.0, window=4)
    assert est.estimate(LocalTime(0.0)) is None
    assert est.to_local_deadline(LocalTime(0.0), PeerTime(1.0)) is None
    est.add_sample(_sample(0.0, 1000.5, 1000.5, 1.0))  # delay 1.0
    est.add_sample(_sample(2.0, 1002.05, 1002.05, 2.1))  # delay 0.1: the best
    est.add_sample(_sample(3.0, 1003.4, 1003.4, 3.8))  # delay 0.8
    e = est.estimate(LocalTime(4.0))
    assert e is not None and e.offset == pytest.approx(1000.0) and e.error == pytest.approx(0.05)
    assert est.sample_count == 3


def test_window_forgets_the_oldest_samples() -> None:
    est = ClockOffsetEstimator(max_drift_rate=0.0, window=2)
    est.add_sample(_sample(0.0, 10.0, 10.0, 0.0))  # perfect, but will fall out of the window
    est.add_sample(_sample(1.0, 11.5, 11.5, 2.0))
    est.add_sample(_sample(3.0, 13.5, 13.5, 4.0))
    e = est.estimate(LocalTime(5.0))
    assert est.sample_count == 2 and e is not None and e.error == pytest.approx(0.5)


def test_error_bound_grows_with_age() -> None:
    rho = 1e-3
    est = ClockOffsetEstimator(max_drift_rate=rho)
    est.add_sample(_sample(10.0, 20.05, 20.05, 10.1))
    errs = [est.estimate(LocalTime(t)) for t in (10.1, 100.0, 1000.0)]
    assert all(e is not None for e in errs)
    e0, e1, e2 = (e.error for e in errs if e is not None)
    assert e0 < e1 < e2
    assert e2 - e1 >= 2 * rho * 900.0  # at least twice the drift rate (both clocks drift)


def test_add_sample_misuse_and_peer_errors() -> None:
    est = ClockOffsetEstimator(max_drift_rate=1e-4)
    with pytest.raises(RemoteProtocolError, match="non-finite"):
        est.add_sample(_sample(0.0, math.nan, 1.0, 1.0))
    with pytest.raises(LocalProtocolError, match="before sent"):
        est.add_sample(_sample(2.0, 5.0, 5.0, 1.0))
    with pytest.raises(RemoteProtocolError, match="before it received"):
        est.add_sample(_sample(0.0, 5.0, 4.0, 1.0))
    est.add_sample(_sample(5.0, 9.0, 9.0, 6.0))
    with pytest.raises(LocalProtocolError, match="receive order"):
        est.add_sample(_sample(1.0, 9.0, 9.0, 2.0))


@given(
    peer_epoch=st.floats(1e4, 2e5),
    local_epoch=st.floats(1e4, 2e5),
    signs=st.tuples(st.sampled_from([-1.0, 0.0, 1.0, 0.3]), st.sampled_from([-1.0, 0.0, 1.0, -0.7])),
    rho=st.sampled_from([0.0, 1e-5, 1e-4, 1e-2]),
    trips=st.lists(st.tuples(st.floats(0.0, 50.0), st.floats(0.0, 0.5), st.floats(0.0, 0.5)), min_size=1, max_size=6),
    later=st.floats(0.0, 500.0),
    ahead=st.floats(-100.0, 1000.0),
)
def test_conversion_is_never_later_than_the_truth(
    peer_epoch: float,
    local_epoch: float,
    signs: tuple[float, float],
    rho: float,
    trips: list[tuple[float, float, float]],
    later: float,
    ahead: float,
) -> None:
    """Whatever the clocks do within the drift bound and whatever the delays, the converted
    deadline is an instant at or before the real one."""
    peer = PeerClock(peer_epoch, 1.0 + signs[0] * rho)
    local = PeerClock(local_epoch, 1.0 + signs[1] * rho)
    est = ClockOffsetEstimator(max_drift_rate=rho, window=4)
    real = 0.0
    for gap, d_out, d_back in trips:
        real += gap
        t1 = local.local(real)
        t2 = peer.local(real + d_out)
        t4 = local.local(real + d_out + d_back)
        est.add_sample(ClockSample(t1, PeerTime(t2), PeerTime(t2), t4))
        real += d_out + d_back
    real += later
    now = local.local(real)
    deadline = PeerTime(peer.local(real) + ahead)
    got = est.to_local_deadline(now, deadline)
    assert got is not None
    truth_real = peer.real(deadline)
    assert local.real(got) <= truth_real + 1e-9 * max(1.0, abs(truth_real))


# -- LeaseConfig -------------------------------------------------------------------------------


def test_defaults_equal_vllm_at_30s() -> None:
    c = LeaseConfig()
    assert c.kv_lease_duration == 30.0 and c.decoder_kv_blocks_ttl == 480.0
    assert c.heartbeat_interval == 5.0 and c.lease_extension == 20.0
    assert c.accessor_extension < c.lease_extension
    assert c.accessor_extension == pytest.approx(20.0 * (1 - 1e-4) / (1 + 1e-4) - 0.05)
    assert c.push_guard == c.access_time_local == pytest.approx(2.0 * (1 + 1e-4))


@pytest.mark.parametrize("duration", [0.3, 0.6, 0.999, 5.99])
def test_sub_second_and_short_durations_work(duration: float) -> None:
    """vLLM's ``duration // 6`` is 0 below 6 s; here the derived values are exact fractions."""
    c = LeaseConfig(kv_lease_duration=duration, validity_margin=0.01)
    assert c.heartbeat_interval == pytest.approx(duration / 6) and c.heartbeat_interval > 0
    assert c.lease_extension == pytest.approx(duration * 2 / 3)
    assert c.accessor_extension > c.heartbeat_interval


BAD_FIELDS: list[tuple[str, object]] = [
    ("kv_lease_duration", 0.0),
    ("kv_lease_duration", -1.0),
    ("kv_lease_duration", math.nan),
    ("kv_lease_duration", math.inf),
    ("kv_lease_duration", 86401.0),
    ("kv_lease_duration", True),
    ("kv_lease_duration", "30"),
    ("decoder_kv_blocks_ttl", 0.0),
    ("decoder_kv_blocks_ttl", 7 * 86400.0 + 1),
    ("max_drift_rate", -1e-9),
    ("max_drift_rate", 0.02),
    ("max_drift_rate", math.nan),
    ("max_access_time", -0.1),
    ("max_access_time", math.inf),
    ("validity_margin", -0.01),
    ("validity_margin", 0.0),  # v2: the safety lemma needs a margin > 0 ...
    ("validity_margin", MIN_VALIDITY_MARGIN / 2),  # ... of at least 1 ms
    ("validity_margin", 30.0),  # leaves no validity window at a 30 s lease
    ("max_message_bytes", 127),
    ("max_message_bytes", MIN_MESSAGE_BYTES - 1),  # v2: a heartbeat chunk and its ack must fit
    ("max_message_bytes", (1 << 20) + 1),
    ("max_message_bytes", 1024.0),
    ("tombstone_limit", -1),
    ("tombstone_limit", True),
    ("max_outstanding_heartbeats", 0),
    ("clock_sample_window", 0),
    ("clock_sample_window", 4097),
    ("vllm_compat", 1),
    ("auth_keys", ("KVLEASE_KEY",)),  # a source is env:NAME or file:PATH
    ("auth_keys", ("env:A", "env:B", "env:C")),  # the current key and at most one previous
    ("auth_allow_vllm_compat", 1),
]


@pytest.mark.parametrize(("field", "value"), BAD_FIELDS)
def test_every_bad_value_raises_config_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        LeaseConfig(**{field: value})  # type: ignore[arg-type]  # a bad value on purpose
    assert info.value.field == field
    assert field in str(info.value)
    assert isinstance(info.value, ValueError)


def test_every_field_is_covered_by_a_bad_value() -> None:
    names = {a.name for a in attrs.fields(LeaseConfig)}
    assert names == {f for f, _ in BAD_FIELDS}


def test_the_smallest_allowed_values_are_accepted() -> None:
    c = LeaseConfig(validity_margin=MIN_VALIDITY_MARGIN, max_message_bytes=MIN_MESSAGE_BYTES)
    assert (MIN_VALIDITY_MARGIN, MIN_MESSAGE_BYTES) == (1e-3, 192)
    assert c.accessor_extension > 0


def test_the_smallest_message_bound_fits_the_engine_ids_it_promises() -> None:
    """At 192 bytes a pinner id of 51 bytes and an accessor id of 124 bytes still leave room for
    a full-size lease id in a heartbeat and its ack; one byte more is a ConfigError naming the
    setting (heartbeat_id_budget = mmb - max(52 + accessor id, 125 + pinner id) >= 16)."""
    c = LeaseConfig(max_message_bytes=MIN_MESSAGE_BYTES)
    Pinner(c, "p" * 51, 1)
    Accessor(c, "a" * 124, session=1)
    with pytest.raises(ConfigError, match="max_message_bytes"):
        Pinner(c, "p" * 52, 1)
    with pytest.raises(ConfigError, match="max_message_bytes"):
        Accessor(c, "a" * 125, session=1)
    with pytest.raises(ConfigError, match="max_message_bytes"):
        Pinner(c, "\u00e9" * 26, 1)  # 52 bytes: the bound counts bytes, not characters


def test_check_time_bounds() -> None:
    for ok in (0.0, MAX_TIME, -MAX_TIME, 1e-300):
        check_time(ok)
    for bad in (math.nan, math.inf, -math.inf, MAX_TIME + 1, -(MAX_TIME + 1), math.nextafter(MAX_TIME, math.inf)):
        with pytest.raises(LocalProtocolError, match="2\\*\\*32"):
            check_time(bad)


def test_config_is_frozen_and_with_changes_validates() -> None:
    c = LeaseConfig()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        c.kv_lease_duration = 1.0  # type: ignore[misc]  # assigning to a frozen field is the point
    assert c.with_changes(kv_lease_duration=3.0).heartbeat_interval == 0.5
    with pytest.raises(ConfigError, match="max_message_bytes"):
        c.with_changes(max_message_bytes=1)


# -- LeaseTicket -------------------------------------------------------------------------------


@given(
    st.builds(
        LeaseTicket,
        st.text(min_size=1, max_size=20),
        st.integers(0, 2**64 - 1),
        st.integers(0, 2**64 - 1),
        ranks=st.integers(1, 64),
    )
)
def test_ticket_round_trips_through_a_dict(tk: LeaseTicket) -> None:
    assert LeaseTicket.from_dict(tk.to_dict()) == tk


def test_fixed_ticket_round_trips() -> None:
    from kvlease import LeaseKind

    tk = LeaseTicket("p", 1, 2, LeaseKind.FIXED_TTL, PeerTime(123.5), 4)
    assert LeaseTicket.from_dict(tk.to_dict()) == tk


@pytest.mark.parametrize(
    "d",
    [
        [],
        {},
        {"engine_id": "", "incarnation": 1, "lease_id": 1},
        {"engine_id": 3, "incarnation": 1, "lease_id": 1},
        {"engine_id": "p", "incarnation": -1, "lease_id": 1},
        {"engine_id": "p", "incarnation": 1, "lease_id": 2**64},
        {"engine_id": "p", "incarnation": 1, "lease_id": True},
        {"engine_id": "p", "incarnation": 1, "lease_id": 1, "ranks": 0},
        {"engine_id": "p", "incarnation": 1, "lease_id": 1, "kind": 7},
        {"engine_id": "p", "incarnation": 1, "lease_id": 1, "kind": 1},
        {"engine_id": "p", "incarnation": 1, "lease_id": 1, "kind": 1, "deadline": "soon"},
        {"engine_id": "p", "incarnation": 2**53, "lease_id": 1},  # a JSON number may be rounded
        {"engine_id": "p", "incarnation": "-1", "lease_id": 1},
        {"engine_id": "p", "incarnation": "1e3", "lease_id": 1},
        {"engine_id": "p", "incarnation": str(2**64), "lease_id": 1},
        {"engine_id": "p", "incarnation": "١٢", "lease_id": 1},  # non-ASCII digits
    ],
)
def test_malformed_tickets_are_remote_errors(d: object) -> None:
    with pytest.raises(RemoteProtocolError):
        LeaseTicket.from_dict(d)


def test_a_64_bit_incarnation_survives_a_router_that_parses_numbers_as_doubles() -> None:
    """Issue 21.3: the ticket's 64-bit fields travel as decimal strings, so a JSON stack that
    reads numbers as doubles (JavaScript, many proxies) cannot round them."""
    import json

    tk = LeaseTicket("prefill-0", 2**64 - 59, 2**60 + 1, ranks=2)
    d = tk.to_dict()
    assert d["incarnation"] == str(2**64 - 59) and d["lease_id"] == str(2**60 + 1)

    def js_router(doc: dict[str, object]) -> dict[str, object]:
        """What a JSON stack with doubles only (JavaScript, many proxies) passes on: numbers
        read as doubles and written back as integers when integral."""
        parsed = json.loads(json.dumps(doc), parse_int=float)
        return {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in parsed.items()}

    assert LeaseTicket.from_dict(js_router(d)) == tk
    as_number = {**d, "incarnation": tk.incarnation}  # what v2 wrote
    assert js_router(as_number)["incarnation"] != tk.incarnation  # rounded on the way
    with pytest.raises(RemoteProtocolError, match="decimal string"):
        LeaseTicket.from_dict(js_router(as_number))
    # An integer below 2**53 is exact in every stack, so it is still accepted.
    assert LeaseTicket.from_dict({"engine_id": "p", "incarnation": 2**53 - 1, "lease_id": 3}).incarnation == 2**53 - 1


def test_a_sealed_ticket_binds_the_memory_it_guards() -> None:
    """Issue 21.3 / 23.3: under a deployment key a ticket carries a tag over itself and the
    bytes naming what it guards; without the key it cannot be forged, altered, or moved to
    another request."""
    from kvlease import FrameAuth

    auth, other = FrameAuth([b"k" * 32]), FrameAuth([b"x" * 32])
    tk = LeaseTicket("prefill-0", 2**63 + 5, 7)
    d = tk.sealed_dict(auth, b"req-a|1,2,3")
    assert LeaseTicket.from_dict(d, auth=auth, bind=b"req-a|1,2,3") == tk
    assert LeaseTicket.from_dict(d) == tk  # no key configured: the tag is not checked
    rotated = FrameAuth([b"n" * 32, b"k" * 32])  # a rotation accepts the previous key's tag
    assert LeaseTicket.from_dict(d, auth=rotated, bind=b"req-a|1,2,3") == tk
    bad = [
        (tk.to_dict(), b"req-a|1,2,3", "carries no tag"),  # unsealed
        (d, b"req-b|1,2,3", "matches no key"),  # moved to another request's blocks
        ({**d, "lease_id": "8"}, b"req-a|1,2,3", "matches no key"),  # altered
        ({**d, "tag": "zz"}, b"req-a|1,2,3", "matches no key"),  # not hex
    ]
    for sealed, bind, why in bad:
        with pytest.raises(RemoteProtocolError, match=why):
            LeaseTicket.from_dict(sealed, auth=auth, bind=bind)
    with pytest.raises(RemoteProtocolError, match="matches no key"):
        LeaseTicket.from_dict(d, auth=other, bind=b"req-a|1,2,3")
    from kvlease import LeaseKind

    fixed = LeaseTicket("p", 1, 2, LeaseKind.FIXED_TTL, PeerTime(9.5))
    moved = {**fixed.sealed_dict(auth, b""), "deadline": 99.5}  # a later deadline: refused
    with pytest.raises(RemoteProtocolError):
        LeaseTicket.from_dict(moved, auth=auth)
