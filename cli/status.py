"""``tandem status``: the daemon's model, where it runs, whether its output is exact,
the drafter and its governor, the prefix cache, the queue and the memory, a line each."""

from __future__ import annotations

import json
from dataclasses import asdict

from tandem.client import Client

from .common import mib


def add_status(sub) -> None:
    p = sub.add_parser("status", help="show the daemon's model, queue, uptime and memory")
    p.add_argument("--json", action="store_true", help="print the raw status as JSON")


def cmd_status(args) -> int:
    with Client(args.socket) as client:
        st = client.status()
    if args.json:
        print(json.dumps(asdict(st), indent=2))
        return 0
    lines = _daemon_lines(st) + _model_lines(st)
    if st.drafter != "none":
        lines.append(_drafter_line(st))
    if st.governor and st.drafter in ("ngram", "suffix"):  # prompt lookup: gated per round, no probes
        lines.append(_lookup_governor_line(st.governor))
    elif st.governor:
        lines.append(_governor_line(st.governor))
    if st.embedding != "none":
        lines.append(_embedding_line(st))
    if st.cache:
        lines += _cache_lines(st.cache)
    lines += _work_lines(st)
    lines.append("memory:    " + ", ".join(_memory(st, k, v) for k, v in st.memory_rss_bytes.items()))
    lines.append(f"restarts:  {st.worker_restarts}")
    lines.append(f"metrics:   {'http://' + st.metrics_addr + '/metrics' if st.metrics_addr else 'off'}")
    for line in lines:
        print(line)
    return 0


def _daemon_lines(st) -> list[str]:
    up = st.uptime_seconds
    return [
        f"state:     {st.state}" + (f" ({st.failure})" if st.failure else ""),
        f"daemon:    tandem {st.daemon_version}, pid {st.pid}, "
        f"up {int(up // 3600)}h{int(up % 3600 // 60):02d}m{int(up % 60):02d}s",
        f"socket:    {st.socket_path}",
    ]


def _model_lines(st) -> list[str]:
    """The model, where its layers are, and whether output is exact (nothing before it is loaded)."""
    m = st.model
    if not m:
        return []
    fim = "fill-in-the-middle" if m.fim else "no fill-in-the-middle tokens"
    lines = [
        f"model:     {m.name} ({mib(m.size_bytes)}, context {m.n_ctx:,} of {m.n_ctx_train:,} trained, "
        f"vocab {m.n_vocab:,}, {fim})"
    ]
    if st.context:
        lines.append(f"context:   {st.context}")
    if m.devices:
        lines += _placement_lines(m, st.drafter_model)
    if m.batch_invariant is not None:
        lines.append(_exact_line(m))
    return lines


def layers_text(m) -> str:
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
    layers = f"layers:    target {layers_text(target)}"
    if drafter is not None and drafter.layers:
        layers += f"; drafter {layers_text(drafter)}"
    lines.append(layers)
    return lines


def _exact_line(m) -> str:
    """Whether output is exact (independent of the cache and drafting), and by which means."""
    kernels = f"mixed kernels (prompts in {m.prefill_chunk}-token chunks)" if m.prefill_chunk else None
    settings = f"{kernels or (m.kernels or '?') + ' kernels'}, flash attention {'on' if m.flash_attn else 'off'}"
    if m.cpu_kernels.startswith("tandem"):
        settings += ", tandem's CPU kernels"
    if m.extra_buffers:
        settings += ", repacked weights"
    if m.prompt_reader:
        settings += " (prompts read over the weights not repacked)"
    differ = ", ".join(m.batch_variant_paths)
    if m.batch_invariant:
        return f"exact:     yes, batch-invariant ({settings}): output does not depend on the cache or drafting"
    if m.draft_off:
        return f"exact:     yes, drafting and jump-forward off (logits differ on {differ}; {settings}): {m.draft_off}"
    if m.exact_steps:
        return (
            f"exact:     yes, with exact steps (logits differ on {differ}; {settings}): every step reads two "
            "positions, so output does not depend on the cache, drafting or the daemon's drafter"
        )
    return f"exact:     no, logits differ on {differ} ({settings}); see the daemon log"


