"""The vLLM adapter's transport over a connector's NIXL agent (pure: a recording stand-in for the
agent, no vLLM and no NIXL; the real agent is exercised by tests/test_vllm_adapter.py)."""

from __future__ import annotations

import logging
import time
from typing import Any

import msgpack
import pytest
from kvlease.adapters.vllm import _transport as transport_module
from kvlease.adapters.vllm._transport import (
    HELLO_MAGIC,
    ConnectorTransport,
    NotifSwap,
    producer_claim,
    verify_producer_claim,
)
from kvlease.transports import HandshakeFailed, HandshakeRequest, Inbound, PeerUnreachable, TransferResult

from kvlease import PROTOCOL_VERSION, FrameAuth


class Agent:
    def __init__(self) -> None:
        self.sent: list[tuple[object, bytes]] = []
        self.loaded: list[bytes] = []
        self.removed: list[str] = []

    def send_notif(self, name: object, notif_msg: bytes = b"") -> None:
        self.sent.append((name, notif_msg))

    def add_remote_agent(self, md: bytes) -> bytes:
        self.loaded.append(md)
        return b"agent-" + md  # NIXL returns the name as bytes

    def remove_remote_agent(self, name: str) -> None:
        self.removed.append(name)

    def get_agent_metadata(self) -> bytes:
        return b"my-md"


def hello(engine: str = "D", rank: int = 0, md: bytes = b"d0", hs: bytes = b"HS") -> bytes:
    body: bytes = msgpack.packb({"e": engine, "r": rank, "md": md, "hs": hs}, use_bin_type=True)
    return HELLO_MAGIC + body


def test_producer_loads_a_decoders_agent_only_when_the_handshake_is_answered() -> None:
    agent = Agent()
    t = ConnectorTransport(agent, "P", 0, {}, lambda e: None)
    t.feed("agent-d0", hello())
    (req,) = t.poll_handshakes()
    assert isinstance(req, HandshakeRequest) and req.data == b"HS"
    assert agent.loaded == []  # nothing installed before the driver accepted it
    with pytest.raises(PeerUnreachable):
        t.send("D", 0, b"ack")
    t.answer_handshake(req.token, b"REPLY")
    assert agent.loaded == [b"d0"] and agent.sent == [("agent-d0", b"REPLY")]
    t.send("D", 0, b"ack")
    assert agent.sent[-1] == ("agent-d0", b"ack")
    t.feed("agent-d0", b"\x92frame")
    assert t.receive() == [Inbound("D", 0, b"\x92frame")]
    t.forget_peer("D")
    assert agent.removed == ["agent-d0"]


def test_a_refused_or_malformed_hello_installs_nothing() -> None:
    agent = Agent()
    t = ConnectorTransport(agent, "P", 0, {}, lambda e: None)
    t.feed("x", hello())
    (req,) = t.poll_handshakes()
    assert isinstance(req, HandshakeRequest)
    t.reject_handshake(req.token)
    t.answer_handshake(req.token, b"late")  # a refused token is forgotten
    for bad in (HELLO_MAGIC + b"\xff\x00", hello(engine=""), hello(rank=-1), HELLO_MAGIC + msgpack.packb([1, 2])):
        t.feed("x", bad)
    assert t.poll_handshakes() == [] and agent.loaded == [] and agent.sent == []
    assert t.dropped_hellos == 4


def test_decoder_says_hello_once_vllms_handshake_has_loaded_the_producer() -> None:
    agent = Agent()
    remote: dict[str, dict[tuple[int, int], Any]] = {}
    started: list[str] = []

    class Pending:
        def __init__(self) -> None:
            self.finished = False
            self.error: BaseException | None = None

        def done(self) -> bool:
            return self.finished

        def exception(self) -> BaseException | None:
            return self.error

    fut = Pending()

    def ensure(engine: str) -> Pending | None:
        if engine != "P":
            raise KeyError(engine)
        started.append(engine)
        return fut

    t = ConnectorTransport(agent, "D", 0, remote, ensure)
    t.request_handshake("P", "127.0.0.1:5600", b"HS")
    assert started == ["P"] and agent.sent == []
    t.progress()
    assert agent.sent == []  # vLLM's handshake still running
    remote["P"] = {(0, 0): b"agent-p0"}
    fut.finished = True
    t.progress()
    ((name, data),) = agent.sent
    assert name == b"agent-p0" and data.startswith(HELLO_MAGIC)
    body = msgpack.unpackb(data[len(HELLO_MAGIC) :], raw=False)
    assert body == {"e": "D", "r": 0, "md": b"my-md", "hs": b"HS"}
    t.feed("agent-p0", b"\x92ack")  # the producer's reply, from an agent vLLM loaded (bytes name)
    assert t.receive() == [Inbound("P", 0, b"\x92ack")]
    t.request_handshake("Q", "127.0.0.1:5601", b"HS")  # no side channel known for Q
    assert t.poll_handshakes() == [HandshakeFailed("Q", "no side channel known: 'Q'")]


