"""Lease-enabled SGLang 0.5.23 NIXL KV manager, sender and receiver, as mixins composed over the
class the rest of SGLang's ``get_kv_class`` chain returns (stock, or another plugin's subclass).

Imported only inside an SGLang process (by the `get_kv_class` hook). What each override adds:

Prefill (`LeaseManagerMixin` in PREFILL mode, `LeaseSenderMixin`):
- the sender grants a *source lease* on the room's KV and answers the decode's ticket request;
  its fixed ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` is replaced by that lease's liveness;
- destination tickets from the decode are checked (sealed for the room, both ranks and the pages,
  under a deployment key) and tracked (heartbeated) at once;
- each transfer worker takes its chunks through `_GatedQueue`: a chunk whose room's leases are not
  acknowledged yet waits *beside* the queue (the worker serves the rooms behind it meanwhile, in
  their order), for at most one heartbeat interval;
- every WRITE the worker posts (`_post_xfer`: every chunk, every decode rank, KV, state and aux)
  passes the lease gate first: the room's first WRITE to a decode rank begins the core's access
  (the push guard, ``now + A_l <= valid_until``), every later one needs the window still to
  cover it; otherwise nothing is posted and the room fails through SGLang's own failure path
  (``_NixlPostError`` -> ``conclude_failure`` -> ``KV_STATUS`` Failed);
- each chunk's WRITEs are reported settled when SGLang's ``_await_handles`` saw them all settle
  (clean if all DONE); the access ends when the room concludes and nothing is in flight: with the
  access-done if every WRITE was DONE (the decode frees at once), else — a post raised
  (``poison_deferred_ack_room``), a handle failed or never settled — as a posted failure (the
  decode keeps the pages to expiry + G). An abort (SGLang's ``ABORT`` from the decode, the
  sender's ``abort``/``clear``) with no WRITE in flight ends the leases at once.

Decode (`LeaseManagerMixin` in DECODE mode, `LeaseReceiverMixin`):
- ``init`` (admission, before the memory wait) asks each prefill rank for its source ticket and
  renews it from then on;
- ``send_metadata`` first grants one push lease per prefill rank and sends it the ticket, sealed
  to the room, both ranks and the destination pages (as SGLang sends them) and aux slot;
- while a destination lease is live (or has expired and is failing the room), SGLang's fixed
  ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` does not apply: an alive prefill keeps the pages however
  long it takes;
- a failed or aborted room releases its leases; SGLang's deferred release then holds the pages
  until ``is_abort_release_safe`` — which here means: every destination lease of the room has
  ended (access-done, a release no WRITE was in flight for, or expiry plus the push guard). The
  prefill's ``ABORT_ACK`` is not trusted for that.
- expiry or loss of a lease fails the room (``record_failure`` + ``KVPoll.Failed``), so SGLang's
  abort, retry and release paths run.

Both: ``KVLEASE`` messages on the manager socket are taken before SGLang's parsing; on the prefill,
any message whose tag SGLang does not know, or a ``NixlMsgGuard`` message that does not parse, is
dropped and counted instead of killing the bootstrap thread.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sglang.srt.disaggregation.base.conn import KVPoll  # type: ignore[import-not-found]
from sglang.srt.disaggregation.common.conn import ABORT_TAG, AbortNotification  # type: ignore[import-not-found]
from sglang.srt.disaggregation.nixl.conn import (  # type: ignore[import-not-found]
    GUARD,
    KVArgsRegisterInfo,
    NixlKVManager,
    NixlKVReceiver,
    NixlKVSender,
    TransferInfo,
    _NixlPostError,
)
from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType  # type: ignore[import-not-found]
from sglang.srt.environ import envs  # type: ignore[import-not-found]

from kvlease import ConfigError

from ._lease import LeaseRuntime, Peer, RoomEvent, engine_name
from ._settings import Settings, load_settings
from ._transport import SglangZmqTransport

if TYPE_CHECKING:  # the mixins' bases for the type checker only (SGLang has no type information)
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager as _ManagerBase
    from sglang.srt.disaggregation.nixl.conn import NixlKVReceiver as _ReceiverBase
    from sglang.srt.disaggregation.nixl.conn import NixlKVSender as _SenderBase
else:
    _ManagerBase = _SenderBase = _ReceiverBase = object

__all__ = [
    "LeaseManagerMixin",
    "LeaseNixlKVManager",
    "LeaseNixlKVReceiver",
    "LeaseNixlKVSender",
    "LeaseReceiverMixin",
    "LeaseSenderMixin",
    "compose",
]

logger = logging.getLogger("kvlease.adapters.sglang")

_PREFILL_TAGS = frozenset({b"WATERMARK", b"STAGING_RSP", ABORT_TAG, GUARD})

#: The chunk a transfer-worker thread is processing (set by `_GatedQueue`): its room, whether it
#: is the last, the lease keys its posted WRITEs count in flight under, the handles posted and
#: not yet seen settled, whether a post raised, and the room's peers as of its first post.
_chunk = threading.local()


def _set_chunk(room: int | None, last: bool) -> None:
    _chunk.room = room
    _chunk.last = last
    _chunk.marked = set()
    _chunk.pending = []
    _chunk.raised = False
    _chunk.refused = False  # the gate refused a WRITE of this chunk: it was never posted
    _chunk.unsettled = False  # SGLang gave up awaiting a posted WRITE of this chunk
    _chunk.peers = None
    _chunk.infos = None


class _GatedQueue:
    """A transfer worker's queue, seen through. A chunk whose room is not ready (its leases
    not acknowledged) is set aside, with every later chunk of that room behind it, while the
    worker takes the other rooms' chunks; it is handed over once ready or once it has waited
    `patience` (then the write gate refuses it). Each `get` looks at each waiting room once."""

    def __init__(
        self,
        queue: Any,
        ready: Callable[[Any], bool],
        patience: float,
        poll: float,
        on_defer: Callable[[], None],
        on_unsettled: Callable[[int, set[str]], None] | None = None,
    ) -> None:
        self._queue = queue
        self._ready = ready
        self._patience = patience
        self._poll = poll
        self._on_defer = on_defer
        self._on_unsettled = on_unsettled
        self._waiting: collections.OrderedDict[Any, collections.deque[tuple[Any, float]]] = collections.OrderedDict()
        cond, buf = getattr(queue, "_cond", None), getattr(queue, "_buf", None)
        #: SGLang's FastQueue has no timed get: wait on its condition (0.5.23's internals).
        self.can_defer = hasattr(cond, "wait") and isinstance(buf, collections.deque)

    def _next(self) -> Any:
        if not self._waiting:
            return self._queue.get()
        cond, buf = self._queue._cond, self._queue._buf
        with cond:
            if not buf:
                cond.wait(self._poll)
            return buf.popleft() if buf else None

    def get(self, *args: Any, **kwargs: Any) -> Any:
        looked = False  # each waiting room is looked at once per get, and again after each idle wait
        while True:
            if not looked:
                looked = True
                now = time.monotonic()
                for room, waiting in list(self._waiting.items()):
                    chunk, since = waiting[0]
                    if now - since >= self._patience or self._ready(chunk):
                        waiting.popleft()
                        if not waiting:
                            del self._waiting[room]
                        return self._take(chunk)
            chunk = self._next()
            if chunk is None:
                looked = False  # nothing new arrived: look at the waiting rooms again
                continue
            room = getattr(chunk, "room", None)
            behind = self._waiting.get(room)
            if behind is not None:
                behind.append((chunk, behind[0][1]))  # a room's chunks keep their order
                continue
            if not self.can_defer:
                deadline = time.monotonic() + self._patience
                while not self._ready(chunk) and time.monotonic() < deadline:
                    time.sleep(0.005)
                return self._take(chunk)
            if not self._ready(chunk):
                self._waiting[room] = collections.deque([(chunk, time.monotonic())])
                self._on_defer()
                continue
            return self._take(chunk)

    def _take(self, chunk: Any) -> Any:
        room, marked = getattr(_chunk, "room", None), getattr(_chunk, "marked", None)
        if room is not None and marked and self._on_unsettled is not None:
            # The previous chunk ended without SGLang seeing its WRITEs settle (no path of
            # 0.5.23 does that): their outcome is unknown.
            self._on_unsettled(room, marked)
        _set_chunk(getattr(chunk, "room", None), bool(getattr(chunk, "is_last_chunk", False)))
        return chunk

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)


def _check_decode_release_settings(settings: Settings) -> None:
    """The decode holds a failed room's pages only through SGLang's deferred release; its
    timeout must outlast the longest a destination lease can take to end after a release."""
    if not envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.get():
        raise ConfigError(
            "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE",
            "0",
            "1 with the kvlease destination-page lease (SGLang's default; "
            "or turn the lease off with SGLANG_KVLEASE_DEST_LEASE=0)",
        )
    bound = settings.config.lease_extension + settings.config.push_guard
    timeout = float(envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT.get())
    if timeout <= bound:
        raise ConfigError(
            "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT",
            timeout,
            f"more than the lease's release bound E + G = {bound:g} s "
            "(from SGLANG_KVLEASE_LEASE_DURATION and SGLANG_KVLEASE_MAX_ACCESS_TIME)",
        )


class LeaseManagerMixin(_ManagerBase):  # type: ignore[misc]
    """SGLang's NIXL KV manager with kvlease leases (see the module docstring)."""

    _kvlease: LeaseRuntime | None = None
    _kvlease_settings: Settings | None = None
    kvlease_dropped: int = 0

    def __init__(self, args: Any, disaggregation_mode: Any, server_args: Any, is_mla_backend: Any = False) -> None:
        settings = load_settings()  # before any thread starts: a bad value fails start-up
        if disaggregation_mode == DisaggregationMode.DECODE and settings.dest_lease:
            _check_decode_release_settings(settings)
        # SGLang's __init__ starts the transfer workers; the runtime exists only after it.
        self._kvlease_settings = settings
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        role = "prefill" if disaggregation_mode == DisaggregationMode.PREFILL else "decode"
        rt = self._kvlease = LeaseRuntime(
            settings,
            role=role,
            ip=self.local_ip,
            port=self.rank_port,
            on_event=self._on_lease_event,
            zmq_context=self._zmq_ctx,
            poll_interval=min(0.05, settings.config.heartbeat_interval / 10),
        )
        from ._metrics import mount

        where = mount(rt, engine_rank=int(getattr(args, "engine_rank", 0) or 0))
        c = settings.config
        logger.info(
            "kvlease: %s rank %s leases on (d=%gs: heartbeat every %.3gs, extension %.3gs; A=%gs; "
            "destination-page lease %s, source-page lease %s; deployment key %s; metrics %s)",
            role,
            rt.engine_id,
            c.kv_lease_duration,
            c.heartbeat_interval,
            c.lease_extension,
            c.max_access_time,
            "on" if settings.dest_lease else "off",
            "on" if settings.source_lease else "off",
            "set" if c.auth_keys else "none",
            where,
        )

    @property
    def kvlease(self) -> LeaseRuntime | None:
        return self._kvlease

    # -- lease events -> SGLang states ------------------------------------------------------

    def _on_lease_event(self, ev: RoomEvent) -> None:
        if ev.kind != "fail":
            return
        status = self.request_status.get(ev.room)
        if status is None or status in (KVPoll.Success, KVPoll.Failed):
            # Nothing to fail; said, since it is a late word from the other side (for one: the
            # prefill's access-done reached this decode after the lease's expiry).
            logger.info("kvlease: room %s, already concluded (%s): %s", ev.room, status, ev.reason)
            return
        logger.warning("kvlease: room %s fails: %s", ev.room, ev.reason)
        if self.disaggregation_mode == DisaggregationMode.PREFILL and ev.room in self.transfer_infos:
            self.conclude_failure(bootstrap_room=ev.room, failure_reason=ev.reason)
        else:
            self.record_failure(ev.room, ev.reason)
            self.update_status(ev.room, KVPoll.Failed)

    # -- inbound: decode listener thread ----------------------------------------------------

    def handle_chunk_ready(self, msg: list[bytes]) -> bool:
        if SglangZmqTransport.is_ours(msg):
            if self._kvlease is not None:
                self._kvlease.deliver(msg)
            return True
        try:
            return bool(super().handle_chunk_ready(msg))
        except Exception:
            self.kvlease_dropped += 1
            return True

    # -- inbound: prefill bootstrap thread --------------------------------------------------

    def _handle_abort_notification(self, msg: list[bytes]) -> bool:
        if SglangZmqTransport.is_ours(msg):
            if self._kvlease is not None:
                self._kvlease.deliver(msg)
            return True
        if not msg or msg[0] not in _PREFILL_TAGS:
            self.kvlease_dropped += 1  # foreign traffic would kill SGLang's bootstrap thread
            return True
        if msg[0] == GUARD:
            try:
                body = msg[1:]
                if body[0] == b"None":
                    KVArgsRegisterInfo.from_zmq(body)
                else:
                    TransferInfo.from_zmq(body)
            except Exception:
                self.kvlease_dropped += 1
                return True
        handled = bool(super()._handle_abort_notification(msg))
        rt = self._kvlease
        if handled and msg[0] == ABORT_TAG and rt is not None:
            notification = AbortNotification.from_zmq(msg)
            if notification is not None:
                # The decode aborted the room (SGLang marked it Failed above, so no further
                # chunk of it is taken): leases no WRITE is in flight for end now.
                rt.close_room(notification.room)
        return handled

    # -- prefill: the write gate ----------------------------------------------------------

    def transfer_worker(self, queue: Any, staging_buffer: Any = None, worker_index: int = 0) -> Any:
        # Started from SGLang's __init__, before the runtime exists: it is looked up per chunk.
        settings = self._kvlease_settings
        if settings is None or not settings.dest_lease:
            return super().transfer_worker(queue, staging_buffer, worker_index)
        interval = settings.config.heartbeat_interval

        def deferred() -> None:
            rt = self._kvlease
            if rt is not None:
                rt.chunks_deferred += 1

        def unsettled(room: int, marked: set[str]) -> None:
            rt = self._kvlease
            if rt is not None:
                rt.settle(room, marked, clean=False)

        gated = _GatedQueue(queue, self._kvlease_ready, interval, min(0.005, interval / 10), deferred, unsettled)
        if not gated.can_defer:
            logger.warning(
                "kvlease: this SGLang's transfer queue has no timed wait: "
                "a room waiting for its lease waits in the worker (and the rooms behind it)"
            )
        return super().transfer_worker(gated, staging_buffer, worker_index)

    def _kvlease_peers(self, room: int) -> list[Peer]:
        """The decode ranks `room` writes to, from SGLang's transfer metadata (cached per chunk)."""
        infos = self.transfer_infos.get(room)
        if infos is not None and infos is getattr(_chunk, "infos", None) and _chunk.peers is not None:
            peers: list[Peer] = _chunk.peers
            return peers
        peers = []
        for info in (infos or {}).values():
            if not info.is_dummy:
                peers.append(
                    (engine_name(info.endpoint, info.dst_port), info.dst_kv_indices.tobytes(), int(info.dst_aux_index))
                )
        if getattr(_chunk, "room", None) == room:
            _chunk.infos, _chunk.peers = infos, peers
        return peers

    def _kvlease_ready(self, chunk: Any) -> bool:
        """Whether a worker may take `chunk` now: its room's leases are acknowledged and cover
        a WRITE, or SGLang will skip the chunk anyway (room failed or cleared)."""
        rt = self._kvlease
        room = getattr(chunk, "room", None)
        if rt is None:
            return False  # the manager is still starting: the runtime is moments away
        if room is None or room not in self.request_status or self.check_status(room) == KVPoll.Failed:
            return True
        infos = self.transfer_infos.get(room)
        if infos is None:
            return True
        peers = [(engine_name(i.endpoint, i.dst_port), b"", 0) for i in infos.values() if not i.is_dummy]
        return not peers or rt.ready(room, peers)

    def _post_xfer(self, xfer_handle: Any, error_msg: str) -> None:
        settings = self._kvlease_settings
        if settings is None or not settings.dest_lease or self.disaggregation_mode != DisaggregationMode.PREFILL:
            return super()._post_xfer(xfer_handle, error_msg)  # type: ignore[no-any-return]
        rt = self._kvlease
        if rt is None:
            raise _NixlPostError("kvlease: WRITE not started: the lease runtime is not up yet")
        room = getattr(_chunk, "room", None)
        if room is None:
            raise _NixlPostError("kvlease: WRITE not started: posted outside a transfer worker's chunk")
        reason = rt.gate(room, self._kvlease_peers(room), _chunk.marked)
        if reason is not None:
            _chunk.refused = True
            raise _NixlPostError(f"kvlease: WRITE not started: {reason}")
        try:
            super()._post_xfer(xfer_handle, error_msg)
        except BaseException:
            _chunk.raised = True  # its WRITE may still land
            raise
        _chunk.pending.append(xfer_handle)

    def _await_handles(self, handles: list[Any], *, failure_seen: bool) -> tuple[bool, bool]:
        settled, failed = super()._await_handles(handles, failure_seen=failure_seen)
        if not settled:
            _chunk.unsettled = True
        rt = self._kvlease
        room = getattr(_chunk, "room", None)
        if rt is not None and room is not None and _chunk.marked:
            rest = [h for h in _chunk.pending if not any(h is w or h == w for w in handles)]
            if failed:
                _chunk.raised = True
            if not settled or not rest:
                self._kvlease_settle(rt, room, clean=settled and not _chunk.raised)
            else:
                _chunk.pending = rest  # one decode rank's WRITE of a staged chunk
        return settled, failed

    @staticmethod
    def _kvlease_settle(rt: LeaseRuntime, room: int, *, clean: bool) -> None:
        marked, _chunk.marked, _chunk.pending, _chunk.raised = _chunk.marked, set(), [], False
        rt.settle(room, marked, clean=clean)

    def conclude_transfer(self, *, bootstrap_room: int, status: Any, **kwargs: Any) -> Any:
        rt = self._kvlease
        if rt is not None and self.disaggregation_mode == DisaggregationMode.PREFILL:
            if status == KVPoll.Success:
                rt.end_write(bootstrap_room, True)  # by the worker, once every WRITE settled DONE
            else:
                rt.close_room(bootstrap_room)
        return super().conclude_transfer(bootstrap_room=bootstrap_room, status=status, **kwargs)

    def poison_deferred_ack_room(self, room: int) -> None:
        rt = self._kvlease
        if rt is not None and self.disaggregation_mode == DisaggregationMode.PREFILL:
            # SGLang cannot prove the room drained (a post raised, or a handle never settled):
            # the accesses end as posted failures, whatever settles later.
            rt.taint(room)
            ours = getattr(_chunk, "room", None) == room
            if ours and _chunk.marked:
                self._kvlease_settle(rt, room, clean=False)
            if ours and _chunk.refused and not _chunk.unsettled:
                # SGLang poisons the drain ACK because "the rejected request's writes may
                # still land"; a WRITE the gate refused was never posted, and the chunk's
                # posted ones settled before this call: the ACK, sent once every chunk of the
                # room drained, stays true. Poisoned, it would leave a decode that waits for
                # it (`is_abort_release_safe`) to SGLang's deferred-release timeout.
                return
        super().poison_deferred_ack_room(room)

    # -- decode: the release gate ---------------------------------------------------------

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        rt = self._kvlease
        if rt is None or not rt.settings.dest_lease:
            return bool(super().is_abort_release_safe(bootstrap_room, required_acks))
        if not rt.dest_freed(bootstrap_room):
            return False
        if rt.dest_needs_drain(bootstrap_room):
            # The lease ran out after this decode's abort with no word from a prefill that
            # may be alive and still writing: SGLang's drain ACK (or its timeout) decides.
            return bool(super().is_abort_release_safe(bootstrap_room, required_acks))
        return True

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        """SGLang's deferred release of an aborted or failed request resolved (drained or timed
        out): its destination pages go back to the pool now. Said once per room (INFO), with
        what it waited for, so an operator can match it with the abort or the failure."""
        super().clear_deferred_abort_state(bootstrap_room)
        rt = self._kvlease
        if rt is not None:
            waited = "the prefill's drain ACK" if rt.dest_needs_drain(bootstrap_room) else "its lease's end"
            logger.info("kvlease: room %s: destination pages released after %s", bootstrap_room, waited)
            rt.forget_dest(bootstrap_room)
            rt.release_resolved(bootstrap_room)


