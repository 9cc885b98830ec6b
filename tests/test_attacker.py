"""An attacker process against real engines on loopback, over ZMQ and over NIXL.

Three real OS processes per test: a pinner engine "P" and an accessor engine "D"
(tests/_proc_helpers.py; 3 s lease: heartbeat every 0.5 s, each extending by 2 s) and an
attacker "X" (tests/_attacker.py) that knows the engine ids, both addresses and the id scheme
(lease ids count from 1; ``ranks=1`` makes the pinner expect one access-done) but not the key.
P grants 10 leases, D tracks them and heartbeats flow; then X attacks.

- With the deployment key on P and D, X's forged frames (unsealed, or sealed with a key of its
  own) are dropped before decoding, and authentic frames captured from another connection (a
  previous D session; replies addressed to it) are refused by the binding: nothing is freed,
  renewed, released or lost, and once D dies its captured heartbeats, replayed, keep nothing
  pinned past the protocol's bound.
- Without a key, binding alone refuses every forgery from an engine that is not the lease's
  accessor, or that is D under another session. Spoofing D's engine id *and* its session (which
  travels in clear) is what the key is for: the positive control shows that forgery freeing a
  lease when no key is configured.

Bounds are the protocol's plus a scheduling slack for a loaded 2-core machine; the figures are
printed (run with ``-s``).
"""

from __future__ import annotations

import contextlib
import random
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _proc_helpers import TEST_LEASE, Agent, spawn_pair

from kvlease import (
    PROTOCOL_VERSION,
    AccessDone,
    AccessDoneAck,
    AccessOutcome,
    FrameAuth,
    Handshake,
    HandshakeReply,
    Heartbeat,
    HeartbeatAck,
    LeaseConfig,
    LocalTime,
    Message,
    PeerTime,
    Release,
    decode,
    encode,
)

pytestmark = pytest.mark.slow

CFG = LeaseConfig(**TEST_LEASE)
EXT = CFG.lease_extension  # 2.0 s
IVL = CFG.heartbeat_interval  # 0.5 s
#: Scheduling slack on a loaded 2-core machine (as in test_zmq_processes).
SLACK = 0.75
N = 10
SIZE = 4096
#: Where P and D read the deployment key; the attacker's environment never has it.
KEY_VAR = "KVLEASE_ATTACK_TEST_KEY"
TRANSPORTS = ["zmq", "nixl"]


def _need(transport: str) -> None:
    pytest.importorskip("zmq")
    if transport == "nixl":
        pytest.importorskip("nixl._api", reason="NIXL is not installed (pip install kvlease[nixl])")
        pytest.importorskip("torch")


@contextlib.contextmanager
def _deployment(transport: str, key: str | None) -> Iterator[tuple[Agent, Agent, Agent]]:
    """P and D (with `key` when given; every frame they send is captured) and the attacker X."""
    _need(transport)
    lease: dict[str, Any] = dict(TEST_LEASE)
    env = None
    if key is not None:
        lease["auth_keys"] = [f"env:{KEY_VAR}"]
        env = {KEY_VAR: key}
    agents: list[Agent] = []
    try:
        p, d = spawn_pair(lease, tensor=transport == "nixl", transport=transport, capture=True, env=env)
        agents += [p, d]
        agents.append(Agent({"engine_id": "X", "transport": transport}, script="_attacker.py"))
        yield p, d, agents[2]
    finally:
        for a in reversed(agents):
            a.close()


def _stats(a: Agent) -> dict[str, Any]:
    stats: dict[str, Any] = a.request("stats", "stats")["stats"]
    return stats


def _wait_stats(a: Agent, pred: Callable[[dict[str, Any]], bool], what: str, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        s = _stats(a)
        if pred(s):
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"{a.name}: {what} not reached within {timeout} s; stats {s}")
        time.sleep(0.1)


def _about(key: str, *events: str) -> Callable[[dict[str, Any]], bool]:
    """A predicate on an agent's events: one of `events`, about `key` (bound now, not at call)."""
    return lambda e: e["ev"] in events and e.get("key") == key


