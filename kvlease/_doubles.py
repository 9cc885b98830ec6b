"""Deliberately broken cores: one copy of every test double that shows a checker can fail.

`kvlease check --inject-bug`, ``kvlease sim --campaign N --inject-bug`` and the Hypothesis
models of `tests/` all draw their broken cores from here (the registries that name them for
the command lines are `kvlease.check._doubles.CHECK_BUGS` and `kvlease.sim._doubles.BUGS`).

Three families:

* a core built from a *wrong* configuration, the kind of mistake an implementation could
  make (`short_lease_pinner` and friends, with the `PinnerFactory` / `AccessorFactory`
  signature of the simulator). Since v3 an accessor follows the terms its pinner states, so a
  wrong configuration is unsafe only in a pinner that misstates its terms (`MisstatingPinner`)
  or an accessor that ignores them (`OwnTermsAccessor`, v2);
* protocol v1 behaviour an adversarial review found unsafe through the public API: a subclass
  of the real core with one v2 fix switched off, by overriding the private method that
  implements it (`ForgetfulAccessor` ... `RenewAtExpiryPinner`);
* a rule added within v3 broken the tempting way (`LateCoverIgnoresFinishAccessor`);
* protocol v2 behaviour the v3 review found unsafe where a deployment differs from the test
  bench, one v3 fix off each (`OwnTermsAccessor`, `PostedReleaseFreesPinner`,
  `NoToRankPinner`, `NoAckBudgetPinner`, `ChunkBoundAccessor`, `UnretiredHandshakeAccessor`).

Never used by anything but checks and tests. Pure, like the core.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs

from ._accessor import Accessor, TrackedState, _Tracked
from ._binding import Bound
from ._clock import MAX_TIME, LocalTime
from ._codec import MAX_IDS
from ._config import MIN_ACCESS_TIME, MIN_VALIDITY_MARGIN, LeaseConfig
from ._events import AccessorOutput, PinnerOutput, Send
from ._messages import (
    AccessDone,
    AccessDoneAck,
    Handshake,
    HandshakeReply,
    Heartbeat,
    HeartbeatAck,
    LeaseTicket,
    Message,
    Release,
)
from ._peer import PinnerEngine as _PinnerEngine
from ._pinner import LeaseState, Pinner

__all__ = [
    "ChunkBoundAccessor",
    "ForgetfulAccessor",
    "LateCoverIgnoresFinishAccessor",
    "MisstatingPinner",
    "NoAckBudgetPinner",
    "NoBindingPinner",
    "NoRankCheckPinner",
    "NoToRankPinner",
    "OwnTermsAccessor",
    "PerConnectionSeqAccessor",
    "PostedReleaseFreesPinner",
    "RenewAtExpiryPinner",
    "RetryAfterPostedFailureAccessor",
    "UnboundAckAccessor",
    "UnboundHandshakeAccessor",
    "UnboundRepliesAccessor",
    "UnretiredHandshakeAccessor",
    "long_lease_pinner",
    "no_drift_margin_accessor",
    "overstated_extension_accessor",
    "short_lease_pinner",
]


class MisstatingPinner(Pinner):
    """A pinner that enforces one configuration and states another's terms (its handshake
    replies and acks name `stated`'s extension, drift bound and access-time bound): the one lie
    v3's stated terms cannot catch, since the accessor believes what the pinner says."""

    def __init__(self, config: LeaseConfig, stated: LeaseConfig, engine_id: str, incarnation: int, **kw: int) -> None:
        super().__init__(config, engine_id, incarnation, **kw)
        self._stated = stated

    def _restate(self, msg: Message) -> Message:
        if isinstance(msg, HandshakeReply):
            st = self._stated
            return attrs.evolve(
                msg,
                extension=st.lease_extension,
                max_drift_rate=st.max_drift_rate,
                max_access_time=st.max_access_time,
            )
        if isinstance(msg, HeartbeatAck):
            return attrs.evolve(msg, extension=self._stated.lease_extension)
        return msg

    def handshake_reply(self, now: LocalTime, message: Handshake) -> HandshakeReply:
        reply = self._restate(super().handshake_reply(now, message))
        assert isinstance(reply, HandshakeReply)
        return reply

    def receive(self, now: LocalTime, message: Message) -> tuple[PinnerOutput, ...]:
        out = super().receive(now, message)
        return tuple(attrs.evolve(o, message=self._restate(o.message)) if isinstance(o, Send) else o for o in out)


