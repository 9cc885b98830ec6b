"""kvlease for vLLM 0.33.0: vLLM's NIXL connector with kvlease as its lease.

Load it with ``"kv_connector": "NixlConnector"`` (pull) or ``"NixlPushConnector"`` (push) and
``"kv_connector_module_path": "kvlease.adapters.vllm"`` in ``--kv-transfer-config``: vLLM takes
the class of that name from this module (a module path wins over its registry), and every check
vLLM keys on the connector's *name* — DCP validation and interleave alignment, the
``--enable-return-routed-experts`` refusal, the CPU Mamba layout, model-specific NIXL checks —
applies to kvlease exactly as to stock NIXL. The same classes are also exported as
``KvleaseNixlConnector`` / ``KvleaseNixlPushConnector`` (earlier releases' names; under them
vLLM skips those checks, and the connector logs a warning saying so). See
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
    "NixlConnector",
    "NixlPushConnector",
]

_PUSH = ("KvleaseNixlPushConnector", "KvleasePushScheduler", "KvleasePushWorker")
#: vLLM's own connector names, under which vLLM's name-keyed NIXL checks apply.
_VLLM_NAMES = {"NixlConnector": "KvleaseNixlConnector", "NixlPushConnector": "KvleaseNixlPushConnector"}


def __getattr__(name: str) -> Any:
    name = _VLLM_NAMES.get(name, name)
    if name in _PUSH:
        from . import push

        return getattr(push, name)
    if name in __all__:
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
