"""Model-free fixtures for the bridge's translation tests: the daemon's results
(tandem.protocol's Done and Chunk) as a test writes them, and a fake AsyncClient
that records what a GenRequest starts."""

from __future__ import annotations

import pytest

from tandem.protocol import Chunk, Done, FinishReason, FunctionCall, Timings, ToolCall, ToolCallDelta, Usage


def make_done(
    text: str = "",
    finish: FinishReason = FinishReason.STOP,
    calls: tuple = (),
    stop_sequence: str | None = None,
    prompt_tokens: int = 12,
    completion_tokens: int = 5,
    cached_tokens: int = 4,
) -> Done:
    """A Done as the daemon sends it: ``calls`` are (id, name, arguments text)."""
    return Done(
        id="req1",
        text=text,
        finish_reason=finish,
        usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, cached_tokens=cached_tokens),
        timings=Timings(
            time_to_first_token_seconds=0.25,
            prompt_seconds=0.125,
            generation_seconds=0.5,
            tokens_per_second=8.0,
            queued_seconds=0.0,
        ),
        tool_calls=[ToolCall(id=i, function=FunctionCall(name=n, arguments=a)) for i, n, a in calls],
        stop_sequence=stop_sequence,
    )


def make_chunk(text: str = "", deltas: tuple = ()) -> Chunk:
    """A Chunk: ``deltas`` are (index, arguments, id, name) pieces of tool calls."""
    return Chunk(
        id="req1",
        text=text,
        token_ids=[1],
        tool_calls=[ToolCallDelta(index=i, arguments=a, id=c, name=n) for i, a, c, n in deltas],
    )


@pytest.fixture
def done():
    return make_done


@pytest.fixture
def chunk():
    return make_chunk


class RecordingClient:
    """What GenRequest.start calls on an AsyncClient, recorded: (method, args, keyword arguments)."""

    def __init__(self):
        self.calls: list[tuple[str, tuple, dict]] = []

    async def generate(self, prompt=None, messages=None, **params):
        self.calls.append(("generate", (prompt, messages), params))
        return "stream"

    async def infill(self, prefix, suffix="", **params):
        self.calls.append(("infill", (prefix, suffix), params))
        return "stream"


@pytest.fixture
def recording_client():
    return RecordingClient()
