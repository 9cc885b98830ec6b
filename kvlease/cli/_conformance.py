"""`kvlease conformance`: replay spec/vectors/ against the core or an external driver.

Application shell: it reads vector files, starts the driver subprocess and prints a table. The
comparison itself is `kvlease.conformance.run_vector` (pure).
"""

from __future__ import annotations

import json
import os
import selectors
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

import click

from kvlease import KvLeaseError
from kvlease.conformance import CoreImplementation, Implementation, JSONDict, VectorResult, run_vector

from ._params import Number

__all__ = ["DriverError", "SubprocessDriver", "conformance", "default_vectors_dir", "load_vectors"]


def _resolve(program: str) -> str:
    """A bare command name is looked up on PATH, then beside this interpreter, so the console
    scripts of the environment kvlease runs from (``kvlease-conformance-driver``) work without
    activating it."""
    if os.sep in program:
        return program
    found = shutil.which(program)
    if found is None:
        beside = Path(sys.executable).parent / program
        if beside.is_file() and os.access(beside, os.X_OK):
            return str(beside)
    return found or program


class DriverError(KvLeaseError):
    """The external driver died, hung, or answered something that is not one JSON object."""


class SubprocessDriver:
    """Speaks the driver protocol with a subprocess over its stdin/stdout, one JSON object
    per line, with a per-request timeout so a hung driver fails the check instead of hanging."""

    def __init__(self, command: str, *, timeout: float = 10.0) -> None:
        self.command = command
        self.timeout = timeout
        self.answered = 0  # responses received: none at all means the driver never worked
        try:
            argv = shlex.split(command)
        except ValueError as exc:
            raise DriverError(f"cannot parse the driver command {command!r}: {exc}") from None
        if not argv:
            raise DriverError("the driver command is empty")
        argv[0] = _resolve(argv[0])
        try:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                bufsize=0,  # stderr is inherited: a chatty driver cannot fill a pipe and stall
            )
        except OSError as exc:  # not found, not executable, ...
            raise DriverError(f"cannot start the driver {argv[0]!r}: {exc.strerror or exc}") from None
        assert self._proc.stdout is not None and self._proc.stdin is not None
        os.set_blocking(self._proc.stdout.fileno(), False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._proc.stdout, selectors.EVENT_READ)
        self._buf = b""
        self._broken = False

    @property
    def broken(self) -> bool:
        """The driver exited, hung or desynchronized: replace it before the next vector."""
        return self._broken or self._proc.poll() is not None

    def call(self, request: JSONDict) -> JSONDict:
        try:
            return self._call(request)
        except DriverError:
            self._broken = True
            raise

    def _call(self, request: JSONDict) -> JSONDict:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        try:
            self._proc.stdin.write(json.dumps(request).encode() + b"\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise DriverError(f"driver stdin closed ({exc}); {self._stderr_tail()}") from None
        while b"\n" not in self._buf:
            if not self._sel.select(self.timeout):
                raise DriverError(f"driver gave no answer within {self.timeout} s")
            chunk = self._proc.stdout.read(65536)
            if chunk == b"":
                try:  # stdout closed: the exit status follows at once
                    status: int | None = self._proc.wait(timeout=2.0)
                except subprocess.TimeoutExpired:
                    status = None
                raise DriverError(f"driver closed its output (exit status {status}); {self._stderr_tail()}")
            if chunk is not None:
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        try:
            response = json.loads(line)
        except ValueError:
            raise DriverError(f"driver answered a line that is not JSON: {line[:200]!r}") from None
        if not isinstance(response, dict):
            raise DriverError(f"driver answered {type(response).__name__}, not an object")
        self.answered += 1
        return response

    @property
    def exit_status(self) -> int | None:
        return self._proc.poll()

    def _stderr_tail(self) -> str:
        return "see its stderr above"

    def close(self) -> None:
        self._sel.close()
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # a hung driver never reads its EOF
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def __enter__(self) -> SubprocessDriver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextmanager
def default_vectors_dir() -> Iterator[Path]:
    """The vectors shipped with kvlease: package data of ``kvlease.spec`` (the source tree's
    ``spec/``, where they are edited; an installed wheel carries a copy), as a directory."""
    with resources.as_file(resources.files("kvlease.spec").joinpath("vectors")) as path:
        yield path


def load_vectors(directory: Path, names: tuple[str, ...] = ()) -> list[JSONDict]:
    """Every ``*.json`` vector in `directory` (sorted by file name), or only `names`."""
    paths = sorted(directory.glob("*.json"))
    if names:
        unknown = sorted(set(names) - {p.stem for p in paths})
        if unknown:
            raise click.BadParameter(
                f"no vector named {', '.join(unknown)} in {directory}; the vectors there: "
                f"{', '.join(p.stem for p in paths) or '(none)'}",
                param_hint="'--only'",
            )
        paths = [p for p in paths if p.stem in names]
    vectors: list[JSONDict] = []
    for p in paths:
        try:
            data = json.loads(p.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise click.ClickException(f"{p}: not a vector file (not JSON: {exc})") from None
        if not isinstance(data, dict):
            raise click.ClickException(f"{p}: a vector file must hold one JSON object")
        vectors.append(data)
    return vectors


def run_all(vectors: list[JSONDict], impl: Implementation) -> list[VectorResult]:
    return [run_vector(v, impl) for v in vectors]


@click.command()
@click.option(
    "--driver",
    "driver_cmd",
    metavar="CMD",
    default=None,
    help="Check an external implementation: a command speaking the driver protocol "
    "(spec/vectors/README.md) on stdin/stdout, e.g. the reference driver, "
    "'kvlease-conformance-driver' (installed beside kvlease).",
)
@click.option(
    "--vectors",
    "vectors_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Directory of vector files (default: the vectors shipped with kvlease).",
)
@click.option("--only", "names", multiple=True, metavar="NAME", help="Run only this vector (repeatable).")
@click.option(
    "--timeout",
    type=Number(0.0, 3600.0, min_open=True),
    default=10.0,
    show_default=True,
    help="Seconds to wait for each driver answer.",
)
def conformance(driver_cmd: str | None, vectors_dir: Path | None, names: tuple[str, ...], timeout: float) -> None:
    """Replay the conformance vectors; exit 1 on any mismatch, showing the first one."""
    from rich.console import Console
    from rich.table import Table

    if vectors_dir is None:
        with default_vectors_dir() as directory:
            if not directory.is_dir():
                raise click.ClickException(f"no vectors at {directory} (a broken install?); pass --vectors DIR")
            vectors = load_vectors(directory, names)
    else:
        directory = vectors_dir
        vectors = load_vectors(directory, names)
    if not vectors:
        raise click.ClickException(f"no vectors matched in {directory}")
    if driver_cmd is None:
        results = run_all(vectors, CoreImplementation())
        target = "in-process Python core"
    else:
        results = []
        try:
            drv = SubprocessDriver(driver_cmd, timeout=timeout)
        except DriverError as exc:
            raise click.ClickException(str(exc)) from None
        try:
            for v in vectors:
                if drv.broken and drv.answered == 0:
                    status = drv.exit_status
                    how = f"exited at once (status {status})" if status is not None else "never answered"
                    raise click.ClickException(
                        f"the driver {driver_cmd!r} {how} without answering a single request; see its stderr"
                    )
                if drv.broken:  # one that crashed or hung on a vector is checked on the rest
                    drv.close()
                    drv = SubprocessDriver(driver_cmd, timeout=timeout)
                results.append(run_vector(v, drv))
        finally:
            drv.close()
        target = f"driver: {driver_cmd}"
    console = Console()
    table = Table(title=f"kvlease conformance ({target})")
    table.add_column("vector")
    table.add_column("kind")
    table.add_column("checked", justify="right")
    table.add_column("result")
    for r in results:
        verdict = "[green]pass[/]" if r.passed else "[red]FAIL[/]"
        table.add_row(r.name, r.kind, f"{r.checked}/{r.total}", verdict)
    console.print(table)
    failed = [r for r in results if not r.passed]
    if failed:
        first = failed[0].mismatch
        assert first is not None
        console.print(f"[red]{len(failed)} of {len(results)} vectors failed.[/] First mismatch:")
        console.print(first.render(), markup=False, highlight=False, soft_wrap=True)
        raise SystemExit(1)
    console.print(f"[green]all {len(results)} vectors pass[/]")
