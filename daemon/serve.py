"""``tandem serve``: resolve the model, start the daemon, run until stopped."""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from typing import Callable, Optional

from tandem.protocol import default_socket_path

from . import config, models, sdnotify
from .server import Daemon, ServeConfig, ServeError, cache_budget

log = logging.getLogger("tandem.daemon")


def serve(
    settings: config.Settings,
    reload: Optional[Callable[[], config.Settings]] = None,
    progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> int:
    """Run the daemon in this process until it is stopped. Returns an exit code.
    ``reload`` re-reads the settings on SIGHUP (see Daemon.reload)."""
    s = settings
    logging.basicConfig(level=s.log_level.upper(), format="tandem %(levelname)s %(message)s", stream=sys.stderr)
    notifier = sdnotify.Notifier.from_environment()
    # until the main loop takes over: a SIGHUP (a reload, a closed terminal) must not kill a starting daemon
    signal.signal(signal.SIGHUP, lambda signum, frame: log.info("SIGHUP while starting: ignored; send it again once ready"))
    try:
        if s.file_found:
            log.info("settings from %s", s.path)

        def say(line: str) -> None:
            progress(line)
            notifier.extend_timeout(120)  # a model download: tell systemd we are still starting

        name, path = _resolve(s.model, say)
        drafter_name, drafter_path = s.drafter, None
        if s.drafter not in ("none", "ngram"):
            drafter_name, drafter_path = _resolve(s.drafter, say)
        daemon = Daemon(
            ServeConfig(
                model_name=name,
                model_path=path,
                socket_path=s.socket or default_socket_path(),
                ctx_size=s.ctx_size,
                threads=s.threads,
                batch_size=s.batch_size,
                max_queue=s.max_queue,
                extra_buffers={"auto": None, "on": True, "off": False}[s.extra_buffers],
                flash_attn=s.flash_attn,
                kernels=s.kernels,
                drafter=drafter_name,
                drafter_path=drafter_path,
                draft_tokens=s.draft_tokens,
                draft_p_min=s.draft_p_min,
                exact=s.exact,
                governor=s.governor,
                governor_per_task=s.governor_per_task,
                state_dir=s.state_dir or config.default_state_dir(),
                cache_bytes=cache_budget(s.cache_bytes),
                page_tokens=s.page_tokens,
                metrics_addr=s.metrics_addr,
                metrics_addr_explicit=s.sources["metrics_addr"] != "default",
                worker_timeout=s.worker_timeout,
                client_queue=s.client_queue,
                log_level=s.log_level,
            ),
            notifier=notifier,
            reload=reload,
            settings=s,
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
