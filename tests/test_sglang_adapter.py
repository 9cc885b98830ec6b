"""The SGLang 0.5.23 plugin, end to end: SGLang's own NIXL manager/sender/receiver and bootstrap
server in real processes (``.venv-sglang``), CPU pages moved over NIXL UCX, the plugin loaded
through SGLang's ``load_plugins()``.

Three processes for the whole module (imports cost ~10-20 s each): prefill P1 and decode D run
the transfer, write-gate, abort and prefill-crash scenarios; prefill P2 (started at the same time)
then serves D for the hostile-traffic, memory-wait and decode-crash scenarios. The tests run in
file order and share those processes.

Lease timing (set through the adapter's environment variables): d = 4 s, so I = d/6 ≈ 0.667 s,
E = 2d/3 ≈ 2.667 s, E_a ≈ 2.616 s; A = 1.5 s, so A_l = G ≈ 1.5 s.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _sglang_helpers import ROOT, Rank, need_sglang
from ports import free_port

pytestmark = pytest.mark.slow

D_LEASE = 4.0
A = 1.5
RHO = 1e-4
I = D_LEASE / 6  # noqa: E741 - the spec's name
E = (D_LEASE * 2) / 3
G = A * (1 + RHO)
#: Scheduling slack on a loaded 2-core machine (the pump's step, process wake-ups, the poll loops).
SLACK = 1.5

ENV = {
    "SGLANG_PLUGINS": "kvlease",
    "SGLANG_KVLEASE_LEASE_DURATION": str(D_LEASE),
    "SGLANG_KVLEASE_MAX_ACCESS_TIME": str(A),
    # SGLang's fixed timeouts, shorter than the waits below: the leases replace them (a prefill
    # slower than this keeps the decode's pages, a decode waiting for memory keeps the
    # prefill's). SGLang's own liveness probe of the prefill (HTTP to its bootstrap server) stays
    # at its default (>= 10 s), so it cannot be what fails a room here.
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "3",
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "3",
    # A deployment key on every rank: frames and tickets sealed (issue 23, hole 3).
    "SGLANG_KVLEASE_AUTH_KEYS": "env:KVLEASE_TEST_KEY",
    "KVLEASE_TEST_KEY": "5e" * 32,
}


class Cluster:
    def __init__(self, tmp: Path) -> None:
        self.port1 = free_port()
        self.port2 = free_port()
        # P1 as SGLang runs it with --enable-metrics: prometheus_client in multiprocess mode,
        # the files SGLang's /metrics reads (MultiProcessCollector) in this directory.
        self.prom_dir = tmp / "prom-p1"
        self.prom_dir.mkdir()
        self.p1 = Rank("prefill", self.port1, {**ENV, "PROMETHEUS_MULTIPROC_DIR": str(self.prom_dir)}, tmp / "p1.log")
        self.d = Rank("decode", self.port1, ENV, tmp / "d.log")
        # P2 loads a second plugin beside kvlease, the host-memory shim (the project's own, as a
        # CPU deployment runs it): SGLang's VRAM registration is left to it, so P2 starts only if
        # the two plugins' classes compose.
        shim = ROOT / "engines" / "sglang" / "shims" / "dram_plugin"
        p2_env = {
            **ENV,
            "SGLANG_PLUGINS": "kvlease,cpu_dram_kv",
            "KVLEASE_TEST_KV_MEM_KIND": "VRAM",
            "PYTHONPATH": os.pathsep.join(x for x in (str(shim), os.environ.get("PYTHONPATH", "")) if x),
        }
        self.p2 = Rank("prefill", self.port2, p2_env, tmp / "p2.log")
        self.ranks = [self.p1, self.d, self.p2]
        for r in self.ranks:
            r.wait_ready()
        # The decode's first contact with each prefill (HTTP to its bootstrap server), as a
        # decode does before its first request from it; not part of any timed scenario.
        self.d.call("connect", prefill_port=self.port1)
        self.d.call("connect", prefill_port=self.port2)

    def close(self) -> None:
        for r in self.ranks:
            r.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    need_sglang()
    c = Cluster(tmp_path_factory.mktemp("sglang"))
    try:
        yield c
    finally:
        c.close()


def bootstrap(c: Cluster, p: Rank, port: int, room: int, src: list[int], dst: list[int], aux: tuple[int, int]) -> None:
    """D admits the request (its receiver asks P for the source ticket), P creates its sender
    (granting the source lease and answering the early ask), D sends its metadata (granting the
    destination lease); P reaches WaitingForInput."""
    c.d.call("receiver", room=room, prefill_port=port)
    p.call("sender", room=room, pages=len(src), aux=aux[0])
    c.d.call("metadata", room=room, pages=dst, aux=aux[1])
    st = p.call("wait", room=room, statuses=["WaitingForInput", "Failed"], within=20)
    assert st["status"] == "WaitingForInput", st


def wait_validity(p: Rank, room: int, at_least: float) -> dict[str, float]:
    """Until every destination lease of `room` on P has `at_least` seconds of validity."""
    deadline = time.time() + 20
    while True:
        left: dict[str, float | None] = p.call("validity", room=room)["left"]  # key -> seconds, or None
        valid = {k: v for k, v in left.items() if v is not None and v >= at_least}
        if left and len(valid) == len(left):
            return valid
        assert time.time() < deadline, f"no validity on P for room {room}: {left}"
        time.sleep(0.05)


# -- 1. the plugin ----------------------------------------------------------------------------


def test_plugin_loads_through_load_plugins(cluster: Cluster) -> None:
    # Beside another plugin's AROUND hook on get_kv_class: both classes apply, whichever is inside.
    assert {"LeaseManagerMixin", "DramNixlKVManager", "NixlKVManager"} <= set(cluster.p2.hello["mro"])
    assert "cpu_dram_kv: NIXL KV buffers registered as DRAM" in cluster.p2.tail(100000)
    for r in (cluster.p1, cluster.d):
        assert r.hello["manager"] == "LeaseNixlKVManager"
        # The module-level get_kv_class copies SGLang's prefill and decode queues call.
        assert r.hello["classes"] == {
            "prefill_manager": "LeaseNixlKVManager",
            "prefill_sender": "LeaseNixlKVSender",
            "decode_manager": "LeaseNixlKVManager",
            "decode_receiver": "LeaseNixlKVReceiver",
        }


def test_sglang_plugins_selects_the_entry_point(cluster: Cluster) -> None:
    # SGLang's own discovery over the installed entry points: SGLANG_PLUGINS is a whitelist.
    assert cluster.d.call("discover", allow="kvlease")["plugins"] == {"kvlease": "kvlease.adapters.sglang:register"}
    assert cluster.d.call("discover", allow="some_other_plugin")["plugins"] == {}


def test_decode_refuses_release_settings_that_undercut_the_lease(cluster: Cluster) -> None:
    ok = cluster.d.call("check_release_settings", env={})
    assert ok["error"] is None, ok
    off = cluster.d.call("check_release_settings", env={"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": "0"})
    assert "ConfigError" in off["error"] and "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE" in off["error"]
    short = cluster.d.call(
        "check_release_settings", env={"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": str(E)}
    )
    assert "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT" in short["error"], short


# -- 2. destination-page lease: the normal transfer -------------------------------------------


def test_normal_transfer_byte_exact_and_leases_end(cluster: Cluster) -> None:
    c, room = cluster, 101
    src, dst = [3, 4, 5, 6], [8, 9, 10, 11]
    bootstrap(c, c.p1, c.port1, room, src, dst, aux=(1, 2))
    wait_validity(c.p1, room, A)
    # A prefill slower than the lease duration and than SGLang's waiting timeout (a long queue,
    # a long forward) keeps the destination pages: its heartbeats renew them. D polls its
    # receiver meanwhile, as SGLang's decode loop does (the timeout is checked in poll()).
    st = c.d.call("wait", room=room, statuses=["Failed", "Success"], within=D_LEASE + 0.5)
    assert st["status"] == "WaitingForInput", st
    c.p1.call("send", room=room, pages=src)
    assert c.p1.call("wait", room=room, statuses=["Success", "Failed"], within=20)["status"] == "Success"
    got = c.d.call("wait", room=room, statuses=["Success", "Failed"], within=20)
    assert got["status"] == "Success", got
    pages = c.d.call("pages", pages=list(range(32)), aux=2)
    want = c.p1.call("expected", pages=src)["pages"]
    for s, d in zip(src, dst, strict=True):
        assert pages["pages"][str(d)] == want[str(s)]  # every byte of every layer: one value, the source's
    for p in set(range(32)) - set(dst):
        assert pages["pages"][str(p)] == [[1], [1]], f"page {p} outside the set was touched"
    assert pages["aux"] == [201]  # P's aux slot 1
    # The access-done rode on the WRITE: D's lease ended (no expiry wait), and D's Release
    # ended P's source lease.
    assert c.d.call("wait_release_safe", room=room, within=2)["safe"]
    deadline = time.time() + 5
    while c.p1.call("source_live", room=room)["live"]:
        assert time.time() < deadline, "P's source lease was not released by D"
        time.sleep(0.05)
    ds, ps = c.d.call("stats"), c.p1.call("stats")
    assert ds["stats"]["leases_completed"] >= 1 and ds["stats"]["leases_expired"] == 0
    assert ps["stats"]["accesses_completed"] >= 1
    assert ps["stats"]["heartbeat_acks_received"] >= 1 and ds["stats"]["heartbeat_acks_received"] >= 1
    c.p1.call("clear", room=room)
    c.d.call("clear", room=room)


# -- 3. a WRITE the validity window does not cover is never started ----------------------------


def test_uncovered_write_is_never_started(cluster: Cluster) -> None:
    c, room = cluster, 102
    src, dst = [1, 2], [20, 21]
    bootstrap(c, c.p1, c.port1, room, src, dst, aux=(2, 3))
    wait_validity(c.p1, room, A)
    posts_before = len(c.p1.call("posts")["posts"])
    # D freezes: P's heartbeats go unanswered, so its window stops growing; once less than A_l
    # is left, no WRITE may start. (E_a ≈ 2.62 s after the last acknowledged send; 1.2 s into
    # the freeze at most 2.62 - 1.2 < A_l = 1.5 s are left.)
    c.d.proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(1.2)
        left = c.p1.call("validity", room=room)["left"]
        assert all(v is None or v < G for v in left.values()), left
        c.p1.call("send", room=room, pages=src)
        st = c.p1.call("wait", room=room, statuses=["Success", "Failed"], within=10)
    finally:
        c.d.proc.send_signal(signal.SIGCONT)
    assert st["status"] == "Failed", st
    assert "kvlease: WRITE not started" in (st["failure"] or ""), st
    assert len(c.p1.call("posts")["posts"]) == posts_before, "a NIXL WRITE was posted"
    assert c.p1.call("stats")["writes_refused"] >= 1
    # Through SGLang's own failure path: D hears KV_STATUS Failed, its pages were never written.
    got = c.d.call("wait", room=room, statuses=["Failed", "Success"], within=10)
    assert got["status"] == "Failed", got
    pages = c.d.call("pages", pages=dst)["pages"]
    assert all(pages[str(p)] == [[1], [1]] for p in dst), pages
    # P released its destination lease (no write in flight) when it cleared the room, so D
    # may reuse the pages without waiting for the expiry.
    c.p1.call("clear", room=room)
    assert c.d.call("wait_release_safe", room=room, within=E + G + SLACK)["safe"]
    c.d.call("clear", room=room)


# -- 4. abort while writing: a late WRITE never lands in reused pages ---------------------------


def test_abort_while_writing_never_lands_in_reused_pages(cluster: Cluster) -> None:
    c, room = cluster, 103
    src, dst = [10, 11, 12], [24, 25, 26]
    bootstrap(c, c.p1, c.port1, room, src, dst, aux=(3, 4))
    wait_validity(c.p1, room, A + 0.5)
    # A straggler: P's worker has begun the access (the push guard allowed it) but its WRITE is
    # posted 0.8 s late, within the access-time bound A.
    c.p1.call("slow_post", seconds=0.8)
    try:
        c.p1.call("send", room=room, pages=src)
        time.sleep(0.15)
        t_abort = c.d.call("abort", room=room)["t"]  # D aborts the request mid-write
        # D reuses the pages the moment SGLang's deferred release would: when the lease says so.
        freed = c.d.call("wait_release_safe", room=room, within=E + G + SLACK + 2)
        assert freed["safe"], "D's destination lease never ended"
        c.d.call("canary", pages=dst, value=77)
        # Until the straggler has posted its WRITE (it was allowed to start: it will land).
        deadline = time.time() + 10
        posts = c.p1.call("posts")["posts"]
        while not (posts and posts[-1] > t_abort) and time.time() < deadline:
            time.sleep(0.05)
            posts = c.p1.call("posts")["posts"]
        c.p1.call("wait", room=room, statuses=["Success", "Failed"], within=10)
    finally:
        c.p1.call("slow_post", seconds=0.0)
    assert posts and posts[-1] > t_abort, "the WRITE was meant to be posted after the abort"
    time.sleep(0.3)  # it has landed by now (a few pages over loopback)
    pages = c.d.call("pages", pages=dst)["pages"]
    assert all(pages[str(p)] == [[77], [77]] for p in dst), f"the canary was overwritten: {pages}"
    assert freed["t"] > posts[-1], "D freed its pages before the late WRITE was even posted"
    st = c.d.call("wait", room=room, statuses=["Failed"], within=5)
    assert st["status"] == "Failed", st
    c.p1.call("clear", room=room)
    c.d.call("clear", room=room)


# -- 4b. issue 23: every WRITE under the gate, every release after the last WRITE can land ------


def wait_posted_after(p: Rank, t: float, within: float = 10.0) -> list[float]:
    """P's post times, once one is later than `t` (the straggler has been posted)."""
    deadline = time.time() + within
    posts: list[float] = p.call("posts")["posts"]
    while not (posts and posts[-1] > t) and time.time() < deadline:
        time.sleep(0.05)
        posts = p.call("posts")["posts"]
    assert posts and posts[-1] > t, "the straggling WRITE was never posted"
    return posts


