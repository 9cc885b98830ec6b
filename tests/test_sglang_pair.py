"""Real SGLang 0.5.23 prefill/decode pairs, stock and with the kvlease plugin, side by side: two
``sglang.launch_server`` processes each (real CPU forwards of a tiny random-weight Llama, KV over
NIXL on loopback in host memory) and SGLang's router in front, as
``../shared/engines/SGLANG-SERVE-ON-CPU.md`` runs them, with the project's own shims
(``engines/sglang/shims``: the host-memory plugin, alone for stock and beside kvlease's; the
``sgl_kernel`` stand-in; the torchvision stand-in is in ``.venv-sglang``). tests/_sglang_serve.py
starts them.

Both pairs start once for the module (start-up is most of its cost): the plugin loads beside the
shim; OpenAI completions (the ``openai`` library) through each router, every text the same as a
``transformers`` run's and the same on both pairs; kvlease's figures in SGLang's own ``/metrics``;
and a request no decode ever admits, which stock SGLang holds for
``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` (300 s: shown still held after the plugin's bound)
and the plugin fails at its source lease's duration ``d``. Then three faults while P's WRITE into
the decode's pages is held in flight (the test-only straggler plugin, tests/sglang_straggler):
D aborts the request (D must keep the pages until the WRITE landed), D is SIGKILLed (how long P
keeps the request's KV; D is started again after), P is SIGKILLed (when D lets the pages go).

Cost: about 5 minutes on a 2-core machine (2026-12-07: start-up of both pairs together 92 s, the
decodes' restart 30 s, the model made once into ``build/``; 11-12 minutes before the idle servers
stopped spinning, docs/sglang.md).
``KVLEASE_SGLANG_PAIR=0`` skips the module.
"""

from __future__ import annotations

import json
import os
import random
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai_serving as serving
import pytest
from _sglang_helpers import SGLANG_PY
from _sglang_serve import MODEL, Pair, http, metric, need_pair_env, wait_until

pytestmark = pytest.mark.slow

D_LEASE = 6.0  # the plugin's lease duration here: I = 1 s, E = 4 s
SLACK = 3.0


#: The completions both pairs serve (token budgets under the prompt's), and their length.
PROMPTS = ["def hello(name):", "import os", "class A:\n    def __init__(self):" * 8, "x = 1", "return x"]
TOKENS = 12


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Pair]]:
    """The stock pair and the plugin's, started together; each kind's P, D and router."""
    if os.environ.get("KVLEASE_SGLANG_PAIR", "1") == "0":
        pytest.skip("KVLEASE_SGLANG_PAIR=0: the real SGLang pairs (2-3 minutes, more under load) are skipped")
    need_pair_env()
    tmp = tmp_path_factory.mktemp("sglang-pairs")
    env = {"SGLANG_KVLEASE_LEASE_DURATION": str(D_LEASE)}
    both = {kind: Pair(tmp, kind, env=env, straggle=tmp / f"{kind}-straggle") for kind in ("stock", "kvlease")}
    try:
        for p in both.values():
            p.start()
        for p in both.values():
            p.route()
            print(
                f"\nreal SGLang pair ({p.kind}): P and D healthy after {p.t_servers:.0f}s, "
                f"serving through the router after {p.t_ready:.0f}s"
            )
        yield both
    finally:
        for p in both.values():
            p.close()


@pytest.fixture(scope="module")
def pair(pairs: dict[str, Pair]) -> Pair:
    return pairs["kvlease"]


@pytest.fixture(scope="module")
def reference() -> dict[str, serving.Reference]:
    """Each prompt's greedy completion by ``transformers`` alone (SGLang's environment)."""
    need_pair_env()
    return serving.reference_texts(PROMPTS, TOKENS, python=SGLANG_PY, model=MODEL)


def test_the_plugin_starts_beside_the_host_memory_shim(pair: Pair) -> None:
    for server, role in ((pair.p, "prefill"), (pair.d, "decode")):
        log = server.log()
        assert "cpu_dram_kv: NIXL KV buffers registered as DRAM" in log, log[-3000:]
        assert re.search(rf"\] kvlease: {role} rank sglang:\S+ leases on \(d=6s", log), log[-3000:]


