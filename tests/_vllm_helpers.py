"""Process handling for the vLLM adapter tests: `Node` runs tests/_vllm_node.py under .venv-vllm."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ports import free_port

ROOT = Path(__file__).resolve().parents[1]


def _main_checkout(root: Path) -> Path | None:
    """The main checkout of the git worktree `root` (None when `root` is not a linked worktree)."""
    try:
        gitdir = Path((root / ".git").read_text().split("gitdir:", 1)[1].strip())
        common = (gitdir / (gitdir / "commondir").read_text().strip()).resolve()
    except (OSError, IndexError):
        return None
    return common.parent


VENV_PY = ROOT / ".venv-vllm" / "bin" / "python"
if not VENV_PY.exists() and (main := _main_checkout(ROOT)) is not None:
    # A git worktree shares its main checkout's .venv-vllm; the nodes still import kvlease from
    # this checkout (`_vllm_node.use_this_checkout`), not from the main one it is installed from.
    VENV_PY = main / ".venv-vllm" / "bin" / "python"
#: A complete model directory without weights (a tiny Llama: vLLM reads only config.json here).
MODEL = ROOT / "engines" / "vllm" / "tiny-llama"
NODE = Path(__file__).resolve().parent / "_vllm_node.py"


def require_vllm_env() -> None:
    """Fail under CI when .venv-vllm is missing (the test command creates it); skip otherwise."""
    problem = None
    if not VENV_PY.exists():
        problem = f"{VENV_PY} is missing: run `bash engines/vllm/setup.sh` (bash dev.sh test does)"
    elif not (MODEL / "config.json").exists():
        problem = f"the weightless tiny Llama is missing at {MODEL}"
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(problem)
        pytest.skip(problem)


def in_clock(offset: int, cmd: list[str]) -> list[str]:
    """`cmd` in a new Linux time namespace whose CLOCK_MONOTONIC (and CLOCK_BOOTTIME) read
    `offset` whole seconds off the host's: the clock epoch of another host, on this one. Killing
    the wrapper kills the command (``--kill-child``)."""
    return ["unshare", "--time", f"--monotonic={offset}", f"--boottime={offset}", "--fork", "--kill-child", *cmd]


def require_time_namespaces() -> None:
    """Skip, saying why, where this host cannot give a process a clock of its own (a kernel
    without time namespaces, or no CAP_SYS_ADMIN): nothing a test command can install."""
    probe = in_clock(1000, [sys.executable, "-c", "import time; print(time.monotonic())"])
    try:
        r = subprocess.run(probe, capture_output=True, text=True, timeout=30, check=False)
    except OSError as exc:
        pytest.skip(f"no unshare(1) to give a process its own clock: {exc}")
    if r.returncode != 0:
        pytest.skip(f"this host refuses a time namespace (unshare --time): {r.stderr.strip()[:200]}")
    if float(r.stdout) < time.monotonic() + 900:
        pytest.skip("a time namespace did not move CLOCK_MONOTONIC")


class PortTaken(AssertionError):
    """A node could not bind a port chosen for it (taken in between): start it again."""


class Node:
    """One vLLM instance (scheduler + connector worker) in its own process."""

    def __init__(
        self,
        name: str,
        role: str,
        connector: str,
        *,
        extra: dict[str, Any] | None = None,
        bad_config: dict[str, Any] | None = None,
        build: list[dict[str, Any]] | None = None,
        max_num_seqs: int = 4,
        log_dir: Path | None = None,
        tp: int = 1,
        model: Path = MODEL,
        keep_pin: bool = False,
        clock_offset: int = 0,
        worker_clock_offset: int = 0,
    ) -> None:
        """`clock_offset`: this node (its scheduler and TP rank 0) runs with CLOCK_MONOTONIC that
        many seconds off the host's, as on another host (a Linux time namespace: `in_clock`);
        `worker_clock_offset`: the same for its TP ranks 1.. (multi-node TP), off the host's."""
        self.name = name
        self.port = free_port()
        env = dict(os.environ)
        env.update(
            VLLM_TARGET_DEVICE="cpu",
            VLLM_LOGGING_STREAM="ext://sys.stderr",  # vLLM's (and kvlease's) log lines to the log file
            HF_HUB_OFFLINE="1",
            UCX_NET_DEVICES="lo",
            VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(self.port),
            KVT_DIST_PORT=str(free_port()),
            PYTHONUNBUFFERED="1",
            VLLM_LOGGING_LEVEL=os.environ.get("KVT_VLLM_LOG", "WARNING"),
        )
        for k in ("COVERAGE_PROCESS_START", "PYTHONPATH"):
            env.pop(k, None)
        cmd = [
            str(VENV_PY),
            str(NODE),
            "--role",
            role,
            "--connector",
            connector,
            "--engine-id",
            name,
            "--model",
            str(model),
            "--tp",
            str(tp),
            "--extra",
            json.dumps(extra or {}),
            "--max-num-seqs",
            str(max_num_seqs),
        ]
        if bad_config is not None:
            cmd += ["--bad-config", json.dumps(bad_config)]
        if build:
            cmd += ["--build", json.dumps(build)]
        if keep_pin:
            cmd.append("--keep-pin")
        if worker_clock_offset:
            cmd += ["--worker-clock-offset", str(worker_clock_offset)]
        if clock_offset:
            cmd = in_clock(clock_offset, cmd)
        self.log_path = (log_dir or Path("/tmp")) / f"vllm-node-{name}-{os.getpid()}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.events: list[dict[str, Any]] = []
        self._q: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("EV "):
                ev = json.loads(line[3:])
                self._q.put(ev)
        self._q.put(None)

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def wait(self, ev: str, timeout: float = 60.0, **match: Any) -> dict[str, Any]:
        """The first event `ev` (with the given fields) seen so far or arriving within `timeout`."""
        for e in self.events:
            if e["ev"] == ev and all(e.get(k) == v for k, v in match.items()):
                return e
        deadline = time.monotonic() + timeout
        while True:
            left = max(0.01, min(deadline - time.monotonic(), 1.0))
            if ev == "ready" and "Address already in use" in self.tail(200):
                raise PortTaken(f"{self.name}: a port was taken:\n" + self.tail())
            if deadline - time.monotonic() <= 0:
                raise AssertionError(
                    f"{self.name}: no {ev} {match} within {timeout} s; log {self.log_path}:\n" + self.tail()
                )
            try:
                got = self._q.get(timeout=left)
            except queue.Empty:
                continue
            if got is None:
                if ev == "ready" and "Address already in use" in self.tail(200):
                    raise PortTaken(f"{self.name}: a port was taken:\n" + self.tail())
                raise AssertionError(f"{self.name} exited (rc={self.proc.poll()}) before {ev} {match}:\n" + self.tail())
            self.events.append(got)
            if got["ev"] == ev and all(got.get(k) == v for k, v in match.items()):
                return got

    def drain(self) -> list[dict[str, Any]]:
        """Every event that has arrived so far."""
        while True:
            try:
                e = self._q.get_nowait()
            except queue.Empty:
                return self.events
            if e is not None:
                self.events.append(e)

    def seen(self, ev: str, **match: Any) -> list[dict[str, Any]]:
        self.drain()
        return [e for e in self.events if e["ev"] == ev and all(e.get(k) == v for k, v in match.items())]

    def stats(self) -> dict[str, Any]:
        n = len(self.seen("stats"))
        self.send(op="stats")
        deadline = time.monotonic() + 30
        while len(self.seen("stats")) <= n:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: no stats")
            time.sleep(0.01)
        return self.seen("stats")[-1]

    def tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(op="exit")
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._log.close()