def _drafter_line(st) -> str:
    line = f"drafter:   {st.drafter}, {st.draft_tokens} tokens per draft"
    if not st.draft_tokens:  # (--drafter auto found none: st.drafter says why)
        return f"drafter:   {st.drafter}"
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
    return line


def _lookup_governor_line(g) -> str:
    """The governor of a prompt-lookup drafter (ngram, suffix): a gate per round by match length."""
    by_match = ", ".join(f"{m}: {a:.2f}" for m, a in g.gate.items()) or "none measured yet"
    return (
        f"governor:  per round (free proposals: the predicted best number of drafts is verified, no probes); "
        f"{g.plain_rounds:,} plain and {g.draft_rounds:,} drafting rounds; acceptance by match length: "
        f"{by_match} (task {g.task}, {g.tasks} task(s) known)"
    )


def _governor_line(g) -> str:
    """The governor of a model drafter: its phase, the speeds it measured, its probes and its prediction."""
    rate = lambda r: f"{r:.1f}" if r is not None else "-"  # noqa: E731
    state = g.phase
    if g.phase == "plain":
        state += f", probe in {g.rounds_until_probe} rounds"
        if g.probe_debt_seconds > 0:
            state += f" and {g.probe_debt_seconds:.0f} s"
    return (
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


def _cache_lines(c) -> list[str]:
    """The prefix cache in shared memory, and its disk tier if it has one."""
    lines = [
        f"cache:     {c.pages:,} of {c.pages_total:,} pages of {c.page_tokens} tokens, "
        f"{mib(c.bytes_used)} of {mib(c.bytes_budget)}; "
        f"{c.hits:,} hits, {c.misses:,} misses; {c.tokens_from_cache:,} prompt tokens from cache, "
        f"{c.tokens_prefilled:,} prefilled"
        + (f", {c.drafter_tokens_from_cache:,} drafter tokens from cache" if c.drafter_tokens_from_cache else "")
        + f"; {c.evictions:,} evicted"
    ]
    if c.disk is not None:
        d = c.disk
        lines.append(
            f"disk:      {d.state}: {d.pages:,} pages, {mib(d.bytes_used)} of {mib(d.bytes_budget)} in {d.path}; "
            f"{d.hits:,} hits, {d.tokens_from_disk:,} prompt tokens from disk; {d.pages_written:,} pages written"
            + (f"; {d.dropped:,} damaged or foreign files ignored" if d.dropped else "")
        )
    return lines


def _embedding_line(st) -> str:
    m = st.embedding_model
    if m is None:  # loading, restarting or off: the name says which
        return f"embedding: {st.embedding}"
    return (
        f"embedding: {st.embedding} ({mib(m.size_bytes)}, inputs up to {m.n_ctx:,} tokens; "
        f"{st.requests.get('embed', 0):,} requests, {st.tokens.get('embedding', 0):,} tokens)"
    )


def _work_lines(st) -> list[str]:
    """The running request, the queue, and the requests and tokens served so far."""
    a, w = st.active, st.within
    reqs = ", ".join(f"{k} {v}" for k, v in sorted(st.requests.items())) or "none yet"
    within = f"; within it: {w.id} ({w.completion_tokens} tokens, {w.elapsed_seconds:.1f} s)" if w else ""
    active = f"{a.id} ({a.completion_tokens} tokens, {a.elapsed_seconds:.1f} s){within}" if a else "none"
    return [
        f"active:    {active}",
        f"queue:     {st.queue_length} waiting (max {st.max_queue})",
        f"requests:  {reqs}",
        f"tokens:    {st.tokens.get('prompt', 0):,} prompt, {st.tokens.get('completion', 0):,} generated",
    ]


def _memory(st, k: str, rss: int) -> str:
    """One process's memory: PSS where the daemon could read it (RSS counts a page twice where
    it is mapped twice, e.g. the model file under a prompt reader, and counts the shared
    prefix-cache arena in every process), else RSS."""
    pss = st.memory_pss_bytes.get(k)
    notes = [f"RSS {mib(rss)}"] if pss is not None else []
    if k in st.worker_pids:
        notes.append(f"pid {st.worker_pids[k]}")
    shown = f"{mib(pss)} PSS" if pss is not None else f"{mib(rss)} RSS"
    return f"{k} {shown}" + (f" ({', '.join(notes)})" if notes else "")
