"""The driver over real ZMQ sockets in one process: hostile input, the asyncio service, engine
TTL and reconnection, and a restarted pinner. Two-process behaviour is in test_zmq_processes.py.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Iterator

import pytest

zmq = pytest.importorskip("zmq")

from kvlease.transports import Driver, DriverEvent, PeerDead, Transport  # noqa: E402
from kvlease.transports.zmq import ZmqTransport  # noqa: E402

from kvlease import (  # noqa: E402
    AccessCompleted,
    Accessor,
    AccessStale,
    Free,
    Heartbeat,
    LeaseConfig,
    LeaseLost,
    LocalTime,
    LostReason,
    Pinner,
    Rejected,
    encode,
)

CFG = LeaseConfig(kv_lease_duration=3.0, max_access_time=0.2)


class FakeClock:
    def __init__(self) -> None:
        self.t = random.uniform(1e4, 2e5)  # a random epoch per peer, as STYLE.md asks

    def __call__(self) -> float:
        return self.t


def _pump(
    drivers: list[Driver], until: Callable[[], bool], timeout: float = 5.0, events: list[DriverEvent] | None = None
) -> list[DriverEvent]:
    """Step every driver until `until()`; events are appended to `events` as they come."""
    events = [] if events is None else events
    deadline = time.monotonic() + timeout
    while not until():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached in {timeout} s; events {events}")
        for d in drivers:
            events.extend(d.step())
        time.sleep(0.001)
    return events


@pytest.fixture
def pinner_side() -> Iterator[Driver]:
    t = ZmqTransport("P", bind="tcp://127.0.0.1:0")
    d = Driver(t, pinner=Pinner(CFG, "P", random.getrandbits(63)), log_interval=60.0)
    yield d
    d.close()


def _accessor(clock: Callable[[], float] | None = None, **kw: float) -> Driver:
    t = ZmqTransport("D", bind="tcp://127.0.0.1:0")
    if clock is None:
        return Driver(t, accessor=Accessor(CFG, "D", session=7), **kw)  # type: ignore[arg-type]
    return Driver(t, accessor=Accessor(CFG, "D", session=7), clock=clock, **kw)  # type: ignore[arg-type]


def test_zmq_transport_satisfies_the_protocol(pinner_side: Driver) -> None:
    assert isinstance(pinner_side.transport, Transport)


def test_hostile_input_is_counted_logged_once_and_dropped(
    pinner_side: Driver, caplog: pytest.LogCaptureFixture
) -> None:
    """Garbage from one peer never raises into the step and never costs another lease."""
    p = pinner_side
    region = bytearray(b"\x42") * 1024
    p.transport.register("good", region)
    ticket = p.grant("good", nbytes=len(region))
    d = _accessor()
    events: list[DriverEvent] = []
    try:
        d.track("good", ticket, address=p.transport.address)
        events += _pump([p, d], lambda: d.accessor is not None and d.accessor.is_connected("P"))
        evil = zmq.Context.instance().socket(zmq.DEALER)
        evil.setsockopt(zmq.IDENTITY, b"evil\x000")
        evil.setsockopt(zmq.LINGER, 0)
        evil.connect(p.transport.address)
        forged_hb = encode(Heartbeat("evil", 0, 1, 99, 12345, 1, LocalTime(1.0), (1, 2, 3)))
        junk = [
            b"",
            b"\xc1\x4b",
            b"\xc1\x4bnot msgpack at all",
            b"\xc1\x4b" + bytes(random.getrandbits(8) for _ in range(200)),
            b"HB:req-1,req-2",  # vLLM compat is off on this driver
            bytes(range(256)),
            forged_hb,  # decodes; wrong incarnation: answered "unknown", renews nothing
        ]
        with caplog.at_level(logging.WARNING, logger="kvlease.transports"):
            for _ in range(20):
                for j in junk:
                    evil.send_multipart([b"M", j])
            evil.send_multipart([b"H", b"garbage handshake"])
            evil.send_multipart([b"Q"])  # unknown transport framing
            evil.send_multipart([b"R", b"12345678", b"no-such-region"])
            events += _pump([p, d], lambda: p.stats.malformed_messages >= 20 * 6 + 1)
            # The legitimate lease is untouched and still reads fine.
            into = bytearray(1024)
            assert d.read("good", "good", into).allowed
            _pump(
                [p, d],
                lambda: {type(e) for e in events} >= {AccessCompleted, Free},
                events=events,
            )
        assert into == region
        assert next(e for e in events if isinstance(e, Free)).key == "good"
        evil_logs = [r for r in caplog.records if "'evil'" in r.getMessage()]
        assert len(evil_logs) == 1, [r.getMessage() for r in evil_logs]  # once per peer per interval
        assert p.stats.malformed_messages >= 20 * 6 + 1
        assert p.pinner is not None and p.pinner.counters.heartbeat_ids_missing >= 3
        evil.close(0)
    finally:
        d.close()


def test_refused_and_misrouted_messages_are_counted_not_raised(pinner_side: Driver) -> None:
    from kvlease import PROTOCOL_VERSION, AccessDoneAck, AccessOutcome, Handshake, HandshakeReply, decode

    p = pinner_side
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.IDENTITY, b"X\x000")
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(p.transport.address)
    try:
        # An accessor-bound message sent to a pinner-only engine: malformed here.
        raw.send_multipart([b"M", encode(AccessDoneAck("X", 0, 1, 0, 5, 1, 1, AccessOutcome.OK))])
        # A handshake in a protocol version we do not speak: the core refuses it.
        raw.send_multipart([b"M", encode(Handshake("X", 0, 1, 5, 99, 0, 1, LocalTime(5.0)))])
        events = _pump([p], lambda: p.stats.rejected_messages >= 1 and p.stats.malformed_messages >= 1)
        assert any(isinstance(e, Rejected) and "version" in e.reason for e in events)
        assert raw.poll(2000)  # and the peer was told who we are and what we speak
        kind, reply = raw.recv_multipart()
        assert kind == b"M"
        answer = decode(reply)  # bound to the handshake it answers
        assert isinstance(answer, HandshakeReply) and answer.version == PROTOCOL_VERSION
        assert (answer.engine_id, answer.to_rank, answer.to_session, answer.seq, answer.t_echo) == ("P", 0, 5, 1, 5.0)
    finally:
        raw.close(0)


async def _serve_until(drivers: list[Driver], done: asyncio.Event, timeout: float) -> None:
    tasks = [asyncio.create_task(d.run(done)) for d in drivers]
    try:
        await asyncio.wait_for(done.wait(), timeout)
    finally:
        done.set()
        await asyncio.gather(*tasks)


@pytest.mark.asyncio
async def test_asyncio_service_runs_a_lease_end_to_end() -> None:
    seen: list[DriverEvent] = []
    done = asyncio.Event()

    def on_event(ev: DriverEvent) -> None:
        seen.append(ev)
        if isinstance(ev, AccessCompleted):
            done.set()

    pt = ZmqTransport("P")
    p = Driver(pt, pinner=Pinner(CFG, "P", 7), on_event=on_event)
    d = Driver(ZmqTransport("D"), accessor=Accessor(CFG, "D", session=7), on_event=on_event)
    region = bytearray(b"kv" * 512)
    pt.register("r", region)
    d.track("r", p.grant("r"), address=pt.address)
    into = bytearray(len(region))

    async def reader() -> None:
        while not d.read("r", "r", into).allowed:  # refused until the handshake is done
            await asyncio.sleep(0.01)

    try:
        await asyncio.gather(_serve_until([p, d], done, 10.0), reader())
        assert into == region
        # D completes on its own verdict; the access-done that rode on the READ may still be in
        # flight to P when the service stops: P frees when it arrives (step P until then).
        _pump([p], lambda: p.stats.leases_completed == 1)  # its events also reach on_event
        assert [e.key for e in seen if isinstance(e, Free)] == ["r"]
    finally:
        p.close()
        d.close()


def test_dead_pinner_is_disconnected_after_engine_ttl_and_a_restart_reconnects() -> None:
    clock = FakeClock()
    pt = ZmqTransport("P")
    address = pt.address
    p = Driver(pt, pinner=Pinner(CFG, "P", 1))
    d = _accessor(clock, engine_ttl=10.0)
    events: list[DriverEvent] = []
    try:
        d.track("a", p.grant("a"), address=address)
        events += _pump([p, d], lambda: d.accessor is not None and d.accessor.is_connected("P"))
        p.close()  # the pinner engine is gone without a word
        for _ in range(60):  # 15 s of fake time in 0.25 s steps
            clock.t += 0.25
            events += d.step()
            time.sleep(0.002)
        lost = [e for e in events if isinstance(e, LeaseLost)]
        assert [e.reason for e in lost] == [LostReason.VALIDITY_LAPSED]
        assert any(isinstance(e, PeerDead) and e.engine_id == "P" for e in events)
        assert d.stats.peers_dead == 1
        # A restarted pinner (new incarnation) on the same address is reached again.
        pt2 = ZmqTransport("P", bind=address)
        p2 = Driver(pt2, pinner=Pinner(CFG, "P", 2))
        try:
            pt2.register("b", bytearray(b"\x09") * 64)
            d.track("b", p2.grant("b"), address=address)
            into = bytearray(64)

            def read_done() -> bool:
                if d.accessor is not None and d.accessor.is_connected("P") and "b" not in started:
                    assert d.read("b", "b", into).allowed
                    started.add("b")
                clock.t += 0.001
                return any(isinstance(e, AccessCompleted) and e.key == "b" for e in events)

            started: set[str] = set()
            while not read_done():
                events.extend(p2.step())
                events.extend(d.step())
                time.sleep(0.001)
                assert clock.t < 1e9
            assert into == b"\x09" * 64
        finally:
            p2.close()
    finally:
        d.close()


def test_restarted_pinner_loses_old_leases_precisely() -> None:
    """Same address, new incarnation, old lease ids reused: the accessor learns the old
    leases are gone (PINNER_RESTARTED / UNKNOWN), never renews a stranger's lease."""
    pt = ZmqTransport("P")
    address = pt.address
    p = Driver(pt, pinner=Pinner(CFG, "P", 100))
    d = _accessor()
    events: list[DriverEvent] = []
    try:
        d.track("old", p.grant("old"), address=address)
        events += _pump([p, d], lambda: d.stats.heartbeat_acks_received >= 1)
        p.close()
        pt2 = ZmqTransport("P", bind=address)
        p2 = Driver(pt2, pinner=Pinner(CFG, "P", 200))
        try:
            stranger = p2.grant("stranger")  # reuses lease id 1 under the new incarnation
            assert stranger.lease_id == 1
            _pump([p2, d], lambda: any(isinstance(e, LeaseLost) for e in events), timeout=10, events=events)
            lost = [e for e in events if isinstance(e, LeaseLost)]
            assert lost[0].key == "old"
            assert lost[0].reason in (LostReason.PINNER_RESTARTED, LostReason.UNKNOWN, LostReason.VALIDITY_LAPSED)
            assert p2.stats.leases_renewed == 0  # the old heartbeats renewed nothing here
        finally:
            p2.close()
    finally:
        d.close()


