"""What a worker process is started with, and how it loads its model.

The daemon writes a ``WorkerConfig`` as JSON on the worker's stdin
(``to_dict``; the worker reads it with ``from_dict``: see worker_handle.py and
worker_main.py). It carries the daemon's settings whole, typed
(``config.SettingsValues``: ``config.settings.kernels``), so an option is spelled
once, and beside them only what the daemon derived: the worker's role and model,
its sockets, the prefix cache's arena and the files it keeps state in.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any, Literal, Mapping, Optional

from tandem.protocol import ModelInfo

from ..config import SettingsValues, is_loopback, rpc_servers
from ..kernels import cpu_has_amx

log = logging.getLogger("tandem.worker")

EXTRA_BUFFERS = {"auto": None, "on": True, "off": False}


# drafters without a model: they look tokens up in the context (no process, no KV)
LOOKUP_DRAFTERS = ("ngram", "suffix")


@dataclass
class WorkerConfig:
    role: str  # "target" or "drafter"
    model_name: str
    model_path: str
    settings: SettingsValues  # the daemon's settings (config.Settings.values)
    endpoint: str = ""  # the daemon's PAIR socket for this worker (set at each start)
    drafter: str = "none"  # target only: "none", "model" or one of LOOKUP_DRAFTERS
    draft_endpoint: str = ""  # the drafter worker binds it, the target worker connects to it
    cache_shm: str = ""  # the daemon's prefix-cache arena (its path in shared memory); "": no prefix cache
    cache_bytes: int = 0  # its size (what could be reserved; settings' cache_bytes may be "auto")
    governor_state: str = ""  # file the governor's state is kept in ("": not kept)
    governor_identity: str = ""  # target, drafter, k and kernels: the state is valid only for these
    probe_cache: str = ""  # file keeping the batch-invariance probe's verdicts across restarts ("": not kept)
    drafter_bytes: int = 0  # the target's: the model drafter's file size (its step-cost prior)
    # the target's: the model drafter's quantization where it is small and at 4 bits or fewer (its
    # acceptance is logged once measured: models.narrow_drafter), else ""
    drafter_quantization: str = ""
    spin_count: Optional[int] = None  # GOMP_SPINCOUNT (None: libgomp's default); see ``spin_count_for``
    life: int = 1  # 1 at the daemon's start, 2... for each restart of this worker
    n_ctx: int = 0  # the context the daemon chose (models/context_size.py); 0: settings' ctx_size or the model's
    kv_room: int = -1  # the target's: bytes --kv-budget leaves beside the KV caches of n_ctx (-1: not known)

    @property
    def draft_tokens(self) -> int:
        return self.settings.draft_tokens if self.drafter != "none" else 0

    @property
    def governed(self) -> bool:
        return self.settings.governor and self.drafter != "none"

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (JSON, msgpack): what the daemon writes on the worker's stdin."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return {**out, "settings": self.settings.to_dict()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WorkerConfig:
        """The inverse of ``to_dict``: what the worker reads from its stdin."""
        return cls(**{**data, "settings": SettingsValues.from_dict(data["settings"])})


def describe_model(model, config: WorkerConfig, **more: Any) -> ModelInfo:
    """What a worker tells the daemon about its loaded model; ``more``: its role's own fields."""
    from ..models.devices import gpu_backend, gpu_note, list_devices

    placement = model.placement
    devices = list_devices()
    return ModelInfo(
        name=config.model_name,
        path=str(model.path),
        n_ctx=model.n_ctx,
        n_ctx_train=model.n_ctx_train,
        n_vocab=model.n_vocab,
        size_bytes=model.size_bytes,
        devices=devices,
        gpu_backend=gpu_backend(),
        gpu_note=gpu_note(devices),
        gpu_layers_asked=model.gpu_layers,
        n_layers=placement.n_layers,
        layers=dict(placement.layers),
        weights=dict(placement.weights),
        kv_type=model.kv_type,
        **more,
    )


def _own_placement(config: WorkerConfig) -> tuple[int | Literal["all"] | None, str]:
    """(gpu_layers, device) of this worker's model: the drafter has its own (drafter_gpu_layers, drafter_device)."""
    s = config.settings
    return (s.drafter_gpu_layers, s.drafter_device) if config.role == "drafter" else (s.gpu_layers, s.device)


def placement_settings(config: WorkerConfig) -> tuple[int, list[str]]:
    """(n_gpu_layers, device names) for this worker's model from the settings
    (the drafter's own: drafter_gpu_layers, drafter_device). auto and "all" are
    llama.cpp's -1: every layer on the GPU and RPC devices there are, none on a
    build without them. Device "none" keeps every layer on the CPU."""
    layers, device = _own_placement(config)
    device = device.strip()
    n = -1 if layers is None or layers == "all" else int(layers)
    if device.lower() == "none":
        return 0, []
    names = [] if device.lower() in ("", "auto") else [d.strip() for d in device.split(",") if d.strip()]
    return n, names


