"""The prefix store: prompt prefixes on disk as content-addressed chunks of KV blocks.

A prompt's full blocks are cut into *chunks* of ``chunk_blocks`` blocks, aligned at the start
of the prompt (the last chunk may be shorter). A chunk is an ordinary kvsnap snapshot named by
the prefix hash (:func:`kvsnap.format.prefix_hash_chain`) of its last block, which identifies
the whole prefix up to it; prompts that share a prefix share its chunks, so N requests behind
one system prompt store it once. :class:`PrefixStore` finds the longest run of stored chunks
of a prompt (:meth:`~PrefixStore.longest_prefix`), records their use for LRU eviction
(:meth:`~PrefixStore.touch`) and moves damaged ones aside (:meth:`~PrefixStore.quarantine`);
:mod:`kvsnap.engines.vllm.eviction` lists and prunes a store. The chunks themselves are
written by :func:`kvsnap.snapshot.capture` and read by :class:`kvsnap.store.SnapshotReader`.

Nothing here needs vLLM.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

#: Suffix of every chunk file.
CHUNK_SUFFIX = ".safetensors"
#: Default blocks per chunk (``chunk_blocks``): 256 tokens at vLLM's GPU block size of 16.
DEFAULT_CHUNK_BLOCKS = 16
_HASH = re.compile(r"[0-9a-f]{32}")


def safe_name(text: str) -> str:
    """``text`` reduced to characters safe in one file name (other characters become ``_``)."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", text).strip(".")
    return cleaned or "_"


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
        NAMESPACE/quarantine/HASH.T.safetensors  chunks that failed a check, moved aside at
                                               time T so they are never matched again

    ``namespace`` separates models, KV dtypes and block sizes (prefix hashes depend on the
    block size, the KV on the rest); :func:`store_namespace` builds it. Chunks are aligned:
    chunk ``k`` of a prompt holds blocks ``k*chunk_blocks ..`` and is ``chunk_blocks`` long
    unless it is the prompt's last. Files are published atomically by the writer (temporary
    name, rename), so readers in other processes never see a partial one; a file's presence is
    its index entry.
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
        ``stat`` per whole chunk, at most ``chunk_blocks`` for the last span.
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
            if path.is_file():
                return ChunkRef(str(path), start, last - start)
        return None

    def touch(self, path: str | os.PathLike[str]) -> None:
        """Record that the chunk at ``path`` was used now (its access time; LRU eviction reads
        it). The modification time is kept: it tells a rewritten file from the one checked."""
        try:
            modified = os.stat(path).st_mtime_ns
            os.utime(path, ns=(time.time_ns(), modified))
        except OSError:
            return  # gone (evicted, quarantined): nothing to record

    def quarantine(self, path: str | os.PathLike[str]) -> Path | None:
        """Move the chunk at ``path`` to ``quarantine/`` so it is never matched again.

        Returns where it went, or ``None`` when it is gone already (another process moved or
        evicted it).
        """
        source = Path(path)
        self.quarantined.mkdir(parents=True, exist_ok=True)
        target = self.quarantined / f"{source.stem}.{time.time_ns()}{CHUNK_SUFFIX}"
        try:
            os.replace(source, target)
        except FileNotFoundError:
            return None
        return target


def store_namespace(model_fingerprint: str, dtype: str, block_size: int) -> str:
    """The store namespace of one model (fingerprint), KV dtype and block size."""
    return safe_name(f"{model_fingerprint[:16]}-{dtype}-b{block_size}")
