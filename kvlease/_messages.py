"""The protocol's messages, as plain frozen values (no bytes here: see `_codec`).

Every message a pinner and an accessor exchange is one of these classes. `LeaseTicket` is not a
wire message: it is what the pinner hands to the accessor out of band (vLLM's
``kv_transfer_params``), in a JSON-friendly form.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

import attrs
import msgpack

from ._clock import MAX_TIME, LocalTime, PeerTime
from ._errors import RemoteProtocolError

if TYPE_CHECKING:
    from ._auth import FrameAuth

__all__ = [
    "PROTOCOL_VERSION",
    "AccessDone",
    "AccessDoneAck",
    "AccessOutcome",
    "Capability",
    "Handshake",
    "HandshakeReply",
    "Heartbeat",
    "HeartbeatAck",
    "LeaseKind",
    "LeaseTicket",
    "Message",
    "Release",
]

PROTOCOL_VERSION = 3


class LeaseKind(enum.IntEnum):
    """Renewable leases are extended by heartbeats; fixed-TTL leases (bidirectional turn-1
    blocks) are never extended and end at a deadline the accessor converts to its clock."""

    RENEWABLE = 0
    FIXED_TTL = 1


class AccessOutcome(enum.IntEnum):
    """The pinner's verdict on an access-done it was asked to confirm."""

    #: The lease was live when the pinner handled the access-done: the access is valid.
    OK = 0
    #: The lease had already expired (or was released): the data may be stale.
    STALE = 1
    #: The pinner does not know the lease (restarted, forgotten, never granted).
    UNKNOWN = 2


class Capability(enum.IntFlag):
    NONE = 0
    #: The peer answers heartbeats with `HeartbeatAck` (always set by kvlease peers).
    HEARTBEAT_ACK = 1
    #: The peer supports push mode (the accessor WRITEs into the pinner's memory).
    PUSH = 2
    #: The peer confirms access-done on request (`AccessDoneAck`).
    CONFIRM_ACCESS = 4
    #: The peer understands vLLM's native ``HB:``/``id:count`` notifications.
    VLLM_COMPAT = 8


ALL_CAPABILITIES = Capability.HEARTBEAT_ACK | Capability.PUSH | Capability.CONFIRM_ACCESS


@attrs.frozen
class Handshake:
    """Accessor → pinner, over the side channel, before heartbeats flow."""

    engine_id: str  # the sender (accessor engine)
    rank: int
    ranks: int
    session: int  # the accessor's incarnation: random per accessor process, echoed in replies
    version: int
    capabilities: int
    seq: int  # the accessor's message counter (never repeats within a session), echoed
    t_send: LocalTime


@attrs.frozen
class HandshakeReply:
    """Pinner → accessor: identity, incarnation, TP layout and a clock sample, bound to the
    handshake it answers (`to_rank`, `to_session`, `seq`, `t_echo`)."""

    engine_id: str  # the sender (pinner engine)
    rank: int
    ranks: int
    incarnation: int
    version: int
    capabilities: int
    max_message_bytes: int
    # The terms this pinner enforces (its own LeaseConfig), which the accessor's validity and
    # push guard must not exceed: how far a renewal extends a lease (seconds, pinner clock), the
    # drift bound it assumes, and the access-time bound its push quarantine keeps.
    extension: float
    max_drift_rate: float
    max_access_time: float
    to_rank: int  # the handshake's sender rank
    to_session: int  # the handshake's session
    seq: int  # the handshake's seq
    # Times are typed from the accessor's side, the only side that relates the two clocks:
    # the handshake's t_send, echoed back, is the accessor's own clock.
    t_echo: LocalTime
    t_recv: PeerTime  # the pinner's clock when it received the handshake
    t_send: PeerTime  # the pinner's clock when it sent this reply


@attrs.frozen
class Heartbeat:
    """Accessor rank → each pinner rank it accesses: renew these leases."""

    engine_id: str  # the sender (accessor engine)
    rank: int
    ranks: int  # the accessor engine's TP size (the pinner checks the layout)
    session: int
    incarnation: int  # the pinner incarnation the ids belong to
    seq: int
    t_send: LocalTime  # sender's clock, echoed in the ack (validity is measured from it)
    lease_ids: tuple[int, ...]  # strictly increasing


