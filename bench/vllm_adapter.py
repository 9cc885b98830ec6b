"""Per-step lease cost on a vLLM prefill worker: the kvlease adapter against vLLM 0.33.0's own.

For 1k / 10k / 100k pinned requests it runs, on the same load and in one process, one heartbeat
interval of worker steps with heartbeats arriving, spread over the interval as a decoder's
queue sends them (each step receives the heartbeat of ``N / steps`` requests; every request is
renewed once per interval), and prints the mean cost of one step's lease work:

- **vLLM**: the notification loop of ``NixlPullConnectorWorker._get_new_notifs`` for ``HB:``
  notifications (decode, prefix test) calling vLLM's own ``_handle_heartbeat``, then vLLM's own
  ``_reap_expired_send_leases`` (a full scan of ``_reqs_to_send``, every step). vLLM's methods
  are called on a worker object that holds only the state they use (``object.__new__`` of
  vLLM's worker class: no NIXL agent or KV cache is needed for this part).
- **kvlease adapter**: what the adapter's worker does with the same heartbeats each step —
  `ConnectorTransport.feed` of the kvlease frames (the accessor's batched heartbeats, split to
  the message bound as it sends them), then `Driver.step()` (decode, renew, the acknowledgement
  sent back through the transport, the pinner's expiry timer) — over a stub NIXL agent that
  accepts sends and does nothing else.

Also the idle step (no heartbeat arriving). It prints figures and asserts nothing.
Run (vLLM's environment): ``.venv-vllm/bin/python bench/vllm_adapter.py [--sizes 1000,10000,100000]``.
Run time: about 30 s.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import uuid
from collections import defaultdict
from typing import Any

try:
    from kvlease.adapters.vllm._transport import ConnectorTransport
    from kvlease.transports import Driver
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats
except ImportError as exc:  # one line for a person, not a traceback: where it does run
    sys.exit(
        f"bench/vllm_adapter.py needs vLLM ({exc}): run it in vLLM's environment, "
        "'.venv-vllm/bin/python -m kvlease bench vllm_adapter' (bash dev.sh test creates .venv-vllm)"
    )

from kvlease import Heartbeat, LeaseConfig, LocalTime, Pinner, encode, split_ids
from kvlease._codec import heartbeat_id_budget

LEASE = 30.0  # vLLM's default kv_lease_duration
STEP_S = 0.010  # a worker step every 10 ms
STEPS = int(LEASE / 6 / STEP_S)  # one heartbeat interval (5 s) of steps: 500


class _StubAgent:
    """Stands in for the NIXL agent: sends go nowhere (their cost is the transport's, not NIXL's)."""

    sent = 0

    def send_notif(self, agent_name: str, notif_msg: bytes = b"") -> None:
        self.sent += 1

    def get_agent_metadata(self) -> bytes:
        return b""


def _vllm_worker(req_ids: list[str], now: float) -> Any:
    w = object.__new__(NixlBaseConnectorWorker)
    w._reqs_to_send = dict.fromkeys(req_ids, now + LEASE)
    w._reqs_to_process = set(req_ids)
    w._lease_extension = int(LEASE) * 2 // 3
    w.consumer_notification_counts_by_req = defaultdict(int)
    w.expected_consumer_notifications_by_req = {}
    w.xfer_stats = NixlKVConnectorStats()
    return w


def bench_vllm(n: int) -> tuple[float, float]:
    req_ids = [f"cmpl-{uuid.uuid4().hex}-0" for _ in range(n)]
    w = _vllm_worker(req_ids, time.perf_counter())
    per = max(1, n // STEPS)
    notifs = [("HB:" + ",".join(req_ids[(s * per) % n : (s * per) % n + per])).encode() for s in range(STEPS)]
    handle, reap = NixlBaseConnectorWorker._handle_heartbeat, NixlBaseConnectorWorker._reap_expired_send_leases
    gc.collect()
    t0 = time.perf_counter()
    for notif in notifs:
        # vLLM's _get_new_notifs, for a heartbeat notification:
        msg = notif.decode("utf-8")
        if msg.startswith("HB:"):
            handle(w, msg[3:])
        done: set[str] = set()
        reap(w, done)
        assert not done
    busy = (time.perf_counter() - t0) / STEPS
    t0 = time.perf_counter()
    for _ in range(STEPS):
        done = set()
        reap(w, done)
    idle = (time.perf_counter() - t0) / STEPS
    return busy, idle


def bench_kvlease(n: int) -> tuple[float, float]:
    cfg = LeaseConfig(kv_lease_duration=LEASE, vllm_compat=True)
    agent = _StubAgent()
    transport = ConnectorTransport(agent, "P", 0, {}, lambda engine: None)
    pinner = Pinner(cfg, "P", 7, rank=0, ranks=1)
    driver = Driver(transport, pinner=pinner, vllm_compat=True)
    # The decoder's agent, as a completed kvlease handshake leaves it (the hello path is tested
    # in tests/test_vllm_adapter.py; here only the per-step cost is measured).
    transport._peers[("D", 0)] = "agent-D"
    transport._peer_of["agent-D"] = ("D", 0)
    for i in range(n):
        driver.grant(f"cmpl-{uuid.uuid4().hex}-0", lease_id=i + 1)
    per = max(1, n // STEPS)
    budget = heartbeat_id_budget(cfg.max_message_bytes, "D", "P")
    frames: list[list[bytes]] = []
    seq = 0
    for s in range(STEPS):
        lo = (s * per) % n
        ids = list(range(lo + 1, min(lo + per, n) + 1))
        step: list[bytes] = []
        for chunk in split_ids(ids, budget):
            seq += 1
            step.append(encode(Heartbeat("D", 0, 1, 0xD, 7, seq, LocalTime(time.monotonic()), chunk)))
        frames.append(step)
    gc.collect()
    t0 = time.perf_counter()
    for step in frames:
        for frame in step:
            transport.feed("agent-D", frame)
        events = driver.step()
        assert not events, events
    busy = (time.perf_counter() - t0) / STEPS
    assert driver.stats.leases_renewed >= min(n, STEPS * per) and driver.stats.malformed_messages == 0
    t0 = time.perf_counter()
    for _ in range(STEPS):
        driver.step()
    idle = (time.perf_counter() - t0) / STEPS
    return busy, idle


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        vb, vi = bench_vllm(n)
        kb, ki = bench_kvlease(n)
        rows.append(
            {
                "pinned": n,
                "vllm_busy_us": vb * 1e6,
                "kvlease_busy_us": kb * 1e6,
                "vllm_idle_us": vi * 1e6,
                "kvlease_idle_us": ki * 1e6,
            }
        )
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        return
    print(
        f"per-step lease cost on a prefill worker, {STEPS} steps (one {LEASE / 6:.0f} s heartbeat interval "
        f"at {STEP_S * 1e3:.0f} ms/step), heartbeats spread over the interval"
    )
    print(
        "| pinned requests | vLLM 0.33.0 (µs/step) | kvlease adapter (µs/step) | vLLM / kvlease | "
        "idle step: vLLM | idle step: kvlease |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['pinned']:,} | {r['vllm_busy_us']:.1f} | {r['kvlease_busy_us']:.1f} | "
            f"{r['vllm_busy_us'] / r['kvlease_busy_us']:.1f}x | {r['vllm_idle_us']:.1f} | {r['kvlease_idle_us']:.1f} |"
        )


if __name__ == "__main__":
    main()
