"""``tandem serve``: resolve the model, start the daemon, run until stopped."""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys
from pathlib import Path
from typing import Callable, Optional

from tandem.protocol import default_socket_path

from . import config, kernels, models
from .cache.arena import cache_budget
from .config import ServeError
from .front import sdnotify
from .front.server import Daemon, ServeConfig
from .models.context_size import ContextError, choose_context
from .models.drafter_auto import pick_drafter
from .models.gguf_meta import GGUFError
from .worker.worker_config import drafter_extra_buffers

log = logging.getLogger("tandem.daemon")


def serve(
    settings: config.Settings,
    reload: Optional[Callable[[], config.Settings]] = None,
    progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> int:
    """Run the daemon in this process until it is stopped. Returns an exit code.
    ``reload`` re-reads the settings on SIGHUP (see Daemon.reload)."""
    s, v = settings, settings.values
    logging.basicConfig(level=v.log_level.upper(), format="tandem %(levelname)s %(message)s", stream=sys.stderr)
    notifier = sdnotify.Notifier.from_environment()
    # until the main loop takes over: a SIGHUP (a reload, a closed terminal) must not kill a starting daemon
    signal.signal(
        signal.SIGHUP, lambda signum, frame: log.info("SIGHUP while starting: ignored; send it again once ready")
    )
    try:
        if s.file_found:
            log.info("settings from %s", s.path)

        def say(line: str) -> None:
            progress(line)
            notifier.extend_timeout(120)  # a model download: tell systemd we are still starting

        # (on: built here, before a worker loads llama.cpp; auto where that failed: said why)
        if kernels.check(v.kernel_patch, say) is None and v.kernel_patch != "off":
            # decided for this daemon's life: a worker restarted after a later `tandem kernels build`
            # must compute what the others did
            s = dataclasses.replace(s, values=dataclasses.replace(v, kernel_patch="off"))
            v = s.values
            if reload is not None:  # (nor is a SIGHUP to say that kernel_patch changed and needs a restart)
                reload = _kernels_off(reload)
        name, path = _resolve(v.model, say)
        _check_template_file(v.chat_template_file)
        drafter_name, drafter_path, drafter_why = pick_drafter(
            v.drafter, v.model, name, path, lambda drafter: _resolve(drafter, say)
        )
        if drafter_path is not None:
            repacked = drafter_extra_buffers(v, patched=v.kernel_patch != "off")  # (off where the build failed)
            loaded, copy = models.drafter_file(drafter_path, v.drafter_quantize, say, repacked)
            if copy:
                drafter_name, drafter_path = f"{drafter_name} as {copy} ({loaded})", loaded
        embedding_name, embedding_path = "", None
        if v.embedding_model != "none":  # resolved (and pulled) as the target is
            embedding_name, embedding_path = _resolve(v.embedding_model, say)
        context = choose_context(v.ctx_size, path, drafter_path, v.kv_type, v.kv_budget)
        log.info("context: %s", context.note)
        daemon = Daemon(
            ServeConfig(
                settings=s,
                model_name=name,
                model_path=path,
                socket_path=v.socket or default_socket_path(),
                state_dir=v.state_dir or config.default_state_dir(),
                cache_bytes=cache_budget(v.cache_bytes),
                drafter_name=drafter_name,
                drafter_path=drafter_path,
                drafter_why=drafter_why,
                n_ctx=context.n_ctx,
                context_note=context.note,
                kv_room=context.room,
                embedding_name=embedding_name,
                embedding_path=embedding_path,
            ),
            notifier=notifier,
            reload=reload,
        )
    except (ServeError, models.ModelError, ContextError, GGUFError, kernels.KernelBuildError) as exc:
        print(f"tandem serve: {exc}", file=sys.stderr)
        return 1
    daemon.serve_forever()
    if daemon.state == "failed":
        print(f"tandem serve: {daemon.failure}", file=sys.stderr)
        return 1
    return 0


def _kernels_off(reload: Callable[[], config.Settings]) -> Callable[[], config.Settings]:
    """``reload`` for a daemon whose --kernel-patch auto was decided off at its start."""

    def reloaded() -> config.Settings:
        new = reload()
        if new.values.kernel_patch != "auto":
            return new
        return dataclasses.replace(new, values=dataclasses.replace(new.values, kernel_patch="off"))

    return reloaded


def _check_template_file(path: Optional[Path]) -> None:
    """--chat-template-file: a readable UTF-8 file, or a clear error before anything loads."""
    if path is None:
        return
    try:
        path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ServeError(
            f"--chat-template-file {path}: cannot read it ({exc}); give a readable UTF-8 Jinja file, or leave "
            "the option out to use the GGUF file's template"
        ) from None


def _resolve(model: str, progress: Callable[[str], None]) -> tuple[str, Path]:
    if models.needs_pull(model):
        progress(f"tandem: model '{model}' is not downloaded yet; pulling it")
        models.pull_any(model, progress)
    return models.resolve(model)
