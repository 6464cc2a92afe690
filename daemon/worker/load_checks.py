"""The checks a model runs on itself at load: do the ways tandem decodes give
the logits exact output rests on, on this CPU, with these kernels?

``batch_invariance`` (with ``step_passes``) decides whether drafting and exact
steps keep greedy output unchanged; ``fast_prefill_is_exact`` and
``prefill_grouping_is_exact`` whether fast prefill does, and in groups of how
many chunks; ``prompt_reader_pays`` whether a prompt reader is worth keeping.
Each takes a ``LlamaModel`` (llama_model.py, which offers them as its methods)
and measures it through its own passes; each leaves its KV cache empty. The
target worker keeps their verdicts (invariance.py).
"""

from __future__ import annotations

import logging
import time
from typing import Optional, Sequence

import numpy as np

log = logging.getLogger(__name__)


def batch_invariance(model) -> dict[str, bool]:
    """Does a position's logits depend on how the tokens were batched? Decodes
    a ~70-token text (past the 64 query rows where ggml's flash attention
    tiles, and the 8 where its K-quant matmul does) the ways tandem does and
    compares the logits bit for bit with one prefill of the whole text:

    - ``restore``: a page of 16 tokens first, then the rest (a prefix-cache hit)
    - ``verify``: all but 5 tokens, then 5 in one pass (a verify pass, k = 4)
    - ``one_token``: the same 5 one at a time (plain decoding), against the verify rows;
      and one-token steps against verify passes of widths 2, 3, 4, 5, 8, 9 and 17 (``step_passes``)
    - ``small_batches``: 7 tokens per call (a prompt longer than --batch-size)
    - ``exact_steps``: what exact mode runs: two-position steps against verify passes
      of widths 2, 3, 4, 5, 8, 9 and 17, each cut back to what its round accepts (``step_passes``)

    Returns each path's verdict; all True means batch-invariant here. Leaves the cache empty."""
    text = (
        "The lighthouse keeper climbed the stairs every evening to light the lamp. "
        'def parse(line):\n    """Split a CSV line."""\n    fields = []\n    for part in line.split(","):\n'
        "        fields.append(part.strip())\n    return fields  # one per column\n"
    )
    tokens = model.tokenize(text, add_special=True)
    while len(tokens) < 70:
        tokens = tokens + tokens[1:]
    tokens = tokens[: min(72, model.n_ctx - 1)]  # decode() splits by n_batch itself
    n = len(tokens)
    if n < 24:
        return {}  # a context too small to probe in: unknown
    try:
        model.clear()
        whole = model.decode(tokens)[0]
        model.clear()
        model.decode(tokens[:16])
        restore = model.decode(tokens[16:])[0]
        model.clear()
        model.decode(tokens[: n - 5])
        rows = model.decode(tokens[n - 5 :], logits_for=range(5))
        model.truncate(n - 5)
        singles = [model.decode([t])[0] for t in tokens[n - 5 :]]
        model.clear()
        for start in range(0, n, 7):
            small = model.decode(tokens[start : start + 7])[0]
        one_token = all(np.array_equal(a, b) for a, b in zip(rows, singles))
        one_token = one_token and step_passes(model, tokens, step=1)
        exact_steps = step_passes(model, tokens, step=2)
        return {
            "restore": bool(np.array_equal(restore, whole)),
            "verify": bool(np.array_equal(rows[-1], whole)),
            "one_token": one_token,
            "small_batches": bool(np.array_equal(small, whole)),
            "exact_steps": exact_steps,
        }
    finally:
        model.clear()


# (width, accepted) of the verify passes ``step_passes`` runs: widths 2 to k + 1 = 17
# (--draft-tokens up to 16; 8 is where ggml's tiled K-quant matmul starts), each
# round accepting some of its drafts
PROBE_ROUNDS = ((5, 1), (2, 0), (17, 3), (3, 2), (9, 8), (8, 0), (4, 3))
PROBE_LEAD = 248  # positions read before the passes, which then run from 248 to 275 (see ``step_passes``)


