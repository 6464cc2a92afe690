"""The ``tandem`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from tandem.daemon import config
from tandem.protocol import FinishReason, Generate, default_socket_path

from .client import Client
from .errors import DaemonNotRunning, QueueFull, RequestFailed, TandemError

DESCRIPTION = """\
tandem: a private, local LLM daemon. Models run in worker processes behind a
Unix socket; nothing leaves this machine.

  tandem run "Explain this error: ..."    ask once (starts a daemon if none runs)
  tandem chat                             talk, multi-turn
  tandem serve --model qwen2.5-coder-1.5b run the daemon in the foreground
  tandem status | tandem stop             inspect / stop the daemon
  tandem http                             OpenAI, Ollama and Anthropic APIs on 127.0.0.1 for editors
  tandem pull NAME | list | show NAME     fetch (resumable, sha256-checked) / list / describe models
  tandem tokens "TEXT"                    count tokens as the served model reads them
  tandem config show                      the effective settings and their sources
  tandem service install                  run the daemon as a systemd user service
"""


def _sampling_args(p: argparse.ArgumentParser) -> None:
    d = Generate(id="x", prompt="")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="most tokens to generate (default %(default)s)")
    p.add_argument(
        "--temperature", type=float, default=d.temperature, help="0 = greedy, deterministic (default %(default)s)"
    )
    p.add_argument(
        "--top-k", type=int, default=d.top_k, help="sample from the k likeliest tokens; 0 = off (default %(default)s)"
    )
    p.add_argument("--top-p", type=float, default=d.top_p, help="nucleus sampling mass; 1 = off (default %(default)s)")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling (default: random)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop before TEXT (repeatable)")
    p.add_argument("--system", default=None, metavar="TEXT", help="a system message before the prompt")
    p.add_argument(
        "--draft",
        choices=["auto", "on", "off"],
        default="auto",
        help="speculative drafting, if the daemon has a drafter: auto = the governor drafts while it is faster "
        "than plain decoding; on = every round; off = never (default %(default)s)",
    )


def _constraint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json-schema", type=Path, metavar="FILE", help="the answer is JSON matching this JSON Schema file")
    g.add_argument("--json-object", action="store_true", help="the answer is one JSON object")
    g.add_argument("--grammar", type=Path, metavar="FILE", help="the answer follows this Lark grammar file")
    g.add_argument("--regex", metavar="PATTERN", help="the answer matches this regular expression")


def _response_format(args) -> Optional[dict]:
    """The run command's constraint flags as a response_format (None: any text)."""
    try:
        if args.json_schema is not None:
            schema = json.loads(args.json_schema.read_text())
            return {"type": "json_schema", "json_schema": {"name": args.json_schema.stem, "schema": schema}}
        if args.grammar is not None:
            return {"type": "grammar", "lark": args.grammar.read_text()}
    except OSError as exc:
        raise TandemError(f"cannot read {exc.filename}: {exc.strerror}") from None
    except ValueError as exc:
        raise TandemError(f"{args.json_schema} is not JSON: {exc}") from None
    if args.regex is not None:
        return {"type": "regex", "pattern": args.regex}
    if args.json_object:
        return {"type": "json_object"}
    return None


def _serve_options(p: argparse.ArgumentParser, skip: tuple[str, ...] = ("socket",)) -> None:
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
    _serving_commands(sub)
    _admin_commands(sub)
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


