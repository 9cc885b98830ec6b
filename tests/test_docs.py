"""The pages under docs/ are tested like code: every code block runs (or says why it cannot) and
prints what the page shows under it; every link resolves; every setting, metric, bug name and
log line a page names exists in the code. The rules: docs/testing.md, "How these pages are
checked". The README's own contract is tests/test_readme.py; figures are tests/test_doc_figures.py.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
from pathlib import Path

import pytest
from _docs import README, ROOT, Block, Page, all_pages, parse, rel, repository_url, run_block

DOC_PAGES = [p for p in all_pages() if p.path != README]
ALL_BLOCKS = [b for p in all_pages() for b in p.blocks]
DOC_BLOCKS = [b for p in DOC_PAGES for b in p.blocks]
#: Blocks this module executes (the README's python blocks are tests/test_readme.py's).
RUN_BLOCKS = [
    b
    for b in ALL_BLOCKS
    if (b.lang == "python" and (b.marker is None or b.marker.kind != "not run") and b.page != README)
    or (b.marker is not None and b.marker.kind == "run")
]


def _id(block: Block) -> str:
    return block.where


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=_id)
def test_code_block_runs_and_prints_what_the_page_shows(block: Block, tmp_path: Path) -> None:
    run_block(block, tmp_path)


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=_id)
def test_every_block_runs_or_says_why_not(block: Block) -> None:
    m = block.marker
    if block.is_output:
        return
    if m is not None and m.kind == "not run":
        assert m.arg, f"{block.where}: <!-- not run: REASON --> needs its reason"
        assert block.output is None, f"{block.where}: shows an output for a block that does not run"
        return
    if m is not None and m.kind in ("figure", "measured"):
        assert block.lang == "text", f"{block.where}: a captured figure is a ```text block"
        return
    if block.lang == "python" or (m is not None and m.kind == "run"):
        return
    raise AssertionError(
        f"{block.where}: a ```{block.lang or '(no language)'} block that neither runs nor says why: mark it "
        "<!-- run -->, <!-- not run: REASON -->, or (captured output) <!-- measured: CMD -->"
    )


def test_the_pages_have_blocks_that_run() -> None:
    """The rules above cannot pass by finding nothing."""
    assert len([b for b in RUN_BLOCKS if b.output is not None]) >= 6


# -- links --------------------------------------------------------------------------------------


def _target_file(page: Path, target: str) -> Path | None:
    """The repository file a link points at, or None for a link outside the repository."""
    repo = repository_url()
    path = target.split("#", 1)[0]
    if path.startswith(("http://", "https://")):
        m = re.match(re.escape(repo) + r"/(?:blob|raw|tree)/main/(.+)$", path)
        return ROOT / m.group(1) if m else None
    if path.startswith("mailto:") or not path:
        return None
    return (page.parent / path).resolve()


@pytest.mark.parametrize("pg", DOC_PAGES, ids=lambda p: rel(p.path))
def test_links_in_docs_resolve(pg: Page) -> None:
    for line, target in pg.links:
        f = _target_file(pg.path, target)
        if f is None:
            assert not target.startswith(repository_url()), f"{rel(pg.path)}:{line}: {target} is not a file of main"
            continue
        assert f.exists(), f"{rel(pg.path)}:{line}: {target} -> {f} does not exist"
        assert ROOT in f.parents or f == ROOT, f"{rel(pg.path)}:{line}: {target} points outside the repository"
        if "#" in target and f.suffix == ".md":
            fragment = target.split("#", 1)[1]
            assert fragment in parse(f).anchors(), f"{rel(pg.path)}:{line}: {f.name} has no heading #{fragment}"


def test_every_docs_page_is_reachable_from_the_index() -> None:
    index = parse(ROOT / "docs" / "index.md")
    linked = {_target_file(index.path, t) for _, t in index.links}
    for page in DOC_PAGES:
        if page.path.name != "index.md":
            assert page.path.resolve() in linked, f"docs/index.md does not link {rel(page.path)}"


# -- names the pages use exist in the code --------------------------------------------------------


def _text_of_docs() -> str:
    return "\n".join(p.visible_text() for p in all_pages())


def _vllm_counters() -> set[str]:
    """``vllm:kvlease_*`` counter names, read from adapters/vllm/_metrics.py (it imports vLLM)."""
    tree = ast.parse((ROOT / "adapters" / "vllm" / "_metrics.py").read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id.endswith("COUNTERS")
        ):
            assert isinstance(node.value, ast.Dict)
            names |= {k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    assert "leases_expired" in names
    return names


def _collector_families() -> set[str]:
    """The families of kvlease.transports.metrics (counters without ``_total``) and the SGLang
    adapter's own, read from their sources."""
    families = set(re.findall(r'"(kvlease_[a-z_]+)"', (ROOT / "transports" / "metrics.py").read_text()))
    from kvlease.transports import metrics  # the metrics extra

    families |= {f"kvlease_{name}" for name, _field, _help in metrics._COUNTERS}
    sglang = (ROOT / "adapters" / "sglang" / "_metrics.py").read_text()
    families |= set(re.findall(r'"(kvlease_sglang_[a-z_]+)"', sglang))
    # The adapter's own counters, named after ``kvlease_sglang_`` in its ADAPTER table.
    table = sglang[sglang.index("ADAPTER: tuple") :]
    families |= {f"kvlease_sglang_{name}" for name in re.findall(r'^\s+\("([a-z_]+)",', table, flags=re.M)}
    return families


