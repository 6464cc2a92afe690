"""A reasoning-model test file: no small reasoning model can be had on these
machines, so a GGUF whose weights are Qwen2.5-Coder-0.5B's and whose chat
template and special tokens are reasoning families', rewritten with the
``gguf`` package. The templates in tests/templates are the families' own (as
llama.cpp keeps them in models/templates).

One file serves every family (so the daemon's load probe runs for it once):
its vocabulary has Qwen3's ``<think>``/``</think>`` (and ``<tool_response>``
tags) in the ids Qwen3 gives them, user-defined tokens as in Qwen3's GGUF (they
render as text), and gpt-oss's control tokens (``<|start|>``, ``<|channel|>``,
``<|message|>``, ``<|end|>``, ``<|return|>``, ``<|call|>``, ``<|constrain|>``)
in unused ids; llama.cpp takes ``<|return|>`` and ``<|call|>`` as end of
generation and, with them, not ``<|end|>``. Its own template is
DeepSeek-R1-Distill-Qwen's, whose generation prompt opens the thinking
(``<｜Assistant｜><think>`` and a line break); a daemon started with ``--chat-template-file``
renders another family's.

The weights never learnt these tokens: what the model writes is Qwen2.5's, so a
test asserts what the daemon does with it (rendering, splitting, budgets,
grammars, fields), not what a real reasoning model would say.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf

from tests.gguf_split import copy_gguf

TEMPLATES = Path(__file__).parent / "templates"
QWEN3, R1, GPT_OSS = (
    TEMPLATES / name
    for name in ("Qwen-Qwen3-0.6B.jinja", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "openai-gpt-oss-120b.jinja")
)
USER_DEFINED, CONTROL = 4, 3
HARMONY = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
TOKENS = {
    151665: ("<tool_response>", USER_DEFINED),
    151666: ("</tool_response>", USER_DEFINED),
    151667: ("<think>", USER_DEFINED),
    151668: ("</think>", USER_DEFINED),
    **{151669 + i: (text, CONTROL) for i, text in enumerate(HARMONY)},
}


def reasoning_gguf(source: Path, dest_dir: Path) -> Path:
    """``source`` (Qwen2.5's vocabulary) as the reasoning test model, written once into ``dest_dir``."""
    tokens = TOKENS
    dest = dest_dir / f"{source.stem}-reasoning.gguf"
    if dest.is_file():
        return dest
    dest_dir.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    partial = dest.with_suffix(".partial")
    template = R1.read_text()

    def value_of(field):
        value = field.contents()
        if field.name == "tokenizer.ggml.tokens":
            value = list(value)
            for token, (text, _) in tokens.items():
                value[token] = text
        elif field.name == "tokenizer.ggml.token_type":
            value = list(value)
            for token, (_, token_type) in tokens.items():
                value[token] = token_type
        elif field.name == "tokenizer.chat_template":
            value = template
        return value

    copy_gguf(reader, gguf.GGUFWriter(partial, arch), value_of)
    os.replace(partial, dest)
    return dest
