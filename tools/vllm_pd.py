"""Real `vllm serve` prefill/decode pairs on this machine, for the suite, the benchmark and the demo.

Each server is a real ``vllm serve`` process of the engine environment (.venv-vllm, built by
engines/vllm/setup.sh) with real CPU forward passes of the tiny Llama made there, KV moved over
NIXL (UCX on loopback, host memory), run with stock vLLM's ``NixlConnector`` or with kvlease's
(``kv_connector_module_path: kvlease.adapters.vllm``). In front: engines/vllm/router.py; the
requests come from engines/vllm/client.py (the ``openai`` library; tools/openai_serving.py). Used by
tests/test_vllm_serve.py, bench/vllm_serve.py and this file's ``demo`` (docs/vllm-serve.md).

Servers start in a scratch directory, never in the repository: a process started from a folder
that holds a directory named ``kvlease`` imports that directory (without the mapped subpackages)
instead of the installed package.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import attrs
import openai_serving as serving
from openai_serving import Held, Reference, tail, wait_until
from ports import free_port
from procstat import proc_stats
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
VENV_PY = ROOT / ".venv-vllm" / "bin" / "python"
MODEL = ROOT / ".venv-vllm" / "tiny-llama"
ROUTER = ROOT / "engines" / "vllm" / "router.py"

#: Every server's environment (docs/vllm-serve.md explains each).
SERVER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
    "UCX_NET_DEVICES": "lo",
    "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "1",
    # Four servers share two cores: one compute thread each, and OpenMP threads that sleep when
    # idle (Intel OpenMP spins 200 ms after every parallel region by default: four idle workers
    # spinning at 40 % CPU each starved the machine to 2 decoded tokens per second).
    "OMP_NUM_THREADS": "1",
    "OMP_WAIT_POLICY": "PASSIVE",
    "KMP_BLOCKTIME": "0",
}

#: The flags both roles share (docs/vllm-serve.md).
COMMON_FLAGS = [
    "--host", "127.0.0.1", "--served-model-name", "tiny", "--dtype", "float32", "--enforce-eager",
    "--block-size", "32",
]  # fmt: skip
#: The model's context, and the decoders' (their fillers decode for as long as a scenario holds
#: them: 8,192 tokens ran out after 87-126 s once the bench's decoders had both cores, before a
#: scenario released them; the rotary table is sized to it, nothing of the KV layout changes,
#: NIXL's compatibility hash does not cover it, and two fillers take 64 MiB of KV).
MAX_MODEL_LEN, D_MAX_MODEL_LEN = 1024, 32768

STOCK, KVLEASE = "stock", "kvlease"
PRODUCER, CONSUMER = "kv_producer", "kv_consumer"


def missing_environment() -> str | None:
    """Why the real-serving pieces cannot run here, or None."""
    if not VENV_PY.exists():
        return f"{VENV_PY} is missing: run `bash engines/vllm/setup.sh` (bash dev.sh test does)"
    if not (MODEL / "model.safetensors").exists():
        return f"the tiny model is missing at {MODEL}: run `bash engines/vllm/setup.sh`"
    if not list((VENV_PY.parent.parent / "lib").glob("python3*/site-packages/vllm/_C.abi3.so")):
        return "vLLM's CPU kernels (vllm/_C.abi3.so) are missing from .venv-vllm: run engines/vllm/setup.sh"
    return None


def kv_transfer_config(
    connector: str,
    role: str,
    lease: float,
    *,
    policy: str = "recompute",
    extra: dict[str, Any] | None = None,
    name: str = "NixlConnector",
) -> str:
    """``--kv-transfer-config`` for one server: stock vLLM's NIXL connector or kvlease's, under the
    same name (``NixlConnector``, so every name-keyed NIXL check of vLLM applies to both; or
    ``NixlPushConnector``, push mode)."""
    cfg: dict[str, Any] = {
        "kv_connector": name,
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"kv_lease_duration": lease, **(extra or {})},
    }
    if connector == KVLEASE:
        cfg["kv_connector_module_path"] = "kvlease.adapters.vllm"
    return json.dumps(cfg)


def get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (OSError, TimeoutError) as e:
        return 0, repr(e)


def parse_metrics(text: str) -> dict[str, float]:
    """Each sample's value by sample name, summed over labels (one engine per server here)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


class Unresponsive(RuntimeError):
    """A server that did not answer /metrics while it lived (`Server.metrics`)."""


#: How long `Server.metrics` keeps asking a live server.
METRICS_PATIENCE = 180.0


