"""llama.cpp state files: a sequence save (``GGSQ``) or a whole-context session (``GGSN``).

Layout (llama.cpp's ``llama_state_seq_save_file`` / ``llama_state_save_file``, little-endian)::

    u32 magic ("ggsq" or "ggsn" as a u32), u32 version (3 / 10), u32 n_tokens, i32 tokens[n]
    session only: u32 len, the model architecture's name
    u32 n_stream; per stream: u32 cell_count, and when it is not 0:
        per cell: i32 pos, u32 n_seq_id, i32 seq_ids[n_seq_id]
        u32 v_trans, u32 n_layer
        per layer: i32 k_type, u64 k_row_bytes, cell_count rows (one cell: heads x head_dim)
        per layer, v_trans 0: i32 v_type, u64 v_row_bytes, cell_count rows
        per layer, v_trans 1: i32 v_type, u32 element bytes, u32 n_embd_v, then per element
            of the row its cell_count values (the V cache is stored transposed)

The KV heads are not recorded (a row is ``heads * head_dim`` elements): they are a hint.
See docs/foreign.md.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from kvsnap.dtypes import kv_element
from kvsnap.errors import (
    LayoutError,
    NotASnapshotError,
    SnapshotCorruptError,
    SnapshotIOError,
    UnsupportedVersionError,
)
from kvsnap.layout import KVGeometry

from .base import (
    ForeignBlock,
    ForeignFormat,
    ForeignProblem,
    ForeignSequence,
    ForeignSource,
    Recognition,
)

if TYPE_CHECKING:  # pages are tensors; recognising and describing a state need no torch
    import torch

FORMAT_NAME = "llama-state"
SEQ_MAGIC = 0x67677371  # "ggsq"
SESSION_MAGIC = 0x6767736E  # "ggsn"
#: The versions read: llama.cpp's LLAMA_STATE_SEQ_VERSION and LLAMA_SESSION_VERSION as of
#: llama-cpp-python 0.3.36.
VERSIONS = {SEQ_MAGIC: 3, SESSION_MAGIC: 10}
KINDS = {SEQ_MAGIC: "sequence state", SESSION_MAGIC: "session"}
#: ggml type ids kvsnap decodes, and their dtypes (snapshot names: kvsnap.dtypes has the rest).
GGML_TYPES = {0: "float32", 1: "float16", 30: "bfloat16"}
_MAX_STREAMS = 256
#: The largest number taken for a format version (llama.cpp's are small counters).
_MAX_VERSION = 255
_MAX_LAYERS = 4096
_MAX_SEQ_IDS = 1 << 16
_DEFAULT_BLOCK = 16

CANNOT_TELL = (
    "no checksums: a flipped bit in the KV is invisible; only the structure and sizes can be "
    "checked",
    "no model fingerprint: a session names the architecture only, a sequence save nothing",
    "no head count: a cell's row is heads x head_dim elements, split by a hint",
)


@dataclass(frozen=True)
class TensorRun:
    """Where one layer's K or V lies in the file: ``offset``, its ggml ``type``, and either
    ``row_bytes`` per cell or (transposed V) ``element_bytes`` and ``row_elements``."""

    offset: int
    type: int
    row_bytes: int
    transposed: bool
    row_elements: int


@dataclass(frozen=True)
class StateStream:
    """One stream's cells: positions, sequence ids, and per layer its K and V runs."""

    positions: np.ndarray
    seq_ids: tuple[tuple[int, ...], ...]
    keys: tuple[TensorRun, ...]
    values: tuple[TensorRun, ...]


