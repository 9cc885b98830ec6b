"""The conformance runner: replays the language-neutral vectors of spec/vectors/ against an
implementation (the in-process core, or any engine behind the line-based JSON driver protocol).

Pure, like the rest of the core: vectors come in as parsed JSON values and responses come back
from an object's ``call``; reading files and running subprocesses is the CLI's job
(`kvlease conformance`).
"""

from ._canonical import (
    FLOAT_TOLERANCE,
    INFORMATIVE_KEYS,
    JSON,
    JSONDict,
    compare,
    message_to_json,
    output_to_json,
    strip_informative,
)
from ._core import CoreImplementation, VectorFormatError
from ._runner import VECTOR_FORMAT, Implementation, Mismatch, VectorResult, run_vector, run_vectors

__all__ = [
    "FLOAT_TOLERANCE",
    "INFORMATIVE_KEYS",
    "JSON",
    "VECTOR_FORMAT",
    "CoreImplementation",
    "Implementation",
    "JSONDict",
    "Mismatch",
    "VectorFormatError",
    "VectorResult",
    "compare",
    "message_to_json",
    "output_to_json",
    "run_vector",
    "run_vectors",
    "strip_informative",
]
