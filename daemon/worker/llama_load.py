"""Loading a GGUF model file into llama.cpp, and the CPU kernels it runs with.

``LlamaModel`` (llama_model.py) boots through these: ``load_weights`` (the
file's weights, on the devices asked for), ``create_context`` (a context over
them, noting the CPU backends it creates), the extra weight buffers
(``default_extra_buffers``) and the reference kernels
(``use_reference_kernels``), switched per pass for fast prefill
(``set_reference``). ``reference_llama`` loads a file the way
llama-cpp-python's own ``Llama`` does, with the same settings.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path
from typing import Optional, Sequence

import llama_cpp as llama

from ..kernels import cpu_has_amx
from ..models.context_size import KV_TYPES

log = logging.getLogger(__name__)


class ModelLoadError(Exception):
    pass


class DecodeError(Exception):  # (raised by LlamaModel's passes and the prompt reader's copies)
    pass


def tokenize(vocab, data: bytes, add_special: bool, parse_special: bool) -> list[int]:
    """llama_tokenize of ``data`` (UTF-8), with a buffer as large as it asks for."""
    capacity = len(data) + 8
    buf = (llama.llama_token * capacity)()
    n = llama.llama_tokenize(vocab, data, len(data), buf, capacity, add_special, parse_special)
    if n < 0:
        capacity = -n
        buf = (llama.llama_token * capacity)()
        n = llama.llama_tokenize(vocab, data, len(data), buf, capacity, add_special, parse_special)
    return list(buf[:n])


def default_threads() -> int:
    return max(1, os.cpu_count() or 1)


def default_extra_buffers(reference_kernels: bool = True, fast_prefill: bool = False) -> bool:
    """llama.cpp's extra weight buffers (repacking, and AMX on Intel CPUs that
    have it): on where steps stay exact with them, off where AMX is present
    (the AMX matmul kernel segfaults on the first decode on an AMX-capable Xeon
    VM, llama-cpp-python 0.3.36, Q4_1).

    Repacked Q4_0/Q4_K/Q8_0 weights multiply 4 rows at a time (gemm) and a
    leftover row alone (gemv), which round differently; a pass of at most 3
    rows is all gemv, each row as a one-token step computes it. So: on with
    fast kernels (nothing is exact there anyway); on with ``--kernels mixed``
    (``fast_prefill``), whose steps run in passes of at most ``REPACK_STEP_ROWS``
    rows (``decode``); off with the reference kernels everywhere (``--kernels
    reference``, whose prompts are read by steps); a drafter's:
    ``worker_config.drafter_extra_buffers``. Repacking decodes Q4_K a third faster on this machine's AVX-512
    EPYC (Qwen2.5-Coder-1.5B: 26.8 against 36.7 ms a step) and reads prompts
    slower (148 against 246 tok/s), as llama-server does; the prompt reader
    (``add_prompt_reader``) gives the faster prompts back."""
    return (not reference_kernels or fast_prefill) and not cpu_has_amx()


# With extra buffers, steps (the reference kernels) run in passes of at most this many
# rows: repack.cpp's gemv, one row at a time, the kernel of a one-token step (from 4
# rows it multiplies 4 at a time, which rounds differently).
REPACK_STEP_ROWS = 3


_REFERENCE_KERNELS = {"on": False, "hook": None, "set": None, "created": None}


def use_reference_kernels(on: bool) -> None:
    """Make llama.cpp CPU contexts created from now on use ggml's row-by-row
    kernels (``ggml_backend_cpu_set_use_ref``), so that a position's logits do
    not depend on how many tokens were decoded with it.

    ggml's CPU backend picks kernels by batch shape: flash attention is tiled for
    64 or more query rows and split across threads for one row over 512 or more
    KV cells; K-quant matmuls are tiled from 8 rows; ops are fused. Each rounds
    differently, so a prefix-cache restore, a verify pass or a one-token step can
    give other logits than one long prefill. ``use_ref`` turns those variants off
    (it is what llama.cpp's test-backend-ops compares against). llama.cpp has no
    API to set it on a context's backend, so this wraps the CPU device's
    ``init_backend`` (``struct ggml_backend_device_i``, 6th slot, pinned to the
    llama.cpp vendored in llama-cpp-python 0.3.36) to set it on every CPU
    backend the device creates. Whether it took effect is not assumed: the load
    probe (``LlamaModel.batch_invariance``) measures it."""
    _REFERENCE_KERNELS["on"] = bool(on)
    if _REFERENCE_KERNELS["hook"] is not None or not on:
        return
    _install_kernel_hook()


def _install_kernel_hook() -> None:
    """Wrap the CPU device's ``init_backend`` (see ``use_reference_kernels``): every
    CPU backend it creates gets the reference kernels while they are on, and is
    listed in ``_REFERENCE_KERNELS["created"]`` while a context is being created,
    so that its model can switch them per pass (``LlamaDecoder.prefill``)."""
    from ..models.devices import DeviceError, libs

    try:
        ggml = base = libs().ggml
    except DeviceError as exc:
        raise ModelLoadError(str(exc)) from None
    dev = ggml.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    if not dev or base.ggml_backend_dev_name(dev) != b"CPU":
        raise ModelLoadError("llama.cpp has no CPU device to set reference kernels on")
    set_ref_addr = base.ggml_backend_reg_get_proc_address(
        base.ggml_backend_dev_backend_reg(dev), b"ggml_backend_cpu_set_use_ref"
    )
    if not set_ref_addr:
        raise ModelLoadError("this llama.cpp has no ggml_backend_cpu_set_use_ref")
    set_ref = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_bool)(set_ref_addr)
    init_type = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)
    slot = ctypes.c_void_p.from_address(dev + 5 * ctypes.sizeof(ctypes.c_void_p))  # iface.init_backend
    original = init_type(slot.value)

    @init_type
    def init_backend(device, params):
        backend = original(device, params)
        if backend and _REFERENCE_KERNELS["on"]:
            set_ref(backend, True)
        if backend and _REFERENCE_KERNELS["created"] is not None:
            _REFERENCE_KERNELS["created"].append(backend)
        return backend

    _REFERENCE_KERNELS["hook"] = (init_backend, original)  # kept alive: llama.cpp holds the pointer
    _REFERENCE_KERNELS["set"] = set_ref
    slot.value = ctypes.cast(init_backend, ctypes.c_void_p).value


def set_reference(backends: Sequence[int], on: bool) -> None:
    """The reference kernels on (or off: ggml's fast ones) for these CPU backends
    (a context's, from ``create_context``)."""
    set_ref = _REFERENCE_KERNELS["set"]
    for backend in backends:
        set_ref(backend, on)


def can_switch_kernels(backends: Sequence[int]) -> bool:
    """Can ``set_reference`` switch these backends' kernels?"""
    return bool(backends and _REFERENCE_KERNELS["set"])


def load_weights(path: Path, extra_buffers: bool, gpu_layers: int, device_names: Sequence[str]):
    """(llama.cpp's model, where its layers and weights went: ``devices.Placement``)."""
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    from ..models.devices import DeviceError, LoadLog, select_devices

    params = llama.llama_model_default_params()
    params.use_extra_bufts = extra_buffers
    params.n_gpu_layers = gpu_layers
    if device_names:
        try:
            chosen = select_devices(device_names)
        except DeviceError as exc:
            raise ModelLoadError(str(exc)) from None
        params.devices = ctypes.addressof(chosen)  # kept alive by `chosen` until the load returns
    with LoadLog() as load_log:
        model = llama.llama_model_load_from_file(os.fsencode(path), params)
    placement = load_log.placement()
    if not model:
        why = "; ".join(placement.errors[-3:]) or "is it a GGUF model file?"
        raise ModelLoadError(f"llama.cpp could not load {path}: {why}")
    return model, placement


def create_context(
    model, n_ctx: int, n_batch: int, n_threads: int, flash_attn: bool, kv_type: str = "f16"
) -> tuple[object, list[int]]:
    """(a llama.cpp context over ``model``, NULL where it could not be created;
    the CPU backends created with it, whose kernels ``set_reference`` switches)."""
    params = llama.llama_context_default_params()
    params.n_ctx = n_ctx
    params.n_batch = n_batch
    params.n_ubatch = n_batch
    params.n_seq_max = 1
    params.n_threads = n_threads
    params.n_threads_batch = n_threads
    params.no_perf = True
    params.type_k = params.type_v = KV_TYPES[kv_type][0]
    params.flash_attn_type = llama.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else llama.LLAMA_FLASH_ATTN_TYPE_DISABLED
    _REFERENCE_KERNELS["created"] = []
    try:
        ctx = llama.llama_init_from_model(model, params)
    finally:
        cpu_backends, _REFERENCE_KERNELS["created"] = _REFERENCE_KERNELS["created"] or [], None
    return ctx, cpu_backends


def reference_llama(path: Path | str, n_ctx: int, n_threads: Optional[int] = None, **kwargs) -> "llama.Llama":
    """llama-cpp-python's own high-level ``Llama`` with the worker's default
    settings (threads, reference kernels, flash attention, extra buffers), for
    comparing the daemon against it in-process. ``Llama`` does not expose
    ``use_extra_bufts``, so its default params are patched while it loads."""
    original = llama.llama_cpp.llama_model_default_params

    def params():
        p = original()
        p.use_extra_bufts = default_extra_buffers()
        return p

    threads = n_threads or default_threads()
    kwargs.setdefault("flash_attn", True)
    use_reference_kernels(True)
    llama.llama_cpp.llama_model_default_params = params
    try:
        return llama.Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False, **kwargs)
    finally:
        llama.llama_cpp.llama_model_default_params = original
