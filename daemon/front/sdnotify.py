"""systemd's service notification protocol, spoken directly.

With ``Type=notify`` systemd passes ``$NOTIFY_SOCKET``: a Unix datagram socket
(a path, or an abstract name written with a leading ``@``). A service sends
newline-separated ``KEY=VALUE`` assignments to it: ``READY=1`` once it serves,
``RELOADING=1`` / ``STOPPING=1`` around a reload and at shutdown, ``STATUS=...``
for ``systemctl status``, ``WATCHDOG=1`` at least every ``$WATCHDOG_USEC``
microseconds when the unit has ``WatchdogSec=``, and ``EXTEND_TIMEOUT_USEC=...``
to ask for more start-up time (a model download). See sd_notify(3); no
library is needed for a single sendto().

Outside systemd (no ``$NOTIFY_SOCKET``) every call is a no-op. The variables are
removed from the environment once read, so the worker processes this daemon
starts do not inherit them and cannot speak for it.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import MutableMapping, Optional

log = logging.getLogger("tandem.daemon")


def socket_address(value: str) -> str | bytes:
    """``$NOTIFY_SOCKET`` as an AF_UNIX address: ``@name`` is the abstract ``\\0name``."""
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    return value


class Notifier:
    def __init__(self, address: Optional[str], watchdog_usec: int = 0):
        self.address = address
        self.watchdog_interval = watchdog_usec / 2e6 if watchdog_usec > 0 else 0.0  # ping twice per period
        self._next_ping = 0.0
        self._sock: Optional[socket.socket] = None
        self._warned = False

    @classmethod
    def from_environment(cls, environ: MutableMapping[str, str] = os.environ) -> "Notifier":
        address = environ.pop("NOTIFY_SOCKET", None) or None
        usec_text = environ.pop("WATCHDOG_USEC", "")
        pid_text = environ.pop("WATCHDOG_PID", "")
        usec = int(usec_text) if usec_text.isdigit() else 0
        if pid_text and pid_text.isdigit() and int(pid_text) != os.getpid():
            usec = 0  # the watchdog is meant for another process
        if address and address[0] not in "/@":
            log.warning("ignoring NOTIFY_SOCKET=%r: not a path or an abstract socket name", address)
            address = None
        return cls(address, usec)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, **fields: object) -> bool:
        """Send ``KEY=VALUE`` lines (``ready=1`` becomes ``READY=1``). False when not under systemd or it failed."""
        if self.address is None:
            return False
        payload = "\n".join(f"{k.upper()}={v}" for k, v in fields.items()).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(payload, socket_address(self.address))
            return True
        except OSError as exc:
            if not self._warned:
                log.warning("could not notify systemd at %s: %s", self.address, exc)
                self._warned = True
            return False

    def ready(self, status: str) -> None:
        self.send(ready=1, status=status)

    def reloading(self) -> None:
        self.send(reloading=1, monotonic_usec=time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000)

    def stopping(self, status: str = "stopping") -> None:
        self.send(stopping=1, status=status)

    def status(self, status: str) -> None:
        self.send(status=status)

    def extend_timeout(self, seconds: float) -> None:
        self.send(extend_timeout_usec=int(seconds * 1e6))

    def watchdog(self, now: Optional[float] = None) -> None:
        """Ping the watchdog if it is due. Call this from the main loop only, so that
        a loop that hangs stops the pings and systemd restarts the daemon."""
        if not self.watchdog_interval or self.address is None:
            return
        now = time.monotonic() if now is None else now
        if now >= self._next_ping:
            self._next_ping = now + self.watchdog_interval
            self.send(watchdog=1)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def parse(datagram: bytes) -> dict[str, str]:
    """A notification as a dict (for tests and tools)."""
    out = {}
    for line in datagram.decode().splitlines():
        key, _, value = line.partition("=")
        out[key] = value
    return out


__all__ = ["Notifier", "parse", "socket_address"]
