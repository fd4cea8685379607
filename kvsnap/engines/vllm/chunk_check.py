"""The scheduler's check of a stored chunk before it offers the chunk to vLLM.

:class:`ChunkChecker` opens a chunk (:meth:`kvsnap.Snapshot.open`: a single file, or a parted
chunk through its index, every part checked against it; with signing keys every file must be
signed by one of them, its pages bound by BLAKE3 digests: an older signed chunk, its pages
bound by xxh3-64 only, is a miss) and checks what this engine needs: the model fingerprint,
the KV geometry (the whole model's, all heads, for a parted chunk), one sequence of the expected
length whose id names the store key it follows and its own (the chunk's name is not trusted:
anyone who can write the store can rename a file), and token ids equal to the prompt's. With
``verify`` it also reads every block of every part and checks every checksum (kvsnap's
``verify``), so a damaged chunk is a miss before any load is planned. A chunk that passes is
remembered by the version (device, inode, size, modification and change times) of its
committing file (a parted chunk's index: its parts are never rewritten, a new write gets new
part names and a new index), so each version of a chunk is read once per process while it is
among the last :data:`MAX_REMEMBERED_CHUNKS` that passed. The change time is the one the
scheduler's own record of a hit left (:meth:`ChunkChecker.touched`): any write to the file
since, a rewrite in place that put its size and modification time back included, moves it and
makes the file a new version, checked again.

Bytes can still change with no trace in the file's times (bit rot on the disk, read back once
the page cache dropped them). So with ``verify`` a chunk about to be offered to vLLM
(``before_hit``) is read and verified again every time, unless the worker loads it from bytes
verified in memory: those the scheduler's hand-over still holds for that version (a chunk
handed over and read whole, :meth:`ChunkChecker.reads_what_loads`; the worker gives a chunk it
loaded from them back, :meth:`~kvsnap.engines.open_snapshots.OpenSnapshots.give_back`). A
worker that reads the file itself (in a process of its own, or a chunk too large to be read
whole) then reads, within the step, the bytes just verified. A chunk damaged on the disk
since its last check is a miss, never a failed load (under vLLM's ``fail`` policy, a failed
request).

Where the worker runs in the scheduler's process (vLLM's ``uni`` executor, a TP size of 1),
a single-file chunk that passed is handed to it open (:data:`~kvsnap.engines.vllm.open_chunks.
CHECKED_CHUNKS`): the worker's load takes it instead of opening and checking the file's
header, trailer, signature and metadata again, but only while the file is the version that
was checked (device, inode, size, modification and change times, of the path and of the open
descriptor alike; the scheduler's own record of the chunk's use moves the change time, and
only that, which :meth:`~kvsnap.engines.open_snapshots.OpenSnapshots.touched` accepts); the
worker still checks every page it copies against the checksums that open read. A chunk of at
most :data:`~kvsnap.store.base.tuning.WHOLE_READ_MAX_BYTES` that is verified or handed over is read
whole as it opens, and its checks and the worker's load are served from those bytes (one read
per chunk, not one per header, trailer, metadata tensor and run of pages).

Nothing here needs vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvsnap import format as fmt
from kvsnap.caches import BoundedLRU
from kvsnap.engines.vllm.open_chunks import CHECKED_CHUNKS
from kvsnap.engines.vllm.prefix_store import ChunkRef, chunk_sequence_id
from kvsnap.errors import KVSnapError, SignatureError, UnsupportedVersionError
from kvsnap.format.signing import KeyRing
from kvsnap.snapshot import Snapshot
from kvsnap.store.base import tuning
from kvsnap.store.files.location import INDEX_SUFFIX, Location
from kvsnap.store.files.resolve import committed_file, is_index_name
from kvsnap.store.read.head_parts import open_snapshot

#: What identifies one version of a chunk's committing file: device, inode, size,
#: modification and change times, and whether it is a parted chunk's index.
FileKey = tuple[int, int, int, int, int, bool]


def file_key(path: str) -> FileKey | None:
    """The version now of the file committing the chunk at ``path`` (``HASH.safetensors``, a
    local path, or its index): the single file's, or a parted chunk's index's (``None``: there
    is neither). At most two ``stat`` calls (:func:`kvsnap.store.files.resolve.committed_file`).
    Works on the path's text: the scheduler asks twice per chunk of every hit, and parsing the
    path and building ``Path`` objects cost more than the ``stat``."""
    text = os.fspath(path)
    if is_index_name(text):
        text = text[: -len(INDEX_SUFFIX)]
    found = committed_file(Location(text, text))
    if found is None or found.status is None:
        return None
    status = found.status
    return (
        status.st_dev,
        status.st_ino,
        status.st_size,
        status.st_mtime_ns,
        status.st_ctime_ns,
        found.indexed,
    )


#: Chunks a :class:`ChunkChecker` remembers as passed (the least recently matched dropped past
#: it): a long-lived engine matches ever new prefixes, and each entry holds a chunk's token
#: ids (a 512-token chunk: ~5 KB), so about 5 MB at most; a chunk dropped is checked again
#: on its next match (a fraction of a millisecond).
MAX_REMEMBERED_CHUNKS = 1024


class ChunkChecker:
    """Checks stored chunks against this engine and a prompt; remembers the last
    ``remember`` chunks that passed."""

    def __init__(
        self,
        fingerprint: str,
        expected_geometry: Mapping[str, Any],
        block_size: int,
        *,
        verify: bool,
        keys: KeyRing | None = None,
        hand_over: bool = False,
        remember: int = MAX_REMEMBERED_CHUNKS,
    ) -> None:
        self.fingerprint = fingerprint
        self.expected_geometry = dict(expected_geometry)
        self.block_size = block_size
        self.verify = verify
        self.keys = keys
        #: Whether chunks that pass are kept open for a worker in this process
        #: (:data:`CHECKED_CHUNKS`).
        self.hand_over = hand_over
        self._passed: BoundedLRU[str, tuple[FileKey, fmt.SequenceRecord]] = BoundedLRU(remember)

    def check(
        self,
        chunk: ChunkRef,
        prompt: np.ndarray,
        chain: Sequence[str],
        *,
        before_hit: bool = False,
    ) -> fmt.SequenceRecord | str:
        """The chunk's sequence record, or why the chunk cannot serve ``prompt``, whose store
        keys (under the request's identity) are ``chain`` (at least up to the chunk's end).
        ``before_hit``: the chunk is about to be offered to vLLM: one whose check reads what
        the worker loads is verified again (see the module's notes)."""
        key = file_key(chunk.path)
        if key is None:
            return "the chunk is gone"
        remembered = self._passed.get(chunk.path)
        # A worker that reads the file again would meet bytes changed with no trace in the
        # file's times (bit rot read back from the disk) as a failed load, a failed request
        # under vLLM's "fail": so a chunk about to be offered is verified again, unless the
        # worker loads it from bytes verified in memory (the hand-over still holds them).
        again = (
            before_hit
            and self.verify
            and not (self.reads_what_loads(key) and CHECKED_CHUNKS.holds(chunk.path, key[:4]))
        )
        if remembered is not None and remembered[0] == key and not again:
            record = remembered[1]
        else:
            result = self._read(chunk.path)
            if isinstance(result, str):
                return result
            record = result
        reason = self._fits_prompt(record, chunk, prompt, chain)
        if reason is not None:
            return reason
        self._passed.put(chunk.path, (key, record))
        return record

    def forget(self, path: str) -> None:
        """Check the chunk at ``path`` again next time (a load of it failed)."""
        self._passed.discard(path)

    def reads_what_loads(self, key: FileKey) -> bool:
        """Whether verifying the chunk whose committing file is ``key`` reads the bytes the
        worker then loads: verified, handed over to a worker in this process, and one file
        small enough to be read whole (the worker loads from the bytes the check read)."""
        size, indexed = key[2], key[5]
        return (
            self.verify and self.hand_over and not indexed and size <= tuning.WHOLE_READ_MAX_BYTES
        )

    def touched(self, path: str) -> None:
        """After the scheduler recorded a use of the chunk at ``path`` (its access time, which
        moves the change time and nothing else): remember the chunk's change time as it is
        now, if the rest of its version is still the one that passed, so that only another
        change makes it a new version."""
        remembered = self._passed.get(path)
        if remembered is None:
            return
        now = file_key(path)
        if now is not None and now[:4] == remembered[0][:4] and now[5] == remembered[0][5]:
            self._passed.put(path, (now, remembered[1]))
        else:
            self._passed.discard(path)

    def _read(self, path: str) -> fmt.SequenceRecord | str:
        # Verifying reads every byte, and a chunk handed over is loaded from the same open
        # files: a small chunk is read whole once, rather than once per header, trailer,
        # metadata tensor and run of pages, here and in the worker's load.
        whole = tuning.WHOLE_READ_MAX_BYTES if self.verify or self.hand_over else 0
        try:
            snapshot = _open_chunk(path, self.keys, whole)
            kept = False
            try:
                reason = self._checked(snapshot)
                if isinstance(reason, str):
                    return reason
                kept = self.hand_over and CHECKED_CHUNKS.keep(path, snapshot, self.keys)
                return reason
            finally:
                if not kept:
                    snapshot.close()
        except SignatureError as error:
            return f"{error.detail} (keys {self.keys!r})"
        except (KVSnapError, OSError, ValueError) as error:
            return f"unreadable chunk: {type(error).__name__}: {error}"

    def _checked(self, snapshot: Snapshot) -> fmt.SequenceRecord | str:
        """The sequence of the open chunk ``snapshot``, or why it cannot serve this engine
        (with :attr:`verify`, every checksum read and checked)."""
        metadata = snapshot.metadata
        reason = self._fits_engine(metadata, snapshot.signature_algorithm, snapshot.page_binding)
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

    def _fits_engine(
        self, metadata: fmt.SnapshotMetadata, signature: str | None, page_binding: str | None
    ) -> str | None:
        """Why a chunk with ``metadata``, signed with ``signature`` binding its pages by
        ``page_binding`` (``kvsnap.Snapshot``'s: an encoded chunk's are its encoded file's
        own), cannot be loaded into this engine, if it cannot."""
        if self.keys is not None and page_binding != "blake3":
            # Signed before pages were bound by BLAKE3: its pages are bound by xxh3-64 only,
            # whose second preimages take seconds. A miss: recomputed and saved anew.
            return (
                f"signed with {signature}, its pages bound by xxh3-64 only (not "
                "collision-resistant): served only with BLAKE3 page digests"
            )
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


def _open_chunk(path: str, keys: KeyRing | None, whole: int) -> Snapshot:
    """The chunk at ``path``, every byte of a small one read at once; an encoded chunk (the
    ``compression`` option) checked whole and decoded as ``Snapshot.open`` does."""
    try:
        return Snapshot(
            open_snapshot(path, verify=True, keys=keys, read_whole_max_bytes=whole), path
        )
    except UnsupportedVersionError:
        return Snapshot.open(path, keys=keys)
