"""Ollama's native API on the bridge, driven by the official ``ollama`` Python
package (which nobody on this project wrote) against the real daemon on
Qwen2.5-Coder-0.5B: list, show, ps, generate (with suffix, raw, system, format),
chat streamed and with tools; and each kind of bad input answered in Ollama's
``{"error"}`` shape with the fix."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request

import jsonschema
import ollama
import pytest

from tandem.client import Client

GREEDY = {"temperature": 0, "num_predict": 24}


@pytest.fixture(scope="module")
def bridge(coder_daemon, bridge_process):
    b = bridge_process(coder_daemon)
    yield b
    assert b.stop() == 0, "".join(b.lines)


@pytest.fixture(scope="module")
def host(bridge) -> str:
    return bridge.url.removesuffix("/v1")


@pytest.fixture(scope="module")
def client(host) -> ollama.Client:
    return ollama.Client(host=host)


@pytest.fixture(scope="module")
def served(coder_daemon) -> str:
    with coder_daemon.client() as c:
        return c.connect().model


def test_list_show_and_ps_describe_the_served_model(client, served, coder_daemon):
    names = [m.model for m in client.list().models]
    assert names[0] == f"{served}:latest"
    first = client.list().models[0]
    assert first.size > 100 << 20 and len(first.digest) == 64
    assert first.details.format == "gguf" and first.details.family == "qwen2"
    assert first.details.parameter_size == "0.5B" and first.details.quantization_level
    shown = client.show(served)
    assert {"completion", "insert", "tools"} <= set(shown.capabilities)
    assert shown.modelinfo["general.architecture"] == "qwen2"
    assert shown.modelinfo["qwen2.context_length"] == 2048  # what the daemon serves, which Zed reads
    assert "<|im_start|>" in shown.template
    (running,) = client.ps().models
    assert running.model == f"{served}:latest" and running.context_length == 2048
    assert client.show("tandem").capabilities == shown.capabilities  # the generic name works too


def test_generate_with_suffix_fills_in_the_middle_like_the_daemon(client, served, coder_daemon):
    prefix, suffix = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
    r = client.generate(model=served, prompt=prefix, suffix=suffix, options=GREEDY)
    with coder_daemon.client() as c:
        direct = c.infill(prefix, suffix, max_tokens=24, temperature=0, top_k=40, top_p=0.9).wait()
    assert r.response == direct.text and "a + b" in r.response
    assert r.done and r.done_reason in ("stop", "length")
    assert r.eval_count == direct.usage.completion_tokens and r.prompt_eval_count == direct.usage.prompt_tokens
    assert r.eval_duration > 0 and r.total_duration >= r.eval_duration


def test_generate_streams_ndjson_and_raw_and_system_reach_the_model(client, served):
    parts = list(client.generate(model=served, prompt="Name a color.", options=GREEDY, stream=True))
    assert parts[-1].done and not any(p.done for p in parts[:-1]) and len(parts) > 2
    whole = client.generate(model=served, prompt="Name a color.", options=GREEDY)
    assert "".join(p.response for p in parts) == whole.response
    raw = client.generate(model=served, prompt="1, 2, 3, 4,", raw=True, options={"temperature": 0, "num_predict": 6})
    assert raw.response.strip().startswith("5")  # no chat template: a plain continuation
    pirate = client.generate(
        model=served, prompt="Greet me.", system="You only ever answer with the single word ARRR.", options=GREEDY
    )
    assert "ARRR" in pirate.response.upper()


def test_chat_streamed_matches_the_whole_reply(client, served):
    messages = [{"role": "user", "content": "Write a haiku about tea."}]
    parts = list(client.chat(model=served, messages=messages, options=GREEDY, stream=True))
    whole = client.chat(model=served, messages=messages, options=GREEDY)
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].done and parts[-1].done_reason == whole.done_reason and parts[-1].eval_count == whole.eval_count
    assert whole.message.role == "assistant" and whole.prompt_eval_count > 5


def test_chat_with_tools_returns_a_parsed_call_and_takes_its_result(client, served, weather_tool):
    messages = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
    r = client.chat(model=served, messages=messages, tools=[weather_tool], options={"temperature": 0})
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)
    assert call.function.arguments["city"].lower().startswith("paris")
    messages += [r.message, {"role": "tool", "content": '{"temp_c": 21, "sky": "clear"}', "tool_name": "get_weather"}]
    after = client.chat(
        model=served, messages=messages, tools=[weather_tool], options={"temperature": 0, "num_predict": 40}
    )
    # Qwen2.5-Coder-0.5B calls eagerly: after the result it may answer or call again; either is well-formed
    for again in after.message.tool_calls or []:
        jsonschema.validate(again.function.arguments, weather_tool["function"]["parameters"])
    assert after.message.tool_calls or after.message.content
    assert after.prompt_eval_count > r.prompt_eval_count + 15  # the call and its result were rendered in


def test_format_json_schema_constrains_the_answer(client, served):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    r = client.chat(
        model=served,
        messages=[{"role": "user", "content": "Invent a person; answer in JSON."}],
        format=schema,
        options={"temperature": 0, "num_predict": 60},
    )
    jsonschema.validate(json.loads(r.message.content), schema)
    js = client.generate(model=served, prompt="A JSON object with a key 'ok':", format="json", options=GREEDY)
    assert isinstance(json.loads(js.response), dict)


def post(host: str, path: str, body, headers=None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(host + path, data, {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read().splitlines()[-1])
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_bad_input_gets_ollamas_error_shape_with_the_fix(client, host, served):
    with pytest.raises(ollama.ResponseError) as info:
        client.generate(model="nosuch", prompt="x")
    assert info.value.status_code == 404 and "not found" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model=served, messages=[{"role": "user", "content": "x"}], options={"num_ctx": 100_000})
    assert info.value.status_code == 400 and "--ctx-size 100000" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.embed(model=served, input="x")
    assert info.value.status_code == 400 and "tandem serve --embedding-model" in info.value.error  # none served
    status, body = post(host, "/api/generate", b'{"model": "x", "prompt": ')
    assert status == 400 and "not valid JSON" in body["error"]
    status, body = post(
        host, "/api/chat", {"model": served, "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}
    )
    assert status == 400 and "images" in body["error"]
    status, body = post(host, "/api/pull", {"model": "llama3"})
    assert status == 501 and "tandem pull" in body["error"]
    with pytest.raises(ollama.ResponseError) as info:
        client.delete(served)  # (a DELETE request)
    assert info.value.status_code == 501 and "tandem rm" in info.value.error
    head = urllib.request.Request(host + "/", method="HEAD")
    with urllib.request.urlopen(head, timeout=30) as r:
        assert r.status == 200
    status, body = post(host, "/api/generate", {"model": served, "prompt": "x"}, {"Origin": "https://evil.example"})
    assert status == 403 and "web pages" in body["error"]
    # a sandboxed frame or data: page sends "null"; a form post, text/plain: a page's requests all the same
    page = {"Origin": "null", "Content-Type": "text/plain"}
    assert post(host, "/api/generate", {"model": served, "prompt": "x"}, page)[0] == 403
    assert post(host, "/api/chat", {"model": served}, {"Sec-Fetch-Site": "cross-site"})[0] == 403
    assert post(host, "/v1/chat/completions", {"model": served}, {"Content-Type": "text/plain"})[0] == 415
    # unknown options are accepted and not applied, as Ollama does with options a runner lacks
    ok = client.generate(model=served, prompt="Hi", options={"num_predict": 2, "repeat_penalty": 1.3, "mirostat": 2})
    assert ok.eval_count == 2


def test_curl_as_ollamas_docs_show_it(host, served):
    """Ollama's docs post with `curl -d` (a form content type): accepted on /api."""
    out = subprocess.run(
        [
            "curl",
            "-s",
            host + "/api/generate",
            "-d",
            json.dumps({"model": served, "prompt": "Hi", "stream": False, "options": {"num_predict": 3}}),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    reply = json.loads(out.stdout)
    assert reply["done"] is True and reply["eval_count"] == 3 and reply["model"] == served


def test_a_client_that_leaves_mid_stream_cancels_its_daemon_request(host, served, coder_daemon):
    port = int(host.rsplit(":", 1)[1])
    body = json.dumps({"model": served, "prompt": "Count to a thousand.", "options": {"num_predict": 2000}}).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(
        b"POST /api/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    assert b"200 OK" in s.recv(65536)  # the stream has started
    with Client(coder_daemon.socket) as c:
        deadline = time.monotonic() + 30
        while c.status().active is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        s.close()
        deadline = time.monotonic() + 5
        while c.status().active is not None:
            assert time.monotonic() < deadline, "the daemon request outlived its HTTP client"
            time.sleep(0.02)


def test_the_llm_cli_with_its_ollama_plugin(host, served, tmp_path):
    """`llm` with llm-ollama (a client nobody here wrote) finds the model in /api/tags and chats."""
    import os
    import shutil

    llm = shutil.which("llm")
    assert llm, "the llm CLI is missing: pip install -e '.[test]'"
    env = {**os.environ, "OLLAMA_HOST": host, "LLM_USER_PATH": str(tmp_path)}
    models = subprocess.run([llm, "models"], capture_output=True, text=True, env=env, timeout=120)
    assert f"Ollama: ollama/{served}:latest" in models.stdout, models.stdout + models.stderr
    out = subprocess.run(
        [llm, "-m", f"ollama/{served}:latest", "-o", "temperature", "0", "-o", "num_predict", "12", "Say hello."],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0 and out.stdout.strip(), out.stderr
