"""The committed conformance vectors are exactly what tools/generate_vectors.py produces from the
core today (it also asserts, scenario by scenario, the property each vector exists to show), so
a core change that alters a vector's meaning fails here, not silently in review."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_vectors_are_what_the_generator_makes() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "generate_vectors.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    n = len(list((ROOT / "spec" / "vectors").glob("*.json")))
    assert f"checked {n} vectors" in proc.stdout + proc.stderr
