#!/usr/bin/env python3
"""Mutation check: do the conformance vectors bind the safety argument?

    .venv/bin/python tools/mutation_check.py [--markdown] [--verbose] [NAME...]

Each mutant below flips one rule of the reference core (kvlease/_pinner.py, _accessor.py,
_terms.py, _clock.py), the way an independent implementation could get it wrong. For each one
the rule is flipped in process, every vector of spec/vectors/ is replayed through
`kvlease.conformance.run_vectors` against `CoreImplementation` (which builds the patched
`Pinner` and `Accessor`), and the rule is restored. A mutant is *killed* when some vector
fails; a survivor means an implementation breaking that rule passes conformance, so the
vectors do not bind it. Exit status 1 if any listed mutant survives (or the unmutated core
fails a vector: then every kill would be vacuous).

How a rule is flipped (nothing on disk changes):
* `edit(owner, name, old, new)`: the method (or function) `owner.name`, recompiled from its
  source with the snippet `old` replaced by `new` in its module's globals, is set on `owner`
  for the duration of the run. `old` must occur exactly once, so a core change that moves the
  rule fails this tool loudly instead of silently testing nothing.
* `replace(owner, name, value)`: set an attribute outright.

`--markdown` prints the table that spec/vectors/README.md carries (a test keeps them equal).
"""

from __future__ import annotations
import __future__

import argparse
import contextlib
import inspect
import json
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from kvlease import LeaseKind, _accessor, _clock, _pinner, _terms
from kvlease._peer import PinnerEngine
from kvlease._records import GivenUp, Tombstone
from kvlease.conformance import CoreImplementation, JSONDict, VectorResult, run_vectors

VECTORS = Path(__file__).resolve().parent.parent / "spec" / "vectors"


@attrs.frozen
class Edit:
    """`owner.name` recompiled from its source with `old` (exactly one occurrence) made `new`."""

    owner: object
    name: str
    old: str
    new: str


@attrs.frozen
class Replace:
    """`owner.name` set to `value`."""

    owner: object
    name: str
    value: object


Patch = Edit | Replace


@attrs.frozen
class Mutant:
    name: str
    rule: str  # the rule of the spec the mutant breaks (what the vectors must bind)
    patches: tuple[Patch, ...]


edit, replace = Edit, Replace


def _recompiled(owner: object, name: str, edits: list[Edit]) -> object:
    """The attribute `owner.name` rebuilt from its source with every edit applied, in order."""
    static = inspect.getattr_static(owner, name)
    func = static.__func__ if isinstance(static, staticmethod | classmethod) else static
    src = textwrap.dedent(inspect.getsource(func))
    for e in edits:
        count = src.count(e.old)
        if count != 1:
            where = f"{getattr(owner, '__name__', owner)}.{name}"
            raise AssertionError(f"{where}: {e.old!r} occurs {count} times, not once")
        src = src.replace(e.old, e.new)
    code = compile(
        src, f"<mutant of {func.__qualname__}>", "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True
    )
    ns: dict[str, Any] = {}
    exec(code, func.__globals__, ns)  # the def (and its decorator) rebuilt from the edited source
    return ns[name]


@contextlib.contextmanager
def applied(mutant: Mutant) -> Iterator[None]:
    """Flip the mutant's rule for the duration of the block; restore the core after."""
    values: dict[tuple[int, str], tuple[object, str, object]] = {}
    edits: dict[tuple[int, str], list[Edit]] = {}
    for p in mutant.patches:
        if not hasattr(p.owner, p.name):
            raise AssertionError(f"{p.owner!r} has no attribute {p.name!r}")
        if isinstance(p, Replace):
            values[(id(p.owner), p.name)] = (p.owner, p.name, p.value)
        else:
            edits.setdefault((id(p.owner), p.name), []).append(p)
    for key, group in edits.items():
        values[key] = (group[0].owner, group[0].name, _recompiled(group[0].owner, group[0].name, group))
    saved = [(owner, name, inspect.getattr_static(owner, name)) for owner, name, _ in values.values()]
    try:
        for owner, name, value in values.values():
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


P, A, T = _pinner.Pinner, _accessor.Accessor, _terms.LeaseTerms


