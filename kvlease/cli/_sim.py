"""`kvlease sim`: the policy comparison (table, JSON, PNG figures) and the fault campaign.

The application shell around `kvlease.sim`: it parses options, runs the pure simulator, draws
rich tables and progress bars, writes JSON and PNG files. matplotlib and rich are imported only
here (matplotlib only when ``--plot`` is given). No protocol logic lives here.
"""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..sim import (
    BUGS,
    Policy,
    RunResult,
    Scenario,
    campaign_scenario,
    default_scenario,
    failure_record,
    minimize,
    record_vector,
    run_scenario,
    run_seed,
)
from ..sim import Cluster as _Cluster
from ._params import BugName, FloatList, FloatTuple, Number

if TYPE_CHECKING:
    from rich.console import Console, RenderableType

__all__ = ["sim"]

_POLICY_NAMES = [p.value for p in Policy]

#: Columns of the comparison table: (summary key, header, format)
_COLUMNS: list[tuple[str, str, str]] = [
    ("dead_block_seconds", "dead blk·s", "{:,.0f}"),
    ("peak_pinned_blocks", "peak blks", "{:,.0f}"),
    ("false_frees", "false frees", "{:d}"),
    ("recomputed", "recomp", "{:d}"),
    ("leases_lost", "lost", "{:d}"),
    ("stale_caught", "stale caught", "{:d}"),
    ("stale_used", "stale used", "{:d}"),
    ("reclaim_p50", "reclaim p50", "{:.1f}"),
    ("reclaim_max", "reclaim max", "{:.1f}"),
    ("heartbeat_bytes", "hb bytes", "{:,d}"),
]


def _fmt(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    return fmt.format(value)


_LEGEND = (
    "dead blk·s: KV blocks pinned for dead requests x seconds; false frees: leases freed while a live decoder "
    "still needed them; stale used: reads of freed blocks handed to the engine; reclaim: s from decoder death to free"
)


def _table(results: list[RunResult], title: str) -> None:
    """The comparison for a person: rich tables in a terminal (every number whole, whatever
    the width); the Markdown table when piped."""
    if not sys.stdout.isatty():
        click.echo(title)
        click.echo(markdown_table(results))
        click.echo(textwrap.fill(_LEGEND, 80))
        return
    from rich.console import Console

    console = Console()
    rows = [(r.policy, [_fmt(r.summary()[k], f) for k, _, f in _COLUMNS]) for r in results]
    for renderable in terminal_table(console, rows, title):
        console.print(renderable)
    console.print(_LEGEND, style="dim")


def terminal_table(console: Console, rows: list[tuple[str, list[str]]], title: str) -> list[RenderableType]:
    """What to print for `rows` (each policy and its cells, in `_COLUMNS` order) on `console`:
    the first layout whose every table rich itself measures within the console's width.

    A row per policy in one table; else a column per policy, in as few tables as fit; else a
    policy per block of ``metric value`` lines. Never a table wider than the console: rich
    cuts each line of one at the terminal's edge (870 shown as "87"), and an estimate of rich's
    widths made beside rich is how that happened (rich gives a wrapping column more than its
    narrowest, and a column's ``min_width`` wins over the table's width). Every column here
    has a fixed width: its widest cell, or the longest word of its header, which wraps."""
    from rich.measure import Measurement
    from rich.table import Table
    from rich.text import Text

    width = console.width

    def fits(table: Table) -> bool:
        return Measurement.get(console, console.options.update_width(10**4), table).maximum <= width

    by_policy = Table(title=title)
    by_policy.add_column("policy", style="bold", no_wrap=True, width=max(len("policy"), *(len(p) for p, _ in rows)))
    for c, (_, header, _) in enumerate(_COLUMNS):
        widest = max(max(len(w) for w in header.split()), *(len(cells[c]) for _, cells in rows))
        by_policy.add_column(header, justify="right", width=widest)
    for policy, cells in rows:
        by_policy.add_row(policy, *cells)
    if fits(by_policy):
        return [by_policy]

    def by_metric(chosen: list[tuple[str, list[str]]], first: bool) -> Table:
        table = Table(title=title if first else None)
        table.add_column("metric", no_wrap=True, width=max(len("metric"), *(len(h) for _, h, _ in _COLUMNS)))
        for policy, cells in chosen:
            table.add_column(policy, justify="right", no_wrap=True, width=max(len(policy), *map(len, cells)))
        for c, (_, header, _) in enumerate(_COLUMNS):
            table.add_row(header, *(cells[c] for _, cells in chosen))
        return table

    tables: list[Table] = []
    group: list[tuple[str, list[str]]] = []
    for row in rows:
        if group and not fits(by_metric([*group, row], not tables)):
            tables.append(by_metric(group, not tables))
            group = []
        group.append(row)
    tables.append(by_metric(group, not tables))
    if all(fits(t) for t in tables):
        return list(tables)
    # Narrower than a metric and one number side by side: lines, which fold rather than crop.
    lines: list[RenderableType] = [Text(title)]
    for policy, cells in rows:
        lines.append(Text(policy, style="bold"))
        lines.extend(Text(f"  {header} {cell}") for (_, header, _), cell in zip(_COLUMNS, cells, strict=True))
    return lines


def markdown_table(results: list[RunResult]) -> str:
    """The comparison as a GitHub-flavoured Markdown table (for docs/sim-results.md)."""
    head = "| policy | " + " | ".join(h for _, h, _ in _COLUMNS) + " |"
    sep = "|---|" + "---:|" * len(_COLUMNS)
    rows = [head, sep]
    for r in results:
        s = r.summary()
        rows.append(f"| {r.policy} | " + " | ".join(_fmt(s[k], f) for k, _, f in _COLUMNS) + " |")
    return "\n".join(rows)


def _progress() -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        disable=not sys.stderr.isatty(),
        console=None,
        transient=False,
    )


