"""LMCache's multiprocess server ``fs`` L2: one headerless file per chunk, per KV rank.

Layout on disk (``lmcache/v1/distributed/l2_adapters/fs_l2_adapter.py``, LMCache 0.5.6)::

    BASE/<model>@0x<kv_rank>@<object group>@<chunk hash>[@<cache salt>].data
    BASE/<same name>.tmp                                  a write under way

``<model>`` is the model name with ``/`` as ``-SEP-``; ``<kv_rank>`` 8 hex digits packing
``(world size << 24) | (rank << 16) | (local world size << 8) | local rank``; ``<object
group>`` hex; ``<chunk hash>`` LMCache's chunk hash (blake3 by default: ``h = blake3(previous
‖ the chunk's token ids as big-endian u32)``, the chain seeded by ``blake3(0 as a signed
big-endian i64 ‖ u32 0)``). A file is the server's memory object for the chunk, raw:
``(2, layers, chunk tokens, heads * head_dim)`` (``KV_2LTD``, the rank's heads). Nothing in it
says the geometry, the dtype or the tokens: see docs/foreign.md.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvsnap.dtypes import kv_element, kv_torch_dtype
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
from .pages import own_tensor, size_problems

FORMAT_NAME = "lmcache-fs"
ENGINE_VERSION = "0.5.6"
_CHUNK_FILE = re.compile(r"^([^@]+)@0x([0-9a-f]{8})@([0-9a-f]+)@([0-9a-f]+)(?:@([^@]+))?\.data$")
_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

CANNOT_TELL = (
    "no checksums: a flipped bit in a chunk file is invisible; only names, sizes and which "
    "ranks hold each chunk can be checked",
    "no token ids: a chunk is found only by recomputing LMCache's chunk hash (blake3) from "
    "the prompt",
    "no model fingerprint: the file names carry the model's name, not its weights",
    "no geometry or dtype: layers, heads and head size come from the model's config",
)


def chunk_hashes(token_ids: Sequence[int], chunk_size: int) -> list[str]:
    """LMCache's default (blake3) chunk hashes of a prompt's full chunks, as hex."""
    from blake3 import blake3

    parent = blake3((0).to_bytes(8, "big", signed=True) + struct.pack(">I", 0)).digest()
    hashes = []
    for start in range(0, len(token_ids) - chunk_size + 1, chunk_size):
        chunk = [int(token) for token in token_ids[start : start + chunk_size]]
        parent = blake3(parent + struct.pack(f">{len(chunk)}I", *chunk)).digest()
        hashes.append(parent.hex())
    return hashes


@dataclass(frozen=True)
class ChunkFile:
    """One chunk file's name, parsed."""

    path: Path
    model: str
    world_size: int
    rank: int
    group: int
    digest: str
    salt: str

    @property
    def deployment(self) -> tuple[str, int, int, str]:
        return self.model, self.world_size, self.group, self.salt


def _parse(path: Path) -> ChunkFile | None:
    match = _CHUNK_FILE.match(path.name)
    if match is None:
        return None
    model, rank_bits, group, digest, salt = match.groups()
    bits = int(rank_bits, 16)
    world, rank = (bits >> 24) & 0xFF, (bits >> 16) & 0xFF
    model = model.replace("-SEP-", "/")
    return ChunkFile(path, model, world, rank, int(group, 16), digest, salt or "")


def _chunk_files(directory: Path) -> list[ChunkFile]:
    try:
        children = sorted(directory.iterdir())
    except OSError:
        return []
    return [chunk for chunk in map(_parse, children) if chunk is not None and chunk.path.is_file()]


def recognise(path: Path) -> Recognition:
    """A directory of LMCache fs L2 chunk files, or one chunk file."""
    if path.is_file():
        if _parse(path) is not None:
            return Recognition(True, "an LMCache fs L2 chunk file")
        return Recognition(False, "not an LMCache fs L2 chunk file (<model>@0x<rank>@...data)")
    if path.is_dir() and _chunk_files(path):
        return Recognition(True, "an LMCache fs L2 directory")
    return Recognition(False, "no LMCache fs L2 chunk file (<model>@0x<rank>@...data) in it")


