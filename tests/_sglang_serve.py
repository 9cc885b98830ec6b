"""Real SGLang 0.5.23 prefill/decode pairs for the tests: two ``sglang.launch_server`` processes
(real CPU forwards of a tiny random-weight Llama, KV over NIXL on loopback in host memory) and
SGLang's router in front, as ``../shared/engines/SGLANG-SERVE-ON-CPU.md`` runs them, with the
project's shims (``engines/sglang/shims``: the host-memory plugin, the ``sgl_kernel`` stand-in;
the torchvision stand-in is in ``.venv-sglang``). A pair runs stock SGLang (the host-memory
plugin alone) or SGLang with kvlease's plugin beside it; the two differ in ``SGLANG_PLUGINS``
only. Used by tests/test_sglang_pair.py and tests/test_sglang_chaos.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _sglang_helpers import ROOT, SGLANG_PY, need_sglang
from ports import free_port

SHIMS = ROOT / "engines" / "sglang" / "shims"
MODEL = ROOT / "build" / "sglang-tiny-llama"
STRAGGLER = ROOT / "tests" / "sglang_straggler"  # a test-only plugin: the prefill's WRITEs held
#: ``SGLANG_PLUGINS`` of each kind of pair: kvlease's plugin composes with the host-memory one.
PLUGINS = {"kvlease": "kvlease,cpu_dram_kv", "stock": "cpu_dram_kv"}


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Server:
    """One process (a launch_server or the router) in a process group of its own."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self.log_path = log
        self._log = open(log, "wb")  # noqa: SIM115 - closed in kill()
        self.proc = subprocess.Popen(
            [str(SGLANG_PY), "-m", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(ROOT),
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        self._log.close()


def http(method: str, url: str, body: dict[str, Any] | None = None, timeout: float = 60.0) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as exc:
        return 0, str(exc)


def wait_until(what: str, pred: Callable[[], bool], within: float, servers: list[Server]) -> None:
    deadline = time.time() + within
    while not pred():
        for s in servers:
            if s.proc.poll() is not None:
                raise AssertionError(f"{s.name} exited ({s.proc.returncode}) waiting for {what}:\n{s.log()[-6000:]}")
        assert time.time() < deadline, f"{what}: not within {within:.0f}s\n" + "\n".join(
            f"== {s.name}\n{s.log()[-3000:]}" for s in servers
        )
        time.sleep(0.5)


def metric(text: str, name: str) -> float:
    """The sum of a metric's samples in a Prometheus exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def need_pair_env() -> None:
    """Skip (fail under CI) without the serving dependencies; make the tiny model once."""
    need_sglang()
    probe = subprocess.run([str(SGLANG_PY), "-c", "import sglang_router, jsonschema, soundfile"], capture_output=True)
    if probe.returncode != 0:
        msg = "no launch_server/router dependencies in .venv-sglang: run `bash engines/sglang/setup.sh`"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    subprocess.run([str(SGLANG_PY), str(ROOT / "tests" / "_sglang_pair_model.py"), str(MODEL)], check=True)


class Pair:
    """P and D (``kind``: ``"kvlease"`` or ``"stock"``), started by `start`, then SGLang's router
    in front by `route`. `env` is added to both servers' environment, `router_flags` to the
    router's command line."""

    def __init__(
        self,
        tmp: Path,
        kind: str = "kvlease",
        env: dict[str, str] | None = None,
        router_flags: tuple[str, ...] = (),
        straggle: Path | None = None,
    ) -> None:
        """`straggle`: a folder for the test-only straggler plugin (tests/sglang_straggler): the
        prefill's WRITEs are held while a file ``arm`` there holds a number of seconds."""
        self.kind = kind
        self.router_flags = list(router_flags)
        self.tmp = tmp
        self.ports = [free_port() for _ in range(8)]
        self.p_url, self.d_url, self.r_url = (f"http://127.0.0.1:{p}" for p in self.ports[:3])
        self.bootstrap_port = self.ports[3]
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(SHIMS / "dram_plugin"), str(SHIMS / "sgl_kernel_cpu")]),
            "SGLANG_USE_CPU_ENGINE": "1",
            "SGLANG_HOST_IP": "127.0.0.1",
            "UCX_NET_DEVICES": "lo",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "SGLANG_PLUGINS": PLUGINS[kind],
            **(env or {}),
        }
        self.straggle = straggle
        if straggle is not None:
            straggle.mkdir(parents=True, exist_ok=True)
            self.env["PYTHONPATH"] += os.pathsep + str(STRAGGLER)
            self.env["SGLANG_PLUGINS"] += ",straggler"
            self.env["KVLEASE_TEST_STRAGGLE_DIR"] = str(straggle)
        self.servers: list[Server] = []
        self.t_servers = self.t_ready = self._t_respawn = 0.0

    def start(self) -> None:
        """Start P and D (returns at once; `route` waits for them)."""
        common = [
            "sglang.launch_server", "--model-path", str(MODEL), "--device", "cpu", "--host", "127.0.0.1",
            "--served-model-name", "tiny", "--dtype", "float32", "--attention-backend", "torch_native",
            "--disable-overlap-schedule", "--mem-fraction-static", "0.1", "--max-total-tokens", "32768",
            "--disaggregation-transfer-backend", "nixl", "--enable-metrics",
            # An idle scheduler waits on its input sockets instead of spinning: without it each of
            # the four servers' schedulers turned at 100 % CPU with nothing to do, and on two cores
            # they took most of the machine from whatever else ran (a decode restarted in 200 s,
            # the transformers reference took 77 s). Only a fully idle scheduler sleeps (nothing
            # queued, in flight or awaiting a deferred release; SGLang's ``is_fully_idle``), and
            # a request wakes it at once: the same on both pairs.
            "--sleep-on-idle",
        ]  # fmt: skip
        ports = self.ports
        p_args = [*common, "--port", str(ports[0]), "--disaggregation-mode", "prefill",
                  "--disaggregation-bootstrap-port", str(ports[3]),
                  "--engine-info-bootstrap-port", str(ports[4])]  # fmt: skip
        d_args = [*common, "--port", str(ports[1]), "--disaggregation-mode", "decode",
                  "--disaggregation-bootstrap-port", str(ports[5]), "--engine-info-bootstrap-port", str(ports[6]),
                  "--disaggregation-decode-retraction-backup", "cpu_tensor"]  # fmt: skip
        self._t0 = time.time()
        self._d_args = d_args
        self.p = Server(f"{self.kind} prefill", p_args, self.env, self.tmp / f"{self.kind}-prefill.log")
        self.d = Server(f"{self.kind} decode", d_args, self.env, self.tmp / f"{self.kind}-decode.log")
        self.servers = [self.p, self.d]

    def respawn_decode(self) -> None:
        """Start D again (after a kill), on the same ports. Call it from the main thread: the
        child dies with the thread that started it (``PR_SET_PDEATHSIG``), so a pool thread's
        exit would kill it."""
        self._t_respawn = time.time()
        self.d.kill()
        self.d = Server(f"{self.kind} decode", self._d_args, self.env, self.tmp / f"{self.kind}-decode-2.log")
        self.servers = [self.p, self.d, *self.servers[2:]]

    def wait_decode(self) -> float:
        """After `respawn_decode`: wait until D is healthy and a completion through the router
        works again (the router keeps D's address); seconds since the respawn."""
        wait_until(
            f"{self.kind} D healthy again",
            lambda: http("GET", f"{self.d_url}/health", timeout=5)[0] == 200,
            400,
            [self.d],
        )
        wait_until(
            f"a completion through the {self.kind} router after D's restart",
            lambda: self.complete("def f(x):", 2)[0] == 200,
            300,
            self.servers,
        )
        return time.time() - self._t_respawn

    def route(self) -> None:
        """Wait for P and D, start the router, wait for a completion through it."""

        def healthy() -> bool:
            return all(http("GET", f"{url}/health", timeout=5)[0] == 200 for url in (self.p_url, self.d_url))

        wait_until(f"{self.kind} P and D healthy", healthy, 400, self.servers)
        self.t_servers = time.time() - self._t0
        r_args = ["sglang_router.launch_router", "--pd-disaggregation", "--prefill", self.p_url,
                  str(self.bootstrap_port), "--decode", self.d_url,
                  "--host", "127.0.0.1", "--port", str(self.ports[2]),
                  "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.ports[7]),
                  *self.router_flags]  # fmt: skip
        self.r = Server(f"{self.kind} router", r_args, self.env, self.tmp / f"{self.kind}-router.log")
        self.servers.append(self.r)
        # The router answers /health before it has seen its workers: until a completion works.
        wait_until(
            f"a completion through the {self.kind} router",
            lambda: self.complete("def f(x):", 2)[0] == 200,
            200,
            self.servers,
        )
        self.t_ready = time.time() - self._t0

    def complete(self, prompt: str, tokens: int) -> tuple[int, str]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": tokens, "temperature": 0}
        status, text = http("POST", f"{self.r_url}/v1/completions", body, timeout=120)
        if status != 200:
            return status, text
        return status, json.loads(text)["choices"][0]["text"]

    def close(self) -> None:
        for s in reversed(self.servers):
            s.kill()
