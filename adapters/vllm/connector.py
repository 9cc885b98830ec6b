"""vLLM 0.33.0's NIXL pull connector with kvlease as its lease.

Enabled with ``--kv-transfer-config '{"kv_connector": "KvleaseNixlConnector",
"kv_connector_module_path": "kvlease.adapters.vllm", "kv_role": ..., "kv_connector_extra_config":
{"kv_lease_duration": 30}}'``. Everything that moves KV stays vLLM's (agents, its handshake, the
descriptors, TP mapping, the READ); only the lease bookkeeping is replaced:

- **Producer scheduler** (`KvleasePullScheduler.request_finished`) picks the lease id (one per
  request, increasing, for this scheduler's random incarnation) and puts the ticket in
  ``kv_transfer_params["kvlease"]``; the id and incarnation go to every worker in the connector
  metadata, so all ranks grant the same id.
- **Producer worker** grants it in its `Pinner` (instead of vLLM's ``_reqs_to_send`` deadline),
  feeds every notification its agent receives to the driver (kvlease frames, and stock vLLM
  ``HB:`` / ``id:count`` through the compat codec), and reports the driver's `Free`s as
  ``finished_sending``. vLLM's full-scan reaper and ``_handle_heartbeat`` see nothing.
- **Decoder scheduler** tracks a request from queue entry (``on_new_request``) when its params
  carry a ticket; the worker's `Accessor` heartbeats from then on. Without a ticket (a stock
  producer) vLLM's own heartbeats are kept and the log says once that there is no validity
  guarantee for that peer.
- **Decoder worker** asks the accessor before vLLM posts the READ and attaches kvlease's
  access-done to it in place of ``"id:count"``; the READ's outcome is held back from the
  scheduler until the accessor's verdict. A lease reported lost, an access reported stale, or a
  READ refused reaches vLLM's scheduler as a failed load (``failed_recving``), which with
  ``kv_load_failure_policy="recompute"`` recomputes the prompt and otherwise fails the request:
  never decoded from blocks that may have been reused.
"""

from __future__ import annotations

# First: an unsupported vLLM is refused, saying what to do, before its internals load.
from ._vllm_check import VLLM_VERSION, VLLM_VERSION_SUPPORTED

# isort: split

import json
import logging
import operator
import os
import secrets
import sys
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvlease.transports import Driver, TransferFailed, load_frame_auth, new_session
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector, NixlPullConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker

from kvlease import (
    AccessCompleted,
    Accessor,
    AccessStale,
    EndReason,
    Free,
    LeaseKind,
    LeaseLost,
    LeaseTicket,
    PeerTime,
    Pinner,
    ProtocolError,
    is_native_frame,
    is_sealed_frame,
    tp_layout,
)

from ._metrics import KVLEASE_COUNTERS, KvleaseConnectorStats, KvleasePromMetrics
from ._pause import InputPause, engine_input_queue
from ._settings import (
    AdapterSettings,
    TransferBound,
    check_side_channel,
    check_transfer_bound,
    largest_access_bytes,
    read_settings,
    transfer_bound,
    unknown_keys,
)
from ._transport import HELLO_MAGIC, ConnectorTransport, NotifSwap
from ._version import OVERRIDE_ENV, SUPPORTED_SERIES

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KvleaseNixlConnector", "KvleasePullScheduler", "KvleasePullWorker"]

log = logging.getLogger("kvlease.adapters.vllm")

#: Key of the ticket in ``kv_transfer_params`` and of the adapter's part of the metadata.
TICKET_KEY = "kvlease"

#: Seconds between the lease pump's turns while a lease or a track is live, and otherwise (a
#: hello from a new decoder waits at most this long). Small against any heartbeat interval.
PUMP_BUSY = 0.005
PUMP_IDLE = 0.05
#: An engine step whose only work is blocks held for decoders' READs comes at most this often
#: (`KvleasePullScheduler.build_connector_meta`). vLLM steps an engine with pending connector
#: work in a loop with a 1 ms pause: 700-800 steps a second measured in a real `vllm serve`
#: producer, each a round trip to every worker, for as long as any lease was held (on a 2-core
#: host, CPU its decoders needed). The workers' lease pumps answer heartbeats between steps; a
#: step only reports frees to the scheduler, so a lease's end reaches vLLM's block pool at
#: most this much later on an idle producer (a busy one steps anyway). The pause ends early when
#: a request reaches the engine's input queue: it runs on the engine's own thread.
HELD_STEP_EVERY = 0.05
#: A lease pump turn longer than this (ns) is logged at WARNING with where its time went (the
#: agent's notifications or the driver's step): one was seen to stall a decoder's engine.
SLOW_TURN_NS = 1_000_000_000


def ticket_binding(params: Mapping[str, Any]) -> bytes:
    """What a sealed ticket guards, from the transfer parameters it travels in: the producer
    engine, its request id and the block ids to be read. Under a deployment key the ticket's
    tag covers these bytes, so a party on the router's path without the key can neither forge
    a ticket nor attach one to another request's (or engine's) blocks."""
    fields = [params.get("remote_engine_id"), params.get("remote_request_id"), params.get("remote_block_ids")]
    return json.dumps(fields, separators=(",", ":"), sort_keys=True).encode()


