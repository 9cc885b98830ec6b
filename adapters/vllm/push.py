"""vLLM 0.33.0's NIXL push connector (``NixlPushConnector``) with kvlease leases.

Enabled with ``--kv-transfer-config '{"kv_connector": "KvleaseNixlPushConnector",
"kv_connector_module_path": "kvlease.adapters.vllm", "kv_role": ..., "kv_connector_extra_config":
{"kv_lease_duration": 30}}'``. In push mode the decoder (D) allocates destination blocks and
registers them with the producer (P) in a ``PUSH_REG`` notification; P's ``nixl-push-writer``
thread WRITEs P's blocks into them. Stock vLLM guards D's blocks only with a soft watchdog, so a
WRITE that lands after D gave its blocks back corrupts another request. Here:

- **D's destination blocks are under a kvlease push lease, D is the pinner.** D's scheduler
  (`KvleasePushScheduler.update_state_after_alloc`) picks the lease id when it stages the
  registration and puts the ticket in it (``reg["kvlease"]``, which a stock P ignores); the id
  goes to every D worker in the connector metadata and each grants it (``push=True``) before
  vLLM's writer sends the registration. A push lease is freed only after its expiry plus the
  push guard ``G = max_access_time * (1 + rho)``. The pinner's `Free` reaches vLLM's scheduler as
  the end of the receive: on the access-done (which P's WRITE carries in place of vLLM's
  ``"id:count"``, so it arrives after the data) a finished load; on expiry a failed load, which
  with ``kv_load_failure_policy="recompute"`` recomputes the prompt.
- **P, the writer, is the accessor.** On a registration that carries a ticket, P's worker
  tracks it (heartbeating D from then on: while its request waits and prefills), and WRITEs only
  under the validity window (spec/PROTOCOL.md, section 6.2: a push WRITE starts only if
  ``now + A_l <= valid_until``).
- **P's source blocks are under a kvlease pinner lease on P's worker** (``src_grants`` from
  `KvleasePushScheduler.request_finished`, granted in place of vLLM's ``_reqs_to_send``
  deadline; renewed by D's stock ``HB:`` through the compat codec; needs ``vllm_compat``). The
  push's completion (vLLM's ``finished_sending``) ends it at once (an access-done through the
  compat codec; its `Free` is swallowed). Its expiry frees the blocks, held while a WRITE from
  them is posted or being posted (``_kv_posting``); no WRITE from an expired one is posted.
  A prefill aborted on P before its WRITE releases D's push lease (``untrack``), so D fails the
  load at once instead of waiting for a WRITE that will not come.
  A request aborted on D while its push is awaited releases the push lease (``release``): P's
  heartbeats stop renewing it and D's blocks come back at its expiry plus ``G``.
- **Mixed fleets.** A registration without a ticket (a stock D) is written as vLLM writes it. A
  stock P ignores the ticket: its ``"id:count"`` ends D's push lease through the compat codec;
  and since it never heartbeats, D, at the lease's expiry, checks whether that producer ever
  said hello: if not, D keeps the blocks (a stock P may still WRITE them) and falls back to
  vLLM's own completion, logging once that it has no validity guarantee for that peer. A
  kvlease P says so in the params it returns (``PRODUCER_KEY``, sealed under a deployment key
  to P and the request): D never takes it for stock, however late its first lease message
  (a loaded producer), and an expired push lease of it is a failed load.

**Threads.** kvlease's core is single-threaded, vLLM's writer thread is not the engine's. The
`Driver` (with the `Pinner` or `Accessor`) lives on the engine's main thread and is pumped from
``start_load_kv`` / ``get_transfer_results`` like the pull adapter's. The writer thread only
reads and queues:

1. ``PUSH_REG`` with a ticket: the writer marks the request *gated* and queues the registration
   for the main thread, which ``track``s it (``push=True``).
2. When vLLM's writer has matched P's finished blocks with the registration, the WRITE is
   parked and handed to the main thread, which asks the accessor (``Driver.write`` →
   ``begin_access``: allowed only when the window covers the access time). If allowed, the main
   thread publishes the approval (the access-done to attach, and ``valid_until``) and gives the
   WRITE back to the writer through vLLM's own ``_deferred_push_inbox``.
3. The gate: each step the main thread publishes, per gated request, a snapshot of the
   accessor's ``valid_until`` (``-inf`` once the lease is lost or the access ended). Before
   posting **each** WRITE (``_xfer_blocks``) the writer checks ``now + A_l <= valid_until``
   against that snapshot (one ``dict`` read, atomic in CPython). Validity only grows while the
   lease lives, so a snapshot one step old only refuses more. A refused WRITE is never posted;
   the main thread reports the access failed (the lease is given up; D frees its blocks at
   expiry + G) and frees P's source blocks. Where the decoder's TP is larger than P's, a push is
   one WRITE per decoder rank, and one can be refused after another was posted: the access
   failed with a part posted, so no decoder rank frees on the Release (each at its expiry + G),
   and P's source blocks are freed only once that WRITE completed.
4. The WRITE's notification is the access-done (vLLM's ``"id:count"`` swapped by the agent
   wrapper), so D hears it only after the data landed; when vLLM reports the WRITE handles done
   on the main thread, the transport reports the access finished to the driver.

Notifications: the writer thread owns ``get_new_notifs`` in push mode. The agent wrapper gives
the writer only ``PUSH_REG`` notifications and queues every other one, with its sender's agent
name, for the main thread: kvlease frames and hellos go to the driver, stock ``HB:`` to the
driver's vLLM-compat codec (P's source-block lease; vLLM's ``_handle_heartbeat`` when compat is
off), and a stock P's ``"id:count"`` to the same codec (it ends D's push lease as an access-done
by request id).
"""

