"""Loaded into the `vllm serve` processes of this project's test bench (tools/vllm_pd.py puts
this folder first on their PYTHONPATH); not part of kvlease.

vLLM 0.33.0's NIXL worker, on the CPU platform, pins the worker's main thread to the last core of
each NUMA node (the core it reserves for KV transfers, `base_worker.py`), and with
``VLLM_CPU_OMP_THREADS_BIND=nobind`` (the recipe's: it runs several servers on one small host)
the forward's OpenMP threads inherit that core. On this 2-core bench every worker of the four
servers then computes on core 1, and a worker's main thread, waiting there for CPU while it
holds the GIL, stalled every other thread of its process for seconds: a producer's lease pump
went 9-15 s without a turn (measured), so heartbeats that had arrived were handled after the
lease had run out. A deployment has a core per NUMA node to reserve and binds the forward's
threads elsewhere; this bench has two cores for four servers, so the reservation is skipped
here (the adapter test harness, tests/_vllm_node.py, does the same), for stock vLLM and
kvlease alike.
"""

from __future__ import annotations

import os
import sys

if hasattr(os, "sched_setaffinity"):
    _pin = os.sched_setaffinity

    def _keep_every_core(pid: int, mask: object) -> None:
        caller = sys._getframe(1).f_code.co_filename.replace(os.sep, "/")
        if pid == 0 and "/kv_transfer/kv_connector/v1/nixl/" in caller:
            return  # vLLM's NIXL worker reserving one core for itself: keep them all (see above)
        _pin(pid, mask)  # type: ignore[arg-type]

    os.sched_setaffinity = _keep_every_core
