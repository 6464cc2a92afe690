"""Reasoning models: which thinking a chat template renders, the template
variables that control it, and the split of a reply into its thinking and its
answer as the tokens arrive.

Two families, told apart by the template itself (as llama.cpp's chat code does):

- ``think``: the thinking between ``<think>`` and ``</think>`` (Qwen3, QwQ,
  DeepSeek-R1 and their distills). Some templates open the tag in the prompt
  (DeepSeek-R1's ``<｜Assistant｜><think>\\n``), so the reply starts inside
  it; Qwen3 takes ``enable_thinking`` and renders an empty block when it is off.
- ``harmony``: gpt-oss's channels. The reply is a sequence of messages
  ``<|channel|>NAME<|message|>TEXT<|end|><|start|>assistant...``; the
  ``analysis`` channel is the thinking, ``final`` (and ``commentary`` without a
  recipient) the answer. The markers are control tokens, which render as no
  text: the splitter is fed them by token (``Splitter.marker``).

The daemon ends a thinking that reached its budget by writing the closing for
the model (``Reasoning.close``) and letting it go on from there, as llama.cpp's
``--reasoning-budget`` and vLLM's thinking budgets do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from ..worker.textstream import held_suffix

THINK = "think"
HARMONY = "harmony"

OPEN_THINK, CLOSE_THINK = "<think>", "</think>"
HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>", "<|return|>", "<|call|>")
ANSWER_CHANNELS = ("final", "commentary")
RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")  # a harmony header's call: "... to=functions.NAME ..."
FORCED_CALL = "<|end|><|start|>assistant<|channel|>commentary to=functions."  # a budget's end where a call must come
FINAL_CHANNEL = "<|channel|>final<|message|>"  # opened for a constrained output (its grammar holds from there)


def detect(template: Optional[str]) -> str:
    """The thinking ``template`` renders: THINK, HARMONY or "" (none)."""
    if not template:
        return ""
    if "<|channel|>" in template and "<|message|>" in template:
        return HARMONY
    if CLOSE_THINK in template or "enable_thinking" in template or "reasoning_content" in template:
        return THINK
    return ""


def template_variables(kind: str, think: Optional[bool], effort: Optional[str]) -> dict:
    """The variables a request's controls set for the template (a template
    ignores what it does not use): ``enable_thinking`` (Qwen3, DeepSeek-R1's
    llama.cpp template; on unless ``think`` is False: a template that reads it
    unset as off would otherwise never think) and ``reasoning_effort`` (gpt-oss)."""
    out: dict = {}
    if not kind:
        return out
    out["enable_thinking"] = think is not False  # (on unless turned off, as llama-server renders them)
    if effort is not None:
        out["reasoning_effort"] = effort
    elif kind == HARMONY and think is False:
        out["reasoning_effort"] = "low"  # gpt-oss always thinks: as little as it can, then the budget of 0 ends it
    return out


def opens_thinking(kind: str, prompt: str) -> bool:
    """The rendered prompt leaves the model inside its thinking (the template opened the tag)."""
    if kind != THINK:
        return False
    tail = prompt.rstrip()
    return tail.endswith(OPEN_THINK)


@dataclass(frozen=True)
class Reasoning:
    """A model's thinking format: its kind, the text that closes a thinking
    (written for the model when the budget is spent), and its harmony marker
    token ids (control tokens, which a piece does not spell)."""

    kind: str
    close: str
    markers: dict  # token id -> marker text (harmony); {} for THINK

    @classmethod
    def of(cls, kind: str, token_of) -> Optional["Reasoning"]:
        """``token_of(text)`` -> the single token that spells ``text``, or None."""
        if kind == THINK:
            return cls(THINK, "\n" + CLOSE_THINK + "\n\n", {})
        if kind == HARMONY:
            markers = {}
            for text in HARMONY_MARKERS:
                token = token_of(text)
                if token is not None:
                    markers[token] = text
            return cls(HARMONY, "<|end|><|start|>assistant<|channel|>final<|message|>", markers)
        return None

    def splitter(self, thinking: bool) -> "Splitter":
        return HarmonySplitter() if self.kind == HARMONY else ThinkSplitter(thinking)


class Splitter:
    """Text of a reply in, (thinking, answer) out; ``thinking`` says where the
    next token's text goes."""

    thinking: bool = False

    def feed(self, text: str) -> tuple[str, str]:
        raise NotImplementedError

    def marker(self, text: str) -> tuple[str, str]:
        """A control token that is part of the format (harmony); the text it spells."""
        return self.feed(text)

    def finish(self) -> tuple[str, str]:
        raise NotImplementedError


