"""The daemon's settings: one schema, three sources, one precedence.

Every option is a ``tandem serve`` flag (``--cache-bytes``), an environment
variable (``TANDEM_CACHE_BYTES``) and a key of the TOML config file
(``cache_bytes = "2G"``). The first of these that is set wins:

1. a command-line flag;
2. the environment variable;
3. the config file: ``--config PATH``, else ``$TANDEM_CONFIG``, else
   ``$XDG_CONFIG_HOME/tandem/config.toml`` (``~/.config/tandem/config.toml``);
4. the built-in default.

Values from all three sources go through the same parser, so a bad value gets
the same message wherever it came from: it names the key, where the value came
from, and what is accepted. Unknown keys in the file are errors too (a typo must
not be silently ignored). ``tandem config show`` prints the effective settings
and where each came from.

The values are typed: ``settings.values.ctx_size`` is a field of ``SettingsValues``,
whose fields are generated from OPTIONS into settings_fields.py by ``python -m
tandem.daemon.config_gen`` (tests/daemon/test_config.py fails while that file is
out of date). Each kind of option has its parser (``PARSERS``).

Options marked ``reload`` are re-read on SIGHUP without dropping the models;
the others need a restart. This module is plain Python (no llama.cpp), so the
CLI can use it without loading the model runtime.
"""

from __future__ import annotations

import ipaddress
import math
import os
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from .settings_fields import SettingsFields

AUTO = None  # the value of an option left to the daemon ("auto" in files and flags)


class ConfigError(Exception):
    """A setting is unknown or has a bad value. The message names the key, its source and the fix."""


@dataclass(frozen=True)
class Option:
    key: str
    kind: str  # "str", "int", "float", "bool", "size", "path", "choice", "addr", "layers", "rpc"
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    auto: bool = False  # "auto" is accepted and means the default (None): the daemon decides
    reload: bool = False  # applied on SIGHUP
    metavar: Optional[str] = None

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def env(self) -> str:
        return "TANDEM_" + self.key.upper()

    def accepted(self) -> str:
        """What this option accepts, for error messages."""
        auto = ' or "auto"' if self.auto else ""
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind == "bool":
            return "on or off (true/false)"
        if self.kind in ("int", "float"):
            bounds = ""
            if self.minimum is not None and self.maximum is not None:
                bounds = f" from {_num(self.minimum)} to {_num(self.maximum)}"
            elif self.minimum is not None:
                bounds = f" >= {_num(self.minimum)}"
            return f"{'an integer' if self.kind == 'int' else 'a number'}{bounds}{auto}"
        if self.kind == "size":
            return f"a size in bytes, or with K, M or G (512M, 2G){auto}"
        if self.kind == "addr":
            return 'HOST:PORT (127.0.0.1:9464; port 0 picks a free one) or "off"'
        if self.kind == "path":
            return f"a path{auto}"
        if self.kind == "layers":
            return f'a number of layers (0 or more) or "all"{auto}'
        if self.kind == "rpc":
            return 'HOST:PORT[,HOST:PORT...] of llama.cpp rpc-servers, or "" (none)'

        return "a string"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


LOOPBACK_METRICS = "127.0.0.1:9464"

