"""The bridge's optional API key (issue 19, item 2): for platforms where the
same-user check on a loopback port cannot run, or on request. A 0600 key file
created on first use, printed by `tandem key`; a request without it, or with
another, gets 401 in OpenAI's shape; the real openai client authenticates with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest

from tandem.bridge.api_key import KeyFileError, ensure_key, matches, presented, read_key, required_key


def test_the_key_file_is_created_private_and_kept(tmp_path):
    path = tmp_path / "state" / "api-key"
    key = ensure_key(path)
    assert key.startswith("tandem-") and len(key) > 40
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert ensure_key(path) == key == read_key(path)
    assert ensure_key(path, new=True) != key  # --new


def test_a_key_file_others_could_read_or_plant_is_refused(tmp_path):
    path = tmp_path / "api-key"
    ensure_key(path)
    os.chmod(path, 0o644)
    with pytest.raises(KeyFileError, match="not your private file.*tandem key --new"):
        read_key(path)
    path.unlink()
    (tmp_path / "elsewhere").write_text("tandem-planted\n")
    os.chmod(tmp_path / "elsewhere", 0o600)
    path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(KeyFileError):
        read_key(path)  # never through a link


def test_auto_requires_the_key_only_where_the_uid_check_cannot_run(tmp_path):
    linux = tmp_path / "proc-net"
    linux.mkdir()
    (linux / "tcp").write_text("  sl  local_address rem_address   st ...\n")
    elsewhere = tmp_path / "no-proc-net"
    elsewhere.mkdir()
    key_file = tmp_path / "api-key"
    assert required_key("auto", key_file, proc=linux) is None and not key_file.exists()
    assert required_key("auto", key_file, proc=elsewhere) == read_key(key_file)
    assert required_key("on", key_file, proc=linux) == read_key(key_file)
    assert required_key("off", key_file, proc=elsewhere) is None
    with pytest.raises(ValueError):
        required_key("sometimes", key_file)


def test_the_key_is_read_from_bearer_or_x_api_key():
    assert presented({"Authorization": "Bearer abc"}) == "abc"
    assert presented({"Authorization": "bearer  abc "}) == "abc"
    assert presented({"x-api-key": "abc"}) == "abc"
    assert presented({}) == ""
    assert matches("abc", "abc") and not matches("abd", "abc") and not matches("", "abc")


def post(url: str, headers: dict) -> tuple[int, dict]:
    body = json.dumps({"model": "x", "prompt": "Hi", "max_tokens": 2}).encode()
    req = urllib.request.Request(url + "/completions", body, {"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_bridge_with_api_key_on_serves_only_requests_that_carry_it(daemon, bridge_process):
    bridge = bridge_process(daemon, "--api-key", "on")
    try:
        key = subprocess.run(
            [sys.executable, "-m", "tandem.cli", "key"],
            capture_output=True,
            text=True,
            env=daemon.env,
            check=True,
        ).stdout.strip()
        assert key.startswith("tandem-")
        deadline = time.monotonic() + 10  # (its stderr is read on a thread)
        while not any("needs the API key that `tandem key` prints" in line for line in bridge.lines):
            assert time.monotonic() < deadline, bridge.lines
            time.sleep(0.05)

        status, body = post(bridge.url, {})
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert body["error"]["type"] == "authentication_error" and "tandem key" in body["error"]["message"]
        assert post(bridge.url, {"Authorization": "Bearer tandem-wrong"})[0] == 401
        assert post(bridge.url, {"x-api-key": key})[0] == 200

        with pytest.raises(openai.AuthenticationError):
            bridge.openai().completions.create(model="x", prompt="Hi", max_tokens=2)  # api_key="unused"
        good = openai.OpenAI(base_url=bridge.url, api_key=key, max_retries=0)
        assert good.completions.create(model="x", prompt="Hi", max_tokens=2).usage.completion_tokens == 2
        assert good.models.list().data[0].id
        # a liveness probe needs no key, as llama-server's /health; then it names nothing, not even the model
        with urllib.request.urlopen(bridge.url.removesuffix("/v1") + "/health", timeout=10) as r:
            assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}
        base = bridge.url.removesuffix("/v1")
        for path in ("/v1/models", "/healthz", "//health", "/api/tags"):  # the exemption is that probe only
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(base + path, timeout=10)
            assert err.value.code == 401, path
        with pytest.raises(urllib.error.HTTPError) as err:  # (and only to GET or HEAD)
            urllib.request.urlopen(urllib.request.Request(base + "/health", b"{}", method="POST"), timeout=10)
        assert err.value.code == 401
    finally:
        bridge.stop()


def test_a_bridge_on_linux_needs_no_key_by_default(daemon, bridge_process):
    bridge = bridge_process(daemon)
    try:
        assert post(bridge.url, {})[0] == 200  # the same-user check runs here: --api-key auto asks for none
        assert not any("API key" in line for line in bridge.lines)
    finally:
        bridge.stop()
