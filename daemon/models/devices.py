"""llama.cpp's compute devices: which there are, where a model's layers went,
and llama.cpp's RPC backend.

llama-cpp-python 0.3.36 binds ``llama_model_params.devices`` and
``n_gpu_layers`` but not ggml's device registry, so this reads it through
ctypes from the ggml libraries the binding loaded. A build without a GPU
backend has one device, the CPU; one built with ``-DGGML_CUDA=on`` adds
``CUDA0``..., with Metal ``MTL0``, and ``--rpc`` adds ``RPC0``... (one per
remote device of each ``rpc-server``), registered in the target worker's
process only.

Where a model's layers went is what llama.cpp logs while it loads: a
``layer N assigned to device D`` line per layer (debug level) and a ``model
buffer size`` line per weight buffer. ``LoadLog`` collects them during the
load and nothing else of llama.cpp's log.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import llama_cpp as llama
from llama_cpp import _logger as llama_logger

from tandem.protocol import DeviceInfo

LLAMA_CPP_PYTHON = f"llama-cpp-python=={llama.__version__}"
# how to get a llama.cpp with a GPU backend (named in status and in errors)
GPU_INSTALL_HINT = (
    "no GPU backend is compiled into this llama-cpp-python; to offload to a GPU, rebuild it with one: "
    f'CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir --no-deps {LLAMA_CPP_PYTHON} '
    '(NVIDIA, needs the CUDA toolkit), or CMAKE_ARGS="-DGGML_METAL=on" on a Mac'
)
RPC_INSTALL_HINT = (
    "this llama-cpp-python was built without llama.cpp's RPC backend; rebuild it with "
    f'CMAKE_ARGS="-DGGML_RPC=on" pip install --force-reinstall --no-cache-dir --no-deps {LLAMA_CPP_PYTHON} '
    "(bench/build_rpc.sh does that and builds a matching rpc-server)"
)
DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}  # enum ggml_backend_dev_type
ALL_LAYERS = -1  # llama.cpp's n_gpu_layers for "every layer, the output layer included"


class DeviceError(Exception):
    """A device or RPC server named in the settings cannot be used; the message names the fix."""


class _Libs:
    """ggml's registry functions, looked up through libllama's own handle (it links
    libggml and libggml-base, whatever they are called on this system)."""

    def __init__(self) -> None:
        self.ggml = self.base = ctypes.CDLL(None, handle=llama.llama_cpp._lib._handle)
        p, s, i = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t
        for lib, name, res, args in (
            (self.ggml, "ggml_backend_dev_count", i, []),
            (self.ggml, "ggml_backend_dev_get", p, [i]),
            (self.ggml, "ggml_backend_dev_by_name", p, [s]),
            (self.ggml, "ggml_backend_dev_by_type", p, [ctypes.c_int]),
            (self.ggml, "ggml_backend_reg_by_name", p, [s]),
            (self.ggml, "ggml_backend_reg_count", i, []),
            (self.ggml, "ggml_backend_reg_get", p, [i]),
            (self.ggml, "ggml_backend_register", None, [p]),
            (self.base, "ggml_backend_dev_name", s, [p]),
            (self.base, "ggml_backend_dev_description", s, [p]),
            (self.base, "ggml_backend_dev_type", ctypes.c_int, [p]),
            (self.base, "ggml_backend_dev_memory", None, [p, ctypes.POINTER(i), ctypes.POINTER(i)]),
            (self.base, "ggml_backend_dev_backend_reg", p, [p]),
            (self.base, "ggml_backend_reg_name", s, [p]),
            (self.base, "ggml_backend_reg_get_proc_address", p, [p, s]),
        ):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args


_LIBS: Optional[_Libs] = None


def libs() -> _Libs:
    """DeviceError where this llama-cpp-python does not expose ggml's registry."""
    global _LIBS
    if _LIBS is None:
        llama.llama_backend_init()
        try:
            _LIBS = _Libs()
        except (AttributeError, OSError) as exc:
            raise DeviceError(f"cannot read llama.cpp's device registry: {exc}") from None
    return _LIBS


def gpu_backend() -> bool:
    """Whether this llama.cpp has a backend that offloads layers (a GPU's, or RPC)."""
    return bool(llama.llama_supports_gpu_offload())


def rpc_backend() -> bool:
    return bool(llama.llama_supports_rpc())


