"""API-level adversity (`Scenario.api`, kvlease policy only): what an engine and its transport
can do through the API at the worst moment.

Re-track a ticket after untrack, completion, disconnect or a failed transfer; hand a ticket to
a second request; deliver a transfer's attached notification and then report the transfer
failed (or fail before posting); misroute messages and handshake replies to a sibling rank;
deliver replies again later; disconnect; end a transfer exactly at valid_until and have a
pinner handle a message exactly at a lease's expiry. Each kind draws from its own random
stream (`api_rngs`), so switching one off leaves the others' draws alone.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from .._accessor import AccessDecision, TrackedState
from .._clock import LocalTime
from .._codec import decode, encode
from .._errors import LocalProtocolError
from .._events import LeaseLost, Rejected, Send
from .._layout import tp_layout
from .._messages import AccessDone, HandshakeReply, Heartbeat, Message
from ._decode import _Decode
from ._world import DecodeEngine, PrefillEngine, Request, SimLease

__all__: list[str] = []

_INF = math.inf


class _Adversity(_Decode):
    def _api_send(self, de: DecodeEngine, rank: int, out: Send, msg: Message, hb: bool) -> bool:
        """Adversity on a decode engine's message to a pinner: hold it until the pinner's
        expiry of a lease it names, or deliver it to a sibling pinner rank. True if handled."""
        pe = self.p.get(out.engine_id)
        if pe is None or out.rank is None:
            return False
        api = self.api
        assert api is not None
        if hb and api.forged_heartbeat and self.api_rngs["forged_heartbeat"].random() < api.forged_heartbeat:
            assert isinstance(msg, Heartbeat)
            self._forge_heartbeat(de, pe, out.rank, msg)
        if (
            api.part_misroute
            and isinstance(msg, AccessDone)
            and pe.tp > de.tp
            and self.api_rngs["part_misroute"].random() < api.part_misroute
        ):
            # One part's access-done of a multi-part access, delivered to another rank the same
            # access reads (or writes): that rank's own part may still be running.
            siblings = [q for q in tp_layout(pe.tp, de.tp, rank).targets if q != out.rank]
            to = self.api_rngs["part_misroute"].choice(siblings)
            self._api_mark(de.name, pe.name)
            self._count("part-misrouted")
            why = f"access-done of {de.name}.{rank} for part {out.rank} misdelivered to rank {to} of the same access"
            if self._tracing:
                self._trace(f"{de.name}.{rank}", "part_misroute", why)
            self._send_checked(de, pe, to, encode(msg), why, hb, "part_misroute")
            return True
        if (
            self._at_expiry
            and isinstance(msg, Heartbeat | AccessDone)
            and self.api_rngs["at_expiry"].random() < self._at_expiry
            and self._hold_to_expiry(de, pe, out.rank, msg)
        ):
            return True
        rng = self.api_rngs["misroute"]
        if self._misroute and pe.tp > 1 and rng.random() < self._misroute:
            q = out.rank
            targets = tp_layout(pe.tp, de.tp, rank).targets
            others = [x for x in range(pe.tp) if x not in targets]
            self._api_mark(de.name, pe.name)
            if self._tracing:
                self._trace(f"{de.name}.{rank}", "misroute", f"to {pe.name}.{q}: {msg!r}")
            if others:
                to = rng.choice(others)
                self._count("misrouted-to-pinner")
                why = f"{type(msg).__name__} of {de.name}.{rank} for rank {q} misrouted to rank {to}"
                self._send_checked(de, pe, to, encode(msg), why, hb)
            else:
                # Every sibling is one this accessor rank addresses too: a delivery there is
                # as good as addressed (and the addressed rank loses it).
                self._count("misrouted-within-layout")
                self._send(de, pe.name, rng.choice([x for x in range(pe.tp) if x != q]), encode(msg), hb)
            return True
        return False

    def _forge_heartbeat(self, de: DecodeEngine, pe: PrefillEngine, prank: int, msg: Heartbeat) -> None:
        """Send pinner rank `prank` a heartbeat from an engine outside the deployment (no key:
        anyone may send one), filled to the pinner's frame bound with unknown ids far apart: its
        ack would not fit, so the pinner must refuse it (an ack over the bound is a
        ``frame-within-bound`` violation at `_p_send`)."""
        bound = self.cfgs[pe.name].max_message_bytes - self.cfgs[pe.name].frame_overhead
        forged = Heartbeat(f"X{de.name}", 0, 1, 0xF0F0, msg.incarnation, 1, msg.t_send, ())
        ids = self._forged_ids.get(bound)
        if ids is None:
            ids = []
            while True:  # ids 2**32 apart, above any the simulated pinners grant
                more = (*ids, (1 << 63) + (len(ids) << 32))
                if len(encode(attrs.evolve(forged, lease_ids=more))) > bound:
                    break
                ids = list(more)
            self._forged_ids[bound] = ids
        data = encode(attrs.evolve(forged, lease_ids=tuple(ids)))
        self._count("forged-heartbeat")
        if self._tracing:
            self._trace(f"X{de.name}", "forged", f"to {pe.name}.{prank}: {len(data)}-byte heartbeat of {len(ids)} ids")
        if self._cut(de.name, pe.name):
            return
        net = self.sc.network
        rng = self.api_rngs["forged_heartbeat"]
        delay = net.base_delay + (min(rng.expovariate(1.0 / net.jitter), net.cap) if net.jitter > 0 else 0.0)
        self._at(self.now + delay, self._deliver, (pe, pe.gen, prank, data, de.name))

    def _late_write(self, de: DecodeEngine, now: LocalTime, req: Request) -> None:
        """A push WRITE fails at the transport after it was posted (access_failed(posted=True)
        on every rank: the core sends Release(posted=True)) and lands later anyway, up to the
        access-time bound after it began. The engine recomputes; the late landing is audited:
        no WRITE may land in memory the pinner freed."""
        lease, pe = req.lease, req.p
        assert lease is not None and pe is not None
        bound = max(self.cfgs[de.name].max_access_time, self.cfgs[pe.name].max_access_time)
        # When the WRITE lands is the transport's business, not when the engine's loop hears it
        # failed (a stalled forward pass hears late): possibly before this report.
        land = max(req.xfer_end, req.xfer_start + self.api_rngs["late_write"].uniform(0.5, 1.0) * bound)
        self._count("late-write")
        if self._tracing:
            self._trace(de.name, "late_write", f"{req.key} failed after posting; it lands at {land:.9f}")
        failed = []
        for acc in de.accessors:
            failed.append(acc.access_failed(now, req.key, posted=True))
        for r, outs in enumerate(failed):
            for out in outs:
                self._d_output(de, r, out)
        if self.check:
            self._at(max(self.now, land), self._late_land, (req, lease, pe.incarnation, land))
        self._fail(de, req, "push write failed after posting")

    def _late_land(self, arg: tuple[Request, SimLease, int, float]) -> None:
        req, lease, incarnation, land = arg
        pe = lease.p
        if not pe.alive or pe.incarnation != incarnation:
            return  # the pinner engine died: its memory went with it
        for prank, (ft, why) in sorted(lease.freed.items()):
            if ft <= land and why != "crash":
                self._violate(
                    "no-access-overlaps-free",
                    f"push write {req.key} (begun {req.xfer_start:.9f}, reported failed after posting) landed at "
                    f"{land:.9f}, but rank {prank} freed at {ft:.9f} ({why})",
                    lease,
                )

    def _hold_to_expiry(self, de: DecodeEngine, pe: PrefillEngine, prank: int, msg: Heartbeat | AccessDone) -> bool:
        """Hold `msg` and have pinner rank `prank` handle it exactly at the expiry (its clock)
        of a lease it names. False if there is no such future expiry."""
        if not pe.alive or not pe.pinners or prank >= len(pe.pinners) or msg.incarnation != pe.incarnation:
            return False
        ids = msg.lease_ids if isinstance(msg, Heartbeat) else (msg.lease_id,)
        if not ids:
            return False
        lid = ids[self.api_rngs["at_expiry"].randrange(len(ids))]
        info = pe.pinners[prank].info(lid)
        if info is None:
            return False
        e = float(info.expiry)
        clock = pe.clock
        tr = clock.real(e)
        if tr <= self.now + self.sc.network.base_delay:
            return False
        while clock.epoch + clock.rate * tr > e:  # the real instant whose reading is at most e
            tr = math.nextafter(tr, -_INF)
        self._api_mark(de.name, pe.name)
        self._count("held-to-expiry")
        if self._tracing:
            self._trace(f"{de.name}", "hold", f"to {pe.name}.{prank} until lease {lid} expiry {e!r}: {msg!r}")
        self._at(tr, self._p_exact, (pe, pe.gen, prank, encode(msg), e, de.name))
        return True

    def _p_exact(self, arg: tuple[PrefillEngine, int, int, bytes, float, str]) -> None:
        pe, gen, prank, data, e, src = arg
        if not pe.alive or pe.gen != gen or not pe.pinners or self._cut(src, pe.name):
            self.result.dropped += 1
            return
        clock = pe.clock
        now = clock.local(self.now)
        if now < e:
            now = LocalTime(e)  # exactly at the expiry
        clock.floor = now
        msg = decode(data)
        if isinstance(msg, Heartbeat) and self.check:
            # A held heartbeat is one the network delivered late: for the reclaim bound it was
            # sent no earlier than one network delay before it arrived.
            for lid in msg.lease_ids:
                lease = self.leases.get((pe.name, msg.incarnation, lid))
                if lease is not None and lease.last_hb < self.now - self.sc.network.max_delay:
                    lease.last_hb = self.now - self.sc.network.max_delay
        self._p_receive(pe, now, prank, data)
        self._poke(pe, self.now)

    def _d_checked(self, de: DecodeEngine, now: LocalTime, rank: int, data: bytes, why: str) -> None:
        """Hand accessor rank `rank` a frame that was misdelivered to it, or that answers
        something it sent before a disconnect, or a handshake reply delivered again: the
        accessor must refuse it or ignore it (Rejected or nothing, and no visible change)."""
        msg = decode(data)
        acc = de.accessors[rank]
        before = self._acc_view(de, acc) if self.check else None
        if self._tracing:
            self._trace(f"{de.name}.{rank}", "recv", f"{why}: {msg!r}")
        self._count("stale-or-misdelivered")
        outs = acc.handshake_reply(now, msg) if isinstance(msg, HandshakeReply) else acc.receive(now, msg)
        if self.check:
            acted = [out for out in outs if not isinstance(out, Rejected)]
            if acted or self._acc_view(de, acc) != before:
                self._violate(
                    "misdelivery-refused",
                    f"{de.name}.{rank} acted on a {why}: {msg!r} -> {acted!r}",
                    self._msg_lease(msg.engine_id, msg),
                )
        for out in outs:
            self._d_output(de, rank, out)

    def _dup_reply(self, de: DecodeEngine, rank: int, data: bytes, p_name: str) -> None:
        """Deliver a handshake reply again later (perhaps after the pinner restarted), to its
        rank or a sibling."""
        rng = self.api_rngs["dup_reply"]
        to = rank
        if de.tp > 1 and rng.random() < 0.3:
            to = rng.choice([r for r in range(de.tp) if r != rank])
        later = self.now + rng.uniform(0.0, 2.0 * self.cfg.kv_lease_duration)
        why = f"handshake reply of {p_name} for rank {rank}, delivered again" + (f" to rank {to}" if to != rank else "")
        self._at(later, self._reply_again, (de, de.gen, to, data, p_name, why))

    def _reply_again(self, arg: tuple[DecodeEngine, int, int, bytes, str, str]) -> None:
        de, gen, to, data, p_name, why = arg
        if not de.alive or de.gen != gen or self._cut(de.name, p_name):
            return
        self._count("reply-again")
        de.checked.append((to, data, why))
        self._poke(de, self.now)

    def _api_begin(self, de: DecodeEngine, now: LocalTime, req: Request, decisions: list[AccessDecision]) -> bool:
        """Adversity as a transfer starts. False: the transport refused to post it (nothing was
        handed over: access_failed(posted=False)); the request waits and is tried again."""
        api = self.api
        assert api is not None
        rngs = self.api_rngs
        if self._track_seq:
            for r, dec in enumerate(decisions):
                if dec.notifications:
                    self._sent(de, r, dec.engine_id, dec.notifications[0].attempt)
        if api.fail_unposted and rngs["fail_unposted"].random() < api.fail_unposted:
            self._count("failed-unposted")
            if self._tracing:
                self._trace(de.name, "post_failed", req.key)
            failed = []
            for acc in de.accessors:
                failed.append(acc.access_failed(now, req.key, posted=False))
            for r, outs in enumerate(failed):
                for out in outs:
                    self._d_output(de, r, out)
            return False
        if api.notify and rngs["notify"].random() < api.notify:
            req.notes = [(r, dec.targets, dec.notifications) for r, dec in enumerate(decisions) if dec.notifications]
        if api.exact_end and not req.push and rngs["exact_end"].random() < api.exact_end:
            ends = [dec.valid_until for dec in decisions]
            if all(v is not None for v in ends):
                v = min(float(e) for e in ends if e is not None)
                clock = de.clock
                tr = clock.real(v)
                if req.xfer_start + self.sc.workload.transfer_base <= tr < _INF:
                    while clock.epoch + clock.rate * tr > v:  # the real instant whose reading is at most v
                        tr = math.nextafter(tr, -_INF)
                    req.xfer_end = tr
                    req.exact = v
                    req.due = _INF  # `_exact_done` finishes it, not the engine loop
                    self._count("exact-end")
                    self._at(tr, self._exact_done, (de, de.gen, req))
        return True

    def _exact_done(self, arg: tuple[DecodeEngine, int, Request]) -> None:
        """The transport reports the transfer done exactly at the accessor's valid_until."""
        de, gen, req = arg
        if not de.alive or de.gen != gen or req not in de.transfers or req.exact is None:
            return
        de.transfers.remove(req)
        clock = de.clock
        now = clock.local(self.now)
        if now < req.exact:
            now = LocalTime(req.exact)
        clock.floor = now
        if self._tracing:
            self._trace(de.name, "exact_end", f"{req.key} at valid_until {req.exact!r} (reading {float(now)!r})")
        self._transfer_done(de, now, req)
        self._poke(de, self.now)

    def _failed_after_notify(self, de: DecodeEngine, now: LocalTime, req: Request) -> None:
        """The transport reports the transfer failed after its attached notification landed:
        access_failed(posted=True). The engine retries only if the core keeps the lease."""
        self._count("failed-after-notify")
        if self._tracing:
            self._trace(de.name, "transfer_failed", f"{req.key} after its notification was delivered")
        failed = []
        for acc in de.accessors:
            failed.append(acc.access_failed(now, req.key, posted=True))
        for r, outs in enumerate(failed):
            for out in outs:
                self._d_output(de, r, out)
        api = self.api
        assert api is not None
        if not req.failed and all(acc.state_of(req.key) is TrackedState.WAITING for acc in de.accessors):
            self._count("retried-after-posted-failure")
            de.waiting.append(req)  # the core let it retry under the same lease
            return
        self._fail(de, req, "transfer failed after its notification landed")
        if api.retrack and self.api_rngs["retrack"].random() < api.retrack:
            why = "re-track after a posted transfer failed"
            self._track_copy(de, self._copy(req, de), "retrack-after-failed-transfer", why)

    def _copy(self, req: Request, de: DecodeEngine) -> Request:
        """Another request of decode engine `de` carrying `req`'s ticket (a fresh id: a key the
        engine never used)."""
        c = Request(1_000_000 + next(self._copies), self.now, req.prompt, req.out_tokens, req.blocks, req.push)
        c.attempt = 1
        c.key = f"r{c.id}.1"
        c.p, c.d, c.lease, c.ticket = req.p, de, req.lease, req.ticket
        c.copy = True
        return c

    def _track_copy(self, de: DecodeEngine, c: Request, kind: str, why: str) -> None:
        """Track `c` (a ticket tracked before) on every rank. Refused: the engine recomputes
        (a fresh lease). Accepted: it is served like any request, and the checks judge."""
        lease, ticket = c.lease, c.ticket
        if lease is None or ticket is None or not de.alive or not de.accessors:
            return
        lease.api = True
        now = de.clock.local(self.now)
        outs: list[tuple[Any, ...]] = []
        refused = ""
        for acc in de.accessors:
            try:
                outs.append(acc.track(now, c.key, ticket, push=c.push))
            except LocalProtocolError as exc:
                refused = str(exc) or type(exc).__name__
                break
        if self._tracing:
            self._trace(de.name, "retrack", f"{why}: {lease.name} as {c.key}: " + (refused or "accepted"))
        if refused:
            self._count(f"{kind}-refused")
            for r in range(len(outs)):  # the ranks that did track it let it go again
                for out in de.accessors[r].untrack(now, c.key):
                    self._d_output(de, r, out)
            self._recompute(c)  # a fresh lease: prefill again
            return
        self._count(f"{kind}-accepted")
        de.reqs[c.key] = c
        de.waiting.append(c)
        for r, rank_outs in enumerate(outs):
            for out in rank_outs:
                self._d_output(de, r, out)
        self._poke(de, self.now)

    def _retrack_later(self, arg: tuple[DecodeEngine, int, Request]) -> None:
        de, gen, req = arg
        if de.alive and de.gen == gen:
            self._track_copy(de, self._copy(req, de), "retrack-after-completion", "re-track after the read completed")

    def _abort(self, arg: tuple[DecodeEngine, int, Request]) -> None:
        """The engine aborts a waiting request (untrack: its Release goes out) and, while the
        Release is in flight, tracks the same ticket again under a new key."""
        de, gen, req = arg
        if (
            not de.alive
            or de.gen != gen
            or req.failed
            or de.reqs.get(req.key) is not req
            or req in de.transfers
            or req.key in de.running
            or not all(acc.state_of(req.key) is TrackedState.WAITING for acc in de.accessors)
        ):
            return
        now = de.clock.local(self.now)
        self._count("abort")
        if self._tracing:
            self._trace(de.name, "abort", req.key)
        released = []
        for acc in de.accessors:
            released.append(acc.untrack(now, req.key))
        req.failed = True
        de.reqs.pop(req.key, None)
        for r, outs in enumerate(released):
            for out in outs:
                self._d_output(de, r, out)
        self._track_copy(de, self._copy(req, de), "retrack-after-untrack", "re-track after untrack")

    def _redispatch(self, req: Request) -> None:
        """The router hands `req`'s ticket to a second request (a retry): on another decode
        engine mostly, else on the same one."""
        rng = self.api_rngs["redispatch"]
        others = sorted(name for name in self.d if req.d is None or name != req.d.name)
        de = self.d[rng.choice(others)] if others and rng.random() < 0.8 else req.d
        if de is None:
            return
        if req.ticket is not None and de.alive and de.accessors:
            self._track_copy(de, self._copy(req, de), "redispatch", "redispatch of a ticket still held")

    def _disconnect(self, de: DecodeEngine) -> None:
        """The engine gives up on one pinner engine (Accessor.disconnect on every rank); its
        later requests there reconnect. Answers to what it sent before must confer nothing."""
        api = self.api
        assert api is not None
        rng = self.api_rngs["disconnect"]
        self._at(self.now + rng.expovariate(api.disconnect), self._disconnect, de)
        p_name = rng.choice(sorted(self.p))
        if not de.alive or not de.accessors:
            return
        now = de.clock.local(self.now)
        self._count("disconnect")
        self._api_mark(de.name, p_name)  # its leases there are lost (or confirmations given up)
        if self._tracing:
            self._trace(de.name, "disconnect", p_name)
        outs = []
        for r, acc in enumerate(de.accessors):
            de.cut_seq[(r, p_name)] = de.sent_seq.get((r, p_name), 0)
            outs.append(acc.disconnect(now, p_name))
        lost: dict[str, Request] = {}
        for rank_outs in outs:
            for out in rank_outs:
                if isinstance(out, LeaseLost) and out.key in de.reqs:
                    lost[out.key] = de.reqs[out.key]
        for r, rank_outs in enumerate(outs):
            for out in rank_outs:
                self._d_output(de, r, out)
        if api.retrack:
            for req in lost.values():
                if self.api_rngs["retrack"].random() < api.retrack:
                    self._track_copy(de, self._copy(req, de), "retrack-after-disconnect", "re-track after disconnect")
