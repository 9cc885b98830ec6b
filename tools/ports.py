"""Ports for the servers the tests, benchmarks and demos start: chosen before the servers bind
them, so each is drawn below the host's ephemeral range (a port the kernel hands to some
outgoing connection meanwhile would be taken from under the server) and never handed out twice
by one process (a fleet's ports are all chosen before any is bound)."""

from __future__ import annotations

import os
import random
import socket
import time
from pathlib import Path

__all__ = ["free_port"]

_DRAW = random.Random(os.getpid() ^ time.time_ns())
_GIVEN: set[int] = set()


def _port_range() -> range:
    """Below the host's ephemeral range; 20000-32000 when that range cannot be read."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(20000, low) if low > 21000 else range(max(low - 12000, 10000), max(low, 11000))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now and that this process has not handed out before."""
    ports = _port_range()
    for _ in range(500):
        port = _DRAW.choice(ports)
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError(f"no free port in [{ports.start}, {ports.stop})")