def _serving_commands(sub) -> None:
    """serve, and the commands that ask the model: run, chat, openai."""

    p = sub.add_parser(
        "serve",
        help="run the daemon in the foreground",
        description="Run the daemon in the foreground. Every option is also an environment variable "
        "(TANDEM_<OPTION>) and a key of the config file; a flag beats the environment, which beats the file, "
        "which beats the default. `tandem config show` prints the effective settings and where each came from.",
    )
    _serve_options(p)

    p = sub.add_parser(
        "run",
        help="stream one answer to the terminal",
        description="Send PROMPT as a user chat message and stream the answer. "
        "Starts a daemon in the background (pulling the default model) if none is running.",
    )
    p.add_argument("prompt", help="the prompt; - reads it from stdin")
    p.add_argument("--raw", action="store_true", help="send PROMPT as plain completion text (no chat template)")
    p.add_argument("--json", action="store_true", help="print one JSON object with the result instead of streaming")
    _autostart_args(p)
    _constraint_args(p)
    _sampling_args(p)

    p = sub.add_parser(
        "chat",
        help="interactive multi-turn chat",
        description="Chat in the terminal. /reset forgets, /exit (or Ctrl-D) leaves.",
    )
    _autostart_args(p)
    _sampling_args(p)

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
    _autostart_args(p)
    p.add_argument("--verbose", action="store_true", help="log every HTTP request to stderr")
    p.add_argument(
        "--idle-timeout",
        type=_positive(float),
        default=DEFAULT_IDLE_TIMEOUT,
        metavar="SECONDS",
        help="close a connection that sends nothing, or stalls reading or writing, this long "
        f"(default {DEFAULT_IDLE_TIMEOUT:g}); a request waiting on the model is not idle",
    )
    p.add_argument(
        "--max-connections",
        type=_positive(int),
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


def _admin_commands(sub) -> None:
    """The commands that look after the daemon: status, stop, cache, config, service, models."""
    p = sub.add_parser("status", help="show the daemon's model, queue, uptime and memory")
    p.add_argument("--json", action="store_true", help="print the raw status as JSON")

    sub.add_parser("stop", help="shut the daemon down cleanly")

    p = sub.add_parser(
        "tokens",
        help="count the tokens of TEXT as the served model reads it (before you send it)",
        description="Tokenize TEXT with the served model's tokenizer: the count, and with --ids the ids. "
        "--chat counts TEXT as one user message through the chat template, as `tandem run` sends it. "
        "Answered at once, even while the daemon generates.",
    )
    p.add_argument("text", metavar="TEXT", help="the text ('-' reads stdin)")
    p.add_argument("--chat", action="store_true", help="as a chat message (with the template), not plain text")
    p.add_argument("--ids", action="store_true", help="print the token ids too")
    p.add_argument("--json", action="store_true", help="print {count, tokens, pieces} as JSON")

    p = sub.add_parser(
        "key",
        help="print the API key `tandem http --api-key on` requires (created on first use)",
        description="Print the bridge's API key, creating it (a 0600 file in $XDG_STATE_HOME/tandem/api-key) "
        "if there is none. Give it to an HTTP client as its API key (sent as Authorization: Bearer KEY). "
        "The bridge requires it with --api-key on, or by itself where it cannot check who connects.",
    )
    p.add_argument("--new", action="store_true", help="replace the key with a new one (a running bridge keeps the old)")
    p.add_argument("--path", action="store_true", help="print where the key is kept instead of the key")

    p = sub.add_parser("cache", help="the prefix cache: clear it", description="Manage the daemon's prefix cache.")
    csub = p.add_subparsers(dest="cache_command", metavar="ACTION")
    c = csub.add_parser(
        "clear",
        help="drop every cached page, in shared memory and on disk (after the running request, before the next "
        "queued one); with no daemon running, remove the disk tier's page files",
    )
    c.add_argument(
        "--memory-only", action="store_true", help="clear the shared memory only: the page files on disk stay"
    )

    p = sub.add_parser(
        "config",
        help="show the effective settings and where each came from",
        description="Settings come from flags, then TANDEM_<OPTION> environment variables, then the config file "
        f"({config.default_config_path()}, or --config / $TANDEM_CONFIG), then defaults.",
    )
    gsub = p.add_subparsers(dest="config_command", metavar="ACTION")
    pp = gsub.add_parser(
        "show",
        help="print every setting as the daemon would use it, with its source (the output is a valid config file)",
        description="Print the effective settings; give serve flags to see their effect.",
    )
    _serve_options(pp)

    p = sub.add_parser(
        "service",
        help="run the daemon as a systemd user service",
        description="Install, remove or inspect the systemd user service (~/.config/systemd/user/tandem.service, "
        "Type=notify with a watchdog, sandboxed to loopback). Its options come from the config file; "
        "`systemctl --user reload tandem` re-reads it.",
    )
    ssub = p.add_subparsers(dest="service_command", metavar="ACTION")
    pp = ssub.add_parser(
        "install", help="pull the configured models, write the unit, reload systemd, enable and start it"
    )
    pp.add_argument(
        "--no-start", action="store_true", help="write the unit and reload systemd, but do not enable or start it"
    )
    pp.add_argument(
        "--http",
        nargs="?",
        const="127.0.0.1:8642",
        default=None,
        metavar="HOST:PORT",
        help="also install the HTTP bridge as tandem-http.service (default address 127.0.0.1:8642), so editors "
        "find the OpenAI, Ollama and Anthropic APIs after login",
    )
    ssub.add_parser("uninstall", help="stop and disable the service (and the bridge's), remove the units")
    ssub.add_parser("status", help="whether the unit is installed, and systemctl's status of it")
    pu = ssub.add_parser("unit", help="print the unit this installation would write")
    pu.add_argument("--http", action="store_true", help="the bridge's unit (tandem-http.service)")

    sub.add_parser("list", help="the models in the store: name, size, quantization, where (as `ollama list`)")
    p = sub.add_parser("pull", help="download a preset model, checked against its pinned sha256")
    p.add_argument("name", help="preset name (see `tandem list`)")
    p = sub.add_parser("show", help="a model's architecture, size, quantization, context, template, FIM and tools")
    p.add_argument("name", help="a preset name or a .gguf path")
    p.add_argument("--template", action="store_true", help="print the whole chat template")
    p.add_argument("--json", action="store_true", help="print everything as JSON")
    p = sub.add_parser("rm", help="delete a pulled preset from the model store (never a file outside it)")
    p.add_argument("name", help="preset name")

    p = sub.add_parser("models", help="fetch and list models")
    msub = p.add_subparsers(dest="models_command", metavar="ACTION")
    pp = msub.add_parser("pull", help="download a preset model into the model store, verifying its sha256")
    pp.add_argument("name", help="preset name (see `tandem models list`)")
    msub.add_parser("list", help="list presets and downloaded models")


def _autostart_args(p: argparse.ArgumentParser) -> None:
    """For commands that start a daemon when none runs."""
    p.add_argument(
        "--model",
        default=argparse.SUPPRESS,
        help="model for a daemon started by this command (default: the configured model)",
    )
    p.add_argument("--no-start", action="store_true", help="fail instead of starting a daemon when none runs")


# --------------------------------------------------------------------------- helpers


def _flags(args) -> dict:
    """The settings given as flags (those not given are absent from ``args``)."""
    return {k: v for k, v in vars(args).items() if k in config.BY_KEY and v is not None}


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _connect(socket: Path, model: str, no_start: bool, config_file: Optional[Path] = None) -> Client:
    from .autostart import daemon_answers, start_daemon

    if not daemon_answers(socket):
        if no_start:
            raise DaemonNotRunning(f"no tandem daemon is running at {socket}; start one with `tandem serve`")
        start_daemon(socket, model, say=_say, config_file=config_file)
    client = Client(socket)
    client.connect()
    return client


def _check_model(client: Client, asked: Optional[str]) -> None:
    """A daemon that answers with another model than ``--model`` asked for: say so, never answer as if."""
    if not asked:
        return
    from tandem.daemon.models import PRESETS

    served = client.server.model
    names = {asked, Path(asked).name, PRESETS[asked].filename if asked in PRESETS else asked}
    if served not in names:
        client.close()
        raise TandemError(
            f"the daemon at {client.socket_path} serves {served}, not {asked} (one resident model): "
            f"stop it (`tandem stop`) and run again to start one on {asked}, or leave out --model"
        )


def _params(args) -> dict:
    return dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        draft=args.draft,
    )