def test_every_metric_a_page_names_exists() -> None:
    from kvlease.adapters.vllm._settings import ADAPTER_KEYS

    vllm = _vllm_counters()
    collector = _collector_families()
    bare = {f"kvlease_{n}" for n in vllm} | collector
    seen = 0
    for page in all_pages():
        text = page.visible_text()
        for m in re.finditer(r"(?<![a-z_])(vllm:)?(kvlease_[a-z_]*[a-z])(?![a-z_(])", text):
            name = m.group(2)
            if name in ADAPTER_KEYS or name.endswith("_") or name in ("kvlease_connector_module_path",):
                continue
            base = name.removesuffix("_total")
            where = f"{rel(page.path)}: {m.group(0)}"
            if m.group(1):
                assert name.endswith("_total") and base.removeprefix("kvlease_") in vllm, f"{where}: not a vLLM counter"
            else:
                assert base in bare or name in bare, f"{where}: no such metric family (or adapter key)"
            seen += 1
    assert seen >= 20


def test_every_counter_in_a_table_of_counter_names_exists() -> None:
    """A table headed `<name>` lists counters by their bare name (``vllm:kvlease_<name>_total``,
    ``kvlease_<name>_total``): each is exported by both adapters unless marked "(vLLM)"."""
    vllm, collector = _vllm_counters(), _collector_families()
    tables = [t for p in all_pages() for t in p.tables if t.header[0] == "`<name>`"]
    assert tables, "the README's 'What to watch' table"
    for table in tables:
        for row in table.rows:
            for name in re.findall(r"`([a-z_]+)`( \(vLLM\))?", row[0]):
                assert name[0] in vllm, f"{table.where}: {name[0]} is not a vLLM counter"
                if not name[1]:
                    assert f"kvlease_{name[0]}" in collector, f"{table.where}: {name[0]} is not exported for SGLang"


def _sglang_env() -> set[str]:
    from kvlease.adapters.sglang._settings import ENV

    return set(ENV)


def test_every_sglang_variable_a_page_names_exists_and_the_adapter_page_names_all() -> None:
    env = _sglang_env()
    for page in all_pages():
        for name in set(re.findall(r"SGLANG_KVLEASE_[A-Z_]*[A-Z]", page.visible_text())):
            assert name in env, f"{rel(page.path)}: {name} is not a setting of the SGLang adapter"
    adapter_page = (ROOT / "docs" / "adapter-sglang.md").read_text()
    assert not [v for v in env if v not in adapter_page], "docs/adapter-sglang.md leaves settings out"


def _transfer_configs() -> list[tuple[Block, dict[str, object]]]:
    out = []
    for block in ALL_BLOCKS:
        for m in re.finditer(r"--kv-transfer-config\s*\\?\s*'(.*?)'", block.body, flags=re.S):
            out.append((block, json.loads(m.group(1).replace("\\\n", ""))))
    return out


def test_every_vllm_transfer_config_loads_kvlease_with_valid_settings() -> None:
    from kvlease.adapters.vllm import __all__ as exported
    from kvlease.adapters.vllm._settings import read_settings, unknown_keys

    configs = _transfer_configs()
    assert len(configs) >= 6, "the README and the vLLM page show the producer and consumer configs"
    for block, cfg in configs:
        assert cfg["kv_connector_module_path"] == "kvlease.adapters.vllm", block.where
        assert cfg["kv_connector"] in exported, f"{block.where}: kvlease.adapters.vllm has no {cfg['kv_connector']}"
        assert cfg["kv_role"] in ("kv_producer", "kv_consumer", "kv_both"), block.where
        extra = cfg.get("kv_connector_extra_config", {})
        assert isinstance(extra, dict)
        read_settings(extra)  # raises ConfigError naming a bad key
        assert not unknown_keys(extra), f"{block.where}: {unknown_keys(extra)}"