def test_completions_through_each_router_are_the_reference_text(
    pairs: dict[str, Pair], reference: dict[str, serving.Reference]
) -> None:
    """OpenAI completions (the ``openai`` library, as a user's) through SGLang's router, several
    at once: stock SGLang and SGLang with the plugin each return what ``transformers`` computes
    for the prompt (greedy, EOS ignored), the KV having come from P (D ran no prefill)."""
    client = serving.Client(python=SGLANG_PY)
    try:
        for kind, p in pairs.items():
            futures = {
                prompt: client.submit(f"{p.r_url}/v1", prompt, TOKENS, extra_body={"ignore_eos": True})
                for prompt in PROMPTS
            }
            answers = {prompt: f.result(timeout=300) for prompt, f in futures.items()}
            for prompt, answer in answers.items():
                assert answer["status"] == 200, (kind, prompt, answer)
                assert answer["text"] == reference[prompt].text, (kind, prompt, answer["text"], reference[prompt].text)
            assert "Prefill batch" not in p.d.log(), f"{kind}: D computed a prefill itself: its KV did not come from P"
    finally:
        client.close()


def test_the_leases_show_in_sglangs_metrics(pair: Pair) -> None:
    """kvlease's counters in SGLang's own ``/metrics``, around one completion: its WRITE went
    under the gate and its destination lease ended on the access-done. Counted as differences:
    a lease of an earlier test that ended otherwise (CI, 2026-12-06: five leases of the concurrent
    completions expired after their rooms had succeeded, on a machine loaded enough to stall the
    prefill's access-done past E) is not this completion's."""
    time.sleep(1.5)  # the mirror writes at most once a second
    p0 = http("GET", f"{pair.p_url}/metrics")[1]
    d0 = http("GET", f"{pair.d_url}/metrics")[1]
    assert pair.complete("return x", 4)[0] == 200
    time.sleep(1.5)
    p_text = http("GET", f"{pair.p_url}/metrics")[1]
    d_text = http("GET", f"{pair.d_url}/metrics")[1]

    def grew(text: str, before: str, name: str) -> float:
        return metric(text, name) - metric(before, name)

    why = "\n".join(line for line in (pair.p.log() + pair.d.log()).splitlines() if "kvlease" in line)[-3000:]
    if metric(d0, "kvlease_leases_expired_total"):
        print(
            f"\nD's destination leases expired before this test: {metric(d0, 'kvlease_leases_expired_total'):g}\n{why}"
        )
    assert grew(p_text, p0, "kvlease_sglang_accesses_total") >= 1, p_text[-3000:]
    assert grew(p_text, p0, "kvlease_sglang_writes_refused_total") == 0, why
    assert grew(d_text, d0, "kvlease_leases_completed_total") >= 1, d_text[-3000:]  # ended by the access-done
    assert grew(d_text, d0, "kvlease_leases_expired_total") == 0, why


def _orphan(p: Pair, room: int, timeout: float) -> tuple[float, int, str]:
    """A request sent to P alone, with bootstrap parameters no decode will ever pick up: seconds
    until P answered (or `timeout` passed: status 0), status, body."""
    body = {
        "text": "def orphan():",
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": p.bootstrap_port,
        "bootstrap_room": room,
    }
    t0 = time.time()
    status, text = http("POST", f"{p.p_url}/generate", body, timeout=timeout)
    return time.time() - t0, status, text


def test_a_request_no_decode_admits_fails_at_its_lease_not_at_300s(pairs: dict[str, Pair]) -> None:
    """Stock SGLang keeps such a request (and its KV) for ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``,
    300 s: the baseline, shown still unanswered well after the plugin's bound. With the plugin,
    the source lease nobody renews fails it at d."""
    bound = D_LEASE + SLACK + 5
    with ThreadPoolExecutor(2) as pool:
        stock = pool.submit(_orphan, pairs["stock"], random.getrandbits(62), bound + 10)
        room = random.getrandbits(62)
        elapsed, status, text = _orphan(pairs["kvlease"], room, D_LEASE + 60)
        stock_elapsed, stock_status, _ = stock.result()
    wait_until(
        "P's failure record",
        lambda: f"room {room} fails: kvlease: source-page lease expired" in pairs["kvlease"].p.log(),
        10,
        [],
    )
    assert elapsed <= bound, f"the orphan request took {elapsed:.1f}s ({status}: {text[:300]})"
    assert stock_status == 0, f"stock SGLang answered its orphan after {stock_elapsed:.1f}s ({stock_status})"
    print(
        f"\na request no decode admits: kvlease ended it after {elapsed:.1f}s (d = {D_LEASE:g}s); "
        f"stock SGLang still held it after {stock_elapsed:.1f}s (its bootstrap timeout: 300 s)"
    )