def test_vllm_compat_notifications_renew_and_complete() -> None:
    """A stock vLLM decoder's ``HB:`` and ``id:count`` notifications over the same wire."""
    cfg = CFG.with_changes(vllm_compat=True, kv_lease_duration=1.5)  # extension 1 s
    pt = ZmqTransport("P")
    p = Driver(pt, pinner=Pinner(cfg, "P", 3), vllm_compat=True)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.IDENTITY, b"vllm-d\x000")
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(pt.address)
    try:
        ticket = p.grant("req-7")
        assert p.pinner is not None
        before = p.pinner.info(ticket.lease_id)
        assert before is not None
        time.sleep(0.6)  # so that now + extension lies beyond the initial expiry
        raw.send_multipart([b"M", b"HB:req-7,unknown-req"])
        _pump([p], lambda: p.stats.leases_renewed >= 1)
        after = p.pinner.info(ticket.lease_id)
        assert after is not None and after.expiry > before.expiry
        raw.send_multipart([b"M", b"req-7:1"])
        events = _pump([p], lambda: p.stats.leases_completed >= 1)
        assert any(isinstance(e, Free) and e.key == "req-7" for e in events)
        assert p.stats.malformed_messages == 0
    finally:
        raw.close(0)
        p.close()


class _SendLog(ZmqTransport):
    """The real ZMQ transport, recording what the driver sends through `send` (the control
    plane) as opposed to what rides on a transfer."""

    def __init__(self, *a: object, **kw: object) -> None:
        super().__init__(*a, **kw)  # type: ignore[arg-type]
        self.sent: list[object] = []
        self.lose_heartbeats = False  # a lossy link for heartbeats (everything else goes)

    def send(self, engine_id: str, rank: int | None, data: bytes) -> None:
        from kvlease import Heartbeat, decode

        msg = decode(data)
        self.sent.append(msg)
        if self.lose_heartbeats and isinstance(msg, Heartbeat):
            return
        super().send(engine_id, rank, data)


