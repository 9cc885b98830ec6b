"""One recording wrapper around a core object: every call the simulator makes on a `Pinner` or
`Accessor` is written down as a conformance-vector step (spec/vectors/README.md), then made.

The simulator wraps its core objects only with ``Cluster(record=True)``, so a plain run pays
nothing; the cluster's code calls the core the same way either way. Which calls are steps, and
how their arguments are written, is the table `_STEPS` below, the one place that knows it.

Must never change what the wrapped object is asked or answers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

from .._codec import encode

__all__ = ["recording"]

_Core = TypeVar("_Core")

#: A step's arguments from the call's (after ``now``): None when the step has none.
_Args = Callable[..., dict[str, Any] | None]


def _none() -> None:
    return None


def _frame(msg: Any) -> dict[str, Any]:
    # Every frame the simulator hands the core is one `encode` produced, and the codec is
    # canonical: re-encoding the decoded message gives those bytes back.
    return {"hex": encode(msg).hex()}


def _key(key: str) -> dict[str, Any]:
    return {"key": key}


def _grant(key: str, *, push: bool, lease_id: int | None = None) -> dict[str, Any]:
    args: dict[str, Any] = {"key": key, "push": push}
    if lease_id is not None:
        args["lease_id"] = lease_id
    return args


def _track(key: str, ticket: Any, *, push: bool) -> dict[str, Any]:
    return {"key": key, "ticket": ticket.to_dict(), "push": push}


def _access_failed(key: str, *, posted: bool | None = None) -> dict[str, Any]:
    return {"key": key} if posted is None else {"key": key, "posted": posted}


def _access_finished(key: str, *, notified: bool = False) -> dict[str, Any]:
    return {"key": key, "notified": True} if notified else {"key": key}


def _disconnect(engine_id: str) -> dict[str, Any]:
    return {"engine_id": engine_id}


#: role -> method -> (the vector's op name, its arguments). Methods not listed (queries such
#: as `next_deadline`, `info`, `state_of`) are passed through unrecorded.
_STEPS: dict[str, dict[str, tuple[str, _Args]]] = {
    "pinner": {
        "handle_timeout": ("handle_timeout", _none),
        "receive": ("receive", _frame),
        "grant": ("grant", _grant),
        "handshake_reply": ("handshake", _frame),
    },
    "accessor": {
        "handle_timeout": ("handle_timeout", _none),
        "receive": ("receive", _frame),
        "handshake_reply": ("handshake_reply", _frame),
        "track": ("track", _track),
        "begin_access": ("begin_access", _key),
        "access_failed": ("access_failed", _access_failed),
        "access_finished": ("access_finished", _access_finished),
        "untrack": ("untrack", _key),
        "disconnect": ("disconnect", _disconnect),
    },
}


class _Recording:
    __slots__ = ("_endpoint", "_inner", "_real_time", "_steps", "_table")

    def __init__(
        self, inner: object, role: str, endpoint: str, steps: list[dict[str, Any]], real_time: Callable[[], float]
    ) -> None:
        self._inner = inner
        self._table = _STEPS[role]
        self._endpoint = endpoint
        self._steps = steps
        self._real_time = real_time

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        step = self._table.get(name)
        if step is None:
            return attr
        op, args_of = step

        def call(now: float, *args: Any, **kwargs: Any) -> Any:
            record: dict[str, Any] = {"endpoint": self._endpoint, "now": now, "op": op, "t": self._real_time()}
            args_ = args_of(*args, **kwargs)
            if args_:
                record["args"] = args_
            self._steps.append(record)
            return attr(now, *args, **kwargs)

        return call


def recording(
    core: _Core, role: str, endpoint: str, steps: list[dict[str, Any]], real_time: Callable[[], float]
) -> _Core:
    """`core` (a `Pinner` or `Accessor`, of role ``"pinner"`` / ``"accessor"``) with every
    call appended to `steps` as endpoint `endpoint`'s step, stamped with `real_time()`."""
    return cast(_Core, _Recording(core, role, endpoint, steps, real_time))
