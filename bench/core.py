"""Benchmark of the pure lease core against the straightforward lease table it replaces.

For 1k / 100k / 1M live leases it prints, for kvlease's `Pinner` and for a dict-and-full-scan
table (the approach vLLM's NIXL connector uses: ``{request_id: expiry}``, renewed by request-id
string, reaped by scanning every entry each step), in one run:

- renewals per second (heartbeats handled, counted per lease id renewed),
- grants per second,
- idle per-step cost of ``next_deadline()`` + ``handle_timeout(now)`` when nothing is due,
- bytes of memory per live lease (tracemalloc, request-id strings excluded on both sides),
- heartbeat bytes on the wire per lease id.

Targets (issue 2): idle step flat in the lease count and <= 2 us at 1M, >= 1M renewals/s,
<= 300 B per lease, <= 6 heartbeat bytes per lease id. This is a benchmark: it prints figures,
it asserts nothing. Run: ``.venv/bin/python bench/core.py [--sizes 1000,100000,1000000]``.
Run time: about 2 minutes (``--quick``, i.e. ``--sizes 1000,100000``: about 10 s).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import tracemalloc
import uuid
from collections.abc import Callable

from kvlease import Heartbeat, LeaseConfig, LocalTime, Pinner, encode, split_ids
from kvlease._codec import heartbeat_id_budget


class ScanTable:
    """The baseline: vLLM-style lease table keyed by request-id string, full scan to reap."""

    def __init__(self, duration: float, extension: float) -> None:
        self.expiry: dict[str, float] = {}
        self.duration = duration
        self.extension = extension

    def grant(self, now: float, key: str) -> None:
        self.expiry[key] = now + self.duration

    def heartbeat(self, now: float, keys: list[str]) -> None:
        new = now + self.extension
        table = self.expiry
        for k in keys:
            old = table.get(k)
            if old is not None and new > old:
                table[k] = new

    def step(self, now: float) -> list[str]:
        expired = [k for k, t in self.expiry.items() if t <= now]
        for k in expired:
            del self.expiry[k]
        return expired


def _rate(n_ops: int, fn: Callable[[], None], min_time: float = 0.3) -> float:
    """Operations per second of `fn` (which performs n_ops operations), best of repeats."""
    best = float("inf")
    total = 0.0
    reps = 0
    while total < min_time or reps < 2:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best = min(best, dt)
        total += dt
        reps += 1
        if reps >= 5:
            break
    return n_ops / best


def _keys(n: int) -> list[str]:
    # vLLM request ids look like "cmpl-<uuid hex>-0"
    return [f"cmpl-{uuid.UUID(int=i).hex}-0" for i in range(n)]


def bench_size(n: int, cfg: LeaseConfig) -> dict[str, float]:
    keys = _keys(n)
    res: dict[str, float] = {}

    # -- grants ---------------------------------------------------------------------------
    def grant_kv() -> None:
        p = Pinner(cfg, "prefill-0", incarnation=1)
        for k in keys:
            p.grant(LocalTime(0.0), k)

    def grant_scan() -> None:
        t = ScanTable(cfg.kv_lease_duration, cfg.lease_extension)
        for k in keys:
            t.grant(0.0, k)

    res["grants_kv"] = _rate(n, grant_kv)
    res["grants_scan"] = _rate(n, grant_scan)

    # -- memory per live lease ----------------------------------------------------------------
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    pinner = Pinner(cfg, "prefill-0", incarnation=1)
    for k in keys:
        pinner.grant(LocalTime(0.0), k)
    res["bytes_kv"] = (tracemalloc.get_traced_memory()[0] - base) / n
    tracemalloc.stop()
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    scan = ScanTable(cfg.kv_lease_duration, cfg.lease_extension)
    for k in keys:
        scan.grant(0.0, k)
    res["bytes_scan"] = (tracemalloc.get_traced_memory()[0] - base) / n
    tracemalloc.stop()

    # -- heartbeats: bytes per id and renewals per second ------------------------------------
    ids = sorted(pinner.live_ids())
    budget = heartbeat_id_budget(cfg.max_message_bytes, "decode-0", "prefill-0")
    chunks = split_ids(ids, budget)
    hbs = [Heartbeat("decode-0", 0, 1, 0xD, 1, i, LocalTime(1.0), c) for i, c in enumerate(chunks)]
    res["hb_bytes_kv"] = sum(len(encode(h)) for h in hbs) / n
    res["hb_max_msg_kv"] = max(len(encode(h)) for h in hbs)
    # vLLM: b"HB:" + b",".join(ids), one message per engine per interval (no size bound).
    res["hb_bytes_scan"] = len(b"HB:" + b",".join(k.encode() for k in keys)) / n

    clock = [1.0]

    def renew_kv() -> None:
        clock[0] += 1.0
        now = LocalTime(clock[0])
        for h in hbs:
            pinner.receive(now, h)

    def renew_scan() -> None:
        clock[0] += 1.0
        scan.heartbeat(clock[0], keys)

    res["renewals_kv"] = _rate(n, renew_kv)
    res["renewals_scan"] = _rate(n, renew_scan)

    # -- idle step: nothing due -------------------------------------------------------------
    now = clock[0] + 0.001
    pinner.handle_timeout(LocalTime(now))
    steps = 200_000

    def idle_kv() -> None:
        p = pinner
        t = LocalTime(now)
        for _ in range(steps):
            d = p.next_deadline()
            if d is not None and d <= t:
                p.handle_timeout(t)

    def idle_call_kv() -> None:
        p = pinner
        t = LocalTime(now)
        for _ in range(steps):
            p.next_deadline()
            p.handle_timeout(t)

    scan_steps = max(3, min(steps, 20_000_000 // n))

    def idle_scan() -> None:
        for _ in range(scan_steps):
            scan.step(now)

    res["idle_kv_us"] = 1e6 / _rate(steps, idle_kv)
    res["idle_call_kv_us"] = 1e6 / _rate(steps, idle_call_kv)
    res["idle_scan_us"] = 1e6 / _rate(scan_steps, idle_scan, min_time=0.2)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000,100000,1000000", help="comma-separated live-lease counts")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args(argv)
    cfg = LeaseConfig()
    sizes = [int(s) for s in args.sizes.split(",")]
    results = {n: bench_size(n, cfg) for n in sizes}
    if args.json:
        print(json.dumps({str(k): v for k, v in results.items()}, indent=2))
        return 0
    rows = [
        ("renewals/s (higher is better)", "renewals_kv", "renewals_scan", "{:,.0f}", True),
        ("grants/s", "grants_kv", "grants_scan", "{:,.0f}", True),
        ("idle step: next_deadline + handle_timeout (us)", "idle_call_kv_us", "idle_scan_us", "{:.3f}", False),
        ("idle step: peek only, handle when due (us)", "idle_kv_us", "idle_scan_us", "{:.3f}", False),
        ("memory per live lease (B)", "bytes_kv", "bytes_scan", "{:.0f}", False),
        ("heartbeat bytes per lease id", "hb_bytes_kv", "hb_bytes_scan", "{:.2f}", False),
    ]
    print(f"kvlease core benchmark (python {sys.version.split()[0]}); baseline = dict + full scan (vLLM style)")
    header = f"| {'figure':48} | {'leases':>9} | {'kvlease':>14} | {'baseline':>14} | {'kvlease/baseline':>16} |"
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for label, kv, sc, fmt, _higher in rows:
        for n in sizes:
            r = results[n]
            ratio = r[kv] / r[sc] if r[sc] else float("inf")
            print(f"| {label:48} | {n:>9,} | {fmt.format(r[kv]):>14} | {fmt.format(r[sc]):>14} | {ratio:>15.3f}x |")
    print(
        f"largest heartbeat message: {max(r['hb_max_msg_kv'] for r in results.values()):.0f} B "
        f"(max_message_bytes = {cfg.max_message_bytes})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