def load_model(config: WorkerConfig):
    """Load the worker's model with the daemon's llama.cpp settings (call only
    after the process environment is set: this imports llama.cpp)."""
    from ..kernels import rows_as_steps
    from .llama_model import LlamaModel

    s = config.settings
    if config.role == "target" and s.rpc:
        servers = rpc_servers(s.rpc)  # IPv4 addresses (config.check_rpc resolved any names)
        remote = [server for server in servers if not is_loopback(server)]
        if remote and s.rpc_leaves_machine:  # (config.check_rpc refuses them otherwise)
            log.warning(
                "rpc: %s not on this machine: the target's weights and every request's activations cross the "
                "network, unencrypted (rpc_leaves_machine is on)",
                ", ".join(remote),
            )
        _add_rpc_servers(servers, wait=RPC_RESTART_WAIT if config.life > 1 else 0.0, other_users=s.rpc_leaves_machine)
    gpu_layers, devices = placement_settings(config)
    kernels = s.kernels
    model = LlamaModel(
        config.model_path,
        n_ctx=config.n_ctx or s.ctx_size,
        kv_type=s.kv_type,
        n_threads=s.threads,
        n_batch=s.batch_size,
        # auto: default_extra_buffers for the target, drafter_extra_buffers for a drafter
        extra_buffers=EXTRA_BUFFERS[s.extra_buffers]
        if config.role == "target"
        else drafter_extra_buffers(s, patched=rows_as_steps()),
        flash_attn=s.flash_attn,
        reference_kernels=kernels != "fast",
        # (a drafter reads on the reference kernels, its KV independent of how its tokens were split)
        fast_prefill=kernels == "mixed" and config.role == "target",
        # a turn's tail read again in whole chunks between requests (LlamaModel.settle), into cache pages
        settle=config.role == "target" and bool(config.cache_shm) and s.settle,
        gpu_layers=gpu_layers,
        devices=devices,
        # (only where there are repacked weights and fast prefill; auto is measured by target_worker)
        prompt_reader=config.role == "target" and s.prompt_reader != "off",
    )
    _say_where(model, config)
    return model


def drafter_extra_buffers(s: SettingsValues, patched: bool) -> bool:
    """Whether a model drafter's weights are repacked (llama.cpp's extra buffers): as --extra-buffers
    says; under auto where its passes of any width stay exact (tandem's kernels: ``patched``) or need not
    (fast kernels), never on CPUs with AMX (it crashes there). With llama.cpp's own reference kernels a
    repacked model reads in passes of 3 rows, about a step a token: a drafter reading a long prompt would
    time out. The daemon asks it before starting workers (which copy of the drafter to load, serve.py),
    a drafter's worker when it loads."""
    if s.extra_buffers != "auto":
        return s.extra_buffers == "on"
    return not cpu_has_amx() and (patched or s.kernels == "fast")


RPC_RESTART_WAIT = 300.0  # seconds a restarted target waits for its rpc-servers to come back


def _add_rpc_servers(servers: list[str], wait: float, other_users: bool) -> None:
    """Register the rpc-servers; a restarted worker (the target died because a
    server went away) waits up to ``wait`` seconds for them to answer again, so
    a server restarted meanwhile brings the daemon back without a restart."""
    import time

    from ..models.devices import DeviceError, add_rpc_servers
    from .llama_model import ModelLoadError

    deadline = time.monotonic() + wait
    said = False
    while True:
        try:
            add_rpc_servers(servers, other_users=other_users)
            return
        except DeviceError as exc:
            if time.monotonic() >= deadline or "built without" in str(exc):
                raise ModelLoadError(str(exc)) from None
            if not said:
                log.warning("%s; waiting up to %.0f s for it", exc, wait)
                said = True
            time.sleep(2.0)


def _say_where(model, config: WorkerConfig) -> None:
    """Log where the layers went, and why not where they were asked to go."""
    from ..models.devices import gpu_note, list_devices

    p = model.placement
    where = ", ".join(f"{n} on {d}" for d, n in sorted(p.layers.items(), key=lambda kv: -kv[1])) or "unknown"
    log.info("%s: %d layers: %s", model.path.name, p.n_layers, where)
    asked = _own_placement(config)[0]
    # asked for layers (not auto, not 0, not --device none), yet none went anywhere but the CPU
    if asked is not None and placement_settings(config)[0] != 0 and set(p.layers) <= {"CPU"}:
        why = gpu_note(list_devices()) or "llama.cpp placed none elsewhere"
        key = "drafter_gpu_layers" if config.role == "drafter" else "gpu_layers"
        log.warning("%s = %s, but every layer runs on the CPU: %s", key, asked, why)


TWO_PROCESS_SPIN = 10_000


def spin_count_for(drafter_kind: str, role: str) -> Optional[int]:
    """The OpenMP spin (GOMP_SPINCOUNT) of a worker of this role in a daemon with this drafter.

    llama.cpp's threads spin after each graph, and ggml's barriers between a
    graph's ops are OpenMP barriers that spin as long before they sleep. With a
    model drafter, two llama.cpp processes take turns on the same cores, and the
    idle one's spinning steals the busy one's: both spin briefly (10,000). The
    drafter's spin slowed the target's round after its steps (FACTS.md: +23% at the
    default spin for both, none at 10,000 for both); the target's (libgomp's
    default, 300,000) slowed the drafter's steps after each verify pass: with the
    Qwen2.5-Coder 1.5B/0.5B pair, a Q4_0 drafter repacked (2026-12-07, AVX2 EPYC,
    forced drafting on a code prompt, 2 runs each) a draft cost 19-25 ms beside the
    target at the default spin and 16-17 ms at 10,000 (15 ms alone); forced drafting
    ran 0.95x and 1.30x plain against 1.25x and 1.26x, and the target's plain rounds
    took 51-52 ms against 54-59 (the machine's noise). (An earlier measurement, with dearer drafters, 2026-12-02, had
    governed plain rounds 2-3% slower at the short spin, within its noise.) With one
    llama.cpp process (no drafter, or a lookup drafter, which is Python) nothing
    competes: the default. GOMP_SPINCOUNT in the environment wins."""
    return TWO_PROCESS_SPIN if drafter_kind == "model" else None
