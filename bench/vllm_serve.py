"""Completions through real `vllm serve` P/D pairs: kvlease's connector against stock vLLM's.

Starts a stock pair and a kvlease pair (tools/vllm_pd.py: real CPU forwards, KV over NIXL on
loopback, engines/vllm/router.py in front), then runs the same load through each in alternating
rounds (so both see the same machine): ``--requests`` streamed completions per round at a fixed
``--concurrency``, from the ``openai`` client. Prints completions per second and time to first
token for each, their ratios (kvlease / stock), and kvlease's own cost inside the producer:
microseconds per turn of its lease code (its part of each engine step, and the lease pump's
turns), from the server's ``vllm:kvlease_lease_work_us`` and ``vllm:kvlease_lease_turns``; and
how many of kvlease's reads waited for the producer's confirmation (``accesses_confirmed``).

    .venv/bin/python bench/vllm_serve.py [--rounds 3] [--requests 24] [--concurrency 4] [--alone | --paired]

``--alone``: one pair at a time instead of both at once, started afresh for each of its rounds
(the stacks still alternate), with P pinned to one core and D to another (``taskset``): on a
machine with fewer cores than four servers need, the two pairs then stop competing for the same
cores, and a round measures its stack, not the other pair's idle polling beside it.

``--paired``: both pairs started once, pinned the same way (both producers on core 0, both
decoders on core 1), and the pair not measured frozen (SIGSTOP, every process of each of its
servers) through the other's round: many short rounds on the same servers, each stock round next
to a kvlease round, so the machine's drift from minute to minute falls on both alike. Prints each
pair of rounds' ratio, their median and a 95 % bootstrap interval of that median.

Needs the vLLM environment (bash engines/vllm/setup.sh). Run time: about 6 minutes (1-3 of them
the servers' start-up); with ``--alone`` about 12 (a pair start-up per round and stack).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import vllm_pd as pd


def run_round(
    fleet: dict[str, pd.Server], client: pd.Client, router: pd.Router, stack: str, args: Any, n: int
) -> dict[str, Any]:
    p, d = ("p_kv", "d_kv") if stack == "kvlease" else ("p_stock", "d_stock")
    headers = {"x-kvlease-prefill": p, "x-kvlease-decode": d}
    reads0 = _reads(fleet.get(d))
    phases0 = _phases(fleet, p, d)
    pending: list[Any] = []
    answers: list[dict[str, Any]] = []
    start = time.monotonic()
    for i in range(args.requests):
        while len(pending) >= args.concurrency:
            done = [f for f in pending if f.done()]
            if not done:
                time.sleep(0.005)
                continue
            for f in done:
                pending.remove(f)
                answers.append(f.result())
        text = f"# round {n} request {i} on {stack}\ndef f{i}(x):\n    return x +"
        pending.append(client.submit(router.base_url, text, args.max_tokens, headers=headers, stream=True))
    answers += [f.result(timeout=900) for f in pending]
    wall = time.monotonic() - start
    ok = [a for a in answers if a["status"] == 200]
    ttft = sorted(a["ttft"] for a in ok if a["ttft"] is not None)
    if reads0 is not None:
        time.sleep(1.0)  # a rank reports its counters to vLLM's metrics at most every 0.5 s
    reads1 = _reads(fleet.get(d))
    phases1 = _phases(fleet, p, d)
    return {
        "phases": {k: (phases1[k][0] - phases0[k][0], phases1[k][1] - phases0[k][1]) for k in phases1},
        "reads": None if reads0 is None or reads1 is None else (reads1[0] - reads0[0], reads1[1] - reads0[1]),
        "wall": wall,
        "ok": len(ok),
        "failed": len(answers) - len(ok),
        "rps": len(ok) / wall,
        "ttft_p50": statistics.median(ttft) if ttft else float("nan"),
        "ttft_p90": ttft[int(0.9 * (len(ttft) - 1))] if ttft else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=24, help="completions per round and stack")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--lease", type=float, default=30.0, help="kv_lease_duration of every server (s)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--alone", action="store_true", help="one pair at a time, P and D on a core each")
    mode.add_argument(
        "--paired",
        action="store_true",
        help="both pairs pinned alike, the one not measured frozen; ratio per round pair",
    )
    ap.add_argument("--seed", type=int, default=0, help="the bootstrap's seed (--paired)")
    args = ap.parse_args()
    if args.rounds < 1 or args.requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        ap.error("--rounds, --requests, --concurrency and --max-tokens must be at least 1")
    problem = pd.missing_environment()
    if problem is not None:
        sys.exit(f"bench/vllm_serve.py: {problem}")
    if args.paired:
        results, work = run_paired(args)
    else:
        results, work = run_alone(args) if args.alone else run_together(args)
    report(args, results, work)


def _pair(stack: str, workdir: Path, args: Any, cpus: tuple[str, str] | None) -> dict[str, pd.Server]:
    connector, suffix = (pd.KVLEASE, "kv") if stack == "kvlease" else (pd.STOCK, "stock")
    p_cpus, d_cpus = cpus if cpus is not None else (None, None)
    return {
        f"p_{suffix}": pd.start_server(f"p_{suffix}", connector, pd.PRODUCER, workdir, lease=args.lease, cpus=p_cpus),
        f"d_{suffix}": pd.start_server(f"d_{suffix}", connector, pd.CONSUMER, workdir, lease=args.lease, cpus=d_cpus),
    }


def _reads(d: pd.Server | None) -> tuple[float, float] | None:
    """A kvlease decoder's reads completed, and of them those that waited for the producer's
    confirmation (one more round trip); None for a stock one."""
    if d is None or d.connector != pd.KVLEASE:
        return None
    m = d.metrics()
    return m.get("vllm:kvlease_accesses_completed_total", 0.0), m.get("vllm:kvlease_accesses_confirmed_total", 0.0)


#: Where a completion's time goes, from each server's own histograms (sum and count): the
#: producer's prefill and its time to the one token it makes, the decoder's queue time (its READ
#: included: vLLM queues a request until its KV arrived), its time to first token, the READ.
PHASES = {
    "P queue": ("p", "vllm:request_queue_time_seconds"),
    "P prefill": ("p", "vllm:request_prefill_time_seconds"),
    "P TTFT": ("p", "vllm:time_to_first_token_seconds"),
    "D queue": ("d", "vllm:request_queue_time_seconds"),
    "D TTFT": ("d", "vllm:time_to_first_token_seconds"),
    "D READ": ("d", "vllm:nixl_xfer_time_seconds"),
    "D decode": ("d", "vllm:request_decode_time_seconds"),
}


def _phases(fleet: dict[str, pd.Server], p: str, d: str) -> dict[str, tuple[float, float]]:
    """Each of `PHASES`: its histogram's sum and count on its server now."""
    metrics = {"p": fleet[p].metrics(), "d": fleet[d].metrics()}
    return {k: (metrics[w].get(f"{m}_sum", 0.0), metrics[w].get(f"{m}_count", 0.0)) for k, (w, m) in PHASES.items()}


