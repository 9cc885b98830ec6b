"""Heterogeneous tensor parallelism over real processes and real ZMQ sockets.

Every worker is its own OS process (tests/_proc_helpers.py: a `Driver` over a `ZmqTransport`
with its own address), as every TP worker of an engine is. Two layouts:

- pinner TP 2, accessor TP 1: the accessor worker reads from both pinner workers; its
  heartbeats fan out to both; the access completes only when both READs landed, and each
  pinner worker then frees its lease exactly once, on the access-done.
- pinner TP 1, accessor TP 2: the pinner worker hears from both accessor workers and frees
  only when both reported their access done.

Killing the accessor frees the lease on every pinner worker within extension + interval of the
last heartbeat that worker heard. Lease: 3 s (heartbeat 0.5 s, extension 2 s).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
from _proc_helpers import TEST_LEASE, Agent

from kvlease import LeaseConfig

pytest.importorskip("zmq")

pytestmark = pytest.mark.slow

CFG = LeaseConfig(**TEST_LEASE)
EXT = CFG.lease_extension
IVL = CFG.heartbeat_interval
SLACK = 0.75  # scheduling on a loaded 2-core machine (a step is ~2 ms when idle)
SIZE = 32 * 1024
#: Long enough for a READ held up by a paused pinner worker (the default is access time +
#: one interval, 0.7 s here, which a loaded machine could overrun).
D_DRIVER = {"transfer_timeout": 3.0}


def _engine(engine_id: str, role: str, ranks: int, **extra: Any) -> list[Agent]:
    """The `ranks` workers of one engine, each a process with its own transport address."""
    incarnation = random.getrandbits(63)  # one engine: one incarnation on every worker
    workers: list[Agent] = []
    try:
        for rank in range(ranks):
            workers.append(
                Agent(
                    {
                        "engine_id": engine_id,
                        "role": role,
                        "rank": rank,
                        "ranks": ranks,
                        "incarnation": incarnation,
                        "lease": TEST_LEASE,
                        **extra,
                    }
                )
            )
        if role == "pinner":
            # Rank 0 tells accessors where every worker listens (its handshake reply).
            workers[0].request("workers", "workers", addresses=[w.address for w in workers])
    except BaseException:
        for w in workers:
            w.close()
        raise
    return workers


def _grant_everywhere(pinners: list[Agent], key: str, lease_id: int) -> dict[str, Any]:
    """One lease id on every pinner worker (a scheduler fanning a grant out); each worker's
    memory holds its own shard (fill = 0x10 + rank)."""
    grants = [
        p.request("grant", "ticket", key=key, size=SIZE, fill=0x10 + r, lease_id=lease_id)
        for r, p in enumerate(pinners)
    ]
    assert grants[0]["ticket"]["ranks"] == len(pinners)
    return grants[0]


def _hb_count(a: Agent) -> int:
    return max((e["count"] for e in a.find(lambda e: e["ev"] == "hb")), default=0)


def _frees(a: Agent, key: str) -> list[dict[str, Any]]:
    return a.find(lambda e: e["ev"] == "Free" and e["key"] == key)


@pytest.fixture
def p2_d1() -> Iterator[tuple[list[Agent], Agent]]:
    pinners = _engine("P", "pinner", 2)
    try:
        d = _engine("D", "accessor", 1, driver=D_DRIVER)[0]
    except BaseException:
        for p in pinners:
            p.close()
        raise
    try:
        yield pinners, d
    finally:
        for a in (*pinners, d):
            a.close()


def test_pinner_tp2_heartbeats_fan_out_and_each_worker_frees_once_on_its_access_done(
    p2_d1: tuple[list[Agent], Agent],
) -> None:
    pinners, d = p2_d1
    grant = _grant_everywhere(pinners, "k", lease_id=41)
    d.request("track", "tracked", key="k", ticket=grant["ticket"], address=grant["address"])
    # Heartbeats reach every pinner worker (one batched heartbeat per interval, fanned out).
    for p in pinners:
        p.wait_for(lambda e: e["ev"] == "hb" and e["count"] >= 2, 10)
    # Hold worker 1 still, so the READ from it cannot finish while the one from worker 0 does.
    pinners[1].send(op="pause", rid="hold", seconds=0.6)
    pinners[1].wait_for(lambda e: e["ev"] == "paused", 5)
    r = d.request("read", "access", key="k", size=SIZE, parts=[0, 1])
    assert r["allowed"] and r["guaranteed"], r
    resumed = pinners[1].wait_for(lambda e: e["ev"] == "resumed", 5)
    done = d.wait_for(lambda e: e["ev"] in ("AccessCompleted", "AccessStale", "TransferFailed"), 10)
    free0 = pinners[0].wait_for(lambda e: e["ev"] == "Free" and e["key"] == "k", 5)
    free1 = pinners[1].wait_for(lambda e: e["ev"] == "Free" and e["key"] == "k", 5)
    print(
        f"\nP TP2 / D TP1: the access completed {done['t'] - resumed['t']:.3f} s after worker 1 resumed; "
        f"workers freed {free0['t'] - resumed['t']:.3f} / {free1['t'] - resumed['t']:.3f} s after it"
    )
    assert done["ev"] == "AccessCompleted", done
    # Complete only once both READs landed: after worker 1 resumed, with both shards.
    assert done["t"] >= resumed["t"]
    assert done["values"] == [0x10, 0x11]
    assert free0["reason"] == free1["reason"] == "access_done"
    # Each worker lets go once *its* part landed: the access-done rides on each part's
    # transfer. Worker 1's part could only land after it resumed; worker 0 may free earlier,
    # and its "completed" answer to a heartbeat meanwhile must not turn our access stale.
    assert free1["t"] >= resumed["t"]
    assert free0["t"] <= free1["t"] + 0.5
    # Nothing more: exactly one free per worker, and the accessor forgot the lease.
    pinners[0].request("stats", "stats")
    pinners[1].request("stats", "stats")
    d.request("stats", "stats")
    assert len(_frees(pinners[0], "k")) == 1 and len(_frees(pinners[1], "k")) == 1
    assert not d.find(lambda e: e["ev"] in ("LeaseLost", "AccessStale"))


def test_pinner_tp2_accessor_killed_frees_on_every_worker_within_the_bound(
    p2_d1: tuple[list[Agent], Agent],
) -> None:
    pinners, d = p2_d1
    grant = _grant_everywhere(pinners, "dead", lease_id=7)
    d.request("track", "tracked", key="dead", ticket=grant["ticket"], address=grant["address"])
    for p in pinners:
        p.wait_for(lambda e: e["ev"] == "hb" and e["count"] >= 3, 10)
    killed = d.kill()
    for rank, p in enumerate(pinners):
        free = p.wait_for(lambda e: e["ev"] == "Free" and e["key"] == "dead", EXT + IVL + 10)
        last_hb = max(e["t"] for e in p.find(lambda e: e["ev"] == "hb" and e["t"] <= killed + 0.05))
        delay = free["t"] - last_hb
        print(
            f"\naccessor SIGKILL: pinner worker {rank} freed {delay:.3f} s after the last heartbeat it heard "
            f"(bound extension + interval + slack = {EXT + IVL + SLACK:.3f} s)"
        )
        assert free["reason"] == "expired"
        assert EXT - 0.05 <= delay <= EXT + IVL + SLACK
    for p in pinners:
        p.request("stats", "stats")  # let any second free show up before counting
        assert len(_frees(p, "dead")) == 1


def test_accessor_tp2_frees_only_when_every_accessor_worker_reported() -> None:
    p = _engine("P", "pinner", 1)[0]
    ds: list[Agent] = []
    try:
        ds = _engine("D", "accessor", 2, driver=D_DRIVER)
        grant = _grant_everywhere([p], "k2", lease_id=5)
        for d in ds:
            d.request("track", "tracked", key="k2", ticket=grant["ticket"], address=grant["address"])
        # One pinner worker hears (and renews for) both accessor workers.
        p.wait_for(lambda e: e["ev"] == "hb" and e["count"] >= 4, 10)
        first = ds[0].request("read", "access", key="k2", size=SIZE)
        assert first["allowed"], first
        done0 = ds[0].wait_for(lambda e: e["ev"] in ("AccessCompleted", "AccessStale", "TransferFailed"), 10)
        assert done0["ev"] == "AccessCompleted" and done0["values"] == [0x10], done0
        # Worker 0's access-done has arrived (a heartbeat after it is answered) but one of two
        # expected ranks is not enough: the memory stays pinned.
        n = _hb_count(p)
        p.wait_for(lambda e: e["ev"] == "hb" and e["count"] >= n + 2, 10)
        assert _frees(p, "k2") == []
        second = ds[1].request("read", "access", key="k2", size=SIZE)
        assert second["allowed"], second
        done1 = ds[1].wait_for(lambda e: e["ev"] in ("AccessCompleted", "AccessStale", "TransferFailed"), 10)
        assert done1["ev"] == "AccessCompleted" and done1["values"] == [0x10], done1
        free = p.wait_for(lambda e: e["ev"] == "Free" and e["key"] == "k2", 5)
        print(f"\nP TP1 / D TP2: freed {free['t'] - done1['t']:.3f} s after the second worker's access completed")
        assert free["reason"] == "access_done"
        assert free["t"] >= second["t"]
        p.request("stats", "stats")
        assert len(_frees(p, "k2")) == 1
        for d in ds:
            assert not d.find(lambda e: e["ev"] in ("LeaseLost", "AccessStale"))
    finally:
        for a in (p, *ds):
            a.close()


# -- the same over vLLM: producer TP 2, decoder TP 1 (tests/_vllm_node.py, a worker process per
# TP rank, vLLM's own TP mapping, handshake and READs, NIXL between the processes) --------------

#: vLLM's lease settings here: a 6 s lease (heartbeat every 1 s, extension 4 s). The decoder's
#: access-time bound (5 s) is longer than its validity window (~3.95 s), so no READ is ever
#: covered by the window alone: every READ asks each producer rank it maps to for confirmation
#: (the path on which a rank that never hears its access-done makes the READ stale).
VLLM_LEASE = 6.0
VLLM_SLACK = 1.0  # scheduling slack of a step loop on a loaded 2-core machine


@pytest.fixture(scope="module")
def tp2() -> Iterator[dict[str, Any]]:
    """A kvlease producer at TP 2 (one KV head per rank) and a kvlease decoder at TP 1 (both
    heads): the decoder reads each producer rank's head, and the lease maps it to both ranks."""
    from _vllm_helpers import nodes_up, require_vllm_env

    require_vllm_env()
    specs: dict[str, dict[str, Any]] = {
        "PT": dict(role="kv_producer", connector="kvlease", extra={"kv_lease_duration": VLLM_LEASE}, tp=2),
        "DT": dict(
            role="kv_consumer",
            connector="kvlease",
            extra={"kv_lease_duration": VLLM_LEASE, "max_access_time": 5.0},
            max_num_seqs=1,
        ),
    }
    with nodes_up(specs, timeout=300) as nodes:
        yield nodes


