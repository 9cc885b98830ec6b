"""The bodies of the demo's two OS processes: the pinner (P) and the accessor (D).

Run as ``python -m kvlease.cli._demo_proc SPEC_JSON`` (a `ChildSpec`: role, scenario, lease,
pool). Each process is an engine worker in miniature, on the child-process harness
(`kvlease.cli._child`: its worker loop, event lines and transport factory): a
`kvlease.transports.Driver` over a real transport (`ZmqTransport` by default, `NixlTransport`
with ``--transport nixl``: registered tensors, real NIXL READs) stepped from a loop as an
engine's forward loop would, so the demo runs exactly the code an engine would. The
driver's clock is the process's monotonic clock shifted by a random epoch (so P's and D's
clocks disagree by hours, as unrelated hosts' monotonic clocks do).

The parent plays the router: it tells P when to grant (``{"op": "grant"}`` on stdin, once D is
connected), forwards each lease ticket to D (``{"op": "track", ...}``: what vLLM carries in
``kv_transfer_params``) and tells P when D is gone (``{"op": "bye"}``). Every lease transition
is reported to the parent as one JSON line on stdout, stamped with the *raw* system-wide
monotonic clock, which the parent uses only to measure, never to decide.

Beyond the driver, this module holds only the engine's memory (a pool of request slots that a
freed slot is at once reused from) and plays the scenario object's script (`Scenario`: when D
reads, the partition window, fixed-TTL grants). The partition is simulated in D by
`PartitionedTransport`, a forwarding wrapper that drops control frames both ways; it also
carries the partition scenario's *baseline* read (the same READ without the lease check) past
the driver. Protocol logic here would be a bug: the core decides
what is valid, what to free and when.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import sys
import time
from typing import Any

from kvlease import (
    AccessCompleted,
    Accessor,
    AccessStale,
    Free,
    LeaseKind,
    LeaseLost,
    LeaseTicket,
    Pinner,
    Rejected,
)

from ..transports import (
    Driver,
    Inbound,
    PeerDead,
    PeerSuspect,
    TransferFailed,
    TransferResult,
    Transport,
    new_session,
)
from ._child import Commands, emit, make_transport, serve
from ._demo_scenarios import SCENARIOS, ChildSpec

log = logging.getLogger("kvlease.demo")

PINNER, ACCESSOR = "prefill-0", "decode-0"

#: A block that a later request reused: what a late READ of a freed block would return.
REUSED = 0xEE

#: After D's last verdict it keeps stepping this long so its last access-done reaches P.
_LINGER = 0.3


def block_pattern(seed: int, block: int, size: int) -> bytes:
    """The KV content request `seed` writes into `block` (distinct per request and block)."""
    b = (seed * 131 + block * 7 + 1) % 251
    return bytes([b]) * size


def slot_pattern(seed: int, slot: int, blocks_per: int, block_size: int) -> bytes:
    return b"".join(block_pattern(seed, slot * blocks_per + j, block_size) for j in range(blocks_per))


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process if the demo (its parent) dies, so no child outlives it."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


# -- memory -----------------------------------------------------------------------------------


class Pool:
    """The engine's KV memory: one buffer per request slot (bytearrays for ZMQ, torch tensors
    for NIXL), registered once as regions ``slot-N``, reused across requests."""

    def __init__(self, transport: str, slots: int, slot_bytes: int) -> None:
        self.torch = transport == "nixl"
        self.slot_bytes = slot_bytes
        self.slots = [self.new(0) for _ in range(slots)]

    def new(self, fill: int) -> Any:
        if self.torch:
            import torch

            return torch.full((self.slot_bytes,), fill, dtype=torch.uint8)
        return bytearray([fill]) * self.slot_bytes

    def fill(self, slot: int, data: bytes) -> None:
        self.put(self.slots[slot], data)

    def put(self, buf: Any, data: bytes) -> None:
        if self.torch:
            import torch

            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        else:
            buf[:] = data

    def contents(self, buf: Any) -> bytes:
        return bytes(buf.numpy().tobytes()) if self.torch else bytes(buf)


class Forwarding:
    """A transport wrapper that forwards every attribute it does not define to `inner`: a
    subclass overrides only what it changes, and whatever the `Transport` protocol gains later
    passes through untouched."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class PartitionedTransport(Forwarding):
    """A `Transport` wrapper for the partition scenario: while `partitioned`, control frames
    are dropped in both directions (as a cut link would lose them), silently. It also lets the
    demo start a *baseline* READ that bypasses the driver (no lease check, no notification):
    its completion is kept here instead of reaching the driver. Everything else passes through.
    """

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self.partitioned = False
        self.dropped = 0
        self._raw: set[int] = set()
        self.raw_done: list[TransferResult] = []

    def send(self, engine_id: str, rank: int | None, data: bytes) -> None:
        if self.partitioned:
            self.dropped += 1
            return
        self.inner.send(engine_id, rank, data)

    def receive(self) -> list[Inbound]:
        frames = list(self.inner.receive())
        if self.partitioned and frames:
            self.dropped += len(frames)
            return []
        return frames

    def start_baseline_read(self, engine_id: str, region: str, into: object) -> int:
        h = int(self.inner.start_read(engine_id, 0, region, into, None))
        self._raw.add(h)
        return h

    def poll_transfers(self) -> list[TransferResult]:
        out = []
        for res in self.inner.poll_transfers():
            if res.handle in self._raw:
                self._raw.discard(res.handle)
                self.raw_done.append(res)
            else:
                out.append(res)
        return out


