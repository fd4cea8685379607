"""thaw's KV snapshots (``thaw-vllm``): vLLM's prefix-cached blocks frozen to one file.

Layout (``thaw_vllm/kv_snapshot.py``, thaw-vllm 0.6.0, its Python writer's single-file form)::

    8 bytes   "THAWKV\\0\\0"
    u32       length of the JSON metadata (little-endian)
    JSON      num_blocks, block_ids, block_hashes (base64 of vLLM's block hash and its 4-byte
              KV cache group), num_layers, block_shape [2, block_size, heads, head_dim],
              block_bytes, dtype ("torch.bfloat16"), block_size
    payload   per layer, per block in block_ids' order: the block's K then V, (2, block_size,
              heads, head_dim), vLLM's own cache bytes

The file records its geometry; it has no checksum and no token ids: a prompt's blocks are
found by vLLM's prefix hashes of its tokens. thaw's Rust writer (``thaw-native``) writes a
``THAW`` region file with a ``.meta`` sidecar instead, which kvsnap recognises but does not
read. See docs/foreign.md.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kvsnap.dtypes import kv_torch_dtype
from kvsnap.errors import LayoutError, NotASnapshotError, SnapshotCorruptError, SnapshotIOError
from kvsnap.layout import KVGeometry

from .base import (
    ForeignBlock,
    ForeignFormat,
    ForeignProblem,
    ForeignSequence,
    ForeignSource,
    Recognition,
)
from .pages import own_tensor
from .vllm_fs_config import DEFAULT_HASH_SEED, prefix_hashes

FORMAT_NAME = "thaw-kv"
ENGINE_VERSION = "0.6.0"
KV_MAGIC = b"THAWKV\x00\x00"
THAW_MAGIC = b"THAW"
_MAX_METADATA = 64 << 20
_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

CANNOT_TELL = (
    "no checksums: a flipped bit in the payload is invisible; only the metadata and the "
    "payload's size can be checked",
    "no token ids: a block is found only by recomputing vLLM's prefix hash from the prompt",
    "no model fingerprint: the file names no model at all",
    "no parallel layout: a TP rank's file holds its own heads, and the metadata does not say which",
)


def recognise(path: Path) -> Recognition:
    """A file starting with thaw's KV magic (or a ``THAW`` file with a KV sidecar)."""
    if not path.is_file():
        return Recognition(False, "not a file")
    try:
        with path.open("rb") as handle:
            head = handle.read(8)
    except OSError as error:
        return Recognition(False, f"unreadable ({error.strerror})")
    if head == KV_MAGIC:
        return Recognition(True, "a thaw KV snapshot")
    if head[:4] == THAW_MAGIC and Path(f"{path}.meta").is_file():
        return Recognition(True, "a thaw KV snapshot written by thaw's native writer")
    return Recognition(False, "no thaw KV magic")


def open_thaw_kv(path: Path, hints: Mapping[str, Any]) -> ThawKVSnapshot:
    """Parse the metadata (never the payload) and return the opened source."""
    try:
        with path.open("rb") as handle:
            head = handle.read(12)
            if head[:4] == THAW_MAGIC and head[:8] != KV_MAGIC:
                raise LayoutError(
                    f"{path}: a thaw region file with a .meta sidecar (thaw's native writer): "
                    "kvsnap reads the single-file form thaw's Python writer writes"
                )
            if len(head) < 12 or head[:8] != KV_MAGIC:
                raise NotASnapshotError("not a thaw KV snapshot", file=str(path))
            (length,) = struct.unpack("<I", head[8:12])
            size = path.stat().st_size
            if length > min(_MAX_METADATA, size - 12):
                raise SnapshotCorruptError(
                    f"truncated: metadata of {length} bytes, the file has {size}", file=str(path)
                )
            raw = handle.read(length)
    except OSError as error:
        raise SnapshotIOError(f"cannot read: {error.strerror or error}", file=str(path)) from None
    try:
        metadata = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise SnapshotCorruptError(f"metadata is not JSON ({error})", file=str(path)) from None
    return ThawKVSnapshot(path, hints, metadata, 12 + length, size)