def test_access_done_rides_on_the_read_not_a_separate_send(pinner_side: Driver) -> None:
    from kvlease import AccessDone, EndReason

    p = pinner_side
    region = bytearray(b"\x5a") * 4096
    p.transport.register("r", region)
    t = _SendLog("D", bind="tcp://127.0.0.1:0")
    d = Driver(t, accessor=Accessor(CFG, "D", session=7))
    events: list[DriverEvent] = []
    try:
        d.track("r", p.grant("r", nbytes=4096), address=p.transport.address)
        _pump([p, d], lambda: d.accessor is not None and d.accessor.valid_until("r") is not None, events=events)
        into = bytearray(4096)
        decision = d.read("r", "r", into)
        assert decision.allowed and decision.guaranteed and decision.targets == (0,)
        _pump([p, d], lambda: {type(e) for e in events} >= {AccessCompleted, Free}, events=events)
        assert into == region
        free = next(e for e in events if isinstance(e, Free))
        assert free.reason is EndReason.ACCESS_DONE
        # The pinner handled an access-done, and none went through the control plane.
        assert not [m for m in t.sent if isinstance(m, AccessDone)]
        assert p.stats.leases_completed == 1
        assert (d.stats.accesses_completed, d.stats.accesses_confirmed) == (1, 0)  # covered: no round trip
    finally:
        d.close()


