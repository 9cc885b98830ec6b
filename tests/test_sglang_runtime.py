"""The SGLang adapter's parts that do not need SGLang, in the main venv: its settings, and its
lease runtime + ZMQ transport over real loopback sockets. A PULL socket and a reader thread stand
where SGLang's manager socket and its bootstrap/listener thread stand (the thread hands
``KVLEASE`` messages to ``LeaseRuntime.deliver``, exactly what the plugin's manager does).
The end-to-end tests with SGLang itself are in test_sglang_adapter.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq
from kvlease.adapters.sglang._lease import LeaseRuntime, RoomEvent
from kvlease.adapters.sglang._settings import ENV, Settings, load_settings
from kvlease.adapters.sglang._transport import TAG, SglangZmqTransport

from kvlease import ConfigError, LeaseConfig

# -- settings -----------------------------------------------------------------------------------


def test_defaults_are_kvleases() -> None:
    s = load_settings({})
    assert s.config == LeaseConfig()
    assert s.dest_lease and s.source_lease and s.metrics_port == 0


def test_settings_are_read() -> None:
    s = load_settings(
        {
            "SGLANG_KVLEASE_LEASE_DURATION": "12",
            "SGLANG_KVLEASE_MAX_ACCESS_TIME": "0.5",
            "SGLANG_KVLEASE_SOURCE_LEASE": "0",
            "SGLANG_KVLEASE_METRICS_PORT": "9400",
        }
    )
    assert s.config.kv_lease_duration == 12.0 and s.config.max_access_time == 0.5
    assert s.dest_lease and not s.source_lease and s.metrics_port == 9400


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("SGLANG_KVLEASE_LEASE_DURATION", "abc"),
        ("SGLANG_KVLEASE_LEASE_DURATION", "-1"),
        ("SGLANG_KVLEASE_LEASE_DURATION", "nan"),
        ("SGLANG_KVLEASE_MAX_ACCESS_TIME", "1e9"),
        ("SGLANG_KVLEASE_VALIDITY_MARGIN", "0"),
        ("SGLANG_KVLEASE_MAX_DRIFT_RATE", "0.5"),
        ("SGLANG_KVLEASE_DEST_LEASE", "maybe"),
        ("SGLANG_KVLEASE_METRICS_PORT", "70000"),
        ("SGLANG_KVLEASE_AUTH_KEYS", "nowhere:x"),
    ],
)
def test_bad_setting_names_the_variable(var: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings({var: value})
    assert var in str(info.value)


def test_every_variable_is_documented() -> None:
    readme = (__import__("pathlib").Path(__file__).parent.parent / "engines/sglang/README-section.md").read_text()
    for var in ENV:
        assert var in readme, var


# -- transport: inbound never raises, bounded ---------------------------------------------------


def test_deliver_drops_malformed_without_raising() -> None:
    t = SglangZmqTransport("sglang:127.0.0.1:1", "127.0.0.1:1")
    bad: list[list[bytes]] = [
        [],
        [TAG],
        [TAG, b"Z", b"e", b"0", b"a:1", b""],
        [TAG, b"F", b"e", b"0", b"a:1", b"x" * ((1 << 20) + 1)],
        [TAG, b"F", b"\xff", b"0", b"a:1", b"x"],  # not ascii: dropped at drain
        [TAG, b"F", b"e", b"-1", b"a:1", b"x"],  # not a rank
        [TAG, b"R", b"e", b"0", b"a:1", b"x"],  # a handshake reply nobody asked for
    ]
    for msg in bad:
        t.deliver(msg)
    assert t.receive() == []
    assert t.poll_handshakes() == []
    assert t.dropped == len(bad)


# -- the runtime over real sockets ----------------------------------------------------------------


class Side:
    """A LeaseRuntime behind a PULL socket read by a thread (SGLang's socket and thread)."""

    def __init__(self, role: str, settings: Settings) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.events: list[tuple[float, RoomEvent]] = []
        self.rt = LeaseRuntime(
            settings,
            role=role,
            ip="127.0.0.1",
            port=self.port,
            on_event=lambda ev: self.events.append((time.monotonic(), ev)),
            zmq_context=self.ctx,
            poll_interval=0.01,
        )
        self._stop = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop:
            if poller.poll(20):
                msg = self.sock.recv_multipart()
                if SglangZmqTransport.is_ours(msg):
                    self.rt.deliver(msg)

    def kinds(self, room: int) -> list[str]:
        return [ev.kind for _t, ev in list(self.events) if ev.room == room]

    def close(self) -> None:
        self.rt.close()
        self._stop = True
        self._thread.join(2)
        self.sock.close(0)
        self.ctx.term()


FAST = Settings(config=LeaseConfig(kv_lease_duration=0.6, max_access_time=0.1, validity_margin=0.01))
E = FAST.config.lease_extension
I = FAST.config.heartbeat_interval  # noqa: E741
G = FAST.config.push_guard


@pytest.fixture
def pd() -> Iterator[tuple[Side, Side]]:
    p, d = Side("prefill", FAST), Side("decode", FAST)
    try:
        yield p, d
    finally:
        p.close()
        d.close()


def wait_for(pred: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_push_lease_ends_with_the_access_done(pd: tuple[Side, Side]) -> None:
    p, d = pd
    room = 7
    p.rt.open_source(room)
    d.rt.ask_source(room, "127.0.0.1", p.port)
    d.rt.grant_dest(room, "127.0.0.1", p.port)
    wait_for(lambda: not p.rt.awaiting_first_ack(room))
    assert not d.rt.dest_freed(room)
    assert p.rt.covered(room) is None
    assert p.rt.begin_write(room) is None
    assert p.rt.writing(room)
    p.rt.end_write(room, True)  # every WRITE DONE: the access-done goes out now
    wait_for(lambda: d.rt.dest_freed(room))
    assert "dest_freed" in d.kinds(room) and "fail" not in d.kinds(room)
    # D's Release ends P's source lease at once.
    wait_for(lambda: p.rt.source_live(room))
    d.rt.stop_source(room)
    wait_for(lambda: not p.rt.source_live(room))
    assert "fail" not in p.kinds(room)


def test_a_write_outside_the_window_is_refused(pd: tuple[Side, Side]) -> None:
    p, d = pd
    room = 8
    d.rt.grant_dest(room, "127.0.0.1", p.port)
    wait_for(lambda: not p.rt.awaiting_first_ack(room))
    d.rt.close()  # D stops answering: P's window stops growing
    wait_for(lambda: p.rt.covered(room) is not None, timeout=E + 1)
    assert p.rt.begin_write(room) is not None
    assert not p.rt.writing(room)
    assert p.rt.writes_refused >= 2


def test_dead_prefill_frees_decode_pages_within_bound(pd: tuple[Side, Side]) -> None:
    p, d = pd
    room = 9
    d.rt.grant_dest(room, "127.0.0.1", p.port)
    wait_for(lambda: not p.rt.awaiting_first_ack(room))
    time.sleep(2 * I)
    (key,) = p.rt.dest_keys(room)
    t_dead = time.monotonic()
    p.rt.close()  # P's heartbeats stop (its pump has stopped when close returns)
    window_end = p.rt.accessor.valid_until(key)  # P could have started a WRITE until then
    assert window_end is not None
    wait_for(lambda: d.rt.dest_freed(room), timeout=E + I + G + 2)
    t_free = next(t for t, ev in d.events if ev.room == room and ev.kind == "dest_freed")
    assert t_free >= window_end + G  # one process, one monotonic clock: exact
    assert t_free - t_dead <= E + I + G + 0.5
    assert [ev.reason for _t, ev in d.events if ev.kind == "fail"] == [
        "kvlease: destination-page lease expired (prefill silent)"
    ]


def test_aborted_room_waits_for_expiry_plus_guard(pd: tuple[Side, Side]) -> None:
    p, d = pd
    room = 10
    d.rt.grant_dest(room, "127.0.0.1", p.port)
    wait_for(lambda: not p.rt.awaiting_first_ack(room))
    assert p.rt.begin_write(room) is None  # a WRITE may be running from now on
    t_release = time.monotonic()
    d.rt.release_dest(room)  # D aborts: a promised push lease is not freed at once
    time.sleep(G / 2)
    assert not d.rt.dest_freed(room)
    p.rt.end_write(room, True)  # the late WRITE landed: its access-done ends the lease
    wait_for(lambda: d.rt.dest_freed(room))
    assert time.monotonic() - t_release < E + G


def test_a_room_two_prefill_ranks_write_frees_after_both() -> None:
    # Prefill TP 2 -> decode TP 1: the decode rank grants one push lease per prefill rank and
    # reuses the pages only when both have ended.
    p0, p1, d = Side("prefill", FAST), Side("prefill", FAST), Side("decode", FAST)
    try:
        room = 11
        d.rt.grant_dest(room, "127.0.0.1", p0.port)
        d.rt.grant_dest(room, "127.0.0.1", p1.port)
        wait_for(lambda: not p0.rt.awaiting_first_ack(room) and not p1.rt.awaiting_first_ack(room))
        assert p0.rt.begin_write(room) is None and p1.rt.begin_write(room) is None
        p0.rt.end_write(room, True)
        time.sleep(0.1)
        assert not d.rt.dest_freed(room)  # p1's WRITE may still land
        p1.rt.end_write(room, True)
        wait_for(lambda: d.rt.dest_freed(room))
        assert "fail" not in d.kinds(room)
    finally:
        for s in (p0, p1, d):
            s.close()


def test_one_prefill_rank_writing_to_two_decode_ranks_needs_both_windows() -> None:
    # Prefill TP 1 -> decode TP 2: the prefill rank holds a lease from each decode rank and
    # starts the final chunk only if both windows cover it.
    p, d0, d1 = Side("prefill", FAST), Side("decode", FAST), Side("decode", FAST)
    try:
        room = 12
        d0.rt.grant_dest(room, "127.0.0.1", p.port)
        d1.rt.grant_dest(room, "127.0.0.1", p.port)
        wait_for(lambda: len(p.rt.dest_keys(room)) == 2 and not p.rt.awaiting_first_ack(room))
        d1.rt.close()  # one decode rank goes silent
        wait_for(lambda: p.rt.covered(room) is not None, timeout=E + 1)
        assert p.rt.begin_write(room) is not None  # nothing starts, not even towards d0
        assert not p.rt.writing(room)
    finally:
        for s in (p, d0, d1):
            s.close()
