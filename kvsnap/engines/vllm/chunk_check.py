"""The scheduler's check of a stored chunk before it offers the chunk to vLLM.

:class:`ChunkChecker` opens a chunk (:meth:`kvsnap.Snapshot.open`: a single file, or a parted
chunk through its index, every part checked against it; with signing keys every file must be
signed by one of them) and checks what this engine needs: the model fingerprint, the KV
geometry (the whole model's, all heads, for a parted chunk), one sequence of the expected
length whose id names the store key it follows and its own (the chunk's name is not trusted:
anyone who can write the store can rename a file), and token ids equal to the prompt's. With
``verify`` it also reads every block of every part and checks every checksum (kvsnap's
``verify``), so a damaged chunk is a miss before any load is planned. A chunk that passes is
remembered by the identity (inode, size, modification time) of its committing file (a parted
chunk's index: its parts are never rewritten, a new write gets new part names and a new
index), so each version of a chunk is read once per process.

Nothing here needs vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvsnap import format as fmt
from kvsnap.engines.vllm.prefix_store import ChunkRef, chunk_sequence_id, snapshot_path
from kvsnap.errors import KVSnapError, SignatureError
from kvsnap.format.signing import KeyRing
from kvsnap.snapshot import Snapshot
from kvsnap.store.location import locate
from kvsnap.store.resolve import committed_file

#: What identifies one version of a file: inode, size, modification time.
FileKey = tuple[int, int, int]


def file_key(path: str) -> FileKey | None:
    """The identity now of the file committing the chunk at ``path`` (``HASH.safetensors``):
    the single file's, or a parted chunk's index's (``None``: there is neither). At most two
    ``stat`` calls (:func:`kvsnap.store.resolve.committed_file`)."""
    found = committed_file(locate(snapshot_path(path), None))
    if found is None or found.status is None:
        return None
    return found.status.st_ino, found.status.st_size, found.status.st_mtime_ns


class ChunkChecker:
    """Checks stored chunks against this engine and a prompt; remembers the chunks that pass."""

    def __init__(
        self,
        fingerprint: str,
        expected_geometry: Mapping[str, Any],
        block_size: int,
        *,
        verify: bool,
        keys: KeyRing | None = None,
    ) -> None:
        self.fingerprint = fingerprint
        self.expected_geometry = dict(expected_geometry)
        self.block_size = block_size
        self.verify = verify
        self.keys = keys
        self._passed: dict[str, tuple[FileKey, fmt.SequenceRecord]] = {}

    def check(
        self, chunk: ChunkRef, prompt: np.ndarray, chain: Sequence[str]
    ) -> fmt.SequenceRecord | str:
        """The chunk's sequence record, or why the chunk cannot serve ``prompt``, whose store
        keys (under the request's identity) are ``chain`` (at least up to the chunk's end)."""
        key = file_key(chunk.path)
        if key is None:
            return "the chunk is gone"
        remembered = self._passed.get(chunk.path)
        if remembered is not None and remembered[0] == key:
            record = remembered[1]
        else:
            result = self._read(chunk.path)
            if isinstance(result, str):
                return result
            record = result
        reason = self._fits_prompt(record, chunk, prompt, chain)
        if reason is not None:
            return reason
        self._passed[chunk.path] = (key, record)
        return record

    def forget(self, path: str) -> None:
        """Check the chunk at ``path`` again next time (a load of it failed)."""
        self._passed.pop(path, None)

    def _read(self, path: str) -> fmt.SequenceRecord | str:
        try:
            with Snapshot.open(path, verify=True, keys=self.keys) as snapshot:
                metadata = snapshot.metadata
                reason = self._fits_engine(metadata)
                if reason is not None:
                    return reason
                if self.verify:
                    problems = snapshot.verify()
                    if problems:
                        first = problems[0]
                        where = f"{first.tensor} block {first.block}: " if first.tensor else ""
                        count = len(problems)
                        return f"failed verification ({count} problems): {where}{first.message}"
                return metadata.sequences[0]
        except SignatureError as error:
            return f"{error.detail} (keys {self.keys!r})"
        except (KVSnapError, OSError, ValueError) as error:
            return f"unreadable chunk: {type(error).__name__}: {error}"

    def _fits_engine(self, metadata: fmt.SnapshotMetadata) -> str | None:
        """Why a chunk with ``metadata`` cannot be loaded into this engine, if it cannot."""
        if metadata.source.model_fingerprint != self.fingerprint:
            return (
                f"model fingerprint {metadata.source.model_fingerprint[:16]} differs from the "
                f"engine's {self.fingerprint[:16]}"
            )
        geometry = metadata.geometry
        for name, expected in self.expected_geometry.items():
            if getattr(geometry, name) != expected:
                return f"{name} is {getattr(geometry, name)!r} in the chunk, {expected!r} here"
        if len(metadata.sequences) != 1:
            return f"a chunk holds one sequence, this file holds {len(metadata.sequences)}"
        return None

    def _fits_prompt(
        self, record: fmt.SequenceRecord, chunk: ChunkRef, prompt: np.ndarray, chain: Sequence[str]
    ) -> str | None:
        """Why ``record`` is not blocks ``chunk`` of ``prompt`` (store keys ``chain``), if it
        is not."""
        parent = chain[chunk.first_block - 1] if chunk.first_block else None
        key = chain[chunk.first_block + chunk.num_blocks - 1]
        if record.id != chunk_sequence_id(chunk.first_block, parent, key):
            return (
                f"the chunk's sequence {record.id!r} is not this prompt's prefix under this "
                "identity (a chunk stored under another name?)"
            )
        start = chunk.first_block * self.block_size
        expected = prompt[start : start + chunk.num_blocks * self.block_size]
        if len(record.block_ids) != chunk.num_blocks or not np.array_equal(
            record.token_ids, expected
        ):
            return "the chunk's token ids differ from the prompt's (hash collision?)"
        return None
