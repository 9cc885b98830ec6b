"""The conformance runner and the in-process implementation judge malformed vectors and
malformed driver requests precisely: a typed VectorFormatError or a reported mismatch, never a
pass and never a crash of the runner."""

from __future__ import annotations

import pytest

from kvlease.conformance import JSON, Implementation, JSONDict
from kvlease.conformance._core import CoreImplementation, VectorFormatError
from kvlease.conformance._runner import run_vector

GOOD_SETUP: JSONDict = {
    "cmd": "setup",
    "config": {"kv_lease_duration": 6.0},
    "endpoints": {
        "P": {"role": "pinner", "engine_id": "prefill-0", "incarnation": 7},
        "D": {"role": "accessor", "engine_id": "decode-0", "session": 7},
    },
}


def _impl() -> CoreImplementation:
    impl = CoreImplementation()
    assert impl.call(GOOD_SETUP) == {"ok": True}
    return impl


@pytest.mark.parametrize(
    "request_",
    [
        {"cmd": "nonsense"},
        {"cmd": "setup", "config": None, "endpoints": {}},
        {"cmd": "setup", "config": {}, "endpoints": {"P": "pinner"}},
        {"cmd": "setup", "config": {}, "endpoints": {"X": {"role": "router", "engine_id": "x"}}},
        {"cmd": "setup", "config": {}, "endpoints": {"P": {"role": "pinner", "engine_id": 5, "incarnation": 1}}},
        {"cmd": "setup", "config": {}, "endpoints": {"P": {"role": "pinner", "engine_id": "p", "incarnation": "x"}}},
        # v2: an accessor needs its session (a uint64 incarnation), given as an integer.
        {"cmd": "setup", "config": {}, "endpoints": {"D": {"role": "accessor", "engine_id": "d"}}},
        {"cmd": "setup", "config": {}, "endpoints": {"D": {"role": "accessor", "engine_id": "d", "session": "7"}}},
        {"cmd": "setup", "config": {}, "endpoints": {"D": {"role": "accessor", "engine_id": "d", "session": True}}},
        {"cmd": "decode", "codec": "morse", "hex": "00"},
        {"cmd": "decode", "hex": 5},
        {"cmd": "decode", "hex": "zz"},
        {"cmd": "step", "endpoint": "nobody", "now": 1.0, "op": "handle_timeout", "args": {}},
        {"cmd": "step", "endpoint": "P", "now": "soon", "op": "handle_timeout", "args": {}},
        {"cmd": "step", "endpoint": "P", "now": 1.0, "op": 7, "args": {}},
        {"cmd": "step", "endpoint": "P", "now": 1.0, "op": "handle_timeout", "args": []},
        {"cmd": "step", "endpoint": "P", "now": 1.0, "op": "teleport", "args": {}},
        {"cmd": "step", "endpoint": "D", "now": 1.0, "op": "teleport", "args": {}},
        {"cmd": "step", "endpoint": "P", "now": 1.0, "op": "release", "args": {"lease_id": "one"}},
        {"cmd": "step", "endpoint": "D", "now": 1.0, "op": "untrack", "args": {"key": 3}},
        {"cmd": "step", "endpoint": "P", "now": 1.0, "op": "receive", "args": {"hex": "not hex"}},
    ],
)
def test_malformed_requests_are_a_vector_format_error(request_: JSONDict) -> None:
    with pytest.raises(VectorFormatError):
        _impl().call(request_)


def _error(resp: JSONDict) -> JSONDict:
    """The error object of a response that must be a refusal."""
    err = resp["error"]
    assert resp["ok"] is False and isinstance(err, dict), resp
    return err


def test_protocol_errors_are_answered_as_errors_not_raised() -> None:
    impl = _impl()
    err = _error(impl.call({"cmd": "decode", "hex": "c14b00"}))  # the magic, then a lone 0: not an array
    assert err["class"] == "DecodeError" and err["category"] == "body"
    resp = impl.call({"cmd": "step", "endpoint": "P", "now": 5.0, "op": "handle_timeout", "args": {}})
    assert resp["ok"] is True
    back = impl.call({"cmd": "step", "endpoint": "P", "now": 1.0, "op": "handle_timeout", "args": {}})
    assert _error(back)["class"] == "LocalProtocolError"
    # v2: times beyond 2**32 and sessions beyond uint64 are the caller's misuse, answered as such.
    far = impl.call({"cmd": "step", "endpoint": "P", "now": 2.0**33, "op": "handle_timeout", "args": {}})
    assert _error(far)["class"] == "LocalProtocolError"
    for session in (-1, 1 << 64):
        bad: JSONDict = {"role": "accessor", "engine_id": "d", "session": session}
        resp = impl.call({"cmd": "setup", "config": {}, "endpoints": {"D": bad}})
        assert _error(resp)["class"] == "LocalProtocolError"


