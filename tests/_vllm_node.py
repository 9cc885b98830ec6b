"""One vLLM 0.33.0 instance (prefill or decode) for the adapter tests, run with .venv-vllm's python.

Real parts: vLLM's `Scheduler`, the KV connector built by vLLM's factory from a real
`KVTransferConfig` (scheduler side and worker side, the latter registered as vLLM's global KV
transfer group), vLLM's own KV-cache allocation on the CPU (`allocate_kv_cache`), every step
going through vLLM's `KVConnectorModelRunnerMixin`, and NIXL/UCX between processes. Faked: the
model forward only. The prefill "forward" writes a pattern into the KV blocks it computes
(value = f(request, block position, layer)); the decode side checks that pattern in the blocks
vLLM loaded for it, so a READ of freed-and-reused blocks shows.

Protocol: one JSON command per stdin line; one ``EV {json}`` line per event on stdout. The node
steps continuously (every ``--step-ms``), as vLLM's engine core does while it has requests, so
heartbeats flow while commands are awaited.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import queue
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
BLOCK = 32


def use_this_checkout() -> None:
    """Import kvlease from the checkout this file is in, not from wherever .venv-vllm's editable
    install points (a git worktree shares the main checkout's environment, whose mapping of
    ``kvlease.adapters`` / ``kvlease.transports`` would otherwise run the main checkout's code)."""
    root = Path(__file__).resolve().parents[1]
    dirs = {
        "kvlease": root / "kvlease",
        "kvlease.adapters": root / "adapters",
        "kvlease.transports": root / "transports",
        "kvlease.spec": root / "spec",
    }

    class Checkout(importlib.abc.MetaPathFinder):
        def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
            where = dirs.get(name)
            if where is None:
                return None
            return importlib.util.spec_from_file_location(
                name, where / "__init__.py", submodule_search_locations=[str(where)]
            )

    sys.meta_path.insert(0, Checkout())


_EMIT = threading.Lock()  # events come from the main thread and from vLLM's push writer thread


def emit(ev: str, **kw: Any) -> None:
    kw["ev"] = ev
    kw.setdefault("t", time.monotonic())
    with _EMIT:
        sys.stdout.write("EV " + json.dumps(kw) + "\n")
        sys.stdout.flush()


def pattern(rid: str, pos: int, layer: int) -> float:
    return float((sum(map(ord, rid)) * 131 + pos * 7 + layer * 1009) % 100003) + 0.5


def fill(kv_caches: dict[str, Any], rid: str, block_ids: list[int]) -> None:
    """The fake prefill forward: every element of `rid`'s blocks (every head this rank holds)."""
    for li, name in enumerate(LAYERS):
        t = kv_caches[name]
        for pos, b in enumerate(block_ids):
            t[b].fill_(pattern(rid, pos, li))


def check(kv_caches: dict[str, Any], rid: str, block_ids: list[int]) -> bool:
    for li, name in enumerate(LAYERS):
        t = kv_caches[name]
        for pos, b in enumerate(block_ids):
            if not bool((t[b] == pattern(rid, pos, li)).all()):
                return False
    return True


def start_worker(args: argparse.Namespace, vllm_config: Any, kv_cache_config: Any) -> tuple[Any, dict[str, Any]]:
    """This process's TP rank: vLLM's distributed state, the worker-side connector built by
    vLLM (as its global KV transfer group), vLLM's CPU KV cache, registered with the connector."""
    import torch
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.kv_transfer import ensure_kv_transfer_initialized, get_kv_transfer_group
    from vllm.v1.attention.backend import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    # As vLLM's CPU worker does before it initializes the distributed state (its CPU
    # communicator names its shared-memory group after the init method's port).
    os.environ["VLLM_DIST_IDENT"] = os.environ["KVT_DIST_PORT"]
    init_distributed_environment(
        world_size=args.tp,
        rank=args.worker_rank,
        distributed_init_method=f"tcp://127.0.0.1:{int(os.environ['KVT_DIST_PORT'])}",
        local_rank=args.worker_rank,
        backend="gloo",
    )
    ensure_model_parallel_initialized(args.tp, 1)
    ensure_kv_transfer_initialized(vllm_config, kv_cache_config)
    worker = get_kv_transfer_group()
    # vLLM's NIXL worker pins the process to the last core of its NUMA node, for a server
    # with cores to spare; four instances on one small machine would then share one core.
    if not args.keep_pin:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    kv_caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), KVCacheLayout.LBHNC)
    worker.register_kv_caches(kv_caches)
    return worker, kv_caches