def _rank_counters(node: Any) -> list[dict[str, int]]:
    return [r["counters"] for r in node.stats()["ranks"]]


def test_vllm_tp2_producer_tp1_decoder_each_rank_confirms_and_frees_on_its_access_done(tp2: dict[str, Any]) -> None:
    """Heterogeneous TP inside vLLM: the TP-1 decoder READs one KV head from each of the TP-2
    producer's ranks (vLLM's TP mapping, one READ per rank, in one access). The READ is never
    covered by the validity window alone here, so it needs every mapped rank's confirmation:
    each rank answers its own part's access-done, the load completes with both heads, and both
    ranks free on the access-done at once (vLLM reports the request freed when every rank has),
    none at expiry. (Where vLLM's mapping reads fewer ranks than the lease maps — its GQA dedup
    and MLA's replicas — the unread ranks get their access-done when the READ is posted.)"""
    p, d = tp2["PT"], tp2["DT"]
    before = _rank_counters(p)
    assert len(before) == 2
    p.send(op="prefill", id="h1")
    params = p.wait("finished", 60, id="h1")["params"]
    assert params["kvlease"]["ranks"] == 2 and params["tp_size"] == 2
    d.send(op="decode", id="h1", params=params)
    done = d.wait("recv_done", 90, id="h1")
    assert done["failed"] is False and done["match"] is True, "the READ failed or was reported stale"
    freed = p.wait("freed", 30, id="h1")
    print(f"\nP TP2 / D TP1: both producer ranks freed {freed['t'] - done['t']:.3f} s after the load")
    assert freed["t"] - done["t"] <= VLLM_SLACK, "a producer rank held its blocks to expiry"
    after = _rank_counters(p)
    for rank in (0, 1):
        assert after[rank]["completed"] == before[rank]["completed"] + 1, f"rank {rank} did not free on access-done"
        assert after[rank]["expired"] == before[rank]["expired"]
    drv = d.stats()["driver"]
    assert drv["accesses_completed"] >= 1 and drv["stale_reads_caught"] == 0


