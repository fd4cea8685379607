"""The prefix store: kvsnap snapshots of prompt prefixes on disk, indexed by prefix hash.

:class:`PrefixStore` finds the longest stored prefix of a prompt's block hash chain
(:meth:`~PrefixStore.longest_prefix`) and publishes the index entries of a newly written
snapshot (:meth:`~PrefixStore.publish_index`); :func:`store_namespace` keeps models, KV dtypes
and block sizes apart. It reads and writes index files only; the snapshots themselves are
written by :func:`kvsnap.snapshot.capture` and read by :class:`kvsnap.store.SnapshotReader`.

Nothing here needs vLLM.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


def safe_name(text: str) -> str:
    """``text`` reduced to characters safe in one file name (other characters become ``_``)."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", text).strip(".")
    return cleaned or "_"


@dataclass(frozen=True)
class StoreMatch:
    """The longest stored prefix of a prompt: ``num_blocks`` leading full blocks in ``path``."""

    num_blocks: int
    path: str
    last_hash: str


class PrefixStore:
    """A directory of kvsnap snapshots of prompt prefixes, indexed by prefix hash.

    Layout of ``root``::

        NAMESPACE/snapshots/HASH.safetensors   one snapshot per saved prefix, named by the
                                               prefix hash of its last block
        NAMESPACE/index/HH/HASH                for every block of every saved prefix: the
                                               snapshot file (a name in snapshots/) holding it

    ``namespace`` separates models, KV dtypes and block sizes (prefix hashes depend on the
    block size, the KV on the rest); :func:`store_namespace` builds it. A snapshot holds its
    prefix from the first block, so if block ``i`` of a prompt is indexed, blocks ``0..i`` are
    all in that one file. Every file is published atomically (temporary name, rename), so
    readers in other processes never see a partial one.
    """

    def __init__(self, root: str | os.PathLike[str], namespace: str) -> None:
        self.root = Path(root)
        self.namespace = namespace
        self.directory = self.root / namespace
        self.snapshots = self.directory / "snapshots"
        self.index = self.directory / "index"

    def snapshot_path(self, last_hash: str) -> Path:
        """Where the snapshot of the prefix ending with the block ``last_hash`` lives."""
        return self.snapshots / f"{last_hash}.safetensors"

    def _entry(self, block_hash: str) -> Path:
        return self.index / block_hash[:2] / block_hash

    def indexed_snapshot(self, block_hash: str) -> Path | None:
        """The snapshot file holding the block with prefix hash ``block_hash``, if indexed."""
        try:
            name = self._entry(block_hash).read_text().strip()
        except OSError:
            return None
        if not name or safe_name(name) != name:
            return None
        return self.snapshots / name

    def longest_prefix(self, chain: Sequence[str]) -> StoreMatch | None:
        """The longest leading run of ``chain`` (full-block prefix hashes) that is indexed.

        Indexed blocks form a prefix of every chain (a snapshot indexes all of its blocks), so
        a binary search over the chain needs ``log2(len(chain))`` index reads.
        """
        low, high = 0, len(chain)  # blocks [0, low) indexed; blocks from `high` on are not
        found: Path | None = None
        while low < high:
            middle = (low + high + 1) // 2
            path = self.indexed_snapshot(chain[middle - 1])
            if path is not None:
                low, found = middle, path
            else:
                high = middle - 1
        if low == 0:
            return None
        if found is None or found != self.indexed_snapshot(chain[low - 1]):
            found = self.indexed_snapshot(chain[low - 1])
        if found is None:
            return None
        return StoreMatch(num_blocks=low, path=str(found), last_hash=chain[low - 1])

    def publish_index(self, chain: Sequence[str], snapshot: Path) -> None:
        """Index every block of ``chain`` as held by ``snapshot`` (atomically, entry by entry).

        Entries are written from the last block to the first, so a concurrent
        :meth:`longest_prefix` never finds a block whose predecessors are not yet indexed by
        some snapshot that holds them.
        """
        for block_hash in reversed(chain):
            entry = self._entry(block_hash)
            entry.parent.mkdir(parents=True, exist_ok=True)
            temporary = entry.with_name(f".{entry.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            temporary.write_text(snapshot.name)
            os.replace(temporary, entry)


def store_namespace(model_fingerprint: str, dtype: str, block_size: int) -> str:
    """The store namespace of one model (fingerprint), KV dtype and block size."""
    return safe_name(f"{model_fingerprint[:16]}-{dtype}-b{block_size}")
