"""Every message round-trips through the codec; every malformed input gets a typed error."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import msgpack
import numpy as np
import pytest

import tandem.protocol as P
import tandem.protocol.internal as I
from tandem.protocol import ErrorCode, ProtocolError, decode, encode, packb, unpackb

MODEL = P.ModelInfo("m", "/m.gguf", 1024, 8192, 49152, 98_362_432, True)
PROBED = P.ModelInfo(
    "m",
    "/m.gguf",
    1024,
    8192,
    49152,
    98_362_432,
    True,
    batch_invariant=False,
    exact_steps=True,
    batch_variant_paths=["verify", "one_token"],
    kernels="reference",
    flash_attn=True,
)

REQUESTS = [
    P.Hello(id="h1", protocol_version=[1, 0], client_name="test"),
    P.Generate(id="g1", prompt="hello"),
    P.Generate(
        id="g2",
        messages=[P.ChatMessage("system", "be brief"), P.ChatMessage("user", "héllo 世界 🙂")],
        max_tokens=7,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        seed=2**64 - 1,
        stop=["\n\n", "END"],
        stream=False,
        ignore_eos=True,
    ),
    P.Complete(id="f1", prefix="def add(a, b):\n    return ", suffix="\n\nprint(add(1, 2))\n"),
    P.Complete(id="f2", prefix="", max_lines=3, stop_at_blank_line=False, draft="off", cache=False),
    P.Generate(
        id="g3",
        prompt="a person as JSON:",
        response_format=P.ResponseFormat(
            "json_schema", json_schema={"name": "p", "schema": {"type": "object"}, "strict": True}
        ),
    ),
    P.Generate(id="g4", prompt="a date:", response_format=P.ResponseFormat("regex", pattern=r"\d{4}-\d{2}-\d{2}")),
    P.Cancel(id="c1", request_id="g1"),
    P.Status(id="s1"),
    P.Shutdown(id="x1"),
    P.CacheClear(id="k1"),
    P.CacheClear(id="k2", memory_only=True),
    P.Tokenize(id="t1", text="def f():", with_pieces=True),
    P.Tokenize(id="t2", messages=[P.ChatMessage(role="user", content="Hi")], tools=[]),
    P.Tokenize(id="t3", messages=[P.ChatMessage(role="user", content="Hi")], tool_choice="none", think=False),
    P.Detokenize(id="d1", tokens=[1, 2, 3]),
    P.Embed(id="e1", input=["def f():", "héllo"], truncate=False, dimensions=64),
]

REPLIES = [
    P.HelloReply(id="h1", protocol_version=[1, 0], daemon_version="0.1.0", model="m", n_ctx=1024),
    P.Chunk(id="g1", text="wor", token_ids=[1, 2, 3]),
    P.Done(
        id="g1",
        text="world",
        finish_reason=P.FinishReason.LENGTH,
        usage=P.Usage(3, 5),
        timings=P.Timings(0.1, 0.05, 0.4, 10.0, 0.0),
    ),
    P.Done(
        id="g2",
        text="exact",
        finish_reason=P.FinishReason.STOP,
        usage=P.Usage(3, 1),
        timings=P.Timings(0.1, 0.05, 0.4, 10.0, 0.0),
        batch_invariant=True,
    ),
    P.Done(
        id="g2",
        text="x",
        finish_reason=P.FinishReason.STOP,
        usage=P.Usage(3, 1),
        timings=P.Timings(0.1, 0.05, 0.4, 10.0, 0.0),
        draft=P.DraftStats(3, 12, 9, 0.75, [3, 3, 2, 1], 4.0),
    ),
    P.Error.of("g1", ErrorCode.PROMPT_TOO_LONG, "too long"),
    P.Error.of(None, ErrorCode.MALFORMED_MESSAGE, "garbage"),
    P.Busy(id="g3", queue_length=16, max_queue=16, message="full"),
    P.CancelReply(id="c1", request_id="g1", found=True),
    P.StatusReply(
        id="s1",
        state="ready",
        daemon_version="0.1.0",
        pid=42,
        uptime_seconds=1.5,
        socket_path="/tmp/t.sock",
        model=MODEL,
        active=P.ActiveRequest(id="g1", elapsed_seconds=0.5, completion_tokens=9),
        queue_length=1,
        max_queue=16,
        requests={"done_stop": 2},
        tokens={"prompt": 10, "completion": 20},
        memory_rss_bytes={"daemon": 1, "target": 2},
        worker_pids={"target": 43},
        worker_restarts=0,
        drafter="qwen2.5-coder-0.5b",
        drafter_model=PROBED,
        draft_tokens=4,
        draft=P.DraftStats(1, 4, 2, 0.5, [1, 1], 3.0),
    ),
    P.ShutdownReply(id="x1"),
    P.CacheCleared(
        id="k1",
        pages=3,
        bytes=3 * 2**20,
        cache=P.CacheInfo(16, 0, 0, 2**30, 1, 2, 32, 8, 0, pages_total=100, page_bytes={"target": 2**20}),
    ),
    P.CacheCleared(id="k2", pages=0, bytes=0, cache=None),
    P.CacheCleared(id="k3", pages=2, bytes=2 << 20, disk_pages=5, disk_bytes=5 << 20, cache=None),
    P.Tokenized(id="t1", tokens=[755, 282], pieces=["def", " f"]),
    P.Detokenized(id="d1", text="abc"),
    P.Embedded(id="e1", model="m", embeddings=[[0.6, 0.8]], prompt_tokens=2, input_tokens=[2]),
]

WORKER_REPLIES = [  # worker -> daemon, besides the chunks, done, errors and cache_cleared it relays
    I.Ready(id="target", model=PROBED, pid=43),
    I.Progress(id="g1"),
    I.DrafterHung(id="g1", message="the drafter did not answer within 10 s"),
    I.CacheState(
        id="target",
        cache=P.CacheInfo(
            16,
            4,
            4 << 20,
            2**30,
            1,
            0,
            64,
            8,
            0,
            disk=P.DiskCacheInfo(
                "/home/u/.cache/tandem/kv/ab", "on", 4, 4 << 20, 4 << 30, 1, 64, 4, 0.01, 4, 4 << 20, 0.02, 0, 0
            ),
        ),
    ),
]


DRAFTER = [
    I.DraftRequest(
        id="g1", keep=10, append=[5, 6], k=4, sampling=I.SamplingParams(0.7, 40, 0.9, 3), p_min=0.1, new_request=True
    ),
    I.DraftRequest(
        id="g1",
        keep=32,
        append=[],
        k=0,
        sampling=I.SamplingParams(0.0, 0, 1.0, 3),
        store=[[0, 0], [16, 4096]],
        restore=[0, 4096],
    ),
]


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda m: type(m).__name__)
def test_request_round_trip(msg):
    frames = encode(msg)
    assert frames[0] == msg.op.value.encode()
    assert decode(frames) == msg


@pytest.mark.parametrize("msg", REPLIES, ids=lambda m: type(m).__name__)
def test_reply_round_trip(msg):
    assert decode(encode(msg), replies=True) == msg


@pytest.mark.parametrize("msg", WORKER_REPLIES, ids=lambda m: type(m).__name__)
def test_worker_reply_round_trip_and_clients_never_decode_one(msg):
    assert decode(encode(msg), table=I.WORKER_REPLIES) == msg
    with pytest.raises(ProtocolError) as info:
        decode(encode(msg), replies=True)  # what a client decodes has no internal messages
    assert info.value.code == ErrorCode.UNKNOWN_OP


def test_drafter_messages_round_trip_with_raw_arrays():
    for msg in DRAFTER:
        assert decode(encode(msg), table=I.DRAFTER_REQUESTS) == msg
    drafted = I.Drafted(
        id="g1",
        tokens=[7, 8],
        n_cached=12,
        q_ids=np.array([7, 1, 8], dtype=np.int32),
        q_probs=np.array([0.9, 0.1, 1.0], dtype=np.float32),
        q_lens=[2, 1],
    )
    frames = encode(drafted)
    assert b"\x80\x03" not in frames[1] and b"numpy" not in frames[1]  # no pickle protocol, no class names
    back = decode(frames, table=I.DRAFTER_REPLIES)
    assert back.tokens == [7, 8] and back.q_lens == [2, 1] and back.n_cached == 12
    assert np.array_equal(back.q_ids, drafted.q_ids) and back.q_probs.dtype == np.float32
    with pytest.raises(ProtocolError) as info:
        decode(encode(drafted))  # not a client request
    assert info.value.code == ErrorCode.UNKNOWN_OP


def test_worker_messages_round_trip_and_clients_cannot_send_them():
    msg = I.DrafterState(id="daemon", available=False)
    assert decode(encode(msg), table=I.WORKER_REQUESTS) == msg
    with pytest.raises(ProtocolError) as info:
        decode(encode(msg))  # the daemon's client-facing table has no drafter_state
    assert info.value.code == ErrorCode.UNKNOWN_OP


def test_every_message_type_is_covered():
    covered = {type(m) for m in REQUESTS + REPLIES + WORKER_REPLIES + DRAFTER} | {I.Drafted, I.DrafterState}
    tables = (P.REQUESTS, P.REPLIES, I.WORKER_REQUESTS, I.WORKER_REPLIES, I.DRAFTER_REQUESTS, I.DRAFTER_REPLIES)
    assert covered == {cls for table in tables for cls in table.values()}


def test_ndarray_round_trip_without_pickle():
    for arr in (np.arange(12, dtype=np.float32).reshape(3, 4), np.array([1, 2], dtype=np.int64), np.zeros(0)):
        back = unpackb(packb({"a": arr}))["a"]
        assert back.dtype == arr.dtype and back.shape == arr.shape and np.array_equal(back, arr)
    bad = msgpack.packb(msgpack.ExtType(1, msgpack.packb(["|O", [1], b"x"], use_bin_type=True)), use_bin_type=True)
    with pytest.raises(ValueError, match="object arrays"):
        unpackb(bad)


def body(**fields):
    return msgpack.packb(fields, use_bin_type=True)


BAD = [
    ("one frame", [b"status"], ErrorCode.MALFORMED_MESSAGE, "2 frames"),
    ("three frames", [b"", b"status", body(id="a")], ErrorCode.MALFORMED_MESSAGE, "2 frames"),
    ("not msgpack", [b"status", b"\xc1\xc1"], ErrorCode.MALFORMED_MESSAGE, "msgpack"),
    ("truncated msgpack", [b"status", body(id="abc")[:-2]], ErrorCode.MALFORMED_MESSAGE, "msgpack"),
    ("body not a map", [b"status", msgpack.packb([1, 2])], ErrorCode.MALFORMED_MESSAGE, "map"),
    ("unknown op", [b"launch", body(id="a")], ErrorCode.UNKNOWN_OP, "launch"),
    ("reply op sent as request", [b"done", body(id="a")], ErrorCode.UNKNOWN_OP, "known ops"),
    ("binary op", [b"\xff\xfe", body(id="a")], ErrorCode.UNKNOWN_OP, "unknown op"),
    ("missing id", [b"status", body()], ErrorCode.INVALID_REQUEST, "'id'"),
    ("empty id", [b"status", body(id="")], ErrorCode.INVALID_REQUEST, "'id'"),
    ("huge id", [b"status", body(id="x" * 1000)], ErrorCode.INVALID_REQUEST, "'id'"),
    ("id wrong type", [b"status", body(id=5)], ErrorCode.INVALID_REQUEST, "'id' must be a string"),
    ("no prompt", [b"generate", body(id="a")], ErrorCode.INVALID_REQUEST, "exactly one"),
    (
        "both prompt and messages",
        [b"generate", body(id="a", prompt="x", messages=[])],
        ErrorCode.INVALID_REQUEST,
        "exactly one",
    ),
    (
        "max_tokens string",
        [b"generate", body(id="a", prompt="x", max_tokens="9")],
        ErrorCode.INVALID_REQUEST,
        "'max_tokens' must be an integer",
    ),
    (
        "max_tokens bool",
        [b"generate", body(id="a", prompt="x", max_tokens=True)],
        ErrorCode.INVALID_REQUEST,
        "'max_tokens'",
    ),
    (
        "max_tokens zero",
        [b"generate", body(id="a", prompt="x", max_tokens=0)],
        ErrorCode.INVALID_REQUEST,
        "'max_tokens'",
    ),
    (
        "temperature negative",
        [b"generate", body(id="a", prompt="x", temperature=-1)],
        ErrorCode.INVALID_REQUEST,
        "'temperature'",
    ),
    (
        "temperature nan",
        [b"generate", body(id="a", prompt="x", temperature=float("nan"))],
        ErrorCode.INVALID_REQUEST,
        "'temperature'",
    ),
    ("top_p zero", [b"generate", body(id="a", prompt="x", top_p=0.0)], ErrorCode.INVALID_REQUEST, "'top_p'"),
    ("top_k negative", [b"generate", body(id="a", prompt="x", top_k=-3)], ErrorCode.INVALID_REQUEST, "'top_k'"),
    ("seed too big", [b"generate", body(id="a", prompt="x", seed=-1)], ErrorCode.INVALID_REQUEST, "'seed'"),
    (
        "stop not a list",
        [b"generate", body(id="a", prompt="x", stop="\n")],
        ErrorCode.INVALID_REQUEST,
        "'stop' must be a list",
    ),
    ("empty stop string", [b"generate", body(id="a", prompt="x", stop=[""])], ErrorCode.INVALID_REQUEST, "'stop'"),
    ("too many stops", [b"generate", body(id="a", prompt="x", stop=["a"] * 17)], ErrorCode.INVALID_REQUEST, "'stop'"),
    (
        "message not a map",
        [b"generate", body(id="a", messages=["hi"])],
        ErrorCode.INVALID_REQUEST,
        "'messages[0]' must be a map",
    ),
    (
        "message role missing",
        [b"generate", body(id="a", messages=[{"content": "hi"}])],
        ErrorCode.INVALID_REQUEST,
        "messages[0].role",
    ),
    (
        "message content int",
        [b"generate", body(id="a", messages=[{"role": "user", "content": 3}])],
        ErrorCode.INVALID_REQUEST,
        "messages[0].content",
    ),
    ("empty messages", [b"generate", body(id="a", messages=[])], ErrorCode.INVALID_REQUEST, "empty"),
    (
        "null prompt and stream",
        [b"generate", body(id="a", prompt="x", stream=None)],
        ErrorCode.INVALID_REQUEST,
        "'stream'",
    ),
    ("cancel without target", [b"cancel", body(id="a")], ErrorCode.INVALID_REQUEST, "request_id"),
    (
        "hello version not ints",
        [b"hello", body(id="a", protocol_version=["1", 0])],
        ErrorCode.INVALID_REQUEST,
        "protocol_version[0]",
    ),
    (
        "hello version too long",
        [b"hello", body(id="a", protocol_version=[1] * 1000)],
        ErrorCode.INVALID_REQUEST,
        "[major, minor]",
    ),
    (
        "draft_tokens too big",
        [b"generate", body(id="a", prompt="x", draft_tokens=99)],
        ErrorCode.INVALID_REQUEST,
        "'draft_tokens'",
    ),
    (
        "draft_p_min too big",
        [b"generate", body(id="a", prompt="x", draft_p_min=1.5)],
        ErrorCode.INVALID_REQUEST,
        "'draft_p_min'",
    ),
    (
        "complete without prefix",
        [b"complete", body(id="a", suffix="x")],
        ErrorCode.INVALID_REQUEST,
        "missing field 'prefix'",
    ),
    (
        "complete prefix not text",
        [b"complete", body(id="a", prefix=b"x")],
        ErrorCode.INVALID_REQUEST,
        "'prefix' must be a string",
    ),
    (
        "complete max_lines negative",
        [b"complete", body(id="a", prefix="x", max_lines=-1)],
        ErrorCode.INVALID_REQUEST,
        "'max_lines'",
    ),
    (
        "complete shares generate's checks",
        [b"complete", body(id="a", prefix="x", top_p=0.0)],
        ErrorCode.INVALID_REQUEST,
        "'top_p'",
    ),
    (
        "too large",
        [b"generate", body(id="a", prompt="x" * (P.MAX_MESSAGE_BYTES + 1))],
        ErrorCode.MESSAGE_TOO_LARGE,
        "limit",
    ),
    ("map with int keys", [b"status", msgpack.packb({1: 2})], ErrorCode.MALFORMED_MESSAGE, "msgpack"),
]


@pytest.mark.parametrize("frames,code,fragment", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_malformed_input_gets_a_typed_error(frames, code, fragment):
    with pytest.raises(ProtocolError) as info:
        decode(frames)
    assert info.value.code == code
    assert fragment in info.value.message


def test_error_keeps_the_request_id_when_readable():
    with pytest.raises(ProtocolError) as info:
        decode([b"generate", body(id="keep-me", prompt="x", max_tokens=-5)])
    assert info.value.request_id == "keep-me"


def test_unknown_fields_are_ignored_for_forward_compatibility():
    msg = decode([b"generate", body(id="a", prompt="x", some_future_field=[1, 2])])
    assert msg == P.Generate(id="a", prompt="x")


def test_protocol_md_documents_every_op_field_and_error_code():
    doc = (Path(P.__file__).parent / "PROTOCOL.md").read_text()
    for op in P.Op:
        assert f"`{op.value}`" in doc, op
    for code in ErrorCode:
        assert re.search(rf"\b{int(code)}\b.*`{code.name}`", doc), code
    tables = (P.REQUESTS, P.REPLIES, I.WORKER_REQUESTS, I.WORKER_REPLIES, I.DRAFTER_REQUESTS, I.DRAFTER_REPLIES)
    nested = [P.DraftStats, P.GovernorInfo, P.CacheInfo, P.ResponseFormat, I.SamplingParams]
    for cls in [*(cls for table in tables for cls in table.values()), *nested]:
        for f in dataclasses.fields(cls):
            assert f"`{f.name}`" in doc, f"{cls.__name__}.{f.name}"
    assert f"{P.PROTOCOL_VERSION[0]}.{P.PROTOCOL_VERSION[1]}" in doc


def test_tokenize_takes_the_rendering_fields_with_messages_only():
    chat = [P.ChatMessage(role="user", content="Hi")]
    P.Tokenize(id="t", messages=chat, tool_choice="required", think=True, reasoning_effort="low").check()
    for field in ({"tool_choice": "none"}, {"think": False}, {"max_thinking_tokens": 0}):
        with pytest.raises(ValueError, match="go with 'messages'"):
            P.Tokenize(id="t", text="Hi", **field).check()