OPTIONS: tuple[Option, ...] = (
    Option(
        "socket",
        "path",
        AUTO,
        "the daemon's Unix socket (auto: $XDG_RUNTIME_DIR/tandem/tandem.sock, else /tmp/tandem-<uid>/tandem.sock)",
        auto=True,
    ),
    Option(
        "model",
        "str",
        "smollm2-135m",
        "preset name (see `tandem models list`), hf.co/ORG/REPO[:QUANT] from Hugging Face, or path of a .gguf "
        "file; a preset or hf.co/ model is pulled if missing",
        metavar="PRESET|HF|PATH",
    ),
    Option(
        "chat_template_file",
        "path",
        AUTO,
        "a Jinja chat template to render chats with instead of the one in the GGUF file (as llama-server's "
        "--chat-template-file): a model whose file has none, or a fixed one (auto: the file's)",
        auto=True,
        metavar="FILE",
    ),
    Option(
        "ctx_size",
        "int",
        AUTO,
        "context length in tokens (auto: the model's trained context where the KV caches fit --kv-budget, else "
        "the longest that fits; `tandem status` says which)",
        minimum=16,
        maximum=1 << 20,
        auto=True,
        metavar="N",
    ),
    Option(
        "kv_budget",
        "size",
        AUTO,
        "memory the KV caches of --ctx-size auto may take (target and model drafter together; --prompt-reader "
        "auto keeps a reader only where its KV cache fits in what is left): auto = a quarter of the machine's memory",
        auto=True,
        metavar="SIZE",
    ),
    Option(
        "kv_type",
        "choice",
        "f16",
        "the KV cache's element type (llama.cpp's type_k/type_v): q8_0 takes about half of f16's memory and "
        "q4_0 about a quarter, at some cost in quality; output stays exact either way; q8_0 and q4_0 need "
        "--flash-attn on",
        choices=("f16", "q8_0", "q4_0"),
    ),
    Option(
        "threads",
        "int",
        AUTO,
        "CPU threads for llama.cpp (auto: all cores)",
        minimum=1,
        maximum=1024,
        auto=True,
        metavar="N",
    ),
    Option(
        "batch_size",
        "int",
        512,
        "prompt tokens per llama_decode call (at most; with mixed kernels a prompt pass reads up to 256 tokens "
        "of whole 64-token chunks, and a step over repacked weights at most 3 rows)",
        minimum=1,
        maximum=65536,
        metavar="N",
    ),
    Option(
        "max_queue",
        "int",
        16,
        "requests that may wait; more get a `busy` reply",
        minimum=0,
        maximum=100_000,
        reload=True,
        metavar="N",
    ),
    Option(
        "preempt_tokens",
        "int",
        512,
        "the short-request lane: while a long generation runs, a request asking for at most N tokens with a prompt "
        "of at most 16,000 characters (a title, a summary, an editor's completion) runs between two of its steps "
        "(or passes of its prompt's reading) instead of waiting for it to end; the long one goes on where it was, "
        "with the same output. 0: off",
        minimum=0,
        maximum=1_000_000,
        reload=True,
        metavar="N",
    ),
    Option(
        "drafter",
        "str",
        "none",
        "speculative decoding: a small model with the target's tokenizer (its own "
        "worker process), 'auto' (a pulled model with the target's tokenizer: the preset's drafter, else "
        "the best small one; none if none is pulled, saying which to pull), 'ngram' (prompt lookup: the last "
        "4 tokens' latest match in the context), "
        "'suffix' (the longest match in the context and in earlier replies; no model either), or 'none'",
        metavar="PRESET|PATH|auto|ngram|suffix|none",
    ),
    Option(
        "drafter_quantize",
        "choice",
        "auto",
        "the drafter's weights (its guesses are only ever checked by the target, so they are chosen for speed): "
        "auto = a drafter of 300M weights or more whose matrices average over 5.5 bits is quantized once to "
        "Q4_0, output and embeddings included, where its weights are repacked (--extra-buffers; not with AMX) "
        "(Qwen2.5-Coder-0.5B: steps 15 instead of 25 ms, the 1.5B's tokens guessed as often within 1 point on "
        "code and edits), a smaller one at 16 or 32 bits to Q8_0 (a copy that cannot be written: the file as "
        "given, with a warning); q4_0 / q8_0 = that copy whatever the size (where the file is wider; an error if "
        "it cannot be made); copies go to the model cache; off = the file as given",
        choices=("auto", "q4_0", "q8_0", "off"),
    ),
    Option(
        "draft_tokens", "int", 4, "tokens drafted per round; requests may override", minimum=0, maximum=16, metavar="K"
    ),
    Option(
        "draft_p_min",
        "float",
        0.0,
        "end a draft early when the drafter's probability for its next guess is below this; 0 = off",
        minimum=0.0,
        maximum=1.0,
        metavar="P",
    ),
    Option(
        "governor",
        "bool",
        True,
        "with a drafter: draft only while drafting is measurably faster than plain "
        "decoding, learned per task and kept in state_dir across restarts; off = draft every round",
    ),
    Option(
        "governor_per_task",
        "bool",
        True,
        "keep one governor state per task (requests whose prompts start "
        "with the same 16 tokens), so alternating tasks each keep their own mode; off = one state for all",
    ),
    Option(
        "exact",
        "choice",
        "auto",
        "decode every step as a batch of >= 2 tokens, so that drafting, jump-forward and whether the daemon "
        "has a drafter never change greedy output on a target whose one-token and batched kernels round "
        "differently (probed at load; an F16 target, for one); costs 25-45%% on steps without drafts. "
        "auto = on only where the probe finds the target not batch-invariant. Where the probe finds verify "
        "passes rounding differently from these steps, drafting and jump-forward are turned off instead "
        "(status and done say so); off = one-token steps and drafting whatever the probe says",
        choices=("auto", "on", "off"),
    ),
    Option(
        "jump_forward",
        "bool",
        True,
        "with a response_format: read the tokens its grammar forces (a schema's fixed keys, closing braces) as "
        "drafts, verified in one batch, instead of sampling them one by one; off = one by one",
    ),
    Option(
        "thinking_budget",
        "int",
        -1,
        "a reasoning model's thinking, in tokens, for requests that set no budget of their own (their max_thinking_"
        "tokens, or Anthropic's budget_tokens): after this many the daemon writes the thinking's closing and the model "
        "answers; 0 = no thinking; -1 = no budget (as llama-server's --reasoning-budget)",
        minimum=-1,
        maximum=1 << 20,
        metavar="N",
    ),
    Option(
        "cache_bytes",
        "size",
        AUTO,
        "prefix cache: keep the KV state of recent prompts, in pages, in this "
        "much shared memory and restore it instead of prefilling a prompt's start again; both models' pages "
        "count. 0 = off. auto: 1G, or half of the free space of /dev/shm if that is less",
        auto=True,
        metavar="SIZE",
    ),
    Option(
        "settle",
        "bool",
        True,
        "prefix cache, with --kernels mixed: between requests, read the last request's final partial "
        "prompt chunk and its reply again in whole chunks into cache pages, so a next turn that re-sends them "
        "(a chat's, an agent's) reads only what is new; a request that arrives stops it at once. off = no "
        "work between requests",
    ),
    Option(
        "page_tokens",
        "int",
        16,
        "prefix cache page size in tokens: a request reuses whole pages, so up to "
        "N-1 tokens of a cached prefix are prefilled again",
        minimum=1,
        maximum=4096,
        metavar="N",
    ),
    Option(
        "disk_cache_bytes",
        "size",
        AUTO,
        "prefix cache, disk tier: the target's pages are also written to files (between requests, never "
        "while one waits), so a prompt's KV survives `tandem stop`, a logout and a reboot; at most this many "
        "bytes of page files (every model's together). 0 = off. auto: 4G, or a quarter of the disk's free "
        "space if that is less. Needs the shared-memory cache (--cache-bytes above 0)",
        auto=True,
        metavar="SIZE",
    ),
    Option(
        "disk_cache_dir",
        "path",
        AUTO,
        "where the disk tier keeps its page files, mode 0700 (auto: $XDG_CACHE_HOME/tandem/kv, else "
        "~/.cache/tandem/kv); they hold your prompts in KV form: `tandem cache clear` removes them",
        auto=True,
        metavar="DIR",
    ),
    Option(
        "state_dir",
        "path",
        AUTO,
        "where the daemon keeps what it learns (the governor's state) "
        "(auto: $XDG_STATE_HOME/tandem, else ~/.local/state/tandem)",
        auto=True,
        metavar="DIR",
    ),
    Option(
        "worker_timeout",
        "float",
        120.0,
        "seconds a model worker may go without a sign of life during a "
        "request (it sends one every second while it works, also while it waits for the drafter) before it "
        "is treated as hung: killed, restarted, and the request answered with an error",
        minimum=1.0,
        maximum=86400.0,
        metavar="SECONDS",
    ),
    Option(
        "client_queue",
        "int",
        10_000,
        "replies queued for a client that does not read them (a stalled "
        "editor) before it counts as gone: its running request is cancelled and further replies to it are "
        "dropped; other clients are never held up by it",
        minimum=16,
        maximum=10_000_000,
        metavar="N",
    ),
    Option(
        "flash_attn",
        "bool",
        True,
        "llama.cpp flash attention (with reference kernels, the batch-invariant "
        "way to compute attention on a CPU; off = separate matmuls, whose rows differ with the batch)",
    ),
    Option(
        "kernels",
        "choice",
        "mixed",
        "llama.cpp CPU kernels: mixed = prompts read with ggml's fast (tiled) kernels in fixed 64-token chunks "
        "counted from the prompt's start, every decoding step with its row-by-row reference kernels (output never "
        "depends on the prefix cache, the batch split or drafting; prompts read about 3x faster than with "
        "reference); reference = the reference kernels for prompts too; fast = the tiled kernels everywhere "
        "(output can change with caching and drafting at near-ties)",
        choices=("mixed", "reference", "fast"),
    ),
    Option(
        "kernel_patch",
        "choice",
        "auto",
        "tandem's CPU kernels (`tandem kernels build`): llama.cpp's CPU backend with tandem's patch, whose "
        "attention for decoding steps reads the KV in fixed chunks of 256 positions evenly over the threads (at "
        "16k tokens of context Qwen2.5-Coder-0.5B decoded 1.09x faster here), and passes over repacked weights "
        "compute each row as a step does, reading the weights once; as exact as before. auto = built at "
        "the first start (llama-cpp-python's sources from PyPI, cmake and a C++ compiler; about a "
        "minute), and where that fails llama.cpp's own, saying why (a failed build is tried again a day later, or by "
        "`tandem kernels build`); on = the same, and a failed build stops the "
        "start; off = llama.cpp's own",
        choices=("auto", "on", "off"),
    ),
    Option(
        "extra_buffers",
        "choice",
        "auto",
        "llama.cpp weight repacking/AMX buffers; auto = on for the target with mixed and fast kernels and for a "
        "model drafter with tandem's CPU kernels or fast ones, off with reference kernels and on CPUs with "
        "AMX (it crashes there). "
        "Repacked weights (Q4_0, Q4_K, Q8_0) multiply 4 rows at a time, which rounds differently from one row, "
        "so with mixed kernels and llama.cpp's own CPU kernels the daemon runs decoding steps in passes of at "
        "most 3 rows (verify and jump-forward passes too; tandem's CPU kernels, --kernel-patch, compute every "
        "row of one pass as a step does): exact, Q4_K decoding about a third faster here, prompts read a third "
        "slower (as llama-server, which repacks); with llama.cpp's own kernels a verify pass of k+1 tokens then "
        "costs about k+1 steps, so a model drafter pays less (off: cheaper verify passes, slower steps); "
        "tandem's multiply Q4_K and Q6_K weights with up to 8 rows at once (5 tokens: about 2.4 steps)",
        choices=("auto", "on", "off"),
    ),
    Option(
        "prompt_reader",
        "choice",
        "auto",
        "with repacked weights and mixed kernels, read prompts in a second llama.cpp context over the weights as "
        "the file has them (not repacked; both map the same file) and copy its KV state over, steps staying on "
        "the repacked ones: llama.cpp's repacked Q4_K reads prompts slower than its plain kernels on some CPUs "
        "(Qwen2.5-Coder-1.5B in 0.63-0.82x the time on a 2-core AVX-512 EPYC). It costs a second KV cache of "
        "--ctx-size (and, while it copies a long prompt's, a buffer as large). auto = where a prompt pass measures "
        "at least a tenth faster that way at load (the first such verdict kept for every daemon of this user on this "
        "machine, ~/.cache/tandem/machine-verdicts.json: the reader computes a prompt's KV in other bits, so "
        "daemons of the same settings must decide alike) and that second KV cache "
        "fits in what --kv-budget leaves beside the ones the context was sized for; output is as exact either way",
        choices=("auto", "on", "off"),
    ),
    Option(
        "gpu_layers",
        "layers",
        AUTO,
        "layers of the target to offload to a GPU or to --rpc servers: N, all, or 0 (none); auto = all where "
        "llama.cpp has a GPU or RPC device, else none. Accepted on a build without a GPU backend, where "
        "`tandem status` says how to install one",
        auto=True,
        metavar="N|all",
    ),
    Option(
        "device",
        "str",
        "auto",
        "llama.cpp device(s) for the target's offloaded layers, comma-separated (CUDA0, MTL0, RPC0...; "
        "`tandem status` lists those found); auto = every GPU and RPC device, split by free memory",
        metavar="NAME[,NAME...]",
    ),
    Option(
        "drafter_gpu_layers",
        "layers",
        AUTO,
        "as gpu_layers, for the model drafter (its own process; --rpc servers are the target's only)",
        auto=True,
        metavar="N|all",
    ),
    Option(
        "drafter_device",
        "str",
        "auto",
        "as device, for the model drafter",
        metavar="NAME[,NAME...]",
    ),
    Option(
        "embedding_model",
        "str",
        "none",
        "a model for embeddings (the embed op, /v1/embeddings, /api/embed), in a worker process of its own beside "
        "the target, at the lowest CPU priority (a running generation keeps its speed): a preset, "
        "hf.co/ORG/REPO[:QUANT] or the path of a .gguf file, pulled if missing; an embedding model (BERT, "
        "nomic-bert...) pools as its file says, a generative one by the mean of its last hidden states; "
        "none = no embeddings",
        metavar="PRESET|HF|PATH|none",
    ),
    Option(
        "rpc",
        "rpc",
        "",
        "offload the target's layers to llama.cpp rpc-server processes, HOST:PORT[,HOST:PORT...], built from "
        "the same llama.cpp (bench/build_rpc.sh); needs llama-cpp-python built with GGML_RPC. Loopback "
        "addresses only, unless rpc_leaves_machine",
        metavar="HOST:PORT[,...]",
    ),
    Option(
        "rpc_leaves_machine",
        "bool",
        False,
        "allow rpc addresses that are not this machine's: the model's weights and every request's "
        "activations, from which its text can be recovered, then cross the network unencrypted",
    ),
    Option(
        "metrics_addr",
        "addr",
        LOOPBACK_METRICS,
        "Prometheus metrics endpoint (HTTP, GET /metrics); "
        "loopback only unless metrics_allow_remote; port 0 picks a free port; off = no endpoint",
        metavar="HOST:PORT|off",
    ),
    Option(
        "metrics_allow_remote",
        "bool",
        False,
        "allow a metrics_addr that is not loopback (a warning is logged: the metrics then leave this machine)",
    ),
    Option(
        "metrics_other_users",
        "bool",
        False,
        "let other local users scrape the loopback metrics endpoint (a packaged Prometheus runs as its own "
        "user); off: only the user who runs the daemon, as on the socket",
    ),
    Option(
        "log_level",
        "choice",
        "info",
        "the daemon's log level",
        choices=("debug", "info", "warning", "error"),
        reload=True,
    ),
)

