"""A GGUF file's metadata (architecture, size label, quantization, context
length, chat template) without loading the model, for ``/api/tags``,
``/api/show`` and ``tandem show``.

It reads the header's key-value section only and seeks past arrays it does not
need (the tokenizer's 50k-150k entries), so it takes milliseconds; the ``gguf``
package's ``GGUFReader`` parses every field and tensor and took 2 s for
SmolLM2-135M here, on every call. Format: github.com/ggml-org/ggml docs/gguf.md
(version 2 and 3: little-endian, u64 counts and string lengths).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any, BinaryIO

MAGIC = b"GGUF"
MAX_STRING = 16 << 20  # a chat template is a few KiB; anything this long is a damaged file
MAX_KEPT_STRING = 1 << 20  # longer values (other than the chat template) are not kept
MAX_KV = 1 << 16
MAX_HEADER = 256 << 20  # the tokenizer of a 150k vocabulary is a few MiB: beyond this, a damaged file

# value types
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

# general.file_type (llama.cpp's llama_ftype) -> Ollama's quantization_level names
FILE_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
}


class GGUFError(Exception):
    """Not a GGUF file this reader understands (the message says why)."""


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise GGUFError("the file ends inside its header")
    return struct.unpack(fmt, data)[0]


def _string(f: BinaryIO) -> str:
    n = _read(f, "<Q")
    if n > MAX_STRING:
        raise GGUFError(f"a string of {n} bytes in the header")
    data = f.read(n)
    if len(data) != n:
        raise GGUFError("the file ends inside its header")
    return data.decode("utf-8", "replace")


def _value(f: BinaryIO, kind: int, keep_arrays: bool, size: int, depth: int = 0) -> Any:
    """One value; ``size`` is the file's, so no count may claim more items than the bytes left."""
    if kind in _SCALARS:
        return _read(f, _SCALARS[kind])
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        if depth > 0:
            raise GGUFError("an array inside an array")  # the format allows it; no model's header has one
        item, count = _read(f, "<I"), _read(f, "<Q")
        smallest = struct.calcsize(_SCALARS[item]) if item in _SCALARS else 8  # a string: its u64 length at least
        if count * smallest > size - f.tell():
            raise GGUFError(f"an array of {count} items, more than the file holds")
        if item in _SCALARS and not keep_arrays:
            f.seek(smallest * count, 1)
            return None
        if not keep_arrays:
            for _ in range(count):
                _value(f, item, False, size, depth + 1)
            return None
        return [_value(f, item, False, size, depth + 1) for _ in range(count)]
    raise GGUFError(f"unknown value type {kind}")


FIM_PREFIXES = {"<|fim_prefix|>", "<fim_prefix>", "<fim-prefix>", "<PRE>", "▁<PRE>"}  # Qwen, StarCoder, ..., CodeLlama


def _has_fim_tokens(f: BinaryIO, size: int) -> bool:
    """Walk the vocabulary array (strings), noting a fill-in-the-middle prefix token."""
    item, count = _read(f, "<I"), _read(f, "<Q")
    if item != _STRING or count * 8 > size - f.tell():
        raise GGUFError("tokenizer.ggml.tokens is not an array of strings that fits the file")
    found = False
    for _ in range(count):
        n = _read(f, "<Q")
        if n > size - f.tell():
            raise GGUFError("a token longer than the file")
        if n > 64:
            f.seek(n, 1)
            continue
        if f.read(n).decode("utf-8", "replace") in FIM_PREFIXES:
            found = True
    return found


