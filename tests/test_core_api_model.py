"""Hypothesis stateful model of the API as a fault: what an engine may call, at the worst moment.

`kvlease.testing.Mesh` joins one pinner engine of p ranks to one or two accessor engines of a
ranks (p, a in {1, 2, 4}, one dividing the other), every rank of an engine on one clock (equal
readings across ranks), each engine at its own random epoch and drift. This machine drives the
*engine* side adversarially — re-track after untrack and after completion, transfers that fail
after their attached notification landed, retries, disconnect and reconnect, local releases —
and the *network* side too: any message in flight can be held, dropped, duplicated, delivered to
a sibling rank of the right engine, or replayed later (stale handshake replies included). The
mesh audits safety after every step (no stale read reported done, no validity past a free, one
free per rank, honest deadlines); this machine adds liveness on fault-free runs (a live,
connected accessor never loses a lease, whatever p and a).

The second half shows the model is worth something: each fix of the v1 review, switched off in
a test double, is caught.
"""

from __future__ import annotations

import random
import re
from typing import Any

import pytest
from conftest import EXAMPLES, STEPS
from hypothesis import Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvlease import (
    MIN_VALIDITY_MARGIN,
    AccessCompleted,
    Accessor,
    AccessStale,
    EndReason,
    LeaseConfig,
    LeaseKind,
    LeaseLost,
    LocalProtocolError,
    LostReason,
    Pinner,
    TrackedState,
)
from kvlease._doubles import (
    ForgetfulAccessor,
    NoRankCheckPinner,
    PerConnectionSeqAccessor,
    RetryAfterPostedFailureAccessor,
)
from kvlease.testing import InvariantViolation, Mesh, PeerClock

LAYOUTS = [(1, 1), (2, 2), (4, 2), (2, 4), (1, 2), (2, 1), (4, 4), (4, 1), (1, 4)]
#: Losses an engine causes itself, which a liveness check must not count against the core.
SELF_INFLICTED = (LostReason.ACCESS_FAILED, LostReason.FORGOTTEN, LostReason.UNREACHABLE)


