"""One remote chunk brought into the local store: fetched, checked as a local chunk, published.

:func:`fetch_into_store` runs on a fetch thread of the scheduler's
:class:`~kvsnap.engines.vllm.remote_fetch.RemoteFetcher`. It reads the chunk's object in one
request, writes it under a staged name beside the chunk's place in the local store
(:func:`~kvsnap.engines.vllm.eviction.staged_path`: not part of the store yet, a dead writer's
leftover once its process is gone), checks it exactly as the scheduler checks a local chunk
(:class:`~kvsnap.engines.vllm.chunk_check.ChunkChecker`, with ``verify`` on: with the keys its
signature, the model fingerprint and KV geometry, its one sequence's id, which names this
prompt's span and store keys under the request's identity, the token ids, every checksum), and
only then publishes it: within the store's bound under its lock, as a worker commits a save
(:func:`~kvsnap.engines.vllm.capacity.commit_within_capacity`), or linked into place, never
replacing a chunk another engine put there meanwhile. An object that fails the check never
enters the store. The scheduler then matches and checks the chunk like any other.

Nothing here needs vLLM.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvsnap.engines.vllm.capacity import (
    LOCK_WAIT_S,
    CapacityLockError,
    commit_within_capacity,
)
from kvsnap.engines.vllm.chunk_check import ChunkChecker
from kvsnap.engines.vllm.events import EventLog
from kvsnap.engines.vllm.eviction import staged_path
from kvsnap.engines.vllm.prefix_store import ChunkRef, PrefixStore
from kvsnap.engines.vllm.remote_health import RemoteHealth, failure_kind
from kvsnap.engines.vllm.remote_store import RemoteStore
from kvsnap.store import publish


@dataclass(frozen=True)
class FetchTarget:
    """A chunk to fetch: blocks ``first_block .. first_block + num_blocks`` of ``prompt``
    (store keys ``chain``), stored locally at ``path``; its last block's key is ``key``."""

    key: str
    path: str
    first_block: int
    num_blocks: int
    prompt: np.ndarray
    chain: Sequence[str]
    request_id: str


@dataclass(frozen=True)
class LocalPublish:
    """How fetched chunks enter the local store: its bound (``None``: none) and the rest of
    what a commit within it needs, and the checker's settings (this engine's)."""

    store: PrefixStore
    checker: ChunkChecker
    capacity: int | None
    min_idle_s: float
    shared: bool
    record_use: bool


def fetch_into_store(
    target: FetchTarget,
    remote: RemoteStore,
    local: LocalPublish,
    health: RemoteHealth,
    events: EventLog,
    *,
    record: Callable[[FetchTarget], object] | None = None,
) -> bool:
    """Bring ``target`` from ``remote`` into the local store; whether the store holds it now
    (it did already, or it was fetched, checked and published). A failure is counted by
    ``health`` and is a miss; nothing here raises. A fetch is recorded on the remote
    (:func:`record_fetch`, with ``local.record_use``) by ``record`` (which queues it: the
    request waiting for this fetch does not wait for that ``PUT`` too), or here without it."""
    store = local.store
    if store.has_chunk(target.path):
        return True  # another engine of this node published it meanwhile
    if not health.available():
        return False
    started = time.perf_counter()
    try:
        data = remote.read(target.key)
    except Exception as error:
        kind = failure_kind(error)
        if kind != "not_found":
            health.failed(kind, error, path=target.path)
        return False
    health.succeeded()
    try:
        published = _publish(target, data, local, health, events)
    except Exception as error:  # a local failure (a full disk, a planted link): a miss
        health.failed("error", error, path=target.path)
        return False
    if not published:
        return store.has_chunk(target.path)
    events.emit(
        "fetch",
        request=target.request_id,
        path=target.path,
        bytes=len(data),
        seconds=round(time.perf_counter() - started, 6),
    )
    if local.record_use:
        if record is None:
            record_fetch(target, remote, health)
        else:
            record(target)
    return True


def record_fetch(target: FetchTarget, remote: RemoteStore, health: RemoteHealth) -> None:
    """Record on the remote that ``target``'s chunk was fetched now (its ``used`` object: the
    last use ``kvsnap store prune URL`` goes by). A failure loses only that record."""
    try:
        remote.record_use(target.key)
    except Exception as error:
        health.failed(failure_kind(error), error, path=target.path)


def _publish(
    target: FetchTarget,
    data: bytes,
    local: LocalPublish,
    health: RemoteHealth,
    events: EventLog,
) -> bool:
    """Stage ``data``, check it as the chunk ``target``, publish it; whether it was published
    (``False``: it failed its check, or the store had no room or lock for it)."""
    store = local.store
    store.chunk_directory(target.path)  # opened below the root without following links
    staged = staged_path(target.path)
    _write_new(staged, data)
    try:
        record = local.checker.check(
            ChunkRef(str(staged), target.first_block, target.num_blocks),
            target.prompt,
            target.chain,
        )
        if isinstance(record, str):
            health.failed("invalid", f"{target.key}: {record}", path=target.path)
            return False
        if local.capacity is None:
            return _link_into_place(staged, Path(target.path))
        try:
            committed, removed = commit_within_capacity(
                store.root,
                staged,
                target.path,
                local.capacity,
                min_idle_s=local.min_idle_s,
                wait_s=LOCK_WAIT_S,
                shared=local.shared,
            )
        except CapacityLockError as error:
            health.failed("error", error, path=target.path)
            return False
        for entry in removed:
            events.emit(
                "evict",
                path=str(entry.path),
                bytes=entry.size,
                idle_s=round(entry.age(), 3),
                quarantined=entry.quarantined,
            )
        return committed
    finally:
        with contextlib.suppress(OSError):
            os.unlink(staged)  # gone already once committed or linked


def _write_new(path: Path, data: bytes) -> None:
    """Write ``data`` to the new file ``path`` (created exclusively, with the store's file
    mode) and ``fsync`` it; a failed write removes it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, publish.file_mode(str(path.parent)))
    try:
        publish.write_all(fd, data)
        os.fsync(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    finally:
        os.close(fd)


def _link_into_place(staged: Path, final: Path) -> bool:
    """Link the checked chunk at ``staged`` to its name ``final`` unless a chunk is there
    already (kept: a link never replaces); whether it is there now."""
    try:
        os.link(staged, final, follow_symlinks=False)
    except FileExistsError:
        return True
    publish.fsync_directory(str(final.parent))
    return True
