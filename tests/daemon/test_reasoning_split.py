"""Reasoning models without a model: which thinking a template renders, the
real templates' rendering of the controls and of the history's thinking, the
split of a reply into thinking and answer, and the engine's budget (a scripted
stand-in model; tests/integration/test_reasoning.py runs a real one)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from tandem.daemon.constraints.tools import HERMES, message_dicts
from tandem.daemon.models import reasoning as R
from tandem.daemon.models.chat import ChatTemplate
from tandem.daemon.worker.engine import Engine
from tandem.daemon.worker.prompts import PromptBuilder
from tandem.protocol import (
    ChatMessage,
    FinishReason,
    FunctionCall,
    FunctionSpec,
    Generate,
    ResponseFormat,
    Tool,
    ToolCall,
)

TEMPLATES = Path(__file__).parent.parent / "templates"
# ChatTemplate renders with llama-cpp-python's Jinja formatter, which the model-free rerun (test_pure_imports)
# blocks: there these tests cannot run; they run in the main run
formatter = pytest.mark.skipif(
    bool(os.environ.get("TANDEM_TEST_WITHOUT_LLAMA_CPP")), reason="needs llama-cpp-python's Jinja formatter"
)
QWEN3 = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
R1 = (TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
GPT_OSS = (TEMPLATES / "openai-gpt-oss-120b.jinja").read_text()


def render(template: str, messages: list[ChatMessage], variables: dict | None = None) -> str:
    return ChatTemplate(template, "<bos>", "<eos>").render(message_dicts(messages, HERMES), None, variables)[0]


def split(splitter: R.Splitter, pieces) -> tuple[str, str]:
    thought = answer = ""
    for piece in pieces:
        r, a = splitter.feed(piece)
        thought, answer = thought + r, answer + a
    r, a = splitter.finish()
    return thought + r, answer + a


# --------------------------------------------------------------------------- templates


def test_the_families_are_told_apart_by_their_templates():
    assert R.detect(QWEN3) == R.THINK and R.detect(R1) == R.THINK and R.detect(GPT_OSS) == R.HARMONY
    qwen25 = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    assert R.detect(qwen25) == "" and R.detect(None) == ""


@formatter
def test_qwen3_renders_thinking_off_as_an_empty_block_and_on_as_nothing():
    user = [ChatMessage("user", "Hi")]
    on = render(QWEN3, user, R.template_variables(R.THINK, None, None))
    off = render(QWEN3, user, R.template_variables(R.THINK, False, None))
    assert on.endswith("<|im_start|>assistant\n")
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not R.opens_thinking(R.THINK, on) and not R.opens_thinking(R.THINK, off)


@formatter
def test_deepseek_r1_opens_the_thinking_in_the_prompt_unless_it_is_off():
    user = [ChatMessage("user", "Hi")]
    on = render(R1, user, R.template_variables(R.THINK, None, None))
    off = render(R1, user, R.template_variables(R.THINK, False, None))
    assert R.opens_thinking(R.THINK, on) and not R.opens_thinking(R.THINK, off)


@formatter
def test_gpt_oss_shows_the_effort_and_thinking_off_asks_for_low():
    user = [ChatMessage("user", "Hi")]
    assert "Reasoning: high" in render(GPT_OSS, user, R.template_variables(R.HARMONY, None, "high"))
    assert "Reasoning: low" in render(GPT_OSS, user, R.template_variables(R.HARMONY, False, None))
    assert render(GPT_OSS, user, {}).endswith("<|start|>assistant")


def _tool_turn(reasoning: str) -> list[ChatMessage]:
    call = ToolCall(id="call_1", function=FunctionCall("read_file", '{"path": "a.py"}'))
    return [
        ChatMessage("user", "Fix a.py"),
        ChatMessage("assistant", "", tool_calls=[call], reasoning=reasoning),
        ChatMessage("tool", "print(1)", tool_call_id="call_1", name="read_file"),
    ]


@formatter
def test_the_thinking_sent_back_is_shown_where_the_template_wants_it():
    """Qwen3 shows the thinking of the turns after the last user message (a tool loop), so the prompt
    re-renders what the model wrote and the prefix cache keeps serving it; gpt-oss shows a tool-call
    turn's analysis; an earlier turn's thinking, closed by a final answer, neither shows."""
    loop = _tool_turn("I should read the file.")
    assert "<think>\nI should read the file.\n</think>\n\n<tool_call>" in render(QWEN3, loop)
    assert "<|channel|>analysis<|message|>I should read the file.<|end|>" in render(GPT_OSS, loop)
    done = [*loop, ChatMessage("assistant", "Fixed.", reasoning="It prints 1."), ChatMessage("user", "Thanks")]
    assert "It prints 1." not in render(QWEN3, done) and "It prints 1." not in render(GPT_OSS, done)
    assert "I should read the file." not in render(GPT_OSS, done)  # (a final answer came after the call)


# --------------------------------------------------------------------------- splitting


THOUGHT = "<think>\nLet me see.\nTwo lines.\n</think>\n\nThe answer.\n\nMore."


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_think_tags_split_the_same_in_pieces_of_any_size(size):
    pieces = [THOUGHT[i : i + size] for i in range(0, len(THOUGHT), size)]
    assert split(R.ThinkSplitter(False), pieces) == ("Let me see.\nTwo lines.", "The answer.\n\nMore.")


def test_a_reply_inside_a_thinking_the_prompt_opened():
    assert split(R.ThinkSplitter(True), ["Hmm", ".\n</thi", "nk>\n\nYes"]) == ("Hmm.", "Yes")
    assert split(R.ThinkSplitter(True), ["cut in the mid", "dle"]) == ("cut in the middle", "")  # (max_tokens)


def test_a_think_tag_after_the_start_is_text():
    assert split(R.ThinkSplitter(False), ["Use ", "<think> tags"]) == ("", "Use <think> tags")
    assert split(R.ThinkSplitter(False), ["\n", "<thi"]) == ("", "<thi")  # (a tag's start, then the end)


def test_harmony_channels_split_by_their_markers():
    s = R.HarmonySplitter()
    out = [s.marker("<|channel|>"), s.feed("analysis"), s.marker("<|message|>"), s.feed("Think."), s.marker("<|end|>")]
    out += [s.marker("<|start|>"), s.feed("assistant"), s.marker("<|channel|>"), s.feed("final")]
    out += [s.marker("<|message|>"), s.feed("Answer."), s.finish()]
    assert "".join(r for r, _ in out) == "Think." and "".join(a for _, a in out) == "Answer."


@formatter
def test_a_harmony_model_that_writes_no_channel_is_all_answer():
    s = R.HarmonySplitter()
    assert split(s, ["plain ", "text"]) == ("", "plain text")


# --------------------------------------------------------------------------- the engine's budget


THINKING = (
    "{{ messages[0].content }}{% if enable_thinking %}<think>\n{% else %}<think>\n</think>\n\n{% endif %}"
    "{# reasoning_content #}"
)


def engine_run(model, drafter=None, **params):
    req = Generate(id="r", messages=[ChatMessage("user", "Q:")], temperature=0.0, **params)
    chunks = []
    template = ChatTemplate(THINKING, "", "")
    done = Engine(model, template, drafter, 4 if drafter is not None else 0, 0.0).run(req, chunks.append, lambda: False)
    return done, chunks


@formatter
def test_the_budget_ends_the_thinking_by_writing_its_closing(scripted_model):
    script = b"abcdefghijklmnopqrstuvwxyz0123456789"
    done, chunks = engine_run(scripted_model(script, n_ctx=128), max_thinking_tokens=5, max_tokens=30)
    closing = "\n</think>\n\n"
    assert done.reasoning == "abcde"
    # the model goes on after the closing, at the position the closing's tokens took
    assert done.text == script.decode()[5 + len(closing) :][: 30 - 5 - len(closing)]
    assert done.usage.reasoning_tokens == 5 + len("\n</think>")  # (the closing's tokens up to its tag: bytes here)
    assert "".join(c.reasoning for c in chunks) == done.reasoning and "".join(c.text for c in chunks) == done.text


@formatter
def test_the_budget_gives_the_same_output_with_drafting(scripted_model, list_drafter):
    """A round of drafts that runs past the budget is cut where it is spent: the output is the plain one."""
    script = b"abcdefghijklmnopqrstuvwxyz0123456789"
    plain, _ = engine_run(scripted_model(script, n_ctx=128), max_thinking_tokens=6, max_tokens=30)
    drafter = list_drafter(script, wrong_at=set())
    drafted, _ = engine_run(scripted_model(script, n_ctx=128), drafter, max_thinking_tokens=6, max_tokens=30)
    assert (drafted.reasoning, drafted.text) == (plain.reasoning, plain.text)


@formatter
def test_thinking_off_is_rendered_by_the_template(scripted_model):
    done, _ = engine_run(scripted_model(b"xyz", n_ctx=64), think=False)
    assert done.reasoning == "" and done.text == "xyz" and done.usage.reasoning_tokens == 0


@formatter
def test_a_constrained_output_is_written_without_thinking(scripted_model):
    """A response_format holds from the first token: the template is asked for no thinking, and a
    thinking the prompt opens anyway is closed at once (a budget of 0)."""
    builder = PromptBuilder(scripted_model(b"x"), ChatTemplate(THINKING, "", ""))
    json_req = Generate(id="r", messages=[ChatMessage("user", "Q")], response_format=ResponseFormat("json_object"))
    assert builder.thinking_controls(json_req) == (False, None) and builder.thinking_budget(json_req) == 0
    text_req = Generate(id="r", messages=[ChatMessage("user", "Q")], response_format=ResponseFormat("text"))
    assert builder.thinking_controls(text_req) == (None, None) and builder.thinking_budget(text_req) is None


@formatter
def test_max_tokens_inside_the_thinking_leaves_no_answer(scripted_model):
    done, _ = engine_run(scripted_model(b"abcdefgh", n_ctx=64), max_tokens=4)
    assert done.finish_reason == FinishReason.LENGTH and done.reasoning == "abcd" and done.text == ""


class HarmonyModel:
    """A scripted model whose vocabulary has harmony's markers as control tokens (ids 200+, no text)."""

    MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>", "<|return|>", "<|call|>")

    def __new__(cls, scripted_model, script: list[int]):
        model = scripted_model(bytes(1), n_ctx=128)
        model.script = script
        ids = {m: 200 + i for i, m in enumerate(cls.MARKERS)}

        def tokenize(text, add_special, parse_special=True):
            out = []
            while text:
                marker = next((m for m in ids if text.startswith(m)), None)
                if marker is not None and parse_special:
                    out.append(ids[marker])
                    text = text[len(marker) :]
                else:
                    out.append(text.encode()[0])
                    text = text[1:]
            return out

        model.tokenize = tokenize
        model.piece = lambda t: b"" if t >= 200 else bytes([t])
        model.is_eog = lambda t: t in (0, ids["<|return|>"], ids["<|call|>"])
        model.ids = ids
        return model


