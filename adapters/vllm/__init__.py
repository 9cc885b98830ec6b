"""kvlease for vLLM 0.33.0: vLLM's NIXL connector with kvlease as its lease.

Load it with ``"kv_connector": "KvleaseNixlConnector"`` (pull) or ``"KvleaseNixlPushConnector"``
(push), ``"kv_connector_module_path": "kvlease.adapters.vllm"`` in ``--kv-transfer-config``; see
`kvlease.adapters.vllm.connector` and `kvlease.adapters.vllm.push`.
The connector classes are imported on first use (vLLM's factory does ``getattr`` on this
module), so `kvlease.adapters.vllm._settings` can be used and tested without vLLM installed.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "KvleaseNixlConnector",
    "KvleaseNixlPushConnector",
    "KvleasePullScheduler",
    "KvleasePullWorker",
    "KvleasePushScheduler",
    "KvleasePushWorker",
]

_PUSH = ("KvleaseNixlPushConnector", "KvleasePushScheduler", "KvleasePushWorker")


def __getattr__(name: str) -> Any:
    if name in _PUSH:
        from . import push

        return getattr(push, name)
    if name in __all__:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