def test_abort_during_a_non_final_chunk_waits_for_its_write(cluster: Cluster) -> None:
    # Hole 1: a non-final chunk's WRITE is an access the core approved and hears the end of, so
    # P's untrack (the inflight queue's failure_exception() -> clear()) cannot free D's pages
    # while that WRITE may still land.
    c, room = cluster, 110
    src, dst = [10, 11, 12, 13], [14, 15, 16, 17]
    bootstrap(c, c.p1, c.port1, room, src, dst, aux=(1, 1))
    wait_validity(c.p1, room, A + 0.5)
    c.p1.call("slow_post", seconds=0.8, count=1)
    try:
        c.p1.call("send", room=room, pages=src[:2])  # a non-final chunk, its WRITE posted 0.8 s late
        time.sleep(0.15)
        t_abort = c.d.call("abort", room=room)["t"]
        assert c.p1.call("wait", room=room, statuses=["Failed"], within=5)["status"] == "Failed"
        c.p1.call("clear", room=room)  # what SGLang's prefill does with a Failed room
        freed = c.d.call("wait_release_safe", room=room, within=E + G + SLACK + 2)
        assert freed["safe"], "D's destination lease never ended"
        c.d.call("canary", pages=dst[:2], value=78)
        posts = wait_posted_after(c.p1, t_abort)
    finally:
        c.p1.call("slow_post", seconds=0.0)
    time.sleep(0.3)  # a late WRITE has landed by now
    pages = c.d.call("pages", pages=dst[:2])["pages"]
    assert all(pages[str(p)] == [[78], [78]] for p in dst[:2]), f"a non-final chunk's WRITE hit reused pages: {pages}"
    assert freed["t"] > posts[-1], "D freed its pages before the chunk's WRITE was even posted"
    print(f"\nabort during a non-final chunk: D freed {freed['t'] - posts[-1]:.3f}s after its late WRITE was posted")
    c.d.call("clear", room=room)


