"""Cutting llama.cpp's sequence state into token pages and putting a prefix back.

(Groundwork for the prefix-cache issue.) ``llama_state_seq_get_data`` for one
sequence in llama-cpp-python 0.3.36 (src/llama-kv-cache.cpp, state_write) is:

    8 bytes       (opaque; kept as read, and required equal at assembly)
    u32 n_stream  (1), u32 cell_count
    per cell:     i32 pos, u32 n_seq_id, i32 seq_id[n_seq_id]
    u32 v_trans, u32 n_layer
    per layer:    i32 k_type, u64 k_row_bytes, cell_count rows of k_row_bytes
    per layer:    v_trans == 0: i32 v_type, u64 v_row_bytes, cell_count rows
                  v_trans == 1: i32 v_type, u32 v_elem_bytes, u32 n_embd_v,
                                then for each of n_embd_v dims, cell_count elements

``parse`` reads that and checks that the sizes add up to the blob exactly;
anything else raises ``StateFormatError``, so a llama.cpp whose format changed
fails loudly instead of restoring garbage. A page holds cells [a, b): their
metadata, then per layer their K rows, then per layer their V (rows, or for
each dimension the b - a elements). ``assemble`` concatenates pages back into
a blob that ``llama_state_seq_set_data`` accepts.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np


class StateFormatError(Exception):
    """The sequence state is not in the format this module knows."""


@dataclass(frozen=True)
class Layout:
    header: bytes
    v_trans: bool
    k: tuple[tuple[int, int], ...]  # per layer: (k_type, k_row_bytes)
    v: tuple[tuple[int, int, int], ...]  # per layer: (v_type, bytes per cell row or element, n_embd_v (1 if rows))

    @property
    def bytes_per_cell(self) -> int:
        meta = 12  # pos, n_seq_id = 1, seq_id
        return meta + sum(rb for _, rb in self.k) + sum(eb * n for _, eb, n in self.v)

    def page_bytes(self, cells: int) -> int:
        return cells * self.bytes_per_cell


@dataclass
class Parsed:
    layout: Layout
    cell_count: int
    meta: np.ndarray  # (cell_count, 3) int32: pos, n_seq_id, seq_id
    k: list[np.ndarray]  # per layer (cell_count, k_row_bytes) uint8
    v: list[np.ndarray]  # per layer (n_embd_v, cell_count * elem) uint8 if v_trans, else (cell_count, row) uint8


class _Reader:
    def __init__(self, buf: memoryview):
        self.buf = buf
        self.at = 0

    def take(self, n: int) -> memoryview:
        if self.at + n > len(self.buf):
            raise StateFormatError(f"state ends at {len(self.buf)} bytes, expected at least {self.at + n}")
        out = self.buf[self.at : self.at + n]
        self.at += n
        return out

    def unpack(self, fmt: str):
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt)))


def parse(blob: bytes | memoryview) -> Parsed:
    buf = memoryview(blob).cast("B")
    r = _Reader(buf)
    header = bytes(r.take(8))
    n_stream, cell_count = r.unpack("II")
    if n_stream != 1:
        raise StateFormatError(f"expected one stream, found {n_stream}")
    meta = (
        np.frombuffer(r.take(12 * cell_count), dtype="<i4").reshape(cell_count, 3)
        if cell_count
        else np.zeros((0, 3), dtype="<i4")
    )
    if cell_count and not (np.all(meta[:, 1] == 1) and np.all(meta[:, 0] == np.arange(cell_count))):
        raise StateFormatError("cells are not one sequence at positions 0, 1, 2, ... (n_seq_id != 1 or gaps)")
    v_trans, n_layer = r.unpack("II")
    if v_trans not in (0, 1) or not 0 < n_layer < 1024:
        raise StateFormatError(f"implausible v_trans {v_trans} / n_layer {n_layer}")
    k_layout, k = [], []
    for _ in range(n_layer):
        k_type, row = r.unpack("iQ")
        k_layout.append((k_type, row))
        k.append(np.frombuffer(r.take(row * cell_count), dtype=np.uint8).reshape(cell_count, row))
    v_layout, v = [], []
    for _ in range(n_layer):
        if v_trans:
            v_type, elem, n_embd = r.unpack("iII")
            v_layout.append((v_type, elem, n_embd))
            v.append(
                np.frombuffer(r.take(elem * n_embd * cell_count), dtype=np.uint8).reshape(n_embd, cell_count * elem)
            )
        else:
            v_type, row = r.unpack("iQ")
            v_layout.append((v_type, row, 1))
            v.append(np.frombuffer(r.take(row * cell_count), dtype=np.uint8).reshape(cell_count, row))
    if r.at != len(buf):
        raise StateFormatError(f"{len(buf) - r.at} bytes left over after the last layer: the format changed")
    layout = Layout(header, bool(v_trans), tuple(k_layout), tuple(v_layout))
    return Parsed(layout, cell_count, meta, k, v)


def cut(p: Parsed, start: int, stop: int) -> bytes:
    """The page of cells [start, stop)."""
    if not 0 <= start < stop <= p.cell_count:
        raise ValueError(f"cells [{start}, {stop}) outside 0..{p.cell_count}")
    parts = [p.meta[start:stop].tobytes()]
    parts += [k[start:stop].tobytes() for k in p.k]
    if p.layout.v_trans:
        parts += [v[:, start * elem : stop * elem].tobytes() for v, (_, elem, _) in zip(p.v, p.layout.v)]
    else:
        parts += [v[start:stop].tobytes() for v in p.v]
    return b"".join(parts)


def assemble(layout: Layout, pages: list[bytes | memoryview], cells_per_page: int) -> bytes:
    """A state blob of ``len(pages) * cells_per_page`` cells from consecutive pages."""
    n = cells_per_page
    page_bytes = layout.page_bytes(n)
    views = []
    for i, page in enumerate(pages):
        mv = memoryview(page).cast("B")
        if len(mv) != page_bytes:
            raise StateFormatError(f"page {i} holds {len(mv)} bytes, expected {page_bytes}")
        views.append(np.frombuffer(mv, dtype=np.uint8))
    cells = n * len(pages)
    # offsets of each part inside a page
    offsets, at = [], 12 * n
    for _, row in layout.k:
        offsets.append((at, row * n))
        at += row * n
    v_offsets = []
    for _, elem, n_embd in layout.v:
        v_offsets.append((at, elem * n_embd * n))
        at += elem * n_embd * n
    out = [layout.header, struct.pack("<II", 1, cells)]
    out += [bytes(pg[: 12 * n]) for pg in views]
    out.append(struct.pack("<II", int(layout.v_trans), len(layout.k)))
    for (k_type, row), (off, size) in zip(layout.k, offsets):
        out.append(struct.pack("<iQ", k_type, row))
        out += [bytes(pg[off : off + size]) for pg in views]
    for (v_type, elem, n_embd), (off, size) in zip(layout.v, v_offsets):
        if layout.v_trans:
            out.append(struct.pack("<iII", v_type, elem, n_embd))
            # each page holds (n_embd, n * elem); the state wants (n_embd, cells * elem)
            blocks = [pg[off : off + size].reshape(n_embd, n * elem) for pg in views]
            out.append(np.concatenate(blocks, axis=1).tobytes() if blocks else b"")
        else:
            out.append(struct.pack("<iQ", v_type, elem))
            out += [bytes(pg[off : off + size]) for pg in views]
    blob = b"".join(out)
    # positions must run 0..cells-1: pages cut from other sequences at other offsets would not
    meta = np.frombuffer(blob[16 : 16 + 12 * cells], dtype="<i4").reshape(cells, 3) if cells else None
    if meta is not None and not np.array_equal(meta[:, 0], np.arange(cells)):
        raise StateFormatError("pages are not consecutive from position 0")
    return blob
