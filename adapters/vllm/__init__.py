"""kvlease for vLLM 0.33.0: vLLM's NIXL connector with kvlease as its lease.

Load it with ``"kv_connector": "KvleaseNixlConnector", "kv_connector_module_path":
"kvlease.adapters.vllm"`` in ``--kv-transfer-config``; see `kvlease.adapters.vllm.connector`.
Importing this package imports vLLM; `kvlease.adapters.vllm._settings` does not.
"""

from .connector import KvleaseNixlConnector, KvleasePullScheduler, KvleasePullWorker

__all__ = ["KvleaseNixlConnector", "KvleasePullScheduler", "KvleasePullWorker"]