def test_external_access_completes_when_vllm_reports_the_read() -> None:
    t = ConnectorTransport(Agent(), "D", 0, {}, lambda e: None)
    with pytest.raises(RuntimeError):
        t.start_read("P", 0, "kv", None, b"done")  # only for a request named with expect()
    t.expect("r1")
    h = t.start_read("P", 0, "kv", None, b"done")
    t.expect(None)
    assert t.notifications("r1") == {0: b"done"} and t.outstanding("r1")
    assert t.poll_transfers() == []
    assert t.complete("r1", ok=True)
    assert t.poll_transfers() == [TransferResult(h, True)]
    assert not t.complete("r1", ok=True)  # reported once
    t.expect("r2")
    h2 = t.start_read("P", 0, "kv", None, b"done2")
    t.cancel_transfer(h2)  # the driver gave up on it
    assert not t.outstanding("r2") and not t.complete("r2", ok=True)
    with pytest.raises(NotImplementedError):
        t.register("kv", bytearray(8))


def test_a_multi_part_access_keeps_each_pinner_ranks_own_access_done() -> None:
    """Pinner TP 2, accessor TP 1: one READ per pinner rank, and each part carries the
    access-done naming its rank (protocol v3), never another rank's."""
    t = ConnectorTransport(Agent(), "D", 0, {}, lambda e: None)
    t.expect("r1")
    h0 = t.start_read("P", 0, "kv", None, b"done-for-0")
    h1 = t.start_read("P", 1, "kv", None, b"done-for-1")
    t.expect(None)
    assert t.notifications("r1") == {0: b"done-for-0", 1: b"done-for-1"}
    assert t.complete("r1", ok=True)
    assert t.poll_transfers() == [TransferResult(h0, True), TransferResult(h1, True)]
    assert t.notifications("r1") == {}


class XferAgent(Agent):
    def __init__(self) -> None:
        super().__init__()
        self.posted: list[bytes] = []

    def make_prepped_xfer(self, *args: Any, notif_msg: bytes = b"") -> int:
        self.posted.append(notif_msg)
        return len(self.posted)


def test_notif_swap_attaches_each_remote_ranks_own_access_done() -> None:
    """The READ vLLM posts to remote rank r carries rank r's access-done; a post to a rank the
    access does not target keeps vLLM's own notification (never another rank's, which would
    free that rank while its part is still running)."""
    agent = XferAgent()
    table = {"rid": {0: b"done-0", 1: b"done-1"}}
    swap = NotifSwap(agent, table, {"P": {(0, 0): "agent-p0", (0, 1): "agent-p1"}})
    for rank in (1, 0, 2):
        with swap.for_rank(rank):
            swap.make_prepped_xfer("READ", 1, [0], 2, [0], notif_msg=b"rid:1")
    assert agent.posted == [b"done-1", b"done-0", b"rid:1"]
    # Outside a post (vLLM's notify-only path) the agent's name tells the rank.
    swap.send_notif("agent-p1", notif_msg=b"rid:1")
    swap.send_notif(b"agent-p0", notif_msg=b"rid:1")
    assert agent.sent == [("agent-p1", b"done-1"), (b"agent-p0", b"done-0")]
    # Requests not under a kvlease lease pass through.
    swap.send_notif("agent-p0", notif_msg=b"other:1")
    assert agent.sent[-1] == ("agent-p0", b"other:1")
    # A single-part access (pinner TP <= accessor TP) needs no rank.
    table["one"] = {3: b"done-3"}
    swap.make_prepped_xfer("READ", 1, [0], 2, [0], notif_msg=b"one:2")
    assert agent.posted[-1] == b"done-3"


# -- a push producer's claim to run kvlease (in the params it returns) ---------------------------


def test_a_producer_claim_without_a_key_says_the_wire_version() -> None:
    params = {"remote_engine_id": "P", "remote_request_id": "r1"}
    claim = producer_claim(None, "P", "r1")
    assert claim == {"v": PROTOCOL_VERSION}
    assert verify_producer_claim(None, params, claim)
    assert not verify_producer_claim(None, params, {"v": PROTOCOL_VERSION - 1})  # another version
    assert not verify_producer_claim(None, params, None)
    assert not verify_producer_claim(None, params, "3")


