"""The prefix store: prompt prefixes on disk as content-addressed chunks of KV blocks.

A prompt's full blocks are cut into *chunks* of ``chunk_blocks`` blocks, aligned at the start
of the prompt (the last chunk may be shorter). A chunk is an ordinary kvsnap snapshot named by
the prefix hash (:func:`kvsnap.format.prefix_hash_chain`) of its last block, which identifies
the whole prefix up to it; prompts that share a prefix share its chunks, so N requests behind
one system prompt store it once. :class:`PrefixStore` finds the longest run of stored chunks
of a prompt (:meth:`~PrefixStore.longest_prefix`), records their use for LRU eviction
(:meth:`~PrefixStore.touch`) and moves damaged ones aside (:meth:`~PrefixStore.quarantine`);
:mod:`kvsnap.engines.vllm.eviction` lists and prunes a store. The chunks themselves are
written by :func:`kvsnap.snapshot.capture` (or, one part per TP rank, by
:func:`kvsnap.distributed.capture`) and read by :meth:`kvsnap.Snapshot.open`.

A chunk is either one file ``HASH.safetensors`` or a *parted* snapshot (docs/format.md,
"Parted snapshots"): the parts ``HASH-{generation}-part-0000i-of-0000k.safetensors`` beside
it and the index ``HASH.safetensors.index.json``, which is its commit point; no
``HASH.safetensors`` exists then. Either way the chunk's path is ``HASH.safetensors`` (what
:meth:`kvsnap.Snapshot.open` opens) and :func:`committed_file` names the file that commits it.

Nothing here needs vLLM.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvsnap import format as fmt
from kvsnap.errors import KVSnapError
from kvsnap.store.location import INDEX_SUFFIX

#: Suffix of every chunk file.
CHUNK_SUFFIX = ".safetensors"
#: Default blocks per chunk (``chunk_blocks``): 256 tokens at vLLM's GPU block size of 16.
DEFAULT_CHUNK_BLOCKS = 16
_HASH = re.compile(r"[0-9a-f]{32}")


def safe_name(text: str) -> str:
    """``text`` reduced to characters safe in one file name (other characters become ``_``)."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", text).strip(".")
    return cleaned or "_"


def index_path(path: str | os.PathLike[str]) -> Path:
    """The parted-snapshot index of the chunk (or snapshot) ``path``: ``path + ".index.json"``,
    or ``path`` itself when it names an index already."""
    text = os.fspath(path)
    return Path(text if text.endswith(INDEX_SUFFIX) else text + INDEX_SUFFIX)


def snapshot_path(path: str | os.PathLike[str]) -> Path:
    """The ``NAME.safetensors`` path of the chunk (or snapshot) ``path``, whether ``path``
    names that file or its index."""
    text = os.fspath(path)
    return Path(text[: -len(INDEX_SUFFIX)] if text.endswith(INDEX_SUFFIX) else text)


def committed_file(path: str | os.PathLike[str]) -> Path | None:
    """The file whose presence commits the chunk at ``path`` (``HASH.safetensors`` or its
    index): the single file when it exists, else the parted snapshot's index when that
    exists, else ``None``. At most two ``stat`` calls.

    Both exist only for a moment while one form replaces the other; the single file is what
    :meth:`kvsnap.Snapshot.open` opens then, so it is the one returned.
    """
    single = snapshot_path(path)
    if single.is_file():
        return single
    index = index_path(single)
    return index if index.is_file() else None


def part_files(index: str | os.PathLike[str]) -> list[Path]:
    """The part files the parted-snapshot index at ``index`` names, beside it, that are its
    own by name (:func:`kvsnap.format.is_part_of`); ``[]`` when the index is gone or
    unreadable (its parts are then named by no index: see
    :mod:`kvsnap.engines.vllm.eviction` for what becomes of them). The index is read without
    moving its access time where the OS allows (``O_NOATIME``): listing a store must not make
    every parted chunk look just used to LRU eviction."""
    index = Path(index)
    raw = _read_keeping_atime(index, fmt.MAX_INDEX_BYTES)
    if raw is None or not fmt.is_parts_index(raw):
        return []
    try:
        records = fmt.decode_parts_index(raw, file=str(index)).parts
    except (KVSnapError, ValueError):
        return []
    stem = snapshot_path(index).name[: -len(CHUNK_SUFFIX)]
    return [index.parent / part.file for part in records if fmt.is_part_of(stem, part.file)]