def _cpus_allowed() -> frozenset[int] | None:
    """The cores the calling thread may run on (None where the platform does not say)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def _run_on(cpus: frozenset[int] | None) -> None:
    """Let the calling thread run on `cpus` (the process's cores before vLLM pinned its worker).

    On the CPU platform vLLM's NIXL worker pins the worker's main thread to one core per NUMA
    node, and every thread it starts afterwards inherits that: the lease pump then shares one
    core with the model forward (and, with ``VLLM_CPU_OMP_THREADS_BIND=nobind``, its OpenMP
    threads), and needs the GIL the forward's thread holds between its kernels. In a real
    ``vllm serve`` decoder on a 2-core host that starved the pump for seconds at a time: heartbeats
    went out (and answers came in) up to 25 s late, and producers' leases ended while their
    decoders were alive. The pump's work is small; letting the OS place it anywhere costs the
    reserved core nothing."""
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as exc:
            log.debug("kvlease: could not let the lease pump run on cores %s: %s", sorted(cpus), exc)


def _route_logs_through_vllm() -> None:
    """kvlease's loggers write where vLLM's do, in vLLM's format (vLLM configures only its
    own ``vllm`` logger, so without this kvlease's INFO lines were dropped and its warnings
    came out bare). An operator who configured the ``kvlease`` logger keeps that."""
    ours, theirs = logging.getLogger("kvlease"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    level = os.environ.get("KVLEASE_LOGGING_LEVEL", "").upper()
    for handler in theirs.handlers:
        ours.addHandler(handler)
        if level in logging.getLevelNamesMapping():
            # kvlease's own level (e.g. DEBUG while vLLM stays at INFO): vLLM's handler filters
            # at vLLM's level, so let the loggers decide (vLLM's logger keeps its own).
            handler.setLevel(logging.NOTSET)
    ours.setLevel(level if level in logging.getLevelNamesMapping() else (theirs.level or logging.INFO))
    ours.propagate = False


def warn_if_unnamed(vllm_config: VllmConfig, vllm_name: str, role: KVConnectorRole) -> None:
    """Start-up warnings, once per engine (scheduler side). vLLM keys several NIXL checks on the
    connector's name (DCP validation, interleave alignment, ``--enable-return-routed-experts``,
    the CPU Mamba layout): loaded under another name, kvlease would silently lose them. An
    extra-config key nobody reads is named (a typo would leave the default). A decoder whose
    ``kv_load_failure_policy`` is ``"fail"`` turns every read kvlease refuses into a client error."""
    # Each vLLM process configures its logging when it starts, before it builds connectors.
    _route_logs_through_vllm()
    ktc = vllm_config.kv_transfer_config
    if ktc is None or role != KVConnectorRole.SCHEDULER:
        return
    if not VLLM_VERSION_SUPPORTED:
        log.warning(
            "kvlease: vLLM %s is not a release this adapter supports (%s); loaded because %s names it: untested",
            VLLM_VERSION,
            ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_SERIES),
            OVERRIDE_ENV,
        )
    unknown = unknown_keys(ktc.kv_connector_extra_config)
    if unknown:
        log.warning("kvlease: kv_connector_extra_config keys nobody reads (ignored): %s", ", ".join(unknown))
    policy = getattr(ktc, "kv_load_failure_policy", None)
    if ktc.kv_role in ("kv_consumer", "kv_both") and policy == "fail":
        log.warning(
            "kvlease: kv_load_failure_policy is 'fail': a KV read kvlease refuses (lease lost, read "
            "stale) fails the request with an error; 'recompute' recomputes the prompt instead"
        )
    if not ktc.has_connector(vllm_name):
        log.warning(
            "kvlease: loaded as kv_connector %r: vLLM skips the checks it keys on the name %r. Use "
            '"kv_connector": "%s" with "kv_connector_module_path": "kvlease.adapters.vllm" (same class)',
            ktc.kv_connector,
            vllm_name,
            vllm_name,
        )


def _settings_of(vllm_config: VllmConfig) -> AdapterSettings:
    ktc = vllm_config.kv_transfer_config
    return read_settings(ktc.kv_connector_extra_config if ktc is not None else None)


def transfer_bound_of(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, settings: AdapterSettings
) -> TransferBound:
    """This worker's transfer bound: its largest access (every transferred cache group's blocks
    for a request of ``max_model_len`` tokens, in this worker's own KV layout) at the stated
    floor (``kvlease_min_bandwidth``)."""
    groups = kv_cache_config.kv_cache_groups
    ids = getattr(kv_cache_config, "transfer_group_ids", range(len(groups)))
    per_group = [
        (int(spec.block_size), int(spec.page_size_bytes) * len(groups[i].layer_names))
        for i in ids
        if (spec := groups[i].kv_cache_spec) is not None
    ]
    cache = sum(int(t.size) for t in kv_cache_config.kv_cache_tensors)
    nbytes = largest_access_bytes(int(vllm_config.model_config.max_model_len), per_group, cache)
    return transfer_bound(settings, nbytes)


def check_at_start_up(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, role: KVConnectorRole, vllm_name: str, *, push: bool
) -> AdapterSettings:
    """Everything a connector checks before it starts, on every role: the settings (a bad value
    raises `ConfigError` naming the key), what the adapter cannot serve (pipeline parallelism),
    the transfer bound (push: refused when ``max_access_time`` cannot cover the largest WRITE);
    then the start-up warnings (once per engine, scheduler side, see `warn_if_unnamed`)."""
    settings = _settings_of(vllm_config)
    pp = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1))
    if pp > 1:
        # The lease transport addresses pipeline stage 0 only: the other stages' workers would
        # never hear a heartbeat, and free (or be read) outside any lease.
        raise ValueError(
            f"kvlease's {vllm_name} does not support pipeline_parallel_size > 1 (got {pp}): its lease messages "
            f"reach pipeline stage 0 only. Run with pipeline_parallel_size 1 (tensor parallelism is supported), "
            f"or use vLLM's own {vllm_name} (no kvlease module path) for this engine"
        )
    bound = transfer_bound_of(vllm_config, kv_cache_config, settings)
    warnings = check_transfer_bound(settings, bound, push=push)
    warn_if_unnamed(vllm_config, vllm_name, role)
    if role == KVConnectorRole.SCHEDULER:
        for line in warnings:
            log.warning("kvlease: %s", line)
    return settings


# -- scheduler side ------------------------------------------------------------------------------


class KvleasePullScheduler(NixlPullConnectorScheduler):  # type: ignore[misc]
    def __init__(self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self.kvlease_settings = _settings_of(vllm_config)
        # Under a deployment key tickets are sealed (bound to the blocks they guard).
        self._kv_auth = load_frame_auth(self.kvlease_settings.lease)
        #: This producer's pinner incarnation: every worker's `Pinner` takes it from the metadata.
        self.kvlease_incarnation = secrets.randbits(64)
        self._kv_next_id = 1
        self._kv_grants: dict[str, int] = {}
        self._kv_fixed: dict[str, float] = {}  # fixed-TTL grants: request -> deadline (monotonic)
        self._kv_track: dict[str, dict[str, Any]] = {}
        self._kv_tracked: set[str] = set()
        self._kv_untrack: list[str] = []
        self._kv_warned: set[str] = set()
        # Requests whose blocks this producer holds for a decoder's READ (until a worker
        # reports them in finished_sending): the engine must keep stepping meanwhile.
        self._kv_held: set[str] = set()
        self._kv_held_step_due = 0.0  # when the next step for held blocks alone may run
        self._kv_pause: InputPause | None = None  # `_kv_find_input`'s, made on the first step
        self._kv_after_compute = False  # whether the last step scheduled any token

    def has_pending_push_work(self) -> bool:
        """True while this producer holds blocks under a lease. vLLM 0.33 lets an engine whose
        requests have all finished block on its input queue even while their blocks wait for
        decoders' READs: the metadata carrying a grant to the workers would then wait for the
        next request, and a lease's end would free nothing until then. vLLM keeps an engine
        stepping while its connector reports pending work (this hook), about once a
        millisecond."""
        return bool(self._kv_held) or bool(super().has_pending_push_work())

    # producer: one lease id per request, shipped to every worker and to the decoder
    def request_finished(self, request: Request, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        if req_id in self._kv_tracked:
            self._kv_tracked.discard(req_id)
            if self._kv_track.pop(req_id, None) is None:
                self._kv_untrack.append(req_id)
        delay, params = super().request_finished(request, block_ids)
        if delay and params is not None and params.get("do_remote_prefill"):
            lease_id = self._kv_next_id
            self._kv_next_id += 1
            self._kv_grants[req_id] = lease_id
            self._kv_held.add(req_id)
            params[TICKET_KEY] = self._kv_ticket(
                params,
                LeaseTicket(
                    engine_id=self.engine_id,
                    incarnation=self.kvlease_incarnation,
                    lease_id=lease_id,
                    ranks=self.transfer_tp_size,
                ),
            )
        elif delay and params is not None and params.get("do_remote_decode") and self.is_bidirectional_kv_xfer_enabled:
            # Bidirectional turn 1 ends on the decoder: its blocks stay for the producer's turn-2
            # READ under a fixed-TTL lease (vLLM's decoder_kv_blocks_ttl). The deadline is in
            # this host's monotonic clock, which the workers' drivers read too; the reader
            # converts it with its continuously refined clock-offset estimate, not a one-shot one.
            lease_id = self._kv_next_id
            self._kv_next_id += 1
            deadline = time.monotonic() + float(self.decoder_kv_blocks_ttl)
            self._kv_grants[req_id] = lease_id
            self._kv_fixed[req_id] = deadline
            self._kv_held.add(req_id)
            params[TICKET_KEY] = self._kv_ticket(
                params,
                LeaseTicket(
                    engine_id=self.engine_id,
                    incarnation=self.kvlease_incarnation,
                    lease_id=lease_id,
                    kind=LeaseKind.FIXED_TTL,
                    deadline=PeerTime(deadline),
                    ranks=self.transfer_tp_size,
                ),
            )
        return delay, params

    def _kv_ticket(self, params: dict[str, Any], ticket: LeaseTicket) -> dict[str, Any]:
        if self._kv_auth is None:
            return ticket.to_dict()
        return ticket.sealed_dict(self._kv_auth, ticket_binding(params))

    # decoder: track from queue entry
    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params
        ticket = None if params is None else params.get(TICKET_KEY)
        turn2 = (
            params is not None
            and params.get("do_remote_decode")
            and self.is_bidirectional_kv_xfer_enabled
            and ticket is not None
            and params.get("remote_block_ids")
        )
        if turn2:
            # Bidirectional turn 2: this producer will READ the decoder's blocks; track the
            # decoder's fixed-TTL lease from queue entry (vLLM's own handling runs too).
            super().on_new_request(request)
        elif params is None or not params.get("do_remote_prefill") or ticket is None:
            if params is not None and params.get("do_remote_prefill"):
                engine = str(params.get("remote_engine_id"))
                if engine not in self._kv_warned and len(self._kv_warned) < 1024:
                    self._kv_warned.add(engine)
                    log.warning(
                        "kvlease: producer %r sent no lease ticket (a stock vLLM producer): falling back to "
                        "vLLM's own heartbeats, with no validity guarantee for KV read from that peer",
                        engine,
                    )
            super().on_new_request(request)
            return
        self._kv_track[request.request_id] = {
            "ticket": ticket,
            "remote_request_id": params.get("remote_request_id"),
            "binding": ticket_binding(params).decode(),
            "host": params.get("remote_host"),
            "port": params.get("remote_port"),
            "tp_size": params.get("tp_size", 1),
            "dcp_size": params.get("dcp_size", 1),
            "pp_size": params.get("pp_size", 1),
        }
        self._kv_tracked.add(request.request_id)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        if self._kv_pause is None:
            self._kv_pause = self._kv_find_input(sys._getframe(1))
        computes = bool(scheduler_output.total_num_scheduled_tokens)
        after_compute, self._kv_after_compute = self._kv_after_compute, computes
        if (
            self._kv_held
            and not computes
            and not after_compute
            and not (self._kv_grants or self._kv_fixed or self._kv_track or self._kv_untrack)
        ):
            # A step for held blocks alone (see HELD_STEP_EVERY): paced by a pause that a new
            # request (or an abort) ends at once (`_kv_find_input`). Never the step right after
            # one that computed: with vLLM's async scheduling (0.33's default on GPUs; the CPU
            # platform turns it off) the engine schedules that step while the previous one
            # still runs and takes the previous one's output only after it, so a pause there
            # would hold back the prefill's own token (the producer's answer to the router) and
            # the requests it finished, whose grants every decoder's first heartbeat waits for
            # (the pinner holds a heartbeat naming a lease not granted yet).
            now = time.monotonic()
            if now < self._kv_held_step_due:
                self._kv_pause(self._kv_held_step_due - now)
                now = time.monotonic()
            self._kv_held_step_due = now + HELD_STEP_EVERY
        meta = super().build_connector_meta(scheduler_output)
        meta.kvlease = {
            "incarnation": self.kvlease_incarnation,
            # The scheduler's clock when the metadata left: fixed-TTL deadlines cross to the
            # workers as what is left of them, since a worker may run on another host.
            "sched_now": time.monotonic(),
            "grants": self._kv_grants,
            "fixed": self._kv_fixed,
            "track": self._kv_track,
            "untrack": self._kv_untrack,
        }
        self._kv_grants, self._kv_fixed, self._kv_track, self._kv_untrack = {}, {}, {}, []
        return meta

    @staticmethod
    def _kv_find_input(frame: Any) -> InputPause:
        """The pause of a step for held blocks alone: it runs on the engine's own thread, and
        waits on the engine core's input queue, found once on the scheduler's call stack, so a
        request (or an abort) that arrives ends it at once (`_pause.InputPause`). A plain sleep
        there held every request that came in meanwhile: on a producer that holds blocks all
        the time (a loaded one) 15 ms more to its first token, measured (bench/vllm_serve.py
        --paired). Said once in the log, either way."""
        pause = InputPause(engine_input_queue(frame))
        if pause.wakes_on_input:
            log.info(
                "kvlease: a step for held blocks alone waits at most %g s, or until a request arrives",
                HELD_STEP_EVERY,
            )
        else:
            log.warning(
                "kvlease: the engine core's input queue is not on the scheduler's call stack: a step for held "
                "blocks alone sleeps %g s, and a request that arrives meanwhile waits for it",
                HELD_STEP_EVERY,
            )
        return pause

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        for req_id in connector_output.finished_recving or ():
            self._kv_tracked.discard(req_id)
        for req_id in connector_output.finished_sending or ():
            self._kv_held.discard(req_id)


# -- worker side ---------------------------------------------------------------------------------


#: Reads every exported driver counter at once (a tuple, in `KVLEASE_COUNTERS` order).
_READ_COUNTERS = operator.attrgetter(*KVLEASE_COUNTERS)
#: The counters that move on nearly every busy step (heartbeats and the renewals they carry):
#: their gains are reported at most every `_STATS_EVERY` seconds. The others count what an
#: operator alerts on (a lease completed, expired, lost, a read refused, a peer given up) and go
#: out with the step they happen in, so an engine that goes idle right after never hides one.
_CHATTER = frozenset({"leases_renewed", "heartbeats_sent", "heartbeats_received", "heartbeat_acks_received"})
_READ_EVENT_COUNTERS = operator.attrgetter(*(name for name in KVLEASE_COUNTERS if name not in _CHATTER))
#: How often the chatter counters' gains reach vLLM's stats, at most, seconds (`_kv_record_stats`).
_STATS_EVERY = 0.5


class _KvleaseWorkerBase:
    """What the pull and the push worker share: the kvlease driver, built on the first step
    (the pinner needs the incarnation the scheduler sends), and the driver's counters reported
    to vLLM's `KVConnectorStats` as per-step deltas."""

    kvlease_settings: AdapterSettings
    #: The largest access of this worker and the transfer timeout it sizes (`transfer_bound_of`).
    kvlease_bound: TransferBound
    kvlease_transport: ConnectorTransport
    kvlease_driver: Driver | None
    engine_id: str
    transfer_tp_rank: int
    transfer_tp_size: int
    xfer_stats: KvleaseConnectorStats
    _kv_pinner_role: bool
    _kv_accessor_role: bool
    _kv_incarnation: int | None
    _kv_counted: dict[str, int]
    #: The driver's counters as last reported, and when they are next due.
    _kv_seen: tuple[int, ...] = (0,) * len(KVLEASE_COUNTERS)
    _kv_seen_events: tuple[int, ...] = (0,) * (len(KVLEASE_COUNTERS) - len(_CHATTER))
    _kv_stats_due: float = 0.0

    def _kv_ensure_driver(self, incarnation: int | None) -> Driver:
        if self.kvlease_driver is not None:
            return self.kvlease_driver
        cfg = self.kvlease_settings.lease
        pinner = None
        if self._kv_pinner_role:
            if incarnation is None:
                raise RuntimeError("the kvlease scheduler did not send its incarnation")
            pinner = Pinner(cfg, self.engine_id, incarnation, rank=self.transfer_tp_rank, ranks=self.transfer_tp_size)
            self._kv_incarnation = incarnation
        accessor = None
        if self._kv_accessor_role:
            accessor = Accessor(
                cfg, self.engine_id, session=new_session(), rank=self.transfer_tp_rank, ranks=self.transfer_tp_size
            )
        s = self.kvlease_settings
        self.kvlease_driver = Driver(
            self.kvlease_transport,
            pinner=pinner,
            accessor=accessor,
            engine_ttl=s.engine_ttl,
            transfer_timeout=self.kvlease_bound.timeout,
            vllm_compat=s.vllm_compat,
        )
        self._kv_driver_ready()
        return self.kvlease_driver

    def _kv_driver_ready(self) -> None:
        """Called once the driver exists (the pull worker starts its lease pump here)."""

    @staticmethod
    def _kv_deltas(counted: dict[str, int], current: dict[str, int]) -> dict[str, int]:
        """What each counter gained since last reported (and remember the new values)."""
        deltas = {}
        for name, seen in counted.items():
            now = current[name]
            if now != seen:
                deltas[name] = now - seen
                counted[name] = now
        return deltas

    def _kv_record_stats(self, driver: Driver) -> bool:
        """The counters' gains since the last report, into vLLM's stats of this step: at once when
        an event counter moved, else at most every `_STATS_EVERY` seconds (the chatter summed over
        the steps in between). A step whose connector stats are not empty makes vLLM copy them and
        ship them to the scheduler (another process under TP), and the chatter moves on nearly
        every busy step; a step with no event pays a tuple comparison and one clock read.
        Whether a report was made."""
        events = _READ_EVENT_COUNTERS(driver.stats)
        now = time.monotonic()
        if events == self._kv_seen_events and now < self._kv_stats_due:
            return False
        self._kv_seen_events = events
        self._kv_stats_due = now + _STATS_EVERY
        values = _READ_COUNTERS(driver.stats)
        if values == self._kv_seen:
            return True
        self._kv_seen = values
        deltas = self._kv_deltas(self._kv_counted, dict(zip(KVLEASE_COUNTERS, values, strict=True)))
        if deltas:
            self.xfer_stats.record_kvlease(deltas)
        return True


