"""GGUF files that are only a header: an architecture and a token list, no tensors. Enough for what reads
headers (gguf_meta, drafter_auto); a file can be made to look as large as a real model (sparse: no disk
used) so that size rules apply to it."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Optional

from tandem.daemon.models.drafter_auto import vocab_of

STRING, ARRAY = 8, 9


def _s(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def write_header_gguf(path: Path, tokens: list[bytes], arch: str = "llama", size: Optional[int] = None) -> Path:
    kvs = [
        _s(b"general.architecture") + struct.pack("<I", STRING) + _s(arch.encode()),
        _s(b"tokenizer.ggml.model") + struct.pack("<I", STRING) + _s(b"gpt2"),
        _s(b"tokenizer.ggml.tokens")
        + struct.pack("<IIQ", ARRAY, STRING, len(tokens))
        + b"".join(_s(t) for t in tokens),
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs))
        if size is not None:
            f.truncate(size)  # (a hole: the size a real model has, no bytes written)
    return path


def tokens_of(path: Path) -> list[bytes]:
    """A real GGUF's token texts, in id order."""
    v = vocab_of(path)
    out, at = [], 0
    for _ in range(v.count):
        (n,) = struct.unpack_from("<Q", v.raw, at)
        out.append(v.raw[at + 8 : at + 8 + n])
        at += 8 + n
    return out
