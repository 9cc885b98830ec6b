#!/usr/bin/env bash
# One entry point for a fresh clone: creates or updates .venv, then runs what you ask.
#   bash dev.sh demo [ARGS...]   the two-process loopback demo (ZMQ on 127.0.0.1)
#   bash dev.sh test [ARGS...]   the whole test suite (what .ci/run calls)
#   bash dev.sh bench|sim|check|conformance [ARGS...]   the other kvlease subcommands
#   bash dev.sh vllm-demo [--lease S]   stock vLLM and kvlease in real vllm serve pairs, side by side
#   bash dev.sh gates            only the static gates (ruff check, ruff format --check, mypy --strict)
#   bash dev.sh env              only create/update the environment
#   bash dev.sh help             this text (no command at all: test)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV=.venv
STAMP=$VENV/.kvlease-installed

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
  fi
  local want
  want=$(cat pyproject.toml dev.sh | sha256sum | cut -d' ' -f1)
  if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # The CPU build of torch first (it is on local disk), so nothing pulls a multi-GB CUDA build.
    "$VENV/bin/python" -m pip install -q "torch==2.13.0"
    "$VENV/bin/python" -m pip install -q -e ".[dev]"
    echo "$want" > "$STAMP"
  fi
}

# The engine environments for the adapter tests: vLLM and SGLang pin their own torch builds, so
# each gets a venv of its own (.venv-vllm, .venv-sglang), created and kept up to date by
# engines/<name>/setup.sh (a no-op when its inputs have not changed). The scripts share nothing
# but pip's cache, so they run side by side (on a fresh machine most of their time is waiting
# on downloads and unpacking); any that fails fails this, named.
engines() {
  local s i failed=0
  local -a pids=() scripts=()
  for s in engines/*/setup.sh; do
    [ -f "$s" ] || continue
    bash "$s" &
    pids+=("$!")
    scripts+=("$s")
  done
  for i in "${!pids[@]}"; do
    if ! wait "${pids[$i]}"; then
      echo "dev.sh: ${scripts[$i]} failed" >&2
      failed=1
    fi
  done
  return "$failed"
}

# The engine environments a selection of tests needs: a test file names its engine
# (tests/test_vllm_*.py, tests/test_sglang_*.py) or imports its helpers (tests/_vllm_*.py,
# tests/_sglang_*.py, tools/vllm_pd.py); a directory, or no path at all, may collect them all.
# Prints engine names, one per line.
engines_for() {
  local a paths=0 all=0 name
  for a in "$@"; do
    case "$a" in -*) continue ;; esac
    [ -e "${a%%::*}" ] || continue
    paths=1
    if [ -d "${a%%::*}" ]; then all=1; continue; fi
    for name in engines/*/; do
      name=$(basename "$name")
      case "$(basename "${a%%::*}")" in *"$name"*) echo "$name"; continue ;; esac
      if grep -qE "(from|import) _${name}_|import ${name}_pd" "${a%%::*}"; then echo "$name"; fi
    done
  done
  if [ "$paths" = 0 ] || [ "$all" = 1 ]; then
    for name in engines/*/; do basename "$name"; done
  fi
}

# Static gates over everything kvlease ships and tests: ruff (lint and format) and mypy --strict
# (through tools/typecheck.py, which checks the package as it installs: kvlease.transports and
# kvlease.adapters are mapped directories that plain mypy cannot resolve).
SOURCES=(kvlease transports adapters tests bench spec tools engines)
gates() {
  "$VENV/bin/ruff" check "${SOURCES[@]}"
  "$VENV/bin/ruff" format --check "${SOURCES[@]}"
  "$VENV/bin/python" tools/typecheck.py
}

cmd=${1:-test}
[ $# -gt 0 ] && shift
case "$cmd" in
  -h|--help|help)
    sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    echo "With no command: test (the whole suite, engines included: 45-55 minutes on 2 cores)."
    exit 0 ;;
esac
setup
case "$cmd" in
  env) engines ;;
  gates) gates ;;
  test)
    if [ $# -gt 0 ]; then  # a selection of tests: only the engines it needs, no coverage gate
      for e in $(engines_for "$@" | sort -u); do
        [ -f "engines/$e/setup.sh" ] && bash "engines/$e/setup.sh"
      done
      exec "$VENV/bin/python" -m pytest "$@"
    fi
    engines
    # The gates first (lint, format, types: a minute, and they fail fast), then the whole
    # suite with its 15 slowest tests listed, then the gate on branch coverage of kvlease/
    # (omit list in pyproject.toml) as its own command, so a shortfall fails the run by its
    # exit status.
    gates
    rm -f .coverage .coverage.*
    "$VENV/bin/python" -m pytest --cov=kvlease --cov-branch --cov-report= --durations=15
    exec "$VENV/bin/python" -m coverage report --fail-under=95 ;;
  demo|bench|sim|check|conformance|version)
    exec "$VENV/bin/kvlease" "$cmd" "$@" ;;
  vllm-demo)  # optional: four real vllm serve processes (a few minutes, about 8 GB)
    bash engines/vllm/setup.sh
    exec "$VENV/bin/python" tools/vllm_pd.py demo "$@" ;;
  *)
    echo "usage: bash dev.sh {demo|test|bench|sim|check|conformance|version|gates|env|vllm-demo} [ARGS...]" >&2; exit 2 ;;
esac
