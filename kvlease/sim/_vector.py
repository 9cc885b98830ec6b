"""Turn a recorded simulation into a conformance-vector candidate (spec/vectors/README.md).

The simulator can record every call it makes on a core object (`Cluster(record=True)`). This
module keeps the calls addressed to a chosen set of engines (the violating lease's pinner and
accessor engines), up to the violation, and fills each step's ``expect`` by replaying the steps
against the in-process reference core (`kvlease.conformance.CoreImplementation`). The result is a
trace vector: it passes on the reference core by construction, and it is the regression test
for the scenario — an implementation that behaves like the broken one fails it where the two
disagree. A human reviews a candidate before it joins spec/vectors/.

Pure: builds a JSON value, opens no file.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from .._config import LeaseConfig
from ..conformance import VECTOR_FORMAT, CoreImplementation

__all__ = ["build_vector"]


def build_vector(
    name: str,
    description: str,
    config: LeaseConfig,
    endpoints: dict[str, dict[str, Any]],
    recorded: Iterable[dict[str, Any]],
    *,
    engines: Iterable[str],
    until: float,
) -> dict[str, Any]:
    keep = set(engines)
    eps = {n: dict(spec) for n, spec in endpoints.items() if spec["engine_id"] in keep}
    steps: list[dict[str, Any]] = []
    for step in recorded:
        if step["t"] > until + 1e-9:
            break
        if step["endpoint"] in eps:
            out = {k: v for k, v in step.items() if k != "t"}
            out["note"] = f"real time {step['t']:.9f}"
            steps.append(out)
    used = {s["endpoint"] for s in steps}
    eps = {n: spec for n, spec in eps.items() if n in used}
    cfg = attrs.asdict(config)
    impl = CoreImplementation()
    setup_request: Any = {"cmd": "setup", "vector": name, "config": cfg, "endpoints": eps}
    setup = impl.call(setup_request)
    if setup.get("ok") is not True:
        raise ValueError(f"the reference core refused the vector's setup: {setup}")
    for step in steps:
        request: Any = {"cmd": "step", "endpoint": step["endpoint"], "now": step["now"], "op": step["op"]}
        request["args"] = step.get("args", {})
        step["expect"] = impl.call(request)
    return {
        "format": VECTOR_FORMAT,
        "kind": "trace",
        "name": name,
        "description": description,
        "config": cfg,
        "endpoints": eps,
        "steps": steps,
    }
