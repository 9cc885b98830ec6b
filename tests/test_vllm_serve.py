"""kvlease inside real `vllm serve` pairs: what a client and an operator see, stock vLLM beside it.

One fleet for the module (start-up is minutes on a 2-core machine): a stock pair (vLLM's own
``NixlConnector``) and a kvlease pair (the same name, loaded from ``kvlease.adapters.vllm``),
each P and D a real ``vllm serve`` with real CPU forwards of the tiny Llama made by
engines/vllm/setup.sh, KV over NIXL (UCX on loopback), engines/vllm/router.py in front, requests
from the ``openai`` library (engines/vllm/client.py). Greedy output is a fixed function of the
prompt, so a KV block of another request shows up as different text: every completion is
compared with the prompt's reference, computed by ``transformers`` alone. The router pairs any P
with any D, so the mixed fleets run on the same four servers. The tests run in file order and
the last kills the decoders. See docs/vllm-serve.md; tools/vllm_pd.py holds the machinery.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import vllm_pd as pd

pytestmark = pytest.mark.slow

#: The lease of every server (``kv_lease_duration``, s): short, so the scenarios are quick, long
#: enough for a loaded 2-core machine to answer heartbeats in time.
LEASE = float(os.environ.get("KVLEASE_SERVE_LEASE", "8"))
P_BLOCKS = 48  # P's KV cache (blocks of 32 tokens): small, so other requests reuse a freed block
D_SEQS = 2  # D's sequence slots: two fillers keep a request waiting in D's queue

STACKS = ("stock", "kvlease")
PROMPTS = {
    "happy": "def happy_path(x):\n    return",
    "mixed": "class MixedFleet:\n    def __init__(self):",
    "overload": "def overloaded_decoder(queue):\n    for item in",
    "stale": "def lease_victim(x): return x * 2",
    "killed": "import os\nclass DeadDecoder:",
}
MAX_TOKENS = 16


def prompt(kind: str, route: str) -> str:
    """A prompt unique to a scenario and a route (so no prefix cache shares its blocks)."""
    return f"# {route}\n{PROMPTS[kind]}"


def all_prompts() -> list[str]:
    routes = ["p_stock->d_stock", "p_kv->d_kv", "p_kv->d_stock", "p_stock->d_kv"]
    return [prompt(kind, route) for kind in PROMPTS for route in routes]


class Fleet:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.servers: dict[str, pd.Server] = {}
        self.router: pd.Router | None = None
        self.client: pd.Client | None = None
        self.reference: dict[str, str] = {}
        self.decode_rate = 0.0  # tokens per second of one filler on D

    def start(self) -> None:
        for connector, suffix in ((pd.STOCK, "stock"), (pd.KVLEASE, "kv")):
            self.servers[f"p_{suffix}"] = pd.start_server(
                f"p_{suffix}", connector, pd.PRODUCER, self.workdir, lease=LEASE, blocks=P_BLOCKS
            )
            self.servers[f"d_{suffix}"] = pd.start_server(
                f"d_{suffix}", connector, pd.CONSUMER, self.workdir, lease=LEASE, max_num_seqs=D_SEQS
            )
        self.reference = pd.reference_texts(all_prompts(), MAX_TOKENS)  # while the servers start
        self.startup_s = pd.wait_healthy(list(self.servers.values()))
        s = self.servers
        self.router = pd.start_router([s["p_stock"], s["p_kv"]], [s["d_stock"], s["d_kv"]], self.workdir)
        self.client = pd.Client()
        # The machine's decode speed now, for fillers that outlast what a scenario waits for.
        t0 = time.monotonic()
        self.client.complete(f"{s['d_stock'].url}/v1", "warm up", 32, extra_body={"ignore_eos": True})
        self.decode_rate = 32 / (time.monotonic() - t0)

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.router is not None:
            self.router.stop()
        for server in self.servers.values():
            server.stop()

    def complete(self, p: str, d: str, text: str, **kw: Any) -> Future[dict[str, Any]]:
        assert self.client is not None and self.router is not None
        headers = {"x-kvlease-prefill": p, "x-kvlease-decode": d}
        return self.client.submit(self.router.base_url, text, MAX_TOKENS, headers=headers, **kw)

    def fill(self, d: str, seconds: float) -> list[Future[dict[str, Any]]]:
        """Occupy every sequence slot of decoder `d` for about `seconds` (direct requests)."""
        assert self.client is not None
        tokens = max(32, min(1000, int(self.decode_rate * seconds)))
        url = f"{self.servers[d].url}/v1"
        return [
            self.client.submit(url, f"filler {i} {time.monotonic()}", tokens, extra_body={"ignore_eos": True})
            for i in range(D_SEQS)
        ]

    def metric(self, server: str, name: str) -> float:
        return self.servers[server].metrics().get(name, 0.0)


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    problem = pd.missing_environment()
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(problem)
        pytest.skip(problem)
    workdir = Path(tempfile.mkdtemp(prefix="kvlease-serve-"))
    f = Fleet(workdir)
    try:
        f.start()
        yield f
    finally:
        f.stop()
        if os.environ.get("KVLEASE_KEEP_LOGS"):
            print(f"\nserver logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def logs(f: Fleet, *names: str) -> str:
    return "\n".join(f"--- {n} ---\n{pd.tail(f.servers[n].log(), 15)}" for n in names)


def test_happy_path_text_equals_reference_and_kv_came_over_nixl(fleet: Fleet) -> None:
    for p, d in (("p_stock", "d_stock"), ("p_kv", "d_kv")):
        text = prompt("happy", f"{p}->{d}")
        hits0 = fleet.metric(d, "vllm:external_prefix_cache_hits_total")
        reads0 = fleet.metric(d, "vllm:nixl_xfer_time_seconds_count")
        answer = fleet.complete(p, d, text).result(timeout=600)
        assert answer["status"] == 200, (answer, logs(fleet, p, d))
        assert answer["text"] == fleet.reference[text], (p, d, answer["text"], fleet.reference[text])
        assert fleet.metric(d, "vllm:external_prefix_cache_hits_total") > hits0, "the prompt was recomputed on D"
        assert fleet.metric(d, "vllm:nixl_xfer_time_seconds_count") == reads0 + 1
        assert fleet.metric(d, "vllm:nixl_num_failed_transfers_total") == 0
    assert fleet.metric("d_kv", "vllm:kvlease_accesses_completed_total") >= 1
    assert fleet.metric("d_kv", "vllm:kvlease_leases_lost_total") == 0
    assert fleet.metric("d_kv", "vllm:kvlease_stale_reads_caught_total") == 0
    assert pd.wait_until(lambda: fleet.metric("p_kv", "vllm:kvlease_leases_completed_total") >= 1, 30, "P's read-done")


def test_mixed_fleets_serve_the_reference_text(fleet: Fleet) -> None:
    """A rolling upgrade: kvlease P with a stock D (D's ``HB:`` and ``id:count`` understood by
    P's compat codec), and stock P with a kvlease D (no ticket: vLLM's own heartbeats, and a
    warning that reads from that producer carry no validity guarantee)."""
    completed0 = fleet.metric("p_kv", "vllm:kvlease_leases_completed_total")
    for p, d in (("p_kv", "d_stock"), ("p_stock", "d_kv")):
        text = prompt("mixed", f"{p}->{d}")
        answer = fleet.complete(p, d, text).result(timeout=600)
        assert answer["status"] == 200, (answer, logs(fleet, p, d))
        assert answer["text"] == fleet.reference[text], (p, d, answer["text"], fleet.reference[text])
    # The stock decoder's "id:count" ended kvlease P's lease (not its expiry).
    pd.wait_until(lambda: fleet.metric("p_kv", "vllm:kvlease_leases_completed_total") > completed0, 30, "P's read-done")
    assert "sent no lease ticket (a stock vLLM producer)" in fleet.servers["d_kv"].log()


def waiting(f: Fleet, d: str, n: int = 1) -> bool:
    return f.metric(d, "vllm:num_requests_waiting") >= n


def test_request_queued_longer_than_the_lease_is_served_from_transferred_kv(fleet: Fleet) -> None:
    """D overloaded: the request waits in D's queue for longer than the lease; kvlease's
    heartbeats hold P's blocks, and the READ succeeds (no recompute)."""
    hold = LEASE * 1.8
    fillers = fleet.fill("d_kv", hold) + fleet.fill("d_stock", hold)
    pd.wait_until(lambda: fleet.metric("d_kv", "vllm:num_requests_running") >= D_SEQS, 120, "D's slots filled")
    renewed0 = fleet.metric("p_kv", "vllm:kvlease_leases_renewed_total")
    hits0 = fleet.metric("d_kv", "vllm:external_prefix_cache_hits_total")
    answers = {}
    for p, d in (("p_kv", "d_kv"), ("p_stock", "d_stock")):
        answers[p] = (prompt("overload", f"{p}->{d}"), fleet.complete(p, d, prompt("overload", f"{p}->{d}")))
    pd.wait_until(lambda: waiting(fleet, "d_kv"), 120, "the request to wait in D's queue")
    queued_at = time.monotonic()
    text, future = answers["p_kv"]
    answer = future.result(timeout=900)
    queued = time.monotonic() - queued_at
    assert answer["status"] == 200, (answer, logs(fleet, "p_kv", "d_kv"))
    assert answer["text"] == fleet.reference[text]
    if queued <= LEASE:
        pytest.fail(f"the request waited only {queued:.1f} s in D's queue (lease {LEASE} s): fillers too short")
    assert fleet.metric("d_kv", "vllm:external_prefix_cache_hits_total") > hits0, "recomputed, not read"
    assert fleet.metric("d_kv", "vllm:kvlease_leases_lost_total") == 0
    assert fleet.metric("p_kv", "vllm:kvlease_leases_renewed_total") > renewed0
    stock_text, stock_future = answers["p_stock"]
    stock = stock_future.result(timeout=900)
    print(f"\noverload: kvlease queued {queued:.1f} s > lease {LEASE} s, served from the transferred KV; "
          f"stock: HTTP {stock['status']}, reference text: {stock['text'] == fleet.reference[stock_text]}")  # fmt: skip
    for filler in fillers:
        filler.result(timeout=900)


