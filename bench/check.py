"""Benchmark of `kvlease check`: states per second, and how the state count grows with each scope
parameter (one varied at a time from a base scope), on the fixed core.

    .venv/bin/python bench/check.py [--quick]

Base scope: p = a = 1, one accessor engine, one renewable lease, every action family but drop
and cross-engine misdelivery, all four clock-rate extremes. Prints one table row per scope:
states, transitions, wall time, states/s, and the growth factor against the row above. It
asserts nothing. Run time: about 3 minutes (``--quick``: about 40 s).
"""

from __future__ import annotations

import sys
import time

from kvlease.check import Scope, explore

BASE = {"without": frozenset({"drop", "cross"})}


def row(label: str, **kw: object) -> tuple[str, int, int, float]:
    scope = Scope(**{**BASE, **kw})  # type: ignore[arg-type]
    t0 = time.perf_counter()
    r = explore(scope)
    wall = time.perf_counter() - t0
    assert r.violation is None, r.violation
    return label, r.states, r.transitions, wall


def main() -> None:
    quick = "--quick" in sys.argv
    d = 5 if quick else 6
    groups: list[tuple[str, list[tuple[str, dict[str, object]]]]] = [
        ("depth", [(f"depth={k}", {"depth": k}) for k in range(3, (7 if quick else 9) + 1)]),
        (
            "pinner/accessor ranks",
            [
                (f"p={p} a={a} depth={d - 1}", {"pinner_ranks": p, "accessor_ranks": a, "depth": d - 1})
                for p, a in ((1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4))
            ],
        ),
        ("accessor engines", [(f"engines={e} depth={d}", {"engines": e, "depth": d}) for e in (1, 2)]),
        ("leases", [(f"leases={n} depth={d}", {"leases": n, "depth": d}) for n in (1, 2, 3)]),
        (
            "kinds",
            [
                (f"kinds={'+'.join(k)} depth={d}", {"kinds": k, "depth": d})
                for k in (("renewable",), ("fixed",), ("push",), ("renewable", "fixed", "push"))
            ],
        ),
        ("replay history", [(f"history={h} depth={d}", {"history": h, "depth": d}) for h in (0, 2)]),
    ]
    print(f"{'scope':<36} {'states':>10} {'transitions':>12} {'wall s':>8} {'states/s':>9} {'growth':>7}")
    for title, rows in groups:
        print(f"-- {title}")
        prev = None
        for label, kw in rows:
            name, states, trans, wall = row(label, **kw)
            growth = f"x{states / prev:.1f}" if prev else ""
            print(f"{name:<36} {states:>10,} {trans:>12,} {wall:>8.1f} {states / wall:>9,.0f} {growth:>7}", flush=True)
            prev = states


if __name__ == "__main__":
    main()