def _deferred_releases(d_url: str) -> dict[str, float]:
    """SGLang's count of the decode's deferred KV releases, by outcome."""
    text = http("GET", f"{d_url}/metrics", timeout=10)[1]
    out: dict[str, float] = {}
    for outcome in ("drained", "timeout", "error"):
        out[outcome] = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("sglang:decode_deferred_kv_release_total{") and f'outcome="{outcome}"' in line
        )
    return out


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except OSError:
        return []


Seen = dict[str, float | str]


def _send_with_write_held(p: Pair, client: serving.Client, prompt: str, hold: float) -> Future[dict[str, Any]]:
    """A completion through `p`'s router whose WRITE into D's pages P holds `hold` seconds (the
    straggler plugin; only that WRITE: the next ones go at once), once that WRITE is held."""
    folder = p.straggle
    assert folder is not None
    held0 = len(_lines(folder / "held"))
    (folder / "arm").write_text(f"{hold:g}")
    try:
        answer = client.submit(f"{p.r_url}/v1", prompt, TOKENS, extra_body={"ignore_eos": True})
        wait_until(f"{p.kind}: P's WRITE held", lambda: len(_lines(folder / "held")) > held0, 120, p.servers)
    finally:
        (folder / "arm").unlink()
    return answer


def _watch(
    answer: Future[dict[str, Any]], t0: float, within: float, wanted: set[str], probe: Callable[[Seen], None]
) -> Seen:
    """Until `within` after `t0` or every key of `wanted` is seen: the answer (``answered``, its
    ``status``) and what `probe` adds, each in seconds after `t0`."""
    seen: Seen = {}
    while time.time() < t0 + within and not wanted <= seen.keys():
        if "answered" not in seen and answer.done():
            seen["answered"] = time.time() - t0
            seen["status"] = answer.result()["status"]
        probe(seen)
        time.sleep(0.1)
    return seen


#: D's log line naming the room of the request SGLang aborted, and of the first room failed
#: after its prefill died: by the plugin (its destination lease expired), or first by SGLang's
#: own heartbeat check of the prefill (``Lost connection with prefill instance``; then the
#: plugin's expiry finds the room concluded, or D's release of it waits for the lease's end and
#: only that line names the room: seen with SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL=2, and in
#: CI). The router's retry of the request never reaches a destination lease (its handshake with
#: the dead prefill fails).
ABORTED_ROOM = re.compile(r"bootstrap_room=(\d+) with exception KVTransferError\(.*\): Aborted by AbortReq")
FAILED_ROOM = re.compile(r"kvlease: room (\d+)(?: fails: |, already concluded \(|: destination pages released after )")
#: D's log lines that say what became of a room after its prefill died.
WHY = re.compile(r"kvlease|Lost connection with prefill|bootstrap_room=")


def _released(p: Pair, t0: float, room_line: re.Pattern[str]) -> Callable[[Seen], None]:
    """A `_watch` probe: D's deferred release of the fault's room resolved (``released``,
    ``outcome``). The plugin's pair: the room of D's first `room_line` after `t0`, released when
    the plugin says so for that room: the router retries a failed request, and the retry's room
    may fail and be released first (seen in CI: P's transfer worker, awaiting the held WRITE,
    left the retry's lease to lapse). Stock's: any deferred release SGLang counts (printed only)."""
    before = _deferred_releases(p.d_url)
    log0 = len(p.d.log())

    def probe(seen: Seen) -> None:
        if "released" in seen:
            return
        if p.kind == "kvlease":
            log = p.d.log()[log0:]
            if "room" not in seen and (m := room_line.search(log)):
                seen["room"] = m.group(1)
            released = rf"kvlease: room {seen.get('room')}: destination .* after ([^\n]+)"
            if "room" in seen and (m := re.search(released, log)):
                seen["released"] = time.time() - t0
                seen["outcome"] = "drained" if "drain" in m.group(1) else "lease end"
            return
        now = _deferred_releases(p.d_url)
        gained = [k for k in now if now[k] > before[k]]
        if gained:
            seen["released"] = time.time() - t0
            seen["outcome"] = gained[0]

    return probe