@attrs.define(eq=False)
class Server:
    """One ``vllm serve`` process (with its engine-core child) in a process group of its own."""

    name: str
    connector: str
    role: str
    port: int
    log_path: Path
    proc: subprocess.Popen[bytes]
    lease: float
    #: `start_server`'s arguments, for `respawn`.
    spec: dict[str, Any] = attrs.field(factory=dict)
    #: How many times `wait_healthy` restarted it on new ports.
    respawns: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def port_taken(self) -> bool:
        """Whether its log says a port it binds was taken. vLLM's NIXL side-channel listener binds
        in a thread, and a failed bind leaves the server waiting for that thread for good: alive,
        never healthy (the CI of 2026-12-05 waited 900 s on such a decoder)."""
        return "address already in use" in self.log().lower()

    def respawn(self) -> None:
        """Kill it and start it again on new ports (its old log kept beside the new one)."""
        self.kill()
        self.respawns += 1
        with contextlib.suppress(OSError):
            self.log_path.rename(self.log_path.with_suffix(f".log.{self.respawns}"))
        again = start_server(**self.spec)
        self.port, self.log_path, self.proc = again.port, again.log_path, again.proc

    def alive(self) -> bool:
        return self.proc.poll() is None

    def healthy(self) -> bool:
        return self.alive() and get(self.url + "/health", timeout=2)[0] == 200

    def metrics(self, patience: float = METRICS_PATIENCE) -> dict[str, float]:
        """The server's /metrics now. A loaded machine may take seconds to answer, so it is asked
        again while its process lives, for `patience` seconds in all (CI of 2026-12-07: a stock
        producer left three 20 s tries unanswered right after a completion it had served); what
        fails says what its processes were doing and what it logged last."""
        deadline = time.monotonic() + patience
        while True:
            status, text = get(self.url + "/metrics", timeout=30)
            if status == 200:
                return parse_metrics(text)
            if not self.alive() or time.monotonic() >= deadline:
                raise Unresponsive(
                    f"{self.name}: /metrics answered {status}: {text[:200]} ({patience:.0f} s asked)\n"
                    f"its processes:\n{self.processes()}\n--- its log ---\n{tail(self.log(), 30)}"
                )
            time.sleep(1)

    def processes(self) -> str:
        """One line per process of its group: state, CPU seconds so far, resident memory, name
        (from /proc: what a hung or starved server was doing)."""
        tick = os.sysconf("SC_CLK_TCK")
        page = os.sysconf("SC_PAGE_SIZE")
        lines = []
        for pid, name, fields in proc_stats():
            if int(fields[2]) != self.proc.pid:
                continue
            cpu = (int(fields[11]) + int(fields[12])) / tick
            rss = int(fields[21]) * page / 2**20
            lines.append(f"  {pid} {fields[0]} cpu {cpu:.1f} s rss {rss:.0f} MiB {name}")
        return "\n".join(sorted(lines)) or "  (none left)"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: signal.Signals) -> None:
        """Signal every process of the server (API server, engine core, their threads)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def freeze(self) -> None:
        self.signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.signal(signal.SIGCONT)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        stop_all([self])


def stop_all(servers: list[Server], grace: float = 30.0) -> None:
    """SIGTERM every server at once, give them `grace` seconds together, then SIGKILL what is
    left (one at a time, each vLLM server took up to 30 s to shut down: a fleet's teardown was
    most of two minutes)."""
    for server in servers:
        if server.alive():
            server.thaw()
            server.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for server in servers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        server.kill()


def bench_shims() -> dict[str, str]:
    """The bench's `sitecustomize` (engines/vllm/shims: vLLM's one-core KV reservation skipped on
    this small host) first on the servers' PYTHONPATH."""
    shims = str(ROOT / "engines" / "vllm" / "shims")
    rest = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": shims + (os.pathsep + rest if rest else "")}


