"""What a simulation run is made of: engines, workload, network, faults, policy.

Plain frozen values, so a scenario can be printed, compared, written to JSON and replayed. The
two builders here make the default policy-comparison scenario and the small adversarial
scenarios of the fault campaign; both are pure functions of their arguments (a seed included).
Owns no state and never reads a clock.
"""

from __future__ import annotations

import enum
import random
from typing import Any

import attrs

from .._config import MIN_VALIDITY_MARGIN, LeaseConfig

__all__ = [
    "ApiSpec",
    "EngineSpec",
    "Fault",
    "FaultKind",
    "NetworkSpec",
    "Policy",
    "Scenario",
    "WorkloadSpec",
    "campaign_scenario",
    "default_scenario",
]


class Policy(enum.Enum):
    """How the pinner decides when to free. The two FIXED ones are simple baseline models
    written for the simulator (no kvlease core involved): the pinner frees at grant + T or on
    read-done, and the decoder never heartbeats (vLLM before leases, with
    ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``)."""

    #: Baseline model: free at grant + 480 s or on read-done; no heartbeats.
    FIXED_480 = "fixed-480s"
    #: Baseline model: free at grant + 30 s or on read-done; no heartbeats.
    FIXED_30 = "fixed-30s"
    #: The real kvlease core on both sides: heartbeats, acks, validity, confirmation.
    KVLEASE = "kvlease"
    #: vLLM-style silent heartbeats: the real `Pinner` (vllm_compat) renews on ``HB:`` and
    #: frees on ``id:count``, but nothing is acknowledged, so a decoder reads blocks that
    #: expired under it without knowing (the stale reads kvlease's acks catch).
    VLLM_HB = "vllm-hb"

    @property
    def fixed_timeout(self) -> float | None:
        if self is Policy.FIXED_480:
            return 480.0
        if self is Policy.FIXED_30:
            return 30.0
        return None


class FaultKind(enum.Enum):
    CRASH = "crash"  # the engine dies at `at`, restarts (new incarnation) after `duration`
    PARTITION = "partition"  # no message between `engine` and `peer` for `duration`
    STALL = "stall"  # the decoder's forward pass runs from `at` for at least `duration`
    #: Adversarial: the decoder's forward pass runs from `at` until just around the earliest
    #: validity end (duration >= 0) or pinner expiry (< 0) of its waiting requests; `duration`
    #: is the offset (see `Cluster._edge`).
    EDGE_STALL = "edge-stall"


@attrs.frozen
class Fault:
    kind: FaultKind
    at: float
    duration: float
    engine: str
    peer: str = ""

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind.value, "at": self.at, "duration": self.duration, "engine": self.engine}
        if self.peer:
            d["peer"] = self.peer
        return d


@attrs.frozen
class ApiSpec:
    """API-level adversity: what an engine and its transport may do through the core's API at
    the worst moment (the network faults are `NetworkSpec` and `Fault`). Each knob is a
    probability per occasion (per request, transfer or message) unless it says otherwise; all
    zero does nothing. Drawn per seed by `campaign_scenario` (None: no API adversity)."""

    #: After a read is reported done, after a disconnect or a posted failed transfer lost the
    #: lease: the engine tracks the same ticket again under a new key (a fresh lease is needed;
    #: the core must refuse, and the engine recomputes).
    retrack: float = 0.0
    #: A waiting request is aborted (untrack: its Release goes out) and the engine re-tracks the
    #: same ticket at once under a new key, while the Release is in flight.
    abort: float = 0.0
    #: The router hands the same ticket to a second request (a retry), on another decode engine
    #: or the same one, while the first still holds it.
    redispatch: float = 0.0
    #: The access-done travels attached to the transfer (AccessDecision.notification, NIXL's
    #: notification), delivered after the data landed; access_finished(notified=True).
    notify: float = 0.0
    #: An attached transfer fails at the transport after its notification was delivered:
    #: access_failed(posted=True); the engine retries only if the core lets it.
    fail_posted: float = 0.0
    #: A transfer fails before anything of it was posted: access_failed(posted=False), retried.
    fail_unposted: float = 0.0
    #: A message addressed to one rank is delivered to a sibling rank of the same engine.
    misroute: float = 0.0
    #: A handshake reply is delivered again later (a duplicate, or stale after a restart), to
    #: its rank or a sibling's.
    dup_reply: float = 0.0
    #: Disconnects (Accessor.disconnect from one pinner engine) per second per decode engine;
    #: later tracks on that engine reconnect.
    disconnect: float = 0.0
    #: A pull transfer is scheduled to end exactly at the accessor's valid_until.
    exact_end: float = 0.0
    #: A heartbeat or access-done is held and handled exactly at the pinner's expiry of a lease
    #: it names.
    at_expiry: float = 0.0
    # -- protocol v3's holes (appended: the streams above keep their seeds) --------------------
    #: A push WRITE fails at the transport after it was posted (access_failed(posted=True): a
    #: Release(posted=True) goes out) and then lands late, up to the access-time bound after it
    #: began: the pinner must not have freed the destination (hole 2).
    late_write: float = 0.0
    #: One part's access-done of a multi-part access (pinner TP > accessor TP) is delivered to
    #: another target rank of the same access, a sibling the accessor rank also addresses: it
    #: must free nothing there (hole 3).
    part_misroute: float = 0.0
    #: With a heartbeat, an engine outside the deployment's honest accessors (no key: the network
    #: carries anything) sends the same pinner rank a heartbeat filled to the pinner's frame
    #: bound with ids far apart, whose ack could not fit: it must be refused, not answered over
    #: the bound (hole 4).
    forged_heartbeat: float = 0.0


