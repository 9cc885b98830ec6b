"""The real-serving suites' fleets (tools/vllm_pd.py): one started per module or class, its
servers' logs removed afterwards unless ``KVLEASE_KEEP_LOGS`` is set."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import vllm_pd as pd

__all__ = ["LEASE", "pd", "started_fleet"]

#: The lease of every server (``kv_lease_duration``, s): short, so the scenarios are quick, long
#: enough for a loaded 2-core machine: a decoder busy decoding took 10 s to take a request in
#: from the router at a load average of 30 (its tracking, hence its heartbeats, start then).
LEASE = float(os.environ.get("KVLEASE_SERVE_LEASE", "20"))


def started_fleet(mode: str = "pull") -> Iterator[pd.Fleet]:
    """A `pd.Fleet` of `mode`, started, for a fixture to yield from (skipped without vLLM's
    environment, failed under CI)."""
    problem = pd.missing_environment()
    if problem is not None:
        if os.environ.get("CI"):
            pytest.fail(problem)
        pytest.skip(problem)
    workdir = Path(tempfile.mkdtemp(prefix=f"kvlease-serve-{mode}-"))
    f = pd.Fleet(workdir, LEASE, mode=mode)
    try:
        f.start()
        print(
            f"\n{mode} fleet healthy after {f.startup_s:.0f} s; warm-up {f.warmup}; decode {f.decode_rate:.0f} tokens/s"
        )
        yield f
    finally:
        f.stop()
        if os.environ.get("KVLEASE_KEEP_LOGS"):
            print(f"\nserver logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
