"""`kvlease check`: exhaustive small-scope model checking of the real core.

An explicit-state, breadth-first explorer (`explore`) drives the real `Pinner` and `Accessor`
objects through every interleaving, up to a depth bound, of the engine calls the API allows, an
adversarial network (deliver, drop, duplicate, deliver to another rank of the addressed engine,
replay, a failed transfer whose notification landed or whose WRITE may still land, one part of a
multi-part access landing before the others, a forged heartbeat at the frame bound) and time
advances to the instants that matter, each clock at an end of its drift bound, with the accessors
optionally configured apart from the pinner (`Scope.accessor_config`). Every transition is audited
against real time (`World.check` and the output handlers), every message a core emits must encode
within the frame bound, and an in-time ack of the latest heartbeat naming a lease must validate it
(the rounds bound's liveness); a violation comes back as a shortest schedule, and `to_vector` turns
it into a conformance-vector candidate.

Pure: no clock, no I/O (the `kvlease check` command times and writes).
"""

from __future__ import annotations

from ._doubles import BUG_HINTS, CHECK_BUGS, RENAMED_BUGS
from ._explore import CheckResult, Counterexample, explore, replay
from ._vector import to_vector
from ._world import KINDS, Scope, Violation, World

__all__ = [
    "BUG_HINTS",
    "CHECK_BUGS",
    "KINDS",
    "RENAMED_BUGS",
    "CheckResult",
    "Counterexample",
    "Scope",
    "Violation",
    "World",
    "explore",
    "replay",
    "to_vector",
]