def worker_stats(worker: Any) -> dict[str, Any]:
    import attrs

    impl = getattr(worker, "connector_worker", None)
    drv = getattr(impl, "kvlease_driver", None)
    return {
        "driver": None
        if drv is None
        else {k: v for k, v in attrs.asdict(drv.stats).items() if isinstance(v, int | float)},
        "counters": None if drv is None or drv.pinner is None else attrs.asdict(drv.pinner.counters),
        "live": None if drv is None or drv.pinner is None else drv.pinner.live_count,
        "tracked": None if drv is None or drv.accessor is None else drv.accessor.tracked_count,
        "reqs_to_send": len(getattr(impl, "_reqs_to_send", {})),
        "push": getattr(impl, "kvlease_push_counts", None),
        "cpus": {"main": sorted(os.sched_getaffinity(0)), "pump": pump_cpus(impl)},
        "clock": time.monotonic(),  # this rank's CLOCK_MONOTONIC (a time namespace moves it)
    }


def pump_cpus(impl: Any) -> list[int] | None:
    """The cores the kvlease lease pump thread may run on (None: no pump running)."""
    pump = getattr(impl, "_kv_pump", None)
    if not isinstance(pump, threading.Thread) or not pump.is_alive() or pump.native_id is None:
        return None
    return sorted(os.sched_getaffinity(pump.native_id))


def sleep_and_wake(worker: Any) -> Any:
    """vLLM's sleep and wake-up of this rank's KV cache registration (what a worker's ``sleep``
    / ``wake_up`` do to the connector): its new handshake metadata, for the scheduler."""
    worker.unregister_kv_caches()
    worker.restore_kv_caches()
    return worker.get_handshake_metadata()


