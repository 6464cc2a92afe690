"""What the command groups share: the daemon's options as flags, the flags of the
commands that start a daemon, connecting (starting one if need be), and output helpers."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from tandem.client import Client, DaemonNotRunning
from tandem.daemon import config


def say(line: str) -> None:
    """A line for the person at the terminal: on stderr, so stdout stays the command's output."""
    print(line, file=sys.stderr, flush=True)


def mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def positive(kind):
    """An argparse type: ``kind`` (int, float) above zero."""

    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error
    return parse


def sampling_args(p: argparse.ArgumentParser) -> None:
    """For the commands that serve the HTTP bridge: sampling for the requests that do not set their own (as
    llama-server's --temp, --top-k and --top-p; Claude Code sends no temperature, so Anthropic's default of 1
    holds there without --temperature)."""
    p.add_argument(
        "--temperature",
        type=bounded(float, 0.0, 100.0),
        metavar="T",
        help="temperature of a request that sets none (0 = greedy; default: the dialect's own: 1 for OpenAI chat "
        "and Anthropic, 0.8 for Ollama, else the daemon's 0.8)",
    )
    p.add_argument(
        "--top-k", type=bounded(int, 0, None), metavar="K", help="top-k of a request that sets none (0 = off)"
    )
    p.add_argument(
        "--top-p",
        type=bounded(float, 0.0, 1.0, low_included=False),
        metavar="P",
        help="top-p of a request that sets none (0 < P <= 1)",
    )


def sampling_defaults(args: argparse.Namespace) -> dict:
    """The sampling ``sampling_args`` gave, by field name (those not given: left out)."""
    given = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
    return {k: v for k, v in given.items() if v is not None}


def bounded(kind, low, high, low_included: bool = True):
    """An argparse type: ``kind`` (int, float) from ``low`` (or above it) to ``high`` (None: no bound)."""

    def parse(text: str):
        value = kind(text)
        above = low <= value if low_included else low < value
        if not (above and (high is None or value <= high)):  # (NaN is neither)
            lower = f"{low} or more" if low_included else f"more than {low}"
            upper = f" and {high} at most" if high is not None else ""
            raise argparse.ArgumentTypeError(f"must be {lower}{upper}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def serve_options(p: argparse.ArgumentParser, skip: tuple[str, ...] = ("socket",)) -> None:
    """One flag per option of the settings schema (tandem.daemon.config); a flag
    not given is left out, so the environment and the config file can supply it."""
    for o in config.OPTIONS:
        if o.key in skip:
            continue
        kw: dict = dict(dest=o.key, default=argparse.SUPPRESS)
        if o.kind == "bool":
            kw["choices"] = ["on", "off"]
        elif o.kind == "choice":
            kw["choices"] = list(o.choices)
        else:
            kw["metavar"] = o.metavar or o.key.upper()
        default = config.show_value(o, o.default)
        extra = "; SIGHUP reloads it" if o.reload else ""
        p.add_argument(o.flag, help=f"{o.help} (default {default}; env {o.env}{extra})", **kw)


def autostart_args(p: argparse.ArgumentParser) -> None:
    """For commands that start a daemon when none runs."""
    p.add_argument(
        "--model",
        default=argparse.SUPPRESS,
        help="model for a daemon started by this command (default: the configured model)",
    )
    p.add_argument("--no-start", action="store_true", help="fail instead of starting a daemon when none runs")


def connect(socket: Path, model: str, no_start: bool, config_file: Optional[Path] = None) -> Client:
    """A connected client of the daemon at ``socket``; one is started on ``model`` if none answers."""
    from .autostart import daemon_answers, start_daemon

    if not daemon_answers(socket):
        if no_start:
            raise DaemonNotRunning(f"no tandem daemon is running at {socket}; start one with `tandem serve`")
        start_daemon(socket, model, say=say, config_file=config_file)
    client = Client(socket)
    client.connect()
    return client