def test_vllm_sums_each_kvlease_counter_over_the_tp_ranks(tp2: dict[str, Any]) -> None:
    """Issue 21 (metrics): vLLM aggregates the connector stats of every TP rank of an engine
    (KVOutputAggregator: each rank's lists extended into one) before the Prometheus metrics
    count them, so a producer counter is the sum over its ranks: on this TP-2 producer a request
    is granted, and completed, on each rank (each pins its own share of the KV)."""
    p = tp2["PT"]
    p.send(op="prefill", id="h3")
    params = p.wait("finished", 60, id="h3")["params"]
    d = tp2["DT"]
    d.send(op="decode", id="h3", params=params)
    done = d.wait("recv_done", 90, id="h3")
    assert done["failed"] is False and done["match"] is True, f"{done}\n{d.name}'s log:\n{d.tail()}"
    p.wait("freed", 30, id="h3")
    from _vllm_helpers import settled_stats

    names = ("leases_granted", "leases_completed")
    s = settled_stats(p, lambda s: {f"vllm:kvlease_{n}_total": sum(r["driver"][n] for r in s["ranks"]) for n in names})
    for name in names:
        per_rank = [r["driver"][name] for r in s["ranks"]]
        # Each rank counted (settled_stats: the exported counter is their sum). Not always the
        # same count: a rank whose part of the READ is done before the step that grants it (the
        # ticket's initial window covers the READ; vLLM holds the blocks until then) has nothing
        # left to grant, and skips it.
        assert min(per_rank) >= 1 and s["prometheus"][f"vllm:kvlease_{name}_total"] == sum(per_rank), per_rank


