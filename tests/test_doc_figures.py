"""Every figure a page shows comes from a command the page names, and the deterministic ones are
regenerated here and compared cell by cell: the simulator's tables (`kvlease sim ... --json`), the
model checker's state counts (`kvlease check ... --json`), and the numbers in the bullet list
under a simulator table. The rules: docs/testing.md, "How these pages are checked".

Rows whose page says they take more than CHEAP_S seconds, and the fault-campaign table, are
regenerated only with ``KVLEASE_DOC_FIGURES=all`` (several minutes); the rest cost about 20 s.
When a figure changes on purpose, rewrite the regenerated cells in place (same selection):

    .venv/bin/python tests/test_doc_figures.py --write [--all]
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from _docs import ROOT, Table, all_pages, rel

CHEAP_S = 10.0
FULL = os.environ.get("KVLEASE_DOC_FIGURES") == "all"

#: A simulator table's header -> the `kvlease sim --json` result field it shows.
SIM_FIELDS = {
    "dead blk·s": "dead_block_seconds",
    "peak blks": "peak_pinned_blocks",
    "false frees": "false_frees",
    "recomp": "recomputed",
    "lost": "leases_lost",
    "stale caught": "stale_caught",
    "stale used": "stale_used",
    "reclaim p50": "reclaim_p50",
    "reclaim max": "reclaim_max",
    "hb bytes": "heartbeat_bytes",
}
_NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
TIMES = "\u00d7"  # the multiplication sign of "17x" in prose


def kvlease_json(argv: tuple[str, ...]) -> Any:
    """`kvlease ARGV --json`, in this process (the CLI as a user types it, without the start-up)."""
    return _kvlease_json(tuple(argv))


@cache
def _kvlease_json(argv: tuple[str, ...]) -> Any:
    from click.testing import CliRunner

    from kvlease.cli import main

    result = CliRunner().invoke(main, [*argv, "--json"])
    assert result.exit_code in (0, 1), f"kvlease {shlex.join(argv)} --json exited {result.exit_code}:\n{result.output}"
    # stdout only: progress lines go to stderr (a click that mixes them in: skip to the JSON).
    out = result.stdout
    return json.loads(out[out.index("{") :] if not out.lstrip().startswith("{") else out)


def number(cell: str) -> float | None:
    """The number a cell shows ("1,530,828" -> 1530828.0; "-" -> None)."""
    s = cell.strip().strip("`*").replace(",", "")
    s = re.sub(r"\s*(s|ms|µs)$", "", s)
    if s in ("-", "—", ""):
        return None
    return float(s)


def decimals(cell: str) -> int:
    m = re.search(r"\.(\d+)", cell)
    return len(m.group(1)) if m else 0


def shown(value: float | None, like: str) -> str:
    """`value` written the way the cell `like` writes its number."""
    if value is None:
        return "-"
    d = decimals(like)
    text = f"{value:,.{d}f}" if ("," in like or abs(value) >= 10_000) else f"{value:.{d}f}"
    return text


def same(cell: str, value: float | None) -> bool:
    want = number(cell)
    if want is None or value is None:
        return want is None and value is None
    return round(value, decimals(cell)) == want


def sim_args(command: str) -> tuple[str, ...]:
    argv = shlex.split(command)
    assert argv[:2] == ["kvlease", "sim"], command
    out: list[str] = []
    it = iter(argv[2:])
    for a in it:
        if a == "--plot":
            next(it)
        elif a != "--markdown":
            out.append(a)
    return ("sim", *out)


@dataclass(frozen=True)
class Cell:
    """One regenerated figure: where it is and what it must say."""

    table: Table
    row: int
    col: int
    want: float | None

    @property
    def where(self) -> str:
        return f"{rel(self.table.page)}:{self.table.row_lines[self.row] + 1}"


# -- the figures ----------------------------------------------------------------------------------


def figure_tables(prefix: str) -> list[Table]:
    return [
        t
        for p in all_pages()
        for t in p.tables
        if t.marker is not None and t.marker.kind == "figure" and t.marker.arg.startswith(prefix)
    ]


def sim_cells(table: Table) -> Iterator[Cell]:
    assert table.marker is not None
    if "--campaign" in table.marker.arg:  # the campaign table: one command per row
        yield from campaign_cells(table)
        return
    data = kvlease_json(sim_args(table.marker.arg))
    results = {r["policy"]: r for r in data["results"]}
    assert table.header[0] == "policy", table.where
    for head in table.header[1:]:
        assert head in SIM_FIELDS, f"{table.where}: column {head!r} is not one `kvlease sim` prints"
    for r, row in enumerate(table.rows):
        assert row[0] in results, f"{table.where}: {row[0]!r} is not a policy of `{table.marker.arg}`"
        for c, head in enumerate(table.header[1:], start=1):
            yield Cell(table, r, c, results[row[0]][SIM_FIELDS[head]])


def campaign_cells(table: Table) -> Iterator[Cell]:
    seeds_col, failing_col = table.column("seeds"), table.column("failing seeds")
    assert seeds_col is not None and failing_col is not None, table.where
    for r, row in enumerate(table.rows):
        m = re.match(r"`([a-z-]+)`", row[0])
        seeds = int(number(row[seeds_col]) or 0)
        argv = ["sim", "--campaign", str(seeds), "--max-reports", "0"] + (["--inject-bug", m.group(1)] if m else [])
        yield Cell(table, r, failing_col, len(kvlease_json(tuple(argv))["failing_seeds"]))


def wall(row: list[str], table: Table) -> float:
    col = next((i for i, h in enumerate(table.header) if h.startswith("wall time")), None)
    assert col is not None, f"{table.where}: a check table needs a wall-time column (it decides what runs here)"
    return number(row[col]) or 0.0


def check_cells(table: Table, full: bool) -> Iterator[Cell]:
    from kvlease.check import BUG_HINTS

    states = table.column("states")
    if states is not None:  # one scope per row: `kvlease check ...`
        command = table.column("command")
        assert command is not None, table.where
        ci_sum, ci_total = 0.0, None
        for r, row in enumerate(table.rows):
            if "(CI)" in row[0]:
                ci_sum += number(row[states]) or 0
            if "total" in row[0].lower() and not row[command]:
                ci_total = r
                continue
            if not full and wall(row, table) > CHEAP_S:
                continue
            argv = shlex.split(row[command].strip("`"))
            assert argv[:2] == ["kvlease", "check"], f"{table.where}: {row[command]}"
            yield Cell(table, r, states, kvlease_json(tuple(argv[1:]))["states"])
        if ci_total is not None:
            yield Cell(table, ci_total, states, ci_sum)
        return
    # One bug per row: `kvlease check --inject-bug BUG` in the scope BUG_HINTS names.
    found, honest = table.column("states, bug"), table.column("states, honest core")
    actions = table.column("found in (actions)")
    assert found is not None and honest is not None and actions is not None, table.where
    for r, row in enumerate(table.rows):
        bug = row[0].strip("`")
        # Before the cost filter: a renamed bug in a slow row must fail here too, not only with
        # KVLEASE_DOC_FIGURES=all.
        assert bug in BUG_HINTS, f"{table.where}: {bug!r} is not a `kvlease check --inject-bug` name in BUG_HINTS"
        if not full and wall(row, table) > CHEAP_S:
            continue
        scope = tuple(shlex.split(BUG_HINTS[bug]))
        bad = kvlease_json(("check", *scope, "--inject-bug", bug))
        good = kvlease_json(("check", *scope))
        assert bad["violations"] == 1 and good["violations"] == 0, f"{table.where}: {bug}"
        yield Cell(table, r, found, bad["states"])
        yield Cell(table, r, honest, good["states"])
        yield Cell(table, r, actions, len(bad["violation"]["schedule"]))


def cells(full: bool = FULL) -> Iterator[Cell]:
    for t in figure_tables("kvlease sim"):
        if full or "--campaign" not in t.marker.arg:  # type: ignore[union-attr]
            yield from sim_cells(t)
    for t in figure_tables("kvlease check"):
        yield from check_cells(t, full)


def _table_ids() -> list[tuple[str, Table]]:
    return [(t.where, t) for t in figure_tables("kvlease ")]


@pytest.mark.parametrize("table", [t for _, t in _table_ids()], ids=[i for i, _ in _table_ids()])
def test_figure_table_is_what_its_command_prints(table: Table) -> None:
    assert table.marker is not None
    if "--campaign" in table.marker.arg and not FULL:
        pytest.skip("the fault campaign takes minutes: KVLEASE_DOC_FIGURES=all")
    gen: Callable[[], Iterator[Cell]] = (
        (lambda: sim_cells(table)) if table.marker.arg.startswith("kvlease sim") else (lambda: check_cells(table, FULL))
    )
    checked, wrong = 0, []
    for cell in gen():
        checked += 1
        text = table.rows[cell.row][cell.col]
        if not same(text, cell.want):
            wrong.append(
                f"{cell.where}: {table.header[cell.col]!r} of {table.rows[cell.row][0]!r} shows {text}, "
                f"`{table.marker.arg}` gives {shown(cell.want, text)}"
            )
    assert checked, f"{table.where}: nothing regenerated"
    assert not wrong, (
        "the page disagrees with the command it names (fix the page, or rewrite the cells with "
        "`python tests/test_doc_figures.py --write`):\n" + "\n".join(wrong)
    )


def wrong_cells(table: Table) -> list[str]:
    """The cells of a simulator table that disagree with the command its marker names."""
    return [cell.where for cell in sim_cells(table) if not same(table.rows[cell.row][cell.col], cell.want)]


def test_a_figure_edited_by_hand_fails_the_check() -> None:
    """The README's simulator table with one number changed by hand (as a person editing the page
    would) is caught, at that cell and nowhere else; the page as it is passes."""
    (readme,) = [t for t in figure_tables("kvlease sim") if rel(t.page) == "README.md"]
    assert wrong_cells(readme) == []
    edits = 0
    for r, row in enumerate(readme.rows):
        for c, text in enumerate(row[1:], start=1):
            if _is_number(text):
                edited = [list(x) for x in readme.rows]
                edited[r][c] = shown((number(text) or 0) + 1, text)
                hand = dataclasses.replace(readme, rows=edited)
                assert wrong_cells(hand) == [f"README.md:{readme.row_lines[r] + 1}"], (r, c, text)
                edits += 1
    assert edits >= 4 * 5, f"the README's simulator table has {edits} numbers"


def allowed_numbers(table: Table) -> set[str]:
    """Numbers the bullets under a figure table may state: its cells' numbers, the section's
    text above it (the scenario), and rounded ratios of two cells of one column (``17`` and the multiplication sign)."""
    out = {_norm(n) for row in table.rows for cell in row for n in _NUMBER.findall(cell)}
    out |= {_norm(n) for n in _NUMBER.findall(table.before)}
    for c in range(1, len(table.header)):
        values = [v for row in table.rows if (v := number(row[c]) if _is_number(row[c]) else None)]
        out |= {f"{round(a / b)}{TIMES}" for a in values for b in values if b > 0 and a > b}
    return out


def _is_number(cell: str) -> bool:
    return bool(re.fullmatch(r"[\d,]+(\.\d+)?", cell.strip()))


def _norm(n: str) -> str:
    n = n.rstrip(",.").replace(",", "")
    return n[:-2] if n.endswith(".0") else n


def bullet_numbers(table: Table) -> list[str]:
    text = re.sub(r"`[^`]*`", "", " ".join(table.after))
    return [
        _norm(m.group(1)) + (TIMES if m.group(2) else "")
        for m in re.finditer(r"(?<![\w.-])(\d[\d,]*(?:\.\d+)?)(" + TIMES + r")?(?![\w])", text)
    ]


SIM_TABLES = [t for t in figure_tables("kvlease sim") if "--campaign" not in t.marker.arg]  # type: ignore[union-attr]


@pytest.mark.parametrize("table", SIM_TABLES, ids=[t.where for t in SIM_TABLES])
def test_numbers_under_a_simulator_table_are_the_tables(table: Table) -> None:
    assert table.after, f"{table.where}: say what the table shows in a bullet list right under it"
    allowed = allowed_numbers(table)
    stray = [n for n in bullet_numbers(table) if n not in allowed]
    assert not stray, (
        f"{table.where}: the bullets under the table state {stray}, which are not numbers of the table "
        "(nor of the scenario above it, nor a rounded ratio of two of its cells)"
    )


# -- every figure names its command ---------------------------------------------------------------


def _command_exists(command: str) -> bool:
    from click.testing import CliRunner

    from kvlease.cli import main

    for part in command.split(";"):
        argv = shlex.split(part.strip())
        if argv and argv[0].endswith("python"):
            if not (ROOT / argv[1]).is_file():
                return False
        elif argv and argv[0].endswith("kvlease"):
            sub = [a for a in argv[1:] if not a.isupper() and a not in ("N", "[--inject-bug", "BUG]")]
            if CliRunner().invoke(main, [*sub[:1], "--help"]).exit_code != 0:
                return False
        else:
            return False
    return True


def _figures() -> list[tuple[str, str, str, str]]:
    """(where, kind, command, visible text of the page) of every marked figure."""
    out = []
    for page in all_pages():
        text = page.visible_text()
        elements: list[tuple[str, Any]] = [(t.where, t.marker) for t in page.tables]
        elements += [(b.where, b.marker) for b in page.blocks]
        elements += [(f"{rel(i.page)}:{i.line}", i.marker) for i in page.images]
        for where, marker in elements:
            if marker is not None and marker.kind in ("figure", "measured"):
                out.append((where, marker.kind, marker.arg, text))
    return out


@pytest.mark.parametrize("figure", _figures(), ids=[f[0] for f in _figures()])
def test_every_figure_names_a_command_that_exists(figure: tuple[str, str, str, str]) -> None:
    where, _kind, command, text = figure
    assert command, f"{where}: the marker names no command"
    for part in command.split(";"):
        assert f"`{part.strip()}" in text, f"{where}: the page's text does not name `{part.strip()}` (the marker does)"
    assert _command_exists(command), f"{where}: `{command}` is not a command of this checkout"


def test_every_table_of_figures_is_marked() -> None:
    unmarked = [
        t.where
        for p in all_pages()
        for t in p.tables
        if any(t.right_aligned) and (t.marker is None or t.marker.kind not in ("figure", "measured"))
    ]
    assert not unmarked, (
        f"tables of figures without a <!-- figure: CMD --> or <!-- measured: CMD --> marker: {unmarked}"
    )


def test_every_image_is_a_marked_figure_that_exists() -> None:
    for page in all_pages():
        for image in page.images:
            assert image.marker is not None and image.marker.kind in ("figure", "measured"), (
                f"{rel(page.path)}:{image.line}: an image needs a <!-- figure: CMD --> marker"
            )
            name = image.target.rsplit("/", 1)[-1]
            assert (ROOT / "docs" / "figures" / name).is_file(), f"{rel(page.path)}:{image.line}: {name} missing"


# -- rewriting ------------------------------------------------------------------------------------


def write(full: bool) -> int:
    """Rewrite every regenerated cell that disagrees; return how many changed."""
    changed = 0
    edits: dict[Path, list[str]] = {}
    for cell in cells(full):
        t = cell.table
        text = t.rows[cell.row][cell.col]
        if same(text, cell.want):
            continue
        lines = edits.setdefault(t.page, t.page.read_text().splitlines())
        i = t.row_lines[cell.row]
        parts = lines[i].split("|")
        # parts[0] is before the first pipe: column c is parts[c + 1].
        parts[cell.col + 1] = f" {shown(cell.want, text)} "
        lines[i] = "|".join(parts)
        t.rows[cell.row][cell.col] = shown(cell.want, text)
        print(f"{cell.where}: {text} -> {shown(cell.want, text)}")
        changed += 1
    for page, lines in edits.items():
        page.write_text("\n".join(lines) + "\n")
    return changed


if __name__ == "__main__":
    if "--write" not in sys.argv:
        sys.exit(
            "usage: python tests/test_doc_figures.py --write [--all]   (the tests: pytest tests/test_doc_figures.py)"
        )
    n = write(full="--all" in sys.argv or FULL)
    print(f"{n} cell(s) rewritten; check the bullets under each table too (pytest tests/test_doc_figures.py)")