class LeaseSenderMixin(_SenderBase):  # type: ignore[misc]
    """SGLang's NIXL sender; its room's KV is held under a source lease the decode renews."""

    _kvlease_source = False

    def __init__(
        self, mgr: Any, bootstrap_addr: str, bootstrap_room: int, req_has_disagg_prefill_dp_rank: bool = False
    ) -> None:
        super().__init__(mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank)
        rt = getattr(mgr, "kvlease", None)
        if rt is not None and self.conclude_state is None and not getattr(mgr, "is_dummy_cp_rank", False):
            rt.open_source(bootstrap_room)
            self._kvlease_source = rt.settings.source_lease

    def _check_bootstrap_timeout(self) -> Any:
        if self._kvlease_source:
            return None  # liveness instead of a fixed timeout: the lease's expiry fails the room
        return super()._check_bootstrap_timeout()

    def abort(self) -> None:
        super().abort()
        rt = getattr(self.kv_mgr, "kvlease", None)
        if rt is not None:
            rt.close_room(self.bootstrap_room)

    def clear(self) -> None:
        super().clear()
        rt = getattr(self.kv_mgr, "kvlease", None)
        if rt is not None:
            rt.close_source(self.bootstrap_room)


class LeaseReceiverMixin(_ReceiverBase):  # type: ignore[misc]
    """SGLang's NIXL receiver; renews the prefill's source lease and pins its destination pages."""

    _kvlease_done = False
    _kvlease_restarted = False  # SGLang's waiting timeout restarted once the leases ended

    def _prefill_ranks(self) -> list[tuple[str, int]]:
        infos = getattr(self, "bootstrap_infos", None) or []
        return [(str(i["rank_ip"]), int(i["rank_port"])) for i in infos if not i.get("is_dummy", False)]

    def init(self, prefill_dp_rank: int) -> None:
        super().init(prefill_dp_rank)
        rt = getattr(self.kv_mgr, "kvlease", None)
        if rt is not None and rt.settings.source_lease and self.conclude_state is None:
            for ip, port in self._prefill_ranks():
                rt.ask_source(self.bootstrap_room, ip, port)

    def send_metadata(self, kv_indices: Any, aux_index: Any = None, *args: Any, **kwargs: Any) -> None:
        rt = getattr(self.kv_mgr, "kvlease", None)
        if rt is not None and rt.settings.dest_lease and self.conclude_state is None:
            pages = kv_indices.tobytes()  # exactly what SGLang's metadata message carries
            aux = -1 if aux_index is None else int(aux_index)
            for ip, port in self._prefill_ranks():
                rt.grant_dest(self.bootstrap_room, ip, port, pages, aux)
        super().send_metadata(kv_indices, aux_index, *args, **kwargs)

    def _check_waiting_timeout(self) -> Any:
        rt = getattr(self.kv_mgr, "kvlease", None)
        if rt is not None and rt.settings.dest_lease:
            room = self.bootstrap_room
            if rt.dest_decides(room):
                return None  # a live lease is an alive prefill; an expired one fails the room itself
            if not self._kvlease_restarted and rt.dest_ended(room):
                # The leases ended on the access-done (the data landed) or a release, possibly a
                # moment before SGLang's own KV_STATUS arrives on its socket: the stock timeout
                # counts from here, not from a wait the lease already covered.
                self._kvlease_restarted = True
                self.init_time = time.time()
        return super()._check_waiting_timeout()

    def _settle(self, status: Any) -> None:
        rt = getattr(self.kv_mgr, "kvlease", None)
        if rt is None or self._kvlease_done:
            return
        if status == KVPoll.Failed:
            self._kvlease_done = True
            rt.release_dest(self.bootstrap_room)
            rt.stop_source(self.bootstrap_room)
        elif status == KVPoll.Success:
            self._kvlease_done = True
            rt.stop_source(self.bootstrap_room)

    def poll(self) -> Any:
        status = super().poll()
        self._settle(status)
        return status

    def abort(self) -> None:
        super().abort()
        self._settle(KVPoll.Failed)

    def clear(self) -> None:
        status = self.kv_mgr.request_status.get(self.bootstrap_room)
        super().clear()
        self._settle(KVPoll.Success if status == KVPoll.Success else KVPoll.Failed)
        rt = getattr(self.kv_mgr, "kvlease", None)
        if rt is not None:
            rt.forget_dest(self.bootstrap_room)


