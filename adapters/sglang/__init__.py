"""kvlease for SGLang 0.5.23's prefill/decode disaggregation, as an SGLang plugin.

Installed as the entry point ``kvlease`` in the ``sglang.srt.plugins`` group; SGLang's
``load_plugins()`` calls :func:`register` in every scheduler process (``SGLANG_PLUGINS=kvlease``
selects it when several plugins are installed). :func:`register` adds one AROUND hook on
``sglang.srt.disaggregation.utils.get_kv_class`` through SGLang's ``HookRegistry``: for the NIXL
backend it returns the lease-enabled manager, sender and receiver of ``._nixl``; everything else
passes through. No SGLang source is patched and nothing outside the registry is replaced.

Settings: ``SGLANG_KVLEASE_*`` environment variables (``._settings.ENV``), defaults equal to
kvlease's. The plugin turns SGLang's deferred decode KV release on (it is how the decode holds a
failed room's pages until its leases end) unless ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE``
is set explicitly.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

__all__ = ["TARGET", "kv_class_hook", "register"]

#: The function the hook wraps (its module-level copies in prefill.py/decode.py are rebound too).
TARGET = "sglang.srt.disaggregation.utils.get_kv_class"


def kv_class_hook(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND hook: SGLang's class, or its lease-enabled subclass for NIXL."""
    cls = original(*args, **kwargs)
    transfer_backend = args[0] if args else kwargs.get("transfer_backend")
    class_type = args[1] if len(args) > 1 else kwargs.get("class_type")
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend  # type: ignore[import-not-found]

    if transfer_backend != TransferBackend.NIXL:
        return cls
    from . import _nixl

    return {
        KVClassType.MANAGER: _nixl.LeaseNixlKVManager,
        KVClassType.SENDER: _nixl.LeaseNixlKVSender,
        KVClassType.RECEIVER: _nixl.LeaseNixlKVReceiver,
    }.get(class_type, cls)


def register() -> None:
    """The plugin's entry point (called by SGLang's ``load_plugins()``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # type: ignore[import-not-found]

    os.environ.setdefault("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", "1")
    HookRegistry.register(TARGET, kv_class_hook, HookType.AROUND)
