"""kvlease inside real `vllm serve` pairs: what a client and an operator see, stock vLLM beside it.

One fleet for the module (start-up is minutes on a 2-core machine): a stock pair (vLLM's own
``NixlConnector``) and a kvlease pair (the same name, loaded from ``kvlease.adapters.vllm``),
each P and D a real ``vllm serve`` with real CPU forwards of the tiny Llama made by
engines/vllm/setup.sh, KV over NIXL (UCX on loopback), engines/vllm/router.py in front, requests
from the ``openai`` library (engines/vllm/client.py). Greedy output is a fixed function of the
prompt, so a KV block of another request shows up as a different completion: every completion
is compared, token for token, with the prompt's reference computed by ``transformers`` alone.
The router pairs any P with any D, so the mixed fleets run on the same four servers. The tests
run in file order; the last kills the decoders. tools/vllm_pd.py holds the fleet and the
scenarios (``python tools/vllm_pd.py demo`` plays them); docs/vllm-serve.md explains them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from _vllm_serve_fleet import LEASE, pd, started_fleet
from openai_serving import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet() -> Iterator[pd.Fleet]:
    yield from started_fleet()


def test_happy_path_text_equals_reference_and_kv_came_over_nixl(fleet: pd.Fleet) -> None:
    done0 = fleet.metric("d_kv", "vllm:kvlease_accesses_completed_total")
    ended0 = kvlease_saw_lease_end(fleet)
    for p, d in pd.PAIRS:
        text = pd.prompt("happy", f"{p}->{d}")
        hits0 = fleet.metric(d, "vllm:external_prefix_cache_hits_total")
        reads0 = fleet.metric(d, "vllm:nixl_xfer_time_seconds_count")
        failed0 = fleet.metric(d, "vllm:nixl_num_failed_transfers_total")
        answer = fleet.complete(p, d, text).result(timeout=600)
        assert answer["status"] == 200, (answer, fleet.logs(p, d))
        assert fleet.reference[text].matches(answer), (p, d, answer["text"], fleet.reference[text])
        assert fleet.metric(d, "vllm:external_prefix_cache_hits_total") > hits0, "the prompt was recomputed on D"
        assert fleet.metric(d, "vllm:nixl_xfer_time_seconds_count") == reads0 + 1
        assert fleet.metric(d, "vllm:nixl_num_failed_transfers_total") == failed0
    # kvlease's verdict on its READ: the access proven inside the lease (and P's read-done), or
    # the lease seen ended (a failed load, recomputed: the same text, D's READ refused).
    wait_until(
        lambda: (
            fleet.metric("d_kv", "vllm:kvlease_accesses_completed_total") > done0
            or kvlease_saw_lease_end(fleet) > ended0
        ),
        30,
        "kvlease's verdict on the READ in vLLM's metrics",
    )
    # An idle pair must not lose a lease: that happened while the lease pump shared one core with
    # the forward (docs/vllm-serve.md, "heartbeats that came late").
    assert fleet.metric("d_kv", "vllm:kvlease_accesses_completed_total") > done0, (
        "kvlease's decoder saw its lease end and recomputed (the text is the reference)\n" + fleet.logs("p_kv", "d_kv")
    )
    # The producer's paced step for held blocks waits on the engine core's input queue (a request
    # that arrives ends it), found on the scheduler's call stack inside the real server.
    p_log = fleet.servers["p_kv"].log()
    assert "a step for held blocks alone waits at most" in p_log, fleet.logs("p_kv")
    assert "input queue is not on the scheduler's call stack" not in p_log
    wait_until(lambda: fleet.metric("p_kv", "vllm:kvlease_leases_completed_total") >= 1, 30, "P's read-done")


def kvlease_saw_lease_end(fleet: pd.Fleet) -> float:
    """Leases kvlease's decoder saw lost, and reads it refused as stale."""
    return fleet.metric("d_kv", "vllm:kvlease_leases_lost_total") + fleet.metric(
        "d_kv", "vllm:kvlease_stale_reads_caught_total"
    )


