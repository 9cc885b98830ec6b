"""Benchmark of the cluster simulator: simulated events per second, to size campaigns.

An event is one entry popped from the simulator's heap: a message delivery (decoded, fed to a
real Pinner/Accessor, its outputs encoded), a forward-pass boundary, an arrival, a timer, a
fault. Every kvlease message goes through the real codec and core, so an event costs what the
protocol costs, plus the simulator's bookkeeping. Prints, per workload: events, wall seconds,
events per second, simulated seconds per wall second; and for the fault campaign, seeds per
second and the projected time of a 2,000-seed run.

Each workload runs ``--repeat`` times (default 3) and the table shows the fastest run (as
``timeit`` does: on a shared machine the slower runs measure the neighbours); ``--json`` also
gives the median. Every repetition simulates the same events (a run is a pure function of its
seed), so only the wall time varies.

Target (issue 5): >= 100k events/s. This is a benchmark: it prints figures, it asserts nothing.
Run: ``.venv/bin/python bench/sim.py [--quick] [--json] [--repeat N]``.
Run time: about 30 s (``--quick``: about 12 s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from kvlease.sim import Cluster, Policy, campaign_scenario, default_scenario, run_seed


def _policy_run(policy: Policy, duration: float, repeat: int) -> dict[str, float]:
    scenario = default_scenario(
        1,
        duration=duration,
        crash_at=duration * 0.27,
        burst=(duration * 0.22, 60.0, 25.0),
        stall=(duration * 0.25, 25.0),
    )
    walls = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = Cluster(scenario, policy).run()
        walls.append(time.perf_counter() - t0)
    wall = min(walls)
    return {
        "events": result.events,
        "wall_s": wall,
        "wall_s_median": statistics.median(walls),
        "events_per_s": result.events / wall,
        "sim_s_per_wall_s": duration / wall,
        "messages": result.messages,
    }


def _campaign_run(seeds: int, repeat: int) -> dict[str, float]:
    walls = []
    for _ in range(repeat):
        events = 0
        t0 = time.perf_counter()
        for seed in range(seeds):
            events += run_seed(seed).events
        walls.append(time.perf_counter() - t0)
    wall = min(walls)
    sim_s = sum(campaign_scenario(s).workload.duration for s in range(seeds))
    return {
        "events": events,
        "wall_s": wall,
        "wall_s_median": statistics.median(walls),
        "events_per_s": events / wall,
        "sim_s_per_wall_s": sim_s / wall,
        "seeds_per_s": seeds / wall,
        "projected_2000_seeds_s": 2000 * wall / seeds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="shorter runs (smoke test)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--repeat", type=int, default=3, help="runs per workload; the fastest is shown (default 3)")
    args = ap.parse_args()
    repeat = max(1, args.repeat)
    duration = 150.0 if args.quick else 900.0
    seeds = 50 if args.quick else 400
    rows: dict[str, dict[str, float]] = {}
    for policy in (Policy.KVLEASE, Policy.VLLM_HB, Policy.FIXED_30, Policy.FIXED_480):
        rows[f"comparison {policy.value} ({duration:.0f} s simulated)"] = _policy_run(policy, duration, repeat)
    rows[f"campaign, checks on ({seeds} seeds)"] = _campaign_run(seeds, repeat)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(
        f"kvlease simulator benchmark (python {sys.version.split()[0]}, fastest of {repeat} runs); "
        "target >= 100,000 events/s"
    )
    header = f"| {'workload':44} | {'events':>10} | {'wall s':>7} | {'events/s':>9} | {'sim s / wall s':>14} |"
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")
    for name, r in rows.items():
        print(
            f"| {name:44} | {r['events']:>10,.0f} | {r['wall_s']:>7.2f} | {r['events_per_s']:>9,.0f} "
            f"| {r['sim_s_per_wall_s']:>14,.1f} |"
        )
    camp = rows[f"campaign, checks on ({seeds} seeds)"]
    print(f"campaign: {camp['seeds_per_s']:.1f} seeds/s; 2,000 seeds take about {camp['projected_2000_seeds_s']:.0f} s")


if __name__ == "__main__":
    main()