def _stream_to_terminal(stream) -> None:
    try:
        for chunk in stream:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        stream.cancel()
        sys.stdout.write("\n")
        _say("[cancelled]")
        raise SystemExit(130) from None
    sys.stdout.write("\n")
    done = stream.done
    if done.finish_reason == FinishReason.LENGTH:
        _say(f"[cut off: the answer reached max tokens ({done.usage.completion_tokens}); raise --max-tokens]")
    if sys.stderr.isatty():
        t = done.timings
        _say(
            f"[{done.usage.completion_tokens} tokens, {t.tokens_per_second:.1f} tok/s, "
            f"first token {t.time_to_first_token_seconds:.2f} s, finish: {done.finish_reason.value}]"
        )


# --------------------------------------------------------------------------- commands


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
        _say(
            f"tandem serve: another tandem daemon{who} is already serving {args.socket}; stop it first "
            "(`tandem stop`), or give this one another socket (--socket PATH)"
        )
        return 1

    return serve(args.settings, reload=lambda: config.load(args.flags, args.config))


def cmd_run(args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    client = _connect(args.socket, args.model, args.no_start, args.config)
    _check_model(client, args.model_given)
    with client:
        if args.raw:
            request = dict(prompt=(args.system + "\n\n" if args.system else "") + prompt)
        else:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": prompt}
            ]
            request = dict(messages=messages)
        request["response_format"] = _response_format(args)
        if args.json:
            done = client.complete(**request, **_params(args))
            print(json.dumps(_done_json(done), indent=2))
            return 0
        _stream_to_terminal(client.generate(**request, **_params(args)))
    return 0


def _done_json(done) -> dict:
    d = asdict(done)
    d["finish_reason"] = done.finish_reason.value
    d.pop("id")
    return {"request_id": done.id, **d}