@attrs.frozen
class EngineSpec:
    name: str
    tp: int
    #: Decode engines: sequences decoded at once. Prefill engines: unused.
    slots: int = 32
    #: This engine's own settings (a rolling config change: the two sides of a lease configured
    #: apart); None: the scenario's `config`.
    config: LeaseConfig | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "tp": self.tp, "slots": self.slots}
        if self.config is not None:
            d["config"] = attrs.asdict(self.config)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> EngineSpec:
        cfg = d.get("config")
        return cls(d["name"], int(d["tp"]), int(d.get("slots", 32)), LeaseConfig(**cfg) if cfg is not None else None)


@attrs.frozen
class NetworkSpec:
    """Notification channel: each message (per destination worker) is lost with `loss`,
    duplicated with `dup`, and delayed by ``base + min(Exp(jitter), cap)`` — independent
    delays reorder messages. The handshake side channel is reliable (TCP) but fails across a
    partition or to a dead engine."""

    base_delay: float = 0.0002
    jitter: float = 0.0005
    cap: float = 0.02
    loss: float = 0.0
    dup: float = 0.0
    side_channel_delay: float = 0.001

    @property
    def max_delay(self) -> float:
        return self.base_delay + self.cap


@attrs.frozen
class WorkloadSpec:
    duration: float = 900.0
    rate: float = 5.0  # requests per second outside bursts
    #: (start, length, rate) windows during which arrivals come at `rate` instead.
    bursts: tuple[tuple[float, float, float], ...] = ()
    prompt_tokens: tuple[int, int] = (512, 4096)
    output_tokens: tuple[int, int] = (64, 512)
    block_tokens: int = 16
    #: Prefill time = base + per-token * prompt tokens (seconds).
    prefill_base: float = 0.02
    prefill_per_token: float = 0.00002
    #: Decode step = base + per-sequence * running sequences (seconds).
    step_base: float = 0.02
    step_per_seq: float = 0.0005
    #: KV transfer time = base + per-block * blocks (seconds).
    transfer_base: float = 0.002
    transfer_per_block: float = 0.00005
    #: Router -> decoder and ticket delay (seconds).
    router_delay: float = 0.002
    #: How long the router keeps sending to an engine after it died.
    router_detect: float = 2.0
    #: A client resubmits a request lost with a crashed engine after this long.
    client_retry: float = 1.0
    #: Fraction of requests in push mode (the accessor WRITEs; begin_access must be guaranteed).
    push_fraction: float = 0.0
    #: Sample the pinned-memory timeline every this many seconds.
    sample_every: float = 1.0


