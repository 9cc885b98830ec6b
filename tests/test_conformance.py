"""The conformance vectors pass against the core, in process and through the real subprocess
driver; the runner catches wrong implementations (a dropped output, wrong bytes, a computed time
off by more than the tolerance, bytes accepted that must be refused, a dead or hung driver)."""

from __future__ import annotations

import ast
import copy
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvlease import DecodeError, FrameAuth, decode, decode_vllm
from kvlease.cli._conformance import SubprocessDriver, load_vectors
from kvlease.conformance import JSON, CoreImplementation, JSONDict, compare, run_vector

ROOT = Path(__file__).resolve().parent.parent
VECTORS_DIR = ROOT / "spec" / "vectors"
VECTORS = load_vectors(VECTORS_DIR)
BY_NAME = {str(v["name"]): v for v in VECTORS}
DRIVER = f"{sys.executable} -m kvlease.cli._conformance_driver"


def _obj(v: JSON) -> JSONDict:
    """`v`, which the vector format says is an object."""
    assert isinstance(v, dict), v
    return v


def _arr(v: JSON) -> list[JSON]:
    """`v`, which the vector format says is an array."""
    assert isinstance(v, list), v
    return v


def _expected_outputs(step: JSON) -> list[JSON]:
    return _arr(_obj(_obj(step)["expect"]).get("outputs", []))


REQUIRED = {
    "happy_pull",
    "overload_long_queue",
    "accessor_crash_expiry",
    "late_read",
    "push_mode",
    "fixed_ttl_bidirectional",
    "pinner_restart",
    "hetero_tp_pinner_wider",
    "hetero_tp_accessor_wider",
    "release",
    "vllm_compat",
    "codec",
}


def test_the_required_scenarios_exist() -> None:
    assert set(BY_NAME) >= REQUIRED


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_vector_passes_in_process(name: str) -> None:
    result = run_vector(BY_NAME[name], CoreImplementation())
    assert result.passed, result.mismatch and result.mismatch.render()
    assert result.checked == result.total > 0


@pytest.fixture(scope="module")
def driver() -> Iterator[SubprocessDriver]:
    with SubprocessDriver(DRIVER, timeout=30.0) as drv:
        yield drv


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_vector_passes_through_the_subprocess_driver(driver: SubprocessDriver, name: str) -> None:
    result = run_vector(BY_NAME[name], driver)
    assert result.passed, result.mismatch and result.mismatch.render()


# -- the runner must be able to fail ----------------------------------------------------------

WRONG_DRIVER = """
import json, sys
from kvlease.conformance import CoreImplementation
impl = CoreImplementation()
dropped = False
for line in sys.stdin:
    resp = impl.call(json.loads(line))
    if not dropped and resp.get("outputs"):
        resp["outputs"] = resp["outputs"][:-1]   # forget one output, once
        dropped = True
    print(json.dumps(resp), flush=True)
"""


def test_a_driver_that_drops_one_output_fails(tmp_path: Path) -> None:
    script = tmp_path / "wrong_driver.py"
    script.write_text(WRONG_DRIVER)
    with SubprocessDriver(f"{sys.executable} {script}", timeout=30.0) as drv:
        result = run_vector(BY_NAME["happy_pull"], drv)
    assert not result.passed and result.mismatch is not None
    assert "expected 1 items, got 0" in result.mismatch.why
    assert result.mismatch.index == 1  # track: its HandshakeNeeded was dropped
    assert "HandshakeNeeded" in result.mismatch.render()


def test_the_cli_exits_nonzero_and_shows_the_first_mismatch(tmp_path: Path) -> None:
    script = tmp_path / "wrong_driver.py"
    script.write_text(WRONG_DRIVER)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvlease",
            "conformance",
            "--driver",
            f"{sys.executable} {script}",
            "--only",
            "happy_pull",
            "--only",
            "release",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "First mismatch" in proc.stdout and "happy_pull" in proc.stdout
    assert "FAIL" in proc.stdout


def test_the_cli_passes_in_process() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvlease", "conformance", "--vectors", str(VECTORS_DIR)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"all {len(VECTORS)} vectors pass" in proc.stdout


class _Tampering:
    """Wraps the core and corrupts one chosen response (in process, so it is cheap)."""

    def __init__(self, step: int, corrupt: Callable[[JSONDict], None]) -> None:
        self.impl = CoreImplementation()
        self.n = -1
        self.step = step
        self.corrupt = corrupt

    def call(self, request: JSONDict) -> JSONDict:
        resp = self.impl.call(request)
        if request["cmd"] != "setup":
            self.n += 1
            if self.n == self.step:
                self.corrupt(resp)
        return resp


def _step_index(vector: JSONDict, op: str) -> int:
    steps = vector["steps"]
    assert isinstance(steps, list)
    return next(i for i, s in enumerate(steps) if isinstance(s, dict) and s["op"] == op)


