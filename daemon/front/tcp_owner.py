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
import sys
from pathlib import Path
from typing import Optional

# the peer's socket while the connection is up or the peer has half-closed it (ESTABLISHED,
# FIN_WAIT1, FIN_WAIT2); TIME_WAIT entries are listed as root's, so they never count
LIVE_STATES = ("01", "04", "05")
NOT_FOUND = -1


def _hex_address(ip: ipaddress._BaseAddress, port: int) -> str:
    """``ip:port`` in /proc/net/tcp's spelling: the address as 32-bit words in the
    kernel's (the machine's) byte order, then the port as 4 hex digits."""
    raw = ip.packed
    words = "".join(f"{int.from_bytes(raw[i : i + 4], sys.byteorder):08X}" for i in range(0, len(raw), 4))
    return f"{words}:{port:04X}"


def _spellings(host: str, port: int) -> list[tuple[str, str]]:
    """(table, spelling) pairs an endpoint may be listed under: an IPv4 address is in
    ``tcp``, or in ``tcp6`` as ``::ffff:a.b.c.d`` when its socket is a dual-stack IPv6
    one (Java and .NET open those even for 127.0.0.1); a mapped address likewise."""
    ip = ipaddress.ip_address(host.split("%")[0])
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.version == 4:
        mapped = ipaddress.IPv6Address("::ffff:" + str(ip))
        return [("tcp", _hex_address(ip, port)), ("tcp6", _hex_address(mapped, port))]
    return [("tcp6", _hex_address(ip, port))]


def owner_uid(peer: tuple, local: tuple, proc: Path = Path("/proc/net")) -> Optional[int]:
    """The uid owning the TCP socket at ``peer`` (host, port, ...) connected to
    ``local``; None if the kernel's tables cannot be read (not Linux); NOT_FOUND
    if they have no such connection (refuse it: the owner is unknown)."""
    readable = False
    for table, want_local in _spellings(peer[0], peer[1]):
        want_remote = dict(_spellings(local[0], local[1])).get(table)
        try:
            lines = (proc / table).read_text().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for line in lines:
            fields = line.split()
            if len(fields) > 7 and fields[1] == want_local and fields[2] == want_remote and fields[3] in LIVE_STATES:
                try:
                    return int(fields[7])
                except ValueError:
                    return NOT_FOUND
    return NOT_FOUND if readable else None


def refusal(peer: tuple, local: tuple) -> Optional[str]:
    """Why a connection from ``peer`` must be refused (another user's, or of no known
    owner), or None to serve it."""
    uid = owner_uid(peer, local)
    if uid is None or uid == os.getuid():
        return None
    who = "an unknown user's" if uid == NOT_FOUND else f"uid {uid}'s"
    return f"this listener serves only the user who runs it (uid {os.getuid()}); this connection is {who}"