@attrs.frozen
class Scenario:
    seed: int
    prefill: tuple[EngineSpec, ...]
    decode: tuple[EngineSpec, ...]
    workload: WorkloadSpec = WorkloadSpec()
    network: NetworkSpec = NetworkSpec()
    faults: tuple[Fault, ...] = ()
    config: LeaseConfig = attrs.field(factory=LeaseConfig)
    #: Each engine's clock runs at (1 + r) with |r| <= this (real drift; the config's
    #: `max_drift_rate` is what the protocol *assumes*; a test may make them disagree).
    drift: float = 1e-4
    #: Give requests a hard cap (the campaign keeps seeds small).
    max_requests: int = 1 << 30
    #: API-level adversity (None: none; see `ApiSpec`).
    api: ApiSpec | None = None
    #: Lease ids far apart: each grant's id is the previous one plus a random gap in
    #: [1, id_gap] (0: consecutive ids), so heartbeats and acks reach the frame bound with few
    #: ids and a round splits into many chunks.
    id_gap: int = 0

    def config_of(self, engine: str) -> LeaseConfig:
        """The settings engine `engine` runs."""
        for e in self.prefill + self.decode:
            if e.name == engine and e.config is not None:
                return e.config
        return self.config

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "prefill": [e.to_json() for e in self.prefill],
            "decode": [e.to_json() for e in self.decode],
            "workload": attrs.asdict(self.workload),
            "network": attrs.asdict(self.network),
            "faults": [f.to_json() for f in self.faults],
            "config": attrs.asdict(self.config),
            "drift": self.drift,
            "max_requests": self.max_requests,
            **({"api": attrs.asdict(self.api)} if self.api is not None else {}),
            **({"id_gap": self.id_gap} if self.id_gap else {}),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Scenario:
        """The inverse of `to_json` (for `kvlease sim --replay`)."""
        wl = dict(d["workload"])
        wl["bursts"] = tuple(tuple(b) for b in wl.get("bursts", ()))
        for name in ("prompt_tokens", "output_tokens"):
            if name in wl:
                wl[name] = tuple(wl[name])
        return cls(
            seed=int(d["seed"]),
            prefill=tuple(EngineSpec.from_json(e) for e in d["prefill"]),
            decode=tuple(EngineSpec.from_json(e) for e in d["decode"]),
            workload=WorkloadSpec(**wl),
            network=NetworkSpec(**d["network"]),
            faults=tuple(
                Fault(FaultKind(f["kind"]), f["at"], f["duration"], f["engine"], f.get("peer", "")) for f in d["faults"]
            ),
            config=LeaseConfig(**d["config"]),
            drift=float(d["drift"]),
            max_requests=int(d["max_requests"]),
            api=ApiSpec(**d["api"]) if d.get("api") is not None else None,
            id_gap=int(d.get("id_gap", 0)),
        )


def default_scenario(
    seed: int = 1,
    *,
    duration: float = 900.0,
    rate: float = 5.0,
    crash_at: float | None = 240.0,
    burst: tuple[float, float, float] | None = (200.0, 60.0, 25.0),
    stall: tuple[float, float] | None = (230.0, 25.0),
) -> Scenario:
    """The policy comparison: 3 prefill engines (TP 2, 1, 2), 4 decode engines (TP 1, 2, 1, 1),
    a decoder crash at `crash_at` (restarting 30 s later), an arrival burst that overloads
    the decoders so requests queue for longer than 30 s, and one forward pass of D2 that
    stalls (start, length) for longer than the lease extension during the burst: the leases of
    requests queued there expire under them (what silent vLLM-style heartbeats turn into stale
    reads, and kvlease reports as lost)."""
    faults: list[Fault] = []
    if stall is not None:
        faults.append(Fault(FaultKind.STALL, stall[0], stall[1], "D2"))
    if crash_at is not None:
        faults.append(Fault(FaultKind.CRASH, crash_at, 30.0, "D1"))
    faults.sort(key=lambda f: f.at)
    return Scenario(
        seed=seed,
        prefill=(EngineSpec("P0", 2), EngineSpec("P1", 1), EngineSpec("P2", 2)),
        decode=(EngineSpec("D0", 1), EngineSpec("D1", 2, 48), EngineSpec("D2", 1), EngineSpec("D3", 1)),
        workload=WorkloadSpec(duration=duration, rate=rate, bursts=(burst,) if burst else ()),
        faults=tuple(faults),
    )