BY_KEY: dict[str, Option] = {o.key: o for o in OPTIONS}
RELOADABLE = frozenset(o.key for o in OPTIONS if o.reload)


def parse_size(text: str) -> int:
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in ("K", "M", "G", "T") else ""
    value = float(t[: len(t) - len(unit)])  # ValueError: not a size
    if not math.isfinite(value) or value < 0:
        raise ValueError("not a finite size")
    return int(value * units[unit])


_AS_GIVEN = object()


class _Invalid(Exception):
    """A per-kind parser's refusal, ``why`` (may be ""); parse_value turns it into the ConfigError.
    ``shown``: the value as the parser judged it, where that is not the raw one (a path given as a PathLike)."""

    def __init__(self, why: str = "", shown: Any = _AS_GIVEN):
        super().__init__(why)
        self.why, self.shown = why, shown


def _parse_bool(option: Option, raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str):
        word = raw.strip().lower()
        if word in ("on", "true", "yes", "1"):
            return True
        if word in ("off", "false", "no", "0"):
            return False
    raise _Invalid()


def _parse_choice(option: Option, raw: Any) -> str:
    if isinstance(raw, bool) and option.choices == ("auto", "on", "off"):
        return "on" if raw else "off"
    if isinstance(raw, str) and raw.strip().lower() in option.choices:
        return raw.strip().lower()
    raise _Invalid()


