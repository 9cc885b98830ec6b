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
