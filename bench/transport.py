"""Benchmark of the ZMQ transport and the driver (a benchmark, not a test: it prints figures).

    .venv/bin/python bench/transport.py [--quick]

Measures, on loopback TCP:
- heartbeat round trip: an accessor process sends an encoded `Heartbeat` (8 lease ids) to a
  pinner engine in another process, whose `Driver` renews and answers; median and p99 of the
  send-to-ack time;
- messages per second: heartbeats pipelined (up to 256 unanswered) and acknowledged;
- per-step driver overhead with 10,000 tracked requests: an accessor driver tracking 10k leases
  on a pinner driver (both in this process, real sockets, real clock), stepped back to back for
  a few seconds; mean and p99 per step, for each side (target: < 50 us). Steps with heartbeat
  rounds (every 0.5 s: ~10 chunked heartbeats and acks) are included in the mean.

The NIXL transport is benchmarked separately (bench/transport_nixl.py).
Run time: about 15 s (``--quick``: about 5 s).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import time
from typing import Any

from kvlease.transports import Driver
from kvlease.transports.zmq import ZmqTransport

from kvlease import (
    Accessor,
    Heartbeat,
    HeartbeatAck,
    LeaseConfig,
    LocalTime,
    Pinner,
    decode,
    encode,
)

CFG = LeaseConfig(kv_lease_duration=3.0, max_access_time=0.2)


def _pinner_process(conn: Any, n_leases: int) -> None:
    transport = ZmqTransport("P", bind="tcp://127.0.0.1:0")
    pinner = Pinner(CFG.with_changes(kv_lease_duration=3600.0), "P", 42)
    driver = Driver(transport, pinner=pinner)
    ids = [driver.grant(f"r{i}").lease_id for i in range(n_leases)]
    conn.send((transport.address, ids))
    while not conn.poll():
        driver.step()
        transport.wait(0.001)


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def bench_round_trip(n: int, burst: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_pinner_process, args=(child, 8), daemon=True)
    proc.start()
    try:
        address, ids = parent.recv()
        t = ZmqTransport("D", bind="tcp://127.0.0.1:0")
        # The side channel first (it tells the transport where P's workers are).
        from kvlease import PROTOCOL_VERSION, Handshake, HandshakeReply

        hs = Handshake("D", 0, 1, 7, PROTOCOL_VERSION, 7, 1, LocalTime(time.monotonic()))
        t.request_handshake("P", address, encode(hs))
        reply = None
        while reply is None:
            t.receive()  # drains the sockets; the reply surfaces from poll_handshakes
            for ev in t.poll_handshakes():
                reply = decode(ev.data)  # type: ignore[union-attr]
            t.wait(0.01)
        assert isinstance(reply, HandshakeReply)
        inc = reply.incarnation
        lease_ids = tuple(ids)
        seq = 0

        def hb() -> bytes:
            nonlocal seq
            seq += 1
            return encode(Heartbeat("D", 0, 1, 7, inc, seq, LocalTime(time.monotonic()), lease_ids))

        for _ in range(200):  # warm up
            t.send("P", None, hb())
            while not t.receive():
                t.wait(0.01)
        rtts: list[float] = []
        for _ in range(n):
            t0 = time.perf_counter()
            t.send("P", None, hb())
            got: list[Any] = []
            while not got:
                got = t.receive()
                if not got:
                    t.wait(0.001)
            rtts.append(time.perf_counter() - t0)
            assert isinstance(decode(got[0].data), HeartbeatAck)
        # Throughput: pipelined, at most `window` unanswered.
        window, sent, acked = 256, 0, 0
        t0 = time.perf_counter()
        while acked < burst:
            while sent < burst and sent - acked < window:
                t.send("P", None, hb())
                sent += 1
            got = t.receive()
            if not got:
                t.wait(0.001)
            acked += len(got)
        elapsed = time.perf_counter() - t0
        t.close()
        return {
            "rtt_median_us": statistics.median(rtts) * 1e6,
            "rtt_p99_us": _quantile(rtts, 0.99) * 1e6,
            "heartbeats_per_s": burst / elapsed,
        }
    finally:
        parent.send("stop")
        proc.join(5)
        if proc.is_alive():
            proc.kill()


def bench_step_overhead(n_requests: int, seconds: float) -> dict[str, float]:
    pt = ZmqTransport("P")
    p = Driver(pt, pinner=Pinner(CFG, "P", random.getrandbits(63)))
    d = Driver(ZmqTransport("D"), accessor=Accessor(CFG, "D", session=7))
    for i in range(n_requests):
        d.track(f"r{i}", p.grant(f"r{i}"), address=pt.address)
    assert d.accessor is not None
    while not d.accessor.is_connected("P"):
        p.step()
        d.step()
    p_steps: list[float] = []
    d_steps: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        p.step()
        t1 = time.perf_counter()
        d.step()
        t2 = time.perf_counter()
        p_steps.append(t1 - t0)
        d_steps.append(t2 - t1)
    lost = d.stats.leases_lost
    freed = p.stats.leases_expired
    out = {
        "accessor_step_mean_us": statistics.fmean(d_steps) * 1e6,
        "accessor_step_median_us": statistics.median(d_steps) * 1e6,
        "accessor_step_p99_us": _quantile(d_steps, 0.99) * 1e6,
        "pinner_step_mean_us": statistics.fmean(p_steps) * 1e6,
        "pinner_step_median_us": statistics.median(p_steps) * 1e6,
        "pinner_step_p99_us": _quantile(p_steps, 0.99) * 1e6,
        "steps": float(len(d_steps)),
        "heartbeats_sent": float(d.stats.heartbeats_sent),
        "leases_renewed": float(p.stats.leases_renewed),
        "lost_or_expired": float(lost + freed),
    }
    p.close()
    d.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    args = ap.parse_args()
    n, burst, secs = (500, 5000, 1.5) if args.quick else (5000, 50000, 4.0)
    rt = bench_round_trip(n, burst)
    st = bench_step_overhead(10_000, secs)
    rows = [
        ("heartbeat round trip, median (ZMQ loopback, 2 processes)", f"{rt['rtt_median_us']:.0f} us", ""),
        ("heartbeat round trip, p99", f"{rt['rtt_p99_us']:.0f} us", ""),
        ("heartbeats acknowledged per second (pipelined)", f"{rt['heartbeats_per_s']:,.0f} /s", ""),
        ("accessor driver step, 10k tracked: mean", f"{st['accessor_step_mean_us']:.1f} us", "< 50 us"),
        (
            "accessor driver step, 10k tracked: median / p99",
            f"{st['accessor_step_median_us']:.1f} / {st['accessor_step_p99_us']:.0f} us",
            "",
        ),
        ("pinner driver step, 10k leases: mean", f"{st['pinner_step_mean_us']:.1f} us", "< 50 us"),
        (
            "pinner driver step, 10k leases: median / p99",
            f"{st['pinner_step_median_us']:.1f} / {st['pinner_step_p99_us']:.0f} us",
            "",
        ),
    ]
    w = max(len(r[0]) for r in rows)
    print(f"{'ZMQ transport + driver':<{w}}  {'measured':>16}  target")
    print("-" * (w + 28))
    for name, value, target in rows:
        print(f"{name:<{w}}  {value:>16}  {target}")
    print(
        f"\n({int(st['steps'])} step pairs over {secs} s; {int(st['heartbeats_sent'])} heartbeat messages "
        f"renewed {int(st['leases_renewed'])} lease ids; {int(st['lost_or_expired'])} lost/expired, must be 0)"
    )


if __name__ == "__main__":
    main()
