"""The reference conformance driver: the Python core behind the line-based JSON protocol.

    kvlease-conformance-driver        (or: python -m kvlease.cli._conformance_driver)

Reads one JSON request per line on stdin and writes one JSON response per line on stdout
(spec/vectors/README.md), by handing each request to `kvlease.conformance.CoreImplementation`.
An engine in another language implements the same loop around its own core. This module is
application shell (it does I/O); it holds no protocol logic.
"""

from __future__ import annotations

import json
import sys
from typing import TextIO

from kvlease.conformance import CoreImplementation, JSONDict, VectorFormatError


def serve(stdin: TextIO, stdout: TextIO) -> int:
    impl = CoreImplementation()
    for line in stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            if not isinstance(request, dict):
                raise VectorFormatError("a request must be a JSON object")
            response: JSONDict = impl.call(request)
        except (ValueError, VectorFormatError) as exc:  # json.JSONDecodeError is a ValueError
            response = {"ok": False, "error": {"class": "DriverError", "error_message": str(exc)}}
        stdout.write(json.dumps(response, allow_nan=False) + "\n")
        stdout.flush()
    return 0


def main() -> None:
    """The ``kvlease-conformance-driver`` console script."""
    sys.exit(serve(sys.stdin, sys.stdout))


if __name__ == "__main__":
    main()