def campaign_scenario(seed: int, *, config: LeaseConfig | None = None) -> Scenario:
    """A small adversarial scenario: short leases (so expiry happens within seconds), clocks
    at the drift bound, lossy/duplicating/reordering network, crashes, partitions, and
    forward-pass stalls around the lease extension. Sized to run in ~10-30 ms."""
    rng = random.Random(seed * 7919 + 17)
    duration_lease = rng.choice((0.6, 1.2, 3.0))
    cfg = config or LeaseConfig(
        kv_lease_duration=duration_lease,
        max_drift_rate=rng.choice((1e-4, 1e-3, 1e-2, 1e-2)),
        max_access_time=duration_lease / 10.0,
        validity_margin=duration_lease / 100.0,
        max_message_bytes=rng.choice((192, 256, 1024)),
    )
    ext = cfg.lease_extension
    horizon = duration_lease * 7.0
    n_p, n_d = rng.randint(1, 2), rng.randint(1, 2)
    prefill = tuple(EngineSpec(f"P{i}", rng.choice((1, 2, 4))) for i in range(n_p))
    decode = tuple(EngineSpec(f"D{i}", rng.choice((1, 2)), rng.randint(1, 4)) for i in range(n_d))
    lossy = rng.random() < 0.6
    network = NetworkSpec(
        base_delay=rng.uniform(0.0, 0.002),
        jitter=rng.uniform(0.0, ext / 20.0),
        cap=ext / 8.0,
        loss=rng.choice((0.05, 0.2, 0.4)) if lossy else 0.0,
        dup=rng.choice((0.0, 0.1, 0.3)),
        side_channel_delay=rng.uniform(0.0, 0.01),
    )
    faults = _faults(rng, prefill, decode, horizon, ext, duration_lease)
    step = duration_lease / 25.0
    workload = WorkloadSpec(
        duration=horizon,
        rate=rng.uniform(1.0, 4.0) / duration_lease,
        bursts=((rng.uniform(0, horizon / 2), horizon / 6, 12.0 / duration_lease),) if rng.random() < 0.5 else (),
        prompt_tokens=(16, 512),
        output_tokens=(2, 40),
        prefill_base=step / 2,
        prefill_per_token=step / 2000,
        step_base=step,
        step_per_seq=step / 10,
        transfer_base=cfg.max_access_time / 20,
        transfer_per_block=cfg.max_access_time / 400,
        router_delay=step / 4,
        router_detect=duration_lease / 2,
        client_retry=duration_lease / 4,
        push_fraction=rng.choice((0.0, 0.3, 1.0)),
        sample_every=horizon,
    )
    drift = cfg.max_drift_rate
    # API-level adversity in about half the seeds. Drawn after everything above, so a seed
    # without it is exactly the scenario it was before the knob existed.
    api: ApiSpec | None = None
    if rng.random() < 0.5:
        api = _api_spec(rng, duration_lease)
        # Ranks to misroute between: multi-rank engines on both sides most of the time (p != a
        # and p = a > 1), with the sizes one of which divides the other.
        prefill = tuple(EngineSpec(e.name, rng.choice((1, 2, 2, 4))) for e in prefill)
        decode = tuple(EngineSpec(e.name, rng.choice((1, 2, 2, 4)), e.slots) for e in decode)
        if config is None and rng.random() < 0.3:
            cfg = cfg.with_changes(validity_margin=MIN_VALIDITY_MARGIN)  # the smallest margin allowed
    # Protocol v3's fault models, from a stream of their own: the draws above (and so every
    # scenario of a seed without them) are what they were before these existed.
    v3 = random.Random(seed * 104729 + 31)
    max_requests = 20
    id_gap = 0
    if config is None and v3.random() < 0.4:
        # A rolling config change: decode engines configured apart from the prefill side, each
        # drawn on its own (hole 1).
        decode = tuple(attrs.evolve(e, config=_apart_config(v3, cfg)) if v3.random() < 0.75 else e for e in decode)
    if v3.random() < 0.3:
        # Frames at the bound: ids far apart, so a few fill a chunk (hole 4).
        id_gap = 1 << v3.choice((24, 40, 56))
    if v3.random() < 0.15:
        # A long round trip: tracks come faster than acks return (hole 5).
        network = attrs.evolve(network, base_delay=v3.uniform(ext / 40.0, ext / 12.0))
    if config is None and v3.random() < 0.2:
        # A healthy crowd (hole 5): no loss and no scheduled faults, a dense burst of twice as
        # many requests, ids far apart and decode engines at the smallest frame bound with a
        # few outstanding rounds, so a round splits into more chunks than the bound and new
        # rounds start before its acks are back; every live lease must still validate.
        id_gap = id_gap or 1 << 40
        max_requests = 40
        faults = ()
        base = v3.uniform(ext / 16.0, ext / 10.0)
        network = attrs.evolve(network, loss=0.0, base_delay=base, jitter=ext / 200.0, cap=ext / 40.0)
        bursts = ((v3.uniform(0.0, horizon / 6), 2.0 * duration_lease, 30.0 / duration_lease),)
        workload = attrs.evolve(workload, bursts=bursts)
        decode = tuple(
            attrs.evolve(
                e,
                config=(e.config or cfg).with_changes(
                    max_message_bytes=192, max_outstanding_heartbeats=v3.choice((2, 3))
                ),
            )
            for e in decode
        )
    if api is not None:
        api = attrs.evolve(
            api,
            late_write=v3.choice((0.3, 1.0)) if v3.random() < 0.5 else 0.0,
            part_misroute=v3.choice((0.1, 0.3)) if v3.random() < 0.5 else 0.0,
            forged_heartbeat=v3.choice((0.01, 0.05)) if v3.random() < 0.5 else 0.0,
        )
    return Scenario(
        seed=seed,
        prefill=prefill,
        decode=decode,
        workload=workload,
        network=network,
        faults=faults,
        config=cfg,
        drift=drift,
        max_requests=max_requests,
        api=api,
        id_gap=id_gap,
    )


