"""Per-step lease cost on a vLLM prefill worker: the kvlease adapter against vLLM 0.33.0's own.

For 1k / 10k / 100k requests pinned on one prefill worker it runs, on the same load and in one
process, one heartbeat interval (5 s at vLLM's default 30 s lease) of 10 ms worker steps, and
prints the mean CPU time of one step's lease work, in µs, under two loads:

- **every step**: a heartbeat arrives on every step, naming ``N / 500`` requests (every request
  renewed once per interval): the new-request heartbeats of decoders under a steady arrival rate
  (a kvlease accessor heartbeats a newly tracked lease at once), or 500 decoders each holding a
  few of this worker's requests.
- **batched**: each of 8 decoder engines sends one heartbeat per interval naming its share of
  the requests, at evenly spaced steps: how both engines heartbeat between arrivals (vLLM: one
  ``HB:`` per decoder and producer per interval; kvlease: one round per interval, split at the
  message bound).

And the step with nothing to do (no notification). Times are the stepping thread's CPU time
(``time.thread_time``: other processes on a shared machine do not count), each figure the least
mean of 5 intervals (``--repeat``) after one warm-up interval (in which every lease's first
heartbeat binds it to its decoder: once per lease, not the steady state). What runs, on worker objects that hold only
the state these methods use (``object.__new__`` of each worker class: no NIXL agent or KV cache
is needed for this part), over a stub NIXL agent that hands out the step's notifications and
accepts sends:

- **vLLM**: vLLM's own ``NixlPullConnectorWorker._get_new_notifs`` (decode, ``HB:`` test,
  ``_handle_heartbeat``) and ``_reap_expired_send_leases`` (a full scan of ``_reqs_to_send``,
  every step).
- **kvlease adapter**: the adapter's own ``KvleasePullWorker.get_transfer_results`` (under its
  lock, timed into its work counters): its ``_get_new_notifs`` (the agent's notifications fed to
  the transport, through vLLM's ``get_transfer_results`` cut to that part on both sides) and
  ``_kv_transfer_results`` (the driver's step — decode, renew, the acknowledgement sent back,
  the pinner's expiry timer — its events, and the stats report to vLLM), on a driver the adapter
  built itself (``_kv_ensure_driver``), its lease pump not started (the pump's turns do the same
  work between engine steps, on another thread).

It prints figures and asserts nothing but that the work was done (every lease renewed, nothing
dropped). Run (vLLM's environment): ``.venv-vllm/bin/python bench/vllm_adapter.py [--sizes
1000,10000,100000] [--repeat 5] [--max-message-bytes B] [--json]``. Run time: about a minute.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import threading
import time
import uuid
from collections import defaultdict
from typing import Any

try:
    from kvlease.adapters.vllm._metrics import KVLEASE_COUNTERS, KvleaseConnectorStats
    from kvlease.adapters.vllm._settings import read_settings, transfer_bound
    from kvlease.adapters.vllm._transport import ConnectorTransport
    from kvlease.adapters.vllm.connector import KvleasePullWorker
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats
except ImportError as exc:  # one line for a person, not a traceback: where it does run
    sys.exit(
        f"bench/vllm_adapter.py needs vLLM ({exc}): run it in vLLM's environment, "
        "'.venv-vllm/bin/python -m kvlease bench vllm_adapter' (bash dev.sh test creates .venv-vllm)"
    )

from kvlease import Heartbeat, LocalTime, encode, split_ids
from kvlease._codec import heartbeat_id_budget

LEASE = 30.0  # vLLM's default kv_lease_duration
#: The leases both engines hold here: an hour, so that nothing expires however slowly a loaded
#: machine runs the intervals (a step's work does not depend on how far its deadlines are).
HELD = 3600.0
STEP_S = 0.010  # a worker step every 10 ms
STEPS = int(LEASE / 6 / STEP_S)  # one heartbeat interval (5 s) of steps: 500
DECODERS = 8  # the batched load's decoder engines
#: Each figure is the least of this many intervals' means (cache and frequency effects only ever
#: add time), both sides alike; --repeat sets it.
REPEAT = 5
INCARNATION = 7


class _StubAgent:
    """Stands in for the NIXL agent: hands out the notifications queued for this step; sends go
    nowhere (their cost is the transport's, not NIXL's)."""

    def __init__(self) -> None:
        self.inbox: dict[bytes, list[bytes]] = {}
        self.sent = 0

    def get_new_notifs(self) -> dict[bytes, list[bytes]]:
        out, self.inbox = self.inbox, {}
        return out

    def send_notif(self, agent_name: str, notif_msg: bytes = b"") -> None:
        self.sent += 1

    def get_agent_metadata(self) -> bytes:
        return b""


# -- the loads: per step, (decoder index, request indices) of each heartbeat ----------------------


def every_step_load(n: int) -> list[list[tuple[int, range]]]:
    per = max(1, n // STEPS)
    return [[(0, range((s * per) % n, min((s * per) % n + per, n)))] for s in range(STEPS)]


def batched_load(n: int) -> list[list[tuple[int, range]]]:
    steps: list[list[tuple[int, range]]] = [[] for _ in range(STEPS)]
    share = -(-n // DECODERS)
    for d in range(DECODERS):
        steps[d * STEPS // DECODERS].append((d, range(d * share, min((d + 1) * share, n))))
    return steps


LOADS = {"every step": every_step_load, "batched": batched_load}


def _time_steps(agent: _StubAgent, inboxes: list[dict[bytes, list[bytes]]], step: Any) -> float:
    """Mean CPU time of one step over `inboxes` (one step each): the stepping thread's own CPU
    time (``time.thread_time``), so what other processes on a shared machine run does not
    count; handing the stub agent its inbox is the only other work in the loop, both sides."""
    gc.collect()
    t0 = time.thread_time()
    for inbox in inboxes:
        agent.inbox = inbox
        step()
    return (time.thread_time() - t0) / len(inboxes)


# -- vLLM 0.33.0 ----------------------------------------------------------------------------------


def bench_vllm(n: int, load: list[list[tuple[int, range]]], repeat: int = REPEAT) -> tuple[float, float]:
    agent = _StubAgent()
    req_ids = [f"cmpl-{uuid.uuid4().hex}-0" for _ in range(n)]
    w = object.__new__(NixlPullConnectorWorker)
    w.nixl_wrapper = agent
    w.transfer_topo = object()  # only asserted present
    w._reqs_to_send = dict.fromkeys(req_ids, time.perf_counter() + HELD)
    w._reqs_to_process = set(req_ids)
    w._lease_extension = int(HELD) * 2 // 3
    w.consumer_notification_counts_by_req = defaultdict(int)
    w.expected_consumer_notifications_by_req = {}
    w.xfer_stats = NixlKVConnectorStats()
    inboxes: list[dict[bytes, list[bytes]]] = []
    for step in load:
        inbox: dict[bytes, list[bytes]] = {}
        for d, ids in step:
            inbox.setdefault(f"agent-D{d}".encode(), []).append(("HB:" + ",".join(req_ids[i] for i in ids)).encode())
        inboxes.append(inbox)

    def step() -> None:
        done = NixlPullConnectorWorker._get_new_notifs(w)
        w._reap_expired_send_leases(done)
        res = KVConnectorTransferResults(finished_sending=done)  # as get_transfer_results returns
        assert not res.finished_sending

    _time_steps(agent, inboxes, step)  # the warm-up interval, as on the adapter's side
    busy = min(_time_steps(agent, inboxes, step) for _ in range(repeat))
    idle = min(_time_steps(agent, [{} for _ in range(STEPS)], step) for _ in range(repeat))
    return busy, idle


# -- the kvlease adapter ----------------------------------------------------------------------------


def _vllm_results(self: Any) -> Any:
    """vLLM's ``get_transfer_results`` as the adapter's calls it (``super()``), cut to what the
    vLLM side of this bench runs too: the notifications, into the step's result object (its
    poll of the transfers in flight, none here, is the same work on both sides)."""
    return KVConnectorTransferResults(finished_sending=self._get_new_notifs())


def bench_kvlease(
    n: int, load: list[list[tuple[int, range]]], repeat: int = REPEAT, max_message_bytes: int | None = None
) -> tuple[float, float]:
    NixlPullConnectorWorker.get_transfer_results = _vllm_results  # for the adapter's super() only
    agent = _StubAgent()
    extra: dict[str, Any] = {"kv_lease_duration": HELD}
    if max_message_bytes is not None:
        extra["max_message_bytes"] = max_message_bytes  # both sides' (decoders split by it too)
    settings = read_settings(extra)
    w = object.__new__(KvleasePullWorker)
    w.nixl_wrapper = agent
    w.kvlease_settings = settings
    w.kvlease_bound = transfer_bound(settings, 1 << 21)
    w.engine_id, w.transfer_tp_rank, w.transfer_tp_size = "P", 0, 1
    w._kv_pinner_role, w._kv_accessor_role = True, False
    w.kvlease_driver = None
    w.kvlease_transport = transport = ConnectorTransport(agent, "P", 0, {}, lambda engine: None)
    w.xfer_stats = KvleaseConnectorStats()
    w._kv_counted = dict.fromkeys(KVLEASE_COUNTERS, 0)
    w._kv_reading, w._kv_verdict, w._kv_failed, w._kv_lost = set(), set(), set(), set()
    w._kv_granted, w._reqs_to_process, w._kv_tickets = set(), set(), {}
    w._kv_lock, w._kv_events, w._kv_unframed, w._kv_work_ns, w._kv_turns = threading.RLock(), [], 0, 0, 0
    # No lease pump: its turns between engine steps do this same work (drain, driver step) on
    # another thread; here every turn is an engine step's, so all of the work is measured.
    w._kv_driver_ready = lambda: None
    driver = w._kv_ensure_driver(INCARNATION)
    # Each decoder's agent, as a completed kvlease handshake leaves it (the hello path is tested
    # in tests/test_vllm_adapter.py; here only the per-step cost is measured).
    for d in range(DECODERS):
        transport._peers[(f"D{d}", 0)] = f"agent-D{d}"
        transport._peer_of[f"agent-D{d}"] = (f"D{d}", 0)
    for i in range(n):
        key = f"cmpl-{uuid.uuid4().hex}-0"
        driver.grant(key, lease_id=i + 1)  # as start_load_kv grants the scheduler's lease ids
        w._kv_granted.add(key)
        w._reqs_to_process.add(key)
    seqs = [0] * DECODERS

    def interval() -> list[dict[bytes, list[bytes]]]:
        """One interval of the decoders' heartbeats, as they send them (each a newer round)."""
        inboxes: list[dict[bytes, list[bytes]]] = []
        for step in load:
            inbox: dict[bytes, list[bytes]] = {}
            for d, ids in step:
                engine = f"D{d}"
                budget = heartbeat_id_budget(settings.lease.max_message_bytes, engine, "P")
                for chunk in split_ids([i + 1 for i in ids], budget):
                    seqs[d] += 1
                    hb = Heartbeat(engine, 0, 1, 0xD0 + d, INCARNATION, seqs[d], LocalTime(time.monotonic()), chunk)
                    inbox.setdefault(f"agent-{engine}".encode(), []).append(encode(hb))
            inboxes.append(inbox)
        return inboxes

    def step() -> None:
        res = w.get_transfer_results()  # the adapter's, over vLLM's (stubbed: `_VllmResults`)
        assert not res.finished_sending

    # The first interval is not counted: each lease's first heartbeat binds it to its accessor
    # (once per lease, a cheaper path than the later renewals'), so steady state is measured.
    _time_steps(agent, interval(), step)
    busy = float("inf")
    for _ in range(repeat):
        inboxes, sent = interval(), agent.sent
        busy = min(busy, _time_steps(agent, inboxes, step))
        assert agent.sent - sent == sum(len(v) for inbox in inboxes for v in inbox.values())  # one ack each
    stats = driver.stats
    assert stats.leases_renewed >= (repeat + 1) * n and stats.malformed_messages == stats.rejected_messages == 0, stats
    idle = min(_time_steps(agent, [{} for _ in range(STEPS)], step) for _ in range(repeat))
    return busy, idle


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeat", type=int, default=REPEAT, help="intervals per figure, the least mean kept")
    ap.add_argument(
        "--max-message-bytes",
        type=int,
        default=None,
        help="kvlease's max_message_bytes on both sides (default: the protocol's, 1024)",
    )
    args = ap.parse_args()
    repeat = max(1, args.repeat)
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        row: dict[str, Any] = {"pinned": n}
        for name, make in LOADS.items():
            load = make(n)
            vb, vi = bench_vllm(n, load, repeat)
            kb, ki = bench_kvlease(n, load, repeat, args.max_message_bytes)
            row[name] = {"vllm_us": vb * 1e6, "kvlease_us": kb * 1e6}
        row["idle"] = {"vllm_us": vi * 1e6, "kvlease_us": ki * 1e6}
        rows.append(row)
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        return
    print(
        f"per-step lease cost on a prefill worker, µs: {STEPS} steps (one {LEASE / 6:.0f} s heartbeat interval "
        f"at {STEP_S * 1e3:.0f} ms/step); every step: a heartbeat on each step; batched: {DECODERS} decoders, "
        "one heartbeat each per interval"
    )
    print(
        "| pinned requests | every step: vLLM | every step: kvlease | vLLM / kvlease "
        "| batched: vLLM | batched: kvlease | vLLM / kvlease | idle: vLLM | idle: kvlease |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        cells = [f"{r['pinned']:,}"]
        for name in LOADS:
            v, k = r[name]["vllm_us"], r[name]["kvlease_us"]
            cells += [f"{v:.1f}", f"{k:.1f}", f"{v / k:.1f}x"]
        cells += [f"{r['idle']['vllm_us']:.1f}", f"{r['idle']['kvlease_us']:.1f}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