def backends() -> list[str]:
    """The backends registered in this process: "CPU", and "CUDA", "Metal", "RPC",
    "RPC[HOST:PORT]" per server added..."""
    lib = libs()
    regs = (lib.ggml.ggml_backend_reg_get(i) for i in range(lib.ggml.ggml_backend_reg_count()))
    return [(lib.base.ggml_backend_reg_name(r) or b"?").decode(errors="replace") for r in regs]


def gpu_note(devices: list[DeviceInfo]) -> str:
    """ "" where llama.cpp has a GPU; otherwise what to do to get one (RPC devices are not GPUs here)."""
    if any(d.kind in ("gpu", "igpu") for d in devices):
        return ""
    try:
        gpu_backends = [b for b in backends() if b not in ("CPU", "BLAS") and not b.startswith("RPC")]
    except DeviceError:
        return "llama.cpp's device registry cannot be read here"
    if gpu_backends:
        return f"llama.cpp has the {', '.join(gpu_backends)} backend but found no device for it (is the driver loaded?)"
    return GPU_INSTALL_HINT


def _describe(dev: int) -> DeviceInfo:
    lib = libs()
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    lib.base.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
    reg = lib.base.ggml_backend_dev_backend_reg(dev)
    backend = (lib.base.ggml_backend_reg_name(reg) or b"").decode(errors="replace")
    kind = DEVICE_TYPES.get(lib.base.ggml_backend_dev_type(dev), "other")
    return DeviceInfo(
        name=(lib.base.ggml_backend_dev_name(dev) or b"?").decode(errors="replace"),
        description=(lib.base.ggml_backend_dev_description(dev) or b"").decode(errors="replace"),
        kind="rpc" if backend == "RPC" else kind,
        memory_free=int(free.value),
        memory_total=int(total.value),
    )


def list_devices() -> list[DeviceInfo]:
    """Every device llama.cpp has in this process, in its order (a GPU backend's
    devices before the CPU; RPC servers' as they were added); [] where the
    registry cannot be read. Asks each device its free memory (an RPC device
    asks its server)."""
    try:
        lib = libs()
    except DeviceError:
        return []
    return [_describe(lib.ggml.ggml_backend_dev_get(i)) for i in range(lib.ggml.ggml_backend_dev_count())]


def device_names() -> list[str]:
    """The devices' names only: asks no server anything."""
    lib = libs()
    names = (
        lib.base.ggml_backend_dev_name(lib.ggml.ggml_backend_dev_get(i))
        for i in range(lib.ggml.ggml_backend_dev_count())
    )
    return [(n or b"?").decode(errors="replace") for n in names]


def select_devices(names: list[str]):
    """``llama_model_params.devices`` for these device names: a NULL-terminated
    array (kept alive by the caller). DeviceError names the devices there are."""
    lib = libs()
    found = []
    for name in names:
        dev = lib.ggml.ggml_backend_dev_by_name(name.encode())
        if dev and lib.base.ggml_backend_dev_type(dev) == 0:  # GGML_BACKEND_DEVICE_TYPE_CPU
            raise DeviceError(
                f"{name} is not a device to offload to: every layer not offloaded runs there; use --device none "
                "to keep them all on it"
            )
        if not dev:
            devices = list_devices()
            there = ", ".join(d.name for d in devices)
            note = gpu_note(devices)
            hint = f"; {note}" if note else ""
            raise DeviceError(f"llama.cpp has no device named {name!r} (devices here: {there}){hint}")
        found.append(dev)
    return (ctypes.c_void_p * (len(found) + 1))(*found, None)


def add_rpc_servers(endpoints: list[str], other_users: bool = False) -> list[str]:
    """Register llama.cpp rpc-server processes (HOST:PORT each) as devices of
    this process; returns the names of the devices they brought. DeviceError
    when this llama.cpp has no RPC backend, or a server does not answer, is
    busy, speaks another protocol version or (unless ``other_users``) runs as
    another user: every server is checked before any is registered."""
    if not endpoints:
        return []
    lib = libs()
    reg = lib.ggml.ggml_backend_reg_by_name(b"RPC") if rpc_backend() else None
    if not reg:
        raise DeviceError(RPC_INSTALL_HINT)
    addr = lib.base.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server")
    if not addr:
        raise DeviceError("this llama.cpp's RPC backend has no ggml_backend_rpc_add_server")
    add_server = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(addr)
    for endpoint in endpoints:
        _reachable(endpoint, other_users=other_users)
    before = set(device_names())
    for endpoint in endpoints:
        server = add_server(endpoint.encode())
        if not server:
            raise DeviceError(
                f"the rpc-server at {endpoint} answered but offers no device (is it an rpc-server of the same "
                f"llama.cpp as {LLAMA_CPP_PYTHON}? bench/build_rpc.sh builds one)"
            )
        lib.ggml.ggml_backend_register(server)
    return [name for name in device_names() if name not in before]


