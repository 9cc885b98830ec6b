"""A found schedule as a conformance-vector candidate (spec/vectors/README.md, trace kind).

The schedule is re-executed with recording on: every core call the world made (grants, tracks,
deliveries as `receive` of the exact bytes, timeouts, access calls) becomes a step on its
endpoint at that endpoint's clock reading. `kvlease.sim._vector.build_vector` then fills each
step's `expect` from the reference core, so the candidate passes on the real core by
construction and fails an implementation that behaves like the broken one where they differ.

Pure: builds a JSON value, opens no file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._accessor import Accessor
from .._pinner import Pinner
from ..sim._vector import build_vector
from ._explore import Counterexample, replay
from ._world import PINNER, Scope

__all__ = ["to_vector"]


def to_vector(
    scope: Scope,
    cx: Counterexample,
    name: str,
    pinner_cls: Callable[..., Pinner] = Pinner,
    accessor_cls: Callable[..., Accessor] = Accessor,
) -> dict[str, Any]:
    _, world = replay(scope, cx.rates, cx.actions, pinner_cls, accessor_cls, expected=cx.message, record=True)
    engines = {PINNER, *world.engine_ranks}
    description = (
        f"`kvlease check` candidate: a shortest schedule ({len(cx.actions)} actions) that broke "
        f"'{cx.message}' against the core under test. Expectations are the reference core's answers "
        "to the same inputs. Schedule: " + " | ".join(line.split("  ", 1)[1] for line in cx.schedule)
    )
    vector = build_vector(
        name,
        description,
        scope.config,
        world.endpoints(),
        world.record or [],
        engines=engines,
        until=float("inf"),
    )
    vector["epochs"] = {
        **{name: world.epochs[0] for name, ep in world.endpoints().items() if ep["role"] == "pinner"},
        **{f"{e}.{r}": world.epochs[1 + int(e.rsplit("-", 1)[1])] for e, r in world.accessors},
    }
    vector["epochs_note"] = f"clock rates (pinner, accessor engines): {list(cx.rates)}"
    return vector