def settled_stats(node: Node, expected: Callable[[dict[str, Any]], dict[str, float]], timeout: float = 15.0) -> Any:
    """`node.stats()` once each Prometheus counter that `expected(stats)` names has the value it
    gives: kvlease reports its counters to vLLM's stats at most every half second (summed), so
    vLLM's metrics trail the driver's counters by up to that long."""
    deadline = time.monotonic() + timeout
    while True:
        stats = node.stats()
        want = expected(stats)
        if all(stats["prometheus"].get(k) == v for k, v in want.items()):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"{node.name}: Prometheus {stats['prometheus']} never reached {want}")
        time.sleep(0.3)


def print_events(*nodes: Node) -> None:
    for n in nodes:
        for e in n.drain():
            print(n.name, e, file=sys.stderr)


@contextlib.contextmanager
def nodes_up(specs: dict[str, dict[str, Any]], timeout: float = 300.0) -> Iterator[dict[str, Node]]:
    """A node per spec (name -> `Node` arguments), each ready within `timeout`: one whose port
    was taken while it started is started again (twice at most). All are closed on the way out."""
    nodes = {name: Node(name, **spec) for name, spec in specs.items()}
    try:
        for name in specs:
            for attempt in range(3):
                try:
                    nodes[name].wait("ready", timeout=timeout)
                    break
                except PortTaken:
                    if attempt == 2:
                        raise
                    nodes[name].close()
                    nodes[name] = Node(name, **specs[name])
        yield nodes
    finally:
        for n in nodes.values():
            n.close()
