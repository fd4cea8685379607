"""The prefix store: prompt prefixes on disk as content-addressed chunks of KV blocks.

A prompt's full blocks are cut into *chunks* of ``chunk_blocks`` blocks, aligned at the start
of the prompt (the last chunk may be shorter). A chunk is an ordinary kvsnap snapshot named by
the store key (:func:`kvsnap.engines.vllm.identity.store_key_chain`: SHA-256 over the request's
cache identity and its tokens) of its last block, which identifies the whole prefix up to it;
prompts that share a prefix share its chunks, so N requests behind one system prompt store it
once. :class:`PrefixStore` finds the longest run of stored chunks
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
import errno
import hashlib
import json
import os
import re
import stat
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsnap import format as fmt
from kvsnap.engines.vllm.identity import KEY_PATTERN
from kvsnap.engines.vllm.store_directories import (
    DIRECTORY_BELOW,
    directory_fd,
    relative_parts,
)
from kvsnap.errors import KVSnapError
from kvsnap.store import resolve
from kvsnap.store.location import INDEX_SUFFIX, Location
from kvsnap.store.resolve import Committed, snapshot_names

#: Suffix of every chunk file.
CHUNK_SUFFIX = ".safetensors"
#: Default blocks per chunk (``chunk_blocks``): 256 tokens at vLLM's GPU block size of 16.
DEFAULT_CHUNK_BLOCKS = 16
#: Chunk names written before store keys were SHA-256 (xxh3-128, 32 digits): never matched
#: (a lookup builds only 64-digit names), removed by pruning (``legacy`` entries).
LEGACY_KEY = re.compile(r"[0-9a-f]{32}")


def safe_name(text: str) -> str:
    """``text`` reduced to characters safe in one file name (other characters become ``_``)."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", text).strip(".")
    return cleaned or "_"


def index_path(path: str | os.PathLike[str]) -> Path:
    """The parted-snapshot index of the chunk (or snapshot) ``path``: ``path + ".index.json"``,
    or ``path`` itself when it names an index already."""
    return _names(path)[1]


def snapshot_path(path: str | os.PathLike[str]) -> Path:
    """The ``NAME.safetensors`` path of the chunk (or snapshot) ``path``, whether ``path``
    names that file or its index."""
    return _names(path)[0]


def _names(path: str | os.PathLike[str]) -> tuple[Path, Path]:
    text = os.fspath(path)
    single, index = snapshot_names(Location(text, text))
    return Path(single.path), Path(index.path)


def _committing(path: str | os.PathLike[str], *, regular: bool) -> Committed | None:
    """:func:`kvsnap.store.resolve.committed_file` of the chunk ``path`` names (either name).

    Works on the path's text: a scheduler asks this several times per chunk of every prompt,
    and building ``Path`` objects for both names cost several times the ``stat`` itself."""
    text = os.fspath(path)
    if resolve.is_index_name(text):
        text = text[: -len(INDEX_SUFFIX)]
    return resolve.committed_file(Location(text, text), regular=regular)


def _is_committed(path: str | os.PathLike[str]) -> bool:
    """Whether :func:`committed_file` of ``path`` would name a file (without making its
    ``Path``)."""
    return _committing(path, regular=True) is not None


def committed_file(path: str | os.PathLike[str]) -> Path | None:
    """The file whose presence commits the chunk at ``path`` (``HASH.safetensors`` or its
    index): the single file when it exists, else the parted snapshot's index when that
    exists, else ``None``. At most two ``stat`` calls.

    Both exist only for a moment while one form replaces the other; the single file is what
    :meth:`kvsnap.Snapshot.open` opens then, so it is the one returned.
    """
    found = _committing(path, regular=True)
    return None if found is None else Path(found.location.path)


def part_files(index: str | os.PathLike[str]) -> list[Path]:
    """The part files the parted-snapshot index at ``index`` names, beside it, that are its
    own by name (:func:`kvsnap.format.is_part_of`); ``[]`` when the index is gone or
    unreadable (its parts are then named by no index: see
    :mod:`kvsnap.engines.vllm.eviction` for what becomes of them). The index is read without
    moving its access time where the OS allows (``O_NOATIME``): listing a store must not make
    every parted chunk look just used to LRU eviction."""
    index = Path(index)
    try:
        parsed = resolve.read_index(Location(str(index), str(index)), keep_atime=True)
    except (KVSnapError, ValueError):
        return []
    if not isinstance(parsed, fmt.PartsIndex):
        return []
    stem = resolve.snapshot_stem(index.name)
    return [index.parent / part.file for part in parsed.parts if fmt.is_part_of(stem, part.file)]