class KvleasePullWorker(_KvleaseWorkerBase, NixlPullConnectorWorker):  # type: ignore[misc]
    nixl_wrapper: Any

    def __init__(self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig) -> None:
        # The cores this process may run on, before vLLM's NIXL worker pins this thread (on the
        # CPU platform: to the last core of each NUMA node). The lease pump runs on these.
        self._kv_cpus = _cpus_allowed()
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self.kvlease_settings = _settings_of(vllm_config)
        self.kvlease_bound = transfer_bound_of(vllm_config, kv_cache_config, self.kvlease_settings)
        self._kv_auth = load_frame_auth(self.kvlease_settings.lease)
        role = vllm_config.kv_transfer_config.kv_role
        # Bidirectional KV transfer: the decoder also holds blocks (turn 1's) for the producer,
        # which also reads (turn 2): both roles on both sides.
        both = bool(self._bidirectional_kv_xfer_enabled) or role == "kv_both"
        self._kv_pinner_role = role == "kv_producer" or both
        self._kv_accessor_role = role == "kv_consumer" or both
        self._kv_swap: dict[str, dict[int, bytes]] = {}  # remote request id -> rank -> access-done
        agent: Any = self.nixl_wrapper
        self.nixl_wrapper = NotifSwap(agent, self._kv_swap, self._remote_agents)
        self._kv_engines: dict[str, dict[str, Any]] = {}  # producer -> its side channel, as vLLM names it
        self.kvlease_transport = ConnectorTransport(
            self.nixl_wrapper, engine_id, self.transfer_tp_rank, self._remote_agents, self._kv_handshake
        )
        self.kvlease_driver: Driver | None = None
        self._kv_incarnation: int | None = None
        self._kv_granted: set[str] = set()
        self._kv_tickets: dict[str, LeaseTicket] = {}  # tracked request -> ticket
        self._kv_remote_id: dict[str, str] = {}  # READ posted: request -> producer's request id
        # Tracked request -> the producer's request id its ticket came with: a READ meta of the
        # same (reused) request id for another producer request is not this lease's business.
        self._kv_source: dict[str, str] = {}
        self._kv_reading: set[str] = set()  # READ posted, vLLM has not reported it yet
        self._kv_verdict: set[str] = set()  # READ reported by vLLM, waiting for the accessor
        self._kv_failed: set[str] = set()  # the accessor gave the access up before vLLM reported it
        # Tracked requests whose lease was lost before their READ: the READ is refused (a failed
        # load), never made without a lease.
        self._kv_lost: set[str] = set()
        self._kv_deferred: list[tuple[str, Any]] = []  # READs waiting for the kvlease handshake
        # The lease pump (a thread: see _kv_pump_loop) and the engine's step share the driver,
        # the transport and the agent's notifications under this lock.
        self._kv_lock = threading.RLock()
        self._kv_stop = threading.Event()
        self._kv_pump: threading.Thread | None = None
        self._kv_events: list[Any] = []  # driver events the pump produced, for the next step
        self._kv_unframed = 0  # non-kvlease notifications dropped (compat off), for vLLM's stats
        self._kv_work_ns = 0  # time in kvlease's own code not yet reported (WORK_COUNTERS)
        self._kv_turns = 0
        # vLLM's per-step connector stats, with kvlease's counters in them (see _metrics).
        self.xfer_stats = KvleaseConnectorStats()
        self._kv_counted = dict.fromkeys(KVLEASE_COUNTERS, 0)

    # -- set-up ------------------------------------------------------------------------------

    def _kv_handshake(self, engine_id: str) -> Any:
        info = self._kv_engines[engine_id]  # KeyError: no side channel known
        return self._ensure_handshake(
            engine_id, info["host"], info["port"], info["tp_size"], info["dcp_size"], info["pp_size"]
        )

    # -- per step: metadata in ---------------------------------------------------------------

    # -- the lease pump ----------------------------------------------------------------------

    def _kv_driver_ready(self) -> None:
        self._kv_pump = threading.Thread(target=self._kv_pump_loop, name="kvlease-lease-pump", daemon=True)
        self._kv_pump.start()

    def _kv_pump_loop(self) -> None:
        """The driver's turns between engine steps. vLLM steps an engine only while it has work
        for the scheduler: a producer whose requests all wait for their READs sits idle
        (blocked on its input queue) with their blocks pinned, and a busy one may not step for a
        whole forward pass. The lease protocol needs answers within a heartbeat interval, so this
        thread drains the agent's notifications and runs the driver's step (heartbeats, their
        acknowledgements, expiries, handshakes) every `PUMP_BUSY` seconds while a lease or a
        track is live, every `PUMP_IDLE` otherwise. What it yields is handed to vLLM on the
        engine's next step (`get_transfer_results`): the pump frees nothing itself."""
        _run_on(self._kv_cpus)
        debug = log.isEnabledFor(logging.DEBUG)
        while not self._kv_stop.is_set():
            busy = False
            asked = time.monotonic() if debug else 0.0
            with self._kv_lock:
                if debug and (waited := time.monotonic() - asked) > 0.1:
                    log.debug("kvlease: the lease pump waited %.3f s for the engine step's lock", waited)
                driver = self.kvlease_driver
                if driver is not None:
                    t0 = time.perf_counter_ns()
                    cpu0 = time.thread_time_ns()
                    try:
                        self._kv_drain()
                        drained = time.perf_counter_ns()
                        self._kv_events.extend(driver.step())
                        busy = driver.next_deadline() is not None
                        done = time.perf_counter_ns()
                        if done - t0 > SLOW_TURN_NS or (debug and done - t0 > 200_000_000):
                            # A turn this long holds the engine's step too (it takes the same
                            # lock): said at WARNING, so a stalled decoder's log says where. The
                            # thread's own CPU time tells work from waiting (for the interpreter
                            # behind another thread, for the OS, or in a blocking call).
                            log.log(
                                logging.WARNING if done - t0 > SLOW_TURN_NS else logging.DEBUG,
                                "kvlease: slow lease pump turn: drain %.3f s, driver step %.3f s, thread CPU %.3f s",
                                (drained - t0) / 1e9,
                                (done - drained) / 1e9,
                                (time.thread_time_ns() - cpu0) / 1e9,
                            )
                    except Exception:  # never let the pump die: the engine's steps go on
                        log.exception("kvlease: lease pump step failed")
                    self._kv_work_ns += time.perf_counter_ns() - t0
                    self._kv_turns += 1
            self._kv_stop.wait(PUMP_BUSY if busy else PUMP_IDLE)

    def shutdown(self) -> None:
        self._kv_stop.set()
        super().shutdown()

    def _kv_acquire(self, what: str) -> None:
        """Take the lease lock for the engine's step (`what`). A wait longer than
        `SLOW_TURN_NS` is logged at WARNING: the engine stood still that long behind the lease
        pump (the clock is read only when the lock is not free at once)."""
        if self._kv_lock.acquire(blocking=False):
            return
        t0 = time.perf_counter_ns()
        self._kv_lock.acquire()
        if (waited := time.perf_counter_ns() - t0) > SLOW_TURN_NS:
            log.warning("kvlease: the engine's step waited %.3f s for the lease lock (%s)", waited / 1e9, what)

    def start_load_kv(self, metadata: Any) -> None:
        self._kv_acquire("start_load_kv")
        try:
            self._kv_start_load(metadata)
        finally:
            self._kv_lock.release()

    def _kv_start_load(self, metadata: Any) -> None:
        t0 = time.perf_counter_ns()
        kv = getattr(metadata, "kvlease", None) or {}
        driver = self._kv_ensure_driver(kv.get("incarnation"))
        if driver.accessor is not None:
            # Untracks first: one names a request the scheduler shipped a track for in an
            # earlier step, so a track of the same id in this metadata is a later request
            # (request ids kept as the client sent them, e.g. with
            # VLLM_DISABLE_REQUEST_ID_RANDOMIZATION). The other order would untrack the new
            # request's lease, or erase its loss record, and let its READ run unleased.
            for req_id in kv.get("untrack", ()):
                self._kv_untrack(driver, req_id)
            tracks = kv.get("track", {})
            for req_id, info in tracks.items():
                self._kv_track(driver, req_id, info)
            if tracks:
                # The new leases' first heartbeat leaves now, before this step's READs are
                # posted and its forward runs: its acknowledgement then has the whole forward
                # to come back, and a READ that ends inside the window it grants completes in
                # this step's `get_transfer_results` instead of waiting for the producer's
                # verdict and vLLM's next step (left to the lease pump, the heartbeat left up to
                # a pump period later, behind the forward for the interpreter: most READs
                # waited one more decoder step for their first token).
                self._kv_drain()
                self._kv_events.extend(driver.step())
            deferred, self._kv_deferred = self._kv_deferred, []
            for req_id, meta in deferred:
                self._read_blocks_for_req(req_id, meta)
        t1 = time.perf_counter_ns()
        super().start_load_kv(metadata)
        t0 += time.perf_counter_ns() - t1  # vLLM's own work is not kvlease's cost
        try:
            self._kv_grant(driver, kv)
        finally:
            self._kv_work_ns += time.perf_counter_ns() - t0

    def _kv_grant(self, driver: Driver, kv: dict[str, Any]) -> None:
        grants = kv.get("grants", {})
        if grants and driver.pinner is not None:
            if kv.get("incarnation") != self._kv_incarnation:
                raise RuntimeError("the kvlease scheduler's incarnation changed under a running worker")
            fixed = kv.get("fixed", {})
            for req_id, lease_id in grants.items():
                # vLLM's worker took the request (it is still to be processed): grant instead of
                # vLLM's deadline, which its reaper would otherwise scan every step.
                if self._reqs_to_send.pop(req_id, None) is None:
                    continue
                deadline = fixed.get(req_id)
                if deadline is None:
                    driver.grant(req_id, lease_id=lease_id)
                else:
                    # What is left of the scheduler's deadline when the metadata left it, from
                    # this worker's own clock: never shorter than the ticket's deadline in real
                    # time (the metadata's latency only lengthens it), whatever this host's clock
                    # epoch (multi-node TP). The reader converts the deadline with rank 0's
                    # clock samples, so rank 0 must share the scheduler's clock (its host).
                    sched_now = kv.get("sched_now")
                    left = float(deadline) - (float(sched_now) if sched_now is not None else float(driver.now()))
                    ttl = max(left, 1e-3)
                    driver.grant(req_id, lease_id=lease_id, kind=LeaseKind.FIXED_TTL, ttl=ttl)
                self._kv_granted.add(req_id)

    def _kv_track(self, driver: Driver, req_id: str, info: dict[str, Any]) -> None:
        source = info.get("remote_request_id")
        if source is not None:
            self._kv_source[req_id] = str(source)
        try:
            ticket = LeaseTicket.from_dict(
                info["ticket"], auth=self._kv_auth, bind=str(info.get("binding", "")).encode()
            )
        except ProtocolError as exc:
            # Not heartbeated by vLLM either (the scheduler took the kvlease path): never read it.
            log.warning("kvlease: request %s carries a malformed lease ticket (%s): its load will fail", req_id, exc)
            self._kv_lost.add(req_id)
            return
        self._kv_engines[ticket.engine_id] = info
        self._kv_tickets[req_id] = ticket
        host, port = info.get("host"), info.get("port")
        try:
            driver.track(req_id, ticket, address=f"{host}:{port}")
        except ProtocolError as exc:
            log.warning("kvlease: cannot track %s (%s): its load will fail", req_id, exc)
            self._kv_tickets.pop(req_id, None)
            self._kv_lost.add(req_id)

    def _kv_untrack(self, driver: Driver, req_id: str) -> None:
        if req_id in self._kv_reading or req_id in self._kv_verdict:
            return
        self._kv_lost.discard(req_id)
        self._kv_tickets.pop(req_id, None)
        self._kv_source.pop(req_id, None)
        remote = self._kv_remote_id.pop(req_id, None)
        if remote is not None:
            self._kv_swap.pop(remote, None)
        assert driver.accessor is not None
        if driver.accessor.state_of(req_id) is not None:
            driver.untrack(req_id)

    # -- the READ ----------------------------------------------------------------------------

    def _read_blocks(self, read_spec: Any, *args: Any, **kwargs: Any) -> Any:
        # One READ per remote rank: its notification is that rank's access-done.
        with self.nixl_wrapper.for_rank(int(read_spec.remote_rank)):
            return super()._read_blocks(read_spec, *args, **kwargs)

    def _read_blocks_for_req(self, req_id: str, meta: Any) -> None:
        with self._kv_lock:
            self._kv_read_blocks_for_req(req_id, meta)

    def _kv_read_blocks_for_req(self, req_id: str, meta: Any) -> None:
        driver = self.kvlease_driver
        source = self._kv_source.get(req_id)
        if source is not None and source != meta.remote.request_id:
            # Another request under the same id (vLLM's notify-only cleanup of an aborted one,
            # with ids reused): the lease tracked under this id, and its loss record, are not
            # that request's to end or to consume.
            super()._read_blocks_for_req(req_id, meta)
            return None
        ticket = self._kv_tickets.get(req_id)
        if req_id in self._kv_lost:
            self._kv_lost.discard(req_id)
            if any(len(group) > 0 for group in meta.local_block_ids):
                self._kv_refuse(req_id, "its lease was lost")
            else:
                self._kv_source.pop(req_id, None)
                super()._read_blocks_for_req(req_id, meta)  # nothing to read: vLLM's notify-only path
            return None
        if driver is None or ticket is None:
            super()._read_blocks_for_req(req_id, meta)
            return None
        engine_id = meta.remote.engine_id
        if ticket.engine_id != engine_id:
            # The lease must be the one on the memory read: a ticket of another producer engine
            # (params mixed up on the way) guards nothing there.
            self._kv_refuse(req_id, f"its ticket is for engine {ticket.engine_id!r}, the READ is from {engine_id!r}")
            return None
        if (
            engine_id not in self._remote_agents
            or engine_id in self._invalid_remote_engines
            or self._remote_registration_generations.get(engine_id, 0) < meta.remote.registration_generation
        ):
            # vLLM's handshake first (it queues the request again when done) or its failure path.
            # A newer registration generation (the producer slept and registered its KV cache
            # again) makes vLLM drop the producer's agents and handshake again: the access begins
            # when vLLM queues the READ again, not now (an access opened now would still be open
            # then, and the READ refused).
            super()._read_blocks_for_req(req_id, meta)
            return None
        if not any(len(group) > 0 for group in meta.local_block_ids):
            # Nothing to read (a full local prefix hit, or an aborted request): the lease ends.
            self._kv_untrack(driver, req_id)
            super()._read_blocks_for_req(req_id, meta)
            return None
        targets = tp_layout(ticket.ranks, self.transfer_tp_size, self.transfer_tp_rank).targets
        into: Any = None if len(targets) == 1 else dict.fromkeys(targets)
        self.kvlease_transport.expect(req_id)
        try:
            decision = driver.read(req_id, "kv", into)
        finally:
            self.kvlease_transport.expect(None)
        if not decision.allowed:
            if "handshake pending" in decision.reason:
                self._kv_deferred.append((req_id, meta))
                return None
            self._kv_refuse(req_id, decision.reason)
            return None
        notifs = self.kvlease_transport.notifications(req_id)
        remote_id = meta.remote.request_id
        if notifs:
            self._kv_swap[remote_id] = notifs
            self._kv_remote_id[req_id] = remote_id
        self._kv_reading.add(req_id)
        # A turn-2 READ is judged by the accessor (fixed-TTL lease, continuous clock-offset
        # estimate), not by vLLM's one-shot offset from the handshake.
        meta.remote.blocks_expiry_time = None
        super()._read_blocks_for_req(req_id, meta)
        if notifs:
            self._kv_notify_unread(engine_id, req_id, notifs)
        return None

    def _kv_notify_unread(self, engine_id: str, req_id: str, notifs: dict[int, bytes]) -> None:
        """Hand the access-done to the producer ranks the lease maps this rank to that vLLM's TP
        mapping does not read. vLLM reads one producer rank per distinct KV head (GQA dedup in
        ``compute_tp_mapping``: with more producer ranks than KV heads, ranks holding the same
        head are read once); kvlease's layout names every rank this one maps to, so the skipped
        ranks would hold their blocks until the lease expired, and a READ that needs their
        confirmation would wait for answers that never come and be reported stale. Nothing of
        theirs is read, so nothing can overlap their free. (MLA's unread replicas vLLM notifies
        itself, with the access-done swapped in by `NotifSwap`.)"""
        plan = self.tp_mappings.get(engine_id)
        if plan is None or self.use_mla:
            return
        read = set(plan.all_source_ranks)
        agents = self._remote_agents.get(engine_id, {})
        for rank, note in notifs.items():
            agent = None if rank in read else agents.get((0, rank))
            if agent is None:
                continue
            try:
                self.nixl_wrapper.send_raw(agent, note)
            except Exception as exc:  # a lost access-done: that rank frees at expiry
                log.warning("kvlease: access-done for unread producer rank %d of %s not sent: %s", rank, req_id, exc)

    def _kv_refuse(self, req_id: str, reason: str) -> None:
        """Do not READ `req_id`: report it to vLLM's scheduler as a failed load."""
        log.warning("kvlease: not reading %s (%s): reported as a failed load", req_id, reason)
        self._kv_forget(req_id)
        self.xfer_stats.record_kv_expired_req()
        self._handle_failed_transfer(req_id, None, self._recv_failures, record_failed_transfer=False)

    def _kv_forget(self, req_id: str) -> None:
        self._kv_tickets.pop(req_id, None)
        self._kv_source.pop(req_id, None)
        self._kv_reading.discard(req_id)
        self._kv_verdict.discard(req_id)
        self._kv_failed.discard(req_id)
        remote = self._kv_remote_id.pop(req_id, None)
        if remote is not None:
            self._kv_swap.pop(remote, None)

    # -- per step: notifications in, results out ---------------------------------------------

    def _get_new_notifs(self) -> set[str]:
        self._kv_drain()
        return set()

    def _kv_drain(self) -> None:
        """Every notification goes to the driver: kvlease frames, hellos, and stock vLLM `HB:` /
        `id:count` (the compat codec), so no request is ever freed by vLLM's own bookkeeping.
        Under the lock (the engine's step or the pump)."""
        notifs_by_agent = self.nixl_wrapper.get_new_notifs()
        if not notifs_by_agent:
            return
        feed = self.kvlease_transport.feed
        compat = self.kvlease_settings.vllm_compat
        for agent_name, notifs in notifs_by_agent.items():
            name = agent_name.decode() if isinstance(agent_name, bytes) else str(agent_name)
            for notif in notifs:
                data = notif if type(notif) is bytes else bytes(notif)
                if not compat and not (is_native_frame(data) or is_sealed_frame(data) or data.startswith(HELLO_MAGIC)):
                    self._kv_unframed += 1
                    continue
                feed(name, data)

    #: The quiet step (`get_transfer_results`): until when the driver has nothing to do, and
    #: its `changes` when that was said.
    _kv_quiet_until: float = float("-inf")
    _kv_quiet_mark: int = -1

    def get_transfer_results(self) -> Any:
        self._kv_acquire("get_transfer_results")
        try:
            return self._kv_get_transfer_results()
        finally:
            self._kv_lock.release()

    def _kv_get_transfer_results(self) -> Any:
        res = super().get_transfer_results()
        t0 = time.perf_counter_ns()
        try:
            driver = self.kvlease_driver
            if driver is None:
                return self._kv_transfer_results(res)
            if (
                driver.changes == self._kv_quiet_mark
                and not self._kv_events
                and not self._kv_unframed
                and not (self._kv_reading and res.finished_recving)
                and self.kvlease_transport.idle()
                and time.monotonic() < self._kv_quiet_until
            ):
                # Nothing arrived, nothing called the driver, no timer or stats report is
                # due: the driver's step would change nothing (most steps of a busy server).
                return res
            res = self._kv_transfer_results(res)
            self._kv_quiet_mark = driver.changes
            self._kv_quiet_until = min(driver.idle_until(), self._kv_stats_due)
            return res
        finally:
            self._kv_work_ns += time.perf_counter_ns() - t0
            self._kv_turns += 1
            if self._kv_work_ns >= 1_000_000:  # reported once a millisecond of work piled up
                us, self._kv_work_ns = divmod(self._kv_work_ns, 1000)
                self.xfer_stats.record_kvlease({"lease_work_us": us, "lease_turns": self._kv_turns})
                self._kv_turns = 0

    def _kv_transfer_results(self, res: Any) -> Any:
        """vLLM's transfer results of this step, with kvlease's verdicts on READs and its frees
        (what the step costs with nothing to do is a driver step and a stats check)."""
        if self._kv_unframed:
            for _ in range(self._kv_unframed):
                self.xfer_stats.record_notification_after_expiry()
            self._kv_unframed = 0
        driver = self.kvlease_driver
        if driver is None:
            return res
        if self._kv_reading and res.finished_recving:
            transport = self.kvlease_transport
            for req_id in self._kv_reading & res.finished_recving:
                self._kv_reading.discard(req_id)
                ok = req_id not in res.failed_recving
                res.finished_recving.discard(req_id)
                res.failed_recving.discard(req_id)
                if req_id in self._kv_failed or not transport.complete(req_id, ok):
                    # The accessor gave this access up already (timed out or peer dead).
                    self._kv_forget(req_id)
                    res.finished_recving.add(req_id)
                    res.failed_recving.add(req_id)
                    continue
                self._kv_verdict.add(req_id)
        events = driver.step()
        if self._kv_events:  # what the lease pump produced since the last step
            events, self._kv_events = [*self._kv_events, *events], []
        for ev in events:
            if isinstance(ev, Free):
                if ev.key in self._kv_granted:
                    self._kv_granted.discard(ev.key)
                    self._reqs_to_process.discard(ev.key)
                    res.finished_sending.add(ev.key)
                    if ev.reason is EndReason.EXPIRED:
                        self.xfer_stats.record_kv_expired_req()
                        log.warning("kvlease: lease of %s expired: its KV blocks are freed", ev.key)
            elif isinstance(ev, AccessCompleted):
                if ev.key in self._kv_verdict:
                    self._kv_forget(ev.key)
                    res.finished_recving.add(ev.key)
            elif isinstance(ev, AccessStale | LeaseLost | TransferFailed):
                key = ev.key
                if key in self._kv_verdict:
                    self._kv_forget(key)
                    res.finished_recving.add(key)
                    res.failed_recving.add(key)
                    self.xfer_stats.record_kv_expired_req()
                    log.warning("kvlease: KV read for %s is not valid (%s): reported as a failed load", key, ev)
                elif key in self._kv_reading:
                    self._kv_failed.add(key)
                elif self._kv_tickets.pop(key, None) is not None:
                    self._kv_lost.add(key)
                    log.warning("kvlease: lease of %s lost before its READ (%s): the READ will be refused", key, ev)
        self._kv_record_stats(driver)
        return res