@pytest.mark.parametrize("last", [False, True], ids=["non-final-chunk", "final-chunk"])
def test_a_post_error_holds_the_pages_to_expiry_plus_guard(cluster: Cluster, last: bool) -> None:
    # Hole 2: SGLang poisons the room's ABORT_ACK when a post raised (its WRITE may still land).
    # The lease is given up as *posted*: D keeps the pages to expiry + G, never less.
    c, room = cluster, 111 + int(last)
    src, dst, d_aux = [4, 5, 6, 7], [18, 19, 20, 21], 2
    bootstrap(c, c.p1, c.port1, room, src, dst, aux=(2, d_aux))
    v = wait_validity(c.p1, room, A)
    window_end = time.time() + min(v.values())  # P's window reaches at least this far
    # Final chunk: its KV WRITE is posted, its aux WRITE's post raises (and is posted 0.8 s
    # later); non-final chunk: its one KV WRITE's post raises (and is posted 0.8 s later).
    c.p1.call("fail_post", after=1 if last else 0, late=0.8)
    t_send = c.p1.call("send", room=room, pages=src if last else src[:2])["t"]
    st = c.p1.call("wait", room=room, statuses=["Failed", "Success"], within=10)
    assert st["status"] == "Failed", st
    assert c.p1.call("poisoned", room=room)["poisoned"], "a real post error must poison SGLang's drain ACK"
    c.p1.call("clear", room=room)
    assert c.d.call("wait", room=room, statuses=["Failed", "Success"], within=10)["status"] == "Failed"
    freed = c.d.call("wait_release_safe", room=room, within=E + G + SLACK + 2)
    assert freed["safe"], "D's destination lease never ended"
    c.d.call("canary", pages=dst, value=79, aux=d_aux)
    posts = wait_posted_after(c.p1, t_send + 0.5)
    time.sleep(0.3)
    got = c.d.call("pages", pages=dst, aux=d_aux)
    assert all(got["pages"][str(p)] == [[79], [79]] for p in dst) and got["aux"] == [79], (
        f"the WRITE whose post raised landed in reused memory: {got}"
    )
    assert freed["t"] > posts[-1], "D freed before the WRITE whose post raised was posted"
    assert freed["t"] >= window_end + G - 0.05, f"D freed {window_end + G - freed['t']:.3f}s before expiry + G"
    print(f"\npost error ({'final' if last else 'non-final'} chunk): D freed {freed['t'] - t_send:.3f}s after the send")
    c.d.call("clear", room=room)