class OwnTermsAccessor(Accessor):
    """v2: validity from the accessor's own configuration alone: the terms a pinner states
    (in its handshake reply and each ack) are read as the most lenient there are."""

    def handshake_reply(self, now: LocalTime, reply: HandshakeReply) -> tuple[AccessorOutput, ...]:
        lenient = attrs.evolve(reply, extension=MAX_TIME, max_drift_rate=0.0, max_access_time=MIN_ACCESS_TIME)
        return super().handshake_reply(now, lenient)

    def receive(self, now: LocalTime, message: Message) -> tuple[AccessorOutput, ...]:
        if isinstance(message, HeartbeatAck):
            message = attrs.evolve(message, extension=MAX_TIME)
        return super().receive(now, message)


def short_lease_pinner(config: LeaseConfig, engine_id: str, incarnation: int, rank: int, ranks: int) -> Pinner:
    """A pinner whose leases are 30% shorter than it states (initial lease and every
    extension): accessors believe leases valid after the pinner freed them."""
    wrong = config.with_changes(kv_lease_duration=config.kv_lease_duration * 0.7)
    return MisstatingPinner(wrong, config, engine_id, incarnation, rank=rank, ranks=ranks)


def long_lease_pinner(config: LeaseConfig, engine_id: str, incarnation: int, rank: int, ranks: int) -> Pinner:
    """A pinner that holds leases 50% longer than configured: safe, but a dead accessor's
    memory outlives the liveness bound."""
    wrong = config.with_changes(kv_lease_duration=config.kv_lease_duration * 1.5)
    return Pinner(wrong, engine_id, incarnation, rank=rank, ranks=ranks)


def overstated_extension_accessor(config: LeaseConfig, engine_id: str, rank: int, ranks: int, session: int) -> Accessor:
    """A v2 accessor (its own terms only) configured with a 10% longer lease than the pinner's:
    the settings-mismatch stale read of v2. (A v3 accessor so configured is safe: it follows
    the pinner's stated extension.)"""
    wrong = config.with_changes(kv_lease_duration=config.kv_lease_duration * 1.1)
    return OwnTermsAccessor(wrong, engine_id, session=session, rank=rank, ranks=ranks)


def no_drift_margin_accessor(config: LeaseConfig, engine_id: str, rank: int, ranks: int, session: int) -> Accessor:
    """An accessor whose validity omits the drift shrink and the safety margin (the classic
    lease bug: trusting that the pinner's clock runs at our rate), and that ignores the
    pinner's stated drift bound."""
    wrong = config.with_changes(max_drift_rate=0.0, validity_margin=MIN_VALIDITY_MARGIN)
    return OwnTermsAccessor(wrong, engine_id, session=session, rank=rank, ranks=ranks)


# -- protocol v1 behaviour, one v2 fix off each ------------------------------------------------


class ForgetfulAccessor(Accessor):
    """v1: forgets the leases it gave up, so a ticket tracked before is accepted again (after
    untrack, completion, loss or a failed transfer) while a message about the first tracking
    may still be in flight — or after the pinner counted that tracking's access-done, whose
    tombstone then confirms the second tracking's read of freed memory."""

    def _retire(self, rkey: tuple[str, int, int]) -> None:
        return


class UnboundHandshakeAccessor(Accessor):
    """v1: a handshake reply counts whatever it answers (another rank's or session's, a
    duplicate, a stale one from before a restart, one for a handshake already answered)."""

    def handshake_reply(self, now: LocalTime, reply: HandshakeReply) -> tuple[AccessorOutput, ...]:
        reply = attrs.evolve(reply, to_rank=self.rank, to_session=self.session)
        eng = self._engines.get(reply.engine_id)
        if eng is None:
            eng = self._engines[reply.engine_id] = _PinnerEngine(reply.engine_id, self.config, reply.ranks)
        if eng.handshakes.get(reply.seq) != reply.t_echo:
            eng.handshakes[reply.seq] = reply.t_echo  # as if it answered one of ours
        return super().handshake_reply(now, reply)