class _Cursor:
    """Reads little-endian fields from a file, refusing any read past its end."""

    def __init__(self, handle: BinaryIO, size: int, name: str) -> None:
        self.handle, self.size, self.name, self.offset = handle, size, name, 0

    def take(self, count: int, what: str) -> bytes:
        if count < 0 or self.offset + count > self.size:
            raise SnapshotCorruptError(
                f"truncated: {what} needs {count} bytes at offset {self.offset}, the file has "
                f"{self.size}",
                file=self.name,
            )
        data = self.handle.read(count)
        self.offset += count
        return data

    def skip(self, count: int, what: str) -> int:
        if count < 0 or self.offset + count > self.size:
            raise SnapshotCorruptError(
                f"truncated: {what} needs {count} bytes at offset {self.offset}, the file has "
                f"{self.size}",
                file=self.name,
            )
        start = self.offset
        self.offset += count
        self.handle.seek(self.offset)
        return start

    def unpack(self, fmt: str, what: str) -> tuple[Any, ...]:
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt), what))

    def bounded(self, fmt: str, what: str, limit: int) -> int:
        (value,) = self.unpack(fmt, what)
        if not 0 <= value <= limit:
            raise SnapshotCorruptError(f"{what} reads {value}, at most {limit}", file=self.name)
        return int(value)


def recognise(path: Path) -> Recognition:
    """A regular file starting with llama.cpp's state magic."""
    if not path.is_file():
        return Recognition(False, "not a file")
    try:
        with path.open("rb") as handle:
            head = handle.read(4)
    except OSError as error:
        return Recognition(False, f"unreadable ({error.strerror})")
    if len(head) == 4 and struct.unpack("<I", head)[0] in VERSIONS:
        return Recognition(True, "a llama.cpp state file")
    return Recognition(False, f"no llama.cpp state magic (first bytes {head.hex() or 'none'})")


