"""The `kvlease` command: help, version, option validation, and `bench`'s script runner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kvlease


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