def cmd_chat(args) -> int:
    client = _connect(args.socket, args.model, args.no_start, args.config)
    _check_model(client, args.model_given)
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    _say(f"tandem chat with {client.server.model} (context {client.server.n_ctx} tokens). /reset, /exit.")
    with client:
        while True:
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):  # Ctrl-D or Ctrl-C at the prompt: leave quietly
                print()
                return 0
            if line.strip() in ("/exit", "/quit"):
                return 0
            if line.strip() in ("/help", "/?"):
                _say(
                    "/reset forgets the conversation, /exit (or Ctrl-D, or Ctrl-C at the prompt) leaves; "
                    "Ctrl-C while it answers stops the answer"
                )
                continue
            if line.startswith("/") and " " not in line.strip():
                _say(f"unknown command {line.strip()}; /help lists them (start a message with a space to send it)")
                continue
            if line.strip() == "/reset":
                history = history[:1] if args.system else []
                _say("[history cleared]")
                continue
            if not line.strip():
                continue
            history.append({"role": "user", "content": line})
            stream = client.generate(messages=history, **_params(args))
            try:
                _stream_to_terminal(stream)
            except SystemExit:
                history.pop()
                continue
            except RequestFailed as exc:
                history.pop()
                _say(f"error: {exc.message}")
                continue
            history.append({"role": "assistant", "content": stream.done.text})


def cmd_openai(args) -> int:
    from tandem.bridge import server as bridge

    listen = args.listen or os.environ.get("TANDEM_OPENAI_LISTEN") or bridge.DEFAULT_LISTEN
    try:
        address = bridge.parse_listen(listen)  # before a daemon is started for nothing
    except ValueError as exc:
        _say(f"tandem: {exc}")
        return 2
    from tandem.bridge.api_key import KeyFileError, key_path, required_key

    try:
        api_key = required_key(args.api_key, key_path())
    except (KeyFileError, OSError) as exc:
        _say(f"tandem: {exc}")
        return 2
    with _connect(args.socket, args.model, args.no_start, args.config) as client:
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
        )
    except OSError as exc:
        _say(
            f"tandem: cannot listen on {listen}: {exc.strerror or exc}. "
            "Pick another port: --listen 127.0.0.1:PORT (0 = any free one)"
        )
        return 2

    url = bridge.url_of(server)
    _say(
        f"tandem http: {url} serves {model} from {args.socket}; base URLs: OpenAI {url}, Anthropic and Ollama "
        f"{url.removesuffix('/v1')} (Ctrl-C stops the bridge)"
    )
    if api_key is not None:
        why = "--api-key on" if args.api_key == "on" else "this system has no /proc/net/tcp to check who connects"
        _say(f"tandem http: every request needs the API key that `tandem key` prints ({why})")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def _where(m) -> str:
    """Where a model's layers are: "31 of 31 on CPU", "25 on CUDA0 and 6 on CPU"."""
    if not m.layers:
        return "unknown"
    parts = sorted(m.layers.items(), key=lambda kv: (-kv[1], kv[0]))
    if len(parts) == 1:
        return f"all {parts[0][1]} on {parts[0][0]}"
    return ", ".join(f"{n} on {dev}" for dev, n in parts) + f" (of {m.n_layers})"


def _placement_lines(target, drafter) -> list[str]:
    """The devices llama.cpp found in the target's worker and where each model's layers are."""
    devices = []
    for d in target.devices:
        memory = f", {d.memory_total / 2**30:.1f} GiB" if d.memory_total else ""
        devices.append(f"{d.name} ({d.description or d.kind}{memory})")
    lines = [f"devices:   {', '.join(devices)}"]
    if target.gpu_note:
        lines[0] += "; " + target.gpu_note
    layers = f"layers:    target {_where(target)}"
    if drafter is not None and drafter.layers:
        layers += f"; drafter {_where(drafter)}"
    lines.append(layers)
    return lines


