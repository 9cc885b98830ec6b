"""`kvlease bench`: run the benchmark scripts in ``bench/`` and show their tables.

Each script is run as a subprocess with this interpreter, its output passed straight through;
``--quick`` becomes each script's own smoke-run option where it has one. The benchmarks live in
the source tree (not the installed package), so the command looks for ``bench/`` beside the
package (editable installs), then in the current directory, or where ``--dir`` says.
This module measures nothing itself and never asserts on speed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import click

__all__ = ["bench"]

#: Scripts whose quick mode is spelled differently from ``--quick``.
_QUICK_ARGS: dict[str, list[str]] = {"core": ["--sizes", "1000,100000"]}


_FROM_CHECKOUT = "'python -m kvlease bench' in the root of a kvlease checkout (git clone, then .venv/bin/python)"


def _bench_dir(explicit: Path | None) -> Path:
    candidates = [explicit] if explicit else [Path(__file__).resolve().parents[2] / "bench", Path.cwd() / "bench"]
    for c in candidates:
        if c is not None and c.is_dir() and any(c.glob("*.py")):
            return c
    where = ", ".join(str(c) for c in candidates if c is not None)
    raise click.UsageError(
        f"no benchmark scripts in {where}: the benchmarks are not installed with kvlease, they live in bench/ of "
        f"a source checkout; run {_FROM_CHECKOUT}, or pass --dir CHECKOUT/bench"
    )


def _scripts(directory: Path) -> dict[str, Path]:
    return {p.stem: p for p in sorted(directory.glob("*.py")) if not p.name.startswith("_")}


def _summary(path: Path) -> str:
    """The first paragraph of the script's module docstring, on one line (a sentence may run
    over several lines: the first line alone can stop mid-sentence)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    for quote in ('"""', "'''"):
        start = text.find(quote)
        if start != -1:
            body = text[start + 3 :].split(quote, 1)[0].strip()
            return " ".join(body.split("\n\n", 1)[0].split())
    return ""


#: The ``Run time: ...`` sentence: up to the first full stop outside parentheses (so that an
#: ``i.e.`` inside them does not end it).
_RUN_TIME = re.compile(r"Run time:\s*((?:[^.()]|\([^()]*\))+)\.", re.S)


def _run_time(path: Path) -> str:
    """What the script's docstring says it takes (its ``Run time: ...`` sentence)."""
    m = _RUN_TIME.search(path.read_text(encoding="utf-8", errors="replace"))
    return " ".join(m.group(1).replace("``", "").split()) if m else "not stated"


class _BenchCommand(click.Command):
    """`--help` ends with the benchmarks found and roughly how long each runs."""

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        try:
            found = _scripts(_bench_dir(None))
        except click.UsageError as exc:
            rows = [("(none)", exc.format_message())]
        else:
            rows = [(name, f"{_run_time(path)} — {_summary(path)}") for name, path in found.items()]
        with formatter.section("Benchmarks (run time, then what it measures)"):
            formatter.write_dl(rows)
        super().format_epilog(ctx, formatter)


def _quick_args(name: str, path: Path) -> list[str] | None:
    if name in _QUICK_ARGS:
        return _QUICK_ARGS[name]
    return ["--quick"] if "--quick" in path.read_text(encoding="utf-8", errors="replace") else None


@click.command(cls=_BenchCommand, context_settings={"ignore_unknown_options": True})
@click.argument("names", nargs=-1)
@click.option("--list", "list_only", is_flag=True, help="List the benchmarks found and exit.")
@click.option("--quick", is_flag=True, help="Pass each script's smoke-run option (fewer sizes/samples).")
@click.option(
    "--dir",
    "directory",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Directory holding the benchmark scripts (default: bench/ of the source checkout).",
)
@click.option("--arg", "extra", multiple=True, help="Extra argument passed to every script (repeatable).")
def bench(names: tuple[str, ...], list_only: bool, quick: bool, directory: Path | None, extra: tuple[str, ...]) -> None:
    """Run the benchmarks in bench/ (all, or the NAMES given). They print figures, with the
    baseline they replace in the same run where there is one; none asserts on speed. Each
    prints its own run time when it ends; roughly how long each takes is listed below.

    The benchmarks are not installed with kvlease: run this in a source checkout (or pass
    --dir CHECKOUT/bench). vllm_adapter needs vLLM: run it with vLLM's environment,
    .venv-vllm/bin/python -m kvlease bench vllm_adapter."""
    found = _scripts(_bench_dir(directory))
    if list_only:
        for name, path in found.items():
            click.echo(f"{name:16} {_summary(path)} (run time: {_run_time(path)})")
        return
    unknown = [n for n in names if n not in found]
    if unknown:
        raise click.BadParameter(
            f"unknown benchmark(s) {', '.join(unknown)}; available: {', '.join(found)}", param_hint="NAMES"
        )
    failed = []
    for name in names or tuple(found):
        path = found[name]
        args = [*extra]
        if quick:
            q = _quick_args(name, path)
            if q is None:
                click.echo(f"note: {name} has no quick mode; running it in full", err=True)
            else:
                args = [*q, *args]
        click.secho(f"== {name}: {' '.join([path.name, *args])}", bold=True)
        t0 = time.monotonic()
        rc = subprocess.call([sys.executable, str(path), *args])
        click.echo(f"== {name}: exit {rc} after {time.monotonic() - t0:.1f} s", err=True)
        if rc != 0:
            failed.append(name)
    if failed:
        raise click.ClickException(f"benchmark(s) failed: {', '.join(failed)}")