def step_passes(model, tokens: Sequence[int], step: int = 2) -> bool:
    """What drafting rests on, measured: does a verify pass of w positions give, row
    for row, the logits a plain step gives at each of those positions, for widths
    2, 3, 4, 5, 8, 9 and 17, with the passes cut back after each round as the engine cuts them
    (rejected drafts dropped, the next pass written into the cells they held)?
    ``step`` is the plain step's width: 1, or 2 in exact mode (the token and a
    guess, the guess then dropped). tinyBLAS and ggml's tiled K-quant matmul start
    at 2 and 8 rows and round each row alike whatever the width; this checks it,
    and whatever else could differ, on the CPU the daemon runs on. Leaves the
    cache empty."""
    starts = [sum(a + 1 for _, a in PROBE_ROUNDS[:i]) for i in range(len(PROBE_ROUNDS))]
    need = max(at + width for at, (width, _) in zip(starts, PROBE_ROUNDS))  # positions read: 27
    # the passes run across position 256, where tandem's CPU kernels' attention (daemon/kernels) reads a
    # second chunk of KV; in a context too small for that, past 24 positions. The start is read as a prompt
    lead = PROBE_LEAD if PROBE_LEAD + need <= model.n_ctx - 2 else 24
    text = list(tokens)
    while len(text) < lead + need:
        text = text + list(tokens[1:])
    text = text[: lead + need]
    if len(text) > model.n_ctx - 2:
        return True  # (a context too small to probe in: the other paths' verdicts stand)
    base, rest = text[:lead], text[lead:]

    def read_base() -> None:
        model.clear()
        if lead == 24:
            model.decode(base)
        else:
            model.prefill(base)

    try:
        read_base()
        steps = []
        for i in range(need):
            if step == 1:
                steps.append(model.decode([rest[i]])[0])
            else:  # an exact step: [token, guess], logits for both, the guess (the token again) dropped
                steps.append(model.decode([rest[i], rest[i]], logits_for=(0, 1))[0])
                model.truncate(model.n_past - 1)
        read_base()
        for at, (width, _) in zip(starts, PROBE_ROUNDS):
            model.truncate(len(base) + at)  # the round before kept its accepted drafts and its own token
            rows = model.decode(rest[at : at + width], logits_for=range(width))
            if not all(np.array_equal(rows[j], steps[at + j]) for j in range(width)):
                return False
        return True
    finally:
        model.clear()


