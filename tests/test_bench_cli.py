"""`kvlease bench` as a user meets it: `--help` says roughly how long each benchmark runs, and
`--list` names them all (the figures themselves are benchmarks' business, never a test's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if not p.name.startswith("_"))


def _kvlease(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "kvlease", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_bench_help_says_how_long_each_benchmark_runs() -> None:
    out = _kvlease("bench", "--help")
    section = out.split("Benchmarks (run time", 1)[1]
    starts = [ln for ln in section.splitlines()[1:] if ln.startswith("  ") and not ln.startswith("   ")]
    rows = {line.split()[0]: line for line in starts}
    assert sorted(rows) == SCRIPTS
    for name, row in rows.items():
        assert "not stated" not in row, f"bench/{name}.py states no 'Run time: ...' in its docstring"
        assert " s" in row or "minute" in row, row


def test_bench_list_names_every_script_with_its_run_time() -> None:
    out = _kvlease("bench", "--list")
    for name in SCRIPTS:
        line = next(ln for ln in out.splitlines() if ln.startswith(name + " "))
        assert "run time: about" in line, line


def test_each_benchmark_entry_is_whole_sentences() -> None:
    # A docstring's first line can stop mid-sentence, and an "i.e." inside the run time's
    # parentheses once cut it short: each entry is the whole first paragraph and run time.
    out = _kvlease("bench", "--list")
    for name in SCRIPTS:
        line = next(ln for ln in out.splitlines() if ln.startswith(name + " "))
        summary, run_time = line[len(name) :].strip().split(" (run time: ")
        assert summary.endswith("."), line
        assert run_time.endswith(")") and run_time[:-1].count("(") == run_time[:-1].count(")"), line
    core = next(ln for ln in out.splitlines() if ln.startswith("core "))
    assert "--sizes 1000,100000: about 10 s)" in core, core
