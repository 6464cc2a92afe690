"""The commands that run a server: ``tandem serve`` and ``tandem stop`` (the daemon),
``tandem http`` (the HTTP bridge, alias ``openai``) and ``tandem key`` (the bridge's API key)."""

from __future__ import annotations

import os
import time

from tandem.client import Client, TandemError
from tandem.daemon import config

from .common import autostart_args, connect, positive, sampling_args, sampling_defaults, say, serve_options


def add_serve(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="run the daemon in the foreground",
        description="Run the daemon in the foreground. Every option is also an environment variable "
        "(TANDEM_<OPTION>) and a key of the config file; a flag beats the environment, which beats the file, "
        "which beats the default. `tandem config show` prints the effective settings and where each came from.",
    )
    serve_options(p)


def add_stop(sub) -> None:
    sub.add_parser("stop", help="shut the daemon down cleanly")


def add_http(sub) -> None:
    from tandem.bridge.server import DEFAULT_IDLE_TIMEOUT, DEFAULT_MAX_CONNECTIONS

    p = sub.add_parser(
        "http",
        aliases=["openai"],
        help="serve the OpenAI, Ollama and Anthropic HTTP APIs on loopback, for editor plugins and agents",
        description="Translate three HTTP dialects to the daemon on one loopback port: OpenAI's (/v1/models, "
        "/v1/completions, /v1/chat/completions), Ollama's (/api/tags, /api/show, /api/generate, /api/chat, ...) "
        "and Anthropic's (/v1/messages, /v1/messages/count_tokens), plus llama-server's /tokenize and "
        "/detokenize. OpenAI: GET /v1/models, POST /v1/completions "
        "(with 'suffix': fill in the middle, for inline completion), POST /v1/chat/completions, and "
        "'stream': true as server-sent events. Loopback only; every HTTP request is one daemon request, "
        "cancelled if the HTTP client disconnects. Starts a daemon if none runs. Ctrl-C stops the bridge "
        "(not the daemon).",
    )
    p.add_argument(
        "--listen",
        default=None,
        metavar="HOST:PORT",
        help="loopback address to listen on; port 0 picks a free one "
        "(default $TANDEM_OPENAI_LISTEN, else 127.0.0.1:8642)",
    )
    autostart_args(p)
    sampling_args(p)
    p.add_argument("--verbose", action="store_true", help="log every HTTP request to stderr")
    p.add_argument(
        "--idle-timeout",
        type=positive(float),
        default=DEFAULT_IDLE_TIMEOUT,
        metavar="SECONDS",
        help="close a connection that sends nothing, or stalls reading or writing, this long "
        f"(default {DEFAULT_IDLE_TIMEOUT:g}); a request waiting on the model is not idle",
    )
    p.add_argument(
        "--max-connections",
        type=positive(int),
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help=f"connections served at once; one more gets 503 (default {DEFAULT_MAX_CONNECTIONS})",
    )
    p.add_argument(
        "--api-key",
        choices=("auto", "on", "off"),
        default="auto",
        help="require the key that `tandem key` prints (Authorization: Bearer KEY, or x-api-key): on = always; "
        "auto (default) = only where the same-user check on the port cannot run (no /proc/net/tcp); off = never",
    )


def add_key(sub) -> None:
    p = sub.add_parser(
        "key",
        help="print the API key `tandem http --api-key on` requires (created on first use)",
        description="Print the bridge's API key, creating it (a 0600 file in $XDG_STATE_HOME/tandem/api-key) "
        "if there is none. Give it to an HTTP client as its API key (sent as Authorization: Bearer KEY). "
        "The bridge requires it with --api-key on, or by itself where it cannot check who connects.",
    )
    p.add_argument("--new", action="store_true", help="replace the key with a new one (a running bridge keeps the old)")
    p.add_argument("--path", action="store_true", help="print where the key is kept instead of the key")


def cmd_serve(args) -> int:
    from tandem.daemon.serve import serve

    from .autostart import daemon_answers

    if daemon_answers(args.socket):  # before a model is pulled for nothing
        try:
            with Client(args.socket) as client:
                st = client.status()
            who = f" (pid {st.pid}, {st.model.name if st.model else 'loading'})"
        except TandemError:
            who = ""
        say(
            f"tandem serve: another tandem daemon{who} is already serving {args.socket}; stop it first "
            "(`tandem stop`), or give this one another socket (--socket PATH)"
        )
        return 1

    return serve(args.settings, reload=lambda: config.load(args.flags, args.config))


def cmd_stop(args) -> int:
    from .autostart import daemon_answers

    socket = args.socket
    if not daemon_answers(socket):
        say(f"tandem: no tandem daemon is running at {socket} (nothing to stop)")
        return 1
    with Client(socket) as client:
        pid = client.status().pid
        client.shutdown()
    deadline = time.monotonic() + 30
    while socket.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if socket.exists():
        say(f"the daemon (pid {pid}) was asked to stop but still holds {socket}")
        return 1
    say(f"stopped the daemon (pid {pid})")
    return 0


def cmd_http(args) -> int:
    from tandem.bridge import server as bridge

    listen = args.listen or os.environ.get("TANDEM_OPENAI_LISTEN") or bridge.DEFAULT_LISTEN
    try:
        address = bridge.parse_listen(listen)  # before a daemon is started for nothing
    except ValueError as exc:
        say(f"tandem: {exc}")
        return 2
    from tandem.bridge.api_key import KeyFileError, key_path, required_key

    try:
        api_key = required_key(args.api_key, key_path())
    except (KeyFileError, OSError) as exc:
        say(f"tandem: {exc}")
        return 2
    with connect(args.socket, args.model, args.no_start, args.config) as client:
        model = client.server.model
    try:
        server = bridge.BridgeServer(
            address,
            args.socket,
            model,
            verbose=args.verbose,
            idle_timeout=args.idle_timeout,
            max_connections=args.max_connections,
            api_key=api_key,
            sampling=sampling_defaults(args),
        )
    except OSError as exc:
        say(
            f"tandem: cannot listen on {listen}: {exc.strerror or exc}. "
            "Pick another port: --listen 127.0.0.1:PORT (0 = any free one)"
        )
        return 2

    url = bridge.url_of(server)
    say(
        f"tandem http: {url} serves {model} from {args.socket}; base URLs: OpenAI {url}, Anthropic and Ollama "
        f"{url.removesuffix('/v1')} (Ctrl-C stops the bridge)"
    )
    if api_key is not None:
        why = "--api-key on" if args.api_key == "on" else "this system has no /proc/net/tcp to check who connects"
        say(f"tandem http: every request needs the API key that `tandem key` prints ({why})")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def cmd_key(args) -> int:
    from tandem.bridge.api_key import KeyFileError, ensure_key, key_path

    path = key_path()
    if args.path:
        print(path)
        return 0
    try:
        print(ensure_key(path, new=args.new))
    except (KeyFileError, OSError) as exc:
        say(f"tandem: {exc}")
        return 1
    return 0