def fast_prefill_is_exact(model) -> Optional[bool]:
    """Does fast prefill hold here what exact output rests on? Two checks:

    - a prompt whose first chunk was kept from a request that went on
      differently gives the logits of the same prompt read whole;
    - a position's logits in a whole chunk do not depend on the chunk's later
      rows (prefix-cache pages of one chunk may come from two requests that
      share the tokens up to a page boundary inside it).

    Both hold by construction (the same chunks in the same shapes; kernels
    that compute rows apart); this checks the construction on this machine
    before the daemon relies on it. None when the context is too small to
    check in. Leaves the cache empty."""
    chunk = model.prefill_chunk
    if not chunk or model.n_ctx < 2 * chunk + 8:
        return None
    text = "The lighthouse keeper climbed the stairs every evening to light the lamp. "
    tokens = model.tokenize(text, add_special=True)
    while len(tokens) < 2 * chunk + 8:
        tokens = tokens + tokens[1:]
    other = model.tokenize(" A different ending, read with it before, about the harbour at night.", False)
    other = (other * (chunk // max(len(other), 1) + 1))[:chunk]
    half = chunk // 2
    group, model.prefill_group = model.prefill_group, chunk  # chunk by chunk: grouping is checked apart
    try:
        model.clear()
        whole = model.prefill(tokens[: chunk + 8]).copy()
        model.clear()
        model.prefill(tokens[:chunk] + other)
        model.truncate(chunk)
        kept = model.prefill(tokens[chunk : chunk + 8])
        rows = []
        reads = model.reader or model  # (the context whose fast kernels read prompts)
        for later in (tokens[chunk + half : 2 * chunk], other[: chunk - half]):
            reads.clear()
            reads.prefill(tokens[:chunk])
            reads.use_reference(False)
            try:
                rows.append(reads.decode(tokens[chunk : chunk + half] + later, logits_for=[half - 1])[0].copy())
            finally:
                reads.use_reference(True)
        return bool(np.array_equal(kept, whole) and np.array_equal(rows[0], rows[1]))
    finally:
        model.prefill_group = group
        model.clear()
        if model.reader is not None:
            model.reader.clear()


def checkable_group(model) -> int:
    """The largest group up to ``prefill_group`` that ``prefill_grouping_is_exact``
    can check in this context (0: not even two chunks, or grouping is off)."""
    chunk = model.prefill_chunk
    if not chunk:
        return 0
    group = min(model.prefill_group, (model.n_ctx - chunk - 8) // chunk * chunk)
    return group if group >= 2 * chunk else 0


def prefill_grouping_is_exact(model) -> Optional[bool]:
    """Does a whole chunk's KV stay the same when one llama_decode reads it with
    the chunks around it (``prefill_group``)? A cached request groups a prompt's
    chunks from another start than an uncached one. Compares the logits after
    a group, one chunk and 8 tokens read chunk by chunk with those read in
    groups from position 0, from the second chunk and from the third (what
    is before kept, as a cached request does: a full group, then one a chunk
    shorter); the 8 in a pass of their own every time. Where the
    context cannot hold that, the group shrinks to what it can check. None
    when not even two chunks can be checked, or grouping is off. Leaves the
    cache empty; ``prefill_group`` the size checked."""
    chunk, group = model.prefill_chunk, checkable_group(model)
    if not group:
        return None
    text = 'def parse(line):\n    """Split a CSV line."""\n    return [part.strip() for part in line.split(",")]\n'
    tokens = model.tokenize(text, add_special=True)
    while len(tokens) < group + chunk + 8:
        tokens = tokens + tokens[1:]
    tokens = tokens[: group + chunk + 8]
    try:
        model.prefill_group = chunk
        model.clear()
        alone = model.prefill(tokens).copy()
        model.prefill_group = group
        model.clear()
        from_zero = model.prefill(tokens).copy()
        shifted = []
        for kept in (chunk, 2 * chunk):  # a full group from the second chunk; a shorter one from the third
            model.clear()
            model.prefill_group = chunk
            model.prefill(tokens[:kept])
            model.prefill_group = group
            shifted.append(model.prefill(tokens[kept:]).copy())
        return bool(np.array_equal(alone, from_zero) and all(np.array_equal(alone, s) for s in shifted))
    finally:
        model.prefill_group = group
        model.clear()


def prompt_reader_pays(model, margin: float = 1.1) -> Optional[bool]:
    """Does the reader read a prompt at least ``margin`` times faster than this
    context? A pass of up to 128 tokens each way, twice, alternating (the
    faster of each). None without a reader or room to measure. Leaves the
    caches empty."""
    reading, reader = model.prompt_reader, model.reader
    n = min(model.prefill_group, 128) // model.prefill_chunk * model.prefill_chunk if reader is not None else 0
    if not n or model.n_ctx <= n:
        return None
    tokens = model.tokenize("The lighthouse keeper climbed the stairs every evening. " * 40, add_special=True)[:n]
    times: dict[bool, list[float]] = {False: [], True: []}
    try:
        for _ in range(2):
            for use in (False, True):
                model.prompt_reader = reading if use else None
                model.clear()
                started = time.perf_counter()
                model.prefill(tokens)
                times[use].append(time.perf_counter() - started)
    finally:
        model.prompt_reader = reading
        model.clear()
        reader.clear()
    log.info(
        "a %d-token prompt pass: %.0f ms over the repacked weights, %.0f ms by the reader",
        n,
        min(times[False]) * 1000,
        min(times[True]) * 1000,
    )
    return min(times[False]) > margin * min(times[True])
