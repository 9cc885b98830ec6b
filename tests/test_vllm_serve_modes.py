"""Push mode and multi-turn (bidirectional) KV transfer inside real `vllm serve` pairs, stock vLLM
beside kvlease, from an OpenAI client through the router.

Two fleets, one after the other (each a stock pair and a kvlease pair of real ``vllm serve``
processes, tools/vllm_pd.py, started once for its class): push mode (``NixlPushConnector``: D
registers its blocks with P, P WRITEs into them; kvlease's push lease has D as the pinner and P
as the accessor), and bidirectional transfer (``bidirectional_kv_xfer``: turn 1's decoder keeps
its blocks, and the next turn's producer READs them back under kvlease's fixed-TTL lease, then
prefills only what is new). Every completion is compared, token for token, with the prompt's
reference computed by ``transformers`` alone; what an operator sees is read from each server's
``/metrics``. docs/vllm-serve.md explains them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest
from _vllm_serve_fleet import pd, started_fleet
from openai_serving import wait_until

pytestmark = pytest.mark.slow

#: Stock vLLM can hang a request for good in both modes: in a run of this suite (2026-12-05) the
#: stock push producer let its lease (`_vllm_serve_fleet.LEASE`) expire without writing ("Releasing expired KV
#: blocks ... retrieved by 0 remote worker(s)"), its decoder waited for the WRITE, gave the
#: registration up after 480 s and still never answered. That is stock's outcome, reported, after
#: `Fleet.stock_hang_s`, or, in push mode, one lease after the stock producer released the
#: request's blocks that way (the WRITE it never made cannot come after; 2026-12-07: released
#: 30 s after the request, and waiting out `stock_hang_s` made the push test take 280 s, not
#: about 110); kvlease's pair gets 600 s and must answer right.
_STOCK_EXPIRED = "Releasing expired KV blocks"


def served(fleet: pd.Fleet, p: str, d: str, future: Future[dict[str, Any]], expired0: int) -> dict[str, Any] | None:
    """The pair's answer; for the stock pair, None (and why, printed) when it hung."""
    if p != "p_stock":
        try:
            return future.result(timeout=600)
        except TimeoutError:
            raise AssertionError(
                f"kvlease {p}->{d}: no answer in 600 s\n{fleet.logs(p, d)}\n{fleet.stacks(p, d)}"
            ) from None
    t0 = time.monotonic()
    expired_at: float | None = None
    while not future.done():
        now = time.monotonic()
        # Push only: a push producer's expired blocks are the WRITE it never made; in the
        # other modes an expiry line may be another request's.
        push = fleet.mode == "push"
        if push and expired_at is None and fleet.servers[p].log().count(_STOCK_EXPIRED) > expired0:
            expired_at = now
        if now - t0 >= fleet.stock_hang_s or (expired_at is not None and now - expired_at >= fleet.lease):
            expired = fleet.servers[p].log().count(_STOCK_EXPIRED) - expired0
            print(
                f"\nstock {p}->{d}: no answer in {now - t0:.0f} s (stock vLLM's own hang, reported, not failed);"
                f" P released {expired} request(s)' blocks as expired meanwhile\n{fleet.logs(p, d)}"
            )
            return None
        with contextlib.suppress(TimeoutError):
            future.result(timeout=1.0)
    return future.result()


@contextlib.contextmanager
def stock_may_hang(p: str, d: str) -> Iterator[None]:
    """One pair's turn; a stock server that stops answering /metrics while it lives is stock's
    outcome, reported (with what its processes were doing) like `served`'s hang, not failed (CI
    of 2026-12-07: the stock producer of the multi-turn fleet, right after serving turn 1).
    kvlease's servers get the same patience and fail."""
    try:
        yield
    except pd.Unresponsive as e:
        if p != "p_stock":
            raise
        print(f"\nstock {p}->{d}: a server stopped answering (stock vLLM's own hang, reported, not failed)\n{e}")


@pytest.fixture(scope="class")
def push_fleet() -> Iterator[pd.Fleet]:
    yield from started_fleet("push")


@pytest.fixture(scope="class")
def multiturn_fleet() -> Iterator[pd.Fleet]:
    yield from started_fleet("bidirectional")


def _push_pair(fleet: pd.Fleet, p: str, d: str) -> None:
    """Push: one pair's completion, written by its producer into its decoder's blocks."""
    if fleet.warmup.get(f"{p}->{d}") == 0:
        print(f"\n{p}->{d}: its warm-up hung (stock vLLM's own hang, reported at start-up): not asked again")
        return
    text = pd.prompt("push", f"{p}->{d}")
    hits0 = fleet.metric(d, "vllm:external_prefix_cache_hits_total")
    failed0 = fleet.metric(d, "vllm:nixl_num_failed_transfers_total")
    expired0 = fleet.servers[p].log().count(_STOCK_EXPIRED)
    answer = served(fleet, p, d, fleet.complete(p, d, text), expired0)
    if answer is None:
        return
    assert answer["status"] == 200, (answer, fleet.logs(p, d))
    assert fleet.reference[text].matches(answer), (p, d, answer["text"], fleet.reference[text])
    assert answer["kv_transfer_params"] is None or not answer["kv_transfer_params"].get("do_remote_decode")
    # The prompt's KV came from P's WRITE, not from a prefill on D.
    assert fleet.metric(d, "vllm:external_prefix_cache_hits_total") > hits0, "the prompt was recomputed on D"
    assert fleet.metric(d, "vllm:nixl_num_failed_transfers_total") == failed0


