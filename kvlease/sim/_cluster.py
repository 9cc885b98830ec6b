"""The discrete-event simulation of a P/D cluster driving the real kvlease core: `Cluster`.

Owns the event loop (virtual real time, one event heap plus one of idle engines' wake-ups) and
the dispatch of a wake-up to the engine's boundary. Everything else is a layer below it, one
module per concern (see `_kernel`): the network, the checks, the workload and faults, the
prefill (pinner) and decode (accessor) engines and API-level adversity. Every kvlease message
is encoded and decoded on its way; the engines hold real `Pinner` and `Accessor` objects (or
the baseline models of `Policy.FIXED_*`), fed only their own local clock.

Must never read a clock, sleep, start a thread or do I/O: a run is a pure function of its
scenario, policy and seed, so a seed reproduces bit for bit.
"""

from __future__ import annotations

import heapq
import math

from ._adversity import _Adversity
from ._kernel import AccessorFactory, PinnerFactory
from ._results import RunResult, Violation
from ._world import DecodeEngine, PrefillEngine, SimEngine

__all__ = ["AccessorFactory", "Cluster", "PinnerFactory", "RunResult", "Violation"]

_INF = math.inf
_heappop = heapq.heappop


class Cluster(_Adversity):
    """One run of one policy on one scenario. `run()` returns the `RunResult`.

    `pinner_factory` / `accessor_factory` build the core objects (a test passes deliberately
    broken doubles to show the checks can fail). With `check=True` every safety and liveness
    claim is checked as the run goes and violations are collected; `trace=True` records an
    event trace (slower) for the campaign's minimized reports.

    With `scenario.api` (kvlease policy only) the engines and their transport also misuse the
    API at the worst moment: re-track a ticket after untrack, completion, disconnect or a failed
    transfer, hand a ticket to a second request, deliver a transfer's attached notification and
    then report the transfer failed (or fail before posting and retry), misroute messages and
    handshake replies to a sibling rank of the right engine, deliver replies again later,
    disconnect, end a transfer exactly at valid_until and have a pinner handle a message exactly
    at a lease's expiry. Each draws from its own random stream (`api_rngs`), so the scenario
    without it runs exactly as before and one switched off leaves the others' draws alone.

    The constructor (`_kernel._Kernel`) takes the scenario, the policy, the core factories and
    the ``check`` / ``trace`` / ``record`` switches; with ``record`` every core call is kept in
    `recorded` as a conformance-vector step, addressed to one of `endpoints`.
    """

    def run(self) -> RunResult:
        sc = self.sc
        wl = sc.workload
        for f in sc.faults:
            self._at(f.at, self._fault, f)
        if self.api is not None and self.api.disconnect > 0:
            for de in self.d.values():
                self._at(self.api_rngs["disconnect"].expovariate(self.api.disconnect), self._disconnect, de)
        self._at(0.0, self._arrival, None)
        if wl.sample_every > 0:
            self._at(0.0, self._sample, None)
        heap = self._heap
        wakes = self._wakes
        end = wl.duration
        events = 0
        pop = _heappop
        while True:
            # Sequence numbers are unique across both heaps: the comparison never reaches `fn`.
            if wakes and (not heap or wakes[0] < heap[0]):
                t, _, fn, arg = pop(wakes)
            elif heap:
                t, _, fn, arg = pop(heap)
            else:
                break
            if t > end:
                break
            self.now = t
            events += 1
            fn(arg)
        self.now = end
        self._set_pinned(0.0)
        self.result.events = events
        if self.check:
            self._final_checks()
        return self.result

    def _wake(self, arg: tuple[SimEngine, int, float]) -> None:
        eng, gen, t = arg
        if gen != eng.gen or not eng.alive or eng.stepping or t != eng.wake_at:
            return
        eng.wake_at = _INF
        if isinstance(eng, PrefillEngine):
            self._p_boundary(eng)
        else:
            assert isinstance(eng, DecodeEngine)
            self._d_boundary(eng, stepped=False)