def _read_keeping_atime(path: Path, limit: int) -> bytes | None:
    """The bytes of the file ``path`` (``None``: gone, unreadable or over ``limit`` bytes),
    read with ``O_NOATIME`` when this process may (it owns the file); otherwise plainly."""
    flags = os.O_RDONLY | getattr(os, "O_NOATIME", 0)
    try:
        try:
            descriptor = os.open(path, flags)
        except PermissionError:  # O_NOATIME needs the file's owner: read it the plain way
            descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    with os.fdopen(descriptor, "rb") as file:
        raw = file.read(limit + 1)
    return raw if len(raw) <= limit else None


def chunk_sequence_id(first_block: int, parent: str | None) -> str:
    """The id of a chunk's one sequence: where it starts and the prefix hash it follows."""
    return f"prefix@{first_block}:{parent or 'root'}"


@dataclass(frozen=True)
class ChunkRef:
    """One stored chunk: blocks ``first_block .. first_block + num_blocks`` of a prefix."""

    path: str
    first_block: int
    num_blocks: int


@dataclass(frozen=True)
class StoreMatch:
    """The longest stored prefix of a prompt: consecutive ``chunks`` from block 0."""

    chunks: tuple[ChunkRef, ...]

    @property
    def num_blocks(self) -> int:
        """Leading full blocks of the prompt the chunks hold."""
        return sum(chunk.num_blocks for chunk in self.chunks)


