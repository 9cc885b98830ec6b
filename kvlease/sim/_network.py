"""The simulated network under `Cluster`: per-rank sends with loss, duplication and delay,
partitions between engines, frames that must confer nothing where they land (misdelivered or
stale: the "checked" path), and the handshake side channel.

Owns the order and number of the network's random draws (one stream, `net_rng`; misroutes
draw from their own), which the seeds' bit-identity depends on.
"""

from __future__ import annotations

import heapq
import math

from .._codec import decode, encode
from .._messages import Handshake
from ._kernel import _Kernel
from ._world import DecodeEngine, SimEngine

__all__: list[str] = []

_heappush = heapq.heappush
_log = math.log


class _Network(_Kernel):
    def _send(self, src: SimEngine, dst_name: str, rank: int | None, data: bytes, heartbeat: bool) -> None:
        dst = self.engines.get(dst_name)
        res = self.result
        if dst is None:
            return
        n = len(data)
        ranks = range(dst.tp) if rank is None else (rank,)
        net = self.sc.network
        rng = self.net_rng
        partitions = self.partitions
        src_name = src.name
        cut = bool(partitions) and (
            ((src_name, dst_name) if src_name < dst_name else (dst_name, src_name)) in partitions
        )
        loss, dup, jitter, base = net.loss, net.dup, net.jitter, net.base_delay
        now = self.now
        heap, seqs, deliver = self._heap, self._seqs, self._deliver
        # The random draws, and their order, are exactly those of one draw sequence per rank:
        # loss, then duplication, then one delay per copy.
        for r in ranks:
            res.messages += 1
            res.protocol_bytes += n
            if heartbeat:
                res.heartbeat_bytes += n
            if cut or (loss and rng.random() < loss):
                res.dropped += 1
                continue
            copies = 2 if dup and rng.random() < dup else 1
            for _ in range(copies):
                # `rng.expovariate(1.0 / jitter)`, inlined (same formula, same draw).
                delay = base + (min(-_log(1.0 - rng.random()) / (1.0 / jitter), net.cap) if jitter > 0 else 0.0)
                _heappush(heap, (now + delay, next(seqs), deliver, (dst, dst.gen, r, data, src_name)))

    def _deliver(self, arg: tuple[SimEngine, int, int, bytes, str]) -> None:
        dst, gen, rank, data, src = arg
        if not dst.alive or dst.gen != gen or (self.partitions and self._cut(src, dst.name)):
            self.result.dropped += 1
            return
        dst.inbox.append((rank, data))
        self._poke(dst, self.now)

    def _send_checked(
        self,
        src: SimEngine,
        dst: SimEngine,
        rank: int,
        data: bytes,
        why: str,
        heartbeat: bool,
        stream: str = "misroute",
    ) -> None:
        """`_send` of one frame to `rank` of `dst` that must confer nothing there (`why`); its
        draws come from the API fault `stream` that misdelivered it."""
        res = self.result
        net = self.sc.network
        rng = self.api_rngs[stream]
        res.messages += 1
        res.protocol_bytes += len(data)
        if heartbeat:
            res.heartbeat_bytes += len(data)
        if self._cut(src.name, dst.name) or (net.loss and rng.random() < net.loss):
            res.dropped += 1
            return
        delay = net.base_delay + (min(rng.expovariate(1.0 / net.jitter), net.cap) if net.jitter > 0 else 0.0)
        self._at(self.now + delay, self._deliver_checked, (dst, dst.gen, rank, data, src.name, why))

    def _deliver_checked(self, arg: tuple[SimEngine, int, int, bytes, str, str]) -> None:
        dst, gen, rank, data, src, why = arg
        if not dst.alive or dst.gen != gen or self._cut(src, dst.name):
            self.result.dropped += 1
            return
        dst.checked.append((rank, data, why))
        self._poke(dst, self.now)

    def _cut(self, a: str, b: str) -> bool:
        if not self.partitions:
            return False
        return ((a, b) if a < b else (b, a)) in self.partitions

    def _heal(self, pair: tuple[str, str]) -> None:
        if self._tracing:
            self._trace(pair[0], "heal", pair[1])
        self.partitions[pair] -= 1
        if not self.partitions[pair]:
            del self.partitions[pair]

    def _side_channel(self, de: DecodeEngine, rank: int, p_name: str, msg: Handshake) -> None:
        if self._track_seq:
            self._sent(de, rank, p_name, msg.seq)
        delay = self.sc.network.side_channel_delay
        self._at(self.now + delay, self._handshake_at_p, (de, de.gen, rank, p_name, encode(msg)))

    def _handshake_at_p(self, arg: tuple[DecodeEngine, int, int, str, bytes]) -> None:
        de, gen, rank, p_name, data = arg
        pe = self.p.get(p_name)
        if pe is None or not pe.alive or not pe.pinners or self._cut(de.name, p_name):
            return  # the accessor asks again after an interval
        msg = decode(data)
        assert isinstance(msg, Handshake)
        p_now = pe.clock.local(self.now)
        reply = pe.pinners[0].handshake_reply(p_now, msg)
        if self._tracing:
            self._trace(p_name, "handshake", f"from {de.name}.{rank} inc={reply.incarnation}")
        back = (de, gen, rank, encode(reply), p_name)
        self._at(self.now + self.sc.network.side_channel_delay, self._handshake_back, back)

    def _handshake_back(self, arg: tuple[DecodeEngine, int, int, bytes, str]) -> None:
        de, gen, rank, data, p_name = arg
        if not de.alive or de.gen != gen or self._cut(de.name, p_name):
            return
        rng = self.api_rngs["misroute"] if self._misroute else None
        if rng is not None and de.tp > 1 and rng.random() < self._misroute:
            to = rng.choice([r for r in range(de.tp) if r != rank])
            self._api_mark(de.name, p_name)
            self._count("misrouted-reply")
            de.checked.append((to, data, f"handshake reply of {p_name} for rank {rank} misrouted to rank {to}"))
        else:
            de.replies.append((rank, data))
        self._poke(de, self.now)

    def _sent(self, de: DecodeEngine, rank: int, p_name: str, seq: int) -> None:
        key = (rank, p_name)
        if seq > de.sent_seq.get(key, 0):
            de.sent_seq[key] = seq
