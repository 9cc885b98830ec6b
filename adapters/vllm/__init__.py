"""kvlease for vLLM 0.33.0: vLLM's NIXL connector with kvlease as its lease.

Load it with ``"kv_connector": "KvleaseNixlConnector", "kv_connector_module_path":
"kvlease.adapters.vllm"`` in ``--kv-transfer-config``; see `kvlease.adapters.vllm.connector`.
The connector classes are imported on first use (vLLM's factory does ``getattr`` on this
module), so `kvlease.adapters.vllm._settings` can be used and tested without vLLM installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvleaseNixlConnector", "KvleasePullScheduler", "KvleasePullWorker"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