@attrs.frozen
class HeartbeatAck:
    """Pinner rank → the accessor rank whose heartbeat it answers: what it renewed, and which
    ids it does not hold. ``renewed + len(unknown + expired + released + completed)`` equals
    the heartbeat's id count."""

    engine_id: str  # the sender (pinner engine)
    rank: int
    incarnation: int
    to_rank: int  # the heartbeat's sender rank
    to_session: int  # the heartbeat's session
    seq: int  # the heartbeat's seq
    t_echo: LocalTime  # the heartbeat's t_send, echoed back: the accessor's own clock
    t_recv: PeerTime  # the pinner's clock when it handled the heartbeat
    #: How far this pinner rank extends a lease on a renewal (seconds of its clock): the
    #: accessor's validity from the round never exceeds it, whatever its own config says.
    extension: float
    renewed: int  # how many of the heartbeat's ids were live and renewed (or fixed and held)
    unknown: tuple[int, ...] = ()  # never granted here, forgotten, or held for another accessor
    expired: tuple[int, ...] = ()
    released: tuple[int, ...] = ()
    completed: tuple[int, ...] = ()  # access-done already counted to completion


@attrs.frozen
class AccessDone:
    """Accessor rank → pinner rank: my access of this lease's memory finished."""

    engine_id: str
    rank: int
    ranks: int  # the accessor engine's TP size: the pinner derives `expected` from the layout
    session: int
    incarnation: int
    #: The pinner rank this access-done is for: each part of a multi-part access carries its
    #: own, so a part's notification delivered to a sibling rank counts nothing there.
    to_rank: int
    lease_id: int
    attempt: int  # the seq of the `begin_access` this access-done reports, echoed in the verdict
    confirm: bool  # ask for an `AccessDoneAck` (the access was not covered by validity)
    t_send: LocalTime


@attrs.frozen
class AccessDoneAck:
    """Pinner rank → accessor rank: whether the lease was live when the access-done was handled."""

    engine_id: str
    rank: int
    incarnation: int
    to_rank: int
    to_session: int
    lease_id: int
    attempt: int  # the access-done's attempt
    outcome: AccessOutcome


@attrs.frozen
class Release:
    """Accessor rank → each pinner rank it would have accessed: this rank will never access
    these leases. The pinner frees once every expected accessor rank reported done or released."""

    engine_id: str
    rank: int
    ranks: int
    session: int
    incarnation: int
    lease_ids: tuple[int, ...]  # strictly increasing
    #: A transfer this rank posted may still land (a posted, failed access): the pinner keeps
    #: a push lease's memory to its expiry and the push guard instead of freeing it now.
    posted: bool = False


Message = Handshake | HandshakeReply | Heartbeat | HeartbeatAck | AccessDone | AccessDoneAck | Release