def test_attached_confirmation_is_answered_even_when_the_answer_races_the_completion(
    pinner_side: Driver,
) -> None:
    """A READ that finishes after the accessor's window: the attached access-done asked the
    pinner to confirm (the window did not cover the access-time bound at the start), so no
    second access-done is sent, and the pinner's `AccessDoneAck` (which may arrive in the same
    step as the completion) turns into a confirmed completion."""
    from kvlease import AccessDone

    p = pinner_side
    region = bytearray(b"\x33") * 1024
    p.transport.register("c", region)
    clock = FakeClock()
    t = _SendLog("D", bind="tcp://127.0.0.1:0")
    d = Driver(t, accessor=Accessor(CFG, "D", session=7), clock=clock)
    events: list[DriverEvent] = []
    try:
        d.track("c", p.grant("c"), address=p.transport.address)

        def valid() -> bool:
            clock.t += 0.0001
            return d.accessor is not None and d.accessor.valid_until("c") is not None

        _pump([p, d], valid, events=events)
        assert d.accessor is not None
        vu = d.accessor.valid_until("c")
        assert vu is not None
        # Heartbeats are lost from here on: the acknowledgement of one sent during the READ
        # would cover its finish late (spec §5.6 step 9); this test is about the verdict.
        t.lose_heartbeats = True
        # Inside the window, but too close to its end to cover the access-time bound.
        clock.t = vu - CFG.access_time_local / 2
        into = bytearray(1024)
        decision = d.read("c", "c", into)
        assert decision.allowed and not decision.guaranteed
        assert decision.notification is not None and decision.notification.confirm
        clock.t = vu + 0.01  # it finishes outside the window (the pinner's lease is live)
        _pump([p, d], lambda: any(isinstance(e, (AccessCompleted, AccessStale)) for e in events), events=events)
        done = [e for e in events if isinstance(e, (AccessCompleted, AccessStale))]
        assert done == [AccessCompleted("c", done[0].lease_id, confirmed_by_pinner=True)], done
        assert (d.stats.accesses_completed, d.stats.accesses_confirmed) == (1, 1)  # it waited a round trip
        assert into == region
        assert not [m for m in t.sent if isinstance(m, AccessDone)]
    finally:
        d.close()


