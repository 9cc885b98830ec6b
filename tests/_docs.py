"""The documentation as data: the fenced blocks, tables, images and links of README.md and of
every page under docs/, each with the HTML-comment marker that says what it is.

Read by tests/test_readme.py, tests/test_docs.py and tests/test_doc_figures.py. The rules the
markers express are written down for authors in docs/testing.md ("How these pages are
checked"). A marker is a one-line comment directly above its element (blank lines may sit
between): ``<!-- run -->``, ``<!-- run: exit 1, timings vary -->``, ``<!-- not run: REASON -->``,
``<!-- figure: CMD -->``, ``<!-- measured: CMD -->``; ``<!-- slot: ... -->`` holds a link to a page
that does not exist yet and is not a link. This module only parses: it runs nothing.
"""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

MARKER_KINDS = ("not run", "run", "figure", "measured", "slot")
_MARKER = re.compile(r"^\s*<!--\s*(not run|run|figure|measured|slot)\s*(?::\s*(.*?))?\s*-->\s*$")
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
_TABLE_SEP = re.compile(r"^\s*\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$")
_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)[^)]*\)")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)[^)]*\)")
_REF_DEF_ML = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.M)
_INLINE_CODE = re.compile(r"`+[^`]*`+")


def pages() -> list[Path]:
    """Every page the rules apply to: the README and each Markdown file under docs/."""
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def repository_url() -> str:
    """``[project.urls] Repository`` of pyproject.toml, without a trailing slash."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        url: str = tomllib.load(f)["project"]["urls"]["Repository"]
    return url.rstrip("/")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@dataclass(frozen=True)
class Marker:
    kind: str  # one of MARKER_KINDS
    arg: str  # what follows the colon ("" when nothing does)


@dataclass
class Block:
    """A fenced code block. `output` is the ```text block that shows what this one prints."""

    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    body: str
    marker: Marker | None
    output: Block | None = None
    is_output: bool = False

    @property
    def where(self) -> str:
        return f"{rel(self.page)}:{self.line}"

    def run_options(self) -> tuple[int, bool]:
        """(expected exit status, durations vary) of a ``run`` marker."""
        exit_status, timings = 0, False
        assert self.marker is not None
        for option in filter(None, (o.strip() for o in self.marker.arg.split(","))):
            if m := re.fullmatch(r"exit (\d+)", option):
                exit_status = int(m.group(1))
            elif option == "timings vary":
                timings = True
            else:
                raise AssertionError(f"{self.where}: unknown run option {option!r} (exit N, timings vary)")
        return exit_status, timings


@dataclass
class Table:
    page: Path
    line: int  # 1-based line of the header row
    header: list[str]
    right_aligned: list[bool]
    rows: list[list[str]]
    row_lines: list[int]  # 0-based index into the page's lines of each row
    marker: Marker | None
    after: list[str] = field(default_factory=list)  # the bullet list right under the table
    before: str = ""  # the section's text from its heading to the table

    @property
    def where(self) -> str:
        return f"{rel(self.page)}:{self.line}"

    def column(self, name: str) -> int | None:
        for i, h in enumerate(self.header):
            if h.strip() == name:
                return i
        return None


@dataclass(frozen=True)
class Image:
    page: Path
    line: int
    target: str
    marker: Marker | None


@dataclass
class Page:
    path: Path
    lines: list[str]
    blocks: list[Block]
    tables: list[Table]
    images: list[Image]
    links: list[tuple[int, str]]  # (1-based line, target) of every link and image
    headings: list[str] = field(default_factory=list)

    def anchors(self) -> set[str]:
        """The fragment ids GitHub gives the page's headings."""
        out = set()
        for h in self.headings:
            s = re.sub(r"[^\w\- ]", "", h.strip().lower().replace("`", ""))
            out.add(s.replace(" ", "-"))
        return out

    def visible_text(self) -> str:
        """The page without HTML comments (what a reader sees, code included)."""
        return _COMMENT.sub("", "\n".join(self.lines))


def split_row(line: str) -> list[str]:
    s = line.strip()
    if s.startswith("|"):
        s = s[1:]
    if s.endswith("|"):
        s = s[:-1]
    # A pipe inside inline code belongs to the cell (no table here escapes one otherwise).
    cells, depth, cur = [], False, ""
    for ch in s:
        if ch == "`":
            depth = not depth
        if ch == "|" and not depth:
            cells.append(cur.strip())
            cur = ""
        else:
            cur += ch
    cells.append(cur.strip())
    return cells


def _marker(line: str) -> Marker | None:
    m = _MARKER.match(line)
    return Marker(m.group(1), (m.group(2) or "").strip()) if m else None