class UnboundRepliesAccessor(UnboundHandshakeAccessor):
    """v1: trusts a reply whatever it is bound to: handshake replies (as above), and acks and
    verdicts addressed to another rank or session, or (verdicts) to another access attempt."""

    def receive(self, now: LocalTime, message: Message) -> tuple[AccessorOutput, ...]:
        if isinstance(message, HeartbeatAck):
            message = attrs.evolve(message, to_rank=self.rank, to_session=self.session)
        elif isinstance(message, AccessDoneAck):
            eng = self._engines.get(message.engine_id)
            t = None if eng is None else eng.leases.get((message.incarnation, message.lease_id))
            attempt = message.attempt if t is None else t.attempt
            message = attrs.evolve(message, to_rank=self.rank, to_session=self.session, attempt=attempt)
        return super().receive(now, message)


class RetryAfterPostedFailureAccessor(Accessor):
    """v1: a failed transfer puts the lease back to WAITING even when it was posted, so the
    engine retries under a lease its attached notification may already have ended."""

    def access_failed(self, now: LocalTime, key: str, *, posted: bool = True) -> tuple[AccessorOutput, ...]:
        return super().access_failed(now, key, posted=False)


class NoRankCheckPinner(Pinner):
    """v1: no layout check: a heartbeat, access-done or release from an accessor rank that does
    not access this pinner rank (the right engine, the wrong rank) is honoured."""

    def _layout_rejection(self, engine_id: str, what: str, rank: int, ranks: int) -> None:
        return None


class NoBindingPinner(Pinner):
    """v1: no lease binding: any accessor (another engine, another session) that names a lease
    renews it, and its access-done or release ends it."""

    @staticmethod
    def _bound_elsewhere(lease: Bound, engine_id: str, rank: int, session: int) -> bool:
        return False

    def _renew(
        self,
        now: LocalTime,
        incarnation: int,
        lease_ids: Iterable[int],
        engine_id: str,
        rank: int,
        session: int,
        seq: int | None,
    ) -> tuple[int, list[int], list[int], list[int], list[int], int]:
        ids = list(lease_ids)
        if incarnation == self.incarnation:
            for lease_id in ids:
                lease = self._leases.get(lease_id)
                if lease is not None:  # forget who it is bound to: whoever renews it now owns it
                    lease.accessor = None
                    lease.b_rank = -1
                    lease.more = None
        return super()._renew(now, incarnation, ids, engine_id, rank, session, None)


class RenewAtExpiryPinner(Pinner):
    """v1: a lease whose expiry has come (now >= expiry) but that handle_timeout has not freed
    yet is still live for messages: a heartbeat renews it, an access-done is counted OK, a
    release ends it."""

    def receive(self, now: LocalTime, message: Message) -> tuple[PinnerOutput, ...]:
        ids: tuple[int, ...] = ()
        if isinstance(message, Heartbeat | Release) and message.incarnation == self.incarnation:
            ids = message.lease_ids
        elif isinstance(message, AccessDone) and message.incarnation == self.incarnation:
            ids = (message.lease_id,)
        for lease_id in ids:
            lease = self._leases.get(lease_id)
            if lease is not None and lease.state is not LeaseState.QUARANTINED and lease.expiry <= now:
                lease.expiry = math.nextafter(float(now), math.inf)  # not expired yet, v1 says
        return super().receive(now, message)


class UnboundAckAccessor(Accessor):
    """v1: an ack or verdict counts on its seq and echoed time alone, whoever it was meant
    for, and the seq restarts at 1 per connection (so an ack from before a disconnect can
    answer a heartbeat after it)."""

    def receive(self, now: LocalTime, message: Message) -> tuple[AccessorOutput, ...]:
        if isinstance(message, HeartbeatAck | AccessDoneAck):
            message = attrs.evolve(message, to_rank=self.rank, to_session=self.session)
        return super().receive(now, message)

    def disconnect(self, now: LocalTime, engine_id: str) -> tuple[AccessorOutput, ...]:
        self._seq = 0
        return super().disconnect(now, engine_id)


