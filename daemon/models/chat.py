"""Rendering chat ``messages`` with the Jinja chat template stored in the GGUF file.

Uses llama-cpp-python's sandboxed Jinja2 formatter (the same rendering its
own chat API uses), fed with the model's BOS/EOS token texts. It is imported
when a template is compiled, so the engine imports no model runtime.
"""

from __future__ import annotations

from typing import Optional, Sequence


class ChatTemplateError(Exception):
    pass


class ChatTemplate:
    def __init__(self, template: str, bos_token: str, eos_token: str):
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        self.template = template
        try:
            self._formatter = Jinja2ChatFormatter(template=template, eos_token=eos_token, bos_token=bos_token)
        except Exception as exc:  # jinja2 raises TemplateSyntaxError and friends
            raise ChatTemplateError(f"the model's chat template does not compile: {exc}") from None

    def render(
        self, messages: Sequence[dict], tools: Optional[list[dict]] = None, variables: Optional[dict] = None
    ) -> tuple[str, bool]:
        """``messages`` as the template's maps (tools.message_dicts), ``tools`` in OpenAI's
        shape, ``variables`` more template variables (``enable_thinking``, ``reasoning_effort``)
        -> (prompt text, whether BOS/EOS should still be added when tokenizing)."""
        try:
            result = self._formatter(messages=list(messages), tools=tools or None, **(variables or {}))
        except Exception as exc:  # templates raise on roles they do not support, etc.
            raise ChatTemplateError(f"the model's chat template rejected these messages: {exc}") from None
        return result.prompt, not result.added_special