def test_a_producer_that_registered_its_kv_cache_again_is_read_without_a_spurious_failure(
    tp2: dict[str, Any],
) -> None:
    """Issue 21 (sleep mode): after the producer's sleep and wake-up (its KV cache registered
    again, every rank), vLLM's decoder sees the new registration generation in the next
    request's params, drops the producer's agents and handshakes again before reading. The
    adapter began its access before vLLM's re-handshake, so the READ vLLM queued again after it
    found an access already open and was refused: a failed load. Now the access begins when
    vLLM really reads: the load after the wake-up matches."""
    p, d = tp2["PT"], tp2["DT"]
    p.send(op="prefill", id="h2-before")  # read once before: the decoder holds the producer's agents
    params = p.wait("finished", 60, id="h2-before")["params"]
    before = params["remote_registration_generation"]
    d.send(op="decode", id="h2-before", params=params)
    assert d.wait("recv_done", 90, id="h2-before")["match"] is True
    p.wait("freed", 30, id="h2-before")
    p.send(op="sleep", id="-")
    p.wait("slept", 60)
    p.send(op="prefill", id="h2")
    params = p.wait("finished", 60, id="h2")["params"]
    print(f"\nregistration generation {before} -> {params['remote_registration_generation']}")
    assert params["remote_registration_generation"] > before, "the wake-up republished the same registration"
    d.send(op="decode", id="h2", params=params)
    done = d.wait("recv_done", 90, id="h2")
    assert done["failed"] is False and done["match"] is True, "the first READ after the wake-up failed"
    p.wait("freed", 30, id="h2")