def _parse_int(option: Option, raw: Any) -> int:
    if isinstance(raw, bool):
        raise _Invalid()
    try:
        if isinstance(raw, float) and not raw.is_integer():
            raise ValueError
        value = int(raw) if not isinstance(raw, str) else int(raw.strip(), 10)
    except (TypeError, ValueError, OverflowError):
        raise _Invalid() from None
    return _bounded(option, value)


def _parse_float(option: Option, raw: Any) -> float:
    if isinstance(raw, bool):
        raise _Invalid()
    try:
        value = float(raw)
        if not math.isfinite(value):
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise _Invalid() from None
    return _bounded(option, value)


def _bounded(option: Option, value: Any) -> Any:
    if option.minimum is not None and value < option.minimum:
        raise _Invalid("too small")
    if option.maximum is not None and value > option.maximum:
        raise _Invalid("too large")
    return value


def _parse_size(option: Option, raw: Any) -> int:
    if isinstance(raw, bool):
        raise _Invalid()
    if isinstance(raw, int):
        if raw < 0:
            raise _Invalid("negative")
        return raw
    if not isinstance(raw, str):
        raise _Invalid('write a fraction with a unit, as a string: "1.5G"')
    try:
        return parse_size(raw)
    except (ValueError, OverflowError):
        raise _Invalid() from None