def chunk_sequence_id(first_block: int, parent: str | None, key: str) -> str:
    """The id of a chunk's one sequence: where it starts, the store key of the block before
    it (``root`` for the first chunk) and its own key (its last block's). A chunk's file name
    can be changed by anyone who can write the store; its (signed) sequence id cannot, so a
    chunk copied under another identity's name never passes the check."""
    return f"prefix@{first_block}:{parent or 'root'}>{key}"


_CHUNK_ID = re.compile(r"prefix@(?P<first>[0-9]+):(?P<parent>root|[0-9a-f]+)>(?P<key>[0-9a-f]+)")


def name_problem(
    path: str | os.PathLike[str], sequences: Sequence[fmt.SequenceRecord]
) -> str | None:
    """Why the chunk at ``path`` (``HASH.safetensors`` or its index) is not the chunk its name
    says, if it is not: it holds one sequence whose (signed) id names ``HASH`` as its own key
    (:func:`chunk_sequence_id`). A chunk copied under another chunk's name fails this; the
    scheduler refuses it as a miss, ``kvsnap store verify`` reports it."""
    name = snapshot_path(path).name
    stem = name[: -len(CHUNK_SUFFIX)]
    if len(sequences) != 1:
        return f"{name} holds {len(sequences)} sequences, a chunk one"
    found = _CHUNK_ID.fullmatch(sequences[0].id)
    if found is None:
        return f"{name} holds sequence {sequences[0].id!r}, not a chunk's"
    if found.group("key") != stem:
        return (
            f"{name} holds the chunk {found.group('key')} (sequence {sequences[0].id!r}): "
            "a chunk copied or renamed under another chunk's name"
        )
    return None


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

        NAMESPACE/chunks/HH/HASH.safetensors   a chunk, named by the store key of its last
                                               block (HH: the hash's first two digits)
        NAMESPACE/chunks/HH/HASH.safetensors.index.json
        NAMESPACE/chunks/HH/HASH-gG-part-0000i-of-0000k.safetensors
                                               a parted chunk (TP > 1, every rank wrote its
                                               own heads): the index commits it
        NAMESPACE/quarantine/HASH.T.safetensors  chunks that failed a check, moved aside at
                                               time T so they are never matched again
        NAMESPACE/quarantine/HASH.T/           a parted chunk moved aside: its index and
                                               parts under their own names

    ``namespace`` separates models (config and weights), KV dtypes, block sizes and KV
    geometries (store keys depend on the block size, the KV on the rest);
    :func:`store_namespace` builds it. Chunks are aligned:
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
        #: A store this process cannot write (a read-only mount, no write permission): it
        #: serves loads; nothing is saved, and a use or a bad chunk is not recorded.
        self.read_only = is_read_only(self.root)

    def chunk_path(self, last_key: str) -> Path:
        """Where the chunk ending with the block of store key ``last_key`` lives."""
        if not KEY_PATTERN.fullmatch(last_key):
            raise ValueError(f"not a store key (64 hex digits): {last_key!r}")
        # One Path from the text: joining Path objects twice cost more than the lookups after.
        return Path(f"{self.chunks}{os.sep}{last_key[:2]}{os.sep}{last_key}{CHUNK_SUFFIX}")

    def chunk_directory(self, path: str | os.PathLike[str]) -> Path:
        """The directory of the chunk at ``path``, created (with the store's own permissions,
        as every directory under the root: :func:`make_directories`) if missing."""
        directory = Path(path).parent
        make_directories(directory, self.root)
        return directory

    def chunk_spans(self, num_blocks: int) -> list[tuple[int, int]]:
        """The aligned ``[start, end)`` block ranges of the chunks of ``num_blocks`` blocks."""
        step = self.chunk_blocks
        return [(start, min(start + step, num_blocks)) for start in range(0, num_blocks, step)]

    def longest_prefix(self, chain: Sequence[str]) -> StoreMatch | None:
        """The longest run of stored chunks covering ``chain`` (full-block store keys) from
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
            if _is_committed(path):
                return ChunkRef(str(path), start, last - start)
        return None

    def has_chunk(self, path: str | os.PathLike[str]) -> bool:
        """Whether the chunk at ``path`` (``HASH.safetensors``) is stored, in either form."""
        return _is_committed(path)

    def touch(self, path: str | os.PathLike[str]) -> bool:
        """Record that the chunk at ``path`` was used now: the access time of its
        :func:`committed_file` (a parted chunk's index), which LRU eviction reads. The
        modification time is kept: it tells a rewritten file from the one checked.

        Returns whether the chunk was there to touch: ``False`` when it is gone (evicted,
        quarantined, or set aside by a pruner this instant), which the caller treats as a
        miss. A pruner re-reads the last use after setting a chunk aside, so a chunk touched
        before that is put back (:mod:`kvsnap.engines.vllm.eviction`)."""
        for _ in range(2):  # again when the file found went since its stat
            found = _committing(path, regular=False)
            if found is None:
                return False  # gone (evicted, quarantined)
            assert found.status is not None
            try:
                # Never through a link: a planted one must not have a file elsewhere touched.
                os.utime(
                    found.location.path,
                    ns=(time.time_ns(), found.status.st_mtime_ns),
                    follow_symlinks=False,
                )
            except FileNotFoundError:
                continue
            except OSError as error:
                # A store this process cannot write is not pruned by it: no record needed.
                # Any other error (a directory where the chunk was, a link loop): a miss.
                return error.errno in _CANNOT_WRITE
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
        process moved or evicted it) or cannot be moved (a store this process cannot write:
        the chunk is checked, and missed, again when next matched).

        Both directories are opened below the root without following links
        (:mod:`~kvsnap.engines.vllm.store_directories`): where the store's directories are not
        what they should be (a file or a link where ``quarantine`` or ``chunks/HH`` belongs,
        a link to another filesystem or outside the store) this raises ``OSError`` and moves
        nothing; nothing outside the store is ever written (:class:`~kvsnap.engines.vllm.
        quarantine.Quarantine` turns that into a logged, skipped quarantine).
        """
        try:
            return self._quarantine(path)
        except OSError as error:
            if error.errno not in _CANNOT_WRITE:
                raise
            return None

    def _quarantine(self, path: str | os.PathLike[str]) -> Path | None:
        single = snapshot_path(path)
        moment = time.time_ns()
        stem = single.name[: -len(CHUNK_SUFFIX)]
        mode = stat.S_IMODE(os.stat(self.root).st_mode)
        with (
            directory_fd(self.root, relative_parts(self.root, single.parent)) as source,
            directory_fd(
                self.root, relative_parts(self.root, self.quarantined), create_mode=mode
            ) as target,
        ):
            if not resolve.is_index_name(Path(path).name):
                name = f"{stem}.{moment}{CHUNK_SUFFIX}"
                with contextlib.suppress(FileNotFoundError):  # no single file: parted, or gone
                    os.replace(single.name, name, src_dir_fd=source, dst_dir_fd=target)
                    return self.quarantined / name
            return self._quarantine_parted(
                source, target, index_path(single).name, f"{stem}.{moment}"
            )

    def _quarantine_parted(
        self, source: int, target: int, index: str, directory: str
    ) -> Path | None:
        """Move the parted chunk whose index is named ``index`` in the open directory
        ``source`` into the new ``directory`` in the open quarantine directory ``target``."""
        os.mkdir(directory, 0o700, dir_fd=target)
        moved = os.open(directory, DIRECTORY_BELOW, dir_fd=target)
        try:
            try:
                os.replace(index, index, src_dir_fd=source, dst_dir_fd=moved)
            except FileNotFoundError:
                os.rmdir(directory, dir_fd=target)
                return None
            moved_index = self.quarantined / directory / index
            # The parts the moved index names (read after the move: a write replacing the
            # chunk meanwhile has parts of another generation, which stay with their index).
            for part in part_files(moved_index):
                with contextlib.suppress(FileNotFoundError):  # gone: a pruner, a new write
                    os.replace(part.name, part.name, src_dir_fd=source, dst_dir_fd=moved)
            return moved_index
        finally:
            os.close(moved)


#: errno values of a write refused by the filesystem or the permissions.
_CANNOT_WRITE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})


