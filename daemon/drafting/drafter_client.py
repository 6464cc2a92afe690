"""The target worker's handle on the drafter worker (the engine's Drafter for a
model drafter).

It mirrors which tokens the drafter holds in its KV cache, so each ``draft``
request says how many to keep (rolling back rejected drafts) and which to
append (accepted tokens the drafter did not produce itself). The mirror also
survives between requests, so a drafter re-reads only what changed.

If the drafter stops answering or answers with an error, drafting is switched
off (plain decoding goes on) rather than stalling the request, and the daemon
is told (``on_broken``), which kills and restarts the drafter: a drafter that
failed once is not left off for the daemon's life. ``go_down`` (the daemon says the drafter
died) closes the socket at once, so the drafter's single PAIR slot is free for
the next one; ``revive`` (it is back) starts afresh with a new socket and an
empty mirror at the next request's start, never under a request that waits on
it. Every draft request's id carries a nonce of this client, so a reply (or an
error) that a drafter computed for an earlier target worker is never taken for
ours. While waiting it calls ``on_wait`` about once a second (the worker's
heartbeat and its check for the daemon's messages); if that says the request was
cancelled, the wait ends.

With a prefix cache (``use_pages``: the target's PageStore, whose tree also holds
the drafter's pages), the drafter restores a cached prefix instead of reading
it whenever that saves reading, and ``store`` has it write the full pages it
holds at the end of a request. Pages the drafter was asked to write stay
allocated and locked until it acknowledges them (then they are sealed) or is
known to be dead (then they are freed), even when the wait for its reply ends
early (a cancel, a timeout): a drafter still writing into extents that the next
request's pages were given would corrupt them.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Callable, Optional, Sequence

import numpy as np
import zmq

from tandem.protocol import Error, decode, encode
from tandem.protocol.internal import DRAFTER_REPLIES, Drafted, DraftRequest, SamplingParams

from .interfaces import Drafter
from .sampler import Sampler
from .speculative import SparseDist

log = logging.getLogger("tandem.worker")

DRAFT_TIMEOUT_MS = 10_000
WAIT_SLICE_MS = 1_000


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.nonzero(x != y)[0]
    return int(diff[0]) if diff.size else n


class ModelDrafterClient(Drafter):
    def __init__(self, zctx: zmq.Context, endpoint: str, timeout: float = 120.0):
        self.zctx, self.endpoint = zctx, endpoint
        self.prefill_timeout_ms = int(timeout * 1000)  # the drafter reads a whole prompt
        self.draft_timeout_ms = min(DRAFT_TIMEOUT_MS, self.prefill_timeout_ms)
        self.on_wait: Optional[Callable[[], bool]] = None  # True: stop waiting (the request was cancelled)
        self.on_broken: Optional[Callable[[str], object]] = None
        self.sock = None
        self.revive_pending = False
        self.last_append = 0
        self.pages = None  # the target's PageStore, when the daemon has a prefix cache
        self.unacknowledged: dict[str, list] = {}  # store request id -> its nodes, while the drafter may write
        self.reset()
        self.request_id = ""
        self.sampler: Optional[Sampler] = None
        self.seed = 0
        self.new_request = False

    def use_pages(self, pages) -> None:
        self.pages = pages

    def go_down(self) -> None:
        """The drafter died: decode plainly, and let go of its endpoint now."""
        self._free_unacknowledged()  # it is dead: it writes nothing more
        self.broken = True
        self.revive_pending = False
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None

    def revive(self) -> None:
        """A new drafter is up: use it from the next request on."""
        self.revive_pending = True

    def reset(self) -> None:
        """Start afresh with a (new) drafter worker on the endpoint: a new socket, an empty mirror."""
        self.revive_pending = False
        if self.sock is not None:
            self.sock.close(linger=0)
        self._free_unacknowledged()  # the drafter they were asked of is gone (a new one is up)
        self.sock = self.zctx.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.endpoint)
        self.nonce = secrets.token_hex(4)
        self.mirror: list[int] = []  # tokens in the drafter's KV cache
        self.awaiting = 0  # replies still to collect
        self.broken = False
        self.page_bytes = 0  # the drafter's page size, from its replies (0: unknown yet, or no cache)

    def begin(self, request_id: str, prompt: list[int], sampler: Sampler, prefill: bool = True) -> None:
        self.request_id = request_id
        self.sampler = sampler
        self.seed = (sampler.seed + 0x9E3779B97F4A7C15) % 2**64  # the drafter's own stream
        self.new_request = True
        if self.revive_pending:
            self.reset()
        if self.broken or not prefill:
            return
        # start the drafter's prefill now, in parallel with the target's own
        self._send(prompt, k=0, p_min=0.0)

    def ready(self) -> bool:
        while self.awaiting and not self.broken and self.sock.poll(0, zmq.POLLIN):
            reply = self._recv(0)
            if reply is None:
                break
            self.mirror = self.mirror[: reply.n_cached]  # a k = 0 reply: it read what was sent
        return self.broken or self.awaiting == 0

    def sync(self, context: list[int]) -> bool:
        """Make the drafter hold ``context`` and wait until it does (False: it broke
        down, timed out or the wait was cancelled)."""
        if self.broken:
            return False
        if context and common_prefix(self.mirror, context) < len(context):
            self._send(context, k=0, p_min=0.0)
        reply = None
        while self.awaiting:
            reply = self._recv(self.prefill_timeout_ms)
            if reply is None:
                return False
        if reply is not None:
            self.mirror = list(context)[: reply.n_cached]
        return reply is None or reply.n_cached >= len(context)  # (False too: no room for all of it)

    def propose(self, context: list[int], k: int, p_min: float):
        if self.broken:
            return [], None
        self._send(context, k, p_min)
        reply = None
        while self.awaiting:
            reading = self.awaiting > 1 or self.last_append > 4 * k + 16  # it reads much more than it drafts
            reply = self._recv(self.prefill_timeout_ms if reading else self.draft_timeout_ms)
            if reply is None:
                return [], None
        assert reply is not None
        # what it holds now: the context (or, if it had no room, a prefix of it) + the drafts it read
        self.mirror = (list(context) + reply.tokens)[: reply.n_cached]
        if self.sampler is None or self.sampler.greedy:
            return reply.tokens, None
        dists, at = [], 0
        for n in reply.q_lens:
            dists.append(
                SparseDist(reply.q_ids[at : at + n].astype(np.int64), reply.q_probs[at : at + n].astype(np.float64))
            )
            at += n
        return reply.tokens, dists

    def _send(self, context: Sequence[int], k: int, p_min: float) -> None:
        keep = common_prefix(self.mirror, context)
        if keep == len(context):
            keep -= 1  # the drafter needs logits after the last token: read it again
        restore, keep = self._restore_plan(context, max(keep, 0))
        self.last_append = len(context) - keep
        self._post(keep, list(context[keep:]), k, p_min, new_request=self.new_request, restore=restore)
        self.new_request = False
        self.mirror = list(context)  # what it will hold before drafting

    def _post(self, keep: int, append: list[int], k: int, p_min: float, new_request: bool = False, **pages) -> str:
        """Send one draft request with this request's sampling settings; its id."""
        s = self.sampler
        assert s is not None
        sampling = SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=self.seed)
        request = DraftRequest(
            id=f"{self.nonce}:{self.request_id}",
            keep=keep,
            append=append,
            k=k,
            sampling=sampling,
            p_min=p_min,
            new_request=new_request,
            **pages,
        )
        self.sock.send_multipart(encode(request))
        self.awaiting += 1
        return request.id

    def _restore_plan(self, context: Sequence[int], keep: int) -> tuple[list[int], int]:
        """Cached drafter pages to restore instead of keeping ``keep`` tokens and
        reading the rest: (offsets, tokens they hold), or ([], keep) if they save nothing."""
        if not self._may_restore(context, keep):
            return [], keep
        offsets = self.pages.match_role(context[: len(context) - 1], "drafter")
        n = len(offsets) * self.pages.page_tokens
        if n <= keep:
            return [], keep
        self.pages.drafter_tokens_from_cache += n
        return offsets, n

    def _may_restore(self, context: Sequence[int], keep: int) -> bool:
        return self.pages is not None and bool(self.page_bytes) and len(context) - keep > self.pages.page_tokens

    def behind(self, context: list[int]) -> int:
        if self.broken or not context:
            return 0
        keep = common_prefix(self.mirror, context)
        if keep == len(context):
            return 0
        if self._may_restore(context, keep):  # (a forecast: no page locked or touched)
            keep = max(keep, self.pages.cached_role(context[: len(context) - 1], "drafter"))
        return len(context) - keep

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
        request_id = self._post(len(self.mirror), [], 0, 0.0, store=store)
        self.pages.tree.lock(nodes)  # never evicted, cleared or reused while the drafter may write them
        self.unacknowledged[request_id] = nodes
        self._recv(self.draft_timeout_ms)  # its reply seals them (now, or when it comes)

    def _acknowledged(self, request_id: str, written: bool) -> None:
        """The drafter answered a store request: its pages are written (sealed)
        or, after an error, not (freed); either way it writes them no more."""
        nodes = self.unacknowledged.pop(request_id, None)
        if nodes is None or self.pages is None:
            return
        self.pages.tree.unlock(nodes)
        if written:
            self.pages.seal(nodes, "drafter")
        else:
            self.pages.unplan(nodes, "drafter")

    def _free_unacknowledged(self) -> None:
        for request_id in list(self.unacknowledged):
            self._acknowledged(request_id, written=False)

    def _break(self, why: str) -> None:
        """Drafting off until the daemon, told, has restarted the drafter (``revive``)."""
        log.warning("%s; drafting is off until it is restarted", why)
        self.broken = True
        if self.on_broken is not None:
            self.on_broken(why)

    def _recv(self, timeout_ms: int) -> Optional[Drafted]:
        """The next reply to one of our requests; None when the drafter failed, did
        not answer within ``timeout_ms`` (then drafting is off and the daemon is
        told, as for an error), or was switched off meanwhile. ``timeout_ms`` 0: only what is there."""
        deadline = time.monotonic() + timeout_ms / 1000
        while not self.broken:
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if self.sock.poll(min(left_ms, WAIT_SLICE_MS), zmq.POLLIN):
                msg = decode(self.sock.recv_multipart(), table=DRAFTER_REPLIES)
                if msg.id is not None and not msg.id.startswith(self.nonce + ":"):
                    continue  # computed for an earlier target worker (or before a reset)
                if isinstance(msg, Error):
                    self.awaiting -= 1
                    self._acknowledged(msg.id, written=False)
                    self._break(f"the drafter failed ({msg.message})")
                    return None
                self.awaiting -= 1
                self._acknowledged(msg.id, written=True)
                self.page_bytes = msg.page_bytes
                return msg
            if timeout_ms == 0:
                return None
            if time.monotonic() >= deadline:
                self._break(f"the drafter did not answer within {timeout_ms / 1000:.0f} s")
                return None
            if self.on_wait is not None and self.on_wait():
                return None  # cancelled: the reply, when it comes, is still awaited (and skipped)
        return None