def test_stale_read_stock_serves_wrong_text_kvlease_never(fleet: Fleet) -> None:
    """The production failure: D's request waits in its queue, every D process stalls past the
    lease, P frees the blocks and other requests reuse them, D resumes and READs. Stock vLLM
    serves the other requests' KV as the victim's (HTTP 200, wrong text); kvlease sees the lease
    lost (or the READ stale), reports a failed load and vLLM recomputes: the reference text."""
    fillers = fleet.fill("d_kv", LEASE) + fleet.fill("d_stock", LEASE)
    pd.wait_until(
        lambda: all(fleet.metric(d, "vllm:num_requests_running") >= D_SEQS for d in ("d_kv", "d_stock")),
        120,
        "D's slots filled",
    )
    usage0 = {p: fleet.metric(p, "vllm:kv_cache_usage_perc") for p in ("p_kv", "p_stock")}
    victims = {}
    for p, d in (("p_kv", "d_kv"), ("p_stock", "d_stock")):
        text = prompt("stale", f"{p}->{d}")
        victims[p] = (text, fleet.complete(p, d, text))
    pd.wait_until(lambda: waiting(fleet, "d_kv") and waiting(fleet, "d_stock"), 120, "the victims in D's queues")
    lost0 = fleet.metric("d_kv", "vllm:kvlease_leases_lost_total") + fleet.metric(
        "d_kv", "vllm:kvlease_stale_reads_caught_total"
    )
    assert fleet.client is not None
    with pd.frozen(fleet.servers["d_kv"], fleet.servers["d_stock"]):
        time.sleep(LEASE + 3)
        # Other requests through each P: its engine steps (stock's reaper runs then) and their
        # prompts take every block of P's small cache, the victim's freed ones included.
        others = [
            fleet.client.submit(f"{fleet.servers[p].url}/v1", f"other {i} " + "tokens " * 300, 1)
            for p in ("p_kv", "p_stock")
            for i in range(10)
        ]
        for other in others:
            assert other.result(timeout=600)["status"] == 200
    freed = {p: fleet.metric(p, "vllm:kv_cache_usage_perc") <= usage0[p] for p in usage0}
    kv_text, kv_future = victims["p_kv"]
    kv = kv_future.result(timeout=900)
    stock_text, stock_future = victims["p_stock"]
    stock = stock_future.result(timeout=900)
    stock_ref, kv_ref = fleet.reference[stock_text], fleet.reference[kv_text]
    print(f"\nstale read: stock HTTP {stock['status']} text {stock['text']!r} (reference {stock_ref!r});")
    print(f"stale read: kvlease HTTP {kv['status']} text {kv['text']!r} (reference {kv_ref!r})")
    # kvlease: the reference text or a clean error, never another request's KV.
    assert (kv["status"] == 200 and kv["text"] == kv_ref) or kv["status"] >= 400, kv
    lost = fleet.metric("d_kv", "vllm:kvlease_leases_lost_total") + fleet.metric(
        "d_kv", "vllm:kvlease_stale_reads_caught_total"
    )
    assert lost > lost0, "kvlease's decoder did not see the lease end"
    d_log = fleet.servers["d_kv"].log()
    assert "its lease was lost" in d_log or "is not valid" in d_log
    # The baseline: stock serves wrong text with 200. If it does not, say why (never pass silently).
    assert stock["status"] == 200, stock
    if stock["text"] == stock_ref:
        pytest.fail(
            "the stock baseline did not reproduce: stock served the reference text "
            f"(P freed the victim's blocks: {freed['p_stock']}; the other requests may not have reused them)"
        )
    for filler in fillers:
        filler.result(timeout=900)


