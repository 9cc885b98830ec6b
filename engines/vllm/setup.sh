#!/usr/bin/env bash
# Creates or updates .venv-vllm: vLLM 0.33.0 (its scheduler and NIXL connector machinery, on the
# CPU) plus kvlease itself, for the vLLM adapter tests (tests/test_vllm_adapter*.py) and
# bench/vllm_adapter.py. A no-op when its inputs (this script, requirements.txt, pyproject.toml)
# have not changed since the last successful run.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$root"

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV=.venv-vllm
STAMP=$VENV/.kvlease-vllm-installed

want=$(cat "$here/setup.sh" "$here/requirements.txt" pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi

echo "engines/vllm/setup.sh: installing vLLM 0.33.0 into $VENV (a few minutes)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
# The CPU build of torch first (on local disk), so nothing pulls a multi-GB CUDA build.
"${pip[@]}" "torch==2.13.0"
# vLLM without its dependency list (that would pull a CUDA torch and much more), then the
# minimal set its scheduler and NIXL connector need on the CPU (with nixl==1.5.1).
"${pip[@]}" --no-deps "vllm==0.33.0"
"${pip[@]}" -r "$here/requirements.txt"
# kvlease itself, editable, with only the dependencies the adapter uses.
"${pip[@]}" --no-deps -e .
"${pip[@]}" "attrs>=23.1" "msgpack>=1.0" "click>=8.1" "rich>=13" "prometheus_client>=0.20"
"$VENV/bin/python" -c "import vllm, nixl._api, kvlease" >/dev/null 2>&1 || {
  echo "engines/vllm/setup.sh: $VENV does not import vllm, nixl._api and kvlease" >&2
  "$VENV/bin/python" -c "import vllm, nixl._api, kvlease"
  exit 1
}
echo "$want" > "$STAMP"