def _vllm_heartbeat_unbound(self: _pinner.Pinner, now: _clock.LocalTime, request_ids: Any) -> int:
    """Mutant body: stock vLLM's `HB:` renews by request id whoever the lease is bound to."""
    self._check_now(now)
    by_key = self._require_compat()
    self._now = now
    renewed = 0
    for lid in sorted({by_key[k] for k in request_ids if k in by_key}):
        lease = self._leases[lid]
        if lease.state is _pinner.LeaseState.ACTIVE and lease.expiry > now:
            if lease.kind is LeaseKind.RENEWABLE:
                lease.expiry = max(lease.expiry, now + self.config.lease_extension)
            lease.promised = True
            renewed += 1
    return renewed


MUTANTS: tuple[Mutant, ...] = (
    # -- pinner: binding and counting ------------------------------------------------------------
    Mutant(
        "pinner_no_binding",
        "a lease is renewed or ended only by the accessor (engine, rank's session) bound to it",
        (
            edit(
                P,
                "_renew",
                "elif bound != engine_id or self._bound_elsewhere(lease, engine_id, rank, session):",
                "elif False:",
            ),
            replace(P, "_bound_elsewhere", staticmethod(lambda lease, engine_id, rank, session: False)),
            edit(P, "_renew", "if lease.b_session != session:", "if False:"),  # the inlined steady state
            edit(
                P,
                "receive_vllm_done",
                "if lease.accessor is not None and lease.accessor != _COMPAT_ENGINE:",
                "if False:",
            ),
        ),
    ),
    Mutant(
        "pinner_no_session_binding",
        "binding includes each accessor rank's session, not just the engine",
        (
            replace(
                P,
                "_bound_elsewhere",
                staticmethod(lambda lease, engine_id, rank, session: lease.accessor not in (None, engine_id)),
            ),
            edit(P, "_renew", "if lease.b_session != session:", "if False:"),  # the inlined steady state
        ),
    ),
    Mutant(
        "pinner_replay_extends",
        "a heartbeat no newer (seq) than one that extended the lease extends nothing",
        (
            replace(P, "_fresh_renewal", staticmethod(lambda lease, rank, seq: True)),
            edit(P, "_renew", "if seq is None or seq > lease.b_seq:", "if True:"),  # the inlined binding
            edit(P, "_renew", "if top > lease.b_seq:", "if True:"),  # the steady state
        ),
    ),
    Mutant(
        "tombstone_ok_any_session",
        "a tombstone answers OK only to the rank and session it counted",
        (edit(Tombstone, "confirms", "and self.sessions.get(rank) == session", "and True"),),
    ),
    Mutant(
        "quarantined_counts_access_done",
        "an access-done on a quarantined (expired) push lease is STALE and counts nothing",
        (edit(P, "_count_access", "if not _counts(lease, now):", "if not lease.expiry > now:"),),
    ),
    Mutant(
        "access_done_to_rank_unchecked",
        "v3: a pinner rank refuses an access-done naming another rank (to_rank)",
        (edit(P, "_on_access_done", "if msg.to_rank != self.rank:", "if False:"),),
    ),
    Mutant(
        "posted_release_not_held",
        "v3: a posted Release of a push lease holds it (never frees at once)",
        (edit(P, "_on_release", "hold=msg.posted and lease.push,", "hold=False,"),),
    ),
    Mutant(
        "posted_release_held_without_guard",
        "v3: a push lease held by a posted Release frees at expiry + the push guard, not at expiry",
        (
            edit(
                P,
                "handle_timeout",
                "elif lease.push and lease.state is not LeaseState.QUARANTINED:",
                "elif lease.push and lease.state is not LeaseState.QUARANTINED and not lease.hold:",
            ),
        ),
    ),
    Mutant(
        "heartbeat_ack_unbounded",
        "v3: a heartbeat whose ack could exceed the pinner's bound is Rejected, no ack built",
        (
            edit(
                P,
                "_on_heartbeat",
                "if len(ids) > self._ack_ids_always_fit and chunk_cost(ids) > self._ack_budget:",
                "if False:",
            ),
        ),
    ),
    Mutant(
        "vllm_heartbeat_renews_bound_lease",
        "a stock vLLM HB: never renews a lease bound to a kvlease accessor",
        (replace(P, "receive_vllm_heartbeat", _vllm_heartbeat_unbound),),
    ),
    Mutant(
        "pinner_refused_call_records_now",
        "a refused call changes nothing, not even the pinner's latest now",
        (edit(P, "release", "self._check_now(now)\n", "self._advance(now)\n"),),
    ),
    # -- accessor: what a reply must answer --------------------------------------------------------
    Mutant(
        "ack_rank_unchecked",
        "an ack counts only from a pinner rank still pending for its heartbeat",
        (
            edit(
                A,
                "_on_ack",
                "if rec is None or rec.t_send != ack.t_echo or ack.rank not in rec.pending_ranks:",
                "if rec is None or rec.t_send != ack.t_echo:",
            ),
            edit(
                A,
                "_on_ack",
                "rec.pending_ranks.discard(ack.rank)",
                "rec.pending_ranks.discard(ack.rank if ack.rank in rec.pending_ranks else min(rec.pending_ranks))",
            ),
        ),
    ),
    Mutant(
        "ack_t_echo_unchecked",
        "an ack counts only if it echoes its heartbeat's send time",
        (
            edit(
                A,
                "_on_ack",
                "if rec is None or rec.t_send != ack.t_echo or ack.rank not in rec.pending_ranks:",
                "if rec is None or ack.rank not in rec.pending_ranks:",
            ),
        ),
    ),
    Mutant(
        "ack_to_rank_unchecked",
        "an ack addressed to another accessor rank is Rejected",
        (edit(A, "_on_ack", "if ack.to_rank != self.rank or ack.to_session", "if ack.to_session"),),
    ),
    Mutant(
        "ack_to_session_unchecked",
        "an ack addressed to another session is Rejected",
        (edit(A, "_on_ack", " or ack.to_session != self.session:", ":"),),
    ),
    Mutant(
        "verdict_attempt_unchecked",
        "a verdict counts only for the access attempt it names",
        (edit(A, "_on_done_ack", "if t is None or t.attempt != ack.attempt:", "if t is None:"),),
    ),
    Mutant(
        "verdict_to_rank_unchecked",
        "a verdict addressed to another accessor rank is Rejected",
        (edit(A, "_on_done_ack", "if ack.to_rank != self.rank or ack.to_session", "if ack.to_session"),),
    ),
    Mutant(
        "verdict_to_session_unchecked",
        "a verdict addressed to another session is Rejected",
        (edit(A, "_on_done_ack", " or ack.to_session != self.session:", ":"),),
    ),
    Mutant(
        "early_verdicts_any_rank",
        "an early verdict (before access_finished) counts for the pinner rank that gave it, once",
        (
            edit(
                A,
                "_on_done_ack",
                "t.early_verdicts.setdefault(ack.rank, ack.outcome)",
                "t.early_verdicts.setdefault(len(t.early_verdicts), ack.outcome)",
            ),
        ),
    ),
    Mutant(
        "verdict_any_rank",
        "a confirmation needs an OK from every target pinner rank (a duplicate counts once)",
        (
            edit(
                A,
                "_verdict",
                "if t.state is not TrackedState.CONFIRMING or rank not in t.confirm_pending:",
                "if t.state is not TrackedState.CONFIRMING:",
            ),
            edit(A, "_verdict", "t.confirm_pending.discard(rank)", "t.confirm_pending.pop()"),
        ),
    ),
    # -- accessor: access decisions ------------------------------------------------------------------
    Mutant(
        "notified_still_sends",
        "access_finished(notified=True) sends no second access-done when none is needed",
        (
            edit(
                A,
                "access_finished",
                "resend = not notified or (not covered and not t.attached_confirm)",
                "resend = True",
            ),
        ),
    ),
    Mutant(
        "lost_notified_still_sends",
        "access_finished(notified=True) of a lease lost mid-access sends no access-done",
        (edit(A, "access_finished", "() if notified else tuple(", "() if False else tuple("),),
    ),
    Mutant(
        "covered_nonstrict",
        "an access is covered only if it finished strictly before valid_until",
        (edit(A, "access_finished", "covered = now < t.valid_until", "covered = now <= t.valid_until"),),
    ),
    Mutant(
        "guaranteed_with_A",
        "guaranteed needs now + A_l (the access bound in the local clock) <= valid_until, not now + A",
        (
            edit(
                A,
                "begin_access",
                "now + eng.terms.access_time_local <= valid",
                "now + eng.terms.max_access_time <= valid",
            ),
        ),
    ),
    Mutant(
        "one_notification_for_all_ranks",
        "v3: one access-done per target pinner rank, each naming its rank",
        (
            edit(
                A,
                "begin_access",
                "self._access_done(t, not guaranteed, now, r) for r in layout.targets",
                "self._access_done(t, not guaranteed, now, layout.targets[0]) for r in layout.targets",
            ),
        ),
    ),
    Mutant(
        "lost_mid_access_not_retired",
        "a lease lost during an access is retired at once (never tracked again meanwhile)",
        (edit(A, "_lose", "self._retire((t.engine.engine_id, t.incarnation, t.lease_id))", "pass"),),
    ),
    Mutant(
        "completed_while_accessing_loses",
        "an ack listing 'completed' while this accessor is accessing does not lose the lease",
        (edit(A, "_on_ack", "if lost.state is TrackedState.ACCESSING:", "if False:"),),
    ),
    Mutant(
        "give_up_at_valid_until",
        "a waiting renewable lease is given up a lease duration after its last acknowledged send, "
        "not when its window lapses",
        (
            edit(
                A,
                "_lapse_time",
                "return anchor + self.config.kv_lease_duration",
                "return t.valid_until if t.valid_until != _NEG_INF else anchor + self.config.kv_lease_duration",
            ),
        ),
    ),
    Mutant(
        "give_up_anchor_from_valid_until",
        "v3: the give-up anchor is the latest acknowledged send time, not valid_until less the own E_a",
        (
            edit(
                A,
                "_lapse_time",
                "anchor = t.tracked_at if t.acked_send == _NEG_INF else t.acked_send",
                "anchor = t.tracked_at if t.valid_until == _NEG_INF"
                " else t.valid_until - self.config.accessor_extension",
            ),
        ),
    ),
    Mutant(
        "past_deadline_shrunk",
        "an already-past fixed-TTL deadline is converted stretched by (1+rho)/(1-rho), not shrunk",
        (
            edit(
                _clock.ClockOffsetEstimator,
                "to_local_deadline",
                "remaining_peer * (1.0 + rho) / (1.0 - rho)",
                "remaining_peer * (1.0 - rho) / (1.0 + rho)",
            ),
        ),
    ),
    Mutant(
        "accessor_refused_call_records_now",
        "a refused call changes nothing, not even the accessor's latest now",
        (edit(A, "track", "self._check_now(now)\n", "self._advance(now)\n"),),
    ),
    Mutant(
        "watermark_moves_down",
        "the watermark of given-up leases never moves down",
        (edit(GivenUp, "add", "if lease_id > self._floor.get(fkey, 0):", "if True:"),),
    ),
    Mutant(
        "other_tp_size_tracked",
        "a ticket of the connected incarnation with another TP size is lost (unknown), not tracked",
        (
            edit(
                A,
                "track",
                "if eng.connected and eng.incarnation == ticket.incarnation and eng.ranks != ticket.ranks:",
                "if False:",
            ),
        ),
    ),
    # -- v3: stated terms ----------------------------------------------------------------------------
    Mutant(
        "stated_terms_ignored",
        "v3: the accessor uses the stricter of the pinner's stated terms and its own",
        (replace(T, "with_pinner", lambda self, config, extension, rho, access: T.own(config)),),
    ),
    Mutant(
        "stated_extension_ignored",
        "v3: the effective extension is the smaller of the stated and the own",
        (edit(T, "with_pinner", "e = min(own_e, extension)", "e = own_e"),),
    ),
    Mutant(
        "stated_drift_ignored",
        "v3: the effective drift bound is the larger of the stated and the own",
        (edit(T, "with_pinner", "max(config.max_drift_rate, rho),", "config.max_drift_rate,"),),
    ),
    Mutant(
        "stated_access_time_ignored",
        "v3: the effective access-time bound is the larger of the stated and the own",
        (edit(T, "with_pinner", "max(config.max_access_time, access),", "config.max_access_time,"),),
    ),
    Mutant(
        "heartbeat_period_own",
        "v3: the heartbeat period is a quarter of a shorter stated extension",
        (
            edit(
                T,
                "with_pinner",
                "interval = config.heartbeat_interval if extension >= own_e else extension / 4.0",
                "interval = config.heartbeat_interval",
            ),
        ),
    ),
    Mutant(
        "ack_extension_ignored",
        "v3: a round's window comes from the smallest extension its acks stated",
        (
            edit(
                A,
                "_on_ack",
                "valid = t_send + eng.terms.validity(rec.extension)",
                "valid = t_send + eng.terms.accessor_extension",
            ),
        ),
    ),
    Mutant(
        "ack_extension_latest",
        "v3: the smallest ack extension of a round counts, not the latest",
        (edit(A, "_on_ack", "if ack.extension < rec.extension:", "if True:"),),
    ),
    Mutant(
        "ack_extension_uncapped",
        "v3: an ack stating more than the effective extension gives no longer window",
        (edit(T, "validity", "if ack_extension >= self.extension:", "if False:"),),
    ),
    Mutant(
        "max_outstanding_counts_chunks",
        "v3: max_outstanding_heartbeats counts heartbeat rounds, not chunks",
        (
            edit(
                PinnerEngine,
                "make_room",
                "(periodic and len(rounds) >= bound)",
                "(periodic and len(self.outstanding) >= bound)",
            ),
            edit(PinnerEngine, "make_room", "return len(rounds) < bound", "return len(self.outstanding) < bound"),
        ),
    ),
    Mutant(
        "new_incarnation_keeps_handshakes",
        "v3: tracking a ticket of a new incarnation forgets the outstanding handshakes",
        (edit(A, "track", "if eng.handshakes and eng.handshake_for != ticket.incarnation:", "if False:"),),
    ),
    Mutant(
        "early_heartbeat_unknown",
        "a heartbeat naming a lease id not granted yet is held, not answered unknown at once",
        (edit(P, "_on_heartbeat", "and ids[-1] >= self._next_id", "and False"),),
    ),
    Mutant(
        "held_heartbeat_waits_out",
        "a held heartbeat is answered once every id it names is granted, not only at its answer-by time",
        (edit(P, "_answer_held", "if msg.lease_ids[-1] < self._next_id or due <= now:", "if due <= now:"),),
    ),
    Mutant(
        "held_heartbeat_late_deadline",
        "next_deadline is due at once when a held heartbeat's ids are all granted",
        (
            edit(
                P,
                "next_deadline",
                "due = self._now if self._held_top < self._next_id else self._held[0][0]",
                "due = self._held[0][0]",
            ),
        ),
    ),
    Mutant(
        "no_late_cover",
        "an acknowledgement whose window covers a CONFIRMING access's finish completes it (§5.6 step 9)",
        (replace(A, "_covered_late", lambda self, t: ()),),
    ),
    Mutant(
        "late_cover_ignores_finish",
        "a late acknowledgement completes a CONFIRMING access only if its window ends after the finish",
        (
            edit(
                A,
                "_covered_late",
                "if t.state is not TrackedState.CONFIRMING or not t.finished_at < t.valid_until:",
                "if t.state is not TrackedState.CONFIRMING:",
            ),
        ),
    ),
)


