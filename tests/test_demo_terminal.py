"""`kvlease demo` under a real terminal (a pty via pexpect): the live view renders, and Ctrl-C
exits cleanly leaving no child process behind (checked by scanning /proc, no psutil)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pexpect
import pytest
from procstat import proc_stats

pytestmark = pytest.mark.slow


def children_of(pid: int) -> set[int]:
    """Pids whose parent is `pid`, from /proc."""
    return {child for child, _name, fields in proc_stats() if int(fields[1]) == pid}


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _as_a_terminal_shell_starts_it() -> None:
    """A shell starts a foreground job with SIGINT at its default. The test run itself may
    ignore SIGINT (a background job of a shell without job control: ``bash dev.sh test &``),
    and an ignored signal stays ignored across fork and exec; Python then installs no
    KeyboardInterrupt handler, Ctrl-C does nothing and the demo finishes its scenario (exit 0).
    That is the user's choice to honour (``nohup``), not what this test is about."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_live_view_renders_and_ctrl_c_leaves_no_child() -> None:
    child = pexpect.spawn(
        sys.executable,
        ["-m", "kvlease", "demo", "--scenario", "overload", "--requests", "4"],
        dimensions=(40, 160),
        env={**os.environ, "TERM": "xterm-256color"},
        encoding="utf-8",
        timeout=30,
        preexec_fn=_as_a_terminal_shell_starts_it,
    )
    try:
        child.expect("pinned KV blocks per state")
        child.expect("pinned, awaiting read")
        # Wait until both P and D are running, then interrupt mid-scenario.
        deadline = time.monotonic() + 20
        kids: set[int] = set()
        while time.monotonic() < deadline:
            kids = children_of(child.pid)
            if len(kids) >= 2:
                break
            time.sleep(0.1)
        assert len(kids) >= 2, "the demo did not start its pinner and accessor processes"
        child.sendintr()  # Ctrl-C: SIGINT to the terminal's foreground process group
        child.expect(pexpect.EOF, timeout=20)
        child.close()
        assert child.exitstatus == 130 or child.signalstatus == signal.SIGINT
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(alive(k) for k in kids):
            time.sleep(0.1)
        assert not any(alive(k) for k in kids), f"children left behind: {[k for k in kids if alive(k)]}"
    finally:
        if child.isalive():
            child.terminate(force=True)


def test_sigterm_also_stops_children() -> None:
    child = pexpect.spawn(
        sys.executable,
        ["-m", "kvlease", "demo", "--scenario", "overload", "--requests", "2"],
        dimensions=(40, 160),
        encoding="utf-8",
        timeout=30,
        preexec_fn=_as_a_terminal_shell_starts_it,
    )
    try:
        child.expect("pinned KV blocks per state")
        deadline = time.monotonic() + 20
        kids: set[int] = set()
        while time.monotonic() < deadline and len(kids) < 2:
            kids = children_of(child.pid)
            time.sleep(0.1)
        assert len(kids) >= 2
        os.kill(child.pid, signal.SIGTERM)  # only the demo: it must stop its children itself
        child.expect(pexpect.EOF, timeout=20)
        child.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(alive(k) for k in kids):
            time.sleep(0.1)
        assert not any(alive(k) for k in kids)
    finally:
        if child.isalive():
            child.terminate(force=True)