def header(f: BinaryIO, path: str | Path) -> tuple[int, int, int]:
    """An open GGUF file's magic, version and counts checked: (the file's size, its tensors, its
    metadata keys); ``f`` is left at the first key."""
    size = os.fstat(f.fileno()).st_size
    if f.read(4) != MAGIC:
        raise GGUFError(f"{path} is not a GGUF file")
    version = _read(f, "<I")
    if version not in (2, 3):
        raise GGUFError(f"GGUF version {version} (this reader knows 2 and 3)")
    n_tensors, n_kv = _read(f, "<Q"), _read(f, "<Q")
    if n_kv > MAX_KV:
        raise GGUFError(f"{n_kv} metadata keys")
    return size, n_tensors, n_kv


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Every key of the header (arrays of more than 64 entries as None)."""
    with open(path, "rb") as f:
        size, _tensors, n_kv = header(f, path)
        return _read_keys(f, path, size, n_kv)


MAX_TENSORS = 1 << 20


def weight_profile(path: str | Path) -> tuple[int, float]:
    """(parameters, bits per parameter) of a model file's weight matrices (its tensors of two or
    more dimensions), from the tensor table: each tensor's bytes run to the next one's offset."""
    with open(path, "rb") as f:
        size, n_tensors, n_kv = header(f, path)
        meta = _read_keys(f, path, size, n_kv)
        if n_tensors > MAX_TENSORS:
            raise GGUFError(f"{n_tensors} tensors")
        table = []  # (offset, elements, is a matrix)
        for _ in range(n_tensors):
            _string(f)
            n_dims = _read(f, "<I")
            if not 1 <= n_dims <= 4:
                raise GGUFError(f"a tensor of {n_dims} dimensions")
            elements = 1
            for _ in range(n_dims):
                elements *= _read(f, "<Q")
            _read(f, "<I")  # its type
            table.append((_read(f, "<Q"), elements, n_dims >= 2))
            if f.tell() > MAX_HEADER:
                raise GGUFError(f"the header is over {MAX_HEADER >> 20} MiB")
        alignment = meta.get("general.alignment") or 32
        if not isinstance(alignment, int) or alignment <= 0:
            raise GGUFError(f"general.alignment {alignment!r}")
        data = -(-f.tell() // alignment) * alignment
    table.sort()
    params = bits = 0
    for i, (offset, elements, matrix) in enumerate(table):
        end = table[i + 1][0] if i + 1 < len(table) else size - data
        if end < offset:
            raise GGUFError("a tensor lies outside the file")
        if matrix:
            params += elements
            bits += 8 * (end - offset)
    return params, (bits / params if params else 0.0)


def _read_keys(f: BinaryIO, path: str | Path, size: int, n_kv: int) -> dict[str, Any]:
    """The key-value section (``f`` at its first key; left after its last)."""
    out: dict[str, Any] = {}
    for _ in range(n_kv):
        key = _string(f)
        kind = _read(f, "<I")
        if kind == _ARRAY and key == "tokenizer.ggml.tokens":
            value = None
            out["tandem.fim"] = _has_fim_tokens(f, size)  # read while skipping: no second pass
        elif kind == _ARRAY:
            at = f.tell()
            _item, count = _read(f, "<I"), _read(f, "<Q")
            f.seek(at)
            value = _value(f, kind, keep_arrays=count <= 64, size=size)
        else:
            value = _value(f, kind, False, size)
        if isinstance(value, str) and len(value) > MAX_KEPT_STRING and key != "tokenizer.chat_template":
            value = None
        if isinstance(value, float) and value != value:
            value = None  # NaN: not JSON
        out[key] = value
        if f.tell() > MAX_HEADER:
            raise GGUFError(f"the header is over {MAX_HEADER >> 20} MiB")
    return out


def facts(path: str | Path) -> dict[str, Any]:
    """What a client is shown about a model file: architecture, family, size
    label, quantization, trained context length, chat template (empty when the
    file cannot be read)."""
    try:
        meta = read_metadata(path)
    except Exception:  # any damaged or hostile file: nothing known, never a failed request
        return {}
    arch = str(meta.get("general.architecture") or "")
    file_type = meta.get("general.file_type")
    return {
        "architecture": arch,
        "family": arch,
        "name": meta.get("general.name") or "",
        "parameter_size": str(meta.get("general.size_label") or ""),
        "quantization": FILE_TYPES.get(file_type, "unknown") if isinstance(file_type, int) else "unknown",
        "context_length": meta.get(f"{arch}.context_length"),
        "chat_template": meta.get("tokenizer.chat_template") or "",
        "fim": bool(meta.get("tandem.fim")),
        "metadata": {k: v for k, v in meta.items() if v is not None and not k.startswith(("tokenizer.", "tandem."))},
    }
