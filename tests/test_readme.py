"""The README is the page an operator reads first, and the package's description on an index
page: it stays short, says what they need in the order they need it, its examples run and print
what it shows, and every link and image is an absolute URL into this repository that resolves.
(The pages under docs/: tests/test_docs.py; the figures: tests/test_doc_figures.py.)
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from _docs import README, ROOT, Block, parse, repository_url, run_block

PAGE = parse(README)
PYTHON = [b for b in PAGE.blocks if b.lang == "python"]

#: About five minutes of reading; the target is 150 lines, this is where a test says no.
MAX_LINES = 170
SECTIONS = [
    "Why",
    "Install",
    "Enable it in vLLM",
    "Enable it in SGLang",
    "What to watch",
    "The two commands",
    "The core in one page",
    "Documentation",
]


def test_the_readme_reads_in_five_minutes() -> None:
    assert len(PAGE.lines) <= MAX_LINES, f"README.md has {len(PAGE.lines)} lines: move detail to docs/"


def test_the_sections_an_operator_needs_come_in_order() -> None:
    headings = [ln[3:] for ln in PAGE.lines if ln.startswith("## ")]
    positions = []
    for want in SECTIONS:
        found = [i for i, h in enumerate(headings) if h.startswith(want)]
        assert found, f"README.md has no '## {want}...' section (has: {headings})"
        positions.append(found[0])
    assert positions == sorted(positions), f"README.md's sections are out of order: {headings}"
    # Turning it on is on the first screens, not after the internals.
    enable = next(i for i, ln in enumerate(PAGE.lines) if ln.startswith("## Enable it in vLLM"))
    assert enable < 80, f"'Enable it in vLLM' starts at line {enable + 1}"


def test_the_two_commands_are_the_ones_ci_runs() -> None:
    text = "\n".join(PAGE.lines)
    assert re.search(r"^bash dev\.sh demo\b", text, flags=re.M)
    assert re.search(r"^bash dev\.sh test\b", text, flags=re.M)
    assert re.search(r"^bash dev\.sh test$", (ROOT / ".ci" / "run").read_text(), flags=re.M)


def test_every_link_and_image_is_absolute_and_resolves() -> None:
    repo = repository_url()
    assert PAGE.links, "README.md links nothing"
    assert PAGE.images, "README.md shows no figure"
    for line, target in PAGE.links:
        where = f"README.md:{line}: {target}"
        assert re.match(r"https?://", target), f"{where} is relative: it does not resolve on a package index page"
        if not target.startswith(repo + "/"):
            continue  # another site's page
        m = re.match(re.escape(repo) + r"/(blob|raw|tree)/main/([^#?]+)", target)
        assert m, f"{where}: use {repo}/blob/main/PATH (a page) or {repo}/raw/main/PATH (an image)"
        assert (ROOT / m.group(2)).exists(), f"{where}: {m.group(2)} is not a file of this repository"
    for image in PAGE.images:
        assert f"{repo}/raw/main/" in image.target, f"README.md:{image.line}: an image is served from /raw/main/"


def test_the_wheel_the_readme_installs_is_this_version() -> None:
    with (ROOT / "pyproject.toml").open("rb") as f:
        version = tomllib.load(f)["project"]["version"]
    wheels = re.findall(r"dist/(kvlease-[^\s'\[]+\.whl)", "\n".join(PAGE.lines))
    assert wheels and all(w == f"kvlease-{version}-py3-none-any.whl" for w in wheels), wheels


def test_the_readme_has_a_core_example_that_prints() -> None:
    assert PYTHON, "README.md should show the core API in a ```python block"
    assert all(b.output is not None and b.output.body.strip() for b in PYTHON), (
        "each README example shows what it prints in a ```text block right under it"
    )


@pytest.mark.parametrize("block", PYTHON, ids=lambda b: b.where)
def test_readme_example_runs_and_prints_what_it_shows(block: Block, tmp_path: Path) -> None:
    run_block(block, tmp_path)
