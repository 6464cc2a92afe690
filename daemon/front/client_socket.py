"""The daemon's client socket: one ROUTER on a Unix socket only its user reaches.

``prepare_socket`` makes the socket's directory private (0700) and checks that
the path fits; ``InstanceLock`` keeps a second daemon off the same socket;
``ClientSocket`` binds the ROUTER 0600, refuses connections of other users
(SO_PEERCRED on the connection's fd, which ZeroMQ's monitor reports), reports
clients that disconnect, and sends without ever blocking on a slow client.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import stat
import struct
from pathlib import Path
from typing import Callable, Iterator

import zmq
from zmq.utils.monitor import recv_monitor_message

from tandem.protocol import Message, encode, endpoint
from tandem.protocol.paths import MAX_SOCKET_PATH_BYTES

from ..config import ServeError

log = logging.getLogger("tandem.daemon")

HARD_MESSAGE_CAP_BYTES = 64 * 1024 * 1024


def prepare_socket(path: Path) -> Path:
    """Create the socket's directory (0700) and check the path fits sun_path."""
    for candidate in (path, path.parent / ".target-4194304-999.ipc"):
        if len(os.fsencode(candidate)) > MAX_SOCKET_PATH_BYTES:
            raise ServeError(
                f"socket path {path} is too long for a Unix socket (limit {MAX_SOCKET_PATH_BYTES} bytes, "
                "with room for the worker sockets beside it); set TANDEM_SOCKET or --socket to a shorter path"
            )
    directory = path.parent
    if not directory.exists():
        old = os.umask(0o077)
        try:
            directory.mkdir(mode=0o700, parents=True)
        finally:
            os.umask(old)
    st = directory.stat()
    if st.st_uid != os.getuid():
        raise ServeError(f"socket directory {directory} belongs to another user (uid {st.st_uid}); pick another path")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise ServeError(
            f"socket directory {directory} is writable by other users (mode {mode:04o}): one of them could put "
            f"their own socket in its place. Run `chmod 700 {directory}`, or choose a socket in a directory of "
            "your own (--socket or TANDEM_SOCKET)"
        )
    if mode & 0o055:
        log.warning("socket directory %s is readable by others (mode %04o); 0700 is better", directory, mode)
    return directory


class InstanceLock:
    """One daemon per socket: an flock on ``<socket>.lock`` holding the pid."""

    def __init__(self, socket_path: Path):
        self.path = socket_path.with_name(socket_path.name + ".lock")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            raise ServeError(
                f"another tandem daemon (pid {holder}) is already serving {socket_path}. "
                f"Stop it with `tandem stop`, or start this one on another socket (--socket or TANDEM_SOCKET)."
            ) from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        os.close(self.fd)


class ClientSocket:
    def __init__(self, zctx: zmq.Context, path: Path, client_queue: int, on_gone: Callable[[bytes], None]):
        """Bind ``path`` (the caller holds its InstanceLock). ``on_gone(identity)``:
        a client that sent requests disconnected."""
        self.path = path
        self.on_gone = on_gone
        if path.exists() or path.is_symlink():
            path.unlink()  # stale: the caller holds the lock, so nobody serves it
        self.sock = zctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.SNDHWM, client_queue)
        # bodies over MAX_MESSAGE_BYTES get an error reply; ZeroMQ drops a peer that
        # sends a frame over this hard cap (no reply is possible: nothing was read)
        self.sock.setsockopt(zmq.MAXMSGSIZE, HARD_MESSAGE_CAP_BYTES)
        self.sock.setsockopt(zmq.LINGER, 1000)
        old = os.umask(0o177)
        try:
            self.sock.bind(endpoint(path))
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        # Client disconnects: the monitor reports the connection's fd; each request
        # frame carries its source fd, which maps the fd to the client's identity.
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.peer_fds: dict[int, bytes] = {}
        self.foreign_fds: set[int] = set()  # connections of another user, refused

    def close(self, linger: int = 1000) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=linger)
        self.path.unlink(missing_ok=True)

    def receive(self, limit: int = 256) -> Iterator[tuple[bytes, list[bytes]]]:
        """The requests waiting, as (client identity, frames), at most ``limit``."""
        for _ in range(limit):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity = frames[0].bytes
            # ZeroMQ queues a connection's "accepted" event before it reads any of
            # its data, and an earlier connection's "disconnected" event on the same
            # fd before that: draining the monitor now retires any earlier owner of
            # this fd, so a late disconnect of a previous client can never cancel
            # this one's request (the fd is reused at once)
            self.drain_monitor()
            fd = frames[0].get(zmq.SRCFD)
            if fd in self.foreign_fds:
                continue  # another user's connection, being closed: no reply
            self.peer_fds[fd] = identity
            yield identity, [f.bytes for f in frames[1:]]

    def drain_monitor(self) -> None:
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            fd = event["value"]
            if event["event"] == zmq.EVENT_ACCEPTED:
                self.foreign_fds.discard(fd)  # a new connection on this fd: judge it afresh
                self._check_peer(fd)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.foreign_fds.discard(fd)
                identity = self.peer_fds.pop(fd, None)
                if identity is not None:
                    self.on_gone(identity)

    def _check_peer(self, fd: int) -> None:
        """A new connection: refuse it unless it is this user's. ZeroMQ does not
        expose SO_PEERCRED, but its monitor gives the accepted socket's fd; a dup
        of it answers getsockopt, and shutting the dup down closes the connection."""
        try:
            with socket.fromfd(fd, socket.AF_UNIX, socket.SOCK_STREAM) as dup:
                if dup.getsockopt(socket.SOL_SOCKET, socket.SO_DOMAIN) != socket.AF_UNIX:
                    return  # the fd was closed and reused meanwhile (e.g. a metrics scrape): not ours to judge
                pid, uid, _gid = struct.unpack("3i", dup.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
                if uid == os.getuid():
                    return
                self.foreign_fds.add(fd)
                log.warning(
                    "refused a connection from uid %d (pid %d): this daemon serves uid %d only", uid, pid, os.getuid()
                )
                dup.shutdown(socket.SHUT_RDWR)
        except OSError as exc:
            # Gone already (ZeroMQ closed the fd): its messages are served like any client's that
            # left. The socket file's 0600 mode is what keeps other users out; this check is the
            # second line, for a socket whose mode someone loosened.
            log.debug("could not check a new connection's user (it is gone): %s", exc)

    def send(self, identity: bytes, msg: Message) -> bool:
        return self.send_frames(identity, encode(msg))

    def send_frames(self, identity: bytes, frames: list[bytes]) -> bool:
        """False when the client is gone or not reading (its queue is full)."""
        try:
            self.sock.send_multipart([identity, *frames], flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            log.warning("client %s is not reading its replies; dropping it", identity.hex())
            return False
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return False
            raise