def test_decoder_killed_frees_producer_blocks_within_the_lease(fleet: Fleet) -> None:
    """D SIGKILLed while its request waits in its queue: P's KV usage back to where it was within
    the lease bound (kvlease: no heartbeat renews it, and the pump runs the expiry even though
    P's engine has nothing else to do). Stock's figure is printed beside it. Kills the decoders:
    the module's last test."""
    fillers = fleet.fill("d_kv", LEASE) + fleet.fill("d_stock", LEASE)
    pd.wait_until(
        lambda: all(fleet.metric(d, "vllm:num_requests_running") >= D_SEQS for d in ("d_kv", "d_stock")),
        120,
        "D's slots filled",
    )
    usage0 = {p: fleet.metric(p, "vllm:kv_cache_usage_perc") for p in ("p_kv", "p_stock")}
    victims = [
        fleet.complete(p, d, prompt("killed", f"{p}->{d}")) for p, d in (("p_kv", "d_kv"), ("p_stock", "d_stock"))
    ]
    pd.wait_until(lambda: waiting(fleet, "d_kv") and waiting(fleet, "d_stock"), 120, "the victims in D's queues")
    assert all(fleet.metric(p, "vllm:kv_cache_usage_perc") > usage0[p] for p in usage0), "P holds no blocks"
    killed_at = time.monotonic()
    fleet.servers["d_kv"].kill()
    fleet.servers["d_stock"].kill()
    freed_after: dict[str, float | None] = dict.fromkeys(usage0)
    deadline = killed_at + 3 * LEASE + 10
    while time.monotonic() < deadline and None in freed_after.values():
        for p in usage0:
            if freed_after[p] is None and fleet.metric(p, "vllm:kv_cache_usage_perc") <= usage0[p]:
                freed_after[p] = time.monotonic() - killed_at
        time.sleep(0.25)
    print(f"\nD killed: P's blocks back after kvlease {freed_after['p_kv']} s, stock {freed_after['p_stock']} s "
          f"(lease {LEASE} s; None: not within {3 * LEASE + 10:.0f} s)")  # fmt: skip
    kv_freed = freed_after["p_kv"]
    assert kv_freed is not None, "kvlease's producer still holds the dead decoder's blocks"
    assert kv_freed <= LEASE + 3.0, f"freed {kv_freed:.1f} s after the kill (lease {LEASE} s)"
    for f in [*victims, *fillers]:
        f.result(timeout=60)  # the client sees the dead D's requests end (an error), not a hang
