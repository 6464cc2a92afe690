"""The daemon's side of one worker process: spawn it, talk to it, notice its death.

Each start gets a fresh PAIR socket on a fresh ipc path, so nothing a dead
worker left queued can reach its successor.

A worker is a plain ``python -m tandem.daemon.worker.worker_main`` subprocess that reads its
configuration as JSON on stdin: no multiprocessing, so nothing is pickled, not
even on the way into a child. Its death is noticed through a pipe whose write
end only the worker holds: the read end (the "sentinel") becomes readable, at
EOF, the moment the worker exits, however it dies.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import zmq

from tandem.protocol import ModelInfo, encode, endpoint

from ..worker.worker_config import WorkerConfig
from .restart_policy import RestartPolicy


class WorkerProcess:
    """A started worker: pid, sentinel, liveness, exit code, join, terminate, kill."""

    def __init__(self, config: WorkerConfig):
        read_end, write_end = os.pipe()
        try:
            self.popen = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tandem.daemon.worker.worker_main",
                    "--sentinel-fd",
                    str(write_end),
                    "--parent-pid",
                    str(os.getpid()),
                ],
                stdin=subprocess.PIPE,
                pass_fds=(write_end,),
                close_fds=True,
            )
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        self.sentinel = read_end
        assert self.popen.stdin is not None
        try:
            self.popen.stdin.write(json.dumps(config.to_dict()).encode())
        except BrokenPipeError:  # it died at once; the sentinel says so
            pass
        finally:
            try:
                self.popen.stdin.close()
            except BrokenPipeError:
                pass

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> Optional[int]:
        return self.popen.returncode  # negative: killed by that signal

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: Optional[float] = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()

    def close(self) -> None:
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


class WorkerHandle:
    """One worker role (target or drafter) across its lives: each ``start`` is a
    new process on a new channel; ``policy`` decides about restarts."""

    def __init__(self, zctx: zmq.Context, config: WorkerConfig, ipc_dir: Path, policy: RestartPolicy):
        self.zctx = zctx
        self.policy = policy
        self.base_config = config
        self.ipc_dir = ipc_dir
        self.generation = 0
        self.process: Optional[WorkerProcess] = None
        self.sock: Optional[zmq.Socket] = None
        self.ipc_path: Optional[Path] = None
        self.info: Optional[ModelInfo] = None
        self.started_at = 0.0

    @property
    def role(self) -> str:
        return self.base_config.role

    @property
    def ready(self) -> bool:
        return self.info is not None and self.alive

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    @property
    def pid(self) -> Optional[int]:
        return self.process.pid if self.process is not None else None

    @property
    def sentinel(self) -> Optional[int]:
        if self.process is None or self.process.sentinel < 0:
            return None
        return self.process.sentinel

    def start(self) -> None:
        self.generation += 1
        self.info = None
        self.ipc_path = self.ipc_dir / f".{self.role}-{os.getpid()}-{self.generation}.ipc"
        self.sock = self.zctx.socket(zmq.PAIR)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint(self.ipc_path))
        os.chmod(self.ipc_path, 0o600)
        config = dataclasses.replace(self.base_config, endpoint=endpoint(self.ipc_path), life=self.generation)
        if self.process is not None:
            self.process.close()
        self.process = WorkerProcess(config)
        self.started_at = time.monotonic()

    def send(self, msg) -> bool:
        """False when the worker cannot take it (dead, or its channel is gone);
        the daemon notices the death through the process sentinel."""
        if self.sock is None:
            return False
        try:
            self.sock.send_multipart(encode(msg), flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def close_channel(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        if self.ipc_path is not None:
            try:
                self.ipc_path.unlink()
            except FileNotFoundError:
                pass
            self.ipc_path = None

    def reap(self) -> Optional[int]:
        """After the process died: collect its exit code and drop the channel."""
        code = None
        if self.process is not None:
            self.process.join(timeout=1)
            code = self.process.exitcode
            self.process.close()
        self.close_channel()
        self.info = None
        return code

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the worker to exit (the caller sent Shutdown), then make sure it does."""
        if self.process is not None:
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(2)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(2)
            self.process.close()
        self.close_channel()
