"""kvlease inside vLLM 0.33.0 (push mode, ``NixlPushConnector``): real vLLM schedulers, connectors
built by vLLM's factory, vLLM's CPU KV-cache allocation and model-runner mixin, vLLM's own push
writer thread, and NIXL WRITEs between two processes.

One pair for the module: P a kvlease push producer and D a kvlease push decoder. D registers its
destination blocks with P (vLLM's ``PUSH_REG``, carrying D's push-lease ticket); P's writer
WRITEs into them. P runs one sequence at a time, so a plain local request ("blocker") keeps a
prefill queued on P (P heartbeating D's push lease meanwhile) for as long as a scenario needs.
Only the model forward is faked: P writes a per-request pattern into the blocks it prefills and
D checks it in the blocks vLLM loaded for it. The scenarios run in order (P is SIGKILLed last).
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from _vllm_helpers import Node, nodes_up, require_vllm_env, settled_stats
from kvlease.adapters.vllm._transport import PRODUCER_KEY, producer_claim

from kvlease import FrameAuth

pytestmark = pytest.mark.slow

#: Short leases (heartbeat every D/6 = 1 s, each extending by 2D/3 = 4 s); not shorter, as a
#: loaded 2-core machine can stall a process for more than D/2 (see test_vllm_adapter.py).
D = 6.0
MAX_ACCESS = 1.0  # max_access_time: the push guard G = A * (1 + rho)
#: P and D share a deployment key (frames and push tickets sealed); both accept the stock P2's
#: unauthenticated ``HB:`` / ``id:count`` (a mixed fleet, stated as such).
KEY_ENV = "KVLEASE_TEST_PUSH_KEY"
EXTRA = {
    "kv_lease_duration": D,
    "max_access_time": MAX_ACCESS,
    "auth_keys": [f"env:{KEY_ENV}"],
    "auth_allow_vllm_compat": True,
}
RHO = 1e-4  # max_drift_rate (default)
G = MAX_ACCESS * (1 + RHO)
SLACK = 1.0  # scheduling slack of a step loop on a loaded 2-core machine
#: A stated floor (``kvlease_min_bandwidth``, bytes/s) at which the largest WRITE of these engines
#: (64 blocks of 2 layers x 16 KiB = 2 MiB) takes 2.1 s, more than MAX_ACCESS.
SLOW_FLOOR = 1e6


@pytest.fixture(scope="module")
def pair() -> Iterator[dict[str, Node]]:
    require_vllm_env()
    os.environ[KEY_ENV] = secrets.token_hex(32)  # inherited by every node
    specs: dict[str, dict[str, Any]] = {
        "P": dict(
            role="kv_producer",
            connector="kvlease-push",
            extra=EXTRA,
            max_num_seqs=1,
            bad_config={"kv_lease_duration": D, "max_access_time": -2},
            build=[{"extra": {**EXTRA, "kvlease_min_bandwidth": SLOW_FLOOR}}],
        ),
        "D": dict(
            role="kv_consumer",
            connector="kvlease-push",
            extra=EXTRA,
            bad_config={"kvlease_engine_tll": 5},
            build=[{"extra": {**EXTRA, "kvlease_min_bandwidth": SLOW_FLOOR}}, {"extra": EXTRA}],
        ),
        # a stock vLLM push producer (NixlPushConnector, unmodified): the mixed fleet
        "P2": dict(role="kv_producer", connector="stock-push", extra={"kv_lease_duration": int(D)}, max_num_seqs=1),
    }
    with nodes_up(specs, timeout=240) as nodes:
        yield nodes


def _register(p: Node, d: Node, rid: str, *, claim: dict[str, Any] | None = None) -> None:
    """D takes `rid` for decode with P's coordinates (as a push router does): D allocates the
    destination blocks and registers them with P. `claim`: what a kvlease producer's returned
    params add (`producer_claim`)."""
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "remote_engine_id": p.name,
        "remote_request_id": rid,
        "remote_host": "127.0.0.1",
        "remote_port": p.port,
        "tp_size": 1,
    }
    if claim is not None:
        params[PRODUCER_KEY] = claim
    d.send(op="decode", id=rid, params=params)
    d.wait("added", 30, id=rid)


def _block_p(p: Node, rid: str) -> None:
    p.send(op="local", id=f"{rid}-blocker", max_tokens=1_000_000)
    p.wait("scheduled", 30, id=f"{rid}-blocker")


def _unblock_p(p: Node, rid: str) -> None:
    p.send(op="abort", id=f"{rid}-blocker")


def _push(p: Node) -> dict[str, int]:
    return p.stats()["push"]  # type: ignore[no-any-return]


def test_push_connectors_come_from_vllms_factory(pair: dict[str, Node]) -> None:
    for name in ("P", "D"):
        ready = pair[name].wait("ready")
        assert ready["scheduler_impl"] == "KvleasePushScheduler"
        assert ready["worker_impl"] == "KvleasePushWorker"
    err = pair["P"].wait("bad_config")["error"]
    assert err is not None and "ConfigError" in err and "max_access_time" in err
    err = pair["D"].wait("bad_config")["error"]
    assert err is not None and "kvlease_engine_tll" in err
    assert pair["P2"].wait("ready")["worker_impl"] == "NixlPushConnectorWorker"


def test_push_refuses_to_start_when_the_access_bound_cannot_cover_the_largest_write(pair: dict[str, Node]) -> None:
    """Issue 21: a push WRITE must end within ``max_access_time`` of its start, or it may land
    after the decoder freed its blocks (the push guard covers only that long). Both roles refuse
    to start when the largest WRITE of the engine (max_model_len's blocks of its KV layout) at
    the stated floor outlasts it, naming both settings and the bound needed; with the default
    floor (1 GB/s: 2 ms) the same lease settings start."""
    for name in ("P", "D"):
        err = pair[name].wait("built", i=0)["error"]
        assert err is not None and err.startswith("ConfigError"), err
        assert "max_access_time" in err and "at least 2.097 s" in err and "kvlease_min_bandwidth" in err
    assert pair["D"].wait("built", i=1)["error"] is None


def test_push_writes_into_the_decoders_blocks_under_its_lease(pair: dict[str, Node]) -> None:
    """D registers w1; P's prefill of w1 waits 1.5 leases behind a blocker (P heartbeats D's push
    lease all along: D keeps the blocks past the initial lease), then P's writer WRITEs its
    blocks into D's: the contents match, D's lease ends completed (the access-done rode on the
    WRITE), and P frees its source blocks."""
    p, d = pair["P"], pair["D"]
    before = d.stats()["counters"]
    p_before = p.stats()
    _block_p(p, "w1")
    _register(p, d, "w1")
    p.send(op="prefill", id="w1")
    time.sleep(1.5 * D)
    assert not d.seen("recv_done", id="w1"), "D gave the blocks up while P was heartbeating"
    _unblock_p(p, "w1")
    done = d.wait("recv_done", 60, id="w1")
    assert done["failed"] is False and done["match"] is True
    freed = p.wait("freed", 30, id="w1")
    d.wait("finished", 30, id="w1")
    # P's source blocks were under a kvlease lease (renewed by D's HB:), freed on the push's
    # completion through finished_sending, not at the lease's expiry.
    p_after = p.stats()
    assert p_after["driver"]["leases_granted"] >= p_before["driver"]["leases_granted"] + 1
    assert p_after["counters"]["expired"] == p_before["counters"]["expired"], "P's source lease expired"
    assert p_after["counters"]["completed"] >= p_before["counters"]["completed"] + 1
    assert p_after["live"] == 0, "P's source lease outlived the push"
    assert freed["t"] - done["t"] < D / 2, "P's source blocks freed on the completion, not at expiry"
    after = d.stats()["counters"]
    assert after["completed"] == before["completed"] + 1
    assert after["expired"] == before["expired"]
    assert after["renewed"] >= before["renewed"] + 3, "P's heartbeats renewed D's push lease"
    # kvlease's counts on vLLM's Prometheus registry (KVConnectorStats), both ends (reported at
    # most every half second: the metrics trail a little)
    stats = settled_stats(
        p,
        lambda s: {
            "vllm:kvlease_push_writes_posted_total": s["push"]["push_writes_posted"],
            "vllm:kvlease_accesses_completed_total": s["driver"]["accesses_completed"],
        },
    )
    assert stats["writes_posted"].get("w1", 0) >= 1  # counted at P's NIXL agent
    assert stats["push"]["push_writes_posted"] >= 1 and stats["driver"]["accesses_completed"] >= 1
    settled_stats(d, lambda s: {"vllm:kvlease_leases_completed_total": s["driver"]["leases_completed"]})


def test_a_registration_altered_on_the_way_is_never_written(pair: dict[str, Node]) -> None:
    """Issue 21.3 (push): under a deployment key D's push ticket is sealed to the registration it
    rides in (D's engine and request id, the destination block ids, the producer). A party on
    the path without the key strips the tag (t1) or names other blocks under the genuine tag
    (t2): P tracks neither lease and WRITEs nothing (its prefill's blocks are freed at once);
    D, never heartbeated, fails the load at the lease's end and recomputes."""
    p, d = pair["P"], pair["D"]
    dropped0 = _push(p)["push_writes_dropped"]
    for rid, how in (("t1", "unsealed"), ("t2", "moved")):
        d.send(op="tamper_reg", id=rid, how=how)
        d.wait("tampering", 30, id=rid)
        _register(p, d, rid)
        p.send(op="prefill", id=rid)
    for rid in ("t1", "t2"):
        done = d.wait("recv_done", 4 * D, id=rid)
        assert done["failed"] is True and done["match"] is None
    stats = p.stats()
    assert "t1" not in stats["writes_posted"] and "t2" not in stats["writes_posted"]
    assert stats["push"]["push_writes_dropped"] == dropped0 + 2
    log = p.tail(400)
    assert "registration t1 carries a malformed push ticket" in log and "carries no tag" in log
    assert "registration t2 carries a malformed push ticket" in log and "matches no key and binding" in log


def test_write_not_covered_by_the_window_is_never_started(pair: dict[str, Node]) -> None:
    """D is frozen (SIGSTOP) while P's prefill of g1 waits: P's heartbeats go unanswered, its
    validity window runs out. P's prefill then finishes and vLLM's writer matches the
    registration, but the WRITE is not covered: it is never posted (P's counts), P frees its
    source blocks, and D, resumed, ends the push lease on expiry + G: a failed load, recomputed."""
    p, d = pair["P"], pair["D"]
    base = _push(p)
    _block_p(p, "g1")
    _register(p, d, "g1")
    p.send(op="prefill", id="g1")
    time.sleep(2 * D / 6)  # the lease is live (a few heartbeats)
    d.signal(signal.SIGSTOP)
    try:
        time.sleep(2 * D / 3 + SLACK)  # past the last acknowledged extension
        _unblock_p(p, "g1")
        p.wait("freed", 30, id="g1")  # the WRITE will not happen: P's source blocks go
    finally:
        d.signal(signal.SIGCONT)
    stats = p.stats()
    counts = stats["push"]
    assert "g1" not in stats["writes_posted"], "a WRITE was posted outside the validity window"
    stopped = ("push_writes_dropped", "push_writes_refused")
    assert sum(counts[k] for k in stopped) > sum(base[k] for k in stopped)
    done = d.wait("recv_done", 60, id="g1")
    assert done["failed"] is True and done["match"] is None
    again = d.wait("scheduled", 60, id="g1")
    assert again["num_computed_tokens"] == 0, "the prompt is recomputed locally"


def test_source_lease_expires_while_the_decoder_is_frozen(pair: dict[str, Node]) -> None:
    """D is frozen (SIGSTOP), so nothing renews P's source lease of e1 (prefilled on P, no
    registration reached it): P's pinner lease expires and vLLM frees the blocks within D (the
    initial lease) plus slack of the prefill's end, through kvlease's Free (not vLLM's reaper),
    with no WRITE from them posted."""
    p, d = pair["P"], pair["D"]
    before = p.stats()
    d.signal(signal.SIGSTOP)
    try:
        p.send(op="prefill", id="e1")
        fin = p.wait("finished", 30, id="e1")
        freed = p.wait("freed", D + 10 * SLACK, id="e1")
    finally:
        d.signal(signal.SIGCONT)
    after = p.stats()
    assert freed["t"] - fin["t"] <= D + SLACK, "freed past the source lease's bound"
    assert freed["t"] - fin["t"] >= D / 2, "freed before the source lease could expire"
    assert after["counters"]["expired"] == before["counters"]["expired"] + 1, "freed by the source lease's expiry"
    assert after["reqs_to_send"] == 0, "vLLM's own deadline holds no source blocks"
    assert "e1" not in after["writes_posted"], "a WRITE from freed source blocks"


def test_expired_source_lease_is_held_while_its_write_is_pending(pair: dict[str, Node]) -> None:
    """A test hook keeps P's posted WRITE of h1 reported pending (the data lands, D loads it and
    stops heartbeating): P's source lease expires, but its blocks are not freed while the WRITE
    is pending; released, the WRITE completes and the blocks are freed."""
    p, d = pair["P"], pair["D"]
    before = p.stats()["counters"]
    p.send(op="hold_write", id="h1")
    p.wait("hold_write", 30, id="h1")
    _register(p, d, "h1")
    p.send(op="prefill", id="h1")
    d.wait("recv_done", 60, id="h1")
    d.wait("finished", 30, id="h1")
    deadline = time.monotonic() + 3 * D
    while p.stats()["counters"]["expired"] == before["expired"]:
        assert time.monotonic() < deadline, "P's source lease never expired"
        time.sleep(0.5)
    time.sleep(1.0)
    assert not p.seen("freed", id="h1"), "P's source blocks freed while a WRITE from them was pending"
    p.send(op="release_write", id="h1")
    p.wait("freed", 30, id="h1")


def test_writer_stalled_past_the_window_does_not_post(pair: dict[str, Node]) -> None:
    """The writer-side guard: the WRITE of s1 is approved, then vLLM's writer thread stalls
    (3 s, longer than the access may take: max_access_time + one heartbeat interval) before
    posting it. The driver gives the access up meanwhile, the published validity drops to -inf,
    and the writer, checking ``now + A_l <= valid_until`` before posting, does not post it. D's
    push lease is not renewed any more (the accessor gave it up): it expires, D fails the load
    and recomputes."""
    p, d = pair["P"], pair["D"]
    base = _push(p)
    _register(p, d, "s1")
    time.sleep(D / 6)  # tracked and heartbeating
    p.send(op="stall_writer", id="s1", seconds=MAX_ACCESS + D / 6 + 1.0)
    p.wait("stalled", 30, id="s1")
    p.send(op="prefill", id="s1")
    p.wait("freed", 30, id="s1")  # P's source blocks: the WRITE will not happen
    counts = _push(p)
    assert "s1" not in p.stats()["writes_posted"], "the writer posted a WRITE its window no longer covered"
    assert counts["push_writes_refused"] == base["push_writes_refused"] + 1
    done = d.wait("recv_done", 4 * D, id="s1")
    assert done["failed"] is True and done["match"] is None
    assert d.wait("scheduled", 60, id="s1")["num_computed_tokens"] == 0


def test_producer_abort_releases_the_decoders_push_lease(pair: dict[str, Node]) -> None:
    """P aborts its prefill of a1 while it waits (D registered, P heartbeating): P releases D's
    push lease instead of heartbeating it for as long as it runs; D ends it without a WRITE (a
    failed load, recomputed) well before the lease could have run out on its own."""
    p, d = pair["P"], pair["D"]
    _block_p(p, "a1")
    _register(p, d, "a1")
    p.send(op="prefill", id="a1")
    time.sleep(D / 2)  # heartbeating
    t_abort = time.monotonic()
    p.send(op="abort", id="a1")
    done = d.wait("recv_done", 4 * D, id="a1")
    assert done["failed"] is True and done["match"] is None
    waited = done["t"] - t_abort
    print(f"push: D ends the lease {waited:.3f} s after P's abort (a lease ran out after D/2 + G = {D / 2 + G:.2f} s)")
    assert waited < D / 2 + G, "the release ended the lease, not its expiry"
    assert "a1" not in p.stats()["writes_posted"]
    assert d.wait("scheduled", 60, id="a1")["num_computed_tokens"] == 0
    _unblock_p(p, "a1")


def test_decoder_abort_releases_its_push_lease(pair: dict[str, Node]) -> None:
    """D aborts x1 while P's prefill of it waits (P heartbeating): D releases the push lease, so
    P's heartbeats stop renewing it and P learns it is gone; P never WRITEs x1 (its source
    blocks are freed once its prefill is done) and D gets the destination blocks back at the
    lease's expiry plus G, instead of holding them for as long as P's prefill waits."""
    p, d = pair["P"], pair["D"]
    _block_p(p, "x1")
    _register(p, d, "x1")
    p.send(op="prefill", id="x1")
    time.sleep(D / 3)  # heartbeating
    t_abort = time.monotonic()
    d.send(op="abort", id="x1")
    done = d.wait("recv_done", 4 * D, id="x1")
    assert done["failed"] is True
    waited = done["t"] - t_abort
    upper = 2 * D / 3 * (1 + RHO) / (1 - RHO) + G
    print(f"push: D gets an aborted request's blocks back {waited:.3f} s after the abort (bound {upper:.3f} s)")
    assert waited <= upper + SLACK
    _unblock_p(p, "x1")
    p.wait("freed", 30, id="x1")
    assert "x1" not in p.stats()["writes_posted"]


def test_kvlease_decoder_with_a_stock_push_producer(pair: dict[str, Node]) -> None:
    """A rolling upgrade: the kvlease decoder D and a stock vLLM push producer P2, which ignores
    the ticket in the registration and never heartbeats the push lease. m0, written at once:
    P2's ``"id:count"`` ends D's push lease through the compat codec. m1, whose prefill waits
    longer than the lease on P2: D does not give the blocks back at expiry (a stock producer
    may still WRITE them); it falls back to vLLM's own completion, says so once in its log, and
    the WRITE that comes later is decoded."""
    p2, d = pair["P2"], pair["D"]
    _register(p2, d, "m0")
    p2.send(op="prefill", id="m0")
    done = d.wait("recv_done", 60, id="m0")
    assert done["failed"] is False and done["match"] is True
    _block_p(p2, "m1")
    _register(p2, d, "m1")
    p2.send(op="prefill", id="m1")
    time.sleep(D + G + 2 * SLACK)  # D's push lease of m1 ran out (no heartbeat from P2)
    assert not d.seen("recv_done", id="m1"), "D gave up the blocks a stock producer may still WRITE"
    _unblock_p(p2, "m1")
    done = d.wait("recv_done", 60, id="m1")
    assert done["failed"] is False and done["match"] is True
    log = d.log_path.read_text(errors="replace")
    assert log.count("never answered the push lease") == 1, "the fallback is logged once per stock producer"


def test_a_producer_claiming_kvlease_is_never_taken_for_stock_vllm(pair: dict[str, Node]) -> None:
    """A kvlease producer's first lease message can come later than the lease: a loaded producer
    (seen in a real ``vllm serve`` push pair at a load average of 40, where the decoder then took
    the kvlease producer for stock vLLM and waited for a WRITE that never came). The params a
    kvlease producer returns claim, sealed under the deployment key to it and the request, that
    it runs kvlease: D then ends the expired push lease as a failed load (recomputed), as for any
    kvlease producer, instead of keeping the blocks for a stock WRITE. Here the claim names a
    producer D has not heard from in this process's lifetime of the lease (P2, blocked past the
    lease); the same claim moved to another request is not believed (tests/test_vllm_transport.py
    covers each way a claim fails)."""
    p2, d = pair["P2"], pair["D"]
    auth = FrameAuth([bytes.fromhex(os.environ[KEY_ENV])])
    _block_p(p2, "c1")
    _register(p2, d, "c1", claim=producer_claim(auth, p2.name, "c1"))
    p2.send(op="prefill", id="c1")
    done = d.wait("recv_done", D + G + 4 * SLACK + 10, id="c1")  # at expiry + G, not at P2's WRITE
    assert done["failed"] is True, "D waited for the producer's WRITE past the lease"
    again = d.wait("scheduled", 60, id="c1")
    assert again["num_computed_tokens"] == 0, "the prompt is recomputed locally"
    p2.send(op="abort", id="c1")  # P2's prefill, never written: D gave the blocks back
    _unblock_p(p2, "c1")
    # A claim that is not the producer's for this request counts for nothing (the stock fallback).
    _block_p(p2, "c2")
    _register(p2, d, "c2", claim=producer_claim(auth, p2.name, "c1"))
    p2.send(op="prefill", id="c2")
    time.sleep(D + G + 2 * SLACK)
    assert not d.seen("recv_done", id="c2"), "D gave up the blocks a stock producer may still WRITE"
    _unblock_p(p2, "c2")
    done = d.wait("recv_done", 60, id="c2")
    assert done["failed"] is False and done["match"] is True


def test_decoder_frees_a_dead_producers_destination_blocks_within_the_bound(pair: dict[str, Node]) -> None:
    """SIGKILL P while its prefill of k1 waits and heartbeats D: D frees k1's destination blocks
    (a failed load) once the last renewal plus the push guard ran out: a renewal extends to
    receipt + 2D/3 and one arrives every D/6, so between D/2 + G and 2D/3 + G (drift-adjusted)
    after the kill, up to scheduling slack."""
    p, d = pair["P"], pair["D"]
    _block_p(p, "k1")
    _register(p, d, "k1")
    p.send(op="prefill", id="k1")
    time.sleep(D + 0.5)  # a whole lease of renewals, then a kill half-way between two heartbeats
    assert not d.seen("recv_done", id="k1")
    t_kill = time.monotonic()
    p.signal(signal.SIGKILL)
    done = d.wait("recv_done", 4 * D, id="k1")
    assert done["failed"] is True
    delay = done["t"] - t_kill  # both CLOCK_MONOTONIC on this machine
    upper = 2 * D / 3 * (1 + RHO) / (1 - RHO) + G
    lower = D / 2 + G
    print(f"push: D frees after producer SIGKILL: {delay:.3f} s (bound [{lower:.3f}, {upper:.3f}] s + {SLACK} s slack)")
    assert lower - SLACK <= delay <= upper + SLACK
    again = d.wait("scheduled", 60, id="k1")
    assert again["num_computed_tokens"] == 0, "the prompt is recomputed locally"
