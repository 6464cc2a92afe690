"""A worker process as the daemon starts it: stdin config, its own channel, its death noticed."""

from __future__ import annotations

import os
import select
import time

import pytest
import zmq

from tandem.daemon.config import SettingsValues
from tandem.daemon.front.restart_policy import RestartPolicy
from tandem.daemon.front.worker_handle import WorkerHandle
from tandem.daemon.worker.worker_config import WorkerConfig
from tandem.protocol import Error, ErrorCode, decode
from tandem.protocol.internal import WORKER_REPLIES


@pytest.fixture
def handle(tmp_path_factory):
    import tempfile

    ipc_dir = tempfile.mkdtemp(prefix="tdm-wh-", dir="/tmp")
    ctx = zmq.Context()
    config = WorkerConfig(
        role="target",
        model_name="missing",
        model_path=os.path.join(ipc_dir, "no-such-model.gguf"),
        settings=SettingsValues(),
    )
    h = WorkerHandle(ctx, config, __import__("pathlib").Path(ipc_dir), RestartPolicy(5, 600.0, 120.0))
    yield h
    h.stop(timeout=2)
    ctx.term()
    __import__("shutil").rmtree(ipc_dir, ignore_errors=True)


def wait_dead(h: WorkerHandle, timeout: float = 30.0) -> None:
    ready, _, _ = select.select([h.sentinel], [], [], timeout)
    assert ready, "the sentinel did not signal the worker's exit"
    deadline = time.monotonic() + 5
    while h.alive and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_worker_that_cannot_load_says_why_then_exits_and_its_channel_goes(handle):
    handle.start()
    assert handle.alive and handle.ipc_path.exists() and oct(handle.ipc_path.stat().st_mode & 0o777) == "0o600"
    assert handle.sock.poll(60_000), "no answer from the worker"
    msg = decode(handle.sock.recv_multipart(), table=WORKER_REPLIES)
    assert isinstance(msg, Error) and msg.code == ErrorCode.NOT_READY and "could not load the model" in msg.message
    wait_dead(handle)
    path = handle.ipc_path
    assert handle.reap() == 0 and handle.sock is None and not path.exists() and handle.info is None


def test_each_start_is_a_new_process_on_a_new_channel_and_a_kill_is_noticed(handle):
    handle.start()
    first_pid, first_path = handle.pid, handle.ipc_path
    handle.process.kill()
    wait_dead(handle)
    assert handle.reap() == -9
    handle.start()
    assert handle.pid != first_pid and handle.ipc_path != first_path and handle.generation == 2
    assert handle.sock.poll(60_000)  # the new one answers on the new channel
