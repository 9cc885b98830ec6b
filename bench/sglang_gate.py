"""How long one room waiting for its lease holds up the other rooms of an SGLang transfer worker.

SGLang 0.5.23's prefill runs each transfer worker over one queue of chunks, many rooms in it. One
room is first in the queue and its destination lease never comes (a ticket lost, a decode gone);
``--rooms`` rooms are queued behind it, their leases acknowledged. The worker takes chunks through
the plugin's gated queue (``kvlease.adapters.sglang._nixl._GatedQueue``, over SGLang's own
``FastQueue``) and "writes" each one for ``--work-ms``. Two ways of waiting are timed, in one run:

- **in the worker** (the plugin before issue 23): the worker waits for the stalled room's lease
  up to one heartbeat interval ``I`` before it refuses the room, and every room behind it waits too;
- **beside the queue** (now): the stalled room is set aside with its later chunks behind it, the
  worker serves the others, each after one look at the stalled room, and hands the stalled room
  over (to be refused by the write gate) once it has waited ``I``.

It prints, per way, how long the rooms behind waited from being queued to being taken (median,
max), when the stalled room was handed over, and how often the worker looked at it; it asserts
nothing. Run (SGLang's environment): ``.venv-sglang/bin/python bench/sglang_gate.py
[--interval 5] [--rooms 100] [--work-ms 1]``. Run time: about 12 s at the default interval
(``--quick``: about 2 s).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import threading
import time
import types
from typing import Any

try:
    from kvlease.adapters.sglang._nixl import _GatedQueue
    from sglang.srt.disaggregation.common.utils import FastQueue  # type: ignore[import-not-found]
except ImportError as exc:  # one line for a person, not a traceback: where it does run
    sys.exit(
        f"bench/sglang_gate.py needs SGLang ({exc}): run it in SGLang's environment, "
        "'.venv-sglang/bin/python -m kvlease bench sglang_gate' (bash dev.sh test creates .venv-sglang)"
    )

STALLED = 0


def run(interval: float, rooms: int, work_s: float, *, beside: bool, stalled: bool = True) -> dict[str, Any]:
    queue = FastQueue()
    looks: collections.Counter[int] = collections.Counter()

    def ready(chunk: Any) -> bool:
        looks[chunk.room] += 1
        return bool(chunk.room != STALLED or not stalled)

    gated = _GatedQueue(queue, ready, interval, 0.005, lambda: None)
    gated.can_defer = beside and gated.can_defer  # False: wait in the worker, as before
    queued: dict[int, float] = {}
    taken: dict[int, float] = {}
    looks_per_room: list[int] = []  # looks at the stalled room while each room behind was taken

    def worker() -> None:
        for _ in range(rooms + 1):
            before = looks[STALLED]
            chunk = gated.get()
            taken[chunk.room] = time.perf_counter()
            if chunk.room != STALLED:
                looks_per_room.append(looks[STALLED] - before)
            if chunk.room != STALLED:
                time.sleep(work_s)  # the room's WRITEs

    t0 = time.perf_counter()
    for room in range(rooms + 1):  # the stalled room first, then the rooms behind it
        queued[room] = time.perf_counter()
        queue.put(types.SimpleNamespace(room=room, is_last_chunk=True))
    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    thread.join(interval * 4 + rooms * work_s * 4 + 10)
    waits = [taken[r] - queued[r] for r in range(1, rooms + 1)]
    order = sorted(taken, key=taken.__getitem__)
    served_before = order.index(STALLED)
    return {
        "way": ("beside the queue" if beside else "in the worker") if stalled else "no stalled room (baseline)",
        "behind_median_s": statistics.median(waits),
        "behind_max_s": max(waits),
        "stalled_handed_over_s": taken[STALLED] - t0,
        "served_before_stalled": served_before,
        "looks_at_stalled": looks[STALLED],
        "max_looks_per_room_served": max(looks_per_room, default=0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interval", type=float, default=None, help="heartbeat interval I, s (default 5: d = 30 s)")
    ap.add_argument("--rooms", type=int, default=100, help="rooms queued behind the stalled one")
    ap.add_argument("--work-ms", type=float, default=1.0, help="time one room's WRITEs take, ms")
    ap.add_argument("--quick", action="store_true", help="I = 0.5 s (a smoke run)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    interval = args.interval if args.interval is not None else (0.5 if args.quick else 5.0)
    t_start = time.perf_counter()
    work = args.work_ms / 1e3
    rows = [run(interval, args.rooms, work, beside=True, stalled=False)]
    rows += [run(interval, args.rooms, work, beside=b) for b in (False, True)]
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        return
    print(
        f"one transfer worker, a room first in its queue whose lease never comes, {args.rooms} rooms behind it "
        f"({args.work_ms:g} ms of WRITEs each); heartbeat interval I = {interval:g} s"
    )
    print(
        "| waiting | rooms behind: median wait | max wait | served before the stalled room | "
        "stalled room taken after | looks at it (max while one room behind was taken) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['way']} | {r['behind_median_s'] * 1e3:.1f} ms | {r['behind_max_s'] * 1e3:.1f} ms | "
            f"{r['served_before_stalled']} of {args.rooms} | {r['stalled_handed_over_s']:.3f} s | "
            f"{r['looks_at_stalled']} ({r['max_looks_per_room_served']}) |"
        )
    print(f"run time {time.perf_counter() - t_start:.1f} s")


if __name__ == "__main__":
    main()
