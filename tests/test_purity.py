"""The core is sans-IO: importing it loads no clock, socket, thread, event loop, process, ZMQ,
NIXL or torch module, and no core source file imports one.

Runtime check: a fresh interpreter imports the core's allowed third-party dependencies first
(attrs itself loads `threading`), records `sys.modules`, imports every core module, and reports
what appeared. Static check: an AST scan of every core source file.
"""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import kvlease

FORBIDDEN = ("time", "socket", "threading", "asyncio", "selectors", "subprocess", "zmq", "nixl", "torch")
#: Parts of the package that are the application shell or may do I/O by design.
SHELL = ("kvlease.cli", "kvlease.__main__")
PKG_DIR = Path(kvlease.__file__).parent


def _core_modules() -> list[str]:
    names = ["kvlease"]
    for info in pkgutil.walk_packages([str(PKG_DIR)], prefix="kvlease."):
        if not any(info.name == s or info.name.startswith(s + ".") for s in SHELL):
            names.append(info.name)
    return sorted(names)


def _is_forbidden(name: str) -> bool:
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN)


def test_core_module_list_is_complete() -> None:
    mods = _core_modules()
    for expected in ("kvlease._pinner", "kvlease._accessor", "kvlease._codec", "kvlease._layout", "kvlease.testing"):
        assert expected in mods
    assert not any(m.startswith("kvlease.cli") for m in mods)


_PROBE = """
import json, sys
import attrs, msgpack  # the core's allowed dependencies: their own imports are not ours
before = set(sys.modules)
import importlib
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def test_importing_the_core_loads_no_io_module() -> None:
    mods = _core_modules()
    res = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(mods)], capture_output=True, text=True, check=True, timeout=120
    )
    added = json.loads(res.stdout)
    assert "kvlease._pinner" in added  # the probe really imported the core
    bad = [m for m in added if _is_forbidden(m)]
    assert not bad, f"importing the core loaded I/O modules: {bad}"


def test_probe_can_fail() -> None:
    """The same probe flags a module that does import a forbidden one."""
    res = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(["kvlease", "selectors"])],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert any(_is_forbidden(m) for m in json.loads(res.stdout))


def _imports(tree: ast.AST) -> list[str]:
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append(node.args[0].value)
    return found


def test_no_core_source_imports_an_io_module() -> None:
    offenders: list[str] = []
    files = 0
    for path in sorted(PKG_DIR.rglob("*.py")):
        rel = path.relative_to(PKG_DIR.parent)
        if rel.parts[:2] == ("kvlease", "cli") or rel.parts == ("kvlease", "__main__.py"):
            continue
        files += 1
        for name in _imports(ast.parse(path.read_text(), str(path))):
            if _is_forbidden(name):
                offenders.append(f"{rel}: {name}")
    assert files >= 10
    assert not offenders, f"core files import I/O modules: {offenders}"


def test_static_scan_can_fail() -> None:
    src = "import time\nfrom socket import socket\nimport importlib\nimportlib.import_module('zmq')\n"
    assert [n for n in _imports(ast.parse(src)) if _is_forbidden(n)] == ["time", "socket", "zmq"]
