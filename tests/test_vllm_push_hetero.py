"""kvlease inside vLLM 0.33.0, push mode with the producer's TP smaller than the decoder's
(issue 21, hole 1): real vLLM schedulers and push connectors, vLLM's own writer thread, NIXL
WRITEs between a TP-1 producer P and a TP-2 decoder D (two processes: D's rank 1 is a worker
process of its own).

P writes each of its KV heads into the D rank that holds it: one WRITE per D rank, one push
access of two parts. The per-WRITE gate can post the WRITE to D's rank 0 and refuse the one to
rank 1 (the validity window lapsed between them). The access failed with a part posted: the
lease is given up, and the WRITE in flight may still land. So no D rank may free its blocks on
that Release (each holds them to its lease's expiry plus the push guard G), and P may not free
the source blocks that WRITE reads from until it completed.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from _vllm_helpers import Node, nodes_up, require_vllm_env

pytestmark = pytest.mark.slow

#: Lease D (heartbeat every D/6 = 2 s, extending by 2D/3 = 8 s) and access bound A (the push
#: guard G = A * (1 + rho)). A WRITE is approved only if ``now + A <= valid_until``, so D's
#: lease, which never ends before P's view of it, lasts until ``A`` after the approval at least.
D = 12.0
A = 4.0
RHO = 1e-4
G = A * (1 + RHO)
#: The writer stalls between its WRITE to D's rank 0 and the one to rank 1 longer than the
#: window can cover after an approval (2D/3 - A + a heartbeat's lateness): rank 1's is refused.
STALL = 2 * D / 3 - A + 2.0
EXTRA = {"kv_lease_duration": D, "max_access_time": A}


@pytest.fixture(scope="module")
def pair() -> Iterator[dict[str, Node]]:
    require_vllm_env()
    specs: dict[str, dict[str, Any]] = {
        "P": dict(role="kv_producer", connector="kvlease-push", extra=EXTRA, max_num_seqs=1),
        "D": dict(role="kv_consumer", connector="kvlease-push", extra=EXTRA, tp=2),
    }
    with nodes_up(specs, timeout=300) as nodes:
        yield nodes


def _register(p: Node, d: Node, rid: str) -> None:
    """D takes `rid` for decode with P's coordinates (as a push router does): each D rank
    allocates its destination blocks and registers them with P."""
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": p.name,
        "remote_request_id": rid,
        "remote_host": "127.0.0.1",
        "remote_port": p.port,
        "tp_size": 1,
    }
    d.send(op="decode", id=rid, params=params)
    d.wait("added", 30, id=rid)


def _freeze(node: Node, sig: int) -> None:
    os.killpg(node.proc.pid, sig)  # the scheduler and its TP worker process


def test_both_decoder_ranks_written_and_each_checks_its_heads(pair: dict[str, Node]) -> None:
    """The happy path first: P's one head goes to each D rank, both land, the load matches."""
    p, d = pair["P"], pair["D"]
    _register(p, d, "w1")
    p.send(op="prefill", id="w1")
    done = d.wait("recv_done", 60, id="w1")
    assert done["failed"] is False and done["match"] is True, f"{done}\n{d.tail()}"
    p.wait("freed", 30, id="w1")
    assert p.stats()["writes_posted"]["w1"] == 2  # one WRITE per D rank


def test_a_refused_part_frees_no_rank_while_the_posted_part_may_land(pair: dict[str, Node]) -> None:
    """P's WRITE to D's rank 0 is posted and held in flight (a test hook keeps it reported
    pending); vLLM's writer then stalls before the WRITE to rank 1, and D is frozen meanwhile, so
    P's heartbeats go unanswered and the window lapses: rank 1's WRITE is refused. The access
    failed with a part posted. Before: the Release freed both D ranks at once (rank 0 while its
    WRITE could still land), and P freed the source blocks the held WRITE reads from. Now: D
    fails the load only at its lease's expiry plus G (at least A + G after the approval), and P
    frees the source blocks when the held WRITE completes."""
    p, d = pair["P"], pair["D"]
    base = p.stats()["push"]
    _register(p, d, "x1")
    time.sleep(D / 6)  # tracked and heartbeating
    p.send(op="hold_write", id="x1")
    p.wait("hold_write", 30, id="x1")
    p.send(op="stall_writer", id="x1", rank=1, seconds=STALL)
    p.wait("stalled", 30, id="x1")
    p.send(op="prefill", id="x1")
    t0 = p.wait("stalling", 60, id="x1")["t"]  # approved, rank 0's WRITE posted, rank 1's next
    _freeze(d, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + STALL + 30
        while p.stats()["push"]["push_writes_refused"] == base["push_writes_refused"]:
            assert time.monotonic() < deadline, "rank 1's WRITE was never refused"
            time.sleep(0.3)
        t_refused = time.monotonic()
    finally:
        _freeze(d, signal.SIGCONT)
    assert p.wait("held", 10, id="x1"), "the WRITE to rank 0 was not posted"
    done = d.wait("recv_done", 4 * D, id="x1")
    print(
        f"\npush, P TP1 -> D TP2: rank 1's WRITE refused {t_refused - t0:.2f} s after the stall began; "
        f"D failed the load {done['t'] - t0:.2f} s after it (bound: at least A + G = {A + G:.2f} s)"
    )
    assert done["failed"] is True and done["match"] is None
    assert done["t"] - t0 >= A + G, "a D rank freed on the Release while the posted WRITE could still land"
    # P: the held WRITE reads from x1's source blocks, which stay P's until it completes.
    time.sleep(1.0)
    assert not p.seen("freed", id="x1"), "P freed the source blocks of a WRITE still in flight"
    p.send(op="release_write", id="x1")
    p.wait("freed", 30, id="x1")
    assert p.stats()["writes_posted"]["x1"] == 1
    assert d.wait("scheduled", 60, id="x1")["num_computed_tokens"] == 0  # recomputed
    # The engine goes on: the next push is written whole.
    _register(p, d, "w2")
    p.send(op="prefill", id="w2")
    done = d.wait("recv_done", 60, id="w2")
    assert done["failed"] is False and done["match"] is True
