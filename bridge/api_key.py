"""The bridge's API key: for setups where the same-user check on its loopback
port cannot run (no ``/proc/net/tcp``: not Linux, or a /proc without it), or
for a user who wants a key anyway.

The key lives in ``$XDG_STATE_HOME/tandem/api-key`` (0600, created with
``O_EXCL | O_NOFOLLOW``; a file that is not the user's own private file is
refused, never read). ``tandem key`` prints it, creating it if needed;
``tandem key --new`` replaces it. A client sends it as ``Authorization: Bearer
KEY`` (what OpenAI's clients send for ``api_key``) or ``x-api-key: KEY``.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from pathlib import Path
from typing import Optional

MODES = ("auto", "on", "off")


class KeyFileError(Exception):
    """The key file cannot be trusted or read; the message names the fix."""


def key_path() -> Path:
    from tandem.daemon.config import default_state_dir

    return default_state_dir() / "api-key"


def read_key(path: Path) -> Optional[str]:
    """The key in ``path``; None if there is none. ``KeyFileError`` for a file
    that is not this user's private regular file, or holds no key."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise KeyFileError(f"cannot read the API key file {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise KeyFileError(
                f"the API key file {path} is not your private file (owner uid {st.st_uid}, mode "
                f"{stat.S_IMODE(st.st_mode):04o}); remove it and run `tandem key --new`"
            )
        key = f.read(4096).decode("ascii", "replace").strip()
    if not key:
        raise KeyFileError(f"the API key file {path} is empty; run `tandem key --new`")
    return key


def ensure_key(path: Path, new: bool = False) -> str:
    """The key, created (or, with ``new``, replaced) as a 0600 file if needed."""
    if not new:
        key = read_key(path)
        if key is not None:
            return key
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = "tandem-" + secrets.token_urlsafe(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    try:
        if new:
            os.replace(tmp, path)
            return key
        try:
            os.link(tmp, path)  # only if there is still none: two first uses at once agree on one key
        except FileExistsError:
            return read_key(path) or key
        return key
    finally:
        tmp.unlink(missing_ok=True)


def uid_check_runs(proc: Path = Path("/proc/net")) -> bool:
    """Can the bridge learn who owns a connecting socket here (tcp_owner)?"""
    return any(os.access(proc / table, os.R_OK) for table in ("tcp", "tcp6"))


def required_key(mode: str, path: Path, proc: Path = Path("/proc/net")) -> Optional[str]:
    """The key requests must carry under ``--api-key MODE``, or None (not
    required): ``on`` always, ``auto`` only where the same-user check cannot
    run, ``off`` never."""
    if mode not in MODES:
        raise ValueError(f"--api-key must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "off" or (mode == "auto" and uid_check_runs(proc)):
        return None
    return ensure_key(path)


def presented(headers) -> str:
    """The key a request carries (``Authorization: Bearer`` or ``x-api-key``), or ""."""
    auth = (headers.get("Authorization") or "").strip()
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return (headers.get("x-api-key") or "").strip()


def matches(given: str, key: str) -> bool:
    return hmac.compare_digest(given.encode(), key.encode())
