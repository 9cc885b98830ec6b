"""`kvlease check`: exhaustive small-scope model checking of the real core (see `kvlease.check`).

The shell around the pure explorer: parses the scope, times the run, prints the counts and any
shortest counterexample, writes it as a conformance-vector candidate under --out.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from ..check import BUG_HINTS, CHECK_BUGS, KINDS, RENAMED_BUGS, Scope, explore, to_vector
from ..check._world import CHECK_CONFIG
from ._params import BugName, Number

__all__ = ["check"]

_BUG_NAMES = BugName(list(CHECK_BUGS), RENAMED_BUGS)

_FAMILIES = (
    "grant",
    "release",
    "track",
    "retrack",
    "untrack",
    "begin",
    "finish",
    "fail",
    "disconnect",
    "drop",
    "dup",
    "misroute",
    "cross",
    "replay",
    "advance",
    "restart",
    "part",
    "bigbeat",
)


def _ranks(ctx: click.Context, param: click.Parameter, value: int) -> int:
    if value not in (1, 2, 4):
        raise click.BadParameter(f"must be 1, 2 or 4, got {value}")
    return value


class _Progress:
    """A line on stderr at most every `every` seconds, terminal or not (a deep scope runs for
    minutes): the depth being explored, states and transitions so far."""

    def __init__(self, depth: int, every: float) -> None:
        self.depth = depth
        self.every = every
        self.started = self.last = time.monotonic()

    def __call__(self, depth: int, states: int, transitions: int) -> None:
        now = time.monotonic()
        if now - self.last < self.every:
            return
        self.last = now
        click.echo(
            f"check: depth {depth}/{self.depth}, {states:,} states, {transitions:,} transitions, "
            f"{now - self.started:.0f} s",
            err=True,
        )


@click.command()
@click.option(
    "--pinner-ranks",
    "-p",
    type=int,
    default=1,
    show_default=True,
    callback=_ranks,
    help="Tensor-parallel ranks of the pinner engine: 1, 2 or 4.",
)
@click.option(
    "--accessor-ranks",
    "-a",
    type=int,
    default=1,
    show_default=True,
    callback=_ranks,
    help="Tensor-parallel ranks of each accessor engine: 1, 2 or 4 (one of -p / -a divides the other).",
)
@click.option("--engines", type=click.IntRange(1, 2), default=1, show_default=True, help="Accessor engines.")
@click.option(
    "--leases",
    type=click.IntRange(1, 3),
    default=1,
    show_default=True,
    help="At most this many leases granted per schedule.",
)
@click.option("--kinds", default="renewable", show_default=True, help=f"Comma-separated, of {', '.join(KINDS)}.")
@click.option("--depth", type=click.IntRange(1, 64), default=8, show_default=True, help="Actions per schedule.")
@click.option(
    "--history",
    type=click.IntRange(0, 8),
    default=0,
    show_default=True,
    help="Delivered messages kept for stale replays.",
)
@click.option(
    "--without",
    default="drop,cross",
    show_default=True,
    help=f"Action families left out (comma-separated, of {', '.join(_FAMILIES)}; 'none' for none).",
)
@click.option(
    "--restarts",
    type=click.IntRange(0, 1),
    default=0,
    show_default=True,
    help="Pinner restarts per schedule (a new incarnation; lease ids start again at 1).",
)
@click.option(
    "--accessor-lease",
    type=Number(0.0, 86400.0, min_open=True),
    default=None,
    help="The accessors' own kv_lease_duration (the two sides configured apart); default: the pinner's 6 s.",
)
@click.option(
    "--max-outstanding",
    type=click.IntRange(1, 64),
    default=None,
    help="max_outstanding_heartbeats on both sides (default 64).",
)
@click.option(
    "--inject-bug",
    type=_BUG_NAMES,
    default=None,
    help="Run against a core with one fix switched off (v1 holes: a v2 fix; v3 holes: a v3 fix); the same "
    "name as `kvlease sim --inject-bug` where both have the bug." + _BUG_NAMES.deprecation(),
)
@click.option("--max-states", type=click.IntRange(1), default=None, help="Stop after this many states (a lower bound).")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Write a violation as a conformance-vector candidate in this directory.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option(
    "--progress-every",
    type=Number(0.0, 3600.0),
    default=5.0,
    show_default=True,
    help="Seconds between progress lines on stderr (depth, states so far), piped or not; "
    "0: at each depth and every few thousand transitions.",
)
def check(
    pinner_ranks: int,
    accessor_ranks: int,
    engines: int,
    leases: int,
    kinds: str,
    depth: int,
    history: int,
    without: str,
    restarts: int,
    accessor_lease: float | None,
    max_outstanding: int | None,
    inject_bug: str | None,
    max_states: int | None,
    out_dir: Path | None,
    as_json: bool,
    progress_every: float,
) -> None:
    """Explore every schedule of the real core up to --depth actions; exit 1 on a violation."""
    if pinner_ranks % accessor_ranks and accessor_ranks % pinner_ranks:
        raise click.BadParameter(
            f"one of --pinner-ranks ({pinner_ranks}) / --accessor-ranks ({accessor_ranks}) must divide the other",
            param_hint="'--pinner-ranks' / '--accessor-ranks'",
        )
    kind_list = tuple(k.strip() for k in kinds.split(",") if k.strip())
    bad = [k for k in kind_list if k not in KINDS]
    if bad or not kind_list:
        raise click.BadParameter(
            f"unknown kinds {', '.join(bad) or '(none given)'}; choose from {', '.join(KINDS)}", param_hint="'--kinds'"
        )
    left_out = frozenset() if without in ("", "none") else frozenset(w.strip() for w in without.split(","))
    if left_out - set(_FAMILIES):
        raise click.BadParameter(
            f"unknown action families {', '.join(sorted(left_out - set(_FAMILIES)))}; choose from "
            f"{', '.join(_FAMILIES)}, or 'none'",
            param_hint="'--without'",
        )
    config = (
        CHECK_CONFIG
        if max_outstanding is None
        else CHECK_CONFIG.with_changes(max_outstanding_heartbeats=max_outstanding)
    )
    acfg = None if accessor_lease is None else config.with_changes(kv_lease_duration=accessor_lease)
    scope = Scope(
        pinner_ranks,
        accessor_ranks,
        engines,
        leases,
        kind_list,
        depth,
        history,
        left_out,
        config=config,
        restarts=restarts,
        accessor_config=acfg,
    )
    pinner_cls, accessor_cls, hole = CHECK_BUGS[inject_bug] if inject_bug else (None, None, "")
    t0 = time.perf_counter()
    result = explore(
        scope,
        *(() if pinner_cls is None else (pinner_cls, accessor_cls)),
        max_states=max_states,
        progress=_Progress(depth, progress_every),
    )
    wall = time.perf_counter() - t0
    written: str | None = None
    cx = result.violation
    if cx is not None and out_dir is not None:
        name = f"check_{inject_bug or 'core'}_p{pinner_ranks}a{accessor_ranks}".replace("-", "_")
        args = () if pinner_cls is None else (pinner_cls, accessor_cls)
        vector = to_vector(scope, cx, name, *args)
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{name}.json"
        path.write_text(json.dumps(vector, indent=1) + "\n")
        written = str(path)
    summary = {
        "scope": {
            "pinner_ranks": pinner_ranks,
            "accessor_ranks": accessor_ranks,
            "engines": engines,
            "leases": leases,
            "kinds": list(kind_list),
            "depth": depth,
            "history": history,
            "without": sorted(left_out),
            "restarts": restarts,
            "accessor_lease": accessor_lease,
            "max_outstanding": max_outstanding,
            "inject_bug": inject_bug,
        },
        "states": result.states,
        "transitions": result.transitions,
        "wall_s": round(wall, 3),
        "states_per_s": round(result.states / wall, 1) if wall > 0 else None,
        "depth_reached": result.depth_reached,
        "exhausted": result.exhausted,
        "truncated": result.truncated,
        "per_depth": result.per_depth,
        "violations": 0 if cx is None else 1,
        "violation": None
        if cx is None
        else {"message": cx.message, "schedule": list(cx.schedule), "rates": list(cx.rates)},
        "vector": written,
    }
    if as_json:
        click.echo(json.dumps(summary, indent=1))
    else:
        click.echo(
            f"scope: p={pinner_ranks} a={accessor_ranks} engines={engines} leases={leases} "
            f"kinds={','.join(kind_list)} depth={depth} without={','.join(sorted(left_out)) or '-'}"
            + (f"  [bug: {inject_bug}: {hole}]" if inject_bug else "")
        )
        click.echo(
            f"states explored: {result.states:,}  transitions: {result.transitions:,}  "
            f"wall time: {wall:.1f} s  ({summary['states_per_s']} states/s)"
        )
        click.echo(
            f"states per depth: {result.per_depth}"
            + ("  (exhausted: no new state within the bound)" if result.exhausted else "")
            + ("  (stopped at --max-states)" if result.truncated else "")
        )
        if cx is None:
            click.echo("violations: 0")
            if inject_bug in BUG_HINTS:
                click.echo(f"a scope that finds it: kvlease check --inject-bug {inject_bug} {BUG_HINTS[inject_bug]}")
        else:
            click.echo(f"violations: 1 — {cx.message}")
            click.echo(f"shortest schedule ({len(cx.actions)} actions, clock rates {list(cx.rates)}):")
            for line in cx.schedule:
                click.echo("  " + line)
            if written:
                click.echo(f"conformance-vector candidate: {written} (replay: kvlease conformance --vectors {out_dir})")
    sys.exit(1 if cx is not None else 0)