def test_one_wrong_wire_byte_fails() -> None:
    v = BY_NAME["happy_pull"]
    i = _step_index(v, "access_finished")

    def flip(resp: JSONDict) -> None:
        out = _obj(_arr(resp["outputs"])[0])
        hx = out["hex"]
        assert isinstance(hx, str)
        out["hex"] = hx[:-2] + ("00" if hx[-2:] != "00" else "01")

    result = run_vector(v, _Tampering(i, flip))
    assert result.mismatch is not None and result.mismatch.index == i
    assert ".hex" in result.mismatch.why


def test_a_computed_time_beyond_the_tolerance_fails_within_it_passes() -> None:
    v = BY_NAME["happy_pull"]
    i = _step_index(v, "begin_access")

    def shift(by: float) -> Callable[[JSONDict], None]:
        def f(resp: JSONDict) -> None:
            result = _obj(resp["result"])
            valid_until = result["valid_until"]
            assert isinstance(valid_until, float)
            result["valid_until"] = valid_until + by

        return f

    assert run_vector(v, _Tampering(i, shift(1e-8))).passed
    bad = run_vector(v, _Tampering(i, shift(1e-3)))
    assert bad.mismatch is not None and "valid_until" in bad.mismatch.why


def test_a_free_with_the_wrong_reason_fails() -> None:
    v = BY_NAME["accessor_crash_expiry"]
    steps = _arr(v["steps"])
    i = next(i for i, s in enumerate(steps) if any(_obj(o)["type"] == "Free" for o in _expected_outputs(s)))

    def relabel(resp: JSONDict) -> None:
        _obj(_arr(resp["outputs"])[0])["reason"] = "released"

    result = run_vector(v, _Tampering(i, relabel))
    assert result.mismatch is not None and "reason" in result.mismatch.why


# -- malformed bytes --------------------------------------------------------------------------

CODEC_ERRORS = [_obj(c) for c in _arr(BY_NAME["codec"]["cases"]) if "error" in _obj(_obj(c)["expect"])]


@pytest.mark.parametrize("case", CODEC_ERRORS, ids=lambda c: str(c["name"]))
def test_malformed_bytes_raise_decode_error_of_the_vectors_category(case: JSONDict) -> None:
    """Each malformed case of the codec vector, straight through the Python codecs: a
    `DecodeError` whose `category` is one the vector allows."""
    data = bytes.fromhex(str(case["hex"]))
    allowed = _arr(_obj(_obj(case["expect"])["error"])["category"])
    with pytest.raises(DecodeError) as exc:
        if case["codec"] == "sealed":
            decode(FrameAuth([bytes.fromhex(str(k)) for k in _arr(case["keys"])]).open(data))
        elif case["codec"] == "native":
            decode(data)
        else:
            decode_vllm(data)
    assert exc.value.category in allowed, (str(exc.value), exc.value.category, allowed)


def test_an_implementation_that_accepts_malformed_bytes_fails() -> None:
    class Lenient:
        def call(self, request: JSONDict) -> JSONDict:
            return {"ok": True, "message": {"type": "Heartbeat"}}

    result = run_vector(BY_NAME["codec"], Lenient())
    assert not result.passed and result.mismatch is not None


def test_a_wrong_decode_error_category_fails() -> None:
    class WrongCategory:
        def __init__(self) -> None:
            self.impl = CoreImplementation()

        def call(self, request: JSONDict) -> JSONDict:
            resp = self.impl.call(request)
            if resp.get("ok") is False:
                _obj(resp["error"])["category"] = "type"
            return resp

    result = run_vector(BY_NAME["codec"], WrongCategory())
    assert result.mismatch is not None and "category" in result.mismatch.why


def test_a_mangled_vector_fails_rather_than_passing() -> None:
    v = copy.deepcopy(BY_NAME["release"])
    first = next(_obj(s) for s in _arr(v["steps"]) if _expected_outputs(s))
    _obj(first["expect"])["outputs"] = []
    result = run_vector(v, CoreImplementation())
    assert not result.passed


# -- driver failures --------------------------------------------------------------------------


def test_a_dead_driver_is_a_failure_not_a_crash() -> None:
    with SubprocessDriver(f"{sys.executable} -c pass", timeout=30.0) as drv:
        result = run_vector(BY_NAME["happy_pull"], drv)
        assert drv.broken
    assert result.mismatch is not None and "the implementation failed" in result.mismatch.why


def test_a_hung_driver_times_out() -> None:
    cmd = f"{sys.executable} -c 'import time; time.sleep(60)'"
    with SubprocessDriver(cmd, timeout=0.5) as drv:
        result = run_vector(BY_NAME["happy_pull"], drv)
    assert result.mismatch is not None and "no answer within" in result.mismatch.why


def test_the_reference_driver_answers_garbage_with_a_driver_error(driver: SubprocessDriver) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvlease.cli._conformance_driver"],
        input="not json\n[1]\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert [x["error"]["class"] for x in lines] == ["DriverError", "DriverError"]


# -- comparison rule and purity ---------------------------------------------------------------