class ApiModel(RuleBasedStateMachine):
    #: Test doubles swap these; the honest model uses the real core.
    pinner_factory: Any = Pinner
    accessor_factory: Any = Accessor
    #: Where to search; the doubles' tests narrow it to where each break shows.
    LAYOUTS: tuple[tuple[int, int], ...] = tuple(LAYOUTS)
    FAULTY: tuple[bool, ...] = (False, True)
    TWO_ENGINES: tuple[bool, ...] = (False, True)

    def __init__(self) -> None:
        super().__init__()
        self.mesh: Mesh
        self.n = 0
        self.faulty = False
        #: engine -> keys it tracks now; keys it gave up (ticket key, engine key)
        self.tracking: dict[str, set[str]] = {}
        self.given_up: dict[str, list[str]] = {}
        self.ticket_of: dict[str, str] = {}  # engine-side key -> granted key
        self.dirty: set[str] = set()  # granted keys a fault or a local release touched

    @initialize(
        data=st.data(),
        seed=st.integers(0, 2**32 - 1),
        duration=st.floats(0.6, 3.0),
        epochs=st.tuples(st.floats(1e4, 2e5), st.floats(1e4, 2e5), st.floats(1e4, 2e5)),
    )
    def setup(self, data: st.DataObject, seed: int, duration: float, epochs: tuple[float, float, float]) -> None:
        p, a = data.draw(st.sampled_from(self.LAYOUTS), label="layout")
        two = data.draw(st.sampled_from(self.TWO_ENGINES), label="two_engines")
        self.faulty = data.draw(st.sampled_from(self.FAULTY), label="faulty")
        drift = data.draw(st.sampled_from([0.0, 1e-4, 1e-2]), label="drift")
        rates = data.draw(st.tuples(st.sampled_from([-1.0, 1.0, 0.0]), st.sampled_from([-1.0, 1.0, 0.0])))
        margin = data.draw(st.sampled_from([MIN_VALIDITY_MARGIN, 0.02 * duration]), label="margin")
        cfg = LeaseConfig(
            kv_lease_duration=duration,
            max_access_time=0.1 * duration,
            max_drift_rate=drift,
            validity_margin=margin,
            decoder_kv_blocks_ttl=2 * duration,
            tombstone_limit=data.draw(st.sampled_from([4, 64]), label="tombstone_limit"),
        )
        engines = {"decode-0": a, **({"decode-1": 1} if two else {})}
        self.mesh = Mesh(
            cfg,
            random.Random(seed),
            pinner_ranks=p,
            accessor_engines=engines,
            pinner_clock=PeerClock(epochs[0], 1.0 + rates[0] * drift),
            accessor_clocks={
                "decode-0": PeerClock(epochs[1], 1.0 + rates[1] * drift),
                "decode-1": PeerClock(epochs[2], 1.0 - rates[1] * drift),
            },
            delay=(0.0, 0.1 * cfg.heartbeat_interval),
            pinner_factory=self.pinner_factory,
            accessor_factory=self.accessor_factory,
        )
        self.cfg = cfg
        self.tracking = {e: set() for e in engines}
        self.given_up = {e: [] for e in engines}

    # -- helpers ----------------------------------------------------------------------------

    def _engine(self, i: int) -> str:
        engines = sorted(self.tracking)
        return engines[i % len(engines)]

    def _ranks(self, engine: str) -> list[int]:
        return sorted(r for e, r in self.mesh.accessors if e == engine)

    def _pick(self, items: list[str] | set[str], i: int) -> str | None:
        ordered = sorted(items)
        return ordered[i % len(ordered)] if ordered else None

    def _retire_if_gone(self, engine: str) -> None:
        """Move keys no rank tracks any more to the engine's given-up list."""
        for key in sorted(self.tracking[engine]):
            if all(self.mesh.accessors[engine, r].state_of(key) is None for r in self._ranks(engine)):
                self.tracking[engine].discard(key)
                self.given_up[engine].append(key)

    # -- engine actions ---------------------------------------------------------------------

    @rule(fixed=st.booleans())
    def grant(self, fixed: bool) -> None:
        self.n += 1
        key = f"req-{self.n}"
        if fixed:
            self.mesh.grant(key, kind=LeaseKind.FIXED_TTL, ttl=1.5 * self.cfg.kv_lease_duration)
        else:
            self.mesh.grant(key)

    @rule(e=st.integers(0, 1), i=st.integers(0, 1000))
    def track(self, e: int, i: int) -> None:
        engine = self._engine(e)
        used = {self.ticket_of[k] for eng in self.tracking for k in self.tracking[eng] | set(self.given_up[eng])}
        fresh = [k for k in self.mesh.tickets if k not in used and "/again-" not in k]
        key = self._pick(fresh, i)
        if key is None:
            return
        age = self.mesh.real - self.mesh.granted_at[self.mesh.tickets[key].lease_id]
        if age > 0.3 * self.cfg.kv_lease_duration:
            self.dirty.add(key)  # the grant may lapse before the first heartbeat: no liveness promise
        self.ticket_of[key] = key
        self.tracking[engine].add(key)
        self.mesh.track(engine, key, self.mesh.tickets[key])

    @rule(e=st.integers(0, 1), i=st.integers(0, 1000), j=st.integers(0, 3))
    def retrack(self, e: int, i: int, j: int) -> None:
        """The engine tracks a ticket it gave up (untracked, completed, lost) under a new key.
        The core must refuse: LocalProtocolError, or LeaseLost(forgotten)."""
        engine = self._engine(e)
        old = self._pick(self.given_up[engine], i)
        if old is None:
            return
        granted = self.ticket_of[old]
        self.n += 1
        new = f"{old}/again-{self.n}"
        r = self._ranks(engine)[j % len(self._ranks(engine))]
        acc = self.mesh.accessors[engine, r]
        try:
            outputs = acc.track(self.mesh.now_a(engine), new, self.mesh.tickets[granted])
        except LocalProtocolError:
            event("re-track refused")
            return
        self.ticket_of[new] = granted
        self.mesh.tickets[new] = self.mesh.tickets[granted]
        self.tracking[engine].add(new)
        self.dirty.add(granted)
        self.mesh._accessor_outputs(engine, r, outputs)
        self._retire_if_gone(engine)

    @rule(e=st.integers(0, 1), i=st.integers(0, 1000), j=st.integers(0, 3))
    def untrack(self, e: int, i: int, j: int) -> None:
        engine = self._engine(e)
        key = self._pick(self.tracking[engine], i)
        if key is None:
            return
        r = self._ranks(engine)[j % len(self._ranks(engine))]
        if self.mesh.accessors[engine, r].state_of(key) in (TrackedState.ACCESSING, TrackedState.LOST):
            with pytest.raises(LocalProtocolError):
                self.mesh.untrack(engine, r, key)
            return
        self.mesh.untrack(engine, r, key)
        self._retire_if_gone(engine)

    @rule(e=st.integers(0, 1), i=st.integers(0, 1000), j=st.integers(0, 3))
    def begin(self, e: int, i: int, j: int) -> None:
        engine = self._engine(e)
        key = self._pick(self.tracking[engine], i)
        if key is None:
            return
        r = self._ranks(engine)[j % len(self._ranks(engine))]
        if self.mesh.accessors[engine, r].state_of(key) is TrackedState.WAITING:
            self.mesh.begin_access(engine, r, key)

    @rule(
        i=st.integers(0, 1000),
        how=st.sampled_from(["notified", "plain", "landed-failed", "posted-failed", "unposted-failed"]),
    )
    def end_access(self, i: int, how: str) -> None:
        open_ = sorted(self.mesh.accesses)
        if not open_:
            return
        engine, r, key = open_[i % len(open_)]
        if how == "notified":
            self.mesh.finish_access(engine, r, key, notified=True)
        elif how == "plain":
            self.mesh.finish_access(engine, r, key, notified=False)
        else:
            posted = how != "unposted-failed"
            self.mesh.fail_access(engine, r, key, posted=posted, landed=how == "landed-failed")
        self._retire_if_gone(engine)

    @rule(e=st.integers(0, 1), j=st.integers(0, 3))
    def disconnect(self, e: int, j: int) -> None:
        engine = self._engine(e)
        r = self._ranks(engine)[j % len(self._ranks(engine))]
        if any(k[0] == engine and k[1] == r for k in self.mesh.accesses):
            return  # the driver disconnects an engine it has no transfer to (it cancels those first)
        # The engine's own doing: what it tracked there is given up (unreachable), and the
        # pinner expires what nobody heartbeats any more.
        self.dirty.update(self.ticket_of[k] for k in self.tracking[engine])
        self.mesh.disconnect(engine, r)
        self._retire_if_gone(engine)

    @rule(i=st.integers(0, 1000))
    def pinner_release(self, i: int) -> None:
        key = self._pick(list(self.mesh.tickets), i)
        if key is not None:
            self.dirty.add(self.ticket_of.get(key, key))
            self.mesh.pinner_release(key)

    @rule(frac=st.floats(0.0, 1.2))
    def advance(self, frac: float) -> None:
        self.mesh.advance(frac * self.cfg.kv_lease_duration)
        for engine in self.tracking:
            self._retire_if_gone(engine)

    @rule(frac=st.floats(0.0, 0.3))
    def advance_a_little(self, frac: float) -> None:
        self.mesh.advance(frac * self.cfg.heartbeat_interval)
        for engine in self.tracking:
            self._retire_if_gone(engine)

    # -- network faults (faulty runs only) --------------------------------------------------

    @precondition(lambda self: self.faulty)
    @rule(i=st.integers(0, 1000))
    def hold(self, i: int) -> None:
        self.mesh.hold(i)

    @precondition(lambda self: self.faulty)
    @rule()
    def hold_latest(self) -> None:
        """The network delays exactly what was just sent (a Release, an access-done, a reply)."""
        self.mesh.hold(len(self.mesh.flight) - 1)

    @precondition(lambda self: self.faulty)
    @rule(i=st.integers(0, 1000))
    def drop(self, i: int) -> None:
        self.mesh.drop(i)

    @precondition(lambda self: self.faulty)
    @rule(i=st.integers(0, 1000))
    def duplicate(self, i: int) -> None:
        self.mesh.duplicate(i)

    @precondition(lambda self: self.faulty)
    @rule(i=st.integers(0, 1000), sibling=st.one_of(st.none(), st.integers(0, 3)))
    def deliver_now(self, i: int, sibling: int | None) -> None:
        self.mesh.deliver_now(i, sibling=sibling)

    @precondition(lambda self: self.faulty)
    @rule(i=st.integers(0, 1000))
    def replay(self, i: int) -> None:
        self.mesh.replay(i)

    # -- liveness ---------------------------------------------------------------------------

    @invariant()
    def live_connected_accessor_never_loses_a_lease(self) -> None:
        if not hasattr(self, "mesh") or self.faulty:
            return
        for engine, rank, ev in self.mesh.events:
            granted = self.ticket_of.get(ev.key, ev.key)
            if granted in self.dirty or self.mesh.tickets[granted].kind is LeaseKind.FIXED_TTL:
                continue  # a fixed TTL runs out by design
            if isinstance(ev, LeaseLost) and ev.reason not in SELF_INFLICTED:
                raise InvariantViolation(f"fault-free run: {engine}.{rank} lost {ev.key!r}: {ev!r}")
            if isinstance(ev, AccessStale):
                raise InvariantViolation(f"fault-free run: {engine}.{rank} got {ev!r}")
        tracked = {self.ticket_of[k] for keys in self.tracking.values() for k in keys}
        for (lid, q), (_, free) in self.mesh.frees.items():
            key = free.key
            if free.reason is EndReason.EXPIRED and key in tracked and key not in self.dirty:
                kind = self.mesh.tickets[key].kind
                if kind is LeaseKind.RENEWABLE:
                    raise InvariantViolation(f"fault-free run: tracked lease {lid} expired on rank {q}")

    def teardown(self) -> None:
        if hasattr(self, "mesh"):
            for _, _, ev in self.mesh.events:
                event(type(ev).__name__ + (f"({ev.reason.value})" if isinstance(ev, LeaseLost) else ""))
            for _, free in self.mesh.frees.values():
                event(f"Free({free.reason.value})")
            event(f"rejected: {bool(self.mesh.rejected)}")

    @invariant()
    def honest_peers_are_not_rejected(self) -> None:
        if hasattr(self, "mesh") and not self.faulty:
            assert not self.mesh.rejected, f"fault-free run rejected: {self.mesh.rejected[:3]}"


