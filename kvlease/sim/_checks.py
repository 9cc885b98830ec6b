"""The protocol's safety and liveness claims, checked as a `Cluster` run goes (``check=True``)
and at its end.

Safety: no message renews, counts or frees an overdue lease; a misdelivered or stale frame
confers nothing; no read of freed blocks is reported done; one free per lease and rank.
Liveness: a dead accessor's lease is freed within the bound derived from the configuration,
and a live accessor on a fault-free path keeps its lease. Owns the bounds and what counts as
fault-free; records violations, never changes the run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._accessor import Accessor
from .._clock import LocalTime
from .._events import Free
from .._messages import AccessDone, AccessDoneAck, HandshakeReply, Heartbeat, HeartbeatAck, Message, Release
from .._pinner import LeaseInfo, Pinner
from ._network import _Network
from ._world import DecodeEngine, PrefillEngine, Request, SimLease

__all__: list[str] = []


class _Checks(_Network):
    def _msg_lease(self, p_name: str, msg: Message) -> SimLease | None:
        """The simulator's lease a message names (its first id), for a violation report."""
        inc = getattr(msg, "incarnation", None)
        if isinstance(msg, Heartbeat | Release):
            lid = msg.lease_ids[0] if msg.lease_ids else None
        elif isinstance(msg, AccessDone | AccessDoneAck):
            lid = msg.lease_id
        else:
            lid = None
        if inc is None or lid is None:
            return None
        return self.leases.get((p_name, inc, lid))

    @staticmethod
    def _overdue(pinner: Pinner, now: LocalTime, msg: Message) -> list[tuple[int, LeaseInfo]] | None:
        """The leases `msg` names that are live at the pinner but expired (expiry <= now)."""
        nd = pinner.next_deadline()
        if nd is None or nd > now:
            return None  # no lease is overdue: the common case
        if isinstance(msg, Heartbeat | Release):
            ids: tuple[int, ...] = msg.lease_ids
        elif isinstance(msg, AccessDone):
            ids = (msg.lease_id,)
        else:
            return None
        if msg.incarnation != pinner.incarnation:
            return None
        watch = []
        for lid in ids:
            info = pinner.info(lid)
            if info is not None and info.expiry <= now:
                watch.append((lid, info))
        return watch or None

    def _check_overdue(
        self,
        pe: PrefillEngine,
        rank: int,
        pinner: Pinner,
        now: LocalTime,
        msg: Message,
        watch: list[tuple[int, LeaseInfo]],
        outs: Sequence[object],
    ) -> None:
        """A lease is expired at pinner time now >= expiry even before handle_timeout frees it:
        no message may renew it, count an access-done or a release for it, or free it."""
        for lid, before in watch:
            after = pinner.info(lid)
            freed = any(isinstance(out, Free) and out.lease_id == lid for out in outs)
            if freed or (
                after is not None
                and (
                    after.expiry != before.expiry
                    or after.accesses_done != before.accesses_done
                    or after.state is not before.state
                )
            ):
                self._violate(
                    "overdue-lease-not-renewed",
                    f"{pe.name}.{rank} at {float(now)!r} acted on lease {lid} (expiry {float(before.expiry)!r}) "
                    f"for a {type(msg).__name__}: {before} -> {after}{' and freed it' if freed else ''}",
                    self.leases.get((pe.name, pinner.incarnation, lid)),
                )

    def _acc_view(self, de: DecodeEngine, acc: Accessor) -> tuple[Any, ...]:
        """What an accessor shows of itself: each request's state and validity, and which
        pinner engines it is connected to."""
        return (
            tuple((key, acc.state_of(key), acc.valid_until(key)) for key in de.reqs),
            tuple(acc.is_connected(name) for name in self.p),
        )

    @staticmethod
    def _stale_answer(de: DecodeEngine, rank: int, msg: Message) -> bool:
        """Whether `msg` answers something rank `rank` sent before its last disconnect."""
        if isinstance(msg, HeartbeatAck | HandshakeReply):
            seq = msg.seq
        elif isinstance(msg, AccessDoneAck):
            seq = msg.attempt
        else:
            return False
        cut = de.cut_seq.get((rank, msg.engine_id))
        return cut is not None and seq <= cut

    def _check_frame(self, src: str, dst: str, msg: Message, size: int, bound: int) -> None:
        """Every frame encodes within the bound that applies to it (``frame-within-bound``):
        an ack within its pinner's `max_message_bytes`, an accessor's message within the
        smaller of its own and its pinner's."""
        if size > bound:
            self._violate(
                "frame-within-bound",
                f"{src} sent {dst} a {size}-byte {type(msg).__name__} over the {bound}-byte bound: {msg!r}",
                self._msg_lease(dst.split(".")[0] if isinstance(msg, Heartbeat | AccessDone | Release) else src, msg),
            )

    def _trouble(self, req: Request, what: str) -> None:
        lease = req.lease
        if self.check and lease is not None and not lease.troubled:
            lease.troubled = what

    def _reclaim_bound(self, lease: SimLease) -> float:
        """The latest real time the protocol allows `lease` to stay pinned (liveness)."""
        cfg = self.cfgs[lease.p.name]  # the pinner's own settings decide when it frees
        rho = self.sc.drift
        slow = 1.0 / (1.0 - rho)
        pstep = self.p_step_max
        net = self.sc.network
        guard = cfg.push_guard * slow if lease.push else 0.0
        initial = lease.granted + cfg.kv_lease_duration * slow
        renewed = lease.last_hb + net.max_delay + pstep + cfg.lease_extension * slow
        return max(initial, renewed) + pstep + guard + 1e-9

    def _check_reclaim_bound(self, pe: PrefillEngine, lease: SimLease) -> None:
        bound = self._reclaim_bound(lease)
        if self.now > bound:
            self._violate(
                "dead-accessor-freed-in-time",
                f"expired at {self.now:.9f}, bound {bound:.9f} (granted {lease.granted:.9f}, last heartbeat "
                f"{lease.last_hb:.9f})",
                lease,
            )

    def _clean(self, lease: SimLease, end: float) -> bool:
        """Did the lease live on a fault-free path (the liveness claim's premise)?"""
        sc = self.sc
        if sc.network.loss > 0 or lease.api:
            return False
        p, d = lease.p.name, lease.d_name
        if d in self.cfgs and not self._rounds_cover_round_trip(p, d):
            return False
        lo = lease.granted - 2 * self.cfg.kv_lease_duration
        for f in sc.faults:
            if f.at > end or f.at + f.duration < lo:
                continue
            if f.engine in (p, d) or f.peer in (p, d):
                return False
        return not any(lo <= t <= end and d_name == d and p_name == p for t, d_name, p_name in self.api_marks)

    def _rounds_cover_round_trip(self, p: str, d: str) -> bool:
        """Whether decode engine `d`'s `max_outstanding_heartbeats` rounds, one per heartbeat
        period, outlast the slowest round trip to `p` (else a periodic round must drop the one
        whose ack is still on its way, whatever the core: the liveness claim's premise)."""
        pcfg, dcfg = self.cfgs[p], self.cfgs[d]
        period = dcfg.heartbeat_interval
        if pcfg.lease_extension < dcfg.lease_extension:
            period = pcfg.lease_extension / 4.0
        period *= 1.0 - self.sc.drift
        wl = self.sc.workload
        d_step = wl.step_base + wl.step_per_seq * self.d[d].slots  # a forward pass, at most
        round_trip = 2.0 * (self.sc.network.max_delay + d_step) + self.p_step_max
        return dcfg.max_outstanding_heartbeats * period > round_trip

    def _final_checks(self) -> None:
        end = self.sc.workload.duration
        for lease in self.all_leases:
            if lease.unfreed and lease.p.alive and lease.p.incarnation == lease.incarnation:
                bound = self._reclaim_bound(lease)
                if end > bound + self.p_step_max:
                    self._violate("dead-accessor-freed-in-time", f"still pinned at the end; bound {bound:.9f}", lease)
            if lease.troubled and self._clean(lease, end):
                self._violate("live-accessor-keeps-lease", lease.troubled, lease)
