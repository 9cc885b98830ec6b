"""One state of the explored system, and every transition out of it, audited in real time.

A `World` holds the REAL cores — one `Pinner` per pinner rank (one engine, one clock) and one
`Accessor` per rank of each accessor engine (one clock per engine) — the network (every message
in flight as its encoded bytes, addressed to one rank of one engine; a bounded history of
delivered messages for stale replays), real time, and the ground truth the audit needs (frees,
the spec's expiry formula per lease and pinner rank, accesses in real time).

`World.actions()` lists every transition allowed from this state (engine calls the API allows,
network actions over each distinct message in flight, time advances to the instants that
matter); `World.apply(action)` performs one on this world (the explorer applies it to a copy)
and raises `Violation` if an invariant breaks. `World.fingerprint()` is the canonical key the
explorer deduplicates on.

Pure: no clock, no I/O. Every "now" is an endpoint's local reading of the world's real time:
``local = epoch + rate * real``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, assert_never

import attrs

from .._accessor import Accessor, TrackedState
from .._clock import LocalTime
from .._codec import decode, encode
from .._config import LeaseConfig
from .._errors import EncodeError, LocalProtocolError
from .._events import (
    AccessCompleted,
    AccessorOutput,
    AccessStale,
    EndReason,
    Free,
    HandshakeNeeded,
    LeaseLost,
    PinnerOutput,
    Rejected,
    Send,
)
from .._layout import tp_layout
from .._messages import AccessDone, HandshakeReply, Heartbeat, HeartbeatAck, LeaseKind, LeaseTicket, Message
from .._pinner import LeaseState, Pinner

__all__ = ["Action", "Scope", "Violation", "World"]

PINNER = "prefill-0"
INCARNATION = 0x5EED0001
#: World lease ids: a pinner's id plus this times its incarnation's generation (0, then 1 after a
#: restart), so the audit tells a restarted pinner's reused ids from its old incarnation's.
GEN = 1_000_000


def glid(incarnation: int, lease_id: int) -> int:
    """The world's id of lease `lease_id` of pinner incarnation `incarnation`."""
    return lease_id + GEN * (incarnation - INCARNATION)


#: How far before / after an instant that matters a time advance lands, real seconds. Far above
#: float rounding at the epochs used (~1e5 s), far below every protocol timing.
DELTA = 1e-5
#: Tolerance for instants compared across clock conversions (as `kvlease.testing`).
TOL = 1e-6

#: An action is a small tuple of plain values: its first item names it (see `World.apply`).
Action = tuple[Any, ...]


class Violation(AssertionError):
    """An invariant broke (the message says which, with the numbers)."""


KINDS = ("renewable", "fixed", "push")
#: The explored configuration: a 6 s lease (heartbeat every 1 s, extension 4 s), a 9 s fixed
#: TTL, a 0.5 s access bound, a 1 % drift bound (large, so rate extremes matter) and the
#: smallest validity margin the config allows.
CHECK_CONFIG = LeaseConfig(
    kv_lease_duration=6.0,
    max_access_time=0.5,
    decoder_kv_blocks_ttl=9.0,
    max_drift_rate=1e-2,
    validity_margin=1e-3,
)


@attrs.frozen
class Scope:
    """What the explorer covers. Epochs and rates are fixed per run: `rates` lists the clock
    rate of the pinner engine then of each accessor engine, each an end of [1-rho, 1+rho]."""

    pinner_ranks: int = 1
    accessor_ranks: int = 1
    engines: int = 1
    leases: int = 1
    kinds: tuple[str, ...] = ("renewable",)
    depth: int = 10
    history: int = 0
    #: Action families left out (a narrower scope): names as `World.apply` dispatches on.
    without: frozenset[str] = frozenset()
    rates: tuple[float, ...] | None = None
    config: LeaseConfig = attrs.field(factory=lambda: CHECK_CONFIG)
    #: Pinner restarts allowed per run (0 or 1): the "restart" action.
    restarts: int = 0
    #: The accessors' own configuration (a rolling config change: the two sides configured
    #: apart); None: the pinner's `config`. Validity must follow the stricter of the two.
    accessor_config: LeaseConfig | None = None

    @property
    def accessor_cfg(self) -> LeaseConfig:
        return self.config if self.accessor_config is None else self.accessor_config

    def rate_choices(self) -> list[tuple[float, ...]]:
        """Every combination of extreme rates (pinner, accessor engines...), or the one given.
        The extremes are those of the larger drift bound of the two configurations."""
        if self.rates is not None:
            return [self.rates]
        rho = max(self.config.max_drift_rate, self.accessor_cfg.max_drift_rate)
        out: list[tuple[float, ...]] = [()]
        for _ in range(1 + self.engines):
            out = [(*r, x) for r in out for x in (1.0 - rho, 1.0 + rho)]
        return out


def _pname(q: int, generation: int) -> str:
    """A pinner rank's endpoint name in recorded vectors (a restarted incarnation is another)."""
    return f"P{q}" if generation == 0 else f"P{q}.r{generation}"


def engine_name(i: int) -> str:
    return f"decode-{i}"


def _session(engine: int, rank: int) -> int:
    return 1000 * (engine + 1) + rank + 1  # a fixed, distinct session per accessor process


@attrs.define
class _Access:
    engine: str
    rank: int
    key: str
    lease_id: int  # the world's id (`glid`)
    begin: float
    targets: tuple[int, ...]
    notifications: dict[int, bytes]  # pinner rank -> the access-done attached to its part
    attempt: int
    push: bool
    end: float | None = None
    #: A target rank freed the lease before the access ended (in the world's order of events,
    #: which is the real order even when readings are equal): it must not be reported done.
    overlapped: bool = False
    #: Pinner ranks whose part of a multi-part access has landed: its notification went out
    #: then, while the other parts still run (the "part" action).
    parts_done: set[int] = attrs.Factory(set)


