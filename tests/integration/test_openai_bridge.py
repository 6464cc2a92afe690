"""`tandem http` (its OpenAI dialect; `tandem openai` is its old name) against the real daemon,
with the official `openai` package and curl as clients."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from urllib.parse import urlparse

import openai
import pytest

PREFIX = "def add(a, b):\n    return "
SUFFIX = "\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
COUNTING = "Count from 1 to 1000, one number per line:\n1\n2\n3\n"


@pytest.fixture(scope="module")
def bridge(bridge_process, coder_daemon):
    b = bridge_process(coder_daemon)
    yield b
    assert b.stop() == 0, "".join(b.lines)


@pytest.fixture(scope="module")
def api(bridge):
    return bridge.openai()


def curl(*args: str, data: object = None) -> subprocess.CompletedProcess:
    cmd = ["curl", "-sS", "-N", *args]
    if data is not None:
        cmd += ["-H", "Content-Type: application/json", "--data-binary", json.dumps(data)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def wait_for(predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_models_lists_the_daemons_model(api, coder_daemon):
    models = api.models.list().data
    with coder_daemon.client() as c:
        st = c.status()
    assert [m.id for m in models] == [st.model.name]
    assert api.models.retrieve(st.model.name).id == st.model.name


def test_completions_with_suffix_fill_in_the_middle_as_the_daemon_does(api, coder_daemon):
    r = api.completions.create(model="any", prompt=PREFIX, suffix=SUFFIX, max_tokens=32, temperature=0)
    with coder_daemon.client() as c:
        done = c.infill(PREFIX, SUFFIX, max_tokens=32).wait()
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].text == done.text and "a + b" in done.text
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == done.usage.prompt_tokens
    assert r.usage.completion_tokens == done.usage.completion_tokens
    assert done.usage.cached_tokens > 0  # the daemon's request reused the pages the bridge's request cached


def test_completions_without_suffix_and_streamed(api, coder_daemon):
    plain = api.completions.create(model="any", prompt="def fibonacci(n):", max_tokens=12, temperature=0)
    with coder_daemon.client() as c:
        done = c.complete(prompt="def fibonacci(n):", max_tokens=12, temperature=0)
    assert plain.choices[0].text == done.text
    assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 12
    pieces = list(
        api.completions.create(model="any", prompt="def fibonacci(n):", max_tokens=12, temperature=0, stream=True)
    )
    assert "".join(p.choices[0].text for p in pieces) == done.text
    assert pieces[-1].choices[0].finish_reason == "length"
    fim = list(
        api.completions.create(model="any", prompt=PREFIX, suffix=SUFFIX, max_tokens=32, temperature=0, stream=True)
    )
    assert "a + b" in "".join(p.choices[0].text for p in fim)


def test_chat_streamed_and_not(api):
    messages = [
        {"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": "What is Python?"},
    ]
    whole = api.chat.completions.create(model="any", messages=messages, max_tokens=24, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    text = whole.choices[0].message.content
    assert text and whole.usage.completion_tokens > 0
    chunks = list(
        api.chat.completions.create(
            model="any",
            messages=messages,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    parts = api.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is Python?"}]}],
        max_tokens=4,
        temperature=0,
    )
    assert parts.choices[0].message.content


def test_return_progress_streams_the_prompts_reading_to_the_openai_client(api):
    # llama-server's return_progress: chunks with prompt_progress (and no content) while the prompt is read, the
    # first with what the cache held and the last at its end; the openai package passes them through
    messages = [{"role": "user", "content": f"Note {time.time_ns()}. " + "Summarise this line of text. " * 60}]
    chunks = list(
        api.chat.completions.create(
            model="any",
            messages=messages,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_progress": True},
        )
    )
    reports = [(ch.model_extra or {}).get("prompt_progress") for ch in chunks]
    progress = [r for r in reports if r]
    assert len(progress) >= 2, chunks
    first_content = next(i for i, ch in enumerate(chunks) if ch.choices and ch.choices[0].delta.content)
    assert all(reports[i] is None for i in range(first_content, len(chunks)))
    usage = chunks[-1].usage
    assert {r["total"] for r in progress} == {usage.prompt_tokens}
    assert progress[0]["processed"] == progress[0]["cache"] == usage.prompt_tokens_details.cached_tokens
    assert progress[-1]["processed"] == usage.prompt_tokens and progress[-1]["time_ms"] >= 0
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    again = api.chat.completions.create(model="any", messages=messages, max_tokens=8, temperature=0)
    assert text == again.choices[0].message.content


def test_errors_have_openais_shape(api, bridge):
    cases = [
        (dict(n=2), openai.BadRequestError, "n"),
        (dict(logprobs=3), openai.BadRequestError, "logprobs"),
        (dict(max_tokens=0), openai.BadRequestError, None),
        (dict(temperature="hot"), openai.BadRequestError, "temperature"),
    ]
    for extra, kind, param in cases:
        with pytest.raises(kind) as err:
            api.completions.create(model="any", prompt="x", **extra)
        body = err.value.body
        assert body["type"] == "invalid_request_error" and body["message"] and body["param"] == param
    with pytest.raises(openai.BadRequestError) as err:
        api.chat.completions.create(model="any", messages=[{"role": "user", "content": "word " * 3000}], max_tokens=4)
    assert err.value.body["code"] == "context_length_exceeded" and "--ctx-size" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):  # a tool result must say which call
        api.chat.completions.create(model="any", messages=[{"role": "tool", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="role 'function'"):
        api.chat.completions.create(model="any", messages=[{"role": "function", "content": "x", "name": "f"}])
    with pytest.raises(openai.BadRequestError) as err:  # (a daemon without --embedding-model)
        api.embeddings.create(model="any", input="x")
    assert err.value.body["code"] == "no_embedding_model" and "--embedding-model" in err.value.body["message"]
    # what a browser or a confused client sends
    r = curl("-i", bridge.url + "/completions", "-H", "Content-Type: text/plain", "--data-binary", '{"prompt": "x"}')
    assert " 415 " in r.stdout.splitlines()[0] and '"error"' in r.stdout
    r = curl("-i", bridge.url + "/completions", "-H", "Content-Type: application/json", "--data-binary", "{not json")
    assert " 400 " in r.stdout.splitlines()[0] and "not valid JSON" in r.stdout
    for host in ("attacker.example:8642", "127.0.0.1.attacker.example:8642", "127.0.0.1.attacker.example"):
        r = curl("-i", bridge.url + "/models", "-H", f"Host: {host}")  # DNS rebinding
        assert " 403 " in r.stdout.splitlines()[0] and "loopback" in r.stdout, host


def test_curl_sees_server_sent_events(bridge):
    r = curl(
        bridge.url + "/chat/completions",
        data={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "stream": True},
    )
    events = [line for line in r.stdout.splitlines() if line]
    assert all(line.startswith("data: ") for line in events), r.stdout
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(line[6:]) for line in events[:-1]]
    assert {p["object"] for p in payloads} == {"chat.completion.chunk"}
    assert payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    r = curl(bridge.url + "/models")
    assert json.loads(r.stdout)["object"] == "list"


def _cancelled(daemon) -> int:
    with daemon.client() as c:
        return c.status().requests.get("done_cancelled", 0)


def _running(daemon):
    """A request has been running for a while (past its prompt: these prompts are short)."""
    with daemon.client() as c:
        active = c.status().active
    return active is not None and active.elapsed_seconds > 0.5


def test_a_client_that_disconnects_cancels_its_daemon_request(bridge, coder_daemon):
    # not streamed: the bridge notices the closed connection while it waits
    before = _cancelled(coder_daemon)
    url = urlparse(bridge.url)
    body = json.dumps({"prompt": COUNTING, "max_tokens": 2000, "temperature": 0}).encode()
    sock = socket.create_connection((url.hostname, url.port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    wait_for(lambda: _running(coder_daemon))
    sock.close()
    wait_for(lambda: _cancelled(coder_daemon) == before + 1, 10)
    wait_for(lambda: not _running(coder_daemon), 10)
    # streamed: the openai client closes the stream after three events
    stream = bridge.openai().completions.create(
        model="any", prompt=COUNTING, max_tokens=2000, temperature=0, stream=True
    )
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    wait_for(lambda: _cancelled(coder_daemon) == before + 2, 10)
    with coder_daemon.client() as c:
        assert c.status().active is None


def test_busy_fim_unsupported_and_daemon_gone(bridge_process, start_daemon):
    d = start_daemon("--max-queue", "1")  # SmolLM2: no FIM tokens
    b = bridge_process(d)
    try:
        api = b.openai()
        with pytest.raises(openai.BadRequestError) as err:
            api.completions.create(model="any", prompt=PREFIX, suffix=SUFFIX)
        assert err.value.body["code"] == "fim_unsupported" and "qwen2.5-coder" in err.value.body["message"]
        with d.client() as c:
            running = c.generate(prompt=COUNTING, max_tokens=2000, temperature=0)
            wait_for(lambda: _running(d))
            queued = c.generate(prompt=COUNTING, max_tokens=2000, temperature=0)
            wait_for(lambda: c.status().queue_length == 1)
            with pytest.raises(openai.RateLimitError) as err:
                api.completions.create(model="any", prompt="x", max_tokens=2)
            assert err.value.response.headers["retry-after"] == "1" and err.value.body["code"] == "queue_full"
            queued.cancel()
            running.cancel()
        d.stop()
        with pytest.raises(openai.InternalServerError) as err:
            api.completions.create(model="any", prompt="x", max_tokens=2)
        assert err.value.status_code == 503 and "tandem serve" in err.value.body["message"]
    finally:
        assert b.stop() == 0


def test_the_bridge_listens_on_loopback_only(coder_daemon):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.cli",
            "--socket",
            str(coder_daemon.socket),
            "openai",
            "--listen",
            "0.0.0.0:8642",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "not a loopback address" in r.stderr and "ssh -L" in r.stderr


def test_response_format_json_schema_through_the_openai_client(api):
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "maximum": 150}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "Maria is 34. Give her name and age as JSON."}]
    r = api.chat.completions.create(model="any", messages=messages, temperature=0, response_format=rf)
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert r.choices[0].finish_reason == "stop"
    pieces = api.chat.completions.create(model="any", messages=messages, temperature=0, response_format=rf, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert streamed == r.choices[0].message.content
    obj = api.chat.completions.create(
        model="any", messages=messages, temperature=0, max_tokens=80, response_format={"type": "json_object"}
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as err:
        bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
        api.chat.completions.create(model="any", messages=messages, response_format=bad)
    assert "json_schema.schema" in err.value.body["message"]
