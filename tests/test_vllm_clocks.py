"""Each vLLM process on its own host's clock: fixed-TTL leases across hosts and multi-node TP.

Issue 21, hole 4. In bidirectional KV transfer the decoder keeps a finished request's blocks
under a fixed-TTL lease whose deadline its scheduler takes from its own clock; each TP worker
grants it. With multi-node TP a worker runs on another host, whose CLOCK_MONOTONIC has another
epoch: a worker that granted ``deadline - its own clock`` would free at once where its clock runs
ahead (the reader's READ of that rank's blocks then overlaps the free) and hold the blocks for
as long as its clock lags. kvlease's workers grant what was left of the deadline when the
scheduler sent it (``sched_now``), which no clock epoch changes.

Here every "host" is a Linux time namespace (``unshare --time``; tests/_vllm_helpers.in_clock),
the only way one machine gives processes clocks of different epochs: the producer on this
host's clock, each decoder's scheduler and TP rank 0 on a clock 500 s ahead, and each decoder's
TP rank 1 on a clock 1,000 s ahead of (DA) or behind (DB) its scheduler's. The producer (the
turn-2 reader) converts the deadline with its clock-offset estimate of the decoder's rank 0.
Only the model forward is faked (tests/_vllm_node.py); KV moves over NIXL between processes.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from typing import Any

import pytest
from _vllm_helpers import Node, nodes_up, require_time_namespaces, require_vllm_env

pytestmark = pytest.mark.slow

D = 6.0  # lease: heartbeat 1 s, extension 4 s
TTL = 10.0  # the decoders' fixed-TTL lease (vLLM's decoder_kv_blocks_ttl)
SLACK = 1.5  # scheduling on a loaded 2-core machine (steps every ~10 ms when idle)
KEY_ENV = "KVLEASE_TEST_CLOCKS_KEY"
EXTRA = {
    "kv_lease_duration": D,
    "bidirectional_kv_xfer": True,
    "decoder_kv_blocks_ttl": TTL,
    "auth_keys": [f"env:{KEY_ENV}"],
}
#: Clock offsets from this host's CLOCK_MONOTONIC, seconds.
SCHED = 500
AHEAD = SCHED + 1000
BEHIND = SCHED - 1000  # below this host's own clock: a host booted later


@pytest.fixture(scope="module")
def hosts() -> Iterator[dict[str, Node]]:
    require_vllm_env()
    require_time_namespaces()
    os.environ[KEY_ENV] = secrets.token_hex(32)  # inherited by every node
    decoder = dict(role="kv_consumer", connector="kvlease", extra=EXTRA, tp=2, max_num_seqs=1, clock_offset=SCHED)
    specs: dict[str, dict[str, Any]] = {
        "PC": dict(role="kv_producer", connector="kvlease", extra=EXTRA),
        "DA": dict(decoder, worker_clock_offset=AHEAD),
        "DB": dict(decoder, worker_clock_offset=BEHIND),
    }
    with nodes_up(specs, timeout=300) as nodes:
        yield nodes


def _turn1(p: Node, d: Node, rid: str) -> dict[str, Any]:
    """Turn 1: prefilled on `p`, decoded on `d` (reading `p`'s KV); `d` then holds its blocks
    under a fixed-TTL lease for turn 2. Returns `d`'s finished event (its ticket in `params`)."""
    p.send(op="prefill", id=rid)
    params = p.wait("finished", 60, id=rid)["params"]
    d.send(op="decode", id=rid, params=params)
    done = d.wait("recv_done", 90, id=rid)
    assert done["failed"] is False and done["match"] is True, f"turn 1 on {d.name}: {done}\n{d.tail()}"
    p.wait("freed", 30, id=rid)
    return d.wait("finished", 60, id=rid)


def _per_rank(d: Node) -> list[dict[str, Any]]:
    return list(d.stats()["ranks"])


def test_each_process_runs_on_its_own_hosts_clock(hosts: dict[str, Node]) -> None:
    """The setting itself: the decoders' ranks read their clocks where they were put."""
    host = hosts["PC"].stats()["clock"]
    for name, rank1 in (("DA", AHEAD), ("DB", BEHIND)):
        clocks = [r["clock"] for r in _per_rank(hosts[name])]
        print(f"\n{name}: rank clocks {clocks[0] - host:+.0f} s, {clocks[1] - host:+.0f} s from the producer's")
        assert abs(clocks[0] - host - SCHED) < 60 and abs(clocks[1] - host - rank1) < 60


def test_a_rank_whose_clock_runs_ahead_holds_its_blocks_until_the_reader_is_done(hosts: dict[str, Node]) -> None:
    """DA's rank 1 runs 1,000 s ahead of DA's scheduler. Turn 2 on the producer READs both of
    DA's ranks' blocks under the fixed-TTL lease, judged by the producer's estimate of DA's rank-0
    clock: the load matches, and each rank frees on the read-done, none at (or before) expiry.
    (Granting ``deadline - own clock`` gave rank 1 no time at all: its blocks were freed before
    the READ, which the producer then caught as stale: a failed load.)"""
    p, d = hosts["PC"], hosts["DA"]
    before = _per_rank(d)
    fin = _turn1(p, d, "a1")
    ticket = fin["params"]["kvlease"]
    assert ticket["kind"] == 1 and ticket["ranks"] == 2  # FIXED_TTL, on both of DA's ranks
    p.send(op="turn2", id="a2", params=fin["params"], prefill_id="a1", check_blocks=3, tokens=160)
    done = p.wait("recv_done", 60, id="a2")
    assert done["failed"] is False and done["match"] is True, f"turn 2 read {done}\n{p.tail()}\n{d.tail()}"
    freed = d.wait("freed", 30, id="a1")
    print(f"\nDA freed turn 1's blocks {freed['t'] - fin['t']:.2f} s after the ticket (TTL {TTL:.0f} s)")
    assert freed["t"] - fin["t"] < TTL, "DA held its blocks to the deadline: a rank never heard the read-done"
    after = _per_rank(d)
    for rank in (0, 1):
        assert after[rank]["counters"]["completed"] > before[rank]["counters"]["completed"], f"rank {rank}"
        assert after[rank]["counters"]["expired"] == before[rank]["counters"]["expired"], f"rank {rank} expired"
    drv = p.stats()["driver"]
    assert drv["stale_reads_caught"] == 0


def test_a_ticket_nobody_reads_frees_every_rank_at_its_deadline(hosts: dict[str, Node]) -> None:
    """DB's rank 1 runs 1,000 s behind DB's scheduler. Nobody reads turn 1's blocks back: each
    rank frees them at the ticket's deadline (vLLM reports the request freed once every rank
    has), neither early nor late. (Granting ``deadline - own clock`` gave rank 1 a lease 1,000 s
    too long: DB's blocks held for a quarter of an hour.)"""
    p, d = hosts["PC"], hosts["DB"]
    before = _per_rank(d)
    fin = _turn1(p, d, "b1")
    freed = d.wait("freed", TTL + 30, id="b1")
    held = freed["t"] - fin["t"]
    print(f"\nDB freed turn 1's unread blocks {held:.2f} s after the ticket (TTL {TTL:.0f} s)")
    assert TTL - SLACK <= held <= TTL + SLACK
    after = _per_rank(d)
    for rank in (0, 1):
        assert after[rank]["counters"]["expired"] == before[rank]["counters"]["expired"] + 1, f"rank {rank}"