def _read_header(cursor: _Cursor) -> tuple[int, int, np.ndarray, str | None]:
    """Magic, version, token ids and (sessions) the architecture name."""
    magic, version = cursor.unpack("II", "the magic and version")
    if magic not in VERSIONS:
        raise NotASnapshotError("not a llama.cpp state file", file=cursor.name)
    if not 0 < version <= _MAX_VERSION:
        # llama.cpp numbers its state formats 1, 2, 3...: anything else is damage after a
        # valid magic, not a newer format.
        raise SnapshotCorruptError(
            f"damaged: llama.cpp {KINDS[magic]} magic followed by version {version}, not a "
            "version llama.cpp writes",
            file=cursor.name,
        )
    if version != VERSIONS[magic]:
        raise UnsupportedVersionError(
            f"llama.cpp {KINDS[magic]} version {version}: kvsnap reads version {VERSIONS[magic]}",
            file=cursor.name,
            version=version,
        )
    count = cursor.bounded("I", "the token count", (cursor.size - cursor.offset) // 4)
    tokens = np.frombuffer(cursor.take(4 * count, "the tokens"), dtype="<i4").astype(np.int64)
    arch = None
    if magic == SESSION_MAGIC:
        length = cursor.bounded("I", "the architecture name's length", 256)
        arch = cursor.take(length, "the architecture name").decode("utf-8", "replace")
    return magic, version, tokens, arch


def _read_cells(cursor: _Cursor, count: int) -> tuple[np.ndarray, tuple[tuple[int, ...], ...]]:
    positions = np.empty(count, dtype=np.int64)
    seq_ids = []
    for cell in range(count):
        positions[cell], n_seq = cursor.unpack("iI", "a cell's position and sequence count")
        if n_seq > _MAX_SEQ_IDS:
            raise SnapshotCorruptError(f"cell {cell} claims {n_seq} sequences", file=cursor.name)
        seq_ids.append(cursor.unpack(f"{n_seq}i", "a cell's sequence ids"))
    return positions, tuple(seq_ids)


def _read_runs(
    cursor: _Cursor, count: int, layers: int, part: str, v_trans: bool
) -> tuple[TensorRun, ...]:
    runs = []
    for layer in range(layers):
        what = f"layer {layer} {part}"
        (kind,) = cursor.unpack("i", f"{what}'s type")
        if v_trans:
            element, elements = cursor.unpack("II", f"{what}'s element size and width")
            offset = cursor.skip(element * elements * count, f"{what}'s values")
            runs.append(TensorRun(offset, kind, element * elements, True, elements))
        else:
            (row,) = cursor.unpack("Q", f"{what}'s row size")
            offset = cursor.skip(row * count, f"{what}'s rows")
            runs.append(TensorRun(offset, kind, row, False, 0))
    return tuple(runs)


def _read_streams(cursor: _Cursor) -> list[StateStream]:
    streams = []
    for _ in range(cursor.bounded("I", "the stream count", _MAX_STREAMS)):
        count = cursor.bounded("I", "the cell count", cursor.size)
        if count == 0:
            continue
        positions, seq_ids = _read_cells(cursor, count)
        v_trans = cursor.bounded("I", "v_trans", 1)
        layers = cursor.bounded("I", "the layer count", _MAX_LAYERS)
        keys = _read_runs(cursor, count, layers, "key", False)
        values = _read_runs(cursor, count, layers, "value", bool(v_trans))
        streams.append(StateStream(positions, seq_ids, keys, values))
    if cursor.offset != cursor.size:
        raise SnapshotCorruptError(
            f"{cursor.size - cursor.offset} bytes after the last stream's KV", file=cursor.name
        )
    return streams


def open_llama_state(path: Path, hints: Mapping[str, Any]) -> LlamaStateFile:
    """Parse the file's whole structure (never its KV) and return the opened source."""
    try:
        handle = path.open("rb")
    except OSError as error:
        raise SnapshotIOError(f"cannot read: {error.strerror or error}", file=str(path)) from None
    with handle:
        cursor = _Cursor(handle, path.stat().st_size, str(path))
        magic, version, tokens, arch = _read_header(cursor)
        streams = _read_streams(cursor)
    return LlamaStateFile(path, hints, magic, version, tokens, arch, streams)


class LlamaStateFile(ForeignSource):
    """One llama.cpp state file, parsed. ``hints``: ``num_kv_heads`` (the row's split into
    heads, required to decode) and ``block_size`` (cells per kvsnap block, default 16)."""

    format_name = FORMAT_NAME
    engine = "llama.cpp"

    def __init__(
        self,
        path: Path,
        hints: Mapping[str, Any],
        magic: int,
        version: int,
        tokens: np.ndarray,
        arch: str | None,
        streams: list[StateStream],
    ) -> None:
        super().__init__(path)
        self.hints = dict(hints)
        self.magic, self.file_version, self.tokens, self.arch = magic, version, tokens, arch
        self.streams = streams

    @property
    def version(self) -> str:
        return f"llama.cpp {KINDS[self.magic]} version {self.file_version}"

    @property
    def cannot_tell(self) -> tuple[str, ...]:
        return CANNOT_TELL

    def describe(self) -> dict[str, Any]:
        streams = []
        for stream in self.streams:
            first = stream.keys[0] if stream.keys else None
            streams.append(
                {
                    "cells": len(stream.positions),
                    "positions": [int(stream.positions.min()), int(stream.positions.max())],
                    "sequences": sorted({seq for ids in stream.seq_ids for seq in ids}),
                    "layers": len(stream.keys),
                    "v_transposed": bool(stream.values and stream.values[0].transposed),
                    "key_type": None if first is None else _type_name(first.type),
                    "key_row_bytes": None if first is None else first.row_bytes,
                }
            )
        return {
            "format": FORMAT_NAME,
            "version": self.version,
            "path": str(self.path),
            "kind": KINDS[self.magic],
            "architecture": self.arch,
            "num_tokens": len(self.tokens),
            "token_ids": self.tokens[:64].tolist(),
            "streams": streams,
            "total_bytes": self.path.stat().st_size,
            "cannot_tell": list(CANNOT_TELL),
        }

    def verify(self) -> list[ForeignProblem]:
        """The structure was checked whole when the file was opened; what remains are
        inconsistencies between its parts."""
        problems = []
        name = str(self.path)
        cells = sum(len(stream.positions) for stream in self.streams)
        if cells != len(self.tokens):
            problems.append(ForeignProblem(name, f"{len(self.tokens)} tokens for {cells} cells"))
        for index, stream in enumerate(self.streams):
            rows = {(run.type, run.row_bytes) for run in (*stream.keys, *stream.values)}
            if len(rows) > 1:
                problems.append(
                    ForeignProblem(
                        name,
                        f"stream {index}: layers of different types or row sizes: {sorted(rows)}",
                    )
                )
            if len(set(stream.positions.tolist())) != len(stream.positions):
                problems.append(
                    ForeignProblem(name, f"stream {index}: two cells hold one position")
                )
        return problems

    def geometry(self) -> KVGeometry:
        if not self.streams:
            raise LayoutError(f"{self.path}: the state holds no cells")
        first = self.streams[0].keys[0]
        if first.type not in GGML_TYPES:
            raise LayoutError(
                f"{self.path}: KV of ggml type {_type_name(first.type)}: kvsnap decodes "
                f"{', '.join(GGML_TYPES.values())}"
            )
        dtype_name = GGML_TYPES[first.type]
        heads = self.hints.get("num_kv_heads")
        if heads is None:
            raise LayoutError(
                f"{self.path}: a llama.cpp state does not record the KV heads: pass --kv-heads N "
                "(num_kv_heads=N from Python)"
            )
        elements = first.row_bytes // kv_element(dtype_name).size
        if elements % int(heads):
            raise LayoutError(f"a row of {elements} elements does not split into {heads} heads")
        return KVGeometry(
            num_layers=len(self.streams[0].keys),
            block_size=int(self.hints.get("block_size") or _DEFAULT_BLOCK),
            dtype=dtype_name,
            num_kv_heads=int(heads),
            head_dim=elements // int(heads),
        )

    def sequences(self) -> list[ForeignSequence]:
        if len(self.streams) != 1:
            raise LayoutError(f"{self.path}: {len(self.streams)} streams: kvsnap converts one")
        stream = self.streams[0]
        count = len(stream.positions)
        if len(self.tokens) != count or not np.array_equal(stream.positions, np.arange(count)):
            raise LayoutError(
                f"{self.path}: {len(self.tokens)} tokens for {count} cells at positions "
                f"{int(stream.positions.min())}..{int(stream.positions.max())}: not one "
                "sequence from position 0"
            )
        size = self.geometry().block_size
        blocks = tuple(str(first) for first in range(0, count, size))
        return [ForeignSequence("sequence", self.tokens.copy(), blocks)]

    def read_block(self, block_id: str) -> ForeignBlock:
        geometry = self.geometry()
        stream = self.streams[0]
        first = int(block_id)
        count = len(stream.positions)
        cells = min(geometry.block_size, count - first)
        if not 0 <= first < count:
            raise LayoutError(f"{self.path}: no block at cell {block_id}")
        shape = (geometry.block_size, geometry.num_kv_heads, geometry.head_dim)
        with self.path.open("rb") as handle:
            keys = tuple(_rows(handle, run, count, first, cells, shape) for run in stream.keys)
            values = tuple(_rows(handle, run, count, first, cells, shape) for run in stream.values)
        return ForeignBlock(block_id, keys, values)


def _rows(
    handle: BinaryIO,
    run: TensorRun,
    count: int,
    first: int,
    cells: int,
    shape: tuple[int, int, int],
) -> torch.Tensor:
    """Cells ``first .. first + cells`` of one layer's K or V as a canonical page (zero-padded)."""
    if run.type not in GGML_TYPES:
        raise LayoutError(f"ggml type {_type_name(run.type)} is not decoded")
    import torch

    dtype = kv_element(GGML_TYPES[run.type]).torch
    page = torch.zeros(shape, dtype=dtype)
    element = dtype.itemsize
    if run.row_bytes != shape[1] * shape[2] * element:
        raise LayoutError(f"rows of {run.row_bytes} bytes do not hold {shape[1]} x {shape[2]}")
    if run.transposed:
        # Element j of every cell lies together: read the whole [row_elements, count] plane.
        handle.seek(run.offset)
        plane = _frombytes(handle.read(run.row_bytes * count), dtype).view(run.row_elements, count)
        page[:cells] = plane[:, first : first + cells].transpose(0, 1).reshape(cells, *shape[1:])
    else:
        handle.seek(run.offset + first * run.row_bytes)
        rows = _frombytes(handle.read(run.row_bytes * cells), dtype)
        page[:cells] = rows.view(cells, *shape[1:])
    return page


def _frombytes(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)


def _type_name(kind: int) -> str:
    known = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 30: "bf16"}
    return known.get(kind, f"type {kind}")


LLAMA_STATE = ForeignFormat(
    name=FORMAT_NAME,
    reads="llama.cpp sequence state (version 3) and session (version 10) files",
    recognise=recognise,
    open=open_llama_state,
    hints=("num_kv_heads", "block_size"),
)
