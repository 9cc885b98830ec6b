"""A deterministic discrete-event simulator of a P/D cluster running the real kvlease core.

Only time and the network are simulated: every prefill worker holds a real `kvlease.Pinner`,
every decode worker a real `kvlease.Accessor`, and every message goes through `encode`/`decode`.
Used for the policy comparison (`kvlease sim`: fixed 480 s and 30 s timeouts against lease
renewal) and for the fault campaign (`kvlease sim --campaign N`), which checks the protocol's
safety and liveness claims on thousands of small adversarial seeds — network faults (loss,
delay, partitions, crashes, drift) and, in about half the seeds, API-level adversity (`ApiSpec`:
what an engine can do through the API at the worst moment).

Layout: `Cluster` (`_cluster`: the event loop) is built in layers, one module per concern, each
a subclass of the one below: `_kernel` (state, event heaps, clocks, the core objects and their
recording wrapper `_recording`), `_network` (sends, partitions, the handshake side channel),
`_checks` (the safety and liveness claims), `_lifecycle` (workload, router, faults, crashes),
`_prefill` (the pinner side), `_decode` (the accessor side), `_adversity` (API-level misuse).
Beside them: `_results` (`RunResult`, `Violation`), `_world` (clocks, requests, engines, the
simulator's lease records), `_baselines` (the fixed-timeout pinner), `_scenario` (specs and
seeded scenarios), `_doubles` (deliberately broken cores), `_campaign` and `_vector`.

Pure like the rest of the core: virtual time only, no clock, no I/O, no threads; matplotlib and
rich are used only by the CLI (`kvlease/cli/_sim.py`).
"""

from ._campaign import (
    TRACE_FORMAT,
    CampaignFailure,
    CampaignReport,
    campaign,
    failure_record,
    minimize,
    record_vector,
    relevant_trace,
    run_scenario,
    run_seed,
)
from ._cluster import AccessorFactory, Cluster, PinnerFactory, RunResult, Violation
from ._doubles import BUGS
from ._scenario import (
    ApiSpec,
    EngineSpec,
    Fault,
    FaultKind,
    NetworkSpec,
    Policy,
    Scenario,
    WorkloadSpec,
    campaign_scenario,
    default_scenario,
)

__all__ = [
    "BUGS",
    "TRACE_FORMAT",
    "AccessorFactory",
    "ApiSpec",
    "CampaignFailure",
    "CampaignReport",
    "Cluster",
    "EngineSpec",
    "Fault",
    "FaultKind",
    "NetworkSpec",
    "PinnerFactory",
    "Policy",
    "RunResult",
    "Scenario",
    "Violation",
    "WorkloadSpec",
    "campaign",
    "campaign_scenario",
    "default_scenario",
    "failure_record",
    "minimize",
    "record_vector",
    "relevant_trace",
    "run_scenario",
    "run_seed",
]