class PerConnectionSeqAccessor(UnboundAckAccessor):
    """v1, all of it: trusts any reply on its seq and echoed time alone, whoever it was meant
    for (a handshake reply answers the latest handshake in flight), and restarts its seq at 1
    per connection (v1's per-engine counter)."""

    def handshake_reply(self, now: LocalTime, reply: HandshakeReply) -> tuple[AccessorOutput, ...]:
        eng = self._engines.get(reply.engine_id)
        if eng is not None and eng.handshakes:
            seq, t = next(reversed(eng.handshakes.items()))
            reply = attrs.evolve(reply, to_rank=self.rank, to_session=self.session, seq=seq, t_echo=LocalTime(t))
        return super().handshake_reply(now, reply)


# -- protocol v2 behaviour, one v3 fix off each ------------------------------------------------


class PostedReleaseFreesPinner(Pinner):
    """v2 (v3 hole 2): a posted Release of a push lease frees the destination at once, though
    the WRITE it reports failed may still land until its access bound has passed."""

    def _on_release(self, now: LocalTime, msg: Release) -> tuple[PinnerOutput, ...]:
        return super()._on_release(now, attrs.evolve(msg, posted=False))


class NoToRankPinner(Pinner):
    """v2 (v3 hole 3): an access-done counts at whichever rank of the right engine it reaches,
    so one part of a multi-part access misdelivered to a sibling rank frees that rank while its
    own part may still be running."""

    def _on_access_done(self, now: LocalTime, msg: AccessDone) -> tuple[PinnerOutput, ...]:
        return super()._on_access_done(now, attrs.evolve(msg, to_rank=self.rank))


class NoAckBudgetPinner(Pinner):
    """v2 (v3 hole 4): every heartbeat is answered, so a heartbeat near the frame bound (ids far
    apart: the ack's lists cost more than the heartbeat's) draws an ack over the bound."""

    def __init__(self, config: LeaseConfig, engine_id: str, incarnation: int, **kw: int) -> None:
        super().__init__(config, engine_id, incarnation, **kw)
        self._ack_ids_always_fit = MAX_IDS


class ChunkBoundAccessor(Accessor):
    """v2 (v3 hole 5): `max_outstanding_heartbeats` bounds the chunks awaiting acks, not the
    rounds: a round of more chunks than the bound (many leases, a small frame bound), or more
    rounds per round trip than the bound (tracks faster than acks return), forgets chunks
    before their acks can arrive, and the leases in them never validate."""

    def _make_room(self, now: float, eng: _PinnerEngine, *, periodic: bool) -> bool:
        horizon = now - eng.terms.accessor_extension
        bound = self.config.max_outstanding_heartbeats
        # v2's bound: on the chunks awaiting acks, whatever round they belong to.
        while eng.outstanding and (
            len(eng.outstanding) >= bound or next(iter(eng.outstanding.values())).t_send < horizon
        ):
            eng.outstanding.popitem(last=False)
        eng.rounds.clear()  # and none on rounds: a new one always fits
        return True

    def _send_heartbeats(self, now: float, eng: _PinnerEngine, ids: list[int], out: list[AccessorOutput]) -> None:
        super()._send_heartbeats(now, eng, ids, out)
        # v2 kept no rounds, so new ids are due at once (`next_deadline`) whatever is outstanding.
        eng.rounds.clear()


class UnretiredHandshakeAccessor(Accessor):
    """v2 (v3 hole 6): tracking a ticket keeps the handshakes already in flight, so a delayed
    reply to a proactive handshake sent before the pinner restarted decides the fate of a lease
    of the new incarnation (lost as `pinner_restarted`)."""

    def track(self, now: LocalTime, key: str, ticket: LeaseTicket, *, push: bool = False) -> tuple[AccessorOutput, ...]:
        eng = self._engines.get(ticket.engine_id)
        if eng is not None and eng.handshakes:
            eng.handshake_for = ticket.incarnation
        return super().track(now, key, ticket, push=push)


class LateCoverIgnoresFinishAccessor(Accessor):
    """The late cover (spec §5.6 step 9) without its condition: any acknowledgement that
    renews a CONFIRMING lease completes its access, whether or not the window it proves ends
    after the finish. A READ that began after the lease expired (and its memory was freed) is
    then reported done if an older heartbeat's ack arrives after it."""

    def _covered_late(self, t: _Tracked) -> tuple[AccessorOutput, ...]:
        if t.state is not TrackedState.CONFIRMING:
            return ()
        t.finished_at = -math.inf  # every window "covers" the finish
        return super()._covered_late(t)
