"""`kvlease demo`: a pinner (P) and an accessor (D) as two real OS processes on loopback.

This module owns the command's options and their validation, the orchestration of the two
child processes per scenario (`_Play`: spawn them on the child-process harness, watch, play the
router between them: grant once D is connected, forward each lease ticket to D, tell P when D
is gone; inflict the scenario's fault, and always kill and reap them in ``finally``, on Ctrl-C
and on SIGTERM too), the rich live view, the summary table, ``--json`` output and
``--metrics-port`` (the children's driver `TransportStats`, exported through
`kvlease.transports.metrics`). The process bodies (a `kvlease.transports.Driver` over the real
ZMQ or NIXL transport each) are in `_demo_proc`; each scenario (timing, fault, judgement, row)
is one object in `_demo_scenarios`; when a scenario has waited too long, and what it then says,
is `_demo_steps` (this module feeds it the events, the time and the starting child's CPU time).
It never decides anything about a lease: the core in each child does.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import click

from kvlease import ConfigError, LeaseConfig

from ._child import ChildProcess
from ._demo_scenarios import SCENARIOS, Bounds, ChildSpec, Scenario, ScenarioResult, ScenarioRun, evaluate
from ._demo_steps import Calibration, Steps
from ._params import Number

__all__ = ["demo"]

log = logging.getLogger("kvlease.demo")

TICK = 0.02
BLOCK_SIZE = 4096
#: The longest `--lease`: every scenario together runs for about ten leases (five minutes here).
MAX_LEASE = 30.0


def _child_env(transport: str) -> dict[str, str]:
    env = dict(os.environ)
    if transport == "nixl":
        env.setdefault("UCX_NET_DEVICES", "lo")
        env.setdefault("UCX_TLS", "tcp,cma,self,sm")
    return env


class _Metrics:
    """Per-role `TransportStats` mirrored from the children's reports, served over HTTP."""

    def __init__(self, port: int) -> None:
        from ..transports._stats import TransportStats
        from ..transports.metrics import (
            LeaseStatsCollector,
            start_http_server,
        )

        self.stats = {"pinner": TransportStats(), "accessor": TransportStats()}
        self.base: dict[str, dict[str, float]] = {"pinner": {}, "accessor": {}}
        self.last: dict[str, dict[str, float]] = {"pinner": {}, "accessor": {}}
        self.collector = LeaseStatsCollector(
            {("prefill-0", "0", "pinner"): self.stats["pinner"], ("decode-0", "0", "accessor"): self.stats["accessor"]},
            label_names=("engine_id", "rank", "role"),
        )
        _, self.server = start_http_server(self.collector, port)
        self.port: int = self.server.server_address[1]

    def update(self, role: str, snap: dict[str, float]) -> None:
        # Counters accumulate across scenarios (each scenario's processes start from zero).
        stats = self.stats[role]
        self.last[role] = snap
        for name, v in snap.items():
            if hasattr(stats, name) and name != "rtt_samples":
                total = self.base[role].get(name, 0) + v
                setattr(stats, name, int(total) if name != "bytes_pinned" else int(v))

    def scenario_done(self) -> None:
        for role in self.base:
            for name, v in self.last[role].items():
                if name != "bytes_pinned":
                    self.base[role][name] = self.base[role].get(name, 0) + v
            self.last[role] = {}

    def rtt(self, seconds: float) -> None:
        self.stats["accessor"].record_rtt(seconds)

    def close(self) -> None:
        self.server.shutdown()


