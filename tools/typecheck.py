"""`mypy --strict` over the package as it installs, and over tests/ and tools/, in one run.

    .venv/bin/python tools/typecheck.py [MYPY OPTIONS...]

setuptools installs transports/ and adapters/ as `kvlease.transports` and `kvlease.adapters`
(`package-dir` in pyproject.toml). The editable install serves that mapping through an import
hook, which mypy cannot follow (it searches paths, it does not run finders): plain `mypy` checks
transports/ as a top-level `transports` and cannot resolve `kvlease.transports` where the tests
(and kvlease/cli/) import it. So this script builds the installed layout as a tree of symbolic
links under build/typecheck/tree/ (from `package-dir`, so it follows the packaging), runs mypy
on that tree and tests/ together, and prints mypy's report with the source paths (a file under
the tree is named by the file it links to). The exit status is mypy's.

The tree is rebuilt on every run (cheap: a few dozen links), so new or removed modules are
seen; mypy's cache for this layout lives in build/typecheck/cache/, apart from the one plain
`mypy` keeps in .mypy_cache/.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "build" / "typecheck"
TREE = OUT / "tree"
CACHE = OUT / "cache"
SOURCES_BESIDE_THE_PACKAGE = ("tests", "tools")


def package_dirs() -> dict[str, Path]:
    """Each package named in pyproject's `package-dir`, with the directory it installs from."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    if "" in mapping:
        sys.exit("tools/typecheck.py: a root package-dir ('' = ...) is not supported")
    return {name: ROOT / where for name, where in mapping.items()}


def build_tree(dirs: dict[str, Path]) -> list[tuple[Path, Path]]:
    """Link every mapped package into TREE at its installed place; return (link, target) pairs.

    A package that holds another mapped package (`kvlease` holds `kvlease.transports`) becomes a
    real directory of links to its entries; any other is one link to its directory."""
    if TREE.exists():
        shutil.rmtree(TREE)
    TREE.mkdir(parents=True)
    links: list[tuple[Path, Path]] = []
    for name in sorted(dirs, key=lambda n: n.count(".")):
        src, dst = dirs[name], TREE.joinpath(*name.split("."))
        if not (src / "__init__.py").is_file():
            sys.exit(f"tools/typecheck.py: package-dir maps {name} to {src}, which has no __init__.py")
        nested = {n.rsplit(".", 1)[1] for n in dirs if n.startswith(name + ".") and n.count(".") == name.count(".") + 1}
        if not nested:
            dst.symlink_to(src, target_is_directory=True)
            links.append((dst, src))
            continue
        dst.mkdir()
        for entry in sorted(src.iterdir()):
            if entry.name == "__pycache__" or entry.name in nested:
                continue
            (dst / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
            links.append((dst / entry.name, entry))
    return links


def _shown(p: Path) -> str:
    """`p` as mypy prints it (relative to the root), a directory with its trailing separator."""
    return os.path.relpath(p, ROOT) + (os.sep if p.is_dir() else "")


def main(argv: list[str]) -> int:
    dirs = package_dirs()
    links = build_tree(dirs)
    tops = sorted({name.split(".")[0] for name in dirs})
    sources = [os.path.relpath(TREE / top, ROOT) for top in tops] + list(SOURCES_BESIDE_THE_PACKAGE)
    cmd = [sys.executable, "-m", "mypy", "--strict", "--cache-dir", os.path.relpath(CACHE, ROOT), *argv, *sources]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    # Longest first, so that a file under a linked directory maps through its own link.
    back = sorted(
        ((_shown(link), _shown(target)) for link, target in links),
        key=lambda lt: len(lt[0]),
        reverse=True,
    )
    for line in proc.stdout.splitlines():
        for link, target in back:
            if link in line:
                line = line.replace(link, target)
                break
        print(line)
    sys.stderr.write(proc.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
