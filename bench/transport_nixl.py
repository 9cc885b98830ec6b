"""Benchmark of the NIXL transport on loopback: two real processes, real NIXL over UCX.

Prints one table, in one run:

- notification round trip (median, p99) of a small kvlease heartbeat frame, echoed by the peer;
- notifications per second one sender gets through to one receiver;
- READ of a 1 MiB and a 64 MiB registered tensor, raw (``NixlTransport.start_read`` polled to
  completion: NIXL and nothing else) and through kvlease (``Driver.read`` on a tracked, valid
  lease, stepped until the core reports ``AccessCompleted``: lease checks, the transfer, and
  the access-done notification on the path), interleaved rep by rep, as medians and a ratio.
  Target: kvlease adds < 1 % to the transfer time.

The peer is this file run with ``--serve echo`` or ``--serve pin``, on the child-process harness
(``kvlease/cli/_child.py``: its worker loop, transport factory and ``ChildProcess``). UCX stays on loopback
(``UCX_NET_DEVICES=lo``). A benchmark, not a test: it asserts nothing.
Run: ``.venv/bin/python bench/transport_nixl.py [--reps-1m 200 --reps-64m 20]``.
Run time: about 1 minute, mostly NIXL start-up (``--quick``: about 50 s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from kvlease.cli._child import ChildProcess, make_transport

os.environ.setdefault("UCX_NET_DEVICES", "lo")

LEASE = 30.0
SIZES = {"r1m": 1 << 20, "r64m": 64 << 20}


def serve_peer(role: str) -> None:
    """The peer process: `echo` bounces notifications; `pin` grants leases on two tensors."""
    import torch
    from kvlease.transports._base import HandshakeRequest  # type: ignore[import-not-found,unused-ignore]
    from kvlease.transports._driver import Driver  # type: ignore[import-not-found,unused-ignore]

    from kvlease import LeaseConfig, Pinner
    from kvlease.cli._child import Commands, emit, make_transport, serve

    tr = make_transport("nixl", f"bench-{role}")
    driver = None
    if role == "pin":
        pinner = Pinner(LeaseConfig(kv_lease_duration=LEASE), tr.engine_id, 7)
        driver = Driver(tr, pinner=pinner)
        for name, n in SIZES.items():
            tr.register(name, torch.randint(0, 256, (n,), dtype=torch.uint8))
    emit("ready", address=tr.address)
    count = 0

    def echo() -> bool:
        # Echo mode busy-polls (a peer's queue is drained at once): the round trip then
        # measures NIXL, not this loop's nap.
        nonlocal count
        for hev in tr.poll_handshakes():
            if isinstance(hev, HandshakeRequest):
                tr.answer_handshake(hev.token, hev.data)
        for m in tr.receive():
            if m.data == b"count?":
                tr.send(m.engine_id, m.rank, str(count).encode())
                count = 0
            elif m.data[:1] == b"f":  # flood: count only
                count += 1
            else:
                tr.send(m.engine_id, m.rank, m.data)
        tr.progress()
        return True

    def pin() -> bool:
        assert driver is not None
        driver.step()
        time.sleep(0.0005)
        return True

    def command(cmd: dict[str, Any]) -> bool:
        if cmd["cmd"] == "grant" and driver is not None:
            tickets = [
                driver.grant(f"{cmd['region']}-{cmd['base'] + i}", nbytes=SIZES[cmd["region"]]).to_dict()
                for i in range(cmd["n"])
            ]
            emit("tickets", tickets=tickets)
        return bool(cmd["cmd"] != "exit")

    serve(Commands(), command, echo if driver is None else pin)
    tr.close()


class Peer(ChildProcess):
    def __init__(self, role: str) -> None:
        super().__init__(
            [sys.executable, os.path.abspath(__file__), "--serve", role],
            name=f"bench-{role}",
            env=dict(os.environ, UCX_NET_DEVICES="lo"),
        )
        self.address = self.ready["address"]

    def read(self) -> dict[str, Any]:
        return self.next()

    def close(self, exit_command: dict[str, Any] | None = None, grace: float = 10.0) -> None:
        super().close({"cmd": "exit"} if exit_command is None else exit_command, grace)


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def bench_notifications(rtt_n: int, flood_n: int) -> dict[str, float]:
    from kvlease.transports._base import HandshakeResponse  # type: ignore[import-not-found,unused-ignore]

    from kvlease import Heartbeat, LocalTime, encode

    peer = Peer("echo")
    tr = make_transport("nixl", "bench-client")
    try:
        tr.request_handshake("bench-echo", peer.address, b"hello")
        while not any(isinstance(e, HandshakeResponse) for e in tr.poll_handshakes()):
            tr.progress()
            time.sleep(0.001)
        frame = encode(Heartbeat("bench-client", 0, 1, 1, 7, 1, LocalTime(0.0), tuple(range(1, 9))))
        rtts: list[float] = []
        for i in range(rtt_n + 50):
            t0 = time.perf_counter()
            tr.send("bench-echo", 0, frame)
            while not tr.receive():
                pass
            if i >= 50:  # warm-up
                rtts.append(time.perf_counter() - t0)
        flood = b"f" + frame
        t0 = time.perf_counter()
        for i in range(flood_n):
            tr.send("bench-echo", 0, flood)
            if i % 256 == 0:
                tr.receive()
        sent = time.perf_counter() - t0
        tr.send("bench-echo", 0, b"count?")
        got: list[Any] = []
        while not got:
            got = tr.receive()
        elapsed = time.perf_counter() - t0
        received = int(got[0].data)
        return {
            "rtt_median_us": statistics.median(rtts) * 1e6,
            "rtt_p99_us": _pct(rtts, 0.99) * 1e6,
            "msgs_per_s": received / elapsed,
            "send_us": sent / flood_n * 1e6,
            "received": received,
            "sent": flood_n,
            "frame_bytes": len(frame),
        }
    finally:
        tr.close()
        peer.close()


def _raw_read(tr: Any, region: str, into: Any) -> float:
    """A NIXL READ of the region and nothing else, polled to completion."""
    t0 = time.perf_counter()
    h = tr.start_read("bench-pin", 0, region, into, None)
    res: list[Any] = []
    while not res:
        tr.progress()
        res = tr.poll_transfers()
    t = time.perf_counter() - t0
    assert res[0].handle == h and res[0].ok, res
    return t


def _leased_read(driver: Any, key: str, region: str, into: Any) -> float:
    """The same READ through kvlease: lease check, transfer, access-done, completion."""
    from kvlease import AccessCompleted

    t0 = time.perf_counter()
    d = driver.read(key, region, into)
    assert d.allowed, d
    done = False
    while not done:
        done = any(isinstance(e, AccessCompleted) and e.key == key for e in driver.step())
    return time.perf_counter() - t0


def bench_reads(reps: dict[str, int]) -> dict[str, dict[str, float]]:
    import torch
    from kvlease.transports._driver import Driver, new_session  # type: ignore[import-not-found,unused-ignore]

    from kvlease import Accessor, LeaseConfig, LeaseTicket

    peer = Peer("pin")
    tr = make_transport("nixl", "bench-reader")
    driver = Driver(tr, accessor=Accessor(LeaseConfig(kv_lease_duration=LEASE), "bench-reader", session=new_session()))
    results: dict[str, dict[str, float]] = {}
    try:
        for region, n in reps.items():
            size = SIZES[region]
            into = torch.zeros(size, dtype=torch.uint8)
            peer.send(cmd="grant", region=region, n=n + 2, base=0)
            tickets = [LeaseTicket.from_dict(t) for t in peer.read()["tickets"]]
            keys = [f"{region}-{i}" for i in range(len(tickets))]
            for key, t in zip(keys, tickets, strict=True):
                driver.track(key, t, address=peer.address)
            deadline = time.monotonic() + 30
            assert driver.accessor is not None
            while any(driver.accessor.valid_until(k) is None for k in keys):
                driver.step()
                time.sleep(0.0005)
                if time.monotonic() > deadline:
                    raise RuntimeError("leases never became valid")
            raw: list[float] = []
            leased: list[float] = []
            for i, key in enumerate(keys):
                # Alternate which goes first, so neither gains from the other's warm caches.
                if i % 2:
                    t_lease = _leased_read(driver, key, region, into)
                    t_raw = _raw_read(tr, region, into)
                else:
                    t_raw = _raw_read(tr, region, into)
                    t_lease = _leased_read(driver, key, region, into)
                if i >= 2:  # warm-up (first registration of `into`, connection setup)
                    raw.append(t_raw)
                    leased.append(t_lease)
            r, k = statistics.median(raw), statistics.median(leased)
            results[region] = {
                "bytes": size,
                "reps": len(raw),
                "raw_ms": r * 1e3,
                "kvlease_ms": k * 1e3,
                "raw_gbps": size / r / 1e9,
                "kvlease_gbps": size / k / 1e9,
                "overhead_pct": (k / r - 1.0) * 100.0,
            }
    finally:
        driver.close()
        peer.close()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", choices=["echo", "pin"], help=argparse.SUPPRESS)
    ap.add_argument("--rtt", type=int, default=2000, help="round trips to time")
    ap.add_argument("--flood", type=int, default=20000, help="notifications for the rate")
    ap.add_argument("--reps-1m", type=int, default=200)
    ap.add_argument("--reps-64m", type=int, default=20)
    ap.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = ap.parse_args()
    if args.serve:
        serve_peer(args.serve)
        return
    import logging

    logging.getLogger("nixl").setLevel(logging.WARNING)
    notes = bench_notifications(args.rtt, args.flood)
    reads = bench_reads({"r1m": args.reps_1m, "r64m": args.reps_64m})
    print("NIXL transport on loopback (UCX, UCX_NET_DEVICES=lo, no progress thread), two processes")
    print(f"{'figure':<44}{'value':>14}")
    print(f"{'notification round trip, median':<44}{notes['rtt_median_us']:>11.1f} us")
    print(f"{'notification round trip, p99':<44}{notes['rtt_p99_us']:>11.1f} us")
    print(f"{'notifications/s (one sender, one receiver)':<44}{notes['msgs_per_s']:>12.0f}/s")
    print(f"{'sender CPU per notification':<44}{notes['send_us']:>11.1f} us")
    print(f"  ({notes['received']}/{notes['sent']} flood notifications of {notes['frame_bytes'] + 1} B arrived)")
    print()
    print(f"{'READ':<8}{'reps':>6}{'raw ms':>10}{'raw GB/s':>10}{'kvlease ms':>12}{'kvl GB/s':>10}{'overhead':>10}")
    for region, r in reads.items():
        label = "1 MiB" if region == "r1m" else "64 MiB"
        print(
            f"{label:<8}{r['reps']:>6}{r['raw_ms']:>10.3f}{r['raw_gbps']:>10.2f}{r['kvlease_ms']:>12.3f}"
            f"{r['kvlease_gbps']:>10.2f}{r['overhead_pct']:>9.2f}%"
        )
    print("(medians; overhead = kvlease path / raw NIXL READ - 1; target < 1 %)")
    if args.json:
        print(json.dumps({"notifications": notes, "reads": reads}))


if __name__ == "__main__":
    main()
