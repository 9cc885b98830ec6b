"""Main-venv side of the SGLang adapter tests: start `_sglang_proc.py` under ``.venv-sglang`` and
talk to it (JSON lines). The SGLang environment is made by ``engines/sglang/setup.sh`` (which the
README's test command runs first); without it the tests fail under CI and skip elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SGLANG_PY = ROOT / ".venv-sglang" / "bin" / "python"
PROC = Path(__file__).resolve().parent / "_sglang_proc.py"


def need_sglang() -> None:
    if SGLANG_PY.exists():
        return
    msg = f"{SGLANG_PY} missing: run `bash engines/sglang/setup.sh` (the README's test command does)"
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


class Rank:
    """One `_sglang_proc.py` process (one SGLang rank)."""

    def __init__(self, role: str, port: int, env: dict[str, str], log: Path) -> None:
        self.role = role
        self.port = port
        self._log = open(log, "wb")  # noqa: SIM115 - closed in close()
        full_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [str(SGLANG_PY), str(PROC), role, str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=full_env,
            cwd=str(ROOT),
        )
        self._answers: queue.Queue[dict[str, Any]] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.hello: dict[str, Any] = {}
        self.log_path = log

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace")
            if line.startswith("@@ "):
                self._answers.put(json.loads(line[3:]))
        self._answers.put({"ok": False, "error": "process exited", "eof": True})

    def wait_ready(self, timeout: float = 180.0) -> dict[str, Any]:
        self.hello = self._get(timeout)
        assert self.hello.get("ok"), f"{self.role} failed to start: {self.hello}\n{self.tail()}"
        return self.hello

    def _get(self, timeout: float) -> dict[str, Any]:
        try:
            return self._answers.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.role}: no answer in {timeout}s\n{self.tail()}") from None

    def call(self, op: str, timeout: float = 60.0, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": op, **kw}) + "\n").encode())
        self.proc.stdin.flush()
        ans = self._get(timeout)
        assert ans.get("ok"), f"{self.role} {op} {kw}: {ans}\n{self.tail()}"
        return ans

    def kill(self) -> float:
        """SIGKILL; returns the wall-clock time just before the signal. Does not wait for the
        exit (a big process can take seconds to be torn down): `close` reaps it."""
        t = time.time()
        self.proc.send_signal(signal.SIGKILL)
        return t

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.kill()
            self.proc.wait(timeout=30)
        self._log.close()