def test_a_relabelled_ticket_moves_no_lease(cluster: Cluster) -> None:
    # Hole 3: under a deployment key, room 121's ticket relabelled as room 120 (the genuine
    # ones delayed behind it) must not become the lease that guards room 120's pages.
    c, r20, r21 = cluster, 120, 121
    c.d.call("hold_tickets", rooms=[r20, r21])
    try:
        bootstrap(c, c.p1, c.port1, r21, [3, 4], [24, 25], aux=(3, 3))
        bootstrap(c, c.p1, c.port1, r20, [1, 2], [22, 23], aux=(4, 4))
        c.d.call("forge_ticket", from_room=r21, as_room=r20)
        time.sleep(0.3)
    finally:
        c.d.call("release_tickets", rooms=[r20, r21])
    wait_validity(c.p1, r20, A)
    c.p1.call("send", room=r20, pages=[1, 2])
    assert c.p1.call("wait", room=r20, statuses=["Success", "Failed"], within=20)["status"] == "Success"
    assert c.d.call("wait", room=r20, statuses=["Success", "Failed"], within=20)["status"] == "Success"
    # Room 120's WRITE ran under room 120's lease: its access-done ended that one, no other.
    assert c.d.call("wait_release_safe", room=r20, within=1.0)["safe"], "room 120's WRITE ran under another lease"
    assert not c.d.call("release_safe", room=r21)["safe"], "room 121's pages were freed by room 120's WRITE"
    assert c.p1.call("stats")["tickets_refused"] >= 1, "the relabelled ticket was not refused"
    wait_validity(c.p1, r21, A)  # room 121's genuine ticket was tracked after all
    c.p1.call("send", room=r21, pages=[3, 4])
    assert c.d.call("wait", room=r21, statuses=["Success", "Failed"], within=20)["status"] == "Success"
    pages = c.d.call("pages", pages=[22, 23, 24, 25])["pages"]
    want = c.p1.call("expected", pages=[1, 2, 3, 4])["pages"]
    assert [pages[str(d)] for d in (22, 23, 24, 25)] == [want[str(s)] for s in (1, 2, 3, 4)]
    for room in (r20, r21):
        c.p1.call("clear", room=room)
        c.d.call("clear", room=room)


