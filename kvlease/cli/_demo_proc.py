"""The bodies of the demo's two OS processes: the pinner (P) and the accessor (D).

Run as ``python -m kvlease.cli._demo_proc ROLE SPEC_JSON``. Each process is a thin driver: it
reads its own monotonic clock shifted by a random epoch (so clocks of P and D disagree by
hours, as unrelated hosts' monotonic clocks do), feeds the core, dispatches its outputs over a
link (`_demo_link`), and re-arms one timer. The scenario script (when to read, when the
partition starts) is the only extra logic. Every lease transition is reported to the parent as
one JSON line on stdout, stamped with the *raw* system-wide monotonic clock, which the parent
uses only to measure, never to decide.

Protocol logic here would be a bug: the core decides what is valid, what to free and when.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from kvlease import (
    AccessCompleted,
    Accessor,
    AccessStale,
    DecodeError,
    EndReason,
    Free,
    Handshake,
    HandshakeNeeded,
    Heartbeat,
    HeartbeatAck,
    LeaseConfig,
    LeaseKind,
    LeaseLost,
    LeaseTicket,
    LocalTime,
    Pinner,
    Rejected,
    Send,
    decode,
    encode,
)

from ..transports._stats import TransportStats  # type: ignore[import-not-found,unused-ignore]
from ._demo_link import Frame

log = logging.getLogger("kvlease.demo")

_FREE_COUNTER = {
    EndReason.ACCESS_DONE: "leases_completed",
    EndReason.RELEASED: "leases_released",
    EndReason.EXPIRED: "leases_expired",
}

#: A block that a later request reused: what a late READ of a freed block would return.
REUSED = 0xEE


def block_pattern(seed: int, block: int, size: int) -> bytes:
    """The KV content request `seed` writes into `block` (distinct per request and block)."""
    b = (seed * 131 + block * 7 + 1) % 251
    return bytes([b]) * size


class Reporter:
    def __init__(self) -> None:
        self._out = sys.stdout

    def __call__(self, ev: str, **fields: Any) -> None:
        fields["ev"] = ev
        fields["t"] = time.monotonic()
        self._out.write(json.dumps(fields) + "\n")
        self._out.flush()


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process if the demo (its parent) dies, so no child outlives it."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Node:
    """What both drivers share: the clock, the stats counters, the loop."""

    def __init__(self, spec: dict[str, Any], report: Reporter) -> None:
        self.spec = spec
        self.report = report
        self.epoch = float(spec["epoch"])
        self.config = LeaseConfig(**spec["config"])
        self.done = False
        self.stats = TransportStats()
        self.partition_drops = 0
        self._next_stats = 0.0

    def now(self) -> LocalTime:
        return LocalTime(time.monotonic() + self.epoch)

    def count(self, name: str, by: int = 1) -> None:
        setattr(self.stats, name, getattr(self.stats, name) + by)

    def report_stats(self) -> None:
        snap = self.stats.snapshot()
        for k in [k for k in snap if k.startswith("heartbeat_rtt")]:
            del snap[k]
        self.report("stats", role=self.spec["role"], stats=snap, partition_drops=self.partition_drops)

    def step(self, now: LocalTime) -> float | None:  # pragma: no cover - overridden
        raise NotImplementedError

    def run(self, link: Any) -> None:
        tick = float(self.spec["tick"])
        while not self.done:
            now = self.now()
            for frame in link.recv():
                self.on_frame(self.now(), frame)
            wake = self.step(self.now())
            now = self.now()
            if now >= self._next_stats:
                self._next_stats = now + 0.1
                self.report_stats()
            timeout = tick if wake is None else min(max(wake - now, 0.0), tick)
            link.wait(timeout)
        self.report_stats()

    def on_frame(self, now: LocalTime, frame: Frame) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


class PinnerNode(Node):
    def __init__(self, spec: dict[str, Any], report: Reporter, link: Any) -> None:
        super().__init__(spec, report)
        self.link = link
        self.pinner = Pinner(self.config, "prefill-0", random.getrandbits(64))
        self.block_size = int(spec["block_size"])
        self.blocks_per = int(spec["blocks_per_request"])
        self.free_blocks = list(range(int(spec["pool_blocks"])))
        self.owned: dict[str, list[int]] = {}
        self.granted = False
        self.accessor_left = False
        self.last_heard = float("-inf")

    def on_frame(self, now: LocalTime, frame: Frame) -> None:
        kind, payload = frame
        self.last_heard = now
        if kind == "msg":
            try:
                msg = decode(payload)
            except DecodeError as exc:
                self.count("malformed_messages")
                log.warning("malformed message from accessor: %s", exc)
                return
            if isinstance(msg, Handshake):
                self.count("handshakes_answered")
            if isinstance(msg, Heartbeat):
                self.count("heartbeats_received")
                self.report("heartbeat", ids=len(msg.lease_ids))
            self.dispatch(self.pinner.receive(now, msg))
        elif kind == "ctl" and payload.get("hello") and not self.granted:
            self.granted = True
            self.grant_all(now)
        elif kind == "ctl" and payload.get("bye"):
            self.accessor_left = True
        elif kind == "read":
            self.link.serve_read(payload["key"], payload["blocks"])

    def grant_all(self, now: LocalTime) -> None:
        fixed = self.spec["scenario"] == "bidirectional"
        for i in range(int(self.spec["requests"])):
            key = f"req-{i}"
            blocks = sorted(self.free_blocks.pop() for _ in range(self.blocks_per))
            seed = random.getrandbits(16)
            for b in blocks:  # the prefill writes this request's KV
                self.link.pool_write(b, block_pattern(seed, b, self.block_size))
            if fixed:
                ticket = self.pinner.grant(now, key, kind=LeaseKind.FIXED_TTL, ttl=self.config.kv_lease_duration)
            else:
                ticket = self.pinner.grant(now, key)
            self.owned[key] = blocks
            self.count("leases_granted")
            self.count("bytes_pinned", len(blocks) * self.block_size)
            info = self.pinner.info(ticket.lease_id)
            assert info is not None
            expiry_real = info.expiry - self.epoch
            log.debug("lease granted key=%s lease_id=%d expiry=%.3f", key, ticket.lease_id, info.expiry)
            self.report("grant", key=key, lease_id=ticket.lease_id, blocks=len(blocks), expiry_real=expiry_real)
            self.link.send_ctl({"key": key, "ticket": ticket.to_dict(), "blocks": blocks, "seed": seed})

    def dispatch(self, outputs: tuple[Any, ...]) -> None:
        for out in outputs:
            match out:
                case Send():
                    data = encode(out.message)
                    if isinstance(out.message, HeartbeatAck):
                        m = out.message
                        self.count("leases_renewed", m.renewed)
                        self.count(
                            "heartbeats_rejected", len(m.unknown) + len(m.expired) + len(m.released) + len(m.completed)
                        )
                    self.link.send_msg(data)
                case Free():
                    blocks = self.owned.pop(out.key)
                    # Another request's prefill takes the blocks at once: a late READ of them
                    # now returns someone else's KV.
                    for b in blocks:
                        self.link.pool_write(b, bytes([REUSED]) * self.block_size)
                    self.free_blocks.extend(blocks)
                    self.count("bytes_pinned", -len(blocks) * self.block_size)
                    self.count(_FREE_COUNTER[out.reason])
                    level = logging.WARNING if out.reason.value == "expired" else logging.DEBUG
                    log.log(level, "lease freed key=%s lease_id=%d reason=%s", out.key, out.lease_id, out.reason.value)
                    self.report("free", key=out.key, lease_id=out.lease_id, reason=out.reason.value, blocks=len(blocks))
                case Rejected():
                    self.count("rejected_messages")
                    log.warning("rejected message from %s: %s", out.engine_id, out.reason)
                    self.report("rejected", reason=out.reason)
                case _:
                    raise AssertionError(f"unexpected pinner output {out!r}")

    def step(self, now: LocalTime) -> float | None:
        self.dispatch(self.pinner.handle_timeout(now))
        if self.granted and not self.owned:
            # Every lease ended. Keep serving until the accessor says it is done (its late
            # reads still hit the reused blocks, as RDMA would), or, in the crash scenario,
            # once it has been silent for a while.
            quiet = now - self.last_heard > 2 * self.config.heartbeat_interval + 1.0
            if self.accessor_left or (quiet and self.spec["scenario"] == "crash"):
                self.done = True
        nd = self.pinner.next_deadline()
        return None if nd is None else nd


class AccessorNode(Node):
    def __init__(self, spec: dict[str, Any], report: Reporter, link: Any) -> None:
        super().__init__(spec, report)
        self.link = link
        self.accessor = Accessor(self.config, "decode-0")
        self.block_size = int(spec["block_size"])
        self.requests: dict[str, dict[str, Any]] = {}  # key -> {blocks, seed, read_at, state}
        self.read_starts: dict[str, float] = {}
        self.resolved = 0
        self.partitioned = False
        self.t0: float | None = None
        self.hb_sent: dict[int, float] = {}  # seq -> local send time, for the RTT figure

    # The scenario script: when each request's READ is attempted, relative to its arrival.
    def read_delay(self, i: int) -> float:
        sc, cfg = self.spec["scenario"], self.config
        if sc == "happy":
            return 0.05 + 0.01 * i
        if sc == "overload":
            return float(self.spec["queue_time"]) + 0.01 * i
        if sc == "crash":
            return 1e9  # killed before it reads
        if sc == "partition":
            return float(self.spec["partition_end"]) + 0.1 + 0.01 * i
        if sc == "bidirectional":
            early = i % 2 == 0
            return cfg.kv_lease_duration * 0.3 + 0.01 * i if early else cfg.kv_lease_duration + 0.3 + 0.01 * i
        raise ValueError(sc)

    def send(self, data: bytes) -> None:
        if self.partitioned:
            self.partition_drops += 1
            return
        self.link.send_msg(data)

    def on_frame(self, now: LocalTime, frame: Frame) -> None:
        kind, payload = frame
        if kind == "msg":
            if self.partitioned:
                self.partition_drops += 1
                return
            try:
                msg = decode(payload)
            except DecodeError as exc:
                self.count("malformed_messages")
                log.warning("malformed message from pinner: %s", exc)
                return
            if isinstance(msg, HeartbeatAck):
                self.count("heartbeat_acks_received")
                sent = self.hb_sent.pop(msg.seq, None)
                if sent is not None:
                    self.report("rtt", seconds=now - sent)
            self.dispatch(now, self.accessor.receive(now, msg))
        elif kind == "ctl" and "ticket" in payload:
            key = payload["key"]
            ticket = LeaseTicket.from_dict(payload["ticket"])
            i = len(self.requests)
            self.requests[key] = {
                "blocks": payload["blocks"],
                "seed": payload["seed"],
                "read_at": now + self.read_delay(i),
                "state": "waiting",
                "ticket": ticket,
            }
            if self.t0 is None:
                self.t0 = now
            self.report("track", key=key, lease_id=ticket.lease_id)
            log.debug("lease tracked key=%s lease_id=%d", key, ticket.lease_id)
            self.dispatch(now, self.accessor.track(now, key, ticket))
        elif kind == "data":
            key, data = payload
            self.count("transfers_ok")
            self.count("bytes_transferred", len(data))
            self.finish_read(now, key, data)

    def finish_read(self, now: LocalTime, key: str, data: bytes) -> None:
        req = self.requests[key]
        expect = b"".join(block_pattern(req["seed"], b, self.block_size) for b in req["blocks"])
        content_ok = data == expect
        req["content_ok"] = content_ok
        if req["state"] == "baseline_read":
            # The read vLLM would have done without a lease check: is the KV still ours?
            req["state"] = "resolved"
            self.report("baseline_read", key=key, content_ok=content_ok)
            self.resolve(key)
            return
        self.dispatch(now, self.accessor.access_finished(now, key))

    def dispatch(self, now: LocalTime, outputs: tuple[Any, ...]) -> None:
        for out in outputs:
            match out:
                case Send():
                    if isinstance(out.message, Heartbeat):
                        self.count("heartbeats_sent")
                        if not self.partitioned:
                            self.hb_sent[out.message.seq] = now
                    self.send(encode(out.message))
                case HandshakeNeeded():
                    # The demo's side channel is the link itself: the pinner answers a
                    # Handshake message with its HandshakeReply.
                    self.count("handshakes_sent")
                    self.send(encode(out.message))
                case AccessCompleted():
                    req = self.requests[out.key]
                    ok = bool(req.get("content_ok"))
                    if not ok:
                        log.warning("SAFETY: access of %s reported valid but its KV was overwritten", out.key)
                    log.debug("access completed key=%s confirmed=%s", out.key, out.confirmed_by_pinner)
                    req["state"] = "resolved"
                    self.count("accesses_completed")
                    self.report(
                        "read",
                        key=out.key,
                        verdict="valid",
                        content_ok=ok,
                        started=self.read_starts.get(out.key),
                        confirmed=out.confirmed_by_pinner,
                    )
                    self.resolve(out.key)
                case AccessStale():
                    req = self.requests[out.key]
                    self.count("stale_reads_caught")
                    log.warning("stale access caught key=%s: %s", out.key, out.reason)
                    req["state"] = "resolved"
                    self.report(
                        "read", key=out.key, verdict="stale", content_ok=bool(req.get("content_ok")), reason=out.reason
                    )
                    self.resolve(out.key)
                case LeaseLost():
                    req = self.requests[out.key]
                    self.count("leases_lost")
                    log.warning("lease lost key=%s lease_id=%d reason=%s", out.key, out.lease_id, out.reason.value)
                    self.report("lost", key=out.key, reason=out.reason.value, state=req["state"])
                    if req["state"] == "waiting":
                        req["state"] = "lost"  # its read will be refused when it comes due
                case Rejected():
                    self.count("rejected_messages")
                    log.warning("rejected message from %s: %s", out.engine_id, out.reason)
                case _:
                    raise AssertionError(f"unexpected accessor output {out!r}")

    def resolve(self, key: str) -> None:
        self.resolved += 1
        if self.resolved >= int(self.spec["requests"]):
            self.link.send_ctl({"bye": True})
            self.done = True

    def step(self, now: LocalTime) -> float | None:
        if self.t0 is None:
            return None
        sc = self.spec["scenario"]
        if sc == "partition":
            start = self.t0 + float(self.spec["partition_start"])
            end = self.t0 + float(self.spec["partition_end"])
            if not self.partitioned and start <= now < end:
                self.partitioned = True
                log.warning("partition: heartbeats stop reaching the pinner")
                self.report("partition", on=True)
            elif self.partitioned and now >= end:
                self.partitioned = False
                self.report("partition", on=False)
        self.dispatch(now, self.accessor.handle_timeout(now))
        wake: float | None = None
        for key, req in self.requests.items():
            if req["state"] in ("waiting", "lost") and now >= req["read_at"]:
                self.attempt_read(now, key, req)
            elif req["state"] in ("waiting", "lost"):
                wake = req["read_at"] if wake is None else min(wake, req["read_at"])
        # Record what the accessor believes while nothing is in flight (safety is checked
        # against the pinner's free times by the parent).
        for key, req in self.requests.items():
            vu = self.accessor.valid_until(key)
            if vu is not None and vu - self.epoch > req.get("valid_until_real", float("-inf")):
                req["valid_until_real"] = vu - self.epoch
                self.report("valid_until", key=key, real=vu - self.epoch)
        nd = self.accessor.next_deadline()
        if nd is not None:
            wake = nd if wake is None else min(wake, nd)
        if sc == "partition":
            wake = min(wake or now + 1.0, self.t0 + float(self.spec["partition_end"]))
        return wake

    def attempt_read(self, now: LocalTime, key: str, req: dict[str, Any]) -> None:
        decision = self.accessor.begin_access(now, key)
        if decision.allowed:
            req["state"] = "reading"
            self.read_starts[key] = time.monotonic()
            self.report("read_start", key=key, guaranteed=decision.guaranteed)
            self.link.start_read(key, req["blocks"])
            return
        # Refused: the lease is gone or cannot be proven live, so the engine would recompute.
        self.count("stale_reads_caught")
        self.report("read", key=key, verdict="refused", content_ok=None, reason=decision.reason)
        log.warning("read refused key=%s: %s", key, decision.reason)
        if self.spec["scenario"] == "partition":
            # Show the baseline: the same READ without the lease check.
            req["state"] = "baseline_read"
            self.link.start_read(key, req["blocks"])
        else:
            req["state"] = "resolved"
            self.resolve(key)


def main(argv: list[str]) -> int:
    role, spec = argv[0], json.loads(argv[1])
    _die_with_parent()
    logging.basicConfig(
        level=spec.get("log_level", "WARNING"),
        stream=sys.stderr,
        format=f"%(asctime)s {role[0].upper()} %(levelname)s %(name)s: %(message)s",
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    report = Reporter()
    link: Any
    transport = spec["transport"]
    make_link: Callable[..., Any]
    if transport == "zmq":
        from ._demo_link import ZmqLink

        make_link = ZmqLink
    else:
        from ._demo_nixl import NixlLink

        make_link = NixlLink
    link_args = {
        "block_size": spec["block_size"],
        "blocks": spec["pool_blocks"],
        "blocks_per_request": spec["blocks_per_request"],
        "epoch": spec["epoch"],
    }
    try:
        if role == "pinner":
            link = make_link(bind=True, **link_args)
            report("ready", endpoint=link.endpoint, pid=os.getpid())
            node: Node = PinnerNode(spec, report, link)
        else:
            link = make_link(bind=False, endpoint=spec["endpoint"], **link_args)
            report("ready", pid=os.getpid())
            node = AccessorNode(spec, report, link)
            link.send_ctl({"hello": True})
        node.run(link)
        report("exit")
        link.close()
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
