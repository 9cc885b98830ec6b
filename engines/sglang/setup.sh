#!/usr/bin/env bash
# Creates or updates .venv-sglang: SGLang 0.5.23 (its disaggregation manager/sender/receiver,
# bootstrap server and plugin system, on the CPU; launch_server and sglang-router 0.3.2 for the
# real prefill/decode pair) plus nixl 1.5.1 and kvlease itself (editable, so the
# `sglang.srt.plugins` entry point is registered), for tests/test_sglang_*.py.
# The light route: --no-deps installs of sglang and nixl, the CPU torch, and only the packages
# the transfer path imports, pinned by constraints.txt. A no-op when its inputs (this script,
# constraints.txt, the torchvision stand-in, pyproject.toml) have not changed.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$root"

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV=.venv-sglang
STAMP=$VENV/.kvlease-sglang-installed

want=$(cat "$here/setup.sh" "$here/constraints.txt" "$here"/torchvision_stub/torchvision/*.py pyproject.toml \
  | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi

echo "engines/sglang/setup.sh: installing SGLang 0.5.23 into $VENV (a few minutes)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-warn-conflicts)
# The CPU build of torch first (on local disk), so nothing pulls a multi-GB CUDA build.
"${pip[@]}" "torch==2.13.0"
# SGLang and NIXL without their dependency lists (SGLang's pulls a CUDA torch and ~9 GB more;
# nixl's meta package pulls both CUDA variants: with no CUDA present it loads nixl_cu13).
"${pip[@]}" --no-deps "sglang==0.5.23" "nixl==1.5.1" "nixl-cu13==1.5.1"
# What the disaggregation transfer path imports, at the versions SGLang 0.5.23 resolves to.
"${pip[@]}" -c "$here/constraints.txt" numpy orjson psutil pybase64 requests triton packaging pillow \
  starlette msgspec pydantic pyzmq tqdm ipython aiohttp transformers dill apache-tvm-ffi sentencepiece \
  compressed-tensors gguf openai partial-json-parser einops prometheus_client setproctitle uvicorn fastapi
# What `python -m sglang.launch_server` (prefill and decode) and SGLang's router need beyond that,
# for tests/test_sglang_pair.py (engines/SGLANG-SERVE-ON-CPU.md: without jsonschema and soundfile the
# HTTP server does not import).
"${pip[@]}" -c "$here/constraints.txt" uvloop python-multipart interegular anthropic blobfile build \
  distro easydict jsonschema llguidance ninja openai-harmony python-dateutil regex scipy tiktoken \
  watchfiles xgrammar xxhash zstandard nvidia-ml-py py-spy smg-grpc-servicer soundfile huggingface_hub \
  safetensors tokenizers
"${pip[@]}" -c "$here/constraints.txt" "sglang-router==0.3.2"
# SGLang imports torchvision at load (srt/configs -> multimodal/internvl_utils.py) but the
# transfer path never calls it, and PyPI's torchvision does not load beside the CPU torch:
# an import-only stand-in (no distribution metadata, so transformers sees no torchvision).
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$site/torchvision"
cp -r "$here/torchvision_stub/torchvision" "$site/torchvision"
# kvlease itself, editable, with only the dependencies the adapter uses.
"${pip[@]}" --no-deps -e .
"${pip[@]}" -c "$here/constraints.txt" "attrs>=23.1" "msgpack>=1.0" "click>=8.1" "rich>=13"
check='import sglang.srt.disaggregation.nixl.conn, nixl._api, kvlease.adapters.sglang, sglang_router, jsonschema, soundfile'
"$VENV/bin/python" -c "$check" >/dev/null 2>&1 || {
  echo "engines/sglang/setup.sh: $VENV does not import SGLang's NIXL backend, nixl and the adapter" >&2
  "$VENV/bin/python" -c "$check"
  exit 1
}
echo "$want" > "$STAMP"