def test_a_write_slower_than_any_timeout_keeps_the_pages(cluster: Cluster) -> None:
    # Hole 4: SGLang awaits its WRITEs without a bound and the plugin cannot cancel them, so no
    # timeout of the plugin's may give the lease up: D keeps the pages until the WRITE landed.
    c, room = cluster, 122
    src, dst = [8, 9], [26, 27]
    bootstrap(c, c.p1, c.port1, room, src, dst, aux=(5, 5))
    wait_validity(c.p1, room, A)
    slow = 8.0  # past the driver's default transfer timeout (A_l + I) plus expiry + G after it
    c.p1.call("slow_post", seconds=slow, count=1)
    try:
        t0 = c.p1.call("send", room=room, pages=src)["t"]
        time.sleep(max(0.0, t0 + slow - 1.0 - time.time()))
        assert not c.d.call("release_safe", room=room)["safe"], "D's pages were freed while P's WRITE was running"
        st = c.p1.call("wait", room=room, statuses=["Success", "Failed"], within=10)
    finally:
        c.p1.call("slow_post", seconds=0.0)
    assert st["status"] == "Success", st
    assert c.d.call("wait", room=room, statuses=["Success", "Failed"], within=10)["status"] == "Success"
    pages = c.d.call("pages", pages=dst)["pages"]
    want = c.p1.call("expected", pages=src)["pages"]
    assert [pages[str(d)] for d in dst] == [want[str(s)] for s in src]
    assert "ran past" in c.p1.tail(20000), "P did not warn that a WRITE outlasted the access-time bound"
    c.p1.call("clear", room=room)
    c.d.call("clear", room=room)


def test_an_abort_while_a_write_outlasts_the_lease_waits_for_its_drain(cluster: Cluster) -> None:
    # D aborts while P's WRITE runs longer than the lease has left plus the push guard (a WRITE
    # past the access bound A: SGLang awaits it without a bound). D's release ends the lease at
    # its expiry + G with no word from P, which is alive and still writing: the pages must wait
    # for SGLang's own drain ACK, which P sends once the WRITE settled. Before, they went back at
    # expiry + G and the late WRITE overwrote whatever reused them.
    c, room = cluster, 127
    src, dst = [2, 3], [8, 9]
    bootstrap(c, c.p1, c.port1, room, src, dst, aux=(6, 6))
    wait_validity(c.p1, room, A)
    slow = E + G + 3.0
    c.p1.call("slow_post", seconds=slow, count=1)
    try:
        c.p1.call("send", room=room, pages=src)
        time.sleep(0.15)
        t_abort = c.d.call("abort", room=room)["t"]
        c.d.call("clear", room=room)  # as SGLang's decode does at once, holding the pages after
        freed = c.d.call("wait_release_safe", room=room, within=slow + SLACK + 5)
        assert freed["safe"], "D's pages never came back (SGLang's drain ACK never counted)"
        c.d.call("canary", pages=dst, value=80)
        posts = wait_posted_after(c.p1, t_abort)
    finally:
        c.p1.call("slow_post", seconds=0.0)
    time.sleep(0.3)  # the late WRITE has landed by now
    pages = c.d.call("pages", pages=dst)["pages"]
    assert all(pages[str(p)] == [[80], [80]] for p in dst), f"the long WRITE landed in reused pages: {pages}"
    assert freed["t"] > posts[-1], f"D freed {posts[-1] - freed['t']:.3f}s before the long WRITE was even posted"
    after = freed["t"] - t_abort
    print(f"\nabort during a {slow:.1f}s WRITE: D freed {after:.3f}s after the abort (expiry + G is {E + G:.1f}s)")
    c.p1.call("wait", room=room, statuses=["Success", "Failed"], within=10)
    c.p1.call("clear", room=room)


