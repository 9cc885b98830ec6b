"""The bench shims: the vLLM bench's `sitecustomize` (engines/vllm/shims, on the bench servers'
PYTHONPATH): its on-demand stack dump, which the bench's hang reports use
(`tools/vllm_pd.Fleet.stacks`); and the pause SGLang's host-memory plugin
(engines/sglang/shims/dram_plugin) gives NIXL's progress thread."""

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


#: An idle NIXL agent made the way vLLM and SGLang make theirs (`nixl_agent`, its progress thread
#: on), then the pause its progress thread was started with and the process's CPU time over a
#: second of nothing to do.
IDLE_AGENT = """
import sys, time
{setup}
import nixl._api as api

config = api.nixlBind.nixlAgentConfig(True)  # progress thread on, NIXL's pause: 0
config.pthrDelay = 0
api.nixlBind.nixlAgent("probe", config)
agent = api.nixl_agent("idle", api.nixl_agent_config())
t0 = time.process_time()
time.sleep(1.0)
print(config.pthrDelay, round(time.process_time() - t0, 3))
"""

#: The SGLang bench's host-memory plugin quiets NIXL's progress thread when SGLang registers it.
DRAM_PLUGIN = SHIMS.parent.parent / "sglang" / "shims" / "dram_plugin"
QUIET = "import kvlease_cpu_dram\nkvlease_cpu_dram._quiet_progress_thread()"


def _idle_agent(folder: Path | None, setup: str) -> tuple[int, float]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["UCX_NET_DEVICES"] = "lo"
    if folder is not None:
        env["PYTHONPATH"] = str(folder)
    out = subprocess.run(
        [sys.executable, "-c", IDLE_AGENT.format(setup=setup)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    delay, cpu = out.stdout.splitlines()[-1].split()  # NIXL logs to stdout before it
    return int(delay), float(cpu)


def test_the_sglang_shim_gives_nixls_progress_thread_a_pause() -> None:
    """NIXL's own agent starts its UCX progress thread with no pause between polls (a busy core per
    server); under the SGLang bench's plugin the thread waits up to a millisecond. Asserted on the
    setting the agent was made with; the CPU an idle agent used is printed, not asserted (a shared
    machine). The vLLM bench does not do this (docs/vllm-serve.md says why)."""
    bare_delay, bare_cpu = _idle_agent(None, "")
    delay, cpu = _idle_agent(DRAM_PLUGIN, QUIET)
    print(f"\nidle NIXL agent, CPU seconds over 1 s: {bare_cpu} as NIXL makes it, {cpu} under the SGLang plugin")
    assert bare_delay == 0, "NIXL's default changed: the plugin's pause may no longer be needed"
    assert delay == 1000