def _two_turns(fleet: pd.Fleet, p: str, d: str) -> None:
    """Multi-turn: one pair's two turns, turn 2's producer reading turn 1's decoder blocks back."""
    # Turn 1's answer is long: P still holds turn 1's prompt in its own prefix cache (it
    # prefilled it), so what it reads back from D is the answer's KV, and vLLM reads no
    # fewer than ``kv_recompute_threshold`` (64) tokens (fewer are recomputed).
    text = pd.prompt("turn1", f"{p}->{d}")
    conversation = fleet.conversations[text]
    expired0 = fleet.servers[p].log().count(_STOCK_EXPIRED)
    turn1 = served(fleet, p, d, fleet.complete(p, d, text, max_tokens=pd.TURN1_TOKENS), expired0)
    if turn1 is None:
        return
    assert turn1["status"] == 200, (turn1, fleet.logs(p, d))
    assert conversation.turn1.matches(turn1), (p, d, turn1["text"], conversation.turn1)
    # D kept turn 1's blocks for the next turn, and said where they are.
    back = turn1["kv_transfer_params"]
    assert back and back["do_remote_decode"] and back["remote_block_ids"], back
    if p == "p_kv":
        assert back["kvlease"]["kind"] == 1, back  # a fixed-TTL lease on D's blocks
    # Turn 2: the conversation so far plus the user's next words, as token ids (a client
    # sends back exactly the tokens it was served).
    more = turn1["prompt_token_ids"][1 : 1 + pd.TURN2_MORE]
    ids = [*turn1["prompt_token_ids"], *turn1["token_ids"], *more]
    assert ids == conversation.turn2_ids  # what the reference's turn 2 is
    reference = conversation.turn2
    hits0 = fleet.metric(p, "vllm:external_prefix_cache_hits_total")
    reads0 = fleet.metric(p, "vllm:nixl_xfer_time_seconds_count")
    turn2 = served(fleet, p, d, fleet.complete(p, d, ids, kv_transfer_params=back), expired0)
    if turn2 is None:
        return
    assert turn2["status"] == 200, (turn2, fleet.logs(p, d))
    assert reference.matches(turn2), (p, d, turn2["text"], reference)
    # P read turn 1's KV back from D instead of prefilling it again.
    assert fleet.metric(p, "vllm:external_prefix_cache_hits_total") > hits0, "P recomputed turn 1"
    assert fleet.metric(p, "vllm:nixl_xfer_time_seconds_count") > reads0


class TestPushMode:
    def test_the_producer_writes_the_reference_kv_into_the_decoders_blocks(self, push_fleet: pd.Fleet) -> None:
        fleet = push_fleet
        posted0 = fleet.metric("p_kv", "vllm:kvlease_push_writes_posted_total")
        done0 = fleet.metric("p_kv", "vllm:kvlease_accesses_completed_total")
        completed0 = fleet.metric("d_kv", "vllm:kvlease_leases_completed_total")
        for p, d in pd.PAIRS:
            with stock_may_hang(p, d):
                _push_pair(fleet, p, d)
        # kvlease's producer wrote under the decoder's push lease, and its write-done ended that
        # lease on D (D frees nothing of a push another request's WRITE may still land in).
        wait_until(
            lambda: fleet.metric("d_kv", "vllm:kvlease_leases_completed_total") > completed0,
            120,  # published with the step after it: 30 s ran out at 3 decoded tokens/s (a loaded machine)
            "D's push lease ended by P's write-done, in vLLM's metrics",
        )
        assert fleet.metric("p_kv", "vllm:kvlease_push_writes_posted_total") > posted0
        assert fleet.metric("p_kv", "vllm:kvlease_push_writes_refused_total") == 0
        assert fleet.metric("p_kv", "vllm:kvlease_push_writes_dropped_total") == 0
        assert fleet.metric("p_kv", "vllm:kvlease_accesses_completed_total") > done0
        assert fleet.metric("d_kv", "vllm:kvlease_leases_lost_total") == 0
        # Stock vLLM's producer exports none of kvlease's counters: the two pairs are what they say.
        with stock_may_hang("p_stock", "d_stock"):
            assert "vllm:kvlease_push_writes_posted_total" not in fleet.servers["p_stock"].metrics()


class TestMultiTurn:
    def test_turn2s_producer_reads_turn1s_decoder_blocks_back(self, multiturn_fleet: pd.Fleet) -> None:
        fleet = multiturn_fleet
        completed0 = fleet.metric("d_kv", "vllm:kvlease_leases_completed_total")
        done0 = fleet.metric("p_kv", "vllm:kvlease_accesses_completed_total")
        for p, d in pd.PAIRS:
            with stock_may_hang(p, d):
                _two_turns(fleet, p, d)
        # kvlease: P's READ of D's blocks was proven inside D's fixed-TTL lease, and its
        # read-done freed them on D at once (not after vLLM's 480 s ``decoder_kv_blocks_ttl``).
        wait_until(
            lambda: fleet.metric("d_kv", "vllm:kvlease_leases_completed_total") > completed0,
            30,
            "D's fixed-TTL lease ended by P's read-done, in vLLM's metrics",
        )
        assert fleet.metric("p_kv", "vllm:kvlease_accesses_completed_total") > done0
        assert fleet.metric("p_kv", "vllm:kvlease_stale_reads_caught_total") == 0
        # The hang report's stack dump (`served`) works on a live server and leaves it serving:
        # the engine core (vLLM's handshake listener) and the worker (kvlease's lease pump) both
        # answer SIGUSR2.
        dump = fleet.stacks("d_kv")
        assert "_nixl_handshake_listener" in dump and "_kv_pump_loop" in dump, dump[-3000:]
        assert fleet.servers["d_kv"].healthy()
