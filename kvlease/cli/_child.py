"""One child-process harness: an engine worker in its own OS process, driven over JSON lines.

Used by everything that runs kvlease in real processes: the transport tests
(``tests/_proc_helpers.py``, ``tests/test_nixl.py``), the NIXL benchmark
(``bench/transport_nixl.py``) and ``kvlease demo`` (``kvlease/cli/_demo_proc.py``). It lives in
the application shell, ``kvlease.cli``, because it does I/O (processes, threads, pipes), which
the sans-IO core must never import; and not in ``kvlease.transports`` because that package is
mapped from ``transports/`` at install time, which mypy cannot follow: from there every test
would see the harness as ``Any``.

The protocol: the parent writes one JSON object per line on the child's stdin (a *command*);
the child writes one JSON object per line on stdout (an *event*: ``{"ev": NAME, "t": ...}``,
stamped with ``time.monotonic()``, which is system-wide on Linux, so the parent can compare
instants across processes to *measure*; the protocol never does). Any other stdout line (NIXL
and UCX print their own) is kept as noise, never parsed as an event. The child's stdin closing
means the parent is gone.

Parent side: `ChildProcess` spawns a child, collects its events in a background thread and
waits for them; a child that exits fails the wait *at once* with `ChildExited` (exit status,
last events, stderr), instead of leaving the waiter to its timeout. Child side: `emit`,
`Commands` (stdin read by a thread), `serve` (the worker loop) and `make_transport` (the
transport factory: ``zmq`` or ``nixl``, by name).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..transports import Transport

__all__ = ["ChildExited", "ChildProcess", "Commands", "emit", "make_transport", "serve"]

Event = dict[str, Any]


class ChildExited(AssertionError):
    """The child process exited before the event a parent waited for."""


# -- parent side --------------------------------------------------------------------------------


class ChildProcess:
    """A child process, its events (in arrival order, plus a final ``eof`` event when its stdout
    closes) and ways to wait for them.

    `on_event`, when given, is called from the reader thread with every event (``eof``
    included). With `ready` (an event name) the constructor waits for that event and keeps it
    in `ready`. `capture_stderr`: keep the child's stderr for failure messages (else it is
    inherited, as the demo's children log to the demo's stderr).
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        name: str,
        env: dict[str, str] | None = None,
        ready: str | None = "ready",
        ready_timeout: float = 60.0,
        on_event: Callable[[Event], None] | None = None,
        capture_stderr: bool = True,
    ) -> None:
        self.name = name
        self.events: list[Event] = []
        self.noise: list[str] = []
        self.stderr: list[str] = []
        self._on_event = on_event
        self._cond = threading.Condition()
        self._cursor = 0
        self.proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if capture_stderr else None,
            env=env,
            text=True,
        )
        self._readers = [threading.Thread(target=self._read_stdout, daemon=True)]
        if capture_stderr:
            self._readers.append(threading.Thread(target=self._read_stderr, daemon=True))
        for t in self._readers:
            t.start()
        self.ready: Event = {}
        if ready is not None:
            try:
                self.ready = self.wait_for(lambda e: e["ev"] == ready, timeout=ready_timeout)
                with self._cond:
                    self._cursor = self.events.index(self.ready) + 1
            except BaseException:
                self.close()
                raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                ev = None
            if not isinstance(ev, dict) or "ev" not in ev:
                self.noise.append(line)
                continue
            self._add(ev)
        self._add({"ev": "eof", "t": time.monotonic()})

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)

    def _add(self, ev: Event) -> None:
        with self._cond:
            self.events.append(ev)
            self._cond.notify_all()
        if self._on_event is not None:
            self._on_event(ev)

    def send(self, **cmd: Any) -> None:
        """One command; `ChildExited` if the child is gone."""
        if not self.try_send(**cmd):
            raise ChildExited(self._why(f"could not send {cmd!r}"))

    def try_send(self, **cmd: Any) -> bool:
        """One command, if the child still reads them (False: it is gone)."""
        if self.proc.stdin is None:
            return False
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except (OSError, ValueError):
            return False
        return True

    def wait_for(self, pred: Callable[[Event], bool], timeout: float, *, start: int = 0) -> Event:
        """The first event (from index `start`) matching `pred`. Fails with `ChildExited` as
        soon as the child has exited without one, with `AssertionError` after `timeout` s."""
        deadline = time.monotonic() + timeout
        with self._cond:
            seen = start
            exited = False
            while not exited:
                for ev in self.events[seen:]:
                    if pred(ev):
                        return ev
                    exited = ev["ev"] == "eof"
                seen = max(seen, len(self.events))
                left = deadline - time.monotonic()
                if exited:
                    break
                if left <= 0:
                    raise AssertionError(self._why(f"no matching event within {timeout} s"))
                self._cond.wait(min(left, 0.2))
        # Its stdout closed: the process is exiting; reap it for the exit status.
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5.0)
        raise ChildExited(self._why("exited without the awaited event"))

    def next(self, timeout: float = 60.0) -> Event:
        """The next event (in arrival order) not yet returned by `next`, after `ready`."""
        ev = self.wait_for(lambda e: True, timeout, start=self._cursor)
        with self._cond:
            self._cursor = self.events.index(ev, self._cursor) + 1
        return ev

    def find(self, pred: Callable[[Event], bool]) -> list[Event]:
        with self._cond:
            return [e for e in self.events if pred(e)]

    def request(self, op: str, reply: str, timeout: float = 30.0, **args: Any) -> Event:
        """Send command `op` with a fresh request id and wait for its `reply` (or ``error``)."""
        rid = f"{op}-{time.monotonic_ns()}"
        self.send(op=op, rid=rid, **args)
        return self.wait_for(lambda e: e.get("rid") == rid and e["ev"] in (reply, "error"), timeout)

    def kill(self, sig: int = 9) -> float:
        """Signal the process; returns when the signal was sent (monotonic)."""
        t = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, sig)
        return t

    def close(self, exit_command: dict[str, Any] | None = None, grace: float = 3.0) -> None:
        """Ask the child to exit (`exit_command`), kill it after `grace` s, reap it, close
        the pipes and join the readers."""
        if self.proc.poll() is None and exit_command is not None:
            self.try_send(**exit_command)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        for t in self._readers:
            t.join(timeout=2.0)
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()

    def _why(self, what: str) -> str:
        rc = self.proc.poll()
        status = "running" if rc is None else f"exit status {rc}"
        with self._cond:
            last = self.events[-20:]
        tail = "".join(self.stderr[-30:] + self.noise[-10:])
        return f"{self.name} ({status}): {what}; last events: {last}\nstderr/noise:\n{tail}"