class World:
    """See the module docstring. Copied (pickle / deepcopy) by the explorer, never shared."""

    def __init__(
        self,
        scope: Scope,
        rates: tuple[float, ...],
        pinner_cls: Callable[..., Pinner] = Pinner,
        accessor_cls: Callable[..., Accessor] = Accessor,
        *,
        record: bool = False,
    ) -> None:
        cfg = scope.config
        self.scope = scope
        self.cfg = cfg
        self.acfg = scope.accessor_cfg
        #: The real-time bound on one access (READ/WRITE), whichever side states the larger.
        self.access_bound = max(cfg.max_access_time, self.acfg.max_access_time)
        self.real = 0.0
        # Arbitrary, distinct epochs (large, so float rounding is exercised).
        self.epochs = [91_000.0] + [12_345.5 + 40_000.0 * i for i in range(scope.engines)]
        self.rates = rates
        p = scope.pinner_ranks
        self.pinner_cls = pinner_cls
        self.incarnation = INCARNATION
        self.restarted_at: list[float] = []  # real instants of pinner restarts
        self.pinners = [pinner_cls(cfg, PINNER, INCARNATION, rank=q, ranks=p) for q in range(p)]
        self.engine_ranks = {engine_name(i): scope.accessor_ranks for i in range(scope.engines)}
        self.accessors: dict[tuple[str, int], Accessor] = {}
        for i in range(scope.engines):
            for r in range(scope.accessor_ranks):
                self.accessors[engine_name(i), r] = accessor_cls(
                    self.acfg, engine_name(i), session=_session(i, r), rank=r, ranks=scope.accessor_ranks
                )
        # The network: (to_pinner, engine, rank, bytes), a multiset kept sorted.
        self.flight: list[tuple[bool, str, int, bytes]] = []
        self.delivered: list[tuple[bool, str, int, bytes]] = []
        # Engine-side bookkeeping.
        self.tickets: dict[str, LeaseTicket] = {}  # request key -> ticket
        # Ground truth below is keyed by the world's lease id (`glid`), not the pinner's.
        self.lease_kind: dict[int, str] = {}  # lease -> "renewable" | "fixed" | "push"
        self.tracked_by: dict[int, str] = {}  # lease -> the accessor engine that tracked it
        self.retracks = 0
        self.granted = 0
        self.next_lid = 0  # the pinner's last lease id (restarts at 0 with the incarnation)
        # Ground truth (real time / pinner clock).
        self.frees: dict[tuple[int, int], tuple[float, Free]] = {}
        self.formula: dict[tuple[int, int], float] = {}  # (lease, rank) -> spec expiry, pinner clock
        self.hb_seq: dict[tuple[int, int, str, int], int] = {}  # (lease, q, engine, arank) -> last renewing seq
        self.done_heard: dict[tuple[int, int], set[tuple[str, int, int]]] = {}
        self.accesses: dict[tuple[str, int, str], _Access] = {}
        self.finished: dict[tuple[str, int, str], _Access] = {}
        #: (accessor engine, rank, reply bytes) of every handshake reply delivered (audit of stale duplicates).
        self.replies_heard: set[tuple[str, int, bytes]] = set()
        #: (lease, pinner rank) -> the real instant until which a WRITE of a posted, failed push
        #: access may still land there (its begin plus the access bound): never freed before.
        self.landing: dict[tuple[int, int], float] = {}
        #: The rounds audit (liveness): (engine, rank, seq) -> (t_send, incarnation, ids, pinner
        #: ranks whose renewing ack was delivered) of each heartbeat an accessor sent that is
        #: still the latest naming one of its ids; (engine, rank, lease) -> that latest seq.
        self.hb_sent: dict[tuple[str, int, int], tuple[float, int, tuple[int, ...], frozenset[int]]] = {}
        self.hb_latest: dict[tuple[str, int, int], int] = {}
        self.last_advance = False
        self.record: list[dict[str, Any]] | None = [] if record else None

    # -- clocks ------------------------------------------------------------------------------

    def now_p(self) -> LocalTime:
        return LocalTime(self.epochs[0] + self.rates[0] * self.real)

    def now_a(self, engine: str) -> LocalTime:
        i = int(engine.rsplit("-", 1)[1])
        return LocalTime(self.epochs[1 + i] + self.rates[1 + i] * self.real)

    def real_of_p(self, local: float) -> float:
        return (local - self.epochs[0]) / self.rates[0]

    def real_of_a(self, engine: str, local: float) -> float:
        i = int(engine.rsplit("-", 1)[1])
        return (local - self.epochs[1 + i]) / self.rates[1 + i]

    # -- recording (conformance-vector steps, only when replaying a found schedule) ---------

    def endpoints(self) -> dict[str, dict[str, Any]]:
        eps: dict[str, dict[str, Any]] = {}
        for g in range(len(self.restarted_at) + 1):
            for q in range(len(self.pinners)):
                eps[_pname(q, g)] = {
                    "role": "pinner",
                    "engine_id": PINNER,
                    "incarnation": INCARNATION + g,
                    "rank": q,
                    "ranks": len(self.pinners),
                }
        base = attrs.asdict(self.cfg)
        own = {k: v for k, v in attrs.asdict(self.acfg).items() if v != base[k]}
        for (e, r), acc in self.accessors.items():
            eps[f"{e}.{r}"] = {
                "role": "accessor",
                "engine_id": e,
                "rank": r,
                "ranks": acc.ranks,
                "session": acc.session,
            }
            if own:  # configured apart from the pinner (vector format 2)
                eps[f"{e}.{r}"]["config"] = own
        return eps

    def _rec(self, endpoint: str, now: float, op: str, args: dict[str, Any] | None = None) -> None:
        if self.record is not None:
            step: dict[str, Any] = {"endpoint": endpoint, "now": now, "op": op, "t": self.real}
            if args:
                step["args"] = args
            self.record.append(step)

    # -- fingerprint -------------------------------------------------------------------------

    def fingerprint(self) -> Hashable:
        """Canonical key of everything that decides the future: the cores' state (private
        fields read here only), the network, real time and the audit's ground truth. Left out
        as behaviour-irrelevant: counters, each core's latest `now` (time never runs backwards
        in a world, so it only guards misuse), heap layouts (taken as multisets: pops and
        peeks depend on the multiset alone), the delivered history's order past its bound."""
        return (
            self.real,
            self.rates,
            self.incarnation,
            tuple(self.restarted_at),
            tuple(_pinner_fp(p) for p in self.pinners),
            tuple(_accessor_fp(a) for a in self.accessors.values()),
            tuple(self.flight),
            tuple(self.delivered),
            tuple(sorted(self.tickets.items(), key=lambda kv: kv[0])),
            tuple(sorted(self.tracked_by.items())),
            tuple(sorted(self.replies_heard)),
            tuple(sorted((k, v[0], v[1].reason) for k, v in self.frees.items())),
            tuple(sorted(self.formula.items())),
            tuple(sorted(self.hb_seq.items())),
            tuple(sorted((k, tuple(sorted(v))) for k, v in self.done_heard.items())),
            tuple(
                sorted(
                    (k, a.begin, a.attempt, a.overlapped, tuple(sorted(a.parts_done))) for k, a in self.accesses.items()
                )
            ),
            tuple(sorted((k, a.begin, a.end, a.attempt, a.overlapped) for k, a in self.finished.items())),
            tuple(sorted(self.landing.items())),
            tuple(sorted(self.hb_sent.items())),
            tuple(sorted(self.hb_latest.items())),
        )

    # -- actions -----------------------------------------------------------------------------

    def actions(self) -> list[Action]:
        """Every transition from here (the explorer prunes by depth)."""
        sc = self.scope
        out: list[Action] = []
        no = sc.without
        if self.granted < sc.leases and "grant" not in no:
            out.extend(("grant", k) for k in sc.kinds)
        if len(self.restarted_at) < sc.restarts and "restart" not in no and self._may_restart():
            out.append(("restart",))
        for key, ticket in sorted(self.tickets.items()):
            lid = glid(ticket.incarnation, ticket.lease_id)
            if "#" in key:
                continue
            if (
                "release" not in no
                and ticket.incarnation == self.incarnation
                and any(p.info(ticket.lease_id) is not None for p in self.pinners)
            ):
                out.append(("release", key))
            if lid not in self.tracked_by and "track" not in no:
                out.extend(("track", e, key) for e in self.engine_ranks)
        for (e, r), acc in self.accessors.items():
            for key in sorted(self.tickets):
                state = acc.state_of(key)
                base = key.split("#")[0]
                lid = glid(self.tickets[key].incarnation, self.tickets[key].lease_id)
                if state is None and "retrack" not in no and "#" not in key and self.tracked_by.get(lid) == e:
                    out.append(("retrack", e, r, base))
                if state in (TrackedState.WAITING, TrackedState.CONFIRMING) and "untrack" not in no:
                    out.append(("untrack", e, r, key))
                if state is TrackedState.WAITING and "begin" not in no:
                    out.append(("begin", e, r, key))
                if (e, r, key) in self.accesses:
                    a = self.accesses[e, r, key]
                    if "part" not in no and len(a.targets) - len(a.parts_done) > 1:
                        out.extend(("part", e, r, key, q) for q in a.targets if q not in a.parts_done)
                    if "finish" not in no:
                        out.append(("finish", e, r, key, True))
                        out.append(("finish", e, r, key, False))
                    if "fail" not in no:
                        out.extend(("fail", e, r, key, how) for how in ("landed", "posted", "unposted"))
            if (
                "disconnect" not in no
                and acc.clock_estimator(PINNER) is not None
                and not any(k[0] == e and k[1] == r for k in self.accesses)
            ):
                out.append(("disconnect", e, r))
        if "bigbeat" not in no:
            out.extend(("bigbeat", q) for q in range(len(self.pinners)))
        # Timeouts: an endpoint whose deadline has come.
        now_p = self.now_p()
        for q, p in enumerate(self.pinners):
            nd = p.next_deadline()
            if nd is not None and nd <= now_p:
                out.append(("timeout", "P", q))
        for (e, r), acc in self.accessors.items():
            nd = acc.next_deadline()
            if nd is not None and nd <= self.now_a(e):
                out.append(("timeout", e, r))
        # The network, over each distinct message in flight.
        seen: set[tuple[bool, str, int, bytes]] = set()
        for i, m in enumerate(self.flight):
            if m in seen:
                continue
            seen.add(m)
            out.append(("deliver", i))
            if "drop" not in no:
                out.append(("drop", i))
            if "dup" not in no:
                out.append(("dup", i))
            if "misroute" not in no:
                ranks = len(self.pinners) if m[0] else self.engine_ranks[m[1]]
                out.extend(("misroute", i, q) for q in range(ranks) if q != m[2])
            if "cross" not in no and not m[0]:
                out.extend(("cross", i, e) for e in self.engine_ranks if e != m[1] and m[2] < self.engine_ranks[e])
        if "replay" not in no:
            out.extend(("replay", j) for j in range(len(self.delivered)))
        # Time: never two advances in a row (the second is reachable directly from the state
        # before the first, one step shallower: advances compose and change nothing else).
        if not self.last_advance and "advance" not in no:
            out.extend(("advance", t) for t in self._instants())
        return out

    def _instants(self) -> list[float]:
        """Real instants that matter, just before and just after each: every endpoint's next
        deadline, each live lease's expiry on each pinner rank, each accessor validity end."""
        marks: set[float] = set()
        for p in self.pinners:
            nd = p.next_deadline()
            if nd is not None:
                marks.add(self.real_of_p(nd))
            for lid in p.live_ids():
                info = p.info(lid)
                assert info is not None
                marks.add(self.real_of_p(info.expiry))
        for (e, _), acc in self.accessors.items():
            nd = acc.next_deadline()
            if nd is not None:
                marks.add(self.real_of_a(e, nd))
            for key in self.tickets:
                v = acc.valid_until(key)
                if v is not None:
                    marks.add(self.real_of_a(e, v))
        out = {t + d for t in marks for d in (-DELTA, DELTA)}
        return sorted(t for t in out if t > self.real)

    def apply(self, action: Action) -> None:
        """Perform `action` here; raise `Violation` when an invariant breaks."""
        self.last_advance = False
        match action[0]:
            case "grant":
                self._grant(action[1])
            case "restart":
                self._restart()
            case "release":
                lid = self.tickets[action[1]].lease_id
                for q in range(len(self.pinners)):
                    self._release(q, lid)
            case "track":
                _, e, key = action
                self.tracked_by[glid(self.tickets[key].incarnation, self.tickets[key].lease_id)] = e
                for r in range(self.engine_ranks[e]):
                    self._track(e, r, key, key)
            case "retrack":
                _, e, r, base = action
                self.retracks += 1
                key = f"{base}#{self.retracks}"
                self.tickets[key] = self.tickets[base]
                self._track(e, r, key, base)
            case "untrack":
                _, e, r, key = action
                acc = self.accessors[e, r]
                now = self.now_a(e)
                self._rec(f"{e}.{r}", now, "untrack", {"key": key})
                self._acc_out(e, r, self._call_a(e, r, lambda: acc.untrack(now, key)))
            case "begin":
                self._begin(*action[1:])
            case "finish":
                self._finish(*action[1:])
            case "fail":
                self._fail(*action[1:])
            case "disconnect":
                _, e, r = action
                self._forget_rounds(e, r)  # the core forgets what it had outstanding there
                acc = self.accessors[e, r]
                now = self.now_a(e)
                self._rec(f"{e}.{r}", now, "disconnect", {"engine_id": PINNER})
                self._acc_out(e, r, self._call_a(e, r, lambda: acc.disconnect(now, PINNER)))
            case "timeout":
                self._timeout(action[1], action[2])
            case "deliver":
                self._deliver(self.flight.pop(action[1]))
            case "drop":
                self.flight.pop(action[1])
            case "dup":
                self._send(self.flight[action[1]])
            case "misroute":
                m = self.flight.pop(action[1])
                self._deliver((m[0], m[1], action[2], m[3]))
            case "cross":
                m = self.flight.pop(action[1])
                self._deliver((m[0], action[2], m[2], m[3]))
            case "replay":
                self._deliver(self.delivered[action[1]], replay=True)
            case "part":
                self._part(*action[1:])
            case "bigbeat":
                self._bigbeat(action[1])
            case "advance":
                self.real = action[1]
                self.last_advance = True
                self.landing = {k: t for k, t in self.landing.items() if t > self.real}
            case other:
                raise ValueError(f"unknown action {other!r}")
        self.check()

    # -- pinner restart ----------------------------------------------------------------------

    def _may_restart(self) -> bool:
        """A restart destroys the old incarnation's memory, which no protocol can warn an
        accessor of in time: a lease an accessor may already count valid is out of the
        protocol's reach. So the pinner restarts only when every lease still live on it was never
        tracked (no heartbeat, ack or access can name it) and no access is in flight."""
        if self.accesses:
            return False
        return all(glid(self.incarnation, pid) not in self.tracked_by for p in self.pinners for pid in p.live_ids())

    def _restart(self) -> None:
        """The pinner engine's workers are replaced by new ones: a new incarnation, the same
        engine id and ranks, lease ids from 1 again. Messages in flight stay in the network.
        Every lease still live on the old incarnation counts as freed at this instant."""
        for q, p in enumerate(self.pinners):
            for pid in p.live_ids():
                info = p.info(pid)
                assert info is not None
                k = (glid(self.incarnation, pid), q)
                if k in self.frees:
                    raise Violation(f"lease {pid} is live on pinner rank {q} after its Free")
                self.frees[k] = (self.real, Free(pid, info.key, EndReason.RELEASED, self.now_p()))
        self.restarted_at.append(self.real)
        self.incarnation += 1
        self.next_lid = 0
        n = len(self.pinners)
        self.pinners = [self.pinner_cls(self.cfg, PINNER, self.incarnation, rank=q, ranks=n) for q in range(n)]

    def _pn(self, q: int) -> str:
        return _pname(q, len(self.restarted_at))

    # -- engine actions ----------------------------------------------------------------------

    def _grant(self, kind: str) -> None:
        self.granted += 1
        self.next_lid += 1
        lid = self.next_lid
        g = glid(self.incarnation, lid)
        key = f"k{self.granted}"
        now = self.now_p()
        lk = LeaseKind.FIXED_TTL if kind == "fixed" else LeaseKind.RENEWABLE
        push = kind == "push"
        ticket: LeaseTicket | None = None
        for q, p in enumerate(self.pinners):
            args: dict[str, Any] = {"key": key, "kind": lk.value, "push": push, "lease_id": lid}
            self._rec(self._pn(q), now, "grant", args)
            t = p.grant(now, key, kind=lk, push=push, lease_id=lid)
            ticket = ticket or t
            duration = self.cfg.decoder_kv_blocks_ttl if lk is LeaseKind.FIXED_TTL else self.cfg.kv_lease_duration
            self.formula[g, q] = now + duration
        assert ticket is not None
        self.tickets[key] = LeaseTicket.from_dict(ticket.to_dict())  # travels as transfer parameters
        self.lease_kind[g] = kind

    def _release(self, q: int, lid: int) -> None:
        p = self.pinners[q]
        now = self.now_p()
        self._rec(self._pn(q), now, "release", {"lease_id": lid})
        self._pinner_out(q, self._call_p(q, lambda: p.release(now, lid)))

    def _track(self, e: str, r: int, key: str, base: str) -> None:
        acc = self.accessors[e, r]
        now = self.now_a(e)
        ticket = self.tickets[base]
        push = self.lease_kind[glid(ticket.incarnation, ticket.lease_id)] == "push"
        self._rec(f"{e}.{r}", now, "track", {"key": key, "ticket": ticket.to_dict(), "push": push})
        self._acc_out(e, r, self._call_a(e, r, lambda: acc.track(now, key, ticket, push=push)))

    def _begin(self, e: str, r: int, key: str) -> None:
        acc = self.accessors[e, r]
        now = self.now_a(e)
        self._rec(f"{e}.{r}", now, "begin_access", {"key": key})
        d = acc.begin_access(now, key)
        if d.allowed:
            first = d.notifications[0]
            lid = glid(first.incarnation, first.lease_id)
            self.accesses[e, r, key] = _Access(
                e,
                r,
                key,
                lid,
                self.real,
                d.targets,
                {q: encode(d.notification_for(q)) for q in d.targets},
                first.attempt,
                self.lease_kind[lid] == "push",
                overlapped=any((lid, q) in self.frees for q in d.targets),
            )

    def _part(self, e: str, r: int, key: str, q: int) -> None:
        """One part of a multi-part access (the one from pinner rank `q`) has landed: the
        transport sends its attached notification now, while the other parts still run."""
        access = self.accesses[e, r, key]
        access.parts_done.add(q)
        self._send((True, PINNER, q, access.notifications[q]))

    def _finish(self, e: str, r: int, key: str, notified: bool) -> None:
        access = self.accesses.pop((e, r, key))
        access.end = self.real
        self._check_write(access)
        self.finished[e, r, key] = access
        access.overlapped = access.overlapped or any(
            (access.lease_id, q) in self.frees for q in access.targets if q not in access.parts_done
        )
        if notified:
            for q in access.targets:
                if q not in access.parts_done:
                    self._send((True, PINNER, q, access.notifications[q]))
        acc = self.accessors[e, r]
        now = self.now_a(e)
        self._rec(f"{e}.{r}", now, "access_finished", {"key": key, "notified": notified})
        self._acc_out(e, r, self._call_a(e, r, lambda: acc.access_finished(now, key, notified=notified)))

    def _fail(self, e: str, r: int, key: str, how: str) -> None:
        access = self.accesses.pop((e, r, key))
        access.end = self.real
        self._check_write(access)
        if how == "landed":  # the notification reached every target, then the transport failed
            for q in access.targets:
                if q not in access.parts_done:
                    self._deliver((True, PINNER, q, access.notifications[q]))
        elif how == "posted" and access.push:
            # The WRITE may still land (a cancel races the completion) until the access bound.
            until = access.begin + self.access_bound
            for q in access.targets:
                if q not in access.parts_done and until > self.real:
                    self.landing[access.lease_id, q] = max(until, self.landing.get((access.lease_id, q), until))
        acc = self.accessors[e, r]
        now = self.now_a(e)
        posted = how != "unposted"
        self._rec(f"{e}.{r}", now, "access_failed", {"key": key, "posted": posted})
        self._acc_out(e, r, self._call_a(e, r, lambda: acc.access_failed(now, key, posted=posted)))

    def _timeout(self, who: str, idx: int) -> None:
        if who == "P":
            p = self.pinners[idx]
            now = self.now_p()
            self._rec(self._pn(idx), now, "handle_timeout")
            outs = p.handle_timeout(now)
            after = p.next_deadline()
            if after is not None and after <= now:
                raise Violation(f"pinner rank {idx}: next_deadline {after} <= now {now} after handle_timeout")
            self._pinner_out(idx, outs)
        else:
            acc = self.accessors[who, idx]
            now = self.now_a(who)
            self._rec(f"{who}.{idx}", now, "handle_timeout")
            a_outs = acc.handle_timeout(now)
            a_after = acc.next_deadline()
            if a_after is not None and a_after <= now:
                raise Violation(f"accessor {who}.{idx}: next_deadline {a_after} <= now {now} after handle_timeout")
            self._acc_out(who, idx, a_outs)

    def _bigbeat(self, q: int) -> None:
        """The network carries anything (no deployment key): a heartbeat in the name of an
        accessor rank of this pinner rank, as large as the frame bound allows, of unknown ids
        2^32 apart (of another incarnation), so its ack's lists cost more than the heartbeat's. The pinner must answer
        within its bound (the send audit) or refuse it. Fed to the core directly: it is no
        accessor's, so the spec's formula and the rounds audit do not see it."""
        p = self.pinners[q]
        r = next(
            r for r in range(self.scope.accessor_ranks) if q in tp_layout(p.ranks, self.scope.accessor_ranks, r).targets
        )
        e = engine_name(0)
        # Another incarnation's ids: answered `unknown` at once (this incarnation's ids at or
        # above the next id would be held first, spec §5.5, and answered a heartbeat later).
        data = _big_heartbeat(
            self.cfg.max_message_bytes, e, r, self.scope.accessor_ranks, _session(0, r), self.incarnation ^ 1
        )
        now = self.now_p()
        self._rec(self._pn(q), now, "receive", {"hex": data.hex()})
        msg = decode(data)
        self._pinner_out(q, self._call_p(q, lambda: p.receive(now, msg), local=False))

    # -- calls that may be refused -----------------------------------------------------------

    def _call_a(
        self, e: str, r: int, fn: Callable[[], tuple[AccessorOutput, ...]], *, local: bool = True
    ) -> tuple[AccessorOutput, ...]:
        """A core call; `local`: a call by the engine, which may refuse misuse. A message
        from the network (`local=False`) must never raise."""
        acc = self.accessors[e, r]
        before = _accessor_fp(acc)
        try:
            return fn()
        except LocalProtocolError as exc:
            if not local:
                raise Violation(f"accessor {e}.{r}: receive raised LocalProtocolError: {exc}") from None
            # A refused misuse is a legal outcome of the action; it must change nothing (§8).
            if _accessor_fp(acc) != before:
                raise Violation(f"accessor {e}.{r}: a call refused with LocalProtocolError changed its state") from None
            return ()

    def _call_p(
        self, q: int, fn: Callable[[], tuple[PinnerOutput, ...]], *, local: bool = True
    ) -> tuple[PinnerOutput, ...]:
        p = self.pinners[q]
        before = _pinner_fp(p)
        try:
            return fn()
        except LocalProtocolError as exc:
            if not local:
                raise Violation(f"pinner rank {q}: receive raised LocalProtocolError: {exc}") from None
            if _pinner_fp(p) != before:
                raise Violation(f"pinner rank {q}: a call refused with LocalProtocolError changed its state") from None
            return ()

    # -- the network -------------------------------------------------------------------------

    def _send(self, m: tuple[bool, str, int, bytes]) -> None:
        self.flight.append(m)
        self.flight.sort()

    def _deliver(self, m: tuple[bool, str, int, bytes], *, replay: bool = False) -> None:
        if not replay and self.scope.history:
            if m in self.delivered:
                self.delivered.remove(m)
            self.delivered.append(m)
            del self.delivered[: -self.scope.history]
        to_pinner, engine, rank, data = m
        msg = decode(data)
        if to_pinner:
            q = rank
            now = self.now_p()
            self._observe_heartbeat(q, now, msg)
            if isinstance(msg, AccessDone) and msg.to_rank == q:  # another rank's part counts nothing here
                done = self.done_heard.setdefault((glid(msg.incarnation, msg.lease_id), q), set())
                done.add((msg.engine_id, msg.rank, msg.attempt))
            self._rec(self._pn(q), now, "receive", {"hex": data.hex()})
            p = self.pinners[q]
            self._pinner_out(q, self._call_p(q, lambda: p.receive(now, msg), local=False))
        else:
            acc = self.accessors[engine, rank]
            now = self.now_a(engine)
            self._rec(f"{engine}.{rank}", now, "receive", {"hex": data.hex()})
            outs = self._call_a(engine, rank, lambda: acc.receive(now, msg), local=False)
            if isinstance(msg, HandshakeReply):
                heard = (engine, rank, data)
                if heard in self.replies_heard:
                    lost = [
                        o
                        for o in outs
                        if isinstance(o, LeaseLost) and self.tickets[o.key].incarnation == self.incarnation
                    ]
                    if lost:  # leases of the live incarnation: a stale reply reverted the engine
                        raise Violation(
                            f"a late duplicate of a handshake reply {engine}.{rank} already received (pinner "
                            f"incarnation {msg.incarnation:#x}, seq {msg.seq}) dropped live lease(s): {lost!r}"
                        )
                if msg.incarnation != self.incarnation:
                    lost = [
                        o
                        for o in outs
                        if isinstance(o, LeaseLost) and self.tickets[o.key].incarnation == self.incarnation
                    ]
                    if lost:  # v3 hole 6: a reply of the old incarnation decided a new lease's fate
                        raise Violation(
                            f"a handshake reply of the pinner's previous incarnation {msg.incarnation:#x} "
                            f"reached {engine}.{rank} after a ticket of the live one was tracked, and dropped "
                            f"live lease(s): {lost!r}"
                        )
                self.replies_heard.add(heard)
                self._forget_rounds(engine, rank)  # a new connection or terms may clear them
            self._acc_out(engine, rank, outs)
            if isinstance(msg, HeartbeatAck):
                self._check_rounds(engine, rank, msg)

    def _observe_heartbeat(self, q: int, now: float, msg: object) -> None:
        """The spec's expiry formula (PROTOCOL §5): a renewable lease's expiry becomes
        ``max(expiry, now + E)`` on a heartbeat from the accessor it is held for, newer than any
        that extended it, while ACTIVE and ``expiry > now``; nothing else moves it."""
        if not isinstance(msg, Heartbeat) or msg.incarnation != self.incarnation:
            return
        p = self.pinners[q]
        if q not in tp_layout(p.ranks, msg.ranks, msg.rank).targets:
            return
        for pid in msg.lease_ids:
            info = p.info(pid)
            lid = glid(msg.incarnation, pid)
            spec = self.formula.get((lid, q))
            if info is None or spec is None or info.state is not LeaseState.ACTIVE or spec <= now:
                continue
            if self.tracked_by.get(lid) != msg.engine_id:
                continue
            k = (lid, q, msg.engine_id, msg.rank)
            if msg.seq <= self.hb_seq.get(k, 0):
                continue
            self.hb_seq[k] = msg.seq
            if info.kind is LeaseKind.RENEWABLE:
                self.formula[lid, q] = max(spec, now + self.cfg.lease_extension)

    # -- dispatch ----------------------------------------------------------------------------

    def _pinner_out(self, q: int, outputs: tuple[PinnerOutput, ...]) -> None:
        for o in outputs:
            match o:
                case Send():
                    if o.rank is None:
                        raise Violation(f"pinner rank {q} sent to every rank: {o!r}")
                    self._send((False, o.engine_id, o.rank, self._wire(f"pinner rank {q}", o.message, self.cfg)))
                case Free():
                    self._on_free(q, o)
                case Rejected():
                    pass
                case _:
                    assert_never(o)

    def _acc_out(self, e: str, r: int, outputs: tuple[AccessorOutput, ...]) -> None:
        for o in outputs:
            match o:
                case Send():
                    if o.rank is None:
                        raise Violation(f"{e}.{r} sent to every rank: {o!r}")
                    # After the handshake an accessor's frames fit the pinner's bound too.
                    bound = min(self.acfg.max_message_bytes, self.cfg.max_message_bytes)
                    data = self._wire(f"{e}.{r}", o.message, self.acfg, bound)
                    if isinstance(o.message, Heartbeat):
                        self._sent_heartbeat(e, r, o.message)
                    self._send((True, o.engine_id, o.rank, data))
                case HandshakeNeeded():
                    self._send((True, o.engine_id, 0, self._wire(f"{e}.{r}", o.message, self.acfg)))
                case AccessCompleted():
                    self._on_completed(e, r, o)
                case LeaseLost() | AccessStale() | Rejected():
                    pass
                case _:
                    assert_never(o)

    # -- audit -------------------------------------------------------------------------------

    @staticmethod
    def _wire(who: str, msg: Message, cfg: LeaseConfig, bound: int | None = None) -> bytes:
        """Encode one message a core emitted: every one must encode, within the frame bound."""
        try:
            data = encode(msg)
        except EncodeError as exc:
            raise Violation(f"{who} emitted a {type(msg).__name__} that cannot be encoded: {exc}") from None
        limit = (cfg.max_message_bytes if bound is None else bound) - cfg.frame_overhead
        if len(data) > limit:
            raise Violation(
                f"{who} emitted a {type(msg).__name__} of {len(data)} bytes, over the {limit}-byte frame bound"
            )
        return data

    def _on_free(self, q: int, free: Free) -> None:
        lid = glid(self.incarnation, free.lease_id)
        k = (lid, q)
        if k in self.frees:
            raise Violation(f"second Free of lease {free.lease_id} on pinner rank {q}: {free!r}")
        self.frees[k] = (self.real, free)
        for a in self.accesses.values():
            if a.lease_id != lid or q not in a.targets or q in a.parts_done:
                continue
            a.overlapped = True
            if a.push and self.real < a.begin + self.access_bound:
                raise Violation(f"push lease {free.lease_id} freed on pinner rank {q} with a write in flight")
        until = self.landing.get(k)
        if until is not None and self.real < until:
            raise Violation(
                f"push lease {free.lease_id} freed on pinner rank {q} at real {self.real:.6f}, while the WRITE of a "
                f"posted failed access may still land there (until real {until:.6f})"
            )
        if free.reason is EndReason.EXPIRED:
            spec = self.formula[k] + (self.cfg.push_guard if self.lease_kind[lid] == "push" else 0.0)
            if float(free.at) < spec - TOL:
                raise Violation(f"lease {free.lease_id} freed on rank {q} at {free.at}, before its expiry {spec}")

    def _check_write(self, access: _Access) -> None:
        if not access.push:
            return
        for q in access.targets:
            freed = self.frees.get((access.lease_id, q))
            if freed is not None and freed[0] < self.real:
                raise Violation(f"push write into lease {access.lease_id} ran past its free on rank {q}")

    def _on_completed(self, e: str, r: int, ev: AccessCompleted) -> None:
        access = self.finished.get((e, r, ev.key))
        if access is None or access.end is None:
            raise Violation(f"AccessCompleted for {e}.{r} {ev.key!r} with no finished access")
        if access.overlapped:
            frees = [(q, self.frees[access.lease_id, q]) for q in access.targets if (access.lease_id, q) in self.frees]
            raise Violation(
                f"stale read reported done: {e}.{r} accessed {ev.key!r} (lease {access.lease_id}) during real "
                f"[{access.begin:.6f}, {access.end:.6f}], but pinner rank(s) freed it before it ended: "
                + ", ".join(f"rank {q} at {t:.6f} ({f.reason.value})" for q, (t, f) in frees)
            )

    def _forget_rounds(self, e: str, r: int) -> None:
        for k in [k for k in self.hb_sent if k[:2] == (e, r)]:
            del self.hb_sent[k]
        for k in [k for k in self.hb_latest if k[:2] == (e, r)]:
            del self.hb_latest[k]

    def _sent_heartbeat(self, e: str, r: int, hb: Heartbeat) -> None:
        if (e, r, hb.seq) in self.hb_sent:
            return  # the same chunk to another target rank
        self.hb_sent[e, r, hb.seq] = (float(hb.t_send), hb.incarnation, hb.lease_ids, frozenset())
        for pid in hb.lease_ids:
            self.hb_latest[e, r, glid(hb.incarnation, pid)] = hb.seq
        live = {seq for (e2, r2, _), seq in self.hb_latest.items() if (e2, r2) == (e, r)}
        for k in [k for k in self.hb_sent if k[:2] == (e, r) and k[2] not in live]:
            del self.hb_sent[k]

    def _check_rounds(self, e: str, r: int, ack: HeartbeatAck) -> None:
        """Liveness of the rounds bound: an ack that renewed every id of the latest heartbeat
        naming a lease, delivered in time (within half the validity it can give) to the rank
        and session it answers, makes the lease valid once every target rank has acked, on a
        network that lost none of it. A core that dropped the heartbeat's record before its
        ack could return (v2: a bound on chunks, not rounds) never validates it."""
        acc = self.accessors[e, r]
        if ack.to_rank != r or ack.to_session != acc.session:
            return
        k = (e, r, ack.seq)
        rec = self.hb_sent.get(k)
        if rec is None or rec[0] != float(ack.t_echo) or ack.rank in rec[3]:
            return
        t_send, inc, ids, acked = rec
        if ack.incarnation != inc or ack.renewed != len(ids):
            del self.hb_sent[k]  # a restart, or a lease listed lost: nothing to promise
            for lk in [lk for lk, seq in self.hb_latest.items() if lk[:2] == (e, r) and seq == ack.seq]:
                del self.hb_latest[lk]
            return
        acked = acked | {ack.rank}
        self.hb_sent[k] = (t_send, inc, ids, acked)
        if not set(tp_layout(len(self.pinners), acc.ranks, r).targets) <= acked:
            return
        # Answered by every target: nothing later can be promised from it (kept out of the
        # fingerprint from now on, so the audit splits no states the cores do not).
        del self.hb_sent[k]
        latest = [lk for lk, seq in self.hb_latest.items() if lk[:2] == (e, r) and seq == ack.seq]
        for lk in latest:
            del self.hb_latest[lk]
        now = self.now_a(e)
        if now > t_send + 0.5 * min(self.cfg.accessor_extension, self.acfg.accessor_extension):
            return
        for pid in ids:
            lid = glid(inc, pid)
            if (e, r, lid) not in latest or self.lease_kind.get(lid) == "fixed":
                continue
            for key, ticket in self.tickets.items():
                if glid(ticket.incarnation, ticket.lease_id) != lid:
                    continue
                if acc.state_of(key) not in (TrackedState.WAITING, TrackedState.ACCESSING):
                    continue
                v = acc.valid_until(key)
                if v is None or v < now:
                    raise Violation(
                        f"liveness: {e}.{r}'s heartbeat seq {ack.seq} (sent at {t_send:.6f}, the latest naming "
                        f"{key!r}) was renewed and acked in time by every target rank, yet {key!r} is not valid "
                        f"(valid_until {v}): its record was dropped before its ack could return"
                    )

    def check(self) -> None:
        """The state invariants, at this real instant."""
        for q, p in enumerate(self.pinners):
            nd = p.next_deadline()
            for pid in p.live_ids():
                info = p.info(pid)
                assert info is not None
                lid = glid(self.incarnation, pid)
                if (lid, q) in self.frees:
                    raise Violation(f"lease {lid} is live on pinner rank {q} after its Free")
                if nd is None or nd > info.expiry:
                    raise Violation(f"pinner rank {q}: next_deadline {nd} is later than lease {lid}'s expiry")
                spec = self.formula[lid, q]
                if info.state is LeaseState.QUARANTINED:
                    spec += self.cfg.push_guard
                if info.expiry < spec - TOL:
                    raise Violation(f"lease {lid} on rank {q}: expiry {info.expiry} earlier than the spec's {spec}")
                if info.expiry > spec + TOL:
                    raise Violation(
                        f"lease {lid} on rank {q}: expiry {info.expiry} later than the spec's {spec} "
                        "(extended by a message the spec does not let renew it)"
                    )
        p_ranks = len(self.pinners)
        for (e, r), acc in self.accessors.items():
            for key, ticket in self.tickets.items():
                v = acc.valid_until(key)
                if v is None:
                    continue
                lid = glid(ticket.incarnation, ticket.lease_id)
                v_real = self.real_of_a(e, v)
                access = self.accesses.get((e, r, key)) or self.finished.get((e, r, key))
                in_access = acc.state_of(key) is not TrackedState.WAITING
                for q in tp_layout(p_ranks, acc.ranks, r).targets:
                    limit: float | None = None
                    freed = self.frees.get((lid, q))
                    if freed is not None:
                        heard = self.done_heard.get((lid, q), set())
                        own = in_access and access is not None and (e, r, access.attempt) in heard
                        if not own:
                            limit = freed[0]
                    elif ticket.incarnation == self.incarnation:
                        info = self.pinners[q].info(ticket.lease_id)
                        if info is not None:
                            limit = self.real_of_p(info.expiry)
                    if limit is not None and v_real > limit + TOL:
                        raise Violation(
                            f"{e}.{r} counts {key!r} (lease {ticket.lease_id}) valid until real {v_real:.6f}, past "
                            f"pinner rank {q}'s {'free' if freed else 'expiry'} at {limit:.6f}"
                        )


