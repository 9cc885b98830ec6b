"""kvlease for SGLang 0.5.23's prefill/decode disaggregation, as an SGLang plugin.

Installed as the entry point ``kvlease`` in the ``sglang.srt.plugins`` group; SGLang's
``load_plugins()`` calls :func:`register` in every scheduler process (``SGLANG_PLUGINS=kvlease``
selects it when several plugins are installed). :func:`register` adds one AROUND hook on
``sglang.srt.disaggregation.utils.get_kv_class`` through SGLang's ``HookRegistry``: for the NIXL
backend it composes the lease-enabled manager, sender and receiver of ``._nixl`` over the class the
rest of the hook chain returned (stock SGLang's, or another plugin's subclass of it, such as the
host-memory shim of ``engines/sglang/shims/``), so both plugins apply in either load order;
everything else passes through. No SGLang source is patched and nothing outside the registry is
replaced.

Settings: ``SGLANG_KVLEASE_*`` environment variables (``._settings.ENV``), defaults equal to
kvlease's. The decode needs SGLang's deferred decode KV release (on by default in 0.5.23: it is
how the decode holds a failed room's pages until its leases end) and refuses to start without it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

__all__ = ["TARGET", "kv_class_hook", "register"]

#: The function the hook wraps (its module-level copies in prefill.py/decode.py are rebound too).
TARGET = "sglang.srt.disaggregation.utils.get_kv_class"


def kv_class_hook(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND hook: for NIXL, the lease-enabled class composed over whatever the rest of the
    chain returned (stock SGLang's class, or another plugin's subclass of it); else that class."""
    cls = original(*args, **kwargs)
    transfer_backend = args[0] if args else kwargs.get("transfer_backend")
    class_type = args[1] if len(args) > 1 else kwargs.get("class_type")
    from sglang.srt.disaggregation.utils import TransferBackend  # type: ignore[import-not-found]

    if transfer_backend != TransferBackend.NIXL:
        return cls
    from . import _nixl

    return _nixl.compose(class_type, cls)


def register() -> None:
    """The plugin's entry point (called by SGLang's ``load_plugins()``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # type: ignore[import-not-found]

    HookRegistry.register(TARGET, kv_class_hook, HookType.AROUND)
    logging.getLogger("kvlease.adapters.sglang").info(
        "kvlease: SGLang plugin registered (an AROUND hook on %s)", TARGET
    )
