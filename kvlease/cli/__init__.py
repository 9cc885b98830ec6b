"""The `kvlease` command: the application shell around the core.

This subpackage is *not* part of the pure core: it reads clocks, spawns processes and talks to
terminals. The core (everything else under `kvlease/`) never imports it. Each subcommand lives in
its own module and is imported only when that subcommand runs, so `kvlease --help` stays fast
and a missing extra only affects the command that needs it.

Besides the subcommands: `_child`, the one child-process harness (an engine worker in its own
process, driven over JSON lines, with a transport factory) that the demo's processes, the
real-process tests and the NIXL benchmark share; the demo is `_demo` (the parent: router,
faults, live view), `_demo_proc` (the two processes' bodies), `_demo_scenarios` (each
scenario one object: timing, fault, script, judgement, table row) and `_demo_steps` (a
scenario's steps, their deadlines and what a timeout says).
"""

from __future__ import annotations

import importlib
from typing import Any

import click

__all__ = ["main"]

#: subcommand name -> (module, attribute, one-line help)
_COMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": ("kvlease.cli._demo", "demo", "Run the two-process loopback demo (P and D as real processes)."),
    "check": ("kvlease.cli._check", "check", "Model-check the real core exhaustively over a small scope."),
    "conformance": (
        "kvlease.cli._conformance",
        "conformance",
        "Replay the conformance vectors against the core or an external driver.",
    ),
    "bench": (
        "kvlease.cli._bench",
        "bench",
        "Run the benchmarks in bench/ of a source checkout (not installed) and print their tables.",
    ),
    "sim": ("kvlease.cli._sim", "sim", "Simulate a P/D cluster: policy comparison, plots, fault campaign."),
    "version": ("kvlease.cli._version", "version", "Print the kvlease and protocol versions."),
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        spec = _COMMANDS.get(cmd_name)
        if spec is None:
            return None
        module = importlib.import_module(spec[0])
        cmd: Any = getattr(module, spec[1])
        assert isinstance(cmd, click.Command)
        return cmd

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, spec[2]) for name, spec in sorted(_COMMANDS.items())]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """kvlease: KV-cache leases for disaggregated prefill/decode LLM serving."""