_BIG: dict[tuple[int, str, int, int, int, int], bytes] = {}


def _big_heartbeat(bound: int, engine: str, rank: int, ranks: int, session: int, incarnation: int) -> bytes:
    """The largest heartbeat within `bound` bytes of unknown ids 2^32 apart (memoized)."""
    key = (bound, engine, rank, ranks, session, incarnation)
    if key not in _BIG:

        def frame(n: int) -> bytes:
            ids = tuple(2**40 + i * 2**32 for i in range(n))
            return encode(Heartbeat(engine, rank, ranks, session, incarnation, 2**63, LocalTime(0.0), ids))

        n = 1
        while len(frame(n + 1)) <= bound:
            n += 1
        _BIG[key] = frame(n)
    return _BIG[key]


# -- canonical views of the cores (read-only; kept out of the cores' hot paths) ----------------


def _pinner_fp(p: Pinner) -> Hashable:
    leases = tuple(
        (
            lid,
            x.key,
            x.kind,
            x.expiry,
            x.expected,
            x.push,
            x.state,
            x.done,
            x.promised,
            x.released,
            x.accessor,
            x.b_rank,
            x.b_session,
            x.b_seq,
            None if x.more is None else tuple(sorted((k, tuple(v)) for k, v in x.more.items())),
        )
        for lid, x in p._leases.items()
    )
    tombs = tuple(
        (lid, t.reason, t.accessor, t.done, None if t.sessions is None else tuple(sorted(t.sessions.items())))
        for lid, t in p._tombstones.items()
    )
    held = tuple((due, encode(msg)) for due, msg in p._held)
    return (p._next_id, leases, tuple(sorted(p._heap)), tombs, held)


