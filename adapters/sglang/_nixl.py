"""Lease-enabled subclasses of SGLang 0.5.23's NIXL KV manager, sender and receiver.

Imported only inside an SGLang process (by the `get_kv_class` hook). What each override adds:

Prefill (`LeaseNixlKVManager` in PREFILL mode, `LeaseNixlKVSender`):
- the sender grants a *source lease* on the room's KV and answers the decode's ticket request;
  its fixed ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` is replaced by that lease's liveness;
- destination tickets from the decode are tracked (heartbeated) at once;
- each transfer worker runs its queue through `_GatedQueue`, so `_post_xfer` knows the chunk it
  posts for: the first WRITE of a non-final chunk is posted only if every destination lease's
  validity window covers it, the first WRITE of the final chunk only if the push guard allows the
  access (``now + A_l <= valid_until``); otherwise nothing is posted and the room fails through
  SGLang's own failure path (``_NixlPostError`` -> ``conclude_failure`` -> ``KV_STATUS`` Failed);
- when the final chunk's WRITEs all settled DONE (``conclude_transfer(Success)``) the access-done
  goes to the decode, which frees at once; a chunk whose WRITEs may still be running
  (``poison_deferred_ack_room``) gives the lease up, so the decode waits for expiry + guard.

Decode (`LeaseNixlKVManager` in DECODE mode, `LeaseNixlKVReceiver`):
- ``init`` (admission, before the memory wait) asks each prefill rank for its source ticket and
  renews it from then on;
- ``send_metadata`` first grants one push lease per prefill rank and sends it the ticket;
- while a destination lease is live (or has expired and is failing the room), SGLang's fixed
  ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` does not apply: an alive prefill keeps the pages however
  long it takes;
- a failed or aborted room releases its leases; SGLang's deferred release then holds the pages
  until ``is_abort_release_safe`` — which here means: every destination lease of the room has
  ended (access-done, a release never promised, or expiry plus the push guard). The prefill's
  ``ABORT_ACK`` is not trusted for that.
- expiry or loss of a lease fails the room (``record_failure`` + ``KVPoll.Failed``), so SGLang's
  abort, retry and release paths run.

Both: ``KVLEASE`` messages on the manager socket are taken before SGLang's parsing; on the prefill,
any message whose tag SGLang does not know, or a ``NixlMsgGuard`` message that does not parse, is
dropped and counted instead of killing the bootstrap thread.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from sglang.srt.disaggregation.base.conn import KVPoll  # type: ignore[import-not-found]
from sglang.srt.disaggregation.common.conn import ABORT_TAG  # type: ignore[import-not-found]
from sglang.srt.disaggregation.nixl.conn import (  # type: ignore[import-not-found]
    GUARD,
    KVArgsRegisterInfo,
    NixlKVManager,
    NixlKVReceiver,
    NixlKVSender,
    TransferInfo,
    _NixlPostError,
)
from sglang.srt.disaggregation.utils import DisaggregationMode  # type: ignore[import-not-found]
from sglang.srt.environ import envs  # type: ignore[import-not-found]

from kvlease import ConfigError

from ._lease import LeaseRuntime, RoomEvent
from ._settings import Settings, load_settings
from ._transport import SglangZmqTransport

__all__ = ["LeaseNixlKVManager", "LeaseNixlKVReceiver", "LeaseNixlKVSender"]

logger = logging.getLogger("kvlease.adapters.sglang")

_PREFILL_TAGS = frozenset({b"WATERMARK", b"STAGING_RSP", ABORT_TAG, GUARD})

#: The chunk a transfer-worker thread is processing (set by `_GatedQueue.get`).
_chunk = threading.local()


class _GatedQueue:
    """A transfer worker's queue, seen through: remembers which chunk the thread took."""

    def __init__(self, queue: Any) -> None:
        self._queue = queue

    def get(self, *args: Any, **kwargs: Any) -> Any:
        chunk = self._queue.get(*args, **kwargs)
        _chunk.room = getattr(chunk, "room", None)
        _chunk.last = bool(getattr(chunk, "is_last_chunk", False))
        _chunk.gated = False
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
            "1 with the kvlease destination-page lease (the plugin sets it unless it is set; "
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