def is_read_only(root: str | os.PathLike[str]) -> bool:
    """Whether this process cannot write the existing directory ``root`` (a read-only mount,
    or no write permission); ``False`` for a missing one (it will be created)."""
    try:
        flags = os.statvfs(root).f_flag
    except FileNotFoundError:
        return False
    return bool(flags & os.ST_RDONLY) or not os.access(root, os.W_OK)


def store_namespace(
    model_fingerprint: str, geometry: Mapping[str, Any], chunk_blocks: int = DEFAULT_CHUNK_BLOCKS
) -> str:
    """The store namespace of one model, KV layout and chunk size:
    ``FINGERPRINT16-DTYPE-bBLOCK-gGEOMETRY8``, then ``-cCHUNK`` for a chunk size other than
    the default.

    ``model_fingerprint`` covers the config (RoPE scaling included) and the weights
    (:func:`kvsnap.format.model_fingerprint_with_weights`); ``geometry`` holds the canonical
    KV geometry's fields (``num_layers``, ``num_kv_heads``, ``head_dim``, ``block_size``,
    ``dtype``, ...), hashed into the last component so that any change of them is another
    namespace. Chunks of other namespaces are never matched.

    The chunk size is part of it because a chunk is named by its last block's key: an engine
    cutting other chunks finds another size's chunk under the key it looks up (a 48-block
    engine's first span ends where a 16-block store's third chunk does), which fails its check
    as a chunk under a wrong name and would be quarantined, valid as it is. The default
    size adds nothing, so stores written before keep their chunks.
    """
    canonical = json.dumps(dict(geometry), sort_keys=True, separators=(",", ":"), default=str)
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:8]
    dtype, block_size = geometry.get("dtype", "unknown"), geometry.get("block_size", 0)
    size = "" if chunk_blocks == DEFAULT_CHUNK_BLOCKS else f"-c{chunk_blocks}"
    return safe_name(f"{model_fingerprint[:16]}-{dtype}-b{block_size}-g{digest}{size}")