# -- the driver as an engine embeds it -------------------------------------------------------


def test_driver_errors_are_kvlease_errors() -> None:
    """Misuse and the unreachable hint sit under KvLeaseError, so one except catches them."""
    from kvlease.transports import PeerUnreachable

    from kvlease import KvLeaseError, LocalProtocolError

    t = ZmqTransport("X")
    try:
        with pytest.raises(LocalProtocolError, match="pinner, an accessor"):
            Driver(t)
        pinner_only = Driver(t, pinner=Pinner(CFG, "X", 1))
        with pytest.raises(KvLeaseError, match="no accessor"):
            pinner_only.untrack("k")
        with pytest.raises(KvLeaseError, match="no pinner"):
            Driver(t, accessor=Accessor(CFG, "X", session=1)).release(1)
        assert issubclass(PeerUnreachable, KvLeaseError)
    finally:
        t.close()


def test_a_buffer_mismatch_raises_and_leaves_the_lease_as_it_was(pinner_side: Driver) -> None:
    """Where the access goes and which ranks it targets come from the core's decision; a
    caller's mistake is refused before anything is posted, and the lease stays usable."""
    from kvlease import LocalProtocolError

    p = pinner_side
    region = bytearray(b"\x07") * 256
    p.transport.register("k", region)
    d = _accessor()
    events: list[DriverEvent] = []
    try:
        d.track("k", p.grant("k"), address=p.transport.address)
        events += _pump([p, d], lambda: d.stats.heartbeat_acks_received >= 1)
        with pytest.raises(LocalProtocolError, match=r"targets \[0\]"):
            d.read("k", "k", {0: bytearray(256), 1: bytearray(256)})
        into = bytearray(256)
        decision = d.read("k", "k", into)
        assert decision.allowed and decision.engine_id == "P" and decision.targets == (0,)
        _pump([p, d], lambda: any(isinstance(e, AccessCompleted) for e in events), events=events)
        assert into == region
    finally:
        d.close()


def test_next_deadline_includes_the_engine_ttl_of_an_unanswered_peer() -> None:
    """`step` declares a silent peer dead at unanswered_since + engine_ttl: `next_deadline`
    says so, so a caller that sleeps until it is not late for that."""
    clock = FakeClock()
    d = _accessor(clock, engine_ttl=4.0)
    try:
        t0 = clock.t
        d.connect("P", "tcp://127.0.0.1:9")  # nobody listens: the handshake goes unanswered
        deadline = d.next_deadline()
        assert deadline is not None and deadline <= t0 + 4.0
        # Step with fake time only at the deadlines the driver names: the peer is declared
        # dead at the first step at or after t0 + 4 s, never later.
        events: list[DriverEvent] = []
        for _ in range(200):
            nd = d.next_deadline()
            assert nd is not None
            clock.t = max(clock.t, nd)
            events += d.step()
            if any(isinstance(e, PeerDead) for e in events):
                break
        assert any(isinstance(e, PeerDead) for e in events)
        assert clock.t <= t0 + 4.0 + 1e-9
    finally:
        d.close()


def test_an_on_event_exception_loses_no_event(pinner_side: Driver) -> None:
    """The callback raises for the first event: every other event of the step still reaches it
    (and step's return value), then the engine's exception surfaces."""
    p = pinner_side
    got: list[DriverEvent] = []

    def on_event(ev: DriverEvent) -> None:
        got.append(ev)
        if len(got) == 1:
            raise RuntimeError("engine bug")

    p.on_event = on_event
    tickets = [p.grant(f"k{i}") for i in range(3)]
    for t in tickets:
        p.release(t.lease_id)
    with pytest.raises(RuntimeError, match="engine bug"):
        p.step()
    assert sorted(e.key for e in got if isinstance(e, Free)) == ["k0", "k1", "k2"]


