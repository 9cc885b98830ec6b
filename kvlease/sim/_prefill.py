"""The prefill engines of the simulated cluster: the pinner side.

Each prefill engine runs forward passes (one request's prefill each), and at every boundary
hands its inbox to its real `Pinner` ranks (or the fixed-timeout baseline), runs their
timeouts and dispatches their outputs (`PinnerOutput`: sends, frees, rejections). At the end
of a prefill it grants the lease on every rank and sends the ticket on with the request.
"""

from __future__ import annotations

import heapq
from typing import assert_never

from .._clock import LocalTime
from .._codec import decode, encode
from .._errors import DecodeError
from .._events import EndReason, Free, PinnerOutput, Rejected, Send
from .._messages import HeartbeatAck, LeaseTicket
from .._vllm_compat import VllmAccessDone, VllmHeartbeat, decode_vllm
from ._lifecycle import _Lifecycle
from ._world import PrefillEngine, Request, SimLease

__all__: list[str] = []

_INF = float("inf")
_heappush = heapq.heappush


class _Prefill(_Lifecycle):
    def _p_enqueue(self, arg: tuple[PrefillEngine, int, Request]) -> None:
        pe, gen, req = arg
        if not pe.alive or pe.gen != gen:
            self._at(self.now + self.sc.workload.client_retry, self._retry, req)
            return
        pe.queue.append(req)
        self._poke(pe, self.now)

    def _p_step_done(self, arg: tuple[PrefillEngine, int, float]) -> None:
        eng, gen, end = arg
        if gen != eng.gen or not eng.alive or end != eng.step_end:
            return  # the engine died, or a stall made this forward pass longer
        eng.stepping = False
        req = eng.current
        eng.current = None
        if req is not None:
            self._prefilled(eng, req)
        self._p_boundary(eng)

    def _start_step(self, eng: PrefillEngine, duration: float) -> None:
        eng.stepping = True
        eng.wake_at = _INF
        end = eng.step_end = self.now + duration
        _heappush(self._heap, (end, next(self._seqs), self._p_step_done, (eng, eng.gen, end)))

    def _p_boundary(self, pe: PrefillEngine) -> None:
        clock = pe.clock
        # `DriftingClock.local` inlined (this runs once per forward pass); LocalTime is a NewType,
        # the same float either way.
        now: LocalTime = clock.epoch + clock.rate * self.now  # type: ignore[assignment]
        if now < clock.floor:
            now = LocalTime(clock.floor)
        if pe.inbox:
            inbox = pe.inbox
            pe.inbox = []
            for rank, data in inbox:
                self._p_receive(pe, now, rank, data)
        if pe.checked:
            checked = pe.checked
            pe.checked = []
            for rank, data, why in checked:
                self._p_receive(pe, now, rank, data, why)
        pinners = pe.pinners
        if pinners:
            for r, pinner in enumerate(pinners):
                outs = pinner.handle_timeout(now)
                if outs:
                    for out in outs:
                        self._p_output(pe, r, out)
        else:
            for r, fixed in enumerate(pe.fixed):
                for free in fixed.handle_timeout(now):
                    self._p_output(pe, r, free)
        if pe.queue:
            req = pe.queue.popleft()
            pe.current = req
            wl = self.sc.workload
            self._start_step(pe, wl.prefill_base + wl.prefill_per_token * req.prompt)
            return
        nd = _INF
        for pinner in pinners:
            d = pinner.next_deadline()
            if d is not None and d < nd:
                nd = d
        for fixed in pe.fixed:
            fd = fixed.next_deadline()
            if fd is not None and fd < nd:
                nd = fd
        if nd < _INF:
            self._poke(pe, max(self.now, pe.clock.real(nd)))

    def _p_receive(self, pe: PrefillEngine, now: LocalTime, rank: int, data: bytes, why: str = "") -> None:
        """Hand one frame to pinner rank `rank`. `why`: it was misdelivered there (API
        adversity), so the pinner must refuse it."""
        if self._native and pe.pinners:
            try:
                msg = decode(data)
            except DecodeError as exc:
                self._violate("codec", f"{pe.name} could not decode: {exc}")
                return
            if self._tracing:
                self._trace(f"{pe.name}.{rank}", "recv", repr(msg) if not why else f"{why}: {msg!r}")
            pinner = pe.pinners[rank]
            watch = self._overdue(pinner, now, msg) if self.check else None
            outs = pinner.receive(now, msg)
            if watch:
                self._check_overdue(pe, rank, pinner, now, msg, watch, outs)
            if why and self.check:
                acted = [out for out in outs if not isinstance(out, Rejected)]
                if acted:
                    self._violate(
                        "misdelivery-refused",
                        f"{pe.name}.{rank} acted on a {why}: {acted!r}",
                        self._msg_lease(pe.name, msg),
                    )
            for out in outs:
                self._p_output(pe, rank, out)
            return
        try:
            note = decode_vllm(data)
        except DecodeError as exc:
            self._violate("codec", f"{pe.name} could not decode a vLLM notification: {exc}")
            return
        match note:
            case VllmHeartbeat():
                if pe.pinners:
                    pe.pinners[rank].receive_vllm_heartbeat(now, note.request_ids)
            case VllmAccessDone():
                if pe.pinners:
                    for out in pe.pinners[rank].receive_vllm_done(now, note.request_id, note.count):
                        self._p_output(pe, rank, out)
                else:
                    free = pe.fixed[rank].done(now, note.request_id, note.count)
                    if free is not None:
                        self._p_output(pe, rank, free)
            case _:
                assert_never(note)

    def _prefilled(self, pe: PrefillEngine, req: Request) -> None:
        """Prefill finished: pin the blocks under a lease on every rank, send the ticket."""
        now = pe.clock.local(self.now)
        self.result.prefills += 1
        if pe.pinners:
            lease_id = None
            gap = self.sc.id_gap
            if gap:
                lease_id = pe.last_id = pe.last_id + self.id_rng.randint(1, gap)
            ticket = pe.pinners[0].grant(now, req.key, push=req.push, lease_id=lease_id)
            for pinner in pe.pinners[1:]:
                pinner.grant(now, req.key, push=req.push, lease_id=ticket.lease_id)
            lid = ticket.lease_id
            # The ticket travels as JSON-ish transfer params, as vLLM's kv_transfer_params do.
            req.ticket = LeaseTicket.from_dict(ticket.to_dict())
        else:
            lid = pe.fixed[0].grant(now, req.key)
            for fixed in pe.fixed[1:]:
                fixed.grant(now, req.key)
        lease = SimLease(pe, pe.incarnation, lid, req, self.now)
        req.lease = lease
        pe.live[lid] = lease
        self.leases[(pe.name, pe.incarnation, lid)] = lease
        if self.check:
            self.all_leases.append(lease)
        self._set_pinned(req.blocks)
        if self._tracing:
            self._trace(pe.name, "grant", f"{lease.name} key={req.key} blocks={req.blocks} push={req.push}")
        d = req.d
        assert d is not None
        self._at(self.now + self.sc.workload.router_delay, self._d_arrive, (d, d.gen, req))

    def _p_output(self, pe: PrefillEngine, rank: int, out: PinnerOutput) -> None:
        match out:
            case Send():
                self._p_send(pe, rank, out)
            case Free():
                self._p_free(pe, rank, out)
            case Rejected():
                self.result.rejected += 1
                if self._tracing:
                    self._trace(f"{pe.name}.{rank}", "rejected", out.reason)
            case _:
                assert_never(out)

    def _p_send(self, pe: PrefillEngine, rank: int, out: Send) -> None:
        heartbeat = isinstance(out.message, HeartbeatAck)
        if self._tracing:
            self._trace(f"{pe.name}.{rank}", "send", f"to {out.engine_id}.{out.rank}: {out.message!r}")
        data = encode(out.message)
        if self.check:
            bound = self.cfgs[pe.name].max_message_bytes
            self._check_frame(f"{pe.name}.{rank}", f"{out.engine_id}.{out.rank}", out.message, len(data), bound)
        if self._misroute:
            de = self.d.get(out.engine_id)
            rng = self.api_rngs["misroute"]
            if de is not None and de.tp > 1 and out.rank is not None and rng.random() < self._misroute:
                # API adversity: delivered to a sibling accessor rank (whose clock reads the same).
                to = rng.choice([r for r in range(de.tp) if r != out.rank])
                self._api_mark(de.name, pe.name)
                self._count("misrouted-to-accessor")
                why = f"{type(out.message).__name__} of {pe.name}.{rank} for rank {out.rank} misrouted to rank {to}"
                if self._tracing:
                    self._trace(f"{pe.name}.{rank}", "misroute", why)
                self._send_checked(pe, de, to, data, why, heartbeat)
                return
        self._send(pe, out.engine_id, out.rank, data, heartbeat)

    def _p_free(self, pe: PrefillEngine, rank: int, out: Free) -> None:
        lease = pe.live.get(out.lease_id)
        if self._tracing:
            self._trace(f"{pe.name}.{rank}", "free", f"{pe.name}/{pe.incarnation}/{out.lease_id} {out.reason.value}")
        if lease is None or rank in lease.freed:
            if self.check:
                self._violate("one-free", f"{pe.name}.{rank} freed lease {out.lease_id} again ({out.reason.value})")
            return
        if out.reason is EndReason.EXPIRED:
            self._on_expired(pe, rank, lease)
        self._memory_released(lease, rank, out.reason.value)
        if not lease.unfreed:
            del pe.live[out.lease_id]

    def _on_expired(self, pe: PrefillEngine, rank: int, lease: SimLease) -> None:
        req = lease.req
        pending = req is not None and not req.failed and req.lease is lease
        if rank == 0 and pending and req is not None and req.d is not None and req.d.alive:
            self.result.false_frees += 1
            if self.check and not lease.troubled:
                lease.troubled = "expired while its accessor still needed it"
        if self.check:
            self._check_reclaim_bound(pe, lease)
