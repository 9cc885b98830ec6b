#!/usr/bin/env python3
"""Generate the conformance vectors in spec/vectors/ (run by hand, commit the JSON).

    .venv/bin/python tools/generate_vectors.py [--check]

Each scenario drives the Python core (through `kvlease.conformance.CoreImplementation`, the
same object the reference driver wraps) along a scripted schedule of real time, converts every
call to the endpoint's own clock (each endpoint has its own random-looking epoch), and records
the responses as the expectation. The scripts also *assert* the protocol properties the
scenario exists to show (a free at the right instant, no free while heartbeats flow, ...), so
a core change that alters the meaning of a vector fails here instead of silently rewriting
the normative expectation. The recorded JSON was read by a human; regenerate only on purpose
and review the diff. `--check` regenerates in memory and fails if any file would change.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import attrs

from kvlease import (
    PROTOCOL_VERSION,
    AccessDone,
    AccessDoneAck,
    Accessor,
    AccessOutcome,
    Handshake,
    HandshakeReply,
    Heartbeat,
    HeartbeatAck,
    LeaseConfig,
    LocalTime,
    Message,
    PeerTime,
    Release,
    encode,
    encode_vllm_done,
    encode_vllm_heartbeat,
)
from kvlease.conformance import JSON, VECTOR_FORMAT, CoreImplementation, JSONDict, message_to_json

HERE = Path(__file__).resolve().parent.parent / "spec" / "vectors"

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
        import copy

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


# -- scenarios --------------------------------------------------------------------------------


def happy_pull() -> Recorder:
    r = Recorder(
        "happy_pull",
        "Pull mode: grant, track, handshake, one heartbeat round, a "
        "guaranteed READ, access-done frees the blocks; a duplicate access-done is a no-op.",
        BASE,
        {"P": pinner("prefill-0", 0x5EED0001), "D": accessor("decode-0")},
        {"P": 14021.5, "D": 98333.25},
    )
    ticket = r.at(0.0).step("P", "grant", key="req-1")["result"]
    hs = only(r.at(0.25).step("D", "track", key="req-1", ticket=ticket), "HandshakeNeeded")
    connect(r, "D", "P", hs, 0.375)
    acks = heartbeat_round(r, "D", ["P"], 0.5)
    assert all(a["outputs"] == [] for a in acks)
    dec = r.at(1.25).step("D", "begin_access", key="req-1")["result"]
    assert dec["allowed"] and dec["guaranteed"]
    assert abs(dec["valid_until"] - (r.local("D", 0.5) + BASE.accessor_extension)) < 1e-9
    fin = r.at(1.5).step("D", "access_finished", key="req-1")
    done, completed = fin["outputs"]
    assert done["message"]["type"] == "AccessDone" and not done["message"]["confirm"]
    assert completed == {"type": "AccessCompleted", "key": "req-1", "lease_id": 1, "confirmed_by_pinner": False}
    free = only(r.at(1.75).deliver("P", done), "Free")
    assert free["reason"] == "access_done" and free["at"] == r.local("P")
    assert r.at(2.0).deliver("P", done, "duplicate access-done: never a second free")["outputs"] == []
    assert r.at(7.0).step("P", "handle_timeout")["outputs"] == []
    assert r.at(7.0).step("D", "handle_timeout")["outputs"] == []
    return r


def overload_long_queue() -> Recorder:
    r = Recorder(
        "overload_long_queue",
        "Pull mode: the request waits in the decoder's queue for "
        "30 s (5 lease durations); heartbeats every interval keep the lease, so nothing is "
        "freed until the READ completes.",
        BASE,
        {"P": pinner("prefill-0", 0x5EED0002), "D": accessor("decode-0")},
        {"P": 51234.75, "D": 1234.5},
    )
    ticket = r.at(0.0).step("P", "grant", key="req-q")["result"]
    hs = only(r.at(0.0).step("D", "track", key="req-q", ticket=ticket), "HandshakeNeeded")
    connect(r, "D", "P", hs, 0.25)
    t = 0.375
    while t < 30.0:
        heartbeat_round(r, "D", ["P"], t)
        assert r.at(t + 0.5).step("P", "handle_timeout")["outputs"] == [], "freed while heartbeating"
        assert r.at(t + 0.5).step("D", "handle_timeout")["outputs"] == []
        t += BASE.heartbeat_interval
    dec = r.at(t).step("D", "begin_access", key="req-q")["result"]
    assert dec["allowed"] and dec["guaranteed"]
    fin = r.at(t + 0.25).step("D", "access_finished", key="req-q")
    assert outs(fin, "AccessCompleted")
    free = only(r.at(t + 0.5).deliver("P", outs(fin, "Send")[0]), "Free")
    assert free["reason"] == "access_done"
    return r


def accessor_crash_expiry() -> Recorder:
    r = Recorder(
        "accessor_crash_expiry",
        "The decoder crashes after two heartbeats: the pinner "
        "frees exactly extension (4 s) after the last heartbeat it handled, not one tick "
        "earlier. A lease no accessor ever tracked frees at grant + duration. A heartbeat "
        "delayed past the free is answered 'expired' and frees nothing twice.",
        BASE,
        {"P": pinner("prefill-0", 0x5EED0003), "D": accessor("decode-0")},
        {"P": 77000.0, "D": 20480.125},
    )
    ticket = r.at(0.0).step("P", "grant", key="req-1")["result"]
    r.at(0.0).step("P", "grant", key="req-2", note="never tracked by any accessor")
    hs = only(r.at(0.0).step("D", "track", key="req-1", ticket=ticket), "HandshakeNeeded")
    connect(r, "D", "P", hs, 0.25)
    for t in (0.375, 1.375, 2.375):
        heartbeat_round(r, "D", ["P"], t)
    late = outs(r.at(3.375).step("D", "handle_timeout"), "Send")[0]
    r.at(3.625).deliver("P", late, "the last heartbeat the pinner handles; the decoder dies now")
    last_hb_recv = 3.625
    # A copy of its final heartbeat is stuck in the network.
    stuck = outs(
        r.at(4.375).step("D", "handle_timeout", note="the accessor's final heartbeat; it is delayed in the network"),
        "Send",
    )[0]
    expiry = last_hb_recv + BASE.lease_extension
    assert r.at(5.875).step("P", "handle_timeout")["outputs"] == []
    free2 = only(r.at(6.0).step("P", "handle_timeout", note="req-2: grant + duration"), "Free")
    assert free2["key"] == "req-2" and free2["reason"] == "expired"
    assert r.at(expiry - 0.125).step("P", "handle_timeout")["outputs"] == []
    free = only(r.at(expiry).step("P", "handle_timeout", note="last heartbeat + extension"), "Free")
    assert free == {**free, "key": "req-1", "reason": "expired", "at": r.local("P", expiry)}
    ack = only(r.at(expiry + 1.0).deliver("P", stuck, "the delayed heartbeat arrives after the free"), "Send")
    assert ack["message"]["expired"] == [1] and ack["message"]["renewed"] == 0
    assert r.at(expiry + 2.0).step("P", "handle_timeout")["outputs"] == []
    return r


def late_read() -> Recorder:
    r = Recorder(
        "late_read",
        "A partition cuts the pinner off after one acknowledged heartbeat. "
        "req-1: the READ starts inside validity but is not covered for the access-time "
        "bound, ends after validity, so the accessor asks the pinner; the pinner had "
        "expired it and answers STALE: the data is never reported valid. req-2 (no "
        "access) is given up one lease duration after its last acknowledged heartbeat "
        "was sent (a lapsed window alone is not a loss).",
        BASE,
        {"P": pinner("prefill-0", 0x5EED0004), "D": accessor("decode-0")},
        {"P": 31337.0, "D": 4096.75},
    )
    t1 = r.at(0.0).step("P", "grant", key="req-1")["result"]
    t2 = r.at(0.0).step("P", "grant", key="req-2")["result"]
    hs = only(r.at(0.0).step("D", "track", key="req-1", ticket=t1), "HandshakeNeeded")
    assert r.at(0.0).step("D", "track", key="req-2", ticket=t2)["outputs"] == []
    connect(r, "D", "P", hs, 0.25)
    heartbeat_round(r, "D", ["P"], 0.375)
    valid_until = r.local("D", 0.375) + BASE.accessor_extension
    # Partition: heartbeats from here on are lost.
    t = 1.375
    while t < 3.9:
        heartbeat_round(r, "D", ["P"], t, lose_to=True)
        t += 1.0
    dec = r.at(4.0).step("D", "begin_access", key="req-1")["result"]
    assert dec["allowed"] and not dec["guaranteed"] and abs(dec["valid_until"] - valid_until) < 1e-9
    assert r.at(4.33).step("D", "handle_timeout", note="req-2's window lapsed: not a loss by itself")["outputs"] == []
    frees = r.at(6.0).step("P", "handle_timeout")["outputs"]
    assert sorted(f["key"] for f in frees) == ["req-1", "req-2"]
    assert all(f["reason"] == "expired" for f in frees)
    fin = r.at(6.25).step("D", "access_finished", key="req-1", note="the READ ends after validity")
    done = only(fin, "Send")
    assert done["message"]["confirm"] is True
    res = r.at(6.375).step(
        "D",
        "handle_timeout",
        note="req-2: a whole lease duration without an ack since the last acknowledged heartbeat was sent: given up",
    )
    lost = outs(res, "LeaseLost")
    assert len(lost) == 1 and lost[0]["key"] == "req-2" and lost[0]["reason"] == "validity_lapsed"
    ack = only(r.at(7.0).deliver("P", done, "the partition heals"), "Send")
    assert ack["message"]["outcome"] == int(AccessOutcome.STALE)
    stale = only(r.at(7.25).deliver("D", ack), "AccessStale")
    assert stale["key"] == "req-1"
    return r


def late_read_confirmed() -> Recorder:
    r = Recorder(
        "late_read_confirmed",
        "Acks are lost (heartbeats still arrive), so the "
        "accessor cannot prove validity and asks; the pinner still holds the lease and "
        "confirms: AccessCompleted(confirmed_by_pinner=true). Without an answer in time "
        "the accessor would report the access stale.",
        BASE,
        {"P": pinner("prefill-0", 0x5EED0005), "D": accessor("decode-0")},
        {"P": 600.5, "D": 190000.25},
    )
    t1 = r.at(0.0).step("P", "grant", key="req-1")["result"]
    t2 = r.at(0.0).step("P", "grant", key="req-2")["result"]
    hs = only(r.at(0.0).step("D", "track", key="req-1", ticket=t1), "HandshakeNeeded")
    r.at(0.0).step("D", "track", key="req-2", ticket=t2)
    connect(r, "D", "P", hs, 0.25)
    t = 0.375
    while t < 3.0:
        heartbeat_round(r, "D", ["P"], t, lose_back=True)
        t += 1.0
    for key in ("req-1", "req-2"):
        dec = r.at(3.5).step("D", "begin_access", key=key)["result"]
        assert dec["allowed"] and not dec["guaranteed"] and dec["valid_until"] is None
    d1 = only(r.at(3.75).step("D", "access_finished", key="req-1"), "Send")
    d2 = only(r.at(3.75).step("D", "access_finished", key="req-2"), "Send")
    assert d1["message"]["confirm"] and d2["message"]["confirm"]
    a1 = r.at(4.0).deliver("P", d1)
    assert [o["type"] for o in a1["outputs"]] == ["Free", "Send"]
    ok = only(r.at(4.25).deliver("D", a1["outputs"][1]), "AccessCompleted")
    assert ok["confirmed_by_pinner"] is True
    # req-2's access-done is lost: the confirmation deadline passes.
    deadline = 3.75 + BASE.accessor_extension
    assert not outs(r.at(deadline - 0.125).step("D", "handle_timeout"), "AccessStale")
    stale = only(r.at(deadline).step("D", "handle_timeout"), "AccessStale")
    assert stale["key"] == "req-2"
    return r


def push_mode() -> Recorder:
    r = Recorder(
        "push_mode",
        "Push mode: the decoder pins destination pages, the prefiller "
        "WRITEs. A write is refused until an acknowledged heartbeat covers the "
        "access-time bound. req-2: the writer vanishes mid-write; at expiry the pinner "
        "quarantines the pages (a write may still land) and frees them only after the "
        "push guard (max_access_time * (1 + rho)); neither the write's access-done landing then nor a "
        "local release can shorten it.",
        BASE,
        {"D": pinner("decode-0", 0x5EED0006), "P": accessor("prefill-0")},
        {"D": 8192.0, "P": 65000.5},
    )
    t1 = r.at(0.0).step("D", "grant", key="req-1", push=True)["result"]
    hs = only(r.at(0.0).step("P", "track", key="req-1", ticket=t1, push=True), "HandshakeNeeded")
    dec = r.at(0.125).step("P", "begin_access", key="req-1")["result"]
    assert not dec["allowed"] and dec["valid_until"] is None
    connect(r, "P", "D", hs, 0.25)
    heartbeat_round(r, "P", ["D"], 0.375)
    dec = r.at(1.0).step("P", "begin_access", key="req-1")["result"]
    assert dec["allowed"] and dec["guaranteed"]
    fin = r.at(1.25).step("P", "access_finished", key="req-1")
    assert outs(fin, "AccessCompleted")
    assert only(r.at(1.5).deliver("D", outs(fin, "Send")[0]), "Free")["reason"] == "access_done"
    t2 = r.at(2.0).step("D", "grant", key="req-2", push=True)["result"]
    assert r.at(2.0).step("P", "track", key="req-2", ticket=t2, push=True)["outputs"] == []
    sends = outs(r.at(2.0).step("P", "handle_timeout", note="a new lease is heartbeated at once"), "Send")
    assert len(sends) == 1 and sends[0]["message"]["lease_ids"] == [2]
    ack = only(r.at(2.25).deliver("D", sends[0]), "Send")
    r.at(2.5).deliver("P", ack)
    dec = r.at(2.75).step("P", "begin_access", key="req-2")["result"]
    assert dec["allowed"] and dec["guaranteed"]
    # The writer dies here. The lease never shrinks: its expiry is the later of the grant's
    # (2.0 + duration) and the last heartbeat's (2.25 + extension).
    expiry = max(2.0 + BASE.kv_lease_duration, 2.25 + BASE.lease_extension)
    assert r.at(expiry - 0.125).step("D", "handle_timeout")["outputs"] == []
    assert r.at(expiry).step("D", "handle_timeout", note="expired: quarantined, not freed")["outputs"] == []
    note = "the write's access-done lands in quarantine: expired, it counts nothing (no free)"
    assert r.at(expiry + 0.0625).step("D", "receive", hex=dec["notifications"][0], note=note)["outputs"] == []
    assert r.at(expiry + 0.125).step("D", "release", lease_id=2)["outputs"] == []
    guard_end = expiry + BASE.push_guard
    assert r.at(guard_end - 0.001).step("D", "handle_timeout")["outputs"] == []
    free = only(r.at(guard_end).step("D", "handle_timeout"), "Free")
    assert free["reason"] == "expired" and free["key"] == "req-2"
    return r


def fixed_ttl_bidirectional() -> Recorder:
    r = Recorder(
        "fixed_ttl_bidirectional",
        "Bidirectional turn 1: the decoder pins its KV for "
        "the prefiller under a fixed TTL (20 s) stated in the decoder's clock. The "
        "prefiller's clock is ~54,000 s apart; it converts the deadline with the "
        "handshake offset, taking the error bound (half the round-trip delay) and the "
        "drift factor (1-rho)/(1+rho) against itself, minus the margin, once an acknowledged "
        "heartbeat round showed the lease is still held for it. Heartbeats are acknowledged "
        "but never extend a fixed lease. req-2 runs out: the accessor gives "
        "it up before the pinner frees it.",
        BASE,
        {"D": pinner("decode-0", 0x5EED0007), "P": accessor("prefill-0")},
        {"D": 60000.0, "P": 5800.5},
    )
    t1 = r.at(0.0).step("D", "grant", key="turn1-a", kind=1)["result"]
    t2 = r.at(0.0).step("D", "grant", key="turn1-b", kind=1, ttl=10.0)["result"]
    assert t1["deadline"] == r.local("D", 20.0) and t2["deadline"] == r.local("D", 10.0)
    hs = only(r.at(1.0).step("P", "track", key="turn1-a", ticket=t1), "HandshakeNeeded")
    r.at(1.0).step("P", "track", key="turn1-b", ticket=t2)
    # Asymmetric path: 0.1 s there, 0.2 s back: the offset estimate is 0.05 s off, within
    # the 0.15 s error bound (delay / 2).
    reply = r.at(1.1).step("D", "handshake", hex=hs["hex"])
    r.at(1.3).step("P", "handshake_reply", hex=reply["result"]["hex"])
    early = r.at(1.3).step(
        "P",
        "begin_access",
        key="turn1-a",
        note="no acknowledged heartbeat yet: the deadline alone does not prove the lease is still held for us",
    )["result"]
    assert early["allowed"] and not early["guaranteed"] and early["valid_until"] is None
    r.at(1.3).step("P", "access_failed", key="turn1-a", posted=False)
    acks = heartbeat_round(r, "P", ["D"], 1.4)
    assert all(a["outputs"] == [] for a in acks)
    dec = r.at(2.0).step("P", "begin_access", key="turn1-a")["result"]
    true_deadline = r.local("P", 20.0)
    assert dec["allowed"] and dec["guaranteed"] and dec["valid_until"] < true_deadline - BASE.validity_margin
    rho = BASE.max_drift_rate
    est_off = ((r.local("D", 1.1) - r.local("P", 1.0)) + (r.local("D", 1.1) - r.local("P", 1.3))) / 2
    err = 0.3 / 2 + 2 * rho * (r.local("P", 2.0) - r.local("P", 1.0))
    now = r.local("P", 2.0)
    expect_valid = now + (t1["deadline"] - (now + est_off + err)) * (1 - rho) / (1 + rho) - BASE.validity_margin
    assert abs(dec["valid_until"] - expect_valid) < 1e-6, (dec, expect_valid)
    fin = r.at(2.5).step("P", "access_finished", key="turn1-a")
    assert outs(fin, "AccessCompleted")
    assert only(r.at(2.6).deliver("D", outs(fin, "Send")[0]), "Free")["reason"] == "access_done"
    # turn1-b: heartbeats are acknowledged (the pinner holds it) but never extend it.
    acks = heartbeat_round(r, "P", ["D"], 3.0)
    assert all(a["outputs"] == [] for a in acks)
    t = 4.0
    lost_at = None
    while t < 10.5:
        # The accessor's driver wakes exactly at next_deadline.
        resp = r.at(t).step("P", "handle_timeout")
        if outs(resp, "LeaseLost"):
            lost_at = t
            break
        nd = resp["next_deadline"]
        for s in outs(resp, "Send"):
            a = only(r.at(t + 0.1).deliver("D", s), "Send")
            assert a["message"]["renewed"] == 1
            nd = r.at(t + 0.2).deliver("P", a)["next_deadline"]
        t = nd - r.epochs["P"]
    assert lost_at is not None and lost_at < 10.0 - 0.1, lost_at
    assert r.at(9.999).step("D", "handle_timeout")["outputs"] == []
    free = only(r.at(10.0).step("D", "handle_timeout"), "Free")
    assert free["key"] == "turn1-b" and free["reason"] == "expired"
    return r


def pinner_restart() -> Recorder:
    r = Recorder(
        "pinner_restart",
        "The prefill engine restarts (new incarnation, lease ids "
        "start again at 1). The accessor's next heartbeat is answered by the new "
        "incarnation: it gives up req-1 (pinner_restarted) and re-handshakes. A delayed "
        "heartbeat of the old incarnation naming id 1 never renews the new lease 1.",
        BASE,
        {
            "P": pinner("prefill-0", 0x1111111111111111),
            "P2": pinner("prefill-0", 0x2222222222222222),
            "D": accessor("decode-0"),
        },
        {"P": 40000.0, "P2": 40000.0, "D": 2222.25},
    )
    t1 = r.at(0.0).step("P", "grant", key="req-1")["result"]
    hs = only(r.at(0.0).step("D", "track", key="req-1", ticket=t1), "HandshakeNeeded")
    connect(r, "D", "P", hs, 0.25)
    heartbeat_round(r, "D", ["P"], 0.375)
    old_hb = outs(r.at(1.375).step("D", "handle_timeout", note="P crashes before this arrives"), "Send")[0]
    # P2 is the restarted engine (same engine id, same clock, new incarnation).
    t2 = r.at(1.5).step("P2", "grant", key="req-2")["result"]
    assert t2["lease_id"] == t1["lease_id"] == 1
    ack = only(r.at(1.625).deliver("P2", old_hb, "an old-incarnation heartbeat reaches the new engine"), "Send")
    assert ack["message"]["unknown"] == [1] and ack["message"]["renewed"] == 0
    lost = only(r.at(1.875).deliver("D", ack), "LeaseLost")
    assert lost["reason"] == "pinner_restarted"
    hs2 = only(r.at(2.0).step("D", "track", key="req-2", ticket=t2), "HandshakeNeeded")
    connect(r, "D", "P2", hs2, 2.125)
    heartbeat_round(r, "D", ["P2"], 2.25)
    # The old heartbeat, duplicated and delayed, arrives again after req-2 was granted.
    again = only(r.at(2.875).deliver("P2", old_hb, "duplicate of the old heartbeat"), "Send")
    assert again["message"]["unknown"] == [1]
    dec = r.at(3.0).step("D", "begin_access", key="req-2")["result"]
    assert dec["allowed"] and dec["guaranteed"]
    assert r.at(6.0).step("P2", "handle_timeout")["outputs"] == []
    return r


def hetero_tp_pinner_wider() -> Recorder:
    r = Recorder(
        "hetero_tp_pinner_wider",
        "Prefill TP=2, decode TP=1: the decoder's one worker "
        "reads from both prefill workers, so it heartbeats each of them (one send per rank), "
        "validity needs the ack of every rank (a duplicate of one rank's is not another's), and each prefill "
        "worker frees on the one "
        "access-done it expects. An access begun before the round is fully acknowledged is "
        "not guaranteed; the driver had not posted it, so it backs off (posted=false) and "
        "retries under the same lease.",
        BASE,
        {
            "P0": pinner("prefill-0", 0x5EED0009, 0, 2),
            "P1": pinner("prefill-0", 0x5EED0009, 1, 2),
            "D": accessor("decode-0"),
        },
        {"P0": 9000.0, "P1": 9000.0, "D": 123.0},
    )
    t = r.at(0.0).step("P0", "grant", key="req-1")["result"]
    assert r.at(0.0).step("P1", "grant", key="req-1")["result"] == {**t, "engine_id": "prefill-0"}
    assert t["ranks"] == 2
    hs = only(r.at(0.0).step("D", "track", key="req-1", ticket=t), "HandshakeNeeded")
    connect(r, "D", "P0", hs, 0.25)
    hb = r.at(0.375).step("D", "handle_timeout")
    sends = outs(hb, "Send")
    assert [s["rank"] for s in sends] == [0, 1] and sends[0]["hex"] == sends[1]["hex"]
    a0 = only(r.at(0.5).deliver("P0", sends[0]), "Send")
    a1 = only(r.at(0.5).deliver("P1", sends[1]), "Send")
    r.at(0.625).deliver("D", a0)
    assert r.at(0.65).deliver("D", a0, "a duplicate of rank 0's ack: it does not stand for rank 1's")["outputs"] == []
    dec = r.at(0.7).step("D", "begin_access", key="req-1", note="rank 1 has not acked yet")["result"]
    assert dec["allowed"] and not dec["guaranteed"] and dec["targets"] == [0, 1]
    r.at(0.75).step(
        "D",
        "access_failed",
        key="req-1",
        posted=False,
        note="the driver backs off before posting anything, and retries",
    )
    r.at(0.75).deliver("D", a1)
    dec = r.at(0.8).step("D", "begin_access", key="req-1")["result"]
    assert dec["allowed"] and dec["guaranteed"]
    fin = r.at(1.0).step("D", "access_finished", key="req-1")
    sends = outs(fin, "Send")
    assert [s["rank"] for s in sends] == [0, 1] and outs(fin, "AccessCompleted")
    assert only(r.at(1.25).deliver("P0", sends[0]), "Free")["reason"] == "access_done"
    assert only(r.at(1.25).deliver("P1", sends[1]), "Free")["reason"] == "access_done"
    return r


def hetero_tp_accessor_wider() -> Recorder:
    r = Recorder(
        "hetero_tp_accessor_wider",
        "Prefill TP=1, decode TP=2: both decode workers "
        "heartbeat the one prefill worker (it simply renews twice), and the lease ends "
        "only when both have reported their access done (expected = 2, derived by the "
        "pinner from the sender's rank and ranks). A duplicate from one rank counts once.",
        BASE,
        {
            "P": pinner("prefill-0", 0x5EED000A),
            "D0": accessor("decode-0", 0, 2, 0xD0),
            "D1": accessor("decode-0", 1, 2, 0xD1),
        },
        {"P": 555.5, "D0": 70000.0, "D1": 70000.0},
    )
    t = r.at(0.0).step("P", "grant", key="req-1")["result"]
    hs0 = only(r.at(0.0).step("D0", "track", key="req-1", ticket=t), "HandshakeNeeded")
    hs1 = only(r.at(0.0).step("D1", "track", key="req-1", ticket=t), "HandshakeNeeded")
    connect(r, "D0", "P", hs0, 0.125)
    connect(r, "D1", "P", hs1, 0.25)
    heartbeat_round(r, "D0", ["P"], 0.5)
    heartbeat_round(r, "D1", ["P"], 1.0)
    f0 = r.at(1.5).step("D0", "begin_access", key="req-1")["result"]
    assert f0["guaranteed"]
    r.at(1.5).step("D1", "begin_access", key="req-1")
    fin0 = r.at(1.75).step("D0", "access_finished", key="req-1")
    fin1 = r.at(1.875).step("D1", "access_finished", key="req-1")
    s0, s1 = outs(fin0, "Send")[0], outs(fin1, "Send")[0]
    assert s0["message"]["ranks"] == 2 and s0["rank"] == 0 and s1["rank"] == 0
    assert r.at(2.0).deliver("P", s0)["outputs"] == []
    assert r.at(2.125).deliver("P", s0, "a duplicate from rank 0 does not count twice")["outputs"] == []
    assert only(r.at(2.25).deliver("P", s1), "Free")["reason"] == "access_done"
    return r


def release() -> Recorder:
    r = Recorder(
        "release",
        "Aborts before access. req-1: the decoder untracks it and sends "
        "Release; the pinner frees at once. req-2: the prefill engine aborts locally "
        "before any heartbeat for it was acknowledged (so no accessor can hold validity "
        "and it may free at once); the decoder tracks it later and the first heartbeat's "
        "ack tells it the lease was released. Duplicate releases do nothing. req-3: the "
        "prefill engine aborts after an acknowledged heartbeat: held until expiry.",
        BASE,
        {"P": pinner("prefill-0", 0x5EED000B), "D": accessor("decode-0")},
        {"P": 1000.0, "D": 2000.0},
    )
    t1 = r.at(0.0).step("P", "grant", key="req-1")["result"]
    t2 = r.at(0.0).step("P", "grant", key="req-2")["result"]
    hs = only(r.at(0.0).step("D", "track", key="req-1", ticket=t1), "HandshakeNeeded")
    connect(r, "D", "P", hs, 0.25)
    heartbeat_round(r, "D", ["P"], 0.375)
    rel = only(r.at(1.0).step("D", "untrack", key="req-1"), "Send")
    assert rel["rank"] == 0 and rel["message"]["type"] == "Release"
    free = only(r.at(1.125).deliver("P", rel), "Free")
    assert free["reason"] == "released" and free["key"] == "req-1"
    assert r.at(1.25).deliver("P", rel, "duplicate Release")["outputs"] == []
    assert only(r.at(1.3).step("P", "release", lease_id=2), "Free")["reason"] == "released"
    assert r.at(1.3).step("P", "release", lease_id=2, note="already ended: harmless")["outputs"] == []
    assert r.at(1.35).step("D", "track", key="req-2", ticket=t2)["outputs"] == []
    acks = heartbeat_round(r, "D", ["P"], 1.375)
    assert len(acks) == 1
    lost = only(acks[0], "LeaseLost")
    assert lost["key"] == "req-2" and lost["reason"] == "released"
    assert r.at(2.0).step("D", "untrack", key="req-2", note="already lost: no-op")["outputs"] == []
    # req-3: the prefill engine aborts *after* a heartbeat was acknowledged. The decoder may hold
    # a validity window, so the pinner must not free at once: it stops renewing, answers the
    # next heartbeat with "released", and frees at the current expiry.
    t3 = r.at(2.0).step("P", "grant", key="req-3")["result"]
    assert r.at(2.0).step("D", "track", key="req-3", ticket=t3)["outputs"] == []
    heartbeat_round(r, "D", ["P"], 2.125)
    assert (
        r.at(3.0).step("P", "release", lease_id=3, note="held: an acked heartbeat promised validity")["outputs"] == []
    )
    acks = heartbeat_round(r, "D", ["P"], 3.5)
    lost = only(acks[0], "LeaseLost")
    assert lost["key"] == "req-3" and lost["reason"] == "released"
    assert r.at(7.875).step("P", "handle_timeout", note="not before the expiry (grant + 6 s)")["outputs"] == []
    free3 = only(r.at(8.0).step("P", "handle_timeout"), "Free")
    assert free3["key"] == "req-3" and free3["reason"] == "released"
    return r


def heartbeat_batching() -> Recorder:
    cfg = BASE.with_changes(max_message_bytes=192)
    r = Recorder(
        "heartbeat_batching",
        "60 leases on one pinner with a 192-byte message bound "
        "(a small-notification backend): the accessor splits its heartbeat by the exact "
        "rule of spec §4.3 (budget = 192 - max(52 + 8, 125 + 9) = 58 bytes; each chunk "
        "costs 5 + size(first id) + the sizes of every other id's distance from the "
        "first), so every heartbeat and every ack answering it stays within the bound.",
        cfg,
        {"P": pinner("prefill-0", 0x5EED000C), "D": accessor("decode-0")},
        {"P": 300.0, "D": 4000.0},
    )
    tickets = []
    lid = 0
    for i in range(60):
        # Gaps of 1, 300, 1000 and 70000 exercise one-, three- and five-byte distances (ids only
        # increase on one pinner incarnation).
        lid += (1, 1, 300, 1, 1, 1000, 1, 70000)[i % 8]
        tickets.append(r.at(0.0).step("P", "grant", key=f"req-{i}", lease_id=lid)["result"])
    hs = only(r.at(0.0).step("D", "track", key="req-0", ticket=tickets[0]), "HandshakeNeeded")
    for i, tk in enumerate(tickets[1:], 1):
        r.at(0.0).step("D", "track", key=f"req-{i}", ticket=tk)
    connect(r, "D", "P", hs, 0.25)
    hb = r.at(0.375).step("D", "handle_timeout")
    sends = outs(hb, "Send")
    assert len(sends) >= 2 and all(len(s["hex"]) // 2 <= 192 for s in sends), [len(s["hex"]) for s in sends]
    acks = [only(r.at(0.5).deliver("P", s), "Send") for s in sends]
    assert all(len(a["hex"]) // 2 <= 192 for a in acks)
    assert sum(a["message"]["renewed"] for a in acks) == 60
    for ack in acks:
        assert r.at(0.625).deliver("D", ack)["outputs"] == []
    return r


def vllm_compat() -> Recorder:
    cfg = BASE.with_changes(vllm_compat=True)
    r = Recorder(
        "vllm_compat",
        "A stock vLLM decoder speaks 'HB:' + ','.join(request ids) and "
        "'<request id>:<count>'. The pinner renews by request id, ignores unknown ids, "
        "and frees after `count` read-done notifications. A lease bound to a kvlease accessor (here "
        "at grant) is never renewed by an `HB:`.",
        cfg,
        {"P": pinner("prefill-0", 0x5EED000D)},
        {"P": 12.0},
    )
    r.at(0.0).step("P", "grant", key="req-1")
    r.at(0.0).step("P", "grant", key="req-2")
    r.at(0.0).step("P", "grant", key="req-3")
    hb = encode_vllm_heartbeat(["req-1", "req-2", "cmpl-unknown"]).hex()
    res = r.at(3.0).step("P", "receive_vllm", hex=hb)["result"]
    assert res == {"renewed": 2}
    r.at(3.0).step("P", "grant", key="req-4", accessor="decode-0", note="bound to a kvlease accessor at grant")
    bound = encode_vllm_heartbeat(["req-4"]).hex()
    res = r.at(3.5).step("P", "receive_vllm", hex=bound, note="stock vLLM cannot renew it")["result"]
    assert res == {"renewed": 0}
    free3 = only(r.at(6.0).step("P", "handle_timeout", note="req-3 was never renewed"), "Free")
    assert free3["key"] == "req-3"
    assert only(r.at(6.5).step("P", "receive_vllm", hex=encode_vllm_done("req-1", 1).hex()), "Free")["key"] == "req-1"
    two = encode_vllm_done("req-2", 2).hex()
    assert r.at(6.75).step("P", "receive_vllm", hex=two, note="first of two readers")["outputs"] == []
    assert only(r.at(6.8).step("P", "receive_vllm", hex=two), "Free")["key"] == "req-2"
    assert r.at(7.0).step("P", "receive_vllm", hex=two, note="late: no second free")["outputs"] == []
    free4 = only(r.at(9.0).step("P", "handle_timeout", note="req-4: grant + duration"), "Free")
    assert free4["key"] == "req-4" and free4["reason"] == "expired"
    return r


def rejections_and_misuse() -> Recorder:
    r = Recorder(
        "rejections_and_misuse",
        "Messages that decode but are refused are Rejected "
        "outputs (nothing else changes); bytes that do not decode are a DecodeError; "
        "local misuse (time running backwards, an id never issued, finishing an access "
        "never begun, tracking twice, a clock reading beyond 2**32 s) is a "
        "LocalProtocolError and changes nothing.",
        BASE,
        {"P": pinner("prefill-0", 0x5EED000E), "D": accessor("decode-0", session=0xD)},
        {"P": 50.0, "D": 60.0},
    )
    t1 = r.at(0.0).step("P", "grant", key="req-1")["result"]
    wrong = HeartbeatAck("decode-0", 0, 1, 0, 0xD, 1, LocalTime(1.0), PeerTime(1.0), 4.0, 0)
    assert only(r.at(0.5).step("P", "receive", hex=encode(wrong).hex()), "Rejected")["engine_id"] == "decode-0"
    future = Handshake("decode-0", 0, 1, 0xD, 7, 7, 1, LocalTime(60.5))
    resp = r.at(0.5).step(
        "P", "receive", note="handshake announcing a future protocol version (in a v2 frame)", hex=encode(future).hex()
    )
    assert [o["type"] for o in resp["outputs"]] == ["Rejected", "Send"]
    bad = r.at(0.5).step("P", "receive", hex="c14b9202")
    assert bad["error"]["class"] == "DecodeError"
    assert r.at(0.5).step("P", "receive", hex="4842")["error"]["category"] == "frame"
    back = r.step("P", "handle_timeout", note="time ran backwards", clock=r.local("P") - 0.25)
    assert back["error"]["class"] == "LocalProtocolError"
    huge = r.step("P", "handle_timeout", note="a clock reading beyond 2**32 s", clock=float(2**32) + 1.0)
    assert huge["error"]["class"] == "LocalProtocolError"
    assert r.at(0.5).step("P", "release", lease_id=99, note="never issued")["error"]["class"] == "LocalProtocolError"
    assert r.at(0.5).step("D", "access_finished", key="req-1")["error"]["class"] == "LocalProtocolError"
    hs = only(r.at(0.5).step("D", "track", key="req-1", ticket=t1), "HandshakeNeeded")
    assert r.at(0.5).step("D", "track", key="req-1", ticket=t1)["error"]["class"] == "LocalProtocolError"
    connect(r, "D", "P", hs, 0.75)
    bogus = AccessDone("decode-0", 3, 2, 0xD, 0x5EED000E, 0, 1, 1, False, LocalTime(61.0))
    rej = r.at(1.0).step("P", "receive", hex=encode(bogus).hex(), note="rank 3 of a 2-rank engine")
    assert only(rej, "Rejected")
    t2 = r.at(1.0).step("P", "grant", key="req-2", expected=2)["result"]
    one = AccessDone("decode-0", 0, 1, 0xD, 0x5EED000E, 0, t2["lease_id"], 1, False, LocalTime(61.0))
    rej = r.at(1.0).step(
        "P", "receive", hex=encode(one).hex(), note="granted with expected=2; a 1-rank accessor's layout says 1"
    )
    assert only(rej, "Rejected")
    hb = Heartbeat("decode-0", 0, 1, 0xD, 0x5EED000E, 1, LocalTime(61.0), (1,))
    assert only(r.at(0.9 + 0.2).step("D", "receive", hex=encode(hb).hex()), "Rejected")
    alien = HeartbeatAck("prefill-0", 0, 0x5EED000E, 0, 0xE, 1, LocalTime(61.0), PeerTime(51.0), 4.0, 1)
    note = "an ack addressed to another session"
    assert only(r.at(1.2).step("D", "receive", hex=encode(alien).hex(), note=note), "Rejected")
    forged = AccessDoneAck("prefill-0", 0, 0x5EED000E, 0, 0xD, 1, 99, AccessOutcome.OK)
    note = "an unasked confirmation is ignored"
    assert r.at(1.3).step("D", "receive", hex=encode(forged).hex(), note=note)["outputs"] == []
    return r


# -- API-level adversity (each hole of the v1 review is a vector) ---------------------------


def forged(hex_: str, **changes: Any) -> str:
    """The frame `hex_` with some fields replaced (what a faulty network or peer could carry)."""
    from kvlease import decode

    return encode(attrs.evolve(decode(bytes.fromhex(hex_)), **changes)).hex()


def retrack() -> Recorder:
    cfg = BASE.with_changes(tombstone_limit=2)
    r = Recorder(
        "retrack",
        "A lease is tracked at most once by one accessor. req-1 is untracked; "
        "its Release is held in the network while the engine re-tracks the same ticket: "
        "refused (LocalProtocolError), so no heartbeat can renew the lease under a second "
        "tracking that the late Release would then free. The same after a completed read "
        "(req-2). The accessor remembers tombstone_limit (here 2) given-up leases; an "
        "older ticket at or below the watermark is refused as LeaseLost 'forgotten'.",
        cfg,
        {"P": pinner("prefill-0", 0x5EED0101), "D": accessor("decode-0")},
        {"P": 7000.0, "D": 18000.5},
    )
    t1 = r.at(0.0).step("P", "grant", key="req-1")["result"]
    t2 = r.at(0.0).step("P", "grant", key="req-2")["result"]
    t3 = r.at(0.0).step("P", "grant", key="req-3")["result"]
    hs = only(r.at(0.0).step("D", "track", key="k1", ticket=t1), "HandshakeNeeded")
    r.at(0.0).step("D", "track", key="k2", ticket=t2)
    connect(r, "D", "P", hs, 0.25)
    heartbeat_round(r, "D", ["P"], 0.375)
    held = only(r.at(1.0).step("D", "untrack", key="k1", note="the Release is held in the network"), "Send")
    again = r.at(1.0).step("D", "track", key="k1-again", ticket=t1, note="re-track after untrack")
    assert again["error"]["class"] == "LocalProtocolError"
    assert only(r.at(1.5).deliver("P", held, "the held Release lands"), "Free")["reason"] == "released"
    dec = r.at(1.5).step("D", "begin_access", key="k2")["result"]
    assert dec["guaranteed"]
    fin = r.at(1.75).step("D", "access_finished", key="k2")
    done = outs(fin, "Send")[0]
    assert outs(fin, "AccessCompleted")
    again = r.at(2.0).step(
        "D", "track", key="k2-again", ticket=t2, note="re-track after completion; the access-done is still in flight"
    )
    assert again["error"]["class"] == "LocalProtocolError"
    assert only(r.at(2.25).deliver("P", done), "Free")["reason"] == "access_done"
    # A third give-up pushes req-1 out of the accessor's memory (limit 2): its id falls under
    # the watermark, and a ticket at or below it is refused as forgotten.
    r.at(2.5).step("D", "track", key="k3", ticket=t3)
    r.at(2.5).step("D", "untrack", key="k3")
    lost = only(r.at(2.75).step("D", "track", key="k1-late", ticket=t1), "LeaseLost")
    assert lost["reason"] == "forgotten"
    return r


def wrong_rank() -> Recorder:
    r = Recorder(
        "wrong_rank",
        "Pinner TP 2, accessor TP 2: accessor rank r accesses pinner rank r "
        "only, and heartbeats only it. Accessor rank 1's AccessDone delivered to pinner "
        "rank 0 (the right engine, the wrong rank) is Rejected and counts nothing; so is "
        "its heartbeat there, and a rank outside the sender's engine. When accessor rank 0 "
        "finishes and pinner rank 0 frees, accessor rank 1 keeps its lease (it never "
        "heartbeats rank 0, so it never hears 'completed' from it) and reads later.",
        BASE,
        {
            "P0": pinner("prefill-0", 0x5EED0102, 0, 2),
            "P1": pinner("prefill-0", 0x5EED0102, 1, 2),
            "D0": accessor("decode-0", 0, 2, 0xD0),
            "D1": accessor("decode-0", 1, 2, 0xD1),
        },
        {"P0": 3000.0, "P1": 3000.0, "D0": 90000.0, "D1": 90000.0},
    )
    t = r.at(0.0).step("P0", "grant", key="req-1")["result"]
    r.at(0.0).step("P1", "grant", key="req-1")
    hs0 = only(r.at(0.0).step("D0", "track", key="req-1", ticket=t), "HandshakeNeeded")
    hs1 = only(r.at(0.0).step("D1", "track", key="req-1", ticket=t), "HandshakeNeeded")
    connect(r, "D0", "P0", hs0, 0.125)
    connect(
        r,
        "D1",
        "P0",
        hs1,
        0.25,
    )
    hb0 = r.at(0.375).step("D0", "handle_timeout")
    hb1 = r.at(0.375).step("D1", "handle_timeout")
    assert [s["rank"] for s in outs(hb0, "Send")] == [0] and [s["rank"] for s in outs(hb1, "Send")] == [1]
    stray = only(
        r.at(0.5).deliver("P0", outs(hb1, "Send")[0], "rank 1's heartbeat misrouted to pinner rank 0"), "Rejected"
    )
    assert stray
    a0 = only(r.at(0.5).deliver("P0", outs(hb0, "Send")[0]), "Send")
    a1 = only(r.at(0.5).deliver("P1", outs(hb1, "Send")[0]), "Send")
    r.at(0.625).deliver("D0", a0)
    r.at(0.625).deliver("D1", a1)
    assert r.at(0.625).step("D0", "begin_access", key="req-1")["result"]["guaranteed"]
    fin0 = r.at(0.875).step("D0", "access_finished", key="req-1")
    assert outs(fin0, "AccessCompleted")
    hx = AccessDone("decode-0", 1, 2, 0xD1, 0x5EED0102, 0, 1, 1, False, LocalTime(90001.0))
    rej = r.at(1.0).step("P0", "receive", hex=encode(hx).hex(), note="accessor rank 1's access-done at pinner rank 0")
    assert only(rej, "Rejected")
    far = AccessDone("decode-0", 70000 % 65536, 2, 0xD1, 0x5EED0102, 0, 1, 1, False, LocalTime(90001.0))
    assert only(
        r.at(1.0).step("P0", "receive", hex=encode(far).hex(), note="a rank the sender's engine lacks"), "Rejected"
    )
    assert only(r.at(1.125).deliver("P0", outs(fin0, "Send")[0]), "Free")["reason"] == "access_done"
    acks = heartbeat_round(r, "D1", ["P0", "P1"], 1.375)
    assert all(a["outputs"] == [] for a in acks), "rank 1 keeps its lease"
    assert r.at(2.0).step("D1", "begin_access", key="req-1")["result"]["guaranteed"]
    fin1 = r.at(2.25).step("D1", "access_finished", key="req-1")
    assert outs(fin1, "AccessCompleted")
    assert only(r.at(2.5).deliver("P1", outs(fin1, "Send")[0]), "Free")["reason"] == "access_done"
    return r


def handshake_binding() -> Recorder:
    r = Recorder(
        "handshake_binding",
        "A handshake reply counts only for the handshake it answers "
        "(the accessor's rank, session, seq and send time). While no reply comes the "
        "accessor handshakes again every interval. A reply produced for another accessor "
        "(here one whose clock is 10 s ahead) is Rejected and gives no clock sample; a "
        "duplicate of an accepted reply does nothing. After the pinner restarts, the reply "
        "of the new incarnation loses the old incarnation's leases, and a late duplicate "
        "of the old incarnation's reply cannot bring them back.",
        BASE,
        {
            "P": pinner("prefill-0", 0x1111),
            "P2": pinner("prefill-0", 0x2222),
            "A": accessor("decode-0", session=0xA),
            "B": accessor("decode-1", session=0xB),
        },
        {"P": 500.0, "P2": 500.0, "A": 40000.0, "B": 40010.0},
    )
    t1 = r.at(0.0).step("P", "grant", key="req-1", kind=1)["result"]
    hs_a = only(r.at(0.0).step("A", "track", key="turn1", ticket=t1), "HandshakeNeeded")
    assert r.at(0.5).step("A", "handle_timeout")["outputs"] == []
    hs_a2 = only(
        r.at(1.0).step("A", "handle_timeout", note="no reply yet: handshake again every interval"), "HandshakeNeeded"
    )
    assert hs_a2["hex"] != hs_a["hex"]
    t1b = r.at(1.0).step("P", "grant", key="req-b")["result"]
    hs_b = only(r.at(1.0).step("B", "track", key="b", ticket=t1b), "HandshakeNeeded")
    reply_b = r.at(1.1).step("P", "handshake", hex=hs_b["hex"])["result"]["hex"]
    reply_a = r.at(1.1).step("P", "handshake", hex=hs_a["hex"])["result"]["hex"]
    rej = r.at(1.2).step("A", "handshake_reply", hex=reply_b, note="B's reply delivered to A")
    assert only(rej, "Rejected")
    dec = r.at(1.2).step("A", "begin_access", key="turn1")["result"]
    assert not dec["allowed"], "no connection, no clock sample from B's reply"
    assert r.at(1.3).step("A", "handshake_reply", hex=reply_a, note="the reply to A's first handshake")["outputs"] == []
    assert r.at(1.4).step("A", "handshake_reply", hex=reply_a, note="a duplicate")["outputs"] == []
    heartbeat_round(r, "A", ["P"], 1.45)
    dec = r.at(1.96).step("A", "begin_access", key="turn1")["result"]
    assert dec["allowed"] and dec["guaranteed"]
    r.at(1.96).step("A", "access_failed", key="turn1", posted=False)
    # P restarts as P2; A learns of a lease of the new incarnation.
    t2 = r.at(2.0).step("P2", "grant", key="req-2")["result"]
    hs3 = only(r.at(2.0).step("A", "track", key="new", ticket=t2), "HandshakeNeeded")
    reply2 = r.at(2.1).step("P2", "handshake", hex=hs3["hex"])["result"]["hex"]
    lost = only(r.at(2.2).step("A", "handshake_reply", hex=reply2), "LeaseLost")
    assert lost["key"] == "turn1" and lost["reason"] == "pinner_restarted"
    assert (
        r.at(2.3).step("A", "handshake_reply", hex=reply_a, note="the old incarnation's reply, late")["outputs"] == []
    )
    acks = heartbeat_round(r, "A", ["P2"], 2.5)
    assert all(a["outputs"] == [] for a in acks)
    assert r.at(3.25).step("A", "begin_access", key="new")["result"]["guaranteed"]
    return r


def ack_binding() -> Recorder:
    r = Recorder(
        "ack_binding",
        "A heartbeat ack counts only for the heartbeat it answers: the "
        "accessor's rank and session, a seq that never repeats within a session (not even "
        "after disconnect), the echoed send time, and ids that account exactly for the "
        "heartbeat's. An ack from before a disconnect, an ack meant for a sibling rank (whose "
        "clock reads the same, or which shares the session), one echoing another send time, and an "
        "ack whose lists contradict its heartbeat all confer nothing.",
        BASE,
        {
            "P": pinner("prefill-0", 0x5EED0104, 0, 1),
            "D0": accessor("decode-0", 0, 2, 0xD0),
            "D1": accessor("decode-0", 1, 2, 0xD1),
        },
        {"P": 800.0, "D0": 60000.0, "D1": 60000.0},
    )
    t1 = r.at(0.0).step("P", "grant", key="req-1")["result"]
    hs = only(r.at(0.0).step("D0", "track", key="k1", ticket=t1), "HandshakeNeeded")
    connect(r, "D0", "P", hs, 0.25)
    hb = outs(r.at(0.375).step("D0", "handle_timeout"), "Send")[0]
    old_ack = only(r.at(0.5).deliver("P", hb), "Send")
    lost = only(r.at(0.6).step("D0", "disconnect", engine_id="prefill-0"), "LeaseLost")
    assert lost["reason"] == "unreachable"
    t2 = r.at(0.7).step("P", "grant", key="req-2")["result"]
    hs = only(r.at(0.7).step("D0", "track", key="k2", ticket=t2), "HandshakeNeeded")
    connect(r, "D0", "P", hs, 0.8)
    hb2 = outs(r.at(0.925).step("D0", "handle_timeout"), "Send")[0]
    assert hb2["message"]["seq"] > hb["message"]["seq"], "seq continues across the disconnect"
    ack2 = only(r.at(1.0).deliver("P", hb2), "Send")
    assert r.at(1.0).deliver("D0", old_ack, "the ack from before the disconnect")["outputs"] == []
    assert r.at(1.0).step("D0", "begin_access", key="k2")["result"]["guaranteed"] is False
    r.at(1.0).step("D0", "access_failed", key="k2", posted=False)
    # The sibling rank sends a heartbeat at the same clock reading; its ack reaches D0.
    t3 = r.at(1.0).step("P", "grant", key="req-3")["result"]
    hs1 = only(r.at(1.0).step("D1", "track", key="k3", ticket=t3), "HandshakeNeeded")
    connect(r, "D1", "P", hs1, 1.0)
    hb1 = outs(r.at(1.125).step("D1", "handle_timeout"), "Send")[0]
    ack1 = only(r.at(1.25).deliver("P", hb1), "Send")
    assert only(r.at(1.375).deliver("D0", ack1, "the sibling's ack"), "Rejected")
    # D0's own round: the ack is tampered with to claim a renewal it does not account for.
    bad = forged(ack2["hex"], renewed=0)
    assert only(r.at(1.375).step("D0", "receive", hex=bad, note="renewed + listed != ids in the heartbeat"), "Rejected")
    to_rank_1 = forged(ack2["hex"], to_rank=1)
    note = "addressed to rank 1 (the session is D0's own)"
    assert only(r.at(1.375).step("D0", "receive", hex=to_rank_1, note=note), "Rejected")
    from kvlease import decode

    genuine = decode(bytes.fromhex(ack2["hex"]))
    assert isinstance(genuine, HeartbeatAck)
    echo = forged(ack2["hex"], t_echo=LocalTime(genuine.t_echo + 0.5))
    note = "echoes a send time its heartbeat did not have"
    assert r.at(1.375).step("D0", "receive", hex=echo, note=note)["outputs"] == []
    dec = r.at(1.375).step("D0", "begin_access", key="k2", note="neither confers anything")["result"]
    assert not dec["guaranteed"] and dec["valid_until"] is None
    r.at(1.375).step("D0", "access_failed", key="k2", posted=False)
    assert r.at(1.4).deliver("D0", ack2)["outputs"] == []
    dec = r.at(1.5).step("D0", "begin_access", key="k2")["result"]
    assert dec["guaranteed"], "the genuine ack still counts"
    return r


def failed_transfer() -> Recorder:
    r = Recorder(
        "failed_transfer",
        "A transfer posted with its access-done attached fails at the "
        "transport, but the notification lands and the pinner frees. The accessor gives "
        "the lease up (LeaseLost 'access_failed', and a Release to the targets) instead of "
        "letting the engine retry a read of freed memory; the engine needs a fresh lease. "
        "An attempt nothing of which was posted may be retried (posted=false), and a "
        "verdict on an earlier attempt never completes a later one.",
        BASE,
        {"P": pinner("prefill-0", 0x5EED0105), "D": accessor("decode-0")},
        {"P": 12.5, "D": 2400.0},
    )
    t1 = r.at(0.0).step("P", "grant", key="req-1")["result"]
    t2 = r.at(0.0).step("P", "grant", key="req-2")["result"]
    hs = only(r.at(0.0).step("D", "track", key="k1", ticket=t1), "HandshakeNeeded")
    r.at(0.0).step("D", "track", key="k2", ticket=t2)
    connect(r, "D", "P", hs, 0.25)
    heartbeat_round(r, "D", ["P"], 0.375)
    dec = r.at(1.0).step("D", "begin_access", key="k1")["result"]
    assert dec["guaranteed"] and dec["notifications"][0]
    freed = r.at(1.25).step("P", "receive", hex=dec["notifications"][0], note="the attached notification lands")
    assert only(freed, "Free")["reason"] == "access_done"
    gone = r.at(1.5).step("D", "access_failed", key="k1", note="the transport reports the transfer failed")
    assert [o["type"] for o in gone["outputs"]] == ["Send", "LeaseLost"]
    assert outs(gone, "LeaseLost")[0]["reason"] == "access_failed"
    assert not r.at(1.5).step("D", "begin_access", key="k1")["result"]["allowed"]
    assert r.at(1.5).step("D", "track", key="k1", ticket=t1)["error"]["class"] == "LocalProtocolError"
    assert r.at(1.75).deliver("P", outs(gone, "Send")[0], "the Release: the lease already ended")["outputs"] == []
    # req-2: the acks stop, so the next access asks the pinner to confirm.
    t = 2.375
    while t < 4.0:
        heartbeat_round(r, "D", ["P"], t, lose_back=True)
        t += 1.0
    first = r.at(4.5).step("D", "begin_access", key="k2")["result"]
    assert first["allowed"] and not first["guaranteed"]
    r.at(4.7).step("D", "access_failed", key="k2", posted=False, note="nothing of attempt 1 was posted")
    from kvlease import decode

    attempt1 = decode(bytes.fromhex(first["notifications"][0]))
    assert isinstance(attempt1, AccessDone)
    verdict = {
        "hex": encode(
            AccessDoneAck(
                "prefill-0", 0, 0x5EED0105, 0, 0xACCE55, attempt1.lease_id, attempt1.attempt, AccessOutcome.OK
            )
        ).hex()
    }
    second = r.at(4.8).step("D", "begin_access", key="k2")["result"]
    assert second["allowed"] and second["notifications"][0] != first["notifications"][0]
    assert r.at(4.9).deliver("D", verdict, "an OK verdict naming attempt 1 reaches attempt 2")["outputs"] == []
    fin = r.at(5.0).step("D", "access_finished", key="k2", note="attempt 2 finished, not notified")
    done = only(fin, "Send")
    res = r.at(5.1).deliver("P", done)
    assert [o["type"] for o in res["outputs"]] == ["Free", "Send"]
    ok = only(r.at(5.2).deliver("D", outs(res, "Send")[0]), "AccessCompleted")
    assert ok["confirmed_by_pinner"] is True
    return r


def expiry_edges() -> Recorder:
    r = Recorder(
        "expiry_edges",
        "A lease is expired at pinner time now >= expiry, before "
        "handle_timeout frees it: a heartbeat handled exactly at the expiry lists it "
        "'expired' (no renewal) and an access-done asking for confirmation is answered "
        "STALE. The ack's lists become LeaseLost: 'expired' for a waiting lease, 'unknown' "
        "for an id the pinner never granted; a lease lost during an access is reported "
        "AccessStale when the access finishes. An access-done for an id never granted is "
        "answered UNKNOWN.",
        BASE,
        {"P": pinner("prefill-0", 0x5EED0106), "D": accessor("decode-0")},
        {"P": 100.0, "D": 200.0},
    )
    t1 = r.at(0.0).step("P", "grant", key="req-1")["result"]
    t2 = r.at(0.0).step("P", "grant", key="req-2")["result"]
    ghost = {**t1, "lease_id": 50}
    hs = only(r.at(0.0).step("D", "track", key="k1", ticket=t1), "HandshakeNeeded")
    r.at(0.0).step("D", "track", key="k2", ticket=t2)
    r.at(0.0).step("D", "track", key="ghost", ticket=ghost, note="a ticket for an id the pinner never granted")
    connect(r, "D", "P", hs, 0.25)
    hb = outs(r.at(0.375).step("D", "handle_timeout"), "Send")[0]
    # The heartbeat is delayed until exactly the grant's expiry (grant + 6 s).
    ack = only(r.at(6.0).deliver("P", hb, "handled at now == expiry: expired, not renewed"), "Send")
    assert ack["message"]["renewed"] == 0 and ack["message"]["expired"] == [1, 2]
    assert ack["message"]["unknown"] == [50]
    stale = AccessDone("decode-0", 0, 1, 0xACCE55, 0x5EED0106, 0, 2, 1, True, LocalTime(206.0))
    res = r.at(6.0).step("P", "receive", hex=encode(stale).hex(), note="confirm-request at now == expiry")
    assert only(res, "Send")["message"]["outcome"] == int(AccessOutcome.STALE)
    frees = r.at(6.0).step("P", "handle_timeout")["outputs"]
    assert sorted(f["key"] for f in frees) == ["req-1", "req-2"]
    dec = r.at(6.0).step("D", "begin_access", key="k1")["result"]
    assert dec["allowed"] and not dec["guaranteed"]
    out = r.at(6.125).deliver("D", ack)
    lost = outs(out, "LeaseLost")
    assert sorted((x["key"], x["reason"]) for x in lost) == [("ghost", "unknown"), ("k1", "expired"), ("k2", "expired")]
    fin = r.at(6.25).step("D", "access_finished", key="k1", note="lost during the access")
    assert outs(fin, "AccessStale")
    unknown = AccessDone("decode-0", 0, 1, 0xACCE55, 0x5EED0106, 0, 50, 1, True, LocalTime(206.0))
    res = r.at(6.5).step("P", "receive", hex=encode(unknown).hex(), note="an id never granted")
    assert only(res, "Send")["message"]["outcome"] == int(AccessOutcome.UNKNOWN)
    return r


def bounds() -> Recorder:
    cfg = BASE.with_changes(tombstone_limit=2, max_outstanding_heartbeats=2)
    r = Recorder(
        "bounds",
        "Everything is bounded. The pinner remembers tombstone_limit (2) ended "
        "leases: a late heartbeat for an older one is answered 'unknown' instead of "
        "'completed'. The accessor remembers max_outstanding_heartbeats (2) unanswered "
        "rounds per engine: the ack of a forgotten round confers nothing. A grant may fix "
        "`expected`; an accessor layout that disagrees is Rejected.",
        cfg,
        {"P": pinner("prefill-0", 0x5EED0107), "D": accessor("decode-0")},
        {"P": 4321.0, "D": 1234.0},
    )
    tickets = [r.at(0.0).step("P", "grant", key=f"req-{i}")["result"] for i in range(1, 4)]
    hs = only(r.at(0.0).step("D", "track", key="k1", ticket=tickets[0]), "HandshakeNeeded")
    connect(r, "D", "P", hs, 0.25)
    heartbeat_round(r, "D", ["P"], 0.375)
    dec = r.at(0.875).step("D", "begin_access", key="k1")["result"]
    fin = r.at(0.9).step("D", "access_finished", key="k1")
    only(r.at(1.0).deliver("P", outs(fin, "Send")[0]), "Free")
    assert dec["guaranteed"]
    for lid in (2, 3):
        done = AccessDone("decode-9", 0, 1, 9, 0x5EED0107, 0, lid, 1, False, LocalTime(1.0))
        only(r.at(1.0).step("P", "receive", hex=encode(done).hex(), note="another accessor completes it"), "Free")
    late = Heartbeat("decode-0", 0, 1, 0xACCE55, 0x5EED0107, 99, LocalTime(1235.0), (1, 2, 3))
    ack = only(r.at(1.25).step("P", "receive", hex=encode(late).hex(), note="lease 1's tombstone was evicted"), "Send")
    assert ack["message"]["unknown"] == [1] and ack["message"]["completed"] == [2, 3]
    t4 = r.at(1.5).step("P", "grant", key="req-4")["result"]
    r.at(1.5).step("D", "track", key="k4", ticket=t4)
    sends = []
    for t in (1.5, 2.5, 3.5):
        sends += outs(r.at(t).step("D", "handle_timeout"), "Send")
    assert len(sends) == 3
    first_ack = only(r.at(3.625).deliver("P", sends[0]), "Send")
    assert r.at(3.75).deliver("D", first_ack, "its round was forgotten (bound 2)")["outputs"] == []
    assert r.at(3.75).step("D", "begin_access", key="k4")["result"]["valid_until"] is None
    r.at(3.75).step("D", "access_failed", key="k4", posted=False)
    t5 = r.at(4.0).step("P", "grant", key="req-5", expected=2)["result"]
    one = AccessDone("decode-0", 0, 1, 0xACCE55, 0x5EED0107, 0, t5["lease_id"], 1, False, LocalTime(1238.0))
    assert only(r.at(4.0).step("P", "receive", hex=encode(one).hex(), note="granted for 2 accessor ranks"), "Rejected")
    return r


# -- protocol version 3: the deployment is part of the fault model ----------------------------


def mismatched_terms() -> Recorder:
    d_config: JSONDict = {"kv_lease_duration": 30.0}
    long = BASE.with_changes(**d_config)
    r = Recorder(
        "mismatched_terms",
        "P and D configured apart (a rolling config change): P extends by 4 s (duration 6), "
        "D's own settings would give it 19.9 s (duration 30). P states the terms it enforces "
        "in its handshake reply and in every ack; D counts validity from the stricter of those "
        "and its own, heartbeats at a quarter of the shorter extension, and so never counts "
        "valid a lease P has freed. v2 counted 19.9 s here: a stale read 13.9 s past P's free. An "
        "unconfirmed READ waits for a verdict for P's window too; a waiting lease is given up a whole "
        "lease duration (D's own) after its last acknowledged round was sent.",
        BASE,
        {"P": pinner("prefill-0", 0x5EED0301), "D": {**accessor("decode-0"), "config": d_config}},
        {"P": 3100.0, "D": 7733.5},
    )
    ticket = r.at(0.0).step("P", "grant", key="req-1")["result"]
    ticket2 = r.at(0.0).step("P", "grant", key="req-2")["result"]
    hs = only(r.at(0.25).step("D", "track", key="req-1", ticket=ticket), "HandshakeNeeded")
    assert r.at(0.25).step("D", "track", key="req-2", ticket=ticket2)["outputs"] == []
    connect(r, "D", "P", hs, 0.375)
    acks = heartbeat_round(r, "D", ["P"], 0.5)
    assert all(a["outputs"] == [] for a in acks)
    dec = r.at(1.0).step("D", "begin_access", key="req-1")["result"]
    assert dec["allowed"] and dec["guaranteed"]
    window = dec["valid_until"] - r.local("D", 0.5)
    assert abs(window - BASE.accessor_extension) < 1e-9 and window < long.accessor_extension - 15.0
    r.at(1.25).step("D", "access_failed", key="req-1", posted=False, note="not posted: D tries later")
    # D's next heartbeat is due a quarter of P's extension after the last, not D's own period.
    nd = r.at(1.25).step("D", "handle_timeout")["next_deadline"]
    assert nd is not None and abs(nd - r.local("D", 0.5 + BASE.lease_extension / 4)) < 1e-9
    # D stops heartbeating (overloaded, its sends lost); P's lease runs out at 6.0.
    dec = r.at(0.5 + BASE.accessor_extension + 0.01).step("D", "begin_access", key="req-1", note="past P's terms")
    res = dec["result"]
    assert not res["guaranteed"] and res["valid_until"] < r.local("D"), res  # only a confirmed read now
    frees = r.at(BASE.kv_lease_duration).step("P", "handle_timeout")["outputs"]
    assert sorted(f["key"] for f in frees) == ["req-1", "req-2"] and all(f["reason"] == "expired" for f in frees)
    # The READ ends unconfirmed: D waits for a verdict for P's window (E_a from P's terms), not D's.
    done = only(r.at(6.25).step("D", "access_finished", key="req-1", note="the READ ends, not covered"), "Send")
    assert done["message"]["confirm"] is True
    deadline = 6.25 + BASE.accessor_extension
    res = r.at(deadline).step("D", "handle_timeout", note="no verdict within P's window: stale (D's own: 19.9 s)")
    assert only_type(res, "AccessStale")["key"] == "req-1"
    # req-2 waits: given up a whole lease duration (D's own, 30 s) after its last acknowledged round
    # was sent, not when its window lapsed (nor at valid_until less D's own E_a + 30 s, as v2 had it).
    res = r.at(30.375).step("D", "handle_timeout", note="req-2's window lapsed long ago: not a loss by itself")
    assert not outs(res, "LeaseLost")
    lost = only_type(r.at(30.5).step("D", "handle_timeout", note="last acknowledged send + 30 s"), "LeaseLost")
    assert lost["key"] == "req-2" and lost["reason"] == "validity_lapsed"
    return r


def posted_failed_push() -> Recorder:
    r = Recorder(
        "posted_failed_push",
        "Push mode: a WRITE is posted and then fails (a later part refused, an error after "
        "the first posts); the WRITE may still land. The accessor's Release says posted=true, "
        "and the pinner holds the destination pages as it would at expiry: freed at expiry + "
        "the push guard, never at once; heartbeats no longer extend it. A Release with "
        "posted=false (nothing posted, the transfer abandoned) frees at once.",
        BASE,
        {"D": pinner("decode-0", 0x5EED0302), "P": accessor("prefill-0")},
        {"D": 412.0, "P": 90017.25},
    )
    t1 = r.at(0.0).step("D", "grant", key="req-1", push=True)["result"]
    hs = only(r.at(0.0).step("P", "track", key="req-1", ticket=t1, push=True), "HandshakeNeeded")
    connect(r, "P", "D", hs, 0.125)
    heartbeat_round(r, "P", ["D"], 0.25)
    dec = r.at(0.875).step("P", "begin_access", key="req-1")["result"]
    assert dec["allowed"] and dec["guaranteed"]
    failed = r.at(0.9).step("P", "access_failed", key="req-1", posted=True, note="the WRITE may still land")
    (rel,) = outs(failed, "Send")
    assert rel["message"]["type"] == "Release" and rel["message"]["posted"] is True
    assert r.at(0.95).deliver("D", rel, note="held, not freed")["outputs"] == []
    expiry = max(0.0 + BASE.kv_lease_duration, 0.5 + BASE.lease_extension)
    guard_end = expiry + BASE.push_guard
    assert r.at(expiry).step("D", "handle_timeout")["outputs"] == []
    assert r.at(guard_end - 0.001).step("D", "handle_timeout")["outputs"] == []
    free = only(r.at(guard_end).step("D", "handle_timeout"), "Free")
    assert free["reason"] == "released" and free["key"] == "req-1"
    # Nothing posted: the Release frees at once.
    t2 = r.at(8.0).step("D", "grant", key="req-2", push=True)["result"]
    assert r.at(8.0).step("P", "track", key="req-2", ticket=t2, push=True)["outputs"] == []
    heartbeat_round(r, "P", ["D"], 8.0)
    assert r.at(8.75).step("P", "begin_access", key="req-2")["result"]["guaranteed"]
    assert r.at(8.8).step("P", "access_failed", key="req-2", posted=False)["outputs"] == []
    (rel,) = outs(r.at(8.8).step("P", "untrack", key="req-2", note="the transfer is abandoned"), "Send")
    assert rel["message"]["posted"] is False
    assert only(r.at(8.9).deliver("D", rel), "Free")["reason"] == "released"
    return r


def multi_part_to_rank() -> Recorder:
    r = Recorder(
        "multi_part_to_rank",
        "Prefill TP=2, decode TP=1: one READ has a part per prefill rank, and each part's "
        "access-done names the pinner rank it is for (to_rank). Part 1's notification "
        "misdelivered to rank 0 (the wrong rank of the right engine) is Rejected and frees "
        "nothing; each rank frees on its own part's.",
        BASE,
        {
            "P0": pinner("prefill-0", 0x5EED0303, 0, 2),
            "P1": pinner("prefill-0", 0x5EED0303, 1, 2),
            "D": accessor("decode-0"),
        },
        {"P0": 5000.0, "P1": 5000.0, "D": 77.0},
    )
    t = r.at(0.0).step("P0", "grant", key="req-1")["result"]
    r.at(0.0).step("P1", "grant", key="req-1")
    hs = only(r.at(0.0).step("D", "track", key="req-1", ticket=t), "HandshakeNeeded")
    connect(r, "D", "P0", hs, 0.25)
    heartbeat_round(r, "D", ["P0", "P1"], 0.375)
    dec = r.at(1.0).step("D", "begin_access", key="req-1")["result"]
    assert dec["guaranteed"] and dec["targets"] == [0, 1] and len(dec["notifications"]) == 2
    n0, n1 = dec["notifications"]
    assert n0 != n1
    rej = r.at(1.25).step("P0", "receive", hex=n1, note="part 1's notification at pinner rank 0")
    assert only(rej, "Rejected")
    assert only(r.at(1.25).step("P0", "receive", hex=n0), "Free")["reason"] == "access_done"
    assert only(r.at(1.3).step("P1", "receive", hex=n1), "Free")["reason"] == "access_done"
    assert outs(r.at(1.5).step("D", "access_finished", key="req-1", notified=True), "AccessCompleted")
    return r


def ack_bound() -> Recorder:
    from kvlease import MIN_MESSAGE_BYTES

    small = {"max_message_bytes": MIN_MESSAGE_BYTES}
    r = Recorder(
        "ack_bound",
        "Every reply a pinner makes fits its max_message_bytes by construction: a heartbeat "
        "whose ack could exceed the bound (ids far apart, each a 9-byte delta in one of the "
        "ack's lists) is Rejected with no ack. An honest accessor never sends one: it splits "
        "by the id budget of both bounds (the pinner's from the handshake reply).",
        BASE.with_changes(**small),
        {"P": pinner("prefill-0", 0x5EED0304), "D": accessor("decode-0", session=0xD3)},
        {"P": 1.0, "D": 2.0},
    )
    r.at(0.0).step("P", "grant", key="req-1")
    wide = tuple(1 + i * 2**40 for i in range(15))
    hb = Heartbeat("decode-0", 0, 1, 0xD3, 0x5EED0304, 1, LocalTime(2.0), wide)
    assert len(encode(hb)) <= MIN_MESSAGE_BYTES
    rej = r.at(0.25).step("P", "receive", hex=encode(hb).hex(), note="15 ids 2**40 apart")
    assert only(rej, "Rejected")
    near = Heartbeat("decode-0", 0, 1, 0xD3, 0x5EED0304, 2, LocalTime(2.5), (1,))
    ack = only(r.at(0.5).step("P", "receive", hex=encode(near).hex()), "Send")
    assert len(bytes.fromhex(ack["hex"])) <= MIN_MESSAGE_BYTES
    return r


# -- bound by tools/mutation_check.py: each rule below had a mutant of the core pass every vector --


def lease_binding() -> Recorder:
    r = Recorder(
        "lease_binding",
        "A lease speaks for the accessor bound to it (engine, and per rank its session): another "
        "engine's heartbeat and one of another session of the same engine are not renewed "
        "('unknown' + Rejected); a replayed heartbeat (a seq no newer than one that extended the "
        "lease) is acknowledged but extends nothing, so the lease frees at the last fresh one + "
        "extension; a completed lease's tombstone answers OK only to the session it counted. A "
        "refused call changes nothing, not even the endpoint's latest now: later calls may read "
        "an earlier clock.",
        BASE,
        {"P": pinner("prefill-0", 0x5EED0401), "D": accessor("decode-0", session=0xD0)},
        {"P": 2500.0, "D": 610.0},
    )
    t1 = r.at(0.0).step("P", "grant", key="req-1")["result"]
    t2 = r.at(0.0).step("P", "grant", key="req-2")["result"]
    note = "refused (never issued) at a later clock reading"
    assert r.step("P", "release", note, clock=r.local("P", 0.5), lease_id=99)["error"]["class"] == "LocalProtocolError"
    hs = only(r.at(0.0).step("D", "track", key="req-1", ticket=t1), "HandshakeNeeded")
    r.at(0.0).step("D", "track", key="req-2", ticket=t2)
    note = "refused (tracked twice) at a later clock reading"
    twice = r.step("D", "track", note, clock=r.local("D", 0.5), key="req-1", ticket=t1)
    assert twice["error"]["class"] == "LocalProtocolError"
    connect(r, "D", "P", hs, 0.25)
    first = outs(r.at(0.5).step("D", "handle_timeout"), "Send")[0]
    ack = only(r.at(0.75).deliver("P", first, "binds both leases to decode-0, rank 0, session 0xD0"), "Send")
    r.at(1.0).deliver("D", ack)
    other = Heartbeat("decode-1", 0, 1, 0xE1, 0x5EED0401, 1, LocalTime(33001.0), (1, 2))
    res = r.at(1.0).step("P", "receive", hex=encode(other).hex(), note="another accessor engine")
    assert [o["type"] for o in res["outputs"]] == ["Rejected", "Send"]
    assert res["outputs"][1]["message"]["unknown"] == [1, 2]
    restarted = Heartbeat("decode-0", 0, 1, 0xD9, 0x5EED0401, 1, LocalTime(611.0), (1, 2))
    res = r.at(1.0).step("P", "receive", hex=encode(restarted).hex(), note="decode-0 rank 0, another session")
    assert [o["type"] for o in res["outputs"]] == ["Rejected", "Send"]
    assert res["outputs"][1]["message"]["unknown"] == [1, 2]
    heartbeat_round(r, "D", ["P"], 1.5)
    heartbeat_round(r, "D", ["P"], 2.5)  # handled at 2.75: req-1 expires at 6.75
    dec = r.at(3.0).step("D", "begin_access", key="req-2")["result"]
    assert dec["guaranteed"]
    fin = r.at(3.0).step("D", "access_finished", key="req-2")
    assert only(r.at(3.25).deliver("P", outs(fin, "Send")[0]), "Free")["reason"] == "access_done"
    dup = AccessDone("decode-0", 0, 1, 0xD0, 0x5EED0401, 0, 2, 77, True, LocalTime(613.5))
    res = r.at(3.5).step("P", "receive", hex=encode(dup).hex(), note="the counted session asks again: OK")
    assert only(res, "Send")["message"]["outcome"] == int(AccessOutcome.OK)
    alien = AccessDone("decode-0", 0, 1, 0xD9, 0x5EED0401, 0, 2, 5, True, LocalTime(613.5))
    res = r.at(3.5).step("P", "receive", hex=encode(alien).hex(), note="another session of decode-0 asks: STALE")
    assert only(res, "Send")["message"]["outcome"] == int(AccessOutcome.STALE)
    replay = only(r.at(5.0).deliver("P", first, "the first heartbeat, replayed"), "Send")
    assert replay["message"]["renewed"] == 1 and replay["message"]["completed"] == [2]
    assert r.at(6.625).step("P", "handle_timeout")["outputs"] == []
    free = only(r.at(6.75).step("P", "handle_timeout", note="the last fresh heartbeat (2.75) + 4 s"), "Free")
    assert free["key"] == "req-1" and free["reason"] == "expired"
    return r


def verdict_binding() -> Recorder:
    r = Recorder(
        "verdict_binding",
        "Prefill TP=2, decode TP=1, acks lost, so the READ asks both pinner ranks to confirm. A "
        "verdict counts only if addressed to this rank and session, for this attempt, and once per "
        "pinner rank: one for rank 1 of the session, one for another session, one on an earlier "
        "attempt, and duplicates of rank 0's (before and after access_finished) all count nothing; "
        "the access completes on rank 1's own OK.",
        BASE,
        {
            "P0": pinner("prefill-0", 0x5EED0402, 0, 2),
            "P1": pinner("prefill-0", 0x5EED0402, 1, 2),
            "D": accessor("decode-0", session=0xD0),
        },
        {"P0": 8100.0, "P1": 8100.0, "D": 450.0},
    )
    from kvlease import decode

    t = r.at(0.0).step("P0", "grant", key="req-1")["result"]
    r.at(0.0).step("P1", "grant", key="req-1")
    hs = only(r.at(0.0).step("D", "track", key="req-1", ticket=t), "HandshakeNeeded")
    connect(r, "D", "P0", hs, 0.125)
    heartbeat_round(r, "D", ["P0", "P1"], 0.375, lose_back=True)
    first = r.at(1.0).step("D", "begin_access", key="req-1")["result"]
    r.at(1.0).step("D", "access_failed", key="req-1", posted=False, note="attempt 1: nothing posted")
    attempt1 = decode(bytes.fromhex(first["notifications"][1]))
    assert isinstance(attempt1, AccessDone)
    dec = r.at(1.1).step("D", "begin_access", key="req-1")["result"]
    assert dec["allowed"] and not dec["guaranteed"] and len(dec["notifications"]) == 2
    n0, n1 = dec["notifications"]
    res = r.at(1.2).step("P0", "receive", hex=n0)
    assert [o["type"] for o in res["outputs"]] == ["Free", "Send"]
    v0 = res["outputs"][1]
    assert only(r.at(1.3).step("D", "receive", hex=forged(v0["hex"], to_rank=1), note="for rank 1"), "Rejected")
    assert only(
        r.at(1.3).step("D", "receive", hex=forged(v0["hex"], to_session=0xBAD), note="for another session"), "Rejected"
    )
    stale = AccessDoneAck("prefill-0", 1, 0x5EED0402, 0, 0xD0, 1, attempt1.attempt, AccessOutcome.OK)
    note = "rank 1's OK on attempt 1"
    assert r.at(1.3).step("D", "receive", hex=encode(stale).hex(), note=note)["outputs"] == []
    assert r.at(1.35).deliver("D", v0, "rank 0's OK, before the transfer is reported done")["outputs"] == []
    assert r.at(1.4).deliver("D", v0, "a duplicate of it")["outputs"] == []
    fin = r.at(1.5).step("D", "access_finished", key="req-1", notified=True, note="rank 1 has not answered")
    assert fin["outputs"] == []
    assert r.at(1.6).deliver("D", v0, "rank 0's OK again, after")["outputs"] == []
    res = r.at(1.7).step("P1", "receive", hex=n1)
    assert [o["type"] for o in res["outputs"]] == ["Free", "Send"]
    ok = only(r.at(1.8).deliver("D", res["outputs"][1]), "AccessCompleted")
    assert ok["confirmed_by_pinner"] is True
    return r


def accessor_edges() -> Recorder:
    r = Recorder(
        "accessor_edges",
        "Edges of the accessor's rules. req-1: begun with less than A_l = A(1+rho) of window left "
        "(but more than A) is not guaranteed; finished exactly at valid_until it is not covered "
        "(covered is now < valid_until) and asks the pinner. req-2: an ack listing it 'completed' "
        "while it is being accessed (its own attached access-done landed) does not lose it. "
        "req-3: lost during an access (disconnect) it is retired at once, so its ticket cannot be "
        "tracked again while the access runs; finished with notified=true it sends nothing.",
        BASE,
        {"P": pinner("prefill-0", 0x5EED0403), "D": accessor("decode-0")},
        {"P": 900.0, "D": 43000.0},
    )
    tickets = [r.at(0.0).step("P", "grant", key=f"req-{i}")["result"] for i in (1, 2, 3)]
    hs = only(r.at(0.0).step("D", "track", key="req-1", ticket=tickets[0]), "HandshakeNeeded")
    r.at(0.0).step("D", "track", key="req-2", ticket=tickets[1])
    r.at(0.0).step("D", "track", key="req-3", ticket=tickets[2])
    connect(r, "D", "P", hs, 0.125)
    heartbeat_round(r, "D", ["P"], 0.375)
    dec = r.at(1.0).step("D", "begin_access", key="req-2")["result"]
    assert dec["guaranteed"]
    landed = r.at(1.1).step("P", "receive", hex=dec["notifications"][0], note="req-2's attached access-done lands")
    assert only(landed, "Free")["reason"] == "access_done"
    acks = heartbeat_round(r, "D", ["P"], 1.375)
    assert acks[0]["outputs"] == [], "completed while accessing: our own access-done"
    fin = r.at(2.0).step("D", "access_finished", key="req-2", notified=True)
    assert only(fin, "AccessCompleted")["confirmed_by_pinner"] is False
    acc = r.impl._endpoints["D"]
    assert isinstance(acc, Accessor)
    valid = acc.valid_until("req-1")
    assert valid is not None and abs(valid - r.local("D", 1.375) - BASE.accessor_extension) < 1e-9
    begin = valid - (BASE.max_access_time + BASE.access_time_local) / 2
    dec = r.step("D", "begin_access", "between A and A_l before valid_until", clock=begin, key="req-1")["result"]
    assert dec["allowed"] and not dec["guaranteed"]
    done = only(r.step("D", "access_finished", "exactly at valid_until", clock=valid, key="req-1"), "Send")
    assert done["message"]["confirm"] is True
    r.at(valid - r.epochs["D"] + 0.0625)
    res = r.deliver("P", done)
    assert [o["type"] for o in res["outputs"]] == ["Free", "Send"]
    assert only(r.at(r.t + 0.0625).deliver("D", res["outputs"][1]), "AccessCompleted")["confirmed_by_pinner"]
    r.at(r.t + 0.125)
    assert not r.step("D", "begin_access", key="req-3")["result"]["guaranteed"]
    lost = only(r.step("D", "disconnect", engine_id="prefill-0"), "LeaseLost")
    assert lost["key"] == "req-3" and lost["reason"] == "unreachable"
    again = r.step("D", "track", "its access still runs: retired at the loss", key="req-3-again", ticket=tickets[2])
    assert again["error"]["class"] == "LocalProtocolError"
    fin = r.step("D", "access_finished", key="req-3", notified=True)
    assert only(fin, "AccessStale")["key"] == "req-3"
    return r


def retrack_edges() -> Recorder:
    cfg = BASE.with_changes(tombstone_limit=1)
    r = Recorder(
        "retrack_edges",
        "tombstone_limit 1: leases 5, 3 and 6 are given up in that order; the watermark rises "
        "to 5 and never moves down (to 3), so re-tracking 5 is LeaseLost 'forgotten'. A ticket of "
        "the connected incarnation that names another TP size is LeaseLost 'unknown', not tracked.",
        cfg,
        {"P": pinner("prefill-0", 0x5EED0404), "D": accessor("decode-0")},
        {"P": 70.0, "D": 4400.0},
    )
    tickets = {i: r.at(0.0).step("P", "grant", key=f"req-{i}")["result"] for i in range(1, 9)}
    hs = only(r.at(0.0).step("D", "track", key="req-7", ticket=tickets[7]), "HandshakeNeeded")
    connect(r, "D", "P", hs, 0.125)
    for i in (5, 3, 6):
        r.at(0.5).step("D", "track", key=f"req-{i}", ticket=tickets[i])
        r.at(0.5).step("D", "untrack", key=f"req-{i}")
    lost = only(r.at(0.75).step("D", "track", key="req-5-again", ticket=tickets[5]), "LeaseLost")
    assert lost["reason"] == "forgotten"
    wider = {**tickets[8], "ranks": 2}
    lost = only(r.at(1.0).step("D", "track", key="req-8", ticket=wider, note="ranks 2; the pinner said 1"), "LeaseLost")
    assert lost["reason"] == "unknown"
    return r


def fixed_ttl_past_deadline() -> Recorder:
    r = Recorder(
        "fixed_ttl_past_deadline",
        "A fixed-TTL lease (1 s) whose first acknowledged round arrives after its deadline: the "
        "deadline, already past, is converted stretched by (1+rho)/(1-rho) (it happened at least "
        "that long ago in the accessor's clock), so valid_until lies in the past; the READ asks "
        "the pinner, which answers STALE.",
        BASE,
        {"D": pinner("decode-0", 0x5EED0405), "P": accessor("prefill-0")},
        {"D": 1200.0, "P": 77777.0},
    )
    t = r.at(0.0).step("D", "grant", key="turn-1", kind=1, ttl=1.0)["result"]
    hs = only(r.at(0.0).step("P", "track", key="turn-1", ticket=t), "HandshakeNeeded")
    connect(r, "P", "D", hs, 0.125)
    hb = outs(r.at(0.5).step("P", "handle_timeout"), "Send")[0]
    ack = only(r.at(0.75).deliver("D", hb), "Send")
    assert ack["message"]["renewed"] == 1
    assert r.at(1.5).deliver("P", ack, "the ack arrives after the deadline")["outputs"] == []
    dec = r.at(1.5).step("P", "begin_access", key="turn-1")["result"]
    assert dec["allowed"] and not dec["guaranteed"] and dec["valid_until"] < r.local("P")
    done = only(r.at(1.625).step("P", "access_finished", key="turn-1"), "Send")
    assert done["message"]["confirm"] is True
    verdict = only(r.at(1.75).deliver("D", done), "Send")
    assert verdict["message"]["outcome"] == int(AccessOutcome.STALE)
    assert only(r.at(1.875).deliver("P", verdict), "AccessStale")
    return r


def stated_terms() -> Recorder:
    p_config: JSONDict = {"max_drift_rate": 1e-3, "max_access_time": 2.0}
    r = Recorder(
        "stated_terms",
        "P states a larger drift bound (1e-3) and access-time bound (2 s) than D's own (1e-4, "
        "0.5 s): D's window shrinks by P's drift bound, and a READ begun with 1 s of window left "
        "is not guaranteed (P's bound, 2 s, does not fit).",
        BASE,
        {"P": {**pinner("prefill-0", 0x5EED0406), "config": p_config}, "D": accessor("decode-0")},
        {"P": 5.0, "D": 6.0},
    )
    strict = BASE.with_changes(**p_config)
    ticket = r.at(0.0).step("P", "grant", key="req-1")["result"]
    hs = only(r.at(0.0).step("D", "track", key="req-1", ticket=ticket), "HandshakeNeeded")
    connect(r, "D", "P", hs, 0.125)
    heartbeat_round(r, "D", ["P"], 0.375)
    at = 0.375 + strict.accessor_extension - 1.0
    dec = r.at(at).step("D", "begin_access", key="req-1", note="1 s of window left")["result"]
    assert dec["allowed"] and not dec["guaranteed"]
    assert abs(dec["valid_until"] - r.local("D", 0.375) - strict.accessor_extension) < 1e-9
    r.at(at).step("D", "access_failed", key="req-1", posted=False)
    return r


def ack_extensions() -> Recorder:
    short: JSONDict = {"kv_lease_duration": 3.0}
    r = Recorder(
        "ack_extensions",
        "Each ack states the extension its pinner rank applied. Prefill TP=2 whose rank 1 runs a "
        "shorter lease (duration 3, extension 2): D's window for a round is counted from the "
        "smallest extension any of its acks stated (rank 1's, whatever the order of arrival). "
        "D2 runs the shorter settings itself: acks stating 4 s give it no more than its own 2.",
        BASE,
        {
            "P0": pinner("prefill-0", 0x5EED0407, 0, 2),
            "P1": {**pinner("prefill-0", 0x5EED0407, 1, 2), "config": short},
            "D": accessor("decode-0", session=0xD0),
            "D2": {**accessor("decode-1", 0, 2, session=0xD2), "config": short},
        },
        {"P0": 640.0, "P1": 640.0, "D": 9100.0, "D2": 300.0},
    )
    short_cfg = BASE.with_changes(**short)
    t = r.at(0.0).step("P0", "grant", key="req-1")["result"]
    r.at(0.0).step("P1", "grant", key="req-1")
    hs = only(r.at(0.0).step("D", "track", key="req-1", ticket=t), "HandshakeNeeded")
    connect(r, "D", "P0", hs, 0.125)
    s0, s1 = outs(r.at(0.375).step("D", "handle_timeout"), "Send")
    a0 = only(r.at(0.5).deliver("P0", s0), "Send")
    a1 = only(r.at(0.5).deliver("P1", s1), "Send")
    assert a0["message"]["extension"] == 4.0 and a1["message"]["extension"] == 2.0
    r.at(0.625).deliver("D", a1, "rank 1's ack (2 s) first")
    r.at(0.75).deliver("D", a0, "rank 0's (4 s) last")
    dec = r.at(0.875).step("D", "begin_access", key="req-1")["result"]
    assert abs(dec["valid_until"] - r.local("D", 0.375) - short_cfg.accessor_extension) < 1e-9
    r.at(0.875).step("D", "access_failed", key="req-1", posted=False)
    t2 = r.at(1.0).step("P0", "grant", key="req-2")["result"]
    hs2 = only(r.at(1.0).step("D2", "track", key="req-2", ticket=t2), "HandshakeNeeded")
    connect(r, "D2", "P0", hs2, 1.125)
    acks = heartbeat_round(r, "D2", ["P0"], 1.375)
    assert acks[0]["outputs"] == []
    dec = r.at(1.875).step("D2", "begin_access", key="req-2")["result"]
    assert abs(dec["valid_until"] - r.local("D2", 1.375) - short_cfg.accessor_extension) < 1e-9
    return r


def rounds_bound() -> Recorder:
    cfg = BASE.with_changes(max_message_bytes=192, max_outstanding_heartbeats=2)
    r = Recorder(
        "rounds_bound",
        "max_outstanding_heartbeats (2) counts heartbeat rounds, not chunks: a round of 20 ids "
        "split into 2+ chunks is still outstanding (one round) when the next periodic round is "
        "sent, so its late acks still validate the leases.",
        cfg,
        {"P": pinner("prefill-0", 0x5EED0408), "D": accessor("decode-0")},
        {"P": 10.0, "D": 20.0},
    )
    tickets = [r.at(0.0).step("P", "grant", key=f"req-{i}", lease_id=1 + i * 2**20)["result"] for i in range(20)]
    hs = only(r.at(0.0).step("D", "track", key="req-0", ticket=tickets[0]), "HandshakeNeeded")
    for i, tk in enumerate(tickets[1:], 1):
        r.at(0.0).step("D", "track", key=f"req-{i}", ticket=tk)
    connect(r, "D", "P", hs, 0.125)
    sends = outs(r.at(0.375).step("D", "handle_timeout"), "Send")
    assert len(sends) >= 2
    acks = [only(r.at(0.5).deliver("P", s), "Send") for s in sends]
    nxt = r.at(1.375).step("D", "handle_timeout", note="the next round; the first one's acks are late")
    assert len(outs(nxt, "Send")) >= 2
    for a in acks:
        assert r.at(1.5).deliver("D", a)["outputs"] == []
    dec = r.at(1.625).step("D", "begin_access", key="req-0")["result"]
    assert dec["guaranteed"] and abs(dec["valid_until"] - r.local("D", 0.375) - cfg.accessor_extension) < 1e-9
    return r


def handshake_new_incarnation() -> Recorder:
    r = Recorder(
        "handshake_new_incarnation",
        "The accessor tracks a ticket of incarnation 1 and handshakes; before the reply, the "
        "pinner restarts and a ticket of incarnation 2 is tracked: the outstanding handshake is "
        "forgotten and a new one is due at once, so the late reply of incarnation 1 counts "
        "nothing (it would have lost the new ticket as pinner_restarted); the new reply loses "
        "the old incarnation's lease.",
        BASE,
        {"P": pinner("prefill-0", 0x1001), "P2": pinner("prefill-0", 0x2002), "D": accessor("decode-0")},
        {"P": 150.0, "P2": 150.0, "D": 62000.0},
    )
    t1 = r.at(0.0).step("P", "grant", key="req-1")["result"]
    hs1 = only(r.at(0.0).step("D", "track", key="k1", ticket=t1), "HandshakeNeeded")
    old_reply = r.at(0.125).step("P", "handshake", hex=hs1["hex"])["result"]["hex"]
    t2 = r.at(0.25).step("P2", "grant", key="req-2")["result"]
    note = "a new incarnation: handshake again now"
    hs2 = only(r.at(0.375).step("D", "track", key="k2", ticket=t2, note=note), "HandshakeNeeded")
    note = "the old incarnation's reply, late"
    assert r.at(0.5).step("D", "handshake_reply", hex=old_reply, note=note)["outputs"] == []
    reply = r.at(0.5).step("P2", "handshake", hex=hs2["hex"])["result"]["hex"]
    lost = only(r.at(0.625).step("D", "handshake_reply", hex=reply), "LeaseLost")
    assert lost["key"] == "k1" and lost["reason"] == "pinner_restarted"
    heartbeat_round(r, "D", ["P2"], 0.75)
    assert r.at(1.5).step("D", "begin_access", key="k2")["result"]["guaranteed"]
    return r


# -- codec vectors ----------------------------------------------------------------------------


def codec_cases() -> JSONDict:
    from kvlease import decode, decode_vllm

    valid_msgs: list[tuple[str, Message]] = [
        ("handshake", Handshake("decode-0", 1, 2, 0xACCE55, 3, 7, 1, LocalTime(98333.25))),
        (
            "handshake_reply",
            HandshakeReply(
                "prefill-0",
                0,
                2,
                0x5EED0001,
                3,
                7,
                1024,
                4.0,
                1e-4,
                0.5,
                1,
                0xACCE55,
                1,
                LocalTime(98333.25),
                PeerTime(14021.875),
                PeerTime(14021.875),
            ),
        ),
        (
            "heartbeat",
            Heartbeat("decode-0", 0, 1, 0xACCE55, 0x5EED0001, 3, LocalTime(98334.0), (1, 2, 3, 300, 70000, 2**63)),
        ),
        (
            "heartbeat_ack",
            HeartbeatAck(
                "prefill-0",
                1,
                0x5EED0001,
                0,
                0xACCE55,
                3,
                LocalTime(98334.0),
                PeerTime(14022.5),
                4.0,
                2,
                (7,),
                (8, 9),
                (),
                (12,),
            ),
        ),
        ("access_done", AccessDone("decode-0", 1, 2, 0xACCE55, 2**64 - 1, 1, 42, 17, True, LocalTime(98335.5))),
        ("access_done_ack", AccessDoneAck("prefill-0", 0, 5, 1, 0xACCE55, 42, 17, AccessOutcome.STALE)),
        ("release", Release("decode-0", 0, 1, 0xACCE55, 5, (4, 5, 900))),
        ("release_posted", Release("decode-0", 0, 1, 0xACCE55, 5, (4,), posted=True)),
        ("heartbeat_empty_ids", Heartbeat("d", 0, 1, 0, 0, 0, LocalTime(0.0), ())),
        ("heartbeat_largest_ranks", Heartbeat("d", 65535, 65536, 2**64 - 1, 0, 1, LocalTime(-(2.0**32)), (5,))),
    ]
    cases: list[JSON] = []
    for name, msg in valid_msgs:
        data = encode(msg)
        assert decode(data) == msg
        cases.append({"name": name, "codec": "native", "hex": data.hex(), "expect": {"message": message_to_json(msg)}})
    for name, raw in [
        ("vllm_heartbeat", encode_vllm_heartbeat(["cmpl-1", "cmpl-2:x"])),
        ("vllm_done", encode_vllm_done("cmpl-7", 4)),
        ("vllm_done_id_with_colon_last_wins", b"a:b:3"),
    ]:
        cases.append(
            {"name": name, "codec": "vllm", "hex": raw.hex(), "expect": {"message": message_to_json(decode_vllm(raw))}}
        )

    import msgpack

    def frame(*items: object) -> bytes:
        body = msgpack.packb(list(items), use_bin_type=True)
        assert isinstance(body, bytes)
        return b"\xc1\x4b" + body

    # Heartbeat fields after [version, type]: engine_id, rank, ranks, session, incarnation, seq, t_send, ids
    hb_ok = ["decode-0", 0, 1, 7, 1, 1, 1.0, [1, 2]]
    V = PROTOCOL_VERSION

    # HandshakeReply fields after [version, type], v3: the pinner states its terms.
    reply_ok: dict[str, object] = {
        "engine_id": "p",
        "rank": 0,
        "ranks": 1,
        "incarnation": 5,
        "version": V,
        "capabilities": 7,
        "max_message_bytes": 1024,
        "extension": 4.0,
        "max_drift_rate": 1e-4,
        "max_access_time": 0.5,
        "to_rank": 0,
        "to_session": 7,
        "seq": 1,
        "t_echo": 1.0,
        "t_recv": 2.0,
        "t_send": 2.0,
    }

    def reply(**change: object) -> bytes:
        return frame(V, 2, *({**reply_ok, **change}).values())

    def hb(**change: object) -> bytes:
        names = ["engine_id", "rank", "ranks", "session", "incarnation", "seq", "t_send", "ids"]
        items = [change.get(n, v) for n, v in zip(names, hb_ok, strict=True)]
        return frame(V, 3, *items)

    bad: list[tuple[str, str, bytes, list[JSON]]] = [
        ("empty", "native", b"", ["frame"]),
        ("wrong_magic", "native", b"\xc1\x4c" + msgpack.packb([V, 3]), ["frame"]),
        ("vllm_bytes_to_native", "native", b"HB:req-1", ["frame"]),
        ("magic_only", "native", b"\xc1\x4b", ["body"]),
        ("truncated_body", "native", encode(valid_msgs[2][1])[:-3], ["body"]),
        ("trailing_bytes", "native", encode(valid_msgs[2][1]) + b"\x00", ["body"]),
        ("not_an_array", "native", b"\xc1\x4b" + msgpack.packb(7), ["body"]),
        ("array_too_short", "native", frame(V), ["body"]),
        ("map_body", "native", b"\xc1\x4b" + msgpack.packb({"v": V}), ["body"]),
        ("version_1", "native", frame(1, 3, "decode-0", 0, 1, 1, 1.0, [1, 2]), ["version"]),
        ("version_2", "native", frame(2, 3, *hb_ok), ["version"]),  # v2 and v3 refuse each other
        ("version_4", "native", frame(4, 3, *hb_ok), ["version"]),
        ("version_0", "native", frame(0, 3, *hb_ok), ["version"]),
        ("version_bool", "native", frame(True, 3, *hb_ok), ["version"]),
        ("type_unknown", "native", frame(V, 99, *hb_ok), ["type"]),
        ("type_zero", "native", frame(V, 0, *hb_ok), ["type"]),
        ("arity_short", "native", frame(V, 3, *hb_ok[:-1]), ["arity"]),
        ("arity_long", "native", frame(V, 3, *hb_ok, 0), ["arity"]),
        ("engine_empty", "native", hb(engine_id=""), ["field"]),
        ("engine_not_str", "native", hb(engine_id=5), ["field"]),
        ("engine_too_long", "native", hb(engine_id="e" * 257), ["body", "field"]),
        ("engine_binary", "native", hb(engine_id=b"decode-0"), ["body", "field"]),
        ("rank_negative", "native", hb(rank=-1), ["field"]),
        ("rank_bool", "native", hb(rank=True), ["field"]),
        ("rank_float", "native", hb(rank=0.0), ["field"]),
        ("ranks_zero", "native", hb(ranks=0), ["field"]),
        ("ranks_too_many", "native", hb(ranks=65537), ["field"]),
        ("session_negative", "native", hb(session=-1), ["field"]),
        ("time_nan", "native", hb(t_send=float("nan")), ["field"]),
        ("time_inf", "native", hb(t_send=float("inf")), ["field"]),
        ("time_beyond_2_32", "native", hb(t_send=2.0**32 + 1.0), ["field"]),
        ("time_string", "native", hb(t_send="1.0"), ["field"]),
        ("ids_zero_gap", "native", hb(ids=[5, 0]), ["field"]),
        ("ids_negative", "native", hb(ids=[-5]), ["field"]),
        ("ids_overflow_u64", "native", hb(ids=[2**64 - 1, 1]), ["field"]),
        ("ids_not_array", "native", hb(ids=5), ["field"]),
        ("handshake_ranks_zero", "native", frame(V, 1, "d", 0, 0, 7, V, 7, 1, 1.0), ["field"]),
        ("handshake_reply_max_message_bytes_zero", "native", reply(max_message_bytes=0), ["field"]),
        ("handshake_reply_extension_zero", "native", reply(extension=0.0), ["field"]),
        ("handshake_reply_extension_negative", "native", reply(extension=-6.0), ["field"]),
        ("handshake_reply_extension_beyond_2_32", "native", reply(extension=2.0**32 + 1.0), ["field"]),
        ("handshake_reply_drift_rate_one", "native", reply(max_drift_rate=1.0), ["field"]),
        ("handshake_reply_drift_rate_negative", "native", reply(max_drift_rate=-1e-4), ["field"]),
        ("handshake_reply_drift_rate_nan", "native", reply(max_drift_rate=float("nan")), ["field"]),
        ("handshake_reply_access_time_inf", "native", reply(max_access_time=float("inf")), ["field"]),
        ("handshake_reply_access_time_string", "native", reply(max_access_time="0.5"), ["field"]),
        (
            "heartbeat_ack_extension_zero",
            "native",
            frame(V, 4, "p", 0, 5, 0, 7, 1, 1.0, 2.0, 0.0, 0, [], [], [], []),
            ["field"],
        ),
        ("access_done_confirm_int", "native", frame(V, 5, "d", 0, 1, 7, 5, 0, 1, 1, 0, 1.0), ["field"]),
        ("access_done_to_rank_negative", "native", frame(V, 5, "d", 0, 1, 7, 5, -1, 1, 1, True, 1.0), ["field"]),
        ("access_done_v2_arity", "native", frame(V, 5, "d", 0, 1, 7, 5, 1, 1, True, 1.0), ["arity"]),
        ("access_done_ack_outcome_3", "native", frame(V, 6, "p", 0, 5, 0, 7, 1, 1, 3), ["field"]),
        ("release_ranks_zero", "native", frame(V, 7, "d", 0, 0, 7, 5, [1], False), ["field"]),
        ("release_posted_int", "native", frame(V, 7, "d", 0, 1, 7, 5, [1], 1), ["field"]),
        ("release_v2_arity", "native", frame(V, 7, "d", 0, 1, 7, 5, [1]), ["arity"]),
        ("vllm_empty", "vllm", b"", ["frame"]),
        ("vllm_not_utf8", "vllm", b"HB:\xff\xfe", ["frame"]),
        ("vllm_no_colon", "vllm", b"req-1", ["frame"]),
        ("vllm_heartbeat_empty_id", "vllm", b"HB:a,,b", ["field"]),
        ("vllm_done_count_zero", "vllm", b"req-1:0", ["field"]),
        ("vllm_done_count_huge", "vllm", b"req-1:65537", ["field"]),
        ("vllm_done_count_not_digits", "vllm", b"req-1:x1", ["field"]),
        ("vllm_done_empty_id", "vllm", b":3", ["frame"]),
    ]
    # Sealed frames (deployment-key authentication): a test key, and the previous one of a
    # rotation. An implementation must accept exactly these tags and refuse the rest.
    from kvlease import FrameAuth

    key_new, key_old = bytes(range(16)), bytes(range(200, 232))
    sealed_new, sealed_old = FrameAuth([key_new]), FrameAuth([key_old])
    rotating: list[JSON] = [key_new.hex(), key_old.hex()]
    for name, msg in valid_msgs[:7]:
        data = sealed_new.seal(encode(msg))
        cases.append(
            {
                "name": f"sealed_{name}",
                "codec": "sealed",
                "keys": [key_new.hex()],
                "hex": data.hex(),
                "expect": {"message": message_to_json(msg)},
            }
        )
    hb_msg = valid_msgs[2][1]
    cases.append(
        {
            "name": "sealed_with_the_previous_key_during_a_rotation",
            "codec": "sealed",
            "keys": rotating,
            "hex": sealed_old.seal(encode(hb_msg)).hex(),
            "expect": {"message": message_to_json(hb_msg)},
        }
    )
    good = sealed_new.seal(encode(hb_msg))
    tampered = bytearray(good)
    tampered[-1] ^= 1
    tag_flipped = bytearray(good)
    tag_flipped[5] ^= 0x80
    for name, raw in [
        ("sealed_unsealed_frame_refused", encode(hb_msg)),
        ("sealed_with_another_key", sealed_old.seal(encode(hb_msg))),
        ("sealed_body_tampered", bytes(tampered)),
        ("sealed_tag_tampered", bytes(tag_flipped)),
        ("sealed_truncated_tag", good[:10]),
        ("sealed_vllm_notification_refused", encode_vllm_heartbeat(["req-1"])),
    ]:
        try:
            decode(sealed_new.open(raw))
        except Exception as exc:
            from kvlease import DecodeError

            assert isinstance(exc, DecodeError) and exc.category == "auth", (name, exc)
        else:
            raise AssertionError(f"{name} opened")
        cases.append(
            {
                "name": name,
                "codec": "sealed",
                "keys": [key_new.hex()],
                "hex": raw.hex(),
                "expect": {"error": {"class": "DecodeError", "category": ["auth"]}},
            }
        )
    for name, codec, raw, cats in bad:
        fn = decode if codec == "native" else decode_vllm
        try:
            fn(raw)
        except Exception as exc:
            from kvlease import DecodeError

            assert isinstance(exc, DecodeError), (name, exc)
            assert exc.category in cats, (name, str(exc), exc.category, cats)
        else:
            raise AssertionError(f"{name} decoded")
        cases.append(
            {
                "name": name,
                "codec": codec,
                "hex": raw.hex(),
                "expect": {"error": {"class": "DecodeError", "category": cats}},
            }
        )
    return {
        "format": VECTOR_FORMAT,
        "kind": "codec",
        "name": "codec",
        "description": "Exact bytes of every message type (decode must yield exactly these "
        "fields) and malformed byte strings that must be rejected with DecodeError of the given "
        "category (any one of those listed).",
        "cases": cases,
    }


SCENARIOS = [
    happy_pull,
    overload_long_queue,
    accessor_crash_expiry,
    late_read,
    late_read_confirmed,
    push_mode,
    fixed_ttl_bidirectional,
    pinner_restart,
    hetero_tp_pinner_wider,
    hetero_tp_accessor_wider,
    release,
    heartbeat_batching,
    vllm_compat,
    rejections_and_misuse,
    retrack,
    wrong_rank,
    handshake_binding,
    ack_binding,
    failed_transfer,
    expiry_edges,
    bounds,
    mismatched_terms,
    posted_failed_push,
    multi_part_to_rank,
    ack_bound,
    lease_binding,
    verdict_binding,
    accessor_edges,
    retrack_edges,
    fixed_ttl_past_deadline,
    stated_terms,
    ack_extensions,
    rounds_bound,
    handshake_new_incarnation,
]


def render(vector: JSONDict) -> str:
    return json.dumps(vector, indent=1) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if a committed vector would change")
    ns = ap.parse_args()
    vectors = [s().vector() for s in SCENARIOS] + [codec_cases()]
    stale = []
    for v in vectors:
        path = HERE / f"{v['name']}.json"
        text = render(v)
        if ns.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
    if stale:
        print("out of date:", ", ".join(stale), file=sys.stderr)
        return 1
    print(f"{'checked' if ns.check else 'wrote'} {len(vectors)} vectors in {HERE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
