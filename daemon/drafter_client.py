"""The target worker's handle on the drafter worker (the engine's Drafter for a
model drafter).

It mirrors which tokens the drafter holds in its KV cache, so each ``draft``
request says how many to keep (rolling back rejected drafts) and which to
append (accepted tokens the drafter did not produce itself). The mirror also
survives between requests, so a drafter re-reads only what changed.

If the drafter stops answering, drafting is switched off (plain decoding goes
on) rather than stalling the request.

With a prefix cache (``pages``: the target's PageStore, whose tree also holds
the drafter's pages), the drafter restores a cached prefix instead of reading
it whenever that saves reading, and ``store`` has it write the full pages it
holds at the end of a request.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import numpy as np
import zmq

from tandem.protocol import DRAFTER_REPLIES, DraftRequest, Drafted, Error, decode, encode

from .sampler import Sampler
from .speculative import SparseDist

log = logging.getLogger("tandem.worker")

PREFILL_TIMEOUT_MS = 300_000  # the drafter reads a whole prompt
DRAFT_TIMEOUT_MS = 10_000


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.nonzero(x != y)[0]
    return int(diff[0]) if diff.size else n


class ModelDrafterClient:
    def __init__(self, zctx: zmq.Context, endpoint: str):
        self.sock = zctx.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.mirror: list[int] = []  # tokens in the drafter's KV cache
        self.awaiting = 0  # replies still to collect
        self.broken = False
        self.request_id = ""
        self.sampler: Optional[Sampler] = None
        self.seed = 0
        self.new_request = False
        self.pages = None  # the target's PageStore, when the daemon has a prefix cache
        self.page_bytes = 0  # the drafter's page size, from its replies (0: unknown yet, or no cache)

    def begin(self, request_id: str, prompt: list[int], sampler: Sampler, prefill: bool = True) -> None:
        self.request_id = request_id
        self.sampler = sampler
        self.seed = (sampler.seed + 0x9E3779B97F4A7C15) % 2**64  # the drafter's own stream
        self.new_request = True
        if self.broken or not prefill:
            return
        # start the drafter's prefill now, in parallel with the target's own
        self._send(prompt, k=0, p_min=0.0)

    def ready(self) -> bool:
        if self.broken:
            return True
        while self.awaiting and self.sock.poll(0, zmq.POLLIN):
            reply = self._recv(0)
            if reply is None:
                return True
            self.mirror = self.mirror[: reply.n_cached]  # a k = 0 reply: it read what was sent
        return self.awaiting == 0

    def sync(self, context: list[int]) -> None:
        """Make the drafter hold ``context`` and wait until it does."""
        if self.broken:
            return
        if context and common_prefix(self.mirror, context) < len(context):
            self._send(context, k=0, p_min=0.0)
        reply = None
        while self.awaiting:
            reply = self._recv(PREFILL_TIMEOUT_MS)
            if reply is None:
                return
        if reply is not None:
            self.mirror = list(context)[: reply.n_cached]

    def propose(self, context: list[int], k: int, p_min: float):
        if self.broken:
            return [], None
        self._send(context, k, p_min)
        reply = None
        while self.awaiting:
            reply = self._recv(PREFILL_TIMEOUT_MS if self.awaiting > 1 else DRAFT_TIMEOUT_MS)
            if reply is None:
                return [], None
        assert reply is not None
        # what it holds now: the context (or, if it had no room, a prefix of it) + the drafts it read
        self.mirror = (list(context) + reply.tokens)[: reply.n_cached]
        if self.sampler is None or self.sampler.greedy:
            return reply.tokens, None
        dists, at = [], 0
        for n in reply.q_lens:
            dists.append(SparseDist(reply.q_ids[at : at + n].astype(np.int64), reply.q_probs[at : at + n].astype(np.float64)))
            at += n
        return reply.tokens, dists

    def _send(self, context: Sequence[int], k: int, p_min: float) -> None:
        keep = common_prefix(self.mirror, context)
        if keep == len(context):
            keep -= 1  # the drafter needs logits after the last token: read it again
        restore, keep = self._restore_plan(context, max(keep, 0))
        self._post(keep, list(context[keep:]), k, p_min, new_request=self.new_request, restore=restore)
        self.new_request = False
        self.mirror = list(context)  # what it will hold before drafting

    def _post(self, keep: int, append: list[int], k: int, p_min: float, new_request: bool = False, **pages) -> None:
        """Send one draft request with this request's sampling settings."""
        s = self.sampler
        assert s is not None
        self.sock.send_multipart(
            encode(
                DraftRequest(
                    id=self.request_id, keep=keep, append=append, k=k, temperature=s.temperature, top_k=s.top_k,
                    top_p=s.top_p, seed=self.seed, p_min=p_min, new_request=new_request, **pages,
                )
            )
        )  # fmt: skip
        self.awaiting += 1

    def _restore_plan(self, context: Sequence[int], keep: int) -> tuple[list[int], int]:
        """Cached drafter pages to restore instead of keeping ``keep`` tokens and
        reading the rest: (offsets, tokens they hold), or ([], keep) if they save nothing."""
        if self.pages is None or not self.page_bytes or len(context) - keep <= self.pages.page_tokens:
            return [], keep
        offsets = self.pages.match_role(context[: len(context) - 1], "drafter")
        n = len(offsets) * self.pages.page_tokens
        if n <= keep:
            return [], keep
        self.pages.drafter_tokens_from_cache += n
        return offsets, n

    def store(self, tokens: Sequence[int]) -> None:
        """End of a request: write the drafter's full pages of ``tokens`` that it
        holds and the cache lacks (waits for it: the checksums need the bytes)."""
        if self.broken or self.pages is None or not self.page_bytes or self.awaiting:
            return
        held = common_prefix(self.mirror, tokens)
        planned = self.pages.plan(tokens[:held], "drafter", self.page_bytes)
        if not planned:
            return
        nodes = [node for _, node in planned]
        store = [[start, node.pages["drafter"].offset] for start, node in planned]
        self._post(len(self.mirror), [], 0, 0.0, store=store)
        if self._recv(DRAFT_TIMEOUT_MS) is None:
            self.pages.unplan(nodes, "drafter")
        else:
            self.pages.seal(nodes, "drafter")

    def _recv(self, timeout_ms: int) -> Optional[Drafted]:
        if not self.sock.poll(timeout_ms, zmq.POLLIN):
            log.warning("the drafter did not answer within %d s; drafting is off", timeout_ms // 1000)
            self.broken = True
            return None
        self.awaiting -= 1
        msg = decode(self.sock.recv_multipart(), table=DRAFTER_REPLIES)
        if isinstance(msg, Error):
            log.warning("the drafter failed (%s); drafting is off", msg.message)
            self.broken = True
            return None
        self.page_bytes = msg.page_bytes
        return msg