def rpc_server_binary() -> Optional[Path]:
    """The rpc-server of this llama.cpp: $TANDEM_RPC_SERVER where set (None if it
    is not an executable file), else the one bench/build_rpc.sh built."""
    import os

    named = os.environ.get("TANDEM_RPC_SERVER")
    if named:
        path = Path(named).expanduser()
    else:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        path = cache / "tandem" / "rpc-server" / llama.__version__ / "bin" / "rpc-server"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def start_rpc_server(binary: Path, port: int, threads: int = 1, timeout: float = 30.0):
    """``rpc-server -H 127.0.0.1 -p PORT -t THREADS`` (for tests and benchmarks), once
    it accepts connections; its output is discarded."""
    import socket
    import subprocess
    import time

    argv = [str(binary), "-H", "127.0.0.1", "-p", str(port), "-t", str(threads)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"rpc-server on port {port} did not listen") from None
            time.sleep(0.1)


# llama.cpp's RPC protocol as vendored in llama-cpp-python 0.3.36 (ggml/src/ggml-rpc): a request is
# | command (1 byte) | size (u64) | data |, a reply | size (u64) | data |; HELLO (14) carries 24 bytes of
# transport capabilities and is answered with major, minor, patch, padding and 24 bytes of them
RPC_PROTO_MAJOR, RPC_PROTO_MINOR = 7, 0
RPC_CMD_HELLO = 14
RPC_CONN_CAPS_SIZE = 24


def _reachable(endpoint: str, timeout: float = 5.0, other_users: bool = False) -> None:
    """Say HELLO to an rpc-server before llama.cpp does: its client aborts the
    process when a server fails, and waits forever on one that serves another
    client (an rpc-server serves one at a time). A server that is not there,
    is busy, speaks another protocol version or (on loopback, unless
    ``other_users``) runs as another user gets a message naming the fix."""
    import socket
    import struct

    host, _, port = endpoint.rpartition(":")
    bind = "127.0.0.1" if host.startswith("127.") or host == "localhost" else "ADDRESS"
    start = f"start it there first: rpc-server -H {bind} -p {port} (built by bench/build_rpc.sh)"
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout)
    except TimeoutError:
        raise DeviceError(
            f"cannot reach the rpc-server at {endpoint}: no answer to the connection within {timeout:.0f} s (is the "
            "host up, and the port open in its firewall?)"
        ) from None
    except OSError as exc:
        raise DeviceError(f"cannot reach the rpc-server at {endpoint} ({exc.strerror or exc}); {start}") from None
    with sock:
        if not other_users:
            _same_user(endpoint, sock)
        try:
            sock.sendall(struct.pack("<BQ", RPC_CMD_HELLO, RPC_CONN_CAPS_SIZE) + bytes(RPC_CONN_CAPS_SIZE))
            want = 8 + 4 + RPC_CONN_CAPS_SIZE
            reply = b""
            while len(reply) < want:
                part = sock.recv(want - len(reply))
                if not part:
                    break
                reply += part
        except TimeoutError:
            raise DeviceError(
                f"the rpc-server at {endpoint} does not answer within {timeout:.0f} s: an rpc-server serves one "
                "client at a time; is another tandem daemon or llama.cpp program using it? Give each its own "
                "rpc-server"
            ) from None
        except OSError as exc:
            raise DeviceError(f"the rpc-server at {endpoint} closed the connection ({exc.strerror or exc})") from None
    size = struct.unpack("<Q", reply[:8])[0] if len(reply) >= 8 else 0
    if len(reply) < want or size != 4 + RPC_CONN_CAPS_SIZE:
        raise DeviceError(
            f"{endpoint} does not answer as an rpc-server of this llama.cpp ({LLAMA_CPP_PYTHON}, RPC protocol "
            f"{RPC_PROTO_MAJOR}.{RPC_PROTO_MINOR}); {start}"
        )
    major, minor, patch = reply[8], reply[9], reply[10]
    if major != RPC_PROTO_MAJOR or minor > RPC_PROTO_MINOR:
        raise DeviceError(
            f"the rpc-server at {endpoint} speaks RPC protocol {major}.{minor}.{patch}, this llama.cpp "
            f"({LLAMA_CPP_PYTHON}) {RPC_PROTO_MAJOR}.{RPC_PROTO_MINOR}: build the server from the same sources "
            "(bench/build_rpc.sh)"
        )


