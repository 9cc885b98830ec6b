"""`CoreImplementation`: the Python core behind the conformance driver protocol.

It answers the same JSON requests an external driver answers over stdin/stdout
(spec/vectors/README.md), by calling `Pinner` and `Accessor` through the public API. The
reference driver (`python -m kvlease.cli._conformance_driver`) is this object plus a line loop.
Pure: it never reads a clock or does I/O; every `now` comes from the request.
"""

from __future__ import annotations

from typing import Any

from .._accessor import Accessor
from .._auth import FrameAuth
from .._clock import LocalTime
from .._codec import decode, encode
from .._config import LeaseConfig
from .._errors import DecodeError, KvLeaseError
from .._events import Output
from .._messages import Handshake, HandshakeReply, LeaseKind, LeaseTicket
from .._pinner import Pinner
from .._vllm_compat import VllmHeartbeat, decode_vllm
from ._canonical import JSON, JSONDict, message_to_json, output_to_json

__all__ = ["CoreImplementation", "VectorFormatError"]


class VectorFormatError(KvLeaseError):
    """A vector or driver request is not in the documented format (a bug in the vector or
    the runner, never in the implementation under test)."""


def error_response(exc: BaseException) -> JSONDict:
    err: JSONDict = {"class": type(exc).__name__, "error_message": str(exc)}
    if isinstance(exc, DecodeError):
        err["category"] = exc.category
    return {"ok": False, "error": err}


