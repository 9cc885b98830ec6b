"""The `kvlease` command: help, version, option validation, and `bench`'s script runner."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import kvlease
from kvlease.cli import main


def kvlease_cmd(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvlease", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_help_lists_every_command() -> None:
    r = kvlease_cmd("--help")
    assert r.returncode == 0
    for name in ("demo", "bench", "conformance", "version"):
        assert name in r.stdout


def test_version() -> None:
    r = kvlease_cmd("version")
    assert r.returncode == 0 and kvlease.__version__ in r.stdout


def test_demo_help_documents_options() -> None:
    r = kvlease_cmd("demo", "--help")
    assert r.returncode == 0
    for opt in ("--scenario", "--lease", "--requests", "--transport", "--json", "--metrics-port", "--log-level"):
        assert opt in r.stdout


def test_negative_lease_names_the_option() -> None:
    r = kvlease_cmd("demo", "--lease", "-1")
    assert r.returncode == 2
    assert "--lease" in r.stderr and "positive" in r.stderr


def test_unknown_transport_and_scenario() -> None:
    r = kvlease_cmd("demo", "--transport", "carrier-pigeon")
    assert r.returncode == 2 and "--transport" in r.stderr and "zmq" in r.stderr
    r = kvlease_cmd("demo", "--scenario", "nope")
    assert r.returncode == 2 and "--scenario" in r.stderr


def test_nixl_missing_says_which_extra(tmp_path: Path) -> None:
    # A `nixl` package that fails to import, first on the path: what a machine without the
    # extra looks like to the demo.
    fake = tmp_path / "nixl"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('No module named nixl._api')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = kvlease_cmd("demo", "--transport", "nixl", env=env)
    assert r.returncode == 2
    assert "pip install 'kvlease[nixl]'" in r.stderr


def test_bench_lists_the_scripts_in_bench() -> None:
    r = kvlease_cmd("bench", "--list")
    assert r.returncode == 0
    assert "core" in r.stdout  # bench/core.py


def test_bench_runs_scripts_with_quick_and_reports_failures(tmp_path: Path) -> None:
    (tmp_path / "echo.py").write_text(
        '"""Echo its arguments (supports --quick)."""\nimport sys\nprint("ARGS", sys.argv[1:])\n'
    )
    (tmp_path / "broken.py").write_text('"""Always fails."""\nraise SystemExit(3)\n')
    r = kvlease_cmd("bench", "--dir", str(tmp_path), "--list")
    assert "echo" in r.stdout and "Echo its arguments" in r.stdout
    r = kvlease_cmd("bench", "--dir", str(tmp_path), "--quick", "echo")
    assert r.returncode == 0 and "ARGS ['--quick']" in r.stdout
    r = kvlease_cmd("bench", "--dir", str(tmp_path))
    assert r.returncode != 0 and "broken" in r.stderr
    r = kvlease_cmd("bench", "--dir", str(tmp_path), "nosuch")
    assert r.returncode == 2 and "nosuch" in r.stderr


def test_too_short_lease_says_the_shortest_that_works() -> None:
    r = kvlease_cmd("demo", "--lease", "0.01")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--lease" in r.stderr and "validity_margin" not in r.stderr
    shortest = float(r.stderr.split("accept is ")[1].split()[0])
    # The shortest accepted lease is accepted, and a hair less is not (three digits).
    from kvlease.cli._demo import _config_ok

    assert _config_ok(shortest) and not _config_ok(shortest * 0.99)
    assert 0.01 < shortest < 1.0


#: Each plausible bad invocation a new user tried (issue 22), the option its message must name,
#: and what else it must say (the valid range or choices). ``{tmp}`` is a scratch directory
#: holding ``notjson.txt`` (not JSON) and ``nojson.json`` (JSON, but no violation record).
BAD_INVOCATIONS: list[tuple[list[str], str, str]] = [
    (["sim", "--rate", "0"], "--rate", "0.0<x<=100.0"),
    (["sim", "--rate", "-1"], "--rate", "0.0<x<=100.0"),
    (["sim", "--rate", "nan"], "--rate", "0.0<x<=100.0"),
    (["sim", "--duration", "-5"], "--duration", "0.0<x<=3600.0"),
    (["sim", "--duration", "1e9"], "--duration", "0.0<x<=3600.0"),
    (["sim", "--crash-at", "inf"], "--crash-at", "x<=3600.0"),
    (["sim", "--burst", "200,60"], "--burst", "START,LENGTH,RATE"),
    (["sim", "--burst", "200,60,0"], "--burst", "RATE 0 is not in the range 0.0<x<=200.0"),
    (["sim", "--burst", "a,60,25"], "--burst", "START must be a number"),
    (["sim", "--stall", "230,-1"], "--stall", "LENGTH -1 is not in the range"),
    (["sim", "--sweep", "10,x"], "--sweep", "'x' is not a number"),
    (["sim", "--sweep", "0"], "--sweep", "0.0<x<=200.0"),
    (["sim", "--campaign", "0"], "--campaign", "1<=x<=1000000"),
    (["sim", "--max-reports", "-1"], "--max-reports", "0<=x<=100"),
    (["sim", "--seed", "-1"], "--seed", "0<=x<=4294967295"),
    (["sim", "--first-seed", "-1"], "--first-seed", "0<=x<=4294967295"),
    (["sim", "--replay", "{tmp}/notjson.txt"], "--replay", "not JSON"),
    (["sim", "--replay", "{tmp}/nojson.json"], "--replay", "no valid 'scenario'"),
    (["sim", "--replay", "{tmp}/absent.json"], "--replay", "does not exist"),
    (["demo", "--lease", "0"], "--lease", "0.0<x<=30.0"),
    (["demo", "--lease", "1e9"], "--lease", "0.0<x<=30.0"),
    (["demo", "--lease", "nan"], "--lease", "positive number of seconds"),
    (["demo", "--requests", "0"], "--requests", "1<=x<=4096"),
    (["demo", "--requests", "5000"], "--requests", "1<=x<=4096"),
    (["demo", "--metrics-port", "65536"], "--metrics-port", "0<=x<=65535"),
    (["demo", "--patience", "0"], "--patience", "0.0<x<=100.0"),
    (["demo", "--patience", "nan"], "--patience", "positive factor"),
    (["check", "-p", "3"], "--pinner-ranks", "1, 2 or 4"),
    (["check", "-a", "0"], "--accessor-ranks", "1, 2 or 4"),
    (["check", "--leases", "4"], "--leases", "1<=x<=3"),
    (["check", "--engines", "3"], "--engines", "1<=x<=2"),
    (["check", "--depth", "0"], "--depth", "1<=x<=64"),
    (["check", "--history", "9"], "--history", "0<=x<=8"),
    (["check", "--restarts", "2"], "--restarts", "0<=x<=1"),
    (["check", "--accessor-lease", "0"], "--accessor-lease", "0.0<x<=86400.0"),
    (["check", "--max-outstanding", "0"], "--max-outstanding", "1<=x<=64"),
    (["check", "--max-states", "0"], "--max-states", "x>=1"),
    (["check", "--progress-every", "-1"], "--progress-every", "0.0<=x<=3600.0"),
    (["check", "--kinds", "bogus"], "--kinds", "renewable, fixed, push"),
    (["check", "--without", "bogus"], "--without", "grant, release"),
    (["check", "--inject-bug", "nosuch"], "--inject-bug", "Invalid value"),
    (["conformance", "--only", "nosuch"], "--only", "accessor_crash_expiry, accessor_edges"),
    (["conformance", "--timeout", "0"], "--timeout", "0.0<x<=3600.0"),
    (["conformance", "--vectors", "{tmp}/absent"], "--vectors", "does not exist"),
    (["bench", "--dir", "{tmp}/absent"], "--dir", "does not exist"),
    (["bench", "nosuch"], "NAMES", "available: "),
]


@pytest.mark.parametrize(
    ("args", "option", "says"), BAD_INVOCATIONS, ids=lambda v: " ".join(v) if isinstance(v, list) else ""
)
def test_a_bad_option_is_a_one_line_usage_error_naming_it(
    args: list[str], option: str, says: str, tmp_path: Path
) -> None:
    (tmp_path / "notjson.txt").write_text("this is not JSON\n")
    (tmp_path / "nojson.json").write_text('{"seed": 1}\n')
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit)  # not a traceback caught by the runner
    assert "Traceback" not in result.output
    error = [ln for ln in result.output.splitlines() if ln.startswith("Error:")]
    assert len(error) == 1, result.output
    assert option in error[0] and says in error[0], error[0]


def test_metrics_without_prometheus_client_names_the_extra(tmp_path: Path) -> None:
    fake = tmp_path / "prometheus_client"  # first on the path: an install without the extra
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('No module named prometheus_client')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = kvlease_cmd("demo", "--metrics-port", "0", env=env)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--metrics-port" in r.stderr and "pip install 'kvlease[metrics]'" in r.stderr


def test_bench_outside_a_source_checkout_says_how_to_run_it(tmp_path: Path) -> None:
    # kvlease as a wheel installs it: the package without bench/ beside it.
    site = tmp_path / "site"
    shutil.copytree(Path(kvlease.__file__).parent, site / "kvlease", ignore=shutil.ignore_patterns("__pycache__"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    r = subprocess.run(
        [sys.executable, "-m", "kvlease", "bench", "core"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=elsewhere,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert str(site / "bench") in r.stderr  # the copy ran, not the checkout
    assert "not installed with kvlease" in r.stderr and "source checkout" in r.stderr
    assert r.stderr.count("Error:") == 1
    r = subprocess.run(
        [sys.executable, "-m", "kvlease", "bench", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=elsewhere,
    )
    assert r.returncode == 0 and "not installed with kvlease" in r.stdout


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is importable here")
def test_bench_vllm_adapter_outside_vllms_environment_says_where_it_runs() -> None:
    r = kvlease_cmd("bench", "vllm_adapter")
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert ".venv-vllm/bin/python -m kvlease bench vllm_adapter" in r.stderr


def test_check_prints_progress_when_piped() -> None:
    r = kvlease_cmd("check", "--depth", "3", "--progress-every", "0")
    assert r.returncode == 0, r.stderr
    progress = [ln for ln in r.stderr.splitlines() if ln.startswith("check: depth ")]
    assert [ln.split(",")[0] for ln in progress][-3:] == ["check: depth 1/3", "check: depth 2/3", "check: depth 3/3"]
    assert "states explored" in r.stdout and "check: depth" not in r.stdout


@pytest.mark.parametrize("name", ["sim", "demo", "check", "bench", "conformance", "version"])
def test_every_option_has_help_and_every_number_a_range(name: str) -> None:
    command = main.get_command(click.Context(main), name)
    assert command is not None
    for param in command.params:
        if not isinstance(param, click.Option) or param.is_flag:
            continue
        assert param.help, f"{name} {param.opts} has no help text"
        unchecked = isinstance(param.type, (click.types.IntParamType, click.types.FloatParamType)) and not isinstance(
            param.type, (click.IntRange, click.FloatRange)
        )
        assert not unchecked or param.callback is not None, f"{name} {param.opts} takes any {param.type.name}"


def _double(factory: object) -> object:
    """The broken core a registry entry runs: the class a simulator factory closes over, or the
    entry itself (a class, or a factory function both registries share)."""
    cells = getattr(factory, "__closure__", None) or ()
    return next((c.cell_contents for c in cells if isinstance(c.cell_contents, type)), factory)


def test_a_bug_has_one_name_in_check_and_in_sim() -> None:
    from kvlease import Accessor, Pinner
    from kvlease.check import CHECK_BUGS, RENAMED_BUGS
    from kvlease.sim import BUGS

    in_sim: dict[object, str] = {_double(f): name for name, pair in BUGS.items() for f in pair if f is not None}
    in_check: dict[object, str] = {
        d: name for name, (p, a, _) in CHECK_BUGS.items() for d in (p, a) if d not in (Pinner, Accessor)
    }
    shared = set(in_sim) & set(in_check)
    assert len(shared) >= 11, shared  # every double both registries run
    assert {in_check[d]: in_sim[d] for d in shared if in_sim[d] != in_check[d]} == {}
    # The earlier check names still work, each for a name that exists, none shadowing one.
    assert set(RENAMED_BUGS.values()) <= set(CHECK_BUGS) and not set(RENAMED_BUGS) & set(CHECK_BUGS)


def test_an_earlier_inject_bug_name_still_runs_and_says_what_it_is_now() -> None:
    result = CliRunner().invoke(main, ["check", "--inject-bug", "rounds", "--depth", "1", "--json"])
    assert result.exit_code == 0, result.output
    assert "--inject-bug rounds is deprecated: it is now chunk-bound" in result.stderr
    assert json.loads(result.stdout)["scope"]["inject_bug"] == "chunk-bound"
    help_text = " ".join(CliRunner().invoke(main, ["check", "--help"], terminal_width=200).output.split())
    assert "Deprecated earlier names, still accepted:" in help_text and "rounds (now chunk-bound)" in help_text