# -- the processes ----------------------------------------------------------------------------


class Node:
    """What both processes share: the driver, the parent's commands, the loop."""

    def __init__(self, spec: ChildSpec) -> None:
        self.spec = spec
        self.report = emit
        self.scenario = SCENARIOS[spec.scenario]
        self.epoch = spec.epoch
        self.config = spec.config
        self.tick = spec.tick
        self.block_size = spec.block_size
        self.blocks_per = spec.blocks_per_request
        self.slot_bytes = self.block_size * self.blocks_per
        self.done = False
        self._linger_until: float | None = None
        self._next_stats = 0.0
        #: The loop's worst stalls: the longest driver step (a transport call that blocks) and
        #: the longest oversleep past the wake it asked for (a starved process). Reported with
        #: the stats, so a late free can be told apart from a wrong expiry.
        self.longest_step = 0.0
        self.longest_oversleep = 0.0
        self._wake_at: float | None = None
        #: This iteration: when it began and how late (past the wake it asked for).
        self._began = 0.0
        self._overslept = 0.0
        self.driver: Driver

    def clock(self) -> float:
        return time.monotonic() + self.epoch

    def loop_late(self) -> float:
        """How late this iteration of the loop is running: its oversleep past the wake it asked
        for plus the step so far. An event the core decided on time reaches the engine this
        much later on a starved machine; a core that decided late shows no such delay."""
        return round(self._overslept + (time.monotonic() - self._began), 4)

    def report_stats(self, extra: dict[str, Any] | None = None) -> None:
        snap = self.driver.stats.snapshot()
        for k in [k for k in snap if k.startswith("heartbeat_rtt")]:
            del snap[k]
        loop = {"longest_step_s": round(self.longest_step, 4), "longest_oversleep_s": round(self.longest_oversleep, 4)}
        self.report("stats", role=self.spec.role, stats=snap, loop=loop, **(extra or {}))

    def command(self, cmd: dict[str, Any]) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def run_command(self, cmd: dict[str, Any]) -> bool:
        self.command(cmd)
        return True

    def on_event(self, ev: Any) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def after_step(self, now: float) -> float | None:
        """Scenario work after the driver's step; returns when to wake for it (or None)."""
        return None

    def stats_extra(self) -> dict[str, Any]:
        return {}

    def run(self) -> None:
        """The harness's worker loop; after the scenario is done (or the parent is gone), keep
        stepping a moment, so what the last step sent (an access-done riding on the last READ)
        leaves before the sockets close."""
        commands = Commands()

        def step() -> bool:
            if commands.parent_gone:
                self.done = True
                self._linger_until = 0.0
            began = self._began = time.monotonic()
            self._overslept = max(0.0, began - self._wake_at) if self._wake_at is not None else 0.0
            self.longest_oversleep = max(self.longest_oversleep, self._overslept)
            for ev in self.driver.step():
                self.on_event(ev)
            self.longest_step = max(self.longest_step, time.monotonic() - began)
            wake = self.after_step(self.driver.now())
            if time.monotonic() >= self._next_stats:
                self._next_stats = time.monotonic() + 0.1
                self.report_stats(self.stats_extra())
            if self.done:
                if self._linger_until is None:
                    self._linger_until = time.monotonic() + _LINGER
                if time.monotonic() >= self._linger_until:
                    return False
            timeout = self.tick
            for d in (wake, self.driver.next_deadline()):
                if d is not None:
                    timeout = min(timeout, max(d - self.driver.now(), 0.0))
            self._wake_at = time.monotonic() + timeout
            self.driver.transport.wait(timeout)
            return True

        serve(commands, self.run_command, step, until_parent_gone=False)
        self.report_stats(self.stats_extra())


