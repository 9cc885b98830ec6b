"""Which vLLM releases the adapter supports, and the check that runs before any of vLLM's
internals load.

The adapter subclasses vLLM's NIXL connector internals (its pull and push workers and
schedulers, their private state), which change between minor releases of vLLM. Imported into
another release they would fail deep inside vLLM, or import and quietly misbehave, so the
connector modules refuse to load (`UnsupportedVllmVersion`, an `ImportError` that vLLM's
connector factory shows as it is) unless the installed vLLM is one of `SUPPORTED_SERIES`.
`check` is pure (the version is an argument), so the policy is tested without vLLM.

An operator who wants to try another release anyway names it exactly in
``KVLEASE_VLLM_VERSION`` (``KVLEASE_VLLM_VERSION=0.34.0``): the adapter then loads, and says at
start-up that the combination is untested. A later upgrade fails again until named again.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from kvlease import __version__ as KVLEASE_VERSION

__all__ = ["OVERRIDE_ENV", "SUPPORTED_SERIES", "UnsupportedVllmVersion", "check", "series_of"]

#: The vLLM release series (major, minor) this adapter is built and tested against.
SUPPORTED_SERIES: tuple[tuple[int, int], ...] = ((0, 33),)
#: The environment variable naming one exact unsupported vLLM version to load under anyway.
OVERRIDE_ENV = "KVLEASE_VLLM_VERSION"


class UnsupportedVllmVersion(ImportError):
    """The installed vLLM is not one the adapter supports (the message says what to do)."""


def series_of(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as ``0.33.0``, ``0.33.1.dev3+g1234`` or
    ``0.33.0+cpu``; None when it has none (vLLM reports ``dev`` without its version file)."""
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\D|$)", version)
    return None if m is None else (int(m.group(1)), int(m.group(2)))


def _names(series: tuple[tuple[int, int], ...]) -> str:
    return ", ".join(f"{a}.{b}.x" for a, b in series)


def check(version: str, env: Mapping[str, str] | None = None, where: str = "") -> bool:
    """Whether vLLM `version` may load: True when supported, False when unsupported but named
    in ``KVLEASE_VLLM_VERSION`` (untested: say so at start-up). Raises `UnsupportedVllmVersion`
    otherwise, saying which releases are supported and what to do."""
    if series_of(version) in SUPPORTED_SERIES:
        return True
    env = os.environ if env is None else env
    if env.get(OVERRIDE_ENV, "").strip() == version.strip():
        return False
    supported = _names(SUPPORTED_SERIES)
    at = f" ({where})" if where else ""
    raise UnsupportedVllmVersion(
        f"kvlease {KVLEASE_VERSION}'s vLLM adapter supports vLLM {supported}; this environment has vLLM "
        f"{version}{at}. Install a supported vLLM (pip install 'vllm=={supported.replace('.x', '.*')}'), or a "
        f"kvlease release that supports vLLM {version} (docs/vllm-operations.md lists which kvlease supports "
        f"which vLLM). To try vLLM {version} anyway, untested (the adapter overrides vLLM's NIXL connector "
        f"internals, which change between vLLM releases), set {OVERRIDE_ENV}={version}."
    )
