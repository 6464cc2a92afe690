"""What a worker process is started with, and how it loads its model.

The daemon writes a ``WorkerConfig`` as JSON on the worker's stdin (see
worker_handle.py). It carries the daemon's settings whole (``config.OPTIONS``'
keys: ``ctx_size``, ``kernels``, ``draft_tokens``...), so an option is spelled
once, and beside them only what the daemon derived: the worker's role and model,
its sockets, the prefix cache's arena and the files it keeps state in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from tandem.protocol import ModelInfo

EXTRA_BUFFERS = {"auto": None, "on": True, "off": False}


# drafters without a model: they look tokens up in the context (no process, no KV)
LOOKUP_DRAFTERS = ("ngram", "suffix")


@dataclass
class WorkerConfig:
    role: str  # "target" or "drafter"
    model_name: str
    model_path: str
    settings: dict[str, Any]  # the daemon's settings (config.Settings.values, paths as strings)
    endpoint: str = ""  # the daemon's PAIR socket for this worker (set at each start)
    drafter: str = "none"  # target only: "none", "model" or one of LOOKUP_DRAFTERS
    draft_endpoint: str = ""  # the drafter worker binds it, the target worker connects to it
    cache_shm: str = ""  # the daemon's prefix-cache arena (its path in shared memory); "": no prefix cache
    cache_bytes: int = 0  # its size (what could be reserved; settings' cache_bytes may be "auto")
    governor_state: str = ""  # file the governor's state is kept in ("": not kept)
    governor_identity: str = ""  # target, drafter, k and kernels: the state is valid only for these
    probe_cache: str = ""  # file keeping the batch-invariance probe's verdicts across restarts ("": not kept)
    drafter_bytes: int = 0  # the target's: the model drafter's file size (its step-cost prior)
    drafter_quantization: str = ""  # the target's: the model drafter's (gguf general.file_type), "" unknown
    spin_count: Optional[int] = None  # GOMP_SPINCOUNT (None: libgomp's default); see ``spin_count_for``

    def __getitem__(self, key: str) -> Any:
        """A setting: ``config["kernels"]``."""
        return self.settings[key]

    @property
    def draft_tokens(self) -> int:
        return self.settings["draft_tokens"] if self.drafter != "none" else 0

    @property
    def governed(self) -> bool:
        return bool(self.settings["governor"]) and self.drafter != "none"


def describe_model(model, config: WorkerConfig, **more: Any) -> ModelInfo:
    """What a worker tells the daemon about its loaded model; ``more``: its role's own fields."""
    return ModelInfo(
        name=config.model_name,
        path=str(model.path),
        n_ctx=model.n_ctx,
        n_ctx_train=model.n_ctx_train,
        n_vocab=model.n_vocab,
        size_bytes=model.size_bytes,
        **more,
    )


def load_model(config: WorkerConfig):
    """Load the worker's model with the daemon's llama.cpp settings (call only
    after the process environment is set: this imports llama.cpp)."""
    from .llama_model import LlamaModel

    kernels = config["kernels"]
    return LlamaModel(
        config.model_path,
        n_ctx=config["ctx_size"],
        n_threads=config["threads"],
        n_batch=config["batch_size"],
        extra_buffers=EXTRA_BUFFERS[config["extra_buffers"]],  # auto: LlamaModel's (off but with fast kernels)
        flash_attn=config["flash_attn"],
        reference_kernels=kernels != "fast",
        # the drafter's KV need not be exact (the target verifies what it drafts): it reads as before
        fast_prefill=kernels == "mixed" and config.role == "target",
        # a turn's tail read again in whole chunks between requests (LlamaModel.settle), into cache pages
        settle=config.role == "target" and bool(config.cache_shm) and config["settle"],
    )


TWO_PROCESS_SPIN = 10_000


def spin_count_for(drafter_kind: str) -> Optional[int]:
    """The OpenMP spin (GOMP_SPINCOUNT) of the workers of a daemon with this drafter.

    llama.cpp's threads spin after each graph. With a model drafter, two llama.cpp
    processes take turns on the same cores and the idle one's spinning steals the
    busy one's: a short spin (10,000) removes that (FACTS.md: +23% on a target step
    right after drafter steps at the default, none at 10,000). With one llama.cpp
    process (no drafter, or the n-gram drafter, which is Python) nothing competes,
    and libgomp's default spin (300,000) decodes 2-5% faster than the short one
    (measured against llama-server, bench/peer.py). The environment's own
    GOMP_SPINCOUNT, where set, wins in both cases."""
    return TWO_PROCESS_SPIN if drafter_kind == "model" else None
