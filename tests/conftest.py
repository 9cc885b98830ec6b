"""Shared test settings.

Hypothesis budgets are sized for a 2-core CI. A developer raises them with
``KVLEASE_EXAMPLES=<n>`` (examples for every property and stateful test) and
``KVLEASE_STEPS=<n>`` (steps per stateful run), e.g. ``KVLEASE_EXAMPLES=5000 pytest tests/``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

#: Scale of every Hypothesis test in this suite; tests derive their own budgets from it.
EXAMPLES = int(os.environ.get("KVLEASE_EXAMPLES", "200"))
STEPS = int(os.environ.get("KVLEASE_STEPS", "50"))

settings.register_profile(
    "kvlease",
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("kvlease")
