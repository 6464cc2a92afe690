"""The batch-invariance probe's verdict, kept across restarts, and what fixes it.

``LlamaModel.batch_invariance()`` measures whether a model's logits depend on
how its tokens were batched; it takes a few seconds for a 1.5B model on 2
cores, so the target worker keeps its verdict in a small JSON file keyed by
everything the verdict depends on.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Callable, Optional

from .worker_config import WorkerConfig

log = logging.getLogger("tandem.worker")

PROBE_PATHS = {"restore", "verify", "one_token", "small_batches", "exact_steps"}  # LlamaModel.batch_invariance's keys


PROBE_VERSION = 2  # what the probe measures (2: its verify passes across position 256, load_checks.PROBE_LEAD)


def probe_key(model, config: WorkerConfig) -> str:
    """What the probe's verdict depends on: the model file, the kernels and
    their settings, the CPU's features as llama.cpp sees them, and its version."""
    st = model.path.stat()
    parts = (
        PROBE_VERSION,
        str(model.path.resolve()),
        st.st_size,
        st.st_mtime_ns,
        config.settings.kernels,
        model.flash_attn,
        model.kv_type,
        model.extra_buffers,
        model.step_rows,  # (with repacked weights, steps in passes of this many rows: exact from 3 down)
        model.n_batch,
        model.n_threads,
        *model.runtime(),
    )
    if model.placement.key():  # offloaded: the verdict is the devices' (a CPU one says nothing of a GPU)
        parts += (model.placement.key(),)
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def _read_kept(path: Optional[Path]) -> dict:
    """The verdicts kept in ``path``: a missing, corrupt or foreign file is none."""
    if path is None:
        return {}
    try:
        if path.is_file() and path.stat().st_size < 1 << 20:  # never a FIFO or a huge file
            known = json.loads(path.read_text())
            return known if isinstance(known, dict) else {}
    except Exception:  # unreadable, not JSON, nested too deep: measure again
        pass
    return {}


def _keep(path: Optional[Path], key: str, verdict: dict) -> None:
    """Add ``verdict`` under ``key`` to the file (its newest 32 entries kept)."""
    if path is None:
        return
    known = {k: v for k, v in _read_kept(path).items() if isinstance(v, dict)}
    known.pop(key, None)
    known[key] = verdict
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(dict(list(known.items())[-32:])))
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        log.warning("could not keep a load check's verdict in %s: %s", path, exc)


def probe_batch_invariance(model, config: WorkerConfig) -> dict[str, bool]:
    """``model.batch_invariance()``, kept in ``config.probe_cache`` (a few seconds
    for a 1.5B model on 2 cores, so not at every start). A missing, corrupt or
    foreign file only means probing again."""
    path = Path(config.probe_cache) if config.probe_cache else None
    key = probe_key(model, config)
    cached = _read_kept(path).get(key)
    if isinstance(cached, dict) and set(cached) == PROBE_PATHS and all(isinstance(v, bool) for v in cached.values()):
        return cached
    paths = model.batch_invariance()
    if paths:
        _keep(path, key, paths)
    return paths


def _kept_verdict(path: Optional[Path], key: str) -> Optional[bool]:
    """A load check's kept verdict (``{"exact": bool}``) under ``key``; None where there is none."""
    found = _read_kept(path).get(key)
    ok = isinstance(found, dict) and set(found) == {"exact"} and isinstance(found["exact"], bool)
    return found["exact"] if ok else None


def kept_check(model, config: Optional[WorkerConfig], name: str, check: Callable[[], Optional[bool]]) -> Optional[bool]:
    """A load check's verdict (``check()``: True, False, or None when it could not
    run), kept beside the probe's under the probe's key and ``name`` (which says
    what else it depends on), so that a restart does not read its prompts again
    (several hundred tokens: seconds for a 1.5B model on 2 cores). None is never kept."""
    path = Path(config.probe_cache) if config is not None and config.probe_cache else None
    key = f"{probe_key(model, config)} {name}" if path is not None else ""
    cached = _kept_verdict(path, key)
    if cached is not None:
        return cached
    verdict = check()
    if verdict is not None:
        _keep(path, key, {"exact": bool(verdict)})
    return verdict


def machine_verdicts() -> Path:
    """Where verdicts that are timings are kept for every daemon of this user on this machine."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tandem" / "machine-verdicts.json"


def machine_kept_check(
    model, config: Optional[WorkerConfig], name: str, check: Callable[[], Optional[bool]]
) -> Optional[bool]:
    """``kept_check`` for a verdict that is a timing (the prompt reader's: is it faster here?), where a
    verdict decides which kernels compute a prompt's KV, so which bits: kept for every daemon of this user on
    this machine, not per state directory, and the first verdict taken stands (a daemon that measured at the
    same time as another takes the other's if it was kept first). So two daemons of the same settings on one
    machine decide alike, whatever their state directories hold. Only for a daemon that keeps verdicts (a
    state directory); None (could not run) is never kept."""
    if config is None or not config.probe_cache:
        return check()
    path = machine_verdicts()
    key = f"{probe_key(model, config)} {name}"
    found = _kept_verdict(path, key)
    if found is not None:
        return found
    verdict = check()
    if verdict is None:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            found = _kept_verdict(path, key)
            if found is not None:  # another daemon decided first
                return found
            _keep(path, key, {"exact": bool(verdict)})
    except OSError as exc:
        log.warning("could not keep a load check's verdict in %s: %s", path, exc)
    return verdict


def invariance_fix(config: WorkerConfig, model) -> str:
    """What to change so that the probe passes, as far as it is known."""
    if config.settings.kernels == "fast":
        return "Use --kernels mixed (the default) or reference."
    if not config.settings.flash_attn:
        return "Use --flash-attn on (the default)."
    if model.extra_buffers:
        return "Try --extra-buffers off (weight repacking uses other kernels for one row than for several)."
    return (
        "No setting is known to fix it for this model file (F16 weights use llamafile's tinyBLAS, whose "
        "rows differ from its one-row kernel); Q4_K and Q4_1 models were measured batch-invariant."
    )
