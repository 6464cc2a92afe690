"""Exceptions raised by the tandem clients."""

from __future__ import annotations

from typing import Optional


class TandemError(Exception):
    """Base class of every error the client raises."""


class InvalidRequest(TandemError):
    """The request was refused before it was sent: a parameter is out of range."""


class DaemonNotRunning(TandemError):
    """No daemon listens on the socket. The message says how to start one."""


class UntrustedSocket(TandemError):
    """The socket (or its directory) could belong to someone else: nothing was sent.
    The message names the path and the fix."""


class DaemonTimeout(TandemError):
    """The daemon did not answer in time."""


class DaemonGone(TandemError):
    """The daemon went away (stopped, crashed, or stopped answering ZeroMQ's
    heartbeat) while a reply was awaited. The next request connects afresh,
    with the socket's checks (``UntrustedSocket``) run again."""


class RequestFailed(TandemError):
    """The daemon answered a request with an ``error`` message."""

    def __init__(self, code: int, name: str, message: str, request_id: Optional[str]):
        super().__init__(f"{name} ({code}): {message}")
        self.code = code
        self.name = name
        self.message = message
        self.request_id = request_id


class QueueFull(TandemError):
    """The daemon answered ``busy``: its request queue is full. Retry later."""

    def __init__(self, message: str, queue_length: int, max_queue: int):
        super().__init__(message)
        self.queue_length = queue_length
        self.max_queue = max_queue
