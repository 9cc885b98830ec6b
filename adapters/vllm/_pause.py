"""The producer's paced step for held blocks, woken by the engine's input (pure: no vLLM import).

A producer that holds blocks for decoders' READs keeps its engine stepping (vLLM 0.33 would
otherwise block on its input queue with the lease's end unreported), and kvlease paces a step
whose only work is held blocks (`connector.HELD_STEP_EVERY`). The pause runs on the engine's
own thread, inside the scheduler's step: a plain sleep there held every request that arrived
meanwhile until it ended. `InputPause` waits on the engine core's input queue instead, so a
request (or an abort) ends the pause the moment it is queued.
"""

from __future__ import annotations

import queue
import time
from types import FrameType
from typing import Any

#: How many frames up from the scheduler's hook the engine core is looked for.
STACK_DEPTH = 16


def engine_input_queue(frame: FrameType | None, depth: int = STACK_DEPTH) -> queue.Queue[Any] | None:
    """The ``input_queue`` of the engine core whose step called the scheduler: the nearest
    ``self`` up the stack from `frame` that has one that is a `queue.Queue` (vLLM's
    ``EngineCoreProc``; an in-process engine without one gives None)."""
    for _ in range(depth):
        if frame is None:
            return None
        found = getattr(frame.f_locals.get("self"), "input_queue", None)
        if isinstance(found, queue.Queue):
            return found
        frame = frame.f_back
    return None


class InputPause:
    """Pauses that end early when the input queue gets an item; a plain sleep without one."""

    def __init__(self, input_queue: queue.Queue[Any] | None) -> None:
        self.input_queue = input_queue

    @property
    def wakes_on_input(self) -> bool:
        return self.input_queue is not None

    def __call__(self, seconds: float) -> None:
        """Wait `seconds`, or until the queue holds an item (at once if it holds one already)."""
        q = self.input_queue
        if q is None:
            time.sleep(seconds)
            return
        # ``put`` notifies ``not_empty`` under the queue's own lock: checked and waited for
        # under that lock, an item put at any moment ends the wait.
        with q.not_empty:
            if not q._qsize():
                q.not_empty.wait(seconds)