def test_compare_rules() -> None:
    assert compare({"a": 1.0, "note": "x"}, {"a": 1.0 + 1e-9}) is None
    assert compare({"a": 1}, {"a": True}) is not None  # a boolean is never a number
    assert compare({"a": [1, 2]}, {"a": [1, 2, 3]}) is not None
    assert compare({"a": 1}, {"a": 1, "b": 2}) is not None
    assert compare({"reason_text": "x"}, {"reason_text": "y"}) is None


def test_the_runner_is_pure() -> None:
    forbidden = {
        "time",
        "socket",
        "threading",
        "asyncio",
        "subprocess",
        "selectors",
        "zmq",
        "nixl",
        "torch",
        "os",
        "io",
        "pathlib",
    }
    for path in (ROOT / "kvlease" / "conformance").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for n in names:
                assert n.split(".")[0] not in forbidden, f"{path.name} imports {n}"


# -- next_deadline binds as a bound; errors and drivers that never start ----------------------


DeadlineAnswer = Callable[[float, float | None], float | None]


class _Deadlines:
    """The core, with every step's next_deadline replaced by `fn(now, reference)`."""

    def __init__(self, fn: DeadlineAnswer) -> None:
        self.impl = CoreImplementation()
        self.fn = fn

    def call(self, request: JSONDict) -> JSONDict:
        resp = self.impl.call(request)
        if request["cmd"] == "step" and resp.get("ok"):
            now, ref = request["now"], resp["next_deadline"]
            assert isinstance(now, int | float) and (ref is None or isinstance(ref, int | float)), (now, ref)
            resp["next_deadline"] = self.fn(float(now), None if ref is None else float(ref))
        return resp


TRACES = sorted(n for n, v in BY_NAME.items() if v["kind"] == "trace")


@pytest.mark.parametrize("answer", ["null", "far", "late"])
def test_a_dishonest_next_deadline_fails_every_trace(answer: str) -> None:
    """A driver answering null, 1e12 or its deadline a second late passed every v1 vector."""
    answers: dict[str, DeadlineAnswer] = {
        "null": lambda now, ref: None,
        "far": lambda now, ref: 1e12,
        "late": lambda now, ref: None if ref is None else ref + 1.0,
    }
    for name in TRACES:
        result = run_vector(BY_NAME[name], _Deadlines(answers[answer]))
        assert not result.passed, name
        assert result.mismatch is not None and "next_deadline" in result.mismatch.why


def test_an_exact_or_early_next_deadline_passes() -> None:
    """The reference's timers are lazy (a renewed lease's old deadline stays queued); an
    implementation that wakes exactly at its next work, or earlier, conforms."""
    for name in TRACES:
        v = BY_NAME[name]
        expects = [_obj(_obj(s)["expect"]) for s in _arr(v["steps"])]
        works = iter([e.get("next_work") for e in expects if e.get("ok")])

        def exact(now: float, ref: float | None, works: Iterator[JSON] = works) -> float | None:
            work = next(works)
            assert work is None or isinstance(work, int | float), work
            return None if work is None else float(work)

        assert run_vector(v, _Deadlines(exact)).passed, name

        def early(now: float, ref: float | None) -> float | None:
            return ref if ref is None or ref <= now else (now + ref) / 2  # halfway: early, never a busy loop

        assert run_vector(v, _Deadlines(early)).passed, name


def test_a_busy_loop_after_handle_timeout_fails() -> None:
    v = BY_NAME["happy_pull"]
    result = run_vector(v, _Deadlines(lambda now, ref: now if ref is not None else None))
    assert result.mismatch is not None and "busy loop" in result.mismatch.why


def test_the_headline_shows_the_implementations_error_message() -> None:
    v = BY_NAME["happy_pull"]

    def refuse(resp: JSONDict) -> None:
        resp.clear()
        resp.update({"ok": False, "error": {"class": "LocalProtocolError", "error_message": "my engine says no"}})

    result = run_vector(v, _Tampering(2, refuse))
    assert result.mismatch is not None and "my engine says no" in result.mismatch.why


def test_the_diff_leaves_out_keys_that_do_not_bind() -> None:
    v = copy.deepcopy(BY_NAME["happy_pull"])
    i = _step_index(v, "access_finished")
    _obj(_obj(_arr(v["steps"])[i])["expect"])["outputs"] = []
    result = run_vector(v, CoreImplementation())
    assert result.mismatch is not None
    text = result.mismatch.render()
    assert '"note"' not in text and '"reason_text"' not in text and '"error_message"' not in text


@pytest.mark.parametrize(
    ("cmd", "says"),
    [("/nonexistent/kvlease-driver", "cannot start the driver"), ("/bin/false", "exited at once (status 1)")],
)
def test_the_cli_says_in_one_line_when_a_driver_cannot_run(cmd: str, says: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvlease", "conformance", "--driver", cmd, "--vectors", str(VECTORS_DIR)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and says in proc.stderr, proc.stderr
