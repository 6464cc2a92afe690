"""Where the daemon's socket lives. Client and daemon resolve it the same way.

1. ``$TANDEM_SOCKET`` if set;
2. else ``$XDG_RUNTIME_DIR/tandem/tandem.sock``;
3. else ``/tmp/tandem-<uid>/tandem.sock``.

The directory is created 0700 and the socket is chmod 0600 by the daemon.
The ZeroMQ endpoint is ``ipc://<path>``.
"""

from __future__ import annotations

import os
from pathlib import Path

# sockaddr_un.sun_path is 108 bytes including the terminating NUL.
MAX_SOCKET_PATH_BYTES = 107


def default_socket_path() -> Path:
    explicit = os.environ.get("TANDEM_SOCKET")
    if explicit:
        return Path(explicit)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "tandem" / "tandem.sock"
    return Path("/tmp") / f"tandem-{os.getuid()}" / "tandem.sock"


def endpoint(path: Path | str) -> str:
    return f"ipc://{os.fspath(path)}"
