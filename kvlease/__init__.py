"""kvlease: KV-cache leases for disaggregated prefill/decode LLM serving.

This package is the pure sans-IO core: it never reads a clock and never does I/O. Time is
passed in as `LocalTime`; outputs are returned as values. Transports (`kvlease.transports`) and
engine adapters (`kvlease.adapters`) load only when imported, behind extras.
"""

from ._accessor import AccessDecision, Accessor, TrackedState
from ._auth import MAC_BYTES, FrameAuth, is_sealed_frame
from ._clock import MAX_TIME, ClockOffsetEstimator, ClockSample, LocalTime, OffsetEstimate, PeerTime
from ._codec import decode, encode, is_native_frame, split_ids
from ._config import MIN_ACCESS_TIME, MIN_MESSAGE_BYTES, MIN_VALIDITY_MARGIN, LeaseConfig
from ._errors import (
    DECODE_ERROR_CATEGORIES,
    ConfigError,
    DecodeError,
    DecodeErrorCategory,
    EncodeError,
    KvLeaseError,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
)
from ._events import (
    AccessCompleted,
    AccessorOutput,
    AccessStale,
    EndReason,
    Free,
    HandshakeNeeded,
    LeaseLost,
    LostReason,
    Output,
    PinnerOutput,
    Rejected,
    Send,
)
from ._layout import MAX_RANKS, TpLayout, tp_layout
from ._messages import (
    PROTOCOL_VERSION,
    AccessDone,
    AccessDoneAck,
    AccessOutcome,
    Capability,
    Handshake,
    HandshakeReply,
    Heartbeat,
    HeartbeatAck,
    LeaseKind,
    LeaseTicket,
    Message,
    Release,
)
from ._pinner import LeaseInfo, LeaseState, Pinner, PinnerCounters
from ._vllm_compat import VllmAccessDone, VllmHeartbeat, decode_vllm, encode_vllm_done, encode_vllm_heartbeat

__version__ = "0.1.0"

__all__ = [
    "DECODE_ERROR_CATEGORIES",
    "MAC_BYTES",
    "MAX_RANKS",
    "MAX_TIME",
    "MIN_ACCESS_TIME",
    "MIN_MESSAGE_BYTES",
    "MIN_VALIDITY_MARGIN",
    "PROTOCOL_VERSION",
    "AccessCompleted",
    "AccessDecision",
    "AccessDone",
    "AccessDoneAck",
    "AccessOutcome",
    "AccessStale",
    "Accessor",
    "AccessorOutput",
    "Capability",
    "ClockOffsetEstimator",
    "ClockSample",
    "ConfigError",
    "DecodeError",
    "DecodeErrorCategory",
    "EncodeError",
    "EndReason",
    "FrameAuth",
    "Free",
    "Handshake",
    "HandshakeNeeded",
    "HandshakeReply",
    "Heartbeat",
    "HeartbeatAck",
    "KvLeaseError",
    "LeaseConfig",
    "LeaseInfo",
    "LeaseKind",
    "LeaseLost",
    "LeaseState",
    "LeaseTicket",
    "LocalProtocolError",
    "LocalTime",
    "LostReason",
    "Message",
    "OffsetEstimate",
    "Output",
    "PeerTime",
    "Pinner",
    "PinnerCounters",
    "PinnerOutput",
    "ProtocolError",
    "Rejected",
    "Release",
    "RemoteProtocolError",
    "Send",
    "TpLayout",
    "TrackedState",
    "VllmAccessDone",
    "VllmHeartbeat",
    "__version__",
    "decode",
    "decode_vllm",
    "encode",
    "encode_vllm_done",
    "encode_vllm_heartbeat",
    "is_native_frame",
    "is_sealed_frame",
    "split_ids",
    "tp_layout",
]