@attrs.frozen
class LeaseTicket:
    """What an accessor needs to renew and access a lease; the pinner returns it from
    `Pinner.grant` and the engine carries it with the transfer parameters."""

    engine_id: str  # the pinner engine
    incarnation: int
    lease_id: int
    kind: LeaseKind = LeaseKind.RENEWABLE
    #: Fixed-TTL only: the pinner's deadline, in the pinner's clock.
    deadline: PeerTime | None = None
    #: Pinner ranks holding this lease's memory (TP size of the pinner engine).
    ranks: int = 1

    def to_dict(self) -> dict[str, Any]:
        """The ticket as JSON-able transfer parameters. The 64-bit `incarnation` and
        `lease_id` are decimal strings: a router that parses JSON numbers as doubles rounds an
        integer above 2**53, and a string survives every JSON stack."""
        d: dict[str, Any] = {
            "engine_id": self.engine_id,
            "incarnation": str(self.incarnation),
            "lease_id": str(self.lease_id),
            "kind": int(self.kind),
            "ranks": self.ranks,
        }
        if self.deadline is not None:
            d["deadline"] = float(self.deadline)
        return d

    def _tag_payload(self, bind: bytes) -> bytes:
        deadline = None if self.deadline is None else float(self.deadline)
        fields = [self.engine_id, self.incarnation, self.lease_id, int(self.kind), deadline, self.ranks, bind]
        return msgpack.packb(fields, use_bin_type=True)  # type: ignore[no-any-return]

    def sealed_dict(self, auth: FrameAuth, bind: bytes) -> dict[str, Any]:
        """`to_dict` with a ``tag``: the deployment key's MAC over the ticket and `bind`, the
        bytes that name what the lease guards (e.g. the producer request id and its block ids).
        `from_dict` with the same key and `bind` accepts it; a party without the key can
        neither forge a ticket nor move one to other memory (spec §7.5)."""
        d = self.to_dict()
        d["tag"] = auth.ticket_tag(self._tag_payload(bind))
        return d

    @classmethod
    def from_dict(cls, d: object, *, auth: FrameAuth | None = None, bind: bytes = b"") -> LeaseTicket:
        """Parse transfer parameters; a malformed one raises `RemoteProtocolError`. With
        `auth` (a deployment key), the ticket must carry a tag over itself and `bind`."""
        if not isinstance(d, dict):
            raise RemoteProtocolError(f"lease ticket must be a mapping, got {type(d).__name__}")
        try:
            engine_id, incarnation, lease_id = d["engine_id"], d["incarnation"], d["lease_id"]
            kind = LeaseKind(d.get("kind", 0))
            ranks = d.get("ranks", 1)
            deadline = d.get("deadline")
        except (KeyError, ValueError) as exc:
            raise RemoteProtocolError(f"malformed lease ticket {d!r}: {exc}") from None
        if not isinstance(engine_id, str) or not engine_id:
            raise RemoteProtocolError(f"lease ticket engine_id must be a non-empty string: {d!r}")
        incarnation = _u64(d, "incarnation", incarnation)
        lease_id = _u64(d, "lease_id", lease_id)
        if not isinstance(ranks, int) or isinstance(ranks, bool) or not 1 <= ranks < 1 << 64:
            raise RemoteProtocolError(f"lease ticket ranks must be an integer >= 1: {d!r}")
        if kind is LeaseKind.FIXED_TTL:
            if (
                not isinstance(deadline, int | float)
                or isinstance(deadline, bool)
                or not -MAX_TIME <= deadline <= MAX_TIME
            ):
                raise RemoteProtocolError(f"fixed-TTL lease ticket needs a finite deadline within +-2**32 s: {d!r}")
            ticket = cls(engine_id, incarnation, lease_id, kind, PeerTime(float(deadline)), ranks)
        else:
            ticket = cls(engine_id, incarnation, lease_id, kind, None, ranks)
        if auth is not None:
            tag = d.get("tag")
            if not isinstance(tag, str) or not auth.check_ticket_tag(ticket._tag_payload(bind), tag):
                what = "carries no tag" if tag is None else "has a tag that matches no key and binding"
                raise RemoteProtocolError(f"lease ticket of lease {lease_id} of {engine_id!r} {what}")
        return ticket


def _u64(d: dict[Any, Any], name: str, v: object) -> int:
    """A ticket's 64-bit field: a decimal string (what `to_dict` writes), or an integer below
    2**53 (exact in every JSON stack; above it one may have been rounded on the way)."""
    if isinstance(v, str) and v.isascii() and v.isdigit() and len(v) <= 20:
        n = int(v)
        if n < 1 << 64:
            return n
    elif isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 53:
        return v
    elif isinstance(v, int) and not isinstance(v, bool) and 1 << 53 <= v < 1 << 64:
        raise RemoteProtocolError(
            f"lease ticket {name} {v} is above 2**53 as a JSON number (a router parsing numbers as "
            f"doubles may have rounded it): it must travel as a decimal string"
        )
    raise RemoteProtocolError(f"lease ticket {name} must be a uint64 as a decimal string: {d!r}")
