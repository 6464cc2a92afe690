"""A split GGUF for tests: a model file rewritten in parts (``NAME-0000i-of-0000N.gguf``,
each with llama.cpp's ``split.*`` keys), as llama.cpp's gguf-split writes them, with the
``gguf`` package. llama.cpp loads such a model from its first part."""

from __future__ import annotations

import math
from pathlib import Path

import gguf


def split_gguf(source: Path, dest: Path, parts: int) -> list[Path]:
    """``source`` in ``parts`` files named after ``dest`` (``dest``'s stem + -0000i-of-0000N.gguf)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    per_part = math.ceil(len(reader.tensors) / parts)
    copy_gguf(reader, gguf.GGUFWriter(dest, arch, split_max_tensors=per_part))
    return sorted(dest.parent.glob(f"{dest.stem}-*-of-*.gguf"))


def copy_gguf(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, value_of=lambda field: field.contents()) -> None:
    """Every key (``value_of(field)``: its value, as read unless changed) and tensor of ``reader``
    written by ``writer``, which is closed."""
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value_of(field), kind, sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data)
    writer.close()
