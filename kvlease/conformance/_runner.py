"""Replays conformance vectors against an implementation and reports the first mismatch.

An implementation is anything with ``call(request) -> response`` speaking the driver protocol
of spec/vectors/README.md: `CoreImplementation` in process, or the CLI's subprocess client for
an engine written in another language. The runner takes vectors as parsed JSON values: it never
opens a file, reads a clock or starts a process (the CLI and the tests do that).
"""

from __future__ import annotations

import contextlib
import difflib
import json
from collections.abc import Iterable
from typing import Protocol

import attrs

from .._codec import decode
from .._errors import DecodeError
from ._canonical import FLOAT_TOLERANCE, INFORMATIVE_KEYS, JSON, JSONDict, compare, message_to_json, strip_informative

__all__ = ["VECTOR_FORMAT", "Implementation", "Mismatch", "VectorResult", "run_vector", "run_vectors"]

#: The version of the vector file format (the ``format`` key of every vector).
VECTOR_FORMAT = 2


class Implementation(Protocol):
    """One JSON request in, one JSON response out (the driver protocol)."""

    def call(self, request: JSONDict) -> JSONDict: ...


@attrs.frozen
class Mismatch:
    """The first place an implementation disagreed with a vector."""

    vector: str
    index: int  # step (trace) or case (codec) number, from 0
    label: str
    why: str
    request: JSON
    expected: JSON
    actual: JSON

    def render(self) -> str:
        """A readable report: what was asked, why it failed, and a diff of the responses
        without the keys that do not bind (notes, reason texts), wire bytes shown decoded as
        well, so a wrong field is visible at a glance."""
        exp = json.dumps(_decorate(_for_diff(self.expected)), indent=2, sort_keys=True).splitlines()
        act = json.dumps(_decorate(_for_diff(self.actual)), indent=2, sort_keys=True).splitlines()
        diff = "\n".join(difflib.unified_diff(exp, act, "expected", "actual", lineterm=""))
        return (
            f"vector {self.vector!r}, {self.label}: {self.why}\n"
            f"request: {json.dumps(self.request, sort_keys=True)}\n{diff}"
        )


@attrs.frozen
class VectorResult:
    name: str
    kind: str
    description: str
    checked: int  # steps or cases that passed before the first mismatch (all, if none)
    total: int
    mismatch: Mismatch | None

    @property
    def passed(self) -> bool:
        return self.mismatch is None


def run_vectors(vectors: Iterable[JSONDict], impl: Implementation) -> list[VectorResult]:
    return [run_vector(v, impl) for v in vectors]


def run_vector(vector: JSONDict, impl: Implementation) -> VectorResult:
    """Replay one vector; stops at the first mismatch (later steps depend on earlier ones)."""
    name = str(vector.get("name", "?"))
    kind = str(vector.get("kind", "?"))
    desc = str(vector.get("description", ""))
    if vector.get("format") != VECTOR_FORMAT:
        why = f"unsupported vector format {vector.get('format')!r} (runner reads {VECTOR_FORMAT})"
        return VectorResult(name, kind, desc, 0, 0, Mismatch(name, -1, "header", why, None, None, None))
    if kind == "trace":
        return _run_trace(name, desc, vector, impl)
    if kind == "codec":
        return _run_codec(name, desc, vector, impl)
    why = f"unknown vector kind {kind!r}"
    return VectorResult(name, kind, desc, 0, 0, Mismatch(name, -1, "header", why, None, None, None))


def _call(impl: Implementation, request: JSONDict) -> JSONDict | str:
    try:
        resp = impl.call(request)
    except Exception as exc:  # a driver that dies or answers garbage is a failed check
        return f"the implementation failed: {type(exc).__name__}: {exc}"
    if not isinstance(resp, dict):
        return f"the implementation answered {type(resp).__name__}, not an object"
    return resp


def _run_trace(name: str, desc: str, vector: JSONDict, impl: Implementation) -> VectorResult:
    steps = vector.get("steps")
    steps = steps if isinstance(steps, list) else []
    total = len(steps)
    setup: JSONDict = {
        "cmd": "setup",
        "vector": name,
        "config": vector.get("config"),
        "endpoints": vector.get("endpoints"),
    }
    resp = _call(impl, setup)
    if isinstance(resp, str) or resp.get("ok") is not True:
        why = resp if isinstance(resp, str) else "setup was refused"
        why = str(why)
        mm = Mismatch(name, -1, "setup", why, setup, {"ok": True}, None if isinstance(resp, str) else resp)
        return VectorResult(name, "trace", desc, 0, total, mm)
    for i, step in enumerate(steps):
        if not isinstance(step, dict):
            mm = Mismatch(name, i, f"step {i}", "malformed step in the vector", None, None, None)
            return VectorResult(name, "trace", desc, i, total, mm)
        request: JSONDict = {
            "cmd": "step",
            "endpoint": step.get("endpoint"),
            "now": step.get("now"),
            "op": step.get("op"),
            "args": step.get("args", {}),
        }
        expected = step.get("expect")
        label = f"step {i} ({step.get('endpoint')} {step.get('op')} at now={step.get('now')})"
        resp = _call(impl, request)
        if isinstance(resp, str):
            return VectorResult(name, "trace", desc, i, total, Mismatch(name, i, label, resp, request, expected, None))
        actual = _response_view(resp, expected)
        diff = compare(strip_informative(expected), strip_informative(actual))
        if diff is None:
            diff = _check_deadline(request, expected, resp)
            if diff is not None:
                actual = {**actual, "next_deadline": resp.get("next_deadline")}
        if diff is not None:
            message = actual.get("error_message")
            if isinstance(message, str) and message:
                diff += f" (the implementation said: {message})"
            mm = Mismatch(name, i, label, diff, request, expected, actual)
            return VectorResult(name, "trace", desc, i, total, mm)
    return VectorResult(name, "trace", desc, total, total, None)


