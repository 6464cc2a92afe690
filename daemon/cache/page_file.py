"""The disk tier's files: their names, their format, and how one is written.

disk_cache.py decides which pages go to disk, which are read back and which are
evicted; this module says what the files hold and checks what is read.

**Names.** A bucket is named by a hash of the page format version, the model
file's identity, the KV state's layout and the page size (``bucket_name``); a
page by a hash of its parent's key and its own tokens (``child_key``; the root's
key is the bucket's), so a page's name stands for its whole prefix. A page
file is ``<key>.page`` (``page_name``).

**A page file** is a header (magic, format version, page size, depth, bucket,
key, parent key, payload length, payload crc32), the page's tokens (int32,
little-endian), then the page's bytes as they are in the arena.
``PageFormat.decode`` checks all of it but the file's owner and mode (the
caller opens it with ``arena.open_own``): the format, the bucket, that the key
is the hash of the parent and tokens asked for, the length (a truncated file)
and the checksum (a file half-written when the power went).

**The index** (``encode_index``): a msgpack map of the format version, the
bucket, and each page's key, parent, depth, size and last use.

**Writing** (``write_atomic``): under a temporary name, then renamed, so a name
never holds a half-written file unless the power went between the two (which
the checksum catches); the index is also fsync'd, with its directory.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import zlib
from pathlib import Path
from typing import Sequence

import msgpack

FORMAT_VERSION = 1
MAGIC = b"TDMKVPG\0"
HEADER = struct.Struct("<8sIII16s16s16sQI")  # magic, version, page_tokens, depth, bucket, key, parent, length, crc
KEY_BYTES = 16
BUCKET_NAME = re.compile(r"[0-9a-f]{32}")


def bucket_name(identity: str, layout: str, page_tokens: int) -> str:
    h = hashlib.sha256(f"{FORMAT_VERSION}\0{identity}\0{layout}\0{page_tokens}".encode())
    return h.hexdigest()[: 2 * KEY_BYTES]


def child_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + struct.pack(f"<{len(tokens)}i", *tokens), digest_size=KEY_BYTES).digest()


def page_name(key: bytes) -> str:
    return key.hex() + ".page"


class PageFileError(Exception):
    """A page file that must not be used; the message says why."""


class PageFormat:
    """The page files of one bucket: pages of ``page_tokens`` tokens and
    ``page_bytes`` bytes, under the bucket's key."""

    def __init__(self, bucket_key: bytes, page_tokens: int, page_bytes: int):
        self.bucket_key = bucket_key
        self.page_tokens = page_tokens
        self.page_bytes = page_bytes
        self.file_bytes = HEADER.size + 4 * page_tokens + page_bytes

    def encode(self, key: bytes, parent: bytes, depth: int, tokens: Sequence[int], payload: bytes) -> bytes:
        """The file of the page ``key``: ``tokens`` after ``parent``, at ``depth``."""
        header = HEADER.pack(
            MAGIC,
            FORMAT_VERSION,
            self.page_tokens,
            depth,
            self.bucket_key,
            key,
            parent,
            len(payload),
            zlib.crc32(payload),
        )
        return header + struct.pack(f"<{len(tokens)}i", *tokens) + payload

    def decode(self, raw: bytes, key: bytes, parent: bytes, tokens: Sequence[int], depth: int) -> bytes:
        """The page bytes of a file read whole (``raw``) that must be the page
        ``key``; ``PageFileError`` where it is not, or not whole."""
        if len(raw) < HEADER.size:
            raise PageFileError(f"{len(raw)} bytes: shorter than a page's header (truncated)")
        magic, version, page_tokens, f_depth, bucket, f_key, f_parent, length, crc = HEADER.unpack_from(raw)
        if magic != MAGIC:
            raise PageFileError("not a tandem page file")
        if version != FORMAT_VERSION:
            raise PageFileError(f"page format {version}, this tandem reads {FORMAT_VERSION} (an older tandem's)")
        if bucket != self.bucket_key:
            raise PageFileError("written for another model file, layout or page size")
        if page_tokens != self.page_tokens or length != self.page_bytes:
            raise PageFileError("pages of another size")
        if f_key != key or f_parent != parent or f_depth != depth or child_key(parent, tokens) != key:
            raise PageFileError("not the page of these tokens")
        if len(raw) != self.file_bytes:
            raise PageFileError(f"holds {len(raw)} bytes, not {self.file_bytes} (truncated)")
        at = HEADER.size
        if list(struct.unpack_from(f"<{page_tokens}i", raw, at)) != list(tokens):
            raise PageFileError("not the page of these tokens")
        payload = raw[at + 4 * page_tokens :]
        if zlib.crc32(payload) != crc:
            raise PageFileError("checksum mismatch (written only in part, or damaged)")
        return payload


def encode_index(bucket: str, rows: list[list]) -> bytes:
    """The index of ``bucket``: ``rows`` of [key, parent, depth, size, last use], parents first."""
    return msgpack.packb({"version": FORMAT_VERSION, "bucket": bucket, "pages": rows}, use_bin_type=True)


def decode_index(raw: bytes, bucket: str) -> list[tuple[bytes, bytes, int, int, float]]:
    """The rows of an index read whole; an exception where it is not one of
    ``bucket`` in this format."""
    data = msgpack.unpackb(raw, strict_map_key=False)
    if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION or data.get("bucket") != bucket:
        raise ValueError("written by another version or for another bucket")
    out = []
    for row in data["pages"]:
        key, parent, depth, size, last_used = row
        if not (isinstance(key, bytes) and isinstance(parent, bytes) and len(key) == KEY_BYTES):
            raise ValueError("a malformed row")
        out.append((key, parent, int(depth), int(size), float(last_used)))
    return out


def write_atomic(path: Path, data: bytes, sync: bool = False) -> None:
    """``data`` as the file ``path`` (0600, never through a symbolic link), under
    a temporary name then renamed; with ``sync``, on disk with its name when this returns."""
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if sync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    if sync:
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
