"""The life of the simulated cluster around the protocol: the workload (arrivals, bursts),
the router, and the scheduled faults (crashes and restarts, partitions, stalls at a lease's
edge).

Owns what happens to requests and engines when things fail; the pinner and accessor sides
(`_prefill`, `_decode`) own what the core is told about it.
"""

from __future__ import annotations

import math
from typing import Any

from ._checks import _Checks
from ._scenario import FaultKind
from ._world import DecodeEngine, PrefillEngine, Request, SimEngine, SimLease, respawn

__all__: list[str] = []

_INF = math.inf


class _Lifecycle(_Checks):
    def _rate(self, t: float) -> float:
        wl = self.sc.workload
        for start, length, rate in wl.bursts:
            if start <= t < start + length:
                return rate
        return wl.rate

    def _arrival(self, _: Any) -> None:
        wl = self.sc.workload
        if self.next_req < self.sc.max_requests:
            rng = self.rng
            prompt = rng.randint(*wl.prompt_tokens)
            req = Request(
                self.next_req,
                self.now,
                prompt,
                rng.randint(*wl.output_tokens),
                max(1, -(-prompt // wl.block_tokens)),
                rng.random() < wl.push_fraction,
            )
            self.next_req += 1
            self.result.requests += 1
            self._route(req)
            self._at(self.now + rng.expovariate(self._rate(self.now)), self._arrival, None)

    def _route(self, req: Request) -> None:
        ps = [e for e in self.p.values() if not self.router_down[e.name]]
        ds = [e for e in self.d.values() if not self.router_down[e.name]]
        if not ps or not ds:
            self._at(self.now + self.sc.workload.client_retry, self._retry, req)
            return
        p = min(ps, key=lambda e: (len(e.queue) + (e.current is not None), e.name))
        d = min(ds, key=lambda e: (len(e.reqs) / e.slots, e.name))
        req.attempt += 1
        req.key = f"r{req.id}.{req.attempt}"
        req.p, req.d = p, d
        self._at(self.now + self.sc.workload.router_delay, self._p_enqueue, (p, p.gen, req))

    def _retry(self, req: Request) -> None:
        self._route(respawn(req))

    def _recompute(self, req: Request) -> None:
        self.result.recomputed += 1
        self._route(respawn(req))

    def _fault(self, f: Any) -> None:
        if self._tracing:
            self._trace(f.engine, f.kind.value, f"duration={f.duration} peer={f.peer}")
        if f.kind is FaultKind.CRASH:
            eng = self.engines[f.engine]
            if not eng.alive:
                return
            if isinstance(eng, PrefillEngine):
                self._crash_p(eng)
            else:
                assert isinstance(eng, DecodeEngine)
                self._crash_d(eng)
            self._at(self.now + self.sc.workload.router_detect, self._router_mark, (eng.name, True))
            self._at(self.now + f.duration, self._restart, eng)
        elif f.kind is FaultKind.PARTITION:
            pair = (f.engine, f.peer) if f.engine < f.peer else (f.peer, f.engine)
            self.partitions[pair] = self.partitions.get(pair, 0) + 1
            self._at(self.now + f.duration, self._heal, pair)
        else:
            eng = self.engines[f.engine]
            if isinstance(eng, DecodeEngine) and eng.alive:
                until = self.now + f.duration
                if f.kind is FaultKind.EDGE_STALL:
                    until = self._edge(eng, f.duration)
                    eng.flush = True
                if eng.stepping:
                    # The forward pass in progress is the one that stalls.
                    if until > eng.step_end:
                        eng.step_end = until
                        self._at(until, self._d_step_done, (eng, eng.gen, until))
                else:
                    eng.stall_until = max(eng.stall_until, until)
                    self._poke(eng, self.now)

    def _edge(self, de: DecodeEngine, u: float) -> float:
        """An adversarial stall: end the forward pass right at a lease's edge, so the next
        access starts where validity, expiry and the access's end meet (where a wrong drift or
        extension bound shows). ``u >= 0``: ``u * duration / 50`` before a waiting request's
        accessor validity end; ``u < 0``: ``|u| * duration / 200`` after its pinner's expiry
        (the adversary sees both sides' state). The earliest such edge the forward pass in
        progress can still reach is chosen."""
        if not de.accessors:
            return self.now
        earliest = de.step_end if de.stepping else self.now
        d = self.cfg.kv_lease_duration
        best = _INF
        for req in de.waiting:
            edge = _INF
            if u >= 0:
                v = de.accessors[0].valid_until(req.key)
                if v is not None:
                    edge = de.clock.real(v) - u * d / 50.0
            elif req.lease is not None and req.p is not None and req.p.pinners:
                info = req.p.pinners[0].info(req.lease.lease_id)
                if info is not None and req.p.incarnation == req.lease.incarnation:
                    edge = req.p.clock.real(info.expiry) - u * d / 200.0
            if earliest <= edge < best:
                best = edge
        if best == _INF:
            return self.now + abs(u) * self.cfg.lease_extension
        return best

    def _router_mark(self, arg: tuple[str, bool]) -> None:
        name, down = arg
        if down == (not self.engines[name].alive):
            self.router_down[name] = down

    def _restart(self, eng: SimEngine) -> None:
        if self._tracing:
            self._trace(eng.name, "restart", "")
        eng.alive = True
        eng.gen += 1
        eng.inbox.clear()
        eng.checked.clear()
        eng.stepping = False
        eng.wake_at = _INF
        if isinstance(eng, PrefillEngine):
            self._start_pinner(eng)
        else:
            assert isinstance(eng, DecodeEngine)
            self._start_accessor(eng)
        self._at(self.now + self.sc.workload.router_detect / 4, self._router_mark, (eng.name, False))

    def _crash_p(self, pe: PrefillEngine) -> None:
        pe.alive = False
        pe.gen += 1
        pe.inbox.clear()
        pe.checked.clear()
        retry = self.sc.workload.client_retry
        lost = list(pe.queue) + ([pe.current] if pe.current else [])
        pe.queue.clear()
        pe.current = None
        for req in lost:
            self._at(self.now + retry, self._retry, req)
        # Process exit releases every pinned block; not a protocol free.
        for lease in list(pe.live.values()):
            for r in range(pe.tp):
                if r not in lease.freed:
                    self._memory_released(lease, r, "crash")
        pe.live.clear()

    def _crash_d(self, de: DecodeEngine) -> None:
        de.alive = False
        de.gen += 1
        de.inbox.clear()
        de.checked.clear()
        retry = self.sc.workload.client_retry
        for req in list(de.reqs.values()):
            lease = req.lease
            if lease is not None and lease.unfreed:
                self._mark_dead(lease, crash=True)
            req.failed = True
            self._at(self.now + retry, self._retry, req)
        de.reqs = {}
        de.accessors = []
        de.waiting = []
        de.running = {}
        de.finishing = []
        de.transfers = []

    def _mark_dead(self, lease: SimLease, *, crash: bool = False) -> None:
        if crash and lease.unfreed and lease.d_crash == _INF:
            lease.d_crash = self.now  # reclaim latency is measured from here
        if lease.dead_since == _INF and lease.unfreed:
            lease.dead_since = self.now
            self._set_pinned(0.0, lease.blocks * lease.unfreed)
        lease.req = None

    def _memory_released(self, lease: SimLease, rank: int, why: str) -> None:
        lease.freed[rank] = (self.now, why)
        lease.unfreed -= 1
        dead = lease.blocks if lease.dead_since != _INF else 0.0
        self._set_pinned(-lease.blocks, -dead)
        if not lease.unfreed and lease.d_crash != _INF:
            self.result.reclaim_latencies.append(self.now - lease.d_crash)