def _run_policies(scenario: Scenario, policies: list[Policy]) -> list[RunResult]:
    results = []
    with _progress() as progress:
        task = progress.add_task("simulating", total=len(policies))
        for policy in policies:
            results.append(_Cluster(scenario, policy).run())
            progress.advance(task)
    return results


def _check_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise click.UsageError(
            f"--plot needs matplotlib ({exc}); install the extra: pip install 'kvlease[sim]'"
        ) from None


#: Each policy's colour and line style in every figure (the same policy looks the same throughout).
_COLORS = {"fixed-480s": "tab:red", "fixed-30s": "tab:orange", "kvlease": "tab:green", "vllm-hb": "tab:blue"}
_STYLES = {"fixed-480s": "-", "fixed-30s": "--", "kvlease": "-", "vllm-hb": ":"}
#: The reclaim CDF's line widths: the curves that coincide are drawn widest first, translucent.
_CDF_WIDTH = {"kvlease": 7.0, "fixed-30s": 2.6, "vllm-hb": 1.4, "fixed-480s": 2.0}


def _plots(
    out: Path, results: list[RunResult], scenario: Scenario, sweep_rates: list[float], sweep_duration: float
) -> list[Path]:
    """Write the three figures (and the sweep's numbers as JSON) into `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    wasted = _load_sweep(scenario.seed, sweep_rates, sweep_duration)
    figures = {
        "sim-pinned-memory.png": pinned_memory_figure(results, scenario),
        "sim-reclaim-cdf.png": reclaim_cdf_figure(results),
        "sim-wasted-prefills.png": wasted_prefills_figure(wasted, sweep_rates, sweep_duration),
    }
    written = []
    for name, fig in figures.items():
        fig.savefig(out / name)
        plt.close(fig)
        written.append(out / name)
    (out / "sim-wasted-prefills.json").write_text(
        json.dumps({"burst_rates": sweep_rates, "sweep_duration": sweep_duration, "recomputed": wasted}, indent=1)
        + "\n"
    )
    return written


def pinned_memory_figure(results: list[RunResult], scenario: Scenario) -> Any:
    """Pinned memory over time, a panel per policy on shared axes, the 480 s policy in grey
    behind the others. Fixed 30 s, kvlease and silent heartbeats pin the same memory (what
    tells them apart is in each panel's title: false frees, stale reads), so on one axis they
    hid each other."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(8, 1.75 * len(results) + 1.1), dpi=100, sharex=True, sharey=True)
    axes = [axes] if len(results) == 1 else list(axes)
    reference = next((r for r in results if r.policy == Policy.FIXED_480.value), None)
    for ax, r in zip(axes, results, strict=True):
        for b_start, b_len, _ in scenario.workload.bursts:
            ax.axvspan(b_start, b_start + b_len, color="0.9", lw=0, label="burst")
        for f in scenario.faults:
            style = "--" if f.kind.value == "crash" else ":"
            ax.axvline(f.at, color="k", lw=0.8, ls=style, label=f"{f.engine} {f.kind.value}")
        if reference is not None and reference is not r:
            ax.plot(*_xy(reference), color="0.7", lw=1.0, label=f"{reference.policy} (for comparison)")
        xs, ys = _xy(r)
        ax.fill_between(xs, ys, color=_COLORS.get(r.policy), alpha=0.15, lw=0)
        ax.plot(xs, ys, color=_COLORS.get(r.policy), ls=_STYLES.get(r.policy, "-"), lw=1.5, label=r.policy)
        s = r.summary()
        ax.set_title(
            f"{r.policy}: {s['dead_block_seconds'] / 1e6:.2f} M dead blk·s, {s['false_frees']} false frees, "
            f"{s['stale_used']} stale reads used",
            loc="left",
            fontsize=9,
            color=_COLORS.get(r.policy),
            fontweight="bold",
        )
        ax.grid(axis="y", color="0.92")
        ax.set_ylabel("k blocks", fontsize=8)
    context: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in _COLORS:  # the policies are named by their panels' titles
                context.setdefault(label, handle)
    fig.legend(
        list(context.values()),
        list(context.keys()),
        loc="upper center",
        ncol=max(1, len(context)),
        fontsize=8,
        frameon=False,
        bbox_to_anchor=(0.5, 0.965),
    )
    axes[-1].set_xlabel("time (s)")
    fig.suptitle("Pinned prefill KV blocks (thousands) through a burst, a stall and a decoder crash", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.945))
    return fig


