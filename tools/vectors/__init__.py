"""The conformance vectors of spec/vectors/, one module per vector family.

Each family module scripts its scenarios against the Python core through the harness of
`_common` (`Recorder`), and asserts the property each scenario exists to show:

    lifecycle        a renewable pull lease on one rank each side: grant to free, expiry, Release
    push             push mode: quarantine, the push guard, posted Releases
    fixed_ttl        fixed-TTL leases: the deadline converted across clocks
    handshake        the handshake, its binding, pinner incarnations
    tensor_parallel  heterogeneous TP layouts, ranks and `to_rank`
    heartbeats       heartbeats and acks: their binding and their bounds
    access           accesses, verdicts, tracking a lease at most once
    terms            protocol version 3's stated terms
    misuse           Rejected outputs, DecodeError, LocalProtocolError
    vllm_compat      stock vLLM notifications
    codec            exact bytes, and the bytes a decoder must refuse

`SCENARIOS` lists every trace scenario in the order the vectors were written (the comments
say why each group was added); `codec_cases` builds the one codec vector. Nothing here writes a
file: tools/generate_vectors.py renders the vectors and writes or checks them.
"""

from __future__ import annotations

from collections.abc import Callable

from ._common import Recorder
from .access import accessor_edges, failed_transfer, retrack, retrack_edges, verdict_binding
from .codec import codec_cases
from .fixed_ttl import fixed_ttl_bidirectional, fixed_ttl_past_deadline
from .handshake import handshake_binding, handshake_new_incarnation, pinner_restart
from .heartbeats import (
    ack_binding,
    ack_bound,
    bounds,
    early_heartbeat,
    heartbeat_batching,
    lease_binding,
    rounds_bound,
)
from .lifecycle import (
    accessor_crash_expiry,
    expiry_edges,
    happy_pull,
    late_cover,
    late_read,
    late_read_confirmed,
    overload_long_queue,
    release,
)
from .misuse import rejections_and_misuse
from .push import posted_failed_push, push_mode
from .tensor_parallel import hetero_tp_accessor_wider, hetero_tp_pinner_wider, multi_part_to_rank, wrong_rank
from .terms import ack_extensions, mismatched_terms, stated_terms
from .vllm_compat import vllm_compat

__all__ = ["SCENARIOS", "Recorder", "codec_cases"]

SCENARIOS: list[Callable[[], Recorder]] = [
    happy_pull,
    overload_long_queue,
    accessor_crash_expiry,
    late_read,
    late_read_confirmed,
    push_mode,
    fixed_ttl_bidirectional,
    pinner_restart,
    hetero_tp_pinner_wider,
    hetero_tp_accessor_wider,
    release,
    heartbeat_batching,
    vllm_compat,
    rejections_and_misuse,
    # API-level adversity (each hole of the v1 review is a vector)
    retrack,
    wrong_rank,
    handshake_binding,
    ack_binding,
    failed_transfer,
    expiry_edges,
    bounds,
    # protocol version 3: the deployment is part of the fault model
    mismatched_terms,
    posted_failed_push,
    multi_part_to_rank,
    ack_bound,
    # bound by tools/mutation_check.py: each rule below had a mutant of the core pass every vector
    lease_binding,
    verdict_binding,
    accessor_edges,
    retrack_edges,
    fixed_ttl_past_deadline,
    stated_terms,
    ack_extensions,
    rounds_bound,
    handshake_new_incarnation,
    # issue 21.2: a ticket published before the grant reaches the pinner's workers
    early_heartbeat,  # issue 20: an acknowledgement arriving after a fast READ covers it (no verdict round trip)
    late_cover,
]
