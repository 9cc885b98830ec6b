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

import faulthandler
import os
import signal
import sys

if hasattr(os, "sched_setaffinity"):
    _pin = os.sched_setaffinity

    def _keep_every_core(pid: int, mask: object) -> None:
        caller = sys._getframe(1).f_code.co_filename.replace(os.sep, "/")
        if pid == 0 and "/kv_transfer/kv_connector/v1/nixl/" in caller:
            return  # vLLM's NIXL worker reserving one core for itself: keep them all (see above)
        _pin(pid, mask)  # type: ignore[arg-type]

    os.sched_setaffinity = _keep_every_core


# -- every thread's stack on demand (the bench's reports of a server that stood still) -----------
#
# SIGUSR2 makes each process of a bench server (API server, engine core, worker) write every
# thread's Python stack to its stderr, the server's log, from the signal handler itself: no
# thread of the process needs to run, so a process stalled behind its interpreter lock or a
# blocking call still answers (`tools/vllm_pd.Fleet.stacks`). vLLM registers nothing on SIGUSR2.
if hasattr(signal, "SIGUSR2"):
    faulthandler.register(signal.SIGUSR2, all_threads=True)

# -- kvlease's stale-read protection switched off (a demonstration, never a deployment) ----------
#
# With KVLEASE_BENCH_UNPROTECTED_READS=1 in a kvlease decoder's environment, its worker READs
# every request's blocks the way stock vLLM does, without asking its lease (no refusal of a lost
# lease, no verdict on the READ): what the stale-read scenario serves then shows that kvlease's
# check, and nothing else in the bench, is what keeps another request's KV out of the completion
# (`python tools/vllm_pd.py demo --switch-off-protection`).
if os.environ.get("KVLEASE_BENCH_UNPROTECTED_READS") == "1":
    import importlib.abc
    import importlib.machinery
    import importlib.util
    from types import ModuleType

    _TARGET = "kvlease.adapters.vllm.connector"

    def _unprotect(module: ModuleType) -> None:
        worker = module.KvleasePullWorker

        def _read_as_stock(self: object, req_id: str, meta: object) -> None:
            super(worker, self)._read_blocks_for_req(req_id, meta)  # type: ignore[misc]

        worker._read_blocks_for_req = _read_as_stock
        print("kvlease bench shim: this decoder's READs do not consult their leases", file=sys.stderr, flush=True)

    class _Loader(importlib.abc.Loader):
        def __init__(self, inner: importlib.abc.Loader) -> None:
            self.inner = inner

        def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
            return self.inner.create_module(spec)

        def exec_module(self, module: ModuleType) -> None:
            self.inner.exec_module(module)
            _unprotect(module)

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
            if name != _TARGET:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return spec
            spec.loader = _Loader(spec.loader)
            return spec

    sys.meta_path.insert(0, _Finder())