def open_lmcache_fs(path: Path, hints: Mapping[str, Any]) -> LMCacheFsDirectory:
    if not recognise(path).matches:
        raise NotASnapshotError(recognise(path).found, file=str(path))
    return LMCacheFsDirectory(path.parent if path.is_file() else path, hints)


class LMCacheFsDirectory(ForeignSource):
    """One fs L2 base directory. ``hints``: ``model`` (a directory with the model's
    ``config.json``), ``dtype`` (default the config's ``torch_dtype``), ``chunk_size`` (default:
    what the file size gives), ``model_name`` (which model's chunks, when there are several)
    and ``tokens``."""

    format_name = FORMAT_NAME
    engine = "lmcache"
    needs_tokens = True

    def __init__(self, directory: Path, hints: Mapping[str, Any]) -> None:
        super().__init__(directory)
        self.hints = dict(hints)
        self.chunks = _chunk_files(directory)
        self.deployments = sorted({chunk.deployment for chunk in self.chunks})
        self._config = _model_config(self.hints.get("model"))

    @property
    def version(self) -> str:
        return f"LMCache {ENGINE_VERSION} fs L2"

    @property
    def cannot_tell(self) -> tuple[str, ...]:
        return CANNOT_TELL

    def deployment(self) -> tuple[str, int, int, str]:
        wanted = self.hints.get("model_name")
        found = [d for d in self.deployments if wanted is None or d[0] == wanted]
        if len(found) != 1:
            names = ", ".join(f"{m} (world size {w}, group {g})" for m, w, g, _ in found)
            raise LayoutError(
                f"{self.path}: chunks of {len(found)} deployments ({names or 'none'}): pass "
                "model_name to choose one"
            )
        return found[0]

    def _token_bytes(self) -> tuple[int, int, int, int]:
        """``(layers, heads per file, head_dim, bytes per token)``."""
        config = self._config
        if config is None:
            raise LayoutError(
                f"{self.path}: LMCache files do not record the layers, KV heads or head size: "
                "pass --model DIR (model=DIR from Python)"
            )
        if config.get("kv_lora_rank"):
            raise LayoutError(f"{self.path}: MLA chunks are not read")
        layers = int(config["num_hidden_layers"])
        heads = int(config.get("num_key_value_heads", config["num_attention_heads"]))
        dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
        world = self.deployment()[1]
        if heads % world:
            raise LayoutError(f"{heads} KV heads do not split over world size {world}")
        element = kv_element(self._dtype()).size
        return layers, heads // world, dim, 2 * layers * (heads // world) * dim * element

    def _dtype(self) -> str:
        dtype = self.hints.get("dtype") or (self._config or {}).get("torch_dtype")
        if not isinstance(dtype, str):
            raise LayoutError(
                f"{self.path}: LMCache files do not record the KV dtype and the model config "
                "names none: pass a model config with a torch_dtype (dtype= from Python)"
            )
        return dtype

    def chunk_size(self) -> int:
        token = self._token_bytes()[3]
        if self.hints.get("chunk_size") is not None:
            return int(self.hints["chunk_size"])
        mine = self.deployment()
        sizes = [c.path.stat().st_size for c in self.chunks if c.deployment == mine]
        size = max(set(sizes), key=sizes.count)
        if size == 0 or size % token:
            raise LayoutError(
                f"{self.path}: chunks of {size} bytes are not whole tokens of {token} bytes: "
                "the model config or dtype does not match the files"
            )
        return size // token

    def geometry(self) -> KVGeometry:
        layers, heads, dim, _ = self._token_bytes()
        world = self.deployment()[1]
        return KVGeometry(layers, self.chunk_size(), self._dtype(), heads * world, dim)

    def describe(self) -> dict[str, Any]:
        deployments = []
        for model, world, group, salt in self.deployments:
            members = [c for c in self.chunks if c.deployment == (model, world, group, salt)]
            deployments.append(
                {
                    "model": model,
                    "world_size": world,
                    "object_group": group,
                    "cache_salt": salt or None,
                    "chunks": len({c.digest for c in members}),
                    "files": len(members),
                    "file_bytes": sorted({c.path.stat().st_size for c in members}),
                }
            )
        return {
            "format": FORMAT_NAME,
            "version": self.version,
            "path": str(self.path),
            "deployments": deployments,
            "num_files": len(self.chunks),
            "total_bytes": sum(c.path.stat().st_size for c in self.chunks),
            "temporary_files": len(self._leftovers()),
            "cannot_tell": list(CANNOT_TELL),
        }

    def _leftovers(self) -> list[Path]:
        return sorted(self.path.glob("*@0x*.tmp"))

    def verify(self) -> list[ForeignProblem]:
        problems = [
            ForeignProblem(str(p), "a temporary file of an interrupted write")
            for p in self._leftovers()
        ]
        for deployment in self.deployments:
            members = [c for c in self.chunks if c.deployment == deployment]
            problems += size_problems([c.path for c in members], None)
            ranks: dict[str, set[int]] = {}
            for chunk in members:
                ranks.setdefault(chunk.digest, set()).add(chunk.rank)
            world = deployment[1]
            for digest, held in sorted(ranks.items()):
                missing = sorted(set(range(world)) - held)
                if missing:
                    problems.append(
                        ForeignProblem(
                            str(self.path),
                            f"chunk {digest[:16]}... is missing rank(s) {missing} of {world}",
                        )
                    )
        return problems

    def sequences(self) -> list[ForeignSequence]:
        tokens = self.hints.get("tokens")
        if tokens is None:
            return []
        size = self.chunk_size()
        found = []
        for digest in chunk_hashes(tokens, size):
            if not all(path.is_file() for path in self._files_of(digest)):
                break
            found.append(digest)
        ids = np.asarray(tokens[: len(found) * size], dtype=np.int64)
        return [ForeignSequence("prompt", ids, tuple(found))]

    def _files_of(self, digest: str) -> list[Path]:
        model, world, group, salt = self.deployment()
        name = model.replace("/", "-SEP-")
        tail = f"@{salt}" if salt else ""
        return [
            self.path / f"{name}@0x{(world << 24) | (r << 16) | (world << 8) | r:08x}@{group:x}"
            f"@{digest}{tail}.data"
            for r in range(world)
        ]

    def read_block(self, block_id: str) -> ForeignBlock:
        geometry = self.geometry()
        layers, heads, dim, token = self._token_bytes()
        dtype = kv_torch_dtype(geometry.dtype)
        keys: list[list[np.ndarray]] = [[] for _ in range(layers)]
        values: list[list[np.ndarray]] = [[] for _ in range(layers)]
        for path in self._files_of(block_id):
            data = _read(path, token * geometry.block_size)
            words = np.frombuffer(data, dtype=_WORDS[geometry.element_size])
            kv = words.reshape(2, layers, geometry.block_size, heads, dim)
            for layer in range(layers):
                keys[layer].append(kv[0, layer])
                values[layer].append(kv[1, layer])
        return ForeignBlock(
            block_id,
            tuple(own_tensor(np.concatenate(parts, axis=1), dtype) for parts in keys),
            tuple(own_tensor(np.concatenate(parts, axis=1), dtype) for parts in values),
        )


def _read(path: Path, expected: int) -> bytes:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SnapshotCorruptError("no such chunk file", file=str(path)) from None
    except OSError as error:
        raise SnapshotIOError(f"cannot read: {error.strerror or error}", file=str(path)) from None
    if len(data) != expected:
        raise SnapshotCorruptError(
            f"{len(data)} bytes, a chunk file here has {expected}", file=str(path)
        )
    return data


def _model_config(model: Any) -> dict[str, Any] | None:
    if model is None:
        return None
    config = Path(model) / "config.json"
    try:
        loaded = json.loads(config.read_text())
    except (OSError, ValueError) as error:
        raise LayoutError(f"{config}: cannot read the model config ({error})") from None
    if not isinstance(loaded, dict):
        raise LayoutError(f"{config}: not a model config")
    return dict(loaded.get("text_config", loaded))


LMCACHE_FS = ForeignFormat(
    name=FORMAT_NAME,
    reads=f"LMCache {ENGINE_VERSION} multiprocess server fs L2 (directory or chunk file)",
    recognise=recognise,
    open=open_lmcache_fs,
    hints=("model", "dtype", "chunk_size", "model_name", "tokens"),
)
