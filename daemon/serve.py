"""``tandem serve``: resolve the model, start the daemon, run until stopped."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Callable, Optional

from . import models
from .server import Daemon, ServeConfig, ServeError, cache_budget


def serve(
    model: str,
    socket_path: Path,
    ctx_size: Optional[int] = None,
    threads: Optional[int] = None,
    batch_size: int = 512,
    max_queue: int = 16,
    extra_buffers: Optional[bool] = None,
    flash_attn: bool = False,
    drafter: str = "none",
    draft_tokens: int = 4,
    draft_p_min: float = 0.0,
    exact: str = "auto",
    governor: bool = True,
    governor_per_task: bool = True,
    state_dir: Optional[Path] = None,
    cache_bytes: Optional[int] = None,
    page_tokens: int = 16,
    progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> int:
    """Run the daemon in this process until it is stopped. Returns an exit code."""
    logging.basicConfig(level=logging.INFO, format="tandem %(levelname)s %(message)s", stream=sys.stderr)
    try:
        name, path = _resolve(model, progress)
        drafter_name, drafter_path = drafter, None
        if drafter not in ("none", "ngram"):
            drafter_name, drafter_path = _resolve(drafter, progress)
        if not 0 <= draft_tokens <= 16:
            raise ServeError(f"--draft-tokens must be between 0 and 16, got {draft_tokens}")
        if not 1 <= page_tokens <= 4096:
            raise ServeError(f"--page-tokens must be between 1 and 4096, got {page_tokens}")
        daemon = Daemon(
            ServeConfig(
                model_name=name,
                model_path=path,
                socket_path=socket_path,
                ctx_size=ctx_size,
                threads=threads,
                batch_size=batch_size,
                max_queue=max_queue,
                extra_buffers=extra_buffers,
                flash_attn=flash_attn,
                drafter=drafter_name,
                drafter_path=drafter_path,
                draft_tokens=draft_tokens,
                draft_p_min=draft_p_min,
                exact=exact,
                governor=governor,
                governor_per_task=governor_per_task,
                state_dir=state_dir,
                cache_bytes=cache_budget(cache_bytes),
                page_tokens=page_tokens,
            )
        )
    except (ServeError, models.ModelError) as exc:
        print(f"tandem serve: {exc}", file=sys.stderr)
        return 1
    daemon.serve_forever()
    if daemon.state == "failed":
        print(f"tandem serve: {daemon.failure}", file=sys.stderr)
        return 1
    return 0


def _resolve(model: str, progress: Callable[[str], None]) -> tuple[str, Path]:
    if model in models.PRESETS and not models.is_pulled(model):
        progress(f"tandem: model '{model}' is not downloaded yet; pulling it")
        models.pull(model, progress=progress)
    return models.resolve(model)