def cmd_status(args) -> int:
    with Client(args.socket) as client:
        st = client.status()
    if args.json:
        print(json.dumps(asdict(st), indent=2))
        return 0
    up = st.uptime_seconds
    print(f"state:     {st.state}" + (f" ({st.failure})" if st.failure else ""))
    print(
        f"daemon:    tandem {st.daemon_version}, pid {st.pid}, "
        f"up {int(up // 3600)}h{int(up % 3600 // 60):02d}m{int(up % 60):02d}s"
    )
    print(f"socket:    {st.socket_path}")
    if st.model:
        m = st.model
        fim = "fill-in-the-middle" if m.fim else "no fill-in-the-middle tokens"
        print(
            f"model:     {m.name} ({_mib(m.size_bytes)}, context {m.n_ctx:,} of {m.n_ctx_train:,} trained, "
            f"vocab {m.n_vocab:,}, {fim})"
        )
    if st.model and st.model.devices:
        for line in _placement_lines(st.model, st.drafter_model):
            print(line)
    if st.model and st.model.batch_invariant is not None:
        m = st.model
        kernels = f"mixed kernels (prompts in {m.prefill_chunk}-token chunks)" if m.prefill_chunk else None
        settings = f"{kernels or (m.kernels or '?') + ' kernels'}, flash attention {'on' if m.flash_attn else 'off'}"
        if m.extra_buffers:
            settings += ", repacked weights"
        if m.prompt_reader:
            settings += " (prompts read over the weights not repacked)"
        differ = ", ".join(m.batch_variant_paths)
        if m.batch_invariant:
            print(f"exact:     yes, batch-invariant ({settings}): output does not depend on the cache or drafting")
        elif m.draft_off:
            print(
                f"exact:     yes, drafting and jump-forward off (logits differ on {differ}; {settings}): {m.draft_off}"
            )
        elif m.exact_steps:
            print(
                f"exact:     yes, with exact steps (logits differ on {differ}; {settings}): every step reads two "
                "positions, so output does not depend on the cache, drafting or the daemon's drafter"
            )
        else:
            print(f"exact:     no, logits differ on {differ} ({settings}); see the daemon log")
    if st.drafter != "none":
        line = f"drafter:   {st.drafter}, {st.draft_tokens} tokens per draft"
        if st.model and st.model.draft_off:
            line += ", not drafting: it would change greedy output here (--exact off drafts anyway)"
        elif st.model and st.model.exact_steps:
            line += ", exact steps" + ("" if st.model.batch_invariant else " (target is not batch-invariant)")
        if st.draft:
            d = st.draft
            line += (
                f"; {d.rounds:,} rounds, {d.accepted:,} of {d.drafted:,} drafts accepted "
                f"({d.acceptance_rate:.0%}), {d.tokens_per_round:.2f} tokens per round"
            )
        print(line)
    if st.governor and st.drafter in ("ngram", "suffix"):  # prompt lookup: gated per round, no probes
        g = st.governor
        by_match = ", ".join(f"{m}: {a:.2f}" for m, a in g.gate.items()) or "none measured yet"
        print(
            f"governor:  per round (free proposals: the predicted best number of drafts is verified, no probes); "
            f"{g.plain_rounds:,} plain and {g.draft_rounds:,} drafting rounds; acceptance by match length: "
            f"{by_match} (task {g.task}, {g.tasks} task(s) known)"
        )
    elif st.governor:
        g = st.governor
        rate = lambda r: f"{r:.1f}" if r is not None else "-"  # noqa: E731
        state = g.phase
        if g.phase == "plain":
            state += f", probe in {g.rounds_until_probe} rounds"
            if g.probe_debt_seconds > 0:
                state += f" and {g.probe_debt_seconds:.0f} s"
        print(
            f"governor:  {state}; plain {rate(g.plain_tokens_per_second)} tok/s, drafting "
            f"{rate(g.draft_tokens_per_second)} tok/s; {g.plain_rounds:,} plain and {g.draft_rounds:,} drafting "
            f"rounds, {g.failed_probes} of {g.probes} probes failed, interval {g.probe_interval} "
            f"(task {g.task}, {g.tasks} task(s) known)"
            + (
                f"; predicted from pass costs: acceptance {g.alpha:.2f}, {g.draft_length} per draft, "
                f"{g.predicted_speedup:.2f}x plain"
                if g.alpha is not None and g.draft_length is not None and g.predicted_speedup is not None
                else ""
            )
        )
    if st.cache:
        c = st.cache
        print(
            f"cache:     {c.pages:,} of {c.pages_total:,} pages of {c.page_tokens} tokens, "
            f"{_mib(c.bytes_used)} of {_mib(c.bytes_budget)}; "
            f"{c.hits:,} hits, {c.misses:,} misses; {c.tokens_from_cache:,} prompt tokens from cache, "
            f"{c.tokens_prefilled:,} prefilled"
            + (f", {c.drafter_tokens_from_cache:,} drafter tokens from cache" if c.drafter_tokens_from_cache else "")
            + f"; {c.evictions:,} evicted"
        )
        if c.disk is not None:
            d = c.disk
            print(
                f"disk:      {d.state}: {d.pages:,} pages, {_mib(d.bytes_used)} of {_mib(d.bytes_budget)} in {d.path}; "
                f"{d.hits:,} hits, {d.tokens_from_disk:,} prompt tokens from disk; {d.pages_written:,} pages written"
                + (f"; {d.dropped:,} damaged or foreign files ignored" if d.dropped else "")
            )
    if st.active:
        a = st.active
        print(f"active:    {a.id} ({a.completion_tokens} tokens, {a.elapsed_seconds:.1f} s)")
    else:
        print("active:    none")
    print(f"queue:     {st.queue_length} waiting (max {st.max_queue})")
    reqs = ", ".join(f"{k} {v}" for k, v in sorted(st.requests.items())) or "none yet"
    print(f"requests:  {reqs}")
    print(f"tokens:    {st.tokens.get('prompt', 0):,} prompt, {st.tokens.get('completion', 0):,} generated")

    def _mem(k: str, rss: int) -> str:
        # PSS where the daemon could read it: RSS counts a page twice where it is mapped
        # twice (the model file under a prompt reader), and counts the shared prefix-cache
        # arena in every process
        pss = st.memory_pss_bytes.get(k)
        notes = [f"RSS {_mib(rss)}"] if pss is not None else []
        if k in st.worker_pids:
            notes.append(f"pid {st.worker_pids[k]}")
        shown = f"{_mib(pss)} PSS" if pss is not None else f"{_mib(rss)} RSS"
        return f"{k} {shown}" + (f" ({', '.join(notes)})" if notes else "")

    print("memory:    " + ", ".join(_mem(k, v) for k, v in st.memory_rss_bytes.items()))
    print(f"restarts:  {st.worker_restarts}")
    print(f"metrics:   {'http://' + st.metrics_addr + '/metrics' if st.metrics_addr else 'off'}")
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
        _say(f"tandem: {exc}")
        return 1
    return 0