def test_a_producer_claim_under_a_key_counts_only_for_its_producer_and_request() -> None:
    """Believing a forged claim about a stock producer would make the decoder free blocks that
    producer may still WRITE: under a key only the producer's own sealed claim counts."""
    key = FrameAuth([bytes(range(32))])
    params = {"remote_engine_id": "P", "remote_request_id": "r1"}
    claim = producer_claim(key, "P", "r1")
    assert verify_producer_claim(key, params, claim)
    rotated = FrameAuth([bytes(range(1, 33)), bytes(range(32))])  # a rotation: the old key still opens
    assert verify_producer_claim(rotated, params, claim)
    assert not verify_producer_claim(key, params, {"v": PROTOCOL_VERSION})  # unsealed
    assert not verify_producer_claim(key, {**params, "remote_request_id": "r2"}, claim)  # moved
    assert not verify_producer_claim(key, {**params, "remote_engine_id": "P2"}, claim)  # another producer
    assert not verify_producer_claim(FrameAuth([bytes(32)]), params, claim)  # another key
    assert not verify_producer_claim(key, params, {**claim, "tag": "zz"})
    assert not verify_producer_claim(key, params, {**claim, "tag": 7})
    assert not verify_producer_claim(key, {"remote_engine_id": "P"}, claim)  # no request named


def test_idle_says_whether_the_drivers_next_step_has_anything_from_the_transport() -> None:
    """The connector's quiet step skips the driver's step only while `idle()`: a fed frame, a
    hello (a handshake event) and a completed READ each make it false until the driver takes
    them."""
    agent = Agent()
    t = ConnectorTransport(agent, "P", 0, {}, lambda e: None)
    assert t.idle()
    t.feed("agent-d0", b"\x92frame")
    assert not t.idle()
    t.receive()
    assert t.idle()
    t.feed("agent-d0", hello())
    assert not t.idle()
    (req,) = t.poll_handshakes()
    assert isinstance(req, HandshakeRequest) and t.idle()
    t.reject_handshake(req.token)
    d = ConnectorTransport(Agent(), "D", 0, {}, lambda e: None)
    d.expect("r1")
    h = d.start_read("P", 0, "kv", None, b"done")
    d.expect(None)
    assert d.idle()  # vLLM's READ in flight: the driver polls nothing of it until it completes
    assert d.complete("r1", ok=True)
    assert not d.idle()
    assert d.poll_transfers() == [TransferResult(h, True)]
    assert d.idle()


class SlowAgent(Agent):
    """An agent whose calls block (a NIXL call stuck in a connection, say)."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def send_notif(self, name: object, notif_msg: bytes = b"") -> None:
        time.sleep(self.delay)
        super().send_notif(name, notif_msg)

    def add_remote_agent(self, md: bytes) -> bytes:
        time.sleep(self.delay)
        return super().add_remote_agent(md)


def test_a_slow_agent_call_is_logged_naming_the_call_and_the_peer(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Each call runs under the worker's lease lock, which the engine's step also takes: one that
    blocks is said at WARNING (the call and its peer), and a quick one is not."""
    monkeypatch.setattr(transport_module, "SLOW_CALL_NS", 20_000_000)
    agent = SlowAgent(0.0)
    t = ConnectorTransport(agent, "P", 0, {}, lambda e: None)
    t.feed("agent-d0", hello())
    (req,) = t.poll_handshakes()
    assert isinstance(req, HandshakeRequest)
    with caplog.at_level(logging.WARNING, logger="kvlease.adapters.vllm"):
        t.answer_handshake(req.token, b"REPLY")
        assert not [r for r in caplog.records if "took" in r.getMessage()]
        agent.delay = 0.05
        t.send("D", 0, b"ack")
    slow = [r.getMessage() for r in caplog.records if "took" in r.getMessage()]
    assert len(slow) == 1 and slow[0].startswith("kvlease: send_notif (agent-d0) took "), slow
    caplog.clear()
    t.feed("agent-d1", hello(rank=1, md=b"d1"))
    (req,) = t.poll_handshakes()
    assert isinstance(req, HandshakeRequest)
    with caplog.at_level(logging.WARNING, logger="kvlease.adapters.vllm"):
        t.answer_handshake(req.token, b"REPLY")
    slow = [r.getMessage() for r in caplog.records if "took" in r.getMessage()]
    assert [m.split(" took ")[0] for m in slow] == [
        "kvlease: loading a kvlease accessor's agent (D)",
        "kvlease: send_notif (agent-d1)",
    ], slow
