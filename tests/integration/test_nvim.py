"""The Neovim plugin (client/editors/nvim), headless, against the bridge and the real daemon."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

NVIM = shutil.which("nvim")
PLUGIN = Path(__file__).resolve().parents[2] / "client" / "editors" / "nvim"

pytestmark = pytest.mark.skipif(
    NVIM is None, reason="needs Neovim >= 0.7 on PATH (Debian/Ubuntu: apt-get install neovim)"
)

SOURCE = "def add(a, b):\n    return \n\n\ndef test_add():\n    assert add(2, 3) == 5\n"


@pytest.fixture(scope="module")
def bridge(bridge_process, coder_daemon):
    b = bridge_process(coder_daemon)
    yield b
    assert b.stop() == 0


def nvim(path: Path, *commands: str, setup: str = "") -> subprocess.CompletedProcess:
    """Run headless Neovim on ``path`` with only this plugin loaded, then the commands."""
    cmd = [
        NVIM,
        "--headless",
        "-u",
        "NONE",
        "-i",
        "NONE",
        "-n",
        "--cmd",
        f"set rtp^={PLUGIN}",
        str(path),
        "-c",
        "runtime plugin/tandem.lua",
        "-c",
        f"lua require('tandem').setup({{ {setup} }})",
    ]
    for c in commands:
        cmd += ["-c", c]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)


WAIT = "lua vim.wait(120000, function() return require('tandem').last() ~= nil end, 20)"
SAVE_LAST = "lua vim.fn.writefile({{vim.json.encode(require('tandem').last())}}, '{out}')"


def test_insert_mode_key_inserts_the_completion_into_the_buffer(short_tmpdir, bridge, coder_daemon):
    d = short_tmpdir()
    path = d / "add.py"
    path.write_text(SOURCE)
    r = nvim(
        path,
        "lua vim.keymap.set('i', '<C-]>', require('tandem').complete)",
        "call cursor(2, 1)",
        'call feedkeys("A\\<C-]>", "tx")',  # append at the end of "    return ", then the key
        WAIT,
        "wq",
        setup=f"url = '{bridge.url}'",
    )
    assert r.returncode == 0, r.stderr
    # what the plugin sends: the buffer's text before and after the cursor
    prefix, suffix = "def add(a, b):\n    return ", "\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
    with coder_daemon.client() as c:
        expected = c.infill(prefix, suffix, max_tokens=128).wait().text
    assert "a + b" in expected
    assert path.read_text() == prefix + expected + suffix
    shutil.rmtree(d)


def test_complete_command_and_line_limit(short_tmpdir, bridge):
    d = short_tmpdir()
    path = d / "fib.py"
    path.write_text("def fibonacci(n):\n\n")
    r = nvim(
        path,
        "call cursor(2, 1)",
        "TandemComplete",
        WAIT,
        "wq",
        setup=f"url = '{bridge.url}', max_lines = 1",
    )
    assert r.returncode == 0, r.stderr
    text = path.read_text()
    assert text.startswith("def fibonacci(n):\n") and len(text.splitlines()) == 2  # one line, into the empty one
    assert text.splitlines()[1].strip()
    shutil.rmtree(d)


def test_chat_streams_the_answer_into_the_chat_buffer(short_tmpdir, bridge, coder_daemon):
    d = short_tmpdir()
    path, out, last = d / "add.py", d / "chat.md", d / "last.json"
    path.write_text(SOURCE)
    r = nvim(
        path,
        "set filetype=python",
        "2,2TandemChat What does this line do?",
        WAIT,
        f"lua vim.fn.writefile(vim.api.nvim_buf_get_lines(0, 0, -1, false), '{out}')",
        SAVE_LAST.format(out=last),
        "qa!",
        setup=f"url = '{bridge.url}', chat_temperature = 0, chat_max_tokens = 24",
    )
    assert r.returncode == 0, r.stderr
    answer = json.loads(last.read_text())
    assert answer.get("error") is None and answer["text"]
    chat = out.read_text()
    question = "What does this line do?\n\n```python\n    return \n```"
    assert chat.startswith("## You\n\n" + question + "\n\n## tandem\n\n")
    assert chat.rstrip("\n").endswith(answer["text"].rstrip("\n"))
    with coder_daemon.client() as c:  # the same conversation, straight to the daemon
        done = c.complete(messages=[{"role": "user", "content": question}], max_tokens=24, temperature=0, top_p=1.0)
    assert answer["text"] == done.text
    shutil.rmtree(d)


def test_no_bridge_is_a_clear_error_not_a_hang(tmp_path):
    path = tmp_path / "x.py"
    path.write_text("x = ")
    last = tmp_path / "last.json"
    r = nvim(
        path,
        "TandemComplete",
        WAIT,
        SAVE_LAST.format(out=last),
        "qa!",
        setup=f"url = 'http://127.0.0.1:{closed_port()}/v1'",
    )
    assert r.returncode == 0, r.stderr
    assert "tandem http" in last.read_text()
    assert path.read_text() == "x = "


def closed_port() -> int:
    """A loopback port nothing listens on."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port