def harmony(ids: dict, *parts) -> list[int]:
    out: list[int] = []
    for p in parts:
        out += [ids[p]] if p in ids else list(p.encode())
    return out


@formatter
def test_harmony_replies_split_into_analysis_and_final(scripted_model):
    model = HarmonyModel(scripted_model, [])
    ids = model.ids
    model.script = harmony(ids, "<|channel|>", "analysis", "<|message|>", "Think.", "<|end|>", "<|start|>")
    model.script += harmony(ids, "assistant", "<|channel|>", "final", "<|message|>", "Done.", "<|return|>")
    req = Generate(id="r", messages=[ChatMessage("user", "Q")], temperature=0.0)
    template = ChatTemplate("{{ messages[0].content }}<|start|>assistant{# <|channel|><|message|> #}", "", "")
    done = Engine(model, template).run(req, lambda c: None, lambda: False)
    assert (done.reasoning, done.text, done.finish_reason) == ("Think.", "Done.", FinishReason.STOP)


@formatter
def test_a_harmony_budget_writes_the_switch_to_the_final_channel(scripted_model):
    model = HarmonyModel(scripted_model, [])
    model.script = harmony(model.ids, "<|channel|>", "analysis", "<|message|>", "abcdefghijklmnopqrstuvwxyz")
    req = Generate(id="r", messages=[ChatMessage("user", "Q")], temperature=0.0, max_thinking_tokens=4, max_tokens=40)
    template = ChatTemplate("{{ messages[0].content }}<|start|>assistant{# <|channel|><|message|> #}", "", "")
    done = Engine(model, template).run(req, lambda c: None, lambda: False)
    assert done.reasoning == "abc"  # (the <|message|> that opened it is the budget's first token)
    assert done.text and np.all([c.isalpha() for c in done.text])  # the model's own letters, in the final channel


