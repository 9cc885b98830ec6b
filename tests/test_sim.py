"""The cluster simulator: determinism, the policy comparison's qualitative claims, the CLI.

Every run drives the real `Pinner` / `Accessor` with encode/decode on every message; only time
and the network are simulated. The inequalities are the seed's argument: a fixed 480 s timeout
holds dead memory after a decoder crash, a fixed 30 s timeout frees leases of requests that are
merely queued during a burst, renewal does neither, and acknowledgements turn the stale reads
of silent (vLLM-style) heartbeats into reported losses.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kvlease.cli._sim import sim
from kvlease.sim import Cluster, Policy, RunResult, default_scenario


def _digest(result: RunResult) -> str:
    blob = json.dumps([result.summary(), result.timeline, result.reclaim_latencies], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


_SMALL = {"duration": 120.0, "crash_at": 60.0, "burst": (30.0, 20.0, 25.0), "stall": (40.0, 25.0)}

_DIGEST_PROBE = """
import hashlib, json
from kvlease.sim import Cluster, Policy, default_scenario
r = Cluster(default_scenario(7, duration=120.0, crash_at=60.0, burst=(30.0, 20.0, 25.0), stall=(40.0, 25.0)),
            Policy.KVLEASE).run()
print(hashlib.sha256(json.dumps([r.summary(), r.timeline, r.reclaim_latencies], sort_keys=True).encode()).hexdigest())
"""


def test_a_fixed_seed_reproduces_bit_identical_results() -> None:
    a = Cluster(default_scenario(7, **_SMALL), Policy.KVLEASE).run()  # type: ignore[arg-type]
    b = Cluster(default_scenario(7, **_SMALL), Policy.KVLEASE).run()  # type: ignore[arg-type]
    assert a.events > 10_000 and a.completed > 100
    assert _digest(a) == _digest(b)
    # Another process with another string-hash seed: nothing may depend on set/dict order of str.
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", _DIGEST_PROBE], capture_output=True, text=True, check=True, env=env, timeout=300
    )
    assert out.stdout.strip() == _digest(a)
    # And the seed matters: another seed is another run.
    c = Cluster(default_scenario(8, **_SMALL), Policy.KVLEASE).run()  # type: ignore[arg-type]
    assert _digest(c) != _digest(a)


@pytest.fixture(scope="module")
def crash_runs() -> dict[Policy, RunResult]:
    """Decoder D1 crashes in the middle of a burst (its queue is full of leased requests)."""
    sc = default_scenario(3, duration=300.0, crash_at=100.0, burst=(80.0, 40.0, 25.0), stall=None)
    return {p: Cluster(sc, p).run() for p in (Policy.FIXED_480, Policy.FIXED_30, Policy.KVLEASE)}


@pytest.fixture(scope="module")
def burst_runs() -> dict[Policy, RunResult]:
    """A burst overloads the decoders: requests queue for longer than 30 s. Nothing fails."""
    sc = default_scenario(4, duration=200.0, crash_at=None, burst=(30.0, 60.0, 25.0), stall=None)
    return {p: Cluster(sc, p).run() for p in (Policy.FIXED_480, Policy.FIXED_30, Policy.KVLEASE)}


@pytest.fixture(scope="module")
def stall_runs() -> dict[Policy, RunResult]:
    """During a burst, one forward pass of D2 stalls for 25 s (longer than the 20 s extension)."""
    sc = default_scenario(4, duration=130.0, crash_at=None, burst=(30.0, 60.0, 25.0), stall=(75.0, 25.0))
    return {p: Cluster(sc, p).run() for p in (Policy.KVLEASE, Policy.VLLM_HB)}


def test_renewal_holds_far_fewer_dead_blocks_than_480s_after_a_crash(crash_runs: dict[Policy, RunResult]) -> None:
    kv, f480, f30 = crash_runs[Policy.KVLEASE], crash_runs[Policy.FIXED_480], crash_runs[Policy.FIXED_30]
    assert kv.reclaim_latencies
    assert kv.dead_block_seconds * 5 < f480.dead_block_seconds
    # Every lease of the dead decoder is reclaimed within the initial lease (30 s) plus the
    # pinner's step; under the 480 s timeout none is reclaimed in the 200 s the run lasts
    # after the crash, and the dead blocks are still pinned at the end.
    assert max(kv.reclaim_latencies) <= 30.0 * (1 + 1e-4) + 0.2
    assert not f480.reclaim_latencies and f480.timeline[-1][1] > 0 and kv.timeline[-1][1] == 0
    # 30 s frees dead leases about as fast, but (below) at the price of false frees.
    assert kv.dead_block_seconds <= f30.dead_block_seconds * 1.5
    assert not kv.violations and kv.stale_used == 0


def test_renewal_has_far_fewer_false_frees_than_30s_under_a_burst(burst_runs: dict[Policy, RunResult]) -> None:
    kv, f30, f480 = burst_runs[Policy.KVLEASE], burst_runs[Policy.FIXED_30], burst_runs[Policy.FIXED_480]
    assert f30.false_frees >= 100 and f30.recomputed >= 100
    assert kv.false_frees == 0 and kv.recomputed == 0 and kv.leases_lost == 0
    assert f480.false_frees == 0  # it has other problems (the crash test)
    assert not kv.violations and kv.stale_used == 0


def test_acks_turn_silent_stale_reads_into_reported_losses(stall_runs: dict[Policy, RunResult]) -> None:
    kv, hb = stall_runs[Policy.KVLEASE], stall_runs[Policy.VLLM_HB]
    # The 25 s stall: the pinner expires leases of requests queued at D2. With silent
    # heartbeats D2 later reads the freed blocks and uses them; kvlease reports them lost.
    assert hb.stale_used > 0
    assert kv.stale_used == 0 and kv.leases_lost > 0 and not kv.violations
    assert kv.heartbeat_bytes > hb.heartbeat_bytes > 0  # acks cost bytes: the table shows how many


def test_cli_json_and_markdown() -> None:
    runner = CliRunner()
    args = ["--duration", "60", "--crash-at", "30", "--burst", "10,10,25", "--stall", "none", "--seed", "2"]
    res = runner.invoke(sim, [*args, "--policy", "kvlease", "--policy", "fixed-30s", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert [r["policy"] for r in data["results"]] == ["kvlease", "fixed-30s"]
    assert data["scenario"]["seed"] == 2
    assert data["results"][0]["violations"] == []
    res = runner.invoke(sim, [*args, "--policy", "kvlease", "--markdown"])
    assert res.exit_code == 0, res.output
    assert res.output.startswith("| policy |") and "| kvlease |" in res.output


def test_cli_plot_writes_small_pngs(tmp_path: Path) -> None:
    res = CliRunner().invoke(
        sim, ["--duration", "60", "--crash-at", "20", "--burst", "10,10,25", "--sweep", "20", "--plot", str(tmp_path)]
    )
    assert res.exit_code == 0, res.output
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == ["sim-pinned-memory.png", "sim-reclaim-cdf.png", "sim-wasted-prefills.png"]
    for p in tmp_path.glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert 5_000 < p.stat().st_size < 200_000


def _overlapping_text(fig: Any) -> list[tuple[str, str]]:
    """Pairs of text drawn on `fig` whose boxes intersect: the tick labels of ticks in view,
    titles, axis labels, legend entries and annotations."""
    from matplotlib.text import Text

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts: list[Text] = []
    ticks: set[int] = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            for tick in [*axis.get_major_ticks(), *axis.get_minor_ticks()]:
                ticks.add(id(tick.label1))
                if lo <= tick.get_loc() <= hi:  # matplotlib draws only these
                    texts.append(tick.label1)
    texts += [t for t in fig.findobj(Text) if id(t) not in ticks and not any(t is u for u in texts)]
    boxes = []
    for t in texts:
        if t.get_visible() and t.get_text().strip():
            boxes.append((t.get_text(), t.get_window_extent(renderer)))
    return [(a, b) for i, (a, ba) in enumerate(boxes) for b, bb in boxes[i + 1 :] if ba.overlaps(bb)]


@pytest.fixture(scope="module")
def figures() -> dict[str, Any]:
    import matplotlib

    matplotlib.use("Agg")
    from kvlease.cli import _sim

    # Long enough after the crash for the 480 s timeout to reclaim: the CDF spans 25..480 s.
    sc = default_scenario(1, duration=540.0, rate=0.5, crash_at=40.0, burst=(20.0, 20.0, 25.0), stall=(30.0, 25.0))
    results = [Cluster(sc, p).run() for p in Policy]
    assert max(results[0].reclaim_latencies) > 479 and min(results[2].reclaim_latencies) < 30
    wasted = _sim._load_sweep(1, [5.0, 40.0], 100.0)
    return {
        "pinned": _sim.pinned_memory_figure(results, sc),
        "cdf": _sim.reclaim_cdf_figure(results),
        "wasted": _sim.wasted_prefills_figure(wasted, [5.0, 40.0], 100.0),
        "wasted_counts": wasted,
    }


@pytest.mark.parametrize("name", ["pinned", "cdf", "wasted"])
def test_no_text_of_a_figure_runs_into_another(figures: dict[str, Any], name: str) -> None:
    # The reclaim CDF's log axis used to label minor ticks: "2x10^1 3x10^1 4x10^1" overlapped.
    assert _overlapping_text(figures[name]) == []


def test_the_pinned_memory_figure_gives_each_policy_its_own_panel(figures: dict[str, Any]) -> None:
    from kvlease.cli._sim import _COLORS

    # Three of the policies pin the same memory: on one axis they were drawn on top of each other.
    panels = figures["pinned"].axes
    assert len(panels) == len(Policy)
    for ax, policy in zip(panels, Policy, strict=True):
        coloured = {ln.get_color() for ln in ax.get_lines() if ln.get_color() in _COLORS.values()}
        assert coloured == {_COLORS[policy.value]}, (policy, coloured)
        assert ax.get_title(loc="left").startswith(f"{policy.value}: ")


def test_the_wasted_prefills_figure_shows_every_policy_each_in_its_own_place(figures: dict[str, Any]) -> None:
    # vllm-hb was left out, and the 480 s baseline's zeros hid under kvlease's markers.
    assert list(figures["wasted_counts"]) == [p.value for p in Policy]
    assert figures["wasted_counts"]["fixed-30s"][1] > 0  # bars of different heights
    (ax,) = figures["wasted"].axes
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [p.value for p in Policy]
    bars = {(round(b.get_x(), 6), round(b.get_width(), 6)) for b in ax.patches}
    assert len(bars) == len(Policy) * 2  # every bar at its own x: nothing drawn over another
    labels = sorted(t.get_text() for t in ax.texts)
    counts = sorted(f"{n:,}" for ns in figures["wasted_counts"].values() for n in ns)
    assert labels == counts  # each count written on its bar, the zeros too


def test_plot_says_how_much_longer_it_takes() -> None:
    from kvlease.cli._sim import sim as command

    help_text = CliRunner().invoke(command, ["--help"], terminal_width=200).output
    assert "about 3x as long as the table alone" in " ".join(help_text.split())


def test_the_simulator_loads_no_plotting_or_terminal_library() -> None:
    probe = (
        "import sys, kvlease.sim\nprint(sorted(m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'rich')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


_TABLE_ARGS = ["sim", "--duration", "120", "--crash-at", "30", "--stall", "none", "--seed", "2"]


def _expected_cells() -> dict[str, list[str]]:
    """Each policy's numbers as the table must show them, from the same run's JSON."""
    from kvlease.cli._sim import _COLUMNS, _fmt

    out = subprocess.run(
        [sys.executable, "-m", "kvlease", *_TABLE_ARGS, "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    results = json.loads(out.stdout)["results"]
    cells = {r["policy"]: [_fmt(r[k], f) for k, _, f in _COLUMNS] for r in results}
    assert any(len(c) >= 7 for row in cells.values() for c in row)  # numbers that used to be cut (`351,…`)
    return cells


def test_the_table_piped_at_80_columns_shows_every_number_whole() -> None:
    expected = _expected_cells()
    env = {**os.environ, "COLUMNS": "80"}
    out = subprocess.run(
        [sys.executable, "-m", "kvlease", *_TABLE_ARGS],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        timeout=300,
    ).stdout
    assert "…" not in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    for policy, cells in expected.items():
        assert [c.strip() for c in rows[policy].split("|")[2:-1]] == cells, rows[policy]


# The table in a real terminal (tmux, at 80, 100 and 120 columns): tests/test_sim_terminal.py.


def test_plot_without_matplotlib_names_the_extra(tmp_path: Path) -> None:
    # A `matplotlib` that fails to import, first on the path: a machine without the extra.
    fake = tmp_path / "matplotlib"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(
        [sys.executable, "-m", "kvlease", "sim", "--duration", "30", "--plot", str(tmp_path / "figs")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert "pip install 'kvlease[sim]'" in out.stderr and "--plot" in out.stderr
    assert not (tmp_path / "figs").exists()
