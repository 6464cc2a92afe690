"""The daemon's settings, typed: one field per option of config.OPTIONS, in its order.

Generated from OPTIONS by `python -m tandem.daemon.config_gen`; do not edit (change OPTIONS in
config.py and run that). config.SettingsValues adds access by key and a plain form.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class SettingsFields:
    """Each field's default is its option's; None is "auto" (the daemon decides)."""

    socket: Path | None = None
    """the daemon's Unix socket (auto: $XDG_RUNTIME_DIR/tandem/tandem.sock, else /tmp/tandem-<uid>/tandem.sock)"""
    model: str = "smollm2-135m"
    """preset name (see `tandem models list`), hf.co/ORG/REPO[:QUANT] from Hugging Face, or path of a .gguf file; a
    preset or hf.co/ model is pulled if missing"""
    chat_template_file: Path | None = None
    """a Jinja chat template to render chats with instead of the one in the GGUF file (as llama-server's
    --chat-template-file): a model whose file has none, or a fixed one (auto: the file's)"""
    ctx_size: int | None = None
    """context length in tokens (auto: the model's trained context where the KV caches fit --kv-budget, else the longest
    that fits; `tandem status` says which)"""
    kv_budget: int | None = None
    """memory the KV caches of --ctx-size auto may take (target and model drafter together; --prompt-reader auto keeps a
    reader only where its KV cache fits in what is left): auto = a quarter of the machine's memory"""
    kv_type: Literal["f16", "q8_0", "q4_0"] = "f16"
    """the KV cache's element type (llama.cpp's type_k/type_v): q8_0 takes about half of f16's memory and q4_0 about a
    quarter, at some cost in quality; output stays exact either way; q8_0 and q4_0 need --flash-attn on"""
    threads: int | None = None
    """CPU threads for llama.cpp (auto: all cores)"""
    batch_size: int = 512
    """prompt tokens per llama_decode call (at most; with mixed kernels a prompt pass reads up to 256 tokens of whole
    64-token chunks, and a step over repacked weights at most 3 rows)"""
    max_queue: int = 16
    """requests that may wait; more get a `busy` reply"""
    preempt_tokens: int = 512
    """the short-request lane: while a long generation runs, a request asking for at most N tokens with a prompt of at
    most 16,000 characters (a title, a summary, an editor's completion) runs between two of its steps (or passes of
    its prompt's reading) instead of waiting for it to end; the long one goes on where it was, with the same output.
    0: off"""
    drafter: str = "none"
    """speculative decoding: a small model with the target's tokenizer (its own worker process), 'auto' (a pulled model
    with the target's tokenizer: the preset's drafter, else the best small one; none if none is pulled, saying which
    to pull), 'ngram' (prompt lookup: the last 4 tokens' latest match in the context), 'suffix' (the longest match in
    the context and in earlier replies; no model either), or 'none'"""
    drafter_quantize: Literal["auto", "q4_0", "q8_0", "off"] = "auto"
    """the drafter's weights (its guesses are only ever checked by the target, so they are chosen for speed): auto = a
    drafter of 300M weights or more whose matrices average over 5.5 bits is quantized once to Q4_0, output and
    embeddings included, where its weights are repacked (--extra-buffers; not with AMX) (Qwen2.5-Coder-0.5B: steps 15
    instead of 25 ms, the 1.5B's tokens guessed as often within 1 point on code and edits), a smaller one at 16 or 32
    bits to Q8_0 (a copy that cannot be written: the file as given, with a warning); q4_0 / q8_0 = that copy whatever
    the size (where the file is wider; an error if it cannot be made); copies go to the model cache; off = the file
    as given"""
    draft_tokens: int = 4
    """tokens drafted per round; requests may override"""
    draft_p_min: float = 0.0
    """end a draft early when the drafter's probability for its next guess is below this; 0 = off"""
    governor: bool = True
    """with a drafter: draft only while drafting is measurably faster than plain decoding, learned per task and kept in
    state_dir across restarts; off = draft every round"""
    governor_per_task: bool = True
    """keep one governor state per task (requests whose prompts start with the same 16 tokens), so alternating tasks
    each keep their own mode; off = one state for all"""
    exact: Literal["auto", "on", "off"] = "auto"
    """decode every step as a batch of >= 2 tokens, so that drafting, jump-forward and whether the daemon has a drafter
    never change greedy output on a target whose one-token and batched kernels round differently (probed at load; an
    F16 target, for one); costs 25-45% on steps without drafts. auto = on only where the probe finds the target not
    batch-invariant. Where the probe finds verify passes rounding differently from these steps, drafting and
    jump-forward are turned off instead (status and done say so); off = one-token steps and drafting whatever the
    probe says"""
    jump_forward: bool = True
    """with a response_format: read the tokens its grammar forces (a schema's fixed keys, closing braces) as drafts,
    verified in one batch, instead of sampling them one by one; off = one by one"""
    thinking_budget: int = -1
    """a reasoning model's thinking, in tokens, for requests that set no budget of their own (their max_thinking_tokens,
    or Anthropic's budget_tokens): after this many the daemon writes the thinking's closing and the model answers; 0
    = no thinking; -1 = no budget (as llama-server's --reasoning-budget)"""
    cache_bytes: int | None = None
    """prefix cache: keep the KV state of recent prompts, in pages, in this much shared memory and restore it instead of
    prefilling a prompt's start again; both models' pages count. 0 = off. auto: 1G, or half of the free space of
    /dev/shm if that is less"""
    settle: bool = True
    """prefix cache, with --kernels mixed: between requests, read the last request's final partial prompt chunk and its
    reply again in whole chunks into cache pages, so a next turn that re-sends them (a chat's, an agent's) reads only
    what is new; a request that arrives stops it at once. off = no work between requests"""
    page_tokens: int = 16
    """prefix cache page size in tokens: a request reuses whole pages, so up to N-1 tokens of a cached prefix are
    prefilled again"""
    disk_cache_bytes: int | None = None
    """prefix cache, disk tier: the target's pages are also written to files (between requests, never while one waits),
    so a prompt's KV survives `tandem stop`, a logout and a reboot; at most this many bytes of page files (every
    model's together). 0 = off. auto: 4G, or a quarter of the disk's free space if that is less. Needs the
    shared-memory cache (--cache-bytes above 0)"""
    disk_cache_dir: Path | None = None
    """where the disk tier keeps its page files, mode 0700 (auto: $XDG_CACHE_HOME/tandem/kv, else ~/.cache/tandem/kv);
    they hold your prompts in KV form: `tandem cache clear` removes them"""
    state_dir: Path | None = None
    """where the daemon keeps what it learns (the governor's state) (auto: $XDG_STATE_HOME/tandem, else
    ~/.local/state/tandem)"""
    worker_timeout: float = 120.0
    """seconds a model worker may go without a sign of life during a request (it sends one every second while it works,
    also while it waits for the drafter) before it is treated as hung: killed, restarted, and the request answered
    with an error"""
    client_queue: int = 10000
    """replies queued for a client that does not read them (a stalled editor) before it counts as gone: its running
    request is cancelled and further replies to it are dropped; other clients are never held up by it"""
    flash_attn: bool = True
    """llama.cpp flash attention (with reference kernels, the batch-invariant way to compute attention on a CPU; off =
    separate matmuls, whose rows differ with the batch)"""
    kernels: Literal["mixed", "reference", "fast"] = "mixed"
    """llama.cpp CPU kernels: mixed = prompts read with ggml's fast (tiled) kernels in fixed 64-token chunks counted
    from the prompt's start, every decoding step with its row-by-row reference kernels (output never depends on the
    prefix cache, the batch split or drafting; prompts read about 3x faster than with reference); reference = the
    reference kernels for prompts too; fast = the tiled kernels everywhere (output can change with caching and
    drafting at near-ties)"""
    kernel_patch: Literal["auto", "on", "off"] = "auto"
    """tandem's CPU kernels (`tandem kernels build`): llama.cpp's CPU backend with tandem's patch, whose attention for
    decoding steps reads the KV in fixed chunks of 256 positions evenly over the threads (at 16k tokens of context
    Qwen2.5-Coder-0.5B decoded 1.09x faster here), and passes over repacked weights compute each row as a step does,
    reading the weights once; as exact as before. auto = built at the first start (llama-cpp-python's sources from
    PyPI, cmake and a C++ compiler; about a minute), and where that fails llama.cpp's own, saying why (a failed build
    is tried again a day later, or by `tandem kernels build`); on = the same, and a failed build stops the start; off
    = llama.cpp's own"""
    extra_buffers: Literal["auto", "on", "off"] = "auto"
    """llama.cpp weight repacking/AMX buffers; auto = on for the target with mixed and fast kernels and for a model
    drafter with tandem's CPU kernels or fast ones, off with reference kernels and on CPUs with AMX (it crashes
    there). Repacked weights (Q4_0, Q4_K, Q8_0) multiply 4 rows at a time, which rounds differently from one row, so
    with mixed kernels and llama.cpp's own CPU kernels the daemon runs decoding steps in passes of at most 3 rows
    (verify and jump-forward passes too; tandem's CPU kernels, --kernel-patch, compute every row of one pass as a
    step does): exact, Q4_K decoding about a third faster here, prompts read a third slower (as llama-server, which
    repacks); with llama.cpp's own kernels a verify pass of k+1 tokens then costs about k+1 steps, so a model drafter
    pays less (off: cheaper verify passes, slower steps); tandem's multiply Q4_K and Q6_K weights with up to 8 rows
    at once (5 tokens: about 2.4 steps)"""
    prompt_reader: Literal["auto", "on", "off"] = "auto"
    """with repacked weights and mixed kernels, read prompts in a second llama.cpp context over the weights as the file
    has them (not repacked; both map the same file) and copy its KV state over, steps staying on the repacked ones:
    llama.cpp's repacked Q4_K reads prompts slower than its plain kernels on some CPUs (Qwen2.5-Coder-1.5B in
    0.63-0.82x the time on a 2-core AVX-512 EPYC). It costs a second KV cache of --ctx-size (and, while it copies a
    long prompt's, a buffer as large). auto = where a prompt pass measures at least a tenth faster that way at load
    (the first such verdict kept for every daemon of this user on this machine,
    ~/.cache/tandem/machine-verdicts.json: the reader computes a prompt's KV in other bits, so daemons of the same
    settings must decide alike) and that second KV cache fits in what --kv-budget leaves beside the ones the context
    was sized for; output is as exact either way"""
    gpu_layers: int | Literal["all"] | None = None
    """layers of the target to offload to a GPU or to --rpc servers: N, all, or 0 (none); auto = all where llama.cpp has
    a GPU or RPC device, else none. Accepted on a build without a GPU backend, where `tandem status` says how to
    install one"""
    device: str = "auto"
    """llama.cpp device(s) for the target's offloaded layers, comma-separated (CUDA0, MTL0, RPC0...; `tandem status`
    lists those found); auto = every GPU and RPC device, split by free memory"""
    drafter_gpu_layers: int | Literal["all"] | None = None
    """as gpu_layers, for the model drafter (its own process; --rpc servers are the target's only)"""
    drafter_device: str = "auto"
    """as device, for the model drafter"""
    embedding_model: str = "none"
    """a model for embeddings (the embed op, /v1/embeddings, /api/embed), in a worker process of its own beside the
    target, at the lowest CPU priority (a running generation keeps its speed): a preset, hf.co/ORG/REPO[:QUANT] or
    the path of a .gguf file, pulled if missing; an embedding model (BERT, nomic-bert...) pools as its file says, a
    generative one by the mean of its last hidden states; none = no embeddings"""
    rpc: str = ""
    """offload the target's layers to llama.cpp rpc-server processes, HOST:PORT[,HOST:PORT...], built from the same
    llama.cpp (bench/build_rpc.sh); needs llama-cpp-python built with GGML_RPC. Loopback addresses only, unless
    rpc_leaves_machine"""
    rpc_leaves_machine: bool = False
    """allow rpc addresses that are not this machine's: the model's weights and every request's activations, from which
    its text can be recovered, then cross the network unencrypted"""
    metrics_addr: str = "127.0.0.1:9464"
    """Prometheus metrics endpoint (HTTP, GET /metrics); loopback only unless metrics_allow_remote; port 0 picks a free
    port; off = no endpoint"""
    metrics_allow_remote: bool = False
    """allow a metrics_addr that is not loopback (a warning is logged: the metrics then leave this machine)"""
    metrics_other_users: bool = False
    """let other local users scrape the loopback metrics endpoint (a packaged Prometheus runs as its own user); off:
    only the user who runs the daemon, as on the socket"""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """the daemon's log level"""
