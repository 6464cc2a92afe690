"""How long a context the daemon gives its models: the KV cache's size per
token from the GGUF header, and the context chosen within a memory budget.

``--ctx-size auto`` (the default) is the model's trained context when the KV
caches of every context the daemon creates for it (the target's and a model
drafter's) fit ``--kv-budget``; else the longest that fits, in whole 1,024s. An
explicit ``--ctx-size`` is taken as given, with a warning when it is over the
budget. llama.cpp allocates the KV cache of the whole context at load, so this
is what a context costs in memory whether or not a prompt fills it. The prompt
reader's second context (``--prompt-reader``, over repacked weights), which
doubles the target's KV cache, is kept by ``auto`` only where it fits in what the
budget leaves (``ContextChoice.room``). With layers on a GPU the budget is still
the machine's memory, not the device's.

Per token and layer a context keeps ``n_head_kv * (key_length + value_length)``
elements; their size is the ``--kv-type``'s (llama.cpp's ``type_k``/``type_v``):
f16 2 bytes, q8_0 34 bytes per 32, q4_0 18 bytes per 32.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import psutil

from .gguf_meta import read_metadata

log = logging.getLogger("tandem.daemon")

# --kv-type -> (ggml type id, bytes per element)
KV_TYPES: dict[str, tuple[int, float]] = {"f16": (1, 2.0), "q8_0": (8, 34 / 32), "q4_0": (2, 18 / 32)}
KV_BUDGET_SHARE = 4  # auto budget: a quarter of the machine's memory
CONTEXT_STEP = 1024  # a context cut to the budget is a multiple of this
MIN_CONTEXT = 2048  # ... and never shorter (then over the budget, with a warning)
FALLBACK_CONTEXT = 4096  # a model file that does not say its trained context
UNSIZED_CONTEXT = 8192  # auto for a model whose KV size the header does not give (as before the budget)


class ContextError(ValueError):
    """A model file whose header does not say what its KV cache needs."""


def kv_bytes_per_token(meta: dict[str, Any], kv_type: str = "f16") -> int:
    """Bytes of KV cache one token takes in a context of this model (all layers)."""
    arch = str(meta.get("general.architecture") or "")
    layers = meta.get(f"{arch}.block_count")
    heads = meta.get(f"{arch}.attention.head_count")
    embd = meta.get(f"{arch}.embedding_length")
    if not all(isinstance(x, int) and x > 0 for x in (layers, heads, embd)):
        raise ContextError(f"the GGUF header has no block_count, head_count or embedding_length for '{arch}'")
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per layer (some architectures): the widest layer for all
        kv_heads = max((h for h in kv_heads if isinstance(h, int)), default=heads)
    if not isinstance(kv_heads, int) or kv_heads <= 0:
        kv_heads = heads
    k_len = meta.get(f"{arch}.attention.key_length") or embd // heads
    v_len = meta.get(f"{arch}.attention.value_length") or embd // heads
    return int(layers * kv_heads * (k_len + v_len) * KV_TYPES[kv_type][1])


def trained_context(meta: dict[str, Any]) -> int:
    arch = str(meta.get("general.architecture") or "")
    n = meta.get(f"{arch}.context_length")
    return n if isinstance(n, int) and n > 0 else FALLBACK_CONTEXT


def default_kv_budget() -> int:
    return psutil.virtual_memory().total // KV_BUDGET_SHARE


@dataclass(frozen=True)
class ContextChoice:
    n_ctx: int
    trained: int
    kv_bytes: int  # the KV caches of every context at n_ctx (target and model drafter)
    budget: int
    note: str  # how it was chosen, for the start-up log and `tandem status`

    @property
    def room(self) -> int:
        """Bytes the budget leaves beside those KV caches (0 when they are over it; -1: not known)."""
        return max(0, self.budget - self.kv_bytes) if self.kv_bytes else -1


def mib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


def choose_context(
    requested: Optional[int],
    model: Path,
    drafter: Optional[Path] = None,
    kv_type: str = "f16",
    budget: Optional[int] = None,
) -> ContextChoice:
    """The context the daemon's models get: ``requested`` (None: auto, see the
    module's docstring), for the target ``model`` and a model ``drafter``."""
    budget = budget or default_kv_budget()
    target = read_metadata(model)
    trained = trained_context(target)
    try:
        per_token = kv_bytes_per_token(target, kv_type)
        if drafter is not None:
            per_token += kv_bytes_per_token(read_metadata(drafter), kv_type)
    except ContextError:  # no attention heads (a recurrent model): no KV cache that grows with the context
        n = requested or min(trained, UNSIZED_CONTEXT)
        how = "--ctx-size" if requested else f"the model's, at most {UNSIZED_CONTEXT:,}"
        return ContextChoice(n, trained, 0, budget, f"{n:,} tokens ({how}; its KV size is not known here)")
    fits = budget // per_token
    cost = f"{kv_type} KV cache {{}} of the {mib(budget)} budget (--kv-budget)"
    if requested:
        n = requested
        note = f"{n:,} tokens (--ctx-size), " + cost.format(mib(n * per_token))
        if n * per_token > budget:
            log.warning(
                "--ctx-size %d needs %s of KV cache, over the %s --kv-budget", n, mib(n * per_token), mib(budget)
            )
    elif trained <= fits:
        n = trained
        note = f"{n:,} tokens (the model's trained context), " + cost.format(mib(n * per_token))
    else:
        n = max(fits // CONTEXT_STEP * CONTEXT_STEP, min(MIN_CONTEXT, trained))
        note = (
            f"{n:,} tokens, not the model's {trained:,}: that would take {mib(trained * per_token)} of {kv_type} "
            f"KV cache, over the {mib(budget)} budget (raise --kv-budget, or --kv-type q8_0 halves it)"
        )
        log.warning("context %s", note)
    return ContextChoice(n, trained, n * per_token, budget, note)
