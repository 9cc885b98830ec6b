"""The recording harness every vector family uses: `Recorder` and the small helpers around it.

`Recorder` runs one scenario against the Python core (through
`kvlease.conformance.CoreImplementation`, the object the reference driver wraps) along a scripted
schedule of real time, converts every call to the endpoint's own clock (each endpoint has its own
epoch), and records each call and the core's response as one step of a trace vector. The
helpers build endpoint descriptions (`pinner`, `accessor`), pick outputs out of a response
(`outs`, `only`, `only_type`), and script the exchanges most scenarios share (`connect`: the
side-channel handshake; `heartbeat_round`: one heartbeat round and its acks; `forged`: a frame
with some fields replaced). `BASE` is the config every vector uses unless it says otherwise.

This module owns how a scenario becomes JSON; it holds no scenario, and never writes a file.
"""

from __future__ import annotations

import copy
from typing import Any

import attrs

from kvlease import LeaseConfig, LocalTime, decode, encode
from kvlease.conformance import JSON, VECTOR_FORMAT, CoreImplementation, JSONDict

__all__ = [
    "BASE",
    "Recorder",
    "accessor",
    "connect",
    "forged",
    "heartbeat_round",
    "only",
    "only_type",
    "outs",
    "pinner",
]

#: Small timings keep vectors short: interval 1 s, extension 4 s, accessor extension ~3.949 s.
BASE = LeaseConfig(kv_lease_duration=6.0, decoder_kv_blocks_ttl=20.0, max_access_time=0.5)


class Recorder:
    """Runs one scenario against the core and records it as a trace vector."""

    def __init__(
        self, name: str, description: str, config: LeaseConfig, endpoints: JSONDict, epochs: dict[str, float]
    ) -> None:
        self.name = name
        self.description = description
        self.config = config
        self.endpoints = endpoints
        self.epochs = epochs
        self.impl = CoreImplementation(annotate=True)
        self.steps: list[JSONDict] = []
        self.t = 0.0  # real time, seconds since the scenario began
        resp = self.impl.call({"cmd": "setup", "config": attrs.asdict(config), "endpoints": endpoints})
        assert resp == {"ok": True}, resp

    def local(self, ep: str, t: float | None = None) -> float:
        return self.epochs[ep] + (self.t if t is None else t)

    def at(self, t: float) -> Recorder:
        assert t >= self.t, (t, self.t)
        self.t = t
        return self

    def step(self, ep: str, op: str, note: str = "", *, clock: float | None = None, **args: JSON) -> dict[str, Any]:
        """One call at the current real time (or at local reading `clock`, for misuse)."""
        now = self.local(ep) if clock is None else clock
        req: JSONDict = {"cmd": "step", "endpoint": ep, "now": now, "op": op, "args": args}
        resp = self.impl.call(req)
        expect: JSONDict
        if resp["ok"]:
            expect = {
                "ok": True,
                "result": resp["result"],
                "outputs": resp["outputs"],
                "next_deadline": resp["next_deadline"],
                "next_work": self.next_work(ep),
            }
        else:
            error = resp["error"]
            assert isinstance(error, dict), resp
            expect = {"ok": False, "error": {k: v for k, v in error.items() if k in ("class", "category")}}
        rec: JSONDict = {"endpoint": ep, "now": now, "op": op, "args": args, "expect": expect}
        if note:
            rec["note"] = note
        self.steps.append(rec)
        return resp

    def next_work(self, ep: str) -> float | None:
        """When `ep` next has work if nothing else arrives: the first instant at which
        handle_timeout, called at each successive reference deadline, has an output. A
        conforming next_deadline is never later than this (the reference's own may be earlier:
        its timers are lazy)."""
        probe = copy.deepcopy(self.impl._endpoints[ep])
        for _ in range(10_000):
            nd = probe.next_deadline()
            if nd is None:
                return None
            at = LocalTime(max(nd, probe._now))  # overdue work is due now
            if probe.handle_timeout(at):
                return float(at)
        raise AssertionError(f"{ep}: no work found along 10,000 deadlines")

    def deliver(self, ep: str, out: dict[str, Any], note: str = "") -> dict[str, Any]:
        return self.step(ep, "receive", note, hex=out["hex"])

    def vector(self) -> JSONDict:
        epochs: JSONDict = dict(self.epochs)
        steps: list[JSON] = list(self.steps)
        return {
            "format": VECTOR_FORMAT,
            "kind": "trace",
            "name": self.name,
            "description": self.description,
            "config": attrs.asdict(self.config),
            "endpoints": self.endpoints,
            "epochs_note": "each endpoint's clock = epoch + real time",
            "epochs": epochs,
            "steps": steps,
        }


def outs(resp: dict[str, Any], typ: str | None = None) -> list[dict[str, Any]]:
    return [o for o in resp["outputs"] if typ is None or o["type"] == typ]


def only(resp: dict[str, Any], typ: str) -> dict[str, Any]:
    found = outs(resp, typ)
    assert len(found) == 1 and len(resp["outputs"]) == 1, resp["outputs"]
    return found[0]


def only_type(resp: dict[str, Any], typ: str) -> dict[str, Any]:
    """The one output of type `typ` among others (heartbeats sent in the same step)."""
    found = outs(resp, typ)
    assert len(found) == 1, resp["outputs"]
    return found[0]


def pinner(engine_id: str, incarnation: int, rank: int = 0, ranks: int = 1) -> JSONDict:
    return {"role": "pinner", "engine_id": engine_id, "incarnation": incarnation, "rank": rank, "ranks": ranks}


def accessor(engine_id: str, rank: int = 0, ranks: int = 1, session: int = 0xACCE55) -> JSONDict:
    return {"role": "accessor", "engine_id": engine_id, "rank": rank, "ranks": ranks, "session": session}


def connect(r: Recorder, acc: str, pin: str, hs_out: dict[str, Any], t: float) -> None:
    """The side-channel handshake the driver performs after HandshakeNeeded."""
    reply = r.at(t).step(pin, "handshake", "the driver carries the handshake over its side channel", hex=hs_out["hex"])
    assert reply["ok"] and reply["outputs"] == []
    assert not r.at(t + 0.125).step(acc, "handshake_reply", hex=reply["result"]["hex"])["outputs"]


def heartbeat_round(
    r: Recorder, acc: str, pins: list[str], t: float, *, lose_to: bool = False, lose_back: bool = False
) -> list[dict[str, Any]]:
    """Accessor's due heartbeat at t, each send delivered to the pinner rank it addresses
    (`pins[rank]`) 0.25 s later, acks back 0.25 s after that. Returns the acks' receive
    responses."""
    hb = r.at(t).step(acc, "handle_timeout")
    sends = outs(hb, "Send")
    assert sends and all(s["message"]["type"] == "Heartbeat" for s in sends), hb
    if lose_to:
        return []
    acks: list[dict[str, Any]] = []
    for s in sends:
        ack = r.at(t + 0.25).deliver(pins[s["rank"]], s)
        acks.append(only(ack, "Send"))
    if lose_back:
        return []
    return [r.at(t + 0.5).deliver(acc, a) for a in acks]


def forged(hex_: str, **changes: Any) -> str:
    """The frame `hex_` with some fields replaced (what a faulty network or peer could carry)."""
    return encode(attrs.evolve(decode(bytes.fromhex(hex_)), **changes)).hex()