def cmd_tokens(args) -> int:
    text = sys.stdin.read() if args.text == "-" else args.text
    with Client(args.socket) as client:
        if args.chat:
            reply = client.tokenize(messages=[{"role": "user", "content": text}], with_pieces=args.json)
        else:
            reply = client.tokenize(text, parse_special=True, with_pieces=args.json)
    if args.json:
        print(json.dumps({"count": len(reply.tokens), "tokens": reply.tokens, "pieces": reply.pieces}))
        return 0
    print(len(reply.tokens))
    if args.ids:
        print(" ".join(map(str, reply.tokens)))
    return 0


def cmd_stop(args) -> int:
    from .autostart import daemon_answers

    socket = args.socket
    if not daemon_answers(socket):
        _say(f"tandem: no tandem daemon is running at {socket} (nothing to stop)")
        return 1
    with Client(socket) as client:
        pid = client.status().pid
        client.shutdown()
    deadline = time.monotonic() + 30
    while socket.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if socket.exists():
        _say(f"the daemon (pid {pid}) was asked to stop but still holds {socket}")
        return 1
    _say(f"stopped the daemon (pid {pid})")
    return 0


def cmd_cache(args) -> int:
    if args.cache_command != "clear":
        _say("usage: tandem cache clear [--memory-only]")
        return 2
    try:
        with Client(args.socket) as client:
            reply = client.cache_clear(memory_only=args.memory_only)
    except DaemonNotRunning:
        if args.memory_only:
            print("no daemon is running: shared memory holds no pages")
            return 0
        from tandem.daemon.cache.disk_cache import clear_dir, default_dir

        root = Path(args.settings.disk_cache_dir) if args.settings.disk_cache_dir else default_dir()
        pages, nbytes, held = clear_dir(root)
        print(f"no daemon is running; removed {pages:,} page files ({_mib(nbytes)}) from {root}")
        if held:
            _say(f"left {held} model(s)' pages that a running daemon holds (clear them through its socket)")
        return 0
    on_disk = f" and {reply.disk_pages:,} ({_mib(reply.disk_bytes)}) from disk" if not args.memory_only else ""
    if reply.cache is None:
        _say("this daemon has no prefix cache (it was started with --cache-bytes 0)")
        if reply.disk_pages:
            print(f"removed {reply.disk_pages:,} page files ({_mib(reply.disk_bytes)}) of earlier daemons from disk")
        return 0
    disk = reply.cache.disk
    print(
        f"cleared {reply.pages:,} pages ({_mib(reply.bytes)}) from shared memory"
        + on_disk
        + f"; the cache now holds {reply.cache.pages:,} pages"
        + (f" in memory, {disk.pages:,} on disk ({disk.path})" if disk is not None else "")
    )
    return 0


def cmd_config(args) -> int:
    if args.config_command != "show":
        _say("usage: tandem config show [serve flags]")
        return 2
    st = args.settings
    where = "found" if st.path.exists() else "not found; defaults apply"
    print(f"# tandem settings; config file: {st.path} ({where})")
    print("# precedence: flag > environment (TANDEM_<OPTION>) > config file > default")
    resolved = {"socket": args.socket, "state_dir": st.state_dir or config.default_state_dir()}
    for o in config.OPTIONS:
        value = st.values[o.key]
        text = config.toml_value(o, value)
        if value is None and o.key in resolved:
            text = config.toml_value(o, resolved[o.key])
        reload = ", reloads on SIGHUP" if o.reload else ""
        print(f"{o.key} = {text}".ljust(44) + f"  # {st.sources[o.key]}{reload}")
    return 0


