"""The ``tandem`` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from tandem.protocol import Generate, default_socket_path

from .client import Client
from .errors import DaemonNotRunning, QueueFull, RequestFailed, TandemError

DEFAULT_MODEL = "smollm2-135m"  # mirrors tandem.daemon.models.DEFAULT_MODEL without importing llama.cpp

DESCRIPTION = """\
tandem: a private, local LLM daemon. Models run in worker processes behind a
Unix socket; nothing leaves this machine.

  tandem run "Explain this error: ..."    ask once (starts a daemon if none runs)
  tandem chat                             talk, multi-turn
  tandem serve --model qwen2.5-coder-1.5b run the daemon in the foreground
  tandem status | tandem stop             inspect / stop the daemon
  tandem models pull NAME | list          fetch / list models
"""


def _sampling_args(p: argparse.ArgumentParser) -> None:
    d = Generate(id="x", prompt="")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="most tokens to generate (default %(default)s)")
    p.add_argument(
        "--temperature", type=float, default=d.temperature, help="0 = greedy, deterministic (default %(default)s)"
    )
    p.add_argument("--top-k", type=int, default=d.top_k, help="sample from the k likeliest tokens; 0 = off (default %(default)s)")
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


def _byte_size(text: str) -> int:
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in "KMG" else ""
    try:
        value = float(t[: len(t) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: use bytes or a number with K, M or G (512M, 1G)")
    if value < 0:
        raise argparse.ArgumentTypeError("a size cannot be negative")
    return int(value * units[unit])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--socket",
        type=Path,
        default=None,
        help=f"daemon socket (default: $TANDEM_SOCKET, else {default_socket_path()})",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("serve", help="run the daemon in the foreground", description="Run the daemon in the foreground.")
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="preset name (see `tandem models list`) or path of a .gguf file (default %(default)s; pulled if missing)",
    )
    p.add_argument(
        "--ctx-size", type=int, default=None, help="context length in tokens (default: the model's, capped at 8192)"
    )
    p.add_argument("--threads", type=int, default=None, help="CPU threads for llama.cpp (default: all cores)")
    p.add_argument("--batch-size", type=int, default=512, help="prompt tokens per llama_decode call (default %(default)s)")
    p.add_argument(
        "--max-queue", type=int, default=16, help="requests that may wait; more get a `busy` reply (default %(default)s)"
    )
    p.add_argument(
        "--drafter",
        default="none",
        metavar="PRESET|PATH|ngram|none",
        help="speculative decoding: a small model with the target's tokenizer (its own worker process), "
        "'ngram' (prompt lookup, no model), or 'none' (default %(default)s)",
    )
    p.add_argument(
        "--draft-tokens", type=int, default=4, help="tokens drafted per round, 1-16; requests may override (default %(default)s)"
    )
    p.add_argument(
        "--draft-p-min",
        type=float,
        default=0.0,
        help="end a draft early when the drafter's probability for its next guess is below this; 0 = off (default)",
    )
    p.add_argument(
        "--governor",
        choices=["on", "off"],
        default="on",
        help="with a drafter: draft only while drafting is measurably faster than plain decoding, learned per task "
        "and kept in --state-dir across restarts; off = draft every round (default %(default)s)",
    )
    p.add_argument(
        "--governor-per-task",
        choices=["on", "off"],
        default="on",
        help="keep one governor state per task (requests whose prompts start with the same 16 tokens: the same "
        "system prompt, the same file), so alternating tasks each keep their own mode; off = one state for all "
        "(default %(default)s)",
    )
    p.add_argument(
        "--exact",
        choices=["auto", "on", "off"],
        default="auto",
        help="with a drafter: decode every step as a batch of >= 2 tokens, so that drafting never changes greedy "
        "output on a target whose one-token and batched kernels round differently (probed at load). Costs "
        "25-30%% on steps without drafts. auto = on only with --governor off (default %(default)s)",
    )
    p.add_argument(
        "--cache-bytes",
        type=_byte_size,
        default=None,
        metavar="SIZE",
        help="prefix cache: keep the KV state of recent prompts, in pages, in this much shared memory (e.g. "
        "512M, 2G) and restore it instead of prefilling a prompt's start again; both models' pages count. "
        "0 = off. Default 1G, or half of the free space of /dev/shm if that is less",
    )
    p.add_argument(
        "--page-tokens",
        type=int,
        default=16,
        metavar="N",
        help="prefix cache page size in tokens: a request reuses whole pages, so up to N-1 tokens of a cached "
        "prefix are prefilled again (default %(default)s; see README)",
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="where the daemon keeps what it learns (the governor's state) "
        "(default: $XDG_STATE_HOME/tandem, else ~/.local/state/tandem)",
    )
    p.add_argument(
        "--flash-attn", choices=["on", "off"], default="off", help="llama.cpp flash attention (default %(default)s)"
    )
    p.add_argument(
        "--extra-buffers",
        choices=["auto", "on", "off"],
        default="auto",
        help="llama.cpp weight repacking/AMX buffers; auto = off on CPUs with AMX, where they crash (default auto)",
    )

    p = sub.add_parser(
        "run",
        help="stream one answer to the terminal",
        description="Send PROMPT as a user chat message and stream the answer. "
        "Starts a daemon in the background (pulling the default model) if none is running.",
    )
    p.add_argument("prompt", help="the prompt; - reads it from stdin")
    p.add_argument("--raw", action="store_true", help="send PROMPT as plain completion text (no chat template)")
    p.add_argument("--json", action="store_true", help="print one JSON object with the result instead of streaming")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model for a daemon started by this command (default %(default)s)")
    p.add_argument("--no-start", action="store_true", help="fail instead of starting a daemon when none runs")
    _sampling_args(p)

    p = sub.add_parser("chat", help="interactive multi-turn chat", description="Chat in the terminal. /reset forgets, /exit (or Ctrl-D) leaves.")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model for a daemon started by this command (default %(default)s)")
    p.add_argument("--no-start", action="store_true", help="fail instead of starting a daemon when none runs")
    _sampling_args(p)

    p = sub.add_parser("status", help="show the daemon's model, queue, uptime and memory")
    p.add_argument("--json", action="store_true", help="print the raw status as JSON")

    sub.add_parser("stop", help="shut the daemon down cleanly")

    p = sub.add_parser("cache", help="the prefix cache: clear it", description="Manage the daemon's prefix cache.")
    csub = p.add_subparsers(dest="cache_command", metavar="ACTION")
    csub.add_parser(
        "clear", help="drop every cached page (after the running request, before the next queued one)"
    )

    p = sub.add_parser("models", help="fetch and list models")
    msub = p.add_subparsers(dest="models_command", metavar="ACTION")
    pp = msub.add_parser("pull", help="download a preset model into the model store, verifying its sha256")
    pp.add_argument("name", help="preset name (see `tandem models list`)")
    msub.add_parser("list", help="list presets and downloaded models")
    return parser


# --------------------------------------------------------------------------- helpers


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _connect(socket: Path, model: str, no_start: bool) -> Client:
    from .autostart import daemon_answers, start_daemon

    if not daemon_answers(socket):
        if no_start:
            raise DaemonNotRunning(f"no tandem daemon is running at {socket}; start one with `tandem serve`")
        start_daemon(socket, model, say=_say)
    client = Client(socket)
    client.connect()
    return client


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
    if sys.stderr.isatty():
        t = done.timings
        _say(
            f"[{done.usage.completion_tokens} tokens, {t.tokens_per_second:.1f} tok/s, "
            f"first token {t.time_to_first_token_seconds:.2f} s, finish: {done.finish_reason.value}]"
        )


# --------------------------------------------------------------------------- commands


def cmd_serve(args) -> int:
    from tandem.daemon.serve import serve

    from .autostart import state_dir

    extra = {"auto": None, "on": True, "off": False}[args.extra_buffers]
    return serve(
        model=args.model,
        socket_path=args.socket,
        ctx_size=args.ctx_size,
        threads=args.threads,
        batch_size=args.batch_size,
        max_queue=args.max_queue,
        extra_buffers=extra,
        flash_attn=args.flash_attn == "on",
        drafter=args.drafter,
        draft_tokens=args.draft_tokens,
        draft_p_min=args.draft_p_min,
        exact=args.exact,
        governor=args.governor == "on",
        governor_per_task=args.governor_per_task == "on",
        cache_bytes=args.cache_bytes,
        page_tokens=args.page_tokens,
        state_dir=args.state_dir or state_dir(),
    )


def cmd_run(args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    client = _connect(args.socket, args.model, args.no_start)
    with client:
        if args.raw:
            request = dict(prompt=(args.system + "\n\n" if args.system else "") + prompt)
        else:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": prompt}
            ]
            request = dict(messages=messages)
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
    client = _connect(args.socket, args.model, args.no_start)
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    _say(f"tandem chat with {client.server.model} (context {client.server.n_ctx} tokens). /reset, /exit.")
    with client:
        while True:
            try:
                line = input("> ")
            except EOFError:
                print()
                return 0
            if line.strip() in ("/exit", "/quit"):
                return 0
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


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def cmd_status(args) -> int:
    with Client(args.socket) as client:
        st = client.status()
    if args.json:
        print(json.dumps(asdict(st), indent=2))
        return 0
    up = st.uptime_seconds
    print(f"state:     {st.state}" + (f" ({st.failure})" if st.failure else ""))
    print(f"daemon:    tandem {st.daemon_version}, pid {st.pid}, up {int(up // 3600)}h{int(up % 3600 // 60):02d}m{int(up % 60):02d}s")
    print(f"socket:    {st.socket_path}")
    if st.model:
        m = st.model
        print(f"model:     {m.name} ({_mib(m.size_bytes)}, context {m.n_ctx:,} of {m.n_ctx_train:,} trained, vocab {m.n_vocab:,})")
    if st.drafter != "none":
        line = f"drafter:   {st.drafter}, {st.draft_tokens} tokens per draft"
        if st.model and st.model.exact_steps:
            line += ", exact steps (target is not batch-invariant)"
        if st.draft:
            d = st.draft
            line += (
                f"; {d.rounds:,} rounds, {d.accepted:,} of {d.drafted:,} drafts accepted "
                f"({d.acceptance_rate:.0%}), {d.tokens_per_round:.2f} tokens per round"
            )
        print(line)
    if st.governor:
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
    if st.active:
        a = st.active
        print(f"active:    {a.id} ({a.completion_tokens} tokens, {a.elapsed_seconds:.1f} s)")
    else:
        print("active:    none")
    print(f"queue:     {st.queue_length} waiting (max {st.max_queue})")
    reqs = ", ".join(f"{k} {v}" for k, v in sorted(st.requests.items())) or "none yet"
    print(f"requests:  {reqs}")
    print(f"tokens:    {st.tokens.get('prompt', 0):,} prompt, {st.tokens.get('completion', 0):,} generated")
    mem = ", ".join(f"{k} {_mib(v)}" + (f" (pid {st.worker_pids[k]})" if k in st.worker_pids else "") for k, v in st.memory_rss_bytes.items())
    print(f"memory:    {mem}")
    print(f"restarts:  {st.worker_restarts}")
    return 0


def cmd_stop(args) -> int:
    from .autostart import daemon_answers

    socket = args.socket
    if not daemon_answers(socket):
        _say(f"no tandem daemon is running at {socket}")
        return 0
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
        _say("usage: tandem cache clear")
        return 2
    with Client(args.socket) as client:
        reply = client.cache_clear()
    if reply.cache is None:
        _say("this daemon has no prefix cache (it was started with --cache-bytes 0)")
        return 0
    print(f"cleared {reply.pages:,} pages ({_mib(reply.bytes)}); the cache now holds {reply.cache.pages:,} pages")
    return 0


def cmd_models(args) -> int:
    from tandem.daemon import models

    if args.models_command == "pull":
        try:
            models.pull(args.name, progress=_say, show_pip_progress=sys.stderr.isatty())
        except models.ModelError as exc:
            raise TandemError(str(exc)) from None
        return 0
    if args.models_command == "list":
        print(f"model store: {models.models_dir()}")
        for name, path, description in models.list_models():
            where = str(path) if path else "(not pulled: tandem models pull " + name + ")"
            print(f"  {name:22} {description}\n  {'':22} {where}")
        return 0
    _say("usage: tandem models {pull NAME | list}")
    return 2


COMMANDS = {
    "serve": cmd_serve,
    "run": cmd_run,
    "chat": cmd_chat,
    "status": cmd_status,
    "stop": cmd_stop,
    "models": cmd_models,
    "cache": cmd_cache,
}


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.socket is None:
        args.socket = default_socket_path()
    try:
        return COMMANDS[args.command](args)
    except QueueFull as exc:
        _say(f"tandem: the daemon is busy: {exc}")
        return 3
    except RequestFailed as exc:
        _say(f"tandem: {exc.name}: {exc.message}")
        return 1
    except TandemError as exc:
        _say(f"tandem: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
