"""Importing this module checks the installed vLLM against the supported releases
(`kvlease.adapters.vllm._version`). The connector modules import it before anything of vLLM's,
so an unsupported vLLM is refused with a message saying what to do, not with a traceback from
inside vLLM's internals."""

from __future__ import annotations

import vllm

from ._version import check

__all__ = ["VLLM_VERSION", "VLLM_VERSION_SUPPORTED"]

#: The installed vLLM's version.
VLLM_VERSION: str = str(getattr(vllm, "__version__", "unknown"))
#: False when the installed vLLM is unsupported and loads only because ``KVLEASE_VLLM_VERSION``
#: names it (the connector warns at start-up).
VLLM_VERSION_SUPPORTED: bool = check(VLLM_VERSION, where=str(getattr(vllm, "__file__", "")))
