"""A test-only SGLang plugin: the prefill's NIXL WRITEs straggle on request, inside a real
``sglang.launch_server``.

While the file ``arm`` exists in ``$KVLEASE_TEST_STRAGGLE_DIR``, every WRITE the prefill's KV
manager posts (``agent.transfer``) is really posted only after the number of seconds the file
holds, from a thread of its own, and its state reads ``PROC`` until then: a WRITE held in flight
(a slow link, a stalled NIC queue), with its data and notification landing late, or never if
the process dies first. Each held WRITE appends a line to ``held`` in the same folder (when it
was held, for how long) and, once posted, one to ``posted``. The proxy wraps the NIXL agent
itself, under every manager class the plugin chain builds (stock SGLang's or kvlease's), so
whatever gate a plugin puts before ``agent.transfer`` runs as it would.

Found on ``PYTHONPATH`` through ``kvlease_test_straggler-0.0.0.dist-info`` (entry point
``straggler`` in ``sglang.srt.plugins``); selected with ``SGLANG_PLUGINS``.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

_made: dict[type, type] = {}


class _Straggler:
    """The NIXL agent, with `transfer` held while armed."""

    def __init__(self, agent: Any, folder: Path) -> None:
        self._agent = agent
        self._dir = folder
        self._waiting: set[int] = set()  # id() of handles held, not posted yet
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    def _note(self, name: str, line: str) -> None:
        with self._lock, open(self._dir / name, "a") as f:
            f.write(line + "\n")

    def transfer(self, handle: Any, *a: Any, **k: Any) -> Any:
        try:
            seconds = float((self._dir / "arm").read_text().strip() or 0)
        except (OSError, ValueError):
            seconds = 0.0
        if seconds <= 0:
            return self._agent.transfer(handle, *a, **k)
        self._waiting.add(id(handle))
        self._note("held", f"{time.time():.3f} {seconds:g}")

        def post() -> None:
            time.sleep(seconds)
            try:
                state = self._agent.transfer(handle, *a, **k)
            finally:
                self._waiting.discard(id(handle))
            self._note("posted", f"{time.time():.3f} {state}")

        threading.Thread(target=post, name="straggling-write", daemon=True).start()
        return "PROC"

    def check_xfer_state(self, handle: Any) -> Any:
        if id(handle) in self._waiting:
            return "PROC"
        return self._agent.check_xfer_state(handle)


def _straggling(base: type) -> type:
    made = _made.get(base)
    if made is None:

        def __init__(self: Any, *a: Any, **k: Any) -> None:
            base.__init__(self, *a, **k)  # type: ignore[misc]
            folder = os.environ.get("KVLEASE_TEST_STRAGGLE_DIR")
            if folder and getattr(self, "agent", None) is not None:
                self.agent = _Straggler(self.agent, Path(folder))

        made = type(f"Straggling{base.__name__}", (base,), {"__init__": __init__, "__module__": __name__})
        _made[base] = made
    return made


def _around_get_kv_class(original: Any, transfer_backend: Any, class_type: Any, *a: Any, **k: Any) -> Any:
    cls = original(transfer_backend, class_type, *a, **k)
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend  # type: ignore[import-not-found]

    if transfer_backend == TransferBackend.NIXL and class_type == KVClassType.MANAGER:
        return _straggling(cls)
    return cls


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # type: ignore[import-not-found]

    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", _around_get_kv_class, HookType.AROUND)
