"""tandem's CPU kernels: llama.cpp's CPU backend (``libggml-cpu``) built from the
sources vendored in the installed llama-cpp-python, with ``ggml_cpu.patch``.

The patch changes two of ggml's reference (``use_ref``) kernels, those every
decoding step runs with ``--kernels mixed``, and the fast flash attention that
reads prompts, whose bits it keeps (docs/exact-output.md, "tandem's CPU
kernels"):

- flash attention: the stock one reads a query row's whole KV in one go and
  splits a pass over threads by query head (in chunks of two heads, so 14 heads
  on 2 threads run 8 against 6); the patched one reads it in fixed chunks of
  256 KV positions, one task per (KV head, chunk), and combines a row's chunks
  in their order. What a row computes depends only on its query, the KV and the
  mask, so a step and a verify pass still agree bit for bit, and at long
  contexts the work splits evenly over the threads and each KV chunk is read
  once for all the query heads that share it;
- repacked weights: a pass of 4 rows or more goes to a 4-row gemm that rounds
  otherwise than the one-row gemv (so tandem cut steps into passes of 3 rows);
  the patched one quantizes every row as one row alone and gives it the gemv's
  arithmetic, over column blocks that stay in the cache while every row passes:
  a pass of any width gives each row a step's bits and reads the weights once.
  On x86 with AVX2, Q4_K (repacked or not) and Q6_K weights are multiplied with
  up to 8 rows at once, each row's integer sums and float operations those of
  the one-row kernel, the weights unpacked once for all of them: a verify pass
  over w tokens then costs well under w steps;
- prompts' flash attention (ggml's tiled path): the stock one converts each
  tile of K, V and the mask to F32 again for every query head that shares a
  KV head; the patched one converts it once for them, and each head's rows go
  through the stock tile's arithmetic: llama.cpp's own bits, faster where the
  context is long.

A daemon's start (``--kernel-patch auto``, the default), or ``tandem kernels build``, downloads the
llama-cpp-python sdist of the installed version from PyPI (pip checks its
hash), applies the patch and builds the one library with the cmake and C++
compiler on PATH, into ``~/.cache/tandem/kernels/KEY/``.
KEY covers the llama-cpp-python version, the patch and the CPU's flags (a
native build for another CPU would die of SIGILL here). A worker loads it
(``preload``) before llama.cpp: the dynamic loader then takes it for
``libggml-cpu.so.0`` when libllama asks for it. Nothing is built or loaded
silently: where the build fails, ``auto`` runs llama.cpp's own and says why,
and the failure is recorded so that a daemon's start does not try again for a day
(``on``: the start fails); the kernels in use are in ``status.model.cpu_kernels``
and part of every key that KV or a verdict is kept under.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

log = logging.getLogger("tandem.kernels")

PATCH = Path(__file__).with_name("ggml_cpu.patch")
LIBRARY = "libggml-cpu.so.0"
FAILED = "build-failed.txt"  # beside it: why the last build failed
RETRY_SECONDS = 24 * 3600  # a daemon's auto tries a failed build again after this
PACKAGE = "llama-cpp-python"


class KernelBuildError(RuntimeError):
    """The patched CPU backend could not be built; the message names the fix."""


def llama_cpp_version() -> str:
    return importlib.metadata.version(PACKAGE)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_has_amx() -> bool:
    """Intel AMX (its int8 tiles): llama.cpp's extra buffers then crash (``llama_load.default_extra_buffers``)."""
    return "amx_int8" in _cpu_flags().split()


RECIPE = 1  # how ``build`` configures and builds (a change here is a new library)


def key() -> str:
    """What the built library is valid for: the llama-cpp-python version and the libggml-base it
    installed (a rebuilt wheel of the same version), the patch, the build recipe, the CPU's flags."""
    try:
        base = (_llama_cpp_lib_dir() / "libggml-base.so.0").stat().st_size
    except (OSError, KernelBuildError):
        base = 0
    parts = f"{llama_cpp_version()}\0{base}\0{RECIPE}\0{PATCH.read_bytes().hex()}\0{_cpu_flags()}"
    return hashlib.sha256(parts.encode()).hexdigest()[:16]


def _tandem_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tandem"


def cache_root() -> Path:
    return _tandem_cache() / "kernels"


def library_path() -> Path:
    return cache_root() / key() / LIBRARY


def built() -> Optional[Path]:
    """The patched library for this llama-cpp-python, patch and CPU, if it has been built."""
    path = library_path()
    return path if path.is_file() else None


def _failure_record() -> Path:
    return library_path().parent / FAILED


def _copy_into_place(src: Path, dst: Path) -> None:
    """``dst`` becomes a copy of ``src`` at once (never a half-written file)."""
    shutil.copy2(src, dst.with_suffix(".part"))
    os.replace(dst.with_suffix(".part"), dst)