class _StopSignals:
    """Ctrl-C (SIGINT) and SIGTERM, noted by the handler and acted on by the main loop.

    The handler only records the signal: a `KeyboardInterrupt` raised wherever the main thread
    happens to be can land inside `queue.Queue.get`'s condition wait and leave its lock
    released twice (``RuntimeError: release unlocked lock``), so the demo raises it itself, at
    the top of its loop. SIGINT is taken over only if Python's default handler is installed:
    a demo started with SIGINT ignored (``nohup``, a background job) keeps ignoring it."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _StopSignals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            current = signal.getsignal(sig)
            if sig == signal.SIGINT and current is not signal.default_int_handler:
                continue
            self._old[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _note(self, signum: int, frame: object) -> None:
        self.signum = signum

    def check(self) -> None:
        """Raise `KeyboardInterrupt` here if a stop signal came: children are then killed and
        reaped by the `finally` clauses on the way out."""
        if self.signum is not None:
            raise KeyboardInterrupt


def _run_scenario(
    name: str,
    transport: str,
    config: LeaseConfig,
    requests: int,
    log_level: str,
    view: Any,
    metrics: _Metrics | None,
    stop: _StopSignals,
    calibration: Calibration,
) -> ScenarioRun:
    play = _Play(SCENARIOS[name], transport, config, requests, log_level, metrics, calibration)
    try:
        play.loop(view, stop)
        play.reap(stop)
    finally:
        play.close()
    return play.run


class _Play:
    """One scenario played by the parent: P and D as child processes, the parent as router
    (grants once D is connected, tickets forwarded to D, "bye" to P once D is gone) and, when
    the scenario has one, the fault (SIGKILL of D)."""

    def __init__(
        self,
        scenario: Scenario,
        transport: str,
        config: LeaseConfig,
        requests: int,
        log_level: str,
        metrics: _Metrics | None,
        calibration: Calibration,
    ) -> None:
        self.scenario = scenario
        self.metrics = metrics
        epochs = {"pinner": random.uniform(1e4, 2e5), "accessor": random.uniform(1e4, 2e5)}
        self.spec = ChildSpec(
            role="pinner",
            scenario=scenario.name,
            transport=transport,
            kv_lease_duration=config.kv_lease_duration,
            max_access_time=config.max_access_time,
            requests=requests,
            block_size=BLOCK_SIZE,
            blocks_per_request=16,
            tick=TICK,
            log_level=log_level,
            epoch=epochs["pinner"],
            timing=scenario.timing(config),
        )
        self.kill_after = scenario.kill_after(self.spec.timing)
        self.run = ScenarioRun(scenario.name, transport, requests, 16, epochs, started=time.monotonic())
        self.events: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self.env = _child_env(transport)
        self.calibration = calibration
        self.steps = Steps(requests, scenario.expected_duration(config), calibration, started=time.monotonic())
        self.children: list[ChildProcess] = []
        self.pinner = self._spawn(self.spec)
        self.accessor: ChildProcess | None = None
        self.exited: set[str] = set()
        self.grant_time: float | None = None

    def _spawn(self, spec: ChildSpec) -> ChildProcess:
        role = spec.role
        child = ChildProcess(
            [sys.executable, "-m", "kvlease.cli._demo_proc", spec.to_json()],
            name=role,
            env=self.env,
            ready=None,
            on_event=lambda ev: self.events.put((role, ev)),
            capture_stderr=False,
        )
        self.children.append(child)
        return child

    def loop(self, view: Any, stop: _StopSignals) -> None:
        run = self.run
        while len(self.exited) < 2:
            stop.check()
            now = time.monotonic()
            starting = self.steps.starting
            child = next((c for c in self.children if c.name == starting), None)
            if child is not None:
                self.steps.cpu(child.name, _cpu_seconds(child.pid), now)
            if self.steps.expired(now):
                run.timed_out = True
                why = self.steps.why(run, now, {c.name: c.pid for c in self.children})
                run.errors.append(why)
                log.error("demo: scenario %s %s", run.name, why)
                return
            try:
                role, ev = self.events.get(timeout=0.05)
            except queue.Empty:
                role, ev = "", {}
            if ev and not self._route(role, ev):
                return
            self._fault()
            view.update(run)

    def _route(self, role: str, ev: dict[str, Any]) -> bool:
        """Act on one child event as the router would; False: the scenario cannot go on."""
        kind, run = ev.get("ev"), self.run
        if kind == "ready" and role == "pinner":
            self.accessor = self._spawn(
                attrs.evolve(self.spec, role="accessor", epoch=run.epochs["accessor"], endpoint=ev["endpoint"])
            )
        elif kind == "connected" and role == "accessor":
            self.pinner.try_send(op="grant")  # D is connected: requests arrive
        elif kind == "grant" and role == "pinner" and self.accessor is not None:
            # The router carries the ticket to D with the request (kv_transfer_params).
            fields = {k: ev[k] for k in ("key", "ticket", "slot", "seed", "address")}
            self.accessor.try_send(op="track", **fields)
        elif kind == "eof":
            self.exited.add(role)
            if role == "pinner" and self.accessor is None:
                run.errors.append("the pinner process exited before it was ready")
                return False
            if role == "accessor":
                self.pinner.try_send(op="bye")  # D is gone: P exits once its leases ended
        elif kind == "stats" and self.metrics is not None:
            self.metrics.update(role, ev["stats"])
        elif kind == "rtt" and self.metrics is not None:
            self.metrics.rtt(float(ev["seconds"]))
        if kind:
            run.feed(role, ev)
            self.steps.observe(role, kind, time.monotonic())
        if kind == "grant" and self.grant_time is None:
            self.grant_time = ev["t"]
        return True

    def _fault(self) -> None:
        """The scenario's fault, if it has one: SIGKILL D once it tracks every request."""
        run, accessor = self.run, self.accessor
        if (
            self.kill_after is not None
            and accessor is not None
            and run.kill_time is None
            and self.grant_time is not None
            and len(run.tracked) == run.requests
            and time.monotonic() >= self.grant_time + self.kill_after
        ):
            run.kill_time = time.monotonic()
            accessor.kill(signal.SIGKILL)
            log.warning("demo: SIGKILLed the accessor (pid %d) mid-flight", accessor.pid)

    def reap(self, stop: _StopSignals) -> None:
        """Wait for both children to exit after their scenario; note what went wrong."""
        run = self.run
        for child in self.children:
            if not run.timed_out:
                waited_until = time.monotonic() + self.calibration.margin
                while child.returncode is None and time.monotonic() < waited_until:
                    stop.check()
                    time.sleep(0.02)
                if child.returncode is None:
                    run.errors.append(f"the {child.name} process did not exit after its scenario")
            rc = child.returncode
            if rc not in (0, None) and not (child.name == "accessor" and run.kill_time is not None):
                run.errors.append(f"the {child.name} process exited with status {rc}")

    def close(self) -> None:
        """Kill and reap the children, then take in what they said after the loop stopped."""
        for child in self.children:
            child.close()
        while True:
            try:
                role, ev = self.events.get_nowait()
            except queue.Empty:
                break
            if ev.get("ev") not in ("eof", None):
                self.run.feed(role, ev)
        if self.metrics is not None:
            self.metrics.scenario_done()
        self.run.finished = time.monotonic()
        self.run.step_seconds = dict(self.steps.seconds)


