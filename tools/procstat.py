"""Processes as /proc shows them (Linux), for the harnesses that watch the servers they start."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path


def proc_stats() -> Iterator[tuple[int, str, list[str]]]:
    """``(pid, command name, fields after the name)`` of each process readable now. The name may
    hold spaces and parentheses, so the fields are split after its last ``)``: ``fields[0]`` is
    the state, ``[1]`` the parent, ``[2]`` the process group, ``[11]`` and ``[12]`` user and
    system CPU in clock ticks, ``[21]`` the resident set in pages (proc(5))."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        yield int(entry.name), stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