def test_a_room_waiting_for_its_lease_does_not_stall_the_worker(cluster: Cluster) -> None:
    # Hole 5: one transfer worker serves many rooms; a room whose lease is not here yet must not
    # hold the rooms queued behind it (it used to sleep in the worker for up to I).
    c, stalled, fast = cluster, 123, 124
    c.d.call("hold_tickets", rooms=[stalled])
    try:
        bootstrap(c, c.p1, c.port1, stalled, [0, 1], [28, 29], aux=(6, 6))
        bootstrap(c, c.p1, c.port1, fast, [2, 3], [30, 31], aux=(7, 7))
        wait_validity(c.p1, fast, A)
        c.p1.call("send", room=stalled, pages=[0, 1])  # first in the (one) worker's queue
        t = c.p1.call("send", room=fast, pages=[2, 3])["t"]
        st = c.p1.call("wait", room=fast, statuses=["Success", "Failed"], within=10)
        assert st["status"] == "Success", st
        waited = st["t"] - t
        assert waited < I / 2, f"the room behind a stalled one waited {waited:.3f}s (I = {I:.3f}s)"
        print(f"\nthe room behind a stalled one: sent to Success in {waited:.3f}s (I = {I:.3f}s)")
        # The stalled room never got its lease: refused after a heartbeat interval, nothing posted.
        st = c.p1.call("wait", room=stalled, statuses=["Success", "Failed"], within=I + SLACK + 2)
        assert st["status"] == "Failed" and "kvlease: WRITE not started" in (st["failure"] or ""), st
    finally:
        c.d.call("release_tickets", rooms=[stalled])
    for room in (stalled, fast):
        c.p1.call("clear", room=room)
        c.d.call("clear", room=room)


def test_a_stalled_room_costs_the_rooms_behind_it_one_check_each(cluster: Cluster) -> None:
    # Counts, over SGLang's own FastQueue: room 900 (two chunks, first in the queue) has no lease
    # yet; the four rooms behind it are served at once, each after at most one look at room 900;
    # room 900's chunks follow, in their order, once its lease is there.
    chunks = [[900, 0], [900, 1], [901, 0], [902, 0], [903, 0], [904, 0]]
    ready = [901, 902, 903, 904]
    got = cluster.p2.call("queue_drill", chunks=chunks, ready=ready, patience=30.0, take=6, ready_at=4, ready_room=900)
    assert got["can_defer"]
    taken = got["taken"]
    assert [(t["room"], t["idx"]) for t in taken] == [(901, 0), (902, 0), (903, 0), (904, 0), (900, 0), (900, 1)]
    for t in taken[:4]:
        assert t["checks"].get("900", 0) <= 1, t
        assert t["s"] < 0.1, t
    # Never ready: handed over after `patience` (the write gate then refuses it), still in order.
    got = cluster.p2.call("queue_drill", chunks=chunks[:3], ready=[901], patience=0.3, take=3)
    taken = got["taken"]
    assert [(t["room"], t["idx"]) for t in taken] == [(901, 0), (900, 0), (900, 1)]
    assert 0.25 <= taken[1]["s"] <= 0.3 + SLACK and taken[2]["s"] < 0.05, taken


def test_every_write_is_gated_not_only_a_chunks_first(cluster: Cluster) -> None:
    # Hole 5: the window is checked before every WRITE of a chunk (S2 is per access), not once
    # per chunk: a WRITE posted after the window lapsed mid-chunk is refused.
    c, room = cluster, 126
    src, dst = [6, 7], [12, 13]
    bootstrap(c, c.p1, c.port1, room, src, dst, aux=(1, 2))
    wait_validity(c.p1, room, A)
    n_posts = len(c.p1.call("posts")["posts"])
    c.p1.call("pause_before", method="send_aux", seconds=1.5)  # the chunk's second WRITE comes late
    c.d.proc.send_signal(signal.SIGSTOP)  # ... and D answers no heartbeat meanwhile
    try:
        c.p1.call("send", room=room, pages=src)
        time.sleep(1.7)
    finally:
        c.d.proc.send_signal(signal.SIGCONT)
    st = c.p1.call("wait", room=room, statuses=["Success", "Failed"], within=10)
    assert st["status"] == "Failed" and "kvlease: WRITE not started" in (st["failure"] or ""), st
    assert len(c.p1.call("posts")["posts"]) == n_posts + 1, "the chunk's late WRITE was posted outside the window"
    # The refused WRITE was never posted: SGLang's drain ACK stays true, so it is not poisoned
    # (a decode waiting for it would otherwise sit out SGLang's 30 s deferred-release timeout).
    assert not c.p1.call("poisoned", room=room)["poisoned"], "the gate's own refusal poisoned the drain ACK"
    c.p1.call("clear", room=room)
    assert c.d.call("wait", room=room, statuses=["Failed", "Success"], within=10)["status"] == "Failed"
    c.d.call("clear", room=room)