class ThinkSplitter(Splitter):
    """``<think>`` ... ``</think>``. A reply may open its thinking only at its
    start (after blank space), as these models do; ``thinking`` True: the
    prompt opened it. The line breaks around the tags belong to neither part."""

    def __init__(self, thinking: bool):
        self.thinking = thinking
        self.started = thinking  # past the point where a reply can open its thinking
        self._held = ""  # text that may be the start of a tag, or line breaks that may precede one
        self._fresh = True  # at the start of a part: its leading line breaks are dropped

    def feed(self, text: str) -> tuple[str, str]:
        pending = self._held + text
        self._held = ""
        thought, answer = [], []
        while pending:
            if self._fresh:
                pending = pending.lstrip("\n")
                if not pending:
                    break
            if not self.started:
                stripped = pending.lstrip()
                if OPEN_THINK.startswith(stripped):  # (blank, or a tag's start)
                    self._held = pending
                    break
                self.started = True
                if stripped.startswith(OPEN_THINK):
                    self.thinking, self._fresh = True, True
                    pending = stripped[len(OPEN_THINK) :]
                continue
            self._fresh = False
            if not self.thinking:
                answer.append(pending)
                break
            at = pending.find(CLOSE_THINK)
            if at >= 0:
                thought.append(pending[:at].rstrip("\n"))
                pending = pending[at + len(CLOSE_THINK) :]
                self.thinking, self._fresh = False, True
                continue
            free = pending[: len(pending) - held_suffix(pending, (CLOSE_THINK,))].rstrip("\n")
            thought.append(free)
            self._held = pending[len(free) :]
            break
        return "".join(thought), "".join(answer)

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self.thinking:
            return held, ""
        return "", held if self.started else held.strip()


class HarmonySplitter(Splitter):
    """gpt-oss's channels: the reply starts in a message header (the prompt
    ends with ``<|start|>assistant``); ``<|message|>`` opens the body of the
    channel the header named; ``<|end|>`` ends it. A body with no header
    channel is answer."""

    def __init__(self) -> None:
        self.header: Optional[str] = ""  # None: in a body
        self.channel = ""
        self.thinking = False
        self.bodies = 0  # messages opened so far
        self.recipient: Optional[str] = None  # the body open now is a call of this function
        self.arguments = ""  # ... and its text so far
        self.call: Optional[tuple[str, str]] = None  # (name, arguments) of the call the reply ended in

    def feed(self, text: str) -> tuple[str, str]:
        if self.header is not None:
            self.header += text
            return "", ""
        if self.recipient is not None:
            self.arguments += text
            return "", ""
        return (text, "") if self.thinking else ("", text)

    def marker(self, text: str) -> tuple[str, str]:
        if text == "<|message|>" and self.header is not None:
            header, self.header = self.header, None
            channel = (header.split("<|channel|>")[-1].split() or [""])[0] if "<|channel|>" in header else ""
            self.channel = channel.strip()
            self.thinking = self.channel == "analysis"
            self.bodies += 1
            called = RECIPIENT.search(header)
            self.recipient, self.arguments = (called.group(1), "") if called else (None, "")
        elif text in ("<|end|>", "<|start|>", "<|return|>", "<|call|>"):
            self.header, self.thinking, self.recipient = "", False, None
        elif self.header is not None:
            self.header += text
        return "", ""

    def finish(self) -> tuple[str, str]:
        """A reply that never opened a message (not in the format at all) is all answer; one that
        ends inside a call's body (its ``<|call|>`` ends generation) leaves that call in ``call``."""
        if self.recipient is not None:
            self.call = (self.recipient, self.arguments.strip())
        if not self.bodies and self.header:
            return "", self.header
        return "", ""