def test_mixed_fleets_serve_the_reference_text(fleet: pd.Fleet) -> None:
    """A rolling upgrade: kvlease P with a stock D (D's ``HB:`` and ``id:count`` understood by
    P's compat codec), and stock P with a kvlease D (no ticket: vLLM's own heartbeats, and a
    warning that reads from that producer carry no validity guarantee)."""
    completed0 = fleet.metric("p_kv", "vllm:kvlease_leases_completed_total")
    expired0 = fleet.metric("p_kv", "vllm:kvlease_leases_expired_total")
    for p, d in (("p_kv", "d_stock"), ("p_stock", "d_kv")):
        text = pd.prompt("mixed", f"{p}->{d}")
        answer = fleet.complete(p, d, text).result(timeout=600)
        assert answer["status"] == 200, (answer, fleet.logs(p, d))
        assert fleet.reference[text].matches(answer), (p, d, answer["text"], fleet.reference[text])
    # The stock decoder's "id:count" ends kvlease P's lease, unless the stock decoder read after
    # the lease (it keeps no validity: the documented "no guarantee" of a mixed fleet).
    wait_until(
        lambda: (
            fleet.metric("p_kv", "vllm:kvlease_leases_completed_total") > completed0
            or fleet.metric("p_kv", "vllm:kvlease_leases_expired_total") > expired0
        ),
        60,
        "P's lease to end",
    )
    if fleet.metric("p_kv", "vllm:kvlease_leases_completed_total") == completed0:
        print("\nmixed: the stock decoder read after kvlease P's lease ended (stock keeps no validity)")
    assert "sent no lease ticket (a stock vLLM producer)" in fleet.servers["d_kv"].log()


def test_request_queued_longer_than_the_lease_is_served_from_transferred_kv(fleet: pd.Fleet) -> None:
    """D overloaded: the request waits in D's queue for longer than the lease (fillers hold D's
    slots for 1.5 leases after it arrived); kvlease's heartbeats hold P's blocks, and the READ
    succeeds (no recompute). kvlease's pair only (the fillers' decoding on both decoders would
    starve this 2-core machine)."""
    fillers = fleet.fill("d_kv")
    try:
        renewed0 = fleet.metric("p_kv", "vllm:kvlease_leases_renewed_total")
        sent0 = fleet.metric("d_kv", "vllm:kvlease_heartbeats_sent_total")
        heard0 = fleet.metric("p_kv", "vllm:kvlease_heartbeats_received_total")
        done0 = fleet.metric("d_kv", "vllm:kvlease_accesses_completed_total")
        lost0 = fleet.metric("d_kv", "vllm:kvlease_leases_lost_total")
        acks0 = fleet.metric("d_kv", "vllm:kvlease_heartbeat_acks_received_total")
        expired0 = fleet.metric("p_kv", "vllm:kvlease_leases_expired_total")
        text = pd.prompt("overload", "p_kv->d_kv")
        future = fleet.complete("p_kv", "d_kv", text)
        wait_until(lambda: fleet.waiting("d_kv"), 120, "the request to wait in D's queue")
        queued_at = time.monotonic()
        # How long D went without decoding a token while the request waited: a decoder that gets no
        # CPU sends no heartbeat either (the lease then ends, rightly).
        stall, last, tokens = 0.0, queued_at, fleet.metric("d_kv", "vllm:generation_tokens_total")
        while time.monotonic() - queued_at < LEASE * 1.5 and not future.done():
            now_tokens = fleet.metric("d_kv", "vllm:generation_tokens_total")
            if now_tokens != tokens:
                tokens, last = now_tokens, time.monotonic()
            stall = max(stall, time.monotonic() - last)
            time.sleep(0.5)
    finally:
        fleet.release(fillers)  # D's slots free: the request is next
    answer = future.result(timeout=600)
    queued = time.monotonic() - queued_at
    assert answer["status"] == 200, (answer, fleet.logs("p_kv", "d_kv"))
    assert fleet.reference[text].matches(answer), (answer["text"], fleet.reference[text])
    assert queued > LEASE, f"the request waited only {queued:.1f} s in D's queue (lease {LEASE} s)"
    lost = fleet.metric("d_kv", "vllm:kvlease_leases_lost_total") - lost0
    sent = fleet.metric("d_kv", "vllm:kvlease_heartbeats_sent_total") - sent0
    heard = fleet.metric("p_kv", "vllm:kvlease_heartbeats_received_total") - heard0
    print(f"\noverload: queued {queued:.1f} s (lease {LEASE} s), D's longest stall {stall:.1f} s, lost: {lost > 0}; "
          f"heartbeats sent by D {sent:.0f}, received by P {heard:.0f}")  # fmt: skip
    if lost and stall >= LEASE / 2:
        pytest.skip(f"D decoded nothing for {stall:.1f} s while the request waited (a starved machine): "
                    "no heartbeat went out, the lease ended and the prompt was recomputed (rightly)")  # fmt: skip
    acks = fleet.metric("d_kv", "vllm:kvlease_heartbeat_acks_received_total") - acks0
    expired = fleet.metric("p_kv", "vllm:kvlease_leases_expired_total") - expired0
    why = [line for line in fleet.servers["d_kv"].log().splitlines() if "lost before its READ" in line]
    if lost and not expired and acks < sent and why and "validity_lapsed" in why[-1]:
        # Seen once in CI (2026-12-05: D sent 12, P received and renewed 12, D took in fewer answers
        # and sent 1 heartbeat in 10 s): P held the lease throughout; D's own process did not take
        # P's answers in for a whole lease, so D could no longer prove the lease and gave it up
        # (safe: recomputed). A decoder process starved of CPU; reported, with D's reason. Any
        # other loss (P's word that it expired or forgot the lease) still fails below.
        pytest.skip(
            f"P held the lease (heard {heard:.0f} of D's {sent:.0f} heartbeats, expired none) but D took in"
            f" only {acks:.0f} answers and gave it up: {why[-1:]}"
        )
    renewed = fleet.metric("p_kv", "vllm:kvlease_leases_renewed_total") - renewed0
    if lost and expired and heard >= sent and renewed >= heard:
        # Seen once in a local full run (2026-12-06: D sent 13, P received and renewed 13, and
        # P's lease code reported 2.4 s of its own wall time in one 10 s window): P renewed on
        # every heartbeat it handled but handled them too late, a producer process starved of
        # CPU. P's expiry was right (safe: recomputed). A heartbeat P did not renew still fails
        # below.
        pytest.skip(
            f"P renewed on each of the {heard:.0f} heartbeats it handled ({sent:.0f} sent) but the lease"
            " expired between two of them: P handled them late (a starved producer)"
        )
    # The liveness claim: D was live (it decoded), so its heartbeats held P's lease. (Until the lease
    # pump ran on the cores vLLM's pinning left it, this failed every time: docs/vllm-serve.md.)
    assert not lost, (
        f"the lease ended while D was live: D sent {sent:.0f} heartbeats, P received {heard:.0f}\n"
        + fleet.logs("p_kv", "d_kv")
    )
    assert fleet.metric("d_kv", "vllm:kvlease_accesses_completed_total") > done0, "recomputed, not read"
    assert fleet.metric("p_kv", "vllm:kvlease_leases_renewed_total") > renewed0