def _hb_count(p: Agent) -> int:
    return max((e["count"] for e in p.find(lambda e: e["ev"] == "hb")), default=0)


def _grant_and_track(p: Agent, d: Agent, prefix: str, fill: int, n: int = N) -> dict[str, dict[str, Any]]:
    """`n` leases granted by P and tracked by D, once D's heartbeats have renewed (and so bound)
    every one of them: the attack starts against leases that belong to D."""
    grants: dict[str, dict[str, Any]] = {}
    for i in range(n):
        key = f"{prefix}-{i + 1}"
        g = grants[key] = p.request("grant", "ticket", key=key, size=SIZE, fill=fill + i)
        d.request("track", "tracked", key=key, ticket=g["ticket"], address=g["address"])
    seen = _hb_count(p)
    p.wait_for(lambda e: e["ev"] == "hb" and e["count"] >= seen + 2, 15.0)
    return grants


def _read_all(d: Agent, grants: dict[str, dict[str, Any]], fill: int) -> dict[str, float]:
    """Read every lease (each must be allowed and covered by validity); returns when each read
    was asked for (before it, nothing of it can have happened). Then every one completes with
    the pinner's bytes."""
    started: dict[str, float] = {}
    for key in grants:
        deadline = time.monotonic() + 10.0
        while True:
            asked = time.monotonic()
            r = d.request("read", "access", key=key, size=SIZE)
            if r["allowed"] or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert r["allowed"] and r["guaranteed"], r
        started[key] = asked
    names = ("AccessCompleted", "AccessStale", "LeaseLost", "TransferFailed")
    for i, key in enumerate(grants):
        out = d.wait_for(_about(key, *names), 15.0)
        assert out["ev"] == "AccessCompleted" and out["values"] == [fill + i], out
    return started


def _wire(a: Agent, auth: FrameAuth | None) -> list[tuple[float, bytes, Message]]:
    """What `a` sent so far, as captured on the wire: (time, bytes, message)."""
    out = []
    for e in a.find(lambda e: e["ev"] == "wire"):
        data = bytes.fromhex(e["data"])
        out.append((e["t"], data, decode(auth.open(data) if auth is not None else data)))
    return out


def _attack(x: Agent, op: str, **job: Any) -> None:
    r = x.request(op, "started", **job)
    assert r["ev"] == "started", r


def _done(x: Agent, name: str, timeout: float = 60.0) -> int:
    """How many frames job `name` sent (every one of them: none failed)."""
    ev = x.wait_for(lambda e: e["ev"] == "done" and e["name"] == name, timeout)
    assert ev["failed"] == 0, ev
    return int(ev["sent"])


def _assert_nothing_happened(p: Agent, d: Agent) -> None:
    assert p.find(lambda e: e["ev"] == "Free") == [], "P freed a lease during the attack"
    assert d.find(lambda e: e["ev"] in ("LeaseLost", "AccessStale", "TransferFailed")) == [], "D lost a lease"


