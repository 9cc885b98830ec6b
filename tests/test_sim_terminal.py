"""`kvlease sim`'s comparison table as a person sees it.

A pipe and a pty with ``COLUMNS`` set both passed while a real terminal cropped numbers (870
shown as "87"): rich cut every line at the terminal's edge, and nothing read back what the
terminal displays. Here a real terminal program (tmux, a private server) runs the command at
80, 100 and 120 columns; the test reads the screen back with ``capture-pane`` and compares
every cell with ``--json`` of the same run. A sweep over widths renders the same tables in
process, where a console of any width costs nothing.
"""

from __future__ import annotations

import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid

import pytest
from rich.console import Console

from kvlease.cli._sim import _COLUMNS, _fmt, terminal_table

#: A short run (about a second per policy) whose numbers are as wide as the default run's:
#: eight-digit block-seconds, three-digit false frees, seven-digit heartbeat bytes.
_ARGS = ["sim", "--duration", "300", "--crash-at", "100", "--burst", "60,60,25", "--stall", "130,25", "--seed", "1"]

_KEYS = [k for k, _, _ in _COLUMNS]
_BORDERS = "┓┃┩│┘"  # what the last character of each line of a box table must be


def _json_run() -> subprocess.Popen[str]:
    """The same run with ``--json``, started now (it runs beside the terminals)."""
    argv = [sys.executable, "-m", "kvlease", *_ARGS, "--json"]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _expected(proc: subprocess.Popen[str]) -> dict[str, dict[str, str]]:
    """Each policy's cells as the table must show them, from the same run's ``--json``."""
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return {r["policy"]: {k: _fmt(r[k], f) for k, _, f in _COLUMNS} for r in json.loads(out)["results"]}


def read_tables(screen: str) -> dict[str, dict[str, str]]:
    """The cells of every box table on `screen`, as {policy: {summary key: cell}}, whichever
    layout the command chose (a row per policy, or a column per policy), and in however many
    tables. A table line that does not end in its border was cut: an assertion error."""
    by_header = {h: k for k, h, _ in _COLUMNS}
    cells: dict[str, dict[str, str]] = {}
    lines = screen.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("┏"):
            i += 1
            continue
        block = []
        while not lines[i].startswith("└"):
            block.append(lines[i])
            i += 1
        block.append(lines[i])
        for line in block:
            assert line[-1] in _BORDERS, f"a table line cut at the terminal's edge: {line!r}"
        head = [ln.split("┃")[1:-1] for ln in block if ln.startswith("┃")]
        headers = [" ".join(w for w in (h[c].strip() for h in head) if w) for c in range(len(head[0]))]
        body = [[c.strip() for c in ln.split("│")[1:-1]] for ln in block if ln.startswith("│")]
        if headers[0] == "policy":
            for row in body:
                for header, cell in zip(headers[1:], row[1:], strict=True):
                    cells.setdefault(row[0], {})[by_header[header]] = cell
        else:
            assert headers[0] == "metric", headers
            for row in body:
                for policy, cell in zip(headers[1:], row[1:], strict=True):
                    cells.setdefault(policy, {})[by_header[row[0]]] = cell
        i += 1
    return cells


def _terminals(widths: tuple[int, ...], argv: list[str]) -> dict[int, str]:
    """What a terminal of each width shows after running `argv` (history included): one tmux
    server, a session per width, all running at once."""
    server = ["tmux", "-L", f"kvlease-test-{uuid.uuid4().hex[:12]}", "-f", "/dev/null"]
    # COLUMNS and LINES unset: the width must come from the terminal, as it does for a person.
    run = shlex.join(["env", "-u", "COLUMNS", "-u", "LINES", sys.executable, "-m", "kvlease", *argv])
    shell = f"{run}; echo __exit=$?; exec sleep 300"
    screens: dict[int, str] = {}
    try:
        for w in widths:
            new = [*server, "new-session", "-d", "-s", f"w{w}", "-c", os.getcwd(), "-x", str(w), "-y", "60", shell]
            subprocess.run(new, check=True, timeout=30)
        deadline = time.monotonic() + 240
        while len(screens) < len(widths) and time.monotonic() < deadline:
            time.sleep(0.3)
            for w in widths:
                if w in screens:
                    continue
                capture = [*server, "capture-pane", "-p", "-J", "-t", f"w{w}", "-S", "-", "-E", "-"]
                screen = subprocess.run(capture, capture_output=True, text=True, check=True, timeout=30).stdout
                if "__exit=" in screen:
                    screens[w] = screen
    finally:
        subprocess.run([*server, "kill-server"], capture_output=True, timeout=30)
    return screens


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (.ci/run installs it)")
def test_the_table_in_a_real_terminal_shows_every_cell_of_the_json_at_80_100_120_columns() -> None:
    proc = _json_run()
    screens = _terminals((80, 100, 120), _ARGS)
    expected = _expected(proc)
    assert sorted(screens) == [80, 100, 120], "a terminal's run did not finish"
    for width, screen in screens.items():
        assert "__exit=0" in screen, screen
        text = screen[screen.index("seed 1:") :]  # after the progress bar
        too_wide = [ln for ln in text.splitlines() if len(ln.rstrip()) > width]
        assert not too_wide, (width, too_wide)
        assert "…" not in text
        assert read_tables(text) == expected, (width, text)


_WIDEST = {  # the default run's numbers (`kvlease sim`), and the widest the columns get
    "fixed-480s": ["25,676,868", "170,387", "0", "0", "0", "0", "0", "480.0", "480.0", "0"],
    "fixed-30s": ["1,437,042", "159,845", "896", "870", "0", "0", "870", "30.0", "30.1", "0"],
    "kvlease": ["1,530,828", "162,183", "37", "37", "37", "0", "0", "30.0", "30.1", "1,055,541"],
    "vllm-hb": ["999,444,834", "1,161,227", "38", "37", "0", "0", "37", "-", "-", "345,468,123"],
}


def test_every_width_from_30_columns_shows_every_cell_whole() -> None:
    for width in range(30, 161):
        buf = io.StringIO()
        console = Console(file=buf, width=width, force_terminal=True, color_system=None, legacy_windows=False)
        for renderable in terminal_table(console, list(_WIDEST.items()), "seed 1: 900 s simulated"):
            console.print(renderable)
        text = buf.getvalue()
        assert max(len(ln) for ln in text.splitlines()) <= width, (width, text)
        assert read_tables(text) == {p: dict(zip(_KEYS, c, strict=True)) for p, c in _WIDEST.items()}, (width, text)


def test_a_terminal_too_narrow_for_any_table_gets_every_number_on_lines_of_its_own() -> None:
    buf = io.StringIO()
    console = Console(file=buf, width=24, force_terminal=True, color_system=None, legacy_windows=False)
    for renderable in terminal_table(console, list(_WIDEST.items()), "seed 1"):
        console.print(renderable)
    lines = buf.getvalue().splitlines()
    assert max(len(ln) for ln in lines) <= 24 and "┏" not in buf.getvalue()
    for policy, cells in _WIDEST.items():
        block = lines[lines.index(policy) + 1 : lines.index(policy) + 1 + len(cells)]
        assert [ln.split()[-1] for ln in block] == cells, block