class PrefixStore:
    """A directory of content-addressed prefix chunks (kvsnap snapshots) of one namespace.

    Layout of ``root``::

        NAMESPACE/chunks/HH/HASH.safetensors   a chunk, named by the prefix hash of its last
                                               block (HH: the hash's first two digits)
        NAMESPACE/chunks/HH/HASH.safetensors.index.json
        NAMESPACE/chunks/HH/HASH-gG-part-0000i-of-0000k.safetensors
                                               a parted chunk (TP > 1, every rank wrote its
                                               own heads): the index commits it
        NAMESPACE/quarantine/HASH.T.safetensors  chunks that failed a check, moved aside at
                                               time T so they are never matched again
        NAMESPACE/quarantine/HASH.T/           a parted chunk moved aside: its index and
                                               parts under their own names

    ``namespace`` separates models, KV dtypes and block sizes (prefix hashes depend on the
    block size, the KV on the rest); :func:`store_namespace` builds it. Chunks are aligned:
    chunk ``k`` of a prompt holds blocks ``k*chunk_blocks ..`` and is ``chunk_blocks`` long
    unless it is the prompt's last. Files are published atomically by the writer (temporary
    name, rename; a parted chunk's index only once every part is durable), so readers in other
    processes never see a partial one; the presence of a chunk's :func:`committed_file` is its
    index entry.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        namespace: str,
        chunk_blocks: int = DEFAULT_CHUNK_BLOCKS,
    ) -> None:
        if chunk_blocks < 1:
            raise ValueError(f"chunk_blocks must be at least 1, got {chunk_blocks}")
        self.root = Path(root)
        self.namespace = namespace
        self.chunk_blocks = chunk_blocks
        self.directory = self.root / namespace
        self.chunks = self.directory / "chunks"
        self.quarantined = self.directory / "quarantine"

    def chunk_path(self, last_hash: str) -> Path:
        """Where the chunk ending with the block of prefix hash ``last_hash`` lives."""
        if not _HASH.fullmatch(last_hash):
            raise ValueError(f"not a prefix hash: {last_hash!r}")
        return self.chunks / last_hash[:2] / f"{last_hash}{CHUNK_SUFFIX}"

    def chunk_spans(self, num_blocks: int) -> list[tuple[int, int]]:
        """The aligned ``[start, end)`` block ranges of the chunks of ``num_blocks`` blocks."""
        step = self.chunk_blocks
        return [(start, min(start + step, num_blocks)) for start in range(0, num_blocks, step)]

    def longest_prefix(self, chain: Sequence[str]) -> StoreMatch | None:
        """The longest run of stored chunks covering ``chain`` (full-block prefix hashes) from
        its first block.

        Whole chunks are taken while they exist; in the first span without its whole chunk a
        shorter chunk (a shorter prompt's last) ending as late as possible ends the match. One
        ``stat`` per whole single-file chunk, two per parted one (:func:`committed_file`); at
        most ``chunk_blocks`` candidates for the last span. A chunk's ``path`` is its
        ``HASH.safetensors`` in either form.
        """
        found: list[ChunkRef] = []
        for start, end in self.chunk_spans(len(chain)):
            chunk = self._longest_in_span(chain, start, end)
            if chunk is None:
                break
            found.append(chunk)
            if chunk.num_blocks < self.chunk_blocks:
                break
        return StoreMatch(tuple(found)) if found else None

    def _longest_in_span(self, chain: Sequence[str], start: int, end: int) -> ChunkRef | None:
        for last in range(end, start, -1):
            path = self.chunk_path(chain[last - 1])
            if committed_file(path) is not None:
                return ChunkRef(str(path), start, last - start)
        return None

    def has_chunk(self, path: str | os.PathLike[str]) -> bool:
        """Whether the chunk at ``path`` (``HASH.safetensors``) is stored, in either form."""
        return committed_file(path) is not None

    def touch(self, path: str | os.PathLike[str]) -> bool:
        """Record that the chunk at ``path`` was used now: the access time of its
        :func:`committed_file` (a parted chunk's index), which LRU eviction reads. The
        modification time is kept: it tells a rewritten file from the one checked.

        Returns whether the chunk was there to touch: ``False`` when it is gone (evicted,
        quarantined, or set aside by a pruner this instant), which the caller treats as a
        miss. A pruner re-reads the last use after setting a chunk aside, so a chunk touched
        before that is put back (:mod:`kvsnap.engines.vllm.eviction`)."""
        for candidate in (snapshot_path(path), index_path(path)):
            try:
                modified = os.stat(candidate).st_mtime_ns
                os.utime(candidate, ns=(time.time_ns(), modified))
            except OSError:
                continue  # not this form, or gone (evicted, quarantined)
            return True
        return False

    def quarantine(self, path: str | os.PathLike[str]) -> Path | None:
        """Move the chunk at ``path`` (``HASH.safetensors`` or a parted chunk's index) to
        ``quarantine/`` so it is never matched again, keeping it readable there.

        A single file becomes ``quarantine/HASH.T.safetensors``. A parted chunk moves whole
        into ``quarantine/HASH.T/`` under its own names: the index first (from that moment the
        chunk is never matched), then the parts it names, so ``kvsnap inspect
        quarantine/HASH.T/HASH.safetensors`` still opens it. Parts of an index too damaged to
        name them stay behind, named by no index (eviction removes them). Returns the moved
        file (a parted chunk's index), or ``None`` when the chunk is gone already (another
        process moved or evicted it).
        """
        single = snapshot_path(path)
        self.quarantined.mkdir(parents=True, exist_ok=True)
        moment = time.time_ns()
        stem = single.name[: -len(CHUNK_SUFFIX)]
        if not Path(path).name.endswith(INDEX_SUFFIX):
            target = self.quarantined / f"{stem}.{moment}{CHUNK_SUFFIX}"
            with contextlib.suppress(FileNotFoundError):  # no single file: parted, or gone
                os.replace(single, target)
                return target
        return self._quarantine_parted(index_path(single), self.quarantined / f"{stem}.{moment}")

    def _quarantine_parted(self, index: Path, directory: Path) -> Path | None:
        """Move the parted chunk whose index is ``index`` into the new ``directory``."""
        directory.mkdir()
        target = directory / index.name
        try:
            os.replace(index, target)
        except FileNotFoundError:
            directory.rmdir()
            return None
        # The parts the moved index names (read after the move: a write replacing the chunk
        # meanwhile has parts of another generation, which stay with their own index).
        for moved in part_files(target):
            try:
                os.replace(index.parent / moved.name, moved)
            except FileNotFoundError:
                continue  # removed by a pruner or a replacing write: nothing left to keep
        return target


def store_namespace(model_fingerprint: str, dtype: str, block_size: int) -> str:
    """The store namespace of one model (fingerprint), KV dtype and block size."""
    return safe_name(f"{model_fingerprint[:16]}-{dtype}-b{block_size}")