def _on_both(pairs: dict[str, Pair], fault: Callable[[Pair, serving.Client], Seen]) -> dict[str, Seen]:
    """`fault` on each pair at once (one OpenAI client between them): what each saw."""
    client = serving.Client(python=SGLANG_PY)
    try:
        with ThreadPoolExecutor(len(pairs)) as pool:
            futures = {kind: pool.submit(fault, p, client) for kind, p in pairs.items()}
            return {kind: f.result() for kind, f in futures.items()}
    finally:
        client.close()


def _abort_decode_mid_write(p: Pair, client: serving.Client, hold: float, within: float) -> Seen:
    """Abort every request on D (SGLang's ``/abort_request``) while P holds the WRITE of one;
    watch D until it let the request's pages go (a deferred release resolved) and P's held WRITE
    until it was posted (it lands a moment later): seconds after the abort of each."""
    folder = p.straggle
    assert folder is not None
    posted0 = len(_lines(folder / "posted"))
    answer = _send_with_write_held(p, client, "def aborted(x):", hold)
    time.sleep(0.3)
    t_abort = time.time()
    released = _released(p, t_abort, ABORTED_ROOM)  # counted from before the abort
    status, body = http("POST", f"{p.d_url}/abort_request", {"abort_all": True}, timeout=30)
    assert status == 200, f"{p.kind}: D's /abort_request answered {status}: {body[:300]}"

    def probe(seen: Seen) -> None:
        released(seen)
        posted = _lines(folder / "posted")
        if "posted" not in seen and len(posted) > posted0:
            seen["posted"] = float(posted[posted0].split()[0]) - t_abort

    return _watch(answer, t_abort, within, {"released", "posted", "answered"}, probe)


def test_decode_aborts_mid_write(pairs: dict[str, Pair]) -> None:
    """D aborts a request while P's WRITE into its pages is held in flight longer than the
    lease's expiry plus the push guard (E + G = 6 s here; the WRITE is posted 12 s late, within
    SGLang's 30 s deferred-release timeout). D must keep the pages until the WRITE has landed:
    polled every 0.1 s, D's deferred release may resolve only after the WRITE was posted. Stock
    SGLang waits for P's drain ACK; the plugin (before issue 23's drain rule) let them go at
    expiry + G, 6 s before the WRITE landed."""
    hold = 12.0
    seen = _on_both(pairs, lambda p, client: _abort_decode_mid_write(p, client, hold, 90.0))
    print(f"\ndecode aborted mid-WRITE (held {hold:g} s), seconds after the abort: {seen}")
    for kind, got in seen.items():
        p = pairs[kind]
        why = f"{kind}: {got}\n{p.d.log()[-2000:]}"
        assert "posted" in got, f"the held WRITE was never posted: {why}"
        if kind == "stock":
            continue  # the baseline, printed: SGLang's own drain ACK
        assert "released" in got, f"D never let the aborted request's pages go: {why}"
        assert float(got["released"]) >= float(got["posted"]), f"D let its pages go before the WRITE landed: {why}"
        assert got["outcome"] == "drained", why
    # The pairs still serve afterwards: the straggling WRITE left nothing behind.
    for kind, p in pairs.items():
        assert p.complete("x = 1", 4)[0] == 200, kind


def _inflight(p_url: str) -> int:
    """P's requests whose KV it still holds for a transfer: the length of SGLang's inflight queue
    now, from ``/v1/loads`` (the scheduler counts its queue when asked). Not the
    ``sglang:num_prefill_inflight_queue_reqs`` gauge: SGLang refreshes it after a batch, and when
    idle only every 30 s, so a room failed between batches showed up late (a CI run read 9.2 s for
    a room the lease failed within its bound)."""
    status, body = http("GET", f"{p_url}/v1/loads?include=disagg", timeout=10)
    assert status == 200, f"P's /v1/loads answered {status}: {body[:300]}"
    return sum(int(load["disaggregation"]["prefill_inflight_queue_reqs"]) for load in json.loads(body)["loads"])


def _kill_decode_mid_write(p: Pair, client: serving.Client, hold: float, within: float) -> Seen:
    """SIGKILL D while P holds the WRITE of one request, and watch P until its inflight queue
    (the requests whose KV it holds for a transfer) is empty again: seconds after the kill."""
    answer = _send_with_write_held(p, client, "def orphaned(x):", hold)
    wait_until(f"{p.kind}: P's request in its inflight queue", lambda: _inflight(p.p_url) > 0, 30, p.servers)
    t_kill = time.time()
    p.d.kill()

    def freed(seen: Seen) -> None:
        if "freed" not in seen and _inflight(p.p_url) == 0:
            seen["freed"] = time.time() - t_kill

    return _watch(answer, t_kill, within, {"freed", "answered"}, freed)