def test_every_vllm_setting_in_the_settings_table_is_read_by_the_adapter() -> None:
    from kvlease.adapters.vllm._settings import ADAPTER_KEYS, LEASE_KEYS

    page = parse(ROOT / "docs" / "adapter-vllm.md")
    (table,) = [t for t in page.tables if t.header[0] == "key"]
    keys = {k for row in table.rows for k in re.findall(r"`([a-z_]+)`", row[0])}
    assert keys == set(LEASE_KEYS) | set(ADAPTER_KEYS), keys ^ (set(LEASE_KEYS) | set(ADAPTER_KEYS))


def test_every_inject_bug_a_page_names_exists() -> None:
    from kvlease.check import CHECK_BUGS
    from kvlease.sim import BUGS

    names = 0
    text = _text_of_docs()
    for m in re.finditer(r"kvlease (sim|check)\b[^`\n]*?--inject-bug ([a-z][a-z-]*[a-z])", text):
        valid = BUGS if m.group(1) == "sim" else CHECK_BUGS
        assert m.group(2) in valid, f"`{m.group(0)}`: {m.group(2)} is not a {m.group(1)} --inject-bug"
        names += 1
    for m in re.finditer(r"--inject-bug ((?:[a-z][a-z-]*[a-z]\s*\|\s*)+[a-z][a-z-]*[a-z])", text):
        for name in re.split(r"\s*\|\s*", m.group(1)):
            assert name in BUGS or name in CHECK_BUGS, f"--inject-bug {name}: no such bug"
            names += 1
    for m in re.finditer(r"^\| `([a-z][a-z-]*)`", text, flags=re.M):
        if m.group(1) in BUGS or m.group(1) in CHECK_BUGS:
            names += 1
    assert names >= 15


def _log_formats() -> list[str]:
    """Every logging format string in adapters/ and transports/, placeholders as ``…``."""
    out = []
    for path in [*(ROOT / "adapters").rglob("*.py"), *(ROOT / "transports").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            # log.warning(FORMAT, ...), and log.log(LEVEL, FORMAT, ...)
            at = {"debug": 0, "info": 0, "warning": 0, "error": 0, "log": 1}.get(node.func.attr)
            if at is None or len(node.args) <= at:
                continue
            fmt = node.args[at]
            if isinstance(fmt, ast.Constant) and isinstance(fmt.value, str):
                out.append(re.sub(r"%[-.\d]*[srdfg]", "…", fmt.value))
    return out


def test_every_log_line_a_page_quotes_is_logged() -> None:
    formats = _log_formats()
    quoted = 0
    for page in all_pages():
        for m in re.finditer(r"`(kvlease(?::| peer) [^`]+)`", page.visible_text()):
            line = re.sub(r"<[^>]+>", "…", m.group(1))
            prefix = line.removesuffix("...")
            if line.endswith("..."):
                ok = any(
                    f.startswith(prefix) or re.fullmatch(re.escape(prefix).replace("…", ".*") + ".*", f)
                    for f in formats
                )
            else:
                ok = line in formats
            if line.strip() in ("kvlease:", "kvlease peer"):
                continue
            assert ok, f"{rel(page.path)}: `{m.group(1)}` is not a log line of adapters/ or transports/"
            quoted += 1
    assert quoted >= 10


def test_the_shell_commands_the_pages_name_parse() -> None:
    """Cheap insurance for blocks that cannot run: each `kvlease SUBCOMMAND` line names a
    subcommand that exists and options it accepts (``--help`` after them must succeed)."""
    from click.testing import CliRunner

    from kvlease.cli import main

    runner = CliRunner()
    for block in ALL_BLOCKS:
        if block.lang != "bash":
            continue
        for raw in block.body.replace("\\\n", " ").splitlines():
            cmd = raw.split("#", 1)[0].strip()
            if not cmd.startswith("kvlease "):
                continue
            argv = shlex.split(cmd.split("|", 1)[0].split("2>&1", 1)[0])[1:]
            result = runner.invoke(main, [*argv, "--help"])
            assert result.exit_code == 0, f"{block.where}: `{cmd}` does not parse:\n{result.output}"