def _accessor_fp(a: Accessor) -> Hashable:
    tracked = tuple(
        (
            key,
            t.engine.engine_id,
            t.lease_id,
            t.incarnation,
            t.kind,
            t.push,
            t.state,
            t.tracked_at,
            t.valid_until,
            t.held,
            t.attempt,
            t.confirm_deadline,
            tuple(sorted(t.confirm_pending)),
            t.attached_confirm,
            None if t.early_verdicts is None else tuple(sorted(t.early_verdicts.items())),
        )
        for key, t in a._tracked.items()
    )
    engines = tuple(
        (
            name,
            eng.connected,
            eng.incarnation,
            eng.ranks,
            tuple((k, t.key) for k, t in eng.leases.items()),
            tuple(sorted(eng.deadlines.items())),
            tuple(sorted(eng.new_ids)),
            eng.next_heartbeat,
            eng.handshake_due,
            tuple(eng.handshakes.items()),
            tuple(
                (s, o.t_send, o.incarnation, o.ids, tuple(sorted(o.pending_ranks)), tuple(sorted(o.missing)))
                for s, o in eng.outstanding.items()
            ),
            eng.max_message_bytes,
            tuple(eng.clock._samples),
        )
        for name, eng in a._engines.items()
    )
    checks = tuple(sorted(a._checks))
    return (a._seq, tracked, engines, checks, a._given_up.snapshot())