def test_a_client_abort_with_no_write_in_flight_ends_the_lease_at_once(cluster: Cluster) -> None:
    c, room = cluster, 125
    bootstrap(c, c.p1, c.port1, room, [5, 6], [12, 13], aux=(1, 2))
    wait_validity(c.p1, room, A)
    t = c.d.call("abort", room=room)["t"]
    freed = c.d.call("wait_release_safe", room=room, within=E + G + SLACK)
    assert freed["safe"]
    assert freed["t"] - t < 0.5, (
        f"the lease of an aborted room no WRITE was running for ended {freed['t'] - t:.2f}s later"
    )
    print(
        f"\nD's destination lease of an aborted room, no WRITE in flight, ended {freed['t'] - t:.3f}s after the abort"
    )
    assert c.p1.call("wait", room=room, statuses=["Failed"], within=5)["status"] == "Failed"
    c.p1.call("clear", room=room)
    c.d.call("clear", room=room)


def test_the_plugin_reports_itself_in_sglangs_logs_and_metrics(cluster: Cluster) -> None:
    # At INFO, through SGLang's logging (its root handler and format), on every rank.
    for r in (cluster.p1, cluster.d):
        log = r.tail(200000)
        line = (
            r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (prefill|decode)\] kvlease: (prefill|decode) rank sglang:\S+ leases on"
        )
        assert re.search(line, log, re.M), log[-2000:]
    # Where SGLang serves /metrics (--enable-metrics: prometheus_client's multiprocess files,
    # read by MultiProcessCollector in the HTTP server process).
    text = cluster.p1.call("multiproc_metrics", path=str(cluster.prom_dir))["text"]
    assert "kvlease_sglang_writes_refused_total" in text and "kvlease_sglang_accesses_total" in text, text[-2000:]