class PinnerNode(Node):
    def __init__(self, spec: ChildSpec) -> None:
        super().__init__(spec)
        transport = make_transport(spec.transport, PINNER)
        self.driver = Driver(transport, pinner=Pinner(self.config, PINNER, random.getrandbits(63)), clock=self.clock)
        self.pool = Pool(spec.transport, spec.requests, self.slot_bytes)
        for slot, buf in enumerate(self.pool.slots):
            transport.register(f"slot-{slot}", buf)
        self.free_slots = list(range(spec.requests))
        self.owned: dict[str, int] = {}  # key -> slot
        self.granted = False
        self.accessor_left = False
        self._hb_seen = 0

    def command(self, cmd: dict[str, Any]) -> None:
        if cmd.get("op") == "grant" and not self.granted:
            self.granted = True
            self.grant_all()
        elif cmd.get("op") == "bye":
            self.accessor_left = True

    def grant_all(self) -> None:
        fixed = self.scenario.fixed_ttl
        pinner = self.driver.pinner
        assert pinner is not None
        for i in range(self.spec.requests):
            key = f"req-{i}"
            slot = self.free_slots.pop()
            seed = random.getrandbits(16)
            # The prefill writes this request's KV into the slot.
            self.pool.fill(slot, slot_pattern(seed, slot, self.blocks_per, self.block_size))
            if fixed:
                ticket = self.driver.grant(
                    key, nbytes=self.slot_bytes, kind=LeaseKind.FIXED_TTL, ttl=self.config.kv_lease_duration
                )
            else:
                ticket = self.driver.grant(key, nbytes=self.slot_bytes)
            self.owned[key] = slot
            info = pinner.info(ticket.lease_id)
            assert info is not None
            log.debug("lease granted key=%s lease_id=%d expiry=%.3f", key, ticket.lease_id, info.expiry)
            self.report(
                "grant",
                key=key,
                lease_id=ticket.lease_id,
                blocks=self.blocks_per,
                expiry_real=info.expiry - self.epoch,
                ticket=ticket.to_dict(),
                slot=slot,
                seed=seed,
                address=self.driver.transport.address,
            )

    def on_event(self, ev: Any) -> None:
        match ev:
            case Free():
                slot = self.owned.pop(ev.key)
                # Another request's prefill takes the slot at once: a late READ of it now
                # returns someone else's KV.
                self.pool.fill(slot, bytes([REUSED]) * self.slot_bytes)
                self.free_slots.append(slot)
                level = logging.WARNING if ev.reason.value == "expired" else logging.DEBUG
                log.log(level, "lease freed key=%s lease_id=%d reason=%s", ev.key, ev.lease_id, ev.reason.value)
                self.report(
                    "free",
                    key=ev.key,
                    lease_id=ev.lease_id,
                    reason=ev.reason.value,
                    blocks=self.blocks_per,
                    loop_late=self.loop_late(),
                )
            case Rejected():
                log.warning("rejected message from %s: %s", ev.engine_id, ev.reason)
                self.report("rejected", reason=ev.reason)
            case _:
                log.debug("driver event %r", ev)

    def after_step(self, now: float) -> float | None:
        n = self.driver.stats.heartbeats_received
        for _ in range(n - self._hb_seen):
            self.report("heartbeat")
        self._hb_seen = n
        # Every lease ended and D is gone (its late reads, if any, hit the reused slots).
        if self.granted and not self.owned and self.accessor_left:
            self.done = True
        return None