from __future__ import annotations

# First: an unsupported vLLM is refused, saying what to do, before its internals load.
from . import _vllm_check  # noqa: F401

# isort: split

import json
import logging
import queue
import secrets
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgpack
from kvlease.transports import Driver, TransferFailed, load_frame_auth
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector, NixlPushConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import PUSH_REG_NOTIF_PREFIX
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import NixlPushConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id

from kvlease import (
    AccessCompleted,
    AccessStale,
    EndReason,
    Free,
    LeaseLost,
    LeaseTicket,
    ProtocolError,
    TrackedState,
    is_native_frame,
    is_sealed_frame,
    tp_layout,
)

from ._metrics import KVLEASE_COUNTERS, PUSH_COUNTERS, KvleaseConnectorStats
from ._settings import AdapterSettings, read_settings
from ._transport import (
    HELLO_MAGIC,
    PRODUCER_KEY,
    ConnectorTransport,
    NotifSwap,
    producer_claim,
    verify_producer_claim,
)
from .connector import TICKET_KEY, _KvleaseConnectorCommon, _KvleaseWorkerBase, check_at_start_up, transfer_bound_of

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KvleaseNixlPushConnector", "KvleasePushScheduler", "KvleasePushWorker"]

log = logging.getLogger("kvlease.adapters.vllm")

_NEG_INF = float("-inf")


def push_binding(reg: Mapping[str, Any]) -> bytes:
    """What a sealed push ticket guards, from the registration it travels in: the decoder engine,
    its request id, the destination block ids and the producer it registers with. Under a
    deployment key the ticket's tag covers these bytes, so a party without the key can neither
    forge a push lease nor move one onto other blocks (another request's, possibly reused), or
    make another producer WRITE under it."""
    fields = [
        reg.get("decode_engine_id"),
        reg.get("request_id"),
        reg.get("local_block_ids"),
        reg.get("remote_engine_id"),
    ]
    return json.dumps(fields, separators=(",", ":"), sort_keys=True, default=int).encode()


def _settings_of(vllm_config: VllmConfig) -> AdapterSettings:
    ktc = vllm_config.kv_transfer_config
    return read_settings(ktc.kv_connector_extra_config if ktc is not None else None)


# -- scheduler side ------------------------------------------------------------------------------