def _faults(
    rng: random.Random,
    prefill: tuple[EngineSpec, ...],
    decode: tuple[EngineSpec, ...],
    horizon: float,
    ext: float,
    duration_lease: float,
) -> tuple[Fault, ...]:
    """Up to six faults: crashes, partitions, stalls around the extension and at a lease's edge."""
    names = [e.name for e in prefill] + [e.name for e in decode]
    faults: list[Fault] = []
    for _ in range(rng.randint(0, 6)):
        kind = rng.choice(
            (FaultKind.CRASH, FaultKind.PARTITION, FaultKind.STALL, FaultKind.EDGE_STALL, FaultKind.EDGE_STALL)
        )
        at = rng.uniform(0.0, horizon * 0.8)
        if kind is FaultKind.EDGE_STALL:
            faults.append(Fault(kind, at, rng.uniform(-1.0, 2.0), rng.choice(decode).name))
        elif kind is FaultKind.STALL:
            eng = rng.choice(decode).name
            # Around the extension: the window where validity, expiry and access meet.
            faults.append(Fault(kind, at, rng.uniform(0.5, 1.3) * ext, eng))
        elif kind is FaultKind.CRASH:
            faults.append(Fault(kind, at, rng.uniform(0.1, 2.0) * duration_lease, rng.choice(names)))
        else:
            p, d = rng.choice(prefill).name, rng.choice(decode).name
            faults.append(Fault(kind, at, rng.uniform(0.2, 2.5) * ext, d, p))
    faults.sort(key=lambda f: (f.at, f.engine))
    return tuple(faults)


def _apart_config(rng: random.Random, pinner: LeaseConfig) -> LeaseConfig:
    """A decode engine's own settings, drawn apart from the prefill side's `pinner`: another
    lease duration (longer or shorter), drift bound, margin, access-time bound, frame bound and
    bound on outstanding heartbeat rounds. The protocol's safety must not depend on them
    agreeing (v3: the accessor takes the stricter of its own and the pinner's stated terms)."""
    d = pinner.kv_lease_duration * rng.choice((0.5, 0.8, 1.25, 2.0, 5.0))
    return pinner.with_changes(
        kv_lease_duration=d,
        max_drift_rate=rng.choice((0.0, 1e-4, 1e-3, 1e-2)),
        validity_margin=rng.choice((MIN_VALIDITY_MARGIN, d / 100.0, d / 50.0)),
        max_access_time=min(d, pinner.kv_lease_duration) / 10.0 * rng.choice((0.5, 1.0, 1.5)),
        max_message_bytes=rng.choice((192, 192, 256, 1024)),
        max_outstanding_heartbeats=rng.choice((1, 2, 4, 64, 64)),
    )


def _api_spec(rng: random.Random, duration_lease: float) -> ApiSpec:
    """Which API-level faults a seed has, and how often (each on in about half the seeds)."""

    def knob(*values: float) -> float:
        return rng.choice(values) if rng.random() < 0.5 else 0.0

    return ApiSpec(
        retrack=knob(0.2, 0.5, 1.0),
        abort=knob(0.1, 0.3),
        redispatch=knob(0.1, 0.3),
        notify=knob(0.5, 1.0),
        fail_posted=knob(0.1, 0.3),
        fail_unposted=knob(0.1, 0.3),
        misroute=knob(0.02, 0.1),
        dup_reply=knob(0.3, 1.0),
        disconnect=knob(0.2 / duration_lease, 1.0 / duration_lease),
        exact_end=knob(0.3, 1.0),
        at_expiry=knob(0.02, 0.1),
    )