TestApiModel = ApiModel.TestCase
TestApiModel.settings = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None)


# -- the model catches each v1 hole, switched back on in a test double --------------------------


#: Rules each search leaves out, so it spends its budget where the break shows (shadowing a
#: rule with a plain method removes it from the machine).
_NOISE = ("drop", "duplicate", "replay", "disconnect", "pinner_release", "retrack", "hold")

BROKEN: dict[str, tuple[type[Pinner], type[Accessor], tuple[tuple[int, int], ...], tuple[str, ...]]] = {
    "retrack": (
        Pinner,
        ForgetfulAccessor,
        ((1, 1),),
        ("drop", "duplicate", "replay", "disconnect", "pinner_release", "hold", "advance"),
    ),
    "unbound-replies": (Pinner, PerConnectionSeqAccessor, ((1, 2), (2, 2)), ("drop", "pinner_release", "retrack")),
    "retry-after-failed-transfer": (
        Pinner,
        RetryAfterPostedFailureAccessor,
        ((1, 1),),
        (*_NOISE, "advance", "deliver_now"),
    ),
    "layout-blind-pinner": (NoRankCheckPinner, Accessor, ((2, 2), (4, 2)), ("pinner_release", "retrack")),
}


def _no_op(self: object, **kwargs: object) -> None:
    return None


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_model_catches_each_v1_hole(name: str) -> None:
    pinner_cls, accessor_cls, layouts, left_out = BROKEN[name]
    attrs_: dict[str, object] = {
        "pinner_factory": pinner_cls,
        "accessor_factory": accessor_cls,
        "LAYOUTS": layouts,
        "FAULTY": (True,),
        "TWO_ENGINES": (False,),
        **{rule_name: _no_op for rule_name in left_out},
    }
    broken = type(f"Broken_{name.replace('-', '_')}", (ApiModel,), attrs_)

    with pytest.raises((InvariantViolation, ExceptionGroup)) as caught:
        run_state_machine_as_test(
            broken,
            settings=settings(
                max_examples=max(EXAMPLES, 3000),
                stateful_step_count=max(STEPS, 40),
                deadline=None,
                phases=[Phase.generate],
                database=None,
                # A fixed sequence of examples: the search either finds the break on every run
                # or on none (a random one found it in most runs, not all, in 3,000 examples).
                derandomize=True,
            ),
        )
    found = list(caught.value.exceptions) if isinstance(caught.value, ExceptionGroup) else [caught.value]
    assert all(isinstance(e, InvariantViolation) for e in found), found
    assert any(re.search(r"stale read|valid until|second Free", str(e)) for e in found), found


def test_events_of_the_model_are_real() -> None:
    """A fault-free two-rank run completes reads (the model exercises the happy path too)."""
    cfg = LeaseConfig(kv_lease_duration=1.2, max_access_time=0.1)
    mesh = Mesh(
        cfg,
        random.Random(1),
        pinner_ranks=2,
        accessor_engines={"decode-0": 2},
        pinner_clock=PeerClock(5e4, 1.0),
        accessor_clocks={"decode-0": PeerClock(9e4, 1.0)},
        delay=(0.0, 0.01),
    )
    ticket = mesh.grant("req-1")
    mesh.track("decode-0", "req-1", ticket)
    mesh.advance(0.5)
    for r in (0, 1):
        assert mesh.begin_access("decode-0", r, "req-1").guaranteed
    mesh.advance(0.05)
    mesh.finish_access("decode-0", 0, "req-1")
    mesh.advance(0.6)
    mesh.finish_access("decode-0", 1, "req-1")
    mesh.advance(0.1)
    done = [ev for _, _, ev in mesh.events if isinstance(ev, AccessCompleted)]
    assert len(done) == 2
    assert sorted(q for (_, q), (_, f) in mesh.frees.items() if f.reason is EndReason.ACCESS_DONE) == [0, 1]
