"""The decode engines of the simulated cluster: the accessor side.

Each decode engine tracks the tickets of its requests on every rank's real `Accessor`, asks
all ranks before a transfer starts and tells all of them how it ended, dispatches their
outputs (`AccessorOutput`) and runs batched forward passes over the requests it accepted. With
`Policy.VLLM_HB` it sends vLLM-style silent heartbeats instead (`_vllm_heartbeat`), and the
baselines report reads done to the pinner ranks of the heterogeneous-TP layout (`tp_layout`).
"""

from __future__ import annotations

import functools
import heapq
import math
from typing import assert_never

from .._accessor import AccessDecision
from .._clock import LocalTime
from .._codec import decode, encode
from .._errors import DecodeError
from .._events import (
    AccessCompleted,
    AccessorOutput,
    AccessStale,
    HandshakeNeeded,
    LeaseLost,
    LostReason,
    Rejected,
    Send,
)
from .._layout import TpLayout, tp_layout
from .._messages import AccessDone, HandshakeReply, Heartbeat
from .._vllm_compat import encode_vllm_done, encode_vllm_heartbeat
from ._prefill import _Prefill
from ._scenario import Policy
from ._world import DecodeEngine, Request

__all__: list[str] = []

_INF = math.inf
_heappush = heapq.heappush
_heappop = heapq.heappop


@functools.cache
def _layouts(pinner_ranks: int, accessor_ranks: int) -> tuple[TpLayout, ...]:
    """`tp_layout` of every accessor rank (a handful of TP sizes: computed once each)."""
    return tuple(tp_layout(pinner_ranks, accessor_ranks, r) for r in range(accessor_ranks))