def _xy(r: RunResult) -> tuple[list[float], list[float]]:
    return [t for t, _ in r.timeline], [b / 1000.0 for _, b in r.timeline]


def reclaim_cdf_figure(results: list[RunResult]) -> Any:
    """Reclaim latency on a log axis labelled at round seconds only (matplotlib's own minor-tick
    labels, ``2x10^1 3x10^1 4x10^1``, ran into each other). The curves that coincide (every
    policy that frees within the initial lease) are drawn widest first, so each shows."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

    fig, ax = plt.subplots(figsize=(7, 3.8), dpi=100)
    drawn = [r for r in results if r.reclaim_latencies]
    for r in sorted(drawn, key=lambda r: -_CDF_WIDTH.get(r.policy, 1.5)):
        lat = sorted(r.reclaim_latencies)
        ys = [(i + 1) / len(lat) for i in range(len(lat))]
        width = _CDF_WIDTH.get(r.policy, 1.5)
        ax.step(
            lat,
            ys,
            where="post",
            label=f"{r.policy} (max {lat[-1]:.1f} s)",
            color=_COLORS.get(r.policy),
            linestyle="-" if width > 4 else _STYLES.get(r.policy, "-"),
            lw=width,
            alpha=0.4 if width > 4 else 1.0,
        )
    ax.set_xscale("log")
    lo = min((min(r.reclaim_latencies) for r in drawn), default=1.0) * 0.7
    ax.set_xlim(max(0.5, lo), 700)
    ax.xaxis.set_major_locator(FixedLocator([t for t in (1, 2, 5, 10, 20, 30, 60, 120, 240, 480) if t >= lo]))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.grid(axis="x", color="0.9")
    ax.set_xlabel("seconds from decoder death to the blocks' free (log scale)")
    ax.set_ylabel("fraction of the dead decoder's leases")
    ax.set_title("Reclaim latency after a decoder crash")
    if drawn:
        ax.legend(fontsize=8, loc="center")
    fig.tight_layout()
    return fig


def _load_sweep(seed: int, rates: list[float], duration: float) -> dict[str, list[int]]:
    """Prefills wasted by every policy at each burst rate, without a crash or a stall."""
    wasted: dict[str, list[int]] = {p.value: [] for p in Policy}
    with _progress() as progress:
        task = progress.add_task("load sweep", total=len(rates) * len(Policy))
        for rate in rates:
            burst = (duration / 5.0, duration / 5.0, rate)
            swept = default_scenario(seed, duration=duration, crash_at=None, burst=burst, stall=None)
            for p in Policy:
                wasted[p.value].append(_Cluster(swept, p).run().recomputed)
                progress.advance(task)
    return wasted


def wasted_prefills_figure(wasted: dict[str, list[int]], rates: list[float], duration: float) -> Any:
    """Every policy at every burst rate: bars side by side, each labelled with its count, so
    the policies that waste nothing show as zeros in their own place (drawn as lines, the 480 s
    baseline's zeros hid under kvlease's)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.8), dpi=100)
    slot = 0.8 / len(wasted)
    top = max(1, *(max(ys) for ys in wasted.values()))
    for i, (name, ys) in enumerate(wasted.items()):
        xs = [j + (i - (len(wasted) - 1) / 2) * slot for j in range(len(rates))]
        hatch = {"fixed-30s": "//", "vllm-hb": ".."}.get(name)
        ax.bar(xs, ys, slot * 0.92, label=name, color=_COLORS.get(name), hatch=hatch, edgecolor="white", lw=0)
        for x, y in zip(xs, ys, strict=True):
            ax.text(x, y + top * 0.015, f"{y:,}", ha="center", va="bottom", fontsize=8, color=_COLORS.get(name))
    ax.set_xticks(range(len(rates)), [f"{r:g}" for r in rates])
    ax.set_ylim(0, top * 1.15)
    ax.set_xlabel(f"burst arrival rate for {duration / 5:.0f} s (requests/s; the decoders serve about 12/s)")
    ax.set_ylabel("prefills wasted and recomputed")
    ax.set_title(f"Wasted prefills vs load ({duration:.0f} s simulated per bar; no crash, no stall)")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", color="0.92")
    ax.set_axisbelow(True)
    fig.tight_layout()
    return fig