def start_server(
    name: str,
    connector: str,
    role: str,
    workdir: Path,
    *,
    lease: float = 6.0,
    blocks: int | None = None,
    max_num_seqs: int = 4,
    max_model_len: int = MAX_MODEL_LEN,
    extra: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    connector_name: str = "NixlConnector",
    cpus: str | None = None,
) -> Server:
    """Start one server (returns at once: `wait_healthy` waits for it); `cpus`: the cores it and
    its engine processes may run on (``taskset -c``), every core when None."""
    port, side = free_port(), free_port()
    flags = [*COMMON_FLAGS, "--port", str(port), "--max-num-seqs", str(max_num_seqs)]
    flags += ["--max-model-len", str(max_model_len)]
    if max_model_len > MAX_MODEL_LEN:
        flags += ["--hf-overrides", json.dumps({"max_position_embeddings": max_model_len})]
    if blocks is not None:
        flags += ["--num-gpu-blocks-override", str(blocks)]
    flags += ["--kv-transfer-config", kv_transfer_config(connector, role, lease, extra=extra, name=connector_name)]
    log_path = workdir / f"{name}.log"
    run_in = workdir / "cwd"
    run_in.mkdir(parents=True, exist_ok=True)
    pin = [] if cpus is None else ["taskset", "-c", cpus]
    proc = subprocess.Popen(
        [*pin, str(VENV_PY), "-m", "vllm.entrypoints.cli.main", "serve", str(MODEL), *flags],
        cwd=run_in,
        env={**os.environ, **SERVER_ENV, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side), **bench_shims(), **(env or {})},
        stdout=log_path.open("wb"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    spec = {
        "name": name, "connector": connector, "role": role, "workdir": workdir, "lease": lease,
        "blocks": blocks, "max_num_seqs": max_num_seqs, "max_model_len": max_model_len,
        "extra": extra, "env": env, "connector_name": connector_name, "cpus": cpus,
    }  # fmt: skip
    return Server(name, connector, role, port, log_path, proc, lease, spec)


#: How many times `wait_healthy` restarts a server whose port was taken.
RESPAWNS = 2


def wait_healthy(servers: list[Server], timeout: float = 900.0) -> float:
    """Wait until every server answers /health; seconds waited. A server whose port was taken
    while it started is restarted on new ports (said on stderr; `RESPAWNS` times at most, each
    with the whole `timeout`); one that dies otherwise fails at once, with its log's tail, and so
    does one not healthy in time."""
    start = time.monotonic()
    pending = list(servers)
    while pending:
        for s in list(pending):
            if s.healthy():
                pending.remove(s)
            elif s.port_taken() and s.respawns < RESPAWNS:
                print(f"{s.name}: a port it binds was taken while it started; restarted on new ports", file=sys.stderr)
                s.respawn()
                start = time.monotonic()
            elif not s.alive():
                raise RuntimeError(f"{s.name} exited with {s.proc.returncode} while starting:\n{tail(s.log())}")
        if time.monotonic() - start > timeout:
            tails = "\n".join(f"--- {s.name} ({s.log_path}):\n{tail(s.log())}" for s in pending)
            raise RuntimeError(f"not healthy after {timeout:.0f} s: {[s.name for s in pending]}\n{tails}")
        if pending:
            time.sleep(2)
    return time.monotonic() - start


@attrs.define(eq=False)
class Router:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_router(prefills: list[Server], decodes: list[Server], workdir: Path, timeout: float = 180.0) -> Router:
    """Start the router in front of the servers and wait until it listens. One whose port was
    taken meanwhile, or that exited, is started again on a new port (`RESPAWNS` times at most);
    one not listening in `timeout` (a loaded machine: CI once saw 60 s run out) fails with its
    log."""
    for attempt in range(RESPAWNS + 1):
        port = free_port()
        args = [str(VENV_PY), str(ROUTER), "--port", str(port)]
        args += [a for s in prefills for a in ("--prefill", f"{s.name}={s.url}")]
        args += [a for s in decodes for a in ("--decode", f"{s.name}={s.url}")]
        log_path = workdir / f"router.{attempt}.log"
        proc = subprocess.Popen(args, cwd=workdir, stdout=log_path.open("wb"), stderr=subprocess.STDOUT)
        router = Router(proc, port, log_path)
        start = time.monotonic()
        while get(f"http://127.0.0.1:{port}/health")[0] == 0:
            if proc.poll() is not None or "address already in use" in router.log().lower():
                router.stop()
                why = tail(router.log())
                print(f"the router on port {port} exited or found its port taken:\n{why}", file=sys.stderr)
                break
            if time.monotonic() - start > timeout:
                router.stop()
                why = tail(router.log())
                raise TimeoutError(f"the router did not listen on port {port} within {timeout:.0f} s:\n{why}")
            time.sleep(0.2)
        else:
            return router
    raise RuntimeError(f"the router failed to start {RESPAWNS + 1} times (logs in {workdir})")


class Client(serving.Client):
    """`openai_serving.Client` in vLLM's environment unless told otherwise."""

    def __init__(self, python: Path = VENV_PY) -> None:
        super().__init__(python)


def reference_texts(
    prompts: list[str], max_tokens: int, *, python: Path = VENV_PY, model: Path = MODEL
) -> dict[str, Reference]:
    """`openai_serving.reference_texts` with vLLM's environment and tiny model by default."""
    return serving.reference_texts(prompts, max_tokens, python=python, model=model)


@attrs.frozen
class Conversation:
    """A two-turn conversation's references: turn 1 (`TURN1_TOKENS` of answer), and turn 2's
    prompt as a client sends it (turn 1's prompt and answer, then new words: `TURN2_MORE`
    tokens of turn 1's prompt again) with its reference."""

    turn1: Reference
    turn2_ids: list[int]
    turn2: Reference


def conversations(prompts: list[str], max_tokens: int) -> dict[str, Conversation]:
    """Each prompt's `Conversation`, computed by ``transformers`` alone."""
    items = [{"prompt": p, "answer_tokens": TURN1_TOKENS, "more_tokens": TURN2_MORE} for p in prompts]
    found = serving.run_reference(items, max_tokens, python=VENV_PY, model=MODEL)
    return {
        p: Conversation(
            Reference(r["turns"][0]["text"], r["turns"][0]["ids"]),
            [int(i) for i in r["turn2_ids"]],
            Reference(r["turns"][1]["text"], r["turns"][1]["ids"]),
        )
        for p, r in zip(prompts, found, strict=True)
    }


@contextlib.contextmanager
def frozen(*servers: Server) -> Iterator[None]:
    """Every process of each server stopped (SIGSTOP) for the block: a decode engine that stalls
    (a long GC pause, a host under memory pressure, a debugger), then resumes as if nothing happened."""
    for s in servers:
        s.freeze()
    try:
        yield
    finally:
        for s in servers:
            s.thaw()


# -- the fleet the suite, the benchmark and the demo run -------------------------------------

P_BLOCKS = 48  # P's KV cache (blocks of 32 tokens): small, so other requests reuse a freed block
#: D's KV cache (blocks of 32 tokens, 128 MiB here): two fillers at their most (64 Ki tokens) and as
#: much again for the scenarios. Not left to ``VLLM_CPU_KVCACHE_SPACE`` (1 GiB: 32,768 blocks):
#: a decoder spent 28-41 s of its start-up, on a loaded 2-core machine, setting up a cache that
#: size (P, at 48 blocks, under a second).
D_BLOCKS = 4096
D_SEQS = 2  # D's sequence slots: two fillers keep a request waiting in D's queue
FILLER_TOKENS = D_MAX_MODEL_LEN - 64  # a filler's most: it is held, then cancelled, long before
MAX_TOKENS = 16
#: Turn 1 of the multi-turn scenario: long enough that the turn-2 producer's READ of it clears
#: vLLM's ``kv_recompute_threshold`` (64 tokens: fewer are recomputed, not read).
TURN1 = "def turn_one(values):\n" + "".join(f"    values.append({i} * {i})\n" for i in range(12)) + "    return"
PROMPTS = {
    "happy": "def happy_path(x):\n    return",
    "mixed": "class MixedFleet:\n    def __init__(self):",
    "overload": "def overloaded_decoder(queue):\n    for item in",
    "stale": "def lease_victim(x): return x * 2",
    "killed": "import os\nclass DeadDecoder:",
    "push": "def pushed_by_the_producer(x):\n    return",
    "turn1": TURN1,
}
ROUTES = ("p_stock->d_stock", "p_kv->d_kv", "p_kv->d_stock", "p_stock->d_kv")
PAIRS = (("p_stock", "d_stock"), ("p_kv", "d_kv"))
#: The transfer modes a fleet runs: pull (vLLM's default: D READs P's blocks), push (P WRITEs
#: into blocks D registered: ``NixlPushConnector``), and bidirectional (multi-turn: turn 1's
#: decoder keeps its blocks for the next turn's producer to READ back). Each: the connector's
#: name, its extra config, and its scenario prompts (the modes' fleets run the two straight pairs
#: only: vLLM's push and bidirectional paths are stated for like-configured pairs).
MODES: dict[str, tuple[str, dict[str, Any]]] = {
    "pull": ("NixlConnector", {}),
    "push": ("NixlPushConnector", {}),
    "bidirectional": ("NixlConnector", {"bidirectional_kv_xfer": True}),
}
MODE_PROMPTS = {"push": ("push",), "bidirectional": ("turn1",)}
#: Turn 1's answer, tokens: more than vLLM's ``kv_recompute_threshold`` (64) past what the
#: producer still holds of turn 1 (its prompt, which it prefilled), so turn 2's producer reads it;
#: and the new tokens turn 2 adds.
TURN1_TOKENS, TURN2_MORE = 96, 20


def prompt(kind: str, route: str) -> str:
    """A prompt unique to a scenario and a route (so no prefix cache shares its blocks)."""
    return f"# {route}\n{PROMPTS[kind]}"


class Fleet:
    """A stock pair (``p_stock``, ``d_stock``: vLLM's own NixlConnector) and a kvlease pair
    (``p_kv``, ``d_kv``), one router that pairs any P with any D (mixed fleets included), one
    client, and every scenario prompt's reference completion."""

    def __init__(self, workdir: Path, lease: float, *, unprotected: bool = False, mode: str = "pull") -> None:
        if mode not in MODES:
            raise ValueError(f"mode: one of {', '.join(MODES)}, not {mode!r}")
        self.workdir = workdir
        self.lease = lease
        self.mode = mode
        #: The routes this fleet serves: any P with any D in pull mode (mixed fleets), the two
        #: straight pairs otherwise.
        self.routes = ROUTES if mode == "pull" else tuple(f"{p}->{d}" for p, d in PAIRS)
        #: kvlease's decoder READs without consulting its leases (the bench shim's switch): the
        #: demonstration that its stale-read check is what keeps the wrong KV out.
        self.unprotected = unprotected
        self.servers: dict[str, Server] = {}
        self.router: Router | None = None
        self.client: Client | None = None
        self.reference: dict[str, Reference] = {}
        self.conversations: dict[str, Conversation] = {}  # bidirectional mode's
        self.decode_rate = 0.0  # tokens per second of one request on D, measured at start
        self.startup_s = 0.0
        self.warmup: dict[str, int] = {}  # route -> HTTP status of its first-contact completion

    def start(self) -> None:
        name, extra = MODES[self.mode]
        pull = self.mode == "pull"
        for connector, suffix in ((STOCK, "stock"), (KVLEASE, "kv")):
            self.servers[f"p_{suffix}"] = start_server(
                f"p_{suffix}",
                connector,
                PRODUCER,
                self.workdir,
                lease=self.lease,
                blocks=P_BLOCKS,
                extra=extra,
                connector_name=name,
            )
            self.servers[f"d_{suffix}"] = start_server(
                f"d_{suffix}",
                connector,
                CONSUMER,
                self.workdir,
                lease=self.lease,
                blocks=D_BLOCKS,
                max_num_seqs=D_SEQS,
                max_model_len=D_MAX_MODEL_LEN if pull else MAX_MODEL_LEN,  # fillers: pull's scenarios only
                env={"KVLEASE_BENCH_UNPROTECTED_READS": "1"} if self.unprotected and connector == KVLEASE else None,
                extra=extra,
                connector_name=name,
            )
        started = time.monotonic()
        modes = {kind for kinds in MODE_PROMPTS.values() for kind in kinds}
        kinds = [k for k in PROMPTS if k not in modes] if pull else list(MODE_PROMPTS[self.mode])
        prompts = [prompt(kind, route) for kind in kinds for route in self.routes]
        # While the servers start:
        if self.mode == "bidirectional":
            self.conversations = conversations(prompts, MAX_TOKENS)
        else:
            self.reference = reference_texts(prompts, MAX_TOKENS)
        wait_healthy(list(self.servers.values()))
        self.startup_s = time.monotonic() - started
        s = self.servers
        self.router = start_router([s["p_stock"], s["p_kv"]], [s["d_stock"], s["d_kv"]], self.workdir)
        self.client = Client()
        # First contact: one completion per route, so vLLM's own NIXL handshakes (its side
        # channel, each producer's agent loaded) are done before the scenarios. On a loaded
        # machine a first handshake took 16 s, longer than the lease: kvlease then refuses that
        # first READ (a failed load, recomputed), where stock vLLM's lazy expiry happens to let
        # it through. What each warm-up did is kept in `warmup`.
        warm = {}
        for route in self.routes:
            p, d = route.split("->")
            warm[route] = self.complete(p, d, f"warm up {route}")
        self.warmup = self._warmed(warm)
        # The machine's decode speed now (printed: what the scenarios' timings are relative to).
        t0 = time.monotonic()
        self.client.complete(f"{s['d_stock'].url}/v1", "warm up", 32, extra_body={"ignore_eos": True})
        self.decode_rate = 32 / (time.monotonic() - t0)

    def _warmed(self, warm: dict[str, Future[dict[str, Any]]]) -> dict[str, int]:
        """Each route's first-contact status. Stock vLLM's push producer can let that first request's
        lease run out before it writes (its handshake took longer than the lease), and its decoder
        then waits for good (CI, 2026-12-06: the fleet's start-up waited 900 s on it; here, on
        2026-12-07, too): a stock producer's route gets two leases and 80 s (one short request;
        the slowest first contact seen took 16 s) and counts as 0 (hung, said with the logs), the
        fleet going on; a kvlease producer's route that does not answer in 600 s fails the
        start-up."""
        start = time.monotonic()
        out: dict[str, int] = {}
        for route, future in warm.items():
            p, d = route.split("->")
            stock = self.servers[p].connector == STOCK
            bound = 2 * self.lease + 80 if stock else 600.0
            try:
                out[route] = future.result(timeout=max(1.0, start + bound - time.monotonic()))["status"]
            except TimeoutError as exc:
                why = f"the warm-up through {route} did not answer in {bound:.0f} s"
                if not stock:
                    raise TimeoutError(f"{why}\n{self.logs(p, d)}") from exc
                print(f"\nstock {route}: {why} (stock vLLM's own hang, not kvlease's)\n{self.logs(p, d)}")
                out[route] = 0
        return out

    @property
    def stock_hang_s(self) -> float:
        """How long a stock producer's request may take before it counts as hung, s: six leases and
        two minutes (a request on this loaded machine takes well under that)."""
        return 6 * self.lease + 120

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.router is not None:
            self.router.stop()
        stop_all(list(self.servers.values()))

    def complete(
        self,
        p: str,
        d: str,
        text: str | list[int],
        *,
        kv_transfer_params: dict[str, Any] | None = None,
        max_tokens: int = MAX_TOKENS,
    ) -> Future[dict[str, Any]]:
        """A completion through the router, from P `p` to D `d`, with its token ids (the prompt's
        too). `kv_transfer_params`: what the previous turn's answer carried (multi-turn), for the
        router to hand P."""
        assert self.client is not None and self.router is not None
        headers = {"x-kvlease-prefill": p, "x-kvlease-decode": d}
        body: dict[str, Any] = {"return_token_ids": True}
        if kv_transfer_params is not None:
            body["kv_transfer_params"] = kv_transfer_params
        return self.client.submit(self.router.base_url, text, max_tokens, headers=headers, extra_body=body)

    def fill(self, *decoders: str) -> list[Held]:
        """Occupy every sequence slot of each decoder with a held request (direct, streamed,
        decoding until `release`), and wait until they all run: what any request sent to those
        decoders next does is wait in their queues, for as long as the scenario needs."""
        assert self.client is not None
        fillers = [
            self.client.hold(f"{self.servers[d].url}/v1", f"filler {i} {time.monotonic()}", FILLER_TOKENS)
            for d in decoders
            for i in range(D_SEQS)
        ]
        try:
            wait_until(
                lambda: all(self.metric(d, "vllm:num_requests_running") >= D_SEQS for d in decoders),
                300,
                f"every sequence slot of {', '.join(decoders)} to be taken by a filler",
            )
        except TimeoutError:
            self.release(fillers)
            raise
        return fillers

    def release(self, fillers: list[Held]) -> None:
        """End held fillers (the decoder aborts them) and wait for their answers. A filler that
        ended by itself before (its decoder killed, or all its tokens decoded) is reported."""
        assert self.client is not None
        for filler in fillers:
            self.client.cancel(filler)
        for filler in fillers:
            answer = filler.future.result(timeout=300)
            if answer["status"] == 200 and not answer.get("cancelled"):
                print(f"a filler ended before its release: {answer['elapsed']:.0f} s, {len(answer['text'])} chars")

    def metric(self, server: str, name: str) -> float:
        return self.servers[server].metrics().get(name, 0.0)

    def waiting(self, d: str) -> bool:
        return self.metric(d, "vllm:num_requests_waiting") >= 1

    def logs(self, *names: str) -> str:
        return "\n".join(f"--- {n} ---\n{tail(self.servers[n].log(), 15)}" for n in names)

    def stacks(self, *names: str, settle: float = 3.0, lines: int = 400) -> str:
        """Every thread's Python stack in each process of the named servers, now: SIGUSR2 (the
        bench shim's handler writes them to the server's log from the signal handler, so a
        process stalled behind its interpreter lock answers too), then what each log gained in
        `settle` seconds, its last `lines` lines."""
        sizes = {n: len(self.servers[n].log()) for n in names}
        for n in names:
            self.servers[n].signal(signal.SIGUSR2)
        time.sleep(settle)
        return "\n".join(
            f"--- {n}: stacks on SIGUSR2 ---\n{tail(self.servers[n].log()[sizes[n] :], lines)}" for n in names
        )


@attrs.frozen
class Outcome:
    """What one pair served for a scenario's victim."""

    route: str
    answer: dict[str, Any]
    reference: Reference

    @property
    def right(self) -> bool:
        return self.answer["status"] == 200 and self.reference.matches(self.answer)

    @property
    def wrong(self) -> bool:
        """HTTP 200 with a completion that is not the prompt's: another request's KV was used."""
        return self.answer["status"] == 200 and not self.reference.matches(self.answer)


def wait_for_victims(f: Fleet) -> None:
    """Until each decoder has a request waiting in its queue (behind the fillers, so it stays
    there until they are released). A decoder's gauges are as old as its last engine step, and
    a loaded 2-core machine stalled a decoder's engine for 20 s: each is waited for on its own."""
    for _, d in PAIRS:
        wait_until(functools.partial(f.waiting, d), 300, f"the victim in {d}'s queue")


def stale_read(f: Fleet) -> dict[str, Any]:
    """The production failure, on both pairs at once: D's request waits in its queue, every D
    process stalls past the lease, P frees the blocks and ten other requests reuse them, D
    resumes and READs. Returns each pair's `Outcome`, and what kvlease's decoder counted."""
    assert f.client is not None
    client = f.client
    fillers = f.fill(*(d for _, d in PAIRS))
    try:
        # Counted before the victims exist: a lease that ends while its request waits (before the
        # freeze) is seen ending too.
        seen0 = f.metric("d_kv", "vllm:kvlease_leases_lost_total") + f.metric(
            "d_kv", "vllm:kvlease_stale_reads_caught_total"
        )
        victims = {p: (prompt("stale", f"{p}->{d}"), f.complete(p, d, prompt("stale", f"{p}->{d}"))) for p, d in PAIRS}
        wait_for_victims(f)
        with frozen(f.servers["d_kv"], f.servers["d_stock"]):
            time.sleep(f.lease + 3)
            # One request through each P first: its engine steps, and stock vLLM's reaper (which
            # runs only in a step) frees the expired victim's blocks; then other requests whose
            # prompts take every block of P's small cache, the victim's freed ones included.
            for p, _ in PAIRS:
                client.complete(f"{f.servers[p].url}/v1", "step", 1)
            time.sleep(1.0)
            others = [
                client.submit(f"{f.servers[p].url}/v1", f"other {i} " + "tokens " * 300, 1)
                for p, _ in PAIRS
                for i in range(10)
            ]
            for other in others:
                other.result(timeout=600)
    finally:
        f.release(fillers)  # the victims are next in the decoders' queues
    out: dict[str, Any] = {}
    for p, d in PAIRS:
        text, future = victims[p]
        out[p] = Outcome(f"{p}->{d}", future.result(timeout=900), f.reference[text])

    def seen() -> float:
        return f.metric("d_kv", "vllm:kvlease_leases_lost_total") + f.metric(
            "d_kv", "vllm:kvlease_stale_reads_caught_total"
        )

    # vLLM publishes a connector's counters with its next stats: give them some seconds.
    try:
        wait_until(lambda: seen() > seen0, 30, "kvlease's decoder to count the lease's end", every=1.0)
        out["kvlease_saw_lease_end"] = True
    except TimeoutError:
        out["kvlease_saw_lease_end"] = False
    return out


#: `decoder_killed`'s figure for a producer that no longer held the victim's blocks when the
#: decoder was killed (its lease had already ended).
FREED_BEFORE_THE_KILL = -1.0


@attrs.frozen
class EarlyEnd:
    """A try of `decoder_killed` on kvlease's pair that did not count: the victim's lease ended
    before the kill, with the decoder live. `sent`: heartbeats the decoder sent in the `waited`
    seconds between its request entering its queue and the check; `due`: how many it owed in
    that time (one per ``kv_lease_duration / 6``)."""

    waited: float
    sent: float
    due: float
    expired: float  # P's kvlease_leases_expired_total, during the try
    lost: float  # D's kvlease_leases_lost_total, during the try

    @property
    def starved(self) -> bool:
        """The decoder sent at least two heartbeats fewer than it owed: a process that got no CPU
        for that long (the lease then ends, rightly). Otherwise the end is unexplained."""
        return self.sent < self.due - 1

    def __str__(self) -> str:
        return (
            f"the lease ended before the kill ({self.expired:.0f} expired on P, {self.lost:.0f} lost on D):"
            f" D sent {self.sent:.0f} heartbeats in {self.waited:.1f} s, {self.due:.1f} due"
        )


@attrs.frozen
class Killed:
    """`decoder_killed`'s outcome for one producer: `freed`, seconds from the kill until P's KV
    usage was back where it was (None: not within three leases and ten seconds;
    `FREED_BEFORE_THE_KILL`: P had freed the victim's blocks before the kill); `early`, the
    kvlease tries that did not count (the lease ended before the kill), each retried."""

    freed: float | None
    early: tuple[EarlyEnd, ...] = ()


_KV_COUNTERS = (
    ("p_kv", "vllm:kvlease_leases_expired_total"),
    ("d_kv", "vllm:kvlease_leases_lost_total"),
    ("d_kv", "vllm:kvlease_heartbeats_sent_total"),
)


def decoder_killed(f: Fleet, tries: int = 3) -> dict[str, Killed]:
    """Each decoder SIGKILLed while its request waits in its queue, one pair after the other:
    when P's KV usage is back where it was. Both decoders decoding their fillers at once starved
    a 2-core CI runner's kvlease decoder of the CPU its heartbeats needed (one sent in 13 s, the
    lease rightly ended before the kill); one at a time, and a kvlease try whose lease ended
    before the kill is retried (up to `tries`) and reported in `Killed.early`. Leaves the fleet
    without decoders."""
    out: dict[str, Killed] = {}
    for p, d in sorted(PAIRS, key=lambda pair: pair[0] != "p_kv"):
        early: list[EarlyEnd] = []
        freed: float | None = FREED_BEFORE_THE_KILL
        for attempt in range(tries):
            result = _kill_one(f, p, d, attempt)
            if isinstance(result, EarlyEnd):
                print(f"decoder_killed, {p}: try {attempt + 1} did not count: {result}", flush=True)
                early.append(result)
                continue
            freed = result
            break
        out[p] = Killed(freed, tuple(early))
    return out


def _kill_one(f: Fleet, p: str, d: str, attempt: int) -> float | EarlyEnd | None:
    """One try of `decoder_killed` on the pair (`p`, `d`): D's slots filled, the victim sent
    through P to wait in D's queue, D killed, P's usage watched. kvlease's pair: an `EarlyEnd`,
    D left alive, when the victim's lease had already ended. The freed time of kvlease's pair
    also needs P's expiry counted (so a gauge that never showed the blocks cannot pass as 0 s)."""
    kvlease = p == "p_kv"

    def counters() -> list[float]:
        return [f.metric(server, name) for server, name in _KV_COUNTERS] if kvlease else []

    fillers = f.fill(d)
    victim: Future[dict[str, Any]] | None = None
    killed = False
    try:
        usage0 = f.metric(p, "vllm:kv_cache_usage_perc")
        before = counters()
        victim = f.complete(p, d, prompt("killed", f"{p}->{d} try {attempt + 1}"))
        wait_until(functools.partial(f.waiting, d), 300, f"the victim in {d}'s queue")
        queued_at = time.monotonic()
        # P's gauge is as old as its last step: a few seconds for it to show the victim's blocks.
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: f.metric(p, "vllm:kv_cache_usage_perc") > usage0, 15, "P's blocks")
        if kvlease:
            expired, lost, sent = (now - then for now, then in zip(counters(), before, strict=True))
            if expired or lost:
                waited = time.monotonic() - queued_at
                return EarlyEnd(waited, sent, waited / (f.lease / 6.0), expired, lost)
        held = f.metric(p, "vllm:kv_cache_usage_perc") > usage0
        killed_at = time.monotonic()
        f.servers[d].kill()
        killed = True
        if not held and not kvlease:  # kvlease's: the expiry counted below tells when it freed
            return FREED_BEFORE_THE_KILL
        deadline = killed_at + 3 * f.lease + 10
        while time.monotonic() < deadline:
            back = f.metric(p, "vllm:kv_cache_usage_perc") <= usage0
            if back and (not kvlease or f.metric(*_KV_COUNTERS[0]) > before[0]):  # D is gone: P's count only
                return time.monotonic() - killed_at
            time.sleep(0.25)
        return None
    finally:
        if killed:
            for future in [*([victim] if victim else []), *(filler.future for filler in fillers)]:
                future.result(timeout=120)  # the dead decoder's requests end (an error), never hang
        else:
            f.release(fillers)  # D's slots free: the victim is served (recomputed: its lease ended)
            if victim is not None:
                victim.result(timeout=600)


