"""The vLLM bench's `sitecustomize` (engines/vllm/shims, on the bench servers' PYTHONPATH): its
on-demand stack dump, which the bench's hang reports use (`tools/vllm_pd.Fleet.stacks`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SHIMS = Path(__file__).resolve().parent.parent / "engines" / "vllm" / "shims"

#: A process stalled the way a bench server can be: one thread holding the interpreter in a long C
#: call (a backtracking regular expression never lets the GIL go), another waiting for it.
STALLED = """
import re, threading, time

def waiting_for_the_interpreter():
    time.sleep(120)

threading.Thread(target=waiting_for_the_interpreter, daemon=True).start()

def holding_the_interpreter():
    re.match(r"(a*)*b", "a" * 64)

print("ready", flush=True)
holding_the_interpreter()
"""


def _stalled(with_shim: bool) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if with_shim:
        env["PYTHONPATH"] = str(SHIMS)
    proc = subprocess.Popen([sys.executable, "-c", STALLED], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n"
    time.sleep(0.5)  # inside the regular expression by now
    return proc


@pytest.mark.skipif(not hasattr(signal, "SIGUSR2"), reason="no SIGUSR2 on this platform")
def test_sigusr2_dumps_every_threads_stack_while_one_holds_the_interpreter() -> None:
    proc = _stalled(with_shim=True)
    try:
        proc.send_signal(signal.SIGUSR2)
        time.sleep(1.0)
        assert proc.poll() is None, "the dump must not end the process"
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=30)
    text = err.decode(errors="replace")
    assert "holding_the_interpreter" in text and "waiting_for_the_interpreter" in text, text
    # Without the shim the same signal ends the process (its default action) and says nothing.
    bare = _stalled(with_shim=False)
    bare.send_signal(signal.SIGUSR2)
    assert bare.wait(timeout=30) == -signal.SIGUSR2
    assert b"holding_the_interpreter" not in bare.communicate(timeout=30)[1]