def _campaign(n: int, first: int, out: Path | None, bug: str | None, as_json: bool, max_reports: int) -> int:
    from rich.console import Console

    console = Console(stderr=as_json)
    pinner_factory, accessor_factory = BUGS[bug] if bug else (None, None)
    failures: list[tuple[int, Any]] = []
    by_claim: dict[str, int] = {}
    events = 0
    started = time.perf_counter()
    with _progress() as progress:
        task = progress.add_task("campaign", total=n)
        for seed in range(first, first + n):
            result = run_seed(seed, pinner_factory=pinner_factory, accessor_factory=accessor_factory)
            events += result.events
            if result.violations:
                failures.append((seed, result.violations))
                for claim in {v.claim for v in result.violations}:
                    by_claim[claim] = by_claim.get(claim, 0) + 1
            progress.update(task, advance=1, description=f"campaign ({len(failures)} failing)")
    elapsed = time.perf_counter() - started
    records = []
    for seed, violations in failures[:max_reports]:
        first_v = violations[0]
        scenario = minimize(
            campaign_scenario(seed), first_v.claim, pinner_factory=pinner_factory, accessor_factory=accessor_factory
        )
        rerun = run_scenario(scenario, pinner_factory=pinner_factory, accessor_factory=accessor_factory, trace=True)
        violation = next((v for v in rerun.violations if v.claim == first_v.claim), first_v)
        record = failure_record(
            scenario, rerun, violation, original_seed=seed, note=f"injected bug: {bug}" if bug else ""
        )
        records.append(record)
        if out is not None:
            # Vectors at the top (`kvlease conformance --vectors OUT` replays them), the
            # simulator's own trace records in traces/ (`kvlease sim --replay FILE`).
            (out / "traces").mkdir(parents=True, exist_ok=True)
            path = out / "traces" / f"sim-violation-seed{seed}-{violation.claim}.json"
            path.write_text(json.dumps(record, indent=1) + "\n")
            record["written_to"] = str(path)
            vector = record_vector(
                scenario,
                violation.claim,
                name=f"sim_seed{seed}_{violation.claim.replace('-', '_')}",
                pinner_factory=pinner_factory,
                accessor_factory=accessor_factory,
            )
            if vector is not None:
                vpath = out / f"sim_seed{seed}_{violation.claim.replace('-', '_')}.json"
                vpath.write_text(json.dumps(vector, indent=1) + "\n")
                record["vector_written_to"] = str(vpath)
        if not as_json:
            console.print(f"[bold red]seed {seed}[/]: {violation.claim} at {violation.at:.6f}: {violation.detail}")
            console.print(f"  minimized: {len(scenario.faults)} fault(s), {scenario.max_requests} request(s); trace:")
            for t, who, what, detail in record["trace"][-25:]:
                console.print(f"    {t:14.6f} {who:6} {what:14} {detail[:150]}", markup=False, highlight=False)
            if out is not None:
                console.print(f"  written to {record['written_to']}")
                if "vector_written_to" in record:
                    console.print(f"  conformance-vector candidate: {record['vector_written_to']}")
    summary = {
        "seeds": n,
        "first_seed": first,
        "injected_bug": bug,
        "events": events,
        "seconds": round(elapsed, 3),
        "failing_seeds": [s for s, _ in failures],
        "by_claim": by_claim,
        "reports": records,
    }
    if as_json:
        click.echo(json.dumps(summary, indent=1))
    else:
        verdict = "[bold green]no violations[/]" if not failures else f"[bold red]{len(failures)} failing seed(s)[/]"
        console.print(
            f"campaign: {n} seeds ({first}..{first + n - 1}), {events:,} events in {elapsed:.1f} s: {verdict}"
            + (f" {by_claim}" if by_claim else "")
        )
    return 1 if failures else 0