def demo(lease: float, *, switch_off_protection: bool = False) -> int:
    """Both pairs, the stale read and the decoder crash, the texts side by side. With
    `switch_off_protection`, kvlease's decoder READs without consulting its leases (the bench
    shim): its pair then serves what stock does, and the demo exits 1."""
    problem = missing_environment()
    if problem is not None:
        print(f"vllm-demo: {problem}")
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="kvlease-vllm-demo-"))
    f = Fleet(workdir, lease, unprotected=switch_off_protection)
    print(f"starting a stock vLLM pair and a kvlease pair (4 x vllm serve, lease {lease:g} s) ...", flush=True)
    if switch_off_protection:
        print("kvlease's stale-read protection is SWITCHED OFF: its decoder reads without asking its lease", flush=True)
    try:
        f.start()
        print(f"healthy after {f.startup_s:.0f} s; logs in {workdir}\n", flush=True)
        print(f"1. the stale read: each decoder's request waits in its queue, every decoder process stops "
              f"for {lease + 3:g} s, ten other requests reuse the producer's blocks, the decoder resumes")  # fmt: skip
        result = stale_read(f)
        for p, name in (("p_stock", "stock vLLM"), ("p_kv", "kvlease")):
            o: Outcome = result[p]
            verdict = "RIGHT" if o.right else ("WRONG (another request's KV)" if o.wrong else "error")
            print(f"   {name:10s} HTTP {o.answer['status']}  {verdict}")
            print(f"              served:    {o.answer['text']!r}")
            print(f"              reference: {o.reference.text!r}")
        print(f"   kvlease's decoder saw the lease end: {result['kvlease_saw_lease_end']}\n", flush=True)
        print("2. the decoder crash: each decoder SIGKILLed while its request waits", flush=True)
        freed = decoder_killed(f)
        for p, name in (("p_stock", "stock vLLM"), ("p_kv", "kvlease")):
            t = freed[p].freed
            back = "not within the wait" if t is None else f"{t:.1f} s"
            if t == FREED_BEFORE_THE_KILL:
                back = "already before the kill (the lease had ended)"
            print(f"   {name:10s} P's blocks back after {back}")
        ok = result["p_kv"].right or result["p_kv"].answer["status"] >= 400
        return 0 if ok else 1
    finally:
        f.stop()


if __name__ == "__main__":
    import argparse
    import sys

    ap = argparse.ArgumentParser(description="kvlease against stock vLLM in real vllm serve pairs")
    ap.add_argument("command", choices=["demo"])
    ap.add_argument("--lease", type=float, default=8.0, help="kv_lease_duration of every server, seconds")
    ap.add_argument(
        "--switch-off-protection",
        action="store_true",
        help="kvlease's decoder reads without consulting its leases (engines/vllm/shims): "
        "shows the stale read it prevents",
    )
    args = ap.parse_args()
    sys.exit(demo(args.lease, switch_off_protection=args.switch_off_protection))