class _Decode(_Prefill):
    def _d_arrive(self, arg: tuple[DecodeEngine, int, Request]) -> None:
        de, gen, req = arg
        lease = req.lease
        assert lease is not None
        if not de.alive or de.gen != gen:
            self._mark_dead(lease, crash=True)
            self._at(self.now + self.sc.workload.client_retry, self._retry, req)
            return
        de.reqs[req.key] = req
        de.waiting.append(req)
        if de.accessors:
            now = de.clock.local(self.now)
            assert req.ticket is not None
            for r, acc in enumerate(de.accessors):
                for out in acc.track(now, req.key, req.ticket, push=req.push):
                    self._d_output(de, r, out)
        elif self.policy is Policy.VLLM_HB and de.hb_due == _INF:
            de.hb_due = self.now
        if self._tracing:
            self._trace(de.name, "track", req.key)
        api = self.api
        if api is not None and not req.copy:
            d = self.cfg.kv_lease_duration
            rng = self.api_rngs["abort"]
            if api.abort and rng.random() < api.abort:
                self._at(self.now + rng.uniform(0.0, d), self._abort, (de, de.gen, req))
            rng = self.api_rngs["redispatch"]
            if api.redispatch and rng.random() < api.redispatch:
                self._at(self.now + rng.uniform(0.0, d / 4), self._redispatch, req)
        self._poke(de, self.now)

    def _d_step_done(self, arg: tuple[DecodeEngine, int, float]) -> None:
        eng, gen, end = arg
        if gen != eng.gen or not eng.alive or end != eng.step_end:
            return  # the engine died, or a stall made this forward pass longer
        eng.stepping = False
        self._d_boundary(eng, stepped=True)

    def _d_boundary(self, de: DecodeEngine, *, stepped: bool) -> None:
        t = self.now
        clock = de.clock
        now: LocalTime = clock.epoch + clock.rate * t  # type: ignore[assignment]  # DriftingClock.local
        if now < clock.floor:
            now = LocalTime(clock.floor)
        accessors = de.accessors
        if de.replies or de.inbox or de.checked:
            self._d_inputs(de, now)
        for req in de.transfers:
            if req.due <= t:  # some transfer ended
                done = [req for req in de.transfers if req.due <= t]
                de.transfers = [req for req in de.transfers if req.due > t]
                for ended in done:
                    self._transfer_done(de, now, ended)
                break
        for r, acc in enumerate(accessors):
            outs = acc.handle_timeout(now)
            if outs:
                for out in outs:
                    self._d_output(de, r, out)
        if self._vllm_hb and de.hb_due <= t:
            self._vllm_heartbeat(de)
        if stepped:
            de.steps += 1
            finishing = de.finishing
            if de.flush:  # this forward pass finished the whole batch
                de.flush = False
                for req in list(de.running.values()):
                    self._finish(de, req)
                finishing.clear()
            while finishing and finishing[0][0] <= de.steps:
                _, _, key = _heappop(finishing)
                req_done = de.running.get(key)
                if req_done is not None:
                    self._finish(de, req_done)
        if de.waiting and de.slots > len(de.running) + len(de.transfers):  # a slot is free
            self._schedule(de, now)
        self._d_rearm(de, t)

    def _d_inputs(self, de: DecodeEngine, now: LocalTime) -> None:
        """Hand the accessor ranks what arrived: handshake replies, frames, checked frames."""
        accessors = de.accessors
        if de.replies:
            replies = de.replies
            de.replies = []
            api = self.api
            for rank, data in replies:
                msg = decode(data)
                assert isinstance(msg, HandshakeReply)
                if de.cut_seq and self._stale_answer(de, rank, msg):
                    self._d_checked(de, now, rank, data, "handshake reply from before a disconnect")
                    continue
                for out in accessors[rank].handshake_reply(now, msg):
                    self._d_output(de, rank, out)
                if api is not None and api.dup_reply and self.api_rngs["dup_reply"].random() < api.dup_reply:
                    self._dup_reply(de, rank, data, msg.engine_id)
        if de.inbox:
            inbox = de.inbox
            de.inbox = []
            for rank, data in inbox:
                try:
                    msg = decode(data)
                except DecodeError as exc:
                    self._violate("codec", f"{de.name} could not decode: {exc}")
                    continue
                if de.cut_seq and self._stale_answer(de, rank, msg):
                    self._d_checked(de, now, rank, data, f"{type(msg).__name__} from before a disconnect")
                    continue
                if self._tracing:
                    self._trace(f"{de.name}.{rank}", "recv", repr(msg))
                outs = accessors[rank].receive(now, msg)
                if outs:
                    for out in outs:
                        self._d_output(de, rank, out)
        if de.checked:
            checked = de.checked
            de.checked = []
            for rank, data, why in checked:
                self._d_checked(de, now, rank, data, why)

    def _d_rearm(self, de: DecodeEngine, t: float) -> None:
        """Start the next forward pass, or sleep until the earliest deadline."""
        accessors = de.accessors
        if de.running or de.stall_until > t:
            duration = self._step_base + self._step_per_seq * len(de.running)
            if de.stall_until > t:
                duration = max(duration, de.stall_until - t)
                if self._tracing:
                    self._trace(de.name, "stall", f"until {de.stall_until:.9f}")
            de.stall_until = 0.0
            # `_start_step` inlined: a decode engine's forward pass is the commonest event.
            de.stepping = True
            de.wake_at = _INF
            end = de.step_end = t + duration
            _heappush(self._heap, (end, next(self._seqs), self._d_step_done, (de, de.gen, end)))
            return
        nd = _INF
        for req in de.transfers:
            nd = min(nd, req.due)
        if accessors:
            for acc in accessors:
                ad = acc.next_deadline()
                if ad is not None:
                    nd = min(nd, de.clock.real(ad))
        if de.waiting and any(req.push for req in de.waiting):
            nd = min(nd, t + self.sc.workload.step_base)  # poll: a push write waits for validity
        nd = min(nd, de.hb_due)
        if nd < _INF:
            self._poke(de, max(t, nd))

    def _vllm_heartbeat(self, de: DecodeEngine) -> None:
        by_p: dict[str, list[str]] = {}
        for req in de.reqs.values():
            if req.p is not None and req.lease is not None and not req.failed:
                by_p.setdefault(req.p.name, []).append(req.key)
        for p_name, keys in by_p.items():
            data = encode_vllm_heartbeat(keys)
            for _ in range(de.tp):  # every decode worker heartbeats every prefill worker
                self._send(de, p_name, None, data, True)
        de.hb_due = self.now + self.cfg.heartbeat_interval if de.reqs else _INF

    def _schedule(self, de: DecodeEngine, now: LocalTime) -> None:
        if not de.waiting:
            return
        free = de.slots - len(de.running) - len(de.transfers)
        if free <= 0:
            return
        keep = []
        waiting = de.waiting
        for i, req in enumerate(waiting):
            if free <= 0:
                # No slot left: the rest only drop their failed requests (one pass in C,
                # instead of a Python step per queued request on every boundary).
                keep.extend([r for r in waiting[i:] if not r.failed])
                break
            if req.failed:
                continue
            if self._begin(de, now, req):
                free -= 1
            elif not req.failed:
                keep.append(req)
        de.waiting = keep

    def _begin(self, de: DecodeEngine, now: LocalTime, req: Request) -> bool:
        """Ask every rank's accessor; start the transfer only if all allow it."""
        started: list[int] = []
        decisions: list[AccessDecision] = []
        for r, acc in enumerate(de.accessors):
            dec = acc.begin_access(now, req.key)
            if not dec.allowed:
                for s in started:
                    de.accessors[s].access_failed(now, req.key, posted=False)  # never posted: back to waiting
                return False
            started.append(r)
            decisions.append(dec)
        wl = self.sc.workload
        req.xfer_start = self.now
        req.xfer_end = req.due = self.now + wl.transfer_base + wl.transfer_per_block * req.blocks
        req.exact = None
        req.notes = None
        if self.api is not None and decisions and not self._api_begin(de, now, req, decisions):
            return False
        de.transfers.append(req)
        if self._tracing:
            self._trace(de.name, "begin_access", f"{req.key} until {req.xfer_end:.9f}")
        return True

    def _transfer_done(self, de: DecodeEngine, now: LocalTime, req: Request) -> None:
        lease = req.lease
        assert lease is not None and req.p is not None
        pe = req.p
        end = req.xfer_end
        # The transport: a dead or restarted pinner engine, or a cut link, fails the transfer.
        ok = pe.alive and pe.incarnation == lease.incarnation and not self._cut(de.name, pe.name)
        ok = ok and not any(why == "crash" for _, why in lease.freed.values())
        if self.check and ok and req.push:
            for prank, (ft, why) in lease.freed.items():
                if ft <= end:
                    self._violate(
                        "no-access-overlaps-free",
                        f"push write {req.key} ran [{req.xfer_start:.9f}, {end:.9f}] but rank {prank} "
                        f"freed at {ft:.9f} ({why})",
                        lease,
                    )
        if self._tracing:
            self._trace(de.name, "transfer_done", f"{req.key} ok={ok} end={end:.9f}")
        api = self.api
        if (
            ok
            and req.push
            and not req.failed
            and api is not None
            and api.late_write
            and self.api_rngs["late_write"].random() < api.late_write
        ):
            self._late_write(de, now, req)  # reported failed now, the WRITE lands later
            return
        if ok and req.notes is not None:
            # The transport delivers each rank's attached access-done after its data landed,
            # whatever the engine has decided about the request meanwhile.
            for r, note_ranks, notes in req.notes:
                for q, note in zip(note_ranks, notes, strict=True):
                    self._d_output(de, r, Send(pe.name, q, note))
        if req.failed:
            for r, acc in enumerate(de.accessors):
                if acc.state_of(req.key) is not None:
                    for out in acc.access_failed(now, req.key):
                        self._d_output(de, r, out)
                for out in acc.untrack(now, req.key):
                    self._d_output(de, r, out)
            return
        # Every rank's transfer ends here: tell each rank's accessor before acting on what any
        # of them says (one rank's loss must not untrack a sibling whose access is in flight).
        if not ok:
            failed = []
            for acc in de.accessors:
                failed.append(acc.access_failed(now, req.key))
            for r, outs in enumerate(failed):
                for out in outs:
                    self._d_output(de, r, out)
            self._fail(de, req, "transfer failed")
            return
        if de.accessors:
            notified = False
            if req.notes is not None:
                if api is not None and api.fail_posted and self.api_rngs["fail_posted"].random() < api.fail_posted:
                    self._failed_after_notify(de, now, req)
                    return
                notified = True
            finished = []
            for acc in de.accessors:
                finished.append(acc.access_finished(now, req.key, notified=notified))
            for r, outs in enumerate(finished):
                for out in outs:
                    self._d_output(de, r, out)
            return
        # Baselines: tell the pinner ranks; the data is whatever the blocks hold now.
        for layout in _layouts(pe.tp, de.tp):
            for pr in layout.targets:
                self._send(de, pe.name, pr, encode_vllm_done(req.key, layout.expected), False)
        req.done_ranks = de.tp
        self._accepted(de, req)

    def _accepted(self, de: DecodeEngine, req: Request) -> None:
        """Every rank's access is reported valid: the engine will decode from these blocks."""
        lease = req.lease
        assert lease is not None
        stale = [(r, ft, why) for r, (ft, why) in lease.freed.items() if ft <= req.xfer_end]
        if stale:
            self.result.stale_used += 1
            if self.check or self.policy is Policy.KVLEASE:
                self._violate(
                    "no-stale-read-reported-done",
                    f"{req.key} read [{req.xfer_start:.9f}, {req.xfer_end:.9f}] reported valid; freed: {stale}",
                    lease,
                )
            if self.policy is not Policy.KVLEASE:
                # Optimistic for the baselines: assume the corruption is noticed and recomputed.
                self._fail(de, req, "stale data")
                return
        if self._tracing:
            self._trace(de.name, "accepted", req.key)
        de.running[req.key] = req
        heapq.heappush(de.finishing, (de.steps + req.out_tokens, req.id, req.key))
        api = self.api
        if api is not None and api.retrack and self.api_rngs["retrack"].random() < api.retrack:
            later = self.now + self.api_rngs["retrack"].uniform(0.0, self.cfg.kv_lease_duration / 2)
            self._at(later, self._retrack_later, (de, de.gen, req))

    def _finish(self, de: DecodeEngine, req: Request) -> None:
        self.result.completed += 1
        de.running.pop(req.key, None)
        de.reqs.pop(req.key, None)
        if req.lease is not None:
            req.lease.req = None

    def _fail(self, de: DecodeEngine, req: Request, why: str) -> None:
        if req.failed:
            return
        req.failed = True
        if self._tracing:
            self._trace(de.name, "fail", f"{req.key}: {why}")
        de.reqs.pop(req.key, None)
        de.running.pop(req.key, None)
        now = de.clock.local(self.now)
        for r, acc in enumerate(de.accessors):
            if acc.state_of(req.key) is not None and req not in de.transfers:
                for out in acc.untrack(now, req.key):
                    self._d_output(de, r, out)
        if req.lease is not None:
            self._mark_dead(req.lease)
        self._recompute(req)

    def _d_output(self, de: DecodeEngine, rank: int, out: AccessorOutput) -> None:
        match out:
            case Send():
                self._d_send(de, rank, out)
            case HandshakeNeeded():
                self._side_channel(de, rank, out.engine_id, out.message)
            case LeaseLost():
                self._d_lost(de, rank, out)
            case AccessStale():
                self.result.stale_caught += 1
                req = de.reqs.get(out.key)
                if self._tracing:
                    self._trace(f"{de.name}.{rank}", "access_stale", f"{out.key} {out.reason}")
                if req is not None:
                    self._trouble(req, f"access stale ({out.reason})")
                    self._fail(de, req, "stale access caught")
            case AccessCompleted():
                req = de.reqs.get(out.key)
                if req is not None and not req.failed:
                    req.done_ranks += 1
                    if req.done_ranks == de.tp:
                        self._accepted(de, req)
            case Rejected():
                self.result.rejected += 1
                if self._tracing:
                    self._trace(f"{de.name}.{rank}", "rejected", out.reason)
            case _:
                assert_never(out)

    def _d_send(self, de: DecodeEngine, rank: int, out: Send) -> None:
        msg = out.message
        hb = isinstance(msg, Heartbeat)
        if self.check and isinstance(msg, Heartbeat):
            for lid in msg.lease_ids:
                lease = self.leases.get((out.engine_id, msg.incarnation, lid))
                if lease is not None:
                    lease.last_hb = self.now
        if self._tracing:
            self._trace(f"{de.name}.{rank}", "send", f"to {out.engine_id}.{out.rank}: {msg!r}")
        if self.check:
            pcfg = self.cfgs.get(out.engine_id)
            bound = self.cfgs[de.name].max_message_bytes
            if pcfg is not None and pcfg.max_message_bytes < bound:
                bound = pcfg.max_message_bytes
            self._check_frame(f"{de.name}.{rank}", f"{out.engine_id}.{out.rank}", msg, len(encode(msg)), bound)
        if self.api is not None:
            if self._track_seq and isinstance(msg, Heartbeat | AccessDone):
                self._sent(de, rank, out.engine_id, msg.seq if isinstance(msg, Heartbeat) else msg.attempt)
            if self._api_send(de, rank, out, msg, hb):
                return
        self._send(de, out.engine_id, out.rank, encode(msg), hb)

    def _d_lost(self, de: DecodeEngine, rank: int, out: LeaseLost) -> None:
        req = de.reqs.get(out.key)
        self.result.leases_lost += 1
        if self._tracing:
            self._trace(f"{de.name}.{rank}", "lease_lost", f"{out.key} {out.reason.value}")
        if req is not None:
            if out.reason not in (LostReason.PINNER_RESTARTED, LostReason.UNREACHABLE, LostReason.ACCESS_FAILED):
                self._trouble(req, f"lease lost ({out.reason.value})")
            if req not in de.transfers:
                self._fail(de, req, f"lease lost: {out.reason.value}")
            else:
                req.failed = True
                self._fail_later(de, req)

    def _fail_later(self, de: DecodeEngine, req: Request) -> None:
        """A rank lost the lease while the transfer is in flight: the transfer's end decides."""
        de.reqs.pop(req.key, None)
        if req.lease is not None:
            self._mark_dead(req.lease)
        self._recompute(req)
