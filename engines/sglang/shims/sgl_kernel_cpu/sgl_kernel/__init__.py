"""A stand-in for SGLang's CPU kernel package (``sgl_kernel``), for ``launch_server`` on a CPU-only
machine with ``SGLANG_USE_CPU_ENGINE=1`` (PyPI has no CPU build of it).

SGLang then imports ``<name>_cpu`` kernels at module load. This answers only names ending in
``_cpu``, each a function that raises ``NotImplementedError`` naming itself if called (the tiny
Llama of the real-pair test calls none of them on the torch-native attention path); any other name
raises ``AttributeError``, so SGLang's ``try: from sgl_kernel import X / except ImportError``
probes take their fallbacks. ``torch.ops.sgl_kernel.convert_weight_packed`` stays absent, so
SGLang's AMX paths stay off. Put this folder on ``PYTHONPATH`` of the servers only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

__version__ = "0.0.0+kvlease.stub"


def assign_req_to_token_pool_cpu(
    req_pool_indices: Any, req_to_token: Any, start_offset: Any, end_offset: Any, out_cache_loc: Any, pool_len: Any
) -> None:
    off = 0
    for r, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True):
        req_to_token[r, s:e] = out_cache_loc[off : off + e - s].to(req_to_token.dtype)
        off += e - s


def _missing(name: str) -> Callable[..., NoReturn]:
    def kernel(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"sgl_kernel stand-in: {name} is not implemented")

    return kernel


def __getattr__(name: str) -> Any:
    if name.endswith("_cpu"):
        return _missing(name)
    raise AttributeError(name)