#: Permission bits a store directory may grant beyond its owner's without ``shared``.
_GROUP_OR_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH


def check_store_directory(root: str | os.PathLike[str], *, shared: bool, signed: bool) -> Path:
    """The store root ``root``, created private (``0700``) when missing, checked otherwise.

    A root that other users may write (group or world write permission) or that another user
    owns could hold chunks nobody here wrote: it is refused with a ``PermissionError`` saying
    how to fix it, unless ``shared`` (a deliberate multi-user store), which in turn requires
    ``signed`` (a signing key: in a shared store only signed chunks are trusted).
    """
    path = Path(root)
    if shared and not signed:
        raise PermissionError(
            f"a shared store ({path}) needs a signing key (key_file or KVSNAP_KEY_FILE): "
            "without one, anyone who can write it can plant KV"
        )
    if not path.exists():
        path.mkdir(mode=0o700, parents=True)
        return path
    status = path.stat()
    if shared:
        return path
    if status.st_uid != os.geteuid():
        raise PermissionError(
            f"the store {path} belongs to user id {status.st_uid}, not to this process "
            f"({os.geteuid()}): use a directory of your own, or set shared_store with a key"
        )
    if status.st_mode & _GROUP_OR_OTHER_WRITE:
        mode = stat.S_IMODE(status.st_mode)
        raise PermissionError(
            f"the store {path} is writable by other users (mode {mode:o}): run chmod 700 "
            f"{path}, or set shared_store with a signing key for a deliberate shared store"
        )
    return path


def make_directories(directory: Path, root: Path) -> None:
    """Create ``directory`` and its missing parents up to ``root`` with the root's permission
    bits exactly (``0700`` for a private store; a shared store's group bits), whatever the
    process umask (a missing root is created ``0700``); files created in them get no more
    access than they grant (:func:`kvsnap.store.publish.create_temp`).

    Every component below the root is opened without following a link: a link or a file
    where one of them belongs raises ``OSError`` (``ELOOP``, ``ENOTDIR``), so a save never
    writes through a link planted in the store."""
    if not root.is_dir():
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = stat.S_IMODE(root.stat().st_mode)
    with directory_fd(root, relative_parts(root, directory), create_mode=mode):
        pass
