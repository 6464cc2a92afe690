"""What both clients share, without a socket: request builders, terminal replies, routing, stream state."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tandem.client import core
from tandem.client.core import ReplyRouter, StreamState
from tandem.client.errors import (
    DaemonNotRunning,
    InvalidRequest,
    QueueFull,
    RequestFailed,
    TandemError,
    UntrustedSocket,
)
from tandem.protocol import (
    PROTOCOL_VERSION,
    Busy,
    Cancel,
    CancelReply,
    ChatMessage,
    Chunk,
    Complete,
    Done,
    Error,
    ErrorCode,
    FinishReason,
    Generate,
    Status,
    Timings,
    Usage,
    decode,
    encode,
)


def done(request_id: str, text: str = "ok") -> Done:
    return Done(
        id=request_id,
        text=text,
        finish_reason=FinishReason.STOP,
        usage=Usage(2, 1),
        timings=Timings(0.01, 0.01, 0.0, 0.0, 0.0),
    )


# --------------------------------------------------------------------------- request builders


def test_generate_request_builds_a_checked_generate_with_the_params():
    req = core.generate_request("hi", max_tokens=7, temperature=0.0, stop=["\n"], seed=3)
    assert isinstance(req, Generate)
    assert (req.prompt, req.messages, req.max_tokens) == ("hi", None, 7)
    assert (req.temperature, req.stop, req.seed) == (0.0, ["\n"], 3)
    assert len(req.id) == 32 and req.id != core.generate_request("hi").id  # a fresh uuid4 hex each time


def test_generate_request_turns_message_dicts_into_chat_messages_and_keeps_chat_messages():
    given = ChatMessage("system", "be brief")
    req = core.generate_request(messages=[given, {"role": "user", "content": "Hi"}])
    assert req.prompt is None
    assert req.messages == [ChatMessage("system", "be brief"), ChatMessage("user", "Hi")]
    assert req.messages[0] is given


def test_generate_request_uses_a_given_request_id_and_makes_one_for_an_empty_one():
    assert core.generate_request("x", request_id="mine").id == "mine"
    assert len(core.generate_request("x", request_id="").id) == 32


def test_the_built_request_encodes_and_the_daemon_side_decodes_it_unchanged():
    req = core.generate_request(messages=[{"role": "user", "content": "Hi"}], top_k=0, draft="off")
    assert decode(encode(req)) == req


@pytest.mark.parametrize(
    "args, params, fragment",
    [
        ((None,), {}, "exactly one of 'prompt'"),
        (("p",), {"messages": [{"role": "user", "content": "x"}]}, "exactly one of 'prompt'"),
        ((None,), {"messages": []}, "'messages' is empty"),
        (("p",), {"max_tokens": 0}, "'max_tokens'"),
        (("p",), {"temperature": -1.0}, "'temperature' must be between 0 and 100, got -1.0"),
        (("p",), {"temperature": float("nan")}, "'temperature'"),
        (("p",), {"top_k": -1}, "'top_k' must be >= 0"),
        (("p",), {"top_p": 0.0}, "'top_p' must be in (0, 1]"),
        (("p",), {"seed": -1}, "'seed'"),
        (("p",), {"stop": [""]}, "each 'stop' string"),
        (("p",), {"stop": ["s"] * 17}, "'stop' has 17 strings"),
        (("p",), {"draft_tokens": 17}, "'draft_tokens' must be between 0 and 16"),
        (("p",), {"draft": "sometimes"}, "'draft' must be one of auto, on, off"),
    ],
)
def test_generate_request_refuses_bad_params_with_invalid_request_naming_them(args, params, fragment):
    messages = params.pop("messages", None)
    with pytest.raises(InvalidRequest) as info:
        core.generate_request(*args, messages=messages, **params)
    assert str(info.value).startswith("invalid request: ")
    assert fragment in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__  # `from None`: no ValueError chained


def test_complete_request_builds_a_complete_with_infill_defaults():
    req = core.complete_request("def f():\n    return ", "\n", max_lines=2, request_id="c1")
    assert isinstance(req, Complete)
    assert (req.id, req.prefix, req.suffix, req.max_lines) == ("c1", "def f():\n    return ", "\n", 2)
    assert (req.max_tokens, req.temperature, req.stop_at_blank_line) == (128, 0.0, True)
    assert core.complete_request("x").suffix == ""


@pytest.mark.parametrize(
    "params, fragment",
    [
        ({"max_lines": -1}, "'max_lines' must be between 0 (no limit) and 10000"),
        ({"max_lines": 10_001}, "'max_lines'"),
        ({"top_p": 1.5}, "'top_p'"),
    ],
)
def test_complete_request_refuses_bad_params_with_invalid_request(params, fragment):
    with pytest.raises(InvalidRequest, match="^invalid request: ") as info:
        core.complete_request("x", **params)
    assert fragment in str(info.value)


def test_hello_request_offers_this_clients_protocol_version():
    hello = core.hello_request()
    assert hello.protocol_version == list(PROTOCOL_VERSION)
    assert hello.client_name == "tandem-python"
    assert hello.id != core.hello_request().id


# --------------------------------------------------------------------------- socket location


def test_resolve_socket_takes_a_given_path_or_the_default(monkeypatch, tmp_path):
    assert core.resolve_socket("/x/y.sock") == Path("/x/y.sock")
    assert core.resolve_socket(tmp_path / "a.sock") == tmp_path / "a.sock"
    monkeypatch.setenv("TANDEM_SOCKET", str(tmp_path / "env.sock"))
    assert core.resolve_socket(None) == tmp_path / "env.sock"


def test_check_socket_exists_raises_daemon_not_running_naming_the_path_and_the_fix(tmp_path):
    missing = tmp_path / "none.sock"
    with pytest.raises(DaemonNotRunning) as info:
        core.check_socket_exists(missing)
    assert str(missing) in str(info.value)
    assert "tandem serve" in str(info.value)
    present = tmp_path / "there.sock"
    with socket.socket(socket.AF_UNIX) as listener:  # a socket with nothing accepting: zmq will say so
        listener.bind(str(present))
        assert core.check_socket_exists(present) is None
        link = tmp_path / "link.sock"
        link.symlink_to(present)
        with pytest.raises(UntrustedSocket, match="is not a socket \\(a symbolic link\\)"):
            core.check_socket_exists(link)  # never followed: it could point at anyone's socket
    plain = tmp_path / "file.sock"
    plain.touch()
    with pytest.raises(UntrustedSocket, match="another kind of file"):
        core.check_socket_exists(plain)


# --------------------------------------------------------------------------- terminal replies


def test_raise_for_terminal_turns_an_error_into_request_failed_with_code_and_name():
    err = Error.of("r1", ErrorCode.PROMPT_TOO_LONG, "the prompt has 9000 tokens; the context is 1024 (--ctx-size)")
    with pytest.raises(RequestFailed) as info:
        core.raise_for_terminal(err)
    e = info.value
    assert (e.code, e.name, e.request_id) == (105, "PROMPT_TOO_LONG", "r1")
    assert e.message == err.message
    assert str(e) == f"PROMPT_TOO_LONG (105): {err.message}"


def test_raise_for_terminal_turns_busy_into_queue_full_with_the_queue():
    with pytest.raises(QueueFull) as info:
        core.raise_for_terminal(Busy(id="r1", queue_length=12, max_queue=16, message="the queue is full (16)"))
    assert (info.value.queue_length, info.value.max_queue, str(info.value)) == (12, 16, "the queue is full (16)")


@pytest.mark.parametrize(
    "msg", [done("r1"), Chunk(id="r1", text="a", token_ids=[1]), CancelReply(id="c", request_id="r1", found=True)]
)
def test_raise_for_terminal_lets_other_messages_pass(msg):
    assert core.raise_for_terminal(msg) is None


# --------------------------------------------------------------------------- routing


def test_router_returns_the_reply_for_the_awaited_request():
    router = ReplyRouter()
    router.expect("a")
    chunk = Chunk(id="a", text="x", token_ids=[5])
    assert router.accept(encode(chunk), waiting_for="a") == chunk
    assert router.pop("a") is None  # it was returned, not buffered


def test_router_buffers_replies_of_other_expected_requests_in_order():
    router = ReplyRouter()
    router.expect("a")
    router.expect("b")
    b1, b2 = Chunk(id="b", text="1", token_ids=[1]), Chunk(id="b", text="2", token_ids=[2])
    assert router.accept(encode(b1), waiting_for="a") is None
    assert router.accept(encode(b2), waiting_for="a") is None
    assert router.accept(encode(done("b")), waiting_for="a") is None
    assert [router.pop("b"), router.pop("b"), router.pop("b"), router.pop("b")] == [b1, b2, done("b"), None]
    assert router.pop("a") is None


def test_router_drops_replies_nobody_waits_for():
    router = ReplyRouter()
    router.expect("a")
    router.expect("gone")
    router.forget("gone")
    assert router.accept(encode(Chunk(id="gone", text="x", token_ids=[])), waiting_for="a") is None
    assert router.accept(encode(Chunk(id="never", text="x", token_ids=[])), waiting_for="a") is None
    assert set(router.buffers) == {"a"} and not router.buffers["a"]
    assert router.pop("gone") is None and router.pop("never") is None


def test_router_forget_discards_what_was_buffered():
    router = ReplyRouter()
    router.expect("b")
    router.accept(encode(Chunk(id="b", text="x", token_ids=[])), waiting_for="a")
    router.forget("b")
    router.forget("b")  # twice is harmless
    assert router.pop("b") is None


def test_router_refuses_an_id_in_use_and_keeps_its_buffer():
    router = ReplyRouter()
    router.expect("b")
    router.accept(encode(Chunk(id="b", text="x", token_ids=[])), waiting_for="a")
    with pytest.raises(InvalidRequest, match="'b' is in use"):
        router.expect("b")
    assert router.pop("b") == Chunk(id="b", text="x", token_ids=[])


def test_an_abandoned_request_keeps_its_id_until_its_terminal_reply_and_its_replies_are_dropped():
    router = ReplyRouter()
    router.expect("b")
    router.abandon("b")  # closed while the daemon still runs it
    with pytest.raises(InvalidRequest):
        router.expect("b")
    assert router.accept(encode(Chunk(id="b", text="late", token_ids=[])), waiting_for="b") is None
    assert router.accept(encode(Done.cancelled("b")), waiting_for="b") is None  # dropped: it was not this one's
    router.expect("b")  # free again
    assert router.accept(encode(Chunk(id="b", text="new", token_ids=[])), waiting_for="b").text == "new"


def test_lose_all_marks_the_waiting_requests_and_keeps_what_was_buffered():
    router = ReplyRouter()
    router.expect("a")
    router.expect("b")
    router.accept(encode(Chunk(id="b", text="x", token_ids=[])), waiting_for="a")
    router.lose_all()
    assert router.lost == {"a", "b"} and router.pop("b").text == "x"
    router.forget("a")
    router.expect("a")  # a retry with the same id on the new connection
    assert "a" not in router.lost


def test_router_hands_an_error_without_an_id_to_whoever_waits():
    router = ReplyRouter()
    router.expect("a")
    err = Error.of(None, ErrorCode.MALFORMED_MESSAGE, "body is not valid msgpack")
    assert router.accept(encode(err), waiting_for="a") == err


@pytest.mark.parametrize(
    "frames",
    [
        [b"chunk", b"\xc1"],  # not msgpack
        [b"chunk"],  # one frame
        encode(Status(id="s")),  # a request op: no reply has it
        [b"chunk", encode(Status(id="s"))[1]],  # a chunk missing its fields
    ],
)
def test_router_raises_tandem_error_for_a_reply_it_cannot_read(frames):
    router = ReplyRouter()
    router.expect("a")
    with pytest.raises(TandemError, match="the daemon sent a message this client cannot read"):
        router.accept(frames, waiting_for="a")


# --------------------------------------------------------------------------- stream state


class RecordingSocket:
    def __init__(self):
        self.sent: list[list[bytes]] = []

    def send_multipart(self, frames, flags=0):
        self.sent.append(frames)


class FakeClient:
    def __init__(self, sock=None):
        self._router = ReplyRouter()
        self._sock = sock


def stream_of(client: FakeClient, request_id: str = "g") -> StreamState:
    client._router.expect(request_id)
    return StreamState(client, request_id)


def test_stream_state_accumulates_chunk_text_and_ends_on_done():
    client = FakeClient(RecordingSocket())
    s = stream_of(client)
    first = Chunk(id="g", text="Hel", token_ids=[1])
    assert s._take(first) is first
    assert s._take(Chunk(id="g", text="", token_ids=[])).text == ""  # held-back text: an empty chunk
    s._take(Chunk(id="g", text="lo", token_ids=[2, 3]))
    assert s.text == "Hello" and s.done is None and not s._finished
    end = done("g", "Hello")
    assert s._take(end) is None
    assert s.done is end and s._finished
    assert "g" not in client._router.buffers
    s.close()
    assert client._sock.sent == []  # a finished stream has nothing to cancel


def test_stream_state_raises_for_error_and_busy_and_stops():
    client = FakeClient(RecordingSocket())
    s = stream_of(client)
    with pytest.raises(RequestFailed) as info:
        s._take(Error.of("g", ErrorCode.WORKER_DIED, "the worker died; it is restarted"))
    assert info.value.code == 201 and s._finished and s.done is None
    assert "g" not in client._router.buffers
    s2 = stream_of(client, "g2")
    with pytest.raises(QueueFull):
        s2._take(Busy(id="g2", queue_length=1, max_queue=1, message="full"))
    assert s2._finished
    s.close(), s2.close()
    assert client._sock.sent == []


def test_stream_state_refuses_an_unexpected_message_in_a_generate_stream():
    s = stream_of(FakeClient())
    with pytest.raises(TandemError, match="unexpected cancel message in a generate stream"):
        s._take(CancelReply(id="g", request_id="g", found=True))
    assert s._finished and s.done is None


def test_stream_state_close_cancels_an_unfinished_request_once_and_forgets_its_replies():
    client = FakeClient(RecordingSocket())
    s = stream_of(client, "g")
    s.close()
    s.close()
    assert len(client._sock.sent) == 1
    cancel = decode(client._sock.sent[0])
    assert isinstance(cancel, Cancel) and cancel.request_id == "g" and cancel.id != "g"
    assert "g" not in client._router.buffers


def test_stream_state_close_without_a_socket_only_forgets():
    client = FakeClient(sock=None)
    s = stream_of(client, "g")
    s.close()
    assert s._finished and "g" not in client._router.buffers
