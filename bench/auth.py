"""Benchmark of deployment-key authentication: what the MAC costs, against no MAC, in one run.

    .venv/bin/python bench/auth.py [--quick] [--seconds S] [--leases N]

Every figure is measured with and without the key in the same run and printed side by side
with their ratio (MAC / no MAC):

- per-message CPU, median of several timeit-style repeats (us per message): ``encode`` vs
  ``FrameAuth.seal(encode(m))``, and ``decode`` vs ``decode(FrameAuth.open(frame))``, for a
  `Heartbeat` carrying 100 lease ids, a `HeartbeatAck` and an `AccessDone` (plain and sealed
  timings alternate within each repeat, so both see the same machine);
- bytes on the wire of one heartbeat round: a 1,000-lease `Accessor` (``max_message_bytes`` =
  1024) connected to a `Pinner`, its periodic round split by the core (the id budget shrinks by
  the 16-byte tag under a key), messages and total bytes of the heartbeats and of the acks;
- the driver step at 10,000 leases: two `Driver` pairs (pinner + accessor, each over its own
  `ZmqTransport` on 127.0.0.1) in this process, one plain and one keyed (the key in an
  environment variable this script sets, named by ``LeaseConfig.auth_keys``), 10,000 leases
  granted by each pinner and tracked by its accessor, heartbeats flowing. After one full
  acknowledged round, the four drivers are stepped back to back in one loop (the pair stepped
  first alternates) for a few seconds; mean / median / p99 of `step()` per side, and mean /
  median of the steps that handled heartbeats or acks (where the MAC work is; few samples, so
  noisier than the overall figures).

Target (the authentication issue): under 10 % on the step (judged here on the mean step time of
each side, which includes the heartbeat rounds). This is a benchmark: it prints figures and
whether the target is met; it asserts nothing. Run time: about 30 s (``--quick``: about 10 s).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import secrets
import statistics
import sys
import time
import timeit
from collections.abc import Callable, Iterable

from kvlease.transports import Driver
from kvlease.transports.zmq import ZmqTransport

from kvlease import (
    AccessDone,
    Accessor,
    AccessorOutput,
    FrameAuth,
    HandshakeNeeded,
    Heartbeat,
    HeartbeatAck,
    LeaseConfig,
    LocalTime,
    Message,
    PeerTime,
    Pinner,
    Send,
    decode,
    encode,
)

KEY_ENV = "KVLEASE_BENCH_AUTH_KEY"
AUTH_SOURCES = (f"env:{KEY_ENV}",)
#: The driver pairs: the lease timings of bench/transport.py (heartbeats every 0.5 s).
DRIVER_CFG = LeaseConfig(kv_lease_duration=3.0, max_access_time=0.2)

Row = tuple[str, str, str, str]


# -- per-message CPU -------------------------------------------------------------------------


def _median_us(fns: list[Callable[[], object]], repeats: int, target_s: float) -> list[float]:
    """Median over `repeats` of each callable's time per call (us). Each repeat times every
    callable once (order rotating), `number` calls each, sized so one timing takes ~target_s."""
    timers = [timeit.Timer(fn) for fn in fns]
    numbers = []
    for t in timers:
        n = 1
        while True:
            dt = t.timeit(n)
            if dt >= target_s / 5:
                break
            n *= 4
        numbers.append(max(1, int(n * target_s / dt)))
    samples: list[list[float]] = [[] for _ in fns]
    for r in range(repeats):
        order = list(range(len(fns)))
        order = order[r % len(order) :] + order[: r % len(order)]
        for i in order:
            samples[i].append(timers[i].timeit(numbers[i]) / numbers[i] * 1e6)
    return [statistics.median(s) for s in samples]


def _codec_calls(auth: FrameAuth, msg: Message) -> list[Callable[[], object]]:
    """encode, seal(encode), decode, decode(open) of `msg`, as argument-less calls."""
    seal, open_ = auth.seal, auth.open
    frame = encode(msg)
    sealed = seal(frame)

    def enc() -> bytes:
        return encode(msg)

    def enc_seal() -> bytes:
        return seal(encode(msg))

    def dec() -> Message:
        return decode(frame)

    def open_dec() -> Message:
        return decode(open_(sealed))

    return [enc, enc_seal, dec, open_dec]


def bench_messages(repeats: int, target_s: float) -> list[tuple[str, str, float, float]]:
    """(message, operation, us without the MAC, us with it) for encode and decode."""
    rng = random.Random(1)
    auth = FrameAuth([secrets.token_bytes(32)])
    session, inc = rng.getrandbits(64), rng.getrandbits(64)
    base = 5_000_000
    ids = tuple(sorted(rng.sample(range(base, base + 400), 100)))  # live ids of a long-running engine
    t = 86_400.125
    messages: list[tuple[str, Message]] = [
        ("Heartbeat (100 ids)", Heartbeat("decode-0", 0, 1, session, inc, 123_456, LocalTime(t), ids)),
        (
            "HeartbeatAck",
            HeartbeatAck("prefill-0", 0, inc, 0, session, 123_456, PeerTime(t), PeerTime(t + 1e-3), 86400.0, 100),
        ),
        ("AccessDone", AccessDone("decode-0", 0, 1, session, inc, 0, ids[0], 123_457, False, LocalTime(t))),
    ]
    out = []
    for name, msg in messages:
        assert decode(auth.open(auth.seal(encode(msg)))) == msg
        enc_plain, enc_mac, dec_plain, dec_mac = _median_us(_codec_calls(auth, msg), repeats, target_s)
        out.append((name, "encode (+ seal)", enc_plain, enc_mac))
        out.append((name, "(open +) decode", dec_plain, dec_mac))
    return out


# -- bytes of a heartbeat round --------------------------------------------------------------


def heartbeat_round(cfg: LeaseConfig, auth: FrameAuth | None, n_leases: int) -> dict[str, int]:
    """One periodic heartbeat round of an accessor tracking `n_leases` on one pinner, as the
    core splits it: messages and wire bytes of the heartbeats and of the acks answering them."""
    rng = random.Random(2)
    pin = Pinner(cfg, "prefill-0", rng.getrandbits(64))
    acc = Accessor(cfg, "decode-0", session=rng.getrandbits(64))

    def wire(msg: Message) -> int:
        data = encode(msg)
        return len(data if auth is None else auth.seal(data))

    t = 1000.0
    hbs: list[Heartbeat] = []

    def to_pinner(outs: Iterable[AccessorOutput]) -> None:
        for o in outs:
            if isinstance(o, HandshakeNeeded):  # the side channel, at once
                to_pinner(acc.receive(LocalTime(t), pin.handshake_reply(LocalTime(t), o.message)))
            elif isinstance(o, Send) and isinstance(o.message, Heartbeat):
                hbs.append(o.message)

    for i in range(n_leases):
        to_pinner(acc.track(LocalTime(t), f"r{i}", pin.grant(LocalTime(t), f"r{i}")))
    rounds = 0
    while True:
        hbs.clear()
        deadline = acc.next_deadline()
        assert deadline is not None
        t = max(t, deadline)
        to_pinner(acc.handle_timeout(LocalTime(t)))
        acks: list[Message] = []
        for hb in hbs:
            acks.extend(o.message for o in pin.receive(LocalTime(t), hb) if isinstance(o, Send))
        for ack in acks:
            to_pinner(acc.receive(LocalTime(t), ack))
        rounds += 1
        # The first round after the handshake carries the newly tracked ids; take the next
        # periodic one, which carries every live lease.
        if rounds >= 2 and sum(len(h.lease_ids) for h in hbs) == n_leases:
            break
        assert rounds < 10, "no full heartbeat round"
    sizes = [wire(h) for h in hbs]
    ack_sizes = [wire(a) for a in acks]
    assert max(sizes + ack_sizes) <= cfg.max_message_bytes
    return {
        "hb_messages": len(sizes),
        "hb_bytes": sum(sizes),
        "hb_largest": max(sizes),
        "ack_messages": len(ack_sizes),
        "ack_bytes": sum(ack_sizes),
    }


# -- the driver step ---------------------------------------------------------------------------


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class _Side:
    def __init__(self) -> None:
        self.steps: list[float] = []
        self.busy: list[float] = []

    def figures(self) -> dict[str, float]:
        return {
            "mean": statistics.fmean(self.steps) * 1e6,
            "median": statistics.median(self.steps) * 1e6,
            "p99": _quantile(self.steps, 0.99) * 1e6,
            "busy_mean": statistics.fmean(self.busy) * 1e6 if self.busy else float("nan"),
            "busy_median": statistics.median(self.busy) * 1e6 if self.busy else float("nan"),
            "busy_steps": float(len(self.busy)),
            "steps": float(len(self.steps)),
        }


class _DriverPair:
    def __init__(self, name: str, cfg: LeaseConfig, n_leases: int) -> None:
        self.name = name
        pt = ZmqTransport(f"P{name}", bind="tcp://127.0.0.1:0")
        self.p = Driver(pt, pinner=Pinner(cfg, f"P{name}", random.getrandbits(63)), log_interval=60.0)
        self.d = Driver(
            ZmqTransport(f"D{name}", bind="tcp://127.0.0.1:0"),
            accessor=Accessor(cfg, f"D{name}", session=random.getrandbits(63)),
            log_interval=60.0,
        )
        for i in range(n_leases):
            self.d.track(f"r{i}", self.p.grant(f"r{i}"), address=pt.address)
        self.n_leases = n_leases
        self.pinner = _Side()
        self.accessor = _Side()

    def step(self) -> None:
        ps, ds = self.p.stats, self.d.stats
        hb0 = ps.heartbeats_received
        t0 = time.perf_counter()
        self.p.step()
        t1 = time.perf_counter()
        ack0, sent0 = ds.heartbeat_acks_received, ds.heartbeats_sent
        t2 = time.perf_counter()
        self.d.step()
        t3 = time.perf_counter()
        self.pinner.steps.append(t1 - t0)
        self.accessor.steps.append(t3 - t2)
        if ps.heartbeats_received != hb0:
            self.pinner.busy.append(t1 - t0)
        if ds.heartbeat_acks_received != ack0 or ds.heartbeats_sent != sent0:
            self.accessor.busy.append(t3 - t2)

    def warm(self) -> bool:
        """Connected, and at least one full round renewed and acknowledged."""
        return self.p.stats.leases_renewed >= self.n_leases and self.d.stats.heartbeat_acks_received > 0

    def counters(self) -> dict[str, int]:
        ps, ds = self.p.stats, self.d.stats
        return {
            "heartbeats": ds.heartbeats_sent,
            "renewed": ps.leases_renewed,
            "lost_or_expired": ds.leases_lost + ps.leases_expired,
            "refused": ps.unauthenticated_messages
            + ds.unauthenticated_messages
            + ps.malformed_messages
            + ds.malformed_messages,
        }

    def close(self) -> None:
        self.p.close()
        self.d.close()


def bench_driver(n_leases: int, seconds: float) -> dict[str, dict[str, float]]:
    os.environ[KEY_ENV] = secrets.token_hex(32)
    pairs = [
        _DriverPair("0", DRIVER_CFG, n_leases),
        _DriverPair("1", DRIVER_CFG.with_changes(auth_keys=AUTH_SOURCES), n_leases),
    ]
    try:
        deadline = time.monotonic() + 30.0
        while not all(p.warm() for p in pairs):
            assert time.monotonic() < deadline, "the driver pairs never completed a heartbeat round"
            for pair in pairs:
                pair.p.step()
                pair.d.step()
        for pair in pairs:
            pair.pinner, pair.accessor = _Side(), _Side()
        before = [p.counters() for p in pairs]
        gc.collect()
        flip = False
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            first, second = (pairs[1], pairs[0]) if flip else (pairs[0], pairs[1])
            first.step()
            second.step()
            flip = not flip
        out: dict[str, dict[str, float]] = {}
        for pair, b in zip(pairs, before, strict=True):
            after = pair.counters()
            fig = {f"pinner_{k}": v for k, v in pair.pinner.figures().items()}
            fig |= {f"accessor_{k}": v for k, v in pair.accessor.figures().items()}
            fig |= {k: float(after[k] - b[k]) for k in after}
            out["mac" if pair.name == "1" else "plain"] = fig
        return out
    finally:
        for pair in pairs:
            pair.close()
        os.environ.pop(KEY_ENV, None)


# -- report --------------------------------------------------------------------------------------


def _ratio(a: float, b: float) -> str:
    return f"{b / a:.3f}x" if a else "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats and a shorter driver run (a smoke run)")
    ap.add_argument("--seconds", type=float, default=None, help="steady-state driver run (default 20, quick 5)")
    ap.add_argument("--leases", type=int, default=10_000, help="leases per driver pair (default 10,000)")
    args = ap.parse_args(argv)
    repeats, target_s = (5, 0.02) if args.quick else (9, 0.05)
    seconds = args.seconds if args.seconds is not None else (5.0 if args.quick else 20.0)

    msgs = bench_messages(repeats, target_s)
    budget = LeaseConfig(max_message_bytes=1024)
    plain_round = heartbeat_round(budget, None, 1000)
    mac_round = heartbeat_round(budget.with_changes(auth_keys=AUTH_SOURCES), FrameAuth([bytes(32)]), 1000)
    drv = bench_driver(args.leases, seconds)
    pl, mc = drv["plain"], drv["mac"]

    rows: list[Row] = []
    for name, op, a, b in msgs:
        rows.append((f"{name}: {op}, us/msg", f"{a:.2f}", f"{b:.2f}", _ratio(a, b)))
    for what, unit in (("hb", "heartbeats"), ("ack", "acks")):
        a_n, b_n = plain_round[f"{what}_messages"], mac_round[f"{what}_messages"]
        a_b, b_b = plain_round[f"{what}_bytes"], mac_round[f"{what}_bytes"]
        rows.append(
            (
                f"1,000-lease round @1024 B: {unit}, msgs / bytes",
                f"{a_n} / {a_b:,}",
                f"{b_n} / {b_b:,}",
                f"{_ratio(a_n, b_n)} / {_ratio(a_b, b_b)}",
            )
        )
    k = f"{args.leases // 1000}k" if args.leases % 1000 == 0 else f"{args.leases:,}"
    for side in ("pinner", "accessor"):
        a3 = [pl[f"{side}_{q}"] for q in ("mean", "median", "p99")]
        b3 = [mc[f"{side}_{q}"] for q in ("mean", "median", "p99")]
        rows.append(
            (
                f"{side} step, {k} leases: mean / median / p99, us",
                " / ".join(f"{x:.1f}" for x in a3),
                " / ".join(f"{x:.1f}" for x in b3),
                " / ".join(_ratio(a, b).rstrip("x") for a, b in zip(a3, b3, strict=True)),
            )
        )
        a2 = [pl[f"{side}_busy_{q}"] for q in ("mean", "median")]
        b2 = [mc[f"{side}_busy_{q}"] for q in ("mean", "median")]
        rows.append(
            (
                f"{side} steps handling heartbeats/acks: mean / median, us",
                " / ".join(f"{x:.0f}" for x in a2),
                " / ".join(f"{x:.0f}" for x in b2),
                " / ".join(_ratio(a, b).rstrip("x") for a, b in zip(a2, b2, strict=True)),
            )
        )

    print(f"kvlease authentication benchmark (python {sys.version.split()[0]}); MAC = keyed BLAKE2b-128, 16 B/frame")
    widths = [max(len(r[i]) for r in [*rows, ("figure", "no MAC", "with MAC", "MAC/no MAC")]) for i in range(4)]
    print(
        f"| {'figure':<{widths[0]}} | {'no MAC':>{widths[1]}} | {'with MAC':>{widths[2]}} | "
        f"{'MAC/no MAC':>{widths[3]}} |"
    )
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(f"| {r[0]:<{widths[0]}} | {r[1]:>{widths[1]}} | {r[2]:>{widths[2]}} | {r[3]:>{widths[3]}} |")
    over = {s: mc[f"{s}_mean"] / pl[f"{s}_mean"] - 1.0 for s in ("pinner", "accessor")}
    met = all(v < 0.10 for v in over.values())
    print(
        f"target < 10 % on the step (mean, both sides): pinner {over['pinner']:+.1%}, "
        f"accessor {over['accessor']:+.1%} -> {'met' if met else 'NOT met'}"
    )
    print(
        f"({seconds:g} s interleaved, {int(pl['pinner_steps']):,} / {int(mc['pinner_steps']):,} step pairs; "
        f"{int(pl['heartbeats']):,} / {int(mc['heartbeats']):,} heartbeats renewed {int(pl['renewed']):,} / "
        f"{int(mc['renewed']):,} ids; lost/expired {int(pl['lost_or_expired'])} / {int(mc['lost_or_expired'])}, "
        f"refused {int(pl['refused'])} / {int(mc['refused'])}, all must be 0; largest heartbeat "
        f"{plain_round['hb_largest']} / {mac_round['hb_largest']} B)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