def cmd_service(args) -> int:
    from . import service

    if args.service_command == "install":
        from .autostart import daemon_answers

        st = args.settings
        if not args.no_start and daemon_answers(args.socket) and not service.is_installed():
            raise TandemError(
                f"a daemon already serves {args.socket} outside systemd; the service cannot start while it runs. "
                "Stop it with `tandem stop`, then install again"
            )
        local = [f"{k} (from {src})" for k, src in st.sources.items() if src.startswith(("flag", "environment"))]
        if local or args.config is not None or os.environ.get("TANDEM_CONFIG"):
            _say(
                "note: the service reads only its config file, "
                f"{config.default_config_path()}; these settings of this shell will not reach it: "
                + ", ".join(
                    local + (["--config / TANDEM_CONFIG"] if args.config or os.environ.get("TANDEM_CONFIG") else [])
                )
            )
        if args.http is not None:
            from tandem.bridge.server import parse_listen

            try:
                parse_listen(args.http)
            except ValueError as exc:
                raise TandemError(str(exc)) from None
        _pull_configured(st)
        return service.install(_say, enable=not args.no_start, http=args.http)
    if args.service_command == "uninstall":
        return service.uninstall(_say)
    if args.service_command == "status":
        return service.status(_say)
    if args.service_command == "unit":
        print(service.render_http() if args.http else service.render(), end="")
        return 0
    _say("usage: tandem service {install [--no-start] | uninstall | status | unit}")
    return 2


def _pull_configured(settings) -> None:
    """The service may not reach the network: pull its models now."""
    from .autostart import ensure_pulled

    for name in (settings.model, settings.drafter):
        ensure_pulled(name, _say, f"tandem: pulling '{name}' first (the service is sandboxed to loopback and cannot)")


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def cmd_list(args) -> int:
    from tandem.daemon import models
    from tandem.daemon.models.gguf_meta import facts

    rows, missing = [], []
    for name, path, _ in models.list_models():
        if path is None:
            missing.append(name)
            continue
        f = facts(path)
        rows.append((name, _size(path.stat().st_size), f.get("parameter_size", ""), f.get("quantization", ""), path))
    w = max([len(r[0]) for r in rows] + [20])
    print(f"{'NAME':{w}} {'SIZE':>9}  {'PARAMS':6} {'QUANT':7} WHERE")
    for name, size, params, quant, path in rows:
        print(f"{name:{w}} {size:>9}  {params:6} {quant:7} {path}")
    if missing:
        print(f"not pulled (tandem pull NAME): {', '.join(missing)}")
    return 0


def cmd_show(args) -> int:
    from tandem.daemon import models
    from tandem.daemon.models.gguf_meta import facts

    try:
        name, path = models.resolve(args.name)
    except models.ModelError as exc:
        raise TandemError(str(exc)) from None
    f = facts(path)
    if not f:
        raise TandemError(f"{path} is not a GGUF file tandem can read")
    template = f["chat_template"]
    tools = (
        "tools (Hermes <tool_call>)"
        if "<tool_call>" in template
        else "tools (a generic prompt: no tool syntax in the template)"
    )
    preset = models.PRESETS.get(name)
    info = {
        "name": name,
        "path": str(path),
        "source": f"PyPI wheels {', '.join(sorted({p.package.rstrip('0123456789') for p in preset.parts}))} "
        f"(sha256 {preset.sha256[:16]}...)"
        if preset
        else "a local file",
        "architecture": f["architecture"],
        "parameters": f["parameter_size"],
        "quantization": f["quantization"],
        "context_length": f["context_length"],
        "fill_in_the_middle": f["fim"],
        "tools": tools,
        "chat_template": template,
        "size_bytes": path.stat().st_size,
    }
    info.update(_show_placement(args.socket, path))
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for key in ("name", "path", "source", "architecture", "parameters", "quantization", "context_length"):
        print(f"  {key.replace('_', ' '):16} {info[key]}")
    print(f"  {'size':16} {_size(info['size_bytes'])}")
    print(f"  {'fill in middle':16} {'yes' if f['fim'] else 'no'}")
    print(f"  {'tool calls':16} {tools}")
    print(f"  {'devices':16} {', '.join(d['name'] + ' (' + d['description'] + ')' for d in info['devices'])}")
    if info["gpu_note"]:
        print(f"  {'':16} {info['gpu_note']}")
    print(f"  {'layers':16} {info['layers']}")
    if args.template:
        print(template)
    else:
        first = template.strip().splitlines()[0][:90] if template else "(none: send plain prompts, tandem run --raw)"
        print(f"  {'chat template':16} {first}{' ...' if template else ''}  (--template prints it whole)")
    return 0