def tp_worker(args: argparse.Namespace, vllm_config: Any, kv_cache_config: Any) -> None:
    """TP rank > 0 in its own process: runs each step's scheduler output that rank 0 sends
    through vLLM's model-runner mixin, the prefill forward faked as on rank 0."""
    from multiprocessing.connection import Client

    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    with set_current_vllm_config(vllm_config):
        worker, kv_caches = start_worker(args, vllm_config, kv_cache_config)
        # Connected once the distributed state exists: rank 0 accepts only after its own.
        conn = Client(("127.0.0.1", args.ctl_port), authkey=b"kvt")
        conn.send((args.worker_rank, worker.get_handshake_metadata()))
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                break
            if msg[0] == "step":
                so = msg[1]
                if args.role == "kv_producer":
                    for nr in so.scheduled_new_reqs:
                        fill(kv_caches, nr.req_id, list(nr.block_ids[0]))
                with (
                    set_forward_context(None, vllm_config),
                    KVConnectorModelRunnerMixin._get_kv_connector_output(so) as kvo,
                ):
                    pass
                conn.send(kvo)
            elif msg[0] == "check":
                conn.send(check(kv_caches, msg[1], msg[2]))
            elif msg[0] == "stats":
                conn.send(worker_stats(worker))
            elif msg[0] == "sleep":
                conn.send(sleep_and_wake(worker))
            else:
                break
        worker.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["kv_producer", "kv_consumer"], required=True)
    ap.add_argument("--connector", choices=["kvlease", "stock", "kvlease-push", "stock-push"], required=True)
    ap.add_argument("--engine-id", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--extra", default="{}")
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size: TP ranks 1.. run as worker processes")
    ap.add_argument("--worker-rank", type=int, default=0, help=argparse.SUPPRESS)  # a TP worker process
    ap.add_argument(
        "--worker-clock-offset",
        type=int,
        default=0,
        help="TP ranks 1.. run with CLOCK_MONOTONIC this many seconds off the host's (a time namespace)",
    )
    ap.add_argument("--ctl-port", type=int, default=0, help=argparse.SUPPRESS)  # rank 0's control listener
    ap.add_argument("--bad-config", default="", help="JSON extra config that must fail at build")
    ap.add_argument(
        "--keep-pin",
        action="store_true",
        help="keep vLLM's pinning of the worker's main thread to one core (others get every core back)",
    )
    ap.add_argument(
        "--build",
        default="[]",
        help="JSON list of connector configs to build on the scheduler side at start (vLLM's factory), each "
        '{"extra": {...}, "policy": "fail", "pp": 2, "role": "kv_consumer"} (defaults: this node\'s): a "built" '
        "event each, with the error if it failed; what it logged is in the node's log",
    )
    args = ap.parse_args()
    use_this_checkout()

    import torch

    # As every vLLM process does at start (vllm serve's engine core, its workers).
    import vllm.logger
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.forward_context import set_forward_context
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    vllm.logger._configure_vllm_root_logger()
    if os.environ.get("KVT_DEBUG"):
        import logging

        logging.basicConfig(level=logging.WARNING, format="%(created).3f %(name)s %(message)s")
        logging.getLogger("kvlease").setLevel(logging.DEBUG)
    # NIXL's progress thread polls UCX without pause (a core each); four instances on a 2-core
    # machine would starve each other (and any process stalled past D/2 rightly loses its
    # leases). Without it, UCX progresses whenever the connector polls, i.e. every step, which
    # these instances do every few ms. A tuning of NIXL's agent config, not of vLLM's logic.
    import functools

    import vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker as nixl_base_worker

    if nixl_base_worker.nixl_agent_config is not None:
        nixl_base_worker.nixl_agent_config = functools.partial(
            nixl_base_worker.nixl_agent_config, enable_prog_thread=False
        )
    extra = json.loads(args.extra)
    if args.connector == "kvlease":
        # vLLM's own name, from kvlease's module: vLLM's name-keyed NIXL checks apply.
        conn, module = "NixlConnector", "kvlease.adapters.vllm"
    elif args.connector == "kvlease-push":
        conn, module = "NixlPushConnector", "kvlease.adapters.vllm"
    elif args.connector == "stock-push":
        conn, module = "NixlPushConnector", None
    else:
        conn, module = "NixlConnector", None

    def kv_config(extra_config: dict[str, Any], policy: str = "recompute", role: str = args.role) -> KVTransferConfig:
        return KVTransferConfig(
            kv_connector=conn,
            kv_connector_module_path=module,
            kv_role=role,
            engine_id=args.engine_id,
            kv_connector_extra_config=extra_config,
            kv_load_failure_policy=policy,
        )

    t0 = time.monotonic()
    model_config = ModelConfig(
        model=args.model, tokenizer=args.model, skip_tokenizer_init=True, max_model_len=2048, dtype="float32", seed=0
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_model_len=2048,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=2048,
            enable_chunked_prefill=False,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
        parallel_config=ParallelConfig(tensor_parallel_size=args.tp),
        kv_transfer_config=kv_config(extra),
        device_config=DeviceConfig("cpu"),
    )
    vllm_config.cache_config.kv_cache_layout = "LBHNC"
    vllm_config.cache_config.num_gpu_blocks = args.blocks
    # Each TP rank holds its share of the model's KV heads (one at least: with more ranks than
    # heads, vLLM replicates them, and its TP mapping then reads one rank per distinct head).
    heads = max(1, model_config.get_total_num_kv_heads() // args.tp)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=32, dtype=torch.float32)
    page = spec.page_size_bytes
    nb = args.blocks
    kv_cache_config = KVCacheConfig(
        num_blocks=nb,
        kv_cache_tensors=[
            KVCacheTensor(size=page * nb * len(LAYERS), layers=list(LAYERS), layer_stride=page * nb, block_stride=page)
        ],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
    )
    emit("config", seconds=time.monotonic() - t0)

    if args.worker_rank:
        tp_worker(args, vllm_config, kv_cache_config)
        return

    if args.bad_config:
        # Built through vLLM's own factory, as the engine does; must fail naming the key.
        import copy

        bad = copy.copy(vllm_config)
        bad.kv_transfer_config = kv_config(json.loads(args.bad_config))
        try:
            KVConnectorFactory.create_connector(bad, KVConnectorRole.SCHEDULER, kv_cache_config)
        except Exception as exc:
            emit("bad_config", error=f"{type(exc).__name__}: {exc}")
        else:
            emit("bad_config", error=None)
    for i, spec in enumerate(json.loads(args.build)):
        # Built through vLLM's own factory, as the engine does (scheduler side: its checks and
        # start-up warnings, in vLLM's log format).
        import copy

        other = copy.copy(vllm_config)
        other.kv_transfer_config = kv_config(
            spec.get("extra", extra), spec.get("policy", "recompute"), spec.get("role", args.role)
        )
        if "pp" in spec:
            other.parallel_config = copy.copy(vllm_config.parallel_config)
            other.parallel_config.pipeline_parallel_size = int(spec["pp"])
        try:
            KVConnectorFactory.create_connector(other, KVConnectorRole.SCHEDULER, kv_cache_config)
        except Exception as exc:
            emit("built", i=i, error=f"{type(exc).__name__}: {exc}")
        else:
            emit("built", i=i, error=None)

    # TP ranks 1..: one worker process each, as vLLM's multiprocessing executor runs them; this
    # process is the engine core (the scheduler) and TP rank 0. Each step's scheduler output goes
    # to every rank, and their connector outputs are aggregated by vLLM's KVOutputAggregator.
    ranks: list[Any] = []
    procs: list[Any] = []
    if args.tp > 1:
        import subprocess
        from multiprocessing.connection import Listener

        listener = Listener(("127.0.0.1", 0), authkey=b"kvt")
        for r in range(1, args.tp):
            argv = [*sys.argv[1:], "--worker-rank", str(r), "--ctl-port", str(listener.address[1])]
            wcmd = [sys.executable, os.path.abspath(__file__), *argv]
            if args.worker_clock_offset:  # this rank on another host's clock (multi-node TP)
                off = args.worker_clock_offset
                wcmd = ["unshare", "--time", f"--monotonic={off}", f"--boottime={off}", "--fork", "--kill-child", *wcmd]
            procs.append(subprocess.Popen(wcmd, stdout=sys.stderr))
    with set_current_vllm_config(vllm_config):
        worker, kv_caches = start_worker(args, vllm_config, kv_cache_config)
        handshake = {(0, 0): worker.get_handshake_metadata()}
        for _ in range(1, args.tp):
            link = listener.accept()
            rank, md = link.recv()
            handshake[(0, rank)] = md
            ranks.append(link)
        if os.environ.get("KVT_DEBUG"):
            impl = worker.connector_worker
            real_send = impl.nixl_wrapper.send_notif
            real_hs = impl._ensure_handshake

            def send_notif(agent: Any, notif_msg: Any = b"", *a: Any, **k: Any) -> Any:
                print(f"{time.time():.3f} send_notif {agent!r} {bytes(notif_msg)[:40]!r}", file=sys.stderr)
                return real_send(agent, notif_msg, *a, **k)

            def ensure(*a: Any, **k: Any) -> Any:
                r = real_hs(*a, **k)
                print(f"{time.time():.3f} ensure_handshake {a} -> {r}", file=sys.stderr)
                return r

            impl.nixl_wrapper.send_notif = send_notif
            impl._ensure_handshake = ensure
        # Push: every WRITE vLLM's writer thread posts, counted at the NIXL agent (per the
        # decoder request id of vLLM's "id:count" notification, before kvlease swaps it), so
        # the tests see what was posted independently of the adapter's own bookkeeping.
        writes_posted: dict[str, int] = {}
        impl0 = getattr(worker, "connector_worker", None)
        if args.connector.endswith("-push") and impl0 is not None:
            agent0 = impl0.nixl_wrapper
            real_prep = agent0.make_prepped_xfer
            xfer_op: dict[int, str] = {}

            def make_prepped_xfer(op: Any, *a: Any, **k: Any) -> Any:
                h = real_prep(op, *a, **k)
                notif = k.get("notif_msg", a[4] if len(a) > 4 else b"")
                if op == "WRITE":
                    xfer_op[h] = bytes(notif).decode("utf-8", "replace").rpartition(":")[0]
                return h

            real_transfer = agent0.transfer

            def transfer(h: Any, *a: Any, **k: Any) -> Any:
                rid = xfer_op.pop(h, None)
                if rid is not None:
                    writes_posted[rid] = writes_posted.get(rid, 0) + 1
                return real_transfer(h, *a, **k)

            agent0.make_prepped_xfer = make_prepped_xfer
            agent0.transfer = transfer

        # Push: a stall of vLLM's writer thread between a WRITE's approval and its posting (as a
        # GC pause or a starved thread would), per decoder request id: the `stall_writer` op.
        # With "rank": only before the WRITE to that decoder rank (after the others were posted:
        # a stall between two WRITEs of one push), said by a "stalling" event.
        stalls: dict[str, tuple[float, int | None]] = {}
        if args.connector.endswith("-push") and impl0 is not None:
            real_xfer_blocks = impl0._xfer_blocks

            def xfer_blocks(*a: Any, **k: Any) -> Any:
                rid = str(k.get("remote_request_id"))
                stall = stalls.get(rid)
                if stall is not None and stall[1] in (None, int(k["read_spec"].remote_rank)):
                    del stalls[rid]
                    emit("stalling", id=rid, rank=int(k["read_spec"].remote_rank), seconds=stall[0])
                    time.sleep(stall[0])
                return real_xfer_blocks(*a, **k)

            impl0._xfer_blocks = xfer_blocks
        # Push, decoder: a registration altered on its way to the producer (a party on the path
        # without the deployment key), per decoder request id: the `tamper_reg` op. "unsealed"
        # strips the ticket's tag; "moved" keeps the tag and names the blocks in another order.
        tamper: dict[str, str] = {}
        if args.connector.endswith("-push") and impl0 is not None and args.role == "kv_consumer":
            real_send_reg = impl0._do_send_reg_notif

            def send_reg(req_id: str, reg_data: dict[str, Any]) -> Any:
                how = tamper.pop(str(reg_data.get("request_id")), None)
                if how == "unsealed":
                    reg_data = {**reg_data, "kvlease": {k: v for k, v in reg_data["kvlease"].items() if k != "tag"}}
                elif how == "moved":
                    reg_data = {**reg_data, "local_block_ids": [list(g)[::-1] for g in reg_data["local_block_ids"]]}
                return real_send_reg(req_id, reg_data)

            impl0._do_send_reg_notif = send_reg
        # A transfer vLLM posted stays "in progress" however NIXL reports it, per request id
        # (push: the producer's WRITE, the `hold_write` / `release_write` ops; pull: the
        # decoder's READ, `hold_read` with `seconds`), as a slow transfer would: its handles are
        # hidden from vLLM's own poll of its transfers, then put back. NIXL sends a READ's
        # notification only when the reader polls it, so a held READ's access-done waits too.
        held: dict[str, list[float]] = {}  # request id -> [seconds, since] (since: first seen posted)
        if impl0 is not None:
            real_pop = impl0._pop_done_transfers

            def pop_done_transfers(transfers: dict[str, list[int]]) -> Any:
                if not held:
                    return real_pop(transfers)
                now = time.monotonic()
                for r, hold in list(held.items()):
                    if r in transfers and hold[1] < 0:
                        hold[1] = now
                        emit("held", id=r)
                    elif hold[1] >= 0 and now >= hold[1] + hold[0]:
                        del held[r]
                        emit("unheld", id=r)
                hidden = {r: transfers.pop(r) for r in list(held) if r in transfers}
                try:
                    return real_pop(transfers)
                finally:
                    transfers.update(hidden)

            impl0._pop_done_transfers = pop_done_transfers
        scheduler = Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=BLOCK,
        )
        scheduler.connector.set_xfer_handshake_metadata_pp_aware(handshake)
    # vLLM's own metrics path for connector stats: the scheduler process records what the workers
    # report with the connector's KVConnectorPromMetrics, on vLLM's Prometheus registry.
    import prometheus_client
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    prom = KVConnectorProm(vllm_config, ["engine"], {0: ["0"]})
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

    aggregator = KVOutputAggregator(args.tp)

    def prom_kvlease() -> dict[str, float]:
        out: dict[str, float] = {}
        for line in prometheus_client.generate_latest().decode().splitlines():
            if line.startswith("vllm:kvlease_"):
                name, _, value = line.rpartition(" ")
                out[name.split("{")[0]] = float(value)
        return out

    emit(
        "ready",
        seconds=time.monotonic() - t0,
        scheduler_connector=type(scheduler.connector).__qualname__,
        worker_connector=type(worker).__qualname__,
        worker_impl=type(getattr(worker, "connector_worker", None)).__qualname__,
        scheduler_impl=type(getattr(scheduler.connector, "connector_scheduler", None)).__qualname__,
        kv_cache_shape=list(kv_caches[LAYERS[0]].shape),
        adapter=getattr(sys.modules.get("kvlease.adapters.vllm"), "__file__", None),
    )

    cmds: queue.Queue[dict[str, Any]] = queue.Queue()

    def reader() -> None:
        for line in sys.stdin:
            if line.strip():
                cmds.put(json.loads(line))
        cmds.put({"op": "exit"})

    threading.Thread(target=reader, daemon=True).start()

    waiting: dict[str, dict[str, Any]] = {}  # decode requests: what to check once loaded
    first_sched: set[str] = set()
    token = 5
    running = True
    stepped = False  # commands wait for the first step (it builds the lease driver)
    while running:
        batch: list[dict[str, Any]] = []
        while stepped:
            if batch:
                cmd = batch.pop(0)
            else:
                try:
                    cmd = cmds.get_nowait()
                except queue.Empty:
                    break
            op = cmd["op"]
            if op == "batch":  # these commands all run before the next scheduler step
                batch.extend(cmd["cmds"])
                continue
            if op == "exit":
                running = False
                break
            if op == "stats":
                mine = worker_stats(worker)
                others = []
                for c in ranks:
                    c.send(("stats",))
                    others.append(c.recv())
                emit(
                    "stats",
                    **mine,
                    ranks=[mine, *others],  # every TP rank's, rank 0 first
                    writes_posted=dict(writes_posted),
                    prometheus=prom_kvlease(),
                )
                continue
            if op == "sleep":
                # vLLM's sleep and wake-up on every rank; the scheduler republishes the new
                # registration (its generation goes up: decoders handshake again).
                new_md = {(0, 0): sleep_and_wake(worker)}
                for r, c in enumerate(ranks, start=1):
                    c.send(("sleep",))
                    new_md[(0, r)] = c.recv()
                connector_scheduler = scheduler.connector.connector_scheduler
                generation = connector_scheduler._registration_generation
                scheduler.connector.set_xfer_handshake_metadata_pp_aware(new_md)
                if connector_scheduler._registration_generation == generation:
                    # On the CPU the registration of the same buffers comes back byte-identical
                    # (UCX's keys of host memory), where a GPU's wake-up changes it: the
                    # generation goes up as vLLM's scheduler counts a changed registration.
                    connector_scheduler._registration_generation += 1
                emit("slept", generation=connector_scheduler._registration_generation)
                continue
            rid = cmd["id"]
            if op in ("hold_write", "hold_read"):
                # `rid`'s transfer stays reported pending until released or for `seconds` (`held`)
                held[rid] = [float(cmd.get("seconds", float("inf"))), -1.0]
                emit(op, id=rid)
                continue
            if op == "release_write":
                held.pop(rid, None)
                emit(op, id=rid)
                continue
            if op == "tamper_reg":
                tamper[rid] = str(cmd["how"])
                emit("tampering", id=rid)
                continue
            if op == "stall_writer":
                stalls[rid] = (float(cmd["seconds"]), cmd.get("rank"))
                emit("stalled", id=rid)
                continue
            if op == "abort":
                scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
                emit("aborted", id=rid)
                continue
            prompt = cmd.get("prompt") or [(i % 900) + 3 for i in range(cmd.get("tokens", 96))]
            params: dict[str, Any] | None
            if op == "prefill":
                params = {"do_remote_decode": True}
                max_tokens = 1
            elif op in ("decode", "turn2"):
                # turn2: bidirectional turn 2 on a producer, reading turn 1's blocks back from
                # the decoder (only the first `check_blocks` hold the turn-1 prefill's pattern).
                params = dict(cmd["params"])
                max_tokens = cmd.get("max_tokens", 2 if op == "decode" else 1)
                waiting[rid] = {"prefill_id": cmd.get("prefill_id", rid), "check_blocks": cmd.get("check_blocks")}
            else:  # "local": a plain request (occupies a sequence slot while it decodes)
                params = None
                max_tokens = cmd.get("max_tokens", 10)
            sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args={"kv_transfer_params": params})
            req = Request(rid, prompt, sp, None, arrival_time=time.time())
            scheduler.add_request(req)
            emit("added", id=rid)

        t_a = time.monotonic()
        so = scheduler.schedule()
        t_b = time.monotonic()
        for nr in so.scheduled_new_reqs:
            req = scheduler.requests[nr.req_id]
            blocks = list(nr.block_ids[0])
            if args.role == "kv_producer":
                fill(kv_caches, nr.req_id, blocks)  # the fake prefill forward
            elif nr.req_id in waiting:
                waiting[nr.req_id]["blocks"] = blocks
            emit("scheduled", id=nr.req_id, num_computed_tokens=nr.num_computed_tokens, blocks=blocks)
        for rid in so.scheduled_cached_reqs.req_ids:
            if rid not in first_sched and rid in waiting:
                first_sched.add(rid)
                req = scheduler.requests[rid]
                emit("resumed", id=rid, num_computed_tokens=req.num_computed_tokens)
        for c in ranks:
            c.send(("step", so))
        with (
            set_current_vllm_config(vllm_config),
            set_forward_context(None, vllm_config),
            KVConnectorModelRunnerMixin._get_kv_connector_output(so) as kvo,
        ):
            pass
        if ranks:
            outputs = [types.SimpleNamespace(kv_connector_output=kvo)]
            outputs += [types.SimpleNamespace(kv_connector_output=c.recv()) for c in ranks]
            kvo = aggregator.aggregate(outputs).kv_connector_output
        if kvo.kv_connector_stats is not None:
            prom.observe(kvo.kv_connector_stats.data, 0)
        req_ids = list(so.num_scheduled_tokens)
        for rid in kvo.finished_recving or ():
            info = waiting.get(rid)
            failed = rid in (kvo.failed_recving or ())
            loaded: list[int] | None = None
            if rid in scheduler.requests:
                loaded = list(scheduler.kv_cache_manager.get_block_ids(rid)[0])
            ok = None
            if not failed and loaded and info is not None:
                blocks_read = loaded[: info["check_blocks"] or len(loaded)]
                ok = check(kv_caches, info["prefill_id"], blocks_read)
                for c in ranks:  # every TP rank's share of the heads
                    c.send(("check", info["prefill_id"], blocks_read))
                    ok = bool(c.recv()) and ok
            emit("recv_done", id=rid, failed=failed, match=ok, blocks=loaded)
        for rid in kvo.finished_sending or ():
            emit("freed", id=rid)
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[token] for _ in req_ids],
            kv_connector_output=kvo,
        )
        t_c = time.monotonic()
        outs = scheduler.update_from_output(so, mro)
        t_d = time.monotonic()
        if t_d - t_a > 0.5:
            emit("slow_step", schedule=t_b - t_a, connector=t_c - t_b, update=t_d - t_c)
        for eco in outs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    emit("finished", id=o.request_id, reason=str(o.finish_reason), params=o.kv_transfer_params)
        stepped = True
        time.sleep(args.step_ms / 1000.0)
    for c in ranks:
        c.send(("exit",))
    worker.shutdown()
    scheduler.shutdown()
    for proc in procs:
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