class KvleasePushScheduler(NixlPushConnectorScheduler):  # type: ignore[misc]
    def __init__(self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self.kvlease_settings = _settings_of(vllm_config)
        self._kv_auth = load_frame_auth(self.kvlease_settings.lease)
        #: This decoder's pinner incarnation (push leases): every worker's `Pinner` takes it.
        self.kvlease_incarnation = secrets.randbits(64)
        self._kv_next_id = 1
        self._kv_push_grants: dict[str, int] = {}
        self._kv_leases: dict[str, int] = {}  # decoder request -> push lease id, until its load ends
        self._kv_releases: list[str] = []
        self._kv_src_grants: dict[str, int] = {}  # producer request -> source lease id (this step)
        #: Registrations (this step) whose producer said in its returned params that it runs
        #: kvlease (`PRODUCER_KEY`).
        self._kv_push_native: list[str] = []

    # decoder: one push lease per registration, its ticket inside the registration
    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        req_id = request.request_id
        staged = req_id in self._push_pending_registrations
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        reg = self._push_pending_registrations.get(req_id)
        if reg is None or staged:
            return
        lease_id = self._kv_next_id
        self._kv_next_id += 1
        self._kv_push_grants[req_id] = lease_id
        params = request.kv_transfer_params or {}
        if verify_producer_claim(self._kv_auth, params, params.get(PRODUCER_KEY)):
            self._kv_push_native.append(req_id)
        self._kv_leases[req_id] = lease_id
        ticket = LeaseTicket(
            engine_id=self.engine_id,
            incarnation=self.kvlease_incarnation,
            lease_id=lease_id,
            ranks=self.transfer_tp_size,
        )
        # Sealed to the registration as it goes out (vLLM fills it completely before this).
        reg[TICKET_KEY] = (
            ticket.to_dict() if self._kv_auth is None else ticket.sealed_dict(self._kv_auth, push_binding(reg))
        )

    def request_finished(self, request: Request, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        if self._kv_leases.pop(request.request_id, None) is not None:
            # Finished (aborted) while its push is still awaited: release the push lease. vLLM
            # holds the blocks until the load reports; the lease ends at its expiry (plus G).
            self._kv_releases.append(request.request_id)
        had = request.request_id in self._reqs_need_send
        result: tuple[bool, dict[str, Any] | None] = super().request_finished(request, block_ids)
        if not had and request.request_id in self._reqs_need_send and self.kvlease_settings.vllm_compat:
            # Producer: P's source blocks go under a kvlease lease (renewed by D's `HB:`).
            self._kv_src_grants[request.request_id] = self._kv_next_id
            self._kv_next_id += 1
        if result[1] is not None and result[1].get("do_remote_prefill"):
            # Producer: the decoder learns from what P returns that P runs kvlease (and so never
            # WRITEs outside the lease), before any lease message of P's can reach it.
            result[1][PRODUCER_KEY] = producer_claim(self._kv_auth, self.engine_id, request.request_id)
        return result

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        for req_id in connector_output.finished_recving or ():
            self._kv_leases.pop(req_id, None)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        meta.kvlease = {
            "incarnation": self.kvlease_incarnation,
            "push_grants": self._kv_push_grants,
            "push_releases": self._kv_releases,
            "src_grants": self._kv_src_grants,
            "push_native": self._kv_push_native,
        }
        self._kv_push_grants, self._kv_releases, self._kv_src_grants = {}, [], {}
        self._kv_push_native = []
        return meta


# -- worker side ---------------------------------------------------------------------------------


class _PushAgent(NotifSwap):
    """The agent as vLLM's push writer sees it: WRITE notifications swapped for kvlease's
    access-done (`NotifSwap`), and ``get_new_notifs`` returning only ``PUSH_REG``; every other
    notification is queued, with its sender, for the engine's main thread."""

    def __init__(
        self,
        agent: Any,
        table: dict[str, dict[int, bytes]],
        agents: dict[str, dict[Any, str]],
        inbox: queue.SimpleQueue[tuple[str, bytes]],
    ) -> None:
        super().__init__(agent, table, agents)
        self._kvlease_inbox = inbox

    def get_new_notifs(self) -> dict[Any, list[bytes]]:
        regs: dict[Any, list[bytes]] = {}
        for agent_name, notifs in self._kvlease_agent.get_new_notifs().items():
            name = agent_name.decode() if isinstance(agent_name, bytes) else str(agent_name)
            for notif in notifs:
                data = bytes(notif)
                if data.startswith(PUSH_REG_NOTIF_PREFIX):
                    regs.setdefault(agent_name, []).append(data)
                else:
                    self._kvlease_inbox.put((name, data))
        return regs


class KvleasePushWorker(_KvleaseWorkerBase, NixlPushConnectorWorker):  # type: ignore[misc]
    nixl_wrapper: Any

    def __init__(self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self.kvlease_settings = _settings_of(vllm_config)
        self.kvlease_bound = transfer_bound_of(vllm_config, kv_cache_config, self.kvlease_settings)
        role = vllm_config.kv_transfer_config.kv_role
        #: Push: the decoder pins its destination blocks, the producer (the writer) accesses.
        #: The producer pins its source blocks too (renewed by D's stock `HB:`, compat codec).
        self._kv_pinner_role = role in ("kv_consumer", "kv_both") or (
            role == "kv_producer" and self.kvlease_settings.vllm_compat
        )
        self._kv_accessor_role = role in ("kv_producer", "kv_both")
        self._kv_swap: dict[str, dict[int, bytes]] = {}  # decoder request id -> rank -> access-done
        self._kv_inbox: queue.SimpleQueue[tuple[str, bytes]] = queue.SimpleQueue()
        self.nixl_wrapper = _PushAgent(self.nixl_wrapper, self._kv_swap, self._remote_agents, self._kv_inbox)
        self._kv_engines: dict[str, dict[str, Any]] = {}
        #: The deployment key push tickets are sealed with (None: authentication off).
        self._kv_auth = load_frame_auth(self.kvlease_settings.lease)
        self._kv_unsealed_warned: set[str] = set()  # decoders warned about (writer thread only)
        self.kvlease_transport = ConnectorTransport(
            self.nixl_wrapper, engine_id, self.transfer_tp_rank, self._remote_agents, self._kv_handshake
        )
        self.kvlease_driver: Driver | None = None
        self._kv_incarnation: int | None = None
        self._kv_access_time = self.kvlease_settings.lease.access_time_local
        # decoder (pinner): requests whose destination blocks are under a push lease
        self._kv_granted: set[str] = set()
        self._kv_producer_of: dict[str, str] = {}  # granted request -> the producer engine
        self._kv_lease_of: dict[str, int] = {}  # granted request -> its push lease id
        #: Requests whose producer turned out to be stock vLLM (it never said hello, so it never
        #: heartbeats the push lease nor honours it): vLLM's own completion path, no guarantee.
        self._kv_stock: set[str] = set()
        self._kv_warned: set[str] = set()
        #: Granted requests whose producer said it runs kvlease: never taken for stock vLLM, even
        #: when its first lease message comes later than the lease (a loaded producer).
        self._kv_native: set[str] = set()
        # producer (accessor), shared with the writer thread (see the module docstring):
        #: Approved WRITEs: decoder request id -> valid_until snapshot (-inf: no longer covered).
        #: Published by the main thread only; a registration with a ticket is gated whether or
        #: not it is here (absent: parked for approval, never written).
        self._kv_gate: dict[str, float] = {}
        self._kv_current: str | None = None  # writer thread: the gated request being written
        self._kv_regs: queue.SimpleQueue[tuple[str, dict[str, Any]]] = queue.SimpleQueue()
        self._kv_want: queue.SimpleQueue[tuple[str, Any, dict[str, Any]]] = queue.SimpleQueue()
        self._kv_refused: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        self._kv_lock = threading.Lock()
        self._kv_posted: dict[str, str] = {}  # producer request id -> decoder request id (WRITE posted)
        # producer, main thread only:
        self._kv_waiting: dict[str, tuple[str, Any, dict[str, Any]]] = {}  # WRITEs waiting for approval
        self._kv_writing: set[str] = set()  # approved, the access is open in the accessor
        self._kv_src_done: set[str] = set()  # producer requests whose WRITE will not happen
        self._kv_tracked: dict[str, str] = {}  # base request id -> tracked decoder request id
        #: Producer: requests whose source blocks are under a kvlease pinner lease.
        self._kv_src: set[str] = set()
        self._kv_src_reported: set[str] = set()  # freed through finished_sending, lease ending
        self._kv_src_held: set[str] = set()  # lease expired, a WRITE from the blocks in flight
        #: Shared with the writer (under ``_sending_transfers_lock``): requests whose WRITEs are
        #: being posted, and source leases expired (no WRITE from them may be posted any more).
        self._kv_posting: set[str] = set()
        self._kv_src_expired: dict[str, None] = {}
        #: Counts for tests and operators: WRITEs posted under a lease / refused by the gate.
        self.kvlease_push_counts = dict.fromkeys(PUSH_COUNTERS, 0)
        self.xfer_stats = KvleaseConnectorStats()
        self._kv_counted = dict.fromkeys(KVLEASE_COUNTERS, 0)
        self._kv_push_counted = dict.fromkeys(PUSH_COUNTERS, 0)

    # -- set-up ------------------------------------------------------------------------------

    def _kv_handshake(self, engine_id: str) -> Any:
        info = self._kv_engines[engine_id]  # KeyError: no side channel known
        return self._ensure_handshake(engine_id, info["host"], info["port"], info["tp_size"])

    # -- main thread: per step ---------------------------------------------------------------

    def start_load_kv(self, metadata: Any) -> None:
        kv = getattr(metadata, "kvlease", None) or {}
        driver = self._kv_ensure_driver(kv.get("incarnation"))
        grants = kv.get("push_grants", {})
        if grants and driver.pinner is not None:
            if kv.get("incarnation") != self._kv_incarnation:
                raise RuntimeError("the kvlease scheduler's incarnation changed under a running worker")
            regs = getattr(metadata, "push_registrations", None) or {}
            self._kv_native.update(r for r in kv.get("push_native", ()) if r in grants)
            for req_id, lease_id in grants.items():
                # Granted before vLLM's writer sends the registration (queued just below).
                driver.grant(req_id, lease_id=lease_id, push=True)
                self._kv_granted.add(req_id)
                self._kv_lease_of[req_id] = lease_id
                reg = regs.get(req_id)
                if reg is not None:
                    self._kv_producer_of[req_id] = str(reg.get("remote_engine_id"))
        if driver.pinner is not None:
            for req_id in kv.get("push_releases", ()):
                lease_id = self._kv_lease_of.pop(req_id, None)
                if lease_id is not None and req_id in self._kv_granted:
                    try:
                        driver.release(lease_id)
                    except ProtocolError as exc:
                        log.warning("kvlease: cannot release the push lease of %s (%s)", req_id, exc)
        if driver.accessor is not None:
            self._kv_pump(driver)
            for req_id in getattr(metadata, "reqs_not_processed", ()) or ():
                self._kv_release(driver, req_id)
        super().start_load_kv(metadata)
        src = kv.get("src_grants", {})
        if src and driver.pinner is not None:
            for req_id, lease_id in src.items():
                # vLLM's worker took the request: grant instead of vLLM's deadline, so vLLM's
                # reaper never sees it (the lease's Free releases it, see get_transfer_results).
                if self._reqs_to_send.pop(req_id, None) is not None:
                    driver.grant(req_id, lease_id=lease_id)
                    self._kv_src.add(req_id)

    def _kv_pump(self, driver: Driver) -> None:
        """Producer: track new registrations, approve parked WRITEs, publish the gate."""
        accessor = driver.accessor
        assert accessor is not None
        while True:
            try:
                rid, reg = self._kv_regs.get_nowait()
            except queue.Empty:
                break
            self._kv_track(driver, rid, reg)
        while True:
            try:
                p_rid, blocks, reg = self._kv_want.get_nowait()
            except queue.Empty:
                break
            self._kv_waiting[str(reg["request_id"])] = (p_rid, blocks, reg)
        for rid in list(self._kv_waiting):
            state = accessor.state_of(rid)
            if state is None or state is TrackedState.LOST:
                # Lost before the WRITE: never written; D frees its blocks at expiry + G.
                p_rid, _blocks, _reg = self._kv_waiting.pop(rid)
                self._kv_drop(rid, p_rid, "its push lease was lost before the WRITE")
                continue
            targets = tp_layout(self._kv_ranks(rid), self.transfer_tp_size, self.transfer_tp_rank).targets
            into: Any = None if len(targets) == 1 else dict.fromkeys(targets)
            self.kvlease_transport.expect(rid)
            try:
                decision = driver.write(rid, "kv", into)
            finally:
                self.kvlease_transport.expect(None)
            if not decision.allowed:
                continue  # not covered yet (no acknowledged heartbeat): asked again next step
            notifs = self.kvlease_transport.notifications(rid)
            if notifs:
                self._kv_swap[rid] = notifs
            assert decision.valid_until is not None
            self._kv_writing.add(rid)
            self._kv_gate[rid] = float(decision.valid_until)
            self._deferred_push_inbox.put(self._kv_waiting.pop(rid))
            self._push_writer_wake.set()
        # The gate's snapshot: valid_until while the access is open, -inf otherwise.
        for rid in list(self._kv_gate):
            state = accessor.state_of(rid)
            v = accessor.valid_until(rid)
            if rid in self._kv_writing and state is TrackedState.ACCESSING and v is not None:
                self._kv_gate[rid] = float(v)
            else:
                self._kv_gate[rid] = _NEG_INF

    def _kv_release(self, driver: Driver, p_rid: str) -> None:
        """Producer: request `p_rid` ended without a prefill to push (aborted): release the
        decoder's push lease, so the decoder fails the load at once instead of waiting for a
        WRITE that will never come (P would otherwise heartbeat it for as long as it runs)."""
        rid = self._kv_tracked.pop(get_base_request_id(p_rid), None)
        if rid is None or rid in self._kv_waiting or rid in self._kv_writing:
            return
        assert driver.accessor is not None
        if driver.accessor.state_of(rid) is TrackedState.WAITING:
            log.info("kvlease: %s ended before its WRITE: releasing the decoder's push lease", p_rid)
            driver.untrack(rid)
            self._kv_forget(rid)

    def _kv_ranks(self, rid: str) -> int:
        reg = self._kv_waiting[rid][2]
        ticket = reg.get(TICKET_KEY) or {}
        return int(ticket.get("ranks", 1))

    def _kv_track(self, driver: Driver, rid: str, reg: dict[str, Any]) -> None:
        try:
            ticket = LeaseTicket.from_dict(reg[TICKET_KEY], auth=self._kv_auth, bind=push_binding(reg))
        except (ProtocolError, KeyError) as exc:
            # Gated without a lease: never written (D's own watchdog and lease end it).
            log.warning("kvlease: registration %s carries a malformed push ticket (%s): not writing it", rid, exc)
            return
        host, port = reg.get("decode_host"), reg.get("decode_port")
        self._kv_engines[ticket.engine_id] = {"host": host, "port": port, "tp_size": reg.get("decode_tp_size", 1)}
        try:
            driver.track(rid, ticket, address=f"{host}:{port}", push=True)
            if len(self._kv_tracked) < 1 << 20:
                self._kv_tracked[get_base_request_id(rid)] = rid
        except ProtocolError as exc:
            log.warning("kvlease: cannot track the push lease of %s (%s): not writing it", rid, exc)

    def _kv_drop(self, rid: str, p_rid: str, why: str) -> None:
        """Producer: `rid`'s WRITE will not happen; P's source blocks are freed (next step)."""
        log.warning("kvlease: not writing %s (%s)", rid, why)
        self.kvlease_push_counts["push_writes_dropped"] += 1
        self._kv_forget(rid)
        self._kv_src_done.add(p_rid)

    def _kv_forget(self, rid: str, *, written: bool = False) -> None:
        """The access of `rid` ended: its approval is withdrawn (-inf, so a WRITE the writer still
        holds is refused), or dropped once nothing more of it can be written."""
        if written:
            self._kv_gate.pop(rid, None)
        elif rid in self._kv_gate:
            self._kv_gate[rid] = _NEG_INF
        self._kv_swap.pop(rid, None)
        self._kv_writing.discard(rid)
        base = get_base_request_id(rid)
        if self._kv_tracked.get(base) == rid:
            del self._kv_tracked[base]

    # -- writer thread -----------------------------------------------------------------------

    def _handle_push_reg_notif(self, notif: bytes) -> None:
        try:
            reg = msgpack.unpackb(notif[len(PUSH_REG_NOTIF_PREFIX) :], raw=False)
        except Exception:
            reg = None
        if isinstance(reg, dict) and isinstance(reg.get("request_id"), str) and reg.get(TICKET_KEY) is not None:
            self._kv_regs.put((reg["request_id"], reg))
        elif self._kv_auth is not None and not self.kvlease_settings.lease.auth_allow_vllm_compat:
            # Under a deployment key a registration without a sealed ticket is a stock decoder's
            # or anybody's: writing it would WRITE into blocks no lease guards, named by a party
            # that need not hold the key. Not registered (vLLM's own timeouts end both sides).
            who = str(reg.get("decode_engine_id")) if isinstance(reg, dict) else "?"
            if who not in self._kv_unsealed_warned and len(self._kv_unsealed_warned) < 1024:
                self._kv_unsealed_warned.add(who)
                log.warning(
                    "kvlease: a push registration from %.100s carries no lease ticket and a deployment key "
                    "is configured: not writing it (a stock decoder needs auth_allow_vllm_compat)",
                    who,
                )
            return
        super()._handle_push_reg_notif(notif)

    def _do_start_push_kv(self, request_id: str, local_block_ids: Any, registration_data: dict[str, Any]) -> None:
        if registration_data.get(TICKET_KEY) is None:
            super()._do_start_push_kv(request_id, local_block_ids, registration_data)  # a stock decoder
            return
        rid = str(registration_data.get("request_id"))
        if rid not in self._kv_gate:
            # Matched: park it until the accessor approves (the main thread re-queues it).
            self._kv_want.put((request_id, local_block_ids, registration_data))
            return
        self._kv_current = rid
        try:
            super()._do_start_push_kv(request_id, local_block_ids, registration_data)
        finally:
            self._kv_current = None

    def _xfer_blocks(
        self,
        read_spec: Any,
        dst_engine_id: str,
        request_id: str,
        remote_request_id: str,
        local_xfer_side_handle: int,
        remote_xfer_side_handle: int,
    ) -> int | None:
        if self._kv_src_expired and request_id in self._kv_src_expired:
            # P's source lease expired (its blocks are being freed): nothing from them is posted.
            return None
        if self._kv_current is not None:
            # The push guard (spec section 6.2), checked before posting each WRITE.
            valid_until = self._kv_gate.get(remote_request_id, _NEG_INF)
            if time.monotonic() + self._kv_access_time > valid_until:
                self._kv_refused.put((request_id, remote_request_id))
                return None
        with self.nixl_wrapper.for_rank(int(read_spec.remote_rank)):  # that rank's access-done
            handle: int | None = super()._xfer_blocks(
                read_spec,
                dst_engine_id,
                request_id,
                remote_request_id,
                local_xfer_side_handle,
                remote_xfer_side_handle,
            )
        return handle

    def _xfer_blocks_for_req(self, req_id: str, meta: Any) -> None:
        # vLLM publishes the WRITE handles only after the last one is posted: until then the
        # request is "posting", which holds a source-lease Free as a posted WRITE does.
        with self._sending_transfers_lock:
            self._kv_posting.add(req_id)
        try:
            super()._xfer_blocks_for_req(req_id, meta)
        finally:
            with self._sending_transfers_lock:
                self._kv_posting.discard(req_id)
        rid = self._kv_current
        if rid is not None:
            with self._sending_transfers_lock:
                posted = bool(self._sending_transfers.get(req_id))
            if posted:
                with self._kv_lock:
                    self._kv_posted[req_id] = rid

    # -- main thread: notifications in, results out ------------------------------------------

    def _get_new_notifs(self) -> set[str]:
        feed = self.kvlease_transport.feed
        stock = False
        while True:
            try:
                name, data = self._kv_inbox.get_nowait()
            except queue.Empty:
                break
            if data.startswith(b"HB:"):
                # D's stock heartbeat for P's source blocks: it renews their kvlease lease (the
                # compat codec), or vLLM's own deadline where P grants none (compat off).
                if self.kvlease_driver is not None and self.kvlease_driver.pinner is not None:
                    feed(name, data)
                else:
                    self._handle_heartbeat(data[3:].decode("utf-8", "replace"))
                continue
            native = is_native_frame(data) or is_sealed_frame(data) or data.startswith(HELLO_MAGIC)
            if not native and self._kv_stock:
                rid = data.rpartition(b":")[0].decode("utf-8", "replace")
                if rid in self._kv_stock:
                    # A stock producer's WRITE completion: vLLM's own handling (below).
                    self._kv_stock.discard(rid)
                    self._pending_completion_notifs.put(data)
                    stock = True
                    continue
            if not self.kvlease_settings.vllm_compat and not native:
                self.xfer_stats.record_notification_after_expiry()
                continue
            feed(name, data)
        if stock:
            NixlPushConnectorWorker._get_new_notifs(self)
        return set()

    def _kv_in_flight(self, p_rid: str) -> bool:
        """Under ``_sending_transfers_lock``: a WRITE from `p_rid`'s blocks is posted (or
        being posted) and not complete."""
        return bool(self._sending_transfers.get(p_rid)) or p_rid in self._kv_posting

    def _kv_src_free(self, res: Any, p_rid: str) -> None:
        self._reqs_to_process.discard(p_rid)
        if p_rid not in res.finished_sending:
            res.finished_sending.add(p_rid)
            self._evict_finished_inbox.put(p_rid)
            self._push_writer_wake.set()

    def get_transfer_results(self) -> Any:
        res = super().get_transfer_results()
        driver = self.kvlease_driver
        if driver is None:
            return res
        transport = self.kvlease_transport
        if self._kv_src:
            # Source blocks vLLM freed on the push's completion: their lease ends now (an
            # access-done through the compat codec), its Free is swallowed.
            for p_rid in res.finished_sending & self._kv_src:
                self._kv_src.discard(p_rid)
                self._kv_src_reported.add(p_rid)
                transport.feed(self.engine_id, f"{p_rid}:1".encode())
        if self._kv_src_held:
            with self._sending_transfers_lock:
                ready = [r for r in self._kv_src_held if not self._kv_in_flight(r)]
            for p_rid in ready:
                self._kv_src_held.discard(p_rid)
                self._kv_src_free(res, p_rid)
        if driver.accessor is not None:
            while True:
                try:
                    p_rid, rid = self._kv_refused.get_nowait()
                except queue.Empty:
                    break
                self.kvlease_push_counts["push_writes_refused"] += 1
                log.warning("kvlease: WRITE for %s not started: the validity window does not cover it", rid)
                transport.complete(rid, False, "WRITE refused by the push guard")
                self._kv_forget(rid, written=True)
                self._kv_src_done.add(p_rid)
            with self._sending_transfers_lock, self._kv_lock:
                finished = [(p, r) for p, r in self._kv_posted.items() if p not in self._sending_transfers]
                for p, _r in finished:
                    del self._kv_posted[p]
            for p_rid, rid in finished:
                self.kvlease_push_counts["push_writes_posted"] += 1
                ok = p_rid in res.finished_sending
                transport.complete(rid, ok, "" if ok else "vLLM reported the WRITE failed")
                self._kv_writing.discard(rid)
            waiting: set[str] = set()
            if self._kv_src_done:
                # A push of several WRITEs (the decoder's TP larger than P's) can be refused in
                # part after another part was posted: its source blocks stay P's until that
                # WRITE completed (vLLM then reports the request sent, in the same call that
                # pops its handles), as an expired source lease's are.
                with self._sending_transfers_lock:
                    waiting = {r for r in self._kv_src_done if self._kv_in_flight(r)}
            for p_rid in self._kv_src_done - waiting:
                # P's source blocks of a WRITE that will not happen: freed as vLLM frees them.
                self._reqs_to_send.pop(p_rid, None)
                self._reqs_to_process.discard(p_rid)
                self._evict_finished_inbox.put(p_rid)
                res.finished_sending.add(p_rid)
                if p_rid in self._kv_src:
                    self._kv_src.discard(p_rid)
                    self._kv_src_reported.add(p_rid)
                    transport.feed(self.engine_id, f"{p_rid}:1".encode())
            self._kv_src_done = waiting
        for ev in driver.step():
            if isinstance(ev, Free):
                if ev.key in self._kv_src_reported:
                    self._kv_src_reported.discard(ev.key)  # freed already, on the push's completion
                elif ev.key in self._kv_src:
                    # P's source lease ended (expired: D stopped renewing). The blocks are freed
                    # now, unless a WRITE from them is in flight: then when it completes.
                    self._kv_src.discard(ev.key)
                    self.xfer_stats.record_kv_expired_req()
                    log.warning("kvlease: source lease of %s ended (%s): its blocks are freed", ev.key, ev.reason.name)
                    with self._sending_transfers_lock:
                        # Kept (bounded) after the free: the writer may still hold the request.
                        self._kv_src_expired[ev.key] = None
                        if len(self._kv_src_expired) > 1 << 16:
                            del self._kv_src_expired[next(iter(self._kv_src_expired))]
                        held = self._kv_in_flight(ev.key)
                    if held:
                        self._kv_src_held.add(ev.key)
                    else:
                        self._kv_src_free(res, ev.key)
                elif ev.key in self._kv_granted:
                    self._kv_granted.discard(ev.key)
                    self._kv_lease_of.pop(ev.key, None)
                    producer = self._kv_producer_of.pop(ev.key, None)
                    native = ev.key in self._kv_native
                    self._kv_native.discard(ev.key)
                    if (
                        ev.reason is EndReason.EXPIRED
                        and producer is not None
                        and not native
                        and producer not in self.kvlease_transport.accessor_engines()
                    ):
                        # The producer never said hello: stock vLLM, which neither heartbeats
                        # nor honours the lease and may still WRITE. Keep the blocks until its
                        # own completion, as vLLM does.
                        self._kv_stock.add(ev.key)
                        if producer not in self._kv_warned and len(self._kv_warned) < 1024:
                            self._kv_warned.add(producer)
                            log.warning(
                                "kvlease: producer %r never answered the push lease (a stock vLLM producer): "
                                "falling back to vLLM's push completion, with no validity guarantee for that peer",
                                producer,
                            )
                    elif ev.reason is EndReason.ACCESS_DONE:
                        # The access-done came after P's WRITE landed: vLLM's "done" marker.
                        self._recving_transfers.setdefault(ev.key, [])
                    else:
                        self.xfer_stats.record_kv_expired_req()
                        log.warning(
                            "kvlease: push lease of %s ended (%s) without a completed WRITE: a failed load",
                            ev.key,
                            ev.reason.name,
                        )
                        self._handle_failed_transfer(ev.key, None, self._recv_failures, record_failed_transfer=False)
            elif isinstance(ev, AccessCompleted):
                self._kv_forget(ev.key, written=True)
                self._kv_tracked.pop(get_base_request_id(ev.key), None)
            elif isinstance(ev, AccessStale | LeaseLost | TransferFailed):
                self._kv_forget(ev.key)
                self._kv_tracked.pop(get_base_request_id(ev.key), None)
        if driver.accessor is not None:
            self._kv_pump(driver)
        self._kv_record_stats(driver)
        return res

    def _kv_record_stats(self, driver: Driver) -> bool:
        reported = super()._kv_record_stats(driver)
        if (reported or self.kvlease_push_counts != self._kv_push_counted) and (
            deltas := self._kv_deltas(self._kv_push_counted, self.kvlease_push_counts)
        ):
            self.xfer_stats.record_kvlease(deltas)
        return reported


# -- the connector -------------------------------------------------------------------------------


class KvleaseNixlPushConnector(_KvleaseConnectorCommon, NixlPushConnector):  # type: ignore[misc]
    """vLLM's push-mode NIXL connector (``NixlPushConnector``) with kvlease push leases."""

    connector_scheduler: KvleasePushScheduler | None
    connector_worker: KvleasePushWorker | None

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        # A bad value fails here, naming the key (and a max_access_time that cannot cover the
        # largest WRITE), before anything starts.
        check_at_start_up(vllm_config, kv_cache_config, role, "NixlPushConnector", push=True)
        if vllm_config.parallel_config.decode_context_parallel_size > 1:
            raise ValueError("NixlPushConnector does not support decode_context_parallel_size > 1.")
        # NixlPushConnector.__init__ would build vLLM's own scheduler or worker: skip to the base.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KvleasePushScheduler(vllm_config, self.engine_id, kv_cache_config)
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            self.connector_scheduler = None
            self.connector_worker = KvleasePushWorker(vllm_config, self.engine_id, kv_cache_config)
        else:
            raise ValueError(f"Unsupported KVConnectorRole: {role}")