def test_decode_sigkilled_mid_write(pairs: dict[str, Pair]) -> None:
    """D dies while P's WRITE into its pages is held in flight (the straggler plugin holds it
    `hold` s; D's process group SIGKILLed): how long P keeps the request's KV. With the plugin,
    P's source lease, which D no longer renews, expires and fails the room: within E + I of the
    kill. Stock SGLang waits on the WRITE: at least until it is posted (then UCX reports the dead
    peer, or not). D is started again afterwards, on the same ports, for the next test."""
    hold = 20.0
    seen = _on_both(pairs, lambda p, client: _kill_decode_mid_write(p, client, hold, 45.0))
    for p in pairs.values():
        p.respawn_decode()  # from this thread: D dies with the thread that starts it
    with ThreadPoolExecutor(len(pairs)) as pool:
        restarts = {kind: pool.submit(p.wait_decode) for kind, p in pairs.items()}
        took = {kind: f.result() for kind, f in restarts.items()}
    print(f"\ndecode SIGKILLed mid-WRITE (held {hold:g} s), seconds after the kill: {seen}; D restarted in {took}")
    mine = seen["kvlease"]
    p_log = "\n".join(line for line in pairs["kvlease"].p.log().splitlines() if "kvlease" in line)[-2000:]
    assert "freed" in mine, f"kvlease: P never let the dead decode's request go: {mine}\n{p_log}"
    bound = D_LEASE * 2 / 3 + D_LEASE / 6  # E + I: a dead decode's source lease fails its room
    assert float(mine["freed"]) <= bound + SLACK, f"{mine}: bound E + I = {bound:.1f} s\n{p_log}"
    assert mine.get("status") != 200, f"kvlease: a request whose decode died was answered 200: {mine}"


def _kill_prefill_mid_write(p: Pair, client: serving.Client, within: float) -> Seen:
    """SIGKILL P while it holds the WRITE of one request (to land 10 minutes late: never, here),
    and watch D until it let the request's pages go (a deferred release resolved, or none was
    needed and the request ended): seconds after the kill of each thing seen."""
    answer = _send_with_write_held(p, client, "def victim(x):", 600.0)
    time.sleep(0.5)
    t_kill = time.time()
    released = _released(p, t_kill, FAILED_ROOM)
    p.p.kill()
    seen = _watch(answer, t_kill, within, {"released", "answered"}, released)
    assert http("GET", f"{p.d_url}/health", timeout=10)[0] == 200, f"{p.kind}: D died with its prefill"
    return seen


def test_prefill_sigkilled_mid_write(pairs: dict[str, Pair]) -> None:
    """P dies while its WRITE into D's pages is in flight (held by the straggler plugin; P's
    process group SIGKILLed). With the plugin, D's destination lease, which P no longer renews,
    ends at its expiry plus the push guard, and SGLang's deferred release lets the pages go on
    it: within E + I + G of the kill. Stock SGLang waits for a drain acknowledgement a dead prefill
    never sends, until its deferred-release timeout (30 s) after it noticed the failure."""
    seen = _on_both(pairs, lambda p, client: _kill_prefill_mid_write(p, client, 120.0))
    print(f"\nprefill SIGKILLed mid-WRITE, seconds after the kill: {seen}")
    mine = seen["kvlease"]
    d_log = "\n".join(line for line in pairs["kvlease"].d.log().splitlines() if WHY.search(line))[-4000:]
    assert "released" in mine, f"kvlease: D never let the dead prefill's pages go: {mine}\n{d_log}"
    # A dead prefill's pages come back within E + I + G of its last heartbeat (docs/sglang.md):
    # E = 2d/3, I = d/6, G = A (1 + rho) at the plugin's default A = 2 s.
    bound = D_LEASE * 2 / 3 + D_LEASE / 6 + 2.0 * (1 + 1e-4)
    assert float(mine["released"]) <= bound + SLACK, f"{mine}: bound E + I + G = {bound:.1f} s"
    assert mine.get("status") != 200, f"kvlease: a request whose KV never came was answered 200: {mine}"
