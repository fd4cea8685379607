"""The remote tier's pieces, built from the connector's options.

:func:`check_remote_options` refuses, at the engine's start, a remote tier without a key (a
store many nodes write is a shared store: only signed chunks are trusted, as in a local
``shared_store``) or without the fsspec implementation its URL needs.
:func:`remote_fetcher` builds the scheduler's :class:`~kvsnap.engines.vllm.remote_fetch.
RemoteFetcher` and :func:`remote_uploader` a worker's :class:`~kvsnap.engines.vllm.
remote_upload.RemoteUploader`; each process has filesystem objects of its own (neither is
made before vLLM starts its processes). No network request is made here: the engine starts
whatever the remote's state (the fetcher's probe says what it is).

Nothing here needs vLLM.
"""

from __future__ import annotations

from kvsnap.engines.vllm.chunk_check import ChunkChecker
from kvsnap.engines.vllm.events import EventLog
from kvsnap.engines.vllm.options import ConnectorOptions
from kvsnap.engines.vllm.prefix_store import PrefixStore
from kvsnap.engines.vllm.remote_fetch import RemoteFetcher
from kvsnap.engines.vllm.remote_publish import LocalPublish
from kvsnap.engines.vllm.remote_store import RemoteStore
from kvsnap.engines.vllm.remote_upload import RemoteUploader
from kvsnap.format.signing import KeyRing

#: Connect and read timeouts of the uploads' requests: an upload carries a whole chunk, and
#: nothing waits for it.
UPLOAD_TIMEOUT_S = 30.0


def check_remote_options(options: ConnectorOptions, keys: KeyRing | None) -> None:
    """Refuse a remote tier without a signing key, or whose URL's filesystem is not installed
    (``ValueError``, naming what to do)."""
    if options.remote_url is None:
        return
    if keys is None:
        raise ValueError(
            f"KVSnapConnector: a remote tier ({options.remote_url}) needs a signing key "
            "(key_file or KVSNAP_KEY_FILE): every node that can write it could plant KV "
            "otherwise"
        )
    import fsspec

    protocol = options.remote_url.split("://", 1)[0]
    try:
        fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as error:
        raise ValueError(
            f"KVSnapConnector: remote_url {options.remote_url} needs fsspec's {protocol!r} "
            f"filesystem ({error}); for s3:// install kvsnap[s3] (s3fs)"
        ) from None


def remote_fetcher(
    options: ConnectorOptions,
    store: PrefixStore,
    checker: ChunkChecker,
    events: EventLog,
) -> RemoteFetcher | None:
    """The scheduler's remote lookups (``None`` without ``remote_url``). Fetched chunks are
    checked with ``checker``'s settings, every checksum verified, and published within
    ``store_capacity_bytes``."""
    if options.remote_url is None:
        return None
    remote = RemoteStore(
        options.remote_url,
        store.namespace,
        storage_options=options.remote_options,
        timeout_s=options.remote_deadline_s,
    )
    fetch_checker = ChunkChecker(
        checker.fingerprint,
        checker.expected_geometry,
        checker.block_size,
        verify=True,
        keys=checker.keys,
        remember=1,
    )
    local = LocalPublish(
        store=store,
        checker=fetch_checker,
        capacity=options.store_capacity_bytes,
        min_idle_s=options.store_min_idle_s,
        shared=options.shared_store,
        record_use=options.remote_writes,
    )
    return RemoteFetcher(
        remote,
        local,
        events,
        deadline_s=options.remote_deadline_s,
        fetches=options.remote_fetches,
    )


def remote_uploader(
    options: ConnectorOptions, store: PrefixStore, events: EventLog
) -> RemoteUploader | None:
    """A worker's uploads (``None`` unless ``remote_mode`` is ``read-write``)."""
    if options.remote_url is None or not options.remote_writes:
        return None
    remote = RemoteStore(
        options.remote_url,
        store.namespace,
        storage_options=options.remote_options,
        timeout_s=UPLOAD_TIMEOUT_S,
    )
    return RemoteUploader(
        remote,
        store,
        events,
        max_in_flight=options.remote_max_uploads,
        max_bytes=options.remote_max_upload_bytes,
    )