@pytest.mark.parametrize(
    ("op", "hex_", "category"),
    [
        ("receive", "c14b9103", "body"),  # an array of one item
        ("receive", "c14b920363", "type"),  # version 3, type 99
        ("handshake", "c14b920363", "type"),
    ],
)
def test_a_decode_error_in_a_step_carries_its_category(op: str, hex_: str, category: str) -> None:
    """The category in the response is the exception's own (`DecodeError.category`), whatever
    its message says."""
    err = _error(_impl().call({"cmd": "step", "endpoint": "P", "now": 1.0, "op": op, "args": {"hex": hex_}}))
    assert err["class"] == "DecodeError" and err["category"] == category


def test_a_handshake_op_given_another_message_is_a_type_error() -> None:
    from kvlease import Release, encode

    release = encode(Release("decode-0", 0, 1, 7, 7, (1,))).hex()
    err = _error(
        _impl().call({"cmd": "step", "endpoint": "P", "now": 1.0, "op": "handshake", "args": {"hex": release}})
    )
    assert (
        err["class"] == "DecodeError" and err["category"] == "type" and "needs a Handshake" in str(err["error_message"])
    )


def _trace(**over: JSON) -> JSONDict:
    v: JSONDict = {
        "format": "kvlease-vector/1",
        "kind": "trace",
        "name": "t",
        "config": GOOD_SETUP["config"],
        "endpoints": GOOD_SETUP["endpoints"],
        "steps": [],
    }
    v.update(over)
    return v


class _Raises:
    def call(self, request: JSONDict) -> JSONDict:
        raise RuntimeError("driver died")


class _NotADict:
    """Breaks the `Implementation` contract (an object per request), as a buggy driver may."""

    def call(self, request: JSONDict) -> JSONDict:
        return ["ok"]  # type: ignore[return-value]  # the broken contract is what the runner must survive


class _RefusesSetup:
    def call(self, request: JSONDict) -> JSONDict:
        return {"ok": False, "error": {"class": "ConfigError"}}


def test_runner_reports_malformed_vectors_and_broken_implementations() -> None:
    from kvlease.conformance import VECTOR_FORMAT

    fmt = VECTOR_FORMAT
    assert run_vector(_trace(format="other/9"), _impl()).mismatch is not None
    assert run_vector(_trace(format=fmt, kind="poem"), _impl()).mismatch is not None
    assert run_vector(_trace(format=fmt, steps=["not a step"]), CoreImplementation()).mismatch is not None
    broken: tuple[Implementation, ...] = (_Raises(), _NotADict(), _RefusesSetup())
    for impl in broken:
        res = run_vector(_trace(format=fmt), impl)
        assert res.mismatch is not None and res.mismatch.label == "setup"
        assert res.mismatch.render()
    codec: JSONDict = {"format": fmt, "kind": "codec", "name": "c", "cases": ["nope"]}
    assert run_vector(codec, CoreImplementation()).mismatch is not None
    bad_expect: JSONDict = {"format": fmt, "kind": "codec", "name": "c", "cases": [{"hex": "c14b00", "expect": 3}]}
    assert run_vector(bad_expect, CoreImplementation()).mismatch is not None
    wants_error: JSONDict = {
        "format": fmt,
        "kind": "codec",
        "name": "c",
        "cases": [{"hex": "c14b9802030000", "expect": {"error": {"class": "EncodeError"}}}],
    }
    assert run_vector(wants_error, CoreImplementation()).mismatch is not None
    wants_ok: JSONDict = {
        "format": fmt,
        "kind": "codec",
        "name": "c",
        "cases": [{"hex": "c14b00", "expect": {"message": {}}}],
    }
    assert run_vector(wants_ok, CoreImplementation()).mismatch is not None
    for impl in broken[:2]:
        res = run_vector({"format": fmt, "kind": "codec", "name": "c", "cases": [{"hex": "00", "expect": {}}]}, impl)
        assert res.mismatch is not None
