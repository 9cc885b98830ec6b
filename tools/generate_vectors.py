#!/usr/bin/env python3
"""Generate the conformance vectors in spec/vectors/ (run by hand, commit the JSON).

    .venv/bin/python tools/generate_vectors.py [--check]

Each scenario drives the Python core (through `kvlease.conformance.CoreImplementation`, the
same object the reference driver wraps) along a scripted schedule of real time, converts every
call to the endpoint's own clock (each endpoint has its own random-looking epoch), and records
the responses as the expectation. The scripts also *assert* the protocol properties the
scenario exists to show (a free at the right instant, no free while heartbeats flow, ...), so
a core change that alters the meaning of a vector fails here instead of silently rewriting
the normative expectation. The recorded JSON was read by a human; regenerate only on purpose
and review the diff. `--check` regenerates in memory and fails if any file would change.

The scenarios live in tools/vectors/, one module per vector family, over the recording harness
of tools/vectors/_common.py; this script only renders them and writes or checks the files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vectors import SCENARIOS, codec_cases

from kvlease.conformance import JSONDict

HERE = Path(__file__).resolve().parent.parent / "spec" / "vectors"


def render(vector: JSONDict) -> str:
    return json.dumps(vector, indent=1) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if a committed vector would change")
    ns = ap.parse_args()
    vectors = [s().vector() for s in SCENARIOS] + [codec_cases()]
    stale = []
    for v in vectors:
        path = HERE / f"{v['name']}.json"
        text = render(v)
        if ns.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
    if stale:
        print("out of date:", ", ".join(stale), file=sys.stderr)
        return 1
    print(f"{'checked' if ns.check else 'wrote'} {len(vectors)} vectors in {HERE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