def _work(metrics: dict[str, float]) -> tuple[float, float]:
    return metrics.get("vllm:kvlease_lease_work_us_total", 0.0), metrics.get("vllm:kvlease_lease_turns_total", 0.0)


def _teardown(servers: dict[str, pd.Server], workdir: Path, router: Any, client: Any) -> None:
    if client is not None:
        client.close()
    if router is not None:
        router.stop()
    pd.stop_all(list(servers.values()))
    shutil.rmtree(workdir, ignore_errors=True)


def run_alone(args: Any) -> tuple[dict[str, list[dict[str, Any]]], tuple[float, float]]:
    """Each round and stack on a pair of its own, started for it (P on core 0, D on core 1)."""
    cores = sorted(os.sched_getaffinity(0))
    cpus = (str(cores[0]), str(cores[1])) if len(cores) >= 2 else None
    results: dict[str, list[dict[str, Any]]] = {"stock": [], "kvlease": []}
    us = turns = 0.0
    for n in range(args.rounds):
        for stack in ("stock", "kvlease") if n % 2 == 0 else ("kvlease", "stock"):
            workdir = Path(tempfile.mkdtemp(prefix="kvlease-bench-serve-"))
            servers = _pair(stack, workdir, args, cpus)
            router = client = None
            try:
                up = pd.wait_healthy(list(servers.values()))
                p, d = servers.values()
                router = pd.start_router([p], [d], workdir)
                client = pd.Client()
                run_round(servers, client, router, stack, argparse.Namespace(**{**vars(args), "requests": 4}), -1)
                work0 = _work(p.metrics())
                r = run_round(servers, client, router, stack, args, n)
                work1 = _work(p.metrics())
                us, turns = us + work1[0] - work0[0], turns + work1[1] - work0[1]
            finally:
                _teardown(servers, workdir, router, client)
            results[stack].append(r)
            print(f"round {n} {stack:8s} (pair healthy after {up:.0f} s) {r['rps']:.2f} completions/s, "
                  f"TTFT p50 {r['ttft_p50'] * 1000:.0f} ms, p90 {r['ttft_p90'] * 1000:.0f} ms, "
                  f"failed {r['failed']}", flush=True)  # fmt: skip
    return results, (us, turns)


