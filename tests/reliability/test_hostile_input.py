"""Hostile input: the codec under hypothesis, and 10,000 malformed frames against
the live daemon. Each gets one typed error reply (or, past the hard size cap, the
connection is dropped), nothing changes, and memory comes back."""

from __future__ import annotations

import random
import string

import msgpack
import psutil
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.protocol import REPLIES, REQUESTS, Error, ErrorCode, Message, ProtocolError, decode, encode, endpoint
from tandem.protocol.messages import MAX_ID_CHARS, MAX_MESSAGE_BYTES, MAX_MESSAGES, MAX_STOP_STRINGS, Op

FUZZ_FRAMES = 10_000

# --------------------------------------------------------------------------- the codec, under hypothesis

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=40)
    | st.binary(max_size=40),
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=12), children, max_size=6),
    max_leaves=30,
)
field_names = st.sampled_from(
    [
        "id",
        "prompt",
        "messages",
        "max_tokens",
        "temperature",
        "top_k",
        "top_p",
        "seed",
        "stop",
        "stream",
        "draft",
        "draft_tokens",
        "cache",
        "request_id",
        "protocol_version",
        "ignore_eos",
        "role",
        "content",
        "x",
    ]
)
bodies = st.dictionaries(field_names, msgpack_values, max_size=8)
ops = st.sampled_from([o.value.encode() for o in Op]) | st.binary(max_size=12)


def check_decode(frames, **kw) -> None:
    """decode either returns a message that survives a round trip, or raises ProtocolError; nothing else."""
    try:
        msg = decode(frames, **kw)
    except ProtocolError as exc:
        assert isinstance(exc.code, ErrorCode) and exc.message
        return
    assert isinstance(msg, Message)
    assert decode(encode(msg), **kw) == msg


@pytest.mark.slow  # fuzzing: seconds to tens of seconds
@settings(max_examples=3000, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=4))
def test_any_bytes_decode_or_raise_protocol_error(frames):
    check_decode(frames)
    check_decode(frames, replies=True)


@pytest.mark.slow  # fuzzing: seconds to tens of seconds
@settings(max_examples=1500, deadline=None)
@given(ops, bodies)
def test_any_msgpack_map_under_any_op_decodes_or_raises_protocol_error(op, body):
    frames = [op, msgpack.packb(body, use_bin_type=True)]
    check_decode(frames)
    check_decode(frames, replies=True)


@pytest.mark.slow  # fuzzing: seconds to tens of seconds
@settings(max_examples=800, deadline=None)
@given(st.sampled_from(sorted(REQUESTS, key=lambda o: o.value)), bodies, st.data())
def test_truncated_or_corrupted_requests_raise_protocol_error(op, body, data):
    raw = msgpack.packb({"id": "r1", **body}, use_bin_type=True)
    cut = data.draw(st.integers(0, max(0, len(raw) - 1)))
    check_decode([op.value.encode(), raw[:cut]])
    flip = data.draw(st.integers(0, len(raw) - 1))
    corrupted = raw[:flip] + bytes([raw[flip] ^ data.draw(st.integers(1, 255))]) + raw[flip + 1 :]
    check_decode([op.value.encode(), corrupted])


def test_every_reply_op_is_refused_as_a_request():
    for op in REPLIES:
        if op in REQUESTS:
            continue  # the same name both ways (status, hello, cancel, ...)
        with pytest.raises(ProtocolError) as info:
            decode([op.value.encode(), msgpack.packb({"id": "x"})])
        assert info.value.code == ErrorCode.UNKNOWN_OP


# --------------------------------------------------------------------------- the live daemon