# -- child side ---------------------------------------------------------------------------------

_emit_lock = threading.Lock()


def emit(ev: str, **fields: Any) -> None:
    """One event line on stdout, stamped with ``time.monotonic()`` (unless `fields` has ``t``)."""
    fields["ev"] = ev
    fields.setdefault("t", time.monotonic())
    line = json.dumps(fields, default=str) + "\n"
    with _emit_lock:
        sys.stdout.write(line)
        sys.stdout.flush()


class Commands:
    """The parent's commands, read from stdin by a daemon thread so the worker loop never
    blocks on them. `parent_gone` turns true when stdin closes (after its last command)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Event | None] = queue.Queue()
        self.parent_gone = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in sys.stdin:
            with contextlib.suppress(ValueError):
                cmd = json.loads(line)
                if isinstance(cmd, dict):
                    self._queue.put(cmd)
        self._queue.put(None)

    def take(self) -> list[Event]:
        """Every command that has arrived, in order (never blocks)."""
        out: list[Event] = []
        while True:
            try:
                cmd = self._queue.get_nowait()
            except queue.Empty:
                return out
            if cmd is None:
                self.parent_gone = True
                return out
            out.append(cmd)


def serve(
    commands: Commands, run: Callable[[Event], bool], step: Callable[[], bool], *, until_parent_gone: bool = True
) -> None:
    """The worker loop: run each command (`run` returns False to stop), then one `step` (which
    steps the driver, reports what happened and waits a little; False to stop); until told to
    stop or, with `until_parent_gone`, until the parent is gone."""
    while True:
        for cmd in commands.take():
            if not run(cmd):
                return
        if until_parent_gone and commands.parent_gone:
            return
        if not step():
            return


def make_transport(
    kind: str, engine_id: str, rank: int = 0, *, incarnation: int | None = None, bind: str = "tcp://127.0.0.1:0"
) -> Transport:
    """A real transport by name: ``zmq`` (a `ZmqTransport` bound to `bind`) or ``nixl`` (a
    `NixlTransport` on loopback; `incarnation` is the pinner's, for its agent name)."""
    if kind == "nixl":
        from ..transports.nixl import NixlTransport

        if incarnation is None:
            return NixlTransport(engine_id, rank)
        return NixlTransport(engine_id, rank, incarnation=incarnation)
    if kind == "zmq":
        from ..transports.zmq import ZmqTransport

        return ZmqTransport(engine_id, rank, bind=bind)
    raise ValueError(f"unknown transport {kind!r}: expected 'zmq' or 'nixl'")