def _same_user(endpoint: str, sock, proc: Optional[Path] = None) -> None:
    """On loopback, the process listening at ``endpoint`` must run as us: a
    loopback port is open to every user, and another's server would get the
    prompts' activations (the owner is looked up in /proc/net/tcp; where that
    cannot be read, not Linux, nothing is checked)."""
    import ipaddress
    import os

    from ..front.tcp_owner import NOT_FOUND, owner_uid

    peer, local = sock.getpeername(), sock.getsockname()
    if not ipaddress.ip_address(peer[0]).is_loopback:
        return
    uid = owner_uid(peer, local) if proc is None else owner_uid(peer, local, proc)
    if uid is None or uid == os.getuid():
        return
    who = "a process of an unknown user" if uid == NOT_FOUND else f"a process of uid {uid}"
    raise DeviceError(
        f"the rpc-server at {endpoint} is {who}, not yours (uid {os.getuid()}): it would get your prompts' "
        "activations. Start your own on a free port, or set rpc_leaves_machine = true if you trust it"
    )


# --------------------------------------------------------------------------- where the layers went

_LAYER = re.compile(r"layer\s+(\d+) assigned to device (\S+?),")
_BUFFER = re.compile(r"load_tensors:\s+(.+?) model buffer size =\s+([\d.]+) MiB")
_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")


@dataclass
class Placement:
    """Where llama.cpp put a model: layers per device (the input layer is not
    counted, the output layer is), weight bytes per buffer, layers offloaded."""

    layers: dict[str, int] = field(default_factory=dict)
    weights: dict[str, int] = field(default_factory=dict)
    offloaded: int = 0
    n_layers: int = 0  # repeating layers + the output layer
    errors: list[str] = field(default_factory=list)  # llama.cpp's error lines during the load

    def key(self) -> str:
        """ "" with every layer on the CPU, else where they are: what measured
        speeds and the batch-invariance verdict depend on beside the model."""
        if set(self.layers) <= {"CPU"}:
            return ""
        return "layers=" + ",".join(f"{d}:{n}" for d, n in sorted(self.layers.items()))


class LoadLog:
    """Collect llama.cpp's log while a model loads (``with LoadLog() as log:``);
    the quiet logger of llama-cpp-python is put back afterwards."""

    def __init__(self) -> None:
        self.lines: list[tuple[int, str]] = []
        self._partial = ""

        @llama.llama_log_callback
        def callback(level: int, text: bytes, user_data) -> None:
            self.lines.append((level, text.decode("utf-8", errors="replace")))

        self._callback = callback  # kept alive while installed

    def __enter__(self) -> "LoadLog":
        llama.llama_log_set(self._callback, ctypes.c_void_p(0))
        return self

    def __exit__(self, *exc) -> None:
        llama.llama_log_set(llama_logger.llama_log_callback, ctypes.c_void_p(0))

    def placement(self) -> Placement:
        text = "".join(t for _, t in self.lines)
        out = Placement()
        for line in text.splitlines():
            if m := _LAYER.search(line):
                out.layers[m.group(2)] = out.layers.get(m.group(2), 0) + 1
            elif m := _BUFFER.search(line):
                name = m.group(1).strip()
                out.weights[name] = out.weights.get(name, 0) + int(float(m.group(2)) * 2**20)
            elif m := _OFFLOADED.search(line):
                out.offloaded, out.n_layers = int(m.group(1)), int(m.group(2))
        if not out.n_layers:
            out.n_layers = sum(out.layers.values())
        errors: list[str] = []
        last = 0
        for level, t in self.lines:  # GGML_LOG_LEVEL_ERROR = 4; CONT (5) goes on the line before
            if level == 5 and last == 4 and errors:
                errors[-1] += t
                continue
            last = last if level == 5 else level
            if level == 4:
                errors.append(t)
        out.errors = [e.strip() for e in errors if e.strip()]
        return out
