"""Breadth-first explicit-state exploration of `World`s, with a shortest counterexample.

State storage: each frontier state is kept as the pickle of its `World` (the real cores and all),
and every transition starts from a fresh unpickled copy of its parent. Copying beats re-executing
the action prefix here: a prefix is up to `depth` core calls, each with an encode/decode, while
unpickling a world of a few cores is one C-level pass (measured ~3x faster than `copy.deepcopy`,
and the pickle doubles as the compact frontier record). Worlds whose classes cannot be pickled
(doubles defined inside a function) fall back to `copy.deepcopy`.

Deduplication: a 128-bit BLAKE2 digest of `World.fingerprint()` (collision odds ~n^2 / 2^129:
nil at these sizes). Breadth-first order makes the first violation found a shortest one (in
actions); its schedule is rebuilt from parent links.

Reductions, and why they are sound:
* No two time advances in a row (in `World.actions`): advances compose and change nothing but
  real time, so the state after two is reachable by one from the state before the first, one
  step shallower — every state and transition it hides is explored anyway.
* `handle_timeout` only when due (deadline <= now): called earlier it returns nothing and
  changes nothing the fingerprint keeps (both cores check exactly their `next_deadline`
  conditions), so it would be a self-loop.
* Network actions over each *distinct* message in flight: copies of one message are
  interchangeable (the network is a multiset, kept sorted).
* A refused call (`LocalProtocolError`) is checked to change nothing and becomes a self-loop.
No symmetry reduction: ranks are not interchangeable (the TP layout maps them to different
pinner ranks), lease ids are ordered (ids only increase), engines have different clocks.
"""

from __future__ import annotations

import copy
import hashlib
import pickle
from collections.abc import Callable
from typing import Any

import attrs

from .._accessor import Accessor
from .._pinner import Pinner
from ._world import Action, Scope, Violation, World, describe

__all__ = ["CheckResult", "Counterexample", "explore", "replay"]


@attrs.frozen
class Counterexample:
    message: str
    rates: tuple[float, ...]
    actions: tuple[Action, ...]
    schedule: tuple[str, ...]


@attrs.define
class CheckResult:
    scope: Scope
    states: int = 0
    transitions: int = 0
    depth_reached: int = 0
    #: True when no new state was left at the depth bound: the scope is exhausted.
    exhausted: bool = False
    per_depth: list[int] = attrs.Factory(list)
    violation: Counterexample | None = None
    #: Stopped early at `max_states` (the count is then a lower bound of the scope).
    truncated: bool = False


#: Transitions between two calls of `explore`'s `progress` (a few per second at these speeds).
PROGRESS_EVERY = 2048


def _digest(world: World) -> bytes:
    return hashlib.blake2b(pickle.dumps(world.fingerprint(), protocol=5), digest_size=16).digest()


class _Store:
    """Freeze / thaw worlds (pickle, or deepcopy when a class cannot be pickled)."""

    def __init__(self, sample: World) -> None:
        try:
            pickle.loads(pickle.dumps(sample, protocol=5))
            self.pickled = True
        except (pickle.PicklingError, AttributeError, TypeError):
            self.pickled = False

    def freeze(self, world: World) -> Any:
        return pickle.dumps(world, protocol=5) if self.pickled else copy.deepcopy(world)

    def thaw(self, frozen: Any) -> World:
        return pickle.loads(frozen) if self.pickled else copy.deepcopy(frozen)  # type: ignore[no-any-return]


def explore(
    scope: Scope,
    pinner_cls: Callable[..., Pinner] = Pinner,
    accessor_cls: Callable[..., Accessor] = Accessor,
    *,
    max_states: int | None = None,
    progress: Callable[[int, int, int], None] | None = None,
) -> CheckResult:
    """Every schedule of up to `scope.depth` actions from each initial world (one per choice
    of clock rates), breadth-first; stops at the first violation (a shortest one).

    `progress`, when given, is called with the depth being explored and the states and
    transitions so far, every `PROGRESS_EVERY` transitions and at the end of each depth (the
    caller decides when to show it: the explorer reads no clock). It changes no result."""
    result = CheckResult(scope)
    parents: dict[bytes, tuple[bytes | None, Action | None]] = {}
    roots: dict[bytes, tuple[float, ...]] = {}
    frontier: list[tuple[bytes, Any]] = []
    store: _Store | None = None
    for rates in scope.rate_choices():
        w = World(scope, rates, pinner_cls, accessor_cls)
        store = store or _Store(w)
        d = _digest(w)
        if d not in parents:
            parents[d] = (None, None)
            roots[d] = rates
            frontier.append((d, store.freeze(w)))
    assert store is not None
    result.states = len(parents)
    result.per_depth.append(len(frontier))

    def fail(parent: bytes, action: Action, message: str) -> CheckResult:
        path = [action]
        node: bytes | None = parent
        while node is not None:
            up, act = parents[node]
            if act is not None:
                path.append(act)
            if up is None:
                break
            node = up
        assert node is not None
        path.reverse()
        result.violation = replay(scope, roots[node], tuple(path), pinner_cls, accessor_cls, expected=message)[0]
        return result

    for depth in range(1, scope.depth + 1):
        nxt: list[tuple[bytes, Any]] = []
        for digest, frozen in frontier:
            parent = store.thaw(frozen)
            for action in parent.actions():
                w = store.thaw(frozen)
                result.transitions += 1
                if progress is not None and result.transitions % PROGRESS_EVERY == 0:
                    progress(depth, len(parents), result.transitions)
                try:
                    w.apply(action)
                except Violation as v:
                    result.depth_reached = depth
                    return fail(digest, action, str(v))
                except Exception as e:  # an undocumented exception from a core call
                    result.depth_reached = depth
                    return fail(digest, action, f"undocumented exception {type(e).__name__}: {e}")
                d = _digest(w)
                if d in parents:
                    continue
                parents[d] = (digest, action)
                nxt.append((d, store.freeze(w)))
                if max_states is not None and len(parents) >= max_states:
                    result.states = len(parents)
                    result.depth_reached = depth
                    result.per_depth.append(len(nxt))
                    result.truncated = True
                    return result
        result.states = len(parents)
        result.per_depth.append(len(nxt))
        result.depth_reached = depth
        if progress is not None:
            progress(depth, result.states, result.transitions)
        frontier = nxt
        if not frontier:
            result.exhausted = True
            break
    return result


def replay(
    scope: Scope,
    rates: tuple[float, ...],
    actions: tuple[Action, ...],
    pinner_cls: Callable[..., Pinner] = Pinner,
    accessor_cls: Callable[..., Accessor] = Accessor,
    *,
    expected: str | None = None,
    record: bool = False,
) -> tuple[Counterexample, World]:
    """Re-execute a schedule from its initial world; describe each step. The last action must
    raise the violation (`expected`, when given). Returns it and the world after it (with
    `record`: every core call as a conformance-vector step, in `World.record`)."""
    w = World(scope, rates, pinner_cls, accessor_cls, record=record)
    lines: list[str] = []
    message = ""
    for i, action in enumerate(actions):
        lines.append(f"{i + 1:2d}. t={w.real:.6f}  {describe(w, action)}")
        try:
            w.apply(action)
        except Violation as v:
            message = str(v)
        except Exception as e:
            message = f"undocumented exception {type(e).__name__}: {e}"
        if message:
            if i != len(actions) - 1:
                raise AssertionError(f"schedule broke early at step {i + 1}: {message}")
            break
    if expected is not None and message != expected:
        raise AssertionError(f"replay does not reproduce the violation: {message!r} != {expected!r}")
    return Counterexample(message, rates, actions, tuple(lines)), w