def _start_both(servers: dict[str, pd.Server], workdir: Path, args: Any, cpus: tuple[str, str] | None) -> pd.Router:
    """Both pairs started into `servers` (their caller stops them) and waited for, and the
    router in front of them."""
    for stack in ("stock", "kvlease"):
        servers.update(_pair(stack, workdir, args, cpus))
    print(f"pairs healthy after {pd.wait_healthy(list(servers.values())):.0f} s", flush=True)
    return pd.start_router([servers["p_stock"], servers["p_kv"]], [servers["d_stock"], servers["d_kv"]], workdir)


def run_together(args: Any) -> tuple[dict[str, list[dict[str, Any]]], tuple[float, float]]:
    """Both pairs up at once, the rounds alternating between them."""
    workdir = Path(tempfile.mkdtemp(prefix="kvlease-bench-serve-"))
    servers: dict[str, pd.Server] = {}
    router = client = None
    try:
        router = _start_both(servers, workdir, args, None)
        client = pd.Client()
        for stack in ("stock", "kvlease"):  # warm-up: handshakes, first forwards
            run_round(servers, client, router, stack, argparse.Namespace(**{**vars(args), "requests": 4}), -1)
        results: dict[str, list[dict[str, Any]]] = {"stock": [], "kvlease": []}
        work0 = servers["p_kv"].metrics()
        for n in range(args.rounds):
            for stack in ("stock", "kvlease") if n % 2 == 0 else ("kvlease", "stock"):
                r = run_round(servers, client, router, stack, args, n)
                results[stack].append(r)
                print(f"round {n} {stack:8s} {r['rps']:.2f} completions/s, TTFT p50 {r['ttft_p50'] * 1000:.0f} ms, "
                      f"p90 {r['ttft_p90'] * 1000:.0f} ms, failed {r['failed']}", flush=True)  # fmt: skip
        work1 = servers["p_kv"].metrics()
    finally:
        _teardown(servers, workdir, router, client)
    (us1, turns1), (us0, turns0) = _work(work1), _work(work0)
    return results, (us1 - us0, turns1 - turns0)


def run_paired(args: Any) -> tuple[dict[str, list[dict[str, Any]]], tuple[float, float]]:
    """Both pairs up once, P on core 0 and D on core 1 for each; a round runs on one pair while
    every process of the other is stopped (SIGSTOP), so the two never share a core, and the
    rounds alternate (stock first in even rounds) on the same servers."""
    cores = sorted(os.sched_getaffinity(0))
    cpus = (str(cores[0]), str(cores[1])) if len(cores) >= 2 else None
    workdir = Path(tempfile.mkdtemp(prefix="kvlease-bench-serve-"))
    servers: dict[str, pd.Server] = {}
    router = client = None
    pairs = {"stock": ("p_stock", "d_stock"), "kvlease": ("p_kv", "d_kv")}
    frozen: list[pd.Server] = []
    us = turns = 0.0
    try:
        router = _start_both(servers, workdir, args, cpus)
        client = pd.Client()
        warm = argparse.Namespace(**{**vars(args), "requests": 4})
        results: dict[str, list[dict[str, Any]]] = {"stock": [], "kvlease": []}
        for n in range(-1, args.rounds):  # round -1: handshakes and first forwards, not counted
            for stack in ("stock", "kvlease") if n % 2 == 0 else ("kvlease", "stock"):
                other = "kvlease" if stack == "stock" else "stock"
                for s in frozen:
                    s.thaw()
                frozen = [servers[name] for name in pairs[other]] if n >= 0 else []
                for s in frozen:
                    s.freeze()
                run_round(servers, client, router, stack, warm, n)  # a thawed server's first steps
                work0 = _work(servers["p_kv"].metrics()) if stack == "kvlease" else None
                r = run_round(servers, client, router, stack, args, n)
                if work0 is not None:
                    work1 = _work(servers["p_kv"].metrics())
                    us, turns = us + work1[0] - work0[0], turns + work1[1] - work0[1]
                if n < 0:
                    continue
                results[stack].append(r)
                print(f"round {n} {stack:8s} {r['rps']:.2f} completions/s, TTFT p50 {r['ttft_p50'] * 1000:.0f} ms, "
                      f"p90 {r['ttft_p90'] * 1000:.0f} ms, failed {r['failed']}", flush=True)  # fmt: skip
    finally:
        for s in frozen:
            s.thaw()
        _teardown(servers, workdir, router, client)
    return results, (us, turns)