@pytest.mark.asyncio
async def test_idle_run_sleeps_on_the_sockets_and_wakes_for_input() -> None:
    """An idle `run()` over ZMQ steps a handful of times a second at most (it sleeps on the
    sockets' descriptors until the next deadline), yet a frame that arrives wakes it at once:
    a stock-vLLM heartbeat sent mid-sleep renews the lease long before the lease's own
    deadline would have woken the driver."""
    cfg = CFG.with_changes(vllm_compat=True, kv_lease_duration=60.0)
    pt = ZmqTransport("P")
    p = Driver(pt, pinner=Pinner(cfg, "P", 3), vllm_compat=True)
    steps = 0
    real_step = p.step

    def counting_step() -> list[DriverEvent]:
        nonlocal steps
        steps += 1
        return real_step()

    p.step = counting_step  # type: ignore[method-assign]
    ticket = p.grant("req-1")
    for i in range(1000):
        p.grant(f"idle-{i}")
    stop = asyncio.Event()
    task = asyncio.create_task(p.run(stop))
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.IDENTITY, b"vllm-d\x000")
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(pt.address)
    try:
        await asyncio.sleep(0.5)
        idle_steps = steps
        # A 1 ms tick would have stepped ~500 times; sleeping on the sockets, only the
        # wake-ups of the connecting peer and the 1 s safety net remain.
        assert idle_steps < 25, idle_steps
        assert p.pinner is not None
        before = p.pinner.info(ticket.lease_id)
        assert before is not None
        await asyncio.sleep(0.3)
        raw.send_multipart([b"M", b"HB:req-1"])
        for _ in range(200):
            if p.stats.leases_renewed >= 1:
                break
            await asyncio.sleep(0.01)
        assert p.stats.leases_renewed >= 1  # woken by the frame, not by a deadline 60 s away
        stop.set()
        await asyncio.wait_for(task, 5.0)  # and a set stop ends the sleep at once
    finally:
        stop.set()
        raw.close(0)
        p.close()


class _Unpollable:
    """A ZMQ transport seen through a wrapper that hides its descriptors, as NIXL's are hidden:
    the driver must poll it."""

    def __init__(self, inner: ZmqTransport) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> object:
        if name in ("wait_fds", "ready"):
            raise AttributeError(name)
        return getattr(self._inner, name)


@pytest.mark.asyncio
async def test_idle_run_backs_off_polling_a_transport_without_descriptors() -> None:
    from kvlease.transports import Pollable

    from kvlease import KvLeaseError

    cfg = CFG.with_changes(vllm_compat=True, kv_lease_duration=60.0)
    inner = ZmqTransport("P")
    tr = _Unpollable(inner)
    assert not isinstance(tr, Pollable)
    p = Driver(tr, pinner=Pinner(cfg, "P", 3), vllm_compat=True)  # type: ignore[arg-type]
    steps = 0
    real_step = p.step

    def counting_step() -> list[DriverEvent]:
        nonlocal steps
        steps += 1
        return real_step()

    p.step = counting_step  # type: ignore[method-assign]
    p.grant("req-1")
    stop = asyncio.Event()
    task = asyncio.create_task(p.run(stop, poll_interval=0.001, max_poll_interval=0.05))
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.IDENTITY, b"vllm-d\x000")
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(inner.address)
    try:
        await asyncio.sleep(1.0)
        # 1 ms polling would step up to ~1000 times; backing off to 50 ms, about 25.
        assert steps < 100, steps
        raw.send_multipart([b"M", b"HB:req-1"])
        for _ in range(200):
            if p.stats.heartbeats_received >= 1:
                break
            await asyncio.sleep(0.01)
        assert p.stats.heartbeats_received >= 1
        with pytest.raises(KvLeaseError, match="poll_interval <= max_poll_interval"):
            await p.run(stop, poll_interval=0.1, max_poll_interval=0.01)
    finally:
        stop.set()
        await asyncio.wait_for(task, 5.0)
        raw.close(0)
        inner.close()