# -- the connector -------------------------------------------------------------------------------


class _KvleaseConnectorCommon:
    """Both connectors report kvlease's counters through vLLM's own stats and Prometheus
    classes (pull and push share these two hooks), and check the handshake listener's port
    before vLLM binds it."""

    connector_scheduler: Any

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        """vLLM starts the NIXL handshake listener here (once), and waits for its bind without a
        bound: a port already taken fails the start-up instead, naming the setting."""
        scheduler = self.connector_scheduler
        if scheduler is not None and scheduler._nixl_handshake_listener_t is None:
            check_side_channel(scheduler.side_channel_host, int(scheduler.side_channel_port))
        super().set_xfer_handshake_metadata_pp_aware(metadata)  # type: ignore[misc]

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvleaseConnectorStats:
        return KvleaseConnectorStats(data=data) if data is not None else KvleaseConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvleasePromMetrics:
        return KvleasePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


class KvleaseNixlConnector(_KvleaseConnectorCommon, NixlPullConnector):  # type: ignore[misc]
    """vLLM's pull-mode NIXL connector (``NixlConnector``) with kvlease leases."""

    connector_scheduler: KvleasePullScheduler | None
    connector_worker: KvleasePullWorker | None

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        # Settings first: a bad value fails here, naming the key, before anything starts.
        check_at_start_up(vllm_config, kv_cache_config, role, "NixlConnector", push=False)
        # NixlPullConnector.__init__ would build vLLM's own scheduler or worker (a worker owns a
        # NIXL agent): skip to the base, which sets up what both modes share.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KvleasePullScheduler(vllm_config, self.engine_id, kv_cache_config)
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            self.connector_scheduler = None
            self.connector_worker = KvleasePullWorker(vllm_config, self.engine_id, kv_cache_config)
