"""An SGLang plugin for CPU-only deployments: NIXL registers the KV pool as host memory (DRAM).

SGLang 0.5.23's prefill and decode queues build their NIXL ``KVArgs`` with
``kv_data_mem_kinds = ["VRAM"]`` and no flag changes it; on a machine without a GPU the KV pool is
host memory and UCX refuses the registration (``VRAM memory is detected as host by UCX``,
``NIXL_ERR_BACKEND``). This plugin adds an AROUND hook on ``get_kv_class`` that subclasses
whatever KV manager class the rest of the chain returns (stock SGLang's, or kvlease's) and
registers every KV buffer as ``DRAM``. It is a separate plugin, not part of kvlease: it is about
where SGLang's memory lives, not about leases, and stock SGLang needs it as much (the real-pair
test runs stock SGLang with it too). kvlease composes with it in either load order.

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


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", _around_get_kv_class, HookType.AROUND)