@pytest.mark.asyncio
async def test_an_engine_call_wakes_a_sleeping_run() -> None:
    """`run()` sleeps on the sockets it knows until the next deadline; an engine call (here
    `track`, which opens a socket to a new pinner and brings a heartbeat deadline forward) wakes
    it to re-plan. With a 60 s safety net, only that wake-up can make the lease acknowledged."""
    cfg = CFG.with_changes(kv_lease_duration=60.0)
    pt = ZmqTransport("P")
    p = Driver(pt, pinner=Pinner(cfg, "P", 5))
    d = Driver(ZmqTransport("D"), accessor=Accessor(cfg, "D", session=9))
    stop = asyncio.Event()
    tasks = [asyncio.create_task(x.run(stop, max_wait=60.0)) for x in (p, d)]
    try:
        await asyncio.sleep(0.3)  # both asleep: nothing is due for a minute
        d.track("k", p.grant("k"), address=pt.address)
        for _ in range(500):
            if d.stats.heartbeat_acks_received >= 1:
                break
            await asyncio.sleep(0.01)
        assert d.stats.heartbeat_acks_received >= 1
        assert d.accessor is not None and d.accessor.valid_until("k") is not None
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 5.0)
        p.close()
        d.close()


def test_a_heartbeat_whose_ack_cannot_fit_never_raises_into_the_step() -> None:
    """Protocol v3, hole 4: a heartbeat just under the 1 MiB frame bound, ids 2**32 apart, every
    field at its widest, sent to a pinner whose engine id is long. v2 built an ack 125 bytes
    over the frame bound and `encode` raised out of `Driver.step()` (in vLLM, into
    `get_transfer_results`). v3: refused, counted, no reply, and the driver keeps serving."""
    engine = "p" * 120
    t = ZmqTransport(engine, bind="tcp://127.0.0.1:0")
    p = Driver(t, pinner=Pinner(CFG, engine, random.getrandbits(63)), log_interval=60.0)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.IDENTITY, b"X\x000")
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(p.transport.address)
    try:
        near = tuple(1 + i * 2**32 for i in range(116_495))
        big = encode(Heartbeat("X", 0, 1, 2**64 - 1, 5, 2**64 - 1, LocalTime(1.0), near))
        assert len(big) > 2**20 - 100
        raw.send_multipart([b"M", big])
        events = _pump([p], lambda: p.stats.rejected_messages >= 1, timeout=20.0)
        assert any(isinstance(e, Rejected) and "budget" in e.reason for e in events)
        assert not raw.poll(300)  # no ack at all
        # Still serving: an ordinary heartbeat is answered.
        raw.send_multipart([b"M", encode(Heartbeat("X", 0, 1, 9, 5, 1, LocalTime(1.0), (1,)))])
        _pump([p], lambda: bool(raw.poll(0)), timeout=5.0)
        kind, reply = raw.recv_multipart()
        assert kind == b"M" and len(reply) <= CFG.max_message_bytes
    finally:
        raw.close(0)
        p.close()


def test_idle_until_holds_while_changes_stand_and_a_call_voids_it() -> None:
    """`idle_until` is when the next step has work as things stand: a pinner with a lease has
    none before the lease's expiry (steps then return nothing and move nothing) and frees it in
    the first step at or after it; every engine call moves `changes`, and an event not yet
    returned makes it -inf (work now). So a step loop that skips steps on this rule (the vLLM
    adapter's quiet step) loses nothing."""
    clock = FakeClock()
    t = ZmqTransport("P", bind="tcp://127.0.0.1:0")
    d = Driver(t, pinner=Pinner(CFG, "P", 5), clock=clock, log_interval=60.0)
    try:
        assert d.idle_until() == float("inf")  # no lease, no peer: no timer at all
        before = d.changes
        first = d.grant("req-1")
        assert d.changes > before  # an engine call
        expiry = d.idle_until()
        assert expiry == clock.t + CFG.kv_lease_duration
        mark = d.changes
        while clock.t + 0.25 < expiry:  # quiet steps: nothing to do, nothing moves
            clock.t += 0.25
            assert d.step() == [] and d.changes == mark and d.idle_until() == expiry
        clock.t = expiry
        (free,) = d.step()
        assert isinstance(free, Free) and free.lease_id == first.lease_id
        assert d.idle_until() == float("inf")
        second = d.grant("req-2")
        mark = d.changes
        d.release(second.lease_id)  # never renewed: freed at once, its Free due in the next step
        assert d.changes > mark and d.idle_until() == -float("inf")
        (free,) = d.step()
        assert isinstance(free, Free) and free.lease_id == second.lease_id
    finally:
        d.close()