def _parse_addr(option: Option, raw: Any) -> str:
    if not isinstance(raw, str):
        raise _Invalid()
    if raw.strip().lower() == "off":
        return "off"
    host, sep, port = raw.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise _Invalid()
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise _Invalid("the host must be an IP address or localhost") from None
    return f"{host}:{int(port)}" if ":" not in host else f"[{host}]:{int(port)}"


def _parse_layers(option: Option, raw: Any) -> int | str:
    if isinstance(raw, str) and raw.strip().lower() == "all":
        return "all"
    if isinstance(raw, bool) or not isinstance(raw, (int, str)):
        raise _Invalid()
    try:
        value = int(raw.strip(), 10) if isinstance(raw, str) else raw
    except ValueError:
        raise _Invalid() from None
    if value < 0:
        raise _Invalid("negative")
    return value


def _parse_rpc(option: Option, raw: Any) -> str:
    if not isinstance(raw, str):
        raise _Invalid()
    if raw.strip().lower() in ("", "off", "none"):
        return ""
    servers = []
    for entry in raw.split(","):
        host, sep, port = entry.strip().rpartition(":")
        if host.startswith("[") or ":" in host:
            raise _Invalid(f"{entry.strip()!r}: llama.cpp's RPC speaks IPv4 only; use 127.0.0.1:PORT")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise _Invalid(f"{entry.strip()!r} is not HOST:PORT")
        servers.append(f"{host}:{int(port)}")
    return ",".join(servers)


