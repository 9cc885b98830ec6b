"""Two-process tests of the NIXL transport: real processes, real NIXL notifications and real
READ/WRITE transfers of registered torch tensors over UCX on loopback (UCX_NET_DEVICES=lo).

Each peer is this file run as a script (``python tests/test_nixl.py pinner|accessor``): a
`Driver` over a `NixlTransport` (from the harness's transport factory), stepped every
millisecond in the harness's worker loop, taking JSON-line commands on stdin and printing
JSON-line events (with ``time.monotonic()``, which is system-wide on Linux, so the test can
compare instants across processes) on stdout; the test side is the harness's `ChildProcess`
(``kvlease/cli/_child.py``), so a crashed peer fails its test at once. Lease: 3 s (heartbeat every 0.5 s,
extension 2 s).
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvlease.cli._child import ChildProcess

LEASE = 3.0
ACCESS_TIME = 0.25  # max_access_time: push guard and the window a WRITE needs
#: Scheduling slack for "one step" on a loaded 2-core machine (the loop steps every 1 ms).
STEP_SLACK = 0.4
HERE = os.path.abspath(__file__)


# ------------------------------------------------------------------------------------------
# the peer process
# ------------------------------------------------------------------------------------------


def _peer_main(role: str) -> None:  # pragma: no cover - runs in a child process
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    import torch
    from kvlease.transports._base import (
        PeerDead,
        PeerSuspect,
        TransferFailed,
    )
    from kvlease.transports._driver import Driver, new_session

    from kvlease import (
        AccessCompleted,
        Accessor,
        AccessStale,
        Free,
        LeaseConfig,
        LeaseLost,
        LeaseTicket,
        Pinner,
        Rejected,
    )
    from kvlease.cli._child import Commands, emit, make_transport, serve

    config = LeaseConfig(kv_lease_duration=LEASE, max_access_time=ACCESS_TIME)
    engine_id = f"{role}-engine"
    incarnation = int.from_bytes(os.urandom(8), "big")
    transport = make_transport("nixl", engine_id, 0, incarnation=incarnation)
    if role == "pinner":
        driver = Driver(transport, pinner=Pinner(config, engine_id, incarnation), engine_ttl=LEASE)
    else:
        driver = Driver(transport, accessor=Accessor(config, engine_id, session=new_session()), engine_ttl=LEASE)
    tensors: dict[str, Any] = {}
    buffers: dict[str, Any] = {}

    def sha(t: Any) -> str:
        return hashlib.sha256(t.numpy().tobytes()).hexdigest()

    def pattern(nbytes: int, seed: int) -> Any:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)

    def command(c: dict[str, Any]) -> bool:
        cmd = c["cmd"]
        if cmd == "region":
            t = pattern(c["nbytes"], c["seed"])
            tensors[c["name"]] = t
            transport.register(c["name"], t)
            emit("region", name=c["name"], sha=sha(t))
        elif cmd == "fill":  # the engine reuses the memory for another request
            tensors[c["name"]].copy_(pattern(tensors[c["name"]].numel(), c["seed"]))
            emit("filled", name=c["name"], sha=sha(tensors[c["name"]]))
        elif cmd == "sha":
            emit("sha", name=c["name"], sha=sha(tensors[c["name"]]))
        elif cmd == "grant":
            ticket = driver.grant(c["key"], nbytes=c.get("nbytes", 0), push=c.get("push", False))
            emit("ticket", key=c["key"], ticket=ticket.to_dict(), address=transport.address)
        elif cmd == "track":
            driver.track(c["key"], LeaseTicket.from_dict(c["ticket"]), address=c["address"], push=c.get("push", False))
            emit("tracked", key=c["key"])
        elif cmd == "valid":
            assert driver.accessor is not None
            v = driver.accessor.valid_until(c["key"])
            emit("valid", key=c["key"], left=None if v is None else v - driver.now())
        elif cmd in ("read", "write"):
            if cmd == "read":
                buf = buffers[c["key"]] = torch.zeros(c["nbytes"], dtype=torch.uint8)
                d = driver.read(c["key"], c["region"], buf)
            else:
                buf = buffers[c["key"]] = pattern(c["nbytes"], c["seed"])
                d = driver.write(c["key"], c["region"], buf)
            emit("decision", key=c["key"], allowed=d.allowed, guaranteed=d.guaranteed, reason=d.reason)
        elif cmd == "hb_count":
            emit("hb_count", n=driver.stats.heartbeats_received)
        elif cmd == "exit":
            return False
        return True

    emit("ready", address=transport.address)
    hb_seen = 0

    def step() -> bool:
        nonlocal hb_seen
        for ev in driver.step():
            match ev:
                case Free():
                    emit("free", key=ev.key, reason=ev.reason.value)
                case LeaseLost():
                    emit("lost", key=ev.key, reason=ev.reason.value)
                case AccessCompleted():
                    emit("completed", key=ev.key, sha=sha(buffers[ev.key]), confirmed=ev.confirmed_by_pinner)
                case AccessStale():
                    emit("stale", key=ev.key, reason=ev.reason)
                case TransferFailed():
                    emit("transfer_failed", key=ev.key, reason=ev.reason)
                case PeerSuspect() | PeerDead() | Rejected():
                    emit(type(ev).__name__, engine_id=ev.engine_id)
        if driver.stats.heartbeats_received != hb_seen:
            hb_seen = driver.stats.heartbeats_received
            emit("hb", n=hb_seen)
        transport.wait(0.001)
        return True

    serve(Commands(), command, step)
    transport.close()
    emit("bye")


# ------------------------------------------------------------------------------------------
# the test side
# ------------------------------------------------------------------------------------------


class Peer(ChildProcess):
    """A peer process (the harness's `ChildProcess`): send commands, wait for events. `wait`
    takes an event: a second wait for the same kind returns the next one."""

    def __init__(self, role: str) -> None:
        self.role = role
        self._taken: set[int] = set()
        super().__init__(
            [sys.executable, HERE, role], name=role, env=dict(os.environ, UCX_NET_DEVICES="lo", PYTHONUNBUFFERED="1")
        )
        self.address = self.ready["address"]

    def wait(
        self, ev: str, timeout: float = 10.0, match: Callable[[dict[str, Any]], bool] | None = None
    ) -> dict[str, Any]:
        def untaken(e: dict[str, Any]) -> bool:
            return e["ev"] == ev and id(e) not in self._taken and (match is None or match(e))

        found = self.wait_for(untaken, timeout)
        self._taken.add(id(found))
        return found

    def seen(self, ev: str, key: str | None = None) -> list[dict[str, Any]]:
        return self.find(lambda e: e["ev"] == ev and (key is None or e.get("key") == key))

    def kill(self, sig: int = signal.SIGKILL) -> float:
        return super().kill(sig)

    def close(self, exit_command: dict[str, Any] | None = None, grace: float = 0.0) -> None:
        super().close(exit_command, grace)


def _key_is(key: str) -> Callable[[dict[str, Any]], bool]:
    return lambda e: bool(e.get("key") == key)


@pytest.fixture(scope="module", autouse=True)
def _needs_nixl() -> None:
    pytest.importorskip("nixl._api", reason="NIXL is not installed (pip install kvlease[nixl])")
    pytest.importorskip("torch")


@pytest.fixture()
def pair() -> Iterator[tuple[Peer, Peer]]:
    pinner = Peer("pinner")
    accessor = Peer("accessor")
    try:
        yield pinner, accessor
    finally:
        accessor.close()
        pinner.close()


def _lease(pinner: Peer, accessor: Peer, key: str, region: str, nbytes: int, seed: int, push: bool = False) -> str:
    """Register a region, grant a lease on it, track it on the accessor, wait until the lease
    is acknowledged (the accessor holds a validity window). Returns the region's sha."""
    pinner.send(cmd="region", name=region, nbytes=nbytes, seed=seed)
    sha = pinner.wait("region", match=lambda e: e["name"] == region)["sha"]
    pinner.send(cmd="grant", key=key, nbytes=nbytes, push=push)
    t = pinner.wait("ticket", match=lambda e: e["key"] == key)
    accessor.send(cmd="track", key=key, ticket=t["ticket"], address=t["address"], push=push)
    accessor.wait("tracked", match=lambda e: e["key"] == key)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        accessor.send(cmd="valid", key=key)
        left = accessor.wait("valid", match=lambda e: e["key"] == key)["left"]
        if left is not None and left > ACCESS_TIME * 2:
            return str(sha)
        time.sleep(0.05)
    raise AssertionError(f"lease {key} never became valid on the accessor")


def test_pull_and_push_happy_path(pair: tuple[Peer, Peer]) -> None:
    pinner, accessor = pair
    nbytes = 1 << 20
    sha = _lease(pinner, accessor, "pull-1", "kv-pull-1", nbytes, seed=1)
    accessor.send(cmd="read", key="pull-1", region="kv-pull-1", nbytes=nbytes)
    assert accessor.wait("decision")["allowed"]
    done = accessor.wait("completed", match=lambda e: e["key"] == "pull-1")
    assert done["sha"] == sha, "the bytes read over NIXL differ from the pinner's tensor"
    free = pinner.wait("free", match=lambda e: e["key"] == "pull-1")
    assert free["reason"] == "access_done"

    # Push: the accessor WRITEs into the pinner's registered tensor.
    _lease(pinner, accessor, "push-1", "kv-push-1", nbytes, seed=2, push=True)
    accessor.send(cmd="write", key="push-1", region="kv-push-1", nbytes=nbytes, seed=99)
    d = accessor.wait("decision", match=lambda e: e["key"] == "push-1")
    assert d["allowed"] and d["guaranteed"], d
    accessor.wait("completed", match=lambda e: e["key"] == "push-1")
    free = pinner.wait("free", match=lambda e: e["key"] == "push-1")
    assert free["reason"] == "access_done"
    pinner.send(cmd="sha", name="kv-push-1")
    pushed = pinner.wait("sha")["sha"]
    pinner.send(cmd="region", name="expect-99", nbytes=nbytes, seed=99)
    assert pushed == pinner.wait("region", match=lambda e: e["name"] == "expect-99")["sha"]


def test_overload_holds_leases_for_three_lease_durations(pair: tuple[Peer, Peer]) -> None:
    pinner, accessor = pair
    nbytes = 256 << 10
    sha = _lease(pinner, accessor, "slow-pull", "r-pull", nbytes, seed=3)
    _lease(pinner, accessor, "slow-push", "r-push", nbytes, seed=4, push=True)
    held_from = time.monotonic()
    time.sleep(3 * LEASE + 0.3)  # unscheduled on the accessor; the driver keeps heartbeating
    assert pinner.seen("free") == [], "the pinner freed a lease its live accessor was renewing"
    assert accessor.seen("lost") == []
    assert len(pinner.seen("hb")) >= int(3 * LEASE / (LEASE / 6)) - 2
    accessor.send(cmd="read", key="slow-pull", region="r-pull", nbytes=nbytes)
    assert accessor.wait("completed", match=lambda e: e["key"] == "slow-pull")["sha"] == sha
    accessor.send(cmd="write", key="slow-push", region="r-push", nbytes=nbytes, seed=5)
    accessor.wait("completed", match=lambda e: e["key"] == "slow-push")
    for key in ("slow-pull", "slow-push"):
        assert pinner.wait("free", match=_key_is(key))["reason"] == "access_done"
    print(f"\nheld {time.monotonic() - held_from:.1f} s (>= 3 x {LEASE} s lease) with nothing freed")


def test_accessor_crash_frees_within_bound(pair: tuple[Peer, Peer]) -> None:
    pinner, accessor = pair
    _lease(pinner, accessor, "c-pull", "r-c-pull", 4096, seed=6)
    _lease(pinner, accessor, "c-push", "r-c-push", 4096, seed=7, push=True)
    # Past the initial grant (duration > extension), so expiry is set by heartbeats alone.
    time.sleep(LEASE - LEASE * 2 / 3 + 0.2)
    pinner.wait("hb", timeout=5)
    killed = accessor.kill(signal.SIGKILL)
    accessor.proc.wait(timeout=10)
    extension, interval = LEASE * 2 / 3, LEASE / 6
    push_guard = ACCESS_TIME * (1 + 1e-4)
    for key, guard in (("c-pull", 0.0), ("c-push", push_guard)):
        free = pinner.wait("free", timeout=10, match=_key_is(key))
        assert free["reason"] == "expired"
        last_hb = max(e["t"] for e in pinner.seen("hb") if e["t"] <= killed + 0.1)
        since_hb = free["t"] - last_hb
        bound = extension + interval + guard + STEP_SLACK
        print(
            f"\n{key}: freed {since_hb:.3f} s after the last heartbeat, {free['t'] - killed:.3f} s after "
            f"SIGKILL; bound extension+interval{'+push guard' if guard else ''}+step = {bound:.3f} s"
        )
        assert extension - 0.05 <= since_hb <= bound
        assert free["t"] - killed <= bound


def test_pinner_crash_accessor_reports_lost(pair: tuple[Peer, Peer]) -> None:
    pinner, accessor = pair
    _lease(pinner, accessor, "p-pull", "r-p-pull", 4096, seed=8)
    _lease(pinner, accessor, "p-push", "r-p-push", 4096, seed=9, push=True)
    killed = pinner.kill(signal.SIGKILL)
    pinner.proc.wait(timeout=10)
    for key in ("p-pull", "p-push"):
        lost = accessor.wait("lost", timeout=2 * LEASE, match=_key_is(key))
        print(f"\n{key}: accessor reported lost ({lost['reason']}) {lost['t'] - killed:.3f} s after the pinner died")
        # Given up one lease duration after the last acknowledged heartbeat was sent.
        assert lost["t"] - killed <= LEASE + STEP_SLACK
    # The accessor is still responsive and refuses to read from the dead pinner.
    accessor.send(cmd="read", key="p-pull", region="r-p-pull", nbytes=4096)
    assert not accessor.wait("decision", timeout=5)["allowed"]
    accessor.send(cmd="valid", key="p-pull")
    accessor.wait("valid", timeout=5)
    # The pinner comes back (same engine id; new incarnation, agent, metadata and address):
    # the accessor re-handshakes, replaces the remote agent, and reads from it.
    restarted = Peer("pinner")
    try:
        sha = _lease(restarted, accessor, "after-restart", "r-new", 8192, seed=13)
        accessor.send(cmd="read", key="after-restart", region="r-new", nbytes=8192)
        assert accessor.wait("completed", match=lambda e: e["key"] == "after-restart")["sha"] == sha
        assert restarted.wait("free", match=lambda e: e["key"] == "after-restart")["reason"] == "access_done"
    finally:
        restarted.close()


@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
def test_late_access_after_expiry_is_never_reported_valid(pair: tuple[Peer, Peer], push: bool) -> None:
    pinner, accessor = pair
    nbytes = 64 << 10
    _lease(pinner, accessor, "late", "r-late", nbytes, seed=10, push=push)
    # Freeze the accessor (no heartbeats, no steps) past the lease: the pinner frees the
    # memory and the engine reuses it for another request.
    accessor.kill(signal.SIGSTOP)
    free = pinner.wait("free", timeout=3 * LEASE, match=lambda e: e["key"] == "late")
    assert free["reason"] == "expired"
    pinner.send(cmd="fill", name="r-late", seed=11)
    reused = pinner.wait("filled")["sha"]
    # The access is queued before the accessor wakes, so it is attempted at once.
    if push:
        accessor.send(cmd="write", key="late", region="r-late", nbytes=nbytes, seed=12)
    else:
        accessor.send(cmd="read", key="late", region="r-late", nbytes=nbytes)
    accessor.kill(signal.SIGCONT)
    d = accessor.wait("decision", timeout=10)
    if d["allowed"]:
        outcome = accessor.wait("stale", timeout=10, match=lambda e: e["key"] == "late")
        print(f"\nlate access ran and was reported stale: {outcome['reason']}")
    else:
        accessor.wait("lost", timeout=10, match=lambda e: e["key"] == "late")
        print(f"\nlate access refused: {d['reason']}")
    time.sleep(0.3)
    assert accessor.seen("completed", "late") == [], "a stale access was reported valid"
    if push:
        pinner.send(cmd="sha", name="r-late")
        assert pinner.wait("sha")["sha"] == reused, "a late WRITE landed in freed memory"


if __name__ == "__main__":
    _peer_main(sys.argv[1])
