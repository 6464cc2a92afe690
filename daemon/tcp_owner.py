"""Who is on the other end of a loopback TCP connection: the uid that owns the peer's socket.

A Unix socket tells its peer's uid (SO_PEERCRED); a TCP socket does not. On Linux
the kernel lists every TCP socket in ``/proc/net/tcp`` and ``/proc/net/tcp6``
with its owner's uid, so a loopback listener can find the connecting socket's
entry (its local address is the peer's address, its remote address is ours) and
refuse another user's, as the daemon's Unix socket does. Elsewhere (no such
files) the owner is unknown: None.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path
from typing import Optional

ESTABLISHED = "01"


def _hex_address(host: str, port: int) -> tuple[str, str]:
    """``(host, port)`` in /proc/net/tcp's spelling: the address as the kernel's words
    in host byte order (little-endian here), the port as 4 hex digits."""
    ip = ipaddress.ip_address(host.split("%")[0])
    raw = ip.packed
    words = "".join(raw[i : i + 4][::-1].hex().upper() for i in range(0, len(raw), 4))
    return words, f"{port:04X}"


NOT_FOUND = -1


def owner_uid(peer: tuple, local: tuple, proc: Path = Path("/proc/net")) -> Optional[int]:
    """The uid owning the TCP socket at ``peer`` (host, port, ...) connected to
    ``local``; None if the kernel's table cannot be read (not Linux); NOT_FOUND
    if it has no such connection (refuse it: the owner is unknown)."""
    family = socket.AF_INET6 if ":" in peer[0] else socket.AF_INET
    table = proc / ("tcp6" if family == socket.AF_INET6 else "tcp")
    want_local = ":".join(_hex_address(peer[0], peer[1]))
    want_remote = ":".join(_hex_address(local[0], local[1]))
    try:
        lines = table.read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) > 7 and fields[1] == want_local and fields[2] == want_remote and fields[3] == ESTABLISHED:
            try:
                return int(fields[7])
            except ValueError:
                return NOT_FOUND
    return NOT_FOUND


def refusal(peer: tuple, local: tuple) -> Optional[str]:
    """Why a connection from ``peer`` must be refused (another user's, or of no known
    owner), or None to serve it."""
    uid = owner_uid(peer, local)
    if uid is None or uid == os.getuid():
        return None
    who = "an unknown user's" if uid == NOT_FOUND else f"uid {uid}'s"
    return f"this listener serves only the user who runs it (uid {os.getuid()}); this connection is {who}"