def _handshake(x: Agent, wait: float) -> dict[str, Any]:
    hs = Handshake("X", 0, 1, random.getrandbits(64), PROTOCOL_VERSION, 7, 1, LocalTime(time.monotonic()))
    return x.request("handshake", "handshake_reply", timeout=wait + 30.0, to="P", data=encode(hs).hex(), wait=wait)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_without_the_key_nothing_is_freed_renewed_released_or_dropped(transport: str) -> None:
    key = secrets.token_hex(16)
    auth = FrameAuth([bytes.fromhex(key)])  # the test plays the operator: it can seal captures
    t_start = time.monotonic()
    with _deployment(transport, key) as (p, d, x):
        grants = _grant_and_track(p, d, "kv", fill=0x10)
        ids = [int(g["ticket"]["lease_id"]) for g in grants.values()]
        inc = int(grants["kv-1"]["ticket"]["incarnation"])
        s_d = d.ready["session"]
        assert ids == list(range(1, N + 1))  # the id scheme the attacker knows
        x.request("connect", "connected", timeout=60.0, targets={"P": p.address, "D": d.address})

        # The side-channel handshake discloses nothing: P drops it unanswered.
        assert _handshake(x, wait=2.0)["data"] is None

        # Forgeries. The incarnation and D's session travel in clear inside sealed frames, so X
        # is given the real ones (and a guessed session too).
        guess = random.getrandbits(64)
        common = {
            "sessions": [s_d, guess],
            "ids": ids,
            "seals": ["none", "wrong"],
            "incarnation": inc,
            "rounds": 3,
            "interval": 0.3,
        }
        _attack(
            x,
            "forge",
            name="forge-P",
            to="P",
            kinds=["access_done", "release", "heartbeat"],
            engines=["D", "Z"],
            **common,
        )
        _attack(
            x,
            "forge",
            name="forge-D",
            to="D",
            kinds=["heartbeat_ack", "handshake_reply", "access_done_ack"],
            pinner="P",
            seqs=list(range(1, 6)),
            **common,
        )

        # Replays of authentic frames from another connection: what a previous D process
        # (session s0) sent for these leases, and P's replies addressed to it; plus P's own
        # captured replies to D on this connection (stale by now).
        s0 = random.getrandbits(64)
        t0 = time.monotonic() - 100.0
        seqs = (1, 2, 3, 1 << 40)
        to_p: list[Message] = [AccessDone("D", 0, 1, s0, inc, 0, i, 7 + i, i % 2 == 0, LocalTime(t0)) for i in ids]
        to_p.append(Release("D", 0, 1, s0, inc, tuple(ids)))
        to_p += [Heartbeat("D", 0, 1, s0, inc, q, LocalTime(t0 + q % 97), tuple(ids)) for q in seqs]
        to_d: list[Message] = [
            HeartbeatAck("P", 0, inc, 0, s0, q, LocalTime(t0 + q), PeerTime(t0 + q), 86400.0, 0, expired=tuple(ids))
            for q in seqs[:3]
        ]
        to_d.append(
            HandshakeReply(
                "P",
                0,
                1,
                random.getrandbits(63),
                PROTOCOL_VERSION,
                7,
                1024,
                86400.0,
                0.0,
                1e-3,
                0,
                s0,
                1,
                LocalTime(t0),
                PeerTime(t0),
                PeerTime(t0),
            )
        )
        to_d += [AccessDoneAck("P", 0, inc, 0, s0, i, 7 + i, AccessOutcome.STALE) for i in ids]
        p_replies = [data.hex() for _, data, _ in _wire(p, auth)]
        assert p_replies, "P sent D nothing to capture"
        rounds = 2
        _attack(
            x,
            "replay",
            name="replay-P",
            to="P",
            frames=[auth.seal(encode(m)).hex() for m in to_p],
            rounds=rounds,
            interval=0.3,
        )
        _attack(
            x,
            "replay",
            name="replay-D",
            to="D",
            frames=[auth.seal(encode(m)).hex() for m in to_d] + p_replies,
            rounds=rounds,
            interval=0.3,
        )

        forged_p, forged_d = _done(x, "forge-P"), _done(x, "forge-D")
        replayed_p, replayed_d = _done(x, "replay-P"), _done(x, "replay-D")
        # Every forged frame (and the handshake) reached P's and D's drivers and was dropped
        # unopened; every replay was opened and refused by the core: P refuses each access-done,
        # each id of the release, each heartbeat (held for D's session), and D each reply to s0,
        # including those P reflected to it (acks of the replayed heartbeats and of the
        # access-dones that asked for confirmation).
        want_p = rounds * (N + N + len(seqs))
        want_d = rounds * (3 + 1 + N + len(seqs) + N // 2)
        sp = _wait_stats(
            p, lambda s: s["unauthenticated_messages"] > forged_p and s["rejected_messages"] >= want_p, "P's drops"
        )
        sd = _wait_stats(
            d, lambda s: s["unauthenticated_messages"] >= forged_d and s["rejected_messages"] >= want_d, "D's drops"
        )
        time.sleep(0.5)
        sp, sd = _stats(p), _stats(d)
        print(
            f"\n[{transport}] keyed: X sent {forged_p} forged frames + 1 handshake to P, {forged_d} to D, "
            f"{replayed_p} + {replayed_d} replays; P dropped {sp['unauthenticated_messages']} unauthenticated, "
            f"rejected {sp['rejected_messages']}; D dropped {sd['unauthenticated_messages']}, rejected "
            f"{sd['rejected_messages']}"
        )
        assert sp["unauthenticated_messages"] == forged_p + 1 and sp["rejected_messages"] == want_p, sp
        assert sd["unauthenticated_messages"] == forged_d and sd["rejected_messages"] == want_d, sd
        assert sp["malformed_messages"] == sd["malformed_messages"] == 0
        _assert_nothing_happened(p, d)

        # D still holds validity for every lease: each read is guaranteed and gets P's bytes; P
        # frees each only once D's read of it began, by access-done.
        started = _read_all(d, grants, fill=0x10)
        for k, t in started.items():
            free = p.wait_for(_about(k, "Free"), 10.0)
            assert free["reason"] == "access_done" and free["t"] >= t, (free, t)

        # D dies. X keeps replaying D's captured frames (its real sealed heartbeats and
        # access-dones, and heartbeats of D's session with seqs it already used) and sending
        # forged heartbeats: P frees every lease within extension + interval of D's death.
        granted = time.monotonic()
        hold = _grant_and_track(p, d, "hold", fill=0x40)
        # Past the initial grant (duration > extension), so only heartbeats set the expiry.
        time.sleep(max(0.0, granted + CFG.kv_lease_duration - EXT + 0.2 - time.monotonic()))
        hold_ids = [int(g["ticket"]["lease_id"]) for g in hold.values()]
        captured = _wire(d, auth)
        old = [Heartbeat("D", 0, 1, s_d, inc, q, LocalTime(time.monotonic()), tuple(hold_ids)) for q in range(1, 6)]
        frames = [data.hex() for _, data, _ in captured] + [auth.seal(encode(m)).hex() for m in old]
        hb_per_round = sum(isinstance(m, Heartbeat) for _, _, m in captured) + len(old)
        duration = EXT + IVL + SLACK + 2.0
        rounds = int(duration / 0.2) + 1
        before = _stats(p)
        _attack(x, "replay", name="replay-dead", to="P", frames=frames, rounds=rounds, interval=0.2)
        _attack(
            x,
            "forge",
            name="forge-dead",
            to="P",
            kinds=["heartbeat"],
            engines=["D"],
            sessions=[s_d],
            ids=hold_ids,
            seals=["none", "wrong"],
            incarnation=inc,
            rounds=rounds,
            interval=0.2,
        )
        killed = d.kill()
        d.proc.wait(10.0)
        hb_at_death = max((e["count"] for e in p.find(lambda e: e["ev"] == "hb" and e["t"] <= killed)), default=0)
        last_hb = max(t for t, _, m in _wire(d, auth) if isinstance(m, Heartbeat))
        bound = EXT + IVL + SLACK
        delays = []
        for k in hold:
            free = p.wait_for(_about(k, "Free"), bound + 10.0)
            assert free["reason"] == "expired", free
            delays.append((free["t"] - killed, free["t"] - last_hb))
        after = _stats(p)
        hb_after_death = _hb_count(p) - hb_at_death
        worst = max(a for a, _ in delays)
        print(
            f"[{transport}] D SIGKILLed under replay: {N} leases freed {min(a for a, _ in delays):.3f}.."
            f"{worst:.3f} s after its death ({min(b for _, b in delays):.3f}..{max(b for _, b in delays):.3f} s "
            f"after its last heartbeat was sent); bound extension + interval + slack = {bound:.3f} s; P opened "
            f"{hb_after_death} replayed heartbeats after D's death and dropped "
            f"{after['unauthenticated_messages'] - before['unauthenticated_messages']} forged frames meanwhile "
            f"({len(frames)} frames replayed per round); {time.monotonic() - t_start:.1f} s in all"
        )
        assert worst <= bound
        # The replays were authentic and reached the core (counted as heartbeats) after D's
        # death, rounds of them, yet renewed nothing; the forgeries were dropped.
        assert hb_after_death >= 2 * hb_per_round
        assert after["unauthenticated_messages"] > before["unauthenticated_messages"]
        x.send(op="stop", name="replay-dead")
        x.send(op="stop", name="forge-dead")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_without_a_key_binding_refuses_every_forgery_from_another_accessor(transport: str) -> None:
    t_start = time.monotonic()
    with _deployment(transport, None) as (p, d, x):
        grants = _grant_and_track(p, d, "kv", fill=0x10)
        ids = [int(g["ticket"]["lease_id"]) for g in grants.values()]
        inc = int(grants["kv-1"]["ticket"]["incarnation"])
        s_d = d.ready["session"]
        x.request("connect", "connected", timeout=60.0, targets={"P": p.address, "D": d.address})
        # Without a key the handshake is answered: X learns P's incarnation from the reply.
        assert _handshake(x, wait=10.0)["incarnation"] == inc

        # Forgeries under an engine P never saw ("Z") and under "D" with sessions other than
        # D's. (Spoofing D's engine id *and* session is what the key is for; see the control.)
        sessions = [random.getrandbits(64), random.getrandbits(64)]
        assert s_d not in sessions
        rounds = 3
        _attack(
            x,
            "forge",
            name="forge-P",
            to="P",
            kinds=["access_done", "release", "heartbeat"],
            engines=["Z", "D"],
            sessions=sessions,
            ids=ids,
            seals=["none"],
            incarnation="learned",
            rounds=rounds,
            interval=0.3,
        )
        sent = _done(x, "forge-P")
        # P refuses each access-done, each id of each release and each heartbeat; it answers
        # those under "D" that ask for it (5 confirmed access-dones and the heartbeat per round
        # and session) to D, which refuses them: they name another session.
        per = N + N + 1
        want_p = rounds * 2 * len(sessions) * per
        want_d = rounds * len(sessions) * (N // 2 + 1)
        assert sent == rounds * 2 * len(sessions) * (N + 2)  # N access-dones, a release, a heartbeat
        sp = _wait_stats(p, lambda s: s["rejected_messages"] >= want_p, "P's rejections")
        sd = _wait_stats(d, lambda s: s["rejected_messages"] >= want_d, "D's rejections")
        time.sleep(0.5)
        sp, sd = _stats(p), _stats(d)
        print(
            f"\n[{transport}] no key: X learned the incarnation, sent {sent} forged frames; P rejected "
            f"{sp['rejected_messages']} (want {want_p}), D rejected {sd['rejected_messages']} reflected acks"
        )
        assert sp["rejected_messages"] == want_p and sd["rejected_messages"] == want_d, (sp, sd)
        assert sp["unauthenticated_messages"] == sp["malformed_messages"] == 0
        _assert_nothing_happened(p, d)
        started = _read_all(d, grants, fill=0x10)
        for k, t in started.items():
            free = p.wait_for(_about(k, "Free"), 10.0)
            assert free["reason"] == "access_done" and free["t"] >= t, (free, t)

        # Control: with D's own engine id and session (visible on the wire), the same forgery
        # frees a lease D never read, when no key is configured. The keyed test sends exactly
        # this forgery too, and there it is dropped.
        ctl = _grant_and_track(p, d, "ctl", fill=0x70, n=1)
        ctl_id = int(ctl["ctl-1"]["ticket"]["lease_id"])
        _attack(
            x,
            "forge",
            name="control",
            to="P",
            kinds=["access_done"],
            engines=["D"],
            sessions=[s_d],
            ids=[ctl_id],
            seals=["none"],
            incarnation="learned",
            rounds=1,
        )
        _done(x, "control")
        free = p.wait_for(lambda e: e["ev"] == "Free" and e["key"] == "ctl-1", 10.0)
        assert free["reason"] == "access_done"
        lost = d.wait_for(lambda e: e["ev"] == "LeaseLost" and e["key"] == "ctl-1", 10.0)
        print(
            f"[{transport}] control (D's engine id and session spoofed, no key): P freed the unread lease, "
            f"D reported it lost ({lost['reason']}); {time.monotonic() - t_start:.1f} s in all"
        )