def _show_placement(socket, path: Path) -> dict:
    """For `tandem show`: the devices llama.cpp has, and where the model's layers
    are when the daemon serves it (its worker's view, RPC devices included);
    otherwise this process's devices, without loading the model."""
    from .autostart import daemon_answers

    if daemon_answers(socket):
        with Client(socket) as client:
            st = client.status()
        for m in (st.model, st.drafter_model):
            if m is not None and m.devices and Path(m.path).resolve() == path.resolve():
                return {
                    "devices": [asdict(d) for d in m.devices],
                    "gpu_note": m.gpu_note,
                    "layers": f"{_where(m)} (as the daemon at {socket} serves it)",
                }
    from tandem.daemon.models.devices import gpu_note, list_devices

    devices = list_devices()
    return {
        "devices": [asdict(d) for d in devices],
        "gpu_note": gpu_note(devices),
        "layers": "not loaded (the daemon does not serve it); llama.cpp places them at `tandem serve` "
        "(--gpu-layers, --device)",
    }


def cmd_rm(args) -> int:
    from tandem.daemon import models

    from .autostart import daemon_answers

    if args.name not in models.PRESETS:
        raise TandemError(
            f"'{args.name}' is not a preset in the store; tandem removes only what it pulled "
            f"({', '.join(models.PRESETS)})"
        )
    path = models.preset_path(args.name)
    if not path.is_file():
        raise TandemError(f"'{args.name}' is not pulled (nothing at {path})")
    if daemon_answers(args.socket):
        with Client(args.socket) as client:
            served = client.status().model
        if served is not None and Path(served.path) == path.resolve():
            raise TandemError(f"the daemon at {args.socket} serves {args.name}: stop it first (`tandem stop`)")
    size = path.stat().st_size
    path.unlink()
    _say(f"removed {args.name} ({_size(size)}, {path})")
    return 0


def cmd_pull(args) -> int:
    args.models_command = "pull"
    return cmd_models(args)


def _pull(name: str) -> int:
    """`tandem pull NAME`: one progress bar for the whole model (bytes, rate, ETA), resumable;
    a line per part instead when stderr is not a terminal."""
    from tqdm import tqdm

    from tandem.daemon import models

    if name not in models.PRESETS:
        return cmd_show_unknown(name)
    if models.is_pulled(name) or not sys.stderr.isatty():
        try:
            models.pull(name, progress=_say)
        except models.ModelError as exc:
            raise TandemError(str(exc)) from None
        return 0
    preset = models.PRESETS[name]
    with tqdm(total=preset.size_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=name, file=sys.stderr) as bar:
        try:
            models.pull(name, progress=lambda line: bar.write(line, file=sys.stderr), bar=bar.update)
        except models.ModelError as exc:
            raise TandemError(str(exc)) from None
    return 0


def cmd_show_unknown(name: str) -> int:
    from tandem.daemon import models

    raise TandemError(f"unknown preset '{name}'. Presets: {', '.join(models.PRESETS)}; or give a .gguf path to serve")


def cmd_models(args) -> int:
    from tandem.daemon import models

    if args.models_command == "pull":
        return _pull(args.name)
    if args.models_command == "list":
        print(f"model store: {models.models_dir()}")
        for name, path, description in models.list_models():
            where = str(path) if path else "(not pulled: tandem models pull " + name + ")"
            print(f"  {name:22} {description}\n  {'':22} {where}")
        return 0
    _say("usage: tandem models {pull NAME | list}")
    return 2


CLIENT_ONLY = ("status", "stop", "cache")

COMMANDS = {
    "serve": cmd_serve,
    "run": cmd_run,
    "chat": cmd_chat,
    "status": cmd_status,
    "http": cmd_openai,
    "openai": cmd_openai,
    "tokens": cmd_tokens,
    "stop": cmd_stop,
    "key": cmd_key,
    "models": cmd_models,
    "list": cmd_list,
    "pull": cmd_pull,
    "show": cmd_show,
    "rm": cmd_rm,
    "cache": cmd_cache,
    "config": cmd_config,
    "service": cmd_service,
}


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error
    return parse


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
            _say(f"tandem: {exc}")
            return 2
        # status, stop, cache: only the socket matters; a broken file must not stop you stopping the daemon
        _say(f"tandem: warning: {exc}")
        args.settings = config.Settings(
            {**{o.key: o.default for o in config.OPTIONS}, "socket": Path(args.socket) if args.socket else None},
            {},
            Path(),
            False,
        )
    args.socket = args.settings.socket or default_socket_path()
    args.model_given = vars(args).get("model")  # --model as given (None: not given)
    if "model" not in vars(args) or args.model is None:
        args.model = args.settings.model
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


def _fail(as_json: bool, message: str, code: int, kind: str) -> int:
    """An error: on stderr, and with --json also as JSON on stdout (a script reads one object either way)."""
    _say(f"tandem: {message}")
    if as_json:
        print(json.dumps({"error": {"type": kind, "message": message}}))
    return code


if __name__ == "__main__":
    sys.exit(main())
