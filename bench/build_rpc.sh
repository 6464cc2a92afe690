#!/bin/sh
# llama.cpp's RPC backend for tandem --rpc, from the llama.cpp vendored in the llama-cpp-python sdist
# tandem pins (client and server must speak the same RPC protocol version, so the server comes from the
# same sources as the library the daemon loads):
#   1. rpc-server (llama.cpp's tools/rpc, binary ggml-rpc-server) -> ~/.cache/tandem/rpc-server/<version>/bin/
#   2. llama-cpp-python reinstalled with CMAKE_ARGS="-DGGML_RPC=on" (the same version; it replaces the installed
#      one in this Python environment: nothing else about it changes)
#   3. with --test: the RPC test (tests/integration/test_rpc.py: two rpc-servers on 127.0.0.1, SmolLM2 split
#      across them, output compared with a local run) and the loopback benchmark (bench/experiments/rpc.py)
# Usage: [CMAKE_ARGS="-DGGML_CUDA=on"] bench/build_rpc.sh [--test] [--no-python]
# CMAKE_ARGS (a GPU backend's flags) go to both builds; run it on each machine that runs an rpc-server
# (GGML_NATIVE builds for the CPU it runs on).
# Needs cmake and a C++ compiler; ~4 minutes for rpc-server and ~6 for llama-cpp-python on 2 cores.
set -eu
TEST=0
PYTHON=1
for arg in "$@"; do
  case "$arg" in
    --test) TEST=1 ;;
    --no-python) PYTHON=0 ;;
    *) echo "usage: bench/build_rpc.sh [--test] [--no-python]" >&2; exit 2 ;;
  esac
done
HERE=$(cd "$(dirname "$0")" && pwd)
VERSION=$(python -c "import importlib.metadata as m; print(m.version('llama_cpp_python'))" 2>/dev/null || echo 0.3.36)
ROOT="${XDG_CACHE_HOME:-$HOME/.cache}/tandem/rpc-server"
OUT="$ROOT/$VERSION"
mkdir -p "$ROOT/src"
cd "$ROOT/src"
SDIST="llama_cpp_python-$VERSION.tar.gz"
"$HERE/fetch_sdist.sh" llama-cpp-python "$VERSION"

# 1. rpc-server, rebuilt when the CPU differs (GGML_NATIVE: see bench/build_llama_server.sh)
CPU=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | md5sum | cut -d' ' -f1)
if [ ! -x "$OUT/bin/rpc-server" ] || [ "$(cat "$OUT/cpu-flags" 2>/dev/null)" != "$CPU" ]; then
  rm -rf "$OUT" "llama_cpp_python-$VERSION"
  tar xzf "$SDIST"
  SRC="$ROOT/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
  NOAMX=""
  if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"; fi
  # shellcheck disable=SC2086 # CMAKE_ARGS is a list of flags
  cmake -S "$SRC" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_RPC=ON -DLLAMA_CURL=OFF \
    -DCMAKE_C_FLAGS="$NOAMX" -DCMAKE_CXX_FLAGS="$NOAMX" -DBUILD_SHARED_LIBS=OFF ${CMAKE_ARGS:-} \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
  cmake --build "$OUT/build" --target ggml-rpc-server -j "$(nproc)"
  mkdir -p "$OUT/bin"
  cp "$OUT/build/bin/ggml-rpc-server" "$OUT/bin/rpc-server"
  echo "$CPU" > "$OUT/cpu-flags"
  rm -rf "$OUT/build"
fi
echo "rpc-server: $OUT/bin/rpc-server"

# 2. llama-cpp-python with the RPC backend
if [ "$PYTHON" = 1 ]; then
  # the backends the installed one has besides the CPU and RPC (CUDA, Metal...): a rebuild without their
  # flags would drop them
  OTHER=$(python -c "from tandem.daemon.models.devices import backends; print(' '.join(b for b in backends() if b not in ('CPU', 'BLAS') and not b.startswith('RPC')))" 2>/dev/null || true)
  if python -c "import llama_cpp, sys; sys.exit(0 if llama_cpp.llama_supports_rpc() else 1)" 2>/dev/null; then
    echo "llama-cpp-python $VERSION already has the RPC backend"
  elif [ -n "$OTHER" ] && [ -z "${CMAKE_ARGS:-}" ]; then
    echo "the installed llama-cpp-python has the $OTHER backend; rebuilding it with only -DGGML_RPC=on would drop" \
      "it: run again with CMAKE_ARGS naming it (e.g. CMAKE_ARGS=\"-DGGML_CUDA=on\" bench/build_rpc.sh)" >&2
    exit 1
  else
    CMAKE_ARGS="${CMAKE_ARGS:-} -DGGML_RPC=on" pip install --force-reinstall --no-deps --no-cache-dir "./$SDIST"
  fi
fi

# 3. the test and the benchmark
if [ "$TEST" = 1 ]; then
  cd "$HERE/.."
  TANDEM_RPC_SERVER="$OUT/bin/rpc-server" python -m pytest -q tests/integration/test_rpc.py
  TANDEM_RPC_SERVER="$OUT/bin/rpc-server" python -m bench.experiments.rpc
fi
