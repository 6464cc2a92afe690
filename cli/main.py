"""The ``tandem`` command line: the parser (each command group adds its own commands)
and the dispatch from a command to its ``cmd_*`` function."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional

from tandem.client import QueueFull, RequestFailed, TandemError
from tandem.daemon import config
from tandem.protocol import default_socket_path

from . import ask, cache, config_cmd, kernels, launch, models, service, serving, status
from .common import say

DESCRIPTION = """\
tandem: a private, local LLM daemon. Models run in worker processes behind a
Unix socket; nothing leaves this machine.

  tandem run "Explain this error: ..."    ask once (starts a daemon if none runs)
  tandem chat                             talk, multi-turn
  tandem serve --model qwen2.5-coder-1.5b run the daemon in the foreground
  tandem status | tandem stop             inspect / stop the daemon
  tandem http                             OpenAI, Ollama and Anthropic APIs on 127.0.0.1 for editors
  tandem launch claude|codex|qwen|opencode run a coding agent on the local model
  tandem pull NAME | list | show NAME     fetch (resumable, sha256-checked) / list / describe models
  tandem tokens "TEXT"                    count tokens as the served model reads them
  tandem config show                      the effective settings and their sources
  tandem service install                  run the daemon as a systemd user service
"""

# the order of `tandem --help`'s list of commands
ADD_COMMANDS = (
    serving.add_serve,
    ask.add_run,
    ask.add_chat,
    serving.add_http,
    launch.add_launch,
    status.add_status,
    serving.add_stop,
    ask.add_tokens,
    serving.add_key,
    cache.add_cache,
    kernels.add_kernels,
    config_cmd.add_config,
    service.add_service,
    models.add_models,  # list, pull, show, rm, models
)

COMMANDS = {
    "serve": serving.cmd_serve,
    "run": ask.cmd_run,
    "chat": ask.cmd_chat,
    "status": status.cmd_status,
    "http": serving.cmd_http,
    "openai": serving.cmd_http,
    "launch": launch.cmd_launch,
    "tokens": ask.cmd_tokens,
    "stop": serving.cmd_stop,
    "key": serving.cmd_key,
    "models": models.cmd_models,
    "list": models.cmd_list,
    "pull": models.cmd_pull,
    "show": models.cmd_show,
    "rm": models.cmd_rm,
    "cache": cache.cmd_cache,
    "kernels": kernels.cmd_kernels,
    "config": config_cmd.cmd_config,
    "service": service.cmd_service,
}

CLIENT_ONLY = ("status", "stop", "cache", "kernels")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--socket",
        default=None,
        help=f"daemon socket (default: $TANDEM_SOCKET, else the config file's socket, else {default_socket_path()})",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="PATH",
        help=f"config file (default: $TANDEM_CONFIG, else {config.default_config_path()}; it need not exist)",
    )
    from tandem.daemon.version import __version__

    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in ADD_COMMANDS:
        add(sub)
    seen: set[int] = set()
    for command in sub.choices.values():  # also after the command: `tandem status --socket X`
        if id(command) in seen:
            continue  # (an alias: the same parser)
        seen.add(id(command))
        command.add_argument("--socket", default=argparse.SUPPRESS, help="daemon socket (as before the command)")
        command.add_argument(
            "--config", type=Path, default=argparse.SUPPRESS, metavar="PATH", help="config file (as before the command)"
        )
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    args.flags = _flags(args)  # as given, for a reload on SIGHUP
    try:
        args.settings = config.load(args.flags, args.config)
    except config.ConfigError as exc:
        if args.command not in CLIENT_ONLY:
            say(f"tandem: {exc}")
            return 2
        # status, stop, cache: only the socket matters; a broken file must not stop you stopping the daemon
        say(f"tandem: warning: {exc}")
        args.settings = config.Settings(
            config.SettingsValues(socket=Path(args.socket) if args.socket else None), {}, Path(), False
        )
    args.socket = args.settings.values.socket or default_socket_path()
    args.model_given = vars(args).get("model")  # --model as given (None: not given)
    if "model" not in vars(args) or args.model is None:
        args.model = args.settings.values.model
    as_json = bool(vars(args).get("json"))
    try:
        return COMMANDS[args.command](args)
    except QueueFull as exc:
        return _fail(as_json, f"the daemon is busy: {exc}", 3, "busy")
    except RequestFailed as exc:
        return _fail(as_json, f"{exc.name}: {exc.message}", 1, exc.name)
    except TandemError as exc:
        return _fail(as_json, str(exc), 1, type(exc).__name__)
    except BrokenPipeError:  # `tandem status | head -2`: the reader left; so do we, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _flags(args) -> dict:
    """The settings given as flags (those not given are absent from ``args``)."""
    return {k: v for k, v in vars(args).items() if k in config.BY_KEY and v is not None}


def _fail(as_json: bool, message: str, code: int, kind: str) -> int:
    """An error: on stderr, and with --json also as JSON on stdout (a script reads one object either way)."""
    say(f"tandem: {message}")
    if as_json:
        print(json.dumps({"error": {"type": kind, "message": message}}))
    return code


if __name__ == "__main__":
    sys.exit(main())
