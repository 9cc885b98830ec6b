"""Real OS processes for the transport tests: an *agent* script and its controller.

Run as a script (``python tests/_proc_helpers.py CONFIG_JSON``), this module is an engine
worker in miniature: a `Driver` over the transport the config names (built by the harness's
factory, `kvlease.transports._child.make_transport`: ZMQ or NIXL), with a `Pinner`, an
`Accessor` or both, stepped from the harness's worker loop (`serve`) exactly as an engine's
forward loop would. It takes JSON-line commands on stdin and prints JSON-line events on stdout
(the harness's protocol: see `kvlease.transports._child`).

Imported, `Agent` (a `ChildProcess` of the harness) spawns such a process (optionally inside a
network namespace) and waits for its events; a crashed agent fails the wait at once.

Config: ``engine_id``, ``role`` (pinner/accessor/both), ``rank``/``ranks`` (a worker of a
tensor-parallel engine; pinner workers of one engine share ``incarnation``), ``bind``, ``lease``
(LeaseConfig fields; ``"auth_keys": ["env:KVLEASE_TEST_KEY"]`` with the key in the child's
environment turns authentication on), ``driver`` (Driver keyword arguments), ``tensor`` (torch
buffers), ``transport`` (``zmq``, the default, or ``nixl``: a `NixlTransport` on loopback, whose
address is its side channel), ``capture`` (emit a ``wire`` event with the hex of every frame the
driver hands the transport, including the access-done attached to a transfer: what an observer
on the wire would capture). The ``ready`` event carries the accessor's ``session`` and the
pinner's ``incarnation``.

Commands (``op``): grant, refill, release, peek, workers (pinner); connect, track, untrack, read
(``parts``: one buffer per pinner rank), write (accessor); pause (stop stepping for a while, then
run ``then`` commands before the next step, which is how a test freezes an accessor's
heartbeats); stats; exit.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvlease.cli._child import (
    ChildProcess,
    Commands,
    emit,
    make_transport,
    serve,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable

#: A short lease for tests: heartbeat every 0.5 s, each extending by 2 s.
TEST_LEASE: dict[str, Any] = {"kv_lease_duration": 3.0, "max_access_time": 0.2}


# -- controller side ---------------------------------------------------------------------------


class Agent(ChildProcess):
    """A spawned agent process (this file, or `script` beside it, run with `config`)."""

    def __init__(
        self,
        config: dict[str, Any],
        *,
        netns: str | None = None,
        env: dict[str, str] | None = None,
        script: str = "_proc_helpers.py",
    ) -> None:
        cmd = [PYTHON, "-u", os.path.join(REPO, "tests", script), json.dumps(config)]
        if netns is not None:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        super().__init__(cmd, name=str(config.get("engine_id", "agent")), env={**os.environ, **(env or {})})
        self.address: str = self.ready["address"]

    def close(self, exit_command: dict[str, Any] | None = None, grace: float = 3.0) -> None:
        super().close({"op": "exit"} if exit_command is None else exit_command, grace)


def spawn_pair(
    lease: dict[str, Any] | None = None,
    *,
    tensor: bool = False,
    pinner_bind: str = "tcp://127.0.0.1:0",
    accessor_bind: str = "tcp://127.0.0.1:0",
    netns: Sequence[str | None] = (None, None),
    transport: str = "zmq",
    capture: bool = False,
    env: dict[str, str] | None = None,
) -> tuple[Agent, Agent]:
    """A pinner engine "P" and an accessor engine "D", as two real processes."""
    lease = dict(TEST_LEASE if lease is None else lease)
    extra = {"transport": transport, "capture": capture}
    p = Agent(
        {"engine_id": "P", "role": "pinner", "bind": pinner_bind, "lease": lease, "tensor": tensor, **extra},
        netns=netns[0],
        env=env,
    )
    try:
        d = Agent(
            {"engine_id": "D", "role": "accessor", "bind": accessor_bind, "lease": lease, "tensor": tensor, **extra},
            netns=netns[1],
            env=env,
        )
    except BaseException:
        p.close()
        raise
    return p, d


# -- agent side ----------------------------------------------------------------------------------


_emit = emit


def _capture(transport: Any) -> None:  # pragma: no cover - runs in the child
    """Emit every frame the driver hands `transport` (after it was handed over)."""
    send, start_read, start_write = transport.send, transport.start_read, transport.start_write

    def captured_send(engine_id: str, rank: int | None, data: bytes) -> None:
        send(engine_id, rank, data)
        _emit("wire", to=engine_id, rank=rank, data=bytes(data).hex())

    def captured(start: Callable[..., int]) -> Callable[..., int]:
        def start_transfer(engine_id: str, rank: int, region: str, buf: object, notif: bytes | None) -> int:
            handle = start(engine_id, rank, region, buf, notif)
            if notif:
                _emit("wire", to=engine_id, rank=rank, data=bytes(notif).hex())
            return handle

        return start_transfer

    transport.send = captured_send
    transport.start_read = captured(start_read)
    transport.start_write = captured(start_write)


def _agent(config: dict[str, Any]) -> None:  # pragma: no cover - runs in the child
    import random

    import attrs
    from kvlease.transports import Driver, new_session

    import kvlease

    lease_cfg = kvlease.LeaseConfig(**config.get("lease", {}))
    engine_id = config["engine_id"]
    role = config["role"]
    use_tensor = bool(config.get("tensor"))
    torch: Any = None
    if use_tensor:
        import torch as _torch

        torch = _torch
    rank, ranks = int(config.get("rank", 0)), int(config.get("ranks", 1))
    # The workers of one pinner engine share its incarnation (heterogeneous-TP tests pass it).
    incarnation = int(config.get("incarnation", random.getrandbits(63)))
    transport: Any = make_transport(
        config.get("transport", "zmq"),
        engine_id,
        rank,
        incarnation=incarnation,
        bind=config.get("bind", "tcp://127.0.0.1:0"),
    )
    if config.get("capture"):
        _capture(transport)
    pinner = None
    if role in ("pinner", "both"):
        pinner = kvlease.Pinner(lease_cfg, engine_id, incarnation, rank=rank, ranks=ranks)
    accessor = (
        kvlease.Accessor(lease_cfg, engine_id, session=new_session(), rank=rank, ranks=ranks)
        if role in ("accessor", "both")
        else None
    )
    driver = Driver(transport, pinner=pinner, accessor=accessor, **config.get("driver", {}))
    regions: dict[str, Any] = {}  # pinner: key -> buffer
    reads: dict[str, Any] = {}  # accessor: key -> destination buffer
    tickets: dict[str, int] = {}  # pinner: key -> lease id

    def new_buffer(size: int, fill: int) -> Any:
        if torch is not None:
            return torch.full((size,), fill, dtype=torch.uint8)
        return bytearray([fill]) * size

    def contents(buf: Any) -> list[int]:
        if isinstance(buf, dict):  # one buffer per pinner rank (heterogeneous TP)
            return sorted({v for b in buf.values() for v in contents(b)})
        raw = bytes(buf.numpy().tobytes()) if torch is not None else bytes(buf)
        return sorted(set(raw))

    commands = Commands()
    _emit(
        "ready",
        address=transport.address,
        session=None if accessor is None else accessor.session,
        incarnation=None if pinner is None else incarnation,
    )
    hb_seen = 0

    def run(cmd: dict[str, Any]) -> bool:
        op = cmd.get("op")
        rid = cmd.get("rid")
        try:
            if op == "exit":
                return False
            if op == "grant":
                key = cmd["key"]
                buf = regions.get(key)
                if buf is None:
                    buf = regions[key] = new_buffer(cmd["size"], cmd["fill"])
                    transport.register(key, buf)
                ticket = driver.grant(
                    key, nbytes=cmd["size"], push=cmd.get("push", False), lease_id=cmd.get("lease_id")
                )
                tickets[key] = ticket.lease_id
                _emit("ticket", rid=rid, key=key, ticket=ticket.to_dict(), address=transport.address)
            elif op == "refill":  # the engine reuses the region's memory for another request
                buf = regions[cmd["key"]]
                if torch is not None:
                    buf.fill_(cmd["fill"])
                else:
                    buf[:] = bytes([cmd["fill"]]) * len(buf)
                _emit("refilled", rid=rid, key=cmd["key"])
            elif op == "workers":  # every worker of this engine, by rank (rank 0 tells accessors)
                transport.worker_addresses = list(cmd["addresses"])
                _emit("workers", rid=rid)
            elif op == "peek":
                _emit("region", rid=rid, key=cmd["key"], values=contents(regions[cmd["key"]]))
            elif op == "release":
                driver.release(tickets[cmd["key"]])
                _emit("released", rid=rid)
            elif op == "connect":
                driver.connect(cmd["engine_id"], cmd["address"])
                _emit("connecting", rid=rid)
            elif op == "track":
                ticket = kvlease.LeaseTicket.from_dict(cmd["ticket"])
                driver.track(cmd["key"], ticket, address=cmd["address"], push=cmd.get("push", False))
                _emit("tracked", rid=rid, key=cmd["key"])
            elif op == "untrack":
                driver.untrack(cmd["key"])
                _emit("untracked", rid=rid, key=cmd["key"])
            elif op in ("read", "write"):
                key = cmd["key"]
                if op == "read":
                    if "parts" in cmd:  # pinner ranks to read from, one buffer each
                        buf = reads[key] = {r: new_buffer(cmd["size"], 0) for r in cmd["parts"]}
                    else:
                        buf = reads[key] = new_buffer(cmd["size"], 0)
                    decision = driver.read(key, cmd.get("region", key), buf)
                else:
                    buf = new_buffer(cmd["size"], cmd["fill"])
                    decision = driver.write(key, cmd.get("region", key), buf)
                _emit(
                    "access",
                    rid=rid,
                    key=key,
                    allowed=decision.allowed,
                    guaranteed=decision.guaranteed,
                    reason=decision.reason,
                )
            elif op == "pause":
                _emit("paused", rid=rid)
                time.sleep(cmd["seconds"])
                _emit("resumed", rid=rid)
                for then in cmd.get("then", []):
                    run(then)
            elif op == "stats":
                _emit("stats", rid=rid, stats=driver.stats.snapshot())
            else:
                _emit("error", rid=rid, error=f"unknown op {op!r}")
        except Exception as exc:
            _emit("error", rid=rid, error=f"{type(exc).__name__}: {exc}")
        return True

    def step() -> bool:
        nonlocal hb_seen
        for ev in driver.step():
            fields = attrs.asdict(ev, recurse=False)
            name = type(ev).__name__
            if name == "AccessCompleted" and fields["key"] in reads:
                fields["values"] = contents(reads.pop(fields["key"]))
            _emit(name, **{k: (v.value if hasattr(v, "value") else v) for k, v in fields.items()})
        n = driver.stats.heartbeats_received
        if n != hb_seen:
            hb_seen = n
            _emit("hb", count=n)
        transport.wait(0.002)
        return True

    serve(commands, run, step)
    driver.close()


if __name__ == "__main__":
    _agent(json.loads(sys.argv[1]))