def load_vectors(where: Path = VECTORS) -> list[JSONDict]:
    return [json.loads(p.read_text()) for p in sorted(where.glob("*.json"))]


def first_failure(results: list[VectorResult]) -> VectorResult | None:
    return next((r for r in results if not r.passed), None)


def check(vectors: list[JSONDict], mutants: tuple[Mutant, ...] = MUTANTS) -> list[tuple[Mutant, VectorResult | None]]:
    """Each mutant with the first vector that fails under it (None: it survives)."""
    base = first_failure(run_vectors(vectors, CoreImplementation()))
    if base is not None:
        assert base.mismatch is not None
        raise AssertionError(f"the unmutated core fails: {base.mismatch.render()}")
    out: list[tuple[Mutant, VectorResult | None]] = []
    for m in mutants:
        with applied(m):
            out.append((m, first_failure(run_vectors(vectors, CoreImplementation()))))
    return out


def markdown(rows: list[tuple[Mutant, VectorResult | None]]) -> str:
    lines = ["| mutant | rule it breaks | first vector that fails |", "|---|---|---|"]
    for m, r in rows:
        lines.append(f"| `{m.name}` | {m.rule} | {'**survives**' if r is None else f'`{r.name}`'} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true", help="print the README table")
    ap.add_argument("--verbose", action="store_true", help="show where each mutant is caught")
    ap.add_argument("names", nargs="*", help="only these mutants")
    ns = ap.parse_args()
    chosen = tuple(m for m in MUTANTS if not ns.names or m.name in ns.names)
    started = time.perf_counter()
    rows = check(load_vectors(), chosen)
    took = time.perf_counter() - started
    survivors = [m.name for m, r in rows if r is None]
    if ns.markdown:
        print(markdown(rows), end="")
    else:
        width = max(len(m.name) for m in chosen)
        for m, r in rows:
            where = "SURVIVES" if r is None else r.name
            if ns.verbose and r is not None and r.mismatch is not None:
                where += f"  ({r.mismatch.label}: {r.mismatch.why[:150]})"
            print(f"{m.name:<{width}}  {where}")
        print(f"{len(rows) - len(survivors)} of {len(rows)} mutants killed in {took:.2f} s", flush=True)
    if survivors:
        print("survivors: " + ", ".join(survivors), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