def _parse_path(option: Option, raw: Any) -> Path:
    text = os.fspath(raw) if isinstance(raw, os.PathLike) else raw
    if not isinstance(text, str) or not text.strip():
        raise _Invalid(shown=text)
    return Path(text).expanduser()


def _parse_str(option: Option, raw: Any) -> str:
    if not isinstance(raw, str):
        raise _Invalid()
    return raw


# an option's kind -> its parser: (option, raw value) -> the value, or _Invalid
PARSERS: dict[str, Callable[[Option, Any], Any]] = {
    "str": _parse_str,
    "int": _parse_int,
    "float": _parse_float,
    "bool": _parse_bool,
    "size": _parse_size,
    "path": _parse_path,
    "choice": _parse_choice,
    "addr": _parse_addr,
    "layers": _parse_layers,
    "rpc": _parse_rpc,
}


def parse_value(option: Option, raw: Any, source: str) -> Any:
    """``raw`` (a string from a flag or the environment, or a TOML value) as
    ``option``'s type; ConfigError names the key, the source and what is accepted."""
    if option.auto and (raw is None or (isinstance(raw, str) and raw.strip().lower() == "auto")):
        return AUTO
    try:
        return PARSERS[option.kind](option, raw)
    except _Invalid as bad:
        shown = raw if bad.shown is _AS_GIVEN else bad.shown
        raise ConfigError(
            f"{option.key} = {shown!r} (from {source}) is not valid{': ' + bad.why if bad.why else ''}; "
            f"{option.key} takes {option.accepted()}"
        ) from None


def is_loopback_host(header: str) -> bool:
    """Whether an HTTP Host header names this machine exactly: ``localhost``, an IPv4
    literal in 127.0.0.0/8 or ``[::1]``, with or without a port. Anything else, such
    as ``127.0.0.1.attacker.example`` (DNS rebinding), is not."""
    host = header.strip().lower()
    if host.startswith("["):
        name, sep, rest = host[1:].partition("]")
        if not sep or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return False
    else:
        name, sep, port = host.rpartition(":")
        if not sep:
            name = host
        elif not port.isdigit():
            return False
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def is_loopback(addr: str) -> bool:
    host = addr.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# --------------------------------------------------------------------------- where things are


