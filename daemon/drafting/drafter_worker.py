"""The drafter worker process: a small model that proposes tokens.

It answers ``draft`` requests from the target worker on its own PAIR socket
(the target drives the rounds; the daemon front only starts and stops it). For
each request it rolls its KV cache back to ``keep`` tokens, reads ``append``,
then samples up to ``k`` tokens, decoding all but the last so the next round
can start from them. At temperature > 0 it returns its distributions q as raw
arrays (never pickled) so the target can apply the acceptance rule.

With a prefix cache, the target worker (which owns the tree) tells it which of
its KV pages to write into the daemon's arena (``store``) and which to read
back instead of prefilling (``restore``); the bytes never leave shared memory.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import numpy as np
import zmq

from tandem.protocol import Error, ErrorCode, ProtocolError, Shutdown, decode, encode
from tandem.protocol.internal import DRAFTER_REQUESTS, Drafted, DraftRequest, Ready

from ..worker.worker_config import WorkerConfig, describe_model, load_model
from .sampler import Sampler

log = logging.getLogger("tandem.drafter")

EMPTY_IDS = np.zeros(0, dtype=np.int32)
EMPTY_PROBS = np.zeros(0, dtype=np.float32)


class Drafting:
    """The drafter's logic, without sockets: roll back, read, draft; store and
    restore prefix-cache pages in the arena (``arena`` None: no prefix cache)."""

    def __init__(self, model, page_tokens: int, arena: Optional[memoryview] = None):
        self.model = model
        self.page_tokens = page_tokens
        self.sampler: Optional[Sampler] = None
        self.arena = arena
        self.layout = None
        self.page_bytes = 0
        if arena is not None:
            from ..cache.page_store import probe_layout

            self.layout = probe_layout(model)
            self.page_bytes = self.layout.page_bytes(page_tokens)

    def _pages(self, req: DraftRequest) -> None:
        from ..cache.page_store import read_pages, write_pages

        if not (req.store or req.restore):
            return
        if self.arena is None:
            raise ValueError("asked to use prefix-cache pages, but this drafter has no prefix cache")
        pt = self.page_tokens
        for start, offset in req.store:
            if start < 0 or start + pt > self.model.n_past or offset < 0 or offset + self.page_bytes > len(self.arena):
                raise ValueError(
                    f"cannot store the page at token {start} (holding {self.model.n_past}) at offset {offset}"
                )
        if req.store:
            write_pages(self.model, self.arena, pt, [(s, o) for s, o in req.store], expect=self.layout)
        if req.restore:
            if any(o < 0 or o + self.page_bytes > len(self.arena) for o in req.restore):
                raise ValueError("a page to restore lies outside the arena")
            read_pages(self.model, self.arena, self.layout, pt, req.restore)

    def draft(self, req: DraftRequest) -> Drafted:
        model = self.model
        if req.new_request or self.sampler is None:
            s = req.sampling
            self.sampler = Sampler(s.temperature, s.top_k, s.top_p, s.seed)
        sampler = self.sampler
        self._pages(req)
        if req.keep > model.n_past:
            raise ValueError(f"asked to keep {req.keep} tokens but {model.n_past} are cached")
        model.truncate(req.keep)
        tokens: list[int] = []
        ids, probs, lens = [], [], []
        if not req.append or model.n_past + len(req.append) >= model.n_ctx or max(req.append) >= model.n_vocab:
            # nothing to read, no room in this drafter's context, or an id past its vocabulary (a target's
            # padding, models/vocab.py: never a text's token): no drafts this time
            return Drafted(
                id=req.id,
                tokens=[],
                n_cached=model.n_past,
                q_ids=EMPTY_IDS,
                q_probs=EMPTY_PROBS,
                q_lens=[],
                page_bytes=self.page_bytes,
            )
        logits = model.decode(req.append)[0]
        for i in range(req.k):
            if sampler.greedy:
                token = int(np.argmax(logits))
                if req.p_min > 0.0 and _softmax_prob(logits, token) < req.p_min:
                    break
            else:
                q_ids, q_probs = sampler.distribution(logits)
                # decide to stop before sampling, from q alone (q_probs[0] is its largest):
                # dropping a sampled guess after the fact would skew what is proposed away from q
                if req.p_min > 0.0 and q_probs[0] < req.p_min:
                    break
                token = int(q_ids[int(sampler.rng.choice(len(q_ids), p=q_probs))])
                ids.append(q_ids.astype(np.int32))
                probs.append(q_probs.astype(np.float32))
                lens.append(len(q_ids))
            tokens.append(token)
            if i + 1 < req.k and model.n_past + 1 < model.n_ctx:
                logits = model.decode([token])[0]
            else:
                break
        return Drafted(
            id=req.id,
            tokens=tokens,
            n_cached=model.n_past,
            q_ids=np.concatenate(ids) if ids else EMPTY_IDS,
            q_probs=np.concatenate(probs) if probs else EMPTY_PROBS,
            q_lens=lens,
            page_bytes=self.page_bytes,
        )


class DrafterLoop:
    """The drafter worker's sockets: the daemon's control channel and the target's draft channel."""

    def __init__(self, config: WorkerConfig, control: zmq.Socket):
        self.config = config
        self.control = control  # to the daemon: ready, shutdown
        self.drafts = control.context.socket(zmq.PAIR)  # to the target worker
        self.drafts.setsockopt(zmq.LINGER, 0)
        self.drafts.bind(config.draft_endpoint)
        os.chmod(config.draft_endpoint.removeprefix("ipc://"), 0o600)
        self.drafting: Optional[Drafting] = None

    def run(self) -> None:
        c = self.config
        try:
            model = load_model(c)
            info = describe_model(model, c, has_chat_template=False, vocab_digests=model.vocab_digests())
            arena = None
            if c.cache_shm:
                from ..cache.page_store import map_arena

                try:
                    arena = memoryview(map_arena(c.cache_shm, c.cache_bytes))
                except OSError as exc:
                    log.warning(
                        "the drafter keeps no prefix-cache pages: cannot use the arena %s (%s)", c.cache_shm, exc
                    )
            self.drafting = Drafting(model, c.settings.page_tokens, arena)
        except Exception as exc:
            error = Error.of(c.role, ErrorCode.NOT_READY, f"could not load the drafter: {exc}")
            self.control.send_multipart(encode(error))
            return
        self.control.send_multipart(encode(Ready(id=c.role, model=info, pid=os.getpid())))
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        poller.register(self.drafts, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll())
                if self.control in events:
                    msg = decode(self.control.recv_multipart(), table=DRAFTER_REQUESTS)
                    if isinstance(msg, Shutdown):
                        return
                if self.drafts in events:
                    self._serve(self.drafts.recv_multipart())
        finally:
            self.drafts.close()

    def _serve(self, frames) -> None:
        req = None
        try:
            req = decode(frames, table=DRAFTER_REQUESTS)
            if not isinstance(req, DraftRequest):
                return
            reply = self.drafting.draft(req)
        except ProtocolError as exc:
            reply = Error.of(exc.request_id, exc.code, exc.message)
        except Exception as exc:  # a llama.cpp failure: tell the target, keep serving
            log.exception("drafting failed")
            why = f"the drafter failed: {type(exc).__name__}: {exc}"
            reply = Error.of(req.id if req is not None else None, ErrorCode.INTERNAL, why)
        self.drafts.send_multipart(encode(reply))


def _softmax_prob(logits: np.ndarray, token: int) -> float:
    z = logits.astype(np.float64) - float(np.max(logits))
    e = np.exp(z)
    return float(e[token] / e.sum())