def test_a_harmony_message_with_no_channel_name_is_answer():
    s = R.HarmonySplitter()
    out = [s.marker("<|channel|>"), s.marker("<|message|>"), s.feed("text"), s.finish()]
    assert "".join(a for _, a in out) == "text"


@pytest.mark.parametrize("max_tokens, n_ctx", [(3, 128), (40, 24)])
@formatter
def test_a_budget_with_no_room_for_its_closing_ends_with_length(scripted_model, max_tokens, n_ctx):
    """The closing and one more token must fit max_tokens and the context, else the request ends
    there: never more tokens than max_tokens, never past the context."""
    script = b"abcdefghijklmnopqrstuvwxyz0123456789"
    model = scripted_model(script, n_ctx=n_ctx)
    for budget in (0, 2):
        done, _ = engine_run(model, max_thinking_tokens=budget, max_tokens=max_tokens)
        assert done.finish_reason == FinishReason.LENGTH
        assert done.usage.completion_tokens <= max_tokens
        assert done.usage.prompt_tokens + done.usage.completion_tokens <= n_ctx
        model.clear()


@formatter
def test_thinking_is_off_for_a_budget_of_0_and_for_a_call_a_think_model_must_make(scripted_model, weather_tool):
    builder = PromptBuilder(scripted_model(b"x"), ChatTemplate(THINKING, "", ""))
    ask = [ChatMessage("user", "Q")]
    assert builder.thinking_controls(Generate(id="r", messages=ask, max_thinking_tokens=0))[0] is False
    builder.default_budget = 0
    assert builder.thinking_controls(Generate(id="r", messages=ask))[0] is False
    assert builder.thinking_controls(Generate(id="r", messages=ask, max_thinking_tokens=5))[0] is None
    builder.default_budget = None
    tools = [Tool(FunctionSpec(**weather_tool["function"]))]
    required = Generate(id="r", messages=ask, tools=tools, tool_choice="required")
    assert builder.thinking_controls(required)[0] is False and builder.thinking_budget(required) == 0
    assert builder.thinking_controls(Generate(id="r", messages=ask, tools=tools))[0] is None