@cache
def parse(path: Path) -> Page:
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    tables: list[Table] = []
    images: list[Image] = []
    links: list[tuple[int, str]] = []
    headings: list[str] = []
    pending: Marker | None = None
    section_start = 0
    # What separates the last code block from the next element: None when anything but blank
    # lines or one line ending in ":" came between (so a following ```text block is not its output).
    last_block: Block | None = None
    gap_lines = 0
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line)
        if fence:
            indent, ticks, lang = fence.groups()
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith(ticks[0] * len(ticks)):
                j += 1
            body = "\n".join(ln[len(indent) :] if ln.startswith(indent) else ln for ln in lines[i + 1 : j])
            block = Block(path, i + 1, lang or "", body + ("\n" if body else ""), pending)
            if (
                lang == "text"
                and pending is None
                and last_block is not None
                and last_block.lang in ("python", "bash")
                and gap_lines <= 1
            ):
                last_block.output = block
                block.is_output = True
            blocks.append(block)
            last_block, gap_lines, pending = block, 0, None
            i = j + 1
            continue
        stripped = line.strip()
        marker = _marker(line)
        if marker is not None:
            if marker.kind != "slot":
                pending = marker
            i += 1
            continue
        if not stripped or _COMMENT.fullmatch(stripped):
            i += 1
            continue
        if stripped.startswith("#"):
            section_start = i
            headings.append(stripped.lstrip("#").strip())
        code_free = _INLINE_CODE.sub("", _COMMENT.sub("", line))
        for m in _IMAGE.finditer(code_free):
            images.append(Image(path, i + 1, m.group(1), pending))
        if stripped.startswith("|") and i + 1 < len(lines) and _TABLE_SEP.match(lines[i + 1]):
            header = split_row(line)
            seps = split_row(lines[i + 1])
            j = i + 2
            rows, row_lines = [], []
            while j < len(lines) and lines[j].strip().startswith("|"):
                rows.append(split_row(lines[j]))
                row_lines.append(j)
                j += 1
            k = j
            while k < len(lines) and not lines[k].strip():
                k += 1
            after: list[str] = []
            while k < len(lines) and (lines[k].startswith("- ") or (after and lines[k].startswith("  "))):
                after.append(lines[k])
                k += 1
            before = "\n".join(lines[section_start:i])
            tables.append(
                Table(path, i + 1, header, [s.endswith(":") for s in seps], rows, row_lines, pending, after, before)
            )
            pending, last_block = None, None
            i = j
            continue
        pending = None
        if last_block is not None:
            gap_lines += 1 if stripped.endswith(":") else 2
        i += 1
    links = _links(lines, blocks)
    return Page(path, lines, blocks, tables, images, links, headings)


def _links(lines: list[str], blocks: list[Block]) -> list[tuple[int, str]]:
    """(line, target) of every link, image and reference definition outside code and comments;
    a link's text may span lines."""
    prose = list(lines)
    for b in blocks:  # blank the fenced blocks, fences included, keeping line numbers
        for k in range(b.line - 1, b.line + b.body.count("\n") + 1):
            if k < len(prose):
                prose[k] = ""
    text = "\n".join(prose)
    text = _COMMENT.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    text = _INLINE_CODE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    found = []
    for rx in (_IMAGE, _LINK, _REF_DEF_ML):
        for m in rx.finditer(text):
            found.append((text.count("\n", 0, m.start()) + 1, m.group(1)))
    return sorted(found)


def all_pages() -> list[Page]:
    return [parse(p) for p in pages()]


#: Environment for a block that runs a shell command: ``kvlease`` is this checkout's.
def shim_dir(tmp: Path) -> Path:
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = bin_dir / "kvlease"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m kvlease "$@"\n')
    shim.chmod(0o755)
    return bin_dir


def run_python(block: Block, tmp: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    script = tmp / f"{block.page.stem}_{block.line}.py"
    script.write_text(block.body)
    return subprocess.run(
        [sys.executable, str(script)], cwd=tmp, capture_output=True, text=True, timeout=timeout, check=False
    )


_DURATION = re.compile(r"\d+(?:\.\d+)?\s?(?:s|ms|µs|us)\b|\(\d+(?:\.\d+)? states/s\)")


def normalize_output(text: str, *, timings: bool) -> str:
    lines = [ln.rstrip() for ln in text.strip("\n").splitlines()]
    out = "\n".join(lines)
    return _DURATION.sub("<duration>", out) if timings else out


def check_block_output(block: Block, stdout: str, *, timings: bool = False) -> None:
    """The block printed what the page shows under it (if it shows anything)."""
    if block.output is None:
        return
    want = normalize_output(block.output.body, timings=timings)
    got = normalize_output(stdout, timings=timings)
    if want != got:
        diff = "\n".join(difflib.unified_diff(want.splitlines(), got.splitlines(), "page", "printed", lineterm=""))
        raise AssertionError(f"{block.where}: the block prints something else than the page shows:\n{diff}")


def run_block(block: Block, tmp_path: Path) -> None:
    if block.lang == "python":
        proc = run_python(block, tmp_path)
        assert proc.returncode == 0, f"{block.where} failed:\n{proc.stderr[-3000:]}"
        check_block_output(block, proc.stdout)
        return
    status, timings = block.run_options()
    path = [str(shim_dir(tmp_path)), str(Path(sys.executable).parent), os.environ.get("PATH", "")]
    env = dict(os.environ, PATH=os.pathsep.join(path))
    proc = subprocess.run(
        ["bash", "-e", "-c", block.body], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == status, (
        f"{block.where} exited {proc.returncode}, the page says {status}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    )
    check_block_output(block, proc.stdout, timings=timings)
