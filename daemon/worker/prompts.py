"""A request's prompt as the model reads it: a chat rendered with the GGUF's chat
template (with tools, taught the way the template teaches them), plain text, or
a fill-in-the-middle prompt from the model's own FIM tokens. The engine asks
``PromptBuilder.prompt_tokens`` for every request it decodes, and the worker for
a ``tokenize`` that counts a request's prompt."""

from __future__ import annotations

from typing import Optional

from tandem.protocol import FIM_FIX, Complete, Decoding, ErrorCode, Generate

from ..constraints.tools import GENERIC, HARMONY, ToolPlan, detect_format, make_plan, message_dicts, tool_dict
from ..constraints.tools import with_generic_prompt as _generic_prompt
from ..drafting.interfaces import Model, RequestError
from ..models import reasoning as reasoning_formats
from ..models.chat import ChatTemplate, ChatTemplateError


class PromptBuilder:
    """The prompts of one model's requests, with its chat template (None: its GGUF has none)."""

    def __init__(self, model: Model, chat_template: Optional[ChatTemplate]):
        self.model = model
        self.chat_template = chat_template
        # the tool-call syntax the chat template teaches (tools.py)
        self.tool_format = detect_format(chat_template.template if chat_template is not None else None)
        # the thinking the template renders (reasoning.py): "think", "harmony" or ""
        self.reasoning_kind = reasoning_formats.detect(chat_template.template if chat_template is not None else None)
        self.reasoning = reasoning_formats.Reasoning.of(self.reasoning_kind, self._single_token)
        self.opens_thinking = False  # the last chat prompt built left the model inside its thinking
        self.default_budget: Optional[int] = None  # --thinking-budget (None: -1, no budget)

    def tool_plan(self, req: Decoding) -> Optional[ToolPlan]:
        if not isinstance(req, Generate):
            return None
        return make_plan(req, self.tool_format, self._single_token)

    def _single_token(self, text: str) -> Optional[int]:
        tokens = self.model.tokenize(text, add_special=False, parse_special=True)
        return tokens[0] if len(tokens) == 1 else None

    def prompt_tokens(self, req: Decoding, plan: Optional[ToolPlan] = None, check_fits: bool = True) -> list[int]:
        """The request's prompt as the model reads it; PROMPT_TOO_LONG when it
        cannot fit the context (unless ``check_fits`` is False: a count)."""
        if isinstance(req, Complete):
            tokens = self.fim_prompt(req)
        elif req.messages is not None:
            if self.chat_template is None:
                raise RequestError(
                    ErrorCode.CHAT_TEMPLATE,
                    "this model has no chat template in its GGUF file; send 'prompt' (plain text) instead of "
                    "'messages' (CLI: tandem run --raw)",
                )
            messages = message_dicts(req.messages, self.tool_format)
            tools = None
            if plan is not None and self.tool_format == GENERIC:
                messages = _generic_prompt(messages, plan.tools)
            elif plan is not None:
                tools = [tool_dict(t) for t in plan.tools]
                if self.tool_format == HARMONY:  # (gpt-oss's template writes every tool's description)
                    for tool in tools:
                        tool["function"].setdefault("description", "")
            variables = reasoning_formats.template_variables(self.reasoning_kind, *self.thinking_controls(req))
            try:
                text, add_special = self.chat_template.render(messages, tools, variables)
            except ChatTemplateError as exc:
                raise RequestError(ErrorCode.CHAT_TEMPLATE, str(exc)) from None
            self.opens_thinking = reasoning_formats.opens_thinking(self.reasoning_kind, text)
            tokens = self.model.tokenize(text, add_special=add_special, parse_special=True)
        else:
            tokens = self.model.tokenize(req.prompt or "", add_special=True, parse_special=True)
        if not tokens:
            raise RequestError(ErrorCode.INVALID_REQUEST, "the prompt is empty (it tokenizes to no tokens)")
        if check_fits and len(tokens) >= self.model.n_ctx:
            raise RequestError(
                ErrorCode.PROMPT_TOO_LONG,
                f"the prompt is {len(tokens):,} tokens but the context holds {self.model.n_ctx:,} "
                f"(and one more is needed to answer). Shorten the prompt, or restart the daemon with a larger "
                f"--ctx-size (this model was trained on {self.model.n_ctx_train:,}).",
            )
        return tokens

    def thinking_controls(self, req: Generate) -> tuple[Optional[bool], Optional[str]]:
        """(think, reasoning_effort) as the template gets them. Thinking is off for a
        constrained output (a response_format other than text: its grammar holds from the
        first token), for a call a <think> model must make (required or a named tool: the
        same), and for a budget of 0."""
        think = req.think
        rf = req.response_format
        if rf is not None and rf.type != "text":
            think = False
        if self.reasoning_kind == reasoning_formats.THINK and req.tool_choice_name() not in (None, "none", "auto"):
            think = False
        budget = req.max_thinking_tokens if req.max_thinking_tokens is not None else self.default_budget
        if budget == 0:
            think = False
        return think, req.reasoning_effort

    def thinking_budget(self, req: Decoding) -> Optional[int]:
        """How many tokens the request may think (None: no limit but max_tokens)."""
        if not isinstance(req, Generate) or self.reasoning is None or req.messages is None:
            return None
        if self.thinking_controls(req)[0] is False:
            return 0
        return req.max_thinking_tokens if req.max_thinking_tokens is not None else self.default_budget

    def fim_prompt(self, req: Complete) -> list[int]:
        """``<prefix token> prefix <suffix token> suffix <middle token>`` (the model
        writes the middle), from the model's own FIM tokens. The two texts are
        tokenized as plain text, so a file that contains the FIM tokens' spelling
        cannot inject them. A file too long for the context keeps the prefix's end
        (the code right before the cursor) and the suffix's start, leaving room to
        answer: an editor should not have to know the context size."""
        model = self.model
        fim = model.fim_tokens()
        if fim is None:
            raise RequestError(
                ErrorCode.FIM_UNSUPPORTED,
                "this model has no fill-in-the-middle tokens in its vocabulary, so 'complete' cannot prompt it. "
                f"{FIM_FIX}",
            )
        pre, suf, mid = fim
        head = model.tokenize("", add_special=True, parse_special=False)  # BOS, for models that want one
        prefix = model.tokenize(req.prefix, add_special=False, parse_special=False)
        suffix = model.tokenize(req.suffix, add_special=False, parse_special=False)
        room = max(0, model.n_ctx - len(head) - 3 - min(req.max_tokens, model.n_ctx // 4))
        if len(prefix) + len(suffix) > room:
            keep_suffix = min(len(suffix), max(room // 4, room - len(prefix)))
            suffix = suffix[:keep_suffix]
            prefix = prefix[len(prefix) - (room - keep_suffix) :] if room > keep_suffix else []
        return [*head, pre, *prefix, suf, *suffix, mid]