def describe(world: World, action: Action) -> str:
    """One line for a schedule: the action, in words, as seen from `world` (before it)."""
    name = action[0]
    if name in ("deliver", "drop", "dup", "misroute"):
        to_pinner, engine, rank, data = world.flight[action[1]]
        msg = decode(data)
        fields = []
        for f in ("seq", "attempt", "lease_id", "lease_ids", "confirm", "to_rank", "renewed", "outcome"):
            if hasattr(msg, f):
                v = getattr(msg, f)
                fields.append(f"{f}={getattr(v, 'name', v)}")
        sender = f"{msg.engine_id}.{msg.rank}"
        dest = f"P{rank}" if to_pinner else f"{engine}.{rank}"
        what = f"{type(msg).__name__}({', '.join(fields)}) {sender} -> {dest}"
        if name == "misroute":
            alt = f"P{action[2]}" if to_pinner else f"{engine}.{action[2]}"
            return f"misroute {what}, delivered to {alt}"
        return f"{name} {what}"
    if name == "replay":
        to_pinner, engine, rank, data = world.delivered[action[1]]
        dest = f"P{rank}" if to_pinner else f"{engine}.{rank}"
        return f"replay {type(decode(data)).__name__} -> {dest}"
    if name == "advance":
        return f"advance real time to {action[1]:.6f}"
    if name == "part":
        return f"part for P{action[4]} of {action[3]} on {action[1]}.{action[2]} landed: its AccessDone sent"
    if name == "bigbeat":
        return f"forged Heartbeat near the frame bound (ids 2^32 apart) -> P{action[1]}"
    if name == "timeout":
        who = f"P{action[2]}" if action[1] == "P" else f"{action[1]}.{action[2]}"
        return f"handle_timeout {who}"
    if name == "grant":
        return f"grant k{world.granted + 1} ({action[1]}) on every pinner rank"
    if name == "track":
        return f"track {action[2]} on every rank of {action[1]}"
    if name == "retrack":
        return f"re-track given-up {action[3]} on {action[1]}.{action[2]}"
    if name == "fail":
        return f"access_failed {action[3]} on {action[1]}.{action[2]} ({action[4]})"
    if name == "finish":
        return f"access_finished {action[3]} on {action[1]}.{action[2]} (notified={action[4]})"
    if name == "release":
        return f"pinner release {action[1]}"
    if name == "restart":
        return f"pinner restart: new incarnation {world.incarnation + 1:#x}, lease ids from 1"
    return " ".join(str(x) for x in action[:1]) + " " + ".".join(str(x) for x in action[1:])
