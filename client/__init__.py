"""Python clients for the tandem daemon: ``Client`` (blocking) and ``AsyncClient`` (asyncio)."""

from .aio import AsyncClient, AsyncStream
from .client import Client, Stream
from .core import assistant_message
from .errors import (
    DaemonGone,
    DaemonNotRunning,
    DaemonTimeout,
    InvalidRequest,
    QueueFull,
    RequestFailed,
    TandemError,
    UntrustedSocket,
)

__all__ = [
    "AsyncClient",
    "AsyncStream",
    "Client",
    "Stream",
    "assistant_message",
    "DaemonGone",
    "DaemonNotRunning",
    "DaemonTimeout",
    "InvalidRequest",
    "QueueFull",
    "RequestFailed",
    "TandemError",
    "UntrustedSocket",
]
