"""`kvlease check`: exhaustive small-scope model checking of the real core.

An explicit-state, breadth-first explorer (`explore`) drives the real `Pinner` and `Accessor`
objects through every interleaving, up to a depth bound, of the engine calls the API allows, an
adversarial network (deliver, drop, duplicate, deliver to another rank of the addressed engine,
replay, a failed transfer whose notification landed) and time advances to the instants that
matter, each clock at an end of its drift bound. Every transition is audited against real time
(`World.check` and the output handlers); a violation comes back as a shortest schedule, and
`to_vector` turns it into a conformance-vector candidate.

Pure: no clock, no I/O (the `kvlease check` command times and writes).
"""

from __future__ import annotations

from ._doubles import BUG_HINTS, CHECK_BUGS
from ._explore import CheckResult, Counterexample, explore, replay
from ._vector import to_vector
from ._world import KINDS, Scope, Violation, World

__all__ = [
    "BUG_HINTS",
    "CHECK_BUGS",
    "KINDS",
    "CheckResult",
    "Counterexample",
    "Scope",
    "Violation",
    "World",
    "explore",
    "replay",
    "to_vector",
]