class ThawKVSnapshot(ForeignSource):
    """One thaw KV snapshot. ``hints``: ``tokens`` (the prompt to find) and ``hash_seed``
    (the engine's ``PYTHONHASHSEED``, if it set one)."""

    format_name = FORMAT_NAME
    engine = "vllm"
    needs_tokens = True

    def __init__(
        self, path: Path, hints: Mapping[str, Any], metadata: Any, offset: int, size: int
    ) -> None:
        super().__init__(path)
        self.hints = dict(hints)
        self.metadata, self.payload_offset, self.size = metadata, offset, size
        problem = _metadata_problem(metadata)
        if problem is not None:
            raise SnapshotCorruptError(f"not thaw's KV metadata: {problem}", file=str(path))
        self.hashes = [base64.b64decode(text, validate=True) for text in metadata["block_hashes"]]

    @property
    def version(self) -> str:
        return f"thaw-vllm {ENGINE_VERSION} KV snapshot"

    @property
    def cannot_tell(self) -> tuple[str, ...]:
        return CANNOT_TELL

    def geometry(self) -> KVGeometry:
        _, block, heads, dim = self.metadata["block_shape"]
        dtype = str(self.metadata["dtype"]).removeprefix("torch.")
        return KVGeometry(int(self.metadata["num_layers"]), int(block), dtype, int(heads), int(dim))

    def _payload_bytes(self) -> int:
        meta = self.metadata
        return int(meta["num_blocks"]) * int(meta["num_layers"]) * int(meta["block_bytes"])

    def describe(self) -> dict[str, Any]:
        meta = self.metadata
        return {
            "format": FORMAT_NAME,
            "version": self.version,
            "path": str(self.path),
            "num_blocks": meta["num_blocks"],
            "num_layers": meta["num_layers"],
            "block_shape": meta["block_shape"],
            "block_size": meta.get("block_size"),
            "dtype": meta["dtype"],
            "block_ids": meta["block_ids"][:64],
            "block_hashes": [digest.hex() for digest in self.hashes[:64]],
            "payload_bytes": self._payload_bytes(),
            "total_bytes": self.size,
            "cannot_tell": list(CANNOT_TELL),
        }

    def verify(self) -> list[ForeignProblem]:
        problems = []
        name = str(self.path)
        expected = self.payload_offset + self._payload_bytes()
        if self.size != expected:
            problems.append(
                ForeignProblem(name, f"{self.size} bytes, the metadata describes {expected}")
            )
        try:
            geometry = self.geometry()
            element = geometry.element_size
        except (LayoutError, ValueError) as error:
            return [*problems, ForeignProblem(name, f"block_shape or dtype: {error}")]
        if math.prod(self.metadata["block_shape"]) * element != self.metadata["block_bytes"]:
            problems.append(ForeignProblem(name, "block_bytes is not block_shape's size"))
        short = [i for i, digest in enumerate(self.hashes) if len(digest) < 32]
        if short:
            problems.append(ForeignProblem(name, f"block hashes {short[:8]} are not vLLM's"))
        return problems

    def sequences(self) -> list[ForeignSequence]:
        tokens = self.hints.get("tokens")
        if tokens is None:
            return []
        block = self.geometry().block_size
        known = {digest[:32]: str(index) for index, digest in enumerate(self.hashes)}
        found = []
        seed = str(self.hints.get("hash_seed") or DEFAULT_HASH_SEED)
        for digest in prefix_hashes(tokens, block, seed):
            if digest not in known:
                break
            found.append(known[digest])
        ids = np.asarray(tokens[: len(found) * block], dtype=np.int64)
        return [ForeignSequence("prompt", ids, tuple(found))]

    def read_block(self, block_id: str) -> ForeignBlock:
        """Block ``block_id``: its index in the snapshot's block list."""
        geometry = self.geometry()
        index, slots = int(block_id), int(self.metadata["num_blocks"])
        if not 0 <= index < slots:
            raise LayoutError(f"{self.path}: no block {block_id}")
        if self.size != self.payload_offset + self._payload_bytes():
            raise SnapshotCorruptError(
                f"{self.size} bytes, the metadata describes "
                f"{self.payload_offset + self._payload_bytes()}",
                file=str(self.path),
            )
        block_bytes = int(self.metadata["block_bytes"])
        dtype = kv_torch_dtype(geometry.dtype)
        shape = (2, geometry.block_size, geometry.num_kv_heads, geometry.head_dim)
        keys, values = [], []
        with self.path.open("rb") as handle:
            for layer in range(geometry.num_layers):
                handle.seek(self.payload_offset + (layer * slots + index) * block_bytes)
                data = handle.read(block_bytes)
                kv = np.frombuffer(data, dtype=_WORDS[geometry.element_size]).reshape(shape)
                keys.append(own_tensor(kv[0], dtype))
                values.append(own_tensor(kv[1], dtype))
        return ForeignBlock(block_id, tuple(keys), tuple(values))


def _metadata_problem(meta: Any) -> str | None:
    """What makes ``meta`` something else than thaw's KV metadata, or ``None``."""
    if not isinstance(meta, dict):
        return "not a JSON object"
    for name in ("num_blocks", "num_layers", "block_bytes"):
        if not isinstance(meta.get(name), int) or meta[name] < 0:
            return f"{name} must be a non-negative integer, found {meta.get(name)!r}"
    if meta["num_blocks"] == 0:
        return None if not meta.get("block_ids") else "num_blocks 0 with block ids"
    shape = meta.get("block_shape")
    if not isinstance(shape, list) or len(shape) != 4 or shape[0] != 2:
        return f"block_shape must be [2, block_size, heads, head_dim], found {shape!r}"
    if not all(isinstance(x, int) and x > 0 for x in shape):
        return f"block_shape must be positive integers, found {shape!r}"
    for name in ("block_ids", "block_hashes"):
        if not isinstance(meta.get(name), list) or len(meta[name]) != meta["num_blocks"]:
            return f"{name} must list num_blocks ({meta['num_blocks']}) entries"
    if not isinstance(meta.get("dtype"), str):
        return "dtype must be a string"
    try:
        for text in meta["block_hashes"]:
            base64.b64decode(text, validate=True)
    except (binascii.Error, TypeError, ValueError):
        return "block_hashes must be base64"
    return None


THAW_KV = ForeignFormat(
    name=FORMAT_NAME,
    reads=f"thaw-vllm {ENGINE_VERSION} KV snapshots (single-file form)",
    recognise=recognise,
    open=open_thaw_kv,
    hints=("tokens", "hash_seed"),
)