class LeaseNixlKVManager(NixlKVManager):  # type: ignore[misc]
    """SGLang's NIXL KV manager with kvlease leases (see the module docstring)."""

    _kvlease: LeaseRuntime | None = None
    kvlease_dropped: int = 0

    def __init__(self, args: Any, disaggregation_mode: Any, server_args: Any, is_mla_backend: Any = False) -> None:
        settings = load_settings()  # before any thread starts: a bad value fails start-up
        if disaggregation_mode == DisaggregationMode.DECODE and settings.dest_lease:
            _check_decode_release_settings(settings)
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        role = "prefill" if disaggregation_mode == DisaggregationMode.PREFILL else "decode"
        self._kvlease = LeaseRuntime(
            settings,
            role=role,
            ip=self.local_ip,
            port=self.rank_port,
            on_event=self._on_lease_event,
            zmq_context=self._zmq_ctx,
            poll_interval=min(0.05, settings.config.heartbeat_interval / 10),
        )
        from ._metrics import mount

        mount(self._kvlease, engine_rank=int(getattr(args, "engine_rank", 0) or 0))

    @property
    def kvlease(self) -> LeaseRuntime | None:
        return self._kvlease

    # -- lease events -> SGLang states ------------------------------------------------------

    def _on_lease_event(self, ev: RoomEvent) -> None:
        if ev.kind != "fail":
            return
        status = self.request_status.get(ev.room)
        if status is None or status in (KVPoll.Success, KVPoll.Failed):
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
        return bool(super()._handle_abort_notification(msg))

    # -- prefill: the write gate ----------------------------------------------------------

    def transfer_worker(self, queue: Any, staging_buffer: Any = None, worker_index: int = 0) -> Any:
        return super().transfer_worker(_GatedQueue(queue), staging_buffer, worker_index)

    def _gate(self, rt: LeaseRuntime, room: int, last: bool) -> str | None:
        """None when the chunk's WRITEs may start, else why not. Only a destination lease that
        is not acknowledged yet (its ticket or first heartbeat round still on the way) is waited
        for, up to one heartbeat interval; a lapsed window is refused at once."""
        deadline = time.monotonic() + rt.config.heartbeat_interval
        while rt.awaiting_first_ack(room) and time.monotonic() < deadline:
            if self.check_status(room) == KVPoll.Failed:
                break
            time.sleep(0.005)
        return rt.begin_write(room) if last else rt.covered(room)

    def _post_xfer(self, xfer_handle: Any, error_msg: str) -> None:
        rt = self._kvlease
        room = getattr(_chunk, "room", None)
        if rt is not None and rt.settings.dest_lease and room is not None and not getattr(_chunk, "gated", True):
            reason = self._gate(rt, room, getattr(_chunk, "last", False))
            if reason is not None:
                raise _NixlPostError(f"kvlease: WRITE not started: {reason}")
            _chunk.gated = True
        super()._post_xfer(xfer_handle, error_msg)

    def conclude_transfer(self, *, bootstrap_room: int, status: Any, **kwargs: Any) -> Any:
        rt = self._kvlease
        if rt is not None and self.disaggregation_mode == DisaggregationMode.PREFILL:
            # Called by the worker once every WRITE of the chunk settled: DONE for Success.
            rt.end_write(bootstrap_room, status == KVPoll.Success)
        return super().conclude_transfer(bootstrap_room=bootstrap_room, status=status, **kwargs)

    def poison_deferred_ack_room(self, room: int) -> None:
        rt = self._kvlease
        if rt is not None and self.disaggregation_mode == DisaggregationMode.PREFILL:
            rt.end_write(room, False, "a WRITE may still be running")
        super().poison_deferred_ack_room(room)

    # -- decode: the release gate ---------------------------------------------------------

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        rt = self._kvlease
        if rt is None or not rt.settings.dest_lease:
            return bool(super().is_abort_release_safe(bootstrap_room, required_acks))
        return rt.dest_freed(bootstrap_room)

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        super().clear_deferred_abort_state(bootstrap_room)
        if self._kvlease is not None:
            self._kvlease.forget_dest(bootstrap_room)


class LeaseNixlKVSender(NixlKVSender):  # type: ignore[misc]
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

    def clear(self) -> None:
        super().clear()
        rt = getattr(self.kv_mgr, "kvlease", None)
        if rt is not None:
            rt.close_source(self.bootstrap_room)


class LeaseNixlKVReceiver(NixlKVReceiver):  # type: ignore[misc]
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
            for ip, port in self._prefill_ranks():
                rt.grant_dest(self.bootstrap_room, ip, port)
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