def test_the_docs_state_stock_sglangs_defaults(cluster: Cluster) -> None:
    # docs/sglang.md section 4, row by row, against SGLang 0.5.23's own environ.py.
    docs = (ROOT / "docs" / "sglang.md").read_text()
    table = docs.split("## 4. Stock SGLang 0.5.23's defaults", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `(SGLANG_\w+)` \| ([^|]+?) \|", table, re.M))
    assert len(rows) == 6, rows
    got = cluster.d.call("sglang_defaults", names=sorted(rows))["defaults"]
    shown = {"True": "1 (on)", "False": "0 (off)"}
    for name, value in got.items():
        assert rows[name] == shown.get(value, value), (name, rows[name], value)
    assert "**on by default** in 0.5.23" in " ".join(docs.split())
    section = " ".join((ROOT / "engines" / "sglang" / "README-section.md").read_text().split())
    assert "default off" not in section
    assert "`SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE`) is on by default in 0.5.23" in section


def test_the_get_kv_class_hook_composes_with_another_plugins_class(cluster: Cluster) -> None:
    got = cluster.p1.call("compose")["classes"]
    for kind, info in got.items():
        assert info["is_other"], f"{kind}: the other plugin's class was discarded ({info['mro']})"
        assert info["leased"], f"{kind}: not lease-enabled ({info['mro']})"


# -- 5. P SIGKILLed while D waits: D frees within the lease bound -------------------------------


def test_prefill_killed_decode_frees_within_bound(cluster: Cluster) -> None:
    c, room = cluster, 104
    src, dst = [0, 1, 2, 3], [28, 29, 30, 31]
    t_grant = time.time()  # D grants at send_metadata, inside bootstrap()
    bootstrap(c, c.p1, c.port1, room, src, dst, aux=(4, 5))
    wait_validity(c.p1, room, A)  # promised: D may only free at expiry + G
    # A renewable lease expires at max(grant + d, last renewal + E) (spec, Claim 3). Kill P once
    # renewals decide it, so the bound is the heartbeat one: E + I + G after the death.
    time.sleep(max(0.0, t_grant + (D_LEASE - E) + I - time.time()))
    v = c.p1.call("validity", room=room)
    window_end = v["t"] + min(v["left"].values())  # P may start a WRITE until then
    t_kill = c.p1.kill()
    freed = c.d.call("wait_release_safe", room=room, within=60)
    st = c.d.call("wait", room=room, statuses=["Failed", "Success"], within=5)
    elapsed = freed["t"] - t_kill
    # Claim 3 (push): at most E + I + G after the death (+ delivery and timer slack). And never
    # before P's last validity window plus the guard: a WRITE P started in time may still land.
    assert freed["safe"], "D never freed the dead prefill's destination pages"
    assert freed["t"] >= window_end + G - 0.05, f"freed {window_end + G - freed['t']:.3f}s too early"
    assert elapsed <= E + I + G + SLACK, f"freed {elapsed:.3f}s after SIGKILL"
    assert st["status"] == "Failed", st
    # The first lease to go fails the room: this destination lease's expiry, or D's hold on P's
    # source lease lapsing (both are the dead prefill); the pages came back by the expiry.
    assert (st["failure"] or "").startswith("kvlease: "), st
    assert c.d.call("stats")["stats"]["leases_expired"] >= 1
    print(f"\nD freed the dead prefill's pages {elapsed:.3f}s after SIGKILL (bound E+I+G = {E + I + G:.3f}s)")
    c.d.call("clear", room=room)


# -- 6. hostile traffic on SGLang's sockets -----------------------------------------------------


def test_hostile_messages_crash_no_sglang_thread(cluster: Cluster) -> None:
    c = cluster
    junk = [
        [b"NOT_A_TAG".hex()],
        [b"KVLEASE".hex()],
        [b"KVLEASE".hex(), b"F".hex(), b"x".hex(), b"0".hex(), b"1.2.3.4:5".hex(), os.urandom(64).hex()],
        [b"KVLEASE".hex(), b"T".hex(), b"x".hex(), b"0".hex(), b"127.0.0.1:1".hex(), b"\xc1garbage".hex()],
        [b"KVLEASE".hex(), b"H".hex(), b"\xff\xfe".hex(), b"-1".hex(), b"".hex(), b"".hex()],
        [b"KVLEASE".hex(), b"R".hex(), b"nobody".hex(), b"0".hex(), b"127.0.0.1:1".hex(), b"x".hex()],
        [b"KVLEASE".hex(), b"Q".hex(), b"x".hex(), b"0".hex(), b"127.0.0.1:1".hex(), b"not-a-room".hex()],
        [b"NixlMsgGuard".hex(), b"garbage".hex()],
    ]
    p2_port = c.p2.hello["rank_port"]
    d_port = c.d.hello["rank_port"]
    c.d.call("inject", port=p2_port, messages=junk)
    c.d.call("inject", port=d_port, messages=junk)
    deadline = time.time() + 15
    while c.p2.call("stats")["dropped"] < 6 or c.d.call("stats")["dropped"] < 5:
        assert time.time() < deadline, (c.p2.call("stats")["dropped"], c.d.call("stats")["dropped"])
        time.sleep(0.1)
    # SGLang's bootstrap thread (P2) and listener thread (D) still serve: a transfer works.
    room, src, dst = 106, [5, 6], [12, 13]
    bootstrap(c, c.p2, c.port2, room, src, dst, aux=(5, 6))
    wait_validity(c.p2, room, A)
    c.p2.call("send", room=room, pages=src)
    assert c.p2.call("wait", room=room, statuses=["Success", "Failed"], within=20)["status"] == "Success"
    assert c.d.call("wait", room=room, statuses=["Success", "Failed"], within=20)["status"] == "Success"
    pages = c.d.call("pages", pages=dst)["pages"]
    want = c.p2.call("expected", pages=src)["pages"]
    assert [pages[str(d)] for d in dst] == [want[str(s)] for s in src]
    metrics = c.p2.call("metrics")["text"]
    assert "kvlease_leases_granted_total" in metrics and "kvlease_sglang_writes_refused_total" in metrics
    c.p2.call("clear", room=room)
    c.d.call("clear", room=room)


# -- 7. source-page lease: D waits for memory, then dies ----------------------------------------


def test_decode_memory_wait_keeps_source_then_decode_killed_prefill_frees(cluster: Cluster) -> None:
    c, room, orphan = cluster, 105, 107
    t_orphan = time.time()
    c.p2.call("sender", room=orphan, pages=2, aux=7)  # a request no decode ever admits
    c.d.call("receiver", room=room, prefill_port=c.port2)  # admitted; no metadata: short of memory
    c.p2.call("sender", room=room, pages=2, aux=6)
    # The orphan's lease is never renewed: it fails at grant + d, not at SGLang's 300 s.
    st = c.p2.call("wait", room=orphan, statuses=["Failed"], within=D_LEASE + SLACK + 2)
    assert st["status"] == "Failed" and "kvlease: source-page lease expired" in (st["failure"] or ""), st
    assert D_LEASE - 0.05 <= st["t"] - t_orphan <= D_LEASE + SLACK, st["t"] - t_orphan
    # Longer than the initial lease d and SGLang's bootstrap timeout: only D's renewals keep
    # P2's source lease (and its room).
    time.sleep(max(0.0, t_orphan + D_LEASE + 1.0 - time.time()))
    assert c.p2.call("source_live", room=room)["live"], "a D short of memory lost P's pages"
    st = c.p2.call("wait", room=room, statuses=["Failed"], within=0)
    assert st["status"] == "Bootstrapping", st
    v = c.d.call("validity", room=room, prefix="s:")
    assert v["left"] and all(x is not None for x in v["left"].values()), v
    window_end = v["t"] + min(v["left"].values())  # D holds P's pages at least until then
    t_kill = c.d.kill()
    st = c.p2.call("wait", room=room, statuses=["Failed"], within=60)
    elapsed = st["t"] - t_kill
    assert st["status"] == "Failed", st
    assert "kvlease: source-page lease expired" in (st["failure"] or ""), st
    # Claim 3 (not push): at most E + I after the death (+ slack); never before D's window ends.
    assert st["t"] >= window_end - 0.05, f"P failed the room {window_end - st['t']:.3f}s too early"
    assert elapsed <= E + I + SLACK, f"P freed {elapsed:.3f}s after D's SIGKILL"
    assert not c.p2.call("source_live", room=room)["live"]
    print(f"\nP freed the dead decode's source pages {elapsed:.3f}s after SIGKILL (bound E+I = {E + I:.3f}s)")
