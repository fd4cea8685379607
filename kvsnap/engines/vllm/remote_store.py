"""The remote tier's objects: a prefix store's layout under an fsspec URL, read and written.

The remote tier holds the same chunks, under the same names, as a local store
(:class:`~kvsnap.engines.vllm.prefix_store.PrefixStore`)::

    URL/NAMESPACE/chunks/HH/KEY.safetensors   a chunk (single file), as a local store has it
    URL/NAMESPACE/used/HH/KEY                 empty: its last modification is the chunk's last
                                              fetch (LRU pruning reads it; no access time on
                                              an object store)

so engines of one model and identity (one namespace, the same store keys) share chunks, and
nothing else does. :class:`RemoteStore` reads a chunk in one request (one ``GET``), creates one
without ever replacing an object (:meth:`RemoteStore.create`: a conditional create,
``If-None-Match: *``, on object stores; a name already taken is a success) and records a
fetch (:meth:`RemoteStore.record_use`). An object store shows an object only once its upload
is complete, so a writer killed mid-upload leaves nothing visible; on a shared filesystem
(``file://``, a mount every node has) the chunk is written under a temporary name and linked
into place.

Credentials and endpoints come the library's standard way (for S3 through botocore: the
environment, ``~/.aws``, an instance role; ``AWS_ENDPOINT_URL_S3`` for MinIO or another
S3-compatible server), or from ``storage_options`` (the connector's ``remote_options``).

Nothing here needs vLLM.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
from collections.abc import Mapping
from typing import Any

from kvsnap.engines.vllm.identity import KEY_PATTERN
from kvsnap.engines.vllm.prefix_store import CHUNK_SUFFIX
from kvsnap.store import publish
from kvsnap.store.location import OBJECT_STORE_PROTOCOLS

#: The folders of a namespace on the remote tier.
CHUNKS = "chunks"
USED = "used"


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def remote_filesystem(
    url: str, storage_options: Mapping[str, Any] | None = None, *, timeout_s: float | None = None
) -> tuple[Any, str]:
    """The fsspec filesystem and root path of ``url``, an instance of its own (settings never
    leak between callers). On S3 (s3fs), unless ``storage_options`` say otherwise: connect and
    read timeouts of ``timeout_s`` and no retries (a failure is a miss, retried by the next
    request that needs the chunk, and an answer past the deadline is no use), when
    ``timeout_s`` is given; one ``GET`` per object (no ``HEAD`` first)."""
    import fsspec

    options: dict[str, Any] = {"skip_instance_cache": True, **dict(storage_options or {})}
    protocol = url.split("://", 1)[0]
    if protocol in ("s3", "s3a") and timeout_s is not None:
        config = {
            "connect_timeout": timeout_s,
            "read_timeout": timeout_s,
            "retries": {"total_max_attempts": 1},
            **dict(options.get("config_kwargs") or {}),
        }
        options["config_kwargs"] = config
    fs, root = fsspec.core.url_to_fs(url, **options)
    if protocol in ("s3", "s3a"):
        if timeout_s is not None:
            fs.retries = 1  # s3fs's own retry loop, on top of botocore's
        fs.max_concurrency = 1  # cat_file: one GET, not a HEAD for the size and ranged GETs
    return fs, root.rstrip("/")


class RemoteStore:
    """One namespace of the remote tier at ``url`` (:mod:`module notes <kvsnap.engines.vllm.
    remote_store>`)."""

    def __init__(
        self,
        url: str,
        namespace: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.url = url
        self.namespace = namespace
        self.fs, self.root = remote_filesystem(url, storage_options, timeout_s=timeout_s)
        protocols = _protocols(self.fs)
        self.object_store = any(protocol in OBJECT_STORE_PROTOCOLS for protocol in protocols)
        self.local = "file" in protocols or "local" in protocols

    def chunk_object(self, key: str) -> str:
        """The path (in :attr:`fs`) of the chunk whose last block's store key is ``key``."""
        if not KEY_PATTERN.fullmatch(key):
            raise ValueError(f"not a store key (64 hex digits): {key!r}")
        return f"{self.root}/{self.namespace}/{CHUNKS}/{key[:2]}/{key}{CHUNK_SUFFIX}"

    def used_object(self, key: str) -> str:
        """The path of the empty object whose last modification is the chunk's last fetch."""
        if not KEY_PATTERN.fullmatch(key):
            raise ValueError(f"not a store key (64 hex digits): {key!r}")
        return f"{self.root}/{self.namespace}/{USED}/{key[:2]}/{key}"

    def read(self, key: str) -> bytes:
        """The chunk ``key``'s bytes, in one request. Raises ``FileNotFoundError`` when it is
        not there, another exception (:func:`~kvsnap.engines.vllm.remote_health.failure_kind`
        names it) when the request fails."""
        return bytes(self.fs.cat_file(self.chunk_object(key)))

    def create(self, key: str, data: bytes) -> bool:
        """Create the chunk ``key`` with ``data`` unless the name is taken; whether it was
        created (``False``: another writer's chunk of that name is there, kept). Never
        replaces an object, never leaves a partial one visible."""
        name = self.chunk_object(key)
        if self.object_store:
            try:
                self.fs.pipe_file(name, data, mode="create")
            except FileExistsError:
                return False
            except OSError as error:
                if _conditional_conflict(error):
                    return False  # another conditional write of the name is under way
                raise
            return True
        if self.local:
            return _link_new(name, data)
        if self.fs.exists(name):
            return False
        # Another filesystem: a temporary name, then a move (a writer racing in between
        # replaces an equal chunk: both are this identity's KV for the same prefix).
        temp = posixpath.join(posixpath.dirname(name), publish.temp_name(posixpath.basename(name)))
        self.fs.pipe_file(temp, data)
        self.fs.mv(temp, name)
        return True

    def record_use(self, key: str) -> None:
        """Record a fetch of the chunk ``key`` now (its ``used`` object, rewritten empty)."""
        self.fs.pipe_file(self.used_object(key), b"")

    def probe(self) -> None:
        """Ask the remote for an object that is not there: returns if it answers (not found,
        or forbidden where listing is not allowed), raises if it cannot be reached."""
        try:
            self.fs.cat_file(f"{self.root}/{self.namespace}/.kvsnap-probe")
        except (FileNotFoundError, PermissionError):
            return


def _conditional_conflict(error: BaseException) -> bool:
    """Whether ``error`` is S3's 409 ``ConditionalRequestConflict`` (two conditional writes of
    one name at once: the other one is creating it)."""
    cause = error.__cause__
    response = getattr(cause, "response", None)
    if not isinstance(response, dict):
        return False
    return response.get("Error", {}).get("Code") == "ConditionalRequestConflict"


def _link_new(path: str, data: bytes) -> bool:
    """Write ``data`` under a locked temporary name beside the local ``path``, then link it
    into place unless ``path`` exists (``link`` never replaces); whether it was created."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, temp = publish.create_temp(path)
    try:
        publish.write_all(fd, data)
        os.fsync(fd)
        try:
            os.link(temp, path)
        except FileExistsError:
            return False
        publish.fsync_directory(os.path.dirname(path))
        return True
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        os.close(fd)
