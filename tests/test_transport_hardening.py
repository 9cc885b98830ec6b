"""What an outsider can do to the transports' own plumbing, and why it no longer works:
a lease granted for a known accessor is bound from the start (no window before the first
heartbeat), a side-channel hello naming another engine cannot take over where that engine's
acks go, and connections that never finish a request cannot make the driver raise."""

from __future__ import annotations

import os
import random
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

from kvlease import AccessDone, Accessor, LeaseConfig, LeaseLost, LocalTime, Pinner, encode

if TYPE_CHECKING:  # the transports load only where a test uses them
    from kvlease.transports import Driver

zmq = pytest.importorskip("zmq")

CFG = LeaseConfig(kv_lease_duration=3.0, max_access_time=0.2)


def _pump(drivers: list[Driver], until: Callable[[], bool], timeout: float = 10.0) -> list[object]:
    events: list[object] = []
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, f"condition not reached; events {events[-10:]}"
        for d in drivers:
            events.extend(d.step())
        time.sleep(0.001)
    return events


def test_a_lease_granted_for_a_known_accessor_has_no_unbound_window() -> None:
    """No key: ten forged AccessDone from an engine the pinner never saw, sent before the
    accessor's first heartbeat, free nothing when the grant named the accessor."""
    from kvlease.transports import Driver
    from kvlease.transports.zmq import ZmqTransport

    p = Driver(ZmqTransport("P"), pinner=Pinner(CFG, "P", random.getrandbits(63)), log_interval=60.0)
    x = zmq.Context.instance().socket(zmq.DEALER)
    try:
        tickets = [p.grant(f"req-{i}", accessor="D") for i in range(1, 11)]
        x.setsockopt(zmq.IDENTITY, b"X\x000")
        x.connect(p.transport.address)
        for t in tickets:
            forged = AccessDone("Z", 0, 1, 1, t.incarnation, 0, t.lease_id, 1, False, LocalTime(0.0))
            x.send_multipart([b"M", encode(forged)])
        events = _pump([p], lambda: p.stats.rejected_messages >= 10)
        assert not [e for e in events if type(e).__name__ == "Free"]
        assert p.pinner is not None and p.pinner.live_count == 10
    finally:
        x.close(linger=0)
        p.close()


@pytest.mark.slow
def test_a_side_channel_hello_cannot_hijack_another_engines_acks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keyed P and D over NIXL: a bare hello naming engine D with the attacker's own agent used
    to replace D's agent at P (D's heartbeats then came from an unknown agent, the lease expired
    and D lost it). Now it needs the handshake it carries to be accepted: D keeps its lease."""
    pytest.importorskip("nixl._api")
    from kvlease.transports import Driver, new_session
    from kvlease.transports.nixl import NixlTransport, loopback_ucx_env, parse_address, side_request

    loopback_ucx_env()
    monkeypatch.setenv("KVLEASE_TEST_KEY", os.urandom(16).hex())
    cfg = CFG.with_changes(auth_keys=("env:KVLEASE_TEST_KEY",))
    inc = random.getrandbits(63)
    pt = NixlTransport("P", incarnation=inc)
    p = Driver(pt, pinner=Pinner(cfg, "P", inc), log_interval=60.0)
    d = Driver(NixlTransport("D"), accessor=Accessor(cfg, "D", session=new_session()), log_interval=60.0)
    x = NixlTransport("X")
    try:
        ticket = p.grant("req-1")
        d.track("req-1", ticket, address=pt.address)
        acc = d.accessor
        assert acc is not None
        _pump([p, d], lambda: acc.valid_until("req-1") is not None)
        hello = x._hello("hello")
        hello["engine_id"] = "D"  # the attacker's agent, claiming to be engine D
        refused: list[BaseException] = []

        def attack() -> None:
            try:
                side_request(parse_address(pt.address), hello, 3.0)
            except (ConnectionRefusedError, OSError) as exc:  # refused: it carries no handshake
                refused.append(exc)

        th = threading.Thread(target=attack, daemon=True)
        th.start()
        before = p.stats.heartbeats_received
        events = _pump([p, d], lambda: p.stats.heartbeats_received >= before + 8, timeout=20.0)
        assert not [e for e in events if isinstance(e, LeaseLost)]
        assert acc.valid_until("req-1") is not None
        assert p.pinner is not None and p.pinner.info(ticket.lease_id) is not None
        th.join(5.0)
        assert refused, "the side channel answered the hijacking hello"
    finally:
        for t in (p, d):
            t.close()
        x.close()


@pytest.mark.slow
def test_idle_side_channel_connections_cannot_make_the_driver_raise() -> None:
    """Connections that send nothing are capped and, out of descriptors, accept is shed: the
    driver's step never raises because of a peer (it used to raise EMFILE)."""
    pytest.importorskip("nixl._api")
    from kvlease.transports import Driver
    from kvlease.transports.nixl import NixlTransport, loopback_ucx_env, parse_address

    loopback_ucx_env()
    inc = random.getrandbits(63)
    pt = NixlTransport("P", incarnation=inc)
    p = Driver(pt, pinner=Pinner(CFG, "P", inc), log_interval=60.0)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    host, port = parse_address(pt.address)
    script = (
        "import socket, sys, time\n"
        f"socks = [socket.create_connection(({host!r}, {port})) for _ in range(80)]\n"
        "print('connected', flush=True)\n"
        "time.sleep(8)\n"
    )
    attacker = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        # Connections queue in the listen backlog until P accepts them in its step.
        open_now = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + 30, hard))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            p.step()  # must never raise, whatever the peers do
            time.sleep(0.002)
        assert pt.malformed > 0  # the excess was shed, and counted
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        attacker.kill()
        attacker.wait()
        p.close()