class AccessorNode(Node):
    def __init__(self, spec: ChildSpec) -> None:
        super().__init__(spec)
        self.wire = PartitionedTransport(make_transport(spec.transport, ACCESSOR))
        # The engine TTL only tears a silent peer down (a hint); keep it past the partition,
        # so this scenario shows the lease expiring, not the peer being forgotten.
        self.driver = Driver(
            self.wire,
            accessor=Accessor(self.config, ACCESSOR, session=new_session()),
            clock=self.clock,
            engine_ttl=4 * self.config.kv_lease_duration + spec.timing.partition_end,
        )
        self.pool = Pool(spec.transport, 0, self.slot_bytes)
        self.requests: dict[str, dict[str, Any]] = {}
        self.resolved = 0
        self.t0: float | None = None
        self.connected = False
        self._rtt_seen = 0
        self._baseline: dict[int, str] = {}  # baseline READ handle -> key
        self.driver.connect(PINNER, spec.endpoint)

    def stats_extra(self) -> dict[str, Any]:
        return {"partition_drops": self.wire.dropped}

    def command(self, cmd: dict[str, Any]) -> None:
        if cmd.get("op") != "track":
            return
        key = cmd["key"]
        ticket = LeaseTicket.from_dict(cmd["ticket"])
        now = self.driver.now()
        if self.t0 is None:
            self.t0 = now
        self.requests[key] = {
            "slot": cmd["slot"],
            "seed": cmd["seed"],
            "read_at": now + self.scenario.read_delay(len(self.requests), self.config, self.spec.timing),
            "state": "waiting",
        }
        self.report("track", key=key, lease_id=ticket.lease_id)
        self.driver.track(key, ticket, address=cmd.get("address"))

    def content_ok(self, key: str) -> bool:
        req = self.requests[key]
        buf = req.get("buf")
        expect = slot_pattern(req["seed"], req["slot"], self.blocks_per, self.block_size)
        return buf is not None and self.pool.contents(buf) == expect

    def on_event(self, ev: Any) -> None:
        match ev:
            case AccessCompleted():
                req = self.requests[ev.key]
                ok = self.content_ok(ev.key)
                if not ok:
                    log.warning("SAFETY: access of %s reported valid but its KV was overwritten", ev.key)
                req["state"] = "resolved"
                self.report(
                    "read",
                    key=ev.key,
                    verdict="valid",
                    content_ok=ok,
                    started=req.get("started"),
                    confirmed=ev.confirmed_by_pinner,
                )
                self.resolve(ev.key)
            case AccessStale():
                req = self.requests[ev.key]
                log.warning("stale access caught key=%s: %s", ev.key, ev.reason)
                req["state"] = "resolved"
                self.report("read", key=ev.key, verdict="stale", content_ok=self.content_ok(ev.key), reason=ev.reason)
                self.resolve(ev.key)
            case LeaseLost():
                req = self.requests[ev.key]
                log.warning("lease lost key=%s lease_id=%d reason=%s", ev.key, ev.lease_id, ev.reason.value)
                self.report("lost", key=ev.key, reason=ev.reason.value, state=req["state"])
                if req["state"] == "waiting":
                    req["state"] = "lost"  # its read will be refused when it comes due
            case TransferFailed():
                # The READ itself failed (not a lease verdict): the engine would recompute.
                req = self.requests[ev.key]
                log.warning("read failed key=%s: %s", ev.key, ev.reason)
                self.driver.untrack(ev.key)
                req["state"] = "resolved"
                self.report("read", key=ev.key, verdict="failed", content_ok=None, reason=ev.reason)
                self.resolve(ev.key)
            case Rejected() | PeerSuspect() | PeerDead():
                log.warning("driver event %r", ev)
            case _:
                log.debug("driver event %r", ev)

    def resolve(self, key: str) -> None:
        self.resolved += 1
        if self.resolved >= self.spec.requests:
            self.done = True

    def after_step(self, now: float) -> float | None:
        accessor = self.driver.accessor
        assert accessor is not None
        if not self.connected and accessor.is_connected(PINNER):
            self.connected = True
            self.report("connected")
        samples = self.driver.stats.rtt_samples
        for s in list(samples)[self._rtt_seen :]:
            self.report("rtt", seconds=s)
        self._rtt_seen = len(samples)
        for res in self.wire.raw_done:
            key = self._baseline.pop(res.handle)
            ok = res.ok and self.content_ok(key)
            self.requests[key]["state"] = "resolved"
            self.report("baseline_read", key=key, content_ok=ok)
            self.resolve(key)
        self.wire.raw_done.clear()
        if self.t0 is None:
            return None
        wake: float | None = None
        window = self.scenario.partition(self.spec.timing)
        if window is not None:
            start, end = self.t0 + window[0], self.t0 + window[1]
            if not self.wire.partitioned and start <= now < end:
                self.wire.partitioned = True
                log.warning("partition: control frames between D and P are dropped")
                self.report("partition", on=True)
            elif self.wire.partitioned and now >= end:
                self.wire.partitioned = False
                self.report("partition", on=False)
            wake = start if now < start else end if now < end else None
        for key, req in self.requests.items():
            if req["state"] in ("waiting", "lost"):
                if now >= req["read_at"]:
                    self.attempt_read(key, req)
                else:
                    wake = req["read_at"] if wake is None else min(wake, req["read_at"])
        # Record what the accessor believes (safety is checked against the pinner's free
        # times by the parent).
        for key, req in self.requests.items():
            vu = accessor.valid_until(key)
            if vu is not None and vu - self.epoch > req.get("valid_until_real", float("-inf")):
                req["valid_until_real"] = vu - self.epoch
                self.report("valid_until", key=key, real=vu - self.epoch)
        return wake

    def attempt_read(self, key: str, req: dict[str, Any]) -> None:
        req["buf"] = self.pool.new(0)
        decision = self.driver.read(key, f"slot-{req['slot']}", req["buf"])
        if decision.allowed:
            req["state"] = "reading"
            req["started"] = time.monotonic()
            self.report("read_start", key=key, guaranteed=decision.guaranteed)
            return
        # Refused: the lease is gone or cannot be proven live, so the engine would recompute.
        self.report("read", key=key, verdict="refused", content_ok=None, reason=decision.reason)
        log.warning("read refused key=%s: %s", key, decision.reason)
        if self.scenario.baseline_read_when_refused:
            # Show the baseline: the same READ without the lease check.
            req["state"] = "baseline_read"
            h = self.wire.start_baseline_read(PINNER, f"slot-{req['slot']}", req["buf"])
            self._baseline[h] = key
        else:
            req["state"] = "resolved"
            self.resolve(key)


def main(argv: list[str]) -> int:
    spec = ChildSpec.from_json(argv[0])
    _die_with_parent()
    logging.basicConfig(
        level=spec.log_level,
        stream=sys.stderr,
        format=f"%(asctime)s {spec.role[0].upper()} %(levelname)s %(name)s: %(message)s",
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    node: Node | None = None
    try:
        if spec.role == "pinner":
            node = PinnerNode(spec)
            emit("ready", endpoint=node.driver.transport.address, pid=os.getpid())
        else:
            node = AccessorNode(spec)
            emit("ready", pid=os.getpid())
        node.run()
        emit("exit")
    except KeyboardInterrupt:
        return 130
    finally:
        if node is not None:
            node.driver.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