def paired_ratios(
    results: dict[str, list[dict[str, Any]]], key: str, seed: int
) -> tuple[list[float], float, float, float]:
    """Each round's kvlease / stock ratio of `key`, their median, and a 95 % bootstrap interval of
    that median (2,000 resamples of the rounds)."""
    ratios = [k[key] / s[key] for s, k in zip(results["stock"], results["kvlease"], strict=True)]
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    return ratios, statistics.median(ratios), medians[int(0.025 * len(medians))], medians[int(0.975 * len(medians)) - 1]


def report(args: Any, results: dict[str, list[dict[str, Any]]], work: tuple[float, float]) -> None:
    def med(stack: str, key: str) -> float:
        return statistics.median(r[key] for r in results[stack])

    if args.paired:
        how = "both pairs pinned alike, the other frozen"
    else:
        how = "one pair at a time, P and D on a core each" if args.alone else "both pairs up together"
    print(f"\n{args.rounds} rounds x {args.requests} streamed completions, concurrency {args.concurrency}, "
          f"{args.max_tokens} tokens, lease {args.lease:g} s, {how} (medians over rounds)")  # fmt: skip
    print(f"{'':10s} {'completions/s':>14s} {'TTFT p50 ms':>12s} {'TTFT p90 ms':>12s} {'failed':>7s}")
    for stack in ("stock", "kvlease"):
        failed = sum(r["failed"] for r in results[stack])
        print(f"{stack:10s} {med(stack, 'rps'):14.2f} {med(stack, 'ttft_p50') * 1000:12.0f} "
              f"{med(stack, 'ttft_p90') * 1000:12.0f} {failed:7d}")  # fmt: skip
    print(f"{'ratio':10s} {med('kvlease', 'rps') / med('stock', 'rps'):14.3f} "
          f"{med('kvlease', 'ttft_p50') / med('stock', 'ttft_p50'):12.3f} "
          f"{med('kvlease', 'ttft_p90') / med('stock', 'ttft_p90'):12.3f}   (kvlease / stock)")  # fmt: skip
    print("where the time goes (mean ms per completion, from each server's histograms, all rounds):")
    print(f"{'':10s} " + " ".join(f"{k:>10s}" for k in PHASES))
    for stack in ("stock", "kvlease"):
        cells = []
        for k in PHASES:
            total = sum(r["phases"][k][0] for r in results[stack])
            count = sum(r["phases"][k][1] for r in results[stack])
            cells.append(f"{total / count * 1000:10.1f}" if count else f"{'-':>10s}")
        print(f"{stack:10s} " + " ".join(cells))
    if args.paired:
        for key, what in (("rps", "completions/s"), ("ttft_p50", "TTFT p50")):
            ratios, mid, lo, hi = paired_ratios(results, key, args.seed)
            print(f"{what} ratio per round pair: {' '.join(f'{r:.3f}' for r in ratios)}")
            print(f"  median {mid:.3f}, 95 % bootstrap interval of the median [{lo:.3f}, {hi:.3f}]")
    us, turns = work
    done = sum(r["ok"] for r in results["kvlease"])
    counted = [r["reads"] for r in results["kvlease"] if r.get("reads") is not None]
    if counted:
        reads, confirmed = sum(c[0] for c in counted), sum(c[1] for c in counted)
        print(f"kvlease's decoder: {confirmed:.0f} of {reads:.0f} reads waited for the producer's confirmation "
              "(no acknowledged window covered them: one more round trip before the first token)")  # fmt: skip
    if turns:
        print(f"kvlease inside P: {us / turns:.1f} µs per turn of its lease code ({turns:.0f} turns), "
              f"{us / max(done, 1):.0f} µs per completion")  # fmt: skip


if __name__ == "__main__":
    main()
