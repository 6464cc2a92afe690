"""Plain decoding of one request: the model-facing logic, free of sockets.

``Engine.run`` takes a validated ``Generate`` request and a model (anything
with the ``LlamaModel`` methods used here), and reports through two callbacks:
``emit(chunk)`` for each step of streamed output and ``should_cancel()`` asked
before every decode step, so a cancel ends the request within one step. It
returns the terminal ``Done`` or raises ``RequestError``.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Protocol, Sequence

import numpy as np

from tandem.protocol import Chunk, Done, ErrorCode, FinishReason, Generate, Timings, Usage

from .chat import ChatTemplate, ChatTemplateError
from .llama_model import DecodeAborted
from .sampler import Sampler
from .textstream import TextStream


class Model(Protocol):
    n_ctx: int
    n_ctx_train: int

    def tokenize(self, text: str, add_special: bool, parse_special: bool = True) -> list[int]: ...
    def piece(self, token: int) -> bytes: ...
    def is_eog(self, token: int) -> bool: ...
    def clear(self) -> None: ...
    def decode(
        self, tokens: Sequence[int], logits_for: Sequence[int] = (-1,), abort: Optional[Callable[[], bool]] = None
    ) -> np.ndarray: ...


class RequestError(Exception):
    """The request cannot be served as given; ends it with an ``error`` reply."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class Engine:
    def __init__(self, model: Model, chat_template: Optional[ChatTemplate], clock: Callable[[], float] = time.perf_counter):
        self.model = model
        self.chat_template = chat_template
        self.clock = clock

    def prompt_tokens(self, req: Generate) -> list[int]:
        if req.messages is not None:
            if self.chat_template is None:
                raise RequestError(
                    ErrorCode.CHAT_TEMPLATE,
                    "this model has no chat template in its GGUF file; send 'prompt' (plain text) instead of "
                    "'messages' (CLI: tandem run --raw)",
                )
            try:
                text, add_special = self.chat_template.render(req.messages)
            except ChatTemplateError as exc:
                raise RequestError(ErrorCode.CHAT_TEMPLATE, str(exc)) from None
            tokens = self.model.tokenize(text, add_special=add_special, parse_special=True)
        else:
            tokens = self.model.tokenize(req.prompt or "", add_special=True, parse_special=True)
        if not tokens:
            raise RequestError(ErrorCode.INVALID_REQUEST, "the prompt is empty (it tokenizes to no tokens)")
        if len(tokens) >= self.model.n_ctx:
            raise RequestError(
                ErrorCode.PROMPT_TOO_LONG,
                f"the prompt is {len(tokens):,} tokens but the context holds {self.model.n_ctx:,} "
                f"(and one more is needed to answer). Shorten the prompt, or restart the daemon with a larger "
                f"--ctx-size (this model was trained on {self.model.n_ctx_train:,}).",
            )
        return tokens

    def run(
        self,
        req: Generate,
        emit: Callable[[Chunk], None],
        should_cancel: Callable[[], bool],
    ) -> Done:
        started = self.clock()
        tokens = self.prompt_tokens(req)
        sampler = Sampler(req.temperature, req.top_k, req.top_p, req.seed)
        stream = TextStream(req.stop)
        model = self.model
        model.clear()
        try:
            logits = model.decode(tokens, abort=should_cancel)[0]  # a long prefill can be cancelled
        except DecodeAborted:
            return self._cancelled_in_prefill(req, len(tokens), started)
        prefilled = self.clock()
        completion: list[int] = []
        first_token_at: Optional[float] = None
        finish = FinishReason.LENGTH
        while True:
            token = sampler.sample(logits)
            if first_token_at is None:
                first_token_at = self.clock()
            if model.is_eog(token) and not req.ignore_eos:
                finish = FinishReason.STOP
                break
            completion.append(token)
            text = stream.push(model.piece(token))
            if req.stream:
                emit(Chunk(id=req.id, text=text, token_ids=[token]))
            if stream.stopped_by is not None:
                finish = FinishReason.STOP
                break
            if len(completion) >= req.max_tokens or len(tokens) + len(completion) >= model.n_ctx:
                finish = FinishReason.LENGTH
                break
            if should_cancel():
                finish = FinishReason.CANCELLED
                break
            logits = model.decode([token])[0]
        tail = stream.flush()
        if tail and req.stream:
            emit(Chunk(id=req.id, text=tail, token_ids=[]))
        finished = self.clock()
        generation_seconds = finished - first_token_at
        return Done(
            id=req.id,
            text=stream.text,
            finish_reason=finish,
            usage=Usage(prompt_tokens=len(tokens), completion_tokens=len(completion)),
            timings=Timings(
                time_to_first_token_seconds=first_token_at - started,
                prompt_seconds=prefilled - started,
                generation_seconds=generation_seconds,
                tokens_per_second=(len(completion) - 1) / generation_seconds
                if len(completion) > 1 and generation_seconds > 0
                else 0.0,
                queued_seconds=0.0,
            ),
        )

    def _cancelled_in_prefill(self, req: Generate, prompt_tokens: int, started: float) -> Done:
        elapsed = self.clock() - started
        return Done(
            id=req.id,
            text="",
            finish_reason=FinishReason.CANCELLED,
            usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=0),
            timings=Timings(0.0, elapsed, 0.0, 0.0, 0.0),
        )
