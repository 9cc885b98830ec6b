"""dev.sh, the one entry point of a fresh clone: what a selection of tests builds, and what each
command forwards to. Runs the script's own functions (sourced, nothing installed)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def engines_for(*paths: str) -> list[str]:
    """What `dev.sh test PATHS...` would build: dev.sh's engines_for, sourced alone."""
    script = (ROOT / "dev.sh").read_text()
    body = script[script.index("engines_for() {") :]
    body = body[: body.index("\n}\n") + 3]
    r = subprocess.run(
        ["bash", "-c", body + 'engines_for "$@"', "engines_for", *paths],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return sorted(set(r.stdout.split()))


@pytest.mark.parametrize(
    ("paths", "engines"),
    [
        (["tests/test_codec.py"], []),
        (["tests/test_codec.py", "-q"], []),
        (["tests/test_vllm_serve.py"], ["vllm"]),
        (["tests/test_sglang_pair.py::test_completions_through_sglangs_router"], ["sglang"]),
        # Its name does not say vLLM; it imports the vLLM helpers (it skipped, or failed under CI,
        # when only the name was read).
        (["tests/test_hetero_tp.py"], ["vllm"]),
        # It checks what kvlease says outside vLLM's environment: no engine needed.
        (["tests/test_cli.py"], []),
        (["tests"], ["sglang", "vllm"]),
        ([], ["sglang", "vllm"]),
        (["-x"], ["sglang", "vllm"]),
    ],
)
def test_a_selection_of_tests_builds_the_engines_it_needs(paths: list[str], engines: list[str]) -> None:
    assert engines_for(*paths) == engines


def test_every_test_file_that_uses_an_engine_environment_selects_it() -> None:
    """A file that reaches an engine's environment (its helpers, its venv) builds it when run alone."""
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        text = path.read_text()
        for engine in ("vllm", "sglang"):
            uses = f"from _{engine}_" in text or f"import _{engine}_" in text or f"import {engine}_pd" in text
            if uses:
                assert engine in engines_for(str(path.relative_to(ROOT))), (path.name, engine)


def test_help_names_every_command_the_script_forwards() -> None:
    r = subprocess.run(["bash", "dev.sh", "help"], cwd=ROOT, capture_output=True, text=True, check=True)
    for command in ("demo", "test", "bench", "sim", "check", "conformance", "vllm-demo", "gates", "env"):
        assert command in r.stdout, command
    # `check` reaches kvlease's model checker (it fell through to the usage error).
    r = subprocess.run(["bash", "dev.sh", "check", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "--inject-bug" in r.stdout


def _engines_in(folder: Path) -> subprocess.CompletedProcess[str]:
    """dev.sh's `engines`, sourced alone and run (under the script's `set -euo pipefail`) in
    `folder`, whose engines/*/setup.sh stand in for the real ones."""
    script = (ROOT / "dev.sh").read_text()
    body = script[script.index("engines() {") :]
    body = body[: body.index("\n}\n") + 3]
    return subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + body + "engines\necho after"],
        cwd=folder,
        capture_output=True,
        text=True,
    )


def test_the_engine_setups_run_side_by_side_and_one_that_fails_fails_the_run(tmp_path: Path) -> None:
    # a waits for b to have started: run in turn (a first), a would give up and fail.
    wait_for_b = "for i in $(seq 300); do [ -f b.started ] && break; sleep 0.1; done; [ -f b.started ]"
    for name, body in (("a", f"{wait_for_b}; touch a.done"), ("b", "touch b.started; exit 3")):
        (tmp_path / "engines" / name).mkdir(parents=True)
        (tmp_path / "engines" / name / "setup.sh").write_text(f"set -e\n{body}\n")
    r = _engines_in(tmp_path)
    assert r.returncode != 0 and "after" not in r.stdout, r
    assert "dev.sh: engines/b/setup.sh failed" in r.stderr
    assert "engines/a/setup.sh" not in r.stderr, "the setups ran one after the other"
    assert (tmp_path / "a.done").exists()
    (tmp_path / "engines" / "b" / "setup.sh").write_text("touch b.started b.done\n")
    r = _engines_in(tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "after", r
    assert (tmp_path / "b.done").exists()