class LeaseNixlKVManager(LeaseManagerMixin, NixlKVManager):  # type: ignore[misc]
    """Stock SGLang's NIXL KV manager with kvlease leases."""


class LeaseNixlKVSender(LeaseSenderMixin, NixlKVSender):  # type: ignore[misc]
    """Stock SGLang's NIXL sender with kvlease's source lease."""


class LeaseNixlKVReceiver(LeaseReceiverMixin, NixlKVReceiver):  # type: ignore[misc]
    """Stock SGLang's NIXL receiver with kvlease's leases."""


_PARTS: dict[Any, tuple[type, type, type]] = {
    KVClassType.MANAGER: (LeaseManagerMixin, NixlKVManager, LeaseNixlKVManager),
    KVClassType.SENDER: (LeaseSenderMixin, NixlKVSender, LeaseNixlKVSender),
    KVClassType.RECEIVER: (LeaseReceiverMixin, NixlKVReceiver, LeaseNixlKVReceiver),
}
_composed: dict[tuple[type, type], type] = {}
_composed_lock = threading.Lock()


def compose(class_type: Any, cls: Any) -> Any:
    """The lease-enabled class for `cls`, what the rest of the ``get_kv_class`` chain returned
    for `class_type`: stock SGLang's class gets ours; a subclass of it (another plugin's) gets
    our mixin above it, so both apply; other class types pass through."""
    parts = _PARTS.get(class_type)
    if parts is None or not isinstance(cls, type):
        return cls
    mixin, stock, ours = parts
    if issubclass(cls, mixin):
        return cls  # already lease-enabled (the hook ran twice, or another plugin wraps ours)
    if not issubclass(cls, stock):
        raise TypeError(
            f"kvlease: get_kv_class returned {cls.__module__}.{cls.__qualname__} for {class_type}, which is not a "
            f"subclass of SGLang's {stock.__name__}: the lease plugin cannot compose with it (remove one of "
            "the plugins from SGLANG_PLUGINS)"
        )
    if cls is stock:
        return ours
    with _composed_lock:
        made = _composed.get((mixin, cls))
        if made is None:
            name = f"Lease{cls.__name__}"
            made = type(name, (mixin, cls), {"__module__": __name__, "__qualname__": name})
            _composed[(mixin, cls)] = made
        return made