def _cpu_seconds(pid: int) -> float | None:
    """CPU time (user + system) process `pid` has used, from /proc; None where unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class _View:
    """The rich live view: a progress bar over scenarios and a table of blocks per state."""

    def __init__(self, enabled: bool, scenarios: list[str], config: LeaseConfig) -> None:
        self.enabled = enabled
        self._live: Any = None
        self._config = config
        self._scenarios = scenarios
        if not enabled:
            return
        from rich.console import Group
        from rich.live import Live
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.completed:.0f}/{task.total:.0f}"),
            TimeElapsedColumn(),
        )
        self.task = self.progress.add_task("scenarios", total=len(scenarios))
        self._group = Group
        self._run: ScenarioRun | None = None
        self._last = 0.0
        self._live = Live(self._render(), refresh_per_second=8, transient=False)

    def _render(self) -> Any:
        from rich.table import Table

        table = Table(title="pinned KV blocks per state", expand=False)
        table.add_column("scenario")
        table.add_column("state")
        table.add_column("blocks", justify="right")
        run = self._run if self.enabled else None
        if run is not None:
            for state, count in run.block_states(time.monotonic()).items():
                table.add_row(run.name, state, str(count))
            reads = run.reads
            valid = sum(1 for r in reads.values() if r["verdict"] == "valid")
            caught = sum(1 for r in reads.values() if r["verdict"] in ("stale", "refused"))
            table.add_row(run.name, "reads valid / stale caught", f"{valid} / {caught}")
            table.add_row(run.name, "heartbeats at P", str(len(run.heartbeats_at_pinner)))
        return self._group(self.progress, table)

    def __enter__(self) -> _View:
        if self._live is not None:
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)

    def start(self, name: str) -> None:
        if self.enabled:
            self.progress.update(self.task, description=f"scenario {name}: {SCENARIOS[name].description}")

    def update(self, run: ScenarioRun) -> None:
        if not self.enabled:
            return
        self._run = run
        now = time.monotonic()
        if now - self._last > 0.1:
            self._last = now
            self._live.update(self._render())

    def done(self) -> None:
        if self.enabled:
            self.progress.advance(self.task)
            self._live.update(self._render())


def _summary_table(results: list[ScenarioResult], config: LeaseConfig, bounds: Bounds) -> Any:
    from rich.table import Table

    t = Table(
        title=f"kvlease demo: lease {config.kv_lease_duration:g} s, heartbeat every {bounds.interval:.3g} s, "
        f"extension {bounds.extension:.3g} s",
    )
    t.add_column("scenario", style="bold")
    t.add_column("transport")
    t.add_column("kvlease (measured)")
    t.add_column("baseline it replaces")
    t.add_column("claims")
    for r in results:
        broken = [c for c in r.claims if not c.ok]
        status = (
            f"[green]{len(r.claims)}/{len(r.claims)} ok[/]"
            if not broken
            else "[red]BROKEN: " + "; ".join(f"{c.name} ({c.text})" for c in broken) + "[/]"
        )
        t.add_row(r.name, r.transport, r.kvlease, r.baseline, status)
    return t


def _demo_config(lease: float) -> LeaseConfig:
    """The lease configuration the demo runs: `--lease` and what derives from it."""
    return LeaseConfig(kv_lease_duration=lease, max_access_time=min(2.0, lease / 10))


def _shortest_lease(too_short: float) -> float:
    """The shortest `--lease` (three significant digits, rounded up) that `_demo_config`
    accepts: found by asking the configuration itself, so it never disagrees with it."""
    lo, hi = too_short, max(1.0, too_short)
    while not _config_ok(hi):
        lo, hi = hi, hi * 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if _config_ok(mid) else (mid, hi)
    scale = 10.0 ** (math.floor(math.log10(hi)) - 2)
    steps = math.ceil(hi / scale)
    while not _config_ok(float(f"{steps * scale:.3g}")):  # rounding may land a hair short
        steps += 1
    return float(f"{steps * scale:.3g}")


def _config_ok(lease: float) -> bool:
    try:
        _demo_config(lease)
    except ConfigError:
        return False
    return True


def _check_metrics() -> None:
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise click.UsageError(
            "--metrics-port needs prometheus_client; install the extra: pip install 'kvlease[metrics]'"
        ) from None


def _check_transport(transport: str) -> None:
    if transport == "nixl":
        try:
            import nixl._api  # noqa: F401
            import torch  # noqa: F401
        except ImportError as exc:
            raise click.UsageError(
                f"--transport nixl needs NIXL and torch ({exc}); install the extra: pip install 'kvlease[nixl]'"
            ) from None
    else:
        try:
            import zmq  # noqa: F401
        except ImportError:
            raise click.UsageError(
                "--transport zmq needs pyzmq; install the extra: pip install 'kvlease[zmq]'"
            ) from None


@click.command()
@click.option(
    "--scenario",
    "scenario",
    type=click.Choice([*SCENARIOS, "all"]),
    default="all",
    show_default=True,
    help="Which scenario to play.",
)
@click.option(
    "--lease",
    "lease",
    type=Number(0.0, MAX_LEASE, min_open=True, what="a positive number of seconds"),
    default=2.5,
    show_default=True,
    help="Initial lease (kv_lease_duration), seconds; heartbeat interval and extension derive from it "
    "(all scenarios take about 10 x the lease).",
)
@click.option(
    "--requests",
    "requests",
    type=click.IntRange(1, 4096),
    default=8,
    show_default=True,
    help="Requests (leases) per scenario.",
)
@click.option(
    "--transport",
    "transport",
    type=click.Choice(["zmq", "nixl"]),
    default="zmq",
    show_default=True,
    help="ZMQ on loopback, or NIXL over UCX with real registered memory.",
)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable results instead of the tables.")
@click.option(
    "--metrics-port",
    "metrics_port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve Prometheus metrics of both processes on 127.0.0.1:PORT during the run.",
)
@click.option(
    "--patience",
    "patience",
    type=Number(0.0, 100.0, min_open=True, what="a positive factor"),
    default=1.0,
    show_default=True,
    help="Scale every step's deadline by this factor. Deadlines already follow the machine (a step gives up "
    "only after its scenario's quiet time plus 4x the slowest process start-up measured, with no progress); "
    "raise it for a machine slower still.",
)
@click.option(
    "--log-level",
    "log_level",
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
    default="error",
    show_default=True,
    help="Log level of the demo and its processes (stderr).",
)
def demo(
    scenario: str,
    lease: float,
    requests: int,
    transport: str,
    as_json: bool,
    metrics_port: int | None,
    patience: float,
    log_level: str,
) -> None:
    """Run a pinner (P) and an accessor (D) as two OS processes on loopback and play the lease
    scenarios, each beside the baseline it replaces. Exits non-zero if any safety or liveness
    claim (checked against bounds derived from the lease configuration) was broken."""
    _check_transport(transport)
    if metrics_port is not None:
        _check_metrics()
    level = log_level.upper()
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s demo %(levelname)s %(name)s: %(message)s")
    try:
        config = _demo_config(lease)
    except ConfigError:
        shortest = _shortest_lease(lease)
        raise click.BadParameter(
            f"{lease:g} s is too short: with the demo's other settings (heartbeat every lease/6, extension "
            f"2 x lease/3, validity margin {LeaseConfig().validity_margin:g} s) the shortest lease these "
            f"settings accept is {shortest:g} s",
            param_hint="'--lease'",
        ) from None
    bounds = Bounds.from_config(config, TICK)
    names = list(SCENARIOS) if scenario == "all" else [scenario]
    metrics = _Metrics(metrics_port) if metrics_port is not None else None
    if metrics is not None and not as_json:
        click.echo(f"metrics: http://127.0.0.1:{metrics.port}/metrics", err=True)
    results: list[ScenarioResult] = []
    interactive = not as_json and sys.stdout.isatty()
    calibration = Calibration(patience=patience)
    try:
        with _StopSignals() as stop, _View(interactive, names, config) as view:
            for i, name in enumerate(names):
                view.start(name)
                if not interactive:  # piped: a line per scenario, so a long run is not silent
                    click.echo(f"demo: scenario {i + 1}/{len(names)}: {name} ({SCENARIOS[name].description})", err=True)
                run = _run_scenario(name, transport, config, requests, level, view, metrics, stop, calibration)
                stop.check()
                results.append(evaluate(run, config, bounds))
                view.done()
    except KeyboardInterrupt:
        click.echo("interrupted: child processes stopped", err=True)
        sys.exit(130)
    finally:
        if metrics is not None:
            metrics.close()
    ok = all(r.ok for r in results)
    if as_json:
        out = {
            "ok": ok,
            "transport": transport,
            "config": {
                "kv_lease_duration": config.kv_lease_duration,
                "heartbeat_interval": bounds.interval,
                "lease_extension": bounds.extension,
                "accessor_extension": bounds.accessor_extension,
                "max_access_time": config.max_access_time,
            },
            "bounds": {"reclaim_s": bounds.reclaim, "slack_s": bounds.slack},
            "scenarios": [r.to_json() for r in results],
        }
        click.echo(json.dumps(out, indent=2))
    else:
        from rich.console import Console

        Console().print(_summary_table(results, config, bounds))
        for r in results:
            for c in r.claims:
                if not c.ok:
                    click.echo(f"BROKEN {c.kind} claim in {r.name}: {c.name}: {c.text}", err=True)
    if not ok:
        sys.exit(1)
