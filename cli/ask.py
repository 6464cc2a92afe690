"""The commands that ask the served model: ``tandem run`` (one answer), ``tandem chat``
(multi-turn) and ``tandem tokens`` (its tokenizer)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from tandem.client import Client, RequestFailed, TandemError
from tandem.protocol import FinishReason, Generate

from .common import autostart_args, connect, say


def add_run(sub) -> None:
    p = sub.add_parser(
        "run",
        help="stream one answer to the terminal",
        description="Send PROMPT as a user chat message and stream the answer. "
        "Starts a daemon in the background (pulling the default model) if none is running.",
    )
    p.add_argument("prompt", help="the prompt; - reads it from stdin")
    p.add_argument("--raw", action="store_true", help="send PROMPT as plain completion text (no chat template)")
    p.add_argument("--json", action="store_true", help="print one JSON object with the result instead of streaming")
    autostart_args(p)
    _constraint_args(p)
    _sampling_args(p)


def add_chat(sub) -> None:
    p = sub.add_parser(
        "chat",
        help="interactive multi-turn chat",
        description="Chat in the terminal. /reset forgets, /exit (or Ctrl-D) leaves.",
    )
    autostart_args(p)
    _sampling_args(p)


def add_tokens(sub) -> None:
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


def _check_model(client: Client, asked: Optional[str]) -> None:
    """A daemon that answers with another model than ``--model`` asked for: say so, never answer as if."""
    if not asked:
        return
    from tandem.daemon.models import PRESETS, ModelError, hub

    served = client.server.model
    names = {asked, Path(asked).name, PRESETS[asked].filename if asked in PRESETS else asked}
    if hub.is_hub_name(asked):
        try:
            names.add(hub.parse(asked).name)  # (the daemon names it hf.co/ORG/REPO:QUANT, the quant upper-cased)
        except ModelError:
            pass
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
        progress=sys.stderr.isatty(),  # (a long prompt's reading, shown on the terminal)
    )


def _progress_line(p) -> str:
    line = f"[reading the prompt: {p.processed:,} of {p.total:,} tokens"
    if p.cached:
        line += f" ({p.cached:,} from the cache)"
    return line + f", {p.seconds:.0f} s]"


def _stream_to_terminal(stream) -> None:
    shown = False  # a progress line is on stderr, to be cleared before the answer
    try:
        for chunk in stream:
            if chunk.progress is not None:
                if chunk.progress.processed < chunk.progress.total and chunk.progress.seconds >= 1:
                    sys.stderr.write("\r\033[K" + _progress_line(chunk.progress))
                    shown = True
                elif shown and chunk.progress.processed >= chunk.progress.total:
                    sys.stderr.write("\r\033[K")  # read: the line goes (also when no text follows)
                    shown = False
                sys.stderr.flush()
                continue
            if shown:
                sys.stderr.write("\r\033[K")
                shown = False
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        stream.cancel()
        if shown:
            sys.stderr.write("\n")
        sys.stdout.write("\n")
        say("[cancelled]")
        raise SystemExit(130) from None
    except BaseException:
        if shown:
            sys.stderr.write("\n")  # (an error's message on a line of its own)
        raise
    sys.stdout.write("\n")
    done = stream.done
    if done.finish_reason == FinishReason.LENGTH:
        say(f"[cut off: the answer reached max tokens ({done.usage.completion_tokens}); raise --max-tokens]")
    if sys.stderr.isatty():
        t = done.timings
        say(
            f"[{done.usage.completion_tokens} tokens, {t.tokens_per_second:.1f} tok/s, "
            f"first token {t.time_to_first_token_seconds:.2f} s, finish: {done.finish_reason.value}]"
        )


def cmd_run(args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    client = connect(args.socket, args.model, args.no_start, args.config)
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
    client = connect(args.socket, args.model, args.no_start, args.config)
    _check_model(client, args.model_given)
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    say(f"tandem chat with {client.server.model} (context {client.server.n_ctx} tokens). /reset, /exit.")
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
                say(
                    "/reset forgets the conversation, /exit (or Ctrl-D, or Ctrl-C at the prompt) leaves; "
                    "Ctrl-C while it answers stops the answer"
                )
                continue
            if line.startswith("/") and " " not in line.strip():
                say(f"unknown command {line.strip()}; /help lists them (start a message with a space to send it)")
                continue
            if line.strip() == "/reset":
                history = history[:1] if args.system else []
                say("[history cleared]")
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
                say(f"error: {exc.message}")
                continue
            history.append({"role": "assistant", "content": stream.done.text})


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