def default_state_dir(environ: Mapping[str, str] = os.environ) -> Path:
    base = environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "tandem"


def default_config_path(environ: Mapping[str, str] = os.environ) -> Path:
    base = environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "tandem" / "config.toml"


def config_path(explicit: Optional[Path], environ: Mapping[str, str] = os.environ) -> tuple[Path, bool]:
    """The config file to read, and whether it was named (then it must exist)."""
    if explicit is not None:
        return Path(explicit).expanduser(), True
    named = environ.get("TANDEM_CONFIG")
    if named:
        return Path(named).expanduser(), True
    return default_config_path(environ), False


def read_file(path: Path, required: bool) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if required:
            raise ConfigError(
                f"the config file {path} does not exist; create it, or drop --config / TANDEM_CONFIG"
            ) from None
        return {}
    except OSError as exc:
        raise ConfigError(f"cannot read the config file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"the config file {path} is not UTF-8 text (byte {exc.start}); save it as UTF-8 (TOML files are)"
        ) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"the config file {path} is not valid TOML: {exc}") from None
    for key, value in data.items():
        if key not in BY_KEY:
            hint = _closest(key)
            raise ConfigError(
                f"unknown key {key!r} in {path}{f' (did you mean {hint!r}?)' if hint else ''}; "
                f"the keys are: {', '.join(BY_KEY)}"
            )
        if isinstance(value, dict):
            raise ConfigError(f"{key} in {path} is a table; the config file has only top-level keys")
    return data


def _closest(key: str) -> Optional[str]:
    import difflib

    match = difflib.get_close_matches(key.replace("-", "_"), BY_KEY, n=1, cutoff=0.6)
    return match[0] if match else None


# --------------------------------------------------------------------------- the effective settings


PATH_KEYS = frozenset(o.key for o in OPTIONS if o.kind == "path")


@dataclass(frozen=True)
class SettingsValues(SettingsFields):
    """The settings' values, typed: ``values.ctx_size`` (the fields are generated from OPTIONS into
    settings_fields.py). Frozen: a change is a new one (``dataclasses.replace``). Besides the fields,
    a value by its option's key for code that loops over OPTIONS, and a plain form for JSON and msgpack."""

    def __getitem__(self, key: str) -> Any:
        """``values["ctx_size"]``: the value of the option ``key`` (KeyError: no such option)."""
        if key not in BY_KEY:
            raise KeyError(key)
        return getattr(self, key)

    def changed(self, other: SettingsValues) -> list[str]:
        """The keys whose values differ from ``other``'s, in OPTIONS' order."""
        return [o.key for o in OPTIONS if getattr(self, o.key) != getattr(other, o.key)]

    def to_dict(self) -> dict[str, Any]:
        """Every value by key, paths as strings: plain values only, for JSON and msgpack."""
        return {o.key: _plain(getattr(self, o.key)) for o in OPTIONS}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SettingsValues:
        """The inverse of ``to_dict`` (a missing key: its default; an unknown one: TypeError)."""
        values: dict[str, Any] = {k: Path(v) if k in PATH_KEYS and v is not None else v for k, v in data.items()}
        return cls(**values)


def _plain(value: Any) -> Any:
    return os.fspath(value) if isinstance(value, Path) else value


@dataclass
class Settings:
    """The effective settings: their typed values, where each came from, and the config file consulted."""

    values: SettingsValues  # replaced whole on a change (SIGHUP's reloadable options, check_rpc's addresses)
    sources: dict[str, str]  # "default", "flag --x", "environment TANDEM_X", "config file PATH"
    path: Path  # the config file consulted (it may not exist)
    file_found: bool

    def changed(self, other: Settings) -> list[str]:
        return self.values.changed(other.values)


