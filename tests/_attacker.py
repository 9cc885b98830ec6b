"""An attacker as a real OS process, for tests/test_attacker.py: it knows the engine ids, the
addresses and the id scheme of a deployment, but not its key.

Run as a script (``python tests/_attacker.py CONFIG_JSON``; config: ``transport``, ``zmq`` or
``nixl``), it takes JSON-line commands on stdin and prints JSON-line events on stdout, like the
agents of `_proc_helpers` (the `Agent` class there drives it: ``Agent(config, script=
"_attacker.py")``). It never reads a key: nothing in this module loads one, and the forgeries it
builds are unsealed or sealed with a key it draws at random. Sealed frames reach it only as
*captured* bytes (``replay``), which it sends unchanged.

How it reaches the engines, as any process on the host can:

- ZMQ: one raw DEALER per target with its own routing identity ``X\\0 0`` (never an engine's:
  taking over D's identity is a transport-level denial of service outside this claim), sending
  ``[b"M", frame]`` to the target's ROUTER, and the side-channel handshake ``[b"H", handshake]``
  to P's, whose answer is ``[b"h", reply, metadata]``.
- NIXL: its own NIXL agent, a `NixlTransport` with engine id ``X``; it fetches each target's
  agent metadata over the target's side channel with a ``hello`` (what the transport does to fetch
  a layout; the target installs X's agent in return), then pushes raw frames as notifications.

Commands (``op``):

- ``connect`` ``targets`` {name: address}: reach each target; ``connected``.
- ``handshake`` ``to``, ``data`` (hex of a frame), ``wait`` (seconds): the side-channel handshake;
  ``handshake_reply`` with the reply's hex (None if none came) and, when the reply is an unsealed
  `HandshakeReply`, the ``incarnation`` it disclosed (kept for ``forge``).
- ``forge`` (see `_forgeries`): build forged frames afresh every round (new seqs and times) and
  send them; ``replay``: send given frames unchanged. Both take ``name``, ``to``, ``rounds``,
  ``interval`` and run in the background; ``done`` (with ``name``, ``sent``, ``failed``) after
  the last round.
- ``stop`` ``name``; ``exit``.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import sys
import threading
import time
from typing import Any

ATTACKER_ENGINE = "X"


def _emit(ev: str, **fields: Any) -> None:
    fields["ev"] = ev
    fields.setdefault("t", time.monotonic())
    sys.stdout.write(json.dumps(fields, default=str) + "\n")
    sys.stdout.flush()


def _forgeries(plan: dict[str, Any], rnd: int, incarnation: int) -> list[bytes]:
    """One round of forged frames, without the key.

    To a pinner (``kinds`` among access_done, release, heartbeat): for every claimed sender
    engine in ``engines`` and session in ``sessions``, an AccessDone for every id in ``ids``
    (``ranks=1``, so the pinner derives expected=1; confirm on every other one), one Release of
    all ids and one Heartbeat of all ids with a seq far above any real one. To an accessor
    (``kinds`` among heartbeat_ack, handshake_reply, access_done_ack): claiming to be ``pinner``,
    addressed to every session in ``sessions``, a HeartbeatAck saying every id ``expired`` (for
    every seq in ``seqs``), a HandshakeReply announcing a new incarnation, an AccessDoneAck with
    a STALE verdict for every id. Every message goes out as each of ``seals``: ``none``
    (unsealed) and ``wrong`` (sealed with a random key)."""
    from kvlease import (
        AccessDone,
        AccessDoneAck,
        AccessOutcome,
        FrameAuth,
        HandshakeReply,
        Heartbeat,
        HeartbeatAck,
        LocalTime,
        PeerTime,
        Release,
        encode,
    )

    ids = tuple(plan["ids"])
    now = time.monotonic()
    msgs: list[Any] = []
    kinds = plan["kinds"]
    for session in plan["sessions"]:
        for engine in plan.get("engines", ()):
            if "access_done" in kinds:
                for i in ids:
                    msgs.append(
                        AccessDone(engine, 0, 1, session, incarnation, 0, i, rnd + 1, i % 2 == 0, LocalTime(now))
                    )
            if "release" in kinds:
                msgs.append(Release(engine, 0, 1, session, incarnation, ids))
            if "heartbeat" in kinds:
                seq = int(plan.get("seq_base", 1 << 40)) + rnd
                msgs.append(Heartbeat(engine, 0, 1, session, incarnation, seq, LocalTime(now), ids))
        pinner = plan.get("pinner")
        if pinner is None:
            continue
        if "heartbeat_ack" in kinds:
            for seq in plan.get("seqs", range(1, 6)):
                msgs.append(
                    HeartbeatAck(
                        pinner,
                        0,
                        incarnation,
                        0,
                        session,
                        seq,
                        LocalTime(now - 0.01),
                        PeerTime(now),
                        86400.0,
                        0,
                        expired=ids,
                    )
                )
        if "handshake_reply" in kinds:
            msgs.append(
                HandshakeReply(
                    pinner,
                    0,
                    1,
                    random.getrandbits(63),
                    2,
                    7,
                    1024,
                    86400.0,
                    0.0,
                    1e-3,
                    0,
                    session,
                    1,
                    LocalTime(now - 0.01),
                    PeerTime(now),
                    PeerTime(now),
                )
            )
        if "access_done_ack" in kinds:
            for i in ids:
                msgs.append(AccessDoneAck(pinner, 0, incarnation, 0, session, i, 1, AccessOutcome.STALE))
    frames: list[bytes] = []
    wrong = FrameAuth([os.urandom(32)])  # not the deployment's key: the attacker has none
    for msg in msgs:
        for seal in plan.get("seals", ("none",)):
            data = encode(msg)
            frames.append(data if seal == "none" else wrong.seal(data))
    return frames


class _Zmq:
    def __init__(self) -> None:
        import zmq

        self.zmq = zmq
        self.ctx = zmq.Context()
        self.socks: dict[str, Any] = {}

    def connect(self, name: str, address: str) -> None:
        sock = self.ctx.socket(self.zmq.DEALER)
        sock.setsockopt(self.zmq.LINGER, 0)
        sock.setsockopt(self.zmq.IDENTITY, ATTACKER_ENGINE.encode() + b"\x000")  # its own identity
        sock.connect(address)
        self.socks[name] = sock

    def send(self, name: str, data: bytes) -> None:
        self.socks[name].send_multipart([b"M", data], flags=self.zmq.NOBLOCK)

    def handshake(self, name: str, data: bytes, timeout: float) -> bytes | None:
        sock = self.socks[name]
        sock.send_multipart([b"H", data])
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if sock.poll(int(left * 1000) + 1):
                frames = sock.recv_multipart()
                if frames[0] == b"h" and len(frames) == 3:
                    return bytes(frames[1])
        return None

    def progress(self) -> None:
        for sock in self.socks.values():  # nothing is meant for us: drain and drop
            with contextlib.suppress(self.zmq.Again):
                while True:
                    sock.recv_multipart(flags=self.zmq.NOBLOCK)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


class _Nixl:
    def __init__(self) -> None:
        from kvlease.transports.nixl import NixlTransport

        self.t = NixlTransport(ATTACKER_ENGINE, 0)
        self.engines: dict[str, str] = {}  # target name -> the engine id its side channel gave
        self.addresses: dict[str, str] = {}

    def connect(self, name: str, address: str) -> None:
        from kvlease.transports.nixl import parse_address, side_request

        reply = side_request(parse_address(address), self.t._hello("hello"), 10.0)
        self.t._install(reply)  # its agent metadata: we can notify it (and it installed ours)
        self.engines[name] = str(reply["engine_id"])
        self.addresses[name] = address

    def send(self, name: str, data: bytes) -> None:
        self.t.send(self.engines[name], 0, data)

    def handshake(self, name: str, data: bytes, timeout: float) -> bytes | None:
        from kvlease.transports.nixl import parse_address, side_request

        try:
            reply = side_request(parse_address(self.addresses[name]), self.t._hello("handshake", data), timeout)
        except OSError:  # unanswered (e.g. refused by a keyed pinner): timed out
            return None
        return bytes(reply["reply"])

    def progress(self) -> None:
        self.t.receive()  # layout announcements of the targets
        self.t.progress()

    def close(self) -> None:
        self.t.close()


def _main(config: dict[str, Any]) -> None:  # pragma: no cover - runs in the child
    from kvlease import DecodeError, HandshakeReply, decode

    net: _Zmq | _Nixl = _Nixl() if config.get("transport") == "nixl" else _Zmq()
    commands: queue.Queue[dict[str, Any] | None] = queue.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            with contextlib.suppress(ValueError):
                commands.put(json.loads(line))
        commands.put(None)

    threading.Thread(target=read_stdin, daemon=True).start()
    jobs: dict[str, dict[str, Any]] = {}
    learned: dict[str, int] = {}  # what a handshake disclosed
    _emit("ready", address=None, pid=os.getpid())

    def run(cmd: dict[str, Any]) -> bool:
        op, rid = cmd.get("op"), cmd.get("rid")
        try:
            if op == "exit":
                return False
            if op == "connect":
                for name, address in cmd["targets"].items():
                    net.connect(name, address)
                _emit("connected", rid=rid)
            elif op == "handshake":
                reply = net.handshake(cmd["to"], bytes.fromhex(cmd["data"]), float(cmd.get("wait", 3.0)))
                incarnation = None
                if reply is not None:
                    with contextlib.suppress(DecodeError):
                        msg = decode(reply)
                        if isinstance(msg, HandshakeReply):
                            incarnation = learned["incarnation"] = msg.incarnation
                _emit("handshake_reply", rid=rid, data=None if reply is None else reply.hex(), incarnation=incarnation)
            elif op in ("forge", "replay"):
                job = dict(cmd, next=time.monotonic(), round=0, sent=0, failed=0)
                if op == "forge":
                    inc = cmd.get("incarnation", "learned")
                    job["incarnation"] = learned["incarnation"] if inc == "learned" else int(inc)
                else:
                    job["bytes"] = [bytes.fromhex(h) for h in cmd["frames"]]
                jobs[cmd["name"]] = job
                _emit("started", rid=rid, name=cmd["name"])
            elif op == "stop":
                stopped = jobs.pop(cmd["name"], None)
                if stopped is not None:
                    _emit("done", name=cmd["name"], sent=stopped["sent"], failed=stopped["failed"], stopped=True)
                _emit("stopped", rid=rid)
            else:
                _emit("error", rid=rid, error=f"unknown op {op!r}")
        except Exception as exc:
            _emit("error", rid=rid, error=f"{type(exc).__name__}: {exc}")
        return True

    def run_jobs() -> None:
        now = time.monotonic()
        for name, job in list(jobs.items()):
            if now < job["next"]:
                continue
            frames = _forgeries(job, job["round"], job["incarnation"]) if job["op"] == "forge" else job["bytes"]
            for data in frames:
                try:
                    net.send(job["to"], data)
                    job["sent"] += 1
                except Exception:
                    job["failed"] += 1
                net.progress()
            job["round"] += 1
            job["next"] = now + float(job.get("interval", 0.1))
            if job["round"] >= int(job.get("rounds", 1)):
                del jobs[name]
                _emit("done", name=name, sent=job["sent"], failed=job["failed"])

    running = True
    while running:
        while True:
            try:
                cmd = commands.get_nowait()
            except queue.Empty:
                break
            if cmd is None or not run(cmd):
                running = False
                break
        run_jobs()
        net.progress()
        time.sleep(0.001)
    net.close()


if __name__ == "__main__":
    _main(json.loads(sys.argv[1]))
