"""kvlease as a user installs it: the sdist and the wheel built from it, the metadata checked
by twine, the wheel installed into a fresh virtual environment with no source tree on the path,
and the commands the README names run from there (conformance with the shipped vectors, the
reference conformance driver, version, the demo on ZMQ).

Slow (a build in an isolated environment and a pip install: about a minute); it runs in CI.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

import kvlease

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _run(argv: list[str], *, cwd: Path, timeout: float, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout[-4000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # Without flags, `build` makes the sdist and then the wheel *from the sdist*: a file the
    # sdist forgets is missing from the wheel too, and this test sees it.
    _run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], cwd=ROOT, timeout=600)
    return out


def test_the_metadata_passes_twine_check(dist: Path) -> None:
    files = sorted(str(p) for p in dist.iterdir())
    assert any(f.endswith(".whl") for f in files) and any(f.endswith(".tar.gz") for f in files), files
    out = _run([sys.executable, "-m", "twine", "check", "--strict", *files], cwd=dist, timeout=120)
    assert out.count("PASSED") == 2, out


def test_the_installed_wheel_runs_what_the_readme_names(dist: Path, tmp_path: Path) -> None:
    wheel = next(dist.glob("kvlease-*.whl"))
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    py = env_dir / "bin" / "python"
    _run([str(py), "-m", "pip", "install", "-q", f"{wheel}[zmq]"], cwd=tmp_path, timeout=600)
    # A clean environment: no source tree on the path, run from a directory that is not it.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = "/usr/bin:/bin"  # the venv is *not* activated, as a user would not have it
    where = _run(
        [str(py), "-c", "import kvlease, kvlease.spec; print(kvlease.__file__)"], cwd=tmp_path, timeout=60, env=env
    )
    assert str(env_dir) in where and str(ROOT) not in where, where

    kv = str(env_dir / "bin" / "kvlease")
    assert f"kvlease {kvlease.__version__}" in _run([kv, "version"], cwd=tmp_path, timeout=60, env=env)
    n_vectors = len(list((ROOT / "spec" / "vectors").glob("*.json")))
    out = _run([kv, "conformance"], cwd=tmp_path, timeout=300, env=env)
    assert f"all {n_vectors} vectors pass" in out, out
    # The reference driver, as the help text spells it, without activating the environment.
    out = _run([kv, "conformance", "--driver", "kvlease-conformance-driver"], cwd=tmp_path, timeout=300, env=env)
    assert f"all {n_vectors} vectors pass" in out, out
    out = _run([kv, "demo", "--scenario", "happy", "--requests", "4"], cwd=tmp_path, timeout=300, env=env)
    assert "happy" in out and "ok" in out, out
