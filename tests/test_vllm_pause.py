"""The producer's paced step for held blocks ends when a request arrives (pure: runs in the main
environment, without vLLM; the real engine's queue is found in tests/test_vllm_serve.py)."""

from __future__ import annotations

import queue
import sys
import threading
import time
from typing import Any

from kvlease.adapters.vllm._pause import InputPause, engine_input_queue


class _EngineCore:
    """Shaped like vLLM's ``EngineCoreProc`` where the pause looks: an ``input_queue``, and a
    step that reaches the scheduler's hook a few calls down."""

    def __init__(self) -> None:
        self.input_queue: queue.Queue[Any] = queue.Queue()

    def step(self) -> queue.Queue[Any] | None:
        return _Scheduler().schedule()


class _Scheduler:
    input_queue = "not a queue"  # an attribute of that name that is no queue is passed over

    def schedule(self) -> queue.Queue[Any] | None:
        return _Connector().build_connector_meta()


class _Connector:
    def build_connector_meta(self) -> queue.Queue[Any] | None:
        return engine_input_queue(sys._getframe(1))


def test_the_engine_cores_queue_is_found_up_the_schedulers_call_stack() -> None:
    core = _EngineCore()
    assert core.step() is core.input_queue
    # Not there (an in-process engine), or beyond the depth looked at: no queue, a plain sleep.
    assert _Scheduler().schedule() is None
    assert engine_input_queue(sys._getframe(), depth=0) is None


def test_a_request_put_during_the_pause_ends_it() -> None:
    q: queue.Queue[Any] = queue.Queue()
    pause = InputPause(q)
    assert pause.wakes_on_input
    threading.Timer(0.2, q.put, args=(("ADD", "req-1"),)).start()
    start = time.monotonic()
    pause(60.0)  # a sleep would hold the test for a minute
    assert time.monotonic() - start < 30.0
    assert q.get_nowait() == ("ADD", "req-1")  # the pause takes nothing from the queue


def test_a_request_already_queued_ends_the_pause_at_once() -> None:
    q: queue.Queue[Any] = queue.Queue()
    q.put(("ABORT", "req-2"))
    start = time.monotonic()
    InputPause(q)(60.0)
    assert time.monotonic() - start < 30.0
    assert q.qsize() == 1


def test_with_nothing_queued_the_pause_lasts_its_time() -> None:
    for pause in (InputPause(queue.Queue()), InputPause(None)):
        start = time.monotonic()
        pause(0.05)
        assert time.monotonic() - start >= 0.04
    assert not InputPause(None).wakes_on_input