def _check_deadline(request: JSONDict, expected: JSON, resp: JSONDict) -> str | None:
    """`next_deadline` binds as a bound. The vector records ``next_work``: the first instant at
    which the endpoint has work (an output) if nothing else arrives. A conforming answer is a
    number no later than that (waking early is allowed, late is not); with no work pending,
    null or any number (a spurious wake-up is harmless). Right after `handle_timeout` it must be
    null or strictly after `now` (no busy loop)."""
    if not isinstance(expected, dict) or expected.get("ok") is not True or "next_work" not in expected:
        return None
    work, got, now = expected.get("next_work"), resp.get("next_deadline"), request.get("now")
    if got is not None and (not isinstance(got, int | float) or isinstance(got, bool)):
        return f"$.next_deadline: expected a number or null, got {got!r}"
    if isinstance(work, int | float):
        if got is None:
            return f"$.next_deadline: null, but work is due at {work!r}"
        if got > work + FLOAT_TOLERANCE:
            return f"$.next_deadline: {got!r} is later than the next work at {work!r} (it would run late)"
    if got is not None and isinstance(now, int | float) and request.get("op") == "handle_timeout" and got <= now:
        return f"$.next_deadline: {got!r} is not after now={now!r} right after handle_timeout (a busy loop)"
    return None


_BOUNDS = ("next_deadline", "next_work")


def _for_diff(v: JSON) -> JSON:
    """Drop the keys that do not bind (but keep the deadline keys, which bind as a bound)."""
    if isinstance(v, dict):
        return {k: _for_diff(x) for k, x in v.items() if k not in INFORMATIVE_KEYS or k in _BOUNDS}
    if isinstance(v, list):
        return [_for_diff(x) for x in v]
    return v


def _response_view(resp: JSONDict, expected: JSON) -> JSONDict:
    """The part of a response a vector binds: ok + result + outputs, or ok + error class
    (+ category for decode errors)."""
    if resp.get("ok") is True:
        return {"ok": True, "result": resp.get("result"), "outputs": resp.get("outputs")}
    # error_message is informative (compare skips it) but shown in the headline.
    err = resp.get("error")
    view: JSONDict = {"ok": resp.get("ok")}
    if isinstance(err, dict):
        want = expected.get("error") if isinstance(expected, dict) else None
        keep: set[str] = {"class"} | ({"category"} if isinstance(want, dict) and "category" in want else set())
        view["error"] = {k: v for k, v in err.items() if k in keep}
        view["error_message"] = err.get("error_message")
    else:
        view["error"] = err
    return view


def _run_codec(name: str, desc: str, vector: JSONDict, impl: Implementation) -> VectorResult:
    cases = vector.get("cases")
    cases = cases if isinstance(cases, list) else []
    total = len(cases)
    for i, case in enumerate(cases):
        if not isinstance(case, dict):
            mm = Mismatch(name, i, f"case {i}", "malformed case in the vector", None, None, None)
            return VectorResult(name, "codec", desc, i, total, mm)
        request: JSONDict = {"cmd": "decode", "codec": case.get("codec", "native"), "hex": case.get("hex")}
        if "keys" in case:
            request["keys"] = case["keys"]
        expected = case.get("expect")
        label = f"case {i} ({case.get('name')})"
        resp = _call(impl, request)
        if isinstance(resp, str):
            return VectorResult(name, "codec", desc, i, total, Mismatch(name, i, label, resp, request, expected, None))
        why = _check_codec_case(expected, resp)
        if why is not None:
            return VectorResult(name, "codec", desc, i, total, Mismatch(name, i, label, why, request, expected, resp))
    return VectorResult(name, "codec", desc, total, total, None)


def _check_codec_case(expected: JSON, resp: JSONDict) -> str | None:
    if not isinstance(expected, dict):
        return "malformed case in the vector (no expect object)"
    want_err = expected.get("error")
    if isinstance(want_err, dict):
        err = resp.get("error")
        if resp.get("ok") is not False or not isinstance(err, dict):
            return f"expected {want_err.get('class')}, but the bytes were accepted"
        if err.get("class") != want_err.get("class"):
            return f"expected error class {want_err.get('class')!r}, got {err.get('class')!r}"
        allowed = want_err.get("category")
        allowed_list = allowed if isinstance(allowed, list) else [allowed]
        if allowed is not None and err.get("category") not in allowed_list:
            return f"expected error category in {allowed_list}, got {err.get('category')!r}"
        return None
    if resp.get("ok") is not True:
        return f"expected the bytes to decode, got error {resp.get('error')!r}"
    return compare(strip_informative(expected.get("message")), strip_informative(resp.get("message")), "$.message")


def _decorate(v: JSON) -> JSON:
    """Add a decoded copy next to every native-frame ``hex`` (for diffs only)."""
    if isinstance(v, dict):
        out: JSONDict = {k: _decorate(x) for k, x in v.items()}
        hx = v.get("hex")
        if isinstance(hx, str) and "message" not in v:
            with contextlib.suppress(ValueError, DecodeError):
                out["message"] = message_to_json(decode(bytes.fromhex(hx)))
        return out
    if isinstance(v, list):
        return [_decorate(x) for x in v]
    return v