def load(
    flags: Optional[Mapping[str, Any]] = None,
    config: Optional[Path] = None,
    environ: Mapping[str, str] = os.environ,
) -> Settings:
    """The effective settings: ``flags`` (key → raw value, only those given),
    then the environment, then the config file, then the defaults."""
    flags = flags or {}
    path, required = config_path(config, environ)
    file_values = read_file(path, required)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for option in OPTIONS:
        if option.key in flags and flags[option.key] is not None:
            raw, source = flags[option.key], f"flag {option.flag}"
        elif environ.get(option.env, "") != "":
            raw, source = environ[option.env], f"environment {option.env}"
        elif option.key in file_values:
            raw, source = file_values[option.key], f"config file {path}"
            if option.kind == "path" and isinstance(raw, str) and raw.strip() and raw.strip().lower() != "auto":
                raw = str(path.parent / Path(raw).expanduser())  # relative to the file, not to where the daemon runs
        else:
            values[option.key], sources[option.key] = option.default, "default"
            continue
        values[option.key] = parse_value(option, raw, source)
        sources[option.key] = source
    settings = Settings(SettingsValues(**values), sources, path, bool(file_values) or path.exists())
    check(settings)
    return settings


def check(settings: Settings) -> None:
    """Rules between options."""
    addr = settings.values.metrics_addr
    if addr != "off" and not is_loopback(addr) and not settings.values.metrics_allow_remote:
        raise ConfigError(
            f"metrics_addr = {addr!r} (from {settings.sources['metrics_addr']}) is not a loopback address: the "
            "metrics would be reachable from other machines. Use 127.0.0.1:PORT, or set metrics_allow_remote = "
            "true (--metrics-allow-remote on) if you mean it"
        )
    v = settings.values
    if v.kv_type != "f16" and not v.flash_attn:
        raise ConfigError(
            f"kv_type = {v.kv_type} (from {settings.sources['kv_type']}) needs flash attention, which is off (from "
            f"{settings.sources['flash_attn']}): llama.cpp keeps a quantized KV cache only with it. Use --flash-attn "
            "on, or --kv-type f16"
        )
    check_rpc(settings)


def rpc_servers(value: str) -> list[str]:
    """The rpc setting's HOST:PORT entries."""
    return [s for s in value.split(",") if s]


def check_rpc(settings: Settings) -> None:
    """Every rpc-server address names this machine, unless the user said the
    traffic may leave it. A name is resolved here, once, and replaced by the
    IPv4 address that was checked: the workers and llama.cpp connect to that, so
    a name that resolves elsewhere later cannot move the traffic off the machine."""
    rpc = settings.values.rpc
    servers = rpc_servers(rpc)
    if not servers:
        return
    if settings.values.rpc_leaves_machine:  # any host goes: nothing to check, nothing to resolve (offline too)
        if len(set(servers)) < len(servers):
            raise ConfigError(f"rpc = {rpc!r}: a server named twice (an rpc-server takes one client)")
        return
    import socket

    source = f"rpc = {rpc!r} (from {settings.sources['rpc']})"
    resolved = []
    for server in servers:
        host, _, port = server.rpartition(":")
        try:
            addresses = sorted({info[4][0] for info in socket.getaddrinfo(host, int(port), socket.AF_INET)})
        except OSError as exc:
            raise ConfigError(
                f"{source}: cannot resolve {host!r} ({exc.strerror or exc}); give the server's IPv4 address"
            ) from None
        remote = [a for a in addresses if not ipaddress.ip_address(a).is_loopback]
        if remote:
            raise ConfigError(
                f"{source}: {server} is not this machine ({', '.join(remote)}); the target's weights and every "
                "request's activations would cross the network, unencrypted. Use 127.0.0.1:PORT, or set "
                "rpc_leaves_machine = true (--rpc-leaves-machine on) if you mean it"
            )
        address = f"{addresses[0]}:{int(port)}"
        if address in resolved:
            raise ConfigError(f"{source}: {server} names the same server twice (an rpc-server takes one client)")
        resolved.append(address)
    settings.values = replace(settings.values, rpc=",".join(resolved))


def show_value(option: Option, value: Any) -> str:
    if value is AUTO:
        return "auto"
    if option.kind == "bool":
        return "on" if value else "off"
    if option.kind == "size":
        for unit, size in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
            if value and value % size == 0:
                return f"{value // size}{unit}"
        return str(value)
    return str(value)


def toml_value(option: Option, value: Any) -> str:
    """``value`` as it would be written in the config file."""
    if value is AUTO:
        return '"auto"'
    if option.kind == "bool":
        return "true" if value else "false"
    if option.kind in ("int", "float"):
        return str(value)
    return '"' + show_value(option, value).replace("\\", "\\\\").replace('"', '\\"') + '"'


class ServeError(Exception):
    """The daemon cannot start. The message says why and what to do."""