def failed() -> Optional[str]:
    """Why the last build for this key failed, if it did (a daemon's auto then does not try again at
    every start; `tandem kernels build` does)."""
    try:
        return _failure_record().read_text(encoding="utf-8", errors="replace").strip() or "unknown"
    except OSError:
        return None


def _failed_age() -> float:
    """Seconds since the recorded failure (inf: none)."""
    try:
        return max(0.0, time.time() - _failure_record().stat().st_mtime)
    except OSError:
        return float("inf")


def _llama_cpp_lib_dir() -> Path:
    try:
        spec = importlib.util.find_spec("llama_cpp")  # (does not import it: llama.cpp must not be loaded yet)
    except ImportError:
        spec = None
    if spec is None or spec.origin is None:
        raise KernelBuildError("llama-cpp-python is not installed")
    return Path(spec.origin).parent / "lib"


def _mapped(name: str) -> list[str]:
    """Paths of the loaded objects whose file name starts with ``name`` (from /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            return sorted({line.split()[-1] for line in f if "/" + name in line})
    except OSError:
        return []


def preload(setting: str) -> Optional[Path]:
    """Before llama.cpp is loaded in this process: load the patched CPU backend
    (``setting`` auto or on, and it is built). Returns its path, or None (llama.cpp's own)."""
    if setting == "off" or "llama_cpp" in sys.modules:
        return None
    path = built()
    if path is None:  # (the daemon found them built before it started its workers: removed since)
        log.warning("tandem's CPU kernels are not built (any more): this worker runs llama.cpp's own")
        return None
    try:
        # llama-cpp-python's libggml-base first, so that ours (which needs libggml-base.so.0) binds to it
        ctypes.CDLL(str(_llama_cpp_lib_dir() / "libggml-base.so.0"), mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except (OSError, KernelBuildError) as e:
        log.warning("tandem's CPU kernels in %s did not load (%s): running llama.cpp's own", path, e)
        return None
    return path


def in_use() -> str:
    """Which CPU backend this process computes with: ``tandem-KEY`` where tandem's is the only one
    loaded, else ``llama.cpp`` (also where both are: a build that loads backends dynamically)."""
    root = os.path.realpath(cache_root())
    ours, theirs = [], []
    for path in _mapped("libggml-cpu.so"):
        (ours if os.path.realpath(path).startswith(root + os.sep) else theirs).append(path)
    if ours and not theirs:
        return f"tandem-{Path(os.path.realpath(ours[0])).parent.name}"
    return "llama.cpp"


def rows_as_steps() -> bool:
    """Whether this process's reference kernels compute every row of a pass over repacked weights as a
    one-row pass does (tandem's patch): then a step need not be cut into passes of 3 rows."""
    return in_use() != "llama.cpp"


def _sdist(workdir: Path, say: Callable[[str], None]) -> Path:
    """The llama-cpp-python sdist of the installed version: a copy kept from before (here, or bench/'s),
    or one pip downloads (and it is kept, for a rebuild)."""
    version = llama_cpp_version()
    name = f"llama_cpp_python-{version}.tar.gz"
    kept = cache_root() / "src" / name
    for path in (kept, _tandem_cache() / "llama-server" / "src" / name):
        if path.is_file():
            return path
    say(f"downloading the {PACKAGE} {version} sources from PyPI (about 75 MB)")
    # (pip prepares an sdist's metadata before it saves it: in an isolated environment, with its build
    # requirements as wheels; without that isolation it deletes the file when they are not installed)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE]
    try:
        done = subprocess.run(
            [*cmd, f"{PACKAGE}=={version}", "-d", str(workdir)], capture_output=True, text=True, timeout=900
        )
        said = (done.stdout + done.stderr).strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
        said = ["pip took over 15 minutes"]
    got = workdir / name
    if not got.is_file():
        raise KernelBuildError(
            f"could not download {PACKAGE}=={version}'s sources from PyPI (is it reachable?): " + " / ".join(said)
        )
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        _copy_into_place(got, kept)
    except OSError:
        pass  # (kept only to save a download)
    return got


def _need(tool: str, fix: str) -> str:
    found = shutil.which(tool)
    if found is None:
        raise KernelBuildError(f"`{tool}` is not installed: {fix}")
    return found


def build(say: Callable[[str], None] = print, jobs: Optional[int] = None) -> Path:
    """Build the patched library if it is not built (one build at a time, under a lock); return its path.
    A failure is recorded beside it (``failed``), a success clears the record."""
    path = library_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    record = _failure_record()
    with open(path.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():
            return path
        record.unlink(missing_ok=True)  # (tried again: the failure before says nothing now)
        try:
            _build(path, say, jobs)
        except Exception as e:
            try:
                record.write_text(f"{type(e).__name__}: {e}\n", encoding="utf-8")
            except OSError:
                pass
            raise
    say(f"built {path}")
    return path


def _build(path: Path, say: Callable[[str], None], jobs: Optional[int]) -> None:
    """The body of ``build``, under its lock: fetch, unpack, patch, configure, compile, install."""
    cmake = _need("cmake", "apt-get install cmake, or pip install cmake")
    patch = _need("patch", "apt-get install patch (build-essential has it)")
    _need("c++", "apt-get install build-essential")
    with tempfile.TemporaryDirectory(prefix="tandem-kernels-") as tmp:
        work = Path(tmp)
        sdist = _sdist(work, say)
        say(f"unpacking {sdist.name}")
        try:
            with tarfile.open(sdist) as tar:
                members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
                tar.extractall(work, members=members, filter="data")
        except (tarfile.TarError, EOFError, TypeError) as e:  # (TypeError: a Python without extraction filters)
            if sdist.parent != work and not isinstance(e, TypeError):
                sdist.unlink(missing_ok=True)  # a kept copy that is damaged: downloaded again next time
            raise KernelBuildError(f"could not unpack {sdist}: {e}") from e
        src = next(work.glob("*/vendor/llama.cpp"), None)
        if src is None:
            raise KernelBuildError(f"{sdist} holds no vendor/llama.cpp")
        applied = subprocess.run([patch, "-p1", "-s", "-i", str(PATCH)], cwd=src, capture_output=True, text=True)
        if applied.returncode != 0:
            raise KernelBuildError(f"the patch does not apply to these sources: {applied.stdout}{applied.stderr}")
        flags = ""
        if "amx_tile" in _cpu_flags().split():  # as bench/build_llama_server.sh: a native AMX build dies here
            flags = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        configure = [
            cmake,
            "-S",
            str(src),
            "-B",
            str(work / "build"),
            "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_NATIVE=ON",
            "-DBUILD_SHARED_LIBS=ON",
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_SERVER=OFF",
            "-DLLAMA_BUILD_TOOLS=OFF",
            f"-DCMAKE_C_FLAGS={flags}",
            f"-DCMAKE_CXX_FLAGS={flags}",
        ]
        say("configuring (cmake)")
        _run(configure, "cmake could not configure llama.cpp's sources")
        say("compiling ggml's CPU backend (about a minute on 2 cores)")
        jobs = jobs or os.cpu_count() or 1
        _run([cmake, "--build", str(work / "build"), "--target", "ggml-cpu", "-j", str(jobs)], "the build failed")
        out = work / "build" / "bin" / LIBRARY
        if not out.is_file():
            raise KernelBuildError(f"the build made no {LIBRARY}")
        _copy_into_place(out.resolve(), path)


def _run(cmd: list[str], what: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
        raise KernelBuildError(what + ":\n" + "\n".join(tail))


def check(setting: str, say: Callable[[str], None], announce: str = "") -> Optional[Path]:
    """What a daemon starting with ``--kernel-patch SETTING`` does before its workers load: auto and on
    build them if they are not built (once per llama-cpp-python version and CPU); where that fails, on is
    an error and auto runs llama.cpp's own kernels, saying why and how to build them. A daemon's auto does
    not try again within RETRY_SECONDS of a recorded failure (a sandboxed service would at every start);
    a start in the foreground (``announce``: the line it says before a build, as ``tandem run`` and
    ``tandem service install`` do) always tries. Returns the library the daemon's workers are to load,
    or None (llama.cpp's own)."""
    if setting == "off":
        return None
    path = built()
    if path is not None:
        return path
    fix = "fix that and run `tandem kernels build`, or pass --kernel-patch off to skip this"
    why, age = failed(), _failed_age()
    if why is not None and setting == "auto" and not announce and age < RETRY_SECONDS:
        log.warning(
            "tandem's CPU kernels are not built: a build %.0f minutes ago failed (`tandem kernels status` says why; "
            "tried again after %d hours): running llama.cpp's own; %s",
            age / 60,
            RETRY_SECONDS // 3600,
            fix,
        )
        return None
    say(
        announce
        or "building tandem's CPU kernels (once for this llama-cpp-python and CPU; --kernel-patch off skips it)"
    )
    try:
        return build(say)
    except Exception as e:  # (whatever it is, auto serves with llama.cpp's kernels; build recorded it)
        if setting == "on":
            raise KernelBuildError(f"tandem's CPU kernels could not be built: {e}") from e
        log.warning(
            "tandem's CPU kernels could not be built (%s): running llama.cpp's own, which decode slower at long "
            "contexts; %s",
            e,
            fix,
        )
        return None
