"""An SGLang plugin for CPU-only deployments: NIXL registers the KV pool as host memory (DRAM).

SGLang 0.5.23's prefill and decode queues build their NIXL ``KVArgs`` with
``kv_data_mem_kinds = ["VRAM"]`` and no flag changes it; on a machine without a GPU the KV pool is
host memory and UCX refuses the registration (``VRAM memory is detected as host by UCX``,
``NIXL_ERR_BACKEND``). This plugin adds an AROUND hook on ``get_kv_class`` that subclasses
whatever KV manager class the rest of the chain returns (stock SGLang's, or kvlease's) and
registers every KV buffer as ``DRAM``. It is a separate plugin, not part of kvlease: it is about
where SGLang's memory lives, not about leases, and stock SGLang needs it as much (the real-pair
test runs stock SGLang with it too). kvlease composes with it in either load order.

It also slows NIXL's UCX progress thread from a busy loop to a poll every millisecond
(`_quiet_progress_thread`), on this small test host only (docs/sglang.md; the vLLM bench tried
the same and took it out, docs/vllm-serve.md).

Found on ``PYTHONPATH`` through ``kvlease_cpu_dram-0.0.0.dist-info`` (entry point ``cpu_dram_kv``
in ``sglang.srt.plugins``); nothing is pip-installed. Select with ``SGLANG_PLUGINS`` (e.g.
``kvlease,cpu_dram_kv``).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("kvlease_cpu_dram")

_made: dict[type, type] = {}


def _dram_manager(base: type) -> type:
    made = _made.get(base)
    if made is None:

        def __init__(self: Any, args: Any, *a: Any, **k: Any) -> None:
            args.kv_data_mem_kinds = ["DRAM"] * len(args.kv_data_ptrs)
            base.__init__(self, args, *a, **k)  # type: ignore[misc]
            logger.info("cpu_dram_kv: NIXL KV buffers registered as DRAM (%d)", len(args.kv_data_ptrs))

        made = type(f"Dram{base.__name__}", (base,), {"__init__": __init__, "__module__": __name__})
        _made[base] = made
    return made


def _around_get_kv_class(original: Any, transfer_backend: Any, class_type: Any, *a: Any, **k: Any) -> Any:
    cls = original(transfer_backend, class_type, *a, **k)
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend

    if transfer_backend == TransferBackend.NIXL and class_type == KVClassType.MANAGER:
        return _dram_manager(cls)
    return cls


#: The UCX progress thread's pause between polls when idle, microseconds (NIXL's ``pthrDelay``).
PROGRESS_THREAD_DELAY_US = 1000


def _quiet_progress_thread() -> None:
    """NIXL's Python agent starts the UCX backend's progress thread with ``pthrDelay = 0``: it polls
    UCX without pause, a whole core per server process even when nothing moves (seen: each
    SGLang server's scheduler process at 100 % CPU while idle, in that thread). A GPU host has
    cores to spare; this bench runs four servers on two cores, where those loops took most of the
    machine (a decode restarted in 3 minutes, not 1). Here the thread waits up to a millisecond
    between polls instead, for stock SGLang and kvlease alike; transfers still progress whenever
    SGLang polls them, as they always do."""
    import nixl._api as api

    make = api.nixlBind.nixlAgent
    if getattr(make, "_kvlease_quiet", False):
        return

    def agent(name: str, config: Any) -> Any:
        if config.pthrDelay == 0:
            config.pthrDelay = PROGRESS_THREAD_DELAY_US
        return make(name, config)

    agent._kvlease_quiet = True  # type: ignore[attr-defined]
    api.nixlBind.nixlAgent = agent


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _quiet_progress_thread()

    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", _around_get_kv_class, HookType.AROUND)