class CoreImplementation:
    """Answers driver-protocol requests with the in-process Python core.

    `annotate` adds decoded copies of wire bytes to outputs (informative; the vector
    generator uses it so that humans can read the vectors).
    """

    def __init__(self, *, annotate: bool = False) -> None:
        self._annotate = annotate
        self._endpoints: dict[str, Pinner | Accessor] = {}

    def call(self, request: JSONDict) -> JSONDict:
        """One request in, one response out; the request's `cmd` selects what to do."""
        cmd = request.get("cmd")
        try:
            if cmd == "setup":
                return self._setup(request)
            if cmd == "step":
                return self._step(request)
            if cmd == "decode":
                return self._decode(request)
        except (KvLeaseError, ValueError) as exc:
            if isinstance(exc, VectorFormatError):
                raise
            return error_response(exc)
        raise VectorFormatError(f"unknown cmd {cmd!r}")

    # -- commands -----------------------------------------------------------------------------

    def _setup(self, request: JSONDict) -> JSONDict:
        cfg = request.get("config")
        eps = request.get("endpoints")
        if not isinstance(cfg, dict) or not isinstance(eps, dict):
            raise VectorFormatError("setup needs a config object and an endpoints object")
        config_fields: dict[str, Any] = dict(cfg)
        config = LeaseConfig(**config_fields)
        self._endpoints = {}
        for name, spec in eps.items():
            if not isinstance(spec, dict):
                raise VectorFormatError(f"endpoint {name!r} must be an object")
            role = spec.get("role")
            engine_id = _str(spec, "engine_id")
            rank, ranks = _int(spec, "rank", 0), _int(spec, "ranks", 1)
            # Format 2: an endpoint may run other settings than the vector's (a deployment
            # whose two sides were configured apart): its "config" overrides those keys.
            own = spec.get("config", {})
            if not isinstance(own, dict):
                raise VectorFormatError(f"endpoint {name!r}: config must be an object")
            ep_config = config.with_changes(**own) if own else config
            if role == "pinner":
                inc = _int(spec, "incarnation")
                self._endpoints[name] = Pinner(ep_config, engine_id, inc, rank=rank, ranks=ranks)
            elif role == "accessor":
                session = _int(spec, "session")
                self._endpoints[name] = Accessor(ep_config, engine_id, session=session, rank=rank, ranks=ranks)
            else:
                raise VectorFormatError(f"endpoint {name!r} has unknown role {role!r}")
        return {"ok": True}

    def _decode(self, request: JSONDict) -> JSONDict:
        data = _hex(request, "hex")
        codec = request.get("codec", "native")
        if codec == "native":
            return {"ok": True, "message": message_to_json(decode(data))}
        if codec == "sealed":  # a frame sealed with a deployment key: open with `keys`, then decode
            keys = request.get("keys")
            if not isinstance(keys, list) or not keys:
                raise VectorFormatError("a sealed decode needs a non-empty keys list (hex)")
            auth = FrameAuth([_hex({"key": k}, "key") for k in keys])
            return {"ok": True, "message": message_to_json(decode(auth.open(data)))}
        if codec == "vllm":
            return {"ok": True, "message": message_to_json(decode_vllm(data))}
        raise VectorFormatError(f"unknown codec {codec!r}")

    def _step(self, request: JSONDict) -> JSONDict:
        name = request.get("endpoint")
        ep = self._endpoints.get(name) if isinstance(name, str) else None
        if ep is None:
            raise VectorFormatError(f"no endpoint named {name!r}")
        now_raw = request.get("now")
        if not isinstance(now_raw, int | float) or isinstance(now_raw, bool):
            raise VectorFormatError(f"step needs a numeric now, got {now_raw!r}")
        now = LocalTime(float(now_raw))
        op = request.get("op")
        args = request.get("args", {})
        if not isinstance(args, dict) or not isinstance(op, str):
            raise VectorFormatError("step needs an op string and an args object")
        result: JSON = None
        outputs: tuple[Output, ...] = ()
        if isinstance(ep, Pinner):
            result, outputs = self._pinner_step(ep, now, op, args)
        else:
            result, outputs = self._accessor_step(ep, now, op, args)
        nd = ep.next_deadline()
        return {
            "ok": True,
            "result": result,
            "outputs": [output_to_json(o, annotate=self._annotate) for o in outputs],
            "next_deadline": None if nd is None else float(nd),
        }

    def _pinner_step(self, p: Pinner, now: LocalTime, op: str, args: dict[str, Any]) -> tuple[JSON, tuple[Output, ...]]:
        if op == "grant":
            ticket = p.grant(
                now,
                _str(args, "key"),
                kind=LeaseKind(_int(args, "kind", 0)),
                push=bool(args.get("push", False)),
                expected=args.get("expected"),
                ttl=args.get("ttl"),
                lease_id=args.get("lease_id"),
                accessor=args.get("accessor"),
            )
            result: JSON = dict(ticket.to_dict())
            return result, ()
        if op == "release":
            return None, p.release(now, _int(args, "lease_id"))
        if op == "receive":
            return None, p.receive(now, decode(_hex(args, "hex")))
        if op == "handshake":
            msg = decode(_hex(args, "hex"))
            if not isinstance(msg, Handshake):
                raise DecodeError(f"handshake op needs a Handshake, got {type(msg).__name__}", category="type")
            reply = p.handshake_reply(now, msg)
            return {"hex": encode(reply).hex()}, ()
        if op == "receive_vllm":
            note = decode_vllm(_hex(args, "hex"))
            if isinstance(note, VllmHeartbeat):
                return {"renewed": p.receive_vllm_heartbeat(now, note.request_ids)}, ()
            return None, p.receive_vllm_done(now, note.request_id, note.count)
        if op == "handle_timeout":
            return None, p.handle_timeout(now)
        raise VectorFormatError(f"unknown pinner op {op!r}")

    def _accessor_step(
        self, a: Accessor, now: LocalTime, op: str, args: dict[str, Any]
    ) -> tuple[JSON, tuple[Output, ...]]:
        if op == "track":
            ticket = LeaseTicket.from_dict(args.get("ticket"))
            return None, a.track(now, _str(args, "key"), ticket, push=bool(args.get("push", False)))
        if op == "untrack":
            return None, a.untrack(now, _str(args, "key"))
        if op == "begin_access":
            d = a.begin_access(now, _str(args, "key"))
            result: JSON = {
                "allowed": d.allowed,
                "guaranteed": d.guaranteed,
                "valid_until": None if d.valid_until is None else float(d.valid_until),
                "reason_text": d.reason,
                "notifications": [encode(n).hex() for n in d.notifications],
                "targets": list(d.targets),
            }
            return result, ()
        if op == "access_finished":
            return None, a.access_finished(now, _str(args, "key"), notified=bool(args.get("notified", False)))
        if op == "access_failed":
            return None, a.access_failed(now, _str(args, "key"), posted=bool(args.get("posted", True)))
        if op == "receive":
            return None, a.receive(now, decode(_hex(args, "hex")))
        if op == "handshake_reply":
            msg = decode(_hex(args, "hex"))
            if not isinstance(msg, HandshakeReply):
                raise DecodeError(
                    f"handshake_reply op needs a HandshakeReply, got {type(msg).__name__}", category="type"
                )
            return None, a.handshake_reply(now, msg)
        if op == "disconnect":
            return None, a.disconnect(now, _str(args, "engine_id"))
        if op == "handle_timeout":
            return None, a.handle_timeout(now)
        raise VectorFormatError(f"unknown accessor op {op!r}")


def _str(d: dict[str, Any], key: str) -> str:
    v = d.get(key)
    if not isinstance(v, str):
        raise VectorFormatError(f"{key!r} must be a string, got {v!r}")
    return v


def _int(d: dict[str, Any], key: str, default: int | None = None) -> int:
    v = d.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool):
        raise VectorFormatError(f"{key!r} must be an integer, got {v!r}")
    return v


def _hex(d: dict[str, Any], key: str) -> bytes:
    v = d.get(key)
    if not isinstance(v, str):
        raise VectorFormatError(f"{key!r} must be a hex string, got {v!r}")
    try:
        return bytes.fromhex(v)
    except ValueError:
        raise VectorFormatError(f"{key!r} is not valid hex: {v[:40]!r}") from None