#: The ranges the options accept: wide enough for any study, narrow enough that a run ends
#: (a simulated hour at 100 requests/s is minutes of wall time per policy).
_MAX_DURATION = 3600.0
_MAX_RATE = 100.0
_MAX_BURST_RATE = 200.0
_SEEDS = click.IntRange(0, 2**32 - 1)
_Seconds = Number(0.0, _MAX_DURATION)
_BURST = FloatTuple(
    (
        ("START", _Seconds),
        ("LENGTH", Number(0.0, _MAX_DURATION, min_open=True)),
        ("RATE", Number(0.0, _MAX_BURST_RATE, min_open=True)),
    )
)
_STALL = FloatTuple((("START", _Seconds), ("LENGTH", Number(0.0, _MAX_DURATION, min_open=True))))


def _replay_record(
    ctx: click.Context, param: click.Parameter, value: Path | None
) -> tuple[Scenario, str | None] | None:
    """A violation record written by ``--out``: its scenario and injected bug, or a usage error
    naming the file and what is wrong with it."""
    if value is None:
        return None
    try:
        record = json.loads(value.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise click.BadParameter(f"{value} is not a violation record written by --out (not JSON: {exc})") from None
    try:
        scenario = Scenario.from_json(record["scenario"])
        bug = (record.get("note") or "").removeprefix("injected bug: ") or None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise click.BadParameter(
            f"{value} is not a violation record written by --out (no valid 'scenario': {type(exc).__name__}: {exc})"
        ) from None
    if bug is not None and bug not in BUGS:
        raise click.BadParameter(f"{value} names an unknown injected bug {bug!r}; known: {', '.join(sorted(BUGS))}")
    return scenario, bug


@click.command()
@click.option("--seed", type=_SEEDS, default=1, show_default=True, help="Workload and fault seed.")
@click.option(
    "--policy",
    "policies",
    multiple=True,
    type=click.Choice(_POLICY_NAMES),
    help="Policies to compare (repeatable; default: all).",
)
@click.option(
    "--duration",
    type=Number(0.0, _MAX_DURATION, min_open=True),
    default=900.0,
    show_default=True,
    help="Simulated seconds.",
)
@click.option(
    "--rate",
    type=Number(0.0, _MAX_RATE, min_open=True),
    default=5.0,
    show_default=True,
    help="Arrivals per second outside the burst.",
)
@click.option(
    "--crash-at",
    type=Number(None, _MAX_DURATION),
    default=240.0,
    show_default=True,
    help="When decoder D1 crashes (negative: never).",
)
@click.option(
    "--burst",
    type=_BURST,
    default="200,60,25",
    show_default=True,
    help=f"START,LENGTH,RATE of the burst (seconds, seconds > 0, 0 < requests/s <= {_MAX_BURST_RATE:g}), or 'none'.",
)
@click.option(
    "--stall",
    type=_STALL,
    default="230,25",
    show_default=True,
    help="START,LENGTH (seconds, LENGTH > 0) of one stalled forward pass of D2, or 'none'.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--markdown", is_flag=True, help="Print the comparison as a Markdown table.")
@click.option(
    "--plot",
    "plot_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Also write three PNG figures here. Slow: the wasted-prefills figure simulates a load sweep (each --sweep "
    "rate x 4 policies, 60-300 s each), so the whole run takes about 3x as long as the table alone at the defaults "
    "(about 30 s instead of 10 on one core), more for a short --duration; it says how much longer when it starts.",
)
@click.option(
    "--sweep",
    type=FloatList(Number(0.0, _MAX_BURST_RATE, min_open=True), max_items=20),
    default="10,15,20,25,30",
    show_default=True,
    help=f"Burst rates for the wasted-prefills figure (1 to 20, each 0 < requests/s <= {_MAX_BURST_RATE:g}).",
)
@click.option(
    "--campaign", "campaign_n", type=click.IntRange(1, 10**6), help="Run the fault campaign over N seeds instead."
)
@click.option("--first-seed", type=_SEEDS, default=0, show_default=True, help="First campaign seed.")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    help="Campaign: write each violation here as a conformance-vector candidate (replay: kvlease conformance "
    "--vectors DIR) and, in DIR/traces, as a simulator record (replay: kvlease sim --replay FILE).",
)
@click.option(
    "--inject-bug",
    type=BugName(list(BUGS), {}),
    help="Campaign: run a deliberately broken core, to see the campaign fail (the same name as "
    "`kvlease check --inject-bug` where both have the bug).",
)
@click.option(
    "--max-reports",
    type=click.IntRange(0, 100),
    default=3,
    show_default=True,
    help="Campaign: minimize and report this many.",
)
@click.option(
    "--replay",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    callback=_replay_record,
    help="Rerun the scenario of a violation record written by --out.",
)
def sim(
    seed: int,
    policies: tuple[str, ...],
    duration: float,
    rate: float,
    crash_at: float,
    burst: tuple[float, float, float] | None,
    stall: tuple[float, float] | None,
    as_json: bool,
    markdown: bool,
    plot_dir: Path | None,
    sweep: list[float],
    campaign_n: int | None,
    first_seed: int,
    out: Path | None,
    inject_bug: str | None,
    max_reports: int,
    replay: tuple[Scenario, str | None] | None,
) -> None:
    """Simulate a P/D cluster running the real kvlease core (virtual time, simulated network).

    Default: compare fixed 480 s and 30 s timeouts, kvlease renewal and vLLM-style silent
    heartbeats on one seeded workload with a burst and a decoder crash. With --campaign N: run
    N small adversarial seeds and check every safety and liveness claim (exit status 1 on a
    violation).
    """
    if replay is not None:
        scenario, bug = replay
        pf, af = BUGS[bug] if bug else (None, None)
        result = run_scenario(scenario, pinner_factory=pf, accessor_factory=af)
        click.echo(json.dumps([v.to_json() for v in result.violations], indent=1))
        sys.exit(1 if result.violations else 0)
    if campaign_n is not None:
        sys.exit(_campaign(campaign_n, first_seed, out, inject_bug, as_json, max_reports))
    chosen = [Policy(p) for p in policies] if policies else list(Policy)
    sweep_duration = max(60.0, min(300.0, duration))
    if plot_dir is not None:
        _check_matplotlib()  # before minutes of simulation, not after
        factor = 1 + len(sweep) * len(Policy) * sweep_duration / (len(chosen) * duration)
        click.echo(
            f"--plot: after the table, a load sweep of {len(sweep) * len(Policy)} runs of {sweep_duration:.0f} s "
            f"for the figures; about {factor:.0f}x as long as the table alone",
            err=True,
        )
    scenario = default_scenario(
        seed,
        duration=duration,
        rate=rate,
        crash_at=crash_at if crash_at >= 0 else None,
        burst=burst,
        stall=stall,
    )
    started = time.perf_counter()
    results = _run_policies(scenario, chosen)
    elapsed = time.perf_counter() - started
    if as_json:
        click.echo(json.dumps({"scenario": scenario.to_json(), "results": [r.summary() for r in results]}, indent=1))
    elif markdown:
        click.echo(markdown_table(results))
    else:
        events = sum(r.events for r in results)
        _table(results, f"seed {seed}: {duration:.0f} s simulated, {events:,} events in {elapsed:.1f} s")
    if plot_dir is not None:
        for path in _plots(plot_dir, results, scenario, sweep, sweep_duration):
            click.echo(f"wrote {path}", err=as_json)
    if any(r.violations for r in results if r.policy == Policy.KVLEASE.value):
        sys.exit(1)
