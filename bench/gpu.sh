#!/bin/sh
# The GPU run of issue 23, as one script for a machine with an NVIDIA GPU and the CUDA toolkit:
# llama-cpp-python (the pinned version) rebuilt with CUDA, tandem installed, the models pulled, then
# bench/experiments/gpu.py (plain, forced and governed speculative decoding at k = 2, 4, 6 with every layer on the GPU,
# greedy output equality, the prefix cache's restore) writing to bench/results/<date>-gpu.
# Usage: bench/gpu.sh [bench/experiments/gpu.py arguments]
set -eu
cd "$(dirname "$0")/.."
VERSION=$(python -c "import importlib.metadata as m; print(m.version('llama_cpp_python'))" 2>/dev/null || echo 0.3.36)
pip install -e . >/dev/null
if ! python -c "from tandem.daemon.models.devices import list_devices; import sys; sys.exit(0 if any(d.kind in ('gpu', 'igpu') for d in list_devices()) else 1)" 2>/dev/null; then
  # native: only the installed GPU's architecture, which keeps the CUDA build to minutes
  CMAKE_ARGS="${CMAKE_ARGS:-} -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=native" \
    pip install --force-reinstall --no-deps --no-cache-dir "llama-cpp-python==$VERSION"
fi
python -m tandem.cli models pull qwen2.5-coder-1.5b
python -m tandem.cli models pull qwen2.5-coder-0.5b
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
exec python -m bench.experiments.gpu "$@"
