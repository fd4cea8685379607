"""The connector's options: ``kv_connector_extra_config``, parsed and checked.

Nothing here needs vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsnap.engines.vllm.prefix_store import DEFAULT_CHUNK_BLOCKS
from kvsnap.format.signing import KeyRing
from kvsnap.store.files.keys import key_ring_from_environment, load_key_ring

MODES = ("persist", "dump", "persist+dump")

#: Every key :meth:`ConnectorOptions.from_extra_config` accepts.
KNOWN_OPTIONS = frozenset(
    {
        "path",
        "mode",
        "dump_requests",
        "dump_decode_step",
        "dump_path",
        "min_blocks",
        "event_log",
        "max_pending_writes",
        "chunk_blocks",
        "store_capacity_bytes",
        "store_min_idle_s",
        "verify_before_load",
        "key_file",
        "shared_store",
        "shutdown_drain_s",
        "compression",
        "remote_url",
        "remote_mode",
        "remote_options",
        "remote_deadline_s",
        "remote_fetches",
        "remote_max_uploads",
        "remote_max_upload_bytes",
    }
)
#: The values of the ``compression`` option.
COMPRESSIONS = ("none", "lossless", "fp8")

#: ``remote_mode`` values: fetch only, or fetch and upload.
REMOTE_MODES = ("read", "read-write")

#: The environment variable that sets how long vLLM waits for its workers to exit once it
#: told them to (vLLM's default: 5 s); the default bound of a worker's drain at shutdown.
VLLM_WORKER_WINDOW_ENV = "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"
VLLM_WORKER_WINDOW_DEFAULT_S = 5.0


@dataclass(frozen=True)
class ConnectorOptions:
    """``kv_connector_extra_config`` of :class:`~kvsnap.engines.vllm.KVSnapConnector`, checked.

    * ``path`` (required): the prefix store directory (``persist``) or dump directory (``dump``).
    * ``mode``: ``persist`` (default), ``dump`` or ``persist+dump``.
    * ``dump_requests``: ``"all"`` (default) or a list of request ids (the id given to vLLM;
      vLLM's internal id with its random suffix is accepted too). A request whose
      ``SamplingParams.extra_args`` holds ``{"kvsnap_dump": true}`` is dumped as well.
    * ``dump_decode_step``: 0 (default) dumps at the end of prefill; ``k`` once the cache holds
      the prompt and ``k`` generated tokens.
    * ``dump_path``: where dumps go (default: ``path``, or ``path/dumps`` in ``persist+dump``).
    * ``min_blocks``: prompts with fewer full blocks are not persisted (default 1). A request
      whose ``SamplingParams.extra_args`` holds ``{"kvsnap_persist": false}`` is not persisted.
    * ``event_log``: a JSON-lines file every process appends its hits, misses, loads, load
      failures, saves and dumps to (default: none; vLLM's log gets them either way).
    * ``max_pending_writes``: chunk and dump writes queued behind the engine before a step's
      saves wait for the oldest step's (default 64); bounds how long finished requests' blocks
      are held for their copies when the disk falls behind.
    * ``chunk_blocks``: blocks per stored chunk (default 16); prompts share stored chunks, so
      smaller chunks share more and cost more files.
    * ``store_capacity_bytes``: the store's bound in bytes (default: none); after each write
      the least recently used chunks are deleted until the store fits.
    * ``store_min_idle_s``: chunks used this recently are never evicted (default 10), since
      a worker may be about to load a chunk the scheduler just matched.
    * ``verify_before_load``: ``"auto"`` (default), ``true`` or ``false``: the scheduler
      verifies every checksum of a chunk (once per file) before offering it, so a damaged
      chunk is a miss instead of a failed load. ``auto`` turns it on unless
      ``kv_load_failure_policy`` is ``recompute`` (where vLLM recomputes failed loads).
    * ``key_file``: a key file (or a list of them; :mod:`kvsnap.store.files.keys`) to sign every
      chunk with and to check every chunk against: unsigned or badly signed chunks are misses.
      Default: the files ``KVSNAP_KEY_FILE`` names, else none (chunks are not signed).
    * ``shared_store``: ``false`` (default) refuses a store directory that other users may
      write or that another user owns; ``true`` accepts it (a deliberate multi-user store),
      and then requires a key.
    * ``shutdown_drain_s``: how long a worker's shutdown waits for the saves still queued
      (default: none, vLLM's own window for its workers, ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``,
      5 s unless set); the saves left after it are abandoned (``save_abandoned``), never
      half-published.
    * ``compression``: ``none`` (default), ``lossless`` or ``fp8``: chunks are stored as
      encoded snapshots (docs/format.md, "Encoded snapshots"; at TP 1: a TP > 1 engine stores
      them as captured); an fp8 chunk is about half the bytes, so a bound holds about twice the
      prefixes, and its hits decode on the host (CPU caches) or on the device (CUDA).
    * ``remote_url``: a remote tier under the local store, shared by many nodes (any fsspec
      URL: ``s3://bucket/prefix``, ``gs://...``; default none). It requires a key. A local
      miss is looked up there asynchronously and a hit fetched into the local store
      (:mod:`~kvsnap.engines.vllm.remote_fetch`); saves are uploaded after their local
      publish (:mod:`~kvsnap.engines.vllm.remote_upload`).
    * ``remote_mode``: ``read-write`` (default: fetch and upload) or ``read`` (fetch only).
    * ``remote_options``: fsspec storage options for ``remote_url`` (``endpoint_url``, a
      region...; credentials are best left to the library's own environment and config).
    * ``remote_deadline_s``: how long a request waits for its remote lookup (default 2): past
      it the chunks not fetched are a miss, and the request is computed.
    * ``remote_fetches``: remote fetches in flight at once (default 8).
    * ``remote_max_uploads``: uploads in flight at once (default 4).
    * ``remote_max_upload_bytes``: bytes of uploads queued or in flight (default 256 MiB); a
      save past it is not uploaded (``upload_skipped``).
    """

    path: str
    mode: str = "persist"
    dump_requests: tuple[str, ...] | None = None  # None: all requests
    dump_decode_step: int = 0
    dump_path: str | None = None
    min_blocks: int = 1
    event_log: str | None = None
    max_pending_writes: int = 64
    chunk_blocks: int = DEFAULT_CHUNK_BLOCKS
    store_capacity_bytes: int | None = None
    store_min_idle_s: float = 10.0
    verify_before_load: bool | None = None  # None: auto
    key_file: tuple[str, ...] = ()
    shared_store: bool = False
    shutdown_drain_s: float | None = None  # None: vLLM's window for its workers
    compression: str = "none"
    remote_url: str | None = None
    remote_mode: str = "read-write"
    remote_options: Mapping[str, Any] = field(default_factory=dict)
    remote_deadline_s: float = 2.0
    remote_fetches: int = 8
    remote_max_uploads: int = 4
    remote_max_upload_bytes: int = 256 << 20

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> ConnectorOptions:
        """Parse and check ``kv_connector_extra_config``; raise ``ValueError`` naming the key."""
        unknown = set(extra) - KNOWN_OPTIONS
        if unknown:
            raise ValueError(
                f"KVSnapConnector: unknown option(s) {sorted(unknown)}; "
                f"known: {sorted(KNOWN_OPTIONS)}"
            )
        if not extra.get("path"):
            raise ValueError("KVSnapConnector needs kv_connector_extra_config['path']")
        mode = str(extra.get("mode", "persist"))
        if mode not in MODES:
            raise ValueError(f"KVSnapConnector: mode must be one of {MODES}, got {mode!r}")
        dump_path = extra.get("dump_path")
        if dump_path is None:
            dump_path = (
                str(Path(extra["path"]) / "dumps") if mode == "persist+dump" else extra["path"]
            )
        return cls(
            path=str(extra["path"]),
            mode=mode,
            dump_requests=_dump_requests(extra.get("dump_requests", "all")),
            dump_decode_step=_integer(extra, "dump_decode_step", 0, minimum=0),
            dump_path=str(dump_path),
            min_blocks=_integer(extra, "min_blocks", 1, minimum=1),
            event_log=extra.get("event_log"),
            max_pending_writes=_integer(extra, "max_pending_writes", 64, minimum=1),
            chunk_blocks=_integer(extra, "chunk_blocks", DEFAULT_CHUNK_BLOCKS, minimum=1),
            store_capacity_bytes=(
                None
                if extra.get("store_capacity_bytes") is None
                else _integer(extra, "store_capacity_bytes", 0, minimum=0)
            ),
            store_min_idle_s=_seconds("store_min_idle_s", extra.get("store_min_idle_s", 10.0)),
            verify_before_load=_auto_flag(extra.get("verify_before_load", "auto")),
            key_file=_paths(extra.get("key_file")),
            shared_store=_flag(extra, "shared_store"),
            shutdown_drain_s=(
                None
                if extra.get("shutdown_drain_s") is None
                else _seconds("shutdown_drain_s", extra["shutdown_drain_s"])
            ),
            compression=_compression(extra.get("compression", "none")),
            **_remote_options(extra, mode),
        )

    def verifies_before_load(self, kv_load_failure_policy: str) -> bool:
        """Whether the scheduler verifies chunks before offering them, under vLLM's
        ``kv_load_failure_policy`` (``auto``: unless it is ``recompute``)."""
        if self.verify_before_load is None:
            return kv_load_failure_policy != "recompute"
        return self.verify_before_load

    def key_ring(self) -> KeyRing | None:
        """The signing keys: those of ``key_file``, else of the files ``KVSNAP_KEY_FILE``
        names, else ``None`` (chunks are neither signed nor required to be)."""
        if self.key_file:
            return load_key_ring(self.key_file)
        return key_ring_from_environment()

    def drain_bound_s(self, environment: Mapping[str, str]) -> float:
        """Seconds a worker's shutdown waits for its queued saves: ``shutdown_drain_s``, else
        the window vLLM gives its workers to exit (``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` in
        ``environment``, 5 s when unset or not a number)."""
        if self.shutdown_drain_s is not None:
            return self.shutdown_drain_s
        try:
            return max(float(environment[VLLM_WORKER_WINDOW_ENV]), 0.0)
        except (KeyError, ValueError):
            return VLLM_WORKER_WINDOW_DEFAULT_S

    @property
    def remote_writes(self) -> bool:
        """Whether saves are uploaded to the remote tier (and fetches recorded there)."""
        return self.remote_url is not None and self.remote_mode == "read-write"

    @property
    def persist(self) -> bool:
        """Whether prompt prefixes are persisted to and loaded from the store."""
        return self.mode in ("persist", "persist+dump")

    @property
    def dump(self) -> bool:
        """Whether requests are dumped as ordinary snapshots."""
        return self.mode in ("dump", "persist+dump")


def _remote_options(extra: Mapping[str, Any], mode: str) -> dict[str, Any]:
    """The ``remote_*`` options, checked (``{}`` without ``remote_url``)."""
    url = extra.get("remote_url")
    if url is None:
        given = sorted(key for key in extra if key.startswith("remote_"))
        if given:
            raise ValueError(f"KVSnapConnector: {given} need remote_url")
        return {}
    if not isinstance(url, str) or "://" not in url:
        raise ValueError(
            f"KVSnapConnector: remote_url must be a URL such as s3://bucket/prefix, got {url!r}"
        )
    if mode == "dump":
        raise ValueError("KVSnapConnector: remote_url needs a persist mode (a prefix store)")
    remote_mode = extra.get("remote_mode", "read-write")
    if remote_mode not in REMOTE_MODES:
        raise ValueError(
            f"KVSnapConnector: remote_mode must be one of {REMOTE_MODES}, got {remote_mode!r}"
        )
    storage = extra.get("remote_options") or {}
    if not isinstance(storage, Mapping) or not all(isinstance(k, str) for k in storage):
        raise ValueError(
            f"KVSnapConnector: remote_options must be a mapping of fsspec options, got {storage!r}"
        )
    deadline = _seconds("remote_deadline_s", extra.get("remote_deadline_s", 2.0))
    return {
        "remote_url": url.rstrip("/"),
        "remote_mode": remote_mode,
        "remote_options": dict(storage),
        "remote_deadline_s": deadline,
        "remote_fetches": _integer(extra, "remote_fetches", 8, minimum=1),
        "remote_max_uploads": _integer(extra, "remote_max_uploads", 4, minimum=1),
        "remote_max_upload_bytes": _integer(extra, "remote_max_upload_bytes", 256 << 20, minimum=0),
    }


def _dump_requests(requests: Any) -> tuple[str, ...] | None:
    """``dump_requests`` as a tuple of ids, or ``None`` for ``"all"``."""
    if requests == "all":
        return None
    if isinstance(requests, list | tuple) and all(isinstance(r, str) for r in requests):
        return tuple(requests)
    raise ValueError(
        f"KVSnapConnector: dump_requests must be 'all' or a list of ids, got {requests!r}"
    )


def _integer(extra: Mapping[str, Any], key: str, default: int, *, minimum: int) -> int:
    """The integer option ``key`` (``default`` when absent), at least ``minimum``."""
    raw = extra.get(key, default)
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"KVSnapConnector: {key} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"KVSnapConnector: {key} must be >= {minimum}, got {value}")
    return value


def _seconds(key: str, raw: Any) -> float:
    """The option ``key`` as a non-negative number of seconds."""
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"KVSnapConnector: {key} must be a number, got {raw!r}") from None
    if not value >= 0:  # NaN too
        raise ValueError(f"KVSnapConnector: {key} must be >= 0, got {value}")
    return value


def _paths(raw: Any) -> tuple[str, ...]:
    """``key_file``: one path or a list of paths (``()`` when absent)."""
    if raw is None:
        return ()
    if isinstance(raw, str) and raw:
        return (raw,)
    if isinstance(raw, list | tuple) and raw and all(isinstance(p, str) and p for p in raw):
        return tuple(raw)
    raise ValueError(f"KVSnapConnector: key_file must be a path or a list of paths, got {raw!r}")


def _flag(extra: Mapping[str, Any], key: str) -> bool:
    raw = extra.get(key, False)
    if isinstance(raw, bool):
        return raw
    raise ValueError(f"KVSnapConnector: {key} must be true or false, got {raw!r}")


def _auto_flag(raw: Any) -> bool | None:
    """``verify_before_load``: ``None`` for ``"auto"``, else the boolean given."""
    if raw == "auto":
        return None
    if isinstance(raw, bool):
        return raw
    raise ValueError(
        f"KVSnapConnector: verify_before_load must be 'auto', true or false, got {raw!r}"
    )


def _compression(raw: Any) -> str:
    if raw not in COMPRESSIONS:
        raise ValueError(f"KVSnapConnector: compression must be one of {COMPRESSIONS}, got {raw!r}")
    return str(raw)