def malformed_frames(rng: random.Random, n: int):
    """n frames, each certainly invalid, from ten kinds of bad input; yields (kind, frames)."""

    def junk(k: int) -> bytes:
        return bytes(rng.getrandbits(8) for _ in range(k))

    def rid() -> str:
        return "f" + "".join(rng.choices(string.ascii_lowercase, k=8))

    def wrong_type():
        return rng.choice([None, True, 3.5, -7, "str", b"\x00\x01", [1, "a"], {"k": 1}, 2**64 - 1])

    kinds = []

    def kind(fn):
        kinds.append(fn)
        return fn

    @kind
    def frame_count():
        return [b"status"] if rng.random() < 0.5 else [b"status", msgpack.packb({"id": rid()}), junk(rng.randint(0, 9))]

    @kind
    def not_msgpack():
        return [rng.choice([b"generate", b"status", b"cancel"]), b"\xc1" + junk(rng.randint(0, 64))]

    @kind
    def not_a_map():
        return [b"generate", msgpack.packb(rng.choice([[1, 2], "text", 7, None, b"raw"]), use_bin_type=True)]

    @kind
    def truncated():
        full = msgpack.packb({"id": rid(), "prompt": "hello " * rng.randint(1, 50), "max_tokens": 4}, use_bin_type=True)
        return [b"generate", full[: rng.randint(1, len(full) - 1)]]

    @kind
    def unknown_op():
        op = rng.choice([b"explode", b"GENERATE", b"chunk", b"done", b"ready", b"draft", b"drafter_state", junk(6)])
        return [op, msgpack.packb({"id": rid(), "prompt": "x"}, use_bin_type=True)]

    invalid = {  # values each field refuses
        "prompt": [12, [1, "a"], {"k": 1}, b"\x00"],
        "max_tokens": ["ten", -1, [1], {"k": 1}, 3.5],
        "temperature": ["hot", -1.0, [1]],
        "top_k": ["k", -1, [1]],
        "top_p": ["p", 1.5, [1]],
        "stop": [[1, 2], 5, {"a": 1}],
        "seed": ["seed", [1], 3.5],
        "draft": ["sometimes", 1, [1]],
        "id": [12, None, [1], ""],
    }

    @kind
    def wrong_types():
        field = rng.choice([*invalid, "messages"])
        body = {"id": rid(), "prompt": "hello"}
        if field == "messages":
            body.pop("prompt")
            body["messages"] = [{"role": wrong_type(), "content": 3}]
        else:
            body[field] = rng.choice(invalid[field])
        return [b"generate", msgpack.packb(body, use_bin_type=True)]

    @kind
    def bad_version():
        return [b"hello", msgpack.packb({"id": rid(), "protocol_version": [rng.randint(2, 1000), 0]})]

    @kind
    def huge_fields():
        which = rng.choice(["id", "stop", "messages", "stop_text"])
        if which == "id":
            body = {"id": "i" * (MAX_ID_CHARS + 1 + rng.randint(0, 10_000)), "prompt": "x"}
        elif which == "stop":
            body = {"id": rid(), "prompt": "x", "stop": ["s"] * (MAX_STOP_STRINGS + 1 + rng.randint(0, 10_000))}
        elif which == "messages":
            body = {"id": rid(), "messages": [{"role": "user", "content": "m"}] * (MAX_MESSAGES + 1)}
        else:
            body = {"id": rid(), "prompt": "x", "stop": ["s" * 100_000]}
        return [b"generate", msgpack.packb(body, use_bin_type=True)]

    @kind
    def nested_bomb():
        return [b"status", b"\x81\xa2id" + b"\x91" * rng.randint(1_000, 50_000) + b"\xc0"]

    @kind
    def bad_extension():
        bad = rng.choice(
            [msgpack.ExtType(1, msgpack.packb(["|O", [1], b"x"])), msgpack.ExtType(1, junk(9)), msgpack.ExtType(9, b"")]
        )
        return [b"generate", msgpack.packb({"id": rid(), "prompt": bad}, use_bin_type=True)]

    for i in range(n):
        k = kinds[i % len(kinds)] if i < len(kinds) else rng.choice(kinds)
        yield k.__name__, k()


def rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def test_ten_thousand_malformed_frames_get_errors_and_change_nothing(start_daemon):
    d = start_daemon("--ctx-size", "512")
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 20_000)
    sock.connect(endpoint(d.socket))
    rng = random.Random(20261129)
    with d.client() as c:
        before = c.status()
        pid = before.pid

        def blast(frames_list) -> dict[str, int]:
            """Send in windows of 200, collect exactly one reply per frame: an error from the 1xx range."""
            codes: dict[str, int] = {}
            for start in range(0, len(frames_list), 200):
                window = frames_list[start : start + 200]
                for _, frames in window:
                    sock.send_multipart(frames)
                for kind, _ in window:
                    reply = decode(sock.recv_multipart(), replies=True)
                    assert isinstance(reply, Error), (kind, reply)
                    assert 100 <= reply.code < 200, (kind, reply)
                    codes[ErrorCode(reply.code).name] = codes.get(ErrorCode(reply.code).name, 0) + 1
            return codes

        blast(list(malformed_frames(rng, 500)))  # warm-up: allocator pools, first-use imports
        warm = rss(pid)
        frames_list = list(malformed_frames(rng, FUZZ_FRAMES))
        kinds = {k for k, _ in frames_list}
        codes = blast(frames_list)
        assert sum(codes.values()) == FUZZ_FRAMES and len(kinds) == 10
        assert set(codes) >= {"MALFORMED_MESSAGE", "UNKNOWN_OP", "INVALID_REQUEST", "UNSUPPORTED_VERSION"}
        with pytest.raises(zmq.Again):
            sock.recv_multipart(zmq.NOBLOCK)  # nothing extra: exactly one reply each
        after = c.status()
        grown = rss(pid) - warm
        print(
            f"\n{FUZZ_FRAMES} malformed frames: replies {codes}; daemon RSS {warm / 2**20:.1f} MiB -> "
            f"{rss(pid) / 2**20:.1f} MiB"
        )
        # nothing changed: no request counted, queued or run; the same worker; memory back near where it was
        assert after.requests == before.requests and after.queue_length == 0 and after.active is None
        assert after.worker_pids == before.worker_pids and after.state == "ready"
        assert grown < 16 * 2**20, f"daemon RSS grew {grown / 2**20:.1f} MiB"
        done = c.complete(prompt="After the storm,", max_tokens=6, ignore_eos=True)
        assert done.usage.completion_tokens == 6
    sock.close()


def test_a_frame_over_the_hard_cap_drops_that_connection_only(start_daemon):
    d = start_daemon("--ctx-size", "256")
    ctx = zmq.Context.instance()
    bad = ctx.socket(zmq.DEALER)
    bad.setsockopt(zmq.LINGER, 0)
    bad.setsockopt(zmq.RCVTIMEO, 3000)
    bad.connect(endpoint(d.socket))
    with d.client() as c:
        c.status()
        bad.send_multipart([b"generate", b"\x00" * (65 * 2**20)])  # over the 64 MiB ZMQ_MAXMSGSIZE
        with pytest.raises(zmq.Again):
            bad.recv_multipart()  # nothing was read, so nothing can be answered
        assert c.status().state == "ready"
        big = [b"generate", msgpack.packb({"id": "big", "prompt": "x" * (MAX_MESSAGE_BYTES + 10)}, use_bin_type=True)]
        ok = ctx.socket(zmq.DEALER)
        ok.setsockopt(zmq.LINGER, 0)
        ok.setsockopt(zmq.RCVTIMEO, 10_000)
        ok.connect(endpoint(d.socket))
        ok.send_multipart(big)  # over the protocol's 4 MiB but under the cap: a typed answer
        reply = decode(ok.recv_multipart(), replies=True)
        assert (
            isinstance(reply, Error) and reply.code == ErrorCode.MESSAGE_TOO_LARGE
        )  # id: not read from a body that size
        ok.close()
        assert c.complete(prompt="Fine:", max_tokens=2).usage.completion_tokens >= 1
    bad.close()