def test_stale_read_stock_serves_wrong_text_kvlease_never(fleet: pd.Fleet) -> None:
    """The production failure (`vllm_pd.stale_read`): stock vLLM serves other requests' KV as
    the victim's (HTTP 200, wrong text); kvlease sees the lease lost (or the READ stale),
    reports a failed load, and vLLM recomputes: the reference text."""
    result = pd.stale_read(fleet)
    kv, stock = result["p_kv"], result["p_stock"]
    for name, o in (("stock", stock), ("kvlease", kv)):
        print(f"\nstale read: {name} HTTP {o.answer['status']} {o.answer['text']!r} (reference {o.reference.text!r})")
    # kvlease: the reference text or a clean error, never another request's KV.
    assert not kv.wrong, (kv.answer, fleet.logs("p_kv", "d_kv"))
    assert kv.right or kv.answer["status"] >= 400, kv.answer
    assert result["kvlease_saw_lease_end"], "kvlease's decoder did not see the lease end"
    d_log = fleet.servers["d_kv"].log()
    assert "its lease was lost" in d_log or "is not valid" in d_log
    # The baseline: stock serves wrong text with HTTP 200. If it does not, say so (never pass silently).
    assert stock.answer["status"] == 200, stock.answer
    if stock.right:
        pytest.fail("the stock baseline did not reproduce: stock served the reference completion")


def test_decoder_killed_frees_producer_blocks_within_the_lease(fleet: pd.Fleet) -> None:
    """D SIGKILLed while its request waits (`vllm_pd.decoder_killed`): P's KV usage back where
    it was within the lease bound (no heartbeat renews it; the lease pump runs the expiry and
    the engine keeps stepping while it holds blocks). Stock's figure is printed beside it.
    A try whose lease ended before the kill is retried; it fails the test unless the decoder was
    starved (sent fewer heartbeats than it owed). Kills the decoders: the module's last test."""
    killed = pd.decoder_killed(fleet)
    kv, stock = killed["p_kv"], killed["p_stock"]
    print(f"\nD killed: P's blocks back after kvlease {kv.freed} s, stock {stock.freed} s (lease {LEASE} s)")
    for early in kv.early:
        print(f"  a kvlease try did not count: {early}")
    unexplained = [early for early in kv.early if not early.starved]
    assert not unexplained, (
        "kvlease's producer ended a lease whose decoder sent its heartbeats on time: "
        + "; ".join(map(str, unexplained))
        + "\n"
        + fleet.logs("p_kv", "d_kv")
    )
    if kv.freed == pd.FREED_BEFORE_THE_KILL:
        pytest.skip(
            f"in each of {len(kv.early)} tries kvlease's decoder was starved of CPU (it owed more"
            f" heartbeats than it sent) and its lease ended, rightly, before the kill: {kv.early[-1]}"
        )
    assert kv.freed is not None, "kvlease's producer still holds the dead decoder's blocks"
    assert kv.freed <= LEASE + 3.0, f"freed {kv.freed:.1f} s after the kill (lease {LEASE} s)"
