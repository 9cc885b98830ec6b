"""One SGLang 0.5.23 disaggregation rank (prefill or decode) on CPU buffers, driven line by line.

Run with ``.venv-sglang/bin/python tests/_sglang_proc.py prefill|decode BOOTSTRAP_PORT``. It loads
plugins the way SGLang's scheduler does (``load_plugins()``, filtered by ``SGLANG_PLUGINS``), then
builds SGLang's own bootstrap server (prefill), KV manager, senders and receivers through the
module-level ``get_kv_class`` copies in ``prefill.py`` / ``decode.py`` — the ones SGLang's prefill
and decode queues call — over CPU tensors registered with NIXL as DRAM. Commands arrive as JSON
lines on stdin; each answer is one JSON line on stdout prefixed ``@@ `` (SGLang logs go to stderr).

Nothing here stands in for SGLang or kvlease: the only fault injected is a straggler (a delay
before a NIXL WRITE is posted, ``slow_post``), by wrapping the NIXL agent's ``transfer`` call.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import zmq
    from kvlease.adapters.sglang._lease import LeaseRuntime

# Die with the test runner, even if it is killed before its teardown (Linux: PR_SET_PDEATHSIG).
with contextlib.suppress(OSError, AttributeError):
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)

os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

ROLE, PORT = sys.argv[1], int(sys.argv[2])
NUM_PAGES, PAGE_BYTES, LAYERS = 32, 256, 2
AUX_SLOTS, AUX_BYTES = 8, 64


def fill_source(kv: list[Any], aux: Any) -> None:
    for layer, t in enumerate(kv):
        for page in range(NUM_PAGES):
            t[page].fill_((page * 7 + layer * 3 + 11) % 251)
    for slot in range(AUX_SLOTS):
        aux[slot].fill_(200 + slot)


def main() -> None:
    import numpy as np
    import torch

    # sglang has no type information (and is installed only in .venv-sglang): its imports are
    # ignored one by one, as in adapters/sglang/.
    from sglang.srt.disaggregation import decode as sg_decode  # type: ignore[import-not-found]
    from sglang.srt.disaggregation import prefill as sg_prefill  # mypy reports this package once: above
    from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll  # type: ignore[import-not-found]
    from sglang.srt.disaggregation.utils import (  # type: ignore[import-not-found]
        DisaggregationMode,
        KVClassType,
        TransferBackend,
    )
    from sglang.srt.plugins import (  # type: ignore[import-not-found]
        GENERAL_PLUGINS_GROUP,
        load_plugins,
        load_plugins_by_group,
    )
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish  # type: ignore[import-not-found]
    from sglang.srt.server_args import ServerArgs  # type: ignore[import-not-found]

    t_start = time.time()
    load_plugins()
    sa = ServerArgs(
        model_path="dummy",
        device="cpu",
        host="127.0.0.1",
        disaggregation_mode=ROLE,
        disaggregation_transfer_backend="nixl",
        disaggregation_bootstrap_port=PORT,
    )
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    # SGLang's scheduler process configures logging after load_plugins(), before its KV manager
    # exists (configure_scheduler_process): the root logger, its format, stderr.
    from sglang.srt.utils import configure_logger  # type: ignore[import-not-found]

    configure_logger(sa, prefix=f" {ROLE}")
    get_parallel().override_permanently(pp_group=None)  # no torch.distributed groups: PP 1

    kv = [torch.zeros((NUM_PAGES, PAGE_BYTES), dtype=torch.uint8) for _ in range(LAYERS)]
    aux = torch.zeros((AUX_SLOTS, AUX_BYTES), dtype=torch.uint8)
    if ROLE == "prefill":
        fill_source(kv, aux)
    else:
        for t in kv:
            t.fill_(1)
    a = KVArgs()
    a.engine_rank, a.pp_rank, a.system_dp_rank, a.rust_http_port = 0, 0, 0, None
    a.kv_cache_dtype_str, a.kv_layout = "uint8", None
    a.prefill_start_layer, a.prefill_end_layer = 0, LAYERS
    a.kv_data_ptrs = [t.data_ptr() for t in kv]
    a.kv_data_lens = [t.numel() for t in kv]
    a.kv_item_lens = [PAGE_BYTES] * LAYERS
    # CPU: SGLang's default (VRAM) is refused by UCX. A rank started with the host-memory shim
    # plugin (engines/sglang/shims/dram_plugin) keeps SGLang's VRAM here and lets the shim fix it.
    a.kv_data_mem_kinds = [os.environ.get("KVLEASE_TEST_KV_MEM_KIND", "DRAM")] * LAYERS
    a.num_draft_entries, a.kv_layer_ids = 0, list(range(LAYERS))
    a.kv_head_num = a.total_kv_head_num = 1
    a.page_size = 1
    a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = [aux.data_ptr()], [aux.numel()], [AUX_BYTES]
    a.ib_device, a.gpu_id = None, 0
    a.state_types, a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], [], []
    a.state_layer_ids, a.state_dim_per_tensor, a.state_slice_outer_counts = [], [], []
    a.is_hybrid_mla_backend, a.state_conv_shard_groups, a.swa_kv_cache_layout = False, [], None
    a.mla_compression_ratios, a.kv_buf_groups, a.hidden_kv_layers, a.draft_kv_layers = None, 1, LAYERS, 0

    nixl = TransferBackend.NIXL
    mod = sg_prefill if ROLE == "prefill" else sg_decode
    classes = {
        "prefill_manager": sg_prefill.get_kv_class(nixl, KVClassType.MANAGER).__name__,
        "prefill_sender": sg_prefill.get_kv_class(nixl, KVClassType.SENDER).__name__,
        "decode_manager": sg_decode.get_kv_class(nixl, KVClassType.MANAGER).__name__,
        "decode_receiver": sg_decode.get_kv_class(nixl, KVClassType.RECEIVER).__name__,
    }
    server = None
    if ROLE == "prefill":
        server = mod.get_kv_class(nixl, KVClassType.BOOTSTRAP_SERVER)(host="127.0.0.1", port=PORT)
        mgr = mod.get_kv_class(nixl, KVClassType.MANAGER)(a, DisaggregationMode.PREFILL, sa, False)
    else:
        mgr = mod.get_kv_class(nixl, KVClassType.MANAGER)(a, DisaggregationMode.DECODE, sa, False)
    rt: LeaseRuntime | None = getattr(mgr, "kvlease", None)
    senders: dict[int, Any] = {}
    receivers: dict[int, Any] = {}
    posts: list[float] = []
    state: dict[str, Any] = {"slow": 0.0, "slow_left": -1, "fail_after": None, "fail_late": 0.0}
    real_transfer = mgr.agent.transfer

    def straggle(handle: Any, late: float, args: Any, kwargs: Any) -> None:
        """The WRITE whose post raised is posted anyway, `late` seconds later, and driven to
        its end (what "its writes may still land" means)."""
        time.sleep(late)
        posts.append(time.time())
        real_transfer(handle, *args, **kwargs)
        deadline = time.time() + 10
        while mgr.agent.check_xfer_state(handle) not in ("DONE", "ERR") and time.time() < deadline:
            time.sleep(0.001)

    def transfer(handle: Any, *args: Any, **kwargs: Any) -> Any:
        if state["slow"] and state["slow_left"] != 0:
            state["slow_left"] -= 1
            time.sleep(state["slow"])  # a straggler: the WRITE is posted late
        left = state["fail_after"]
        if left is not None:
            if left == 0:  # this post raises; its WRITE is still posted, later
                state["fail_after"] = None
                args_ = (handle, state["fail_late"], args, kwargs)
                threading.Thread(target=straggle, args=args_, daemon=True).start()
                raise RuntimeError("injected post error (the WRITE is posted late)")
            state["fail_after"] = left - 1
        posts.append(time.time())
        return real_transfer(handle, *args, **kwargs)

    mgr.agent.transfer = transfer

    # Tickets on the decode's way out (decode only): captured per room, held on request, and
    # replayed relabelled (an attacker on the network that delays and rewrites messages).
    tickets: dict[int, tuple[str, bytes]] = {}
    held: list[tuple[int, str, bytes]] = []
    hold_rooms: set[int] = set()
    real_push = rt.transport.push if rt is not None else None

    def push(address: str, kind: bytes, payload: bytes, **kw: Any) -> None:
        assert real_push is not None
        if kind == b"T":
            import msgpack

            room_t = msgpack.unpackb(payload, raw=False)["room"]
            tickets[room_t] = (address, payload)
            if room_t in hold_rooms:
                held.append((room_t, address, payload))
                return
        real_push(address, kind, payload, **kw)

    if rt is not None and ROLE == "decode":
        rt.transport.push = push  # type: ignore[method-assign]
    answer(
        {
            "ok": True,
            "classes": classes,
            "manager": type(mgr).__name__,
            "mro": [k.__name__ for k in type(mgr).__mro__],
            "engine_id": rt.engine_id if rt else None,
            "rank_port": mgr.rank_port,
            "pid": os.getpid(),
            "startup_s": time.time() - t_start,
        }
    )

    names: dict[int, str] = {v: k for k, v in vars(KVPoll).items() if isinstance(v, int)}

    def status_name(s: int) -> str:
        return names[s]

    def failure(room: int) -> str | None:
        with mgr.failure_lock:
            record: str | None = mgr.failure_records.get(room)  # room -> reason, if it failed
            return record

    def runtime() -> LeaseRuntime:
        if rt is None:
            raise RuntimeError(f"no kvlease runtime on {type(mgr).__name__}")
        return rt

    def party(room: int) -> Any:
        """This rank's sender (prefill) or receiver (decode) for `room`."""
        obj = senders.get(room) if ROLE == "prefill" else receivers.get(room)
        if obj is None:
            raise KeyError(f"no {'sender' if ROLE == 'prefill' else 'receiver'} for room {room}")
        return obj

    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "sender":
                room = cmd["room"]
                cls = sg_prefill.get_kv_class(nixl, KVClassType.SENDER)
                s = senders[room] = cls(mgr, f"127.0.0.1:{PORT}", room)
                s.init(cmd["pages"], aux_index=cmd["aux"])
                answer({"ok": True, "status": status_name(s.poll())})
            elif op == "connect":  # what the decode does on first contact with a prefill
                addr = f"127.0.0.1:{cmd['prefill_port']}"
                deadline = time.time() + 60
                while not mgr.try_ensure_parallel_info(addr):
                    if time.time() > deadline:
                        raise RuntimeError("no parallel info from the prefill bootstrap server")
                    time.sleep(0.05)
                answer({"ok": True})
            elif op == "receiver":
                room = cmd["room"]
                addr = f"127.0.0.1:{cmd['prefill_port']}"
                deadline = time.time() + 30
                while not mgr.try_ensure_parallel_info(addr):
                    if time.time() > deadline:
                        raise RuntimeError("no parallel info from the prefill bootstrap server")
                    time.sleep(0.05)
                r = receivers[room] = sg_decode.get_kv_class(nixl, KVClassType.RECEIVER)(mgr, addr, room)
                r.init(0)
                answer({"ok": True, "status": status_name(r.poll())})
            elif op == "metadata":
                r = receivers[cmd["room"]]
                r.send_metadata(np.array(cmd["pages"], dtype=np.int32), aux_index=cmd["aux"])
                answer({"ok": True, "t": time.time()})
            elif op == "wait":  # poll the sender/receiver until one of the statuses, or timeout
                room = cmd["room"]
                obj = party(room)
                want = set(cmd["statuses"])
                deadline = time.time() + cmd["within"]
                st = status_name(obj.poll())
                while st not in want and time.time() < deadline:
                    time.sleep(0.005)
                    st = status_name(obj.poll())
                answer({"ok": True, "status": st, "t": time.time(), "failure": failure(room)})
            elif op == "send":
                senders[cmd["room"]].send(np.array(cmd["pages"], dtype=np.int32))
                answer({"ok": True, "t": time.time()})
            elif op == "abort":
                party(cmd["room"]).abort()
                answer({"ok": True, "t": time.time()})
            elif op == "clear":
                obj = senders.pop(cmd["room"]) if ROLE == "prefill" else receivers.pop(cmd["room"])
                obj.clear()
                answer({"ok": True})
            elif op == "release_safe":
                answer({"ok": True, "safe": bool(mgr.is_abort_release_safe(cmd["room"], 1))})
            elif op == "wait_release_safe":  # what SGLang's deferred release polls
                deadline = time.time() + cmd["within"]
                safe = bool(mgr.is_abort_release_safe(cmd["room"], 1))
                while not safe and time.time() < deadline:
                    time.sleep(0.002)
                    safe = bool(mgr.is_abort_release_safe(cmd["room"], 1))
                answer({"ok": True, "safe": safe, "t": time.time()})
            elif op == "pages":  # bytes of the given pages, every layer, as lists of distinct values
                out: dict[str, list[list[int]]] = {}
                for p in cmd["pages"]:
                    out[str(p)] = [sorted({int(x) for x in kv[layer][p].tolist()}) for layer in range(LAYERS)]
                answer({"ok": True, "pages": out, "aux": sorted({int(x) for x in aux[cmd.get("aux", 0)].tolist()})})
            elif op == "expected":  # what the source pages hold (prefill's fill pattern)
                answer(
                    {
                        "ok": True,
                        "pages": {
                            str(p): [[(p * 7 + layer * 3 + 11) % 251] for layer in range(LAYERS)] for p in cmd["pages"]
                        },
                    }
                )
            elif op == "canary":
                for p in cmd["pages"]:
                    for t in kv:
                        t[p].fill_(cmd["value"])
                if cmd.get("aux") is not None:
                    aux[cmd["aux"]].fill_(cmd["value"])
                answer({"ok": True, "t": time.time()})
            elif op == "slow_post":  # every post (or the next `count`) waits `seconds` first
                state["slow"] = cmd["seconds"]
                state["slow_left"] = cmd.get("count", -1)
                answer({"ok": True})
            elif op == "poisoned":  # SGLang gave the room's drain ACK up (poison_deferred_ack_room)
                answer({"ok": True, "poisoned": cmd["room"] in mgr._deferred_ack_poisoned_rooms})
            elif op == "posts":
                answer({"ok": True, "posts": posts})
            elif op == "fail_post":  # the post `after` posts from now raises; its WRITE lands `late` s later
                state["fail_after"], state["fail_late"] = cmd["after"], cmd["late"]
                answer({"ok": True})
            elif op == "pause_before":  # the next call of a manager method waits first (a late post)
                name, seconds = cmd["method"], cmd["seconds"]
                original = getattr(mgr, name)

                def paused(*a: Any, _o: Any = original, _n: str = name, _s: float = seconds, **k: Any) -> Any:
                    mgr.__dict__.pop(_n, None)
                    time.sleep(_s)
                    return _o(*a, **k)

                setattr(mgr, name, paused)
                answer({"ok": True})
            elif op == "hold_tickets":
                hold_rooms.update(cmd["rooms"])
                answer({"ok": True})
            elif op == "release_tickets":
                assert real_push is not None
                rooms = set(cmd["rooms"])
                hold_rooms.difference_update(rooms)
                for item in [h for h in held if h[0] in rooms]:
                    held.remove(item)
                    real_push(item[1], b"T", item[2])
                answer({"ok": True})
            elif op == "forge_ticket":  # room `from_room`'s ticket, relabelled as `as_room`
                import msgpack

                assert real_push is not None
                address, payload = tickets[cmd["from_room"]]
                forged = msgpack.unpackb(payload, raw=False)
                forged["room"] = cmd["as_room"]
                real_push(address, b"T", msgpack.packb(forged, use_bin_type=True))
                answer({"ok": True})
            elif op == "source_live":
                answer({"ok": True, "live": bool(runtime().source_live(cmd["room"]))})
            elif op == "validity":  # seconds of validity left on each lease this rank accesses
                lr = runtime()
                with lr._lock:
                    now = lr.driver.now()
                    left: dict[str, float | None] = {}
                    for key in lr.keys(cmd["room"], cmd.get("prefix", "d:")):
                        vu = lr.accessor.valid_until(key)
                        left[key] = None if vu is None else vu - now
                answer({"ok": True, "left": left, "t": time.time()})
            elif op == "dest_expiry":  # decode: seconds until each destination lease's expiry
                lr = runtime()
                with lr._lock:
                    now = lr.driver.now()
                    exp: dict[str, list[float | str] | None] = {}
                    for lid in lr._dest.get(cmd["room"], {}):
                        info = lr.pinner.info(lid)
                        exp[str(lid)] = None if info is None else [info.expiry - now, str(info.state)]
                answer({"ok": True, "expiry": exp, "t": time.time()})
            elif op == "stats":
                lr = runtime()
                answer(
                    {
                        "ok": True,
                        "stats": {k: v for k, v in lr.stats.snapshot().items()},
                        "writes_refused": lr.writes_refused,
                        "rooms_failed": lr.rooms_failed,
                        "tickets_refused": getattr(lr, "tickets_refused", 0),
                        "dropped": lr.transport.dropped + getattr(mgr, "kvlease_dropped", 0),
                    }
                )
            elif op == "multiproc_metrics":  # what SGLang's /metrics serves (--enable-metrics)
                from prometheus_client import CollectorRegistry, generate_latest, multiprocess

                registry = CollectorRegistry()
                multiprocess.MultiProcessCollector(registry, path=cmd["path"])  # type: ignore[no-untyped-call]
                answer({"ok": True, "text": generate_latest(registry).decode()})
            elif op == "compose":  # the hook over another plugin's classes (its AROUND hook inside ours)
                from kvlease.adapters.sglang import kv_class_hook
                from sglang.srt.disaggregation.nixl.conn import (  # type: ignore[import-not-found]
                    NixlKVManager,
                    NixlKVReceiver,
                    NixlKVSender,
                )

                composed: dict[str, dict[str, Any]] = {}
                for kind, base in (("MANAGER", NixlKVManager), ("SENDER", NixlKVSender), ("RECEIVER", NixlKVReceiver)):
                    other = type(f"OtherPlugin{base.__name__}", (base,), {})
                    cls = kv_class_hook(lambda *a, _o=other, **k: _o, nixl, getattr(KVClassType, kind))
                    composed[kind] = {
                        "mro": [k.__name__ for k in cls.__mro__][:6],
                        "is_other": issubclass(cls, other),
                        "leased": any(k.__module__.startswith("kvlease.") for k in cls.__mro__),
                    }
                answer({"ok": True, "classes": composed})
            elif op == "queue_drill":  # the plugin's gated queue over SGLang's FastQueue, counted
                import collections
                import types

                from kvlease.adapters.sglang._nixl import _GatedQueue
                from sglang.srt.disaggregation.common.utils import FastQueue  # type: ignore[import-not-found]

                fq = FastQueue()
                checks: collections.Counter[int] = collections.Counter()
                ready_rooms = set(cmd["ready"])

                def ready(
                    chunk: Any, _checks: collections.Counter[int] = checks, _ready: set[int] = ready_rooms
                ) -> bool:
                    _checks[chunk.room] += 1
                    return chunk.room in _ready

                gated = _GatedQueue(fq, ready, cmd["patience"], 0.002, lambda: None)
                for room_c, idx in cmd["chunks"]:
                    fq.put(types.SimpleNamespace(room=room_c, idx=idx, is_last_chunk=False))
                taken: list[dict[str, Any]] = []
                for n in range(cmd["take"]):
                    if n == cmd.get("ready_at", -1):
                        ready_rooms.add(cmd["ready_room"])
                    before = dict(checks)
                    t_get = time.monotonic()
                    chunk = gated.get()
                    taken.append(
                        {
                            "room": chunk.room,
                            "idx": chunk.idx,
                            "s": time.monotonic() - t_get,
                            "checks": {str(k): v - before.get(k, 0) for k, v in checks.items()},
                        }
                    )
                answer({"ok": True, "taken": taken, "can_defer": gated.can_defer})
            elif op == "sglang_defaults":  # what SGLang itself says its defaults are
                from sglang.srt.environ import envs  # type: ignore[import-not-found]

                answer({"ok": True, "defaults": {name: repr(getattr(envs, name).default) for name in cmd["names"]}})
            elif op == "metrics":
                from prometheus_client import REGISTRY, generate_latest

                answer({"ok": True, "text": generate_latest(REGISTRY).decode()})
            elif op == "inject":  # raw multipart onto a manager socket (hostile traffic)
                import zmq

                sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 10000)
                sock.connect(f"tcp://127.0.0.1:{cmd['port']}")
                for frames in cmd["messages"]:
                    sock.send_multipart([bytes.fromhex(f) for f in frames])
                sock.close()
                answer({"ok": True})
            elif op == "alive":  # SGLang's socket threads still serve
                answer({"ok": True, "threads": sorted(t.name for t in threading.enumerate())})
            elif op == "discover":  # SGLang's plugin discovery under a given SGLANG_PLUGINS
                saved = os.environ.get("SGLANG_PLUGINS")
                os.environ["SGLANG_PLUGINS"] = cmd["allow"]
                try:
                    found = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
                finally:
                    if saved is None:
                        os.environ.pop("SGLANG_PLUGINS", None)
                    else:
                        os.environ["SGLANG_PLUGINS"] = saved
                answer({"ok": True, "plugins": {k: f"{v[0].__module__}:{v[0].__name__}" for k, v in found.items()}})
            elif op == "check_release_settings":  # the decode's start-up check, under given env
                from kvlease.adapters.sglang._nixl import _check_decode_release_settings
                from kvlease.adapters.sglang._settings import load_settings

                saved_env: dict[str, str | None] = {k: os.environ.get(k) for k in cmd["env"]}
                os.environ.update(cmd["env"])
                try:
                    _check_decode_release_settings(load_settings())
                    verdict = None
                except Exception as exc:
                    verdict = f"{type(exc).__name__}: {exc}"
                finally:
                    for k, v in saved_env.items():
                        if v is None:
                            os.environ.pop(k, None)
                        else:
                            os.environ[k] = v
                answer({"ok": True, "error": verdict})
            elif op == "exit":
                answer({"ok": True})
                break
            else:
                answer({"ok": False, "error": f"unknown op {op!r}"})
        except Exception as exc:
            answer({"ok": False, "error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()})
    if server is not None:
        with contextlib.suppress(Exception):
            server.close()
    os._exit(0)


def answer(obj: dict[str, Any]) -> None:
    sys.stdout.write("@@ " + json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:
        answer({"ok": False, "error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()})
        sys.stdout.flush()
        os._exit(1)
